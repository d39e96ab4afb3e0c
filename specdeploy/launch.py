"""Launching a GPU deployment: the tritonserver command, its container equivalent, and Kubernetes manifests.

The launch follows tensorrtllm_backend's `scripts/launch_triton_server.py`:
- one process when the target and the draft each run on one GPU;
- otherwise "orchestrator mode" (`--multi-model`): TensorRT-LLM's examples/draft_target_model/README.md
  (Triton workflow, step 4): "`--multi-model` is necessary if TP mode is used", whether or not the draft has the
  target's rank count. The launcher then runs one rank, `mpirun -n 1 tritonserver ...` with
  TRTLLM_ORCHESTRATOR=1 (the backend spawns each model's per-GPU workers, TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1),
  and adds `--pinned-memory-pool-byte-size=0 --enable-peer-access=false --cuda-memory-pool-byte-size=<gpu>:0`
  for every GPU (tensorrtllm_backend@c2e65b8 scripts/launch_triton_server.py:119-128 add_multi_model_config,
  :158-164 mpirun -n 1 per rank, :217-221 the environment and "World size must be 1 when using multi-model").
  Its "leader mode" (every rank loads every model) serves one TensorRT-LLM model per deployment, not a
  draft/target pair, so it is not used here.
- `trtllm-llmapi`: one tritonserver; LLM(...) inside the llmapi model starts its own TP/PP workers.

Nothing here needs a GPU to produce commands; `start` refuses without the server binary.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from specdeploy import backends, packaging
from specdeploy.artifacts import Layout
from specdeploy.config import Recipe
from specdeploy.errors import ConfigError, ServerError

TRITONSERVER = "/opt/tritonserver/bin/tritonserver"  # in NGC Triton images
DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
# Triton's Prometheus counter of cumulative queue time; an adapter rule turns it into a per-second rate.
HPA_METRIC = "nv_inference_queue_duration_us"


@dataclass(frozen=True)
class LaunchPlan:
    mode: str  # single | orchestrator | llmapi
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    gpus: int = 1  # GPUs one replica needs

    @property
    def command_line(self) -> str:
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (prefix + " " if prefix else "") + shlex.join(self.command)


def _ports(recipe: Recipe) -> dict[str, int]:
    t = recipe.triton
    return {
        "http": t.http_port or DEFAULT_PORTS["http"],
        "grpc": t.grpc_port or DEFAULT_PORTS["grpc"],
        "metrics": t.metrics_port or DEFAULT_PORTS["metrics"],
    }


def _server_args(repo: Path, ports: dict[str, int], rank: int, auto_complete: bool) -> list[str]:
    args = [
        f"--model-repository={repo}",
        f"--grpc-port={ports['grpc']}",
        f"--http-port={ports['http']}",
        f"--metrics-port={ports['metrics']}",
    ]
    if not auto_complete:
        args.append("--disable-auto-complete-config")
    # launch_triton_server.py: a separate python-backend shared-memory prefix per rank
    args.append(f"--backend-config=python,shm-region-prefix-name=prefix{rank}_")
    return args


def specdeploy_site() -> str:
    """The directory holding the specdeploy package: the python models of the repository import it."""
    import specdeploy

    return str(Path(specdeploy.__file__).resolve().parent.parent)


def launch_plan(recipe: Recipe, layout: Layout, tritonserver: str = TRITONSERVER, mode: str = "auto") -> LaunchPlan:
    """The command that starts tritonserver for the recipe's GPU backend."""
    plan = _launch_plan(recipe, layout, tritonserver, mode)
    if backends.of(recipe).bls_limits is not None:
        # preprocessing / postprocessing / tensorrt_llm_bls are specdeploy python models (SPECDEPLOY_SITE)
        plan = LaunchPlan(plan.mode, plan.command, {**plan.env, "SPECDEPLOY_SITE": specdeploy_site()}, plan.gpus)
    return plan


def _launch_plan(recipe: Recipe, layout: Layout, tritonserver: str, mode: str) -> LaunchPlan:
    repo = Path(layout.repo).resolve()
    ports = _ports(recipe)
    target_ranks = recipe.target.tp_size * recipe.target.pp_size
    draft_ranks = recipe.draft.tp_size * recipe.draft.pp_size
    gpus = max(target_ranks, draft_ranks)
    backend = backends.of(recipe)
    if not backend.gpu:
        raise ConfigError(f"launch plans are for GPU backends; recipe backend is {recipe.backend!r}",
                          "the cpu backend starts with specdeploy serve")  # fmt: skip
    if not backend.tensorrt_engines:
        # the llmapi model sets max_batch_size/decoupled in auto_complete_config: keep auto-complete on
        from specdeploy.triton import llmapi

        args = [*_server_args(repo, ports, 0, auto_complete=True), *llmapi.server_args(recipe)]
        return LaunchPlan("llmapi", [tritonserver, *args], gpus=target_ranks)
    if mode == "auto":
        mode = "single" if gpus == 1 else "orchestrator"
    if mode == "single":
        return LaunchPlan("single", [tritonserver, *_server_args(repo, ports, 0, auto_complete=False)], gpus=1)
    if mode != "orchestrator":
        raise ConfigError(f"unknown launch mode {mode!r}", "choices: auto, single, orchestrator")
    env = {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1"}
    memory = ["--pinned-memory-pool-byte-size=0", "--enable-peer-access=false",
              *[f"--cuda-memory-pool-byte-size={gpu}:0" for gpu in range(gpus)]]  # fmt: skip
    args = _server_args(repo, ports, 0, auto_complete=False)
    cmd = ["mpirun", "--allow-run-as-root", "-n", "1", tritonserver, *args[:4], *memory, *args[4:]]
    return LaunchPlan("orchestrator", cmd, env, gpus)


def container_env(plan: LaunchPlan) -> dict[str, str]:
    """The launch environment inside the image: specdeploy is installed there, so no host SPECDEPLOY_SITE."""
    return {k: v for k, v in plan.env.items() if k != "SPECDEPLOY_SITE"}


def docker_command(plan: LaunchPlan, recipe: Recipe, layout: Layout, image: str | None = None) -> list[str]:
    """The same launch inside the image `docker build` makes from packaging.write_context (the NGC TensorRT-LLM
    Triton image with specdeploy installed); the project root is mounted at its own path so the engine paths
    written into config.pbtxt stay valid. Nothing from the host's site-packages is mounted."""
    root = str(Path(layout.root).resolve())
    ports = _ports(recipe)
    cmd = ["docker", "run", "--rm", "--gpus", "all", "--ipc=host", "--shm-size=2g",
           "--ulimit", "memlock=-1", "--ulimit", "stack=67108864"]  # fmt: skip
    for port in ports.values():
        cmd += ["-p", f"{port}:{port}"]
    cmd += ["-v", f"{root}:{root}", "-w", root]
    for key, value in container_env(plan).items():
        cmd += ["-e", f"{key}={value}"]
    return cmd + [image or packaging.image_tag(recipe, layout), *plan.command]


# ---------------------------------------------------------------- Kubernetes


def k8s_name(recipe: Recipe) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", recipe.name.lower()).strip("-")
    return f"specdeploy-{name}"[:63].rstrip("-")


def k8s_manifests(
    recipe: Recipe,
    layout: Layout,
    image: str | None = None,
    max_replicas: int = 4,
    queue_us_per_second: int = 100_000,
    volume_claim: str | None = None,
) -> list[dict]:
    """Deployment (GPU requests, health probes), Service and HorizontalPodAutoscaler for one recipe.

    The pod mounts a PersistentVolumeClaim holding the project root (engines/ and triton_repo/) at the same
    path as on the build machine. The HPA scales on the per-pod rate of Triton's
    nv_inference_queue_duration_us (microseconds spent queued per second), which a prometheus-adapter rule
    must expose as a custom metric of that name.
    """
    name = k8s_name(recipe)
    plan = launch_plan(recipe, layout, TRITONSERVER)
    ports = _ports(recipe)
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "specdeploy"}
    container = _k8s_container(recipe, layout, plan, ports, image)
    deployment = _k8s_deployment(name, labels, container, ports, volume_claim)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {
            "selector": dict(labels),
            "ports": [{"name": n, "port": p, "targetPort": n} for n, p in ports.items()],
        },
    }
    hpa = _k8s_autoscaler(name, labels, max_replicas, queue_us_per_second)
    return [deployment, service, hpa, *operations_manifests(recipe, deployment, service)]


def _k8s_container(recipe: Recipe, layout: Layout, plan: LaunchPlan, ports: dict, image: str | None) -> dict:
    """The tritonserver container: the launch plan's command, its GPUs, health probes, the project volume."""
    root = str(Path(layout.root).resolve())
    startup_s = int(recipe.triton.startup_timeout_s)
    return {
        "name": "tritonserver",
        "image": image or packaging.image_tag(recipe, layout),  # pushed to a registry the cluster pulls from
        "command": plan.command,
        "env": [{"name": k, "value": v} for k, v in container_env(plan).items()],
        "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
        "resources": {
            "requests": {"nvidia.com/gpu": plan.gpus},
            "limits": {"nvidia.com/gpu": plan.gpus},
        },
        # Triton's KServe v2 health endpoints; engines take minutes to load, so a startup probe guards
        # the liveness probe until the server first answers.
        "startupProbe": {
            "httpGet": {"path": "/v2/health/live", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": max(1, startup_s // 10),
        },
        "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": "http"}, "periodSeconds": 5,
                           "failureThreshold": 3},  # fmt: skip
        "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 3},  # fmt: skip
        "volumeMounts": [{"name": "project", "mountPath": root}, {"name": "dshm", "mountPath": "/dev/shm"}],
    }


def _k8s_deployment(name: str, labels: dict, container: dict, ports: dict, volume_claim: str | None) -> dict:
    """One replica of the container, scraped by Prometheus, on a GPU node, with the project's volume claim."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": dict(labels)},
            "template": {
                "metadata": {
                    "labels": dict(labels),
                    "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(ports["metrics"]),
                                    "prometheus.io/path": "/metrics"},  # fmt: skip
                },
                "spec": {
                    "containers": [container],
                    "volumes": [
                        {"name": "project", "persistentVolumeClaim": {"claimName": volume_claim or f"{name}-project"}},
                        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                    ],
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                },
            },
        },
    }


def _k8s_autoscaler(name: str, labels: dict, max_replicas: int, queue_us_per_second: int) -> dict:
    """The HorizontalPodAutoscaler on the per-pod rate of Triton's queue time (HPA_METRIC)."""
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": 1,
            "maxReplicas": max_replicas,
            "metrics": [{
                "type": "Pods",
                "pods": {
                    "metric": {"name": HPA_METRIC},
                    "target": {"type": "AverageValue", "averageValue": str(queue_us_per_second)},
                },
            }],  # fmt: skip
            # engines load slowly: scale down only after a quiet period
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}},
        },
    }


CANARY_ENV = "SPECDEPLOY_CANARY_CONTROL_PERCENT"  # overrides canary.control_percent in the BLS (specdeploy.metrics)
GATEWAY = "specdeploy-gateway"


def operations_manifests(recipe: Recipe, deployment: dict, service: dict, gateway: str = GATEWAY) -> list[dict]:
    """Canary and observability manifests beside the speculative Deployment and its Service.

    - with canary.control_percent P > 0: a control Deployment and Service (the same server whose BLS sends
      every request down the plain path, env CANARY_ENV=100; the speculative one gets 0), and a Gateway API
      HTTPRoute that splits the speculative entry point 100-P / P between them by weighted backendRefs;
      with P = 0 the HTTPRoute has the speculative backend alone;
    - a Prometheus Operator ServiceMonitor scraping both Services' metrics ports;
    - a ConfigMap with the Grafana dashboard (label grafana_dashboard: "1" for Grafana's sidecar).
    """
    import json

    from specdeploy import metrics

    name = deployment["metadata"]["name"]
    percent = recipe.canary.control_percent
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    http_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    group = {"specdeploy.io/recipe": name}
    for obj in (deployment, service):
        obj["metadata"]["labels"].update(group)
    for labels in (deployment["spec"]["selector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"], service["spec"]["selector"]):
        labels["specdeploy.io/arm"] = "speculative"
    container["env"].append({"name": CANARY_ENV, "value": "0"})
    out = []
    # Gateway API weights are integers: percent, or basis points for a fractional share
    scale = 1 if float(percent).is_integer() else 100
    control_weight = round(percent * scale)
    backends = [{"name": name, "port": http_port, "weight": 100 * scale - control_weight}]
    if percent > 0:
        control, control_service = _control_arm(deployment, service, name)
        out += [control, control_service]
        backends.append({"name": control["metadata"]["name"], "port": http_port, "weight": control_weight})
    route = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": name, "labels": dict(service["metadata"]["labels"])},
        "spec": {
            "parentRefs": [{"name": gateway}],
            "rules": [
                # the speculative entry point is split between the arms; everything else (ensemble, health) goes
                # to the speculative Deployment, which serves the same models
                {"matches": [{"path": {"type": "PathPrefix", "value": "/v2/models/tensorrt_llm_bls"}}], "backendRefs": backends},
                {"matches": [{"path": {"type": "PathPrefix", "value": "/"}}], "backendRefs": [{"name": name, "port": http_port}]},
            ],
        },
    }
    monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": name, "labels": dict(service["metadata"]["labels"])},
        "spec": {
            "selector": {"matchLabels": dict(group)},
            "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}],
        },
    }
    dashboard = metrics.grafana_dashboard(f"specdeploy {recipe.name}", recipe.cost.machine_price_per_hour, recipe.cost.currency)
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name[:53]}-dashboard", "labels": {**group, "grafana_dashboard": "1"}},
        "data": {f"{name}.json": json.dumps(dashboard, indent=1)},
    }
    return out + [route, monitor, config_map]


def _control_arm(deployment: dict, service: dict, name: str) -> tuple[dict, dict]:
    """The control Deployment and Service: copies of the speculative ones whose BLS sends every request down the
    plain path (CANARY_ENV=100), labelled arm "control"."""
    import copy

    control = copy.deepcopy(deployment)
    control_name = f"{name[:55]}-control"
    control["metadata"]["name"] = control_name
    for labels in (control["metadata"]["labels"], control["spec"]["selector"]["matchLabels"], control["spec"]["template"]["metadata"]["labels"]):
        labels["app.kubernetes.io/name"] = control_name
    for labels in (control["spec"]["selector"]["matchLabels"], control["spec"]["template"]["metadata"]["labels"]):
        labels["specdeploy.io/arm"] = "control"
    control_env = control["spec"]["template"]["spec"]["containers"][0]["env"]
    next(e for e in control_env if e["name"] == CANARY_ENV)["value"] = "100"
    control_service = copy.deepcopy(service)
    control_service["metadata"]["name"] = control_name
    control_service["metadata"]["labels"]["app.kubernetes.io/name"] = control_name
    control_service["spec"]["selector"].update({"app.kubernetes.io/name": control_name, "specdeploy.io/arm": "control"})
    return control, control_service


PROMETHEUS_ADAPTER_RULE = f"""\
# prometheus-adapter rule that exposes the HPA metric (per-pod rate of Triton's queue time):
# rules:
#   - seriesQuery: '{HPA_METRIC}{{namespace!="",pod!=""}}'
#     resources: {{overrides: {{namespace: {{resource: namespace}}, pod: {{resource: pod}}}}}}
#     name: {{matches: "{HPA_METRIC}", as: "{HPA_METRIC}"}}
#     metricsQuery: 'sum(rate(<<.Series>>{{<<.LabelMatchers>>}}[1m])) by (<<.GroupBy>>)'
"""


def _eagle3_head_line(recipe: Recipe, layout: Layout) -> str:
    """draft.kind eagle3 on a GPU backend: where the head is on the volume (the build stages it in the project root,
    so the options file's speculative_model is the same path inside the pod)."""
    if not recipe.draft.is_eagle3 or not backends.of(recipe).gpu:
        return ""
    from specdeploy import trtllm

    return (f"# EAGLE-3 head: {layout.engine('draft')} (staged from {trtllm.eagle3_head_source(recipe, layout)} by "
            "specdeploy build); speculative_config.speculative_model names that path.\n")


def k8s_yaml(recipe: Recipe, layout: Layout, **kwargs) -> str:
    docs = k8s_manifests(recipe, layout, **kwargs)
    header = (
        f"# Kubernetes manifests for specdeploy recipe {recipe.name} (backend {recipe.backend}).\n"
        f"# The PersistentVolumeClaim must hold {Path(layout.root).resolve()} (engines/ and triton_repo/).\n"
        f"# The image is {packaging.image_tag(recipe, layout)}: {shlex.join(packaging.build_command(recipe, layout))}, "
        "then push it where the cluster pulls from (or pass --image).\n"
        + _eagle3_head_line(recipe, layout)
        + PROMETHEUS_ADAPTER_RULE
    )
    return header + "---\n".join(yaml.safe_dump(d, sort_keys=False) for d in docs)


# ---------------------------------------------------------------- starting on this machine


def print_lines(recipe: Recipe, layout: Layout, image: str | None = None, tritonserver: str = TRITONSERVER) -> list[str]:
    plan = launch_plan(recipe, layout, tritonserver)
    lines = [f"# launch ({plan.mode}, {plan.gpus} GPU(s)):", plan.command_line,
             f"# the same in a container: build the image ({packaging.image_context(layout)}/Dockerfile installs "
             f"specdeploy into {backends.of(recipe).default_image}), then run it:",
             shlex.join(packaging.build_command(recipe, layout)),
             shlex.join(docker_command(plan, recipe, layout))]  # fmt: skip
    if plan.mode == "llmapi":
        lines.append("# the llmapi models need model.py and helpers.py from TensorRT-LLM triton_backend/all_models/llmapi/"
                     "tensorrt_llm/1/ in triton_repo/<recipe>/tensorrt_llm{,_control}/1/")  # fmt: skip
    return lines


def find_tritonserver(explicit: str | None = None) -> str | None:
    for candidate in (explicit, shutil.which("tritonserver"), TRITONSERVER):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def start(recipe: Recipe, layout: Layout, tritonserver: str | None = None, log_path: Path | None = None,
          timeout_s: float | None = None, die_with_parent: bool = True) -> subprocess.Popen:  # fmt: skip
    """Start the GPU deployment here (its own process group) and wait for /v2/health/ready; ServerError with the
    log tail otherwise. die_with_parent=False leaves it running after specdeploy exits (serve --detach)."""
    from specdeploy.triton import server

    exe = find_tritonserver(tritonserver)
    if exe is None:
        raise ServerError(
            "no tritonserver with the TensorRT-LLM backend on this machine",
            "run inside the image (see the docker commands from specdeploy serve --print-only), or pass --server-binary",
        )
    plan = launch_plan(recipe, layout, exe)
    if plan.command[0] == "mpirun" and shutil.which("mpirun") is None:
        raise ServerError("mpirun is not on PATH but the orchestrator launch (TP/PP > 1) runs under it", "install OpenMPI or use the NGC image")
    log_path = Path(log_path or Path(layout.server_state) / server.LOG_FILE)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + plan.command_line + "\n")
        log.flush()
        proc = subprocess.Popen(plan.command, env={**os.environ, **plan.env}, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=server._die_with_parent if die_with_parent else None)  # fmt: skip
    url = f"http://127.0.0.1:{_ports(recipe)['http']}/v2/health/ready"
    deadline = time.monotonic() + (timeout_s or recipe.triton.startup_timeout_s)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return proc
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    if proc.poll() is None:
        server.stop_pid(proc.pid, process=proc)
    tail = log_path.read_text(errors="replace").splitlines()[-30:] if log_path.is_file() else []
    raise ServerError("tritonserver did not become ready; last log lines:\n" + "\n".join(tail), f"full log: {log_path}")


def server_state(recipe: Recipe, layout: Layout, proc: subprocess.Popen, log_path: Path):
    """What `specdeploy status` / `stop` read for this GPU server (the CPU server's state file format)."""
    from specdeploy.artifacts import process_identity
    from specdeploy.triton.server import ServerState

    ports = _ports(recipe)
    me = process_identity(proc.pid)
    return ServerState(proc.pid, ports["grpc"], ports["http"], ports["metrics"], str(log_path), str(Path(layout.repo).resolve()),
                       time.time(), me.start_ticks if me else None, list(me.cmdline) if me else None)  # fmt: skip


def serve_gpu(
    recipe: Recipe,
    layout: Layout,
    *,
    print_k8s: bool = False,
    print_only: bool = False,
    image: str | None = None,
    tritonserver: str | None = None,
    k8s_out: Path | None = None,
    detach: bool = False,
    recipe_path: str = "RECIPE",
    echo=print,
):
    """`specdeploy serve` for a GPU backend.

    print_k8s: the Kubernetes manifests. print_only: write the image's build context (packaging.write_context,
    `image` is its base) and print the launch, `docker build` and `docker run`; start nothing. Otherwise run the
    pre-flight checks, start the server here and record it in layout.server_state so `status` and `stop` work;
    detach leaves it running and returns its state, else serve until Ctrl-C / SIGTERM and stop it.
    """
    from specdeploy.triton import server

    if print_k8s:
        text = k8s_yaml(recipe, layout, image=image)
        if k8s_out:
            Path(k8s_out).write_text(text)
            echo(f"wrote {k8s_out}")
        else:
            echo(text.rstrip())
        return None
    if print_only:
        context = packaging.write_context(recipe, layout, image)
        echo(f"# wrote {context / 'Dockerfile'} (specdeploy installed into the image, for docker and Kubernetes)")
    for line in print_lines(recipe, layout, image, tritonserver or TRITONSERVER):
        echo(line)
    if print_only:
        return None
    existing = server.ServerState.read(layout.server_state)
    if existing is not None and existing.running():
        raise ServerError(f"a server for this recipe is already running (pid {existing.pid}, grpc {existing.grpc_url})",
                          f"stop it first: specdeploy stop {recipe_path}")  # fmt: skip
    from specdeploy import preflight

    preflight.enforce(preflight.run_all(recipe, layout), echo)
    log_path = Path(layout.server_state) / server.LOG_FILE
    proc = start(recipe, layout, tritonserver, log_path, die_with_parent=not detach)
    state = server_state(recipe, layout, proc, log_path)
    state.write(Path(layout.server_state))
    echo(f"tritonserver is ready (pid {proc.pid}); http {state.http_port}, grpc {state.grpc_port}, metrics {state.metrics_port}")
    echo(f"  log: {log_path}")
    if detach:
        echo(f"detached; stop it with: specdeploy stop {recipe_path}")
        return state

    try:
        return server.serve_in_foreground(proc, log_path, lambda: server.stop_pid(proc.pid, process=proc), echo, state)
    finally:
        (Path(layout.server_state) / server.STATE_FILE).unlink(missing_ok=True)
