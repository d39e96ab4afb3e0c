"""Quality of built CPU engines against their unquantized source, on the quantize stage's held-out text.

`specdeploy quantize` prints a quality table for ModelOpt's fake-quantized model. This measures what is served
instead: each engine folder given (its real kernels, weights and activation quantization, e.g. an int8_sq engine
built with `quantization.per_token`, which ModelOpt's simulation does not have) against the Hugging Face source in
fp32, with the same metrics on the same rows (specdeploy.quantize.calibration_text.heldout_rows: the shipped held-out
passages, never calibration text nor validation prompts; or `--text FILE`, e.g. a text no setting was chosen on):
perplexity, top-1 agreement, mean KL(source || engine).

    .venv/bin/python bench/engine_quality.py --model smollm2-135m-instruct \
        --engine engines/smollm2-135m/target --engine engines/sm-int8sq/target [--row-len 256]

Prints one row per engine and writes bench/results/engine-quality-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def engine_model(folder: str):
    """A CPU engine called like a Hugging Face model on one row: model(input_ids [1, T]).logits [1, T, vocab]."""
    from specdeploy.engine.model import CpuEngine

    engine = CpuEngine.load(folder)

    def call(input_ids):
        return SimpleNamespace(logits=engine.forward(engine.new_cache(input_ids.shape[1]), input_ids[0])[None])

    return engine, call


def label_of(engine, folder: str) -> str:
    return f"{Path(folder).parent.name}/{Path(folder).name} ({engine.spec.quant_algo or 'bf16'}, {engine.spec.dtype})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the engines' source: bundled name or HF folder")
    ap.add_argument("--engine", action="append", required=True, help="an engine folder (repeatable)")
    ap.add_argument("--row-len", type=int, default=256, help="tokens per row (the recipes' calib_max_seq_length)")
    ap.add_argument(
        "--text",
        default=None,
        help=(
            "measure on this text file instead (cut into rows of --row-len tokens), e.g. text no setting was chosen on"
        ),
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdeploy.core.model_store import resolve
    from specdeploy.quantize.calibration_text import heldout_rows
    from specdeploy.quantize.quality import evaluate_quality
    from specdeploy.recipe.config import QuantConfig

    torch.set_num_threads(args.threads)
    source_dir = resolve(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(source_dir))
    source = AutoModelForCausalLM.from_pretrained(str(source_dir), dtype=torch.float32).eval()
    if args.text:
        ids = tokenizer(Path(args.text).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        rows = [r for r in (ids[i : i + args.row_len] for i in range(0, len(ids), args.row_len)) if len(r) >= 2]
        passages = 1
        print(f"text {args.text}: {len(rows)} rows of up to {args.row_len} tokens", file=sys.stderr)
    else:
        rows, passages = heldout_rows(tokenizer, args.row_len)
        print(f"held-out text: {passages} passages, {len(rows)} rows of up to {args.row_len} tokens", file=sys.stderr)
    results = []
    for folder in args.engine:
        engine, call = engine_model(folder)
        started = time.monotonic()
        report = evaluate_quality(source, call, rows, QuantConfig(), progress=True, num_passages=passages)
        results.append(
            {
                "engine": folder,
                "label": label_of(engine, folder),
                "quant_algo": engine.spec.quant_algo,
                "dtype": engine.spec.dtype,
                **report.as_dict(),
                "seconds": round(time.monotonic() - started, 1),
            }
        )
        print(f"  {results[-1]['label']}: done in {results[-1]['seconds']} s", file=sys.stderr)

    print(f"\n{'engine':<58} {'perplexity':>10} {'source':>8} {'top-1':>7} {'KL nats':>8}")
    for r in results:
        print(
            f"{r['label']:<58} {r['quantized_perplexity']:10.3f} {r['source_perplexity']:8.3f} "
            f"{100 * r['top1_agreement']:6.2f}% {r['mean_kl']:8.4f}"
        )
    out = (
        Path(args.out)
        if args.out
        else ROOT / "bench" / "results" / f"engine-quality-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "model": args.model,
                "text": args.text or "heldout",
                "row_len": args.row_len,
                "rows": len(rows),
                "passages": passages,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
