"""INT8 SmoothQuant on integer dot products (csrc/int8_kernels.cpp, issue 25): bit-exact against an independent
torch reference of TensorRT-LLM's definition, for every kernel variant this CPU runs (AVX2, AVX-VNNI,
AVX512-VNNI), for 1..16 rows, K of any size, per-tensor and per-token activation scales."""

from __future__ import annotations

import os

import pytest
import torch

from specdeploy.engine import native
from specdeploy.engine.kernels import NativeLinear

if not native.cpu_supported():
    pytest.skip(
        "the native kernels need AVX-512 or AVX2 + FMA; the engine uses torch ops here", allow_module_level=True
    )
if os.environ.get(native.DISABLE_ENV) == "0":
    pytest.skip(f"{native.DISABLE_ENV}=0 switches the native kernels off", allow_module_level=True)

OPS = native.ops()
VARIANTS = list(OPS.int8_variants()) if OPS is not None else []
BF16_TINY = torch.tensor(1e-6).to(torch.bfloat16).float()


# ---------------------------------------------------------------- the reference, written from the definition


def quantize_reference(x, pqs, act_scale):
    """(q [M, K] f32 integer values, token scale [M] or None). TensorRT-LLM: v = x smoothed (here bf16(x * s));
    per tensor q = sat(rne(v * (1 / act_scale))); per token row_max = max(bf16(1e-6), max |v|),
    q = sat(rne(v * (127 / row_max))), token scale = row_max / 127; sat = clamp to [-128, 127]."""
    v = x.float()
    if pqs is not None:
        v = (v * pqs).to(torch.bfloat16).float()
    if act_scale > 0:
        mult = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(act_scale, dtype=torch.float32)
        return torch.round(v * mult).clamp(-128, 127), None  # torch.round: half to even
    row_max = torch.maximum(v.abs().amax(dim=1), BF16_TINY)
    full_127 = torch.full_like(row_max, 127.0)
    # f32 divisions of equal-shaped tensors: torch turns `127.0 / t` into 127 * (1 / t), another rounding
    q = torch.round(v * torch.div(full_127, row_max)[:, None]).clamp(-128, 127)
    return q, torch.div(row_max, full_127)


def linear_reference(x, w, weight_scale, pqs=None, act_scale=0.05, bias=None, residual=None):
    q, token = quantize_reference(x, pqs, act_scale)
    acc = (q.to(torch.int64)[:, None, :] * w.to(torch.int64)[None, :, :]).sum(-1)  # exact integer sums
    if token is None:
        scale = (torch.tensor(act_scale, dtype=torch.float32) * weight_scale)[None, :]
    else:
        scale = token[:, None] * weight_scale[None, :]
    y = acc.to(torch.float32) * scale
    if bias is not None:
        y = y + bias
    if residual is not None:
        y = residual.float() + y.to(torch.bfloat16).float()
    return y.to(torch.bfloat16)


# ---------------------------------------------------------------- helpers


def _case(n, k, seed, pqs=True, bias=False, residual_rows=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)  # -128 too: the VNNI offset handles it
    weight_scale = torch.rand(n, generator=g) * 0.01 + 1e-3
    s = (torch.rand(k, generator=g) + 0.5).to(torch.bfloat16).float() if pqs else None
    b = (torch.randn(n, generator=g) * 0.1).to(torch.bfloat16).float() if bias else None
    r = torch.randn(residual_rows, n, generator=g).to(torch.bfloat16) if residual_rows else None
    return w, weight_scale, s, b, r


def _x(rows, k, seed, spread=3.0):
    return (torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * spread).to(torch.bfloat16)


def _packs(w):
    """The weight packed for every variant (each has its layout)."""
    return {variant: OPS.int8_pack(w, variant) for variant in VARIANTS}


def _run(variant, packed, x, n, weight_scale, pqs, act_scale, bias=None, residual=None):
    """`packed`: int8_pack's bytes for this variant, or _packs' dict of them."""
    if isinstance(packed, dict):
        packed = packed[variant]
    out_scale = (torch.tensor(act_scale, dtype=torch.float32) * weight_scale) if act_scale > 0 else weight_scale
    return OPS.int8_linear(x, packed, n, variant, pqs, act_scale, out_scale.contiguous(), bias, residual)


def test_the_kernels_load_and_this_cpu_runs_the_variant_its_flags_name():
    assert OPS is not None
    assert native.INT8_AVX2 in VARIANTS
    assert native.int8_variant() in VARIANTS
    flags = native._cpu_flag_set()
    assert (native.INT8_AVX512_VNNI in VARIANTS) == ({"avx512_vnni", "avx512bw"} <= flags)
    assert (native.INT8_AVX_VNNI in VARIANTS) == ("avx_vnni" in flags)


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        ({"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni"}, {}, native.INT8_AVX512_VNNI),
        (
            {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni"},
            {native.AVX512_ENV: "0"},
            native.INT8_AVX_VNNI,
        ),
        ({"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni"}, {native.VNNI_ENV: "0"}, native.INT8_AVX2),
        ({"avx2", "fma", "avx_vnni"}, {}, native.INT8_AVX_VNNI),
        ({"avx2", "fma"}, {}, native.INT8_AVX2),
    ],
)
def test_the_variant_follows_the_cpus_flags_and_the_overrides(monkeypatch, flags, env, expected):
    monkeypatch.setattr(native, "_cpu_flag_set", lambda: flags)
    for name in (native.AVX512_ENV, native.VNNI_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert native.int8_variant() == expected


@pytest.mark.parametrize("act_scale", [0.05, 0.0])  # per tensor (ModelOpt's export), per token (TensorRT-LLM plugin)
@pytest.mark.parametrize("pqs", [True, False])
def test_activation_quantization_is_the_definition_bit_for_bit(act_scale, pqs):
    k = 203
    _, _, s, _, _ = _case(4, k, 3, pqs=pqs)
    x = _x(16, k, 5)
    x[0, :8] = torch.tensor([0.025, 0.075, -0.025, -0.125, 100.0, -100.0, 6.35, -6.4])  # ties (even) and saturation
    x[1] = 0.0  # a zero row: the 1e-6 floor of the per-token scale
    q, token = OPS.int8_quantize(x, s, act_scale)
    ref_q, ref_token = quantize_reference(x, s, act_scale)
    assert torch.equal(q.float(), ref_q)
    if act_scale > 0:
        assert (ref_q == -128).any() and (ref_q == 127).any()
    else:
        assert torch.equal(token, ref_token)
        assert (ref_q.abs().amax(dim=1)[2:] == 127).all()


SHAPES = [(1, 1), (3, 17), (4, 64), (7, 100), (70, 96), (13, 203), (8, 576)]  # K % 64 != 0 and N % 4 != 0 included


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("act_scale", [0.05, 0.0])
def test_every_variant_equals_the_reference_bit_for_bit_for_1_to_16_rows(n, k, act_scale):
    w, weight_scale, s, b, r = _case(n, k, n * 1000 + k, bias=True, residual_rows=16)
    packed = _packs(w)
    x = _x(16, k, k)
    for variant in VARIANTS:
        for rows in range(1, 17):
            xr, rr = x[:rows].contiguous(), r[:rows].contiguous()
            y = _run(variant, packed, xr, n, weight_scale, s, act_scale, b, rr)
            assert torch.equal(y, linear_reference(xr, w, weight_scale, s, act_scale, b, rr)), (variant, rows)
        y = _run(variant, packed, x, n, weight_scale, None, act_scale)
        assert torch.equal(y, linear_reference(x, w, weight_scale, None, act_scale)), variant


def test_variants_and_row_counts_give_the_same_bits():
    """The same rows through every variant, alone, in calls of 1..16 rows and shuffled: one set of bits."""
    n, k = 38, 1544  # K: 24 steps of 64 and a tail of 8
    w, weight_scale, s, _, _ = _case(n, k, 9)
    packed = _packs(w)
    x = _x(16, k, 21)
    for act_scale in (0.05, 0.0):
        alone = torch.cat(
            [
                _run(native.INT8_AVX2, packed, x[i : i + 1].contiguous(), n, weight_scale, s, act_scale)
                for i in range(16)
            ]
        )
        assert alone.abs().sum() > 0
        for variant in VARIANTS:
            for rows in range(1, 17):
                y = _run(variant, packed, x[:rows].contiguous(), n, weight_scale, s, act_scale)
                assert torch.equal(y, alone[:rows]), (variant, rows, act_scale)
            perm = torch.randperm(16, generator=torch.Generator().manual_seed(variant))
            assert torch.equal(_run(variant, packed, x[perm].contiguous(), n, weight_scale, s, act_scale), alone[perm])


def test_prefill_sized_calls_keep_the_bits():
    """300 rows of K = 1536: the kernel walks rows in L2-sized chunks and threads split the channels."""
    n, k = 24, 1536
    w, weight_scale, s, _, _ = _case(n, k, 4)
    packed = _packs(w)
    x = _x(300, k, 8)
    ref = linear_reference(x, w, weight_scale, s, 0.05)
    for variant in VARIANTS:
        assert torch.equal(_run(variant, packed, x, n, weight_scale, s, 0.05), ref), variant


def test_the_engine_linear_runs_the_integer_kernel():
    """NativeLinear for W8A8_SQ_PER_CHANNEL engine tensors (as compile.py writes them) takes the int8 kernel,
    through `linear` (as the Decoder calls it), with the definition's bits."""
    n, k = 10, 150
    w, weight_scale, s, b, r = _case(n, k, 6, bias=True, residual_rows=5)
    t = {
        "weight": w,
        "weight_scale": weight_scale,
        "act_scale": torch.tensor(0.04),
        "pre_quant_scale": s.to(torch.bfloat16),
        "bias": b.to(torch.bfloat16),
    }
    assert NativeLinear.supports(OPS, t, "W8A8_SQ_PER_CHANNEL", None)
    lin = NativeLinear(OPS, t, "W8A8_SQ_PER_CHANNEL", torch.bfloat16, None)
    assert lin.kind == native.INT8_SQ and lin.group_size == native.int8_variant()
    x = _x(5, k, 1)
    act = float(torch.tensor(0.04))
    assert torch.equal(lin(x, r), linear_reference(x, w, weight_scale, s, act, b, r))
    assert torch.equal(lin(x[:1]), linear_reference(x[:1], w, weight_scale, s, act, b))


def test_per_token_engine_linears_native_and_torch_give_the_definitions_bits():
    """quantization.per_token engines (quant_algo SQ_PER_TOKEN, no act_scale in the engine): NativeLinear runs the
    kernel's per-token mode and the torch fallback (SmoothQuantLinear) computes the same bits, both equal to the
    reference of TensorRT-LLM's per-token definition; the static act_scale a checkpoint carries is not used."""
    from specdeploy.engine.kernels import SmoothQuantLinear, make_linear
    from specdeploy.engine.spec import SQ_PER_TOKEN

    n, k = 12, 200
    w, weight_scale, s, b, r = _case(n, k, 11, bias=True, residual_rows=6)
    t = {
        "weight": w,
        "weight_scale": weight_scale,
        "pre_quant_scale": s.to(torch.bfloat16),
        "bias": b.to(torch.bfloat16),
    }
    x = _x(6, k, 12)
    x[2] *= 40  # rows of very different ranges: one static scale would saturate this row and flatten the others
    x[4] *= 0.01
    ref = linear_reference(x, w, weight_scale, s, 0.0, b, r)
    native_lin = NativeLinear(OPS, t, SQ_PER_TOKEN, torch.bfloat16, None)
    assert native_lin.act_scale == 0.0
    torch_lin = make_linear(t, SQ_PER_TOKEN, torch.bfloat16, None)
    assert isinstance(torch_lin, SmoothQuantLinear) and torch_lin.per_token
    assert torch.equal(native_lin(x, r), ref)
    assert torch.equal(torch_lin(x, r), ref)
    for i in range(6):  # a row alone gives its bits in the batch
        assert torch.equal(native_lin(x[i : i + 1]), linear_reference(x[i : i + 1], w, weight_scale, s, 0.0, b))
    static = linear_reference(x, w, weight_scale, s, float(x.float().abs().max()) / 127, b, r)
    assert not torch.equal(static, ref)  # the two modes differ on these rows, so the equalities above tell them apart


def test_each_variants_packed_layout_is_the_documented_one():
    """int8_pack's bytes, read back by the layout int8_kernels.cpp documents (packing needs no CPU feature, so every
    layout is checked on every machine): 4-channel blocks of 64-byte steps of K (AVX2, AVX-VNNI), or 16-channel
    blocks of 4-byte groups of K (AVX512-VNNI), zeros past K and N, then the channels' int32 weight sums."""
    n, k = 18, 70  # N % 4 = 2 (two single channels), N % 16 = 2 (a padded block), K % 64 = 6
    w = _case(n, k, 13)[0]
    kp = 128
    sums = w.to(torch.int32).sum(dim=1)
    for variant in (native.INT8_AVX2, native.INT8_AVX_VNNI):
        packed = OPS.int8_pack(w, variant)
        assert packed.numel() == n * kp + 4 * n
        body = packed[: n * kp].view(torch.int8)
        blocks = body[: 16 * kp].view(4, kp // 64, 4, 64).permute(0, 2, 1, 3).reshape(16, kp)  # [block, step, ch, byte]
        singles = body[16 * kp :].view(2, kp)
        unpacked = torch.cat([blocks, singles])
        assert torch.equal(unpacked[:, :k], w) and not unpacked[:, k:].any()
        assert torch.equal(packed[n * kp :].view(torch.int32), sums)
    packed = OPS.int8_pack(w, native.INT8_AVX512_VNNI)
    assert packed.numel() == 32 * kp + 4 * n
    body = packed[: 32 * kp].view(torch.int8).view(2, kp // 4, 16, 4)  # [block, group of 4 in K, channel, byte]
    unpacked = body.permute(0, 2, 1, 3).reshape(32, kp)
    assert torch.equal(unpacked[:n, :k], w) and not unpacked[:, k:].any() and not unpacked[n:].any()
    assert torch.equal(packed[32 * kp :].view(torch.int32), sums)


def test_bad_arguments_are_errors_not_crashes():
    w, weight_scale, s, _, _ = _case(6, 70, 2)
    packed = OPS.int8_pack(w, native.INT8_AVX2)
    x = _x(2, 70, 3)
    with pytest.raises(RuntimeError, match="packed weight"):
        _run(native.INT8_AVX2, packed[:-1].contiguous(), x, 6, weight_scale, s, 0.05)
    with pytest.raises(RuntimeError, match="variant"):
        _run(7, packed, x, 6, weight_scale, s, 0.05)
    with pytest.raises(RuntimeError, match="pre_quant_scale"):
        _run(native.INT8_AVX2, packed, x, 6, weight_scale, s[:-1].contiguous(), 0.05)
    with pytest.raises(RuntimeError, match="int8"):
        OPS.int8_pack(w.float(), native.INT8_AVX2)
    with pytest.raises(RuntimeError, match="variant 7 does not exist"):
        OPS.int8_pack(w, 7)
    if native.INT8_AVX512_VNNI in VARIANTS:  # another variant's layout has another size: refused, not misread
        with pytest.raises(RuntimeError, match="packed weight"):
            _run(native.INT8_AVX512_VNNI, packed, x, 6, weight_scale, s, 0.05)


def test_doctor_names_the_int8_variant():
    from specdeploy.ops import doctor

    line = next(x for x in doctor.report_lines() if "native kernels" in x)
    assert f"int8 {native.INT8_VARIANT_NAMES[native.int8_variant()]}" in line
