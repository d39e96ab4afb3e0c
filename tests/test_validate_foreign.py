"""`specdeploy validate --url ... --tokenizer ...` with no recipe, against specdeploy's own servers treated as
deployments it did not make: the inflight_batcher_llm layout over Triton, the llmapi layout over Triton, and the
OpenAI front. Only the address and the tokenizer describe the deployment (plus run-size options to keep the
run short); the report must hold a real parity verdict, the draft counts where the server returns them, and
name what it could not check.
"""

from __future__ import annotations

import json
from pathlib import Path

import ops_deploy
import pytest
from click.testing import CliRunner

from specdeploy.cli.main import main
from specdeploy.client import openai_adapter

PROMPTS = [("The quick brown fox", "chat"), ("def add(a, b):", "code"), ("Triton serves models", "summarization")]
RUN_SIZE = [
    "--max-tokens",
    "12",
    "--min-compared-tokens",
    "4",
    "--concurrency",
    "1",
    "--repeats",
    "1",
    "--min-speedup",
    "0",
    "--no-progress",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ops_deploy.make_model(tmp_path_factory.mktemp("foreign-model"))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("foreign-prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for p, c in PROMPTS))
    return str(path)


@pytest.fixture(scope="module")
def inflight(tmp_path_factory, model_dir):
    """(recipe, layout, server) of a served inflight_batcher_llm deployment; always stopped."""
    recipe, layout, _ = ops_deploy.build(tmp_path_factory.mktemp("foreign-ibl"), model_dir, "foreign")
    with ops_deploy.running(layout) as srv:
        yield recipe, layout, srv


def _validate(args: list[str], report_dir: Path) -> tuple[object, dict]:
    result = CliRunner().invoke(main, ["validate", *args, "--report-dir", str(report_dir)])
    path = report_dir / "report.json"
    assert path.is_file(), result.output
    return result, json.loads(path.read_text())


def _not_checked(report: dict) -> dict[str, str]:
    return {item["what"]: item["because"] for item in report["not_checked"]}


def _drafted(report: dict) -> int:
    return sum(
        s["drafted"] or 0 for run in report["latency"]["runs"] if run["mode"] == "speculative" for s in run["samples"]
    )


def _parity_computed(report: dict) -> dict:
    summary = report["parity"]["summary"]["all"]
    assert summary["prompts"] == len(PROMPTS) and summary["compared"] > 0, summary
    assert all(
        i["control_text"] and i["speculative_text"] for i in report["parity"]["items"]
    )  # non-empty outputs compared
    return summary


@pytest.mark.server
def test_inflight_batcher_llm_layout_by_url_and_tokenizer_only(inflight, model_dir, prompts, tmp_path):
    _, _, srv = inflight
    result, report = _validate(
        ["--url", srv.state.grpc_url, "--tokenizer", str(model_dir), "--prompts", prompts, *RUN_SIZE], tmp_path
    )
    assert report["complete"], report["errors"]
    summary = _parity_computed(report)
    assert summary["exact"] == summary["compared"], report["parity"]["items"]  # the draft is the target: same outputs
    assert (
        report["deployment"]["foreign"]
        and report["deployment"]["served_names"]["tensorrt_llm_bls"] == "tensorrt_llm_bls"
    )
    assert report["settings"]["chat_template_used"]  # the tokenizer has a chat template: prompts were rendered with it
    assert _drafted(report) > 0  # the BLS returns total_draft_tokens
    assert report["gate"]["exit_code"] == result.exit_code == 0, result.output
    missing = _not_checked(report)
    assert "--metrics-url" in missing["the metrics endpoint against validate's own counts"]
    assert "quantization quality" in missing and "cost per response and per 1k tokens" in missing
    assert not any("acceptance rate" in what for what in missing)  # returned, so checked
    assert not any(
        what.startswith("where a speculative round's time goes") for what in missing
    )  # the BLS returns its seconds
    assert [p["concurrency"] for p in report["latency"]["round_profile"]] == [1]  # RUN_SIZE: concurrency 1
    assert "Not checked" in (tmp_path / "report.md").read_text()
    assert "not checked: the metrics endpoint" in result.output


@pytest.mark.server
def test_metrics_of_a_foreign_deployment_are_checked_and_model_names_are_options(
    inflight, model_dir, prompts, tmp_path
):
    """--metrics-url: the counters are compared with validate's own; the model names given explicitly work the same;
    --control-url routes the control to its own endpoint (here the same server again), whose requests this metrics
    endpoint then does not judge."""
    _, _, srv = inflight
    args = [
        "--url",
        srv.state.grpc_url,
        "--tokenizer",
        str(model_dir),
        "--prompts",
        prompts,
        "--speculative-model",
        "tensorrt_llm_bls",
        "--control-model",
        "ensemble",
        "--num-draft-tokens",
        "2",
        "--metrics-url",
        srv.state.metrics_url,
        "--raw",
        *RUN_SIZE,
    ]
    result, report = _validate(args, tmp_path / "one")
    assert report["complete"], report["errors"]
    _parity_computed(report)
    assert report["settings"]["num_draft_tokens"] == 2 and not report["settings"]["chat_template_used"]
    check = report["metrics_check"]
    assert check["checked"] and not check["mismatches"] and check["rows"], check
    assert "control" in {r["path"] for r in check["rows"]}
    assert "the metrics endpoint against validate's own counts" not in _not_checked(report)

    result, report = _validate([*args, "--control-url", srv.state.grpc_url], tmp_path / "two")
    assert report["complete"], report["errors"]
    assert (
        _parity_computed(report)["exact"] == len(PROMPTS) and report["deployment"]["control_url"] == srv.state.grpc_url
    )
    check = report["metrics_check"]
    assert check["checked"] and not check["mismatches"] and {r["path"] for r in check["rows"]} == {"speculative"}, check
    assert "--control-url" in _not_checked(report)["part of the metrics endpoint"]


@pytest.mark.server
def test_openai_protocol_by_url_and_tokenizer_only(inflight, model_dir, prompts, tmp_path):
    from specdeploy.ops.openai import api as openai_api
    from specdeploy.ops.openai import app
    from specdeploy.triton.ports import free_port

    recipe, layout, srv = inflight
    front = openai_api.build_front(recipe, layout, srv.state.grpc_url, timeout_s=60)
    with openai_api.ApiServer(app.create_app(front), free_port()) as api:
        result, report = _validate(
            ["--protocol", "openai", "--url", api.url, "--tokenizer", str(model_dir), "--prompts", prompts, *RUN_SIZE],
            tmp_path,
        )
    assert report["complete"], report["errors"]
    summary = _parity_computed(report)
    assert summary["exact"] == summary["compared"]
    assert report["url"] == api.url.rstrip("/") + ("" if api.url.rstrip("/").endswith("/v1") else "/v1")
    assert _drafted(report) > 0  # specdeploy's front returns the draft counts in its extension field
    missing = _not_checked(report)
    assert "near-tie triage of divergences" in missing  # no target-only model behind an OpenAI API
    # the front passes the BLS's round seconds on in its extension field: the round profile as over gRPC
    assert not any(what.startswith("where a speculative round's time goes") for what in missing)
    assert [p["concurrency"] for p in report["latency"]["round_profile"]] == [1]
    assert any(what.startswith("the draft length the options name") for what in missing)  # the front fixes k
    # and the report's header does not claim the k validate would have sent
    header = (tmp_path / "report.md").read_text().split("## ")[0]
    assert (
        "the deployment's own draft length (num_draft_tokens not sent" in header and "num_draft_tokens=" not in header
    )
    assert "--metrics-url" in missing["the metrics endpoint against validate's own counts"]
    # over OpenAI it streams by default: every stream equals its unary text, TTFT/TPOT from the stream, tokens from
    # usage
    assert report["settings"]["stream"] and report["parity"]["streams_checked"]
    assert all(i["stream_equal"] is True for i in report["parity"]["items"])
    levels = report["latency"]["levels"]
    assert {r["ttft_source"] for r in levels} == {"stream"} and all(r["tpot_s_p99"] is not None for r in levels)
    assert {t for r in levels for t in r["tokens_source"]} == {"usage"}
    assert "TTFT and TPOT" not in missing
    assert {r["acceptance_source"] for r in levels if r["mode"] == "speculative"} == {openai_adapter.SPECDEPLOY_SOURCE}
    # the header names the model ids and the URL it talked to, not the Triton names
    ends = report["deployment"]["endpoints"]
    assert ends["speculative"]["model"] == "foreign-speculative" and ends["control"]["model"] == "foreign-control"
    assert f"model `foreign-speculative` at `{report['url']}`" in header
    plan = report["plan"]  # chosen before the first request: 3 prompts x 2 sides x (unary + stream), 3 timed x 2 sides
    assert (plan["parity"], plan["latency"], plan["total"]) == (12, 6, 12 + 4 + 6)
    assert plan["eta_s_after_warm_up"] > 0


@pytest.mark.server
def test_llmapi_layout_by_url_and_tokenizer(tmp_path_factory, model_dir, prompts, tmp_path):
    recipe, layout, _ = ops_deploy.build(
        tmp_path_factory.mktemp("foreign-llmapi"), model_dir, "foreign", triton={"layout": "llmapi"}
    )
    assert recipe.layout == "llmapi" and recipe.control == "side_by_side"
    with ops_deploy.running(layout) as srv:
        result, report = _validate(
            [
                "--url",
                srv.state.grpc_url,
                "--tokenizer",
                str(model_dir),
                "--layout",
                "llmapi",
                "--prompts",
                prompts,
                *RUN_SIZE,
            ],
            tmp_path,
        )
    assert report["complete"], report["errors"]
    summary = _parity_computed(report)
    assert summary["exact"] == summary["compared"]
    assert report["deployment"]["served_names"]["tensorrt_llm_bls"] == "tensorrt_llm"
    assert _drafted(report) > 0
    missing = _not_checked(report)
    assert "exact token ids of the outputs" in missing  # the llmapi model returns text only
    assert any(what.startswith("the draft length the options name") for what in missing)


# ---------------------------------------------------------------- bad input


def test_no_recipe_needs_url_and_tokenizer_and_a_recipe_refuses_deployment_options(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["validate"])
    assert result.exit_code != 0 and "nothing says which deployment" in result.output and "--url" in result.output
    result = runner.invoke(main, ["validate", "--url", "127.0.0.1:1"])
    assert result.exit_code != 0 and "needs --tokenizer" in result.output
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\ntarget: {model: t}\ndraft: {model: d}\n")
    result = runner.invoke(main, ["validate", str(recipe), "--tokenizer", "x", "--control-model", "c"])
    assert (
        result.exit_code != 0 and "--tokenizer, --control-model describe a deployment without a recipe" in result.output
    )


def test_a_wrong_tokenizer_path_is_named_with_the_fix(tmp_path):
    result = CliRunner().invoke(
        main,
        [
            "validate",
            "--url",
            "127.0.0.1:1",
            "--tokenizer",
            str(tmp_path / "nope"),
            "--report-dir",
            str(tmp_path / "r"),
        ],
    )
    assert (
        result.exit_code != 0
        and "cannot load a tokenizer from" in result.output
        and "hint: pass --tokenizer" in result.output
    )
    assert not (tmp_path / "r" / "report.json").exists()  # refused before any request


@pytest.mark.server
def test_unreachable_url_and_missing_model_name_end_with_the_fix(inflight, model_dir, tmp_path):
    from specdeploy.triton.ports import free_port

    _, _, srv = inflight
    base = [
        "--tokenizer",
        str(model_dir),
        "--max-prompts",
        "1",
        "--max-tokens",
        "8",
        "--min-compared-tokens",
        "4",
        "--no-progress",
    ]
    result, report = _validate(["--url", f"127.0.0.1:{free_port()}", *base], tmp_path / "down")
    assert result.exit_code == 1 and not report["complete"]
    assert "unreachable" in report["errors"][0] and "check --url" in report["errors"][0] and "error:" in result.output
    result, report = _validate(["--url", srv.state.grpc_url, "--speculative-model", "my_bls", *base], tmp_path / "name")
    assert result.exit_code == 1 and "model 'my_bls' is missing" in report["errors"][0], report["errors"]
    assert (
        "--speculative-model NAME" in report["errors"][0] and "tensorrt_llm_bls" in report["errors"][0]
    )  # what it serves, and the fix


# ---------------------------------------------------------------- pieces, without a server


def _exposition(bls: int, ensemble: int) -> str:
    return (
        "# TYPE nv_inference_request_success counter\n"
        f'nv_inference_request_success{{model="tensorrt_llm_bls",version="1"}} {bls}\n'
        f'nv_inference_request_success{{model="ensemble",version="1"}} {ensemble}\n'
    )


def test_an_endpoint_without_specdeploy_metrics_is_checked_on_triton_counters_and_says_the_rest():
    """NVIDIA's BLS exports no speculation metrics: requests per path come from nv_inference_request_success, and the
    notes say that draft and output tokens are not checked."""
    from specdeploy.client.metrics_check import PathCounts, compare
    from specdeploy.core.metrics import reader

    window = reader.parse(_exposition(13, 12), 2.0).minus(reader.parse(_exposition(3, 2), 1.0))
    counts = {"tensorrt_llm_bls": PathCounts(requests=10), "ensemble": PathCounts(requests=10)}
    section = compare(window, counts, {})
    assert section["checked"] and not section["mismatches"], section
    assert [(r["path"], r["metrics"], r["client"]) for r in section["rows"]] == [
        ("speculative", 10, 10),
        ("control", 10, 10),
    ]
    assert any("draft tokens, accepted tokens, output tokens and rounds are not checked" in n for n in section["notes"])
    counts["tensorrt_llm_bls"].requests = 9  # a stray request on the server: named
    assert compare(window, counts, {})["mismatches"] == [
        'nv_inference_request_success{model="tensorrt_llm_bls"}: the metrics endpoint counted 10, validate counted 9'
        " (speculative path)"
    ]
    elsewhere = compare(window, {"tensorrt_llm_bls": PathCounts(requests=10)}, {}, control_here=False)
    assert [r["path"] for r in elsewhere["rows"]] == ["speculative"]  # the control's server is another one


def test_openai_model_ids_are_found_or_asked_for(monkeypatch):
    from specdeploy.client.openai_adapter import OpenAIEndpoint
    from specdeploy.client.protocol import CONTROL_MODEL, SPECULATIVE_MODEL
    from specdeploy.core.errors import ClientError

    served = {
        "http://a/v1": ["ops", "ops-speculative", "ops-control", "ops-canary"],
        "http://b/v1": ["llama"],
        "http://c/v1": ["x", "y"],
    }
    monkeypatch.setattr(OpenAIEndpoint, "served_models", lambda self, base: served[base])
    front = OpenAIEndpoint("http://a")
    front.check_ready([SPECULATIVE_MODEL, CONTROL_MODEL])
    assert (
        front.ids == {SPECULATIVE_MODEL: "ops-speculative", CONTROL_MODEL: "ops-control"}
        and front.canary_id == "ops-canary"
    )
    split = OpenAIEndpoint("http://b", control_url="http://c", ids={CONTROL_MODEL: "y"})
    split.check_ready([SPECULATIVE_MODEL, CONTROL_MODEL])
    assert split.ids == {SPECULATIVE_MODEL: "llama", CONTROL_MODEL: "y"}
    with pytest.raises(ClientError, match="which model .* is the control") as exc:
        OpenAIEndpoint("http://b").check_ready([SPECULATIVE_MODEL, CONTROL_MODEL])
    assert "--control-model" in exc.value.hint
    with pytest.raises(ClientError, match="does not serve 'z'"):
        OpenAIEndpoint("http://c", ids={SPECULATIVE_MODEL: "z"}).check_ready([SPECULATIVE_MODEL])


def test_the_client_imports_no_stage():
    """client/ depends on the core and its own adapters only: no quantize, build, repository, server, launch,
    backends."""
    import ast

    allowed = {"specdeploy.recipe.config", "specdeploy.speculation.sampling"}  # and the core
    package = Path(__file__).resolve().parent.parent / "specdeploy"
    client = package / "client"

    def module(dotted: str) -> bool:
        return (package.parent / (dotted.replace(".", "/") + ".py")).is_file()

    found = set()
    for path in client.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specdeploy"):
                # `from a import b` counts a.b where b is a module, else a
                names = [
                    f"{node.module}.{a.name}" if module(f"{node.module}.{a.name}") else node.module for a in node.names
                ]
                found |= {(path.name, n) for n in names if not n.startswith("specdeploy.client")}
            elif isinstance(node, ast.Import):
                found |= {
                    (path.name, a.name)
                    for a in node.names
                    if a.name.startswith("specdeploy") and not a.name.startswith("specdeploy.client")
                }
    assert {(f, n) for f, n in found if n not in allowed and not n.startswith("specdeploy.core.")} == set()


def test_triton_requests_use_the_given_names_and_knobs_and_record_what_a_model_does_not_declare(monkeypatch):
    """Model names and the BLS knobs reach the wire; an input the served model does not declare is left out and recorded
    (the report lists it as not checked)."""
    import numpy as np

    from specdeploy.client.deployment import Deployment, open_endpoint
    from specdeploy.client.protocol import CONTROL_MODEL, SPECULATIVE_MODEL, GenerateRequest

    declared = {
        "my_bls": ("text_input", "max_tokens", "num_draft_tokens", "use_draft_logits"),
        "my_ensemble": ("text_input", "max_tokens"),
    }
    sent = []

    class Response:
        def as_numpy(self, name):
            return np.array([b"hi"], dtype=object) if name == "text_output" else None

    endpoint = open_endpoint(
        Deployment("127.0.0.1:1", "tok", speculative_model="my_bls", control_model="my_ensemble", use_draft_logits=True)
    )
    monkeypatch.setattr(
        endpoint,
        "_config",
        lambda model: {"input": [{"name": n} for n in declared[model]], "output": [{"name": "text_output"}]},
    )
    monkeypatch.setattr(
        endpoint,
        "_exchange",
        lambda model, decoupled, inputs, outputs, timeout_s, on_text=None: (
            sent.append((model, inputs)) or [Response()],
            None,
            0.0,
            0.1,
        ),
    )
    assert endpoint.generate(SPECULATIVE_MODEL, GenerateRequest("p", 4, num_draft_tokens=2), 1).text == "hi"
    endpoint.generate(CONTROL_MODEL, GenerateRequest("p", 4), 1)
    (spec_model, spec_inputs), (control_model, control_inputs) = sent
    assert (
        spec_model == "my_bls"
        and spec_inputs["num_draft_tokens"].item() == 2
        and spec_inputs["use_draft_logits"].item() is True
    )
    assert (
        control_model == "my_ensemble"
        and "use_draft_logits" not in control_inputs
        and "num_draft_tokens" not in control_inputs
    )
    assert endpoint.dropped_inputs == {
        "my_bls": {"exclude_input_in_output", "return_perf_metrics"},
        "my_ensemble": {"exclude_input_in_output", "return_perf_metrics"},
    }
    with pytest.raises(Exception, match="input of the inflight_batcher_llm layout's BLS"):
        Deployment("127.0.0.1:1", "tok", layout="llmapi", use_draft_logits=True)


@pytest.mark.server
def test_a_time_budget_too_small_cuts_the_timed_phases_and_says_so(inflight, model_dir, prompts, tmp_path):
    _, _, srv = inflight
    args = ["--url", srv.state.grpc_url, "--tokenizer", str(model_dir), "--prompts", prompts, *RUN_SIZE]
    result, report = _validate([*args, "--repeats", "4", "--time-budget", "0.0001"], tmp_path)
    assert report["complete"], report["errors"]
    _parity_computed(report)  # parity is never cut
    budget = report["plan"]["budget"]
    assert (budget["repeats"], budget["timed_prompts"], budget["fits"]) == (2, len(PROMPTS), False)
    assert report["settings"]["repeats"] == 2 and len(report["latency"]["runs"]) == 2 * 2  # 2 repeats x 2 sides
    assert any("--time-budget" in w and "does not fit" in w for w in report["warnings"]), report["warnings"]
    assert "--time-budget" in result.output
