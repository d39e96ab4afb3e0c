"""Training the head: batches, the held-out acceptance (`heldout_acceptance`), and `train_head`, seeded and
resumable (training-time test over draft.train.ttt_steps positions, soft labels from the target, loss on answer
positions only; model + optimizer + position checkpointed into a work folder)."""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdeploy.core.artifacts import disk_full_as_error
from specdeploy.eagle3.modelopt import head_parameters
from specdeploy.eagle3.samples import DraftData
from specdeploy.recipe.config import Eagle3TrainConfig

RESUME_STATE = "resume.pt"
CHECKPOINT_EVERY_S = 300.0  # model + optimizer + position saved this often (and at every epoch end)
# with a time limit: the steps are fitted to it once FIT_AFTER_STEPS are done, at the pace of those after the first
# WARM_UP_STEPS (a GPU's first steps also pay for its kernels' set-up: timed from step 0, an H200's first run fitted
# 820 steps into a limit that 2,044 would have met)
WARM_UP_STEPS = 10
FIT_AFTER_STEPS = 30
LENGTH_BUCKET = 32  # batches are padded to a multiple of this (one cached TTT mask per padded length)
GROUP_POOL_BATCHES = 64  # draft.train.length_grouping: samples sorted by length within pools of this many batches


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
        mask[row, s.loss_start : n] = 1
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


# ---------------------------------------------------------------- held-out acceptance


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
        return (
            f"held-out acceptance per position {per}; mean accepted {self.mean_accepted:.2f} ({self.positions}"
            " positions)"
        )


def heldout_acceptance(
    model, samples, ttt_steps: int, seq_len: int, batch_size: int, pad_id: int, device: str = "cpu", features=None
) -> Acceptance:
    """Greedy acceptance of the head on held-out answers, as drafting at inference would see it.

    For each answer position s (the target has read tokens 0..s and gives token s+1), the head drafts j = 1..K
    tokens in a chain: draft j reads the head's own hidden state from draft j-1 (ModelOpt's training-time test
    runs exactly this: `forward` rolls the head's pre-norm output one position per TTT step and masks attention
    with `get_ttt_msk_func`). Draft j is accepted when it and all before it equal the target's greedy tokens.
    Drafts past the first are fed the sample's tokens, which equal the drafts wherever all earlier drafts were
    accepted; a start counts only where the sample's next K tokens are the target's own greedy ones (always on
    greedy answers; on sampled answers elsewhere the chain would be fed tokens it did not draft).

    `features(samples, width)`: the target's outputs for ModelOpt's offline mode (specdeploy.eagle3.features);
    None: the model runs the target itself."""
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
                out = model(input_ids=ids, loss_mask=loss_mask, **(features(chunk, ids.shape[1]) if features else {}))
                target_next = out.logits.argmax(-1)  # [batch, width]: the target's token after position p
                drafts = []
                for logits in recorded[:ttt_steps]:
                    d = logits.argmax(-1)  # [batch, width] draft-vocabulary ids
                    drafts.append(d + d2t[d] if d2t is not None else d)
                begin = torch.tensor([max(0, s.loss_start - 1) for s in chunk], device=ids.device)
                end = torch.tensor(lengths, device=ids.device) - ttt_steps
                chains, counted = chain_hits(ids, target_next, drafts, begin, end)
                starts += counted
                for j in range(ttt_steps):
                    hits[j] += chains[j]
    finally:
        model._eagle_forward = original
        model.train(was_training)
    at_least = [h / starts if starts else 0.0 for h in hits]
    reached = [starts] + hits[:-1]
    per_position = [h / r if r else 0.0 for h, r in zip(hits, reached)]
    return Acceptance(starts, at_least, per_position)


def chain_hits(ids, target_next, drafts, begin, end) -> tuple[list[int], int]:
    """Over every row r and start position s in [begin[r], end[r]) where the sample follows the target's greedy path
    for the next K = len(drafts) tokens (ids[s + 1 + i] == target_next[s + i], i < K): how many starts have drafts
    1..j all equal to the target's tokens (draft j sits at head position s + j - 1 and predicts token s + j + 1),
    for each j, and how many starts were counted. One pass of tensor operations per batch (a loop over positions
    would wait on the device at every comparison)."""
    import torch

    width = ids.shape[1]
    k = len(drafts)

    def ahead(x, i):  # ahead(x, i)[:, s] = x[:, s + i], False past the end
        if i == 0:
            return x
        out = torch.zeros_like(x)
        out[:, : width - i] = x[:, i:]
        return out

    follows_next = torch.zeros_like(ids, dtype=torch.bool)
    follows_next[:, : width - 1] = ids[:, 1:] == target_next[:, : width - 1]  # [:, p]: token p + 1 is the target's
    positions = torch.arange(width, device=ids.device)[None, :]
    counted = (positions >= begin[:, None]) & (positions < end[:, None])
    for i in range(k):
        counted &= ahead(follows_next, i)
    gives = ahead(target_next, 1)  # [:, p]: the target's token after position p + 1
    chain = counted
    hits = []
    for j in range(k):
        chain = chain & ahead(drafts[j] == gives, j)
        hits.append(int(chain.sum()))
    return hits, int(counted.sum())


# ---------------------------------------------------------------- training


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
    planned_steps: int = 0  # before a time limit cut them (== steps without one)

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


def epoch_batches(lengths: list[int], t: Eagle3TrainConfig, epoch: int) -> list[list[int]]:
    """The epoch's batches (sample indices), a function of (seed, epoch) alone, so a resumed run takes the same.
    Shuffled and cut in order; with draft.train.length_grouping the shuffled order is cut into pools of
    GROUP_POOL_BATCHES batches, each pool sorted by length and cut, and the batches shuffled again: the same number
    of batches, each of similar lengths (padding is what a CPU pays for most: docs/eagle3-train.md "Training further
    on the CPU")."""
    import torch

    order = epoch_order(len(lengths), t.seed, epoch)
    size = t.batch_size
    if not t.length_grouping:
        return [order[i : i + size] for i in range(0, len(order), size)]
    pool = size * GROUP_POOL_BATCHES
    batches = []
    for i in range(0, len(order), pool):
        sorted_pool = sorted(order[i : i + pool], key=lambda j: (lengths[j], j))
        batches += [sorted_pool[k : k + size] for k in range(0, len(sorted_pool), size)]
    g = torch.Generator().manual_seed(t.seed * 1_000_003 + epoch + 500_009)
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def train_head(
    model,
    data: DraftData,
    t: Eagle3TrainConfig,
    work_dir: Path,
    *,
    fingerprint: str = "",
    progress: bool = True,
    echo=print,
    device: str = "cpu",
    pad_id: int = 0,
    checkpoint_every_s: float = CHECKPOINT_EVERY_S,
    precision: str = "float32",
    time_limit_s: float | None = None,
    features=None,
    step_features=None,
    _stop_after_step: int | None = None,
) -> TrainResult:
    """Train the head of `model` on `data`; checkpoints model + optimizer + position into `work_dir` (a rerun
    with the same `fingerprint` continues from there). Returns the held-out acceptance before and after.

    `time_limit_s`: the run (held-out passes included) ends within about that many seconds: once FIT_AFTER_STEPS
    steps are done, the planned steps are cut to what fits at the pace of those after WARM_UP_STEPS (the learning-rate
    schedule follows the new total), so a lent GPU's minutes still end in an exported head. `features`: as in
    heldout_acceptance; `step_features`: the training steps' own (draft_features.TopKFeatures), else `features`."""
    import torch
    from tqdm.auto import tqdm

    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    step_features = step_features or features
    params = head_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=t.learning_rate)
    steps_per_epoch = math.ceil(len(data.train) / t.batch_size)
    total_steps = max(1, math.ceil(t.epochs * steps_per_epoch))
    masks = _MaskCache(model)
    model._mask_cache = masks
    # held-out acceptance in fp32 whatever the training precision: the target's greedy tokens as exact as here
    evaluate = lambda: heldout_acceptance(
        model, list(data.heldout), t.ttt_steps, t.seq_len, t.batch_size, pad_id, device, features
    )  # noqa: E731
    lengths = [min(len(s.input_ids), t.seq_len) for s in data.train]
    batches: dict[int, list[list[int]]] = {}  # epoch -> its batches

    step, log = 0, []
    began = time.monotonic()
    planned_steps = total_steps
    state_path = work_dir / RESUME_STATE
    state = torch.load(state_path, map_location=device, weights_only=False) if state_path.is_file() else None
    if state is not None and state.get("fingerprint") == fingerprint:
        model.eagle_module.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        step, log = state["step"], state["log"]
        total_steps = state.get("total_steps", total_steps)
        initial = Acceptance(**state["initial_acceptance"])
        echo(f"resuming at step {step} of {total_steps} ({state_path})")
        # what one held-out pass took when the run began: a resumed --time-limit fit leaves room for the passes still
        # to come (with 0 here, a resumed run filled its limit with steps and ran the passes on top)
        evaluate_s = state.get("evaluate_s", 0.0)
    else:
        initial = evaluate()
        evaluate_s = time.monotonic() - began
        echo(f"untrained head: {initial.line()}")
        log.append({"epoch": 0, "step": 0, "heldout": asdict(initial)})
    resumed_from = step

    def save() -> None:
        tmp = state_path.with_suffix(".tmp")
        kept = (
            "the checkpoint saved before stays there, and the next run resumes from it"
            if state_path.is_file()
            else "nothing was kept"
        )
        try:
            with disk_full_as_error(work_dir, "the training checkpoint", kept):
                torch.save(
                    {
                        "fingerprint": fingerprint,
                        "step": step,
                        "total_steps": total_steps,
                        "log": log,
                        "head": model.eagle_module.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "initial_acceptance": asdict(initial),
                        "evaluate_s": evaluate_s,
                    },
                    tmp,
                )
        except BaseException:
            tmp.unlink(missing_ok=True)  # a half-written checkpoint is never left to be read back
            raise
        os.replace(tmp, state_path)

    model.train()
    t0 = last_save = time.monotonic()
    tokens, step_seconds = 0, 0.0
    epoch_tokens, epoch_seconds = 0, 0.0  # since the last epoch end (a cached epoch runs faster than the first)
    losses: list[float] = []
    accs: list[list[float]] = []
    bar = tqdm(
        total=total_steps,
        initial=step,
        desc="train eagle3 head",
        unit="step",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    try:
        while step < total_steps:
            epoch, k = divmod(step, steps_per_epoch)
            if epoch not in batches:
                batches.clear()
                batches[epoch] = epoch_batches(lengths, t, epoch)
            chunk = [data.train[i] for i in batches[epoch][k]]
            started = time.monotonic()  # the engine's features count as the step's (the target's part of it)
            ids, loss_mask, rows = make_batch(chunk, t.seq_len, pad_id, device)
            extra = step_features(chunk, ids.shape[1]) if step_features else {}
            masks.use(ids.shape[1])
            for group in optimizer.param_groups:
                group["lr"] = learning_rate_at(t, step, total_steps)
            with autocast(precision, device):
                out = model(input_ids=ids, loss_mask=loss_mask, **extra)
            # the target's full-vocabulary logits (out.logits, and the engine's in `extra`: 32 x 416 x 49,152 fp32 is
            # 2.6 GB) are not in the graph: freed before the backward pass, not held through it
            loss, train_acc = out.loss, out.train_acc[0]
            del out, extra
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step_seconds += time.monotonic() - started
            epoch_seconds += time.monotonic() - started
            step += 1
            tokens += sum(rows)
            epoch_tokens += sum(rows)
            losses.append(float(loss.detach()))
            accs.append(train_acc)
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", acc1=f"{accs[-1][0]:.2f}", tok_s=f"{tokens / step_seconds:.0f}")
            if step == resumed_from + WARM_UP_STEPS:
                warm = time.monotonic()
            if time_limit_s is not None and step == resumed_from + FIT_AFTER_STEPS and step < total_steps:
                pace = (time.monotonic() - warm) / (FIT_AFTER_STEPS - WARM_UP_STEPS)
                fitted = fit_steps(
                    step, total_steps, steps_per_epoch, pace, evaluate_s, began + time_limit_s - time.monotonic()
                )
                if fitted < total_steps:
                    bar.write(
                        f"time limit {time_limit_s:.0f} s: {fitted} of the {total_steps} planned steps fit",
                        file=sys.stderr,
                    )
                    total_steps = fitted
                    bar.total = total_steps
            end_of_epoch = step % steps_per_epoch == 0 or step == total_steps
            if end_of_epoch:
                acc = evaluate()
                entry = {
                    "epoch": round(step / steps_per_epoch, 3),
                    "step": step,
                    "loss": sum(losses) / len(losses),
                    "train_acc": [sum(a[j] for a in accs) / len(accs) for j in range(len(accs[0]))],
                    "heldout": asdict(acc),
                    "seconds": round(time.monotonic() - t0, 1),
                    "train_tokens_per_s": round(tokens / step_seconds, 1),
                    "epoch_tokens_per_s": round(epoch_tokens / epoch_seconds, 1),
                }
                log.append(entry)
                epoch_tokens, epoch_seconds = 0, 0.0
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
    return TrainResult(
        final, initial, step, resumed_from, time.monotonic() - t0, tokens, step_seconds, log, planned_steps
    )


def fit_steps(
    step: int, total_steps: int, steps_per_epoch: int, step_s: float, evaluate_s: float, left_s: float
) -> int:
    """The last step that lets a run at `step` end within `left_s` seconds, at `step_s` a step and `evaluate_s` a
    held-out pass (one at the end, one at each epoch end before it); never below step + 1, never above the plan."""

    def needed(last: int) -> float:
        epoch_ends = (last - 1) // steps_per_epoch - step // steps_per_epoch  # epoch ends before the last step
        return (last - step) * step_s + (1 + max(0, epoch_ends)) * evaluate_s

    low, high = step + 1, total_steps  # needed() grows with `last`: the largest that fits, by bisection
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if needed(mid) <= left_s else (low, mid - 1)
    return low


def autocast(precision: str, device: str):
    """Forward passes in `precision` (torch autocast: matmuls in bf16, reductions and the loss in fp32); the
    weights, gradients and AdamW state stay fp32."""
    import torch

    return torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=precision == "bfloat16")
