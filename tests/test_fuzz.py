"""bench/fuzz.py as a test: a short seeded fuzz against the REAL server and the OpenAI front, and the bugs it found.

The fuzz sends malformed requests to every model of the session's served repository (`ops_decoupled` in
conftest.py) and to the front's routes; afterwards the server and the front must be live, no known-good request
may have changed its answer, and every refusal must carry a message.
"""

from __future__ import annotations

import http.client
import json
import math

import bench_modules
import numpy as np
import pytest

from specdeploy.core.errors import ConfigError
from specdeploy.ops.openai import api as openai_api
from specdeploy.ops.openai import app, requests


def _fuzz_module():
    return bench_modules.load("fuzz")


@pytest.mark.server
def test_short_seeded_fuzz_keeps_server_and_front_whole(ops_decoupled):
    from specdeploy.triton.ports import free_port

    fuzz = _fuzz_module()
    recipe, layout, srv = ops_decoupled
    front = openai_api.build_front(recipe, layout, srv.state.grpc_url, timeout_s=60)
    lines = []
    with openai_api.ApiServer(app.create_app(front), free_port()) as api:
        report = fuzz.run_fuzz(
            srv.state.grpc_url, api.url[: -len("/v1")], seed=7, count=150, batch=50, timeout_s=60, echo=lines.append
        )
    assert report["cases"] == 150 and report["sent"] >= 140  # a few cases the client library refuses to serialize
    assert fuzz.failed(report) == [], report["findings"]
    assert set(report["models"]) >= {
        "ensemble",
        "tensorrt_llm_bls",
        "tensorrt_llm",
        "tensorrt_llm_draft",
        "preprocessing",
        "postprocessing",
    }
    assert report["crashes"] == 0 and report["good_lost"] == 0, report["findings"]
    assert report["good_checks"] == 3 * 3  # ensemble, BLS and the front after each of the 3 batches
    assert report["server_live"] and report["front_live"]
    assert report["unnamed"] == 0 and all(m.strip() for m in report["refusals"].values())
    assert report["faults"] == 0 and report["timeouts"] == 0, report["findings"]
    assert report["named"] > 50 and report["served"] > 0  # the mix reached both outcomes
    assert report["sent"] == sum(report[k] for k in ("served", "named", "unnamed", "faults", "timeouts", "crashes"))


def _toy_models(fuzz):
    declared = (
        fuzz.Declared("text_input", "STRING", (1,), False),
        fuzz.Declared("max_tokens", "INT32", (1,), False),
        fuzz.Declared("temperature", "FP32", (1,), True),
        fuzz.Declared("num_draft_tokens", "INT32", (1,), True),
        fuzz.Declared("beam_width", "INT32", (1,), True),
        fuzz.Declared("stop_words", "STRING", (-1,), True),
    )
    bls = fuzz.Model("tensorrt_llm_bls", declared, True, True)
    return [bls, fuzz.Model("postprocessing", declared[:2], True, False)]


def test_generated_cases_are_seeded_and_reach_every_declared_input_and_field():
    from specdeploy.ops.openai.requests import FIELDS

    fuzz = _fuzz_module()
    models = _toy_models(fuzz)
    run = list(fuzz.cases(models, "r", seed=3, count=3000))
    again = fuzz.cases(models, "r", seed=3, count=200)
    assert [c[1][0] for c in run[:200]] == [c[1][0] for c in again]  # case i from (seed, i) alone
    assert [c[1][0] for c in run[:50]] != [c[1][0] for c in fuzz.cases(models, "r", seed=4, count=50)]
    names = " ".join(c[1][0] for c in run)
    for m in models:
        for d in m.inputs:
            for kind in ("dtype", "shape", "value"):
                assert f"{kind}:{m.name}.{d.name}" in names, (kind, m.name, d.name)
    assert all(f"{k}:tensorrt_llm_bls" in names for k in ("draft_conflict", "beam", "duplicate_id", "unknown_input"))
    assert "+" in names  # several inputs or fields changed at once
    for key, spec in FIELDS.items():
        assert f"field_{key}" in names, key
    bodies = b" ".join(c[1][3] or b"" for c in run if c[0] == "openai")
    for marker in (b"\\ud800", b"\\u0000", b"x" * 4097, b"[" * 17):  # a lone surrogate, NUL, one past a limit, too deep
        assert marker in bodies, marker
    tensors = [v for c in run if c[0] == "triton" for v in c[1][2].values() if v.dtype == object]
    assert any(b"\xed\xa0\x80" in bytes(x) for t in tensors for x in t.reshape(-1)[:1])  # a surrogate's bytes over gRPC


def test_a_fault_or_a_dead_part_fails_the_run():
    fuzz = _fuzz_module()
    clean = {"faults": 0, "timeouts": 0, "crashes": 0, "good_lost": 0, "unnamed": 0}
    clean.update(server_live=True, front_live=True)
    assert fuzz.failed(clean) == []
    assert fuzz.failed({**clean, "faults": 1}) == ["1 faults"]
    assert fuzz.failed({**clean, "front_live": False}) == ["front not live at the end"]
    assert fuzz.failed({**clean, "front_live": None}) == []  # no front in the run
    assert fuzz.PYTHON_FAULT.search("internal error: UnicodeEncodeError: 'utf-8' codec can't encode")
    assert not fuzz.PYTHON_FAULT.search("'stop' is not valid Unicode text (a lone surrogate U+D800 at character 0)")


# ---------------------------------------------------------------- what the fuzz found, each pinned without the fuzz


def test_nan_or_infinite_temperature_is_refused_before_sampling():
    """A NaN temperature reached torch.multinomial in the engine ("probability tensor contains inf, nan")."""
    from specdeploy.speculation.sampling import SamplingParams

    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ConfigError, match="temperature is"):
            SamplingParams(temperature=bad)
    assert SamplingParams(temperature=0.0).temperature == 0.0


def _parse(body):
    from specdeploy.recipe.load import parse_recipe

    recipe = parse_recipe({"name": "r", "target": {"model": "x"}, "draft": {"model": "x"}})
    return requests.parse_job(body, False, requests.routes(recipe), None, 16, 319)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("temperature", math.nan, "finite"),
        ("top_p", math.nan, "finite"),
        ("temperature", math.inf, "finite"),
        ("seed", 2**70, "must be in"),
        ("prompt", "a \ud800 b", "not valid Unicode"),
        ("stop", 5, "'stop' must be a string or a list"),
    ],
)
def test_front_refuses_values_that_failed_deeper_down(field, value, words):
    """Each was a 500 (NaN sampling, OverflowError packing a UINT64 seed, UnicodeEncodeError sending the prompt,
    TypeError iterating a number as the stop list)."""
    with pytest.raises(requests.ApiError) as info:
        _parse({"model": "r", "prompt": "hi", field: value})
    assert info.value.status == 400 and info.value.param == field and words in info.value.message


def test_front_refuses_json_nested_too_deeply_with_400():
    """json.loads raises RecursionError (not a ValueError) on deep nesting: it was a 500."""
    from specdeploy.triton.ports import free_port

    front = app.Front(None, None, {}, 16, 3, 5.0)  # the body is refused before any model is asked
    with openai_api.ApiServer(app.create_app(front), free_port()) as api:
        conn = http.client.HTTPConnection(f"127.0.0.1:{api.port}", timeout=30)
        conn.request(
            "POST",
            "/v1/completions",
            body=b"[" * 200_000 + b"]" * 200_000,
            headers={"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        data = json.loads(response.read())
        conn.close()
    assert response.status == 400 and "too deeply" in data["error"]["message"]


def test_unknown_paths_and_methods_answer_in_openai_error_format():
    """FastAPI's own 404/405 bodies were {"detail": ...}: OpenAI clients found no error message in them."""
    from specdeploy.triton.ports import free_port

    front = app.Front(None, None, {}, 16, 3, 5.0)
    with openai_api.ApiServer(app.create_app(front), free_port()) as api:
        for method, path, status in (
            ("GET", "/v1/nope", 404),
            ("POST", "/v1/models", 405),
            ("GET", "/v1/completions", 405),
        ):
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
        for name, array in (
            ("TOKENS_BATCH", np.array(tokens, dtype=np.int32)),
            ("SEQUENCE_LENGTH", np.array(lengths, dtype=np.int32)),
        ):
            t = grpcclient.InferInput(name, list(array.shape), "INT32")
            t.set_data_from_numpy(array)
            inputs.append(t)
        return client.infer("postprocessing", inputs, client_timeout=60)

    for tokens, lengths, words in (
        ([[[5, -1, 7]]], [[3]], "token id -1; token ids are >= 0"),
        ([[[5, -(2**31)]]], [[2]], f"token id {-(2**31)}; token ids are >= 0"),
        ([[[5, 6, 7]]], [[4]], "SEQUENCE_LENGTH 4 is outside [0, 3]"),
        ([[[5, 6, 7]]], [[3, 3]], "SEQUENCE_LENGTH has 2 values"),
    ):
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
        assert (
            f"num_return_sequences is {n}, above this model's max_batch_size {recipe.engine.max_batch_size}" in message
        )
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


@pytest.mark.server
def test_a_bad_text_gets_the_same_rule_over_grpc_and_over_the_front(ops_decoupled):
    """text_rules is the one boundary: a lone surrogate (its bytes over gRPC, where only bytes travel), a NUL and an
    oversize text are refused by the same rule on both sides, the field or input named; never a 500."""
    from specdeploy.core.text_rules import MAX_SHORT_BYTES
    from specdeploy.triton.ports import free_port

    fuzz = _fuzz_module()
    recipe, layout, srv = ops_decoupled
    triton = fuzz.Triton(srv.state.grpc_url, 60)
    bls = next(m for m in fuzz.discover(triton.client) if m.name == "tensorrt_llm_bls")
    front = openai_api.build_front(recipe, layout, srv.state.grpc_url, timeout_s=60)
    with openai_api.ApiServer(app.create_app(front), free_port()) as api:
        http = fuzz.Front(api.url[: -len("/v1")], None, 60)
        for text, rule in (("\ud800", "invalid_text"), ("a\x00b", "nul"), ("x" * (MAX_SHORT_BYTES + 1), "oversize")):
            body = {"model": recipe.name, "prompt": "hi", "max_tokens": 2, "stop": [text]}
            status, data = http.request("POST", "/v1/completions", json.dumps(body).encode())
            assert status == 400 and data["error"]["code"] == rule and data["error"]["param"] == "stop", data
            assert "'stop[0]'" in data["error"]["message"]
            words = np.array([[text.encode("utf-8", "surrogatepass")]], dtype=object)
            outcome, message = triton.send(bls, {**fuzz._base(bls), "stop_words": words})
            assert outcome == "named" and "input 'stop_words' " in message and f"(rule {rule})" in message, message


@pytest.mark.server
def test_preprocessing_without_a_required_input_is_refused_naming_it(ops_decoupled):
    """QUERY or REQUEST_OUTPUT_LEN missing, an optional input sent in its place, reached the model (Triton let it
    through): an AttributeError / TypeError traceback as the error text; the 10,000-case run found both."""
    fuzz = _fuzz_module()
    _, _, srv = ops_decoupled
    triton = fuzz.Triton(srv.state.grpc_url, 60)
    model = next(m for m in fuzz.discover(triton.client) if m.name == "preprocessing")
    for missing, words in (
        ("QUERY", "input 'QUERY' is required"),
        ("REQUEST_OUTPUT_LEN", "input 'REQUEST_OUTPUT_LEN' (max_tokens) is required"),
    ):
        inputs = {**fuzz._base(model), "END_ID": np.array([[2]], dtype=np.int32)}
        del inputs[missing]
        outcome, message = triton.send(model, inputs)
        assert outcome == "named" and words in message, (outcome, message)
