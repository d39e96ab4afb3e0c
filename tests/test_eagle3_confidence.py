"""bench/eagle3_confidence.py's pure parts: acceptance by the head's probability and the cut-off sweep, on rounds
whose numbers are worked out by hand."""

from __future__ import annotations

import bench_modules
import pytest

ROUNDS = [  # k = 3: the head's probability of each draft, and how many of the round's drafts the target accepted
    {"probabilities": [0.95, 0.9, 0.8], "accepted": 3},
    {"probabilities": [0.55, 0.15, 0.9], "accepted": 2},
    {"probabilities": [0.05, 0.5, 0.5], "accepted": 0},
    {"probabilities": [0.12, 0.5, 0.5], "accepted": 1},
]


def test_first_draft_acceptance_by_probability_bins():
    conf = bench_modules.load("eagle3_confidence")
    assert conf.by_probability(ROUNDS) == [(0.0, 1, 0.0), (0.1, 1, 1.0), (0.5, 1, 1.0), (0.9, 1, 1.0)]


def test_sweep_cuts_each_round_at_its_first_draft_below_the_cut_and_costs_it():
    conf = bench_modules.load("eagle3_confidence")
    rows, catch_up, step = (1.0, 1.1, 1.2, 1.3, 1.4), 0.2, 0.1
    table = {row["draft_p_min"]: row for row in conf.sweep(ROUNDS, rows, catch_up, step, rule="draft")}
    # no cut-off: 3 drafts every round, 6 accepted; each round costs 1.3 + the catch-up + 2 later steps
    assert table[0.0]["k_per_round"] == 3 and table[0.0]["accepted_per_round"] == 6 / 4
    assert table[0.0]["estimated_speedup"] == pytest.approx((4 + 6) / (4 * 1.7))
    # each draft at 0.2: rounds draft 3, 1 (0.15 < 0.2 stops the second, after the step that computed it), 0, 0
    assert table[0.2]["k_per_round"] == 4 / 4 and table[0.2]["accepted_per_round"] == 4 / 4
    costs = (1.3 + 0.2 + 0.2) + (1.1 + 0.2 + 0.1) + 2 * (1.0 + 0.2)
    assert table[0.2]["estimated_speedup"] == pytest.approx((4 + 4) / costs)
    # 0.7 keeps only the sure round
    assert table[0.7]["k_per_round"] == 3 / 4 and table[0.7]["accepted_per_round"] == 3 / 4


def test_the_chain_rule_cuts_where_the_product_of_the_drafts_probabilities_falls_below_the_cut():
    """The engine's rule (Eagle3Drafter.draft_steps): 0.95 x 0.9 x 0.8 = 0.684 keeps all three at 0.5 and two at 0.7,
    where each draft alone keeps three; 0.55 x 0.15 = 0.0825 stops the second draft at 0.1."""
    conf = bench_modules.load("eagle3_confidence")
    assert [conf.kept(ROUNDS[0]["probabilities"], cut, "chain") for cut in (0.5, 0.7, 0.86, 0.96)] == [3, 2, 1, 0]
    assert [conf.kept(ROUNDS[0]["probabilities"], cut, "draft") for cut in (0.5, 0.7, 0.86, 0.96)] == [3, 3, 2, 0]
    table = {row["draft_p_min"]: row for row in conf.sweep(ROUNDS, rule="chain")}
    # 0.1: rounds keep 3 (0.684), 1 (0.0825 < 0.1), 0 (0.05), 1 (0.12, then 0.06); accepted 3 + 1 + 0 + 1
    assert table[0.1]["k_per_round"] == 5 / 4 and table[0.1]["accepted_per_round"] == 5 / 4
    rows, catch_up, step = conf.ROWS, conf.CATCH_UP, conf.HEAD_STEP
    costs = (rows[3] + catch_up + 2 * step) + 2 * (rows[1] + catch_up + step) + (rows[0] + catch_up)
    assert table[0.1]["estimated_speedup"] == pytest.approx((4 + 5) / costs)


def test_acceptance_by_group_is_per_category_or_source_and_per_draft_position():
    conf = bench_modules.load("eagle3_confidence")
    rounds = [dict(r, prompt=p) for r, p in zip(ROUNDS, ("code-0", "code-1", "chat-0", "calibration-12-3/0"))]
    groups = {name: (n, mean, shares) for name, n, mean, shares in conf.by_group(rounds, 3)}
    assert groups["code"] == (2, 2.5, [1.0, 1.0, 0.5])  # accepted 3 and 2: both rounds kept drafts 1 and 2
    assert groups["chat"] == (1, 0.0, [0.0, 0.0, 0.0]) and groups["calibration"] == (1, 1.0, [1.0, 0.0, 0.0])
    assert groups["all"] == (4, 1.5, [0.75, 0.5, 0.25])


def test_acceptance_split_by_whether_the_drafted_position_repeats_the_prompt():
    conf = bench_modules.load("eagle3_confidence")
    rounds = [dict(r, repeats_prompt=flag) for r, flag in zip(ROUNDS, (True, False, True, False))]
    assert conf.by_repeat(rounds) == [("repeats the prompt", 2, 0.5, 1.5), ("other", 2, 1.0, 1.5)]
    assert conf.by_repeat([dict(ROUNDS[0], repeats_prompt=False)]) == [("other", 1, 1.0, 3.0)]


def test_record_rounds_and_the_lookup_bench_drive_the_real_fused_loop(tmp_path, tiny_tokenizer_dir):
    """The benches' engine parts on a tiny target with a random head: record_rounds wraps the executor's own drafter
    (its rounds' probabilities and acceptance recorded, the output the target's), and eagle3_lookup.measure counts
    the lookup's rounds within the passes; both broke silently before when the drafter's signature changed."""
    from eagle3_heads import make_eagle3_head
    from tiny_models import make_tiny_model

    from specdeploy.deploy.cpu_compile import compile_checkpoint
    from specdeploy.engine.eagle3 import Eagle3Head
    from specdeploy.engine.executor import Executor
    from specdeploy.engine.model import CpuEngine
    from specdeploy.engine.request import EngineRequest, run
    from specdeploy.quantize.modelopt import quantize_model
    from specdeploy.recipe.config import EngineConfig, QuantConfig

    make_tiny_model(tmp_path / "model", tiny_tokenizer_dir, seed=0, num_hidden_layers=4)
    quantize_model(tmp_path / "model", QuantConfig(), tmp_path / "ckpt", progress=False)
    compile_checkpoint(
        tmp_path / "ckpt", tmp_path / "engine", EngineConfig(dtype="float32", max_input_len=128, max_seq_len=256), 8
    )
    engine = CpuEngine.load(tmp_path / "engine")
    head = Eagle3Head.load(make_eagle3_head(tmp_path / "head", 64, 512, (0, 1, 2)), engine)
    prompts = [("a", [5, 6, 7, 8, 9, 5, 6, 7]), ("b", [40, 41, 42, 43])]
    conf = bench_modules.load("eagle3_confidence")
    rounds = conf.record_rounds(Executor(engine, 2, head=head), head, prompts, 12, 3, None)
    assert rounds and all(len(r["probabilities"]) == 3 and 0 <= r["accepted"] <= 3 for r in rounds)
    assert all(0.0 < p <= 1.0 for r in rounds for p in r["probabilities"])
    # prompt "a" repeats itself (5 6 7 twice): a round is flagged exactly when its first drafted token and the one
    # before it are a bigram of the prompt
    for prompt_id, ids in prompts:
        sequence = list(ids) + run(Executor(engine), EngineRequest(list(ids), 12)).token_ids
        bigrams = {tuple(ids[i : i + 2]) for i in range(len(ids) - 1)}
        mine = [r for r in rounds if r["prompt"] == prompt_id]
        assert mine and all(
            r["repeats_prompt"] == (tuple(sequence[r["position"] - 1 : r["position"] + 1]) in bigrams) for r in mine
        )
    lookup = bench_modules.load("eagle3_lookup")
    plain, outputs = lookup.measure(Executor(engine, 2, head=head), prompts, 3, 24, None)
    looked, same = lookup.measure(Executor(engine, 2, head=head, lookup_threshold=1), prompts, 3, 24, None)
    assert same == outputs == [run(Executor(engine), EngineRequest(list(ids), 24)).token_ids for _, ids in prompts]
    assert plain["lookup_rounds"] == 0 and 0 < looked["lookup_rounds"] <= looked["rounds"] <= looked["passes"]


def test_quotes_bench_pure_parts():
    quotes = bench_modules.load("eagle3_quotes")
    prompt = [1, 2, 3, 4]
    sequence = prompt + [9, 2, 3, 7]
    assert [quotes.quotes_prompt(prompt, sequence, i) for i in (5, 6, 7)] == [False, True, False]
    assert quotes.summarize([(True, True), (True, False), (False, True)]) == {
        "quotes": (2, 0.5),
        "other": (1, 1.0),
        "all": (3, 2 / 3),
    }
    prose = "The harbor woke slowly while the ferry left the pier. " * 5
    text = (
        f"# Title\n\n{prose.strip()}\n\n.. note:: skipped\n\nToo short.\n\n{prose.strip()} See"
        f" https://x.org.\n\n{prose.strip()}\n"
    )
    assert quotes.paragraphs(text) == [prose.strip(), prose.strip()]
    prompts = quotes.passage_prompts([text, prose.strip().upper()])
    assert len(prompts) == 1 and prompts[0].endswith(prose.strip())  # deduplicated across texts (case folded)
    assert prompts == quotes.passage_prompts([text])  # seeded


def test_quotes_bench_first_drafts_are_the_fused_loops(tmp_path, tiny_tokenizer_dir):
    """first_draft_hits feeds the head row by row as the fused loop does: at every position its draft equals the one
    a drafter caught up on the whole history at once makes."""
    import torch
    from eagle3_heads import make_eagle3_head
    from tiny_models import make_tiny_model

    from specdeploy.deploy.cpu_compile import compile_checkpoint
    from specdeploy.engine.eagle3 import Eagle3Head
    from specdeploy.engine.model import CpuEngine
    from specdeploy.quantize.modelopt import quantize_model
    from specdeploy.recipe.config import EngineConfig, QuantConfig

    make_tiny_model(tmp_path / "model", tiny_tokenizer_dir, seed=0, num_hidden_layers=4)
    quantize_model(tmp_path / "model", QuantConfig(), tmp_path / "ckpt", progress=False)
    compile_checkpoint(
        tmp_path / "ckpt", tmp_path / "engine", EngineConfig(dtype="float32", max_input_len=128, max_seq_len=256), 8
    )
    engine = CpuEngine.load(tmp_path / "engine")
    head = Eagle3Head.load(make_eagle3_head(tmp_path / "head", 64, 512, (0, 1, 2)), engine)
    quotes = bench_modules.load("eagle3_quotes")
    prompt, answer = [5, 6, 7, 8, 9, 5, 6], [7, 30, 31, 5, 6, 7, 40]
    hits = quotes.first_draft_hits(engine, head, prompt, answer)
    sequence = prompt + answer
    assert len(hits) == len(answer) - 1
    _, aux = engine.forward(engine.new_cache(len(sequence)), torch.tensor(sequence), aux_layers=head.aux_layer_ids)
    for i, (quoted, hit) in enumerate(hits):
        position = len(prompt) + 1 + i
        drafter = head.new_drafter(len(sequence))
        drafter.catch_up(aux[: position - 1], sequence[1:position])
        assert hit == (drafter.draft(1)[0] == sequence[position])
        assert quoted == quotes.quotes_prompt(prompt, sequence, position)
    assert [q for q, _ in hits] == [False, False, False, True, True, False]  # (5, 6) and (6, 7) of the prompt
