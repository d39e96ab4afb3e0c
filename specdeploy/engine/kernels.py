"""Linear layers, one class per TensorRT-LLM `quant_algo`, each executing the checkpoint's own numerics.

Engine weight layout (written by compile.py, read here), per linear layer `P`:

    quant_algo            tensors
    None (full_prec)      P.weight [N, K] (dtype), P.bias [N]?
    FP8                   P.weight [N, K] float8_e4m3fn, P.weight_scale [N] f32, P.act_scale [] f32
    W8A16 (int8_wo)       P.weight [N, K] int8, P.weight_scale [N] f32
    W4A16_AWQ (int4_awq)  P.weight [N, K/2] uint8 (low nibble = even k, values q + 8), P.weight_scale [N, K/G] f32,
                          P.pre_quant_scale [K]
    W8A8_SQ_PER_CHANNEL   P.weight [N, K] int8, P.weight_scale [N] f32, P.act_scale [] f32, P.pre_quant_scale [K]
    W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN (int8_sq, quantization.per_token)
                          P.weight [N, K] int8, P.weight_scale [N] f32, P.pre_quant_scale [K]

Dequantized weight: W = q * weight_scale (per tensor, per output channel, or per [channel, group]).
Every layer maps x [M, K] (compute dtype) to y [M, N] (compute dtype).

`row_invariant`: each output row is bit-identical whatever M is (the kernel reduces every row along K the
same way). True for oneDNN's prepacked bf16 GEMM and torch's int8/int4 weight-only kernels (tests check it
for M = 1..8); false for MKL's fp32/fp16 GEMMs behind `F.linear`, whose micro-kernels depend on M. The
runtime pads rows to a fixed bucket only for an engine with a kernel that is not row-invariant, so that a
k+1-row pass stays bit-identical to k+1 one-row passes either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdeploy.engine.spec import SQ_PER_TOKEN

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT4_INNER_K_TILES = 2


class PackedGemm:
    """y = x W^T (+ b) in bf16 with the weight reordered once into oneDNN's blocked layout.

    Plain `F.linear` on a bf16 weight lets oneDNN reorder the weight on every call; prepacking halves the LM-head
    GEMM's time. The layout is chosen for one row (a decode step): packing for more rows gained little
    (docs/stages.md "Why native kernels"). Other dtypes, or a torch without the mkldnn ops, use `F.linear`.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias, self.packed = weight, bias, None
        if weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
                self.weight = None  # only the packed copy is kept
            except (RuntimeError, AttributeError):
                self.packed = None

    @property
    def row_invariant(self) -> bool:
        return self.packed is not None

    def __call__(self, x):
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        return _nbytes(self.packed if self.packed is not None else self.weight, self.bias)


class DenseLinear:
    """Unquantized: y = x W^T + b."""

    def __init__(self, t: dict, dtype: torch.dtype):
        self.gemm = PackedGemm(t["weight"].to(dtype).contiguous(), _opt(t, "bias", dtype))

    @property
    def row_invariant(self) -> bool:
        return self.gemm.row_invariant

    def __call__(self, x, residual=None):
        return _plus(self.gemm(x), residual)

    def nbytes(self) -> int:
        return self.gemm.nbytes()


class Fp8Linear:
    """FP8 (E4M3) weights with a per-tensor scale and a static per-tensor activation scale.

    As TensorRT-LLM's FP8 GEMM: x_q = e4m3(x / act_scale); y = (x_q @ W_q^T) * (act_scale * weight_scale).
    E4M3 values are exact in bf16 (3 mantissa bits), so the GEMM runs on bf16 copies of x_q and W_q with
    fp32 accumulation and the scale is applied to the fp32 result: the same products, only faster.
    Scales are 1-d f32 tensors, so `x / act_scale` and `y * out_scale` promote a bf16 operand to f32 in
    the same op (a 0-d scale would not promote it).
    """

    def __init__(self, t: dict, dtype: torch.dtype):
        gemm_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
        self.dtype = dtype
        self.gemm_dtype = gemm_dtype
        self.gemm = PackedGemm(t["weight"].to(gemm_dtype).contiguous(), None)  # exact: e4m3 -> bf16/f32
        act_scale = t.get("act_scale")
        self.act_scale = None if act_scale is None else act_scale.float().reshape(1)
        out_scale = t["weight_scale"].float() * (self.act_scale if self.act_scale is not None else 1.0)
        self.out_scale = out_scale.reshape(-1).contiguous()  # [N] (or [1]) f32
        self.bias = _opt(t, "bias", dtype)
        self.row_invariant = self.gemm.row_invariant

    def __call__(self, x, residual=None):
        if self.act_scale is not None:
            x = torch.div(x, self.act_scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # f32 -> e4m3
        y = torch.mul(self.gemm(x.to(self.gemm_dtype)), self.out_scale).to(self.dtype)  # [M, N], scaled in f32
        return _plus(y if self.bias is None else y + self.bias, residual)

    def nbytes(self) -> int:
        return self.gemm.nbytes() + _nbytes(self.bias)


class Int8WeightOnlyLinear:
    """INT8 weight-only (W8A16): y = x @ (q * scale)^T with torch's fused int8 weight-only GEMM.

    The per-channel scale is applied in the activation dtype, as in TensorRT-LLM's weight-only kernels.
    """

    row_invariant = True

    def __init__(self, t: dict, dtype: torch.dtype):
        self.weight = t["weight"].contiguous()  # [N, K] int8
        self.scale = t["weight_scale"].to(dtype).contiguous()  # [N]
        self.bias = _opt(t, "bias", dtype)

    def __call__(self, x, residual=None):
        y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scale)
        return _plus(y if self.bias is None else y + self.bias, residual)

    def nbytes(self) -> int:
        return _nbytes(self.weight, self.scale, self.bias)


class Int4AwqLinear:
    """INT4 AWQ (W4A16_AWQ): y = (x * pre_quant_scale) @ (q * scale[:, k // G])^T, q in [-8, 7].

    bf16 runs on torch's int4 weight-only kernel (`_weight_int4pack_mm_for_cpu`, which dequantizes
    (u - 8) * scale + zero with u = q + 8 and zero = 0); other dtypes dequantize once at load.
    """

    def __init__(self, t: dict, dtype: torch.dtype, group_size: int):
        self.dtype = dtype
        self.group_size = group_size
        self.pre_quant_scale = t["pre_quant_scale"].to(dtype)
        packed = t["weight"]  # [N, K/2] uint8
        scale = t["weight_scale"].float()  # [N, K/G]
        unsigned = unpack_int4(packed)  # [N, K] values 0..15
        n, k = unsigned.shape
        self.fused = dtype == torch.bfloat16 and k % (INT4_INNER_K_TILES * 16) == 0 and n % 8 == 0
        if self.fused:
            self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                unsigned.to(torch.int32), INT4_INNER_K_TILES
            )
            zeros = torch.zeros_like(scale)
            self.scales_and_zeros = torch.stack([scale.t(), zeros.t()], dim=-1).to(dtype).contiguous()  # [K/G, N, 2]
        else:
            q = unsigned.to(torch.float32) - 8.0
            self.weight = (q * scale.to(dtype).float().repeat_interleave(group_size, dim=1)).to(dtype).contiguous()
        self.bias = _opt(t, "bias", dtype)
        self.row_invariant = self.fused

    def __call__(self, x, residual=None):
        x = x * self.pre_quant_scale
        if self.fused:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, self.group_size, self.scales_and_zeros)
        else:
            y = F.linear(x, self.weight)
        return _plus(y if self.bias is None else y + self.bias, residual)

    def nbytes(self) -> int:
        extra = self.scales_and_zeros if self.fused else None
        return _nbytes(self.weight, extra, self.pre_quant_scale, self.bias)


class SmoothQuantLinear:
    """INT8 SmoothQuant, per-channel weight scales, activations quantized per tensor with the static act_scale
    (W8A8_SQ_PER_CHANNEL) or per token with each row's own scale (SQ_PER_TOKEN).

    Per tensor: x_q = clamp(round(v * (1 / act_scale)), -128, 127), y = (x_q @ q^T) * act_scale * weight_scale;
    per token: row_max = max(bf16(1e-6), max |v|), x_q = clamp(round(v * (127 / row_max)), -128, 127),
    y = (x_q @ q^T) * (row_max / 127) * weight_scale; v = bf16(x * pre_quant_scale) in both (csrc/int8_kernels.cpp
    cites TensorRT-LLM for each step). The integer products are exact in f32 and the torch int8 weight-only GEMM
    accumulates them in f32 with the f32 scales applied to the f32 result, as TensorRT-LLM's int8 GEMM does with its
    int32 accumulator.
    """

    row_invariant = True
    _TINY = float(torch.tensor(1e-6).to(torch.bfloat16))  # TensorRT-LLM's T(1e-6) floor of a row's max, in bf16

    def __init__(self, t: dict, dtype: torch.dtype, per_token: bool = False):
        self.dtype, self.per_token = dtype, per_token
        self.weight = t["weight"].contiguous()  # [N, K] int8
        self.weight_scale = t["weight_scale"].float().contiguous()  # [N] f32
        if per_token:
            self._ones = torch.ones_like(self.weight_scale)
        else:
            self.act_scale = t["act_scale"].float()
            self.inv_act_scale = 1.0 / self.act_scale  # f32
            self.out_scale = (self.weight_scale * self.act_scale).contiguous()  # [N] f32
        self.pre_quant_scale = t["pre_quant_scale"].to(dtype)
        self.bias = _opt(t, "bias", dtype)

    def __call__(self, x, residual=None):
        v = (x * self.pre_quant_scale).float()
        if self.per_token:
            row_max = v.abs().amax(dim=-1, keepdim=True).clamp_min_(self._TINY)
            full = torch.full_like(row_max, 127.0)
            x_q = torch.round(v * torch.div(full, row_max)).clamp_(-128.0, 127.0)
            sums = torch.ops.aten._weight_int8pack_mm(x_q, self.weight, self._ones)  # [M, N] f32 integer sums
            y = sums * (torch.div(row_max, full) * self.weight_scale)  # the kernel's order of products
        else:
            # v * (1 / act_scale), rounded to nearest even and saturated to [-128, 127], as TensorRT-LLM's
            # quantizedKernel
            x_q = torch.round(v * self.inv_act_scale).clamp_(-128.0, 127.0)  # [M, K] integer-valued f32
            y = torch.ops.aten._weight_int8pack_mm(x_q, self.weight, self.out_scale)
        # the bias joins the f32 result before the one rounding to the compute dtype, as in the kernel's epilogue
        return _plus((y if self.bias is None else y + self.bias.float()).to(self.dtype), residual)

    def nbytes(self) -> int:
        return _nbytes(self.weight, self.bias)


class NativeLinear:
    """Any format on bf16 activations in one call of the native kernel (csrc/cpu_kernels.cpp): the format's
    input quantization, a GEMV that streams the packed weight once, then output scale, bias and residual.

    Numerics as the torch classes above, except that scales apply to the f32 accumulator before the single
    rounding to bf16 (as TensorRT-LLM's GEMM epilogues do); FP8 stays 1 byte per weight in memory.
    W8A8_SQ_PER_CHANNEL runs on int8 x int8 dot products with int32 sums (csrc/int8_kernels.cpp, whose comment
    cites TensorRT-LLM's definition): x_q = sat_[-128, 127](rne(bf16(x * pre_quant_scale) * (1 / act_scale))),
    y = f32(sum x_q * q) * (act_scale * weight_scale), in the variant native.int8_variant() picks for this CPU.
    """

    row_invariant = True

    def __init__(
        self,
        ops,
        t: dict,
        quant_algo: str | None,
        dtype: torch.dtype,
        group_size: int | None,
        int8_variant: int | None = None,
    ):
        """`int8_variant`: the int8 kernel variant (its own weight layout) where it is not the one this CPU gets
        (native.int8_variant()), to compare variants."""
        from specdeploy.engine import native

        weight = t["weight"]
        self.ops, self.n = ops, weight.shape[0]
        self.group_scale, self.group_size, self.pre_quant_scale, self.act_scale = None, 0, None, 0.0
        bias = t.get("bias")
        self.bias = None if bias is None else bias.to(dtype).float().contiguous()  # the bf16 bias, in f32
        out_scale = None
        if quant_algo is None:
            self.kind, weight = native.BF16, weight.to(dtype)
        elif quant_algo == "FP8":
            self.kind, weight = native.FP8, weight.view(torch.uint8)
            act = t.get("act_scale")
            self.act_scale = 0.0 if act is None else float(act)
            out_scale = t["weight_scale"].float() * (1.0 if act is None else act.float())
        elif quant_algo == "W8A16":
            self.kind, out_scale = native.INT8, t["weight_scale"].to(dtype).float()
        elif quant_algo == "W4A16_AWQ":
            self.kind, self.group_size = native.INT4, group_size
            self.group_scale = t["weight_scale"].to(dtype).float().contiguous()
            self.pre_quant_scale = t["pre_quant_scale"].to(dtype).float().contiguous()
        else:  # W8A8_SQ_*: integer dot products (csrc/int8_kernels.cpp), per-tensor static act_scale or per token
            per_token = quant_algo == SQ_PER_TOKEN  # act_scale 0 tells the kernel: each row's own scale
            self.kind, self.act_scale = native.INT8_SQ, 0.0 if per_token else float(t["act_scale"])
            # the kernel's `group_size` slot carries its ISA variant, which has its own packed layout
            self.group_size = native.int8_variant() if int8_variant is None else int8_variant
            out_scale = t["weight_scale"].float() * (1.0 if per_token else t["act_scale"].float())
            self.pre_quant_scale = t["pre_quant_scale"].to(dtype).float().contiguous()
        self.k = weight.shape[1] * (2 if self.kind == native.INT4 else 1)
        self.out_scale = None if out_scale is None else out_scale.reshape(-1).expand(self.n).contiguous()
        if self.kind == native.INT8_SQ:
            self.packed = ops.int8_pack(weight.contiguous(), self.group_size)
        else:
            self.packed = ops.pack(weight.contiguous(), self.kind, self.k)

    @staticmethod
    def supports(ops, t: dict, quant_algo: str | None, group_size: int | None) -> bool:
        """Shapes the native kernel (`ops`) takes: K a multiple of its format's step in this build (16 f32 lanes
        with AVX-512, 32 for bf16 with AVX512-BF16, 8 with AVX2); AWQ groups a power of two >= that step."""
        from specdeploy.engine import native

        if quant_algo in ("W8A8_SQ_PER_CHANNEL", SQ_PER_TOKEN):
            return True  # the integer kernels pad K to their step
        kind = {None: native.BF16, "FP8": native.FP8, "W4A16_AWQ": native.INT4}.get(quant_algo, native.INT8)
        step = int(ops.k_multiple(kind))
        k = t["weight"].shape[1] * (2 if quant_algo == "W4A16_AWQ" else 1)
        if quant_algo == "W4A16_AWQ" and not (group_size and group_size >= step and group_size & (group_size - 1) == 0):
            return False
        return k % step == 0

    def args(self) -> tuple:
        """The native kernel's arguments after x: (packed, kind, N, group_scale, group_size, pre_quant_scale,
        act_scale, out_scale, bias), as `linear` and `Decoder.set_linear` take them."""
        return (
            self.packed,
            self.kind,
            self.n,
            self.group_scale,
            self.group_size,
            self.pre_quant_scale,
            self.act_scale,
            self.out_scale,
            self.bias,
        )

    def __call__(self, x, residual=None):
        return self.ops.linear(x.contiguous(), *self.args(), residual)

    def nbytes(self) -> int:
        return _nbytes(self.packed, self.group_scale, self.pre_quant_scale, self.out_scale, self.bias)


def make_linear(t: dict, quant_algo: str | None, dtype: torch.dtype, group_size: int | None, native_ops=None):
    """The runtime layer for one linear's engine tensors (names without the layer prefix): the native
    kernel when `native_ops` is given (bf16 engines) and takes the shapes, else torch ops."""
    if native_ops is not None and NativeLinear.supports(native_ops, t, quant_algo, group_size):
        return NativeLinear(native_ops, t, quant_algo, dtype, group_size)
    if quant_algo is None:
        return DenseLinear(t, dtype)
    if quant_algo == "FP8":
        return Fp8Linear(t, dtype)
    if quant_algo == "W8A16":
        return Int8WeightOnlyLinear(t, dtype)
    if quant_algo == "W4A16_AWQ":
        return Int4AwqLinear(t, dtype, group_size)
    if quant_algo in ("W8A8_SQ_PER_CHANNEL", SQ_PER_TOKEN):
        return SmoothQuantLinear(t, dtype, per_token=quant_algo == SQ_PER_TOKEN)
    raise AssertionError(f"compile.py lets no other quant_algo through: {quant_algo}")


def dequantize(t: dict, quant_algo: str | None, group_size: int | None) -> torch.Tensor:
    """The f32 weight [N, K] a quantized linear represents (for tests and references)."""
    w = t["weight"]
    if quant_algo is None:
        return w.float()
    if quant_algo == "W4A16_AWQ":
        q = unpack_int4(w).float() - 8.0
        return q * t["weight_scale"].float().repeat_interleave(group_size, dim=1)
    scale = t["weight_scale"].float()
    return w.float() * (scale[:, None] if scale.dim() == 1 else scale)


def pack_int4(unsigned: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K/2] uint8, low nibble = even k."""
    u = unsigned.to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] uint8 values 0..15."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def _plus(y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return y if residual is None else residual + y


def _opt(t: dict, name: str, dtype):
    value = t.get(name)
    return None if value is None else value.to(dtype).contiguous()


def _nbytes(*tensors) -> int:
    return sum(x.numel() * x.element_size() for x in tensors if x is not None)
