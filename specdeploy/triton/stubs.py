"""A server's python-backend stub processes: which run under it, which went away since it was ready, and what a
server that is gone left behind (stubs still running, shared-memory regions), removed by `reap`."""

from __future__ import annotations

import os
from pathlib import Path

from specdeploy.triton import shm
from specdeploy.triton.server_state import ServerState

STUB_BINARY = "triton_python_backend_stub"


def python_stubs(server_pid: int) -> dict[str, int]:
    """Python-backend instance name (`tensorrt_llm_0_0`) -> pid of its stub process under the server. The stub's
    command line ends with the instance name and the kind (`... tensorrt_llm_0_0 DEFAULT`)."""
    import psutil

    out = {}
    try:
        children = psutil.Process(server_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for child in children:
        try:
            cmd = child.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if len(cmd) >= 3 and os.path.basename(cmd[0]) == STUB_BINARY:
            out[cmd[-2]] = child.pid
    return out


DEAD_STUB = "has exited (killed or crashed)"  # how stub_changes says a stub died (server.status_code reads it)


def stub_changes(state: ServerState) -> str:
    """What happened to the python stubs since the server was ready. tritonserver 2.51's python backend does not
    restart a stub that died: the server stays ready and each request to that instance fails with "Stub process
    '<instance>' is not healthy" (libtriton_python.so of the nvidia-pytriton 0.7.0 wheel has that message and no
    restart path), so a dead stub is said here with the fix."""
    if not state.stubs:
        return ""
    now = python_stubs(state.pid)
    gone = sorted(name for name, pid in state.stubs.items() if now.get(name) != pid)
    if not gone:
        return f"; {len(now)} python stubs alive"
    restarted = [f"{name} (pid {state.stubs[name]} -> {now[name]})" for name in gone if name in now]
    dead = [f"{name} (pid {state.stubs[name]})" for name in gone if name not in now]
    parts = []
    if dead:
        parts.append(
            f"python stub {', '.join(dead)} {DEAD_STUB}; tritonserver does not restart it and "
            "requests to that instance fail with 'Stub process ... is not healthy': restart the server "
            "(specdeploy stop RECIPE, then specdeploy serve RECIPE --detach)"
        )
    if restarted:
        parts.append(f"python stub restarted: {', '.join(restarted)}")
    return "; " + "; ".join(parts)


def _orphans(state: ServerState) -> tuple[list, list[Path]]:
    """(stub processes, shared-memory regions) a server that is gone left behind. tritonserver 2.51's python stubs
    outlive a SIGKILLed server (seen: some still running a minute later, each holding its model and its region). Its
    stubs are found by the region prefix their command line names (a prefix is unique to one server)."""
    import psutil

    prefixes = shm.prefixes_in(state.cmdline or ())
    stubs = []
    for proc in psutil.process_iter(["cmdline"]) if prefixes else ():
        cmd = proc.info.get("cmdline") or []
        if cmd and os.path.basename(cmd[0]) == STUB_BINARY and any(p in arg for p in prefixes for arg in cmd):
            stubs.append(proc)
    return stubs, [path for prefix in prefixes for path in shm.SHM_DIR.glob(prefix + "*")]


def orphans_line(state: ServerState) -> str:
    stubs, regions = _orphans(state)
    if not (stubs or regions):
        return ""
    return (
        f"; it left {len(stubs)} python stubs running and {len(regions)} shared-memory regions "
        "(specdeploy stop, or the next serve, removes them)"
    )


def reap(state: ServerState) -> str:
    """After a server that exited by itself (or was killed): stop its stubs still running and remove its shared-memory
    regions (see _orphans)."""
    import psutil

    stubs, _ = _orphans(state)
    for proc in stubs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(stubs, timeout=10)
    removed = sum(shm.remove(prefix) for prefix in shm.prefixes_in(state.cmdline or ()))
    said = [f"stopped {len(stubs)} python stubs it left"] if stubs else []
    said += [f"removed {removed} shared-memory regions it left"] if removed else []
    return "; " + ", ".join(said) if said else ""
