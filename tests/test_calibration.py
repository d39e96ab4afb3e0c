"""Quantizing large models: the calibration estimate and refusal, and pre-quantized checkpoints used as is."""

from __future__ import annotations

import json
import shutil

import pytest

from specdeploy.core.artifacts import Layout, Manifest
from specdeploy.core.errors import ConfigError, QuantizeError
from specdeploy.quantize import calibration
from specdeploy.quantize import stage as quantize
from specdeploy.recipe.config import QuantConfig
from specdeploy.recipe.load import parse_recipe

GIB = 2**30
# meta-llama/Llama-3.1-70B-Instruct config.json (the fields the estimate reads)
LLAMA_70B = {
    "num_hidden_layers": 80,
    "hidden_size": 8192,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
# By hand: attention 8192 * 128 * (2*64 + 2*8) = 150,994,944 and MLP 3 * 8192 * 28672 = 704,643,072 per layer,
# x 80 layers = 68,451,041,280; embeddings + lm_head 2 * 128256 * 8192 = 2,101,346,304.
LLAMA_70B_PARAMS = 70_552_387_584


def test_parameter_count_of_llama_70b():
    assert calibration.count_params(LLAMA_70B) == LLAMA_70B_PARAMS


def test_cpu_calibration_of_70b_is_refused_with_alternatives():
    quant = QuantConfig(qformat="fp8", calib_size=512, calib_max_seq_length=512)
    plan = calibration.plan_calibration(LLAMA_70B, quant, gpu_memory_bytes=[], ram_bytes=512 * GIB)
    assert plan.device == "cpu"
    # fp32 model + its fp32 reference copy, 15 % headroom: 2 * 4 * 70.55e9 * 1.15 bytes = 604.5 GiB
    assert plan.peak_bytes == int(2 * 4 * LLAMA_70B_PARAMS * 1.15)
    # 2 * params * 512 * 512 tokens / 2e11 FLOP/s = 184,949 s = 51.4 h
    assert plan.seconds == pytest.approx(2 * LLAMA_70B_PARAMS * 512 * 512 / 2e11)
    assert "51.4 h" in plan.summary()
    with pytest.raises(QuantizeError, match="needs 605 GiB of RAM but this machine has 512 GiB") as err:
        calibration.check_calibration(plan, quant, "/models/Llama-3.1-70B-Instruct", "target")
    assert "pre-quantized checkpoint" in err.value.hint and "GPUs" in err.value.hint


def test_cpu_calibration_that_fits_but_takes_days_is_refused():
    quant = QuantConfig(qformat="fp8")
    plan = calibration.plan_calibration(LLAMA_70B, quant, [], ram_bytes=2048 * GIB)
    with pytest.raises(QuantizeError, match="max_calib_hours"):
        calibration.check_calibration(plan, quant, "m", "target")
    generous = QuantConfig(qformat="fp8", max_calib_hours=100)
    calibration.check_calibration(plan, generous, "m", "target")  # the user said so


def test_gpu_calibration_of_70b_fits_four_h100s():
    quant = QuantConfig(qformat="fp8")
    plan = calibration.plan_calibration(LLAMA_70B, quant, [80 * GIB] * 4, ram_bytes=512 * GIB)
    assert plan.device == "cuda"
    assert plan.peak_bytes == int(2 * LLAMA_70B_PARAMS * 1.15)  # bf16, 151 GiB < 320 GiB
    assert plan.seconds == pytest.approx(2 * LLAMA_70B_PARAMS * 512 * 512 / 2e14)  # ~185 s
    calibration.check_calibration(plan, quant, "m", "target")
    one_gpu = calibration.plan_calibration(LLAMA_70B, quant, [80 * GIB], ram_bytes=512 * GIB)
    with pytest.raises(QuantizeError, match="GPU memory"):
        calibration.check_calibration(one_gpu, quant, "m", "target")


def test_awq_counts_its_capped_samples_and_search_passes():
    quant = QuantConfig(qformat="int4_awq", calib_size=512, calib_max_seq_length=512)
    plan = calibration.plan_calibration(LLAMA_70B, quant, [80 * GIB] * 4, ram_bytes=None)
    assert plan.seconds == pytest.approx(2 * LLAMA_70B_PARAMS * 32 * 512 * 4 / 2e14)


# ---------------------------------------------------------------- pre-quantized checkpoints


def _export(path, quantization=None, config_extra=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", **(config_extra or {})}))
    if quantization is not None:
        (path / "hf_quant_config.json").write_text(
            json.dumps({"producer": {"name": "modelopt"}, "quantization": quantization})
        )
    return path


def test_nvidia_fp8_export_is_detected(tmp_path):
    pre = calibration.detect_prequantized(_export(tmp_path / "a", {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}))
    assert (pre.qformat, pre.kv_cache_dtype, pre.source) == ("fp8", "fp8", "hf_quant_config.json")
    pre = calibration.detect_prequantized(
        _export(
            tmp_path / "b",
            config_extra={"quantization_config": {"quant_method": "modelopt", "quant_algo": "W4A16_AWQ"}},
        )
    )
    assert (pre.qformat, pre.kv_cache_dtype) == ("int4_awq", None)
    assert calibration.detect_prequantized(_export(tmp_path / "c")) is None


@pytest.mark.parametrize(
    ("quantization", "config_extra", "words"),
    [
        ({"quant_algo": "NVFP4"}, None, "does not deploy"),
        (None, {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "not by ModelOpt"),
    ],
)
def test_unknown_quantized_formats_are_refused(tmp_path, quantization, config_extra, words):
    with pytest.raises(QuantizeError, match=words):
        calibration.detect_prequantized(_export(tmp_path / "m", quantization, config_extra))


def test_prequantized_must_match_the_recipe_and_backend():
    pre = calibration.Prequantized("fp8", "fp8", "hf_quant_config.json")
    calibration.check_prequantized(
        pre, QuantConfig(qformat="fp8", kv_cache_dtype="fp8"), "trtllm-llmapi", "m", "target"
    )
    with pytest.raises(ConfigError, match="already quantized as fp8"):
        calibration.check_prequantized(pre, QuantConfig(qformat="int4_awq"), "trtllm-llmapi", "m", "target")
    with pytest.raises(ConfigError, match="trtllm-llmapi"):
        calibration.check_prequantized(
            pre, QuantConfig(qformat="fp8", kv_cache_dtype="fp8"), "trtllm-engine", "m", "target"
        )


def _recipe(target, draft, backend="trtllm-llmapi", kv="fp8"):
    return parse_recipe(
        {
            "name": "preq",
            "backend": backend,
            "target": {"model": str(target), "quantization": {"qformat": "fp8", "kv_cache_dtype": kv}},
            "draft": {"model": str(draft), "quantization": {"qformat": "fp8", "kv_cache_dtype": kv}},
            "speculative": {"max_draft_len": 4, "num_draft_tokens": 4},
            "engine": {"max_seq_len": 256, "max_input_len": 128},
            "validation": {"max_tokens": 16},
        }
    )


def test_quantize_links_a_prequantized_export_without_calibrating(
    tmp_path, monkeypatch, tiny_llama_dir, tiny_llama_draft_dir
):
    from specdeploy.gpu import trtllm

    def no_calibration(*a, **k):
        raise AssertionError("a pre-quantized checkpoint must not be calibrated")

    monkeypatch.setattr(quantize, "quantize_model", no_calibration)
    exports = {}
    for role, src in (("target", tiny_llama_dir), ("draft", tiny_llama_draft_dir)):
        exports[role] = tmp_path / f"{role}-fp8"
        shutil.copytree(src, exports[role])
        (exports[role] / "hf_quant_config.json").write_text(
            json.dumps(
                {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}
            )
        )
    recipe = _recipe(exports["target"], exports["draft"])
    layout = Layout.of(recipe, tmp_path / "project")
    lines = []
    reports = quantize.quantize_recipe(recipe, layout, echo=lines.append)
    assert reports == {"target": None, "draft": None}
    ckpt = layout.checkpoint("target")
    assert (ckpt / "model.safetensors").is_symlink()
    assert (ckpt / "model.safetensors").resolve() == (exports["target"] / "model.safetensors").resolve()
    m = Manifest.read(ckpt)
    assert m.settings["prequantized"] is True and m.extra["prequantized_from"] == "hf_quant_config.json"
    assert any("no calibration" in line for line in lines)
    trtllm.check_hf_checkpoint(ckpt, "target", "fp8")  # the LLM-API build accepts it
    again = []
    quantize.quantize_recipe(recipe, layout, echo=again.append)
    assert sum("up to date" in line for line in again) == 2


def test_quantize_refuses_a_70b_cpu_calibration_before_loading(tmp_path, monkeypatch, tiny_llama_dir):
    big = tmp_path / "llama-70b"
    big.mkdir()
    config = {k: v for k, v in json.loads((tiny_llama_dir / "config.json").read_text()).items() if k != "head_dim"}
    (big / "config.json").write_text(json.dumps({**config, **LLAMA_70B}))
    (big / "model-00001-of-00030.safetensors").write_bytes(b"")  # weights are not read before the refusal
    monkeypatch.setattr(quantize, "_machine_memory", lambda: ([], 256 * GIB))
    monkeypatch.setattr(quantize, "quantize_model", lambda *a, **k: pytest.fail("loaded the model"))
    recipe = _recipe(big, tiny_llama_dir, backend="cpu", kv=None)
    with pytest.raises(QuantizeError, match="target .*llama-70b: calibrating 70.55B parameters on cpu"):
        quantize.quantize_recipe(recipe, Layout.of(recipe, tmp_path / "project"), echo=lambda s: None)
