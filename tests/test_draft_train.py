"""`specdeploy draft train`: an EAGLE-3 head trained with ModelOpt on a tiny random Llama target.

The training data is the target's own greedy continuations of random prompts (what `specdeploy draft data`
writes, in its contract's format), so the head has something to learn: the target's next tokens.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("modelopt.torch.speculative")

import bench_modules  # noqa: E402
from tiny_models import make_tiny_model, make_tokenizer  # noqa: E402

from specdeploy.core import artifacts
from specdeploy.core.errors import ConfigError, SpecDeployError  # noqa: E402
from specdeploy.eagle3 import (
    modelopt as modelopt_eagle3,
)
from specdeploy.eagle3 import (
    samples as draft_samples,
)
from specdeploy.eagle3 import (
    train as draft_train,
)
from specdeploy.eagle3 import (
    train_loop as draft_train_loop,
)
from specdeploy.eagle3 import (
    train_plan as draft_train_plan,
)
from specdeploy.recipe.config import EAGLE3_VOCAB_COUNTS, Eagle3TrainConfig  # noqa: E402
from specdeploy.recipe.load import parse_recipe  # noqa: E402

VOCAB = 512
POOL = 48  # the tokens prompts and answers use: the target maps each to a successor inside the pool
PROMPT_LEN, ANSWER_LEN = 6, 18
# precision float32: the same numbers on every CPU (auto picks bfloat16 where the CPU multiplies it natively)
TRAIN = dict(
    draft_vocab_size=160,
    ttt_steps=3,
    epochs=8.0,
    learning_rate=1e-2,
    seq_len=32,
    batch_size=8,
    seed=0,
    precision="float32",
)


def make_bigram_target(path: Path, tokenizer_dir: Path) -> None:
    """A tiny random Llama (4 layers) whose LM head is set so that its greedy next token is mostly a fixed
    successor of the current one inside a pool of tokens: structure a one-layer head can learn in a few steps
    (a fully random tiny target is chaotic: its continuations do not generalise from 16 samples)."""
    from transformers import AutoModelForCausalLM

    make_tiny_model(path, tokenizer_dir, seed=0, num_hidden_layers=4, vocab_size=VOCAB)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    pool = (torch.randperm(VOCAB - 8, generator=g)[:POOL] + 8).tolist()
    successor = dict(zip(pool, [pool[i] for i in torch.randperm(POOL, generator=g).tolist()]))
    with torch.no_grad():
        for token, nxt in successor.items():
            model.lm_head.weight[nxt] = 50 * model.model.embed_tokens.weight[token]
    model.save_pretrained(str(path))
    (path / "pool.json").write_text(json.dumps(pool))


def greedy_answers(model_dir: Path, n: int, seed: int) -> list[dict]:
    """The target's greedy continuations of random prompts, as `specdeploy draft data` lines."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(json.loads((model_dir / "pool.json").read_text()))
    prompts = pool[torch.randint(0, POOL, (n, PROMPT_LEN), generator=g)]
    ids = prompts
    with torch.no_grad():
        for _ in range(ANSWER_LEN):  # greedy, by hand: no generation-config defaults in the way
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return [
        {"id": f"s{seed}-{i}", "source": "test", "input_ids": row.tolist(), "loss_start": PROMPT_LEN, "sampled": False}
        for i, row in enumerate(ids)
    ]


def write_data(folder: Path, train: list[dict], heldout: list[dict], fingerprint: str = "data-1") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (folder / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in heldout))
    artifacts.Manifest(stage="draft-data", recipe_name="tiny-eagle3", fingerprint=fingerprint).write(folder)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    torch.set_num_threads(2)
    make_tokenizer(root / "tok", vocab_size=VOCAB)
    target = root / "target-hf"
    make_bigram_target(target, root / "tok")
    data = root / "data"
    write_data(data, greedy_answers(target, 16, seed=1), greedy_answers(target, 8, seed=2))
    return root, target, data


def recipe_for(target: Path, **train):
    return parse_recipe(
        {
            "name": "tiny-eagle3",
            "target": {"model": str(target)},
            "draft": {"kind": "eagle3", "head": "trained", "train": {**TRAIN, **train}},
            "speculative": {"max_draft_len": 4, "num_draft_tokens": 3},
        }
    )


def layout_with_data(root: Path, data: Path, recipe, name: str) -> artifacts.Layout:
    layout = artifacts.Layout(root / name, recipe.name)
    layout.draft_data.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(data, layout.draft_data)
    return layout


def test_training_raises_heldout_acceptance_and_exports_a_head_that_drafts_the_same(tiny):
    root, target, data = tiny
    recipe = recipe_for(target)
    layout = layout_with_data(root, data, recipe, "run")
    lines = []
    result = draft_train.train_recipe(recipe, layout, echo=lines.append, progress=False)
    before, after = result.initial_acceptance, result.acceptance
    assert before.positions == after.positions > 50
    assert after.per_position[0] > before.per_position[0] + 0.2, (before, after)
    assert after.mean_accepted > before.mean_accepted

    head = layout.eagle3_head
    manifest = artifacts.Manifest.read(head)
    assert manifest.stage == draft_train.STAGE
    assert manifest.extra["heldout_acceptance"]["per_position"] == after.per_position
    assert manifest.inputs["data_fingerprint"] == "data-1"
    log = [json.loads(line) for line in (head / draft_train.TRAIN_LOG).read_text().splitlines()]
    assert [e["epoch"] for e in log] == list(range(9))
    assert not draft_train.resume_dir(head).exists()

    # the standard EAGLE-3 layout, stating what was trained
    config = json.loads((head / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 160
    assert config["hidden_size"] == 64 and config["intermediate_size"] == 128 and config["num_attention_heads"] == 4
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1]  # ModelOpt's default for 4 layers
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2]  # llama.cpp's convention: layer inputs
    assert config["torch_dtype"] == "float32" and config["rope_scaling"] is None
    from safetensors.torch import load_file

    weights = load_file(str(head / "model.safetensors"))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "layers.0.self_attn.q_proj.weight"} <= set(weights)
    assert weights["layers.0.self_attn.q_proj.weight"].shape == (64, 128)  # reads [embeddings, hidden]
    assert weights["lm_head.weight"].shape == (160, 64)
    assert {str(v.dtype) for k, v in weights.items() if k != "d2t"} == {"torch.float32"}
    # trap 5: input_layernorm stays at ones, so ModelOpt's doubly normalised features equal the runtimes' single
    # hidden_norm (what is trained is what is served); hidden_norm itself is trained
    assert torch.equal(weights["layers.0.input_layernorm.weight"], torch.ones(64))
    assert not torch.equal(weights["layers.0.hidden_norm.weight"], torch.ones(64))
    # d2t: target_id = draft_id + d2t[draft_id], the most frequent answer tokens (computed here independently)
    counts = Counter(
        t
        for r in map(json.loads, (data / "train.jsonl").read_text().splitlines())
        for t in r["input_ids"][r["loss_start"] :]
    )
    draft_targets = (torch.arange(160) + weights["d2t"]).tolist()
    assert draft_targets == sorted(draft_targets) and len(set(draft_targets)) == 160
    top = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))][: min(160, len(counts))]
    assert set(top) <= set(draft_targets)
    # beside it, how often the training answers used each draft token (draft.serve_vocab_size ranks by them)
    written = json.loads((head / EAGLE3_VOCAB_COUNTS).read_text())
    assert written["counts"] == [counts.get(t, 0) for t in draft_targets] and written["source"] == str(
        layout.draft_data
    )
    assert written["answer_tokens"] == sum(counts.values()) >= written["counted"] == sum(written["counts"]) > 0

    # reloaded into a fresh model, the head drafts what the trained one drafted
    t = recipe.draft.train
    trained = modelopt_eagle3.build_model(target, t, draft_targets, [0, 1])
    fresh_drafts = _drafts(trained, data)
    modelopt_eagle3.load_exported_head(trained, head)
    reloaded = _drafts(trained, data)
    assert not torch.equal(fresh_drafts, reloaded)  # the untrained head drafts otherwise
    heldout = _samples(data / "heldout.jsonl")
    acc = draft_train_loop.heldout_acceptance(trained, heldout, 3, 32, 8, 0)
    assert acc.per_position == after.per_position
    # the held-out measure is what ModelOpt's own drafting loop gives, prefix by prefix
    starts, hits = reference_acceptance(trained, heldout, 3)
    assert hits[0] > 0 and hits[1] > 0  # trained enough to check the chain
    assert acc.positions == starts and acc.accepted_at_least == [h / starts for h in hits]

    # up to date: a rerun is a no-op; --force trains again
    again = draft_train.train_recipe(recipe, layout, echo=lines.append, progress=False)
    assert again is None and any("up to date" in line for line in lines)


def _samples(path: Path):
    return draft_samples._read_samples(path, VOCAB, "x")


def test_cli_vocab_counts_counts_a_heads_draft_tokens_in_the_training_answers_only(tiny, tmp_path):
    """`specdeploy draft vocab-counts HEAD --data DIR`: per draft id (through the head's d2t), the answer tokens of the
    folder's train.jsonl, never its held-out prompts'; an earlier file is replaced whole; a folder that is no head,
    or data that is missing, is refused naming it."""
    from click.testing import CliRunner
    from eagle3_heads import make_eagle3_head

    from specdeploy.cli.main import main

    root, _, data = tiny
    d2t = torch.arange(40) * 2  # draft id i -> target id 3 i
    head = make_eagle3_head(tmp_path / "head", 64, VOCAB, (0, 1), draft_vocab_size=40, d2t=d2t)
    (head / EAGLE3_VOCAB_COUNTS).write_text("{}")
    result = CliRunner().invoke(main, ["draft", "vocab-counts", str(head), "--data", str(data)])
    assert result.exit_code == 0, result.output
    answers = Counter(t for s in _samples(data / "train.jsonl") for t in s.input_ids[s.loss_start :])
    heldout = Counter(t for s in _samples(data / "heldout.jsonl") for t in s.input_ids[s.loss_start :])
    written = json.loads((head / EAGLE3_VOCAB_COUNTS).read_text())
    assert written["counts"] == [answers.get(3 * i, 0) for i in range(40)] and sum(written["counts"]) > 0
    assert written["counts"] != [
        answers.get(3 * i, 0) + heldout.get(3 * i, 0) for i in range(40)
    ]  # held-out not counted
    assert f"{written['counted']:,} of {written['answer_tokens']:,} answer tokens" in result.output
    for args, words in (
        ([str(tmp_path)], "no config.json"),
        ([str(head), "--data", str(tmp_path / "none")], "no EAGLE-3 training data"),
    ):
        result = CliRunner().invoke(
            main, ["draft", "vocab-counts", *args] + ([] if "--data" in args else ["--data", str(data)])
        )
        assert result.exit_code != 0 and words in result.output, result.output


def _drafts(model, data: Path):
    ids = torch.tensor([_samples(data / "heldout.jsonl")[0].input_ids])
    model.eval()
    _, drafts = model.pseudo_speculative_generate(ids[:, :12], steps=3)
    return drafts


def _train_quietly(model, d, t, work: Path, stop=None, **kwargs) -> None:
    """train_head without progress or messages, a checkpoint every step, stopped after step `stop` (a
    KeyboardInterrupt, as an interrupted run), as the resume tests run it."""
    draft_train_loop.train_head(
        model,
        d,
        t,
        work,
        fingerprint="fp",
        progress=False,
        echo=lambda m: None,
        checkpoint_every_s=0.0,
        _stop_after_step=stop,
        **kwargs,
    )


def test_resume_after_interruption_gives_the_same_weights(tiny):
    root, target, data = tiny
    recipe = recipe_for(target, epochs=2.0)
    t = recipe.draft.train
    d = draft_samples.read_draft_data(data, VOCAB)
    draft_ids = modelopt_eagle3.choose_draft_vocab(d.train, VOCAB, t.draft_vocab_size)

    def run(work: Path, stop=None):
        model = modelopt_eagle3.build_model(target, t, draft_ids, [0, 1])
        _train_quietly(model, d, t, work, stop)
        return model.eagle_module.state_dict()

    straight = run(root / "straight")
    with pytest.raises(KeyboardInterrupt):
        run(root / "interrupted", stop=3)
    state = torch.load(root / "interrupted" / draft_train_loop.RESUME_STATE, weights_only=False)
    assert state["step"] == 3
    # the first held-out pass's seconds travel with it: a resumed --time-limit run keeps room for the passes to come
    assert state["evaluate_s"] > 0
    resumed = run(root / "interrupted")
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key
    # a checkpoint of other inputs is not resumed from
    other = modelopt_eagle3.build_model(target, t, draft_ids, [0, 1])
    lines = []
    draft_train_loop.train_head(
        other, d, replace(t, epochs=0.2), root / "interrupted", fingerprint="other", progress=False, echo=lines.append
    )
    assert not any("resuming" in line for line in lines)


def test_missing_or_broken_data_is_refused_with_the_command_to_run(tiny, tmp_path):
    root, target, data = tiny
    recipe = recipe_for(target)
    layout = artifacts.Layout(tmp_path, recipe.name)
    with pytest.raises(SpecDeployError, match="no EAGLE-3 training data") as exc:
        draft_train.train_recipe(recipe, layout, echo=lambda m: None, progress=False)
    assert "specdeploy draft data" in exc.value.hint

    shutil.copytree(data, layout.draft_data)
    (layout.draft_data / "heldout.jsonl").unlink()
    with pytest.raises(SpecDeployError, match="lacks heldout.jsonl") as exc:
        draft_train.train_recipe(recipe, layout, echo=lambda m: None, progress=False)
    assert "specdeploy draft data" in exc.value.hint

    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    rows[3]["input_ids"][7] = VOCAB + 5
    write_data(layout.draft_data, rows, rows[:2])
    with pytest.raises(SpecDeployError, match=f"token id {VOCAB + 5} is outside the target's vocabulary") as exc:
        draft_train.train_recipe(recipe, layout, echo=lambda m: None, progress=False)
    assert "train.jsonl:4" in exc.value.message


def test_a_run_estimated_over_max_train_hours_is_refused_with_the_estimate(tiny, tmp_path):
    root, target, data = tiny
    recipe = recipe_for(target, epochs=1e6, max_train_hours=1.0)
    layout = artifacts.Layout(tmp_path, recipe.name)
    shutil.copytree(data, layout.draft_data)
    with pytest.raises(ConfigError, match=r"longer than draft.train.max_train_hours \(1 h\)") as exc:
        draft_train.train_recipe(recipe, layout, echo=lambda m: None, progress=False)
    assert "(estimate)" in exc.value.message and " h" in exc.value.message
    assert not layout.eagle3_head.exists()


def test_a_run_that_needs_more_memory_than_there_is_is_refused():
    cfg = {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "vocab_size": 128256,
    }
    d = draft_samples.DraftData(Path("."), (draft_samples.Sample("a", (1, 2, 3), 1),), (), "x")
    t = Eagle3TrainConfig()
    plan = draft_train_plan.plan_training(cfg, d, t, "cpu", 8 * 2**30, t.draft_vocab_size, 3)
    with pytest.raises(ConfigError, match="GiB are available"):
        draft_train_plan.check_plan(plan, t)


# ---------------------------------------------------------------- an independent reader: llama.cpp's converter


def test_llama_cpp_converts_the_exported_head_of_the_bundled_model(tmp_path):
    from specdeploy.core import model_store as models

    if not models.is_fetched("smollm2-135m-instruct"):
        pytest.skip("the bundled model is not fetched (make models)")
    llama_cpp = bench_modules.load("llama_cpp")  # the source and converter environment the benchmarks use
    try:
        src, env = llama_cpp.source(), llama_cpp.converter_env()
    except llama_cpp.Unavailable as exc:
        pytest.skip(str(exc))
    target = models.cached_path("smollm2-135m-instruct")
    t = Eagle3TrainConfig(draft_vocab_size=8192)
    config = json.loads((target / "config.json").read_text())
    aux = modelopt_eagle3.aux_layer_ids(config, t)
    assert aux == [1, 14, 26]  # ModelOpt's default for 30 layers
    draft_ids = list(range(0, 2 * 8192, 2))  # any ascending set: d2t is what is checked here
    model = modelopt_eagle3.build_model(target, t, draft_ids, aux)
    head = tmp_path / "head"
    modelopt_eagle3.export_head(model, head, aux)
    out = tmp_path / "head.gguf"
    got = subprocess.run(
        [
            sys.executable,
            str(src / "convert_hf_to_gguf.py"),
            str(head),
            "--outfile",
            str(out),
            "--outtype",
            "f32",
            "--target-model-dir",
            str(target),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    assert "Detected EAGLE-3 draft model" in got.stderr

    sys.path.insert(0, str(src / "gguf-py"))
    try:
        from gguf import GGUFReader
    finally:
        sys.path.remove(str(src / "gguf-py"))
    reader = GGUFReader(str(out))
    fields = {name: f for name, f in reader.fields.items()}
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "eagle3"
    layers_field = fields["eagle3.target_layers"]
    assert [int(layers_field.parts[i][0]) for i in layers_field.data] == [2, 15, 27]  # the inputs of these layers
    tensors = {t.name: t for t in reader.tensors}
    d2t = tensors["d2t"].data.reshape(-1).tolist()
    assert d2t == draft_ids  # llama.cpp stores absolute target ids: draft_id + d2t[draft_id]
    assert {"fc.weight", "output.weight", "blk.0.attn_q.weight"} <= set(tensors)


def test_sigkill_mid_training_keeps_the_previous_head_and_the_rerun_resumes(tiny, tmp_path):
    """The CLI as a subprocess, SIGKILLed once its first resume checkpoint is on disk (tests/stage_pause.py): the head
    exported before (other settings) stays in place byte for byte and loadable, and the same command again resumes
    from the checkpoint and gives the weights of an uninterrupted run."""
    import signal

    import yaml
    from safetensors.torch import load_file

    _, target, data = tiny
    tests = Path(__file__).resolve().parent

    def recipe_file(name: str, **train) -> Path:
        path = tmp_path / name
        path.write_text(
            yaml.safe_dump(
                {
                    "name": "tiny-eagle3",
                    "target": {"model": str(target)},
                    "draft": {"kind": "eagle3", "head": "trained", "train": {**TRAIN, **train}},
                    "speculative": {"max_draft_len": 4, "num_draft_tokens": 3},
                }
            )
        )
        return path

    def cli(root: Path, recipe: Path, point: str = "none") -> subprocess.Popen:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(tests.parent)}
        return subprocess.Popen(
            [
                sys.executable,
                str(tests / "stage_pause.py"),
                point,
                "--root",
                str(root),
                "draft",
                "train",
                str(recipe),
                "--no-progress",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )

    def finished(root: Path, recipe: Path) -> str:
        proc = cli(root, recipe)
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out
        return out

    short, full = recipe_file("short.yaml", epochs=1.0), recipe_file("full.yaml", epochs=4.0)
    reference = artifacts.Layout(tmp_path / "reference", "tiny-eagle3")
    shutil.copytree(data, reference.draft_data)
    finished(reference.root, full)  # uninterrupted

    layout = artifacts.Layout(tmp_path / "killed", "tiny-eagle3")
    shutil.copytree(data, layout.draft_data)
    finished(layout.root, short)  # the previous head
    head, partial = layout.eagle3_head, draft_train.resume_dir(layout.eagle3_head)
    before = {p.name: p.read_bytes() for p in head.iterdir()}

    proc = cli(layout.root, full, point="checkpoint")
    paused = ""
    for line in proc.stdout:  # a signal, not a sleep: the line stage_pause prints once the checkpoint is saved
        paused += line
        if line.startswith("PAUSED checkpoint"):
            break
    assert "PAUSED checkpoint" in paused, paused
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert (partial / draft_train_loop.RESUME_STATE).is_file()
    assert {p.name: p.read_bytes() for p in head.iterdir()} == before  # the previous head, untouched
    previous = artifacts.Manifest.read(head)
    assert previous.settings["train"]["epochs"] == 1.0
    d2t = load_file(str(head / "model.safetensors"))["d2t"]
    model = modelopt_eagle3.build_model(
        target, recipe_for(target).draft.train, (torch.arange(len(d2t)) + d2t).tolist(), [0, 1]
    )
    modelopt_eagle3.load_exported_head(model, head)  # loadable

    out = finished(layout.root, full)
    assert "resuming at step" in out, out
    assert not partial.exists()
    resumed, straight = (
        load_file(str(head / "model.safetensors")),
        load_file(str(reference.eagle3_head / "model.safetensors")),
    )
    assert resumed.keys() == straight.keys()
    for key in straight:
        assert torch.equal(resumed[key], straight[key]), key


def test_cli_draft_train_without_data_names_the_data_command(tiny, tmp_path):
    import yaml
    from click.testing import CliRunner

    from specdeploy.cli.main import main

    _, target, _ = tiny
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "name": "tiny-eagle3",
                "target": {"model": str(target)},
                "draft": {"kind": "eagle3", "head": "trained"},
                "speculative": {"max_draft_len": 4, "num_draft_tokens": 3},
            }
        )
    )
    result = CliRunner().invoke(main, ["--root", str(tmp_path), "draft", "train", str(recipe), "--no-progress"])
    assert result.exit_code != 0
    assert "no EAGLE-3 training data" in result.output and "run: specdeploy draft data RECIPE" in result.output


def reference_acceptance(model, samples, k: int) -> tuple[int, list[int]]:
    """(starts, hits per draft position) by ModelOpt's own drafting loop, one prefix at a time: for each answer
    position s, `pseudo_speculative_generate(tokens 0..s, steps=k)` (the target's token, then k chained drafts)."""
    model.eval()
    starts, hits = 0, [0] * k
    with torch.no_grad():
        for s in samples:
            x = torch.tensor([s.input_ids])
            greedy = model(input_ids=x).logits.argmax(-1)[0]  # the target's token after each position
            for start in range(max(0, s.loss_start - 1), len(s.input_ids) - k):
                if not torch.equal(x[0, start + 1 : start + 1 + k], greedy[start : start + k]):
                    continue
                starts += 1
                base, drafts = model.pseudo_speculative_generate(x[:, : start + 1], steps=k)
                assert int(base) == s.input_ids[start + 1]
                for j in range(k):
                    if int(drafts[0, j]) != int(greedy[start + j + 1]):
                        break
                    hits[j] += 1
    return starts, hits


def test_export_dtype_bfloat16_halves_the_weights_and_keeps_d2t_integer(tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "model.safetensors"
    weights = {"fc.weight": torch.randn(8, 24), "lm_head.weight": torch.randn(16, 8), "d2t": torch.arange(16) * 3}
    save_file(weights, str(path))
    modelopt_eagle3.cast_weights(path, "bfloat16")
    back = load_file(str(path))
    assert back["fc.weight"].dtype == torch.bfloat16 and torch.equal(back["fc.weight"], weights["fc.weight"].bfloat16())
    assert back["d2t"].dtype == weights["d2t"].dtype and torch.equal(back["d2t"], weights["d2t"])
    assert not path.with_suffix(".tmp").exists()


def test_an_unknown_export_dtype_is_refused_naming_the_choices():
    from specdeploy.core.errors import ConfigError
    from specdeploy.recipe.load import parse_recipe

    raw = {
        "name": "x",
        "target": {"model": "smollm2-135m-instruct"},
        "draft": {"kind": "eagle3", "head": "trained", "train": {"export_dtype": "int8"}},
    }
    with pytest.raises(ConfigError, match="export_dtype") as caught:
        parse_recipe(raw)
    assert "float32, bfloat16, float16" in str(caught.value)


def test_bfloat16_training_also_raises_heldout_acceptance(tiny):
    """draft.train.precision bfloat16: the forward passes under autocast (the head's weights and AdamW stay fp32)."""
    root, target, data = tiny
    recipe = recipe_for(target, precision="bfloat16")
    layout = layout_with_data(root, data, recipe, "run-bf16")
    lines: list[str] = []
    result = draft_train.train_recipe(recipe, layout, echo=lines.append, progress=False)
    assert any("forward passes in bfloat16" in line for line in lines)
    assert result.acceptance.per_position[0] > result.initial_acceptance.per_position[0] + 0.2
    manifest = artifacts.Manifest.read(layout.eagle3_head)
    assert manifest.settings["precision"] == "bfloat16"
    from safetensors.torch import load_file

    weights = load_file(str(layout.eagle3_head / "model.safetensors"))
    assert {str(v.dtype) for k, v in weights.items() if k != "d2t"} == {"torch.float32"}  # fp32 master weights


def test_precision_auto_is_bfloat16_only_where_the_cpu_multiplies_bf16(monkeypatch):
    from specdeploy.engine import native

    t = Eagle3TrainConfig()
    assert t.precision == "auto"
    monkeypatch.setattr(native, "_cpu_flags", lambda: "flags : fpu avx2 fma avx512f avx512_bf16")
    assert draft_train.train_precision(t, "cpu") == "bfloat16"
    monkeypatch.setattr(native, "_cpu_flags", lambda: "flags : fpu avx2 fma amx_tile amx_bf16")
    assert draft_train.train_precision(t, "cpu") == "bfloat16"
    monkeypatch.setattr(native, "_cpu_flags", lambda: "flags : fpu avx2 fma avx512f avx512_vnni")
    assert draft_train.train_precision(t, "cpu") == "float32"
    assert draft_train.train_precision(t, "cuda") == "bfloat16"
    assert draft_train.train_precision(replace(t, precision="float32"), "cuda") == "float32"


def test_an_unknown_precision_is_refused_naming_the_choices():
    raw = {
        "name": "x",
        "target": {"model": "smollm2-135m-instruct"},
        "draft": {"kind": "eagle3", "head": "trained", "train": {"precision": "fp8"}},
    }
    with pytest.raises(ConfigError, match="precision") as caught:
        parse_recipe(raw)
    assert "auto, float32, bfloat16" in str(caught.value)


def test_cosine_schedule_runs_from_the_learning_rate_to_a_tenth_and_depends_on_the_step_alone():
    t = Eagle3TrainConfig(learning_rate=1e-3, lr_schedule="cosine")
    rates = [draft_train_loop.learning_rate_at(t, step, 11) for step in range(11)]
    assert rates[0] == pytest.approx(1e-3) and rates[-1] == pytest.approx(1e-4) and rates[5] == pytest.approx(5.5e-4)
    assert all(a > b for a, b in zip(rates, rates[1:]))
    constant = replace(t, lr_schedule="constant")
    assert {draft_train_loop.learning_rate_at(constant, step, 11) for step in range(11)} == {1e-3}
    with pytest.raises(ConfigError, match="lr_schedule"):
        parse_recipe(
            {
                "name": "x",
                "target": {"model": "smollm2-135m-instruct"},
                "draft": {"kind": "eagle3", "head": "trained", "train": {"lr_schedule": "linear"}},
            }
        )


@pytest.mark.parametrize("when", ["before training", "at the first checkpoint"])
def test_a_full_disk_is_refused_or_reported_naming_the_folder_and_the_previous_head_stays(
    tiny, tmp_path, full_disk, monkeypatch, when
):
    """draft train on a full disk (a tmpfs holding the recipe's data and an exported head, 64 KiB free;
    tests/conftest.py full_disk). `before training`: the run is refused up front with the space its checkpoints and
    export need.
    `at the first checkpoint` (that check switched off): the checkpoint cannot be written, and the run stops with
    the folder and the space named. Either way no traceback, nothing half-written, and the head exported before
    stays byte for byte."""
    import yaml
    from click.testing import CliRunner

    from specdeploy.cli.main import main

    _, target, data = tiny
    layout = layout_with_data(tmp_path, data, recipe_for(target), "p")
    path = tmp_path / "r.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "tiny-eagle3",
                "target": {"model": str(target)},
                "draft": {"kind": "eagle3", "head": "trained", "train": {**TRAIN, "epochs": 1.0}},
                "speculative": {"max_draft_len": 4, "num_draft_tokens": 3},
            }
        )
    )
    run = lambda *extra: CliRunner().invoke(
        main, ["--root", str(layout.root), "draft", "train", str(path), "--no-progress", *extra]
    )  # noqa: E731
    first = run()
    assert first.exit_code == 0, first.output
    previous = {p.name: p.read_bytes() for p in layout.eagle3_head.iterdir()}
    there = full_disk(layout.engines, keep=("draft-data", "eagle3-head"))
    if when == "at the first checkpoint":
        monkeypatch.setattr(draft_train, "check_disk", lambda *args: None)
    got = run("--force")
    print(got.output)
    assert got.exit_code == 1 and isinstance(got.exception, SystemExit) and "Traceback" not in got.output, (
        got.output,
        got.exception,
    )
    if when == "before training":
        assert f"error: not enough disk space to train the EAGLE-3 head in {layout.engines}: about " in got.output, (
            got.output
        )
        assert (
            "MiB needed (resume checkpoints and the exported head)" in got.output and "untrained head" not in got.output
        )
    else:
        assert (
            f"error: no space left writing the training checkpoint in {draft_train.resume_dir(layout.eagle3_head)} ("
            in got.output
        )
        assert "nothing was kept" in got.output, got.output
    assert "hint:" in got.output and "point --root at a larger" in got.output, got.output
    left = sorted(set(os.listdir(layout.engines)) - {".lock", draft_train.resume_dir(layout.eagle3_head).name})
    assert left == there, "nothing half-written may be left"
    assert not list(draft_train.resume_dir(layout.eagle3_head).glob("*.tmp")), "no half-written checkpoint"
    assert {p.name: p.read_bytes() for p in layout.eagle3_head.iterdir()} == previous


def test_chain_hits_counts_as_the_position_by_position_definition():
    """The held-out acceptance's tensor count equals a loop over rows and start positions written from its
    definition (the loop the count replaced), on random batches where drafts and samples often agree."""
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        rows, width, k = 3, 24, 1 + trial % 4
        ids = torch.randint(0, 3, (rows, width), generator=g)
        target_next = torch.randint(0, 3, (rows, width), generator=g)
        target_next[:, :-1] = torch.where(
            torch.rand(rows, width - 1, generator=g) < 0.7, ids[:, 1:], target_next[:, :-1]
        )
        drafts = [torch.randint(0, 3, (rows, width), generator=g) for _ in range(k)]
        lengths = torch.randint(k + 1, width + 1, (rows,), generator=g).tolist()
        begin = torch.randint(0, 6, (rows,), generator=g)
        hits, starts = [0] * k, 0
        for r in range(rows):
            x, t, n = ids[r], target_next[r], lengths[r]
            for s in range(int(begin[r]), n - k):
                if not all(x[s + 1 + i] == t[s + i] for i in range(k)):
                    continue
                starts += 1
                for j in range(k):
                    if drafts[j][r, s + j] != t[s + j + 1]:
                        break
                    hits[j] += 1
        got_hits, got_starts = draft_train_loop.chain_hits(ids, target_next, drafts, begin, torch.tensor(lengths) - k)
        assert (got_hits, got_starts) == (hits, starts), trial
    assert starts > 0 and hits[0] > 0


def test_fit_steps_keeps_the_plan_when_it_fits_and_cuts_it_to_the_time_left():
    fit = draft_train_loop.fit_steps
    assert fit(20, 1000, 500, 0.1, 5.0, 1000.0) == 1000
    assert fit(20, 1000, 500, 0.1, 5.0, 50.0) == 470  # 450 steps x 0.1 s + the final held-out pass
    assert fit(20, 1000, 500, 0.1, 5.0, 60.0) == 520  # past the epoch end: its held-out pass counts too
    assert fit(20, 1000, 500, 0.1, 5.0, 0.0) == 21  # never below one more step


def test_a_time_limit_cuts_the_steps_and_still_exports_the_head(tiny, tmp_path):
    """draft train --time-limit: a limit no run can meet ends at the first step after the timed ones, and the head
    is exported with the planned and done steps in its manifest; a generous limit trains the whole plan."""
    from click.testing import CliRunner

    from specdeploy.cli.main import main

    root, target, data = tiny
    recipe = recipe_for(target, epochs=4.0)
    layout = layout_with_data(tmp_path, data, recipe, "cut")
    result = draft_train.train_recipe(recipe, layout, echo=lambda m: None, progress=False, time_limit_s=1e-6)
    planned = 4 * 2  # 16 samples / batch 8 x 4 epochs
    assert result.planned_steps == planned and result.steps == planned  # under FIT_AFTER_STEPS steps: nothing to fit
    recipe = recipe_for(target, epochs=16.0, batch_size=4)
    layout = layout_with_data(tmp_path, data, recipe, "cut2")
    result = draft_train.train_recipe(recipe, layout, echo=lambda m: None, progress=False, time_limit_s=1e-6)
    assert result.planned_steps == 64 and result.steps == draft_train_loop.FIT_AFTER_STEPS + 1
    manifest = artifacts.Manifest.read(layout.eagle3_head)
    assert manifest.extra["planned_steps"] == 64 and manifest.extra["steps"] == draft_train_loop.FIT_AFTER_STEPS + 1
    assert manifest.settings["time_limit_s"] == 1e-6
    assert (layout.eagle3_head / "model.safetensors").is_file()
    # the CLI passes minutes; a limit changes the head's identity, so the run without one trains again
    path = tmp_path / "recipe.json"
    raw = {
        "name": "tiny-eagle3",
        "target": {"model": str(target)},
        "draft": {"kind": "eagle3", "head": "trained", "train": {**TRAIN, "epochs": 16.0, "batch_size": 4}},
        "speculative": {"max_draft_len": 4, "num_draft_tokens": 3},
    }
    path.write_text(json.dumps(raw))
    cli_layout = layout_with_data(tmp_path / "cli", data, recipe, "")
    out = CliRunner().invoke(
        main, ["--root", str(cli_layout.root), "draft", "train", str(path), "--no-progress", "--time-limit", "600"]
    )
    assert out.exit_code == 0, out.output
    manifest = artifacts.Manifest.read(cli_layout.eagle3_head)
    assert (
        manifest.settings["time_limit_s"] == 36000.0
        and manifest.extra["steps"] == 64 == manifest.extra["planned_steps"]
    )
    out = CliRunner().invoke(
        main, ["--root", str(cli_layout.root), "draft", "train", str(path), "--no-progress", "--time-limit", "0"]
    )
    assert out.exit_code != 0 and "--time-limit" in out.output


# ---------------------------------------------------------------- the target's side from the CPU engine, a head trained
# further


def engine_recipe(target: Path, name: str = "tiny-eagle3-engine", **train):
    """recipe_for with a built CPU engine behind it (full precision, float32: the engine's numbers close to torch's)."""
    return parse_recipe(
        {
            "name": name,
            "backend": "cpu",
            "target": {
                "model": str(target),
                "quantization": {"qformat": "full_prec", "calib_size": 4, "calib_max_seq_length": 32},
            },
            "draft": {"kind": "eagle3", "head": "trained", "train": {**TRAIN, **train}},
            "speculative": {"max_draft_len": 4, "num_draft_tokens": 3},
            "engine": {"dtype": "float32", "max_batch_size": 2, "max_input_len": 64, "max_seq_len": 96},
        }
    )


@pytest.fixture(scope="module")
def tiny_engine(tiny):
    """The tiny target quantized (full_prec) and built as a CPU engine, with the draft data beside it."""
    from specdeploy.deploy.cpu_build import build_recipe
    from specdeploy.quantize.stage import quantize_recipe

    root, target, data = tiny
    recipe = engine_recipe(target, features="engine")
    layout = layout_with_data(root, data, recipe, "engine-run")
    quantize_recipe(recipe, layout, echo=lambda *_: None, progress=False)
    build_recipe(recipe, layout, echo=lambda *_: None)
    return layout


def test_engine_features_are_what_modelopt_captures_from_the_targets_weights(tiny, tiny_engine):
    """The engine's aux features and logits, fed to ModelOpt's offline mode, are the outputs its online mode hooks
    from the same layers of the target's weights (ModelOpt's ids: layer outputs), and its loss is the same."""
    from specdeploy.eagle3.features import EngineFeatures

    root, target, data = tiny
    t = Eagle3TrainConfig(**TRAIN)
    samples = _samples(data / "heldout.jsonl")[:4]
    ids, loss_mask, _ = draft_train_loop.make_batch(samples, 32, 0)
    features = EngineFeatures.load(tiny_engine.engine("target"), [0, 1])
    extra = features(samples, ids.shape[1])
    outputs = extra["base_model_outputs"]
    assert outputs["aux_hidden_states"].shape == (4, ids.shape[1], 2 * 64)
    assert outputs["base_model_logits"].shape == (4, ids.shape[1], VOCAB)

    online = modelopt_eagle3.build_model(target, t, None, [0, 1])
    offline = modelopt_eagle3.build_model(target, t, None, [0, 1], offline=True)
    offline.eagle_module.load_state_dict(online.eagle_module.state_dict())
    assert not hasattr(offline.model, "layers")  # ModelOpt's offline mode dropped the target's decoder layers
    captured = []
    online.eagle_module.fc.register_forward_hook(lambda m, args, out: captured.append(args[0].detach()))
    for model in (online, offline):
        model.train()
        model._mask_cache = draft_train_loop._MaskCache(model)
        model._mask_cache.use(ids.shape[1])
    with torch.no_grad():
        a = online(input_ids=ids, loss_mask=loss_mask)
        b = offline(input_ids=ids, loss_mask=loss_mask, **extra)
    real = torch.zeros_like(ids, dtype=torch.bool)
    for row, s in enumerate(samples):
        real[row, : len(s.input_ids)] = True
    torch.testing.assert_close(outputs["aux_hidden_states"][real], captured[0][real], rtol=1e-3, atol=1e-3)
    # the engine's LM head holds bf16 weights (as served): logits within 1 % of their scale, the same greedy tokens
    scale = float(a.logits[real].abs().max())
    torch.testing.assert_close(b.logits[real], a.logits[real], rtol=0, atol=0.01 * scale)
    assert torch.equal(b.logits[real].argmax(-1), a.logits[real].argmax(-1))
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-3, atol=1e-3)


def test_training_on_engine_features_raises_heldout_acceptance_and_names_the_engine(tiny, tiny_engine):
    result = draft_train.train_recipe(
        engine_recipe(tiny[1], features="engine"), tiny_engine, echo=lambda *_: None, progress=False
    )
    before, after = result.initial_acceptance, result.acceptance
    assert before.positions == after.positions > 50
    assert after.per_position[0] > before.per_position[0] + 0.2, (before, after)
    manifest = artifacts.Manifest.read(tiny_engine.eagle3_head)
    build = artifacts.Manifest.read(tiny_engine.engine("target"))
    assert manifest.inputs["features_engine_fingerprint"] == build.fingerprint
    assert manifest.settings["train"]["features"] == "engine"


def test_top_k_labels_give_the_full_distributions_loss_within_the_tail_they_drop(tiny, tiny_engine):
    """draft.train.label_top_k: the loss on the target's top-k draft tokens (renormalized) is the loss on its whole
    draft-vocabulary distribution within 0.1 % here (k = 32 of 160: the tiny target puts nearly all of its mass on
    its first few tokens); labels read from the wrong columns move it by 1.5 % (the check tells them apart)."""
    from specdeploy.eagle3.features import EngineFeatures

    root, target, data = tiny
    samples = _samples(data / "heldout.jsonl")[:6]
    ids, loss_mask, _ = draft_train_loop.make_batch(samples, 32, 0)
    model, draft_ids = _offline_model(target, data, ids)
    full = EngineFeatures.load(tiny_engine.engine("target"), [0, 1])
    assert modelopt_eagle3.draft_target_ids(model).tolist() == draft_ids

    def loss(features):
        extra = features(samples, ids.shape[1])
        with torch.no_grad():
            return float(model(input_ids=ids, loss_mask=loss_mask, **extra).loss)

    whole = loss(full)
    top = full.top_k(32, draft_ids)
    labels = top(samples, ids.shape[1])["base_model_outputs"]["base_model_logits"]
    assert labels.shape == (6, ids.shape[1], len(draft_ids))
    assert abs(loss(top) - whole) <= 1e-3 * abs(whole), (loss(top), whole)
    assert abs(loss(full.top_k(32, list(range(len(draft_ids))))) - whole) > 5e-3 * abs(whole)


def _offline_model(target, data, ids):
    """The tiny target's offline model over the draft vocabulary of the training answers, ready for a forward."""
    t = Eagle3TrainConfig(**TRAIN)
    draft_ids = modelopt_eagle3.choose_draft_vocab(_samples(data / "train.jsonl"), VOCAB, t.draft_vocab_size)
    model = modelopt_eagle3.build_model(target, t, draft_ids, [0, 1], offline=True)
    modelopt_eagle3.accept_draft_space_logits(model)
    model.train()
    model._mask_cache = draft_train_loop._MaskCache(model)
    model._mask_cache.use(ids.shape[1])
    return model, draft_ids


def test_feature_cache_gives_the_engines_loss_bit_for_bit_and_a_wrong_column_moves_it(tiny, tiny_engine, tmp_path):
    """draft.train.feature_cache: a step fed from the cache (written on the samples' first use, read back by a fresh
    reader as a later epoch or a resumed run would) has the engine-fed step's tensors and loss, bit for bit; the same
    cache with every label moved to the next draft column gives another loss (the check would see a misread)."""
    from specdeploy.eagle3.feature_cache import CachedFeatures
    from specdeploy.eagle3.features import EngineFeatures

    root, target, data = tiny
    train = _samples(data / "train.jsonl")
    samples = train[3:9]
    ids, loss_mask, _ = draft_train_loop.make_batch(samples, 32, 0)
    model, draft_ids = _offline_model(target, data, ids)
    top = EngineFeatures.load(tiny_engine.engine("target"), [0, 1]).top_k(32, draft_ids)

    def loss(extra):
        with torch.no_grad():
            return model(input_ids=ids, loss_mask=loss_mask, **extra).loss

    from_engine = top(samples, ids.shape[1])
    first = CachedFeatures(top, tmp_path / "cache", train, 32, {})
    written = first(samples, ids.shape[1])
    assert first.computed == len(samples)
    again = CachedFeatures(top, tmp_path / "cache", train, 32, {})
    read = again(samples, ids.shape[1])
    assert again.computed == 0  # every sample from the disk
    for name, tensor in from_engine["base_model_outputs"].items():
        assert torch.equal(read["base_model_outputs"][name], tensor), name
        assert torch.equal(written["base_model_outputs"][name], tensor), name
    assert float(loss(read)) == float(loss(from_engine))

    arrays = again.cache.arrays
    arrays["top_ids"][:] = (arrays["top_ids"][:] + 1) % len(draft_ids)
    arrays["top_ids"].flush()
    shifted = CachedFeatures(top, tmp_path / "cache", train, 32, {})(samples, ids.shape[1])
    assert abs(float(loss(shifted)) - float(loss(from_engine))) > 1e-3 * abs(float(loss(from_engine)))


def test_feature_cache_is_emptied_when_the_samples_or_the_engine_change(tiny, tiny_engine, tmp_path):
    from specdeploy.eagle3.feature_cache import CachedFeatures
    from specdeploy.eagle3.features import EngineFeatures

    root, target, data = tiny
    train = _samples(data / "train.jsonl")
    draft_ids = list(range(160))
    engine = EngineFeatures.load(tiny_engine.engine("target"), [0, 1], identity="engine-1")
    folder = tmp_path / "cache"

    def cached_after_a_step(samples, features):
        cache = CachedFeatures(features.top_k(8, draft_ids), folder, samples, 32, {})
        before = [cache.cache.cached(i) for i in range(4)]
        cache(samples[:4], 32)
        return before

    assert cached_after_a_step(train, engine) == [False] * 4
    assert cached_after_a_step(train, engine) == [True] * 4  # the same samples and engine: kept
    changed = list(train)
    changed[10] = replace(changed[10], input_ids=changed[10].input_ids[:-1] + (changed[10].input_ids[-1] + 1,))
    assert cached_after_a_step(changed, engine) == [False] * 4  # one token of another sample changed
    assert cached_after_a_step(changed, engine) == [True] * 4
    other = EngineFeatures(engine.engine, [0, 1], identity="engine-2")  # another build (another target or format)
    assert cached_after_a_step(changed, other) == [False] * 4
    assert cached_after_a_step(changed, other) == [True] * 4
    cache = CachedFeatures(other.top_k(16, draft_ids), folder, changed, 32, {})  # another k
    assert not cache.cache.cached(0)
    assert sorted(p.name for p in folder.parent.iterdir()) == ["cache"]  # no temporary folder left


def test_a_resumed_run_reads_its_features_from_the_cache_and_ends_with_the_uncached_runs_weights(
    tiny, tiny_engine, tmp_path
):
    """A run interrupted in its second epoch resumes with every training sample's features read from the cache the
    first epoch wrote (the engine computes none), and ends with the weights of a run without the cache, bit for bit."""
    from specdeploy.eagle3.feature_cache import CachedFeatures
    from specdeploy.eagle3.features import EngineFeatures

    root, target, data = tiny
    t = Eagle3TrainConfig(**{**TRAIN, "epochs": 2.0, "features": "engine", "label_top_k": 8})
    d = draft_samples.read_draft_data(data, VOCAB)
    draft_ids = modelopt_eagle3.choose_draft_vocab(d.train, VOCAB, t.draft_vocab_size)
    features = EngineFeatures.load(tiny_engine.engine("target"), [0, 1])

    def run(work: Path, cache: bool, stop=None):
        model = modelopt_eagle3.build_model(target, t, draft_ids, [0, 1], offline=True)
        modelopt_eagle3.accept_draft_space_logits(model)
        top = features.top_k(t.label_top_k, draft_ids)
        steps = CachedFeatures(top, tmp_path / "cache", d.train, t.seq_len, {}) if cache else top
        try:
            _train_quietly(model, d, t, work, stop, features=features, step_features=steps)
        finally:
            computed = steps.computed if cache else None
        return model.eagle_module.state_dict(), computed

    straight, _ = run(tmp_path / "straight", cache=False)
    steps_per_epoch = -(-len(d.train) // t.batch_size)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "interrupted", cache=True, stop=steps_per_epoch + 1)
    resumed, computed = run(tmp_path / "interrupted", cache=True)
    assert computed == 0
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key


def test_draft_train_with_feature_cache_exports_the_uncached_runs_head_and_keeps_the_features(
    tiny, tiny_engine, tmp_path
):
    """`draft train` with draft.train.feature_cache: the exported head is the one trained without it, bit for bit, and
    every training sample's features stay beside the head for the next run."""
    from safetensors.torch import load_file

    from specdeploy.eagle3.feature_cache import KEY_FILE

    heads, layouts = {}, {}
    for cache in (False, True):
        layout = layouts[cache] = artifacts.Layout(tmp_path / str(cache), "tiny-eagle3-topk")
        shutil.copytree(tiny_engine.engines, layout.engines, ignore=shutil.ignore_patterns("eagle3-head*"))
        recipe = engine_recipe(tiny[1], features="engine", label_top_k=8, feature_cache=cache, epochs=3.0)
        draft_train.train_recipe(recipe, layout, echo=lambda *_: None, progress=False)
        heads[cache] = load_file(str(layout.eagle3_head / "model.safetensors"))
    assert heads[True].keys() == heads[False].keys()
    for key, tensor in heads[False].items():
        assert torch.equal(heads[True][key], tensor), key
    folder = draft_train.feature_cache_dir(layouts[True].eagle3_head)
    assert json.loads((folder / KEY_FILE).read_text())["k"] == 8
    assert (folder / "done.bin").read_bytes() == bytes([1]) * len(_samples(tiny[2] / "train.jsonl"))
    assert not draft_train.feature_cache_dir(layouts[False].eagle3_head).exists()


def test_ttt_attention_runs_on_the_fused_kernel_with_the_math_paths_loss(tiny, tiny_engine):
    """The training-time test's attention on torch's fused CPU kernel (modelopt_eagle3.fused_ttt_attention) gives the
    loss of ModelOpt's math path within 1e-6 (fp32; equal here) and its gradients within 1e-5 of their scale (6e-7
    here); the profiler sees the fused kernel, and not the math path, run."""
    from torch.profiler import profile

    from specdeploy.eagle3.features import EngineFeatures

    root, target, data = tiny
    samples = _samples(data / "heldout.jsonl")[:6]
    ids, loss_mask, _ = draft_train_loop.make_batch(samples, 32, 0)
    model, draft_ids = _offline_model(target, data, ids)
    extra = EngineFeatures.load(tiny_engine.engine("target"), [0, 1]).top_k(32, draft_ids)(samples, ids.shape[1])

    def step():
        model.zero_grad(set_to_none=True)
        with profile() as prof:
            loss = model(input_ids=ids, loss_mask=loss_mask, **extra).loss
            loss.backward()
        ops = {e.key for e in prof.key_averages()}
        return (
            float(loss.detach()),
            {n: p.grad.clone() for n, p in model.eagle_module.named_parameters() if p.grad is not None},
            ops,
        )

    fused_loss, fused_grads, fused_ops = step()
    model._enable_cp_ttt = type(model)._enable_cp_ttt.__get__(model)  # ModelOpt's own: SDPA's math path
    math_loss, math_grads, math_ops = step()
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in fused_ops
    assert "aten::_scaled_dot_product_attention_math" not in fused_ops
    assert "aten::_scaled_dot_product_attention_math" in math_ops
    assert abs(fused_loss - math_loss) <= 1e-6 * abs(math_loss), (fused_loss, math_loss)
    for name, grad in math_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=0, atol=1e-5 * float(grad.abs().max()) + 1e-12)


def test_training_on_top_k_labels_raises_heldout_acceptance(tiny, tiny_engine, tmp_path):
    layout = artifacts.Layout(tmp_path, "tiny-eagle3-topk")  # its own head folder: the engine and data copied
    shutil.copytree(tiny_engine.engines, layout.engines, ignore=shutil.ignore_patterns("eagle3-head*"))
    recipe = engine_recipe(tiny[1], features="engine", label_top_k=8)
    result = draft_train.train_recipe(recipe, layout, echo=lambda *_: None, progress=False)
    before, after = result.initial_acceptance, result.acceptance
    assert before.positions == after.positions > 50
    assert after.per_position[0] > before.per_position[0] + 0.2, (before, after)
    assert artifacts.Manifest.read(layout.eagle3_head).settings["train"]["label_top_k"] == 8


def test_acceptance_losses_are_minus_log_and_one_minus_the_overlap_of_the_two_distributions():
    """draft.train.loss lk / tv on hand-made distributions: alpha = sum min(p, q) per position, lk the masked mean of
    -log alpha, tv of 1 - alpha; masked positions count for nothing; a head equal to the target loses nothing."""
    p = torch.tensor([[[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [1.0, 0.0, 0.0]]])  # [B 1, S 3, V 3]
    q = torch.tensor([[[0.5, 0.5, 0.0], [0.1, 0.1, 0.8], [0.0, 0.0, 1.0]]])
    logits = q.clamp_min(1e-12).log()
    mask = torch.tensor([[1, 1, 0]])  # the third position (disjoint support) is not an answer token
    alphas = [0.5 + 0.2 + 0.0, 1.0]
    lk = modelopt_eagle3.acceptance_loss("lk", p, logits, mask)
    tv = modelopt_eagle3.acceptance_loss("tv", p, logits, mask)
    assert lk.item() == pytest.approx(sum(-math.log(a) for a in alphas) / 2, rel=1e-4)
    assert tv.item() == pytest.approx(sum(1 - a for a in alphas) / 2, rel=1e-4)
    everything = modelopt_eagle3.acceptance_loss("lk", p, logits, torch.ones(1, 3))
    assert everything.item() == pytest.approx((-math.log(0.7) - math.log(1e-6)) / 3, rel=1e-3)  # clamped, finite
    assert modelopt_eagle3.acceptance_loss("lk", p, p.log(), mask).item() == pytest.approx(0.0, abs=1e-5)
    # the gradient flows to the head's logits and raises the overlap
    logits = logits.clone().requires_grad_(True)
    modelopt_eagle3.acceptance_loss("lk", p, logits, mask).backward()
    assert logits.grad[0, 0, 1] > 0 > logits.grad[0, 0, 0]  # less of the over-drafted token, more of the likely one


def test_training_on_the_lk_loss_raises_heldout_acceptance_and_replaces_modelopts_loss(tiny, tmp_path):
    """draft.train.loss lk: the step's loss is -log alpha (<= ttt_steps * -log 1e-6, and not ModelOpt's cross-entropy
    on the same batch), the position accuracy is ModelOpt's, and a short run raises held-out acceptance."""
    root, target, data = tiny
    t = Eagle3TrainConfig(**TRAIN)
    samples = _samples(data / "heldout.jsonl")[:6]
    ids, loss_mask, _ = draft_train_loop.make_batch(samples, 32, 0)
    draft_ids = modelopt_eagle3.choose_draft_vocab(_samples(data / "train.jsonl"), VOCAB, t.draft_vocab_size)
    outs = {}
    for kind in ("kl", "lk", "tv"):
        torch.manual_seed(0)
        model = modelopt_eagle3.build_model(target, t, draft_ids, [0, 1])
        modelopt_eagle3.use_loss(model, kind)
        model.train()
        model._mask_cache = draft_train_loop._MaskCache(model)
        model._mask_cache.use(ids.shape[1])
        with torch.no_grad():
            outs[kind] = model(input_ids=ids, loss_mask=loss_mask)
    assert outs["kl"].train_acc == outs["lk"].train_acc == outs["tv"].train_acc
    assert 0 < float(outs["tv"].loss) <= t.ttt_steps  # a sum over the steps of 1 - alpha (decayed)
    assert float(outs["lk"].loss) > float(outs["tv"].loss)  # -log a > 1 - a
    assert float(outs["lk"].loss) != pytest.approx(float(outs["kl"].loss), rel=1e-3)

    recipe = recipe_for(target, loss="lk")
    layout = layout_with_data(tmp_path, data, recipe, "lk")
    lines = []
    result = draft_train.train_recipe(recipe, layout, echo=lines.append, progress=False)
    before, after = result.initial_acceptance, result.acceptance
    assert after.per_position[0] > before.per_position[0] + 0.2, (before, after)
    assert artifacts.Manifest.read(layout.eagle3_head).settings["train"]["loss"] == "lk"
    assert any("loss: lk" in line for line in lines)


def test_a_head_trained_further_starts_where_the_exported_one_ended(tiny, tmp_path):
    """init_head: the second run's untrained acceptance is the first run's final one (its weights and d2t loaded),
    and it trains on from there; the fingerprint names the head it started from."""
    root, target, data = tiny
    first_recipe = recipe_for(target, epochs=2.0)
    first_layout = layout_with_data(tmp_path, data, first_recipe, "first")
    first = draft_train.train_recipe(first_recipe, first_layout, echo=lambda *_: None, progress=False)
    head = first_layout.eagle3_head
    second_recipe = recipe_for(target, epochs=2.0, init_head=str(head), learning_rate=5e-3)
    second_layout = layout_with_data(tmp_path, data, second_recipe, "second")
    lines = []
    second = draft_train.train_recipe(second_recipe, second_layout, echo=lines.append, progress=False)
    assert second.initial_acceptance == first.acceptance
    assert second.acceptance.mean_accepted > first.acceptance.mean_accepted
    assert any(str(head) in line for line in lines)
    manifest = artifacts.Manifest.read(second_layout.eagle3_head)
    assert (
        manifest.inputs["init_head_hash"] == artifacts.head_hash(head) != artifacts.dir_hash(head)
    )  # the export wrote counts
    # counting the start head's answers again (`draft vocab-counts`) leaves the head trained from it up to date
    counts = json.loads((head / EAGLE3_VOCAB_COUNTS).read_text())
    (head / EAGLE3_VOCAB_COUNTS).write_text(json.dumps({**counts, "counts": [c + 1 for c in counts["counts"]]}))
    assert draft_train.train_recipe(second_recipe, second_layout, echo=(again := []).append, progress=False) is None
    assert any("up to date" in line for line in again)
    from safetensors.torch import load_file

    assert torch.equal(
        load_file(str(head / "model.safetensors"))["d2t"],
        load_file(str(second_layout.eagle3_head / "model.safetensors"))["d2t"],
    )
    # a head that reads other layers is refused, naming the setting
    with pytest.raises(ConfigError, match="init_head") as err:
        draft_train.train_recipe(
            recipe_for(target, init_head=str(head), aux_layers=(1, 3)),
            second_layout,
            echo=lambda *_: None,
            progress=False,
        )
    assert "aux_layers" in err.value.hint
    # so is one of another draft vocabulary size (its d2t and LM head would not load), before any work
    size = json.loads((head / "config.json").read_text())["draft_vocab_size"]
    with pytest.raises(ConfigError, match=f"drafts over {size} tokens") as err:
        draft_train.train_recipe(
            recipe_for(target, init_head=str(head), draft_vocab_size=size + 8),
            second_layout,
            echo=lambda *_: None,
            progress=False,
        )
    assert f"draft_vocab_size: {size}" in err.value.hint


def test_length_grouping_takes_every_sample_once_in_batches_of_like_lengths():
    import random

    rng = random.Random(3)
    lengths = [rng.randint(20, 400) for _ in range(1000)]
    t = Eagle3TrainConfig(batch_size=8, seed=5, length_grouping=True)
    plain = draft_train_loop.epoch_batches(lengths, replace(t, length_grouping=False), 0)
    grouped = draft_train_loop.epoch_batches(lengths, t, 0)
    assert len(grouped) == len(plain) == 125 and all(len(b) == 8 for b in grouped)
    assert sorted(i for b in grouped for i in b) == list(range(1000))
    assert grouped == draft_train_loop.epoch_batches(lengths, t, 0)  # a function of (seed, epoch): resumable
    assert grouped != draft_train_loop.epoch_batches(lengths, t, 1)

    def padded(batches):
        return sum(len(b) * max(lengths[i] for i in b) for b in batches)

    assert padded(grouped) < 0.75 * padded(plain), (padded(grouped), padded(plain))


def test_new_train_keys_at_their_defaults_keep_a_heads_fingerprint_and_bad_ones_are_refused():
    from specdeploy.core.artifacts import fingerprint
    from specdeploy.recipe.config import to_plain

    recipe = recipe_for(Path("/nonexistent"))
    old = {
        k: v
        for k, v in to_plain(recipe.draft.train).items()
        if k
        not in (
            "features",
            "init_head",
            "length_grouping",
            "data_dir",
            "label_top_k",
            "heldout_samples",
            "loss",
            "feature_cache",
        )
    }
    assert draft_train.stage_fingerprint(recipe, "t", "d") == fingerprint(
        stage=draft_train.STAGE, target="t", data="d", train=old
    )
    # the cache gives the engine's bits: with it or without, the same head (a run resumes across the switch)
    cached = recipe_for(Path("/nonexistent"), features="engine", label_top_k=8, feature_cache=True)
    assert draft_train.stage_fingerprint(cached, "t", "d") == draft_train.stage_fingerprint(
        recipe_for(Path("/nonexistent"), features="engine", label_top_k=8), "t", "d"
    )
    with pytest.raises(ConfigError, match="feature_cache' needs draft.train.label_top_k"):
        recipe_for(Path("/x"), features="engine", feature_cache=True)
    assert draft_train.stage_fingerprint(
        recipe_for(Path("/nonexistent"), length_grouping=True), "t", "d"
    ) != draft_train.stage_fingerprint(recipe, "t", "d")
    with pytest.raises(ConfigError, match="draft.train.features"):
        recipe_for(Path("/x"), features="gpu")
    with pytest.raises(ConfigError, match="init_head"):
        recipe_for(Path("/x"), init_head="trained")
    with pytest.raises(ConfigError, match="label_top_k' needs draft.train.features: engine"):
        recipe_for(Path("/x"), label_top_k=8)
    with pytest.raises(ConfigError, match="label_top_k' is -1"):
        recipe_for(Path("/x"), features="engine", label_top_k=-1)
    with pytest.raises(ConfigError, match="heldout_samples' is -1"):
        recipe_for(Path("/x"), heldout_samples=-1)
    assert draft_train.stage_fingerprint(
        recipe_for(Path("/nonexistent"), loss="lk"), "t", "d"
    ) != draft_train.stage_fingerprint(recipe, "t", "d")
    with pytest.raises(ConfigError, match="(?s)draft.train.loss.*kl, lk, tv"):
        recipe_for(Path("/x"), loss="ce")
    with pytest.raises(ConfigError, match="draft.train.features' is engine on backend trtllm-llmapi") as err:
        parse_recipe(
            {
                "name": "x",
                "backend": "trtllm-llmapi",
                "target": {"model": "/x"},
                "draft": {"kind": "eagle3", "head": "trained", "train": {"features": "engine"}},
                "speculative": {"max_draft_len": 4, "num_draft_tokens": 3},
            }
        )
    assert "backend cpu" in err.value.hint


def test_checkpoint_bench_measures_the_runs_head_and_its_start_with_the_runs_own_measure(tiny, tiny_engine):
    """bench/eagle3_checkpoint.py: a recipe starting from a trained head, a resume checkpoint holding the untrained
    head: the rows are those heads' held-out acceptance as draft train measured them (engine features)."""
    bench = bench_modules.load("eagle3_checkpoint")
    head = tiny_engine.eagle3_head
    if not (head / "model.safetensors").is_file():  # the engine-features run above (module order), else its own
        draft_train.train_recipe(
            engine_recipe(tiny[1], features="engine"), tiny_engine, echo=lambda *_: None, progress=False
        )
    trained = artifacts.Manifest.read(head).extra["heldout_acceptance"]
    recipe = engine_recipe(tiny[1], name="tiny-eagle3-engine", features="engine", init_head=str(head))
    t = recipe.draft.train
    from safetensors.torch import load_file

    d2t = load_file(str(head / "model.safetensors"))["d2t"]
    # the checkpoint holds the untrained head (the training run's seed), the start row the trained one
    model = modelopt_eagle3.build_model(
        tiny[1], replace(t, init_head=""), (torch.arange(len(d2t)) + d2t).tolist(), [0, 1], offline=True
    )
    untrained = artifacts.Manifest.read(head).extra["untrained_acceptance"]
    partial = draft_train.resume_dir(tiny_engine.eagle3_head)
    partial.mkdir(exist_ok=True)
    torch.save(
        {"head": model.eagle_module.state_dict(), "step": 3, "total_steps": 9}, partial / draft_train_loop.RESUME_STATE
    )
    try:
        lines = []
        result = bench.measure(recipe, tiny_engine, 1000, echo=lines.append)
    finally:
        shutil.rmtree(partial)
    assert result["step"] == 3 and result["samples"] == 8
    assert (
        result["start"]["per_position"] == trained["per_position"]
        and result["start"]["positions"] == trained["positions"] > 50
    )
    assert result["checkpoint"]["per_position"] == untrained["per_position"] != trained["per_position"]
    assert any("step 3 of 9" in line for line in lines)


def test_data_dir_trains_on_another_recipes_data_and_its_absence_names_the_folder(tiny, tmp_path):
    root, target, data = tiny
    recipe = recipe_for(target, epochs=1.0, data_dir=str(data))
    layout = artifacts.Layout(tmp_path / "elsewhere", recipe.name)  # no draft-data of its own
    draft_train.train_recipe(recipe, layout, echo=lambda *_: None, progress=False)
    assert artifacts.Manifest.read(layout.eagle3_head).inputs["data_dir"] == str(data)
    with pytest.raises(SpecDeployError, match=str(tmp_path / "missing")):
        draft_train.train_recipe(
            recipe_for(target, data_dir=str(tmp_path / "missing")), layout, echo=lambda *_: None, progress=False
        )


def test_data_curve_trains_nested_parts_of_one_folder_and_measures_each_on_the_same_heldout(tiny, tmp_path, capsys):
    """bench/eagle3_data_curve.py on the tiny target: the parts are prefixes of one order of the training samples up to
    a share of the answer tokens (a source variant takes that budget from one source), every head is measured on the
    same held-out samples, the full part's head beats its untrained start, and a rerun finds every head up to date."""
    import yaml

    curve = bench_modules.load("eagle3_data_curve")
    _, target, data = tiny
    records = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    for i, record in enumerate(records):
        record["source"] = "odd" if i % 2 else "even"
    heldout = [json.loads(line) for line in (data / "heldout.jsonl").read_text().splitlines()]
    source = tmp_path / "data"
    write_data(source, records, heldout, fingerprint="data-curve")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "name": "tiny-eagle3",
                "target": {"model": str(target)},
                "draft": {"kind": "eagle3", "head": "trained", "train": TRAIN},
                "speculative": {"max_draft_len": 4, "num_draft_tokens": 3},
            }
        )
    )
    work, out = tmp_path / "work", tmp_path / "curve.json"
    args = [
        "--recipe",
        str(recipe),
        "--root",
        str(tmp_path),
        "--data",
        str(source),
        "--fractions",
        "0.25,1",
        "--variant",
        "odd:source=odd",
        "--variant",
        "slow:learning_rate=0.001",
        "--variant-fraction",
        "0.5",
        "--heldout",
        "6",
        "--work",
        str(work),
        "--out",
        str(out),
    ]
    assert curve.main(args) == 0
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ["f0.25", "f1", "odd", "slow"]

    def ids(part: str) -> list[str]:
        return [json.loads(line)["id"] for line in (work / "data" / part / "train.jsonl").read_text().splitlines()]

    # every answer is ANSWER_LEN tokens: a quarter of 16 answers' tokens is 4 samples, the first 4 of the full part's
    # order
    assert rows["f1"]["answer_tokens"] == 16 * ANSWER_LEN and rows["f1"]["train_samples"] == 16
    assert rows["f0.25"]["answer_tokens"] == 4 * ANSWER_LEN and ids("0.25") == ids("1")[:4]
    assert sorted(ids("1")) == sorted(r["id"] for r in records)
    # half the tokens from one source: all 8 of its samples, none of the other's
    assert sorted(ids("odd-0.5")) == sorted(r["id"] for r in records if r["source"] == "odd")
    assert rows["slow"]["train"]["learning_rate"] == 0.001 and rows["slow"]["answer_tokens"] == 8 * ANSWER_LEN
    slow_manifest = artifacts.Manifest.read(Path(rows["slow"]["head"]))
    assert slow_manifest.settings["train"]["learning_rate"] == 0.001
    assert slow_manifest.inputs["data_dir"] == str(work / "data" / "0.5")
    # the same held-out positions for every head: the first 6 held-out samples, never trained on
    positions = {r["heldout"]["positions"] for r in rows.values()}
    assert len(positions) == 1 and positions.pop() > 0
    assert (work / "data" / "1" / "heldout.jsonl").read_text().splitlines() == (
        data / "heldout.jsonl"
    ).read_text().splitlines()[:6]
    part = artifacts.Manifest.read(work / "data" / "0.25")
    assert part.inputs["part_of_fingerprint"] == "data-curve" and part.extra["part"]["train_samples"] == 4
    assert part.fingerprint != artifacts.Manifest.read(work / "data" / "1").fingerprint
    full = rows["f1"]
    assert sum(full["heldout"]["accepted_at_least"]) > sum(full["untrained"]["accepted_at_least"])
    assert isinstance(result["slope_per_doubling"], float)
    capsys.readouterr()
    # nothing changed: every part and head up to date; a head made elsewhere (here the full part's) is measured alike
    assert curve.main(args + ["--reference", f"same={full['head']}"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("eagle3 head: up to date") == 4 and "untrained head" not in printed
    assert json.loads(out.read_text())["references"] == [
        {"name": "same", "head": full["head"], "heldout": full["heldout"]}
    ]


def test_heldout_samples_measures_a_seeded_subset_of_the_held_out_samples(tiny):
    from dataclasses import replace

    _, _, data_dir = tiny
    data = draft_samples.read_draft_data(data_dir, VOCAB)
    assert len(data.heldout) >= 3
    cut = replace(recipe_for(Path("/x")).draft.train, heldout_samples=2)
    subset = draft_train.heldout_subset(data, cut).heldout
    assert len(subset) == 2 and set(subset) <= set(data.heldout)
    assert subset == draft_train.heldout_subset(data, cut).heldout  # the same seed: the same samples
    assert list(subset) == [s for s in data.heldout if s in subset]  # in the file's order
    assert draft_train.heldout_subset(data, replace(cut, heldout_samples=0)) is data
    assert draft_train.heldout_subset(data, replace(cut, heldout_samples=len(data.heldout))) is data
