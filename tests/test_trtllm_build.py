"""trtllm-engine: exact trtllm-build command lines, and the build orchestration driven by a stand-in tool."""

from __future__ import annotations

from pathlib import Path

import pytest
from _trtllm_standin import install_standin, recorded, write_trtllm_checkpoint

from specdeploy.core.artifacts import Layout, Manifest
from specdeploy.core.errors import BuildError, StaleArtifactError
from specdeploy.gpu import trtllm, trtllm_build
from specdeploy.gpu.trtllm_build import CheckpointInfo, build_command
from specdeploy.recipe.load import parse_recipe


def make_recipe(target="t", draft="d", qformat="fp8", tp=1, use_logits=False, **engine):
    return parse_recipe(
        {
            "name": "gpu-test",
            "backend": "trtllm-engine",
            "target": {"model": str(target), "tp_size": tp, "quantization": {"qformat": qformat}},
            "draft": {"model": str(draft), "quantization": {"qformat": qformat}},
            "speculative": {"max_draft_len": 6, "num_draft_tokens": 4, "use_draft_logits": use_logits},
            "engine": {"max_batch_size": 4, "max_input_len": 1024, "max_seq_len": 2048, **engine},
        }
    )


COMMON = [
    "--kv_cache_type",
    "paged",
    "--use_paged_context_fmha",
    "enable",
    "--remove_input_padding",
    "enable",
    "--gpt_attention_plugin",
    "auto",
    "--gemm_plugin",
    "auto",
]
# max_input_len is max_seq_len - 1, not the recipe's 1024: the speculative BLS resends prompt + output every round
LIMITS = ["--max_batch_size", "4", "--max_input_len", "2047", "--max_seq_len", "2048"]


def io(role):
    return ["--checkpoint_dir", f"/c/{role}", "--output_dir", f"/e/{role}"]


GOLDEN = {
    # (qformat, tp, use_draft_logits, role) -> argv
    ("fp8", 1, False, "draft"): ["trtllm-build", *io("draft"), *LIMITS, *COMMON],
    ("fp8", 1, False, "target"): [
        "trtllm-build",
        *io("target"),
        *LIMITS,
        *COMMON,
        "--speculative_decoding_mode",
        "draft_tokens_external",
        "--max_draft_len",
        "6",
    ],
    ("int8_sq", 2, False, "target"): [
        "trtllm-build",
        *io("target"),
        *LIMITS,
        *COMMON,
        "--speculative_decoding_mode",
        "draft_tokens_external",
        "--max_draft_len",
        "6",
        "--workers",
        "2",
    ],
    ("int8_sq", 2, False, "draft"): ["trtllm-build", *io("draft"), *LIMITS, *COMMON],
    ("int4_awq", 1, True, "target"): [
        "trtllm-build",
        *io("target"),
        *LIMITS,
        *COMMON,
        "--speculative_decoding_mode",
        "draft_tokens_external",
        "--max_draft_len",
        "6",
        "--gather_generation_logits",
    ],
    ("int4_awq", 1, True, "draft"): ["trtllm-build", *io("draft"), *LIMITS, *COMMON, "--gather_generation_logits"],
    ("fp8", 2, True, "target"): [
        "trtllm-build",
        *io("target"),
        *LIMITS,
        *COMMON,
        "--speculative_decoding_mode",
        "draft_tokens_external",
        "--max_draft_len",
        "6",
        "--gather_generation_logits",
        "--workers",
        "2",
    ],
    ("int8_wo", 1, False, "target"): [
        "trtllm-build",
        *io("target"),
        *LIMITS,
        *COMMON,
        "--speculative_decoding_mode",
        "draft_tokens_external",
        "--max_draft_len",
        "6",
    ],
}


@pytest.mark.parametrize("key", list(GOLDEN), ids=lambda k: "-".join(map(str, k)))
def test_golden_command_lines(key):
    qformat, tp, logits, role = key
    recipe = make_recipe(qformat=qformat, tp=tp, use_logits=logits)
    ranks = tp if role == "target" else 1
    ckpt = CheckpointInfo(tp_size=ranks, pp_size=1)
    cmd = build_command(recipe, role, Path(f"/c/{role}"), Path(f"/e/{role}"), ckpt, workers=ranks)
    assert cmd == GOLDEN[key]


def test_workers_limited_by_gpus_and_pp_counts(tmp_path):
    from specdeploy.core.gpus import GpuInfo

    recipe = parse_recipe(
        {
            "name": "pp",
            "backend": "trtllm-engine",
            "target": {"model": "t", "tp_size": 2, "pp_size": 2},
            "draft": {"model": "d"},
        }
    )
    layout = Layout.of(recipe, tmp_path)
    one_gpu = [GpuInfo(0, "H100", 80 * 2**30, (9, 0))]
    target = trtllm_build.plan_engine_build(recipe, layout, one_gpu)[1]
    assert target.checkpoint.world_size == 4 and "--workers" not in target.command  # 1 GPU: serial build
    target = trtllm_build.plan_engine_build(recipe, layout, None)[1]
    assert target.command[-2:] == ["--workers", "4"]


# ---------------------------------------------------------------- orchestration with the stand-in tool


@pytest.fixture
def gpu_env(tmp_path, monkeypatch, tiny_llama_dir, tiny_llama_draft_dir):
    """Stand-in trtllm-build on PATH, fake checkpoints, no GPU probe."""
    monkeypatch.setattr(trtllm.gpu_probe, "probe", lambda timeout_s=10.0: [])
    record = tmp_path / "record.jsonl"
    install_standin(tmp_path / "bin", monkeypatch, record)
    recipe = make_recipe(target=tiny_llama_dir, draft=tiny_llama_draft_dir, tp=2, max_batch_size=1)
    layout = Layout.of(recipe, tmp_path / "project")
    write_trtllm_checkpoint(layout.checkpoint("target"), recipe.name, tiny_llama_dir, tp=2)
    write_trtllm_checkpoint(layout.checkpoint("draft"), recipe.name, tiny_llama_draft_dir, tp=1)
    return recipe, layout, record


def test_build_runs_tool_per_role_and_writes_manifests(gpu_env):
    recipe, layout, record = gpu_env
    lines = []
    outputs = trtllm_build.build_engine_recipe(recipe, layout, echo=lines.append)
    assert outputs == [layout.engine("draft"), layout.engine("target")]
    calls = recorded(record)
    planned = trtllm_build.plan_engine_build(recipe, layout, [])
    assert len(calls) == 2
    for call, step in zip(calls, planned):
        # the tool got the planned argv except that it writes into the temporary sibling directory
        out = call[call.index("--output_dir") + 1]
        assert Path(out).parent == step.output_dir.parent and Path(out).name.startswith(f".{step.role}.tmp-")
        assert call[: call.index("--output_dir")] == step.command[1 : step.command.index("--output_dir")]
        assert call[call.index("--output_dir") + 2 :] == step.command[step.command.index("--output_dir") + 2 :]
    target = layout.engine("target")
    assert sorted(p.name for p in target.glob("rank*.engine")) == ["rank0.engine", "rank1.engine"]
    m = Manifest.read(target)
    assert m.stage == "build" and m.settings["max_draft_len"] == 6 and m.settings["backend"] == "trtllm-engine"
    assert m.extra["command"] == planned[1].command and "--speculative_decoding_mode" in m.extra["command_line"]
    assert m.tool_versions["trtllm-build"] == "0.18.0-standin"
    assert m.extra["gpus"] == ["no GPU seen by nvidia-smi/torch"]
    assert m.extra["tokenizer_dir"] == recipe.target.model
    assert (target / "build.log").read_text().startswith("[TensorRT-LLM] TensorRT-LLM version")
    # streamed with progress
    assert any("[target" in line and "building rank 1 of 2" in line for line in lines)
    # nothing temporary left behind
    assert not [p for p in layout.engines.iterdir() if p.name.startswith(".")]


def test_up_to_date_engines_are_not_rebuilt(gpu_env):
    recipe, layout, record = gpu_env
    trtllm_build.build_engine_recipe(recipe, layout, echo=lambda s: None)
    lines = []
    trtllm_build.build_engine_recipe(recipe, layout, echo=lines.append)
    assert len(recorded(record)) == 2
    assert any("up to date" in line for line in lines)
    trtllm_build.build_engine_recipe(recipe, layout, force=True, echo=lambda s: None)
    assert len(recorded(record)) == 4


def test_failed_build_keeps_earlier_engine_and_reports_tool_tail(gpu_env, monkeypatch):
    recipe, layout, record = gpu_env
    trtllm_build.build_engine_recipe(recipe, layout, echo=lambda s: None)
    target = layout.engine("target")
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    monkeypatch.setenv("STANDIN_FAIL", "target")
    with pytest.raises(BuildError) as err:
        trtllm_build.build_engine_recipe(recipe, layout, force=True, echo=lambda s: None)
    message = str(err.value)
    assert "exit 1" in message and "out of memory while building the engine" in message
    assert "standin failure" in message
    after = {p.name: p.read_bytes() for p in target.iterdir()}
    assert after == before  # the earlier engine is kept, byte for byte
    assert not [p for p in layout.engines.iterdir() if p.name.startswith(".")]  # partial output removed


def test_failed_first_build_leaves_no_engine(gpu_env, monkeypatch):
    recipe, layout, record = gpu_env
    monkeypatch.setenv("STANDIN_FAIL", "draft")
    with pytest.raises(BuildError):
        trtllm_build.build_engine_recipe(recipe, layout, echo=lambda s: None)
    assert not layout.engine("draft").exists() and not layout.engine("target").exists()
    assert len(recorded(record)) == 1  # stopped at the draft


def test_dry_run_prints_commands_and_writes_nothing(gpu_env):
    recipe, layout, record = gpu_env
    lines = []
    assert trtllm_build.build_engine_recipe(recipe, layout, dry_run=True, echo=lines.append) == []
    text = "\n".join(lines)
    for step in trtllm_build.plan_engine_build(recipe, layout, []):
        assert step.command_line in text
    assert recorded(record) == [] and not layout.engine("target").exists()


def test_dry_run_without_checkpoints_uses_recipe_mapping(tmp_path, monkeypatch):
    monkeypatch.setattr(trtllm.gpu_probe, "probe", lambda timeout_s=10.0: [])
    recipe = make_recipe(tp=2)
    layout = Layout.of(recipe, tmp_path)
    lines = []
    trtllm_build.build_engine_recipe(recipe, layout, dry_run=True, echo=lines.append)
    assert any(line.endswith("--workers 2") for line in lines)
    assert not (tmp_path / "engines").exists()


def test_missing_tool_is_a_build_error(gpu_env, monkeypatch):
    recipe, layout, _ = gpu_env
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(BuildError, match="trtllm-build is not on PATH"):
        trtllm_build.build_engine_recipe(recipe, layout, echo=lambda s: None)


def test_checkpoint_split_must_match_recipe(gpu_env, tiny_llama_dir):
    recipe, layout, _ = gpu_env
    write_trtllm_checkpoint(layout.checkpoint("target"), recipe.name, tiny_llama_dir, tp=1)
    with pytest.raises(StaleArtifactError, match="tp 1 x pp 1"):
        trtllm_build.build_engine_recipe(recipe, layout, echo=lambda s: None)


def test_missing_checkpoint_names_quantize(tmp_path, monkeypatch):
    monkeypatch.setattr(trtllm.gpu_probe, "probe", lambda timeout_s=10.0: [])
    recipe = make_recipe()
    with pytest.raises(StaleArtifactError, match="specdeploy quantize"):
        trtllm_build.plan_engine_build(recipe, Layout.of(recipe, tmp_path), [], must_exist=True)


def test_tool_exiting_zero_without_engines_is_an_error(gpu_env, tmp_path, monkeypatch):
    recipe, layout, _ = gpu_env
    liar = tmp_path / "bin2" / "trtllm-build"
    liar.parent.mkdir()
    liar.write_text("#!/bin/sh\necho 'nothing built'\nexit 0\n")
    liar.chmod(0o755)
    monkeypatch.setenv("PATH", f"{liar.parent}:/usr/bin:/bin")
    with pytest.raises(BuildError, match="wrote 0 rank engine"):
        trtllm_build.build_engine_recipe(recipe, layout, echo=lambda s: None)


def test_gpu_recipe_file_loads_and_dry_runs(tmp_path, monkeypatch):
    from specdeploy.recipe.load import load_recipe

    monkeypatch.setattr(trtllm.gpu_probe, "probe", lambda timeout_s=10.0: [])
    recipe = load_recipe(Path(__file__).parent.parent / "build" / "llama3-70b-fp8-engine.yaml")
    assert recipe.backend == "trtllm-engine" and recipe.target.tp_size == 4
    assert recipe.target.quantization.qformat == "fp8"
    lines = []
    trtllm_build.build_engine_recipe(recipe, Layout.of(recipe, tmp_path), dry_run=True, echo=lines.append)
    target_line = [line for line in lines if "--speculative_decoding_mode" in line][0]
    assert "--max_draft_len 8" in target_line and target_line.endswith("--workers 4")


def test_the_default_gpu_example_is_the_llm_api_on_a_current_image(tmp_path, monkeypatch):
    """TensorRT-LLM removed the TensorRT engine path on main (docs/source/legacy/tensorrt-backend-removal.md): the
    GPU example without a qualifier is the LLM-API recipe; the engine recipe says so in its name."""
    from specdeploy.recipe.load import load_recipe

    monkeypatch.setattr(trtllm.gpu_probe, "probe", lambda timeout_s=10.0: [])
    build = Path(__file__).parent.parent / "build"
    default, engine = load_recipe(build / "llama3-70b-fp8.yaml"), load_recipe(build / "llama3-70b-fp8-engine.yaml")
    assert default.backend == "trtllm-llmapi" and engine.backend == "trtllm-engine" and engine.name.endswith("-engine")
    from specdeploy.gpu import image as packaging

    # the recipe's release (1.2) picks the newest NGC image carrying it (trtllm_images)
    assert packaging.base_image(default) == "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"
    lines = []
    trtllm.build_llmapi_recipe(default, Layout.of(default, tmp_path), dry_run=True, echo=lines.append)
    text = "\n".join(lines)
    assert "\nspeculative_config:\n" in text and "trtllm-serve" in text and "trtllm-build" not in text


def test_gpu_backends_build_with_trtllm():
    from specdeploy.core import backends

    gpu = [b for b in backends.ALL if b.gpu]
    assert {b.name for b in gpu} == {"trtllm-engine", "trtllm-llmapi"}
    assert all(b.external_build for b in gpu)


def test_cli_build_dry_run(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from specdeploy.cli.main import main

    monkeypatch.setattr(trtllm.gpu_probe, "probe", lambda timeout_s=10.0: [])
    recipe_path = Path(__file__).parent.parent / "build" / "llama3-70b-fp8-engine.yaml"
    result = CliRunner().invoke(main, ["--root", str(tmp_path), "build", str(recipe_path), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "--speculative_decoding_mode draft_tokens_external --max_draft_len 8" in result.output
    assert list(tmp_path.iterdir()) == []
    cpu = tmp_path / "cpu.yaml"
    cpu.write_text("name: c\ntarget: {model: t}\ndraft: {model: d}\n")
    result = CliRunner().invoke(main, ["--root", str(tmp_path), "build", str(cpu), "--dry-run"])
    assert result.exit_code == 2 and "builds in-process" in result.output
