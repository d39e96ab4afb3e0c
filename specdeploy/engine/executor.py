"""What a TensorRT-LLM `tensorrt_llm` model does for one request, over a CPU engine.

`Executor(engine).generate(GenerationRequest)` yields `GenerationChunk`s. A plain request decodes
up to `max_new_tokens` tokens (greedy or sampled, see `specdeploy.speculative.is_greedy`). A
request with `draft_tokens` runs one target pass over input + draft, accepts per
`specdeploy.speculative` and returns the accepted prefix plus one token of its own: TensorRT-LLM's
`draft_tokens_external` semantics.

Prefix KV reuse across calls (TensorRT-LLM's `enable_kv_cache_reuse`): finished requests leave
their KV cache in a small LRU pool; a request whose input starts with cached tokens truncates that
cache to the common prefix (the position pointer moves back) and computes only the suffix. The
speculative loop sends the whole sequence every round, so each round computes only its new tokens.
Memory is bounded by `max_cached_sequences` caches of at most `cache_len` positions each.

The engine API used (CONTRACTS.md): `engine.spec` (vocab_size, max_seq_len, max_draft_len),
`engine.new_cache(max_len)` -> cache with `.length` and `.truncate(n)`, and
`engine.forward(cache, LongTensor[n]) -> FloatTensor[n, vocab]` (appends n positions).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from specdeploy import speculative as spec
from specdeploy.errors import ConfigError
from specdeploy.speculative import SamplingParams


@dataclass
class GenerationRequest:
    input_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    end_id: int | None = None
    pad_id: int | None = None
    stop_words: list[list[int]] = field(default_factory=list)
    bad_words: list[list[int]] = field(default_factory=list)
    draft_tokens: list[int] | None = None
    draft_logits: torch.Tensor | None = None  # [k, vocab], the draft's generation logits
    return_logits: bool = False
    streaming: bool = False


@dataclass
class GenerationStats:
    drafted: int = 0
    accepted: int = 0
    iterations: int = 0  # engine forward passes
    input_tokens: int = 0
    reused_tokens: int = 0  # input positions whose KV came from the pool
    computed_tokens: int = 0  # positions run through the engine
    output_tokens: int = 0
    first_forward_time_s: float = 0.0  # the pass over the uncached suffix (and draft tokens)
    forward_time_s: float = 0.0  # all engine passes
    first_token_time_s: float = 0.0  # from the call to the first token
    total_time_s: float = 0.0


@dataclass
class GenerationChunk:
    token_ids: list[int]  # new tokens of this chunk
    logits: torch.Tensor | None = None  # [len(token_ids), vocab]: the (bad-words-masked) logits each was chosen from
    finished: bool = False
    finish_reason: str | None = None  # "length" | "end_id" | "stop_words" | "draft" (a verification pass)
    stats: GenerationStats | None = None


@dataclass
class _Entry:
    """A KV cache and the tokens whose KV it holds (len(tokens) == cache.length)."""

    cache: object
    capacity: int
    tokens: list[int] = field(default_factory=list)


def reusable_prefix_len(cached_tokens: Sequence[int], input_ids: Sequence[int]) -> int:
    """How many leading input positions can keep their cached KV.

    The common prefix of the cached tokens and the input, less at least one position: the last
    input token is always run, since its logits choose the next token.

    This is also where the one subtle step of speculative decoding is handled. The draft samples
    its k tokens one after another and feeds each back except the last: its cache ends at
    sequence + d1..d(k-1). When the target accepts every draft token, the next round's sequence is
    sequence + d1..dk + t (t the target's own token), so the draft has never seen its own last token
    dk: the common prefix stops before dk and both dk and t (two positions) are computed. A loop
    that assumed "one new token per round" would run t at dk's position and silently diverge.
    """
    limit = min(len(cached_tokens), len(input_ids) - 1)
    if limit <= 0:
        return 0
    if cached_tokens[:limit] == input_ids[:limit]:  # the common case: input extends the cache
        return limit
    n = 0
    while n < limit and cached_tokens[n] == input_ids[n]:
        n += 1
    return n


def mask_bad_words(logits: torch.Tensor, sequence: Sequence[int], bad_words: Sequence[Sequence[int]]) -> torch.Tensor:
    """Set to -inf the last token of every bad word whose other tokens end `sequence` ([vocab] row)."""
    banned = []
    for word in bad_words:
        n = len(word)
        if n == 0:
            continue
        if n == 1 or (len(sequence) >= n - 1 and list(sequence[len(sequence) - (n - 1) :]) == list(word[:-1])):
            banned.append(word[-1])
    if not banned:
        return logits
    logits = logits.clone()
    logits[banned] = float("-inf")
    return logits


class Executor:
    """Runs requests on one engine, one at a time, keeping finished sequences' KV for reuse."""

    def __init__(self, engine, max_cached_sequences: int = 4, cache_len: int | None = None, clock=time.perf_counter):
        if max_cached_sequences < 1:
            raise ConfigError(f"max_cached_sequences is {max_cached_sequences}, must be >= 1")
        self.engine = engine
        self.max_cached_sequences = max_cached_sequences
        self.max_seq_len = int(engine.spec.max_seq_len)
        self.cache_len = min(cache_len or self.max_seq_len, self.max_seq_len)
        self.max_draft_len = int(getattr(engine.spec, "max_draft_len", 0) or 0)
        self._pool: OrderedDict[int, _Entry] = OrderedDict()  # LRU order: oldest first
        self._next_id = 0
        self._lock = threading.Lock()
        self._clock = clock

    # ------------------------------------------------------------ the KV pool

    @property
    def cached_sequences(self) -> list[list[int]]:
        return [list(e.tokens) for e in self._pool.values()]

    def kv_cache_bytes(self) -> int:
        """Bytes held by the pooled KV caches (caches that report `nbytes()`)."""
        return sum(int(e.cache.nbytes()) for e in self._pool.values() if hasattr(e.cache, "nbytes"))

    def clear_cache(self) -> None:
        with self._lock:
            self._pool.clear()

    def _acquire(self, input_ids: list[int], needed: int) -> tuple[_Entry, int]:
        """Take the pool entry sharing the longest prefix with input_ids, rolled back to that prefix."""
        with self._lock:
            best_id, best_len = None, 0
            for entry_id, entry in self._pool.items():
                n = reusable_prefix_len(entry.tokens, input_ids)
                if n > best_len and entry.capacity >= needed:
                    best_id, best_len = entry_id, n
            if best_id is not None:
                entry = self._pool.pop(best_id)
                entry.cache.truncate(best_len)  # the KV pointer moves back
                del entry.tokens[best_len:]
                return entry, best_len
            if len(self._pool) >= self.max_cached_sequences:
                _, victim = self._pool.popitem(last=False)  # evict the least recently used
                if victim.capacity >= needed:
                    victim.cache.truncate(0)
                    victim.tokens.clear()
                    return victim, 0
                del victim
        capacity = max(self.cache_len, needed)
        return _Entry(self.engine.new_cache(capacity), capacity), 0

    def _release(self, entry: _Entry) -> None:
        assert entry.cache.length == len(entry.tokens), (entry.cache.length, len(entry.tokens))
        with self._lock:
            self._pool[self._next_id] = entry
            self._next_id += 1
            while len(self._pool) > self.max_cached_sequences:
                self._pool.popitem(last=False)

    def _forward(self, entry: _Entry, tokens: list[int], stats: GenerationStats) -> torch.Tensor:
        t0 = self._clock()
        logits = self.engine.forward(entry.cache, torch.tensor(tokens, dtype=torch.long))  # [n, vocab]
        stats.forward_time_s += self._clock() - t0
        stats.iterations += 1
        stats.computed_tokens += len(tokens)
        entry.tokens.extend(tokens)
        return logits

    # ------------------------------------------------------------ requests

    def _check(self, request: GenerationRequest) -> None:
        n = len(request.input_ids)
        if n == 0:
            raise ConfigError("input_ids is empty", "send at least one token (e.g. the BOS token)")
        if request.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens is {request.max_new_tokens}, must be >= 1")
        k = len(request.draft_tokens or [])
        if k > self.max_draft_len:
            raise ConfigError(
                f"Number of draft tokens ({k}) is larger than maximum number of draft tokens ({self.max_draft_len})",
                "build the target engine with a larger max_draft_len (speculative.max_draft_len) or send fewer draft tokens",
            )
        if n + max(request.max_new_tokens, k + 1) > self.max_seq_len:
            raise ConfigError(
                f"input ({n} tokens) + output ({max(request.max_new_tokens, k + 1)}) exceeds the engine's max_seq_len {self.max_seq_len}",
                "shorten the prompt or ask for fewer tokens, or rebuild with a larger engine.max_seq_len",
            )
        if request.draft_logits is not None and tuple(request.draft_logits.shape[:1]) != (k,):
            raise ConfigError(f"draft_logits has shape {tuple(request.draft_logits.shape)}, expected [{k}, vocab]")

    def generate(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        """Run one request; yields chunks (one per token when streaming, else one), the last with
        finished=True, finish_reason and stats."""
        self._check(request)
        start = self._clock()
        stats = GenerationStats(input_tokens=len(request.input_ids))
        draft = list(request.draft_tokens or [])
        needed = len(request.input_ids) + max(request.max_new_tokens, len(draft) + 1)
        entry, reused = self._acquire(list(request.input_ids), needed)
        stats.reused_tokens = reused
        try:
            if draft:
                yield from self._verify(entry, request, draft, stats, start)
            else:
                yield from self._decode(entry, request, stats, start)
        finally:
            self._release(entry)

    def _decode(self, entry: _Entry, request: GenerationRequest, stats: GenerationStats, start: float) -> Iterator[GenerationChunk]:
        input_ids = list(request.input_ids)
        generator = None if spec.is_greedy(request.sampling) else spec.make_generator(request.sampling.seed)
        logits = self._forward(entry, input_ids[stats.reused_tokens :], stats)[-1]  # [vocab]
        stats.first_forward_time_s = stats.forward_time_s
        sequence = list(input_ids)
        output: list[int] = []
        kept_logits: list[torch.Tensor] = []
        pending = 0  # tokens not yet sent (non-streaming sends all at the end)
        while True:
            row = mask_bad_words(logits, sequence, request.bad_words)
            token = spec.choose_token(row, request.sampling, generator)
            if not output:
                stats.first_token_time_s = self._clock() - start
            output.append(token)
            sequence.append(token)
            pending += 1
            if request.return_logits:
                kept_logits.append(row)
            reason = None
            if spec.find_stop(sequence, len(sequence) - 1, request.end_id, request.stop_words) is not None:
                reason = "end_id" if token == request.end_id else "stop_words"
            elif len(output) >= request.max_new_tokens:
                reason = "length"
            if reason is not None:
                stats.output_tokens = len(output)
                stats.total_time_s = self._clock() - start
                yield self._chunk(output[-pending:], kept_logits[-pending:] if request.return_logits else None, reason, stats)
                return
            if request.streaming:
                yield self._chunk([token], kept_logits[-1:] if request.return_logits else None, None, None)
                pending = 0
            logits = self._forward(entry, [token], stats)[0]

    def _verify(self, entry: _Entry, request: GenerationRequest, draft: list[int], stats: GenerationStats, start: float) -> Iterator[GenerationChunk]:
        """One target pass over the uncached input suffix + the k draft tokens; accept; add one own token."""
        input_ids = list(request.input_ids)
        k = len(draft)
        n_in = len(input_ids)
        logits = self._forward(entry, input_ids[stats.reused_tokens :] + draft, stats)[-(k + 1) :]  # [k + 1, vocab]
        stats.first_forward_time_s = stats.forward_time_s
        context = input_ids + draft
        rows = logits
        if request.bad_words:
            rows = torch.stack([mask_bad_words(logits[i], context[: n_in + i], request.bad_words) for i in range(k + 1)])
        params = request.sampling
        if spec.is_greedy(params):
            num_accepted, next_token = spec.verify_greedy(draft, rows)
        else:
            generator = spec.make_generator(params.seed)
            target_probs = spec.sampling_distribution(rows, params)  # [k + 1, vocab]
            if request.draft_logits is not None:
                draft_rows = request.draft_logits.float()  # [k, vocab]
                if request.bad_words:
                    draft_rows = torch.stack([mask_bad_words(draft_rows[i], context[: n_in + i], request.bad_words) for i in range(k)])
                draft_probs = spec.sampling_distribution(draft_rows, params)  # [k, vocab]
                num_accepted, next_token = spec.verify_rejection(draft, draft_probs, target_probs, generator)
            else:
                num_accepted, next_token = spec.verify_token_match(draft, target_probs, generator)
        # Keep the KV of the accepted draft tokens only: the pointer moves back past the rejected ones.
        entry.cache.truncate(n_in + num_accepted)
        del entry.tokens[n_in + num_accepted :]
        output = (draft[:num_accepted] + [next_token])[: request.max_new_tokens]
        reason = "draft" if len(output) < request.max_new_tokens else "length"
        cut = spec.find_stop(input_ids + output, n_in, request.end_id, request.stop_words)
        if cut is not None:
            output = output[: cut - n_in]
            reason = "end_id" if output[-1] == request.end_id else "stop_words"
        stats.drafted, stats.accepted = k, num_accepted
        stats.output_tokens = len(output)
        stats.first_token_time_s = stats.total_time_s = self._clock() - start
        yield self._chunk(output, rows[: len(output)] if request.return_logits else None, reason, stats)

    @staticmethod
    def _chunk(tokens, logits, reason, stats) -> GenerationChunk:
        if isinstance(logits, list):
            logits = torch.stack(logits) if logits else None
        return GenerationChunk(list(tokens), logits, reason is not None, reason, stats)


def run(executor: Executor, request: GenerationRequest) -> GenerationChunk:
    """Drain a request into one chunk (all tokens, all logits, the final reason and stats)."""
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    last = None
    for chunk in executor.generate(request):
        tokens.extend(chunk.token_ids)
        if chunk.logits is not None:
            logits.append(chunk.logits)
        last = chunk
    assert last is not None and last.finished
    return GenerationChunk(tokens, torch.cat(logits) if logits else None, True, last.finish_reason, last.stats)
