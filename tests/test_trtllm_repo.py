"""GPU model configs: tensorrtllm C++ backend models and the llmapi model, checked with Triton's schema."""

from __future__ import annotations

import pytest
import yaml

from _trtllm_standin import install_standin, write_hf_checkpoint, write_trtllm_checkpoint
from specdeploy import trtllm
from specdeploy.artifacts import Layout
from specdeploy.config import parse_recipe
from specdeploy.triton import gpu_models, repository


def make_recipe(target, draft, backend="trtllm-engine", tp=2, decoupled=False):
    return parse_recipe({
        "name": "repo-gpu", "backend": backend,
        "target": {"model": str(target), "tp_size": tp, "quantization": {"qformat": "fp8"}},
        "draft": {"model": str(draft), "quantization": {"qformat": "fp8"}},
        "speculative": {"max_draft_len": 4, "num_draft_tokens": 4},
        "engine": {"max_batch_size": 1, "kv_cache_free_gpu_mem_fraction": 0.9},
        "triton": {"decoupled": decoupled, "max_queue_delay_microseconds": 0},
    })  # fmt: skip


@pytest.fixture
def built_engines(tmp_path, monkeypatch, tiny_llama_dir, tiny_llama_draft_dir):
    monkeypatch.setattr(trtllm.gpu_probe, "probe", lambda timeout_s=10.0: [])
    install_standin(tmp_path / "bin", monkeypatch, tmp_path / "record.jsonl")
    recipe = make_recipe(tiny_llama_dir, tiny_llama_draft_dir)
    layout = Layout.of(recipe, tmp_path / "project")
    write_trtllm_checkpoint(layout.checkpoint("target"), recipe.name, tiny_llama_dir, tp=2, layers=8)
    write_trtllm_checkpoint(layout.checkpoint("draft"), recipe.name, tiny_llama_draft_dir, tp=1, layers=1)
    trtllm.build_engine_recipe(recipe, layout, echo=lambda s: None)
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
    inp = repository.repo_inputs(recipe, layout)
    specs = gpu_models.trtllm_engine_models(inp)
    assert [s.name for s in specs] == ["tensorrt_llm", "tensorrt_llm_draft"]
    fractions = {}
    for spec, role in zip(specs, ("target", "draft")):
        config = repository.check_config(repository.render(spec), spec.name)
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
        assert config.model_transaction_policy.decoupled is False
        assert {i.name for i in config.input} >= {"input_ids", "draft_input_ids", "draft_logits", "request_output_len"}
        assert {o.name for o in config.output} >= {"output_ids", "sequence_length", "generation_logits"}
    assert fractions["draft"] < fractions["target"]
    assert fractions["draft"] + fractions["target"] == pytest.approx(0.9)


def test_decoupled_mode_goes_to_transaction_policy(built_engines):
    import dataclasses

    recipe, layout = built_engines
    inp = repository.repo_inputs(recipe, layout)
    inp = dataclasses.replace(inp, recipe=dataclasses.replace(recipe, triton=dataclasses.replace(recipe.triton, decoupled=True)))
    for spec in gpu_models.trtllm_engine_models(inp):
        assert repository.check_config(repository.render(spec)).model_transaction_policy.decoupled is True


def test_kv_split_follows_kv_bytes_per_token():
    assert gpu_models.kv_fraction_split(0.9, 100, 900) == {"draft": 0.09, "target": 0.81}
    assert gpu_models.kv_fraction_split(0.9, None, None) == {"draft": 0.09, "target": 0.81}  # default share 0.1
    assert gpu_models.kv_fraction_split(1.0, 1, 1000)["draft"] == 0.05  # at least 5 %
    assert gpu_models.kv_fraction_split(1.0, 1000, 1)["draft"] == 0.5


def test_llmapi_model_config_and_model_yaml(tmp_path, built_llmapi):
    recipe, layout = built_llmapi
    inp = repository.repo_inputs(recipe, layout)
    dest = tmp_path / "repo"
    upstream = tmp_path / "TensorRT-LLM"
    (upstream / gpu_models.LLMAPI_UPSTREAM_DIR).mkdir(parents=True)
    (upstream / gpu_models.LLMAPI_UPSTREAM_DIR / "model.py").write_text("# upstream model.py\n")
    missing = gpu_models.llmapi_repository(inp, dest, upstream)
    assert missing == ["tensorrt_llm/1/helpers.py (copy from TensorRT-LLM "
                       "triton_backend/all_models/llmapi/tensorrt_llm/1/helpers.py)"]  # fmt: skip
    config = repository.check_config((dest / "tensorrt_llm" / "config.pbtxt").read_text(), "tensorrt_llm")
    assert config.backend == "python" and config.max_batch_size == 0
    assert {i.name for i in config.input} >= {"text_input", "sampling_param_max_tokens"}
    model_yaml = yaml.safe_load((dest / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert model_yaml["model"] == str(layout.checkpoint("target"))
    assert model_yaml["backend"] == "pytorch" and model_yaml["tensor_parallel_size"] == 2
    assert model_yaml["speculative_config"]["decoding_type"] == "DraftTarget"
    assert model_yaml["speculative_config"]["speculative_model"] == str(layout.checkpoint("draft"))
    assert model_yaml["triton_config"] == {"max_batch_size": 0, "decoupled": False}
    assert (dest / "tensorrt_llm" / "1" / "model.py").read_text() == "# upstream model.py\n"


def test_generate_repository_for_trtllm_engine(built_engines):
    """The whole repository from the shared generator: GPU engine models + the shared models, all parsing."""
    recipe, layout = built_engines
    path, written = repository.generate_repository(recipe, layout)
    assert written
    names = sorted(p.name for p in path.iterdir() if (p / "config.pbtxt").is_file())
    assert names == ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm", "tensorrt_llm_bls", "tensorrt_llm_draft"]
    for name in names:
        config = repository.check_config((path / name / "config.pbtxt").read_text(), name)
        if name in ("tensorrt_llm", "tensorrt_llm_draft"):
            assert config.backend == "tensorrtllm"
            assert not (path / name / "1" / "model.py").exists()  # C++ backend: no python source
    from specdeploy.artifacts import Manifest

    # trtllm-build saves no tokenizer: the generator takes it from the source model the engine manifest names
    assert Manifest.read(path).extra["tokenizer_source"] == recipe.target.model


def test_generate_llmapi_repository_is_atomic_and_up_to_date(built_llmapi):
    recipe, layout = built_llmapi
    warnings = []
    path, written = gpu_models.generate_llmapi_repository(recipe, layout, echo=warnings.append)
    assert written and sorted(p.name for p in path.iterdir()) == ["manifest.json", "tensorrt_llm"]
    assert len(warnings) == 2  # model.py and helpers.py must come from TensorRT-LLM: said, not faked
    repository.require_repository(recipe, layout)  # the serve stage accepts it
    assert gpu_models.generate_llmapi_repository(recipe, layout)[1] is False
    assert repository.generate_repository(recipe, layout) == (path, False)  # `specdeploy repo` dispatches here
