"""The backends: their facts (specdeploy.core.backends) decide per backend in one place, and their stages
(specdeploy.deploy.backend_stages) are what the pipeline drives."""

from __future__ import annotations

import ast
import json
import socket
import stat
import sys
from pathlib import Path

import pytest
from _trtllm_standin import STANDIN_TRITONSERVER, install_standin, recorded

from specdeploy.core import backends
from specdeploy.core.errors import ConfigError
from specdeploy.deploy import backend_stages, preflight
from specdeploy.recipe import config
from specdeploy.recipe.load import parse_recipe

PACKAGE = Path(__file__).resolve().parents[1] / "specdeploy"
# Written out here, not read from specdeploy: the names a recipe's `backend` key takes.
BACKEND_NAMES = {"cpu", "trtllm-engine", "trtllm-llmapi"}


def backend_decisions(source: str) -> list[str]:
    """Places in `source` that decide by a backend's name: a comparison with a name literal (or a literal
    collection of names), or a dict literal keyed by backend names (a dispatch table)."""

    def names_in(node) -> list[str]:
        if isinstance(node, ast.Constant) and node.value in BACKEND_NAMES:
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in BACKEND_NAMES]
        return []

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(names_in(n) for n in (node.left, *node.comparators)):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Dict) and any(node.keys) and all(names_in(k) for k in node.keys if k is not None):
            found.append(f"line {node.lineno}: table keyed by backend {ast.unparse(node)[:60]}")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts and len(names_in(node)) == len(node.elts):
            found.append(f"line {node.lineno}: list of backends {ast.unparse(node)[:60]}")
    return found


def test_the_scan_finds_each_kind_of_backend_decision():
    source = (
        'if recipe.backend == "trtllm-engine":\n    pass\n'
        'ok = backend in ("cpu", "trtllm-llmapi")\n'
        'TABLE = {"cpu": 1, "trtllm-llmapi": 2}\n'
        'GPU = ("trtllm-engine", "trtllm-llmapi")\n'
        'device = "cpu" if x else "cuda"\nBYTES = {"cpu": 4, "cuda": 2}\n'  # devices, not backends
    )
    lines = {int(f.split(":")[0].split()[1]) for f in backend_decisions(source)}
    assert lines == {1, 3, 4, 5}  # not 6 and 7: "cpu" as a torch device


def test_no_backend_string_decisions_outside_the_backend_facts():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "backends.py":
            continue
        found = backend_decisions(path.read_text())
        if found:
            offenders[str(path.relative_to(PACKAGE.parent))] = found
    assert offenders == {}, "ask specdeploy.core.backends instead of comparing backend names:\n" + json.dumps(
        offenders, indent=1
    )


def test_registry_is_what_config_accepts():
    assert set(backends.NAMES) == BACKEND_NAMES
    assert config.BACKENDS == backends.NAMES
    assert parse_recipe({"name": "x", "target": {"model": "t"}, "draft": {"model": "d"}}).backend == "cpu"
    assert backends.get("trtllm-llmapi") is backends.TRTLLM_LLMAPI
    with pytest.raises(ConfigError, match="unknown backend 'tensorrt'") as exc:
        backends.get("tensorrt")
    assert "cpu, trtllm-engine, trtllm-llmapi" in exc.value.hint
    with pytest.raises(ConfigError, match="backend"):
        parse_recipe({"name": "x", "backend": "vllm", "target": {"model": "t"}, "draft": {"model": "d"}})


def test_every_backend_answers_every_question():
    for b in backends.ALL:
        assert set(b.qformats) <= set(config.QFORMATS) and "full_prec" in b.qformats
        assert set(b.preflight_checks) <= set(preflight.CHECKS), b.name
        assert b.checkpoint_format in ("trtllm", "hf")
        # the engine backend's default image; trtllm-llmapi's follows the recipe's trtllm_version (trtllm_images)
        assert (b.default_image is not None) == b.tensorrt_engines
    # every check is used by some backend, and the GPU-only checks by GPU backends only
    assert set(preflight.CHECKS) == {c for b in backends.ALL for c in b.preflight_checks}
    assert not {"fp8", "memory", "llmapi", "bls"} & set(backends.CPU.preflight_checks)
    # every backend serves a layout; the layout (not the backend) decides which repository is written
    assert all(b.layouts and set(b.layouts) <= set(backends.LAYOUTS) for b in backends.ALL)
    assert backends.TRTLLM_LLMAPI.layouts == ("llmapi",) and "llmapi" in backends.CPU.layouts
    assert backends.CPU.exact_verification and not any(b.exact_verification for b in backends.ALL if b.gpu)


def test_every_backend_has_its_stages():
    assert [s.backend for s in backend_stages.ALL] == list(backends.ALL)
    for b in backends.ALL:
        stages = backend_stages.get(b.name)
        assert stages.backend is b
        for method in ("build", "serve", "start", "engine_models"):
            assert getattr(type(stages), method) is not getattr(backend_stages.BackendStages, method), (b.name, method)
    with pytest.raises(ConfigError, match="unknown backend 'tensorrt'"):
        backend_stages.get("tensorrt")


def test_facts_answer_from_data():
    r = parse_recipe(
        {"name": "x", "target": {"model": "t"}, "draft": {"model": "d"}, "triton": {"inflight_batching": False}}
    )
    assert not backends.CPU.batches_in_flight(r) and backends.TRTLLM_ENGINE.batches_in_flight(r)
    assert backends.CPU.usable([], None, False)
    assert not backends.TRTLLM_LLMAPI.usable([], "1.2", False) and backends.TRTLLM_LLMAPI.usable(["gpu"], "1.2", False)
    assert not backends.TRTLLM_ENGINE.usable(["gpu"], "1.1", False) and backends.TRTLLM_ENGINE.usable(
        ["gpu"], "1.1", True
    )


def test_config_asks_the_backend():
    base = {"name": "x", "target": {"model": "t", "quantization": {"qformat": "int8_sq"}}, "draft": {"model": "d"}}
    parse_recipe({**base, "backend": "trtllm-engine"})
    with pytest.raises(ConfigError, match="which backend 'trtllm-llmapi' cannot run") as exc:
        parse_recipe({**base, "backend": "trtllm-llmapi"})
    assert "full_prec, fp8, int4_awq" in exc.value.hint
    sharded = {"name": "x", "target": {"model": "t", "tp_size": 2}, "draft": {"model": "d"}}
    with pytest.raises(ConfigError, match="2 ranks on backend 'cpu'") as exc:
        parse_recipe(sharded)
    assert "trtllm-engine or trtllm-llmapi" in exc.value.hint
    ngram = {"name": "x", "target": {"model": "t"}, "draft": {"kind": "ngram"}, "backend": "trtllm-engine"}
    with pytest.raises(ConfigError, match="ngram is not wired for backend trtllm-engine"):
        parse_recipe(ngram)


def test_repository_does_not_import_the_gpu_models():
    tree = ast.parse((PACKAGE / "triton" / "repository.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported |= {f"{node.module}.{a.name}" for a in node.names} | {node.module or ""}
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
    assert not any("gpu_models" in name for name in imported), imported


def test_generate_refuses_gpu_recipes():
    r = parse_recipe({"name": "g", "backend": "trtllm-llmapi", "target": {"model": "t"}, "draft": {"model": "d"}})
    with pytest.raises(ConfigError, match="runs the cpu backend; recipe g uses trtllm-llmapi"):
        backends.of(r).require_local("'specdeploy generate'", r)
    backends.CPU.require_local("'specdeploy generate'", r)  # the cpu backend runs it


# ---------------------------------------------------------------- `specdeploy run` on a GPU recipe, with stand-ins


def _free_ports(n: int) -> list[int]:
    ports = []
    for _ in range(n):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    return ports


def test_run_on_a_gpu_recipe_drives_the_gpu_flow(tmp_path, monkeypatch, tiny_llama_dir, tiny_llama_draft_dir):
    """quantize (real, tiny models) -> trtllm-build stand-in -> tensorrtllm repository -> the GPU launch (stand-in
    tritonserver from PATH) -> validate (fails: the stand-in has no gRPC) -> the server is stopped."""
    from click.testing import CliRunner

    from specdeploy.cli.main import main

    record = tmp_path / "record.jsonl"
    install_standin(tmp_path / "bin", monkeypatch, record)
    exe = tmp_path / "bin" / "tritonserver"
    exe.write_text(STANDIN_TRITONSERVER.replace("{python}", sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr("specdeploy.core.gpus.probe", lambda timeout_s=10.0: [])
    grpc, http, metrics = _free_ports(3)
    quant = {"qformat": "fp8", "calib_size": 4, "calib_max_seq_length": 32}
    recipe_path = tmp_path / "gpu.yaml"
    recipe_path.write_text(
        json.dumps(
            {
                "name": "gpu-run",
                "backend": "trtllm-engine",
                "target": {"model": str(tiny_llama_dir), "quantization": quant},
                "draft": {"model": str(tiny_llama_draft_dir), "quantization": quant},
                "speculative": {"max_draft_len": 4, "num_draft_tokens": 3},
                "engine": {"max_batch_size": 1, "max_input_len": 64, "max_seq_len": 128},
                "triton": {"grpc_port": grpc, "http_port": http, "metrics_port": metrics, "startup_timeout_s": 30},
                "validation": {"max_prompts": 1, "max_tokens": 16, "request_timeout_s": 2},
            }
        )
    )
    root = tmp_path / "project"
    result = CliRunner().invoke(main, ["--root", str(root), "run", str(recipe_path), "--no-progress"])
    print(result.output)
    calls = recorded(record)
    builds = [c for c in calls if c and c[0] != "tritonserver" and c[0] != "tritonserver-stopped"]
    assert len(builds) == 2, (result.output, calls)
    target_build = next(c for c in builds if "--speculative_decoding_mode" in c)
    assert target_build[target_build.index("--max_draft_len") + 1] == "4"
    draft_build = next(c for c in builds if "--speculative_decoding_mode" not in c)
    assert (
        Path(draft_build[draft_build.index("--checkpoint_dir") + 1])
        == root / "engines" / "gpu-run" / "checkpoints" / "draft"
    )
    servers = [c for c in calls if c[0] == "tritonserver"]
    assert len(servers) == 1, calls
    repo = Path(next(a.split("=", 1)[1] for a in servers[0] if a.startswith("--model-repository=")))
    assert (repo / "tensorrt_llm" / "config.pbtxt").is_file() and (repo / "tensorrt_llm_bls" / "config.pbtxt").is_file()
    assert 'backend: "tensorrtllm"' in (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert f"--grpc-port={grpc}" in servers[0] and "--disable-auto-complete-config" in servers[0]
    assert calls[-1] == ["tritonserver-stopped", "SIGTERM"], calls  # stopped after validate, which failed
    assert "== serve" in result.output and "== validate" in result.output and "== stop" in result.output
    assert result.exit_code != 0


def test_an_llmapi_recipe_is_validatable_but_not_swept(tmp_path):
    """Both layouts serve a control now; the llmapi layout fixes the draft length per deployment, so a draft-length
    sweep is refused before any request."""
    from specdeploy.core.artifacts import Layout
    from specdeploy.deploy.recipe_deployment import validate_recipe

    r = parse_recipe({"name": "l", "backend": "trtllm-llmapi", "target": {"model": "t"}, "draft": {"model": "d"}})
    with pytest.raises(ConfigError, match="fixes it per deployment"):
        validate_recipe(r, Layout.of(r, tmp_path), url="127.0.0.1:1", sweep_draft_tokens=(1, 2))


@pytest.mark.server
def test_run_on_the_cpu_backend_serves_validates_and_stops(tmp_path, monkeypatch, tiny_tokenizer_dir):
    """`specdeploy run` on a cpu recipe: real quantize and build of tiny models, the real tritonserver started by
    the backend, a validation report with a verdict, and the server gone afterwards."""
    from click.testing import CliRunner
    from tiny_models import make_tiny_model

    from specdeploy.cli.main import main

    target_dir, draft_dir = tmp_path / "target-hf", tmp_path / "draft-hf"
    make_tiny_model(target_dir, tiny_tokenizer_dir, seed=0)
    make_tiny_model(draft_dir, tiny_tokenizer_dir, seed=1, num_hidden_layers=1)
    quant = {"calib_size": 4, "calib_max_seq_length": 32}
    recipe_path = tmp_path / "cpu.yaml"
    recipe_path.write_text(
        json.dumps(
            {
                "name": "cpu-run",
                "target": {"model": str(target_dir), "quantization": {**quant, "qformat": "fp8"}},
                "draft": {"model": str(draft_dir), "quantization": {**quant, "qformat": "int8_wo"}},
                "speculative": {"max_draft_len": 4, "num_draft_tokens": 3},
                "engine": {"dtype": "bfloat16", "max_batch_size": 2, "max_input_len": 1100, "max_seq_len": 1400},
                "validation": {
                    "max_prompts": 4,
                    "max_tokens": 16,
                    "min_compared_tokens": 4,
                    "concurrency": [1],
                    "repeats": 1,
                    "min_speedup": 0.0,
                    "latency_prompts": 2,
                    "chat_template": "none",
                },
            }
        )
    )
    root = tmp_path / "project"
    result = CliRunner().invoke(main, ["--root", str(root), "run", str(recipe_path), "--no-progress"])
    out = result.output
    assert "== serve" in out and "ready: tritonserver (pid" in out and "stopped tritonserver" in out, out
    pid = int(out.split("ready: tritonserver (pid ", 1)[1].split(",", 1)[0])
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    report = json.loads((root / "engines" / "cpu-run" / "report" / "report.json").read_text())
    summary = report["parity"]["summary"]["all"]
    assert summary["compared"] == summary["prompts"] == 4 and summary["exact"] == summary["compared"], summary
    assert report["gate"]["passed"] is True and result.exit_code == 0, out
