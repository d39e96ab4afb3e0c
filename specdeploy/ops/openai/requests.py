"""What an OpenAI request means to the front: the model ids it serves and the Triton model each one calls
(`routes`), the request body read into a `Job` (`parse_job`: OpenAI's fields, checked, with a 400 that names the
field), the errors in OpenAI's format (`ApiError`), and the server's tokenizer (`Codec`: chat template, token
counts the way preprocessing counts them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdeploy.client.protocol import CONTROL_MODEL, SPECULATIVE_MODEL
from specdeploy.core.errors import ClientError
from specdeploy.core.text_rules import TextError, check_json
from specdeploy.speculation.sampling import SamplingParams

UNSUPPORTED = (
    "logprobs",
    "top_logprobs",
    "echo",
    "best_of",
    "suffix",
    "tools",
    "functions",
    "logit_bias",
    "response_format",
)


@dataclass(frozen=True)
class Field:
    """What one request field takes: `kind` (text, prompt, messages, stop, int, number, bool, object, unsupported),
    the bounds of a number, and the routes that read it."""

    kind: str
    low: float | None = None
    high: float | None = None
    routes: tuple[str, ...] = ("completions", "chat")


# The request schema parse_job reads (OpenAI's fields this front knows); bench/fuzz.py generates its cases from it.
FIELDS = {
    "model": Field("text"),
    "prompt": Field("prompt", routes=("completions",)),
    "messages": Field("messages", routes=("chat",)),
    "max_tokens": Field("int", 1),
    "max_completion_tokens": Field("int", 1, routes=("chat",)),
    "temperature": Field("number", 0.0, 2.0),
    "top_p": Field("number", 0.0, 1.0),
    "seed": Field("int", 0, 2**64 - 1),  # Triton's seed is UINT64
    "n": Field("int", 1),  # and 1 only: parse_job says so in its own words
    "stop": Field("stop"),
    "stream": Field("bool"),
    "stream_options": Field("object"),
    "user": Field("text"),  # OpenAI's end-user tag: read by no one here, checked as every text is
    **{key: Field("unsupported") for key in UNSUPPORTED},
}


@dataclass(frozen=True)
class Route:
    id: str
    path: str  # speculative | control | canary
    triton_model: str
    send_num_draft_tokens: bool


def routes(recipe) -> dict[str, Route]:
    """The model ids this front serves and the Triton model each one calls."""
    name = recipe.name
    spec = Route(f"{name}-speculative", "speculative", SPECULATIVE_MODEL, True)
    out = {
        name: Route(name, "speculative", SPECULATIVE_MODEL, True),
        spec.id: spec,
        f"{name}-control": Route(f"{name}-control", "control", CONTROL_MODEL, False),
    }
    if recipe.canary.control_percent > 0:
        out[f"{name}-canary"] = Route(f"{name}-canary", "canary", SPECULATIVE_MODEL, False)
    return out


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def text_refusal(exc: TextError) -> ApiError:
    """A text refused at the boundary (text_rules): 400, `param` its top-level field, `code` the rule."""
    return ApiError(400, f"'{exc.field}' {exc.detail}", param=exc.root, code=exc.rule)


def from_client_error(exc: ClientError) -> ApiError:
    text = exc.message
    if "timed out" in text:
        return ApiError(504, text, "timeout", code="deadline_exceeded")
    if "unreachable" in text or "went away" in text:
        return ApiError(503, text, "server_error", code="triton_unavailable")
    lowered = text.lower()
    # the deployment cannot serve right now (a python stub died, a model not loaded): a server fault a client may retry
    if any(s in lowered for s in SERVER_DOWN_MARKS):
        return ApiError(503, text, "server_error", code="triton_unavailable")
    if "internal error" in lowered or any(s in lowered for s in SERVER_FAULT_MARKS):
        return ApiError(500, text, "server_error")
    return ApiError(400, text, "invalid_request_error")  # the model refused the request (it says why)


# Triton's and TensorRT-LLM's words for a server that cannot run a request (Triton core: "has no available versions",
# "Request for unknown model"; the python backend: "Stub process '...' is not healthy"), and for a failure inside it
SERVER_DOWN_MARKS = ("is not healthy", "has no available versions", "request for unknown model", "is not ready")
SERVER_FAULT_MARKS = (
    "out of memory",
    "cuda error",
    "cuda runtime error",
    "[tensorrt-llm][error]",
    "segmentation fault",
)


class Codec:
    """The server's tokenizer: chat template, and token counts the way preprocessing counts them."""

    def __init__(self, tokenizer_dir: Path, add_special_tokens: bool = True):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.add_special_tokens = add_special_tokens

    def chat_prompt(self, messages: list[dict]) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(
                400, "this model's tokenizer has no chat template", param="messages", code="no_chat_template"
            )
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template error is the request's fault (roles, content types)
            raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc

    def count_prompt(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=self.add_special_tokens)["input_ids"])

    def count_output(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0


# ---------------------------------------------------------------- request parsing


def _number(body: dict, key: str, kind, default):
    low, high = FIELDS[key].low, FIELDS[key].high
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(400, f"'{key}' must be {'an integer' if kind is int else 'a number'}, got {value!r}", param=key)
    if isinstance(value, float) and not math.isfinite(value):  # JSON from Python clients may carry NaN / Infinity
        raise ApiError(400, f"'{key}' must be a finite number, got {value!r}", param=key)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ApiError(400, f"'{key}' is {value}, must be in [{low}, {high if high is not None else 'inf'}]", param=key)
    return kind(value)


@dataclass(frozen=True)
class Job:
    route: Route
    prompt: str
    max_tokens: int
    sampling: SamplingParams | None
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool


def _max_tokens(value: int, key: str, limit: int | None) -> int:
    if limit is not None and value > limit:
        raise ApiError(
            400,
            f"'{key}' is {value}, above this deployment's limit of {limit} tokens (the engine's max_seq_len "
            "counts prompt plus output)",
            param=key,
            code="max_tokens_too_large",
        )
    return value


def _content_text(message: dict, index: int) -> str:
    """A chat message's text for the chat template: its string content, or its text parts joined (OpenAI's
    [{"type": "text", "text": ...}] form, which the `openai` SDK sends as is); an assistant turn may have none."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, list) and content and all(isinstance(p, dict) for p in content):
        kinds = {p.get("type") for p in content}
        if kinds == {"text"} and all(isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
        other = sorted(str(k) for k in kinds - {"text"})
        if other:
            raise ApiError(
                400,
                f"messages[{index}].content has parts of type {', '.join(other)}; this server takes text parts only",
                param="messages",
                code="unsupported_parameter",
            )
    raise ApiError(
        400, f"messages[{index}].content must be a string or a list of {{type: text, text}} parts", param="messages"
    )


def parse_job(
    body: Any,
    chat: bool,
    served: dict[str, Route],
    codec: Codec,
    default_max_tokens: int,
    max_tokens_limit: int | None = None,
) -> Job:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        check_json(body)  # every text of the body, before any field is read
    except TextError as exc:
        raise text_refusal(exc) from None
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required", param="model")
    if model not in served:
        raise ApiError(
            404,
            f"the model '{model}' does not exist; served here: {', '.join(served)}",
            param="model",
            code="model_not_found",
        )
    for key in UNSUPPORTED:
        value = body.get(key)
        if value and not (key == "response_format" and isinstance(value, dict) and value.get("type") == "text"):
            raise ApiError(400, f"'{key}' is not supported by this server", param=key, code="unsupported_parameter")
    if _number(body, "n", int, 1) != 1:
        raise ApiError(400, "'n' must be 1 here (one completion per request)", param="n", code="unsupported_parameter")
    if chat:
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(x, dict) and "role" in x for x in messages)
        ):
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
        prompt = codec.chat_prompt([{**m, "content": _content_text(m, i)} for i, m in enumerate(messages)])
        max_tokens = _number(body, "max_completion_tokens", int, None)
        key = "max_completion_tokens"
        if max_tokens is None:
            max_tokens, key = _number(body, "max_tokens", int, default_max_tokens), "max_tokens"
        max_tokens = _max_tokens(max_tokens, key, max_tokens_limit)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' must be a string (one prompt per request)", param="prompt")
        max_tokens = _max_tokens(_number(body, "max_tokens", int, default_max_tokens), "max_tokens", max_tokens_limit)
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="messages" if chat else "prompt")
    temperature = _number(body, "temperature", float, 1.0)
    top_p = _number(body, "top_p", float, 1.0)
    seed = _number(body, "seed", int, None)
    # top_p 0 is the narrowest nucleus, the most likely token alone: greedy, as temperature 0
    sampling = None if temperature == 0.0 or top_p == 0.0 else SamplingParams(temperature, 0, top_p, seed)
    stop = body.get("stop")
    stops = (
        (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else () if stop is None else (None,)
    )
    if not all(isinstance(s, str) for s in stops) or len(stops) > 4:
        raise ApiError(400, "'stop' must be a string or a list of up to 4 strings", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", param="stream")
    options = body.get("stream_options") or {}
    include_usage = bool(options.get("include_usage", False)) if isinstance(options, dict) else False
    return Job(served[model], prompt, max_tokens, sampling, stops, stream, include_usage)
