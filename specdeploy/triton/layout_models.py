"""The models of the inflight_batcher_llm layout as `ModelSpec`s: preprocessing, postprocessing, ensemble and
tensorrt_llm_bls (the same on every backend), and the cpu backend's engine models (`cpu_engine_models`; the GPU ones
are in gpu_models.py). `model_specs` puts them in load order.
"""

from __future__ import annotations

from specdeploy.speculation.policy import PolicySettings
from specdeploy.triton.model_config import EnsembleStep, ModelSpec
from specdeploy.triton.repo_inputs import RepoInputs
from specdeploy.triton.tensors import (
    BLS,
    BLS_EXTRA_OUTPUTS,
    BLS_ONLY_INPUTS,
    DRAFT_MODEL,
    EAGLE3_LLM_INPUTS,
    EAGLE3_LLM_OUTPUTS,
    ENGINE_MODEL_NAMES,
    ENSEMBLE,
    LLM_INPUTS,
    LLM_OUTPUTS,
    OUTPUT_COUNT,
    POSTPROCESSING,
    POSTPROCESSING_INPUTS,
    POSTPROCESSING_OUTPUTS,
    PREPROCESSING,
    PREPROCESSING_INPUTS,
    PREPROCESSING_OUTPUTS,
    RESULT_OUTPUTS,
    TARGET_MODEL,
    TEXT_INPUTS,
    TEXT_OUTPUTS,
)

TOKENIZER_SUBDIR = "tokenizer"
# draft.kind eagle3: the head is copied into the tensorrt_llm model's folder (beside its version 1/), so the
# repository carries what it serves; its hash is in the repository's fingerprint (a changed head: out of date)
EAGLE3_HEAD_SUBDIR = "eagle3_head"


def _tokenizer_params(model: str) -> dict[str, str]:
    # One copy inside preprocessing/ (a top-level folder would be taken for a model), referred to
    # relative to each model's own folder: the repository stays valid wherever it is moved.
    here = TOKENIZER_SUBDIR if model == PREPROCESSING else f"../{PREPROCESSING}/{TOKENIZER_SUBDIR}"
    return {"tokenizer_dir": here}


def preprocessing_spec(inp: RepoInputs) -> ModelSpec:
    r = inp.recipe
    return ModelSpec(
        name=PREPROCESSING,
        max_batch_size=r.engine.max_batch_size,
        inputs=PREPROCESSING_INPUTS,
        outputs=PREPROCESSING_OUTPUTS,
        parameters={
            **_tokenizer_params(PREPROCESSING),
            "add_special_tokens": "true",
            "max_input_len": str(inp.max_input_len),
        },
        instance_count=1,  # tokenizing takes microseconds; each extra instance costs a process and its start-up
        source="preprocessing.py",
    )


def postprocessing_spec(inp: RepoInputs) -> ModelSpec:
    r = inp.recipe
    return ModelSpec(
        name=POSTPROCESSING,
        max_batch_size=r.engine.max_batch_size,
        inputs=POSTPROCESSING_INPUTS,
        outputs=POSTPROCESSING_OUTPUTS,
        parameters={**_tokenizer_params(POSTPROCESSING), "skip_special_tokens": "true"},
        instance_count=1,
        source="postprocessing.py",
    )


# The ensemble's wiring, as NVIDIA's ensemble/config.pbtxt maps it: (step input, ensemble tensor).
ENSEMBLE_PRE_INPUTS = (
    ("QUERY", "text_input"),
    ("DECODER_QUERY", "decoder_text_input"),
    ("REQUEST_OUTPUT_LEN", "max_tokens"),
    ("BAD_WORDS_DICT", "bad_words"),
    ("STOP_WORDS_DICT", "stop_words"),
    ("EMBEDDING_BIAS_WORDS", "embedding_bias_words"),
    ("EMBEDDING_BIAS_WEIGHTS", "embedding_bias_weights"),
    ("END_ID", "end_id"),
    ("PAD_ID", "pad_id"),
    ("PROMPT_TABLE_EXTRA_ID", "prompt_table_extra_id"),
)
ENSEMBLE_PRE_OUTPUTS = (
    ("REQUEST_INPUT_LEN", "_REQUEST_INPUT_LEN"),
    ("INPUT_ID", "_INPUT_ID"),
    ("REQUEST_DECODER_INPUT_LEN", "_REQUEST_DECODER_INPUT_LEN"),
    ("DECODER_INPUT_ID", "_DECODER_INPUT_ID"),
    ("REQUEST_OUTPUT_LEN", "_REQUEST_OUTPUT_LEN"),
    ("STOP_WORDS_IDS", "_STOP_WORDS_IDS"),
    ("BAD_WORDS_IDS", "_BAD_WORDS_IDS"),
    ("EMBEDDING_BIAS", "_EMBEDDING_BIAS"),
    ("OUT_END_ID", "_PREPROCESSOR_END_ID"),
    ("OUT_PAD_ID", "_PREPROCESSOR_PAD_ID"),
    ("OUT_PROMPT_TABLE_EXTRA_IDS", "_OUT_PROMPT_TABLE_EXTRA_IDS"),
)
ENSEMBLE_LLM_INPUTS = (
    ("input_ids", "_INPUT_ID"),
    ("decoder_input_ids", "_DECODER_INPUT_ID"),
    ("input_lengths", "_REQUEST_INPUT_LEN"),
    ("decoder_input_lengths", "_REQUEST_DECODER_INPUT_LEN"),
    ("exclude_input_in_output", "exclude_input_in_output"),
    ("request_output_len", "_REQUEST_OUTPUT_LEN"),
    ("end_id", "_PREPROCESSOR_END_ID"),
    ("pad_id", "_PREPROCESSOR_PAD_ID"),
    ("embedding_bias", "_EMBEDDING_BIAS"),
    ("runtime_top_k", "top_k"),
    ("runtime_top_p", "top_p"),
    ("temperature", "temperature"),
    ("len_penalty", "length_penalty"),
    ("repetition_penalty", "repetition_penalty"),
    ("min_tokens", "min_tokens"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
    ("seed", "seed"),
    ("return_log_probs", "return_log_probs"),
    ("return_context_logits", "return_context_logits"),
    ("return_generation_logits", "return_generation_logits"),
    ("return_perf_metrics", "return_perf_metrics"),
    ("num_return_sequences", "num_return_sequences"),
    ("beam_width", "beam_width"),
    ("streaming", "stream"),
    ("prompt_embedding_table", "prompt_embedding_table"),
    ("prompt_vocab_size", "prompt_vocab_size"),
    ("stop_words_list", "_STOP_WORDS_IDS"),
    ("bad_words_list", "_BAD_WORDS_IDS"),
    ("prompt_table_extra_ids", "_OUT_PROMPT_TABLE_EXTRA_IDS"),
    ("lora_task_id", "lora_task_id"),
    ("lora_weights", "lora_weights"),
    ("lora_config", "lora_config"),
    ("guided_decoding_guide_type", "guided_decoding_guide_type"),
    ("guided_decoding_guide", "guided_decoding_guide"),
)


def ensemble_spec(inp: RepoInputs) -> ModelSpec:
    pre = EnsembleStep(PREPROCESSING, input_map=ENSEMBLE_PRE_INPUTS, output_map=ENSEMBLE_PRE_OUTPUTS)
    llm = EnsembleStep(
        TARGET_MODEL,
        input_map=ENSEMBLE_LLM_INPUTS,
        # sequence_length under its own name: the postprocessing's input and the ensemble's output (OUTPUT_COUNT)
        output_map=(("output_ids", "_TOKENS_BATCH"), ("sequence_length", "sequence_length"))
        + tuple((t.name, t.name) for t in RESULT_OUTPUTS),
    )
    post = EnsembleStep(
        POSTPROCESSING,
        input_map=(("TOKENS_BATCH", "_TOKENS_BATCH"), ("SEQUENCE_LENGTH", "sequence_length")),
        output_map=(("OUTPUT", "text_output"),),
    )
    return ModelSpec(
        name=ENSEMBLE,
        platform="ensemble",
        backend=None,
        max_batch_size=inp.recipe.engine.max_batch_size,
        inputs=TEXT_INPUTS,
        outputs=TEXT_OUTPUTS + RESULT_OUTPUTS + OUTPUT_COUNT,
        steps=(pre, llm, post),
    )


def bls_spec(inp: RepoInputs) -> ModelSpec:
    r = inp.recipe
    from specdeploy.speculation import ngram

    return ModelSpec(
        name=BLS,
        max_batch_size=r.engine.max_batch_size,
        inputs=TEXT_INPUTS + BLS_ONLY_INPUTS,
        outputs=TEXT_OUTPUTS + RESULT_OUTPUTS + OUTPUT_COUNT + BLS_EXTRA_OUTPUTS,
        parameters={
            # draft.kind ngram: the BLS proposes by prompt lookup itself (no call to tensorrt_llm_draft)
            **(
                {"draft_kind": "ngram", **ngram.to_parameters(ngram.settings_from_recipe(r))}
                if r.draft.is_ngram
                else {}
            ),
            # draft.kind suffix: likewise, by the suffix automaton over the request's own text
            **(ngram.suffix_settings_from_recipe(r).to_parameters() if r.draft.is_suffix else {}),
            # the draft's own cap (draft.max_draft_len): "max_draft_len" below is the target's, for the BLS's k
            **({"draft_max_draft_len": str(_lookup_draft_len(r))} if r.draft.is_ngram or r.draft.is_suffix else {}),
            # draft.kind eagle3: tensorrt_llm drafts with its head inside; the BLS passes k, one call per request
            **({"draft_kind": "eagle3"} if r.draft.is_eagle3 else {}),
            **_tokenizer_params(BLS),
            "add_special_tokens": "true",
            "skip_special_tokens": "true",
            "tensorrt_llm_model_name": TARGET_MODEL,
            "tensorrt_llm_draft_model_name": DRAFT_MODEL,
            # NVIDIA's BLS with accumulate_tokens true streams the text of every token so far in each response
            # (tensorrtllm_backend c2e65b8, all_models/inflight_batcher_llm/tensorrt_llm_bls/1/model.py:57-60,
            # lib/decode.py:416-447); this BLS streams each response's new text only, which is "false" there
            "accumulate_tokens": "false",
            "num_draft_tokens": str(r.speculative.num_draft_tokens),
            "max_draft_len": str(inp.target_max_draft_len),
            "use_draft_logits": str(r.speculative.use_draft_logits).lower(),
            "max_input_len": str(inp.max_input_len),
            "max_seq_len": str(inp.max_seq_len),
            "request_timeout_s": str(r.triton.request_timeout_s),
            # each draft/target call's Triton timeout: the BLS checks its own cancellation between them
            "cancel_check_interval_s": "0.5",
            # speculation policy (specdeploy.speculation.policy): its state lives in the BLS instance
            **PolicySettings.from_recipe(r.speculative).to_parameters(),
            # the canary's control arm (specdeploy.core.metrics.recorder.BlsOps): this share of requests takes the plain
            # path
            "canary_control_percent": str(r.canary.control_percent),
        },
        instance_count=r.bls_instance_count,
        decoupled=r.triton.decoupled,
        source="tensorrt_llm_bls.py",
    )


def _lookup_draft_len(r) -> int:
    """The ngram / suffix draft's own max_draft_len (draft.max_draft_len, else speculative.num_draft_tokens)."""
    from specdeploy.speculation import ngram

    settings = ngram.suffix_settings_from_recipe(r) if r.draft.is_suffix else ngram.settings_from_recipe(r)
    return settings.max_draft_len


def engine_model_parameters(inp: RepoInputs, role: str) -> dict[str, str]:
    """The parameters NVIDIA's tensorrt_llm model takes that every backend sets the same way.

    `exclude_input_in_output` is false so one client request means one thing on every backend (the
    BLS sets it per request anyway); KV block reuse is what the draft/target flow relies on.
    """
    return {
        "gpt_model_path": str(inp.engine_dirs[role]),
        "gpt_model_type": "inflight_fused_batching",
        "max_beam_width": "1",
        "enable_kv_cache_reuse": "true",
        "exclude_input_in_output": "false",
    }


def eagle3_head_parameters(r) -> dict[str, str]:
    """draft.kind eagle3 on cpu: how the CPU engine runs the head, as model parameters of either layout (specdeploy's
    own; TensorRT-LLM has none of them): its cut-off (speculative.draft_p_min), its linears (draft.head_weights), the
    draft tokens it scores (draft.serve_vocab_size, 0: all) and the suffix lookup (draft.sa_config, 0: off)."""
    return {
        "eagle3_draft_p_min": str(r.speculative.draft_p_min),
        "eagle3_head_weights": r.draft.cpu_head_weights,
        "eagle3_serve_vocab_size": str(r.draft.serve_vocab_size),
        "eagle3_sa_threshold": str(r.draft.lookup_threshold),
    }


def cpu_engine_models(inp: RepoInputs) -> list[ModelSpec]:
    """tensorrt_llm and tensorrt_llm_draft as python models over specdeploy's CPU engine."""
    r = inp.recipe
    specs = []
    for role, name in ENGINE_MODEL_NAMES.items():
        if role == "draft" and (r.draft.is_ngram or r.draft.is_suffix):
            specs.append(_ngram_draft_model(inp))
            continue
        if role == "draft" and r.draft.is_eagle3:  # the head runs inside tensorrt_llm: no draft model
            continue
        max_draft_len = inp.target_max_draft_len if role == "target" else 0
        eagle3 = role == "target" and r.draft.is_eagle3
        specs.append(
            ModelSpec(
                name=name,
                max_batch_size=r.engine.max_batch_size,
                inputs=LLM_INPUTS + (EAGLE3_LLM_INPUTS if eagle3 else ()),
                outputs=LLM_OUTPUTS + (EAGLE3_LLM_OUTPUTS if eagle3 else ()),
                parameters={
                    # relative to the model's folder, like tokenizer_dir (common.resolve_dir)
                    **(
                        {
                            "eagle3_head": EAGLE3_HEAD_SUBDIR,
                            "eagle3_policy": r.speculative.policy,
                            **eagle3_head_parameters(r),
                        }
                        if eagle3
                        else {}
                    ),
                    **engine_model_parameters(inp, role),
                    "kv_cache_free_gpu_mem_fraction": str(r.engine.kv_cache_free_gpu_mem_fraction),
                    "executor_factory": inp.executor_factory,
                    "max_input_len": str(int(inp.engine_setting(role, "max_input_len", r.engine.max_input_len))),
                    "max_seq_len": str(int(inp.engine_setting(role, "max_seq_len", r.engine.max_seq_len))),
                    "max_draft_len": str(max_draft_len),
                    "request_timeout_s": str(r.triton.request_timeout_s),
                    "inflight_batching": str(r.triton.inflight_batching).lower(),
                    # decoupled: streamed tokens are held until they complete text (whole characters per response)
                    **_tokenizer_params(name),
                    "skip_special_tokens": "true",
                },
                instance_count=r.triton.instance_count,
                decoupled=r.triton.decoupled,
                dynamic_batching_delay_us=r.triton.max_queue_delay_microseconds,
                source="tensorrt_llm.py",
            )
        )
    return specs


def _ngram_draft_model(inp: RepoInputs) -> ModelSpec:
    """tensorrt_llm_draft for draft.kind ngram or suffix: a python model with the tensorrt_llm interface that
    proposes from input_ids by prompt lookup (specdeploy.speculation.ngram); no engine, no weights."""
    from specdeploy.speculation import ngram

    r = inp.recipe
    settings = (
        ngram.suffix_settings_from_recipe(r).to_parameters()
        if r.draft.is_suffix
        else ngram.to_parameters(ngram.settings_from_recipe(r))
    )
    return ModelSpec(
        name=DRAFT_MODEL,
        max_batch_size=r.engine.max_batch_size,
        inputs=LLM_INPUTS,
        outputs=LLM_OUTPUTS,
        parameters={
            **settings,
            "max_input_len": str(inp.max_seq_len),  # the BLS sends prompt + output so far
            "max_seq_len": str(inp.max_seq_len),
        },
        instance_count=r.triton.instance_count,
        decoupled=r.triton.decoupled,
        source="ngram_draft.py",
    )


def model_specs(inp: RepoInputs, engine_models, finish_models=None) -> list[ModelSpec]:
    """All models of the repository, in load order: the shared models around the backend's engine models
    (`engine_models(inp)`: `tensorrt_llm` and `tensorrt_llm_draft`, from `BackendStages.engine_models`), as the
    backend serves them (`finish_models(inp, specs)`: the engine backend renames tensors per release)."""
    specs = [preprocessing_spec(inp), *engine_models(inp), postprocessing_spec(inp), ensemble_spec(inp), bls_spec(inp)]
    return finish_models(inp, specs) if finish_models else specs
