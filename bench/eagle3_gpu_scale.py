"""Throughput of the EAGLE-3 pipeline's two heavy stages at the bundled target's shape on whatever device torch
has (a GPU where there is one): Hugging Face `generate` (greedy, a fixed number of new tokens, batches of prompts:
what the draft-data stage's answers cost there) and specdeploy's `draft_train.train_recipe` (ModelOpt EAGLE-3, the
head and settings of build/smollm2-135m-eagle3.yaml) over synthetic samples.

The target has SmolLM2-135M's config with random weights (seeded): throughput does not depend on the weights, and
this runs where the bundled weights (270 MB in bf16) cannot be copied (the device tool moves 64 MiB a call); a
model folder with only config.json and the tokenizer files is enough (`--config-dir`). Acceptance is not measured:
random samples are no target's answers.

    python bench/eagle3_gpu_scale.py --config-dir DIR [--batches 256,1024] [--new-tokens 256] [--samples 3000]
        [--batch-size 16] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-dir", required=True, help="a folder with the target's config.json and tokenizer files")
    ap.add_argument("--batches", default="256,1024")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--samples", type=int, default=3000, help="training samples of 64 prompt + 256 answer tokens")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    from specdeploy.core import artifacts
    from specdeploy.eagle3 import train as draft_train
    from specdeploy.recipe.load import parse_recipe

    work = Path(tempfile.mkdtemp(prefix="eagle3-scale-"))
    model_dir = work / "target"
    shutil.copytree(args.config_dir, model_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(str(model_dir))).to(torch.bfloat16)
    model.save_pretrained(str(model_dir))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    model = model.to(dev).eval()
    res = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "new_tokens": args.new_tokens}
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = torch.randint(100, 40000, (batch, 64), device=dev)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)  # warm-up
            sync()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
            sync()
            dt = time.perf_counter() - t0
        res[f"generate_batch{batch}_tokens_per_s"] = round(batch * args.new_tokens / dt)
        print(
            f"generate: batch {batch} x {args.new_tokens} new tokens in {dt:.1f} s, {batch * args.new_tokens / dt:,.0f}"
            " tokens/s",
            flush=True,
        )
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()

    rng = random.Random(0)
    sample = lambda i: {
        "id": f"s{i}",
        "source": "synthetic",
        "input_ids": [rng.randrange(100, 40000) for _ in range(320)],  # noqa: E731
        "loss_start": 64,
        "sampled": False,
    }
    recipe = parse_recipe(
        {
            "name": "scale",
            "target": {"model": str(model_dir)},
            "draft": {
                "kind": "eagle3",
                "head": "trained",
                "train": {
                    "draft_vocab_size": 8192,
                    "ttt_steps": 3,
                    "epochs": 1.0,
                    "learning_rate": 1e-3,
                    "seq_len": 512,
                    "batch_size": args.batch_size,
                    "seed": 0,
                    "precision": "auto",
                },
            },
            "speculative": {"max_draft_len": 4, "num_draft_tokens": 3},
        }
    )
    layout = artifacts.Layout(work / "run", recipe.name)
    data = layout.draft_data
    data.mkdir(parents=True)
    (data / "train.jsonl").write_text("".join(json.dumps(sample(i)) + "\n" for i in range(args.samples)))
    (data / "heldout.jsonl").write_text("".join(json.dumps(sample(i)) + "\n" for i in range(64)))
    artifacts.Manifest(stage="draft-data", recipe_name=recipe.name, fingerprint="synthetic-1").write(data)
    t0 = time.perf_counter()
    draft_train.train_recipe(recipe, layout, echo=print, progress=False)
    manifest = artifacts.Manifest.read(layout.eagle3_head)
    res.update(
        {
            "train_wall_s": round(time.perf_counter() - t0, 1),
            "train_device": manifest.settings.get("device"),
            "train_precision": manifest.settings.get("precision"),
            **{
                f"train_{k.removeprefix('train_')}": manifest.extra.get(k)
                for k in ("train_tokens_per_s", "train_seconds", "steps", "seconds_per_step")
            },
        }
    )
    if dev == "cuda":
        res["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
