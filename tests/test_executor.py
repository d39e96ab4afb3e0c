"""The Executor (one TensorRT-LLM `tensorrt_llm` request over an engine): prefix KV reuse, draft
verification, stop conditions, sampling, and greedy speculative parity on tiny random models.

Engines: `ReferenceEngine` (transformers, one position at a time) always; the real `CpuEngine`
built from the same tiny checkpoints when the runtime and the quantize stage are importable.
"""

from __future__ import annotations

import pytest
import torch
from standin_engines import ReferenceEngine, TableEngine

from specdeploy.core.errors import ConfigError
from specdeploy.engine.executor import Executor
from specdeploy.engine.generate import ExecutorProposer, ExecutorVerifier, target_only_generate
from specdeploy.engine.kv_pool import reusable_prefix_len
from specdeploy.engine.request import EngineRequest, run
from specdeploy.speculation import loop as spec
from specdeploy.speculation.sampling import SamplingParams

ENGINE_KINDS = ["reference", "cpu"]


def _cpu_engine(model_dir, out_dir, max_draft_len):
    """Quantize (full precision) + compile + load with the project's own stages."""
    from specdeploy.deploy.cpu_compile import compile_checkpoint
    from specdeploy.engine.model import CpuEngine
    from specdeploy.quantize.modelopt import quantize_model
    from specdeploy.recipe.config import EngineConfig, QuantConfig

    ckpt = out_dir / "ckpt"
    quantize_model(model_dir, QuantConfig(), ckpt, progress=False)
    engine_cfg = EngineConfig(dtype="float32", max_input_len=128, max_seq_len=256)
    compile_checkpoint(ckpt, out_dir / "engine", engine_cfg, max_draft_len)
    return CpuEngine.load(out_dir / "engine")


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def engines(request, tiny_llama_dir, tiny_llama_draft_dir, tmp_path_factory):
    """(target, draft) engines of one kind over the tiny random Llama pair."""
    if request.param == "reference":
        return ReferenceEngine(tiny_llama_dir), ReferenceEngine(tiny_llama_draft_dir)
    root = tmp_path_factory.mktemp("cpu-engines")
    (root / "t").mkdir()
    (root / "d").mkdir()
    return _cpu_engine(tiny_llama_dir, root / "t", 8), _cpu_engine(tiny_llama_draft_dir, root / "d", None)


def forward_fresh(engine, tokens):
    cache = engine.new_cache(len(tokens) + 1)
    return engine.forward(cache, torch.tensor(tokens))  # [n, vocab]


def prompt_of(seed, n=6, vocab=512):
    return torch.randint(4, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------- prefix reuse


def test_reusable_prefix_len_names_the_subtle_step():
    seq, drafts, bonus = [1, 2, 3], [7, 8, 9], 5
    cached_after_proposing = seq + drafts[:-1]  # the draft never fed back its own last token
    assert reusable_prefix_len(cached_after_proposing, seq + drafts + [bonus]) == len(seq) + 2  # compute 9 and 5
    assert reusable_prefix_len([1, 2, 3], [1, 2, 3]) == 2  # the last input token is always run
    assert reusable_prefix_len([1, 2, 4, 5], [1, 2, 3, 4]) == 2
    assert reusable_prefix_len([], [1]) == 0


def test_prefix_reuse_gives_the_same_logits_as_a_fresh_pass(engines):
    target, _ = engines
    ex = Executor(target, max_cached_sequences=2)
    prompt = prompt_of(1)
    first = run(ex, EngineRequest(prompt, 6, return_logits=True))
    assert first.stats.reused_tokens == 0
    longer = prompt + first.token_ids + [42]
    second = run(ex, EngineRequest(longer, 4, return_logits=True))
    # the cache held prompt + 5 of the 6 outputs: the 6th output and 42 are computed
    assert second.stats.reused_tokens == len(prompt) + 5 and second.stats.computed_tokens == 2 + 3
    fresh = forward_fresh(target, longer + second.token_ids[:-1])  # [n, vocab]
    n = len(longer)
    assert torch.equal(second.logits, fresh[n - 1 :])
    assert torch.equal(first.logits, fresh[len(prompt) - 1 : len(prompt) + 5])
    # a diverging request rolls the cache back to the common prefix
    branch = prompt[:3] + [7, 8]
    third = run(ex, EngineRequest(branch, 3, return_logits=True))
    assert third.stats.reused_tokens == 3
    assert torch.equal(third.logits, forward_fresh(target, branch + third.token_ids[:-1])[len(branch) - 1 :])


def test_kv_pool_is_bounded_lru():
    engine = TableEngine.random(16, seed=0)
    ex = Executor(engine, max_cached_sequences=2)
    for p in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        run(ex, EngineRequest(p, 2))
    assert [s[:3] for s in ex.cached_sequences] == [[4, 5, 6], [7, 8, 9]]  # [1, 2, 3] evicted
    again = run(ex, EngineRequest([4, 5, 6, 1], 1))
    assert again.stats.reused_tokens == 3
    assert [s[:3] for s in ex.cached_sequences] == [[7, 8, 9], [4, 5, 6]]  # most recent last


def test_draft_executor_catch_up_after_all_accepted(engines):
    """Round 2 of a draft: with every draft accepted it computes exactly 2 positions (dk and the bonus)."""
    target, draft = engines
    draft_ex = Executor(draft)
    target_ex = Executor(target)
    seq = prompt_of(2)
    proposal = run(draft_ex, EngineRequest(seq, 4, return_logits=True))
    verified = run(target_ex, EngineRequest(seq, 5, draft_tokens=proposal.token_ids))
    nxt = seq + verified.token_ids
    again = run(draft_ex, EngineRequest(nxt, 1))
    accepted = verified.stats.accepted
    cached = len(seq) + 3  # seq + d1..d3
    assert again.stats.reused_tokens == min(cached, len(seq) + accepted)
    assert again.stats.computed_tokens == len(nxt) - again.stats.reused_tokens


# ---------------------------------------------------------------- draft verification


def test_verification_returns_accepted_prefix_plus_one_and_rolls_back(engines):
    target, _ = engines
    ex = Executor(target)
    prompt = prompt_of(3)
    greedy = run(ex, EngineRequest(prompt, 5, return_logits=True)).token_ids
    ex.clear_cache()
    # all accepted: bonus token is the 5th greedy token
    out = run(ex, EngineRequest(prompt, 5, draft_tokens=greedy[:4], return_logits=True))
    assert out.token_ids == greedy and out.stats.accepted == 4 and out.stats.iterations == 1
    assert ex.cached_sequences == [prompt + greedy[:4]]
    # a wrong second token: one accepted, replaced by the target's token, the rest rolled back
    wrong = [greedy[0], (greedy[1] + 1) % 512, greedy[2]]
    out = run(ex, EngineRequest(prompt, 4, draft_tokens=wrong, return_logits=True))
    assert out.token_ids == greedy[:2] and out.stats.accepted == 1
    assert ex.cached_sequences == [prompt + greedy[:1]]
    fresh = forward_fresh(target, prompt + wrong)
    assert torch.equal(out.logits, fresh[len(prompt) - 1 : len(prompt) + 1])  # k+1-row pass == fresh rows


def test_verification_limits():
    engine = TableEngine.random(8, seed=0, max_draft_len=2, max_seq_len=10)
    ex = Executor(engine)
    with pytest.raises(ConfigError, match="larger than maximum number of draft tokens"):
        run(ex, EngineRequest([1], 4, draft_tokens=[1, 2, 3]))
    with pytest.raises(ConfigError, match="max_seq_len"):
        run(ex, EngineRequest([1] * 8, 4))
    with pytest.raises(ConfigError):
        run(ex, EngineRequest([], 4))


# ---------------------------------------------------------------- stop conditions, bad words, streaming


def chain_engine():
    """A bigram engine whose greedy path from token 1 is 1 -> 2 -> 3 -> ... -> 7 -> 0 -> 1."""
    vocab = 8
    table = torch.zeros(vocab, vocab)
    for t in range(vocab):
        table[t, (t + 1) % vocab] = 10.0
        table[t, (t + 2) % vocab] = 5.0
    return TableEngine(table)


def test_stop_conditions():
    ex = Executor(chain_engine())
    r = run(ex, EngineRequest([1], 10, end_id=5))
    assert r.token_ids == [2, 3, 4, 5] and r.finish_reason == "end_id"
    r = run(ex, EngineRequest([1], 10, stop_words=[[3, 4]]))
    assert r.token_ids == [2, 3, 4] and r.finish_reason == "stop_words"
    r = run(ex, EngineRequest([1], 3))
    assert r.token_ids == [2, 3, 4] and r.finish_reason == "length" and r.stats.output_tokens == 3
    # draft verification also stops at the end id inside the accepted drafts
    r = run(ex, EngineRequest([1], 5, end_id=3, draft_tokens=[2, 3, 4, 5]))
    assert r.token_ids == [2, 3] and r.finish_reason == "end_id"


def test_bad_words_are_masked():
    ex = Executor(chain_engine())
    r = run(ex, EngineRequest([1], 3, bad_words=[[3]], return_logits=True))
    assert r.token_ids == [2, 4, 5]  # 3 banned: the second choice (2 + 2) is taken
    assert r.logits[1, 3] == 10.0  # generation logits are the engine's raw rows, as TensorRT-LLM returns them
    r = run(ex, EngineRequest([1], 4, bad_words=[[3, 4]]))  # 4 is banned only right after 3
    assert r.token_ids == [2, 3, 5, 6]


def test_streaming_yields_one_chunk_per_token_with_stats_last():
    ex = Executor(chain_engine())
    chunks = list(ex.generate(EngineRequest([1], 4, streaming=True, return_logits=True)))
    assert [c.token_ids for c in chunks] == [[2], [3], [4], [5]]
    assert [c.finished for c in chunks] == [False, False, False, True]
    assert chunks[-1].stats.output_tokens == 4 and chunks[-1].stats.iterations == 4
    assert all(c.logits.shape == (1, 8) for c in chunks)


def test_seeded_sampling_is_reproducible_and_varies_with_seed():
    engine = TableEngine.random(32, seed=3, scale=0.5)
    ex = Executor(engine)
    a = run(ex, EngineRequest([1], 30, SamplingParams(top_k=20, seed=1))).token_ids
    b = run(ex, EngineRequest([1], 30, SamplingParams(top_k=20, seed=1))).token_ids
    c = run(ex, EngineRequest([1], 30, SamplingParams(top_k=20, seed=2))).token_ids
    assert a == b and a != c
    greedy_hot = run(ex, EngineRequest([1], 30, SamplingParams(temperature=5.0))).token_ids  # no top_k/top_p: greedy
    assert greedy_hot == run(ex, EngineRequest([1], 30)).token_ids


# ---------------------------------------------------------------- greedy parity, real models


def test_greedy_speculative_equals_target_only(engines):
    """Token for token, for several prompts and k, on tiny random Llama target and draft."""
    target, draft = engines
    target_ex, draft_ex = Executor(target, 2), Executor(draft, 2)
    for seed in range(3):
        prompt = prompt_of(seed, n=3 + 2 * seed)
        expected = spec.collect(target_only_generate(target_ex, prompt, 20))[0]
        for k in (1, 3, target.spec.max_draft_len):
            tokens, stats = spec.collect(
                spec.speculative_generate(ExecutorProposer(draft_ex), ExecutorVerifier(target_ex), prompt, 20, k)
            )
            assert tokens == expected, (seed, k)
            assert stats.output_tokens == 20


def test_draft_equals_target_gives_full_acceptance(engines):
    target, _ = engines
    ex_a, ex_b = Executor(target, 2), Executor(target, 2)
    tokens, stats = spec.collect(
        spec.speculative_generate(ExecutorProposer(ex_a), ExecutorVerifier(ex_b), prompt_of(9), 21, 4)
    )
    assert stats.accepted == stats.drafted == 16 and stats.target_iterations == 5
    assert stats.acceptance_rate == 1.0


def test_verification_pass_logits_equal_single_steps_for_every_k(engines):
    """The k+1-row verification pass must give the one-row logits bit for bit, up to max_draft_len
    (on the CPU engine this covers a full row bucket: suffix + max_draft_len drafts)."""
    target, _ = engines
    prompt = prompt_of(11, n=5)
    steps = forward_fresh(target, prompt[:1])
    cache = target.new_cache(64)
    target.forward(cache, torch.tensor(prompt[:1]))
    rows = [
        target.forward(cache, torch.tensor([t])) for t in prompt[1:] + list(range(10, 10 + target.spec.max_draft_len))
    ]
    stepwise = torch.cat([steps] + rows)  # [n, vocab], one position per call
    seq = prompt + list(range(10, 10 + target.spec.max_draft_len))
    for k in range(1, target.spec.max_draft_len + 1):
        ex = Executor(target)
        run(ex, EngineRequest(prompt, 1))  # caches prompt; the verification pass is then [last prompt token] + k drafts
        out = run(ex, EngineRequest(prompt, k + 1, draft_tokens=seq[len(prompt) : len(prompt) + k], return_logits=True))
        n = len(out.token_ids)
        assert torch.equal(out.logits, stepwise[len(prompt) - 1 : len(prompt) - 1 + n]), k


def test_generate_session_streams_text(tiny_llama_dir, tiny_llama_draft_dir):
    from transformers import AutoTokenizer

    from specdeploy.engine.generate import Session, generate, stats_lines

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    session = Session(tok, Executor(ReferenceEngine(tiny_llama_dir)), Executor(ReferenceEngine(tiny_llama_draft_dir)))
    pieces = []
    spec_result = generate(session, "The quick brown fox", 12, num_draft_tokens=3, on_text=pieces.append)
    plain = generate(session, "The quick brown fox", 12, num_draft_tokens=0)
    assert spec_result.token_ids == plain.token_ids and "".join(pieces) == spec_result.text
    assert spec_result.stats.drafted > 0 and plain.stats.drafted == 0
    text = "\n".join(stats_lines(spec_result, speculative=True))
    assert "acceptance rate" in text and "time in draft" in text


def test_cli_generate_without_engines_says_how_to_build(tmp_path):
    from click.testing import CliRunner

    from specdeploy.cli.main import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\ntarget: {model: smollm2-135m-instruct}\ndraft: {model: smollm2-135m-instruct}\n")
    result = CliRunner().invoke(main, ["--root", str(tmp_path), "generate", str(recipe), "--prompt", "hi"])
    assert result.exit_code != 0
    assert "specdeploy build" in result.output


# ---------------------------------------------------------------- logits processing, log probs, context logits
# Expected values come from hand-checked chains (chain_engine) or from `ref_process` below, a
# plain-Python re-statement of TensorRT-LLM's penaltyKernels.cu order that shares no code with
# specdeploy.engine.logits.


def ref_process(
    row, sequence, generated, bias=None, temperature=1.0, rep=1.0, presence=0.0, freq=0.0, min_tokens=0, end_id=None
):
    values = [float(v) for v in row]
    for j in range(len(values)):
        v = values[j] + (float(bias[j]) if bias is not None else 0.0)
        if temperature not in (0.0, 1.0):
            v /= temperature
        count = list(sequence).count(j)
        if count:
            v = v * rep if v < 0 else v / rep
            v -= presence + freq * count
        if j == end_id and generated < min_tokens:
            v = float("-inf")
        values[j] = v
    return values


def ref_greedy_table(table, prompt, n, end_id=None, **kw):
    """Step-by-step greedy decoding of a bigram table with ref_process."""
    sequence, out = list(prompt), []
    while len(out) < n:
        values = ref_process(table[sequence[-1]].tolist(), sequence, len(out), end_id=end_id, **kw)
        token = max(range(len(values)), key=lambda j: (values[j], -j))
        out.append(token)
        sequence.append(token)
        if token == end_id:
            break
    return out


PENALTIES = dict(repetition_penalty=1.6, presence_penalty=0.7, frequency_penalty=0.4)


def test_presence_penalty_counts_the_prompt():
    ex = Executor(chain_engine())
    assert run(ex, EngineRequest([4, 1, 2, 3], 2)).token_ids == [4, 5]
    # 4 is in the prompt: from 3, 4 scores 10 - 6 = 4 < 5 (token 5)
    assert run(ex, EngineRequest([4, 1, 2, 3], 2, presence_penalty=6.0)).token_ids == [5, 6]


def test_penalties_match_a_reference_decoder():
    engine = TableEngine.random(24, seed=5, scale=1.0)
    ex = Executor(engine)
    bias = torch.linspace(-0.5, 0.5, 24)
    prompt = [3, 7, 3, 11]
    for kw, ref_kw in [
        (dict(repetition_penalty=1.8), dict(rep=1.8)),
        (dict(repetition_penalty=0.6), dict(rep=0.6)),
        (dict(presence_penalty=0.9), dict(presence=0.9)),
        (dict(frequency_penalty=0.6), dict(freq=0.6)),
        (dict(PENALTIES, embedding_bias=bias), dict(rep=1.6, presence=0.7, freq=0.4, bias=bias)),
    ]:
        got = run(ex, EngineRequest(prompt, 30, **kw)).token_ids
        assert got == ref_greedy_table(engine.table, prompt, 30, **ref_kw), kw
    plain = run(ex, EngineRequest(prompt, 30)).token_ids
    assert plain != run(ex, EngineRequest(prompt, 30, **PENALTIES)).token_ids  # the penalties matter here


def test_min_tokens_bans_the_end_id_until_the_count():
    ex = Executor(chain_engine())
    assert run(ex, EngineRequest([1], 20, end_id=3)).token_ids == [2, 3]
    assert run(ex, EngineRequest([1], 20, end_id=3, min_tokens=1)).token_ids == [2, 3]  # 1 generated: allowed
    # min_tokens 2: the 2nd token may not be 3, so 4 (the second choice); then round the chain back to 3
    r = run(ex, EngineRequest([1], 20, end_id=3, min_tokens=2))
    assert r.token_ids == [2, 4, 5, 6, 7, 0, 1, 2, 3] and r.finish_reason == "end_id"


def test_embedding_bias_is_added_to_the_logits():
    ex = Executor(chain_engine())
    bias = torch.zeros(8)
    bias[2] = -6.0  # from 1: token 2 scores 10 - 6 = 4 < token 3's 5
    assert run(ex, EngineRequest([1], 8, embedding_bias=bias)).token_ids == [3, 4, 5, 6, 7, 0, 1, 3]
    with pytest.raises(ConfigError, match="embedding_bias"):
        run(ex, EngineRequest([1], 2, embedding_bias=torch.zeros(7)))
    with pytest.raises(ConfigError, match="repetition_penalty"):
        run(ex, EngineRequest([1], 2, repetition_penalty=0.0))


def test_log_probs_are_of_the_processed_distribution():
    engine = TableEngine.random(16, seed=7, scale=1.0)
    prompt = [1, 5, 1]
    kw = dict(PENALTIES, return_log_probs=True, return_logits=True)
    sampled = SamplingParams(temperature=0.8, top_k=5, seed=3)
    for normalize in (False, True):
        ex = Executor(engine, normalize_log_probs=normalize)
        for sampling in (SamplingParams(), sampled):
            for streaming in (False, True):
                r = run(ex, EngineRequest(prompt, 12, sampling, streaming=streaming, **kw))
                assert len(r.log_probs) == len(r.token_ids) == 12
                sequence = list(prompt)
                for i, token in enumerate(r.token_ids):
                    values = ref_process(
                        r.logits[i].tolist(),
                        sequence,
                        i,
                        temperature=sampling.temperature,
                        rep=1.6,
                        presence=0.7,
                        freq=0.4,
                    )
                    values = torch.tensor(values)
                    if not normalize:
                        expected = float(torch.log_softmax(values.double(), -1)[token])
                    elif sampling.top_k == 0:
                        expected = 0.0  # greedy: the token had probability 1
                    else:
                        kept = torch.topk(values.double(), sampling.top_k).values
                        expected = float(values[token].double() - torch.logsumexp(kept, -1))
                    assert r.log_probs[i] == pytest.approx(expected, abs=1e-4), (normalize, sampling, i)
                    sequence.append(token)
                assert r.stats.cum_log_prob == pytest.approx(sum(r.log_probs), abs=1e-5)
                if normalize is False:
                    assert r.stats.cum_log_prob < 0


def test_context_logits_equal_a_fresh_forward(engines):
    target, _ = engines
    ex = Executor(target)
    prompt = prompt_of(21, n=7)
    run(ex, EngineRequest(prompt, 3))  # caches the prompt: the next request would reuse it
    r = run(ex, EngineRequest(prompt, 2, return_context_logits=True, return_logits=True))
    fresh = forward_fresh(target, prompt + r.token_ids[:1])  # [n + 1, vocab]
    assert r.stats.reused_tokens == 0 and r.context_logits.shape == (len(prompt), target.spec.vocab_size)
    assert torch.equal(r.context_logits, fresh[: len(prompt)])
    assert torch.equal(r.logits, fresh[len(prompt) - 1 :])
    v = run(ex, EngineRequest(prompt, 3, draft_tokens=r.token_ids, return_context_logits=True))
    assert torch.equal(v.context_logits, fresh[: len(prompt)])
    assert run(ex, EngineRequest(prompt, 2)).context_logits is None


def test_greedy_verification_with_penalties_equals_single_steps(engines):
    """A k+1-row verification pass applies the penalties per position over input + draft[:i]:
    verifying the target's own (penalized) output accepts all of it; a corrupted draft is cut at the
    corruption and replaced by the penalized step's token; rounds chained like the BLS's give the
    step-by-step output."""
    target, _ = engines
    k = target.spec.max_draft_len
    vocab = target.spec.vocab_size
    bias = torch.zeros(vocab)
    bias[prompt_of(30, n=4)] = 1.5
    end_id = 2
    kw = dict(PENALTIES, embedding_bias=bias, end_id=end_id)
    prompt = prompt_of(31, n=6) + prompt_of(31, n=6)[:3]  # repeated tokens: the prompt's penalties matter
    ex = Executor(target, 2)
    steps = run(ex, EngineRequest(prompt, 16, min_tokens=4, **kw)).token_ids
    assert steps != run(ex, EngineRequest(prompt, 16)).token_ids  # penalties change this output
    ex.clear_cache()
    v = run(ex, EngineRequest(prompt, k + 1, min_tokens=4, draft_tokens=steps[:k], **kw))
    assert v.token_ids == steps[: k + 1] and v.stats.accepted == k
    bad = list(steps[:k])
    bad[2] = (bad[2] + 1) % vocab
    v = run(ex, EngineRequest(prompt, k + 1, min_tokens=4, draft_tokens=bad, **kw))
    assert v.token_ids == steps[:3] and v.stats.accepted == 2
    # BLS-style rounds: whole sequence each time, min_tokens lowered by what was generated
    out = []
    while len(out) < 16:
        draft = steps[len(out) : len(out) + 3]
        draft[-1:] = [(draft[-1] + 7) % vocab] if len(out) % 2 else draft[-1:]  # every other round, a wrong last draft
        left = 16 - len(out)
        request = EngineRequest(
            prompt + out,
            min(len(draft) + 1, left),
            min_tokens=max(0, 4 - len(out)),
            draft_tokens=draft[: left - 1] or None,
            **kw,
        )
        r = run(ex, request)
        out += r.token_ids
        if r.finish_reason == "end_id":
            break
    assert out == steps


def test_min_tokens_in_verification_rejects_an_early_end_id():
    ex = Executor(chain_engine())
    # step by step with min_tokens 2 from [1]: 2, 4 (3 is the end id), 5
    assert run(ex, EngineRequest([1], 3, end_id=3, min_tokens=2)).token_ids == [2, 4, 5]
    v = run(ex, EngineRequest([1], 3, end_id=3, min_tokens=2, draft_tokens=[2, 3]))
    assert v.token_ids == [2, 4] and v.stats.accepted == 1
    # min_tokens 1: row 1 has generated 1 token, so the end id is allowed there (as step by step: [2, 3])
    assert run(ex, EngineRequest([1], 3, end_id=3, min_tokens=1)).token_ids == [2, 3]
    v = run(ex, EngineRequest([1], 3, end_id=3, min_tokens=1, draft_tokens=[2, 3]))
    assert v.token_ids == [2, 3] and v.stats.accepted == 2 and v.finish_reason == "end_id"


# ---------------------------------------------------------------- cancellation, deadline, timestamps, KV blocks


class TickingEngine(TableEngine):
    """A table engine whose every forward pass advances a fake clock by one second (and 1000 ns)."""

    def __init__(self, table):
        super().__init__(table)
        self.now = 0.0

    def clock(self):
        return self.now

    def wall_ns(self):
        return int(self.now * 1000)

    def forward(self, cache, token_ids):
        self.now += 1.0
        return super().forward(cache, token_ids)


def ticking_chain():
    return TickingEngine(chain_engine().table)


@pytest.mark.parametrize("streaming", [False, True])
def test_cancellation_stops_within_one_step(streaming):
    engine = ticking_chain()
    ex = Executor(engine, clock=engine.clock)
    request = EngineRequest([1], 50, streaming=streaming, is_cancelled=lambda: engine.calls >= 3)
    chunks = list(ex.generate(request))
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == [2, 3, 4] and engine.calls == 3  # the token of the 3rd pass is kept, no 4th pass
    assert chunks[-1].finished and chunks[-1].finish_reason == "cancelled" and chunks[-1].stats.output_tokens == 3
    # the executor is free: the next request runs to its end
    assert run(ex, EngineRequest([1], 4)).finish_reason == "length"


def test_cancelled_before_start_runs_nothing():
    engine = ticking_chain()
    ex = Executor(engine, clock=engine.clock)
    r = run(ex, EngineRequest([1], 5, is_cancelled=lambda: True))
    assert r.token_ids == [] and r.finish_reason == "cancelled" and engine.calls == 0
    r = run(ex, EngineRequest([1], 5, draft_tokens=[2, 3], is_cancelled=lambda: True))
    assert r.token_ids == [] and r.finish_reason == "cancelled" and engine.calls == 0


def test_deadline_stops_within_one_step():
    engine = ticking_chain()
    ex = Executor(engine, clock=engine.clock)
    r = run(ex, EngineRequest([1], 50, timeout_s=2.5))
    # passes end at t = 1, 2, 3: the check after the 3rd pass's token sees 3 >= 2.5
    assert r.token_ids == [2, 3, 4] and r.finish_reason == "timeout" and engine.calls == 3
    r = run(ex, EngineRequest([1], 3, timeout_s=3.0))  # length is reached first: it wins
    assert r.finish_reason == "length"
    with pytest.raises(ConfigError, match="timeout_s"):
        run(ex, EngineRequest([1], 3, timeout_s=0))


def test_first_token_time_is_stamped_when_the_token_is_chosen():
    engine = ticking_chain()
    ex = Executor(engine, clock=engine.clock, wall_clock_ns=engine.wall_ns)
    r = run(ex, EngineRequest([1], 5))  # unary: one chunk at the end, but the stamps are per token
    assert r.stats.scheduled_time_ns == 0
    assert r.stats.first_token_time_ns == 1000  # after the prefill pass, not at the end
    assert r.stats.last_token_time_ns == 5000
    assert r.stats.first_token_time_s == 1.0 and r.stats.total_time_s == 5.0


def test_kv_cache_block_counts_on_reuse():
    from specdeploy.engine.executor import TOKENS_PER_BLOCK

    assert TOKENS_PER_BLOCK == 32  # TensorRT-LLM's PluginConfig default tokens_per_block
    ex = Executor(TableEngine.random(32, seed=2), tokens_per_block=4)
    prompt = list(range(4, 14))  # 10 tokens
    first = run(ex, EngineRequest(prompt, 6)).stats
    # 16 tokens in 4-token blocks: 4 blocks, nothing reused
    assert (first.kv_cache_alloc_total_blocks, first.kv_cache_reused_blocks, first.kv_cache_alloc_new_blocks) == (
        4,
        0,
        4,
    )
    longer = prompt + run(ex, EngineRequest(prompt, 6)).token_ids + [1]  # 17 tokens
    second = run(ex, EngineRequest(longer, 3)).stats
    # reused: prompt + 5 outputs = 15 tokens = 3 whole blocks; total ceil(20 / 4) = 5; new 2
    assert second.reused_tokens == 15
    assert (second.kv_cache_alloc_total_blocks, second.kv_cache_reused_blocks, second.kv_cache_alloc_new_blocks) == (
        5,
        3,
        2,
    )


# ---------------------------------------------------------------- chunked prefill (cancellation inside a long prompt)


def test_chunked_prefill_changes_no_logits_and_no_tokens(engines):
    """A prompt run in passes of 3 positions gives the same tokens, logits and context logits, bit
    for bit, as one pass (the engines' rows do not depend on the pass size), plain and verifying."""
    target, _ = engines
    prompt = prompt_of(31, n=10)
    whole, chunked = Executor(target, prefill_chunk=1000), Executor(target, prefill_chunk=3)
    a = run(whole, EngineRequest(prompt, 4, return_logits=True, return_context_logits=True))
    b = run(chunked, EngineRequest(prompt, 4, return_logits=True, return_context_logits=True))
    assert (
        a.token_ids == b.token_ids
        and torch.equal(a.logits, b.logits)
        and torch.equal(a.context_logits, b.context_logits)
    )
    assert b.stats.iterations == a.stats.iterations + 3  # 10 positions: 4 passes of <= 3 instead of 1
    draft = a.token_ids[:2] + [5]
    va = run(Executor(target, prefill_chunk=1000), EngineRequest(prompt, 4, draft_tokens=draft, return_logits=True))
    vb = run(Executor(target, prefill_chunk=3), EngineRequest(prompt, 4, draft_tokens=draft, return_logits=True))
    assert va.token_ids == vb.token_ids and torch.equal(va.logits, vb.logits)


@pytest.mark.parametrize("drafted", [False, True])
def test_cancellation_stops_a_long_prefill_between_chunks(drafted):
    """Cancelled after 2 of the 5 passes a 20-position input needs: no 3rd pass, no token; the
    computed positions stay cached and the next request reuses them."""
    engine = ticking_chain()
    ex = Executor(engine, clock=engine.clock, prefill_chunk=4)
    prompt = [1 + i % 7 for i in range(20)]  # 20 tokens of the 8-token chain
    r = run(ex, EngineRequest(prompt, 5, draft_tokens=[2] if drafted else None, is_cancelled=lambda: engine.calls >= 2))
    assert r.token_ids == [] and r.finish_reason == "cancelled" and engine.calls == 2
    assert ex.cached_sequences == [prompt[:8]]
    r = run(ex, EngineRequest(prompt, 1))
    assert r.finish_reason == "length" and r.stats.reused_tokens == 8
    assert run(ex, EngineRequest([1, 2], 1, timeout_s=0.5)).finish_reason == "length"  # one pass: nothing to interrupt
    ex2 = Executor(engine, clock=engine.clock, prefill_chunk=4)
    r = run(ex2, EngineRequest(prompt, 5, timeout_s=2.5))  # passes end at t = 1, 2, 3: stopped before the 4th
    assert r.finish_reason == "timeout" and r.token_ids == [] and r.stats.computed_tokens == 12
    with pytest.raises(ConfigError, match="prefill_chunk"):
        Executor(engine, prefill_chunk=0)
