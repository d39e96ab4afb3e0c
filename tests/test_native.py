"""The native kernels of bf16 engines (specdeploy/engine/csrc/cpu_kernels.cpp): each weight format against
torch's own ops, row invariance (the bits of a row never depend on how many rows a call has), exact FP8
conversions, and the native engine against the torch-op engine."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from specdeploy.engine import native
from specdeploy.engine.kernels import FP8_MAX, pack_int4
from specdeploy.engine.model import CpuEngine

if not native.cpu_supported():
    pytest.skip(
        "the native kernels need AVX-512 or AVX2 + FMA; the engine uses torch ops here", allow_module_level=True
    )
if os.environ.get(native.DISABLE_ENV) == "0":
    pytest.skip(f"{native.DISABLE_ENV}=0 switches the native kernels off", allow_module_level=True)

OPS = native.ops()
N, K = 70, 96  # N % 4 != 0: blocks of four channels and single-channel tails; K % 32 == 0


def test_native_kernels_load_on_this_cpu():
    assert OPS is not None, "a supported CPU but the extension did not build: see the warning above"


def _x(rows=9, k=K, seed=0):
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _formats():
    """kind -> (weight as stored, linear kwargs, f32 reference y(x))."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(N, K, generator=g) * 0.1
    bf16 = w.to(torch.bfloat16)
    fp8 = (w * 20).to(torch.float8_e4m3fn)
    int8 = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    unsigned = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    scale = torch.rand(N, generator=g) * 0.01 + 1e-3
    group_scale = (torch.rand(N, K // 32, generator=g) * 0.01 + 1e-3).to(torch.bfloat16).float()
    pqs = (torch.rand(K, generator=g) + 0.5).to(torch.bfloat16).float()
    act = 0.02

    def fp8_act(x):
        return (x.float() / act).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()

    return {
        "bf16": (native.BF16, bf16, {}, lambda x: x.float() @ bf16.float().t()),
        "fp8": (
            native.FP8,
            fp8.view(torch.uint8),
            dict(act_scale=act, out_scale=scale),
            lambda x: (fp8_act(x) @ fp8.float().t()) * scale,
        ),
        "int8": (native.INT8, int8, dict(out_scale=scale), lambda x: (x.float() @ int8.float().t()) * scale),
        "int4": (
            native.INT4,
            pack_int4(unsigned),
            dict(group_scale=group_scale, group_size=32, pre_quant_scale=pqs),
            lambda x: (
                (x * pqs.to(torch.bfloat16)).float()
                @ ((unsigned.float() - 8) * group_scale.repeat_interleave(32, dim=1)).t()
            ),
        ),
    }


def _linear(
    kind,
    packed,
    x,
    group_scale=None,
    group_size=0,
    pre_quant_scale=None,
    act_scale=0.0,
    out_scale=None,
    bias=None,
    residual=None,
):
    return OPS.linear(
        x, packed, kind, N, group_scale, group_size, pre_quant_scale, act_scale, out_scale, bias, residual
    )


@pytest.mark.parametrize("name", ["bf16", "fp8", "int8", "int4"])
def test_linear_matches_torch_reference_and_is_row_invariant(name):
    kind, weight, kwargs, reference = _formats()[name]
    packed = OPS.pack(weight.contiguous(), kind, K)
    x = _x()
    y = _linear(kind, packed, x, **kwargs)
    ref = reference(x)
    assert y.dtype == torch.bfloat16 and y.shape == (9, N)
    assert ((y.float() - ref).abs() <= 0.01 * ref.abs() + 0.02 * ref.abs().mean()).all()
    for rows in range(1, 10):  # 4-row, 2-row and 1-row blocks: the same bits per row
        assert torch.equal(_linear(kind, packed, x[:rows].contiguous(), **kwargs), y[:rows]), rows


def test_linear_epilogue_bias_and_residual():
    kind, weight, _, reference = _formats()["bf16"]
    packed = OPS.pack(weight, kind, K)
    x, bias, residual = _x(3), torch.randn(N), torch.randn(3, N).to(torch.bfloat16)
    y = _linear(kind, packed, x, bias=bias, residual=residual)
    plain = (reference(x) + bias).to(torch.bfloat16)
    assert ((y.float() - (residual + plain).float()).abs() <= 0.02 * y.float().abs() + 0.05).all()


def test_fp8_weights_decode_exactly_for_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # the two NaN codes
    weights = codes.view(-1, 1).expand(-1, 16).contiguous()  # [254, 16]: code c in every column
    packed = OPS.pack(weights, native.FP8, 16)
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    x[0, 0] = 1.0
    y = OPS.linear(x, packed, native.FP8, len(codes), None, 0, None, 0.0, None, None, None)
    assert torch.equal(y[0], codes.view(torch.float8_e4m3fn).float().to(torch.bfloat16))


def test_fp8_activation_quantization_is_torchs():
    eye = torch.eye(64).to(torch.float8_e4m3fn).view(torch.uint8).contiguous()
    packed = OPS.pack(eye, native.FP8, 64)
    g = torch.Generator().manual_seed(3)
    for act in (1.0, 0.01, 3.7):
        x = (torch.randn(8, 64, generator=g) * torch.logspace(-5, 3, 64)).to(torch.bfloat16)  # subnormal to clamped
        y = OPS.linear(x, packed, native.FP8, 64, None, 0, None, act, None, None, None)
        expected = (x.float() / act).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float().to(torch.bfloat16)
        assert torch.equal(y, expected), act


def test_rms_norm_and_swiglu_match_torch():
    x, w = _x(5, 128), torch.rand(128).to(torch.bfloat16)
    xf = x.float()
    ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert (OPS.rms_norm(x, w, 1e-5).float() - ref.float()).abs().max().item() <= 0.01
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(OPS.swiglu(x), F.silu(gate) * up)


@pytest.mark.parametrize("inter", [1536, 40])  # SmolLM2's intermediate size (whole vectors), and a scalar tail
def test_swiglu_of_gate_and_up_apart_equals_swiglu_of_the_two_side_by_side(inter):
    """The decoder's int8_sq layers (gate and up apart) take swiglu(gate, up) instead of swiglu(cat(gate, up)): the same
    bits, and torch's, at every row count a pass runs."""
    g = torch.Generator().manual_seed(9)
    for rows in range(1, 10):
        gate = (torch.randn(rows, inter, generator=g) * 4).to(torch.bfloat16)
        up = (torch.randn(rows, inter, generator=g) * 4).to(torch.bfloat16)
        apart = OPS.swiglu(gate, up)
        assert torch.equal(apart, OPS.swiglu(torch.cat([gate, up], dim=1))), rows
        assert torch.equal(apart, F.silu(gate) * up), rows
    with pytest.raises(RuntimeError, match="up"):
        OPS.swiglu(gate, up[:, :-1].contiguous())


def test_bad_arguments_are_errors_not_crashes():
    packed = OPS.pack(torch.zeros(8, 32, dtype=torch.bfloat16), native.BF16, 32)
    with pytest.raises(RuntimeError, match="multiple of"):
        OPS.pack(torch.zeros(8, 36, dtype=torch.bfloat16), native.BF16, 36)  # no build takes K % 8 != 0
    with pytest.raises(RuntimeError, match="bytes from pack"):
        OPS.linear(_x(1, 64), packed, native.BF16, 8, None, 0, None, 0.0, None, None, None)
    with pytest.raises(RuntimeError, match="bf16"):
        OPS.linear(torch.zeros(1, 32), packed, native.BF16, 8, None, 0, None, 0.0, None, None, None)


@pytest.fixture(scope="module")
def bf16_engines(tmp_path_factory, tiny_tokenizer_dir):
    """The tiny test model's FP8 target as a bf16 engine (loaded with native kernels or with torch ops)."""
    from tiny_models import make_tiny_model

    from specdeploy.deploy.cpu_compile import compile_checkpoint
    from tests.test_engine import ENGINE, QUANT_MODEL, export_checkpoint

    root = tmp_path_factory.mktemp("native")
    make_tiny_model(root / "hf", tiny_tokenizer_dir, seed=5, **QUANT_MODEL)
    export_checkpoint(root / "hf", root / "ckpt", "fp8", dtype=torch.bfloat16)
    compile_checkpoint(root / "ckpt", root / "engine", dataclasses.replace(ENGINE, dtype="bfloat16"), 4)
    return root / "engine"


def test_native_engine_close_to_torch_engine(bf16_engines, monkeypatch):
    fast = CpuEngine.load(bf16_engines)
    monkeypatch.setattr(native, "ops", lambda: None)
    slow = CpuEngine.load(bf16_engines)
    assert fast.decoder is not None and slow.native is None
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(4))
    a, b = fast.forward(fast.new_cache(), ids), slow.forward(slow.new_cache(), ids)
    assert (a - b).abs().max().item() < 0.1
    assert (a.argmax(-1) == b.argmax(-1)).sum().item() >= 22  # of 24


@pytest.fixture(scope="module")
def int8_sq_engines(tmp_path_factory, tiny_tokenizer_dir):
    """The tiny test model's int8_sq checkpoint as bf16 engines, static and per token, with gate and up apart, as
    in the bundled model's checkpoint, where each has its own smoothing and activation scales (the tiny model's
    happen to be equal, so compile's fuse is turned off here)."""
    from unittest import mock

    from tiny_models import make_tiny_model

    from specdeploy.deploy import cpu_compile as compile_module
    from specdeploy.deploy.cpu_compile import compile_checkpoint
    from tests.test_engine import ENGINE, QUANT_MODEL, export_checkpoint

    root = tmp_path_factory.mktemp("native_sq")
    make_tiny_model(root / "hf", tiny_tokenizer_dir, seed=5, **QUANT_MODEL)
    export_checkpoint(root / "hf", root / "ckpt", "int8_sq", dtype=torch.bfloat16)
    engine = dataclasses.replace(ENGINE, dtype="bfloat16")
    with mock.patch.object(compile_module, "fuse", lambda gate, up: None):
        compile_checkpoint(root / "ckpt", root / "static", engine, 4)
        compile_checkpoint(root / "ckpt", root / "per_token", engine, 4, per_token=True)
    return {"static": root / "static", "per_token": root / "per_token"}


@pytest.mark.parametrize("kind", ["fp8", "int8_sq static", "int8_sq per_token"])
def test_decoder_call_equals_the_per_op_native_loop(kind, bf16_engines, int8_sq_engines):
    engine = CpuEngine.load(bf16_engines if kind == "fp8" else int8_sq_engines[kind.split()[1]])
    assert engine.decoder is not None  # int8_sq too: its gate and up run apart inside the native call
    fused = kind == "fp8"
    assert all((layer.gate_up is not None) == fused for layer in engine.layers)
    ids = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))  # the one-call step runs its loops on its own team (csrc/step_team.h)
    try:
        one_call = engine.forward(engine.new_cache(), ids)
        steps = [engine.forward(cache := engine.new_cache(), ids[:8])] + [
            engine.forward(cache, ids[i : i + 1]) for i in range(8, 12)
        ]
        engine.decoder = None  # the same native kernels, called layer by layer from Python (at::parallel_for)
        assert torch.equal(one_call, engine.forward(engine.new_cache(), ids))
        assert torch.equal(torch.cat(steps), one_call)  # a prefill then decode steps: the rows' bits again
    finally:
        torch.set_num_threads(threads)


def test_the_decoders_profile_counts_its_parts_and_changes_no_bits(int8_sq_engines):
    """Decoder.set_profile (bench/round_profile.py): the timed call gives the untimed call's bits and aux features,
    every part of a pass gets time, one call is counted per call; set_profile(False) clears the sums."""
    engine = CpuEngine.load(int8_sq_engines["per_token"])
    ids = torch.randint(0, 512, (5,), generator=torch.Generator().manual_seed(8))
    layers = (0, engine.spec.num_layers - 1)
    plain = engine.forward(engine.new_cache(), ids, aux_layers=layers)
    engine.decoder.set_profile(True)
    timed = engine.forward(engine.new_cache(), ids, aux_layers=layers)
    seconds = engine.decoder.profile().tolist()
    engine.decoder.set_profile(False)
    assert torch.equal(plain[0], timed[0]) and torch.equal(plain[1], timed[1])
    assert len(seconds) == 10 and seconds[-1] == 1  # norms, qkv, rope+kv, attention, o, gate_up, swiglu, down, capture
    assert all(s > 0 for s in seconds[:-1])
    assert engine.decoder.profile().tolist() == [0.0] * 10


def test_an_error_inside_the_one_call_step_is_raised_and_the_next_step_runs(bf16_engines):
    engine = CpuEngine.load(bf16_engines)
    ids = torch.randint(0, 512, (6,), generator=torch.Generator().manual_seed(6))
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        before = engine.forward(engine.new_cache(), ids)
        cache = engine.new_cache()
        x = engine.embedding[ids]
        with pytest.raises(RuntimeError, match="positions out of range"):  # attention's check, on the team's thread
            engine.decoder.forward(x, cache.keys, cache.values, cache.max_len, ids.numel())
        assert torch.equal(engine.forward(engine.new_cache(), ids), before)
    finally:
        torch.set_num_threads(threads)


def test_a_standing_team_gives_the_same_bits_nests_and_reopens_after_an_error(bf16_engines):
    """native.standing_team: linears and a whole engine step inside it equal the same outside (which thread computes a
    chunk changes no bits); an inner block inside an open team does not open another; torch's own loops run on the
    caller alone while it stands and get their threads back after; an error inside closes it, and the next block
    opens it again and works."""
    kind, weight, kwargs, _ = _formats()["bf16"]
    packed = OPS.pack(weight.contiguous(), kind, K)
    x = _x()
    engine = CpuEngine.load(bf16_engines)
    ids = torch.randint(0, 512, (6,), generator=torch.Generator().manual_seed(7))
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        alone, step = _linear(kind, packed, x, **kwargs), engine.forward(engine.new_cache(), ids)
        with native.standing_team(OPS):
            assert OPS.team_open() is False  # already open on this thread: an inner block is a no-op
            # torch's own loops stay on this thread while the team holds the other cores (a libgomp worker woken
            # by them would spin against the team's helper)
            assert torch.get_num_threads() == 1
            inside = [_linear(kind, packed, x[:rows].contiguous(), **kwargs) for rows in (9, 4, 1)]
            inside_step = engine.forward(engine.new_cache(), ids)  # its one-call step runs on the open team
        assert torch.equal(inside[0], alone) and torch.equal(inside[1], alone[:4]) and torch.equal(inside[2], alone[:1])
        assert torch.equal(inside_step, step)
        with pytest.raises(ZeroDivisionError):
            with native.standing_team(OPS):
                _linear(kind, packed, x, **kwargs)
                raise ZeroDivisionError
        with native.standing_team(OPS):
            assert torch.equal(_linear(kind, packed, x, **kwargs), alone)
        assert OPS.team_open() is True  # closed again after the block
        OPS.team_close()
        assert torch.get_num_threads() == max(2, threads)  # torch's own team size is back after every block
        with native.standing_team(None):  # no native kernels: nothing to open
            pass
    finally:
        torch.set_num_threads(threads)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    native.ops.cache_clear()
    try:
        assert native.ops() is None
    finally:
        monkeypatch.delenv(native.DISABLE_ENV)
        native.ops.cache_clear()
    assert native.ops() is not None


@pytest.mark.parametrize(
    "flags, env, expected",
    [
        ("flags : fpu avx avx2 fma", None, "avx2"),
        ("flags : fpu avx avx2 fma avx512f avx512bw", None, "avx512"),
        ("flags : fpu avx avx2 fma avx512f avx512bw avx512_bf16", None, "avx512-bf16"),
        ("flags : fpu avx avx2 fma avx512f avx512bw avx512_bf16", "0", "avx2"),
    ],
)
def test_the_isa_and_the_build_follow_the_cpus_own_flags(monkeypatch, flags, env, expected):
    """The variant is chosen from the CPU that loads the kernels, and the build folder is keyed by its flags, so a
    home folder shared with another CPU never hands this one a binary with instructions it lacks."""
    monkeypatch.setattr(native, "_cpu_flags", lambda: flags)
    if env is None:
        monkeypatch.delenv(native.AVX512_ENV, raising=False)
    else:
        monkeypatch.setenv(native.AVX512_ENV, env)
    assert native.isa() == expected
    assert ("-mno-avx512f" in native._cflags()) == (expected == "avx2")
    other = native.build_dir()
    monkeypatch.setattr(native, "_cpu_flags", lambda: flags + " amx_int8")
    assert native.build_dir() != other


BF16_CPU = "flags : fpu avx avx2 fma avx512f avx512bw avx512_bf16"


@pytest.mark.parametrize(
    "flags, vendor, env, kernel",
    [
        ("flags : fpu avx avx2 fma", "AuthenticAMD", "dpbf16", "f32"),
        ("flags : fpu avx avx2 fma avx512f avx512bw", "AuthenticAMD", None, "pairs"),
        (
            "flags : fpu avx avx2 fma avx512f avx512bw",
            "GenuineIntel",
            "dpbf16",
            "pairs",
        ),  # no AVX512-BF16: nothing else
        (BF16_CPU, "GenuineIntel", None, "pairs"),  # Intel's VDPBF16PS issued at a quarter of the FMA rate
        (BF16_CPU, "GenuineIntel", "auto", "pairs"),
        (BF16_CPU, "GenuineIntel", "dpbf16", "dpbf16"),
        (BF16_CPU, "AuthenticAMD", None, "dpbf16"),  # the EPYC's multi-row passes: ~2x faster with it
        (BF16_CPU, "AuthenticAMD", "pairs", "pairs"),
        (BF16_CPU, "", None, "dpbf16"),
    ],
)
def test_the_bf16_kernel_and_its_build_follow_the_cpu_and_the_environment(monkeypatch, flags, vendor, env, kernel):
    monkeypatch.setattr(native, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(native, "_cpu_vendor", lambda: vendor)
    monkeypatch.delenv(native.AVX512_ENV, raising=False)
    if env is None:
        monkeypatch.delenv(native.BF16_ENV, raising=False)
    else:
        monkeypatch.setenv(native.BF16_ENV, env)
    assert native.bf16_kernel() == kernel
    assert ("-DSPECDEPLOY_BF16_DPBF16" in native._cflags()) == (kernel == "dpbf16")
    monkeypatch.setenv(native.BF16_ENV, "vdpbf16")
    if kernel != "f32":
        with pytest.raises(ValueError, match="SPECDEPLOY_NATIVE_BF16='vdpbf16': expected auto, pairs or dpbf16"):
            native.bf16_kernel()


@pytest.mark.skipif(native.isa() != "avx512-bf16", reason="needs an AVX512-BF16 CPU")
def test_the_vdpbf16ps_build_agrees_with_the_pairs_kernel(tmp_path):
    """The other bf16 build of this CPU (SPECDEPLOY_NATIVE_BF16=dpbf16 or pairs, its own build folder) gives the
    loaded kernel's bits: both add each lane's odd then even product, exact in f32 (away from subnormals, which
    VDPBF16PS flushes and the engine's weights and activations do not hold)."""
    import subprocess

    kind, weight, kwargs, reference = _formats()["bf16"]
    other = "pairs" if native.bf16_kernel() == "dpbf16" else "dpbf16"
    x = _x()
    torch.save({"weight": weight, "x": x}, tmp_path / "in.pt")
    code = (
        f"import torch; from specdeploy.engine import native; d = torch.load({str(tmp_path / 'in.pt')!r}); ops ="
        f" native.ops(); assert native.bf16_kernel() == {other!r}; p = ops.pack(d['weight'].contiguous(), native.BF16,"
        f" {K}); f = lambda x: ops.linear(x, p, native.BF16, {N}, None, 0, None, 0.0, None, None, None);"
        f" torch.save([f(d['x'])] + [f(d['x'][:r].contiguous()) for r in range(1, 10)], {str(tmp_path / 'out.pt')!r})"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, native.BF16_ENV: other}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    y, *parts = torch.load(tmp_path / "out.pt")
    for rows, part in enumerate(parts, 1):
        assert torch.equal(part, y[:rows]), rows
    assert torch.equal(y, _linear(kind, OPS.pack(weight.contiguous(), kind, K), x, **kwargs))


def test_the_loaded_build_is_the_isa_doctor_names():
    from specdeploy.ops import doctor

    line = next(x for x in doctor.report_lines() if "native kernels" in x)
    assert native.isa() in line
    flags = native._cpu_flag_set()
    assert native.isa().startswith("avx512") == ("avx512f" in flags and os.environ.get(native.AVX512_ENV) != "0")


# ---------------------------------------------------------------- multi-row tiles (issue 12)


def _smoothquant(n, k, seed):
    """SmoothQuant as the kernel takes it: int8 weights, per-channel out scale, pre-quant scale, act scale."""
    g = torch.Generator().manual_seed(seed)
    int8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-3
    pqs = (torch.rand(k, generator=g) + 0.5).to(torch.bfloat16).float()
    act = 0.05

    def reference(x):
        xq = ((x * pqs.to(torch.bfloat16)).float() / act).round().clamp(-128, 127)
        return (xq @ int8.float().t()) * scale

    return native.INT8, int8, dict(pre_quant_scale=pqs, act_scale=act, out_scale=scale), reference


@pytest.mark.parametrize("name", ["bf16", "fp8", "int8", "int4", "smoothquant"])
def test_every_format_rows_1_to_16_bit_identical_per_row(name):
    """Each row of a call of 1..16 rows (several register tiles and a remainder tile; N % 4 = 2 channel tails)
    has the bits of that row computed alone, and is close to the f32 reference."""
    kind, weight, kwargs, reference = _smoothquant(N, K, 7) if name == "smoothquant" else _formats()[name]
    packed = OPS.pack(weight.contiguous(), kind, K)
    x = _x(16, seed=11)
    alone = torch.cat([_linear(kind, packed, x[r : r + 1].contiguous(), **kwargs) for r in range(16)])
    ref = reference(x)
    assert ((alone.float() - ref).abs() <= 0.01 * ref.abs() + 0.02 * ref.abs().mean()).all()
    assert alone.abs().sum() > 0
    for rows in range(1, 17):
        assert torch.equal(_linear(kind, packed, x[:rows].contiguous(), **kwargs), alone[:rows]), rows
    shuffled = torch.randperm(16, generator=torch.Generator().manual_seed(2))  # a row's place in the call is irrelevant
    assert torch.equal(_linear(kind, packed, x[shuffled].contiguous(), **kwargs), alone[shuffled])


@pytest.mark.parametrize("name", ["bf16", "fp8", "int4"])
def test_prefill_sized_calls_cross_row_chunks_with_the_same_bits(name):
    """200 rows of K = 1024: the kernel walks the rows in L2-sized chunks; every row keeps its one-row bits."""
    k, n, rows = 1024, 10, 200
    g = torch.Generator().manual_seed(12)
    w = torch.randn(n, k, generator=g) * 0.05
    if name == "bf16":
        kind, weight, kwargs, wf = native.BF16, w.to(torch.bfloat16), {}, w.to(torch.bfloat16).float()
        quant = lambda x: x.float()  # noqa: E731
    elif name == "fp8":
        fp8 = (w * 20).to(torch.float8_e4m3fn)
        kind, weight, kwargs, wf = native.FP8, fp8.view(torch.uint8), dict(act_scale=0.02), fp8.float()
        quant = lambda x: (x.float() / 0.02).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()  # noqa: E731
    else:
        unsigned = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        gs = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).to(torch.bfloat16).float()
        kind, weight, kwargs = native.INT4, pack_int4(unsigned), dict(group_scale=gs, group_size=32)
        wf, quant = (unsigned.float() - 8) * gs.repeat_interleave(32, dim=1), lambda x: x.float()  # noqa: E731
    packed = OPS.pack(weight.contiguous(), kind, k)
    x = _x(rows, k, seed=13)
    y = OPS.linear(
        x,
        packed,
        kind,
        n,
        kwargs.get("group_scale"),
        kwargs.get("group_size", 0),
        None,
        kwargs.get("act_scale", 0.0),
        None,
        None,
        None,
    )
    ref = quant(x) @ wf.t()
    assert ((y.float() - ref).abs() <= 0.01 * ref.abs() + 0.02 * ref.abs().mean()).all()
    for r in (0, 47, 48, 95, 96, 150, 199):
        one = OPS.linear(
            x[r : r + 1].contiguous(),
            packed,
            kind,
            n,
            kwargs.get("group_scale"),
            kwargs.get("group_size", 0),
            None,
            kwargs.get("act_scale", 0.0),
            None,
            None,
            None,
        )
        assert torch.equal(one[0], y[r]), r


@pytest.mark.parametrize("threads", [1, 2])
def test_fp8_decode_exact_with_flush_to_zero_and_denormals_are_zero(threads):
    """E4M3 subnormal weights and subnormal f32 products stay exact with FTZ/DAZ on in the calling thread."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    weights = codes.view(-1, 1).expand(-1, 16).contiguous()
    packed = OPS.pack(weights, native.FP8, 16)
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    x[0, 0] = 2.0**-9  # the smallest E4M3 subnormal: products of 2^-9 and the decoded weights are f32 subnormals
    expected = (codes.view(torch.float8_e4m3fn).float() * 2.0**-9).to(torch.bfloat16)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.set_flush_denormal(True), "this CPU cannot flush denormals: nothing to test"
        assert torch.tensor([1e-40]).mul(1.0).item() == 0.0  # FTZ/DAZ really on in this thread
        y = OPS.linear(x, packed, native.FP8, len(codes), None, 0, None, 0.0, None, None, None)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(previous)
    assert torch.equal(y[0], expected)
    assert torch.tensor([1e-40]).mul(1.0).item() != 0.0  # and the kernel left the mode as it found it


def test_supports_falls_back_where_the_build_needs_a_larger_k_multiple():
    """NativeLinear.supports asks the build: K % 16 == 0 is not enough where bf16 packs 32 at a time
    (AVX512-BF16); such a layer falls back to torch ops instead of failing at load."""
    import types

    from specdeploy.engine.kernels import DenseLinear, NativeLinear, make_linear

    weight = torch.randn(8, 48).to(torch.bfloat16)
    bf16_32 = types.SimpleNamespace(k_multiple=lambda kind: 32 if kind == native.BF16 else 16)
    assert not NativeLinear.supports(bf16_32, {"weight": weight}, None, None)
    assert isinstance(make_linear({"weight": weight}, None, torch.bfloat16, None, bf16_32), DenseLinear)
    step = int(OPS.k_multiple(native.BF16))
    odd = torch.randn(8, step + step // 2).to(torch.bfloat16)
    assert isinstance(make_linear({"weight": odd}, None, torch.bfloat16, None, OPS), DenseLinear)
    even = make_linear({"weight": torch.randn(8, 2 * step).to(torch.bfloat16)}, None, torch.bfloat16, None, OPS)
    assert isinstance(even, NativeLinear)


def test_a_baton_left_by_a_killed_build_does_not_hang_the_next_load(tmp_path):
    """torch's build baton (`lock` in the build folder, FileBaton) outlives a process killed mid-build and makes every
    later load wait forever (pytorch/pytorch#189245). A new process loads the kernels anyway and removes it."""
    import subprocess
    import sys

    baton = native.build_dir() / native.TORCH_BATON
    baton.write_text("")  # what a build killed between FileBaton.try_acquire and release leaves
    try:
        got = subprocess.run(
            [sys.executable, "-c", "from specdeploy.engine import native; assert native.ops() is not None"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        left = baton.exists()
        baton.unlink(missing_ok=True)
    assert got.returncode == 0, got.stderr[-2000:]
    assert not left and "left by a kernel build that was killed" in got.stderr


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The kernel's RoPE on [rows, heads, D] bf16 with [rows, D] tables (sin's first half negated by the caller):
    x * cos + [x2, x1] * sin in f32, rounded to bf16."""
    x = x.float()
    rotated = torch.cat([x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]], dim=-1)
    return (x * cos[:, None] + rotated * sin[:, None]).to(torch.bfloat16).double()


@pytest.mark.parametrize("head_size", [16, 24, 64, 128])  # 24: no whole number of vectors (the per-key dot)
@pytest.mark.parametrize("start", [0, 37])
@pytest.mark.parametrize("heads, kv_heads, rows", [(6, 2, 19), (8, 2, 5), (4, 2, 2)])
def test_attention_follows_a_reference_and_each_rows_bits_are_its_own(head_size, start, heads, kv_heads, rows):
    """native attention: each row of a pass is softmax(q k^T * scale) v over exactly its own positions 0..start+r
    (a float64 reference from the same RoPE tables, the cache's earlier keys included), and is bit for bit the row a
    pass of that one row gives, whatever the pass's size (keys in blocks of a vector's lanes: a row's keys count
    never changes another row's sums). A pass of several rows reads each KV head's keys once for a unit of rows x
    its query heads (csrc attend_queries, the scores and the values 3, 2 or 1 queries at a time: groups of 3, 4 and 2
    here); one row runs each query head as a task of its own: the same bits."""
    g = torch.Generator().manual_seed(head_size + start + rows)
    max_len = 80
    width = (heads + 2 * kv_heads) * head_size
    cos, sin = torch.randn(max_len, head_size, generator=g), torch.randn(max_len, head_size, generator=g)
    keys0 = torch.randn(kv_heads, max_len, head_size, generator=g).to(torch.bfloat16)  # the cache holds bf16
    values0 = torch.randn(kv_heads, max_len, head_size, generator=g).to(torch.bfloat16)
    qkv = torch.randn(rows, width, generator=g).to(torch.bfloat16)
    scale = head_size**-0.5
    keys, values = keys0.clone(), values0.clone()
    out = OPS.attention(qkv, cos, sin, keys, values, start, rows, heads, kv_heads, scale)
    for r in sorted({0, 1, min(7, rows - 1), rows - 1}):  # row by row, each on the cache as the pass before it left it
        k1, v1 = keys0.clone(), values0.clone()
        if r:
            OPS.attention(qkv[:r].contiguous(), cos, sin, k1, v1, start, r, heads, kv_heads, scale)
        one = OPS.attention(qkv[r : r + 1].contiguous(), cos, sin, k1, v1, start + r, 1, heads, kv_heads, scale)
        assert torch.equal(one[0], out[r]), r
    q = _rope_ref(
        qkv[:, : heads * head_size].view(rows, heads, head_size), cos[start : start + rows], sin[start : start + rows]
    )
    k_new = _rope_ref(
        qkv[:, heads * head_size : (heads + kv_heads) * head_size].view(rows, kv_heads, head_size),
        cos[start : start + rows],
        sin[start : start + rows],
    )
    v_new = qkv[:, (heads + kv_heads) * head_size :].view(rows, kv_heads, head_size).double()
    all_k = torch.cat([keys0[:, :start].double(), k_new.transpose(0, 1)], dim=1)  # [kv, start + rows, D]
    all_v = torch.cat([values0[:, :start].double(), v_new.transpose(0, 1)], dim=1)
    assert torch.equal(keys[:, : start + rows].double(), all_k) and torch.equal(
        values[:, : start + rows].double(), all_v
    )
    group = heads // kv_heads
    for r in range(rows):
        n = start + r + 1
        for h in range(heads):
            p = torch.softmax((all_k[h // group, :n] @ q[r, h]) * scale, dim=0)
            expected = p @ all_v[h // group, :n]
            got = out[r, h * head_size : (h + 1) * head_size].double()
            torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("head_size", [16, 32, 64, 128])
@pytest.mark.parametrize("team", [False, True])
def test_attention_rows_equal_one_row_passes_over_the_engines_shapes(head_size, team):
    """Over the shapes the engine runs (groups 1-6, 1-9 rows, 0-200 positions) a pass's every row has the bits of a
    one-row pass at its position, inside a standing team and without one (other chunks: a one-row pass runs a chunk's
    query heads of one KV head as one task, csrc attention_batch). A pass of several rows and one of one row are
    different tasks; that they agree bit for bit, with the reference test above pinning what they compute, is what
    keeps either from drifting. Padding rows past m come back 0."""
    g = torch.Generator().manual_seed(head_size)
    max_len = 216
    for groups in range(1, 7):
        kv_heads = 2 if groups < 4 else 1
        heads = groups * kv_heads
        width = (heads + 2 * kv_heads) * head_size
        cos, sin = torch.randn(max_len, head_size, generator=g), torch.randn(max_len, head_size, generator=g)
        keys0 = torch.randn(kv_heads, max_len, head_size, generator=g).to(torch.bfloat16)
        values0 = torch.randn(kv_heads, max_len, head_size, generator=g).to(torch.bfloat16)
        for rows, start in [(1, 0), (2, 1), (3, 15), (4, 16), (5, 63), (6, 64), (7, 100), (8, 191), (9, 200)]:
            qkv = torch.randn(rows + 1, width, generator=g).to(torch.bfloat16)  # the last row: padding
            keys, values, scale = keys0.clone(), values0.clone(), head_size**-0.5
            with native.standing_team(OPS if team else None):
                out = OPS.attention(qkv, cos, sin, keys, values, start, rows, heads, kv_heads, scale)
                assert not out[rows].any()
                for r in range(rows):  # the cache as the pass left it: each row reads only positions 0..start+r
                    row = qkv[r : r + 1].contiguous()
                    one = OPS.attention(row, cos, sin, keys, values, start + r, 1, heads, kv_heads, scale)
                    assert torch.equal(one[0], out[r]), (groups, rows, start, r)
