"""tensorrt_llm_draft for draft.kind ngram and suffix: prompt-lookup drafting behind the tensorrt_llm interface.

The BLS calls it exactly as it calls a model draft: `input_ids` (prompt + output so far),
`input_lengths`, `request_output_len` (k) -> `output_ids` [1, 1, n], `sequence_length` [1, 1] with
n <= k proposed tokens (possibly none: no pattern matched), cut before `end_id` when one is sent. Every
other optional input of the tensorrt_llm layout is accepted and has no effect on a proposal (the target's
verification applies the request's sampling, penalties and stop conditions). `return_generation_logits` is refused: an
n-gram draft has no logits. The pool (public or per request) is `specdeploy.speculation.ngram.NGramDrafts`; with the
parameter `draft_kind` suffix, `SuffixDrafts` (the suffix automaton over the sequence sent).
"""

import os
import sys

# The python stub runs in isolated mode (PYTHONPATH ignored): the launcher passes our site-packages.
sys.path[:0] = [p for p in os.environ.get("SPECDEPLOY_SITE", "").split(os.pathsep) if p]

import time  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from specdeploy.speculation import ngram  # noqa: E402
from specdeploy.triton.models import (
    common,  # noqa: E402
    request_inputs,
)
from specdeploy.triton.models.request_inputs import RequestError  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        params = common.parameters(args)
        self.name = args["model_name"]
        self.decoupled = common.is_decoupled(args)
        self.drafts = ngram.drafts_from_parameters(params)
        self.max_input_len = int(params["max_input_len"])

    def execute(self, requests):
        return common.execute_all(requests, self.decoupled, self._serve, FINAL)

    def _serve(self, request, emit):
        arrival_ns = time.time_ns()
        get = request_inputs.input_reader(request)
        try:
            ids, out_len, exclude_input = self._parse(get)
            tokens = self.drafts.draft(ids, out_len)
            end_id = request_inputs.scalar(get("end_id"), "end_id", int, None)
            if end_id is not None and end_id in tokens:
                # a tensorrt_llm model's output_ids stop before the end id (tensorrt_llm.py _without_end_token):
                # the proposal does too, as a model draft's would
                tokens = tokens[: tokens.index(end_id)]
        except RequestError as exc:
            emit(_error(f"{self.name}: {exc}"), True)
            return
        except Exception as exc:
            traceback.print_exc()
            emit(_error(f"{self.name}: internal error: {type(exc).__name__}: {exc}"), True)
            return
        out = tokens if exclude_input else ids + tokens
        now = time.time_ns()
        outputs = [
            pb_utils.Tensor("output_ids", np.array(out, dtype=np.int32).reshape(1, 1, -1)),  # [batch, beam, len]
            pb_utils.Tensor("sequence_length", np.array([[len(out)]], dtype=np.int32)),  # [batch, beam]
            pb_utils.Tensor("arrival_time_ns", np.array([[arrival_ns]], dtype=np.int64)),
            pb_utils.Tensor("first_token_time_ns", np.array([[now]], dtype=np.int64)),
            pb_utils.Tensor("last_token_time_ns", np.array([[now]], dtype=np.int64)),
        ]
        emit(pb_utils.InferenceResponse(output_tensors=outputs), True)

    def _parse(self, get):
        input_ids = get("input_ids")
        request_inputs.require_single(input_ids, "input_ids")
        ids = input_ids.reshape(-1).tolist()
        length = request_inputs.scalar(get("input_lengths"), "input_lengths", int, len(ids))
        if not 0 < length <= len(ids):
            raise RequestError(f"input_lengths is {length} but input_ids holds {len(ids)} ids")
        ids = [int(t) for t in ids[:length]]
        if len(ids) > self.max_input_len:
            raise RequestError(f"the sequence has {len(ids)} tokens, more than max_input_len ({self.max_input_len})")
        out_len = request_inputs.scalar(get("request_output_len"), "request_output_len", int)
        if out_len < 0:
            raise RequestError(f"request_output_len is {out_len}; ask for 0 or more tokens")
        if request_inputs.scalar(get("return_generation_logits"), "return_generation_logits", bool, False):
            raise RequestError(
                "return_generation_logits is true, but an n-gram draft has no logits; send false "
                "(the BLS does when use_draft_logits is false)"
            )
        exclude = request_inputs.scalar(get("exclude_input_in_output"), "exclude_input_in_output", bool, False)
        return ids, out_len, exclude

    def finalize(self):
        self.drafts = None


def _error(message: str):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
