"""Seeded malformed requests against a served repository and its OpenAI front; the server must answer, not die.

    .venv/bin/python bench/fuzz.py --recipe build/smollm2-135m.yaml [--root .] [--count 1000] [--seed 0] [--out F]
    .venv/bin/python bench/fuzz.py --grpc-url 127.0.0.1:PORT [--openai-url http://127.0.0.1:PORT] [--api-key KEY] ...

With --recipe it serves the built repository (`specdeploy repo RECIPE` first) and the OpenAI front on free
loopback ports, and stops both at the end. Case i is generated from (seed, i) alone by a seeded mutator: a Triton case
(tritonclient gRPC) takes one model and the inputs its config declares on the server, and changes one to three of them
(dtype, shape, values at and past their ranges, NaN/inf, texts that break text_rules and texts around its limits, a
missing or an added optional input, a 1 Mi-element tensor), or sends a conflict (num_draft_tokens past max_draft_len,
beam_width 2, one request id twice, `stop` for an id nobody sent); an OpenAI case changes one to three fields of a good
request by their kind in the front's request schema (openai_requests.FIELDS), or breaks the body's bytes, or calls a
wrong route, or hangs up mid-stream.

After every batch a known-good greedy request on each text path must return the text it returned before.
Counts: sent, served, refused with a message (the problem named), refused with an empty message, server
faults (HTTP 5xx or a Python exception surfacing as the error text, from a model or the front), timeouts, crashes
(the server, a model or a python stub gone) and good requests lost. Exit status 1 on any fault, timeout, crash, lost
good request or empty message, or when the server or the front is not live at the end.
"""

from __future__ import annotations

import argparse
import builtins
import http.client
import json
import math
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

from specdeploy.core.text_rules import MAX_DEPTH, MAX_STRINGS, limit_of  # noqa: E402
from specdeploy.ops.openai.requests import FIELDS  # noqa: E402 (after the path: bench/ runs from a checkout)

GOOD_PROMPT = "The quick brown fox"
GOOD_TOKENS = 6
HUGE_ELEMENTS = 1 << 20
DEFAULT_COUNT = 1000
# a Python exception surfacing as the error text (a model's or the front's): refused, but not in words a user can act on
PYTHON_FAULT = re.compile(
    r"Traceback|\b(%s)\b"
    % "|".join(n for n in dir(builtins) if n.endswith(("Error", "Exception")) and n != "Exception")
)
CRASH = re.compile(
    r"[Ss]tub process .*(not healthy|unhealthy|crash)|Failed to (initialize|connect to) stub"
    r"|Socket closed|connection refused",
    re.I,
)
NUMPY = {
    "BOOL": np.bool_,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "STRING": np.object_,
}
# a valid value per known input name (the rest get 1 / 1.0 / False / b"a"): a base the mutations change one input of
GOOD_VALUES = {
    "text_input": b"The quick brown fox",
    "QUERY": b"The quick brown fox",
    "max_tokens": 3,
    "REQUEST_OUTPUT_LEN": 3,
    "request_output_len": 3,
    "input_ids": [5, 6, 7],
    "input_lengths": 3,
    "TOKENS_BATCH": [[5, 6, 7]],
    "SEQUENCE_LENGTH": [3],
    "num_draft_tokens": 2,
}


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
    findings: list = field(
        default_factory=list
    )  # (case, outcome, message) of every fault, timeout, crash, unnamed, loss

    echo: object = None  # where findings are said as they happen

    def add(self, case: str, outcome: str, message: str = "") -> None:
        self.sent += 1
        setattr(self, outcome, getattr(self, outcome) + 1)
        row = self.by_case.setdefault(case.split(":")[0].split("+")[0], {})  # by the first change a case made
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
        inputs = tuple(
            Declared(
                i["name"],
                i["data_type"].removeprefix("TYPE_"),
                tuple(int(d) for d in i.get("dims", [])),
                bool(i.get("optional")),
            )
            for i in config.get("input", [])
        )
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


# ---------------------------------------------------------------- the seeded generator
# A seeded mutator, not Hypothesis, drives the run: case i is a function of (seed, i) alone, so a finding is re-sent by
# its index without the rest of the run; a live server is the thing under test, so there is no shrinking to gain and
# 10,000 cases cost no example database. The suite's property tests (tests/test_properties.py) use Hypothesis.

OUTPUT_LENGTHS = {
    "max_tokens",
    "request_output_len",
    "REQUEST_OUTPUT_LEN",
}  # a large value here generates up to max_seq_len


def _text_bytes(name: str, rng: random.Random) -> bytes:
    """A malformed, odd or valid text for a STRING input, by the rules of text_rules and around them."""
    limit = limit_of(name)
    return rng.choice(
        [
            b"\xff\xfe\xc3(",
            b"\xed\xa0\x80",
            b"a\xed\xb0\x80b",
            b"\xc0\xaf",
            b"\xf4\x90\x80\x80",
            b"fox\xc3",  # not UTF-8
            b"a\x00b",
            b"\x00",
            b"",
            b" ",
            b"x" * (limit + 1),
            b"x" * limit,  # NUL, empty, one past and at the size limit
            # valid: astral, RTL, combining
            "h\u00e9llo \U0001f98a \u0645\u0631\u062d\u0628\u0627 e\u0301 \u202e\u2028".encode(),
            bytes(rng.randrange(256) for _ in range(rng.randrange(1, 48))),  # random bytes
            GOOD_PROMPT.encode() * rng.randrange(1, 40),
        ]
    )


def _int_value(d: Declared, rng: random.Random) -> int:
    info = np.iinfo(NUMPY[d.dtype])
    small = [0, 1, 2, 3, -1, -2]
    if d.name in OUTPUT_LENGTHS and rng.random() > 0.05:  # long generations only now and then: 10,000 cases in hours
        value = rng.choice(small + [rng.randrange(-100, 9)])
    else:
        value = rng.choice(
            small + [int(info.min), int(info.max), int(info.max) - 1, 2**31, 10_000, rng.randrange(-1000, 1000)]
        )
    return max(int(info.min), min(int(info.max), value))  # in Python ints: np.clip goes through float64


def _value(d: Declared, rng: random.Random):
    if d.dtype == "STRING":
        return _text_bytes(d.name, rng)
    if d.dtype == "BOOL":
        return rng.random() < 0.5
    if d.dtype.startswith("FP"):
        return rng.choice([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e30, -1.0, 0.5, 1.0, 2.0, 1e-30, 65504.0])
    return _int_value(d, rng)


def _shape(good: np.ndarray, rng: random.Random) -> list[int]:
    shape = list(good.shape)
    kind = rng.choice(["rank+", "rank-", "grow", "zero", "batch"])
    if kind == "rank+":
        return shape + [rng.choice([1, 2])]
    if kind == "rank-":
        return shape[:-1]
    if kind == "zero":
        return [0 if i == len(shape) - 1 else s for i, s in enumerate(shape)] or [0]
    if kind == "batch":
        return [rng.choice([0, 2, 5])] + shape[1:]
    return shape[:-1] + [rng.choice([2, 3, 17, MAX_STRINGS + 1])] if shape else [2]


def _filled(shape, value, dtype) -> np.ndarray:
    # through a 0-d array of the dtype: np.full casts a Python int through C long, which UINT64's top half overflows
    with np.errstate(over="ignore"):  # 1e30 as FP16 is inf: one more value to send
        return np.full(shape, value if dtype is np.object_ else np.array(value).astype(dtype), dtype=dtype)


def _mutate_input(model: Model, d: Declared, inputs: dict, rng: random.Random) -> str:
    """Change one declared input of `inputs` in place; the kind of change made."""
    good = _good_array(d, model.batched)
    dtype = NUMPY[d.dtype]
    kind = rng.choice(
        ["dtype", "shape", "value", "value", "value", "missing" if d.name in inputs else "present", "huge"]
        if rng.random() > 0.02
        else ["huge"]
    )
    if kind == "huge" and rng.random() > 0.1:  # a 1 Mi-element tensor costs seconds to send: one try in ten
        kind = "value"
    if kind == "dtype":
        other = rng.choice([t for t in NUMPY if t != d.dtype])
        inputs[d.name] = np.full(good.shape, b"1" if other == "STRING" else 1, dtype=NUMPY[other])
    elif kind == "shape":
        shape = _shape(good, rng)
        inputs[d.name] = np.full(
            shape, good.reshape(-1)[0] if good.size else (b"a" if d.dtype == "STRING" else 0), dtype=dtype
        )
    elif kind == "value":
        inputs[d.name] = _filled(good.shape, _value(d, rng), dtype)
    elif kind == "missing":
        del inputs[d.name]
    elif kind == "present":
        inputs[d.name] = _filled(good.shape, _value(d, rng), dtype) if rng.random() < 0.7 else good
    else:
        lead = [1] if model.batched else []
        inputs[d.name] = np.full(
            lead + [HUGE_ELEMENTS] + [max(x, 1) for x in d.dims[1:]], good.reshape(-1)[0], dtype=dtype
        )
    return kind


def _conflicts(model: Model) -> list[str]:
    names = {d.name for d in model.inputs}
    return [
        k
        for k, needs in (
            ("draft_conflict", "num_draft_tokens"),
            ("draft_ids_conflict", "draft_input_ids"),
            ("beam", "beam_width"),
            ("stop_unknown", "stop"),
        )
        if needs in names
    ] + ["unknown_input", "duplicate_id"]


def triton_case(models: list[Model], rng: random.Random) -> tuple:
    """(case name, model, inputs, special): one to three declared inputs of one model changed, or a conflict."""
    model = rng.choice(models)
    if rng.random() < 0.06:
        special = rng.choice(_conflicts(model))
        return f"{special}:{model.name}", model, _base(model), special
    inputs = _base(model)
    chosen = rng.sample(model.inputs, min(len(model.inputs), rng.choice([1, 1, 1, 2, 2, 3])))
    kinds = [f"{_mutate_input(model, d, inputs, rng)}:{model.name}.{d.name}" for d in chosen]
    return "+".join(kinds), model, inputs, None


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
                result = self.client.infer(
                    model.name, tensors, outputs=requested, request_id=request_id, client_timeout=self.timeout_s
                )
                return "served", [result]
            return self._stream(model, tensors, requested, request_id)
        except InferenceServerException as exc:
            return self._refusal(str(exc.message() or ""), exc.status())

    def _stream(self, model, tensors, requested, request_id):
        import queue

        results: queue.Queue = queue.Queue()
        client = self.grpc.InferenceServerClient(
            self.url
        )  # one stream per request: a broken stream breaks nothing else
        client.start_stream(callback=lambda result, error: results.put((result, error)), stream_timeout=self.timeout_s)
        try:
            client.async_stream_infer(
                model.name, tensors, outputs=requested, request_id=request_id, enable_empty_final_response=True
            )
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
        inputs = {
            "text_input": np.array([[prompt.encode()]], dtype=object),
            "max_tokens": np.array([[max_tokens]], dtype=np.int32),
        }
        if model.name == "tensorrt_llm_bls":
            inputs["num_draft_tokens"] = np.array([[2]], dtype=np.int32)
        outcome, got = self.send(model, inputs, outputs=["text_output"])
        if outcome != "served":
            if why is not None:
                why.append(f"{model.name}: {outcome}: {got}")
            return None
        return "".join(r.as_numpy("text_output").reshape(-1)[0].decode("utf-8", "replace") for r in got)


def run_triton_case(triton: Triton, case, tally: Tally) -> None:
    name, model, inputs, special = case
    if special == "unknown_input":
        inputs["no_such_input"] = np.array([[1]], dtype=np.int32)
    elif special == "draft_conflict":
        inputs["num_draft_tokens"] = np.array([[10_000]], dtype=np.int32)
    elif special == "draft_ids_conflict":
        inputs["draft_input_ids"] = np.ones((1, 10_000), dtype=np.int32)
    elif special == "beam":
        inputs["beam_width"] = np.array([[2]], dtype=np.int32)
    elif special == "stop_unknown":
        inputs["stop"] = np.array([[True]])
        outcome, message = triton.send(model, inputs, request_id="no-such-request")
        return _record(triton, tally, name, model, outcome, message)
    elif special == "duplicate_id":
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

    def request(
        self, method: str, path: str, body: bytes | None = None, hang_up_after_first: bool = False, headers=None
    ):
        """(status, parsed body or None); status 0 with the error when the connection failed."""
        conn = http.client.HTTPConnection(self.address, timeout=self.timeout_s)
        try:
            conn.request(
                method, path, body=body, headers={"Content-Type": "application/json", **self.headers, **(headers or {})}
            )
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


def _front_text(field: str, rng: random.Random):
    """A malformed, odd or valid JSON string for a text field, by the rules of text_rules and around them."""
    limit = limit_of(field)
    return rng.choice(
        [
            "\ud800",
            "a \udc00 b",
            "\ud83e",
            "a\x00b",
            "\x00",
            "",
            " ",
            "x" * (limit + 1),
            "\u00e9" * (limit // 2 + 1),
            "h\u00e9llo \U0001f98a \u0645\u0631\u062d\u0628\u0627 e\u0301 \u202e\u2028\ufeff",
            GOOD_PROMPT,
            "".join(
                chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x3000), rng.randrange(0x10000, 0x10FFFF)]))
                for _ in range(rng.randrange(1, 40))
            ),
        ]
    )


def _other_type(rng: random.Random):
    return rng.choice(
        [None, True, 0, -1, 1.5, "8", [], {}, [1, 2], {"a": 1}, "x" * 10, 2**63, -(2**63), 2**70, math.nan, math.inf]
    )


def _deep(value, rng: random.Random):
    for _ in range(rng.choice([MAX_DEPTH, MAX_DEPTH + 1, 40])):
        value = [value] if rng.random() < 0.5 else {"a": value}
    return value


def _field_value(key: str, spec, good, rng: random.Random):
    """A changed value for one field of the front's schema (openai_requests.FIELDS), by the field's kind."""
    choice = rng.random()
    if choice < 0.15:
        return _other_type(rng)
    if choice < 0.2:
        return _deep(good if good is not None else 1, rng)
    if spec.kind in ("int", "number"):
        low = spec.low if spec.low is not None else 0
        edges = [
            low,
            low - 1,
            (spec.high if spec.high is not None else 10**9),
            (spec.high + 1 if spec.high is not None else 2**63),
        ]
        if spec.kind == "number":
            edges += [math.nan, math.inf, -math.inf, low - 1e-9, 1e308, -0.0]
        value = rng.choice(edges + [0, 1, 2, 3, 1.5, True])
        if (
            key in ("max_tokens", "max_completion_tokens")
            and isinstance(value, (int, float))
            and value > 8
            and rng.random() > 0.05
        ):
            value = rng.randrange(-2, 9)  # long generations only now and then (the front's limit refuses the largest)
        return value
    if spec.kind == "bool":
        return rng.choice([True, False, "true", 1, 0, None])
    if spec.kind == "object":
        return rng.choice(
            [{"include_usage": True}, {"include_usage": "maybe"}, {"include_usage": _front_text(key, rng)}, "x", [1]]
        )
    if spec.kind == "unsupported":
        return rng.choice([1, True, "x", [1], {"type": "text"}, {"type": "json_object"}, None, 0, ""])
    if spec.kind == "stop":
        return rng.choice(
            [
                _front_text(key, rng),
                [_front_text(key, rng) for _ in range(rng.randrange(0, 6))],
                [_front_text(key, rng)] * (MAX_STRINGS + 1),
                [1],
                5,
            ]
        )
    if spec.kind == "messages":
        text = _front_text("messages", rng)
        return rng.choice(
            [
                [{"role": "user", "content": text}],
                [{"role": _front_text("role", rng), "content": GOOD_PROMPT}],
                [{"role": "user", "content": [{"type": "text", "text": text}]}],
                [{"role": "user", "content": [{"type": "image_url"}]}],
                [{"role": "system", "content": text}, {"role": "user", "content": GOOD_PROMPT}],
                [{"content": GOOD_PROMPT}],
                [],
                "x",
                [1],
                [{"role": "assistant", "content": None}],
                [{"role": "user", "content": GOOD_PROMPT, text[:20] or "k": text}],
            ]
        )
    return (
        rng.choice([_front_text(key, rng), [_front_text(key, rng)], [GOOD_PROMPT, GOOD_PROMPT]])
        if spec.kind == "prompt"
        else _front_text(key, rng)
    )


def _raw_body(body: dict, rng: random.Random) -> bytes:
    """The body's bytes broken the way a client or a proxy breaks them."""
    raw = json.dumps(body).encode()
    at = rng.randrange(len(raw))
    return rng.choice(
        [
            raw[:at],
            raw[:at] + b"\xff" + raw[at:],
            raw[:at] + b"\x00" + raw[at:],
            b"\xef\xbb\xbf" + raw,
            raw.replace(b'"', b"'", 1),
            b"[" * 100_000 + b"]" * 100_000,
            b"",
            b"null",
            b"[1, 2]",
            b"\xff\xfe{}",
            raw[:-1] + b', "model": ' + raw[:-1] + b"}}",
            raw + b"garbage",
        ]
    )


FIELD_WEIGHTS = {
    "unsupported": 0.3,
    "text": 2.0,
    "prompt": 4.0,
    "messages": 4.0,
    "stop": 3.0,
}  # the texts: where faults hid


def front_case(model_id: str, rng: random.Random) -> tuple:
    """(case name, method, path, raw body, hang up mid-stream): one to three fields of a good request changed (each by
    its kind in the front's schema), or its bytes broken, or a wrong route."""
    chat = rng.random() < 0.5
    route, path = ("chat", "/v1/chat/completions") if chat else ("completions", "/v1/completions")
    body = {"model": model_id, "max_tokens": 3, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": GOOD_PROMPT}]} if chat else {"prompt": GOOD_PROMPT})
    roll = rng.random()
    if roll < 0.03:
        method, where = rng.choice(
            [
                ("GET", path),
                ("POST", "/v1/models"),
                ("GET", "/v1/nope"),
                ("DELETE", path),
                ("GET", "/v1/models/" + "x" * rng.choice([10, 5000])),
                ("GET", "/v1/models/%ED%A0%80"),
            ]
        )
        return f"route:{method} {where[:30]}", method, where, None, False
    if roll < 0.05:
        return (
            f"stream_hang_up:{path}",
            "POST",
            path,
            json.dumps({**body, "stream": True, "max_tokens": 12}).encode(),
            True,
        )
    if roll < 0.15:
        return f"raw_body:{path}", "POST", path, _raw_body(body, rng), False
    keys = [k for k, spec in FIELDS.items() if route in spec.routes]
    weights = [FIELD_WEIGHTS.get(FIELDS[k].kind, 1.0) for k in keys]
    changed = []
    for key in dict.fromkeys(rng.choices(keys, weights, k=rng.choice([1, 1, 1, 2, 2, 3]))):
        if rng.random() < 0.1 and key in body:
            del body[key]
            changed.append(f"missing_{key}")
        else:
            body[key] = _field_value(key, FIELDS[key], body.get(key), rng)
            changed.append(f"field_{key}")
    if rng.random() < 0.05:
        body[_front_text("key", rng)] = 1  # an unknown field, its name itself odd
        changed.append("unknown_field")
    raw = json.dumps(body).encode()  # ASCII: a lone surrogate goes as the escape \\ud800, valid JSON
    return "+".join(changed) + f":{path}", "POST", path, raw, False


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
        message = (
            data.get("error", {}).get("message", "")
            if isinstance(data, dict) and isinstance(data.get("error"), dict)
            else ""
        )
        outcome = "faults" if PYTHON_FAULT.search(message) else "named" if message.strip() else "unnamed"
        tally.add(name, outcome, message or str(data)[:200])


# ---------------------------------------------------------------- the run


def cases(models: list[Model], model_id: str | None, seed: int, count: int):
    """Case i of the run: from (seed, i) alone; a Triton case (every model's declared inputs) or, with a front, an
    OpenAI one (its request schema), in turn by chance."""
    for i in range(count):
        rng = random.Random(f"{seed}:{i}")
        if model_id is None or rng.random() < 0.55:
            yield "triton", triton_case(models, rng)
        else:
            yield "openai", front_case(model_id, rng)


def run_fuzz(
    grpc_url: str,
    openai_url: str | None = None,
    api_key: str | None = None,
    seed: int = 0,
    count: int = DEFAULT_COUNT,
    batch: int = 25,
    timeout_s: float = 60.0,
    model_id: str | None = None,
    echo=print,
    progress: bool = False,
    out: Path | None = None,
) -> dict:
    """Send `count` generated cases in batches; check the known-good requests after each batch. With `out`, the report
    so far is written there after every batch ("done" counts the cases sent), so a stopped run keeps its figures."""
    from tqdm import tqdm

    triton = Triton(grpc_url, timeout_s)
    models = discover(triton.client)
    front = Front(openai_url, api_key, timeout_s) if openai_url else None
    if front is not None and model_id is None:
        model_id = front.request("GET", "/v1/models")[1]["data"][0]["id"]
    tally = Tally(echo=echo if not progress else tqdm.write)
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
                tally.echo(f"  ! good request lost on {m.name} ({triton.healthy(m.name) or 'server live'})")
        if front is not None:
            tally.good_checks += 1
            if front.text(model_id) != expected["openai"]:
                tally.good_lost += 1
                tally.findings.append({"case": "good:openai", "outcome": "good_lost", "message": ""})
                tally.echo("  ! good request lost on the front")

    start = time.monotonic()
    bar = tqdm(total=count, unit="case", disable=not progress, mininterval=5, smoothing=0.05)
    for i, (where, case) in enumerate(cases(models, model_id, seed, count), 1):
        run_triton_case(triton, case, tally) if where == "triton" else run_front_case(front, case, tally)
        bar.update()
        if i % batch == 0 or i == count:
            check_good()
            bar.set_postfix(
                sent=tally.sent,
                faults=tally.faults,
                crashes=tally.crashes,
                timeouts=tally.timeouts,
                lost=tally.good_lost,
            )
            if out is not None:
                Path(out).write_text(
                    json.dumps({**tally.to_dict(), "seed": seed, "cases": count, "done": i}, indent=1) + "\n"
                )
            if not progress:
                echo(
                    f"  {i}/{count} cases: {tally.sent} requests, {tally.served} served, {tally.named} refused with a "
                    f"message, {tally.faults} faults, {tally.crashes} crashes, {tally.good_lost} good lost"
                )
    bar.close()
    report = tally.to_dict()
    report.update(
        seed=seed,
        cases=count,
        done=count,
        models=[m.name for m in models],
        seconds=round(time.monotonic() - start, 1),
        server_live=triton.healthy() is None,
        front_live=front.live() if front is not None else None,
    )
    return report


def failed(report: dict) -> list[str]:
    """What makes the run fail: any fault, timeout, crash, lost good request or empty message, or a part not live."""
    wrong = [f"{report[k]} {k}" for k in ("faults", "timeouts", "crashes", "good_lost", "unnamed") if report[k]]
    wrong += [
        f"{part} not live at the end"
        for part, key in (("server", "server_live"), ("front", "front_live"))
        if report[key] is False
    ]
    return wrong


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", help="serve this recipe's built repository (and the OpenAI front) for the run")
    parser.add_argument("--root", default=None)
    parser.add_argument("--grpc-url", help="an already served repository, 127.0.0.1:PORT")
    parser.add_argument("--openai-url", help="its OpenAI front, http://127.0.0.1:PORT")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--count", type=int, default=DEFAULT_COUNT, help="generated cases to send (default: %(default)s)"
    )
    parser.add_argument("--batch", type=int, default=25)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    if args.recipe:
        report = _serve_and_fuzz(args)
    elif args.grpc_url:
        report = _fuzz(args, args.grpc_url, args.openai_url, args.api_key)
    else:
        parser.error("give --recipe, or --grpc-url (and --openai-url)")
    report.update(commit=_commit(), cpu=_cpu())
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("findings", "refusals")}, indent=1))
    for finding in report["findings"][:30]:
        print(f"  {finding['outcome']:9} {finding['case']}: {finding['message'][:200]}")
    wrong = failed(report)
    print(
        f"fuzz: FAILED: {', '.join(wrong)}"
        if wrong
        else f"fuzz: passed: {report['sent']} requests, none refused wrongly"
    )
    return 1 if wrong else 0


def _fuzz(args, grpc_url: str, openai_url: str | None, api_key: str | None) -> dict:
    opts = dict(seed=args.seed, count=args.count, batch=args.batch, timeout_s=args.timeout, progress=True, out=args.out)
    return run_fuzz(grpc_url, openai_url, api_key, **opts)


def _commit() -> str:
    import subprocess

    run = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return run.stdout.strip() or "unknown"


def _cpu() -> str:
    import platform

    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    return next(
        (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.processor()
    )


def _serve_and_fuzz(args) -> dict:
    from specdeploy.core.artifacts import Layout
    from specdeploy.ops.openai import api as openai_api
    from specdeploy.ops.openai import app
    from specdeploy.recipe.load import load_recipe
    from specdeploy.triton import ports, server

    recipe = load_recipe(args.recipe)
    layout = Layout.of(recipe, args.root)
    if not (layout.repo / "ensemble" / "config.pbtxt").is_file():
        raise SystemExit(f"no model repository at {layout.repo}: run `specdeploy repo {args.recipe}` first")
    srv = server.start(layout.repo, ports.Ports.pick(), Path(layout.server_state) / "tritonserver-fuzz.log")
    try:
        server.wait_ready(srv, 600)
        front = openai_api.build_front(recipe, layout, srv.state.grpc_url, timeout_s=args.timeout)
        with openai_api.ApiServer(app.create_app(front), ports.free_port()) as api:
            return _fuzz(args, srv.state.grpc_url, api.url[: -len("/v1")], None)
    finally:
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
