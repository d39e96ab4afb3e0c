"""Verification: the accept/reject math as pure functions, used by the draft-target loop and the fused loop.

A small **draft** model proposes `k` tokens; the **target** scores the `k + 1` positions in one
pass; the longest accepted prefix is kept and the target adds one token of its own. With greedy
decoding acceptance is an exact match, so the output is the target's own greedy output. With
sampling, the modified rejection sampling of Leviathan et al. 2023 ("Fast Inference from
Transformers via Speculative Decoding", arXiv:2211.17192, Algorithm 1) and Chen et al. 2023
("Accelerating Large Language Model Decoding with Speculative Sampling", arXiv:2302.01318,
Algorithm 2) keeps the target's distribution exactly.

Names say which model: `draft_probs` / `target_probs`, never p and q (the two papers swap them).
Randomness is always passed in as a `torch.Generator`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from specdeploy.speculation.sampling import SamplingParams, is_greedy


def greedy_token(logits: torch.Tensor) -> int:
    """The argmax of one logits row [vocab]; ties go to the lowest token id, a NaN wins (the first), as torch's CPU
    argmax. A float32 row goes through numpy's argmax, which agrees on both (tests/test_speculative.py) and is SIMD,
    an order of magnitude faster on a 49,152-token row, paid once a token per request (docs/benchmarks.md "Batched
    decode steps")."""
    if logits.dtype == torch.float32 and logits.dim() == 1 and logits.is_cpu:
        return int(np.argmax(logits.numpy()))
    return int(torch.argmax(logits))


def greedy_tokens(rows: torch.Tensor) -> list[int]:
    """greedy_token of each row of rows [n, vocab] (a verification pass; docs/benchmarks.md "The LM screen on integer
    dot products" has torch's argmax's cost there)."""
    if rows.dtype == torch.float32 and rows.dim() == 2 and rows.is_cpu:
        return np.argmax(rows.numpy(), axis=-1).tolist()
    return rows.argmax(-1).tolist()


def sampling_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [..., vocab] (fp32) that a token is drawn from: temperature, then top-k, then top-p.

    Greedy parameters give the one-hot argmax. Ties at the top-k boundary are kept (like
    Hugging Face's TopKLogitsWarper). top-p keeps the smallest prefix of the sorted distribution
    whose mass reaches top_p (at least one token), computed after top-k, as TensorRT-LLM's
    combined top-k/top-p sampling does.
    """
    logits = logits.float()
    if is_greedy(params):
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    scaled = logits / params.temperature  # [..., vocab]
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [..., vocab]
    if 0.0 < params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # exclusive cumulative sum
        drop_sorted = mass_before >= params.top_p  # the first token is never dropped (mass_before 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_token(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a probability row [vocab]."""
    return int(torch.multinomial(probs, 1, generator=generator))


def choose_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token from one logits row [vocab]: argmax when greedy, else a draw."""
    if is_greedy(params):
        return greedy_token(logits)
    assert generator is not None, "sampling needs a generator"
    return sample_token(sampling_distribution(logits, params), generator)


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with `seed`, or with fresh entropy when seed is None."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return generator


# ---------------------------------------------------------------- verification (pure math)


def verify_greedy(draft_tokens: Sequence[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification: accept the longest prefix of `draft_tokens` equal to the target's argmax.

    draft_tokens: k ids; target_logits: [k + 1, vocab], row i scores the position of draft_tokens[i]
    (row k follows the last draft token). Returns (num_accepted, next_token) where next_token is the
    target's argmax at the first mismatch (or after the last draft token when all are accepted), so
    the output is the target's own greedy continuation.
    """
    k = len(draft_tokens)
    assert target_logits.shape[0] == k + 1, (target_logits.shape, k)
    target_tokens = greedy_tokens(target_logits)  # [k + 1]
    num_accepted = 0
    while num_accepted < k and draft_tokens[num_accepted] == target_tokens[num_accepted]:
        num_accepted += 1
    return num_accepted, target_tokens[num_accepted]


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, target - draft)) [..., vocab]: where to draw from after a rejection.

    Leviathan et al. 2023, Algorithm 1 (p'(x) = norm(max(0, q(x) - p(x))) in their letters, q the
    target); Chen et al. 2023, Algorithm 2. When the two rows are equal the residual has no mass
    (a rejection then has probability 0); the target row is returned so the result stays a
    distribution.
    """
    residual = torch.clamp(target_probs - draft_probs, min=0.0)  # [..., vocab]
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), target_probs)


def verify_rejection(
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> tuple[int, int]:
    """Modified rejection sampling (Leviathan et al. 2023 Alg. 1; Chen et al. 2023 Alg. 2).

    draft_tokens: k ids, each drawn from the matching row of draft_probs [k, vocab];
    target_probs: [k + 1, vocab]. Draft token i is accepted with probability
    min(1, target_probs[i, x] / draft_probs[i, x]); at the first rejection the next token is drawn
    from residual_distribution(target_probs[i], draft_probs[i]); when all k are accepted it is drawn
    from target_probs[k]. Every emitted token is then distributed exactly as the target's.
    Returns (num_accepted, next_token).
    """
    k = len(draft_tokens)
    assert draft_probs.shape[0] == k and target_probs.shape[0] == k + 1, (draft_probs.shape, target_probs.shape, k)
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64).tolist()  # one draw per position
    for i, token in enumerate(draft_tokens):
        draft_p = float(draft_probs[i, token])
        target_p = float(target_probs[i, token])
        # accept with probability min(1, target_p / draft_p); draft_p == 0 cannot be drawn, but
        # guard it: accept only if the target gives the token mass.
        accept = uniforms[i] * draft_p < target_p if draft_p > 0 else target_p > 0
        if not accept:
            return i, sample_token(residual_distribution(target_probs[i], draft_probs[i]), generator)
    return k, sample_token(target_probs[k], generator)


def verify_token_match(
    draft_tokens: Sequence[int], target_probs: torch.Tensor, generator: torch.Generator
) -> tuple[int, int]:
    """Sampling without draft probabilities: the target draws its own token at each position and the
    draft token is accepted while they agree (TensorRT-LLM's acceptance when no draft logits are
    given). Each emitted token is a target draw given its prefix, so the distribution is the
    target's; acceptance is lower than with `verify_rejection`. Returns (num_accepted, next_token).
    """
    k = len(draft_tokens)
    assert target_probs.shape[0] == k + 1, (target_probs.shape, k)
    for i in range(k + 1):
        token = sample_token(target_probs[i], generator)
        if i == k or token != draft_tokens[i]:
            return i, token
    raise AssertionError("unreachable")


@dataclass
class RoundStats:
    """The rounds of one speculative generation, kept alike by the draft-target loop (SpecStats) and the fused
    EAGLE-3 loop (the engine's GenerationStats). A round is one target call after the prefill: k_per_round[i] draft
    tokens asked for (0: a plain step or run), accepted_per_round[i] of them accepted, lookup_per_round[i] 1 where the
    drafts were the request's own text (suffix lookup) rather than the draft model's or head's; beside them the
    seconds of the draft's work and of the target call."""

    drafted: int = 0
    accepted: int = 0
    accepted_per_round: list[int] = field(default_factory=list)
    k_per_round: list[int] = field(default_factory=list)
    lookup_per_round: list[int] = field(default_factory=list)
    draft_s_per_round: list[float] = field(default_factory=list)
    target_s_per_round: list[float] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.k_per_round)

    @property
    def speculated_share(self) -> float:
        """Share of rounds that asked the draft for tokens."""
        return sum(1 for k in self.k_per_round if k > 0) / len(self.k_per_round) if self.k_per_round else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0
