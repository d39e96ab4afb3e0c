"""The plan of a head's training run: steps, time and memory, estimated up front and refused over
draft.train.max_train_hours or the memory there is (`plan_training`, `check_plan`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdeploy.core.durations import duration_text
from specdeploy.core.errors import ConfigError, DiskFullError
from specdeploy.eagle3.samples import DraftData
from specdeploy.recipe.config import Eagle3TrainConfig

# Throughput assumed for the time estimate (as specdeploy.quantize.calibration: labelled estimates; they decide a
# refusal only when far off). Training on CPU in fp32 runs well below calibration's forward-only figure. The CPU
# figures sit between an idle and a loaded machine's, so a busy machine still finishes near the estimate
# (docs/eagle3-train.md "Caching, resuming, refusing").
CPU_FLOPS = 4.0e10
CPU_BF16_FLOPS = 1.2e11  # where draft.train.precision resolves to bfloat16 (AMX / AVX512-BF16)
# draft.train.features engine: the CPU engine's prefill with every row's logits and the aux layers captured, set
# below what it measured (docs/eagle3-train.md "Training further on the CPU")
ENGINE_FEATURE_TOKENS_PER_S = 500.0
GPU_FLOPS = 1.0e14
ADAM_BYTES_PER_PARAM = 16  # fp32 weight, gradient, two Adam moments
CHECKPOINT_BYTES_PER_PARAM = 12  # the resume checkpoint: fp32 weight and two Adam moments (no gradient)
EXPORT_BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class TrainPlan:
    device: str
    steps_per_epoch: int
    total_steps: int
    train_tokens: int  # tokens the target reads over the whole run
    head_params: int
    seconds: float
    peak_bytes: int
    available_bytes: int | None

    def summary(self) -> str:
        gib = 2**30
        avail = f" of {self.available_bytes / gib:.0f} GiB" if self.available_bytes else ""
        return (
            f"{self.total_steps} steps ({self.steps_per_epoch} per epoch), {self.train_tokens:,} tokens, "
            f"head {self.head_params / 1e6:.1f} M parameters, on {self.device}: ~{self.peak_bytes / gib:.1f} GiB"
            f"{avail}, ~{duration_text(self.seconds)} (estimate)"
        )


def head_shape(target_config: dict, draft_vocab_size: int, num_aux: int) -> int:
    """Parameters of the one-layer head sized like the target (ModelOpt's EagleModule)."""
    h = target_config["hidden_size"]
    heads = target_config["num_attention_heads"]
    kv = target_config.get("num_key_value_heads") or heads
    head_dim = target_config.get("head_dim") or h // heads
    inter = target_config["intermediate_size"]
    attn = 2 * h * (heads * head_dim + 2 * kv * head_dim) + heads * head_dim * h  # q/k/v read [embeds, hidden]
    mlp = 3 * h * inter
    vocab = target_config["vocab_size"]
    lm_head = h * draft_vocab_size if draft_vocab_size < vocab else 0  # else the target's own, frozen
    return attn + mlp + num_aux * h * h + lm_head + 4 * h


def plan_training(
    target_config: dict,
    data: DraftData,
    t: Eagle3TrainConfig,
    device: str,
    available_bytes: int | None,
    draft_vocab_size: int,
    num_aux: int,
    precision: str = "float32",
    engine_features: bool = False,
) -> TrainPlan:
    from specdeploy.quantize.calibration import count_params

    steps_per_epoch = math.ceil(len(data.train) / t.batch_size)
    total_steps = max(1, math.ceil(t.epochs * steps_per_epoch))
    tokens_per_epoch = sum(min(len(s.input_ids), t.seq_len) for s in data.train)
    train_tokens = int(tokens_per_epoch * total_steps / steps_per_epoch)
    target_params = count_params(target_config)
    head_params = head_shape(target_config, draft_vocab_size, num_aux)
    vocab = target_config["vocab_size"]
    # per token: the target's forward (2 P), the head's forward + backward over ttt_steps (6 P each); the
    # held-out passes add about one more target forward per epoch over a smaller set.
    flops = train_tokens * ((0.0 if engine_features else 2.0 * target_params) + 6.0 * head_params * t.ttt_steps)
    seconds = flops / (GPU_FLOPS if device == "cuda" else CPU_BF16_FLOPS if precision == "bfloat16" else CPU_FLOPS)
    if engine_features:  # the target's forward in the engine, every training token once a step (once with the cache)
        engine_tokens = min(train_tokens, tokens_per_epoch) if t.feature_cache else train_tokens
        seconds += engine_tokens / ENGINE_FEATURE_TOKENS_PER_S
    # memory: the target in fp32, the head with gradients and Adam, and per batch the target's logits (full
    # vocabulary: logits, softmax, draft-vocabulary copy) and the head's per TTT step
    tokens_per_batch = t.batch_size * t.seq_len
    activations = (
        4 * tokens_per_batch * (3 * vocab + 3 * t.ttt_steps * (draft_vocab_size + 8 * target_config["hidden_size"]))
    )
    peak = int(1.15 * (4 * target_params + ADAM_BYTES_PER_PARAM * head_params + activations))
    return TrainPlan(device, steps_per_epoch, total_steps, train_tokens, head_params, seconds, peak, available_bytes)


def check_plan(plan: TrainPlan, t: Eagle3TrainConfig) -> None:
    """Refuse a run that cannot fit in memory or would take longer than draft.train.max_train_hours."""
    gib = 2**30
    if plan.available_bytes is not None and plan.peak_bytes > plan.available_bytes:
        raise ConfigError(
            f"training the EAGLE-3 head: {plan.summary()}; that needs {plan.peak_bytes / gib:.1f} GiB but "
            f"{plan.available_bytes / gib:.1f} GiB are available",
            "lower draft.train.batch_size or draft.train.seq_len, or train on a machine with more memory",
        )
    if plan.seconds > t.max_train_hours * 3600:
        raise ConfigError(
            f"training the EAGLE-3 head: {plan.summary()}, longer than draft.train.max_train_hours "
            f"({t.max_train_hours:g} h)",
            "lower draft.train.epochs or draft.data.num_prompts, train on a GPU machine, or raise "
            "draft.train.max_train_hours if you mean it (the run is resumable)",
        )


def disk_needed(plan: TrainPlan, t: Eagle3TrainConfig) -> int:
    """Bytes the run writes beside its output: the resume checkpoint twice (the new one is written beside the last
    before it replaces it) and the exported head, plus 1 MiB for the config, manifest and log."""
    checkpoint = plan.head_params * CHECKPOINT_BYTES_PER_PARAM
    return 2 * checkpoint + plan.head_params * EXPORT_BYTES_PER_PARAM.get(t.export_dtype, 4) + (1 << 20)


def check_disk(plan: TrainPlan, t: Eagle3TrainConfig, folder, free: int) -> None:
    """Refuse up front a run whose checkpoints and export cannot fit in the `free` bytes of `folder`'s disk (rather
    than failing at its first checkpoint or, worse, at the export after hours of training)."""
    needed = disk_needed(plan, t)
    if free < needed:
        raise DiskFullError(
            f"not enough disk space to train the EAGLE-3 head in {folder}: about {needed / 2**20:.1f} MiB "
            f"needed (resume checkpoints and the exported head), {free / 2**20:.1f} MiB free",
            "free some space on that disk or point --root at a larger one, and run the command again",
        )
