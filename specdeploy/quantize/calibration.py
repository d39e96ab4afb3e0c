"""Before the quantize stage loads a model: can it calibrate here, on which device, and does it need to at all?

- `plan_calibration`: memory and time of ModelOpt calibration on this machine (GPU when one is present, else
  CPU in fp32), and a refusal with alternatives when it does not fit or would take too long. Calibrating a
  70B model on CPU holds it in fp32 twice (the stage keeps the unquantized model for its quality report):
  ~1.1 TB of RAM, and days of compute.
- `detect_prequantized`: a Hugging Face folder that is already a ModelOpt export (NVIDIA publishes FP8
  checkpoints such as nvidia/Llama-3.1-70B-Instruct-FP8: `hf_quant_config.json` with `quantization.quant_algo`)
  is used as the checkpoint as is, without calibrating.

Pure functions over the model's config.json and the machine's numbers; the quantize stage calls them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdeploy.core.durations import duration_text
from specdeploy.core.errors import ConfigError, QuantizeError
from specdeploy.recipe.config import QuantConfig

# Sustained throughput assumed for calibration forwards (dense matmuls): a many-core server CPU in fp32, and a
# data-centre GPU in bf16 (well under an H100's peak). Estimates, labelled as such; they decide refusals only
# when off by a large margin (hours against days).
CPU_FLOPS = 2.0e11
GPU_FLOPS = 2.0e14
# Forward passes over the calibration set per format: AWQ searches scales (several passes), the rest one.
CALIB_PASSES = {"int4_awq": 4}
BYTES = {"cpu": 4, "cuda": 2}  # fp32 on CPU, bf16 on the GPU
HEADROOM = 1.15  # activations, allocator slack
AWQ_MAX_CALIB_SIZE = 32  # as quantize.AWQ_MAX_CALIB_SIZE (TensorRT-LLM's quantize.py)

# ModelOpt quant_algo (hf_quant_config.json) -> specdeploy qformat; KV cache likewise.
PREQUANTIZED_QFORMATS = {"FP8": "fp8", "W4A16_AWQ": "int4_awq"}
PREQUANTIZED_KV = {None: None, "FP8": "fp8"}


@dataclass(frozen=True)
class CalibrationPlan:
    device: str  # "cuda" | "cpu"
    params: int
    peak_bytes: int  # on the device (RAM for cpu, summed GPU memory for cuda)
    host_bytes: int  # RAM for the unquantized reference copy (cuda) or everything (cpu)
    seconds: float
    available_bytes: int | None
    available_host_bytes: int | None

    def summary(self) -> str:
        gib = 2**30
        where = "GPU memory" if self.device == "cuda" else "RAM"
        avail = f" of {self.available_bytes / gib:.0f} GiB" if self.available_bytes else ""
        return (
            f"calibrating {self.params / 1e9:.2f}B parameters on {self.device}: ~{self.peak_bytes / gib:.1f} GiB "
            f"{where}{avail}, ~{duration_text(self.seconds)} (estimate)"
        )


def count_params(hf_config: dict) -> int:
    from specdeploy.deploy.preflight import ModelShape

    shape = ModelShape.from_config(hf_config)
    return shape.linear_params + shape.embedding_params


def plan_calibration(
    hf_config: dict,
    quant: QuantConfig,
    gpu_memory_bytes: list[int],
    ram_bytes: int | None,
) -> CalibrationPlan:
    """Where and how long ModelOpt calibration takes for one model (GPU when any is present)."""
    params = count_params(hf_config)
    device = "cuda" if gpu_memory_bytes else "cpu"
    weights = params * BYTES[device]
    samples = min(quant.calib_size, AWQ_MAX_CALIB_SIZE) if quant.qformat == "int4_awq" else quant.calib_size
    tokens = samples * quant.calib_max_seq_length
    flops = 2.0 * params * tokens * CALIB_PASSES.get(quant.qformat, 1)
    seconds = flops / (GPU_FLOPS if device == "cuda" else CPU_FLOPS)
    if device == "cuda":
        # model on the GPUs (device_map="auto"), the unquantized reference for the quality report in RAM
        return CalibrationPlan(
            device,
            params,
            peak_bytes=int(weights * HEADROOM),
            host_bytes=weights,
            seconds=seconds,
            available_bytes=sum(gpu_memory_bytes),
            available_host_bytes=ram_bytes,
        )
    # CPU: the model and its unquantized reference copy, both fp32
    peak = int(2 * weights * HEADROOM)
    return CalibrationPlan(
        device,
        params,
        peak_bytes=peak,
        host_bytes=peak,
        seconds=seconds,
        available_bytes=ram_bytes,
        available_host_bytes=ram_bytes,
    )


def check_calibration(plan: CalibrationPlan, quant: QuantConfig, model: str, role: str) -> None:
    """Refuse a calibration that cannot fit or would take longer than quantization.max_calib_hours."""
    alternatives = (
        f"use a pre-quantized checkpoint as {role}.model (e.g. NVIDIA's FP8 Hugging Face exports such as "
        "nvidia/Llama-3.1-70B-Instruct-FP8: specdeploy uses them without calibrating, backend trtllm-llmapi); "
        "run specdeploy quantize on a machine with GPUs (it calibrates there in bf16); or lower "
        f"{role}.quantization.calib_size"
    )
    gib = 2**30
    if plan.available_bytes is not None and plan.peak_bytes > plan.available_bytes:
        where = "GPU memory" if plan.device == "cuda" else "RAM"
        raise QuantizeError(
            f"{role} {model}: {plan.summary()}; that needs {plan.peak_bytes / gib:.0f} GiB of {where} but this machine "
            f"has {plan.available_bytes / gib:.0f} GiB",
            alternatives,
        )
    if plan.device == "cuda" and plan.available_host_bytes is not None and plan.host_bytes > plan.available_host_bytes:
        raise QuantizeError(
            f"{role} {model}: the unquantized reference for the quality report needs {plan.host_bytes / gib:.0f} GiB "
            f"of RAM, this machine has {plan.available_host_bytes / gib:.0f} GiB",
            alternatives,
        )
    if plan.seconds > quant.max_calib_hours * 3600:
        raise QuantizeError(
            f"{role} {model}: {plan.summary()}, longer than {role}.quantization.max_calib_hours "
            f"({quant.max_calib_hours:g} h)",
            alternatives + f"; or raise {role}.quantization.max_calib_hours if you mean it",
        )


# ---------------------------------------------------------------- pre-quantized checkpoints


@dataclass(frozen=True)
class Prequantized:
    qformat: str
    kv_cache_dtype: str | None
    source: str  # which file said so


def detect_prequantized(model_dir: Path) -> Prequantized | None:
    """The format of a ModelOpt Hugging Face export (hf_quant_config.json, or config.json quantization_config
    with quant_method modelopt); None for an unquantized model. Unknown formats are an error, not a guess."""
    model_dir = Path(model_dir)
    path = model_dir / "hf_quant_config.json"
    algo = kv = None
    if path.is_file():
        try:
            q = json.loads(path.read_text()).get("quantization") or {}
        except ValueError as exc:
            raise QuantizeError(f"{path} is not valid JSON: {exc}", "re-download the checkpoint") from exc
        algo, kv, source = q.get("quant_algo"), q.get("kv_cache_quant_algo"), path.name
    else:
        config_path = model_dir / "config.json"
        try:
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except ValueError:
            config = {}
        q = config.get("quantization_config") or {}
        if not q:
            return None
        if q.get("quant_method") != "modelopt":
            raise QuantizeError(
                f"{model_dir} is already quantized ({q.get('quant_method')!r} quantization_config), not by ModelOpt",
                "use the unquantized model (specdeploy quantizes it with ModelOpt) or a ModelOpt export",
            )
        algo, kv, source = q.get("quant_algo"), q.get("kv_cache_quant_algo"), "config.json quantization_config"
    if algo is None and kv is None:
        return None
    if algo not in PREQUANTIZED_QFORMATS or kv not in PREQUANTIZED_KV:
        raise QuantizeError(
            f"{model_dir} is a ModelOpt export with quant_algo {algo!r} / kv_cache_quant_algo {kv!r}, which specdeploy "
            f"does not deploy (known: {', '.join(PREQUANTIZED_QFORMATS)}; KV cache FP8 or none)",
            "use an FP8 or INT4 AWQ export, or the unquantized model",
        )
    return Prequantized(PREQUANTIZED_QFORMATS[algo], PREQUANTIZED_KV[kv], source)


def check_prequantized(pre: Prequantized, quant: QuantConfig, backend: str, model: str, role: str) -> None:
    """The recipe must ask for what the checkpoint is, on a backend that loads Hugging Face exports."""
    from specdeploy.core import backends

    if not backends.get(backend).prequantized_models:
        loaders = " or ".join(b.name for b in backends.ALL if b.prequantized_models)
        raise ConfigError(
            f"{role}.model {model} is a pre-quantized ModelOpt Hugging Face export ({pre.qformat}); backend {backend} "
            "needs TensorRT-LLM checkpoints that specdeploy writes by calibrating",
            f"use backend {loaders} (it loads the export as is), or point the model at the unquantized weights",
        )
    if (quant.qformat, quant.kv_cache_dtype) != (pre.qformat, pre.kv_cache_dtype):
        raise ConfigError(
            f"{role}.model {model} is already quantized as {pre.qformat} (KV cache"
            f" {pre.kv_cache_dtype or 'unquantized'}, from {pre.source}), but the recipe asks for {quant.qformat} (KV"
            f" cache {quant.kv_cache_dtype or 'unquantized'})",
            f"set {role}.quantization.qformat: {pre.qformat} and kv_cache_dtype: "
            f"{pre.kv_cache_dtype or 'null'}, or use the unquantized model",
        )


def link_checkpoint(source: Path, dest: Path) -> list[str]:
    """Make `dest` the checkpoint by symlinking the export's files (no copy of tens of GB); returns their names."""
    names = []
    for item in sorted(Path(source).iterdir()):
        if item.is_file():
            (Path(dest) / item.name).symlink_to(item.resolve())
            names.append(item.name)
    return names
