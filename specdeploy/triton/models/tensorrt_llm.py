"""tensorrt_llm / tensorrt_llm_draft on the CPU backend: one engine behind specdeploy's Executor.

What NVIDIA's `tensorrtllm` backend model does for one request, with its tensor names: generate
`request_output_len` tokens after `input_ids`, or, given `draft_input_ids` (and optionally
`draft_logits`), verify them in one pass and return the accepted prefix plus one own token
(draft_tokens_external). Prefix KV reuse across requests is the Executor's pool, so the BLS rounds
only compute their new positions. In decoupled mode with `streaming`, one response per token
(the new tokens only, as TensorRT-LLM streams); otherwise one response.
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

from specdeploy.errors import SpecDeployError  # noqa: E402
from specdeploy.triton.models import common  # noqa: E402
from specdeploy.triton.models.common import RequestError  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        from specdeploy.engine.executor import GenerationRequest
        from specdeploy.speculative import SamplingParams

        self._GenerationRequest, self._SamplingParams = GenerationRequest, SamplingParams
        params = common.parameters(args)
        self.name = args["model_name"]
        self.decoupled = common.is_decoupled(args)
        self.exclude_input_default = common.flag(params.get("exclude_input_in_output"), False)
        factory = common.load_object(params.get("executor_factory") or "specdeploy.triton.models.common:load_cpu_executor")
        self.executor = factory(params["gpt_model_path"])
        spec = self.executor.engine.spec
        self.vocab_size = int(getattr(spec, "vocab_size", 0)) or None
        self.max_input_len = min(int(params["max_input_len"]), int(getattr(spec, "max_input_len", 1 << 30) or 1 << 30))
        self.max_seq_len = min(int(params["max_seq_len"]), int(spec.max_seq_len))
        self.max_draft_len = min(int(params["max_draft_len"]), int(getattr(spec, "max_draft_len", 0) or 0))

    def execute(self, requests):
        return common.execute_all(requests, self.decoupled, self._serve, FINAL)

    # ------------------------------------------------------------ one request

    def _serve(self, request, emit):
        arrival_ns = time.time_ns()
        try:
            gen, flags = self._parse(request)
        except (RequestError, SpecDeployError) as exc:
            emit(_error(f"{self.name}: {common.error_text(exc)}"), True)
            return
        try:
            self._generate(gen, flags, arrival_ns, emit)
        except SpecDeployError as exc:
            emit(_error(f"{self.name}: {common.error_text(exc)}"), True)
        except Exception as exc:  # an engine failure: answer this request, keep serving the others
            traceback.print_exc()
            emit(_error(f"{self.name}: internal error: {type(exc).__name__}: {exc}"), True)

    def _input(self, request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    def _parse(self, request):
        get = lambda name: self._input(request, name)  # noqa: E731
        input_ids = get("input_ids")
        common.require_single(input_ids, "input_ids")
        ids = input_ids.reshape(-1).tolist()
        length = common.scalar(get("input_lengths"), "input_lengths", int, len(ids))
        if not 0 <= length <= len(ids):
            raise RequestError(f"input_lengths is {length} but input_ids holds {len(ids)} ids")
        ids = [int(t) for t in ids[:length]]
        if not ids:
            raise RequestError("input_ids is empty; send a non-empty prompt")
        if len(ids) > self.max_input_len:
            raise RequestError(f"the prompt has {len(ids)} tokens, more than max_input_len ({self.max_input_len}); shorten it")
        common.check_token_ids(ids, self.vocab_size, "input_ids")
        out_len = common.scalar(get("request_output_len"), "request_output_len", int)
        common.check_output_len(len(ids), out_len, self.max_seq_len, "request_output_len (max_tokens)")

        draft = get("draft_input_ids")
        draft_tokens = None if draft is None else [int(t) for t in draft.reshape(-1).tolist()]
        if draft_tokens is not None:
            if len(draft_tokens) > self.max_draft_len:
                raise RequestError(
                    f"Number of draft tokens ({len(draft_tokens)}) is larger than maximum number of draft tokens "
                    f"({self.max_draft_len}); lower num_draft_tokens or rebuild the target with a larger max_draft_len"
                )
            common.check_token_ids(draft_tokens, self.vocab_size, "draft_input_ids")
        draft_logits = get("draft_logits")
        if draft_logits is not None:
            if draft_tokens is None:
                raise RequestError("draft_logits given without draft_input_ids")
            draft_logits = torch.from_numpy(np.ascontiguousarray(draft_logits.reshape(-1, draft_logits.shape[-1]), dtype=np.float32))
            if draft_logits.shape[0] != len(draft_tokens) or (self.vocab_size and draft_logits.shape[1] != self.vocab_size):
                raise RequestError(
                    f"draft_logits has shape {list(draft_logits.shape)}, expected [{len(draft_tokens)}, {self.vocab_size}] "
                    "(one row per draft token)"
                )
        min_tokens = common.scalar(get("min_tokens"), "min_tokens", int, 0)
        if min_tokens > 0:
            raise RequestError("min_tokens is not supported by the cpu backend; leave it unset or 0")

        streaming = common.scalar(get("streaming"), "streaming", bool, False)
        if streaming and not self.decoupled:
            raise RequestError("streaming needs the model deployed in decoupled mode (recipe triton.decoupled: true)")
        sampling = self._SamplingParams(**common.sampling_fields(get, "runtime_top_k", "runtime_top_p"))
        end_id = common.scalar(get("end_id"), "end_id", int, None)
        pad_id = common.scalar(get("pad_id"), "pad_id", int, None)
        flags = {
            "exclude_input": common.scalar(get("exclude_input_in_output"), "exclude_input_in_output", bool, self.exclude_input_default),
            "return_logits": common.scalar(get("return_generation_logits"), "return_generation_logits", bool, False),
            "perf": common.scalar(get("return_perf_metrics"), "return_perf_metrics", bool, False),
            "streaming": streaming,
            "pad_id": pad_id if pad_id is not None and pad_id >= 0 else (end_id if end_id is not None and end_id >= 0 else 0),
        }
        gen = self._GenerationRequest(
            input_ids=ids,
            max_new_tokens=out_len,
            sampling=sampling,
            end_id=end_id if end_id is not None and end_id >= 0 else None,
            pad_id=pad_id,
            stop_words=common.from_words_list(get("stop_words_list"), "stop_words_list"),
            bad_words=common.from_words_list(get("bad_words_list"), "bad_words_list"),
            draft_tokens=draft_tokens,
            draft_logits=draft_logits,
            return_logits=flags["return_logits"],
            streaming=streaming,
        )
        return gen, flags

    def _generate(self, gen, flags, arrival_ns, emit):
        tokens, logits = [], []
        first_ns = None
        for chunk in self.executor.generate(gen):
            now = time.time_ns()
            if first_ns is None and chunk.token_ids:
                first_ns = now
            if flags["streaming"]:
                response = self._response(chunk.token_ids, chunk.logits, flags, chunk.stats, arrival_ns, first_ns, now)
                emit(response, chunk.finished)
            else:
                tokens.extend(chunk.token_ids)
                if chunk.logits is not None:
                    logits.append(chunk.logits)
                if chunk.finished:
                    ids = tokens if flags["exclude_input"] else list(gen.input_ids) + tokens
                    all_logits = torch.cat(logits) if logits else None
                    emit(self._response(ids, all_logits, flags, chunk.stats, arrival_ns, first_ns, now), True)
            if chunk.finished:
                return

    def _response(self, ids, logits, flags, stats, arrival_ns, first_ns, now_ns):
        outputs = [
            pb_utils.Tensor("output_ids", np.array(ids, dtype=np.int32).reshape(1, 1, -1)),  # [batch, beam, len]
            pb_utils.Tensor("sequence_length", np.array([[len(ids)]], dtype=np.int32)),  # [batch, beam]
        ]
        if flags["return_logits"]:
            rows = logits.float().numpy() if logits is not None else np.zeros((0, self.vocab_size or 0), np.float32)
            outputs.append(pb_utils.Tensor("generation_logits", rows.reshape(1, 1, *rows.shape[-2:]).astype(np.float32)))
        drafted = getattr(stats, "drafted", 0) if stats is not None else 0
        accepted = getattr(stats, "accepted", 0) if stats is not None else 0
        # Perf outputs go with every response: the ensemble maps them, and they cost nothing.
        outputs += [
            pb_utils.Tensor("acceptance_rate", np.array([[accepted / drafted if drafted else 0.0]], dtype=np.float32)),
            pb_utils.Tensor("total_accepted_draft_tokens", np.array([[accepted]], dtype=np.int32)),
            pb_utils.Tensor("total_draft_tokens", np.array([[drafted]], dtype=np.int32)),
            pb_utils.Tensor("arrival_time_ns", np.array([[arrival_ns]], dtype=np.int64)),
            pb_utils.Tensor("first_token_time_ns", np.array([[first_ns or now_ns]], dtype=np.int64)),
            pb_utils.Tensor("last_token_time_ns", np.array([[now_ns]], dtype=np.int64)),
        ]
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def finalize(self):
        self.executor = None


def _error(message: str):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
