"""GPU backends: TensorRT engines with `trtllm-build`, or an LLM-API (PyTorch backend) options file.

`trtllm-engine` (TensorRT-LLM releases that still ship `trtllm-build`, <= 1.1) builds one engine
per role from the quantized TensorRT-LLM checkpoints; `trtllm-llmapi` (current TensorRT-LLM) has no
engine file and instead writes the options `LLM(...)`, `trtllm-serve` and Triton's llmapi model
read. Flags and keys are TensorRT-LLM's own; each is cited where it is used.

On this (GPU-less) machine the code runs through `--dry-run`, golden tests and a recording
stand-in `trtllm-build` on PATH; it never pretends a GPU result.

The parts, one module each: `trtllm_engine` (trtllm-build: checkpoints, command lines, running the tool),
`llmapi_versions` (each release's option names), `llmapi_options` (the recipe as LLM-API options). This module
builds for trtllm-llmapi (options file, staged EAGLE-3 head, the start check) and keeps the parts' names importable.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import yaml

from specdeploy.core import gpus as gpu_probe
from specdeploy.core.artifacts import (
    MANIFEST,
    Layout,
    Manifest,
    atomic_output,
    fingerprint,
    head_hash,
    is_up_to_date,
    require,
    tool_versions,
)
from specdeploy.core.errors import BuildError, StaleArtifactError

# The parts, one module each; the names other modules and the tests use stay importable from here.
from specdeploy.gpu.llmapi_options import eagle3_head_source, llmapi_mapping_notes, llmapi_options
from specdeploy.gpu.llmapi_versions import LlmApiVersion, llmapi_version
from specdeploy.gpu.trtllm_build import BUILD_STAGE
from specdeploy.recipe.config import EAGLE3_HEAD_TRAINED, Recipe

LLMAPI_OPTIONS = "extra_llm_api_options.yaml"
EAGLE3_WEIGHTS = ("*.safetensors", "*.bin")  # the published heads ship pytorch_model.bin, ModelOpt exports safetensors


def check_hf_checkpoint(ckpt_dir: Path, role: str, qformat: str) -> None:
    """The LLM API loads Hugging Face-format checkpoints (ModelOpt `export_hf_checkpoint`), not TRT-LLM ones."""
    config_path = Path(ckpt_dir) / "config.json"
    if not config_path.is_file():
        raise StaleArtifactError(
            f"{ckpt_dir} has no {role} checkpoint (no config.json)", "run: specdeploy quantize <recipe>"
        )
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
    return [
        "trtllm-serve",
        str(target_dir),
        "--backend",
        "pytorch",
        "--port",
        str(port),
        "--extra_llm_api_options",
        str(options_path),
    ]


def build_llmapi_recipe(
    recipe: Recipe,
    layout: Layout,
    force: bool = False,
    dry_run: bool = False,
    echo=print,
    prove: bool = True,
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
        echo(
            f"warning: tensorrt_llm {installed} is installed, the recipe targets trtllm_version"
            f" {recipe.trtllm_version}; the options use {version.name}'s names (set trtllm_version to match the release"
            " that will serve)"
        )
    if dry_run:
        _echo_dry_run(recipe, layout, version, text, findings, echo)
        return []
    checkpoint_fps, head = _llmapi_inputs(recipe, layout)
    fp = llmapi_fingerprint(recipe, options, checkpoint_fps)
    if not force and is_up_to_date(out, fp) and is_up_to_date(layout.engine("draft"), fp):
        echo(f"LLM-API options are up to date: {out / LLMAPI_OPTIONS}")
        return [out]
    proof = prove_llmapi_starts(layout.checkpoint("target"), options, echo) if prove else "skipped (--no-prove)"
    gpus = [g.summary() for g in gpu_probe.probe()] or ["no GPU seen by nvidia-smi/torch"]
    draft_out = layout.engine("draft")  # has no artifact of its own: its manifest says so (_write_draft)
    _write_draft(recipe, layout, fp, checkpoint_fps, head, echo)
    _write_target(recipe, layout, version, text, fp, checkpoint_fps, gpus, proof)
    echo(f"wrote {out / LLMAPI_OPTIONS} (start check: {proof})")
    return [out, draft_out]


def _echo_dry_run(recipe: Recipe, layout: Layout, version: LlmApiVersion, text: str, findings, echo) -> None:
    out = layout.engine("target")
    for f in findings:
        echo(f"# preflight {f.line()}")
    for note in llmapi_mapping_notes(recipe, version):
        echo(f"# {note}")
    echo(f"# dry run: {out / LLMAPI_OPTIONS} would contain:")
    echo(text.rstrip())
    echo("# equivalent server: " + shlex.join(serve_command(out / LLMAPI_OPTIONS, layout.checkpoint("target"))))


def _llmapi_inputs(recipe: Recipe, layout: Layout) -> tuple[dict, Path | None]:
    """(the fingerprints of the checkpoints and of the EAGLE-3 head, the head folder or None), each checked."""
    checkpoint_fps = {}
    for role in recipe.model_roles:  # an n-gram draft has no checkpoint
        manifest = require(layout.checkpoint(role), "quantize", "specdeploy quantize <recipe>")
        check_hf_checkpoint(layout.checkpoint(role), role, recipe.model(role).quantization.qformat)
        checkpoint_fps[role] = manifest.fingerprint
    head = None
    if recipe.draft.stages_head:  # the head (EAGLE-3, PARD, DFlash draft) is an input like a checkpoint
        head = eagle3_head_source(recipe, layout)
        check_eagle3_head_files(head, recipe)
        checkpoint_fps["eagle3_head"] = head_hash(head)
    return checkpoint_fps, head


def _write_draft(recipe: Recipe, layout: Layout, fp: str, checkpoint_fps: dict, head: Path | None, echo) -> None:
    """The draft has no artifact of its own (the target's speculative_config loads it); its manifest says so
    and lets later stages treat both roles alike. For draft.kind eagle3 the head is staged here."""
    out, draft_out = layout.engine("target"), layout.engine("draft")
    with atomic_output(draft_out) as tmp:
        extra = {
            "checkpoint_dir": str(layout.checkpoint("draft")),
            "tokenizer_dir": str(layout.checkpoint("draft")),
            "note": f"loaded by speculative_config in {out / LLMAPI_OPTIONS}",
        }
        if head is not None:
            # kind eagle3: the head folder itself, so that it travels with the project root (docker -v root:root,
            # the Kubernetes volume) and speculative_model names a path that exists inside the container too
            echo(f"staging the {recipe.draft.head_name} {head} -> {draft_out}")
            _copy_head(head, tmp)
            extra = {
                "head_source": str(head),
                "tokenizer_dir": str(layout.checkpoint("target")),
                "note": f"the {recipe.draft.head_name} speculative_config in {out / LLMAPI_OPTIONS} loads",
            }
        Manifest(
            stage=BUILD_STAGE,
            recipe_name=recipe.name,
            fingerprint=fp,
            settings={"backend": "trtllm-llmapi", "role": "draft", "kind": recipe.draft.kind},
            inputs={"checkpoint": checkpoint_fps.get("draft"), "eagle3_head": checkpoint_fps.get("eagle3_head")},
            tool_versions=tool_versions("tensorrt_llm"),
            extra=extra,
        ).write(tmp)


def _write_target(
    recipe: Recipe,
    layout: Layout,
    version: LlmApiVersion,
    text: str,
    fp: str,
    checkpoint_fps: dict,
    gpus: list[str],
    proof: str,
) -> None:
    """The target's folder: the options file and its manifest."""
    out = layout.engine("target")
    with atomic_output(out) as tmp:
        (tmp / LLMAPI_OPTIONS).write_text(text)
        Manifest(
            stage=BUILD_STAGE,
            recipe_name=recipe.name,
            fingerprint=fp,
            settings={
                "backend": "trtllm-llmapi",
                "role": "target",
                "trtllm_version": recipe.trtllm_version,
                "max_draft_len": recipe.speculative.max_draft_len,
                "max_input_len": recipe.engine.max_input_len,
                "max_seq_len": recipe.engine.max_seq_len,
            },
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


def check_eagle3_head_files(head: Path, recipe: Recipe) -> None:
    """The head folder a deployment needs: config.json and its weights (what TensorRT-LLM loads)."""
    trained = recipe.draft.head == EAGLE3_HEAD_TRAINED
    what = recipe.draft.head_name
    fix = (
        "run: specdeploy draft train <recipe> (it writes the head there)"
        if trained
        else (
            "download the head, e.g. huggingface-cli download yuhuili/EAGLE3-LLaMA3.1-Instruct-8B --local-dir <folder>,"
            " and set draft.head to that folder"
            if recipe.draft.is_eagle3
            else f"download the {what} and set draft.head to its folder"
        )
    )
    if not (Path(head) / "config.json").is_file():
        raise StaleArtifactError(f"the {what} {head} has no config.json (draft.head: {recipe.draft.head})", fix)
    if not any(p for pattern in EAGLE3_WEIGHTS for p in Path(head).glob(pattern)):
        raise StaleArtifactError(f"the {what} {head} has no weights (*.safetensors or *.bin)", fix)


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
