"""Speculative decoding: the accept/reject math as pure functions, and the transport-free loop.

A small **draft** model proposes `k` tokens; the **target** scores the `k + 1` positions in one
pass; the longest accepted prefix is kept and the target adds one token of its own. With greedy
decoding acceptance is an exact match, so the output is the target's own greedy output. With
sampling, the modified rejection sampling of Leviathan et al. 2023 ("Fast Inference from
Transformers via Speculative Decoding", arXiv:2211.17192, Algorithm 1) and Chen et al. 2023
("Accelerating Large Language Model Decoding with Speculative Sampling", arXiv:2302.01318,
Algorithm 2) keeps the target's distribution exactly.

Names say which model: `draft_probs` / `target_probs`, never p and q (the two papers swap them).
Randomness is always passed in as a `torch.Generator`.

The loop (`speculative_generate`) is one BLS round at a time and knows nothing of transport: it
talks to a `Proposer` (the draft) and a `Verifier` (the target). Local adapters over
`specdeploy.engine.executor.Executor` live in `specdeploy.generate`; the Triton BLS model adapts
the same two protocols to BLS calls of the `tensorrt_llm_draft` and `tensorrt_llm` models.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np
import torch

from specdeploy.errors import ConfigError
from specdeploy.policy import RequestPolicy, RoundOutcome

# ---------------------------------------------------------------- sampling parameters


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, with TensorRT-LLM's meaning (see `is_greedy`).

    top_k = 0 and top_p = 0 mean "not set". seed None means "draw one".
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0 or self.temperature == float("inf"):  # NaN fails >=; NaN logits break sampling
            raise ConfigError(f"temperature is {self.temperature}, must be a finite number >= 0")
        if self.top_k < 0:
            raise ConfigError(f"top_k is {self.top_k}, must be >= 0 (0 = not set)")
        if not 0.0 <= self.top_p <= 1.0:
            raise ConfigError(f"top_p is {self.top_p}, must be in [0, 1] (0 = not set)")


GREEDY = SamplingParams()


def is_greedy(params: SamplingParams) -> bool:
    """True when a request decodes greedily.

    TensorRT-LLM's C++ runtime has no `do_sample`: a request that sets neither top_k
    (`runtime_top_k`) nor top_p (`runtime_top_p`), or sets both to 0, is decoded greedily and its
    temperature has no effect. Found with the search tool:
      - NVIDIA/TensorRT-LLM issue #646 (maintainer byshiue): "When both topk and topp are 0, TRT LLM
        will set it to greedy search automatically."
      - NVIDIA/TensorRT-LLM issue #1341 (byshiue): "temperature does not bring effect on greedy
        search"; the reporter: "top_k and top_p by default were 1 and 0, which makes temperature
        redundant."
      - deepjavalibrary/djl-serving PR #1659 (TensorRT-LLM parameter unification): "if top_p=0 and
        top_k=0, then it automatically does greedy".
    top_k == 1 (argmax of the filtered distribution) and temperature == 0 (the limit of
    temperature scaling) are the same argmax, so they are greedy here too: exact-match verification
    is then the rejection rule itself, and outputs agree token for token.
    """
    if params.top_k == 1 or params.temperature == 0.0:
        return True
    return params.top_k <= 0 and params.top_p <= 0.0


def greedy_token(logits: torch.Tensor) -> int:
    """The argmax of one logits row [vocab]; ties go to the lowest token id, a NaN wins (the first), as torch's CPU
    argmax. A float32 row goes through numpy's argmax, which agrees on both (tests/test_speculative.py) and is SIMD:
    9 us against torch's 104-144 us on a 49,152-token row (2-core Xeon, 2026-11-29), paid once a token per request."""
    if logits.dtype == torch.float32 and logits.dim() == 1 and logits.is_cpu:
        return int(np.argmax(logits.numpy()))
    return int(torch.argmax(logits))


def greedy_tokens(rows: torch.Tensor) -> list[int]:
    """greedy_token of each row of rows [n, vocab] (a verification pass: 0.36 ms a pass of ~3 rows through torch's
    argmax in the fused loop's profile, 2-core Xeon, 2026-11-29)."""
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


def verify_token_match(draft_tokens: Sequence[int], target_probs: torch.Tensor, generator: torch.Generator) -> tuple[int, int]:
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


# ---------------------------------------------------------------- the loop


@dataclass(frozen=True)
class Proposal:
    """What the draft returns: up to k tokens and, when asked, their logits [len(tokens), vocab]."""

    tokens: list[int]
    logits: torch.Tensor | None = None


class Proposer(Protocol):
    """The draft side of a round (a local Executor, or a BLS call to `tensorrt_llm_draft`).

    Given the whole sequence so far (prompt + output), return up to `num_tokens` new tokens sampled
    with `sampling` (greedy or not, as `is_greedy` says), with their generation logits when
    `return_logits`. It may return fewer (e.g. it produced the end id).
    """

    def propose(self, sequence: list[int], num_tokens: int, sampling: SamplingParams, return_logits: bool) -> Proposal: ...


class Verifier(Protocol):
    """The target side of a round (a local Executor, or a BLS call to `tensorrt_llm` with
    `draft_input_ids`, `draft_logits` and `request_output_len = k + 1`).

    Score `sequence + draft_tokens` in one pass and return the accepted prefix of draft_tokens plus
    one token of the target's own (greedy exact match, or rejection sampling when `draft_logits`
    [k, vocab] is given and sampling, or token matching when sampling without logits). An empty
    draft means: generate one token, or `output_len` plain tokens in this one call (a plain run; the
    loop passes `output_len` only when it is above 1, and the target stops early on the end id or a
    stop word as it does alone).
    """

    def verify(
        self, sequence: list[int], draft_tokens: list[int], draft_logits: torch.Tensor | None, sampling: SamplingParams,
        output_len: int | None = None,
    ) -> list[int]: ...


@dataclass
class SpecStats:
    """Counts and timings of one speculative generation (the metrics of docs/operations.md)."""

    drafted: int = 0
    accepted: int = 0
    target_iterations: int = 0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    output_tokens: int = 0
    finish_reason: str = ""
    accepted_per_round: list[int] = field(default_factory=list)
    k_per_round: list[int] = field(default_factory=list)  # draft tokens asked for, per round (0: a plain step or run)
    lookup_per_round: list[int] = field(default_factory=list)  # fused EAGLE-3: 1 where the round's drafts were the suffix lookup's
    # beside k_per_round, seconds: the draft's work and the target call of each round (fused EAGLE-3: the head's work
    # and the verification pass; the prefill pass, which no round holds, in prefill_s)
    draft_s_per_round: list[float] = field(default_factory=list)
    target_s_per_round: list[float] = field(default_factory=list)
    prefill_s: float = 0.0
    plain_run_tokens: int = 0  # tokens generated by plain runs (k = 0 rounds that asked for more than one token)
    plain_runs: int = 0  # such rounds (each one target call, a target pass per token)
    policy: str = "static"

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

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per target call: output tokens / target iterations."""
        return self.output_tokens / self.target_iterations if self.target_iterations else 0.0

    @property
    def target_passes(self) -> int:
        """Target forward passes: one per call, except a plain run, which is one call but a pass per token."""
        return self.target_iterations - self.plain_runs + self.plain_run_tokens


def round_sampling(sampling: SamplingParams, base_seed: int, round_index: int, role: str) -> SamplingParams:
    """The sampling parameters of one call in one round, with its own seed.

    The draft's draws and the target's acceptance draws must be independent, and rounds must not
    repeat each other's random numbers; sending the request's seed unchanged to every call would
    correlate them (same seed, same stream) and bias the output. Each call gets a seed derived from
    (seed, round, role), so a seeded request is still reproducible.
    """
    if is_greedy(sampling):
        return sampling
    digest = hashlib.blake2b(f"{base_seed}:{round_index}:{role}".encode(), digest_size=8).digest()
    return replace(sampling, seed=int.from_bytes(digest, "little") >> 1)


def find_stop(tokens: Sequence[int], start: int, end_id: int | None, stop_words: Sequence[Sequence[int]]) -> int | None:
    """The length to cut `tokens` to if a stop condition ends at or after index `start`, else None.

    The end id and stop words stay in the output (as in TensorRT-LLM's output_ids); stop words may
    begin before `start` (across rounds).
    """
    for i in range(start, len(tokens)):
        if end_id is not None and tokens[i] == end_id:
            return i + 1
        for word in stop_words:
            n = len(word)
            if n and i + 1 >= n and list(tokens[i + 1 - n : i + 1]) == list(word):
                return i + 1
    return None


def speculative_generate(
    draft: Proposer,
    target: Verifier,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    num_draft_tokens: int,
    sampling: SamplingParams = GREEDY,
    end_id: int | None = None,
    stop_words: Sequence[Sequence[int]] = (),
    use_draft_logits: bool = False,
    clock=time.perf_counter,
    policy: RequestPolicy | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[list[int] | SpecStats]:
    """Draft-target speculative decoding, one BLS round at a time (the BLS round of NVIDIA's tensorrt_llm_bls).

    Each round: cap = min(num_draft_tokens, remaining - 1) and k = cap, or what `policy` chooses in
    0..cap (specdeploy.policy; k = 0 is a plain target step). A k = 0 round is one target call for
    `policy.plain_tokens(remaining)` tokens (a plain run; without a policy all that remain, since the
    cap then is 0 only when nothing can be drafted); the draft proposes k tokens from the
    current sequence (with logits when `use_draft_logits` and sampling); the target verifies them and
    returns the accepted prefix plus one token of its own; the policy gets the round's outcome.
    Stops on length, end id, stop words (matched over prompt + output, as the target alone does, so a
    stop word may begin in the prompt), no progress (the target returned nothing), or when
    `should_stop()` turns true between rounds (finish_reason "cancelled").

    Yields each round's new tokens (a list[int]) as they come, and finally one SpecStats.
    """
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens is {max_new_tokens}, must be >= 1")
    if num_draft_tokens < 0:
        raise ConfigError(f"num_draft_tokens is {num_draft_tokens}, must be >= 0")
    greedy = is_greedy(sampling)
    want_logits = use_draft_logits and not greedy
    base_seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, (1,)))
    sequence = list(prompt_ids)  # prompt + output
    prompt_len = len(sequence)
    stats = SpecStats(policy=policy.name if policy is not None else "static")
    round_index = 0
    draft_fresh = False  # the draft has seen the sequence up to its last round (not after the prompt or a k = 0 round)
    while True:
        if should_stop is not None and should_stop():
            stats.finish_reason = "cancelled"
            break
        remaining = max_new_tokens - (len(sequence) - prompt_len)
        cap = max(0, min(num_draft_tokens, remaining - 1))
        k = policy.choose(cap) if policy is not None else cap
        assert 0 <= k <= cap, (k, cap)
        proposal = Proposal([])
        draft_s = 0.0
        run = 1  # plain tokens asked of the target when k = 0
        if k == 0:
            # a policy written before plain runs existed (no plain_tokens) keeps one token per round
            run = remaining if policy is None else getattr(policy, "plain_tokens", lambda _: 1)(remaining)
            assert 1 <= run <= max(1, remaining), (run, remaining)
        if k > 0:
            t0 = clock()
            proposal = draft.propose(sequence, k, round_sampling(sampling, base_seed, round_index, "draft"), want_logits)
            draft_s = clock() - t0
            stats.draft_time_s += draft_s
            proposal = Proposal(proposal.tokens[:k], None if proposal.logits is None else proposal.logits[:k])
            stats.drafted += len(proposal.tokens)
            if not proposal.tokens and policy is not None:
                # Nothing to verify (an n-gram draft without a match): a plain run as the policy sizes it,
                # not a call for one token (served, a call costs ~half a step beyond its pass).
                run = getattr(policy, "empty_run", lambda _: 1)(remaining)
                assert 1 <= run <= max(1, remaining), (run, remaining)
                k = 0 if run > 1 else k
        t0 = clock()
        target_sampling = round_sampling(sampling, base_seed, round_index, "target")
        if run > 1:
            new = target.verify(sequence, [], None, target_sampling, output_len=run)
            stats.plain_run_tokens += min(len(new), remaining)
            stats.plain_runs += 1
        else:
            new = target.verify(sequence, list(proposal.tokens), proposal.logits if want_logits else None, target_sampling)
        target_s = clock() - t0
        stats.target_time_s += target_s
        stats.target_iterations += 1
        stats.k_per_round.append(k)
        stats.draft_s_per_round.append(draft_s)
        stats.target_s_per_round.append(target_s)
        round_index += 1
        accepted = _accepted_count(proposal.tokens, new)
        if policy is not None:
            policy.record(RoundOutcome(k, len(proposal.tokens), accepted, len(new), draft_s, target_s,
                                       draft_fresh=draft_fresh, first_round=round_index == 1, plain_run=run))
        draft_fresh = k > 0
        if not new:
            stats.finish_reason = "no_progress"
            break
        stats.accepted += accepted
        stats.accepted_per_round.append(accepted)
        start = len(sequence)
        sequence.extend(new[:remaining])
        cut = find_stop(sequence, start, end_id, stop_words)
        if cut is not None:
            del sequence[cut:]
        new = sequence[start:]
        stats.output_tokens = len(sequence) - prompt_len
        if new:
            yield new
        if cut is not None:
            stats.finish_reason = "end_id" if end_id is not None and sequence[-1] == end_id else "stop_words"
            break
        if stats.output_tokens >= max_new_tokens:
            stats.finish_reason = "length"
            break
    yield stats


def _accepted_count(draft_tokens: Sequence[int], returned: Sequence[int]) -> int:
    """How many draft tokens the target kept: their common prefix. The target's own token never
    equals the draft token it replaces (greedy: a mismatch; rejection: the residual has no mass
    there), and a target that stopped early (end id inside the draft) returns only draft tokens."""
    n = 0
    limit = min(len(draft_tokens), len(returned))
    while n < limit and draft_tokens[n] == returned[n]:
        n += 1
    return n


def collect(run: Iterator[list[int] | SpecStats]) -> tuple[list[int], SpecStats]:
    """Drain a speculative_generate run: (all new tokens, stats)."""
    tokens: list[int] = []
    stats = SpecStats()
    for item in run:
        if isinstance(item, SpecStats):
            stats = item
        else:
            tokens.extend(item)
    return tokens, stats


def predicted_speedup(acceptance_rate: float, num_draft_tokens: int, cost_ratio: float, verify_cost: float = 1.0) -> float:
    """Leviathan et al. 2023 (arXiv:2211.17192): tokens per round (1 - a^(g+1)) / (1 - a) over cost g*c + 1.

    `verify_cost` is the target's (g+1)-row verification pass in target steps; the paper's model takes it
    as 1 (a GPU scores g+1 rows in about the time of one), a CPU pays more rows with more compute."""
    a, g = acceptance_rate, num_draft_tokens
    tokens_per_round = g + 1.0 if a >= 1.0 else (1.0 - a ** (g + 1)) / (1.0 - a)
    return tokens_per_round / (g * cost_ratio + verify_cost)
