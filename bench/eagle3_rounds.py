"""What a fused EAGLE-3 round costs in target steps, in process: the recipe's target engine with its head
(`draft.head`), greedy, on the built-in chat prompts (or `--prompts heldout --data DIR`: a draft-data folder's
held-out prompts, never trained on, to choose settings on), with k = 0 (the target alone) and k = --draft-len (the fused
loop with the recipe's `speculative.draft_p_min`) taking turns (ABAB), each prompt from an empty cache.

Per run: ms per token after the first, target passes, forward time per pass (the target's pass alone), the head's
time before each pass, drafted / accepted drafts, and tokens per pass. A round in target steps (the k = 0 run's forward
time per pass): the verification pass + the head's work + the rest of the round's wall time; the outputs of both must
be equal.

    .venv/bin/python bench/eagle3_rounds.py [--recipe build/smollm2-135m.yaml] [--count 8] [--max-tokens 64]
        [--draft-len 3] [--repeats 2] [--compare-team] [--variants static,cost,cost:0]

--concurrency N runs the prompts N at a time through one BatchScheduler (in-flight batching, as served) and times
the whole set: tokens per second of each variant against the target alone.

--variants runs the k run once per POLICY[:DRAFT_P_MIN[:K[:SA[:VOCAB]]]] (speculative.policy static or cost, the
recipe's draft_p_min and --draft-len unless given; SA: draft.sa_config.threshold, the request's own text looked up
before the head, 0 off; VOCAB: draft.serve_vocab_size, the head's draft tokens scored, 0 all; default the recipe's),
each on its own executor (the cost policy's measurements carry over its runs).

--compare-head-batch (with --concurrency > 1) adds a run in each turn of the recipe's variant with the scheduler's head
forwards one request at a time (as before the heads were batched: engine/batching.py), and prints each run's wall time
in head forwards and how many requests shared one.

--compare-team adds a third run in each turn: the k run without the standing team Executor.generate opens around
each step (engine/native.standing_team; the head's work included), to see what one wake-up per step instead of one
per parallel loop saves; run it with OMP_WAIT_POLICY=PASSIVE, as the served stubs run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def run_all(executor, prompts, k: int, max_tokens: int, end_id) -> tuple[dict, list[list[int]]]:
    from specdeploy.engine.request import EngineRequest, run

    tot = dict(t=0.0, fwd=0.0, draft=0.0, out=0, passes=0, drafted=0, accepted=0, lookup=0)
    outputs = []
    for _, ids in prompts:
        executor.clear_cache()
        t0 = time.perf_counter()
        o = run(
            executor, EngineRequest(input_ids=list(ids), max_new_tokens=max_tokens, end_id=end_id, num_draft_tokens=k)
        )
        dt = time.perf_counter() - t0
        s = o.stats
        tot["t"] += dt - s.first_token_time_s
        tot["fwd"] += s.forward_time_s - s.first_forward_time_s
        tot["draft"] += s.draft_time_s
        tot["out"] += len(o.token_ids) - 1
        tot["passes"] += s.iterations - 1
        tot["drafted"] += s.drafted
        tot["accepted"] += s.accepted
        tot["lookup"] += s.lookup_rounds
        outputs.append(list(o.token_ids))
    return tot, outputs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(ROOT / "build" / "smollm2-135m.yaml"))
    ap.add_argument("--root", default=str(ROOT))
    ap.add_argument(
        "--prompts",
        choices=("builtin", "heldout"),
        default="builtin",
        help="heldout: the greedy held-out prompts of a draft-data folder (--data), to choose settings on",
    )
    ap.add_argument("--data", default=str(ROOT / "engines" / "smollm2-135m-eagle3-gpu" / "draft-data"))
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare-team", action="store_true", help="also run k without the standing team (see above)")
    ap.add_argument(
        "--compare-head-batch",
        action="store_true",
        help="also run k with the head forwards of the requests in flight one at a time (see above)",
    )
    ap.add_argument("--concurrency", type=int, default=1, help="prompts in flight (see above)")
    ap.add_argument(
        "--variants", default="", help="POLICY[:DRAFT_P_MIN[:K[:SA[:VOCAB]]]],... (see above); default: the recipe's"
    )
    args = ap.parse_args(argv)

    import torch

    from bench.eagle3_confidence import load_pair, prompts_of
    from specdeploy.engine.eagle3 import Eagle3Head
    from specdeploy.engine.executor import Executor

    torch.set_num_threads(args.threads)
    recipe, layout, engine, head, tokenizer = load_pair(args.recipe, args.root)
    prompts = prompts_of(args.prompts, args.data, args.count, tokenizer, args.max_tokens)
    k = args.draft_len
    own = f"{recipe.speculative.policy}:{recipe.speculative.draft_p_min:g}"
    variants = [
        v if ":" in v else f"{v}:{recipe.speculative.draft_p_min:g}" for v in args.variants.split(",") if v
    ] or [own]
    executors, draft_len = {"0": None}, {"0": 0}
    heads = {recipe.draft.serve_vocab_size: head}  # draft.serve_vocab_size -> the head scoring that many draft tokens
    extra = (["no team"] if args.compare_team else []) + (["heads alone"] if args.compare_head_batch else [])
    for name in variants + extra:
        policy, p_min, *rest = (own if name in extra else name).split(":")
        sa = int(rest[1]) if len(rest) > 1 else recipe.draft.lookup_threshold
        vocab = int(rest[2]) if len(rest) > 2 else recipe.draft.serve_vocab_size
        if vocab not in heads:
            heads[vocab] = Eagle3Head.load(
                layout.eagle3_head_source(recipe.draft.head), engine, recipe.draft.cpu_head_weights, vocab
            )
        executors[name] = Executor(
            engine, 2, head=heads[vocab], draft_p_min=float(p_min), draft_policy=policy, lookup_threshold=sa
        )
        draft_len[name] = int(rest[0]) if rest else k
        run_all(executors[name], prompts[:1], draft_len[name], 8, tokenizer.eos_token_id)  # warm-up
    # the target alone runs on the first variant's executor, as target-alone and fused requests share one in a server
    # (and as this script did before --variants: with two executors a round measured 1.43-1.61 steps against 1.28-1.43
    # here the same hour, within this VM's noise or not)
    executors["0"] = executors[variants[0]]
    run_all(executors["0"], prompts[:1], 0, 8, tokenizer.eos_token_id)  # warm-up
    runs: dict = {name: [] for name in executors}
    outputs: dict = {}
    order = list(executors)
    for rep in range(args.repeats):
        for name in order if rep % 2 == 0 else order[::-1]:
            with _standing_team(name != "no team"):
                if args.concurrency > 1:
                    tot, outputs[name] = run_batched(
                        executors[name],
                        prompts,
                        draft_len[name],
                        args.max_tokens,
                        tokenizer.eos_token_id,
                        args.concurrency,
                        name != "heads alone",
                    )
                else:
                    tot, outputs[name] = run_all(
                        executors[name], prompts, draft_len[name], args.max_tokens, tokenizer.eos_token_id
                    )
            runs[name].append(tot)
    if args.concurrency > 1:
        return report_batched(runs, outputs, order, args.concurrency)
    print(
        f"{len(prompts)} {args.prompts} chat prompts x {args.max_tokens} tokens, {args.threads} threads, k = {k} "
        f"(variants POLICY:DRAFT_P_MIN[:K[:SA[:VOCAB]]]; 0: the target alone), target {layout.engine('target')}"
    )
    for kk in order:
        for t in runs[kk]:
            n, passes = t["out"], max(t["passes"], 1)
            print(
                f"{kk}: {n} tokens after the first, {t['t'] * 1000 / n:.2f} ms/token; {passes} passes, forward"
                f" {t['fwd'] * 1000 / passes:.2f} ms/pass (head before it: {t['draft'] * 1000 / passes:.2f} ms/pass);"
                f" drafted {t['drafted']} accepted {t['accepted']}; {n / passes:.2f} tokens/pass"
                + (f"; {t['lookup']} rounds drafted by lookup" if t["lookup"] else "")
            )
    step = min(t["fwd"] / max(t["passes"], 1) for t in runs["0"])
    plain = min(t["t"] / t["out"] for t in runs["0"])
    for kk in order[1:]:
        for t in runs[kk]:
            passes = max(t["passes"], 1)
            verify, head, wall = t["fwd"] / passes / step, t["draft"] / passes / step, t["t"] / passes / step
            print(
                f"{kk} round: {wall:.2f} target steps (pass {verify:.2f}, head {head:.2f}, rest"
                f" {wall - verify - head:.2f}), {t['out'] / passes:.2f} tokens; {plain / (t['t'] / t['out']):.2f}x the"
                " target alone's ms/token"
            )
    same = all(outputs[kk] == outputs["0"] for kk in order)
    print("outputs equal to the target alone:", same)
    return 0 if same else 1


def run_batched(
    executor, prompts, k: int, max_tokens: int, end_id, concurrency: int, batch_heads: bool = True
) -> tuple[dict, list[list[int]]]:
    """The prompts `concurrency` at a time through one BatchScheduler: wall time of the set (and of its head forwards),
    tokens, drafts. batch_heads False: the head forwards of the requests in flight run one request at a time."""
    import threading

    from specdeploy.engine.batching import BatchScheduler
    from specdeploy.engine.request import EngineRequest

    executor.clear_cache()
    head_s, heads = [0.0], [0, 0]  # time in head forwards; head passes, head steps
    run_head_passes = type(executor).run_head_passes

    def timed_heads(passes):
        t = time.perf_counter()
        for group in [passes] if batch_heads else [[p] for p in passes]:
            run_head_passes(executor, group)
        head_s[0] += time.perf_counter() - t
        heads[0] += len(passes)
        heads[1] += 1

    executor.run_head_passes = timed_heads
    scheduler = BatchScheduler(executor, concurrency)
    outputs: list = [None] * len(prompts)
    stats: list = [None] * len(prompts)
    next_prompt = iter(range(len(prompts)))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next(next_prompt, None)
            if i is None:
                return
            tokens = []
            for chunk in scheduler.generate(
                EngineRequest(
                    input_ids=list(prompts[i][1]), max_new_tokens=max_tokens, end_id=end_id, num_draft_tokens=k
                )
            ):
                tokens.extend(chunk.token_ids)
                if chunk.finished:
                    stats[i] = chunk.stats
            outputs[i] = tokens

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    scheduler.close()
    del executor.run_head_passes
    tot = dict(
        t=wall,
        out=sum(len(o) for o in outputs),
        passes=sum(s.iterations for s in stats),
        drafted=sum(s.drafted for s in stats),
        accepted=sum(s.accepted for s in stats),
        head_s=head_s[0],
        head_passes=heads[0],
        head_steps=heads[1],
    )
    return tot, outputs


def report_batched(runs: dict, outputs: dict, order: list, concurrency: int) -> int:
    plain = [t["out"] / t["t"] for t in runs["0"]]
    print(
        f"{concurrency} requests in flight (one BatchScheduler), the target alone: "
        + ", ".join(f"{x:.1f}" for x in plain)
        + " tokens/s"
    )
    for name in order[1:]:
        for t in runs[name]:
            rate = t["out"] / t["t"]
            print(
                f"{name}: {rate:.1f} tokens/s ({rate / (sum(plain) / len(plain)):.2f}x), drafted {t['drafted']}"
                f" accepted {t['accepted']}, {t['out'] / max(t['passes'], 1):.2f} tokens per request pass; head"
                f" forwards {100 * t['head_s'] / t['t']:.1f} % of the wall time,"
                f" {t['head_passes'] / max(t['head_steps'], 1):.2f} requests a head step"
            )
    same = all(outputs[kk] == outputs["0"] for kk in order)
    print("outputs equal to the target alone:", same)
    return 0 if same else 1


def _standing_team(on: bool):
    """The executor's standing team as it is (on) or replaced by a no-op (off) for one run."""
    import contextlib

    from specdeploy.engine import native

    @contextlib.contextmanager
    def patched():
        original = native.standing_team
        native.standing_team = lambda native_ops: contextlib.nullcontext()
        try:
            yield
        finally:
            native.standing_team = original

    return contextlib.nullcontext() if on else patched()


if __name__ == "__main__":
    sys.exit(main())
