"""tensorrt_llm / tensorrt_llm_draft on the CPU backend: one engine behind specdeploy's Executor.

What NVIDIA's `tensorrtllm` backend model does for one request, with its tensor names: generate
`request_output_len` tokens after `input_ids`, or, given `draft_input_ids` (and optionally
`draft_logits`), verify them in one pass and return the accepted prefix plus one own token
(draft_tokens_external). Prefix KV reuse across requests is the Executor's pool, so the BLS rounds
only compute their new positions. In decoupled mode with `streaming`, one response per token
(the new tokens only, as TensorRT-LLM streams); otherwise one response.

With the parameter `inflight_batching` (recipe `triton.inflight_batching`), requests do not wait for
each other: `execute` hands each request to a thread and returns None at once, so Triton passes the
next requests in while earlier ones run (the python backend of Triton 2.51 lets a model answer through
the request's response sender in decoupled and non-decoupled mode alike: one final response for the
latter). The threads feed one `BatchScheduler`, which steps all active requests in one engine forward
per step (continuous batching, at most `max_batch_size` requests) over one KV pool of that many
sequences plus as many kept for prefix reuse. Each request's tokens are those it would get alone.
"""

import os
import sys

# The python stub runs in isolated mode (PYTHONPATH ignored): the launcher passes our site-packages.
sys.path[:0] = [p for p in os.environ.get("SPECDEPLOY_SITE", "").split(os.pathsep) if p]

import dataclasses  # noqa: E402
import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from specdeploy.core.errors import SpecDeployError  # noqa: E402
from specdeploy.triton.models import (
    cancellation,
    common,  # noqa: E402
    optional_inputs,
    request_inputs,
    stub_safety,
    text_stream,
)
from specdeploy.triton.models.request_inputs import RequestError  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


# NVIDIA's engine-model inputs this model cannot honour (accepted only at their neutral value).
REFUSED = (
    "encoder_input_features",
    "encoder_output_lengths",
    "decoder_input_ids",
    "decoder_input_lengths",
    "beam_width",
    "runtime_top_p_decay",
    "prompt_embedding_table",
    "prompt_table_extra_ids",
    "prompt_vocab_size",
    "cross_attention_mask",
    "mrope_rotary_cos_sin",
    "mrope_position_deltas",
    "lora_task_id",
    "lora_weights",
    "lora_config",
    "context_phase_params",
    "skip_cross_attn_blocks",
    "guided_decoding_guide_type",
    "guided_decoding_guide",
    "lookahead_window_size",
    "lookahead_ngram_size",
    "lookahead_verification_set_size",
)


class Cancelled(Exception):
    """The client cancelled the request or its server-side deadline passed."""


class TritonPythonModel:
    def initialize(self, args):
        from specdeploy.engine.request import EngineRequest
        from specdeploy.speculation.sampling import SamplingParams

        self._GenerationRequest, self._SamplingParams = EngineRequest, SamplingParams
        params = common.parameters(args)
        self.name = args["model_name"]
        self.decoupled = common.is_decoupled(args)
        # the most sequences one request may ask for: as many as the model batches (each is a live sequence)
        self.max_return_sequences = max(1, int(json.loads(args.get("model_config") or "{}").get("max_batch_size") or 1))
        self.exclude_input_default = common.flag(params.get("exclude_input_in_output"), False)
        self.request_timeout_s = float(params.get("request_timeout_s") or 0.0)
        factory = common.load_object(
            params.get("executor_factory") or "specdeploy.triton.models.common:load_cpu_executor"
        )
        # draft.kind eagle3: the EAGLE-3 head (copied into this model's folder by `specdeploy repo`) runs inside the
        # executor (engine/executor.py, the fused loop); a request drafts with it only when it sends num_draft_tokens >
        # 0
        head_dir = common.resolve_dir(params["eagle3_head"], args) if params.get("eagle3_head") else None
        self.eagle3 = head_dir is not None
        draft_p_min = float(params.get("eagle3_draft_p_min") or 0.0)  # speculative.draft_p_min
        head_weights = params.get("eagle3_head_weights") or "bf16"  # draft.head_weights
        policy = (
            params.get("eagle3_policy") or "static"
        )  # speculative.policy: cost decides draft by draft in the engine
        lookup = int(params.get("eagle3_sa_threshold") or 0)  # draft.sa_config.threshold (0: no suffix lookup)
        vocab = int(
            params.get("eagle3_serve_vocab_size") or 0
        )  # draft.serve_vocab_size (0: the whole draft vocabulary)
        load = lambda: common.with_eagle3_head(
            factory(params["gpt_model_path"]),
            head_dir,
            draft_p_min,
            head_weights,
            policy,  # noqa: E731
            lookup,
            vocab,
        )
        self.executor, self.batcher = self._load(args, params, load)
        self._stub_lock = stub_safety.StubLock()  # the batching path's request threads and scheduler share the stub
        self._running = cancellation.RunningRequests()  # request id -> its stop check, for TensorRT-LLM's `stop` input
        spec = self.executor.engine.spec
        self.vocab_size = int(getattr(spec, "vocab_size", 0)) or None
        # The BLS resends the whole sequence every round: inputs may be as long as max_seq_len minus
        # the tokens asked for (the client-facing max_input_len is checked by preprocessing and the BLS).
        self.max_seq_len = min(int(params["max_seq_len"]), int(spec.max_seq_len))
        self.max_draft_len = min(int(params["max_draft_len"]), int(getattr(spec, "max_draft_len", 0) or 0))
        # Streamed tokens are held back until they complete text (common.HoldBack), so that the
        # ensemble's postprocessing, which decodes each streamed response on its own, sends whole
        # characters. Only for tokenizers where that per-response decoding is exact; with another
        # tokenizer `streaming` is refused with the reason (the BLS streams exactly with any).
        self.tokenizer, self.stream_problem = None, None
        if self.decoupled and params.get("tokenizer_dir"):
            self.tokenizer = common.load_tokenizer(common.resolve_dir(params["tokenizer_dir"], args))
            self.stream_problem = text_stream.chunk_decoding_problem(self.tokenizer)
        self.skip_special_tokens = common.flag(params.get("skip_special_tokens"), True)

    def _load(self, args, params, load):
        """(executor, BatchScheduler or None). The scheduler when in-flight batching is on (the parameter, or
        SPECDEPLOY_INFLIGHT_BATCHING=1 to run a test suite both ways) and the executor can step requests; its
        executor is then loaded in the scheduler's thread (BatchScheduler.loading: every engine pass in one thread
        keeps torch's OpenMP team fast)."""
        on = (
            common.flag(params.get("inflight_batching"), False) or os.environ.get("SPECDEPLOY_INFLIGHT_BATCHING") == "1"
        )
        if not on:
            return load(), None
        from specdeploy.engine.batching import BatchScheduler

        max_batch_size = max(1, int(json.loads(args["model_config"]).get("max_batch_size") or 1))

        def load_for_batching():
            executor = load()
            # one pool per instance: max_batch_size live sequences, and as many finished ones kept for reuse
            executor.max_cached_sequences = max(executor.max_cached_sequences, max_batch_size)
            return executor

        batcher = BatchScheduler.loading(load_for_batching, max_batch_size)
        if batcher.executor.in_flight_batching:
            return batcher.executor, batcher
        batcher.close()  # an executor that cannot step requests runs them one after another
        return batcher.executor, None

    def execute(self, requests):
        arrival_ns = time.time_ns()
        if self.batcher is None:
            return common.execute_all(
                requests, self.decoupled, lambda request, emit: self._serve(request, emit, arrival_ns), FINAL
            )
        for request in requests:  # each request on its own thread, all stepped together by the batcher
            sender = request.get_response_sender()
            if self.decoupled:
                emit = lambda response, final, s=sender: stub_safety.send(s, response, FINAL if final else 0)  # noqa: E731
            else:  # one response per request, sent with the final flag
                emit = lambda response, final, s=sender: stub_safety.send(s, response, FINAL) if final else None  # noqa: E731
            threading.Thread(target=self._serve_locked, args=(request, emit, arrival_ns), daemon=True).start()
        return None

    def _serve_locked(self, request, emit, arrival_ns):
        """A request thread of the batching path: every triton_python_backend_utils call under the stub lock."""
        with self._stub_lock:
            self._serve(request, emit, arrival_ns)

    # ------------------------------------------------------------ one request

    def _serve(self, request, emit, arrival_ns):
        try:
            get = request_inputs.input_reader(request)
            if request_inputs.scalar(get("stop"), "stop", bool, False):
                # TensorRT-LLM's `stop`: end the running request with this request id (it answers with the
                # tokens it has); the stop request itself gets an empty final response
                stopped = self._running.stop(request.request_id())
                print(
                    f"{self.name}: stop for request id {request.request_id()!r}: {stopped} running request(s) stopped",
                    flush=True,
                )
                emit(self._response([], None, None, {}, None, _Times(arrival_ns)), True)
                return
            gen, flags = self._parse(get)
        except (RequestError, SpecDeployError) as exc:
            emit(_error(f"{self.name}: {common.error_text(exc)}"), True)
            return
        except Exception as exc:  # noqa: BLE001  unanswered, a request thread's exception left its client waiting forever
            traceback.print_exc()
            emit(_error(f"{self.name}: internal error reading the request: {type(exc).__name__}: {exc}"), True)
            return
        flags["arrival_ns"] = arrival_ns
        # with the batcher, the scheduler thread polls it between steps: under the stub lock
        flags["stop_check"] = cancellation.request_cancel_check(
            request, self.request_timeout_s, self._stub_lock if self.batcher else None
        )
        gen.is_cancelled = flags["stop_check"]  # also checked between prefill chunks inside the executor
        try:
            with self._running.registered(request.request_id(), flags["stop_check"]):
                self._generate_all(gen, flags, emit)
        except Cancelled as exc:
            emit(_error(f"{self.name}: {exc}"), True)
        except SpecDeployError as exc:
            emit(_error(f"{self.name}: {common.error_text(exc)}"), True)
        except Exception as exc:  # an engine failure: answer this request, keep serving the others
            traceback.print_exc()
            emit(_error(f"{self.name}: internal error: {type(exc).__name__}: {exc}"), True)

    def _parse(self, get):
        optional_inputs.refuse_unsupported(get, REFUSED)
        ids, out_len = self._prompt(get)
        draft_tokens, draft_logits = self._drafts(get)
        streaming, n_seq = self._sequences(get, draft_tokens)
        sampling = self._SamplingParams(**request_inputs.sampling_fields(get, "runtime_top_k", "runtime_top_p"))
        num_draft_tokens = self._eagle3_draft_count(get, draft_tokens)
        end_id = request_inputs.scalar(get("end_id"), "end_id", int, None)
        pad_id = request_inputs.scalar(get("pad_id"), "pad_id", int, None)
        return_log_probs = request_inputs.scalar(get("return_log_probs"), "return_log_probs", bool, False)
        flags = {
            "exclude_input": request_inputs.scalar(
                get("exclude_input_in_output"), "exclude_input_in_output", bool, self.exclude_input_default
            ),
            "return_logits": request_inputs.scalar(
                get("return_generation_logits"), "return_generation_logits", bool, False
            ),
            "return_context_logits": request_inputs.scalar(
                get("return_context_logits"), "return_context_logits", bool, False
            ),
            "return_log_probs": return_log_probs,
            "perf": request_inputs.scalar(get("return_perf_metrics"), "return_perf_metrics", bool, False),
            "streaming": streaming,
            "num_return_sequences": n_seq,
            "eagle3_rounds": self.eagle3,
        }
        values = {
            **optional_inputs.penalty_fields(get),
            "embedding_bias": self._embedding_bias(get("embedding_bias")),
            "return_log_probs": return_log_probs,
            "return_context_logits": flags["return_context_logits"],
        }
        gen = self._GenerationRequest(
            input_ids=ids,
            max_new_tokens=out_len,
            sampling=sampling,
            end_id=end_id if end_id is not None and end_id >= 0 else None,
            pad_id=pad_id,
            stop_words=request_inputs.from_words_list(get("stop_words_list"), "stop_words_list"),
            bad_words=request_inputs.from_words_list(get("bad_words_list"), "bad_words_list"),
            draft_tokens=draft_tokens,
            draft_logits=draft_logits,
            **({"num_draft_tokens": num_draft_tokens} if num_draft_tokens else {}),
            # logits are kept for return_generation_logits, and to derive log probs when the executor gives none
            return_logits=flags["return_logits"] or return_log_probs,
            # one chunk per token where the request streams, or runs on the stub's thread (cancellation and the deadline
            # are checked per chunk); a non-streaming request in the batcher gets one chunk at the end: the executor
            # checks gen.is_cancelled (cancellation, deadline, `stop`) between steps and stamps the first token in its
            # stats, and a chunk a step would wake the request's thread, and hand it the GIL, every step
            streaming=streaming or self.batcher is None,
            **optional_inputs.request_kwargs(self._GenerationRequest, values),
        )
        return gen, flags

    def _prompt(self, get):
        """The prompt's ids (input_lengths honoured, each id in the vocabulary) and request_output_len, checked."""
        input_ids = get("input_ids")
        if input_ids is None:
            raise RequestError("input_ids is required (encoder inputs are not supported by the cpu backend)")
        request_inputs.require_single(input_ids, "input_ids")
        ids = input_ids.reshape(-1).tolist()
        length = request_inputs.scalar(get("input_lengths"), "input_lengths", int, len(ids))
        if not 0 <= length <= len(ids):
            raise RequestError(f"input_lengths is {length} but input_ids holds {len(ids)} ids")
        ids = [int(t) for t in ids[:length]]
        if not ids:
            raise RequestError("input_ids is empty; send a non-empty prompt")
        request_inputs.check_token_ids(ids, self.vocab_size, "input_ids")
        out_len = request_inputs.scalar(get("request_output_len"), "request_output_len", int)
        out_len = request_inputs.check_output_len(
            len(ids), out_len, self.max_seq_len, "request_output_len (max_tokens)"
        )
        return ids, out_len

    def _drafts(self, get):
        """draft_input_ids and draft_logits (None when absent or empty), checked against max_draft_len and the
        vocabulary."""
        draft = get("draft_input_ids")
        draft_tokens = None if draft is None or draft.size == 0 else [int(t) for t in draft.reshape(-1).tolist()]
        if draft_tokens is not None:
            if len(draft_tokens) > self.max_draft_len:
                raise RequestError(
                    f"Number of draft tokens ({len(draft_tokens)}) is larger than maximum number of draft tokens "
                    f"({self.max_draft_len}); lower num_draft_tokens or rebuild the target with a larger max_draft_len"
                )
            request_inputs.check_token_ids(draft_tokens, self.vocab_size, "draft_input_ids")
        draft_logits = get("draft_logits")
        if draft_logits is not None and draft_logits.size == 0:
            draft_logits = None
        if draft_logits is not None:
            if draft_tokens is None:
                raise RequestError("draft_logits given without draft_input_ids")
            draft_logits = torch.from_numpy(
                np.ascontiguousarray(draft_logits.reshape(-1, draft_logits.shape[-1]), dtype=np.float32)
            )
            if draft_logits.shape[0] != len(draft_tokens) or (
                self.vocab_size and draft_logits.shape[1] != self.vocab_size
            ):
                raise RequestError(
                    f"draft_logits has shape {list(draft_logits.shape)}, expected [{len(draft_tokens)},"
                    f" {self.vocab_size}] (one row per draft token)"
                )
        return draft_tokens, draft_logits

    def _sequences(self, get, draft_tokens):
        """streaming and num_return_sequences, refused where this deployment cannot serve them."""
        streaming = request_inputs.scalar(get("streaming"), "streaming", bool, False)
        if streaming and not self.decoupled:
            raise RequestError("streaming needs the model deployed in decoupled mode (recipe triton.decoupled: true)")
        if streaming and self.stream_problem:
            raise RequestError(
                f"streaming is not supported with this tokenizer: {self.stream_problem}, so the streamed text would"
                " differ from the whole text; stream from tensorrt_llm_bls (stream=true) or send stream=false"
            )
        n_seq = request_inputs.scalar(get("num_return_sequences"), "num_return_sequences", int, 1)
        if n_seq < 1:
            raise RequestError(f"num_return_sequences is {n_seq}; send 1 or more")
        if n_seq > self.max_return_sequences:  # INT32_MAX of them held the model for hours (bench/fuzz.py)
            raise RequestError(
                f"num_return_sequences is {n_seq}, above this model's max_batch_size {self.max_return_sequences}; "
                "send at most that many (or raise engine.max_batch_size)"
            )
        if n_seq > 1 and not self.decoupled:
            raise RequestError(
                "num_return_sequences > 1 needs decoupled mode (one response per sequence; recipe triton.decoupled:"
                " true)"
            )
        if n_seq > 1 and draft_tokens is not None:
            raise RequestError("num_return_sequences > 1 cannot be combined with draft_input_ids")
        return streaming, n_seq

    def _eagle3_draft_count(self, get, draft_tokens):
        """num_draft_tokens for the EAGLE-3 head (0: the target alone), capped by the engine's max_draft_len."""
        if not self.eagle3:
            return 0
        num_draft_tokens = request_inputs.scalar(get("num_draft_tokens"), "num_draft_tokens", int, 0)
        if num_draft_tokens < 0:
            raise RequestError(f"num_draft_tokens is {num_draft_tokens}, must be >= 0 (0: the target alone)")
        if num_draft_tokens and draft_tokens is not None:
            raise RequestError("num_draft_tokens > 0 (the EAGLE-3 head drafts) cannot be combined with draft_input_ids")
        return min(num_draft_tokens, self.max_draft_len)

    def _embedding_bias(self, array):
        if array is None or np.asarray(array).size == 0:
            return None
        bias = np.asarray(array, dtype=np.float32).reshape(-1)
        vocab = self.vocab_size or bias.size
        if bias.size > vocab and np.any(bias[vocab:]):
            raise RequestError(
                f"embedding_bias has {bias.size} entries with non-zero ones past the vocabulary ({vocab}); send [vocab]"
                " weights"
            )
        out = np.zeros(vocab, dtype=np.float32)
        out[: min(vocab, bias.size)] = bias[:vocab]
        return None if not np.any(out) else torch.from_numpy(out)

    def _generate_all(self, gen, flags, emit):
        n = flags["num_return_sequences"]
        greedy = self._is_greedy(gen.sampling)
        base_seed = (
            gen.sampling.seed if gen.sampling.seed is not None else int(np.random.SeedSequence().entropy % (1 << 62))
        )
        done = None
        for index in range(n):
            if greedy and done is not None:  # greedy: every sequence is the same, as in TensorRT-LLM with beam width 1
                for response in done:
                    emit(_with_sequence_index(response, index), index == n - 1)
                continue
            if n > 1:
                gen.sampling = dataclasses.replace(gen.sampling, seed=base_seed + index)
            responses = []
            self._generate(
                gen, flags, index, lambda r, final, i=index: (responses.append(r), emit(r, final and i == n - 1))
            )
            done = [r for r in responses]

    @staticmethod
    def _is_greedy(sampling):
        from specdeploy.speculation.sampling import is_greedy

        return is_greedy(sampling)

    def _generate(self, gen, flags, sequence_index, emit):
        times = _Times(flags["arrival_ns"])
        times.scheduled_ns = time.time_ns()
        tokens, logits, log_probs, context_logits = [], [], [], None
        held = _Held(self.tokenizer, self.skip_special_tokens) if flags["streaming"] else None
        chunks = (
            self.executor.generate(gen)
            if self.batcher is None
            else self._stub_lock.released_while(self.batcher.generate(gen))
        )
        end_log_prob = (
            0.0  # the end token's log prob: in cum_log_probs, not in output_log_probs (see _without_end_token)
        )
        try:
            for raw_chunk in chunks:
                chunk, dropped = _without_end_token(
                    raw_chunk, gen.end_id, self._log_probs(raw_chunk, gen) if flags["return_log_probs"] else None
                )
                end_log_prob += dropped
                now = time.time_ns()
                if times.first_ns is None and chunk.token_ids:
                    times.first_ns = int(getattr(chunk.stats, "first_token_time_ns", 0) or 0) or now
                if chunk.finish_reason in ("cancelled", "timeout") and flags["stop_check"].reason != "stopped":
                    raise Cancelled(
                        self._cancel_text(
                            flags["stop_check"].reason or chunk.finish_reason, flags, len(tokens) + len(chunk.token_ids)
                        )
                    )
                if context_logits is None and getattr(chunk, "context_logits", None) is not None:
                    context_logits = chunk.context_logits
                chunk_log_probs = chunk.log_probs if flags["return_log_probs"] else None
                times.last_ns = now
                if flags["streaming"]:
                    # one response per run of tokens that completes text (per token for ASCII), the rest at the end
                    ready = held.push(chunk.token_ids, chunk.logits, chunk_log_probs, chunk.finished)
                    if ready is not None:
                        ids, ready_logits, ready_log_probs = ready
                        response = self._response(
                            ids,
                            ready_logits,
                            ready_log_probs,
                            flags,
                            chunk.stats,
                            times,
                            sequence_index,
                            context_logits if not held.sent else None,
                            len(gen.input_ids) + len(tokens) + len(chunk.token_ids),
                            end_log_prob if chunk.finished else 0.0,
                        )
                        held.sent += len(ids)
                        emit(response, chunk.finished)
                    tokens.extend(chunk.token_ids)
                else:
                    tokens.extend(chunk.token_ids)
                    if chunk.logits is not None:
                        logits.append(chunk.logits)
                    if chunk_log_probs is not None:
                        log_probs.extend(chunk_log_probs)
                    if chunk.finished:
                        ids = tokens if flags["exclude_input"] else list(gen.input_ids) + tokens
                        all_logits = torch.cat(logits) if logits else None
                        emit(
                            self._response(
                                ids,
                                all_logits,
                                log_probs if flags["return_log_probs"] else None,
                                flags,
                                chunk.stats,
                                times,
                                sequence_index,
                                context_logits,
                                len(gen.input_ids) + len(tokens),
                                end_log_prob,
                            ),
                            True,
                        )
                if chunk.finished:
                    return
                if flags["stop_check"]() and flags["stop_check"].reason != "stopped":  # stopped: the executor ends it
                    raise Cancelled(self._cancel_text(flags["stop_check"].reason, flags, len(tokens)))
        finally:
            chunks.close()  # a cancelled request gives its KV cache back to the pool at once

    @staticmethod
    def _cancel_text(reason, flags, produced):
        if reason == "timeout":
            return (
                f"the request ran past its server-side deadline of {flags['stop_check'].deadline_s:.3g} s after"
                f" {produced} tokens"
            )
        return f"the request was cancelled after {produced} tokens"

    @staticmethod
    def _log_probs(chunk, gen):
        given = getattr(chunk, "log_probs", None)
        if given is not None:
            return [float(x) for x in given]
        if chunk.logits is None or not chunk.token_ids:
            return []
        # The log-probability of each chosen token under the distribution it was chosen from.
        from specdeploy.speculation import sampling as speculation_sampling
        from specdeploy.speculation import verify

        rows = chunk.logits.float()  # [n, vocab]
        if speculation_sampling.is_greedy(
            gen.sampling
        ):  # greedy: the log-softmax of the logits, as TensorRT-LLM reports it
            log_dist = torch.log_softmax(rows, dim=-1)
        else:
            log_dist = torch.log(verify.sampling_distribution(rows, gen.sampling).clamp_min(1e-30))
        return log_dist[torch.arange(len(chunk.token_ids)), torch.tensor(chunk.token_ids)].tolist()

    def _response(
        self,
        ids,
        logits,
        log_probs,
        flags,
        stats,
        times,
        sequence_index=0,
        context_logits=None,
        total_tokens=0,
        end_log_prob=0.0,
    ):
        vocab = self.vocab_size or 0
        outputs = {
            "output_ids": np.array(ids, dtype=np.int32).reshape(1, 1, -1),  # [batch, beam, len]
            "sequence_length": np.array([[len(ids)]], dtype=np.int32),  # [batch, beam]
        }
        # Every output is sent (empty or zero when not asked for): the ensemble maps them all.
        if flags.get("return_log_probs") and log_probs is not None:
            outputs["cum_log_probs"] = np.array([[sum(log_probs) + end_log_prob]], dtype=np.float32)  # [batch, beam]
            outputs["output_log_probs"] = np.array(log_probs, dtype=np.float32).reshape(1, 1, -1)  # [batch, beam, len]
        else:
            outputs["cum_log_probs"] = np.zeros((1, 1), np.float32)
            outputs["output_log_probs"] = np.zeros((1, 1, 0), np.float32)
        if flags.get("return_context_logits") and context_logits is not None:
            outputs["context_logits"] = (
                context_logits.float().numpy().reshape(1, -1, context_logits.shape[-1])
            )  # [batch, prompt, vocab]
        else:
            outputs["context_logits"] = np.zeros((1, 0, vocab), np.float32)
        if flags.get("return_logits") and logits is not None:
            rows = logits.float().numpy()
            outputs["generation_logits"] = rows.reshape(1, 1, *rows.shape[-2:]).astype(
                np.float32
            )  # [batch, beam, len, vocab]
        else:
            outputs["generation_logits"] = np.zeros((1, 1, 0, vocab), np.float32)
        outputs["batch_index"] = np.array([[0]], dtype=np.int32)
        outputs["sequence_index"] = np.array([[sequence_index]], dtype=np.int32)
        new, reused, total = common.kv_blocks(stats, total_tokens)
        outputs["kv_cache_alloc_new_blocks"] = np.array([[new]], dtype=np.int32)
        outputs["kv_cache_reused_blocks"] = np.array([[reused]], dtype=np.int32)
        outputs["kv_cache_alloc_total_blocks"] = np.array([[total]], dtype=np.int32)
        now = time.time_ns()
        drafted = getattr(stats, "drafted", 0) if stats is not None else 0
        accepted = getattr(stats, "accepted", 0) if stats is not None else 0
        outputs["arrival_time_ns"] = np.array([[times.arrival_ns]], dtype=np.int64)
        outputs["first_scheduled_time_ns"] = np.array([[times.scheduled_ns or times.arrival_ns]], dtype=np.int64)
        outputs["first_token_time_ns"] = np.array([[times.first_ns or now]], dtype=np.int64)
        outputs["last_token_time_ns"] = np.array([[times.last_ns or now]], dtype=np.int64)
        outputs["acceptance_rate"] = np.array([[accepted / drafted if drafted else 0.0]], dtype=np.float32)
        outputs["total_accepted_draft_tokens"] = np.array([[accepted]], dtype=np.int32)
        outputs["total_draft_tokens"] = np.array([[drafted]], dtype=np.int32)
        if flags.get("eagle3_rounds"):
            # per verification pass after the prefill (GenerationStats.k_per_round; 0: a plain step), final only
            final = stats is not None and getattr(stats, "fused", False)
            per_round = list(getattr(stats, "k_per_round", [])) if final else []
            accepted_round = list(getattr(stats, "accepted_per_round", [])) if final else []
            outputs["draft_tokens_per_round"] = np.array(per_round, dtype=np.int32).reshape(1, -1)
            outputs["accepted_draft_tokens_per_round"] = np.array(accepted_round, dtype=np.int32).reshape(1, -1)
            # 1 where that pass's drafts were the request's own text (draft.sa_config), not the head's
            lookup_round = list(getattr(stats, "lookup_per_round", [])) if final else []
            outputs["lookup_draft_rounds"] = np.array(lookup_round, dtype=np.int32).reshape(1, -1)
            # seconds: the head's work before each of those passes, and every engine pass, the prefill first
            draft_s = list(getattr(stats, "draft_s_per_round", [])) if final else []
            pass_s = [stats.first_forward_time_s] + list(getattr(stats, "target_s_per_round", [])) if final else []
            outputs["draft_seconds_per_round"] = np.array(draft_s, dtype=np.float32).reshape(1, -1)
            outputs["forward_seconds_per_pass"] = np.array(pass_s, dtype=np.float32).reshape(1, -1)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in outputs.items()])

    def finalize(self):
        if self.batcher is not None:
            self.batcher.close()
        self.executor = None


def _without_end_token(chunk, end_id, log_probs):
    """(chunk, the dropped end token's log prob): the chunk as TensorRT-LLM reports it when the sequence ended at
    `end_id`, the end token left out of the tokens and their log probs. `log_probs` are the chunk's
    (None when not asked for); the returned chunk carries them in `log_probs`.

    TensorRT-LLM never counts the end token as an output token:
    - its samplers write the chosen id, add its log prob to cum_log_probs, and on the end id set FINISHED_EOS
      without advancing the sequence length ("Do not increase seq len when EOS is generated. Seq len should
      always contain only tokens to be outputted": NVIDIA/TensorRT-LLM@03961722
      cpp/tensorrt_llm/kernels/samplingTopKKernels.cu topKStage2Sampling, the same in samplingTopPKernels.cu);
      output_log_probs are read up to the sequence length, so they hold no entry for it while cum_log_probs does;
    - with several new tokens per step (draft_input_ids verified in one pass), `explicitEOSCriterion` finds the
      first end id among them and cuts the sequence length and numNewTokens to the position before it, so accepted
      draft tokens after the end id are dropped too (NVIDIA/TensorRT-LLM cpp/tensorrt_llm/kernels/
      stopCriteriaKernels.cu explicitEOSCriterion; the accepted-token copy in externalDraftTokensKernels.cu
      likewise stops at an end id without counting it);
    - the backend's output_ids are the executor's Result.outputTokenIds and sequence_length their count
      (triton-inference-server/tensorrtllm_backend@c2e65b8 inflight_batcher_llm/src/model_instance_state.cc:1059-1098).
    A stop word stays in the output (stopWordsCriterion cuts "up to stopped word (including)", same file), and a
    request that reaches request_output_len keeps all its tokens (lengthCriterion): only the end id is dropped.
    The input is never examined: a prompt that ends with the end id is generated on like any other.
    generation_logits keep the row of the step that chose the end id: TensorRT-LLM fills one row per decoding step
    it ran, in a [beamWidth, maxNewTokens, vocab] buffer ([1, numDraftTokens + 1, vocab] when verifying), not one
    per output token (NVIDIA/TensorRT-LLM cpp/include/tensorrt_llm/batch_manager/llmRequest.h
    allocGenerationLogitsHost / setGenerationLogitsHost)."""
    if not (
        chunk.finished
        and chunk.finish_reason == "end_id"
        and chunk.token_ids
        and end_id is not None
        and chunk.token_ids[-1] == end_id
    ):
        return (chunk if log_probs is None else dataclasses.replace(chunk, log_probs=list(log_probs))), 0.0
    dropped = float(log_probs[-1]) if log_probs else 0.0
    return (
        dataclasses.replace(
            chunk,
            token_ids=list(chunk.token_ids[:-1]),
            log_probs=None if log_probs is None else list(log_probs[:-1]),
        ),
        dropped,
    )


class _Held:
    """Streamed tokens (with their logits and log probs) held until they complete text (common.HoldBack)."""

    def __init__(self, tokenizer, skip_special_tokens):
        self.hold = (
            text_stream.HoldBack(tokenizer.backend_tokenizer, skip_special_tokens) if tokenizer is not None else None
        )
        self.ids, self.logits, self.log_probs = [], [], []
        self.sent = 0  # tokens sent so far

    def push(self, ids, logits, log_probs, finished):
        """(ids, logits [n, vocab] or None, log probs or None) to send now, or None to wait; all at the end."""
        self.ids += list(ids)
        if logits is not None:
            self.logits.append(logits)
        if log_probs is not None:
            self.log_probs += list(log_probs)
        n = len(self.ids)  # without a tokenizer: every token at once
        if self.hold is not None:
            self.hold.push(ids)
            n = len(self.ids) if finished else len(self.ids) - self.hold.pending
            if finished:
                self.hold.flush()
        if n == 0 and not finished:
            return None
        out_logits = torch.cat(self.logits)[:n] if self.logits else None
        out = (self.ids[:n], out_logits, self.log_probs[:n] if log_probs is not None else None)
        rest = torch.cat(self.logits)[n:] if self.logits else None
        self.ids, self.log_probs = self.ids[n:], self.log_probs[n:]
        self.logits = [rest] if rest is not None and len(rest) else []
        return out


class _Times:
    def __init__(self, arrival_ns):
        self.arrival_ns = arrival_ns
        self.scheduled_ns = None
        self.first_ns = None
        self.last_ns = None


def _with_sequence_index(response, index):
    tensors = [
        pb_utils.Tensor("sequence_index", np.array([[index]], dtype=np.int32)) if t.name() == "sequence_index" else t
        for t in response.output_tensors()
    ]
    return pb_utils.InferenceResponse(output_tensors=tensors)


def _error(message: str):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
