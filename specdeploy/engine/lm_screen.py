"""A greedy step's LM head at int8 bytes, with the bf16 head's argmax: screen every token, recompute the few that can win.

A decode step of the bundled model reads 107 MB of int8 layers and the 57 MB bf16 LM head (ModelOpt and
TensorRT-LLM keep lm_head unquantized, and `specdeploy build` refuses a quantized one), so on a machine that
streams ~20 GB/s the head alone is a third of the step. A greedy request needs only the argmax of each row.
`ScreenedHead` reads an int8 copy of the head instead (28 MB: one byte a weight, a bf16 scale a token, through the
int8 weight-only kernel: f32 activations, so no activation rounding to bound), bounds how far each screened logit
can lie from the one the bf16 head computes, and recomputes with the bf16 kernel only the tokens whose upper bound
reaches the best lower bound: ~5 of 49,152 on chat text (the profile in docs/benchmarks.md).

Why the argmax is the bf16 head's, bit for bit. Per row x and token j, with R_j = sum_k x_k W_jk exact:
  - the bf16 head returns C_j = bf16(fl(sum_k x_k W_jk));
  - the screen returns A_j = bf16(fl(fl(sum_k x_k q_jk) * s_j)) (W_jk ~ s_j q_jk);
  - |s_j sum_k x_k q_jk - R_j| <= ||x|| * ||W_j - s_j q_j|| (Cauchy-Schwarz), the row norm measured exactly when
    the copy is made;
  - a sum of K products rounded in any order lies within gamma_K * sum_k |x_k w_k| <= gamma_K ||x|| ||w|| of the
    exact one (gamma_K = K u / (1 - K u), u = 2^-24; Higham, Accuracy and Stability of Numerical Algorithms,
    2nd ed., section 3.1), and each bf16 rounding moves a value by at most 2^-8 of it.
Together |C_j - A_j| <= b_j = 0.0082 |A_j| + ||x|| c_j (c_j: `slack`). Every token whose C_j can be the row's
maximum has A_j + b_j >= max_i (A_i - b_i); those candidates get their C_j from the bf16 kernel itself, on
their own rows packed as the head packs them (the kernel's bits do not depend on the block a channel sits in:
csrc/cpu_kernels.cpp `tile`), and every other token's logit is -inf. The argmax of the result, ties to the lowest
id, is the argmax of the full bf16 row. Anything else a caller may do with logits (sampling, log probs,
penalties, bias, bad words, min_tokens) needs the full row: the executor screens only requests that need none
of that (executor.argmax_only).

Up to MAX_ROWS rows a call (decode steps, verification passes of up to 7 drafts, batches of up to 8 steps): past
that the int8 kernel's f32 decode and products make it compute-bound and no faster than the bf16 head (measured in
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
CHUNK = 4096  # tokens of the head at a time while the copy is made


class ScreenedHead:
    """Greedy rows of the LM head `weight` [vocab, hidden] (bf16): `argmax_rows(x)` -> fp32 logits [rows, vocab],
    exact (the bf16 head's bits) for every token that can be a row's maximum, -inf for the others.
    `full(x)` is the bf16 head itself."""

    def __init__(self, ops, weight: torch.Tensor, full: NativeLinear):
        assert weight.dtype == torch.bfloat16 and weight.dim() == 2, "the LM head's bf16 [vocab, hidden] weight"
        self.ops, self.full, self.weight = ops, full, weight  # weight: for the candidates' rows (tied: the embedding)
        self.vocab, self.hidden = weight.shape
        scale = torch.empty(self.vocab, dtype=torch.bfloat16)
        codes = torch.empty(self.vocab, self.hidden, dtype=torch.int8)
        slack = torch.empty(self.vocab, dtype=torch.float64)
        gamma = 2.0 * (self.hidden + 8) * 2.0**-24  # gamma_K with room for the kernels' final lane sums
        for begin in range(0, self.vocab, CHUNK):  # in chunks: float64 copies of the whole head would hold ~0.7 GB
            w = weight[begin : begin + CHUNK].double()  # [chunk, hidden]
            amax = w.abs().amax(dim=1)
            # one bf16 scale per token (as NativeLinear keeps W8A16 scales); an all-zero row keeps scale 1, codes 0
            s = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax)).to(torch.bfloat16)
            q = torch.clamp(torch.round(w / s.double()[:, None]), -INT8_MAX, INT8_MAX)
            dequantized = s.double()[:, None] * q
            error = (w - dequantized).norm(dim=1)  # ||W_j - s_j q_j||, exact to double rounding
            slack[begin : begin + CHUNK] = 1.01 * error + gamma * (dequantized.norm(dim=1) + w.norm(dim=1))
            scale[begin : begin + CHUNK], codes[begin : begin + CHUNK] = s, q.to(torch.int8)
        self.screen = NativeLinear(ops, {"weight": codes, "weight_scale": scale}, "W8A16", torch.bfloat16, None)
        self.slack = (slack * (1 + 1e-6) + 1e-7).float()  # [vocab], c_j rounded up into f32
        self.max_candidates = max(1, self.vocab // 16)  # past this, reading the whole head is as cheap
        self.max_rows = MAX_ROWS
        self.rows = self.candidates = self.fallbacks = 0  # counts for profiles (bench/kernels.py)

    @staticmethod
    def supports(lm_head) -> bool:
        """Whether an engine's LM head can be screened: the native bf16 kernel with no bias, and not disabled."""
        return (isinstance(lm_head, NativeLinear) and lm_head.kind == native.BF16 and lm_head.bias is None
                and os.environ.get(DISABLE_ENV, "1") != "0")

    def nbytes(self) -> int:
        """Bytes of the screen a greedy step reads (its int8 copy, scales and bounds; the candidates' rows are a few KB)."""
        return self.screen.nbytes() + self.slack.numel() * self.slack.element_size()

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, hidden] (bf16, the final norm's output) -> fp32 [rows, vocab]: the bf16 head's logits for every
        token that can be its row's maximum, -inf elsewhere. Falls back to the whole head where the screen
        leaves too many candidates or sees non-finite values."""
        x = x.contiguous()
        self.rows += x.shape[0]
        screened = self.screen(x)  # [rows, vocab] bf16, A
        # ||x||, the candidates, their rows packed and run through the bf16 kernel, -inf elsewhere: one native call
        logits, candidates = self.ops.screen_logits(x, screened, self.slack, self.weight, BF16_ROUNDING, self.max_candidates)
        if candidates == 0:  # a non-finite value, or too many candidates
            self.fallbacks += 1
            return self.full(x).float()
        self.candidates += candidates
        return logits
