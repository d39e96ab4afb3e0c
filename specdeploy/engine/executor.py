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

Per request it honours TensorRT-LLM's logits processing (embedding bias, temperature, repetition /
presence / frequency penalties over prompt + output, min_tokens, bad words: `specdeploy.engine.logits`,
applied per verified position in a draft verification pass too), log probs, context and generation
logits, cancellation and a deadline (checked between decode steps), the perf timestamps and the
`kv_cache_*` block counts (`TOKENS_PER_BLOCK` tokens per block).

The engine API used (CONTRACTS.md): `engine.spec` (vocab_size, max_seq_len, max_draft_len),
`engine.new_cache(max_len)` -> cache with `.length` and `.truncate(n)`, and
`engine.forward(cache, LongTensor[n]) -> FloatTensor[n, vocab]` (appends n positions).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from specdeploy import speculative as spec
from specdeploy.engine import logits as lp
from specdeploy.engine.logits import LogitsParams, mask_bad_words  # noqa: F401  (mask_bad_words: re-exported)
from specdeploy.errors import ConfigError
from specdeploy.speculative import SamplingParams

# Tokens per KV cache block for the kv_cache_* block counts: TensorRT-LLM's default
# (`PluginConfig._tokens_per_block = 32` in tensorrt_llm/plugin/plugin.py; older releases used 64).
TOKENS_PER_BLOCK = 32

# Positions per engine pass when a request's uncached input is long: cancellation and the deadline
# are checked between these chunks, so a cancelled long prompt stops within one chunk. The CPU
# engine's rows do not depend on how many positions a pass holds, so chunking changes no logits.
PREFILL_CHUNK = 128


@dataclass
class GenerationRequest:
    """One `tensorrt_llm` request. Logits processing (penalties, min_tokens, embedding bias, bad
    words) has TensorRT-LLM's meaning and order: see `specdeploy.engine.logits`."""

    input_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    end_id: int | None = None
    pad_id: int | None = None
    stop_words: list[list[int]] = field(default_factory=list)
    bad_words: list[list[int]] = field(default_factory=list)
    draft_tokens: list[int] | None = None
    draft_logits: torch.Tensor | None = None  # [k, vocab], the draft's (raw) generation logits
    # Fused EAGLE-3 (an Executor given a head): draft up to this many tokens per round inside the engine.
    # Greedy requests only; a sampled request decodes with the target alone (finish stats say fused=False).
    num_draft_tokens: int = 0
    return_logits: bool = False
    streaming: bool = False
    repetition_penalty: float = 1.0  # over prompt + output tokens, as TensorRT-LLM
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # the end id is banned until this request has generated min_tokens tokens
    embedding_bias: torch.Tensor | None = None  # [vocab] fp32, added to the logits
    return_log_probs: bool = False
    return_context_logits: bool = False  # [prompt_len, vocab] on the first chunk; disables prefix reuse
    is_cancelled: Callable[[], bool] | None = None  # polled between decode steps
    timeout_s: float | None = None  # deadline from the start of generate(), checked between steps


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
    # wall-clock stamps (time.time_ns()), TensorRT-LLM's perf outputs; 0 = not reached
    scheduled_time_ns: int = 0  # when generate() started work on the request (first_scheduled_time_ns)
    first_token_time_ns: int = 0  # when the first token was chosen (the real TTFT stamp, also in unary mode)
    last_token_time_ns: int = 0  # when the last token was chosen
    # KV cache blocks of TOKENS_PER_BLOCK tokens (Executor.tokens_per_block), as TensorRT-LLM reports them:
    # total = blocks covering input + output, reused = whole blocks of the reused prefix, new = total - reused
    kv_cache_alloc_new_blocks: int = 0
    kv_cache_reused_blocks: int = 0
    kv_cache_alloc_total_blocks: int = 0
    cum_log_prob: float = 0.0  # sum of the output tokens' log probs (with return_log_probs)
    # fused EAGLE-3 (Executor with a head, request.num_draft_tokens > 0): drafted/accepted above are the totals
    fused: bool = False  # the request ran the fused loop (False: target alone, e.g. a sampled request)
    draft_time_s: float = 0.0  # head time: catch-up rows and draft steps
    accepted_per_round: list[int] = field(default_factory=list)
    drafted_per_round: list[int] = field(default_factory=list)  # every verification pass after the prefill (0: a plain step)
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: rounds that drafted a token at position i
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: rounds whose token at position i was accepted


@dataclass
class GenerationChunk:
    token_ids: list[int]  # new tokens of this chunk
    logits: torch.Tensor | None = None  # [len(token_ids), vocab]: the raw engine logits each was chosen from (generation_logits)
    finished: bool = False
    # "length" | "end_id" | "stop_words" | "draft" (a verification pass) | "cancelled" | "timeout"
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    log_probs: list[float] | None = None  # one per token of token_ids (with return_log_probs)
    context_logits: torch.Tensor | None = None  # [prompt_len, vocab], first chunk only (with return_context_logits)


@dataclass
class _Entry:
    """A KV cache and the tokens whose KV it holds (len(tokens) == cache.length)."""

    cache: object
    capacity: int
    tokens: list[int] = field(default_factory=list)
    drafter: object = None  # an eagle3.Eagle3Drafter: the head's rows 0..drafter.length-1 follow `tokens`

    def truncate(self, length: int) -> None:
        """Forget positions >= length; the head's row p reads the token at p + 1, so it keeps rows < length - 1."""
        self.cache.truncate(length)
        del self.tokens[length:]
        if self.drafter is not None and self.drafter.length > max(0, length - 1):
            self.drafter.truncate(max(0, length - 1))


@dataclass
class _Pass:
    """One engine pass a request asks for: `tokens` appended to `entry`'s cache, logits of the last
    `keep` rows (None: all). The driver sets `logits` and `elapsed_s` (the wall time of the pass it ran in)."""

    entry: _Entry
    tokens: list[int]
    keep: int | None = None
    capture: bool = False  # also return the EAGLE-3 head's aux features of every row (Executor.head)
    logits: torch.Tensor | None = None
    aux: torch.Tensor | None = None  # [len(tokens), len(aux layers) * hidden] with capture
    elapsed_s: float = 0.0


def _count(per_position: list[int], n: int, size: int) -> None:
    """Add one to positions 0..n-1 of a per-draft-position counter, grown to at least `size` positions."""
    per_position.extend([0] * (size - len(per_position)))
    for i in range(n):
        per_position[i] += 1


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


class Executor:
    """Runs requests on one engine, one at a time, keeping finished sequences' KV for reuse."""

    def __init__(
        self,
        engine,
        max_cached_sequences: int = 4,
        cache_len: int | None = None,
        clock=time.perf_counter,
        wall_clock_ns=time.time_ns,
        tokens_per_block: int = TOKENS_PER_BLOCK,
        normalize_log_probs: bool = True,
        prefill_chunk: int = PREFILL_CHUNK,
        head=None,
    ):
        """`clock` times passes and deadlines (seconds); `wall_clock_ns` stamps the perf timestamps;
        `normalize_log_probs` is the `tensorrt_llm` model parameter of that name (default true, as in
        tensorrtllm_backend): log probs of the top-k/top-p renormalized distribution (0 for a greedy
        token), else log_softmax of the processed row. `head` (an engine.eagle3.Eagle3Head loaded against
        this engine) enables the fused EAGLE-3 loop for requests with num_draft_tokens > 0."""
        if max_cached_sequences < 1:
            raise ConfigError(f"max_cached_sequences is {max_cached_sequences}, must be >= 1")
        if prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk is {prefill_chunk}, must be >= 1")
        if tokens_per_block < 1:
            raise ConfigError(f"tokens_per_block is {tokens_per_block}, must be >= 1")
        self.engine = engine
        self.max_cached_sequences = max_cached_sequences
        self.max_seq_len = int(engine.spec.max_seq_len)
        self.cache_len = min(cache_len or self.max_seq_len, self.max_seq_len)
        self.max_draft_len = int(getattr(engine.spec, "max_draft_len", 0) or 0)
        self.vocab_size = int(getattr(engine.spec, "vocab_size", 0) or 0) or None
        self.tokens_per_block = tokens_per_block
        self.normalize_log_probs = normalize_log_probs
        self.prefill_chunk = prefill_chunk
        self.head = head
        self._pool: OrderedDict[int, _Entry] = OrderedDict()  # LRU order: oldest first
        self._next_id = 0
        self._lock = threading.Lock()
        self._clock = clock
        self._wall_ns = wall_clock_ns

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
                entry.truncate(best_len)  # the KV pointer moves back
                return entry, best_len
            if len(self._pool) >= self.max_cached_sequences:
                _, victim = self._pool.popitem(last=False)  # evict the least recently used
                if victim.capacity >= needed:
                    victim.truncate(0)
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

    def _prefill(
        self, entry: _Entry, tokens: list[int], keep: int | None, stats: GenerationStats, request: GenerationRequest, start: float,
        aux: list | None = None,
    ):
        """Run `tokens` in passes of at most `prefill_chunk` positions, checking cancellation and the
        deadline between them: (the logits of the last `keep` positions (all when None), None), or
        (None, reason) when interrupted (the positions computed so far stay cached for reuse).
        A generator step (see `_steps`): `logits, reason = yield from self._prefill(...)`. With a list `aux`,
        every pass captures the head's aux features and appends them there (all rows, in order)."""
        rows: list[torch.Tensor] = []
        kept = 0
        for begin in range(0, len(tokens), self.prefill_chunk):
            if begin:
                reason = self._interrupted(request, start)
                if reason is not None:
                    return None, reason
            part = tokens[begin : begin + self.prefill_chunk]
            # an earlier chunk's rows are needed only when `keep` reaches back into it
            # rows of this chunk among the last `keep` of all tokens: only those need logits
            want = None if keep is None else max(0, begin + len(part) - max(begin, len(tokens) - keep))
            out = yield from self._forward(entry, part, stats, want, aux)  # [want or n, vocab]
            rows.append(out)
            kept += len(out)
            while keep is not None and len(rows) > 1 and kept - len(rows[0]) >= keep:  # drop rows no longer needed
                kept -= len(rows.pop(0))
        logits = rows[0] if len(rows) == 1 else torch.cat(rows)
        return (logits if keep is None else logits[-keep:]), None

    def _forward(self, entry: _Entry, tokens: list[int], stats: GenerationStats, keep: int | None = None, aux: list | None = None):
        """One engine pass over `tokens` appended to `entry`: yields a `_Pass` for the driver (`generate`
        runs it alone, a `BatchScheduler` together with other requests' passes) and returns its logits
        ([n, vocab], or the last `keep` rows). With a list `aux`, the pass captures the head's aux features
        of its rows and appends them there."""
        work = _Pass(entry, tokens, keep, capture=aux is not None)
        yield work
        if aux is not None:
            aux.append(work.aux)
        assert work.logits is not None, "the driver did not run the pass"
        stats.forward_time_s += work.elapsed_s
        stats.iterations += 1
        stats.computed_tokens += len(tokens)
        return work.logits

    def run_passes(self, passes: list["_Pass"]) -> None:
        """Run engine passes (each sequence at most once) in one batched forward when the engine has
        `forward_batch` and there is more than one, else one by one; sets each pass's logits and time."""
        t0 = self._clock()
        batch = getattr(self.engine, "forward_batch", None)
        capture = [p.capture for p in passes]
        layers = self.head.aux_layer_ids if any(capture) else None
        auxs = [None] * len(passes)
        if batch is not None:  # also for one pass: it computes the kept rows' logits only
            tokens = [torch.tensor(p.tokens, dtype=torch.long) for p in passes]
            if layers is None:
                outs = batch([p.entry.cache for p in passes], tokens, [p.keep for p in passes])
            else:
                outs, auxs = batch([p.entry.cache for p in passes], tokens, [p.keep for p in passes], aux_layers=layers, capture=capture)
        else:
            outs = []
            for i, p in enumerate(passes):
                ids = torch.tensor(p.tokens, dtype=torch.long)
                if p.capture:
                    out, auxs[i] = self.engine.forward(p.entry.cache, ids, aux_layers=layers)
                else:
                    out = self.engine.forward(p.entry.cache, ids)  # [n, vocab]
                outs.append(out if p.keep is None else out[len(out) - min(p.keep, len(out)) :])
        elapsed = self._clock() - t0
        for p, out, aux in zip(passes, outs, auxs):
            p.logits, p.aux, p.elapsed_s = out, aux, elapsed
            p.entry.tokens.extend(p.tokens)  # here, not in the request's steps: a request closed now keeps a consistent cache

    # ------------------------------------------------------------ requests

    def _check(self, request: GenerationRequest) -> LogitsParams:
        """Refuse what cannot run, naming the field; returns the request's logits processing."""
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
        if request.num_draft_tokens < 0:
            raise ConfigError(f"num_draft_tokens is {request.num_draft_tokens}, must be >= 0", "send 0 for the target alone")
        if request.timeout_s is not None and not request.timeout_s > 0:
            raise ConfigError(f"timeout_s is {request.timeout_s}, must be > 0", "leave it unset for no deadline")
        bias = request.embedding_bias
        if bias is not None and self.vocab_size and tuple(bias.shape) != (self.vocab_size,):
            raise ConfigError(
                f"embedding_bias has shape {list(bias.shape)}, expected [{self.vocab_size}] (one value per vocabulary token)",
                "send a [vocab_size] fp32 bias, or leave it unset",
            )
        return LogitsParams(
            temperature=request.sampling.temperature,
            repetition_penalty=request.repetition_penalty,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            min_tokens=request.min_tokens,
            end_id=request.end_id,
            bad_words=tuple(tuple(int(t) for t in w) for w in request.bad_words),
            embedding_bias=None if bias is None else bias.float(),
        )

    def generate(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        """Run one request; yields chunks (one per token when streaming, else one), the last with
        finished=True, finish_reason and stats. Cancellation (`is_cancelled`) and the deadline
        (`timeout_s`) are checked before the first pass, between prefill chunks (`prefill_chunk`
        positions) and after every token: the request then ends
        with the tokens it has and finish_reason "cancelled" / "timeout".

        Runs each engine pass of the request as soon as it is asked for (one request at a time);
        `BatchScheduler` drives the same `steps` of many requests with shared passes."""
        steps = self.steps(request)
        try:
            item = next(steps)
            while True:
                if isinstance(item, _Pass):
                    self.run_passes([item])
                else:
                    yield item
                item = next(steps)
        except StopIteration:
            return
        finally:
            steps.close()  # a request closed early gives its KV cache back to the pool at once

    def steps(self, request: GenerationRequest) -> Iterator["GenerationChunk | _Pass"]:
        """The request as a sequence of steps: yields a `_Pass` whenever it needs an engine pass (the
        driver runs it, sets its logits, then resumes the generator) and a `GenerationChunk` whenever it
        has output. Closing the generator releases the request's KV cache into the pool."""
        params = self._check(request)
        start = self._clock()
        stats = GenerationStats(input_tokens=len(request.input_ids), scheduled_time_ns=self._wall_ns())
        reason = self._interrupted(request, start)
        if reason is not None:
            self._finish(stats, [], [], start)
            yield self._chunk(request, [], [], [], reason, stats, None)
            return
        draft = list(request.draft_tokens or [])
        needed = len(request.input_ids) + max(request.max_new_tokens, len(draft) + 1)
        entry, reused = self._acquire(list(request.input_ids), needed)
        fused = self.fuses(request)
        if request.return_context_logits and reused:
            # reused positions have no logits: recompute the whole prompt
            entry.truncate(0)
            reused = 0
        if fused:  # the head needs the aux features of every position it has not caught up on
            if entry.drafter is None:
                entry.drafter = self.head.new_drafter(entry.capacity + self.max_draft_len + 2)
            # Entry.truncate left the head at most one row short of the reused prefix; the target steps back to
            # the head's length (rows < it read tokens of the reused prefix only), and recomputes the rest
            reused = min(reused, entry.drafter.length)
            entry.cache.truncate(reused)
            del entry.tokens[reused:]
        stats.reused_tokens = reused
        try:
            if draft:
                yield from self._verify(entry, request, params, draft, stats, start)
            elif fused:
                yield from self._fused(entry, request, params, stats, start)
            else:
                yield from self._decode(entry, request, params, stats, start)
        finally:
            self._release(entry)

    def fuses(self, request: GenerationRequest) -> bool:
        """Whether the request runs the fused EAGLE-3 loop: a head is loaded, the request asks for draft tokens
        and sends none of its own, and it is greedy (a sampled request decodes with the target alone: the
        head's proposals would need token-match or rejection verification, not written yet)."""
        return (self.head is not None and request.num_draft_tokens > 0 and not request.draft_tokens
                and self.max_draft_len > 0 and spec.is_greedy(request.sampling))

    def _interrupted(self, request: GenerationRequest, start: float) -> str | None:
        if request.is_cancelled is not None and request.is_cancelled():
            return "cancelled"
        if request.timeout_s is not None and self._clock() - start >= request.timeout_s:
            return "timeout"
        return None

    def _finish(self, stats: GenerationStats, output: list[int], log_probs: list[float], start: float) -> None:
        """Final counts: output tokens, total time, cumulative log prob, KV blocks."""
        stats.output_tokens = len(output)
        stats.total_time_s = self._clock() - start
        stats.cum_log_prob = float(sum(log_probs))
        tpb = self.tokens_per_block
        total = -(-(stats.input_tokens + stats.output_tokens) // tpb)  # ceil
        stats.kv_cache_reused_blocks = stats.reused_tokens // tpb  # whole blocks only are shared
        stats.kv_cache_alloc_total_blocks = total
        stats.kv_cache_alloc_new_blocks = total - stats.kv_cache_reused_blocks

    def _stamp_token(self, stats: GenerationStats, first: bool, start: float) -> None:
        now_ns = self._wall_ns()
        if first:
            stats.first_token_time_s = self._clock() - start
            stats.first_token_time_ns = now_ns
        stats.last_token_time_ns = now_ns

    def _decode(
        self, entry: _Entry, request: GenerationRequest, params: LogitsParams, stats: GenerationStats, start: float
    ) -> Iterator[GenerationChunk]:
        input_ids = list(request.input_ids)
        n_in = len(input_ids)
        generator = None if spec.is_greedy(request.sampling) else spec.make_generator(request.sampling.seed)
        sampler = lp.sampler_params(request.sampling)
        logits, reason = yield from self._prefill(
            entry, input_ids[stats.reused_tokens :], None if request.return_context_logits else 1, stats, request, start
        )
        if reason is not None:
            self._finish(stats, [], [], start)
            yield self._chunk(request, [], [], [], reason, stats, None)
            return
        context_logits = logits[:n_in] if request.return_context_logits else None  # reused == 0 then
        raw = logits[-1]  # [vocab]
        stats.first_forward_time_s = stats.forward_time_s
        sequence = list(input_ids)
        output: list[int] = []
        kept_logits: list[torch.Tensor] = []
        kept_log_probs: list[float] = []
        pending = 0  # tokens not yet sent (non-streaming sends all at the end)
        while True:
            row = lp.process_row(raw, sequence, len(output), params)  # [vocab]
            token = spec.choose_token(row, sampler, generator)
            self._stamp_token(stats, not output, start)
            output.append(token)
            sequence.append(token)
            pending += 1
            if request.return_logits:
                kept_logits.append(raw)
            if request.return_log_probs:
                kept_log_probs.append(lp.token_log_prob(row, token, request.sampling, self.normalize_log_probs))
            reason = None
            if spec.find_stop(sequence, len(sequence) - 1, request.end_id, request.stop_words) is not None:
                reason = "end_id" if token == request.end_id else "stop_words"
            elif len(output) >= request.max_new_tokens:
                reason = "length"
            else:
                reason = self._interrupted(request, start)
            if reason is not None:
                self._finish(stats, output, kept_log_probs, start)
                yield self._chunk(request, output[-pending:], kept_logits[-pending:], kept_log_probs[-pending:], reason, stats, context_logits)
                return
            if request.streaming:
                yield self._chunk(request, [token], kept_logits[-1:], kept_log_probs[-1:], None, None, context_logits)
                context_logits = None
                pending = 0
            raw = (yield from self._forward(entry, [token], stats, 1))[0]

    def _fused(
        self, entry: _Entry, request: GenerationRequest, params: LogitsParams, stats: GenerationStats, start: float
    ) -> Iterator[GenerationChunk]:
        """The fused EAGLE-3 loop (TensorRT-LLM's one-model path): every target pass also returns the aux
        features of its rows; the head catches up on the accepted positions and drafts k tokens; the next
        pass verifies them (k + 1 rows) and decides every token, so the output is the target's own greedy
        continuation, bit for bit (rows do not depend on how many a pass holds: engine/model.py).

        State between rounds: the target cache holds positions 0..L-1 (the last chosen token not run yet),
        the head rows 0..L-1 (row p: the target's features at p and the token at p + 1)."""
        head, drafter = self.head, entry.drafter
        input_ids = list(request.input_ids)
        n_in = len(input_ids)
        aux_parts: list[torch.Tensor] = []
        logits, reason = yield from self._prefill(
            entry, input_ids[stats.reused_tokens :], None if request.return_context_logits else 1, stats, request, start, aux_parts
        )
        if reason is not None:
            self._finish(stats, [], [], start)
            yield self._chunk(request, [], [], [], reason, stats, None)
            return
        stats.fused = True
        context_logits = logits[:n_in] if request.return_context_logits else None
        raw_rows = logits[-1:]  # [1, vocab]: the rows the tokens of this round were chosen from
        rows = lp.process_rows(raw_rows, input_ids, n_in, 0, params)
        new = [spec.greedy_token(rows[0])]
        pending_aux = torch.cat(aux_parts) if len(aux_parts) > 1 else aux_parts[0]  # rows drafter.length..L-1
        sequence = list(input_ids)
        output: list[int] = []
        kept_logits: list[torch.Tensor] = []
        kept_log_probs: list[float] = []
        pending = 0
        while True:
            # the round's tokens (draft[:a] + the target's own), cut by length and stop conditions
            base = len(sequence)
            self._stamp_token(stats, not output, start)
            new = new[: request.max_new_tokens - len(output)]
            sequence.extend(new)
            reason = None
            cut = spec.find_stop(sequence, base, request.end_id, request.stop_words)
            if cut is not None:
                del sequence[cut:]
                reason = "end_id" if sequence[-1] == request.end_id else "stop_words"
            elif len(output) + len(new) >= request.max_new_tokens:
                reason = "length"
            new = sequence[base:]
            output.extend(new)
            pending += len(new)
            if request.return_logits:
                kept_logits.extend(raw_rows[: len(new)])
            if request.return_log_probs:
                kept_log_probs.extend(lp.token_log_prob(rows[i], t, request.sampling, self.normalize_log_probs) for i, t in enumerate(new))
            if reason is None:
                reason = self._interrupted(request, start)
            if reason is not None:
                self._finish(stats, output, kept_log_probs, start)
                yield self._chunk(request, output[-pending:], kept_logits[-pending:], kept_log_probs[-pending:], reason, stats, context_logits)
                return
            if request.streaming and new:
                yield self._chunk(request, new, kept_logits[-len(new):], kept_log_probs[-len(new):], None, None, context_logits)
                context_logits = None
                pending = 0
            # the head catches up on the positions the target just computed and kept, then drafts
            t0 = self._clock()
            length = entry.cache.length
            drafter.truncate(length - pending_aux.shape[0])
            drafter.catch_up(pending_aux, sequence[drafter.length + 1 : length + 1])
            k = max(0, min(request.num_draft_tokens, self.max_draft_len, request.max_new_tokens - len(output) - 1))
            draft = drafter.draft(k) if k else []
            stats.draft_time_s += self._clock() - t0
            # one target pass: the last token + k drafts, k + 1 rows, with their aux features
            aux_parts = []
            raw_rows = yield from self._forward(entry, [sequence[-1]] + draft, stats, None, aux_parts)  # [k + 1, vocab]
            rows = lp.process_rows(raw_rows, sequence + draft, len(sequence), len(output), params)  # [k + 1, vocab]
            accepted, next_token = spec.verify_greedy(draft, rows)
            entry.cache.truncate(length + 1 + accepted)  # the rejected drafts' KV: the pointer moves back
            del entry.tokens[length + 1 + accepted :]
            pending_aux = aux_parts[0][: accepted + 1]  # [a + 1, L * hidden] positions length..length+a
            new = draft[:accepted] + [next_token]
            stats.drafted += k
            stats.accepted += accepted
            stats.drafted_per_round.append(k)  # 0: a plain step (one token was left to generate)
            stats.accepted_per_round.append(accepted)
            if k:
                _count(stats.drafted_per_position, k, k)
                _count(stats.accepted_per_position, accepted, k)

    def _verify(
        self,
        entry: _Entry,
        request: GenerationRequest,
        params: LogitsParams,
        draft: list[int],
        stats: GenerationStats,
        start: float,
    ) -> Iterator[GenerationChunk]:
        """One target pass over the uncached input suffix + the k draft tokens; accept; add one own token.

        Row i (the position of draft[i], or after the last draft token for i = k) is processed over
        input + draft[:i] with i tokens generated, so the pass equals k + 1 single decode steps with
        the same penalties, min_tokens, bias and bad words (greedy parity)."""
        input_ids = list(request.input_ids)
        k = len(draft)
        n_in = len(input_ids)
        logits, reason = yield from self._prefill(
            entry, input_ids[stats.reused_tokens :] + draft, None if request.return_context_logits else k + 1, stats, request, start
        )  # [n_in - reused + k, vocab], or the last k + 1 rows
        if reason is not None:
            self._finish(stats, [], [], start)
            yield self._chunk(request, [], [], [], reason, stats, None)
            return
        context_logits = logits[:n_in] if request.return_context_logits else None  # reused == 0 then
        raw_rows = logits[-(k + 1) :]  # [k + 1, vocab]
        stats.first_forward_time_s = stats.forward_time_s
        context = input_ids + draft
        rows = lp.process_rows(raw_rows, context, n_in, 0, params)  # [k + 1, vocab]
        sampling = request.sampling
        if spec.is_greedy(sampling):
            num_accepted, next_token = spec.verify_greedy(draft, rows)
        else:
            generator = spec.make_generator(sampling.seed)
            sampler = lp.sampler_params(sampling)
            target_probs = spec.sampling_distribution(rows, sampler)  # [k + 1, vocab]
            if request.draft_logits is not None:
                # the draft's raw logits, processed as the draft processed them: its own distribution
                draft_rows = lp.process_rows(request.draft_logits.float(), context, n_in, 0, params)  # [k, vocab]
                draft_probs = spec.sampling_distribution(draft_rows, sampler)  # [k, vocab]
                num_accepted, next_token = spec.verify_rejection(draft, draft_probs, target_probs, generator)
            else:
                num_accepted, next_token = spec.verify_token_match(draft, target_probs, generator)
        self._stamp_token(stats, True, start)
        # Keep the KV of the accepted draft tokens only: the pointer moves back past the rejected ones.
        entry.truncate(n_in + num_accepted)
        output = (draft[:num_accepted] + [next_token])[: request.max_new_tokens]
        reason = "draft" if len(output) < request.max_new_tokens else "length"
        cut = spec.find_stop(input_ids + output, n_in, request.end_id, request.stop_words)
        if cut is not None:
            output = output[: cut - n_in]
            reason = "end_id" if output[-1] == request.end_id else "stop_words"
        log_probs = []
        if request.return_log_probs:  # under the target's distribution (the one emitted tokens follow)
            log_probs = [lp.token_log_prob(rows[i], t, sampling, self.normalize_log_probs) for i, t in enumerate(output)]
        stats.drafted, stats.accepted = k, num_accepted
        self._finish(stats, output, log_probs, start)
        yield self._chunk(request, output, raw_rows[: len(output)], log_probs, reason, stats, context_logits)

    @staticmethod
    def _chunk(request, tokens, logits, log_probs, reason, stats, context_logits) -> GenerationChunk:
        rows = None
        if request.return_logits and len(tokens):
            rows = torch.stack(list(logits)) if isinstance(logits, list) else logits
        return GenerationChunk(
            token_ids=list(tokens),
            logits=rows,
            finished=reason is not None,
            finish_reason=reason,
            stats=stats,
            log_probs=list(log_probs) if request.return_log_probs else None,
            context_logits=context_logits,
        )


class _Job:
    """A request in a BatchScheduler: its steps generator and the queue its consumer reads."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        self.steps: Iterator | None = None
        self.out: queue.SimpleQueue = queue.SimpleQueue()  # GenerationChunk | BaseException
        self.closed = False  # the consumer stopped reading (cancelled, or gone)


class BatchScheduler:
    """In-flight (continuous) batching over one Executor, as TensorRT-LLM's batch manager does.

    A background thread steps every active request together: each request runs until it needs an
    engine pass (`Executor.steps` yields a `_Pass`), then the passes of all active requests (decode
    rows, k + 1 verification rows, prefill chunks of `prefill_chunk` positions) run in one
    `engine.forward_batch`: the linear layers once over all rows, attention per sequence over its own
    KV cache. Requests join and leave between steps; at most `max_batch_size` are active, the others
    wait in arrival order. Rows are computed independently of their neighbours (see
    specdeploy.engine.model), so a request's tokens and logits do not depend on what it was batched
    with. The KV caches come from the executor's one pool (prefix reuse across requests and rounds).

    `generate(request)` is called from any thread and yields the request's chunks as `Executor.generate`
    does; closing it early (cancellation) drops the request at the next step and frees its cache."""

    def __init__(self, executor: Executor, max_batch_size: int, load: Callable[[], Executor] | None = None):
        if max_batch_size < 1:
            raise ConfigError(f"max_batch_size is {max_batch_size}, must be >= 1", "set engine.max_batch_size >= 1")
        self.executor = executor
        self.max_batch_size = max_batch_size
        self.steps_run = 0  # batched engine steps so far
        self.max_active = 0  # the most requests that shared one step
        self._cond = threading.Condition()
        self._waiting: deque[_Job] = deque()
        self._stopped = False
        self._paused = 0
        loaded, failure = threading.Event(), []

        def main():
            try:
                if load is not None:
                    self.executor = load()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                failure.append(exc)
                return
            finally:
                loaded.set()
            self._loop()

        self._thread = threading.Thread(target=main, name="specdeploy-batch-scheduler", daemon=True)
        self._thread.start()
        loaded.wait()
        if failure:
            raise failure[0]

    @classmethod
    def loading(cls, load: Callable[[], Executor], max_batch_size: int) -> "BatchScheduler":
        """A scheduler whose executor `load()` builds in the scheduler's own thread, so that the engine's OpenMP
        work (loading, prepacking, every step) runs in that one thread. torch's OpenMP (libgomp) gives every
        thread that runs a parallel region its own team; a second team on a machine with as many cores as one
        team has threads makes all of them sleep between regions instead of spinning, and a step then took
        2-4x longer (bench/batching.py, README "In-flight batching")."""
        return cls(None, max_batch_size, load)  # type: ignore[arg-type]

    def generate(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        job = _Job(request)
        with self._cond:
            if self._stopped:
                raise ConfigError("the batch scheduler was closed", "the model is unloading; send the request again")
            self._waiting.append(job)
            self._cond.notify()
        try:
            while True:
                item = job.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            job.closed = True
            with self._cond:
                self._cond.notify()

    @contextlib.contextmanager
    def paused(self):
        """No step starts inside this block (requests queue up): lets a test or a caller line requests up."""
        with self._cond:
            self._paused += 1
        try:
            yield self
        finally:
            with self._cond:
                self._paused -= 1
                self._cond.notify()

    def waiting(self) -> int:
        """Requests queued, not yet active."""
        with self._cond:
            return len(self._waiting)

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        active: list[_Job] = []
        while True:
            with self._cond:
                while not self._stopped and (self._paused or (not self._waiting and not active)):
                    self._cond.wait()
                if self._stopped:
                    break
                while self._waiting and len(active) < self.max_batch_size:
                    active.append(self._waiting.popleft())  # join between steps
            work = []  # (job, pass)
            for job in list(active):
                step = self._advance(job)
                if step is None:
                    active.remove(job)  # leave between steps
                else:
                    work.append((job, step))
            if not work:
                continue
            self.max_active = max(self.max_active, len(work))
            try:
                self.executor.run_passes([step for _, step in work])
                self.steps_run += 1
            except Exception as exc:  # an engine failure fails the requests of this step, the others go on
                for job, _ in work:
                    job.out.put(exc)
                    self._drop(job)
                    active.remove(job)
        for job in active + list(self._waiting):
            job.out.put(ConfigError("the batch scheduler was closed", "the model is unloading; send the request again"))
            self._drop(job)

    def _advance(self, job: _Job) -> "_Pass | None":
        """Run the job's steps up to its next engine pass (sending its chunks on the way); None when the
        job is done, failed or closed (its steps are then closed and its cache back in the pool)."""
        if job.closed:
            self._drop(job)
            return None
        try:
            if job.steps is None:
                job.steps = self.executor.steps(job.request)
            item = next(job.steps)
            while not isinstance(item, _Pass):
                job.out.put(item)
                item = next(job.steps)
            return item
        except StopIteration:
            self._drop(job)
            return None
        except Exception as exc:  # a refused request (ConfigError) or a failure in its processing
            job.out.put(exc)
            self._drop(job)
            return None

    @staticmethod
    def _drop(job: _Job) -> None:
        if job.steps is not None:
            try:
                job.steps.close()
            except Exception:  # noqa: BLE001  (a failed pass may leave the cache inconsistent: it is discarded)
                pass
            job.steps = None


def run(executor: Executor, request: GenerationRequest) -> GenerationChunk:
    """Drain a request into one chunk (all tokens, logits, log probs, the context logits, the final
    reason and stats)."""
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    log_probs: list[float] | None = [] if request.return_log_probs else None
    context_logits = None
    last = None
    for chunk in executor.generate(request):
        tokens.extend(chunk.token_ids)
        if chunk.logits is not None:
            logits.append(chunk.logits)
        if chunk.log_probs is not None and log_probs is not None:
            log_probs.extend(chunk.log_probs)
        if chunk.context_logits is not None:
            context_logits = chunk.context_logits
        last = chunk
    assert last is not None and last.finished
    return GenerationChunk(
        tokens, torch.cat(logits) if logits else None, True, last.finish_reason, last.stats, log_probs, context_logits
    )
