"""Training throughput of an EAGLE-3 head on the CPU, side by side: the recipe's training step as it is (A: the
engine's features with the target's whole distribution as the labels) against the same step with
draft.train.label_top_k (B: the labels kept as the target's top-k draft tokens), same data, same head, same settings.

The arms take turns (ABBA ...), each turn in a fresh process (its own peak memory; the machine is shared and its load
drifts, so neither arm gets the quiet minutes alone). A turn starts from the recipe's init_head (else a fresh head),
runs --steps training steps of draft.train.batch_size samples and reports the steps' real tokens per second (what
`draft train` logs as train_tokens_per_s: held-out passes not counted) and its peak resident memory. `--profile`
also prints where one step's time goes (torch.profiler, each arm, ops by self CPU time).

The data: ShareGPT's train split as scored text (a user turn and its assistant turn in the chat template, the loss on
the answer), cut to draft.train.seq_len; the held-out split is never read.

    .venv/bin/python bench/eagle3_train_speed.py --recipe build/smollm2-135m-eagle3-tune.yaml --top-k 64 \\
        [--steps 3] [--order ABBA] [--batch-size 32] [--profile] [--out engines/eagle3-train-speed.json]
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
    """One arm's turn in this process: --steps training steps with the recipe's settings."""
    import torch

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

    recipe = load_recipe(args.recipe)
    t = replace(
        recipe.draft.train,
        batch_size=args.batch_size or recipe.draft.train.batch_size,
        length_grouping=False,
        label_top_k=args.top_k if args.arm == "B" else 0,
        epochs=1.0,
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
    if args.profile:
        profile_step(model, samples[: t.batch_size], t, step_features or features, precision, pad_id_of(target_config))
    with tempfile.TemporaryDirectory() as work:
        result = train_head(
            model,
            data,
            t,
            Path(work),
            progress=False,
            echo=lambda *_: None,
            precision=precision,
            pad_id=pad_id_of(target_config),
            features=features,
            step_features=step_features,
        )
    return {
        "arm": args.arm,
        "tokens": result.tokens,
        "step_seconds": result.step_seconds,
        "steps": result.steps,
        "tokens_per_s": result.tokens_per_s,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "precision": precision,
        "label_top_k": t.label_top_k,
        "batch_size": t.batch_size,
    }


def profile_step(model, chunk, t, features, precision: str, pad_id: int) -> None:
    """One forward + backward under torch.profiler, the feature call included; the top ops by self CPU time."""
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
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18), file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="build/smollm2-135m-eagle3-tune.yaml")
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="training steps a turn")
    parser.add_argument(
        "--batch-size", type=int, default=0, help="samples a step [the recipe's draft.train.batch_size]"
    )
    parser.add_argument("--order", default="ABBA", help="the arms' turns, e.g. ABBAABBA")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default="")
    parser.add_argument("--arm", choices=["A", "B"], help=argparse.SUPPRESS)  # one turn, in a child process
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(one_turn(args)), flush=True)
        return
    turns = []
    for i, arm in enumerate(args.order):
        cmd = [
            sys.executable,
            __file__,
            "--recipe",
            args.recipe,
            "--top-k",
            str(args.top_k),
            "--steps",
            str(args.steps),
            "--batch-size",
            str(args.batch_size),
            "--seed",
            str(args.seed),
            "--arm",
            arm,
        ]
        if args.profile and i < 2:
            cmd.append("--profile")
        began = time.monotonic()
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]
        turns.append(json.loads(out))
        print(
            f"turn {i + 1} ({arm}): {turns[-1]['tokens_per_s']:.0f} tokens/s, peak {turns[-1]['peak_rss_gb']:.1f} GB "
            f"({time.monotonic() - began:.0f} s with set-up)",
            flush=True,
        )
    summary = {}
    for arm in "AB":
        mine = [x for x in turns if x["arm"] == arm]
        summary[arm] = {
            "tokens_per_s_median": statistics.median(x["tokens_per_s"] for x in mine),
            "tokens_per_s": [round(x["tokens_per_s"], 1) for x in mine],
            "peak_rss_gb": round(max(x["peak_rss_gb"] for x in mine), 2),
        }
    ratio = summary["B"]["tokens_per_s_median"] / summary["A"]["tokens_per_s_median"]
    a, b = summary["A"], summary["B"]
    print(
        f"A (whole distribution): {a['tokens_per_s_median']:.0f} tokens/s, peak {a['peak_rss_gb']} GB; "
        f"B (top {args.top_k}): {b['tokens_per_s_median']:.0f} tokens/s, peak {b['peak_rss_gb']} GB; "
        f"B/A {ratio:.2f}x"
    )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"turns": turns, "summary": summary, "ratio": ratio, "args": vars(args)}, indent=1)
        )


if __name__ == "__main__":
    main()
