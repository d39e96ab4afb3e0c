"""specdeploy.ops.canary: the promote / rollback decision from metric windows, and the `canary` command."""

from __future__ import annotations

import dataclasses
import http.server
import threading

import pytest
from click.testing import CliRunner

from specdeploy.client import metrics_check
from specdeploy.core.metrics import names, reader, recorder, sinks
from specdeploy.ops import canary as can
from specdeploy.recipe.config import CanaryConfig

CONFIG = CanaryConfig(
    control_percent=20, window_s=1.0, min_requests=10, min_speedup=1.2, max_p99_ratio=1.5, min_acceptance_rate=0.5
)


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def traffic(
    sink, arm: str, requests: int, latency_s: float, tokens: int, drafted: int = 0, accepted: int = 0, failures: int = 0
):
    """`requests` finished requests of `tokens` tokens each taking latency_s (with one round of drafts each)."""
    clock = Clock()
    rec = recorder.Recorder(sink, "tensorrt_llm_bls", 4, clock=clock)
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
    sink = sinks.PrometheusClientSink()
    before = reader.parse(sink.text())
    traffic(sink, "speculative", spec_n, spec_latency, 20, drafted=4, accepted=accepted, failures=spec_failures)
    traffic(sink, "control", ctrl_n, ctrl_latency, 20)
    return reader.parse(sink.text()).minus(before)


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
    sink = sinks.PrometheusClientSink()
    traffic(sink, "speculative", 20, 0.4, 20, drafted=4, accepted=4)
    traffic(sink, "speculative", 2, 30.0, 20, drafted=4, accepted=4)  # a slow tail
    traffic(sink, "control", 22, 1.0, 20)
    v = can.decide(reader.parse(sink.text()), dataclasses.replace(CONFIG, min_speedup=0.1), 10.0)
    assert v.p99_ratio > 1.5 and v.decision == can.ROLLBACK


def test_too_little_traffic_is_inconclusive():
    v = can.decide(_window(0.5, 1.0, ctrl_n=3), CONFIG, 10.0)
    assert v.decision == can.INCONCLUSIVE and v.exit_code == 1
    assert "control arm had 3 requests" in v.line and "wait longer" in v.line
    # a recipe that sends the control arm nothing: waiting cannot help, the fix is the recipe's share
    v = can.decide(_window(0.5, 1.0, ctrl_n=0), dataclasses.replace(CONFIG, control_percent=0.0), 10.0)
    assert v.decision == can.INCONCLUSIVE and "set canary.control_percent" in v.line and "wait longer" not in v.line


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
    from specdeploy.cli.main import main

    srv, handler = metrics_server
    sink = sinks.PrometheusClientSink()
    traffic(sink, "speculative", 50, 5.0, 20, drafted=4, accepted=0)  # old, bad traffic before the window
    before = sink.text()
    traffic(sink, "speculative", 30, 0.5, 20, drafted=4, accepted=3)
    traffic(sink, "control", 12, 1.0, 20)
    handler.texts = [before, sink.text()]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: r\ntarget: {model: x}\ndraft: {model: x}\ncanary: {control_percent: 20, min_requests: 10,"
        " min_acceptance_rate: 0.5}\n"
    )
    url = f"127.0.0.1:{srv.server_address[1]}"
    result = CliRunner().invoke(main, ["canary", str(recipe), "--url", url, "--window", "0.2"])
    assert result.exit_code == 0, result.output
    assert "PROMOTE" in result.output and "speedup 2.000x" in result.output
    handler.texts = [sink.text()]  # nothing new during the window
    result = CliRunner().invoke(main, ["canary", str(recipe), "--url", url, "--window", "0.2"])
    assert result.exit_code == 1 and "INCONCLUSIVE" in result.output
    # the server restarted inside the window (its counters began again): a fast-looking arm after the restart is
    # no verdict, whatever the subtraction would say
    restarted = sinks.PrometheusClientSink()
    traffic(restarted, "speculative", 30, 0.5, 20, drafted=4, accepted=3)
    traffic(restarted, "control", 12, 5.0, 20)
    handler.texts = [sink.text(), restarted.text()]
    result = CliRunner().invoke(main, ["canary", str(recipe), "--url", url, "--window", "0.2"])
    assert result.exit_code == 1 and "INCONCLUSIVE: the server restarted during the window" in result.output, (
        result.output
    )


def test_kubernetes_output_has_weighted_route_scrape_config_and_dashboard(tmp_path):
    import json
    from pathlib import Path

    import yaml

    from specdeploy.core.artifacts import Layout
    from specdeploy.gpu import k8s
    from specdeploy.recipe.load import load_recipe

    base = load_recipe(Path(__file__).parent.parent / "build" / "llama3-70b-fp8-engine.yaml")
    r = dataclasses.replace(
        base,
        canary=dataclasses.replace(base.canary, control_percent=20.0),
        cost=dataclasses.replace(base.cost, machine_price_per_hour=12.0),
    )
    docs = [d for d in yaml.safe_load_all(k8s.k8s_yaml(r, Layout.of(r, tmp_path))) if d]
    kinds = [d["kind"] for d in docs]
    assert kinds == [
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "Deployment",
        "Service",
        "HTTPRoute",
        "ServiceMonitor",
        "ConfigMap",
    ]
    spec_dep, spec_svc, _, ctrl_dep, ctrl_svc, route, monitor, dashboard_cm = docs
    env = lambda d: {e["name"]: e["value"] for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}  # noqa: E731
    assert env(spec_dep)[k8s.CANARY_ENV] == "0" and env(ctrl_dep)[k8s.CANARY_ENV] == "100"
    assert (
        ctrl_svc["spec"]["selector"]
        == ctrl_dep["spec"]["selector"]["matchLabels"]
        == ctrl_dep["spec"]["template"]["metadata"]["labels"]
    )
    assert (
        spec_svc["spec"]["selector"]["specdeploy.io/arm"] == "speculative"
        and ctrl_svc["spec"]["selector"]["specdeploy.io/arm"] == "control"
    )
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    split = route["spec"]["rules"][0]
    assert split["matches"][0]["path"]["value"] == "/v2/models/tensorrt_llm_bls"
    assert [(b["name"], b["weight"]) for b in split["backendRefs"]] == [
        (spec_svc["metadata"]["name"], 80),
        (ctrl_svc["metadata"]["name"], 20),
    ]
    assert all(isinstance(b["weight"], int) for b in split["backendRefs"])
    http = {p["name"]: p["port"] for p in spec_svc["spec"]["ports"]}["http"]
    assert all(b["port"] == http for b in split["backendRefs"])
    # the ServiceMonitor selects both Services and scrapes their named metrics port
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert all(selector.items() <= svc["metadata"]["labels"].items() for svc in (spec_svc, ctrl_svc))
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics" and any(
        p["name"] == "metrics" for p in spec_svc["spec"]["ports"]
    )
    # the dashboard queries exported metric names only
    board = json.loads(next(iter(dashboard_cm["data"].values())))
    exprs = " ".join(t["expr"] for p in board["panels"] for t in p["targets"])
    import re

    used = set(re.findall(r"specdeploy_[a-z0-9_]+", exprs))
    exported = set(names.names()) | {n + s for n in names.names() for s in ("_bucket", "_sum", "_count")}
    assert used and used <= exported, used - exported
    for needed in (
        names.ACCEPTED_TOKENS,
        names.DRAFT_TOKENS,
        names.TPOT,
        names.ROUNDS,
        names.RUNNING,
        names.GENERATION_TOKENS,
    ):
        assert needed.name in exprs
    assert any("Cost per 1k output tokens" in p["title"] for p in board["panels"])

    plain = [d["kind"] for d in yaml.safe_load_all(k8s.k8s_yaml(base, Layout.of(base, tmp_path))) if d]
    assert plain == ["Deployment", "Service", "HorizontalPodAutoscaler", "HTTPRoute", "ServiceMonitor", "ConfigMap"]


# ---------------------------------------------------------------- live: a real tritonserver with a 20 % control arm

PROMPTS = ["The quick brown fox", "def add(a, b):", "Triton Inference Server serves models", "Once upon a time"]


@pytest.mark.server
def test_live_metrics_match_a_known_run_and_canary_gives_a_verdict(tmp_path_factory):
    import ops_deploy

    from specdeploy.cli.main import main
    from specdeploy.client.protocol import GenerateRequest
    from specdeploy.client.triton_adapter import TritonEndpoint

    root = tmp_path_factory.mktemp("canary-live")
    model_dir = ops_deploy.make_model(root)
    _, _, recipe_path = ops_deploy.build(root, model_dir, "ops", canary={"control_percent": 20})
    layout_repo = root / "triton_repo" / "ops"
    assert 'key: "canary_control_percent"' in (layout_repo / "tensorrt_llm_bls" / "config.pbtxt").read_text()
    from specdeploy.core.artifacts import Layout
    from specdeploy.recipe.load import load_recipe

    layout = Layout.of(load_recipe(recipe_path), root)
    with ops_deploy.running(layout) as srv:
        endpoint = TritonEndpoint(srv.state.grpc_url)
        url = srv.state.metrics_url
        # a known run: requests that set num_draft_tokens always take the speculative arm
        before = reader.scrape(url)
        results = [
            endpoint.generate("tensorrt_llm_bls", GenerateRequest(p, 16, num_draft_tokens=3), 60) for p in PROMPTS
        ]
        # Triton counts a BLS request's success when it releases the request, which may be just after the client has
        # its answer: read the window once the counters stop moving, as validate's metrics check does
        window = metrics_check.settled(url, before, (names.REQUESTS.name, metrics_check.TRITON_SUCCESS), 5.0).minus(
            before
        )
        spec = reader.arm_stats(window, "speculative", "tensorrt_llm_bls")
        assert spec.requests == len(PROMPTS) and spec.errors == 0 and spec.running == 0
        assert (
            reader.count_mismatches(
                window, requests=len(PROMPTS), drafted=sum(r.perf.total_draft_tokens for r in results)
            )
            == []
        )
        assert reader.count_mismatches(window, requests=len(PROMPTS) + 1) == [
            f"requests: metrics say {len(PROMPTS)}, the client counted {len(PROMPTS) + 1} (arm speculative)"
        ]
        assert spec.drafted == sum(r.perf.total_draft_tokens for r in results) > 0
        assert spec.accepted == sum(r.perf.total_accepted_draft_tokens for r in results)
        # output tokens: the target alone's exact ids for the same prompts (greedy parity: the same count)
        assert spec.output_tokens == sum(len(endpoint.trace(p, 16, 60, with_logits=False).output_ids) for p in PROMPTS)
        assert window.sum(names.PROMPT_TOKENS.name, arm="speculative") > 0
        assert reader.arm_stats(window, "control").requests == 0
        assert window.sum("nv_inference_request_success", model="tensorrt_llm_bls") == len(PROMPTS)
        frame = CliRunner().invoke(main, ["monitor", str(recipe_path), "--url", url, "--once", "--interval", "0.2"])
        assert frame.exit_code == 0, frame.output
        row = next(line.split() for line in frame.output.splitlines() if line.startswith("speculative"))
        assert row[1:3] == [str(len(PROMPTS)), "0"] and row[4] == "1.000"  # the draft is the target: all accepted

        # live traffic without num_draft_tokens: 20 % goes down the plain path; the canary watches it
        stop = threading.Event()
        texts: list[str] = []

        def traffic():
            client = TritonEndpoint(srv.state.grpc_url)
            while not stop.is_set():
                texts.append(client.generate("tensorrt_llm_bls", GenerateRequest(PROMPTS[0], 16), 60).text)

        worker = threading.Thread(target=traffic, daemon=True)
        worker.start()
        try:
            result = CliRunner().invoke(
                main,
                ["canary", str(recipe_path), "--url", url, "--window", "240", "--min-requests", "2", "--until-enough"],
            )
        finally:
            stop.set()
            worker.join(timeout=60)
    assert result.exit_code in (0, 3), result.output  # a verdict, not "inconclusive"
    assert ("PROMOTE" in result.output) == (result.exit_code == 0) and ("ROLLBACK" in result.output) == (
        result.exit_code == 3
    )
    rows = {
        line.split()[0]: line.split()
        for line in result.output.splitlines()
        if line.startswith(("speculative", "control"))
    }
    assert int(rows["speculative"][1]) >= 2 and int(rows["control"][1]) >= 2
    assert len(set(texts)) == 1  # greedy: both arms give the same answer


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"canary": {"control_percent": 120}}, "canary.control_percent"),
        ({"canary": {"window_s": 0}}, "canary.window_s"),
        ({"canary": {"min_requests": 0}}, "canary.min_requests"),
        ({"canary": {"min_acceptance_rate": 2}}, "canary.min_acceptance_rate"),
        ({"cost": {"machine_price_per_hour": -1}}, "cost.machine_price_per_hour"),
        ({"cost": {"price": 3}}, "cost.price"),
    ],
)
def test_recipe_refuses_bad_operations_keys_naming_them(section, key):
    from specdeploy.core.errors import ConfigError
    from specdeploy.recipe.load import parse_recipe

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_recipe({"name": "r", "target": {"model": "x"}, "draft": {"model": "x"}, **section})
