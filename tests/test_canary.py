"""specdeploy.canary: the promote / rollback decision from metric windows, and the `canary` command."""

from __future__ import annotations

import dataclasses
import http.server
import threading

import pytest
from click.testing import CliRunner

from specdeploy import canary as can
from specdeploy import metrics as m
from specdeploy.config import CanaryConfig

CONFIG = CanaryConfig(control_percent=20, window_s=1.0, min_requests=10, min_speedup=1.2, max_p99_ratio=1.5, min_acceptance_rate=0.5)


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def traffic(sink, arm: str, requests: int, latency_s: float, tokens: int, drafted: int = 0, accepted: int = 0, failures: int = 0):
    """`requests` finished requests of `tokens` tokens each taking latency_s (with one round of drafts each)."""
    clock = Clock()
    rec = m.Recorder(sink, "tensorrt_llm_bls", 4, clock=clock)
    for _ in range(requests):
        timer = rec.request_started(arm)
        clock.now += latency_s / 2
        if drafted:
            rec.round(arm, drafted, accepted, accepted + 1, 0.01, 0.02)
        timer.tokens(1, clock.now)
        clock.now += latency_s / 2
        timer.tokens(tokens - 1, clock.now)
        rec.request_finished(timer, prompt_tokens=5)
    for _ in range(failures):
        rec.request_finished(rec.request_started(arm), prompt_tokens=5, ok=False)


def _window(spec_latency, ctrl_latency, spec_n=30, ctrl_n=12, accepted=3, spec_failures=0):
    sink = m.PrometheusClientSink()
    before = m.parse(sink.text())
    traffic(sink, "speculative", spec_n, spec_latency, 20, drafted=4, accepted=accepted, failures=spec_failures)
    traffic(sink, "control", ctrl_n, ctrl_latency, 20)
    return m.parse(sink.text()).minus(before)


def test_faster_speculative_arm_is_promoted():
    v = can.decide(_window(0.5, 1.0), CONFIG, 10.0)
    assert v.decision == can.PROMOTE and v.exit_code == 0
    # seconds per output token: control 1.0/20, speculative 0.5/20 -> 2x
    assert v.speedup == pytest.approx(2.0)
    assert v.speculative.acceptance_rate == pytest.approx(0.75)
    assert v.line.startswith("PROMOTE: speedup 2.000x")


def test_slower_speculative_arm_is_rolled_back_with_the_reason():
    v = can.decide(_window(1.0, 0.9), CONFIG, 10.0)
    assert v.decision == can.ROLLBACK and v.exit_code == 3
    assert v.speedup == pytest.approx(0.9)
    assert any(r.startswith("speedup 0.900x < 1.20x") for r in v.reasons)


def test_low_acceptance_or_more_errors_roll_back_even_when_faster():
    v = can.decide(_window(0.5, 1.0, accepted=1), CONFIG, 10.0)  # 1 of 4 drafts accepted: 0.25 < 0.5
    assert v.decision == can.ROLLBACK and any("acceptance rate 0.250 < 0.50" in r for r in v.reasons)
    v = can.decide(_window(0.5, 1.0, spec_failures=3), CONFIG, 10.0)
    assert v.decision == can.ROLLBACK and any(r.startswith("error share speculative 0.091") for r in v.reasons)


def test_tail_latency_regression_rolls_back():
    sink = m.PrometheusClientSink()
    traffic(sink, "speculative", 20, 0.4, 20, drafted=4, accepted=4)
    traffic(sink, "speculative", 2, 30.0, 20, drafted=4, accepted=4)  # a slow tail
    traffic(sink, "control", 22, 1.0, 20)
    v = can.decide(m.parse(sink.text()), dataclasses.replace(CONFIG, min_speedup=0.1), 10.0)
    assert v.p99_ratio > 1.5 and v.decision == can.ROLLBACK


def test_too_little_traffic_is_inconclusive():
    v = can.decide(_window(0.5, 1.0, ctrl_n=3), CONFIG, 10.0)
    assert v.decision == can.INCONCLUSIVE and v.exit_code == 1
    assert "control arm had 3 requests" in v.line


class _MetricsHandler(http.server.BaseHTTPRequestHandler):
    texts: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        body = (self.texts.pop(0) if len(self.texts) > 1 else self.texts[0]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def metrics_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _MetricsHandler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv, _MetricsHandler
    finally:
        srv.shutdown()
        srv.server_close()


def test_canary_command_reads_a_window_from_the_endpoint(metrics_server, tmp_path):
    """Two scrapes (before, after): only the difference counts, so traffic before the window is ignored."""
    from specdeploy.cli import main

    srv, handler = metrics_server
    sink = m.PrometheusClientSink()
    traffic(sink, "speculative", 50, 5.0, 20, drafted=4, accepted=0)  # old, bad traffic before the window
    before = sink.text()
    traffic(sink, "speculative", 30, 0.5, 20, drafted=4, accepted=3)
    traffic(sink, "control", 12, 1.0, 20)
    handler.texts = [before, sink.text()]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\ntarget: {model: x}\ndraft: {model: x}\ncanary: {control_percent: 20, min_requests: 10, min_acceptance_rate: 0.5}\n")
    url = f"127.0.0.1:{srv.server_address[1]}"
    result = CliRunner().invoke(main, ["canary", str(recipe), "--url", url, "--window", "0.2"])
    assert result.exit_code == 0, result.output
    assert "PROMOTE" in result.output and "speedup 2.000x" in result.output
    handler.texts = [sink.text()]  # nothing new during the window
    result = CliRunner().invoke(main, ["canary", str(recipe), "--url", url, "--window", "0.2"])
    assert result.exit_code == 1 and "INCONCLUSIVE" in result.output
