"""Pre-flight checks: known field failures of draft/target deployments turned into messages up front.

Each check returns Findings (error / warning / info); `run_all` gathers them and `raise_on_errors`
stops the stage with every error at once. The memory estimate is arithmetic on the model shapes
(weights at their quantized width, KV cache for max_batch_size x max_seq_len tokens), labelled as
an estimate: the real numbers come from TensorRT-LLM at load time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdeploy.core import backends
from specdeploy.core.errors import ConfigError, SpecDeployError
from specdeploy.core.gpus import GpuInfo
from specdeploy.recipe.config import EAGLE3_HEAD_TRAINED, EAGLE3_VOCAB_COUNTS, ROLES, Recipe

# FP8 GEMMs and FP8 KV cache need Ada/Hopper or newer (SM 8.9+); TensorRT-LLM's support matrix.
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Bytes per weight of the quantized linear layers (INT4 AWQ: 4 bits + one fp16 scale per group).
QFORMAT_WEIGHT_BYTES = {"fp8": 1.0, "int8_sq": 1.0, "int8_wo": 1.0}
RUNTIME_OVERHEAD_BYTES = int(1.5 * 2**30)  # CUDA context, activations and workspaces per GPU (rough)
# Every check `run_all` can run; each backend lists those that apply to it (backends.Backend.preflight_checks).
CHECKS = ("draft_len", "tokenizer", "eagle3_head", "fp8", "kv_cache", "memory", "bls", "llmapi", "mtp_heads")


@dataclass(frozen=True)
class Finding:
    level: str  # "error" | "warning" | "info"
    check: str  # draft_len | tokenizer | fp8 | kv_cache | memory | bls
    message: str
    hint: str = ""

    def line(self) -> str:
        return f"{self.level:7s} {self.check:9s} {self.message}" + (f" (hint: {self.hint})" if self.hint else "")


# ---------------------------------------------------------------- draft length


def check_draft_len(recipe: Recipe, target_engine_config: dict | None = None) -> list[Finding]:
    """num_draft_tokens must fit the target's max_draft_len (recipe, and the built engine when given)."""
    s = recipe.speculative
    findings = []
    if s.num_draft_tokens > s.max_draft_len:
        findings.append(
            Finding(
                "error",
                "draft_len",
                f"num_draft_tokens {s.num_draft_tokens} > max_draft_len {s.max_draft_len}: the target would fail with "
                "'Number of draft tokens is larger than maximum number of draft tokens'",
                f"set speculative.num_draft_tokens <= {s.max_draft_len} or raise max_draft_len and rebuild",
            )
        )
    if target_engine_config is not None:
        built = (target_engine_config.get("build_config") or {}).get("max_draft_len", 0)
        if built < s.num_draft_tokens:
            findings.append(
                Finding(
                    "error",
                    "draft_len",
                    f"the target engine was built with max_draft_len {built} < num_draft_tokens {s.num_draft_tokens}",
                    "rebuild: specdeploy build <recipe> --force (the target needs --speculative_decoding_mode "
                    "draft_tokens_external --max_draft_len K)",
                )
            )
    return findings


# ---------------------------------------------------------------- tokenizers


def check_tokenizers(target_dir: Path | None, draft_dir: Path | None) -> list[Finding]:
    if target_dir is None or draft_dir is None:
        return [Finding("info", "tokenizer", "models not available locally yet; tokenizers are compared once they are")]
    from specdeploy.core.model_store import check_same_tokenizer

    try:
        check_same_tokenizer(target_dir, draft_dir)
    except SpecDeployError as exc:
        return [Finding("error", "tokenizer", exc.message, exc.hint)]
    return [Finding("info", "tokenizer", "draft and target share one tokenizer")]


# ---------------------------------------------------------------- FP8


def uses_fp8(recipe: Recipe) -> list[str]:
    used = []
    for role in ROLES:
        q = recipe.model(role).quantization
        if q.qformat == "fp8":
            used.append(f"{role} weights")
        if q.kv_cache_dtype == "fp8":
            used.append(f"{role} KV cache")
    return used


def check_fp8(recipe: Recipe, gpus: list[GpuInfo]) -> list[Finding]:
    used = uses_fp8(recipe)
    if not used or not backends.of(recipe).gpu:
        return []
    if not gpus:
        return [Finding("info", "fp8", f"FP8 ({', '.join(used)}) needs compute capability 8.9+; no GPU here to check")]
    old = [g for g in gpus if g.compute_capability is not None and g.compute_capability < FP8_MIN_COMPUTE_CAPABILITY]
    if old:
        names = ", ".join(f"{g.name} ({g.compute_capability[0]}.{g.compute_capability[1]})" for g in old)
        return [
            Finding(
                "error",
                "fp8",
                f"FP8 ({', '.join(used)}) needs compute capability 8.9+ (Ada/Hopper); this machine has {names}",
                "use qformat int8_sq / int8_wo / int4_awq and kv_cache_dtype int8 or null on this GPU",
            )
        ]
    return []


# ---------------------------------------------------------------- KV cache format


def check_kv_cache_format(recipe: Recipe) -> list[Finding]:
    """The draft/target flow needs KV block reuse, hence paged context FMHA, which has format limits."""
    findings = []
    backend = backends.of(recipe)
    for role in ROLES:
        q = recipe.model(role).quantization
        if backend.tensorrt_engines and q.kv_cache_dtype == "int8":
            findings.append(
                Finding(
                    "error",
                    "kv_cache",
                    f"{role}.quantization.kv_cache_dtype int8: KV block reuse needs --use_paged_context_fmha, which"
                    " does not support an INT8 KV cache (NVIDIA/TensorRT-LLM issue #2166)",
                    "use kv_cache_dtype fp8 (compute capability 8.9+) or null",
                )
            )
        if backend.gpu and q.qformat == "int4_awq" and q.kv_cache_dtype == "fp8":
            findings.append(
                Finding(
                    "warning",
                    "kv_cache",
                    f"{role}: INT4 AWQ weights with an FP8 KV cache and paged context FMHA have failed with 'FMHA"
                    " kernels are not found' (NVIDIA/TensorRT-LLM PR #8862 disables paged context FMHA for it in the"
                    " PyTorch flow)",
                    "prefer kv_cache_dtype null with int4_awq, or fp8 weights with an fp8 KV cache",
                )
            )
    return findings


# ---------------------------------------------------------------- memory


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool = False

    @classmethod
    def from_config(cls, config: dict) -> "ModelShape":
        """From a Hugging Face config.json or a TensorRT-LLM checkpoint config.json."""
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config.get("head_size") or hidden // heads),
            intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
            vocab_size=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    @classmethod
    def from_dir(cls, directory: Path) -> "ModelShape | None":
        path = Path(directory) / "config.json"
        if not path.is_file():
            return None
        try:
            return cls.from_config(json.loads(path.read_text()))
        except (ValueError, KeyError):
            return None

    @property
    def linear_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size  # gated MLP: gate, up, down
        return self.num_layers * (attn + mlp)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)


@dataclass(frozen=True)
class MemoryEstimate:
    role: str
    ranks: int
    weights_bytes_per_rank: int
    kv_bytes_per_token_per_rank: int
    kv_tokens: int

    @property
    def kv_bytes_per_rank(self) -> int:
        return self.kv_bytes_per_token_per_rank * self.kv_tokens


def estimate(recipe: Recipe, role: str, shape: ModelShape) -> MemoryEstimate:
    """Weights and KV cache per GPU for one role, sized from that role's own layers and KV heads."""
    m, e = recipe.model(role), recipe.engine
    act_bytes = DTYPE_BYTES[e.dtype]
    q = m.quantization
    if q.qformat == "int4_awq":
        per_weight = 0.5 + 2.0 / q.awq_block_size
    else:
        per_weight = QFORMAT_WEIGHT_BYTES.get(q.qformat, float(act_bytes))
    weights = shape.linear_params * per_weight + shape.embedding_params * act_bytes
    kv_bytes = 1 if q.kv_cache_dtype in ("fp8", "int8") else act_bytes
    kv_heads_per_rank = max(1, shape.num_kv_heads // m.tp_size)  # fewer KV heads than ranks: replicated
    layers_per_rank = -(-shape.num_layers // m.pp_size)
    kv_per_token = 2 * layers_per_rank * kv_heads_per_rank * shape.head_dim * kv_bytes
    ranks = m.tp_size * m.pp_size
    tokens = e.max_batch_size * (e.max_seq_len + (recipe.speculative.max_draft_len if role == "target" else 0))
    return MemoryEstimate(role, ranks, int(weights / ranks), kv_per_token, tokens)


def check_memory(
    recipe: Recipe, shapes: dict[str, ModelShape | None], gpus: list[GpuInfo], gpu_memory_bytes: int | None = None
) -> list[Finding]:
    """Draft + target weights + KV cache on the busiest GPU (GPU 0 holds target rank 0 and the draft)."""
    if not backends.of(recipe).gpu:
        return []
    missing = [r for r in ROLES if shapes.get(r) is None]
    if missing:
        return [Finding("info", "memory", f"no model config for {', '.join(missing)} yet; memory estimate skipped")]
    est = {r: estimate(recipe, r, shapes[r]) for r in ROLES}  # type: ignore[arg-type]
    gib = 2**30
    weights = est["target"].weights_bytes_per_rank + est["draft"].weights_bytes_per_rank
    kv = est["target"].kv_bytes_per_rank + est["draft"].kv_bytes_per_rank
    need = weights + kv + RUNTIME_OVERHEAD_BYTES
    summary = (
        f"GPU 0 estimate: target weights {est['target'].weights_bytes_per_rank / gib:.1f} GiB + draft weights "
        f"{est['draft'].weights_bytes_per_rank / gib:.1f} GiB + KV cache for {recipe.engine.max_batch_size} x "
        f"{recipe.engine.max_seq_len} tokens (target {est['target'].kv_bytes_per_rank / gib:.1f} GiB, draft "
        f"{est['draft'].kv_bytes_per_rank / gib:.1f} GiB) + ~{RUNTIME_OVERHEAD_BYTES / gib:.1f} GiB runtime "
        f"= {need / gib:.1f} GiB"
    )
    findings = []
    ranks = est["target"].ranks
    if gpus and len(gpus) < ranks:
        findings.append(
            Finding(
                "error",
                "memory",
                f"the target needs {ranks} GPUs (tp x pp) but this machine has {len(gpus)}",
                "lower target.tp_size / pp_size, or deploy on a larger node (specdeploy serve --print-k8s)",
            )
        )
    total = gpu_memory_bytes if gpu_memory_bytes is not None else (min(g.memory_bytes for g in gpus) if gpus else None)
    if total is None:
        findings.append(Finding("info", "memory", summary + "; no GPU here to compare with"))
        return findings
    fraction = recipe.engine.kv_cache_free_gpu_mem_fraction
    kv_budget = max(0, total - weights - RUNTIME_OVERHEAD_BYTES) * fraction
    if weights + RUNTIME_OVERHEAD_BYTES > total:
        findings.append(
            Finding(
                "error",
                "memory",
                f"{summary} > {total / gib:.1f} GiB per GPU: the weights alone do not fit",
                "raise target.tp_size, quantize further (fp8 / int4_awq), or use a smaller draft",
            )
        )
    elif kv > kv_budget:
        share = kv_budget / kv if kv else 1.0
        findings.append(
            Finding(
                "warning",
                "memory",
                f"{summary}; with {total / gib:.1f} GiB per GPU and kv_cache_free_gpu_mem_fraction {fraction} the KV"
                f" cache holds about {share:.0%} of max_batch_size x max_seq_len tokens, so long or many requests will"
                " queue",
                "lower engine.max_batch_size / max_seq_len, use kv_cache_dtype fp8 or int8, or raise tp_size",
            )
        )
    else:
        findings.append(Finding("info", "memory", f"{summary} <= {total / gib:.1f} GiB per GPU"))
    return findings


# ---------------------------------------------------------------- BLS


def check_bls(recipe: Recipe) -> list[Finding]:
    limits = backends.of(recipe).bls_limits  # specdeploy's own BLS (triton/models/tensorrt_llm_bls.py)
    if limits is None:
        return []
    findings = [
        Finding(
            "info",
            "bls",
            f"engines are built with max_input_len {recipe.engine.max_seq_len - 1} (max_seq_len - 1): the speculative"
            " BLS resends prompt + output every round; clients stay limited to engine.max_input_len"
            f" {recipe.engine.max_input_len}",
        )
    ]
    if recipe.triton.decoupled and not limits.streaming:
        findings.append(
            Finding(
                "error",
                "bls",
                f"triton.decoupled (streaming) is on, but the speculative BLS on backend {recipe.backend} does not"
                " stream",
                "set triton.decoupled: false for the speculative path (the ensemble control can still stream)",
            )
        )
    if recipe.engine.max_batch_size > limits.max_request_batch:
        findings.append(
            Finding(
                "warning",
                "bls",
                f"engine.max_batch_size is {recipe.engine.max_batch_size}, but specdeploy's speculative BLS on"
                f" {recipe.backend} takes {limits.max_request_batch} sequence per request: send one sequence per"
                " request; concurrent requests are still batched in flight by the tensorrt_llm models",
                "clients must not send batched tensors to tensorrt_llm_bls",
            )
        )
    return findings


# ---------------------------------------------------------------- EAGLE-3 head (draft.kind eagle3)


def check_eagle3_head(recipe: Recipe, layout=None, target_dir: Path | None = None) -> list[Finding]:
    """The head folder exists with config.json and weights, and it was trained for this target: its hidden size
    (`target_hidden_size`, else `hidden_size`) and `vocab_size` equal the target's config.json, and the target layers
    it reads exist. Compared only where both are on this machine."""
    if not recipe.draft.is_eagle3:
        return []
    from specdeploy.gpu import llmapi_options, trtllm

    if layout is None and recipe.draft.head == EAGLE3_HEAD_TRAINED:
        return [Finding("info", "eagle3_head", "the trained head is checked once `specdeploy draft train` wrote it")]
    head = (
        llmapi_options.eagle3_head_source(recipe, layout)
        if layout is not None
        else Path(recipe.draft.head).expanduser()
    )
    try:
        trtllm.check_eagle3_head_files(head, recipe)
        config = llmapi_options.read_eagle3_head_config(head)
    except SpecDeployError as exc:
        return [Finding("error", "eagle3_head", exc.message, exc.hint)]
    target_config_path = Path(target_dir) / "config.json" if target_dir else None
    if target_config_path is None or not target_config_path.is_file():
        return [
            Finding(
                "info",
                "eagle3_head",
                f"EAGLE-3 head {head} found; the target is not on this machine yet, so "
                "its hidden size and vocabulary are compared once it is",
            )
        ]
    target = json.loads(target_config_path.read_text())
    target = target.get("text_config", target)  # multimodal configs nest the language model's
    head_config = head / "config.json"
    fix = (
        f"use an EAGLE-3 head trained for this target ({recipe.target.model}), or train one: draft.head: trained "
        "and `specdeploy draft train <recipe>`"
    )
    findings = []
    head_hidden = config.get("target_hidden_size") or config.get("hidden_size")
    if head_hidden != target.get("hidden_size"):
        findings.append(
            Finding(
                "error",
                "eagle3_head",
                f"{head_config} expects target hidden size {head_hidden}, but "
                f"{target_config_path} has hidden_size {target.get('hidden_size')}",
                fix,
            )
        )
    if config.get("vocab_size") != target.get("vocab_size"):
        findings.append(
            Finding(
                "error",
                "eagle3_head",
                f"{head_config} has vocab_size {config.get('vocab_size')}, but "
                f"{target_config_path} has vocab_size {target.get('vocab_size')}",
                fix,
            )
        )
    layers = llmapi_options.eagle3_aux_layers(config) or []
    depth = target.get("num_hidden_layers")
    if depth is not None and any(not 0 <= i < depth for i in layers if i != -1):
        findings.append(
            Finding(
                "error",
                "eagle3_head",
                f"{head_config} reads target layers {layers}, but {target_config_path} has {depth} layers",
                fix,
            )
        )
    return findings or [
        Finding(
            "info",
            "eagle3_head",
            f"EAGLE-3 head {head} matches the target (hidden size "
            f"{head_hidden}, vocabulary {config.get('vocab_size')})",
        )
    ]


def check_served_vocabulary(recipe: Recipe, layout) -> list[Finding]:
    """draft.serve_vocab_size (the CPU engine cuts the head's draft vocabulary at load) against the head draft.head
    names, where it is on this machine: at most its draft vocabulary, and the counts file it ranks the tokens by
    beside it. `specdeploy run` calls it before quantize on the cpu backend (whose stages have no pre-flight of their
    own), so that neither is found only at `specdeploy repo`, which refuses the same."""
    size = recipe.draft.serve_vocab_size
    if not recipe.draft.is_eagle3 or not size:
        return []
    head = layout.eagle3_head_source(recipe.draft.head)
    try:
        config = json.loads((head / "config.json").read_text())
    except (OSError, ValueError):
        return []  # no head (or no readable config) yet: `specdeploy repo` refuses it with its own message
    draft_vocab = int(config.get("draft_vocab_size") or config.get("vocab_size") or 0)
    if size == draft_vocab:
        return []
    if draft_vocab and size > draft_vocab:
        return [
            Finding(
                "error",
                "eagle3_head",
                f"draft.serve_vocab_size is {size}, but the EAGLE-3 head {head} has {draft_vocab} draft tokens",
                f"set draft.serve_vocab_size to 1..{draft_vocab}, or remove it (the whole draft vocabulary)",
            )
        ]
    if not (head / EAGLE3_VOCAB_COUNTS).is_file():
        from specdeploy.eagle3.head import vocab_counts_fix

        return [
            Finding(
                "error",
                "eagle3_head",
                f"draft.serve_vocab_size is {size}, but the EAGLE-3 head {head} has no "
                f"{EAGLE3_VOCAB_COUNTS} (how often the target wrote each draft token)",
                vocab_counts_fix(recipe, head, layout),
            )
        ]
    return []


# ---------------------------------------------------------------- LLM-API options of the target release


def check_llmapi_options(recipe: Recipe) -> list[Finding]:
    """trtllm-llmapi: the recipe's trtllm_version is one specdeploy knows, and every speculative setting maps to
    that release's options (trtllm.speculative_options refuses what does not)."""
    from specdeploy.gpu import llmapi_options, llmapi_versions

    try:
        version = llmapi_versions.llmapi_version(recipe.trtllm_version)
        llmapi_options.speculative_options(recipe, version, Path("draft"), llmapi_options.decoding_kind(recipe))
    except SpecDeployError as exc:
        return [Finding("error", "llmapi", exc.message, exc.hint)]
    return [Finding("info", "llmapi", "; ".join(llmapi_options.llmapi_mapping_notes(recipe, version)))]


# ---------------------------------------------------------------- MTP heads of the target


# Where a checkpoint's config.json says how many MTP layers it has: DeepSeek-style, then Qwen3-Next-style
# (NVIDIA/TensorRT-LLM@011d093 tensorrt_llm/_torch/speculative/utils.py update_spec_config_from_model_config, which
# assumes 1 when neither is there)
MTP_LAYER_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def check_mtp_heads(recipe: Recipe, target_dir: Path | None) -> list[Finding]:
    """draft.kind mtp: the target's config.json names MTP layers (MTP_LAYER_KEYS). TensorRT-LLM would assume one
    and fail while loading weights that are not there, so a target without them is refused here. Above the layer
    count, vanilla MTP drafts only that many tokens (the same function warns and cuts max_draft_len)."""
    if not recipe.draft.is_mtp:
        return []
    config_path = target_dir / "config.json" if target_dir is not None else None
    if config_path is None or not config_path.is_file():
        return [Finding("info", "mtp_heads", "the target's MTP heads are checked once its config.json is here")]
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        return [Finding("error", "mtp_heads", f"{config_path} is not valid JSON: {exc}", "re-download the target")]
    sections = [config] + ([config["text_config"]] if isinstance(config.get("text_config"), dict) else [])
    layers = next((int(c[k]) for c in sections for k in MTP_LAYER_KEYS if c.get(k) is not None), 0)
    if layers < 1:
        return [
            Finding(
                "error",
                "mtp_heads",
                f"draft.kind mtp, but the target's config.json ({config_path}) names no MTP layers "
                f"({' / '.join(MTP_LAYER_KEYS)} absent or 0): {config.get('architectures') or 'this model'} has no "
                "MTP heads for TensorRT-LLM's MTPDecodingConfig to draft with",
                "use a target trained with MTP heads (DeepSeek-V3/R1, Qwen3-Next, ...), or draft.kind ngram, suffix, "
                "eagle3 or model",
            )
        ]
    d = recipe.draft
    draft_len = d.max_draft_len if d.max_draft_len is not None else recipe.speculative.num_draft_tokens
    findings = [Finding("info", "mtp_heads", f"the target has {layers} MTP layer(s); {draft_len} drafted a round")]
    if layers > 1 and draft_len > layers:
        findings.append(
            Finding(
                "warning",
                "mtp_heads",
                f"the target has {layers} MTP layers and the recipe drafts {draft_len}: vanilla MTP drafts at most "
                f"{layers} (TensorRT-LLM cuts max_draft_len to it)",
                f"set draft.max_draft_len: {layers}",
            )
        )
    return findings


# ---------------------------------------------------------------- all together


def _local_model_dir(name: str) -> Path | None:
    """A recipe model's directory if it is on this machine, without downloading anything."""
    from specdeploy.core import model_store as models

    if name in models.BUNDLED:
        return models.cached_path(name) if models.is_fetched(name) else None
    path = Path(name).expanduser()
    return path if (path / "config.json").is_file() else None


def run_all(
    recipe: Recipe,
    layout=None,
    gpus: list[GpuInfo] | None = None,
    model_dirs: dict[str, Path | None] | None = None,
    gpu_memory_bytes: int | None = None,
    check_built_engine: bool = True,
) -> list[Finding]:
    """Every pre-flight check for a recipe; model shapes come from the source models or the checkpoints.

    check_built_engine=False skips reading the existing target engine (the build stage is about to replace it).
    """
    from specdeploy.core import gpus as gpu_probe

    gpus = gpu_probe.probe() if gpus is None else gpus
    if model_dirs is None:
        model_dirs = {role: _local_model_dir(recipe.model(role).model) for role in ROLES}
    shapes = {}
    for role in ROLES:
        shape = ModelShape.from_dir(model_dirs[role]) if model_dirs.get(role) else None
        if shape is None and layout is not None:
            shape = ModelShape.from_dir(layout.checkpoint(role))
        shapes[role] = shape
    backend = backends.of(recipe)
    target_engine_config = None
    if check_built_engine and layout is not None and backend.tensorrt_engines:
        path = layout.engine("target") / "config.json"
        if path.is_file():
            target_engine_config = json.loads(path.read_text())
    checks = {  # the backend names which apply (Backend.preflight_checks), in its order
        "draft_len": lambda: check_draft_len(recipe, target_engine_config),
        "tokenizer": lambda: (
            check_tokenizers(model_dirs.get("target"), model_dirs.get("draft"))
            if recipe.draft.has_weights_of_its_own
            else [Finding("info", "tokenizer", f"draft.kind {recipe.draft.kind} uses the target's tokenizer")]
        ),
        "eagle3_head": lambda: check_eagle3_head(
            recipe, layout, model_dirs.get("target") or (layout.checkpoint("target") if layout is not None else None)
        ),
        "fp8": lambda: check_fp8(recipe, gpus),
        "kv_cache": lambda: check_kv_cache_format(recipe),
        "memory": lambda: check_memory(recipe, shapes, gpus, gpu_memory_bytes),
        "bls": lambda: check_bls(recipe),
        "llmapi": lambda: check_llmapi_options(recipe),
        "mtp_heads": lambda: check_mtp_heads(recipe, model_dirs.get("target")),
    }
    assert set(checks) == set(CHECKS)
    return [finding for name in backend.preflight_checks for finding in checks[name]()]


def enforce(findings: list[Finding], echo=print) -> list[Finding]:
    """Print the warnings, then stop on errors (raise_on_errors); the findings, for a caller that keeps them."""
    for f in findings:
        if f.level == "warning":
            echo(f"warning: {f.message}")
    raise_on_errors(findings)
    return findings


def raise_on_errors(findings: list[Finding]) -> None:
    errors = [f for f in findings if f.level == "error"]
    if errors:
        raise ConfigError(
            "pre-flight check failed:\n" + "\n".join(f"  - {f.message}" for f in errors),
            "; ".join(f.hint for f in errors if f.hint),
        )
