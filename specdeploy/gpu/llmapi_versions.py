"""Backend trtllm-llmapi: how each TensorRT-LLM release names the LLM-API's speculative-decoding options
(`LlmApiVersion`, one per release line, each fact cited), and the recipe's `trtllm_version` read into one of them."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from specdeploy.core.errors import ConfigError

# The LLM-API option names and meanings per TensorRT-LLM release. Each fact is from
# tensorrt_llm/llmapi/llm_args.py (DecodingBaseConfig, DraftTargetDecodingConfig) at the commits around the
# changes, and from docs/source/features/speculative-decoding.md:
# - decoding_type: until the speculative configs became a pydantic union discriminated by a `decoding_type:
#   Literal["Draft_Target"]` field, DecodingBaseConfig.from_dict dispatched on a table keyed "DraftTarget" (the
#   class attribute "Draft_Target" was not a key there: "Invalid decoding type"). After it, "Draft_Target" is the
#   literal and "DraftTarget" a documented alias (the docs' YAML list of decoding types).
# - the draft model: `speculative_model_dir` until PR #10099 (2025-12-18) renamed it `speculative_model`, keeping
#   `speculative_model_dir` as a validation alias (AliasChoices); before it, `speculative_model` is an unknown key
#   of a StrictBaseModel (rejected).
# - max_concurrency: "speculation will be disabled at batch sizes above this value" (same meaning throughout).
# - draft_len_schedule: added by PR #8194 (Oct 2025) with LOWER-bound keys ({1: 4, 4: 2, 8: 0}: batch >= 1 drafts
#   4, >= 4 drafts 2, >= 8 drafts 0; key 1 required and == max_draft_len); PR #10860 (Jan 2026) made the keys
#   UPPER bounds ({4: 4, 8: 2, 32: 1}: batch 1-4 drafts 4, 5-8 drafts 2, 9-32 drafts 1, 33+ off; smallest key
#   == max_draft_len; mutually exclusive with max_concurrency).
# - acceptance gate (speculation off for good once a rolling mean drops below a threshold):
#   `acceptance_window` + `acceptance_length_threshold` (mean acceptance LENGTH over the last N completed
#   requests) until PR #12905 (2026-04-09, "BREAKING"), then `acceptance_rate_window_size` +
#   `acceptance_rate_threshold` (accepted_draft_tokens / drafted_tokens over the last N speculative iterations,
#   0..1).
# - EAGLE-3 (draft.kind eagle3), read in each release's own llm_args.py as its documentation publishes it
#   (NVIDIA/TensorRT-LLM gh-pages `<release>/_modules/tensorrt_llm/llmapi/llm_args.html`, Sphinx viewcode: the
#   release's source without line numbers, so classes and fields are cited by name) and API reference pages:
#   1.1.0 (@8660c11): EagleDecodingConfig with `decoding_type: ClassVar[str] = "Eagle"`, fields
#     `eagle3_one_model: Optional[bool] = True`, `eagle3_layers_to_capture: Optional[Set[int]] = None`;
#     validate() reads `speculative_model_dir`; no Eagle3DecodingConfig.
#   1.2.0 (@7e873e5): the same EagleDecodingConfig fields (plus eagle3_model_arch); DecodingBaseConfig.from_dict
#     dispatches "Eagle" -> EagleDecodingConfig (no "Eagle3" key; "DraftTarget", "NGram" as above);
#     `speculative_model` with validation_alias AliasChoices("speculative_model", "speculative_model_dir").
#     On the PyTorch backend decoding_type Eagle IS EAGLE-3 (spec_dec_mode EAGLE3_ONE_MODEL / EAGLE3).
#   PR #10124 (merged 2025-12-18, after the 1.2 branch) added `decoding_type: Eagle3` and deprecated Eagle there.
#   1.3.0rc27 and 1.4.0rc1 (API pages llm-api/reference/Eagle3DecodingConfig.html): `decoding_type:
#     Literal['Eagle3']`, `speculative_model`, `max_draft_len`, `eagle3_layers_to_capture: Set[int] | None`; neither
#     page lists `eagle3_one_model` (main's llm_args.py still has it, default True, "Eagle3 2-model is deprecated and
#     will be removed in release 1.4"), so specdeploy leaves it out there: the default is the one-model path.
#   sa_config (draft.sa_config): 1.3.0rc27, 1.4.0rc1 and 1.4.0rc4 API pages list `sa_config: SAEnhancerConfig |
#     None = None` on Eagle3DecodingConfig ("When set, combines SA drafting with Eagle3 speculative decoding", beta);
#     main's llm_args.py: `class SAEnhancerConfig(StrictBaseModel)` with `threshold: PositiveInt = 4` ("Minimum
#     suffix match length required for the SA output to override neural draft tokens") and `enable_global_pool:
#     bool = False`. The suffix automaton drafts for the one-model path only (`_torch/speculative/utils.py`
#     get_spec_resource_manager; two-model and dynamic-tree EAGLE-3 build no SA state). Before (PR #11878, merged
#     2026-03, "Integrate SA with EAGLE3 and PARD") main spelled it `use_sa_spec` / `sa_spec_threshold`; no release
#     page seen lists those, so specdeploy writes sa_config and only where a release page shows it.
#   use_dynamic_tree (draft.tree): the 1.3.0rc27, 1.4.0rc1 and 1.4.0rc4 Eagle3DecodingConfig pages list
#     `use_dynamic_tree: bool | None = False`, `dynamic_tree_max_topK: int | None`, and DecodingBaseConfig's
#     `max_total_draft_tokens: int | None`; 1.1.0's and 1.2.0's fields were not read for them, so they are refused.
#   eagle3_layers_to_capture means "Target model layer indices to capture hidden states from ... Defaults to {1,
#   num_layers//2-1, num_layers-4}" in every one of them: the convention of ModelOpt's exported
#   `eagle_aux_hidden_state_layer_ids`, written through unchanged when the head's config.json names them.
# - use_rejection_sampling (speculative.use_draft_logits): a DecodingBaseConfig field, `use_rejection_sampling: bool =
#   False`, on the 1.3.0rc27, 1.4.0rc1 and 1.4.0rc4 API pages (llm-api/reference/Eagle3DecodingConfig.html and every
#   other *DecodingConfig page). PR #12588 (merged 2026-05-15) added it for EAGLE-3 one-model, PR #15775 (2026-07)
#   extended it to one-model MTP / DRAFT_TARGET / PARD / DFLASH. 1.1.0's and 1.2.0's DecodingBaseConfig (read as
#   above) have no such field, and a StrictBaseModel rejects the key. n-gram drafts have no distribution to sample.
# - suffix (draft.kind suffix): SADecodingConfig, the standalone suffix automaton (no draft model). Main's llm_args.py
#   (NVIDIA/TensorRT-LLM@0004396): `decoding_type: Literal["SA"]`, `max_matching_ngram_size: int = -1` (-1: longest
#   match; n > 0: sizes n down to 1; 0 refused), `enable_global_pool: bool = False`, `global_pool_size:
#   Optional[PositiveInt] = None` (requires enable_global_pool; max_matching_ngram_size in [1, 64] or -1 with it),
#   max_draft_len > 0. The 1.3.0rc27 and 1.4.0rc4 API pages (llm-api/reference/SADecodingConfig.html) list the same
#   fields; 1.1.0's and 1.2.0's from_dict tables (gh-pages @8660c11, @7e873e5) have no "SA" key ("Invalid decoding
#   type"). The 1.3.0 candidates rc22-rc26 were not read.
# - auto (draft.kind auto): AutoDecodingConfig, "automatically select a good, draft-model free speculation algorithm";
#   "Attributes that are inherited from the base class are ignored". The "AUTO" key of 1.1.0's and 1.2.0's from_dict
#   tables (gh-pages @8660c11, @7e873e5; no fields of its own), `decoding_type: Literal['AUTO']` on the 1.3.0rc29 page
#   and in main's llm_args.py (@0004396). What it picks: NVIDIA/TensorRT-LLM@7274a59
#   tensorrt_llm/_torch/speculative/auto_heuristic.py (NGram, max_draft_len 5 / 3, max_matching_ngram_size 3 / 5 at
#   max_batch_size <= 4 / above, max_concurrency 32); that file was not read at the release tags.
# - mtp (draft.kind mtp): MTPDecodingConfig, the target's own MTP heads. 1.1.0 (gh-pages @8660c11) and 1.2.0
#   (@7e873e5): fields `num_nextn_predict_layers: int = 1`, `use_relaxed_acceptance_for_thinking: bool = False`,
#   `relaxed_topk: int = 1`, `relaxed_delta: float = 0.`, `use_mtp_vanilla`, `mtp_eagle_one_model`, and the thinking
#   tokens, spelled `BEGIN_THINKING_PHASE_TOKEN` / `END_THINKING_PHASE_TOKEN` in 1.1.0 and
#   `begin_thinking_phase_token` / `end_thinking_phase_token` in 1.2.0 (128798 / 128799); `from_dict` sets
#   `max_draft_len = num_nextn_predict_layers`, so the draft length is written as num_nextn_predict_layers there.
#   1.3.0rc27, 1.4.0rc1 and 1.4.0rc4 pages (MTPDecodingConfig.html): `max_draft_len` (None: from the checkpoint),
#   `relaxed_topk: PositiveInt = 1`, `relaxed_delta: NonNegativeFloat = 0.0`, `num_nextn_predict_layers: int | None =
#   None`, which main's llm_args.py (@0004396) marks internal ("Do not set manually") and remaps to max_draft_len with a
#   deprecation warning: max_draft_len is written there. How many heads the target has: its config.json's
#   `num_nextn_predict_layers` (DeepSeek-style) or `mtp_num_hidden_layers` (Qwen3-Next-style), 1 when neither
#   (NVIDIA/TensorRT-LLM@011d093 tensorrt_llm/_torch/speculative/utils.py update_spec_config_from_model_config).
# - pard / dflash (draft.kind pard, dflash): PARDDecodingConfig (`decoding_type: Literal["PARD"]`,
#   `mask_token_id: Optional[int] = None` "read from the draft model config", `sa_config`) and DFlashDecodingConfig
#   (`Literal["DFlash"]`,
#   `mask_token_id`, `target_layer_ids: Optional[List[int]] = None` "read from the draft model config
#   (dflash_config.target_layer_ids)") in main's llm_args.py (@0004396); both take speculative_model and max_draft_len.
#   Release pages: DFlashDecodingConfig.html on 1.3.0rc27 (plus `attention_backend`); PARDDecodingConfig.html on
#   1.4.0rc1 and 1.4.0rc4, none found for 1.3 (so PARD is refused on 1.3 as unverified). 1.1.0 / 1.2.0 have neither
#   in from_dict. specdeploy writes decoding_type, max_draft_len and speculative_model only (the checkpoint's own
#   config supplies the rest).
# Release lines from PyPI upload dates: 1.1.0 2025-12-19, 1.2.0 2026-03-12 (branch: rc6 2025-12-23),
# 1.3.0rc0 2026-01-22 ... rc22 2026-07-22, 1.4.0rc0 2026-10-13. The 1.3.0 release candidates before rc22 straddle
# PRs #10860 and #12905, so specdeploy names no options for them rather than guess.


@dataclass(frozen=True)
class LlmApiVersion:
    """How one TensorRT-LLM release spells draft/target speculative decoding in the LLM-API options."""

    name: str
    releases: str  # which releases this covers, in words
    # draft kind ("draft_target", "ngram", "eagle3", "suffix", ...) -> decoding_type value; a kind missing here is a
    # decoding type this release does not have (refused, naming the releases that have it)
    decoding_types: dict
    draft_model_key: str  # speculative_model_dir | speculative_model (the EAGLE-3 head's key too)
    draft_len_schedule: str | None  # None (no such option verified) | "lower" | "upper" bounds
    acceptance_keys: tuple[str, str] | None  # (window key, threshold key)
    acceptance_measure: str | None  # "length" | "rate": what the threshold means in this release
    evidence: str
    eagle3_fields: tuple[str, ...] = ()  # EAGLE-3 fields verified in this release's llm_args.py (beyond max_draft_len)
    eagle3_evidence: str = ""
    # decoding types (keys of decoding_types) whose config takes use_rejection_sampling in this release
    rejection_sampling: tuple[str, ...] = ()
    rejection_sampling_evidence: str = "no use_rejection_sampling in this release's DecodingBaseConfig"
    # where this release's decoding types beyond draft_target, ngram and eagle3 were read
    decoding_evidence: str = ""
    # MTPDecodingConfig: the key the draft length is written under, and the thinking-phase token keys
    mtp_draft_len_key: str = "max_draft_len"
    mtp_thinking_keys: tuple[str, str] = ("begin_thinking_phase_token", "end_thinking_phase_token")


LLMAPI_VERSIONS = {
    "1.1": LlmApiVersion(
        name="1.1",
        releases="1.1.x",
        decoding_types={
            "draft_target": "DraftTarget",
            "ngram": "NGram",
            "eagle3": "Eagle",
            "auto": "AUTO",
            "mtp": "MTP",
        },
        draft_model_key="speculative_model_dir",
        draft_len_schedule=None,
        # 1.1.0's own llm_args.py (release docs, gh-pages 1.1.0/_modules/tensorrt_llm/llmapi/llm_args.html @8660c11):
        # DecodingBaseConfig holds max_draft_len, speculative_model_dir, max_concurrency, load_format only (a
        # StrictBaseModel: other keys are rejected), so 1.1 has neither draft_len_schedule nor an acceptance gate.
        acceptance_keys=None,
        acceptance_measure=None,
        evidence=(
            "1.1.0 llm_args.py: from_dict keyed 'DraftTarget'/'NGram'/'Eagle'; speculative_model_dir; "
            "no draft_len_schedule, no acceptance gate"
        ),
        eagle3_fields=("eagle3_one_model", "eagle3_layers_to_capture"),
        eagle3_evidence=(
            "1.1.0 llm_args.py (release docs, gh-pages @8660c11): EagleDecodingConfig 'Eagle', "
            "eagle3_one_model, eagle3_layers_to_capture, speculative_model_dir"
        ),
        decoding_evidence=(
            "1.1.0 llm_args.py (gh-pages @8660c11) DecodingBaseConfig.from_dict keys: MTP, Medusa, Eagle, "
            "Lookahead, NGram, DraftTarget, UserProvided, AUTO"
        ),
        mtp_draft_len_key="num_nextn_predict_layers",
        mtp_thinking_keys=("BEGIN_THINKING_PHASE_TOKEN", "END_THINKING_PHASE_TOKEN"),
    ),
    "1.2": LlmApiVersion(
        name="1.2",
        releases="1.2.x",
        # DraftTarget and speculative_model_dir are read on both sides of the Literal/rename changes, which the
        # 1.2 branch (cut around Dec 2025) may or may not carry.
        decoding_types={
            "draft_target": "DraftTarget",
            "ngram": "NGram",
            "eagle3": "Eagle",
            "auto": "AUTO",
            "mtp": "MTP",
        },
        draft_model_key="speculative_model_dir",
        draft_len_schedule="lower",
        acceptance_keys=("acceptance_window", "acceptance_length_threshold"),
        acceptance_measure="length",
        evidence="PR #8194 (lower-bound draft_len_schedule) before the branch, PR #10860 and #12905 after it",
        eagle3_fields=("eagle3_one_model", "eagle3_layers_to_capture"),
        eagle3_evidence=(
            "1.2.0 llm_args.py (release docs, gh-pages @7e873e5): from_dict 'Eagle' -> "
            "EagleDecodingConfig, eagle3_one_model, eagle3_layers_to_capture, speculative_model_dir alias"
        ),
        decoding_evidence=(
            "1.2.0 llm_args.py (gh-pages @7e873e5) DecodingBaseConfig.from_dict keys: MTP, Medusa, Eagle, "
            "Lookahead, NGram, DraftTarget, SaveState, UserProvided, AUTO"
        ),
        mtp_draft_len_key="num_nextn_predict_layers",
    ),
    "1.3": LlmApiVersion(
        name="1.3",
        releases="1.3.0rc22 and later 1.3 releases",
        decoding_types={
            "draft_target": "Draft_Target",
            "ngram": "NGram",
            "eagle3": "Eagle3",
            "suffix": "SA",
            "auto": "AUTO",
            "mtp": "MTP",
            "dflash": "DFlash",
        },
        draft_model_key="speculative_model",
        draft_len_schedule="upper",
        acceptance_keys=("acceptance_rate_window_size", "acceptance_rate_threshold"),
        acceptance_measure="rate",
        evidence="decoding_type Literal['Draft_Target']; PR #10099, #10860 and #12905 merged",
        eagle3_fields=("eagle3_layers_to_capture", "sa_config", "use_dynamic_tree"),
        eagle3_evidence=(
            "1.3.0rc27 API page Eagle3DecodingConfig: Literal['Eagle3'], speculative_model, "
            "eagle3_layers_to_capture, sa_config (no eagle3_one_model listed)"
        ),
        rejection_sampling=("eagle3", "draft_target"),
        rejection_sampling_evidence=(
            "1.3.0rc27 API pages: DecodingBaseConfig.use_rejection_sampling; PR #12588 "
            "(EAGLE-3 one-model), PR #15775 (DRAFT_TARGET one-model)"
        ),
        decoding_evidence="1.3.0rc27 API page SADecodingConfig: Literal['SA'], max_matching_ngram_size -1, "
        "enable_global_pool, global_pool_size; 1.3.0rc29 AutoDecodingConfig: Literal['AUTO']; 1.3.0rc27 "
        "DFlashDecodingConfig: Literal['DFlash'] (no PARDDecodingConfig page found for 1.3)",
    ),
}


# 1.4 spells every option as 1.3 does (main after PR #12905); only the evidence differs
LLMAPI_VERSIONS["1.4"] = replace(
    LLMAPI_VERSIONS["1.3"],
    name="1.4",
    decoding_types={**LLMAPI_VERSIONS["1.3"].decoding_types, "pard": "PARD"},
    releases="1.4.x",
    evidence="as 1.3 (main after PR #12905)",
    eagle3_evidence=(
        "1.4.0rc1 API page Eagle3DecodingConfig: Literal['Eagle3'], speculative_model, "
        "eagle3_layers_to_capture, sa_config (no eagle3_one_model listed)"
    ),
    rejection_sampling_evidence=(
        "1.4.0rc1 and 1.4.0rc4 API pages: DecodingBaseConfig.use_rejection_sampling; "
        "PR #12588 (EAGLE-3 one-model), PR #15775 (DRAFT_TARGET one-model)"
    ),
    decoding_evidence="1.4.0rc4 API page SADecodingConfig: Literal['SA'], max_matching_ngram_size -1, "
    "enable_global_pool, global_pool_size; PARDDecodingConfig (1.4.0rc1, rc4 pages): Literal['PARD']; "
    "AutoDecodingConfig Literal['AUTO'] and DFlashDecodingConfig Literal['DFlash'] on main (llm_args.py@0004396)",
)

# The first release candidate of a line whose option names LLMAPI_VERSIONS describes (earlier ones are refused here
# and by the image's version gate, packaging.dockerfile).
LLMAPI_MIN_RC = {"1.3": 22}


def llmapi_version(version: str) -> LlmApiVersion:
    """The LlmApiVersion for a recipe's `trtllm_version` ("1.2", "1.2.1", "1.3.0rc24", "1.4.0rc1", ...)."""
    text = str(version).strip()
    m = re.fullmatch(r"(\d+)\.(\d+)(?:\.(\d+))?(?:rc(\d+))?(?:\.post\d+)?", text)
    supported = ", ".join(f"{v.name} ({v.releases})" for v in LLMAPI_VERSIONS.values())
    if m is None:
        raise ConfigError(
            f"key 'trtllm_version' is {version!r}, not a TensorRT-LLM version",
            f"write it as on PyPI, e.g. 1.2.1; supported: {supported}",
        )
    line = f"{m.group(1)}.{m.group(2)}"
    rc = m.group(4)
    if line in LLMAPI_MIN_RC and rc is not None and int(rc) < LLMAPI_MIN_RC[line]:
        raise ConfigError(
            f"trtllm_version {text}: the 1.3.0 release candidates before rc22 straddle TensorRT-LLM PR #10860 "
            "(draft_len_schedule keys became upper bounds) and PR #12905 (acceptance gate renamed and redefined); "
            "specdeploy cannot tell which option names this one takes",
            "use a 1.2.x release (trtllm_version: 1.2) or 1.3.0rc22 or later (trtllm_version: 1.3)",
        )
    if line not in LLMAPI_VERSIONS:
        hint = (
            "TensorRT-LLM 1.0 and older: use backend trtllm-engine"
            if (int(m.group(1)), int(m.group(2))) < (1, 1)
            else "a newer release may rename options again; add it to trtllm.LLMAPI_VERSIONS after checking llm_args.py"
        )
        raise ConfigError(f"trtllm_version {text} has no verified LLM-API option names (supported: {supported})", hint)
    return LLMAPI_VERSIONS[line]
