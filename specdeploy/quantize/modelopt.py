"""One model through NVIDIA ModelOpt on the CPU (or the GPUs when there are some): load the Hugging Face model,
calibrate it with `mtq.quantize`, measure its quality against the source, and export the checkpoint. The same steps
TensorRT-LLM's `examples/quantization/quantize.py` takes (quantize_by_modelopt.py).
"""

from __future__ import annotations

import contextlib
import copy
import random
import time
from pathlib import Path

from specdeploy.core.errors import QuantizeError
from specdeploy.quantize.calibration_text import BUILTIN, calibration_samples, heldout_rows, read_passages
from specdeploy.quantize.export import export_hf, export_trtllm, quiet
from specdeploy.quantize.formats import (
    KV_NUM_BITS,
    MODELOPT_CFG,
    SUPPORTED_MODEL_TYPES,
    check_disk_space,
    check_model,
    check_quant_config,
    estimate_output_bytes,
)
from specdeploy.quantize.quality import QualityReport, evaluate_quality
from specdeploy.recipe.config import QuantConfig


def modelopt_config(quant: QuantConfig) -> dict | None:
    """The ModelOpt quantization config for a QuantConfig (None: nothing to calibrate)."""
    import modelopt.torch.quantization as mtq

    name = MODELOPT_CFG[quant.qformat]
    if name is None and quant.kv_cache_dtype is None:
        return None
    if name is None:  # KV cache only, like TensorRT-LLM's EMPTY_CFG + KV cache config
        cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    else:
        cfg = copy.deepcopy(getattr(mtq, name))
    if quant.qformat == "int4_awq":
        for entry in cfg["quant_cfg"]:
            if entry.get("quantizer_name") == "*weight_quantizer" and "block_sizes" in entry.get("cfg", {}):
                entry["cfg"]["block_sizes"][-1] = quant.awq_block_size
    if quant.smoothquant_alpha is not None:  # ModelOpt's SmoothQuantCalibConfig.alpha (its default 1.0 otherwise)
        cfg["algorithm"] = {"method": "smoothquant", "alpha": float(quant.smoothquant_alpha)}
    if quant.kv_cache_dtype is not None:
        kv = copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
        for entry in kv:
            entry["cfg"]["num_bits"] = KV_NUM_BITS[quant.kv_cache_dtype]
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + kv
    return cfg


@contextlib.contextmanager
def _hf_progress(enabled: bool):
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not enabled:
            hf_logging.enable_progress_bar()


def quantize_model(
    source_dir: str | Path,
    quant: QuantConfig,
    out_dir: str | Path,
    tp_size: int = 1,
    pp_size: int = 1,
    progress: bool = True,
    dtype: str = "bfloat16",
    paged_context_fmha: bool = True,
    echo=print,
    checkpoint_format: str = "trtllm",
) -> QualityReport:
    """Quantize the Hugging Face model in `source_dir` with ModelOpt and write a TensorRT-LLM checkpoint.

    `out_dir` receives `config.json` + `rank{N}.safetensors` (N < tp_size * pp_size), as written by
    `modelopt.torch.export.export_tensorrt_llm_checkpoint`. Calibration is seeded (`quant.seed`) and
    deterministic. Returns the quality report of the quantized model against the source on held-out text.
    `paged_context_fmha=False` lifts the KV-cache combination checks (only for engines built without it).
    `checkpoint_format="hf"` writes ModelOpt's Hugging Face export instead (`export_hf_checkpoint`:
    safetensors + `hf_quant_config.json` + tokenizer), the format the TensorRT-LLM LLM API loads; the
    LLM API shards it itself, so it is written unsplit.
    """
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    check_quant_config(quant, paged_context_fmha)
    hf = check_model(source_dir, quant, tp_size, pp_size)
    check_disk_space(out_dir, estimate_output_bytes(source_dir, quant))
    if quant.calib_dataset != BUILTIN:
        read_passages(quant.calib_dataset)  # fail before loading the model

    with quiet():  # importing ModelOpt warns and prints (no tensorrt_llm installed): load what runs below, silenced
        import modelopt.torch.export  # noqa: F401
        import modelopt.torch.quantization  # noqa: F401
        import torch
        import tqdm.auto  # noqa: F401
        import transformers  # noqa: F401

    random.seed(quant.seed)
    torch.manual_seed(quant.seed)
    t0 = time.perf_counter()
    tokenizer, model, on_gpu = _load(source_dir, progress, echo)
    t1 = time.perf_counter()
    source_model = _calibrate(model, tokenizer, source_dir, quant, on_gpu, progress, echo)
    t_calib = time.perf_counter() - t1

    rows, num_passages = heldout_rows(tokenizer, quant.calib_max_seq_length)
    report = evaluate_quality(source_model, model, rows, quant, progress, num_passages)
    del source_model

    decoder = SUPPORTED_MODEL_TYPES[hf["model_type"]]
    out_dir.mkdir(parents=True, exist_ok=True)
    if checkpoint_format == "hf":
        export_hf(model, tokenizer, out_dir, dtype, source_dir, quant)
        echo(
            f"  quantized {source_dir.name} to {quant.qformat} (Hugging Face format) in"
            f" {time.perf_counter() - t0:.1f} s"
        )
        return report
    export_trtllm(model, decoder, out_dir, dtype, tp_size, pp_size, hf, source_dir, quant)
    echo(
        f"  quantized {source_dir.name} to {quant.qformat} in {time.perf_counter() - t0:.1f} s (calibration"
        f" {t_calib:.1f} s)"
    )
    return report


def _load(source_dir: Path, progress: bool, echo):
    """(tokenizer, model, on_gpu): a GPU calibrates in bf16 across the GPUs (device_map auto); the CPU in fp32
    (calibration.plan_calibration)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source_dir))
        on_gpu = torch.cuda.is_available()
        load = {"dtype": torch.bfloat16, "device_map": "auto"} if on_gpu else {"dtype": torch.float32}
        with _hf_progress(progress):
            model = AutoModelForCausalLM.from_pretrained(str(source_dir), **load).eval()
        echo(f"  calibrating on {'the GPU(s) in bf16' if on_gpu else 'the CPU in fp32'}")
    except (OSError, ValueError) as exc:
        raise QuantizeError(
            f"cannot load the model in {source_dir}: {exc}", "check the folder is a complete HF model"
        ) from exc
    return tokenizer, model, on_gpu


def _calibrate(model, tokenizer, source_dir: Path, quant: QuantConfig, on_gpu: bool, progress: bool, echo):
    """Quantize `model` in place with `mtq.quantize` over the calibration samples (nothing to do for full_prec
    without a KV-cache format); returns the unquantized reference for the quality report."""
    cfg = modelopt_config(quant)
    if cfg is None:
        return model
    import modelopt.torch.quantization as mtq
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    samples = calibration_samples(tokenizer, quant, echo)  # [calib_size, calib_max_seq_length]
    if on_gpu:  # the unquantized reference stays in RAM, not in GPU memory
        with _hf_progress(False):
            source_model = AutoModelForCausalLM.from_pretrained(str(source_dir), dtype=torch.bfloat16).eval()
    else:
        source_model = copy.deepcopy(model)  # the reference for the quality report (twice the model's memory)

    def forward_loop(m):  # ModelOpt calls this once per calibration pass (AWQ: several)
        with torch.no_grad():
            for row in tqdm(samples, desc=f"calibrate {quant.qformat}", disable=not progress, leave=False):
                m(row[None, :].to(model.device))  # [1, calib_max_seq_length]

    with quiet():
        mtq.quantize(model, cfg, forward_loop)
    return source_model
