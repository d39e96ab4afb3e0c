"""How the benchmarks configure llama.cpp (bench/llama_cpp.py): -march=native, or on a CPU whose AMX code dies with
SIGILL, the instruction sets it lists one by one without AMX, in a build folder of its own."""

from __future__ import annotations

import bench_modules

llama_cpp = bench_modules.load("llama_cpp")

XEON = {
    "sse4_2",
    "f16c",
    "fma",
    "bmi2",
    "avx",
    "avx2",
    "avx_vnni",
    "avx512f",
    "avx512cd",
    "avx512vl",
    "avx512dq",
    "avx512bw",
    "avx512vbmi",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
}
EPYC = {"sse4_2", "f16c", "fma", "bmi2", "avx", "avx2"}


def test_native_unless_amx_is_ruled_out_on_a_cpu_that_lists_it():
    assert llama_cpp.cmake_options(XEON) == ("build", llama_cpp.CMAKE_OPTIONS)
    assert llama_cpp.cmake_options(EPYC, amx=False) == ("build", llama_cpp.CMAKE_OPTIONS)  # nothing to rule out
    folder, options = llama_cpp.cmake_options(XEON, amx=False)
    assert folder == "build-noamx" and "-DGGML_NATIVE=OFF" in options and "-DGGML_NATIVE=ON" not in options
    on = {o.split("=")[0][2:] for o in options if o.endswith("=ON") and o.startswith("-DGGML_")}
    assert on == {
        "GGML_SSE42",
        "GGML_F16C",
        "GGML_FMA",
        "GGML_BMI2",
        "GGML_AVX",
        "GGML_AVX2",
        "GGML_AVX_VNNI",
        "GGML_AVX512",
        "GGML_AVX512_VBMI",
        "GGML_AVX512_VNNI",
        "GGML_AVX512_BF16",
    }
    assert not any("AMX" in o for o in options)
    assert "-DLLAMA_CURL=OFF" in options and "-DCMAKE_BUILD_TYPE=Release" in options


def test_avx512_needs_all_five_subsets():
    _, options = llama_cpp.cmake_options((XEON - {"avx512dq"}), amx=False)
    assert "-DGGML_AVX512=OFF" in options and "-DGGML_AVX2=ON" in options


def test_llama_bench_runs_without_the_passive_openmp_wait_set_for_specdeploys_side(tmp_path, monkeypatch):
    """bench/kernels.py sets OMP_WAIT_POLICY=PASSIVE for the engine (as served); llama-bench, passive, decoded at a
    third of its speed. A stand-in llama-bench reports, as its tokens/s, whether it saw the variable."""
    fake = tmp_path / "llama-bench"
    fake.write_text(
        '#!/bin/sh\nif [ -n "$OMP_WAIT_POLICY" ]; then ts=1; else ts=2; fi\n'
        'echo "[{\\"n_prompt\\": 64, \\"n_gen\\": 0, \\"avg_ts\\": $ts}]"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("SPECDEPLOY_PEER_PROBE", "kept")
    env = llama_cpp.peer_env(LLAMA_TRACE="1")
    assert "OMP_WAIT_POLICY" not in env and env["SPECDEPLOY_PEER_PROBE"] == "kept" and env["LLAMA_TRACE"] == "1"
    kernels = bench_modules.load("kernels")
    numbers = kernels.llama_numbers(fake, {"q8_0": tmp_path / "model.gguf"}, threads=2)
    assert numbers["q8_0"]["pp64"] == 2.0


def test_a_llama_bench_run_that_dies_with_sigill_reruns_on_the_build_without_amx(tmp_path, monkeypatch):
    """The depth prefill of `decode_turns` (llama-bench -d 200) takes the prompt path whose AMX code dies with SIGILL
    on the Xeon VMs: the run is repeated on the build without AMX, which later rounds then use directly."""
    native = tmp_path / "native-llama-bench"
    native.write_text("#!/bin/sh\nkill -ILL $$\n")
    noamx = tmp_path / "noamx-llama-bench"
    noamx.write_text(
        '#!/bin/sh\necho "[{\\"n_prompt\\": 0, \\"n_gen\\": 64, \\"n_depth\\": 200, \\"avg_ts\\": 3.5}]"\n'
    )
    for f in (native, noamx):
        f.chmod(0o755)
    kernels = bench_modules.load("kernels")
    asked = []
    monkeypatch.setattr(kernels.llama_cpp, "binary", lambda target, amx=True: asked.append((target, amx)) or noamx)
    rows, used = kernels.run_llama_bench(native, ["-m", "model.gguf", "-n", "64", "-d", "200"], "q8_0 tg64")
    assert rows[0]["avg_ts"] == 3.5 and used == noamx and asked == [("llama-bench", False)]
    rows, used = kernels.run_llama_bench(noamx, ["-m", "model.gguf"], "q8_0 tg64")
    assert used == noamx and len(asked) == 1  # no second fallback
