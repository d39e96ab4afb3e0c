"""The one module that speaks Triton: `Endpoint` over tritonclient gRPC.

Maps `GenerateRequest` to the inflight_batcher_llm tensor names (`text_input`, `max_tokens`,
`num_draft_tokens`, `stream`, `return_perf_metrics`, ...), and every failure to a ClientError
that says what to do. Every call carries a deadline (`client_timeout` / `stream_timeout`), so a
dead or stuck server ends a run instead of hanging it. Decoupled models are called through the
gRPC stream API (required by Triton for them), which also gives a client-side TTFT.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Sequence

import numpy as np

from specdeploy.client.protocol import (
    PREPROCESSING_MODEL,
    TARGET_MODEL,
    TIMING_SERVER,
    TIMING_STREAM,
    GenerateRequest,
    GenerateResult,
    PerfMetrics,
    TargetTrace,
)
from specdeploy.core.errors import ClientError

CONNECT_TIMEOUT_S = 5.0
K_HISTORY_OUTPUT = "speculative_k_history"  # optional BLS output: INT32 [-1], draft length per round (0: plain step)
# optional BLS outputs beside it: FP32 [-1], seconds of each round's draft work and target call
ROUND_SECONDS_OUTPUTS = ("speculative_draft_seconds", "speculative_target_seconds")
PERF_OUTPUTS = (
    "total_draft_tokens",
    "total_accepted_draft_tokens",
    "acceptance_rate",
    "arrival_time_ns",
    "first_token_time_ns",
    "last_token_time_ns",
)


def _tc():
    # Before grpc starts: its fork handlers can block a later fork (the tritonserver a process starts) forever while a
    # channel's threads are busy (grpc/grpc#37259); every fork specdeploy makes is followed by exec, the case grpc
    # documents this switch for (doc/fork_support.md).
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    return grpcclient, InferenceServerException


REPO_HINT = "regenerate the repository (specdeploy repo RECIPE) and restart the server"


class TritonEndpoint:
    """A Triton server at `url` (host:port of its gRPC endpoint). `names`: the core's model names -> the served
    ones (default the same); `missing_hint`: what to do when a model is missing."""

    def __init__(
        self,
        url: str,
        names: dict[str, str] | None = None,
        missing_hint: str | None = None,
        speculative_inputs: dict[str, bool] | None = None,
    ):
        if "://" in url:
            url = url.split("://", 1)[1]
        self.url = url
        self.names = dict(names or {})
        self.served_names = self.names  # the metrics check's `model` labels
        self.missing_hint = missing_hint or REPO_HINT
        self.speculative_inputs = dict(speculative_inputs or {})  # BOOL inputs sent with every speculative request
        self.dropped_inputs: dict[
            str, set[str]
        ] = {}  # served model -> inputs it does not declare (left out of requests)
        self._local = threading.local()
        self._decoupled: dict[str, bool] = {}
        self._configs: dict[str, dict] = {}

    def served(self, model: str) -> str:
        return self.names.get(model, model)

    # ------------------------------------------------------------ plumbing

    def _client(self):
        client = getattr(self._local, "client", None)
        if client is None:
            grpcclient, _ = _tc()
            try:
                client = grpcclient.InferenceServerClient(self.url)
            except Exception as exc:  # a malformed address
                raise ClientError(f"cannot create a gRPC client for {self.url}: {exc}", "pass --url host:port") from exc
            self._local.client = client
        return client

    def _error(self, exc, what: str, timeout_s: float) -> ClientError:
        status = str(getattr(exc, "status", lambda: "")() or "")
        message = getattr(exc, "message", lambda: str(exc))() or str(exc)
        if "DEADLINE_EXCEEDED" in status or "Deadline Exceeded" in message:
            return ClientError(
                f"{what} timed out after {timeout_s:.0f} s (server {self.url})",
                "the server may be overloaded or stuck; raise validation.request_timeout_s or check the server log",
            )
        if "UNAVAILABLE" in status or "failed to connect" in message.lower() or "connection refused" in message.lower():
            return ClientError(
                f"the server at {self.url} is unreachable or went away during {what}: {message.strip()[:300]}",
                "start it (specdeploy serve RECIPE --detach) or check --url and the server log",
            )
        return ClientError(f"{what} failed on {self.url}: {message.strip()[:500]}", "see the server log for details")

    def _call(self, what: str, timeout_s: float, fn, *args, **kwargs):
        _, InferenceServerException = _tc()
        try:
            return fn(*args, **kwargs)
        except InferenceServerException as exc:
            raise self._error(exc, what, timeout_s) from None

    # ------------------------------------------------------------ readiness

    def check_ready(self, models: Sequence[str]) -> None:
        client = self._client()
        live = self._call(
            "the liveness check", CONNECT_TIMEOUT_S, client.is_server_live, client_timeout=CONNECT_TIMEOUT_S
        )
        if not live:
            raise ClientError(f"the server at {self.url} is not live", "check the server log")
        for model in (self.served(m) for m in models):
            ready = self._call(
                f"the readiness check of {model}",
                CONNECT_TIMEOUT_S,
                client.is_model_ready,
                model,
                client_timeout=CONNECT_TIMEOUT_S,
            )
            if ready:
                continue
            index = self._call(
                "the model index",
                CONNECT_TIMEOUT_S,
                client.get_model_repository_index,
                as_json=True,
                client_timeout=CONNECT_TIMEOUT_S,
            )
            entries = {m.get("name"): m for m in index.get("models", [])}
            if model not in entries:
                raise ClientError(
                    f"model '{model}' is missing on {self.url} (it serves: {', '.join(sorted(entries)) or 'nothing'})",
                    self.missing_hint,
                )
            entry = entries[model]
            raise ClientError(
                f"model '{model}' on {self.url} is not ready (state {entry.get('state', '?')}:"
                f" {entry.get('reason', '')})",
                "see the server log for why it failed to load",
            )

    def _config(self, model: str) -> dict:
        if model not in self._configs:
            self._configs[model] = self._call(
                f"reading the config of {model}",
                CONNECT_TIMEOUT_S,
                self._client().get_model_config,
                model,
                as_json=True,
                client_timeout=CONNECT_TIMEOUT_S,
            ).get("config", {})
        return self._configs[model]

    def model_parameters(self, model: str) -> dict[str, str]:
        """The served model's config parameters (name -> string value), e.g. the BLS's policy settings."""
        params = self._config(self.served(model)).get("parameters", {}) or {}
        return {k: v.get("string_value", "") if isinstance(v, dict) else str(v) for k, v in params.items()}

    def _has_output(self, model: str, name: str) -> bool:
        return any(o.get("name") == name for o in self._config(model).get("output", []))

    def _declared(self, model: str, inputs: dict, required: Sequence[str]) -> dict:
        """Leave out optional inputs the model does not declare (older deployments lack some)."""
        declared = {i.get("name") for i in self._config(model).get("input", [])}
        if not declared:  # a config without an input list (auto-complete): send everything
            return inputs
        missing = [name for name in required if name not in declared]
        if missing:
            raise ClientError(
                f"model '{model}' on {self.url} has no input {missing[0]!r}; it is not an inflight_batcher_llm"
                " deployment",
                "point --url at a deployment generated by specdeploy repo or NVIDIA's tensorrtllm_backend",
            )
        if "seed" in inputs and "seed" not in declared and "random_seed" in declared:  # older NVIDIA name
            inputs = {**inputs, "random_seed": inputs["seed"]}
        dropped = {name for name in inputs if name not in declared and name != "seed"}
        if dropped:
            self.dropped_inputs.setdefault(model, set()).update(dropped)
        return {name: value for name, value in inputs.items() if name in declared}

    def is_decoupled(self, model: str) -> bool:
        model = self.served(model)
        if model not in self._decoupled:
            config = self._config(model)
            decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
            steps = config.get("ensemble_scheduling", {}).get("step", [])
            decoupled = decoupled or any(self.is_decoupled(s["model_name"]) for s in steps)
            self._decoupled[model] = decoupled
        return self._decoupled[model]

    # ------------------------------------------------------------ requests

    def generate(self, model: str, request: GenerateRequest, timeout_s: float, on_text=None) -> GenerateResult:
        """One request; `on_text(piece)` (optional) gets each response's text as it arrives (the OpenAI front streams
        it)."""
        extra = self.speculative_inputs if request.num_draft_tokens is not None else {}
        model = self.served(model)
        inputs = {
            "text_input": np.array([[request.prompt.encode("utf-8")]], dtype=object),
            "max_tokens": np.array([[request.max_tokens]], dtype=np.int32),
            "exclude_input_in_output": np.array([[True]]),
            "return_perf_metrics": np.array([[request.return_perf_metrics]]),
        }
        if request.stream:
            inputs["stream"] = np.array([[True]])
        if request.num_draft_tokens is not None:
            inputs["num_draft_tokens"] = np.array([[request.num_draft_tokens]], dtype=np.int32)
        if request.stop_words:  # the ensemble's / BLS's STRING [-1]: the engine stops at them (token ids, tensors.py)
            inputs["stop_words"] = np.array([[w.encode("utf-8") for w in request.stop_words]], dtype=object)
        for name, value in extra.items():
            inputs[name] = np.array([[bool(value)]])
        if request.sampling is not None:
            s = request.sampling
            inputs["temperature"] = np.array([[s.temperature]], dtype=np.float32)
            inputs["top_k"] = np.array([[s.top_k]], dtype=np.int32)
            inputs["top_p"] = np.array([[s.top_p]], dtype=np.float32)
            if s.seed is not None:
                inputs["seed"] = np.array([[s.seed]], dtype=np.uint64)
        inputs = self._declared(model, inputs, required=("text_input", "max_tokens"))
        outputs = [
            "text_output",
            *(o for o in (PERF_OUTPUTS if request.return_perf_metrics else ()) if self._has_output(model, o)),
        ]
        with_ids = self._has_output(model, "output_ids")  # exact tokens, where the deployment offers them
        if with_ids:
            outputs.append("output_ids")
        with_count = not with_ids and self._has_output(
            model, "sequence_length"
        )  # else their number (specdeploy's models)
        if with_count:
            outputs.append("sequence_length")
        with_k = request.return_perf_metrics and self._has_output(model, K_HISTORY_OUTPUT)  # the policy's k per round
        if with_k:
            outputs.append(K_HISTORY_OUTPUT)
        with_s = with_k and all(
            self._has_output(model, o) for o in ROUND_SECONDS_OUTPUTS
        )  # the round profile's seconds
        if with_s:
            outputs += ROUND_SECONDS_OUTPUTS
        responses, first_s, start, latency = self._exchange(
            model, self.is_decoupled(model), inputs, outputs, timeout_s, on_text
        )
        text = "".join(_text(r) for r in responses)
        perf = _perf(responses[-1]) if request.return_perf_metrics and responses else PerfMetrics()
        ids = [int(t) for r in responses for t in _ids(r)] if with_ids else None
        ttft, decode, source = timing(request.stream, start, first_s, start + latency, perf)
        k_history = [int(k) for r in responses for k in _array(r, K_HISTORY_OUTPUT)] if with_k else None
        draft_s, target_s = (
            [[float(x) for r in responses for x in _array(r, o)] for o in ROUND_SECONDS_OUTPUTS]
            if with_s
            else (None, None)
        )
        count = sum(int(n) for r in responses for n in _array(r, "sequence_length")) if with_count else None
        return GenerateResult(
            text, latency, ttft, source, decode, len(responses), perf, ids, k_history, draft_s, target_s, count
        )

    def trace(self, prompt: str, max_tokens: int, timeout_s: float, with_logits: bool = True) -> TargetTrace:
        pre = self._run(
            self.served(PREPROCESSING_MODEL),
            {
                "QUERY": np.array([[prompt.encode("utf-8")]], dtype=object),
                "REQUEST_OUTPUT_LEN": np.array([[max_tokens]], dtype=np.int32),
            },
            ["INPUT_ID", "REQUEST_INPUT_LEN", "OUT_END_ID", "OUT_PAD_ID"],
            timeout_s,
        )[-1]
        input_ids = pre.as_numpy("INPUT_ID").astype(np.int32).reshape(1, -1)
        llm_inputs = {
            "input_ids": input_ids,
            "input_lengths": pre.as_numpy("REQUEST_INPUT_LEN").astype(np.int32).reshape(1, 1),
            "request_output_len": np.array([[max_tokens]], dtype=np.int32),
            "exclude_input_in_output": np.array([[True]]),
            "return_generation_logits": np.array([[with_logits]]),
        }
        end_id = None
        for src, dst in (("OUT_END_ID", "end_id"), ("OUT_PAD_ID", "pad_id")):
            value = pre.as_numpy(src)
            if value is not None:
                llm_inputs[dst] = value.astype(np.int32).reshape(1, 1)
                if dst == "end_id" and int(value.reshape(-1)[0]) >= 0:
                    end_id = int(value.reshape(-1)[0])
        outputs = ["output_ids", "sequence_length"] + (["generation_logits"] if with_logits else [])
        out = self._run(self.served(TARGET_MODEL), llm_inputs, outputs, timeout_s)[-1]
        ids = out.as_numpy("output_ids").reshape(-1)
        n = int(out.as_numpy("sequence_length").reshape(-1)[0])
        logits = out.as_numpy("generation_logits") if with_logits else None
        if logits is not None and logits.size:
            logits = logits.reshape(-1, logits.shape[-1]).astype(np.float32)  # [generated, vocab]
        else:
            logits = None
        return TargetTrace(input_ids.reshape(-1).tolist(), [int(t) for t in ids[:n]], logits, end_id)

    def close(self) -> None:
        client = getattr(self._local, "client", None)
        if client is not None:
            try:
                client.close()
            except Exception:  # closing is best effort
                pass
            self._local.client = None

    # ------------------------------------------------------------ transport

    def _exchange(self, model, decoupled: bool, inputs, outputs, timeout_s, on_text=None):
        """One request's responses (the gRPC stream for a decoupled model), the time of the first non-empty one
        (streamed only), when it was sent and how long it took."""
        what = f"a request to {model}"
        start = time.perf_counter()
        if decoupled:
            responses, first_s = self._stream(model, inputs, outputs, timeout_s, what, on_text)
        else:
            responses, first_s = [self._infer(model, inputs, outputs, timeout_s, what)], None
            if on_text is not None:
                on_text(_text(responses[0]))
        return responses, first_s, start, time.perf_counter() - start

    def _run(self, model, inputs, outputs, timeout_s):
        what = f"a request to {model}"
        if self.is_decoupled(model):
            return self._stream(model, inputs, outputs, timeout_s, what)[0]
        return [self._infer(model, inputs, outputs, timeout_s, what)]

    def _tensors(self, inputs: dict, outputs: Sequence[str]):
        grpcclient, _ = _tc()
        from tritonclient.utils import np_to_triton_dtype

        tensors = []
        for name, array in inputs.items():
            t = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            t.set_data_from_numpy(array)
            tensors.append(t)
        return tensors, [grpcclient.InferRequestedOutput(n) for n in outputs]

    def _infer(self, model, inputs, outputs, timeout_s, what):
        tensors, requested = self._tensors(inputs, outputs)
        return self._call(
            what, timeout_s, self._client().infer, model, tensors, outputs=requested, client_timeout=timeout_s
        )

    def _stream(self, model, inputs, outputs, timeout_s, what, on_text=None):
        """All responses of one request on the gRPC stream, and the time of the first non-empty one."""
        tensors, requested = self._tensors(inputs, outputs)
        client = self._client()
        results: queue.Queue = queue.Queue()
        client.start_stream(
            callback=lambda result, error: results.put((result, error, time.perf_counter())), stream_timeout=timeout_s
        )
        responses, first_s = [], None
        deadline = time.monotonic() + timeout_s
        try:
            self._call(
                what,
                timeout_s,
                client.async_stream_infer,
                model,
                tensors,
                outputs=requested,
                enable_empty_final_response=True,
            )
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ClientError(
                        f"{what} timed out after {timeout_s:.0f} s (server {self.url})",
                        "raise validation.request_timeout_s or check the server log",
                    )
                try:
                    result, error, at = results.get(timeout=remaining)
                except queue.Empty:
                    continue
                if error is not None:
                    raise self._error(error, what, timeout_s)
                response = result.get_response()
                final = response.parameters.get("triton_final_response")
                if response.outputs:
                    responses.append(result)
                    if on_text is not None:
                        on_text(_text(result))
                    if first_s is None and _text(result):
                        first_s = at
                if final is not None and final.bool_param:
                    return responses, first_s
        finally:
            try:
                client.stop_stream(cancel_requests=True)
            except Exception:  # the stream may already be broken; nothing left to clean up
                pass


def timing(streamed: bool, sent_s: float, first_s: float | None, done_s: float, perf: PerfMetrics):
    """(TTFT, first-to-last-token time, source) of one request.

    Streamed: the client's clock, request sent -> first non-empty response -> last response.
    Unary: the model's perf outputs, arrival -> first_token_time_ns -> last_token_time_ns (the
    client sees nothing before the whole answer arrives).
    """
    if streamed:
        if first_s is None:
            return None, None, None
        return first_s - sent_s, done_s - first_s, TIMING_STREAM
    if perf.server_ttft_s is None:
        return None, None, None
    return perf.server_ttft_s, perf.server_decode_s, TIMING_SERVER


def _text(result) -> str:
    array = result.as_numpy("text_output")
    if array is None:
        return ""
    return "".join(v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v) for v in array.reshape(-1))


def _ids(result) -> list[int]:
    return _array(result, "output_ids")


def _array(result, name: str) -> list:
    array = result.as_numpy(name)
    return [] if array is None else array.reshape(-1).tolist()


def _perf(result) -> PerfMetrics:
    values = {}
    for name in PERF_OUTPUTS:
        array = result.as_numpy(name)
        if array is not None and array.size:
            value = array.reshape(-1)[0].item()
            values[name] = float(value) if name == "acceptance_rate" else int(value)
    return PerfMetrics(**values)
