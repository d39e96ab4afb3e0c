"""CPU engine: logits against Hugging Face and ModelOpt references, bit-exact batch invariance, KV rollback.

Checkpoints are exported here with ModelOpt itself (as `specdeploy quantize` does) from tiny random models.
Tolerances (max |logit difference|, random tiny models whose logits are O(1)):
  fp32 engine vs HF fp32 with the checkpoint's weight rounding: 2e-5; bf16 engine vs HF fp32: 5e-2 and the same
  argmax on >= 90% of positions; quantized fp32 engine vs an HF model holding the checkpoint's dequantized
  weights and quantizing each linear's input as the quant algo says: 1e-5 (int8_sq: 1e-2, see the test); vs ModelOpt's
  own fake-quantized model (fp32 weights, not the checkpoint's bf16 ones, so activation roundings flip): 1e-2
  (weight-only), 3e-2 (int8_sq), 6e-2 (fp8: 3 mantissa bits).
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from tiny_models import make_tiny_model, tiny_llama_config

from specdeploy.core.errors import BuildError
from specdeploy.deploy.cpu_compile import compile_checkpoint
from specdeploy.engine import native
from specdeploy.engine.kv_cache import KVCache
from specdeploy.engine.model import CpuEngine
from specdeploy.recipe.config import EngineConfig

ENGINE = EngineConfig(dtype="float32", max_batch_size=1, max_input_len=64, max_seq_len=128)
QFORMATS = {
    "fp8": "FP8_DEFAULT_CFG",
    "int8_wo": "INT8_WEIGHT_ONLY_CFG",
    "int8_sq": "INT8_SMOOTHQUANT_CFG",
    "int4_awq": "INT4_AWQ_CFG",
}
QUANT_TOL = {"fp8": 6e-2, "int8_wo": 1e-2, "int4_awq": 1e-2, "int8_sq": 3e-2}
# hidden 128 so that INT4 AWQ's 128-wide groups fit; GQA (4 heads, 2 KV heads).
QUANT_MODEL = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def export_checkpoint(hf_dir, out_dir, qformat=None, kv_cache_dtype=None, dtype=torch.float32):
    """Quantize (or not) an HF model with ModelOpt and export a TensorRT-LLM checkpoint; returns the HF model
    as ModelOpt left it (fake-quantized: the dequantized reference)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    if qformat is not None:
        cfg = copy.deepcopy(getattr(mtq, QFORMATS[qformat]))
        if kv_cache_dtype is not None:
            kv = copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
            for entry in kv:
                entry["cfg"]["num_bits"] = (4, 3) if kv_cache_dtype == "fp8" else 8
            cfg["quant_cfg"] = list(cfg["quant_cfg"]) + kv
        gen = torch.Generator().manual_seed(0)
        calib = [torch.randint(0, model.config.vocab_size, (1, 32), generator=gen) for _ in range(4)]

        def forward_loop(m):
            with torch.no_grad():
                for ids in calib:
                    m(ids)

        mtq.quantize(model, cfg, forward_loop)
    decoder = "qwen" if model.config.model_type == "qwen2" else "llama"
    with torch.inference_mode():
        export_tensorrt_llm_checkpoint(
            model, decoder_type=decoder, dtype=dtype, export_dir=str(out_dir), inference_tensor_parallel=1
        )
    # What `specdeploy quantize` adds: ModelOpt misses transformers-5 RoPE settings.
    path = out_dir / "config.json"
    config = json.loads(path.read_text())
    rope = model.config.rope_parameters or {}
    config["rotary_base"] = float(rope.get("rope_theta", 10000.0))
    config["rotary_scaling"] = None if rope.get("rope_type", "default") == "default" else dict(rope)
    path.write_text(json.dumps(config))
    return model


def dequantized_reference(hf_dir, ckpt_dir, per_token=False):
    """An fp32 Hugging Face model carrying the checkpoint's dequantized weights, with hooks that quantize each
    linear's input the way the checkpoint's quant_algo says (int8_sq with `per_token`: each row by its own
    max |x| / 127): an independent reading of the checkpoint."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from specdeploy.deploy.cpu_compile import repack_modelopt_int4
    from specdeploy.engine.kernels import dequantize

    config = json.loads((ckpt_dir / "config.json").read_text())
    algo = config["quantization"]["quant_algo"]
    group = config["quantization"].get("group_size")
    t = {
        k: v.float() if not k.endswith(".weight") or v.is_floating_point() and v.dtype != torch.float8_e4m3fn else v
        for k, v in load_file(str(ckpt_dir / "rank0.safetensors")).items()
    }
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    hf = model.model
    n_q = hf.config.num_attention_heads * (hf.config.hidden_size // hf.config.num_attention_heads)

    def load_linear(module, prefix):
        w = t[prefix + ".weight"]
        parts = {"weight": repack_modelopt_int4(w) if algo == "W4A16_AWQ" else w}
        for src, dst in (("weights_scaling_factor", "weight_scale"),):
            if prefix + "." + src in t:
                scale = t[prefix + "." + src]
                parts[dst] = scale if algo == "W4A16_AWQ" else scale.reshape(-1).expand(parts["weight"].shape[0])
        weight = dequantize(parts, algo, group)  # [N, K] f32
        act = t.get(prefix + ".activation_scaling_factor")
        pre = t.get(prefix + ".prequant_scaling_factor")

        def quantize_input(_, args):
            x = args[0]
            if pre is not None:
                x = x * pre
            if act is not None and algo == "FP8":
                x = (x / act).clamp(-448, 448).to(torch.float8_e4m3fn).float() * act
            elif act is not None and per_token:
                row = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-6) / 127
                x = (x / row).round().clamp(-128, 127) * row
            elif act is not None:
                x = (x / act).round().clamp(-128, 127) * act
            return (x,)

        module.register_forward_pre_hook(quantize_input)
        return weight

    with torch.no_grad():
        hf.embed_tokens.weight.copy_(t["transformer.vocab_embedding.weight"])
        hf.norm.weight.copy_(t["transformer.ln_f.weight"])
        model.lm_head.weight.copy_(t.get("lm_head.weight", t["transformer.vocab_embedding.weight"]))
        for i, layer in enumerate(hf.layers):
            p = f"transformer.layers.{i}."
            layer.input_layernorm.weight.copy_(t[p + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(t[p + "post_layernorm.weight"])
            attn, mlp = layer.self_attn, layer.mlp
            qkv = load_linear(attn.q_proj, p + "attention.qkv")  # one hook on q_proj quantizes the shared input
            for module in (attn.k_proj, attn.v_proj):
                module.register_forward_pre_hook(
                    attn.q_proj._forward_pre_hooks[next(iter(attn.q_proj._forward_pre_hooks))]
                )
            n_kv = (qkv.shape[0] - n_q) // 2
            attn.q_proj.weight.copy_(qkv[:n_q])
            attn.k_proj.weight.copy_(qkv[n_q : n_q + n_kv])
            attn.v_proj.weight.copy_(qkv[n_q + n_kv :])
            attn.o_proj.weight.copy_(load_linear(attn.o_proj, p + "attention.dense"))
            mlp.gate_proj.weight.copy_(load_linear(mlp.gate_proj, p + "mlp.fc"))
            mlp.up_proj.weight.copy_(load_linear(mlp.up_proj, p + "mlp.gate"))
            mlp.down_proj.weight.copy_(load_linear(mlp.down_proj, p + "mlp.proj"))
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids[None]).logits[0].float()  # [n, vocab]


def build(tmp_path, ckpt, dtype="float32", max_draft_len=4, **overrides):
    out = tmp_path / f"engine-{dtype}-{max_draft_len}"
    compile_checkpoint(ckpt, out, dataclasses.replace(ENGINE, dtype=dtype, **overrides), max_draft_len)
    return CpuEngine.load(out)


def prompt(n=12, seed=0, vocab=512):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- fixtures: models and checkpoints

ARCHES = {
    "llama-gqa-untied": lambda: tiny_llama_config(),
    "llama3-rope-tied": lambda: tiny_llama_config(
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2-bias-tied": lambda: _qwen2_config(),
}


def _qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=1e6,
        bos_token_id=1,
        eos_token_id=2,
    )


@pytest.fixture(scope="module", params=sorted(ARCHES))
def arch_checkpoint(request, tmp_path_factory, tiny_tokenizer_dir):
    root = tmp_path_factory.mktemp(request.param)
    make_tiny_model(root / "hf", tiny_tokenizer_dir, seed=3, model_config=ARCHES[request.param]())
    model = export_checkpoint(root / "hf", root / "ckpt")
    return model, root / "ckpt"


@pytest.fixture(scope="module")
def quant_hf_dir(tmp_path_factory, tiny_tokenizer_dir):
    path = tmp_path_factory.mktemp("quant-hf")
    make_tiny_model(path, tiny_tokenizer_dir, seed=5, **QUANT_MODEL)
    return path


@pytest.fixture(scope="module")
def quant_checkpoints(tmp_path_factory, quant_hf_dir):
    """{qformat: (fake-quantized reference model, checkpoint dir)} (bf16 checkpoints, as the default recipe)."""

    class Lazy(dict):  # exported on first use, so a -k selection only pays for what it needs
        def __missing__(self, qformat):
            ckpt = tmp_path_factory.mktemp(f"ckpt-{qformat}")
            model = export_checkpoint(
                quant_hf_dir, ckpt, None if qformat == "full_prec" else qformat, dtype=torch.bfloat16
            )
            self[qformat] = (model, ckpt)
            return self[qformat]

    return Lazy()


# ---------------------------------------------------------------- against Hugging Face


def test_full_precision_fp32_matches_hf(arch_checkpoint, tmp_path):
    model, ckpt = arch_checkpoint
    engine = build(tmp_path, ckpt, "float32")
    ids = prompt(40)  # past the llama3 original context (32) to exercise the scaled frequencies
    logits = engine.forward(engine.new_cache(), ids)
    # The checkpoint holds the weights in its own dtype (ModelOpt writes fp16 when asked for fp32).
    ckpt_dtype = getattr(torch, json.loads((ckpt / "config.json").read_text())["dtype"])
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(ckpt_dtype).float())
    assert (logits - hf_logits(rounded, ids)).abs().max().item() < 2e-5


def test_full_precision_bf16_close_to_hf(arch_checkpoint, tmp_path):
    model, ckpt = arch_checkpoint
    engine = build(tmp_path, ckpt, "bfloat16")
    ids = prompt(40)
    logits = engine.forward(engine.new_cache(), ids)
    ref = hf_logits(model, ids)
    assert (logits - ref).abs().max().item() < 5e-2
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


def test_spec_records_model_facts(arch_checkpoint, tmp_path):
    model, ckpt = arch_checkpoint
    spec = build(tmp_path, ckpt).spec
    assert spec.tie_word_embeddings == bool(model.config.tie_word_embeddings)
    assert spec.attention_bias == (model.config.model_type == "qwen2")
    assert spec.num_kv_heads == 2 and spec.max_draft_len == 4
    assert spec.batch_invariant and spec.row_bucket == 8  # fp32: a multiple of 8 rows (see row_bucket_for)
    assert build(tmp_path, ckpt, "bfloat16").spec.row_bucket == 5  # bf16: one verification pass


def test_draft_engine_is_unpadded_and_agrees_with_target(quant_checkpoints, tmp_path):
    _, ckpt = quant_checkpoints["int8_wo"]
    draft, target = build(tmp_path, ckpt, "bfloat16", max_draft_len=None), build(tmp_path, ckpt, "bfloat16")
    assert not draft.spec.batch_invariant and draft.spec.max_draft_len == 0
    ids = prompt(20)
    a, b = draft.forward(draft.new_cache(), ids), target.forward(target.new_cache(), ids)
    assert (a - b).abs().max().item() < 0.05 and (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


# ---------------------------------------------------------------- quantized numerics


@pytest.mark.parametrize("qformat", sorted(QFORMATS))
def test_quantized_engine_matches_dequantized_reference(quant_hf_dir, quant_checkpoints, qformat, tmp_path):
    _, ckpt = quant_checkpoints[qformat]
    engine = build(tmp_path, ckpt, "float32")
    ids = prompt(20)
    logits = engine.forward(engine.new_cache(), ids)
    ref = hf_logits(dequantized_reference(quant_hf_dir, ckpt), ids)
    # int8 activations: a 1e-7 difference upstream can flip one rounding (one step of act_scale * weight_scale).
    assert (logits - ref).abs().max().item() < (1e-2 if qformat == "int8_sq" else 1e-5)


@pytest.mark.parametrize("qformat", sorted(QFORMATS))
def test_quantized_engine_close_to_modelopt_fake_quant(quant_checkpoints, qformat, tmp_path):
    model, ckpt = quant_checkpoints[qformat]
    engine = build(tmp_path, ckpt, "float32")
    ids = prompt(20)
    logits = engine.forward(engine.new_cache(), ids)
    assert (logits - hf_logits(model, ids)).abs().max().item() < QUANT_TOL[qformat]


@pytest.mark.parametrize("qformat", sorted(QFORMATS))
def test_quantized_bf16_engine_close_to_fp32_engine(quant_checkpoints, qformat, tmp_path):
    _, ckpt = quant_checkpoints[qformat]
    ids = prompt(20)
    fp32 = build(tmp_path, ckpt, "float32")
    bf16 = build(tmp_path, ckpt, "bfloat16")
    a, b = fp32.forward(fp32.new_cache(), ids), bf16.forward(bf16.new_cache(), ids)
    assert (a - b).abs().max().item() < 0.1
    assert (a.argmax(-1) == b.argmax(-1)).sum().item() >= 18  # of 20 (a float mean of 18/20 is below 0.9)


def test_weights_are_stored_quantized(quant_checkpoints, tmp_path):
    from safetensors.torch import load_file

    expected = {"fp8": torch.float8_e4m3fn, "int8_wo": torch.int8, "int8_sq": torch.int8, "int4_awq": torch.uint8}
    for qformat, dtype in expected.items():
        out = tmp_path / qformat
        compile_checkpoint(quant_checkpoints[qformat][1], out, ENGINE, None)
        tensors = load_file(str(out / "model.safetensors"))
        assert tensors["layers.0.qkv.weight"].dtype == dtype
        assert ("layers.0.gate_up.weight" in tensors) or ("layers.0.gate.weight" in tensors)


def test_per_token_build_of_an_int8_sq_checkpoint(quant_hf_dir, quant_checkpoints, tmp_path):
    """quantization.per_token: the same ModelOpt int8_sq checkpoint compiled into an engine whose linears quantize
    activations per token (SQ_PER_TOKEN, no act_scale kept); its logits follow an independent per-token reading of
    the checkpoint and differ from the static engine's; per_token on another format is refused."""
    from safetensors.torch import load_file

    from specdeploy.engine.spec import SQ_PER_TOKEN

    _, ckpt = quant_checkpoints["int8_sq"]
    engines = {}
    for dtype in ("float32", "bfloat16"):  # torch's SmoothQuantLinear, and the native kernel's per-token mode
        spec = compile_checkpoint(ckpt, tmp_path / dtype, dataclasses.replace(ENGINE, dtype=dtype), 4, per_token=True)
        assert spec.quant_algo == SQ_PER_TOKEN
        tensors = load_file(str(tmp_path / dtype / "model.safetensors"))
        assert not any(name.endswith("act_scale") for name in tensors) and "layers.0.qkv.pre_quant_scale" in tensors
        engines[dtype] = CpuEngine.load(tmp_path / dtype)
    static = build(tmp_path, ckpt, "float32")
    ids = prompt(20)
    a = engines["float32"].forward(engines["float32"].new_cache(), ids)
    ref = hf_logits(dequantized_reference(quant_hf_dir, ckpt, per_token=True), ids)
    assert (a - ref).abs().max().item() < 1e-2  # as the static engine against its reference
    assert (a - static.forward(static.new_cache(), ids)).abs().max().item() > 1e-3  # the mode is applied
    b = engines["bfloat16"].forward(engines["bfloat16"].new_cache(), ids)
    assert (a - b).abs().max().item() < 0.1 and (a.argmax(-1) == b.argmax(-1)).sum().item() >= 18
    with pytest.raises(BuildError, match="per_token applies to int8_sq"):
        compile_checkpoint(quant_checkpoints["fp8"][1], tmp_path / "bad", ENGINE, 4, per_token=True)


# ---------------------------------------------------------------- exact batch invariance


def _row_by_row(engine, ids, start_ids):
    cache = engine.new_cache()
    engine.forward(cache, start_ids)
    return torch.cat([engine.forward(cache, ids[i : i + 1]) for i in range(len(ids))])


def _in_one_call(engine, ids, start_ids):
    cache = engine.new_cache()
    engine.forward(cache, start_ids)
    return engine.forward(cache, ids)


@pytest.mark.parametrize("kernels", ["bfloat16", "bfloat16-torch", "float32"])  # bf16: native kernels, or torch ops
@pytest.mark.parametrize("qformat", ["full_prec", *sorted(QFORMATS)])
def test_k_plus_one_rows_bit_identical_to_single_rows(quant_checkpoints, qformat, kernels, tmp_path, monkeypatch):
    dtype = kernels.removesuffix("-torch")
    if kernels.endswith("-torch"):
        monkeypatch.setattr(native, "ops", lambda: None)
    engine = build(tmp_path, quant_checkpoints[qformat][1], dtype, max_draft_len=6)
    assert (engine.native is not None) == (kernels == "bfloat16" and native.ops() is not None)
    start = prompt(9, seed=1)
    for k in (1, 3, 6):
        draft = prompt(k + 1, seed=10 + k)
        assert torch.equal(_in_one_call(engine, draft, start), _row_by_row(engine, draft, start)), k


@pytest.mark.skipif(native.ops() is None, reason="the LM head screen runs on the native kernels")
def test_greedy_rows_screen_the_lm_head_and_keep_its_argmax(quant_checkpoints, tmp_path):
    """greedy=True (engine/lm_screen.py): calls of up to max_rows rows (decode steps, short verification passes, small
    batches) go through the screen, whose kept logits are the bf16 head's bits and whose argmax is its argmax; longer
    calls, and batches with one sequence that wants every logit, get the whole head."""
    engine = build(tmp_path, quant_checkpoints["int8_sq"][1], "bfloat16", max_draft_len=6)
    assert engine.screen is not None
    exact, greedy = engine.new_cache(), engine.new_cache()
    start = prompt(9, seed=1)
    assert torch.equal(
        engine.forward(exact, start), engine.forward(greedy, start, greedy=True)
    )  # 9 rows: the whole head
    steps = prompt(20, seed=3)
    narrowed = False
    for i in range(0, 20, 2):  # two one-row calls (decode steps), or one two-row call (a verification pass)
        for rows in (steps[i : i + 1], steps[i + 1 : i + 2]) if i % 4 else (steps[i : i + 2],):
            full, screened = engine.forward(exact, rows), engine.forward(greedy, rows, greedy=True)
            kept = torch.isfinite(screened)
            assert torch.equal(screened[kept], full[kept]) and torch.equal(screened.argmax(-1), full.argmax(-1))
            narrowed |= not kept.all()
    assert narrowed  # the screen did leave tokens out
    consulted = engine.screen.rows
    assert consulted == 20
    more = engine.forward(greedy, prompt(engine.screen.max_rows + 1, seed=4), greedy=True)
    assert torch.isfinite(more).all() and engine.screen.rows == consulted  # longer calls: the whole head
    a, b = engine.new_cache(), engine.new_cache()
    engine.forward_batch([a, b], [start, start], [1, 1])
    mixed = engine.forward_batch([a, b], [steps[:1], steps[1:2]], [1, 1], greedy=[True, False])
    assert all(torch.isfinite(rows).all() for rows in mixed) and engine.screen.rows == consulted
    a.truncate(len(start))
    b.truncate(len(start))
    both = engine.forward_batch([a, b], [steps[:1], steps[1:2]], [1, 1], greedy=[True, True])  # one row each: screened
    assert engine.screen.rows == consulted + 2
    assert [int(rows.argmax()) for rows in both] == [int(rows.argmax()) for rows in mixed]


@pytest.mark.skipif(native.ops() is None, reason="the LM head screen runs on the native kernels")
def test_executor_screens_greedy_requests_only(quant_checkpoints, tmp_path, monkeypatch):
    """A greedy request's tokens are the same with the screen as without it, and it consults the screen; a request
    that returns its logits gets every logit (none -inf) and does not."""
    from specdeploy.engine.executor import Executor
    from specdeploy.engine.request import EngineRequest, run

    engine = build(tmp_path, quant_checkpoints["int8_sq"][1], "bfloat16", max_draft_len=6)
    request = EngineRequest(input_ids=prompt(10, seed=7).tolist(), max_new_tokens=12)
    screened = run(Executor(engine), request)
    assert engine.screen.rows == 12  # the prompt's last row (the only one kept), then 11 decode steps
    with_logits = run(Executor(engine), dataclasses.replace(request, return_logits=True))
    assert engine.screen.rows == 12 and torch.isfinite(with_logits.logits).all()
    assert with_logits.token_ids == screened.token_ids
    screen, engine.screen = engine.screen, None
    assert run(Executor(engine), request).token_ids == screened.token_ids
    assert screen.rows == 12


def test_prompt_longer_than_bucket_is_bit_identical_to_single_rows(quant_checkpoints, tmp_path):
    engine = build(tmp_path, quant_checkpoints["fp8"][1], "bfloat16", max_draft_len=4)
    ids = prompt(2 * engine.spec.row_bucket + 3, seed=2)
    assert torch.equal(_in_one_call(engine, ids, ids[:1]), _row_by_row(engine, ids, ids[:1]))


def test_kv_rollback_then_reforward_equals_fresh_pass(quant_checkpoints, tmp_path):
    engine = build(tmp_path, quant_checkpoints["int8_wo"][1], "bfloat16")
    start, rejected, accepted = prompt(7, seed=3), prompt(4, seed=4), prompt(3, seed=5)
    cache = engine.new_cache()
    engine.forward(cache, start)
    engine.forward(cache, rejected)  # a draft the target refused
    cache.truncate(len(start) + 1)  # keep its first token only
    after = engine.forward(cache, accepted)
    fresh = engine.new_cache()
    engine.forward(fresh, torch.cat([start, rejected[:1]]))
    assert torch.equal(after, engine.forward(fresh, accepted))
    assert cache.length == fresh.length == len(start) + 1 + len(accepted)


# ---------------------------------------------------------------- KV cache quantization


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_kv_cache_quantized_storage(quant_hf_dir, kv_cache_dtype, tmp_path):
    qformat = "fp8" if kv_cache_dtype == "fp8" else "int8_sq"
    model = export_checkpoint(quant_hf_dir, tmp_path / "ckpt", qformat, kv_cache_dtype)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["quantization"]["kv_cache_quant_algo"] == kv_cache_dtype.upper()
    engine = build(tmp_path, tmp_path / "ckpt", "float32")
    cache = engine.new_cache()
    assert cache.keys.dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[kv_cache_dtype]
    ids = prompt(20)
    logits = engine.forward(cache, ids)
    ref = hf_logits(model, ids)
    assert (logits - ref).abs().max().item() < 5e-2
    assert torch.equal(engine.forward(engine.new_cache(), ids[:9]), logits[:9])
    assert torch.equal(_in_one_call(engine, ids[9:14], ids[:9]), _row_by_row(engine, ids[9:14], ids[:9]))


@pytest.mark.parametrize("algo", ["FP8", "INT8"])
def test_kv_cache_round_trip_is_scaled_quantization(algo):
    cache = KVCache(1, 2, 8, 16, torch.float32, algo, torch.tensor([0.05]))
    k = torch.randn(3, 2, 8)
    cache.write(0, 0, k, k)
    cache.length = 3
    keys, _ = cache.read(0, 3)  # [kv_heads, 3, head_size]
    if algo == "FP8":
        expected = (k / 0.05).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 0.05
    else:
        expected = (k / 0.05).round().clamp(-128, 127) * 0.05
    assert torch.equal(keys, expected.transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_an_unquantized_kv_cache_stores_the_compute_dtype_and_reads_it_as_f32_exactly(dtype):
    """k and v reach the cache rounded to the compute dtype; the cache keeps that dtype (half of f32's bytes for bf16,
    which every sequence of a batched decode step reads) and `read` gives f32 holding the same values."""
    cache = KVCache(2, 2, 8, 16, dtype)
    assert cache.keys.dtype == cache.values.dtype == dtype
    assert cache.nbytes() == 2 * 2 * 2 * 16 * 8 * torch.finfo(dtype).bits // 8
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    cache.write(1, 0, k, v)
    cache.length = 3
    keys, values = cache.read(1, 3)
    assert keys.dtype == values.dtype == torch.float32
    assert torch.equal(keys, k.to(dtype).float().transpose(0, 1)) and torch.equal(
        values, v.to(dtype).float().transpose(0, 1)
    )


# ---------------------------------------------------------------- refusals


def _edit_config(ckpt, tmp_path, **changes):
    import shutil

    dest = tmp_path / "edited"
    shutil.copytree(ckpt, dest)
    config = json.loads((dest / "config.json").read_text())
    for key, value in changes.items():
        target = config
        *path, last = key.split("__")
        for part in path:
            target = target[part]
        target[last] = value
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"architecture": "GPTJForCausalLM"}, "architecture"),
        ({"mapping__tp_size": 2, "mapping__world_size": 2}, "one rank"),
        ({"quantization__quant_algo": "NVFP4"}, "quant_algo"),
        ({"quantization__kv_cache_quant_algo": "NVFP4"}, "kv_cache_quant_algo"),
        ({"rotary_scaling": {"type": "yarn", "factor": 4.0}}, "rotary_scaling"),
        ({"rotary_pct": 0.5}, "rotary"),
    ],
)
def test_compile_refuses_what_it_cannot_run(quant_checkpoints, tmp_path, changes, words):
    ckpt = _edit_config(quant_checkpoints["full_prec"][1], tmp_path, **changes)
    with pytest.raises(BuildError, match=words) as info:
        compile_checkpoint(ckpt, tmp_path / "out", ENGINE, None)
    assert info.value.hint


def test_compile_refuses_unknown_tensors(quant_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = _edit_config(quant_checkpoints["int8_wo"][1], tmp_path)
    tensors = load_file(str(ckpt / "rank0.safetensors"))
    tensors["transformer.layers.0.attention.qkv.weights_scaling_factor_2"] = torch.ones(1)
    save_file(tensors, str(ckpt / "rank0.safetensors"))
    with pytest.raises(BuildError, match="weight_scale|weights_scaling_factor_2|unexpected|does not know"):
        compile_checkpoint(ckpt, tmp_path / "out", ENGINE, None)


def test_cache_bounds_are_errors(quant_checkpoints, tmp_path):
    from specdeploy.core.errors import ConfigError

    engine = build(tmp_path, quant_checkpoints["full_prec"][1], "bfloat16")
    with pytest.raises(ConfigError):
        engine.new_cache(engine.spec.max_seq_len + 1)
    cache = engine.new_cache(8)
    with pytest.raises(ConfigError):
        engine.forward(cache, prompt(9))
    with pytest.raises(ConfigError):
        engine.forward(cache, torch.tensor([engine.spec.vocab_size]))


# ---------------------------------------------------------------- the build stage


def _recipe_and_checkpoints(tmp_path, quant_checkpoints, quant_hf_dir, draft_quantization=None):
    import shutil

    from specdeploy.core.artifacts import Layout, Manifest
    from specdeploy.recipe.config import ROLES, to_plain
    from specdeploy.recipe.load import parse_recipe

    recipe = parse_recipe(
        {
            "name": "tiny",
            "target": {"model": str(quant_hf_dir), "quantization": {"qformat": "fp8"}},
            "draft": {"model": str(quant_hf_dir), "quantization": draft_quantization or {"qformat": "int8_wo"}},
            "speculative": {"max_draft_len": 3, "num_draft_tokens": 3},
            "engine": {"max_input_len": 32, "max_seq_len": 64},
            "validation": {"max_tokens": 16},
        }
    )
    layout = Layout.of(recipe, tmp_path)
    for role in ROLES:
        m = recipe.model(role)
        dest = layout.checkpoint(role)
        shutil.copytree(quant_checkpoints[m.quantization.qformat][1], dest)
        Manifest(
            stage="quantize",
            recipe_name=recipe.name,
            fingerprint=f"fp-{role}",
            settings={**to_plain(m), "dtype": "bfloat16", "role": role},
        ).write(dest)
    return recipe, layout


def test_build_recipe_builds_both_engines_once(quant_checkpoints, quant_hf_dir, tmp_path):
    import os
    import shutil

    from specdeploy.core.artifacts import Manifest
    from specdeploy.deploy import backend_stages

    recipe, layout = _recipe_and_checkpoints(tmp_path, quant_checkpoints, quant_hf_dir)
    build = backend_stages.of(recipe).build  # what `specdeploy build` runs for a cpu recipe
    built = build(recipe, layout, echo=lambda *_: None)
    assert built["target"].max_draft_len == 3 and built["draft"].max_draft_len == 0
    assert built["target"].quant_algo == "FP8" and built["draft"].quant_algo == "W8A16"
    manifest = Manifest.read(layout.engine("target"))
    assert manifest.stage == "build" and manifest.inputs["checkpoint_fingerprint"] == "fp-target"
    engine = CpuEngine.load(layout.engine("target"))
    assert engine.spec.max_seq_len == 64 and engine.forward(engine.new_cache(), prompt(4)).shape == (4, 512)
    lines = []
    assert build(recipe, layout, echo=lines.append) == {"target": None, "draft": None}
    assert [line for line in lines if "up to date" in line] == [
        f"{role}: up to date ({layout.engine(role)})" for role in ("target", "draft")
    ]
    # bf16 engines: the kernels are compiled at build time, not at first use. Whether they can be is decided
    # here from the machine itself (not from specdeploy.engine.native): AVX2 and FMA (every variant needs
    # them; AVX-512 machines have both), a C++ compiler, and SPECDEPLOY_NATIVE not set to 0.
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    capable = {"avx2", "fma"} <= set(flags) and os.environ.get("SPECDEPLOY_NATIVE") != "0"
    capable = capable and shutil.which(os.environ.get("CXX", "c++")) is not None
    assert lines[-1] == "native CPU kernels: " + ("ready" if capable else "unavailable, engines use torch ops")


def test_per_token_is_a_build_setting_of_the_same_checkpoint(quant_checkpoints, quant_hf_dir, tmp_path):
    """Switching quantization.per_token rebuilds that engine from the checkpoint it has (no re-quantize: the
    checkpoint is the same), leaves the other engine up to date, and switching back rebuilds the static engine."""
    import dataclasses as dc

    from specdeploy.core.artifacts import Manifest
    from specdeploy.deploy.cpu_build import build_recipe
    from specdeploy.engine.spec import SQ_PER_TOKEN

    recipe, layout = _recipe_and_checkpoints(tmp_path, quant_checkpoints, quant_hf_dir, {"qformat": "int8_sq"})
    quiet = lambda *_: None  # noqa: E731
    assert build_recipe(recipe, layout, echo=quiet)["draft"].quant_algo == "W8A8_SQ_PER_CHANNEL"
    static_fp = Manifest.read(layout.engine("draft")).fingerprint
    q = dc.replace(recipe.draft.quantization, per_token=True)
    per_token = dc.replace(recipe, draft=dc.replace(recipe.draft, quantization=q))
    built = build_recipe(per_token, layout, echo=quiet)
    assert built["target"] is None and built["draft"].quant_algo == SQ_PER_TOKEN
    assert Manifest.read(layout.engine("draft")).fingerprint != static_fp
    assert build_recipe(per_token, layout, echo=quiet) == {"target": None, "draft": None}
    assert build_recipe(recipe, layout, echo=quiet)["draft"].quant_algo == "W8A8_SQ_PER_CHANNEL"


def test_build_refuses_missing_or_stale_checkpoints(quant_checkpoints, quant_hf_dir, tmp_path):
    import shutil

    from specdeploy.core.artifacts import Manifest
    from specdeploy.core.errors import StaleArtifactError
    from specdeploy.deploy.cpu_build import build_recipe

    recipe, layout = _recipe_and_checkpoints(tmp_path, quant_checkpoints, quant_hf_dir)
    manifest = Manifest.read(layout.checkpoint("draft"))
    manifest.settings["quantization"]["qformat"] = "int4_awq"  # quantized for another recipe
    manifest.write(layout.checkpoint("draft"))
    with pytest.raises(StaleArtifactError, match="other settings") as info:
        build_recipe(recipe, layout, echo=lambda *_: None)
    assert "specdeploy quantize" in info.value.hint
    assert not layout.engine("target").exists()  # nothing built before every input was checked
    shutil.rmtree(layout.checkpoint("draft"))
    with pytest.raises(StaleArtifactError, match="no quantize output"):
        build_recipe(recipe, layout, echo=lambda *_: None)


def test_cli_build(quant_checkpoints, quant_hf_dir, tmp_path):
    import yaml
    from click.testing import CliRunner

    from specdeploy.cli.main import main
    from specdeploy.recipe.config import to_plain

    recipe, layout = _recipe_and_checkpoints(tmp_path, quant_checkpoints, quant_hf_dir)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(to_plain(recipe)))
    result = CliRunner().invoke(main, ["--root", str(tmp_path), "build", str(path)])
    assert result.exit_code == 0, result.output
    assert (layout.engine("target") / "model.safetensors").is_file()
    assert (layout.engine("draft") / "manifest.json").is_file()


def test_engine_file_reader_matches_safetensors(tmp_path):
    from safetensors.torch import load_file, save_file

    from specdeploy.engine.model import LazyTensors

    g = torch.Generator().manual_seed(7)
    tensors = {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "fp8": torch.randn(4, 16, generator=g).to(torch.float8_e4m3fn),
        "int8": torch.randint(-128, 128, (7,), generator=g, dtype=torch.int8),
        "scalar": torch.tensor(0.25),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    expected = load_file(str(path))
    with LazyTensors(path) as lazy:
        assert set(lazy) == set(expected) and "bf16" in lazy and "missing" not in lazy
        for name, tensor in expected.items():
            assert lazy[name].dtype == tensor.dtype and torch.equal(lazy[name], tensor), name
    path.write_bytes(path.read_bytes()[:-8])  # cut into the last tensor's data
    with LazyTensors(path) as lazy, pytest.raises(BuildError, match="truncated"):
        [lazy[name] for name in lazy]


def test_quantized_kv_cache_dequantizes_once_per_chunk(quant_hf_dir, tmp_path, monkeypatch):
    """A prefill over a quantized KV cache reads (dequantizes) each layer's prefix once per chunk, not once per
    query row (which made prefill quadratic in Python), with the bits of row-by-row decoding."""
    export_checkpoint(quant_hf_dir, tmp_path / "ckpt", "fp8", "fp8")
    engine = build(tmp_path, tmp_path / "ckpt", "float32")
    ids = prompt(24, seed=6)
    reads = []
    original = KVCache.read
    monkeypatch.setattr(KVCache, "read", lambda self, layer, end: reads.append(end) or original(self, layer, end))
    cache = engine.new_cache()
    logits = engine.forward(cache, ids)
    assert len(reads) == engine.spec.num_layers * -(-len(ids) // engine.chunk_rows)
    monkeypatch.setattr(KVCache, "read", original)
    assert torch.equal(logits[1:], _row_by_row(engine, ids[1:], ids[:1]))
