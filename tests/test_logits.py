"""Logits processing (specdeploy.engine.logits) on hand-made rows: every expected value below is
worked out by hand in the comment next to it, in TensorRT-LLM's order (bias, temperature,
repetition, presence, frequency over prompt + output, min_tokens, bad words)."""

from __future__ import annotations

import math

import pytest
import torch

from specdeploy.core.errors import ConfigError
from specdeploy.engine import logits as lp
from specdeploy.engine.logits import LogitsParams
from specdeploy.speculation.sampling import SamplingParams

ROW = torch.tensor([2.0, -1.0, 0.5, 3.0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    out = lp.apply_penalties(ROW, [0, 1, 1], repetition=2.0)
    # token 0 occurs: 2.0 / 2 = 1.0; token 1 occurs (negative): -1.0 * 2 = -2.0; 2 and 3 do not occur
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0]
    assert ROW.tolist() == [2.0, -1.0, 0.5, 3.0]  # the input row is not modified


def test_presence_penalty_subtracts_once_per_present_token():
    out = lp.apply_penalties(ROW, [0, 1, 1], presence=0.5)
    assert out.tolist() == [1.5, -1.5, 0.5, 3.0]  # token 1 occurs twice, still -0.5 once


def test_frequency_penalty_subtracts_per_occurrence():
    out = lp.apply_penalties(ROW, [0, 1, 1], frequency=0.5)
    assert out.tolist() == [1.5, -2.0, 0.5, 3.0]  # token 1: -1.0 - 2 * 0.5


def test_penalties_ignore_ids_outside_the_vocabulary():
    assert lp.apply_penalties(ROW, [7, -1], presence=1.0).tolist() == ROW.tolist()


def test_full_order_bias_temperature_penalties_min_tokens():
    params = LogitsParams(
        temperature=0.5,
        repetition_penalty=2.0,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        min_tokens=2,
        end_id=1,
        embedding_bias=torch.tensor([0.0, 0.0, 1.0, 0.0]),
    )
    out = lp.process_row(ROW, [2, 2, 0], generated=1, params=params)
    # + bias: [2, -1, 1.5, 3]; / 0.5: [4, -2, 3, 6]
    # token 0 (once): 4 / 2 = 2, - 1 = 1, - 0.5 = 0.5
    # token 2 (twice): 3 / 2 = 1.5, - 1 = 0.5, - 2 * 0.5 = -0.5
    # end id 1 banned (1 generated < min_tokens 2)
    assert out.tolist() == [0.5, float("-inf"), -0.5, 6.0]
    # penalties before temperature would give token 2: ((1.5 / 2) - 1 - 1) / 0.5 = -2.5, not -0.5
    later = lp.process_row(ROW, [2, 2, 0], generated=2, params=params)
    assert later[1] == -2.0  # 2 generated: the end id is allowed again (-1 / 0.5)


def test_min_tokens_bans_the_end_id_exactly_until_the_count():
    for generated, banned in [(0, True), (2, True), (3, False), (4, False)]:
        out = lp.ban_min_tokens(ROW, end_id=3, generated=generated, min_tokens=3)
        assert bool(out[3] == float("-inf")) is banned, generated
        assert out[:3].tolist() == ROW[:3].tolist()
    assert lp.ban_min_tokens(ROW, end_id=None, generated=0, min_tokens=3).tolist() == ROW.tolist()


def test_bad_words_mask_the_last_token_after_the_prefix():
    out = lp.mask_bad_words(ROW, [5, 0], [[0, 3], [2]])
    assert out.tolist() == [2.0, -1.0, float("-inf"), float("-inf")]  # [0, 3]: sequence ends in 0; [2] always
    assert lp.mask_bad_words(ROW, [5, 1], [[0, 3]]).tolist() == ROW.tolist()


def test_neutral_params_leave_the_row_unchanged():
    assert lp.process_row(ROW, [0, 1, 2, 3], 0, LogitsParams()).tolist() == ROW.tolist()


def test_process_rows_processes_each_position_over_its_own_prefix():
    params = LogitsParams(presence_penalty=1.0)
    rows = torch.stack([ROW, ROW, ROW])  # positions after context[:2], [:3], [:4]
    out = lp.process_rows(rows, [0, 1, 2, 3], start=2, generated=0, params=params)
    assert out[0].tolist() == [1.0, -2.0, 0.5, 3.0]  # 0 and 1 present
    assert out[1].tolist() == [1.0, -2.0, -0.5, 3.0]  # + 2
    assert out[2].tolist() == [1.0, -2.0, -0.5, 2.0]  # + 3


@pytest.mark.parametrize(
    "params, nothing",
    [
        (LogitsParams(), True),
        (LogitsParams(temperature=0.0), True),
        (LogitsParams(temperature=0.7), False),
        (LogitsParams(repetition_penalty=1.2), False),
        (LogitsParams(min_tokens=2, end_id=3), False),
        (LogitsParams(bad_words=((1,),)), False),
        (LogitsParams(embedding_bias=torch.zeros(4)), False),
    ],
)
def test_process_rows_without_processing_returns_the_rows_each_row_would_give(params, nothing):
    """The fused loop's rounds: where nothing processes a row, process_rows hands the rows back without a copy, the
    bits of processing each row alone (process_row), which is what it does otherwise."""
    rows = torch.stack([ROW, -ROW, ROW * 2])
    out = lp.process_rows(rows, [0, 1, 2, 3], start=1, generated=0, params=params)
    each = torch.stack([lp.process_row(rows[i], [0, 1, 2, 3][: 1 + i], i, params) for i in range(3)])
    assert params.processes_nothing is nothing
    assert torch.equal(out, each) and out.dtype == torch.float32
    assert (out.data_ptr() == rows.data_ptr()) is nothing


def test_invalid_params_name_the_field():
    with pytest.raises(ConfigError, match="repetition_penalty"):
        LogitsParams(repetition_penalty=0.0)
    with pytest.raises(ConfigError, match="min_tokens"):
        LogitsParams(min_tokens=-1)
    with pytest.raises(ConfigError, match="embedding_bias"):
        LogitsParams(embedding_bias=torch.zeros(2, 4))
    with pytest.raises(ConfigError, match="embedding_bias"):
        lp.process_row(ROW, [], 0, LogitsParams(embedding_bias=torch.zeros(3)))


def test_sampler_params_do_not_apply_temperature_twice():
    assert lp.sampler_params(SamplingParams(temperature=0.5, top_k=3)) == SamplingParams(temperature=1.0, top_k=3)
    greedy = SamplingParams(temperature=0.0, top_k=3)  # temperature 0 is greedy and must stay greedy
    assert lp.sampler_params(greedy) == greedy


def test_token_log_prob_unnormalized_is_log_softmax_of_the_processed_row():
    row = torch.tensor([0.5, -2.0, -0.5, 6.0])
    z = sum(math.exp(v) for v in [0.5, -2.0, -0.5, 6.0])
    for token in range(4):
        expected = row[token].item() - math.log(z)
        got = lp.token_log_prob(row, token, SamplingParams(top_k=2), normalize=False)
        assert got == pytest.approx(expected, abs=1e-5)


def test_token_log_prob_normalized_is_over_the_kept_tokens():
    row = torch.tensor([0.5, -2.0, -0.5, 6.0])
    # top_k=2 keeps 6.0 and 0.5: P(token 0) = e^0.5 / (e^0.5 + e^6)
    expected = 0.5 - math.log(math.exp(0.5) + math.exp(6.0))
    assert lp.token_log_prob(row, 0, SamplingParams(top_k=2), normalize=True) == pytest.approx(expected, abs=1e-5)
    assert lp.token_log_prob(row, 3, SamplingParams(), normalize=True) == 0.0  # greedy: probability 1
