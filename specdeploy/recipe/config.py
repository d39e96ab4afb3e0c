"""Recipes: YAML files under build/ loaded once into frozen dataclasses and checked at the edge.

Every default and every list of choices lives here, in the dataclasses of a recipe's sections; the CLI and the
stages read them from here. `config_loader.load_recipe` reads a YAML file into a `Recipe` (unknown keys, wrong
types), `config_checks` checks what the keys say together (impossible combinations, values out of range).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from specdeploy.core import backends as _backends

# TensorRT-LLM's own words (examples/quantization/quantize.py --qformat / --kv_cache_dtype).
QFORMATS = _backends.ALL_QFORMATS
KV_CACHE_DTYPES = (None, "fp8", "int8")
AWQ_BLOCK_SIZES = (64, 128)
BACKENDS = _backends.NAMES  # what each backend is: specdeploy/core/backends.py (core facts, no stage imported)
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
    # int8_sq only: activations quantized per token with each row's own scale (TensorRT-LLM's
    # W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN) instead of ModelOpt's one static scale per tensor. A build setting:
    # the checkpoint is the same (BUILD_ONLY_QUANT_KEYS), the engine differs.
    per_token: bool = False
    # int8_sq only: SmoothQuant's migration strength (ModelOpt's SmoothQuantCalibConfig.alpha, in [0, 1]; a larger value
    # moves more of the activations' outliers into the weights). null: ModelOpt's default, 1.0.
    smoothquant_alpha: float | None = None


# Quantization keys that are not part of a checkpoint's identity: a limit on the quantize run, and what the build
# makes of the same checkpoint.
BUILD_ONLY_QUANT_KEYS = ("max_calib_hours", "per_token")
# Quantization keys added after checkpoints existed, with the default that means what those checkpoints were made with.
LATER_QUANT_KEYS = {"smoothquant_alpha": None}
# Draft keys added after checkpoints existed (kind suffix only), likewise.
LATER_DRAFT_KEYS = {
    "enable_global_pool": None,
    "global_pool_size": None,
    "use_relaxed_acceptance_for_thinking": None,
    "relaxed_topk": None,
    "relaxed_delta": None,
    "begin_thinking_phase_token": None,
    "end_thinking_phase_token": None,
}


def checkpoint_settings(model: "ModelConfig") -> dict:
    """The model's settings that make its checkpoint (what the quantize stage fingerprints and the build compares).
    Keys added after checkpoints were made are left out at their default, so those checkpoints stay up to date."""
    plain = {k: v for k, v in to_plain(model).items() if not (k in LATER_DRAFT_KEYS and v == LATER_DRAFT_KEYS[k])}
    plain["quantization"] = checkpoint_quantization(plain["quantization"])
    return plain


def checkpoint_quantization(quant: dict) -> dict:
    """A quantization section (plain, from a recipe or an older manifest) without the keys that do not make the
    checkpoint: the build-only ones, and later keys at the default earlier checkpoints were made with."""
    return {
        k: v
        for k, v in quant.items()
        if k not in BUILD_ONLY_QUANT_KEYS and not (k in LATER_QUANT_KEYS and v == LATER_QUANT_KEYS[k])
    }


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a bundled model name (`specdeploy models list`) or a local Hugging Face directory
    quantization: QuantConfig = field(default_factory=QuantConfig)
    tp_size: int = 1
    pp_size: int = 1


DRAFT_KINDS = ("model", "ngram", "eagle3", "suffix", "auto", "mtp", "pard", "dflash")  # draft.kind
EAGLE3_HEAD_TRAINED = "trained"  # draft.head: the head `specdeploy draft train RECIPE` wrote for this recipe
EAGLE3_EXPORT_DTYPES = ("float32", "bfloat16", "float16")  # draft.train.export_dtype
EAGLE3_TRAIN_PRECISIONS = ("auto", "float32", "bfloat16")  # draft.train.precision
EAGLE3_LR_SCHEDULES = ("constant", "cosine")  # draft.train.lr_schedule
EAGLE3_TRAIN_FEATURES = ("target", "engine")  # draft.train.features
EAGLE3_TRAIN_LOSSES = ("kl", "lk", "tv")  # draft.train.loss
EAGLE3_DATA_BACKENDS = ("engine", "torch")  # draft.data.backend
EAGLE3_HEAD_WEIGHTS = ("auto", "int8", "bf16")  # draft.head_weights
# beside an EAGLE-3 head, specdeploy's own (the runtimes read config.json and model.safetensors only): how often each
# draft token was an answer token of the training samples of a `draft data` folder (the head's own, or another run's
# answers of the same target), in draft-id order; draft.serve_vocab_size keeps the most counted. JSON, not
# safetensors: llama.cpp's converter reads every *.safetensors file of the folder as weights.
EAGLE3_VOCAB_COUNTS = "draft_vocab_counts.json"
# draft.max_matching_ngram_size when null; the default of specdeploy.speculation.ngram.NGramSettings, written here
# because the recipe checks draft.min_matching_ngram_size against it and the recipe imports nothing above the core.
NGRAM_MAX_MATCHING_NGRAM_SIZE = 2
SPECULATION_POLICIES = ("static", "cost")  # speculative.policy (specdeploy.speculation.policy)


@dataclass(frozen=True)
class Eagle3DataConfig:
    """draft.data (kind eagle3): the head's training data, written by `specdeploy draft data RECIPE`.

    The target writes its own training set (ModelOpt's "data synthesis"): prompts from `sources`
    ("calibration": the shipped calibration passages turned into requests; "self_instruct": user turns the
    target writes itself from its chat template; or a .jsonl/.txt prompt file), answered by the target through
    the CPU engine (or its weights with torch on a GPU: `backend`). `text_files` are texts already on the machine,
    scored by the target (prefill only). The validation prompt sets are never used."""

    sources: tuple[str, ...] = ("calibration", "self_instruct")
    text_files: tuple[str, ...] = ()
    num_prompts: int = 512
    samples_per_prompt: int = 2  # the first answer greedy, the others sampled at `temperature`
    # The share of the sharegpt source's prompts whose sample is the conversation's own assistant turn, scored by
    # the target (a prefill: its features and distribution at every answer position) instead of answers the target
    # writes: 0.0 all on-policy, 1.0 all scored text. A scored sample costs the data stage only its tokenization
    # (the prefill runs at `draft train`, features: engine); docs/eagle3-data.md "Two kinds of samples".
    scored_share: float = 0.0
    temperature: float = 0.8
    max_new_tokens: int = 256
    seed: int = 0
    # requests in flight while the target writes the data (in-flight batching); 0: engine.max_batch_size. The
    # engine's multi-row passes cost far less per row than one-row steps, so more rows make more tokens per second.
    batch_size: int = 0
    # who answers: "engine" (the recipe's built CPU engine, the quantized target that serves) or "torch" (the
    # target's Hugging Face weights with torch, on a GPU where torch sees one: batch_size rows a pass;
    # specdeploy.eagle3.decode_torch)
    backend: str = "engine"


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
    # where the CPU multiplies bf16 natively (AMX / AVX512-BF16) or on a GPU, else float32 (docs/eagle3-train.md
    # "Inputs")
    precision: str = "auto"
    # where the target's features (its aux layers' outputs) and its distribution (the soft labels) come from.
    # target: ModelOpt runs the target's Hugging Face weights in torch inside each step (its online mode). engine: the
    # recipe's built CPU engine computes them (the quantized target the head will draft for, faster than torch) and
    # ModelOpt trains through its offline mode (`eagle_offline`, `base_model_outputs`): docs/eagle3-train.md
    # "Training further on the CPU"
    features: str = "target"
    # start from an exported head (a folder, or a head bundled with specdeploy by name) instead of a fresh one: a
    # head trained further. Its aux layers and draft vocabulary (d2t) are kept; the optimizer starts anew
    init_head: str = ""
    # batches of samples of similar length (sorted within pools of 64 batches, the batches then shuffled): less
    # padding, the same samples each epoch
    length_grouping: bool = False
    # the training data's folder; empty: the recipe's own (`specdeploy draft data RECIPE` writes it)
    data_dir: str = ""
    # features engine: the training steps' labels are the target's top N tokens of the draft vocabulary (its
    # distribution renormalized over them) instead of all of it; 0: all. The held-out passes keep the whole
    # distribution (specdeploy.eagle3.features.TopKFeatures)
    label_top_k: int = 0
    # with label_top_k: each training sample's aux features and top-k labels computed once, on its first use, kept
    # beside the head's folder (eagle3-head.features, ~4 KB a token for SmolLM2) and read back by later epochs and
    # resumed runs: the same bits as the engine's (specdeploy.eagle3.feature_cache)
    feature_cache: bool = False
    # held-out samples the acceptance is measured on before and after training (and at each epoch's end): the first N
    # in an order drawn with `seed`; 0: all. A pass over all of them is time a CPU run's --time-limit does not train
    heldout_samples: int = 0
    # what each draft position is trained to minimise against the target's distribution p (the head's q): kl, ModelOpt's
    # soft cross-entropy (KL(p || q) up to p's entropy); lk, -log sum_x min(p, q), minus the log of the acceptance
    # probability (LK losses, arXiv 2602.23881); tv, 1 - sum_x min(p, q), the total variation distance. The held-out
    # acceptance and the position accuracy are the same whichever (specdeploy.eagle3.modelopt.use_loss)
    loss: str = "kl"


@dataclass(frozen=True)
class SAConfig:
    """draft.sa_config (kind eagle3): TensorRT-LLM's SAEnhancerConfig, its fields and defaults (gpu/llmapi_versions.py):
    a suffix match of at least `threshold` tokens drafts instead of the head; `enable_global_pool` also searches other
    requests' tokens (TensorRT-LLM only: the CPU engine looks in the request's own)."""

    threshold: int = 4
    enable_global_pool: bool = False


@dataclass(frozen=True)
class TreeConfig:
    """draft.tree (kind eagle3): a dynamic draft tree, TensorRT-LLM's Eagle3DecodingConfig use_dynamic_tree with
    dynamic_tree_max_topK (children kept per node) and max_total_draft_tokens (nodes verified a round); GPU only
    (the cpu backend refuses it: docs/gpu.md)."""

    max_topk: int = 0
    max_total_draft_tokens: int = 0


@dataclass(frozen=True)
class DraftConfig(ModelConfig):
    """The draft: a model (quantized and built like the target), `ngram` (prompt lookup over the request's own
    tokens, no weights), `eagle3` (a head on the target's features) or `suffix` (TensorRT-LLM's standalone suffix
    automaton: the request's own text, no weights) or `auto` (TensorRT-LLM's AutoDecodingConfig: it picks a
    draft-model-free method itself; trtllm-llmapi only) or `mtp` (the target's own multi-token-prediction heads,
    TensorRT-LLM's MTPDecodingConfig; trtllm-llmapi only), `pard` / `dflash` (a PARD or DFlash draft checkpoint,
    draft.head, loaded by TensorRT-LLM as it is; trtllm-llmapi only). The n-gram, suffix and MTP keys are TensorRT-LLM's
    NGramDecodingConfig / SADecodingConfig fields; null means its default (specdeploy.speculation.ngram), and
    max_draft_len null means speculative.num_draft_tokens."""

    model: str = ""  # required for kind model
    kind: str = "model"
    max_draft_len: int | None = None
    max_matching_ngram_size: int | None = None
    is_keep_all: bool | None = None
    is_use_oldest: bool | None = None
    is_public_pool: bool | None = None
    min_matching_ngram_size: int | None = None  # specdeploy's own (vLLM: prompt_lookup_min), cpu backend only
    # kind suffix (TensorRT-LLM's SADecodingConfig, GPU only): other requests' tokens searched too, in a pool of
    # global_pool_size slots (null: TensorRT-LLM's max(64, max_batch_size)). null: false
    enable_global_pool: bool | None = None
    global_pool_size: int | None = None
    # kind mtp (TensorRT-LLM's MTPDecodingConfig: the target's own MTP heads, GPU only): between the thinking-phase
    # tokens, accept a draft token that is any of the target's relaxed_topk candidates within relaxed_delta of its
    # top-1 probability (the output there is no longer the target's greedy output). null: TensorRT-LLM's defaults
    # (false, 1, 0.0, 128798, 128799: DeepSeek-R1's <think> and </think>)
    use_relaxed_acceptance_for_thinking: bool | None = None
    relaxed_topk: int | None = None
    relaxed_delta: float | None = None
    begin_thinking_phase_token: int | None = None
    end_thinking_phase_token: int | None = None
    # kind eagle3: an exported EAGLE-3 checkpoint folder (config.json + model.safetensors), or "trained"; kinds pard and
    # dflash: the PARD / DFlash draft checkpoint folder
    head: str = ""
    # kind eagle3, backend cpu: how the CPU engine holds the head's linear layers. int8: int8 per output channel
    # (weight-only, the target's int8_wo numerics), half the bytes a draft pass reads; bf16: as exported. auto: int8
    # on backend cpu, faster with the same accepted drafts (docs/recipes.md "The default recipe, key by key");
    # TensorRT-LLM loads the head as exported on the GPU backends.
    head_weights: str = "auto"
    # kind eagle3, backend cpu: the head scores only this many of its draft tokens, the ones the target wrote most in
    # the answers its counts come from (draft_vocab_counts.json beside the head: `specdeploy draft vocab-counts`); its
    # LM head shrinks with them. 0: the whole draft vocabulary (TensorRT-LLM loads the head's own d2t on the GPU
    # backends).
    serve_vocab_size: int = 0
    # kind eagle3: the request's own text before the head (TensorRT-LLM's suffix automaton enhancement,
    # Eagle3DecodingConfig.sa_config): where the longest suffix of the sequence that occurred earlier is at least
    # sa_config.threshold tokens long, what followed it is the round's draft. null: off.
    sa_config: SAConfig | None = None
    # kind eagle3, GPU backends: verify a dynamic tree of drafts a round instead of one chain. null: a chain.
    tree: TreeConfig | None = None
    data: Eagle3DataConfig = field(default_factory=Eagle3DataConfig)
    train: Eagle3TrainConfig = field(default_factory=Eagle3TrainConfig)

    NGRAM_KEYS = (
        "max_draft_len",
        "max_matching_ngram_size",
        "is_keep_all",
        "is_use_oldest",
        "is_public_pool",
        "min_matching_ngram_size",
    )
    SUFFIX_KEYS = ("max_draft_len", "max_matching_ngram_size", "enable_global_pool", "global_pool_size")
    MTP_KEYS = (
        "max_draft_len",
        "use_relaxed_acceptance_for_thinking",
        "relaxed_topk",
        "relaxed_delta",
        "begin_thinking_phase_token",
        "end_thinking_phase_token",
    )

    @property
    def is_ngram(self) -> bool:
        return self.kind == "ngram"

    @property
    def is_eagle3(self) -> bool:
        return self.kind == "eagle3"

    @property
    def is_suffix(self) -> bool:
        return self.kind == "suffix"

    @property
    def is_auto(self) -> bool:
        return self.kind == "auto"

    @property
    def is_mtp(self) -> bool:
        return self.kind == "mtp"

    @property
    def stages_head(self) -> bool:
        """A draft folder (draft.head) that TensorRT-LLM loads as it is (speculative_model): an EAGLE-3 head, or a
        PARD or DFlash draft; the GPU build stages it in the deployment."""
        return self.kind in ("eagle3", "pard", "dflash")

    @property
    def head_name(self) -> str:
        """What draft.head is, in words: "EAGLE-3 head", "PARD draft", "DFlash draft"."""
        return {"eagle3": "EAGLE-3 head", "pard": "PARD draft", "dflash": "DFlash draft"}[self.kind]

    @property
    def cpu_head_weights(self) -> str:
        """int8 or bf16: head_weights with auto resolved for the CPU engine."""
        return "int8" if self.head_weights == "auto" else self.head_weights

    @property
    def lookup_threshold(self) -> int:
        """The CPU engine's suffix lookup before the head (Executor lookup_threshold): 0 without sa_config."""
        return self.sa_config.threshold if self.is_eagle3 and self.sa_config is not None else 0

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
    # static: TensorRT-LLM's (num_draft_tokens, dynamic schedule and gate); cost: specdeploy.speculation.policy
    policy: str = "static"
    probe_interval: int = 8  # policy cost: plain rounds before a request that stopped speculating tries again
    # draft.kind eagle3, cpu backend: the head stops drafting at the first token whose chain probability (its own times
    # the drafts' before it) is less than this, so a round it is unsure of costs one target row; 0: k drafts every round
    draft_p_min: float = 0.0


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
    request_timeout_s: float = (
        0.0  # server-side deadline per request (0: none); a request's Triton `timeout` overrides it
    )
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
    repeats: int = 4  # even: each side runs first in half of them (ABBA, client.latency.paired_order)
    min_parity: float = 1.0
    min_speedup: float = 1.0
    near_tie_margin: float = 0.05  # GPU backends only: the cpu backend is exact (backends.Backend.exact_verification)
    request_timeout_s: float = 120.0
    chat_template: str = (
        "auto"  # auto: render prompts with the tokenizer's chat template when it has one; none: raw text
    )
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
    # GPU backends: the image the deployment runs in. auto: the newest NGC Triton image carrying trtllm_version
    # (trtllm-llmapi) or the backend's default (trtllm-engine); a named NGC image must carry it (trtllm_images).
    image: str = "auto"
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
