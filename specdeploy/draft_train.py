"""The draft-train stage: `specdeploy draft train RECIPE` trains an EAGLE-3 head for the recipe's target with
NVIDIA ModelOpt (`modelopt.torch.speculative`) and exports the standard EAGLE-3 checkpoint.

Read top to bottom:
  1. `read_draft_data`: the training set `specdeploy draft data RECIPE` wrote (train.jsonl, heldout.jsonl,
     manifest.json), checked against the target's vocabulary.
  2. `plan_training` / `check_plan`: steps, time and memory, refused up front over draft.train.max_train_hours.
  3. `choose_draft_vocab`: the head's vocabulary, the most frequent answer tokens, as ModelOpt's d2t map.
  4. `build_model`: the target converted with `mtsp.convert(model, [("eagle", cfg)])`, the head sized like the
     target (one decoder layer with its hidden size, heads and intermediate size), not ModelOpt's 8B default.
  5. `train_head`: seeded, resumable training (training-time test over draft.train.ttt_steps positions, soft
     labels from the target, loss on answer positions only), held-out acceptance per epoch.
  6. `heldout_acceptance`: the share of answer positions where the head's chained greedy draft j equals the
     target's greedy token, j = 1..ttt_steps.
  7. `export_head`: ModelOpt's exporter, then config.json made to state what was trained.
  8. `train_recipe`: the stage (cached by fingerprint, written with atomic_output and a manifest).

ModelOpt 0.47 on CPU has four traps (DESIGN.md "EAGLE-3 drafts"); each workaround below says which.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdeploy.config import Eagle3TrainConfig, Recipe, to_plain
from specdeploy.errors import ConfigError, ModelError, SpecDeployError, StaleArtifactError

STAGE = "eagle3-head"
DATA_COMMAND = "specdeploy draft data RECIPE"
TRAIN_FILE, HELDOUT_FILE = "train.jsonl", "heldout.jsonl"
TRAIN_LOG = "train_log.jsonl"
RESUME_STATE = "resume.pt"
CHECKPOINT_EVERY_S = 300.0  # model + optimizer + position saved this often (and at every epoch end)
LENGTH_BUCKET = 32  # batches are padded to a multiple of this (one cached TTT mask per padded length)
TOOL_DISTRIBUTIONS = ("nvidia-modelopt", "torch", "transformers", "safetensors")
# Throughput assumed for the time estimate (as specdeploy.calibration: labelled estimates; they decide a refusal only
# when far off). Training on CPU in fp32 runs well below calibration's forward-only figure. Measured on 2 cores
# (docs/eagle3-train.md): ~1e11 FLOP/s fp32 and ~3e11 bf16 autocast on an idle AMX Xeon, 2e10 fp32 under load ~20;
# the figures below sit between, so a busy machine still finishes near the estimate.
CPU_FLOPS = 4.0e10
CPU_BF16_FLOPS = 1.2e11  # where draft.train.precision resolves to bfloat16 (AMX / AVX512-BF16)
GPU_FLOPS = 1.0e14
ADAM_BYTES_PER_PARAM = 16  # fp32 weight, gradient, two Adam moments


class DraftTrainError(SpecDeployError):
    """The head cannot be trained from what is on disk (missing or broken training data)."""


# ---------------------------------------------------------------- 1. training data


@dataclass(frozen=True)
class Sample:
    id: str
    input_ids: tuple[int, ...]
    loss_start: int
    sampled: bool = False


@dataclass(frozen=True)
class DraftData:
    folder: Path
    train: tuple[Sample, ...]
    heldout: tuple[Sample, ...]
    fingerprint: str  # the data manifest's


def read_draft_data(folder: Path, vocab_size: int, rerun: str = DATA_COMMAND) -> DraftData:
    """The training data of `specdeploy draft data`, every line checked (ids inside the target's vocabulary)."""
    from specdeploy.artifacts import MANIFEST, Manifest

    folder = Path(folder)
    if not folder.is_dir():
        raise StaleArtifactError(f"no EAGLE-3 training data in {folder}", f"run: {rerun}")
    missing = [name for name in (TRAIN_FILE, HELDOUT_FILE, MANIFEST) if not (folder / name).is_file()]
    if missing:
        raise StaleArtifactError(f"the training data in {folder} lacks {', '.join(missing)}", f"run: {rerun}")
    manifest = Manifest.read(folder)
    if manifest is None:
        raise StaleArtifactError(f"{folder / MANIFEST} is unreadable", f"run: {rerun}")
    train = _read_samples(folder / TRAIN_FILE, vocab_size, rerun)
    heldout = _read_samples(folder / HELDOUT_FILE, vocab_size, rerun)
    if not train:
        raise DraftTrainError(f"{folder / TRAIN_FILE} holds no sample with an answer to train on", f"run: {rerun}")
    return DraftData(folder, train, heldout, manifest.fingerprint)


def _read_samples(path: Path, vocab_size: int, rerun: str) -> tuple[Sample, ...]:
    samples = []
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
                ids = tuple(int(t) for t in row["input_ids"])
                sample = Sample(str(row["id"]), ids, int(row["loss_start"]), bool(row.get("sampled", False)))
            except (ValueError, KeyError, TypeError) as exc:
                raise DraftTrainError(f"{where}: not a training sample ({exc!r}); each line needs id, input_ids, "
                                      "loss_start", f"run: {rerun} --force") from exc  # fmt: skip
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise DraftTrainError(f"{where}: token id {bad[0]} is outside the target's vocabulary (0..{vocab_size - 1})",
                                      f"the data was made for another tokenizer; run: {rerun} --force")  # fmt: skip
            if not 0 <= sample.loss_start < len(ids):
                raise DraftTrainError(f"{where}: loss_start {sample.loss_start} is outside its {len(ids)} tokens",
                                      f"run: {rerun} --force")  # fmt: skip
            if len(ids) >= 3:  # a draft needs a context token, the target's token and one to predict
                samples.append(sample)
    return tuple(samples)


# ---------------------------------------------------------------- 2. plan: steps, time, memory


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
        return (f"{self.total_steps} steps ({self.steps_per_epoch} per epoch), {self.train_tokens:,} tokens, "
                f"head {self.head_params / 1e6:.1f} M parameters, on {self.device}: ~{self.peak_bytes / gib:.1f} GiB"
                f"{avail}, ~{_duration(self.seconds)} (estimate)")  # fmt: skip


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


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


def plan_training(target_config: dict, data: DraftData, t: Eagle3TrainConfig, device: str, available_bytes: int | None,
                  draft_vocab_size: int, num_aux: int, precision: str = "float32") -> TrainPlan:  # fmt: skip
    from specdeploy.calibration import count_params

    steps_per_epoch = math.ceil(len(data.train) / t.batch_size)
    total_steps = max(1, math.ceil(t.epochs * steps_per_epoch))
    tokens_per_epoch = sum(min(len(s.input_ids), t.seq_len) for s in data.train)
    train_tokens = int(tokens_per_epoch * total_steps / steps_per_epoch)
    target_params = count_params(target_config)
    head_params = head_shape(target_config, draft_vocab_size, num_aux)
    vocab = target_config["vocab_size"]
    # per token: the target's forward (2 P), the head's forward + backward over ttt_steps (6 P each); the
    # held-out passes add about one more target forward per epoch over a smaller set.
    flops = train_tokens * (2.0 * target_params + 6.0 * head_params * t.ttt_steps)
    seconds = flops / (GPU_FLOPS if device == "cuda" else CPU_BF16_FLOPS if precision == "bfloat16" else CPU_FLOPS)
    # memory: the target in fp32, the head with gradients and Adam, and per batch the target's logits (full
    # vocabulary: logits, softmax, draft-vocabulary copy) and the head's per TTT step
    tokens_per_batch = t.batch_size * t.seq_len
    activations = 4 * tokens_per_batch * (3 * vocab + 3 * t.ttt_steps * (draft_vocab_size + 8 * target_config["hidden_size"]))
    peak = int(1.15 * (4 * target_params + ADAM_BYTES_PER_PARAM * head_params + activations))
    return TrainPlan(device, steps_per_epoch, total_steps, train_tokens, head_params, seconds, peak, available_bytes)


def check_plan(plan: TrainPlan, t: Eagle3TrainConfig) -> None:
    """Refuse a run that cannot fit in memory or would take longer than draft.train.max_train_hours."""
    gib = 2**30
    if plan.available_bytes is not None and plan.peak_bytes > plan.available_bytes:
        raise ConfigError(f"training the EAGLE-3 head: {plan.summary()}; that needs {plan.peak_bytes / gib:.1f} GiB but "
                          f"{plan.available_bytes / gib:.1f} GiB are available",
                          "lower draft.train.batch_size or draft.train.seq_len, or train on a machine with more memory")  # fmt: skip
    if plan.seconds > t.max_train_hours * 3600:
        raise ConfigError(f"training the EAGLE-3 head: {plan.summary()}, longer than draft.train.max_train_hours "
                          f"({t.max_train_hours:g} h)",
                          "lower draft.train.epochs or draft.data.num_prompts, train on a GPU machine, or raise "
                          "draft.train.max_train_hours if you mean it (the run is resumable)")  # fmt: skip


# ---------------------------------------------------------------- 3. draft vocabulary


def choose_draft_vocab(samples, vocab_size: int, draft_vocab_size: int) -> list[int] | None:
    """The head's vocabulary: the `draft_vocab_size` target ids most frequent in the answers (ties: lower id),
    filled up from the prompts and then the lowest ids; ascending. None when it would be the full vocabulary.

    ModelOpt's convention (plugins/hf_eagle.py `pseudo_speculative_generate`: `draft_token += d2t[draft_token]`,
    and `_map_logits_to_draft_vocab`: target ids = arange + d2t): target_id = draft_id + d2t[draft_id]."""
    if draft_vocab_size >= vocab_size:
        return None
    from collections import Counter

    answers, prompts = Counter(), Counter()
    for s in samples:
        answers.update(s.input_ids[s.loss_start:])
        prompts.update(s.input_ids[: s.loss_start])
    chosen: list[int] = []
    seen: set[int] = set()
    for counter in (answers, prompts):
        for token, _ in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])):
            if len(chosen) == draft_vocab_size:
                break
            if token not in seen:
                chosen.append(token)
                seen.add(token)
    token = 0
    while len(chosen) < draft_vocab_size:
        if token not in seen:
            chosen.append(token)
            seen.add(token)
        token += 1
    return sorted(chosen)


def d2t_of(draft_ids: list[int]):
    import torch

    ids = torch.tensor(draft_ids, dtype=torch.int64)
    return ids - torch.arange(len(draft_ids), dtype=torch.int64)  # [draft_vocab]


# ---------------------------------------------------------------- 4. the model


def aux_layer_ids(target_config: dict, t: Eagle3TrainConfig) -> list[int]:
    """Target layers whose outputs feed the head: draft.train.aux_layers, or ModelOpt's default."""
    from modelopt.torch.speculative.plugins.hf_eagle import default_eagle_aux_layer_ids

    layers = target_config["num_hidden_layers"]
    ids = list(t.aux_layers) or default_eagle_aux_layer_ids(layers)
    bad = [i for i in ids if not 0 <= i < layers]
    if bad:
        raise ConfigError(f"draft.train.aux_layers: layer {bad[0]} does not exist (the target has {layers} layers, 0..{layers - 1})",
                          "name layers of the target, or leave aux_layers empty for ModelOpt's default")  # fmt: skip
    return sorted(set(ids))


def eagle_config(target_config: dict, t: Eagle3TrainConfig, draft_vocab_size: int, aux_ids: list[int]) -> dict:
    """ModelOpt's EAGLE3_DEFAULT_CFG with the head sized like the target and the CPU traps avoided."""
    import modelopt.torch.speculative as mtsp

    cfg = copy.deepcopy(mtsp.config.EAGLE3_DEFAULT_CFG)["config"]
    heads = target_config["num_attention_heads"]
    rope_theta = _rope_theta(target_config)
    cfg["eagle_architecture_config"].update(
        intermediate_size=target_config["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=target_config.get("num_key_value_heads") or heads,
        head_dim=target_config.get("head_dim") or target_config["hidden_size"] // heads,
        rms_norm_eps=target_config.get("rms_norm_eps", 1e-5),
        hidden_act=target_config.get("hidden_act", "silu"),
        # the target's own RoPE base (the default's 10000 is Llama-2's), no scaling
        rope_theta=rope_theta,
        rope_scaling={"rope_type": "default", "rope_theta": rope_theta},
        torch_dtype="float32",
        draft_vocab_size=draft_vocab_size,
        eagle_aux_hidden_state_layer_ids=aux_ids,
    )
    cfg["eagle_ttt_steps"] = t.ttt_steps
    # trap 2: torch.compile(max-autotune) costs minutes per shape on CPU and buys nothing here
    cfg["eagle_use_torch_compile"] = False
    # the exporter would write YaRN scaling (factor 32) into config.json although the head trained without it
    # (modelopt/torch/export/plugins/hf_spec_export.py `_export_config`, and speculative/config.py
    # `eagle_export_rope_scaling`): the head is exported with the RoPE it trained with.
    cfg["eagle_export_rope_scaling"] = {}
    return cfg


def _rope_theta(target_config: dict) -> float:
    for source in (target_config, target_config.get("rope_parameters") or {}, target_config.get("rope_scaling") or {}):
        if source.get("rope_theta") is not None:
            return float(source["rope_theta"])
    return 10000.0


def build_model(target_dir: Path, t: Eagle3TrainConfig, draft_ids: list[int] | None, aux_ids: list[int], device: str = "cpu"):
    """The target (frozen, fp32) converted to ModelOpt's EAGLE-3 model with a fresh head (seeded)."""
    import modelopt.torch.speculative as mtsp
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    target_config = model.config.to_dict()
    vocab = target_config["vocab_size"]
    draft_vocab_size = len(draft_ids) if draft_ids is not None else vocab
    torch.manual_seed(t.seed)  # the head's initial weights
    mtsp.convert(model, [("eagle", eagle_config(target_config, t, draft_vocab_size, aux_ids))])
    head = model.eagle_module
    if draft_ids is not None:
        with torch.no_grad():
            head.d2t.copy_(d2t_of(draft_ids))
    # trap 1: ModelOpt builds the head's rotary embedding with a `device=` keyword (plugins/modeling_eagle.py
    # `_maybe_init_rope`) that transformers 5.23's LlamaRotaryEmbedding(config) does not take; it only builds one
    # when the head has none, so the head gets it here (inv_freq is not a persistent buffer: nothing is exported).
    head.rotary_emb = LlamaRotaryEmbedding(config=head.config)
    # trap 3: the head keeps ModelOpt's default sdpa attention (flex attention has no CPU backward).
    assert head.config._attn_implementation == "sdpa", head.config._attn_implementation
    # trap 5: ModelOpt 0.47 feeds the features through the decoder layer's input_layernorm before its attention
    # pre-hook applies hidden_norm (plugins/modeling_eagle.py `_eagle3_attention_forward_pre_hook`: self_attn gets
    # `input_layernorm(hidden_states)` from LlamaDecoderLayer), while the runtimes that serve the head normalise the
    # features with hidden_norm only (TensorRT-LLM Eagle3DecoderLayer, vLLM llama_eagle3, llama.cpp eagle3, and
    # specdeploy/engine/eagle3.py). With input_layernorm's weight held at ones the extra RMSNorm is the identity on
    # an already normalised vector, so what is trained is what is served; the weight only scales the embeddings'
    # half of q/k/v's input, which q/k/v learn anyway.
    head.layers[0].input_layernorm.weight.requires_grad_(False)
    if t.init_from_target:
        init_head_from_target(model, draft_ids)
    model.to(device)
    return model


def init_head_from_target(model, draft_ids: list[int] | None) -> None:
    """Start the head's decoder layer from the target's last layer and its LM head from the target's rows.

    ModelOpt has no such option (its head starts random). The head's q/k/v read [embeddings, hidden] (2x
    hidden): the hidden half takes the target's weights, the embedding half stays as initialised."""
    import torch

    src = model.model.layers[-1]
    dst = model.eagle_module.layers[0]
    h = model.config.hidden_size
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(dst.self_attn, name).weight[:, h:].copy_(getattr(src.self_attn, name).weight)
        dst.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(dst.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
        dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
        model.eagle_module.norm.weight.copy_(model.model.norm.weight)
        if hasattr(model.eagle_module, "lm_head"):
            rows = model.lm_head.weight if draft_ids is None else model.lm_head.weight[torch.tensor(draft_ids)]
            model.eagle_module.lm_head.weight.copy_(rows)


def head_parameters(model) -> list:
    return [p for p in model.eagle_module.parameters() if p.requires_grad]


# ---------------------------------------------------------------- batches


def make_batch(samples, seq_len: int, pad_id: int, device: str = "cpu"):
    """(input_ids, loss_mask, lengths): right-padded to a multiple of LENGTH_BUCKET (at most seq_len).

    loss_mask[p] weights the target's prediction at position p (the token p + 1), as ModelOpt's `_eagle_loss`
    reads it (`loss_mask[:, 1 + ttt_step:]` beside `base_output_predict_tok[:, 1 + ttt_step:]`): positions
    >= loss_start are the answer's, whose first token the target itself gives (the head drafts from the next)."""
    import torch

    lengths = [min(len(s.input_ids), seq_len) for s in samples]
    width = min(seq_len, LENGTH_BUCKET * math.ceil(max(lengths) / LENGTH_BUCKET))
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for row, (s, n) in enumerate(zip(samples, lengths)):
        ids[row, :n] = torch.tensor(s.input_ids[:n])
        mask[row, s.loss_start:n] = 1
    return ids.to(device), mask.to(device), lengths  # [batch, width] x2


class _MaskCache:
    """ModelOpt caches the training-time-test attention masks by TTT step only (`_get_ttt_attention_mask`), sized
    for the first batch's length; batches here are padded to a few lengths (not all to seq_len: on CPU the padding
    would cost more than the training), so each length keeps its own cache."""

    def __init__(self, model):
        self.model = model
        self.by_length: dict[int, dict] = {}

    def use(self, width: int) -> None:
        self.model._cached_attn_blk_masks = self.by_length.setdefault(width, {})


# ---------------------------------------------------------------- 6. held-out acceptance


@dataclass
class Acceptance:
    positions: int  # chain starts evaluated
    accepted_at_least: list[float]  # [j-1]: share of starts whose drafts 1..j all equal the target's tokens
    per_position: list[float]  # [j-1]: share of draft j equal to the target's token, among starts that reached j

    @property
    def mean_accepted(self) -> float:
        """Expected accepted drafts per round with max_draft_len = ttt_steps (greedy, without the target's own)."""
        return sum(self.accepted_at_least)

    def line(self) -> str:
        per = " ".join(f"{j + 1}:{a:.3f}" for j, a in enumerate(self.per_position))
        return f"held-out acceptance per position {per}; mean accepted {self.mean_accepted:.2f} ({self.positions} positions)"


def heldout_acceptance(model, samples, ttt_steps: int, seq_len: int, batch_size: int, pad_id: int, device: str = "cpu") -> Acceptance:
    """Greedy acceptance of the head on held-out answers, as drafting at inference would see it.

    For each answer position s (the target has read tokens 0..s and gives token s+1), the head drafts j = 1..K
    tokens in a chain: draft j reads the head's own hidden state from draft j-1 (ModelOpt's training-time test
    runs exactly this: `forward` rolls the head's pre-norm output one position per TTT step and masks attention
    with `get_ttt_msk_func`). Draft j is accepted when it and all before it equal the target's greedy tokens.
    Drafts past the first are fed the sample's tokens, which equal the drafts wherever all earlier drafts were
    accepted; a start counts only where the sample's next K tokens are the target's own greedy ones (always on
    greedy answers; on sampled answers elsewhere the chain would be fed tokens it did not draft)."""
    import torch

    head = model.eagle_module
    d2t = getattr(head, "d2t", None)
    hits = [0] * ttt_steps
    starts = 0
    recorded: list = []
    original = model._eagle_forward

    def recording(*args, **kwargs):  # ModelOpt's own forward, its logits kept (one call per TTT step)
        out = original(*args, **kwargs)
        recorded.append(out[2].detach())
        return out

    was_training = model.training
    model._eagle_forward = recording
    try:
        model.train()  # ModelOpt runs the TTT steps only in training mode; no dropout in Llama layers (p = 0)
        with torch.no_grad():
            for i in range(0, len(samples), batch_size):
                chunk = samples[i : i + batch_size]
                ids, loss_mask, lengths = make_batch(chunk, seq_len, pad_id, device)
                if not hasattr(model, "_mask_cache"):
                    model._mask_cache = _MaskCache(model)
                model._mask_cache.use(ids.shape[1])
                recorded.clear()
                out = model(input_ids=ids, loss_mask=loss_mask)
                target_next = out.logits.argmax(-1)  # [batch, width]: the target's token after position p
                drafts = []
                for logits in recorded[:ttt_steps]:
                    d = logits.argmax(-1)  # [batch, width] draft-vocabulary ids
                    drafts.append(d + d2t[d] if d2t is not None else d)
                for row, (s, n) in enumerate(zip(chunk, lengths)):
                    x = ids[row, :n]
                    g = target_next[row, :n]
                    for start in range(max(0, s.loss_start - 1), n - ttt_steps):
                        # the sample follows the target's greedy path for the next K tokens
                        if not torch.equal(x[start + 1 : start + 1 + ttt_steps], g[start : start + ttt_steps]):
                            continue
                        starts += 1
                        for j in range(ttt_steps):
                            # draft j+1 sits at head position start + j (step j) and predicts token start + j + 2
                            if drafts[j][row, start + j] != g[start + j + 1]:
                                break
                            hits[j] += 1
    finally:
        model._eagle_forward = original
        model.train(was_training)
    at_least = [h / starts if starts else 0.0 for h in hits]
    reached = [starts] + hits[:-1]
    per_position = [h / r if r else 0.0 for h, r in zip(hits, reached)]
    return Acceptance(starts, at_least, per_position)


# ---------------------------------------------------------------- 5. training


@dataclass
class TrainResult:
    acceptance: Acceptance
    initial_acceptance: Acceptance
    steps: int
    resumed_from_step: int
    seconds: float
    tokens: int
    step_seconds: float  # in training steps alone (held-out passes not counted)
    log: list = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_seconds if self.step_seconds else 0.0


def learning_rate_at(t: Eagle3TrainConfig, step: int, total_steps: int) -> float:
    """draft.train.lr_schedule at `step` (0-based): a function of the step alone, so a resumed run follows the same
    curve. cosine: learning_rate at the first step, a tenth of it at the last."""
    if t.lr_schedule == "constant" or total_steps <= 1:
        return t.learning_rate
    floor = 0.1 * t.learning_rate
    return floor + 0.5 * (t.learning_rate - floor) * (1 + math.cos(math.pi * step / (total_steps - 1)))


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def train_head(model, data: DraftData, t: Eagle3TrainConfig, work_dir: Path, *, fingerprint: str = "", progress: bool = True,
               echo=print, device: str = "cpu", pad_id: int = 0, checkpoint_every_s: float = CHECKPOINT_EVERY_S,
               precision: str = "float32", _stop_after_step: int | None = None) -> TrainResult:  # fmt: skip
    """Train the head of `model` on `data`; checkpoints model + optimizer + position into `work_dir` (a rerun
    with the same `fingerprint` continues from there). Returns the held-out acceptance before and after."""
    import torch
    from tqdm.auto import tqdm

    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    params = head_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=t.learning_rate)
    steps_per_epoch = math.ceil(len(data.train) / t.batch_size)
    total_steps = max(1, math.ceil(t.epochs * steps_per_epoch))
    masks = _MaskCache(model)
    model._mask_cache = masks
    # held-out acceptance in fp32 whatever the training precision: the target's greedy tokens as exact as here
    evaluate = lambda: heldout_acceptance(model, list(data.heldout), t.ttt_steps, t.seq_len, t.batch_size, pad_id, device)  # noqa: E731

    step, log = 0, []
    state_path = work_dir / RESUME_STATE
    state = torch.load(state_path, map_location=device, weights_only=False) if state_path.is_file() else None
    if state is not None and state.get("fingerprint") == fingerprint:
        model.eagle_module.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        step, log = state["step"], state["log"]
        initial = Acceptance(**state["initial_acceptance"])
        echo(f"resuming at step {step} of {total_steps} ({state_path})")
    else:
        initial = evaluate()
        echo(f"untrained head: {initial.line()}")
        log.append({"epoch": 0, "step": 0, "heldout": asdict(initial)})
    resumed_from = step

    def save() -> None:
        tmp = state_path.with_suffix(".tmp")
        torch.save({"fingerprint": fingerprint, "step": step, "log": log, "head": model.eagle_module.state_dict(),
                    "optimizer": optimizer.state_dict(), "initial_acceptance": asdict(initial)}, tmp)  # fmt: skip
        os.replace(tmp, state_path)

    model.train()
    t0 = last_save = time.monotonic()
    tokens, step_seconds = 0, 0.0
    losses: list[float] = []
    accs: list[list[float]] = []
    bar = tqdm(total=total_steps, initial=step, desc="train eagle3 head", unit="step", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)  # fmt: skip
    try:
        while step < total_steps:
            epoch, k = divmod(step, steps_per_epoch)
            order = epoch_order(len(data.train), t.seed, epoch)
            chunk = [data.train[i] for i in order[k * t.batch_size : (k + 1) * t.batch_size]]
            ids, loss_mask, lengths = make_batch(chunk, t.seq_len, pad_id, device)
            masks.use(ids.shape[1])
            for group in optimizer.param_groups:
                group["lr"] = learning_rate_at(t, step, total_steps)
            started = time.monotonic()
            with autocast(precision, device):
                out = model(input_ids=ids, loss_mask=loss_mask)
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            optimizer.step()
            step_seconds += time.monotonic() - started
            step += 1
            tokens += sum(lengths)
            losses.append(float(out.loss.detach()))
            accs.append(out.train_acc[0])
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", acc1=f"{accs[-1][0]:.2f}", tok_s=f"{tokens / step_seconds:.0f}")
            end_of_epoch = step % steps_per_epoch == 0 or step == total_steps
            if end_of_epoch:
                acc = evaluate()
                entry = {"epoch": round(step / steps_per_epoch, 3), "step": step, "loss": sum(losses) / len(losses),
                         "train_acc": [sum(a[j] for a in accs) / len(accs) for j in range(len(accs[0]))],
                         "heldout": asdict(acc), "seconds": round(time.monotonic() - t0, 1),
                         "train_tokens_per_s": round(tokens / step_seconds, 1)}  # fmt: skip
                log.append(entry)
                losses.clear()
                accs.clear()
                bar.write(f"epoch {entry['epoch']:g}: loss {entry['loss']:.3f}, {acc.line()}", file=sys.stderr)
            if end_of_epoch or time.monotonic() - last_save >= checkpoint_every_s:
                save()
                last_save = time.monotonic()
            if _stop_after_step is not None and step >= _stop_after_step and step < total_steps:
                raise KeyboardInterrupt(f"stopped after step {step} (test)")
    finally:
        bar.close()
    final = Acceptance(**log[-1]["heldout"])
    return TrainResult(final, initial, step, resumed_from, time.monotonic() - t0, tokens, step_seconds, log)


# ---------------------------------------------------------------- 7. export


def cast_weights(path: Path, dtype: str) -> None:
    """Rewrite an exported head's weights in `dtype` (draft.train.export_dtype); d2t stays integer. The head trains
    in fp32; bfloat16 halves the file (the CPU engine and the GPU runtimes compute the head in bf16 anyway)."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path))
    cast = {k: (v if k == "d2t" or not v.is_floating_point() else v.to(getattr(torch, dtype))) for k, v in weights.items()}
    tmp = path.with_suffix(".tmp")
    save_file(cast, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def export_head(model, out_dir: Path, aux_ids: list[int], dtype: str = "float32") -> dict:
    """ModelOpt's exporter (export_speculative_decoding), then config.json stating what was trained.

    The exporter writes the state dict as it is (fp32 here) while config.json takes `torch_dtype` from the
    architecture config; the RoPE is the one trained (eagle_export_rope_scaling={}). llama.cpp's converter reads a
    top-level `eagle_aux_hidden_state_layer_ids` (conversion/llama.py) as the layers whose *inputs* it captures
    (src/llama-context.cpp `extract_layer_inputs`, common/speculative.cpp `llama_set_embeddings_layer_inp`),
    while ModelOpt's ids are layers whose *outputs* feed the head (plugins/hf_eagle.py forward hook): the top-level
    copy is ModelOpt's ids + 1 (its default [2, L//2, L-3] is ModelOpt's [1, L//2-1, L-4] + 1)."""
    from modelopt.torch.export import export_speculative_decoding
    from safetensors import safe_open

    out_dir = Path(out_dir)
    export_speculative_decoding(model, export_dir=out_dir)
    if dtype != "float32":
        cast_weights(out_dir / "model.safetensors", dtype)
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    with safe_open(str(out_dir / "model.safetensors"), "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()).lower() for k in f.keys() if k != "d2t"}
    names = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
    dtype = names.get(dtypes.pop(), "float32") if len(dtypes) == 1 else "float32"
    config["torch_dtype"] = dtype
    config["dtype"] = dtype
    head_config = model.eagle_module.config
    config["rope_theta"] = _rope_theta(to_plain(head_config.to_dict()))
    config["rope_scaling"] = None
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in aux_ids]
    config["target_hidden_size"] = model.config.hidden_size
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return config


def load_exported_head(model, head_dir: Path) -> None:
    """Load an exported head's weights into a converted model (the inverse of export_head, for checks)."""
    from safetensors.torch import load_file

    weights = load_file(str(Path(head_dir) / "model.safetensors"))
    own = model.eagle_module.state_dict()
    if "lm_head.weight" not in own:
        weights.pop("lm_head.weight")  # the exporter adds the target's when the head shares it
    missing, unexpected = model.eagle_module.load_state_dict({k: v.to(own[k].dtype) for k, v in weights.items()}, strict=False)
    if missing or unexpected:
        raise ModelError(f"{head_dir}: the exported head does not match this model (missing {missing}, unexpected {unexpected})",
                         "export it again with specdeploy draft train --force")  # fmt: skip


# ---------------------------------------------------------------- 8. the stage


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def train_precision(t: Eagle3TrainConfig, device: str) -> str:
    """draft.train.precision resolved: "auto" is bfloat16 on a GPU or on a CPU that multiplies bf16 in hardware
    (measured on a 2-core AMX Xeon, SmolLM2-135M, 4 x 384 tokens a step: 190-250 tokens/s fp32, 540-700 bf16, the
    same loss to 2 decimals over the first steps), else float32."""
    if t.precision != "auto":
        return t.precision
    from specdeploy.engine.native import bf16_native

    return "bfloat16" if device == "cuda" or bf16_native() else "float32"


def autocast(precision: str, device: str):
    """Forward passes in `precision` (torch autocast: matmuls in bf16, reductions and the loss in fp32); the
    weights, gradients and AdamW state stay fp32."""
    import torch

    return torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=precision == "bfloat16")


def _available_memory(device: str) -> int | None:
    import torch

    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except (ImportError, OSError):
        return None


def stage_fingerprint(recipe: Recipe, target_hash: str, data_fingerprint: str) -> str:
    from specdeploy.artifacts import fingerprint

    return fingerprint(stage=STAGE, target=target_hash, data=data_fingerprint, train=to_plain(recipe.draft.train))


def resume_dir(dest: Path) -> Path:
    """Where an unfinished run keeps its checkpoint (beside the output; removed when the head is exported)."""
    return dest.parent / f"{dest.name}.partial"


def train_recipe(recipe: Recipe, layout, force: bool = False, echo=print, progress: bool = True) -> TrainResult | None:
    """Train and export the recipe's EAGLE-3 head into layout.eagle3_head; None when it is up to date."""
    import shutil

    from specdeploy import models
    from specdeploy.artifacts import Manifest, atomic_output, dir_hash, is_up_to_date, tool_versions

    if not recipe.draft.is_eagle3:
        raise ConfigError(f"draft.kind is {recipe.draft.kind}, not eagle3: there is no head to train",
                          "set draft.kind: eagle3 (with draft.head: trained) to train one")  # fmt: skip
    t = recipe.draft.train
    target_dir = models.resolve(recipe.target.model)
    target_config = json.loads((target_dir / "config.json").read_text())
    vocab = target_config["vocab_size"]
    data = read_draft_data(layout.draft_data, vocab)
    target_hash = dir_hash(target_dir)
    fp = stage_fingerprint(recipe, target_hash, data.fingerprint)
    dest = layout.eagle3_head
    if not force and is_up_to_date(dest, fp):
        echo(f"eagle3 head: up to date ({dest})")
        return None
    aux_ids = aux_layer_ids(target_config, t)
    draft_ids = choose_draft_vocab(data.train, vocab, t.draft_vocab_size)
    draft_vocab_size = len(draft_ids) if draft_ids is not None else vocab
    device = _device()
    precision = train_precision(t, device)
    plan = plan_training(target_config, data, t, device, _available_memory(device), draft_vocab_size, len(aux_ids), precision)
    check_plan(plan, t)
    echo(f"eagle3 head for {recipe.target.model}: {plan.summary()}")
    echo(f"  aux layers {aux_ids}, draft vocabulary {draft_vocab_size} of {vocab}, {len(data.train)} training and "
         f"{len(data.heldout)} held-out samples from {data.folder}")  # fmt: skip
    work = resume_dir(dest)
    if force and work.exists():
        shutil.rmtree(work)
    model = build_model(target_dir, t, draft_ids, aux_ids, device)
    pad_id = target_config.get("pad_token_id")
    pad_id = pad_id if isinstance(pad_id, int) and 0 <= pad_id < vocab else 0
    echo(f"  forward passes in {precision} (draft.train.precision {t.precision})")
    result = train_head(model, data, t, work, fingerprint=fp, progress=progress, echo=echo, device=device, pad_id=pad_id,
                        precision=precision)
    head_params = sum(p.numel() for p in model.eagle_module.parameters())
    with atomic_output(dest) as tmp:
        export_head(model, tmp, aux_ids, t.export_dtype)
        (tmp / TRAIN_LOG).write_text("".join(json.dumps(entry) + "\n" for entry in result.log))
        Manifest(
            stage=STAGE,
            recipe_name=recipe.name,
            fingerprint=fp,
            settings={"train": to_plain(t), "aux_layers": aux_ids, "draft_vocab_size": draft_vocab_size,
                      "device": device, "precision": precision, "seed": t.seed},  # fmt: skip
            inputs={"target_dir": str(target_dir), "target_hash": target_hash, "data_dir": str(data.folder),
                    "data_fingerprint": data.fingerprint},  # fmt: skip
            tool_versions=tool_versions(*TOOL_DISTRIBUTIONS),
            extra={"heldout_acceptance": asdict(result.acceptance), "untrained_acceptance": asdict(result.initial_acceptance),
                   "mean_accepted": result.acceptance.mean_accepted, "head_parameters": head_params,
                   "steps": result.steps, "resumed_from_step": result.resumed_from_step, "train_seconds": round(result.seconds, 1),
                   "train_tokens_per_s": round(result.tokens_per_s, 1),
                   "seconds_per_step": round(result.step_seconds / max(1, result.steps - result.resumed_from_step), 2),
                   "command": " ".join(sys.argv) or f"specdeploy draft train {recipe.name}"},  # fmt: skip
        ).write(tmp)
    shutil.rmtree(work, ignore_errors=True)
    echo(f"eagle3 head: {result.acceptance.line()}")
    echo(f"eagle3 head: wrote {dest}")
    return result
