"""What the quantize stage accepts: TensorRT-LLM's `--qformat` / `--kv_cache_dtype` words and what each maps to
(the ModelOpt config, the checkpoint's quant_algo, bytes per weight), and the input checks run before any model is
loaded (format combinations TensorRT-LLM rejects, the model's architecture and shapes, disk space).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from specdeploy.core.errors import ConfigError, ModelError, QuantizeError
from specdeploy.recipe.config import AWQ_BLOCK_SIZES, KV_CACHE_DTYPES, QFORMATS, QuantConfig

# --qformat -> name of the ModelOpt config (None: export without quantizing, as TensorRT-LLM does).
MODELOPT_CFG = {
    "full_prec": None,
    "fp8": "FP8_DEFAULT_CFG",
    "int8_sq": "INT8_SMOOTHQUANT_CFG",
    "int8_wo": "INT8_WEIGHT_ONLY_CFG",
    "int4_awq": "INT4_AWQ_CFG",
}
# What each format writes into config.json (quantization.quant_algo), as TensorRT-LLM's QuantAlgo names it.
QUANT_ALGO = {
    "full_prec": None,
    "fp8": "FP8",
    "int8_sq": "W8A8_SQ_PER_CHANNEL",
    "int8_wo": "W8A16",
    "int4_awq": "W4A16_AWQ",
}
KV_CACHE_QUANT_ALGO = {None: None, "fp8": "FP8", "int8": "INT8"}
# KV cache quantizers: ModelOpt's FP8_KV_CFG pattern; INT8 uses the same quantizers with 8 integer
# bits (TensorRT-LLM's KV_CACHE_CFG in quantize_by_modelopt.py: num_bits 8, axis None).
KV_NUM_BITS = {"fp8": (4, 3), "int8": 8}
# Bytes per stored weight element, for the disk-space estimate (unquantized tensors are 16-bit).
WEIGHT_BYTES = {"full_prec": 2.0, "fp8": 1.0, "int8_sq": 1.0, "int8_wo": 1.0, "int4_awq": 0.5}
# TensorRT-LLM's quantize.py calibrates AWQ with at most 32 samples ("AWQ calibration could take longer").
AWQ_MAX_CALIB_SIZE = 32
# Formats whose scales come from the weights alone (ModelOpt "max" calibration of weight quantizers only).
WEIGHT_ONLY_MAX_CALIBRATION = ("int8_wo",)
# Weight-only GEMM kernels need the per-rank input dimension divisible by 64 (TensorRT-LLM issue #729).
WEIGHT_ONLY_K_MULTIPLE = 64

# Hugging Face `model_type` -> ModelOpt / TensorRT-LLM decoder type. Only decoder families whose
# TensorRT-LLM checkpoint specdeploy's engines understand (Llama-style: RMSNorm, RoPE, gated SiLU MLP).
SUPPORTED_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen"}

# Combinations that TensorRT-LLM refuses when building an engine with paged context FMHA, which the
# draft/target flow needs for KV-cache block reuse (tensorrt_llm/builder.py `build`, and the same checks
# in the C++ attention op). Messages quoted from TensorRT-LLM.
PAGED_CONTEXT_FMHA_REJECTS = {
    "int8": "Paged Context FMHA doesn't work with int8 kv cache currently.",
    "fp8": "FP8 Paged Context FMHA only works with fp8 quantization workflow currently.",
}


def check_quant_config(quant: QuantConfig, paged_context_fmha: bool = True) -> None:
    """Refuse formats and combinations TensorRT-LLM cannot build; each error names the fix."""
    if quant.qformat not in MODELOPT_CFG:
        raise ConfigError(f"unknown qformat {quant.qformat!r}", f"valid choices: {', '.join(QFORMATS)}")
    if quant.kv_cache_dtype not in KV_CACHE_DTYPES:
        shown = ", ".join("null" if k is None else k for k in KV_CACHE_DTYPES)
        raise ConfigError(f"unknown kv_cache_dtype {quant.kv_cache_dtype!r}", f"valid choices: {shown}")
    if quant.qformat == "int4_awq" and quant.awq_block_size not in AWQ_BLOCK_SIZES:
        raise ConfigError(
            f"awq_block_size {quant.awq_block_size} is not supported",
            f"use one of {', '.join(map(str, AWQ_BLOCK_SIZES))}",
        )
    if paged_context_fmha and quant.kv_cache_dtype == "int8":
        raise ConfigError(
            f"qformat {quant.qformat!r} with kv_cache_dtype 'int8': TensorRT-LLM refuses it: "
            f'"{PAGED_CONTEXT_FMHA_REJECTS["int8"]}" (the draft/target engines need paged context FMHA)',
            "set kv_cache_dtype: null, or kv_cache_dtype: fp8 together with qformat: fp8",
        )
    if paged_context_fmha and quant.kv_cache_dtype == "fp8" and quant.qformat != "fp8":
        raise ConfigError(
            f"qformat {quant.qformat!r} with kv_cache_dtype 'fp8': TensorRT-LLM refuses it: "
            f'"{PAGED_CONTEXT_FMHA_REJECTS["fp8"]}" (the draft/target engines need paged context FMHA)',
            "use kv_cache_dtype: fp8 only with qformat: fp8, or set kv_cache_dtype: null",
        )


def read_hf_config(source_dir: Path) -> dict:
    source_dir = Path(source_dir)
    if not source_dir.is_dir():
        raise ModelError(f"model directory {source_dir} does not exist", "pass a Hugging Face model folder")
    path = source_dir / "config.json"
    if not path.is_file():
        raise ModelError(f"model directory {source_dir} has no config.json", "point at a Hugging Face model folder")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {path}: {exc}", "re-download or re-save the model") from exc


def weight_files(source_dir: Path) -> list[Path]:
    return sorted(Path(source_dir).glob("*.safetensors")) + sorted(Path(source_dir).glob("pytorch_model*.bin"))


def check_model(source_dir: Path, quant: QuantConfig, tp_size: int, pp_size: int) -> dict:
    """Check the source folder and its shapes against the format and parallelism; return its HF config."""
    hf = read_hf_config(source_dir)
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise QuantizeError(
            f"model type {model_type!r} ({', '.join(hf.get('architectures') or ['?'])}) in {source_dir} "
            "is not supported by the quantize stage",
            f"use a model of type {', '.join(SUPPORTED_MODEL_TYPES)} (Llama, Mistral, Qwen2 families)",
        )
    if not weight_files(source_dir):  # same words as specdeploy.core.model_store.resolve
        raise ModelError(
            f"model directory {source_dir} has no weights (*.safetensors or pytorch_model*.bin)",
            "download or save the model's weights into that folder (e.g. model.save_pretrained(dir))",
        )
    if tp_size < 1 or pp_size < 1:
        raise ConfigError(f"tp_size {tp_size} and pp_size {pp_size} must be >= 1")
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    if heads % tp_size or (kv_heads % tp_size and tp_size % kv_heads):
        raise ConfigError(
            f"tp_size {tp_size} does not divide the model's {heads} attention / {kv_heads} KV heads",
            "choose a tp_size that divides the number of attention heads",
        )
    if hf["num_hidden_layers"] < pp_size:
        raise ConfigError(f"pp_size {pp_size} exceeds the model's {hf['num_hidden_layers']} layers")
    hidden, inter = hf["hidden_size"], hf["intermediate_size"]
    head_dim = hf.get("head_dim") or hidden // heads
    # Input dimension (K) of each linear on one tensor-parallel rank: column-parallel layers (qkv, fc,
    # gate) see the full hidden size; row-parallel ones (dense, proj) a 1/tp slice.
    k_dims = {"qkv/fc/gate": hidden, "dense": heads * head_dim // tp_size, "proj": inter // tp_size}
    multiple = {"int4_awq": quant.awq_block_size, "int8_wo": WEIGHT_ONLY_K_MULTIPLE}.get(quant.qformat)
    if multiple:
        bad = {name: k for name, k in k_dims.items() if k % multiple}
        if bad:
            what = f"awq_block_size {multiple}" if quant.qformat == "int4_awq" else f"{multiple} (weight-only kernels)"
            fix = "set awq_block_size: 64" if quant.qformat == "int4_awq" and multiple == 128 else "use another qformat"
            raise ConfigError(
                f"qformat {quant.qformat!r}: input dimensions per rank {bad} are not multiples of {what}",
                f"{fix}, or a smaller tp_size",
            )
    return hf


def estimate_output_bytes(source_dir: Path, quant: QuantConfig) -> int:
    """Upper estimate of the checkpoint size: every weight at the format's width, 16-bit at most, plus 5%."""
    from safetensors import safe_open

    numel = 0
    for path in weight_files(source_dir):
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as fh:
                for name in fh.keys():
                    numel += math.prod(fh.get_slice(name).get_shape())
        else:
            numel += path.stat().st_size // 4  # a .bin of fp32 weights: 4 bytes per element at most
    return int(numel * max(WEIGHT_BYTES[quant.qformat], 2.0) * 1.05) + (1 << 20)


def check_disk_space(out_dir: Path, needed: int) -> None:
    probe = Path(out_dir).absolute()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise QuantizeError(
            f"not enough disk space for the checkpoint in {out_dir}: about {needed / 2**20:.0f} MiB needed, "
            f"{free / 2**20:.0f} MiB free",
            "free some space on that disk or pass --root on a bigger one",
        )


def needs_calibration(quant: QuantConfig) -> bool:
    return MODELOPT_CFG[quant.qformat] is not None or quant.kv_cache_dtype is not None
