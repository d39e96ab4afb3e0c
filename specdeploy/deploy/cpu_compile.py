"""Compile a TensorRT-LLM checkpoint (config.json + rank0.safetensors) into a CPU engine directory.

Checkpoint layout read here, as written by ModelOpt's `export_tensorrt_llm_checkpoint` (verified on
modelopt 0.47 for full_prec, fp8, int8_sq, int8_wo, int4_awq and fp8/int8 KV caches):

    transformer.vocab_embedding.weight      transformer.ln_f.weight      lm_head.weight
    transformer.layers.N.input_layernorm.weight / post_layernorm.weight
    transformer.layers.N.attention.qkv.*     fused [q; k; v] rows (+ .bias for Qwen2)
    transformer.layers.N.attention.dense.*   output projection
    transformer.layers.N.mlp.fc.*            HF gate_proj (the SiLU branch)
    transformer.layers.N.mlp.gate.*          HF up_proj
    transformer.layers.N.mlp.proj.*          HF down_proj
    transformer.layers.N.attention.kv_cache_scaling_factor
    each linear: .weight, .weights_scaling_factor, .activation_scaling_factor, .prequant_scaling_factor

The engine directory holds `config.json` (EngineSpec) and `model.safetensors` in the runtime layout of
kernels.py (fused gate/up, int4 repacked, per-channel scales). Anything the runtime cannot execute with
the checkpoint's own numerics is refused with a BuildError.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from specdeploy.core.errors import BuildError
from specdeploy.engine.kernels import pack_int4
from specdeploy.engine.spec import (
    ARCHITECTURES,
    DTYPES,
    ENGINE_WEIGHTS,
    KV_CACHE_QUANT_ALGOS,
    QUANT_ALGOS,
    ROPE_SCALING_TYPES,
    SQ_PER_TOKEN,
    UNPADDED_CHUNK,
    EngineSpec,
)
from specdeploy.recipe.config import EngineConfig

CHECKPOINT_CONFIG = "config.json"
CHECKPOINT_WEIGHTS = "rank0.safetensors"

LINEARS = {"attention.qkv": "qkv", "attention.dense": "o", "mlp.fc": "gate", "mlp.gate": "up", "mlp.proj": "down"}
SUFFIXES = {
    "weight": "weight",
    "bias": "bias",
    "weights_scaling_factor": "weight_scale",
    "activation_scaling_factor": "act_scale",
    "prequant_scaling_factor": "pre_quant_scale",
}
# Tensors each quant algo must provide per linear (besides weight and an optional bias).
REQUIRED = {
    None: (),
    "FP8": ("weight_scale", "act_scale"),
    "W8A16": ("weight_scale",),
    "W4A16_AWQ": ("weight_scale", "pre_quant_scale"),
    "W8A8_SQ_PER_CHANNEL": ("weight_scale", "act_scale", "pre_quant_scale"),
    SQ_PER_TOKEN: ("weight_scale", "pre_quant_scale"),
}
# Tensors a checkpoint may hold that the engine does not use: per token, the activation scale is each row's own, so
# the static act_scale ModelOpt calibrated is read and dropped.
UNUSED = {SQ_PER_TOKEN: ("act_scale",)}
WEIGHT_DTYPES = {
    None: (torch.float32, torch.bfloat16, torch.float16),
    "FP8": (torch.float8_e4m3fn,),
    "W8A16": (torch.int8,),
    "W4A16_AWQ": (torch.int8, torch.uint8),
    "W8A8_SQ_PER_CHANNEL": (torch.int8,),
    SQ_PER_TOKEN: (torch.int8,),
}


def row_bucket_for(max_draft_len: int | None, dtype: str) -> int:
    """Rows every GEMM of a target runs on: one verification pass (max_draft_len + 1), no more, since padding
    costs time (docs/stages.md "2. build"). fp32/fp16 GEMMs (MKL) handle a remainder of
    rows with other micro-kernels, so a row's result depends on its place in the block: there the bucket is
    a multiple of 8, where every row position computes alike (tests/test_engine.py checks both bit for bit).
    A draft is not padded: it decodes one row at a time and prefills in chunks of UNPADDED_CHUNK rows."""
    if not max_draft_len:
        return UNPADDED_CHUNK
    rows = max_draft_len + 1
    return rows if dtype == "bfloat16" else -(-rows // 8) * 8


def compile_checkpoint(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    engine_cfg: EngineConfig,
    max_draft_len: int | None,
    per_token: bool = False,
) -> EngineSpec:
    """Read the TensorRT-LLM checkpoint in ckpt_dir and write a CPU engine into out_dir.

    `max_draft_len` is set on a target (the longest draft it verifies in one pass), None on a draft.
    `per_token` (an int8_sq checkpoint only) makes the engine quantize activations per token (SQ_PER_TOKEN).
    Raises BuildError for what the CPU runtime cannot run faithfully (architecture, quant algo, TP/PP > 1).
    """
    from safetensors.torch import load_file, save_file

    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    config = read_checkpoint_config(ckpt_dir)
    spec = make_spec(config, engine_cfg, max_draft_len, ckpt_dir, per_token)
    weights = ckpt_dir / CHECKPOINT_WEIGHTS
    if not weights.is_file():
        raise BuildError(f"{ckpt_dir} has no {CHECKPOINT_WEIGHTS}", "re-run: specdeploy quantize RECIPE")
    tensors, facts = convert_weights(load_file(str(weights)), spec)
    spec = dataclasses.replace(spec, **facts)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / ENGINE_WEIGHTS))
    spec.write(out_dir)
    return spec


# ---------------------------------------------------------------- config


def read_checkpoint_config(ckpt_dir: Path) -> dict:
    path = Path(ckpt_dir) / CHECKPOINT_CONFIG
    if not path.is_file():
        raise BuildError(
            f"{ckpt_dir} is not a TensorRT-LLM checkpoint (no {CHECKPOINT_CONFIG})", "run: specdeploy quantize RECIPE"
        )
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise BuildError(f"{path} is not valid JSON: {exc}", "re-run: specdeploy quantize RECIPE --force") from exc


def make_spec(
    config: dict,
    engine_cfg: EngineConfig,
    max_draft_len: int | None,
    ckpt_dir: Path | None = None,
    per_token: bool = False,
) -> EngineSpec:
    """Check the checkpoint config against what the runtime executes and derive the engine spec."""
    where = f"checkpoint {ckpt_dir}" if ckpt_dir else "checkpoint"
    arch = config.get("architecture")
    if arch not in ARCHITECTURES:
        raise BuildError(
            f"{where}: architecture {arch!r} is not supported by the cpu backend",
            f"supported: {', '.join(ARCHITECTURES)}; use a GPU backend (trtllm-engine) for other models",
        )
    mapping = config.get("mapping") or {}
    ranks = {k: int(mapping.get(k, 1)) for k in ("world_size", "tp_size", "pp_size")}
    if any(v != 1 for v in ranks.values()) or (ckpt_dir and (Path(ckpt_dir) / "rank1.safetensors").exists()):
        raise BuildError(
            f"{where}: is sharded ({ranks}); the cpu engine runs one rank",
            "quantize with tp_size: 1 and pp_size: 1 for backend cpu",
        )
    quant = config.get("quantization") or {}
    quant_algo, kv_algo = _check_quantization(quant, where, per_token)
    scaling = config.get("rotary_scaling")
    _check_model(config, engine_cfg, where)
    if engine_cfg.dtype not in DTYPES:
        raise BuildError(
            f"engine dtype {engine_cfg.dtype!r} is not supported on cpu", f"use one of {', '.join(DTYPES)}"
        )

    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    extra = {"producer": config.get("producer"), "checkpoint": str(ckpt_dir) if ckpt_dir else None}
    return EngineSpec(
        architecture=arch,
        dtype=engine_cfg.dtype,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_size=int(config.get("head_size") or hidden // heads),
        intermediate_size=int(config["intermediate_size"]),
        norm_epsilon=float(config.get("norm_epsilon", 1e-6)),
        rotary_base=float(config.get("rotary_base", 10000.0)),  # TensorRT-LLM's default when absent
        rotary_scaling=scaling or None,
        max_position_embeddings=int(config.get("max_position_embeddings", engine_cfg.max_seq_len)),
        max_batch_size=engine_cfg.max_batch_size,
        max_input_len=engine_cfg.max_input_len,
        max_seq_len=engine_cfg.max_seq_len,
        max_draft_len=int(max_draft_len or 0),
        row_bucket=row_bucket_for(max_draft_len, engine_cfg.dtype),
        batch_invariant=bool(max_draft_len),
        quant_algo=quant_algo,
        kv_cache_quant_algo=kv_algo,
        group_size=int(quant["group_size"]) if quant_algo == "W4A16_AWQ" else None,
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=config.get("eos_token_id"),
        extra=extra,
    )


def _check_quantization(quant: dict, where: str, per_token: bool) -> tuple[str | None, str | None]:
    """The checkpoint's quantization as the engine runs it: (quant_algo, kv_cache_quant_algo), or BuildError."""
    quant_algo, kv_algo = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    if quant_algo not in QUANT_ALGOS:
        raise BuildError(
            f"{where}: quant_algo {quant_algo!r} has no faithful CPU implementation",
            "cpu qformats: full_prec, fp8, int8_sq, int8_wo, int4_awq (quant_algo "
            + ", ".join(str(a) for a in QUANT_ALGOS)
            + ")",
        )
    if per_token:
        if quant_algo != "W8A8_SQ_PER_CHANNEL":
            raise BuildError(
                f"{where}: quantization.per_token applies to int8_sq checkpoints, this one is {quant_algo}",
                "set per_token: false, or qformat: int8_sq and re-run: specdeploy quantize RECIPE",
            )
        quant_algo = SQ_PER_TOKEN
    if kv_algo not in KV_CACHE_QUANT_ALGOS:
        raise BuildError(
            f"{where}: kv_cache_quant_algo {kv_algo!r} is not supported", "use kv_cache_dtype fp8, int8 or null"
        )
    if quant.get("has_zero_point"):
        raise BuildError(
            f"{where}: asymmetric (zero-point) INT4 is not supported", "quantize with qformat int4_awq (symmetric)"
        )
    exclude = quant.get("exclude_modules") or []
    if quant_algo is not None and "lm_head" not in exclude and not any("lm_head" in e for e in exclude):
        raise BuildError(
            f"{where}: a quantized lm_head is not supported", "keep lm_head in exclude_modules (ModelOpt's default)"
        )
    if quant_algo == "W4A16_AWQ" and not quant.get("group_size"):
        raise BuildError(
            f"{where}: W4A16_AWQ without quantization.group_size", "re-run: specdeploy quantize RECIPE --force"
        )
    return quant_algo, kv_algo


def _check_model(config: dict, engine_cfg: EngineConfig, where: str) -> None:
    """The architecture facts the CPU runtime executes faithfully (position embedding, activation, norm, RoPE
    scaling, attention window), or BuildError."""
    checks = [
        (
            config.get("position_embedding_type", "rope_gpt_neox") == "rope_gpt_neox",
            "position_embedding_type must be rope_gpt_neox",
        ),
        (float(config.get("rotary_pct", 1.0)) == 1.0, "partial rotary (rotary_pct < 1) is not supported"),
        (
            config.get("hidden_act", "silu") in ("silu", "swiglu"),
            f"hidden_act {config.get('hidden_act')!r} is not silu",
        ),
        (config.get("rmsnorm", True), "only RMSNorm models are supported"),
        (not config.get("residual_mlp", False), "residual_mlp is not supported"),
        (
            config.get("moe") is None or not (config.get("moe") or {}).get("num_experts"),
            "mixture-of-experts is not supported",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise BuildError(f"{where}: {message}", "use a Llama/Mistral/Qwen2-style model or a GPU backend")
    scaling = config.get("rotary_scaling")
    from specdeploy.engine.model import rope_scaling_type

    kind = rope_scaling_type(scaling)
    if kind is not None and kind not in ROPE_SCALING_TYPES:
        raise BuildError(
            f"{where}: rotary_scaling type {kind!r} is not supported", f"supported: {', '.join(ROPE_SCALING_TYPES)}"
        )
    window = config.get("sliding_window") or config.get("max_attention_window")
    if isinstance(window, list):
        window = min(window) if window else None
    if window and engine_cfg.max_seq_len > int(window):
        raise BuildError(
            f"{where}: sliding-window attention ({window}) shorter than engine.max_seq_len ({engine_cfg.max_seq_len})",
            f"set engine.max_seq_len <= {window} (full attention is then exact)",
        )


# ---------------------------------------------------------------- weights


def convert_weights(ckpt: dict, spec: EngineSpec) -> tuple[dict, dict]:
    """Checkpoint tensors -> (engine tensors in runtime names and layout, facts for the spec).

    Refuses tensors it does not know how to apply."""
    dtype = getattr(torch, spec.dtype)
    used: set[str] = set()

    def take(name: str, required: bool = True):
        if name not in ckpt:
            if required:
                raise BuildError(f"checkpoint lacks tensor {name}", "re-run: specdeploy quantize RECIPE --force")
            return None
        used.add(name)
        return ckpt[name]

    out = {}
    embedding = take("transformer.vocab_embedding.weight")
    out["embedding.weight"] = embedding.to(dtype)
    lm_head = take("lm_head.weight", required=False)
    tied = lm_head is None or (lm_head.shape == embedding.shape and torch.equal(lm_head, embedding))
    if not tied:
        out["lm_head.weight"] = lm_head.to(dtype)
    out["final_norm.weight"] = take("transformer.ln_f.weight").to(dtype)
    attention_bias = False
    for i in range(spec.num_layers):
        src, dst = f"transformer.layers.{i}.", f"layers.{i}."
        out[dst + "input_norm.weight"] = take(src + "input_layernorm.weight").to(dtype)
        out[dst + "post_norm.weight"] = take(src + "post_layernorm.weight").to(dtype)
        linears = {}
        for ckpt_name, name in LINEARS.items():
            prefix = src + ckpt_name + "."
            t = {
                SUFFIXES[k[len(prefix) :]]: take(k)
                for k in list(ckpt)
                if k.startswith(prefix) and k[len(prefix) :] in SUFFIXES
            }
            linears[name] = convert_linear(t, spec, f"{src}{ckpt_name}", dtype)
        attention_bias = attention_bias or "bias" in linears["qkv"]
        gate_up = fuse(linears["gate"], linears["up"])
        if gate_up is not None:  # else the halves quantize their shared input differently: two GEMMs
            del linears["gate"], linears["up"]
            linears["gate_up"] = gate_up
        for name, t in linears.items():
            for suffix, value in t.items():
                out[f"{dst}{name}.{suffix}"] = value
        kv_scale = kv_cache_scale(take, src + "attention.")
        if spec.kv_cache_quant_algo is not None:
            if kv_scale is None:
                raise BuildError(
                    f"checkpoint lacks {src}attention.kv_cache_scaling_factor",
                    "re-run: specdeploy quantize RECIPE --force",
                )
            out[dst + "kv_scale"] = kv_scale
    unknown = sorted(set(ckpt) - used)
    if unknown:
        raise BuildError(
            f"checkpoint has tensors the cpu runtime does not know how to apply: {', '.join(unknown[:5])}"
            + (f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else ""),
            "this quantization variant is not supported by the cpu backend; use full_prec, fp8, int8_sq, int8_wo or"
            " int4_awq",
        )
    facts = {"tie_word_embeddings": tied, "attention_bias": attention_bias}
    return {k: v.contiguous() for k, v in out.items()}, facts


def kv_cache_scale(take, prefix: str):
    """One KV scale per layer, as TensorRT-LLM uses: kv_cache_scaling_factor, or max(k, v) when ModelOpt wrote
    only the separate k_/v_cache_scaling_factor (it derives the shared one the same way)."""
    shared = take(prefix + "kv_cache_scaling_factor", required=False)
    k, v = (
        take(prefix + "k_cache_scaling_factor", required=False),
        take(prefix + "v_cache_scaling_factor", required=False),
    )
    if shared is None and k is not None and v is not None:
        shared = torch.maximum(k.float(), v.float())
    return None if shared is None else shared.float().reshape(())


def convert_linear(t: dict, spec: EngineSpec, name: str, dtype) -> dict:
    """One checkpoint linear -> engine tensors (see kernels.py for the layout)."""
    algo = spec.quant_algo
    if "weight" not in t:
        raise BuildError(f"checkpoint lacks tensor {name}.weight", "re-run: specdeploy quantize RECIPE --force")
    allowed = {"weight", "bias", *REQUIRED[algo], *UNUSED.get(algo, ())}
    missing = [k for k in REQUIRED[algo] if k not in t]
    surplus = sorted(set(t) - allowed)
    if missing or surplus:
        problem = f"lacks {', '.join(missing)}" if missing else f"has unexpected {', '.join(surplus)}"
        raise BuildError(
            f"checkpoint linear {name} {problem} for quant_algo {algo}",
            "the checkpoint does not match its config.json; re-run: specdeploy quantize RECIPE --force",
        )
    w = t["weight"]
    if w.dtype not in WEIGHT_DTYPES[algo]:
        raise BuildError(
            f"checkpoint linear {name}.weight is {w.dtype}, not a {algo} weight",
            "re-run: specdeploy quantize RECIPE --force",
        )
    out = {}
    if algo is None:
        out["weight"] = w.to(dtype)
    elif algo == "W4A16_AWQ":
        out["weight"] = repack_modelopt_int4(w)
        scale = t["weight_scale"].float()  # [N, K / group]
        n, k = out["weight"].shape[0], out["weight"].shape[1] * 2
        if spec.group_size is None or k % spec.group_size or tuple(scale.shape) != (n, k // spec.group_size):
            raise BuildError(
                f"checkpoint linear {name}: AWQ scales {tuple(scale.shape)} do not fit [{n}, {k}] / group"
                f" {spec.group_size}"
            )
        out["weight_scale"] = scale
    else:
        out["weight"] = w
        scale = t["weight_scale"].float().reshape(-1)
        if scale.numel() == 1:  # per-tensor (FP8): expanded per channel so halves can be fused
            scale = scale.expand(w.shape[0]).clone()
        if scale.numel() != w.shape[0]:
            raise BuildError(f"checkpoint linear {name}: {scale.numel()} weight scales for {w.shape[0]} channels")
        out["weight_scale"] = scale
    if "act_scale" in t and "act_scale" not in UNUSED.get(algo, ()):
        out["act_scale"] = t["act_scale"].float().reshape(())
    if "pre_quant_scale" in t:
        out["pre_quant_scale"] = t["pre_quant_scale"].to(dtype)
    if "bias" in t:
        out["bias"] = t["bias"].to(dtype)
    return out


def fuse(gate: dict, up: dict) -> dict | None:
    """[gate; up] as one linear when both see the same quantized input (equal activation/pre-quant scales)."""
    for key in ("act_scale", "pre_quant_scale"):
        a, b = gate.get(key), up.get(key)
        if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
            return None
    if set(gate) != set(up):
        return None
    fused = {}
    for key, value in gate.items():
        fused[key] = value if key in ("act_scale", "pre_quant_scale") else torch.cat([value, up[key]], dim=0)
    return fused


def repack_modelopt_int4(packed: torch.Tensor) -> torch.Tensor:
    """ModelOpt int4 [N/2, K] (two output rows per byte, low nibble = even row, signed) -> kernels.py [N, K/2].

    Engine layout: unsigned u = q + 8 in 0..15, two input columns per byte, low nibble = even column.
    """
    b = packed.view(torch.uint8).to(torch.int16)  # [N/2, K]
    low, high = b & 0x0F, (b >> 4) & 0x0F
    low = torch.where(low >= 8, low - 16, low)  # sign-extend the 4-bit values
    high = torch.where(high >= 8, high - 16, high)
    q = torch.stack([low, high], dim=1).reshape(-1, b.shape[1])  # [N, K]: rows 2j (low), 2j+1 (high)
    return pack_int4((q + 8).to(torch.uint8))
