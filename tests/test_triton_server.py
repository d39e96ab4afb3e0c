"""The generated repository on a REAL tritonserver (loopback, tiny models, HF stand-in engine).

Two servers per run (module-scoped, always stopped): `plain` (non-decoupled, 2 instances, a
different draft model) and `streaming` (decoupled, 1 instance, draft == target).
"""

from __future__ import annotations

import queue
import shutil
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from triton_hf_engine import make_engines  # noqa: E402

from specdeploy.triton import repository, server  # noqa: E402

import tritonclient.grpc as tritonclient_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

TESTS_DIR = str(Path(__file__).parent)
PROMPTS = [
    "The quick brown fox",
    "Speculative decoding lets a small draft",
    "def add(a, b):",
    "Triton Inference Server serves",
    "Once upon a time",
    "Q: What is the capital of France? A:",
    "x",
]
MAX_TOKENS = 16


def _start(tmp_path_factory, target_dir, draft_dir, name, **overrides):
    root = tmp_path_factory.mktemp(name)
    recipe, layout = make_engines(root, target_dir, draft_dir, **overrides)
    repo, _ = repository.generate_repository(recipe, layout, executor_factory="triton_hf_engine:load_executor")
    srv = server.start(repo, server.Ports.pick(), root / "tritonserver.log", extra_site=(TESTS_DIR,), exit_timeout_s=3)
    try:
        server.wait_ready(srv, 240)
    except BaseException:
        srv.stop()
        raise
    return srv


pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_llama_dir, tiny_llama_draft_dir):
    srv = _start(tmp_path_factory, tiny_llama_dir, tiny_llama_draft_dir, "plain", triton={"instance_count": 2})
    client = tritonclient_grpc.InferenceServerClient(srv.state.grpc_url)
    client.url = srv.state.grpc_url  # for tests that open one client per thread
    try:
        yield client
    finally:
        client.close()
        srv.stop()
        assert not srv.alive()


@pytest.fixture(scope="module")
def streaming(tmp_path_factory, tiny_llama_dir):
    """Started the way `specdeploy serve --detach` does it; stopped the way `specdeploy stop` does."""
    root = tmp_path_factory.mktemp("streaming")
    recipe, layout = make_engines(root, tiny_llama_dir, tiny_llama_dir, triton={"decoupled": True})
    repo, _ = repository.generate_repository(recipe, layout, executor_factory="triton_hf_engine:load_executor")
    repository.require_repository(recipe, layout)
    lines = []
    try:
        state = server.serve(repo, layout.server_state, recipe.triton, detach=True, echo=lines.append, extra_site=(TESTS_DIR,))
        assert any(state.grpc_url in line for line in lines)
        client = tritonclient_grpc.InferenceServerClient(state.grpc_url)
        client.url = state.grpc_url
        client.state_dir = layout.server_state
        yield client
        client.close()
    finally:
        server.stop(layout.server_state)
    assert server.status(layout.server_state)[0] is None


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))


# ---------------------------------------------------------------- client helpers

DTYPES = {np.int32: "INT32", np.float32: "FP32", np.uint64: "UINT64", np.bool_: "BOOL", np.object_: "BYTES", np.int64: "INT64"}


def _inputs(values: dict) -> list:
    out = []
    for name, value in values.items():
        arr = value if isinstance(value, np.ndarray) else _as_array(name, value)
        tensor = tritonclient_grpc.InferInput(name, list(arr.shape), DTYPES[arr.dtype.type])
        tensor.set_data_from_numpy(arr)
        out.append(tensor)
    return out


def _as_array(name, value):
    if isinstance(value, (str, bytes)):
        return np.array([[value if isinstance(value, bytes) else value.encode()]], dtype=object)
    if isinstance(value, bool):
        return np.array([[value]], dtype=bool)
    if isinstance(value, float):
        return np.array([[value]], dtype=np.float32)
    if name in ("seed", "random_seed"):
        return np.array([[value]], dtype=np.uint64)
    if isinstance(value, int):
        return np.array([[value]], dtype=np.int32)
    if isinstance(value, list):  # stop_words / bad_words
        return np.array([[w.encode() for w in value]], dtype=object)
    raise TypeError(name)


def infer(client, model, **values):
    return client.infer(model, _inputs(values), client_timeout=120)


def text(result) -> str:
    return result.as_numpy("text_output").reshape(-1)[0].decode("utf-8")


def stream(client, model, **values) -> list:
    """All responses of one streamed request (or raises the first error)."""
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(model, _inputs(values), enable_empty_final_response=True)
        results = []
        while True:
            result, error = responses.get(timeout=120)
            if error is not None:
                raise error
            final = result.get_response().parameters["triton_final_response"].bool_param
            if result.get_response().outputs:
                results.append(result)
            if final:
                return results
    finally:
        client.stop_stream()


def stream_text(client, model, **values) -> str:
    return "".join(text(r) for r in stream(client, model, **values))


# ---------------------------------------------------------------- non-decoupled server


def test_all_models_ready_with_the_generated_configs(plain):
    assert plain.is_server_ready()
    for name in ("preprocessing", "tensorrt_llm", "tensorrt_llm_draft", "postprocessing", "ensemble", "tensorrt_llm_bls"):
        assert plain.is_model_ready(name), name
    config = plain.get_model_config("tensorrt_llm_bls").config
    assert {i.name for i in config.input} >= {"text_input", "max_tokens", "num_draft_tokens", "use_draft_logits"}


@pytest.mark.parametrize("num_draft_tokens", [0, 1, 3, 4])
def test_bls_equals_ensemble_token_for_token(plain, num_draft_tokens):
    for i, prompt in enumerate(PROMPTS):
        exclude = bool(i % 2)
        control = text(infer(plain, "ensemble", text_input=prompt, max_tokens=MAX_TOKENS, exclude_input_in_output=exclude))
        spec = text(
            infer(
                plain,
                "tensorrt_llm_bls",
                text_input=prompt,
                max_tokens=MAX_TOKENS,
                num_draft_tokens=num_draft_tokens,
                exclude_input_in_output=exclude,
            )
        )
        assert spec == control, (prompt, num_draft_tokens)
        if not exclude:
            assert control.startswith(prompt)


def _ids(client, prompt):
    pre = infer(client, "preprocessing", QUERY=prompt, REQUEST_OUTPUT_LEN=MAX_TOKENS)
    n = int(pre.as_numpy("REQUEST_INPUT_LEN").reshape(-1)[0])
    return pre.as_numpy("INPUT_ID").reshape(-1)[:n].tolist()


def _llm(client, model, ids, output_len, **extra):
    values = {
        "input_ids": np.array([ids], dtype=np.int32),
        "input_lengths": np.array([[len(ids)]], dtype=np.int32),
        "request_output_len": np.array([[output_len]], dtype=np.int32),
        "exclude_input_in_output": np.array([[True]]),
        **extra,
    }
    result = client.infer(model, _inputs(values), client_timeout=120)
    n = int(result.as_numpy("sequence_length").reshape(-1)[0])
    return result.as_numpy("output_ids").reshape(-1)[:n].tolist(), result


def test_client_driven_pipeline_matches_bls(plain, tokenizer):
    """preprocessing -> tensorrt_llm_draft -> tensorrt_llm (draft_input_ids) -> postprocessing by hand."""
    k = 3
    for prompt in PROMPTS[:4]:
        sequence = _ids(plain, prompt)
        prompt_len = len(sequence)
        drafted = accepted = 0
        while len(sequence) - prompt_len < MAX_TOKENS:
            remaining = MAX_TOKENS - (len(sequence) - prompt_len)
            draft, _ = _llm(plain, "tensorrt_llm_draft", sequence, max(min(k, remaining - 1), 1))
            draft = draft[: min(k, remaining - 1)]
            extra = {"draft_input_ids": np.array([draft], dtype=np.int32)} if draft else {}
            new, result = _llm(plain, "tensorrt_llm", sequence, len(draft) + 1, return_perf_metrics=np.array([[True]]), **extra)
            assert 1 <= len(new) <= len(draft) + 1
            assert new[:-1] == draft[: len(new) - 1]
            drafted += int(result.as_numpy("total_draft_tokens").reshape(-1)[0])
            accepted += int(result.as_numpy("total_accepted_draft_tokens").reshape(-1)[0])
            sequence += new[:remaining]
        output = sequence[prompt_len:]
        post = plain.infer(
            "postprocessing",
            _inputs(
                {
                    "TOKENS_BATCH": np.array([[output]], dtype=np.int32),
                    "SEQUENCE_LENGTH": np.array([[len(output)]], dtype=np.int32),
                }
            ),
        )
        by_hand = post.as_numpy("OUTPUT").reshape(-1)[0].decode()
        bls = infer(plain, "tensorrt_llm_bls", text_input=prompt, max_tokens=MAX_TOKENS, num_draft_tokens=k, exclude_input_in_output=True)
        assert by_hand == text(bls) == tokenizer.decode(output, skip_special_tokens=True)
        assert accepted <= drafted


def test_perf_metrics_are_consistent(plain):
    for prompt in PROMPTS[:4]:
        r = infer(plain, "tensorrt_llm_bls", text_input=prompt, max_tokens=MAX_TOKENS, num_draft_tokens=3, return_perf_metrics=True)
        drafted = int(r.as_numpy("total_draft_tokens").reshape(-1)[0])
        accepted = int(r.as_numpy("total_accepted_draft_tokens").reshape(-1)[0])
        rate = float(r.as_numpy("acceptance_rate").reshape(-1)[0])
        assert 0 < drafted and 0 <= accepted <= drafted
        assert rate == pytest.approx(accepted / drafted, abs=1e-6)
        arrival, first, last = (int(r.as_numpy(n).reshape(-1)[0]) for n in ("arrival_time_ns", "first_token_time_ns", "last_token_time_ns"))
        assert 0 < arrival <= first <= last


def test_stop_words_bad_words_and_end_id_agree(plain, tokenizer):
    prompt = PROMPTS[0]
    greedy, _ = _llm(plain, "tensorrt_llm", _ids(plain, prompt), MAX_TOKENS)
    # a generated token whose text encodes back to itself, first seen after a few tokens
    round_trips = [
        i for i, t in enumerate(greedy) if i >= 2 and t not in greedy[:i] and tokenizer(tokenizer.decode([t]), add_special_tokens=False).input_ids == [t]
    ]
    assert round_trips, greedy
    i = round_trips[0]
    word = tokenizer.decode([greedy[i]])
    cases = [{"stop_words": [word]}, {"bad_words": [word]}, {"end_id": int(greedy[i])}]
    outputs = []
    for case in cases:
        control = text(infer(plain, "ensemble", text_input=prompt, max_tokens=MAX_TOKENS, exclude_input_in_output=True, **case))
        spec = text(infer(plain, "tensorrt_llm_bls", text_input=prompt, max_tokens=MAX_TOKENS, exclude_input_in_output=True, **case))
        assert spec == control, case
        outputs.append(spec)
    stopped, banned, ended = outputs
    assert stopped == tokenizer.decode(greedy[: i + 1], skip_special_tokens=True)
    assert banned != tokenizer.decode(greedy, skip_special_tokens=True)
    assert banned.startswith(tokenizer.decode(greedy[:i], skip_special_tokens=True).rstrip("\ufffd"))
    assert ended == stopped


def test_sampling_is_reproducible_with_a_seed(plain):
    args = dict(text_input=PROMPTS[1], max_tokens=MAX_TOKENS, top_k=20, temperature=0.9, seed=1234, exclude_input_in_output=True)
    for model, extra in (("ensemble", {}), ("tensorrt_llm_bls", {"use_draft_logits": True, "return_perf_metrics": True})):
        first = infer(plain, model, **args, **extra)
        assert text(first) == text(infer(plain, model, **args, **extra))
        if model == "tensorrt_llm_bls":
            drafted = int(first.as_numpy("total_draft_tokens").reshape(-1)[0])
            assert 0 <= int(first.as_numpy("total_accepted_draft_tokens").reshape(-1)[0]) <= drafted


def test_concurrent_requests_all_correct(plain):
    expected = {p: text(infer(plain, "ensemble", text_input=p, max_tokens=MAX_TOKENS)) for p in PROMPTS}
    jobs = [(model, p) for p in PROMPTS for model in ("ensemble", "tensorrt_llm_bls")]

    def run(job):
        model, prompt = job
        client = tritonclient_grpc.InferenceServerClient(plain.url)
        try:
            return job, text(infer(client, model, text_input=prompt, max_tokens=MAX_TOKENS))
        finally:
            client.close()

    with ThreadPoolExecutor(8) as pool:
        for (model, prompt), got in pool.map(run, jobs):
            assert got == expected[prompt], (model, prompt)


BAD_INPUTS = [
    ("ensemble", dict(text_input="", max_tokens=8), "empty"),
    ("tensorrt_llm_bls", dict(text_input="", max_tokens=8), "empty"),
    ("ensemble", dict(text_input="fox " * 100, max_tokens=8), "max_input_len"),
    ("tensorrt_llm_bls", dict(text_input="fox " * 100, max_tokens=8), "max_input_len"),
    ("ensemble", dict(text_input="hello", max_tokens=0), "max_tokens"),
    ("tensorrt_llm_bls", dict(text_input="hello", max_tokens=-3), "max_tokens"),
    ("ensemble", dict(text_input="hello", max_tokens=500), "max_seq_len"),
    ("tensorrt_llm_bls", dict(text_input="hello", max_tokens=500), "max_seq_len"),
    ("tensorrt_llm_bls", dict(text_input="hello", max_tokens=8, num_draft_tokens=9), "max_draft_len"),
    ("ensemble", dict(text_input=b"caf\xc3(", max_tokens=8), "UTF-8"),
    ("tensorrt_llm_bls", dict(text_input=b"\xff\xfe", max_tokens=8), "UTF-8"),
    ("ensemble", dict(text_input="hello", max_tokens=8, stream=True), "decoupled"),
    ("ensemble", dict(text_input="hello", max_tokens=np.array([[8.0]], dtype=np.float32)), "data-type"),
    ("tensorrt_llm_bls", dict(text_input=np.array([[b"a", b"b"]], dtype=object), max_tokens=8), "shape"),
]


@pytest.mark.parametrize("model,values,needle", BAD_INPUTS, ids=[f"{m}-{n}" for m, _, n in BAD_INPUTS])
def test_bad_input_gets_an_error_and_the_server_keeps_serving(plain, model, values, needle):
    with pytest.raises(InferenceServerException) as err:
        infer(plain, model, **values)
    assert needle.lower() in err.value.message().lower(), err.value.message()
    assert text(infer(plain, model, text_input=PROMPTS[0], max_tokens=4))


def test_engine_level_errors(plain):
    with pytest.raises(InferenceServerException, match="Number of draft tokens"):
        _llm(plain, "tensorrt_llm", [1, 5, 6], 6, draft_input_ids=np.array([[5, 6, 7, 8, 9]], dtype=np.int32))
    with pytest.raises(InferenceServerException, match="outside the vocabulary"):
        _llm(plain, "tensorrt_llm", [1, 99999], 2)
    with pytest.raises(InferenceServerException, match="max_draft_len|Number of draft tokens"):
        _llm(plain, "tensorrt_llm_draft", [1, 5], 2, draft_input_ids=np.array([[5]], dtype=np.int32))
    # no state leaks: the same request twice gives the same output after the failures
    first, _ = _llm(plain, "tensorrt_llm", [1, 5, 6], 6)
    assert _llm(plain, "tensorrt_llm", [1, 5, 6], 6)[0] == first


# ---------------------------------------------------------------- decoupled server (draft == target)


def test_streaming_bls_equals_non_streaming(streaming):
    for prompt in PROMPTS[:5]:
        args = dict(text_input=prompt, max_tokens=MAX_TOKENS, exclude_input_in_output=True)
        whole = stream(streaming, "tensorrt_llm_bls", **args)
        assert len(whole) == 1
        parts = stream(streaming, "tensorrt_llm_bls", stream=True, num_draft_tokens=2, **args)
        assert len(parts) > 1
        control = stream_text(streaming, "ensemble", **args)
        assert "".join(text(p) for p in parts) == text(whole[0]) == control


def test_streaming_ensemble_sends_every_token(streaming, tokenizer):
    prompt = PROMPTS[2]
    ids = _stream_ids(streaming, prompt)
    parts = stream(streaming, "ensemble", text_input=prompt, max_tokens=MAX_TOKENS, stream=True)
    assert len(parts) == len(ids)
    assert [text(p) for p in parts] == [tokenizer.decode([t], skip_special_tokens=True) for t in ids]


def _stream_ids(client, prompt):
    pre = stream(client, "preprocessing", QUERY=prompt, REQUEST_OUTPUT_LEN=MAX_TOKENS)[0]
    n = int(pre.as_numpy("REQUEST_INPUT_LEN").reshape(-1)[0])
    ids = pre.as_numpy("INPUT_ID").reshape(-1)[:n].tolist()
    values = {
        "input_ids": np.array([ids], dtype=np.int32),
        "input_lengths": np.array([[n]], dtype=np.int32),
        "request_output_len": np.array([[MAX_TOKENS]], dtype=np.int32),
        "exclude_input_in_output": np.array([[True]]),
    }
    (result,) = stream(client, "tensorrt_llm", **values)
    length = int(result.as_numpy("sequence_length").reshape(-1)[0])
    return result.as_numpy("output_ids").reshape(-1)[:length].tolist()


def test_draft_equal_to_target_accepts_everything(streaming):
    for prompt in PROMPTS[:3]:
        (r,) = stream(streaming, "tensorrt_llm_bls", text_input=prompt, max_tokens=MAX_TOKENS, num_draft_tokens=4, return_perf_metrics=True)
        drafted = int(r.as_numpy("total_draft_tokens").reshape(-1)[0])
        assert drafted > 0
        assert int(r.as_numpy("total_accepted_draft_tokens").reshape(-1)[0]) == drafted
        assert float(r.as_numpy("acceptance_rate").reshape(-1)[0]) == pytest.approx(1.0)


def test_streamed_bad_input_errors_then_serves(streaming):
    with pytest.raises(InferenceServerException, match="empty"):
        stream(streaming, "tensorrt_llm_bls", text_input="", max_tokens=4, stream=True)
    assert stream_text(streaming, "tensorrt_llm_bls", text_input=PROMPTS[0], max_tokens=4, stream=True)


def test_concurrent_streams_all_correct(streaming):
    expected = {p: stream_text(streaming, "tensorrt_llm_bls", text_input=p, max_tokens=12, exclude_input_in_output=True) for p in PROMPTS[:6]}
    def run(prompt):
        client = tritonclient_grpc.InferenceServerClient(streaming.url)
        try:
            return prompt, stream_text(client, "tensorrt_llm_bls", text_input=prompt, max_tokens=12, stream=True)
        finally:
            client.close()

    with ThreadPoolExecutor(6) as pool:
        for prompt, got in pool.map(run, list(expected)):
            assert got == expected[prompt]


def test_detached_server_status(streaming):
    state, line = server.status(streaming.state_dir)
    assert state is not None and line.startswith("running, ready") and state.grpc_url in line
