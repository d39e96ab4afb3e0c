"""The generated repository on a REAL tritonserver (loopback, tiny models, HF stand-in engine).

Two servers per run (module-scoped, always stopped): `plain` (non-decoupled, 2 instances, a
different draft model) and `streaming` (decoupled, 1 instance, draft == target).
"""

from __future__ import annotations

import queue
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tritonclient.grpc as tritonclient_grpc  # noqa: E402
from tiny_models import SERVER_READY_TIMEOUT_S  # noqa: E402
from triton_hf_engine import make_engines  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from specdeploy.core.metrics import names as core_metrics_names
from specdeploy.core.metrics import reader
from specdeploy.deploy import backend_stages
from specdeploy.triton import ports, repository, server, tensors  # noqa: E402

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
    repo, _ = backend_stages.of(recipe).write_repository(
        recipe, layout, executor_factory="triton_hf_engine:load_executor"
    )
    srv = server.start(repo, ports.Ports.pick(), root / "tritonserver.log", extra_site=(TESTS_DIR,), exit_timeout_s=3)
    try:
        server.wait_ready(srv, SERVER_READY_TIMEOUT_S)
    except BaseException:
        srv.stop()
        raise
    return srv


def assert_no_stub_crashed(log: str | Path) -> None:
    """No python stub died, also not at the server's stop: the models release their Triton metrics and held BLS
    responses in `finalize` (metrics.TritonSink.close, common.HeldResponses.clear); released at the stub's teardown,
    they wrote to its shared memory after it was gone (SIGSEGV on every stop before)."""
    text = Path(log).read_text(errors="replace")
    assert "Fatal Python error" not in text, text[text.index("Fatal Python error") - 300 :][:1500]


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
    assert_no_stub_crashed(srv.state.log)


@pytest.fixture(scope="module")
def streaming(tmp_path_factory, tiny_llama_dir):
    """Started the way `specdeploy serve --detach` does it; stopped the way `specdeploy stop` does."""
    root = tmp_path_factory.mktemp("streaming")
    recipe, layout = make_engines(root, tiny_llama_dir, tiny_llama_dir, triton={"decoupled": True})
    repo, _ = backend_stages.of(recipe).write_repository(
        recipe, layout, executor_factory="triton_hf_engine:load_executor"
    )
    repository.require_repository(recipe, layout)
    lines = []
    try:
        state = server.serve(
            repo, layout.server_state, recipe.triton, detach=True, echo=lines.append, extra_site=(TESTS_DIR,)
        )
        assert any(state.grpc_url in line for line in lines)
        client = tritonclient_grpc.InferenceServerClient(state.grpc_url)
        client.url = state.grpc_url
        client.state_dir = layout.server_state
        yield client
        client.close()
    finally:
        server.stop(layout.server_state)
    assert server.status(layout.server_state)[0] is None
    assert_no_stub_crashed(state.log)


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))


# ---------------------------------------------------------------- client helpers

DTYPES = {
    np.int32: "INT32",
    np.float32: "FP32",
    np.uint64: "UINT64",
    np.bool_: "BOOL",
    np.object_: "BYTES",
    np.int64: "INT64",
}


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
    for name in (
        "preprocessing",
        "tensorrt_llm",
        "tensorrt_llm_draft",
        "postprocessing",
        "ensemble",
        "tensorrt_llm_bls",
    ):
        assert plain.is_model_ready(name), name
    config = plain.get_model_config("tensorrt_llm_bls").config
    assert {i.name for i in config.input} >= {"text_input", "max_tokens", "num_draft_tokens", "use_draft_logits"}


@pytest.mark.parametrize("num_draft_tokens", [0, 1, 3, 4])
def test_bls_equals_ensemble_token_for_token(plain, num_draft_tokens):
    for i, prompt in enumerate(PROMPTS):
        exclude = bool(i % 2)
        control = text(
            infer(plain, "ensemble", text_input=prompt, max_tokens=MAX_TOKENS, exclude_input_in_output=exclude)
        )
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
            new, result = _llm(
                plain, "tensorrt_llm", sequence, len(draft) + 1, return_perf_metrics=np.array([[True]]), **extra
            )
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
        bls = infer(
            plain,
            "tensorrt_llm_bls",
            text_input=prompt,
            max_tokens=MAX_TOKENS,
            num_draft_tokens=k,
            exclude_input_in_output=True,
        )
        assert by_hand == text(bls) == tokenizer.decode(output, skip_special_tokens=True)
        assert accepted <= drafted


def test_perf_metrics_are_consistent(plain):
    for prompt in PROMPTS[:4]:
        r = infer(
            plain,
            "tensorrt_llm_bls",
            text_input=prompt,
            max_tokens=MAX_TOKENS,
            num_draft_tokens=3,
            return_perf_metrics=True,
        )
        drafted = int(r.as_numpy("total_draft_tokens").reshape(-1)[0])
        accepted = int(r.as_numpy("total_accepted_draft_tokens").reshape(-1)[0])
        rate = float(r.as_numpy("acceptance_rate").reshape(-1)[0])
        assert 0 < drafted and 0 <= accepted <= drafted
        assert rate == pytest.approx(accepted / drafted, abs=1e-6)
        arrival, first, last = (
            int(r.as_numpy(n).reshape(-1)[0]) for n in ("arrival_time_ns", "first_token_time_ns", "last_token_time_ns")
        )
        assert 0 < arrival <= first <= last


def test_stop_words_bad_words_and_end_id_agree(plain, tokenizer):
    prompt = PROMPTS[0]
    greedy, _ = _llm(plain, "tensorrt_llm", _ids(plain, prompt), MAX_TOKENS)
    # a generated token whose text encodes back to itself, first seen after a few tokens
    round_trips = [
        i
        for i, t in enumerate(greedy)
        if i >= 2
        and t not in greedy[:i]
        and tokenizer(tokenizer.decode([t]), add_special_tokens=False).input_ids == [t]
    ]
    assert round_trips, greedy
    i = round_trips[0]
    word = tokenizer.decode([greedy[i]])
    cases = [{"stop_words": [word]}, {"bad_words": [word]}, {"end_id": int(greedy[i])}]
    outputs = []
    for case in cases:
        control = text(
            infer(plain, "ensemble", text_input=prompt, max_tokens=MAX_TOKENS, exclude_input_in_output=True, **case)
        )
        spec = text(
            infer(
                plain,
                "tensorrt_llm_bls",
                text_input=prompt,
                max_tokens=MAX_TOKENS,
                exclude_input_in_output=True,
                **case,
            )
        )
        assert spec == control, case
        outputs.append(spec)
    stopped, banned, ended = outputs
    assert stopped == tokenizer.decode(greedy[: i + 1], skip_special_tokens=True)
    assert banned != tokenizer.decode(greedy, skip_special_tokens=True)
    assert banned.startswith(tokenizer.decode(greedy[:i], skip_special_tokens=True).rstrip("\ufffd"))
    # a stop word stays in the output, the end token does not (TensorRT-LLM's output_ids; tensorrt_llm.py
    # _without_end_token)
    assert ended == tokenizer.decode(greedy[:i], skip_special_tokens=True)


def test_the_bls_cuts_its_answer_after_a_stop_word_written_inside_other_tokens(plain, tokenizer):
    """NVIDIA's BLS also cuts text_output after the first stop word in the generated text (tensorrt_llm_bls/1/model.py
    at c2e65b8), which catches a stop word the model wrote inside tokens of its own, where the engine's token match
    cannot: the answer ends with the stop word's first occurrence."""
    prompt = PROMPTS[0]
    full = text(
        infer(plain, "tensorrt_llm_bls", text_input=prompt, max_tokens=MAX_TOKENS, exclude_input_in_output=True)
    )
    ids = _llm(plain, "tensorrt_llm", _ids(plain, prompt), MAX_TOKENS)[0]
    # two characters that start inside a token of the answer (the second character of a token of two or more)
    starts, at = [], 0
    for t in ids:
        piece = tokenizer.decode([t])
        if len(piece) >= 2 and piece.isprintable():
            starts.append(at + 1)
        at += len(piece)
    start = next(i for i in starts if i + 2 <= len(full) and full[i : i + 2].strip() == full[i : i + 2])
    stop = full[start : start + 2]
    cut = text(
        infer(
            plain,
            "tensorrt_llm_bls",
            text_input=prompt,
            max_tokens=MAX_TOKENS,
            exclude_input_in_output=True,
            stop_words=[stop],
        )
    )
    assert cut == full[: full.find(stop) + len(stop)] and len(cut) < len(full), (stop, cut, full)


def test_sampling_is_reproducible_with_a_seed(plain):
    args = dict(
        text_input=PROMPTS[1], max_tokens=MAX_TOKENS, top_k=20, temperature=0.9, seed=1234, exclude_input_in_output=True
    )
    for model, extra in (
        ("ensemble", {}),
        ("tensorrt_llm_bls", {"use_draft_logits": True, "return_perf_metrics": True}),
    ):
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


def test_more_tokens_than_max_seq_len_leaves_room_for_are_as_many_as_fit(plain, tokenizer):
    """A request whose prompt plus max_tokens passes max_seq_len (128 here) gets the tokens that fit, as TensorRT-LLM
    lowers mMaxNewTokens with a warning (LlmRequest::validate) rather than failing it; a prompt that fills it is
    refused.
    """
    ids = tokenizer("hello there").input_ids
    out, _ = _llm(plain, "tensorrt_llm", ids, 500, end_id=np.array([[-1]], dtype=np.int32))
    assert len(out) == 128 - len(ids)
    for model in ("ensemble", "tensorrt_llm_bls"):
        assert text(infer(plain, model, text_input="hello", max_tokens=500))  # served, not refused
    with pytest.raises(InferenceServerException, match="max_seq_len"):
        _llm(plain, "tensorrt_llm", list(range(5, 133)), 4)


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
    # one response per token, except that tokens are held until they complete a character (reference:
    # the plain decode of the output so far ends on a whole character)
    so_far = [tokenizer.decode(ids[:i], skip_special_tokens=True) for i in range(1, len(ids) + 1)]
    whole_chars = [t for t in so_far if not t.endswith("\ufffd")]
    expected = [b[len(a) :] for a, b in zip([""] + whole_chars, whole_chars)]
    assert [t for t in (text(p) for p in parts) if t] == [t for t in expected if t]
    assert "".join(text(p) for p in parts) == tokenizer.decode(ids, skip_special_tokens=True)


MULTI_BYTE_BIAS = dict(
    embedding_bias_words=["é", "日", "😀"], embedding_bias_weights=np.array([[30.0, 30.0, 30.0]], np.float32)
)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_streamed_multi_byte_text_equals_the_whole_text(streaming, tokenizer, model):
    """The tiny tokenizer is byte-level BPE trained on ASCII: é, 日 and 😀 are 2, 3 and 4 byte tokens.
    A bias towards those bytes makes the output multi-byte text; streamed, each response carries whole
    characters, so the concatenated stream equals the non-streamed text."""
    args = dict(text_input=PROMPTS[0], max_tokens=24, exclude_input_in_output=True, **MULTI_BYTE_BIAS)
    (whole,) = stream(streaming, model, **args)
    parts = [text(p) for p in stream(streaming, model, stream=True, **args)]
    assert any(ord(c) > 127 and c != "\ufffd" for c in text(whole)), text(whole)  # real multi-byte characters came out
    assert "".join(parts) == text(whole)
    assert len(parts) > 1


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
        (r,) = stream(
            streaming,
            "tensorrt_llm_bls",
            text_input=prompt,
            max_tokens=MAX_TOKENS,
            num_draft_tokens=4,
            return_perf_metrics=True,
        )
        drafted = int(r.as_numpy("total_draft_tokens").reshape(-1)[0])
        assert drafted > 0
        assert int(r.as_numpy("total_accepted_draft_tokens").reshape(-1)[0]) == drafted
        assert float(r.as_numpy("acceptance_rate").reshape(-1)[0]) == pytest.approx(1.0)


def test_streamed_bad_input_errors_then_serves(streaming):
    with pytest.raises(InferenceServerException, match="empty"):
        stream(streaming, "tensorrt_llm_bls", text_input="", max_tokens=4, stream=True)
    assert stream_text(streaming, "tensorrt_llm_bls", text_input=PROMPTS[0], max_tokens=4, stream=True)


def test_concurrent_streams_all_correct(streaming):
    expected = {
        p: stream_text(streaming, "tensorrt_llm_bls", text_input=p, max_tokens=12, exclude_input_in_output=True)
        for p in PROMPTS[:6]
    }

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


# ---------------------------------------------------------------- the REAL CPU engine inside tritonserver
# Tiny random checkpoints (max_position_embeddings 2048 for the long-sequence case) through quantize
# (FP8 target, INT8 weight-only draft of a different, 1-layer model) and build (bf16, native kernels
# where the machine has them), served with the default executor factory.

LONG_PROMPT_TOKENS, LONG_OUTPUT, REAL_MAX_SEQ_LEN = 1000, 200, 1400


@pytest.fixture(scope="module")
def real(tmp_path_factory, tiny_tokenizer_dir):
    from tiny_models import build_quietly, make_tiny_pair, tiny_pair_recipe

    from specdeploy.recipe.load import parse_recipe

    root = tmp_path_factory.mktemp("real")
    recipe = parse_recipe(
        tiny_pair_recipe(
            "real",
            *make_tiny_pair(root, tiny_tokenizer_dir, max_position_embeddings=2048),
            engine={"dtype": "bfloat16", "max_batch_size": 4, "max_input_len": 1100, "max_seq_len": REAL_MAX_SEQ_LEN},
            triton={"instance_count": 1, "inflight_batching": True},  # the stop test needs requests to meet
            validation={"max_tokens": 16},
        )
    )
    layout = build_quietly(recipe, root)
    repo, _ = backend_stages.of(recipe).write_repository(recipe, layout)
    srv = server.start(repo, ports.Ports.pick(), root / "tritonserver.log", exit_timeout_s=3)
    try:
        server.wait_ready(srv, SERVER_READY_TIMEOUT_S)
        client = tritonclient_grpc.InferenceServerClient(srv.state.grpc_url)
        client.url, client.metrics_url, client.log = srv.state.grpc_url, srv.state.metrics_url, srv.state.log
        yield client
        client.close()
    finally:
        srv.stop()
    assert not srv.alive()
    assert_no_stub_crashed(srv.state.log)


def _neutral_text_inputs(model: str) -> dict:
    """Every optional input of NVIDIA's ensemble / tensorrt_llm_bls at its neutral value."""
    values = dict(
        decoder_text_input="",
        num_return_sequences=1,
        bad_words=[""],
        stop_words=[""],
        exclude_input_in_output=True,
        end_id=2,
        pad_id=3,
        top_k=0,
        top_p=0.0,
        temperature=1.0,
        length_penalty=1.0,
        repetition_penalty=1.0,
        min_tokens=0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        seed=7,
        return_log_probs=True,
        return_context_logits=True,
        return_generation_logits=True,
        return_perf_metrics=True,
        beam_width=1,
        stream=False,
        prompt_embedding_table=np.zeros((1, 0, 0), np.float16),
        prompt_table_extra_id=np.array([[0]], np.uint64),
        prompt_vocab_size=0,
        embedding_bias_words=[""],
        embedding_bias_weights=np.zeros((1, 0), np.float32),
        lora_task_id=np.array([[0]], np.uint64),
        lora_weights=np.zeros((1, 0, 0), np.float16),
        lora_config=np.zeros((1, 0, 3), np.int32),
        guided_decoding_guide_type="",
        guided_decoding_guide="",
    )
    if model == "tensorrt_llm_bls":
        values.update(
            image_input=np.zeros((1, 0, 3, 0, 0), np.float16),
            image_bytes_input=np.zeros((1, 0, 0, 0, 0), np.uint8),
            image_url_input="",
            video_bytes_input=np.zeros((1, 0, 0, 0, 0), np.uint8),
            num_draft_tokens=3,
            use_draft_logits=False,
        )
    return values


DTYPES.update({np.float16: "FP16", np.uint8: "UINT8"})
RESULT_NAMES = [t.name for t in tensors.RESULT_OUTPUTS]


def _infer_all_outputs(client, model, values, names):
    outputs = [tritonclient_grpc.InferRequestedOutput(n) for n in names]
    return client.infer(model, _inputs(values), outputs=outputs, client_timeout=120)


def test_real_every_optional_input_neutral_and_every_output(real, tokenizer):
    prompt, n = PROMPTS[1], 8
    plain = {}
    for model in ("ensemble", "tensorrt_llm_bls"):
        plain[model] = text(infer(real, model, text_input=prompt, max_tokens=n, exclude_input_in_output=True))
        r = _infer_all_outputs(
            real,
            model,
            dict(text_input=prompt, max_tokens=n, **_neutral_text_inputs(model)),
            ["text_output"] + RESULT_NAMES,
        )
        assert text(r) == plain[model], model  # neutral values change nothing
        for name in RESULT_NAMES:
            assert r.as_numpy(name) is not None, (model, name)
        log_probs = r.as_numpy("output_log_probs").reshape(-1)
        ids = tokenizer(text(r), add_special_tokens=False).input_ids
        assert 0 < len(log_probs) <= n and np.all(log_probs <= 0), model
        assert r.as_numpy("cum_log_probs").reshape(-1)[0] == pytest.approx(float(log_probs.sum()), rel=1e-5)
        assert r.as_numpy("generation_logits").shape[-2:] == (len(log_probs), 512), model
        assert r.as_numpy("context_logits").shape[-1] == 512, model
        arrival, scheduled, first, last = (
            int(r.as_numpy(x).reshape(-1)[0])
            for x in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
        )
        assert 0 < arrival <= scheduled <= first <= last, model
        assert int(r.as_numpy("kv_cache_alloc_total_blocks").reshape(-1)[0]) >= 1
        del ids
    assert plain["ensemble"] == plain["tensorrt_llm_bls"]
    # tensorrt_llm itself, with every optional input at its neutral value
    ids = _ids(real, prompt)
    values = {
        "input_ids": np.array([ids], np.int32),
        "input_lengths": np.array([[len(ids)]], np.int32),
        "request_output_len": np.array([[n]], np.int32),
        "exclude_input_in_output": np.array([[True]]),
        "num_return_sequences": np.array([[1]], np.int32),
        "beam_width": np.array([[1]], np.int32),
        "decoder_input_ids": np.array([[3]], np.int32),
        "decoder_input_lengths": np.array([[1]], np.int32),
        "embedding_bias": np.zeros((1, 0), np.float32),
        "runtime_top_p_decay": np.array([[1.0]], np.float32),
        "runtime_top_p_min": np.array([[1e-6]], np.float32),
        "runtime_top_p_reset_ids": np.array([[-1]], np.int32),
        "len_penalty": np.array([[1.0]], np.float32),
        "early_stopping": np.array([[False]]),
        "beam_search_diversity_rate": np.array([[0.0]], np.float32),
        "repetition_penalty": np.array([[1.0]], np.float32),
        "presence_penalty": np.array([[0.0]], np.float32),
        "frequency_penalty": np.array([[0.0]], np.float32),
        "min_tokens": np.array([[0]], np.int32),
        "stop": np.array([[False]]),
        "streaming": np.array([[False]]),
        "return_log_probs": np.array([[True]]),
        "return_context_logits": np.array([[True]]),
        "return_generation_logits": np.array([[True]]),
        "return_perf_metrics": np.array([[True]]),
        "lora_task_id": np.array([[0]], np.uint64),
        "prompt_vocab_size": np.array([[0]], np.int32),
        "lookahead_window_size": np.array([[0]], np.int32),
        "guided_decoding_guide": np.array([[b""]], object),
        "skip_cross_attn_blocks": np.array([[False]]),
        "retention_decode_priority": np.array([[50]], np.int32),
    }
    r = _infer_all_outputs(real, "tensorrt_llm", values, ["output_ids", "sequence_length"] + RESULT_NAMES)
    got = r.as_numpy("output_ids").reshape(-1)[: int(r.as_numpy("sequence_length").reshape(-1)[0])].tolist()
    assert tokenizer.decode(got, skip_special_tokens=True) == plain["ensemble"]
    assert r.as_numpy("context_logits").shape[-2:] == (len(ids), 512)


UNSUPPORTED = [
    ("ensemble", "beam_width", 2),
    ("ensemble", "lora_task_id", np.array([[5]], np.uint64)),
    ("tensorrt_llm_bls", "guided_decoding_guide", '{"type": "object"}'),
    ("tensorrt_llm_bls", "prompt_vocab_size", 4),
    ("tensorrt_llm_bls", "num_return_sequences", 2),
]


@pytest.mark.parametrize("model,name,value", UNSUPPORTED, ids=[f"{m}-{n}" for m, n, _ in UNSUPPORTED])
def test_real_unsupported_input_is_refused_by_name_then_serves(real, model, name, value):
    with pytest.raises(InferenceServerException) as err:
        infer(real, model, text_input=PROMPTS[0], max_tokens=4, **{name: value})
    assert name in err.value.message(), err.value.message()
    assert text(infer(real, model, text_input=PROMPTS[0], max_tokens=4))


def test_real_greedy_parity_bls_equals_ensemble(real):
    for prompt in PROMPTS:
        control = text(infer(real, "ensemble", text_input=prompt, max_tokens=24, exclude_input_in_output=True))
        spec = text(infer(real, "tensorrt_llm_bls", text_input=prompt, max_tokens=24, exclude_input_in_output=True))
        assert spec == control and control, prompt


def test_real_greedy_parity_with_penalties(real):
    penalties = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2, min_tokens=6)
    changed = 0
    for prompt in PROMPTS[:4]:
        args = dict(text_input=prompt, max_tokens=24, exclude_input_in_output=True)
        plain = text(infer(real, "ensemble", **args))
        control = text(infer(real, "ensemble", **args, **penalties))
        spec = text(infer(real, "tensorrt_llm_bls", **args, **penalties, num_draft_tokens=3))
        assert spec == control, prompt
        changed += control != plain
    assert changed  # the penalties did change some output


def test_real_long_prompt_same_text_on_both_paths(real, tokenizer):
    words = " ".join(["The quick brown fox jumps over the lazy dog."] * 200)
    ids = tokenizer(words, add_special_tokens=True).input_ids[:LONG_PROMPT_TOKENS]
    prompt = tokenizer.decode(ids, skip_special_tokens=True)
    assert 900 <= len(tokenizer(prompt).input_ids) <= 1100
    args = dict(
        text_input=prompt, max_tokens=LONG_OUTPUT, exclude_input_in_output=True, end_id=-1, return_perf_metrics=True
    )
    control = real.infer("ensemble", _inputs(args), client_timeout=900)
    spec = real.infer("tensorrt_llm_bls", _inputs(args), client_timeout=900)
    assert text(spec) == text(control)
    assert len(tokenizer(text(control), add_special_tokens=False).input_ids) >= LONG_OUTPUT // 2


def _scrape_until(client, baseline, done, what: str):
    """Scrape the server's metrics until `done(window since baseline)` holds: waiting for a signal, not for a time
    (the overall bound only keeps a broken server from hanging the suite)."""
    deadline = time.monotonic() + 600
    while True:
        window = reader.scrape(client.metrics_url).minus(baseline)
        if done(window):
            return window
        assert time.monotonic() < deadline, f"the server never showed {what}"
        time.sleep(0.005)


def _longest_output(tokenizer, prompt: str) -> int:
    """The most tokens the real fixture's engine lets `prompt` ask for (max_seq_len minus the prompt)."""
    return REAL_MAX_SEQ_LEN - len(tokenizer(prompt).input_ids)


def test_real_cancelled_long_request_frees_the_instance(real, tokenizer):
    """A client cancels a long BLS request (tritonclient's async_infer(...).cancel(), Triton's gRPC
    cancellation) once the BLS reports it running (its num_requests_running gauge): the BLS sees it within one
    time slice of its draft/target calls (which stop between prefill chunks and tokens) and ends it as a failed
    request after fewer target passes than the whole output needs, so the instance serves the next request.
    The request asks for every token the engine allows (end_id -1): the cancel, sent as soon as the gauge shows
    it, finds nearly all of that work still to do."""
    model = "tensorrt_llm_bls"
    words = " ".join(["Once upon a time there was a little robot."] * 90)
    max_tokens, k = _longest_output(tokenizer, words), 3
    long_request = _inputs(dict(text_input=words, max_tokens=max_tokens, end_id=-1, num_draft_tokens=k))
    before = reader.scrape(real.metrics_url)
    done: queue.Queue = queue.Queue()
    call = real.async_infer(model, long_request, callback=lambda result, error: done.put(error), client_timeout=900)
    _scrape_until(
        real, before, lambda w: w.sum(core_metrics_names.RUNNING.name, model=model) >= 1, "the long request running"
    )
    call.cancel()
    assert isinstance(done.get(timeout=60), InferenceServerException)
    ended = (core_metrics_names.REQUEST_ERRORS.name, core_metrics_names.REQUESTS.name)
    window = _scrape_until(
        real, before, lambda w: sum(w.sum(n, model=model) for n in ended) >= 1, "the cancelled request ending"
    )
    assert window.sum(core_metrics_names.REQUESTS.name, model=model) == 0  # it did not run to its end
    assert window.sum(core_metrics_names.REQUEST_ERRORS.name, model=model) == 1
    assert window.sum(core_metrics_names.RUNNING.name, model=model) == 0
    # each pass emits at most k + 1 tokens: the whole output needs at least max_tokens / (k + 1) passes
    assert window.sum(core_metrics_names.TARGET_PASSES.name, model=model) < max_tokens / (k + 1), window.sum(
        core_metrics_names.TARGET_PASSES.name, model=model
    )
    assert text(infer(real, model, text_input=PROMPTS[0], max_tokens=2))


STOP = dict(input_ids=np.zeros((1, 1), np.int32), input_lengths=0, request_output_len=0, stop=True)


def _stopped_in_log(client, request_id: str) -> list[int]:
    """How many running requests each `stop` for `request_id` ended, from the tensorrt_llm model's log lines."""
    found = re.findall(
        rf"stop for request id '{re.escape(request_id)}': ([0-9]+) running request",
        Path(client.log).read_text(errors="replace"),
    )
    return [int(n) for n in found]


def test_real_cancelled_long_ensemble_request_frees_the_instance(real, tokenizer):
    """The same on the ensemble. Triton 2.51 checks an ensemble request's cancellation only between ensemble
    steps (triton-inference-server/core#263, server#6739), so the running tensorrt_llm step never sees it and
    generates on; with in-flight batching (the default, this fixture) the next request joins the running batch
    instead of waiting behind it: once it is answered, the cancelled request still runs, which a `stop` for its
    id then shows (the ensemble gives its steps its own request id: triton-inference-server/core@r24.10
    src/ensemble_scheduler/ensemble_scheduler.cc:977) and ends. It asks for every token the engine allows."""
    prompt, request_id = "x", "cancelled-ensemble"
    long_request = _inputs(dict(text_input=prompt, max_tokens=_longest_output(tokenizer, prompt), end_id=-1))
    before = reader.scrape(real.metrics_url)
    done: queue.Queue = queue.Queue()
    call = real.async_infer(
        "ensemble",
        long_request,
        request_id=request_id,
        callback=lambda result, error: done.put(error),
        client_timeout=900,
    )
    _scrape_until(
        real,
        before,
        lambda w: w.sum("nv_inference_exec_count", model="tensorrt_llm") >= 1,
        "its tensorrt_llm step running",
    )
    call.cancel()
    assert isinstance(done.get(timeout=60), InferenceServerException)
    assert text(infer(real, "ensemble", text_input=PROMPTS[0], max_tokens=2))
    real.infer("tensorrt_llm", _inputs(STOP), request_id=request_id, client_timeout=60)
    assert _stopped_in_log(real, request_id) == [1], "the next request was answered only after the cancelled one ended"
    # Triton counts the cancelled ensemble request once its steps are done (as a success: they all ran)
    _scrape_until(
        real,
        before,
        lambda w: w.sum("nv_inference_request_success", model="ensemble") >= 2,
        "the cancelled request ending",
    )


DEADLINE = re.compile(r"ran past its server-side deadline.* after ([0-9]+) tokens")


def test_real_server_side_deadline(real, tokenizer):
    """A request's Triton `timeout` stops it while it runs: among deadlines doubling from 1 ms, one ends the
    request with the server's "ran past its server-side deadline ... after N tokens" and N > 0 (it had been
    generating; smaller deadlines may end it before its first token or inside one BLS call). No time of this
    machine is assumed: the sweep finds a deadline that lands inside the run, which asks for every token the
    engine allows."""
    words = " ".join(["Once upon a time there was a little robot."] * 90)
    values = dict(text_input=words, max_tokens=_longest_output(tokenizer, words), end_id=-1)
    for model in ("tensorrt_llm_bls", "ensemble"):
        seen, timeout_us = [], 1000
        while not any(m and int(m.group(1)) > 0 for m in map(DEADLINE.search, seen)):
            with pytest.raises(
                InferenceServerException, match="deadline|[Tt]imeout"
            ) as err:  # never finished: no deadline is too long yet
                real.infer(model, _inputs(values), timeout=timeout_us, client_timeout=900)
            seen.append(err.value.message())
            timeout_us *= 2
        assert text(infer(real, model, text_input=PROMPTS[0], max_tokens=2))


@pytest.mark.parametrize("num_draft_tokens", [None, 0])
def test_real_unary_ttft_is_when_the_first_token_came(real, num_draft_tokens):
    """On the ensemble, and on the BLS when it runs plain tokens in one target call (num_draft_tokens 0):
    TTFT is when the target produced the first token, not when the whole answer was back. Two spans of the
    same request compare: from its scheduling to its first token (the prefill of a 5-token prompt: one engine
    pass) and from the first token to the last (255 more passes); a first token stamped with the whole answer
    puts all the passes in the first span and none in the second."""
    model, extra = ("ensemble", {}) if num_draft_tokens is None else ("tensorrt_llm_bls", {"num_draft_tokens": 0})
    r = infer(real, model, text_input=PROMPTS[0], max_tokens=256, end_id=-1, return_perf_metrics=True, **extra)
    arrival, scheduled, first, last = (
        int(r.as_numpy(x).reshape(-1)[0])
        for x in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
    )
    assert arrival <= scheduled < first < last
    assert first - scheduled < last - first, (arrival, scheduled, first, last)


def test_real_kv_block_counts_agree_on_both_paths(real):
    """The BLS's KV block counts are the request's (its last target call holds the whole sequence), as
    the ensemble's: the same totals for the same prompt and output, not a sum over its rounds."""
    counts = {}
    for model in ("ensemble", "tensorrt_llm_bls"):
        r = infer(real, model, text_input=PROMPTS[1], max_tokens=40, end_id=-1, return_perf_metrics=True)
        counts[model] = [
            int(r.as_numpy(x).reshape(-1)[0])
            for x in ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks")
        ]
        new, reused, total = counts[model]
        assert total >= 1 and new + reused == total
    assert counts["ensemble"][2] == counts["tensorrt_llm_bls"][2], counts


def test_real_stop_request_ends_the_running_request(real):
    """TensorRT-LLM's `stop` input: a second request with the running request's id and stop=true ends it
    (in-flight batching lets both reach the instance); the running request answers normally with the
    tokens it has, the stop request with an empty response. Stops are sent until the running request
    answers (one that arrives before the request is registered stops nothing, and says so in the log); it
    asks for every token the engine allows (end_id -1), so only a stop ends it short of that."""
    long_output = REAL_MAX_SEQ_LEN - 4
    values = dict(
        input_ids=np.array([[5, 6, 7, 8]], np.int32), input_lengths=4, request_output_len=long_output, end_id=-1
    )
    done: queue.Queue = queue.Queue()
    real.async_infer(
        "tensorrt_llm",
        _inputs(values),
        request_id="stop-me",
        callback=lambda result, error: done.put((result, error)),
        client_timeout=900,
    )
    while done.empty():
        answer = real.infer("tensorrt_llm", _inputs(STOP), request_id="stop-me", client_timeout=60)
        assert answer.as_numpy("output_ids").size == 0
    result, error = done.get()
    assert error is None, error
    generated = int(result.as_numpy("sequence_length").reshape(-1)[0]) - 4
    assert 0 <= generated < long_output, generated
    assert 1 in _stopped_in_log(real, "stop-me")  # a stop ended it (one before it was registered finds 0)


def test_wait_ready_returns_only_once_the_metrics_endpoint_answers_too(tmp_path):
    """tritonserver says ready on HTTP before its metrics service listens (40 ms apart in a CI log, where a scrape right
    after wait_ready found the port closed): a stand-in whose metrics port opens only at the third readiness poll."""
    import http.server
    import threading
    import types

    from specdeploy.triton.ports import free_port

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.server.hits.append(self.path)
            if self.path == "/v2/health/ready" and sum(p == self.path for p in self.server.hits) == 3:
                metrics_server.thread.start()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    http_srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    http_srv.hits = []
    metrics_port = free_port()

    class Lazy:  # binds and serves the metrics port only when started
        def __init__(self):
            self.srv = None
            self.thread = threading.Thread(target=self._run, daemon=True)

        def _run(self):
            self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", metrics_port), Handler)
            self.srv.hits = http_srv.hits
            self.srv.serve_forever()

    metrics_server = Lazy()
    threading.Thread(target=http_srv.serve_forever, daemon=True).start()
    state = types.SimpleNamespace(
        http_port=http_srv.server_address[1], metrics_port=metrics_port, log=str(tmp_path / "log")
    )
    fake = types.SimpleNamespace(state=state, alive=lambda: True, stop=lambda: None)
    try:
        server.wait_ready(fake, SERVER_READY_TIMEOUT_S)
        assert (
            http_srv.hits.count("/v2/health/ready") >= 3 and "/metrics" in http_srv.hits
        )  # waited for it, in that order
        assert server.metrics_listening(metrics_port)
    finally:
        http_srv.shutdown()
        if metrics_server.srv is not None:
            metrics_server.srv.shutdown()
