"""The target's Hugging Face tokenizer as the `TokenCodec` a validation run encodes and decodes with."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from specdeploy.client.prompts import HFChatTemplate
from specdeploy.core.errors import ConfigError


class HFCodec:
    """The target's Hugging Face tokenizer (encode without special tokens, decode skipping them)."""

    def __init__(self, tokenizer_dir: str | Path):
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        except (OSError, ValueError) as exc:  # no such directory / repository, or no tokenizer files in it
            raise ConfigError(
                f"cannot load a tokenizer from {str(tokenizer_dir)!r}: {str(exc).splitlines()[0][:300]}",
                "pass --tokenizer a directory with tokenizer.json / tokenizer_config.json (the target model's), "
                "or a Hugging Face model name already in the local cache",
            ) from None

    def chat_renderer(self):
        # The repository's preprocessing encodes with add_special_tokens (NVIDIA's default).
        return HFChatTemplate(self.tokenizer) if HFChatTemplate.available(self.tokenizer) else None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def prompt_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=True).input_ids)
