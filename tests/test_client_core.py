"""The validation core against scripted fakes: statistics on known samples, triage, report files, gate codes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from client_fakes import CharCodec, FakeEndpoint, continuation
from specdeploy.client import gate, latency as lat, parity as par
from specdeploy.client.prompts import BUILTIN_CATEGORIES, Prompt, load_prompt_set
from specdeploy.client.protocol import Sampling, TargetTrace
from specdeploy.client.report import write_report
from specdeploy.client.validate import Options, parse_range, validate
from specdeploy.errors import ConfigError


# ---------------------------------------------------------------- prompts


def test_builtin_prompt_sets_have_a_few_dozen_per_category():
    prompts = load_prompt_set("builtin", 32)
    for category in BUILTIN_CATEGORIES:
        assert 24 <= sum(p.category == category for p in prompts) <= 40
    assert len({p.id for p in prompts}) == len(prompts)


def test_max_prompts_keeps_every_category():
    prompts = load_prompt_set("builtin", 32, max_prompts=8)
    assert len(prompts) == 8
    assert {p.category for p in prompts} == set(BUILTIN_CATEGORIES)


def test_user_jsonl(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n\n{"prompt": "x", "category": "c", "max_tokens": 5}\n')
    a, b = load_prompt_set(str(f), 9)
    assert (a.category, a.max_tokens, b.category, b.max_tokens, b.id) == ("custom", 9, "c", 5, "c-0")
    f.write_text('{"prompt": "hi", "temp": 1}\n')
    with pytest.raises(ConfigError, match="unknown key 'temp'"):
        load_prompt_set(str(f), 9)
    f.write_text("not json\n")
    with pytest.raises(ConfigError, match=":1 is not valid JSON"):
        load_prompt_set(str(f), 9)


# ---------------------------------------------------------------- latency statistics on known samples


def _sample(mode, latency, ttft, tokens, prompt="p0", category="chat", repeat=0, concurrency=1, drafted=None, accepted=None):
    return lat.RequestSample(mode, concurrency, repeat, prompt, category, 4 if mode == "speculative" else None, 0.0, latency, ttft, "server", tokens, drafted, accepted)


def test_tpot_and_percentiles_on_known_samples():
    s = _sample("control", latency=1.0, ttft=0.1, tokens=10)
    assert s.tpot_s == pytest.approx(0.9 / 9)
    assert _sample("control", 1.0, 0.1, 1).tpot_s is None
    latencies = [0.1 * i for i in range(1, 11)]  # 0.1 .. 1.0
    run = lat.LevelRun("control", 1, 0, None, wall_s=2.0, samples=[_sample("control", v, 0.05, 11, prompt=f"p{i}") for i, v in enumerate(latencies)])
    stats = lat.level_stats([run])
    assert stats["e2e_s_p50"] == pytest.approx(0.55)
    assert stats["e2e_s_p90"] == pytest.approx(0.91)
    assert stats["e2e_s_p99"] == pytest.approx(0.991)
    assert stats["e2e_s_mean"] == pytest.approx(0.55)
    assert stats["ttft_s_p50"] == pytest.approx(0.05)
    assert stats["tpot_s_p50"] == pytest.approx((0.55 - 0.05) / 10)
    assert stats["output_tokens_per_s"] == pytest.approx(110 / 2.0)
    assert stats["requests_per_s"] == pytest.approx(10 / 2.0)
    assert stats["acceptance_rate"] is None


def test_acceptance_rate_and_length():
    # 20 tokens, 12 of 16 drafted accepted -> 8 target iterations -> 2.5 tokens per call.
    samples = [_sample("speculative", 1.0, 0.1, 20, drafted=16, accepted=12)]
    rate, length = lat.acceptance(samples)
    assert rate == pytest.approx(0.75)
    assert length == pytest.approx(20 / 8)


def test_speedup_table_spread_over_repeats():
    runs = []
    for repeat, (c_lat, s_lat) in enumerate([(1.0, 0.5), (1.0, 0.4), (1.2, 0.8)]):
        for mode, value in (("control", c_lat), ("speculative", s_lat)):
            samples = [_sample(mode, value, 0.1, 10, prompt="a", category="chat", repeat=repeat),
                       _sample(mode, value * 2, 0.1, 10, prompt="b", category="code", repeat=repeat)]
            runs.append(lat.LevelRun(mode, 1, repeat, None, 1.0, samples))
    rows = {(r["concurrency"], r["category"]): r for r in lat.speedup_table(runs)}
    assert rows[(1, "all")]["per_repeat"] == pytest.approx([2.0, 2.5, 1.5])
    assert rows[(1, "all")]["median"] == pytest.approx(2.0)
    assert (rows[(1, "chat")]["min"], rows[(1, "chat")]["max"]) == pytest.approx((1.5, 2.5))
    assert set(c for _, c in rows) == {"all", "chat", "code"}


def test_expected_speedup_model_and_fit():
    assert lat.expected_tokens_per_round(0.0, 4) == 1.0
    assert lat.expected_tokens_per_round(1.0, 4) == 5.0
    assert lat.expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
    alpha, c = 0.8, 0.1
    assert lat.expected_acceptance_rate(0.5, 2) == pytest.approx(0.375)  # (0.5 + 0.25) / 2
    points = [
        {"k": k, "acceptance_rate": lat.expected_acceptance_rate(alpha, k), "acceptance_length": None, "speedup": lat.expected_speedup(alpha, k, c)}
        for k in range(1, 7)
    ]
    fitted_alpha, fitted_c = lat.fit_speedup_model(points)
    assert fitted_alpha == pytest.approx(alpha, abs=1e-3)
    assert fitted_c == pytest.approx(c, abs=1e-3)
    by_length = [{"k": p["k"], "acceptance_length": lat.expected_tokens_per_round(alpha, p["k"]), "speedup": p["speedup"]} for p in points]
    assert lat.fit_speedup_model(by_length)[0] == pytest.approx(alpha, abs=1e-3)
    rec = lat.recommend_k(points, fitted_alpha, fitted_c, max_k=6)
    best = max(range(1, 7), key=lambda k: lat.expected_speedup(alpha, k, c))
    assert rec["recommended_k"] == best


# ---------------------------------------------------------------- parity


def _prompt(text="hello", n=12):
    return Prompt("chat-0", text, "chat", n)


def test_divergence_located_at_the_corrupted_token():
    codec = CharCodec()
    control = continuation("hello", 12)
    spec = control[:5] + "Z" + control[6:]
    index, token = par.locate_divergence(codec.encode(control), spec, codec)
    assert (index, token) == (5, ord("Z"))
    assert par.locate_divergence(codec.encode(control), control, codec) == (None, None)
    assert par.locate_divergence(codec.encode(control), control[:7], codec) == (7, None)


def test_triage_near_tie_vs_real_mismatch():
    codec = CharCodec()
    control = continuation("hello", 12)
    spec = control[:3] + "Z" + control[4:]
    ids = codec.encode(control)
    logits = np.zeros((12, 256), dtype=np.float32)
    logits[np.arange(12), ids] = 5.0
    logits[3, ord("Z")] = 4.99  # a near-tie
    trace = TargetTrace([1, 2], ids, logits)
    item = par.compare_greedy(_prompt(), control, spec, codec, trace, near_tie_margin=0.05)
    assert (item.verdict, item.divergence_index, item.matched_tokens) == ("near_tie", 3, 3)
    assert item.token_margin == pytest.approx(0.01, abs=1e-5)
    assert item.top1_top2_margin == pytest.approx(0.01, abs=1e-5)
    logits[3, ord("Z")] = 1.0
    item = par.compare_greedy(_prompt(), control, spec, codec, trace, near_tie_margin=0.05)
    assert item.verdict == "mismatch" and not item.passes
    assert (item.control_token_text, item.speculative_token_text) == (control[3], "Z")
    assert par.compare_greedy(_prompt(), control, spec, codec, None, 0.05).verdict == "untriaged"


def test_summary_counts_near_ties_as_passing():
    items = [
        par.PromptParity("a", "chat", "match", "x", "x", 10, 10),
        par.PromptParity("b", "chat", "near_tie", "x", "y", 10, 4),
        par.PromptParity("c", "code", "mismatch", "x", "y", 10, 0),
    ]
    s = par.summarize(items)
    assert s["all"].exact_match_rate == pytest.approx(1 / 3)
    assert s["all"].parity_rate == pytest.approx(2 / 3)
    assert s["all"].token_agreement == pytest.approx(14 / 30)
    assert s["chat"].parity_rate == 1.0 and s["code"].mismatches == 1


def test_homogeneity_test_accepts_same_and_rejects_different_distributions():
    rng = np.random.default_rng(0)
    a = list(rng.choice(list("abc"), size=400, p=[0.5, 0.3, 0.2]))
    b = list(rng.choice(list("abc"), size=400, p=[0.5, 0.3, 0.2]))
    c = list(rng.choice(list("abc"), size=400, p=[0.2, 0.3, 0.5]))
    assert par.homogeneity_test(a, b)[2] > 0.01
    assert par.homogeneity_test(a, c)[2] < 1e-6
    assert par.homogeneity_test(["x"] * 10, ["x"] * 10) == (0.0, 0, 1.0)
    assert par.combine_p_values([0.5, 0.5]) > 0.3


# ---------------------------------------------------------------- the whole run, report and gate


def _options(**kw):
    base = dict(max_prompts=8, max_tokens=12, concurrency=(1, 2), repeats=2, request_timeout_s=5.0, num_draft_tokens=4, max_draft_len=6, warmup_requests=1)
    base.update(kw)
    return Options(**base)


def test_clean_run_passes_and_writes_a_complete_report(tmp_path):
    options = _options(sweep_draft_tokens=(1, 2, 3))
    report = validate(FakeEndpoint(), CharCodec(), options, "fake", progress=False)
    assert report["complete"] and not report["errors"]
    assert report["parity"]["summary"]["all"]["exact_match_rate"] == 1.0
    verdict = gate.evaluate(report, options.min_parity, options.min_speedup)
    assert verdict.exit_code == 0 and verdict.line.startswith("PASS")
    report["gate"] = verdict.to_dict()
    paths = write_report(report, tmp_path)
    assert set(paths) == {"json", "markdown", "latency", "categories", "sweep"}
    data = json.loads((tmp_path / "report.json").read_text())
    # every raw sample is kept: prompts x levels x repeats x 2 paths
    assert sum(len(r["samples"]) for r in data["latency"]["runs"]) == 8 * 2 * 2 * 2
    assert data["latency"]["speedups"][0]["median"] == pytest.approx(2.0)
    md = (tmp_path / "report.md").read_text()
    for heading in ("Greedy parity", "Latency", "Speedup", "Draft-length sweep", "latency.png"):
        assert heading in md
    for png in ("latency.png", "categories.png", "sweep.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_corrupted_token_fails_the_gate_with_its_index(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "alpha", "category": "a"}\n{"prompt": "beta", "category": "b"}\n')
    endpoint = FakeEndpoint(corrupt={"beta": (7, "Z", 3.0)})
    options = _options(prompt_set=str(prompts), max_prompts=0, concurrency=(1,), repeats=1)
    report = validate(endpoint, CharCodec(), options, progress=False)
    bad = [i for i in report["parity"]["items"] if i["verdict"] != "match"]
    assert len(bad) == 1 and bad[0]["divergence_index"] == 7 and bad[0]["verdict"] == "mismatch"
    assert bad[0]["token_margin"] == pytest.approx(3.0)
    verdict = gate.evaluate(report, 1.0, 1.0)
    assert verdict.exit_code == gate.EXIT_PARITY and "1 mismatches" in verdict.line


def test_near_tie_passes_by_default(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "alpha"}\n')
    report = validate(FakeEndpoint(corrupt={"alpha": (2, "Z", 0.01)}), CharCodec(), _options(prompt_set=str(prompts), max_prompts=0, concurrency=(1,), repeats=1), progress=False)
    assert report["parity"]["summary"]["all"]["near_ties"] == 1
    assert gate.evaluate(report, 1.0, 1.0).exit_code == 0


def test_slow_speculation_fails_speed_gate_and_warns():
    report = validate(FakeEndpoint(latency=(0.01, 0.02)), CharCodec(), _options(), progress=False)
    verdict = gate.evaluate(report, 1.0, 1.0)
    assert verdict.exit_code == gate.EXIT_SPEED and "0.50x < 1.00x" in verdict.line
    assert any("expected at high concurrency" in w for w in report["warnings"])
    assert gate.evaluate(report, 1.0, 0.0).exit_code == 0  # --min-speedup 0 disables the check


def test_server_dying_mid_run_keeps_partial_results(tmp_path):
    endpoint = FakeEndpoint(fail_after=30)
    report = validate(endpoint, CharCodec(), _options(), progress=False)
    assert not report["complete"] and "went away" in report["errors"][0]
    assert len(report["parity"]["items"]) == 8  # 16 calls
    runs = report["latency"]["runs"]
    assert runs and runs[-1]["error"]
    verdict = gate.evaluate(report, 1.0, 1.0)
    assert verdict.exit_code == gate.EXIT_INCOMPLETE and verdict.line.startswith("FAIL: incomplete run")
    report["gate"] = verdict.to_dict()
    write_report(report, tmp_path)
    assert "INCOMPLETE" in (tmp_path / "report.md").read_text()


def test_unreachable_server_reports_incomplete(tmp_path):
    report = validate(FakeEndpoint(ready=False), CharCodec(), _options(), progress=False)
    assert not report["complete"] and "cannot reach" in report["errors"][0]
    assert gate.evaluate(report, 1.0, 1.0).exit_code == gate.EXIT_INCOMPLETE
    paths = write_report(report, tmp_path)
    assert set(paths) == {"json", "markdown"}


def test_sampling_comparison_reports_p_value():
    options = _options(concurrency=(1,), repeats=1, sampling=Sampling(temperature=1.0, top_k=10, seed=1), samples_per_prompt=100, sample_prompts=2)
    report = validate(FakeEndpoint(), CharCodec(), options, progress=False)
    assert len(report["sampling"]["tests"]) == 2
    assert report["sampling"]["combined_p_value"] > 0.01
    assert gate.evaluate(report, 1.0, 1.0).exit_code == 0


def test_parse_range_and_sweep_bounds():
    assert parse_range("1..4") == (1, 2, 3, 4)
    assert parse_range("1,3") == (1, 3)
    with pytest.raises(ConfigError):
        parse_range("a..b")
    from specdeploy.config import parse_recipe

    recipe = parse_recipe({"name": "r", "target": {"model": "m"}, "draft": {"model": "m"}})
    with pytest.raises(ConfigError, match="outside 1..4"):
        Options.from_recipe(recipe, sweep_draft_tokens=(1, 5))
    assert Options.from_recipe(recipe, min_speedup=1.5).min_speedup == 1.5
