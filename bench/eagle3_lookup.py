"""What the suffix lookup before an EAGLE-3 head (recipe draft.sa_config) buys, measured in the fused loop itself.

The recipe's target engine with its head runs the same greedy requests once per threshold (0: the head alone), in
process, k = --draft-len drafts a round with the recipe's draft_p_min, and counts per run: target passes after the
prefill, tokens per pass, the share of rounds the lookup drafted, the drafts accepted a round (all rounds, the
lookup's rounds, the head's rounds). Every run's output must equal the head-alone run's (the target decides).

Prompts as bench/eagle3_confidence.py: `--prompts heldout` (default) the greedy held-out prompts of a draft-data folder
(never trained on, never the validation prompts: choose the threshold here), `--prompts builtin` the built-in
validation prompts (to report what a chosen threshold does there, never to choose it).

    .venv/bin/python bench/eagle3_lookup.py [--recipe build/smollm2-135m.yaml] [--prompts heldout|builtin]
        [--data engines/smollm2-135m-eagle3-gpu/draft-data] [--count 48] [--thresholds 0,2,3,4,5] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the served stubs (triton/server.py); read when torch loads


def measure(executor, prompts, k: int, max_tokens: int, end_id) -> tuple[dict, list[list[int]]]:
    """Totals over the prompts (each from an empty cache) and the outputs."""
    from specdeploy.engine.request import EngineRequest, run

    tot = dict(tokens=0, passes=0, rounds=0, drafted=0, accepted=0, lookup_rounds=0, lookup_accepted=0)
    outputs = []
    for _, ids in prompts:
        executor.clear_cache()
        out = run(
            executor, EngineRequest(input_ids=list(ids), max_new_tokens=max_tokens, end_id=end_id, num_draft_tokens=k)
        )
        s = out.stats
        tot["tokens"] += len(out.token_ids) - 1  # after the prefill's token
        tot["passes"] += s.iterations - 1
        tot["rounds"] += sum(1 for d in s.k_per_round if d)  # rounds that drafted (by the head or the lookup)
        for key in ("drafted", "accepted", "lookup_rounds", "lookup_accepted"):
            tot[key] += getattr(s, key)
        outputs.append(list(out.token_ids))
    return tot, outputs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(ROOT / "build" / "smollm2-135m.yaml"))
    ap.add_argument("--root", default=str(ROOT))
    ap.add_argument("--prompts", choices=("heldout", "builtin"), default="heldout")
    ap.add_argument("--data", default=str(ROOT / "engines" / "smollm2-135m-eagle3-gpu" / "draft-data"))
    ap.add_argument("--count", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--draft-len", type=int, default=None, help="k (default: the recipe's speculative.num_draft_tokens)"
    )
    ap.add_argument("--thresholds", default="0,2,3,4,5", help="draft.sa_config.threshold values; 0: no lookup")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    from bench.eagle3_confidence import load_pair, prompts_of
    from specdeploy.engine.executor import Executor

    torch.set_num_threads(args.threads)
    recipe, layout, engine, head, tokenizer = load_pair(args.recipe, args.root)
    prompts = prompts_of(args.prompts, args.data, args.count, tokenizer, args.max_tokens)
    k = args.draft_len or recipe.speculative.num_draft_tokens
    thresholds = [int(t) for t in args.thresholds.split(",")]
    print(
        f"{len(prompts)} {args.prompts} prompts x {args.max_tokens} tokens, k = {k}, draft_p_min "
        f"{recipe.speculative.draft_p_min:g}, head {layout.eagle3_head_source(recipe.draft.head)}",
        flush=True,
    )
    rows, reference = [], None
    for threshold in thresholds:
        executor = Executor(
            engine, 2, head=head, draft_p_min=recipe.speculative.draft_p_min, lookup_threshold=threshold
        )
        tot, outputs = measure(executor, prompts, k, args.max_tokens, tokenizer.eos_token_id)
        reference = reference if reference is not None else outputs
        if outputs != reference:
            print(f"threshold {threshold}: outputs differ from the first run's: a bug", flush=True)
            return 1
        head_rounds = tot["rounds"] - tot["lookup_rounds"]
        row = {
            "threshold": threshold,
            **tot,
            "tokens_per_pass": tot["tokens"] / max(1, tot["passes"]),
            "lookup_share": tot["lookup_rounds"] / max(1, tot["passes"]),
            "accepted_per_pass": tot["accepted"] / max(1, tot["passes"]),
            "accepted_per_lookup_round": tot["lookup_accepted"] / max(1, tot["lookup_rounds"]),
            "accepted_per_head_round": (tot["accepted"] - tot["lookup_accepted"]) / max(1, head_rounds),
        }
        rows.append(row)
        print(
            f"threshold {threshold}: {row['tokens_per_pass']:.3f} tokens a pass ({tot['passes']} passes),"
            f" {row['accepted_per_pass']:.3f} accepted drafts a pass; lookup drafted {row['lookup_share']:.1%} of"
            f" passes, {row['accepted_per_lookup_round']:.2f} accepted there; the head's drafting rounds"
            f" {row['accepted_per_head_round']:.2f}",
            flush=True,
        )
    print("outputs equal across thresholds: True")
    if args.out:
        Path(args.out).write_text(
            json.dumps({"prompts": args.prompts, "count": len(prompts), "k": k, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
