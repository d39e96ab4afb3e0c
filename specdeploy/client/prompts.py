"""Prompt sets for validation: the built-in sets (chat, code, summarization, reasoning), real requests from the
ShareGPT validation half (`sharegpt` or `sharegpt:SEED`: specdeploy.core.sharegpt, one user turn per conversation with
its earlier turns, categories "first-turn" and "multi-turn") or a user .jsonl, rendered with the target's chat
template.

A .jsonl file has one object per line: either `prompt` (a user message) or `messages` (OpenAI-style
`[{"role": ..., "content": ...}, ...]`), optional `category` (default "custom") and `max_tokens`
(default: the recipe's `validation.max_tokens`).

An instruct model sent raw text without its chat template often ends at once (an empty answer that
"matches" trivially), so with `validation.chat_template: auto` every prompt is rendered with the
tokenizer's template (transformers' `apply_chat_template(..., tokenize=False,
add_generation_prompt=True)`) and sent as `text_input`. The server's preprocessing tokenizes with
`add_special_tokens` on, so a template that writes the BOS token itself would get a second one: the
renderer drops the template's leading BOS text exactly when the tokenizer would add it again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from specdeploy.core import sharegpt
from specdeploy.core.errors import ConfigError
from specdeploy.core.text_rules import TextError, check_json, decode_text

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "data" / "prompts"
BUILTIN_CATEGORIES = ("chat", "code", "summarization", "reasoning")
DEFAULT_CATEGORY = "custom"
SHAREGPT_PROMPTS = 64  # drawn when max_prompts is 0 (all): the validation half holds ~1,100 conversations
ROLES = ("system", "user", "assistant")

Message = tuple[str, str]  # (role, content)
ChatRenderer = Callable[[Sequence[Message]], str]


@dataclass(frozen=True)
class Prompt:
    id: str  # "<category>-<index>", stable across runs
    text: str  # what is sent as text_input (rendered with the chat template when one is used)
    category: str
    max_tokens: int
    messages: tuple[Message, ...] = ()  # the conversation `text` was rendered from; () when sent raw


def load_prompt_set(
    prompt_set: str, default_max_tokens: int, max_prompts: int = 0, fits: Callable[[Prompt], bool] | None = None
) -> list[Prompt]:
    """The prompts of `prompt_set` ("builtin", "sharegpt[-reported][:SEED]" or a .jsonl path), at most `max_prompts`
    (0: all), not yet rendered.

    When limited, prompts are taken round-robin over the categories so that every category stays
    represented. `fits` (a `PromptFit`): a drawn ShareGPT prompt it rejects is skipped before the set is cut, so
    another takes its place; a named set is taken as written (the caller refuses a prompt that does not fit).
    """
    seed = sharegpt.prompt_set_seed(prompt_set)
    if seed is not None:
        return _sharegpt_prompts(seed, default_max_tokens, max_prompts, sharegpt.prompt_set_split(prompt_set), fits)
    if prompt_set == "builtin":
        prompts = [p for c in BUILTIN_CATEGORIES for p in _read_jsonl(BUILTIN_DIR / f"{c}.jsonl", default_max_tokens)]
    else:
        prompts = _read_jsonl(Path(prompt_set), default_max_tokens)
    if not prompts:
        raise ConfigError(f"prompt set {prompt_set} holds no prompts", 'add lines like {"prompt": "..."}')
    return spread_over_categories(prompts, max_prompts) if max_prompts > 0 else prompts


def _sharegpt_prompts(
    seed: int, max_tokens: int, max_prompts: int, split: str, fits: Callable[[Prompt], bool] | None
) -> list[Prompt]:
    """Drawn per category (half first turns, half later turns with their context) from the validation half (or the
    reported one), those `fits` rejects left out."""
    count = max_prompts or SHAREGPT_PROMPTS
    drawn = sharegpt.validation_prompts(4 * count, seed, split=split)  # more than needed: categories cut to their share
    by_category: dict[str, list[Prompt]] = {"first-turn": [], "multi-turn": []}
    for conversation_turn, messages in drawn:
        category = "first-turn" if len(messages) == 1 else "multi-turn"
        group = by_category[category]
        # asked under the conversation's id ("<id>/<turn>"): a skipped prompt is named by where it comes from
        if fits is None or fits(Prompt(conversation_turn, "", category, max_tokens, messages)):
            group.append(Prompt(f"{category}-{len(group)}", "", category, max_tokens, messages))
    return spread_over_categories([p for group in by_category.values() for p in group], count)


def render_prompts(prompts: Sequence[Prompt], renderer: ChatRenderer | None) -> list[Prompt]:
    """Each prompt's `text` rendered from its messages by `renderer`; None: sent raw.

    A prompt given as `messages` has no raw form: without a renderer it is an error.
    """
    return [render_prompt(p, renderer) for p in prompts]


def render_prompt(p: Prompt, renderer: ChatRenderer | None) -> Prompt:
    if renderer is not None:
        return Prompt(p.id, renderer(p.messages), p.category, p.max_tokens, p.messages)
    if p.text:
        return Prompt(p.id, p.text, p.category, p.max_tokens)
    raise ConfigError(
        f"prompt {p.id} is given as 'messages', which need a chat template to become text",
        "set validation.chat_template: auto with a tokenizer that has a chat template, or give 'prompt' instead",
    )


class PromptFit:
    """Whether a prompt fits the deployment's `max_input_len`, counted as its server counts it (rendered by
    `renderer`, encoded with special tokens: `codec.prompt_tokens`); `skipped` holds (id, tokens) of those that did
    not, in the order asked. The server refuses a longer prompt, and a validation run stops at the first refusal."""

    def __init__(self, codec, renderer: ChatRenderer | None, max_input_len: int):
        self.codec, self.renderer, self.max_input_len = codec, renderer, max_input_len
        self.skipped: list[tuple[str, int]] = []

    def tokens(self, prompt: Prompt) -> int:
        return self.codec.prompt_tokens(render_prompt(prompt, self.renderer).text)

    def __call__(self, prompt: Prompt) -> bool:
        n = self.tokens(prompt)
        if n <= self.max_input_len:
            return True
        self.skipped.append((prompt.id, n))
        return False

    def refuse_misfits(self, rendered: Sequence[Prompt], prompt_set: str) -> None:
        """ConfigError naming every prompt of a set the user chose (already rendered) that is longer than
        max_input_len."""
        long = [(p.id, n) for p in rendered if (n := self.codec.prompt_tokens(p.text)) > self.max_input_len]
        if long:
            named = ", ".join(f"{i} ({n:,} tokens)" for i, n in long[:5]) + (" ..." if len(long) > 5 else "")
            raise ConfigError(
                f"{len(long)} prompt(s) of {prompt_set} are longer than the deployment's max_input_len"
                f" ({self.max_input_len:,} tokens): {named}",
                "shorten or drop them, or build the engines with a larger engine.max_input_len",
            )


def categories(prompts: list[Prompt]) -> list[str]:
    return list(dict.fromkeys(p.category for p in prompts))


class HFChatTemplate:
    """`messages -> text` with a Hugging Face tokenizer's chat template, single BOS guaranteed.

    `server_adds_special_tokens`: whether the server's preprocessing encodes with
    add_special_tokens (NVIDIA's default, and specdeploy's repository).
    """

    def __init__(self, tokenizer, server_adds_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.server_adds_special_tokens = server_adds_special_tokens

    @staticmethod
    def available(tokenizer) -> bool:
        return bool(getattr(tokenizer, "chat_template", None))

    def __call__(self, messages: Sequence[Message]) -> str:
        conversation = [{"role": role, "content": content} for role, content in messages]
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        return strip_duplicate_bos(text, self.tokenizer) if self.server_adds_special_tokens else text


def strip_duplicate_bos(text: str, tokenizer) -> str:
    """`text` without its leading BOS text when encoding with add_special_tokens would add a second BOS.

    Checked on ids: the result encodes (with special tokens) to exactly the ids the template meant.
    """
    bos_id, bos = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "bos_token", None)
    if bos_id is None or not bos or not text.startswith(bos):
        return text
    meant = list(tokenizer(text, add_special_tokens=False).input_ids)
    served = list(tokenizer(text, add_special_tokens=True).input_ids)
    if served[:2] != [bos_id, bos_id]:
        return text  # the tokenizer adds no BOS of its own (SmolLM2, Qwen2): the template's is the only one
    stripped = text[len(bos) :]
    if list(tokenizer(stripped, add_special_tokens=True).input_ids)[: len(meant)] != meant:
        raise ConfigError(
            "the chat template writes a BOS token that the tokenizer adds again, and removing it changes the prompt's"
            " tokens",
            "set validation.chat_template: none and give already rendered prompts",
        )
    return stripped


def _read_jsonl(path: Path, default_max_tokens: int) -> list[Prompt]:
    if not path.is_file():
        raise ConfigError(f"prompt file {path} not found", "set validation.prompt_set to 'builtin' or a .jsonl path")
    prompts: list[Prompt] = []
    counters: dict[str, int] = {}
    for lineno, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{lineno}"
        try:  # the texts validate sends, by the rules a request's texts are held to (text_rules)
            obj = json.loads(decode_text(raw, "line", limit=len(raw)))
            check_json(obj)
        except TextError as exc:
            hint = "save the file as UTF-8 text, without NUL characters or lone surrogates"
            raise ConfigError(f"{where}: {exc}", hint) from None
        except ValueError as exc:
            raise ConfigError(f"{where} is not valid JSON: {exc}", "one JSON object per line") from exc
        if not isinstance(obj, dict):
            raise ConfigError(f"{where} is not a JSON object", 'e.g. {"prompt": "Hello", "category": "chat"}')
        unknown = sorted(set(obj) - {"prompt", "messages", "category", "max_tokens"})
        if unknown:
            raise ConfigError(
                f"{where} has unknown key '{unknown[0]}'", "valid keys: prompt or messages, category, max_tokens"
            )
        text, messages = _prompt_or_messages(obj, where)
        category = obj.get("category", DEFAULT_CATEGORY)
        if not isinstance(category, str) or not category:
            raise ConfigError(f"{where}: 'category' must be a non-empty string")
        if category == "all":  # the report's name for every prompt together: its counts would take these twice
            raise ConfigError(
                f"{where}: 'category' is 'all', the report's name for all prompts together",
                "name the category otherwise",
            )
        max_tokens = obj.get("max_tokens", default_max_tokens)
        if type(max_tokens) is not int or max_tokens < 1:
            raise ConfigError(f"{where}: 'max_tokens' must be a positive integer, got {max_tokens!r}")
        index = counters.get(category, 0)
        counters[category] = index + 1
        prompts.append(Prompt(f"{category}-{index}", text, category, max_tokens, messages))
    return prompts


def _prompt_or_messages(obj: dict, where: str) -> tuple[str, tuple[Message, ...]]:
    """(raw text or "" for a conversation, the messages); exactly one of prompt/messages."""
    example = 'e.g. {"prompt": "Hello"} or {"messages": [{"role": "user", "content": "Hello"}]}'
    if ("prompt" in obj) == ("messages" in obj):
        raise ConfigError(f"{where} needs exactly one of 'prompt' and 'messages'", example)
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise ConfigError(f"{where} needs a non-empty string 'prompt'", example)
        return obj["prompt"], (("user", obj["prompt"]),)
    raw = obj["messages"]
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where}: 'messages' must be a non-empty list", example)
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise ConfigError(f"{where}: messages[{i}] must be an object with exactly 'role' and 'content'", example)
        if m["role"] not in ROLES:
            raise ConfigError(f"{where}: messages[{i}].role is {m['role']!r}", f"valid roles: {', '.join(ROLES)}")
        if not isinstance(m["content"], str) or not m["content"].strip():
            raise ConfigError(f"{where}: messages[{i}].content must be a non-empty string")
        messages.append((m["role"], m["content"]))
    if messages[-1][0] == "assistant":
        raise ConfigError(
            f"{where}: the last message is the assistant's",
            "end the conversation with a user message: the model answers it",
        )
    return "", tuple(messages)


def spread_over_categories(prompts: Sequence[Prompt], limit: int) -> list[Prompt]:
    """At most `limit` prompts, round-robin over the categories (each keeps its file order)."""
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
