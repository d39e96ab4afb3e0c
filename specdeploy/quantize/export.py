"""Writing the quantized model out with ModelOpt's exporters: a TensorRT-LLM checkpoint (`config.json` +
`rank{N}.safetensors`, with the config fixes TensorRT-LLM's quantize.py applies after the export) or a Hugging Face
checkpoint for the LLM API; and the quieting of ModelOpt's prints and known-harmless warnings.
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from pathlib import Path

from specdeploy.core.errors import QuantizeError
from specdeploy.quantize.formats import KV_CACHE_QUANT_ALGO, QUANT_ALGO
from specdeploy.recipe.config import QuantConfig


def export_dtype(engine_dtype: str) -> str:
    """Checkpoint dtype for unquantized tensors: TensorRT-LLM checkpoints are float16 or bfloat16."""
    return engine_dtype if engine_dtype in ("float16", "bfloat16") else "bfloat16"


@contextlib.contextmanager
def quiet():
    """Silence ModelOpt's prints and its known-harmless warnings (no tensorrt_llm installed, untested transformers)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tensorrt_llm.*")
        warnings.filterwarnings("ignore", message=".*not tested with current version of modelopt.*")
        warnings.filterwarnings("ignore", message=".*Large KV activation.*")
        warnings.filterwarnings("ignore", message=".*lm_head quantization may lead.*")  # lm_head stays unquantized
        warnings.filterwarnings("ignore", message=".*is not calibrated, skip smoothing.*")
        with contextlib.redirect_stdout(io.StringIO()):
            yield


def export_trtllm(
    model,
    decoder: str,
    out_dir: Path,
    dtype: str,
    tp_size: int,
    pp_size: int,
    hf: dict,
    source_dir: Path,
    quant: QuantConfig,
) -> None:
    """A TensorRT-LLM checkpoint of `model` split into tp_size * pp_size ranks, with its config.json finished."""
    import torch
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    try:
        with quiet(), torch.inference_mode():
            export_tensorrt_llm_checkpoint(
                model,
                decoder_type=decoder,
                dtype=getattr(torch, dtype),
                export_dir=out_dir,
                inference_tensor_parallel=tp_size,
                inference_pipeline_parallel=pp_size,
            )
    except (AssertionError, ValueError, NotImplementedError) as exc:
        raise QuantizeError(
            f"ModelOpt could not export {source_dir} as {quant.qformat}: {exc}", "try another qformat"
        ) from exc
    _finish_config(out_dir, hf, quant, decoder)


def export_hf(model, tokenizer, out_dir: Path, dtype: str, source_dir: Path, quant: QuantConfig) -> None:
    """ModelOpt's Hugging Face export (safetensors + hf_quant_config.json) and the tokenizer, unsplit."""
    import torch
    from modelopt.torch.export import export_hf_checkpoint

    try:
        with quiet(), torch.inference_mode():
            export_hf_checkpoint(model, dtype=getattr(torch, dtype), export_dir=out_dir)
    except (AssertionError, ValueError, NotImplementedError) as exc:
        raise QuantizeError(
            f"ModelOpt could not export {source_dir} as {quant.qformat}: {exc}", "try another qformat"
        ) from exc
    tokenizer.save_pretrained(str(out_dir))


def _finish_config(out_dir: Path, hf: dict, quant: QuantConfig, decoder: str) -> None:
    """The config.json fixes TensorRT-LLM's quantize.py applies after the ModelOpt export (without tensorrt_llm
    installed ModelOpt writes the config by hand and misses the RoPE base of transformers-5 configs)."""
    path = out_dir / "config.json"
    config = json.loads(path.read_text())
    rope = hf.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    config["rotary_base"] = float(rope_theta)
    rope_type = rope.get("rope_type") or (hf.get("rope_scaling") or {}).get("rope_type", "default")
    config["rotary_scaling"] = None if rope_type == "default" else {**(hf.get("rope_scaling") or {}), **rope}
    config["model_type"] = decoder
    config["quantization"]["quant_algo"] = QUANT_ALGO[quant.qformat]
    config["quantization"]["kv_cache_quant_algo"] = KV_CACHE_QUANT_ALGO[quant.kv_cache_dtype]
    config["quantization"].setdefault("exclude_modules", [])
    if decoder == "qwen":
        config["qwen_type"] = hf["model_type"]
        config["norm_epsilon"] = hf["rms_norm_eps"]
        config["intermediate_size"] = hf["intermediate_size"]
    path.write_text(json.dumps(config, indent=4) + "\n")
