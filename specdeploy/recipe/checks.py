"""The checks of a recipe across its keys: choices, ranges and impossible combinations (`num_draft_tokens >
max_draft_len`, a draft kind's keys on another kind, a layout its backend does not serve, ...). Each problem is a
ConfigError that names the key and what to set instead; `check_recipe` runs them all, in order."""

from __future__ import annotations

from specdeploy.core import backends as _backends
from specdeploy.core.errors import ConfigError
from specdeploy.recipe.config import (
    AWQ_BLOCK_SIZES,
    BACKENDS,
    CHAT_TEMPLATE_MODES,
    CONTROL_MODES,
    DRAFT_KINDS,
    EAGLE3_DATA_BACKENDS,
    EAGLE3_EXPORT_DTYPES,
    EAGLE3_HEAD_TRAINED,
    EAGLE3_HEAD_WEIGHTS,
    EAGLE3_LR_SCHEDULES,
    EAGLE3_TRAIN_FEATURES,
    EAGLE3_TRAIN_LOSSES,
    EAGLE3_TRAIN_PRECISIONS,
    ENGINE_DTYPES,
    KV_CACHE_DTYPES,
    NGRAM_MAX_MATCHING_NGRAM_SIZE,
    QFORMATS,
    SPECULATION_POLICIES,
    DraftConfig,
    Eagle3DataConfig,
    Eagle3TrainConfig,
    QuantConfig,
    Recipe,
)


def check_recipe(r: Recipe) -> None:
    """Every check of a parsed recipe; the first problem raises."""
    _check(r)
    _check_operations(r)


def _choice(key: str, value, choices) -> None:
    if value not in choices:
        shown = ", ".join("null" if c is None else str(c) for c in choices)
        raise ConfigError(f"key '{key}' has invalid value {value!r}", f"valid choices: {shown}")


def _at_least(key: str, value, low) -> None:
    if value < low:
        raise ConfigError(f"key '{key}' is {value}, must be >= {low}")


def _only_draft_keys(d, allowed, hint: str = "remove it") -> None:
    """Refuse a set draft lookup key (DraftConfig.NGRAM_KEYS) outside `allowed` (the kind's own)."""
    extra = [k for k in DraftConfig.NGRAM_KEYS if k not in allowed and getattr(d, k) is not None]
    if extra:
        raise ConfigError(f"key 'draft.{extra[0]}' applies to draft.kind ngram only", hint)


def _check_draft_len(d, s, why: str = "") -> None:
    """draft.max_draft_len, where set: at least 1 and at most speculative.max_draft_len (what the target verifies)."""
    if d.max_draft_len is not None:
        _at_least("draft.max_draft_len", d.max_draft_len, 1)
        if d.max_draft_len > s.max_draft_len:
            raise ConfigError(
                f"key 'draft.max_draft_len' ({d.max_draft_len}) is larger than speculative.max_draft_len"
                f" ({s.max_draft_len})",
                f"set draft.max_draft_len <= {s.max_draft_len}{why}",
            )


def _check(r: Recipe) -> None:
    # "." and ".." pass the character check but name no folder of their own: engines/.. is the project root
    if not r.name or r.name in (".", "..") or not all(c.isalnum() or c in "-_." for c in r.name):
        raise ConfigError(f"key 'name' is {r.name!r}", "use letters, digits, '-', '_' or '.' (it names output folders)")
    _choice("backend", r.backend, BACKENDS)
    _check_draft_kind(r)
    for role in r.model_roles:
        _check_model(r, role)
    s = r.speculative
    _at_least("speculative.max_draft_len", s.max_draft_len, 1)
    _at_least("speculative.num_draft_tokens", s.num_draft_tokens, 1)
    _check_draft_p_min(r)
    if s.policy != "static" and _backends.get(r.backend).gpu and r.layout == "llmapi":
        # the llmapi layout on a GPU is TensorRT-LLM's own model (gpu/llmapi_repository.py writes no policy for it): no
        # specdeploy code would read the policy, so the deployment would run TensorRT-LLM's static one unsaid
        raise ConfigError(
            f"key 'speculative.policy' is {s.policy} on backend {r.backend} (llmapi layout), where TensorRT-LLM "
            "decides the draft length itself and no specdeploy model applies a policy",
            "use policy: static with speculative.dynamic (max_concurrency, draft_len_schedule, the acceptance gate), "
            "or triton.layout: inflight_batcher_llm",
        )
    if s.num_draft_tokens > s.max_draft_len:
        raise ConfigError(
            f"key 'speculative.num_draft_tokens' is {s.num_draft_tokens}, larger than speculative.max_draft_len "
            f"({s.max_draft_len}); the target would fail with 'Number of draft tokens is larger than maximum'",
            f"set num_draft_tokens <= {s.max_draft_len} or raise max_draft_len (the target engine is built with it)",
        )
    _check_dynamic(r)
    _choice("speculative.policy", s.policy, SPECULATION_POLICIES)
    _at_least("speculative.probe_interval", s.probe_interval, 1)
    e = r.engine
    _choice("engine.dtype", e.dtype, ENGINE_DTYPES)
    _at_least("engine.max_batch_size", e.max_batch_size, 1)
    _at_least("engine.max_input_len", e.max_input_len, 1)
    if e.max_seq_len <= e.max_input_len:
        raise ConfigError(
            f"key 'engine.max_seq_len' ({e.max_seq_len}) must be larger than engine.max_input_len ({e.max_input_len})",
            "max_seq_len counts prompt plus generated tokens",
        )
    if not 0.0 < e.kv_cache_free_gpu_mem_fraction <= 1.0:
        raise ConfigError(
            f"key 'engine.kv_cache_free_gpu_mem_fraction' is {e.kv_cache_free_gpu_mem_fraction}, must be in (0, 1]"
        )
    t = r.triton
    for port_key in ("grpc_port", "http_port", "metrics_port"):
        port = getattr(t, port_key)
        if not 0 <= port <= 65535:
            raise ConfigError(f"key 'triton.{port_key}' is {port}", "use 0 (pick a free port) or 1..65535")
    _at_least("triton.instance_count", t.instance_count, 1)
    _at_least("triton.bls_instance_count", t.bls_instance_count, 0)
    _at_least("triton.request_timeout_s", t.request_timeout_s, 0)
    _check_layout(r)
    _check_image(r)
    _check_draft_mapping(r)
    v = r.validation
    _at_least("validation.max_tokens", v.max_tokens, 1)
    if v.max_tokens >= e.max_seq_len:
        raise ConfigError(
            f"key 'validation.max_tokens' ({v.max_tokens}) must be below engine.max_seq_len ({e.max_seq_len})"
        )
    if not v.concurrency:
        raise ConfigError("key 'validation.concurrency' is empty", "list at least one level, e.g. [1, 2, 4]")
    for i, level in enumerate(v.concurrency):
        _at_least(f"validation.concurrency[{i}]", level, 1)
    _at_least("validation.repeats", v.repeats, 1)
    if not 0.0 <= v.min_parity <= 1.0:
        raise ConfigError(f"key 'validation.min_parity' is {v.min_parity}, must be in [0, 1]")
    _choice("validation.chat_template", v.chat_template, CHAT_TEMPLATE_MODES)
    _at_least("validation.min_compared_tokens", v.min_compared_tokens, 1)
    if v.min_compared_tokens > v.max_tokens:
        raise ConfigError(
            f"key 'validation.min_compared_tokens' ({v.min_compared_tokens}) is larger than validation.max_tokens"
            f" ({v.max_tokens}): no output could be long enough to compare",
            f"raise validation.max_tokens to at least {v.min_compared_tokens} or lower min_compared_tokens",
        )
    if not 0.0 <= v.min_compared_share <= 1.0:
        raise ConfigError(f"key 'validation.min_compared_share' is {v.min_compared_share}, must be in [0, 1]")
    _at_least("validation.latency_prompts", v.latency_prompts, 0)


def _check_model(r: Recipe, role: str) -> None:
    """One role's model section: quantization choices and ranges, what the backend runs, ranks."""
    m = r.model(role)
    q = m.quantization
    _choice(f"{role}.quantization.qformat", q.qformat, QFORMATS)
    _choice(f"{role}.quantization.kv_cache_dtype", q.kv_cache_dtype, KV_CACHE_DTYPES)
    _choice(f"{role}.quantization.awq_block_size", q.awq_block_size, AWQ_BLOCK_SIZES)
    _at_least(f"{role}.quantization.calib_size", q.calib_size, 1)
    _at_least(f"{role}.quantization.calib_max_seq_length", q.calib_max_seq_length, 8)
    if not q.max_calib_hours > 0:
        raise ConfigError(f"key '{role}.quantization.max_calib_hours' is {q.max_calib_hours}, must be > 0")
    _at_least(f"{role}.tp_size", m.tp_size, 1)
    _at_least(f"{role}.pp_size", m.pp_size, 1)
    backend = _backends.get(r.backend)
    if q.qformat not in backend.qformats:
        raise ConfigError(
            f"key '{role}.quantization.qformat' is {q.qformat!r}, which backend '{r.backend}' cannot run",
            f"qformats for {r.backend}: {', '.join(backend.qformats)}",
        )
    _check_smoothquant(r, role, backend)
    if m.tp_size * m.pp_size > 1 and not backend.multi_rank:
        raise ConfigError(
            f"key '{role}.tp_size'/'{role}.pp_size' asks for {m.tp_size * m.pp_size} ranks on backend '{r.backend}'",
            "the cpu engine runs one rank; set tp_size: 1 and pp_size: 1, or use"
            f" {' or '.join(b.name for b in _backends.ALL if b.multi_rank)}",
        )


def _check_smoothquant(r: Recipe, role: str, backend) -> None:
    """int8_sq's own keys (per_token, smoothquant_alpha): only with qformat int8_sq, in range, where the backend runs
    them."""
    q = r.model(role).quantization
    if q.per_token and q.qformat != "int8_sq":
        raise ConfigError(
            f"key '{role}.quantization.per_token' is true with qformat {q.qformat!r}: per-token activation "
            "scales are an int8_sq (SmoothQuant) setting",
            f"set {role}.quantization.per_token: false, or qformat: int8_sq",
        )
    if q.smoothquant_alpha is not None:
        if q.qformat != "int8_sq":
            raise ConfigError(
                f"key '{role}.quantization.smoothquant_alpha' is set with qformat {q.qformat!r}: it is "
                "SmoothQuant's (int8_sq)",
                f"remove {role}.quantization.smoothquant_alpha, or use qformat: int8_sq",
            )
        if not 0.0 <= q.smoothquant_alpha <= 1.0:
            raise ConfigError(
                f"key '{role}.quantization.smoothquant_alpha' is {q.smoothquant_alpha}, must be in [0, 1] "
                "(ModelOpt's SmoothQuantCalibConfig)",
                "use e.g. 0.8, or null for ModelOpt's default 1.0",
            )
    if q.per_token and not backend.int8_sq_per_token:
        able = " or ".join(b.name for b in _backends.ALL if b.int8_sq_per_token)
        raise ConfigError(
            f"key '{role}.quantization.per_token' is true on backend {r.backend}: ModelOpt exports int8_sq "
            "with static per-tensor activation scales only, and specdeploy does not run TensorRT-LLM's "
            "convert_checkpoint.py --per_token",
            f"set per_token: false on this backend, or use backend {able}",
        )


def _check_layout(r: Recipe) -> None:
    t, backend = r.triton, _backends.get(r.backend)
    if t.layout != "auto" and t.layout not in backend.layouts:
        others = [b.name for b in _backends.ALL if t.layout in b.layouts]
        raise ConfigError(
            f"key 'triton.layout' is {t.layout!r}, which backend '{r.backend}' does not serve (it serves:"
            f" {', '.join(backend.layouts)})",
            (
                f"use backend {' or '.join(others)}, or layout {backend.layouts[0]}"
                if others
                else f"choices: {', '.join(_backends.LAYOUTS)}"
            ),
        )
    _choice("triton.control", t.control, CONTROL_MODES)
    if t.control != "auto" and r.layout != _backends.LLMAPI_LAYOUT:
        raise ConfigError(
            f"key 'triton.control' is {t.control}, which only the llmapi layout has (its control is a model of its"
            " own)",
            "set triton.layout: llmapi, or drop triton.control (the inflight_batcher_llm layout's control, ensemble, "
            "shares the target model with the speculative path)",
        )
    if r.layout == _backends.LLMAPI_LAYOUT and r.canary.control_percent:
        raise ConfigError(
            "canary.control_percent is set, but the canary's control arm lives in tensorrt_llm_bls, which the llmapi"
            " layout does not have",
            "set canary.control_percent: 0, or use triton.layout: inflight_batcher_llm",
        )


def _check_image(r: Recipe) -> None:
    """The image a GPU recipe runs in carries its TensorRT-LLM (trtllm_images); the cpu backend runs in none."""
    from specdeploy.core import trtllm_images

    backend = _backends.get(r.backend)
    if not backend.gpu:
        if r.image != "auto":
            raise ConfigError(
                f"key 'image' is {r.image!r}, but backend {r.backend} runs no container image",
                "remove it (auto), or use a GPU backend",
            )
        return
    if backend.tensorrt_engines:  # the engines' release is known once built: packaging checks it against the image
        if r.image != "auto":
            trtllm_images.image_trtllm(r.image)
        return
    trtllm_images.recipe_image(r)


def _check_draft_mapping(r: Recipe) -> None:
    """trtllm-llmapi: the draft runs in the LLM's own mapping (no speculative config of any release has a tp/pp field,
    docs/gpu.md "What is settled"), so a draft tp_size / pp_size of its own is refused rather than dropped."""
    backend = _backends.get(r.backend)
    d, t = r.draft, r.target
    if not backend.gpu or backend.tensorrt_engines or not d.has_weights_of_its_own:
        return
    if (d.tp_size, d.pp_size) not in ((1, 1), (t.tp_size, t.pp_size)):
        raise ConfigError(
            f"keys 'draft.tp_size' / 'draft.pp_size' are {d.tp_size} / {d.pp_size}, but on backend "
            f"{r.backend} the draft runs in the target's mapping ({t.tp_size} / {t.pp_size}): "
            "TensorRT-LLM's speculative_config has no mapping of its own",
            "remove draft.tp_size and draft.pp_size, or use backend trtllm-engine",
        )


def _check_operations(r: Recipe) -> None:
    if r.cost.machine_price_per_hour < 0:
        raise ConfigError(
            f"key 'cost.machine_price_per_hour' is {r.cost.machine_price_per_hour}, must be >= 0",
            "0 leaves cost out of the report",
        )
    c = r.canary
    if not 0.0 <= c.control_percent <= 100.0:
        raise ConfigError(
            f"key 'canary.control_percent' is {c.control_percent}, must be in [0, 100]",
            "e.g. 20 sends a fifth of the speculative entry point's requests down the plain path",
        )
    if c.window_s <= 0:
        raise ConfigError(f"key 'canary.window_s' is {c.window_s}, must be > 0")
    _at_least("canary.min_requests", c.min_requests, 1)
    if c.min_speedup <= 0 or c.max_p99_ratio <= 0:
        raise ConfigError("keys 'canary.min_speedup' and 'canary.max_p99_ratio' must be > 0")
    if not 0.0 <= c.min_acceptance_rate <= 1.0:
        raise ConfigError(f"key 'canary.min_acceptance_rate' is {c.min_acceptance_rate}, must be in [0, 1]")


ACCEPTANCE_MEASURES = ("rate", "length")


def _check_dynamic(r: Recipe) -> None:
    """speculative.dynamic: shape and ranges here; what a TensorRT-LLM version accepts in trtllm.llmapi_options."""
    d = r.speculative.dynamic
    if d is None:
        return
    if not _backends.get(r.backend).dynamic_speculation:
        raise ConfigError(
            f"key 'speculative.dynamic' is set, but backend '{r.backend}' has no dynamic speculation",
            "remove speculative.dynamic, or use backend"
            f" {' or '.join(b.name for b in _backends.ALL if b.dynamic_speculation)}",
        )
    if d.max_concurrency is not None:
        _at_least("speculative.dynamic.max_concurrency", d.max_concurrency, 1)
    previous = 0
    for i, entry in enumerate(d.draft_len_schedule):
        key = f"speculative.dynamic.draft_len_schedule[{i}]"
        if len(entry) != 2:
            raise ConfigError(f"key '{key}' is {list(entry)}", "each entry is [up_to_batch_size, draft_len]")
        bound, length = entry
        if bound <= previous:
            raise ConfigError(
                f"key '{key}' has batch size {bound} after {previous}", "list batch sizes in ascending order, from 1"
            )
        if not 0 <= length <= r.speculative.num_draft_tokens:
            raise ConfigError(
                f"key '{key}' has draft length {length}",
                f"use 0..{r.speculative.num_draft_tokens} (speculative.num_draft_tokens)",
            )
        previous = bound
    if d.draft_len_schedule and d.draft_len_schedule[0][1] != r.speculative.num_draft_tokens:
        raise ConfigError(
            f"key 'speculative.dynamic.draft_len_schedule[0]' drafts {d.draft_len_schedule[0][1]} tokens, but the"
            f" smallest batch sizes must draft speculative.num_draft_tokens ({r.speculative.num_draft_tokens})",
            "TensorRT-LLM requires the first entry to use the full draft length",
        )
    if d.max_concurrency is not None and d.draft_len_schedule:
        raise ConfigError(
            "keys 'speculative.dynamic.max_concurrency' and 'draft_len_schedule' are both set",
            "use one: a schedule whose last bound is N already turns speculation off above N requests",
        )
    _choice("speculative.dynamic.acceptance_measure", d.acceptance_measure, ACCEPTANCE_MEASURES)
    if (d.acceptance_window is None) != (d.acceptance_threshold is None):
        raise ConfigError(
            "keys 'speculative.dynamic.acceptance_window' and 'acceptance_threshold' go together",
            "set both (window > 0 and a threshold) or neither",
        )
    if d.acceptance_window is not None:
        _at_least("speculative.dynamic.acceptance_window", d.acceptance_window, 1)
        high = 1.0 if d.acceptance_measure == "rate" else float(r.speculative.num_draft_tokens + 1)
        if not 0.0 <= d.acceptance_threshold <= high:
            raise ConfigError(
                f"key 'speculative.dynamic.acceptance_threshold' is {d.acceptance_threshold}, outside 0..{high:g} "
                f"for measure '{d.acceptance_measure}'",
                "a rate is accepted/drafted (0..1); a length is tokens per step (0..num_draft_tokens+1)",
            )


def _check_draft_kind(r: Recipe) -> None:
    d = r.draft
    _choice("draft.kind", d.kind, DRAFT_KINDS)
    if not d.is_eagle3:
        defaults = {
            **({} if d.stages_head else {"head": ""}),
            "head_weights": "auto",
            "serve_vocab_size": 0,
            "sa_config": None,
            "tree": None,
            "data": Eagle3DataConfig(),
            "train": Eagle3TrainConfig(),
        }
        for key, default in defaults.items():
            if getattr(d, key) != default:
                raise ConfigError(
                    f"key 'draft.{key}' applies to draft.kind eagle3 only", "remove it, or set draft.kind: eagle3"
                )
    for kind, keys in (("suffix", DraftConfig.SUFFIX_KEYS), ("mtp", DraftConfig.MTP_KEYS)):
        own = [k for k in keys if k not in DraftConfig.NGRAM_KEYS and getattr(d, k) is not None]
        if own and d.kind != kind:
            raise ConfigError(
                f"key 'draft.{own[0]}' applies to draft.kind {kind} only", f"remove it, or set draft.kind: {kind}"
            )
    if d.is_eagle3:
        _check_eagle3(r)
        return
    if d.is_suffix:
        _check_suffix(r)
        return
    if d.is_auto:
        _check_auto(r)
        return
    if d.is_mtp:
        _check_mtp(r)
        return
    if d.kind in ("pard", "dflash"):
        _check_parallel_draft(r)
        return
    if not d.is_ngram:
        if not d.model:
            raise ConfigError(
                "missing required key 'draft.model'",
                "name a bundled model or a local Hugging Face folder, or set draft.kind: ngram",
            )
        _only_draft_keys(d, (), "remove it, or set draft.kind: ngram")
        return
    _check_no_weights(d)
    s = r.speculative
    _check_draft_len(d, s, ": the target engine verifies at most that many draft tokens")
    if d.max_matching_ngram_size is not None:
        _at_least("draft.max_matching_ngram_size", d.max_matching_ngram_size, 1)
    if d.min_matching_ngram_size is not None:
        _at_least("draft.min_matching_ngram_size", d.min_matching_ngram_size, 1)
        largest = d.max_matching_ngram_size or NGRAM_MAX_MATCHING_NGRAM_SIZE
        if d.min_matching_ngram_size > largest:
            raise ConfigError(
                f"key 'draft.min_matching_ngram_size' ({d.min_matching_ngram_size}) is larger than "
                f"draft.max_matching_ngram_size ({largest})",
                "set min_matching_ngram_size <= max_matching_ngram_size",
            )
        if d.min_matching_ngram_size > 1 and _backends.get(r.backend).gpu:
            raise ConfigError(
                f"key 'draft.min_matching_ngram_size' is {d.min_matching_ngram_size}, but TensorRT-LLM's "
                f"NGramDecodingConfig has no minimum pattern size (backend {r.backend})",
                "remove it (1: every pattern size proposes), or use backend cpu",
            )
    if s.use_draft_logits:
        raise ConfigError(
            "key 'speculative.use_draft_logits' is true, but an n-gram draft has no logits",
            "set use_draft_logits: false (sampled requests are then verified by token matching, which keeps the"
            " target's distribution)",
        )
    if not _backends.get(r.backend).ngram_draft:
        raise ConfigError(
            f"draft.kind ngram is not wired for backend {r.backend}",
            f"use backend {' or '.join(b.name for b in _backends.ALL if b.ngram_draft)} (trtllm-llmapi: decoding_type"
            " NGram)",
        )


def _check_no_weights(d: DraftConfig) -> None:
    """A draft kind without weights of its own (ngram, suffix) takes none of a model's keys."""
    if d.model or d.quantization != QuantConfig() or (d.tp_size, d.pp_size) != (1, 1):
        key = "model" if d.model else ("quantization" if d.quantization != QuantConfig() else "tp_size")
        raise ConfigError(
            f"key 'draft.{key}' does not apply to draft.kind {d.kind} (it has no weights)",
            "remove it from the draft section",
        )


def _check_suffix(r: Recipe) -> None:
    """draft.kind suffix: TensorRT-LLM's SADecodingConfig and its validator (NVIDIA/TensorRT-LLM@0004396
    tensorrt_llm/llmapi/llm_args.py SADecodingConfig.validate_sa_config): max_draft_len > 0; max_matching_ngram_size
    -1 (longest match) or > 0, and in [1, 64] beside enable_global_pool; global_pool_size >= 1 and only with
    enable_global_pool (its description: >= max_batch_size). Which releases have it: gpu/llmapi_versions.py."""
    d, s = r.draft, r.speculative
    _check_no_weights(d)
    _only_draft_keys(d, DraftConfig.SUFFIX_KEYS)
    _check_draft_len(d, s)
    size = d.max_matching_ngram_size
    if size is not None and size != -1 and size < 1:
        raise ConfigError(
            f"key 'draft.max_matching_ngram_size' is {size}",
            "use -1 (the longest earlier match, TensorRT-LLM's default) or a size >= 1",
        )
    if d.enable_global_pool and size not in (None, -1) and size > 64:
        raise ConfigError(
            f"key 'draft.max_matching_ngram_size' is {size} with enable_global_pool, but TensorRT-LLM's global pool "
            "compares at most 64 tokens",
            "use -1 or a size in [1, 64], or remove enable_global_pool",
        )
    if d.global_pool_size is not None:
        _at_least("draft.global_pool_size", d.global_pool_size, 1)
        if not d.enable_global_pool:
            raise ConfigError(
                "key 'draft.global_pool_size' is set, but TensorRT-LLM's global_pool_size requires "
                "enable_global_pool: true",
                "set draft.enable_global_pool: true, or remove global_pool_size",
            )
        if d.global_pool_size < r.engine.max_batch_size:
            raise ConfigError(
                f"key 'draft.global_pool_size' ({d.global_pool_size}) is smaller than engine.max_batch_size "
                f"({r.engine.max_batch_size}): TensorRT-LLM needs a slot for every request in flight",
                f"set global_pool_size >= {r.engine.max_batch_size}, or remove it (max(64, max_batch_size))",
            )
    backend = _backends.get(r.backend)
    if d.enable_global_pool and not backend.gpu:
        raise ConfigError(
            "key 'draft.enable_global_pool' is true, but the CPU engine looks up each request's own tokens only",
            "remove it (false), or use backend trtllm-llmapi",
        )
    if s.use_draft_logits:
        raise ConfigError(
            "key 'speculative.use_draft_logits' is true, but a suffix-automaton draft has no logits",
            "set use_draft_logits: false (sampled requests are then verified by token matching)",
        )
    if not backend.suffix_draft:
        raise ConfigError(
            f"draft.kind suffix is not wired for backend {r.backend}",
            f"use backend {' or '.join(b.name for b in _backends.ALL if b.suffix_draft)} (trtllm-llmapi: "
            "decoding_type SA)",
        )


def _check_auto(r: Recipe) -> None:
    """draft.kind auto: TensorRT-LLM's AutoDecodingConfig ("Attributes that are inherited from the base class are
    ignored", llm_args.py 1.2.0 @7e873e5 and @0004396), so no draft key, no dynamic speculation and no rejection
    sampling: they would be dropped. What it picks (NVIDIA/TensorRT-LLM@7274a59
    tensorrt_llm/_torch/speculative/auto_heuristic.py suggest_spec_config): NGram with max_draft_len 5 and
    max_matching_ngram_size 3 up to max_batch_size 4, else 3 and 5, and max_concurrency 32."""
    d, s = r.draft, r.speculative
    _check_no_weights(d)
    keys = [k for k in (*DraftConfig.NGRAM_KEYS, *DraftConfig.SUFFIX_KEYS) if getattr(d, k) is not None]
    if keys:
        raise ConfigError(
            f"key 'draft.{keys[0]}' does not apply to draft.kind auto: TensorRT-LLM's AutoDecodingConfig picks "
            "the method and its settings itself",
            "remove it, or write the draft out (draft.kind ngram or suffix with its keys)",
        )
    if s.dynamic is not None or s.use_draft_logits:
        key = "dynamic" if s.dynamic is not None else "use_draft_logits"
        raise ConfigError(
            f"key 'speculative.{key}' is set, but TensorRT-LLM's AutoDecodingConfig ignores the settings of "
            "DecodingBaseConfig (it sets max_concurrency 32 itself)",
            f"remove speculative.{key}, or use draft.kind ngram with it",
        )
    if not _backends.get(r.backend).auto_draft:
        small = r.engine.max_batch_size <= 4
        raise ConfigError(
            f"draft.kind auto is not wired for backend {r.backend}: AUTO is a choice TensorRT-LLM's LLM API makes "
            "when it starts (auto_heuristic.py suggest_spec_config), and the choice may change from release to "
            "release; the CPU engine and trtllm-build have no such choice to defer to",
            f"use backend {' or '.join(b.name for b in _backends.ALL if b.auto_draft)}, or write out what it picks "
            f"for engine.max_batch_size {r.engine.max_batch_size}: draft.kind ngram, max_draft_len "
            f"{5 if small else 3}, max_matching_ngram_size {3 if small else 5} (and speculation off above 32 "
            "requests)",
        )


def _check_parallel_draft(r: Recipe) -> None:
    """draft.kind pard / dflash: TensorRT-LLM's PARDDecodingConfig / DFlashDecodingConfig (llm_args.py@0004396): a
    draft checkpoint loaded as it is (speculative_model; its mask token and, for DFlash, the target layers it reads
    come from its config.json), max_draft_len = speculative.num_draft_tokens. Which releases have them:
    gpu/llmapi_versions.py."""
    d = r.draft
    if d.model or d.quantization != QuantConfig() or (d.tp_size, d.pp_size) != (1, 1):
        key = "model" if d.model else ("quantization" if d.quantization != QuantConfig() else "tp_size")
        raise ConfigError(
            f"key 'draft.{key}' does not apply to draft.kind {d.kind}: TensorRT-LLM loads the draft checkpoint as "
            "it is (speculative_model), unquantized by specdeploy",
            "remove it; draft.head names the draft folder",
        )
    keys = [
        k
        for k in (*DraftConfig.NGRAM_KEYS, *DraftConfig.SUFFIX_KEYS, *DraftConfig.MTP_KEYS)
        if getattr(d, k) is not None
    ]
    if keys:
        raise ConfigError(
            f"key 'draft.{keys[0]}' does not apply to draft.kind {d.kind}",
            "remove it (speculative.num_draft_tokens sets max_draft_len)",
        )
    if not d.head or d.head == EAGLE3_HEAD_TRAINED:
        raise ConfigError(
            f"key 'draft.head' must name the {'PARD' if d.kind == 'pard' else 'DFlash'} draft checkpoint folder "
            f"(draft.kind {d.kind})",
            "download or train the draft and set draft.head to its folder",
        )
    backend = _backends.get(r.backend)
    if not backend.parallel_drafts:
        raise ConfigError(
            f"draft.kind {d.kind} is not wired for backend {r.backend}: "
            + (
                "the CPU engine has neither drafter (PARD verifies k drafts made in one pass over mask tokens, "
                "DFlash a draft model that attends to target layers' hidden states)"
                if not backend.gpu
                else "it is a decoding type of TensorRT-LLM's LLM API only"
            ),
            f"use backend {' or '.join(b.name for b in _backends.ALL if b.parallel_drafts)}, or another draft.kind",
        )


def _check_mtp(r: Recipe) -> None:
    """draft.kind mtp: TensorRT-LLM's MTPDecodingConfig, the target's own MTP heads (DeepSeek-V3 and later; whether
    the target has them is read from its config.json by the pre-flight check, deploy/preflight.py). Ranges from the
    1.3.0rc27 / 1.4.0rc4 MTPDecodingConfig pages: relaxed_topk PositiveInt, relaxed_delta NonNegativeFloat, the
    thinking-phase tokens NonNegativeInt; max_draft_len > 0 (llm_args.py@0004396)."""
    d, s = r.draft, r.speculative
    _check_no_weights(d)
    _only_draft_keys(d, DraftConfig.MTP_KEYS)
    _check_draft_len(d, s)
    if d.relaxed_topk is not None:
        _at_least("draft.relaxed_topk", d.relaxed_topk, 1)
    if d.relaxed_delta is not None and not d.relaxed_delta >= 0.0:
        raise ConfigError(f"key 'draft.relaxed_delta' is {d.relaxed_delta}, must be >= 0", "e.g. 0.01, or remove it")
    for key in ("begin_thinking_phase_token", "end_thinking_phase_token"):
        if getattr(d, key) is not None:
            _at_least(f"draft.{key}", getattr(d, key), 0)
    relaxed_keys = [k for k in DraftConfig.MTP_KEYS[2:] if getattr(d, k) is not None]
    if relaxed_keys and not d.use_relaxed_acceptance_for_thinking:
        raise ConfigError(
            f"key 'draft.{relaxed_keys[0]}' is set, but it only acts with use_relaxed_acceptance_for_thinking "
            "(TensorRT-LLM's MTPDecodingConfig)",
            "set draft.use_relaxed_acceptance_for_thinking: true, or remove it",
        )
    backend = _backends.get(r.backend)
    if not backend.mtp_draft:
        raise ConfigError(
            f"draft.kind mtp is not wired for backend {r.backend}: MTP drafts with layers of the target's own "
            "checkpoint (DeepSeek-V3 and later), which "
            + (
                "the CPU engine does not run: it executes Llama, Mistral and Qwen2 checkpoints "
                "(engine/spec.py ARCHITECTURES), none of which has MTP layers"
                if not backend.gpu
                else "TensorRT-LLM's engine path does not build"
            ),
            f"use backend {' or '.join(b.name for b in _backends.ALL if b.mtp_draft)} with a target that has MTP "
            "heads, or another draft.kind here",
        )


def _check_eagle3(r: Recipe) -> None:
    d = r.draft
    if d.model or d.quantization != QuantConfig() or (d.tp_size, d.pp_size) != (1, 1):
        key = "model" if d.model else ("quantization" if d.quantization != QuantConfig() else "tp_size")
        raise ConfigError(
            f"key 'draft.{key}' does not apply to draft.kind eagle3 (the head runs inside the target)",
            "remove it from the draft section; draft.head names the head",
        )
    _only_draft_keys(d, ("max_draft_len",))
    if not d.head:
        raise ConfigError(
            "missing required key 'draft.head' (draft.kind eagle3)",
            f"name an exported EAGLE-3 checkpoint folder, or '{EAGLE3_HEAD_TRAINED}' for the head "
            "`specdeploy draft train RECIPE` writes",
        )
    _check_draft_len(d, r.speculative)
    backend = _backends.get(r.backend)
    _choice("draft.head_weights", d.head_weights, EAGLE3_HEAD_WEIGHTS)
    if d.sa_config is not None:
        _at_least("draft.sa_config.threshold", d.sa_config.threshold, 1)
        if d.sa_config.enable_global_pool and not backend.gpu:
            raise ConfigError(
                "key 'draft.sa_config.enable_global_pool' is true, but the CPU engine looks up each "
                "request's own tokens only",
                "remove it (false), or use backend trtllm-llmapi",
            )
    if d.tree is not None:
        _check_tree(r, backend)
    if d.head_weights == "int8" and backend.gpu:
        raise ConfigError(
            f"key 'draft.head_weights' is int8 on backend {r.backend}, but only the CPU engine quantizes the "
            "head: TensorRT-LLM loads the EAGLE-3 checkpoint as exported (Eagle3DecodingConfig's "
            "speculative_model)",
            "remove draft.head_weights (auto), or set it to bf16",
        )
    _at_least("draft.serve_vocab_size", d.serve_vocab_size, 0)
    if d.serve_vocab_size and backend.gpu:
        raise ConfigError(
            f"key 'draft.serve_vocab_size' is {d.serve_vocab_size} on backend {r.backend}, but only the CPU "
            "engine cuts the head's draft vocabulary: TensorRT-LLM loads the EAGLE-3 checkpoint's own d2t "
            "(Eagle3DecodingConfig's speculative_model)",
            "remove draft.serve_vocab_size (0)",
        )
    if not backend.eagle3_draft:
        able = " or ".join(b.name for b in _backends.ALL if b.eagle3_draft)
        raise ConfigError(
            f"draft.kind eagle3 is not wired for backend {r.backend}: {backend.no_eagle3_because}",
            f"use backend {able} (trtllm-llmapi: decoding_type Eagle3 with the same head folder), "
            "or draft.kind model on this backend",
        )
    # speculative.use_draft_logits on a GPU: use_rejection_sampling where the recipe's TensorRT-LLM release has it
    # (llmapi_options refuses it elsewhere, naming the releases that have it)
    t = d.train
    _choice("draft.train.export_dtype", t.export_dtype, EAGLE3_EXPORT_DTYPES)
    _choice("draft.train.precision", t.precision, EAGLE3_TRAIN_PRECISIONS)
    _choice("draft.train.lr_schedule", t.lr_schedule, EAGLE3_LR_SCHEDULES)
    _choice("draft.train.features", t.features, EAGLE3_TRAIN_FEATURES)
    _choice("draft.train.loss", t.loss, EAGLE3_TRAIN_LOSSES)
    if t.init_head == EAGLE3_HEAD_TRAINED:
        raise ConfigError(
            "key 'draft.train.init_head' is 'trained': the head this recipe trains cannot be its own start",
            "name another head's folder or a bundled head (specdeploy/data/heads), or remove init_head",
        )
    _at_least("draft.train.heldout_samples", t.heldout_samples, 0)
    if t.label_top_k < 0:
        raise ConfigError(
            f"key 'draft.train.label_top_k' is {t.label_top_k}",
            "0 (the whole distribution) or the number of tokens kept, e.g. 64",
        )
    if t.label_top_k and t.features != "engine":
        raise ConfigError(
            "key 'draft.train.label_top_k' needs draft.train.features: engine (the labels come from the CPU engine)",
            "set features: engine, or remove label_top_k",
        )
    if t.feature_cache and not t.label_top_k:
        raise ConfigError(
            "key 'draft.train.feature_cache' needs draft.train.label_top_k (the cache keeps the top-k labels; the"
            " whole distribution is 196 KB a token for SmolLM2)",
            "set features: engine and label_top_k (e.g. 64), or remove feature_cache",
        )
    if t.features == "engine" and backend.gpu:
        raise ConfigError(
            f"key 'draft.train.features' is engine on backend {r.backend}, but only the CPU engine returns "
            "the target's features",
            "remove it (target: ModelOpt runs the target's weights), or use backend cpu",
        )
    _choice("draft.data.backend", d.data.backend, EAGLE3_DATA_BACKENDS)
    _at_least("draft.data.batch_size", d.data.batch_size, 0)
    _at_least("draft.train.draft_vocab_size", t.draft_vocab_size, 2)
    _at_least("draft.train.ttt_steps", t.ttt_steps, 1)
    _at_least("draft.data.num_prompts", d.data.num_prompts, 1)
    _at_least("draft.data.samples_per_prompt", d.data.samples_per_prompt, 1)
    if not 0.0 <= d.data.scored_share <= 1.0:
        raise ConfigError(f"key 'draft.data.scored_share' is {d.data.scored_share}, must be between 0.0 and 1.0")
    if d.data.scored_share > 0.0 and "sharegpt" not in d.data.sources:
        raise ConfigError(
            f"key 'draft.data.scored_share' is {d.data.scored_share}, but draft.data.sources has no sharegpt: only"
            " ShareGPT's conversations carry an answer to score",
            "add sharegpt to draft.data.sources, or remove scored_share (other texts: draft.data.text_files)",
        )


def _check_tree(r: Recipe, backend) -> None:
    """draft.tree: TensorRT-LLM's EAGLE-3 dynamic tree. Its nodes start at one per layer (model_drafter.py asserts
    max_draft_len <= max_total_draft_tokens) and keep at most max_topk per layer; the suffix automaton builds no state
    for a tree (gpu/llmapi_versions.py); the CPU engine verifies chains only."""
    tree, d = r.draft.tree, r.draft
    depth = d.max_draft_len if d.max_draft_len is not None else r.speculative.num_draft_tokens
    if not backend.gpu:
        raise ConfigError(
            f"key 'draft.tree' is set on backend {r.backend}: a tree pass over several draft rows costs more than the "
            "tokens it adds on a CPU (the shipped head's 5-8 node trees measured 0.77-1.02x the chain's speed, "
            "docs/gpu.md)",
            "remove draft.tree (a chain), or use backend trtllm-llmapi",
        )
    _at_least("draft.tree.max_topk", tree.max_topk, 1)
    if not depth <= tree.max_total_draft_tokens <= tree.max_topk * depth:
        raise ConfigError(
            f"key 'draft.tree.max_total_draft_tokens' is {tree.max_total_draft_tokens}, outside "
            f"[{depth}, {tree.max_topk * depth}]: a tree of {depth} layers (the draft length) has at "
            f"least one node a layer and at most max_topk ({tree.max_topk})",
            f"set it between {depth} and {tree.max_topk * depth}",
        )
    if d.sa_config is not None:
        raise ConfigError(
            "keys 'draft.tree' and 'draft.sa_config' are both set, but TensorRT-LLM builds no suffix "
            "automaton for a dynamic tree",
            "remove one of them",
        )


def _check_draft_p_min(r: Recipe) -> None:
    p = r.speculative.draft_p_min
    if not 0.0 <= p < 1.0:
        raise ConfigError(
            f"key 'speculative.draft_p_min' is {p}, must be in [0, 1)",
            "use 0 (draft k tokens every round) or a probability such as 0.2",
        )
    if p > 0 and not r.draft.is_eagle3:
        raise ConfigError(
            f"key 'speculative.draft_p_min' is {p}, but draft.kind is {r.draft.kind}: the cut-off is the "
            "EAGLE-3 head's own probability",
            "remove speculative.draft_p_min, or use draft.kind eagle3",
        )
    if p > 0 and not _backends.get(r.backend).draft_confidence_cutoff:
        # specdeploy writes TensorRT-LLM's Eagle3DecodingConfig with the fields read in each release's llm_args.py
        # (specdeploy/gpu/llmapi_versions.py): speculative_model, max_draft_len, eagle3_layers_to_capture,
        # eagle3_one_model; none is a confidence cut-off, so the GPU path would silently draft k every round
        able = " or ".join(b.name for b in _backends.ALL if b.draft_confidence_cutoff)
        raise ConfigError(
            f"key 'speculative.draft_p_min' is {p} on backend {r.backend}: TensorRT-LLM's EAGLE-3 options "
            "have no confidence cut-off (specdeploy/gpu/llmapi_versions.py)",
            f"set speculative.draft_p_min: 0 on this backend, or use backend {able}",
        )
