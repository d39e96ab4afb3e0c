"""preprocessing: text -> token ids (QUERY -> INPUT_ID), stop/bad words -> TensorRT-LLM word lists.

Same tensors as NVIDIA's inflight_batcher_llm preprocessing model.
"""

import os
import sys

# The python stub runs in isolated mode (PYTHONPATH ignored): the launcher passes our site-packages.
sys.path[:0] = [p for p in os.environ.get("SPECDEPLOY_SITE", "").split(os.pathsep) if p]

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from specdeploy.triton.models import (
    common,  # noqa: E402
    optional_inputs,
    request_inputs,
)
from specdeploy.triton.models.request_inputs import RequestError  # noqa: E402

# NVIDIA's preprocessing inputs this model cannot honour (accepted only at their neutral value).
REFUSED = ("DECODER_QUERY", "IMAGE_BYTES", "IMAGE_URL", "VIDEO_BYTES", "PROMPT_TABLE_EXTRA_ID")


class TritonPythonModel:
    def initialize(self, args):
        params = common.parameters(args)
        self.tokenizer = common.load_tokenizer(common.resolve_dir(params["tokenizer_dir"], args))
        self.add_special_tokens = common.flag(params.get("add_special_tokens"), True)
        self.max_input_len = int(params["max_input_len"])
        self.end_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.end_id

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._run(request))
            except (RequestError, request_inputs.RequestError) as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"preprocessing: {exc}")))
        return responses

    def _run(self, request):
        get = request_inputs.input_reader(request)
        query = get("QUERY")
        out_len = get("REQUEST_OUTPUT_LEN")
        batch = request_inputs.batch_size(query, "QUERY")
        if out_len is None:  # required, yet Triton let it through with an optional input in its place (bench/fuzz.py)
            raise RequestError("input 'REQUEST_OUTPUT_LEN' (max_tokens) is required")
        bad = get("BAD_WORDS_DICT")
        stop = get("STOP_WORDS_DICT")
        end_in = get("END_ID")
        pad_in = get("PAD_ID")
        optional_inputs.refuse_unsupported(get, REFUSED)
        bias_words = get("EMBEDDING_BIAS_WORDS")
        bias_weights = get("EMBEDDING_BIAS_WEIGHTS")

        ids, out_lens, bad_lists, stop_lists, ends, pads, biases = [], [], [], [], [], [], []
        for i in range(batch):
            text = request_inputs.decode_utf8(query[i].reshape(-1)[0], "text_input")
            ids.append(request_inputs.encode_prompt(self.tokenizer, text, self.add_special_tokens, self.max_input_len))
            n = request_inputs.scalar(out_len[i], "max_tokens", int)
            if n <= 0:
                raise RequestError(f"max_tokens is {n}; ask for at least 1 token")
            out_lens.append(n)
            bad_lists.append(
                request_inputs.to_words_list(
                    request_inputs.encode_words(
                        self.tokenizer, request_inputs.strings(None if bad is None else bad[i], "bad_words")
                    )
                )
            )
            stop_lists.append(
                request_inputs.to_words_list(
                    request_inputs.encode_words(
                        self.tokenizer, request_inputs.strings(None if stop is None else stop[i], "stop_words")
                    )
                )
            )
            ends.append(request_inputs.scalar(None if end_in is None else end_in[i], "end_id", int, self.end_id))
            pads.append(request_inputs.scalar(None if pad_in is None else pad_in[i], "pad_id", int, self.pad_id))
            biases.append(
                optional_inputs.embedding_bias_from_words(
                    self.tokenizer,
                    None if bias_words is None else bias_words[i],
                    None if bias_weights is None else bias_weights[i],
                    len(self.tokenizer),
                )
            )

        width = max(len(x) for x in ids)
        input_id = np.full((batch, width), pads[0] if pads[0] is not None else 0, dtype=np.int32)
        for i, x in enumerate(ids):
            input_id[i, : len(x)] = x
        outputs = [
            pb_utils.Tensor("INPUT_ID", input_id),
            pb_utils.Tensor("REQUEST_INPUT_LEN", np.array([[len(x)] for x in ids], dtype=np.int32)),
            pb_utils.Tensor("BAD_WORDS_IDS", _stack(bad_lists)),
            pb_utils.Tensor("STOP_WORDS_IDS", _stack(stop_lists)),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", np.array([[n] for n in out_lens], dtype=np.int32)),
            pb_utils.Tensor("OUT_END_ID", np.array([[-1 if e is None else e] for e in ends], dtype=np.int32)),
            pb_utils.Tensor("OUT_PAD_ID", np.array([[-1 if p is None else p] for p in pads], dtype=np.int32)),
            # decoder-only models: a one-token decoder input of the pad id, as NVIDIA's preprocessing sends
            pb_utils.Tensor("DECODER_INPUT_ID", np.array([[0 if p is None else p] for p in pads], dtype=np.int32)),
            pb_utils.Tensor("REQUEST_DECODER_INPUT_LEN", np.ones((batch, 1), dtype=np.int32)),
            pb_utils.Tensor("EMBEDDING_BIAS", _biases(biases, len(self.tokenizer))),
            pb_utils.Tensor("OUT_PROMPT_TABLE_EXTRA_IDS", np.zeros((batch, 1), dtype=np.uint64)),
        ]
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def finalize(self):
        pass


def _biases(biases, vocab_size):
    """[batch, vocab] fp32, or [batch, 0] when no request of the batch sets an embedding bias (NVIDIA's convention)."""
    if all(b is None for b in biases):
        return np.zeros((len(biases), 0), dtype=np.float32)
    return np.stack([np.zeros(vocab_size, np.float32) if b is None else b for b in biases])


def _stack(lists):
    """Word lists [2, L_i] of a batch -> [batch, 2, max L] (ids padded with 0, offsets with -1)."""
    width = max(x.shape[1] for x in lists)
    out = np.zeros((len(lists), 2, width), dtype=np.int32)
    out[:, 1, :] = -1
    for i, x in enumerate(lists):
        out[i, :, : x.shape[1]] = x
    return out
