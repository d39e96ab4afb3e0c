"""The backends: the one place that knows, per backend, how to build, which repository models to write,
how to serve and stop, what `doctor` reports and which pre-flight checks apply.

    cpu            specdeploy's own CPU engines, python-backend models, the embedded tritonserver
    trtllm-engine  TensorRT engines from `trtllm-build` (TensorRT-LLM <= 1.1), Triton's tensorrtllm backend
    trtllm-llmapi  the LLM API (PyTorch backend), TensorRT-LLM's `llmapi` Triton model with model.yaml

Every other module asks `backends.of(recipe)` (or `backends.get(name)`) and calls the object; none compares
`recipe.backend` with a name (tests/test_backends.py scans the sources for that). The stage modules are imported
inside the methods, so config.py can take the list of names from here without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from specdeploy.errors import ConfigError

# TensorRT-LLM's own words (examples/quantization/quantize.py --qformat); config.QFORMATS is this tuple.
ALL_QFORMATS = ("full_prec", "fp8", "int8_sq", "int8_wo", "int4_awq")
# Repository layouts (recipe triton.layout): NVIDIA's tensorrtllm_backend all_models/inflight_batcher_llm, and
# TensorRT-LLM's triton_backend/all_models/llmapi (one python model around LLM(...), options in model.yaml).
IFB_LAYOUT, LLMAPI_LAYOUT = "inflight_batcher_llm", "llmapi"
LAYOUTS = (IFB_LAYOUT, LLMAPI_LAYOUT)


@dataclass(frozen=True)
class BlsLimits:
    """What specdeploy's speculative BLS takes on a backend: one sequence per request; streaming or not."""

    max_request_batch: int
    streaming: bool


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
class Backend:
    """What one backend is and does. The subclasses below implement the stage methods."""

    name: str
    summary: str
    qformats: tuple[str, ...]  # quantization formats its engines execute
    multi_rank: bool  # can shard a model (tp_size * pp_size > 1)
    exact_verification: bool  # batched verification bit-identical to target-only decoding by construction
    gpu: bool  # runs on NVIDIA GPUs: launch plans, docker image, GPU pre-flight checks
    checkpoint_format: str  # what `quantize` writes for it: "trtllm" (TensorRT-LLM checkpoint) | "hf" (ModelOpt HF export)
    dynamic_speculation: bool  # speculative.dynamic (draft_len_schedule / acceptance gate) has a meaning
    ngram_draft: bool  # draft.kind ngram is wired
    prequantized_models: bool  # loads pre-quantized ModelOpt Hugging Face exports as the model
    external_build: bool  # `build --dry-run` prints the external commands it would run
    tensorrt_engines: bool  # engines come from trtllm-build and load only in the release that built them
    default_image: str | None  # NGC base image the generated Dockerfile installs specdeploy into
    bls_limits: BlsLimits | None  # None: the speculative BLS is not part of this backend's repository
    layouts: tuple[str, ...]  # repository layouts it serves (LAYOUTS), the default first
    preflight_checks: tuple[str, ...]  # names in specdeploy.preflight.CHECKS, run in this order

    # ---- build
    def build(self, recipe, layout, *, force: bool = False, echo=print, dry_run: bool = False):
        raise NotImplementedError

    def expected_engine_fingerprint(self, recipe, layout, role: str) -> str | None:
        """What `build` would record for the engine of `role` now; None: not checked by the repository stage."""
        return None

    # ---- repository
    def engine_models(self, inp) -> list:
        """The ModelSpecs of `tensorrt_llm` and `tensorrt_llm_draft` in the shared inflight_batcher_llm layout."""
        raise NotImplementedError

    def finish_models(self, inp, specs: list) -> list:
        """The repository's models as this backend serves them (the engine backend renames tensors per release)."""
        return specs

    def write_repository(self, recipe, layout, recipe_path: str = "RECIPE", force: bool = False,
                         executor_factory: str | None = None) -> tuple[Path, bool]:  # fmt: skip
        """The recipe's layout: inflight_batcher_llm (shared models around `engine_models`) or llmapi."""
        from specdeploy.triton import llmapi, repository

        if recipe.layout == LLMAPI_LAYOUT:
            return llmapi.generate_repository(recipe, layout, recipe_path, force, executor_factory)
        return repository.generate_layout_repository(recipe, layout, recipe_path, force, executor_factory)

    def require_repository(self, recipe, layout, recipe_path: str = "RECIPE"):
        from specdeploy.triton import repository

        return repository.require_repository(recipe, layout, recipe_path=recipe_path)

    # ---- serve / stop
    def serve(self, recipe, layout, *, detach: bool, server_binary: str | None, recipe_path: str, echo=print,
              print_only: bool = False, print_k8s: bool = False, image: str | None = None):  # fmt: skip
        raise NotImplementedError

    def start(self, recipe, layout, *, server_binary: str | None = None, echo=print) -> Running:
        """Start the deployment for the pipeline (not recorded; dies with this process); ready when it returns."""
        raise NotImplementedError

    def stop(self, layout) -> str:
        """Stop the server `serve --detach` recorded (the same state file on every backend)."""
        from specdeploy.triton import server

        return server.stop(layout.server_state)

    # ---- doctor / pre-flight
    def usable(self, gpus, tensorrt_llm: str | None, has_trtllm_build: bool) -> bool:
        raise NotImplementedError

    def batches_in_flight(self, recipe) -> bool:
        """Whether the engine models step the concurrent requests of an instance together."""
        raise NotImplementedError

    def require_local(self, what: str, recipe) -> None:
        """Refuse `what` (a command that runs the CPU engines in this process) on a GPU backend."""
        if self.gpu:
            raise ConfigError(f"{what} runs the cpu backend; recipe {recipe.name} uses {self.name}",
                              "use a cpu recipe, or serve and validate the GPU deployment")  # fmt: skip


# ---------------------------------------------------------------- cpu


@dataclass(frozen=True)
class CpuBackend(Backend):
    def build(self, recipe, layout, *, force=False, echo=print, dry_run=False):
        if dry_run:
            raise ConfigError(
                f"--dry-run prints the external build commands of {', '.join(b.name for b in ALL if b.external_build)}; "
                f"backend {self.name!r} builds in-process",
                "run specdeploy check RECIPE to see its plan",
            )
        from specdeploy.engine import build_recipe

        return build_recipe(recipe, layout, force=force, echo=echo)

    def expected_engine_fingerprint(self, recipe, layout, role):
        from specdeploy.artifacts import Manifest
        from specdeploy.engine.build import engine_fingerprint

        checkpoint = Manifest.read(layout.checkpoint(role))
        if checkpoint is None:
            return None
        max_draft_len = recipe.speculative.max_draft_len if role == "target" else None
        return engine_fingerprint(recipe, role, checkpoint, max_draft_len)

    def engine_models(self, inp):
        from specdeploy.triton import repository

        return repository.cpu_engine_models(inp)

    def serve(self, recipe, layout, *, detach, server_binary, recipe_path, echo=print, print_only=False,
              print_k8s=False, image=None):  # fmt: skip
        from specdeploy.triton import llmapi, server

        if print_only or print_k8s:
            raise ConfigError(f"--print-only/--print-k8s describe GPU deployments; backend {self.name} serves here",
                              f"run: specdeploy serve {recipe_path}")  # fmt: skip
        self.require_repository(recipe, layout, recipe_path)
        return server.serve(layout.repo, layout.server_state, recipe.triton, binary=server_binary, detach=detach,
                            echo=echo, recipe_path=recipe_path, extra_args=llmapi.server_args(recipe))  # fmt: skip

    def start(self, recipe, layout, *, server_binary=None, echo=print):
        from specdeploy.triton import llmapi, server

        t = recipe.triton
        ports = server.Ports.pick(t.grpc_port, t.http_port, t.metrics_port)
        running = server.start(layout.repo, ports, Path(layout.server_state) / server.LOG_FILE, binary=server_binary,
                               extra_args=llmapi.server_args(recipe))
        try:
            server.wait_ready(running, t.startup_timeout_s)
        except BaseException:
            running.stop()
            raise
        s = running.state
        return StartedServer(s.grpc_url, s.metrics_url, f"tritonserver (pid {s.pid}, grpc {s.grpc_url}, log {s.log})",
                             running.stop)  # fmt: skip

    def usable(self, gpus, tensorrt_llm, has_trtllm_build):
        return True

    def batches_in_flight(self, recipe):
        return recipe.triton.inflight_batching


# ---------------------------------------------------------------- the GPU backends


@dataclass(frozen=True)
class GpuBackend(Backend):
    def batches_in_flight(self, recipe):
        return True  # TensorRT-LLM's batch manager and the LLM API batch in flight

    def build(self, recipe, layout, *, force=False, echo=print, dry_run=False):
        from specdeploy import trtllm

        builder = trtllm.build_engine_recipe if self.tensorrt_engines else trtllm.build_llmapi_recipe
        return builder(recipe, layout, force=force, dry_run=dry_run, echo=echo)

    def serve(self, recipe, layout, *, detach, server_binary, recipe_path, echo=print, print_only=False,
              print_k8s=False, image=None):  # fmt: skip
        from specdeploy import launch

        return launch.serve_gpu(recipe, layout, print_k8s=print_k8s, print_only=print_only, image=image,
                                tritonserver=server_binary, detach=detach, recipe_path=recipe_path, echo=echo)  # fmt: skip

    def start(self, recipe, layout, *, server_binary=None, echo=print):
        from specdeploy import launch, preflight
        from specdeploy.triton import server

        self.require_repository(recipe, layout)
        preflight.enforce(preflight.run_all(recipe, layout), echo)
        log_path = Path(layout.server_state) / server.LOG_FILE
        proc = launch.start(recipe, layout, server_binary, log_path)
        state = launch.server_state(recipe, layout, proc, log_path)
        return StartedServer(state.grpc_url, state.metrics_url, f"tritonserver (pid {proc.pid}, grpc {state.grpc_url}, "
                             f"log {log_path})", lambda: server.stop_pid(proc.pid, process=proc))  # fmt: skip


@dataclass(frozen=True)
class TrtllmEngineBackend(GpuBackend):
    def expected_engine_fingerprint(self, recipe, layout, role):
        return None  # trtllm.build_engine_recipe checks its own fingerprints; the repository reads the manifests

    def engine_models(self, inp):
        from specdeploy.triton import gpu_models

        return gpu_models.trtllm_engine_models(inp)

    def finish_models(self, inp, specs):
        from specdeploy.triton import gpu_models

        # the C++ backend's tensor names changed between releases: follow the one the engines were built for
        return gpu_models.follow_backend_names(specs, gpu_models.backend_names(gpu_models.engine_trtllm_version(inp)))

    def usable(self, gpus, tensorrt_llm, has_trtllm_build):
        return bool(gpus) and tensorrt_llm is not None and has_trtllm_build


@dataclass(frozen=True)
class TrtllmLlmapiBackend(GpuBackend):
    def engine_models(self, inp):
        raise AssertionError("the llmapi layout has no separate engine models")  # layouts: llmapi only

    def usable(self, gpus, tensorrt_llm, has_trtllm_build):
        return bool(gpus) and tensorrt_llm is not None


# ---------------------------------------------------------------- the registry

_COMMON_CHECKS = ("draft_len", "tokenizer")

CPU = CpuBackend(
    name="cpu",
    summary="specdeploy's CPU engines in python-backend models on the embedded tritonserver (no GPU)",
    qformats=ALL_QFORMATS,
    multi_rank=False,
    exact_verification=True,
    gpu=False,
    checkpoint_format="trtllm",
    dynamic_speculation=True,
    ngram_draft=True,
    prequantized_models=False,
    external_build=False,
    tensorrt_engines=False,
    default_image=None,
    bls_limits=None,  # the CPU BLS streams and takes any batch of single-sequence requests
    layouts=(IFB_LAYOUT, LLMAPI_LAYOUT),
    preflight_checks=_COMMON_CHECKS,
)
# NGC Triton + TensorRT-LLM images (nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3). 25.03 ships TensorRT-LLM
# 0.18 with trtllm-build (examples/draft_target_model/README.md); the LLM-API path takes the newest monthly release
# (Triton release notes 26.10). Which TensorRT-LLM a tag carries is checked when the image is built (packaging.py).
TRTLLM_ENGINE = TrtllmEngineBackend(
    name="trtllm-engine",
    summary="TensorRT engines from trtllm-build (TensorRT-LLM <= 1.1) behind Triton's tensorrtllm backend + specdeploy's BLS",
    qformats=ALL_QFORMATS,
    multi_rank=True,
    exact_verification=False,
    gpu=True,
    checkpoint_format="trtllm",
    dynamic_speculation=False,
    ngram_draft=False,
    prequantized_models=False,
    external_build=True,
    tensorrt_engines=True,
    default_image="nvcr.io/nvidia/tritonserver:25.03-trtllm-python-py3",
    # specdeploy's own BLS (not NVIDIA's, whose limits are tensorrtllm_backend issue #676) streams in decoupled
    # mode and takes one sequence per request; concurrent requests are batched in flight by the tensorrt_llm models.
    bls_limits=BlsLimits(max_request_batch=1, streaming=True),
    layouts=(IFB_LAYOUT,),
    preflight_checks=(*_COMMON_CHECKS, "fp8", "kv_cache", "memory", "bls"),
)
# The LLM API (PyTorch backend) loads ModelOpt Hugging Face checkpoints: FP8 and INT4 AWQ, not the INT8
# SmoothQuant/weight-only kernels of the TensorRT engine path.
TRTLLM_LLMAPI = TrtllmLlmapiBackend(
    name="trtllm-llmapi",
    summary="the LLM API (PyTorch backend, current TensorRT-LLM) in TensorRT-LLM's llmapi Triton model",
    qformats=("full_prec", "fp8", "int4_awq"),
    multi_rank=True,
    exact_verification=False,
    gpu=True,
    checkpoint_format="hf",
    dynamic_speculation=True,
    ngram_draft=True,
    prequantized_models=True,
    external_build=True,
    tensorrt_engines=False,
    default_image="nvcr.io/nvidia/tritonserver:26.10-trtllm-python-py3",
    bls_limits=None,
    layouts=(LLMAPI_LAYOUT,),
    preflight_checks=(*_COMMON_CHECKS, "fp8", "kv_cache", "memory", "llmapi"),
)

ALL: tuple[Backend, ...] = (CPU, TRTLLM_ENGINE, TRTLLM_LLMAPI)
NAMES: tuple[str, ...] = tuple(b.name for b in ALL)
DEFAULT = CPU.name


def get(name: str) -> Backend:
    for backend in ALL:
        if backend.name == name:
            return backend
    raise ConfigError(f"unknown backend {name!r}", f"choices: {', '.join(NAMES)}")


def of(recipe) -> Backend:
    return get(recipe.backend)


def doctor_lines(gpus=None) -> list[str]:
    """`specdeploy doctor` lines: GPUs, compute capability, memory, TensorRT-LLM, trtllm-build, usable backends."""
    import shutil

    from specdeploy import gpu as gpu_probe

    gpus = gpu_probe.probe() if gpus is None else gpus
    version = gpu_probe.tensorrt_llm_version()
    tool = shutil.which("trtllm-build")

    def line(ok, what, detail):
        return f"{ {True: 'ok  ', False: 'no  ', None: '--  '}[ok]}{what:18s} {detail}"

    if not gpus:
        lines = [line(None, "GPU", "none found (nvidia-smi/torch.cuda); GPU backends can only dry-run here")]
    else:
        lines = []
        for g in gpus:
            cc = "?" if g.compute_capability is None else "{}.{}".format(*g.compute_capability)
            fp8 = g.compute_capability is not None and g.compute_capability >= (8, 9)
            lines.append(line(True, f"GPU {g.index}", f"{g.name}, {g.memory_gib:.1f} GiB, compute capability {cc}"
                              f"{'' if fp8 else ' (no FP8: needs 8.9+)'}"))  # fmt: skip
    lines.append(line(version is not None, "tensorrt_llm", version or "not installed"))
    lines.append(line(tool is not None, "trtllm-build", tool or "not on PATH (TensorRT-LLM <= 1.1 ships it)"))
    usable = [b.name for b in ALL if b.usable(gpus, version, tool is not None)]
    lines.append(line(True, "usable backends", ", ".join(usable)))
    return lines
