"""Fused EAGLE-3 step costs on the bundled target (SmolLM2-135M), in-process, same threads for everything.

Measured (median of --repeat timed calls after warm-up, each at the same cache length, rolled back after):
  target step        one target decode row (KV cached)
  target step+aux    the same with the head's aux features captured (native decoder run in segments)
  verify k+1         one target pass over k+1 rows (with capture), k = 1..4, and its ratio to one step
  head step          one head draft row (KV cached): embedding, norms, fc-free row (own prenorm state), LM head
  head catch-up a+1  the head over a+1 rows of target features (fc included), after a verification pass
for random heads in the exported format at two draft vocabularies (the full 49152 and a 8192-token one).
A random head makes no claim about acceptance; only costs are measured here.

    .venv/bin/python bench/eagle3.py [--threads 2] [--context 128] [--repeat 30]

Prints a table and writes bench/results/eagle3-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


CLOCK = time.perf_counter


def timed(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = CLOCK()
        fn()
        samples.append(CLOCK() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help=(
            "time with the process's CPU time (time.process_time) instead of wall time: on a shared, "
            "loaded machine, with --threads 1, what the work costs rather than how long it waited"
        ),
    )
    ap.add_argument("--workdir", default=None, help="keep the compiled engine here and reuse it on later runs")
    args = ap.parse_args()
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time
    import torch

    torch.set_num_threads(args.threads)
    from eagle3_heads import make_eagle3_head

    from specdeploy.core.model_store import resolve
    from specdeploy.deploy.cpu_compile import compile_checkpoint
    from specdeploy.engine.eagle3 import Eagle3Head, default_aux_layer_ids
    from specdeploy.engine.model import CpuEngine
    from specdeploy.quantize.modelopt import quantize_model
    from specdeploy.recipe.config import EngineConfig, QuantConfig

    tmp = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="eagle3-bench-"))
    if not (tmp / "engine" / "config.json").is_file():
        quantize_model(resolve("smollm2-135m-instruct"), QuantConfig(), tmp / "ckpt", progress=False)
        compile_checkpoint(
            tmp / "ckpt", tmp / "engine", EngineConfig(dtype="bfloat16", max_input_len=512, max_seq_len=1024), 4
        )
    target = CpuEngine.load(tmp / "engine")
    s = target.spec
    layers = default_aux_layer_ids(s.num_layers)
    g = torch.Generator().manual_seed(0)
    context = torch.randint(10, s.vocab_size, (args.context,), generator=g)
    cache = target.new_cache()
    _, aux = target.forward(cache, context, aux_layers=layers)
    n = cache.length
    ms = {}

    def target_rows(rows, capture):
        def fn():
            ids = context[:rows]
            if capture:
                target.forward(cache, ids, aux_layers=layers)
            else:
                target.forward(cache, ids)
            cache.truncate(n)

        return fn

    ms["target step"] = timed(target_rows(1, False), args.repeat)
    ms["target step+aux"] = timed(target_rows(1, True), args.repeat)
    for k in range(1, 5):
        ms[f"verify k={k} ({k + 1} rows, aux)"] = timed(target_rows(k + 1, True), args.repeat)
    for draft_vocab in (s.vocab_size, 8192):
        d2t = None if draft_vocab == s.vocab_size else torch.arange(draft_vocab) * 5
        path = make_eagle3_head(
            tmp / f"head-{draft_vocab}",
            s.hidden_size,
            s.vocab_size,
            layers,
            num_heads=s.num_heads,
            num_kv_heads=s.num_kv_heads,
            intermediate_size=s.intermediate_size,
            draft_vocab_size=draft_vocab,
            d2t=d2t,
        )
        head = Eagle3Head.load(path, target)
        head_cache = head.new_cache()
        head.forward(head_cache, head.project(aux), context[1:].tolist() + [11])
        _, prenorm = head.forward(head_cache, head.project(aux[-1:]), torch.tensor([12]))
        m = head_cache.length

        def head_step():
            head.forward(head_cache, prenorm, torch.tensor([13]))
            head_cache.truncate(m)

        def catch_up(rows):
            def fn():
                head.forward(head_cache, head.project(aux[:rows]), context[:rows])
                head_cache.truncate(m)

            return fn

        ms[f"head step (draft vocab {draft_vocab})"] = timed(head_step, args.repeat)
        for rows in (1, 3, 5):
            ms[f"head catch-up {rows} rows (draft vocab {draft_vocab})"] = timed(catch_up(rows), args.repeat)
    step = ms["target step"]
    clock = "process CPU time" if args.cpu_time else "wall time"
    print(
        f"SmolLM2-135M bf16 engine, native={target.decoder is not None}, {args.threads} threads, context"
        f" {args.context}, {clock}"
    )
    print(f"{'what':52s} {'ms':>8s} {'/ target step':>14s}")
    for name, t in ms.items():
        print(f"{name:52s} {1000 * t:8.3f} {t / step:14.3f}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"eagle3-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(
        json.dumps(
            {
                "threads": args.threads,
                "context": args.context,
                "clock": clock,
                "load_average": os.getloadavg(),
                "ms": {k: 1000 * v for k, v in ms.items()},
            },
            indent=2,
        )
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
