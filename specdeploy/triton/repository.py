"""The Triton model repository: typed model configs -> checked `config.pbtxt` files -> `triton_repo/<recipe>/`.

Layout and tensor names are those of NVIDIA's `inflight_batcher_llm` (../shared/DESIGN.md) so that
clients written for a TensorRT-LLM deployment work unchanged:

    preprocessing ─▶ tensorrt_llm ─▶ postprocessing      = ensemble (the unaccelerated control)
    tensorrt_llm_bls: tokenize, then rounds of tensorrt_llm_draft (k tokens) + tensorrt_llm
                      (draft_input_ids, k + 1 tokens), then detokenize

preprocessing, postprocessing, ensemble and tensorrt_llm_bls are the same on every backend; the
two engine models (`tensorrt_llm`, `tensorrt_llm_draft`) are handed in by the recipe's backend
(`specdeploy.backend_stages`: `cpu_engine_models` here, the GPU ones in gpu_models.py, which imports this module).
Every config is rendered from the dataclasses below and parsed with Triton's own `ModelConfig`
protobuf before anything is written.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from specdeploy.artifacts import Manifest, atomic_output, fingerprint, require, tool_versions
from specdeploy.config import Recipe, to_plain
from specdeploy.errors import RepoError
from specdeploy.policy import PolicySettings

STAGE = "repo"
MODEL_SOURCES = Path(__file__).parent / "models"
TOKENIZER_SUBDIR = "tokenizer"
# draft.kind eagle3: the head is copied into the tensorrt_llm model's folder (beside its version 1/), so the
# repository carries what it serves; its hash is in the repository's fingerprint (a changed head: out of date)
EAGLE3_HEAD_SUBDIR = "eagle3_head"
EAGLE3_HEAD_FILES = ("config.json", "model.safetensors")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
CPU_EXECUTOR_FACTORY = "specdeploy.triton.models.common:load_cpu_executor"

# Model names of the layout (clients import them from specdeploy.client.protocol too).
PREPROCESSING, POSTPROCESSING, ENSEMBLE = "preprocessing", "postprocessing", "ensemble"
TARGET_MODEL, DRAFT_MODEL, BLS = "tensorrt_llm", "tensorrt_llm_draft", "tensorrt_llm_bls"
ENGINE_MODEL_NAMES = {"target": TARGET_MODEL, "draft": DRAFT_MODEL}


# ---------------------------------------------------------------- typed config objects


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # Triton's data type without the TYPE_ prefix: INT32, FP32, BOOL, STRING, UINT64, INT64
    dims: tuple[int, ...]  # per batch item
    optional: bool = False
    ragged: bool = False  # allow_ragged_batch


@dataclass(frozen=True)
class EnsembleStep:
    model: str
    input_map: tuple[tuple[str, str], ...]  # (step model's input, ensemble tensor)
    output_map: tuple[tuple[str, str], ...]  # (step model's output, ensemble tensor)


@dataclass(frozen=True)
class ModelSpec:
    """Everything a config.pbtxt says, plus which model.py source (if any) goes into version 1/."""

    name: str
    max_batch_size: int
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    backend: str | None = "python"
    platform: str | None = None  # "ensemble"
    parameters: dict[str, str] = field(default_factory=dict)
    instance_count: int = 1
    decoupled: bool = False
    dynamic_batching_delay_us: int | None = None  # None: no dynamic_batching block
    steps: tuple[EnsembleStep, ...] = ()
    source: str | None = None  # file name in specdeploy/triton/models/, copied as <name>/1/model.py


def _t(name, dtype, dims, optional=False, ragged=False) -> Tensor:
    return Tensor(name, dtype, tuple(dims), optional, ragged)


# Every tensor of the layout, written once, exactly as NVIDIA declares it (name, data type, dims,
# optional) in tensorrtllm_backend c2e65b8 all_models/inflight_batcher_llm/*/config.pbtxt
# (tests/test_triton_repo.py compares with tests/data/trtllm_backend_c2e65b8_tensors.json). Which of
# them the CPU models honour and which they refuse unless neutral: specdeploy/triton/models/common.py
# (HONOURED, NEUTRAL) and the README table "tensor -> honoured or refused".
REQ, OPT = False, True
RAGGED = {"input_ids", "draft_input_ids", "draft_logits", "stop_words_list", "bad_words_list", "lora_weights",
          "lora_config", "guided_decoding_guide_type", "guided_decoding_guide", "embedding_bias"}


def _table(rows) -> tuple[Tensor, ...]:
    return tuple(Tensor(name, dtype, tuple(dims), optional, name in RAGGED) for name, dtype, dims, optional in rows)


# What every generation result may carry (tensorrt_llm, tensorrt_llm_bls and ensemble outputs).
RESULT_OUTPUTS = _table([
    ("cum_log_probs", "FP32", [-1], REQ),
    ("output_log_probs", "FP32", [-1, -1], REQ),
    ("context_logits", "FP32", [-1, -1], REQ),
    ("generation_logits", "FP32", [-1, -1, -1], REQ),
    ("batch_index", "INT32", [1], REQ),
    ("sequence_index", "INT32", [1], REQ),
    ("kv_cache_alloc_new_blocks", "INT32", [1], REQ),
    ("kv_cache_reused_blocks", "INT32", [1], REQ),
    ("kv_cache_alloc_total_blocks", "INT32", [1], REQ),
    ("arrival_time_ns", "INT64", [1], REQ),
    ("first_scheduled_time_ns", "INT64", [1], REQ),
    ("first_token_time_ns", "INT64", [1], REQ),
    ("last_token_time_ns", "INT64", [1], REQ),
    ("acceptance_rate", "FP32", [1], REQ),
    ("total_accepted_draft_tokens", "INT32", [1], REQ),
    ("total_draft_tokens", "INT32", [1], REQ),
])
# ensemble and BLS share these client-facing inputs
TEXT_INPUTS = _table([
    ("text_input", "STRING", [1], REQ),
    ("max_tokens", "INT32", [1], REQ),
    ("decoder_text_input", "STRING", [1], OPT),
    ("num_return_sequences", "INT32", [1], OPT),
    ("bad_words", "STRING", [-1], OPT),
    ("stop_words", "STRING", [-1], OPT),
    ("exclude_input_in_output", "BOOL", [1], OPT),
    ("end_id", "INT32", [1], OPT),
    ("pad_id", "INT32", [1], OPT),
    ("top_k", "INT32", [1], OPT),
    ("top_p", "FP32", [1], OPT),
    ("temperature", "FP32", [1], OPT),
    ("length_penalty", "FP32", [1], OPT),
    ("repetition_penalty", "FP32", [1], OPT),
    ("min_tokens", "INT32", [1], OPT),
    ("presence_penalty", "FP32", [1], OPT),
    ("frequency_penalty", "FP32", [1], OPT),
    ("seed", "UINT64", [1], OPT),
    ("return_log_probs", "BOOL", [1], OPT),
    ("return_context_logits", "BOOL", [1], OPT),
    ("return_generation_logits", "BOOL", [1], OPT),
    ("return_perf_metrics", "BOOL", [1], OPT),
    ("beam_width", "INT32", [1], OPT),
    ("stream", "BOOL", [1], OPT),
    ("prompt_embedding_table", "FP16", [-1, -1], OPT),
    ("prompt_table_extra_id", "UINT64", [1], OPT),
    ("prompt_vocab_size", "INT32", [1], OPT),
    ("embedding_bias_words", "STRING", [-1], OPT),
    ("embedding_bias_weights", "FP32", [-1], OPT),
    ("lora_task_id", "UINT64", [1], OPT),
    ("lora_weights", "FP16", [-1, -1], OPT),
    ("lora_config", "INT32", [-1, 3], OPT),
    ("guided_decoding_guide_type", "STRING", [1], OPT),
    ("guided_decoding_guide", "STRING", [1], OPT),
])
BLS_ONLY_INPUTS = _table([
    ("image_input", "FP16", [-1, 3, -1, -1], OPT),
    ("image_bytes_input", "UINT8", [-1, -1, -1, -1], OPT),
    ("image_url_input", "STRING", [1], OPT),
    ("video_bytes_input", "UINT8", [-1, -1, -1, -1], OPT),
    ("num_draft_tokens", "INT32", [1], OPT),
    ("use_draft_logits", "BOOL", [1], OPT),
])
TEXT_OUTPUTS = _table([("text_output", "STRING", [-1], REQ)])
# draft.kind eagle3 (cpu): specdeploy's own tensorrt_llm tensors, beyond NVIDIA's layout. TensorRT-LLM's one-model
# EAGLE-3 drafts max_draft_len tokens per round with no per-request input; here the BLS passes its k (0 or absent:
# plain decoding, what the control `ensemble` gets), and reads back the per-round counts for its metrics.
EAGLE3_LLM_INPUTS = _table([("num_draft_tokens", "INT32", [1], OPT)])
EAGLE3_LLM_OUTPUTS = _table([
    ("draft_tokens_per_round", "INT32", [-1], REQ),
    ("accepted_draft_tokens_per_round", "INT32", [-1], REQ),
])

PREPROCESSING_INPUTS = _table([
    ("QUERY", "STRING", [1], REQ),
    ("DECODER_QUERY", "STRING", [1], OPT),
    ("IMAGE_BYTES", "UINT8", [-1, -1, -1, -1], OPT),
    ("IMAGE_URL", "STRING", [1], OPT),
    ("VIDEO_BYTES", "UINT8", [-1, -1, -1, -1], OPT),
    ("REQUEST_OUTPUT_LEN", "INT32", [1], REQ),
    ("BAD_WORDS_DICT", "STRING", [-1], OPT),
    ("STOP_WORDS_DICT", "STRING", [-1], OPT),
    ("EMBEDDING_BIAS_WORDS", "STRING", [-1], OPT),
    ("EMBEDDING_BIAS_WEIGHTS", "FP32", [-1], OPT),
    ("END_ID", "INT32", [1], OPT),
    ("PAD_ID", "INT32", [1], OPT),
    ("PROMPT_TABLE_EXTRA_ID", "UINT64", [1], OPT),
])
PREPROCESSING_OUTPUTS = _table([
    ("INPUT_ID", "INT32", [-1], REQ),
    ("REQUEST_INPUT_LEN", "INT32", [1], REQ),
    ("DECODER_INPUT_ID", "INT32", [-1], REQ),
    ("REQUEST_DECODER_INPUT_LEN", "INT32", [1], REQ),
    ("BAD_WORDS_IDS", "INT32", [2, -1], REQ),
    ("STOP_WORDS_IDS", "INT32", [2, -1], REQ),
    ("EMBEDDING_BIAS", "FP32", [-1], REQ),
    ("REQUEST_OUTPUT_LEN", "INT32", [-1], REQ),
    ("OUT_END_ID", "INT32", [1], REQ),
    ("OUT_PAD_ID", "INT32", [1], REQ),
    ("OUT_PROMPT_TABLE_EXTRA_IDS", "UINT64", [-1], REQ),
    # multimodal outputs: declared for NVIDIA's clients, never produced (image/video inputs are refused)
    ("PIXEL_VALUES", "FP16", [-1, -1, -1, -1], REQ),
    ("ASPECT_RATIO_IDS", "INT64", [-1], REQ),
    ("ASPECT_RATIO_MASK", "INT64", [-1, -1], REQ),
    ("CROSS_ATTENTION_MASK", "INT64", [-1, -1, -1], REQ),
    ("IMAGE_SIZES", "INT64", [2], REQ),
    ("IS_VIDEO_INPUT", "BOOL", [1], REQ),
    ("ATTENTION_MASK", "INT64", [-1], REQ),
    ("IMAGE_GRID_THW", "INT64", [3], REQ),
    ("VISION_INPUT_ID", "INT32", [-1], REQ),
])
LLM_INPUTS = _table([
    ("input_ids", "INT32", [-1], OPT),
    ("encoder_input_features", "BOOL", [-1, -1], OPT),
    ("encoder_output_lengths", "INT32", [1], OPT),
    ("input_lengths", "INT32", [1], REQ),
    ("request_output_len", "INT32", [1], REQ),
    ("num_return_sequences", "INT32", [1], OPT),
    ("draft_input_ids", "INT32", [-1], OPT),
    ("decoder_input_ids", "INT32", [-1], OPT),
    ("decoder_input_lengths", "INT32", [1], OPT),
    ("draft_logits", "FP32", [-1, -1], OPT),
    ("draft_acceptance_threshold", "FP32", [1], OPT),
    ("end_id", "INT32", [1], OPT),
    ("pad_id", "INT32", [1], OPT),
    ("stop_words_list", "INT32", [2, -1], OPT),
    ("bad_words_list", "INT32", [2, -1], OPT),
    ("embedding_bias", "FP32", [-1], OPT),
    ("beam_width", "INT32", [1], OPT),
    ("temperature", "FP32", [1], OPT),
    ("runtime_top_k", "INT32", [1], OPT),
    ("runtime_top_p", "FP32", [1], OPT),
    ("runtime_top_p_min", "FP32", [1], OPT),
    ("runtime_top_p_decay", "FP32", [1], OPT),
    ("runtime_top_p_reset_ids", "INT32", [1], OPT),
    ("len_penalty", "FP32", [1], OPT),
    ("early_stopping", "BOOL", [1], OPT),
    ("repetition_penalty", "FP32", [1], OPT),
    ("min_tokens", "INT32", [1], OPT),
    ("beam_search_diversity_rate", "FP32", [1], OPT),
    ("presence_penalty", "FP32", [1], OPT),
    ("frequency_penalty", "FP32", [1], OPT),
    ("seed", "UINT64", [1], OPT),
    ("return_log_probs", "BOOL", [1], OPT),
    ("return_context_logits", "BOOL", [1], OPT),
    ("return_generation_logits", "BOOL", [1], OPT),
    ("return_perf_metrics", "BOOL", [1], OPT),
    ("exclude_input_in_output", "BOOL", [1], OPT),
    ("stop", "BOOL", [1], OPT),
    ("streaming", "BOOL", [1], OPT),
    ("prompt_embedding_table", "FP16", [-1, -1], OPT),
    ("prompt_table_extra_ids", "UINT64", [-1], OPT),
    ("prompt_vocab_size", "INT32", [1], OPT),
    ("cross_attention_mask", "BOOL", [-1, -1], OPT),
    ("mrope_rotary_cos_sin", "FP32", [-1], OPT),
    ("mrope_position_deltas", "INT64", [1], OPT),
    ("lora_task_id", "UINT64", [1], OPT),
    ("lora_weights", "FP16", [-1, -1], OPT),
    ("lora_config", "INT32", [-1, 3], OPT),
    ("context_phase_params", "UINT8", [-1], OPT),
    ("skip_cross_attn_blocks", "BOOL", [1], OPT),
    ("retention_token_range_starts", "INT32", [-1], OPT),
    ("retention_token_range_ends", "INT32", [-1], OPT),
    ("retention_token_range_priorities", "INT32", [-1], OPT),
    ("retention_token_range_durations_ms", "INT32", [-1], OPT),
    ("retention_decode_priority", "INT32", [1], OPT),
    ("retention_decode_duration_ms", "INT32", [1], OPT),
    ("guided_decoding_guide_type", "STRING", [1], OPT),
    ("guided_decoding_guide", "STRING", [1], OPT),
    ("lookahead_window_size", "INT32", [1], OPT),
    ("lookahead_ngram_size", "INT32", [1], OPT),
    ("lookahead_verification_set_size", "INT32", [1], OPT),
])
LLM_OUTPUTS = _table([
    ("output_ids", "INT32", [-1, -1], REQ),
    ("sequence_length", "INT32", [-1], REQ),
    ("context_phase_params", "UINT8", [-1], REQ),
]) + RESULT_OUTPUTS
POSTPROCESSING_INPUTS = _table([
    ("TOKENS_BATCH", "INT32", [-1, -1], REQ),
    ("SEQUENCE_LENGTH", "INT32", [-1], REQ),
])
POSTPROCESSING_OUTPUTS = _table([("OUTPUT", "STRING", [-1], REQ)])


# ---------------------------------------------------------------- rendering and checking


def _tensor_block(tensors: tuple[Tensor, ...]) -> str:
    items = []
    for t in tensors:
        lines = [f'    name: "{t.name}"', f"    data_type: TYPE_{t.dtype}", f"    dims: [ {', '.join(map(str, t.dims))} ]"]
        if t.optional:
            lines.append("    optional: true")
        if t.ragged:
            lines.append("    allow_ragged_batch: true")
        items.append("  {\n" + "\n".join(lines) + "\n  }")
    return "[\n" + ",\n".join(items) + "\n]"


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render(spec: ModelSpec) -> str:
    """The config.pbtxt text of one model. A parameter without a value is an error, never a default."""
    out = [f"name: {_quote(spec.name)}"]
    if spec.platform:
        out.append(f"platform: {_quote(spec.platform)}")
    else:
        out.append(f"backend: {_quote(spec.backend)}")
    out.append(f"max_batch_size: {spec.max_batch_size}")
    if spec.decoupled:
        out.append("model_transaction_policy {\n  decoupled: true\n}")
    if spec.dynamic_batching_delay_us is not None:
        out.append(f"dynamic_batching {{\n  max_queue_delay_microseconds: {spec.dynamic_batching_delay_us}\n}}")
    out.append("input " + _tensor_block(spec.inputs))
    out.append("output " + _tensor_block(spec.outputs))
    if spec.steps:
        steps = []
        for step in spec.steps:
            maps = [f'      model_name: "{step.model}"', "      model_version: -1"]
            for key, value in step.input_map:
                maps.append(f"      input_map {{ key: {_quote(key)} value: {_quote(value)} }}")
            for key, value in step.output_map:
                maps.append(f"      output_map {{ key: {_quote(key)} value: {_quote(value)} }}")
            steps.append("    {\n" + "\n".join(maps) + "\n    }")
        out.append("ensemble_scheduling {\n  step [\n" + ",\n".join(steps) + "\n  ]\n}")
    if not spec.platform:
        out.append(f"instance_group [\n  {{\n    count: {spec.instance_count}\n    kind: KIND_CPU\n  }}\n]")
    for key, value in spec.parameters.items():
        if value is None:
            raise RepoError(f"model {spec.name}: parameter '{key}' has no value", "this is a bug in the repository generator")
        out.append(f"parameters: {{\n  key: {_quote(key)}\n  value: {{ string_value: {_quote(str(value))} }}\n}}")
    return "\n".join(out) + "\n"


def check_config(text: str, expected_name: str | None = None):
    """Parse config.pbtxt text with Triton's ModelConfig protobuf; RepoError naming the problem otherwise."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        config = text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise RepoError(f"config of model {expected_name or '?'} does not parse as Triton's ModelConfig: {exc}") from exc
    if expected_name is not None and config.name != expected_name:
        raise RepoError(f"config names model {config.name!r}, expected {expected_name!r}")
    return config


def _check_ensemble(spec: ModelSpec, specs: dict[str, ModelSpec]) -> None:
    """Every step mapping names a real tensor of the step model; every ensemble output is produced."""
    produced = {t.name for t in spec.inputs}
    for step in spec.steps:
        model = specs[step.model]
        model_inputs = {t.name for t in model.inputs}
        model_outputs = {t.name for t in model.outputs}
        for key, value in step.input_map:
            if key not in model_inputs or value not in produced:
                raise RepoError(f"ensemble step {step.model}: input {key} <- {value} maps an unknown tensor")
        for key, value in step.output_map:
            if key not in model_outputs:
                raise RepoError(f"ensemble step {step.model}: output {key} is not an output of {step.model}")
            produced.add(value)
    missing = [t.name for t in spec.outputs if t.name not in produced]
    if missing:
        raise RepoError(f"ensemble outputs {missing} are not produced by any step")


# ---------------------------------------------------------------- the models of the layout


@dataclass(frozen=True)
class RepoInputs:
    """What the per-backend builders need: the recipe, the engines and their manifests."""

    recipe: Recipe
    engine_dirs: dict[str, Path]  # role -> absolute engine dir
    engine_manifests: dict[str, Manifest]
    executor_factory: str  # "module:callable" that loads an Executor from an engine dir
    eagle3_head_dir: Path | None = None  # draft.kind eagle3: the head folder draft.head names (absolute)
    eagle3_head_hash: str = ""  # the hash of its files (EAGLE3_HEAD_FILES)

    def engine_setting(self, role: str, key: str, default):
        """A build setting from the engine's manifest (top level or its `engine` section), else `default`."""
        settings = self.engine_manifests[role].settings
        value = settings.get(key)
        if value is None and isinstance(settings.get("engine"), dict):
            value = settings["engine"].get(key)
        return default if value is None else value

    @property
    def target_max_draft_len(self) -> int:
        return int(self.engine_setting("target", "max_draft_len", self.recipe.speculative.max_draft_len))

    @property
    def max_input_len(self) -> int:
        return int(self.engine_setting("target", "max_input_len", self.recipe.engine.max_input_len))

    @property
    def max_seq_len(self) -> int:
        return int(self.engine_setting("target", "max_seq_len", self.recipe.engine.max_seq_len))


def _tokenizer_params(model: str) -> dict[str, str]:
    # One copy inside preprocessing/ (a top-level folder would be taken for a model), referred to
    # relative to each model's own folder: the repository stays valid wherever it is moved.
    here = TOKENIZER_SUBDIR if model == PREPROCESSING else f"../{PREPROCESSING}/{TOKENIZER_SUBDIR}"
    return {"tokenizer_dir": here}


def preprocessing_spec(inp: RepoInputs) -> ModelSpec:
    r = inp.recipe
    return ModelSpec(
        name=PREPROCESSING,
        max_batch_size=r.engine.max_batch_size,
        inputs=PREPROCESSING_INPUTS,
        outputs=PREPROCESSING_OUTPUTS,
        parameters={**_tokenizer_params(PREPROCESSING), "add_special_tokens": "true", "max_input_len": str(inp.max_input_len)},
        instance_count=1,  # tokenizing takes microseconds; each extra instance costs a process and its start-up
        source="preprocessing.py",
    )


def postprocessing_spec(inp: RepoInputs) -> ModelSpec:
    r = inp.recipe
    return ModelSpec(
        name=POSTPROCESSING,
        max_batch_size=r.engine.max_batch_size,
        inputs=POSTPROCESSING_INPUTS,
        outputs=POSTPROCESSING_OUTPUTS,
        parameters={**_tokenizer_params(POSTPROCESSING), "skip_special_tokens": "true"},
        instance_count=1,
        source="postprocessing.py",
    )


# The ensemble's wiring, as NVIDIA's ensemble/config.pbtxt maps it: (step input, ensemble tensor).
ENSEMBLE_PRE_INPUTS = (
    ("QUERY", "text_input"),
    ("DECODER_QUERY", "decoder_text_input"),
    ("REQUEST_OUTPUT_LEN", "max_tokens"),
    ("BAD_WORDS_DICT", "bad_words"),
    ("STOP_WORDS_DICT", "stop_words"),
    ("EMBEDDING_BIAS_WORDS", "embedding_bias_words"),
    ("EMBEDDING_BIAS_WEIGHTS", "embedding_bias_weights"),
    ("END_ID", "end_id"),
    ("PAD_ID", "pad_id"),
    ("PROMPT_TABLE_EXTRA_ID", "prompt_table_extra_id"),
)
ENSEMBLE_PRE_OUTPUTS = (
    ("REQUEST_INPUT_LEN", "_REQUEST_INPUT_LEN"),
    ("INPUT_ID", "_INPUT_ID"),
    ("REQUEST_DECODER_INPUT_LEN", "_REQUEST_DECODER_INPUT_LEN"),
    ("DECODER_INPUT_ID", "_DECODER_INPUT_ID"),
    ("REQUEST_OUTPUT_LEN", "_REQUEST_OUTPUT_LEN"),
    ("STOP_WORDS_IDS", "_STOP_WORDS_IDS"),
    ("BAD_WORDS_IDS", "_BAD_WORDS_IDS"),
    ("EMBEDDING_BIAS", "_EMBEDDING_BIAS"),
    ("OUT_END_ID", "_PREPROCESSOR_END_ID"),
    ("OUT_PAD_ID", "_PREPROCESSOR_PAD_ID"),
    ("OUT_PROMPT_TABLE_EXTRA_IDS", "_OUT_PROMPT_TABLE_EXTRA_IDS"),
)
ENSEMBLE_LLM_INPUTS = (
    ("input_ids", "_INPUT_ID"),
    ("decoder_input_ids", "_DECODER_INPUT_ID"),
    ("input_lengths", "_REQUEST_INPUT_LEN"),
    ("decoder_input_lengths", "_REQUEST_DECODER_INPUT_LEN"),
    ("exclude_input_in_output", "exclude_input_in_output"),
    ("request_output_len", "_REQUEST_OUTPUT_LEN"),
    ("end_id", "_PREPROCESSOR_END_ID"),
    ("pad_id", "_PREPROCESSOR_PAD_ID"),
    ("embedding_bias", "_EMBEDDING_BIAS"),
    ("runtime_top_k", "top_k"),
    ("runtime_top_p", "top_p"),
    ("temperature", "temperature"),
    ("len_penalty", "length_penalty"),
    ("repetition_penalty", "repetition_penalty"),
    ("min_tokens", "min_tokens"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
    ("seed", "seed"),
    ("return_log_probs", "return_log_probs"),
    ("return_context_logits", "return_context_logits"),
    ("return_generation_logits", "return_generation_logits"),
    ("return_perf_metrics", "return_perf_metrics"),
    ("num_return_sequences", "num_return_sequences"),
    ("beam_width", "beam_width"),
    ("streaming", "stream"),
    ("prompt_embedding_table", "prompt_embedding_table"),
    ("prompt_vocab_size", "prompt_vocab_size"),
    ("stop_words_list", "_STOP_WORDS_IDS"),
    ("bad_words_list", "_BAD_WORDS_IDS"),
    ("prompt_table_extra_ids", "_OUT_PROMPT_TABLE_EXTRA_IDS"),
    ("lora_task_id", "lora_task_id"),
    ("lora_weights", "lora_weights"),
    ("lora_config", "lora_config"),
    ("guided_decoding_guide_type", "guided_decoding_guide_type"),
    ("guided_decoding_guide", "guided_decoding_guide"),
)


def ensemble_spec(inp: RepoInputs) -> ModelSpec:
    pre = EnsembleStep(PREPROCESSING, input_map=ENSEMBLE_PRE_INPUTS, output_map=ENSEMBLE_PRE_OUTPUTS)
    llm = EnsembleStep(
        TARGET_MODEL,
        input_map=ENSEMBLE_LLM_INPUTS,
        output_map=(("output_ids", "_TOKENS_BATCH"), ("sequence_length", "_SEQUENCE_LENGTH")) + tuple((t.name, t.name) for t in RESULT_OUTPUTS),
    )
    post = EnsembleStep(
        POSTPROCESSING,
        input_map=(("TOKENS_BATCH", "_TOKENS_BATCH"), ("SEQUENCE_LENGTH", "_SEQUENCE_LENGTH")),
        output_map=(("OUTPUT", "text_output"),),
    )
    return ModelSpec(
        name=ENSEMBLE,
        platform="ensemble",
        backend=None,
        max_batch_size=inp.recipe.engine.max_batch_size,
        inputs=TEXT_INPUTS,
        outputs=TEXT_OUTPUTS + RESULT_OUTPUTS,
        steps=(pre, llm, post),
    )


# specdeploy's own BLS outputs, beyond NVIDIA's layout (sent only when a client asks for them by name):
# speculative_k_history, the draft length of each round of the request (0: a plain step or run).
BLS_EXTRA_OUTPUTS = _table([("speculative_k_history", "INT32", [-1], REQ)])


def bls_spec(inp: RepoInputs) -> ModelSpec:
    r = inp.recipe
    from specdeploy import ngram

    return ModelSpec(
        name=BLS,
        max_batch_size=r.engine.max_batch_size,
        inputs=TEXT_INPUTS + BLS_ONLY_INPUTS,
        outputs=TEXT_OUTPUTS + RESULT_OUTPUTS + BLS_EXTRA_OUTPUTS,
        parameters={
            # draft.kind ngram: the BLS proposes by prompt lookup itself (no call to tensorrt_llm_draft)
            **({"draft_kind": "ngram", **ngram.to_parameters(ngram.settings_from_recipe(r))} if r.draft.is_ngram else {}),
            # draft.kind eagle3: tensorrt_llm drafts with its head inside; the BLS passes k, one call per request
            **({"draft_kind": "eagle3"} if r.draft.is_eagle3 else {}),
            **_tokenizer_params(BLS),
            "add_special_tokens": "true",
            "skip_special_tokens": "true",
            "tensorrt_llm_model_name": TARGET_MODEL,
            "tensorrt_llm_draft_model_name": DRAFT_MODEL,
            "accumulate_tokens": "true",
            "num_draft_tokens": str(r.speculative.num_draft_tokens),
            "max_draft_len": str(inp.target_max_draft_len),
            "use_draft_logits": str(r.speculative.use_draft_logits).lower(),
            "max_input_len": str(inp.max_input_len),
            "max_seq_len": str(inp.max_seq_len),
            "request_timeout_s": str(r.triton.request_timeout_s),
            # each draft/target call's Triton timeout: the BLS checks its own cancellation between them
            "cancel_check_interval_s": "0.5",
            # speculation policy (specdeploy.policy): its state lives in the BLS instance
            **PolicySettings.from_recipe(r.speculative).to_parameters(),
            # the canary's control arm (specdeploy.metrics.BlsOps): this share of requests takes the plain path
            "canary_control_percent": str(r.canary.control_percent),
        },
        instance_count=r.bls_instance_count,
        decoupled=r.triton.decoupled,
        source="tensorrt_llm_bls.py",
    )


def engine_model_parameters(inp: RepoInputs, role: str) -> dict[str, str]:
    """The parameters NVIDIA's tensorrt_llm model takes that every backend sets the same way.

    `exclude_input_in_output` is false so one client request means one thing on every backend (the
    BLS sets it per request anyway); KV block reuse is what the draft/target flow relies on.
    """
    return {
        "gpt_model_path": str(inp.engine_dirs[role]),
        "gpt_model_type": "inflight_fused_batching",
        "max_beam_width": "1",
        "enable_kv_cache_reuse": "true",
        "exclude_input_in_output": "false",
    }


def cpu_engine_models(inp: RepoInputs) -> list[ModelSpec]:
    """tensorrt_llm and tensorrt_llm_draft as python models over specdeploy's CPU engine."""
    r = inp.recipe
    specs = []
    for role, name in ENGINE_MODEL_NAMES.items():
        if role == "draft" and r.draft.is_ngram:
            specs.append(_ngram_draft_model(inp))
            continue
        if role == "draft" and r.draft.is_eagle3:  # the head runs inside tensorrt_llm: no draft model
            continue
        max_draft_len = inp.target_max_draft_len if role == "target" else 0
        eagle3 = role == "target" and r.draft.is_eagle3
        specs.append(
            ModelSpec(
                name=name,
                max_batch_size=r.engine.max_batch_size,
                inputs=LLM_INPUTS + (EAGLE3_LLM_INPUTS if eagle3 else ()),
                outputs=LLM_OUTPUTS + (EAGLE3_LLM_OUTPUTS if eagle3 else ()),
                parameters={
                    # relative to the model's folder, like tokenizer_dir (common.resolve_dir)
                    **({"eagle3_head": EAGLE3_HEAD_SUBDIR} if eagle3 else {}),
                    **engine_model_parameters(inp, role),
                    "kv_cache_free_gpu_mem_fraction": str(r.engine.kv_cache_free_gpu_mem_fraction),
                    "executor_factory": inp.executor_factory,
                    "max_input_len": str(int(inp.engine_setting(role, "max_input_len", r.engine.max_input_len))),
                    "max_seq_len": str(int(inp.engine_setting(role, "max_seq_len", r.engine.max_seq_len))),
                    "max_draft_len": str(max_draft_len),
                    "request_timeout_s": str(r.triton.request_timeout_s),
                    "inflight_batching": str(r.triton.inflight_batching).lower(),
                    # decoupled: streamed tokens are held until they complete text (whole characters per response)
                    **_tokenizer_params(name),
                    "skip_special_tokens": "true",
                },
                instance_count=r.triton.instance_count,
                decoupled=r.triton.decoupled,
                dynamic_batching_delay_us=r.triton.max_queue_delay_microseconds,
                source="tensorrt_llm.py",
            )
        )
    return specs


def _ngram_draft_model(inp: RepoInputs) -> ModelSpec:
    """tensorrt_llm_draft for draft.kind ngram: a python model with the tensorrt_llm interface that proposes
    from input_ids by prompt lookup (specdeploy.ngram); no engine, no weights."""
    from specdeploy import ngram

    r = inp.recipe
    return ModelSpec(
        name=DRAFT_MODEL,
        max_batch_size=r.engine.max_batch_size,
        inputs=LLM_INPUTS,
        outputs=LLM_OUTPUTS,
        parameters={
            **ngram.to_parameters(ngram.settings_from_recipe(r)),
            "max_input_len": str(inp.max_seq_len),  # the BLS sends prompt + output so far
            "max_seq_len": str(inp.max_seq_len),
        },
        instance_count=r.triton.instance_count,
        decoupled=r.triton.decoupled,
        source="ngram_draft.py",
    )


def model_specs(inp: RepoInputs, engine_models, finish_models=None) -> list[ModelSpec]:
    """All models of the repository, in load order: the shared models around the backend's engine models
    (`engine_models(inp)`: `tensorrt_llm` and `tensorrt_llm_draft`, from `BackendStages.engine_models`), as the
    backend serves them (`finish_models(inp, specs)`: the engine backend renames tensors per release)."""
    specs = [preprocessing_spec(inp), *engine_models(inp), postprocessing_spec(inp), ensemble_spec(inp), bls_spec(inp)]
    return finish_models(inp, specs) if finish_models else specs


# ---------------------------------------------------------------- the stage


def _sources_hash() -> str:
    from specdeploy.artifacts import file_hash

    return fingerprint(**{p.name: file_hash(p) for p in sorted(MODEL_SOURCES.glob("*.py"))})


def _has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file()


def find_tokenizer(engine_dir: Path, manifest: Manifest, model: str | None = None) -> Path:
    """The tokenizer saved with the engine or its checkpoint, else the source model's (the recipe's
    `model`, resolved like the quantize stage does: a bundled name or a local HF folder)."""
    candidates = [Path(engine_dir), Path(engine_dir) / "tokenizer"]
    for section in (manifest.settings, manifest.extra, manifest.inputs):
        for key in ("tokenizer_dir", "checkpoint", "source_dir", "model_dir", "hf_dir", "source_model_dir"):
            value = section.get(key) if isinstance(section, dict) else None
            if isinstance(value, str):
                candidates.append(Path(value))
    for path in candidates:
        if _has_tokenizer(path):
            return path
    model = manifest.extra.get("model") if isinstance(manifest.extra.get("model"), str) else model
    if model:
        from specdeploy import models

        source = Path(models.resolve(model))
        if _has_tokenizer(source):
            return source
        candidates.append(source)
    raise RepoError(
        f"no tokenizer found for engine {engine_dir} (looked in {', '.join(map(str, candidates))})",
        "rebuild the engine so that it saves the tokenizer beside it: specdeploy build RECIPE --force",
    )


def repo_inputs(recipe: Recipe, layout, recipe_path: str = "RECIPE", executor_factory: str | None = None) -> RepoInputs:
    """Read the engines' manifests (StaleArtifactError with a `specdeploy build` hint when missing)."""
    dirs, manifests = {}, {}
    for role in recipe.model_roles:  # an n-gram draft has no engine
        engine_dir = Path(layout.engine(role)).resolve()
        manifests[role] = require(engine_dir, "build", f"specdeploy build {recipe_path}")
        if manifests[role].recipe_name != recipe.name:
            from specdeploy.errors import StaleArtifactError

            raise StaleArtifactError(
                f"{engine_dir} was built for recipe {manifests[role].recipe_name!r}, not {recipe.name!r}",
                f"run: specdeploy build {recipe_path}",
            )
        expected = _expected_engine_fingerprint(recipe, layout, role)
        if expected is not None and manifests[role].fingerprint != expected:
            from specdeploy.errors import StaleArtifactError

            raise StaleArtifactError(
                f"the {role} engine {engine_dir} is stale: its checkpoint or the recipe's engine settings changed",
                f"run: specdeploy build {recipe_path}",
            )
        dirs[role] = engine_dir
    head_dir, head_hash = _eagle3_head(recipe, layout, recipe_path) if recipe.draft.is_eagle3 else (None, "")
    inp = RepoInputs(recipe, dirs, manifests, executor_factory or CPU_EXECUTOR_FACTORY, head_dir, head_hash)
    if recipe.speculative.num_draft_tokens > inp.target_max_draft_len:
        raise RepoError(
            f"speculative.num_draft_tokens ({recipe.speculative.num_draft_tokens}) is larger than the target "
            f"engine's max_draft_len ({inp.target_max_draft_len})",
            f"rebuild the target with a larger max_draft_len: specdeploy build {recipe_path} --force",
        )
    return inp


def _eagle3_head(recipe: Recipe, layout, recipe_path: str) -> tuple[Path, str]:
    """draft.kind eagle3: (the head folder, the hash of its files). BuildError when there is none."""
    from specdeploy.artifacts import file_hash
    from specdeploy.config import EAGLE3_HEAD_TRAINED
    from specdeploy.errors import BuildError

    trained = recipe.draft.head == EAGLE3_HEAD_TRAINED
    head_dir = layout.eagle3_head_source(recipe.draft.head).resolve()
    missing = [name for name in EAGLE3_HEAD_FILES if not (head_dir / name).is_file()]
    if missing:
        fix = f"train it with: specdeploy draft train {recipe_path}" if trained else "set draft.head to an exported EAGLE-3 checkpoint folder"
        raise BuildError(f"no EAGLE-3 head at {head_dir} (no {', '.join(missing)})", fix)
    return head_dir, fingerprint(**{name: file_hash(head_dir / name) for name in EAGLE3_HEAD_FILES})


def check_eagle3_head(inp: RepoInputs) -> None:
    """Load the head against the target engine (engine.eagle3.Eagle3Head.load's checks: hidden size, vocabulary,
    aux layers, shapes), so a head that does not fit is refused by `specdeploy repo`, not by tritonserver."""
    from specdeploy.engine.eagle3 import Eagle3Head
    from specdeploy.engine.model import CpuEngine

    Eagle3Head.load(inp.eagle3_head_dir, CpuEngine.load(str(inp.engine_dirs["target"])))


def _expected_engine_fingerprint(recipe: Recipe, layout, role: str) -> str | None:
    """What the CPU build (engine/build.py) would record for the engine of `role` now. None on the GPU backends:
    trtllm.build_engine_recipe checks its own fingerprints, and the LLM API has no engine to check."""
    from specdeploy import backends

    if backends.of(recipe).gpu:
        return None
    from specdeploy.engine.build import engine_fingerprint

    checkpoint = Manifest.read(layout.checkpoint(role))
    if checkpoint is None:
        return None
    max_draft_len = recipe.speculative.max_draft_len if role == "target" else None
    return engine_fingerprint(recipe, role, checkpoint, max_draft_len)


def repo_fingerprint(inp: RepoInputs) -> str:
    r = inp.recipe
    return fingerprint(
        engines={role: m.fingerprint for role, m in inp.engine_manifests.items()},
        engine_dirs={role: str(d) for role, d in inp.engine_dirs.items()},
        backend=r.backend,
        speculative=to_plain(r.speculative),
        draft=to_plain(r.draft) if r.draft.is_ngram else None,
        **({"eagle3_head": inp.eagle3_head_hash} if r.draft.is_eagle3 else {}),
        engine=to_plain(r.engine),
        triton={k: getattr(r.triton, k) for k in ("instance_count", "decoupled", "max_queue_delay_microseconds", "request_timeout_s",
                                                  "inflight_batching")} | {"bls_instance_count": r.bls_instance_count},
        layout=r.layout,
        **({"control": r.control} if r.layout == "llmapi" else {}),
        executor_factory=inp.executor_factory,
        sources=_sources_hash(),
        **({"canary_control_percent": r.canary.control_percent} if r.canary.control_percent else {}),
    )


def generate_layout_repository(
    recipe: Recipe, layout, engine_models, recipe_path: str = "RECIPE", force: bool = False,
    executor_factory: str | None = None, finish_models=None,
) -> tuple[Path, bool]:
    """The inflight_batcher_llm layout (cpu, trtllm-engine): `layout.repo`, or (path, False) when up to date.
    `engine_models(inp)` gives the backend's `tensorrt_llm` and `tensorrt_llm_draft`, `finish_models` its renames
    (model_specs).

    Refuses missing or mismatched engines (hint: `specdeploy build`). Each config.pbtxt is checked
    with Triton's ModelConfig schema before anything is written; the write is atomic.
    """
    inp = repo_inputs(recipe, layout, recipe_path, executor_factory)
    fp = repo_fingerprint(inp)
    dest = Path(layout.repo)
    current = Manifest.read(dest)
    if not force and current is not None and current.stage == STAGE and current.fingerprint == fp:
        return dest, False

    if inp.eagle3_head_dir is not None:
        check_eagle3_head(inp)
    specs = model_specs(inp, engine_models, finish_models)
    by_name = {s.name: s for s in specs}
    texts = {}
    for spec in specs:
        text = render(spec)
        check_config(text, spec.name)
        if spec.steps:
            _check_ensemble(spec, by_name)
        texts[spec.name] = text
    tokenizer_src = find_tokenizer(inp.engine_dirs["target"], inp.engine_manifests["target"], recipe.target.model)

    with atomic_output(dest) as tmp:
        for spec in specs:
            model_dir = tmp / spec.name
            (model_dir / "1").mkdir(parents=True)
            (model_dir / "config.pbtxt").write_text(texts[spec.name])
            if spec.source:
                shutil.copyfile(MODEL_SOURCES / spec.source, model_dir / "1" / "model.py")
        if inp.eagle3_head_dir is not None:
            (tmp / TARGET_MODEL / EAGLE3_HEAD_SUBDIR).mkdir()
            for name in EAGLE3_HEAD_FILES:
                shutil.copyfile(inp.eagle3_head_dir / name, tmp / TARGET_MODEL / EAGLE3_HEAD_SUBDIR / name)
        tok_dir = tmp / PREPROCESSING / TOKENIZER_SUBDIR
        tok_dir.mkdir()
        for name in TOKENIZER_FILES:
            if (tokenizer_src / name).is_file():
                shutil.copyfile(tokenizer_src / name, tok_dir / name)
        Manifest(
            stage=STAGE,
            recipe_name=recipe.name,
            fingerprint=fp,
            settings={
                "backend": recipe.backend,
                "models": [s.name for s in specs],
                "decoupled": recipe.triton.decoupled,
                "instance_count": recipe.triton.instance_count,
                "num_draft_tokens": recipe.speculative.num_draft_tokens,
                "max_draft_len": inp.target_max_draft_len,
                "max_input_len": inp.max_input_len,
                "max_seq_len": inp.max_seq_len,
            },
            inputs={f"{role}_engine": m.fingerprint for role, m in inp.engine_manifests.items()}
            | ({"eagle3_head": inp.eagle3_head_hash} if inp.eagle3_head_dir is not None else {}),
            tool_versions=tool_versions("tritonclient", "transformers"),
            extra={"engine_dirs": {r: str(d) for r, d in inp.engine_dirs.items()}, "tokenizer_source": str(tokenizer_src)}
            | ({"eagle3_head_source": str(inp.eagle3_head_dir)} if inp.eagle3_head_dir is not None else {}),
        ).write(tmp)
    return dest, True


def require_repository(recipe: Recipe, layout, recipe_path: str = "RECIPE") -> Manifest:
    """The repository's manifest if it matches the engines and recipe now; StaleArtifactError otherwise."""
    from specdeploy.errors import StaleArtifactError

    manifest = require(layout.repo, STAGE, f"specdeploy repo {recipe_path}")
    try:
        inp = repo_inputs(recipe, layout, recipe_path, _recorded_factory(layout.repo))
    except StaleArtifactError as exc:
        raise StaleArtifactError(f"the repository's engines are not usable: {exc.message}", exc.hint) from exc
    if manifest.fingerprint != repo_fingerprint(inp):
        raise StaleArtifactError(
            f"{layout.repo} is stale: the engines, the recipe or specdeploy changed since it was generated",
            f"run: specdeploy repo {recipe_path}",
        )
    return manifest


def _recorded_factory(repo: Path) -> str | None:
    config = Path(repo) / TARGET_MODEL / "config.pbtxt"
    if not config.is_file():
        return None
    parsed = check_config(config.read_text())
    param = parsed.parameters.get("executor_factory")
    return param.string_value if param is not None and param.string_value else None

