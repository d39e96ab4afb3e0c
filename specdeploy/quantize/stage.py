"""The quantize stage: Hugging Face checkpoints -> TensorRT-LLM checkpoints, with NVIDIA ModelOpt, on CPU.

This module runs the stage for a recipe (`quantize_recipe`): both roles, every input checked before any model is
loaded, each checkpoint written atomically with its manifest, unchanged inputs reused. Its parts, one module each:
  - `quant_formats`: the format tables (TensorRT-LLM's `--qformat` / `--kv_cache_dtype` words -> ModelOpt configs)
    and the input checks (architecture, format combinations TensorRT-LLM rejects, shapes, disk space),
  - `calibration_text`: the calibration and held-out text, packed into fixed-length samples,
  - `modelopt_quantize.quantize_model`: load -> `mtq.quantize` (calibrate) -> quality report -> export,
  - `quant_quality`: the quality report (perplexity, top-1 agreement, KL) of the fake-quantized model,
  - `checkpoint_export`: ModelOpt's TensorRT-LLM / Hugging Face export and the config.json fixes.

The same steps TensorRT-LLM's `examples/quantization/quantize.py` takes (quantize_by_modelopt.py), minus
the GPU: `full_prec` exports unquantized weights, every other format calibrates with ModelOpt first.
"""

from __future__ import annotations

from pathlib import Path

from specdeploy.quantize import calibration
from specdeploy.quantize.calibration_text import BUILTIN, CALIB_FILE, HELDOUT_FILE, builtin_path, read_passages
from specdeploy.quantize.export import export_dtype
from specdeploy.quantize.formats import (
    KV_CACHE_QUANT_ALGO,
    QUANT_ALGO,
    check_model,
    check_quant_config,
    needs_calibration,
)
from specdeploy.quantize.modelopt import quantize_model
from specdeploy.recipe.config import QuantConfig, Recipe, checkpoint_settings

STAGE = "quantize"
TOOL_DISTRIBUTIONS = ("nvidia-modelopt", "torch", "transformers")


# ---------------------------------------------------------------- a recipe


def _resolve(model: str) -> Path:
    from specdeploy.core.model_store import resolve

    return resolve(model)


def checkpoint_format(recipe: Recipe) -> str:
    """TensorRT-LLM checkpoints for the cpu and trtllm-engine backends; Hugging Face format for the LLM API."""
    from specdeploy.core import backends

    return backends.of(recipe).checkpoint_format


def _ranks(recipe: Recipe, m) -> tuple[int, int]:
    return (1, 1) if checkpoint_format(recipe) == "hf" else (m.tp_size, m.pp_size)


def _machine_memory() -> tuple[list[int], int | None]:
    """(memory of each GPU, RAM available) for the calibration plan."""
    from specdeploy.core import gpus as gpu_probe

    try:
        import psutil

        ram = int(psutil.virtual_memory().available)
    except (ImportError, OSError):
        ram = None
    return [g.memory_bytes for g in gpu_probe.probe()], ram


def recipe_fingerprint(recipe: Recipe, role: str, source_hash: str) -> str:
    from specdeploy.core.artifacts import file_hash, fingerprint, tool_versions

    m = recipe.model(role)
    calib = m.quantization.calib_dataset
    return fingerprint(
        stage=STAGE,
        source=source_hash,
        model=checkpoint_settings(m),
        format=checkpoint_format(recipe),
        dtype=export_dtype(recipe.engine.dtype),
        calib=file_hash(Path(calib)) if calib != BUILTIN else file_hash(builtin_path(CALIB_FILE)),
        heldout=file_hash(builtin_path(HELDOUT_FILE)),
        tools=tool_versions(*TOOL_DISTRIBUTIONS),
    )


def quantize_recipe(recipe: Recipe, layout, force: bool = False, echo=print, progress: bool = True) -> dict:
    """Write `layout.checkpoint(role)` for the target and the draft; unchanged inputs are not redone.

    All inputs of both roles are checked before any model is loaded. Each checkpoint is written into a
    temporary folder and swapped in only when complete (with its manifest), so a failed run keeps the
    earlier checkpoint. Returns {role: QualityReport or None when up to date}.
    """
    from specdeploy.core.artifacts import is_up_to_date

    plans = [_plan_role(recipe, role) for role in recipe.model_roles]  # an n-gram draft has no weights
    reports = {}
    for role, m, source, source_hash, fp, pre, plan in plans:
        dest = layout.checkpoint(role)
        if not force and is_up_to_date(dest, fp):
            echo(f"{role}: up to date ({dest})")
            reports[role] = None
        elif pre is not None:
            _link_prequantized(recipe, role, m, source, source_hash, fp, pre, dest, echo)
            reports[role] = None
        else:
            reports[role] = _quantize_role(recipe, role, m, source, source_hash, fp, plan, dest, echo, progress)
    return reports


def _plan_role(recipe: Recipe, role: str) -> tuple:
    """Check one role's inputs without loading its model: (role, model config, source folder, its hash, the
    fingerprint, the ModelOpt export it already is or None, the calibration plan or None)."""
    from specdeploy.core.artifacts import dir_hash

    m = recipe.model(role)
    source = _resolve(m.model)
    pre = calibration.detect_prequantized(source)  # a ModelOpt export is used as is, without calibrating
    plan = None
    if pre is not None:
        calibration.check_prequantized(pre, m.quantization, recipe.backend, m.model, role)
    else:
        check_quant_config(m.quantization)
        hf = check_model(source, m.quantization, m.tp_size, m.pp_size)
        if m.quantization.calib_dataset != BUILTIN:
            read_passages(m.quantization.calib_dataset)
        if needs_calibration(m.quantization):
            plan = calibration.plan_calibration(hf, m.quantization, *_machine_memory())
            calibration.check_calibration(plan, m.quantization, m.model, role)
    source_hash = dir_hash(source)
    return role, m, source, source_hash, recipe_fingerprint(recipe, role, source_hash), pre, plan


def _quant_algos(q: QuantConfig) -> dict:
    return {"quant_algo": QUANT_ALGO[q.qformat], "kv_cache_quant_algo": KV_CACHE_QUANT_ALGO[q.kv_cache_dtype]}


def _link_prequantized(
    recipe: Recipe, role: str, m, source: Path, source_hash: str, fp: str, pre, dest: Path, echo
) -> None:
    """A source that is already a ModelOpt export becomes the checkpoint by links, with its manifest."""
    from specdeploy.core.artifacts import Manifest, atomic_output, tool_versions

    with atomic_output(dest) as tmp:
        files = calibration.link_checkpoint(source, tmp)
        Manifest(
            stage=STAGE,
            recipe_name=recipe.name,
            fingerprint=fp,
            settings={**checkpoint_settings(m), "role": role, "format": "hf", "prequantized": True},
            inputs={"source_dir": str(source), "source_hash": source_hash},
            tool_versions=tool_versions(*TOOL_DISTRIBUTIONS),
            extra={
                "quality": None,
                "prequantized_from": pre.source,
                "linked_files": files,
                **_quant_algos(m.quantization),
            },
        ).write(tmp)
    echo(
        f"{role}: {m.model} is already a ModelOpt {pre.qformat} export ({pre.source}); linked as the checkpoint "
        f"{dest}, no calibration"
    )


def _quantize_role(
    recipe: Recipe, role: str, m, source: Path, source_hash: str, fp: str, plan, dest: Path, echo, progress: bool
):
    """Quantize one role's model into `dest` (atomically, with its manifest); returns its QualityReport."""
    from specdeploy.core.artifacts import Manifest, atomic_output, tool_versions

    q = m.quantization
    echo(
        f"{role}: quantizing {m.model} to {q.qformat}" + (f" + {q.kv_cache_dtype} KV cache" if q.kv_cache_dtype else "")
    )
    if plan is not None:
        echo(f"  {plan.summary()}")
    dtype = export_dtype(recipe.engine.dtype)
    with atomic_output(dest) as tmp:
        report = quantize_model(
            source,
            q,
            tmp,
            *_ranks(recipe, m),
            progress=progress,
            dtype=dtype,
            echo=echo,
            checkpoint_format=checkpoint_format(recipe),
        )
        Manifest(
            stage=STAGE,
            recipe_name=recipe.name,
            fingerprint=fp,
            settings={**checkpoint_settings(m), "dtype": dtype, "role": role, "format": checkpoint_format(recipe)},
            inputs={"source_dir": str(source), "source_hash": source_hash},
            tool_versions=tool_versions(*TOOL_DISTRIBUTIONS),
            extra={"quality": report.as_dict(), **_quant_algos(q)},
        ).write(tmp)
    echo(report.table(f"{role} ({m.model})"))
    echo(f"{role}: wrote {dest}")
    return report
