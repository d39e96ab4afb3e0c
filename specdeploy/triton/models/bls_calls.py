"""The speculative loop's draft and target over BLS calls: tensorrt_llm_draft and tensorrt_llm as a
`specdeploy.speculation.loop` `Proposer` and `Verifier`, with the tensor names of NVIDIA's layout.

`LlmCall` (one BLS call to a tensorrt_llm-layout model, in time slices when not decoupled), `TritonProposer`,
`TritonVerifier` (and `Record`, what the target calls of one request returned besides tokens), and
`ended_at_end_id` (reading an end from a short answer). The BLS model (tensorrt_llm_bls.py) runs the loop over them.
"""

import uuid

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from specdeploy.speculation import loop as spec
from specdeploy.triton.models import cancellation, stub_safety


class BlsModelError(Exception):
    """A draft or target call came back with an error."""


class Record:
    """What the engine calls of one request returned besides tokens (log probs, logits, KV blocks)."""

    def __init__(self):
        self.rounds = []  # per target call: (log_probs list | None, generation_logits [n, vocab] | None)
        self.context_logits = None
        # KV blocks of the request: every target call carries the whole sequence, so the last call's total is
        # the request's; what was reused from earlier requests shows in the first call
        self.kv_reused, self.kv_total = 0, 0
        self.first_token_ns = 0  # when the first target call produced its first token (the request's TTFT)


class LlmCall:
    """One BLS call to a tensorrt_llm-layout model; returns (new token ids, generation logits or None, outputs)."""

    def __init__(self, model_name: str, decoupled: bool, slice_s: float, held: stub_safety.HeldResponses, names=None):
        self.model_name = model_name
        self.decoupled = decoupled
        self.slice_s = slice_s  # each call's first Triton timeout (0: none), see common.call_in_slices
        self.held = held  # the decoupled calls' response iterators (common.HeldResponses)
        # the engine backend release's tensor names (BLS parameter engine_tensor_names, gpu_models.BackendNames):
        # NVIDIA's c2e65b8 name -> the release's name, or None where the release has no such tensor
        self.names = names or {}

    def __call__(
        self,
        sequence,
        output_len,
        sampling,
        extra,
        return_logits,
        more_outputs=(),
        stop_check=None,
        slice_s=None,
        on_tokens=None,
    ):
        """`on_tokens(ids)`: called with each response's new token ids as it arrives (decoupled calls only; a call that
        sends `streaming` gets one response per run of tokens, so the caller can pass them on before the call ends).
        A streamed response holds only its new tokens, on the CPU models as from NVIDIA's tensorrt_llm, whose streamed
        output_ids NVIDIA's BLS concatenates (`new_tokens`, tensorrtllm_backend c2e65b8
        tensorrt_llm_bls/1/lib/decode.py:416-417)."""
        if self.decoupled:
            self.held.release(stop_check)
            # Not sliced: a decoupled BLS call abandoned at its timeout while the model still sends responses
            # corrupted the stub's heap (tritonserver 2.51: "malloc_consolidate(): unaligned fastbin chunk
            # detected", then "Stub process is not healthy"), so there the BLS checks between rounds, and a call that
            # streams (a streamed request's fused call or plain run) is stopped with TensorRT-LLM's `stop` once the
            # BLS's own request ends (_call). A call that does not stream runs to its end: streaming it only to check
            # would slow every non-streamed fused request (docs/triton-stub-workarounds.md).
            streams = stop_check is not None and "streaming" in extra
            return self._call(
                sequence,
                output_len,
                sampling,
                extra,
                return_logits,
                more_outputs,
                0,
                on_tokens,
                stop_check if streams else None,
            )
        if not self.slice_s or stop_check is None:
            return self._call(sequence, output_len, sampling, extra, return_logits, more_outputs, 0)
        attempt = lambda s: self._call(sequence, output_len, sampling, extra, return_logits, more_outputs, int(s * 1e6))  # noqa: E731
        try:
            return cancellation.call_in_slices(attempt, stop_check, max(self.slice_s, slice_s or 0.0))
        except cancellation.ParentStopped as exc:
            raise BlsModelError(f"{self.model_name}: {exc}") from None

    def _call(
        self,
        sequence,
        output_len,
        sampling,
        extra,
        return_logits,
        more_outputs,
        timeout_us,
        on_tokens=None,
        stop_check=None,
    ):
        """`stop_check` (a streamed decoupled call): asked as each response arrives; once it fires, the call's request
        id gets TensorRT-LLM's `stop` (_send_stop) and the call ends with the tokens it has."""
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
        wanted = (
            ["output_ids", "sequence_length"] + (["generation_logits"] if return_logits else []) + list(more_outputs)
        )
        named = {self.names.get(k, k): v for k, v in tensors.items() if self.names.get(k, k) is not None}
        # an id of its own, as NVIDIA's BLS gives each request it sends (str(uuid.uuid4()), tensorrtllm_backend c2e65b8
        # all_models/inflight_batcher_llm/tensorrt_llm_bls/1/model.py:195), which `stop` names
        stop_id = uuid.uuid4().hex if stop_check is not None and self.names.get("stop", "stop") is not None else ""
        request = pb_utils.InferenceRequest(
            model_name=self.model_name,
            requested_output_names=[n for n in wanted if self.names.get(n, n) is not None],
            inputs=[pb_utils.Tensor(k, v) for k, v in named.items()],
            request_id=stop_id,
            timeout=timeout_us,  # microseconds; the engine model stops at it (between prefill chunks and tokens)
        )
        responses = self.held.hold(request.exec(decoupled=True)) if self.decoupled else [request.exec()]
        tokens, logits, outputs = [], [], {}
        for response in responses:
            if stop_id and stop_check():  # the BLS's own request was cancelled or ran past its deadline
                self._send_stop(stop_id)
                stop_id = ""  # the rest of the responses come as they were, ending soon
            if response.has_error():
                message = response.error().message()
                if timeout_us and cancellation.is_slice_expiry(message):
                    raise cancellation.SliceExpired(message)
                raise BlsModelError(f"{self.model_name}: {message}")
            out = pb_utils.get_output_tensor_by_name(response, "output_ids")
            if out is None:  # the empty final response of a decoupled model
                continue
            n = int(pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy().reshape(-1)[0])
            new = [int(t) for t in out.as_numpy().reshape(-1)[:n]]
            tokens.extend(new)
            if on_tokens is not None and new:
                on_tokens(new)
            if return_logits:
                rows = pb_utils.get_output_tensor_by_name(response, "generation_logits").as_numpy()
                logits.append(torch.from_numpy(rows.reshape(-1, rows.shape[-1]).copy()))  # [n, vocab]
            for name in more_outputs:
                tensor = pb_utils.get_output_tensor_by_name(response, name)
                if tensor is not None:
                    outputs.setdefault(name, []).append(tensor.as_numpy())
        return tokens, (torch.cat(logits) if logits else None), outputs

    def _send_stop(self, request_id: str) -> None:
        """TensorRT-LLM's `stop` for the running call `request_id`: a request of that id with stop=true and no tokens,
        as NVIDIA's BLS sends it (tensorrtllm_backend c2e65b8 all_models/inflight_batcher_llm/tensorrt_llm_bls/1/lib/
        triton_decoder.py:194-216; the input: all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt:293-298). Its
        C++ backend cancels the executor's requests of that id
        (inflight_batcher_llm/src/model_instance_state.cc:871-905), its Python model alike
        (all_models/inflight_batcher_llm/tensorrt_llm/1/model.py:1336-1352), and specdeploy's CPU model ends them with
        the tokens they have (tensorrt_llm.py `_serve`). A stop that fails is reported in the log and the call runs on
        to its end, as before."""
        tensors = {
            "input_ids": np.zeros([1, 1], dtype=np.int32),
            "input_lengths": np.zeros([1, 1], dtype=np.int32),
            "request_output_len": np.zeros([1, 1], dtype=np.int32),
            "stop": np.array([[True]]),
        }
        named = {self.names.get(k, k): v for k, v in tensors.items()}
        request = pb_utils.InferenceRequest(
            model_name=self.model_name,
            requested_output_names=[],
            request_id=request_id,
            inputs=[pb_utils.Tensor(k, v) for k, v in named.items()],
        )
        for response in self.held.hold(request.exec(decoupled=True)):
            if response.has_error():
                print(
                    f"{self.model_name}: the stop for request id {request_id!r} failed: {response.error().message()}",
                    flush=True,
                )


def request_tensors(job, produced: int) -> dict:
    """Penalties, min_tokens (less the tokens already produced) and the embedding bias, for draft and target alike."""
    out = {
        "repetition_penalty": np.array([[job["penalties"]["repetition_penalty"]]], dtype=np.float32),
        "presence_penalty": np.array([[job["penalties"]["presence_penalty"]]], dtype=np.float32),
        "frequency_penalty": np.array([[job["penalties"]["frequency_penalty"]]], dtype=np.float32),
        "min_tokens": np.array([[max(job["penalties"]["min_tokens"] - produced, 0)]], dtype=np.int32),
    }
    if job["embedding_bias"] is not None:
        out["embedding_bias"] = job["embedding_bias"][None]  # [1, vocab]
    if job["end_id"] is not None:
        out["end_id"] = np.array([[job["end_id"]]], dtype=np.int32)
    return out


class TritonProposer:
    """specdeploy.speculation.loop.Proposer over tensorrt_llm_draft."""

    def __init__(self, call: LlmCall, job):
        self.call, self.job = call, job

    def propose(self, sequence, num_tokens, sampling, return_logits):
        extra = {
            "bad_words_list": self.job["bad_words_list"][None],
            **request_tensors(self.job, len(sequence) - len(self.job["prompt_ids"])),
        }
        tokens, logits, _ = self.call(
            sequence, num_tokens, sampling, extra, return_logits, stop_check=self.job.get("stop_check")
        )
        # a draft that ended at the end id returns the logits row of that step too (no token for it)
        return spec.Proposal(tokens, None if logits is None else logits[: len(tokens)])


class TritonVerifier:
    """specdeploy.speculation.loop.Verifier over tensorrt_llm with draft_input_ids (request_output_len = k + 1)."""

    def __init__(self, call: LlmCall, job, record: Record, costs=None, active=lambda: 1, stream_sink=None):
        self.call, self.job, self.record = call, job, record
        self.stream_sink = (
            stream_sink  # a streamed request's sink for a plain run's tokens as they come (PlainRunStream)
        )
        # the deployment's measured costs (specdeploy.speculation.costs.CostModel), to size a plain run's time slice
        self.costs = costs
        self.active = active  # requests the BLS instances are serving now (policy.ActiveCount)

    def verify(self, sequence, draft_tokens, draft_logits, sampling, output_len=None):
        job = self.job
        first = not self.record.rounds
        # A call that carries draft_input_ids never asks for logits: NVIDIA's BLS sets both flags only when the call
        # has no draft request (tensorrtllm_backend@c2e65b8 all_models/inflight_batcher_llm/tensorrt_llm_bls/1/lib/
        # triton_decoder.py:495-508) and docs/model_config.md:223 says they are "not supported when using
        # speculative decoding". A request that wants logits is served without drafts (_run).
        context_logits = job["return_context_logits"] and first and not draft_tokens
        extra = {
            "bad_words_list": job["bad_words_list"][None],
            "stop_words_list": job["stop_words_list"][None],
            "return_log_probs": np.array([[job["return_log_probs"]]]),
            "return_context_logits": np.array([[context_logits]]),
            **request_tensors(job, len(sequence) - len(job["prompt_ids"])),
        }
        if draft_tokens:
            extra["draft_input_ids"] = np.array([draft_tokens], dtype=np.int32)
        if draft_logits is not None:
            extra["draft_logits"] = draft_logits.float().numpy()[None].astype(np.float32)  # [1, k, vocab]
        wanted = ["output_log_probs", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "first_token_time_ns"]
        if context_logits:
            wanted.append("context_logits")
        # A plain run of a streamed request streams too (stream_sink, given by the BLS where tensorrt_llm streams): its
        # tokens reach the client as they come, not when the run returns
        on_tokens = None
        if self.stream_sink is not None and output_len and output_len > 1 and not draft_tokens:
            extra["streaming"] = np.array([[True]])
            on_tokens = PlainRunStream(sequence, job["end_id"], job["stop_words"], self.stream_sink)
        # output_len: a plain run of the policy, or the canary's plain path (the whole answer in one call,
        # specdeploy.core.metrics.recorder.PlainVerifier)
        tokens, logits, outputs = self.call(
            sequence,
            output_len or len(draft_tokens) + 1,
            sampling,
            extra,
            job["return_generation_logits"] and not draft_tokens,
            wanted,
            stop_check=job.get("stop_check"),
            slice_s=self._run_slice_s(output_len),
            on_tokens=on_tokens,
        )
        log_probs = (
            [float(x) for a in outputs.get("output_log_probs", []) for x in a.reshape(-1)]
            if job["return_log_probs"]
            else None
        )
        self.record.rounds.append((log_probs, logits))
        if "context_logits" in outputs:
            rows = outputs["context_logits"][0]
            self.record.context_logits = rows.reshape(-1, rows.shape[-1])  # [prompt, vocab]
        last = {name: int(outputs[name][-1].reshape(-1)[0]) for name in wanted[1:] if outputs.get(name)}
        if first:
            self.record.kv_reused = last.get("kv_cache_reused_blocks", 0)
            self.record.first_token_ns = last.get("first_token_time_ns", 0)
        self.record.kv_total = last.get("kv_cache_alloc_total_blocks", self.record.kv_total)
        requested = output_len or len(draft_tokens) + 1
        if ended_at_end_id(sequence, draft_tokens, tokens, requested, job["end_id"], job["stop_words"]):
            return tokens + [job["end_id"]]  # the loop (speculative_generate) then finishes with reason end_id
        return tokens

    def _run_slice_s(self, output_len):
        """A first time slice long enough for a plain run of output_len tokens (common.run_slice_s)."""
        if not output_len or output_len <= 1:
            return None
        costs = self.costs
        per_token = (costs.plain_token_s or costs.verify_s.get(1)) if costs is not None else None
        return cancellation.run_slice_s(output_len, per_token or RUN_TOKEN_GUESS_S, self.active())


class PlainRunStream:
    """Passes a streamed plain run's tokens to `sink` as they arrive, up to where the speculative loop will cut the run
    (`spec.find_stop` over the whole sequence, as `speculative_generate` checks a round: a stop word may begin before
    the run, where the engine, which sees it as prompt, does not look), so what was sent is always the start of what the
    loop yields; nothing after the cut is sent."""

    def __init__(self, sequence, end_id, stop_words, sink):
        self.sequence, self.end_id, self.stop_words, self.sink = list(sequence), end_id, stop_words, sink
        self.cut = False

    def __call__(self, ids):
        if self.cut:
            return
        start = len(self.sequence)
        self.sequence.extend(ids)
        cut = spec.find_stop(self.sequence, start, self.end_id, self.stop_words)
        if cut is not None:
            self.cut = True
            del self.sequence[cut:]
        if len(self.sequence) > start:
            self.sink(self.sequence[start:])


def ended_at_end_id(sequence, draft_tokens, returned, requested, end_id, stop_words) -> bool:
    """Whether a tensorrt_llm call ended its sequence at `end_id`, read from what it returned.

    TensorRT-LLM leaves the end token out of output_ids (see tensorrt_llm.py `_without_end_token` for the sources),
    so the end shows only as a short answer. Without an end, a call returns what it was asked for: `requested`
    tokens of a plain run, or, with draft tokens, the accepted prefix plus one token of the target's own, which
    differs from the draft token at that place (greedy: else it would have been accepted; rejection sampling: the
    residual distribution is zero at a rejected draft token; token matching: a rejection means a different token),
    capped at `requested` = k + 1. Fewer tokens than that, not explained by a stop word (a stop word stays in the
    output), means the end id came next. `stop_words` are token lists; matched over the whole sequence."""
    if end_id is None:
        return False
    if draft_tokens:
        agreed = 0
        while agreed < min(len(draft_tokens), len(returned)) and draft_tokens[agreed] == returned[agreed]:
            agreed += 1
        expected = min(agreed + 1, requested)
    else:
        expected = requested
    if len(returned) >= expected:
        return False
    whole = list(sequence) + list(returned)
    return spec.find_stop(whole, len(sequence), None, stop_words) is None


RUN_TOKEN_GUESS_S = 0.05  # seconds per plain token before the deployment has timed one
