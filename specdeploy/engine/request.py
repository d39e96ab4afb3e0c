"""What crosses the executor's seam: a `tensorrt_llm` request (`EngineRequest`), the chunks it yields
(`GenerationChunk`), the counts and stamps of its run (`GenerationStats`), the checks a request passes before it
runs (`check_request`), and `run`, which drains a request's chunks into one.

The Triton `tensorrt_llm` model, the in-process generator and the draft-data stage build requests and read chunks;
`engine.executor` runs them one at a time, `engine.batching` many together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from specdeploy.core.errors import ConfigError
from specdeploy.engine.logits import LogitsParams
from specdeploy.speculation.sampling import SamplingParams
from specdeploy.speculation.verify import RoundStats


@dataclass
class EngineRequest:
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
    # Greedy requests verify by exact match, sampled ones by token match (the target's own draws: same tokens).
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
class GenerationStats(RoundStats):
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
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: rounds that drafted a token at position i
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: rounds whose token at position i was accepted
    lookup_rounds: int = (
        0  # rounds whose drafts were the request's own text (Executor lookup_threshold), not the head's
    )
    lookup_accepted: int = 0  # of `accepted`, those drafted by the lookup


@dataclass
class GenerationChunk:
    token_ids: list[int]  # new tokens of this chunk
    logits: torch.Tensor | None = (
        None  # [len(token_ids), vocab]: the raw engine logits each was chosen from (generation_logits)
    )
    finished: bool = False
    # "length" | "end_id" | "stop_words" | "draft" (a verification pass) | "cancelled" | "timeout"
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    log_probs: list[float] | None = None  # one per token of token_ids (with return_log_probs)
    context_logits: torch.Tensor | None = None  # [prompt_len, vocab], first chunk only (with return_context_logits)


def check_request(request: EngineRequest, max_draft_len: int, max_seq_len: int, vocab_size: int | None) -> LogitsParams:
    """Refuse what an engine of these limits cannot run, naming the field; returns the request's logits processing."""
    n = len(request.input_ids)
    if n == 0:
        raise ConfigError("input_ids is empty", "send at least one token (e.g. the BOS token)")
    if request.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens is {request.max_new_tokens}, must be >= 1")
    k = len(request.draft_tokens or [])
    if k > max_draft_len:
        raise ConfigError(
            f"Number of draft tokens ({k}) is larger than maximum number of draft tokens ({max_draft_len})",
            "build the target engine with a larger max_draft_len (speculative.max_draft_len) or send fewer draft"
            " tokens",
        )
    if n + max(request.max_new_tokens, k + 1) > max_seq_len:
        raise ConfigError(
            f"input ({n} tokens) + output ({max(request.max_new_tokens, k + 1)}) exceeds the engine's max_seq_len"
            f" {max_seq_len}",
            "shorten the prompt or ask for fewer tokens, or rebuild with a larger engine.max_seq_len",
        )
    if request.draft_logits is not None and tuple(request.draft_logits.shape[:1]) != (k,):
        raise ConfigError(f"draft_logits has shape {tuple(request.draft_logits.shape)}, expected [{k}, vocab]")
    if request.num_draft_tokens < 0:
        raise ConfigError(
            f"num_draft_tokens is {request.num_draft_tokens}, must be >= 0", "send 0 for the target alone"
        )
    if request.timeout_s is not None and not request.timeout_s > 0:
        raise ConfigError(f"timeout_s is {request.timeout_s}, must be > 0", "leave it unset for no deadline")
    bias = request.embedding_bias
    if bias is not None and vocab_size and tuple(bias.shape) != (vocab_size,):
        raise ConfigError(
            f"embedding_bias has shape {list(bias.shape)}, expected [{vocab_size}] (one value per vocabulary token)",
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


def chunk_of(request: EngineRequest, tokens, logits, log_probs, reason, stats, context_logits) -> GenerationChunk:
    """A chunk of `tokens` with what the request asked for: the logits each was chosen from, their log probs."""
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


def run(executor, request: EngineRequest) -> GenerationChunk:
    """Drain a request through `executor.generate` (an Executor, a BatchScheduler) into one chunk (all tokens,
    logits, log probs, the context logits, the final reason and stats)."""
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
