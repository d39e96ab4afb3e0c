"""Answer tokens per second of `draft data`'s torch backend (specdeploy.eagle3.decode_torch.TorchGenerator) at a
target's shape, on whatever device torch has (a GPU where there is one): random weights from a config.json (speed
does not depend on the weights; the device tool cannot carry the bundled ones in one call), 64-token prompts,
every row decoding `--new-tokens` (random weights rarely end a turn), greedy and sampled rows.

    python bench/eagle3_gpu_decode.py --config CONFIG.json [--rows 256,1024] [--new-tokens 128] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the target's config.json")
    ap.add_argument("--rows", default="256,1024")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdeploy.eagle3.decode_torch import TorchGenerator, device_name
    from specdeploy.eagle3.generation import Job, Journal

    work = Path(tempfile.mkdtemp(prefix="gpu-decode-"))
    (work / "model").mkdir()
    (work / "model" / "config.json").write_text(Path(args.config).read_text())
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(str(work / "model"))
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(str(work / "model"))
    gen = TorchGenerator(work / "model", -1, Journal(work / "journal.jsonl"), print, None, batch_size=1)
    sync = torch.cuda.synchronize if gen.device == "cuda" else (lambda: None)
    res = {
        "device": torch.cuda.get_device_name(0) if gen.device == "cuda" else device_name(),
        "new_tokens": args.new_tokens,
        "dtype": str(gen.dtype),
    }
    g = torch.Generator().manual_seed(1)
    for rows in [int(r) for r in args.rows.split(",")]:
        for sampled in (False, True):
            jobs = [
                Job(
                    f"r{i}",
                    torch.randint(100, config.vocab_size, (64,), generator=g).tolist(),
                    args.new_tokens,
                    0.8 if sampled else None,
                    i,
                )
                for i in range(rows)
            ]
            gen.decode(jobs[: min(rows, 8)])  # warm-up
            sync()
            t0 = time.perf_counter()
            tokens, _ = gen.decode(jobs)
            sync()
            dt = time.perf_counter() - t0
            made = sum(len(t) for t in tokens)
            key = f"rows{rows}_{'sampled' if sampled else 'greedy'}"
            res[key + "_tokens_per_s"] = round(made / dt)
            res[key + "_ms_per_step"] = round(1000 * dt / args.new_tokens, 2)
            print(
                f"{key}: {made} tokens in {dt:.2f} s, {made / dt:,.0f} tokens/s, {1000 * dt / args.new_tokens:.1f} ms a"
                " step",
                flush=True,
            )
    if gen.device == "cuda":
        res["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    print(json.dumps(res))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
