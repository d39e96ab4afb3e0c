"""GPU launch commands (single / orchestrator / llmapi), docker, and Kubernetes manifests."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from _trtllm_standin import STANDIN_TRITONSERVER

from specdeploy.core.artifacts import Layout
from specdeploy.core.errors import ConfigError, ServerError
from specdeploy.gpu import image as packaging
from specdeploy.gpu import k8s, launch, launch_command
from specdeploy.gpu import triton_models as gpu_models
from specdeploy.recipe.load import parse_recipe

# Written out, not taken from specdeploy.gpu.launch: where NGC's Triton images install the server, and the
# folder holding the specdeploy package (this checkout's root) that the python models must import from.
NGC_TRITONSERVER = "/opt/tritonserver/bin/tritonserver"
SOURCE_ROOT = str(Path(__file__).resolve().parents[1])


def recipe(backend="trtllm-engine", target_tp=1, draft_tp=1, **triton):
    return parse_recipe(
        {
            "name": "Llama3_70b.fp8",
            "backend": backend,
            "target": {"model": "t", "tp_size": target_tp, "quantization": {"qformat": "fp8"}},
            "draft": {"model": "d", "tp_size": draft_tp, "quantization": {"qformat": "fp8"}},
            "triton": {"grpc_port": 9001, "http_port": 9000, "metrics_port": 9002, **triton},
        }
    )


def test_single_gpu_runs_one_tritonserver(tmp_path):
    r = recipe()
    plan = launch_command.launch_plan(r, Layout.of(r, tmp_path))
    repo = (tmp_path / "triton_repo" / r.name).resolve()
    assert plan.mode == "single" and plan.gpus == 1 and plan.env == {"SPECDEPLOY_SITE": SOURCE_ROOT}
    assert plan.command == [
        NGC_TRITONSERVER,
        f"--model-repository={repo}",
        "--grpc-port=9001",
        "--http-port=9000",
        "--metrics-port=9002",
        "--disable-auto-complete-config",
        "--backend-config=python,shm-region-prefix-name=prefix0_",
    ]


ORCHESTRATOR_ENV = {
    "TRTLLM_ORCHESTRATOR": "1",
    "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1",
    "SPECDEPLOY_SITE": SOURCE_ROOT,
}


@pytest.mark.parametrize(("target_tp", "draft_tp"), [(2, 2), (4, 1)])
def test_tensor_parallel_draft_target_runs_the_orchestrator_under_mpirun_n_1(tmp_path, target_tp, draft_tp):
    """TensorRT-LLM's draft_target_model/README.md: "--multi-model is necessary if TP mode is used" (equal ranks
    included); NVIDIA's launch_triton_server.py then runs `mpirun --allow-run-as-root -n 1 tritonserver` with the
    memory-pool flags of add_multi_model_config for every GPU and TRTLLM_ORCHESTRATOR=1. Written out here."""
    r = recipe(target_tp=target_tp, draft_tp=draft_tp)
    plan = launch_command.launch_plan(r, Layout.of(r, tmp_path))
    repo = (tmp_path / "triton_repo" / r.name).resolve()
    assert plan.mode == "orchestrator" and plan.gpus == target_tp and plan.env == ORCHESTRATOR_ENV
    pools = [f"--cuda-memory-pool-byte-size={gpu}:0" for gpu in range(target_tp)]
    assert plan.command == [
        "mpirun",
        "--allow-run-as-root",
        "-n",
        "1",
        NGC_TRITONSERVER,
        f"--model-repository={repo}",
        "--grpc-port=9001",
        "--http-port=9000",
        "--metrics-port=9002",
        "--pinned-memory-pool-byte-size=0",
        "--enable-peer-access=false",
        *pools,
        "--disable-auto-complete-config",
        "--backend-config=python,shm-region-prefix-name=prefix0_",
    ]
    assert plan.command_line.startswith("TRTLLM_ORCHESTRATOR=1 TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1 ")
    with pytest.raises(ConfigError, match="unknown launch mode 'leader'"):
        launch_command.launch_plan(r, Layout.of(r, tmp_path), mode="leader")


def test_llmapi_keeps_auto_complete(tmp_path):
    r = recipe(backend="trtllm-llmapi", target_tp=2)
    plan = launch_command.launch_plan(r, Layout.of(r, tmp_path))
    assert plan.mode == "llmapi" and plan.gpus == 2 and plan.env == {}  # no specdeploy models inside
    assert "--disable-auto-complete-config" not in plan.command
    # TP > 1: one tritonserver under `mpirun -n 1`, as NVIDIA's launch_triton_server.py (world size 1, MPI on)
    assert plan.command[:5] == ["mpirun", "--allow-run-as-root", "-n", "1", NGC_TRITONSERVER]
    single = recipe(backend="trtllm-llmapi")
    assert (
        launch_command.launch_plan(single, Layout.of(single, tmp_path)).command[0] == NGC_TRITONSERVER
    )  # its --no-mpi


def test_cpu_backend_has_no_gpu_plan(tmp_path):
    r = parse_recipe({"name": "c", "target": {"model": "t"}, "draft": {"model": "d"}})
    with pytest.raises(ConfigError):
        launch_command.launch_plan(r, Layout.of(r, tmp_path))


def test_docker_command_mounts_project_and_passes_env(tmp_path):
    r = recipe(target_tp=4)
    layout = Layout.of(r, tmp_path)
    plan = launch_command.launch_plan(r, layout)
    cmd = launch_command.docker_command(plan, r, layout)
    root = str(tmp_path.resolve())
    assert cmd[:3] == ["docker", "run", "--rm"] and "--gpus" in cmd
    assert f"{root}:{root}" in cmd and "-e" in cmd and "TRTLLM_ORCHESTRATOR=1" in cmd
    for port in (9000, 9001, 9002):
        assert f"{port}:{port}" in cmd
    image_at = cmd.index(packaging.image_tag(r))  # the image built with specdeploy installed, not the bare NGC one
    assert cmd[image_at + 1 :] == plan.command
    # nothing from the host's site-packages: specdeploy is installed in the image
    assert not any(a.startswith("SPECDEPLOY_SITE") for a in cmd) and f"{SOURCE_ROOT}:" not in " ".join(cmd)
    lines = launch.print_lines(r, layout)
    assert plan.command_line in lines


def test_k8s_manifests_are_valid_yaml_with_expected_kinds(tmp_path):
    r = recipe(target_tp=4, startup_timeout_s=1200)
    text = k8s.k8s_yaml(r, Layout.of(r, tmp_path), max_replicas=3)
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert [d["kind"] for d in docs] == [
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "HTTPRoute",
        "ServiceMonitor",
        "ConfigMap",
    ]
    deployment, service, hpa = docs[:3]  # the canary/observability manifests: tests/test_canary.py
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
    assert "SPECDEPLOY_SITE=" in lines[2] and "mpirun --allow-run-as-root -n 1 " in lines[2]
    assert lines[4].startswith("docker build") and lines[5].startswith("docker run")
    assert (packaging.image_context(layout) / "Dockerfile").is_file()
    out = tmp_path / "k8s.yaml"
    launch.serve_gpu(r, layout, print_k8s=True, k8s_out=out, echo=lines.append)
    assert [d["kind"] for d in yaml.safe_load_all(out.read_text()) if d][0] == "Deployment"


def test_cli_serve_print_k8s_for_gpu_recipe(tmp_path):
    from pathlib import Path

    from click.testing import CliRunner

    from specdeploy.cli.main import main

    recipe_path = Path(__file__).parent.parent / "build" / "llama3-70b-fp8-engine.yaml"
    result = CliRunner().invoke(main, ["--root", str(tmp_path), "serve", str(recipe_path), "--print-k8s"])
    assert result.exit_code == 0, result.output
    docs = [d for d in yaml.safe_load_all(result.output) if d]
    assert [d["kind"] for d in docs] == [
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "HTTPRoute",
        "ServiceMonitor",
        "ConfigMap",
    ]
    assert "&id" not in result.output  # plain YAML, no anchors
    result = CliRunner().invoke(main, ["--root", str(tmp_path), "serve", str(recipe_path), "--print-only"])
    assert result.exit_code == 0 and "TRTLLM_ORCHESTRATOR=1" in result.output and "docker run" in result.output
    # --print-only starts nothing; it writes only the image's build context
    assert [p.relative_to(tmp_path) for p in tmp_path.glob("*/*/*")] == [Path("engines/llama3-70b-fp8-engine/image")]


# ---------------------------------------------------------------- the image (packaging.py)


def test_dockerfile_installs_specdeploy_into_the_ngc_image_without_its_deps(tmp_path):
    r = parse_recipe(
        {
            "name": "pkg",
            "backend": "trtllm-llmapi",
            "trtllm_version": "1.3.0rc24",
            "image": "registry.example.com/triton-trtllm:1.3.0rc24",  # no NGC image carries 1.3
            "target": {"model": "t"},
            "draft": {"model": "d"},
        }
    )
    layout = Layout.of(r, tmp_path)
    context = packaging.write_context(r, layout)
    text = (context / "Dockerfile").read_text()
    assert "\nFROM registry.example.com/triton-trtllm:1.3.0rc24\n" in text
    assert "pip install --no-cache-dir --no-deps /opt/specdeploy/src" in text
    assert '"pyyaml==6.0.3"' in text and "torch" not in text.split("--no-deps /opt/specdeploy/src")[1].split("\n")[1]
    src = context / packaging.SOURCE_DIR
    assert (src / "pyproject.toml").is_file() and (
        src / "specdeploy" / "triton" / "models" / "tensorrt_llm_bls.py"
    ).is_file()
    assert not list(src.rglob("__pycache__"))
    assert packaging.build_command(r, layout) == [
        "docker",
        "build",
        "-t",
        "specdeploy/pkg:trtllm-1.3.0rc24",
        str(context),
    ]


def _version_check(dockerfile: str) -> str:
    """The python program of the Dockerfile's first RUN (the TensorRT-LLM version check), as the shell sees it."""
    run = dockerfile.split('RUN python3 -c "', 1)[1].split('"\n', 1)[0]
    return run.replace("\\\n", "")


def _run_version_gate(recipe, installed: str, tmp_path):
    """The Dockerfile's version check run in a Python that sees tensorrt_llm `installed` (its dist-info only)."""
    import subprocess
    import sys

    dist = tmp_path / "site" / f"tensorrt_llm-{installed}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tensorrt_llm\nVersion: {installed}\n")
    program = _version_check(packaging.dockerfile(recipe, "base"))
    return subprocess.run(
        [sys.executable, "-c", program],
        env={"PYTHONPATH": str(tmp_path / "site")},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("installed", "ok"), [("1.2.1", True), ("1.2.0", True), ("1.3.0rc24", False), ("1.20.0", False)]
)
def test_image_build_refuses_another_tensorrt_llm(tmp_path, installed, ok):
    r = parse_recipe(
        {
            "name": "pkg",
            "backend": "trtllm-llmapi",
            "trtllm_version": "1.2",
            "target": {"model": "t"},
            "draft": {"model": "d"},
        }
    )
    done = _run_version_gate(r, installed, tmp_path)
    assert (done.returncode == 0) is ok, done.stderr
    if not ok:
        assert f"the image has TensorRT-LLM {installed}, the recipe targets 1.2" in done.stderr


@pytest.mark.parametrize(
    ("installed", "ok"),
    [
        ("1.3.0rc5", False),
        ("1.3.0rc21", False),
        ("1.3.0rc22", True),
        ("1.3.0rc24.post1", True),
        ("1.3.0", True),
        ("1.4.0rc1", False),
    ],
)
def test_image_build_gate_for_a_release_line_starts_at_its_first_verified_candidate(tmp_path, installed, ok):
    """trtllm_version 1.3 names the options of 1.3.0rc22 and later (trtllm.llmapi_version refuses rc5); the image
    gate must refuse the same candidates, not take any 1.3.0rcN."""
    r = parse_recipe(
        {
            "name": "pkg",
            "backend": "trtllm-llmapi",
            "trtllm_version": "1.3",
            "image": "built:1.3",
            "target": {"model": "t"},
            "draft": {"model": "d"},
        }
    )
    done = _run_version_gate(r, installed, tmp_path)
    assert (done.returncode == 0) is ok, done.stderr


# ---------------------------------------------------------------- serve on this machine (stand-in tritonserver)


@pytest.fixture
def standin_server(tmp_path, monkeypatch):
    import socket
    import stat
    import sys

    exe = tmp_path / "bin" / "tritonserver"
    exe.parent.mkdir()
    exe.write_text(STANDIN_TRITONSERVER.replace("{python}", sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    ports = []
    for _ in range(3):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    monkeypatch.setattr("specdeploy.core.gpus.probe", lambda timeout_s=10.0: [])
    r = recipe(grpc_port=ports[0], http_port=ports[1], metrics_port=ports[2], startup_timeout_s=30)
    return r, Layout.of(r, tmp_path / "project"), str(exe)


def test_gpu_serve_detach_writes_state_for_status_and_stop(standin_server):
    from specdeploy.triton import server, server_state

    r, layout, exe = standin_server
    lines = []
    state = launch.serve_gpu(r, layout, tritonserver=exe, detach=True, recipe_path="r.yaml", echo=lines.append)
    try:
        assert server_state.ServerState.read(layout.server_state).pid == state.pid
        assert state.http_port == r.triton.http_port and state.grpc_port == r.triton.grpc_port
        _, line = server.status(layout.server_state)
        assert line.startswith("running, ready") and f"pid {state.pid}" in line
        assert any("specdeploy stop r.yaml" in x for x in lines)
        with pytest.raises(ServerError, match="already running"):
            launch.serve_gpu(r, layout, tritonserver=exe, detach=True, echo=lines.append)
        log = (layout.server_state / "tritonserver.log").read_text()
        assert "standin tritonserver --model-repository=" in log
    finally:
        message = server.stop(layout.server_state)
    assert message == f"stopped tritonserver (pid {state.pid})"
    assert server.status(layout.server_state)[1].startswith("not running")


def test_engine_images_carry_the_release_that_built_the_engines(tmp_path):
    from specdeploy.core.artifacts import Manifest

    r = recipe()
    layout = Layout.of(r, tmp_path)
    assert packaging.target_trtllm(r, layout) == gpu_models.ENGINE_BACKEND_TRTLLM  # nothing built yet
    layout.engine("target").mkdir(parents=True)
    Manifest(stage="build", recipe_name=r.name, fingerprint="f", tool_versions={"trtllm-build": "0.17.0.post1"}).write(
        layout.engine("target")
    )
    assert packaging.target_trtllm(r, layout) == "0.17.0.post1"
    text = packaging.dockerfile(r, "base", layout)
    assert "the recipe targets 0.17.0.post1: rebuild the engines" in text
    assert packaging.image_tag(r, layout).endswith(":trtllm-0.17.0.post1")


def test_gpu_serve_in_the_foreground_stops_its_server_on_sigterm(standin_server, tmp_path):
    import json
    import signal
    import subprocess
    import sys
    import time

    from specdeploy.recipe.config import to_plain
    from specdeploy.triton import server_state

    r, layout, exe = standin_server
    program = (
        "import json, sys\nfrom specdeploy.gpu import launch\nfrom specdeploy.core.artifacts import Layout\nfrom"
        " specdeploy.recipe.load import parse_recipe\nr = parse_recipe(json.loads(sys.argv[1]))\nlaunch.serve_gpu(r,"
        " Layout.of(r, sys.argv[2]), tritonserver=sys.argv[3], echo=lambda s: print(s, flush=True))\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", program, json.dumps(to_plain(r)), str(layout.root), exe],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for line in child.stdout:
            if line.startswith("serving;"):
                break
        state = server_state.ServerState.read(layout.server_state)
        assert state is not None and state.running()  # status works while it serves in the foreground
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while state.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not state.running()  # the server went down with it
        assert server_state.ServerState.read(layout.server_state) is None
    finally:
        if child.poll() is None:
            child.kill()


def test_engine_image_must_be_a_known_ngc_image_carrying_the_engines_release(tmp_path):
    """The repository names the tensorrt_llm tensors for the release that built the engines; the image written into
    the Dockerfile must carry that release (trtllm_images.IMAGE_TRTLLM), else the build context is refused."""
    from specdeploy.core.artifacts import Manifest
    from specdeploy.core.errors import RepoError

    r = recipe()
    layout = Layout.of(r, tmp_path)
    layout.engine("target").mkdir(parents=True)
    Manifest(stage="build", recipe_name=r.name, fingerprint="f", tool_versions={"trtllm-build": "0.18.0"}).write(
        layout.engine("target")
    )
    context = packaging.write_context(r, layout)  # the default image, 25.03, carries 0.18.0
    assert "FROM nvcr.io/nvidia/tritonserver:25.03-trtllm-python-py3" in (context / "Dockerfile").read_text()
    with pytest.raises(RepoError, match="carries TensorRT-LLM 0.17.0, the engines were built with 0.18.0") as err:
        packaging.write_context(r, layout, "nvcr.io/nvidia/tritonserver:25.01-trtllm-python-py3")
    assert "25.04-trtllm-python-py3" in err.value.hint  # the newest image of the 0.18 line
    with pytest.raises(ConfigError, match="not an NGC Triton TensorRT-LLM image"):
        packaging.write_context(r, layout, "example.com/mine:latest")


def test_gpu_serve_refuses_a_repository_that_is_not_there(standin_server):
    """`specdeploy serve` on a GPU backend checks the repository as the CPU backend and the pipeline's start do, before
    it launches anything (it started tritonserver on a folder that did not exist); the print modes need none."""
    from specdeploy.core.errors import SpecDeployError
    from specdeploy.deploy import backend_stages
    from specdeploy.triton import server_state

    r, layout, exe = standin_server
    with pytest.raises(SpecDeployError, match="specdeploy repo r.yaml"):
        backend_stages.of(r).serve(
            r, layout, detach=True, server_binary=exe, recipe_path="r.yaml", echo=lambda *_: None
        )
    assert server_state.ServerState.read(layout.server_state) is None  # nothing was started
    lines = []
    backend_stages.of(r).serve(
        r, layout, detach=False, server_binary=exe, recipe_path="r.yaml", echo=lines.append, print_only=True
    )
    assert lines


def test_a_gpu_start_ended_by_sigterm_stops_its_server(standin_server, tmp_path):
    """SIGTERM (a job's time limit) while a detached GPU server starts: the server goes down with the start, instead of
    running on unrecorded where `status` and `stop` cannot see it. The stand-in here never becomes ready."""
    import json
    import os
    import signal
    import stat
    import subprocess
    import sys
    import time

    from specdeploy.core import artifacts
    from specdeploy.recipe.config import to_plain
    from specdeploy.triton import server_state

    r, layout, _ = standin_server
    pid_file = tmp_path / "server.pid"
    slow = tmp_path / "bin" / "slow-tritonserver"
    slow.write_text(
        f"#!{sys.executable}\nimport os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
    )
    slow.chmod(slow.stat().st_mode | stat.S_IEXEC)
    program = (
        "import json, sys\nfrom specdeploy.gpu import launch\nfrom specdeploy.core.artifacts import Layout\nfrom"
        " specdeploy.recipe.load import parse_recipe\nr = parse_recipe(json.loads(sys.argv[1]))\nlaunch.serve_gpu(r,"
        " Layout.of(r, sys.argv[2]), tritonserver=sys.argv[3], detach=True, echo=lambda s: None)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", program, json.dumps(to_plain(r)), str(layout.root), str(slow)])
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(
                0.05
            )  # waits for the stand-in to have started (a signal, not a race: the assert below says which)
        started = int(pid_file.read_text())
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=60) != 0
        deadline = time.monotonic() + 10
        while artifacts.pid_alive(started) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = artifacts.pid_alive(started)
        if alive:
            os.kill(started, signal.SIGKILL)
        assert not alive, "the server of an interrupted start ran on"
        assert server_state.ServerState.read(layout.server_state) is None
    finally:
        if child.poll() is None:
            child.kill()
