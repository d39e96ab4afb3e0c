"""The python backend's shared-memory regions: named per server, removed when the server stops.

Every python-backend model instance talks to its stub through a POSIX shared-memory region in /dev/shm
(64 MiB here, see server.STUB_SHM_BYTES). tritonserver removes them when it shuts down cleanly, but a server
or stub killed mid-way (the SIGKILL after --exit-timeout-secs, a crashed test run) leaves them behind, and
tmpfs keeps their pages in memory: on the machine this project is developed on, a day of test runs left
19 GiB of a 24 GiB /dev/shm taken, and a later server's stubs then hung while starting.

So each server gets its own region name prefix (`specdeploy_<token>_`, the backend's shm-region-prefix-name),
its regions are removed after it stops, and a start removes those of servers no process runs any more.
`specdeploy doctor` counts the python-backend regions no process uses (any Triton's, any prefix: each stub
names its region on its command line) and `doctor --clean-shm` removes them.
"""

from __future__ import annotations

import re
import secrets
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "specdeploy_"
TRITON_DEFAULT = "triton_python_backend_shm_region_"  # the backend's own prefix, when none is given
_OPTION = "shm-region-prefix-name="
_OURS = re.compile(rf"^({PREFIX}[0-9a-f]+_)")


def new_prefix() -> str:
    return f"{PREFIX}{secrets.token_hex(6)}_"


def backend_arg(prefix: str) -> str:
    return f"--backend-config=python,{_OPTION}{prefix}"


def prefixes_in(cmdline: tuple[str, ...] | list[str]) -> list[str]:
    """This project's region prefixes named in a tritonserver command line."""
    found = [arg.split(_OPTION, 1)[1] for arg in cmdline if _OPTION in arg]
    return [prefix for prefix in found if _OURS.match(prefix)]


def remove(prefix: str, directory: Path | None = None) -> int:
    """Remove the regions of the server that used `prefix` (call once it has exited); how many were left."""
    if not _OURS.match(prefix):
        return 0
    return len(_unlink(list((directory or SHM_DIR).glob(prefix + "*"))))


def remove_orphaned(directory: Path | None = None) -> int:
    """Remove this project's regions whose server no process runs: neither the server nor one of its stubs
    (a stub's command line names its region) has the prefix in its command line any more. No age is needed:
    the server's command line names the prefix before any region exists."""
    return len(_unlink([path for path in unused(directory, min_age_s=0) if _OURS.match(path.name)]))


def remove_unused(directory: Path | None = None) -> tuple[int, int]:
    """Remove the regions `unused()` lists; (how many, the bytes tmpfs held for them)."""
    left = unused(directory)
    held = tmpfs_bytes(left)
    return len(_unlink(left)), held


def tmpfs_bytes(regions: list[Path]) -> int:
    """What tmpfs holds for these regions (pages touched), not their nominal size."""
    total = 0
    for path in regions:
        try:
            total += path.stat().st_blocks * 512
        except OSError:
            pass
    return total


def _unlink(paths: list[Path]) -> list[Path]:
    for path in paths:
        path.unlink(missing_ok=True)
    return paths


def unused(directory: Path | None = None, min_age_s: float = 60.0) -> list[Path]:
    """Python-backend regions (ours, or tritonserver's default `triton_python_backend_shm_region_` ones) that no
    live process names on its command line and that are older than `min_age_s` (a server creates a region just
    before it starts the stub that names it)."""
    try:
        candidates = [
            path
            for path in (directory or SHM_DIR).iterdir()
            if _OURS.match(path.name) or path.name.startswith(TRITON_DEFAULT)
        ]
    except OSError:
        return []
    if not candidates:
        return []
    live, now = _live_command_lines(), time.time()
    return [path for path in candidates if now - _mtime(path, now) >= min_age_s and not _in_use(path, live)]


def _in_use(region: Path, live: str) -> bool:
    """Ours: while a process (server or stub) names its server's prefix. Another Triton's: while its stub names it."""
    ours = _OURS.match(region.name)
    return (ours.group(1) if ours else region.name) in live


def _mtime(path: Path, default: float) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return default


def _live_command_lines() -> str:
    import psutil

    return "\n".join(" ".join(proc.info.get("cmdline") or ()) for proc in psutil.process_iter(["cmdline"]))
