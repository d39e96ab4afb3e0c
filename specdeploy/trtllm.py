"""GPU backends: TensorRT engines with `trtllm-build`, or an LLM-API (PyTorch backend) options file.

`trtllm-engine` (TensorRT-LLM releases that still ship `trtllm-build`, <= 1.1) builds one engine
per role from the quantized TensorRT-LLM checkpoints; `trtllm-llmapi` (current TensorRT-LLM) has no
engine file and instead writes the options `LLM(...)`, `trtllm-serve` and Triton's llmapi model
read. Flags and keys are TensorRT-LLM's own; each is cited where it is used.

On this (GPU-less) machine the code runs through `--dry-run`, golden tests and a recording
stand-in `trtllm-build` on PATH; it never pretends a GPU result.
"""

from __future__ import annotations

import collections
import json
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from specdeploy import gpu as gpu_probe
from specdeploy.artifacts import (MANIFEST, Layout, Manifest, atomic_output, dir_hash, fingerprint, is_up_to_date,
                                  require, tool_versions)
from specdeploy.config import EAGLE3_HEAD_TRAINED, Recipe, to_plain
from specdeploy.errors import BuildError, ConfigError, StaleArtifactError

TOOL = "trtllm-build"
BUILD_STAGE = "build"
LLMAPI_OPTIONS = "extra_llm_api_options.yaml"
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
        "--checkpoint_dir", str(checkpoint_dir),
        "--output_dir", str(output_dir),
        "--max_batch_size", str(e.max_batch_size),
        "--max_input_len", str(engine_max_input_len(recipe)),
        "--max_seq_len", str(e.max_seq_len),
    ]  # fmt: skip
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
        del flags[at:at + 2]
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


def build_engine_recipe(recipe: Recipe, layout: Layout, force: bool = False, dry_run: bool = False, echo=print,
                        run_preflight=None) -> list[Path]:  # fmt: skip
    """`specdeploy build` for backend trtllm-engine: draft then target engine, each atomically with a manifest.

    A failed build leaves the earlier engine of that role in place and raises BuildError with the tool's last lines.
    `run_preflight(gpus)` returns the pre-flight findings (backend_stages.GpuStages.build hands it in).
    """
    gpus = gpu_probe.probe()
    findings = run_preflight(gpus) if run_preflight else []
    if dry_run:
        steps = plan_engine_build(recipe, layout, gpus, must_exist=False)
        echo(f"# dry run: {TOOL} commands for recipe {recipe.name} ({gpu_probe.describe(gpus)}); nothing is written")
        for f in findings:
            echo(f"# preflight {f.line()}")
        for step in steps:
            src = "" if step.checkpoint.present else "  # checkpoint not written yet: tp/pp taken from the recipe"
            echo(f"# {step.role}: tp {step.checkpoint.tp_size} x pp {step.checkpoint.pp_size}{src}")
            echo(step.command_line)
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
        outputs.append(step.output_dir)
    return outputs


# ---------------------------------------------------------------- LLM API (PyTorch backend)

# The LLM-API option names and meanings per TensorRT-LLM release. Each fact is from
# tensorrt_llm/llmapi/llm_args.py (DecodingBaseConfig, DraftTargetDecodingConfig) at the commits around the
# changes, and from docs/source/features/speculative-decoding.md:
# - decoding_type: until the speculative configs became a pydantic union discriminated by a `decoding_type:
#   Literal["Draft_Target"]` field, DecodingBaseConfig.from_dict dispatched on a table keyed "DraftTarget" (the
#   class attribute "Draft_Target" was not a key there: "Invalid decoding type"). After it, "Draft_Target" is the
#   literal and "DraftTarget" a documented alias (the docs' YAML list of decoding types).
# - the draft model: `speculative_model_dir` until PR #10099 (2025-12-18) renamed it `speculative_model`, keeping
#   `speculative_model_dir` as a validation alias (AliasChoices); before it, `speculative_model` is an unknown key
#   of a StrictBaseModel (rejected).
# - max_concurrency: "speculation will be disabled at batch sizes above this value" (same meaning throughout).
# - draft_len_schedule: added by PR #8194 (Oct 2025) with LOWER-bound keys ({1: 4, 4: 2, 8: 0}: batch >= 1 drafts
#   4, >= 4 drafts 2, >= 8 drafts 0; key 1 required and == max_draft_len); PR #10860 (Jan 2026) made the keys
#   UPPER bounds ({4: 4, 8: 2, 32: 1}: batch 1-4 drafts 4, 5-8 drafts 2, 9-32 drafts 1, 33+ off; smallest key
#   == max_draft_len; mutually exclusive with max_concurrency).
# - acceptance gate (speculation off for good once a rolling mean drops below a threshold):
#   `acceptance_window` + `acceptance_length_threshold` (mean acceptance LENGTH over the last N completed
#   requests) until PR #12905 (2026-04-09, "BREAKING"), then `acceptance_rate_window_size` +
#   `acceptance_rate_threshold` (accepted_draft_tokens / drafted_tokens over the last N speculative iterations,
#   0..1).
# - EAGLE-3 (draft.kind eagle3), read in each release's own llm_args.py as its documentation publishes it
#   (NVIDIA/TensorRT-LLM gh-pages `<release>/_modules/tensorrt_llm/llmapi/llm_args.html`, Sphinx viewcode: the
#   release's source without line numbers, so classes and fields are cited by name) and API reference pages:
#   1.1.0 (@8660c11): EagleDecodingConfig with `decoding_type: ClassVar[str] = "Eagle"`, fields
#     `eagle3_one_model: Optional[bool] = True`, `eagle3_layers_to_capture: Optional[Set[int]] = None`;
#     validate() reads `speculative_model_dir`; no Eagle3DecodingConfig.
#   1.2.0 (@7e873e5): the same EagleDecodingConfig fields (plus eagle3_model_arch); DecodingBaseConfig.from_dict
#     dispatches "Eagle" -> EagleDecodingConfig (no "Eagle3" key; "DraftTarget", "NGram" as above);
#     `speculative_model` with validation_alias AliasChoices("speculative_model", "speculative_model_dir").
#     On the PyTorch backend decoding_type Eagle IS EAGLE-3 (spec_dec_mode EAGLE3_ONE_MODEL / EAGLE3).
#   PR #10124 (merged 2025-12-18, after the 1.2 branch) added `decoding_type: Eagle3` and deprecated Eagle there.
#   1.3.0rc27 and 1.4.0rc1 (API pages llm-api/reference/Eagle3DecodingConfig.html): `decoding_type:
#     Literal['Eagle3']`, `speculative_model`, `max_draft_len`, `eagle3_layers_to_capture: Set[int] | None`; neither
#     page lists `eagle3_one_model` (main's llm_args.py still has it, default True, "Eagle3 2-model is deprecated and
#     will be removed in release 1.4"), so specdeploy leaves it out there: the default is the one-model path.
#   eagle3_layers_to_capture means "Target model layer indices to capture hidden states from ... Defaults to {1,
#   num_layers//2-1, num_layers-4}" in every one of them: the convention of ModelOpt's exported
#   `eagle_aux_hidden_state_layer_ids`, written through unchanged when the head's config.json names them.
# Release lines from PyPI upload dates: 1.1.0 2025-12-19, 1.2.0 2026-03-12 (branch: rc6 2025-12-23),
# 1.3.0rc0 2026-01-22 ... rc22 2026-07-22, 1.4.0rc0 2026-10-13. The 1.3.0 release candidates before rc22 straddle
# PRs #10860 and #12905, so specdeploy names no options for them rather than guess.


@dataclass(frozen=True)
class LlmApiVersion:
    """How one TensorRT-LLM release spells draft/target speculative decoding in the LLM-API options."""

    name: str
    releases: str  # which releases this covers, in words
    decoding_types: dict  # draft kind ("draft_target", "ngram", "eagle3") -> decoding_type value
    draft_model_key: str  # speculative_model_dir | speculative_model (the EAGLE-3 head's key too)
    draft_len_schedule: str | None  # None (no such option verified) | "lower" | "upper" bounds
    acceptance_keys: tuple[str, str] | None  # (window key, threshold key)
    acceptance_measure: str | None  # "length" | "rate": what the threshold means in this release
    evidence: str
    eagle3_fields: tuple[str, ...] = ()  # EAGLE-3 fields verified in this release's llm_args.py (beyond max_draft_len)
    eagle3_evidence: str = ""


LLMAPI_VERSIONS = {
    "1.1": LlmApiVersion(
        name="1.1", releases="1.1.x",
        decoding_types={"draft_target": "DraftTarget", "ngram": "NGram", "eagle3": "Eagle"},
        draft_model_key="speculative_model_dir",
        draft_len_schedule=None,
        # 1.1.0's own llm_args.py (release docs, gh-pages 1.1.0/_modules/tensorrt_llm/llmapi/llm_args.html @8660c11):
        # DecodingBaseConfig holds max_draft_len, speculative_model_dir, max_concurrency, load_format only (a
        # StrictBaseModel: other keys are rejected), so 1.1 has neither draft_len_schedule nor an acceptance gate.
        acceptance_keys=None, acceptance_measure=None,
        evidence="1.1.0 llm_args.py: from_dict keyed 'DraftTarget'/'NGram'/'Eagle'; speculative_model_dir; "
                 "no draft_len_schedule, no acceptance gate",
        eagle3_fields=("eagle3_one_model", "eagle3_layers_to_capture"),
        eagle3_evidence="1.1.0 llm_args.py (release docs, gh-pages @8660c11): EagleDecodingConfig 'Eagle', "
                        "eagle3_one_model, eagle3_layers_to_capture, speculative_model_dir",
    ),
    "1.2": LlmApiVersion(
        name="1.2", releases="1.2.x",
        # DraftTarget and speculative_model_dir are read on both sides of the Literal/rename changes, which the
        # 1.2 branch (cut around Dec 2025) may or may not carry.
        decoding_types={"draft_target": "DraftTarget", "ngram": "NGram", "eagle3": "Eagle"},
        draft_model_key="speculative_model_dir",
        draft_len_schedule="lower",
        acceptance_keys=("acceptance_window", "acceptance_length_threshold"), acceptance_measure="length",
        evidence="PR #8194 (lower-bound draft_len_schedule) before the branch, PR #10860 and #12905 after it",
        eagle3_fields=("eagle3_one_model", "eagle3_layers_to_capture"),
        eagle3_evidence="1.2.0 llm_args.py (release docs, gh-pages @7e873e5): from_dict 'Eagle' -> "
                        "EagleDecodingConfig, eagle3_one_model, eagle3_layers_to_capture, speculative_model_dir alias",
    ),
    "1.3": LlmApiVersion(
        name="1.3", releases="1.3.0rc22 and later 1.3 releases",
        decoding_types={"draft_target": "Draft_Target", "ngram": "NGram", "eagle3": "Eagle3"},
        draft_model_key="speculative_model",
        draft_len_schedule="upper",
        acceptance_keys=("acceptance_rate_window_size", "acceptance_rate_threshold"), acceptance_measure="rate",
        evidence="decoding_type Literal['Draft_Target']; PR #10099, #10860 and #12905 merged",
        eagle3_fields=("eagle3_layers_to_capture",),
        eagle3_evidence="1.3.0rc27 API page Eagle3DecodingConfig: Literal['Eagle3'], speculative_model, "
                        "eagle3_layers_to_capture (no eagle3_one_model listed)",
    ),
    "1.4": LlmApiVersion(
        name="1.4", releases="1.4.x",
        decoding_types={"draft_target": "Draft_Target", "ngram": "NGram", "eagle3": "Eagle3"},
        draft_model_key="speculative_model",
        draft_len_schedule="upper",
        acceptance_keys=("acceptance_rate_window_size", "acceptance_rate_threshold"), acceptance_measure="rate",
        evidence="as 1.3 (main after PR #12905)",
        eagle3_fields=("eagle3_layers_to_capture",),
        eagle3_evidence="1.4.0rc1 API page Eagle3DecodingConfig: Literal['Eagle3'], speculative_model, "
                        "eagle3_layers_to_capture (no eagle3_one_model listed)",
    ),
}  # fmt: skip


# The first release candidate of a line whose option names LLMAPI_VERSIONS describes (earlier ones are refused here
# and by the image's version gate, packaging.dockerfile).
LLMAPI_MIN_RC = {"1.3": 22}


def llmapi_version(version: str) -> LlmApiVersion:
    """The LlmApiVersion for a recipe's `trtllm_version` ("1.2", "1.2.1", "1.3.0rc24", "1.4.0rc1", ...)."""
    text = str(version).strip()
    m = re.fullmatch(r"(\d+)\.(\d+)(?:\.(\d+))?(?:rc(\d+))?(?:\.post\d+)?", text)
    supported = ", ".join(f"{v.name} ({v.releases})" for v in LLMAPI_VERSIONS.values())
    if m is None:
        raise ConfigError(f"key 'trtllm_version' is {version!r}, not a TensorRT-LLM version",
                          f"write it as on PyPI, e.g. 1.2.1; supported: {supported}")  # fmt: skip
    line = f"{m.group(1)}.{m.group(2)}"
    rc = m.group(4)
    if line in LLMAPI_MIN_RC and rc is not None and int(rc) < LLMAPI_MIN_RC[line]:
        raise ConfigError(
            f"trtllm_version {text}: the 1.3.0 release candidates before rc22 straddle TensorRT-LLM PR #10860 "
            "(draft_len_schedule keys became upper bounds) and PR #12905 (acceptance gate renamed and redefined); "
            "specdeploy cannot tell which option names this one takes",
            "use a 1.2.x release (trtllm_version: 1.2) or 1.3.0rc22 or later (trtllm_version: 1.3)",
        )
    if line not in LLMAPI_VERSIONS:
        hint = "TensorRT-LLM 1.0 and older: use backend trtllm-engine" if (int(m.group(1)), int(m.group(2))) < (1, 1) \
            else "a newer release may rename options again; add it to trtllm.LLMAPI_VERSIONS after checking llm_args.py"
        raise ConfigError(f"trtllm_version {text} has no verified LLM-API option names (supported: {supported})", hint)
    return LLMAPI_VERSIONS[line]


def _draft_len_schedule(schedule: tuple, form: str) -> dict[int, int]:
    """specdeploy's [[up_to_batch, draft_len], ...] (speculation off above the last bound) in a release's form.

    upper: {up_to_batch: draft_len} as is (batch sizes above the largest key draft 0).
    lower: {from_batch: draft_len}: the first entry starts at batch 1, each next one at the previous bound + 1,
    and one more entry turns speculation off (0) above the last bound.
    """
    if form == "upper":
        return {int(bound): int(length) for bound, length in schedule}
    out, start = {}, 1
    for bound, length in schedule:
        out[start] = int(length)
        start = int(bound) + 1
    out[start] = 0
    return out


# ---------------------------------------------------------------- EAGLE-3 heads (draft.kind eagle3)

EAGLE3_WEIGHTS = ("*.safetensors", "*.bin")  # the published heads ship pytorch_model.bin, ModelOpt exports safetensors


def eagle3_head_source(recipe: Recipe, layout: Layout) -> Path:
    """The recipe's EAGLE-3 head folder (Layout.eagle3_head_source: trained, bundled or a path)."""
    return layout.eagle3_head_source(recipe.draft.head)


def read_eagle3_head_config(head_dir: Path) -> dict | None:
    """The head's config.json, or None when the folder is not on this machine (a dry run before the download)."""
    path = Path(head_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}", "re-download or re-export the EAGLE-3 head") from exc


def eagle3_aux_layers(head_config: dict | None) -> list[int] | None:
    """The target layers whose OUTPUTS the head reads (TensorRT-LLM's `eagle3_layers_to_capture` convention, whose
    default {1, L//2-1, L-4} is ModelOpt's), from the head's config.json; None: the consumer's default.

    Two conventions name them. ModelOpt's export nests `eagle_config.eagle_aux_hidden_state_layer_ids` and hooks
    the outputs of those layers (modelopt/torch/speculative/plugins/hf_eagle.py: `register_forward_hook` on
    `layers[i]` for i in the ids). vLLM and llama.cpp read a top-level `eagle_aux_hidden_state_layer_ids` as the
    stream ENTERING layer i (vLLM model_executor/models/llama.py LlamaModel.forward appends `hidden_states +
    residual` before running layer idx; llama.cpp `extract_layer_inputs`), i.e. the output of layer i - 1.
    The nested ids win; top-level ones are shifted by one."""
    if not head_config:
        return None
    nested = (head_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return sorted(int(i) for i in nested)
    entering = head_config.get("eagle_aux_hidden_state_layer_ids")
    return sorted(int(i) - 1 for i in entering) if entering else None


def _eagle3_options(recipe: Recipe, version: LlmApiVersion, head_dir: Path, head_config: dict | None) -> dict:
    """Eagle3DecodingConfig (EagleDecodingConfig before 1.3) for one release; only fields verified there."""
    d, s = recipe.draft, recipe.speculative
    draft_len = d.max_draft_len if d.max_draft_len is not None else s.num_draft_tokens
    if s.dynamic and s.dynamic.draft_len_schedule and draft_len != s.num_draft_tokens:
        raise ConfigError(
            f"draft.max_draft_len ({draft_len}) differs from speculative.num_draft_tokens ({s.num_draft_tokens}), but "
            "TensorRT-LLM requires the draft_len_schedule's first entry to equal speculative_config.max_draft_len",
            "drop draft.max_draft_len (it defaults to num_draft_tokens) or drop the schedule",
        )
    spec = {"decoding_type": version.decoding_types["eagle3"], "max_draft_len": draft_len,
            version.draft_model_key: str(head_dir)}  # fmt: skip
    if "eagle3_one_model" in version.eagle3_fields:
        spec["eagle3_one_model"] = True  # the draft runs inside the target's engine (the default; two-model is deprecated)
    layers = eagle3_aux_layers(head_config)
    if layers:
        if "eagle3_layers_to_capture" not in version.eagle3_fields:
            raise ConfigError(f"the EAGLE-3 head reads target layers {layers}, but eagle3_layers_to_capture is not "
                              f"verified for TensorRT-LLM {version.name}", "use trtllm_version 1.1 or later")  # fmt: skip
        spec["eagle3_layers_to_capture"] = layers
    return spec


def speculative_options(recipe: Recipe, version: LlmApiVersion, draft_dir: Path, kind: str = "draft_target",
                        head_config: dict | None = None) -> dict:
    """`speculative_config` for one TensorRT-LLM release. Every recipe setting is mapped or refused, never dropped.

    - speculative.num_draft_tokens -> max_draft_len: the LLM API drafts max_draft_len tokens every iteration (it
      has no separate per-request count), so the tokens drafted per round set it; speculative.max_draft_len only
      bounds num_draft_tokens (there is no engine to build it into).
    - speculative.use_draft_logits -> refused: DraftTarget verifies greedy requests token by token and has no
      switch for rejection sampling on the draft's logits.
    """
    s = recipe.speculative
    if s.use_draft_logits:
        raise ConfigError(
            f"speculative.use_draft_logits is true, but TensorRT-LLM {version.name}'s LLM API (decoding_type "
            f"{version.decoding_types[kind]}) has no option for rejection sampling on the draft's logits",
            "set use_draft_logits: false for backend trtllm-llmapi, or use backend trtllm-engine (its BLS passes "
            "draft_logits)",
        )
    spec = {
        "decoding_type": version.decoding_types[kind],
        "max_draft_len": s.num_draft_tokens,
        version.draft_model_key: str(draft_dir),
    }
    if kind == "eagle3":  # draft_dir is the head folder; head_config its config.json (None: not on this machine)
        spec = _eagle3_options(recipe, version, draft_dir, head_config)
    if kind == "ngram":  # NGramDecodingConfig: no draft model; the recipe's draft section carries its fields
        from specdeploy.ngram import TRTLLM_FIELDS, settings_from_recipe

        settings = settings_from_recipe(recipe)
        spec = {"decoding_type": version.decoding_types[kind], **{f: getattr(settings, f) for f in TRTLLM_FIELDS}}
    d = s.dynamic
    if d is None:
        return spec
    if d.max_concurrency is not None:
        spec["max_concurrency"] = d.max_concurrency
    if d.draft_len_schedule:
        if version.draft_len_schedule is None:
            raise ConfigError(
                f"speculative.dynamic.draft_len_schedule is set, but draft_len_schedule is not verified for "
                f"TensorRT-LLM {version.name} ({version.evidence})",
                "use max_concurrency instead, or target trtllm_version 1.2 or later",
            )
        spec["draft_len_schedule"] = _draft_len_schedule(d.draft_len_schedule, version.draft_len_schedule)
    if d.acceptance_window is not None:
        if version.acceptance_keys is None:
            raise ConfigError(f"TensorRT-LLM {version.name} has no acceptance gate",
                              "remove speculative.dynamic.acceptance_window/threshold")  # fmt: skip
        if d.acceptance_measure != version.acceptance_measure:
            words = {"rate": "acceptance rate (accepted / drafted tokens, 0..1) over speculative iterations",
                     "length": "mean acceptance length (tokens per step) over completed requests"}  # fmt: skip
            raise ConfigError(
                f"speculative.dynamic.acceptance_measure is '{d.acceptance_measure}', but TensorRT-LLM {version.name} "
                f"gates on the {words[version.acceptance_measure]} ({version.acceptance_keys[1]}); the two do not "
                "convert into each other",
                f"set acceptance_measure: {version.acceptance_measure} and a threshold in those units, or change "
                "trtllm_version",
            )
        window_key, threshold_key = version.acceptance_keys
        spec[window_key] = d.acceptance_window
        spec[threshold_key] = d.acceptance_threshold
    return spec


def llmapi_options(recipe: Recipe, layout: Layout, version: LlmApiVersion | None = None, draft_dir: Path | None = None) -> dict:
    """The LLM-API options (keys of tensorrt_llm.llmapi LLM args) for draft/target speculative decoding.

    Names follow the recipe's trtllm_version (LLMAPI_VERSIONS). Top-level keys, stable across the supported
    releases (llm_args.py): `kv_cache_config.{free_gpu_memory_fraction, enable_block_reuse, dtype}`,
    `max_batch_size`, `max_input_len`, `max_seq_len`, `tensor_parallel_size`, `pipeline_parallel_size`. The
    quick start runs Draft/Target with `disable_overlap_scheduler=True`. `draft_dir`: the draft model (default: the
    draft checkpoint; the cpu backend's llmapi layout names the draft engine).
    """
    version = version or llmapi_version(recipe.trtllm_version)
    target, e = recipe.target, recipe.engine
    kv_dtype = target.quantization.kv_cache_dtype
    return {
        "tensor_parallel_size": target.tp_size,
        "pipeline_parallel_size": target.pp_size,
        "max_batch_size": e.max_batch_size,
        "max_input_len": engine_max_input_len(recipe),  # the speculative flow resends prompt + output
        "max_seq_len": e.max_seq_len,
        "disable_overlap_scheduler": True,
        "kv_cache_config": {
            "free_gpu_memory_fraction": e.kv_cache_free_gpu_mem_fraction,
            # NVIDIA's own DraftTarget tests run with block reuse off, before and after the speculative_model
            # rename (NVIDIA/TensorRT-LLM@104ead7 tests/unittest/_torch/speculative/test_draft_target.py:30 and
            # @00c1146 tests/unittest/_torch/speculative/hw_agnostic/test_draft_target.py:45 and its rejection test:
            # `KvCacheConfig(enable_block_reuse=False...)`); no NVIDIA source shows reuse safe with a draft model.
            "enable_block_reuse": False,
            "dtype": kv_dtype if kv_dtype == "fp8" else "auto",
        },
        "speculative_config": _speculative_config(recipe, layout, version, draft_dir),
    }


def _speculative_config(recipe: Recipe, layout: Layout, version: LlmApiVersion, draft_dir: Path | None) -> dict:
    d = recipe.draft
    if d.is_eagle3:
        # the build stages the head in the deployment (engines/<recipe>/draft, under the project root that the
        # container and the Kubernetes volume mount at the same path): speculative_model points there
        head_config = read_eagle3_head_config(eagle3_head_source(recipe, layout))
        return speculative_options(recipe, version, draft_dir or layout.engine("draft"), "eagle3", head_config)
    return speculative_options(recipe, version, draft_dir or layout.checkpoint("draft"),
                               "ngram" if d.is_ngram else "draft_target")


def llmapi_mapping_notes(recipe: Recipe, version: LlmApiVersion | None = None) -> list[str]:
    """What the options file does with the recipe's speculative settings, for the dry run and the manifest."""
    version = version or llmapi_version(recipe.trtllm_version)
    s = recipe.speculative
    kind = "eagle3" if recipe.draft.is_eagle3 else ("ngram" if recipe.draft.is_ngram else "draft_target")
    notes = [f"TensorRT-LLM {version.name} ({version.releases}): decoding_type {version.decoding_types[kind]}, "
             f"draft model key {version.draft_model_key}",
             f"speculative.num_draft_tokens {s.num_draft_tokens} -> speculative_config.max_draft_len (drafted every "
             f"iteration); speculative.max_draft_len {s.max_draft_len} only bounds it"]  # fmt: skip
    if s.dynamic and s.dynamic.draft_len_schedule:
        notes.append(f"draft_len_schedule written with {version.draft_len_schedule}-bound keys")
    # The names come from llm_args.py on TensorRT-LLM's main branch around the renames (LLMAPI_VERSIONS), not from
    # each release's tag, which could not be read here; the build's start check (LLM(...)) is what confirms them.
    notes.append(f"names read on TensorRT-LLM main around the renames, not from the {version.name} release's tag: "
                 "the build's LLM(...) start check on the GPU machine confirms them")
    if kind == "eagle3":
        fields = ", ".join(version.eagle3_fields) or "none"
        notes.append(f"EAGLE-3 fields verified for {version.name}: max_draft_len, {version.draft_model_key}, {fields} "
                     f"({version.eagle3_evidence}); the head is staged in the deployment and speculative_model points there")
    return notes


def check_hf_checkpoint(ckpt_dir: Path, role: str, qformat: str) -> None:
    """The LLM API loads Hugging Face-format checkpoints (ModelOpt `export_hf_checkpoint`), not TRT-LLM ones."""
    config_path = Path(ckpt_dir) / "config.json"
    if not config_path.is_file():
        raise StaleArtifactError(f"{ckpt_dir} has no {role} checkpoint (no config.json)", "run: specdeploy quantize <recipe>")
    config = json.loads(config_path.read_text())
    if "mapping" in config and "architectures" not in config:
        raise StaleArtifactError(
            f"{ckpt_dir} is a TensorRT-LLM checkpoint; backend trtllm-llmapi loads Hugging Face-format checkpoints",
            "re-run specdeploy quantize for backend trtllm-llmapi (ModelOpt export_hf_checkpoint output)",
        )
    quantized = (Path(ckpt_dir) / "hf_quant_config.json").is_file() or "quantization_config" in config
    if qformat != "full_prec" and not quantized:
        raise StaleArtifactError(
            f"{ckpt_dir} has no hf_quant_config.json / quantization_config but the recipe asks for {qformat}",
            "re-run: specdeploy quantize <recipe> --force",
        )


def llmapi_fingerprint(recipe: Recipe, options: dict, checkpoint_fps: dict) -> str:
    return fingerprint(backend="trtllm-llmapi", options=options, checkpoints=checkpoint_fps)


def serve_command(options_path: Path, target_dir: Path, port: int = 8000) -> list[str]:
    """The equivalent `trtllm-serve` command (OpenAI-compatible server) for the same options file.

    `--extra_llm_api_options` is called `--config` in newer releases (both accepted there).
    """
    return ["trtllm-serve", str(target_dir), "--backend", "pytorch", "--port", str(port),
            "--extra_llm_api_options", str(options_path)]  # fmt: skip


def build_llmapi_recipe(
    recipe: Recipe, layout: Layout, force: bool = False, dry_run: bool = False, echo=print, prove: bool = True,
    run_preflight=None,
) -> list[Path]:
    """`specdeploy build` for backend trtllm-llmapi: write the options YAML (no engine) and, when TensorRT-LLM is
    importable on a GPU machine, load it once with LLM(...) to prove it starts."""
    version = llmapi_version(recipe.trtllm_version)
    options = llmapi_options(recipe, layout, version)
    out = layout.engine("target")
    text = yaml.safe_dump(options, sort_keys=False)
    findings = run_preflight(gpu_probe.probe()) if run_preflight else []  # as in build_engine_recipe
    installed = gpu_probe.tensorrt_llm_version()
    if installed is not None and not installed.startswith(version.name):
        echo(f"warning: tensorrt_llm {installed} is installed, the recipe targets trtllm_version {recipe.trtllm_version}; "
             f"the options use {version.name}'s names (set trtllm_version to match the release that will serve)")
    if dry_run:
        for f in findings:
            echo(f"# preflight {f.line()}")
        for note in llmapi_mapping_notes(recipe, version):
            echo(f"# {note}")
        echo(f"# dry run: {out / LLMAPI_OPTIONS} would contain:")
        echo(text.rstrip())
        echo("# equivalent server: " + shlex.join(serve_command(out / LLMAPI_OPTIONS, layout.checkpoint("target"))))
        return []
    checkpoint_fps = {}
    for role in recipe.model_roles:  # an n-gram draft has no checkpoint
        manifest = require(layout.checkpoint(role), "quantize", "specdeploy quantize <recipe>")
        check_hf_checkpoint(layout.checkpoint(role), role, recipe.model(role).quantization.qformat)
        checkpoint_fps[role] = manifest.fingerprint
    head = None
    if recipe.draft.is_eagle3:  # the head is an input of the deployment like a checkpoint
        head = eagle3_head_source(recipe, layout)
        check_eagle3_head_files(head, recipe)
        checkpoint_fps["eagle3_head"] = dir_hash(head)
    fp = llmapi_fingerprint(recipe, options, checkpoint_fps)
    if not force and is_up_to_date(out, fp) and is_up_to_date(layout.engine("draft"), fp):
        echo(f"LLM-API options are up to date: {out / LLMAPI_OPTIONS}")
        return [out]
    proof = prove_llmapi_starts(layout.checkpoint("target"), options, echo) if prove else "skipped (--no-prove)"
    gpus = [g.summary() for g in gpu_probe.probe()] or ["no GPU seen by nvidia-smi/torch"]
    # The draft has no artifact of its own (the target's speculative_config loads it); its manifest says so
    # and lets later stages treat both roles alike.
    draft_out = layout.engine("draft")
    with atomic_output(draft_out) as tmp:
        extra = {"checkpoint_dir": str(layout.checkpoint("draft")), "tokenizer_dir": str(layout.checkpoint("draft")),
                 "note": f"loaded by speculative_config in {out / LLMAPI_OPTIONS}"}  # fmt: skip
        if head is not None:
            # kind eagle3: the head folder itself, so that it travels with the project root (docker -v root:root,
            # the Kubernetes volume) and speculative_model names a path that exists inside the container too
            echo(f"staging the EAGLE-3 head {head} -> {draft_out}")
            _copy_head(head, tmp)
            extra = {"head_source": str(head), "tokenizer_dir": str(layout.checkpoint("target")),
                     "note": f"the EAGLE-3 head speculative_config in {out / LLMAPI_OPTIONS} loads"}
        Manifest(
            stage=BUILD_STAGE,
            recipe_name=recipe.name,
            fingerprint=fp,
            settings={"backend": "trtllm-llmapi", "role": "draft", "kind": recipe.draft.kind},
            inputs={"checkpoint": checkpoint_fps.get("draft"), "eagle3_head": checkpoint_fps.get("eagle3_head")},
            tool_versions=tool_versions("tensorrt_llm"),
            extra=extra,
        ).write(tmp)
    with atomic_output(out) as tmp:
        (tmp / LLMAPI_OPTIONS).write_text(text)
        Manifest(
            stage=BUILD_STAGE,
            recipe_name=recipe.name,
            fingerprint=fp,
            settings={"backend": "trtllm-llmapi", "role": "target", "trtllm_version": recipe.trtllm_version,
                      "max_draft_len": recipe.speculative.max_draft_len,
                      "max_input_len": recipe.engine.max_input_len, "max_seq_len": recipe.engine.max_seq_len},
            inputs=checkpoint_fps,
            tool_versions=tool_versions("tensorrt_llm"),
            extra={
                "checkpoint_dir": str(layout.checkpoint("target")),
                "tokenizer_dir": str(layout.checkpoint("target")),
                "options_file": LLMAPI_OPTIONS,
                "serve_command": shlex.join(serve_command(out / LLMAPI_OPTIONS, layout.checkpoint("target"))),
                "gpus": gpus,
                "start_check": proof,
                "mapping": llmapi_mapping_notes(recipe, version),
            },
        ).write(tmp)
    echo(f"wrote {out / LLMAPI_OPTIONS} (start check: {proof})")
    return [out, draft_out]


def check_eagle3_head_files(head: Path, recipe: Recipe) -> None:
    """The head folder a deployment needs: config.json and its weights (what TensorRT-LLM loads)."""
    trained = recipe.draft.head == EAGLE3_HEAD_TRAINED
    fix = ("run: specdeploy draft train <recipe> (it writes the head there)" if trained else
           "download the head, e.g. huggingface-cli download yuhuili/EAGLE3-LLaMA3.1-Instruct-8B --local-dir <folder>, "
           "and set draft.head to that folder")  # fmt: skip
    if not (Path(head) / "config.json").is_file():
        raise StaleArtifactError(f"the EAGLE-3 head {head} has no config.json (draft.head: {recipe.draft.head})", fix)
    if not any(p for pattern in EAGLE3_WEIGHTS for p in Path(head).glob(pattern)):
        raise StaleArtifactError(f"the EAGLE-3 head {head} has no weights (*.safetensors or *.bin)", fix)


def _copy_head(head: Path, dest: Path) -> None:
    """The head's files into `dest`: copies, not hard links, so that editing the source in place cannot change
    a built deployment behind its manifest (an 8B head is ~1.6 GB)."""
    for src in sorted(Path(head).iterdir()):
        if src.is_file() and src.name != MANIFEST:
            shutil.copy2(src, dest / src.name)


def prove_llmapi_starts(target_dir: Path, options: dict, echo=print) -> str:
    """Load the options once with LLM(...) and generate a few tokens; says why when it cannot run here."""
    if gpu_probe.tensorrt_llm_version() is None:
        return "not run: tensorrt_llm is not installed"
    if not gpu_probe.probe():
        return "not run: no GPU"
    try:
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict
    except ImportError as exc:
        return f"not run: cannot import tensorrt_llm ({exc})"
    echo("loading the LLM-API deployment once to prove it starts ...")
    args = update_llm_args_with_extra_dict({"model": str(target_dir), "backend": "pytorch"}, options)
    try:
        llm = LLM(**args)
        try:
            out = llm.generate(["Hello"], SamplingParams(max_tokens=4))
            return f"started; generated {len(out[0].outputs[0].token_ids)} tokens"
        finally:
            llm.shutdown()
    except Exception as exc:  # noqa: BLE001 - any start failure is reported as a BuildError with its cause
        raise BuildError(
            f"TensorRT-LLM could not start the draft/target deployment: {exc}",
            "check GPU memory (kv_cache_free_gpu_mem_fraction) and that the checkpoints are ModelOpt HF exports",
        ) from exc
