"""GPU model configs: tensorrtllm C++ backend models and the llmapi model, checked with Triton's schema."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from _trtllm_standin import install_standin, write_hf_checkpoint, write_trtllm_checkpoint

from specdeploy.core import trtllm_images
from specdeploy.core.artifacts import Layout
from specdeploy.core.errors import RepoError
from specdeploy.deploy import backend_stages
from specdeploy.gpu import llmapi_repository as llmapi
from specdeploy.gpu import llmapi_upstream, trtllm, trtllm_build
from specdeploy.gpu import triton_models as gpu_models
from specdeploy.recipe.load import parse_recipe
from specdeploy.triton import layout_models, model_config, repo_inputs, repository


def make_recipe(target, draft, backend="trtllm-engine", tp=2, decoupled=False):
    return parse_recipe(
        {
            "name": "repo-gpu",
            "backend": backend,
            "target": {"model": str(target), "tp_size": tp, "quantization": {"qformat": "fp8"}},
            "draft": {"model": str(draft), "quantization": {"qformat": "fp8"}},
            "speculative": {"max_draft_len": 4, "num_draft_tokens": 4},
            "engine": {"max_batch_size": 1, "kv_cache_free_gpu_mem_fraction": 0.9},
            "triton": {"decoupled": decoupled, "max_queue_delay_microseconds": 0},
        }
    )


@pytest.fixture
def built_engines(tmp_path, monkeypatch, tiny_llama_dir, tiny_llama_draft_dir):
    monkeypatch.setattr(trtllm.gpu_probe, "probe", lambda timeout_s=10.0: [])
    install_standin(tmp_path / "bin", monkeypatch, tmp_path / "record.jsonl")
    recipe = make_recipe(tiny_llama_dir, tiny_llama_draft_dir)
    layout = Layout.of(recipe, tmp_path / "project")
    write_trtllm_checkpoint(layout.checkpoint("target"), recipe.name, tiny_llama_dir, tp=2, layers=8)
    write_trtllm_checkpoint(layout.checkpoint("draft"), recipe.name, tiny_llama_draft_dir, tp=1, layers=1)
    trtllm_build.build_engine_recipe(recipe, layout, echo=lambda s: None)
    return recipe, layout


@pytest.fixture
def built_llmapi(tmp_path, monkeypatch, tiny_llama_dir, tiny_llama_draft_dir):
    """A trtllm-llmapi recipe with its (Hugging Face format) checkpoints and LLM-API build outputs."""
    monkeypatch.setattr(trtllm.gpu_probe, "probe", lambda timeout_s=10.0: [])
    recipe = make_recipe(tiny_llama_dir, tiny_llama_draft_dir, backend="trtllm-llmapi")
    layout = Layout.of(recipe, tmp_path / "project")
    write_hf_checkpoint(layout.checkpoint("target"), recipe.name, tiny_llama_dir)
    write_hf_checkpoint(layout.checkpoint("draft"), recipe.name, tiny_llama_draft_dir)
    trtllm.build_llmapi_recipe(recipe, layout, echo=lambda s: None)
    return recipe, layout


def test_tensorrtllm_models_parse_and_carry_parameters(built_engines):
    recipe, layout = built_engines
    inp = repo_inputs.repo_inputs(recipe, layout)
    specs = gpu_models.trtllm_engine_models(inp)
    assert [s.name for s in specs] == ["tensorrt_llm", "tensorrt_llm_draft"]
    fractions = {}
    for spec, role in zip(specs, ("target", "draft")):
        config = model_config.check_config(model_config.render(spec), spec.name)
        assert config.backend == "tensorrtllm"
        assert config.max_batch_size == 1
        params = {k: v.string_value for k, v in config.parameters.items()}
        assert params["gpt_model_path"] == str(layout.engine(role).resolve())
        assert params["gpt_model_type"] == "inflight_fused_batching"
        assert params["enable_kv_cache_reuse"] == "true"
        assert params["max_beam_width"] == "1"
        assert params["exclude_input_in_output"] == "false"  # same default as the cpu backend
        assert params["gpu_device_ids"] == ("0,1" if role == "target" else "0")
        fractions[role] = float(params["kv_cache_free_gpu_mem_fraction"])
        if role == "draft":  # capped at batch x max_seq_len tokens, whichever order Triton loads the two in
            cap = recipe.engine.max_batch_size * recipe.engine.max_seq_len
            assert params["max_tokens_in_paged_kv_cache"] == str(cap)
        else:
            assert "max_tokens_in_paged_kv_cache" not in params
        assert config.model_transaction_policy.decoupled is False
        assert {i.name for i in config.input} >= {"input_ids", "draft_input_ids", "draft_logits", "request_output_len"}
        assert {o.name for o in config.output} >= {"output_ids", "sequence_length", "generation_logits"}
    # fractions compose in load order (target first: it takes f_t of the free memory F, the draft then f_d of
    # what is left): together they take the recipe's 0.9 of F. Computed here, not with gpu_models' helper.
    target_share = fractions["target"]
    draft_share = fractions["draft"] * (1 - fractions["target"])
    assert draft_share + target_share == pytest.approx(0.9, abs=1e-3)
    assert draft_share < target_share


def test_decoupled_mode_goes_to_transaction_policy(built_engines):
    import dataclasses

    recipe, layout = built_engines
    inp = repo_inputs.repo_inputs(recipe, layout)
    inp = dataclasses.replace(
        inp, recipe=dataclasses.replace(recipe, triton=dataclasses.replace(recipe.triton, decoupled=True))
    )
    for spec in gpu_models.trtllm_engine_models(inp):
        assert model_config.check_config(model_config.render(spec)).model_transaction_policy.decoupled is True


def test_kv_split_is_computed_in_load_order():
    # total 0.9, draft 10 % of the KV bytes per token -> wanted: draft 0.09 F, target 0.81 F of the free memory F.
    # Target loads first: it takes 0.81 F; 0.19 F is left, so the draft needs 0.09 / 0.19 = 0.4737 of it.
    assert gpu_models.kv_fraction_split(0.9, 100, 900) == {"draft": 0.4737, "target": 0.81}
    # Draft first: it takes 0.09 F; 0.91 F left, the target needs 0.81 / 0.91 = 0.8901 of it.
    assert gpu_models.kv_fraction_split(0.9, 100, 900, ("draft", "target")) == {"draft": 0.09, "target": 0.8901}
    assert gpu_models.kv_fraction_split(0.9, None, None) == {"draft": 0.4737, "target": 0.81}  # default share 0.1
    # shares clamp to 5 %..50 %: total 1.0, draft share 0.05 -> target 0.95 first, draft 0.05 / 0.05 = 1.0
    assert gpu_models.kv_fraction_split(1.0, 1, 1000) == {"draft": 1.0, "target": 0.95}
    assert gpu_models.kv_fraction_split(1.0, 1000, 1) == {"draft": 1.0, "target": 0.5}


def test_the_naive_split_starves_a_draft_loaded_second():
    # the review's finding: 0.09 + 0.81 with the draft second leaves it 0.09 * (1 - 0.81) = 1.71 % of F
    naive = gpu_models.kv_shares_when_loaded({"draft": 0.09, "target": 0.81}, ("target", "draft"))
    assert naive["draft"] == pytest.approx(0.0171)
    split = gpu_models.kv_fraction_split(0.9, 100, 900)
    assert gpu_models.kv_shares_when_loaded(split, ("target", "draft")) == pytest.approx(
        {"draft": 0.09, "target": 0.81}, abs=1e-4
    )


def test_a_capped_draft_loaded_first_leaves_the_target_its_share():
    # Same fractions, but Triton loads the draft first. Its max_tokens_in_paged_kv_cache cap (here worth 0.06 F)
    # bounds it: draft min(0.4737 F, 0.06 F) = 0.06 F, then the target 0.81 * 0.94 F = 0.7614 F.
    split = gpu_models.kv_fraction_split(0.9, 100, 900)
    shares = gpu_models.kv_shares_when_loaded(split, ("draft", "target"), caps={"draft": 0.06})
    assert shares == pytest.approx({"draft": 0.06, "target": 0.7614})


def test_llmapi_models_config_and_model_yaml(tmp_path, built_llmapi):
    """The speculative llmapi model and its control: same target, the control without speculative_config."""
    recipe, layout = built_llmapi
    inp = repo_inputs.repo_inputs(recipe, layout)
    dest = tmp_path / "repo"
    upstream = tmp_path / "TensorRT-LLM"
    (upstream / llmapi_upstream.UPSTREAM_DIR).mkdir(parents=True)
    (upstream / llmapi_upstream.UPSTREAM_DIR / "model.py").write_text("# upstream model.py\n")
    with pytest.raises(RepoError, match=f"--trtllm-src {upstream} has no .*helpers.py"):  # a checkout lacking one
        llmapi.write_models(inp, layout, dest, upstream)
    (upstream / llmapi_upstream.UPSTREAM_DIR / "helpers.py").write_text("# upstream helpers.py\n")
    assert llmapi.write_models(inp, layout, dest, upstream) == []
    assert llmapi.write_models(inp, layout, tmp_path / "from-image") == [  # the container's start copies them in
        f"{name}/1/{file}" for name in llmapi.MODELS for file in ("model.py", "helpers.py")
    ]
    for name in llmapi.MODELS:
        config = model_config.check_config((dest / name / "config.pbtxt").read_text(), name)
        assert config.backend == "python" and config.max_batch_size == 0 and not config.parameters
        assert {i.name for i in config.input} >= {"text_input", "sampling_param_max_tokens"}
        assert (dest / name / "1" / "model.py").read_text() == "# upstream model.py\n"
    model_yaml = yaml.safe_load((dest / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert model_yaml["model"] == str(layout.checkpoint("target"))
    assert model_yaml["backend"] == "pytorch" and model_yaml["tensor_parallel_size"] == 2
    assert model_yaml["speculative_config"]["decoding_type"] == "DraftTarget"
    assert model_yaml["speculative_config"]["speculative_model_dir"] == str(layout.checkpoint("draft"))  # the 1.2 name
    assert model_yaml["triton_config"] == {"max_batch_size": 0, "decoupled": False}
    control_yaml = yaml.safe_load((dest / "tensorrt_llm_control" / "1" / "model.yaml").read_text())
    assert control_yaml == {k: v for k, v in model_yaml.items() if k != "speculative_config"}


def test_generate_repository_for_trtllm_engine(built_engines):
    """The whole repository from the shared generator: GPU engine models + the shared models, all parsing."""
    recipe, layout = built_engines
    path, written = backend_stages.of(recipe).write_repository(recipe, layout)
    assert written
    names = sorted(p.name for p in path.iterdir() if (p / "config.pbtxt").is_file())
    assert names == [
        "ensemble",
        "postprocessing",
        "preprocessing",
        "tensorrt_llm",
        "tensorrt_llm_bls",
        "tensorrt_llm_draft",
    ]
    for name in names:
        config = model_config.check_config((path / name / "config.pbtxt").read_text(), name)
        if name in ("tensorrt_llm", "tensorrt_llm_draft"):
            assert config.backend == "tensorrtllm"
            assert not (path / name / "1" / "model.py").exists()  # C++ backend: no python source
    from specdeploy.core.artifacts import Manifest

    # trtllm-build saves no tokenizer: the generator takes it from the source model the engine manifest names
    assert Manifest.read(path).extra["tokenizer_source"] == recipe.target.model


def test_generate_llmapi_repository_is_atomic_and_up_to_date(built_llmapi):
    recipe, layout = built_llmapi
    warnings = []
    path, written = llmapi.generate_repository(recipe, layout, echo=warnings.append)
    assert written and sorted(p.name for p in path.iterdir()) == [
        "manifest.json",
        "tensorrt_llm",
        "tensorrt_llm_control",
    ]
    # model.py and helpers.py (twice) come from the image at the container's start: said, not faked
    assert len(warnings) == 1 and "tensorrt_llm_control/1/helpers.py come from the image" in warnings[0]
    assert "--trtllm-src" in warnings[0]
    repository.require_repository(recipe, layout)  # the serve stage accepts it
    assert llmapi.generate_repository(recipe, layout)[1] is False
    assert backend_stages.of(recipe).write_repository(recipe, layout) == (
        path,
        False,
    )  # `specdeploy repo` dispatches here


# ---------------------------------------------------------------- tensor names of the image's backend release

REFERENCE_NAMES = Path(__file__).parent / "data" / "trtllm_backend_tensor_names.json"


def _model_specs(recipe, layout):
    stages = backend_stages.of(recipe)
    return layout_models.model_specs(
        repo_inputs.repo_inputs(recipe, layout), stages.engine_models, stages.finish_models
    )


def _set_built_version(layout, version):
    from specdeploy.core.artifacts import Manifest

    manifest = Manifest.read(layout.engine("target"))
    manifest.tool_versions["trtllm-build"] = version
    manifest.write(layout.engine("target"))


@pytest.mark.parametrize(
    ("version", "tag"),
    [("0.16.0", "v0.16.0"), ("0.17.0", "v0.17.0"), ("0.18.0", "v0.18.0"), ("0.18.2", "v0.18.2"), ("0.19.0", "v0.19.0")],
)
def test_engine_models_declare_the_tensor_names_of_the_release_that_built_the_engines(built_engines, version, tag):
    """Each model the repository writes for trtllm-engine names only tensors NVIDIA's tensorrt_llm model of that
    release declares (config.pbtxt at the tag, extracted into tests/data), and the ensemble and the BLS send
    only those: the 0.18 backend reads min_length / random_seed and has no perf outputs."""
    import json

    reference = json.loads(REFERENCE_NAMES.read_text())[tag]
    recipe, layout = built_engines
    _set_built_version(layout, version)
    specs = {s.name: s for s in _model_specs(recipe, layout)}
    for name in ("tensorrt_llm", "tensorrt_llm_draft"):
        config = model_config.check_config(model_config.render(specs[name]), name)
        assert {i.name for i in config.input} <= set(reference["inputs"]), name
        assert {o.name for o in config.output} <= set(reference["outputs"]), name
        declared = {i.name for i in config.input}
    ensemble = specs["ensemble"]
    llm_step = next(step for step in ensemble.steps if step.model == "tensorrt_llm")
    assert {k for k, _ in llm_step.input_map} <= declared
    assert {k for k, _ in llm_step.output_map} <= set(reference["outputs"])
    model_config._check_ensemble(ensemble, specs)  # every mapping names a tensor of its step model
    sent = json.loads(specs["tensorrt_llm_bls"].parameters["engine_tensor_names"])
    bls_names = {sent.get(n, n) for n in ("min_tokens", "seed", "return_perf_metrics", "first_token_time_ns")}
    assert bls_names - {None} <= declared | set(reference["outputs"])
    if tag.startswith("v0.18"):
        assert {"min_length", "random_seed"} <= declared and not {"min_tokens", "seed"} & declared
        assert llm_step.input_map and ("min_length", "min_tokens") in llm_step.input_map
        assert sent["min_tokens"] == "min_length" and sent["seed"] == "random_seed"
        assert sent["return_perf_metrics"] is None and sent["first_token_time_ns"] is None
        assert "arrival_time_ns" not in {t.name for t in ensemble.outputs}


def test_engines_of_an_unverified_backend_release_are_refused(built_engines):
    recipe, layout = built_engines
    _set_built_version(layout, "1.1.0")
    with pytest.raises(RepoError, match="1.1.0.*not verified") as err:
        _model_specs(recipe, layout)
    assert "trtllm-llmapi" in err.value.hint


@pytest.mark.parametrize(
    ("image", "version"),
    [
        ("nvcr.io/nvidia/tritonserver:25.03-trtllm-python-py3", "0.18.0"),
        ("nvcr.io/nvidia/tritonserver:25.01-trtllm-python-py3", "0.17.0"),
    ],
)
def test_image_table_names_the_release_an_ngc_image_carries(image, version):
    assert trtllm_images.image_trtllm(image) == version


@pytest.mark.parametrize("image", ["nvcr.io/nvidia/tritonserver:24.11-trtllm-python-py3", "myregistry/triton:latest"])
def test_an_image_the_table_does_not_know_is_refused_with_the_fix(image):
    from specdeploy.core.errors import ConfigError

    with pytest.raises(ConfigError, match="not an NGC Triton TensorRT-LLM image") as err:
        trtllm_images.image_trtllm(image)
    assert "25.03 (0.18.0)" in err.value.hint
