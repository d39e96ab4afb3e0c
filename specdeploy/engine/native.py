"""Native kernels for bf16 CPU engines (csrc/cpu_kernels.cpp), compiled once per machine and torch.

`ops()` builds the extension on first use into $SPECDEPLOY_HOME/native/<key> (about a minute; later
processes load it in milliseconds) and returns `torch.ops.specdeploy_cpu`, or None where it cannot be
used: set SPECDEPLOY_NATIVE=0, a CPU with neither AVX-512 nor AVX2 + FMA, or no C++ compiler. The engine then
runs the same model on torch ops: slower, with the same parity guarantee (both paths are row-invariant).

The native linear fuses each format's input quantization, the GEMV and the output scaling, bias and residual into one
call, because torch's weight-only kernels stream the weights well below a plain read's bandwidth (docs/stages.md
"Why native kernels").
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path

import torch

from specdeploy.core import artifacts

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
# INT8 SmoothQuant on integer dot products (issue 25), one extension with cpu_kernels.cpp; int8_gemv.inc is its
# per-instruction-set body.
INT8_SOURCE = Path(__file__).parent / "csrc" / "int8_kernels.cpp"
SOURCES = (
    SOURCE,
    INT8_SOURCE,
    Path(__file__).parent / "csrc" / "int8_gemv.inc",
    Path(__file__).parent / "csrc" / "step_team.h",
    Path(__file__).parent / "csrc" / "exact_float.h",
)
DISABLE_ENV = "SPECDEPLOY_NATIVE"  # "0": always use the torch path
# The kernels are built for the CPU that loads them (-march=native, one build folder per CPU feature set):
# the 16-lane AVX-512 variant where the CPU has AVX-512F, else the 8-lane AVX2 + FMA one. "0" forces the AVX2 variant on
# an AVX-512 CPU (to compare the two).
AVX512_ENV = "SPECDEPLOY_NATIVE_AVX512"
# The int8 SmoothQuant kernels are compiled for every instruction set into the one binary and one variant is
# picked per engine load from the CPU's flags (`int8_variant`): AVX512-VNNI, else AVX-VNNI, else AVX2. "0"
# forces the AVX2 variant (VPMADDWD) on a VNNI CPU; SPECDEPLOY_NATIVE_AVX512=0 rules out the 512-bit one.
VNNI_ENV = "SPECDEPLOY_NATIVE_VNNI"
# bf16 weights on AVX-512: "pairs" splits each bf16 pair into two f32 vectors (two integer instructions per 32
# weights) and multiplies with FMA; "dpbf16" uses VDPBF16PS where the CPU has AVX512-BF16. Both give the same bits
# (each lane adds its odd, then its even product, exact in f32: tested). "auto" (the default) takes the one measured
# faster on the CPU's maker: pairs on Intel, VDPBF16PS elsewhere (docs/stages.md "Why native kernels").
BF16_ENV = "SPECDEPLOY_NATIVE_BF16"

# Weight kinds of the native linear (csrc: WeightKind).
BF16, FP8, INT8, INT4, INT8_SQ = 0, 1, 2, 3, 4
# Variants of the int8 SmoothQuant kernel (csrc/int8_kernels.cpp: Variant).
INT8_AVX2, INT8_AVX_VNNI, INT8_AVX512_VNNI = 0, 1, 2
INT8_VARIANT_NAMES = {INT8_AVX2: "avx2", INT8_AVX_VNNI: "avx-vnni", INT8_AVX512_VNNI: "avx512-vnni"}


@functools.cache
def ops():
    """torch.ops.specdeploy_cpu, built and loaded on first use; None where the native path is unavailable."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    if not cpu_supported():
        return None
    try:
        _load()
    except Exception as exc:  # no compiler, no ninja, a failing build: the torch path still works
        warnings.warn(f"specdeploy: native CPU kernels unavailable, using torch ops ({str(exc).splitlines()[0]})")
        return None
    return torch.ops.specdeploy_cpu


@contextlib.contextmanager
def standing_team(native_ops):
    """Every native parallel loop inside the block on one team of helper threads (csrc/step_team.h `Standing`): the
    helpers are woken once for the block, not once per loop (each OpenMP region wakes a sleeping thread under the
    served stubs' OMP_WAIT_POLICY=PASSIVE). `native_ops`: ops() or None (then nothing changes). The bits are the
    same either way: which thread computes a chunk changes none."""
    opened = native_ops is not None and bool(native_ops.team_open())
    try:
        yield
    finally:
        if opened:
            native_ops.team_close()


def cpu_supported() -> bool:
    """Whether this CPU runs the kernels: AVX-512 (16-lane build) or AVX2 + FMA (8-lane build); torch reports AVX2 only
    where FMA is present too."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512", "AMX")


def build_dir() -> Path:
    """One folder per source, torch, Python and CPU feature set: the build uses -march=native, so a home folder
    shared by machines with different CPUs must not hand one of them another's binary."""
    source = b"\0".join(path.read_bytes() for path in SOURCES)
    parts = [
        source,
        torch.__version__.encode(),
        platform.machine().encode(),
        sys.version.split()[0].encode(),
        _cpu_flags().encode(),
        " ".join(_cflags()).encode(),
    ]
    return artifacts.home() / "native" / hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _cpuinfo_line(key: str) -> str | None:
    """The first line of /proc/cpuinfo starting with `key`, or None."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(key)), None)
    except OSError:
        return None


def _cpu_flags() -> str:
    return _cpuinfo_line("flags") or platform.processor()


def _cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD), or "" where there is none."""
    line = _cpuinfo_line("vendor_id")
    return line.split(":", 1)[1].strip() if line else ""


def _cpu_flag_set() -> set[str]:
    line = _cpu_flags()
    return set(line.split(":", 1)[1].split()) if ":" in line else set(line.split())


def isa() -> str:
    """The instruction set the kernels are built for on this CPU: `avx512-bf16`, `avx512` or `avx2`. Chosen from
    the CPU's own flags when the engine loads, so a build cached for another CPU is never used here (the build
    folder's key holds the flags)."""
    flags = _cpu_flag_set()
    if "avx512f" in flags and os.environ.get(AVX512_ENV, "1") != "0":
        return "avx512-bf16" if "avx512_bf16" in flags else "avx512"
    return "avx2"


def bf16_native() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX tiles or AVX512-BF16), where torch's bf16 matmuls (oneDNN)
    run several times faster than fp32; on AVX2-only CPUs they are emulated and slower."""
    return bool({"amx_bf16", "avx512_bf16"} & _cpu_flag_set())


def int8_variant() -> int:
    """The int8 SmoothQuant kernel variant for this CPU (INT8_AVX2, INT8_AVX_VNNI or INT8_AVX512_VNNI), from its own
    flags when the engine loads; every variant gives the same bits (integer sums), only the speed differs."""
    flags = _cpu_flag_set()
    if os.environ.get(VNNI_ENV, "1") == "0":
        return INT8_AVX2
    if {"avx512_vnni", "avx512bw"} <= flags and os.environ.get(AVX512_ENV, "1") != "0":
        return INT8_AVX512_VNNI
    if "avx_vnni" in flags:
        return INT8_AVX_VNNI
    return INT8_AVX2


def _cflags() -> list[str]:
    flags = ["-O3", "-march=native", "-fopenmp"]
    if not isa().startswith("avx512"):
        flags.append("-mno-avx512f")  # turns off every AVX-512 extension -march=native enabled
    elif bf16_kernel() == "dpbf16":
        flags.append("-DSPECDEPLOY_BF16_DPBF16")
    return flags


def bf16_kernel() -> str:
    """How the native kernels multiply bf16 weights here: `dpbf16` (VDPBF16PS, on an AVX512-BF16 CPU not made by
    Intel, or asked for by SPECDEPLOY_NATIVE_BF16), `pairs` (AVX-512: bf16 pairs split into f32, FMA) or `f32`
    (AVX2: widened, FMA). See BF16_ENV for why the maker decides."""
    if not isa().startswith("avx512"):
        return "f32"
    wanted = os.environ.get(BF16_ENV, "auto")
    if wanted not in ("auto", "pairs", "dpbf16"):
        raise ValueError(f"{BF16_ENV}={wanted!r}: expected auto, pairs or dpbf16")
    if isa() != "avx512-bf16":
        return "pairs"
    if wanted == "auto":
        return "pairs" if _cpu_vendor() == "GenuineIntel" else "dpbf16"
    return wanted


def _load() -> None:
    import ninja  # the build tool torch's extension loader runs; its binary may not be on PATH (a bare venv)
    from torch.utils.cpp_extension import load

    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    directory = build_dir()
    if not any(directory.glob("*.so")):
        print(
            f"compiling native CPU kernels into {directory} (once per machine, about a minute)",
            file=sys.stderr,
            flush=True,
        )
    directory.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory):
        load(
            name="specdeploy_cpu",
            sources=[str(SOURCE), str(INT8_SOURCE)],
            extra_cflags=_cflags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )


BUILD_LOCK = ".specdeploy-build.lock"
TORCH_BATON = "lock"  # torch.utils.cpp_extension._jit_compile's FileBaton(os.path.join(build_directory, "lock"))


@contextlib.contextmanager
def _build_lock(directory: Path):
    """Serialize the kernels' build and load across processes with an OS lock (flock, released by the kernel when its
    holder dies), and inside it remove torch's own build baton if one is there: torch 2.13's FileBaton is a file
    created with O_EXCL that a process killed mid-build (SIGKILL, OOM, a stopped server's python stub) never removes,
    after which every later load waits for it forever (pytorch/pytorch#189245; upstream fix #190543 replaces it with a
    FileLock). Under our lock no other specdeploy process is building in this folder, so a baton there is stale."""
    import fcntl

    with open(directory / BUILD_LOCK, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            baton = directory / TORCH_BATON
            if baton.exists():
                print(
                    f"removing {baton}: left by a kernel build that was killed (pytorch/pytorch#189245)",
                    file=sys.stderr,
                    flush=True,
                )
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
