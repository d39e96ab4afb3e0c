"""The screened LM head (engine/lm_screen.py): greedy rows read an int8 copy of the head, and every token that can be a
row's maximum gets the bf16 head's own logit, so the argmax is the full head's, ties included."""

from __future__ import annotations

import pytest
import torch

from specdeploy.engine import native
from specdeploy.engine.executor import argmax_only
from specdeploy.engine.kernels import NativeLinear
from specdeploy.engine.lm_screen import KINDS, ScreenedHead
from specdeploy.engine.logits import LogitsParams
from specdeploy.engine.request import EngineRequest
from specdeploy.speculation.sampling import SamplingParams

pytestmark = pytest.mark.skipif(
    native.ops() is None, reason="the screen runs on the native kernels (no C++ compiler here)"
)

VOCAB, HIDDEN = 4096, 576  # the bundled model's hidden size, a vocabulary an eighth of its


@pytest.fixture(params=KINDS)
def kind(request):
    """Both screens: int8 x int8 codes of x and of its residual (VNNI CPUs), and W8A16 (AVX2-only CPUs)."""
    return request.param


def _screen(weight: torch.Tensor, kind: str) -> ScreenedHead:
    return ScreenedHead(
        native.ops(), weight, NativeLinear(native.ops(), {"weight": weight}, None, torch.bfloat16, None), kind
    )


def _head(kind: str, seed: int = 0, vocab: int = VOCAB):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, HIDDEN, generator=gen) * 0.05).to(torch.bfloat16)  # [vocab, hidden]
    return _screen(weight, kind), weight, gen


def _toward(weight: torch.Tensor, tokens: list[int], gen: torch.Generator, scale: float = 4.0, noise: float = 1.0):
    """A final-norm row x [1, hidden] whose logits peak at `tokens` (x leans toward their weight rows)."""
    lean = sum(weight[t].float() for t in tokens) / len(tokens)
    x = lean / lean.norm() * scale * HIDDEN**0.5 * 0.05 + torch.randn(HIDDEN, generator=gen) * noise
    return x.to(torch.bfloat16).reshape(1, HIDDEN)


def _near_tie(weight: torch.Tensor, gen: torch.Generator, scale: float, noise: float, width: float) -> torch.Tensor:
    """A row x [hidden] (f32) leaning toward two random tokens, moved along their weight rows' difference so that their
    exact logits lie a uniform draw in [-width, width] apart."""
    a, b = torch.randperm(weight.shape[0], generator=gen)[:2].tolist()
    apart = (weight[a] - weight[b]).float()
    x = _toward(weight, [a, b], gen, scale=scale, noise=noise).float()[0]
    gap = float(torch.empty(()).uniform_(-width, width, generator=gen))  # logit a - logit b
    return x + (gap - x @ apart) / (apart @ apart) * apart


def _check(screen: ScreenedHead, x: torch.Tensor) -> torch.Tensor:
    """The screened rows against the full head: the same bits wherever a logit is kept, the same argmax."""
    full = screen.full(x).float()  # [rows, vocab]
    screened = screen.argmax_rows(x)
    kept = torch.isfinite(screened)
    assert torch.equal(screened[kept], full[kept])
    assert torch.equal(screened.argmax(dim=-1), full.argmax(dim=-1))
    return kept


def test_every_token_that_can_win_keeps_its_exact_logit(kind):
    screen, weight, gen = _head(kind)
    for i in range(40):
        tokens = torch.randint(0, VOCAB, (1 + i % 3,), generator=gen).tolist()
        rows = torch.cat([_toward(weight, tokens, gen) for _ in range(1 + i % 2)])  # one or two rows a call
        kept = _check(screen, rows)
        assert kept.sum(dim=-1).max() < VOCAB // 16  # a screen: few tokens recomputed
    assert screen.fallbacks == 0 and screen.rows == 60
    assert 0 < screen.candidates / screen.rows < 64


def test_the_bound_catches_what_the_int8_copy_ranks_wrong(kind):
    """Rows x on which two tokens' exact logits lie a bf16 step or so apart (x leans toward both, its part along their
    difference set), with an outlier weight in every row that coarsens the int8 steps (x has no part along it): the
    int8 copy alone then often names the wrong one of the two; the screened result never does."""
    _, weight, gen = _head(kind, seed=1)
    weight = weight.clone()
    weight[:, 0] = 2.0  # int8 steps of 2/127 in every row
    screen = _screen(weight, kind)
    flipped = 0
    for _ in range(100):
        x = _near_tie(weight, gen, scale=6.0, noise=0.05, width=0.06)
        x[0] = 0.0
        x = x.to(torch.bfloat16).reshape(1, HIDDEN)
        flipped += int(screen.screened(x).argmax()) != int(screen.full(x).float().argmax())
        _check(screen, x)
    assert flipped >= 10, flipped  # the case the bound exists for did occur


def test_a_tie_goes_to_the_lowest_token_as_in_the_full_head(kind):
    _, weight, gen = _head(kind, seed=2)
    weight = weight.clone()
    weight[3000] = weight[700]  # two tokens with the same row: the same logit always
    screen = _screen(weight, kind)
    full = screen.full
    x = _toward(weight, [700], gen, scale=8.0)
    screened = screen.argmax_rows(x)
    assert torch.isfinite(screened[0, [700, 3000]]).all() and screened[0, 700] == screened[0, 3000]
    assert int(screened.argmax()) == 700 == int(full(x).float().argmax())


@pytest.mark.parametrize("row", ["flat", "nan", "inf"])
def test_what_the_screen_cannot_narrow_reads_the_whole_head(row, kind):
    screen, _, _ = _head(kind, seed=3)
    x = torch.zeros(1, HIDDEN, dtype=torch.bfloat16)  # every logit 0: all tokens tie
    if row != "flat":
        x[0, 5] = float(row)
    out = screen.argmax_rows(x)
    assert screen.fallbacks == 1
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(screen.full(x).float()))  # no -inf: the full rows


def test_the_screen_can_be_switched_off(monkeypatch):
    _, weight, _ = _head("int8")
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
    request = EngineRequest(input_ids=[1, 2, 3], max_new_tokens=4, **change)
    assert argmax_only(request, LogitsParams()) is screened


@pytest.mark.parametrize(
    "params",
    [
        LogitsParams(repetition_penalty=1.2),
        LogitsParams(presence_penalty=0.5),
        LogitsParams(min_tokens=2, end_id=0),
        LogitsParams(bad_words=((5,),)),
        LogitsParams(embedding_bias=torch.zeros(8)),
    ],
)
def test_logits_processing_that_reorders_tokens_reads_the_whole_head(params):
    assert not argmax_only(EngineRequest(input_ids=[1, 2, 3], max_new_tokens=4), params)


def test_the_int8_screen_bounds_coarse_activation_steps():
    """Rows with one outlier activation (int8 steps of outlier/127 for every other channel of the row): the int8 copy's
    codes of x alone then often name the wrong one of two close tokens; the residual's codes and the bound keep the
    screened result exact, and the candidates few."""
    _, weight, gen = _head("int8", seed=4)
    weight = weight.clone()
    weight[:, 7] = 0.0  # the outlier's channel: it moves no logit, only the codes' steps
    screen = _screen(weight, "int8")
    flipped = 0
    for i in range(100):
        x = _near_tie(weight, gen, scale=6.0, noise=0.05, width=0.06)
        x[7] = 60.0 if i % 2 else -60.0
        x = x.to(torch.bfloat16).reshape(1, HIDDEN)
        flipped += int(screen.screened(x).argmax()) != int(screen.full(x).float().argmax())
        _check(screen, x)
    assert flipped >= 10, flipped
    assert screen.fallbacks == 0 and screen.candidates / screen.rows < 16


@pytest.mark.parametrize(
    "variant, kind", [(native.INT8_AVX2, "w8a16"), (native.INT8_AVX512_VNNI, "int8"), (native.INT8_AVX_VNNI, "int8")]
)
def test_the_screen_kind_follows_the_int8_kernel_variant(monkeypatch, variant, kind):
    from specdeploy.engine import lm_screen

    monkeypatch.delenv(lm_screen.KIND_ENV, raising=False)
    monkeypatch.setattr(native, "int8_variant", lambda: variant)
    assert lm_screen.default_kind() == kind
    monkeypatch.setenv(lm_screen.KIND_ENV, "w8a16")
    assert lm_screen.default_kind() == "w8a16"


def test_the_int8_screen_bounds_what_the_residual_codes_leave():
    """Weights the int8 codes hold exactly, rows with two large values whose weight columns are zero (x's own codes hold
    only the first, so every logit comes from the residual's codes, whose steps the second sets), and two tokens whose
    logits lie a few thousandths apart: the two rows' codes then often rank them wrong, the screened result never
    does, and it needs no fallback to the whole head (with x's codes alone every token would be a candidate)."""
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(-127, 128, (VOCAB, HIDDEN), generator=gen).float()
    codes[:, 0] = 127.0  # every row's scale is 2^-9 exactly: the codes are the weight
    weight = (codes * 2.0**-9).to(torch.bfloat16)
    weight[:, 7] = weight[:, 9] = 0.0
    screen = _screen(weight, "int8")
    flipped = 0
    for i in range(100):
        x = _near_tie(weight, gen, scale=0.1, noise=0.002, width=0.003)
        x[0], x[7], x[9] = 0.0, 60.0, 0.23  # 60 / 127 = 0.47: x's codes are 0 but at 7, the residual's steps 0.23 / 127
        x = x.to(torch.bfloat16).reshape(1, HIDDEN)
        two_rows = screen.screened(torch.cat([x, (x.double() - _codes_of(x)).to(torch.bfloat16)]))
        flipped += int((two_rows[0] + two_rows[1]).argmax()) != int(screen.full(x).float().argmax())
        _check(screen, x)
    assert flipped >= 10, flipped  # the codes did rank wrong
    assert screen.fallbacks == 0 and screen.candidates / screen.rows < 16


def _codes_of(x: torch.Tensor) -> torch.Tensor:
    """s1 q1 of x's rows as the int8 kernel quantizes them (per token), in float64."""
    q, s = native.ops().int8_quantize(x, None, 0.0)
    return s.double()[:, None] * q.double()
