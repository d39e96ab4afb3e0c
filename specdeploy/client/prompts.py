"""Prompt sets for validation: the built-in sets (chat, code, summarization, reasoning) or a user .jsonl.

A .jsonl file has one object per line: `prompt` (required), optional `category` (default
"custom") and `max_tokens` (default: the recipe's `validation.max_tokens`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdeploy.errors import ConfigError

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "data" / "prompts"
BUILTIN_CATEGORIES = ("chat", "code", "summarization", "reasoning")
DEFAULT_CATEGORY = "custom"


@dataclass(frozen=True)
class Prompt:
    id: str  # "<category>-<index>", stable across runs
    text: str
    category: str
    max_tokens: int


def load_prompt_set(prompt_set: str, default_max_tokens: int, max_prompts: int = 0) -> list[Prompt]:
    """The prompts of `prompt_set` ("builtin" or a .jsonl path), at most `max_prompts` (0: all).

    When limited, prompts are taken round-robin over the categories so that every category stays
    represented.
    """
    if prompt_set == "builtin":
        prompts = [p for c in BUILTIN_CATEGORIES for p in _read_jsonl(BUILTIN_DIR / f"{c}.jsonl", default_max_tokens)]
    else:
        prompts = _read_jsonl(Path(prompt_set), default_max_tokens)
    if not prompts:
        raise ConfigError(f"prompt set {prompt_set} holds no prompts", "add lines like {\"prompt\": \"...\"}")
    return _round_robin(prompts, max_prompts) if max_prompts > 0 else prompts


def categories(prompts: list[Prompt]) -> list[str]:
    return list(dict.fromkeys(p.category for p in prompts))


def _read_jsonl(path: Path, default_max_tokens: int) -> list[Prompt]:
    if not path.is_file():
        raise ConfigError(f"prompt file {path} not found", "set validation.prompt_set to 'builtin' or a .jsonl path")
    prompts: list[Prompt] = []
    counters: dict[str, int] = {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{where} is not valid JSON: {exc}", "one JSON object per line") from exc
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise ConfigError(f"{where} needs a non-empty string 'prompt'", 'e.g. {"prompt": "Hello", "category": "chat"}')
        unknown = sorted(set(obj) - {"prompt", "category", "max_tokens"})
        if unknown:
            raise ConfigError(f"{where} has unknown key '{unknown[0]}'", "valid keys: prompt, category, max_tokens")
        category = obj.get("category", DEFAULT_CATEGORY)
        if not isinstance(category, str) or not category:
            raise ConfigError(f"{where}: 'category' must be a non-empty string")
        max_tokens = obj.get("max_tokens", default_max_tokens)
        if type(max_tokens) is not int or max_tokens < 1:
            raise ConfigError(f"{where}: 'max_tokens' must be a positive integer, got {max_tokens!r}")
        index = counters.get(category, 0)
        counters[category] = index + 1
        prompts.append(Prompt(f"{category}-{index}", obj["prompt"], category, max_tokens))
    return prompts


def _round_robin(prompts: list[Prompt], limit: int) -> list[Prompt]:
    by_category: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    chosen: list[Prompt] = []
    depth = 0
    while len(chosen) < min(limit, len(prompts)):
        for group in by_category.values():
            if depth < len(group) and len(chosen) < limit:
                chosen.append(group[depth])
        depth += 1
    return chosen
