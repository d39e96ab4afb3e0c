"""What each backend does: its stages composed, behind one interface (build, repository, serve, start, stop).

    cpu            the CPU engine build (deploy/cpu_build.py), python-backend engine models, the embedded tritonserver
    trtllm-engine  trtllm-build (gpu/trtllm_build.py), Triton's tensorrtllm models (gpu/triton_models.py), the GPU
    launch trtllm-llmapi  the LLM-API options (gpu/llmapi_options.py, gpu/trtllm.py), TensorRT-LLM's llmapi model
    (gpu/llmapi_repository.py), the GPU launch

What a backend *is* (its facts) is `specdeploy.core.backends`, in the core; this layer sits above the stages and imports
them, and only the pipeline and the CLI import it (docs/architecture.md). The per-backend choices here are made on
those facts, never on a backend's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from specdeploy.core import backends
from specdeploy.core.errors import ConfigError


class Running(Protocol):
    """A server the pipeline started: where to reach it, and how to stop it."""

    grpc_url: str
    metrics_url: str
    description: str

    def stop(self) -> None: ...


@dataclass(frozen=True)
class StartedServer:
    grpc_url: str
    metrics_url: str
    description: str
    _stop: object  # () -> None

    def stop(self) -> None:
        self._stop()


@dataclass(frozen=True)
class BackendStages:
    """The stages of one backend (`backend`: its facts). The subclasses below implement the stage methods."""

    backend: backends.Backend

    # ---- build
    def build(self, recipe, layout, *, force: bool = False, echo=print, dry_run: bool = False):
        raise NotImplementedError

    # ---- repository
    def engine_models(self, inp) -> list:
        """The ModelSpecs of `tensorrt_llm` and `tensorrt_llm_draft` in the shared inflight_batcher_llm layout."""
        raise NotImplementedError

    def finish_models(self, inp, specs: list) -> list:
        """The repository's models as this backend serves them (the engine backend renames tensors per release)."""
        return specs

    def write_repository(
        self,
        recipe,
        layout,
        recipe_path: str = "RECIPE",
        force: bool = False,
        executor_factory: str | None = None,
        trtllm_src: Path | None = None,
    ) -> tuple[Path, bool]:
        """`specdeploy repo`: the recipe's layout, inflight_batcher_llm (the shared models around `engine_models`)
        or llmapi; returns (path, written). An up-to-date repository is kept. trtllm_src: a TensorRT-LLM checkout
        the GPU llmapi models take model.py and helpers.py from."""
        from specdeploy.gpu import llmapi_repository as llmapi
        from specdeploy.triton import repository

        if trtllm_src is not None and not (self.backend.gpu and recipe.layout == backends.LLMAPI_LAYOUT):
            raise ConfigError(
                "--trtllm-src is for TensorRT-LLM's llmapi model on a GPU backend; recipe "
                f"{recipe.name} uses backend {recipe.backend}, layout {recipe.layout}",
                "drop --trtllm-src",
            )
        if recipe.layout == backends.LLMAPI_LAYOUT:
            return llmapi.generate_repository(recipe, layout, recipe_path, force, executor_factory, trtllm_src)
        return repository.generate_layout_repository(
            recipe, layout, self.engine_models, recipe_path, force, executor_factory, finish_models=self.finish_models
        )

    def require_repository(self, recipe, layout, recipe_path: str = "RECIPE"):
        from specdeploy.triton import repository

        return repository.require_repository(recipe, layout, recipe_path=recipe_path)

    # ---- serve / stop
    def serve(
        self,
        recipe,
        layout,
        *,
        detach: bool,
        server_binary: str | None,
        recipe_path: str,
        echo=print,
        print_only: bool = False,
        print_k8s: bool = False,
        image: str | None = None,
    ):
        raise NotImplementedError

    def start(self, recipe, layout, *, server_binary: str | None = None, echo=print) -> Running:
        """Start the deployment for the pipeline (not recorded; dies with this process); ready when it returns."""
        raise NotImplementedError

    def stop(self, layout) -> str:
        """Stop the server `serve --detach` recorded (the same state file on every backend)."""
        from specdeploy.triton import server

        return server.stop(layout.server_state)


# ---------------------------------------------------------------- cpu


@dataclass(frozen=True)
class CpuStages(BackendStages):
    def build(self, recipe, layout, *, force=False, echo=print, dry_run=False):
        if dry_run:
            raise ConfigError(
                "--dry-run prints the external build commands of"
                f" {', '.join(b.name for b in backends.ALL if b.external_build)}; backend {self.backend.name!r} builds"
                " in-process",
                "run specdeploy check RECIPE to see its plan",
            )
        from specdeploy.deploy.cpu_build import build_recipe

        return build_recipe(recipe, layout, force=force, echo=echo)

    def engine_models(self, inp):
        from specdeploy.triton import layout_models

        return layout_models.cpu_engine_models(inp)

    def serve(
        self,
        recipe,
        layout,
        *,
        detach,
        server_binary,
        recipe_path,
        echo=print,
        print_only=False,
        print_k8s=False,
        image=None,
    ):
        from specdeploy.gpu import llmapi_repository as llmapi
        from specdeploy.triton import server

        if print_only or print_k8s:
            raise ConfigError(
                f"--print-only/--print-k8s describe GPU deployments; backend {self.backend.name} serves here",
                f"run: specdeploy serve {recipe_path}",
            )
        self.require_repository(recipe, layout, recipe_path)
        return server.serve(
            layout.repo,
            layout.server_state,
            recipe.triton,
            binary=server_binary,
            detach=detach,
            echo=echo,
            recipe_path=recipe_path,
            extra_args=llmapi.server_args(recipe),
        )

    def start(self, recipe, layout, *, server_binary=None, echo=print):
        from specdeploy.gpu import llmapi_repository as llmapi
        from specdeploy.triton import ports as triton_ports
        from specdeploy.triton import server

        t = recipe.triton
        ports = triton_ports.Ports.pick(t.grpc_port, t.http_port, t.metrics_port)
        running = server.start(
            layout.repo,
            ports,
            Path(layout.server_state) / server.LOG_FILE,
            binary=server_binary,
            extra_args=llmapi.server_args(recipe),
        )
        try:
            server.wait_ready(running, t.startup_timeout_s)
        except BaseException:
            running.stop()
            raise
        s = running.state
        return StartedServer(
            s.grpc_url, s.metrics_url, f"tritonserver (pid {s.pid}, grpc {s.grpc_url}, log {s.log})", running.stop
        )


# ---------------------------------------------------------------- the GPU backends


@dataclass(frozen=True)
class GpuStages(BackendStages):
    def build(self, recipe, layout, *, force=False, echo=print, dry_run=False):
        from specdeploy.deploy import preflight
        from specdeploy.gpu import trtllm, trtllm_build

        # The pre-flight's LLM-API check asks trtllm how the recipe maps to a release's options, so trtllm cannot
        # import preflight (they would import each other): the build gets the checks from here and runs them once
        # it has probed the GPUs. A real build stops on errors; a dry run lists the findings.
        def run_preflight(gpus):
            findings = preflight.run_all(recipe, layout, gpus, check_built_engine=False)
            return findings if dry_run else preflight.enforce(findings, echo)

        builder = trtllm_build.build_engine_recipe if self.backend.tensorrt_engines else trtllm.build_llmapi_recipe
        return builder(recipe, layout, force=force, dry_run=dry_run, echo=echo, run_preflight=run_preflight)

    def serve(
        self,
        recipe,
        layout,
        *,
        detach,
        server_binary,
        recipe_path,
        echo=print,
        print_only=False,
        print_k8s=False,
        image=None,
    ):
        from specdeploy.gpu import launch

        if not (print_only or print_k8s):  # a real start serves the repository: it must be there and current
            self.require_repository(recipe, layout, recipe_path)
        return launch.serve_gpu(
            recipe,
            layout,
            print_k8s=print_k8s,
            print_only=print_only,
            image=image,
            tritonserver=server_binary,
            detach=detach,
            recipe_path=recipe_path,
            echo=echo,
        )

    def start(self, recipe, layout, *, server_binary=None, echo=print):
        from specdeploy.deploy import preflight
        from specdeploy.gpu import launch
        from specdeploy.triton import server

        self.require_repository(recipe, layout)
        preflight.enforce(preflight.run_all(recipe, layout), echo)
        log_path = Path(layout.server_state) / server.LOG_FILE
        proc = launch.start(recipe, layout, server_binary, log_path)
        state = launch.server_state(recipe, layout, proc, log_path)
        return StartedServer(
            state.grpc_url,
            state.metrics_url,
            f"tritonserver (pid {proc.pid}, grpc {state.grpc_url}, log {log_path})",
            lambda: server.stop_pid(proc.pid, process=proc),
        )


@dataclass(frozen=True)
class TrtllmEngineStages(GpuStages):
    def engine_models(self, inp):
        from specdeploy.gpu import triton_models as gpu_models

        return gpu_models.trtllm_engine_models(inp)

    def finish_models(self, inp, specs):
        from specdeploy.gpu import triton_models as gpu_models

        # the C++ backend's tensor names changed between releases: follow the one the engines were built for
        return gpu_models.follow_backend_names(specs, gpu_models.backend_names(gpu_models.engine_trtllm_version(inp)))


@dataclass(frozen=True)
class TrtllmLlmapiStages(GpuStages):
    def engine_models(self, inp):
        raise AssertionError("the llmapi layout has no separate engine models")  # layouts: llmapi only


# ---------------------------------------------------------------- one per backend of specdeploy.core.backends.ALL

ALL: tuple[BackendStages, ...] = (
    CpuStages(backends.CPU),
    TrtllmEngineStages(backends.TRTLLM_ENGINE),
    TrtllmLlmapiStages(backends.TRTLLM_LLMAPI),
)


def get(name: str) -> BackendStages:
    backend = backends.get(name)  # an unknown name: its ConfigError lists the choices
    return next(stages for stages in ALL if stages.backend is backend)


def of(recipe) -> BackendStages:
    return get(recipe.backend)
