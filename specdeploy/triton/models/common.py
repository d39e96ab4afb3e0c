"""Helpers shared by the python-backend models (imported inside tritonserver's python stub).

What every model does around its requests: read its `parameters` and load what they name (tokenizer, executor,
EAGLE-3 head), run `execute` over its requests (decoupled or not, `execute_all`), turn an exception into the text
of a Triton error, and count a request's KV blocks.

Nothing here imports `triton_python_backend_utils`: the models pass their tensors in as numpy
arrays and turn `RequestError` into a Triton error, so these helpers are testable without a server.

The parts, one module each: `request_inputs` (`RequestError`, reading and checking a request's tensors, its
tokens and sampling fields), `optional_inputs` (NVIDIA's optional inputs: honoured, or refused unless neutral),
`text_stream` (`TextStream`, `HoldBack`: detokenizing a stream), `cancellation` (deadlines, cancellation,
TensorRT-LLM's `stop`, BLS calls in time slices), `stub_safety` (`HeldResponses`, `StubLock`). Every name stays
importable from here: the models call them as `common.<name>`.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
from pathlib import Path

from specdeploy.triton.models.stub_safety import send

# A python stub that dies on a signal (SIGSEGV, SIGABRT from a corrupted heap) prints every thread's Python stack
# into the server log first (the stub's stderr), so a crash is readable from a CI log.
faulthandler.enable(all_threads=True)


# ---------------------------------------------------------------- model parameters


def parameters(args: dict) -> dict[str, str]:
    """The `parameters` of a model's config as {key: string_value}."""
    import json

    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def is_decoupled(args: dict) -> bool:
    import json

    config = json.loads(args["model_config"])
    return bool(config.get("model_transaction_policy", {}).get("decoupled", False))


def flag(value: str | None, default: bool = False) -> bool:
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def resolve_dir(value: str, args: dict) -> Path:
    """A directory parameter: absolute, or relative to the model's own folder in the repository."""
    path = Path(value)
    if not path.is_absolute():
        path = Path(args["model_repository"]) / path
    return path.resolve()


def load_tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def load_object(spec: str):
    """Import 'package.module:attribute'."""
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def load_cpu_executor(engine_dir: str):
    """The default executor factory: specdeploy's CPU engine behind the KV-reusing Executor."""
    from specdeploy.engine.executor import Executor
    from specdeploy.engine.model import CpuEngine

    return Executor(CpuEngine.load(engine_dir), max_cached_sequences=int(os.environ.get("SPECDEPLOY_KV_POOL", "4")))


def with_eagle3_head(
    executor,
    head_dir,
    draft_p_min: float = 0.0,
    head_weights: str = "bf16",
    policy: str = "static",
    lookup_threshold: int = 0,
    serve_vocab_size: int = 0,
):
    """draft.kind eagle3: the executor with the EAGLE-3 head of `head_dir` loaded against its engine (the fused loop,
    engine/executor.py), its linears held as `head_weights` (draft.head_weights: bf16 or int8), scoring
    `serve_vocab_size` of its draft tokens (draft.serve_vocab_size; 0: all), its draft cut-off
    (speculative.draft_p_min), which drafts a round verifies (speculative.policy: static, or cost:
    engine/draft_cost.py) and the suffix lookup tried before the head (`lookup_threshold`: draft.sa_config.threshold,
    0 off); unchanged when head_dir is None. A head that does not fit the engine: ModelError naming the file."""
    if head_dir is None:
        return executor
    from specdeploy.engine.eagle3 import Eagle3Head

    executor.head = Eagle3Head.load(head_dir, executor.engine, head_weights, serve_vocab_size)
    executor.draft_p_min = draft_p_min
    executor.draft_policy = policy
    executor.lookup_threshold = lookup_threshold
    return executor


def streamed_emit(sender, final_flag: int):
    """`emit(response, final)` over a decoupled request's response sender. A client that cancelled its
    request (or closed its stream) has Triton close the sender: what the model still sends for it is
    dropped, instead of raising out of `execute` and logging an error per cancelled request."""

    def emit(response, final: bool) -> None:
        try:
            send(sender, response, final_flag if final else 0)
        except Exception as exc:  # noqa: BLE001 - pb_utils.TritonModelException, only importable in the stub
            if "sender has been closed" not in str(exc):
                raise

    return emit


def execute_all(requests, decoupled: bool, serve, final_flag: int):
    """Run `serve(request, emit)` for each request of a Triton `execute` call.

    `emit(response, final)`: a decoupled model sends every response as it comes (the last one with
    `final_flag`); otherwise only the final response is kept and returned, one per request.
    """
    if decoupled:
        for request in requests:
            serve(request, streamed_emit(request.get_response_sender(), final_flag))
        return None
    responses = []
    for request in requests:
        box = []
        serve(request, lambda response, final, b=box: b.append(response) if final else None)
        responses.append(box[-1])
    return responses


def error_text(exc) -> str:
    """A SpecDeployError's message with its hint, or any other exception's text, for a Triton error."""
    text = getattr(exc, "message", None) or str(exc)
    hint = getattr(exc, "hint", "")
    return f"{text} ({hint})" if hint else text


KV_TOKENS_PER_BLOCK = 64  # TensorRT-LLM's default tokens_per_block, for the kv_cache_* block counts


def kv_blocks(stats, total_tokens: int) -> tuple[int, int, int]:
    """(new, reused, total) KV blocks of a request: the executor's counts, else derived from its token counts."""
    if (
        stats is not None
        and getattr(stats, "kv_cache_alloc_total_blocks", None) is not None
        and hasattr(stats, "kv_cache_reused_blocks")
    ):
        return (
            int(stats.kv_cache_alloc_new_blocks),
            int(stats.kv_cache_reused_blocks),
            int(stats.kv_cache_alloc_total_blocks),
        )
    reused = int(getattr(stats, "reused_tokens", 0) or 0) // KV_TOKENS_PER_BLOCK
    total = -(-total_tokens // KV_TOKENS_PER_BLOCK)
    return total - reused, reused, total
