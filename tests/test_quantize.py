"""The quantize stage on tiny random Llama models: every format, its files, its numerics, reuse and bad inputs.

Dequantization tolerances (per element, w = source fp32 weight, s = stored scale, p = stored bf16
pre-quant (SmoothQuant/AWQ) scale folded back into the weight):
  fp8       |deq - w| <= 2^-4 |w| + 2^-9 s        (E4M3: 3 mantissa bits -> half-ulp 2^-4; subnormal step 2^-9 s)
  int8_wo   |deq - w| <= s_row / 2                (round to nearest of a per-channel scale)
  int8_sq   |deq - w| <= p s_row / 2 + 2^-7 |w|   (plus the bf16 rounding of p)
  int4_awq  |deq - w| <= p s_block / 2 + 2^-7 |w| (per-block scale, block = awq_block_size)
  full_prec |deq - w| <= 2^-8 |w|                 (bf16 rounding)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

from specdeploy.cli.main import main
from specdeploy.core.artifacts import Layout, Manifest
from specdeploy.core.errors import ConfigError, ModelError, QuantizeError
from specdeploy.quantize import calibration_text, modelopt
from specdeploy.quantize import export as checkpoint_export
from specdeploy.quantize import formats as quant_formats
from specdeploy.quantize import stage as qz
from specdeploy.recipe.config import QFORMATS, QuantConfig, to_plain
from specdeploy.recipe.load import parse_recipe

TINY = dict(calib_size=4, calib_max_seq_length=32, awq_block_size=64)
CASES = {  # name -> (qformat, kv_cache_dtype)
    "full_prec": ("full_prec", None),
    "fp8": ("fp8", None),
    "fp8_kv": ("fp8", "fp8"),
    "int8_sq": ("int8_sq", None),
    "int8_sq_int8kv": ("int8_sq", "int8"),  # only without paged context FMHA
    "int8_wo": ("int8_wo", None),
    "int4_awq": ("int4_awq", None),
}
Export = namedtuple("Export", "dir config weights report")

LINEARS = {  # TensorRT-LLM name -> Hugging Face projection(s) (qkv is fused)
    "attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attention.dense": ("self_attn.o_proj",),
    "mlp.fc": ("mlp.gate_proj",),
    "mlp.gate": ("mlp.up_proj",),
    "mlp.proj": ("mlp.down_proj",),
}
CONFIG_KEYS = (
    "architecture",
    "dtype",
    "logits_dtype",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_size",
    "intermediate_size",
    "norm_epsilon",
    "position_embedding_type",
    "max_position_embeddings",
    "hidden_act",
    "mapping",
    "quantization",
    "rotary_base",
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matrices: one thread avoids OpenMP synchronisation costs (100x on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def exports(tiny_llama_dir, tmp_path_factory):
    out = {}
    for name, (qformat, kv) in CASES.items():
        path = tmp_path_factory.mktemp(f"ckpt-{name}")
        quant = QuantConfig(qformat=qformat, kv_cache_dtype=kv, **TINY)
        report = modelopt.quantize_model(
            tiny_llama_dir, quant, path, progress=False, paged_context_fmha=kv != "int8", echo=lambda *_: None
        )
        out[name] = Export(
            path, json.loads((path / "config.json").read_text()), load_file(path / "rank0.safetensors"), report
        )
    return out


@pytest.fixture(scope="module")
def source_weights(tiny_llama_dir):
    return load_file(Path(tiny_llama_dir) / "model.safetensors")


def test_every_qformat_has_a_handler():
    assert (
        set(quant_formats.MODELOPT_CFG)
        == set(QFORMATS)
        == set(quant_formats.QUANT_ALGO)
        == set(quant_formats.WEIGHT_BYTES)
    )


@pytest.mark.parametrize("name", CASES)
def test_config_json_has_trtllm_keys(exports, name):
    qformat, kv = CASES[name]
    config = exports[name].config
    assert not [k for k in CONFIG_KEYS if k not in config]
    assert config["architecture"] == "LlamaForCausalLM" and config["dtype"] == "bfloat16"
    assert config["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    assert (
        config["quantization"]["quant_algo"]
        == {
            "full_prec": None,
            "fp8": "FP8",
            "int8_sq": "W8A8_SQ_PER_CHANNEL",
            "int8_wo": "W8A16",
            "int4_awq": "W4A16_AWQ",
        }[qformat]
    )
    assert config["quantization"]["kv_cache_quant_algo"] == {None: None, "fp8": "FP8", "int8": "INT8"}[kv]
    assert config["rotary_base"] == 10000.0 and config["head_size"] == 16 and config["num_key_value_heads"] == 2
    if qformat == "int4_awq":
        assert config["quantization"]["group_size"] == 64


@pytest.mark.parametrize("name", CASES)
def test_tensor_names_dtypes_shapes(exports, name):
    qformat, kv = CASES[name]
    w = exports[name].weights
    hidden, inter, qkv = 64, 128, 64 + 2 * 2 * 16  # q: 4 heads x 16, k and v: 2 heads x 16 each
    shapes = {
        "attention.qkv": (qkv, hidden),
        "attention.dense": (hidden, hidden),
        "mlp.fc": (inter, hidden),
        "mlp.gate": (inter, hidden),
        "mlp.proj": (hidden, inter),
    }
    for layer in range(2):
        for name_, (out_f, in_f) in shapes.items():
            p = f"transformer.layers.{layer}.{name_}."
            weight = w[p + "weight"]
            if qformat == "full_prec":
                assert weight.dtype == torch.bfloat16 and weight.shape == (out_f, in_f)
                assert p + "weights_scaling_factor" not in w
                continue
            scale = w[p + "weights_scaling_factor"]
            assert scale.dtype == torch.float32
            if qformat == "fp8":
                assert weight.dtype == torch.float8_e4m3fn and weight.shape == (out_f, in_f)
                assert scale.shape == (1,) and w[p + "activation_scaling_factor"].dtype == torch.float32
            elif qformat.startswith("int8"):
                assert weight.dtype == torch.int8 and weight.shape == (out_f, in_f) and scale.shape == (out_f,)
                assert (p + "activation_scaling_factor" in w) == (qformat == "int8_sq")
            else:  # two int4 values per byte along the output dimension; one scale per 64-wide input block
                assert weight.dtype in (torch.int8, torch.uint8) and weight.shape == (out_f // 2, in_f)
                assert scale.shape == (out_f, in_f // 64) and w[p + "prequant_scaling_factor"].shape == (in_f,)
        attn = f"transformer.layers.{layer}.attention."
        assert (attn + "kv_cache_scaling_factor" in w) == (kv is not None)
        if kv:
            assert w[attn + "kv_cache_scaling_factor"].dtype == torch.float32
    for name_ in ("transformer.vocab_embedding.weight", "lm_head.weight", "transformer.ln_f.weight"):
        assert w[name_].dtype == torch.bfloat16  # embeddings, lm_head and norms stay unquantized
    assert w["lm_head.weight"].shape == (512, 64)


def unpack_int4(packed):
    """[out/2, in] bytes -> [out, in] signed int4 values (low nibble = even output row)."""
    p = packed.view(torch.uint8).to(torch.int16)
    low, high = p & 0xF, (p >> 4) & 0xF
    low, high = torch.where(low > 7, low - 16, low), torch.where(high > 7, high - 16, high)
    return torch.stack([low, high], dim=1).reshape(-1, p.shape[1]).float()


def dequantize(w, prefix, qformat):
    """Stored tensors -> float32 weight [out, in], including any folded pre-quant scale; and the tolerance."""
    weight = w[prefix + "weight"]
    if qformat == "full_prec":
        deq = weight.float()
        return deq, deq.abs() * 2**-8
    scale = w[prefix + "weights_scaling_factor"]
    pre = w[prefix + "prequant_scaling_factor"].float()[None, :] if prefix + "prequant_scaling_factor" in w else 1.0
    if qformat == "fp8":
        deq = weight.float() * scale
        return deq, deq.abs() * 2**-4 + scale * 2**-9 + 1e-7
    if qformat.startswith("int8"):
        deq = weight.float() * scale[:, None] * pre
        tol = scale[:, None] / 2 * pre
    else:
        block = weight.shape[1] // scale.shape[1]
        deq = unpack_int4(weight) * scale.repeat_interleave(block, dim=1) * pre
        tol = scale.repeat_interleave(block, dim=1) / 2 * pre
    return deq, tol * 1.01 + deq.abs() * 2**-7 * (0 if qformat == "int8_wo" else 1) + 1e-7


@pytest.mark.parametrize("name", ["full_prec", "fp8", "int8_sq", "int8_wo", "int4_awq"])
def test_dequantized_weights_reproduce_source(exports, source_weights, name):
    qformat, _ = CASES[name]
    w = exports[name].weights
    for layer in range(2):
        for trt_name, hf_names in LINEARS.items():
            source = torch.cat([source_weights[f"model.layers.{layer}.{h}.weight"] for h in hf_names])
            deq, tol = dequantize(w, f"transformer.layers.{layer}.{trt_name}.", qformat)
            assert deq.shape == source.shape
            excess = ((deq - source).abs() - tol).max().item()
            assert excess <= 0, f"{name} layer {layer} {trt_name}: error exceeds tolerance by {excess:.3g}"
    assert torch.equal(w["transformer.vocab_embedding.weight"], source_weights["model.embed_tokens.weight"].bfloat16())


def test_quality_report(exports):
    full = exports["full_prec"].report
    assert full.top1_agreement == 1.0 and full.mean_kl == 0.0 and full.source_perplexity == full.quantized_perplexity
    for name in ("fp8", "int8_sq", "int8_wo", "int4_awq"):
        r = exports[name].report
        assert r.num_tokens > 1000 and r.num_sequences == len(calibration_text.heldout_passages())
        assert r.source_perplexity == pytest.approx(full.source_perplexity)
        assert 0.5 < r.top1_agreement <= 1.0 and 0.0 <= r.mean_kl < 0.05
    table = exports["int4_awq"].report.table("target")
    assert "perplexity (int4_awq)" in table and "top-1 agreement" in table and "mean KL" in table


def test_builtin_sets_are_disjoint_and_large():
    calib, heldout = calibration_text.calibration_passages("builtin"), calibration_text.heldout_passages()
    assert len(calib) >= 300 and len(heldout) >= 30
    assert not set(calib) & set(heldout)


def test_calibration_is_seeded():
    tokens = [[i] * (i + 1) for i in range(20)]
    a, passes = calibration_text.pack_samples(tokens, 8, 16, seed=7, sep_id=0)
    b, _ = calibration_text.pack_samples(tokens, 8, 16, seed=7, sep_id=0)
    c, _ = calibration_text.pack_samples(tokens, 8, 16, seed=8, sep_id=0)
    assert a.shape == (8, 16) and torch.equal(a, b) and not torch.equal(a, c) and passes == 1


def test_tensor_parallel_writes_one_file_per_rank(tiny_llama_dir, tmp_path):
    quant = QuantConfig(qformat="fp8", **TINY)
    modelopt.quantize_model(tiny_llama_dir, quant, tmp_path, tp_size=2, progress=False, echo=lambda *_: None)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["mapping"] == {"world_size": 2, "tp_size": 2, "pp_size": 1}
    ranks = [load_file(tmp_path / f"rank{r}.safetensors") for r in range(2)]
    assert not (tmp_path / "rank2.safetensors").exists()
    for w in ranks:
        assert w["transformer.layers.0.attention.qkv.weight"].shape == (32 + 16 + 16, 64)  # 2 q heads, 1 k, 1 v
        assert w["transformer.layers.0.mlp.fc.weight"].shape == (64, 64)  # column-parallel: 128 / 2 outputs
        assert w["transformer.layers.0.mlp.proj.weight"].shape == (64, 64)  # row-parallel: 128 / 2 inputs
    fc = [w["transformer.layers.0.mlp.fc.weight"].float() for w in ranks]
    assert ranks[0]["transformer.layers.0.mlp.fc.weight"].dtype == torch.float8_e4m3fn and not torch.equal(*fc)


def test_weight_only_needs_k_multiple_of_64_per_rank(tiny_llama_dir, tmp_path):
    with pytest.raises(ConfigError, match="not multiples of 64") as info:  # dense: 64 / tp 2 = 32 inputs per rank
        modelopt.quantize_model(
            tiny_llama_dir, QuantConfig(qformat="int8_wo", **TINY), tmp_path, tp_size=2, progress=False
        )
    assert "smaller tp_size" in info.value.hint


# ---------------------------------------------------------------- the recipe: reuse, force, bad inputs


def make_recipe(target_dir, draft_dir, **target_quant):
    quant = {"calib_size": 4, "calib_max_seq_length": 32, "awq_block_size": 64}
    return parse_recipe(
        {
            "name": "tiny",
            "target": {"model": str(target_dir), "quantization": {**quant, "qformat": "fp8", **target_quant}},
            "draft": {"model": str(draft_dir), "quantization": {**quant, "qformat": "int8_wo"}},
        }
    )


def snapshot(layout):
    return {
        str(p.relative_to(layout.engines)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(layout.engines.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def done(tiny_llama_dir, tiny_llama_draft_dir, tmp_path_factory):
    """A recipe quantized once: (recipe, layout, printed lines, reports)."""
    recipe = make_recipe(tiny_llama_dir, tiny_llama_draft_dir)
    layout = Layout.of(recipe, tmp_path_factory.mktemp("root"))
    lines = []
    reports = qz.quantize_recipe(recipe, layout, echo=lines.append, progress=False)
    return recipe, layout, lines, reports


def test_recipe_writes_both_roles_with_manifests(done):
    recipe, layout, lines, reports = done
    for role, algo in (("target", "FP8"), ("draft", "W8A16")):
        ckpt = layout.checkpoint(role)
        assert (ckpt / "config.json").is_file() and (ckpt / "rank0.safetensors").is_file()
        m = Manifest.read(ckpt)
        assert m.stage == "quantize" and m.recipe_name == "tiny" and m.extra["quant_algo"] == algo
        assert m.extra["quality"] == reports[role].as_dict()
        assert m.tool_versions["nvidia-modelopt"] and m.inputs["source_hash"]
    assert any("perplexity" in line for line in lines)


def test_rerun_is_a_noop_and_force_redoes_deterministically(done, tiny_llama_dir, tiny_llama_draft_dir):
    recipe, layout, _, _ = done
    before = snapshot(layout)
    lines = []
    assert qz.quantize_recipe(recipe, layout, echo=lines.append, progress=False) == {"target": None, "draft": None}
    assert lines == [
        f"target: up to date ({layout.checkpoint('target')})",
        f"draft: up to date ({layout.checkpoint('draft')})",
    ]
    assert snapshot(layout) == before
    changed = make_recipe(tiny_llama_dir, tiny_llama_draft_dir, calib_size=5)  # a different target section
    reports = qz.quantize_recipe(changed, layout, echo=lambda *_: None, progress=False)
    assert reports["draft"] is None and reports["target"] is not None
    reports = qz.quantize_recipe(recipe, layout, force=True, echo=lambda *_: None, progress=False)
    assert reports["draft"] is not None
    after = snapshot(layout)
    rank_files = [k for k in before if k.endswith(".safetensors") or k.endswith("config.json")]
    assert {k: after[k] for k in rank_files} == {k: before[k] for k in rank_files}  # seeded: identical output


def test_cli_reports_up_to_date(done, tmp_path):
    recipe, layout, _, _ = done
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(to_plain(recipe)))
    result = CliRunner().invoke(main, ["--root", str(layout.root), "quantize", str(path), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "target: up to date" in result.output and "draft: up to date" in result.output


def _with_target(recipe, **quant):
    q = dataclasses.replace(recipe.target.quantization, **quant)
    return dataclasses.replace(recipe, target=dataclasses.replace(recipe.target, quantization=q))


def _with_target_model(recipe, model_dir):
    return dataclasses.replace(recipe, target=dataclasses.replace(recipe.target, model=str(model_dir)))


def _bad_dirs(tiny_llama_dir, tmp_path):
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(Path(tiny_llama_dir) / "config.json", no_weights)
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(tiny_llama_dir, gpt2)
    config = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(
        json.dumps({**config, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    return no_weights, gpt2


def _calib_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad\x80")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{not json\n')
    return empty, binary, broken


BAD_INPUTS = {
    "unknown qformat": (lambda r, d: _with_target(r, qformat="int3"), ConfigError, "unknown qformat 'int3'"),
    "int8 kv cache": (
        lambda r, d: _with_target(r, kv_cache_dtype="int8"),
        ConfigError,
        "doesn't work with int8 kv cache",
    ),
    "fp8 kv with int8_wo": (
        lambda r, d: _with_target(r, qformat="int8_wo", kv_cache_dtype="fp8"),
        ConfigError,
        "only works with fp8 quantization workflow",
    ),
    "awq block 128 on hidden 64": (
        lambda r, d: _with_target(r, qformat="int4_awq", awq_block_size=128),
        ConfigError,
        "set awq_block_size: 64",
    ),
    "missing calibration file": (
        lambda r, d: _with_target(r, calib_dataset=str(d / "nope.jsonl")),
        ConfigError,
        "not found",
    ),
    "empty calibration file": (
        lambda r, d: _with_target(r, calib_dataset=str(d / "empty.txt")),
        ConfigError,
        "is empty",
    ),
    "unreadable calibration file": (
        lambda r, d: _with_target(r, calib_dataset=str(d / "binary.txt")),
        ConfigError,
        "unreadable",
    ),
    "broken jsonl": (
        lambda r, d: _with_target(r, calib_dataset=str(d / "broken.jsonl")),
        ConfigError,
        "line 2 is not JSON",
    ),
    "model without weights": (lambda r, d: _with_target_model(r, d / "no-weights"), ModelError, "has no weights"),
    "unsupported architecture": (lambda r, d: _with_target_model(r, d / "gpt2"), QuantizeError, "model type 'gpt2'"),
}


@pytest.fixture(scope="module")
def bad_dir(tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("bad")
    _bad_dirs(tiny_llama_dir, path)
    _calib_files(path)
    return path


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_fails_and_keeps_the_checkpoint(done, bad_dir, case):
    recipe, layout, _, _ = done
    make, error, message = BAD_INPUTS[case]
    before = snapshot(layout)
    with pytest.raises(error, match=message) as info:
        qz.quantize_recipe(make(recipe, bad_dir), layout, force=True, echo=lambda *_: None, progress=False)
    assert info.value.hint
    assert snapshot(layout) == before


def test_low_disk_space_fails_and_keeps_the_checkpoint(done, monkeypatch):
    recipe, layout, _, _ = done
    before = snapshot(layout)
    monkeypatch.setattr(
        quant_formats.shutil, "disk_usage", lambda p: SimpleNamespace(total=10**9, used=10**9 - 1000, free=1000)
    )
    with pytest.raises(QuantizeError, match="not enough disk space") as info:
        qz.quantize_recipe(recipe, layout, force=True, echo=lambda *_: None, progress=False)
    assert "free some space" in info.value.hint
    assert snapshot(layout) == before


def test_failure_midway_keeps_the_checkpoint(done, monkeypatch):
    recipe, layout, _, _ = done
    before = snapshot(layout)

    def boom(*args, **kwargs):
        raise QuantizeError("simulated export failure", "none")

    monkeypatch.setattr(
        checkpoint_export, "_finish_config", boom
    )  # after ModelOpt has written into the temporary folder
    with pytest.raises(QuantizeError, match="simulated"):
        qz.quantize_recipe(recipe, layout, force=True, echo=lambda *_: None, progress=False)
    assert snapshot(layout) == before
    assert not [p for p in layout.checkpoint("target").parent.iterdir() if p.name.startswith(".")]


def test_qwen2_exports_with_qkv_bias(tiny_tokenizer_dir, tmp_path):
    from tiny_models import make_tiny_model
    from transformers import Qwen2Config

    source = tmp_path / "qwen2"
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    make_tiny_model(source, tiny_tokenizer_dir, model_config=config)
    out = tmp_path / "ckpt"
    report = modelopt.quantize_model(
        source, QuantConfig(qformat="fp8", **TINY), out, progress=False, echo=lambda *_: None
    )
    trt = json.loads((out / "config.json").read_text())
    assert trt["architecture"] == "Qwen2ForCausalLM" and trt["qwen_type"] == "qwen2" and trt["model_type"] == "qwen"
    assert trt["quantization"]["quant_algo"] == "FP8" and report.top1_agreement > 0.5
    w = load_file(out / "rank0.safetensors")
    assert w["transformer.layers.0.attention.qkv.bias"].shape == (128,)
    assert w["transformer.layers.0.attention.qkv.weight"].dtype == torch.float8_e4m3fn


def test_llmapi_backend_gets_hugging_face_format_checkpoints(tiny_llama_dir, tmp_path):
    """The LLM API loads ModelOpt's Hugging Face export; the trtllm-llmapi build accepts what quantize wrote."""
    from specdeploy.gpu import trtllm

    quant = {"calib_size": 2, "calib_max_seq_length": 16}
    recipe = parse_recipe(
        {
            "name": "tiny-llmapi",
            "backend": "trtllm-llmapi",
            "target": {"model": str(tiny_llama_dir), "quantization": {**quant, "qformat": "fp8"}},
            "draft": {"model": str(tiny_llama_dir), "quantization": {**quant, "qformat": "full_prec"}},
        }
    )
    layout = Layout.of(recipe, tmp_path)
    qz.quantize_recipe(recipe, layout, echo=lambda *_: None, progress=False)
    target = layout.checkpoint("target")
    hf_quant = json.loads((target / "hf_quant_config.json").read_text())
    assert hf_quant["quantization"]["quant_algo"] == "FP8"
    assert "architectures" in json.loads((target / "config.json").read_text())
    assert (target / "tokenizer_config.json").is_file()
    assert not list(target.glob("rank*.safetensors"))
    trtllm.check_hf_checkpoint(target, "target", "fp8")
    trtllm.check_hf_checkpoint(layout.checkpoint("draft"), "draft", "full_prec")
    assert Manifest.read(target).settings["format"] == "hf"
