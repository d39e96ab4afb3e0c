"""specdeploy.ops.monitor: one frame from two scrapes, and `specdeploy monitor --once` against an endpoint."""

from __future__ import annotations

import http.server
import threading

import pytest
from click.testing import CliRunner

from specdeploy.core.errors import ClientError
from specdeploy.core.metrics import names, reader, recorder, sinks
from specdeploy.ops import monitor as mon
from specdeploy.recipe.config import CostConfig


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def _traffic(sink, arm, requests, latency_s, tokens, drafted, accepted):
    """Each request: one round (drafted/accepted), then the rest of its tokens one per pass."""
    clock = Clock()
    rec = recorder.Recorder(sink, "tensorrt_llm_bls", 4, clock=clock)
    for _ in range(requests):
        timer = rec.request_started(arm)
        clock.now += 0.1
        if drafted:
            rec.round(arm, drafted, accepted, accepted + 1, 0.01, 0.02)
        else:
            rec.round(arm, 0, 0, 1, 0.0, 0.02, reason=names.REASON_CONTROL_ARM)
        timer.tokens(1, clock.now)
        clock.now += latency_s - 0.1
        timer.tokens(tokens - 1, clock.now)
        rec.request_finished(timer, prompt_tokens=5)


def test_frame_shows_acceptance_tpot_onoff_inflight_and_cost():
    sink = sinks.PrometheusClientSink()
    start = reader.parse(sink.text(), taken_s=0.0)
    _traffic(sink, "speculative", 4, 1.0, 10, drafted=4, accepted=2)
    _traffic(sink, "control", 2, 2.0, 10, drafted=0, accepted=0)
    recorder.Recorder(sink, "tensorrt_llm_bls", 4).request_started("speculative")  # one still in flight
    now = reader.parse(sink.text(), taken_s=2.0)
    lines = mon.frame(now, now.minus(start), 2.0, CostConfig(machine_price_per_hour=36.0), "tiny")
    text = "\n".join(lines)
    spec_row = next(line for line in lines if line.startswith("speculative"))
    ctrl_row = next(line for line in lines if line.startswith("control"))
    # speculative: 4 requests, 1 running, 40 tokens in 2 s = 20.0 tok/s, acceptance 8/16 = 0.500
    assert spec_row.split()[:5] == ["speculative", "4", "1", "20.0", "0.500"]
    # tokens per round: 40 output tokens / 4 target passes recorded = 10.00 (the recorder saw one pass per request)
    assert spec_row.split()[5] == "10.00"
    # TPOT: every request (1.0 - 0.1) / 9 = 0.1 s; histogram buckets (0.075, 0.1] -> p50 interpolates inside it
    p50 = float(spec_row.split()[6].rstrip("ms"))
    assert 75.0 < p50 <= 100.0
    assert spec_row.split()[-1] == "4/0" and ctrl_row.split()[-1] == "0/2"
    assert "speculation off: control_arm 2" in text
    # cost: 36 per hour = 0.01 per second; speculative 4 requests in 2 s -> 0.005 per response; 20 tok/s -> 0.5 per 1k
    assert "cost speculative  per response 0.0050 USD, per 1k output tokens 0.5000 USD" in text


def test_frame_without_specdeploy_metrics_says_so():
    snap = reader.parse('nv_inference_request_success{model="ensemble",version="1"} 3\n')
    text = "\n".join(mon.frame(snap, snap, 1.0, CostConfig()))
    assert "triton requests: ensemble 3" in text and "no specdeploy metrics yet" in text
    assert "cost" not in text  # no machine price set


class _Handler(http.server.BaseHTTPRequestHandler):
    texts: list[str] = []

    def do_GET(self):  # noqa: N802
        body = (self.texts.pop(0) if len(self.texts) > 1 else self.texts[0]).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_monitor_once_prints_one_frame(endpoint, tmp_path):
    from specdeploy.cli.main import main

    sink = sinks.PrometheusClientSink()
    before = sink.text()
    _traffic(sink, "speculative", 3, 1.0, 8, drafted=4, accepted=4)
    _Handler.texts = [before, sink.text()]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\ntarget: {model: x}\ndraft: {model: x}\ncost: {machine_price_per_hour: 2.5}\n")
    result = CliRunner().invoke(main, ["monitor", str(recipe), "--url", endpoint, "--once", "--interval", "0.1"])
    assert result.exit_code == 0, result.output
    assert result.output.count("specdeploy monitor r") == 1
    row = next(line for line in result.output.splitlines() if line.startswith("speculative"))
    assert row.split()[1:3] == ["3", "0"] and row.split()[4] == "1.000"
    assert "cost speculative" in result.output


def test_monitor_counts_from_a_restart_and_waits_out_an_unreachable_server(endpoint, monkeypatch):
    """Counters lower than the last scrape (a restarted server) give the traffic since the restart, said as such, not
    negative rates; a scrape that fails mid-watch is said and retried (it ended the live view before)."""
    from specdeploy.ops import monitor as mon

    sink = sinks.PrometheusClientSink()
    _traffic(sink, "speculative", 9, 1.0, 8, drafted=4, accepted=4)
    fresh = sinks.PrometheusClientSink()
    _traffic(fresh, "speculative", 2, 1.0, 8, drafted=4, accepted=4)
    before, after = reader.parse(sink.text()), reader.parse(fresh.text())
    assert after.resets(before) and not before.resets(reader.parse(sinks.PrometheusClientSink().text()))
    # a declared gauge that goes down (Triton's queue: nv_inference_pending_request_count) is no restart
    queue = '# TYPE nv_inference_pending_request_count gauge\nnv_inference_pending_request_count{model="a"} {n}\n'
    assert not reader.parse(queue.replace("{n}", "0")).resets(reader.parse(queue.replace("{n}", "3")))
    assert (
        reader.parse(queue.replace("{n}", "0"))
        .minus(reader.parse(queue.replace("{n}", "3")))
        .sum("nv_inference_pending_request_count")
        == 0
    )
    window = after.minus(before)
    assert window.sum(names.REQUESTS.name, arm="speculative") == 2  # Prometheus's increase(): the restarted count
    _Handler.texts = [sink.text(), fresh.text()]
    frames = []
    mon.run(endpoint, CostConfig(), interval_s=0.0, echo=frames.append, sleep=lambda s: None, frames=1)
    row = next(line for line in frames[-1].splitlines() if line.startswith("speculative"))
    assert "the server restarted" in frames[-1] and row.split()[1] == "2"  # the 2 requests since the restart
    # unreachable for one scrape: said, then the next frame comes
    calls = []

    def flaky(url, timeout_s=5.0):
        calls.append(url)
        if len(calls) == 2:
            raise ClientError(f"cannot read metrics from {url}: refused", "start the server")
        return reader.parse(sink.text())

    lines = []
    monkeypatch.setattr(mon.reader, "scrape", flaky)
    mon.run(endpoint, CostConfig(), interval_s=0.0, echo=lines.append, sleep=lambda s: None, frames=1)
    assert "refused; retrying" in lines[0] and len(calls) == 3 and "speculative" in lines[-1]


def test_monitor_without_a_server_names_the_fix(tmp_path):
    from specdeploy.cli.main import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\ntarget: {model: x}\ndraft: {model: x}\n")
    result = CliRunner().invoke(main, ["--root", str(tmp_path), "monitor", str(recipe), "--once"])
    assert result.exit_code == 1 and "serve" in result.output and "--url" in result.output
