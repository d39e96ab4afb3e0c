"""Training throughput of an EAGLE-3 head on the CPU, side by side: main's training step (A, "today": specdeploy
imported from a `git archive` of --baseline, main by default) against this tree's (B: the engine's features batched
with the LM head over the draft vocabulary only, the training-time test's attention on torch's fused CPU kernel, and
draft.train.feature_cache), the same samples, head and settings: the recipe's draft.train with label_top_k = --top-k
(64, as build/smollm2-135m-eagle3-sharegpt.yaml; 0: the whole distribution; --today-top-k: A's alone, 0 as main's
default), --epochs passes over --steps batches.

The arms take turns (ABBA ...), each turn in a fresh process (its own peak memory; the machine is shared and its load
drifts, so neither arm gets the quiet minutes alone). A turn starts from the recipe's init_head (else a fresh head),
runs --epochs x --steps training steps of draft.train.batch_size samples and reports the steps' real tokens per second
(what `draft train` logs as train_tokens_per_s: held-out passes not counted) in the first epoch and in the later ones
(where B reads its features from the cache it wrote in the first) and its peak resident memory. `--profile` also
prints where one step's time goes (torch.profiler, each arm, ops by self CPU time; B twice: its features from the
engine, then the same batch's from the cache).

The data: ShareGPT's train split as scored text (a user turn and its assistant turn in the chat template, the loss on
the answer), cut to draft.train.seq_len; the held-out split is never read.

    .venv/bin/python bench/eagle3_train_speed.py --recipe build/smollm2-135m-eagle3-tune.yaml --top-k 64 \\
        [--steps 3] [--epochs 2] [--order ABBA] [--batch-size 8] [--profile] [--out engines/eagle3-train-speed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def scored_samples(tokenizer, count: int, seq_len: int, seed: int):
    """`count` samples of ShareGPT's train split: a first user turn and its answer, the loss on the answer."""
    import random

    from specdeploy.core import sharegpt
    from specdeploy.eagle3.samples import Sample

    conversations = [c for c in sharegpt.load().conversations if not sharegpt.is_heldout(c.id) and sharegpt.english(c)]
    random.Random(seed).shuffle(conversations)
    samples = []
    for c in conversations:
        turns = list(c.turns)
        if len(turns) < 2 or turns[0][0] != "user" or turns[1][0] != "assistant" or len(turns[0][1]) > 1500:
            continue
        messages = [{"role": "user", "content": turns[0][1]}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        whole = tokenizer.apply_chat_template(
            messages + [{"role": "assistant", "content": turns[1][1]}], tokenize=True, return_dict=False
        )
        if whole[: len(prompt)] != prompt or len(prompt) + 32 > seq_len:
            continue
        samples.append(Sample(f"sharegpt-{c.id}", tuple(whole[:seq_len]), len(prompt)))
        if len(samples) == count:
            return samples
    raise SystemExit(f"only {len(samples)} usable conversations")


def one_turn(args) -> dict:
    """One arm's turn in this process: --epochs x --steps training steps with the recipe's settings; arm A imports
    specdeploy from --baseline-dir (main's code), B from this tree."""
    if args.arm == "A":
        sys.path.insert(0, args.baseline_dir)
    import torch

    import specdeploy
    from specdeploy.core import artifacts
    from specdeploy.core import model_store as models
    from specdeploy.eagle3.features import EngineFeatures
    from specdeploy.eagle3.modelopt import (
        accept_draft_space_logits,
        aux_layer_ids,
        build_model,
        draft_target_ids,
        head_draft_ids,
        load_exported_head,
    )
    from specdeploy.eagle3.samples import DraftData
    from specdeploy.eagle3.train import init_head_folder, pad_id_of, train_precision
    from specdeploy.eagle3.train_loop import train_head
    from specdeploy.engine.generate import load_tokenizer
    from specdeploy.recipe.load import load_recipe

    tree = str(Path(specdeploy.__file__).parent.parent)
    assert tree == (args.baseline_dir if args.arm == "A" else str(ROOT)), tree
    recipe = load_recipe(args.recipe)
    t = replace(
        recipe.draft.train,
        batch_size=args.batch_size or recipe.draft.train.batch_size,
        length_grouping=False,
        label_top_k=args.top_k if args.arm == "B" or args.today_top_k < 0 else args.today_top_k,
        epochs=float(args.epochs),
        lr_schedule="constant",
    )
    layout = artifacts.Layout.of(recipe, ROOT)
    target_dir = models.resolve(recipe.target.model)
    target_config = json.loads((target_dir / "config.json").read_text())
    aux_ids = aux_layer_ids(target_config, t)
    tokenizer = load_tokenizer(target_dir, recipe.target.model)
    samples = scored_samples(tokenizer, t.batch_size * args.steps, t.seq_len, args.seed)
    data = DraftData(Path("."), tuple(samples), tuple(samples[:1]), "bench")
    init = init_head_folder(recipe, layout, aux_ids)
    draft_ids = head_draft_ids(init)[1] if init is not None else None
    model = build_model(target_dir, t, draft_ids, aux_ids, offline=True)
    if init is not None:
        load_exported_head(model, init)
    features = EngineFeatures.load(layout.engine("target"), aux_ids)
    step_features = None
    if t.label_top_k:
        step_features = features.top_k(t.label_top_k, draft_target_ids(model).tolist())
        accept_draft_space_logits(model)
    torch.manual_seed(0)
    precision = train_precision(t, "cpu")
    pad_id = pad_id_of(target_config)
    with tempfile.TemporaryDirectory() as work:
        cached = args.arm == "B" and t.label_top_k

        def with_cache(name):
            from specdeploy.eagle3.feature_cache import CachedFeatures

            return CachedFeatures(step_features, Path(work) / name, data.train, t.seq_len, {})

        if args.profile:
            batch = samples[: t.batch_size]
            profile = with_cache("profile") if cached else step_features or features
            profile_step(model, batch, t, profile, precision, pad_id, "from the engine" if cached else "")
            if cached:
                profile_step(model, batch, t, profile, precision, pad_id, "from the cache")
        result = train_head(
            model,
            data,
            t,
            Path(work) / "resume",
            progress=False,
            echo=lambda *_: None,
            precision=precision,
            pad_id=pad_id,
            features=features,
            step_features=with_cache("features") if cached else step_features,
        )
    # the log's cumulative tokens/s at each epoch end -> each epoch's own (every epoch has the same tokens)
    per_epoch = result.tokens / args.epochs
    ends = [per_epoch * (i + 1) / entry["train_tokens_per_s"] for i, entry in enumerate(result.log[1:])]
    epoch_tokens_per_s = [per_epoch / (b - a) for a, b in zip([0.0] + ends, ends)]
    return {
        "arm": args.arm,
        "tree": tree,
        "tokens": result.tokens,
        "step_seconds": result.step_seconds,
        "steps": result.steps,
        "tokens_per_s": result.tokens_per_s,
        "epoch_tokens_per_s": epoch_tokens_per_s,
        "loss": [entry["loss"] for entry in result.log[1:]],
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "precision": precision,
        "label_top_k": t.label_top_k,
        "batch_size": t.batch_size,
    }


def profile_step(model, chunk, t, features, precision: str, pad_id: int, what: str = "") -> None:
    """One forward + backward under torch.profiler, the feature call included; the top ops by self CPU time and the
    step's parts (engine_features, head_forward, head_backward) by total CPU time."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from specdeploy.eagle3.train_loop import _MaskCache, autocast, make_batch

    model.train()
    model._mask_cache = _MaskCache(model)
    ids, loss_mask, _ = make_batch(chunk, t.seq_len, pad_id)
    model._mask_cache.use(ids.shape[1])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("engine_features"):
            extra = features(chunk, ids.shape[1])
        with record_function("head_forward"), autocast(precision, "cpu"):
            out = model(input_ids=ids, loss_mask=loss_mask, **extra)
        with record_function("head_backward"):
            out.loss.backward()
    model.zero_grad(set_to_none=True)
    events = prof.key_averages()
    names = ("engine_features", "head_forward", "head_backward")
    parts = ", ".join(f"{e.key} {e.cpu_time_total / 1e6:.2f}" for e in events if e.key in names)
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    print(f"profiled step {what}: {total:.2f} CPU-s; {parts}", file=sys.stderr)
    print(events.table(sort_by="self_cpu_time_total", row_limit=22), file=sys.stderr, flush=True)


def baseline_tree(rev: str, folder: Path) -> str:
    """`git archive REV specdeploy` unpacked into folder: the code arm A imports."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "specdeploy"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], check=True, capture_output=True, text=True)
    return commit.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="build/smollm2-135m-eagle3-tune.yaml")
    parser.add_argument("--top-k", type=int, default=64, help="draft.train.label_top_k of both arms")
    parser.add_argument(
        "--today-top-k", type=int, default=-1, help="arm A's label_top_k where it differs (0: main's default) [--top-k]"
    )
    parser.add_argument("--steps", type=int, default=3, help="training steps an epoch")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the same --steps batches")
    parser.add_argument(
        "--batch-size", type=int, default=0, help="samples a step [the recipe's draft.train.batch_size]"
    )
    parser.add_argument("--order", default="ABBA", help="the arms' turns, e.g. ABBAABBA")
    parser.add_argument("--baseline", default="main", help="the git revision arm A runs (today's code)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default="")
    parser.add_argument("--arm", choices=["A", "B"], help=argparse.SUPPRESS)  # one turn, in a child process
    parser.add_argument("--baseline-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(one_turn(args)), flush=True)
        return
    turns = []
    with tempfile.TemporaryDirectory() as baseline_dir:
        commit = baseline_tree(args.baseline, Path(baseline_dir))
        for i, arm in enumerate(args.order):
            cmd = [sys.executable, __file__, "--recipe", args.recipe, "--top-k", str(args.top_k)]
            cmd += ["--today-top-k", str(args.today_top_k)]
            cmd += ["--steps", str(args.steps), "--epochs", str(args.epochs), "--batch-size", str(args.batch_size)]
            cmd += ["--seed", str(args.seed), "--arm", arm, "--baseline-dir", baseline_dir]
            if args.profile and i < 2:
                cmd.append("--profile")
            began, load = time.monotonic(), os.getloadavg()[0]
            out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]
            turns.append({**json.loads(out), "load_before": load, "load_after": os.getloadavg()[0]})
            x = turns[-1]
            epochs = " / ".join(f"{v:.0f}" for v in x["epoch_tokens_per_s"])
            print(
                f"turn {i + 1} ({arm}): {x['tokens_per_s']:.0f} tokens/s (epochs {epochs}), peak "
                f"{x['peak_rss_gb']:.2f} GB, loss {x['loss']}, load {load:.1f} -> {x['load_after']:.1f} "
                f"({time.monotonic() - began:.0f} s with set-up)",
                flush=True,
            )
    summary = {}
    for arm in "AB":
        mine = [x for x in turns if x["arm"] == arm]
        summary[arm] = {
            "tokens_per_s_median": statistics.median(x["tokens_per_s"] for x in mine),
            "first_epoch_median": statistics.median(x["epoch_tokens_per_s"][0] for x in mine),
            "later_epochs_median": statistics.median(v for x in mine for v in x["epoch_tokens_per_s"][1:]),
            "peak_rss_gb": round(max(x["peak_rss_gb"] for x in mine), 2),
        }
    a, b = summary["A"], summary["B"]
    today_k = next(x["label_top_k"] for x in turns if x["arm"] == "A")
    ratios = {k: b[k] / a[k] for k in ("tokens_per_s_median", "first_epoch_median", "later_epochs_median")}
    print(
        f"A (main {commit[:8]}, top {today_k}): first epoch {a['first_epoch_median']:.0f}, later "
        f"{a['later_epochs_median']:.0f} tokens/s, peak {a['peak_rss_gb']} GB; B (this tree): first epoch "
        f"{b['first_epoch_median']:.0f}, later {b['later_epochs_median']:.0f} tokens/s, peak {b['peak_rss_gb']} GB; "
        f"B/A first epoch {ratios['first_epoch_median']:.2f}x, later {ratios['later_epochs_median']:.2f}x, whole run "
        f"{ratios['tokens_per_s_median']:.2f}x"
    )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"turns": turns, "summary": summary, "ratios": ratios, "baseline": commit, "args": vars(args)},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
