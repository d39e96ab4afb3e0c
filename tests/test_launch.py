"""GPU launch commands (single / MPI leader / orchestrator / llmapi), docker, and Kubernetes manifests."""

from __future__ import annotations

import pytest
import yaml

from specdeploy import launch
from specdeploy.artifacts import Layout
from specdeploy.config import parse_recipe
from specdeploy.errors import ConfigError, ServerError


def recipe(backend="trtllm-engine", target_tp=1, draft_tp=1, **triton):
    return parse_recipe({
        "name": "Llama3_70b.fp8", "backend": backend,
        "target": {"model": "t", "tp_size": target_tp, "quantization": {"qformat": "fp8"}},
        "draft": {"model": "d", "tp_size": draft_tp, "quantization": {"qformat": "fp8"}},
        "triton": {"grpc_port": 9001, "http_port": 9000, "metrics_port": 9002, **triton},
    })  # fmt: skip


def test_single_gpu_runs_one_tritonserver(tmp_path):
    r = recipe()
    plan = launch.launch_plan(r, Layout.of(r, tmp_path))
    repo = (tmp_path / "triton_repo" / r.name).resolve()
    assert plan.mode == "single" and plan.gpus == 1 and plan.env == {"SPECDEPLOY_SITE": launch.specdeploy_site()}
    assert plan.command == [
        launch.TRITONSERVER, f"--model-repository={repo}", "--grpc-port=9001", "--http-port=9000",
        "--metrics-port=9002", "--disable-auto-complete-config",
        "--backend-config=python,shm-region-prefix-name=prefix0_",
    ]  # fmt: skip


def test_equal_ranks_use_mpirun_one_rank_per_gpu(tmp_path):
    r = recipe(target_tp=2, draft_tp=2)
    plan = launch.launch_plan(r, Layout.of(r, tmp_path))
    assert plan.mode == "leader" and plan.gpus == 2
    cmd = plan.command
    assert cmd[:2] == ["mpirun", "--allow-run-as-root"]
    ranks = " ".join(cmd).split(" : ")
    assert len(ranks) == 2 and all(" -n 1 " in f" {part} " for part in ranks)
    assert "--load-model=tensorrt_llm" not in ranks[0]  # rank 0 serves every model
    assert "--model-control-mode=explicit --load-model=tensorrt_llm --load-model=tensorrt_llm_draft" in ranks[1]
    assert "shm-region-prefix-name=prefix1_" in ranks[1]


def test_different_ranks_use_orchestrator_mode(tmp_path):
    r = recipe(target_tp=4, draft_tp=1)
    plan = launch.launch_plan(r, Layout.of(r, tmp_path))
    assert plan.mode == "orchestrator" and plan.gpus == 4
    assert plan.env["TRTLLM_ORCHESTRATOR"] == "1" and plan.env["TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES"] == "1"
    assert plan.command[0] == launch.TRITONSERVER and "mpirun" not in plan.command
    assert plan.command_line.startswith("TRTLLM_ORCHESTRATOR=1 TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1 ")
    with pytest.raises(ConfigError, match="leader mode"):
        launch.launch_plan(r, Layout.of(r, tmp_path), mode="leader")


def test_llmapi_keeps_auto_complete(tmp_path):
    r = recipe(backend="trtllm-llmapi", target_tp=2)
    plan = launch.launch_plan(r, Layout.of(r, tmp_path))
    assert plan.mode == "llmapi" and plan.gpus == 2 and plan.env == {}  # no specdeploy models inside
    assert "--disable-auto-complete-config" not in plan.command


def test_cpu_backend_has_no_gpu_plan(tmp_path):
    r = parse_recipe({"name": "c", "target": {"model": "t"}, "draft": {"model": "d"}})
    with pytest.raises(ConfigError):
        launch.launch_plan(r, Layout.of(r, tmp_path))


def test_docker_command_mounts_project_and_passes_env(tmp_path):
    r = recipe(target_tp=4)
    layout = Layout.of(r, tmp_path)
    plan = launch.launch_plan(r, layout)
    cmd = launch.docker_command(plan, r, layout)
    root = str(tmp_path.resolve())
    assert cmd[:3] == ["docker", "run", "--rm"] and "--gpus" in cmd
    assert f"{root}:{root}" in cmd and "-e" in cmd and "TRTLLM_ORCHESTRATOR=1" in cmd
    for port in (9000, 9001, 9002):
        assert f"{port}:{port}" in cmd
    image_at = cmd.index(launch.DEFAULT_IMAGES["trtllm-engine"])
    assert cmd[image_at + 1:] == plan.command
    lines = launch.print_lines(r, layout)
    assert plan.command_line in lines


def test_k8s_manifests_are_valid_yaml_with_expected_kinds(tmp_path):
    r = recipe(target_tp=4, startup_timeout_s=1200)
    text = launch.k8s_yaml(r, Layout.of(r, tmp_path), max_replicas=3)
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "HorizontalPodAutoscaler"]
    deployment, service, hpa = docs
    name = deployment["metadata"]["name"]
    assert name == "specdeploy-llama3-70b-fp8"  # DNS-1123
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 1200
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 9000, "grpc": 9001, "metrics": 9002}
    assert {"name": "TRTLLM_ORCHESTRATOR", "value": "1"} in container["env"]
    assert deployment["spec"]["selector"]["matchLabels"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert {p["name"] for p in service["spec"]["ports"]} == {"http", "grpc", "metrics"}
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
    assert hpa["spec"]["maxReplicas"] == 3
    metric = hpa["spec"]["metrics"][0]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "nv_inference_queue_duration_us"
    assert "prometheus-adapter" in text


def test_start_without_tritonserver_is_a_server_error(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "find_tritonserver", lambda explicit=None: None)
    r = recipe()
    with pytest.raises(ServerError, match="no tritonserver"):
        launch.start(r, Layout.of(r, tmp_path))


def test_serve_gpu_print_modes(tmp_path):
    r = recipe(target_tp=2, draft_tp=2)
    layout = Layout.of(r, tmp_path)
    lines = []
    assert launch.serve_gpu(r, layout, print_only=True, echo=lines.append) is None
    assert lines[1].startswith("SPECDEPLOY_SITE=") and "mpirun" in lines[1] and lines[3].startswith("docker run")
    out = tmp_path / "k8s.yaml"
    launch.serve_gpu(r, layout, print_k8s=True, k8s_out=out, echo=lines.append)
    assert [d["kind"] for d in yaml.safe_load_all(out.read_text()) if d][0] == "Deployment"


def test_cli_serve_print_k8s_for_gpu_recipe(tmp_path):
    from pathlib import Path

    from click.testing import CliRunner

    from specdeploy.cli import main

    recipe_path = Path(__file__).parent.parent / "build" / "llama3-70b-fp8.yaml"
    result = CliRunner().invoke(main, ["--root", str(tmp_path), "serve", str(recipe_path), "--print-k8s"])
    assert result.exit_code == 0, result.output
    docs = [d for d in yaml.safe_load_all(result.output) if d]
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "HorizontalPodAutoscaler"]
    assert "&id" not in result.output  # plain YAML, no anchors
    result = CliRunner().invoke(main, ["--root", str(tmp_path), "serve", str(recipe_path), "--print-only"])
    assert result.exit_code == 0 and "TRTLLM_ORCHESTRATOR=1" in result.output and "docker run" in result.output
    assert list(tmp_path.iterdir()) == []
