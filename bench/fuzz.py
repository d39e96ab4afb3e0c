"""Seeded malformed requests against a served repository and its OpenAI front; the server must answer, not die.

    .venv/bin/python bench/fuzz.py --recipe build/smollm2-135m.yaml [--root .] [--count N] [--seed 0] [--out fuzz.json]
    .venv/bin/python bench/fuzz.py --grpc-url 127.0.0.1:PORT [--openai-url http://127.0.0.1:PORT] [--api-key KEY] ...

With --recipe it serves the built repository (`specdeploy repo RECIPE` first) and the OpenAI front on free
loopback ports, and stops both at the end. Triton cases (tritonclient gRPC; the inputs each model declares
come from the server's own model config, so every model of the repository is covered): per declared input a
wrong dtype, a wrong shape, an empty and a huge tensor, NaN/inf, out-of-range ids and lengths, invalid UTF-8,
a 1 MB string, a missing required and an unknown input; then conflicting parameters (num_draft_tokens far past
max_draft_len, beam_width 2), two concurrent requests with one request id, and `stop` for an id nobody sent.
OpenAI cases: bodies that are not JSON, too deep, too large, fields of the wrong type or value, unknown fields,
lone surrogates, wrong methods and paths, and streaming clients that hang up after the first chunk.

After every batch a known-good greedy request on each text path must return the text it returned before.
Counts: sent, served, refused with a message (the problem named), refused with an empty message, server
faults (HTTP 5xx or a Python exception surfacing from a model), timeouts, crashes (the server, a model or a
python stub gone) and good requests lost. Exit status 1 when there was a crash, a lost good request or an
empty message.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GOOD_PROMPT = "The quick brown fox"
GOOD_TOKENS = 6
BIG_STRING = b"fox " * (1 << 18)  # 1 MiB
HUGE_ELEMENTS = 1 << 20
# a model's own Python exception surfacing as the error text: refused, but not in words a user can act on
PYTHON_FAULT = re.compile(r"Traceback|\b(TypeError|KeyError|IndexError|AttributeError|ZeroDivisionError|UnboundLocalError|NameError)\b")
CRASH = re.compile(r"[Ss]tub process .*(not healthy|unhealthy|crash)|Failed to (initialize|connect to) stub|Socket closed|connection refused", re.I)
NUMPY = {"BOOL": np.bool_, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "UINT8": np.uint8,
         "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64, "FP16": np.float16, "FP32": np.float32,
         "FP64": np.float64, "STRING": np.object_}  # fmt: skip
# a valid value per known input name (the rest get 1 / 1.0 / False / b"a"): a base the mutations change one input of
GOOD_VALUES = {"text_input": b"The quick brown fox", "QUERY": b"The quick brown fox", "max_tokens": 3, "REQUEST_OUTPUT_LEN": 3,
               "request_output_len": 3, "input_ids": [5, 6, 7], "input_lengths": 3, "TOKENS_BATCH": [[5, 6, 7]],
               "SEQUENCE_LENGTH": [3], "num_draft_tokens": 2}  # fmt: skip


@dataclass
class Tally:
    sent: int = 0
    served: int = 0
    named: int = 0  # refused with a non-empty message
    unnamed: int = 0  # refused with an empty message
    faults: int = 0  # HTTP 5xx, or a model's Python exception as the message
    timeouts: int = 0
    crashes: int = 0
    good_checks: int = 0
    good_lost: int = 0
    by_case: dict = field(default_factory=dict)
    refusals: dict = field(default_factory=dict)  # case -> the message it was refused with (what a user reads)
    findings: list = field(default_factory=list)  # (case, outcome, message) of every fault, timeout, crash, unnamed, loss

    echo: object = None  # where findings are said as they happen

    def add(self, case: str, outcome: str, message: str = "") -> None:
        self.sent += 1
        setattr(self, outcome, getattr(self, outcome) + 1)
        row = self.by_case.setdefault(case.split(":")[0], {})
        row[outcome] = row.get(outcome, 0) + 1
        if outcome == "named":
            self.refusals[case] = message[:300]
        if outcome in ("unnamed", "faults", "timeouts", "crashes"):
            self.findings.append({"case": case, "outcome": outcome, "message": message[:400]})
            if self.echo is not None:
                self.echo(f"  ! {outcome} {case}: {message[:300]}")

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "echo"}


# ---------------------------------------------------------------- Triton (gRPC)


@dataclass(frozen=True)
class Declared:
    name: str
    dtype: str  # TYPE_ stripped
    dims: tuple[int, ...]
    optional: bool


@dataclass(frozen=True)
class Model:
    name: str
    inputs: tuple[Declared, ...]
    batched: bool
    decoupled: bool


def discover(client) -> list[Model]:
    """Every ready model of the repository, with the inputs its config declares (the server's own config)."""
    models = []
    for entry in client.get_model_repository_index(as_json=True).get("models", []):
        if entry.get("state") != "READY":
            continue
        config = client.get_model_config(entry["name"], as_json=True)["config"]
        inputs = tuple(Declared(i["name"], i["data_type"].removeprefix("TYPE_"), tuple(int(d) for d in i.get("dims", [])), bool(i.get("optional")))
                       for i in config.get("input", []))  # fmt: skip
        decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled"))
        models.append(Model(entry["name"], inputs, int(config.get("max_batch_size", 0)) > 0, decoupled))
    return sorted(models, key=lambda m: m.name)


def _good_array(d: Declared, batched: bool) -> np.ndarray:
    value = GOOD_VALUES.get(d.name)
    if value is None:
        value = {"STRING": b"a", "BOOL": False}.get(d.dtype, 1.0 if d.dtype.startswith("FP") else 1)
    array = np.array(value, dtype=NUMPY[d.dtype])
    shape = [max(x, 1) if x != -1 else None for x in d.dims]
    if array.ndim == 0:
        array = np.full([s or 1 for s in shape], value, dtype=NUMPY[d.dtype])
    elif array.ndim < len(shape):
        array = array.reshape([1] * (len(shape) - array.ndim) + list(array.shape))
    return array[None] if batched else array


def _base(model: Model) -> dict[str, np.ndarray]:
    # optional in the config but needed for a request that means something (input_ids), or what the path is for
    inputs = {d.name: _good_array(d, model.batched) for d in model.inputs if not d.optional or d.name in GOOD_VALUES}
    if model.name == "tensorrt_llm_bls":
        inputs["num_draft_tokens"] = np.array([[2]], dtype=np.int32)
    return inputs


def _mutations(d: Declared) -> list[str]:
    kinds = ["wrong_dtype", "wrong_shape", "empty", "huge"]
    if d.dtype.startswith("FP"):
        kinds += ["nan", "inf"]
    elif d.dtype.startswith(("INT", "UINT")):
        kinds += ["negative", "int_max"]
    elif d.dtype == "STRING":
        kinds += ["bad_utf8", "big_string"]
    kinds.append("missing" if not d.optional or d.name in GOOD_VALUES else "present")
    return kinds


def _mutate(model: Model, d: Declared, kind: str) -> dict[str, np.ndarray]:
    inputs = _base(model)
    good = _good_array(d, model.batched)
    dtype = NUMPY[d.dtype]
    lead = [1] if model.batched else []
    if kind == "wrong_dtype":
        other = np.float32 if d.dtype != "FP32" else np.int64
        inputs[d.name] = (np.ones(good.shape, dtype=np.int32) if d.dtype == "STRING" else good.astype(other))
    elif kind == "wrong_shape":
        inputs[d.name] = np.repeat(good[..., None], 2, axis=-1)
    elif kind == "empty":
        inputs[d.name] = np.zeros(lead + [0] * max(len(d.dims), 1), dtype=dtype)
    elif kind == "huge":
        inputs[d.name] = np.full(lead + [HUGE_ELEMENTS] + [max(x, 1) for x in d.dims[1:]], good.reshape(-1)[0], dtype=dtype)
    elif kind in ("nan", "inf"):
        inputs[d.name] = np.full(good.shape, np.nan if kind == "nan" else np.inf, dtype=dtype)
    elif kind == "negative":
        inputs[d.name] = np.full(good.shape, -1 if d.dtype.startswith("INT") else 0, dtype=dtype)
    elif kind == "int_max":
        inputs[d.name] = np.full(good.shape, np.iinfo(dtype).max, dtype=dtype)
    elif kind == "bad_utf8":
        inputs[d.name] = np.full(good.shape, b"\xff\xfe\xc3(", dtype=object)
    elif kind == "big_string":
        inputs[d.name] = np.full(good.shape, BIG_STRING, dtype=object)
    elif kind == "missing":
        del inputs[d.name]
    elif kind == "present":
        inputs[d.name] = good
    return inputs


class Triton:
    def __init__(self, url: str, timeout_s: float):
        import tritonclient.grpc as grpcclient

        self.grpc, self.url, self.timeout_s = grpcclient, url, timeout_s
        self.client = grpcclient.InferenceServerClient(url)

    def send(self, model: Model, inputs: dict, request_id: str = "", outputs=None):
        """('served', texts) or (outcome, message) for one request; streams for a decoupled model."""
        from tritonclient.utils import InferenceServerException, np_to_triton_dtype

        tensors = []
        try:
            for name, array in inputs.items():
                t = self.grpc.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype) or "BYTES")
                t.set_data_from_numpy(array)
                tensors.append(t)
        except Exception as exc:  # the client library itself refuses (e.g. a dtype it cannot serialize): nothing sent
            return "client", str(exc)
        requested = [self.grpc.InferRequestedOutput(n) for n in outputs] if outputs else None
        try:
            if not model.decoupled:
                result = self.client.infer(model.name, tensors, outputs=requested, request_id=request_id, client_timeout=self.timeout_s)
                return "served", [result]
            return self._stream(model, tensors, requested, request_id)
        except InferenceServerException as exc:
            return self._refusal(str(exc.message() or ""), exc.status())

    def _stream(self, model, tensors, requested, request_id):
        import queue

        results: queue.Queue = queue.Queue()
        client = self.grpc.InferenceServerClient(self.url)  # one stream per request: a broken stream breaks nothing else
        client.start_stream(callback=lambda result, error: results.put((result, error)), stream_timeout=self.timeout_s)
        try:
            client.async_stream_infer(model.name, tensors, outputs=requested, request_id=request_id, enable_empty_final_response=True)
            got, deadline = [], time.monotonic() + self.timeout_s
            while True:
                try:
                    result, error = results.get(timeout=max(0.01, deadline - time.monotonic()))
                except queue.Empty:
                    return "timeouts", f"no final response within {self.timeout_s} s"
                if error is not None:
                    return self._refusal(str(error.message() or ""), error.status())
                response = result.get_response()
                if response.outputs:
                    got.append(result)
                final = response.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    return "served", got
        finally:
            client.stop_stream(cancel_requests=True)
            client.close()

    @staticmethod
    def _refusal(message: str, status) -> tuple[str, str]:
        if "Deadline" in message or "DEADLINE" in str(status):
            return "timeouts", message
        if CRASH.search(message) or "UNAVAILABLE" in str(status):
            return "crashes", message
        if PYTHON_FAULT.search(message):
            return "faults", message
        return ("named" if message.strip() else "unnamed"), message

    def healthy(self, model: str | None = None) -> str | None:
        """None when the server is live and the model ready, else what is wrong."""
        try:
            if not self.client.is_server_live():
                return "server not live"
            if model is not None and not self.client.is_model_ready(model):
                return f"model {model} not ready"
        except Exception as exc:
            return f"server unreachable: {exc}"
        return None

    def text(self, model: Model, prompt: str, max_tokens: int, why: list | None = None) -> str | None:
        inputs = {"text_input": np.array([[prompt.encode()]], dtype=object), "max_tokens": np.array([[max_tokens]], dtype=np.int32)}
        if model.name == "tensorrt_llm_bls":
            inputs["num_draft_tokens"] = np.array([[2]], dtype=np.int32)
        outcome, got = self.send(model, inputs, outputs=["text_output"])
        if outcome != "served":
            if why is not None:
                why.append(f"{model.name}: {outcome}: {got}")
            return None
        return "".join(r.as_numpy("text_output").reshape(-1)[0].decode("utf-8", "replace") for r in got)


def triton_cases(models: list[Model]) -> list[tuple]:
    """(case name, model, inputs or a special kind) for every declared input x mutation, plus the conflicts."""
    cases = []
    for m in models:
        for d in m.inputs:
            cases += [(f"{kind}:{m.name}.{d.name}", m, d, kind) for kind in _mutations(d)]
        cases.append((f"unknown_input:{m.name}", m, None, "unknown_input"))
        names = {d.name for d in m.inputs}
        if "num_draft_tokens" in names:
            cases.append((f"num_draft_tokens_past_max:{m.name}", m, None, "draft_conflict"))
        if "draft_input_ids" in names:
            cases.append((f"draft_input_ids_past_max:{m.name}", m, None, "draft_ids_conflict"))
        if "beam_width" in names:
            cases.append((f"beam_width_2:{m.name}", m, None, "beam"))
        if "stop" in names:
            cases.append((f"stop_unknown_id:{m.name}", m, None, "stop_unknown"))
        cases.append((f"duplicate_request_id:{m.name}", m, None, "duplicate_id"))
    return cases


def run_triton_case(triton: Triton, case, tally: Tally) -> None:
    name, model, declared, kind = case
    if declared is not None:
        inputs = _mutate(model, declared, kind)
    else:
        inputs = _base(model)
        if kind == "unknown_input":
            inputs["no_such_input"] = np.array([[1]], dtype=np.int32)
        elif kind == "draft_conflict":
            inputs["num_draft_tokens"] = np.array([[10_000]], dtype=np.int32)
        elif kind == "draft_ids_conflict":
            inputs["draft_input_ids"] = np.ones((1, 10_000), dtype=np.int32)
        elif kind == "beam":
            inputs["beam_width"] = np.array([[2]], dtype=np.int32)
        elif kind == "stop_unknown":
            inputs["stop"] = np.array([[True]])
            outcome, message = triton.send(model, inputs, request_id="no-such-request")
            return _record(triton, tally, name, model, outcome, message)
        elif kind == "duplicate_id":
            outcomes: list = [None, None]

            def one(i):
                outcomes[i] = triton.send(model, inputs, request_id="same-id")

            threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for outcome, message in outcomes:
                _record(triton, tally, name, model, outcome, message)
            return
    outcome, message = triton.send(model, inputs)
    _record(triton, tally, name, model, outcome, message)


def _record(triton: Triton, tally: Tally, name: str, model: Model, outcome: str, message) -> None:
    if outcome == "client":  # refused before sending: not a server answer
        return
    problem = triton.healthy(model.name)
    if problem is not None:
        outcome, message = "crashes", f"{problem} (after: {message if isinstance(message, str) else 'served'})"
    tally.add(name, outcome, message if isinstance(message, str) else "")


# ---------------------------------------------------------------- the OpenAI front (HTTP)


class Front:
    def __init__(self, url: str, api_key: str | None, timeout_s: float):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        self.address, self.timeout_s = parts.netloc, timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def request(self, method: str, path: str, body: bytes | None = None, hang_up_after_first: bool = False, headers=None):
        """(status, parsed body or None); status 0 with the error when the connection failed."""
        conn = http.client.HTTPConnection(self.address, timeout=self.timeout_s)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json", **self.headers, **(headers or {})})
            response = conn.getresponse()
            if hang_up_after_first:
                response.fp.readline()  # the first SSE line, then the client goes away mid-stream
                conn.sock.shutdown(socket.SHUT_RDWR)
                return response.status, None
            data = response.read()
            try:
                return response.status, json.loads(data) if data and not data.startswith(b"data:") else data
            except ValueError:
                return response.status, data
        except (OSError, http.client.HTTPException) as exc:
            return 0, str(exc)
        finally:
            conn.close()

    def live(self) -> bool:
        return self.request("GET", "/health")[0] == 200

    def text(self, model_id: str) -> str | None:
        body = {"model": model_id, "prompt": GOOD_PROMPT, "max_tokens": GOOD_TOKENS, "temperature": 0}
        status, data = self.request("POST", "/v1/completions", json.dumps(body).encode())
        return data["choices"][0]["text"] if status == 200 and isinstance(data, dict) else None


def front_cases(model_id: str) -> list[tuple]:
    """(case name, method, path, raw body, hang up mid-stream) for the OpenAI front."""
    good = {"model": model_id, "prompt": GOOD_PROMPT, "max_tokens": 3, "temperature": 0}
    chat = {"model": model_id, "messages": [{"role": "user", "content": GOOD_PROMPT}], "max_tokens": 3, "temperature": 0}
    cases = []
    for i, raw in enumerate([b"{not json", b"", b"\xff\xfe{}", b"[1, 2]", b"42", b'"text"', b"null", b"[" * 200_000 + b"]" * 200_000,
                             b'{"model": "' + b"x" * (2 << 20) + b'"}']):  # fmt: skip
        for path in ("/v1/completions", "/v1/chat/completions"):
            cases.append((f"not_json_{i}:{path}", "POST", path, raw, False))
    wrong = {"model": [1, None, [], {}, "no-such-model"], "prompt": [1, {}, [1, 2], ["a", "b"], None, "\ud800 lone surrogate", ""],
             "max_tokens": ["8", -1, 0, 1.5, 2**63, True, 10**9], "temperature": ["hot", -1, 1e308, float("nan"), float("inf")],
             "top_p": [2, float("nan"), "x"], "seed": [-1, "x", 2**70], "stream": ["yes", 1], "stop": [5, [1], ["a"] * 5, ["\ud800"]],
             "n": [2, "x"], "stream_options": ["x", {"include_usage": "maybe"}], "logprobs": [5], "no_such_field": [1],
             "user": [123]}  # fmt: skip
    for key, values in wrong.items():
        for j, value in enumerate(values):
            cases.append((f"field_{key}_{j}:/v1/completions", "POST", "/v1/completions", json.dumps({**good, key: value}).encode(), False))
    wrong_chat = {"messages": ["x", [], [1], [{"role": 1, "content": 2}], [{"content": "x"}], [{"role": "user", "content": [{"type": "image_url"}]}],
                                [{"role": "user", "content": "\ud800"}]],
                  "max_completion_tokens": [0, "x", 10**9]}  # fmt: skip
    for key, values in wrong_chat.items():
        for j, value in enumerate(values):
            cases.append((f"field_{key}_{j}:/v1/chat/completions", "POST", "/v1/chat/completions", json.dumps({**chat, key: value}).encode(), False))
    for method, path in (("GET", "/v1/completions"), ("POST", "/v1/models"), ("GET", "/v1/nope"), ("DELETE", "/v1/chat/completions"),
                         ("GET", "/v1/models/" + "x" * 5000)):  # fmt: skip
        cases.append((f"route:{method} {path[:30]}", method, path, None, False))
    for path, body in (("/v1/completions", good), ("/v1/chat/completions", chat)):
        streamed = json.dumps({**body, "stream": True, "max_tokens": 12}).encode()
        cases.append((f"stream_hang_up:{path}", "POST", path, streamed, True))
    return cases


def run_front_case(front: Front, case, tally: Tally) -> None:
    name, method, path, body, hang_up = case
    status, data = front.request(method, path, body, hang_up_after_first=hang_up)
    if status == 0 or not front.live():
        tally.add(name, "crashes", f"front gone: {data}")
    elif hang_up or 200 <= status < 300:
        tally.add(name, "served")
    elif status >= 500:
        tally.add(name, "faults", json.dumps(data)[:400] if isinstance(data, dict) else str(data)[:400])
    else:
        message = data.get("error", {}).get("message", "") if isinstance(data, dict) and isinstance(data.get("error"), dict) else ""
        tally.add(name, "named" if message.strip() else "unnamed", message or str(data)[:200])


# ---------------------------------------------------------------- the run


def run_fuzz(grpc_url: str, openai_url: str | None = None, api_key: str | None = None, seed: int = 0, count: int | None = None,
             batch: int = 25, timeout_s: float = 60.0, model_id: str | None = None, echo=print) -> dict:  # fmt: skip
    """Send the seeded cases (all, or `count` of them) in batches; check the known-good requests after each batch."""
    triton = Triton(grpc_url, timeout_s)
    models = discover(triton.client)
    cases = [("triton", c) for c in triton_cases(models)]
    front = Front(openai_url, api_key, timeout_s) if openai_url else None
    if front is not None:
        if model_id is None:
            listed = front.request("GET", "/v1/models")[1]
            model_id = listed["data"][0]["id"]
        cases += [("openai", c) for c in front_cases(model_id)]
    rng = random.Random(seed)
    rng.shuffle(cases)
    if count is not None:
        cases = cases[:count]
    tally = Tally(echo=echo)
    text_models = [m for m in models if {"text_input", "max_tokens"} <= {d.name for d in m.inputs}]
    why: list = []
    expected = {m.name: triton.text(m, GOOD_PROMPT, GOOD_TOKENS, why) for m in text_models}
    if front is not None:
        expected["openai"] = front.text(model_id)
    missing = [k for k, v in expected.items() if not v]
    if missing:
        raise RuntimeError(f"the known-good request failed before fuzzing on: {', '.join(missing)} ({'; '.join(why)})")

    def check_good():
        for m in text_models:
            tally.good_checks += 1
            if triton.text(m, GOOD_PROMPT, GOOD_TOKENS) != expected[m.name]:
                tally.good_lost += 1
                tally.findings.append({"case": f"good:{m.name}", "outcome": "good_lost", "message": ""})
                echo(f"  ! good request lost on {m.name} ({triton.healthy(m.name) or 'server live'})")
        if front is not None:
            tally.good_checks += 1
            if front.text(model_id) != expected["openai"]:
                tally.good_lost += 1
                tally.findings.append({"case": "good:openai", "outcome": "good_lost", "message": ""})

    start = time.monotonic()
    for i in range(0, len(cases), batch):
        for where, case in cases[i : i + batch]:
            (run_triton_case(triton, case, tally) if where == "triton" else run_front_case(front, case, tally))
        check_good()
        echo(f"  {min(i + batch, len(cases))}/{len(cases)} cases: {tally.sent} requests, {tally.served} served, {tally.named} refused "
             f"with a message, {tally.faults} faults, {tally.crashes} crashes, {tally.good_lost} good lost")  # fmt: skip
    report = tally.to_dict()
    report.update(seed=seed, cases=len(cases), models=[m.name for m in models], seconds=round(time.monotonic() - start, 1),
                  server_live=triton.healthy() is None, front_live=front.live() if front is not None else None)  # fmt: skip
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", help="serve this recipe's built repository (and the OpenAI front) for the run")
    parser.add_argument("--root", default=None)
    parser.add_argument("--grpc-url", help="an already served repository, 127.0.0.1:PORT")
    parser.add_argument("--openai-url", help="its OpenAI front, http://127.0.0.1:PORT")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=None, help="send only this many cases (default: all)")
    parser.add_argument("--batch", type=int, default=25)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    if args.recipe:
        report = _serve_and_fuzz(args)
    elif args.grpc_url:
        report = run_fuzz(args.grpc_url, args.openai_url, args.api_key, args.seed, args.count, args.batch, args.timeout)
    else:
        parser.error("give --recipe, or --grpc-url (and --openai-url)")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("findings", "refusals")}, indent=1))
    for finding in report["findings"][:30]:
        print(f"  {finding['outcome']:9} {finding['case']}: {finding['message'][:200]}")
    return 1 if report["crashes"] or report["good_lost"] or report["unnamed"] else 0


def _serve_and_fuzz(args) -> dict:
    from specdeploy import openai_api
    from specdeploy.artifacts import Layout
    from specdeploy.config_loader import load_recipe
    from specdeploy.triton import server

    recipe = load_recipe(args.recipe)
    layout = Layout.of(recipe, args.root)
    if not (layout.repo / "ensemble" / "config.pbtxt").is_file():
        raise SystemExit(f"no model repository at {layout.repo}: run `specdeploy repo {args.recipe}` first")
    srv = server.start(layout.repo, server.Ports.pick(), Path(layout.server_state) / "tritonserver-fuzz.log")
    try:
        server.wait_ready(srv, 600)
        front = openai_api.build_front(recipe, layout, srv.state.grpc_url, timeout_s=args.timeout)
        with openai_api.ApiServer(openai_api.create_app(front), server.free_port()) as api:
            return run_fuzz(srv.state.grpc_url, api.url[: -len("/v1")], None, args.seed, args.count, args.batch, args.timeout)
    finally:
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
