"""What a TensorRT-LLM `tensorrt_llm` model does for one request, over a CPU engine.

`Executor(engine).generate(EngineRequest)` yields `GenerationChunk`s (`engine.request`). A plain request
decodes up to `max_new_tokens` tokens (greedy or sampled, see `specdeploy.speculation.sampling.is_greedy`). A request
with
`draft_tokens` runs one target pass over input + draft, accepts per `specdeploy.speculation.loop` and returns the
accepted prefix plus one token of its own: TensorRT-LLM's `draft_tokens_external` semantics. With an EAGLE-3 head,
a request with `num_draft_tokens` runs the fused loop (the head drafts inside the executor; greedy or sampled).

Prefix KV reuse across calls (TensorRT-LLM's `enable_kv_cache_reuse`) is `engine.kv_pool`: a request takes the
pooled cache sharing its longest prefix and computes only the suffix; memory is bounded by
`max_cached_sequences` caches of at most `cache_len` positions each. With a head, fused passes and plain prefills keep
their rows' aux features beside the KV, so a fused request reuses a prompt that a plain request computed (the head
catches up from them) as it reuses one of its own.

Per request it honours TensorRT-LLM's logits processing (embedding bias, temperature, repetition /
presence / frequency penalties over prompt + output, min_tokens, bad words: `specdeploy.engine.logits`,
applied per verified position in a draft verification pass too), log probs, context and generation
logits, cancellation and a deadline (checked between decode steps), the perf timestamps and the
`kv_cache_*` block counts (`TOKENS_PER_BLOCK` tokens per block).

A request runs as a generator of steps (`Executor.steps`) that yields an `EnginePass` whenever it needs the
engine (and a `HeadPass` whenever the fused loop needs the EAGLE-3 head): `generate` runs each pass at once,
`engine.batching.BatchScheduler` runs the passes of many requests in one batched forward (and their head passes in
one batched head forward).

The engine API used: `engine.spec` (vocab_size, max_seq_len, max_draft_len),
`engine.new_cache(max_len)` -> cache with `.length` and `.truncate(n)`, and
`engine.forward(cache, LongTensor[n]) -> FloatTensor[n, vocab]` (appends n positions).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from specdeploy.core.errors import ConfigError
from specdeploy.engine import logits as lp
from specdeploy.engine.draft_cost import DraftCost
from specdeploy.engine.eagle3 import HeadPass
from specdeploy.engine.kv_pool import CachedSequence, KvPool
from specdeploy.engine.logits import LogitsParams
from specdeploy.engine.native import standing_team
from specdeploy.engine.request import EngineRequest, GenerationChunk, GenerationStats, check_request, chunk_of
from specdeploy.speculation import loop as spec
from specdeploy.speculation import sampling as speculation_sampling
from specdeploy.speculation import verify
from specdeploy.speculation.ngram import SuffixLookup

# Tokens per KV cache block for the kv_cache_* block counts: TensorRT-LLM's default
# (`PluginConfig._tokens_per_block = 32` in tensorrt_llm/plugin/plugin.py; older releases used 64).
TOKENS_PER_BLOCK = 32

# Positions per engine pass when a request's uncached input is long: cancellation and the deadline
# are checked between these chunks, so a cancelled long prompt stops within one chunk. The CPU
# engine's rows do not depend on how many positions a pass holds, so chunking changes no logits.
PREFILL_CHUNK = 128


@dataclass
class EnginePass:
    """One engine pass a request asks for: `tokens` appended to `entry`'s cache, logits of the last
    `keep` rows (None: all). The driver sets `logits` and `elapsed_s` (the wall time of the pass it ran in)."""

    entry: CachedSequence
    tokens: list[int]
    keep: int | None = None
    capture: bool = False  # also return the EAGLE-3 head's aux features of every row (Executor.head)
    argmax_only: bool = False  # the request takes only each row's argmax: the engine may screen its LM head
    logits: torch.Tensor | None = None
    aux: torch.Tensor | None = None  # [len(tokens), len(aux layers) * hidden] with capture
    elapsed_s: float = 0.0


def argmax_only(request: EngineRequest, params: LogitsParams) -> bool:
    """Whether a request uses nothing of its logits rows but their argmax: greedy, no logits or log probs returned, and
    no processing that can lift a token over another (embedding bias, penalties, min_tokens, bad words). Its passes
    may then screen the LM head (engine/lm_screen.py: every token that can win keeps its exact logit)."""
    returns = request.return_logits or request.return_log_probs or request.return_context_logits
    reorders = (
        params.embedding_bias is not None or params.uses_penalties or params.min_tokens > 0 or bool(params.bad_words)
    )
    return speculation_sampling.is_greedy(request.sampling) and not returns and not reorders


def _token_match(draft: list[int], rows: torch.Tensor, sampler, generator: torch.Generator) -> tuple[int, int]:
    """spec.verify_token_match over processed rows, each row's distribution computed only when it is drawn from and
    alone, as the target alone computes it (a [k + 1, vocab] softmax or sort need not round like one-row ones):
    (accepted drafts, the target's own token)."""
    for i in range(len(draft) + 1):
        token = verify.choose_token(rows[i], sampler, generator)
        if i == len(draft) or token != draft[i]:
            return i, token
    raise AssertionError("unreachable")


def _append_round(
    sequence: list[int], new: list[int], request: EngineRequest, produced: int
) -> tuple[list[int], str | None]:
    """Append a round's tokens to `sequence`, cut at max_new_tokens and at the first end id or stop word; returns
    the tokens kept and why generation ends there (None: it goes on)."""
    base = len(sequence)
    sequence.extend(new[: request.max_new_tokens - produced])
    reason = None
    cut = spec.find_stop(sequence, base, request.end_id, request.stop_words)
    if cut is not None:
        del sequence[cut:]
        reason = "end_id" if sequence[-1] == request.end_id else "stop_words"
    elif produced + len(sequence) - base >= request.max_new_tokens:
        reason = "length"
    return sequence[base:], reason


def _count(per_position: list[int], n: int, size: int) -> None:
    """Add one to positions 0..n-1 of a per-draft-position counter, grown to at least `size` positions."""
    per_position.extend([0] * (size - len(per_position)))
    for i in range(n):
        per_position[i] += 1


class Executor:
    """Runs requests on one engine, one at a time, keeping finished sequences' KV for reuse."""

    # steps() and run_passes(): a BatchScheduler can interleave this executor's requests in shared passes
    in_flight_batching = True

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
        draft_p_min: float = 0.0,
        draft_policy: str = "static",
        lookup_threshold: int = 0,
    ):
        """`clock` times passes and deadlines (seconds); `wall_clock_ns` stamps the perf timestamps;
        `normalize_log_probs` is the `tensorrt_llm` model parameter of that name (default true, as in
        tensorrtllm_backend): log probs of the top-k/top-p renormalized distribution (0 for a greedy
        token), else log_softmax of the processed row. `head` (an engine.eagle3.Eagle3Head loaded against
        this engine) enables the fused EAGLE-3 loop for requests with num_draft_tokens > 0; `draft_p_min`
        (recipe speculative.draft_p_min) cuts its drafts at the first one whose chain probability (the head's, times the
        drafts' before it) is less;
        `draft_policy` (recipe speculative.policy) "cost" verifies only the drafts this engine's measured costs and
        acceptance say pay (engine/draft_cost.py), "static" all of them. `lookup_threshold` > 0 (recipe
        draft.sa_config.threshold): a round first looks the sequence's suffix up in the request's own tokens
        (ngram.SuffixLookup) and, where it occurred earlier over at least that many tokens, verifies what followed it
        instead of drafting with the head (TensorRT-LLM's suffix automaton enhancement)."""
        if max_cached_sequences < 1:
            raise ConfigError(f"max_cached_sequences is {max_cached_sequences}, must be >= 1")
        if prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk is {prefill_chunk}, must be >= 1")
        if tokens_per_block < 1:
            raise ConfigError(f"tokens_per_block is {tokens_per_block}, must be >= 1")
        self.engine = engine
        self.max_seq_len = int(engine.spec.max_seq_len)
        self.cache_len = min(cache_len or self.max_seq_len, self.max_seq_len)
        self.kv_pool = KvPool(engine.new_cache, max_cached_sequences, self.cache_len)
        self.max_draft_len = int(getattr(engine.spec, "max_draft_len", 0) or 0)
        self.vocab_size = int(getattr(engine.spec, "vocab_size", 0) or 0) or None
        self.tokens_per_block = tokens_per_block
        self.normalize_log_probs = normalize_log_probs
        self.prefill_chunk = prefill_chunk
        self.head = head
        self.draft_p_min = draft_p_min
        self.lookup_threshold = lookup_threshold
        self._clock = clock
        self.draft_cost: DraftCost | None = None
        self.draft_policy = draft_policy
        self._wall_ns = wall_clock_ns

    @property
    def draft_policy(self) -> str:
        return "static" if self.draft_cost is None else "cost"

    @draft_policy.setter
    def draft_policy(self, policy: str) -> None:  # speculative.policy; the measurements start afresh
        assert policy in ("static", "cost"), policy
        self.draft_cost = DraftCost(clock=self._clock) if policy == "cost" else None

    # ------------------------------------------------------------ the KV pool (engine.kv_pool)

    @property
    def max_cached_sequences(self) -> int:
        return self.kv_pool.max_sequences

    @max_cached_sequences.setter
    def max_cached_sequences(self, value: int) -> None:  # the tensorrt_llm model raises it to the batch size
        self.kv_pool.max_sequences = value

    @property
    def cached_sequences(self) -> list[list[int]]:
        return self.kv_pool.cached_sequences

    def kv_cache_bytes(self) -> int:
        """Bytes held by the pooled KV caches (caches that report `nbytes()`)."""
        return self.kv_pool.nbytes()

    def clear_cache(self) -> None:
        self.kv_pool.clear()

    # ------------------------------------------------------------ engine passes

    def _prefill(
        self,
        entry: CachedSequence,
        tokens: list[int],
        keep: int | None,
        stats: GenerationStats,
        request: EngineRequest,
        start: float,
        aux: list | None = None,
        argmax: bool = False,
    ):
        """Run `tokens` in passes of at most `prefill_chunk` positions, checking cancellation and the
        deadline between them: (the logits of the last `keep` positions (all when None), None), or
        (None, reason) when interrupted (the positions computed so far stay cached for reuse).
        A generator step (see `_steps`): `logits, reason = yield from self._prefill(...)`. With a list `aux`,
        every pass captures the head's aux features and appends them there (all rows, in order). argmax: the request
        takes only the rows' argmax (`argmax_only`)."""
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
            out = yield from self._forward(entry, part, stats, want, aux, argmax)  # [want or n, vocab]
            rows.append(out)
            kept += len(out)
            while keep is not None and len(rows) > 1 and kept - len(rows[0]) >= keep:  # drop rows no longer needed
                kept -= len(rows.pop(0))
        logits = rows[0] if len(rows) == 1 else torch.cat(rows)
        return (logits if keep is None else logits[-keep:]), None

    def _forward(
        self,
        entry: CachedSequence,
        tokens: list[int],
        stats: GenerationStats,
        keep: int | None = None,
        aux: list | None = None,
        argmax: bool = False,
    ):
        """One engine pass over `tokens` appended to `entry`: yields a `EnginePass` for the driver (`generate`
        runs it alone, a `BatchScheduler` together with other requests' passes) and returns its logits
        ([n, vocab], or the last `keep` rows). With a list `aux`, the pass captures the head's aux features
        of its rows and appends them there. argmax: only the rows' argmax is used (`argmax_only`)."""
        work = EnginePass(entry, tokens, keep, capture=aux is not None, argmax_only=argmax)
        yield work
        if aux is not None:
            aux.append(work.aux)
        assert work.logits is not None, "the driver did not run the pass"
        stats.forward_time_s += work.elapsed_s
        stats.iterations += 1
        stats.computed_tokens += len(tokens)
        return work.logits

    def run_passes(self, passes: list["EnginePass"]) -> None:
        """Run engine passes (each sequence at most once) in one batched forward when the engine has
        `forward_batch` and there is more than one, else one by one; sets each pass's logits and time."""
        t0 = self._clock()
        batch = getattr(self.engine, "forward_batch", None)
        # With a head a plain pass captures too where it costs nothing that counts: a prefill (many rows; the entry
        # keeps the features for a fused request that reuses the prompt, CachedSequence.store_aux) or a pass in a batch
        # that captures anyway. Not a plain one-row step alone, where capturing costs (docs/eagle3-serving.md); a fused
        # request that reuses a plain answer computes its positions again.
        batch_captures = any(p.capture for p in passes)
        capture = [p.capture or (self.head is not None and (batch_captures or len(p.tokens) > 1)) for p in passes]
        layers = self.head.aux_layer_ids if any(capture) else None
        auxs = [None] * len(passes)
        # an engine with a screened LM head (CpuEngine.screen) is told which passes need only their rows' argmax
        screens = getattr(self.engine, "screen", None) is not None
        if batch is not None:  # also for one pass: it computes the kept rows' logits only
            tokens = [torch.tensor(p.tokens, dtype=torch.long) for p in passes]
            extra = {"greedy": [p.argmax_only for p in passes]} if screens else {}
            if layers is None:
                outs = batch([p.entry.cache for p in passes], tokens, [p.keep for p in passes], **extra)
            else:
                outs, auxs = batch(
                    [p.entry.cache for p in passes],
                    tokens,
                    [p.keep for p in passes],
                    aux_layers=layers,
                    capture=capture,
                    **extra,
                )
        else:
            outs = []
            for i, p in enumerate(passes):
                ids = torch.tensor(p.tokens, dtype=torch.long)
                extra = {"greedy": p.argmax_only} if screens else {}
                if capture[i]:
                    out, auxs[i] = self.engine.forward(p.entry.cache, ids, aux_layers=layers, **extra)
                else:
                    out = self.engine.forward(p.entry.cache, ids, **extra)  # [n, vocab]
                outs.append(out if p.keep is None else out[len(out) - min(p.keep, len(out)) :])
        elapsed = self._clock() - t0
        if self.draft_cost is not None:
            self.draft_cost.observe_pass(sum(len(p.tokens) for p in passes), elapsed, len(passes))
        for p, out, aux in zip(passes, outs, auxs):
            p.logits, p.aux, p.elapsed_s = out, aux if p.capture else None, elapsed
            if aux is not None:
                p.entry.store_aux(len(p.entry.tokens), aux)
            p.entry.tokens.extend(
                p.tokens
            )  # here, not in the request's steps: a request closed now keeps a consistent cache

    def run_head_passes(self, passes: list[HeadPass]) -> None:
        """Run the EAGLE-3 head forwards of several requests (one per request) in one batched head forward."""
        self.head.run_passes(passes)

    # ------------------------------------------------------------ requests

    def generate(self, request: EngineRequest) -> Iterator[GenerationChunk]:
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
                if isinstance(item, (EnginePass, HeadPass)):
                    # the passes and the request's work between them on one standing team (native.standing_team)
                    with standing_team(getattr(self.engine, "native", None)):
                        while isinstance(item, (EnginePass, HeadPass)):
                            if isinstance(item, EnginePass):
                                self.run_passes([item])
                            else:
                                self.run_head_passes([item])
                            item = next(steps)
                    continue
                yield item
                item = next(steps)
        except StopIteration:
            return
        finally:
            steps.close()  # a request closed early gives its KV cache back to the pool at once

    def steps(self, request: EngineRequest) -> Iterator["GenerationChunk | EnginePass | HeadPass"]:
        """The request as a sequence of steps: yields a `EnginePass` whenever it needs an engine pass (the
        driver runs it, sets its logits, then resumes the generator), a `HeadPass` whenever the fused loop needs a
        forward of the EAGLE-3 head (`run_head_passes`), and a `GenerationChunk` whenever it has output. Closing
        the generator releases the request's KV cache into the pool."""
        params = check_request(request, self.max_draft_len, self.max_seq_len, self.vocab_size)
        start = self._clock()
        stats = GenerationStats(input_tokens=len(request.input_ids), scheduled_time_ns=self._wall_ns())
        reason = self._interrupted(request, start)
        if reason is not None:
            self._finish(stats, [], [], start)
            yield chunk_of(request, [], [], [], reason, stats, None)
            return
        draft = list(request.draft_tokens or [])
        needed = len(request.input_ids) + max(request.max_new_tokens, len(draft) + 1)
        entry, reused = self.kv_pool.acquire(list(request.input_ids), needed)
        fused = self.fuses(request)
        if request.return_context_logits and reused:
            # reused positions have no logits: recompute the whole prompt
            entry.truncate(0)
            reused = 0
        if fused:  # the head needs the aux features of every position it has not caught up on
            if entry.drafter is None:
                entry.drafter = self.head.new_drafter(entry.capacity + self.max_draft_len + 2)
            # Entry.truncate left the head at most one row short of the reused prefix (rows < it read tokens of the
            # reused prefix only); the head catches up from the kept aux features where the prefix has them (a plain
            # request wrote it), else the target steps back to the head's length and recomputes the rest
            reused = min(reused, max(entry.drafter.length, entry.aux_length))
            entry.truncate(reused)
        stats.reused_tokens = reused
        try:
            if draft:
                yield from self._verify(entry, request, params, draft, stats, start)
            elif fused:
                yield from self._fused(entry, request, params, stats, start)
            else:
                yield from self._decode(entry, request, params, stats, start)
        finally:
            self.kv_pool.release(entry)

    def fuses(self, request: EngineRequest) -> bool:
        """Whether the request runs the fused EAGLE-3 loop: a head is loaded, the request asks for draft tokens
        and sends none of its own. Greedy or sampled (a sampled request's drafts are verified by token match)."""
        return (
            self.head is not None
            and request.num_draft_tokens > 0
            and not request.draft_tokens
            and self.max_draft_len > 0
        )

    def _interrupted(self, request: EngineRequest, start: float) -> str | None:
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

    def _last_chunk(
        self,
        request: EngineRequest,
        stats: GenerationStats,
        start: float,
        reason: str,
        output: list[int],
        logits: list,
        log_probs: list[float],
        pending: int,
        context_logits,
    ) -> GenerationChunk:
        """The request's final chunk: its stats finished over the whole output, and the `pending` tokens (with their
        logits and log probs) that no streamed chunk has carried yet."""
        self._finish(stats, output, log_probs, start)
        return chunk_of(
            request, output[-pending:], logits[-pending:], log_probs[-pending:], reason, stats, context_logits
        )

    def _stamp_token(self, stats: GenerationStats, first: bool, start: float) -> None:
        now_ns = self._wall_ns()
        if first:
            stats.first_token_time_s = self._clock() - start
            stats.first_token_time_ns = now_ns
        stats.last_token_time_ns = now_ns

    def _decode(
        self, entry: CachedSequence, request: EngineRequest, params: LogitsParams, stats: GenerationStats, start: float
    ) -> Iterator[GenerationChunk]:
        input_ids = list(request.input_ids)
        n_in = len(input_ids)
        generator = (
            None if speculation_sampling.is_greedy(request.sampling) else verify.make_generator(request.sampling.seed)
        )
        sampler = lp.sampler_params(request.sampling)
        argmax = argmax_only(request, params)
        logits, reason = yield from self._prefill(
            entry,
            input_ids[stats.reused_tokens :],
            None if request.return_context_logits else 1,
            stats,
            request,
            start,
            argmax=argmax,
        )
        if reason is not None:
            self._finish(stats, [], [], start)
            yield chunk_of(request, [], [], [], reason, stats, None)
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
            token = verify.choose_token(row, sampler, generator)
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
                yield self._last_chunk(
                    request, stats, start, reason, output, kept_logits, kept_log_probs, pending, context_logits
                )
                return
            if request.streaming:
                yield chunk_of(request, [token], kept_logits[-1:], kept_log_probs[-1:], None, None, context_logits)
                context_logits = None
                pending = 0
            raw = (yield from self._forward(entry, [token], stats, 1, argmax=argmax))[0]

    def _fused(
        self, entry: CachedSequence, request: EngineRequest, params: LogitsParams, stats: GenerationStats, start: float
    ) -> Iterator[GenerationChunk]:
        """The fused EAGLE-3 loop (TensorRT-LLM's one-model path): every target pass also returns the aux
        features of its rows; the head catches up on the accepted positions and drafts k tokens; the next
        pass verifies them (k + 1 rows) and decides every token, so the output is the target's own greedy
        continuation, bit for bit (rows do not depend on how many a pass holds: engine/model.py).

        A sampled request is verified by token match (TensorRT-LLM's acceptance without draft logits,
        spec.verify_token_match): the target draws its own token at each row, in order, and a draft token is kept
        while it equals the draw. The draws are the ones the target alone would make: one per emitted token, from
        the same rows with the same generator, so a seeded request gives the target's own sampled output token for
        token, whatever the head proposed.

        State between rounds: the target cache holds positions 0..L-1 (the last chosen token not run yet),
        the head rows 0..L-1 (row p: the target's features at p and the token at p + 1)."""
        input_ids = list(request.input_ids)
        n_in = len(input_ids)
        aux_parts: list[torch.Tensor] = []
        logits, reason = yield from self._prefill(
            entry,
            input_ids[stats.reused_tokens :],
            None if request.return_context_logits else 1,
            stats,
            request,
            start,
            aux_parts,
            argmax_only(request, params),
        )
        if reason is not None:
            self._finish(stats, [], [], start)
            yield chunk_of(request, [], [], [], reason, stats, None)
            return
        stats.fused = True
        stats.first_forward_time_s = stats.forward_time_s
        context_logits = logits[:n_in] if request.return_context_logits else None
        raw_rows = logits[-1:]  # [1, vocab]: the rows the tokens of this round were chosen from
        rows = lp.process_rows(raw_rows, input_ids, n_in, 0, params)
        generator = (
            None if speculation_sampling.is_greedy(request.sampling) else verify.make_generator(request.sampling.seed)
        )
        sampler = lp.sampler_params(request.sampling)
        new = [verify.choose_token(rows[0], sampler, generator)]
        if (
            entry.drafter.length < stats.reused_tokens
        ):  # the reused positions the head has not seen: their kept features
            aux_parts.insert(0, entry.aux[entry.drafter.length : stats.reused_tokens])
        pending_aux = torch.cat(aux_parts) if len(aux_parts) > 1 else aux_parts[0]  # rows drafter.length..L-1
        sequence = list(input_ids)
        output: list[int] = []
        kept_logits: list[torch.Tensor] = []
        kept_log_probs: list[float] = []
        pending = 0
        lookup = SuffixLookup(self.lookup_threshold, sequence) if self.lookup_threshold > 0 else None
        while True:
            # the round's tokens (draft[:a] + the target's own), cut by length and stop conditions
            self._stamp_token(stats, not output, start)
            new, reason = _append_round(sequence, new, request, len(output))
            if lookup is not None:
                lookup.extend(new)
            output.extend(new)
            pending += len(new)
            if request.return_logits:
                kept_logits.extend(raw_rows[: len(new)])
            if request.return_log_probs:
                kept_log_probs.extend(
                    lp.token_log_prob(rows[i], t, request.sampling, self.normalize_log_probs) for i, t in enumerate(new)
                )
            if reason is None:
                reason = self._interrupted(request, start)
            if reason is not None:
                yield self._last_chunk(
                    request, stats, start, reason, output, kept_logits, kept_log_probs, pending, context_logits
                )
                return
            if request.streaming and new:
                yield chunk_of(
                    request, new, kept_logits[-len(new) :], kept_log_probs[-len(new) :], None, None, context_logits
                )
                context_logits = None
                pending = 0
            raw_rows, rows, new, pending_aux = yield from self._fused_round(
                entry, pending_aux, sequence, len(output), request, params, stats, generator, lookup
            )

    def _fused_round(
        self,
        entry: CachedSequence,
        pending_aux: torch.Tensor,
        sequence: list[int],
        produced: int,
        request: EngineRequest,
        params: LogitsParams,
        stats: GenerationStats,
        generator: torch.Generator | None,
        lookup: SuffixLookup | None = None,
    ):
        """One round of the fused loop: the head catches up on the positions the target computed and kept, drafts up
        to k, and one target pass of k + 1 rows verifies them (greedy: exact match; sampled: token match with the
        request's `generator`). With a `lookup` whose suffix match is long enough, its tokens are the drafts and
        the head stays idle (it catches up in a later round). Returns (the pass's raw rows, its processed rows, the
        round's tokens: accepted drafts + the target's own, the aux features of the kept positions)."""
        drafter = entry.drafter
        t0 = self._clock()
        length = entry.cache.length
        k = max(0, min(request.num_draft_tokens, self.max_draft_len, request.max_new_tokens - produced - 1))
        # the request's own text first (no head work, no policy: a row is all such a draft costs)
        looked_up = lookup.draft(k) if lookup is not None else []
        cost = self.draft_cost if k and not looked_up else None
        plain = (
            cost is not None and not cost.speculate()
        )  # policy cost: drafting does not pay now, nor does the head's work
        idle = plain or k == 0 or bool(looked_up)  # the head drafts nothing this round: it catches up later, if ever
        rule = cost.round() if cost is not None and not idle else None
        if looked_up:
            draft = looked_up
            stats.lookup_rounds += 1
        elif idle:
            draft = []
        else:
            drafter.truncate(length - pending_aux.shape[0])  # pending_aux: the positions the head has not seen yet
            # each head forward is a HeadPass for the driver (a BatchScheduler runs those of every request together)
            yield from drafter.catch_up_steps(pending_aux, sequence[drafter.length + 1 : length + 1])
            draft = yield from drafter.draft_steps(k, self.draft_p_min, rule)
        k = len(draft)  # fewer where the head was unsure (draft_p_min), a draft did not pay (cost) or the match ran out
        draft_s = self._clock() - t0
        stats.draft_time_s += draft_s
        # one target pass: the last token + k drafts, k + 1 rows, with their aux features
        aux_parts = []
        forward_before = stats.forward_time_s
        raw_rows = yield from self._forward(
            entry, [sequence[-1]] + draft, stats, None, aux_parts, argmax_only(request, params)
        )  # [k + 1, vocab]
        forward_s = stats.forward_time_s - forward_before
        rows = lp.process_rows(raw_rows, sequence + draft, len(sequence), produced, params)  # [k + 1, vocab]
        if generator is None:
            accepted, next_token = verify.verify_greedy(draft, rows)
        else:
            accepted, next_token = _token_match(draft, rows, lp.sampler_params(request.sampling), generator)
        if rule is not None:
            rule.outcome(accepted, self._clock() - t0)  # the round's wall time: the head's work and the pass it shared
        elif plain:
            self.draft_cost.observe_plain_round(self._clock() - t0)
        entry.roll_back(length + 1 + accepted)  # the rejected drafts' KV (and kept features): the pointer moves back
        kept = aux_parts[0][: accepted + 1]  # [a + 1, L * hidden] positions length..length+a
        pending_aux = torch.cat([pending_aux, kept]) if idle else kept  # the head has not seen these positions yet
        stats.drafted += k
        stats.accepted += accepted
        stats.lookup_accepted += accepted if looked_up else 0
        stats.k_per_round.append(k)  # 0: a plain step (one token left, the head unsure, or the cost policy)
        stats.accepted_per_round.append(accepted)
        stats.lookup_per_round.append(1 if looked_up else 0)
        stats.draft_s_per_round.append(draft_s)
        stats.target_s_per_round.append(forward_s)
        if k:
            _count(stats.drafted_per_position, k, k)
            _count(stats.accepted_per_position, accepted, k)
        return raw_rows, rows, draft[:accepted] + [next_token], pending_aux

    def _verify(
        self,
        entry: CachedSequence,
        request: EngineRequest,
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
            entry,
            input_ids[stats.reused_tokens :] + draft,
            None if request.return_context_logits else k + 1,
            stats,
            request,
            start,
            argmax=argmax_only(request, params),
        )  # [n_in - reused + k, vocab], or the last k + 1 rows
        if reason is not None:
            self._finish(stats, [], [], start)
            yield chunk_of(request, [], [], [], reason, stats, None)
            return
        context_logits = logits[:n_in] if request.return_context_logits else None  # reused == 0 then
        raw_rows = logits[-(k + 1) :]  # [k + 1, vocab]
        stats.first_forward_time_s = stats.forward_time_s
        context = input_ids + draft
        rows = lp.process_rows(raw_rows, context, n_in, 0, params)  # [k + 1, vocab]
        sampling = request.sampling
        if speculation_sampling.is_greedy(sampling):
            num_accepted, next_token = verify.verify_greedy(draft, rows)
        else:
            generator = verify.make_generator(sampling.seed)
            sampler = lp.sampler_params(sampling)
            target_probs = verify.sampling_distribution(rows, sampler)  # [k + 1, vocab]
            if request.draft_logits is not None:
                # the draft's raw logits, processed as the draft processed them: its own distribution
                draft_rows = lp.process_rows(request.draft_logits.float(), context, n_in, 0, params)  # [k, vocab]
                draft_probs = verify.sampling_distribution(draft_rows, sampler)  # [k, vocab]
                num_accepted, next_token = verify.verify_rejection(draft, draft_probs, target_probs, generator)
            else:
                num_accepted, next_token = verify.verify_token_match(draft, target_probs, generator)
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
            log_probs = [
                lp.token_log_prob(rows[i], t, sampling, self.normalize_log_probs) for i, t in enumerate(output)
            ]
        stats.drafted, stats.accepted = k, num_accepted
        self._finish(stats, output, log_probs, start)
        yield chunk_of(request, output, raw_rows[: len(output)], log_probs, reason, stats, context_logits)
