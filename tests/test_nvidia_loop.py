"""NVIDIA's client-orchestrated speculative loop against a REAL tritonserver serving the CPU engines.

tensorrtllm_backend's `e2e_grpc_speculative_decoding_client.py` (run by `tools/inflight_batcher_llm/
speculative_decoding_test.py` without `--execute-bls-speculative-decoding`) drives the models itself: each round
it asks `tensorrt_llm_draft` for k tokens, sends them to `tensorrt_llm` as `draft_input_ids`, and takes the returned
`output_ids` as the next round's input. It has no end-id check of its own: it stops on length, when the target
returns the draft's ids, or when a round returns the ids it was sent (no progress). It therefore depends on the
backend leaving the end token out of `output_ids` (tensorrt_llm.py `_without_end_token`); a backend that returns it
lets the next round generate on past the end of the answer.

`client_speculative` below is our own implementation of that algorithm (not NVIDIA's code), with the same stop
rules; docs/interop.md runs NVIDIA's own client unchanged against the bundled model.

The deployment: a tiny random target, quantized FP8, and the same weights quantized INT8 weight-only as the draft,
so the draft mostly agrees with the target and sometimes does not. Random weights never choose an end token of
their own, so each prompt's end id is a token the target produces a few tokens into its answer: the answer ends
there, well before max_tokens, as a chat answer ends at <|im_end|>.
"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tiny_models import SERVER_READY_TIMEOUT_S

from specdeploy.deploy import backend_stages
from specdeploy.triton import ports, server

pytestmark = pytest.mark.server

MAX_TOKENS = 40
NUM_DRAFT_TOKENS = 4
QUESTIONS = [
    "Tell me a fun fact about octopuses.",
    "Why is the sky blue?",
    "Write a short thank-you note.",
    "What is 2 + 2?",
]


def chat(question: str) -> str:
    """SmolLM2's chat format (its tokenizer's template with the default system turn)."""
    return (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_tokenizer_dir):
    from tiny_models import TINY_QUANT, build_quietly, make_tiny_model

    from specdeploy.recipe.load import parse_recipe

    root = tmp_path_factory.mktemp("nvidia-loop")
    model_dir = root / "target-hf"
    make_tiny_model(model_dir, tiny_tokenizer_dir, seed=0)
    recipe = parse_recipe(
        {
            "name": "nvidia-loop",
            "target": {"model": str(model_dir), "quantization": {**TINY_QUANT, "qformat": "fp8"}},
            "draft": {"model": str(model_dir), "quantization": {**TINY_QUANT, "qformat": "int8_wo"}},
            "speculative": {
                "max_draft_len": NUM_DRAFT_TOKENS,
                "num_draft_tokens": NUM_DRAFT_TOKENS,
                "policy": "static",
            },
            "engine": {"dtype": "bfloat16", "max_batch_size": 2, "max_input_len": 256, "max_seq_len": 320},
            "triton": {"instance_count": 1},
        }
    )
    layout = build_quietly(recipe, root)
    repo, _ = backend_stages.of(recipe).write_repository(recipe, layout)
    srv = server.start(repo, ports.Ports.pick(), root / "tritonserver.log", exit_timeout_s=3)
    try:
        server.wait_ready(srv, SERVER_READY_TIMEOUT_S)
        client = grpcclient.InferenceServerClient(srv.state.grpc_url)
        yield client
        client.close()
    finally:
        srv.stop()
    assert not srv.alive()


# ---------------------------------------------------------------- calls with NVIDIA's tensor names


def _tensor(name, array):
    t = grpcclient.InferInput(
        name, list(array.shape), {np.int32: "INT32", np.object_: "BYTES", np.bool_: "BOOL"}[array.dtype.type]
    )
    t.set_data_from_numpy(array)
    return t


def _infer(client, model, **arrays):
    return client.infer(model, [_tensor(k, v) for k, v in arrays.items()], client_timeout=120)


def _scalar(value):
    return np.array([[value]], dtype=np.int32)


def preprocess(client, prompt, end_id):
    r = _infer(
        client,
        "preprocessing",
        QUERY=np.array([[prompt.encode()]], dtype=object),
        REQUEST_OUTPUT_LEN=_scalar(MAX_TOKENS),
        END_ID=_scalar(end_id),
    )
    return r.as_numpy("INPUT_ID").reshape(-1).tolist()


def llm(client, model, ids, output_len, end_id, draft=None):
    """`model`'s output_ids[:sequence_length] (input echoed: exclude_input_in_output false, the client's default)."""
    arrays = dict(
        input_ids=np.array([ids], np.int32),
        input_lengths=_scalar(len(ids)),
        request_output_len=_scalar(output_len),
        end_id=_scalar(end_id),
    )
    if draft is not None:
        arrays["draft_input_ids"] = np.array([draft], np.int32)
    r = _infer(client, model, **arrays)
    n = int(r.as_numpy("sequence_length").reshape(-1)[0])
    return r.as_numpy("output_ids").reshape(-1)[:n].tolist()


def postprocess(client, ids):
    r = _infer(
        client,
        "postprocessing",
        TOKENS_BATCH=np.array([[ids]], np.int32),
        SEQUENCE_LENGTH=np.array([[len(ids)]], np.int32),
    )
    return r.as_numpy("OUTPUT").reshape(-1)[0].decode()


def client_speculative(client, prompt, end_id, k=NUM_DRAFT_TOKENS):
    """The client-orchestrated loop: (text, generated ids, drafted, accepted). Stops on length, on the target
    returning the draft's own output, or on a round that changed nothing (the sequence ended at end_id)."""
    prompt_ids = preprocess(client, prompt, end_id)
    ids, drafted, accepted = prompt_ids, 0, 0
    while True:
        n = min(k, len(prompt_ids) + MAX_TOKENS - len(ids) - 1)
        draft_out, draft = None, None
        if n > 0:
            draft_out = llm(client, "tensorrt_llm_draft", ids, n, end_id)
            draft = draft_out[len(ids) :]
        out = llm(client, "tensorrt_llm", ids, len(draft) + 1 if draft is not None else 1, end_id, draft)
        new = out[len(ids) :]
        drafted += len(draft or [])
        agreed = 0
        while draft and agreed < min(len(draft), len(new)) and draft[agreed] == new[agreed]:
            agreed += 1
        accepted += agreed
        last, ids = ids, out
        if len(ids) >= len(prompt_ids) + MAX_TOKENS or ids == draft_out or ids == last:
            break
    return postprocess(client, ids), ids[len(prompt_ids) :], drafted, accepted


def control(client, prompt, end_id):
    """The target alone: (text through the ensemble, the target's generated ids)."""
    r = _infer(
        client,
        "ensemble",
        text_input=np.array([[prompt.encode()]], dtype=object),
        max_tokens=_scalar(MAX_TOKENS),
        end_id=_scalar(end_id),
        exclude_input_in_output=np.array([[False]]),
    )
    prompt_ids = preprocess(client, prompt, end_id)
    return (
        r.as_numpy("text_output").reshape(-1)[0].decode(),
        llm(client, "tensorrt_llm", prompt_ids, MAX_TOKENS, end_id)[len(prompt_ids) :],
    )


def ending_token(client, prompt) -> int:
    """A token the target generates 4..12 tokens into its answer and not before: with it as end_id the answer ends
    there. (-1: no end id.)"""
    prompt_ids = preprocess(client, prompt, -1)
    greedy = llm(client, "tensorrt_llm", prompt_ids, MAX_TOKENS, -1)[len(prompt_ids) :]
    for i in range(4, 13):
        if greedy[i] not in greedy[:i] and greedy[i] not in prompt_ids[-4:]:
            return int(greedy[i])
    pytest.fail(f"no fresh token 4..12 tokens into {greedy}")


def test_the_client_orchestrated_loop_equals_the_control_on_answers_that_end(served):
    drafted = accepted = 0
    for question in QUESTIONS:
        prompt = chat(question)
        end_id = ending_token(served, prompt)
        control_text, control_ids = control(served, prompt, end_id)
        assert end_id not in control_ids and 4 <= len(control_ids) < MAX_TOKENS  # the answer ended at end_id
        text, ids, d, a = client_speculative(served, prompt, end_id)
        assert ids == control_ids, question
        assert text == control_text, question
        drafted, accepted = drafted + d, accepted + a
    assert drafted > 0 and 0 < accepted <= drafted  # drafts were proposed and some accepted


def test_the_bls_loop_equals_the_control_on_answers_that_end(served):
    for question in QUESTIONS[:2]:
        prompt = chat(question)
        end_id = ending_token(served, prompt)
        control_text, _ = control(served, prompt, end_id)
        r = _infer(
            served,
            "tensorrt_llm_bls",
            text_input=np.array([[prompt.encode()]], dtype=object),
            max_tokens=_scalar(MAX_TOKENS),
            end_id=_scalar(end_id),
            num_draft_tokens=_scalar(NUM_DRAFT_TOKENS),
            return_perf_metrics=np.array([[True]]),
            exclude_input_in_output=np.array([[False]]),
        )
        assert r.as_numpy("text_output").reshape(-1)[0].decode() == control_text, question
        assert int(r.as_numpy("total_draft_tokens").reshape(-1)[0]) > 0
