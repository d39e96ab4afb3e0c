"""bench/round_profile.py on the tiny bf16 target and a random head: every part of every pass and of the head gets its
time, the tables come out in one-row steps, and the engine and head are as they were afterwards (the timers are
hooks around their own methods, taken off again)."""

from __future__ import annotations

import bench_modules
import pytest
import torch
from eagle3_heads import make_eagle3_head
from tiny_models import make_tiny_model

from specdeploy.engine import native
from specdeploy.engine.eagle3 import Eagle3Head

pytestmark = pytest.mark.skipif(
    not native.cpu_supported() or native.ops() is None, reason="the profile times the native decoder's parts"
)


@pytest.mark.parametrize("one_call", [True, False])
def test_the_round_profile_times_every_part_and_leaves_engine_and_head_as_they_were(
    tmp_path, tiny_tokenizer_dir, one_call
):
    """The head's parts are timed inside its one native call, or around its ops where it runs op by op."""
    from tests.test_eagle3_fused import AUX, _engine

    make_tiny_model(tmp_path / "hf", tiny_tokenizer_dir, seed=0, num_hidden_layers=4)
    engine = _engine(tmp_path / "hf", tmp_path / "engine", "bfloat16")
    head = Eagle3Head.load(make_eagle3_head(tmp_path / "head", 64, 512, AUX), engine)
    assert engine.decoder is not None and engine.screen is not None
    assert head.one_call is not None
    if not one_call:
        head.one_call = None  # as where the native head cannot run
    lm_head = head.lm_head
    rp = bench_modules.load("round_profile")
    context = torch.randint(4, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    before = engine.forward(engine.new_cache(), torch.tensor(context))

    result = rp.profile(engine, head, context, repeats=1, threads=2, draft_len=3)

    assert set(result["passes"]) == {"step"} | {f"pass {m}" for m in rp.ROWS}
    assert result["passes"]["step"]["total"] == 1.0 and result["head_one_call"] == one_call
    for parts in result["passes"].values():
        assert all(parts[p] > 0 for p in ("linears", "attention", "norms+rope", "lm head", "screen alone"))
    assert all(result["passes"][f"pass {m}"]["verify"] > 0 for m in rp.ROWS)
    assert set(result["head"]) == {f"catch-up {n}" for n in rp.CATCH_UP} | {"draft step", "head round 3"}
    assert all(h["total"] > 0 and h["lm head"] > 0 for h in result["head"].values())
    assert result["head"]["catch-up 1"]["fc"] > 0 and result["head"]["draft step"]["fc"] == 0
    # where the one call runs, the same head work op by op in turns beside it
    expected = {"catch-up 2", "draft step", "head round 3"} if one_call else set()
    assert set(result["head_op_by_op"]) == expected and all(t > 0 for t in result["head_op_by_op"].values())
    assert result["floors"]["bytes"]["linears"] > 0 and result["read_gb_s"] > 0
    # the hooks are off again: the engine's and head's own methods, the same bits
    assert not {"_logits", "_norm", "_native_batch"} & set(vars(engine)) and "project" not in vars(head)
    assert head.lm_head is lm_head
    assert torch.equal(engine.forward(engine.new_cache(), torch.tensor(context)), before)


def test_the_batched_round_profile_times_the_rounds_of_requests_in_flight_together(tmp_path, tiny_tokenizer_dir):
    """Two requests in one BatchScheduler, as served: every timed step is a round of both, split into the heads, the
    shared pass and the rest in the control's batched steps; the outputs are the target's alone."""
    import types

    from transformers import AutoTokenizer

    from tests.test_eagle3_fused import AUX, _engine

    make_tiny_model(tmp_path / "hf", tiny_tokenizer_dir, seed=0, num_hidden_layers=4)
    engine = _engine(tmp_path / "hf", tmp_path / "engine", "bfloat16")
    head = Eagle3Head.load(make_eagle3_head(tmp_path / "head", 64, 512, AUX), engine)
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    recipe = types.SimpleNamespace(speculative=types.SimpleNamespace(draft_p_min=0.0))
    args = types.SimpleNamespace(concurrency=2, draft_len=3, prompts=4, max_tokens=12, round_repeats=2)
    rp = bench_modules.load("round_profile")

    gen = torch.Generator().manual_seed(5)
    prompts = [(str(i), torch.randint(4, 512, (20 + 3 * i,), generator=gen).tolist()) for i in range(4)]

    r = rp.batched_round_section(args, recipe, engine, head, tokenizer, prompts)

    assert r["concurrency"] == 2 and r["prompts"] == 4 and r["identical_outputs"] is True
    assert r["steps_timed"] > 0 and r["head_steps"] > 0 and r["pass_steps"] > 0
    # the three parts are the round: the pass and the heads inside the interval between two passes' ends
    assert r["head_steps"] + r["pass_steps"] < r["round_steps"]
    assert r["rest_steps"] == pytest.approx(r["round_steps"] - r["head_steps"] - r["pass_steps"])
    assert r["tpot_speedup"] == pytest.approx(r["tokens_per_pass"] / r["round_steps"])
    assert 1 <= r["tokens_per_pass"] <= args.draft_len + 1
