"""Helpers shared by the python-backend models (imported inside tritonserver's python stub).

Nothing here imports `triton_python_backend_utils`: the models pass their tensors in as numpy
arrays and turn `RequestError` into a Triton error, so these helpers are testable without a server.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import os
from pathlib import Path
from typing import Sequence

import numpy as np

# A python stub that dies on a signal (SIGSEGV, SIGABRT from a corrupted heap) prints every thread's Python stack
# into the server log first (the stub's stderr), so a crash is readable from a CI log.
faulthandler.enable(all_threads=True)


class RequestError(Exception):
    """Something wrong with one request: answered with a Triton error, the server keeps serving."""


# ---------------------------------------------------------------- model parameters


def parameters(args: dict) -> dict[str, str]:
    """The `parameters` of a model's config as {key: string_value}."""
    import json

    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def is_decoupled(args: dict) -> bool:
    import json

    config = json.loads(args["model_config"])
    return bool(config.get("model_transaction_policy", {}).get("decoupled", False))


def flag(value: str | None, default: bool = False) -> bool:
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def resolve_dir(value: str, args: dict) -> Path:
    """A directory parameter: absolute, or relative to the model's own folder in the repository."""
    path = Path(value)
    if not path.is_absolute():
        path = Path(args["model_repository"]) / path
    return path.resolve()


def load_tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def load_object(spec: str):
    """Import 'package.module:attribute'."""
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def load_cpu_executor(engine_dir: str):
    """The default executor factory: specdeploy's CPU engine behind the KV-reusing Executor."""
    from specdeploy.engine.model import CpuEngine
    from specdeploy.engine.executor import Executor

    return Executor(CpuEngine.load(engine_dir), max_cached_sequences=int(os.environ.get("SPECDEPLOY_KV_POOL", "4")))


def with_eagle3_head(executor, head_dir, draft_p_min: float = 0.0):
    """draft.kind eagle3: the executor with the EAGLE-3 head of `head_dir` loaded against its engine (the fused loop,
    engine/executor.py) and its draft cut-off (speculative.draft_p_min); unchanged when head_dir is None. A head that
    does not fit the engine: ModelError naming the file."""
    if head_dir is None:
        return executor
    from specdeploy.engine.eagle3 import Eagle3Head

    executor.head = Eagle3Head.load(head_dir, executor.engine)
    executor.draft_p_min = draft_p_min
    return executor


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


def batch_size(array: np.ndarray, name: str) -> int:
    if array.ndim == 0:
        raise RequestError(f"input '{name}' has no batch dimension")
    return int(array.shape[0])


def require_single(array: np.ndarray, name: str) -> None:
    if array is None:  # Triton lets a decoupled model's request through without it (bench/fuzz.py found a traceback)
        raise RequestError(f"input '{name}' is required")
    n = batch_size(array, name)
    if n != 1:
        raise RequestError(f"input '{name}' has batch size {n}; this model takes one sequence per request (send batch 1)")


def decode_utf8(value, name: str) -> str:
    if isinstance(value, str):
        return value
    raw = bytes(value)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(
            f"input '{name}' is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}); send UTF-8 text"
        ) from None


def strings(array: np.ndarray | None, name: str) -> list[str]:
    """A STRING tensor of one batch item as a list of non-empty strings ([] when absent)."""
    if array is None:
        return []
    return [s for s in (decode_utf8(v, name) for v in np.asarray(array).reshape(-1)) if s]


# ---------------------------------------------------------------- tokens


def encode_prompt(tokenizer, text: str, add_special_tokens: bool, max_input_len: int) -> list[int]:
    """Token ids of a prompt, checked: not empty, at most max_input_len tokens."""
    if not text:
        raise RequestError("text_input is empty; send a non-empty prompt")
    ids = list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
    if not ids:
        raise RequestError("text_input tokenizes to no tokens; send a non-empty prompt")
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
        arr = arr[0]
    if arr.ndim != 2 or arr.shape[0] != 2:
        raise RequestError(f"input '{name}' must have shape [2, L] per request (ids, end offsets), got {list(np.shape(array))}")
    ids, offsets = arr[0].tolist(), [int(o) for o in arr[1].tolist() if o >= 0]
    words, start = [], 0
    for end in offsets:
        if not start <= end <= len(ids):
            raise RequestError(f"input '{name}' has an offset {end} outside its {len(ids)} ids")
        if end > start:
            words.append([int(t) for t in ids[start:end]])
        start = end
    return words


def check_output_len(prompt_len: int, max_tokens: int, max_seq_len: int, name: str = "max_tokens") -> None:
    """At least one token asked for, and the prompt plus the tokens asked for fit in max_seq_len."""
    if max_tokens is None:  # a decoupled model's request may arrive without it
        raise RequestError(f"input {name} is required")
    if max_tokens <= 0:
        raise RequestError(f"{name} is {max_tokens}; ask for at least 1 token")
    if prompt_len + max_tokens > max_seq_len:
        raise RequestError(
            f"prompt ({prompt_len} tokens) + {name} ({max_tokens}) = {prompt_len + max_tokens} exceeds max_seq_len "
            f"({max_seq_len}); ask for at most {max(max_seq_len - prompt_len, 0)} tokens"
        )


def check_token_ids(ids: Sequence[int], vocab_size: int | None, name: str) -> None:
    if vocab_size is None:
        return
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"input '{name}' holds token id {bad[0]}, outside the vocabulary [0, {vocab_size})")


class TextStream:
    """Incremental detokenization: the text of all tokens so far, sent as the new suffix each time.

    A trailing partial UTF-8 character decodes to U+FFFD; it is held back until the next token
    completes it, so the concatenated deltas equal the decoding of the whole output.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool, prefix_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prefix_ids)
        self.sent = len(self._decode())

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        text = self._decode()
        stable = len(text.rstrip("\ufffd"))
        delta = text[self.sent : stable] if stable > self.sent else ""
        self.sent = max(self.sent, stable)
        return delta

    def flush(self) -> str:
        text = self._decode()
        delta = text[self.sent :]
        self.sent = len(text)
        return delta


def streamed_emit(sender, final_flag: int):
    """`emit(response, final)` over a decoupled request's response sender. A client that cancelled its
    request (or closed its stream) has Triton close the sender: what the model still sends for it is
    dropped, instead of raising out of `execute` and logging an error per cancelled request."""

    def emit(response, final: bool) -> None:
        try:
            sender.send(response, flags=final_flag if final else 0)
        except Exception as exc:  # noqa: BLE001 - pb_utils.TritonModelException, only importable in the stub
            if "sender has been closed" not in str(exc):
                raise

    return emit


def execute_all(requests, decoupled: bool, serve, final_flag: int):
    """Run `serve(request, emit)` for each request of a Triton `execute` call.

    `emit(response, final)`: a decoupled model sends every response as it comes (the last one with
    `final_flag`); otherwise only the final response is kept and returned, one per request.
    """
    if decoupled:
        for request in requests:
            serve(request, streamed_emit(request.get_response_sender(), final_flag))
        return None
    responses = []
    for request in requests:
        box = []
        serve(request, lambda response, final, b=box: b.append(response) if final else None)
        responses.append(box[-1])
    return responses


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


def error_text(exc) -> str:
    """A SpecDeployError's message with its hint, or any other exception's text, for a Triton error."""
    text = getattr(exc, "message", None) or str(exc)
    hint = getattr(exc, "hint", "")
    return f"{text} ({hint})" if hint else text


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
    "len_penalty", "length_penalty", "early_stopping", "beam_search_diversity_rate", "runtime_top_p_min",
    "runtime_top_p_reset_ids", "retention_token_range_starts", "retention_token_range_ends",
    "retention_token_range_priorities", "retention_token_range_durations_ms", "retention_decode_priority",
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


def embedding_bias_from_words(tokenizer, words: list[str], weights, vocab_size: int) -> np.ndarray | None:
    """NVIDIA's preprocessing rule: every token of each word gets its weight added ([vocab] fp32), or None."""
    weights = [] if weights is None else [float(w) for w in np.asarray(weights).reshape(-1).tolist()]
    if not words and not weights:
        return None
    if len(words) != len(weights):
        raise RequestError(
            f"embedding_bias_words has {len(words)} words but embedding_bias_weights {len(weights)} weights; send one weight per word"
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


PENALTY_NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0, "embedding_bias": None}


def request_kwargs(request_type, values: dict) -> dict:
    """`values` for the engine's GenerationRequest; RequestError naming a non-neutral one it lacks a field for."""
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


def deadline_s(request_timeout_us: int, default_s: float) -> float | None:
    """Seconds a request may run on the server: its own Triton `timeout` (microseconds, tritonclient's
    `timeout=`) when set, else the model's `request_timeout_s` parameter; None: no deadline."""
    if request_timeout_us and request_timeout_us > 0:
        return request_timeout_us / 1e6
    return default_s if default_s and default_s > 0 else None


KV_TOKENS_PER_BLOCK = 64  # TensorRT-LLM's default tokens_per_block, for the kv_cache_* block counts


def kv_blocks(stats, total_tokens: int) -> tuple[int, int, int]:
    """(new, reused, total) KV blocks of a request: the executor's counts, else derived from its token counts."""
    if stats is not None and getattr(stats, "kv_cache_alloc_total_blocks", None) is not None and hasattr(stats, "kv_cache_reused_blocks"):
        return int(stats.kv_cache_alloc_new_blocks), int(stats.kv_cache_reused_blocks), int(stats.kv_cache_alloc_total_blocks)
    reused = int(getattr(stats, "reused_tokens", 0) or 0) // KV_TOKENS_PER_BLOCK
    total = -(-total_tokens // KV_TOKENS_PER_BLOCK)
    return total - reused, reused, total


class CancelCheck:
    """`request.is_cancelled()` at most every `interval_s` (each call is a round trip to the server
    process) plus the request's deadline; `reason` is "cancelled" or "timeout" once it fires."""

    def __init__(self, is_cancelled, deadline_s: float | None, interval_s: float = 0.05, clock=None):
        import time

        self._clock = clock or time.monotonic
        self._is_cancelled = is_cancelled
        self._deadline = None if deadline_s is None else self._clock() + deadline_s
        self._interval = interval_s
        self._next = self._clock() + interval_s
        self.deadline_s = deadline_s
        self.reason: str | None = None

    def __call__(self) -> bool:
        if self.reason is None:
            now = self._clock()
            if self._deadline is not None and now > self._deadline:
                self.reason = "timeout"
            elif now >= self._next:
                self._next = now + self._interval
                if self._is_cancelled():
                    self.reason = "cancelled"
        return self.reason is not None

    def stop(self) -> None:
        """End the request early on purpose (TensorRT-LLM's `stop`): it finishes with what it has."""
        if self.reason is None:
            self.reason = "stopped"

    def ask_now(self) -> bool:
        """`is_cancelled()` now, not throttled; True: the request is to end (cancelled, timed out or stopped).

        False means the question went through the stub's queue to the server and back (a stub caches a True
        answer and no longer asks), which `HeldResponses.release` relies on."""
        if self.reason is None and self._is_cancelled():
            self.reason = "cancelled"
        return self.reason is not None


class RunningRequests:
    """The running requests of a model instance by Triton request id, so that TensorRT-LLM's `stop`
    input (a second request with the same id and stop=true) can end them: their CancelCheck then
    reads "stopped", and the executor finishes them with the tokens they have (not an error)."""

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self._checks: dict[str, list[CancelCheck]] = {}

    @contextlib.contextmanager
    def registered(self, request_id: str, check: CancelCheck):
        if not request_id:  # without an id a request cannot be stopped this way
            yield
            return
        with self._lock:
            self._checks.setdefault(request_id, []).append(check)
        try:
            yield
        finally:
            with self._lock:
                checks = self._checks.get(request_id, [])
                checks.remove(check)
                if not checks:
                    self._checks.pop(request_id, None)

    def stop(self, request_id: str) -> int:
        """Stop every running request with this id; how many there were."""
        with self._lock:
            checks = list(self._checks.get(request_id, [])) if request_id else []
        for check in checks:
            check.stop()
        return len(checks)


def request_cancel_check(request, default_timeout_s: float, lock=None) -> CancelCheck:
    """The request's CancelCheck; `lock` (the model's StubLock) is held around `is_cancelled` when other threads
    of the stub may be calling triton_python_backend_utils at the same time."""
    try:
        timeout_us = int(request.timeout())
    except Exception:  # older stubs have no timeout()
        timeout_us = 0
    is_cancelled = getattr(request, "is_cancelled", lambda: False)
    if lock is not None:
        unlocked = is_cancelled

        def is_cancelled():
            with lock:
                return unlocked()

    return CancelCheck(is_cancelled, deadline_s(timeout_us, default_timeout_s))


class HeldResponses:
    """The response iterators of a stub's decoupled BLS calls, kept until the stub's own thread is done with them.

    In tritonserver 2.51's python backend (r24.10), a decoupled call that ends queues its iterator's cleanup for
    the stub's stub-to-parent thread, which drops the stub's reference to it. If the model had dropped its own
    references first, the iterator, its responses and their tensors are freed on that thread, and a tensor frees
    its numpy array without holding the GIL (`PbTensor::~PbTensor`; python_backend b771f4f, r24.12, holds it)
    while the model's thread runs Python: the Python heap is corrupted and the stub dies with SIGSEGV in whatever
    it allocates next ("Stub process is not healthy"; 1 in ~60 rounds of 6 concurrent streams in
    tests/test_triton_server.py before this). `request.is_cancelled()` goes through the same queue and waits for
    its answer, so once it answered, every cleanup queued before it is done and the iterators held so far are
    owned by the model alone: released then, on the model's thread, with the GIL."""

    def __init__(self):
        self._held: list = []

    def hold(self, iterator):
        self._held.append(iterator)
        return iterator

    def release(self, check: CancelCheck | None) -> None:
        """Drop the held iterators if `check.ask_now()` went through the queue (else keep them for a later call)."""
        if self._held and check is not None and not check.ask_now():
            self._held.clear()

    def clear(self) -> None:
        """At `finalize`, not later: a response freed at the stub's teardown would touch its shared memory after it is gone."""
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)


class StubLock:
    """One lock for every triton_python_backend_utils call a stub makes from more than one thread.

    The python backend's stub is not safe for that: its response sender releases the GIL while it sends, and a
    tensor built meanwhile in another thread corrupted the stub's heap ("munmap_chunk(): invalid pointer", a
    faulthandler stack in `_response` beside another thread in `send`; tests/test_batching.py, in-flight batching).
    A request thread holds it for all its work and lets go only while it waits for the engine (`released_while`)."""

    def __init__(self):
        import threading

        self._lock = threading.RLock()

    def __enter__(self):
        self._lock.acquire()
        return self

    def __exit__(self, *exc):
        self._lock.release()

    def released_while(self, items):
        """Iterate `items` (a generator that blocks for each item) without the lock while it blocks."""
        iterator = iter(items)
        while True:
            self._lock.release()
            try:
                item = next(iterator)
            except StopIteration:
                return
            finally:
                self._lock.acquire()
            yield item


# ---------------------------------------------------------------- streaming whole characters


def chunk_decoding_problem(tokenizer) -> str | None:
    """Why decoding streamed chunks of whole characters one by one could differ from decoding the
    whole output, or None when it cannot: a byte-level BPE decoder maps each token to its bytes, so
    decoding is concatenative over chunks that hold complete UTF-8 characters. SentencePiece-style
    decoders (Metaspace, Strip) drop a chunk's leading space, and `clean_up_tokenization_spaces`
    rewrites text across chunk boundaries."""
    import json

    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return "the tokenizer sets clean_up_tokenization_spaces (it rewrites spaces across chunk boundaries)"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "the tokenizer has no fast (tokenizers) backend"
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        return f"its decoder is {decoder.get('type') or 'none'}, not ByteLevel (a chunk decoded alone can lose its leading space)"
    return None


class HoldBack:
    """Which streamed tokens may be sent now: tokens are held until they complete text.

    tokenizers' incremental detokenizer (`DecodeStream`) says when the tokens so far end on a whole
    character; only then are the held tokens released, so each streamed response decodes to whole
    characters and the concatenated text equals the decoding of the whole output (for a tokenizer
    without a `chunk_decoding_problem`). `flush` releases what is left at the end of the request.
    """

    def __init__(self, backend_tokenizer, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self._tokenizer = backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []

    def push(self, ids: Sequence[int]) -> list[int]:
        ready: list[int] = []
        for token in ids:
            self._held.append(int(token))
            if self._stream.step(self._tokenizer, int(token)) is not None:
                ready, self._held = ready + self._held, []
        return ready

    @property
    def pending(self) -> int:
        """Tokens held back (they do not complete text yet)."""
        return len(self._held)

    def flush(self) -> list[int]:
        out, self._held = self._held, []
        return out


# ---------------------------------------------------------------- BLS calls in time slices (cancellation inside a round)
# A BLS request's draft/target calls do not see the client's cancellation of the BLS request. So
# each call carries a short Triton timeout: the engine model stops at it (between prefill chunks and
# tokens, its KV stays cached), the BLS checks its own request, and re-sends the call if it goes on;
# the re-sent call reuses the cached prefix, so it resumes where the expired one stopped.

CANCEL_CHECK_INTERVAL_S = 0.5


class SliceExpired(Exception):
    """A BLS call ran out of its time slice before it finished."""


class ParentStopped(Exception):
    """The BLS request was cancelled or passed its deadline while one of its calls ran."""


def is_slice_expiry(message: str) -> bool:
    """An engine model's error for a call stopped at its own timeout (tensorrt_llm's deadline text,
    or Triton's queue timeout)."""
    return "server-side deadline" in message or "timeout expired" in message.lower()


def run_slice_s(output_len: int, per_token_s: float, active: int) -> float:
    """The first time slice of a plain run: a slice that expires mid-run loses every token it generated, so it
    allows twice the run's time at the per-token cost measured so far, times the requests in flight (their steps
    share the target: at concurrency 2 a token cost ~1.7x the one-request cost the deployment had measured), plus
    a second for the prompt's prefill. With a slice of 2x the one-request time, 2 concurrent BLS plain runs of 64
    tokens took 2.1x the ensemble's time (most first slices expired; with no slicing 1.15x)."""
    return 2.0 * max(1, active) * output_len * per_token_s + 1.0


def call_in_slices(attempt, stop_check, slice_s: float, max_attempts: int = 10_000):
    """`attempt(slice_s)` until it returns, checking `stop_check()` (a CancelCheck) after each expired
    slice. An attempt that expired after generating tokens lost them (only prefill work stays cached),
    so the next slice is twice as long: a call always finishes, however slow its decode steps."""
    for _ in range(max_attempts):
        try:
            return attempt(slice_s)
        except SliceExpired as exc:
            if stop_check():
                what = "ran past its server-side deadline" if stop_check.reason == "timeout" else "was cancelled"
                raise ParentStopped(f"the request {what} during this call") from None
            if _generated_before_expiry(str(exc)):
                slice_s *= 2
    raise ParentStopped(f"the call did not finish in {max_attempts} time slices")


def _generated_before_expiry(message: str) -> bool:
    import re

    match = re.search(r"after (\d+) tokens", message)
    return match is None or int(match.group(1)) > 0
