"""Recipes: YAML files under build/ loaded once into frozen dataclasses and checked at the edge.

Every default and every list of choices lives here; the CLI and the stages read them from here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from specdeploy import backends as _backends
from specdeploy.errors import ConfigError

# TensorRT-LLM's own words (examples/quantization/quantize.py --qformat / --kv_cache_dtype).
QFORMATS = _backends.ALL_QFORMATS
KV_CACHE_DTYPES = (None, "fp8", "int8")
AWQ_BLOCK_SIZES = (64, 128)
BACKENDS = _backends.NAMES  # what each backend is: specdeploy/backends.py (core facts, no stage imported)
ENGINE_DTYPES = ("bfloat16", "float16", "float32")
ROLES = ("target", "draft")

CHAT_TEMPLATE_MODES = ("auto", "none")  # validation.chat_template
CONTROL_MODES = ("auto", "side_by_side", "load_unload")  # triton.control
AUTO_BLS_INSTANCES = 4  # the most tensorrt_llm_bls processes triton.bls_instance_count 0 starts (each ~0.3 GB)


def exact_verification(backend: str) -> bool:
    """Whether `backend` guarantees greedy speculative output == target-only output, bit for bit (the CPU engine:
    row-invariant kernels; the GPU backends verify in reduced precision, so validate triages near-ties)."""
    return _backends.get(backend).exact_verification


@dataclass(frozen=True)
class QuantConfig:
    qformat: str = "full_prec"
    kv_cache_dtype: str | None = None
    calib_dataset: str = "builtin"  # "builtin" or a .txt/.jsonl path
    calib_size: int = 512
    calib_max_seq_length: int = 512
    awq_block_size: int = 128
    seed: int = 1234
    max_calib_hours: float = 4.0  # the quantize stage refuses a longer (estimated) calibration; see calibration.py


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a bundled model name (`specdeploy models list`) or a local Hugging Face directory
    quantization: QuantConfig = field(default_factory=QuantConfig)
    tp_size: int = 1
    pp_size: int = 1


DRAFT_KINDS = ("model", "ngram", "eagle3")  # draft.kind
EAGLE3_HEAD_TRAINED = "trained"  # draft.head: the head `specdeploy draft train RECIPE` wrote for this recipe
EAGLE3_EXPORT_DTYPES = ("float32", "bfloat16", "float16")  # draft.train.export_dtype
EAGLE3_TRAIN_PRECISIONS = ("auto", "float32", "bfloat16")  # draft.train.precision
EAGLE3_LR_SCHEDULES = ("constant", "cosine")  # draft.train.lr_schedule
# draft.max_matching_ngram_size when null; the default of specdeploy.ngram.NGramSettings, written here because the
# recipe checks draft.min_matching_ngram_size against it and the recipe imports nothing above the core.
NGRAM_MAX_MATCHING_NGRAM_SIZE = 2
SPECULATION_POLICIES = ("static", "cost")  # speculative.policy (specdeploy.policy)


@dataclass(frozen=True)
class Eagle3DataConfig:
    """draft.data (kind eagle3): the head's training data, written by `specdeploy draft data RECIPE`.

    The target writes its own training set (ModelOpt's "data synthesis"): prompts from `sources`
    ("calibration": the shipped calibration passages turned into requests; "self_instruct": user turns the
    target writes itself from its chat template; or a .jsonl/.txt prompt file), answered by the target through
    the CPU engine. `text_files` are texts already on the machine, scored by the target (prefill only). The
    validation prompt sets are never used."""

    sources: tuple[str, ...] = ("calibration", "self_instruct")
    text_files: tuple[str, ...] = ()
    num_prompts: int = 512
    samples_per_prompt: int = 2  # the first answer greedy, the others sampled at `temperature`
    temperature: float = 0.8
    max_new_tokens: int = 256
    seed: int = 0
    # requests in flight while the target writes the data (in-flight batching); 0: engine.max_batch_size. The
    # engine's multi-row passes cost far less per row than one-row steps, so more rows make more tokens per second.
    batch_size: int = 0


@dataclass(frozen=True)
class Eagle3TrainConfig:
    """draft.train (kind eagle3): how `specdeploy draft train RECIPE` trains the head with ModelOpt's EAGLE-3
    (`modelopt.torch.speculative`), sized like the target (one decoder layer), not ModelOpt's 8B default."""

    draft_vocab_size: int = 8192  # the head's own vocabulary (d2t maps it into the target's)
    aux_layers: tuple[int, ...] = ()  # target layers whose outputs feed the head; empty: ModelOpt's default
    ttt_steps: int = 3  # training-time test: draft positions trained per step
    epochs: float = 2.0
    learning_rate: float = 3e-4
    # constant, or cosine: from learning_rate down to a tenth of it over the run (a short run ends on small steps)
    lr_schedule: str = "constant"
    seq_len: int = 512
    batch_size: int = 4
    seed: int = 0
    max_train_hours: float = 4.0  # refused above this estimate, as quantize refuses a long calibration
    export_dtype: str = "float32"  # the exported head's weights: float32 (as trained) | bfloat16 | float16
    # start the head's layer from the target's last layer and its LM head from the target's rows (ModelOpt: random)
    init_from_target: bool = False
    # the forward passes under torch autocast in bfloat16 (master weights and optimizer stay fp32). auto: bfloat16
    # where the CPU multiplies bf16 natively (AMX / AVX512-BF16; ~3x faster than fp32 there) or on a GPU, else float32
    precision: str = "auto"


@dataclass(frozen=True)
class DraftConfig(ModelConfig):
    """The draft: a model (quantized and built like the target) or `ngram` (prompt lookup over the request's own
    tokens, no weights). The n-gram keys are TensorRT-LLM's NGramDecodingConfig fields; null means its default
    (specdeploy.ngram.NGramSettings), and max_draft_len null means speculative.num_draft_tokens."""

    model: str = ""  # required for kind model
    kind: str = "model"
    max_draft_len: int | None = None
    max_matching_ngram_size: int | None = None
    is_keep_all: bool | None = None
    is_use_oldest: bool | None = None
    is_public_pool: bool | None = None
    min_matching_ngram_size: int | None = None  # specdeploy's own (vLLM: prompt_lookup_min), cpu backend only
    # kind eagle3: an exported EAGLE-3 checkpoint folder (config.json + model.safetensors), or "trained"
    head: str = ""
    data: Eagle3DataConfig = field(default_factory=Eagle3DataConfig)
    train: Eagle3TrainConfig = field(default_factory=Eagle3TrainConfig)

    NGRAM_KEYS = ("max_draft_len", "max_matching_ngram_size", "is_keep_all", "is_use_oldest", "is_public_pool",
                  "min_matching_ngram_size")

    @property
    def is_ngram(self) -> bool:
        return self.kind == "ngram"

    @property
    def is_eagle3(self) -> bool:
        return self.kind == "eagle3"

    @property
    def has_weights_of_its_own(self) -> bool:
        """A draft that is a model of its own, quantized and built like the target (kind model)."""
        return self.kind == "model"


@dataclass(frozen=True)
class DynamicSpeculation:
    """When the LLM API turns speculation down or off (backend trtllm-llmapi only; see trtllm.LLMAPI_VERSIONS).

    Stated in specdeploy's own terms and translated to the recipe's trtllm_version:
    - max_concurrency: speculation off above this many requests in flight;
    - draft_len_schedule: [[up_to_batch_size, draft_len], ...], ascending; above the last bound speculation is off;
    - acceptance_window / acceptance_threshold / acceptance_measure: turn speculation off for good once the
      rolling mean over `acceptance_window` samples falls below `acceptance_threshold`, where the measure is
      "rate" (accepted / drafted tokens, 0..1) or "length" (accepted tokens per step). Each TensorRT-LLM version
      implements only one of the two measures; the other is refused, never converted.
    """

    max_concurrency: int | None = None
    draft_len_schedule: tuple[tuple[int, ...], ...] = ()
    acceptance_window: int | None = None
    acceptance_threshold: float | None = None
    acceptance_measure: str = "rate"


@dataclass(frozen=True)
class SpeculativeConfig:
    max_draft_len: int = 4
    num_draft_tokens: int = 4
    use_draft_logits: bool = False
    dynamic: DynamicSpeculation | None = None
    policy: str = "static"  # static: TensorRT-LLM's (num_draft_tokens, dynamic schedule and gate); cost: specdeploy.policy
    probe_interval: int = 8  # policy cost: plain rounds before a request that stopped speculating tries again


@dataclass(frozen=True)
class EngineConfig:
    dtype: str = "bfloat16"
    max_batch_size: int = 8
    max_input_len: int = 1024
    max_seq_len: int = 2048
    kv_cache_free_gpu_mem_fraction: float = 0.9  # GPU backends: split between draft and target


@dataclass(frozen=True)
class TritonConfig:
    grpc_port: int = 0  # 0: pick a free loopback port at start
    http_port: int = 0
    metrics_port: int = 0
    instance_count: int = 1
    decoupled: bool = False
    inflight_batching: bool = True  # cpu backend: one engine forward per step for all in-flight requests
    max_queue_delay_microseconds: int = 1000
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 0.0  # server-side deadline per request (0: none); a request's Triton `timeout` overrides it
    # tensorrt_llm_bls instances (NVIDIA's fill_template key bls_instance_count): each runs one speculative request at a
    # time, so this many run at once. 0: auto, min(engine.max_batch_size, 4) when the engine models batch in flight
    # (their concurrent draft and target calls then share engine steps), else instance_count.
    bls_instance_count: int = 0
    # The repository's layout (backends.LAYOUTS): NVIDIA's inflight_batcher_llm models, or TensorRT-LLM's llmapi model
    # (speculative `tensorrt_llm` + its control `tensorrt_llm_control`). "auto": the backend's first layout.
    layout: str = "auto"
    # llmapi layout: the control loaded beside the speculative model (side_by_side), or loaded only while validate
    # measures it (load_unload: Triton's explicit model control), for memory that holds one target at a time.
    # auto: side_by_side on the cpu backend, load_unload on a GPU (each LLM(...) takes a share of the free GPU memory).
    control: str = "auto"


@dataclass(frozen=True)
class CostConfig:
    machine_price_per_hour: float = 0.0  # what one serving machine costs per hour; 0: not reported
    currency: str = "USD"


@dataclass(frozen=True)
class CanaryConfig:
    control_percent: float = 0.0  # share of tensorrt_llm_bls requests sent down the plain path (the control arm)
    window_s: float = 60.0  # `specdeploy canary`: how long to watch live traffic
    min_requests: int = 20  # per arm, before a verdict
    min_speedup: float = 1.0  # promote when control TPOT p50 / speculative TPOT p50 >= this
    max_p99_ratio: float = 1.2  # roll back when speculative e2e p99 > this x control's
    min_acceptance_rate: float = 0.0  # roll back below this acceptance rate


@dataclass(frozen=True)
class ValidationConfig:
    prompt_set: str = "builtin"  # "builtin" or a .jsonl path
    max_prompts: int = 0  # 0: all prompts of the set
    max_tokens: int = 64
    concurrency: tuple[int, ...] = (1, 2, 4)
    repeats: int = 3
    min_parity: float = 1.0
    min_speedup: float = 1.0
    near_tie_margin: float = 0.05  # GPU backends only: the cpu backend is exact (backends.Backend.exact_verification)
    request_timeout_s: float = 120.0
    chat_template: str = "auto"  # auto: render prompts with the tokenizer's chat template when it has one; none: raw text
    min_compared_tokens: int = 16  # a control output shorter than this is "too short to compare"
    min_compared_share: float = 0.9  # the gate fails when fewer prompts than this share are comparable
    latency_prompts: int = 0  # prompts per latency run, spread over the categories (0: every parity prompt)


@dataclass(frozen=True)
class Recipe:
    name: str
    target: ModelConfig
    draft: DraftConfig
    backend: str = _backends.DEFAULT
    # The TensorRT-LLM release the GPU backends target (trtllm.LLMAPI_VERSIONS): the LLM-API option names and
    # meanings follow it, and the packaging checks the image carries it.
    trtllm_version: str = "1.2"
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    triton: TritonConfig = field(default_factory=TritonConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    canary: CanaryConfig = field(default_factory=CanaryConfig)

    @property
    def layout(self) -> str:
        """The repository layout: triton.layout, or the backend's first one when it says auto."""
        return _backends.get(self.backend).layouts[0] if self.triton.layout == "auto" else self.triton.layout

    @property
    def bls_instance_count(self) -> int:
        """tensorrt_llm_bls instances: triton.bls_instance_count, or the auto rule written beside that key."""
        t = self.triton
        if t.bls_instance_count:
            return t.bls_instance_count
        if _backends.get(self.backend).batches_in_flight(self):
            return min(self.engine.max_batch_size, AUTO_BLS_INSTANCES)
        return t.instance_count

    @property
    def control(self) -> str:
        """How the llmapi layout's control is served: triton.control, or by the backend when it says auto."""
        if self.triton.control != "auto":
            return self.triton.control
        return "load_unload" if _backends.get(self.backend).gpu else "side_by_side"

    def model(self, role: str) -> ModelConfig:
        assert role in ROLES, role
        return getattr(self, role)

    @property
    def model_roles(self) -> tuple[str, ...]:
        """The roles that are models to quantize and build: both, or only the target for an n-gram draft."""
        return ROLES if self.draft.has_weights_of_its_own else ("target",)

    def section_hash(self, *sections: str) -> str:
        """A stable hash of the named top-level sections (dotted paths allowed), for manifests."""
        data = {name: _lookup(self, name) for name in sections}
        return stable_hash(data)


def stable_hash(data) -> str:
    text = json.dumps(to_plain(data), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def to_plain(value):
    if dataclasses.is_dataclass(value):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def _lookup(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


# ---------------------------------------------------------------- loading


def load_recipe(path: str | Path) -> Recipe:
    """Read and check a YAML recipe; every problem is a ConfigError that names the key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe {path} not found", "pass a YAML file such as build/smollm2-135m.yaml")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {path} is not valid YAML: {exc}", "fix the YAML syntax") from exc
    recipe = parse_recipe(raw, source=str(path))
    return recipe


def parse_recipe(raw, source: str = "recipe") -> Recipe:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys to values")
    recipe = _build(Recipe, raw, "")
    _check(recipe)
    _check_operations(recipe)
    return recipe


def _build(cls, raw, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"key '{prefix.rstrip('.')}' must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown key '{prefix}{unknown[0]}'",
            f"valid keys here: {', '.join(fields)}",
        )
    kwargs = {}
    for name, f in fields.items():
        key = prefix + name
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"missing required key '{key}'")
            continue
        kwargs[name] = _convert(hints[name], raw[name], key)
    return cls(**kwargs)


def _convert(hint, value, key: str):
    if dataclasses.is_dataclass(hint):
        return _build(hint, value if value is not None else {}, key + ".")
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"key '{key}' must be a list, got {value!r}")
        return tuple(_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (type(value) is not hint):
        raise ConfigError(f"key '{key}' must be {hint.__name__}, got {value!r} ({type(value).__name__})")
    return value


def _choice(key: str, value, choices) -> None:
    if value not in choices:
        shown = ", ".join("null" if c is None else str(c) for c in choices)
        raise ConfigError(f"key '{key}' has invalid value {value!r}", f"valid choices: {shown}")


def _at_least(key: str, value, low) -> None:
    if value < low:
        raise ConfigError(f"key '{key}' is {value}, must be >= {low}")


def _check(r: Recipe) -> None:
    # "." and ".." pass the character check but name no folder of their own: engines/.. is the project root
    if not r.name or r.name in (".", "..") or not all(c.isalnum() or c in "-_." for c in r.name):
        raise ConfigError(f"key 'name' is {r.name!r}", "use letters, digits, '-', '_' or '.' (it names output folders)")
    _choice("backend", r.backend, BACKENDS)
    _check_draft_kind(r)
    for role in r.model_roles:
        m = r.model(role)
        q = m.quantization
        _choice(f"{role}.quantization.qformat", q.qformat, QFORMATS)
        _choice(f"{role}.quantization.kv_cache_dtype", q.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice(f"{role}.quantization.awq_block_size", q.awq_block_size, AWQ_BLOCK_SIZES)
        _at_least(f"{role}.quantization.calib_size", q.calib_size, 1)
        _at_least(f"{role}.quantization.calib_max_seq_length", q.calib_max_seq_length, 8)
        if not q.max_calib_hours > 0:
            raise ConfigError(f"key '{role}.quantization.max_calib_hours' is {q.max_calib_hours}, must be > 0")
        _at_least(f"{role}.tp_size", m.tp_size, 1)
        _at_least(f"{role}.pp_size", m.pp_size, 1)
        backend = _backends.get(r.backend)
        if q.qformat not in backend.qformats:
            raise ConfigError(
                f"key '{role}.quantization.qformat' is {q.qformat!r}, which backend '{r.backend}' cannot run",
                f"qformats for {r.backend}: {', '.join(backend.qformats)}",
            )
        if m.tp_size * m.pp_size > 1 and not backend.multi_rank:
            raise ConfigError(
                f"key '{role}.tp_size'/'{role}.pp_size' asks for {m.tp_size * m.pp_size} ranks on backend '{r.backend}'",
                f"the cpu engine runs one rank; set tp_size: 1 and pp_size: 1, or use {' or '.join(b.name for b in _backends.ALL if b.multi_rank)}",
            )
    s = r.speculative
    _at_least("speculative.max_draft_len", s.max_draft_len, 1)
    _at_least("speculative.num_draft_tokens", s.num_draft_tokens, 1)
    if s.num_draft_tokens > s.max_draft_len:
        raise ConfigError(
            f"key 'speculative.num_draft_tokens' is {s.num_draft_tokens}, larger than speculative.max_draft_len "
            f"({s.max_draft_len}); the target would fail with 'Number of draft tokens is larger than maximum'",
            f"set num_draft_tokens <= {s.max_draft_len} or raise max_draft_len (the target engine is built with it)",
        )
    _check_dynamic(r)
    _choice("speculative.policy", s.policy, SPECULATION_POLICIES)
    _at_least("speculative.probe_interval", s.probe_interval, 1)
    e = r.engine
    _choice("engine.dtype", e.dtype, ENGINE_DTYPES)
    _at_least("engine.max_batch_size", e.max_batch_size, 1)
    _at_least("engine.max_input_len", e.max_input_len, 1)
    if e.max_seq_len <= e.max_input_len:
        raise ConfigError(
            f"key 'engine.max_seq_len' ({e.max_seq_len}) must be larger than engine.max_input_len ({e.max_input_len})",
            "max_seq_len counts prompt plus generated tokens",
        )
    if not 0.0 < e.kv_cache_free_gpu_mem_fraction <= 1.0:
        raise ConfigError(f"key 'engine.kv_cache_free_gpu_mem_fraction' is {e.kv_cache_free_gpu_mem_fraction}, must be in (0, 1]")
    t = r.triton
    for port_key in ("grpc_port", "http_port", "metrics_port"):
        port = getattr(t, port_key)
        if not 0 <= port <= 65535:
            raise ConfigError(f"key 'triton.{port_key}' is {port}", "use 0 (pick a free port) or 1..65535")
    _at_least("triton.instance_count", t.instance_count, 1)
    _at_least("triton.bls_instance_count", t.bls_instance_count, 0)
    _at_least("triton.request_timeout_s", t.request_timeout_s, 0)
    _check_layout(r)
    v = r.validation
    _at_least("validation.max_tokens", v.max_tokens, 1)
    if v.max_tokens >= e.max_seq_len:
        raise ConfigError(f"key 'validation.max_tokens' ({v.max_tokens}) must be below engine.max_seq_len ({e.max_seq_len})")
    if not v.concurrency:
        raise ConfigError("key 'validation.concurrency' is empty", "list at least one level, e.g. [1, 2, 4]")
    for i, level in enumerate(v.concurrency):
        _at_least(f"validation.concurrency[{i}]", level, 1)
    _at_least("validation.repeats", v.repeats, 1)
    if not 0.0 <= v.min_parity <= 1.0:
        raise ConfigError(f"key 'validation.min_parity' is {v.min_parity}, must be in [0, 1]")
    _choice("validation.chat_template", v.chat_template, CHAT_TEMPLATE_MODES)
    _at_least("validation.min_compared_tokens", v.min_compared_tokens, 1)
    if v.min_compared_tokens > v.max_tokens:
        raise ConfigError(
            f"key 'validation.min_compared_tokens' ({v.min_compared_tokens}) is larger than validation.max_tokens ({v.max_tokens}): "
            "no output could be long enough to compare",
            f"raise validation.max_tokens to at least {v.min_compared_tokens} or lower min_compared_tokens",
        )
    if not 0.0 <= v.min_compared_share <= 1.0:
        raise ConfigError(f"key 'validation.min_compared_share' is {v.min_compared_share}, must be in [0, 1]")
    _at_least("validation.latency_prompts", v.latency_prompts, 0)


def _check_layout(r: Recipe) -> None:
    t, backend = r.triton, _backends.get(r.backend)
    if t.layout != "auto" and t.layout not in backend.layouts:
        others = [b.name for b in _backends.ALL if t.layout in b.layouts]
        raise ConfigError(
            f"key 'triton.layout' is {t.layout!r}, which backend '{r.backend}' does not serve (it serves: {', '.join(backend.layouts)})",
            f"use backend {' or '.join(others)}, or layout {backend.layouts[0]}" if others else f"choices: {', '.join(_backends.LAYOUTS)}",
        )
    _choice("triton.control", t.control, CONTROL_MODES)
    if t.control != "auto" and r.layout != _backends.LLMAPI_LAYOUT:
        raise ConfigError(
            f"key 'triton.control' is {t.control}, which only the llmapi layout has (its control is a model of its own)",
            "set triton.layout: llmapi, or drop triton.control (the inflight_batcher_llm layout's control, ensemble, "
            "shares the target model with the speculative path)",
        )
    if r.layout == _backends.LLMAPI_LAYOUT and r.canary.control_percent:
        raise ConfigError(
            "canary.control_percent is set, but the canary's control arm lives in tensorrt_llm_bls, which the llmapi layout does not have",
            "set canary.control_percent: 0, or use triton.layout: inflight_batcher_llm",
        )


def _check_operations(r: Recipe) -> None:
    if r.cost.machine_price_per_hour < 0:
        raise ConfigError(f"key 'cost.machine_price_per_hour' is {r.cost.machine_price_per_hour}, must be >= 0", "0 leaves cost out of the report")
    c = r.canary
    if not 0.0 <= c.control_percent <= 100.0:
        raise ConfigError(f"key 'canary.control_percent' is {c.control_percent}, must be in [0, 100]", "e.g. 20 sends a fifth of the speculative entry point's requests down the plain path")
    if c.window_s <= 0:
        raise ConfigError(f"key 'canary.window_s' is {c.window_s}, must be > 0")
    _at_least("canary.min_requests", c.min_requests, 1)
    if c.min_speedup <= 0 or c.max_p99_ratio <= 0:
        raise ConfigError("keys 'canary.min_speedup' and 'canary.max_p99_ratio' must be > 0")
    if not 0.0 <= c.min_acceptance_rate <= 1.0:
        raise ConfigError(f"key 'canary.min_acceptance_rate' is {c.min_acceptance_rate}, must be in [0, 1]")


ACCEPTANCE_MEASURES = ("rate", "length")


def _check_dynamic(r: Recipe) -> None:
    """speculative.dynamic: shape and ranges here; what a TensorRT-LLM version accepts in trtllm.llmapi_options."""
    d = r.speculative.dynamic
    if d is None:
        return
    if not _backends.get(r.backend).dynamic_speculation:
        raise ConfigError(
            f"key 'speculative.dynamic' is set, but backend '{r.backend}' has no dynamic speculation",
            f"remove speculative.dynamic, or use backend {' or '.join(b.name for b in _backends.ALL if b.dynamic_speculation)}",
        )
    if d.max_concurrency is not None:
        _at_least("speculative.dynamic.max_concurrency", d.max_concurrency, 1)
    previous = 0
    for i, entry in enumerate(d.draft_len_schedule):
        key = f"speculative.dynamic.draft_len_schedule[{i}]"
        if len(entry) != 2:
            raise ConfigError(f"key '{key}' is {list(entry)}", "each entry is [up_to_batch_size, draft_len]")
        bound, length = entry
        if bound <= previous:
            raise ConfigError(f"key '{key}' has batch size {bound} after {previous}", "list batch sizes in ascending order, from 1")
        if not 0 <= length <= r.speculative.num_draft_tokens:
            raise ConfigError(f"key '{key}' has draft length {length}",
                              f"use 0..{r.speculative.num_draft_tokens} (speculative.num_draft_tokens)")  # fmt: skip
        previous = bound
    if d.draft_len_schedule and d.draft_len_schedule[0][1] != r.speculative.num_draft_tokens:
        raise ConfigError(
            f"key 'speculative.dynamic.draft_len_schedule[0]' drafts {d.draft_len_schedule[0][1]} tokens, but the smallest "
            f"batch sizes must draft speculative.num_draft_tokens ({r.speculative.num_draft_tokens})",
            "TensorRT-LLM requires the first entry to use the full draft length",
        )
    if d.max_concurrency is not None and d.draft_len_schedule:
        raise ConfigError(
            "keys 'speculative.dynamic.max_concurrency' and 'draft_len_schedule' are both set",
            "use one: a schedule whose last bound is N already turns speculation off above N requests",
        )
    _choice("speculative.dynamic.acceptance_measure", d.acceptance_measure, ACCEPTANCE_MEASURES)
    if (d.acceptance_window is None) != (d.acceptance_threshold is None):
        raise ConfigError("keys 'speculative.dynamic.acceptance_window' and 'acceptance_threshold' go together",
                          "set both (window > 0 and a threshold) or neither")  # fmt: skip
    if d.acceptance_window is not None:
        _at_least("speculative.dynamic.acceptance_window", d.acceptance_window, 1)
        high = 1.0 if d.acceptance_measure == "rate" else float(r.speculative.num_draft_tokens + 1)
        if not 0.0 <= d.acceptance_threshold <= high:
            raise ConfigError(
                f"key 'speculative.dynamic.acceptance_threshold' is {d.acceptance_threshold}, outside 0..{high:g} "
                f"for measure '{d.acceptance_measure}'",
                "a rate is accepted/drafted (0..1); a length is tokens per step (0..num_draft_tokens+1)",
            )



def _check_draft_kind(r: Recipe) -> None:
    d = r.draft
    _choice("draft.kind", d.kind, DRAFT_KINDS)
    if not d.is_eagle3:
        defaults = {"head": "", "data": Eagle3DataConfig(), "train": Eagle3TrainConfig()}
        for key, default in defaults.items():
            if getattr(d, key) != default:
                raise ConfigError(f"key 'draft.{key}' applies to draft.kind eagle3 only", "remove it, or set draft.kind: eagle3")
    else:
        _check_eagle3(r)
        return
    if not d.is_ngram:
        if not d.model:
            raise ConfigError("missing required key 'draft.model'", "name a bundled model or a local Hugging Face folder, or set draft.kind: ngram")
        extra = [k for k in DraftConfig.NGRAM_KEYS if getattr(d, k) is not None]
        if extra:
            raise ConfigError(f"key 'draft.{extra[0]}' applies to draft.kind ngram only", "remove it, or set draft.kind: ngram")
        return
    if d.model or d.quantization != QuantConfig() or (d.tp_size, d.pp_size) != (1, 1):
        key = "model" if d.model else ("quantization" if d.quantization != QuantConfig() else "tp_size")
        raise ConfigError(f"key 'draft.{key}' does not apply to draft.kind ngram (it has no weights)", "remove it from the draft section")
    s = r.speculative
    if d.max_draft_len is not None:
        _at_least("draft.max_draft_len", d.max_draft_len, 1)
        if d.max_draft_len > s.max_draft_len:
            raise ConfigError(
                f"key 'draft.max_draft_len' ({d.max_draft_len}) is larger than speculative.max_draft_len ({s.max_draft_len})",
                f"set draft.max_draft_len <= {s.max_draft_len}: the target engine verifies at most that many draft tokens",
            )
    if d.max_matching_ngram_size is not None:
        _at_least("draft.max_matching_ngram_size", d.max_matching_ngram_size, 1)
    if d.min_matching_ngram_size is not None:
        _at_least("draft.min_matching_ngram_size", d.min_matching_ngram_size, 1)
        largest = d.max_matching_ngram_size or NGRAM_MAX_MATCHING_NGRAM_SIZE
        if d.min_matching_ngram_size > largest:
            raise ConfigError(f"key 'draft.min_matching_ngram_size' ({d.min_matching_ngram_size}) is larger than "
                              f"draft.max_matching_ngram_size ({largest})", "set min_matching_ngram_size <= max_matching_ngram_size")
        if d.min_matching_ngram_size > 1 and _backends.get(r.backend).gpu:
            raise ConfigError(f"key 'draft.min_matching_ngram_size' is {d.min_matching_ngram_size}, but TensorRT-LLM's "
                              f"NGramDecodingConfig has no minimum pattern size (backend {r.backend})",
                              "remove it (1: every pattern size proposes), or use backend cpu")
    if s.use_draft_logits:
        raise ConfigError(
            "key 'speculative.use_draft_logits' is true, but an n-gram draft has no logits",
            "set use_draft_logits: false (sampled requests are then verified by token matching, which keeps the target's distribution)",
        )
    if not _backends.get(r.backend).ngram_draft:
        raise ConfigError(f"draft.kind ngram is not wired for backend {r.backend}",
                          f"use backend {' or '.join(b.name for b in _backends.ALL if b.ngram_draft)} (trtllm-llmapi: decoding_type NGram)")


def _check_eagle3(r: Recipe) -> None:
    d = r.draft
    if d.model or d.quantization != QuantConfig() or (d.tp_size, d.pp_size) != (1, 1):
        key = "model" if d.model else ("quantization" if d.quantization != QuantConfig() else "tp_size")
        raise ConfigError(f"key 'draft.{key}' does not apply to draft.kind eagle3 (the head runs inside the target)",
                          "remove it from the draft section; draft.head names the head")
    extra = [k for k in DraftConfig.NGRAM_KEYS if k != "max_draft_len" and getattr(d, k) is not None]
    if extra:
        raise ConfigError(f"key 'draft.{extra[0]}' applies to draft.kind ngram only", "remove it")
    if not d.head:
        raise ConfigError("missing required key 'draft.head' (draft.kind eagle3)",
                          f"name an exported EAGLE-3 checkpoint folder, or '{EAGLE3_HEAD_TRAINED}' for the head "
                          "`specdeploy draft train RECIPE` writes")
    if d.max_draft_len is not None:
        _at_least("draft.max_draft_len", d.max_draft_len, 1)
        if d.max_draft_len > r.speculative.max_draft_len:
            raise ConfigError(
                f"key 'draft.max_draft_len' ({d.max_draft_len}) is larger than speculative.max_draft_len ({r.speculative.max_draft_len})",
                f"set draft.max_draft_len <= {r.speculative.max_draft_len}",
            )
    backend = _backends.get(r.backend)
    if not backend.eagle3_draft:
        able = " or ".join(b.name for b in _backends.ALL if b.eagle3_draft)
        raise ConfigError(f"draft.kind eagle3 is not wired for backend {r.backend}: {backend.no_eagle3_because}",
                          f"use backend {able} (trtllm-llmapi: decoding_type Eagle3 with the same head folder), "
                          "or draft.kind model on this backend")  # fmt: skip
    if not backend.gpu and r.speculative.policy == "cost":
        raise ConfigError(f"key 'speculative.policy' is cost, but on backend {r.backend} the EAGLE-3 head drafts inside tensorrt_llm "
                          "(one call per request, the fused loop), which does not consult the cost policy yet",
                          "set speculative.policy: static (k = num_draft_tokens every round, the schedule and gate apply per request)")  # fmt: skip
    if not backend.gpu and r.layout == _backends.LLMAPI_LAYOUT:
        raise ConfigError(f"draft.kind eagle3 is not wired for the llmapi layout on backend {r.backend} yet",
                          "set triton.layout: inflight_batcher_llm (or auto)")
    if r.speculative.use_draft_logits and backend.gpu:
        raise ConfigError(f"key 'speculative.use_draft_logits' is true, but TensorRT-LLM's EAGLE-3 on backend {r.backend} "
                          "has no rejection sampling on the head's logits",
                          "set use_draft_logits: false (greedy requests are verified token by token)")  # fmt: skip
    t = d.train
    _choice("draft.train.export_dtype", t.export_dtype, EAGLE3_EXPORT_DTYPES)
    _choice("draft.train.precision", t.precision, EAGLE3_TRAIN_PRECISIONS)
    _choice("draft.train.lr_schedule", t.lr_schedule, EAGLE3_LR_SCHEDULES)
    _at_least("draft.data.batch_size", d.data.batch_size, 0)
    _at_least("draft.train.draft_vocab_size", t.draft_vocab_size, 2)
    _at_least("draft.train.ttt_steps", t.ttt_steps, 1)
    _at_least("draft.data.num_prompts", d.data.num_prompts, 1)
    _at_least("draft.data.samples_per_prompt", d.data.samples_per_prompt, 1)
