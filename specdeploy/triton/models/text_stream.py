"""Detokenizing a stream: text sent as it comes, never a broken character.

`TextStream` (the BLS: each round's new text, a trailing partial UTF-8 character held back), `HoldBack` (the engine
model: tokens held until they complete text) and `chunk_decoding_problem` (whether decoding such chunks one by one
equals decoding the whole output, for a tokenizer).
"""

from __future__ import annotations

from typing import Sequence


class TextStream:
    """Incremental detokenization: the text of all tokens so far, sent as the new suffix each time.

    A trailing partial UTF-8 character decodes to U+FFFD; it is held back until the next token
    completes it, so the concatenated deltas equal the decoding of the whole output.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool, prefix_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prefix_ids)
        self.sent = len(self._decode())

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        text = self._decode()
        stable = len(text.rstrip("\ufffd"))
        delta = text[self.sent : stable] if stable > self.sent else ""
        self.sent = max(self.sent, stable)
        return delta

    def flush(self) -> str:
        text = self._decode()
        delta = text[self.sent :]
        self.sent = len(text)
        return delta


# ---------------------------------------------------------------- streaming whole characters


def chunk_decoding_problem(tokenizer) -> str | None:
    """Why decoding streamed chunks of whole characters one by one could differ from decoding the
    whole output, or None when it cannot: a byte-level BPE decoder maps each token to its bytes, so
    decoding is concatenative over chunks that hold complete UTF-8 characters. SentencePiece-style
    decoders (Metaspace, Strip) drop a chunk's leading space, and `clean_up_tokenization_spaces`
    rewrites text across chunk boundaries."""
    import json

    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return "the tokenizer sets clean_up_tokenization_spaces (it rewrites spaces across chunk boundaries)"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "the tokenizer has no fast (tokenizers) backend"
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        return (
            f"its decoder is {decoder.get('type') or 'none'}, not ByteLevel (a chunk decoded alone can lose its leading"
            " space)"
        )
    return None


class HoldBack:
    """Which streamed tokens may be sent now: tokens are held until they complete text.

    tokenizers' incremental detokenizer (`DecodeStream`) says when the tokens so far end on a whole
    character; only then are the held tokens released, so each streamed response decodes to whole
    characters and the concatenated text equals the decoding of the whole output (for a tokenizer
    without a `chunk_decoding_problem`). `flush` releases what is left at the end of the request.
    """

    def __init__(self, backend_tokenizer, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self._tokenizer = backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []

    def push(self, ids: Sequence[int]) -> list[int]:
        ready: list[int] = []
        for token in ids:
            self._held.append(int(token))
            if self._stream.step(self._tokenizer, int(token)) is not None:
                ready, self._held = ready + self._held, []
        return ready

    @property
    def pending(self) -> int:
        """Tokens held back (they do not complete text yet)."""
        return len(self._held)

    def flush(self) -> list[int]:
        out, self._held = self._held, []
        return out
