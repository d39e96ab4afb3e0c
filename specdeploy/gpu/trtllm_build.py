"""Backend trtllm-engine: TensorRT engines with `trtllm-build` (TensorRT-LLM releases that still ship it, <= 1.1),
one engine per role from the quantized TensorRT-LLM checkpoints. Flags are TensorRT-LLM's own; each is cited where it
is used. On a GPU-less machine it runs through `--dry-run`, golden tests and a recording stand-in `trtllm-build` on
PATH; it never pretends a GPU result.
"""

from __future__ import annotations

import collections
import json
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from specdeploy.core import gpus as gpu_probe
from specdeploy.core.artifacts import (
    Layout,
    Manifest,
    atomic_output,
    fingerprint,
    is_up_to_date,
    require,
    tool_versions,
)
from specdeploy.core.errors import BuildError, StaleArtifactError
from specdeploy.recipe.config import Recipe, to_plain

TOOL = "trtllm-build"
BUILD_STAGE = "build"
LOG_TAIL_LINES = 30

# Flags every engine gets. Source: `trtllm-build --help` / tensorrt_llm/commands/build.py and
# tensorrt_llm/plugin/plugin.py (add_plugin_argument: feature flags take enable|disable, plugin flags a
# dtype or "auto" = the checkpoint dtype, https://nvidia.github.io/TensorRT-LLM/legacy/python-api/tensorrt_llm.plugin.html);
# examples/draft_target_model/README.md: "--use_paged_context_fmha=enable must be specified since we need
# KV-Cache reuse in this approach".
COMMON_FLAGS = (
    ("--kv_cache_type", "paged"),
    ("--use_paged_context_fmha", "enable"),
    ("--remove_input_padding", "enable"),
    ("--gpt_attention_plugin", "auto"),
    ("--gemm_plugin", "auto"),
)
# examples/draft_target_model/README.md: "--speculative_decoding_mode=draft_tokens_external and
# --max_draft_len must be specified for target model."
SPECULATIVE_MODE = "draft_tokens_external"


def engine_max_input_len(recipe: Recipe) -> int:
    """The engines' max_input_len for the speculative flow: max_seq_len - 1.

    The BLS sends the whole sequence (prompt + output so far) to both engines every round, so their inputs
    grow to max_seq_len minus the tokens asked for; an engine built with the client-facing
    engine.max_input_len would fail half-way through a long answer. Clients are still held to
    engine.max_input_len by preprocessing and the BLS.
    """
    return recipe.engine.max_seq_len - 1


# ---------------------------------------------------------------- checkpoints


@dataclass(frozen=True)
class CheckpointInfo:
    """What the build needs from a quantized TensorRT-LLM checkpoint's config.json."""

    tp_size: int
    pp_size: int
    quant_algo: str | None = None
    kv_cache_quant_algo: str | None = None
    present: bool = True  # False: planned from the recipe (dry run before quantize)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size


def read_checkpoint(ckpt_dir: Path, recipe: Recipe, role: str, *, must_exist: bool) -> CheckpointInfo:
    """The checkpoint's mapping and quantization; from the recipe when absent and not required."""
    m = recipe.model(role)
    config_path = Path(ckpt_dir) / "config.json"
    if not config_path.is_file():
        if must_exist:
            raise StaleArtifactError(
                f"{ckpt_dir} has no quantized {role} checkpoint (no config.json)",
                f"run: specdeploy quantize <recipe> (it writes the {role} checkpoint there)",
            )
        return CheckpointInfo(m.tp_size, m.pp_size, present=False)
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise BuildError(f"{config_path} is not valid JSON: {exc}", "re-run specdeploy quantize --force") from exc
    if "mapping" not in config:
        raise StaleArtifactError(
            f"{ckpt_dir} is not a TensorRT-LLM checkpoint (config.json has no 'mapping')",
            "trtllm-build reads TensorRT-LLM checkpoints; re-run specdeploy quantize for backend trtllm-engine",
        )
    mapping = config["mapping"]
    tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
    if (tp, pp) != (m.tp_size, m.pp_size):
        raise StaleArtifactError(
            f"{role} checkpoint {ckpt_dir} is split tp {tp} x pp {pp}, the recipe asks for "
            f"tp {m.tp_size} x pp {m.pp_size}",
            "re-run: specdeploy quantize <recipe> --force (the split is fixed when the checkpoint is written)",
        )
    quant = config.get("quantization") or {}
    return CheckpointInfo(tp, pp, quant.get("quant_algo"), quant.get("kv_cache_quant_algo"))


# ---------------------------------------------------------------- trtllm-build command lines


def build_command(
    recipe: Recipe, role: str, checkpoint_dir: Path, output_dir: Path, ckpt: CheckpointInfo, workers: int = 1
) -> list[str]:
    """The exact `trtllm-build` argv for one role (draft or target)."""
    e, s = recipe.engine, recipe.speculative
    cmd = [
        TOOL,
        "--checkpoint_dir",
        str(checkpoint_dir),
        "--output_dir",
        str(output_dir),
        "--max_batch_size",
        str(e.max_batch_size),
        "--max_input_len",
        str(engine_max_input_len(recipe)),
        "--max_seq_len",
        str(e.max_seq_len),
    ]
    for flag, value in COMMON_FLAGS:
        cmd += [flag, value]
    if role == "target":
        cmd += ["--speculative_decoding_mode", SPECULATIVE_MODE, "--max_draft_len", str(s.max_draft_len)]
    if s.use_draft_logits:
        # Both roles: the draft must return its generation logits (BLS passes them as draft_logits)
        # and the target accepts by comparing logits. draft_target_model/README.md: "--gather_generation_logits
        # is necessary if using generation logits for selecting tokens in target model."
        cmd.append("--gather_generation_logits")
    if ckpt.world_size > 1 and workers > 1:
        # build.py: "--workers: The number of workers for building in parallel" (one rank engine each).
        cmd += ["--workers", str(workers)]
    return cmd


@dataclass(frozen=True)
class BuildStep:
    role: str
    checkpoint_dir: Path
    output_dir: Path
    checkpoint: CheckpointInfo
    command: list[str]  # with output_dir as the final location (what the manifest records)

    @property
    def command_line(self) -> str:
        return shlex.join(self.command)


def plan_engine_build(
    recipe: Recipe, layout: Layout, gpus: list[gpu_probe.GpuInfo] | None = None, *, must_exist: bool = False
) -> list[BuildStep]:
    """The build steps for draft then target; `--workers` is min(ranks, GPUs) (ranks when no GPU is seen)."""
    steps = []
    for role in ("draft", "target"):
        ckpt_dir = layout.checkpoint(role)
        ckpt = read_checkpoint(ckpt_dir, recipe, role, must_exist=must_exist)
        workers = min(ckpt.world_size, len(gpus)) if gpus else ckpt.world_size
        out = layout.engine(role)
        steps.append(BuildStep(role, ckpt_dir, out, ckpt, build_command(recipe, role, ckpt_dir, out, ckpt, workers)))
    return steps


def _with_output_dir(command: list[str], output_dir: Path) -> list[str]:
    cmd = list(command)
    cmd[cmd.index("--output_dir") + 1] = str(output_dir)
    return cmd


def engine_fingerprint(recipe: Recipe, step: BuildStep, checkpoint_fp: str) -> str:
    # The command minus paths (and --workers, which only parallelises the build) says everything about the
    # engine besides the checkpoint itself.
    flags = [a for a in step.command if a not in (str(step.checkpoint_dir), str(step.output_dir))]
    if "--workers" in flags:
        at = flags.index("--workers")
        del flags[at : at + 2]
    return fingerprint(backend="trtllm-engine", role=step.role, checkpoint=checkpoint_fp, flags=flags)


# ---------------------------------------------------------------- running the tool


def run_tool(command: list[str], log_path: Path, role: str, echo=print) -> tuple[int, list[str], str | None]:
    """Run a build tool streaming its output with elapsed time; returns (exit code, last lines, version line).

    Never raises on a non-zero exit: the caller turns that into a BuildError with the tail.
    """
    tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
    version = None
    start = time.monotonic()
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    except OSError as exc:
        raise BuildError(f"cannot start {command[0]}: {exc}", f"is {command[0]} installed and executable?") from exc
    with open(log_path, "w") as log, proc:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            log.write(raw)
            tail.append(line)
            # trtllm-build's first line: "[TensorRT-LLM] TensorRT-LLM version: 0.18.0"
            if version is None and "TensorRT-LLM version:" in line:
                version = line.split("TensorRT-LLM version:", 1)[1].strip()
            echo(f"  [{role} {time.monotonic() - start:6.1f}s] {line}")
        rc = proc.wait()
    return rc, list(tail), version


def _require_tool() -> str:
    exe = shutil.which(TOOL)
    if exe is None:
        raise BuildError(
            f"{TOOL} is not on PATH",
            "backend trtllm-engine needs TensorRT-LLM <= 1.1 (pip install tensorrt_llm==<version>, or the NGC image "
            "nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3); current TensorRT-LLM: use backend trtllm-llmapi; "
            "see the commands with specdeploy build <recipe> --dry-run",
        )
    return exe


def _check_engine_output(out: Path, world_size: int, role: str, tail: list[str]) -> None:
    engines = sorted(out.glob("rank*.engine"))
    if not (out / "config.json").is_file() or len(engines) != world_size:
        raise BuildError(
            f"{TOOL} exited 0 for the {role} but wrote {len(engines)} rank engine(s) (expected {world_size}) "
            f"and {'a' if (out / 'config.json').is_file() else 'no'} config.json; last lines:\n" + "\n".join(tail),
            "check the build log above",
        )


def build_engine_recipe(
    recipe: Recipe, layout: Layout, force: bool = False, dry_run: bool = False, echo=print, run_preflight=None
) -> list[Path]:
    """`specdeploy build` for backend trtllm-engine: draft then target engine, each atomically with a manifest.

    A failed build leaves the earlier engine of that role in place and raises BuildError with the tool's last lines.
    `run_preflight(gpus)` returns the pre-flight findings (backend_stages.GpuStages.build hands it in).
    """
    gpus = gpu_probe.probe()
    findings = run_preflight(gpus) if run_preflight else []
    if dry_run:
        _echo_dry_run(recipe, plan_engine_build(recipe, layout, gpus, must_exist=False), gpus, findings, echo)
        return []
    steps = plan_engine_build(recipe, layout, gpus, must_exist=True)
    exe = _require_tool()
    outputs = []
    for i, step in enumerate(steps, 1):
        ckpt_manifest = require(step.checkpoint_dir, "quantize", "specdeploy quantize <recipe>")
        fp = engine_fingerprint(recipe, step, ckpt_manifest.fingerprint)
        if not force and is_up_to_date(step.output_dir, fp):
            echo(f"[{i}/{len(steps)}] {step.role} engine is up to date: {step.output_dir}")
            outputs.append(step.output_dir)
            continue
        echo(f"[{i}/{len(steps)}] building the {step.role} engine -> {step.output_dir}")
        _build_engine(recipe, step, exe, fp, ckpt_manifest, gpus, echo)
        outputs.append(step.output_dir)
    return outputs


def _echo_dry_run(recipe: Recipe, steps: list[BuildStep], gpus, findings, echo) -> None:
    echo(f"# dry run: {TOOL} commands for recipe {recipe.name} ({gpu_probe.describe(gpus)}); nothing is written")
    for f in findings:
        echo(f"# preflight {f.line()}")
    for step in steps:
        src = "" if step.checkpoint.present else "  # checkpoint not written yet: tp/pp taken from the recipe"
        echo(f"# {step.role}: tp {step.checkpoint.tp_size} x pp {step.checkpoint.pp_size}{src}")
        echo(step.command_line)


def _build_engine(recipe: Recipe, step: BuildStep, exe: str, fp: str, ckpt_manifest: Manifest, gpus, echo) -> None:
    """Run trtllm-build for one role into a temporary folder that replaces step.output_dir when it succeeds."""
    echo(f"  $ {step.command_line}")
    started = time.monotonic()
    with atomic_output(step.output_dir) as tmp:
        command = [exe] + _with_output_dir(step.command, tmp)[1:]
        rc, tail, version = run_tool(command, tmp / "build.log", step.role, echo)
        if rc != 0:
            raise BuildError(
                f"{TOOL} failed for the {step.role} (exit {rc}); its last lines:\n" + "\n".join(tail),
                f"the earlier {step.role} engine (if any) is unchanged; full log above. Fix the cause and re-run "
                "specdeploy build",
            )
        _check_engine_output(tmp, step.checkpoint.world_size, step.role, tail)
        Manifest(
            stage=BUILD_STAGE,
            recipe_name=recipe.name,
            fingerprint=fp,
            settings={
                "backend": "trtllm-engine",
                "role": step.role,
                "max_draft_len": recipe.speculative.max_draft_len if step.role == "target" else None,
                "gather_generation_logits": recipe.speculative.use_draft_logits,
                "max_input_len": recipe.engine.max_input_len,  # the client-facing limit (the repository reads it)
                "engine_max_input_len": engine_max_input_len(recipe),
                "max_seq_len": recipe.engine.max_seq_len,
                "tp_size": step.checkpoint.tp_size,
                "pp_size": step.checkpoint.pp_size,
                "engine": to_plain(recipe.engine),
            },
            inputs={"checkpoint": ckpt_manifest.fingerprint},
            tool_versions=tool_versions("tensorrt_llm", "tensorrt") | {TOOL: version, "tool_path": exe},
            extra={
                "checkpoint_dir": str(step.checkpoint_dir),
                # the repository generator copies the tokenizer from here (trtllm-build does not save it)
                "tokenizer_dir": ckpt_manifest.inputs.get("source_dir"),
                "command": step.command,
                "command_line": step.command_line,
                "gpus": [g.summary() for g in gpus] or ["no GPU seen by nvidia-smi/torch"],
                "build_seconds": round(time.monotonic() - started, 1),
            },
        ).write(tmp)
    echo(f"  {step.role} engine done in {time.monotonic() - started:.1f}s")
