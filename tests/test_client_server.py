"""The validation client against a real tritonserver serving specdeploy's CPU engine (loopback only).

Tiny random checkpoints go through the real quantize (FP8 target; its INT8 weight-only copy as the draft)
and build stages, and the module's servers run them with the native kernels where the machine has them.
The draft differs from its target, so the speculative path both accepts and rejects draft tokens. A
test-only executor hook wraps the CPU engine and corrupts one token of the speculative path for one prompt.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from tiny_models import SERVER_READY_TIMEOUT_S

from specdeploy.client import gate  # noqa: E402
from specdeploy.client.triton_adapter import TritonEndpoint  # noqa: E402
from specdeploy.core.artifacts import Layout
from specdeploy.core.errors import ClientError  # noqa: E402
from specdeploy.deploy.recipe_deployment import tokenizer_dir, validate_recipe  # noqa: E402
from specdeploy.recipe.load import parse_recipe
from specdeploy.triton import ports
from specdeploy.triton import server as server_mod  # noqa: E402

TESTS_DIR = Path(__file__).resolve().parent
CLEAN_PROMPTS = [
    ("The quick brown fox", "chat"),
    ("def add(a, b):", "code"),
    ("Triton Inference Server serves models", "summarization"),
]
MAX_TOKENS = 16

pytestmark = pytest.mark.server  # the server binary is fetched on first use, never skipped


def _recipe_dict(target: Path, draft: Path, name: str = "clienttest", decoupled: bool = False) -> dict:
    calibration = {"calib_size": 4, "calib_max_seq_length": 32}
    return {
        "name": name,
        "triton": {"decoupled": decoupled},
        "backend": "cpu",
        "target": {"model": str(target), "quantization": {**calibration, "qformat": "fp8"}},
        "draft": {"model": str(draft), "quantization": {**calibration, "qformat": "int8_wo"}},
        "speculative": {"max_draft_len": 4, "num_draft_tokens": 3},
        "engine": {"dtype": "bfloat16", "max_batch_size": 4, "max_input_len": 512, "max_seq_len": 640},
        "validation": {
            "max_tokens": MAX_TOKENS,
            "min_compared_tokens": MAX_TOKENS // 2,
            "chat_template": "none",
            "concurrency": [1, 2],
            "repeats": 1,
            "min_speedup": 0.0,
            "request_timeout_s": 30.0,
        },
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_llama_dir):
    """engines/ of a real quantize + build of the tiny model (FP8 target, INT8 weight-only draft)."""
    from specdeploy.deploy.cpu_build import build_recipe
    from specdeploy.quantize.stage import quantize_recipe

    root = tmp_path_factory.mktemp("client-build")
    recipe = parse_recipe(_recipe_dict(tiny_llama_dir, tiny_llama_dir))
    layout = Layout.of(recipe, root)
    quantize_recipe(recipe, layout, echo=lambda *_: None, progress=False)
    build_recipe(recipe, layout, echo=lambda *_: None)
    return layout.engines


def _deploy(root: Path, built: Path, raw: dict, executor_factory: str | None = None):
    """The built engines under a recipe of their own, with its repository; (recipe, layout)."""
    from specdeploy.deploy import backend_stages

    recipe = parse_recipe(raw)
    layout = Layout.of(recipe, root)
    shutil.copytree(built, layout.engines)  # same recipe name, another project root: the engines match it
    backend_stages.of(recipe).write_repository(recipe, layout, executor_factory=executor_factory)
    return recipe, layout


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, tiny_llama_dir, built):
    """(recipe, layout, recipe_path, server, corrupt_file): a running server on 127.0.0.1; always stopped."""
    root = tmp_path_factory.mktemp("client-deploy")
    raw = _recipe_dict(tiny_llama_dir, tiny_llama_dir)
    recipe_path = root / "clienttest.yaml"
    recipe_path.write_text(yaml.safe_dump(raw))
    recipe, layout = _deploy(root, built, raw, executor_factory="client_broken_engine:load_executor")

    corrupt_file = root / "corrupt.json"  # written by the parity test once it knows a clean index
    previous = os.environ.get("SPECDEPLOY_TEST_CORRUPT")
    os.environ["SPECDEPLOY_TEST_CORRUPT"] = str(corrupt_file)
    server = server_mod.start(
        layout.repo, ports.Ports.pick(), layout.server_state / "tritonserver.log", extra_site=(str(TESTS_DIR),)
    )
    try:
        server_mod.wait_ready(server, SERVER_READY_TIMEOUT_S)
        yield recipe, layout, recipe_path, server, corrupt_file
    finally:
        server.stop()
        if previous is None:
            os.environ.pop("SPECDEPLOY_TEST_CORRUPT", None)
        else:
            os.environ["SPECDEPLOY_TEST_CORRUPT"] = previous


@pytest.fixture(scope="module")
def decoupled_deployment(tmp_path_factory, tiny_llama_dir, built):
    """The same engines in decoupled mode (streaming), for the client-side TTFT; the default CPU executor."""
    root = tmp_path_factory.mktemp("client-decoupled")
    recipe, layout = _deploy(root, built, _recipe_dict(tiny_llama_dir, tiny_llama_dir, decoupled=True))
    server = server_mod.start(layout.repo, ports.Ports.pick(), layout.server_state / "tritonserver.log")
    try:
        server_mod.wait_ready(server, SERVER_READY_TIMEOUT_S)
        yield recipe, layout, server
    finally:
        server.stop()


def _prompt_file(path: Path, prompts) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for p, c in prompts))
    return str(path)


def test_clean_deployment_passes_with_complete_report(deployment, tmp_path):
    recipe, layout, _, server, _ = deployment
    prompts = _prompt_file(tmp_path / "clean.jsonl", CLEAN_PROMPTS)
    report, paths, verdict = validate_recipe(
        recipe,
        layout,
        url=server.state.grpc_url,
        report_dir=tmp_path / "report",
        progress=False,
        prompt_set=prompts,
        sweep_draft_tokens=(1, 2, 3),
        metrics_url=server.state.metrics_url,
    )
    assert report["complete"], report["errors"]
    summary = report["parity"]["summary"]["all"]
    assert (summary["prompts"], summary["exact"], summary["mismatches"]) == (3, 3, 0)
    assert verdict.exit_code == 0 and verdict.line.startswith("PASS")
    # the metrics endpoint agrees with validate's own counts of every request it sent (parity, warm-up, latency, sweep)
    check = report["metrics_check"]
    assert check["checked"] and not check["mismatches"], check
    compared = {r["metric"].split("{")[0]: r for r in check["rows"] if r["path"] == "speculative"}
    assert {
        "specdeploy_request_success_total",
        "specdeploy_spec_decode_num_draft_tokens_total",
        "specdeploy_spec_decode_num_accepted_tokens_total",
        "specdeploy_generation_tokens_total",
    } <= set(compared)
    n_spec = 3 + 2 + 3 * 2 + 3 * 3  # parity, warm-up, latency (2 levels), sweep (3 k) of 3 prompts, 1 repeat
    assert compared["specdeploy_request_success_total"]["client"] == n_spec
    if (
        report["speculation"]["source"] == "speculative_k_history"
    ):  # the BLS returns k per round: one round per target pass
        assert compared["specdeploy_spec_decode_num_target_passes_total"]["agree"]
    assert "metrics endpoint agrees" in verdict.line
    spec_rounds = report["speculation"]
    assert spec_rounds["policy"]["speculation_policy"] == recipe.speculative.policy
    assert spec_rounds["rounds_on"] > 0 and 0 < spec_rounds["speculated_share"] <= 1
    levels = report["latency"]["levels"]
    assert [(r["mode"], r["concurrency"]) for r in levels] == [
        ("control", 1),
        ("speculative", 1),
        ("control", 2),
        ("speculative", 2),
    ]
    spec = levels[1]
    assert spec["acceptance_rate"] is not None and 0.0 <= spec["acceptance_rate"] <= 1.0
    assert spec["ttft_s_p50"] is not None and spec["ttft_source"] == "server"
    assert all(r["e2e_s_p50"] > 0 for r in levels)
    data = json.loads(paths["json"].read_text())
    assert sum(len(r["samples"]) for r in data["latency"]["runs"]) == 3 * 2 * 2
    # the draft differs from its target: the server's counts show drafts both accepted and rejected, and the
    # outputs still match the control token for token (above)
    spec_samples = [s for r in data["latency"]["runs"] if r["mode"] == "speculative" for s in r["samples"]]
    drafted, accepted = sum(s["drafted"] for s in spec_samples), sum(s["accepted"] for s in spec_samples)
    assert 0 < accepted < drafted, (accepted, drafted)
    assert spec["acceptance_rate"] == pytest.approx(
        sum(s["accepted"] for s in spec_samples if s["concurrency"] == 1)
        / sum(s["drafted"] for s in spec_samples if s["concurrency"] == 1)
    )
    # the round profile: the BLS's seconds per round beside its k history, per level, summing to the server's decode
    # time
    profile = {p["concurrency"]: p for p in report["latency"]["round_profile"]}
    assert set(profile) == {1, 2}
    for level, row in profile.items():
        timed = [s for s in spec_samples if s["concurrency"] == level and len(s["k_rounds"]) >= 2]
        assert all(len(s["k_rounds"]) == len(s["draft_s_rounds"]) == len(s["target_s_rounds"]) for s in timed) and timed
        assert row["rounds"] == sum(len(s["k_rounds"]) - 1 for s in timed) == sum(b["rounds"] for b in row["by_k"])
        assert row["draft_s_per_round"] > 0 and row["target_s_per_round"] > 0  # the draft model and the target both ran
        assert row["round_steps"] == pytest.approx(row["draft_steps"] + row["target_steps"] + row["rest_steps"])
        assert row["tpot_speedup"] == pytest.approx(row["tokens_per_round"] / row["round_steps"])
        decode = sum(s["decode_s"] for s in timed)
        assert row["rest_s_per_round"] * row["rounds"] == pytest.approx(
            decode - sum(sum(s["draft_s_rounds"][1:]) + sum(s["target_s_rounds"][1:]) for s in timed)
        )
    assert "### Where a speculative round's time goes" in paths["markdown"].read_text()
    assert set(paths) == {"json", "markdown", "latency", "categories", "sweep", "draft_length"}
    points = report["sweep"]["points"]
    assert [p["k"] for p in points] == [1, 2, 3]
    assert all(0.0 < p["acceptance_rate"] < 1.0 for p in points), points
    assert 0.0 < report["sweep"]["alpha"] < 1.0 and report["sweep"]["recommendation"]["recommended_k"] in (1, 2, 3, 4)


def test_metrics_endpoint_counts_a_known_run_and_a_stray_request_is_a_named_mismatch(deployment):
    """Known requests -> the exported counters: expected values from the responses' perf outputs and the target
    alone's exact tokens (tensorrt_llm, not the BLS); then one request validate did not send fails the check."""
    from specdeploy.client import metrics_check
    from specdeploy.client.protocol import CONTROL_MODEL, SPECULATIVE_MODEL, GenerateRequest
    from specdeploy.core.metrics import names, reader

    _, _, _, server, _ = deployment
    raw = TritonEndpoint(server.state.grpc_url)
    check = metrics_check.MetricsCheck(raw, server.state.metrics_url)
    sent = [(p, k) for p, _ in CLEAN_PROMPTS for k in (1, 3)]
    drafted = accepted = tokens = 0
    for prompt, k in sent:
        result = check.endpoint.generate(SPECULATIVE_MODEL, GenerateRequest(prompt, MAX_TOKENS, num_draft_tokens=k), 30)
        drafted += result.perf.total_draft_tokens
        accepted += result.perf.total_accepted_draft_tokens
        tokens += len(raw.trace(prompt, MAX_TOKENS, 30, with_logits=False).output_ids)  # greedy: the same tokens
    check.endpoint.generate(CONTROL_MODEL, GenerateRequest(CLEAN_PROMPTS[0][0], MAX_TOKENS), 30)
    assert 0 < accepted < drafted  # the INT8 draft differs from its FP8 target
    exact = {
        raw.generate(CONTROL_MODEL, GenerateRequest(p, MAX_TOKENS), 30).text: len(
            raw.trace(p, MAX_TOKENS, 30, False).output_ids
        )
        for p, _ in CLEAN_PROMPTS
    }
    after = metrics_check.settled(server.state.metrics_url, check.before, (names.REQUESTS.name,), 5.0)
    window = after.minus(check.before)
    stats = reader.arm_stats(window, names.SPECULATIVE_ARM, SPECULATIVE_MODEL)
    assert (stats.requests, stats.drafted, stats.accepted, stats.output_tokens) == (
        len(sent),
        drafted,
        accepted,
        tokens,
    )
    assert stats.target_passes == tokens - accepted  # each pass emits its accepted drafts plus one token of its own
    assert window.sum("nv_inference_request_success", model=CONTROL_MODEL) == 1 + len(CLEAN_PROMPTS)

    report = {
        "complete": True,
        "parity": {
            "items": [{"control_text": t, "speculative_text": t, "generated_tokens": n} for t, n in exact.items()]
        },
    }
    counts = check.endpoint.counts
    counts[CONTROL_MODEL].requests += len(CLEAN_PROMPTS)  # the reference requests above went around the counter
    assert metrics_check.compare(window, counts, metrics_check.exact_token_counts(report))["mismatches"] == []
    # a request validate did not send (another client) is caught, naming the metric
    raw.generate(SPECULATIVE_MODEL, GenerateRequest(CLEAN_PROMPTS[1][0], MAX_TOKENS, num_draft_tokens=2), 30)
    section = check.finish(report)
    assert any(
        line.startswith(
            'specdeploy_request_success_total{model="tensorrt_llm_bls",arm="speculative"}: the metrics '
            f"endpoint counted {len(sent) + 1}, validate counted {len(sent)}"
        )
        for line in section["mismatches"]
    ), section
    assert any(line.startswith("specdeploy_generation_tokens_total") for line in section["mismatches"])
    verdict = gate.evaluate({**report, "prompts": [], "metrics_check": section}, 1.0, 0.0)
    assert "metrics endpoint disagrees: specdeploy_request_success_total" in verdict.line
    (metric_check,) = [c for c in verdict.checks if c.name == "metrics"]
    assert not metric_check.ok and metric_check.exit_code == gate.EXIT_METRICS
    spec = report["speculation"]  # from the same window: every target pass is a round, with or without a draft
    assert spec["source"] in ("metrics", "speculative_k_history") and spec["rounds_on"] > 0
    assert spec["rounds_on"] + spec["rounds_off"] == sum(spec["k_counts"].values())


def test_broken_speculative_path_is_reported_at_its_index(deployment, tmp_path):
    """Through the CLI: the corrupted token is found at its generated index and the exit code is 3."""
    from specdeploy.cli.main import main

    recipe, layout, recipe_path, server, corrupt_file = deployment
    # Corrupt a token that completes a character of the control's text (a random model emits many
    # partial UTF-8 byte tokens, which text outputs cannot place exactly), using a plain-text token.
    from tiny_models import CORPUS
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir(recipe, layout)))
    endpoint = TritonEndpoint(server.state.grpc_url)

    def clean(ids, i):
        return not tokenizer.decode(ids[: i + 1]).endswith("\ufffd")

    for text in dict.fromkeys(CORPUS):
        trace = endpoint.trace(text, MAX_TOKENS, 30)
        ids = trace.output_ids
        index = next((i for i in range(2, len(ids) - 1) if clean(ids, i)), None)
        if index is not None:
            break
    assert index is not None, "no prompt whose control output decodes cleanly"
    token = next(t for t in tokenizer(" quick brown", add_special_tokens=False).input_ids if t != ids[index])
    prompts = _prompt_file(tmp_path / "mixed.jsonl", [CLEAN_PROMPTS[0], (text, "chat")])
    corrupt_file.write_text(json.dumps({"prompt_ids": trace.prompt_ids, "index": index, "token": token}))
    args = ["--root", str(layout.root), "validate", str(recipe_path), "--url", server.state.grpc_url]
    args += ["--report-dir", str(tmp_path / "report"), "--prompt-set", prompts, "--no-progress"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == gate.EXIT_PARITY, result.output
    assert result.output.strip().splitlines()[-1].startswith("FAIL: parity 50.0% < 100.0%")
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    (bad,) = [i for i in report["parity"]["items"] if i["verdict"] != "match"]
    assert bad["verdict"] == "mismatch"
    assert bad["divergence_index"] == index
    assert bad["control_token"] == ids[index]
    # without output_ids from the BLS the speculative token is re-tokenized from text: only its presence is exact
    assert bad["speculative_token"] is not None and bad["speculative_token"] != ids[index]
    assert bad["token_margin"] is not None and bad["token_margin"] > recipe.validation.near_tie_margin
    assert "Divergences" in (tmp_path / "report" / "report.md").read_text()


def test_decoupled_deployment_streams_for_client_side_ttft(decoupled_deployment, tmp_path):
    recipe, layout, server = decoupled_deployment
    prompts = _prompt_file(tmp_path / "clean.jsonl", CLEAN_PROMPTS)
    report, _, verdict = validate_recipe(
        recipe,
        layout,
        url=server.state.grpc_url,
        report_dir=tmp_path,
        progress=False,
        prompt_set=prompts,
        concurrency=(1,),
    )
    assert report["complete"], report["errors"]
    assert report["settings"]["stream"] is True
    assert report["parity"]["summary"]["all"]["exact"] == len(CLEAN_PROMPTS)
    samples = [s for r in report["latency"]["runs"] for s in r["samples"]]
    assert samples and all(s["ttft_source"] == "stream" for s in samples)
    assert all(0 < s["ttft_s"] <= s["latency_s"] for s in samples)
    several_tokens = [s for s in samples if s["output_tokens"] > 1]
    assert all(s["tpot_s"] is not None for s in several_tokens)
    assert verdict.exit_code == 0, verdict.line


def test_a_decoupled_bls_streams_plain_runs_as_they_are_made(decoupled_deployment):
    """stream=true through the BLS: a request without drafts (num_draft_tokens 0: the whole answer is one plain run of
    tensorrt_llm) arrives in many text responses, not in one at the end, and joins into the control's text; with drafts
    the rounds stream and join alike."""
    from specdeploy.client.protocol import GenerateRequest

    _, _, server = decoupled_deployment
    endpoint = TritonEndpoint(server.state.grpc_url)
    try:
        for prompt, _ in CLEAN_PROMPTS:
            control = endpoint.generate("ensemble", GenerateRequest(prompt, MAX_TOKENS), 120).text
            for k in (0, 2):
                pieces = []
                result = endpoint.generate(
                    "tensorrt_llm_bls",
                    GenerateRequest(prompt, MAX_TOKENS, num_draft_tokens=k, stream=True),
                    120,
                    on_text=pieces.append,
                )
                assert result.text == "".join(pieces) == control, (prompt, k)
                texts = [p for p in pieces if p]
                assert len(texts) >= min(4, len(control.split())), (prompt, k, pieces)
                if k == 0:
                    assert result.k_history == [0] and len(texts) > 1, (
                        prompt,
                        result.k_history,
                        pieces,
                    )  # one call, streamed
    finally:
        endpoint.close()


def test_sampled_outputs_compared_statistically(deployment, tmp_path):
    """top_k=3 over 2 tokens: at most 9 outcomes, so 120 seeded samples per side give a real chi-square test."""
    from specdeploy.speculation.sampling import SamplingParams

    recipe, layout, _, server, _ = deployment
    prompts = _prompt_file(tmp_path / "one.jsonl", CLEAN_PROMPTS[:1])
    report, _, verdict = validate_recipe(
        recipe,
        layout,
        url=server.state.grpc_url,
        report_dir=tmp_path,
        progress=False,
        prompt_set=prompts,
        concurrency=(1,),
        sampling=SamplingParams(temperature=1.0, top_k=3, seed=0),
        samples_per_prompt=120,
        sample_prompts=1,
    )
    assert report["complete"], report["errors"]
    (test,) = report["sampling"]["tests"]
    assert sum(test["control_counts"].values()) == sum(test["speculative_counts"].values()) == 120
    assert 1 < test["outcomes"] <= 9 and test["dof"] >= 1
    assert report["sampling"]["combined_p_value"] >= 0.001, test
    assert verdict.exit_code == 0, verdict.line


def test_missing_model_and_timeout_are_client_errors(deployment):
    _, _, _, server, _ = deployment
    endpoint = TritonEndpoint(server.state.grpc_url)
    with pytest.raises(ClientError, match="model 'no_such_model' is missing"):
        endpoint.check_ready(["no_such_model"])
    from specdeploy.client.protocol import GenerateRequest

    # a 1 µs deadline passes before any answer can come back over gRPC: the error shows the client applied it
    with pytest.raises(ClientError, match="timed out"):
        endpoint.generate("ensemble", GenerateRequest(CLEAN_PROMPTS[0][0], 200), timeout_s=1e-6)


def test_unreachable_server_ends_quickly_with_partial_report(deployment, tmp_path):
    recipe, layout, _, _, _ = deployment
    port = ports.free_port()
    attempted = []
    report, paths, verdict = validate_recipe(
        recipe, layout, url=f"127.0.0.1:{port}", report_dir=tmp_path, progress=attempted.append
    )
    # it ends at the readiness check: not one prompt is sent to a server that is not there
    assert attempted == [] and report["parity"] is None and report["latency"] is None
    assert not report["complete"] and "unreachable" in report["errors"][0]
    assert verdict.exit_code == gate.EXIT_INCOMPLETE
    assert json.loads(paths["json"].read_text())["complete"] is False
    assert "INCOMPLETE" in paths["markdown"].read_text()


def test_server_dying_mid_run_ends_quickly_with_partial_report(deployment, tmp_path):
    """Runs last: it kills the module's server."""
    recipe, layout, _, server, _ = deployment
    outcome, some_done, killed = {}, threading.Event(), threading.Event()
    finished = []

    def on_request(n):
        finished.append(n)
        if len(finished) >= 2:
            some_done.set()
            killed.wait(timeout=300)  # the run cannot finish before the server is dead: it waits here

    def run():
        outcome["result"] = validate_recipe(
            recipe,
            layout,
            url=server.state.grpc_url,
            report_dir=tmp_path,
            progress=on_request,
            max_prompts=40,
            repeats=5,
        )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert some_done.wait(timeout=300), "no request finished"
    assert thread.is_alive()
    server_mod.stop_pid(server.process.pid, timeout_s=0.0, process=server.process)  # SIGTERM, then SIGKILL the group
    done_when_killed = len(finished)
    killed.set()
    thread.join(timeout=120)  # a guard against a hang, not a speed bound
    assert not thread.is_alive(), "validate hung after the server died"
    report, paths, verdict = outcome["result"]
    # it stopped at the first failure instead of sending each remaining request to a dead server
    assert len(finished) <= done_when_killed + 2 * max(recipe.validation.concurrency)
    assert not report["complete"]
    assert verdict.exit_code == gate.EXIT_INCOMPLETE
    assert report["parity"]["items"], "parity results before the death are kept"
    assert "INCOMPLETE" in paths["markdown"].read_text()
