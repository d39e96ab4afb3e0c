"""`Endpoint` over the llmapi layout: TensorRT-LLM's `llmapi` Triton model, speculative and control.

The core's model names map to the layout's: `tensorrt_llm_bls` (speculative) -> `tensorrt_llm`, `ensemble`
(control) -> `tensorrt_llm_control`. Requests use the llmapi tensors (`text_input`, `sampling_param_*`,
`streaming`); greedy is `sampling_param_top_k` 1, the one spelling the LLM API and specdeploy's model read alike.
A streamed response holds the whole text so far (CompletionOutput.text), so the last one is the answer. The layout
returns text only: no token ids (tokens are counted by re-tokenizing, or from the parity phase for the same text),
no target-only model to trace with, and one draft length per deployment (model.yaml), so no per-request
num_draft_tokens.

`load_unload` (recipe triton.control load_unload): the server runs in explicit model control and holds one of
the two models at a time; `use(model)` unloads the other and loads the one asked for, and validate orders its
requests so that each phase swaps once (`one_model_at_a_time`).
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import numpy as np

from specdeploy.client.protocol import (
    CONTROL_MODEL,
    SPECULATIVE_MODEL,
    GenerateRequest,
    GenerateResult,
    PerfMetrics,
    TargetTrace,
)
from specdeploy.client.triton_adapter import CONNECT_TIMEOUT_S, PERF_OUTPUTS, TritonEndpoint, _perf, _text, timing
from specdeploy.core.errors import ClientError

LLMAPI_NAMES = {
    SPECULATIVE_MODEL: "tensorrt_llm",
    CONTROL_MODEL: "tensorrt_llm_control",
}  # gpu/llmapi_repository.py MODELS
LOAD_TIMEOUT_S = 600.0


class LlmapiEndpoint(TritonEndpoint):
    """The llmapi deployment at `url` (gRPC host:port); `load_unload`: one of its two models loaded at a time."""

    def __init__(
        self,
        url: str,
        load_unload: bool = False,
        load_timeout_s: float = LOAD_TIMEOUT_S,
        names: dict | None = None,
        missing_hint: str | None = None,
    ):
        llmapi_names = {k: v for k, v in (names or LLMAPI_NAMES).items() if k in LLMAPI_NAMES}
        super().__init__(url, llmapi_names, missing_hint)
        self.one_model_at_a_time = load_unload
        self.load_timeout_s = load_timeout_s
        self.loaded: str | None = None  # load_unload: the model loaded now (None: not known yet)
        self.swaps: list[tuple[str, float]] = []  # (model loaded, seconds the swap took), in order
        self._swap_lock = threading.Lock()

    def served(self, model: str) -> str:
        if model in self.names:
            return self.names[model]
        if model in self.names.values():  # already a served name
            return model
        raise ClientError(
            f"the llmapi layout has no model for '{model}' (it serves {', '.join(self.names.values())})",
            "text outputs only: no target-only trace, no preprocessing",
        )

    # ------------------------------------------------------------ readiness and loading

    def check_ready(self, models: Sequence[str]) -> None:
        names = [self.served(m) for m in models]
        if not self.one_model_at_a_time:
            return super().check_ready(names)
        super().check_ready([])  # live
        entries = self._model_index()
        for name in names:
            if name not in entries:
                raise ClientError(
                    f"model '{name}' is not in the repository of {self.url} (it has:"
                    f" {', '.join(sorted(entries)) or 'nothing'})",
                    self.missing_hint,
                )
        ready = [n for n, e in entries.items() if e.get("state") == "READY"]
        self.loaded = ready[0] if len(ready) == 1 else None

    def _model_index(self) -> dict[str, dict]:
        """The repository index: model name -> its entry (state, version)."""
        index = self._call(
            "the model index",
            CONNECT_TIMEOUT_S,
            self._client().get_model_repository_index,
            as_json=True,
            client_timeout=CONNECT_TIMEOUT_S,
        )
        return {m.get("name"): m for m in index.get("models", [])}

    def use(self, model: str) -> None:
        """load_unload: make `model` the loaded one (unload the other first: memory for one target)."""
        if not self.one_model_at_a_time:
            return
        name = self.served(model)
        with self._swap_lock:
            if self.loaded == name:
                return
            started = time.perf_counter()
            client = self._client()
            others = sorted(set(self.names.values()) - {name})
            for other in others:
                self._call(
                    f"unloading {other}",
                    self.load_timeout_s,
                    client.unload_model,
                    other,
                    client_timeout=self.load_timeout_s,
                )
            self._wait_unloaded(others)
            self._call(
                f"loading {name}", self.load_timeout_s, client.load_model, name, client_timeout=self.load_timeout_s
            )
            self.loaded = name
            self.swaps.append((name, time.perf_counter() - started))

    def _wait_unloaded(self, names: Sequence[str]) -> None:
        """Triton's unload returns before the model's stub has exited; wait until the index says so."""
        deadline = time.monotonic() + self.load_timeout_s
        while time.monotonic() < deadline:
            states = {name: entry.get("state") for name, entry in self._model_index().items()}
            if all(states.get(n) not in ("READY", "UNLOADING", "LOADING") for n in names):
                return
            time.sleep(0.1)
        raise ClientError(
            f"{', '.join(names)} did not unload within {self.load_timeout_s:.0f} s on {self.url}", "see the server log"
        )

    # ------------------------------------------------------------ Endpoint

    def is_decoupled(self, model: str) -> bool:
        if self.one_model_at_a_time:
            self.use(model)  # an unloaded model's config is not served
        return super().is_decoupled(self.served(model))

    def model_parameters(self, model: str) -> dict[str, str]:
        name = self.served(model)
        if self.one_model_at_a_time and self.loaded != name and name not in self._configs:
            raise ClientError(
                f"{name} is not loaded now (load_unload), so its config is not served", "read the recipe instead"
            )
        return super().model_parameters(name)

    def generate(self, model: str, request: GenerateRequest, timeout_s: float, on_text=None) -> GenerateResult:
        name = self.served(model)
        self.use(model)
        inputs = {
            "text_input": np.array([request.prompt.encode("utf-8")], dtype=object),
            "sampling_param_max_tokens": np.array([request.max_tokens], dtype=np.int32),
            "sampling_param_exclude_input_from_output": np.array([True]),
            "sampling_param_return_perf_metrics": np.array([request.return_perf_metrics]),
        }
        if request.stream:
            inputs["streaming"] = np.array([True])
        s = request.sampling
        if s is None:
            inputs["sampling_param_top_k"] = np.array([1], dtype=np.int32)
        else:
            inputs["sampling_param_temperature"] = np.array([s.temperature], dtype=np.float32)
            if s.top_k:
                inputs["sampling_param_top_k"] = np.array([s.top_k], dtype=np.int32)
            if s.top_p:
                inputs["sampling_param_top_p"] = np.array([s.top_p], dtype=np.float32)
            if s.seed is not None:
                inputs["sampling_param_seed"] = np.array([s.seed], dtype=np.uint64)
        inputs = self._declared(name, inputs, required=("text_input", "sampling_param_max_tokens"))
        outputs = [
            "text_output",
            *(o for o in (PERF_OUTPUTS if request.return_perf_metrics else ()) if self._has_output(name, o)),
        ]
        responses, first_s, start, latency = self._exchange(
            name, super().is_decoupled(name), inputs, outputs, timeout_s, on_text
        )
        texts = [t for t in (_text(r) for r in responses) if t]
        perf = _perf(responses[-1]) if request.return_perf_metrics and responses else PerfMetrics()
        ttft, decode, source = timing(request.stream, start, first_s, start + latency, perf)
        return GenerateResult(texts[-1] if texts else "", latency, ttft, source, decode, len(responses), perf)

    def trace(self, prompt: str, max_tokens: int, timeout_s: float, with_logits: bool = True) -> TargetTrace:
        raise ClientError(
            "the llmapi layout has no target-only model to trace (text outputs only)",
            "divergences are located in the text; use the inflight_batcher_llm layout to triage with logits",
        )
