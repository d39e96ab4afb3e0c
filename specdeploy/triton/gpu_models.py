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

`trtllm-llmapi`: TensorRT-LLM's `llmapi` Triton model (a python model around `LLM(...)`, from
`triton_backend/all_models/llmapi/tensorrt_llm/`) whose `1/model.yaml` holds the LLM-API options,
speculative_config included; draft and target run inside the one model, so its repository is that
model alone (see `llmapi_repository`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from specdeploy.errors import RepoError
from specdeploy.triton import repository
from specdeploy.triton.repository import (
    DRAFT_MODEL,
    ENGINE_MODEL_NAMES,
    LLM_INPUTS,
    LLM_OUTPUTS,
    TARGET_MODEL,
    ModelSpec,
    RepoInputs,
    _t,
    check_config,
    engine_model_parameters,
    render,
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


# ---------------------------------------------------------------- trtllm-llmapi

LLMAPI_MODEL = TARGET_MODEL  # the upstream model's name; draft and target both live inside it
LLMAPI_UPSTREAM_DIR = "triton_backend/all_models/llmapi/tensorrt_llm/1"  # in a TensorRT-LLM checkout
LLMAPI_UPSTREAM_FILES = ("model.py", "helpers.py")
# The llmapi model's tensors (TensorRT-LLM triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt).
LLMAPI_INPUTS = (
    _t("text_input", "STRING", [-1]),
    _t("streaming", "BOOL", [1], optional=True),
    _t("sampling_param_temperature", "FP32", [1], optional=True),
    _t("sampling_param_top_k", "INT32", [1], optional=True),
    _t("sampling_param_top_p", "FP32", [1], optional=True),
    _t("sampling_param_max_tokens", "INT32", [1], optional=True),
    _t("sampling_param_stop", "STRING", [-1], optional=True),
    _t("sampling_param_seed", "UINT64", [1], optional=True),
    _t("sampling_param_exclude_input_from_output", "BOOL", [1], optional=True),
    _t("sampling_param_return_perf_metrics", "BOOL", [1], optional=True),
    _t("return_finish_reason", "BOOL", [1], optional=True),
)
LLMAPI_OUTPUTS = (
    _t("text_output", "STRING", [-1]),
    _t("finish_reason", "STRING", [-1]),
    _t("arrival_time_ns", "INT64", [1]),
    _t("first_token_time_ns", "INT64", [1]),
    _t("last_token_time_ns", "INT64", [1]),
    _t("acceptance_rate", "FP32", [1]),
    _t("total_accepted_draft_tokens", "INT32", [1]),
    _t("total_draft_tokens", "INT32", [1]),
)


def llmapi_model_yaml(inp: RepoInputs) -> dict:
    """`1/model.yaml`: LLM args (model, backend, parallelism, speculative_config, ...) + `triton_config`.

    Upstream model.py passes everything except `triton_config` to LLM(**args) through
    update_llm_args_with_extra_dict, and reads triton_config.{max_batch_size, decoupled} in
    auto_complete_config; its template sets max_batch_size 0 ("does not support batching"): requests are
    batched in flight by the LLM itself (up to max_batch_size in the LLM args).
    """
    from specdeploy.trtllm import LLMAPI_OPTIONS

    r = inp.recipe
    options_path = inp.engine_dirs["target"] / LLMAPI_OPTIONS
    if not options_path.is_file():
        raise RepoError(f"{options_path} is missing", "run: specdeploy build <recipe> (backend trtllm-llmapi writes it)")
    options = yaml.safe_load(options_path.read_text())
    target_ckpt = inp.engine_manifests["target"].extra.get("checkpoint_dir")
    if not target_ckpt:
        raise RepoError("the LLM-API build manifest does not name the target checkpoint", "run: specdeploy build <recipe> --force")
    return {
        "model": target_ckpt,
        "backend": "pytorch",
        **options,
        "triton_config": {"max_batch_size": 0, "decoupled": r.triton.decoupled},
    }


def llmapi_spec(inp: RepoInputs) -> ModelSpec:
    # No max_batch_size in config.pbtxt: upstream's auto_complete_config sets it from model.yaml, and
    # launch must therefore NOT pass --disable-auto-complete-config for this model.
    return ModelSpec(
        name=LLMAPI_MODEL,
        backend="python",
        max_batch_size=0,
        inputs=LLMAPI_INPUTS,
        outputs=LLMAPI_OUTPUTS,
        instance_count=1,
        decoupled=inp.recipe.triton.decoupled,
    )


def llmapi_repository(inp: RepoInputs, dest: Path, upstream_src: Path | None = None) -> list[str]:
    """Write the llmapi model into `dest` (config.pbtxt, 1/model.yaml; 1/model.py + helpers.py when a
    TensorRT-LLM checkout is given). Returns what is still missing for the server to load it."""
    spec = llmapi_spec(inp)
    text = render(spec)
    check_config(text, spec.name)
    model_dir = Path(dest) / spec.name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(text)
    (model_dir / "1" / "model.yaml").write_text(yaml.safe_dump(llmapi_model_yaml(inp), sort_keys=False))
    missing = []
    for name in LLMAPI_UPSTREAM_FILES:
        src = Path(upstream_src) / LLMAPI_UPSTREAM_DIR / name if upstream_src else None
        if src is not None and src.is_file():
            shutil.copyfile(src, model_dir / "1" / name)
        elif not (model_dir / "1" / name).is_file():
            missing.append(f"{spec.name}/1/{name} (copy from TensorRT-LLM {LLMAPI_UPSTREAM_DIR}/{name})")
    return missing


def generate_llmapi_repository(
    recipe, layout, recipe_path: str = "RECIPE", force: bool = False, upstream_src: Path | None = None, echo=print
) -> tuple[Path, bool]:
    """`specdeploy repo` for backend trtllm-llmapi: `layout.repo` with the llmapi model only, atomically, with
    the same manifest (stage "repo", repository.repo_fingerprint) the shared generator writes."""
    from specdeploy.artifacts import Manifest, atomic_output, tool_versions

    inp = repository.repo_inputs(recipe, layout, recipe_path)
    fp = repository.repo_fingerprint(inp)
    dest = Path(layout.repo)
    current = Manifest.read(dest)
    if not force and current is not None and current.stage == repository.STAGE and current.fingerprint == fp:
        return dest, False
    with atomic_output(dest) as tmp:
        missing = llmapi_repository(inp, tmp, upstream_src)
        Manifest(
            stage=repository.STAGE,
            recipe_name=recipe.name,
            fingerprint=fp,
            settings={"backend": recipe.backend, "models": [LLMAPI_MODEL], "decoupled": recipe.triton.decoupled,
                      "num_draft_tokens": recipe.speculative.num_draft_tokens,
                      "max_draft_len": recipe.speculative.max_draft_len},
            inputs={f"{role}_engine": m.fingerprint for role, m in inp.engine_manifests.items()},
            tool_versions=tool_versions("tritonclient"),
            extra={"missing_upstream_files": missing},
        ).write(tmp)
    for item in missing:
        echo(f"warning: {item}")
    return dest, True


__all__ = ["DRAFT_MODEL", "TARGET_MODEL", "device_ids", "generate_llmapi_repository", "kv_fraction_split",
           "llmapi_repository", "trtllm_engine_models"]
