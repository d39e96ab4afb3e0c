"""draft.kind suffix (TensorRT-LLM's standalone suffix automaton, SADecodingConfig): proposals against hand-checked
sequences, the recipe's checks (transcribed from SADecodingConfig's validator), greedy parity of the loop with the
automaton as the only draft, and the same served by the real CPU engine in tritonserver."""

from __future__ import annotations

import pytest
import torch
from standin_engines import TableEngine
from tiny_models import SERVER_READY_TIMEOUT_S

from specdeploy.core.errors import ConfigError
from specdeploy.engine.executor import Executor
from specdeploy.engine.generate import ExecutorVerifier, target_only_generate
from specdeploy.recipe.load import parse_recipe
from specdeploy.speculation import loop as spec
from specdeploy.speculation import ngram
from specdeploy.speculation import policy as pol
from specdeploy.speculation.ngram import SuffixDrafts, SuffixProposer, SuffixSettings


def _recipe(draft: dict, backend: str = "cpu", **top):
    raw = {
        "name": "x",
        "backend": backend,
        "target": {"model": "m", "quantization": {"qformat": "fp8"}},
        "draft": {"kind": "suffix", **draft},
        "speculative": {"max_draft_len": 6, "num_draft_tokens": 4},
        **top,
    }
    return parse_recipe(raw)


def test_the_longest_earlier_match_of_any_length_drafts_what_followed_it():
    proposer = SuffixProposer(SuffixSettings(max_draft_len=3))
    seq = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 1, 2, 3]
    assert proposer.draft(seq, 4) == [4, 5, 9]  # [1, 2, 3] (3 tokens) beats [2, 3]; capped at max_draft_len 3
    assert proposer.draft(seq + [4], 2) == [5, 9]  # the same request, one token on: fed incrementally
    assert proposer.draft([7, 8, 7], 3) == [8, 7]  # a one-token match drafts (no threshold), cut at the end
    assert proposer.draft([7, 8], 3) == []  # nothing occurred earlier: no draft, no verification rows
    assert proposer.draft([7, 8, 7], 0) == []


def test_a_fixed_ngram_size_compares_at_most_that_many_tokens():
    # the suffix [5, 6, 1] occurred twice before (after 8 and after 2): the first of them drafts [2, 5]. Compared over
    # 1 token only, every earlier 1 ties and the first one (after 9) drafts [8, 5]
    seq = [9, 1, 8, 5, 6, 1, 2, 5, 6, 1, 3, 5, 6, 1]
    assert SuffixProposer(SuffixSettings(2, -1)).draft(seq, 2) == [2, 5]
    assert SuffixProposer(SuffixSettings(2, 1)).draft(seq, 2) == [8, 5]


def test_settings_from_recipe_and_parameters_round_trip():
    settings = ngram.suffix_settings_from_recipe(_recipe({}))
    assert settings == SuffixSettings(max_draft_len=4, max_matching_ngram_size=-1)  # num_draft_tokens, longest match
    settings = ngram.suffix_settings_from_recipe(_recipe({"max_draft_len": 3, "max_matching_ngram_size": 5}))
    assert settings == SuffixSettings(3, 5)
    params = settings.to_parameters()
    assert params["draft_kind"] == "suffix" and ngram.suffix_from_parameters(params) == settings
    assert isinstance(ngram.drafts_from_parameters(params), SuffixDrafts)
    assert isinstance(ngram.drafts_from_parameters(ngram.to_parameters(ngram.NGramSettings())), ngram.NGramDrafts)
    assert SuffixDrafts(settings).draft([1, 2, 3, 1, 2], 4) == [3, 1, 2]


@pytest.mark.parametrize(
    ("draft", "backend", "top", "words"),
    [
        ({"max_matching_ngram_size": 0}, "cpu", {}, "-1 .* or a size >= 1"),  # SADecodingConfig: 0 is invalid
        ({"max_matching_ngram_size": -2}, "cpu", {}, "-1 .* or a size >= 1"),
        ({"max_draft_len": 0}, "cpu", {}, "max_draft_len' is 0"),  # max_draft_len must be > 0 for SA
        ({"max_draft_len": 7}, "cpu", {}, "larger than speculative.max_draft_len"),
        (
            {"enable_global_pool": True, "max_matching_ngram_size": 65},
            "trtllm-llmapi",
            {},
            "global pool compares at most 64",
        ),
        ({"global_pool_size": 64}, "trtllm-llmapi", {}, "requires enable_global_pool"),
        ({"enable_global_pool": True, "global_pool_size": 0}, "trtllm-llmapi", {}, "global_pool_size' is 0"),
        (
            {"enable_global_pool": True, "global_pool_size": 4},
            "trtllm-llmapi",
            {"engine": {"max_batch_size": 8}},
            "smaller than engine.max_batch_size",
        ),
        ({"enable_global_pool": True}, "cpu", {}, "request's own tokens only"),
        ({"is_keep_all": False}, "cpu", {}, "applies to draft.kind ngram only"),
        ({"model": "d"}, "cpu", {}, "does not apply to draft.kind suffix"),
        ({}, "trtllm-engine", {}, "not wired for backend trtllm-engine"),
        ({}, "cpu", {"speculative": {"use_draft_logits": True}}, "suffix-automaton draft has no logits"),
    ],
)
def test_the_recipe_refuses_what_sadecodingconfig_refuses(draft, backend, top, words):
    with pytest.raises(ConfigError, match=words):
        _recipe(draft, backend, **top)


def test_suffix_only_keys_are_refused_on_other_kinds():
    raw = {"name": "x", "target": {"model": "m"}, "draft": {"kind": "ngram", "enable_global_pool": True}}
    with pytest.raises(ConfigError, match="'draft.enable_global_pool' applies to draft.kind suffix only"):
        parse_recipe(raw)
    raw["draft"] = {"model": "d", "global_pool_size": 64}
    with pytest.raises(ConfigError, match="'draft.global_pool_size' applies to draft.kind suffix only"):
        parse_recipe(raw)


def test_greedy_parity_with_the_suffix_automaton_on_bigram_engines():
    # Greedy bigram outputs fall into cycles, so the automaton finds matches, and rejections happen too.
    target_engine = TableEngine.random(24, seed=31)
    totals = {}
    for seed in range(6):
        prompt = torch.randint(0, 24, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
        expected = spec.collect(target_only_generate(Executor(target_engine), prompt, 40))[0]
        for settings in (SuffixSettings(4, -1), SuffixSettings(3, 2)):
            for name in ("fixed k", "cost policy"):
                policy = (
                    pol.SharedPolicy(pol.PolicySettings("cost", 4, probe_interval=2)).request()
                    if name == "cost policy"
                    else None
                )
                run = spec.speculative_generate(
                    SuffixProposer(settings), ExecutorVerifier(Executor(target_engine, 2)), prompt, 40, 4, policy=policy
                )
                tokens, stats = spec.collect(run)
                assert tokens == expected  # the target's own greedy tokens, whatever was drafted
                total = totals.setdefault((settings, name), [0, 0])
                total[0] += stats.drafted
                total[1] += stats.accepted
    for (settings, name), (drafted, accepted) in totals.items():
        assert drafted > accepted > 0, (settings, name)  # proposals were made, some right and some wrong


def test_a_session_drafts_with_the_automaton_and_no_draft_model(tmp_path):
    """generate's Session for a suffix recipe: no draft engine is loaded (none is built), the proposer is the
    automaton over each request's own text."""
    from specdeploy.engine.generate import Session

    recipe = _recipe({"max_draft_len": 3})
    assert recipe.model_roles == ("target",)
    assert not Session(tokenizer=None, target=Executor(TableEngine.random(8, seed=1))).can_speculate
    session = Session(
        tokenizer=None, target=Executor(TableEngine.random(8, seed=1)), suffix=ngram.suffix_settings_from_recipe(recipe)
    )
    assert session.can_speculate and isinstance(session.proposer(), SuffixProposer)


# ---------------------------------------------------------------- served: real tritonserver, real CPU engine


@pytest.mark.server
def test_served_suffix_draft_keeps_greedy_parity(tmp_path_factory, tiny_llama_dir):
    """A tiny random target through the real quantize + build (only the target: the automaton has nothing to
    build), its repository in tritonserver: the BLS's greedy text equals the ensemble's, the automaton drafts from
    the request's own text, and tensorrt_llm_draft (for clients that call it) drafts the same way."""
    import numpy as np
    import tritonclient.grpc as tritonclient_grpc

    from specdeploy.client.protocol import GenerateRequest
    from specdeploy.client.triton_adapter import TritonEndpoint
    from specdeploy.core.artifacts import Layout
    from specdeploy.deploy import backend_stages
    from specdeploy.deploy.cpu_build import build_recipe
    from specdeploy.quantize.stage import quantize_recipe
    from specdeploy.triton import model_config, ports, tensors
    from specdeploy.triton import server as server_mod

    root = tmp_path_factory.mktemp("suffix-served")
    recipe = parse_recipe(
        {
            "name": "suffixtest",
            "backend": "cpu",
            "target": {
                "model": str(tiny_llama_dir),
                "quantization": {"qformat": "full_prec", "calib_size": 4, "calib_max_seq_length": 32},
            },
            "draft": {"kind": "suffix", "max_draft_len": 3},
            "speculative": {"max_draft_len": 4, "num_draft_tokens": 4},
            "engine": {"dtype": "bfloat16", "max_batch_size": 2, "max_input_len": 256, "max_seq_len": 384},
            "validation": {"max_tokens": 48, "min_compared_tokens": 8, "chat_template": "none"},
        }
    )
    layout = Layout.of(recipe, root)
    quantize_recipe(recipe, layout, echo=lambda *_: None, progress=False)
    build_recipe(recipe, layout, echo=lambda *_: None)
    assert not (layout.engine("draft") / "config.json").exists()  # nothing built for the draft
    backend_stages.of(recipe).write_repository(recipe, layout)
    bls_config = model_config.check_config((layout.repo / tensors.BLS / "config.pbtxt").read_text())
    assert bls_config.parameters["draft_kind"].string_value == "suffix"
    assert bls_config.parameters["max_matching_ngram_size"].string_value == "-1"
    # the automaton's own cap beside the target's (the BLS's k is bounded by both)
    assert bls_config.parameters["draft_max_draft_len"].string_value == "3"
    assert bls_config.parameters["max_draft_len"].string_value == "4"
    draft_config = model_config.check_config((layout.repo / tensors.DRAFT_MODEL / "config.pbtxt").read_text())
    assert draft_config.parameters["draft_kind"].string_value == "suffix"
    server = server_mod.start(layout.repo, ports.Ports.pick(), layout.server_state / "tritonserver.log")
    drafted = accepted = 0
    try:
        server_mod.wait_ready(server, SERVER_READY_TIMEOUT_S)
        endpoint = TritonEndpoint(server.state.grpc_url)
        for prompt in ("one two three one two three one two", "a b a b a b a b a"):
            control = endpoint.generate(tensors.ENSEMBLE, GenerateRequest(prompt, 48), 60)
            speculative = endpoint.generate(tensors.BLS, GenerateRequest(prompt, 48), 60)
            assert speculative.text == control.text and control.text
            drafted += speculative.perf.total_draft_tokens or 0
            accepted += speculative.perf.total_accepted_draft_tokens or 0
        endpoint.close()
        client = tritonclient_grpc.InferenceServerClient(server.state.grpc_url)
        ids = [5, 6, 7, 8, 5, 6]
        inputs = [
            tritonclient_grpc.InferInput("input_ids", [1, len(ids)], "INT32"),
            tritonclient_grpc.InferInput("input_lengths", [1, 1], "INT32"),
            tritonclient_grpc.InferInput("request_output_len", [1, 1], "INT32"),
        ]
        inputs[0].set_data_from_numpy(np.array([ids], dtype=np.int32))
        inputs[1].set_data_from_numpy(np.array([[len(ids)]], dtype=np.int32))
        inputs[2].set_data_from_numpy(np.array([[3]], dtype=np.int32))
        out = client.infer(tensors.DRAFT_MODEL, inputs, client_timeout=60).as_numpy("output_ids").reshape(-1).tolist()
        assert out == ids + [7, 8, 5]  # what followed [5, 6]'s first occurrence
        client.close()
    finally:
        server.stop()
    assert drafted > accepted > 0, (drafted, accepted)


def test_the_replay_bench_counts_target_passes_by_hand():
    """bench/lookup_replay.py's rounds, counted by hand."""
    import bench_modules

    replay = bench_modules.load("lookup_replay").replay
    # prompt [1, 2, 3], answer [1, 2, 3, 9]: pass 1 drafts nothing (3 has no earlier occurrence) and adds 1; pass 2
    # drafts [2, 3] after 1 (k=2 cap), both accepted, plus the target's 9: 4 tokens in 2 passes, 2 drafted
    assert replay(SuffixProposer(SuffixSettings(2, -1)), [1, 2, 3], [1, 2, 3, 9], 2) == (2, 2)
    # a draft that is wrong from its first token: accepted 0, the pass adds the target's one token
    assert replay(SuffixProposer(SuffixSettings(2, -1)), [7, 8, 7], [5, 6], 2) == (2, 1)
