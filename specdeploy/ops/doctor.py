"""`specdeploy doctor`: one line per thing this machine has or lacks for each backend."""

from __future__ import annotations

import importlib.util
import platform
import shutil
import socket
import sys

from specdeploy.core import artifacts


def _line(ok: bool | None, what: str, detail: str) -> str:
    mark = {True: "ok  ", False: "no  ", None: "--  "}[ok]
    return f"{mark}{what:18s} {detail}"


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _free_port() -> int | None:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    except OSError:
        return None


def _server_line() -> str:
    try:
        from specdeploy.triton import install
    except ImportError:
        return _line(None, "tritonserver", "server support not installed")
    found = install.find_binary(fetch=False)
    if found is None:
        return _line(
            False, "tritonserver", "not found yet (specdeploy serve fetches it from the nvidia-pytriton wheel)"
        )
    return _line(True, "tritonserver", str(found))


def _native_line() -> str:
    from specdeploy.engine import lm_screen, native

    if not native.cpu_supported():
        return _line(
            False, "native kernels", "this CPU has neither AVX-512 nor AVX2 + FMA: CPU engines run on torch ops"
        )
    int8 = native.INT8_VARIANT_NAMES[native.int8_variant()]
    return _line(
        True,
        "native kernels",
        f"{native.isa()}, bf16 {native.bf16_kernel()}, int8 {int8}, greedy LM screen "
        f"{lm_screen.default_kind()} (chosen from this CPU's flags; built on first use)",
    )


def _shm_line() -> str:
    """/dev/shm room, and the Triton python-backend regions that no process uses (left by killed servers)."""
    from specdeploy.triton import shm

    try:
        usage = shutil.disk_usage(shm.SHM_DIR)
    except OSError:
        return _line(None, "shared memory", f"no {shm.SHM_DIR}")
    left = shm.unused()
    if not left:
        return _line(True, "shared memory", f"{shm.SHM_DIR}: {usage.free / 2**30:.1f} GiB free")
    size = shm.tmpfs_bytes(left) / 2**30
    return _line(
        False,
        "shared memory",
        f"{shm.SHM_DIR}: {usage.free / 2**30:.1f} GiB free; {len(left)} Triton python-backend "
        f"regions ({size:.1f} GiB) that no process uses: remove them with `specdeploy doctor --clean-shm`",
    )


def clean_shm() -> str:
    from specdeploy.triton import shm

    removed, held = shm.remove_unused()
    return f"removed {removed} unused Triton python-backend regions from {shm.SHM_DIR} ({held / 2**30:.1f} GiB)"


def gpu_lines(gpus=None) -> list[str]:
    """GPUs, compute capability, memory, TensorRT-LLM, trtllm-build, and which backends this machine can run."""
    from specdeploy.core import backends
    from specdeploy.core import gpus as gpu_probe

    gpus = gpu_probe.probe() if gpus is None else gpus
    version = gpu_probe.tensorrt_llm_version()
    tool = shutil.which("trtllm-build")
    if not gpus:
        lines = [_line(None, "GPU", "none found (nvidia-smi/torch.cuda); GPU backends can only dry-run here")]
    else:
        lines = []
        for g in gpus:
            cc = "?" if g.compute_capability is None else "{}.{}".format(*g.compute_capability)
            fp8 = g.compute_capability is not None and g.compute_capability >= (8, 9)
            lines.append(
                _line(
                    True,
                    f"GPU {g.index}",
                    f"{g.name}, {g.memory_gib:.1f} GiB, compute capability {cc}"
                    f"{'' if fp8 else ' (no FP8: needs 8.9+)'}",
                )
            )
    lines.append(_line(version is not None, "tensorrt_llm", version or "not installed"))
    lines.append(_line(tool is not None, "trtllm-build", tool or "not on PATH (TensorRT-LLM <= 1.1 ships it)"))
    usable = [b.name for b in backends.ALL if b.usable(gpus, version, tool is not None)]
    lines.append(_line(True, "usable backends", ", ".join(usable)))
    return lines


def report_lines() -> list[str]:
    torch_version = _version("torch")
    lines = [
        _line(sys.version_info >= (3, 10), "python", f"{platform.python_version()} ({sys.executable})"),
        _line(torch_version is not None, "torch", torch_version or "not installed (make setup)"),
        _native_line(),
        *gpu_lines(),
        _line(_version("nvidia-modelopt") is not None, "modelopt", _version("nvidia-modelopt") or "not installed"),
        _line(
            importlib.util.find_spec("tritonclient") is not None, "tritonclient", _version("tritonclient") or "missing"
        ),
        _server_line(),
        _shm_line(),
    ]
    port = _free_port()
    lines.append(
        _line(port is not None, "free ports", f"loopback port {port} was free" if port else "cannot bind 127.0.0.1")
    )
    home = artifacts.home()
    usage = shutil.disk_usage(home if home.exists() else home.parent if home.parent.exists() else "/")
    lines.append(_line(True, "cache dir", f"{home} ({usage.free / 2**30:.1f} GiB free)"))
    return lines
