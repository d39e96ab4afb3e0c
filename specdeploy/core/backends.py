"""The backends: what each one is, as pure data that the recipe checks, the stages and the CLI ask.

    cpu            specdeploy's own CPU engines, python-backend models, the embedded tritonserver
    trtllm-engine  TensorRT engines from `trtllm-build` (TensorRT-LLM <= 1.1), Triton's tensorrtllm backend
    trtllm-llmapi  the LLM API (PyTorch backend), TensorRT-LLM's `llmapi` Triton model with model.yaml

Every other module asks `backends.of(recipe)` (or `backends.get(name)`) for a fact; none compares `recipe.backend`
with a name (tests/test_backends.py scans the sources for that). What a backend *does* (build, write its
repository, serve, start, stop) is `specdeploy.deploy.backend_stages`, which composes the stages; this module imports
no stage, so the recipe (config.py) and every stage can read these facts without an import cycle
(docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdeploy.core.errors import ConfigError

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


@dataclass(frozen=True)
class Backend:
    """What one backend is. Pure data and questions answered from it; what it does: specdeploy.deploy.backend_stages."""

    name: str
    summary: str
    qformats: tuple[str, ...]  # quantization formats its engines execute
    multi_rank: bool  # can shard a model (tp_size * pp_size > 1)
    exact_verification: bool  # batched verification bit-identical to target-only decoding by construction
    gpu: bool  # runs on NVIDIA GPUs (TensorRT-LLM): launch plans, docker image, GPU pre-flight checks
    checkpoint_format: (
        str  # what `quantize` writes for it: "trtllm" (TensorRT-LLM checkpoint) | "hf" (ModelOpt HF export)
    )
    dynamic_speculation: bool  # speculative.dynamic (draft_len_schedule / acceptance gate) has a meaning
    ngram_draft: bool  # draft.kind ngram is wired
    eagle3_draft: bool  # draft.kind eagle3 (an EAGLE-3 head on the target's hidden states) is wired
    prequantized_models: bool  # loads pre-quantized ModelOpt Hugging Face exports as the model
    external_build: bool  # `build --dry-run` prints the external commands it would run
    tensorrt_engines: bool  # engines come from trtllm-build and load only in the release that built them
    always_batches_in_flight: bool  # its engine models batch in flight whatever triton.inflight_batching says
    # NGC base image the generated Dockerfile installs specdeploy into when the recipe names none; None on
    # trtllm-llmapi, whose recipe's trtllm_version picks it (trtllm_images.image_for), and on cpu (no image)
    default_image: str | None
    bls_limits: BlsLimits | None  # None: the speculative BLS is not part of this backend's repository
    layouts: tuple[str, ...]  # repository layouts it serves (LAYOUTS), the default first
    preflight_checks: tuple[str, ...]  # names in specdeploy.deploy.preflight.CHECKS, run in this order
    no_eagle3_because: str = ""  # why draft.kind eagle3 is not wired (eagle3_draft False), for the refusal
    # speculative.draft_p_min (the EAGLE-3 head's confidence cut-off) is carried out; TensorRT-LLM's EAGLE-3 options
    # have no such field (specdeploy/gpu/llmapi_versions.py lists the fields of each release)
    draft_confidence_cutoff: bool = False
    suffix_draft: bool = False  # draft.kind suffix (the standalone suffix automaton) is wired
    auto_draft: bool = False  # draft.kind auto (TensorRT-LLM's AutoDecodingConfig: the LLM API picks the method)
    mtp_draft: bool = False  # draft.kind mtp (the target's own MTP heads, TensorRT-LLM's MTPDecodingConfig)
    parallel_drafts: bool = False  # draft.kind pard / dflash (drafters that propose all k tokens in one pass)
    # quantization.per_token on int8_sq: the CPU engine quantizes activations per token at build time from ModelOpt's
    # checkpoint. ModelOpt 0.47 exports int8_sq as W8A8_SQ_PER_CHANNEL only (modelopt/torch/export/quant_utils.py:728),
    # and TensorRT-LLM's per-token SmoothQuant comes from its own convert_checkpoint.py (--smoothquant --per_token
    # --per_channel), which specdeploy does not run: the GPU backends refuse it rather than build something unchecked
    int8_sq_per_token: bool = False

    def batches_in_flight(self, recipe) -> bool:
        """Whether the engine models step the concurrent requests of an instance together."""
        return self.always_batches_in_flight or recipe.triton.inflight_batching

    def usable(self, gpus, tensorrt_llm: str | None, has_trtllm_build: bool) -> bool:
        """Whether this machine can run it: the GPU backends need a GPU and TensorRT-LLM, and TensorRT engines
        the `trtllm-build` of the release that builds them."""
        if not self.gpu:
            return True
        return bool(gpus) and tensorrt_llm is not None and (has_trtllm_build or not self.tensorrt_engines)

    def require_local(self, what: str, recipe) -> None:
        """Refuse `what` (a command that runs the CPU engines in this process) on a GPU backend."""
        if self.gpu:
            raise ConfigError(
                f"{what} runs the cpu backend; recipe {recipe.name} uses {self.name}",
                "use a cpu recipe, or serve and validate the GPU deployment",
            )


# ---------------------------------------------------------------- the table

_COMMON_CHECKS = ("draft_len", "tokenizer", "eagle3_head")

CPU = Backend(
    name="cpu",
    summary="specdeploy's CPU engines in python-backend models on the embedded tritonserver (no GPU)",
    qformats=ALL_QFORMATS,
    multi_rank=False,
    exact_verification=True,
    gpu=False,
    checkpoint_format="trtllm",
    dynamic_speculation=True,
    ngram_draft=True,
    eagle3_draft=True,  # specdeploy's own fused CPU engine runs the head
    draft_confidence_cutoff=True,  # Eagle3Drafter.draft(k, p_min)
    suffix_draft=True,  # speculation.ngram.SuffixProposer
    int8_sq_per_token=True,  # deploy/cpu_compile.py SQ_PER_TOKEN
    prequantized_models=False,
    external_build=False,
    tensorrt_engines=False,
    always_batches_in_flight=False,  # triton.inflight_batching decides (tensorrt_llm.py's BatchScheduler or not)
    default_image=None,
    bls_limits=None,  # the CPU BLS streams and takes any batch of single-sequence requests
    layouts=(IFB_LAYOUT, LLMAPI_LAYOUT),
    preflight_checks=_COMMON_CHECKS,
)
# NGC Triton + TensorRT-LLM images (nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3). 25.03 ships TensorRT-LLM
# 0.18 with trtllm-build (examples/draft_target_model/README.md); which release each tag carries: trtllm_images.
TRTLLM_ENGINE = Backend(
    name="trtllm-engine",
    summary=(
        "TensorRT engines from trtllm-build (TensorRT-LLM <= 1.1) behind Triton's tensorrtllm backend +"
        " specdeploy's BLS"
    ),
    qformats=ALL_QFORMATS,
    multi_rank=True,
    exact_verification=False,
    gpu=True,
    checkpoint_format="trtllm",
    dynamic_speculation=False,
    ngram_draft=False,
    eagle3_draft=False,  # see no_eagle3_because
    prequantized_models=False,
    external_build=True,
    tensorrt_engines=True,
    always_batches_in_flight=True,  # TensorRT-LLM's batch manager
    default_image="nvcr.io/nvidia/tritonserver:25.03-trtllm-python-py3",
    # specdeploy's own BLS (not NVIDIA's, whose limits are tensorrtllm_backend issue #676) streams in decoupled
    # mode and takes one sequence per request; concurrent requests are batched in flight by the tensorrt_llm models.
    bls_limits=BlsLimits(max_request_batch=1, streaming=True),
    layouts=(IFB_LAYOUT,),
    preflight_checks=(*_COMMON_CHECKS, "fp8", "kv_cache", "memory", "bls"),
    # The TensorRT engine path never built EAGLE-3. Its EAGLE is the EAGLE-1 draft network of
    # tensorrt_llm/models/eagle/model.py, converted by examples/eagle/convert_checkpoint.py and built with
    # `trtllm-build --speculative_decoding_mode eagle` (examples/eagle/README.md @06255cb: "Only EAGLE-1 is
    # supported"; later READMEs add EAGLE-2's dynamic tree at run time, same EAGLE-1 checkpoint). EAGLE-3 came to
    # TensorRT-LLM on the PyTorch backend only: NVIDIA/TensorRT-LLM PR #10124 (2025-12-18): "Eagle (v1, v2) are
    # fundamentally different from Eagle3", "TRTLLM pytorch backend does not support Eagle and only supports
    # Eagle3"; issue #10396 (1.2.0rc6, `--backend trt`): the engine path takes only the EagleForCausalLM (EAGLE-1)
    # architecture. The engine path itself ends with 1.1 (docs/source/legacy/tensorrt-backend-removal.md).
    no_eagle3_because=(
        "TensorRT-LLM's engine path (trtllm-build --speculative_decoding_mode eagle) builds only "
        "EAGLE-1/2 draft networks; EAGLE-3 heads run on its PyTorch backend (the LLM API) only"
    ),
)
# The LLM API (PyTorch backend) loads ModelOpt Hugging Face checkpoints: FP8 and INT4 AWQ, not the INT8
# SmoothQuant/weight-only kernels of the TensorRT engine path.
TRTLLM_LLMAPI = Backend(
    name="trtllm-llmapi",
    summary="the LLM API (PyTorch backend, current TensorRT-LLM) in TensorRT-LLM's llmapi Triton model",
    qformats=("full_prec", "fp8", "int4_awq"),
    multi_rank=True,
    exact_verification=False,
    gpu=True,
    checkpoint_format="hf",
    dynamic_speculation=True,
    ngram_draft=True,
    eagle3_draft=True,  # speculative_config Eagle3DecodingConfig (trtllm.LLMAPI_VERSIONS)
    suffix_draft=True,  # SADecodingConfig where the release has it (gpu/llmapi_versions.py)
    auto_draft=True,  # AutoDecodingConfig, every release (gpu/llmapi_versions.py)
    mtp_draft=True,  # MTPDecodingConfig, every release (gpu/llmapi_versions.py)
    parallel_drafts=True,  # PARDDecodingConfig / DFlashDecodingConfig where the release has them
    prequantized_models=True,
    external_build=True,
    tensorrt_engines=False,
    always_batches_in_flight=True,  # the LLM API's scheduler
    default_image=None,  # the recipe's trtllm_version picks it (trtllm_images.recipe_image)
    bls_limits=None,
    layouts=(LLMAPI_LAYOUT,),
    preflight_checks=(*_COMMON_CHECKS, "fp8", "kv_cache", "memory", "llmapi", "mtp_heads"),
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
