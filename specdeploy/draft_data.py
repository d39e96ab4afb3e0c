"""`specdeploy draft data RECIPE`: the training set of an EAGLE-3 draft head (draft.kind eagle3), written by the target.

EAGLE-3 heads learn to predict what the *target* says, so the target writes its own training set (ModelOpt's
"data synthesis" step): prompts from draft.data.sources are rendered with the target's chat template and answered
by the recipe's own built CPU engine, many at a time (engine.batching.BatchScheduler: in-flight batching, up to
engine.max_batch_size requests per step). The first answer to a prompt is greedy, the others are sampled at
draft.data.temperature with a seed derived from the prompt, so the same seed and settings give the same data.

Prompt sources:
- "calibration": the shipped passages (specdeploy/data/calib/calibration.jsonl) inside a few instruction
  templates (summarize / continue / explain / questions), drawn with the seed;
- "self_instruct": user turns the target writes itself: the chat template's text up to a user turn's content is
  fed to the target, which samples until the end of its turn; trivial and duplicate turns are dropped;
- a .jsonl file ({"prompt": ...} or {"messages": [...]} per line) or a .txt file (one prompt per line).
`text_files` are texts already on the machine, cut into chunks and stored as scored text (loss from position 0,
nothing generated: the trainer computes the target's distribution over them).

The validation prompt sets (specdeploy/data/prompts/*.jsonl and the recipe's validation.prompt_set) are never
used: a prompt file holding one of their prompts is refused, a calibration or self-instruct prompt equal to one
(normalized) is dropped, and the manifest says so.

Output (Layout.draft_data; the contract `specdeploy draft train` reads): train.jsonl and heldout.jsonl, one sample
per line {"id", "source", "input_ids" (prompt then answer incl. the end token), "loss_start" (first answer
token; 0 for scored text), "sampled"}, and manifest.json. heldout.jsonl holds ~HELDOUT_PERCENT % of the prompts
(chosen by a hash of the prompt; all samples of a prompt on the same side), never trained on.

Resumable: every finished generation is appended to a journal in the work folder `.draft-data.partial` beside
the output; a rerun with the same inputs and settings replays it and generates only what is missing (`--force`
starts over). The finished output is renamed into place atomically and the work folder removed.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from specdeploy import artifacts
from specdeploy.config import Recipe
from specdeploy.errors import ConfigError, StaleArtifactError

STAGE = "draft-data"
RERUN = "specdeploy draft data {recipe}"
DATA_DIR = Path(__file__).resolve().parent / "data"
CALIBRATION_FILE = DATA_DIR / "calib" / "calibration.jsonl"
VALIDATION_DIR = DATA_DIR / "prompts"
NAMED_SOURCES = ("calibration", "self_instruct")
PROMPT_FILE_SUFFIXES = (".jsonl", ".txt")
HELDOUT_PERCENT = 5
WORK_SUFFIX = ".partial"

# "calibration": a passage inside one of these requests (the passage is the only variable part)
CALIBRATION_TEMPLATES = (
    "Summarize the following passage in two or three sentences.\n\n{text}",
    "Continue this text for another paragraph, keeping its style and tone.\n\n{text}",
    "Explain the following passage in simple words, as you would to a curious teenager.\n\n{text}",
    "Write three questions about this passage, then answer each of them.\n\n{text}",
    "What is the main idea of this text, and what details support it?\n\n{text}",
)

SELF_INSTRUCT_MAX_TOKENS = 96  # a user turn longer than this is cut off, and dropped (it never ended)
SELF_INSTRUCT_MIN_WORDS = 3
SELF_INSTRUCT_ATTEMPTS = 4  # at most this many candidates per wanted prompt (plus one wave of slack)
MIN_ANSWER_TOKENS = 8  # a prompt that leaves fewer positions for the answer (max_seq_len) is dropped as too long
_MARK = "\u2063SPECDEPLOY-USER-TURN\u2063"  # stands in for a user turn's content when cutting the template


def normalize(text: str) -> str:
    """The form prompts are compared in (dedupe, validation exclusion): case and whitespace folded."""
    return " ".join(text.lower().split())


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps(parts).encode()).digest()[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def is_heldout(key: str) -> bool:
    return _hash_bucket(key) < HELDOUT_PERCENT


def _hash_bucket(key: str) -> int:
    return int(hashlib.sha256(normalize(key).encode()).hexdigest()[:8], 16) % 100


# ---------------------------------------------------------------- prompts


@dataclass(frozen=True)
class PromptSpec:
    """One prompt of the plan: `messages` as (role, content) pairs, the last one the user's."""

    id: str
    source: str  # "calibration" | "self_instruct" | "file"
    messages: tuple[tuple[str, str], ...]

    @property
    def key(self) -> str:
        """The normalized text the prompt is compared and held out by."""
        return normalize(" ".join(content for role, content in self.messages if role == "user"))


def validation_prompts(recipe: Recipe) -> dict[str, str]:
    """normalized user text -> file, for every prompt of the built-in validation sets and of the recipe's own."""
    files = sorted(VALIDATION_DIR.glob("*.jsonl"))
    if recipe.validation.prompt_set != "builtin":
        files.append(Path(recipe.validation.prompt_set))
    found: dict[str, str] = {}
    for path in files:
        if not path.is_file():
            continue  # validate refuses a missing prompt set itself
        for _, messages in _read_prompt_file(path):
            found.setdefault(normalize(" ".join(c for r, c in messages if r == "user")), str(path))
    return found


def _read_prompt_file(path: Path) -> list[tuple[int, tuple[tuple[str, str], ...]]]:
    """(line number, messages) of a .jsonl ({"prompt"} or {"messages"}) or .txt (one prompt per line) file."""
    if not path.is_file():
        raise ConfigError(f"prompt file {path} not found", "fix the path in draft.data.sources (relative paths are from the current directory)")
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            out.append((lineno, (("user", line.strip()),)))
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{where} is not valid JSON: {exc}", 'one object per line, e.g. {"prompt": "Hello"}') from exc
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
            out.append((lineno, (("user", obj["prompt"]),)))
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"]:
            try:
                messages = tuple((str(m["role"]), str(m["content"])) for m in obj["messages"])
            except (TypeError, KeyError) as exc:
                raise ConfigError(f"{where}: every message needs 'role' and 'content'", 'e.g. {"messages": [{"role": "user", "content": "Hi"}]}') from exc
            if messages[-1][0] != "user":
                raise ConfigError(f"{where}: the last message is not the user's", "end the conversation with a user message: the target answers it")
            out.append((lineno, messages))
        else:
            raise ConfigError(f"{where} has neither a non-empty 'prompt' nor 'messages'", 'e.g. {"prompt": "Hello"}')
    return out


def check_sources(recipe: Recipe) -> None:
    """Refuse an unknown source or a missing file before any work."""
    data = recipe.draft.data
    if not recipe.draft.is_eagle3:
        raise ConfigError(f"draft.kind is {recipe.draft.kind}: `draft data` makes the training set of an EAGLE-3 head",
                          "set draft.kind: eagle3 (with draft.head) in the recipe")
    if not data.sources and not data.text_files:
        raise ConfigError("draft.data.sources and draft.data.text_files are both empty", 'e.g. sources: ["calibration", "self_instruct"]')
    for source in data.sources:
        if source in NAMED_SOURCES:
            continue
        if Path(source).suffix not in PROMPT_FILE_SUFFIXES:
            raise ConfigError(f"unknown draft.data source {source!r}",
                              f"use {', '.join(NAMED_SOURCES)}, or a path to a .jsonl or .txt prompt file")
        if not Path(source).is_file():
            raise ConfigError(f"prompt file {source} (draft.data.sources) not found", "fix the path (relative paths are from the current directory)")
    for path in data.text_files:
        if not Path(path).is_file():
            raise ConfigError(f"text file {path} (draft.data.text_files) not found", "fix the path, or remove it")


def _quotas(sources: Sequence[str], total: int) -> dict[str, int]:
    base, extra = divmod(total, len(sources))
    return {s: base + (1 if i < extra else 0) for i, s in enumerate(sources)}


class _Collector:
    """Accepts prompts in order: drops duplicates and validation prompts (counted per source)."""

    def __init__(self, validation: dict[str, str]):
        self.validation = validation
        self.seen: set[str] = set()
        self.prompts: list[PromptSpec] = []
        self.dropped_validation: dict[str, int] = {}
        self.dropped_duplicate: dict[str, int] = {}

    def offer(self, prompt: PromptSpec) -> bool:
        key = prompt.key
        if key in self.validation:
            self.dropped_validation[prompt.source] = self.dropped_validation.get(prompt.source, 0) + 1
            return False
        if key in self.seen:
            self.dropped_duplicate[prompt.source] = self.dropped_duplicate.get(prompt.source, 0) + 1
            return False
        self.seen.add(key)
        self.prompts.append(prompt)
        return True


def calibration_prompts(seed: int) -> list[PromptSpec]:
    """Every (passage, template) pair, in the seed's order."""
    passages = [json.loads(line)["text"] for line in CALIBRATION_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]
    pairs = [(p, t) for p in range(len(passages)) for t in range(len(CALIBRATION_TEMPLATES))]
    random.Random(_seed(seed, "calibration")).shuffle(pairs)
    return [PromptSpec(f"calibration-{p}-{t}", "calibration", (("user", CALIBRATION_TEMPLATES[t].format(text=passages[p])),))
            for p, t in pairs]


def file_prompts(path: str, seed: int, validation: dict[str, str]) -> list[PromptSpec]:
    """A prompt file's prompts in the seed's order; a validation prompt in it is refused."""
    prompts = []
    for lineno, messages in _read_prompt_file(Path(path)):
        prompt = PromptSpec(f"file-{_seed(str(path))% 10**6}-{lineno}", "file", messages)
        if prompt.key in validation:
            user = next(c for r, c in reversed(messages) if r == "user")
            raise ConfigError(
                f"prompt file {path} line {lineno} holds a validation prompt ({validation[prompt.key]}): {user[:80]!r}",
                "remove the validation prompts from the training prompts: a draft trained on them makes validation measure memory",
            )
        prompts.append(prompt)
    random.Random(_seed(seed, "file", str(path))).shuffle(prompts)
    return prompts


# ---------------------------------------------------------------- the chat template


class ChatFormat:
    """The target's chat template as token ids: a conversation ready for the answer, and a user turn's prefix."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("the target's tokenizer has no chat template; EAGLE-3 training data is chat-formatted",
                              "use an instruct (chat) target model whose tokenizer has a chat template")
        self.tokenizer = tokenizer
        self.end_id = tokenizer.eos_token_id
        if self.end_id is None:
            raise ConfigError("the target's tokenizer has no end (eos) token", "use a tokenizer with an eos token")
        bos = getattr(tokenizer, "bos_token_id", None)
        probe = list(tokenizer("x", add_special_tokens=True).input_ids)
        self._bos = bos if bos is not None and probe and probe[0] == bos else None  # the tokenizer's own BOS

    def _ids(self, text: str) -> list[int]:
        ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
        if self._bos is not None and (not ids or ids[0] != self._bos):
            ids.insert(0, self._bos)  # what the server's preprocessing (add_special_tokens) would send
        return ids

    def prompt_ids(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False,
                                                  add_generation_prompt=True)
        return self._ids(text)

    def user_turn_prefix(self) -> list[int]:
        """The ids the template writes before a (first) user turn's content, system prompt included."""
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=False)
        if _MARK not in text:
            raise ConfigError("the chat template does not show the user's content; self_instruct cannot find a user turn",
                              "remove self_instruct from draft.data.sources")
        return self._ids(text.split(_MARK, 1)[0])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i != self.end_id], skip_special_tokens=True)


# ---------------------------------------------------------------- the journal (resume)


class Journal:
    """Finished generations, one JSON line each ({"key", "tokens", "reason"}), in the work folder."""

    def __init__(self, path: Path):
        self.path = path
        self.done: dict[str, dict] = {}
        good = []
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    self.done[entry["key"]] = entry
                    good.append(line)
                except (ValueError, KeyError, TypeError):
                    break  # a line cut by the interruption, and anything after it
            path.write_text("".join(g + "\n" for g in good), encoding="utf-8")
        self._fh = open(path, "a", encoding="utf-8")

    def add(self, key: str, tokens: list[int], reason: str) -> None:
        entry = {"key": key, "tokens": tokens, "reason": reason}
        self._fh.write(json.dumps(entry) + "\n")
        self._fh.flush()
        self.done[key] = entry

    def close(self) -> None:
        self._fh.close()


# ---------------------------------------------------------------- generation


@dataclass
class Job:
    key: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float | None  # None: greedy
    seed: int


class Generator:
    """Runs jobs through a BatchScheduler over the target engine; journals each finished one; shows progress."""

    def __init__(self, scheduler, end_id: int, journal: Journal, echo, on_sample: Callable[[str], None] | None):
        self.scheduler = scheduler
        self.end_id = end_id
        self.journal = journal
        self.echo = echo
        self.on_sample = on_sample
        self.tokens = 0  # answer tokens of the generations journaled in this run
        self.live_tokens = 0  # tokens generated in this run so far, unfinished generations included
        self.busy_s = 0.0
        self._lock = threading.Lock()

    def _one(self, job: Job):
        from specdeploy.engine.request import GenerationRequest
        from specdeploy.speculative import GREEDY, SamplingParams

        # top_p 1.0: sampled from the whole distribution; TensorRT-LLM (and the CPU engine) decode greedily when
        # neither top_k nor top_p is set, whatever the temperature (specdeploy.speculative.is_greedy)
        sampling = GREEDY if job.temperature is None else SamplingParams(temperature=job.temperature, top_p=1.0, seed=job.seed)
        request = GenerationRequest(input_ids=job.input_ids, max_new_tokens=job.max_new_tokens, sampling=sampling, end_id=self.end_id,
                                    streaming=True)  # streamed: the progress line counts tokens as they come
        tokens: list[int] = []
        reason = None
        for chunk in self.scheduler.generate(request):
            tokens.extend(chunk.token_ids)
            with self._lock:
                self.live_tokens += len(chunk.token_ids)
            reason = chunk.finish_reason
        return job, tokens, reason

    def run(self, jobs: list[Job], label: str, total: int, done_before: int) -> None:
        """Generate every job not in the journal yet; `total` and `done_before` (jobs done before `jobs`) are for the
        progress line."""
        todo = [j for j in jobs if j.key not in self.journal.done]
        if not todo:
            return
        start = time.monotonic()
        tokens0 = self.live_tokens
        done = done_before + len(jobs) - len(todo)
        last_print = 0.0
        workers = self.scheduler.max_batch_size
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="draft-data")
        try:
            futures = [pool.submit(self._one, j) for j in todo]
            for future in as_completed(futures):
                job, tokens, reason = future.result()
                self.journal.add(job.key, tokens, reason)
                self.tokens += len(tokens)
                done += 1
                if self.on_sample is not None:
                    self.on_sample(job.key)
                now = time.monotonic()
                if now - last_print >= 5.0 or done == total:
                    last_print = now
                    elapsed = now - start
                    rate = (self.live_tokens - tokens0) / elapsed if elapsed else 0.0
                    per_job = elapsed / (done - done_before)
                    eta = per_job * (total - done)
                    self.echo(f"{label}: {done}/{total}, {rate:.1f} tokens/s, ETA {_duration(eta)}")
        except BaseException:
            for f in futures if "futures" in locals() else []:
                f.cancel()
            raise
        finally:
            self.busy_s += time.monotonic() - start
            pool.shutdown(wait=False, cancel_futures=True)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def self_instruct_prompts(gen: Generator, chat: ChatFormat, collector: _Collector, quota: int, seed: int, temperature: float,
                          max_seq_len: int) -> int:
    """Ask the target for user turns until `quota` are accepted (or the attempts run out); returns how many were kept."""
    prefix = chat.user_turn_prefix()
    max_new = min(SELF_INSTRUCT_MAX_TOKENS, max_seq_len - len(prefix))
    kept, index, limit = 0, 0, SELF_INSTRUCT_ATTEMPTS * quota + 8
    temperature = temperature if temperature > 0 else 1.0  # a greedy user turn would be the same every time
    while kept < quota and index < limit:
        wave = min(limit - index, max(8, 2 * (quota - kept)))
        jobs = [Job(f"self_instruct-{i}", prefix, max_new, temperature, _seed(seed, "self_instruct", i)) for i in range(index, index + wave)]
        gen.run(jobs, "draft data: self-instruct user turns", index + wave, index)
        for job in jobs:  # in index order: the result does not depend on the order generations finished in
            index += 1
            entry = gen.journal.done[job.key]
            text = chat.decode(entry["tokens"]).strip()
            if entry["reason"] != "end_id" or len(text.split()) < SELF_INSTRUCT_MIN_WORDS:
                continue
            if collector.offer(PromptSpec(job.key, "self_instruct", (("user", text),))):
                kept += 1
                if kept == quota:
                    break
    return kept


# ---------------------------------------------------------------- the stage


def data_fingerprint(recipe: Recipe, target_manifest, validation: dict[str, str]) -> str:
    data = recipe.draft.data
    files = {p: artifacts.file_hash(Path(p)) for p in [*data.sources, *data.text_files] if p not in NAMED_SOURCES}
    return artifacts.fingerprint(
        stage=STAGE,
        target=target_manifest.fingerprint,
        data=asdict(data),
        text_chunk=recipe.draft.train.seq_len,
        files=files,
        calibration=artifacts.file_hash(CALIBRATION_FILE),
        validation=sorted(validation),
        heldout_percent=HELDOUT_PERCENT,
        version=1,
    )


def work_dir(layout) -> Path:
    dest = layout.draft_data
    return dest.parent / f".{dest.name}{WORK_SUFFIX}"


def make_draft_data(recipe: Recipe, layout, recipe_path: str = "RECIPE", force: bool = False, echo=None,
                    on_sample: Callable[[str], None] | None = None) -> Path:
    """Write Layout.draft_data for `recipe` (see the module docstring); returns it. `on_sample(key)` is called
    after each generation is journaled (tests interrupt the run there)."""
    from specdeploy.engine.batching import BatchScheduler
    from specdeploy.engine.executor import Executor
    from specdeploy.generate import load_engine, load_tokenizer

    echo = echo or (lambda message: print(message, file=sys.stderr, flush=True))
    rerun = RERUN.format(recipe=recipe_path)
    check_sources(recipe)
    data = recipe.draft.data
    target_dir = layout.engine("target")
    try:
        target_manifest = artifacts.require(target_dir, stage="build", rerun=f"specdeploy build {recipe_path}")
    except StaleArtifactError as exc:
        raise StaleArtifactError(f"no built target engine at {target_dir}: `draft data` answers prompts with it",
                                 f"run: specdeploy quantize {recipe_path} && specdeploy build {recipe_path}") from exc
    validation = validation_prompts(recipe)
    file_lists = {s: file_prompts(s, data.seed, validation) for s in data.sources if s not in NAMED_SOURCES}  # refuses early
    fp = data_fingerprint(recipe, target_manifest, validation)
    dest = layout.draft_data
    if not force and artifacts.is_up_to_date(dest, fp):
        echo(f"draft data: up to date ({dest})")
        return dest

    work = work_dir(layout)
    stamp = work / "fingerprint"
    if force or not stamp.is_file() or stamp.read_text().strip() != fp:
        if work.exists():
            echo(f"draft data: starting over ({'--force' if force else 'inputs or settings changed since the interrupted run'})")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        stamp.write_text(fp + "\n")
    journal = Journal(work / "journal.jsonl")
    if journal.done:
        echo(f"draft data: resuming from {work} ({len(journal.done)} generations already done)")

    tokenizer = load_tokenizer(target_dir, recipe.target.model)
    chat = ChatFormat(tokenizer)
    engine_box: dict = {}

    in_flight = data.batch_size or recipe.engine.max_batch_size

    def load():
        engine = load_engine(target_dir, "target", recipe_path)
        engine_box["max_seq_len"] = int(engine.spec.max_seq_len)
        return Executor(engine, max_cached_sequences=in_flight + 1)

    started = time.monotonic()
    scheduler = BatchScheduler.loading(load, in_flight)
    try:
        max_seq_len = engine_box["max_seq_len"]
        gen = Generator(scheduler, chat.end_id, journal, echo, on_sample)
        # ---- prompts
        collector = _Collector(validation)
        quotas = _quotas(data.sources, data.num_prompts) if data.sources else {}
        short = 0
        pools = {}
        for source in data.sources:  # the fixed sources first, each up to its quota
            if source == "self_instruct":
                continue
            pools[source] = iter(calibration_prompts(data.seed) if source == "calibration" else file_lists[source])
            kept = 0
            for prompt in pools[source] if quotas[source] else ():
                kept += collector.offer(prompt)
                if kept == quotas[source]:
                    break
            short += quotas[source] - kept
        for source, pool in pools.items():  # what a source lacked comes from the others' remaining prompts, in order,
            for prompt in pool:  # then from self_instruct
                if short == 0:
                    break
                short -= collector.offer(prompt)
        if "self_instruct" in data.sources:
            quotas["self_instruct"] += short
            kept = self_instruct_prompts(gen, chat, collector, quotas["self_instruct"], data.seed, data.temperature, max_seq_len)
            if kept < quotas["self_instruct"]:
                echo(f"draft data: the target wrote {kept} usable user turns of {quotas['self_instruct']} wanted "
                     f"(the others did not end within {SELF_INSTRUCT_MAX_TOKENS} tokens, were trivial or repeated)")
        # ---- answers
        jobs, plan, too_long = [], [], 0
        for prompt in collector.prompts:
            ids = chat.prompt_ids(prompt.messages)
            max_new = min(data.max_new_tokens, max_seq_len - len(ids))
            if max_new < min(MIN_ANSWER_TOKENS, data.max_new_tokens):
                too_long += 1
                continue
            plan.append((prompt, ids))
            for k in range(data.samples_per_prompt):
                jobs.append(Job(f"{prompt.id}/{k}", ids, max_new, None if k == 0 else data.temperature, _seed(data.seed, prompt.id, k)))
        gen.run(jobs, "draft data: samples", len(jobs), 0)
    finally:
        scheduler.close()
        journal.close()

    # ---- the output
    records: list[tuple[bool, dict]] = []  # (held out, record)
    for prompt, ids in plan:
        for k in range(data.samples_per_prompt):
            entry = journal.done[f"{prompt.id}/{k}"]
            records.append((prompt.key, {"id": f"{prompt.id}/{k}", "source": prompt.source, "input_ids": ids + entry["tokens"],
                                         "loss_start": len(ids), "sampled": k > 0}))
    for path in data.text_files:
        for i, chunk in enumerate(_text_chunks(tokenizer, Path(path), min(recipe.draft.train.seq_len, max_seq_len))):
            records.append((f"{path}#{i}", {"id": f"text-{_seed(str(path)) % 10**6}-{i}", "source": "text", "input_ids": chunk,
                                            "loss_start": 0, "sampled": False}))
    keys = list(dict.fromkeys(key for key, _ in records))
    held = {key for key in keys if is_heldout(key)}
    if not held and len(keys) >= 2:  # a small set still holds one prompt out: the one with the lowest hash bucket
        held = {min(keys, key=lambda key: (_hash_bucket(key), key))}
    stats = _stats(records, held, collector, too_long)
    elapsed = time.monotonic() - started
    with artifacts.atomic_output(dest) as tmp:
        with open(tmp / "train.jsonl", "w", encoding="utf-8") as train, open(tmp / "heldout.jsonl", "w", encoding="utf-8") as heldout:
            for key, record in records:
                (heldout if key in held else train).write(json.dumps(record) + "\n")
        artifacts.Manifest(
            stage=STAGE,
            recipe_name=recipe.name,
            fingerprint=fp,
            settings={"data": asdict(data), "heldout_percent": HELDOUT_PERCENT, "max_batch_size": in_flight,
                      "text_chunk_tokens": min(recipe.draft.train.seq_len, max_seq_len)},
            inputs={"target_engine": str(target_dir), "target_engine_fingerprint": target_manifest.fingerprint,
                    "files": [p for p in [*data.sources, *data.text_files] if p not in NAMED_SOURCES]},
            tool_versions=artifacts.tool_versions("torch", "transformers"),
            extra={**stats, "seed": data.seed,
                   "validation_excluded": "the validation prompt sets (specdeploy/data/prompts/*.jsonl and validation.prompt_set) "
                                          "were excluded: prompt files holding one are refused, equal generated prompts dropped",
                   "answer_tokens_this_run": gen.tokens,
                   "tokens_per_s": round(gen.tokens / gen.busy_s, 2) if gen.busy_s else None,
                   "wall_s_this_run": round(elapsed, 1)},
        ).write(tmp)
    shutil.rmtree(work, ignore_errors=True)
    echo(f"draft data: wrote {dest} ({stats['train']['samples']} train, {stats['heldout']['samples']} held-out samples, "
         f"{stats['total']['tokens']} tokens; {gen.tokens} answer tokens this run"
         + (f", {gen.tokens / gen.busy_s:.1f} tokens/s)" if gen.busy_s else ")"))
    return dest


def _text_chunks(tokenizer, path: Path, size: int) -> list[list[int]]:
    ids = list(tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=True).input_ids)
    return [ids[i : i + size] for i in range(0, len(ids), size) if len(ids[i : i + size]) >= 2]


def _stats(records, held, collector: _Collector, too_long: int) -> dict:
    def count(subset) -> dict:
        by_source: dict[str, dict] = {}
        for key, record in subset:
            s = by_source.setdefault(record["source"], {"prompts": set(), "samples": 0, "tokens": 0, "answer_tokens": 0})
            s["prompts"].add(key)
            s["samples"] += 1
            s["tokens"] += len(record["input_ids"])
            s["answer_tokens"] += len(record["input_ids"]) - record["loss_start"]
        for s in by_source.values():
            s["prompts"] = len(s["prompts"])
        return {"samples": sum(s["samples"] for s in by_source.values()), "tokens": sum(s["tokens"] for s in by_source.values()),
                "prompts": sum(s["prompts"] for s in by_source.values()), "by_source": by_source}

    return {
        "total": count(records),
        "train": count([r for r in records if r[0] not in held]),
        "heldout": count([r for r in records if r[0] in held]),
        "dropped_validation_prompts": dict(collector.dropped_validation),
        "dropped_duplicate_prompts": dict(collector.dropped_duplicate),
        "dropped_too_long_prompts": too_long,
    }
