"""The accept/reject math and the speculative loop: unit cases, 'draft == target => all accepted',
statistical tests that sampled output follows the target's distribution, and greedy parity."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats
from standin_engines import TableEngine

from specdeploy.core.errors import ConfigError
from specdeploy.engine.executor import Executor
from specdeploy.engine.generate import ExecutorProposer, ExecutorVerifier, target_only_generate
from specdeploy.speculation import loop as spec
from specdeploy.speculation import sampling as speculation_sampling
from specdeploy.speculation import verify
from specdeploy.speculation.loop import SpecStats
from specdeploy.speculation.sampling import SamplingParams

P_MIN = 1e-3  # the statistical tests fail at this p-value; every test is seeded, so they are deterministic


def onehot_logits(tokens, vocab=8, high=5.0):
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = high
    return logits


def chi_square_p(observed_counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """p-value of observed counts against expected probabilities; cells with expected < 5 are pooled."""
    n = observed_counts.sum()
    expected = expected_probs * n
    assert observed_counts[expected_probs == 0].sum() == 0, "a token the target never emits was emitted"
    big = expected >= 5
    obs = list(observed_counts[big])
    exp = list(expected[big])
    small_exp = expected[~big & (expected_probs > 0)].sum()
    if small_exp > 0:
        obs.append(observed_counts[~big].sum())
        exp.append(small_exp)
    exp = np.array(exp) * (sum(obs) / sum(exp))
    return scipy_stats.chisquare(obs, exp).pvalue


# ---------------------------------------------------------------- sampling parameters


@pytest.mark.parametrize(
    "params, greedy",
    [
        (SamplingParams(), True),
        (SamplingParams(temperature=0.7), True),  # TensorRT-LLM: no top_k/top_p => greedy whatever the temperature
        (SamplingParams(temperature=2.0, top_k=0, top_p=0.0), True),
        (SamplingParams(top_k=1, top_p=0.9), True),  # argmax of the filtered distribution
        (SamplingParams(temperature=0.0, top_k=40), True),
        (SamplingParams(top_k=40), False),
        (SamplingParams(top_p=0.9), False),
        (SamplingParams(temperature=0.8, top_k=5, top_p=0.5), False),
    ],
)
def test_is_greedy_follows_tensorrt_llm(params, greedy):
    assert speculation_sampling.is_greedy(params) is greedy


def test_sampling_params_reject_bad_values():
    for kwargs in ({"temperature": -1.0}, {"top_k": -1}, {"top_p": 1.5}):
        with pytest.raises(ConfigError):
            SamplingParams(**kwargs)


def test_sampling_distribution_topk_topp_temperature():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    probs = verify.sampling_distribution(logits, SamplingParams(top_k=2))
    assert torch.allclose(probs, torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7)
    probs = verify.sampling_distribution(logits, SamplingParams(top_p=0.6))  # 0.5 < 0.6 <= 0.7
    assert torch.allclose(probs, torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7)
    probs = verify.sampling_distribution(logits, SamplingParams(top_p=0.5))  # the first token alone reaches 0.5
    assert torch.allclose(probs, torch.tensor([1.0, 0, 0, 0, 0]))
    probs = verify.sampling_distribution(
        logits, SamplingParams(top_k=3, top_p=0.75)
    )  # top-p over the top-3 renormalized
    assert torch.allclose(probs, torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7)
    hot = verify.sampling_distribution(logits, SamplingParams(temperature=0.5, top_k=5))
    expected = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    assert torch.allclose(hot, expected / expected.sum(), atol=1e-6)
    greedy = verify.sampling_distribution(logits, SamplingParams())
    assert greedy.tolist() == [1.0, 0, 0, 0, 0]
    batched = verify.sampling_distribution(torch.stack([logits, logits.flip(0)]), SamplingParams(top_k=2))  # [2, vocab]
    assert torch.allclose(batched[1], torch.tensor([0, 0, 0, 0.2, 0.5]) / 0.7)


# ---------------------------------------------------------------- verification


def test_verify_greedy_cases():
    assert verify.verify_greedy([1, 2, 3], onehot_logits([1, 2, 3, 4])) == (3, 4)  # all accepted + bonus
    assert verify.verify_greedy([1, 2, 3], onehot_logits([1, 5, 3, 4])) == (1, 5)  # first mismatch replaced
    assert verify.verify_greedy([1, 2, 3], onehot_logits([6, 2, 3, 4])) == (0, 6)
    assert verify.verify_greedy([], onehot_logits([7])) == (0, 7)  # no draft: one token of the target's own


def test_residual_distribution():
    target = torch.tensor([0.5, 0.3, 0.2, 0.0])
    draft = torch.tensor([0.2, 0.5, 0.2, 0.1])
    assert torch.allclose(verify.residual_distribution(target, draft), torch.tensor([1.0, 0, 0, 0]))
    target = torch.tensor([0.4, 0.4, 0.2])
    draft = torch.tensor([0.1, 0.2, 0.7])
    assert torch.allclose(verify.residual_distribution(target, draft), torch.tensor([0.6, 0.4, 0.0]))
    same = torch.tensor([0.3, 0.7])
    assert torch.allclose(verify.residual_distribution(same, same), same)  # no residual mass: stays a distribution


def test_verify_rejection_draft_equals_target_accepts_all():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        probs = torch.softmax(torch.randn(5, 16, generator=g), -1)  # [k + 1, vocab]
        draft_tokens = [verify.sample_token(probs[i], g) for i in range(4)]
        n, _ = verify.verify_rejection(draft_tokens, probs[:4], probs, g)
        assert n == 4


def test_verify_rejection_rejects_tokens_the_target_never_emits():
    g = torch.Generator().manual_seed(1)
    draft_probs = torch.tensor([[0.5, 0.5, 0.0]])
    target_probs = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    for _ in range(50):
        assert verify.verify_rejection([1], draft_probs, target_probs, g) == (0, 0)
        assert verify.verify_rejection([0], draft_probs, target_probs, g) == (1, 2)


def test_verify_rejection_first_token_follows_target_distribution():
    """Leviathan et al. Appendix A.1: the emitted token is distributed as the target, whatever the draft."""
    g = torch.Generator().manual_seed(2)
    vocab, n = 6, 20000
    draft_probs = torch.tensor([[0.05, 0.4, 0.3, 0.1, 0.1, 0.05]])
    target_probs = torch.tensor([[0.3, 0.1, 0.1, 0.2, 0.0, 0.3], [1 / 6] * 6])
    counts = np.zeros(vocab)
    accepted = 0
    for _ in range(n):
        x = verify.sample_token(draft_probs[0], g)
        num, nxt = verify.verify_rejection([x], draft_probs, target_probs, g)
        counts[x if num == 1 else nxt] += 1
        accepted += num
    assert chi_square_p(counts, target_probs[0].numpy()) > P_MIN
    expected_rate = float(torch.minimum(draft_probs[0], target_probs[0]).sum())  # 1 - TV distance
    assert abs(accepted / n - expected_rate) < 0.02


def test_verify_token_match_follows_target_distribution():
    g = torch.Generator().manual_seed(3)
    target_probs = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]])
    counts = np.zeros(3)
    for _ in range(6000):
        num, nxt = verify.verify_token_match([1], target_probs, g)
        counts[1 if num == 1 else nxt] += 1
    assert chi_square_p(counts, target_probs[0].numpy()) > P_MIN


# ---------------------------------------------------------------- the loop with scripted mocks


class ScriptedDraft:
    def __init__(self, proposals):
        self.proposals = list(proposals)
        self.calls = []

    def propose(self, sequence, num_tokens, sampling, return_logits):
        self.calls.append((list(sequence), num_tokens))
        return spec.Proposal(self.proposals.pop(0)[:num_tokens])


class ScriptedTarget:
    def __init__(self, replies):
        self.replies = list(replies)
        self.calls = []

    def verify(self, sequence, draft_tokens, draft_logits, sampling):
        self.calls.append((list(sequence), list(draft_tokens)))
        return self.replies.pop(0)


def test_loop_rounds_counts_and_lengths():
    draft = ScriptedDraft([[5, 6, 7], [9, 9, 9], [1, 2, 3]])
    target = ScriptedTarget([[5, 6, 8], [9, 9, 9, 4], [1, 2]])
    tokens, stats = spec.collect(spec.speculative_generate(draft, target, [100], max_new_tokens=9, num_draft_tokens=3))
    assert tokens == [5, 6, 8, 9, 9, 9, 4, 1, 2]
    # round 3: remaining = 2 => k = min(3, 2 - 1) = 1
    assert [c[1] for c in draft.calls] == [3, 3, 1]
    assert target.calls[1] == ([100, 5, 6, 8], [9, 9, 9])
    assert (stats.drafted, stats.accepted, stats.target_iterations) == (7, 2 + 3 + 1, 3)
    assert stats.output_tokens == 9 and stats.finish_reason == "length"
    assert stats.acceptance_rate == pytest.approx(6 / 7)
    assert stats.acceptance_length == pytest.approx(3.0)


def test_loop_stops_on_end_id_stop_words_and_no_progress():
    run = spec.speculative_generate(ScriptedDraft([[5, 2, 7]]), ScriptedTarget([[5, 2, 7, 8]]), [1], 10, 3, end_id=2)
    tokens, stats = spec.collect(run)
    assert tokens == [5, 2] and stats.finish_reason == "end_id"
    # a stop word spanning two rounds
    run = spec.speculative_generate(
        ScriptedDraft([[5, 6], [7, 8]]), ScriptedTarget([[5, 6, 3], [7, 8, 9]]), [1], 10, 2, stop_words=[[3, 7]]
    )
    tokens, stats = spec.collect(run)
    assert tokens == [5, 6, 3, 7] and stats.finish_reason == "stop_words"
    run = spec.speculative_generate(ScriptedDraft([[5]]), ScriptedTarget([[]]), [1], 10, 1)
    tokens, stats = spec.collect(run)
    assert tokens == [] and stats.finish_reason == "no_progress"
    # max_new_tokens = 1: no draft call at all (k = 0)
    draft = ScriptedDraft([])
    tokens, stats = spec.collect(spec.speculative_generate(draft, ScriptedTarget([[4]]), [1], 1, 4))
    assert tokens == [4] and draft.calls == [] and stats.drafted == 0


def test_loop_streams_each_round():
    run = spec.speculative_generate(ScriptedDraft([[5, 6], [7, 8]]), ScriptedTarget([[5, 9], [7, 8, 1]]), [1], 5, 2)
    items = list(run)
    assert items[:2] == [[5, 9], [7, 8, 1]] and isinstance(items[-1], SpecStats)


def test_round_seeds_are_independent_and_reproducible():
    s = SamplingParams(top_k=5, seed=7)
    seeds = {spec.round_sampling(s, 7, r, role).seed for r in range(50) for role in ("draft", "target")}
    assert len(seeds) == 100
    assert spec.round_sampling(s, 7, 3, "draft") == spec.round_sampling(s, 7, 3, "draft")
    assert spec.round_sampling(SamplingParams(), 7, 3, "draft").seed is None  # greedy: untouched


def test_predicted_speedup_model():
    assert spec.predicted_speedup(0.0, 4, 0.0) == pytest.approx(1.0)
    assert spec.predicted_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    assert spec.predicted_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / 0.2 / 1.4)
    assert spec.predicted_speedup(0.8, 4, 0.1, verify_cost=2.0) == pytest.approx((1 - 0.8**5) / 0.2 / 2.4)


# ---------------------------------------------------------------- end to end over executors (bigram engines)


def loop_on(draft_engine, target_engine, prompt, max_new, k, sampling, use_draft_logits=False):
    draft = ExecutorProposer(Executor(draft_engine, 2))
    target = ExecutorVerifier(Executor(target_engine, 2))
    return spec.collect(
        spec.speculative_generate(draft, target, prompt, max_new, k, sampling, use_draft_logits=use_draft_logits)
    )


def exact_sequence_probs(engine: TableEngine, first: int, length: int, params: SamplingParams) -> dict[tuple, float]:
    """The target's exact distribution over its next `length` tokens after `first`."""
    rows = verify.sampling_distribution(engine.table, params)  # [vocab, vocab]: P(next | last)
    vocab = rows.shape[0]
    out = {}
    for seq in itertools.product(range(vocab), repeat=length):
        p, last = 1.0, first
        for t in seq:
            p *= float(rows[last, t])
            last = t
        if p > 0:
            out[seq] = p
    return out


@pytest.mark.parametrize(
    "params, use_draft_logits, k",
    [
        (SamplingParams(temperature=1.0, top_k=6), True, 2),
        (SamplingParams(temperature=0.8, top_k=3), True, 3),
        (SamplingParams(temperature=1.2, top_p=0.8), True, 2),
        (SamplingParams(temperature=1.0, top_k=4, top_p=0.9), False, 2),  # token matching, no draft logits
    ],
)
def test_speculative_sampling_matches_target_distribution(params, use_draft_logits, k):
    """Chi-square over seeded runs: the joint distribution of 3 generated tokens is the target's."""
    vocab, length, runs = 6, 3, 2000
    target_engine = TableEngine.random(vocab, seed=10)
    draft_engine = TableEngine.random(vocab, seed=11)
    exact = exact_sequence_probs(target_engine, 0, length, params)
    index = {seq: i for i, seq in enumerate(itertools.product(range(vocab), repeat=length))}
    counts = np.zeros(len(index))
    expected = np.zeros(len(index))
    for seq, p in exact.items():
        expected[index[seq]] = p
    drafted = accepted = 0
    for seed in range(runs):
        tokens, stats = loop_on(
            draft_engine,
            target_engine,
            [0],
            length,
            k,
            SamplingParams(**{**params.__dict__, "seed": seed}),
            use_draft_logits,
        )
        counts[index[tuple(tokens)]] += 1
        drafted += stats.drafted
        accepted += stats.accepted
    assert chi_square_p(counts, expected) > P_MIN
    assert 0 < accepted < drafted  # the two models differ: some accepted, some rejected


def test_seeded_sampling_is_reproducible():
    target_engine = TableEngine.random(8, seed=10)
    draft_engine = TableEngine.random(8, seed=11)
    params = SamplingParams(top_k=5, seed=123)
    a = loop_on(draft_engine, target_engine, [1, 2], 20, 3, params, True)[0]
    b = loop_on(draft_engine, target_engine, [1, 2], 20, 3, params, True)[0]
    assert a == b and len(a) == 20


def test_draft_equals_target_accepts_everything_when_sampling():
    engine = TableEngine.random(16, seed=5)
    for seed in range(20):
        tokens, stats = loop_on(engine, engine, [3], 17, 4, SamplingParams(top_k=8, seed=seed), use_draft_logits=True)
        # rounds of 5, 5, 5 tokens, then remaining 2 => k = 1
        assert stats.accepted == stats.drafted == 4 + 4 + 4 + 1 and stats.target_iterations == 4


def test_greedy_speculative_equals_target_only_on_bigram_engines():
    target_engine = TableEngine.random(32, seed=20)
    draft_engine = TableEngine.random(32, seed=21, scale=0.5)
    for seed in range(10):
        prompt = torch.randint(0, 32, (3,), generator=torch.Generator().manual_seed(seed)).tolist()
        expected = spec.collect(target_only_generate(Executor(target_engine), prompt, 25))[0]
        for k in (1, 2, 5):
            assert loop_on(draft_engine, target_engine, prompt, 25, k, SamplingParams(temperature=0.7))[0] == expected


# ---------------------------------------------------------------- stop words across the prompt, cancellation, policies


def test_stop_word_spanning_prompt_and_output_ends_like_the_control():
    # The prompt ends with 3; the stop word [3, 7] completes with the first output token. The target
    # alone (Executor._decode: find_stop over prompt + output) stops there; so must the loop.
    table = torch.full((16, 16), -5.0)
    for a, b in [(1, 3), (3, 7), (7, 9), (9, 4), (4, 9)]:
        table[a, b] = 5.0  # a bigram chain: 1 -> 3 -> 7 -> 9 -> 4 -> 9 ...
    engine = TableEngine(table)
    prompt = [1, 3]
    control = spec.collect(target_only_generate(Executor(engine), prompt, 6, stop_words=[[3, 7]]))
    assert control[0] == [7] and control[1].finish_reason == "stop_words"
    for k in (1, 3):
        draft, target = ExecutorProposer(Executor(engine)), ExecutorVerifier(Executor(engine), stop_words=[[3, 7]])
        tokens, stats = spec.collect(spec.speculative_generate(draft, target, prompt, 6, k, stop_words=[[3, 7]]))
        assert tokens == [7] and stats.finish_reason == "stop_words"
    # With scripted models that do not stop on their own, the loop itself cuts at the boundary word.
    run = spec.speculative_generate(
        ScriptedDraft([[7, 9]]), ScriptedTarget([[7, 9, 4]]), [1, 3], 10, 2, stop_words=[[3, 7]]
    )
    tokens, stats = spec.collect(run)
    assert tokens == [7] and stats.finish_reason == "stop_words"
    # A stop word wholly inside the prompt does not stop anything.
    run = spec.speculative_generate(ScriptedDraft([[9]]), ScriptedTarget([[9, 4]]), [3, 7], 2, 1, stop_words=[[3, 7]])
    assert spec.collect(run)[0] == [9, 4]


def test_should_stop_cancels_between_rounds():
    polls = []

    def should_stop():
        polls.append(len(polls))
        return len(polls) > 2  # false before rounds 1 and 2, true before round 3

    draft = ScriptedDraft([[5, 6], [7, 8], [1, 1]])
    target = ScriptedTarget([[5, 6, 1], [7, 8, 2], [1, 1, 1]])
    tokens, stats = spec.collect(spec.speculative_generate(draft, target, [0], 20, 2, should_stop=should_stop))
    assert tokens == [5, 6, 1, 7, 8, 2] and stats.finish_reason == "cancelled"
    assert len(target.calls) == 2 and len(polls) == 3
    tokens, stats = spec.collect(
        spec.speculative_generate(ScriptedDraft([]), ScriptedTarget([]), [0], 5, 2, should_stop=lambda: True)
    )
    assert tokens == [] and stats.finish_reason == "cancelled" and stats.target_iterations == 0


class ScriptedPolicy:
    name = "scripted"

    def __init__(self, ks):
        self.ks, self.caps, self.outcomes = list(ks), [], []

    def choose(self, cap):
        self.caps.append(cap)
        return min(cap, self.ks.pop(0))

    def record(self, outcome):
        self.outcomes.append(outcome)

    def plain_tokens(self, remaining):
        return 1

    def empty_run(self, remaining):
        return 1


def test_loop_asks_the_policy_for_k_and_reports_outcomes():
    policy = ScriptedPolicy([2, 0, 3])
    draft = ScriptedDraft([[5, 6], [7, 8, 9]])
    target = ScriptedTarget([[5, 4], [3], [7, 8, 9, 1]])
    ticks = iter(range(100))
    run = spec.speculative_generate(draft, target, [0], 7, 3, policy=policy, clock=lambda: float(next(ticks)))
    tokens, stats = spec.collect(run)
    assert tokens == [5, 4, 3, 7, 8, 9, 1]
    assert [c[1] for c in draft.calls] == [2, 3]  # the k = 0 round called no draft
    assert target.calls[1] == ([0, 5, 4], [])  # a plain step: an empty draft
    assert policy.caps == [3, 3, 3] and stats.k_per_round == [2, 0, 3]
    assert stats.policy == "scripted" and stats.speculated_share == pytest.approx(2 / 3)
    first, plain, third = policy.outcomes
    assert (first.k, first.drafted, first.accepted, first.emitted, first.first_round) == (2, 2, 1, 2, True)
    assert (plain.k, plain.drafted, plain.rows, plain.draft_time_s) == (0, 0, 1, 0.0)
    assert (third.accepted, third.draft_fresh) == (3, False)  # the draft skipped the plain round's token
    assert first.draft_time_s == 1.0 and first.target_time_s == 1.0  # one tick per clock pair


def test_greedy_parity_with_adaptive_k_on_bigram_engines():
    from specdeploy.speculation import policy as pol

    target_engine = TableEngine.random(32, seed=20)
    draft_engine = TableEngine.random(32, seed=21, scale=0.5)
    for seed in range(6):
        prompt = torch.randint(0, 32, (3,), generator=torch.Generator().manual_seed(seed)).tolist()
        expected = spec.collect(target_only_generate(Executor(target_engine), prompt, 30))[0]
        for settings in (
            pol.PolicySettings("cost", 4, probe_interval=2),
            pol.PolicySettings("static", 4, acceptance_rate_window_size=2, acceptance_rate_threshold=0.9),
        ):
            deployment = pol.SharedPolicy(settings)
            draft, target = ExecutorProposer(Executor(draft_engine, 2)), ExecutorVerifier(Executor(target_engine, 2))
            tokens, stats = spec.collect(
                spec.speculative_generate(draft, target, prompt, 30, 4, policy=deployment.request())
            )
            assert tokens == expected
            assert len(set(stats.k_per_round)) > 1 or settings.policy == "static"  # the cost policy varied k


# ---------------------------------------------------------------- plain runs: k = 0 rounds of several tokens in one
# call


class RunPolicy(ScriptedPolicy):
    """Scripted k per round and, after a k = 0, the plain tokens to ask for."""

    def __init__(self, ks, runs):
        super().__init__(ks)
        self.runs, self.remaining = list(runs), []

    def plain_tokens(self, remaining):
        self.remaining.append(remaining)
        return min(remaining, self.runs.pop(0))


class RunTarget(ScriptedTarget):
    def verify(self, sequence, draft_tokens, draft_logits, sampling, output_len=None):
        self.calls.append((list(sequence), list(draft_tokens), output_len))
        return self.replies.pop(0)


def test_plain_run_is_one_target_call_for_many_tokens():
    policy = RunPolicy([0, 2, 0], [4, 1])
    draft = ScriptedDraft([[7, 8]])
    target = RunTarget([[1, 2, 3, 4], [7, 5], [6]])
    tokens, stats = spec.collect(spec.speculative_generate(draft, target, [0], 7, 3, policy=policy))
    assert tokens == [1, 2, 3, 4, 7, 5, 6] and stats.finish_reason == "length"
    # a run asks for output_len tokens with no draft; a one-token plain step keeps the old call shape
    assert [c[2] for c in target.calls] == [4, None, None] and target.calls[0] == ([0], [], 4)
    assert policy.remaining == [7, 1] and policy.caps == [3, 2, 0]
    assert stats.k_per_round == [0, 2, 0] and stats.target_iterations == 3 and stats.plain_run_tokens == 4
    assert (
        stats.plain_runs == 1 and stats.target_passes == 6
    )  # the run's 4 tokens are 4 passes; the round and the step 1 each
    run, spec_round, step = policy.outcomes
    assert (run.k, run.emitted, run.plain_run, run.is_run) == (0, 4, 4, True)
    assert (step.plain_run, step.is_run) == (1, False)


class EmptyRunPolicy(RunPolicy):
    def empty_run(self, remaining):
        self.remaining.append(remaining)
        return min(remaining, self.runs.pop(0))


def test_an_empty_proposal_becomes_a_plain_run():
    """k > 0 chosen, the draft proposes nothing (an n-gram without a match): one call for the run the policy
    sizes, recorded as a plain run; a run of one keeps the one-token call and the chosen k."""
    policy = EmptyRunPolicy([3, 2, 3, 0], [5, 1, 1])
    draft = ScriptedDraft([[], [7, 8], []])
    target = RunTarget([[1, 2, 3, 4, 7], [7, 8, 9], [6], [5]])
    tokens, stats = spec.collect(spec.speculative_generate(draft, target, [0], 10, 3, policy=policy))
    assert tokens == [1, 2, 3, 4, 7, 7, 8, 9, 6, 5] and stats.finish_reason == "length"
    assert [(c[1], c[2]) for c in target.calls] == [([], 5), ([7, 8], None), ([], None), ([], None)]
    assert policy.remaining == [10, 2, 1] and stats.k_per_round == [0, 2, 1, 0] and stats.plain_run_tokens == 5
    assert stats.plain_runs == 1 and stats.target_passes == 8
    run, spec_round, step, _ = policy.outcomes
    assert (run.k, run.drafted, run.emitted, run.plain_run, run.is_run) == (0, 0, 5, 5, True)
    assert (step.k, step.drafted, step.plain_run) == (1, 0, 1)


def test_policies_size_the_run_after_an_empty_proposal():
    from specdeploy.speculation import policy as pol

    for name in pol.POLICIES:
        request = pol.SharedPolicy(pol.PolicySettings(name, 4, probe_interval=6)).request()
        assert request.choose(4) == 4 and request.empty_run(50) == 6 and request.empty_run(2) == 2


def test_no_policy_and_no_draft_tokens_is_one_call():
    target = RunTarget([[3, 4, 5, 6, 7]])
    tokens, stats = spec.collect(spec.speculative_generate(ScriptedDraft([]), target, [0], 5, 0))
    assert tokens == [3, 4, 5, 6, 7] and target.calls == [([0], [], 5)] and stats.target_iterations == 1


class CountingVerifier(ExecutorVerifier):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def verify(self, *args, **kwargs):
        self.calls += 1
        return super().verify(*args, **kwargs)


@pytest.mark.parametrize("sampling", [speculation_sampling.GREEDY, SamplingParams(temperature=0.0, top_k=5)])
def test_fallback_runs_equal_the_target_alone_with_fewer_target_calls(sampling):
    from specdeploy.speculation import policy as pol

    target_engine = TableEngine.random(32, seed=20)
    draft_engine = TableEngine.random(32, seed=21, scale=0.5)
    gated_runs = 0
    for seed in range(4):
        prompt = torch.randint(0, 32, (3,), generator=torch.Generator().manual_seed(seed)).tolist()
        expected = spec.collect(target_only_generate(Executor(target_engine), prompt, 40, end_id=31))[0]
        # the gate trips after two bad rounds (threshold 1.0 cannot be met by this draft): the rest is plain
        settings = pol.PolicySettings("static", 3, acceptance_rate_window_size=2, acceptance_rate_threshold=1.0)
        deployment = pol.SharedPolicy(settings)
        target = CountingVerifier(Executor(target_engine, 2), end_id=31)
        run = spec.speculative_generate(
            ExecutorProposer(Executor(draft_engine, 2), end_id=31),
            target,
            prompt,
            40,
            3,
            sampling=sampling,
            end_id=31,
            policy=deployment.request(),
        )
        tokens, stats = spec.collect(run)
        assert tokens == expected
        if len(expected) > 8 and deployment.gate.disabled:
            assert stats.k_per_round[-1] == 0 and stats.plain_run_tokens > 1
            assert target.calls == stats.target_iterations < len(expected) - stats.accepted
            gated_runs += 1
        # a request that asks for no draft tokens: one target call, the target's own output
        target = CountingVerifier(Executor(target_engine, 2), end_id=31)
        policy = pol.SharedPolicy(pol.PolicySettings("cost", 3)).request()
        run = spec.speculative_generate(
            ExecutorProposer(Executor(draft_engine, 2)),
            target,
            prompt,
            40,
            0,
            sampling=sampling,
            end_id=31,
            policy=policy,
        )
        tokens, stats = spec.collect(run)
        assert tokens == expected and target.calls == 1 and stats.k_per_round == [0]
    assert gated_runs >= 2  # the gate tripped and the rest ran plain on most prompts


def test_greedy_token_is_torchs_argmax_ties_nans_and_infinities_included():
    """greedy_token takes a float32 row through numpy's argmax (SIMD; torch's CPU argmax was ~0.1 ms a token): the
    same index as torch's on ties (the lowest id), NaNs (the first wins), infinities, all -inf rows (the screened head's
    rows are -inf outside its candidates), rows of a 2-D tensor, inference tensors, and other dtypes (through torch)."""
    from specdeploy.speculation.verify import greedy_token, greedy_tokens

    g = torch.Generator().manual_seed(0)
    nan, inf = float("nan"), float("inf")
    rows = [
        torch.tensor([1.0, 3.0, 3.0, 2.0]),
        torch.tensor([1.0, nan, 5.0, nan]),
        torch.tensor([-inf] * 5),
        torch.tensor([1.0, inf, inf]),
        torch.tensor([-0.0, 0.0]),
        torch.tensor([-inf, 2.0, -inf, 2.0]),
        torch.randn(49152, generator=g),
        torch.randn(3, 4096, generator=g)[1],
        torch.randn(4096, 3, generator=g)[:, 2],
    ]
    with torch.inference_mode():
        rows.append(torch.randn(49152, generator=g))
    rows += [r.to(torch.bfloat16) for r in rows[:3]] + [rows[6].double()]
    for row in rows:
        assert greedy_token(row) == int(torch.argmax(row)), row
        both = torch.stack([row, row.flip(0)])  # greedy_tokens: each row of a pass, also of a transposed (strided) one
        for pair in (both, both.t().contiguous().t()):
            assert greedy_tokens(pair) == pair.argmax(-1).tolist(), pair
    assert greedy_token(torch.tensor([1.0, 3.0, 3.0, 2.0])) == 1 and greedy_token(torch.tensor([1.0, nan, 5.0])) == 1
