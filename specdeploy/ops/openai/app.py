"""The OpenAI-compatible FastAPI app: the API-key and body-size guards, OpenAI's error format for every error, the
model list, and the completion routes (whole answers, and server-sent events as Triton's responses arrive).
`Front` holds what the routes need (the Triton endpoint, the codec, the routes, the limits) and answers for one job.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request  # module level: FastAPI resolves the handlers' (string) annotations here

from specdeploy.client.protocol import GenerateRequest, GenerateResult
from specdeploy.core.errors import ClientError
from specdeploy.core.text_rules import TOO_DEEP, TextError, decode_text
from specdeploy.ops.openai.requests import ApiError, Codec, Job, Route, from_client_error, parse_job, text_refusal

API_KEY_ENV = "SPECDEPLOY_API_KEY"
MAX_BODY_BYTES = 1 << 20  # 1 MiB: a prompt this front accepts (engine.max_input_len tokens) is far smaller
OPEN_PATHS = ("/health",)  # reachable without the API key (load balancers, `wait_listening`)
MAX_WAITING = 256  # whole answers waiting for Triton at once (beyond any engine's batch; Triton queues the rest)


class StopCutter:
    """Cuts streamed text before the first stop string, as the whole answer would be cut: at the stop that starts first.
    Text that could still begin a stop is held back until it does or cannot; a stop that completed is the cut only
    once no stop starting before it can still complete (with "\nObservation:" and "Observation" both stops, text
    ending in "\nObservation" waits: the longer one starts first)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0
        self.stopped = False

    def _first_complete(self) -> int:
        return min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)

    def _first_partial(self) -> int:
        """The earliest position from which the text up to its end begins a stop it has not completed (len: none)."""
        n = len(self.text)
        starts = [
            p for s in self.stops for p in range(max(self.sent, n - len(s) + 1), n) if s.startswith(self.text[p:])
        ]
        return min(starts, default=n)

    def _cut(self, at: int) -> str:
        self.stopped = True
        out, self.sent = self.text[self.sent : at], at
        self.text = self.text[:at]
        return out

    def push(self, piece: str) -> str:
        if self.stopped:
            return ""
        self.text += piece
        cut, partial = self._first_complete(), self._first_partial()
        if cut >= 0 and cut <= partial:
            return self._cut(cut)
        limit = partial if cut < 0 else min(cut, partial)
        out, self.sent = self.text[self.sent : limit], max(self.sent, limit)
        return out

    def flush(self) -> str:
        """The end of the answer: a stop that completed is the cut (the longer one that started before it never did)."""
        if self.stopped:
            return ""
        cut = self._first_complete()
        if cut >= 0:
            return self._cut(cut)
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


class Front:
    """What the routes need: the Triton endpoint, the codec, the routes, the defaults."""

    def __init__(
        self,
        endpoint,
        codec: Codec,
        served: dict[str, Route],
        default_max_tokens: int,
        num_draft_tokens: int,
        timeout_s: float,
        api_key: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_tokens_limit: int | None = None,
        max_seq_len: int | None = None,
    ):
        self.endpoint, self.codec, self.served = endpoint, codec, served
        self.max_seq_len = max_seq_len  # the engine's: an answer that fills it was cut there ("length")
        self.default_max_tokens, self.num_draft_tokens, self.timeout_s = default_max_tokens, num_draft_tokens, timeout_s
        self.api_key = api_key or None  # an empty key (an empty env var) means none
        self.max_body_bytes, self.max_tokens_limit = max_body_bytes, max_tokens_limit
        self.created = int(time.time())
        # whole answers wait for Triton in threads of their own: in asyncio's default pool (cores + 4 threads, 6 on a
        # 2-core machine) they held every thread, capped the requests in flight below the server's batch and queued
        # every other request's parsing behind them (a streamed answer has a thread of its own)
        self.waiting = ThreadPoolExecutor(max_workers=MAX_WAITING, thread_name_prefix="openai-wait")

    def auth_error(self, authorization: str | None) -> ApiError | None:
        """None when the request may pass: no key configured, or `Authorization: Bearer <key>` matches."""
        if self.api_key is None:
            return None
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return ApiError(
                401,
                "You didn't provide an API key: send the header 'Authorization: Bearer <key>' "
                f"(the key this server was started with, --api-key or ${API_KEY_ENV})",
                code="missing_api_key",
            )
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
            # the server stops at a stop string's tokens too (NVIDIA's stop_words: the string tokenized alone), so a
            # request does not run on to max_tokens after it; the text is still cut here, where the tokens differ
            stop_words=tuple(job.stops),
        )

    def run(self, job: Job, on_text=None) -> GenerateResult:
        try:
            return self.endpoint.generate(job.route.triton_model, self.request(job), self.timeout_s, on_text=on_text)
        except ClientError as exc:
            raise from_client_error(exc) from exc

    def usage(self, job: Job, result: GenerateResult | None, text: str, cut: bool) -> dict:
        prompt_tokens = self.codec.count_prompt(job.prompt)
        if result is not None and result.output_tokens is not None and not cut:  # the server's own count
            completion = result.output_tokens
        else:
            completion = self.codec.count_output(text)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

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
            "server_decode_s": (
                perf.server_decode_s if perf is not None else None
            ),  # first -> last token on the server's clock
            "completion_tokens_exact": result is not None and result.output_tokens is not None and not cut,
            "k_history": (
                result.k_history if result is not None else None
            ),  # draft length per round, where the BLS returns it
            # beside it, seconds of each round's draft work and target call (validate's round profile)
            "draft_s_history": result.draft_s_history if result is not None else None,
            "target_s_history": result.target_s_history if result is not None else None,
        }

    def finish_reason(self, job: Job, usage: dict, cut: bool) -> str:
        """ "stop" where a stop string or the end token ended it; "length" where max_tokens did, or max_seq_len (the
        deployment gives a request whose prompt and max_tokens pass it the tokens that fit, as TensorRT-LLM does)."""
        if cut:
            return "stop"
        full = self.max_seq_len is not None and usage["total_tokens"] >= self.max_seq_len
        return "length" if full or usage["completion_tokens"] >= job.max_tokens else "stop"


def create_app(front: Front):
    """The FastAPI app over `front`: guards, error handlers, routes. FastAPI's /docs and /openapi.json are off."""
    from fastapi import FastAPI

    app = FastAPI(title="specdeploy OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    _add_guard(app, front)
    _add_error_handlers(app)
    _add_routes(app, front)
    return app


def _add_guard(app, front: Front) -> None:
    """The API key (every path but OPEN_PATHS) and the declared body size, checked before a route runs."""
    from fastapi.responses import JSONResponse

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        if request.url.path not in OPEN_PATHS:
            error = front.auth_error(request.headers.get("authorization"))
            if error is not None:
                return JSONResponse(error.body(), status_code=error.status, headers={"WWW-Authenticate": "Bearer"})
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > front.max_body_bytes:
            return JSONResponse(_too_large(front, int(length)).body(), status_code=413)
        return await call_next(request)


def _too_large(front: Front, size: int | None) -> ApiError:
    got = f"{size} bytes" if size is not None else "larger"
    return ApiError(
        413,
        f"the request body is {got}, above this server's limit of {front.max_body_bytes} bytes (--max-body-bytes)",
        code="request_too_large",
    )


def _add_error_handlers(app) -> None:
    """Every error in OpenAI's format: ours, Starlette's (unknown path, wrong method), and any other as a 500."""
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)  # unknown path, wrong method: OpenAI's error format, not FastAPI's {"detail"}
    async def _http_error(request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(
            ApiError(exc.status_code, message, code=code).body(), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        return JSONResponse(
            ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").body(), status_code=500
        )


def _add_routes(app, front: Front) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models():
        data = [
            {
                "id": r.id,
                "object": "model",
                "created": front.created,
                "owned_by": "specdeploy",
                "specdeploy": {"path": r.path, "triton_model": r.triton_model},
            }
            for r in front.served.values()
        ]
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str):
        if model_id not in front.served:
            raise ApiError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
        r = front.served[model_id]
        return {"id": r.id, "object": "model", "created": front.created, "owned_by": "specdeploy"}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(front, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(front, request, chat=True)


async def _read_body(front: Front, request: Request):
    raw = bytearray()
    async for piece in request.stream():  # a chunked body has no Content-Length: count what arrives
        raw += piece
        if len(raw) > front.max_body_bytes:
            raise _too_large(front, None)
    try:
        text = decode_text(bytes(raw), "body", front.max_body_bytes)  # JSON is UTF-8 (RFC 8259 section 8.1)
    except TextError as exc:
        raise text_refusal(exc) from None
    try:
        return json.loads(text)
    except RecursionError:
        raise ApiError(400, "the request body nests JSON too deeply", code=TOO_DEEP) from None
    except ValueError:
        raise ApiError(400, "the request body is not valid JSON") from None


async def _complete(front: Front, request: Request, chat: bool):
    from fastapi.responses import StreamingResponse

    job = await asyncio.to_thread(
        parse_job,
        await _read_body(front, request),
        chat,
        front.served,
        front.codec,
        front.default_max_tokens,
        front.max_tokens_limit,
    )
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    if job.stream:
        return StreamingResponse(_stream(front, job, ident, chat), media_type="text/event-stream")
    result = await asyncio.get_running_loop().run_in_executor(front.waiting, front.run, job)
    cutter = StopCutter(list(job.stops))
    text = cutter.push(result.text) + cutter.flush()
    usage = await asyncio.to_thread(front.usage, job, result, text, cutter.stopped)
    reason = front.finish_reason(job, usage, cutter.stopped)
    choice = (
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason, "logprobs": None}
        if chat
        else {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
    )
    return {
        "id": ident,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": job.route.id,
        "choices": [choice],
        "usage": usage,
        "specdeploy": front.extension(job, result, cutter.stopped),
    }


class _Abandoned(Exception):
    """Raised in a stream's Triton callback once nobody reads it (a stop string ended it, or the client went away)."""


async def _stream(front: Front, job: Job, ident: str, chat: bool):
    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue = asyncio.Queue()
    cutter = StopCutter(list(job.stops))
    done = object()
    outcome: dict = {}
    # set when the rest of the answer is not wanted: the stream's next response raises in the callback, and the
    # endpoint's stream ends with cancel_requests=True (TritonEndpoint._stream), so the server frees the request's
    # slot instead of generating to max_tokens for no one
    abandoned = threading.Event()

    def on_text(piece: str) -> None:
        if abandoned.is_set():
            raise _Abandoned()
        loop.call_soon_threadsafe(pieces.put_nowait, piece)

    def work():
        try:
            outcome["result"] = front.run(job, on_text=on_text)
        except BaseException as exc:  # reported to the client as an error event (unless abandoned)
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
        data = {
            "id": ident,
            "object": kind,
            "created": created,
            "model": job.route.id,
            "choices": [choice],
            **(extra or {}),
        }
        return f"data: {json.dumps(data)}\n\n"

    threading.Thread(target=work, name="openai-stream", daemon=True).start()
    try:  # the client may go away at any yield: the finally abandons the Triton request
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
            if cutter.stopped:  # a stop string: the answer is complete, the rest of the generation is not wanted
                abandoned.set()
                break
        if "error" in outcome and not cutter.stopped:  # once stopped, the abandoned request's end is no error
            exc = outcome["error"]
            api = exc if isinstance(exc, ApiError) else ApiError(500, f"internal error: {exc}", "server_error")
            yield f"data: {json.dumps(api.body())}\n\n"
            yield "data: [DONE]\n\n"
            return
        tail = cutter.flush()
        if tail:
            text += tail
            yield chunk(tail)
        result = outcome.get("result")  # None: stopped before the server finished (the usage is counted on the text)
        usage = await asyncio.to_thread(front.usage, job, result, text, cutter.stopped)
        yield chunk(
            None,
            front.finish_reason(job, usage, cutter.stopped),
            extra={"specdeploy": front.extension(job, result, cutter.stopped)},
        )
        if job.include_usage:
            data = {
                "id": ident,
                "object": kind,
                "created": created,
                "model": job.route.id,
                "choices": [],
                "usage": usage,
            }
            yield f"data: {json.dumps(data)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        abandoned.set()
