"""The fused EAGLE-3 loop: the CPU engine runs the target and an EAGLE-3 head as one model.

Tiers (STYLE.md rule 11): greedy output equals the target alone token for token (random heads, k = 1..4,
one request and in-flight batches), and so does seeded sampled output (token-match verification); a drafter that
proposes the target's own continuation gets every draft accepted; the head's forward equals an independent plain-torch
implementation of the exported format's math; heads that do not fit the target are refused naming the file.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
import torch.nn.functional as F
from eagle3_heads import make_eagle3_head
from tiny_models import make_tiny_model

from specdeploy.core.errors import ModelError
from specdeploy.engine.batching import BatchScheduler
from specdeploy.engine.eagle3 import Eagle3Head, default_aux_layer_ids, quantize_int8_per_channel
from specdeploy.engine.executor import Executor
from specdeploy.engine.request import EngineRequest, run
from specdeploy.recipe.config import EAGLE3_VOCAB_COUNTS
from specdeploy.speculation.sampling import SamplingParams

AUX = (0, 1, 2)


def _engine(model_dir, out_dir, dtype, max_draft_len=8):
    from specdeploy.deploy.cpu_compile import compile_checkpoint
    from specdeploy.engine.model import CpuEngine
    from specdeploy.quantize.modelopt import quantize_model
    from specdeploy.recipe.config import EngineConfig, QuantConfig

    ckpt = out_dir / "ckpt"
    if not ckpt.exists():
        quantize_model(model_dir, QuantConfig(), ckpt, progress=False)
    compile_checkpoint(
        ckpt, out_dir / dtype, EngineConfig(dtype=dtype, max_input_len=128, max_seq_len=256), max_draft_len
    )
    return CpuEngine.load(out_dir / dtype)


@pytest.fixture(scope="module")
def four_layer_dir(tmp_path_factory, tiny_tokenizer_dir):
    path = tmp_path_factory.mktemp("tiny-llama-4l")
    make_tiny_model(path, tiny_tokenizer_dir, seed=0, num_hidden_layers=4)
    return path


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def target(request, four_layer_dir, tmp_path_factory):
    """The tiny 4-layer target: fp32 (torch kernels, padded rows) and bf16 (native decoder, run in segments)."""
    return _engine(four_layer_dir, tmp_path_factory.mktemp("eng"), request.param)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return make_eagle3_head(tmp_path_factory.mktemp("head") / "h", 64, 512, AUX)


def prompt_of(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 512, (n,), generator=g).tolist()


# ---------------------------------------------------------------- the target's aux features


def test_capture_leaves_logits_unchanged(target):
    ids = torch.tensor(prompt_of(1, 21))
    plain = target.forward(target.new_cache(64), ids)
    logits, aux = target.forward(target.new_cache(64), ids, aux_layers=AUX)
    assert torch.equal(plain, logits)
    assert aux.shape == (21, 3 * 64) and aux.dtype == target.dtype
    # the features are the layers' outputs: the last captured layer of a 3-layer prefix equals ...
    outs, auxs = target.forward_batch(
        [target.new_cache(64), target.new_cache(64)],
        [ids, ids[:7]],
        [1, None],
        aux_layers=(1, 3),
        capture=[True, False],
    )
    assert torch.equal(outs[0], plain[-1:]) and torch.equal(outs[1], target.forward(target.new_cache(64), ids[:7]))
    assert torch.equal(auxs[0][:, :64], aux[:, 64:128]) and auxs[1] is None
    # ... and the last layer's output, normed and through the LM head, gives the logits
    last = auxs[0][:, 64:].contiguous()
    assert torch.allclose(target.lm_head(target._norm(last, target.final_norm)).float(), plain, atol=1e-5)


# ---------------------------------------------------------------- the head's math


def reference_head_logits(head_dir, embedding, aux, next_tokens):
    """The exported head's forward in plain f32 torch, written from the format (vLLM llama_eagle3 /
    TensorRT-LLM Eagle3DecoderLayer math), independent of engine/eagle3.py: all rows at once with a causal mask."""
    from safetensors.torch import load_file

    w = {k: v.float() for k, v in load_file(str(head_dir / "model.safetensors")).items()}
    c = json.loads((head_dir / "config.json").read_text())
    h, nq, nkv, d, eps = (
        c["hidden_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
        c["rms_norm_eps"],
    )

    def norm(x, name):
        return F.rms_norm(x, (h,), w[name], eps)

    n = aux.shape[0]
    feature = aux.float() @ w["fc.weight"].T
    x = torch.cat(
        [
            norm(embedding[next_tokens].float(), "layers.0.input_layernorm.weight"),
            norm(feature, "layers.0.hidden_norm.weight"),
        ],
        dim=-1,
    )
    q = (x @ w["layers.0.self_attn.q_proj.weight"].T).view(n, nq, d)
    k = (x @ w["layers.0.self_attn.k_proj.weight"].T).view(n, nkv, d)
    v = (x @ w["layers.0.self_attn.v_proj.weight"].T).view(n, nkv, d)
    inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
    ang = torch.outer(torch.arange(n).float(), inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def rope(t):
        t1, t2 = t[..., : d // 2], t[..., d // 2 :]
        return t * cos + torch.cat([-t2, t1], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
    att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    hs = feature + att.transpose(0, 1).reshape(n, nq * d) @ w["layers.0.self_attn.o_proj.weight"].T
    m = norm(hs, "layers.0.post_attention_layernorm.weight")
    mlp = (F.silu(m @ w["layers.0.mlp.gate_proj.weight"].T) * (m @ w["layers.0.mlp.up_proj.weight"].T)) @ w[
        "layers.0.mlp.down_proj.weight"
    ].T
    prenorm = hs + mlp
    return norm(prenorm, "norm.weight") @ w["lm_head.weight"].T  # [n, draft_vocab]


def test_head_forward_matches_an_independent_implementation(four_layer_dir, tmp_path):
    target = _engine(four_layer_dir, tmp_path, "float32")
    head_dir = make_eagle3_head(tmp_path / "head", 64, 512, AUX, dtype="float32", seed=3)
    head = Eagle3Head.load(head_dir, target)
    ids = prompt_of(2, 12)
    _, aux = target.forward(target.new_cache(64), torch.tensor(ids), aux_layers=AUX)
    next_tokens = ids[1:] + [7]
    expected = reference_head_logits(head_dir, target.embedding, aux, torch.tensor(next_tokens))  # [12, draft_vocab]
    for split in (12, 5):  # all rows in one call, or two calls over the cache (positions continue)
        cache = head.new_cache(64)
        logits, prenorm = head.forward(cache, head.project(aux[:split]), torch.tensor(next_tokens[:split]))
        assert torch.allclose(logits, expected[split - 1], atol=2e-4, rtol=1e-4)
        if split < 12:
            logits, _ = head.forward(cache, head.project(aux[split:]), torch.tensor(next_tokens[split:]))
            assert torch.allclose(logits, expected[-1], atol=2e-4, rtol=1e-4)
    assert cache.length == 12


def test_draft_maps_draft_ids_through_d2t(four_layer_dir, tmp_path):
    target = _engine(four_layer_dir, tmp_path, "float32")
    d2t = torch.arange(64) * 3  # draft id i -> target id 4 i
    head = Eagle3Head.load(make_eagle3_head(tmp_path / "h", 64, 512, AUX, draft_vocab_size=64, d2t=d2t), target)
    drafter = head.new_drafter(64)
    ids = prompt_of(3, 9)
    _, aux = target.forward(target.new_cache(64), torch.tensor(ids), aux_layers=AUX)
    drafter.catch_up(aux, ids[1:] + [5])
    draft = drafter.draft(4)
    assert len(draft) == 4 and all(t % 4 == 0 for t in draft)
    assert draft[0] == 4 * int(drafter.logits.argmax()) and drafter.length == 9  # drafted rows rolled back


def test_head_passes_of_several_sequences_run_together_as_each_alone(target, head_dir):
    """Eagle3Head.run_passes over three sequences (catch-ups of 3 and 2 rows from the target's features at different
    depths, and a draft step from the head's own state between them) gives each sequence the logits, prenorm rows and
    cache of its own pass: on the bf16 target in one forward_batch (native kernels, row-invariant), on the f32 one pass
    by pass."""
    head = Eagle3Head.load(head_dir, target)
    assert head.row_invariant == (target.dtype == torch.bfloat16)
    ids = prompt_of(4, 14)
    _, aux = target.forward(target.new_cache(64), torch.tensor(ids), aux_layers=AUX)  # [14, 3 * hidden]

    def sequences():
        """Three drafters at depths 0, 9 and 5 and the pass each asks for next."""
        drafters = [head.new_drafter(64) for _ in range(3)]
        drafters[1].catch_up(aux[:9], ids[1:10])
        drafters[2].catch_up(aux[:5], ids[1:6])
        steps = [
            drafters[0].catch_up_steps(aux[:3], ids[1:4]),
            drafters[1].draft_steps(3),
            drafters[2].catch_up_steps(aux[5:7], ids[6:8]),
        ]
        return drafters, steps

    drafters, steps = sequences()
    alone = []
    for drafter, step in zip(drafters, steps):
        work = next(step)
        head.run_passes([work])
        alone.append((work.logits, work.prenorm, drafter.cache.length, drafter.cache.read(0, drafter.cache.length)))
    drafters, steps = sequences()
    together = [next(step) for step in steps]
    assert (
        [len(w.tokens) for w in together] == [3, 1, 2] and together[1].aux is None and together[1].features is not None
    )
    head.run_passes(together)
    for work, drafter, (logits, prenorm, length, keys) in zip(together, drafters, alone):
        assert torch.equal(work.logits, logits) and torch.equal(work.prenorm, prenorm)
        assert drafter.cache.length == length and all(
            torch.equal(a, b) for a, b in zip(drafter.cache.read(0, length), keys)
        )


# ---------------------------------------------------------------- the head's forward in one native call

# (weights, final norm, LM head): the variants of the head's one call; the LM head over all 64 draft tokens, the 16
# served ones (draft.serve_vocab_size), or the target's (a head without lm_head.weight)
ONE_CALL_HEADS = [
    ("bf16", True, "all"),
    ("int8", True, "all"),
    ("bf16", False, "served"),
    ("int8", False, "served"),
    ("int8", True, "target's"),
]


def one_call_mismatches(target, head) -> list[str]:
    """Where the head's one native call (csrc Eagle3Head) gives other bits than its ops (`_forward_ops`: the same
    kernels, one call each): catch-ups of 1..5 rows, alone and beside another sequence's draft step (run_passes: fc
    inside the call), and 1..5 rows of head features (forward_batch), after caches of 5 and 3 rows; logits, prenorm
    rows and the caches' keys and values."""
    from specdeploy.engine.eagle3 import HeadPass

    assert head.one_call is not None
    ids = prompt_of(6, 12)
    _, aux = target.forward(target.new_cache(64), torch.tensor(ids), aux_layers=AUX)  # [12, 3 * hidden]
    tokens = ids[1:] + [9]
    one_call = head.one_call

    def outputs(native: bool) -> list[torch.Tensor]:
        head.one_call = one_call if native else None
        try:
            a, b = head.new_drafter(64), head.new_drafter(64)
            a.catch_up(aux[:5], tokens[:5])
            b.catch_up(aux[:3], tokens[:3])
            got = []
            for n in range(1, 6):
                for passes in (
                    [HeadPass(a, tokens[5 : 5 + n], aux=aux[5 : 5 + n])],
                    [HeadPass(a, tokens[5 : 5 + n], aux=aux[5 : 5 + n]), HeadPass(b, tokens[3:4], features=b.prenorm)],
                    [HeadPass(b, tokens[3:4], features=b.prenorm), HeadPass(a, tokens[5 : 5 + n], aux=aux[5 : 5 + n])],
                ):
                    head.run_passes(passes)
                    got += [
                        x for p in passes for x in (p.logits, p.prenorm, *p.drafter.cache.read(0, p.drafter.length))
                    ]
                    a.cache.truncate(5)
                    b.cache.truncate(3)
                features = torch.cat([a.prenorm] * n) + torch.arange(n, dtype=head.dtype)[:, None]  # [n, hidden]
                logits, prenorm = head.forward_batch([a.cache], features, torch.tensor(tokens[5 : 5 + n]), [n])
                got += [logits, prenorm, *a.cache.read(0, 5 + n)]
                a.cache.truncate(5)
            return got
        finally:
            head.one_call = one_call

    native, ops = outputs(True), outputs(False)
    assert len(native) == len(ops)
    return [f"output {i}" for i, (x, y) in enumerate(zip(native, ops)) if not torch.equal(x, y)]


def _one_call_head(path, target, weights, with_norm, lm_head):
    if lm_head == "target's":
        from safetensors.torch import load_file, save_file

        head_dir = make_eagle3_head(path, 64, 512, AUX, with_norm=with_norm)
        tensors = load_file(str(head_dir / "model.safetensors"))
        del tensors["lm_head.weight"]
        save_file(tensors, str(head_dir / "model.safetensors"))
        head = Eagle3Head.load(head_dir, target, weights)
        assert head.lm_head is target.lm_head
        return head
    head_dir = _counted_head(path, [(i * 37) % 11 for i in range(64)], with_norm=with_norm)
    return Eagle3Head.load(head_dir, target, weights, serve_vocab_size=16 if lm_head == "served" else 0)


@pytest.fixture(scope="module")
def bf16_target_dir(four_layer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eng_bf16")
    _engine(four_layer_dir, out, "bfloat16")
    return out / "bfloat16"


@pytest.mark.parametrize("weights, with_norm, lm_head", ONE_CALL_HEADS)
def test_the_heads_one_native_call_gives_the_bits_of_its_ops(target, tmp_path, weights, with_norm, lm_head):
    """The head's forward in one native call equals the same kernels called op by op, bit for bit: bf16 and int8
    linears, with and without a final norm, its own LM head, a served vocabulary of it or the target's; on the f32
    target (torch ops) there is no call."""
    head = _one_call_head(tmp_path / "h", target, weights, with_norm, lm_head)
    if target.native is None:
        assert head.one_call is None
        return
    assert one_call_mismatches(target, head) == []


def test_the_heads_one_native_call_gives_the_bits_of_its_ops_in_the_other_builds(bf16_target_dir, tmp_path):
    """The same comparison in the other builds of the native kernels this CPU can load (each its own build folder):
    the AVX2 one on an AVX-512 CPU (SPECDEPLOY_NATIVE_AVX512=0), the other bf16 kernel on an AVX512-BF16 one."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from specdeploy.engine import native

    if native.ops() is None:
        pytest.skip("no native kernels here")
    builds = []  # (environment, the build's isa and bf16 kernel)
    if native.isa().startswith("avx512"):
        builds.append(({native.AVX512_ENV: "0"}, "avx2 f32"))
    if native.isa() == "avx512-bf16":
        other = "pairs" if native.bf16_kernel() == "dpbf16" else "dpbf16"
        builds.append(({native.BF16_ENV: other}, f"avx512-bf16 {other}"))
    if not builds:
        pytest.skip(f"{native.isa()}: no other build of the kernels on this CPU")
    tests = Path(__file__).parent
    code = "\n".join(
        [
            "import sys, pathlib, test_eagle3_fused as t",
            "from specdeploy.engine import native",
            "from specdeploy.engine.model import CpuEngine",
            f"target = CpuEngine.load({str(bf16_target_dir)!r})",
            f"root = pathlib.Path({str(tmp_path)!r})",
            "heads = [(v, t._one_call_head(root / str(i), target, *v)) for i, v in enumerate(t.ONE_CALL_HEADS)]",
            "bad = [(v, t.one_call_mismatches(target, head)) for v, head in heads]",
            "print(native.isa(), native.bf16_kernel(), bad)",
            "sys.exit(any(b for _, b in bad))",
        ]
    )
    for env, build in builds:
        done = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])},
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0 and done.stdout.startswith(build), (env, done.stdout[-2000:], done.stderr[-2000:])


def test_the_fused_loop_runs_the_heads_one_native_call(target, head_dir, monkeypatch):
    """Where the native kernels run the head, every head pass of the fused loop is one native call (none op by op),
    and the output is the target's."""
    head = Eagle3Head.load(head_dir, target)
    if target.native is None:
        assert head.one_call is None
        return
    assert head.one_call is not None

    class Counted:
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def forward(self, *args):
            self.calls += 1
            return self.inner.forward(*args)

    head.one_call = counted = Counted(head.one_call)

    def no_ops(*args):
        raise AssertionError("the head ran op by op")

    monkeypatch.setattr(head, "_forward_ops", no_ops)
    prompt = prompt_of(7, 9)
    got = run(Executor(target, head=head), EngineRequest(prompt, 16, num_draft_tokens=3))
    assert got.token_ids == run(Executor(target), EngineRequest(prompt, 16)).token_ids
    assert got.stats.drafted > 0 and counted.calls > 0


def test_a_request_closed_mid_draft_leaves_the_heads_cache_as_before(target, head_dir):
    """draft_steps closed between two head passes (a request cancelled while the scheduler batches heads) rolls the
    head's cache back to its caught-up rows, as a finished draft does."""
    head = Eagle3Head.load(head_dir, target)
    ids = prompt_of(5, 8)
    _, aux = target.forward(target.new_cache(64), torch.tensor(ids), aux_layers=AUX)
    drafter = head.new_drafter(64)
    drafter.catch_up(aux, ids[1:] + [9])
    steps = drafter.draft_steps(4)
    head.run_passes([next(steps)])  # the second draft's row is in the cache now
    assert drafter.length == 9
    steps.close()
    assert drafter.length == 8


# ---------------------------------------------------------------- the fused loop: greedy parity


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_fused_greedy_equals_the_target_alone(target, head_dir, k):
    plain, fused = Executor(target), Executor(target, head=Eagle3Head.load(head_dir, target))
    for seed, n in ((0, 5), (1, 11), (2, 30)):
        prompt = prompt_of(seed, n)
        expected = run(plain, EngineRequest(prompt, 20))
        got = run(fused, EngineRequest(prompt, 20, num_draft_tokens=k, return_logits=True))
        assert got.token_ids == expected.token_ids
        assert got.stats.fused and got.stats.drafted > 0
        assert sum(got.stats.drafted_per_position) == got.stats.drafted
        _assert_round_seconds(got.stats)
        assert torch.equal(got.logits, run(plain, EngineRequest(prompt, 20, return_logits=True)).logits)
    again = run(fused, EngineRequest(prompt, 20, num_draft_tokens=k))  # prefix reuse: the head's rows are pooled too
    assert again.token_ids == expected.token_ids and again.stats.reused_tokens > 0


def test_a_fused_request_reuses_the_prefix_a_plain_request_left_and_drafts_as_from_scratch(target, head_dir):
    """Plain and fused requests share the executor's KV pool (the control and the speculative path of one tensorrt_llm
    model): a plain request's prefill keeps the head's aux features beside its KV, so a fused request on the same prompt
    reuses all of it but its last token (it recomputed the whole prompt before) and drafts, round by round, what it
    drafts from an empty cache; its answer is the target's. A plain request's one-row steps keep none (their cost would
    be the control's): the plain answer itself is computed again."""
    fused = Executor(target, head=Eagle3Head.load(head_dir, target))
    prompt = prompt_of(7, 40)
    fused.clear_cache()
    cold = run(fused, EngineRequest(prompt, 24, num_draft_tokens=3))
    fused.clear_cache()
    plain = run(fused, EngineRequest(prompt, 24))
    assert plain.token_ids == cold.token_ids
    warm = run(fused, EngineRequest(prompt, 24, num_draft_tokens=3))
    assert warm.stats.reused_tokens == len(prompt) - 1 and cold.stats.reused_tokens == 0
    assert warm.token_ids == cold.token_ids and warm.stats.drafted > 0
    assert warm.stats.k_per_round == cold.stats.k_per_round
    assert warm.stats.accepted_per_round == cold.stats.accepted_per_round
    # a longer conversation on top of the plain answer: the prompt reused (a plain one-row step keeps no features, so
    # the answer's positions are computed again), the rest drafted as cold
    follow = prompt + plain.token_ids + prompt_of(8, 6)
    fused.clear_cache()
    cold_follow = run(fused, EngineRequest(follow, 16, num_draft_tokens=3))
    fused.clear_cache()
    run(fused, EngineRequest(prompt, 24))
    warm_follow = run(fused, EngineRequest(follow, 16, num_draft_tokens=3))
    assert warm_follow.stats.reused_tokens == len(prompt)
    assert warm_follow.token_ids == cold_follow.token_ids
    assert warm_follow.stats.k_per_round == cold_follow.stats.k_per_round
    # and on top of a fused answer (its rejected drafts' rows rolled back, its head some positions behind)
    after_fused = prompt + cold.token_ids + prompt_of(8, 6)
    fused.clear_cache()
    cold_after = run(fused, EngineRequest(after_fused, 16, num_draft_tokens=3))
    fused.clear_cache()
    run(fused, EngineRequest(prompt, 24, num_draft_tokens=3))
    warm_after = run(fused, EngineRequest(after_fused, 16, num_draft_tokens=3))
    assert warm_after.stats.reused_tokens >= len(prompt) + len(cold.token_ids) - 1
    assert warm_after.token_ids == cold_after.token_ids
    assert warm_after.stats.k_per_round == cold_after.stats.k_per_round


def test_a_pool_entry_keeps_aux_features_only_where_they_follow_its_tokens():
    """CachedSequence.store_aux keeps the rows of a pass that extends the kept ones; rolling back (rejected drafts) or
    truncating (a shorter reused prefix) forgets the rows past the new length, so later rows are kept again."""
    from specdeploy.engine.kv_pool import CachedSequence

    class Cache:
        def truncate(self, length):
            self.length = length

    entry = CachedSequence(Cache(), capacity=8)
    rows = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    entry.store_aux(0, rows[:4])
    entry.tokens = [1, 2, 3, 4]
    assert entry.aux_length == 4 and torch.equal(entry.aux[:4], rows[:4])
    entry.roll_back(2)  # two rejected drafts
    assert entry.aux_length == 2 and entry.tokens == [1, 2]
    entry.store_aux(2, -rows[2:5])  # the next pass's rows replace them
    assert entry.aux_length == 5 and torch.equal(entry.aux[2:5], -rows[2:5])
    entry.store_aux(6, rows[6:7])  # a gap: not kept
    entry.store_aux(5, torch.zeros(4, 3))  # past the capacity: not kept
    assert entry.aux_length == 5
    entry.truncate(3)
    assert entry.aux_length == 3 and entry.nbytes() == 8 * 3 * 4


def _assert_round_seconds(s):
    """The round profile's seconds (the served `draft_seconds_per_round` / `forward_seconds_per_pass`): one entry
    a verification pass beside k_per_round, summing with the prefill's pass to the request's totals; the
    head worked before every pass that holds its drafts."""
    assert len(s.draft_s_per_round) == len(s.target_s_per_round) == len(s.k_per_round) == s.iterations - 1
    assert 0 < s.first_forward_time_s < s.forward_time_s
    assert s.first_forward_time_s + sum(s.target_s_per_round) == pytest.approx(s.forward_time_s, rel=1e-9)
    assert sum(s.draft_s_per_round) == pytest.approx(s.draft_time_s, rel=1e-9)
    assert all(t > 0 for t in s.target_s_per_round)
    assert all(
        d > 0 for d, k, looked in zip(s.draft_s_per_round, s.k_per_round, s.lookup_per_round) if k and not looked
    )


def test_an_int8_head_holds_per_channel_int8_weights_and_stays_bit_exact(target, head_dir):
    """draft.head_weights int8: each of the head's linears holds int8 weights with one scale per output channel,
    within half a step of the exported weight; its logits follow the exported head's; the fused output still equals
    the target alone (only the drafts can change); an unknown kind is refused."""
    from safetensors.torch import load_file

    from specdeploy.engine.kernels import make_linear

    w = load_file(str(head_dir / "model.safetensors"))["layers.0.mlp.down_proj.weight"]
    q = quantize_int8_per_channel(w, target.dtype)
    assert q["weight"].dtype == torch.int8 and q["weight_scale"].shape == (w.shape[0],)
    assert int(q["weight"].abs().max()) == 127  # each channel's largest weight on the grid's end
    error = (q["weight"].float() * q["weight_scale"][:, None] - w.float()).abs()
    assert bool((error <= q["weight_scale"][:, None] * 0.5 + 1e-6).all())
    bf16, int8 = Eagle3Head.load(head_dir, target), Eagle3Head.load(head_dir, target, "int8")
    assert int8.weights == "int8" and bf16.weights == "bf16"
    assert type(int8.down) is type(make_linear(q, "W8A16", target.dtype, None, target.native))
    ids = prompt_of(4, 10)
    _, aux = target.forward(target.new_cache(64), torch.tensor(ids), aux_layers=AUX)
    exact, _ = bf16.forward(bf16.new_cache(64), bf16.project(aux), torch.tensor(ids[1:] + [9]))
    approx, _ = int8.forward(int8.new_cache(64), int8.project(aux), torch.tensor(ids[1:] + [9]))
    assert F.cosine_similarity(exact, approx, dim=0) > 0.99 and not torch.equal(exact, approx)
    plain, fused = Executor(target), Executor(target, head=int8)
    for seed, n in ((0, 5), (2, 30)):
        prompt = prompt_of(seed, n)
        got = run(fused, EngineRequest(prompt, 20, num_draft_tokens=3))
        assert got.token_ids == run(plain, EngineRequest(prompt, 20)).token_ids and got.stats.drafted > 0
    with pytest.raises(ValueError, match="head weights 'int4'"):
        Eagle3Head.load(head_dir, target, "int4")


def test_fused_stops_and_streams_as_the_target(target, head_dir):
    plain, fused = Executor(target), Executor(target, head=Eagle3Head.load(head_dir, target))
    prompt = prompt_of(4, 8)
    ref = run(plain, EngineRequest(prompt, 20)).token_ids
    stop = ref[5:7]
    expected = run(plain, EngineRequest(prompt, 20, stop_words=[stop], end_id=ref[12]))
    got = run(fused, EngineRequest(prompt, 20, stop_words=[stop], end_id=ref[12], num_draft_tokens=3))
    assert (got.token_ids, got.finish_reason) == (expected.token_ids, expected.finish_reason)
    chunks = list(fused.generate(EngineRequest(prompt, 20, num_draft_tokens=3, streaming=True)))
    assert [t for c in chunks for t in c.token_ids] == ref and chunks[-1].finished


SAMPLINGS = [
    SamplingParams(temperature=0.8, top_k=20, seed=5),
    SamplingParams(temperature=1.0, top_p=0.9, seed=11),
    SamplingParams(temperature=0.6, top_k=50, top_p=0.95, seed=2),
]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["top_k", "top_p", "both"])
def test_sampled_requests_run_fused_and_return_the_targets_own_draws(target, head_dir, sampling):
    """Token-match verification: every emitted token is the target's draw from the rows it would have alone, so a
    seeded request gives the target-alone output token for token, whatever the head drafts."""
    fused = Executor(target, head=Eagle3Head.load(head_dir, target))
    for i, k in enumerate((1, 3, 4)):
        prompt = prompt_of(5 + i, 6 + i)
        got = run(fused, EngineRequest(prompt, 24, sampling=sampling, num_draft_tokens=k))
        expected = run(Executor(target), EngineRequest(prompt, 24, sampling=sampling))
        assert got.token_ids == expected.token_ids and len(expected.token_ids) == 24
        assert got.stats.fused and got.stats.drafted > 0 and got.stats.iterations == len(got.stats.k_per_round) + 1


@pytest.mark.parametrize("k", [1, 3])
def test_a_drafter_with_the_targets_sampled_answer_gets_every_draft_accepted(target, k):
    """The draws decide: drafts equal to the target's seeded sample are all kept, a wrong one ends its round there."""
    sampling, prompt = SAMPLINGS[1], prompt_of(8, 7)
    expected = run(Executor(target), EngineRequest(prompt, 21, sampling=sampling)).token_ids
    got = run(
        Executor(target, head=OracleHead(prompt + expected)),
        EngineRequest(prompt, 21, sampling=sampling, num_draft_tokens=k),
    )
    assert got.token_ids == expected and got.stats.accepted == got.stats.drafted > 0
    assert got.stats.iterations == 1 + -(-20 // (k + 1))
    partly = run(
        Executor(target, head=OracleHead(prompt + expected, 2)),
        EngineRequest(prompt, 21, sampling=sampling, num_draft_tokens=k),
    )
    assert partly.token_ids == expected and 0 < partly.stats.accepted < partly.stats.drafted


def _consume_together(scheduler, consume, n: int) -> None:
    """consume(0..n-1) on threads whose requests all join the scheduler's first step (queued while it is paused)."""
    with scheduler.paused():
        threads = [threading.Thread(target=consume, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        while scheduler.waiting() < n:
            threading.Event().wait(0.01)
    for t in threads:
        t.join(600)


@pytest.mark.parametrize("policy,lookup", [("static", 0), ("cost", 0), ("static", 2)])
def test_fused_requests_in_flight_batching(target, head_dir, policy, lookup):
    """Several requests' verification rows in one forward_batch: each request's output is the target's own (the cost
    policy measures passes of several requests; with the suffix lookup, some requests' rounds are the lookup's)."""
    plain = Executor(target)
    executor = Executor(
        target,
        max_cached_sequences=8,
        head=Eagle3Head.load(head_dir, target),
        draft_policy=policy,
        lookup_threshold=lookup,
    )
    scheduler = BatchScheduler(executor, 4)
    try:
        requests = [
            EngineRequest(
                prompt_of(10 + i, 4 + 3 * i) if i % 2 else _repeating_prompt(10 + i), 16, num_draft_tokens=1 + i % 4
            )
            for i in range(5)
        ]
        requests.append(EngineRequest(prompt_of(20, 9), 12))  # a plain request in the same batches
        results, stats = [None] * len(requests), [None] * len(requests)

        def consume(i):
            tokens = []
            for chunk in scheduler.generate(requests[i]):
                tokens.extend(chunk.token_ids)
                stats[i] = chunk.stats
            results[i] = tokens

        _consume_together(scheduler, consume, len(requests))
        alone = Executor(
            target, max_cached_sequences=8, head=Eagle3Head.load(head_dir, target), lookup_threshold=lookup
        )
        for request, tokens, batched in zip(requests, results, stats):
            assert tokens == run(plain, EngineRequest(request.input_ids, request.max_new_tokens)).token_ids
            if request.num_draft_tokens:  # a pass shared with other requests: timed whole for each of them
                _assert_round_seconds(batched)
            if (
                policy == "static" and request.num_draft_tokens
            ):  # the head's batched forwards drafted what it drafts alone
                own = run(alone, request).stats
                assert (batched.k_per_round, batched.accepted_per_round) == (own.k_per_round, own.accepted_per_round)
        assert scheduler.max_active > 1
        assert scheduler.max_head_batch > 1  # several requests' head forwards in one
        if policy == "cost":
            assert len(scheduler.executor.draft_cost.pass_s) > 2  # passes of several row counts timed
    finally:
        scheduler.close()


def test_a_failed_head_step_fails_its_requests_and_the_others_go_on(target, head_dir):
    """A head forward that raises fails the fused requests whose passes it held (their consumers get the error); a
    plain request in flight finishes with the target's tokens, and the scheduler serves the next fused request."""
    plain = Executor(target)
    executor = Executor(target, max_cached_sequences=8, head=Eagle3Head.load(head_dir, target))
    calls, run_head_passes = [], executor.run_head_passes

    def failing_once(passes):
        calls.append(len(passes))
        if len(calls) == 3:
            raise RuntimeError("head failure")
        run_head_passes(passes)

    executor.run_head_passes = failing_once
    scheduler = BatchScheduler(executor, 4)
    try:
        requests = [EngineRequest(prompt_of(30 + i, 6), 12, num_draft_tokens=3) for i in range(2)]
        requests.append(EngineRequest(prompt_of(40, 7), 12))  # plain: no head passes
        results = [None] * len(requests)

        def consume(i):
            try:
                results[i] = [t for chunk in scheduler.generate(requests[i]) for t in chunk.token_ids]
            except RuntimeError as exc:
                results[i] = exc

        _consume_together(scheduler, consume, len(requests))
        assert calls[2] == 2  # the failed step held both fused requests' passes
        assert all(isinstance(r, RuntimeError) and "head failure" in str(r) for r in results[:2]), results
        assert results[2] == run(plain, EngineRequest(requests[2].input_ids, 12)).token_ids
        again = [t for chunk in scheduler.generate(requests[0]) for t in chunk.token_ids]
        assert again == run(plain, EngineRequest(requests[0].input_ids, 12)).token_ids
    finally:
        scheduler.close()


# ---------------------------------------------------------------- a drafter that knows the target's answer


class OracleDrafter:
    """Proposes the target's own greedy continuation (from a reference run), optionally wrong at every
    `wrong_every`-th draft: the loop's accounting, with nothing left to chance."""

    def __init__(self, reference: list[int], wrong_every: int = 0):
        self.reference, self.wrong_every, self.length, self.drafts = reference, wrong_every, 0, 0

    def truncate(self, length):
        self.length = length

    def catch_up(self, aux, next_tokens):
        assert aux.shape[0] == len(next_tokens)
        assert (
            next_tokens == self.reference[self.length + 1 : self.length + 1 + len(next_tokens)]
        )  # the target's tokens
        self.length += len(next_tokens)

    # the fused loop's protocol: generators of the head passes they need (the oracle needs none)
    def catch_up_steps(self, aux, next_tokens):
        yield from ()
        self.catch_up(aux, next_tokens)

    def draft_steps(self, k, p_min=0.0, rule=None):
        yield from ()
        return self.draft(k, p_min, rule)

    def draft(self, k, p_min=0.0, rule=None):
        tokens = self.reference[self.length + 1 : self.length + 1 + k]
        wrong = None
        if self.wrong_every:
            self.drafts += 1
            if self.drafts % self.wrong_every == 0:
                tokens[-1] = (tokens[-1] + 1) % 512
                wrong = len(tokens) - 1
        if rule is None:
            return tokens
        kept = []  # policy cost: the oracle is sure of its right drafts (0.95) and unsure of the wrong one (0.05)
        for j, token in enumerate(tokens):
            if (j and not rule.more()) or not rule.verify(0.05 if j == wrong else 0.95):
                break
            kept.append(token)
        return kept


class OracleHead:
    aux_layer_ids = AUX

    def __init__(self, reference, wrong_every=0):
        self.reference, self.wrong_every = reference, wrong_every

    def new_drafter(self, max_len):
        return OracleDrafter(self.reference, self.wrong_every)


@pytest.mark.parametrize("k", [1, 3, 4])
def test_a_drafter_with_the_targets_answer_gets_every_draft_accepted(target, k):
    prompt = prompt_of(6, 7)
    expected = run(Executor(target), EngineRequest(prompt, 21)).token_ids
    got = run(Executor(target, head=OracleHead(prompt + expected)), EngineRequest(prompt, 21, num_draft_tokens=k))
    s = got.stats
    assert got.token_ids == expected
    assert s.accepted == s.drafted > 0 and s.accepted_per_position == s.drafted_per_position
    assert s.accepted_per_round == s.k_per_round
    assert s.iterations == 1 + -(-20 // (k + 1))  # prefill, then k + 1 tokens per pass
    partly = run(Executor(target, head=OracleHead(prompt + expected, 2)), EngineRequest(prompt, 21, num_draft_tokens=k))
    assert partly.token_ids == expected and 0 < partly.stats.accepted < partly.stats.drafted


def test_policy_cost_verifies_the_drafts_that_pay_and_stays_the_target(target):
    """policy cost (engine/draft_cost.py): the oracle is sure (0.95) of its right drafts and unsure (0.05) of the one
    it gets wrong every second round; the static policy verifies every draft and has some rejected, the cost policy
    verifies the sure ones only: every draft it verifies is accepted, in fewer passes than plain steps. Both give
    the target's own tokens; the cost model measured the passes and calibrated the head's probabilities."""
    prompt = prompt_of(6, 7)
    expected = run(Executor(target), EngineRequest(prompt, 21)).token_ids
    static = run(Executor(target, head=OracleHead(prompt + expected, 2)), EngineRequest(prompt, 21, num_draft_tokens=3))
    assert static.token_ids == expected and 0 < static.stats.accepted < static.stats.drafted
    executor = Executor(target, head=OracleHead(prompt + expected, 2), draft_policy="cost")
    got = run(executor, EngineRequest(prompt, 21, num_draft_tokens=3))
    s = got.stats
    assert got.token_ids == expected
    assert s.accepted == s.drafted > 0 and s.iterations < len(expected)
    cost = executor.draft_cost
    assert cost.pass_s.keys() >= {len(prompt), 1}  # the prefill and plain rounds' passes among those timed
    sure, unsure = cost.calibration[-1], cost.calibration[0]
    assert sure.successes == sure.trials > 0 and unsure.trials == 0  # every sure draft verified and accepted
    assert executor.draft_policy == "cost" and Executor(target).draft_policy == "static"


@pytest.mark.parametrize("policy", ["static", "cost"])
def test_a_random_head_under_either_policy_is_the_target(target, head_dir, policy):
    """A random head (first drafts at a few percent) under the cost policy: the rule counts the rounds it cut, and the
    output is the target's; static drafts every round."""
    plain = Executor(target)
    for seed in (0, 1):
        prompt = prompt_of(seed, 11)
        expected = run(plain, EngineRequest(prompt, 24)).token_ids
        executor = Executor(target, head=Eagle3Head.load(head_dir, target), draft_policy=policy)
        got = run(executor, EngineRequest(prompt, 24, num_draft_tokens=3))
        s = got.stats
        assert got.token_ids == expected
        assert sum(s.k_per_round) == s.drafted and s.accepted <= s.drafted
        if policy == "static":  # k = 3 every round but the last ones, where fewer tokens are left than k + 1
            assert len(s.k_per_round) > 3 and set(s.k_per_round[:-3]) == {3}, s.k_per_round
        else:
            assert s.drafted < 3 * len(s.k_per_round) and executor.draft_cost.pass_s


# ---------------------------------------------------------------- the request's own text first (draft.sa_config)


def _repeating_prompt(seed: int) -> list[int]:
    block = prompt_of(seed, 5)
    return block * 3 + block[:2]


def _replayed_lookup_rounds(prompt, output, stats, k, threshold, max_new) -> int:
    """The rounds of a fused run in which the suffix lookup proposes, found again from its output alone: before round
    r the sequence is the prompt and the tokens emitted so far (the prefill's one, then accepted + 1 a round); a
    lookup round drafted exactly what SuffixLookup proposes there, so its count of drafts must be that length, and
    the stats' lookup_accepted must be what those rounds accepted."""
    from specdeploy.speculation.ngram import SuffixLookup

    produced, found, kept, proposed = 1, 0, 0, 0
    assert len(stats.lookup_per_round) == len(stats.k_per_round)
    for drafted, accepted, looked in zip(stats.k_per_round, stats.accepted_per_round, stats.lookup_per_round):
        asked = min(k, max_new - produced - 1)
        proposal = SuffixLookup(threshold, prompt + output[:produced]).draft(asked)
        assert looked == (1 if proposal else 0), (produced, proposal, looked)  # the per-round flag the metrics read
        if proposal:
            assert drafted == len(proposal), (produced, proposal, drafted)
            found, kept, proposed = found + 1, kept + accepted, proposed + drafted
        produced += accepted + 1
    assert stats.lookup_accepted == kept
    return found, proposed


@pytest.mark.parametrize("k", [1, 3])
def test_lookup_rounds_rest_the_head_which_catches_up_on_the_right_tokens(target, k):
    """lookup_threshold (draft.sa_config): a round whose suffix occurred earlier verifies what followed it and the
    head drafts nothing; the oracle head then catches up on exactly the positions it skipped (OracleDrafter checks
    the tokens and the rows of aux features) and every draft it makes is accepted. The output is the target's, and
    the rounds the lookup drafted are the ones a replay of the output finds."""
    looked_up = 0
    for seed in (7, 8, 9):
        prompt = _repeating_prompt(seed)
        expected = run(Executor(target), EngineRequest(prompt, 21)).token_ids
        got = run(
            Executor(target, head=OracleHead(prompt + expected), lookup_threshold=1),
            EngineRequest(prompt, 21, num_draft_tokens=k),
        )
        s = got.stats
        assert got.token_ids == expected
        rounds, lookup_drafted = _replayed_lookup_rounds(prompt, expected, s, k, 1, 21)
        assert s.lookup_rounds == rounds < len(s.k_per_round)
        assert s.accepted - s.lookup_accepted == s.drafted - lookup_drafted  # the oracle head's drafts: all accepted
        looked_up += s.lookup_rounds
        off = run(Executor(target, head=OracleHead(prompt + expected)), EngineRequest(prompt, 21, num_draft_tokens=k))
        assert off.token_ids == expected and off.stats.lookup_rounds == 0 and off.stats.accepted == off.stats.drafted
    assert looked_up > 0


@pytest.mark.parametrize("policy", ["static", "cost"])
def test_lookup_with_a_random_head_greedy_and_sampled_is_the_target(target, head_dir, policy):
    """With a random head, greedy and seeded sampled requests (token match) under either policy: the target's own
    tokens, with the rounds the replay finds drafted by the lookup; a threshold longer than any repeat looks nothing up.
    """
    plain, looked_up = Executor(target), 0
    for seed, sampling in ((0, SamplingParams()), (1, SAMPLINGS[0]), (2, SamplingParams())):
        prompt = _repeating_prompt(seed)
        expected = run(plain, EngineRequest(prompt, 24, sampling=sampling)).token_ids
        executor = Executor(target, head=Eagle3Head.load(head_dir, target), draft_policy=policy, lookup_threshold=1)
        got = run(executor, EngineRequest(prompt, 24, sampling=sampling, num_draft_tokens=3))
        assert got.token_ids == expected
        assert got.stats.lookup_rounds == _replayed_lookup_rounds(prompt, expected, got.stats, 3, 1, 24)[0]
        looked_up += got.stats.lookup_rounds
        never = Executor(
            target, head=Eagle3Head.load(head_dir, target), draft_policy=policy, lookup_threshold=len(prompt) + 24
        )
        got = run(never, EngineRequest(prompt, 24, sampling=sampling, num_draft_tokens=3))
        assert got.token_ids == expected and got.stats.lookup_rounds == 0
    assert looked_up > 0


# ---------------------------------------------------------------- the head's confidence cut-off (draft_p_min)


def _first_draft_probability(drafter) -> float:
    return float(torch.softmax(drafter.logits.reshape(-1).float(), -1).max())


class _Probabilities:
    """A draft rule (the cost policy's interface) that keeps every draft and records the head's probability of each."""

    def __init__(self):
        self.seen: list[float] = []

    def more(self) -> bool:
        return True

    def verify(self, p: float) -> bool:
        self.seen.append(p)
        return True


def test_draft_p_min_stops_at_the_first_draft_below_it(target, head_dir):
    """draft(k, p_min) is the prefix of draft(k) up to the first draft whose chain probability (its probability under
    the head times those of the drafts before it) is below p_min: just above the first draft's probability nothing
    is proposed, just below it at least that draft; just above the chain of the first two, one draft, though the
    second alone is more likely than that."""
    head = Eagle3Head.load(head_dir, target)
    fused = Executor(target, head=head)
    prompt = prompt_of(3, 9)
    drafters = []
    real_new = head.new_drafter
    head.new_drafter = lambda *a, **kw: drafters.append(real_new(*a, **kw)) or drafters[-1]
    run(fused, EngineRequest(prompt, 4, num_draft_tokens=3))  # a caught-up drafter to probe
    drafter = drafters[-1]
    full = drafter.draft(4)
    p0 = _first_draft_probability(drafter)
    assert drafter.draft(4, p_min=p0 * 1.0001) == []
    assert drafter.draft(4, p_min=p0 * 0.9999)[:1] == full[:1]
    for p_min in (0.0, 0.001, 0.002, 0.003, 0.01, 0.5):
        cut = drafter.draft(4, p_min=p_min)
        assert cut == full[: len(cut)], p_min
    recorded = _Probabilities()
    assert drafter.draft(4, rule=recorded) == full and recorded.seen[0] == p0
    chains = [p0]
    for p in recorded.seen[1:]:
        chains.append(chains[-1] * p)
    for i, chain in enumerate(chains):  # cut at draft i + 1 exactly where its chain falls below p_min
        assert drafter.draft(4, p_min=chain * 1.0001) == full[:i], i
        assert drafter.draft(4, p_min=chain * 0.9999)[: i + 1] == full[: i + 1], i
    assert recorded.seen[1] > chains[1] * 1.0001  # the second draft alone would have cleared that cut
    assert drafter.draft(4) == full  # drafting leaves the head's cache as it was


def _first_draft_probabilities(head, executor, prompt, n) -> list[float]:
    """The head's probability of its first draft in every round of a k = 3 run (p_min 0)."""
    seen = []
    real_new = head.new_drafter

    def new_drafter(*args, **kwargs):
        drafter = real_new(*args, **kwargs)
        real_draft = drafter.draft_steps

        def draft_steps(k, p_min=0.0, rule=None):
            seen.append(_first_draft_probability(drafter))
            return (yield from real_draft(k, p_min, rule))

        drafter.draft_steps = draft_steps
        return drafter

    head.new_drafter = new_drafter
    try:
        run(executor, EngineRequest(prompt, n, num_draft_tokens=3))
    finally:
        head.new_drafter = real_new
    return seen


@pytest.mark.parametrize("cut", ["median", "never sure"])
def test_fused_with_draft_p_min_equals_the_target_alone_and_counts_the_rounds_it_drafted(target, head_dir, cut):
    """p_min at the median of the head's first-draft probabilities: about half the rounds propose nothing (one
    target row), the others draft; at 0.99, which a random head never reaches, no round drafts. The output is the
    target's own either way, and the counters add up."""
    plain = Executor(target)
    for seed in (0, 1, 2):
        prompt = prompt_of(seed, 11)
        expected = run(plain, EngineRequest(prompt, 24)).token_ids
        head = Eagle3Head.load(head_dir, target)
        probabilities = sorted(_first_draft_probabilities(head, Executor(target, head=head), prompt, 24))
        p_min = probabilities[len(probabilities) // 2] if cut == "median" else 0.99
        got = run(Executor(target, head=head, draft_p_min=p_min), EngineRequest(prompt, 24, num_draft_tokens=3))
        s = got.stats
        assert got.token_ids == expected
        assert sum(s.k_per_round) == s.drafted and max(s.k_per_round) <= 3 and s.accepted <= s.drafted
        if cut == "median":  # the rounds the head is unsure of are one-row passes; the others draft
            assert 0 < s.k_per_round.count(0) < len(s.k_per_round), s.k_per_round
            assert s.drafted > 0
        else:
            assert s.drafted == 0 and len(s.k_per_round) == len(expected) - 1


# ---------------------------------------------------------------- draft.serve_vocab_size


def _counted_head(path, counts, **kwargs):
    """A random head with 64 draft tokens (draft id i -> target id 4 i) and `counts` as its draft_vocab_counts.json."""
    head = make_eagle3_head(path, 64, 512, AUX, draft_vocab_size=64, d2t=torch.arange(64) * 3, **kwargs)
    (head / EAGLE3_VOCAB_COUNTS).write_text(json.dumps({"counts": counts}))
    return head


def test_a_served_vocabulary_scores_the_most_counted_draft_tokens_and_stays_the_target(target, tmp_path):
    """draft.serve_vocab_size n: the head keeps the n draft ids its counts rank first (ties: the lower id); its logits
    are the whole head's at those ids, so it drafts the best of them, mapped through d2t; its probabilities are over
    them alone; greedy output stays the target's."""
    counts = [(i * 37) % 11 for i in range(64)]  # 0..10, with ties
    head_dir = _counted_head(tmp_path / "h", counts)
    full, cut = Eagle3Head.load(head_dir, target), Eagle3Head.load(head_dir, target, serve_vocab_size=16)
    kept = sorted(sorted(range(64), key=lambda i: (-counts[i], i))[:16])
    assert cut.served_vocab_size == 16 and full.served_vocab_size == 64
    assert cut.draft_to_target.tolist() == [4 * i for i in kept]
    assert Eagle3Head.load(head_dir, target, serve_vocab_size=64).draft_to_target.tolist() == [4 * i for i in range(64)]
    ids = prompt_of(5, 12)
    _, aux = target.forward(target.new_cache(64), torch.tensor(ids), aux_layers=AUX)
    whole, _ = full.forward(full.new_cache(64), full.project(aux), torch.tensor(ids[1:] + [7]))
    some, _ = cut.forward(cut.new_cache(64), cut.project(aux), torch.tensor(ids[1:] + [7]))
    assert some.shape == (16,) and torch.allclose(some, whole[kept], rtol=1e-3, atol=1e-3)
    drafter = cut.new_drafter(64)
    drafter.catch_up(aux, ids[1:] + [7])
    first = drafter.draft(1)[0]
    assert first == 4 * kept[int(whole[kept].argmax())] and first in cut.draft_to_target.tolist()
    plain, fused = Executor(target), Executor(target, head=cut)
    for seed, n in ((0, 5), (2, 30)):
        prompt = prompt_of(seed, n)
        got = run(fused, EngineRequest(prompt, 20, num_draft_tokens=3))
        assert got.token_ids == run(plain, EngineRequest(prompt, 20)).token_ids and got.stats.drafted > 0


def test_a_served_vocabulary_of_a_head_without_d2t_maps_back_to_the_target_ids(target, tmp_path):
    """A head over the target's whole vocabulary (no d2t: draft id = target id) cut to n tokens: its kept rows are
    the only map from a cut index back to a token id, so the draft is the kept id with the best logit."""
    head_dir = make_eagle3_head(tmp_path / "h", 64, 512, AUX)  # draft_vocab_size = vocab_size, no d2t
    counts = [(i * 53) % 17 for i in range(512)]
    (head_dir / EAGLE3_VOCAB_COUNTS).write_text(json.dumps({"counts": counts}))
    full, cut = Eagle3Head.load(head_dir, target), Eagle3Head.load(head_dir, target, serve_vocab_size=16)
    kept = sorted(sorted(range(512), key=lambda i: (-counts[i], i))[:16])
    assert full.draft_to_target is None and cut.draft_to_target.tolist() == kept
    ids = prompt_of(3, 10)
    _, aux = target.forward(target.new_cache(64), torch.tensor(ids), aux_layers=AUX)
    whole, _ = full.forward(full.new_cache(64), full.project(aux), torch.tensor(ids[1:] + [7]))
    drafter = cut.new_drafter(64)
    drafter.catch_up(aux, ids[1:] + [7])
    assert drafter.draft(1) == [kept[int(whole[kept].argmax())]]
    got = run(Executor(target, head=cut), EngineRequest(ids, 16, num_draft_tokens=3))
    assert got.token_ids == run(Executor(target), EngineRequest(ids, 16)).token_ids


def test_a_vocabulary_of_one_drafts_with_certainty(target, tmp_path):
    """Cut to one draft token the head gives it probability 1: a draft_p_min of 0.99, which the whole random head seldom
    reaches, drafts in every round but the last (the served test uses this to see the cut inside tritonserver)."""
    head_dir = _counted_head(tmp_path / "h", [1] * 10 + [5] + [1] * 53)
    prompt = prompt_of(1, 9)
    rounds = {}
    for size in (0, 1):
        head = Eagle3Head.load(head_dir, target, serve_vocab_size=size)
        got = run(Executor(target, head=head, draft_p_min=0.99), EngineRequest(prompt, 12, num_draft_tokens=3))
        assert got.token_ids == run(Executor(target), EngineRequest(prompt, 12)).token_ids
        rounds[size] = got.stats.k_per_round
    assert rounds[1].count(0) <= 1 and rounds[1][0] == 3, rounds  # only the last round has no room to draft
    assert rounds[0].count(0) > len(rounds[0]) / 2, rounds


@pytest.mark.parametrize(
    "counts, size, words",
    [
        (None, 8, "needs draft_vocab_counts.json"),
        ("not json", 8, "draft_vocab_counts.json is unreadable"),
        ([1] * 63, 8, "holds 63 counts"),
        ([1] * 63 + [-1], 8, "expected 64 non-negative"),
        ([1] * 64, 65, "draft vocabulary has 64 tokens"),
    ],
)
def test_a_served_vocabulary_without_fitting_counts_is_refused(target, tmp_path, counts, size, words):
    head_dir = make_eagle3_head(tmp_path / "h", 64, 512, AUX, draft_vocab_size=64)
    if counts is not None:
        (head_dir / EAGLE3_VOCAB_COUNTS).write_text(
            counts if isinstance(counts, str) else json.dumps({"counts": counts})
        )
    with pytest.raises(ModelError) as err:
        Eagle3Head.load(head_dir, target, serve_vocab_size=size)
    assert str(head_dir) in str(err.value) and words in str(err.value) and err.value.hint, str(err.value)


# ---------------------------------------------------------------- heads that do not fit


@pytest.mark.parametrize(
    "kwargs, edit, words",
    [
        (dict(hidden_size=32), None, "hidden_size 32"),
        (dict(aux_layer_ids=(0, 2, 4)), None, "layers [4]"),
        (dict(draft_vocab_size=64, d2t=torch.full((64,), 500)), None, "d2t maps draft ids"),
        (dict(vocab_size=1024), None, "vocab_size 1024"),
        (dict(draft_vocab_size=64), lambda c: c, None),  # fine: d2t of zeros
        ({}, lambda c: c.update(architectures=["LlamaForCausalLM"]), "architectures"),
        ({}, lambda c: c.update(intermediate_size=96), "mlp.gate_proj.weight has shape"),
    ],
)
def test_heads_that_do_not_fit_the_target_are_refused(target, tmp_path, kwargs, edit, words):
    args = dict(hidden_size=64, vocab_size=512, aux_layer_ids=AUX)
    args.update(kwargs)
    path = make_eagle3_head(tmp_path / "head", **args)
    if edit is not None:
        config = json.loads((path / "config.json").read_text())
        edit(config)
        (path / "config.json").write_text(json.dumps(config))
    if words is None:
        assert Eagle3Head.load(path, target).draft_to_target is not None
        return
    with pytest.raises(ModelError) as err:
        Eagle3Head.load(path, target)
    assert str(path) in str(err.value) and words in str(err.value) and err.value.hint


def test_default_layer_ids_and_top_level_ids(target, tmp_path):
    assert default_aux_layer_ids(32) == (1, 15, 28) and default_aux_layer_ids(4) == (0, 1)
    head = Eagle3Head.load(make_eagle3_head(tmp_path / "h", 64, 512, (2, 0, 1), top_level_ids=True), target)
    assert head.aux_layer_ids == (0, 1, 2)


# ---------------------------------------------------------------- the bundled model


@pytest.mark.slow
def test_bundled_smollm2_with_a_random_head_stays_bit_exact(tmp_path):
    from specdeploy.core.model_store import resolve

    target = _engine(resolve("smollm2-135m-instruct"), tmp_path, "bfloat16", max_draft_len=4)
    s = target.spec
    d2t = torch.arange(4096) * 11  # draft id i -> target id 12 i (< 49152)
    head = Eagle3Head.load(
        make_eagle3_head(
            tmp_path / "head",
            s.hidden_size,
            s.vocab_size,
            default_aux_layer_ids(s.num_layers),
            num_heads=s.num_heads,
            num_kv_heads=s.num_kv_heads,
            intermediate_size=1536,
            draft_vocab_size=4096,
            d2t=d2t,
        ),
        target,
    )
    plain, fused = Executor(target), Executor(target, head=head)
    for seed in (0, 1):
        prompt = prompt_of(seed, 12)
        expected = run(plain, EngineRequest(prompt, 24)).token_ids
        got = run(fused, EngineRequest(prompt, 24, num_draft_tokens=3))
        assert got.token_ids == expected and got.stats.drafted > 0


@pytest.mark.slow
@pytest.mark.parametrize("weights, vocab", [("bf16", 0), ("int8", 0), ("int8", 4096)])
def test_the_shipped_head_on_smollm2_is_bit_exact_and_accepted(tmp_path, weights, vocab):
    """The head specdeploy ships for SmolLM2 (the default recipe's draft) on the bundled target, on chat-formatted
    prompts of the built-in validation set (never trained on): the fused output equals the target alone, and the
    head's drafts are accepted (a trained head, unlike a random one), its linears as exported or in int8 (the
    default recipe's draft.head_weights), over all its draft tokens or the 4,096 its counts keep (the default
    recipe's draft.serve_vocab_size)."""
    from transformers import AutoTokenizer

    from specdeploy.client.prompts import load_prompt_set
    from specdeploy.core.artifacts import BUNDLED_HEADS
    from specdeploy.core.model_store import resolve

    model_dir = resolve("smollm2-135m-instruct")
    target = _engine(model_dir, tmp_path, "bfloat16", max_draft_len=4)
    head = Eagle3Head.load(BUNDLED_HEADS / "smollm2-135m-instruct-eagle3", target, weights, vocab)
    assert head.served_vocab_size == (vocab or 8192)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    plain, fused = Executor(target), Executor(target, head=head)
    drafted = accepted = 0
    for prompt in load_prompt_set("builtin", 48)[:3]:
        messages = [{"role": role, "content": content} for role, content in prompt.messages] or [
            {"role": "user", "content": prompt.text}
        ]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        expected = run(plain, EngineRequest(ids, 48)).token_ids
        got = run(fused, EngineRequest(ids, 48, num_draft_tokens=3))
        assert got.token_ids == expected
        drafted, accepted = drafted + got.stats.drafted, accepted + got.stats.accepted
    assert drafted > 0 and accepted / drafted > 0.1, (accepted, drafted)


# ---------------------------------------------------------------- specdeploy generate (Session)


def test_generate_session_runs_the_fused_loop(target, head_dir, tmp_path):
    from types import SimpleNamespace

    from specdeploy.core.artifacts import Layout
    from specdeploy.engine import generate as gen
    from specdeploy.speculation.loop import collect

    session = gen.Session(
        SimpleNamespace(eos_token_id=None), Executor(target, head=Eagle3Head.load(head_dir, target)), eagle3=True
    )
    prompt = prompt_of(7, 9)
    tokens, stats = collect(session.stream(prompt, 16, num_draft_tokens=3))
    assert tokens == run(Executor(target), EngineRequest(prompt, 16)).token_ids
    assert stats.policy == "eagle3-fused" and stats.drafted == sum(stats.k_per_round) > 0
    assert stats.target_iterations == 1 + len(stats.k_per_round)
    recipe = SimpleNamespace(draft=SimpleNamespace(head="trained"))
    with pytest.raises(Exception) as err:
        gen.load_eagle3_head(recipe, Layout(tmp_path, "none"), target, "r.yaml")  # no head trained there
    assert "specdeploy draft train r.yaml" in str(err.value)
