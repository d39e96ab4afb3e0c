"""specdeploy.metrics (recorder, exposition parser, windows, quantiles) and specdeploy.core.cost."""

from __future__ import annotations

import math

import pytest
from standin_engines import TableEngine

from specdeploy.core.cost import cost_of, level_cost
from specdeploy.core.errors import ClientError
from specdeploy.core.metrics import names as core_metrics_names
from specdeploy.core.metrics import reader, recorder, sinks
from specdeploy.engine.executor import Executor
from specdeploy.engine.generate import ExecutorProposer, ExecutorVerifier, target_only_generate
from specdeploy.speculation import loop as spec
from specdeploy.speculation import policy as pol


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _recorder(max_draft_len=4):
    sink = sinks.PrometheusClientSink()
    clock = FakeClock()
    return sink, recorder.Recorder(sink, "tensorrt_llm_bls", max_draft_len, clock=clock), clock


@pytest.mark.parametrize("declared", [False, True])
def test_recorder_rounds_and_request_appear_in_the_exposition(declared):
    sink, rec, clock = _recorder()
    if declared:  # what the Triton models do in initialize: every series exists at zero before the first request
        rec.declare_all()
        zero = reader.parse(sink.text())
        assert (
            zero.has(core_metrics_names.REQUESTS.name)
            and zero.sum(core_metrics_names.REQUESTS.name) == 0
            and zero.sum(core_metrics_names.RUNNING.name) == 0
        )
        assert set(zero.by_label(core_metrics_names.REQUESTS.name, "arm")) == set(core_metrics_names.ARMS)
        assert (
            reader.arm_stats(zero, "speculative").off_reasons == {}
            and reader.arm_stats(zero, "speculative").drafted_per_pos == {}
        )
    timer = rec.request_started(core_metrics_names.SPECULATIVE_ARM)
    running = reader.parse(sink.text())
    assert running.sum(core_metrics_names.RUNNING.name, arm="speculative") == 1
    # round 1: 4 drafted, all kept + 1 target token; round 2: 4 drafted, 1 kept; round 3: no draft (last token)
    clock.now += 0.5  # TTFT 0.5 s
    rec.round("speculative", drafted=4, accepted=4, emitted=5, draft_s=0.1, target_s=0.2)
    timer.tokens(5, clock.now)
    clock.now += 0.3
    rec.round("speculative", drafted=4, accepted=1, emitted=2, draft_s=0.1, target_s=0.2)
    timer.tokens(2, clock.now)
    clock.now += 0.2
    rec.round("speculative", drafted=0, accepted=0, emitted=1, draft_s=0.0, target_s=0.2)
    timer.tokens(1, clock.now)
    rec.request_finished(timer, prompt_tokens=11)

    snap = reader.parse(sink.text())
    a = reader.arm_stats(snap, "speculative")
    assert (a.requests, a.errors, a.running) == (1, 0, 0)
    assert (a.drafted, a.accepted, a.target_passes, a.output_tokens) == (8, 5, 3, 8)
    assert a.acceptance_rate == pytest.approx(5 / 8)
    assert a.tokens_per_round == pytest.approx(8 / 3)
    assert (a.rounds_on, a.rounds_off) == (2, 1)
    assert a.off_reasons == {core_metrics_names.REASON_LAST_TOKEN: 1}
    assert a.accepted_per_pos == {0: 2, 1: 1, 2: 1, 3: 1}
    assert a.drafted_per_pos == {0: 2, 1: 2, 2: 2, 3: 2}
    assert a.draft_s == pytest.approx(0.2) and a.target_s == pytest.approx(0.6)
    assert a.e2e_mean_s == pytest.approx(1.0)
    assert a.tpot_mean_s == pytest.approx((1.0 - 0.5) / 7)
    assert snap.sum(core_metrics_names.PROMPT_TOKENS.name) == 11
    # acceptance-length histogram: one round of 5 tokens, one of 2 (the undrafted round is not a draft)
    assert snap.buckets(core_metrics_names.ACCEPTANCE_LENGTH.name, arm="speculative")[:5] == [
        (1.0, 0),
        (2.0, 1),
        (3.0, 1),
        (4.0, 1),
        (5.0, 2),
    ]
    assert reader.arm_stats(snap, "control").requests == 0


def test_failed_request_counts_as_error_not_success():
    sink, rec, _ = _recorder()
    timer = rec.request_started(core_metrics_names.CONTROL_ARM)
    rec.request_finished(timer, prompt_tokens=3, ok=False)
    a = reader.arm_stats(reader.parse(sink.text()), "control")
    assert (a.requests, a.errors, a.running, a.output_tokens) == (0, 1, 0, 0)


def _engines():
    target = TableEngine.random(48, seed=3, scale=1.5)
    draft = TableEngine(target.table + 2.0 * TableEngine.random(48, seed=4).table)  # a draft that often disagrees
    return target, draft


class _Verifier(ExecutorVerifier):
    """ExecutorVerifier with the BLS verifier's `output_len` (the plain path asks for the whole answer)."""

    calls = 0

    def verify(self, sequence, draft_tokens, draft_logits, sampling, output_len=None):
        type(self).calls += 1
        if output_len is None:
            return super().verify(sequence, draft_tokens, draft_logits, sampling)
        from specdeploy.engine.request import EngineRequest, run

        return run(
            self.executor, EngineRequest(input_ids=sequence, max_new_tokens=output_len, sampling=sampling)
        ).token_ids


def _serve(ops, requested_k, k=4, max_tokens=30, prompt=(1, 2, 3)):
    """What tensorrt_llm_bls does with BlsOps around the real loop and the real static policy."""
    target, draft = _engines()
    deployment = pol.SharedPolicy(pol.PolicySettings("static", k))
    timer = ops.start(requested_k)
    rounds = spec.speculative_generate(
        ExecutorProposer(Executor(draft, 2)),
        ops.verifier(timer, _Verifier(Executor(target, 2)), max_tokens, len(prompt)),
        list(prompt),
        max_new_tokens=max_tokens,
        num_draft_tokens=ops.num_draft_tokens(timer, k),
        policy=ops.policy(timer, deployment.request(), deployment),
    )
    tokens, stats = [], None
    for item in rounds:
        if isinstance(item, spec.SpecStats):
            stats = item
        else:
            ops.tokens(timer, len(item))
            tokens.extend(item)
    ops.finish(timer, len(prompt), ok=True)
    return timer.arm, tokens, stats


def test_bls_ops_metrics_agree_with_the_loops_own_statistics():
    sink = sinks.PrometheusClientSink()
    ops = recorder.BlsOps(sink, "tensorrt_llm_bls", 4)
    arm, tokens, stats = _serve(ops, requested_k=True)
    a = reader.arm_stats(reader.parse(sink.text()), "speculative")
    assert arm == "speculative"
    assert 0 < stats.accepted < stats.drafted  # partial acceptance, so the test can tell counts apart
    assert (a.drafted, a.accepted, a.target_passes) == (stats.drafted, stats.accepted, stats.target_iterations)
    assert a.output_tokens == len(tokens) == stats.output_tokens == 30
    assert a.requests == 1 and a.running == 0
    # accepted at position i = rounds that accepted more than i drafts
    for pos in range(4):
        assert a.accepted_per_pos.get(pos, 0) == sum(1 for n in stats.accepted_per_round if n > pos)
    # the last round(s) cannot draft (one token left) and say so
    assert a.rounds_on == sum(1 for k in stats.k_per_round if k > 0)
    assert a.rounds_off == sum(1 for k in stats.k_per_round if k == 0) and set(a.off_reasons) <= {
        core_metrics_names.REASON_LAST_TOKEN
    }


def test_rounds_whose_draft_proposed_nothing_say_so():
    """An n-gram draft without a match: the round is a plain run, counted off with reason no_proposal (not
    last_token), and the tokens are the target's own."""
    from specdeploy.speculation.ngram import NGramProposer, NGramSettings

    target, _ = _engines()
    sink = sinks.PrometheusClientSink()
    ops = recorder.BlsOps(sink, "tensorrt_llm_bls", 4)
    deployment = pol.SharedPolicy(pol.PolicySettings("static", 4, probe_interval=5))
    timer = ops.start(True)
    prompt = [1, 2, 3, 4, 5, 6, 7]  # no pattern repeats: the first round has nothing to propose
    run = spec.speculative_generate(
        NGramProposer(NGramSettings(4, 3, min_matching_ngram_size=3)),
        ops.verifier(timer, _Verifier(Executor(target, 2)), 20, len(prompt)),
        prompt,
        max_new_tokens=20,
        num_draft_tokens=4,
        policy=ops.policy(timer, deployment.request(), deployment),
    )
    tokens, stats = spec.collect(run)
    expected = spec.collect(target_only_generate(Executor(target), prompt, 20))[0]
    assert tokens == expected
    a = reader.arm_stats(reader.parse(sink.text()), "speculative")
    assert stats.k_per_round[0] == 0 and stats.plain_run_tokens >= 5
    assert (
        a.off_reasons.get(core_metrics_names.REASON_NO_PROPOSAL, 0) >= 1 and a.target_passes == stats.target_iterations
    )


def test_canary_control_arm_is_one_target_call_with_the_same_greedy_tokens():
    sink = sinks.PrometheusClientSink()
    spec_arm, spec_tokens, _ = _serve(
        recorder.BlsOps(sink, "tensorrt_llm_bls", 4, control_percent=0), requested_k=False
    )
    ops = recorder.BlsOps(sink, "tensorrt_llm_bls", 4, control_percent=100)
    _Verifier.calls = 0
    arm, tokens, stats = _serve(ops, requested_k=False)
    assert (spec_arm, arm) == ("speculative", "control")
    assert tokens == spec_tokens  # greedy: the plain path gives the target's own tokens
    assert _Verifier.calls == 1 and stats.drafted == 0
    snap = reader.parse(sink.text())
    c = reader.arm_stats(snap, "control")
    assert (c.requests, c.output_tokens, c.target_passes, c.drafted) == (1, 30, 1, 0)
    assert c.off_reasons == {core_metrics_names.REASON_CONTROL_ARM: 1}
    assert c.tpot_p50_s is None  # the whole answer at once: no time per output token
    # a request that sets num_draft_tokens stays speculative whatever the share
    assert _serve(ops, requested_k=True)[0] == "speculative"


def test_canary_share_is_honoured_and_the_env_overrides_it(monkeypatch):
    ops = recorder.BlsOps(sinks.PrometheusClientSink(), "bls", 4, control_percent=20, seed=7)
    arms = [ops.start(False).arm for _ in range(2000)]
    assert 0.17 < arms.count("control") / 2000 < 0.23
    monkeypatch.setenv(recorder.CANARY_ENV, "100")
    assert recorder.BlsOps(sinks.PrometheusClientSink(), "bls", 4, control_percent=20).start(False).arm == "control"
    monkeypatch.setenv(recorder.CANARY_ENV, "0")
    assert recorder.BlsOps(sinks.PrometheusClientSink(), "bls", 4, control_percent=20).control_percent == 0.0


TRITON_TEXT = """\
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="ensemble",version="1"} 7
nv_inference_request_success{model="tensorrt_llm_bls",version="1"} 12
# HELP specdeploy_spec_decode_num_draft_tokens_total Draft tokens proposed.
# TYPE specdeploy_spec_decode_num_draft_tokens_total counter
specdeploy_spec_decode_num_draft_tokens_total{arm="speculative",model="tensorrt_llm_bls"} 40
# HELP specdeploy_e2e_request_latency_seconds End-to-end request latency in the server.
# TYPE specdeploy_e2e_request_latency_seconds histogram
specdeploy_e2e_request_latency_seconds_count{arm="speculative",model="tensorrt_llm_bls"} 8
specdeploy_e2e_request_latency_seconds_sum{arm="speculative",model="tensorrt_llm_bls"} 6.5
specdeploy_e2e_request_latency_seconds_bucket{arm="speculative",model="tensorrt_llm_bls",le="0.5"} 2
specdeploy_e2e_request_latency_seconds_bucket{arm="speculative",model="tensorrt_llm_bls",le="1"} 6
specdeploy_e2e_request_latency_seconds_bucket{arm="speculative",model="tensorrt_llm_bls",le="+Inf"} 8
"""


def test_parse_triton_style_exposition_and_quantiles():
    snap = reader.parse(TRITON_TEXT)
    assert snap.by_label("nv_inference_request_success", "model") == {"ensemble": 7, "tensorrt_llm_bls": 12}
    assert snap.sum(core_metrics_names.DRAFT_TOKENS.name, arm="speculative") == 40
    buckets = snap.buckets(core_metrics_names.E2E.name, arm="speculative")
    assert buckets == [(0.5, 2), (1.0, 6), (math.inf, 8)]
    # rank 4 of 8 lies in (0.5, 1], 2 of its 4 observations in: 0.5 + 0.5 * 2/4
    assert reader.histogram_quantile(0.5, buckets) == pytest.approx(0.75)
    assert reader.histogram_quantile(0.25, buckets) == pytest.approx(0.5)  # rank 2: the top of the first bucket
    assert reader.histogram_quantile(0.99, buckets) == 1.0  # in +Inf: the largest finite bound
    assert reader.histogram_quantile(0.5, []) is None
    odd = reader.parse('x_total{path="a\\"b,c}",k="v"} 2.5 1700000000\n')  # escaped quote, comma, brace; a timestamp
    assert odd.by_label("x_total", "path") == {'a"b,c}': 2.5}


def test_window_subtracts_counters_and_keeps_gauges():
    before = reader.parse('a_total{arm="x"} 5\nb_bucket{le="+Inf"} 2\ng{arm="x"} 3\n')
    after = reader.parse('a_total{arm="x"} 9\nb_bucket{le="+Inf"} 7\ng{arm="x"} 1\nc_total 4\n')
    w = after.minus(before)
    assert w.sum("a_total") == 4 and w.sum("b_bucket") == 5 and w.sum("g") == 1 and w.sum("c_total") == 4


def test_bad_exposition_and_unreachable_endpoint_are_client_errors():
    with pytest.raises(ClientError, match="not Prometheus format"):
        reader.parse("this is { not metrics\n")
    with pytest.raises(ClientError, match="cannot read metrics"):
        reader.scrape("127.0.0.1:1", timeout_s=0.5)
    assert reader.metrics_url("127.0.0.1:8002") == "http://127.0.0.1:8002/metrics"
    assert reader.metrics_url("http://h:1/metrics") == "http://h:1/metrics"


def test_metric_names_follow_the_conventions():
    names = core_metrics_names.names()
    assert len(names) == len(set(names))
    assert all(n.startswith("specdeploy_") for n in names)
    counters = [d for d in core_metrics_names.ALL_METRICS if d.kind == "counter"]
    assert all(d.name.endswith("_total") for d in counters)
    for vllm_suffix in (
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
        "spec_decode_num_drafts",
        "spec_decode_num_accepted_tokens_per_pos",
        "generation_tokens",
        "e2e_request_latency_seconds",
    ):
        assert any(n in (f"specdeploy_{vllm_suffix}", f"specdeploy_{vllm_suffix}_total") for n in names), vllm_suffix


def test_cost_per_response_and_per_1k_tokens():
    # 3.6 per hour = 0.001 per second; 2 responses/s -> 0.0005 each; 100 tokens/s -> 0.01 per 1000 tokens
    c = cost_of(3.6, requests_per_s=2.0, output_tokens_per_s=100.0)
    assert c.per_response == pytest.approx(0.0005)
    assert c.per_1k_output_tokens == pytest.approx(0.01)
    level = {"requests_per_s": 0.5, "output_tokens_per_s": 40.0}
    lc = level_cost(level, 7.2, "EUR")
    assert (lc.per_response, lc.per_1k_output_tokens, lc.currency) == (pytest.approx(0.004), pytest.approx(0.05), "EUR")
    assert cost_of(1.0, None, 0.0).per_response is None and cost_of(1.0, None, 0.0).per_1k_output_tokens is None
    with pytest.raises(ValueError):
        cost_of(-1.0, 1.0, 1.0)


def test_cost_section_for_the_report():
    from specdeploy.core.cost import cost_markdown, cost_section

    levels = [
        {"mode": "control", "concurrency": 1, "requests_per_s": 2.0, "output_tokens_per_s": 100.0},
        {"mode": "speculative", "concurrency": 1, "requests_per_s": 1.0, "output_tokens_per_s": None},
    ]
    assert cost_section(levels, 0.0) is None and cost_markdown(None) == []
    section = cost_section(levels, 3.6, "EUR")
    assert section["levels"][0] == {
        "mode": "control",
        "concurrency": 1,
        "per_response": pytest.approx(0.0005),
        "per_1k_output_tokens": pytest.approx(0.01),
        "currency": "EUR",
    }
    assert section["levels"][1]["per_1k_output_tokens"] is None
    text = "\n".join(cost_markdown(section))
    assert "| 1 | control | 0.000500 EUR | 0.0100 EUR |" in text and "| 1 | speculative | 0.0010 EUR | – |" in text
    assert "per machine-hour (recipe `cost.machine_price_per_hour`)" in text
    # a deployment without a recipe: the price came from the command line, and the report says so
    assert "per machine-hour (`--price-per-hour`)" in "\n".join(
        cost_markdown(cost_section(levels, 3.6, "EUR", "`--price-per-hour`"))
    )


def test_report_markdown_has_the_cost_table_when_a_price_is_set():
    from specdeploy.client.report_markdown import render_markdown
    from specdeploy.core.cost import cost_section

    levels = [{"mode": "speculative", "concurrency": 2, "requests_per_s": 4.0, "output_tokens_per_s": 200.0}]
    text = render_markdown({"recipe": "r", "cost": cost_section(levels, 7.2)})
    assert "## Cost" in text and "| 2 | speculative | 0.000500 USD | 0.0100 USD |" in text
    assert "## Cost" not in render_markdown({"recipe": "r", "cost": None})


def test_triton_sink_releases_its_metrics_at_close_and_creates_none_after():
    """BlsOps.close (the models' finalize) releases every pb_utils metric and family while the stub still runs; a
    metric update after it is dropped instead of creating a series again (a stand-in for pb_utils' classes)."""
    import gc
    import types
    import weakref

    created = []

    class Metric:
        def __init__(self, **kwargs):
            created.append(weakref.ref(self))

        def increment(self, value):
            pass

        observe = increment

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = range(3)

        def __init__(self, **kwargs):
            created.append(weakref.ref(self))

        def Metric(self, **kwargs):  # noqa: N802 - pb_utils' name
            return Metric(**kwargs)

    ops = recorder.BlsOps(sinks.TritonSink(types.SimpleNamespace(MetricFamily=MetricFamily)), "tensorrt_llm_bls", 2)
    ops.recorder.declare_all()
    ops.finish(ops.start(requested_k=False), prompt_tokens=3, ok=True)
    gc.collect()
    assert created and all(ref() is not None for ref in created)  # kept referenced while serving
    ops.close()
    gc.collect()
    assert all(ref() is None for ref in created)
    count = len(created)
    ops.finish(ops.start(requested_k=False), prompt_tokens=3, ok=True)
    assert len(created) == count


def test_fused_rounds_carry_the_models_seconds_of_each_pass_and_split_the_call_without_them():
    """A fused EAGLE-3 call: with the seconds tensorrt_llm returns (every engine pass, the prefill first; the head's
    work before each verification pass) each round's draft and target seconds are those, in the counters and in the
    returned rounds; without them (an older model) or misaligned, the call's time is split evenly over its passes
    and no draft time is invented; a plain call is one round of the whole call."""

    def run(pass_s, draft_s, drafted=(3, 0, 2), accepted=(2, 0, 1), call_s=0.9):
        sink = sinks.PrometheusClientSink()
        ops = recorder.BlsOps(sink, "tensorrt_llm_bls", 4)
        timer = ops.start(True)
        rounds = ops.fused_rounds(
            timer, 3, 4, 64, list(drafted), list(accepted), 8, call_s, None, pass_s=pass_s, draft_s=draft_s
        )
        return rounds, reader.arm_stats(reader.parse(sink.text()), "speculative")

    rounds, a = run([0.3, 0.1, 0.05, 0.08], [0.02, 0.01, 0.03])
    assert rounds.k == [0, 3, 0, 2] and rounds.accepted == [0, 2, 0, 1]
    assert rounds.target_s == [0.3, 0.1, 0.05, 0.08] and rounds.draft_s == [0.0, 0.02, 0.01, 0.03]
    assert a.target_s == pytest.approx(0.53) and a.draft_s == pytest.approx(0.06)  # the unsure head's 0.01 counts too
    for pass_s, draft_s in ((None, None), ([0.3, 0.1, 0.05], [0.02, 0.01, 0.03]), ([0.3, 0.1, 0.05, 0.08], [0.02])):
        rounds, a = run(pass_s, draft_s)
        assert rounds.draft_s == rounds.target_s == [] and a.target_s == pytest.approx(0.9) and a.draft_s == 0.0
    rounds, a = run([0.4], [], drafted=(), accepted=())  # plain: one round, the call's time
    assert rounds.k == [0] and rounds.target_s == [] and a.target_s == pytest.approx(0.9)
