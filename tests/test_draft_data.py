"""`specdeploy draft data`: the EAGLE-3 head's training set, written by a tiny random target through the real
quantize -> build -> CPU engine with in-flight batching."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_models import TINY_QUANT, build_quietly, make_tiny_model

from specdeploy import draft_data as dd
from specdeploy.artifacts import Layout, Manifest
from specdeploy.config import parse_recipe
from specdeploy.errors import ConfigError, StaleArtifactError

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
        "draft": {"kind": "eagle3", "head": "trained",
                  "data": {"num_prompts": 6, "samples_per_prompt": 2, "max_new_tokens": 6, "sources": ["calibration"], **data}},
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
    from specdeploy.engine.executor import Executor, GenerationRequest, run
    from specdeploy.generate import load_engine, load_tokenizer

    prompts = tmp_path / "mine.txt"
    prompts.write_text("Tell me about the sea.\nWrite a haiku about rain.\nWhy do cats purr so much?\nName three fruits.\n")
    text = tmp_path / "notes.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    recipe, layout = _setup(tmp_path, built, chat_model, {"num_prompts": 20, "sources": ["calibration", str(prompts)],
                                                          "text_files": [str(text)], "max_new_tokens": 5})
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
            expected = run(engine, GenerationRequest(r["input_ids"][: r["loss_start"]], 5, end_id=tok.eos_token_id)).token_ids
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
    assert manifest.extra["total"]["prompts"] == 20 + len([p for p in by_prompt if p.startswith("text-")])
    assert manifest.extra["total"]["by_source"]["file"]["prompts"] == 4  # the file had 4 of its quota of 10
    assert manifest.extra["total"]["by_source"]["calibration"]["prompts"] == 16  # calibration made up the other 6
    assert "validation" in manifest.extra["validation_excluded"]
    assert manifest.inputs["target_engine_fingerprint"] == Manifest.read(layout.engine("target")).fingerprint
    assert not dd.work_dir(layout).exists()
    # unchanged inputs and settings: up to date, nothing regenerated
    _, again = _make(recipe, layout)
    assert any("up to date" in line for line in again)
