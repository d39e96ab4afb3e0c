"""The one boundary every request text crosses, on the OpenAI front and in the python-backend models alike.

A text is refused by one of four rules, each with a name both sides report (`TextError.rule`): `invalid_text` (a lone
surrogate in a JSON string, or bytes that are not UTF-8), `nul` (a U+0000 character), `oversize` (more bytes or more
strings than the field takes) and `too_deep` (a JSON value nested past MAX_DEPTH). The front turns a TextError into a
400 whose `code` is the rule; a Triton model into a Triton error that names the input and the rule. So the same
malformed value gets the same kind of refusal over gRPC and over HTTP.
"""

from __future__ import annotations

from typing import Any

INVALID_TEXT, NUL, OVERSIZE, TOO_DEEP = "invalid_text", "nul", "oversize", "too_deep"
RULES = (INVALID_TEXT, NUL, OVERSIZE, TOO_DEEP)

# A prompt as long as the front's whole body limit (openai_app.MAX_BODY_BYTES); far past any max_input_len in tokens,
# so it is refused before the tokenizer spends time on it.
MAX_PROMPT_BYTES = 1 << 20
MAX_SHORT_BYTES = 4096  # a stop or bad word, a model id, a role, a user tag: refused past this, never needed longer
MAX_STRINGS = 256  # strings in one list field (stop words, bad words, bias words, chat messages' parts)
MAX_DEPTH = 16  # JSON nesting of a request body; OpenAI's deepest field (messages[i].content[j].text) is 4 levels
# The fields whose text is a prompt, by the name each side gives them (front key, Triton input); any other is short.
PROMPT_FIELDS = frozenset({"prompt", "messages", "text_input", "QUERY", "decoder_text_input"})


class TextError(ValueError):
    """A request text refused by one of RULES; `field` is its path in the body or the Triton input's name."""

    def __init__(self, field: str, rule: str, detail: str):
        super().__init__(f"{field} {detail} (rule {rule})")
        self.field, self.rule, self.detail = field, rule, detail

    @property
    def root(self) -> str:
        """The top-level field: 'messages' for messages[0].content."""
        return self.field.split("[", 1)[0].split(".", 1)[0]


def limit_of(field: str) -> int:
    root = field.split("[", 1)[0].split(".", 1)[0]
    return MAX_PROMPT_BYTES if root in PROMPT_FIELDS else MAX_SHORT_BYTES


def check_text(text: str, field: str, limit: int | None = None) -> str:
    """`text` (a JSON string) when it has a UTF-8 form, no NUL and at most `limit` bytes (default: limit_of(field))."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:  # only a lone surrogate ("\ud800" in JSON) has no UTF-8 form
        detail = f"is not valid Unicode text (a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start})"
        raise TextError(field, INVALID_TEXT, f"{detail}; send UTF-8 text") from None
    _check_size(size, field, limit)
    if "\x00" in text:
        raise TextError(field, NUL, f"holds a NUL character (U+0000) at character {text.index(chr(0))}; remove it")
    return text


def decode_text(raw: bytes, field: str, limit: int | None = None) -> str:
    """A string tensor's element (or a body's bytes) as text, by the same rules as check_text."""
    _check_size(len(raw), field, limit)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:  # also the surrogates' own bytes (b"\xed\xa0\x80"): UTF-8 has no form for them
        raise TextError(
            field,
            INVALID_TEXT,
            f"is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}); send UTF-8 text",
        ) from None
    return check_text(text, field, limit)


def check_count(count: int, field: str) -> None:
    if count > MAX_STRINGS:
        raise TextError(field, OVERSIZE, f"holds {count} strings, above the limit of {MAX_STRINGS}; send fewer")


def check_json(value: Any, field: str = "", depth: int = 0) -> None:
    """Every string of a parsed JSON body (keys too) by check_text, every list's length and the nesting depth."""
    if depth > MAX_DEPTH:
        raise TextError(field or "body", TOO_DEEP, f"nests JSON more than {MAX_DEPTH} levels deep; flatten it")
    if isinstance(value, str):
        check_text(value, field or "body")
    elif isinstance(value, dict):
        for key, item in value.items():
            path = f"{field}.{_printable(key)}" if field else _printable(key)
            check_text(key, path)  # the key itself, named by its path
            check_json(item, path, depth + 1)
    elif isinstance(value, list):
        if len(value) > MAX_STRINGS and any(isinstance(v, str) for v in value):
            check_count(len(value), field or "body")
        for i, item in enumerate(value):
            check_json(item, f"{field}[{i}]", depth + 1)


def _printable(key: str) -> str:
    """A key as a path may show it: escaped where it is itself not valid text (the error message must encode)."""
    return key if key.isprintable() else ascii(key)[1:-1]  # escaped: a lone surrogate or NUL is not printable


def _check_size(size: int, field: str, limit: int | None) -> None:
    limit = limit_of(field) if limit is None else limit
    if size > limit:
        raise TextError(
            field, OVERSIZE, f"is {size} bytes, above the limit of {limit} bytes for this field; shorten it"
        )
