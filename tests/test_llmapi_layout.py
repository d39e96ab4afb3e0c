"""The llmapi layout on the cpu backend: TensorRT-LLM's llmapi model interface over the CPU engines, a control model
beside the speculative one (or loaded only while validate measures it), on the real tritonserver."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from tiny_models import SERVER_READY_TIMEOUT_S, TINY_QUANT, build_quietly, make_tiny_pair, tiny_pair_recipe

from specdeploy.core.artifacts import Layout
from specdeploy.core.errors import ConfigError
from specdeploy.deploy import backend_stages
from specdeploy.gpu import llmapi_repository as llmapi
from specdeploy.recipe.load import parse_recipe
from specdeploy.triton import model_config, ports, repository, server

PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "Q: What is the capital of France? A:"]


def _recipe(target_dir, draft_dir, name="llm", **sections) -> dict:
    base = tiny_pair_recipe(
        name,
        target_dir,
        draft_dir,
        engine={"dtype": "bfloat16", "max_batch_size": 2, "max_input_len": 500, "max_seq_len": 700},
        triton={"layout": "llmapi"},
        validation={
            "max_prompts": 4,
            "max_tokens": 16,
            "min_compared_tokens": 4,
            "concurrency": [1, 2],
            "repeats": 1,
            "min_speedup": 0.0,
            "latency_prompts": 2,
            "chat_template": "none",
        },
    )
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return base


# ---------------------------------------------------------------- the recipe


@pytest.mark.parametrize(
    "sections, needle",
    [
        ({"backend": "trtllm-engine", "triton": {"layout": "llmapi"}}, "does not serve"),
        ({"triton": {"layout": "inflight_batcher_llm", "control": "load_unload"}}, "only the llmapi layout"),
        ({"triton": {"layout": "llmapi"}, "canary": {"control_percent": 20}}, "tensorrt_llm_bls"),
        ({"triton": {"layout": "llmapi", "control": "both"}}, "triton.control"),
    ],
)
def test_recipe_layout_and_control_mistakes_are_named(sections, needle):
    data = _recipe("t", "d")
    for key, value in sections.items():
        data[key] = value if not isinstance(value, dict) else {**data.get(key, {}), **value}
    with pytest.raises(ConfigError, match=needle):
        parse_recipe(data)


def test_layout_and_control_defaults_follow_the_backend():
    cpu = parse_recipe({k: v for k, v in _recipe("t", "d").items() if k != "triton"})
    assert cpu.layout == "inflight_batcher_llm" and llmapi.server_args(cpu) == ()
    side = parse_recipe(_recipe("t", "d"))
    assert side.layout == "llmapi" and side.control == "side_by_side" and llmapi.server_args(side) == ()
    swap = parse_recipe(_recipe("t", "d", triton={"control": "load_unload"}))
    assert llmapi.server_args(swap) == ("--model-control-mode=explicit", "--load-model=tensorrt_llm")
    gpu_data = {**_recipe("t", "d"), "backend": "trtllm-llmapi", "triton": {}}
    gpu_data["draft"] = {**gpu_data["draft"], "quantization": {**TINY_QUANT, "qformat": "fp8"}}
    gpu = parse_recipe(gpu_data)
    assert gpu.layout == "llmapi" and gpu.control == "load_unload"  # two LLM(...) on one GPU: one at a time by default


# ---------------------------------------------------------------- built engines, served


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_tokenizer_dir):
    """Tiny FP8 target + INT8 draft, quantized and built once; recipes with other triton sections reuse them."""
    root = tmp_path_factory.mktemp("llmapi")
    target_dir, draft_dir = make_tiny_pair(root, tiny_tokenizer_dir)
    build_quietly(parse_recipe(_recipe(target_dir, draft_dir)), root)
    return root, target_dir, draft_dir


@dataclasses.dataclass(frozen=True)
class _RepoAt(Layout):
    """The built engines' layout, with the repository written elsewhere (one per deployment variant)."""

    repo_dir: Path = Path()

    @property
    def repo(self) -> Path:
        return self.repo_dir


def _deploy(built, name: str, **triton):
    """The recipe with `triton` settings, its repository (written under its own name) and its layout."""
    root, target_dir, draft_dir = built
    recipe = parse_recipe(_recipe(target_dir, draft_dir, triton={"layout": "llmapi", **triton}))
    layout = _RepoAt(root, recipe.name, root / name)
    path, written = backend_stages.of(recipe).write_repository(recipe, layout)
    assert written and path == root / name
    return recipe, layout, path


def test_repository_holds_the_speculative_model_and_its_control(built):
    recipe, layout, repo = _deploy(built, "repo-files")
    assert sorted(p.name for p in repo.iterdir() if (p / "config.pbtxt").is_file()) == [
        "tensorrt_llm",
        "tensorrt_llm_control",
    ]
    spec_yaml = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    control_yaml = yaml.safe_load((repo / "tensorrt_llm_control" / "1" / "model.yaml").read_text())
    assert spec_yaml["model"] == control_yaml["model"] == str(layout.engine("target"))
    # the recipe's TensorRT-LLM release names the draft (1.2: DraftTarget + speculative_model_dir), here the draft
    # engine
    assert spec_yaml["speculative_config"] == {
        "decoding_type": "DraftTarget",
        "max_draft_len": 3,
        "speculative_model_dir": str(layout.engine("draft")),
    }
    assert "speculative_config" not in control_yaml
    assert {k: v for k, v in spec_yaml.items() if k != "speculative_config"} == control_yaml
    for name in llmapi.MODELS:
        config = model_config.check_config((repo / name / "config.pbtxt").read_text(), name)
        assert config.max_batch_size == 0 and {i.name for i in config.input} >= {
            "text_input",
            "sampling_param_max_tokens",
            "stop",
        }
        assert (repo / name / "1" / "model.py").read_text() == (repository.MODEL_SOURCES / "llmapi.py").read_text()
    params = model_config.check_config((repo / "tensorrt_llm" / "config.pbtxt").read_text()).parameters
    assert params["speculation_policy"].string_value == recipe.speculative.policy


def _serve(recipe, repo, root: Path, name: str):
    srv = server.start(
        repo, ports.Ports.pick(), root / f"{name}.log", exit_timeout_s=3, extra_args=llmapi.server_args(recipe)
    )
    server.wait_ready(srv, SERVER_READY_TIMEOUT_S)  # stops the server itself when it does not come up
    return srv


def _infer(client, model: str, **values) -> dict:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for key, value in values.items():
        if isinstance(value, str):
            array = np.array([value.encode()], dtype=object)
        elif isinstance(value, list):
            array = np.array([v.encode() for v in value], dtype=object)
        else:
            array = np.array([value], dtype={bool: np.bool_, int: np.int32, float: np.float32}[type(value)])
        tensor = grpcclient.InferInput(key, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    result = client.infer(model, inputs)
    return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}


def _text(outputs: dict) -> str:
    return outputs["text_output"][0].decode()


@pytest.fixture(scope="module")
def side_by_side(built):
    import tritonclient.grpc as grpcclient

    recipe, layout, repo = _deploy(built, "side-by-side")
    srv = _serve(recipe, repo, built[0], "side-by-side")
    client = grpcclient.InferenceServerClient(srv.state.grpc_url)
    try:
        yield recipe, layout, client, srv
    finally:
        client.close()
        srv.stop()
    assert not srv.alive()


@pytest.mark.server
def test_speculative_and_control_answer_the_target_alone_token_for_token(side_by_side):
    """Greedy text of tensorrt_llm (draft + target) == tensorrt_llm_control == the target engine run in-process."""
    from specdeploy.engine.generate import Session, target_only_generate
    from specdeploy.speculation.loop import collect

    recipe, layout, client, _ = side_by_side
    session = Session.from_recipe(recipe, layout, speculative=False)
    compared = 0
    for prompt in PROMPTS:
        ask = dict(
            text_input=prompt,
            sampling_param_max_tokens=16,
            sampling_param_top_k=1,
            sampling_param_exclude_input_from_output=True,
        )
        spec, control = (
            _text(_infer(client, "tensorrt_llm", **ask)),
            _text(_infer(client, "tensorrt_llm_control", **ask)),
        )
        ids, _ = collect(target_only_generate(session.target, session.encode(prompt), 16, end_id=session.end_id))
        expected = session.tokenizer.decode(ids, skip_special_tokens=True)
        assert spec == control == expected, (prompt, spec, control, expected)
        compared += len(ids)
    assert compared >= 40  # real outputs, not empty ones


@pytest.mark.server
def test_perf_outputs_finish_reason_and_the_prompt_in_the_output(side_by_side):
    _, _, client, _ = side_by_side
    out = _infer(
        client,
        "tensorrt_llm",
        text_input=PROMPTS[0],
        sampling_param_max_tokens=12,
        sampling_param_top_k=1,
        sampling_param_return_perf_metrics=True,
        return_finish_reason=True,
        sampling_param_exclude_input_from_output=True,
    )
    assert out["finish_reason"][0] == b"length"
    assert int(out["total_draft_tokens"][0]) > 0 and 0 <= int(out["total_accepted_draft_tokens"][0]) <= int(
        out["total_draft_tokens"][0]
    )
    assert out["arrival_time_ns"][0] <= out["first_token_time_ns"][0] <= out["last_token_time_ns"][0]
    control = _infer(
        client,
        "tensorrt_llm_control",
        text_input=PROMPTS[0],
        sampling_param_max_tokens=12,
        sampling_param_top_k=1,
        sampling_param_return_perf_metrics=True,
    )
    assert int(control["total_draft_tokens"][0]) == 0
    assert _text(control) == PROMPTS[0] + _text(
        out
    )  # exclude_input_from_output false (the llmapi default): prompt included


@pytest.mark.server
def test_stop_strings_end_the_output_on_both_models(side_by_side):
    _, _, client, _ = side_by_side
    ask = dict(
        text_input=PROMPTS[1],
        sampling_param_max_tokens=16,
        sampling_param_top_k=1,
        sampling_param_exclude_input_from_output=True,
    )
    full = _text(_infer(client, "tensorrt_llm_control", **ask))
    word = full.split()[2] if len(full.split()) > 2 else full.split()[-1]
    for model in llmapi.MODELS:
        out = _infer(
            client, model, **ask, sampling_param_stop=[word], return_finish_reason=True, return_stop_reason=True
        )
        assert word not in _text(out) and full.startswith(_text(out)) and len(_text(out)) < len(full), (
            model,
            full,
            _text(out),
        )
        assert out["finish_reason"][0] == b"stop" and out["stop_reason"][0] == word.encode()


@pytest.mark.server
@pytest.mark.parametrize(
    "values, needle",
    [
        ({"lora_id": 3}, "lora_id"),
        ({"sampling_param_presence_penalty": 0.5}, "penalties"),
        ({"sampling_param_best_of": 2}, "best_of"),
        ({"streaming": True}, "decoupled mode"),
        ({"sampling_param_max_tokens": 5000}, "sampling_param_max_tokens"),
    ],
)
def test_what_the_model_cannot_do_is_refused_by_name_then_it_serves(side_by_side, values, needle):
    from tritonclient.utils import InferenceServerException

    _, _, client, _ = side_by_side
    with pytest.raises(InferenceServerException, match=needle):
        _infer(client, "tensorrt_llm", text_input=PROMPTS[0], **{"sampling_param_max_tokens": 4, **values})
    assert _text(_infer(client, "tensorrt_llm", text_input=PROMPTS[0], sampling_param_max_tokens=4))


@pytest.mark.server
def test_validate_side_by_side_compares_real_outputs_and_checks_the_metrics(side_by_side, tmp_path):
    from specdeploy.deploy.recipe_deployment import validate_recipe

    recipe, layout, _, srv = side_by_side
    report, _, verdict = validate_recipe(
        recipe, layout, url=srv.state.grpc_url, metrics_url=srv.state.metrics_url, report_dir=tmp_path, progress=False
    )
    summary = report["parity"]["summary"]["all"]
    assert summary["compared"] == summary["prompts"] == 4 and summary["exact"] == 4 and summary["tokens"] >= 40, summary
    assert verdict.passed, report["gate"]
    assert any("cannot be triaged" in w for w in report["warnings"])  # text only: said, not hidden
    check = report["metrics_check"]
    assert check["checked"] and not check["mismatches"], check
    rows = {(r["path"], r["metric"].split("{")[0]) for r in check["rows"]}
    assert ("control", "nv_inference_request_success") in rows and (
        "speculative",
        "specdeploy_spec_decode_num_draft_tokens_total",
    ) in rows, rows
    levels = {(r["mode"], r["concurrency"]) for r in report["latency"]["levels"]}
    assert levels == {("control", 1), ("control", 2), ("speculative", 1), ("speculative", 2)}


@pytest.mark.server
def test_decoupled_streams_the_whole_text_so_far(built):
    import queue

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    recipe, _, repo = _deploy(built, "decoupled", decoupled=True)
    srv = _serve(recipe, repo, built[0], "decoupled")
    try:
        client = grpcclient.InferenceServerClient(srv.state.grpc_url)
        results = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        inputs = []
        for key, array in {
            "text_input": np.array([PROMPTS[2].encode()], dtype=object),
            "streaming": np.array([True]),
            "sampling_param_max_tokens": np.array([16], dtype=np.int32),
            "sampling_param_top_k": np.array([1], dtype=np.int32),
            "sampling_param_exclude_input_from_output": np.array([True]),
        }.items():
            tensor = grpcclient.InferInput(key, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        client.async_stream_infer("tensorrt_llm", inputs, enable_empty_final_response=True)
        texts = []
        while True:
            result, error = results.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            if response.outputs:
                texts.append(result.as_numpy("text_output")[0].decode())
            if response.parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
        unary_over_stream = _unary_over_the_stream_api(srv.state.grpc_url, PROMPTS[2])
        assert len(texts) >= 3 and all(b.startswith(a) for a, b in zip(texts, texts[1:])), texts  # cumulative
        assert texts[-1] == unary_over_stream
        client.close()
    finally:
        srv.stop()


@pytest.mark.server
def test_ngram_draft_on_the_llmapi_layout_keeps_greedy_parity(built):
    """draft.kind ngram: model.yaml carries TensorRT-LLM's NGram fields only, specdeploy's minimum pattern size
    goes in the model's parameters; served, the speculative model drafts by prompt lookup (repetitive prompts
    give matches) and answers what the control does."""

    root, target_dir, draft_dir = built
    data = _recipe(target_dir, draft_dir)
    data["draft"] = {
        "kind": "ngram",
        "max_matching_ngram_size": 3,
        "min_matching_ngram_size": 2,
        "is_public_pool": False,
    }
    data["speculative"] = {**data.get("speculative", {}), "policy": "static"}
    recipe = parse_recipe(data)
    layout = _RepoAt(root, recipe.name, root / "ngram")
    repo, _ = backend_stages.of(recipe).write_repository(recipe, layout)
    spec_yaml = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert spec_yaml["speculative_config"] == {
        "decoding_type": "NGram",
        "max_draft_len": recipe.speculative.num_draft_tokens,
        "max_matching_ngram_size": 3,
        "is_keep_all": True,
        "is_use_oldest": True,
        "is_public_pool": False,
    }
    params = model_config.check_config((repo / "tensorrt_llm" / "config.pbtxt").read_text()).parameters
    assert params["min_matching_ngram_size"].string_value == "2"
    prompts = ("one two three one two three one two", "a b c a b c a b c a b", PROMPTS[1])
    assert _drafted_with_greedy_parity(recipe, repo, root, "ngram", prompts) > 0


@pytest.mark.server
def test_suffix_draft_on_the_llmapi_layout_keeps_greedy_parity(built):
    """draft.kind suffix: model.yaml carries TensorRT-LLM's SA fields (in trtllm_version 1.4's names; 1.2 has no SA
    and is refused), and served, the speculative model drafts with the suffix automaton and answers what the control
    does."""

    root, target_dir, draft_dir = built
    data = _recipe(target_dir, draft_dir)
    data["draft"] = {"kind": "suffix"}
    data["speculative"] = {**data.get("speculative", {}), "policy": "static"}
    with pytest.raises(ConfigError, match="SADecodingConfig, which TensorRT-LLM 1.2 does not have"):
        recipe = parse_recipe({**data, "trtllm_version": "1.2"})
        backend_stages.of(recipe).write_repository(recipe, _RepoAt(root, recipe.name, root / "suffix-1.2"))
    recipe = parse_recipe({**data, "trtllm_version": "1.4"})
    layout = _RepoAt(root, recipe.name, root / "suffix")
    repo, _ = backend_stages.of(recipe).write_repository(recipe, layout)
    spec_yaml = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert spec_yaml["speculative_config"] == {
        "decoding_type": "SA",
        "max_draft_len": recipe.speculative.num_draft_tokens,
        "max_matching_ngram_size": -1,
        "enable_global_pool": False,
    }
    prompts = ("one two three one two three one two", "a b c a b c a b c a b")
    assert _drafted_with_greedy_parity(recipe, repo, root, "suffix", prompts) > 0


def _unary_over_the_stream_api(url: str, prompt: str) -> str:
    """The same request without `streaming` (a decoupled model is called over the stream API all the same)."""
    from specdeploy.client.llmapi_adapter import LlmapiEndpoint
    from specdeploy.client.protocol import SPECULATIVE_MODEL, GenerateRequest

    endpoint = LlmapiEndpoint(url)
    try:
        return endpoint.generate(SPECULATIVE_MODEL, GenerateRequest(prompt, 16), 60).text
    finally:
        endpoint.close()


# ---------------------------------------------------------------- `specdeploy run`, both control modes


@pytest.mark.server
@pytest.mark.parametrize("control", ["side_by_side", "load_unload"])
def test_run_an_llmapi_recipe_to_a_verdict(tmp_path, tiny_tokenizer_dir, control):
    """quantize -> build -> repo -> serve -> validate -> stop on an llmapi-layout cpu recipe. load_unload: the server
    starts with the speculative model only, validate loads the control, measures it and swaps back."""
    from click.testing import CliRunner

    from specdeploy.cli.main import main

    target_dir, draft_dir = make_tiny_pair(tmp_path, tiny_tokenizer_dir)
    recipe_path = tmp_path / "llmapi.yaml"
    recipe_path.write_text(json.dumps(_recipe(target_dir, draft_dir, name="llmapi-run", triton={"control": control})))
    root = tmp_path / "project"
    result = CliRunner().invoke(main, ["--root", str(root), "run", str(recipe_path), "--no-progress"])
    out = result.output
    assert "stopped tritonserver" in out, out
    log = (root / "engines" / "llmapi-run" / "server" / server.LOG_FILE).read_text()
    report = json.loads((root / "engines" / "llmapi-run" / "report" / "report.json").read_text())
    summary = report["parity"]["summary"]["all"]
    assert summary["compared"] == summary["prompts"] == 4 and summary["exact"] == 4 and summary["tokens"] >= 40, summary
    assert report["gate"]["passed"] is True and result.exit_code == 0, out
    if control == "load_unload":
        assert "--model-control-mode=explicit" in log and "--load-model=tensorrt_llm" in log
        swaps = report["settings"]["control_loading"]["swaps"]
        assert [s["loaded"] for s in swaps] == [
            "tensorrt_llm_control",
            "tensorrt_llm",
            "tensorrt_llm_control",
            "tensorrt_llm",
        ], swaps
        assert "successfully unloaded 'tensorrt_llm_control'" in log
        assert not report["metrics_check"]["checked"] and "load_unload" in report["metrics_check"]["notes"][0]
    else:
        assert "control_loading" not in report["settings"] and "--model-control-mode" not in log
        assert report["metrics_check"]["checked"] and not report["metrics_check"]["mismatches"], report["metrics_check"]


def test_the_openai_front_is_refused_on_the_llmapi_layout(tmp_path):
    from click.testing import CliRunner

    from specdeploy.cli.main import main

    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(json.dumps(_recipe(tmp_path / "t", tmp_path / "d")))
    result = CliRunner().invoke(main, ["--root", str(tmp_path), "serve", str(recipe_path), "--openai-port", "18123"])
    assert result.exit_code != 0 and "llmapi layout" in result.output and not (tmp_path / "engines").exists(), (
        result.output
    )


def _drafted_with_greedy_parity(recipe, repo, root, name: str, prompts) -> int:
    """Serve `repo`, send each prompt greedily to the speculative and the control model, assert equal non-empty
    answers, and return the draft tokens the speculative model reported; the server is always stopped."""
    import tritonclient.grpc as grpcclient

    srv = _serve(recipe, repo, root, name)
    client = grpcclient.InferenceServerClient(srv.state.grpc_url)
    drafted = 0
    try:
        for prompt in prompts:
            ask = dict(
                text_input=prompt,
                sampling_param_max_tokens=24,
                sampling_param_top_k=1,
                sampling_param_exclude_input_from_output=True,
                sampling_param_return_perf_metrics=True,
            )
            spec, control = _infer(client, "tensorrt_llm", **ask), _infer(client, "tensorrt_llm_control", **ask)
            assert _text(spec) == _text(control) and _text(control), prompt
            drafted += int(spec["total_draft_tokens"][0])
    finally:
        client.close()
        srv.stop()
    return drafted
