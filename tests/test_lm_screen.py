"""The screened LM head (engine/lm_screen.py): greedy rows read an int8 copy of the head, and every token that can be a
row's maximum gets the bf16 head's own logit, so the argmax is the full head's, ties included."""

from __future__ import annotations

import pytest
import torch

from specdeploy.engine import native
from specdeploy.engine.executor import Executor, argmax_only
from specdeploy.engine.kernels import NativeLinear
from specdeploy.engine.lm_screen import ScreenedHead
from specdeploy.engine.logits import LogitsParams
from specdeploy.engine.model import CpuEngine
from specdeploy.engine.request import GenerationRequest
from specdeploy.speculative import SamplingParams

pytestmark = pytest.mark.skipif(native.ops() is None, reason="the screen runs on the native kernels (no C++ compiler here)")

VOCAB, HIDDEN = 4096, 576  # the bundled model's hidden size, a vocabulary an eighth of its


def _head(seed: int = 0, vocab: int = VOCAB):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, HIDDEN, generator=gen) * 0.05).to(torch.bfloat16)  # [vocab, hidden]
    ops = native.ops()
    full = NativeLinear(ops, {"weight": weight}, None, torch.bfloat16, None)
    return ScreenedHead(ops, weight, full), weight, gen


def _toward(weight: torch.Tensor, tokens: list[int], gen: torch.Generator, scale: float = 4.0, noise: float = 1.0):
    """A final-norm row x [1, hidden] whose logits peak at `tokens` (x leans toward their weight rows)."""
    lean = sum(weight[t].float() for t in tokens) / len(tokens)
    x = lean / lean.norm() * scale * HIDDEN**0.5 * 0.05 + torch.randn(HIDDEN, generator=gen) * noise
    return x.to(torch.bfloat16).reshape(1, HIDDEN)


def _check(screen: ScreenedHead, x: torch.Tensor) -> torch.Tensor:
    """The screened rows against the full head: the same bits wherever a logit is kept, the same argmax."""
    full = screen.full(x).float()  # [rows, vocab]
    screened = screen.argmax_rows(x)
    kept = torch.isfinite(screened)
    assert torch.equal(screened[kept], full[kept])
    assert torch.equal(screened.argmax(dim=-1), full.argmax(dim=-1))
    return kept


def test_every_token_that_can_win_keeps_its_exact_logit():
    screen, weight, gen = _head()
    for i in range(40):
        tokens = torch.randint(0, VOCAB, (1 + i % 3,), generator=gen).tolist()
        rows = torch.cat([_toward(weight, tokens, gen) for _ in range(1 + i % 2)])  # one or two rows a call
        kept = _check(screen, rows)
        assert kept.sum(dim=-1).max() < VOCAB // 16  # a screen: few tokens recomputed
    assert screen.fallbacks == 0 and screen.rows == 60
    assert 0 < screen.candidates / screen.rows < 64


def test_the_bound_catches_what_the_int8_copy_ranks_wrong():
    """Rows x on which two tokens' exact logits lie a bf16 step or so apart (x leans toward both, its part along their
    difference set), with an outlier weight in every row that coarsens the int8 steps (x has no part along it): the
    int8 copy alone then often names the wrong one of the two; the screened result never does."""
    _, weight, gen = _head(seed=1)
    weight = weight.clone()
    weight[:, 0] = 2.0  # int8 steps of 2/127 in every row
    screen = ScreenedHead(native.ops(), weight, NativeLinear(native.ops(), {"weight": weight}, None, torch.bfloat16, None))
    flipped = 0
    for _ in range(100):
        a, b = torch.randperm(VOCAB, generator=gen)[:2].tolist()
        apart = (weight[a] - weight[b]).float()
        x = _toward(weight, [a, b], gen, scale=6.0, noise=0.05).float()[0]
        gap = float(torch.empty(()).uniform_(-0.06, 0.06, generator=gen))  # logit a - logit b
        x = x + (gap - x @ apart) / (apart @ apart) * apart
        x[0] = 0.0
        x = x.to(torch.bfloat16).reshape(1, HIDDEN)
        flipped += int(screen.screen(x).float().argmax()) != int(screen.full(x).float().argmax())
        _check(screen, x)
    assert flipped >= 10, flipped  # the case the bound exists for did occur


def test_a_tie_goes_to_the_lowest_token_as_in_the_full_head():
    screen, weight, gen = _head(seed=2)
    weight = weight.clone()
    weight[3000] = weight[700]  # two tokens with the same row: the same logit always
    full = NativeLinear(native.ops(), {"weight": weight}, None, torch.bfloat16, None)
    screen = ScreenedHead(native.ops(), weight, full)
    x = _toward(weight, [700], gen, scale=8.0)
    screened = screen.argmax_rows(x)
    assert torch.isfinite(screened[0, [700, 3000]]).all() and screened[0, 700] == screened[0, 3000]
    assert int(screened.argmax()) == 700 == int(full(x).float().argmax())


@pytest.mark.parametrize("row", ["flat", "nan", "inf"])
def test_what_the_screen_cannot_narrow_reads_the_whole_head(row):
    screen, _, _ = _head(seed=3)
    x = torch.zeros(1, HIDDEN, dtype=torch.bfloat16)  # every logit 0: all tokens tie
    if row != "flat":
        x[0, 5] = float(row)
    out = screen.argmax_rows(x)
    assert screen.fallbacks == 1
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(screen.full(x).float()))  # no -inf: the full rows


def test_the_screen_can_be_switched_off(monkeypatch):
    _, weight, _ = _head()
    full = NativeLinear(native.ops(), {"weight": weight}, None, torch.bfloat16, None)
    assert ScreenedHead.supports(full)
    monkeypatch.setenv("SPECDEPLOY_LM_SCREEN", "0")
    assert not ScreenedHead.supports(full)
    with_bias = NativeLinear(native.ops(), {"weight": weight, "bias": torch.zeros(VOCAB)}, None, torch.bfloat16, None)
    monkeypatch.delenv("SPECDEPLOY_LM_SCREEN")
    assert not ScreenedHead.supports(with_bias)  # the bound has no bias term


@pytest.mark.parametrize(
    "change, screened",
    [
        ({}, True),
        ({"return_logits": True}, False),
        ({"return_log_probs": True}, False),
        ({"return_context_logits": True}, False),
        ({"sampling": SamplingParams(top_k=4, temperature=0.8, seed=1)}, False),
    ],
)
def test_which_requests_take_only_the_argmax(change, screened):
    request = GenerationRequest(input_ids=[1, 2, 3], max_new_tokens=4, **change)
    assert argmax_only(request, LogitsParams()) is screened


@pytest.mark.parametrize(
    "params", [LogitsParams(repetition_penalty=1.2), LogitsParams(presence_penalty=0.5), LogitsParams(min_tokens=2, end_id=0),
               LogitsParams(bad_words=((5,),)), LogitsParams(embedding_bias=torch.zeros(8))],
)
def test_logits_processing_that_reorders_tokens_reads_the_whole_head(params):
    assert not argmax_only(GenerationRequest(input_ids=[1, 2, 3], max_new_tokens=4), params)
