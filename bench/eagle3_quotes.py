"""Where an EAGLE-3 head misses: its first draft against the target's greedy answers, teacher-forced, at the answer
positions that quote the prompt (the target's token and the one before it are two tokens of the prompt) and at the
others; plus `--write-passages`, prompts around passages the head never saw, for a data recipe to try.

Each prompt's greedy answer comes from the recipe's target engine (no drafting); one prefill over prompt + answer gives
the aux features, and the head catches up row by row as the fused loop feeds it, so the first draft at every answer
position is the one the loop would make there after a fully accepted history.

    .venv/bin/python bench/eagle3_quotes.py [--head DIR] --prompts builtin[:CATEGORY] | heldout:DATA_DIR[:SOURCE]
    [--count 32] .venv/bin/python bench/eagle3_quotes.py --write-passages FILE.jsonl   # prose paragraphs of the docs
    installed here

--write-passages: paragraphs of 40-160 words of prose (no markup lines, letters and spaces >= 90 %, no URLs, code
or identifiers) from the .rst/.md files and METADATA of the virtual environment's packages, /usr/share/doc READMEs
and the Python standard library's docstrings, deduplicated, each once inside one of the calibration requests
(draft_prompts.CALIBRATION_TEMPLATES) drawn with seed 1: a prompt file for draft.data.sources. Which files exist
depends on the machine: record the file with the data it made.
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import random
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MIN_WORDS, MAX_WORDS = 40, 160


def quotes_prompt(prompt: list[int], sequence: list[int], position: int, bigrams=None) -> bool:
    """Is the token at `position` of `sequence`, with the one before it, a bigram of `prompt` (`bigrams`: its
    eagle3_confidence.prompt_bigrams, computed once per prompt)?"""
    if bigrams is None:
        from bench.eagle3_confidence import prompt_bigrams

        bigrams = prompt_bigrams(prompt)
    return (sequence[position - 1], sequence[position]) in bigrams


def first_draft_hits(engine, head, prompt: list[int], answer: list[int]) -> list[tuple[bool, bool]]:
    """(quotes the prompt, the head's first draft equals the target's token) at each answer position after the first
    (the first answer token is the target's own, from the prompt's last row)."""
    import torch

    sequence = list(prompt) + list(answer)
    cache = engine.new_cache(len(sequence) + 1)
    _, aux = engine.forward(cache, torch.tensor(sequence), aux_layers=head.aux_layer_ids)
    drafter = head.new_drafter(len(sequence) + 1)
    from bench.eagle3_confidence import prompt_bigrams

    bigrams = prompt_bigrams(prompt)
    out = []
    for row in range(len(prompt) - 1, len(sequence) - 2):  # row `row` (with token row + 1) drafts position row + 2
        drafter.catch_up(aux[drafter.length : row + 1], sequence[drafter.length + 1 : row + 2])
        hit = head.to_target(int(drafter.logits.argmax())) == sequence[row + 2]
        out.append((quotes_prompt(prompt, sequence, row + 2, bigrams), hit))
    return out


def summarize(hits: list[tuple[bool, bool]]) -> dict:
    """{"quotes"|"other"|"all": (positions, share of first drafts equal to the target's token)}."""
    count = Counter(hits)
    out = {}
    for name, flag in (("quotes", True), ("other", False)):
        n = count[(flag, True)] + count[(flag, False)]
        out[name] = (n, count[(flag, True)] / n if n else 0.0)
    n = sum(count.values())
    out["all"] = (n, (count[(True, True)] + count[(False, True)]) / n if n else 0.0)
    return out


def is_prose(paragraph: str) -> bool:
    words = paragraph.split()
    if not MIN_WORDS <= len(words) <= MAX_WORDS or not paragraph[0].isupper() or paragraph[-1] not in ".!?":
        return False
    letters = sum(c.isalpha() or c == " " for c in paragraph) / len(paragraph)
    return letters >= 0.9 and not any(mark in paragraph for mark in ("http", "`", "::", "_", "{"))


def paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a text: blank-line separated, no line starting with markup."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in block.splitlines() if line.strip()]
        if not lines or any(
            line.startswith(("#", "=", "-", "*", ">", "|", "..", ":", "`", "[", "<", "!", "+")) for line in lines
        ):
            continue
        paragraph = " ".join(lines)
        if is_prose(paragraph):
            out.append(paragraph)
    return out


def machine_texts(site_packages: Path, stdlib: Path):
    files = sorted(
        {
            *glob.glob(f"{site_packages}/**/*.rst", recursive=True),
            *glob.glob(f"{site_packages}/**/*.md", recursive=True),
            *glob.glob(f"{site_packages}/*.dist-info/METADATA"),
            *glob.glob("/usr/share/doc/**/README*", recursive=True),
        }
    )
    for path in files:
        if path.endswith(".gz"):
            continue
        try:
            yield Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
    for path in sorted(glob.glob(f"{stdlib}/**/*.py", recursive=True)):
        if "/test" in path or "site-packages" in path:
            continue
        try:
            tree = ast.parse(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(
                node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            ) and ast.get_docstring(node):
                yield ast.get_docstring(node)


def passage_prompts(texts, seed: int = 1) -> list[str]:
    """Each distinct prose paragraph of `texts` once, inside a calibration request drawn with `seed` (order shuffled
    with seed 0)."""
    from specdeploy.eagle3.prompts import CALIBRATION_TEMPLATES, normalize

    seen, found = set(), []
    for text in texts:
        for paragraph in paragraphs(text):
            if normalize(paragraph) not in seen:
                seen.add(normalize(paragraph))
                found.append(paragraph)
    random.Random(0).shuffle(found)
    rng = random.Random(seed)
    return [CALIBRATION_TEMPLATES[rng.randrange(len(CALIBRATION_TEMPLATES))].format(text=p) for p in found]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "build" / "smollm2-135m.yaml"))
    ap.add_argument("--root", default=str(ROOT))
    ap.add_argument("--head", default=None, help="exported head folder (default: the recipe's)")
    ap.add_argument("--prompts", default="builtin", help="builtin[:CATEGORY] or heldout:DATA_DIR[:SOURCE]")
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--write-passages", default=None, metavar="FILE")
    args = ap.parse_args(argv)

    if args.write_passages:
        import sysconfig

        site = Path(sysconfig.get_paths()["purelib"])
        prompts = passage_prompts(machine_texts(site, Path(sysconfig.get_paths()["stdlib"])))
        Path(args.write_passages).write_text(
            "".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8"
        )
        print(f"{len(prompts)} prompts -> {args.write_passages}")
        return 0

    from bench.eagle3_confidence import heldout_prompts, load_pair
    from bench.eagle3_peer import chat_prompts
    from specdeploy.engine.eagle3 import Eagle3Head
    from specdeploy.engine.executor import Executor
    from specdeploy.engine.request import EngineRequest, run

    recipe, layout, engine, head, tokenizer = load_pair(args.recipe, args.root)
    if args.head:
        head = Eagle3Head.load(args.head, engine, recipe.draft.cpu_head_weights)
    kind, _, rest = args.prompts.partition(":")
    if kind == "builtin":
        prompts = [p for p in chat_prompts(tokenizer, 10**4, args.max_tokens) if p[0].startswith(rest)][: args.count]
    else:
        folder, _, source = rest.partition(":")
        sources = {
            json.loads(line)["id"]: json.loads(line)["source"] for line in (Path(folder) / "heldout.jsonl").open()
        }
        prompts = [p for p in heldout_prompts(Path(folder), 10**6) if not source or sources[p[0]] == source][
            : args.count
        ]
    executor = Executor(engine)
    hits = []
    for _, ids in prompts:
        answer = run(executor, EngineRequest(list(ids), args.max_tokens, end_id=tokenizer.eos_token_id)).token_ids
        hits += first_draft_hits(engine, head, list(ids), answer)
    result = summarize(hits)
    print(
        f"{len(prompts)} {args.prompts} prompts, first draft = the target's greedy token: "
        + ", ".join(f"{name} {share:.3f} ({n} positions)" for name, (n, share) in result.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
