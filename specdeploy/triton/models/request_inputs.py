"""Reading one request's tensors, checked: what the python-backend models ask of every input they read.

`RequestError` (something wrong with one request), the request's inputs by name (`input_reader`), one value per
request (`scalar`), text and word lists, the prompt's tokens and the lengths they must fit, and the sampling fields.
Nothing here imports `triton_python_backend_utils`: tensors come in as numpy arrays.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specdeploy.core.text_rules import TextError, check_count, check_text, decode_text


class RequestError(Exception):
    """Something wrong with one request: answered with a Triton error, the server keeps serving."""


# ---------------------------------------------------------------- reading request tensors


def input_reader(request):
    """name -> the request's input as a numpy array, or None when it does not carry it. Reads the request's inputs
    once: triton_python_backend_utils.get_input_tensor_by_name lists (and wraps) all of them again on every call,
    and a model looks up dozens of optional names per request."""
    tensors = {tensor.name(): tensor for tensor in request.inputs()}

    def get(name: str) -> np.ndarray | None:
        tensor = tensors.get(name)
        return None if tensor is None else tensor.as_numpy()

    return get


def scalar(array: np.ndarray | None, name: str, kind, default=None):
    """One value per request (tensor [1, 1] or [1]); the default when the optional input is absent."""
    if array is None:
        return default
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise RequestError(f"input '{name}' must hold one value per request, got shape {list(np.shape(array))}")
    value = flat[0]
    return kind(value.item() if hasattr(value, "item") else value)


def batch_size(array: np.ndarray | None, name: str) -> int:
    if array is None:  # Triton passed a request without it (bench/fuzz.py: an optional input sent in its place)
        raise RequestError(f"input '{name}' is required")
    if array.ndim == 0:
        raise RequestError(f"input '{name}' has no batch dimension")
    return int(array.shape[0])


def require_single(array: np.ndarray, name: str) -> None:
    if array is None:  # Triton lets a decoupled model's request through without it (bench/fuzz.py found a traceback)
        raise RequestError(f"input '{name}' is required")
    n = batch_size(array, name)
    if n != 1:
        raise RequestError(
            f"input '{name}' has batch size {n}; this model takes one sequence per request (send batch 1)"
        )


def decode_utf8(value, name: str) -> str:
    """One element of a STRING tensor as text, by the boundary's rules (text_rules: UTF-8, no NUL, a size limit)."""
    try:
        return check_text(value, name) if isinstance(value, str) else decode_text(bytes(value), name)
    except TextError as exc:
        raise _text_refusal(exc) from None


def _text_refusal(exc: TextError) -> RequestError:
    return RequestError(f"input '{exc.field}' {exc.detail} (rule {exc.rule})")


def strings(array: np.ndarray | None, name: str) -> list[str]:
    """A STRING tensor of one batch item as a list of non-empty strings ([] when absent)."""
    if array is None:
        return []
    values = np.asarray(array).reshape(-1)
    try:
        check_count(values.size, name)
    except TextError as exc:
        raise _text_refusal(exc) from None
    return [s for s in (decode_utf8(v, name) for v in values) if s]


# ---------------------------------------------------------------- tokens


def encode_prompt(tokenizer, text: str, add_special_tokens: bool, max_input_len: int) -> list[int]:
    """Token ids of a prompt, checked: at least one token, at most max_input_len. An empty text is tokenized as NVIDIA's
    preprocessing does (preprocessing/1/model.py:557-562 at c2e65b8): a tokenizer that adds BOS makes it [BOS], a prompt
    for unconditional generation; one that adds nothing leaves no token, refused."""
    ids = list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
    if not ids:
        raise RequestError("text_input is empty or tokenizes to no tokens; send a non-empty prompt")
    if len(ids) > max_input_len:
        raise RequestError(f"the prompt has {len(ids)} tokens, more than max_input_len ({max_input_len}); shorten it")
    return ids


def encode_words(tokenizer, words: Sequence[str]) -> list[list[int]]:
    return [ids for ids in (list(tokenizer(w, add_special_tokens=False).input_ids) for w in words) if ids]


def to_words_list(words: list[list[int]]) -> np.ndarray:
    """TensorRT-LLM's word-list format [2, L] (int32): flat ids, then end offsets padded with -1."""
    flat = [t for w in words for t in w]
    offsets = np.cumsum([len(w) for w in words]).tolist() if words else []
    length = max(1, len(flat))
    out = np.zeros((2, length), dtype=np.int32)
    out[1, :] = -1
    out[0, : len(flat)] = flat
    out[1, : len(offsets)] = offsets
    return out


def from_words_list(array: np.ndarray | None, name: str) -> list[list[int]]:
    """Inverse of to_words_list for one batch item ([1, 2, L] or [2, L])."""
    if array is None:
        return []
    arr = np.asarray(array)
    if arr.ndim == 3:
        if arr.shape[0] != 1:  # an empty batch indexed [0] was an IndexError (tests/test_properties.py found it)
            raise RequestError(f"input '{name}' has batch size {arr.shape[0]}; send one word list per request")
        arr = arr[0]
    if arr.ndim != 2 or arr.shape[0] != 2:
        raise RequestError(
            f"input '{name}' must have shape [2, L] per request (ids, end offsets), got {list(np.shape(array))}"
        )
    ids, offsets = arr[0].tolist(), [int(o) for o in arr[1].tolist() if o >= 0]
    words, start = [], 0
    for end in offsets:
        if not start <= end <= len(ids):
            raise RequestError(f"input '{name}' has an offset {end} outside its {len(ids)} ids")
        if end > start:
            words.append([int(t) for t in ids[start:end]])
        start = end
    return words


def check_output_len(
    prompt_len: int, max_tokens: int, max_seq_len: int, name: str = "max_tokens", clamp: bool = True
) -> int:
    """The tokens to generate: at least one asked for; where the prompt plus them pass max_seq_len, as many as fit
    (`clamp`: TensorRT-LLM's LlmRequest::validate lowers mMaxNewTokens to maxSequenceLen - promptLen with a warning
    instead of refusing, cpp/tensorrt_llm/batch_manager/llmRequest.cpp), refused only when none fits."""
    if max_tokens is None:  # a decoupled model's request may arrive without it
        raise RequestError(f"input {name} is required")
    if max_tokens <= 0:
        raise RequestError(f"{name} is {max_tokens}; ask for at least 1 token")
    if prompt_len + max_tokens > max_seq_len:
        if clamp and prompt_len < max_seq_len:
            return max_seq_len - prompt_len
        raise RequestError(
            f"prompt ({prompt_len} tokens) + {name} ({max_tokens}) = {prompt_len + max_tokens} exceeds max_seq_len "
            f"({max_seq_len}); ask for at most {max(max_seq_len - prompt_len, 0)} tokens"
        )
    return max_tokens


def check_token_ids(ids: Sequence[int], vocab_size: int | None, name: str) -> None:
    if vocab_size is None:
        return
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"input '{name}' holds token id {bad[0]}, outside the vocabulary [0, {vocab_size})")


def sampling_fields(get, top_k_name: str, top_p_name: str) -> dict:
    """SamplingParams fields from a request's optional inputs (`get(name)` -> array or None).

    The engine models name top-k/top-p `runtime_top_k`/`runtime_top_p`, the text models `top_k`/`top_p`;
    `random_seed` is the older NVIDIA name of `seed`.
    """
    seed = scalar(get("seed"), "seed", int, None)
    if seed is None:
        seed = scalar(get("random_seed"), "random_seed", int, None)
    return {
        "temperature": scalar(get("temperature"), "temperature", float, 1.0),
        "top_k": scalar(get(top_k_name), top_k_name, int, 0),
        "top_p": scalar(get(top_p_name), top_p_name, float, 0.0),
        "seed": seed,
    }


def cut_at_stop_text(text: str, stops: Sequence[str], start: int = 0) -> str:
    """`text` up to and with the first of `stops` (in their order) found at or after `start`; `text` when none is."""
    for stop in stops:
        index = text.find(stop, start) if stop else -1
        if index != -1:
            return text[: index + len(stop)]
    return text
