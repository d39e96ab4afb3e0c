"""How often the target accepts an EAGLE-3 head's drafts, by the probability the head gave them, and what cutting
drafts below a probability (recipe speculative.draft_p_min) would buy.

The recipe's target engine runs the fused loop in-process with k drafts every round (no cut-off) while each round's
drafts and the head's probability of each are recorded (around Eagle3Drafter.draft); a draft counts as accepted when
the target's own greedy output has it at that position and all earlier drafts of the round were accepted.

Prompts: `--prompts heldout` (default): the held-out prompts of a `specdeploy draft data` folder (`--data`, default
the head's training recipe's, engines/smollm2-135m-eagle3/draft-data), never trained on and never the validation
prompts: choose draft_p_min here. `--prompts builtin`: the built-in validation prompts, to report what a chosen value
does there (never to choose it). `--prompts sharegpt`: real requests of ShareGPT's validation half (seed 0), which
no head trains on (docs/validate.md); `--prompts sharegpt-reported`: the reported half, never chosen on.

The sweep estimates the speedup of each cut-off with a cost model in one-row target steps: a round of 1 + k rows costs
ROWS[k] (the idle per-op profile of 2026-12-06, docs/benchmarks.md: 1.02 / 1.07 / 1.15 / 1.25 steps for 1..4 rows),
the head's catch-up with its first draft CATCH_UP (0.12) and HEAD_STEP (0.06) per later draft step the head ran
(a cut draft was computed before it was cut). Two rules: `chain`, what the engine does (a draft is cut where its
probability times those of the drafts before it falls below the cut), and `draft` (each draft's own probability, as
llama.cpp's --spec-draft-p-min), to compare.

    .venv/bin/python bench/eagle3_confidence.py [--recipe build/smollm2-135m.yaml] [--prompts heldout|builtin|sharegpt]
        [--count 24] [--max-tokens 64] [--draft-len 3] [--data DIR] [--out FILE.json]
    .venv/bin/python bench/eagle3_confidence.py --rounds FILE.json     # the tables again from an --out file's rounds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from itertools import zip_longest
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# a pass of 1..5 rows in one-row steps (docs/benchmarks.md, the per-op profile idle on 2026-12-06: 1..4 rows; 5: 10:49)
ROWS = (1.02, 1.07, 1.15, 1.25, 1.41)
CATCH_UP = 0.12  # the head's catch-up and first draft, every round (the same profile: 0.117)
HEAD_STEP = 0.06  # one later draft step of the head (0.062)
CUTS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
RULES = ("chain", "draft")  # the engine's cut (Eagle3Drafter.draft_steps), and each draft alone (llama.cpp's)


def heldout_prompts(data_dir: Path, count: int) -> list[tuple[str, list[int]]]:
    """(id, prompt ids) of the greedy held-out samples of a draft-data folder (input_ids[:loss_start]), taken in
    turns from each source (calibration, self_instruct, a prompt file) so that none dominates."""
    lines = (data_dir / "heldout.jsonl").read_text().splitlines()
    by_source: dict[str, list[dict]] = {}
    for record in (json.loads(line) for line in lines if line.strip()):
        if not record["sampled"]:
            by_source.setdefault(record["source"], []).append(record)
    turns = [r for group in zip_longest(*by_source.values()) for r in group if r is not None]
    return [(r["id"], r["input_ids"][: r["loss_start"]]) for r in turns][:count]


def load_pair(recipe_path: str, root: str):
    """(recipe, layout, target engine, head loaded against it as the recipe holds it (its weights and served
    vocabulary), tokenizer) of an eagle3 recipe whose target engine is built under `root`."""
    from transformers import AutoTokenizer

    from specdeploy.core import model_store as models
    from specdeploy.core.artifacts import Layout
    from specdeploy.engine.eagle3 import Eagle3Head
    from specdeploy.engine.model import CpuEngine
    from specdeploy.recipe.load import load_recipe

    recipe = load_recipe(recipe_path)
    layout = Layout.of(recipe, Path(root))
    engine = CpuEngine.load(layout.engine("target"))
    head = Eagle3Head.load(
        layout.eagle3_head_source(recipe.draft.head),
        engine,
        recipe.draft.cpu_head_weights,
        recipe.draft.serve_vocab_size,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(models.resolve(recipe.target.model)))
    return recipe, layout, engine, head, tokenizer


def prompts_of(kind: str, data_dir: str, count: int, tokenizer, max_tokens: int) -> list[tuple[str, list[int]]]:
    """`heldout`: the draft-data folder's greedy held-out prompts; `builtin`: the built-in validation prompts;
    `sharegpt`: ShareGPT's validation half (`validate --prompt-set sharegpt`, seed 0); `sharegpt-reported`: its
    reported half (reported beside it, never chosen on)."""
    if kind == "heldout":
        return heldout_prompts(Path(data_dir), count)
    from bench.eagle3_peer import chat_prompts

    return chat_prompts(tokenizer, count, max_tokens, kind)


def prompt_bigrams(ids) -> set[tuple[int, int]]:
    """The prompt's pairs of adjacent tokens: an answer position quotes the prompt where it and the token before it are
    one."""
    return set(zip(ids, ids[1:]))


def record_rounds(executor, head, prompts, max_tokens: int, k: int, end_id) -> list[dict]:
    """Every round of the fused loop over `prompts`: the head's probability of each draft and whether it was
    accepted."""
    import torch

    from specdeploy.engine.request import EngineRequest, run

    rounds, seen = [], []
    real_new = head.new_drafter

    def new_drafter(*args, **kwargs):
        drafter = real_new(*args, **kwargs)
        real_draft = drafter.draft_steps  # what the fused loop calls (a generator of the head passes it needs)

        def draft_steps(n, p_min=0.0, rule=None):
            base, logits, prenorm, probabilities = drafter.cache.length, drafter.logits, drafter.prenorm, []
            tokens = yield from real_draft(n, p_min, rule)
            for i, token in enumerate(tokens):  # the same rows again, for their probabilities (draft() keeps none)
                if i:
                    logits, prenorm = head.forward(drafter.cache, prenorm, torch.tensor([tokens[i - 1]]))
                probabilities.append(float(torch.softmax(logits.reshape(-1).float(), -1).max()))
            drafter.cache.truncate(base)
            seen.append((base, tokens, probabilities))
            return tokens

        drafter.draft_steps = draft_steps
        return drafter

    head.new_drafter = new_drafter
    try:
        for prompt_id, ids in prompts:
            seen.clear()
            out = run(
                executor,
                EngineRequest(input_ids=list(ids), max_new_tokens=max_tokens, end_id=end_id, num_draft_tokens=k),
            )
            sequence = list(ids) + list(out.token_ids)
            bigrams = prompt_bigrams(ids)
            for base, tokens, probabilities in seen:
                if len(tokens) < k:
                    continue  # the last rounds, cut by max_tokens
                accepted = 0  # draft i is for position base + 1 + i (the head's row base - 1 predicts base + 1)
                while (
                    accepted < len(tokens)
                    and base + 1 + accepted < len(sequence)
                    and sequence[base + 1 + accepted] == tokens[accepted]
                ):
                    accepted += 1
                # does the target's token at the first draft's position repeat, with the token before it, two tokens of
                # the prompt?
                repeats = base + 1 < len(sequence) and (sequence[base], sequence[base + 1]) in bigrams
                rounds.append(
                    {
                        "prompt": prompt_id,
                        "probabilities": probabilities,
                        "accepted": accepted,
                        "repeats_prompt": repeats,
                        "position": base + 1,
                    }
                )
            print(f"  {prompt_id}: {len(seen)} rounds, {out.stats.accepted}/{out.stats.drafted} accepted", flush=True)
    finally:
        head.new_drafter = real_new
    return rounds


def by_probability(rounds: list[dict]) -> list[tuple[float, int, float]]:
    """(bin start, rounds, share whose first draft was accepted) per 0.1 of the first draft's probability."""
    count, hits = Counter(), Counter()
    for r in rounds:
        b = min(int(r["probabilities"][0] * 10), 9)
        count[b] += 1
        hits[b] += r["accepted"] > 0
    return [(b / 10, count[b], hits[b] / count[b]) for b in sorted(count)]


def by_group(rounds: list[dict], k: int) -> list[tuple[str, int, float, list[float]]]:
    """(group, rounds, accepted drafts per round, share of rounds accepting drafts 1..k) per prompt group: the
    category of a built-in prompt ("code-3" -> code), the source of a held-out one."""
    groups: dict[str, list[int]] = {}
    for r in rounds:
        groups.setdefault(str(r["prompt"]).split("-", 1)[0], []).append(r["accepted"])
    groups["all"] = [r["accepted"] for r in rounds]
    return [
        (g, len(a), sum(a) / len(a), [sum(x > i for x in a) / len(a) for i in range(k)]) for g, a in groups.items() if a
    ]


def by_repeat(rounds: list[dict]) -> list[tuple[str, int, float, float]]:
    """(kind, rounds, share accepting the first draft, accepted drafts per round) for the rounds whose first drafted
    position repeats two tokens of the prompt (the answer quotes its prompt there) and for the others: a head that
    drafts from what it learned of the language, not from the request's own text, accepts less where it quotes."""
    out = []
    for name, flag in (("repeats the prompt", True), ("other", False)):
        subset = [r for r in rounds if r.get("repeats_prompt") is flag]
        if subset:
            out.append(
                (
                    name,
                    len(subset),
                    sum(r["accepted"] > 0 for r in subset) / len(subset),
                    sum(r["accepted"] for r in subset) / len(subset),
                )
            )
    return out


def kept(probabilities: list[float], cut: float, rule: str) -> int:
    """Drafts a round keeps at cut-off `cut`: up to the first whose chain probability (`chain`: its own times the
    drafts' before it) or own probability (`draft`) is below it."""
    chain, k = 1.0, 0
    for p in probabilities:
        chain *= p
        if (chain if rule == "chain" else p) < cut:
            break
        k += 1
    return k


def sweep(rounds: list[dict], rows=ROWS, catch_up=CATCH_UP, step=HEAD_STEP, rule="chain") -> list[dict]:
    """Per cut-off: drafts and accepted drafts per round, and the estimated speedup (tokens per step-cost; plain
    decoding costs one step a token)."""
    out = []
    for cut in CUTS:
        drafted = accepted = 0
        cost = 0.0
        for r in rounds:
            k = kept(r["probabilities"], cut, rule)
            drafted, accepted = drafted + k, accepted + min(k, r["accepted"])
            # the head ran a step for each later draft it looked at: the kept ones and the one that was cut
            cost += rows[min(k, len(rows) - 1)] + catch_up + step * min(k, len(r["probabilities"]) - 1)
        n = len(rounds)
        out.append(
            {
                "draft_p_min": cut,
                "rule": rule,
                "k_per_round": drafted / n,
                "accepted_per_round": accepted / n,
                "estimated_speedup": (n + accepted) / cost if cost else 0.0,
            }
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(ROOT / "build" / "smollm2-135m.yaml"))
    ap.add_argument("--root", default=str(ROOT))
    ap.add_argument("--prompts", choices=("heldout", "builtin", "sharegpt", "sharegpt-reported"), default="heldout")
    ap.add_argument("--data", default=str(ROOT / "engines" / "smollm2-135m-eagle3" / "draft-data"))
    ap.add_argument("--count", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", default=None, help="print the tables from an --out file's rounds (no engine)")
    args = ap.parse_args(argv)

    if args.rounds:
        saved = json.loads(Path(args.rounds).read_text())
        rounds, draft_len = saved["rounds"], max(len(r["probabilities"]) for r in saved["rounds"])
        print(f"{len(rounds)} rounds of {draft_len} drafts on {saved['prompts']} prompts, from {args.rounds}")
    else:
        rounds, draft_len = record(args), args.draft_len
    groups, repeat, table = report(rounds, draft_len)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"prompts": args.prompts, "rounds": rounds, "groups": groups, "repeats": repeat, "sweep": table},
                indent=1,
            )
        )
    return 0


def record(args) -> list[dict]:
    """The rounds of the recipe's fused loop on the chosen prompts, k = --draft-len, no cut-off."""
    import torch

    from specdeploy.engine.executor import Executor

    torch.set_num_threads(args.threads)
    recipe, layout, engine, head, tokenizer = load_pair(args.recipe, args.root)
    head_dir = layout.eagle3_head_source(recipe.draft.head)
    prompts = prompts_of(args.prompts, args.data, args.count, tokenizer, args.max_tokens)
    print(
        f"head {head_dir}, target {layout.engine('target')}, {len(prompts)} {args.prompts} prompts x {args.max_tokens} "
        f"tokens, k = {args.draft_len}, no cut-off",
        flush=True,
    )
    return record_rounds(
        Executor(engine, 2, head=head), head, prompts, args.max_tokens, args.draft_len, tokenizer.eos_token_id
    )


def report(rounds: list[dict], draft_len: int):
    """Prints the tables; returns (groups, repeat, sweep) for the --out file."""
    print(f"\nfirst draft accepted, by the head's probability of it ({len(rounds)} rounds of {draft_len} drafts):")
    for start, n, share in by_probability(rounds):
        print(f"  {start:.1f}-{start + 0.1:.1f}  {n:5d} rounds  {share:.2f}")
    print(f"\naccepted drafts per round (no cut-off) and the share of rounds accepting draft 1..{draft_len}, by group:")
    groups = by_group(rounds, draft_len)
    for name, n, mean, shares in groups:
        print(f"  {name:15s} {n:5d} rounds  {mean:.2f}  " + " / ".join(f"{x:.2f}" for x in shares))
    repeat = by_repeat(rounds)
    print("\nby the first drafted position: rounds, first draft accepted, accepted drafts per round")
    for name, n, first, mean in repeat:
        print(f"  {name:19s} {n:5d} rounds  {first:.2f}  {mean:.2f}")
    table = [row for rule in RULES for row in sweep(rounds, rule=rule)]
    print("\nrule   draft_p_min  drafts/round  accepted/round  estimated speedup (the cost model above)")
    for row in table:
        print(
            f"  {row['rule']:5s}  {row['draft_p_min']:.2f}        {row['k_per_round']:.2f}          "
            f"{row['accepted_per_round']:.2f}            {row['estimated_speedup']:.3f}x"
        )
    return groups, repeat, table


if __name__ == "__main__":
    sys.exit(main())
