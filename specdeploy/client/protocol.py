"""What crosses the seam between the validation core and a transport (Triton gRPC or a scripted fake).

The core (parity, latency, report, gate) sees only these dataclasses and the `Endpoint` protocol;
`triton_adapter.TritonEndpoint` maps them to Triton tensor names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from specdeploy.speculation.sampling import SamplingParams

# Model names of the inflight_batcher_llm layout (tensorrtllm_backend's all_models/inflight_batcher_llm).
CONTROL_MODEL = "ensemble"  # preprocessing -> tensorrt_llm -> postprocessing: no speculation
SPECULATIVE_MODEL = "tensorrt_llm_bls"  # draft + target rounds
TARGET_MODEL = "tensorrt_llm"
PREPROCESSING_MODEL = "preprocessing"
REQUIRED_MODELS = (CONTROL_MODEL, SPECULATIVE_MODEL)
TRIAGE_MODELS = (PREPROCESSING_MODEL, TARGET_MODEL)


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    max_tokens: int
    num_draft_tokens: int | None = None  # only for the speculative model
    sampling: SamplingParams | None = None  # None: greedy
    stream: bool = False  # decoupled deployments: stream for a client-side TTFT
    return_perf_metrics: bool = True
    stop_words: tuple[
        str, ...
    ] = ()  # the deployment's `stop_words` input, where it declares one (the OpenAI front's `stop`)


@dataclass(frozen=True)
class PerfMetrics:
    """The server's perf outputs (each None when the model did not return it)."""

    total_draft_tokens: int | None = None
    total_accepted_draft_tokens: int | None = None
    acceptance_rate: float | None = None
    arrival_time_ns: int | None = None
    first_token_time_ns: int | None = None
    last_token_time_ns: int | None = None
    source: str | None = None  # which counters the draft counts come from (the report names it)

    @property
    def server_ttft_s(self) -> float | None:
        """Arrival to first token, on the server's clock."""
        if self.arrival_time_ns and self.first_token_time_ns and self.first_token_time_ns >= self.arrival_time_ns:
            return (self.first_token_time_ns - self.arrival_time_ns) / 1e9
        return None

    @property
    def server_decode_s(self) -> float | None:
        """First token to last token, on the server's clock (TPOT = this / (output tokens - 1))."""
        if self.first_token_time_ns and self.last_token_time_ns and self.last_token_time_ns >= self.first_token_time_ns:
            return (self.last_token_time_ns - self.first_token_time_ns) / 1e9
        return None


TIMING_STREAM, TIMING_SERVER = "stream", "server"  # where a result's TTFT and decode time come from


@dataclass(frozen=True)
class GenerateResult:
    text: str
    latency_s: float  # client-side, request sent -> last response received
    ttft_s: float | None = (
        None  # streamed: client-side, to the first non-empty response; unary: the server's perf outputs
    )
    ttft_source: str | None = None  # TIMING_STREAM | TIMING_SERVER | None; also the source of decode_s
    decode_s: float | None = None  # first token -> last token, from the same source as ttft_s
    responses: int = 1
    perf: PerfMetrics = field(default_factory=PerfMetrics)
    token_ids: list[int] | None = None  # generated ids, when the model returns `output_ids`
    k_history: list[int] | None = (
        None  # draft length per round (0: a plain step), when the BLS returns `speculative_k_history`
    )
    # beside k_history, seconds of each round's draft work and target call (`speculative_draft_seconds` /
    # `speculative_target_seconds`), when the BLS returns them
    draft_s_history: list[float] | None = None
    target_s_history: list[float] | None = None
    # the output tokens as the server counted them, where it returns `sequence_length` but no ids (specdeploy's
    # ensemble and tensorrt_llm_bls); with token_ids, their count
    output_tokens: int | None = None
    usage_tokens: int | None = None  # an OpenAI server's `usage.completion_tokens` for this answer

    def __post_init__(self):
        if self.output_tokens is None and self.token_ids is not None:
            object.__setattr__(self, "output_tokens", len(self.token_ids))


@dataclass(frozen=True)
class TargetTrace:
    """The control's exact greedy tokens and the target's logits at every generated position."""

    prompt_ids: list[int]
    output_ids: list[int]  # as the engine returns them (the CPU engine keeps a final end_id)
    logits: np.ndarray | None  # [output_len, vocab] fp32; None when not asked for or not returned
    end_id: int | None = None  # the end id the preprocessing chose (the competing token where a side ended)


class Endpoint(Protocol):
    url: str

    def check_ready(self, models: Sequence[str]) -> None:
        """Raise ClientError (quickly) when the server is unreachable or a model is missing/not ready."""

    def is_decoupled(self, model: str) -> bool: ...

    def generate(self, model: str, request: GenerateRequest, timeout_s: float) -> GenerateResult:
        """One request with a deadline; ClientError on any failure (timeout, server gone, model error)."""

    def trace(self, prompt: str, max_tokens: int, timeout_s: float, with_logits: bool = True) -> TargetTrace:
        """Greedy tokens (and, `with_logits`, generation logits) of the target alone (preprocessing + tensorrt_llm)."""

    def close(self) -> None: ...


class TokenCodec(Protocol):
    """The target's tokenizer: locates divergences in text outputs and, where the server returns no
    ids, counts tokens; `chat_renderer` renders prompts with its chat template."""

    def chat_renderer(self):
        """A `messages -> text` callable using the tokenizer's chat template; None when it has none."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def prompt_tokens(self, text: str) -> int:
        """How many tokens the server makes of a prompt (its preprocessing encodes with special tokens: NVIDIA's
        add_special_tokens default); compared with the deployment's max_input_len."""
