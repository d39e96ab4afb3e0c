"""Backend trtllm-llmapi: the recipe as LLM-API options (`LLM(...)`, `trtllm-serve` and Triton's llmapi model read
them) for one TensorRT-LLM release (llmapi_versions): every speculative setting mapped or refused, never dropped;
EAGLE-3 heads read from their config.json."""

from __future__ import annotations

import json
from pathlib import Path

from specdeploy.core import backends
from specdeploy.core.artifacts import Layout
from specdeploy.core.errors import ConfigError
from specdeploy.gpu.llmapi_versions import LLMAPI_VERSIONS, LlmApiVersion, llmapi_version
from specdeploy.gpu.trtllm_build import engine_max_input_len
from specdeploy.recipe.config import Recipe


def _draft_len_schedule(schedule: tuple, form: str) -> dict[int, int]:
    """specdeploy's [[up_to_batch, draft_len], ...] (speculation off above the last bound) in a release's form.

    upper: {up_to_batch: draft_len} as is (batch sizes above the largest key draft 0).
    lower: {from_batch: draft_len}: the first entry starts at batch 1, each next one at the previous bound + 1,
    and one more entry turns speculation off (0) above the last bound.
    """
    if form == "upper":
        return {int(bound): int(length) for bound, length in schedule}
    out, start = {}, 1
    for bound, length in schedule:
        out[start] = int(length)
        start = int(bound) + 1
    out[start] = 0
    return out


# ---------------------------------------------------------------- EAGLE-3 heads (draft.kind eagle3)


def eagle3_head_source(recipe: Recipe, layout: Layout) -> Path:
    """The recipe's EAGLE-3 head folder (Layout.eagle3_head_source: trained, bundled or a path)."""
    return layout.eagle3_head_source(recipe.draft.head)


def read_eagle3_head_config(head_dir: Path) -> dict | None:
    """The head's config.json, or None when the folder is not on this machine (a dry run before the download)."""
    path = Path(head_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}", "re-download or re-export the EAGLE-3 head") from exc


def eagle3_aux_layers(head_config: dict | None) -> list[int] | None:
    """The target layers whose OUTPUTS the head reads (TensorRT-LLM's `eagle3_layers_to_capture` convention, whose
    default {1, L//2-1, L-4} is ModelOpt's), from the head's config.json; None: the consumer's default.

    Two conventions name them. ModelOpt's export nests `eagle_config.eagle_aux_hidden_state_layer_ids` and hooks
    the outputs of those layers (modelopt/torch/speculative/plugins/hf_eagle.py: `register_forward_hook` on
    `layers[i]` for i in the ids). vLLM and llama.cpp read a top-level `eagle_aux_hidden_state_layer_ids` as the
    stream ENTERING layer i (vLLM model_executor/models/llama.py LlamaModel.forward appends `hidden_states +
    residual` before running layer idx; llama.cpp `extract_layer_inputs`), i.e. the output of layer i - 1.
    The nested ids win; top-level ones are shifted by one."""
    if not head_config:
        return None
    nested = (head_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return sorted(int(i) for i in nested)
    entering = head_config.get("eagle_aux_hidden_state_layer_ids")
    return sorted(int(i) - 1 for i in entering) if entering else None


def _eagle3_options(recipe: Recipe, version: LlmApiVersion, head_dir: Path, head_config: dict | None) -> dict:
    """Eagle3DecodingConfig (EagleDecodingConfig before 1.3) for one release; only fields verified there."""
    d, s = recipe.draft, recipe.speculative
    draft_len = d.max_draft_len if d.max_draft_len is not None else s.num_draft_tokens
    if s.dynamic and s.dynamic.draft_len_schedule and draft_len != s.num_draft_tokens:
        raise ConfigError(
            f"draft.max_draft_len ({draft_len}) differs from speculative.num_draft_tokens ({s.num_draft_tokens}), but "
            "TensorRT-LLM requires the draft_len_schedule's first entry to equal speculative_config.max_draft_len",
            "drop draft.max_draft_len (it defaults to num_draft_tokens) or drop the schedule",
        )
    spec = {
        "decoding_type": version.decoding_types["eagle3"],
        "max_draft_len": draft_len,
        version.draft_model_key: str(head_dir),
    }
    if "eagle3_one_model" in version.eagle3_fields:
        spec["eagle3_one_model"] = (
            True  # the draft runs inside the target's engine (the default; two-model is deprecated)
        )
    layers = eagle3_aux_layers(head_config)
    if layers:
        if "eagle3_layers_to_capture" not in version.eagle3_fields:
            raise ConfigError(
                f"the EAGLE-3 head reads target layers {layers}, but eagle3_layers_to_capture is not "
                f"verified for TensorRT-LLM {version.name}",
                "use trtllm_version 1.1 or later",
            )
        spec["eagle3_layers_to_capture"] = layers
    sa = d.sa_config
    if (
        sa is not None and backends.of(recipe).gpu
    ):  # the CPU engine takes it as a model parameter (gpu/llmapi_repository.py)
        if "sa_config" not in version.eagle3_fields:
            raise ConfigError(
                "key 'draft.sa_config' is set, but Eagle3DecodingConfig.sa_config is not verified for "
                f"TensorRT-LLM {version.name}",
                "use trtllm_version 1.3 or later, or remove draft.sa_config",
            )
        spec["sa_config"] = {"threshold": sa.threshold, "enable_global_pool": sa.enable_global_pool}
    if d.tree is not None:
        if "use_dynamic_tree" not in version.eagle3_fields:
            raise ConfigError(
                f"key 'draft.tree' is set, but use_dynamic_tree is not verified for TensorRT-LLM {version.name}",
                "use trtllm_version 1.3 or later, or remove draft.tree",
            )
        spec.update(
            use_dynamic_tree=True,
            dynamic_tree_max_topK=d.tree.max_topk,
            max_total_draft_tokens=d.tree.max_total_draft_tokens,
        )
    return spec


def speculative_options(
    recipe: Recipe, version: LlmApiVersion, draft_dir: Path, kind: str = "draft_target", head_config: dict | None = None
) -> dict:
    """`speculative_config` for one TensorRT-LLM release. Every recipe setting is mapped or refused, never dropped.

    - speculative.num_draft_tokens -> max_draft_len: the LLM API drafts max_draft_len tokens every iteration (it
      has no separate per-request count), so the tokens drafted per round set it; speculative.max_draft_len only
      bounds num_draft_tokens (there is no engine to build it into).
    - speculative.use_draft_logits -> use_rejection_sampling where the release's decoding type takes it
      (LlmApiVersion.rejection_sampling), refused where it does not.
    """
    s = recipe.speculative
    _check_decoding_type(recipe, version, kind)
    if s.use_draft_logits:
        _check_rejection_sampling(recipe, version, kind)
    spec = {
        "decoding_type": version.decoding_types[kind],
        "max_draft_len": s.num_draft_tokens,
        version.draft_model_key: str(draft_dir),
    }
    if kind == "eagle3":  # draft_dir is the head folder; head_config its config.json (None: not on this machine)
        spec = _eagle3_options(recipe, version, draft_dir, head_config)
    if kind == "ngram":  # NGramDecodingConfig: no draft model; the recipe's draft section carries its fields
        from specdeploy.speculation.ngram import TRTLLM_FIELDS, settings_from_recipe

        settings = settings_from_recipe(recipe)
        spec = {"decoding_type": version.decoding_types[kind], **{f: getattr(settings, f) for f in TRTLLM_FIELDS}}
    if kind == "suffix":  # SADecodingConfig: no draft model either
        from specdeploy.speculation.ngram import suffix_settings_from_recipe

        settings, d = suffix_settings_from_recipe(recipe), recipe.draft
        spec = {
            "decoding_type": version.decoding_types[kind],
            "max_draft_len": settings.max_draft_len,
            "max_matching_ngram_size": settings.max_matching_ngram_size,
            "enable_global_pool": bool(d.enable_global_pool),
        }
        if d.global_pool_size is not None:
            spec["global_pool_size"] = d.global_pool_size
    if kind == "auto":  # AutoDecodingConfig ignores the base fields: the LLM API picks (recipe checks refuse them)
        spec = {"decoding_type": version.decoding_types[kind]}
    if kind == "mtp":  # MTPDecodingConfig: the target's own heads, no draft model
        spec = _mtp_options(recipe, version)
    if s.use_draft_logits:
        spec["use_rejection_sampling"] = True
    if s.dynamic is None:
        return spec
    return _with_dynamic(spec, s.dynamic, version)


# The recipe's draft kind as TensorRT-LLM names its class, for refusals
DECODING_CLASSES = {
    "draft_target": "DraftTargetDecodingConfig",
    "ngram": "NGramDecodingConfig",
    "eagle3": "Eagle3DecodingConfig",
    "suffix": "SADecodingConfig",
    "auto": "AutoDecodingConfig",
    "mtp": "MTPDecodingConfig",
    "pard": "PARDDecodingConfig",
    "dflash": "DFlashDecodingConfig",
}


def decoding_kind(recipe: Recipe) -> str:
    """The recipe's draft as a key of LlmApiVersion.decoding_types."""
    return "draft_target" if recipe.draft.kind == "model" else recipe.draft.kind


def _mtp_options(recipe: Recipe, version: LlmApiVersion) -> dict:
    """MTPDecodingConfig for one release: the draft length under the release's key (num_nextn_predict_layers on 1.1
    / 1.2, max_draft_len after), relaxed acceptance only where the recipe turns it on (llmapi_versions.py)."""
    d = recipe.draft
    draft_len = d.max_draft_len if d.max_draft_len is not None else recipe.speculative.num_draft_tokens
    spec = {"decoding_type": version.decoding_types["mtp"], version.mtp_draft_len_key: draft_len}
    if d.use_relaxed_acceptance_for_thinking:
        spec["use_relaxed_acceptance_for_thinking"] = True
        spec["relaxed_topk"] = d.relaxed_topk if d.relaxed_topk is not None else 1
        spec["relaxed_delta"] = d.relaxed_delta if d.relaxed_delta is not None else 0.0
        begin_key, end_key = version.mtp_thinking_keys
        if d.begin_thinking_phase_token is not None:
            spec[begin_key] = d.begin_thinking_phase_token
        if d.end_thinking_phase_token is not None:
            spec[end_key] = d.end_thinking_phase_token
    return spec


def _check_decoding_type(recipe: Recipe, version: LlmApiVersion, kind: str) -> None:
    """Refuse a draft kind whose decoding type the release does not have, naming the releases that have it."""
    if kind in version.decoding_types:
        return
    able = [v.name for v in LLMAPI_VERSIONS.values() if kind in v.decoding_types]
    raise ConfigError(
        f"draft.kind {recipe.draft.kind} is TensorRT-LLM's {DECODING_CLASSES[kind]}, which TensorRT-LLM "
        f"{version.name} does not have ({version.decoding_evidence or version.evidence})",
        f"set trtllm_version to {' or '.join(able)}" if able else "use another draft.kind",
    )


def _check_rejection_sampling(recipe: Recipe, version: LlmApiVersion, kind: str) -> None:
    """speculative.use_draft_logits: refused where the release's decoding type has no use_rejection_sampling, and
    beside draft.sa_config, whose suffix-automaton drafts carry no draft distribution to sample against."""
    decoding_type = version.decoding_types[kind]
    if kind not in version.rejection_sampling:
        able = [v.name for v in LLMAPI_VERSIONS.values() if kind in v.rejection_sampling]
        raise ConfigError(
            f"speculative.use_draft_logits is true, but TensorRT-LLM {version.name}'s {decoding_type} config has no "
            f"use_rejection_sampling ({version.rejection_sampling_evidence})",
            (
                f"set trtllm_version to {' or '.join(able)} (their {decoding_type} takes use_rejection_sampling), or "
                if able
                else ""
            )
            + "set use_draft_logits: false (greedy requests are verified token by token)",
        )
    if recipe.draft.sa_config is not None:
        raise ConfigError(
            "speculative.use_draft_logits and draft.sa_config are both set: tokens the suffix automaton "
            "drafts have no draft probability for rejection sampling",
            "remove one of them",
        )


def _with_dynamic(spec: dict, d, version: LlmApiVersion) -> dict:
    """speculative.dynamic in `spec`: max_concurrency, the draft-length schedule, the acceptance gate."""
    if d.max_concurrency is not None:
        spec["max_concurrency"] = d.max_concurrency
    if d.draft_len_schedule:
        if version.draft_len_schedule is None:
            raise ConfigError(
                "speculative.dynamic.draft_len_schedule is set, but draft_len_schedule is not verified for "
                f"TensorRT-LLM {version.name} ({version.evidence})",
                "use max_concurrency instead, or target trtllm_version 1.2 or later",
            )
        spec["draft_len_schedule"] = _draft_len_schedule(d.draft_len_schedule, version.draft_len_schedule)
    if d.acceptance_window is not None:
        if version.acceptance_keys is None:
            raise ConfigError(
                f"TensorRT-LLM {version.name} has no acceptance gate",
                "remove speculative.dynamic.acceptance_window/threshold",
            )
        if d.acceptance_measure != version.acceptance_measure:
            words = {
                "rate": "acceptance rate (accepted / drafted tokens, 0..1) over speculative iterations",
                "length": "mean acceptance length (tokens per step) over completed requests",
            }
            raise ConfigError(
                f"speculative.dynamic.acceptance_measure is '{d.acceptance_measure}', but TensorRT-LLM {version.name} "
                f"gates on the {words[version.acceptance_measure]} ({version.acceptance_keys[1]}); the two do not "
                "convert into each other",
                f"set acceptance_measure: {version.acceptance_measure} and a threshold in those units, or change "
                "trtllm_version",
            )
        window_key, threshold_key = version.acceptance_keys
        spec[window_key] = d.acceptance_window
        spec[threshold_key] = d.acceptance_threshold
    return spec


def llmapi_options(
    recipe: Recipe, layout: Layout, version: LlmApiVersion | None = None, draft_dir: Path | None = None
) -> dict:
    """The LLM-API options (keys of tensorrt_llm.llmapi LLM args) for draft/target speculative decoding.

    Names follow the recipe's trtllm_version (LLMAPI_VERSIONS). Top-level keys, stable across the supported
    releases (llm_args.py): `kv_cache_config.{free_gpu_memory_fraction, enable_block_reuse, dtype}`,
    `max_batch_size`, `max_input_len`, `max_seq_len`, `tensor_parallel_size`,
    `pipeline_parallel_size`. `draft_dir`: the draft model (default: the
    draft checkpoint; the cpu backend's llmapi layout names the draft engine).
    """
    version = version or llmapi_version(recipe.trtllm_version)
    target, e = recipe.target, recipe.engine
    kv_dtype = target.quantization.kv_cache_dtype
    return {
        "tensor_parallel_size": target.tp_size,
        "pipeline_parallel_size": target.pp_size,
        "max_batch_size": e.max_batch_size,
        "max_input_len": engine_max_input_len(recipe),  # the speculative flow resends prompt + output
        "max_seq_len": e.max_seq_len,
        # NVIDIA's quick start runs Draft/Target and NGram without the overlap scheduler; EAGLE-3 one-model and the
        # suffix automaton keep it (NVIDIA/TensorRT-LLM@b35ac1b tensorrt_llm/_torch/speculative/interface.py
        # support_overlap_scheduler: eagle3_one_model in every version of it read, is_sa() and draft models in the
        # newest; @0004396 llm_args.py SADecodingConfig: "supports CUDA graph and overlap scheduler")
        # PARD / DFlash: not read in a release's support_overlap_scheduler, so off (it costs speed only)
        "disable_overlap_scheduler": decoding_kind(recipe)
        in ("draft_target", "ngram", "auto", "pard", "dflash"),  # auto: an NGram
        "kv_cache_config": {
            "free_gpu_memory_fraction": e.kv_cache_free_gpu_mem_fraction,
            # NVIDIA's own DraftTarget tests run with block reuse off, before and after the speculative_model
            # rename (NVIDIA/TensorRT-LLM@104ead7 tests/unittest/_torch/speculative/test_draft_target.py:30 and
            # @00c1146 tests/unittest/_torch/speculative/hw_agnostic/test_draft_target.py:45 and its rejection test:
            # `KvCacheConfig(enable_block_reuse=False...)`); no NVIDIA source shows reuse safe with a draft model.
            "enable_block_reuse": False,
            "dtype": kv_dtype if kv_dtype == "fp8" else "auto",
        },
        "speculative_config": _speculative_config(recipe, layout, version, draft_dir),
    }


def _speculative_config(recipe: Recipe, layout: Layout, version: LlmApiVersion, draft_dir: Path | None) -> dict:
    d = recipe.draft
    if d.kind in ("pard", "dflash"):  # the draft folder staged by the build, as for an EAGLE-3 head
        return speculative_options(recipe, version, draft_dir or layout.engine("draft"), d.kind)
    if d.is_eagle3:
        # the build stages the head in the deployment (engines/<recipe>/draft, under the project root that the
        # container and the Kubernetes volume mount at the same path): speculative_model points there
        head_config = read_eagle3_head_config(eagle3_head_source(recipe, layout))
        return speculative_options(recipe, version, draft_dir or layout.engine("draft"), "eagle3", head_config)
    return speculative_options(recipe, version, draft_dir or layout.checkpoint("draft"), decoding_kind(recipe))


def llmapi_mapping_notes(recipe: Recipe, version: LlmApiVersion | None = None) -> list[str]:
    """What the options file does with the recipe's speculative settings, for the dry run and the manifest."""
    version = version or llmapi_version(recipe.trtllm_version)
    s = recipe.speculative
    kind = decoding_kind(recipe)
    _check_decoding_type(recipe, version, kind)
    notes = [
        (
            f"TensorRT-LLM {version.name} ({version.releases}): decoding_type {version.decoding_types[kind]}, "
            + (
                f"draft model key {version.draft_model_key}"
                if kind in ("draft_target", "eagle3", "pard", "dflash")
                else "no draft model"
            )
        ),
        (
            f"speculative.num_draft_tokens {s.num_draft_tokens} -> speculative_config."
            f"{version.mtp_draft_len_key if kind == 'mtp' else 'max_draft_len'} (drafted every iteration; "
            "draft.max_draft_len where the kind has one); "
            f"speculative.max_draft_len {s.max_draft_len} only bounds it"
        ),
    ]
    if s.dynamic and s.dynamic.draft_len_schedule:
        notes.append(f"draft_len_schedule written with {version.draft_len_schedule}-bound keys")
    if kind == "mtp" and recipe.draft.use_relaxed_acceptance_for_thinking:
        notes.append(
            "MTP relaxed acceptance: between the thinking-phase tokens a draft token is accepted when it is among the "
            "target's top relaxed_topk within relaxed_delta of its top-1, so the output there is not the target's own "
            "greedy output; validate's parity reports the difference"
        )
    if kind == "auto":
        notes[1] = (
            "decoding_type AUTO: TensorRT-LLM picks the method and its draft length (an NGram draft in "
            "auto_heuristic.py@7274a59); speculative.num_draft_tokens is not passed"
        )
    # The names come from llm_args.py on TensorRT-LLM's main branch around the renames (LLMAPI_VERSIONS), not from
    # each release's tag, which could not be read here; the build's start check (LLM(...)) is what confirms them.
    notes.append(
        f"names read on TensorRT-LLM main around the renames, not from the {version.name} release's tag: "
        "the build's LLM(...) start check on the GPU machine confirms them"
    )
    if kind == "eagle3":
        fields = ", ".join(version.eagle3_fields) or "none"
        notes.append(
            f"EAGLE-3 fields verified for {version.name}: max_draft_len, {version.draft_model_key}, {fields} "
            f"({version.eagle3_evidence}); the head is staged in the deployment and speculative_model points there"
        )
    return notes
