"""tensorrt_llm_bls: speculative decoding over BLS calls to tensorrt_llm_draft and tensorrt_llm.

The loop is `specdeploy.speculation.loop.speculative_generate` (no Triton import there); `bls_calls` maps its
`Proposer` / `Verifier` protocols to BLS requests with the tensor names of NVIDIA's layout; this file
tokenizes the prompt, detokenizes the output, and checks the request. With `stream` (decoupled
mode) each round's new text is sent as it comes, holding back an incomplete UTF-8 character; a call that makes several
tokens (a plain run, a fused request) is streamed from tensorrt_llm, so its text comes as it is made too.

Where a round costs:
  - k = 0 (the policy fell back, the gate tripped, the request asked for no draft tokens): one target
    call for a run of plain tokens (`policy.plain_tokens`), not one call per token;
  - draft.kind ngram (BLS parameter `draft_kind`): the proposal is computed here from the token ids the
    BLS already holds (`specdeploy.speculation.ngram.NGramProposer`, same settings and pool semantics as the
    `tensorrt_llm_draft` python model, which stays in the repository for clients that call it), so a
    round is one Triton call, to the target;
  - draft.kind suffix (`draft_kind` suffix): likewise, the suffix automaton over the request's own ids
    (`specdeploy.speculation.ngram.SuffixProposer`, one per request);
  - draft.kind eagle3 (`draft_kind` eagle3): tensorrt_llm runs the EAGLE-3 head inside (the fused loop of
    engine/executor.py), so a request is ONE call to tensorrt_llm with `num_draft_tokens` = k (0: plain); its
    per-round counts (`draft_tokens_per_round`, `accepted_draft_tokens_per_round`) feed the metrics here.
`sequence_length` (INT32 [-1], sent only when a client requests it by name): the answer's output tokens, with the last
response; `speculative_k_history` (likewise): the k of each round;
`speculative_draft_seconds` / `speculative_target_seconds` (FP32 [-1], likewise) beside it: each round's draft work
and target call (fused: the head's work and the engine pass, as tensorrt_llm timed them), for validate's round profile.
"""

import os
import sys

# The python stub runs in isolated mode (PYTHONPATH ignored): the launcher passes our site-packages.
sys.path[:0] = [p for p in os.environ.get("SPECDEPLOY_SITE", "").split(os.pathsep) if p]

import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from specdeploy.core.errors import SpecDeployError  # noqa: E402
from specdeploy.core.metrics import recorder
from specdeploy.speculation import loop as spec  # noqa: E402
from specdeploy.speculation import (
    ngram,  # noqa: E402
    sharing,
)
from specdeploy.speculation import policy as pol  # noqa: E402
from specdeploy.speculation import sampling as speculation_sampling
from specdeploy.triton.models import (
    cancellation,
    common,  # noqa: E402
    optional_inputs,
    request_inputs,
    stub_safety,
    text_stream,
)
from specdeploy.triton.models.bls_calls import (
    RUN_TOKEN_GUESS_S,
    BlsModelError,
    LlmCall,
    Record,
    TritonProposer,
    TritonVerifier,
    request_tensors,
)
from specdeploy.triton.models.request_inputs import RequestError  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


# NVIDIA's BLS inputs this model cannot honour (accepted only at their neutral value).
REFUSED = (
    "decoder_text_input",
    "image_input",
    "image_bytes_input",
    "image_url_input",
    "video_bytes_input",
    "beam_width",
    "prompt_embedding_table",
    "prompt_vocab_size",
    "prompt_table_extra_id",
    "lora_task_id",
    "lora_weights",
    "lora_config",
    "guided_decoding_guide_type",
    "guided_decoding_guide",
)


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
        self.request_timeout_s = float(params.get("request_timeout_s") or 0.0)
        # The engine models share our transaction policy (the generator writes both from the recipe).
        # Each draft/target call runs at most cancel_check_interval_s before the BLS checks whether its own
        # request was cancelled (or passed its deadline); an unfinished call is re-sent and resumes from its KV.
        slice_s = float(params.get("cancel_check_interval_s") or cancellation.CANCEL_CHECK_INTERVAL_S)
        self.held = stub_safety.HeldResponses()  # one queue barrier serves both models' calls
        names = json.loads(params.get("engine_tensor_names") or "{}")
        self.target = LlmCall(params["tensorrt_llm_model_name"], self.decoupled, slice_s, self.held, names)
        self.draft = LlmCall(params["tensorrt_llm_draft_model_name"], self.decoupled, slice_s, self.held, names)
        self.default_end_id = self.tokenizer.eos_token_id
        # draft.kind ngram: propose here, from the ids this BLS holds (a public pool is this instance's). Our
        # "max_draft_len" is the target's; the draft's own cap comes as draft_max_draft_len
        own = {**params, "max_draft_len": params.get("draft_max_draft_len") or params["max_draft_len"]}
        self.ngram = ngram.from_parameters(own) if params.get("draft_kind") == "ngram" else None
        self.ngram_pool = ngram.NGramPool(self.ngram) if self.ngram is not None and self.ngram.is_public_pool else None
        # draft.kind suffix: the suffix automaton over each request's own ids, here too
        self.suffix = ngram.suffix_from_parameters(own) if params.get("draft_kind") == "suffix" else None
        self.eagle3 = params.get("draft_kind") == "eagle3"
        # A streamed request asks tensorrt_llm to stream too where one call makes several tokens (a fused request: a
        # response per round; a plain run: a response per token) and sends the text as it comes. tensorrt_llm refuses
        # `streaming` for a tokenizer whose chunks do not decode alone (its stream_problem, the same tokenizer as ours);
        # with such a tokenizer the text of such a call goes when the call returns.
        self.engine_streams = self.decoupled and text_stream.chunk_decoding_problem(self.tokenizer) is None
        # Speculation policy (specdeploy.speculation.policy): the instances of this repository share the active count,
        # and those of this server (its tritonserver is our parent) the measured costs, acceptance and gate
        sharing.remove_abandoned(tempfile.gettempdir())
        folder = sharing.instances_folder(tempfile.gettempdir(), args.get("model_repository", ""))
        self.active = sharing.ActiveCount(folder)
        self.deployment = pol.SharedPolicy(
            pol.PolicySettings.from_parameters(params, self.default_num_draft_tokens), self.active
        )
        self.shared = sharing.SharedState(folder, self.deployment, os.getppid())
        # Prometheus metrics on Triton's metrics port and the canary's control arm (specdeploy.metrics)
        self.ops = recorder.BlsOps.in_triton(pb_utils, self.name, self.max_draft_len, params)

    def execute(self, requests):
        arrival_ns = time.time_ns()
        return common.execute_all(
            requests, self.decoupled, lambda request, emit: self._serve(request, emit, arrival_ns), FINAL
        )

    def _serve(self, request, emit, arrival_ns):
        try:
            job = self._parse(request)
        except (RequestError, SpecDeployError) as exc:
            emit(_error(f"{self.name}: {common.error_text(exc)}"), True)
            return
        job["stop_check"] = cancellation.request_cancel_check(request, self.request_timeout_s)
        job["wanted"] = _requested_outputs(request)
        job["ops"] = self.ops.start(
            requested_k=pb_utils.get_input_tensor_by_name(request, "num_draft_tokens") is not None
        )
        ok = False
        try:
            self.active.set_busy(True)
            self.shared.pull()
            ok = self._run(job, arrival_ns, emit)
        except (BlsModelError, SpecDeployError) as exc:
            emit(_error(f"{self.name}: {common.error_text(exc)}"), True)
        except Exception as exc:
            traceback.print_exc()
            emit(_error(f"{self.name}: internal error: {type(exc).__name__}: {exc}"), True)
        finally:
            self.shared.push()
            self.active.set_busy(False)
            self.ops.finish(job["ops"], len(job["prompt_ids"]), bool(ok))

    def _parse(self, request) -> dict:
        get = request_inputs.input_reader(request)
        optional_inputs.refuse_unsupported(get, REFUSED)
        text_input = get("text_input")
        request_inputs.require_single(text_input, "text_input")
        text = request_inputs.decode_utf8(text_input.reshape(-1)[0], "text_input")
        prompt_ids = request_inputs.encode_prompt(self.tokenizer, text, self.add_special_tokens, self.max_input_len)
        max_tokens = request_inputs.scalar(get("max_tokens"), "max_tokens", int)
        max_tokens = request_inputs.check_output_len(len(prompt_ids), max_tokens, self.max_seq_len)
        num_draft_tokens = request_inputs.scalar(
            get("num_draft_tokens"), "num_draft_tokens", int, self.default_num_draft_tokens
        )
        if num_draft_tokens < 0:
            raise RequestError(f"num_draft_tokens is {num_draft_tokens}, must be >= 0")
        if num_draft_tokens > self.max_draft_len:
            raise RequestError(
                f"num_draft_tokens ({num_draft_tokens}) is larger than the target engine's max_draft_len "
                f"({self.max_draft_len}); send at most {self.max_draft_len}"
            )
        sampling = speculation_sampling.SamplingParams(**request_inputs.sampling_fields(get, "top_k", "top_p"))
        end_id = request_inputs.scalar(get("end_id"), "end_id", int, self.default_end_id)
        stream = request_inputs.scalar(get("stream"), "stream", bool, False)
        if stream and not self.decoupled:
            raise RequestError("stream needs the model deployed in decoupled mode (recipe triton.decoupled: true)")
        n_seq = request_inputs.scalar(get("num_return_sequences"), "num_return_sequences", int, 1)
        if n_seq != 1:
            raise RequestError(
                f"input 'num_return_sequences' is {n_seq}; tensorrt_llm_bls returns one sequence (send 1, or use"
                " ensemble)"
            )
        stop_texts = request_inputs.strings(get("stop_words"), "stop_words")
        stop_words = request_inputs.encode_words(self.tokenizer, stop_texts)
        bad_words = request_inputs.encode_words(self.tokenizer, request_inputs.strings(get("bad_words"), "bad_words"))
        bias = optional_inputs.embedding_bias_from_words(
            self.tokenizer, get("embedding_bias_words"), get("embedding_bias_weights"), len(self.tokenizer)
        )
        return {
            "prompt_ids": prompt_ids,
            "max_tokens": max_tokens,
            "num_draft_tokens": num_draft_tokens,
            "sampling": sampling,
            "end_id": end_id if end_id is not None and end_id >= 0 else None,
            "stop_words": stop_words,
            "stop_texts": stop_texts,
            "bad_words_list": request_inputs.to_words_list(bad_words),
            "stop_words_list": request_inputs.to_words_list(stop_words),
            "use_draft_logits": request_inputs.scalar(
                get("use_draft_logits"), "use_draft_logits", bool, self.default_use_draft_logits
            ),
            "stream": stream,
            "exclude_input": request_inputs.scalar(
                get("exclude_input_in_output"), "exclude_input_in_output", bool, False
            ),
            "perf": request_inputs.scalar(get("return_perf_metrics"), "return_perf_metrics", bool, False),
            "penalties": optional_inputs.penalty_fields(get),
            "embedding_bias": bias,
            "return_log_probs": request_inputs.scalar(get("return_log_probs"), "return_log_probs", bool, False),
            "return_context_logits": request_inputs.scalar(
                get("return_context_logits"), "return_context_logits", bool, False
            ),
            "return_generation_logits": request_inputs.scalar(
                get("return_generation_logits"), "return_generation_logits", bool, False
            ),
        }

    def _run(self, job, arrival_ns, emit):
        if self.eagle3:
            return self._run_fused(job, arrival_ns, emit)
        record = Record()
        times = {"arrival": arrival_ns, "scheduled": time.time_ns(), "first": None}
        stream = text_stream.TextStream(self.tokenizer, self.skip_special_tokens) if job["stream"] else None
        streamed = [0]  # output tokens already pushed into `stream`

        def send(ids):
            streamed[0] += len(ids)
            delta = stream.push(ids)
            if delta:
                emit(self._response(delta, job, None, times, record, None), False)

        if self.ngram is not None:
            proposer = ngram.NGramProposer(self.ngram, self.ngram_pool)
        elif self.suffix is not None:
            proposer = ngram.SuffixProposer(self.suffix)
        else:
            proposer = TritonProposer(self.draft, job)
        # a plain run's tokens as they come (bls_calls.PlainRunStream). Not kept in `job`: `send` holds the job and the
        # response sender, and a cycle through them left the sender to the garbage collector, which freed it at the
        # stub's teardown after its shared memory was gone (SIGSEGV, "Garbage-collecting", tests/test_triton_server.py)
        verifier = TritonVerifier(
            self.target,
            job,
            record,
            self.deployment.costs,
            self.active,
            stream_sink=send if stream is not None and self.engine_streams else None,
        )
        ops = job["ops"]  # the canary arm and the metrics of this request
        rounds = spec.speculative_generate(
            proposer,
            self.ops.verifier(ops, verifier, job["max_tokens"], len(job["prompt_ids"])),
            job["prompt_ids"],
            max_new_tokens=job["max_tokens"],
            # logits come only from calls without drafts (TritonVerifier.verify): such a request is served plain
            num_draft_tokens=(
                0
                if job["return_context_logits"] or job["return_generation_logits"]
                else self.ops.num_draft_tokens(ops, job["num_draft_tokens"])
            ),
            sampling=job["sampling"],
            end_id=job["end_id"],
            stop_words=job["stop_words"],
            use_draft_logits=job["use_draft_logits"],
            should_stop=job["stop_check"],
            policy=self.ops.policy(ops, self.deployment.request(), self.deployment),
        )
        output, stats = [], spec.SpecStats()
        extras = {"log_probs": [], "logits": []}
        for item in rounds:
            if isinstance(item, spec.SpecStats):
                stats = item
                continue
            if job["end_id"] is not None and item and item[-1] == job["end_id"]:
                # the loop ends at the first end id; NVIDIA's BLS returns its last target call's output_ids, which
                # hold no end token (tensorrt_llm.py _without_end_token; tensorrtllm_backend@c2e65b8
                # all_models/inflight_batcher_llm/tensorrt_llm_bls/1/lib/decode.py:353,380)
                item = item[:-1]
                if not item:
                    continue
            times["first"] = times["first"] or record.first_token_ns or time.time_ns()
            output.extend(item)
            self.ops.tokens(ops, len(item))
            # this round's tokens came from the latest target call (a prefix of what it returned)
            round_log_probs, round_logits = record.rounds[-1] if record.rounds else (None, None)
            if round_log_probs is not None:
                extras["log_probs"].extend(round_log_probs[: len(item)])
            if round_logits is not None:
                extras["logits"].append(round_logits[: len(item)])
            if stream is not None and len(output) > streamed[0]:  # what a streamed plain run did not send already
                send(output[streamed[0] :])
        if job["stop_check"].reason is not None:
            what = "ran past its server-side deadline" if job["stop_check"].reason == "timeout" else "was cancelled"
            emit(_error(f"{self.name}: the request {what} after {len(output)} tokens"), True)
            return
        emit(self._response(self._last_text(job, stream, output), job, stats, times, record, extras, len(output)), True)
        return True

    def _run_fused(self, job, arrival_ns, emit):
        """draft.kind eagle3: one tensorrt_llm call that drafts with the head inside, k = the request's num_draft_tokens
        (the canary's control arm, and requests that want logits: 0), capped by the static policy (schedule, gate).
        The metrics get one round per target pass: the prefill (no draft: the head has no features yet), then each
        verification pass with its drafted / accepted counts. `stream`: the call asks tensorrt_llm for `streaming` (a
        response per round, as TensorRT-LLM's one-model speculative modes stream from the tensorrt_llm model:
        tensorrtllm_backend c2e65b8 docs/model_config.md:314) and each round's new text is sent as it comes, holding
        back an incomplete UTF-8 character; the counts go in the final response (see engine_streams for the exception).
        NVIDIA's own BLS refuses `stream` with drafts (its two-model loop, tensorrt_llm_bls/1/lib/decode.py:116-119)."""
        ops = job["ops"]
        times = {"arrival": arrival_ns, "scheduled": time.time_ns(), "first": None}
        wants_logits = job["return_context_logits"] or job["return_generation_logits"]
        # the static policy: schedule and gate may turn it off
        k, plain_reason = self.ops.fused_k(
            ops,
            0 if wants_logits else job["num_draft_tokens"],
            self.max_draft_len,
            self.deployment.fused_request(),
            self.deployment,
        )
        extra = {
            "bad_words_list": job["bad_words_list"][None],
            "stop_words_list": job["stop_words_list"][None],
            "return_log_probs": np.array([[job["return_log_probs"]]]),
            "return_context_logits": np.array([[job["return_context_logits"]]]),
            "num_draft_tokens": np.array([[k]], dtype=np.int32),
            **request_tensors(job, 0),
        }
        wanted = [
            "output_log_probs",
            "kv_cache_reused_blocks",
            "kv_cache_alloc_total_blocks",
            "first_token_time_ns",
            "draft_tokens_per_round",
            "accepted_draft_tokens_per_round",
            "lookup_draft_rounds",
            "draft_seconds_per_round",
            "forward_seconds_per_pass",
        ] + (["context_logits"] if job["return_context_logits"] else [])
        stream, on_tokens = None, None
        if job["stream"]:
            stream = text_stream.TextStream(self.tokenizer, self.skip_special_tokens)
            if self.engine_streams:
                extra["streaming"] = np.array([[True]])

                def on_tokens(ids):
                    delta = stream.push(ids)
                    if delta:
                        emit(self._response(delta, job, None, times, None, None), False)

        started = time.perf_counter()
        tokens, logits, outputs = self.target(
            job["prompt_ids"],
            job["max_tokens"],
            job["sampling"],
            extra,
            job["return_generation_logits"],
            wanted,
            stop_check=job["stop_check"],
            slice_s=cancellation.run_slice_s(job["max_tokens"], RUN_TOKEN_GUESS_S, self.active()),
            on_tokens=on_tokens,
        )
        call_s = time.perf_counter() - started
        if job["stop_check"].reason is not None:
            what = "ran past its server-side deadline" if job["stop_check"].reason == "timeout" else "was cancelled"
            emit(_error(f"{self.name}: the request {what} after {len(tokens)} tokens"), True)
            return
        flat = lambda name, kind=int: [kind(x) for a in outputs.get(name, []) for x in a.reshape(-1)]  # noqa: E731
        drafted_rounds, accepted_rounds = flat("draft_tokens_per_round"), flat("accepted_draft_tokens_per_round")
        rounds = self.ops.fused_rounds(
            ops,
            k,
            self.max_draft_len,
            job["max_tokens"],
            drafted_rounds,
            accepted_rounds,
            len(tokens),
            call_s,
            plain_reason,
            self.deployment.settings.policy,
            flat("lookup_draft_rounds"),
            flat("forward_seconds_per_pass", float),
            flat("draft_seconds_per_round", float),
        )
        record = Record()
        log_probs = (
            [float(x) for a in outputs.get("output_log_probs", []) for x in a.reshape(-1)]
            if job["return_log_probs"]
            else None
        )
        if outputs.get("context_logits"):
            rows = outputs["context_logits"][0]
            record.context_logits = rows.reshape(-1, rows.shape[-1])
        last = {n: int(outputs[n][-1].reshape(-1)[0]) for n in wanted[1:4] if outputs.get(n)}
        record.kv_reused = last.get("kv_cache_reused_blocks", 0)
        record.kv_total = last.get("kv_cache_alloc_total_blocks", 0)
        times["first"] = last.get("first_token_time_ns", 0) or (time.time_ns() if tokens else None)
        self.ops.tokens(ops, len(tokens))
        stats = spec.SpecStats(
            drafted=sum(drafted_rounds),
            accepted=sum(accepted_rounds),
            output_tokens=len(tokens),
            k_per_round=rounds.k,
            accepted_per_round=rounds.accepted,
            target_iterations=len(rounds.k),
            draft_s_per_round=rounds.draft_s,
            target_s_per_round=rounds.target_s,
            policy="eagle3-fused",
        )
        extras = {"log_probs": log_probs or [], "logits": [logits[: len(tokens)]] if logits is not None else []}
        if stream is not None and on_tokens is None:  # not streamed by tensorrt_llm: the whole text now
            stream.push(tokens)
        emit(self._response(self._last_text(job, stream, tokens), job, stats, times, record, extras, len(tokens)), True)
        return True

    def _last_text(self, job, stream, output: list[int]) -> str:
        """The last response's text: a streamed request's text not sent yet, else the whole answer (with the prompt
        unless excluded), cut at its first stop text."""
        if stream is not None:
            return stream.flush()
        ids = output if job["exclude_input"] else job["prompt_ids"] + output
        return self._cut_at_stop_text(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens), job)

    def _cut_at_stop_text(self, text: str, job) -> str:
        """A whole answer ends after its first stop word found in the generated text, as NVIDIA's BLS cuts text_output
        (tensorrtllm_backend c2e65b8, tensorrt_llm_bls/1/model.py:146-167: the stop words in their order, from the
        generation's start), also where the model wrote the word inside other tokens than its own (the engine stops
        only where the tokens match)."""
        start = (
            0
            if job["exclude_input"]
            else len(self.tokenizer.decode(job["prompt_ids"], skip_special_tokens=self.skip_special_tokens))
        )
        return request_inputs.cut_at_stop_text(text, job["stop_texts"], start)

    def _response(self, text, job, stats, times, record, extras, n_output=0):
        # [1], flat as NVIDIA's BLS sends it (its clients read text_output[0] as bytes)
        outputs = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object))]
        if stats is None:  # a streamed chunk: text only
            return pb_utils.InferenceResponse(output_tensors=outputs)
        now = time.time_ns()
        log_probs = extras["log_probs"] if job["return_log_probs"] else []
        values = {
            "cum_log_probs": np.array([[sum(log_probs)]], dtype=np.float32),
            "output_log_probs": np.array(log_probs, dtype=np.float32).reshape(1, 1, -1),
            "context_logits": (
                record.context_logits[None].astype(np.float32)
                if record.context_logits is not None
                else np.zeros((1, 0, 0), np.float32)
            ),
            "generation_logits": (
                torch.cat(extras["logits"]).float().numpy()[None, None]
                if extras["logits"]
                else np.zeros((1, 1, 0, 0), np.float32)
            ),
            "batch_index": np.array([[0]], dtype=np.int32),
            "sequence_index": np.array([[0]], dtype=np.int32),
            "kv_cache_alloc_new_blocks": np.array([[record.kv_total - record.kv_reused]], dtype=np.int32),
            "kv_cache_reused_blocks": np.array([[record.kv_reused]], dtype=np.int32),
            "kv_cache_alloc_total_blocks": np.array([[record.kv_total]], dtype=np.int32),
            "arrival_time_ns": np.array([[times["arrival"]]], dtype=np.int64),
            "first_scheduled_time_ns": np.array([[times["scheduled"]]], dtype=np.int64),
            "first_token_time_ns": np.array([[times["first"] or now]], dtype=np.int64),
            "last_token_time_ns": np.array([[now]], dtype=np.int64),
            "acceptance_rate": np.array([[stats.acceptance_rate]], dtype=np.float32),
            "total_accepted_draft_tokens": np.array([[stats.accepted]], dtype=np.int32),
            "total_draft_tokens": np.array([[stats.drafted]], dtype=np.int32),
        }
        if (
            "sequence_length" in job["wanted"]
        ):  # the answer's output tokens, [batch, beam] as tensorrt_llm's (OUTPUT_COUNT)
            values["sequence_length"] = np.array([[n_output]], dtype=np.int32)
        # per round, [1, rounds], only when asked for (the seconds are empty where the target did not time its passes)
        for name, per_round, dtype in (
            ("speculative_k_history", stats.k_per_round, np.int32),
            ("speculative_draft_seconds", stats.draft_s_per_round, np.float32),
            ("speculative_target_seconds", stats.target_s_per_round, np.float32),
        ):
            if name in job["wanted"]:
                values[name] = np.array(per_round, dtype=dtype).reshape(1, -1)
        outputs += [pb_utils.Tensor(k, v) for k, v in values.items()]
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def finalize(self):
        self.active.close(when_last=self.shared.files)
        self.ops.close()
        self.held.clear()  # the stub's queue has long been idle: its clean-ups are done (common.HeldResponses)


def _requested_outputs(request) -> set:
    """The output names the client asked for (Triton fills in every output when it named none)."""
    try:
        return set(request.requested_output_names())
    except AttributeError:  # a stub without the call: only NVIDIA's outputs
        return set()


def _error(message: str):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
