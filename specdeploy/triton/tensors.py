"""The model names and tensors of NVIDIA's `inflight_batcher_llm` layout (tensorrtllm_backend's
all_models/inflight_batcher_llm), written once, and specdeploy's own additions to it (EAGLE-3's per-round counts, the
BLS's `speculative_k_history`)."""

from __future__ import annotations

from specdeploy.triton.model_config import Tensor

# Model names of the layout (clients import them from specdeploy.client.protocol too).
PREPROCESSING, POSTPROCESSING, ENSEMBLE = "preprocessing", "postprocessing", "ensemble"
TARGET_MODEL, DRAFT_MODEL, BLS = "tensorrt_llm", "tensorrt_llm_draft", "tensorrt_llm_bls"
ENGINE_MODEL_NAMES = {"target": TARGET_MODEL, "draft": DRAFT_MODEL}


# Every tensor of the layout, written once, exactly as NVIDIA declares it (name, data type, dims,
# optional) in tensorrtllm_backend c2e65b8 all_models/inflight_batcher_llm/*/config.pbtxt
# (tests/test_triton_repo.py compares with tests/data/trtllm_backend_c2e65b8_tensors.json). Which of
# them the CPU models honour and which they refuse unless neutral: specdeploy/triton/models/optional_inputs.py
# (HONOURED, NEUTRAL) and the README table "tensor -> honoured or refused".
REQ, OPT = False, True
RAGGED = {
    "input_ids",
    "draft_input_ids",
    "draft_logits",
    "stop_words_list",
    "bad_words_list",
    "lora_weights",
    "lora_config",
    "guided_decoding_guide_type",
    "guided_decoding_guide",
    "embedding_bias",
}


def _table(rows) -> tuple[Tensor, ...]:
    return tuple(Tensor(name, dtype, tuple(dims), optional, name in RAGGED) for name, dtype, dims, optional in rows)


# What every generation result may carry (tensorrt_llm, tensorrt_llm_bls and ensemble outputs).
RESULT_OUTPUTS = _table(
    [
        ("cum_log_probs", "FP32", [-1], REQ),
        ("output_log_probs", "FP32", [-1, -1], REQ),
        ("context_logits", "FP32", [-1, -1], REQ),
        ("generation_logits", "FP32", [-1, -1, -1], REQ),
        ("batch_index", "INT32", [1], REQ),
        ("sequence_index", "INT32", [1], REQ),
        ("kv_cache_alloc_new_blocks", "INT32", [1], REQ),
        ("kv_cache_reused_blocks", "INT32", [1], REQ),
        ("kv_cache_alloc_total_blocks", "INT32", [1], REQ),
        ("arrival_time_ns", "INT64", [1], REQ),
        ("first_scheduled_time_ns", "INT64", [1], REQ),
        ("first_token_time_ns", "INT64", [1], REQ),
        ("last_token_time_ns", "INT64", [1], REQ),
        ("acceptance_rate", "FP32", [1], REQ),
        ("total_accepted_draft_tokens", "INT32", [1], REQ),
        ("total_draft_tokens", "INT32", [1], REQ),
    ]
)
# ensemble and BLS share these client-facing inputs
TEXT_INPUTS = _table(
    [
        ("text_input", "STRING", [1], REQ),
        ("max_tokens", "INT32", [1], REQ),
        ("decoder_text_input", "STRING", [1], OPT),
        ("num_return_sequences", "INT32", [1], OPT),
        ("bad_words", "STRING", [-1], OPT),
        ("stop_words", "STRING", [-1], OPT),
        ("exclude_input_in_output", "BOOL", [1], OPT),
        ("end_id", "INT32", [1], OPT),
        ("pad_id", "INT32", [1], OPT),
        ("top_k", "INT32", [1], OPT),
        ("top_p", "FP32", [1], OPT),
        ("temperature", "FP32", [1], OPT),
        ("length_penalty", "FP32", [1], OPT),
        ("repetition_penalty", "FP32", [1], OPT),
        ("min_tokens", "INT32", [1], OPT),
        ("presence_penalty", "FP32", [1], OPT),
        ("frequency_penalty", "FP32", [1], OPT),
        ("seed", "UINT64", [1], OPT),
        ("return_log_probs", "BOOL", [1], OPT),
        ("return_context_logits", "BOOL", [1], OPT),
        ("return_generation_logits", "BOOL", [1], OPT),
        ("return_perf_metrics", "BOOL", [1], OPT),
        ("beam_width", "INT32", [1], OPT),
        ("stream", "BOOL", [1], OPT),
        ("prompt_embedding_table", "FP16", [-1, -1], OPT),
        ("prompt_table_extra_id", "UINT64", [1], OPT),
        ("prompt_vocab_size", "INT32", [1], OPT),
        ("embedding_bias_words", "STRING", [-1], OPT),
        ("embedding_bias_weights", "FP32", [-1], OPT),
        ("lora_task_id", "UINT64", [1], OPT),
        ("lora_weights", "FP16", [-1, -1], OPT),
        ("lora_config", "INT32", [-1, 3], OPT),
        ("guided_decoding_guide_type", "STRING", [1], OPT),
        ("guided_decoding_guide", "STRING", [1], OPT),
    ]
)
BLS_ONLY_INPUTS = _table(
    [
        ("image_input", "FP16", [-1, 3, -1, -1], OPT),
        ("image_bytes_input", "UINT8", [-1, -1, -1, -1], OPT),
        ("image_url_input", "STRING", [1], OPT),
        ("video_bytes_input", "UINT8", [-1, -1, -1, -1], OPT),
        ("num_draft_tokens", "INT32", [1], OPT),
        ("use_draft_logits", "BOOL", [1], OPT),
    ]
)
TEXT_OUTPUTS = _table([("text_output", "STRING", [-1], REQ)])
# draft.kind eagle3 (cpu): specdeploy's own tensorrt_llm tensors, beyond NVIDIA's layout. TensorRT-LLM's one-model
# EAGLE-3 drafts max_draft_len tokens per round with no per-request input; here the BLS passes its k (0 or absent:
# plain decoding, what the control `ensemble` gets), and reads back the per-round counts for its metrics.
EAGLE3_LLM_INPUTS = _table([("num_draft_tokens", "INT32", [1], OPT)])
EAGLE3_LLM_OUTPUTS = _table(
    [
        ("draft_tokens_per_round", "INT32", [-1], REQ),
        ("accepted_draft_tokens_per_round", "INT32", [-1], REQ),
        ("lookup_draft_rounds", "INT32", [-1], REQ),
        # seconds, for the round profile: the head's work before each verification pass (beside draft_tokens_per_round),
        # and every engine pass of the request, the prefill first
        ("draft_seconds_per_round", "FP32", [-1], REQ),
        ("forward_seconds_per_pass", "FP32", [-1], REQ),
    ]
)

PREPROCESSING_INPUTS = _table(
    [
        ("QUERY", "STRING", [1], REQ),
        ("DECODER_QUERY", "STRING", [1], OPT),
        ("IMAGE_BYTES", "UINT8", [-1, -1, -1, -1], OPT),
        ("IMAGE_URL", "STRING", [1], OPT),
        ("VIDEO_BYTES", "UINT8", [-1, -1, -1, -1], OPT),
        ("REQUEST_OUTPUT_LEN", "INT32", [1], REQ),
        ("BAD_WORDS_DICT", "STRING", [-1], OPT),
        ("STOP_WORDS_DICT", "STRING", [-1], OPT),
        ("EMBEDDING_BIAS_WORDS", "STRING", [-1], OPT),
        ("EMBEDDING_BIAS_WEIGHTS", "FP32", [-1], OPT),
        ("END_ID", "INT32", [1], OPT),
        ("PAD_ID", "INT32", [1], OPT),
        ("PROMPT_TABLE_EXTRA_ID", "UINT64", [1], OPT),
    ]
)
PREPROCESSING_OUTPUTS = _table(
    [
        ("INPUT_ID", "INT32", [-1], REQ),
        ("REQUEST_INPUT_LEN", "INT32", [1], REQ),
        ("DECODER_INPUT_ID", "INT32", [-1], REQ),
        ("REQUEST_DECODER_INPUT_LEN", "INT32", [1], REQ),
        ("BAD_WORDS_IDS", "INT32", [2, -1], REQ),
        ("STOP_WORDS_IDS", "INT32", [2, -1], REQ),
        ("EMBEDDING_BIAS", "FP32", [-1], REQ),
        ("REQUEST_OUTPUT_LEN", "INT32", [-1], REQ),
        ("OUT_END_ID", "INT32", [1], REQ),
        ("OUT_PAD_ID", "INT32", [1], REQ),
        ("OUT_PROMPT_TABLE_EXTRA_IDS", "UINT64", [-1], REQ),
        # multimodal outputs: declared for NVIDIA's clients, never produced (image/video inputs are refused)
        ("PIXEL_VALUES", "FP16", [-1, -1, -1, -1], REQ),
        ("ASPECT_RATIO_IDS", "INT64", [-1], REQ),
        ("ASPECT_RATIO_MASK", "INT64", [-1, -1], REQ),
        ("CROSS_ATTENTION_MASK", "INT64", [-1, -1, -1], REQ),
        ("IMAGE_SIZES", "INT64", [2], REQ),
        ("IS_VIDEO_INPUT", "BOOL", [1], REQ),
        ("ATTENTION_MASK", "INT64", [-1], REQ),
        ("IMAGE_GRID_THW", "INT64", [3], REQ),
        ("VISION_INPUT_ID", "INT32", [-1], REQ),
    ]
)
LLM_INPUTS = _table(
    [
        ("input_ids", "INT32", [-1], OPT),
        ("encoder_input_features", "BOOL", [-1, -1], OPT),
        ("encoder_output_lengths", "INT32", [1], OPT),
        ("input_lengths", "INT32", [1], REQ),
        ("request_output_len", "INT32", [1], REQ),
        ("num_return_sequences", "INT32", [1], OPT),
        ("draft_input_ids", "INT32", [-1], OPT),
        ("decoder_input_ids", "INT32", [-1], OPT),
        ("decoder_input_lengths", "INT32", [1], OPT),
        ("draft_logits", "FP32", [-1, -1], OPT),
        ("draft_acceptance_threshold", "FP32", [1], OPT),
        ("end_id", "INT32", [1], OPT),
        ("pad_id", "INT32", [1], OPT),
        ("stop_words_list", "INT32", [2, -1], OPT),
        ("bad_words_list", "INT32", [2, -1], OPT),
        ("embedding_bias", "FP32", [-1], OPT),
        ("beam_width", "INT32", [1], OPT),
        ("temperature", "FP32", [1], OPT),
        ("runtime_top_k", "INT32", [1], OPT),
        ("runtime_top_p", "FP32", [1], OPT),
        ("runtime_top_p_min", "FP32", [1], OPT),
        ("runtime_top_p_decay", "FP32", [1], OPT),
        ("runtime_top_p_reset_ids", "INT32", [1], OPT),
        ("len_penalty", "FP32", [1], OPT),
        ("early_stopping", "BOOL", [1], OPT),
        ("repetition_penalty", "FP32", [1], OPT),
        ("min_tokens", "INT32", [1], OPT),
        ("beam_search_diversity_rate", "FP32", [1], OPT),
        ("presence_penalty", "FP32", [1], OPT),
        ("frequency_penalty", "FP32", [1], OPT),
        ("seed", "UINT64", [1], OPT),
        ("return_log_probs", "BOOL", [1], OPT),
        ("return_context_logits", "BOOL", [1], OPT),
        ("return_generation_logits", "BOOL", [1], OPT),
        ("return_perf_metrics", "BOOL", [1], OPT),
        ("exclude_input_in_output", "BOOL", [1], OPT),
        ("stop", "BOOL", [1], OPT),
        ("streaming", "BOOL", [1], OPT),
        ("prompt_embedding_table", "FP16", [-1, -1], OPT),
        ("prompt_table_extra_ids", "UINT64", [-1], OPT),
        ("prompt_vocab_size", "INT32", [1], OPT),
        ("cross_attention_mask", "BOOL", [-1, -1], OPT),
        ("mrope_rotary_cos_sin", "FP32", [-1], OPT),
        ("mrope_position_deltas", "INT64", [1], OPT),
        ("lora_task_id", "UINT64", [1], OPT),
        ("lora_weights", "FP16", [-1, -1], OPT),
        ("lora_config", "INT32", [-1, 3], OPT),
        ("context_phase_params", "UINT8", [-1], OPT),
        ("skip_cross_attn_blocks", "BOOL", [1], OPT),
        ("retention_token_range_starts", "INT32", [-1], OPT),
        ("retention_token_range_ends", "INT32", [-1], OPT),
        ("retention_token_range_priorities", "INT32", [-1], OPT),
        ("retention_token_range_durations_ms", "INT32", [-1], OPT),
        ("retention_decode_priority", "INT32", [1], OPT),
        ("retention_decode_duration_ms", "INT32", [1], OPT),
        ("guided_decoding_guide_type", "STRING", [1], OPT),
        ("guided_decoding_guide", "STRING", [1], OPT),
        ("lookahead_window_size", "INT32", [1], OPT),
        ("lookahead_ngram_size", "INT32", [1], OPT),
        ("lookahead_verification_set_size", "INT32", [1], OPT),
    ]
)
LLM_OUTPUTS = (
    _table(
        [
            ("output_ids", "INT32", [-1, -1], REQ),
            ("sequence_length", "INT32", [-1], REQ),
            ("context_phase_params", "UINT8", [-1], REQ),
        ]
    )
    + RESULT_OUTPUTS
)
POSTPROCESSING_INPUTS = _table(
    [
        ("TOKENS_BATCH", "INT32", [-1, -1], REQ),
        ("SEQUENCE_LENGTH", "INT32", [-1], REQ),
    ]
)
POSTPROCESSING_OUTPUTS = _table([("OUTPUT", "STRING", [-1], REQ)])

# specdeploy's own output of `ensemble` and `tensorrt_llm_bls`, beyond NVIDIA's layout (whose text-level models return
# text only): `sequence_length`, the output tokens of a response, as tensorrt_llm counts them (the end id never
# counted, tensorrt_llm.py _drop_end), so that a client knows how many tokens it got and whether max_tokens ended
# the answer without tokenizing the text again (which can merge tokens the model wrote apart). Summed over a
# request's responses: the ensemble passes each tensorrt_llm response's count; the BLS sends the whole answer's with
# its last response (its streamed text chunks carry none). Sent only when a client asks for it by name.
OUTPUT_COUNT = _table([("sequence_length", "INT32", [-1], REQ)])
# specdeploy's own BLS outputs, beyond NVIDIA's layout (sent only when a client asks for them by name):
# speculative_k_history, the draft length of each round of the request (0: a plain step or run); beside it the
# seconds of each round's draft work and target call (fused EAGLE-3: the head's work and the engine pass).
BLS_EXTRA_OUTPUTS = _table(
    [
        ("speculative_k_history", "INT32", [-1], REQ),
        ("speculative_draft_seconds", "FP32", [-1], REQ),
        ("speculative_target_seconds", "FP32", [-1], REQ),
    ]
)
