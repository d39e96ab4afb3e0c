"""tensorrt_llm_bls: speculative decoding over BLS calls to tensorrt_llm_draft and tensorrt_llm.

The loop is `specdeploy.speculative.speculative_generate` (no Triton import there); this file only
maps its `Proposer` / `Verifier` protocols to BLS requests with the tensor names of NVIDIA's layout,
tokenizes the prompt, detokenizes the output, and checks the request. With `stream` (decoupled
mode) each round's new text is sent as it comes, holding back an incomplete UTF-8 character.
"""

import os
import sys

# The python stub runs in isolated mode (PYTHONPATH ignored): the launcher passes our site-packages.
sys.path[:0] = [p for p in os.environ.get("SPECDEPLOY_SITE", "").split(os.pathsep) if p]

import time  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from specdeploy import speculative as spec  # noqa: E402
from specdeploy.errors import SpecDeployError  # noqa: E402
from specdeploy.triton.models import common  # noqa: E402
from specdeploy.triton.models.common import RequestError  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class BlsModelError(Exception):
    """A draft or target call came back with an error."""


class _LlmCall:
    """One BLS call to a tensorrt_llm-layout model; returns (new token ids, generation logits or None)."""

    def __init__(self, model_name: str, decoupled: bool):
        self.model_name = model_name
        self.decoupled = decoupled

    def __call__(self, sequence, output_len, sampling, extra, return_logits):
        tensors = {
            "input_ids": np.array([sequence], dtype=np.int32),
            "input_lengths": np.array([[len(sequence)]], dtype=np.int32),
            "request_output_len": np.array([[output_len]], dtype=np.int32),
            "exclude_input_in_output": np.array([[True]]),
            "return_generation_logits": np.array([[bool(return_logits)]]),
            "return_perf_metrics": np.array([[True]]),
            "temperature": np.array([[sampling.temperature]], dtype=np.float32),
            "runtime_top_k": np.array([[sampling.top_k]], dtype=np.int32),
            "runtime_top_p": np.array([[sampling.top_p]], dtype=np.float32),
            **extra,
        }
        if sampling.seed is not None:
            tensors["seed"] = np.array([[sampling.seed]], dtype=np.uint64)
        request = pb_utils.InferenceRequest(
            model_name=self.model_name,
            requested_output_names=["output_ids", "sequence_length"] + (["generation_logits"] if return_logits else []),
            inputs=[pb_utils.Tensor(k, v) for k, v in tensors.items()],
        )
        responses = request.exec(decoupled=True) if self.decoupled else [request.exec()]
        tokens, logits = [], []
        for response in responses:
            if response.has_error():
                raise BlsModelError(f"{self.model_name}: {response.error().message()}")
            out = pb_utils.get_output_tensor_by_name(response, "output_ids")
            if out is None:  # the empty final response of a decoupled model
                continue
            n = int(pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy().reshape(-1)[0])
            tokens.extend(int(t) for t in out.as_numpy().reshape(-1)[:n])
            if return_logits:
                rows = pb_utils.get_output_tensor_by_name(response, "generation_logits").as_numpy()
                logits.append(torch.from_numpy(rows.reshape(-1, rows.shape[-1]).copy()))  # [n, vocab]
        return tokens, (torch.cat(logits) if logits else None)


class TritonProposer:
    """specdeploy.speculative.Proposer over tensorrt_llm_draft."""

    def __init__(self, call: _LlmCall, end_id, bad_words_list):
        self.call, self.end_id, self.bad_words_list = call, end_id, bad_words_list

    def propose(self, sequence, num_tokens, sampling, return_logits):
        extra = {"bad_words_list": self.bad_words_list[None]}
        if self.end_id is not None:
            extra["end_id"] = np.array([[self.end_id]], dtype=np.int32)
        tokens, logits = self.call(sequence, num_tokens, sampling, extra, return_logits)
        return spec.Proposal(tokens, logits)


class TritonVerifier:
    """specdeploy.speculative.Verifier over tensorrt_llm with draft_input_ids (request_output_len = k + 1)."""

    def __init__(self, call: _LlmCall, end_id, bad_words_list, stop_words_list):
        self.call, self.end_id = call, end_id
        self.bad_words_list, self.stop_words_list = bad_words_list, stop_words_list

    def verify(self, sequence, draft_tokens, draft_logits, sampling):
        extra = {"bad_words_list": self.bad_words_list[None], "stop_words_list": self.stop_words_list[None]}
        if self.end_id is not None:
            extra["end_id"] = np.array([[self.end_id]], dtype=np.int32)
        if draft_tokens:
            extra["draft_input_ids"] = np.array([draft_tokens], dtype=np.int32)
        if draft_logits is not None:
            extra["draft_logits"] = draft_logits.float().numpy()[None].astype(np.float32)  # [1, k, vocab]
        tokens, _ = self.call(sequence, len(draft_tokens) + 1, sampling, extra, False)
        return tokens


class TritonPythonModel:
    def initialize(self, args):
        params = common.parameters(args)
        self.name = args["model_name"]
        self.decoupled = common.is_decoupled(args)
        self.tokenizer = common.load_tokenizer(common.resolve_dir(params["tokenizer_dir"], args))
        self.add_special_tokens = common.flag(params.get("add_special_tokens"), True)
        self.skip_special_tokens = common.flag(params.get("skip_special_tokens"), True)
        self.default_num_draft_tokens = int(params["num_draft_tokens"])
        self.max_draft_len = int(params["max_draft_len"])
        self.default_use_draft_logits = common.flag(params.get("use_draft_logits"), False)
        self.max_input_len = int(params["max_input_len"])
        self.max_seq_len = int(params["max_seq_len"])
        # The engine models share our transaction policy (the generator writes both from the recipe).
        self.target = _LlmCall(params["tensorrt_llm_model_name"], self.decoupled)
        self.draft = _LlmCall(params["tensorrt_llm_draft_model_name"], self.decoupled)
        self.default_end_id = self.tokenizer.eos_token_id

    def execute(self, requests):
        return common.execute_all(requests, self.decoupled, self._serve, FINAL)

    def _input(self, request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    def _serve(self, request, emit):
        arrival_ns = time.time_ns()
        try:
            job = self._parse(request)
        except (RequestError, SpecDeployError) as exc:
            emit(_error(f"{self.name}: {common.error_text(exc)}"), True)
            return
        try:
            self._run(job, arrival_ns, emit)
        except (BlsModelError, SpecDeployError) as exc:
            emit(_error(f"{self.name}: {common.error_text(exc)}"), True)
        except Exception as exc:
            traceback.print_exc()
            emit(_error(f"{self.name}: internal error: {type(exc).__name__}: {exc}"), True)

    def _parse(self, request) -> dict:
        get = lambda name: self._input(request, name)  # noqa: E731
        text_input = get("text_input")
        common.require_single(text_input, "text_input")
        text = common.decode_utf8(text_input.reshape(-1)[0], "text_input")
        prompt_ids = common.encode_prompt(self.tokenizer, text, self.add_special_tokens, self.max_input_len)
        max_tokens = common.scalar(get("max_tokens"), "max_tokens", int)
        common.check_output_len(len(prompt_ids), max_tokens, self.max_seq_len)
        num_draft_tokens = common.scalar(get("num_draft_tokens"), "num_draft_tokens", int, self.default_num_draft_tokens)
        if num_draft_tokens < 0:
            raise RequestError(f"num_draft_tokens is {num_draft_tokens}, must be >= 0")
        if num_draft_tokens > self.max_draft_len:
            raise RequestError(
                f"num_draft_tokens ({num_draft_tokens}) is larger than the target engine's max_draft_len "
                f"({self.max_draft_len}); send at most {self.max_draft_len}"
            )
        sampling = spec.SamplingParams(**common.sampling_fields(get, "top_k", "top_p"))
        end_id = common.scalar(get("end_id"), "end_id", int, self.default_end_id)
        stream = common.scalar(get("stream"), "stream", bool, False)
        if stream and not self.decoupled:
            raise RequestError("stream needs the model deployed in decoupled mode (recipe triton.decoupled: true)")
        stop_words = common.encode_words(self.tokenizer, common.strings(get("stop_words"), "stop_words"))
        bad_words = common.encode_words(self.tokenizer, common.strings(get("bad_words"), "bad_words"))
        return {
            "prompt_ids": prompt_ids,
            "max_tokens": max_tokens,
            "num_draft_tokens": num_draft_tokens,
            "sampling": sampling,
            "end_id": end_id if end_id is not None and end_id >= 0 else None,
            "stop_words": stop_words,
            "bad_words_list": common.to_words_list(bad_words),
            "stop_words_list": common.to_words_list(stop_words),
            "use_draft_logits": common.scalar(get("use_draft_logits"), "use_draft_logits", bool, self.default_use_draft_logits),
            "stream": stream,
            "exclude_input": common.scalar(get("exclude_input_in_output"), "exclude_input_in_output", bool, False),
            "perf": common.scalar(get("return_perf_metrics"), "return_perf_metrics", bool, False),
        }

    def _run(self, job, arrival_ns, emit):
        proposer = TritonProposer(self.draft, job["end_id"], job["bad_words_list"])
        verifier = TritonVerifier(self.target, job["end_id"], job["bad_words_list"], job["stop_words_list"])
        rounds = spec.speculative_generate(
            proposer,
            verifier,
            job["prompt_ids"],
            max_new_tokens=job["max_tokens"],
            num_draft_tokens=job["num_draft_tokens"],
            sampling=job["sampling"],
            end_id=job["end_id"],
            stop_words=job["stop_words"],
            use_draft_logits=job["use_draft_logits"],
        )
        stream = common.TextStream(self.tokenizer, self.skip_special_tokens) if job["stream"] else None
        output, first_ns, stats = [], None, spec.SpecStats()
        for item in rounds:
            if isinstance(item, spec.SpecStats):
                stats = item
                continue
            first_ns = first_ns or time.time_ns()
            output.extend(item)
            if stream is not None:
                delta = stream.push(item)
                if delta:
                    emit(self._response(delta, job, None, arrival_ns, first_ns), False)
        if stream is not None:
            text = stream.flush()
        else:
            ids = output if job["exclude_input"] else job["prompt_ids"] + output
            text = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        emit(self._response(text, job, stats, arrival_ns, first_ns), True)

    def _response(self, text, job, stats, arrival_ns, first_ns):
        outputs = [pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=object))]
        if job["perf"] and stats is not None:
            now = time.time_ns()
            outputs += [
                pb_utils.Tensor("acceptance_rate", np.array([[stats.acceptance_rate]], dtype=np.float32)),
                pb_utils.Tensor("total_accepted_draft_tokens", np.array([[stats.accepted]], dtype=np.int32)),
                pb_utils.Tensor("total_draft_tokens", np.array([[stats.drafted]], dtype=np.int32)),
                pb_utils.Tensor("arrival_time_ns", np.array([[arrival_ns]], dtype=np.int64)),
                pb_utils.Tensor("first_token_time_ns", np.array([[first_ns or now]], dtype=np.int64)),
                pb_utils.Tensor("last_token_time_ns", np.array([[now]], dtype=np.int64)),
            ]
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def finalize(self):
        pass


def _error(message: str):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
