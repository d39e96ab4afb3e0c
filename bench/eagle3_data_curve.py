"""Held-out acceptance of an EAGLE-3 head against the data it was trained on: the curve issue 24 asks to pick by.

Trains fresh heads with the recipe's own stage (`draft_train.train_recipe`: ModelOpt's EAGLE-3, the recipe's
draft.train settings, overridable with --set) on nested parts of one `specdeploy draft data` folder and measures
each as the stage does (`heldout_acceptance`: greedy chains of ttt_steps drafts against the target's tokens at the
answer positions of the folder's held-out samples, the same --heldout samples for every point, never trained on):

  - the data curve: the first FRACTION of the folder's answer tokens, for each --fractions, in one seeded order of
    the training samples (each part holds the smaller ones), at the same settings;
  - variants at --variant-fraction: `NAME:KEY=VALUE[,KEY=VALUE]` overrides of draft.train (`init_from_target=true`,
    `draft_vocab_size=2048`, `learning_rate=0.003`, ...), or `source=NAME`: the same answer-token budget from one
    source of the folder only (calibration, self_instruct, file), so each source is measured at equal size.

Each point's part is a folder of its own (train.jsonl: the part; heldout.jsonl: the --heldout samples; a manifest
whose fingerprint names the source folder's, the fraction and the order), so its head is cached like any other.
A point reports its answer tokens, the training's wall and CPU seconds (this process: all its threads) and, from
the source folder's manifest, the seconds the target took to write that share of the data; the held-out
acceptance per draft position and its sum (accepted drafts a round at k = ttt_steps), after each epoch too; and
the least-squares slope of the curve's acceptance against log2(answer tokens): what each doubling of the data buys.

`--validate RECIPE` also drafts with each head in that recipe's fused loop (its built target engine, the head in
the recipe's weights, all of its draft tokens, k = ttt_steps, no cut-off, no lookup) on the built-in validation
prompts: accepted drafts a round there, reported beside the held-out figure and never chosen on.

    .venv/bin/python bench/eagle3_data_curve.py --recipe build/smollm2-135m-eagle3.yaml \
        [--fractions 0.0625,0.125,0.25,0.5] [--variant init:init_from_target=true] [--variant-fraction 0.125] \
        [--set features=engine --set batch_size=16] [--heldout 64] [--work engines/eagle3-curve] \
        [--reference shipped=smollm2-135m-instruct-eagle3] [--validate build/smollm2-135m.yaml --validate-count 32] \
        [--out engines/eagle3-curve.json]

`--reference NAME=HEAD`: a head made elsewhere (a folder, or a bundled head's name) measured as the points are.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

SOURCE_KEY = "source"  # a variant key that picks the training samples of one source, not a draft.train key


@dataclass(frozen=True)
class Point:
    """One head to train: `name`, the share of the folder's answer tokens, draft.train overrides, a source filter."""

    name: str
    fraction: float
    train: dict = field(default_factory=dict)
    source: str = ""


def parse_value(text: str):
    """A --set / --variant value as YAML reads it (true, 2048, 3e-4, cosine)."""
    import yaml

    return yaml.safe_load(text)


def parse_assignments(text: str) -> dict:
    """`KEY=VALUE[,KEY=VALUE]` -> {KEY: value}."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise SystemExit(f"{text!r}: expected KEY=VALUE[,KEY=VALUE]")
        out[key.strip()] = parse_value(value.strip())
    return out


def parse_variant(text: str, fraction: float) -> Point:
    """`NAME:KEY=VALUE[,KEY=VALUE]`; the key `source` picks a source of the data instead of a draft.train setting."""
    name, sep, rest = text.partition(":")
    if not sep or not name:
        raise SystemExit(f"--variant {text!r}: expected NAME:KEY=VALUE[,KEY=VALUE]")
    train = parse_assignments(rest)
    source = str(train.pop(SOURCE_KEY, "") or "")
    return Point(name, fraction, train, source)


def answer_tokens(record: dict) -> int:
    return len(record["input_ids"]) - record["loss_start"]


def sample_order(records: list[dict], seed: int) -> list[int]:
    """One seeded order of the training samples; every part of the curve is a prefix of it."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    return order


def take_part(records: list[dict], order: list[int], fraction: float, source: str = "") -> list[dict]:
    """The samples of `order` (of `source` only, when given) up to `fraction` of all the training answer tokens
    (the sample that crosses the budget is kept): nested for growing fractions of one order."""
    budget = fraction * sum(answer_tokens(r) for r in records)
    part, held = [], 0
    for i in order:
        if held >= budget:
            break
        if source and records[i]["source"] != source:
            continue
        part.append(records[i])
        held += answer_tokens(records[i])
    return part


def write_part(
    source_dir: Path, dest: Path, records: list[dict], heldout: list[str], fraction: float, order_seed: int, source: str
) -> dict:
    """A draft-data folder for one point: its training part, the shared held-out lines, a manifest naming both."""
    from specdeploy.core.artifacts import Manifest, fingerprint

    manifest = Manifest.read(source_dir)
    if manifest is None:
        raise SystemExit(f"{source_dir} has no manifest.json: write it with `specdeploy draft data RECIPE`")
    part = {
        "source_folder": str(source_dir),
        "source_fingerprint": manifest.fingerprint,
        "fraction": fraction,
        "order_seed": order_seed,
        "source": source,
        "heldout_samples": len(heldout),
        "train_samples": len(records),
        "answer_tokens": sum(answer_tokens(r) for r in records),
        "tokens": sum(len(r["input_ids"]) for r in records),
    }
    fp = fingerprint(stage="draft-data-part", **{k: v for k, v in part.items() if k != "source_folder"})
    current = Manifest.read(dest) if dest.is_dir() else None
    if current is not None and current.fingerprint == fp:
        return part
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / "train.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, dest / "train.jsonl")
    (dest / "heldout.jsonl").write_text("".join(line + "\n" for line in heldout))
    Manifest(
        stage=manifest.stage,
        recipe_name=manifest.recipe_name,
        fingerprint=fp,
        settings=manifest.settings,
        inputs={"part_of": str(source_dir), "part_of_fingerprint": manifest.fingerprint},
        tool_versions=manifest.tool_versions,
        extra={"part": part},
    ).write(dest)
    return part


def point_recipe(raw: dict, point: Point, common: dict, data_dir: Path):
    """The recipe of one point: the source recipe with its own name, the part as draft.train.data_dir, the overrides."""
    import copy

    from specdeploy.recipe.load import parse_recipe

    body = copy.deepcopy(raw)
    body["name"] = f"{raw['name']}-curve-{point.name}"
    train = body.setdefault("draft", {}).setdefault("train", {})
    train.update(common)
    train.update(point.train)
    train["data_dir"] = str(data_dir)
    return parse_recipe(body, f"{point.name} (from {raw['name']})")


def link_engine(source_layout, layout) -> None:
    """draft.train.features engine: the point's recipe reads the source recipe's built target engine."""
    src, dest = source_layout.engine("target"), layout.engine("target")
    if dest.exists() or dest.is_symlink():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.symlink_to(src.resolve(), target_is_directory=True)


def write_seconds(source_manifest, part: dict) -> float | None:
    """The seconds the target took to write this part's answers, at the source folder's own rate."""
    rate = (source_manifest.extra or {}).get("tokens_per_s")
    return part["answer_tokens"] / rate if rate else None


def train_point(point: Point, raw: dict, common: dict, part_dir: Path, work: Path, source_layout, echo=print) -> dict:
    """Train (or find up to date) one point's head; returns its row."""
    from specdeploy.core.artifacts import Layout, Manifest
    from specdeploy.eagle3 import train as draft_train

    recipe = point_recipe(raw, point, common, part_dir)
    layout = Layout(work, recipe.name)
    if recipe.draft.train.features == "engine":
        link_engine(source_layout, layout)
    wall, cpu = time.monotonic(), time.process_time()
    trained = draft_train.train_recipe(recipe, layout, echo=echo) is not None  # None: up to date, nothing trained now
    manifest = Manifest.read(layout.eagle3_head)
    log = [
        json.loads(line)
        for line in (layout.eagle3_head / draft_train.TRAIN_LOG).read_text().splitlines()
        if line.strip()
    ]
    extra = manifest.extra
    return {
        "name": point.name,
        "fraction": point.fraction,
        "source": point.source,
        "train": {**common, **point.train},
        "head": str(layout.eagle3_head),
        "steps": extra["steps"],
        # this run's seconds only where it trained; a cached head has the seconds its manifest recorded
        "train_wall_s": round(time.monotonic() - wall, 1) if trained else None,
        "train_cpu_s": round(time.process_time() - cpu, 1) if trained else None,
        "recorded_train_s": extra["train_seconds"],
        "heldout": extra["heldout_acceptance"],
        "untrained": extra["untrained_acceptance"],
        "epochs": [
            {"epoch": e["epoch"], "mean_accepted": _mean(e["heldout"]), "per_position": e["heldout"]["per_position"]}
            for e in log
            if e["epoch"]
        ],
    }


def measure_head(name: str, head_dir: Path, raw: dict, common: dict, part_dir: Path, source_layout, echo=print) -> dict:
    """A head made elsewhere (the shipped one) measured as the points are: the same held-out samples, the same measure
    and target side (the points' settings), its own weights and draft vocabulary."""
    from dataclasses import asdict

    import torch
    from safetensors.torch import load_file

    from specdeploy.core import model_store as models
    from specdeploy.eagle3 import train as draft_train
    from specdeploy.eagle3.modelopt import aux_layer_ids, build_model, load_exported_head
    from specdeploy.eagle3.samples import read_draft_data
    from specdeploy.eagle3.train_loop import heldout_acceptance

    recipe = point_recipe(raw, Point(name, 1.0), common, part_dir)
    t = recipe.draft.train
    target_dir = models.resolve(recipe.target.model)
    target_config = json.loads((target_dir / "config.json").read_text())
    data = read_draft_data(part_dir, target_config["vocab_size"])
    aux = aux_layer_ids(target_config, t)
    features = draft_train.engine_features(recipe, source_layout, aux) if t.features == "engine" else None
    d2t = load_file(str(Path(head_dir) / "model.safetensors")).get("d2t")
    draft_ids = None if d2t is None else (torch.arange(len(d2t)) + d2t).tolist()
    model = build_model(target_dir, t, draft_ids, aux, offline=features is not None)
    load_exported_head(model, Path(head_dir))
    acceptance = heldout_acceptance(
        model,
        list(data.heldout),
        t.ttt_steps,
        t.seq_len,
        t.batch_size,
        draft_train.pad_id_of(target_config),
        "cpu",
        features,
    )
    echo(f"  {name} ({head_dir}): {acceptance.line()}")
    return {"name": name, "head": str(head_dir), "heldout": asdict(acceptance)}


def _mean(acceptance: dict) -> float:
    """Accepted drafts a round at k = ttt_steps, of an Acceptance as the manifests store it."""
    from specdeploy.eagle3.train_loop import Acceptance

    return Acceptance(**acceptance).mean_accepted


def slope_per_doubling(rows: list[dict]) -> float | None:
    """Least-squares slope of held-out accepted drafts a round against log2(answer tokens); None under two points."""
    points = [(math.log2(r["answer_tokens"]), _mean(r["heldout"])) for r in rows if r["answer_tokens"] > 0]
    if len(points) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else None


def validate_head(head_dir: Path, served_recipe_path: str, count: int, k: int, max_tokens: int, echo=print) -> dict:
    """Accepted drafts a round of `head_dir` in the served recipe's fused loop on the built-in validation prompts
    (its target engine, the head in the recipe's weights, all its draft tokens, no cut-off, no lookup)."""
    from transformers import AutoTokenizer

    from bench.eagle3_confidence import by_group, prompts_of, record_rounds
    from specdeploy.core import model_store as models
    from specdeploy.core.artifacts import Layout
    from specdeploy.engine.eagle3 import Eagle3Head
    from specdeploy.engine.executor import Executor
    from specdeploy.engine.model import CpuEngine
    from specdeploy.recipe.load import load_recipe

    recipe = load_recipe(served_recipe_path)
    engine = CpuEngine.load(Layout.of(recipe, ROOT).engine("target"))
    head = Eagle3Head.load(head_dir, engine, recipe.draft.cpu_head_weights, 0)
    tokenizer = AutoTokenizer.from_pretrained(str(models.resolve(recipe.target.model)))
    prompts = prompts_of("builtin", "", count, tokenizer, max_tokens)
    rounds = record_rounds(Executor(engine, 2, head=head), head, prompts, max_tokens, k, tokenizer.eos_token_id)
    groups = {name: {"rounds": n, "accepted_per_round": round(mean, 3)} for name, n, mean, _ in by_group(rounds, k)}
    echo(
        f"  validation ({count} built-in prompts, k = {k}): {groups['all']['accepted_per_round']:.2f} accepted a round"
    )
    return groups


def validated(head_dir: Path, served_recipe_path: str, count: int, k: int, max_tokens: int, cache_dir: Path) -> dict:
    """validate_head, kept in `cache_dir` per head and setting (a rerun of the curve measures only what changed):
    keyed by the head's files and the served recipe's engine."""
    from specdeploy.core.artifacts import Layout, Manifest, fingerprint, head_hash
    from specdeploy.recipe.load import load_recipe

    engine = Manifest.read(Layout.of(load_recipe(served_recipe_path), ROOT).engine("target"))
    key = fingerprint(
        head=head_hash(head_dir), engine=engine.fingerprint if engine else "", count=count, k=k, tokens=max_tokens
    )
    cache = cache_dir / f"{key[:24]}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    groups = validate_head(head_dir, served_recipe_path, count, k, max_tokens)
    cache_dir.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(groups))
    return groups


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(ROOT / "build" / "smollm2-135m-eagle3.yaml"))
    ap.add_argument("--root", default=str(ROOT), help="where the recipe's engines/ are (its data and target engine)")
    ap.add_argument("--data", default="", help="the draft-data folder (default: the recipe's own)")
    ap.add_argument("--fractions", default="0.0625,0.125,0.25,0.5")
    ap.add_argument(
        "--variant", action="append", default=[], help="NAME:KEY=VALUE[,KEY=VALUE] (source=NAME: one source)"
    )
    ap.add_argument("--variant-fraction", type=float, default=0.125)
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE: a draft.train setting for every point")
    ap.add_argument("--heldout", type=int, default=64, help="held-out samples measured (the folder's first ones)")
    ap.add_argument("--order-seed", type=int, default=0)
    ap.add_argument("--work", default=str(ROOT / "engines" / "eagle3-curve"))
    ap.add_argument(
        "--reference", action="append", default=[], help="NAME=HEAD_DIR: a head made elsewhere, measured alike"
    )
    ap.add_argument("--validate", default="", help="a served eagle3 recipe whose fused loop drafts with each head")
    ap.add_argument("--validate-count", type=int, default=32)
    ap.add_argument("--validate-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    import torch
    import yaml

    from specdeploy.core.artifacts import Layout, Manifest
    from specdeploy.recipe.load import parse_recipe

    torch.set_num_threads(args.threads)
    raw = yaml.safe_load(Path(args.recipe).read_text())
    source_layout = Layout.of(parse_recipe(raw, args.recipe), Path(args.root))
    source_dir = Path(args.data) if args.data else source_layout.draft_data
    records = [json.loads(line) for line in (source_dir / "train.jsonl").read_text().splitlines() if line.strip()]
    heldout = [line for line in (source_dir / "heldout.jsonl").read_text().splitlines() if line.strip()][: args.heldout]
    source_manifest = Manifest.read(source_dir)
    common = {}
    for text in args.set:
        common.update(parse_assignments(text))
    points = [Point(f"f{float(f):g}", float(f)) for f in args.fractions.split(",") if f.strip()]
    points += [parse_variant(v, args.variant_fraction) for v in args.variant]
    order = sample_order(records, args.order_seed)
    work = Path(args.work)
    print(
        f"{len(records)} training samples ({sum(answer_tokens(r) for r in records):,} answer tokens) and {len(heldout)}"
        f" held-out samples of {source_dir}; {len(points)} heads into {work}",
        flush=True,
    )
    rows = []
    for point in points:
        part_records = take_part(records, order, point.fraction, point.source)
        if not part_records:
            raise SystemExit(f"{point.name}: no training samples (source {point.source!r} not in {source_dir}?)")
        part_dir = work / "data" / (f"{point.source}-{point.fraction:g}" if point.source else f"{point.fraction:g}")
        part = write_part(source_dir, part_dir, part_records, heldout, point.fraction, args.order_seed, point.source)
        print(
            f"\n== {point.name}: {part['train_samples']} samples, {part['answer_tokens']:,} answer tokens, "
            f"overrides {dict(common, **point.train)}",
            flush=True,
        )
        row = train_point(point, raw, common, part_dir, work, source_layout)
        row.update(
            train_samples=part["train_samples"],
            answer_tokens=part["answer_tokens"],
            tokens=part["tokens"],
            write_s=write_seconds(source_manifest, part) if source_manifest else None,
        )
        if args.validate:
            k = int(row["train"].get("ttt_steps", raw["draft"]["train"].get("ttt_steps", 3)))
            row["validation"] = validated(
                Path(row["head"]), args.validate, args.validate_count, k, args.validate_tokens, work / "validation"
            )
        rows.append(row)
        if args.out:  # after every point: a stopped run keeps what it measured
            Path(args.out).write_text(json.dumps({"source": str(source_dir), "rows": rows}, indent=1))
    references = []
    for text in args.reference:
        name, _, head_dir = text.partition("=")
        if not head_dir:
            raise SystemExit(f"--reference {text!r}: expected NAME=HEAD_DIR")
        head_dir = str(Path(head_dir)) if "/" in head_dir else str(ROOT / "specdeploy" / "data" / "heads" / head_dir)
        ref = measure_head(name, Path(head_dir), raw, common, part_dir, source_layout)
        if args.validate:
            ref["validation"] = validated(
                Path(head_dir),
                args.validate,
                args.validate_count,
                len(ref["heldout"]["per_position"]),
                args.validate_tokens,
                work / "validation",
            )
        references.append(ref)
    curve = [r for r in rows if not r["source"] and not r["train"].keys() - common.keys()]
    slope = slope_per_doubling(curve)
    print(f"\nheld-out acceptance ({len(heldout)} samples of {source_dir}, never trained on) by training data:")
    print(
        "  point        samples  answer tokens  write s  train s (CPU s)  steps  per position           accepted a"
        " round" + ("  validation" if args.validate else "")
    )
    for r in rows:
        per = " / ".join(f"{x:.3f}" for x in r["heldout"]["per_position"])
        write = f"{r['write_s']:7.0f}" if r["write_s"] is not None else "      -"
        val = f"  {r['validation']['all']['accepted_per_round']:.2f}" if "validation" in r else ""
        cpu = f"{r['train_cpu_s']:6.0f}" if r["train_cpu_s"] is not None else "     -"  # a cached head: not this run's
        wall = r["train_wall_s"] if r["train_wall_s"] is not None else r["recorded_train_s"]
        print(
            f"  {r['name']:12s} {r['train_samples']:7d}  {r['answer_tokens']:13,d}  {write}  {wall:7.0f} "
            f"({cpu})  {r['steps']:5d}  {per:21s}  {_mean(r['heldout']):.3f}{val}"
        )
    for r in references:
        per = " / ".join(f"{x:.3f}" for x in r["heldout"]["per_position"])
        val = f"  {r['validation']['all']['accepted_per_round']:.2f}" if "validation" in r else ""
        print(f"  {r['name']:12s} (made elsewhere: {r['head']}){'':5s}{per:21s}  {_mean(r['heldout']):.3f}{val}")
    if slope is not None:
        print(
            f"\nper doubling of the answer tokens: {slope:+.3f} accepted drafts a round (least squares over"
            f" {len(curve)} points)"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"source": str(source_dir), "rows": rows, "references": references, "slope_per_doubling": slope},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
