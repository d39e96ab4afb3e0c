"""Acceptance from the serving runtime's own counters and the OpenAI stream, against recorded responses
(tests/data/runtime_counters/README.md says where each comes from): llama.cpp's per-response timings (streamed and
not), vLLM's and SGLang's /metrics, trtllm-serve's iteration stats; then the run-size presets and the plan."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest
import yaml
from client_fakes import CharCodec, FakeEndpoint

from specdeploy.client import latency as lat
from specdeploy.client import openai_adapter, protocol, runtime_counters
from specdeploy.client import options as client_options
from specdeploy.client import validate as val
from specdeploy.client.protocol import CONTROL_MODEL, SPECULATIVE_MODEL, GenerateRequest

DATA = Path(__file__).resolve().parent / "data" / "runtime_counters"
ROOT = Path(__file__).resolve().parent.parent


class Replay:
    """A loopback HTTP server that answers each path with recorded bytes (a list: one body per request, in turn)."""

    def __init__(self, routes: dict[str, list[tuple[str, bytes]]]):
        self.routes = {k: list(v) for k, v in routes.items()}
        self.bodies: list[dict] = []
        replay = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    replay.bodies.append(json.loads(self.rfile.read(length)))
                queue = replay.routes[self.path]
                content_type, body = queue.pop(0) if len(queue) > 1 else queue[0]
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _recorded(name: str) -> bytes:
    return (DATA / name).read_bytes()


def _llama_endpoint(url: str) -> openai_adapter.OpenAIEndpoint:
    return openai_adapter.OpenAIEndpoint(url, ids={SPECULATIVE_MODEL: "spec", CONTROL_MODEL: "plain"}, control_url=url)


# ---------------------------------------------------------------- llama.cpp: per-response timings


def test_llama_cpp_unary_and_streamed_answers_carry_their_draft_counts_and_usage():
    unary, sse = json.loads(_recorded("llama_spec.json")), _recorded("llama_spec.sse")
    routes = {"/v1/completions": [("application/json", _recorded("llama_spec.json")), ("text/event-stream", sse)]}
    with Replay(routes) as server:
        endpoint = _llama_endpoint(server.url)
        got = endpoint.generate(SPECULATIVE_MODEL, GenerateRequest("p", 24), 10)
        streamed = endpoint.generate(SPECULATIVE_MODEL, GenerateRequest("p", 24, stream=True), 10)
    timings = unary["timings"]
    counts = (got.perf.total_draft_tokens, got.perf.total_accepted_draft_tokens)
    assert counts == (timings["draft_n"], timings["draft_n_accepted"])
    assert got.perf.source == runtime_counters.LLAMA_SOURCE and got.usage_tokens == unary["usage"]["completion_tokens"]
    assert got.text == unary["choices"][0]["text"]
    # the stream: its pieces joined are the same answer, its last chunks carry the counts and usage
    assert streamed.text == got.text and streamed.responses > 1 and streamed.ttft_source == "stream"
    assert streamed.perf.total_draft_tokens is not None and streamed.perf.source == runtime_counters.LLAMA_SOURCE
    assert streamed.usage_tokens == got.usage_tokens
    assert server.bodies[1]["stream"] and server.bodies[1]["stream_options"] == {"include_usage": True}


def test_llama_cpp_plain_answers_carry_no_draft_counts():
    with Replay({"/v1/completions": [("application/json", _recorded("llama_plain.json"))]}) as server:
        got = _llama_endpoint(server.url).generate(CONTROL_MODEL, GenerateRequest("p", 24), 10)
    assert got.perf.total_draft_tokens is None and got.perf.source is None and got.usage_tokens is not None


def test_usage_is_the_token_count_where_no_ids_come_back():
    result = protocol.GenerateResult("abc", 0.1, usage_tokens=7)
    assert lat.count_tokens(result, CharCodec(), ("abc", 3)) == (7, lat.COUNT_USAGE)


# ---------------------------------------------------------------- metrics endpoints


def test_vllm_counters_over_a_run_are_the_difference_of_two_readings():
    before = runtime_counters.parse(_recorded("vllm_before.prom").decode())
    after = runtime_counters.parse(_recorded("vllm_after.prom").decode())
    w = runtime_counters.window(before, after)
    assert (w.drafts, w.drafted, w.accepted) == (40, 120, 72) and w.accepted_per_pos == (32, 24, 16)
    assert w.acceptance_rate == pytest.approx(0.6) and w.acceptance_length == pytest.approx(1 + 72 / 40)
    assert "vllm:spec_decode_num_draft_tokens_total" in w.source


def test_sglang_gauges_are_read_after_the_run_and_said_to_be_a_recent_value():
    after = runtime_counters.parse(_recorded("sglang_after.prom").decode())
    w = runtime_counters.window(after, after)
    assert (w.acceptance_length, w.acceptance_rate, w.drafted) == (2.4, 0.35, None)
    assert "sglang:spec_accept_length" in w.source and "not counts" in w.note


def test_trtllm_serve_iteration_stats_are_summed_over_the_iterations_read():
    after = runtime_counters.parse(_recorded("trtllm_serve_after.json").decode())
    w = runtime_counters.window([], after)
    assert (w.drafted, w.accepted, w.drafts) == (15, 9, 5) and w.acceptance_length == pytest.approx(1 + 9 / 5)


def test_an_endpoint_without_speculation_counters_gives_nothing():
    triton = runtime_counters.parse('nv_inference_request_success{model="ensemble",version="1"} 3\n')
    assert runtime_counters.window(triton, triton) is None


def test_counters_read_around_each_speculative_run_give_the_level_its_acceptance():
    """A foreign endpoint without per-response counts: each speculative latency run reads the metrics endpoint before
    and after; the level's acceptance is the sum of its runs' windows, and names its source."""
    proms = [_recorded("vllm_before.prom"), _recorded("vllm_after.prom")]
    with Replay({"/metrics": [("text/plain", p) for p in proms * 4]}) as server:
        counters = runtime_counters.RuntimeCounters(server.url)
        endpoint = FakeEndpoint(draft_counts=False)
        report = val.validate(endpoint, CharCodec(), _options(), "fake", progress=False, counters=counters)
    assert report["complete"], report["errors"]
    spec = [r for r in report["latency"]["levels"] if r["mode"] == "speculative"]
    assert len(counters.windows) == 2 and not counters.errors  # one window per speculative run (2 repeats)
    assert spec[0]["drafted"] == 240 and spec[0]["acceptance_length"] == pytest.approx(1 + 144 / 80)
    assert spec[0]["acceptance_source"].startswith("vLLM /metrics")
    assert all(r["counters"] is None for r in report["latency"]["runs"] if r["mode"] == "control")


def _options(**kw):
    base = dict(
        max_prompts=4,
        max_tokens=20,
        concurrency=(1,),
        repeats=2,
        request_timeout_s=5.0,
        num_draft_tokens=4,
        max_draft_len=6,
        warmup_requests=1,
        min_compared_tokens=16,
    )
    return client_options.Options(**{**base, **kw})


# ---------------------------------------------------------------- the run's size, chosen up front


def test_a_recipe_less_run_is_the_default_recipe_s_size():
    v = yaml.safe_load((ROOT / "build" / "smollm2-135m.yaml").read_text())["validation"]
    want = {
        "max_prompts": v["max_prompts"],
        "latency_prompts": v["latency_prompts"],
        "concurrency": tuple(v["concurrency"]),
        "repeats": v["repeats"],
    }
    assert client_options.FOREIGN_SIZE == want
    # what the user sets wins over the preset
    assert client_options.sized({"repeats": 2, "concurrency": None}, client_options.QUICK_SIZE)["repeats"] == 2


def test_the_plan_is_said_before_the_first_request_and_the_eta_after_the_warm_up(monkeypatch):
    endpoint = FakeEndpoint()
    notes = []
    monkeypatch.setattr(val._Progress, "note", lambda self, line: notes.append((line, len(endpoint.calls))))
    report = val.validate(endpoint, CharCodec(), _options(stream=True), "fake", progress=False)
    plan = report["plan"]
    # 4 prompts x 2 sides x (unary + stream); warm-up 1 a side; 4 timed x 2 sides x 1 level x 2 repeats
    assert (plan["parity"], plan["warm_up"], plan["latency"], plan["total"]) == (16, 2, 16, 34)
    assert notes[0][0].startswith("plan: 34 requests") and notes[0][1] == 0
    assert notes[1][0].startswith("warm-up done") and notes[1][1] == 16 + 2
    assert len(endpoint.calls) == plan["total"]  # the plan is what was sent


# ---------------------------------------------------------------- acceptance over every speculative prompt (issue 57)


def test_acceptance_counts_every_prompt_once_from_the_parity_phase_with_an_interval():
    report = val.validate(FakeEndpoint(), CharCodec(), _options(max_prompts=8), "fake", progress=False)
    acc = report["acceptance"]
    items = report["parity"]["items"]
    assert acc["all"]["prompts"] == len(items) == 8 and acc["phases"] == ["parity"]  # not only the 8 timed ones
    assert acc["all"]["drafted"] == sum(i["drafted"] for i in items)
    tokens = sum(i["speculative_tokens"] or i["control_tokens"] for i in items)
    accepted = sum(i["accepted"] for i in items)
    assert acc["all"]["acceptance_length"] == pytest.approx(tokens / (tokens - accepted))
    lo, hi = acc["all"]["acceptance_length_ci95"]
    assert lo <= acc["all"]["acceptance_length"] <= hi
    assert set(acc["by_category"]) == {i["category"] for i in items}
    assert sum(f["prompts"] for f in acc["by_category"].values()) == 8


def test_acceptance_is_split_by_source_where_the_deployment_says():
    from specdeploy.client import acceptance

    report = val.validate(FakeEndpoint(), CharCodec(), _options(), "fake", progress=False)
    lookup = {"rounds": 10, "drafted": 30, "accepted": 20, "head_rounds": 40, "head_drafted": 120, "head_accepted": 30}
    report["speculation"] = {"lookup": lookup}
    split = acceptance.section(report)["by_source"]
    assert split["lookup"]["accepted_per_round"] == 2.0 and split["head"]["accepted_per_round"] == 0.75


class _Captured(Exception):
    pass


@pytest.mark.parametrize(
    "args, stream, size",
    [
        ([], True, client_options.FOREIGN_SIZE),
        (["--no-stream", "--quick"], False, client_options.QUICK_SIZE),
        (["--quick", "--repeats", "6"], True, {**client_options.QUICK_SIZE, "repeats": 6}),
    ],
)
def test_a_recipe_less_openai_run_streams_unless_told_and_is_sized_by_preset(monkeypatch, tmp_path, args, stream, size):
    from click.testing import CliRunner

    from specdeploy.cli.main import main

    def capture(deployment, options, *rest, **kw):
        raise _Captured(options)

    monkeypatch.setattr(val, "validate_deployment", capture)
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    result = CliRunner().invoke(
        main, ["validate", "--protocol", "openai", "--url", "http://127.0.0.1:9", "--tokenizer", str(tokenizer), *args]
    )
    assert isinstance(result.exception, _Captured), result.output
    options = result.exception.args[0]
    assert options.stream is stream
    assert {k: getattr(options, k) for k in size} == size
