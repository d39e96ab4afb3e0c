"""N-gram (prompt-lookup) drafting: proposals against hand-checked sequences, one test per flag,
and greedy parity of the loop with an n-gram draft."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import tritonclient.grpc as tritonclient_grpc
from standin_engines import TableEngine
from tiny_models import SERVER_READY_TIMEOUT_S

from specdeploy.engine.executor import Executor
from specdeploy.engine.generate import ExecutorVerifier, target_only_generate
from specdeploy.speculation import loop as spec
from specdeploy.speculation import ngram, sharing
from specdeploy.speculation import policy as pol
from specdeploy.speculation.ngram import NGramDrafts, NGramPool, NGramProposer, NGramSettings, SuffixLookup


def test_longest_pattern_wins_and_match_follows_it():
    # ... 1 2 3 4 5 ... 9 2 3 7 8 ... and the sequence ends with "1 2 3" (n = 3 matches the first place).
    s = NGramSettings(max_draft_len=3, max_matching_ngram_size=3)
    seq = [1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8, 0, 1, 2, 3]
    assert NGramProposer(s).draft(seq, 3) == [4, 5, 6]
    # Ends with "0 2 3": no 3-gram; the 2-gram "2 3" was seen twice -> the oldest match by default.
    seq2 = [1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8, 0, 2, 3]
    assert NGramProposer(s).draft(seq2, 3) == [4, 5, 6]
    # max_matching_ngram_size 1: only the last token is a pattern ("3" first followed by 4 5 6).
    assert NGramProposer(NGramSettings(3, 1)).draft(seq, 3) == [4, 5, 6]
    # k caps the proposal; no pattern -> nothing.
    assert NGramProposer(s).draft(seq, 2) == [4, 5]
    assert NGramProposer(s).draft([1, 2, 3, 4], 3) == []


def test_min_matching_ngram_size_keeps_short_patterns_from_proposing():
    # The last token "3" was followed by 4 5 earlier, but the 2-gram "0 3" never occurred.
    seq = [1, 2, 3, 4, 5, 6, 0, 3]
    assert NGramProposer(NGramSettings(2, 3)).draft(seq, 2) == [4, 5]  # TensorRT-LLM's behaviour: any size
    assert NGramProposer(NGramSettings(2, 3, min_matching_ngram_size=2)).draft(seq, 2) == []
    # A 2-gram that did occur still proposes under the minimum.
    assert NGramProposer(NGramSettings(2, 3, min_matching_ngram_size=2)).draft(seq + [4], 2) == [5, 6]
    with pytest.raises(AssertionError):
        NGramSettings(2, 2, min_matching_ngram_size=3)


def test_match_is_cut_at_the_end_and_grows_with_the_sequence():
    s = NGramSettings(max_draft_len=4, max_matching_ngram_size=2)
    p = NGramProposer(s)
    # "5 6" seen once, followed only by 7 (then the end): match (7, 5, 6)? no: it is followed by 7 5 6
    seq = [5, 6, 7, 5, 6]
    assert p.draft(seq, 4) == [7, 5, 6]  # the match stops where the sequence ends
    seq += [7, 5, 6]  # the tail is rescanned: the match of "5 6" grows to 4 tokens
    assert p.draft(seq, 4) == [7, 5, 6, 7]


def test_is_use_oldest_picks_first_or_last_match():
    seq = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2]
    assert NGramProposer(NGramSettings(2, 2, is_use_oldest=True)).draft(seq, 2) == [10, 11]
    assert NGramProposer(NGramSettings(2, 2, is_use_oldest=False)).draft(seq, 2) == [20, 21]


def test_is_keep_all_keeps_one_match_unless_a_longer_one_comes():
    s_all, s_one = NGramSettings(2, 1, is_keep_all=True), NGramSettings(2, 1, is_keep_all=False)
    pool_all, pool_one = NGramPool(s_all), NGramPool(s_one)
    seq = [1, 10, 11, 1, 20, 21, 1]
    pool_all.add(seq, 0)
    pool_one.add(seq, 0)
    assert pool_all.matches[(1,)] == [(10, 11), (20, 21)]
    assert pool_one.matches[(1,)] == [(10, 11)]  # the second match is not longer: the first stays
    # with keep_all false and newest wanted, the one kept match is still the first
    assert NGramProposer(NGramSettings(2, 1, is_keep_all=False, is_use_oldest=False)).draft(seq, 2) == [10, 11]
    assert NGramProposer(NGramSettings(2, 1, is_keep_all=True, is_use_oldest=False)).draft(seq, 2) == [20, 21]
    # A longer match replaces a shorter one in both modes (the shorter was cut by the sequence's end).
    pool = NGramPool(s_one)
    pool.add([4, 9], 0)
    assert pool.matches[(4,)] == [(9,)]
    pool.add([4, 9, 8], 0)
    assert pool.matches[(4,)] == [(9, 8)]


def test_suffix_lookup_proposes_what_followed_the_first_occurrence_of_the_longest_match():
    """SuffixLookup (draft.sa_config, TensorRT-LLM's suffix automaton rule): the longest earlier occurrence of the
    sequence's suffix wins over a more recent shorter one; among equally long ones the first; below the threshold
    nothing; a draft stops at the end of the sequence; built at once or token by token, the same."""
    seq = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 1, 2, 3]
    lookup = SuffixLookup(2, seq)
    assert lookup.draft(3) == [4, 5, 9]  # [1, 2, 3] at 0..2 (3 tokens) beats [2, 3] at 6..7
    assert lookup.draft(0) == [] and lookup.draft(1) == [4]
    assert SuffixLookup(4, seq).draft(3) == []  # the longest match is 3 tokens
    lookup.extend([4])
    assert lookup.draft(4) == [5, 9, 2, 3]  # [1, 2, 3, 4] now
    first = SuffixLookup(2, [5, 6, 1, 5, 6, 2, 5, 6])
    assert first.draft(2) == [1, 5]  # [5, 6] twice before, 2 tokens each: the first occurrence
    assert SuffixLookup(2, [5, 6, 7, 5, 6]).draft(5) == [7, 5, 6]  # cut where the sequence ends
    assert SuffixLookup(1, [8, 9]).draft(2) == [] and SuffixLookup(1, [3]).draft(2) == []  # nothing occurred earlier
    stepwise = SuffixLookup(2)
    for token in seq + [4]:
        stepwise.extend([token])
    assert stepwise.draft(4) == lookup.draft(4)
    long = list(range(100)) * 2  # a 100-token match: followed back MAX_MATCH tokens, still proposed
    assert SuffixLookup(SuffixLookup.MAX_MATCH, long).draft(2) == [0, 1]


def test_is_public_pool_shares_patterns_between_requests():
    public = NGramDrafts(NGramSettings(2, 2, is_public_pool=True))
    private = NGramDrafts(NGramSettings(2, 2, is_public_pool=False))
    first = [7, 8, 30, 31, 5]
    for drafts in (public, private):
        assert drafts.draft(first, 2) == []
    other = [9, 9, 7, 8]  # a different request ending with "7 8", seen only in the first one
    assert public.draft(other, 2) == [30, 31]
    assert private.draft(other, 2) == []
    # The private pool is found again by prefix: the first request continues with its own pool.
    assert private.draft(first + [7, 8], 2) == [30, 31]


def test_settings_from_recipe_and_parameters_round_trip():
    from specdeploy.recipe.load import parse_recipe

    raw = {
        "name": "x",
        "target": {"model": "m"},
        "draft": {"kind": "ngram", "max_matching_ngram_size": 3, "is_public_pool": False},
        "speculative": {"max_draft_len": 6, "num_draft_tokens": 5},
    }
    settings = ngram.settings_from_recipe(parse_recipe(raw))
    assert settings == NGramSettings(
        max_draft_len=5, max_matching_ngram_size=3, is_keep_all=True, is_use_oldest=True, is_public_pool=False
    )
    assert ngram.from_parameters(ngram.to_parameters(settings)) == settings
    raw["draft"]["min_matching_ngram_size"] = 2
    settings = ngram.settings_from_recipe(parse_recipe(raw))
    assert settings.min_matching_ngram_size == 2 and ngram.from_parameters(ngram.to_parameters(settings)) == settings
    # parameters written before the field existed read as TensorRT-LLM's behaviour
    old = {k: v for k, v in ngram.to_parameters(settings).items() if k != "min_matching_ngram_size"}
    assert ngram.from_parameters(old).min_matching_ngram_size == 1


@pytest.mark.parametrize(
    "draft,backend,words",
    [
        (
            {"kind": "ngram", "max_matching_ngram_size": 2, "min_matching_ngram_size": 3},
            "cpu",
            "larger than draft.max_matching_ngram_size",
        ),
        ({"kind": "ngram", "min_matching_ngram_size": 0}, "cpu", "min_matching_ngram_size"),
        ({"kind": "ngram", "min_matching_ngram_size": 2}, "trtllm-llmapi", "no minimum pattern size"),
        ({"model": "d", "min_matching_ngram_size": 2}, "cpu", "applies to draft.kind ngram only"),
    ],
)
def test_min_matching_ngram_size_is_checked(draft, backend, words):
    from specdeploy.core.errors import ConfigError
    from specdeploy.recipe.load import parse_recipe

    raw = {
        "name": "x",
        "backend": backend,
        "target": {"model": "m", "quantization": {"qformat": "fp8"}},
        "draft": draft,
    }
    with pytest.raises(ConfigError, match=words):
        parse_recipe(raw)


def test_greedy_parity_with_ngram_draft_on_bigram_engines():
    # Greedy bigram outputs fall into cycles, so the n-gram draft gets matches and rejections both.
    target_engine = TableEngine.random(24, seed=31)
    totals = {}
    for seed in range(6):
        prompt = torch.randint(0, 24, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
        expected = spec.collect(target_only_generate(Executor(target_engine), prompt, 40))[0]
        for settings in (NGramSettings(4, 2), NGramSettings(3, 1, is_use_oldest=False, is_keep_all=False)):
            for name in ("fixed k", "cost policy"):
                policy = (
                    pol.SharedPolicy(pol.PolicySettings("cost", 4, probe_interval=2)).request()
                    if name == "cost policy"
                    else None
                )
                run = spec.speculative_generate(
                    NGramProposer(settings), ExecutorVerifier(Executor(target_engine, 2)), prompt, 40, 4, policy=policy
                )
                tokens, stats = spec.collect(run)
                assert tokens == expected
                total = totals.setdefault((settings, name), [0, 0])
                total[0] += stats.drafted
                total[1] += stats.accepted
    for (settings, name), (drafted, accepted) in totals.items():
        assert drafted > 0 and accepted > 0, (settings, name)  # proposals were made, and some were right


def test_llmapi_options_write_decoding_type_ngram_for_every_version():
    import dataclasses
    from pathlib import Path

    from specdeploy.gpu import llmapi_options, llmapi_versions
    from specdeploy.recipe.load import parse_recipe

    raw = {
        "name": "x",
        "backend": "trtllm-llmapi",
        "target": {"model": "m", "quantization": {"qformat": "fp8"}},
        "draft": {"kind": "ngram", "max_draft_len": 3, "is_use_oldest": False},
        "speculative": {"num_draft_tokens": 4},
    }
    recipe = parse_recipe(raw)
    expected = {
        "decoding_type": "NGram",
        "max_draft_len": 3,
        "max_matching_ngram_size": 2,
        "is_keep_all": True,
        "is_use_oldest": False,
        "is_public_pool": True,
    }
    for name, version in llmapi_versions.LLMAPI_VERSIONS.items():
        assert llmapi_options.speculative_options(recipe, version, Path("/unused"), "ngram") == expected, name
    layout = dataclasses.make_dataclass("L", [])()
    layout.checkpoint = lambda role: Path("/ckpt") / role
    assert (
        llmapi_options.llmapi_options(recipe, layout, llmapi_versions.LLMAPI_VERSIONS["1.4"])["speculative_config"]
        == expected
    )


# ---------------------------------------------------------------- served: real tritonserver, real CPU engine


@pytest.mark.server
@pytest.mark.parametrize("policy", ["static", "cost"])
def test_served_ngram_draft_keeps_greedy_parity(tmp_path_factory, tiny_llama_dir, policy):
    """A tiny random target through the real quantize + build (only the target: the n-gram draft has
    nothing to build), its repository with ngram_draft.py as tensorrt_llm_draft, in tritonserver: the
    speculative path's greedy text equals the ensemble's, and the draft both hits and misses."""
    from specdeploy.client.protocol import GenerateRequest
    from specdeploy.client.triton_adapter import TritonEndpoint
    from specdeploy.core.artifacts import Layout
    from specdeploy.deploy import backend_stages
    from specdeploy.deploy.cpu_build import build_recipe
    from specdeploy.quantize.stage import quantize_recipe
    from specdeploy.recipe.load import parse_recipe
    from specdeploy.triton import model_config, ports, tensors
    from specdeploy.triton import server as server_mod

    root = tmp_path_factory.mktemp(f"ngram-served-{policy}")
    raw = {
        "name": f"ngramtest-{policy}",
        "backend": "cpu",
        "target": {
            "model": str(tiny_llama_dir),
            "quantization": {"qformat": "full_prec", "calib_size": 4, "calib_max_seq_length": 32},
        },
        "draft": {"kind": "ngram", "max_matching_ngram_size": 2, "is_public_pool": False},
        "speculative": {"max_draft_len": 4, "num_draft_tokens": 4, "policy": policy, "probe_interval": 2},
        "engine": {"dtype": "bfloat16", "max_batch_size": 2, "max_input_len": 256, "max_seq_len": 384},
        "validation": {"max_tokens": 48, "min_compared_tokens": 8, "chat_template": "none"},
    }
    recipe = parse_recipe(raw)
    layout = Layout.of(recipe, root)
    quantize_recipe(recipe, layout, echo=lambda *_: None, progress=False)
    build_recipe(recipe, layout, echo=lambda *_: None)
    assert not (layout.engine("draft") / "config.json").exists()  # nothing built for the draft
    backend_stages.of(recipe).write_repository(recipe, layout)
    draft_config = model_config.check_config((layout.repo / tensors.DRAFT_MODEL / "config.pbtxt").read_text())
    assert draft_config.parameters["max_matching_ngram_size"].string_value == "2"
    bls_config = model_config.check_config((layout.repo / tensors.BLS / "config.pbtxt").read_text())
    assert bls_config.parameters["speculation_policy"].string_value == policy
    assert bls_config.parameters["draft_kind"].string_value == "ngram"
    abandoned = Path(tempfile.gettempdir()) / f"{sharing.INSTANCES_PREFIX}gone-{policy}"  # a killed server's folder
    abandoned.mkdir(exist_ok=True)
    (abandoned / "999999999").write_text("1")
    os.utime(abandoned, (0, 0))
    server = server_mod.start(layout.repo, ports.Ports.pick(), layout.server_state / "tritonserver.log")
    drafted = accepted = 0
    try:
        server_mod.wait_ready(server, SERVER_READY_TIMEOUT_S)
        assert not abandoned.exists()  # swept by the BLS instances as they started
        endpoint = TritonEndpoint(server.state.grpc_url)
        prompts = [
            "one two three one two three one two",
            "def f(x): return x + 1\ndef g(x): return f(x)",
            "a b a b a b a b a",
        ]
        stats = tritonclient_grpc.InferenceServerClient(server.state.grpc_url)
        for prompt in prompts:
            control = endpoint.generate(tensors.ENSEMBLE, GenerateRequest(prompt, 48), 60)
            speculative = endpoint.generate(tensors.BLS, GenerateRequest(prompt, 48), 60)
            assert speculative.text == control.text and control.text
            drafted += speculative.perf.total_draft_tokens or 0
            accepted += speculative.perf.total_accepted_draft_tokens or 0
        # the BLS proposed by itself: not one call went to the tensorrt_llm_draft model
        assert _inference_count(stats, tensors.DRAFT_MODEL) == 0
        # num_draft_tokens 0 (speculation off for the request): one target call, the target's own text;
        # speculative_k_history only when asked for, one entry per round
        prompt = prompts[1]
        control = endpoint.generate(tensors.ENSEMBLE, GenerateRequest(prompt, 48), 60)
        target_calls = _inference_count(stats, tensors.TARGET_MODEL)
        result = _bls(stats, prompt, 48, num_draft_tokens=0, outputs=("text_output", "speculative_k_history"))
        assert _inference_count(stats, tensors.TARGET_MODEL) - target_calls == 1
        assert result.as_numpy("text_output").reshape(-1)[0].decode() == control.text
        assert result.as_numpy("speculative_k_history").reshape(-1).tolist() == [0]
        result = _bls(stats, prompt, 48, outputs=("text_output", "speculative_k_history", "total_draft_tokens"))
        history = result.as_numpy("speculative_k_history").reshape(-1).tolist()
        drafted_here = int(result.as_numpy("total_draft_tokens").reshape(-1)[0])
        assert sum(history) >= drafted_here and max(history) <= 4 and len(history) >= 1
        if policy == "static":  # the cost policy may, from its timings, run this request as plain steps
            assert drafted_here > 0
        assert _bls(stats, prompt, 48, outputs=("text_output",)).as_numpy("speculative_k_history") is None
        stats.close()
        endpoint.close()
        # The BLS instances (2 here) share one measured state, the server's: each of the 6 BLS requests above
        # added its rounds to it, whichever instance served it.
        (state_file,) = Path(tempfile.gettempdir()).glob(f"specdeploy-active-*/policy-{server.state.pid}.json")
        assert len([p for p in state_file.parent.iterdir() if p.name.isdigit()]) == 2
        assert json.loads(state_file.read_text())["version"] == 6
    finally:
        server.stop()
    assert not state_file.exists()  # gone with the server's last instance
    assert drafted > accepted > 0, (drafted, accepted)


def _inference_count(client, model: str) -> int:
    return sum(m.inference_count for m in client.get_inference_statistics(model).model_stats)


def _bls(client, prompt: str, max_tokens: int, outputs=("text_output",), **scalars):
    import numpy as np

    from specdeploy.triton import tensors

    inputs = [
        tritonclient_grpc.InferInput("text_input", [1, 1], "BYTES"),
        tritonclient_grpc.InferInput("max_tokens", [1, 1], "INT32"),
    ]
    inputs[0].set_data_from_numpy(np.array([[prompt.encode()]], dtype=object))
    inputs[1].set_data_from_numpy(np.array([[max_tokens]], dtype=np.int32))
    for name, value in {
        "exclude_input_in_output": True,
        **scalars,
    }.items():  # the text after the prompt, as the endpoint asks
        tensor = tritonclient_grpc.InferInput(name, [1, 1], "BOOL" if isinstance(value, bool) else "INT32")
        tensor.set_data_from_numpy(np.array([[value]], dtype=bool if isinstance(value, bool) else np.int32))
        inputs.append(tensor)
    requested = [tritonclient_grpc.InferRequestedOutput(name) for name in outputs]
    return client.infer(tensors.BLS, inputs, outputs=requested, client_timeout=60)


def test_the_recipes_ngram_keys_are_the_settings_fields():
    """One list: the recipe's draft keys (DraftConfig.NGRAM_KEYS) are NGramSettings' fields and the model's
    parameters, in one order."""
    from dataclasses import fields

    assert ngram.FIELDS == tuple(f.name for f in fields(NGramSettings))
    assert set(ngram.from_parameters(ngram.to_parameters(NGramSettings())).__dict__) == set(ngram.FIELDS)
