"""Where the prompts of an EAGLE-3 head's training data come from (draft.data.sources): the shipped calibration
passages inside a few instruction templates, prompt files (.jsonl or .txt), user turns the target writes itself
(self_instruct), and real user turns with their earlier turns (sharegpt: the train split of
specdeploy.core.sharegpt). The validation prompt sets are never used: a prompt file or text file holding one of their
prompts is refused, a calibration or self-instruct prompt holding one is dropped (`PromptCollector` counts both).
"Holding" is `ValidationScreen`'s rule: the validation prompt's text inside any message of the prompt, after Unicode
(NFKC), invisible-character, case and whitespace folding, not only a prompt equal to it: a calibration passage held
the whole of a built-in code prompt and its continuation, and was trained on while exact matching let it through.

ShareGPT's held-out conversations (`sharegpt.HELDOUT_RULE`) are kept out the same way wherever the wheel is
installed: a prompt or text file holding one of their user turns is refused (file, line and rule named), any other
prompt holding one is dropped and counted (ShareGPT repeats some requests under several ids)."""

from __future__ import annotations

import hashlib
import json
import random
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specdeploy.core import sharegpt
from specdeploy.core.errors import ConfigError
from specdeploy.eagle3.generation import ChatFormat, Generator, Job
from specdeploy.recipe.config import Recipe

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
CALIBRATION_FILE = DATA_DIR / "calib" / "calibration.jsonl"
VALIDATION_DIR = DATA_DIR / "prompts"
NAMED_SOURCES = ("calibration", "self_instruct", "sharegpt")
PROMPT_FILE_SUFFIXES = (".jsonl", ".txt")

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


def normalize(text: str) -> str:
    """The form prompts are compared in (dedupe, validation exclusion): case and whitespace folded."""
    return " ".join(text.lower().split())


# characters left out before looking for a validation prompt: zero-width spaces and joiners, word joiner, byte-order
# mark, soft hyphen (a prompt with one inside reads the same)
_INVISIBLE = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff\u00ad"), None)
MIN_CONTAINED_CHARS = (
    24  # a validation prompt shorter than this (folded) is matched whole only, not inside a longer text
)


def screen_text(text: str) -> str:
    """The form validation prompts are looked for in: NFKC (full-width, ligatures, non-breaking spaces), invisible
    characters dropped, then `normalize` (case and whitespace)."""
    return normalize(unicodedata.normalize("NFKC", text).translate(_INVISIBLE))


class ValidationScreen:
    """Finds a validation prompt inside a training text (`find`: the validation file it comes from, or None)."""

    def __init__(self, validation: dict[str, str]):
        self.prompts = {screen_text(text): path for text, path in validation.items()}

    def find(self, text: str, *whole: str) -> str | None:
        """The validation file of a prompt inside `text` (or equal to it), or equal to one of `whole` (a request's
        user turns joined, each message alone: a short validation prompt is matched whole, and a request holds it
        whole in one of those); None."""
        folded = screen_text(text)
        wholes = {folded, *(screen_text(w) for w in whole)}
        for prompt, path in self.prompts.items():
            if prompt in wholes or (len(prompt) >= MIN_CONTAINED_CHARS and prompt in folded):
                return path
        return None

    def find_in(self, prompt: "PromptSpec") -> str | None:
        """`find` over a training request: all its messages, its user turns joined, each message alone."""
        return self.find(
            prompt.text, " ".join(c for r, c in prompt.messages if r == "user"), *(c for _, c in prompt.messages)
        )


def derived_seed(*parts) -> int:
    """A seed of its own for one draw (a source's order, a generation), from the run's seed and what names the draw."""
    return int.from_bytes(hashlib.sha256(json.dumps(parts).encode()).digest()[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


# ---------------------------------------------------------------- prompts


@dataclass(frozen=True)
class PromptSpec:
    """One prompt of the plan: `messages` as (role, content) pairs, the last one the user's."""

    id: str
    source: str  # "calibration" | "self_instruct" | "sharegpt" | "file"
    messages: tuple[tuple[str, str], ...]
    # what the prompt is held out with: prompts sharing a text (a calibration passage in its five requests) go to
    # the same side, or a held-out request would be judged on a passage the head learned by heart; "": the prompt
    group_text: str = ""
    # the assistant turn that answered it in its source (sharegpt), which draft.data.scored_share may score in place
    # of the target's answers; "" for the other sources
    reply: str = ""

    @property
    def key(self) -> str:
        """The normalized text the prompt is compared by."""
        return normalize(" ".join(content for role, content in self.messages if role == "user"))

    @property
    def text(self) -> str:
        """Every message's content and the reply (what is screened for validation prompts: a system message or a
        scored reply may hold one too)."""
        return "\n".join([*(content for _, content in self.messages), *([self.reply] if self.reply else [])])

    @property
    def group(self) -> str:
        """The normalized text the prompt is held out by (draft_data.is_heldout)."""
        return normalize(self.group_text) if self.group_text else self.key


def validation_prompts(recipe: Recipe) -> dict[str, str]:
    """normalized user text -> file, for every prompt of the built-in validation sets and of the recipe's own."""
    files = sorted(VALIDATION_DIR.glob("*.jsonl"))
    if recipe.validation.prompt_set != "builtin" and sharegpt.prompt_set_seed(recipe.validation.prompt_set) is None:
        files.append(Path(recipe.validation.prompt_set))
    found: dict[str, str] = {}
    for path in files:
        if not path.is_file():  # its prompts could not be kept out: refuse rather than train on them unknowingly
            raise ConfigError(
                f"validation.prompt_set {path} not found (relative paths are from the current directory, {Path.cwd()})",
                "run from the folder validate runs from, or give validation.prompt_set as an absolute path",
            )
        for _, messages in _read_prompt_file(path):
            found.setdefault(normalize(" ".join(c for r, c in messages if r == "user")), str(path))
    return found


def _read_prompt_file(path: Path) -> list[tuple[int, tuple[tuple[str, str], ...]]]:
    """(line number, messages) of a .jsonl ({"prompt"} or {"messages"}) or .txt (one prompt per line) file."""
    if not path.is_file():
        raise ConfigError(
            f"prompt file {path} not found",
            "fix the path in draft.data.sources (relative paths are from the current directory)",
        )
    out = []
    for lineno, line in enumerate(read_utf8(path, "prompt file").splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            out.append((lineno, (("user", line.strip()),)))
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ConfigError(
                f"{where} is not valid JSON: {exc}", 'one object per line, e.g. {"prompt": "Hello"}'
            ) from exc
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
            out.append((lineno, (("user", obj["prompt"]),)))
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"]:
            try:
                messages = tuple((str(m["role"]), str(m["content"])) for m in obj["messages"])
            except (TypeError, KeyError) as exc:
                raise ConfigError(
                    f"{where}: every message needs 'role' and 'content'",
                    'e.g. {"messages": [{"role": "user", "content": "Hi"}]}',
                ) from exc
            if messages[-1][0] != "user":
                raise ConfigError(
                    f"{where}: the last message is not the user's",
                    "end the conversation with a user message: the target answers it",
                )
            out.append((lineno, messages))
        else:
            raise ConfigError(f"{where} has neither a non-empty 'prompt' nor 'messages'", 'e.g. {"prompt": "Hello"}')
    return out


def check_sources(recipe: Recipe) -> None:
    """Refuse an unknown source or a missing file before any work."""
    data = recipe.draft.data
    if not recipe.draft.is_eagle3:
        raise ConfigError(
            f"draft.kind is {recipe.draft.kind}: `draft data` makes the training set of an EAGLE-3 head",
            "set draft.kind: eagle3 (with draft.head) in the recipe",
        )
    if not data.sources and not data.text_files:
        raise ConfigError(
            "draft.data.sources and draft.data.text_files are both empty",
            'e.g. sources: ["calibration", "self_instruct"]',
        )
    for source in data.sources:
        if source == sharegpt.NAME and not sharegpt.installed():
            raise ConfigError(
                "draft.data source 'sharegpt' needs the ShareGPT data set, which is not installed",
                sharegpt.INSTALL_HINT,
            )
        if source in NAMED_SOURCES:
            continue
        if Path(source).suffix not in PROMPT_FILE_SUFFIXES:
            raise ConfigError(
                f"unknown draft.data source {source!r}",
                f"use {', '.join(NAMED_SOURCES)}, or a path to a .jsonl or .txt prompt file",
            )
        if not Path(source).is_file():
            raise ConfigError(
                f"prompt file {source} (draft.data.sources) not found",
                "fix the path (relative paths are from the current directory)",
            )
    for path in data.text_files:
        if not Path(path).is_file():
            raise ConfigError(f"text file {path} (draft.data.text_files) not found", "fix the path, or remove it")


def check_text_files(
    paths: Sequence[str], validation: dict[str, str], heldout: "sharegpt.HeldoutScreen | None" = None
) -> None:
    """Refuse a text file (draft.data.text_files: scored from its first token) that holds a validation prompt or a
    held-out ShareGPT conversation."""
    screen = ValidationScreen(validation)
    for path in paths:
        text = read_utf8(Path(path), "text file")
        found = screen.find(text)
        if found is not None:
            raise ConfigError(
                f"text file {path} (draft.data.text_files) holds a validation prompt ({found})",
                "remove the validation prompts from the training texts: a draft trained on them makes validation"
                " measure memory",
            )
        held = heldout.find_line(text) if heldout else None
        if held is not None:
            raise heldout_error(f"text file {path} (draft.data.text_files)", held[0], held[1])


def heldout_screen() -> "sharegpt.HeldoutScreen | None":
    """The screen for ShareGPT's held-out conversations where the wheel is installed; None where it is not (no file
    on the machine could then have come from it through specdeploy)."""
    return sharegpt.HeldoutScreen(sharegpt.load(), screen_text) if sharegpt.installed() else None


def heldout_error(where: str, lineno: int, conversation_id: str) -> ConfigError:
    return ConfigError(
        f"{where} line {lineno} holds a user turn of the held-out ShareGPT conversation "
        f"{conversation_id} ({sharegpt.HELDOUT_RULE})",
        "remove that conversation from the file: the held-out split measures heads on what they never saw",
    )


def read_utf8(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # a byte-order mark is no content
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what} {path} is not UTF-8 text (byte {exc.start}: {exc.reason})", "save it as UTF-8"
        ) from None


def source_quotas(sources: Sequence[str], total: int) -> dict[str, int]:
    base, extra = divmod(total, len(sources))
    return {s: base + (1 if i < extra else 0) for i, s in enumerate(sources)}


class PromptCollector:
    """Accepts prompts in order: drops duplicates and validation prompts (counted per source)."""

    def __init__(self, validation: dict[str, str], heldout: "sharegpt.HeldoutScreen | None" = None):
        self.validation = validation
        self.screen = ValidationScreen(validation)
        self.heldout = heldout
        self.dropped_heldout: dict[str, int] = {}
        self.seen: set[str] = set()
        self.prompts: list[PromptSpec] = []
        self.dropped_validation: dict[str, int] = {}
        self.dropped_duplicate: dict[str, int] = {}

    def offer(self, prompt: PromptSpec) -> bool:
        key = prompt.key
        if self.screen.find_in(prompt) is not None:
            self.dropped_validation[prompt.source] = self.dropped_validation.get(prompt.source, 0) + 1
            return False
        if self.heldout is not None and any(self.heldout.find(c) for r, c in prompt.messages if r == "user"):
            self.dropped_heldout[prompt.source] = self.dropped_heldout.get(prompt.source, 0) + 1
            return False
        if key in self.seen:
            self.dropped_duplicate[prompt.source] = self.dropped_duplicate.get(prompt.source, 0) + 1
            return False
        self.seen.add(key)
        self.prompts.append(prompt)
        return True


def calibration_prompts(seed: int) -> list[PromptSpec]:
    """Every (passage, template) pair, in the seed's order."""
    passages = [
        json.loads(line)["text"] for line in CALIBRATION_FILE.read_text(encoding="utf-8").splitlines() if line.strip()
    ]
    pairs = [(p, t) for p in range(len(passages)) for t in range(len(CALIBRATION_TEMPLATES))]
    random.Random(derived_seed(seed, "calibration")).shuffle(pairs)
    return [
        PromptSpec(
            f"calibration-{p}-{t}",
            "calibration",
            (("user", CALIBRATION_TEMPLATES[t].format(text=passages[p])),),
            group_text=passages[p],
        )
        for p, t in pairs
    ]


def file_prompts(
    path: str, seed: int, validation: dict[str, str], heldout: "sharegpt.HeldoutScreen | None" = None
) -> list[PromptSpec]:
    """A prompt file's prompts in the seed's order; a validation prompt or a held-out ShareGPT conversation in it is
    refused."""
    prompts = []
    screen = ValidationScreen(validation)
    for lineno, messages in _read_prompt_file(Path(path)):
        prompt = PromptSpec(f"file-{derived_seed(str(path)) % 10**6}-{lineno}", "file", messages)
        found = screen.find_in(prompt)
        if found is not None:
            user = next(c for r, c in reversed(messages) if r == "user")
            raise ConfigError(
                f"prompt file {path} line {lineno} holds a validation prompt ({found}): {user[:80]!r}",
                "remove the validation prompts from the training prompts: a draft trained on them makes validation"
                " measure memory",
            )
        held = next((h for r, c in messages if r == "user" and heldout and (h := heldout.find(c))), None)
        if held is not None:
            raise heldout_error(f"prompt file {path}", lineno, held)
        prompts.append(prompt)
    if not prompts:
        raise ConfigError(
            f"prompt file {path} (draft.data.sources) holds no prompts",
            'write one prompt a line (.txt) or one {"prompt": ...} object a line (.jsonl), or remove it from the'
            " sources",
        )
    random.Random(derived_seed(seed, "file", str(path))).shuffle(prompts)
    return prompts


def sharegpt_prompts(seed: int) -> list[PromptSpec]:
    """The train split's user turns with their earlier turns (English), conversations in the seed's order and each
    conversation's turns in order; grouped by conversation, so its turns go to the same side of draft data's own
    held-out share."""
    conversations = [c for c in sharegpt.load().conversations if not sharegpt.is_heldout(c.id) and sharegpt.english(c)]
    random.Random(derived_seed(seed, "sharegpt")).shuffle(conversations)
    return [
        PromptSpec(
            f"sharegpt-{c.id}-{turn}",
            "sharegpt",
            messages,
            group_text=f"sharegpt {c.id}",
            reply=sharegpt.reply_to(c, turn),
        )
        for c in conversations
        for turn, messages in sharegpt.user_prompts(c)
    ]


def self_instruct_prompts(
    gen: Generator,
    chat: ChatFormat,
    collector: PromptCollector,
    quota: int,
    seed: int,
    temperature: float,
    max_seq_len: int,
) -> int:
    """Ask the target for user turns until `quota` are accepted (or the attempts run out); returns how many were
    kept."""
    prefix = chat.user_turn_prefix()
    max_new = min(SELF_INSTRUCT_MAX_TOKENS, max_seq_len - len(prefix))
    kept, index, limit = 0, 0, SELF_INSTRUCT_ATTEMPTS * quota + 8
    temperature = temperature if temperature > 0 else 1.0  # a greedy user turn would be the same every time
    while kept < quota and index < limit:
        wave = min(limit - index, max(8, 2 * (quota - kept)))
        jobs = [
            Job(f"self_instruct-{i}", prefix, max_new, temperature, derived_seed(seed, "self_instruct", i))
            for i in range(index, index + wave)
        ]
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
