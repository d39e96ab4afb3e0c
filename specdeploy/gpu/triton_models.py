"""GPU variants of the engine models; `specdeploy.deploy.backend_stages` picks them per backend (this module imports
repository.py, never the other way round).

`trtllm-engine`: `tensorrt_llm` and `tensorrt_llm_draft` served by Triton's TensorRT-LLM C++ backend
(`backend: "tensorrtllm"`), with the parameters of tensorrtllm_backend's
`all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt` and the draft/target settings of
TensorRT-LLM's `examples/draft_target_model/README.md` (Triton workflow, step 3):
`gpt_model_type: inflight_fused_batching`, `enable_kv_cache_reuse: true`, `max_beam_width: 1`,
`kv_cache_free_gpu_mem_fraction` shared by the two models on one GPU, `gpu_device_ids`,
`exclude_input_in_output`, decoupled mode via `model_transaction_policy`. The shared models
(preprocessing, postprocessing, ensemble, tensorrt_llm_bls) stay as repository.py makes them.

`trtllm-llmapi` serves the llmapi layout (specdeploy/gpu/llmapi_repository.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from specdeploy.core.errors import RepoError
from specdeploy.core.trtllm_images import IMAGE_TRTLLM, image_trtllm
from specdeploy.triton.layout_models import engine_model_parameters
from specdeploy.triton.model_config import ModelSpec
from specdeploy.triton.repo_inputs import RepoInputs
from specdeploy.triton.tensors import DRAFT_MODEL, ENGINE_MODEL_NAMES, LLM_INPUTS, LLM_OUTPUTS, TARGET_MODEL

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


def kv_shares_when_loaded(
    fractions: dict[str, float], load_order: tuple, caps: dict[str, float] | None = None
) -> dict[str, float]:
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
    from specdeploy.deploy.preflight import ModelShape, estimate

    out = {}
    for role in ENGINE_MODEL_NAMES:
        ckpt = inp.engine_manifests[role].extra.get("checkpoint_dir")
        shape = ModelShape.from_dir(Path(ckpt)) if ckpt else None
        out[role] = estimate(inp.recipe, role, shape).kv_bytes_per_token_per_rank if shape else None
    return out


# ---------------------------------------------------------------- tensor names per backend release


@dataclass(frozen=True)
class BackendNames:
    """How one tensorrtllm_backend release names the `tensorrt_llm` model's tensors, relative to LLM_INPUTS /
    LLM_OUTPUTS (NVIDIA's names at c2e65b8). A tensor the release lacks is neither declared nor sent: the C++
    backend reads inputs by name and ignores an undeclared one's absence, but a request for an output the model
    does not declare is refused."""

    release: str  # tensorrtllm_backend tag the facts are read from
    renamed: dict  # c2e65b8 input name -> this release's name
    absent_inputs: frozenset
    absent_outputs: frozenset
    extra_inputs: tuple = ()  # (name, dtype, dims) this release declares and c2e65b8 does not

    def input_name(self, name: str) -> str | None:
        """This release's name of a c2e65b8 input, None when it has none."""
        return None if name in self.absent_inputs else self.renamed.get(name, name)


# tensorrtllm_backend@v0.18.0 inflight_batcher_llm/src/utils.h:86 minLength = "min_length", :90 randomSeed =
# "random_seed", read by utils.cc:574/:586; c2e65b8 utils.h:93 minTokens = "min_tokens", :97 seed = "seed". The
# declared tensors of each release: all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt at the tag
# (tests/data/trtllm_backend_tensor_names.json, extracted from those files, is what the test compares with).
_OLD_NAMES = {"min_tokens": "min_length", "seed": "random_seed"}
_PERF_OUTPUTS = frozenset(
    {
        "arrival_time_ns",
        "first_scheduled_time_ns",
        "first_token_time_ns",
        "last_token_time_ns",
        "acceptance_rate",
        "total_accepted_draft_tokens",
        "total_draft_tokens",
    }
)
_REUSE_STATS = (("return_kv_cache_reuse_stats", "BOOL", (1,)),)  # v0.18.0 config.pbtxt; gone by v0.19.0
_NEWER_INPUTS = frozenset(
    {
        "return_perf_metrics",
        "guided_decoding_guide_type",
        "guided_decoding_guide",
        "lookahead_window_size",
        "lookahead_ngram_size",
        "lookahead_verification_set_size",
        "mrope_rotary_cos_sin",
        "mrope_position_deltas",
    }
)
_RETENTION = frozenset(
    {
        "retention_token_range_starts",
        "retention_token_range_ends",
        "retention_token_range_priorities",
        "retention_token_range_durations_ms",
        "retention_decode_priority",
        "retention_decode_duration_ms",
    }
)
BACKEND_TENSOR_NAMES = {
    "0.16": BackendNames("v0.16.0", _OLD_NAMES, _NEWER_INPUTS | _RETENTION, _PERF_OUTPUTS, _REUSE_STATS),
    "0.17": BackendNames("v0.17.0", _OLD_NAMES, _NEWER_INPUTS, _PERF_OUTPUTS, _REUSE_STATS),
    "0.18": BackendNames("v0.18.0", _OLD_NAMES, _NEWER_INPUTS, _PERF_OUTPUTS, _REUSE_STATS),
    "0.19": BackendNames("v0.19.0", _OLD_NAMES, frozenset(), frozenset()),
}
# From 0.20 the backend is in NVIDIA/TensorRT-LLM (triton_backend/); its per-release names are not verified here.


def check_engine_image(image: str, engines_trtllm: str) -> BackendNames:
    """The tensor names the engine deployment gets on `image`: the image must be one trtllm_images knows, carry the
    release line that built the engines (TensorRT engines load only there) and a backend whose names are known."""
    carried = image_trtllm(image)
    if carried.split(".")[:2] != str(engines_trtllm).split(".")[:2]:
        tags = [tag for tag, v in IMAGE_TRTLLM.items() if v.split(".")[:2] == str(engines_trtllm).split(".")[:2]]
        raise RepoError(
            f"image {image} carries TensorRT-LLM {carried}, the engines were built with {engines_trtllm}",
            (
                f"use --image nvcr.io/nvidia/tritonserver:{tags[-1]}-trtllm-python-py3"
                if tags
                else "rebuild the engines with the trtllm-build of the image's release"
            )
            + " (TensorRT engines load only in the release that built them)",
        )
    return backend_names(carried)


def backend_names(trtllm_version: str) -> BackendNames:
    """The tensor names of the tensorrtllm_backend that ships with `trtllm_version` (e.g. "0.18.0", "0.18")."""
    line = ".".join(str(trtllm_version).split(".")[:2])
    if line not in BACKEND_TENSOR_NAMES:
        images = ", ".join(f"{tag}" for tag, v in IMAGE_TRTLLM.items() if v[:4] in BACKEND_TENSOR_NAMES)
        raise RepoError(
            f"the engines are for TensorRT-LLM {trtllm_version}, whose Triton tensorrtllm backend's tensor names "
            f"specdeploy has not verified (known: {', '.join(BACKEND_TENSOR_NAMES)})",
            f"build the engines with the trtllm-build of a known release (NGC images {images}), or use backend "
            "trtllm-llmapi; new releases go into specdeploy.gpu.triton_models.BACKEND_TENSOR_NAMES from their "
            "config.pbtxt and src/utils.h",
        )
    return BACKEND_TENSOR_NAMES[line]


# What engine-backend images must carry when no built engine says otherwise (25.03 carries 0.18; trtllm-build
# exists up to 1.1). TensorRT engines only load in the TensorRT-LLM release that built them.
ENGINE_BACKEND_TRTLLM = "0.18"


def engine_trtllm_version(inp: RepoInputs) -> str:
    """The TensorRT-LLM that built the target engine (its manifest), else the default image's release."""
    version = (inp.engine_manifests["target"].tool_versions or {}).get("trtllm-build")
    return str(version).split("-")[0] if version else ENGINE_BACKEND_TRTLLM


def follow_backend_names(specs: list[ModelSpec], names: BackendNames) -> list[ModelSpec]:
    """The repository's models with the `tensorrt_llm` tensors of one backend release: the engine models declare
    that release's names, the ensemble maps to them (dropping what the release lacks, also from its own outputs),
    and the BLS is told the names to send (parameter `engine_tensor_names`)."""
    import json

    from specdeploy.triton.model_config import Tensor
    from specdeploy.triton.tensors import BLS, ENSEMBLE

    def inputs(tensors):
        out = tuple(replace(t, name=names.input_name(t.name)) for t in tensors if names.input_name(t.name))
        return out + tuple(Tensor(n, dtype, dims, True, False) for n, dtype, dims in names.extra_inputs)

    def outputs(tensors):
        return tuple(t for t in tensors if t.name not in names.absent_outputs)

    out = []
    for spec in specs:
        if spec.name in ENGINE_MODEL_NAMES.values():
            spec = replace(spec, inputs=inputs(spec.inputs), outputs=outputs(spec.outputs))
        elif spec.name == ENSEMBLE:
            steps = tuple(
                (
                    replace(
                        step,
                        input_map=tuple((names.input_name(k), v) for k, v in step.input_map if names.input_name(k)),
                        output_map=tuple((k, v) for k, v in step.output_map if k not in names.absent_outputs),
                    )
                    if step.model == TARGET_MODEL
                    else step
                )
                for step in spec.steps
            )
            # Triton refuses an ensemble input no step consumes: a tensor the release lacks leaves the interface
            consumed = {v for step in steps for _, v in step.input_map}
            spec = replace(
                spec,
                steps=steps,
                inputs=tuple(t for t in spec.inputs if t.name in consumed),
                outputs=outputs(spec.outputs),
            )
        elif spec.name == BLS:
            # the BLS computes its own timings and acceptance; only what it sends and asks of tensorrt_llm changes
            sent = {k: names.input_name(k) for k in [t.name for t in LLM_INPUTS] if names.input_name(k) != k}
            sent |= {k: None for k in names.absent_outputs}
            spec = replace(
                spec, parameters={**spec.parameters, "engine_tensor_names": json.dumps(sent, sort_keys=True)}
            )
        out.append(spec)
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
