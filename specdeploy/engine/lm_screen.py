"""A greedy step's LM head at int8 bytes, with the bf16 head's argmax: screen every token, recompute the few that can
win.

A decode step of the bundled model reads 107 MB of int8 layers and the 57 MB bf16 LM head (ModelOpt and
TensorRT-LLM keep lm_head unquantized, and `specdeploy build` refuses a quantized one), so on a machine that
streams ~20 GB/s the head alone is a third of the step. A greedy request needs only the argmax of each row.
`ScreenedHead` reads an int8 copy of the head instead (28 MB: one byte a weight, a bf16 scale a token), bounds how
far each screened logit can lie from the one the bf16 head computes, and recomputes with the bf16 kernel only the
tokens whose upper bound reaches the best lower bound: ~5 of 49,152 on chat text (the profile in docs/benchmarks.md).

Two screens, chosen by the CPU (`default_kind`):
  - "int8" (CPUs with VNNI): int8 x int8 dot products (the int8 SmoothQuant kernel, csrc/int8_kernels.cpp, per token,
    no smoothing). A row x is quantized as the kernel does (s1 q1, its own codes) and so is its residual
    bf16(x - s1 q1) (s2 q2): two kernel rows per row, one stream of the codes, A_j = their two outputs summed. The
    residual's codes make the activations' error ~1/127 of a single code's, so the bound stays as tight as W8A16's
    (the same few candidates a row on chat text; one code alone left tens to hundreds). The integer sums are exact
    and cheaper than W8A16's, whose f32 decode of every weight grows with the rows (docs/benchmarks.md "The LM
    screen on integer dot products").
  - "w8a16" (AVX2-only CPUs: their int8 kernel's cost grows with the rows about as fast, so two rows a row would gain
    nothing; the same section): the int8 weight-only kernel, f32 activations, so no activation rounding to bound.

Why the argmax is the bf16 head's, bit for bit. Per row x and token j, with R_j = sum_k x_k W_jk exact:
  - the bf16 head returns C_j = bf16(fl(sum_k x_k W_jk));
  - W8A16: the screen returns A_j = bf16(fl(fl(sum_k x_k q_jk) * s_j)) (W_jk ~ s_j q_jk);
    |s_j sum_k x_k q_jk - R_j| <= ||x|| * ||W_j - s_j q_j|| (Cauchy-Schwarz), the row norm measured exactly when
    the copy is made;
  - int8: A_j = fl(o1_j + o2_j), o_t = bf16(fl(fl(f32(sum_k q_t,k q_jk) * s_t) * s_j)), the int32 sums exact; with
    e = x - s1 q1 - s2 q2 (exact in double, per row) and x . W_j - (s1 q1 + s2 q2) . s_j q_j = x . (W_j - s_j q_j)
    + e . s_j q_j, the codes' part is within ||x|| ||W_j - s_j q_j|| + ||e|| ||s_j q_j||; each o_t lies within
    2^-8 |o_t| (and a few u) of its exact value, so A_j's roundings stay within 2^-8 (|A_j| + 2 |o2_j|);
  - a sum of K products rounded in any order lies within gamma_K * sum_k |x_k w_k| <= gamma_K ||x|| ||w|| of the
    exact one (gamma_K = K u / (1 - K u), u = 2^-24; Higham, Accuracy and Stability of Numerical Algorithms,
    2nd ed., section 3.1), and each bf16 rounding moves a value by at most 2^-8 of it.
Together |C_j - A_j| <= b_j = 0.0082 |A_j| + ||x|| c_j (W8A16; c_j: `slack`), or b_j = 0.0082 (|A_j| + |o2_j|) +
||x|| c_j + ||e|| d_j (int8; d_j: `slack_act`, 1.01 ||s_j q_j|| rounded up). Every token whose C_j can be the
row's maximum has A_j + b_j >= max_i (A_i - b_i); those candidates get their C_j from the bf16 kernel itself, on
their own rows packed as the head packs them (the kernel's bits do not depend on the block a channel sits in:
csrc/cpu_kernels.cpp `tile`), and every other token's logit is -inf. The argmax of the result, ties to the lowest
id, is the argmax of the full bf16 row. Anything else a caller may do with logits (sampling, log probs,
penalties, bias, bad words, min_tokens) needs the full row: the executor screens only requests that need none
of that (executor.argmax_only).

Up to MAX_ROWS rows a call (decode steps, verification passes of up to 7 drafts, batches of up to 8 steps): past
that the W8A16 kernel's f32 decode and products make it compute-bound and no faster than the bf16 head (measured in
docs/benchmarks.md); longer calls read the whole head.
"""

from __future__ import annotations

import os

import torch

from specdeploy.engine import native
from specdeploy.engine.kernels import NativeLinear

DISABLE_ENV = "SPECDEPLOY_LM_SCREEN"  # "0": greedy steps read the whole bf16 head (to compare)
BF16_ROUNDING = 0.0082  # two bf16 roundings (2^-8 each) and their cross terms, rounded up
INT8_MAX = 127
MAX_ROWS = 8  # rows a call screens (see the module docstring)
KINDS = ("int8", "w8a16")  # the screen's kernels (see the module docstring)
KIND_ENV = "SPECDEPLOY_LM_SCREEN_KIND"  # one of KINDS, to compare them
CHUNK = 4096  # tokens of the head at a time while the copy is made


def default_kind() -> str:
    """The screen's kernels: int8 x int8 where this CPU has VNNI, else W8A16 (SPECDEPLOY_LM_SCREEN_KIND overrides)."""
    kind = os.environ.get(KIND_ENV)
    if kind:
        return kind
    return "w8a16" if native.int8_variant() == native.INT8_AVX2 else "int8"


class ScreenedHead:
    """Greedy rows of the LM head `weight` [vocab, hidden] (bf16): `argmax_rows(x)` -> fp32 logits [rows, vocab],
    exact (the bf16 head's bits) for every token that can be a row's maximum, -inf for the others.
    `full(x)` is the bf16 head itself."""

    def __init__(self, ops, weight: torch.Tensor, full: NativeLinear, kind: str | None = None):
        assert weight.dtype == torch.bfloat16 and weight.dim() == 2, "the LM head's bf16 [vocab, hidden] weight"
        self.ops, self.full, self.weight = ops, full, weight  # weight: for the candidates' rows (tied: the embedding)
        self.vocab, self.hidden = weight.shape
        scale = torch.empty(self.vocab, dtype=torch.bfloat16)
        codes = torch.empty(self.vocab, self.hidden, dtype=torch.int8)
        slack = torch.empty(self.vocab, dtype=torch.float64)
        codes_norm = torch.empty(self.vocab, dtype=torch.float64)  # ||s_j q_j||
        gamma = 2.0 * (self.hidden + 8) * 2.0**-24  # gamma_K with room for the kernels' final lane sums
        for begin in range(0, self.vocab, CHUNK):  # in chunks: float64 copies of the whole head would hold ~0.7 GB
            w = weight[begin : begin + CHUNK].double()  # [chunk, hidden]
            amax = w.abs().amax(dim=1)
            # one bf16 scale per token (as NativeLinear keeps W8A16 scales); an all-zero row keeps scale 1, codes 0
            s = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax)).to(torch.bfloat16)
            q = torch.clamp(torch.round(w / s.double()[:, None]), -INT8_MAX, INT8_MAX)
            dequantized = s.double()[:, None] * q
            error = (w - dequantized).norm(dim=1)  # ||W_j - s_j q_j||, exact to double rounding
            codes_norm[begin : begin + CHUNK] = dequantized.norm(dim=1)
            slack[begin : begin + CHUNK] = 1.01 * error + gamma * (codes_norm[begin : begin + CHUNK] + w.norm(dim=1))
            scale[begin : begin + CHUNK], codes[begin : begin + CHUNK] = s, q.to(torch.int8)
        self.slack = (slack * (1 + 1e-6) + 1e-7).float()  # [vocab], c_j rounded up into f32
        self.kind = kind or default_kind()
        if self.kind == "int8":  # the codes through the int8 SmoothQuant kernel (see the module docstring)
            self.variant = native.int8_variant()
            self.packed = ops.int8_pack(codes, self.variant)
            self.out_scale = scale.float()
            self.slack_act = (codes_norm * (1.01 * (1 + 1e-6)) + 1e-7).float()  # [vocab], d_j rounded up into f32
            self.screen = None
        elif self.kind == "w8a16":
            self.screen = NativeLinear(ops, {"weight": codes, "weight_scale": scale}, "W8A16", torch.bfloat16, None)
        else:
            raise ValueError(f"screen kind {self.kind!r}: expected one of {KINDS}")
        self.max_candidates = max(1, self.vocab // 16)  # past this, reading the whole head is as cheap
        self.max_rows = MAX_ROWS
        self.rows = self.candidates = self.fallbacks = 0  # counts for profiles (bench/kernels.py)

    @staticmethod
    def supports(lm_head) -> bool:
        """Whether an engine's LM head can be screened: the native bf16 kernel with no bias, and not disabled."""
        return (
            isinstance(lm_head, NativeLinear)
            and lm_head.kind == native.BF16
            and lm_head.bias is None
            and os.environ.get(DISABLE_ENV, "1") != "0"
        )

    def nbytes(self) -> int:
        """Bytes of the screen a greedy step reads (its int8 copy, scales and bounds; the candidates' rows are a few
        KB)."""
        if self.kind == "int8":
            extra = sum(t.numel() * t.element_size() for t in (self.packed, self.out_scale, self.slack_act))
        else:
            extra = self.screen.nbytes()
        return extra + self.slack.numel() * self.slack.element_size()

    def screened(self, x: torch.Tensor) -> torch.Tensor:
        """The screen's own logits of x [rows, hidden] (bf16) before any bound: the int8 copy's (A), for tests."""
        if self.kind == "w8a16":
            return self.screen(x.contiguous())
        rows = self.ops.int8_linear(
            x.contiguous(), self.packed, self.vocab, self.variant, None, 0.0, self.out_scale, None, None
        )
        return rows.float()

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, hidden] (bf16, the final norm's output) -> fp32 [rows, vocab]: the bf16 head's logits for every
        token that can be its row's maximum, -inf elsewhere. Falls back to the whole head where the screen
        leaves too many candidates or sees non-finite values."""
        x = x.contiguous()
        self.rows += x.shape[0]
        if (
            self.kind == "int8"
        ):  # the codes of x and of its residual, the bound, the candidates' bf16 rows: one native call
            logits, candidates = self.ops.screen_logits_int8(
                x,
                self.packed,
                self.variant,
                self.out_scale,
                self.slack,
                self.slack_act,
                self.weight,
                BF16_ROUNDING,
                self.max_candidates,
            )
        else:
            screened = self.screen(x)  # [rows, vocab] bf16, A
            # ||x||, the candidates, their rows packed and run through the bf16 kernel, -inf elsewhere: one native call
            logits, candidates = self.ops.screen_logits(
                x, screened, self.slack, self.weight, BF16_ROUNDING, self.max_candidates
            )
        if candidates == 0:  # a non-finite value, or too many candidates
            self.fallbacks += 1
            return self.full(x).float()
        self.candidates += candidates
        return logits
