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

from specdeploy.errors import ConfigError

# TensorRT-LLM's own words (examples/quantization/quantize.py --qformat / --kv_cache_dtype).
QFORMATS = ("full_prec", "fp8", "int8_sq", "int8_wo", "int4_awq")
KV_CACHE_DTYPES = (None, "fp8", "int8")
AWQ_BLOCK_SIZES = (64, 128)
BACKENDS = ("cpu", "trtllm-engine", "trtllm-llmapi")
ENGINE_DTYPES = ("bfloat16", "float16", "float32")
ROLES = ("target", "draft")

# Which quantization formats each backend can execute. The LLM API (PyTorch backend) loads
# ModelOpt Hugging Face checkpoints: FP8 and INT4 AWQ, not the INT8 SmoothQuant/weight-only kernels
# of the TensorRT engine path.
BACKEND_QFORMATS = {
    "cpu": QFORMATS,
    "trtllm-engine": QFORMATS,
    "trtllm-llmapi": ("full_prec", "fp8", "int4_awq"),
}
# Backends that run one rank per process and so can shard a model (tp_size * pp_size > 1).
MULTI_RANK_BACKENDS = ("trtllm-engine", "trtllm-llmapi")


@dataclass(frozen=True)
class QuantConfig:
    qformat: str = "full_prec"
    kv_cache_dtype: str | None = None
    calib_dataset: str = "builtin"  # "builtin" or a .txt/.jsonl path
    calib_size: int = 512
    calib_max_seq_length: int = 512
    awq_block_size: int = 128
    seed: int = 1234


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a bundled model name (`specdeploy models list`) or a local Hugging Face directory
    quantization: QuantConfig = field(default_factory=QuantConfig)
    tp_size: int = 1
    pp_size: int = 1


@dataclass(frozen=True)
class SpeculativeConfig:
    max_draft_len: int = 4
    num_draft_tokens: int = 4
    use_draft_logits: bool = False


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
    max_queue_delay_microseconds: int = 1000
    startup_timeout_s: float = 300.0


@dataclass(frozen=True)
class ValidationConfig:
    prompt_set: str = "builtin"  # "builtin" or a .jsonl path
    max_prompts: int = 0  # 0: all prompts of the set
    max_tokens: int = 64
    concurrency: tuple[int, ...] = (1, 2, 4)
    repeats: int = 3
    min_parity: float = 1.0
    min_speedup: float = 1.0
    near_tie_margin: float = 0.05
    request_timeout_s: float = 120.0


@dataclass(frozen=True)
class Recipe:
    name: str
    target: ModelConfig
    draft: ModelConfig
    backend: str = "cpu"
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    triton: TritonConfig = field(default_factory=TritonConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)

    def model(self, role: str) -> ModelConfig:
        assert role in ROLES, role
        return getattr(self, role)

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
    if not r.name or not all(c.isalnum() or c in "-_." for c in r.name):
        raise ConfigError(f"key 'name' is {r.name!r}", "use letters, digits, '-', '_' or '.' (it names output folders)")
    _choice("backend", r.backend, BACKENDS)
    for role in ROLES:
        m = r.model(role)
        q = m.quantization
        _choice(f"{role}.quantization.qformat", q.qformat, QFORMATS)
        _choice(f"{role}.quantization.kv_cache_dtype", q.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice(f"{role}.quantization.awq_block_size", q.awq_block_size, AWQ_BLOCK_SIZES)
        _at_least(f"{role}.quantization.calib_size", q.calib_size, 1)
        _at_least(f"{role}.quantization.calib_max_seq_length", q.calib_max_seq_length, 8)
        _at_least(f"{role}.tp_size", m.tp_size, 1)
        _at_least(f"{role}.pp_size", m.pp_size, 1)
        if q.qformat not in BACKEND_QFORMATS[r.backend]:
            raise ConfigError(
                f"key '{role}.quantization.qformat' is {q.qformat!r}, which backend '{r.backend}' cannot run",
                f"qformats for {r.backend}: {', '.join(BACKEND_QFORMATS[r.backend])}",
            )
        if m.tp_size * m.pp_size > 1 and r.backend not in MULTI_RANK_BACKENDS:
            raise ConfigError(
                f"key '{role}.tp_size'/'{role}.pp_size' asks for {m.tp_size * m.pp_size} ranks on backend '{r.backend}'",
                f"the cpu engine runs one rank; set tp_size: 1 and pp_size: 1, or use {' or '.join(MULTI_RANK_BACKENDS)}",
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
