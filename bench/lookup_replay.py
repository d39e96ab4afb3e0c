"""Model-free drafts replayed on the target's own greedy answers: tokens per target pass of the n-gram draft and of
the suffix automaton alone (draft.kind suffix), per category of the built-in prompts.

The target (the bundled SmolLM2-135M-Instruct, unquantized, fp32, Hugging Face transformers) answers each prompt
greedily once (chat template, `--max-tokens`); each proposer then replays that answer: a round drafts up to k tokens
from the sequence so far, the target accepts the longest prefix that equals its own answer and adds one token. Greedy
speculative output equals the answer, so the rounds are exactly those a served deployment runs with that draft and a
fixed k (no cost policy); time is not measured.

    .venv/bin/python bench/lookup_replay.py [--max-tokens 128] [--k 4] [--max-prompts 0]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdeploy.client.prompts import load_prompt_set
from specdeploy.core import model_store
from specdeploy.speculation.ngram import NGramProposer, NGramSettings, SuffixProposer, SuffixSettings


def replay(proposer, prompt_ids: list[int], answer: list[int], k: int) -> tuple[int, int]:
    """(target passes, drafted tokens) for `answer` after `prompt_ids` with this proposer."""
    sequence, produced, passes, drafted = list(prompt_ids), 0, 0, 0
    while produced < len(answer):
        draft = proposer.draft(sequence, min(k, len(answer) - produced - 1)) if len(answer) - produced > 1 else []
        drafted += len(draft)
        accepted = 0
        while accepted < len(draft) and draft[accepted] == answer[produced + accepted]:
            accepted += 1
        new = answer[produced : produced + accepted + 1]
        sequence += new
        produced += len(new)
        passes += 1
    return passes, drafted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-prompts", type=int, default=0, help="0: all 119 built-in prompts")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model_dir = model_store.cached_path("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    proposers = {
        "ngram 3..2 (build/smollm2-135m-ngram.yaml)": lambda: NGramProposer(
            NGramSettings(args.k, 3, is_public_pool=False, min_matching_ngram_size=2)
        ),
        "ngram 2..1 (TensorRT-LLM's defaults)": lambda: NGramProposer(NGramSettings(args.k, 2, is_public_pool=False)),
        "suffix, longest match (-1)": lambda: SuffixProposer(SuffixSettings(args.k, -1)),
    }
    totals: dict[tuple[str, str], list[int]] = {}
    start = time.time()
    for prompt in load_prompt_set("builtin", args.max_tokens, args.max_prompts):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=args.max_tokens, do_sample=False, pad_token_id=0
            )
        answer = out[0, len(prompt_ids) :].tolist()
        for name, make in proposers.items():
            passes, drafted = replay(make(), prompt_ids, answer, args.k)
            for key in ((name, prompt.category), (name, "all")):
                total = totals.setdefault(key, [0, 0, 0])
                total[0] += len(answer)
                total[1] += passes
                total[2] += drafted
    rows = {f"{n} | {c}": {"tokens_per_pass": t / p, "drafted_per_pass": d / p} for (n, c), (t, p, d) in totals.items()}
    for key, row in rows.items():
        print(f"{key:60s} tokens/pass {row['tokens_per_pass']:.2f}  drafted/pass {row['drafted_per_pass']:.2f}")
    out_dir = Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"lookup-replay-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"k": args.k, "max_tokens": args.max_tokens, "rows": rows}, indent=1))
    print(f"wrote {path} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
