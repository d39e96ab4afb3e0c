"""GPU variants of the engine models; `specdeploy.backends` picks them per backend (this module imports
repository.py, never the other way round).

`trtllm-engine`: `tensorrt_llm` and `tensorrt_llm_draft` served by Triton's TensorRT-LLM C++ backend
(`backend: "tensorrtllm"`), with the parameters of tensorrtllm_backend's
`all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt` and the draft/target settings of
TensorRT-LLM's `examples/draft_target_model/README.md` (Triton workflow, step 3):
`gpt_model_type: inflight_fused_batching`, `enable_kv_cache_reuse: true`, `max_beam_width: 1`,
`kv_cache_free_gpu_mem_fraction` shared by the two models on one GPU, `gpu_device_ids`,
`exclude_input_in_output`, decoupled mode via `model_transaction_policy`. The shared models
(preprocessing, postprocessing, ensemble, tensorrt_llm_bls) stay as repository.py makes them.

`trtllm-llmapi` serves the llmapi layout (specdeploy/triton/llmapi.py).
"""

from __future__ import annotations

from pathlib import Path

from specdeploy.triton.repository import (
    DRAFT_MODEL,
    ENGINE_MODEL_NAMES,
    LLM_INPUTS,
    LLM_OUTPUTS,
    TARGET_MODEL,
    ModelSpec,
    RepoInputs,
    engine_model_parameters,
)

DEFAULT_DRAFT_KV_SHARE = 0.1  # when the model shapes are unknown: drafts are small
DRAFT_KV_SHARE_BOUNDS = (0.05, 0.5)
# tensorrtllm_backend's template value; used when the backend spawns executor workers (orchestrator mode).
EXECUTOR_WORKER_PATH = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"


# ---------------------------------------------------------------- placement and memory split


def device_ids(inp: RepoInputs) -> dict[str, str]:
    """Target ranks on GPUs 0..N-1; the draft shares GPU 0 (draft_target_model/README.md: one GPU for both
    'appears better performance than placing on two separate GPUs')."""
    target = inp.recipe.target
    ranks = target.tp_size * target.pp_size
    draft = inp.recipe.draft
    return {
        "target": ",".join(str(i) for i in range(ranks)),
        "draft": ",".join(str(i) for i in range(draft.tp_size * draft.pp_size)),
    }


# Triton is expected to load the target first; kv_fraction_split sizes the draft's fraction for being second,
# and the draft's max_tokens_in_paged_kv_cache cap keeps it small should it load first after all.
KV_LOAD_ORDER = ("target", "draft")


def kv_fraction_split(
    total: float, draft_kv_per_token: int | None, target_kv_per_token: int | None, load_order: tuple = KV_LOAD_ORDER
) -> dict[str, float]:
    """Per-model kv_cache_free_gpu_mem_fraction values that give each model its share of `total`.

    The TensorRT-LLM backend allocates each model's KV cache as a fraction of the GPU memory free when *that*
    model loads, so fractions compose: with F free before the first KV cache, the first model takes a*F and the
    second b*(1-a)*F. Splitting 0.9 as 0.81 (target, first) + 0.09 (draft, second) would leave the draft
    0.09*0.19 = 1.7 % of F. Here the first gets share_first*total and the second share_second*total/(1 -
    share_first*total), so that together they take `total` of F, in the proportion of their KV bytes per token
    (both hold the same number of tokens).
    """
    if draft_kv_per_token and target_kv_per_token:
        share = draft_kv_per_token / (draft_kv_per_token + target_kv_per_token)
    else:
        share = DEFAULT_DRAFT_KV_SHARE
    low, high = DRAFT_KV_SHARE_BOUNDS
    share = min(max(share, low), high)
    shares = {"draft": share, "target": 1.0 - share}
    first, second = load_order
    fractions = {first: total * shares[first]}
    fractions[second] = min(1.0, total * shares[second] / (1.0 - fractions[first]))
    return {role: round(fractions[role], 4) for role in ("draft", "target")}


def kv_shares_when_loaded(fractions: dict[str, float], load_order: tuple, caps: dict[str, float] | None = None) -> dict[str, float]:
    """Share of the free memory F each model's KV cache takes, loading in `load_order` (caps: share limits from
    max_tokens_in_paged_kv_cache, the backend takes the smaller of the two)."""
    caps = caps or {}
    left, out = 1.0, {}
    for role in load_order:
        out[role] = min(fractions[role] * left, caps.get(role, 1.0))
        left -= out[role]
    return out


def draft_kv_tokens(recipe) -> int:
    """Tokens the draft's KV cache needs at most: every sequence of the batch at full length."""
    return recipe.engine.max_batch_size * recipe.engine.max_seq_len


def _kv_per_token(inp: RepoInputs) -> dict[str, int | None]:
    from specdeploy.preflight import ModelShape, estimate

    out = {}
    for role in ENGINE_MODEL_NAMES:
        ckpt = inp.engine_manifests[role].extra.get("checkpoint_dir")
        shape = ModelShape.from_dir(Path(ckpt)) if ckpt else None
        out[role] = estimate(inp.recipe, role, shape).kv_bytes_per_token_per_rank if shape else None
    return out


# ---------------------------------------------------------------- trtllm-engine


def trtllm_engine_models(inp: RepoInputs) -> list[ModelSpec]:
    """`tensorrt_llm` (target) and `tensorrt_llm_draft` for Triton's tensorrtllm C++ backend."""
    r = inp.recipe
    kv = _kv_per_token(inp)
    fractions = kv_fraction_split(r.engine.kv_cache_free_gpu_mem_fraction, kv["draft"], kv["target"])
    devices = device_ids(inp)
    specs = []
    for role, name in ENGINE_MODEL_NAMES.items():
        specs.append(
            ModelSpec(
                name=name,
                backend="tensorrtllm",
                max_batch_size=r.engine.max_batch_size,
                inputs=LLM_INPUTS,
                outputs=LLM_OUTPUTS,
                parameters={
                    **engine_model_parameters(inp, role),
                    "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
                    "batch_scheduler_policy": "guaranteed_no_evict",
                    "kv_cache_free_gpu_mem_fraction": str(fractions[role]),
                    **({"max_tokens_in_paged_kv_cache": str(draft_kv_tokens(r))} if role == "draft" else {}),
                    "gpu_device_ids": devices[role],
                    "executor_worker_path": EXECUTOR_WORKER_PATH,
                },
                instance_count=1,  # the C++ backend batches in flight inside one instance
                decoupled=r.triton.decoupled,
                dynamic_batching_delay_us=r.triton.max_queue_delay_microseconds,
                source=None,  # no model.py: the tensorrtllm backend is C++
            )
        )
    return specs


__all__ = ["DRAFT_MODEL", "TARGET_MODEL", "device_ids", "kv_fraction_split", "trtllm_engine_models"]
