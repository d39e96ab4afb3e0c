"""draft.kind eagle3 in the Triton repository (backend cpu), on a REAL tritonserver.

A tiny 4-layer target (quantize -> build with specdeploy's own stages) and a random EAGLE-3 head in the exported
format: `specdeploy repo` writes no tensorrt_llm_draft, copies the head into tensorrt_llm's folder and records its
hash; tensorrt_llm drafts with the head inside (one BLS call per request). Greedy text and token ids of the
speculative paths equal the control's (ensemble / tensorrt_llm without num_draft_tokens) for k = 1..4, the
responses' draft counters are > 0 and agree with the metrics endpoint; a head that does not fit is refused.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))

from eagle3_heads import make_eagle3_head  # noqa: E402
from ops_deploy import CHAT_TEMPLATE, chat_text  # noqa: E402
from tiny_models import SERVER_READY_TIMEOUT_S, make_tiny_model, make_tokenizer  # noqa: E402

pytestmark = pytest.mark.server

AUX = (0, 1, 2)
MAX_TOKENS = 16
CHATS = [
    [{"role": "user", "content": "What is speculative decoding?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "def add(a, b):"}],
    [
        {"role": "user", "content": "Once upon a time"},
        {"role": "assistant", "content": "there was"},
        {"role": "user", "content": "go on"},
    ],
]


def _model(root: Path, **overrides) -> Path:
    from transformers import AutoTokenizer

    tok_dir, model_dir = root / "tokenizer", root / "model"
    make_tokenizer(tok_dir)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(tok_dir))
    make_tiny_model(model_dir, tok_dir, seed=0, num_hidden_layers=4, **overrides)
    return model_dir


def _deployment(root: Path, model_dir: Path, head: Path, **sections):
    """(recipe, layout, recipe_path) of a built tiny eagle3 deployment (the repository not written yet)."""
    from specdeploy.core.artifacts import Layout
    from specdeploy.deploy.cpu_build import build_recipe
    from specdeploy.quantize.stage import quantize_recipe
    from specdeploy.recipe.load import parse_recipe

    raw = {
        "name": "eagle3-triton",
        "target": {"model": str(model_dir)},
        "draft": {"kind": "eagle3", "head": str(head)},
        "speculative": {"max_draft_len": 4, "num_draft_tokens": 3},
        "engine": {"dtype": "float32", "max_batch_size": 4, "max_input_len": 256, "max_seq_len": 320},
        "validation": {"max_tokens": MAX_TOKENS, "request_timeout_s": 60.0},
        "triton": {"startup_timeout_s": SERVER_READY_TIMEOUT_S},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    recipe = parse_recipe(raw)
    root.mkdir(parents=True, exist_ok=True)
    recipe_path = root / "eagle3.yaml"
    recipe_path.write_text(yaml.safe_dump(raw))
    layout = Layout.of(recipe, root)
    quantize_recipe(recipe, layout, echo=lambda *a, **k: None, progress=False)
    build_recipe(recipe, layout, echo=lambda *a, **k: None)
    return recipe, layout, recipe_path


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3-triton")
    model_dir = _model(root / "hf")
    head = make_eagle3_head(root / "head", 64, 512, AUX, dtype="float32")
    # max_concurrency as the default recipe has it: up to 2 in flight a request drafts the k it asks for, also above
    # num_draft_tokens (test_greedy_parity_and_draft_counters_match_metrics asks for 4)
    recipe, layout, recipe_path = _deployment(
        root / "deploy", model_dir, head, speculative={"dynamic": {"max_concurrency": 2}}
    )
    return recipe, layout, recipe_path, head


@pytest.fixture(scope="module")
def served(built):
    import tritonclient.grpc as grpc

    from specdeploy.deploy import backend_stages
    from specdeploy.triton import ports, server

    recipe, layout, recipe_path, head = built
    repo, _ = backend_stages.of(recipe).write_repository(recipe, layout, recipe_path=str(recipe_path))
    srv = server.start(repo, ports.Ports.pick(), Path(layout.server_state) / "tritonserver.log", exit_timeout_s=3)
    try:
        server.wait_ready(srv, SERVER_READY_TIMEOUT_S)
        client = grpc.InferenceServerClient(srv.state.grpc_url)
        client.metrics_url = srv.state.metrics_url
        yield client
        client.close()
    finally:
        srv.stop()


def test_repository_has_no_draft_model_and_carries_the_head(built, served):
    from specdeploy.core.artifacts import Manifest
    from specdeploy.core.errors import StaleArtifactError
    from specdeploy.triton import layout_models, repository

    recipe, layout, recipe_path, head = built
    repo = Path(layout.repo)
    manifest = Manifest.read(repo)
    assert "tensorrt_llm_draft" not in manifest.settings["models"] and not (repo / "tensorrt_llm_draft").exists()
    copied = repo / "tensorrt_llm" / layout_models.EAGLE3_HEAD_SUBDIR
    assert (copied / "model.safetensors").read_bytes() == (head / "model.safetensors").read_bytes()
    assert manifest.inputs["eagle3_head"]
    config = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert 'key: "eagle3_head"' in config and '"num_draft_tokens"' in config
    assert 'key: "draft_kind"' in (repo / "tensorrt_llm_bls" / "config.pbtxt").read_text()
    repository.require_repository(recipe, layout, str(recipe_path))
    # a changed head makes the repository out of date
    changed = json.loads((head / "config.json").read_text())
    try:
        (head / "config.json").write_text(json.dumps({**changed, "rms_norm_eps": 1e-6}))
        with pytest.raises(StaleArtifactError, match="stale"):
            repository.require_repository(recipe, layout, str(recipe_path))
    finally:
        (head / "config.json").write_text(json.dumps(changed, indent=2))
    repository.require_repository(recipe, layout, str(recipe_path))
    # so does a draft key the repository carries as a model parameter
    from specdeploy.recipe.config import to_plain
    from specdeploy.recipe.load import parse_recipe

    raw = to_plain(recipe)
    for key, value in (("head_weights", "bf16"), ("sa_config", {"threshold": 3})):
        with pytest.raises(StaleArtifactError, match="stale"):
            repository.require_repository(
                parse_recipe({**raw, "draft": {**raw["draft"], key: value}}), layout, str(recipe_path)
            )


def _inputs(values: dict):
    import tritonclient.grpc as grpc

    kinds = {np.int32: "INT32", np.bool_: "BOOL", np.object_: "BYTES", np.float32: "FP32", np.uint64: "UINT64"}
    out = []
    for name, arr in values.items():
        tensor = grpc.InferInput(name, list(arr.shape), kinds[arr.dtype.type])
        tensor.set_data_from_numpy(arr)
        out.append(tensor)
    return out


def _bls(client, prompt, **extra):
    values = {
        "text_input": np.array([[prompt.encode()]], dtype=object),
        "max_tokens": np.array([[MAX_TOKENS]], dtype=np.int32),
        **{k: np.array([[v]], dtype=np.int32) for k, v in extra.items()},
    }
    return client.infer("tensorrt_llm_bls" if extra else "ensemble", _inputs(values), client_timeout=300)


def _llm(client, ids, max_tokens=MAX_TOKENS, **extra):
    values = {
        "input_ids": np.array([ids], dtype=np.int32),
        "input_lengths": np.array([[len(ids)]], dtype=np.int32),
        "request_output_len": np.array([[max_tokens]], dtype=np.int32),
        "exclude_input_in_output": np.array([[True]]),
        **{k: np.array([[v]], dtype=np.int32) for k, v in extra.items()},
    }
    r = client.infer("tensorrt_llm", _inputs(values), client_timeout=300)
    n = int(r.as_numpy("sequence_length").reshape(-1)[0])
    return r.as_numpy("output_ids").reshape(-1)[:n].tolist(), r


def _count(r, name) -> int:
    return int(r.as_numpy(name).reshape(-1)[0])


def _scrape_until(url, baseline, done):
    from specdeploy.core.metrics import reader

    deadline = time.monotonic() + 300
    while True:
        window = reader.scrape(url).minus(baseline)
        if done(window):
            return window
        assert time.monotonic() < deadline, "the metrics never showed the requests"
        time.sleep(0.01)


def test_greedy_parity_and_draft_counters_match_metrics(built, served):
    """The BLS with k = 1..4 and tensorrt_llm with num_draft_tokens = k give the control's text / token ids; the
    head drafted (counters > 0) and the metrics endpoint counts the same drafted / accepted tokens."""
    from transformers import AutoTokenizer

    from specdeploy.core.metrics import names, reader

    recipe, layout, _, _ = built
    tok = AutoTokenizer.from_pretrained(str(Path(layout.repo) / "preprocessing" / "tokenizer"))
    baseline = reader.scrape(served.metrics_url)
    drafted = accepted = requests = 0
    draft_s = target_s = 0.0
    for chat in CHATS:
        prompt = chat_text(chat)
        control = _bls(served, prompt).as_numpy("text_output").reshape(-1)[0].decode()
        ids = tok(prompt).input_ids
        control_ids, plain = _llm(served, ids)
        assert _count(plain, "total_draft_tokens") == 0  # the control never uses the head
        for k in (1, 2, 3, 4):
            r = _bls(served, prompt, num_draft_tokens=k)
            assert r.as_numpy("text_output").reshape(-1)[0].decode() == control, (prompt, k)
            d, a = _count(r, "total_draft_tokens"), _count(r, "total_accepted_draft_tokens")
            assert d > 0 and 0 <= a <= d, (prompt, k, d, a)
            assert float(r.as_numpy("acceptance_rate").reshape(-1)[0]) == pytest.approx(a / d, abs=1e-6)
            drafted, accepted, requests = drafted + d, accepted + a, requests + 1
            # the round profile's seconds beside the k history: the head worked before the passes that hold its drafts
            history = r.as_numpy("speculative_k_history").reshape(-1).tolist()
            head, passes = (
                r.as_numpy(n).reshape(-1).tolist() for n in ("speculative_draft_seconds", "speculative_target_seconds")
            )
            assert len(history) == len(head) == len(passes) >= 2 and history[0] == head[0] == 0 and sum(history) == d, (
                history,
                head,
            )
            assert max(history) == k, (
                k,
                history,
            )  # the k asked for, 4 too (above num_draft_tokens 3, max_concurrency 2)
            assert all(t > 0 for t in passes) and all(h > 0 for h, n in zip(head, history) if n), (
                history,
                head,
                passes,
            )
            draft_s, target_s = draft_s + sum(head), target_s + sum(passes)
            spec_ids, direct = _llm(served, ids, num_draft_tokens=k)
            assert spec_ids == control_ids, (prompt, k)
            rounds = direct.as_numpy("draft_tokens_per_round").reshape(-1).tolist()
            assert sum(rounds) == _count(direct, "total_draft_tokens") > 0 and max(rounds) <= k
    window = _scrape_until(
        served.metrics_url, baseline, lambda w: w.sum(names.REQUESTS.name, arm="speculative") >= requests
    )
    assert window.sum(names.DRAFT_TOKENS.name, arm="speculative") == drafted
    assert window.sum(names.ACCEPTED_TOKENS.name, arm="speculative") == accepted
    assert window.sum(names.REQUESTS.name, arm="speculative") == requests
    # the metrics' seconds are the model's own per pass (not the call split evenly), as the responses carry them
    assert window.sum(names.DRAFT_SECONDS.name, arm="speculative") == pytest.approx(draft_s, rel=1e-4)
    assert window.sum(names.TARGET_SECONDS.name, arm="speculative") == pytest.approx(target_s, rel=1e-4)
    # one round per target pass: the prefill (no draft) and each verification pass
    assert window.sum(names.DRAFTS.name, arm="speculative") > 0


def test_sampled_requests_draft_with_the_head_and_return_the_controls_draws(served):
    """A seeded sampled request (temperature, top-k / top-p) through the BLS with k drafts gives the text the control
    path draws with the same seed (token-match verification keeps the target's own draws) and the head drafted."""
    sampling = {
        "temperature": np.array([[0.8]], dtype=np.float32),
        "top_k": np.array([[20]], dtype=np.int32),
        "top_p": np.array([[0.95]], dtype=np.float32),
    }
    drafted = 0
    for i, chat in enumerate(CHATS):
        values = {
            "text_input": np.array([[chat_text(chat).encode()]], dtype=object),
            "max_tokens": np.array([[MAX_TOKENS]], dtype=np.int32),
            "seed": np.array([[100 + i]], dtype=np.uint64),
            **sampling,
        }
        control = (
            served.infer("ensemble", _inputs(values), client_timeout=300)
            .as_numpy("text_output")
            .reshape(-1)[0]
            .decode()
        )
        k = 1 + i % 4
        r = served.infer(
            "tensorrt_llm_bls",
            _inputs({**values, "num_draft_tokens": np.array([[k]], dtype=np.int32)}),
            client_timeout=300,
        )
        assert r.as_numpy("text_output").reshape(-1)[0].decode() == control, (chat, k)
        other = dict(values, seed=np.array([[200 + i]], dtype=np.uint64))
        assert (
            served.infer("ensemble", _inputs(other), client_timeout=300).as_numpy("text_output").reshape(-1)[0].decode()
            != control
        )
        drafted += _count(r, "total_draft_tokens")
    assert drafted > 0


def test_num_draft_tokens_zero_is_plain_and_counted_as_such(built, served):
    from specdeploy.core.metrics import names, reader

    baseline = reader.scrape(served.metrics_url)
    prompt = chat_text(CHATS[0])
    r = _bls(served, prompt, num_draft_tokens=0)
    assert (
        r.as_numpy("text_output").reshape(-1)[0].decode()
        == _bls(served, prompt).as_numpy("text_output").reshape(-1)[0].decode()
    )
    assert _count(r, "total_draft_tokens") == 0
    window = _scrape_until(served.metrics_url, baseline, lambda w: w.sum(names.REQUESTS.name, arm="speculative") >= 1)
    assert window.sum(names.DRAFT_TOKENS.name) == 0
    assert window.sum(names.ROUNDS.name, reason=names.REASON_NO_DRAFT) == 1


def test_a_head_of_another_hidden_size_is_refused_at_repo(built, tmp_path):
    from specdeploy.core.errors import ModelError
    from specdeploy.deploy import backend_stages
    from specdeploy.recipe.config import to_plain
    from specdeploy.recipe.load import parse_recipe

    recipe, layout, recipe_path, _ = built
    wrong = make_eagle3_head(tmp_path / "wrong", 32, 512, AUX, dtype="float32")
    raw = to_plain(recipe)
    raw["draft"]["head"] = str(wrong)
    other = parse_recipe(raw)
    moved = layout.__class__.of(other, tmp_path / "deploy")
    shutil.copytree(layout.engines, moved.engines)
    with pytest.raises(ModelError, match=r"hidden_size 32 differs from the target's 64") as info:
        backend_stages.of(other).write_repository(other, moved, recipe_path=str(recipe_path))
    assert str(wrong) in info.value.message
    assert not Path(moved.repo).exists()


def test_config_takes_the_cost_policy_and_the_llmapi_layout_for_eagle3_on_cpu(built):
    from specdeploy.recipe.config import to_plain
    from specdeploy.recipe.load import parse_recipe

    raw = to_plain(built[0])
    assert (
        parse_recipe({**raw, "speculative": {**raw["speculative"], "policy": "cost"}}).speculative.policy == "cost"
    )  # served: below
    assert (
        parse_recipe({**raw, "triton": {**raw["triton"], "layout": "llmapi"}}).layout == "llmapi"
    )  # served: test below


def test_config_head_weights_resolve_for_the_cpu_and_are_refused_where_they_cannot_apply(built):
    from specdeploy.core.errors import ConfigError
    from specdeploy.recipe.config import to_plain
    from specdeploy.recipe.load import parse_recipe

    raw = to_plain(built[0])
    draft = lambda **kw: {**raw["draft"], **kw}  # noqa: E731
    assert parse_recipe(raw).draft.head_weights == "auto" and parse_recipe(raw).draft.cpu_head_weights == "int8"
    assert parse_recipe({**raw, "draft": draft(head_weights="bf16")}).draft.cpu_head_weights == "bf16"
    with pytest.raises(ConfigError, match="draft.head_weights") as err:
        parse_recipe({**raw, "draft": draft(head_weights="int4")})
    assert "int8" in err.value.hint
    with pytest.raises(ConfigError, match="only the CPU engine quantizes the head") as err:
        parse_recipe({**raw, "backend": "trtllm-llmapi", "draft": draft(head_weights="int8")})
    assert "set it to bf16" in err.value.hint
    assert (
        parse_recipe(
            {**raw, "backend": "trtllm-llmapi", "speculative": {**raw["speculative"], "draft_p_min": 0.0}}
        ).draft.head_weights
        == "auto"
    )
    with pytest.raises(ConfigError, match="draft.head_weights' applies to draft.kind eagle3 only"):
        parse_recipe({**raw, "draft": {"kind": "ngram", "head_weights": "bf16"}})


def test_config_serve_vocab_size_is_the_cpu_engines_and_is_refused_where_it_cannot_apply(built):
    from specdeploy.core.errors import ConfigError
    from specdeploy.recipe.config import to_plain
    from specdeploy.recipe.load import parse_recipe

    raw = to_plain(built[0])
    draft = lambda **kw: {**raw["draft"], **kw}  # noqa: E731
    assert parse_recipe(raw).draft.serve_vocab_size == 0
    assert parse_recipe({**raw, "draft": draft(serve_vocab_size=4096)}).draft.serve_vocab_size == 4096
    with pytest.raises(ConfigError, match="draft.serve_vocab_size' is -1, must be >= 0"):
        parse_recipe({**raw, "draft": draft(serve_vocab_size=-1)})
    gpu = {**raw, "backend": "trtllm-llmapi", "speculative": {**raw["speculative"], "draft_p_min": 0.0}}
    with pytest.raises(ConfigError, match="only the CPU engine cuts the head's draft vocabulary") as err:
        parse_recipe({**gpu, "draft": draft(serve_vocab_size=4096)})
    assert "remove draft.serve_vocab_size" in err.value.hint
    with pytest.raises(ConfigError, match="draft.serve_vocab_size' applies to draft.kind eagle3 only"):
        parse_recipe({**raw, "draft": {"kind": "ngram", "serve_vocab_size": 4096}})


@pytest.mark.parametrize("layout", ["inflight_batcher_llm", "llmapi"])
def test_served_vocabulary_reaches_the_head_in_either_layout(built, tmp_path, layout):
    """draft.serve_vocab_size travels to the served head with its counts: `specdeploy repo` copies
    draft_vocab_counts.json beside the head (its hash in the repository's) and passes the size as a model parameter,
    and refuses a head without counts naming the command that writes them. Cut to one draft token at a draft_p_min of
    0.99 (which the whole random head seldom reaches: test_served_draft_cut_reaches_the_head_inside_tensorrt_llm), the
    served model drafts in nearly every round, so the cut runs inside tritonserver; the answers are the control's."""
    import tritonclient.grpc as grpc

    from specdeploy.core.errors import BuildError
    from specdeploy.deploy import backend_stages
    from specdeploy.triton import ports, server

    recipe, _, _, head = built
    counted = tmp_path / "head"
    shutil.copytree(head, counted)
    sections = dict(
        draft={"serve_vocab_size": 1},
        speculative={"draft_p_min": 0.99},
        **({"triton": {"layout": "llmapi"}} if layout == "llmapi" else {}),
    )
    recipe, layout_, recipe_path = _deployment(tmp_path / "deploy", Path(recipe.target.model), counted, **sections)
    with pytest.raises(BuildError, match="has no draft_vocab_counts.json") as err:
        backend_stages.of(recipe).write_repository(recipe, layout_, recipe_path=str(recipe_path))
    assert "specdeploy draft vocab-counts" in err.value.hint
    (counted / "draft_vocab_counts.json").write_text(json.dumps({"counts": [0] * 300 + [9] + [0] * 211}))
    repo, _ = backend_stages.of(recipe).write_repository(recipe, layout_, recipe_path=str(recipe_path))
    staged = Path(repo) / "tensorrt_llm" / "eagle3_head"
    assert (staged / "draft_vocab_counts.json").read_bytes() == (counted / "draft_vocab_counts.json").read_bytes()
    from specdeploy.core.errors import StaleArtifactError
    from specdeploy.recipe.config import to_plain
    from specdeploy.recipe.load import parse_recipe
    from specdeploy.triton import repository

    repository.require_repository(recipe, layout_, str(recipe_path))
    raw = to_plain(recipe)
    with pytest.raises(StaleArtifactError, match="stale"):  # another size, the same counts: the parameter is stale
        repository.require_repository(
            parse_recipe({**raw, "draft": {**raw["draft"], "serve_vocab_size": 2}}), layout_, str(recipe_path)
        )
    assert re.search(
        r'key: "eagle3_serve_vocab_size"\s*value: \{\s*string_value: "1"',
        (Path(repo) / "tensorrt_llm" / "config.pbtxt").read_text(),
    )
    srv = server.start(repo, ports.Ports.pick(), Path(layout_.server_state) / "tritonserver.log", exit_timeout_s=3)
    try:
        server.wait_ready(srv, SERVER_READY_TIMEOUT_S)
        client = grpc.InferenceServerClient(srv.state.grpc_url)
        for chat in CHATS[:2]:
            prompt = chat_text(chat)
            if layout == "llmapi":
                control, out = (
                    _llmapi_infer(client, model, prompt) for model in ("tensorrt_llm_control", "tensorrt_llm")
                )
                assert (
                    out["text_output"][0].decode() == control["text_output"][0].decode() and control["text_output"][0]
                ), prompt
                rounds = int(out["total_draft_tokens"][0]) / 3  # at least, when each round drafts 3
            else:
                control = _bls(client, prompt).as_numpy("text_output").reshape(-1)[0].decode()
                r = _bls(client, prompt, num_draft_tokens=3)
                assert r.as_numpy("text_output").reshape(-1)[0].decode() == control, prompt
                rounds = _count(r, "total_draft_tokens") / 3
            assert rounds >= MAX_TOKENS / 4 - 1, (prompt, rounds)  # >= 4 rounds (3 drafts + 1 token a round at most)
        client.close()
    finally:
        srv.stop()


def test_config_bounds_draft_p_min_to_the_head_on_cpu(built):
    from specdeploy.core.errors import ConfigError
    from specdeploy.recipe.config import to_plain
    from specdeploy.recipe.load import parse_recipe

    raw = to_plain(built[0])
    speculative = lambda p: {**raw["speculative"], "draft_p_min": p}  # noqa: E731
    assert parse_recipe({**raw, "speculative": speculative(0.2)}).speculative.draft_p_min == 0.2
    for bad in (-0.1, 1.0):
        with pytest.raises(ConfigError, match=r"speculative.draft_p_min.*must be in \[0, 1\)"):
            parse_recipe({**raw, "speculative": speculative(bad)})
    with pytest.raises(ConfigError, match="draft.kind is ngram") as err:
        parse_recipe({**raw, "draft": {"kind": "ngram"}, "speculative": speculative(0.2)})
    assert "use draft.kind eagle3" in err.value.hint
    with pytest.raises(ConfigError, match="no confidence cut-off") as err:
        parse_recipe({**raw, "backend": "trtllm-llmapi", "speculative": speculative(0.2)})
    assert "speculative.draft_p_min: 0 on this backend, or use backend cpu" in err.value.hint


@pytest.mark.parametrize("cut", ["draft_p_min", "cost", "sa_config"])
def test_served_draft_cut_reaches_the_head_inside_tensorrt_llm(built, tmp_path, cut):
    """speculative.draft_p_min and policy cost travel to the served tensorrt_llm model (its config parameters): at a
    p_min of 0.99, which this random head never reaches, the speculative entry point drafts nothing, and the metrics
    say why each verification pass was plain (draft_p_min, not last_token: at most one per request); under the cost
    policy the random head's rounds (one token each, for the head's work and a pass of k + 1 rows) cost more than
    plain ones, so the engine goes plain, counted under reason policy (the deployment with neither drafts k = 3
    every round, test_greedy_parity_and_draft_counters_match_metrics). sa_config: the same p_min of 0.99 with
    draft.sa_config (threshold 1): the head still drafts nothing, so every draft counted is the suffix lookup's,
    run inside the served model. Each answers as the control does."""
    import tritonclient.grpc as grpc

    from specdeploy.core.metrics import names, reader
    from specdeploy.deploy import backend_stages
    from specdeploy.triton import ports, server

    recipe, layout, _, head = built
    model_dir = Path(recipe.target.model)
    speculative = {"policy": "cost"} if cut == "cost" else {"draft_p_min": 0.99}
    draft = {"sa_config": {"threshold": 1}} if cut == "sa_config" else {}
    recipe, layout, recipe_path = _deployment(tmp_path / cut, model_dir, head, speculative=speculative, draft=draft)
    repo, _ = backend_stages.of(recipe).write_repository(recipe, layout, recipe_path=str(recipe_path))
    config = (Path(repo) / "tensorrt_llm" / "config.pbtxt").read_text()
    assert 'key: "eagle3_draft_p_min"' in config
    assert 'key: "eagle3_head_weights"' in config and 'string_value: "int8"' in config  # draft.head_weights auto
    assert 'key: "eagle3_policy"' in config and f'string_value: "{recipe.speculative.policy}"' in config
    assert re.search(
        r'key: "eagle3_sa_threshold"\s*value: \{\s*string_value: "%d"' % (1 if cut == "sa_config" else 0), config
    )
    reason = names.REASON_POLICY if cut == "cost" else names.REASON_DRAFT_P_MIN
    srv = server.start(repo, ports.Ports.pick(), Path(layout.server_state) / "tritonserver.log", exit_timeout_s=3)
    try:
        server.wait_ready(srv, SERVER_READY_TIMEOUT_S)
        client = grpc.InferenceServerClient(srv.state.grpc_url)
        baseline = reader.scrape(srv.state.metrics_url)
        drafted = 0
        for chat in CHATS[:2]:
            prompt = chat_text(chat)
            control = _bls(client, prompt).as_numpy("text_output").reshape(-1)[0].decode()
            r = _bls(client, prompt, num_draft_tokens=3)
            assert r.as_numpy("text_output").reshape(-1)[0].decode() == control
            drafted += _count(r, "total_draft_tokens")
        client.close()
        window = _scrape_until(
            srv.state.metrics_url, baseline, lambda w: w.sum(names.REQUESTS.name, arm="speculative") >= 2
        )
        off = {
            why: window.sum(names.ROUNDS.name, arm="speculative", reason=why)
            for why in (names.REASON_NO_PROPOSAL, reason, names.REASON_LAST_TOKEN)
        }
        assert off[names.REASON_NO_PROPOSAL] == 2  # each request's prefill pass
        assert off[names.REASON_LAST_TOKEN] <= 2, off
        assert window.sum(names.DRAFT_TOKENS.name, arm="speculative") == drafted
        assert off[reason] > 0
        if cut == "draft_p_min":
            assert drafted == 0 and sum(off.values()) == window.sum(names.TARGET_PASSES.name, arm="speculative")
        lookup = {
            m.name: window.sum(m.name, arm="speculative")
            for m in (names.LOOKUP_DRAFTS, names.LOOKUP_DRAFT_TOKENS, names.LOOKUP_ACCEPTED_TOKENS)
        }
        if cut == "sa_config":  # rounds the lookup drafted, the others cut by draft_p_min: no pass left uncounted
            drafting = window.sum(names.ROUNDS.name, arm="speculative", reason=names.REASON_NONE)
            assert drafted > 0 and drafting > 0
            assert sum(off.values()) + drafting == window.sum(names.TARGET_PASSES.name, arm="speculative")
            # the head drafts nothing past 0.99: every drafting round, draft and accepted draft is the lookup's
            assert lookup == {
                names.LOOKUP_DRAFTS.name: drafting,
                names.LOOKUP_DRAFT_TOKENS.name: drafted,
                names.LOOKUP_ACCEPTED_TOKENS.name: window.sum(names.ACCEPTED_TOKENS.name, arm="speculative"),
            }, lookup
        else:
            assert not any(lookup.values()), lookup
    finally:
        srv.stop()


def _llmapi_infer(client, model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    import tritonclient.grpc as grpcclient

    values = {
        "text_input": np.array([prompt.encode()], dtype=object),
        "sampling_param_max_tokens": np.array([max_tokens], dtype=np.int32),
        "sampling_param_exclude_input_from_output": np.array([True]),
        "sampling_param_return_perf_metrics": np.array([True]),
    }
    inputs = []
    for name, array in values.items():
        tensor = grpcclient.InferInput(
            name, list(array.shape), {"object": "BYTES", "int32": "INT32", "bool": "BOOL"}[array.dtype.name]
        )
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    result = client.infer(model, inputs, client_timeout=300)
    return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}


@pytest.mark.parametrize("policy", ["static", "cost", "lookup", "user_sa_config"])
def test_llmapi_layout_runs_the_head_inside_the_speculative_model(built, tmp_path, policy):
    """triton.layout llmapi on cpu: model.yaml's speculative_config names the head (decoding_type Eagle3, copied into
    the repository), tensorrt_llm drafts with it inside and answers as tensorrt_llm_control (the target alone) does,
    its acceptance outputs and the metrics endpoint count the same drafts, and each pass is a metrics round; under
    policy cost (the model's speculation_policy parameter) the engine goes plain once the random head's rounds are
    found to cost more per token than plain ones (reason policy); lookup: draft.sa_config (threshold 1) with a
    draft_p_min the random head never reaches, so the drafts counted are the suffix lookup's (its threshold a model
    parameter of the CPU engine, not in model.yaml); user_sa_config: the recipe without one (parameter 0) and the
    user's own `sa_config` (TensorRT-LLM's SAEnhancerConfig) added to model.yaml's speculative_config, which the
    engine then honours as lookup does."""
    import tritonclient.grpc as grpc

    from specdeploy.core.metrics import names, reader
    from specdeploy.deploy import backend_stages
    from specdeploy.gpu.llmapi_versions import llmapi_version
    from specdeploy.triton import ports, server

    _, _, _, head = built
    model_dir = Path(built[0].target.model)
    lookup = policy in ("lookup", "user_sa_config")
    speculative = {"draft_p_min": 0.99, "policy": "static"} if lookup else {"draft_p_min": 0.0, "policy": policy}
    draft = {"sa_config": {"threshold": 1}} if policy == "lookup" else {}
    recipe, layout, recipe_path = _deployment(
        tmp_path / "llmapi", model_dir, head, triton={"layout": "llmapi"}, speculative=speculative, draft=draft
    )
    repo, _ = backend_stages.of(recipe).write_repository(recipe, layout, recipe_path=str(recipe_path))
    options = yaml.safe_load((Path(repo) / "tensorrt_llm" / "1" / "model.yaml").read_text())
    spec = options["speculative_config"]
    version = llmapi_version(recipe.trtllm_version)  # the recipe's release names the decoding type and the head's key
    assert spec["decoding_type"] == version.decoding_types["eagle3"] and spec["max_draft_len"] == 3
    staged = Path(spec[version.draft_model_key])
    assert (
        staged == Path(repo) / "tensorrt_llm" / "eagle3_head"
        and (staged / "model.safetensors").read_bytes() == (head / "model.safetensors").read_bytes()
    )
    assert "speculative_config" not in yaml.safe_load(
        (Path(repo) / "tensorrt_llm_control" / "1" / "model.yaml").read_text()
    )
    assert "sa_config" not in spec
    config = (Path(repo) / "tensorrt_llm" / "config.pbtxt").read_text()
    assert re.search(
        r'key: "eagle3_sa_threshold"\s*value: \{\s*string_value: "%d"' % (1 if policy == "lookup" else 0), config
    )
    if policy == "user_sa_config":
        options["speculative_config"]["sa_config"] = {"threshold": 1}
        (Path(repo) / "tensorrt_llm" / "1" / "model.yaml").write_text(yaml.safe_dump(options))
    srv = server.start(repo, ports.Ports.pick(), Path(layout.server_state) / "tritonserver.log", exit_timeout_s=3)
    try:
        server.wait_ready(srv, SERVER_READY_TIMEOUT_S)
        client = grpc.InferenceServerClient(srv.state.grpc_url)
        baseline = reader.scrape(srv.state.metrics_url)
        drafted = accepted = 0
        for chat in CHATS:
            prompt = chat_text(chat)
            control = _llmapi_infer(client, "tensorrt_llm_control", prompt)
            out = _llmapi_infer(client, "tensorrt_llm", prompt)
            assert out["text_output"][0].decode() == control["text_output"][0].decode() and control["text_output"][0], (
                prompt
            )
            assert int(control["total_draft_tokens"][0]) == 0
            d, a = int(out["total_draft_tokens"][0]), int(out["total_accepted_draft_tokens"][0])
            assert (d > 0 or policy != "static") and 0 <= a <= d, (
                prompt,
                d,
                a,
            )  # cost: plain once drafting does not pay
            drafted, accepted = drafted + d, accepted + a
        client.close()
        window = _scrape_until(
            srv.state.metrics_url, baseline, lambda w: w.sum(names.REQUESTS.name, arm="speculative") >= len(CHATS)
        )
        assert window.sum(names.DRAFT_TOKENS.name, arm="speculative") == drafted
        assert window.sum(names.ACCEPTED_TOKENS.name, arm="speculative") == accepted
        assert drafted > 0
        # the lookup's share of the drafts (the random head still passes 0.99 now and then: 29 of 32 drafts here)
        looked, looked_accepted = (
            window.sum(m.name, arm="speculative") for m in (names.LOOKUP_DRAFT_TOKENS, names.LOOKUP_ACCEPTED_TOKENS)
        )
        assert (
            (0 < looked <= drafted and 0 < looked_accepted <= accepted) if lookup else looked == looked_accepted == 0
        ), (looked, drafted)
        # the random head's own drafts past 0.99 are never accepted here (3 drafted, 0 accepted with the user's
        # sa_config ignored); the lookup's are, where the random target repeats itself (32 / 21)
        assert accepted > 0 or not lookup, (drafted, accepted)
        plain_by_policy = window.sum(names.ROUNDS.name, arm="speculative", reason=names.REASON_POLICY)
        assert (plain_by_policy > 0) == (policy == "cost")  # cost: the random head's one-token rounds do not pay
        rounds = window.sum(names.ROUNDS.name, arm="speculative")
        assert (
            rounds
            == window.sum(names.TARGET_PASSES.name, arm="speculative")
            > window.sum(names.DRAFTS.name, arm="speculative")
            > 0
        )
        assert window.sum(names.ROUNDS.name, arm="speculative", reason=names.REASON_NO_PROPOSAL) == len(
            CHATS
        )  # the prefills
    finally:
        srv.stop()


def test_concurrent_fused_requests_in_a_bf16_server_draft_as_alone_and_answer_as_the_control(built, tmp_path):
    """A bf16 engine (native kernels, row-invariant: the in-flight batcher runs the fused requests' head forwards as
    one, engine/batching.py) in the real server: four fused requests of 200 tokens sent at once to tensorrt_llm each
    return the control's tokens, and draft, round by round, what the same request drafts alone in the server."""
    import threading

    import tritonclient.grpc as grpc
    from transformers import AutoTokenizer

    from specdeploy.deploy import backend_stages
    from specdeploy.triton import ports, server

    _, _, _, head = built
    recipe, layout, recipe_path = _deployment(
        tmp_path / "bf16",
        Path(built[0].target.model),
        head,
        engine={"dtype": "bfloat16"},
        speculative={"draft_p_min": 0.0},
    )
    repo, _ = backend_stages.of(recipe).write_repository(recipe, layout, recipe_path=str(recipe_path))
    tok = AutoTokenizer.from_pretrained(str(Path(repo) / "preprocessing" / "tokenizer"))
    prompts = [tok(chat_text(chat)).input_ids for chat in CHATS]
    n = 200  # long enough for the four requests to be in flight together
    srv = server.start(repo, ports.Ports.pick(), Path(layout.server_state) / "tritonserver.log", exit_timeout_s=3)
    clients = []
    try:
        server.wait_ready(srv, SERVER_READY_TIMEOUT_S)
        clients = [
            grpc.InferenceServerClient(srv.state.grpc_url) for _ in prompts
        ]  # one connection per request in flight
        control = [_llm(clients[0], ids, n)[0] for ids in prompts]

        def fused(i):
            tokens, r = _llm(clients[i], prompts[i], n, num_draft_tokens=3)
            return tokens, r.as_numpy("draft_tokens_per_round").reshape(-1).tolist()

        alone = [fused(i) for i in range(len(prompts))]
        together, start = [None] * len(prompts), threading.Barrier(len(prompts))

        def send(i):
            start.wait()
            together[i] = fused(i)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        for i in range(len(prompts)):
            assert len(control[i]) > 100 and alone[i][0] == control[i] and together[i][0] == control[i], i
            assert sum(alone[i][1]) > 0 and together[i][1] == alone[i][1], i  # the same drafts, round by round
    finally:
        for client in clients:
            client.close()
        srv.stop()


def test_a_decoupled_deployment_streams_the_fused_path_round_by_round(built, tmp_path):
    """triton.decoupled: a streamed BLS request of the fused path (stream=true, k = 3) arrives as one text response per
    round the head and target wrote, not as the whole answer at the end; the pieces join into the text of the same
    request unstreamed, which is the control's, and the final response carries the drafted counts and the round
    history. A streamed request of tensorrt_llm with num_draft_tokens streams its rounds as well."""
    from transformers import AutoTokenizer

    from specdeploy.client.protocol import GenerateRequest
    from specdeploy.client.triton_adapter import TritonEndpoint
    from specdeploy.deploy import backend_stages
    from specdeploy.triton import ports, server

    _, _, _, head = built
    recipe, layout, recipe_path = _deployment(
        tmp_path / "decoupled",
        Path(built[0].target.model),
        head,
        triton={"decoupled": True},
        speculative={"draft_p_min": 0.0},
    )
    repo, _ = backend_stages.of(recipe).write_repository(recipe, layout, recipe_path=str(recipe_path))
    tok = AutoTokenizer.from_pretrained(str(Path(repo) / "preprocessing" / "tokenizer"))
    srv = server.start(repo, ports.Ports.pick(), Path(layout.server_state) / "tritonserver.log", exit_timeout_s=3)
    endpoint = TritonEndpoint(srv.state.grpc_url)
    try:
        server.wait_ready(srv, SERVER_READY_TIMEOUT_S)
        streamed_rounds = 0
        for chat in CHATS:
            prompt = chat_text(chat)
            control = endpoint.generate("ensemble", GenerateRequest(prompt, MAX_TOKENS), 300).text
            whole = endpoint.generate("tensorrt_llm_bls", GenerateRequest(prompt, MAX_TOKENS, num_draft_tokens=3), 300)
            pieces = []
            streamed = endpoint.generate(
                "tensorrt_llm_bls",
                GenerateRequest(prompt, MAX_TOKENS, num_draft_tokens=3, stream=True),
                300,
                on_text=pieces.append,
            )
            assert whole.text == control and streamed.text == control and "".join(pieces) == control, prompt
            texts = [p for p in pieces if p]
            history = streamed.k_history
            assert streamed.perf.total_draft_tokens and sum(history) == streamed.perf.total_draft_tokens, (
                prompt,
                history,
            )
            # a text response per pass that completed text: more than one whenever the answer took more than one pass
            assert len(history) >= 2 and len(texts) >= 2, (prompt, pieces, history)
            assert len(texts) <= len(history), (prompt, pieces, history)
            streamed_rounds += len(texts)
        assert streamed_rounds > len(CHATS)
        # tensorrt_llm itself, streaming with the head: each response holds a round's tokens, together the control's
        ids = tok(chat_text(CHATS[0])).input_ids
        values = {
            "input_ids": np.array([ids], dtype=np.int32),
            "input_lengths": np.array([[len(ids)]], dtype=np.int32),
            "request_output_len": np.array([[MAX_TOKENS]], dtype=np.int32),
            "exclude_input_in_output": np.array([[True]]),
            "streaming": np.array([[True]]),
        }

        def run(extra):  # the responses of one request on the gRPC stream (tensorrt_llm is decoupled here)
            responses = endpoint._run("tensorrt_llm", {**values, **extra}, ["output_ids", "sequence_length"], 300)
            chunks = [
                r.as_numpy("output_ids").reshape(-1)[: int(r.as_numpy("sequence_length").reshape(-1)[0])].tolist()
                for r in responses
            ]
            return [c for c in chunks if c]

        plain = run({})
        fused = run({"num_draft_tokens": np.array([[3]], dtype=np.int32)})
        assert sum(plain, []) == sum(fused, []) and len(sum(plain, [])) > 0
        assert 2 <= len(fused) and any(len(c) > 1 for c in fused), fused  # rounds, some of more than one token
    finally:
        endpoint.close()
        srv.stop()


def test_a_cancelled_request_of_a_decoupled_deployment_stops_its_fused_call(tmp_path):
    """triton.decoupled: the fused path is one tensorrt_llm call for the whole answer, which the BLS's own request's
    cancellation cannot reach from outside (a decoupled call is not sliced). A streamed request's call streams, and
    once the client has cancelled, the BLS sends TensorRT-LLM's `stop` for the call's request id: tensorrt_llm reports
    it stopped a running request and the BLS request ends failed, not answered; with drafts (k = 3) and as a plain run
    (k = 0). Each request is cancelled after its first text and asks for every token the engine allows (end_id -1:
    ~4,000), so the cancel finds nearly all of its work still to do. Then the instance answers the next request as
    the control."""
    import tritonclient.grpc as grpc
    from transformers import AutoTokenizer

    from specdeploy.client.protocol import GenerateRequest
    from specdeploy.client.triton_adapter import TritonEndpoint
    from specdeploy.core.metrics import names, reader
    from specdeploy.deploy import backend_stages
    from specdeploy.triton import ports, server

    model_dir = _model(tmp_path / "hf", max_position_embeddings=4096)
    head = make_eagle3_head(tmp_path / "head", 64, 512, AUX, dtype="float32")
    recipe, layout, recipe_path = _deployment(
        tmp_path / "decoupled",
        model_dir,
        head,
        triton={"decoupled": True},
        speculative={"draft_p_min": 0.0},
        engine={"max_seq_len": 4096},
    )
    repo, _ = backend_stages.of(recipe).write_repository(recipe, layout, recipe_path=str(recipe_path))
    tok = AutoTokenizer.from_pretrained(str(Path(repo) / "preprocessing" / "tokenizer"))
    log = Path(layout.server_state) / "tritonserver.log"
    srv = server.start(repo, ports.Ports.pick(), log, exit_timeout_s=3)
    endpoint = TritonEndpoint(srv.state.grpc_url)
    stopped = re.compile(r"tensorrt_llm: stop for request id '([0-9a-f]{32})': ([0-9]+) running request")
    try:
        server.wait_ready(srv, SERVER_READY_TIMEOUT_S)
        prompt = chat_text(CHATS[0])
        max_tokens = 4096 - len(tok(prompt).input_ids)
        # one baseline: the BLS counts a request after its answer went out, so a window begun after the previous turn's
        # answer may still see it; the BLS serves its requests one after another, so a turn's error comes after it
        before = reader.scrape(srv.state.metrics_url)
        for turn, k in enumerate((3, 0)):
            values = {
                "text_input": np.array([[prompt.encode()]], dtype=object),
                "max_tokens": np.array([[max_tokens]], dtype=np.int32),
                "end_id": np.array([[-1]], dtype=np.int32),
                "num_draft_tokens": np.array([[k]], dtype=np.int32),
                "stream": np.array([[True]]),
            }
            inputs = []
            for name, array in values.items():
                tensor = grpc.InferInput(
                    name,
                    list(array.shape),
                    "BYTES" if array.dtype == object else {"int32": "INT32", "bool": "BOOL"}[array.dtype.name],
                )
                tensor.set_data_from_numpy(array)
                inputs.append(tensor)
            client = grpc.InferenceServerClient(srv.state.grpc_url)
            texts: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: texts.put((result, error)))
            client.async_stream_infer("tensorrt_llm_bls", inputs, request_id=f"cancelled-{k}")
            result, error = texts.get(timeout=300)  # its first text has come
            assert error is None and result.as_numpy("text_output").reshape(-1)[0], error
            client.stop_stream(cancel_requests=True)
            client.close()
            ended = (names.REQUEST_ERRORS.name, names.REQUESTS.name)
            window = _scrape_until(
                srv.state.metrics_url,
                before,
                lambda w: sum(w.sum(n, model="tensorrt_llm_bls") for n in ended) >= 2 * turn + 1,
            )
            assert window.sum(names.REQUESTS.name, model="tensorrt_llm_bls") == turn, (
                k
            )  # it was not answered (the turns' last requests were)
            assert window.sum(names.REQUEST_ERRORS.name, model="tensorrt_llm_bls") == turn + 1, k
            found = stopped.findall(log.read_text(errors="replace"))
            assert [n for _, n in found] == ["1"] * (turn + 1), (k, found)  # the stop ended the running call
            control = endpoint.generate("ensemble", GenerateRequest(prompt, MAX_TOKENS), 300).text
            assert (
                endpoint.generate("tensorrt_llm_bls", GenerateRequest(prompt, MAX_TOKENS, num_draft_tokens=3), 300).text
                == control
            )
    finally:
        endpoint.close()
        srv.stop()
