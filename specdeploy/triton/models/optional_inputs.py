"""NVIDIA's optional inputs on the CPU models: each one honoured, or refused unless neutral.

The table of inputs the CPU models cannot honour (`NEUTRAL`, with the neutral value each is accepted at) and
`refuse_unsupported`; the inputs they do honour beyond sampling: the penalties and min_tokens, the embedding
bias built from words, and `request_kwargs`, which refuses a non-neutral one the executor has no field for.
"""

from __future__ import annotations

import numpy as np

from specdeploy.triton.models.request_inputs import RequestError, decode_utf8, scalar

# ---------------------------------------------------------------- NVIDIA's optional inputs: honoured or refused
# Inputs of NVIDIA's layout the CPU models cannot honour. Each is accepted when absent or at its
# neutral value (the predicate) and refused otherwise with an error naming it; the README table
# "tensor -> honoured or refused" lists the same. Inputs that only matter in beam search (beam
# width 1 here, as TensorRT-LLM ignores them there) and KV-retention hints are accepted at any value.


def _empty_or_zero(a: np.ndarray) -> bool:
    if a.dtype == object:
        return all(not bytes(v if not isinstance(v, str) else v.encode()) for v in a.reshape(-1))
    return a.size == 0 or not np.any(a)


def _value_is(neutral):
    return lambda a: a.size == 0 or all(v == neutral for v in a.reshape(-1).tolist())


def _at_most_one_token(a: np.ndarray) -> bool:
    return a.size <= 1 or (a.ndim >= 2 and a.shape[-1] <= 1)


NEUTRAL = {
    # engine-model names
    "encoder_input_features": _empty_or_zero,
    "encoder_output_lengths": _empty_or_zero,
    "decoder_input_ids": _at_most_one_token,  # NVIDIA's preprocessing sends [pad] when there is no decoder_text_input
    "decoder_input_lengths": lambda a: a.size == 0 or all(v <= 1 for v in a.reshape(-1).tolist()),
    "beam_width": _value_is(1),
    "runtime_top_p_decay": _value_is(1.0),
    "prompt_embedding_table": _empty_or_zero,
    "prompt_table_extra_ids": _empty_or_zero,
    "prompt_vocab_size": _empty_or_zero,
    "cross_attention_mask": _empty_or_zero,
    "mrope_rotary_cos_sin": _empty_or_zero,
    "mrope_position_deltas": _empty_or_zero,
    "lora_task_id": _empty_or_zero,
    "lora_weights": _empty_or_zero,
    "lora_config": _empty_or_zero,
    "context_phase_params": _empty_or_zero,
    "skip_cross_attn_blocks": _empty_or_zero,
    "guided_decoding_guide_type": _empty_or_zero,
    "guided_decoding_guide": _empty_or_zero,
    "lookahead_window_size": _empty_or_zero,
    "lookahead_ngram_size": _empty_or_zero,
    "lookahead_verification_set_size": _empty_or_zero,
    # text-model names (ensemble / BLS / preprocessing)
    "decoder_text_input": _empty_or_zero,
    "prompt_table_extra_id": _empty_or_zero,
    "image_input": _empty_or_zero,
    "image_bytes_input": _empty_or_zero,
    "image_url_input": _empty_or_zero,
    "video_bytes_input": _empty_or_zero,
    "DECODER_QUERY": _empty_or_zero,
    "IMAGE_BYTES": _empty_or_zero,
    "IMAGE_URL": _empty_or_zero,
    "VIDEO_BYTES": _empty_or_zero,
    "PROMPT_TABLE_EXTRA_ID": _empty_or_zero,
}
NEUTRAL_TEXT = {
    "beam_width": "1",
    "runtime_top_p_decay": "1.0",
    "decoder_input_ids": "at most one token",
    "decoder_input_lengths": "0 or 1",
}
# Accepted at any value: no effect with beam width 1 (as in TensorRT-LLM) or a cache hint.
IGNORED = (
    "len_penalty",
    "length_penalty",
    "early_stopping",
    "beam_search_diversity_rate",
    "runtime_top_p_min",
    "runtime_top_p_reset_ids",
    "retention_token_range_starts",
    "retention_token_range_ends",
    "retention_token_range_priorities",
    "retention_token_range_durations_ms",
    "retention_decode_priority",
    "retention_decode_duration_ms",
)


def refuse_unsupported(get, names) -> None:
    """RequestError naming the first input of `names` set to something other than its neutral value."""
    for name in names:
        array = get(name)
        if array is None:
            continue
        if not NEUTRAL[name](np.asarray(array)):
            neutral = NEUTRAL_TEXT.get(name, "empty, 0 or false")
            raise RequestError(
                f"input '{name}' is not supported by the cpu backend (only its neutral value: {neutral}); "
                "leave it unset for this deployment"
            )


def embedding_bias_from_words(tokenizer, words, weights, vocab_size: int) -> np.ndarray | None:
    """NVIDIA's preprocessing rule (tensorrtllm_backend c2e65b8, preprocessing/1/model.py:686-715): no bias unless both
    embedding_bias_words and embedding_bias_weights are sent; one weight per word, the lists as sent (a batch pads the
    shorter one with "" and 0.0); every token of each word gets its weight added ([vocab] fp32); a word that encodes to
    nothing ("") adds nothing. `words`, `weights`: one batch item's tensors, or None."""
    if words is None or weights is None:
        return None
    words = [decode_utf8(w, "embedding_bias_words") for w in np.asarray(words).reshape(-1)]
    if not any(words):  # only empty words (an input's neutral value): no bias, whatever the weights' shape
        return None
    weights = [float(w) for w in np.asarray(weights).reshape(-1).tolist()]
    if len(words) != len(weights):
        raise RequestError(
            f"embedding_bias_words has {len(words)} words but embedding_bias_weights {len(weights)} weights; send one"
            " weight per word"
        )
    bias = np.zeros(vocab_size, dtype=np.float32)
    for word, weight in zip(words, weights):
        for token in tokenizer(word, add_special_tokens=False).input_ids:
            if 0 <= token < vocab_size:
                bias[token] += weight
    return bias


def penalty_fields(get) -> dict:
    """The sampling penalties and min_tokens of a request, TensorRT-LLM's defaults when absent."""
    return {
        "repetition_penalty": scalar(get("repetition_penalty"), "repetition_penalty", float, 1.0),
        "presence_penalty": scalar(get("presence_penalty"), "presence_penalty", float, 0.0),
        "frequency_penalty": scalar(get("frequency_penalty"), "frequency_penalty", float, 0.0),
        "min_tokens": scalar(get("min_tokens"), "min_tokens", int, 0),
    }


PENALTY_NEUTRAL = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
    "embedding_bias": None,
}


def request_kwargs(request_type, values: dict) -> dict:
    """`values` for the engine's EngineRequest; RequestError naming a non-neutral one it lacks a field for."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(request_type)}
    out = {}
    for key, value in values.items():
        if key in known:
            out[key] = value
        elif key in PENALTY_NEUTRAL and not _is_neutral_value(value, PENALTY_NEUTRAL[key]):
            raise RequestError(f"input '{key}' is not supported by this engine's executor; leave it unset")
    return out


def _is_neutral_value(value, neutral) -> bool:
    if neutral is None:
        return value is None
    return value == neutral
