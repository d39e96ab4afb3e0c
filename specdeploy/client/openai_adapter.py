"""`Endpoint` over the OpenAI-compatible front (`specdeploy.openai_api`): what `validate --protocol openai`
and load through the front use.

The core's model names map to the front's model ids: `tensorrt_llm_bls` -> `<recipe>-speculative`
(the front then sends its `num_draft_tokens`; a request without num_draft_tokens goes to `<recipe>-canary`,
where the canary share applies), `ensemble` -> `<recipe>-control`. Prompts go to
`/v1/completions` as text, exactly as the Triton path sends `text_input`, with `temperature: 0` for
greedy. The server-side figures come back in the front's `specdeploy` extension field (draft tokens,
accepted, server TTFT and decode time, k per round). The control's exact tokens (`trace`) and the
served configs need the Triton deployment under the front: pass its gRPC endpoint as `triton`
(None: parity falls back to the text, and the report says so). Standard library HTTP only.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Sequence

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
from specdeploy.errors import ClientError


def base_url(url: str) -> str:
    """host:port, http://host:port or http://host:port/v1 -> http://host:port/v1."""
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


class OpenAIEndpoint:
    """The OpenAI front at `url`, serving `recipe_name`'s model ids; `triton`: the deployment under it (optional)."""

    def __init__(self, url: str, recipe_name: str, triton=None, num_draft_tokens: int | None = None):
        self.url = base_url(url)
        self.recipe_name = recipe_name
        self.triton = triton
        self.ids = {SPECULATIVE_MODEL: f"{recipe_name}-speculative", CONTROL_MODEL: f"{recipe_name}-control"}
        self.num_draft_tokens = num_draft_tokens

    # ------------------------------------------------------------ http

    def _http(self, method: str, path: str, body: dict | None, timeout_s: float):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(request, timeout=timeout_s)
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read().decode())["error"]["message"]
            except Exception:  # not OpenAI's error format
                message = str(exc)
            hint = "raise validation.request_timeout_s or check the server log" if exc.code == 504 else "see the front's and the server's logs"
            raise ClientError(f"the OpenAI front at {self.url} answered {exc.code} on {path}: {message[:400]}", hint) from None
        except (urllib.error.URLError, OSError) as exc:
            if "timed out" in str(exc):
                raise ClientError(f"a request to the OpenAI front at {self.url} timed out after {timeout_s:.0f} s",
                                  "raise validation.request_timeout_s or check the server log") from None  # fmt: skip
            raise ClientError(f"the OpenAI front at {self.url} is unreachable: {exc}",
                              "start it (specdeploy serve RECIPE --openai-port N) or check --openai-url") from None  # fmt: skip

    # ------------------------------------------------------------ Endpoint

    def check_ready(self, models: Sequence[str]) -> None:
        via_front = [m for m in models if m in self.ids]
        if via_front:
            with self._http("GET", "/models", None, 10) as response:
                served = {m["id"] for m in json.loads(response.read().decode()).get("data", [])}
            for model in via_front:
                if self.ids[model] not in served:
                    raise ClientError(f"the OpenAI front at {self.url} does not serve '{self.ids[model]}' (it serves: {', '.join(sorted(served))})",
                                      "start the front for this recipe (specdeploy serve RECIPE --openai-port N)")  # fmt: skip
        rest = [m for m in models if m not in self.ids]
        if rest:
            if self.triton is None:
                raise ClientError(f"{', '.join(rest)} can only be reached over Triton, not through the OpenAI front",
                                  "pass the deployment's gRPC address too (--url host:port)")  # fmt: skip
            self.triton.check_ready(rest)

    def is_decoupled(self, model: str) -> bool:
        return self.triton.is_decoupled(model) if self.triton is not None else False

    def model_parameters(self, model: str) -> dict[str, str]:
        if self.triton is None:
            raise ClientError("the OpenAI front shows no model configs", "pass the deployment's gRPC address too (--url host:port)")
        return self.triton.model_parameters(model)

    def body(self, model: str, request: GenerateRequest) -> dict:
        if model not in self.ids:
            raise ClientError(f"the OpenAI front serves no path for the Triton model '{model}'", "use tensorrt_llm_bls or ensemble")
        ident = self.ids[model]
        if model == SPECULATIVE_MODEL and request.num_draft_tokens is None:
            ident = f"{self.recipe_name}-canary"  # no num_draft_tokens: the deployment's canary share applies (as over Triton)
        body: dict = {"model": ident, "prompt": request.prompt, "max_tokens": request.max_tokens, "stream": request.stream}
        if request.sampling is None:
            body["temperature"] = 0
        else:
            s = request.sampling
            if s.top_k:
                raise ClientError("the OpenAI API has no top_k", "compare sampling over the Triton protocol (--protocol triton) or with --top-p")
            body.update(temperature=s.temperature, top_p=s.top_p or 1.0)
            if s.seed is not None:
                body["seed"] = int(s.seed)
        if request.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def generate(self, model: str, request: GenerateRequest, timeout_s: float, on_text=None) -> GenerateResult:
        if request.num_draft_tokens is not None and self.num_draft_tokens is not None and request.num_draft_tokens != self.num_draft_tokens:
            raise ClientError(f"the OpenAI front always sends num_draft_tokens={self.num_draft_tokens}; this run asks for {request.num_draft_tokens}",
                              "sweep draft lengths over the Triton protocol (--protocol triton)")  # fmt: skip
        body = self.body(model, request)
        start = time.perf_counter()
        pieces, first_s, ext = [], None, {}
        with self._http("POST", "/completions", body, timeout_s) as response:
            if not request.stream:
                data = json.loads(response.read().decode())
                pieces.append(data["choices"][0]["text"])
                ext = data.get("specdeploy") or {}
            else:
                for raw in response:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    data = json.loads(payload)
                    if "error" in data:
                        raise ClientError(f"the OpenAI front at {self.url} reported: {data['error'].get('message')}", "see the server log")
                    for choice in data.get("choices", []):
                        if choice.get("text"):
                            pieces.append(choice["text"])
                            if on_text is not None:
                                on_text(choice["text"])
                            first_s = first_s or time.perf_counter()
                    ext = data.get("specdeploy") or ext
        done = time.perf_counter()
        text = "".join(pieces)
        if on_text is not None and not request.stream:
            on_text(text)
        perf = PerfMetrics(total_draft_tokens=ext.get("draft_tokens"), total_accepted_draft_tokens=ext.get("accepted_draft_tokens"),
                           acceptance_rate=ext.get("acceptance_rate"))  # fmt: skip
        if request.stream and first_s is not None:
            ttft, decode, source = first_s - start, done - first_s, TIMING_STREAM
        elif ext.get("server_ttft_s") is not None:
            ttft, decode, source = ext["server_ttft_s"], ext.get("server_decode_s"), TIMING_SERVER
        else:
            ttft, decode, source = None, None, None
        ids = ext.get("output_ids")
        return GenerateResult(text, done - start, ttft, source, decode, max(1, len(pieces)), perf, ids, ext.get("k_history"))

    def trace(self, prompt: str, max_tokens: int, timeout_s: float, with_logits: bool = True) -> TargetTrace:
        if self.triton is None:
            raise ClientError("the target alone is not reachable through the OpenAI front", "pass the deployment's gRPC address too (--url host:port)")
        return self.triton.trace(prompt, max_tokens, timeout_s, with_logits)

    def close(self) -> None:
        if self.triton is not None:
            self.triton.close()
