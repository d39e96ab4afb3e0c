"""An OpenAI-compatible HTTP front (FastAPI + uvicorn) over a Triton deployment of the inflight_batcher_llm layout.

Endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (the model's chat
template, from the repository's tokenizer), `GET /health`. It speaks to Triton through
`specdeploy.client.triton_adapter.TritonEndpoint` (gRPC, every call with a deadline).

The `model` field picks the path (`/v1/models` lists them):
- `<recipe>` and `<recipe>-speculative` -> `tensorrt_llm_bls`, always speculative (sends
  `num_draft_tokens`, which also keeps a canary from sending it down the plain path);
- `<recipe>-control` -> `ensemble` (target only, the unaccelerated control);
- `<recipe>-canary` -> `tensorrt_llm_bls` without `num_draft_tokens`: the BLS sends
  `canary.control_percent` % of these down the plain path (listed only when that share is > 0).

Semantics:
- `temperature` 0 decodes greedily (the same tokens as the Triton path for the same prompt);
  `temperature` > 0 (OpenAI's default is 1) samples with `top_p` (default 1.0) and `seed`.
- `max_tokens` (chat also `max_completion_tokens`) defaults to the recipe's `validation.max_tokens`.
- `stop` strings are applied here: the text is cut before the first one and `finish_reason` is
  `stop` (the server may generate a few tokens past it). `n` > 1, `logprobs`, `echo`, `best_of`,
  `suffix` and `tools` are refused with a 400 in OpenAI's error format.
- `usage.prompt_tokens` tokenizes the prompt (template applied) with the server's tokenizer and
  settings (`add_special_tokens`): the count preprocessing makes. `usage.completion_tokens` counts the
  output ids when the model returns `output_ids`; NVIDIA's `ensemble` / `tensorrt_llm_bls` interface
  returns only text, so there it re-tokenizes the output text, which can differ from the generated
  ids where the model emitted a split a tokenizer would merge (`specdeploy.completion_tokens_exact`
  says which).
- Streaming (`stream: true`, server-sent events, `stream_options.include_usage`): on a decoupled
  deployment (`triton.decoupled: true`) each Triton response becomes a chunk as it arrives; on a
  unary deployment the whole answer comes as one content chunk (then the final chunk), so SSE
  clients work unchanged but see no incremental tokens.
- Extension field `specdeploy` on every completion (and on the final stream chunk):
  `{"path", "triton_model", "draft_tokens", "accepted_draft_tokens", "acceptance_rate",
  "server_ttft_s", "completion_tokens_exact"}` from the BLS perf outputs (null on the control path).
- Errors: `{"error": {"message", "type", "param", "code"}}` with 400 (bad request), 401 (API key
  missing or wrong), 404 (unknown model), 413 (body too large), 503 (Triton unreachable), 504
  (deadline), 500 (server fault).

Security: it binds 127.0.0.1 unless a host is named (a non-loopback host needs an API key). With an
API key (`--api-key` / `SPECDEPLOY_API_KEY`) every route but `/health` wants `Authorization: Bearer
<key>`, as OpenAI's API does. Request bodies are capped (`--max-body-bytes`, 413) and `max_tokens`
by the deployment (`engine.max_seq_len - 1`, or a lower `--max-tokens-limit`; 400 naming it).
FastAPI's /docs and /openapi.json are off.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import json
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request  # module level: FastAPI resolves the handlers' (string) annotations here

from specdeploy.client.protocol import CONTROL_MODEL, SPECULATIVE_MODEL, GenerateRequest, GenerateResult, Sampling
from specdeploy.errors import ClientError, ConfigError

HOST = "127.0.0.1"
API_KEY_ENV = "SPECDEPLOY_API_KEY"
MAX_BODY_BYTES = 1 << 20  # 1 MiB: a prompt this front accepts (engine.max_input_len tokens) is far smaller
OPEN_PATHS = ("/health",)  # reachable without the API key (load balancers, `wait_listening`)
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "tools", "functions", "logit_bias", "response_format")


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
    out = {name: Route(name, "speculative", SPECULATIVE_MODEL, True), spec.id: spec,
           f"{name}-control": Route(f"{name}-control", "control", CONTROL_MODEL, False)}  # fmt: skip
    if recipe.canary.control_percent > 0:
        out[f"{name}-canary"] = Route(f"{name}-canary", "canary", SPECULATIVE_MODEL, False)
    return out


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def from_client_error(exc: ClientError) -> ApiError:
    text = exc.message
    if "timed out" in text:
        return ApiError(504, text, "timeout", code="deadline_exceeded")
    if "unreachable" in text or "went away" in text:
        return ApiError(503, text, "server_error", code="triton_unavailable")
    if "internal error" in text:
        return ApiError(500, text, "server_error")
    return ApiError(400, text, "invalid_request_error")  # the model refused the request (it says why)


class Codec:
    """The server's tokenizer: chat template, and token counts the way preprocessing counts them."""

    def __init__(self, tokenizer_dir: Path, add_special_tokens: bool = True):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.add_special_tokens = add_special_tokens

    def chat_prompt(self, messages: list[dict]) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template", param="messages", code="no_chat_template")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template error is the request's fault (roles, content types)
            raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc

    def count_prompt(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=self.add_special_tokens)["input_ids"])

    def count_output(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0


class StopCutter:
    """Cuts streamed text before the first stop string, holding back what could begin one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, piece: str) -> str:
        if self.stopped:
            return ""
        self.text += piece
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.sent = self.text[self.sent : cut], cut
            self.text = self.text[:cut]
            return out
        limit = max(self.sent, len(self.text) - self.hold) if self.stops else len(self.text)
        out, self.sent = self.text[self.sent : limit], limit
        return out

    def flush(self) -> str:
        if self.stopped:
            return ""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


# ---------------------------------------------------------------- request parsing


def _number(body: dict, key: str, kind, default, low=None, high=None):
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
    sampling: Sampling | None
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool


def _max_tokens(value: int, key: str, limit: int | None) -> int:
    if limit is not None and value > limit:
        raise ApiError(400, f"'{key}' is {value}, above this deployment's limit of {limit} tokens (the engine's max_seq_len "
                            "counts prompt plus output)", param=key, code="max_tokens_too_large")  # fmt: skip
    return value


def parse_job(body: Any, chat: bool, served: dict[str, Route], codec: Codec, default_max_tokens: int, max_tokens_limit: int | None = None) -> Job:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required", param="model")
    if model not in served:
        raise ApiError(404, f"the model '{model}' does not exist; served here: {', '.join(served)}", param="model", code="model_not_found")
    for key in UNSUPPORTED:
        value = body.get(key)
        if value and not (key == "response_format" and isinstance(value, dict) and value.get("type") == "text"):
            raise ApiError(400, f"'{key}' is not supported by this server", param=key, code="unsupported_parameter")
    if _number(body, "n", int, 1, 1) != 1:
        raise ApiError(400, "'n' must be 1 here (one completion per request)", param="n", code="unsupported_parameter")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(x, dict) and "role" in x for x in messages):
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
        prompt = codec.chat_prompt(messages)
        max_tokens = _number(body, "max_completion_tokens", int, None, 1)
        key = "max_completion_tokens"
        if max_tokens is None:
            max_tokens, key = _number(body, "max_tokens", int, default_max_tokens, 1), "max_tokens"
        max_tokens = _max_tokens(max_tokens, key, max_tokens_limit)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' must be a string (one prompt per request)", param="prompt")
        max_tokens = _max_tokens(_number(body, "max_tokens", int, default_max_tokens, 1), "max_tokens", max_tokens_limit)
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="messages" if chat else "prompt")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate (JSON "\ud800") has no UTF-8 form to send
        raise ApiError(400, f"the prompt is not valid Unicode text ({exc.reason} at character {exc.start})",
                       param="messages" if chat else "prompt") from None  # fmt: skip
    temperature = _number(body, "temperature", float, 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", float, 1.0, 0.0, 1.0)
    seed = _number(body, "seed", int, None, 0, 2**64 - 1)  # Triton's seed is UINT64
    sampling = None if temperature == 0.0 else Sampling(temperature, 0, top_p if top_p > 0 else 1.0, seed)
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else () if stop is None else (None,)
    if not all(isinstance(s, str) for s in stops) or len(stops) > 4:
        raise ApiError(400, "'stop' must be a string or a list of up to 4 strings", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", param="stream")
    options = body.get("stream_options") or {}
    include_usage = bool(options.get("include_usage", False)) if isinstance(options, dict) else False
    return Job(served[model], prompt, max_tokens, sampling, stops, stream, include_usage)


# ---------------------------------------------------------------- the app


class Front:
    """What the routes need: the Triton endpoint, the codec, the routes, the defaults."""

    def __init__(self, endpoint, codec: Codec, served: dict[str, Route], default_max_tokens: int, num_draft_tokens: int, timeout_s: float,
                 api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES, max_tokens_limit: int | None = None):  # fmt: skip
        self.endpoint, self.codec, self.served = endpoint, codec, served
        self.default_max_tokens, self.num_draft_tokens, self.timeout_s = default_max_tokens, num_draft_tokens, timeout_s
        self.api_key = api_key or None  # an empty key (an empty env var) means none
        self.max_body_bytes, self.max_tokens_limit = max_body_bytes, max_tokens_limit
        self.created = int(time.time())

    def auth_error(self, authorization: str | None) -> ApiError | None:
        """None when the request may pass: no key configured, or `Authorization: Bearer <key>` matches."""
        if self.api_key is None:
            return None
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return ApiError(401, "You didn't provide an API key: send the header 'Authorization: Bearer <key>' "
                                 f"(the key this server was started with, --api-key or ${API_KEY_ENV})", code="missing_api_key")  # fmt: skip
        # constant time, so the key cannot be found byte by byte from response times; bytes, because compare_digest
        # refuses non-ASCII str: Starlette decodes header bytes as latin-1, so encoding back gives the bytes sent
        if not hmac.compare_digest(given.strip().encode("latin-1", "replace"), self.api_key.encode("utf-8")):
            return ApiError(401, "Incorrect API key provided", code="invalid_api_key")
        return None

    def request(self, job: Job) -> GenerateRequest:
        return GenerateRequest(
            prompt=job.prompt,
            max_tokens=job.max_tokens,
            num_draft_tokens=self.num_draft_tokens if job.route.send_num_draft_tokens else None,
            sampling=job.sampling,
            stream=job.stream and self.endpoint.is_decoupled(job.route.triton_model),
            return_perf_metrics=True,
        )

    def run(self, job: Job, on_text=None) -> GenerateResult:
        try:
            return self.endpoint.generate(job.route.triton_model, self.request(job), self.timeout_s, on_text=on_text)
        except ClientError as exc:
            raise from_client_error(exc) from exc

    def usage(self, job: Job, result: GenerateResult, text: str, cut: bool) -> dict:
        prompt_tokens = self.codec.count_prompt(job.prompt)
        if result.token_ids is not None and not cut:
            completion = len(result.token_ids)
        else:
            completion = self.codec.count_output(text)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}

    @staticmethod
    def extension(job: Job, result: GenerateResult | None, cut: bool = False) -> dict:
        perf = result.perf if result is not None else None
        speculative = job.route.path != "control" and perf is not None and perf.total_draft_tokens is not None
        return {
            "path": job.route.path,
            "triton_model": job.route.triton_model,
            "draft_tokens": perf.total_draft_tokens if speculative else None,
            "accepted_draft_tokens": perf.total_accepted_draft_tokens if speculative else None,
            "acceptance_rate": perf.acceptance_rate if speculative else None,
            "server_ttft_s": perf.server_ttft_s if perf is not None else None,
            "server_decode_s": perf.server_decode_s if perf is not None else None,  # first -> last token on the server's clock
            "completion_tokens_exact": result is not None and result.token_ids is not None and not cut,
            "k_history": result.k_history if result is not None else None,  # draft length per round, where the BLS returns it
        }

    def finish_reason(self, job: Job, usage: dict, cut: bool) -> str:
        return "stop" if cut or usage["completion_tokens"] < job.max_tokens else "length"


def create_app(front: Front):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="specdeploy OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        if request.url.path not in OPEN_PATHS:
            error = front.auth_error(request.headers.get("authorization"))
            if error is not None:
                return JSONResponse(error.body(), status_code=error.status, headers={"WWW-Authenticate": "Bearer"})
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > front.max_body_bytes:
            return JSONResponse(_too_large(int(length)).body(), status_code=413)
        return await call_next(request)

    def _too_large(size: int | None) -> ApiError:
        got = f"{size} bytes" if size is not None else "larger"
        return ApiError(413, f"the request body is {got}, above this server's limit of {front.max_body_bytes} bytes "
                             "(--max-body-bytes)", code="request_too_large")  # fmt: skip

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)  # unknown path, wrong method: OpenAI's error format, not FastAPI's {"detail"}
    async def _http_error(request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(ApiError(exc.status_code, message, code=code).body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").body(), status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models():
        data = [{"id": r.id, "object": "model", "created": front.created, "owned_by": "specdeploy",
                 "specdeploy": {"path": r.path, "triton_model": r.triton_model}} for r in front.served.values()]  # fmt: skip
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str):
        if model_id not in front.served:
            raise ApiError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
        r = front.served[model_id]
        return {"id": r.id, "object": "model", "created": front.created, "owned_by": "specdeploy"}

    async def _body(request: Request):
        raw = bytearray()
        async for piece in request.stream():  # a chunked body has no Content-Length: count what arrives
            raw += piece
            if len(raw) > front.max_body_bytes:
                raise _too_large(None)
        try:
            return json.loads(bytes(raw))
        except RecursionError:
            raise ApiError(400, "the request body nests JSON too deeply") from None
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            raise ApiError(400, "the request body is not valid JSON") from None

    async def _complete(request: Request, chat: bool):
        job = await asyncio.to_thread(parse_job, await _body(request), chat, front.served, front.codec, front.default_max_tokens,
                                      front.max_tokens_limit)  # fmt: skip
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if job.stream:
            return StreamingResponse(_stream(job, ident, chat), media_type="text/event-stream")
        result = await asyncio.to_thread(front.run, job)
        cutter = StopCutter(list(job.stops))
        text = cutter.push(result.text) + cutter.flush()
        usage = await asyncio.to_thread(front.usage, job, result, text, cutter.stopped)
        reason = front.finish_reason(job, usage, cutter.stopped)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason, "logprobs": None} if chat
                  else {"index": 0, "text": text, "finish_reason": reason, "logprobs": None})  # fmt: skip
        return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": job.route.id, "choices": [choice], "usage": usage, "specdeploy": front.extension(job, result, cutter.stopped)}  # fmt: skip

    async def _stream(job: Job, ident: str, chat: bool):
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()
        cutter = StopCutter(list(job.stops))
        done = object()
        outcome: dict = {}

        def work():
            try:
                outcome["result"] = front.run(job, on_text=lambda piece: loop.call_soon_threadsafe(pieces.put_nowait, piece))
            except BaseException as exc:  # reported to the client as an error event
                outcome["error"] = exc
            finally:
                loop.call_soon_threadsafe(pieces.put_nowait, done)

        kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def chunk(delta_text: str | None, reason: str | None = None, first: bool = False, extra: dict | None = None) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": delta_text} if delta_text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": reason, "logprobs": None}
            data = {"id": ident, "object": kind, "created": created, "model": job.route.id, "choices": [choice], **(extra or {})}
            return f"data: {json.dumps(data)}\n\n"

        threading.Thread(target=work, name="openai-stream", daemon=True).start()
        if chat:
            yield chunk(None, first=True)
        text = ""
        while True:
            piece = await pieces.get()
            if piece is done:
                break
            out = cutter.push(piece)
            if out:
                text += out
                yield chunk(out)
        if "error" in outcome:
            exc = outcome["error"]
            api = exc if isinstance(exc, ApiError) else ApiError(500, f"internal error: {exc}", "server_error")
            yield f"data: {json.dumps(api.body())}\n\n"
            yield "data: [DONE]\n\n"
            return
        tail = cutter.flush()
        if tail:
            text += tail
            yield chunk(tail)
        result = outcome["result"]
        usage = await asyncio.to_thread(front.usage, job, result, text, cutter.stopped)
        yield chunk(None, front.finish_reason(job, usage, cutter.stopped), extra={"specdeploy": front.extension(job, result, cutter.stopped)})
        if job.include_usage:
            data = {"id": ident, "object": kind, "created": created, "model": job.route.id, "choices": [], "usage": usage}
            yield f"data: {json.dumps(data)}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(request, chat=True)

    return app


# ---------------------------------------------------------------- running it


def deployment_max_tokens(recipe, option: int | None = None) -> int:
    """The most tokens one request may ask for: the engine's max_seq_len less one prompt token, or a lower option."""
    limit = recipe.engine.max_seq_len - 1
    if option is not None:
        if not 1 <= option <= limit:
            raise ConfigError(f"--max-tokens-limit is {option}, must be in [1, {limit}]", f"engine.max_seq_len is {recipe.engine.max_seq_len}")
        limit = option
    return limit


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to listen beyond loopback without an API key: anyone who reaches the port could use the deployment."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not api_key:
        raise ConfigError(f"the OpenAI front would listen on {host} (beyond this machine) without an API key",
                          f"pass --api-key KEY (or set ${API_KEY_ENV}), or keep the default host {HOST}")  # fmt: skip


def build_front(recipe, layout, grpc_url: str, timeout_s: float | None = None, api_key: str | None = None,
                max_body_bytes: int = MAX_BODY_BYTES, max_tokens_limit: int | None = None) -> Front:  # fmt: skip
    """A Front over the deployment at grpc_url with the recipe's routes and its repository's tokenizer."""
    from specdeploy.client.protocol import REQUIRED_MODELS
    from specdeploy.client.triton_adapter import TritonEndpoint
    from specdeploy.recipe_deployment import tokenizer_dir

    endpoint = TritonEndpoint(grpc_url)
    endpoint.check_ready(REQUIRED_MODELS)
    codec = Codec(tokenizer_dir(recipe, layout))
    return Front(endpoint, codec, routes(recipe), recipe.validation.max_tokens, recipe.speculative.num_draft_tokens,
                 timeout_s or recipe.validation.request_timeout_s, api_key=api_key, max_body_bytes=max_body_bytes,
                 max_tokens_limit=deployment_max_tokens(recipe, max_tokens_limit))  # fmt: skip


def _dial_host(host: str) -> str:
    return HOST if host in ("0.0.0.0", "::", "") else host  # a wildcard bind is reached on loopback


class ApiServer:
    """uvicorn on host:port (127.0.0.1 by default) in a background thread; `stop()` shuts it down."""

    def __init__(self, app, port: int, host: str = HOST):
        import uvicorn

        self.port, self.host = port, host
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, name="openai-api", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{_dial_host(self.host)}:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> "ApiServer":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError(f"the OpenAI front could not listen on {self.host}:{self.port}", "pick another --openai-port (is it taken?)")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


STATE_FILE = "openai.json"  # beside the server state of `serve --detach`
LOG_FILE = "openai.log"


def wait_listening(port: int, timeout_s: float, alive=lambda: True, host: str = HOST) -> bool:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        try:
            with urllib.request.urlopen(f"http://{_dial_host(host)}:{port}/health", timeout=1.0) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    return False


def start_detached(recipe_path: str, root: str | None, grpc_url: str, port: int, state_dir: Path, timeout_s: float = 120.0, echo=print,
                   host: str = HOST, api_key: str | None = None, request_timeout_s: float | None = None) -> int:  # fmt: skip
    """Start the front in its own process (`python -m specdeploy.openai_api`) and record it for `stop`.

    The API key goes to the child in its environment, never on its command line (which `ps` shows and
    the state file records)."""
    import subprocess
    import sys

    from specdeploy.artifacts import process_identity
    from specdeploy.errors import ServerError

    check_bind(host, api_key)
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    log = state_dir / LOG_FILE
    cmd = [sys.executable, "-m", "specdeploy.openai_api", str(recipe_path), "--grpc-url", grpc_url, "--port", str(port), "--host", host]
    if root:
        cmd += ["--root", str(root)]
    if request_timeout_s:
        cmd += ["--request-timeout", str(request_timeout_s)]
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    if api_key:
        env[API_KEY_ENV] = api_key
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    if not wait_listening(port, timeout_s, alive=lambda: process.poll() is None, host=host):
        process.kill()
        process.wait(timeout=5)
        tail = log.read_text()[-1500:] if log.is_file() else ""
        raise ServerError(f"the OpenAI front did not start on {host}:{port}:\n{tail}", f"full log: {log}")
    ident = process_identity(process.pid)
    (state_dir / STATE_FILE).write_text(json.dumps({"pid": process.pid, "port": port, "log": str(log),
                                                     "start_ticks": ident.start_ticks if ident else None,
                                                     "cmdline": list(ident.cmdline) if ident else cmd}))  # fmt: skip
    echo(f"  openai:  http://{_dial_host(host)}:{port}/v1 (pid {process.pid}, log {log})")
    return process.pid


def stop_detached(state_dir: Path) -> str | None:
    """Stop the front `start_detached` recorded in state_dir; None when there was none."""
    from specdeploy.artifacts import ProcessIdentity
    from specdeploy.triton.server import stop_pid

    path = Path(state_dir) / STATE_FILE
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    stop_pid(state["pid"], timeout_s=10, expected=ProcessIdentity(state["pid"], state.get("start_ticks"), tuple(state.get("cmdline") or ())))
    path.unlink(missing_ok=True)
    return f"stopped the OpenAI front (pid {state['pid']})"


def serve_foreground(front: Front, port: int, echo=print, stop: threading.Event | None = None, host: str = HOST) -> None:
    """Serve the front on host:port (127.0.0.1 by default) until Ctrl-C (or `stop` is set); says where once it listens."""
    check_bind(host, front.api_key)
    server = ApiServer(create_app(front), port, host).start()  # listening before it says so (a taken port fails here)
    echo(f"  openai:  {server.url} (Ctrl-C stops it and the server)")
    try:
        while server.thread.is_alive() and not (stop is not None and stop.is_set()):
            server.thread.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    """`python -m specdeploy.openai_api RECIPE --grpc-url H:P --port N [--host H] [--root DIR]` (what `serve --detach --openai-port` runs);
    the API key comes from $SPECDEPLOY_API_KEY (or --api-key)."""
    from specdeploy.artifacts import Layout
    from specdeploy.config import load_recipe

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("recipe")
    parser.add_argument("--grpc-url", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default=HOST)
    parser.add_argument("--root", default=None)
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None)
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    parser.add_argument("--max-tokens-limit", type=int, default=None)
    parser.add_argument("--request-timeout", type=float, default=None, help="deadline of each Triton call, s [recipe validation.request_timeout_s]")
    args = parser.parse_args(argv)
    check_bind(args.host, args.api_key)
    recipe = load_recipe(args.recipe)
    front = build_front(recipe, Layout.of(recipe, args.root), args.grpc_url, timeout_s=args.request_timeout, api_key=args.api_key,
                        max_body_bytes=args.max_body_bytes, max_tokens_limit=args.max_tokens_limit)  # fmt: skip
    import uvicorn

    uvicorn.run(create_app(front), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
