"""The llmapi layout: TensorRT-LLM's `llmapi` Triton model (triton_backend/all_models/llmapi/tensorrt_llm), twice.

    tensorrt_llm          the speculative deployment: model.yaml with its speculative_config
    tensorrt_llm_control  the same target without speculative_config: the unaccelerated control validate compares with

Each model folder holds config.pbtxt (the upstream tensors, LLMAPI_INPUTS/LLMAPI_OUTPUTS) and `1/model.yaml` (LLM-API
options in the recipe's TensorRT-LLM release, trtllm.llmapi_options). What runs them:
- backend `trtllm-llmapi`: TensorRT-LLM's own model.py + helpers.py of the image's release, copied in at the
  container's start (or from a TensorRT-LLM checkout `repo --trtllm-src` names: llmapi_upstream), LLM(...) on the
  GPU; model.yaml `model` is the target's HF checkpoint.
- backend `cpu`: specdeploy's python model (models/llmapi.py) with the same interface over the CPU engines;
  model.yaml `model` is the target engine and the draft key names the draft engine, or for draft.kind eagle3 the
  head, copied into the speculative model's folder (`tensorrt_llm/eagle3_head`, as the inflight_batcher_llm
  layout stages it) and run inside the target (the fused loop).

With triton.control load_unload the server starts in explicit model control with only tensorrt_llm loaded, and
validate loads the control, measures it and unloads it (client/llmapi_adapter.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from specdeploy.core.errors import RepoError
from specdeploy.gpu import llmapi_upstream
from specdeploy.triton import repo_inputs, repository
from specdeploy.triton.layout_models import EAGLE3_HEAD_SUBDIR, eagle3_head_parameters
from specdeploy.triton.model_config import ModelSpec, _t, check_config, render
from specdeploy.triton.repo_inputs import RepoInputs, check_eagle3_head, stage_eagle3_head
from specdeploy.triton.repository import MODEL_SOURCES

SPECULATIVE_MODEL = "tensorrt_llm"  # the upstream model's name: NVIDIA's llmapi clients reach the speculative path
CONTROL_MODEL = "tensorrt_llm_control"
MODELS = (SPECULATIVE_MODEL, CONTROL_MODEL)
CPU_SOURCE = "llmapi.py"  # in specdeploy/triton/models/

# The llmapi model's tensors, as TensorRT-LLM's triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt declares
# them (main, 2026): max_batch_size 0, so dims are per request.
LLMAPI_INPUTS = (
    _t("text_input", "STRING", [-1]),
    _t("image_url", "STRING", [-1], optional=True),
    _t("streaming", "BOOL", [1], optional=True),
    _t("sampling_param_best_of", "INT32", [1], optional=True),
    _t("sampling_param_temperature", "FP32", [1], optional=True),
    _t("sampling_param_top_k", "INT32", [1], optional=True),
    _t("sampling_param_top_p", "FP32", [1], optional=True),
    _t("sampling_param_frequency_penalty", "FP32", [1], optional=True),
    _t("sampling_param_presence_penalty", "FP32", [1], optional=True),
    _t("sampling_param_max_tokens", "INT32", [1], optional=True),
    _t("sampling_param_stop", "STRING", [-1], optional=True),
    _t("sampling_param_seed", "UINT64", [1], optional=True),
    _t("sampling_param_exclude_input_from_output", "BOOL", [1], optional=True),
    _t("sampling_param_return_perf_metrics", "BOOL", [1], optional=True),
    _t("return_finish_reason", "BOOL", [1], optional=True),
    _t("return_stop_reason", "BOOL", [1], optional=True),
    _t("return_cumulative_logprob", "BOOL", [1], optional=True),
    _t("stop", "BOOL", [1], optional=True),
    _t("lora_id", "UINT64", [1], optional=True),
    _t("lora_name", "STRING", [1], optional=True),
    _t("lora_path", "STRING", [1], optional=True),
    _t("lora_ckpt_source", "STRING", [1], optional=True),
)
LLMAPI_OUTPUTS = (
    _t("text_output", "STRING", [-1]),
    _t("finish_reason", "STRING", [-1]),
    _t("stop_reason", "STRING", [-1]),
    _t("cumulative_logprob", "FP32", [-1]),
    _t("kv_cache_reused_block", "INT32", [-1]),
    _t("kv_cache_missed_block", "INT32", [-1]),
    _t("kv_cache_alloc_new_blocks", "INT32", [-1]),
    _t("kv_cache_alloc_total_blocks", "INT32", [-1]),
    _t("kv_cache_hit_rate", "FP32", [-1]),
    _t("arrival_time_ns", "INT64", [1]),
    _t("first_scheduled_time_ns", "INT64", [1]),
    _t("first_token_time_ns", "INT64", [1]),
    _t("last_token_time_ns", "INT64", [1]),
    _t("acceptance_rate", "FP32", [1]),
    _t("total_accepted_draft_tokens", "INT32", [1]),
    _t("total_draft_tokens", "INT32", [1]),
)


def model_yaml(inp: RepoInputs, layout, speculative: bool, tokenizer_dir: Path | None = None) -> dict:
    """`1/model.yaml`: LLM args (model, backend, limits, speculative_config for the speculative model) +
    `triton_config`.

    Upstream model.py passes everything except `triton_config` to LLM(**args) through update_llm_args_with_extra_dict
    and reads triton_config.{max_batch_size, decoupled} in auto_complete_config; max_batch_size 0 there because the
    LLM batches requests in flight itself (up to the LLM args' max_batch_size).
    """
    from specdeploy.core import backends
    from specdeploy.gpu import llmapi_options, trtllm

    r = inp.recipe
    gpu = backends.of(r).gpu
    if gpu:
        options_path = inp.engine_dirs["target"] / trtllm.LLMAPI_OPTIONS
        if not options_path.is_file():
            raise RepoError(
                f"{options_path} is missing", "run: specdeploy build <recipe> (backend trtllm-llmapi writes it)"
            )
        options = yaml.safe_load(options_path.read_text())
        target = inp.engine_manifests["target"].extra.get("checkpoint_dir")
        if not target:
            raise RepoError(
                "the LLM-API build manifest does not name the target checkpoint",
                "run: specdeploy build <recipe> --force",
            )
        head = {"model": target, "backend": "pytorch"}
    else:  # the cpu engines: same option names, engine folders where the GPU has checkpoints
        draft = inp.engine_dirs.get("draft", Path(layout.engine("draft")))
        if (
            inp.eagle3_head_dir is not None
        ):  # the head staged in the repository (write_models), where the server reads it
            draft = Path(layout.repo) / SPECULATIVE_MODEL / EAGLE3_HEAD_SUBDIR
        options = llmapi_options.llmapi_options(r, layout, draft_dir=draft)
        head = {"model": str(inp.engine_dirs["target"]), "tokenizer": str(tokenizer_dir), "backend": "specdeploy-cpu"}
    if not speculative:
        options = {k: v for k, v in options.items() if k != "speculative_config"}
    return {**head, **options, "triton_config": {"max_batch_size": 0, "decoupled": r.triton.decoupled}}


def model_spec(inp: RepoInputs, name: str) -> ModelSpec:
    """config.pbtxt of one llmapi model. GPU: no parameters, and upstream's auto_complete_config sets max_batch_size
    and the transaction policy from model.yaml (launch keeps auto-complete on). CPU: complete, with the parameters
    of specdeploy's model (the speculation policy, the deadline, the executor factory)."""
    from specdeploy.core import backends
    from specdeploy.speculation.policy import PolicySettings

    r = inp.recipe
    parameters = {}
    if not backends.of(r).gpu:
        parameters = {
            "executor_factory": inp.executor_factory,
            "request_timeout_s": str(r.triton.request_timeout_s),
            "add_special_tokens": "true",
            **(PolicySettings.from_recipe(r.speculative).to_parameters() if name == SPECULATIVE_MODEL else {}),
        }
        if r.draft.is_eagle3 and name == SPECULATIVE_MODEL:  # on the GPU the suffix lookup is in model.yaml instead
            parameters.update(eagle3_head_parameters(r))
        if (
            r.draft.is_ngram and name == SPECULATIVE_MODEL
        ):  # specdeploy's own n-gram field (model.yaml has TensorRT-LLM's)
            from specdeploy.speculation import ngram

            parameters["min_matching_ngram_size"] = str(ngram.settings_from_recipe(r).min_matching_ngram_size)
    return ModelSpec(
        name=name,
        backend="python",
        max_batch_size=0,
        inputs=LLMAPI_INPUTS,
        outputs=LLMAPI_OUTPUTS,
        parameters=parameters,
        instance_count=1,
        decoupled=r.triton.decoupled,
    )


def write_models(
    inp: RepoInputs, layout, dest: Path, upstream_src: Path | None = None, tokenizer_dir: Path | None = None
) -> list[str]:
    """Write both models into `dest`; returns the upstream files the container's start copies in (GPU, without a
    TensorRT-LLM checkout `upstream_src`)."""
    from specdeploy.core import backends

    gpu = backends.of(inp.recipe).gpu
    missing = []
    for name in MODELS:
        spec = model_spec(inp, name)
        text = render(spec)
        check_config(text, name)
        model_dir = Path(dest) / name
        (model_dir / "1").mkdir(parents=True, exist_ok=True)
        (model_dir / "config.pbtxt").write_text(text)
        options = model_yaml(inp, layout, name == SPECULATIVE_MODEL, tokenizer_dir)
        (model_dir / "1" / "model.yaml").write_text(yaml.safe_dump(options, sort_keys=False))
        if not gpu:
            shutil.copyfile(MODEL_SOURCES / CPU_SOURCE, model_dir / "1" / "model.py")
            if inp.eagle3_head_dir is not None and name == SPECULATIVE_MODEL:
                stage_eagle3_head(inp, model_dir / EAGLE3_HEAD_SUBDIR)
            continue
        if upstream_src is None:
            missing += llmapi_upstream.repository_missing(Path(dest), (name,))
            continue
        try:
            llmapi_upstream.copy_from_checkout(Path(upstream_src), model_dir / "1")
        except FileNotFoundError as exc:
            raise RepoError(
                f"--trtllm-src {upstream_src} has no {exc.args[0]}",
                "name a TensorRT-LLM checkout of the image's release (it holds "
                f"{llmapi_upstream.UPSTREAM_DIR}/model.py and helpers.py)",
            ) from exc
    return missing


def generate_repository(
    recipe,
    layout,
    recipe_path: str = "RECIPE",
    force: bool = False,
    executor_factory: str | None = None,
    upstream_src: Path | None = None,
    echo=print,
) -> tuple[Path, bool]:
    """`specdeploy repo` for the llmapi layout: `layout.repo` with both models, atomically, with the manifest (stage
    "repo", repository.repo_fingerprint) the shared generator writes; (path, False) when up to date. `upstream_src`
    (a TensorRT-LLM checkout) always rewrites it, with that checkout's model.py and helpers.py."""
    from specdeploy.core import backends
    from specdeploy.core.artifacts import Manifest, atomic_output, tool_versions

    inp = repo_inputs.repo_inputs(recipe, layout, recipe_path, executor_factory)
    fp = repository.repo_fingerprint(inp)
    dest = Path(layout.repo)
    current = Manifest.read(dest)
    if (
        not force
        and upstream_src is None
        and current is not None
        and current.stage == repository.STAGE
        and current.fingerprint == fp
    ):
        return dest, False
    tokenizer = None
    if not backends.of(recipe).gpu:
        tokenizer = repo_inputs.find_tokenizer(
            inp.engine_dirs["target"], inp.engine_manifests["target"], recipe.target.model
        )
        if inp.eagle3_head_dir is not None:
            check_eagle3_head(inp)  # a head that does not fit the target: refused here, naming the file
    with atomic_output(dest) as tmp:
        missing = write_models(inp, layout, tmp, upstream_src, tokenizer)
        Manifest(
            stage=repository.STAGE,
            recipe_name=recipe.name,
            fingerprint=fp,
            settings={
                "backend": recipe.backend,
                "layout": recipe.layout,
                "models": list(MODELS),
                "control": recipe.control,
                "decoupled": recipe.triton.decoupled,
                "num_draft_tokens": recipe.speculative.num_draft_tokens,
                "max_draft_len": recipe.speculative.max_draft_len,
            },
            inputs={f"{role}_engine": m.fingerprint for role, m in inp.engine_manifests.items()},
            tool_versions=tool_versions("tritonclient"),
            extra={"missing_upstream_files": missing, **({"tokenizer_source": str(tokenizer)} if tokenizer else {})},
        ).write(tmp)
    if missing:
        echo(
            f"note: {', '.join(missing)} come from the image when its container starts (specdeploy serve "
            "--print-only prints it); to start tritonserver outside it, run: specdeploy repo RECIPE --trtllm-src "
            "<TensorRT-LLM checkout>"
        )
    return dest, True


def server_args(recipe) -> tuple[str, ...]:
    """tritonserver arguments of the recipe's control mode: load_unload starts with the speculative model only."""
    if recipe.layout != "llmapi" or recipe.control != "load_unload":
        return ()
    return ("--model-control-mode=explicit", f"--load-model={SPECULATIVE_MODEL}")
