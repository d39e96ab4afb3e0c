"""trtllm-llmapi: the LLM-API options file, its checks, and what the build records (no GPU here)."""

from __future__ import annotations

import pytest
import yaml

from _trtllm_standin import write_hf_checkpoint, write_trtllm_checkpoint
from specdeploy import trtllm
from specdeploy.artifacts import Layout, Manifest
from specdeploy.config import parse_recipe
from specdeploy.errors import StaleArtifactError


def make_recipe(target="t", draft="d", kv=None, **extra):
    return parse_recipe({
        "name": "llmapi-test", "backend": "trtllm-llmapi",
        "target": {"model": str(target), "tp_size": 2, "quantization": {"qformat": "fp8", "kv_cache_dtype": kv}},
        "draft": {"model": str(draft), "quantization": {"qformat": "fp8"}},
        "speculative": {"max_draft_len": 5, "num_draft_tokens": 3},
        "engine": {"max_batch_size": 1, "max_input_len": 512, "max_seq_len": 1024,
                   "kv_cache_free_gpu_mem_fraction": 0.8},
        **extra,
    })  # fmt: skip


def test_options_carry_draft_target_speculative_config(tmp_path):
    recipe = make_recipe(kv="fp8")
    layout = Layout.of(recipe, tmp_path)
    options = trtllm.llmapi_options(recipe, layout)
    assert options["speculative_config"] == {
        "decoding_type": "DraftTarget",
        "max_draft_len": 5,
        "speculative_model": str(layout.checkpoint("draft")),
    }
    assert options["kv_cache_config"] == {"free_gpu_memory_fraction": 0.8, "enable_block_reuse": True, "dtype": "fp8"}
    assert options["tensor_parallel_size"] == 2 and options["pipeline_parallel_size"] == 1
    assert (options["max_batch_size"], options["max_input_len"], options["max_seq_len"]) == (1, 512, 1024)
    assert options["disable_overlap_scheduler"] is True


def test_dry_run_prints_yaml_and_serve_command(tmp_path, monkeypatch):
    monkeypatch.setattr(trtllm.gpu_probe, "probe", lambda timeout_s=10.0: [])
    recipe = make_recipe()
    lines = []
    trtllm.build_llmapi_recipe(recipe, Layout.of(recipe, tmp_path), dry_run=True, echo=lines.append)
    text = "\n".join(lines)
    assert "decoding_type: DraftTarget" in text and "trtllm-serve" in text and "--extra_llm_api_options" in text
    assert not (tmp_path / "engines").exists()


@pytest.fixture
def llmapi_env(tmp_path, monkeypatch, tiny_llama_dir, tiny_llama_draft_dir):
    monkeypatch.setattr(trtllm.gpu_probe, "probe", lambda timeout_s=10.0: [])
    recipe = make_recipe(tiny_llama_dir, tiny_llama_draft_dir)
    layout = Layout.of(recipe, tmp_path / "project")
    write_hf_checkpoint(layout.checkpoint("target"), recipe.name, tiny_llama_dir)
    write_hf_checkpoint(layout.checkpoint("draft"), recipe.name, tiny_llama_draft_dir)
    return recipe, layout


def test_build_writes_options_and_manifests(llmapi_env):
    recipe, layout = llmapi_env
    lines = []
    outputs = trtllm.build_llmapi_recipe(recipe, layout, echo=lines.append)
    assert outputs == [layout.engine("target"), layout.engine("draft")]
    written = yaml.safe_load((layout.engine("target") / trtllm.LLMAPI_OPTIONS).read_text())
    assert written == trtllm.llmapi_options(recipe, layout)
    m = Manifest.read(layout.engine("target"))
    assert m.stage == "build" and m.settings["backend"] == "trtllm-llmapi" and m.settings["max_draft_len"] == 5
    # honest about what it could not do here
    assert m.extra["start_check"].startswith("not run")
    assert Manifest.read(layout.engine("draft")).settings["role"] == "draft"
    again = []
    trtllm.build_llmapi_recipe(recipe, layout, echo=again.append)
    assert any("up to date" in line for line in again)


def test_trtllm_format_checkpoint_is_refused(llmapi_env, tiny_llama_dir):
    recipe, layout = llmapi_env
    write_trtllm_checkpoint(layout.checkpoint("target"), recipe.name, tiny_llama_dir, tp=2)
    with pytest.raises(StaleArtifactError, match="Hugging Face-format"):
        trtllm.build_llmapi_recipe(recipe, layout, echo=lambda s: None)


def test_unquantized_export_is_refused_for_fp8(llmapi_env, tiny_llama_dir):
    recipe, layout = llmapi_env
    write_hf_checkpoint(layout.checkpoint("draft"), recipe.name, tiny_llama_dir, quantized=False)
    with pytest.raises(StaleArtifactError, match="hf_quant_config"):
        trtllm.build_llmapi_recipe(recipe, layout, echo=lambda s: None)


def test_start_check_says_why_it_did_not_run(tmp_path):
    assert trtllm.prove_llmapi_starts(tmp_path, {}).startswith("not run")
