"""Speculation policies on scripted acceptance/cost traces (no clocks, no engines)."""

from __future__ import annotations

import json
import os

import pytest

from specdeploy.core.errors import ConfigError
from specdeploy.recipe.load import parse_recipe
from specdeploy.speculation import costs, sharing
from specdeploy.speculation import policy as pol
from specdeploy.speculation import schedule as speculation_schedule
from specdeploy.speculation.costs import RoundOutcome
from specdeploy.speculation.policy import PolicySettings, SharedPolicy
from specdeploy.speculation.schedule import AcceptanceGate


def test_draft_len_schedule_uses_upper_bounds():
    schedule = {2: 4, 4: 2}
    got = [speculation_schedule.scheduled_draft_len(schedule, active, 6) for active in range(1, 7)]
    assert got == [4, 4, 2, 2, 0, 0]  # 1-2 -> 4, 3-4 -> 2, above the last bound: off
    assert speculation_schedule.scheduled_draft_len(None, 9, 5) == 5
    assert speculation_schedule.schedule_from(None, 3) == {
        3: None
    }  # max_concurrency: off above 3, the request's own k up to it
    assert [speculation_schedule.scheduled_draft_len({3: None}, active, 6) for active in (1, 3, 4)] == [6, 6, 0]
    assert speculation_schedule.schedule_from({1: 4, 8: 1}, 3) == {1: 4, 8: 1}


def test_static_policy_follows_the_active_count():
    active = [1]
    deployment = SharedPolicy(PolicySettings("static", 4, draft_len_schedule={1: 4, 3: 2}), active=lambda: active[0])
    request = deployment.request()
    seen = []
    for n in (1, 2, 3, 4, 1):
        active[0] = n
        seen.append(request.choose(4))
    assert seen == [4, 2, 2, 0, 4]
    assert request.choose(1) == 1  # the request's own k (cap) still bounds it
    deployment = SharedPolicy(PolicySettings("static", 4, max_concurrency=2), active=lambda: active[0])
    active[0] = 3
    assert deployment.request().choose(4) == 0
    # up to max_concurrency a request drafts the k it asks for, also above num_draft_tokens (TensorRT-LLM's
    # max_concurrency only turns speculation off above it): validate's draft-length sweep asks for 1..max_draft_len
    active[0] = 2
    assert [deployment.request().choose(k) for k in (1, 4, 6)] == [1, 4, 6]
    assert "max_concurrency 2" in deployment.describe()


def test_gate_trips_only_after_a_full_window():
    gate = AcceptanceGate(window=4, threshold=0.5)
    assert [gate.record(0.1) for _ in range(3)] == [False] * 3 and not gate.disabled  # window not full yet
    assert gate.record(0.1) is True and gate.disabled and gate.tripped_mean == pytest.approx(0.1)
    assert gate.record(1.0) is False and gate.disabled  # off for good
    rolling = AcceptanceGate(window=4, threshold=0.5)
    for rate in (1.0, 1.0, 1.0, 1.0, 0.0, 0.0):  # the mean of the last 4: 0.5 is not below 0.5
        assert rolling.record(rate) is False
    assert rolling.record(0.0) is True  # (1 + 0 + 0 + 0) / 4 = 0.25
    assert not AcceptanceGate(0, 0.5).record(0.0)  # window 0: no gate


def test_gate_turns_the_deployment_off_for_every_request():
    deployment = SharedPolicy(PolicySettings("static", 4, acceptance_rate_window_size=3, acceptance_rate_threshold=0.6))
    first = deployment.request()
    for _ in range(3):
        assert first.choose(4) == 4
        first.record(RoundOutcome(4, 4, 1, 2, 0.0, 0.0))  # acceptance rate 0.25
    assert deployment.gate.disabled and first.choose(4) == 0 and deployment.request().choose(4) == 0
    assert "off since mean 0.25" in deployment.describe()


class Trace:
    """A scripted deployment: plain step = 10 ms, verification grows `slope` per extra row, the draft
    costs `draft_ms` per token; acceptance of each round comes from `accept(round, k)`."""

    def __init__(self, settings, draft_ms, slope=0.1):
        self.deployment = SharedPolicy(settings)
        self.draft_ms, self.slope = draft_ms, slope
        self.ks = []

    def run(self, request, rounds, accept):
        last_k = None
        for i in range(rounds):
            k = request.choose(4)
            accepted = accept(i, k) if k else 0
            request.record(
                RoundOutcome(
                    k,
                    k,
                    accepted,
                    accepted + 1,
                    self.draft_ms * k / 1000,
                    0.010 * (1 + self.slope * k),
                    draft_fresh=last_k not in (None, 0),
                    first_round=i == 0,
                )
            )
            self.ks.append(k)
            last_k = k
        return self.ks[-rounds:]


def test_cost_policy_picks_plain_steps_when_the_draft_costs_too_much():
    # c = 1.2 (draft step 12 ms vs 10 ms target step) and 90 % acceptance: every k > 0 loses.
    trace = Trace(PolicySettings("cost", 4, probe_interval=8), draft_ms=12.0)
    ks = trace.run(trace.deployment.request(), 200, lambda i, k: k if i % 10 else k - 1)
    assert ks[:2] == [4, 4]  # exploration times the full draft first
    tail = ks[20:]
    assert tail.count(0) / len(tail) > 0.9  # plain decoding, with rare probes
    assert 0 < sum(1 for k in tail if k) <= 10  # probes back off (interval doubles up to MAX_PROBE_INTERVAL)


def test_cost_policy_keeps_a_cheap_draft_speculating():
    # an n-gram-like draft (0.05 ms) with 90 % acceptance: the full k wins every round after exploring.
    trace = Trace(PolicySettings("cost", 4), draft_ms=0.05)
    ks = trace.run(trace.deployment.request(), 60, lambda i, k: k if i % 10 else k - 1)
    assert set(ks[10:]) == {4}


def test_cost_policy_falls_back_at_once_and_comes_back():
    trace = Trace(PolicySettings("cost", 4, probe_interval=4), draft_ms=2.0)
    request = trace.deployment.request()
    good = trace.run(request, 30, lambda i, k: k)  # the draft is always right
    assert set(good[10:]) == {4}
    bad = trace.run(request, 30, lambda i, k: 0)  # the draft stops being right
    plain_from = bad.index(0)
    assert plain_from <= 4  # within a few rounds, not after a window, and not for good:
    assert bad[plain_from + 1 : plain_from + 4] == [0, 0, 0]
    again = trace.run(request, 30, lambda i, k: k)  # right again: a probe finds out and speculation resumes
    assert again[-10:] == [4] * 10
    assert again.index(4) <= 8  # the first probe came after probe_interval plain rounds


def test_cost_policy_respects_the_gate_and_the_schedule():
    active = [5]
    deployment = SharedPolicy(PolicySettings("cost", 4, draft_len_schedule={4: 4}), active=lambda: active[0])
    assert deployment.request().choose(4) == 0  # 5 active > the last bound
    active[0] = 1
    assert deployment.request().choose(4) == 4


def test_expected_tokens_and_cost_model_estimates():
    assert costs.expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert costs.expected_tokens(1.0, 4) == pytest.approx(5.0)
    assert costs.expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    model = costs.CostModel()
    for rows, seconds in ((1, 0.010), (3, 0.014)):
        for _ in range(3):
            model.observe(RoundOutcome(rows - 1, rows - 1, 0, 1, 0.004 * (rows - 1), seconds))
    # verification interpolates/extrapolates linearly in rows; the draft scales with k from its one point
    assert model.round_seconds(0) == pytest.approx(0.010)
    assert model.round_seconds(1) == pytest.approx(0.012 + 0.004)
    assert model.round_seconds(4) == pytest.approx(0.018 + 0.016)
    assert model.best_k(0.0, 4) == 0 and model.best_k(0.99, 4) == 4


def test_settings_from_recipe_and_bls_parameters():
    raw = {
        "name": "x",
        "target": {"model": "m"},
        "draft": {"model": "m"},
        "speculative": {
            "num_draft_tokens": 3,
            "policy": "cost",
            "probe_interval": 5,
            "dynamic": {"draft_len_schedule": [[2, 3], [4, 1]], "acceptance_window": 8, "acceptance_threshold": 0.3},
        },
    }
    settings = PolicySettings.from_recipe(parse_recipe(raw).speculative)
    assert settings == PolicySettings("cost", 3, {2: 3, 4: 1}, None, 8, 0.3, "rate", 5)
    assert PolicySettings.from_parameters(settings.to_parameters(), 3) == settings
    assert PolicySettings.from_parameters({}, 4) == PolicySettings("static", 4)


@pytest.mark.parametrize(
    "speculative, draft, message",
    [
        ({"policy": "fastest"}, {"model": "m"}, "speculative.policy"),
        ({"probe_interval": 0}, {"model": "m"}, "speculative.probe_interval"),
        ({}, {"kind": "ngrams"}, "draft.kind"),
        ({}, {"kind": "ngram", "model": "m"}, "draft.model"),
        ({}, {"model": "m", "max_matching_ngram_size": 2}, "draft.max_matching_ngram_size"),
        ({"max_draft_len": 4}, {"kind": "ngram", "max_draft_len": 5}, "draft.max_draft_len"),
        ({"use_draft_logits": True}, {"kind": "ngram"}, "use_draft_logits"),
        ({}, {}, "draft.model"),
    ],
)
def test_recipe_keys_are_checked_at_the_edge(speculative, draft, message):
    raw = {"name": "x", "target": {"model": "m"}, "draft": draft, "speculative": speculative}
    with pytest.raises(ConfigError) as info:
        parse_recipe(raw)
    assert message in str(info.value) + str(getattr(info.value, "hint", ""))


def test_ngram_recipe_has_only_the_target_to_build():
    recipe = parse_recipe({"name": "x", "target": {"model": "m"}, "draft": {"kind": "ngram"}})
    assert recipe.model_roles == ("target",)
    assert parse_recipe({"name": "x", "target": {"model": "m"}, "draft": {"model": "m"}}).model_roles == (
        "target",
        "draft",
    )


def test_active_count_counts_busy_living_instances(tmp_path):
    import os

    count = sharing.ActiveCount(tmp_path / "active")
    assert count() == 1  # no one busy: at least the asking request
    count.set_busy(True)
    (tmp_path / "active" / str(os.getppid())).write_text("1")  # another living instance, busy
    (tmp_path / "active" / "999999999").write_text("1")  # a dead process: not counted
    assert count() == 2
    count.set_busy(False)
    assert count() == 1
    count.close()
    assert not (tmp_path / "active" / str(os.getpid())).exists()


def _exploring_rounds(deployment: SharedPolicy) -> int:
    """Rounds a fresh request of `deployment` spends until the cost model is calibrated (c = 1.2, never right)."""
    request, rounds = deployment.request(), 0
    while not (deployment.costs.calibrated() and not deployment.costs.unmeasured(1)):
        k = request.choose(4)
        request.record(RoundOutcome(k, k, 0, 1, 0.012 * k, 0.010 * (1 + 0.1 * k), draft_fresh=k > 0))
        rounds += 1
    return rounds


def test_instances_of_one_server_share_what_they_measured(tmp_path):
    """Two BLS instances (two Deployments in two processes, here two objects) of one server: what the first
    measured is the second's from its next request, so it does not explore again; a server restart starts afresh."""
    settings = PolicySettings("cost", 4, acceptance_rate_window_size=2, acceptance_rate_threshold=0.5)
    a, b = SharedPolicy(settings), SharedPolicy(settings)
    shared_a, shared_b = sharing.SharedState(tmp_path, a, 4242), sharing.SharedState(tmp_path, b, 4242)
    shared_a.pull()
    assert _exploring_rounds(a) >= 4
    shared_a.push()
    shared_b.pull()
    assert b.costs == a.costs and b.costs.calibrated() and b.acceptance == a.acceptance
    assert b.gate.disabled and b.request().choose(4) == 0  # the gate tripped on a's rounds: off for the deployment
    assert _exploring_rounds(b) == 0
    fresh = SharedPolicy(settings)
    sharing.SharedState(tmp_path, fresh, 4343).pull()  # another server (pid) of the same repository
    assert not fresh.costs.calibrated() and not fresh.gate.disabled


def test_concurrent_requests_of_two_instances_both_count(tmp_path):
    """Both instances pulled the same state and measured one round each: after both pushes the shared state holds
    both rounds (the second push replays its rounds onto the first's result, not onto what it had pulled)."""
    a, b = SharedPolicy(PolicySettings("cost", 4)), SharedPolicy(PolicySettings("cost", 4))
    shared_a, shared_b = sharing.SharedState(tmp_path, a, 7), sharing.SharedState(tmp_path, b, 7)
    shared_a.pull(), shared_b.pull()
    a.request().record(RoundOutcome(0, 0, 0, 1, 0.0, 0.010))
    b.request().record(RoundOutcome(2, 2, 2, 3, 0.02, 0.012))
    shared_a.push(), shared_b.push()
    assert b.costs.verify_n == {1: 1, 3: 1} and b.acceptance.rounds == 1
    shared_a.pull()
    assert a.costs == b.costs and a.state() == b.state()
    assert not a.journal and not b.journal  # shared once, not again on the next push


def test_sharing_that_fails_never_stops_the_instance(tmp_path, capsys):
    """An unreadable state starts afresh; a folder that cannot be written leaves the instance its own measurements,
    said on stderr (the server log), and the request is not failed by it."""
    d = SharedPolicy(PolicySettings("cost", 4))
    shared = sharing.SharedState(tmp_path, d, 5)
    shared.files[0].write_text("{not json")
    shared.pull()  # nothing usable: keeps what it has
    d.request().record(RoundOutcome(0, 0, 0, 1, 0.0, 0.010))
    shared.push()
    assert json.loads(shared.files[0].read_text())["version"] == 1
    shared.files[0].unlink()
    shared.files[1].unlink()
    tmp_path.chmod(0o500)  # no writes (root ignores modes: then the lock path is made a folder instead)
    try:
        if os.access(tmp_path, os.W_OK):
            shared.files[1].mkdir()
        d.request().record(RoundOutcome(2, 2, 2, 3, 0.02, 0.012))
        shared.push()
    finally:
        tmp_path.chmod(0o700)
    assert "could not share the speculation policy's measurements" in capsys.readouterr().err
    assert d.costs.verify_n == {1: 1, 3: 1} and d.journal == []  # its own measurements, nothing queued twice


def test_shared_state_files_go_with_their_server(tmp_path):
    (tmp_path / "policy-999999999.json").write_text("{}")  # a server that is gone
    (tmp_path / "policy-999999999.lock").write_text("")
    d = SharedPolicy(PolicySettings("cost", 4))
    shared = sharing.SharedState(tmp_path, d, 11)
    assert not list(tmp_path.glob("policy-999999999*"))
    d.request().record(RoundOutcome(0, 0, 0, 1, 0.0, 0.010))
    shared.push()
    assert (tmp_path / "policy-11.json").exists()
    mine, other = sharing.ActiveCount(tmp_path), tmp_path / str(os.getppid())
    other.write_text("0")  # another live instance of the server
    mine.close(when_last=shared.files)  # it still serves: the state stays
    assert (tmp_path / "policy-11.json").exists() and not mine.mine.exists()
    other.unlink()
    sharing.ActiveCount(tmp_path).close(when_last=shared.files)  # the last instance leaves: state and folder go
    assert not tmp_path.exists()


def test_folders_of_servers_that_are_gone_are_swept(tmp_path):
    import time

    def folder(name, *files, age_s=600.0):
        path = tmp_path / name
        path.mkdir()
        for f in files:
            (path / f).write_text("0")
        os.utime(path, (time.time() - age_s, time.time() - age_s))
        return path

    gone = folder(sharing.INSTANCES_PREFIX + "a", "999999999", "policy-999999998.json", "policy-999999998.lock")
    live = folder(sharing.INSTANCES_PREFIX + "b", "999999999", str(os.getpid()))  # one instance still runs
    live_server = folder(sharing.INSTANCES_PREFIX + "c", "policy-%d.json" % os.getpid())
    starting = folder(sharing.INSTANCES_PREFIX + "d", "999999999", age_s=5)  # changed just now: a server starting
    other = folder("somebody-else", "999999999")
    assert sharing.remove_abandoned(tmp_path) == 1
    assert not gone.exists() and live.exists() and live_server.exists() and starting.exists() and other.exists()


# ---------------------------------------------------------------- plain runs (k = 0 rounds of several tokens)


def test_plain_run_lengths_follow_why_speculation_is_off():
    # the gate tripped: the rest of the request in one call
    gated = SharedPolicy(PolicySettings("static", 4, acceptance_rate_window_size=2, acceptance_rate_threshold=0.5))
    request = gated.request()
    for _ in range(2):
        request.choose(4)
        request.record(RoundOutcome(4, 4, 0, 1, 0.01, 0.01))
    assert gated.gate.disabled and request.choose(4) == 0 and request.plain_tokens(37) == 37
    # the request asked for no draft tokens (cap 0): all that remain, whatever the policy
    for name in pol.POLICIES:
        request = SharedPolicy(PolicySettings(name, 4)).request()
        assert request.choose(0) == 0 and request.plain_tokens(20) == 20
    # the schedule holds speculation off (too many active): a bounded run, the active count may fall
    active = [9]
    busy = SharedPolicy(
        PolicySettings("cost", 4, draft_len_schedule={4: 4}, probe_interval=6), active=lambda: active[0]
    )
    request = busy.request()
    assert request.choose(4) == 0 and request.plain_tokens(50) == 6 and request.plain_tokens(3) == 3


def test_cost_policy_runs_plain_tokens_until_the_next_probe():
    trace = Trace(PolicySettings("cost", 4, probe_interval=8), draft_ms=12.0)
    request = trace.deployment.request()
    explored = []
    while trace.deployment.costs.unmeasured(1) or not trace.deployment.costs.calibrated():
        k = request.choose(4)
        if k == 0:
            explored.append(request.plain_tokens(100))  # exploration times single plain steps
        request.record(RoundOutcome(k, k, 0, 1, 0.004 * k, 0.010 * (1 + 0.1 * k), draft_fresh=k > 0))  # never right
    assert explored and set(explored) == {1}
    before = request.plain_rounds  # exploration ended on plain steps: they count towards the probe
    assert explored.count(1) == before == 2
    assert request.choose(4) == 0  # c = 1.2: plain decoding pays more
    assert request.plain_tokens(100) == 8 - before  # the plain tokens until probe_interval, in one call
    assert request.plain_tokens(3) == 3  # never more than remain
    request.record(RoundOutcome(0, 0, 0, 4, 0.0, 0.032, plain_run=6))  # the run stopped early (end id): 4 tokens
    assert request.plain_rounds == before + 4
    assert request.choose(4) == 0 and request.plain_tokens(100) == 2  # the rest of the interval
    request.record(RoundOutcome(0, 0, 0, 2, 0.0, 0.016, plain_run=2))
    assert request.choose(4) > 0  # 8 plain tokens since the last speculating round: a probe


def test_plain_runs_are_costed_per_token_apart_from_one_row_steps():
    model = costs.CostModel()
    for _ in range(2):
        model.observe(RoundOutcome(0, 0, 0, 1, 0.0, 0.012))  # one-row steps, each with its round trip
        model.observe(RoundOutcome(2, 2, 1, 2, 0.004, 0.016))
    model.observe(RoundOutcome(0, 0, 0, 8, 0.0, 0.064, plain_run=8))  # 8 ms per token in one call
    assert model.verify_s[1] == pytest.approx(0.012) and model.plain_token_s == pytest.approx(0.008)
    assert model.round_seconds(0) == pytest.approx(0.008)  # a fallback runs: its per-token cost
    assert model.round_seconds(2) == pytest.approx(0.016 + 0.004)  # rounds keep their measured cost
    # a run asked for 8 that ended after one token is a one-row step, not a run
    assert not RoundOutcome(0, 0, 0, 1, 0.0, 0.01, plain_run=8).is_run
    assert not RoundOutcome(2, 2, 2, 3, 0.0, 0.01, plain_run=1).is_run


def test_a_draft_that_cannot_pay_even_when_always_right_is_probed_rarely():
    # draft step 12 ms, plain step 10 ms: k + 1 tokens cost more than k + 1 plain steps at any k
    trace = Trace(PolicySettings("cost", 4, probe_interval=8), draft_ms=12.0)
    trace.run(trace.deployment.request(), 12, lambda i, k: k)  # calibrate (acceptance 100 %)
    request = trace.deployment.request()
    assert request.choose(4) == 0 and request.plain_tokens(500) == pol.MAX_PROBE_INTERVAL
    # a cheap draft that is often wrong keeps the short interval (a probe may find it right again)
    cheap = Trace(PolicySettings("cost", 4, probe_interval=8), draft_ms=0.05)
    cheap.run(cheap.deployment.request(), 40, lambda i, k: 0)
    request = cheap.deployment.request()
    assert request.choose(4) == 0 and request.plain_tokens(500) == 8


def test_speculation_must_beat_plain_steps_by_the_margin():
    """A k predicted at break-even (or a hair above) stays plain; one clearly ahead is chosen."""
    model = costs.CostModel()
    for _ in range(2):
        model.observe(RoundOutcome(0, 0, 0, 1, 0.0, 0.010))
        model.observe(RoundOutcome(1, 1, 1, 2, 0.009, 0.010))  # k = 1: 2 tokens in 19 ms vs 20 ms plain: +5.3 %
    assert model.tokens_per_s(1.0, 1) / model.tokens_per_s(1.0, 0) == pytest.approx(20 / 19)
    assert model.best_k(1.0, 1) == 1  # just over the margin
    assert model.best_k(0.95, 1) == 0  # 1.95 tokens in 19 ms: 2.6 % ahead, inside the margin
    assert model.tokens_per_s(0.95, 1) > model.tokens_per_s(0.95, 0)


def test_a_schedule_hold_runs_long_when_no_draft_could_pay():
    """Held off by the schedule with a draft that cannot pay even when always right: one call runs
    MAX_PROBE_INTERVAL tokens, not probe_interval (the re-check could only let it speculate at a loss)."""
    active = [1]
    trace = Trace(PolicySettings("cost", 4, max_concurrency=1, probe_interval=8), draft_ms=12.0)
    trace.deployment.active = lambda: active[0]
    trace.run(trace.deployment.request(), 12, lambda i, k: k)  # calibrate alone (acceptance 100 %)
    active[0] = 2
    request = trace.deployment.request()
    assert request.choose(4) == 0 and request.plain_tokens(500) == pol.MAX_PROBE_INTERVAL
    assert request.plain_tokens(20) == 20
    cheap = Trace(PolicySettings("cost", 4, max_concurrency=1, probe_interval=8), draft_ms=0.05)
    cheap.deployment.active = lambda: active[0]
    active[0] = 1
    cheap.run(cheap.deployment.request(), 12, lambda i, k: k)
    active[0] = 2
    request = cheap.deployment.request()
    assert request.choose(4) == 0 and request.plain_tokens(500) == 8  # a draft that pays: re-check soon
