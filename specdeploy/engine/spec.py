"""The engine's own config.json: what `compile` decided and what the runtime needs, nothing inferred later."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

ENGINE_CONFIG = "config.json"
ENGINE_WEIGHTS = "model.safetensors"
ENGINE_FORMAT = "specdeploy-cpu-engine"
FORMAT_VERSION = 1

# Checkpoint `quantization.quant_algo` values the CPU runtime executes with their own numerics.
QUANT_ALGOS = (None, "FP8", "W8A16", "W4A16_AWQ", "W8A8_SQ_PER_CHANNEL")
# What an engine runs: the checkpoint's quant_algo, or W8A8_SQ_PER_CHANNEL with dynamic per-token activation scales
# (the recipe's quantization.per_token), which TensorRT-LLM names W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN
# (tensorrt_llm/quantization/mode.py QuantAlgo; examples/models/core/llama/convert_checkpoint.py args_to_quant_config:
# --smoothquant with --per_channel and --per_token, NVIDIA/TensorRT-LLM@fd96a08).
SQ_PER_TOKEN = "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
ENGINE_QUANT_ALGOS = (*QUANT_ALGOS, SQ_PER_TOKEN)
KV_CACHE_QUANT_ALGOS = (None, "FP8", "INT8")
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ROPE_SCALING_TYPES = ("linear", "llama3")
DTYPES = ("bfloat16", "float16", "float32")
UNPADDED_CHUNK = 64  # rows per GEMM of an engine that is not batch-invariant (a draft)


@dataclass(frozen=True)
class EngineSpec:
    """Everything the runtime needs to run one compiled engine (written as the engine's config.json)."""

    architecture: str
    dtype: str  # compute dtype of activations and unquantized weights
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    norm_epsilon: float
    rotary_base: float
    max_position_embeddings: int
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_draft_len: int  # 0 for an engine that does not verify drafts (the draft itself)
    row_bucket: int  # batch_invariant: every GEMM runs on exactly this many rows; else the largest chunk
    batch_invariant: bool = True  # the target: k+1-row passes bit-identical to single rows (see model.py)
    quant_algo: str | None = None
    kv_cache_quant_algo: str | None = None
    group_size: int | None = None  # INT4 AWQ block size along the input dimension
    rotary_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    backend: str = "cpu"
    format: str = ENGINE_FORMAT
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)  # informational (source checkpoint, producer)

    def write(self, directory: Path) -> None:
        path = Path(directory) / ENGINE_CONFIG
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def read(cls, directory: Path) -> "EngineSpec":
        from specdeploy.core.errors import BuildError

        path = Path(directory) / ENGINE_CONFIG
        if not path.is_file():
            raise BuildError(f"{directory} is not a CPU engine (no {ENGINE_CONFIG})", "run: specdeploy build RECIPE")
        data = json.loads(path.read_text())
        if data.get("format") != ENGINE_FORMAT or data.get("format_version") != FORMAT_VERSION:
            raise BuildError(
                f"{directory} holds format {data.get('format')!r} v{data.get('format_version')}, "
                f"expected {ENGINE_FORMAT} v{FORMAT_VERSION}",
                "rebuild it: specdeploy build RECIPE --force",
            )
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads
