"""Property-based tests (Hypothesis) of every parser a user's input reaches: the OpenAI request parser, the Triton
models' optional-input parsing, the recipe loader, the prompt-file and the draft-data loaders.

Each property says what any input gets: a value the next stage can use, or the parser's own error naming the
problem, never another exception. Examples are bounded and derandomized (the same cases on every run, no example
database), so the suite stays reproducible and its time bounded; bench/fuzz.py sends the same kinds of input, at scale,
to a live server.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from specdeploy.core.errors import ConfigError, SpecDeployError
from specdeploy.core.text_rules import MAX_DEPTH, RULES

ROOT = Path(__file__).resolve().parent.parent
BOUNDED = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# Texts with what breaks a boundary: lone surrogates (Hypothesis leaves category Cs out unless asked), NUL, size.
TEXTS = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=12),
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "a\x00", "x" * 4097, "The quick brown fox", ""]),
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | TEXTS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXTS, inner, max_size=3),
    max_leaves=8,
)


def _deep(value, depth: int):
    for _ in range(depth):
        value = [value]
    return value


# ---------------------------------------------------------------- the OpenAI request parser


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    import ops_deploy
    from tiny_models import make_tokenizer
    from transformers import AutoTokenizer

    from specdeploy.ops.openai.requests import Codec

    folder = tmp_path_factory.mktemp("codec")
    make_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.chat_template = ops_deploy.CHAT_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    return Codec(folder)


def _served():
    from specdeploy.ops.openai.requests import routes
    from specdeploy.recipe.load import parse_recipe

    return routes(parse_recipe({"name": "r", "target": {"model": "x"}, "draft": {"model": "x"}}))


def _bodies():
    from specdeploy.ops.openai.requests import FIELDS

    keys = st.sampled_from(sorted(FIELDS)) | TEXTS
    values = JSON_VALUES | st.builds(_deep, JSON_VALUES, st.integers(MAX_DEPTH - 2, MAX_DEPTH + 3))
    good = st.fixed_dictionaries(
        {
            "model": st.just("r"),
            "prompt": TEXTS,
            "messages": st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["user", "system", "assistant"]) | TEXTS, "content": TEXTS}
                ),
                max_size=2,
            ),
        }
    )
    return st.builds(lambda base, changes: {**base, **changes}, good, st.dictionaries(keys, values, max_size=4))


@BOUNDED
@given(body=_bodies(), chat=st.booleans())
def test_openai_parser_gives_a_sendable_job_or_a_4xx_naming_the_field(codec, body, chat):
    from specdeploy.ops.openai.requests import ApiError, parse_job

    try:
        job = parse_job(body, chat, _served(), codec, 16, 319)
    except ApiError as exc:
        assert 400 <= exc.status < 500 and exc.message.strip()
        json.dumps(exc.body()).encode("utf-8")  # the refusal itself can be sent (a lone surrogate in it was a 500)
        exc.message.encode("utf-8")
        named = {k if k.isprintable() else ascii(k)[1:-1] for k in body} | {
            "messages",
            "prompt",
        }  # a key as it can be sent
        assert exc.param is None or exc.param in named, (exc.param, exc.message)
        assert exc.code is None or isinstance(exc.code, str)
        return
    for text in (job.prompt, *job.stops):  # what goes to Triton encodes as UTF-8 and holds no NUL
        assert "\x00" not in text.encode("utf-8").decode("utf-8")
    assert 1 <= job.max_tokens <= 319 and len(job.stops) <= 4


@BOUNDED
@given(
    body=_bodies(),
    bad=st.sampled_from(["\ud800", "a\x00b", "x" * 4097]),
    where=st.sampled_from(["stop", "user", "model"]),
)
def test_openai_parser_refuses_a_bad_text_in_any_field_by_its_rule(codec, body, bad, where):
    from specdeploy.ops.openai.requests import ApiError, parse_job

    body = {**body, where: bad}
    with pytest.raises(ApiError) as info:
        parse_job(body, False, _served(), codec, 16, 319)
    # a rule of text_rules names the refusal; when an earlier key of the body breaks one first, that key is named
    assert info.value.status == 400 and info.value.code in RULES, info.value.message


# ---------------------------------------------------------------- the Triton models' optional inputs

NUMERIC = hnp.arrays(
    st.sampled_from([np.int32, np.int64, np.uint64, np.float32, np.bool_]),
    hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3),
)
STRINGS = hnp.arrays(
    np.object_,
    hnp.array_shapes(min_dims=1, max_dims=2, min_side=0, max_side=3),
    elements=st.binary(max_size=8) | st.sampled_from([b"\xed\xa0\x80", b"a\x00", b"x" * 4097]),
)


def _getter(arrays: dict):
    return lambda name: arrays.get(name)


@BOUNDED
@given(
    arrays=st.dictionaries(
        st.sampled_from(
            [
                "temperature",
                "top_k",
                "top_p",
                "seed",
                "random_seed",
                "repetition_penalty",
                "presence_penalty",
                "frequency_penalty",
                "min_tokens",
                "beam_width",
                "prompt_embedding_table",
                "lora_task_id",
                "decoder_input_ids",
                "decoder_input_lengths",
                "image_input",
                "runtime_top_p_decay",
            ]
        ),
        NUMERIC,
        max_size=5,
    )
)
def test_optional_inputs_are_read_or_refused_with_a_request_error(arrays):
    """Any numeric tensor of any shape (Triton itself refuses a dtype other than the declared one)."""
    from specdeploy.triton.models.optional_inputs import NEUTRAL, penalty_fields, refuse_unsupported
    from specdeploy.triton.models.request_inputs import RequestError, sampling_fields

    get = _getter(arrays)
    for read in (
        lambda: sampling_fields(get, "top_k", "top_p"),
        lambda: penalty_fields(get),
        lambda: refuse_unsupported(get, NEUTRAL),
    ):
        try:
            read()
        except RequestError as exc:
            assert str(exc).startswith("input '") and "Traceback" not in str(exc)


@BOUNDED
@given(array=STRINGS, name=st.sampled_from(["stop_words", "bad_words", "text_input", "embedding_bias_words"]))
def test_string_tensors_give_clean_text_or_a_request_error_naming_input_and_rule(array, name):
    """Any STRING tensor (Triton itself refuses another dtype): text that encodes, or the input and the rule named."""
    from specdeploy.triton.models.request_inputs import RequestError, strings

    try:
        texts = strings(array, name)
    except RequestError as exc:
        assert str(exc).startswith(f"input '{name}' ") and re.search(r"\(rule (%s)\)" % "|".join(RULES), str(exc)), str(
            exc
        )
    else:
        assert all("\x00" not in t and t.encode("utf-8") for t in texts)


@BOUNDED
@given(array=NUMERIC)
def test_word_lists_are_read_or_refused_with_a_request_error(array):
    from specdeploy.triton.models.request_inputs import RequestError, from_words_list

    try:
        words = from_words_list(array.astype(np.int32) if array.dtype != np.bool_ else array, "stop_words")
    except RequestError as exc:
        assert "'stop_words'" in str(exc)
    else:
        assert all(w for w in words)


@BOUNDED
@given(
    words=st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=4), max_size=5)
)  # encode_words drops empty ones
def test_words_list_round_trips(words):
    from specdeploy.triton.models.request_inputs import from_words_list, to_words_list

    assert from_words_list(to_words_list(words), "stop_words") == [w for w in words if w]


# ---------------------------------------------------------------- the recipe loader

RECIPE = yaml.safe_load((ROOT / "build" / "smollm2-135m.yaml").read_text())
YAML_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _paths(tree, prefix=()):
    yield prefix
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _paths(value, prefix + (key,))


RECIPE_PATHS = [p for p in _paths(RECIPE) if p]


def _replaced(tree, path, value, delete: bool):
    tree = json.loads(json.dumps(tree))
    node = tree
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return tree


@BOUNDED
@given(path=st.sampled_from(RECIPE_PATHS), value=YAML_VALUES, delete=st.booleans())
def test_recipe_loader_names_a_key_for_any_changed_value(tmp_path_factory, path, value, delete):
    from specdeploy.recipe.load import load_recipe

    file = tmp_path_factory.mktemp("recipe") / "r.yaml"
    file.write_text(yaml.safe_dump(_replaced(RECIPE, path, value, delete)))
    try:
        load_recipe(file)
    except ConfigError as exc:
        keys = {str(k) for p in RECIPE_PATHS for k in p} | {path[-1]}
        assert any(k in str(exc) for k in keys), str(exc)  # the key, or the keys a check across them names


@BOUNDED
@given(
    text=st.text(max_size=60)
    | st.binary(max_size=40).map(lambda b: b.decode("latin-1"))
    | YAML_VALUES.map(yaml.safe_dump)
)
def test_recipe_loader_refuses_any_yaml_text_with_a_config_error(tmp_path_factory, text):
    from specdeploy.recipe.load import load_recipe

    file = tmp_path_factory.mktemp("recipe") / "r.yaml"
    file.write_text(text)
    with pytest.raises(ConfigError):  # none of these is a recipe: each is named, none a traceback
        load_recipe(file)


# ---------------------------------------------------------------- the prompt-file and draft-data loaders

PROMPT_TEXTS = TEXTS | st.text(st.characters(exclude_categories=()), min_size=1, max_size=12)
PROMPT_LINES = st.one_of(
    st.builds(
        lambda text, extra: json.dumps({"prompt": text, **extra}),
        PROMPT_TEXTS,
        st.dictionaries(st.sampled_from(["category", "max_tokens"]), st.integers(-1, 9) | PROMPT_TEXTS, max_size=2),
    ),
    st.builds(
        lambda msgs: json.dumps({"messages": [{"role": r, "content": c} for r, c in msgs]}),
        st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), PROMPT_TEXTS), min_size=1, max_size=3),
    ),
    st.builds(
        json.dumps,
        st.dictionaries(
            st.sampled_from(["prompt", "messages", "category", "max_tokens", "x"]), JSON_VALUES, max_size=3
        ),
    ),
    st.builds(json.dumps, JSON_VALUES),
    st.text(st.characters(exclude_categories=()), max_size=20),
    st.sampled_from(
        ['{"prompt": "a\\ud800"}', '{"prompt": "a\\u0000"}', '{"messages": [{"role": "user", "content": "\\udfff"}]}']
    ),
)


WELL_FORMED_PROMPTS = st.builds(
    lambda text, n, category: json.dumps({"prompt": text, "max_tokens": n, "category": category}),
    PROMPT_TEXTS,
    st.integers(-1, 9) | PROMPT_TEXTS | st.floats(),
    st.sampled_from(["chat", "code", ""]),
)


@BOUNDED
@given(lines=st.lists(WELL_FORMED_PROMPTS, min_size=1, max_size=3) | st.lists(PROMPT_LINES, min_size=1, max_size=4))
def test_prompt_file_gives_prompts_or_a_config_error_naming_the_line(tmp_path_factory, lines):
    """Any lines: prompts that can be sent, or a ConfigError naming the file (and line)."""
    from specdeploy.client.prompts import load_prompt_set

    file = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    file.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass"))  # a lone surrogate's bytes: not UTF-8
    try:
        prompts = load_prompt_set(str(file), 8)
    except ConfigError as exc:
        assert str(file) in str(exc), str(exc)
    else:  # what validate sends encodes as UTF-8 and holds no NUL
        texts = [t for p in prompts for t in (p.text, p.category, *(x for m in p.messages for x in m))]
        assert (
            prompts
            and all(p.max_tokens >= 1 for p in prompts)
            and all("\x00" not in t.encode("utf-8").decode() for t in texts)
        )


SAMPLE_LINES = st.one_of(
    st.builds(
        json.dumps,
        st.fixed_dictionaries(
            {
                "id": JSON_VALUES,
                "input_ids": st.lists(st.integers(-5, 300) | JSON_VALUES, max_size=6),
                "loss_start": st.integers(-2, 8) | JSON_VALUES,
            }
        ),
    ),
    st.builds(json.dumps, JSON_VALUES),
    st.text(max_size=20),
)


WELL_FORMED_SAMPLES = st.builds(
    lambda ids, start: json.dumps({"id": "s", "input_ids": ids, "loss_start": start}),
    st.lists(st.integers(-3, 300), min_size=3, max_size=6),
    st.integers(-1, 6),
)


@BOUNDED
@given(lines=st.lists(WELL_FORMED_SAMPLES, min_size=1, max_size=3) | st.lists(SAMPLE_LINES, min_size=1, max_size=4))
def test_draft_data_gives_samples_or_an_error_naming_the_line(tmp_path_factory, lines):
    from specdeploy.core.artifacts import Manifest
    from specdeploy.eagle3.samples import HELDOUT_FILE, TRAIN_FILE, read_draft_data

    folder = tmp_path_factory.mktemp("draft-data")
    (folder / TRAIN_FILE).write_text("\n".join(lines), encoding="utf-8", errors="surrogatepass")
    (folder / HELDOUT_FILE).write_text("")
    Manifest(stage="draft-data", recipe_name="r", fingerprint="f").write(folder)
    try:
        data = read_draft_data(folder, 256)
    except SpecDeployError as exc:
        assert TRAIN_FILE in str(exc), str(exc)
    else:
        assert all(0 <= s.loss_start < len(s.input_ids) and all(0 <= t < 256 for t in s.input_ids) for s in data.train)
