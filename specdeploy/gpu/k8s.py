"""Kubernetes manifests for a GPU deployment: the Deployment (GPU requests, health probes), Service and
HorizontalPodAutoscaler, and beside them the canary's control arm, its HTTPRoute, a ServiceMonitor and the Grafana
dashboard (`k8s_yaml` writes them all, with the image and prometheus-adapter notes)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from specdeploy.core import backends
from specdeploy.core.artifacts import Layout
from specdeploy.gpu import image as packaging
from specdeploy.gpu.launch_command import (
    TRITONSERVER,
    LaunchPlan,
    _ports,
    container_command,
    container_env,
    launch_plan,
)
from specdeploy.recipe.config import Recipe

# Triton's Prometheus counter of cumulative queue time; an adapter rule turns it into a per-second rate.
HPA_METRIC = "nv_inference_queue_duration_us"


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
        "command": container_command(plan, layout),
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
        "readinessProbe": {
            "httpGet": {"path": "/v2/health/ready", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/v2/health/live", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
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
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(ports["metrics"]),
                        "prometheus.io/path": "/metrics",
                    },
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
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": HPA_METRIC},
                        "target": {"type": "AverageValue", "averageValue": str(queue_us_per_second)},
                    },
                }
            ],
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
    name = deployment["metadata"]["name"]
    percent = recipe.canary.control_percent
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    http_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    group = {"specdeploy.io/recipe": name}
    for obj in (deployment, service):
        obj["metadata"]["labels"].update(group)
    for labels in (
        deployment["spec"]["selector"]["matchLabels"],
        deployment["spec"]["template"]["metadata"]["labels"],
        service["spec"]["selector"],
    ):
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
    route = _http_route(name, service, gateway, backends, http_port)
    monitor = _service_monitor(name, service, group)
    config_map = _dashboard_config_map(recipe, name, group)
    return out + [route, monitor, config_map]


def _http_route(name: str, service: dict, gateway: str, backend_refs: list[dict], http_port: int) -> dict:
    """The Gateway API HTTPRoute: the speculative entry point split between the arms by weight."""
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": name, "labels": dict(service["metadata"]["labels"])},
        "spec": {
            "parentRefs": [{"name": gateway}],
            "rules": [
                # the speculative entry point is split between the arms; everything else (ensemble, health) goes
                # to the speculative Deployment, which serves the same models
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/v2/models/tensorrt_llm_bls"}}],
                    "backendRefs": backend_refs,
                },
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                    "backendRefs": [{"name": name, "port": http_port}],
                },
            ],
        },
    }


def _service_monitor(name: str, service: dict, group: dict) -> dict:
    """The Prometheus Operator ServiceMonitor scraping the metrics ports of both arms' Services."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": name, "labels": dict(service["metadata"]["labels"])},
        "spec": {
            "selector": {"matchLabels": dict(group)},
            "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}],
        },
    }


def _dashboard_config_map(recipe: Recipe, name: str, group: dict) -> dict:
    """The Grafana dashboard in a ConfigMap (label grafana_dashboard: "1" for Grafana's sidecar)."""
    import json

    from specdeploy.core.metrics import dashboard as core_metrics_dashboard

    dashboard = core_metrics_dashboard.grafana_dashboard(
        f"specdeploy {recipe.name}", recipe.cost.machine_price_per_hour, recipe.cost.currency
    )
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name[:53]}-dashboard", "labels": {**group, "grafana_dashboard": "1"}},
        "data": {f"{name}.json": json.dumps(dashboard, indent=1)},
    }


def _control_arm(deployment: dict, service: dict, name: str) -> tuple[dict, dict]:
    """The control Deployment and Service: copies of the speculative ones whose BLS sends every request down the
    plain path (CANARY_ENV=100), labelled arm "control"."""
    import copy

    control = copy.deepcopy(deployment)
    control_name = f"{name[:55]}-control"
    control["metadata"]["name"] = control_name
    for labels in (
        control["metadata"]["labels"],
        control["spec"]["selector"]["matchLabels"],
        control["spec"]["template"]["metadata"]["labels"],
    ):
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
    if not recipe.draft.stages_head or not backends.of(recipe).gpu:
        return ""
    from specdeploy.gpu import llmapi_options

    return (
        f"# {recipe.draft.head_name}: {layout.engine('draft')} (staged from "
        f"{llmapi_options.eagle3_head_source(recipe, layout)} by "
        "specdeploy build); speculative_config.speculative_model names that path.\n"
    )


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
