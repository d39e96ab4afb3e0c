"""bench/fuzz.py as a test: a short seeded fuzz against the REAL server and the OpenAI front, and the bugs it found.

The fuzz sends malformed requests to every model of the session's served repository (`ops_decoupled` in
conftest.py) and to the front's routes; afterwards the server and the front must be live, no known-good request
may have changed its answer, and every refusal must carry a message.
"""

from __future__ import annotations

import http.client
import json
import math

import numpy as np
import pytest

import bench_modules
from specdeploy import openai_api
from specdeploy.errors import ConfigError


def _fuzz_module():
    return bench_modules.load("fuzz")


@pytest.mark.server
def test_short_seeded_fuzz_keeps_server_and_front_whole(ops_decoupled):
    from specdeploy.triton.server import free_port

    fuzz = _fuzz_module()
    recipe, layout, srv = ops_decoupled
    front = openai_api.build_front(recipe, layout, srv.state.grpc_url, timeout_s=60)
    lines = []
    with openai_api.ApiServer(openai_api.create_app(front), free_port()) as api:
        report = fuzz.run_fuzz(srv.state.grpc_url, api.url[: -len("/v1")], seed=7, count=150, batch=50, timeout_s=60, echo=lines.append)
    assert report["cases"] == 150 and report["sent"] >= 140  # a few cases the client library refuses to serialize
    assert set(report["models"]) >= {"ensemble", "tensorrt_llm_bls", "tensorrt_llm", "tensorrt_llm_draft", "preprocessing", "postprocessing"}
    assert report["crashes"] == 0 and report["good_lost"] == 0, report["findings"]
    assert report["good_checks"] == 3 * 3  # ensemble, BLS and the front after each of the 3 batches
    assert report["server_live"] and report["front_live"]
    assert report["unnamed"] == 0 and all(m.strip() for m in report["refusals"].values())
    assert report["faults"] == 0 and report["timeouts"] == 0, report["findings"]
    assert report["named"] > 50 and report["served"] > 0  # the mix reached both outcomes
    assert report["sent"] == sum(report[k] for k in ("served", "named", "unnamed", "faults", "timeouts", "crashes"))


def test_fuzz_cases_cover_every_declared_input_and_the_conflicts():
    fuzz = _fuzz_module()
    declared = (fuzz.Declared("text_input", "STRING", (1,), False), fuzz.Declared("max_tokens", "INT32", (1,), False),
                fuzz.Declared("temperature", "FP32", (1,), True), fuzz.Declared("num_draft_tokens", "INT32", (1,), True),
                fuzz.Declared("beam_width", "INT32", (1,), True))  # fmt: skip
    model = fuzz.Model("tensorrt_llm_bls", declared, True, True)
    names = [c[0] for c in fuzz.triton_cases([model])]
    for d in declared:
        assert {f"{k}:tensorrt_llm_bls.{d.name}" for k in ("wrong_dtype", "wrong_shape", "empty", "huge")} <= set(names)
    assert {"nan:tensorrt_llm_bls.temperature", "bad_utf8:tensorrt_llm_bls.text_input", "big_string:tensorrt_llm_bls.text_input",
            "int_max:tensorrt_llm_bls.max_tokens", "missing:tensorrt_llm_bls.max_tokens", "num_draft_tokens_past_max:tensorrt_llm_bls",
            "beam_width_2:tensorrt_llm_bls", "duplicate_request_id:tensorrt_llm_bls"} <= set(names)  # fmt: skip
    base = fuzz._base(model)
    assert base["text_input"].shape == (1, 1) and base["num_draft_tokens"].dtype == np.int32
    huge = fuzz._mutate(model, declared[0], "big_string")["text_input"]
    assert len(huge.reshape(-1)[0]) == 1 << 20
    assert fuzz._mutate(model, declared[2], "nan")["temperature"].dtype == np.float32
    assert "max_tokens" not in fuzz._mutate(model, declared[1], "missing")


# ---------------------------------------------------------------- what the fuzz found, each pinned without the fuzz


def test_nan_or_infinite_temperature_is_refused_before_sampling():
    """A NaN temperature reached torch.multinomial in the engine ("probability tensor contains inf, nan")."""
    from specdeploy.speculative import SamplingParams

    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ConfigError, match="temperature is"):
            SamplingParams(temperature=bad)
    assert SamplingParams(temperature=0.0).temperature == 0.0


def _parse(body):
    from specdeploy.config_loader import parse_recipe

    recipe = parse_recipe({"name": "r", "target": {"model": "x"}, "draft": {"model": "x"}})
    return openai_api.parse_job(body, False, openai_api.routes(recipe), None, 16, 319)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("temperature", math.nan, "finite"),
    ("top_p", math.nan, "finite"),
    ("temperature", math.inf, "finite"),
    ("seed", 2**70, "must be in"),
    ("prompt", "a \ud800 b", "not valid Unicode"),
    ("stop", 5, "'stop' must be a string or a list"),
])  # fmt: skip
def test_front_refuses_values_that_failed_deeper_down(field, value, words):
    """Each was a 500 (NaN sampling, OverflowError packing a UINT64 seed, UnicodeEncodeError sending the prompt,
    TypeError iterating a number as the stop list)."""
    with pytest.raises(openai_api.ApiError) as info:
        _parse({"model": "r", "prompt": "hi", field: value})
    assert info.value.status == 400 and info.value.param == field and words in info.value.message


def test_front_refuses_json_nested_too_deeply_with_400():
    """json.loads raises RecursionError (not a ValueError) on deep nesting: it was a 500."""
    from specdeploy.triton.server import free_port

    front = openai_api.Front(None, None, {}, 16, 3, 5.0)  # the body is refused before any model is asked
    with openai_api.ApiServer(openai_api.create_app(front), free_port()) as api:
        conn = http.client.HTTPConnection(f"127.0.0.1:{api.port}", timeout=30)
        conn.request("POST", "/v1/completions", body=b"[" * 200_000 + b"]" * 200_000, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = json.loads(response.read())
        conn.close()
    assert response.status == 400 and "too deeply" in data["error"]["message"]


def test_unknown_paths_and_methods_answer_in_openai_error_format():
    """FastAPI's own 404/405 bodies were {"detail": ...}: OpenAI clients found no error message in them."""
    from specdeploy.triton.server import free_port

    front = openai_api.Front(None, None, {}, 16, 3, 5.0)
    with openai_api.ApiServer(openai_api.create_app(front), free_port()) as api:
        for method, path, status in (("GET", "/v1/nope", 404), ("POST", "/v1/models", 405), ("GET", "/v1/completions", 405)):
            conn = http.client.HTTPConnection(f"127.0.0.1:{api.port}", timeout=30)
            conn.request(method, path)
            response = conn.getresponse()
            error = json.loads(response.read())["error"]
            conn.close()
            assert response.status == status and path in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.server
def test_postprocessing_refuses_ids_and_lengths_it_cannot_decode(ops_decoupled):
    """Negative ids and a SEQUENCE_LENGTH past the tokens were Python tracebacks (OverflowError from the
    tokenizer, IndexError); now they are errors naming the tensor and the range."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    _, _, srv = ops_decoupled
    client = grpcclient.InferenceServerClient(srv.state.grpc_url)

    def send(tokens, lengths):
        inputs = []
        for name, array in (("TOKENS_BATCH", np.array(tokens, dtype=np.int32)), ("SEQUENCE_LENGTH", np.array(lengths, dtype=np.int32))):
            t = grpcclient.InferInput(name, list(array.shape), "INT32")
            t.set_data_from_numpy(array)
            inputs.append(t)
        return client.infer("postprocessing", inputs, client_timeout=60)

    for tokens, lengths, words in (([[[5, -1, 7]]], [[3]], "token id -1; token ids are >= 0"),
                                   ([[[5, -(2**31)]]], [[2]], f"token id {-(2**31)}; token ids are >= 0"),
                                   ([[[5, 6, 7]]], [[4]], "SEQUENCE_LENGTH 4 is outside [0, 3]"),
                                   ([[[5, 6, 7]]], [[3, 3]], "SEQUENCE_LENGTH has 2 values")):  # fmt: skip
        with pytest.raises(InferenceServerException) as info:
            send(tokens, lengths)
        assert words in info.value.message() and "Traceback" not in info.value.message()
    assert send([[[5, 6, 7]]], [[2]]).as_numpy("OUTPUT").shape == (1,)  # still decodes what it can
    assert send([[[5, 2**31 - 1]]], [[2]]).as_numpy("OUTPUT").shape == (1,)  # past the vocabulary: decodes to nothing
    client.close()


@pytest.mark.server
def test_num_return_sequences_is_bounded_by_max_batch_size(ops_decoupled):
    """INT32_MAX sequences in one request held the target for good (every later request timed out)."""
    fuzz = _fuzz_module()
    recipe, _, srv = ops_decoupled
    triton = fuzz.Triton(srv.state.grpc_url, 60)
    model = next(m for m in fuzz.discover(triton.client) if m.name == "ensemble")
    for n in (2**31 - 1, recipe.engine.max_batch_size + 1):
        inputs = {**fuzz._base(model), "num_return_sequences": np.array([[n]], dtype=np.int32)}
        outcome, message = triton.send(model, inputs)
        assert outcome == "named", (outcome, message)
        assert f"num_return_sequences is {n}, above this model's max_batch_size {recipe.engine.max_batch_size}" in message
    inputs = {**fuzz._base(model), "num_return_sequences": np.array([[2]], dtype=np.int32)}
    outcome, got = triton.send(model, inputs, outputs=["text_output"])
    assert outcome == "served" and got  # within the bound it is served


@pytest.mark.server
def test_target_without_request_output_len_is_answered_not_left_waiting(ops_decoupled):
    """A missing request_output_len raised a TypeError in the request's thread: no response ever came."""
    fuzz = _fuzz_module()
    _, _, srv = ops_decoupled
    triton = fuzz.Triton(srv.state.grpc_url, 60)
    model = next(m for m in fuzz.discover(triton.client) if m.name == "tensorrt_llm")
    inputs = fuzz._base(model)
    del inputs["request_output_len"]
    outcome, message = triton.send(model, inputs)
    assert outcome == "named" and "input request_output_len (max_tokens) is required" in message, (outcome, message)
