"""tensorrt_llm and tensorrt_llm_control of the llmapi layout on the CPU backend: TensorRT-LLM's `llmapi`
Triton model interface (triton_backend/all_models/llmapi/tensorrt_llm: `text_input`, `streaming`,
`sampling_param_*`, `return_*_reason`, the perf outputs) over specdeploy's CPU engines.

`1/model.yaml` holds LLM-API options as TensorRT-LLM's model reads them: `model` (here the target engine),
`tokenizer`, `speculative_config` (decoding_type DraftTarget/Draft_Target with the draft engine under
`speculative_model` or `speculative_model_dir`, or NGram with its fields) and `triton_config`. Without a
`speculative_config` the model is the target alone: that is the control. Each round's draft length comes from
specdeploy's speculation policy (the config parameters, as in tensorrt_llm_bls), capped by max_draft_len.

Meanings follow the LLM API: `sampling_param_max_tokens` defaults to 32; greedy unless a temperature above 0,
top_k above 1 or top_p is sent (a temperature alone samples the whole distribution); a streamed response holds
the whole text so far, as CompletionOutput.text does (less the last characters a stop string could still
complete); `sampling_param_stop` ends the output before the first stop string, matched in the decoded text. Requests run
one after another per instance. Refused with a message, never ignored: LoRA and image inputs, best_of > 1, penalties,
return_cumulative_logprob. The kv_cache_* outputs are not returned (the speculative loop does not count KV blocks per
request).
"""

import os
import sys

# The python stub runs in isolated mode (PYTHONPATH ignored): the launcher passes our site-packages.
sys.path[:0] = [p for p in os.environ.get("SPECDEPLOY_SITE", "").split(os.pathsep) if p]

import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
import yaml  # noqa: E402

from specdeploy.core.errors import SpecDeployError  # noqa: E402
from specdeploy.core.metrics import recorder
from specdeploy.engine.generate import (
    ExecutorProposer,
    ExecutorVerifier,
    fused_generate,
    target_only_generate,
)  # noqa: E402
from specdeploy.speculation import loop as spec  # noqa: E402
from specdeploy.speculation import ngram, sampling
from specdeploy.speculation import policy as pol  # noqa: E402
from specdeploy.triton.models import (
    cancellation,
    common,  # noqa: E402
    request_inputs,
)
from specdeploy.triton.models.request_inputs import RequestError  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
DEFAULT_MAX_TOKENS = 32  # tensorrt_llm.SamplingParams.max_tokens
DRAFT_MODEL_KEYS = ("speculative_model", "speculative_model_dir")  # 1.3+ and the older name (trtllm.LLMAPI_VERSIONS)
DRAFT_TARGET_TYPES = ("Draft_Target", "DraftTarget")
EAGLE3_TYPES = ("Eagle3", "Eagle")  # Eagle3DecodingConfig from 1.3, EagleDecodingConfig before (gpu/llmapi_versions.py)
REFUSED = ("image_url", "lora_id", "lora_name", "lora_path", "lora_ckpt_source")
PENALTIES = ("sampling_param_frequency_penalty", "sampling_param_presence_penalty")


def _error(message: str):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))


class TritonPythonModel:
    def initialize(self, args):
        params = common.parameters(args)
        self.name = args["model_name"]
        self.decoupled = common.is_decoupled(args)
        self.request_timeout_s = float(params.get("request_timeout_s") or 0.0)
        self.add_special_tokens = common.flag(params.get("add_special_tokens"), True)
        model_dir = Path(args["model_repository"]) / str(args["model_version"])
        options = yaml.safe_load((model_dir / "model.yaml").read_text())
        factory = common.load_object(
            params.get("executor_factory") or "specdeploy.triton.models.common:load_cpu_executor"
        )
        self.target = factory(options["model"])
        self.tokenizer = common.load_tokenizer(Path(options.get("tokenizer") or options["model"]))
        self.end_id = self.tokenizer.eos_token_id
        self.max_seq_len = int(options.get("max_seq_len") or self.target.engine.spec.max_seq_len)
        self.max_input_len = int(options.get("max_input_len") or self.max_seq_len - 1)
        self.draft, self.ngram, self.ngram_pool, self.suffix = None, None, None, None
        self.eagle3 = False
        self.max_draft_len = 0
        speculative = options.get("speculative_config")
        if speculative:
            self.max_draft_len = int(speculative["max_draft_len"])
            kind = speculative["decoding_type"]
            if kind in DRAFT_TARGET_TYPES:
                key = next((k for k in DRAFT_MODEL_KEYS if speculative.get(k)), None)
                if key is None:
                    raise pb_utils.TritonModelException(
                        f"{self.name}: speculative_config names no draft ({' or '.join(DRAFT_MODEL_KEYS)})"
                    )
                self.draft = factory(speculative[key])
            elif kind in EAGLE3_TYPES:
                # the head runs inside the target's executor (the fused loop), with specdeploy's own cut-off
                key = next((k for k in DRAFT_MODEL_KEYS if speculative.get(k)), None)
                if key is None:
                    raise pb_utils.TritonModelException(
                        f"{self.name}: speculative_config names no EAGLE-3 head ({' or '.join(DRAFT_MODEL_KEYS)})"
                    )
                self.target = common.with_eagle3_head(
                    self.target,
                    speculative[key],
                    float(params.get("eagle3_draft_p_min") or 0.0),
                    params.get("eagle3_head_weights") or "bf16",
                    params.get("speculation_policy") or "static",
                    self._sa_threshold(params, speculative),
                    int(params.get("eagle3_serve_vocab_size") or 0),
                )
                self.eagle3 = True
            elif kind == "NGram":
                # TensorRT-LLM's fields from speculative_config; specdeploy's own minimum from the model's parameters
                self.ngram = ngram.NGramSettings(
                    **{f: speculative[f] for f in ngram.TRTLLM_FIELDS if f in speculative},
                    min_matching_ngram_size=int(params.get("min_matching_ngram_size", "1")),
                )
                self.ngram_pool = ngram.NGramPool(self.ngram) if self.ngram.is_public_pool else None
            elif kind == "SA":  # the standalone suffix automaton over each request's own text
                self.suffix = ngram.SuffixSettings(
                    self.max_draft_len, int(speculative.get("max_matching_ngram_size", -1))
                )
            else:
                raise pb_utils.TritonModelException(
                    f"{self.name}: decoding_type {kind!r} is not served by the cpu backend "
                    f"(it serves {', '.join(DRAFT_TARGET_TYPES + EAGLE3_TYPES)}, NGram and SA)"
                )
            settings = pol.PolicySettings.from_parameters(params, self.max_draft_len)
            self.deployment = pol.SharedPolicy(settings)
            self.ops = recorder.BlsOps.in_triton(pb_utils, self.name, self.max_draft_len, params)
        self._running = cancellation.RunningRequests()  # request id -> its stop check, for the `stop` input

    @property
    def speculative(self) -> bool:
        return self.max_draft_len > 0

    def _sa_threshold(self, params: dict, speculative: dict) -> int:
        """The suffix lookup's threshold (draft.sa_config): specdeploy's model parameter where it sets one, else an
        `sa_config` in the options' speculative_config (TensorRT-LLM's SAEnhancerConfig, threshold 4 by default: a
        user's own model.yaml); 0: none."""
        if int(params.get("eagle3_sa_threshold") or 0) > 0:
            return int(params["eagle3_sa_threshold"])
        sa = speculative.get("sa_config")
        if sa is None:
            return 0
        if sa.get("enable_global_pool"):
            raise pb_utils.TritonModelException(
                f"{self.name}: sa_config.enable_global_pool is true, but the CPU engine "
                "looks up each request's own tokens only"
            )
        return int(sa.get("threshold", 4))

    def finalize(self):
        if getattr(self, "ops", None) is not None:
            self.ops.close()  # metrics.TritonSink.close

    def execute(self, requests):
        arrival_ns = time.time_ns()
        return common.execute_all(
            requests, self.decoupled, lambda request, emit: self._serve(request, emit, arrival_ns), FINAL
        )

    def _serve(self, request, emit, arrival_ns):
        get = request_inputs.input_reader(request)
        if request_inputs.scalar(get("stop"), "stop", bool, False):
            stopped = self._running.stop(request.request_id())
            emit(
                _error(
                    f"{self.name}: stopped {stopped} running request(s) with id {request.request_id()!r}"
                    if stopped
                    else f"{self.name}: no running request with id {request.request_id()!r} to stop"
                ),
                True,
            )
            return
        try:
            job = self._parse(get)
        except (RequestError, SpecDeployError) as exc:
            emit(_error(f"{self.name}: {common.error_text(exc)}"), True)
            return
        check = cancellation.request_cancel_check(request, self.request_timeout_s)
        timer = self.ops.start(requested_k=False) if self.speculative else None
        ok = False
        try:
            with self._running.registered(request.request_id(), check):
                ok = self._run(job, check, timer, arrival_ns, emit)
        except SpecDeployError as exc:
            emit(_error(f"{self.name}: {common.error_text(exc)}"), True)
        except Exception as exc:
            traceback.print_exc()
            emit(_error(f"{self.name}: internal error: {type(exc).__name__}: {exc}"), True)
        finally:
            if timer is not None:
                self.ops.finish(timer, len(job["prompt_ids"]), bool(ok))

    def _parse(self, get) -> dict:
        for name in REFUSED:
            if get(name) is not None:
                raise RequestError(
                    f"input '{name}' is not served by the cpu backend's llmapi model (no LoRA adapters, no images);"
                    " leave it out"
                )
        for name in PENALTIES:
            if request_inputs.scalar(get(name), name, float, 0.0) != 0.0:
                raise RequestError(
                    f"input '{name}' is set; the cpu backend's llmapi model has no penalties (send 0 or leave it out)"
                )
        if request_inputs.scalar(get("sampling_param_best_of"), "sampling_param_best_of", int, 1) != 1:
            raise RequestError("sampling_param_best_of is above 1; this model returns one sequence (send 1)")
        if request_inputs.scalar(get("return_cumulative_logprob"), "return_cumulative_logprob", bool, False):
            raise RequestError(
                "return_cumulative_logprob is not served by the cpu backend's llmapi model (leave it false)"
            )
        text_input = get("text_input")
        if text_input is None or text_input.size != 1:
            raise RequestError(
                "text_input must hold exactly one prompt (a 1-D tensor of one string), as in TensorRT-LLM's llmapi"
                " model"
            )
        text = request_inputs.decode_utf8(text_input.reshape(-1)[0], "text_input")
        prompt_ids = request_inputs.encode_prompt(self.tokenizer, text, self.add_special_tokens, self.max_input_len)
        max_tokens = request_inputs.scalar(
            get("sampling_param_max_tokens"), "sampling_param_max_tokens", int, DEFAULT_MAX_TOKENS
        )
        # refused, not shortened: the LLM API's own handling of a request past max_seq_len is not read here
        request_inputs.check_output_len(
            len(prompt_ids), max_tokens, self.max_seq_len, "sampling_param_max_tokens", clamp=False
        )
        streaming = request_inputs.scalar(get("streaming"), "streaming", bool, False)
        if streaming and not self.decoupled:
            raise RequestError("Streaming is only supported in decoupled mode (recipe triton.decoupled: true)")
        stops = request_inputs.strings(get("sampling_param_stop"), "sampling_param_stop")
        return {
            "text": text,
            "prompt_ids": prompt_ids,
            "max_tokens": max_tokens,
            "sampling": self._sampling(get),
            "streaming": streaming,
            "stops": stops,
            "exclude_input": request_inputs.scalar(
                get("sampling_param_exclude_input_from_output"), "sampling_param_exclude_input_from_output", bool, False
            ),
            "perf": request_inputs.scalar(
                get("sampling_param_return_perf_metrics"), "sampling_param_return_perf_metrics", bool, False
            ),
            "finish_reason": request_inputs.scalar(get("return_finish_reason"), "return_finish_reason", bool, False),
            "stop_reason": request_inputs.scalar(get("return_stop_reason"), "return_stop_reason", bool, False),
        }

    @staticmethod
    def _sampling(get) -> sampling.SamplingParams:
        """The LLM API's meaning in specdeploy's SamplingParams (TensorRT-LLM's: greedy unless top_k/top_p set)."""
        temperature = request_inputs.scalar(
            get("sampling_param_temperature"), "sampling_param_temperature", float, None
        )
        top_k = request_inputs.scalar(get("sampling_param_top_k"), "sampling_param_top_k", int, 0) or 0
        top_p = request_inputs.scalar(get("sampling_param_top_p"), "sampling_param_top_p", float, 0.0) or 0.0
        seed = request_inputs.scalar(get("sampling_param_seed"), "sampling_param_seed", int, None)
        if temperature == 0.0 or top_k == 1 or (temperature is None and not top_k and not top_p):
            return sampling.GREEDY
        if not top_k and not top_p:
            top_p = 1.0  # a temperature alone samples from the whole distribution
        return sampling.SamplingParams(
            temperature=1.0 if temperature is None else temperature, top_k=top_k, top_p=top_p, seed=seed
        )

    def _rounds(self, job, should_stop, timer):
        if not self.speculative:
            return target_only_generate(
                self.target, job["prompt_ids"], job["max_tokens"], job["sampling"], self.end_id, should_stop=should_stop
            )
        if self.eagle3:
            return self._fused_rounds(job, should_stop, timer)
        if self.ngram is not None:
            proposer = ngram.NGramProposer(self.ngram, self.ngram_pool)
        elif self.suffix is not None:
            proposer = ngram.SuffixProposer(self.suffix)
        else:
            proposer = ExecutorProposer(self.draft, self.end_id)
        verifier = ExecutorVerifier(self.target, self.end_id)
        return spec.speculative_generate(
            proposer,
            self.ops.verifier(timer, verifier, job["max_tokens"], len(job["prompt_ids"])),
            job["prompt_ids"],
            max_new_tokens=job["max_tokens"],
            num_draft_tokens=self.ops.num_draft_tokens(timer, self.max_draft_len),
            sampling=job["sampling"],
            end_id=self.end_id,
            should_stop=should_stop,
            policy=self.ops.policy(timer, self.deployment.request(), self.deployment),
        )

    def _fused_rounds(self, job, should_stop, timer):
        """draft.kind eagle3: one call of the target's executor with the head inside, k = max_draft_len (0 on the
        canary's control arm), capped by the static policy (schedule, gate); the metrics get one round per target
        pass afterwards (metrics.BlsOps.fused_rounds), as in tensorrt_llm_bls."""
        k, plain_reason = self.ops.fused_k(
            timer, self.max_draft_len, self.max_draft_len, self.deployment.fused_request(), self.deployment
        )
        started = time.perf_counter()
        stats = None
        for item in fused_generate(
            self.target, job["prompt_ids"], job["max_tokens"], k, job["sampling"], self.end_id, should_stop=should_stop
        ):
            if isinstance(item, spec.SpecStats):
                stats = item
            yield item
        if stats is not None:
            self.ops.fused_rounds(
                timer,
                k,
                self.max_draft_len,
                job["max_tokens"],
                stats.k_per_round,
                stats.accepted_per_round,
                stats.output_tokens,
                time.perf_counter() - started,
                plain_reason,
                self.deployment.settings.policy,
                stats.lookup_per_round,
                [stats.prefill_s] + stats.target_s_per_round,
                stats.draft_s_per_round,
            )

    def _run(self, job, check, timer, arrival_ns, emit) -> bool:
        times = {"arrival": arrival_ns, "scheduled": time.time_ns(), "first": None}
        output, stats = [], spec.SpecStats()
        prefix = "" if job["exclude_input"] else job["text"]
        text, stopped = "", None  # the output text (cut at a stop string), and that stop string
        hold = max((len(s) for s in job["stops"]), default=1) - 1  # a stop string may still complete over these
        watch = job["streaming"] or bool(
            job["stops"]
        )  # the text is read every round; otherwise decoded once at the end
        for item in self._rounds(job, lambda: stopped is not None or check(), timer):
            if isinstance(item, spec.SpecStats):
                stats = item
                continue
            times["first"] = times["first"] or time.time_ns()
            output.extend(item)
            if timer is not None:
                self.ops.tokens(timer, len(item))
            if not watch:
                continue
            text, stopped = cut_at_stop(self._decode(output), job["stops"])
            if job["streaming"] and len(text) > hold:  # the whole text so far, as CompletionOutput.text
                emit(self._response(prefix + (text if stopped else text[: len(text) - hold]), job, None, times), False)
        if check.reason in ("cancelled", "timeout"):
            what = "ran past its server-side deadline" if check.reason == "timeout" else "was cancelled"
            emit(_error(f"{self.name}: the request {what} after {len(output)} tokens"), True)
            return False
        if not watch:
            text = self._decode(output)
        reason = ("stop", stopped) if stopped is not None else finish_reason(stats.finish_reason)
        emit(self._response(prefix + text, job, stats, times, reason), True)
        return True

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _response(self, text, job, stats, times, reason=("stop", None)):
        outputs = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object))]
        if stats is None:  # a streamed response before the last: text only
            return pb_utils.InferenceResponse(output_tensors=outputs)
        if job["finish_reason"]:
            outputs.append(pb_utils.Tensor("finish_reason", np.array([reason[0].encode()], dtype=object)))
        if job["stop_reason"]:
            outputs.append(pb_utils.Tensor("stop_reason", np.array([str(reason[1]).encode()], dtype=object)))
        if job["perf"]:
            now = time.time_ns()
            values = {
                "arrival_time_ns": np.array([times["arrival"]], dtype=np.int64),
                "first_scheduled_time_ns": np.array([times["scheduled"]], dtype=np.int64),
                "first_token_time_ns": np.array([times["first"] or now], dtype=np.int64),
                "last_token_time_ns": np.array([now], dtype=np.int64),
                "acceptance_rate": np.array([stats.acceptance_rate], dtype=np.float32),
                "total_accepted_draft_tokens": np.array([stats.accepted], dtype=np.int32),
                "total_draft_tokens": np.array([stats.drafted], dtype=np.int32),
            }
            outputs += [pb_utils.Tensor(k, v) for k, v in values.items()]
        return pb_utils.InferenceResponse(output_tensors=outputs)


def finish_reason(reason: str | None) -> tuple[str, None]:
    """(CompletionOutput.finish_reason, stop_reason) from the loop's reason: "length", "cancelled" (the `stop` input)
    or "stop" (the end id: `FinishReason.END_ID` -> 'stop' in NVIDIA/TensorRT-LLM tensorrt_llm/executor/result.py
    GenerationResultBase._handle_sequence). The end token itself never reaches text_output: the text is decoded with
    skip_special_tokens, the LLM API's default (`_decode`)."""
    if reason == "length":
        return "length", None
    if reason in ("cancelled", "stopped"):
        return "cancelled", None
    return "stop", None


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The text up to the earliest stop string in it (the string left out, as the LLM API's default
    include_stop_str_in_output false), and that string; (text, None) when none occurs."""
    found = [(text.find(s), s) for s in stops if s and s in text]
    if not found:
        return text, None
    at, stop = min(found)
    return text[:at], stop
