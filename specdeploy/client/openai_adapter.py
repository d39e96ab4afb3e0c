"""`Endpoint` over an OpenAI-compatible API: specdeploy's front (`specdeploy.ops.openai.api`), trtllm-serve or vLLM
(`/v1/models` and `/v1/completions`: NVIDIA/TensorRT-LLM@e7f7345 tensorrt_llm/serve/openai_server.py, register_routes).

The core's model names map to model ids: for specdeploy's front `tensorrt_llm_bls` -> `<recipe>-speculative`
(the front then sends its `num_draft_tokens`; a request without num_draft_tokens goes to `<recipe>-canary`,
where the canary share applies), `ensemble` -> `<recipe>-control`; for any other server the ids given
(`ids`), the control possibly on a server of its own (`control_url`). Prompts go to `/v1/completions` as
text, exactly as the Triton path sends `text_input`, with `temperature: 0` for greedy. specdeploy's front
returns server-side figures in its `specdeploy` extension field (draft tokens, accepted, server TTFT and
decode time, k per round); llama.cpp its draft counts in `timings` (`client/runtime_counters.py`); every server its
`usage`. What a server does not return the report lists as not checked. The control's exact tokens (`trace`) and the
served configs need the Triton deployment under the front: pass its gRPC endpoint as `triton` (None: parity falls back
to the text). Standard library HTTP only."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.request
from typing import Sequence

from specdeploy.client import runtime_counters
from specdeploy.client.protocol import (
    CONTROL_MODEL,
    SPECULATIVE_MODEL,
    TIMING_SERVER,
    TIMING_STREAM,
    GenerateRequest,
    GenerateResult,
    PerfMetrics,
    TargetTrace,
)
from specdeploy.core.errors import ClientError


def base_url(url: str) -> str:
    """host:port, http://host:port or http://host:port/v1 -> http://host:port/v1."""
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


# The key a front with an API key wants (specdeploy's front: --api-key / SPECDEPLOY_API_KEY; trtllm-serve and vLLM
# read OpenAI's own variable), sent on every request as OpenAI's clients do.
API_KEY_ENVS = ("SPECDEPLOY_API_KEY", "OPENAI_API_KEY")


def api_key() -> str | None:
    return next((os.environ[name] for name in API_KEY_ENVS if os.environ.get(name)), None)


@contextlib.contextmanager
def _answer_errors(base: str, path: str, timeout_s: float):
    """Reading and parsing an answer: a connection that drops or stalls mid-body, or a body that is not OpenAI's JSON,
    is a ClientError (validate records it as a fault and writes its report), not an exception that escapes."""
    try:
        yield
    except ClientError:
        raise
    except (TimeoutError, socket.timeout) as exc:
        raise ClientError(
            f"a request to the OpenAI API at {base} timed out after {timeout_s:.0f} s while its answer came ({exc})",
            "raise validation.request_timeout_s or check the server log",
        ) from None
    except (OSError, http.client.HTTPException) as exc:
        raise ClientError(
            f"the OpenAI API at {base} went away while answering {path}: {type(exc).__name__}: {exc}",
            "check the front's and the server's logs",
        ) from None
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise ClientError(
            f"{base}{path} did not answer as an OpenAI API does ({type(exc).__name__}: {exc})",
            "check --url / --openai-url: it must be an OpenAI-compatible base URL such as http://HOST:8000/v1",
        ) from None


SPECDEPLOY_SOURCE = "specdeploy front's specdeploy.draft_tokens / accepted_draft_tokens (per response)"


def _perf(ext: dict, timings: dict | None) -> PerfMetrics:
    """The answer's draft counts: specdeploy's extension field, else llama.cpp's timings, else none."""
    if ext.get("draft_tokens") is not None:
        return PerfMetrics(
            total_draft_tokens=ext["draft_tokens"],
            total_accepted_draft_tokens=ext.get("accepted_draft_tokens"),
            acceptance_rate=ext.get("acceptance_rate"),
            source=SPECDEPLOY_SOURCE,
        )
    counts = runtime_counters.from_llama_timings(timings)
    if counts is None:
        return PerfMetrics(acceptance_rate=ext.get("acceptance_rate"))
    drafted, accepted = counts
    return PerfMetrics(
        total_draft_tokens=drafted,
        total_accepted_draft_tokens=accepted,
        acceptance_rate=accepted / drafted if drafted else None,
        source=runtime_counters.LLAMA_SOURCE,
    )


class OpenAIEndpoint:
    """The OpenAI-compatible API at `url`. Model ids: specdeploy's front for `recipe_name`, or `ids` (core name ->
    model id; a missing one is resolved from `/v1/models` by `check_ready`); `control_url`: the control's own
    server; `triton`: the Triton deployment under specdeploy's front (optional)."""

    def __init__(
        self,
        url: str,
        recipe_name: str | None = None,
        triton=None,
        num_draft_tokens: int | None = None,
        *,
        ids: dict | None = None,
        canary_id: str | None = None,
        control_url: str | None = None,
    ):
        self.url = base_url(url)
        self.urls = {SPECULATIVE_MODEL: self.url, CONTROL_MODEL: base_url(control_url) if control_url else self.url}
        self.triton = triton
        self.ids = dict(ids or {})
        self.canary_id = canary_id
        if recipe_name is not None:
            self.ids = {SPECULATIVE_MODEL: f"{recipe_name}-speculative", CONTROL_MODEL: f"{recipe_name}-control"}
            self.canary_id = f"{recipe_name}-canary"
        self.num_draft_tokens = num_draft_tokens
        # the metrics endpoint is Triton's (specdeploy's front): its labels are the Triton names
        self.served_names: dict = {}

    # ------------------------------------------------------------ http

    def _http(self, method: str, path: str, body: dict | None, timeout_s: float, base: str | None = None):
        base = base or self.url
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        key = api_key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(base + path, data=data, method=method, headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=timeout_s)
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read().decode())["error"]["message"]
            except Exception:  # not OpenAI's error format
                message = str(exc)
            if exc.code == 504:
                hint = "raise validation.request_timeout_s or check the server log"
            elif exc.code == 401:  # the key comes from the environment, as OpenAI's clients take it
                hint = (
                    f"set {' or '.join(API_KEY_ENVS)} to the key the front was started with"
                    if api_key() is None
                    else f"the key in ${next(n for n in API_KEY_ENVS if os.environ.get(n))} is not the front's"
                )
            else:
                hint = "see the front's and the server's logs"
            raise ClientError(
                f"the OpenAI API at {base} answered {exc.code} on {path}: {message[:400]}", hint
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            if "timed out" in str(exc):
                raise ClientError(
                    f"a request to the OpenAI API at {base} timed out after {timeout_s:.0f} s",
                    "raise validation.request_timeout_s or check the server log",
                ) from None
            raise ClientError(
                f"the OpenAI API at {base} is unreachable: {exc}",
                "start it (specdeploy serve RECIPE --openai-port N) or check the address (--url, --openai-url,"
                " --control-url)",
            ) from None

    # ------------------------------------------------------------ Endpoint

    def served_models(self, base: str) -> list[str]:
        with self._http("GET", "/models", None, 10, base) as response, _answer_errors(base, "/models", 10):
            return [m["id"] for m in json.loads(response.read().decode()).get("data", [])]

    def check_ready(self, models: Sequence[str]) -> None:
        via_api = [m for m in models if m in (SPECULATIVE_MODEL, CONTROL_MODEL)]
        for model in via_api:
            served = self.served_models(self.urls[model])
            if model not in self.ids:
                self._resolve(model, served)
            if self.ids[model] not in served:
                raise ClientError(
                    f"the OpenAI API at {self.urls[model]} does not serve '{self.ids[model]}' (it serves:"
                    f" {', '.join(sorted(served))})",
                    "name a served model: --speculative-model ID / --control-model ID (specdeploy's front: "
                    "specdeploy serve RECIPE --openai-port N)",
                )
        rest = [m for m in models if m not in via_api]
        if rest:
            if self.triton is None:
                raise ClientError(
                    f"{', '.join(rest)} can only be reached over Triton, not through the OpenAI API",
                    "pass the deployment's gRPC address too (--url host:port)",
                )
            self.triton.check_ready(rest)

    def _resolve(self, model: str, served: list[str]) -> None:
        """The model id not given: specdeploy's front pair `<name>-speculative` / `<name>-control`, else the one model
        a server serves (the control only when it has a server of its own)."""
        pairs = [
            i[: -len("-speculative")]
            for i in served
            if i.endswith("-speculative") and i[: -len("-speculative")] + "-control" in served
        ]
        option = "--speculative-model" if model == SPECULATIVE_MODEL else "--control-model"
        if len(pairs) == 1 and self.urls[SPECULATIVE_MODEL] == self.urls[CONTROL_MODEL]:
            name = pairs[0]
            self.ids.setdefault(SPECULATIVE_MODEL, f"{name}-speculative")
            self.ids.setdefault(CONTROL_MODEL, f"{name}-control")
            if self.canary_id is None and f"{name}-canary" in served:
                self.canary_id = f"{name}-canary"
        elif len(served) == 1 and (
            model == SPECULATIVE_MODEL or self.urls[CONTROL_MODEL] != self.urls[SPECULATIVE_MODEL]
        ):
            self.ids[model] = served[0]
        else:
            raise ClientError(
                f"which model of the OpenAI API at {self.urls[model]} is the"
                f" {'speculative path' if model == SPECULATIVE_MODEL else 'control'}? It serves:"
                f" {', '.join(sorted(served)) or 'nothing'}",
                f"pass {option} ID"
                + (
                    ""
                    if model == SPECULATIVE_MODEL
                    else " (the target alone), or --control-url for a server of its own"
                ),
            )

    def describe(self) -> dict:
        """What the run talked to, per path: the base URL and the model id (after `check_ready` resolved it)."""
        return {
            path: {"url": self.urls[model], "model": self.ids.get(model)}
            for path, model in (("speculative", SPECULATIVE_MODEL), ("control", CONTROL_MODEL))
        }

    def is_decoupled(self, model: str) -> bool:
        return self.triton.is_decoupled(model) if self.triton is not None else False

    def model_parameters(self, model: str) -> dict[str, str]:
        if self.triton is None:
            raise ClientError(
                "the OpenAI front shows no model configs", "pass the deployment's gRPC address too (--url host:port)"
            )
        return self.triton.model_parameters(model)

    def body(self, model: str, request: GenerateRequest) -> dict:
        if model not in (SPECULATIVE_MODEL, CONTROL_MODEL):
            raise ClientError(
                f"the OpenAI API serves no path for the Triton model '{model}'", "use tensorrt_llm_bls or ensemble"
            )
        if model not in self.ids:
            self.check_ready([model])
        ident = self.ids[model]
        if model == SPECULATIVE_MODEL and request.num_draft_tokens is None and self.canary_id:
            ident = self.canary_id  # no num_draft_tokens: the deployment's canary share applies (as over Triton)
        body: dict = {
            "model": ident,
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "stream": request.stream,
        }
        if request.sampling is None:
            body["temperature"] = 0
        else:
            s = request.sampling
            if s.top_k:
                raise ClientError(
                    "the OpenAI API has no top_k",
                    "compare sampling over the Triton protocol (--protocol triton) or with --top-p",
                )
            body.update(temperature=s.temperature, top_p=s.top_p or 1.0)
            if s.seed is not None:
                body["seed"] = int(s.seed)
        if request.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def generate(self, model: str, request: GenerateRequest, timeout_s: float, on_text=None) -> GenerateResult:
        if (
            request.num_draft_tokens is not None
            and self.num_draft_tokens is not None
            and request.num_draft_tokens != self.num_draft_tokens
        ):
            raise ClientError(
                f"the OpenAI front always sends num_draft_tokens={self.num_draft_tokens}; this run asks for"
                f" {request.num_draft_tokens}",
                "sweep draft lengths over the Triton protocol (--protocol triton)",
            )
        body = self.body(model, request)
        start = time.perf_counter()
        pieces, first_s, ext, timings, usage = [], None, {}, None, None
        with (
            self._http("POST", "/completions", body, timeout_s, self.urls[model]) as response,
            _answer_errors(self.urls[model], "/completions", timeout_s),
        ):
            if not request.stream:
                data = json.loads(response.read().decode())
                pieces.append(data["choices"][0]["text"])
                ext, timings, usage = data.get("specdeploy") or {}, data.get("timings"), data.get("usage")
            else:
                ended = False
                for raw in response:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        ended = True
                        break
                    data = json.loads(payload)
                    if "error" in data:
                        raise ClientError(
                            f"the OpenAI API at {self.urls[model]} reported: {data['error'].get('message')}",
                            "see the server log",
                        )
                    for choice in data.get("choices", []):
                        if choice.get("text"):
                            pieces.append(choice["text"])
                            if on_text is not None:
                                on_text(choice["text"])
                            first_s = first_s or time.perf_counter()
                    ext = data.get("specdeploy") or ext
                    timings = data.get("timings") or timings  # llama.cpp: on the last chunks
                    usage = data.get("usage") or usage  # the final chunk (stream_options.include_usage)
                if not ended:  # the stream stopped before its end: what came is not an answer
                    raise ClientError(
                        f"the OpenAI API at {self.urls[model]} ended a stream without 'data: [DONE]' after "
                        f"{len(pieces)} chunks",
                        "see the front's and the server's logs",
                    )
        done = time.perf_counter()
        text = "".join(pieces)
        if on_text is not None and not request.stream:
            on_text(text)
        perf = _perf(ext, timings)
        if request.stream and first_s is not None:
            ttft, decode, source = first_s - start, done - first_s, TIMING_STREAM
        elif ext.get("server_ttft_s") is not None:
            ttft, decode, source = ext["server_ttft_s"], ext.get("server_decode_s"), TIMING_SERVER
        else:
            ttft, decode, source = None, None, None
        ids = ext.get("output_ids")
        completion = (usage or {}).get("completion_tokens")
        completion = int(completion) if isinstance(completion, (int, float)) else None
        return GenerateResult(
            text,
            done - start,
            ttft,
            source,
            decode,
            max(1, len(pieces)),
            perf,
            ids,
            ext.get("k_history"),
            ext.get("draft_s_history"),
            ext.get("target_s_history"),
            usage_tokens=completion,
        )

    def trace(self, prompt: str, max_tokens: int, timeout_s: float, with_logits: bool = True) -> TargetTrace:
        if self.triton is None:
            raise ClientError(
                "the target alone is not reachable through the OpenAI API",
                "pass the deployment's gRPC address too (--url host:port)",
            )
        return self.triton.trace(prompt, max_tokens, timeout_s, with_logits)

    def close(self) -> None:
        if self.triton is not None:
            self.triton.close()
