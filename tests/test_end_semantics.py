"""End-token and stop semantics of the CPU `tensorrt_llm` model, its BLS and the n-gram draft, as TensorRT-LLM's.

The sources behind each rule are cited where it is encoded (tensorrt_llm.py `_without_end_token`,
bls_calls.py `ended_at_end_id`). Here the model file runs outside a stub (a stand-in for
triton_python_backend_utils) over the real Executor and a bigram engine whose greedy chain is known:
1 -> 2 -> 3 -> ... (token t is followed by t + 1), so every expected value is written down, not computed by the
code under test.
"""

from __future__ import annotations

import importlib
import json
import sys
import types

import numpy as np
import pytest
import torch
from standin_engines import TableEngine

from specdeploy.engine.executor import Executor

VOCAB = 16
END = 5  # the chain from 1 reaches the end id after 2, 3, 4


def chain_table() -> torch.Tensor:
    """Logits [vocab, vocab]: after t the most likely token is t + 1 (mod vocab), with distinct runner-ups."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(VOCAB, VOCAB, generator=g)
    for t in range(VOCAB):
        table[t, (t + 1) % VOCAB] = 8.0
    return table


def load_chain_executor(_engine_dir: str):
    # normalize_log_probs false: greedy tokens get the log-softmax of their row (normalized, they would all be 0)
    return Executor(
        TableEngine(chain_table(), max_seq_len=64, max_draft_len=8), max_cached_sequences=2, normalize_log_probs=False
    )


class _Tensor:
    def __init__(self, name, value):
        self._name, self._value = name, np.asarray(value)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._value


class _Response:
    def __init__(self, output_tensors=None, error=None):
        self.tensors = {t.name(): t.as_numpy() for t in output_tensors or []}
        self.error = error


class _Request:
    def __init__(self, **inputs):
        self._inputs = [_Tensor(k, v) for k, v in inputs.items()]

    def inputs(self):
        return self._inputs

    def request_id(self):
        return "1"

    def is_cancelled(self):
        return False

    def timeout(self):
        return 0


@pytest.fixture
def pb_utils(monkeypatch):
    stand_in = types.SimpleNamespace(
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=1,
        Tensor=_Tensor,
        InferenceResponse=_Response,
        TritonError=lambda message: message,
    )
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stand_in)
    return stand_in


def _load(name, monkeypatch, request):
    module_name = f"specdeploy.triton.models.{name}"
    monkeypatch.delitem(sys.modules, module_name, raising=False)
    request.addfinalizer(lambda: sys.modules.pop(module_name, None))  # not left bound to the stand-in
    return importlib.import_module(module_name)


@pytest.fixture
def model(pb_utils, monkeypatch, request):
    module = _load("tensorrt_llm", monkeypatch, request)
    instance = module.TritonPythonModel()
    params = {
        "executor_factory": f"{__name__}:load_chain_executor",
        "gpt_model_path": "unused",
        "max_seq_len": "64",
        "max_draft_len": "8",
    }
    config = {"parameters": {k: {"string_value": v} for k, v in params.items()}, "max_batch_size": 1}
    instance.initialize({"model_name": "tensorrt_llm", "model_config": json.dumps(config)})
    yield instance
    instance.finalize()


def call(model, input_ids, output_len, **extra):
    """One request: (generated ids, the response's outputs). input_ids are sent and echoed as TensorRT-LLM does
    (exclude_input_in_output false): the generated ids are what follows them."""
    inputs = {
        "input_ids": np.array([input_ids], np.int32),
        "input_lengths": np.array([[len(input_ids)]], np.int32),
        "request_output_len": np.array([[output_len]], np.int32),
        "end_id": np.array([[END]], np.int32),
        "return_log_probs": np.array([[True]]),
        "return_generation_logits": np.array([[True]]),
    }
    for key, value in extra.items():
        inputs[key] = np.asarray(value)
    (response,) = model.execute([_Request(**inputs)])
    assert response.error is None, response.error
    out = response.tensors
    ids = out["output_ids"].reshape(-1).tolist()
    assert out["sequence_length"].reshape(-1).tolist() == [len(ids)]  # sequence_length counts output_ids
    assert ids[: len(input_ids)] == list(input_ids)
    return ids[len(input_ids) :], out


def log_prob(previous: int, token: int) -> float:
    return float(torch.log_softmax(chain_table()[previous], -1)[token])


def test_an_answer_that_ends_at_end_id_leaves_the_end_token_out(model):
    generated, out = call(model, [1], 10)
    assert generated == [2, 3, 4]
    log_probs = out["output_log_probs"].reshape(-1).tolist()
    assert log_probs == pytest.approx(
        [log_prob(1, 2), log_prob(2, 3), log_prob(3, 4)], abs=1e-5
    )  # none for the end token
    # cum_log_probs still adds the end token's (TensorRT-LLM adds it before it checks for the end id)
    expected_cum = sum(log_probs) + log_prob(4, END)
    assert float(out["cum_log_probs"].reshape(-1)[0]) == pytest.approx(expected_cum, abs=1e-4)
    assert out["generation_logits"].shape[2] == 4  # a row per decoding step, the end id's step included


def test_the_end_id_inside_accepted_drafts_ends_the_output_before_it(model):
    """Drafts 2 3 4 END 6: the target agrees with all of them (and would go on with 7), but the sequence ends at
    the end id: output 2 3 4, and the accepted draft after the end id is dropped."""
    generated, _ = call(model, [1], 6, draft_input_ids=np.array([[2, 3, 4, END, 6]], np.int32))
    assert generated == [2, 3, 4]
    # the target's own token is the end id: the same
    generated, _ = call(model, [1], 4, draft_input_ids=np.array([[2, 3, 4]], np.int32))
    assert generated == [2, 3, 4]
    # a rejected draft before the end id: the accepted prefix plus the target's own token, as always
    generated, _ = call(model, [1], 4, draft_input_ids=np.array([[2, 9, 4]], np.int32))
    assert generated == [2, 3]


def test_a_call_on_a_sequence_that_already_ended_generates_on(model):
    """The input is not examined for the end id: NVIDIA's client loop sends the same ids again after an end, and
    the target's first token is the end id again, so the call returns no new token (its stop signal)."""
    generated, _ = call(model, [1, 2, 3, 4, END], 3)
    assert generated == [6, 7, 8]
    generated, _ = call(model, [1, 2, 3, 4], 3)
    assert generated == []  # ends at once: no token, output_ids == input_ids
    generated, _ = call(model, [1, 2, 3, 4], 3, draft_input_ids=np.array([[END, 6]], np.int32))
    assert generated == []


def test_a_stop_word_stays_in_the_output(model):
    stop_words = np.array([[[3, 4], [2, -1]]], np.int32)  # [batch, 2, len]: the ids, then the offsets
    generated, _ = call(model, [1], 10, stop_words_list=stop_words)
    assert generated == [2, 3, 4]
    generated, _ = call(
        model, [1], 6, stop_words_list=stop_words, draft_input_ids=np.array([[2, 3, 4, END, 6]], np.int32)
    )
    assert generated == [2, 3, 4]
    generated, _ = call(model, [7], 10, stop_words_list=np.array([[[9], [1]]], np.int32))
    assert generated == [8, 9]


def test_max_tokens_keeps_every_token_and_an_end_at_the_limit_is_still_left_out(model):
    generated, _ = call(model, [1], 2)
    assert generated == [2, 3]
    generated, _ = call(model, [1], 4)
    assert generated == [2, 3, 4]  # the 4th token is the end id
    generated, _ = call(model, [7], 3, draft_input_ids=np.array([[8, 9, 10, 11]], np.int32))
    assert generated == [8, 9, 10]  # request_output_len caps the accepted drafts


def test_without_end_id_the_end_token_is_an_ordinary_token(model):
    generated, _ = call(model, [1], 5, end_id=np.array([[-1]], np.int32))
    assert generated == [2, 3, 4, 5, 6]


def test_the_final_chunk_loses_only_a_final_end_token(pb_utils, monkeypatch, request):
    """Per chunk (streaming sends one per token): only the last chunk of a sequence that ended at the end id
    changes; its end token's log prob is handed back for cum_log_probs."""
    from specdeploy.engine.request import GenerationChunk

    module = _load("tensorrt_llm", monkeypatch, request)
    final = GenerationChunk(token_ids=[3, END], finished=True, finish_reason="end_id")
    kept, dropped = module._without_end_token(final, END, [-0.25, -0.75])
    assert kept.token_ids == [3] and kept.log_probs == [-0.25] and dropped == -0.75
    for chunk in (
        GenerationChunk(token_ids=[END]),
        GenerationChunk(token_ids=[3, END], finished=True, finish_reason="length"),
    ):
        kept, dropped = module._without_end_token(chunk, END, None)
        assert kept.token_ids == chunk.token_ids and dropped == 0.0


# ---------------------------------------------------------------- the BLS reads the end from a short answer


@pytest.fixture
def bls(pb_utils, monkeypatch, request):
    return _load("bls_calls", monkeypatch, request)


@pytest.mark.parametrize(
    "draft, returned, requested, ended",
    [
        ([2, 3, 4], [2, 3, 4, 5], 4, False),  # all accepted + own token
        ([2, 9, 4], [2, 3], 4, False),  # rejected at 1: prefix + own token
        ([2, 3, 4], [2, 3, 4], 4, True),  # all accepted, the own token was the end id
        ([2, END, 6], [2], 4, True),  # the end id among the accepted drafts
        ([9, 9], [], 3, True),  # the end id was the target's first token
        ([], [2, 3], 5, True),  # a plain run shorter than asked
        ([], [2, 3, 4, 5, 6], 5, False),
        ([], [2, 3], 2, False),
    ],
)
def test_the_bls_reads_an_end_from_what_the_target_returned(bls, draft, returned, requested, ended):
    assert bls.ended_at_end_id([1], draft, returned, requested, END, []) is ended
    assert bls.ended_at_end_id([1], draft, returned, requested, None, []) is False  # no end id asked: never


def test_a_stop_word_explains_a_short_answer(bls):
    assert bls.ended_at_end_id([1], [2, 3, 4], [2, 3], 4, END, [[3]]) is False
    assert bls.ended_at_end_id([1, 2], [], [3], 4, END, [[2, 3]]) is False  # a stop word begun in the input
    assert bls.ended_at_end_id([1], [2, 3, 4], [2, 3], 4, END, [[7]]) is True


def test_a_draft_that_ended_gives_logits_only_for_its_tokens(bls):
    class Call:
        def __call__(self, *args, **kwargs):
            return [2, 3], torch.zeros(3, VOCAB), {}  # 2 tokens, 3 rows (the end id's step)

    job = {
        "bad_words_list": np.zeros((2, 1), np.int32),
        "penalties": {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0},
        "embedding_bias": None,
        "end_id": END,
        "prompt_ids": [1],
    }
    proposal = bls.TritonProposer(Call(), job).propose([1], 4, None, True)
    assert proposal.tokens == [2, 3] and tuple(proposal.logits.shape) == (2, VOCAB)


def test_nvidias_client_loop_stops_at_the_end_of_the_answer(model):
    """The client-orchestrated loop (tests/test_nvidia_loop.py `client_speculative`, here in process, the model as
    its own draft) stops on a round that changed nothing: that is the end, only when output_ids hold no end token."""
    prompt, max_tokens, k = [1], 12, 2
    ids = prompt
    while True:
        n = min(k, len(prompt) + max_tokens - len(ids) - 1)
        draft_out = ids + call(model, ids, n)[0] if n > 0 else None
        draft = draft_out[len(ids) :] if draft_out is not None else None
        extra = {"draft_input_ids": np.array([draft], np.int32)} if draft else {}
        out = ids + call(model, ids, len(draft) + 1 if draft is not None else 1, **extra)[0]
        last, ids = ids, out
        if len(ids) >= len(prompt) + max_tokens or ids == draft_out or ids == last:
            break
    assert ids[len(prompt) :] == call(model, prompt, max_tokens)[0] == [2, 3, 4]


def test_the_ngram_draft_proposes_nothing_past_the_end_id(pb_utils, monkeypatch, request):
    """The prompt holds `7 8 END 9 ... 7 8`: prompt lookup proposes END 9 after 7 8; a tensorrt_llm_draft's output
    stops before the end id, so with end_id sent the proposal is what came before it (nothing)."""
    module = _load("ngram_draft", monkeypatch, request)
    params = {
        "max_draft_len": "4",
        "max_matching_ngram_size": "2",
        "is_keep_all": "true",
        "is_use_oldest": "true",
        "is_public_pool": "false",
        "min_matching_ngram_size": "2",
        "max_input_len": "64",
    }
    draft = module.TritonPythonModel()
    draft.initialize(
        {
            "model_name": "tensorrt_llm_draft",
            "model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in params.items()}}),
        }
    )
    prompt = [1, 7, 8, END, 9, 4, 7, 8]

    def proposal(**extra):
        inputs = {
            "input_ids": np.array([prompt], np.int32),
            "input_lengths": np.array([[len(prompt)]], np.int32),
            "request_output_len": np.array([[2]], np.int32),
            **extra,
        }
        (response,) = draft.execute([_Request(**inputs)])
        return response.tensors["output_ids"].reshape(-1).tolist()[len(prompt) :]

    without = proposal()
    assert END in without  # the lookup does propose the end id here
    assert proposal(end_id=np.array([[END]], np.int32)) == without[: without.index(END)]


def test_a_streamed_plain_run_sends_only_what_the_loop_keeps(bls):
    """PlainRunStream passes a plain run's tokens on as they arrive and stops where speculative_generate cuts the run:
    at a stop word, also one that began before the run (the engine saw that part as prompt), or at the end id."""
    sent = []
    stream = bls.PlainRunStream([1, 7], END, [[7, 8]], lambda ids: sent.append(list(ids)))
    stream([8, 9])  # 7 (before the run) 8: the stop word ends at the run's first token
    stream([4])
    assert sent == [[8]]
    sent.clear()
    stream = bls.PlainRunStream([1], END, [[7, 6]], lambda ids: sent.append(list(ids)))
    for chunk in ([2], [3, 7], [6, 4], [9]):
        stream(chunk)
    assert sent == [[2], [3, 7], [6]]  # the stop word stays, nothing after it
    sent.clear()
    stream = bls.PlainRunStream([1], END, [], lambda ids: sent.append(list(ids)))
    for chunk in ([2], [], [3, END, 4]):
        stream(chunk)
    assert sent == [[2], [3, END]]  # an empty response sends nothing; the end id ends it, as the loop's cut does
