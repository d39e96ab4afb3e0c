"""The command that starts tritonserver for a GPU deployment, and its container equivalent.

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
- `trtllm-llmapi`: one tritonserver (under `mpirun -n 1` when TP x PP > 1, as NVIDIA's launcher); LLM(...) inside
  the llmapi model starts its own TP/PP workers.

Nothing here needs a GPU to produce commands.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from specdeploy.core import backends
from specdeploy.core.artifacts import Layout
from specdeploy.core.errors import ConfigError
from specdeploy.gpu import image as packaging
from specdeploy.recipe.config import Recipe

TRITONSERVER = "/opt/tritonserver/bin/tritonserver"  # in NGC Triton images
DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}


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
        raise ConfigError(
            f"launch plans are for GPU backends; recipe backend is {recipe.backend!r}",
            "the cpu backend starts with specdeploy serve",
        )
    if not backend.tensorrt_engines:
        # the llmapi model sets max_batch_size/decoupled in auto_complete_config: keep auto-complete on
        from specdeploy.gpu import llmapi_repository as llmapi

        args = [*_server_args(repo, ports, 0, auto_complete=True), *llmapi.server_args(recipe)]
        # NVIDIA's llmapi launch (tensorrtllm_backend@0b9d7d5 docs/llmapi.md: launch_triton_server.py with its default
        # --world_size 1) runs one tritonserver under `mpirun -n 1` unless --no-mpi, which it allows at world size 1
        # only (NVIDIA/TensorRT-LLM@0a2e2c1 triton_backend/scripts/launch_triton_server.py get_cmd); model.py
        # (@044a90d) hands LLM(...) the MPI world only when it is larger than 1. So: mpirun -n 1 when TP x PP > 1.
        command = [tritonserver, *args]
        if target_ranks > 1:
            command = ["mpirun", "--allow-run-as-root", "-n", "1", *command]
        return LaunchPlan("llmapi", command, gpus=target_ranks)
    if mode == "auto":
        mode = "single" if gpus == 1 else "orchestrator"
    if mode == "single":
        return LaunchPlan("single", [tritonserver, *_server_args(repo, ports, 0, auto_complete=False)], gpus=1)
    if mode != "orchestrator":
        raise ConfigError(f"unknown launch mode {mode!r}", "choices: auto, single, orchestrator")
    env = {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1"}
    memory = [
        "--pinned-memory-pool-byte-size=0",
        "--enable-peer-access=false",
        *[f"--cuda-memory-pool-byte-size={gpu}:0" for gpu in range(gpus)],
    ]
    args = _server_args(repo, ports, 0, auto_complete=False)
    cmd = ["mpirun", "--allow-run-as-root", "-n", "1", tritonserver, *args[:4], *memory, *args[4:]]
    return LaunchPlan("orchestrator", cmd, env, gpus)


def container_env(plan: LaunchPlan) -> dict[str, str]:
    """The launch environment inside the image: specdeploy is installed there, so no host SPECDEPLOY_SITE."""
    return {k: v for k, v in plan.env.items() if k != "SPECDEPLOY_SITE"}


def container_command(plan: LaunchPlan, layout: Layout) -> list[str]:
    """The launch inside the image. The llmapi models first get the image's own TensorRT-LLM model.py and helpers.py
    (staged at its build, triton.llmapi_upstream), so the repository runs the Python of the release it is served by."""
    if plan.mode != "llmapi":
        return plan.command
    from specdeploy.gpu import llmapi_repository as llmapi
    from specdeploy.gpu import llmapi_upstream

    staged = [f"{llmapi_upstream.STAGED_DIR}/{f}" for f in llmapi_upstream.UPSTREAM_FILES]
    repo = Path(layout.repo).resolve()
    copies = " && ".join(shlex.join(["cp", *staged, f"{repo / model / '1'}/"]) for model in llmapi.MODELS)
    return ["sh", "-c", f'{copies} && exec "$@"', "specdeploy-llmapi", *plan.command]


def docker_command(plan: LaunchPlan, recipe: Recipe, layout: Layout, image: str | None = None) -> list[str]:
    """The same launch inside the image `docker build` makes from packaging.write_context (the NGC TensorRT-LLM
    Triton image with specdeploy installed); the project root is mounted at its own path so the engine paths
    written into config.pbtxt stay valid. Nothing from the host's site-packages is mounted."""
    root = str(Path(layout.root).resolve())
    ports = _ports(recipe)
    cmd = [
        "docker",
        "run",
        "--rm",
        "--gpus",
        "all",
        "--ipc=host",
        "--shm-size=2g",
        "--ulimit",
        "memlock=-1",
        "--ulimit",
        "stack=67108864",
    ]
    for port in ports.values():
        cmd += ["-p", f"{port}:{port}"]
    cmd += ["-v", f"{root}:{root}", "-w", root]
    for key, value in container_env(plan).items():
        cmd += ["-e", f"{key}={value}"]
    return cmd + [image or packaging.image_tag(recipe, layout), *container_command(plan, layout)]
