"""What the validation client knows about a deployment, and the endpoint that speaks to it.

A `Deployment` is the whole of it: where the speculative and the control path answer, over which
protocol and layout, under which model names, with which tokenizer, and what the deployment is known
to export (a metrics endpoint, a speculation policy, quality reports, a machine price). It is built
either from a recipe (`specdeploy.deploy.recipe_deployment`, the pipeline/CLI layer) or from the CLI options
of `specdeploy validate --url ... --tokenizer ...` for a deployment specdeploy did not make (`foreign`).
The client never reads a recipe, a repository or a server state file itself.

Model names (NVIDIA's layouts, the defaults when none is given):
- inflight_batcher_llm: speculative `tensorrt_llm_bls` (NVIDIA/TensorRT-LLM@0193dbd
  triton_backend/all_models/inflight_batcher_llm/tensorrt_llm_bls/config.pbtxt:27), control `ensemble`
  (NVIDIA/TensorRT-LLM@2a9abd9 triton_backend/all_models/inflight_batcher_llm/ensemble/config.pbtxt:27);
  triage through `preprocessing` + `tensorrt_llm` (the ensemble's steps).
- llmapi: speculative `tensorrt_llm` (NVIDIA/TensorRT-LLM@0a71057
triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt:27);
  NVIDIA ships one model, so the control is a second one: `tensorrt_llm_control` in the same repository
  (specdeploy's layout; loaded side by side or swapped by Triton's explicit model control), or the same
  name on another server (`control_url`).
- openai: model ids as `/v1/models` lists them; specdeploy's front serves `<name>-speculative` and
  `<name>-control`, recognised when no id is given.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specdeploy.client.protocol import CONTROL_MODEL, PREPROCESSING_MODEL, SPECULATIVE_MODEL, TARGET_MODEL
from specdeploy.core.errors import ConfigError

PROTOCOLS = ("triton", "openai")
LAYOUTS = ("inflight_batcher_llm", "llmapi")
CONTROL_LOADINGS = (
    "side_by_side",
    "load_unload",
)  # both models loaded; or one at a time (Triton explicit model control)
LLMAPI_MODEL, LLMAPI_CONTROL_MODEL = "tensorrt_llm", "tensorrt_llm_control"
DEFAULT_NAMES = {
    "inflight_batcher_llm": {SPECULATIVE_MODEL: SPECULATIVE_MODEL, CONTROL_MODEL: CONTROL_MODEL},
    "llmapi": {SPECULATIVE_MODEL: LLMAPI_MODEL, CONTROL_MODEL: LLMAPI_CONTROL_MODEL},
}
FRONT_SUFFIXES = (
    "-speculative",
    "-control",
    "-canary",
)  # specdeploy's OpenAI front (specdeploy.ops.openai.requests.routes)


@dataclass(frozen=True)
class Deployment:
    """One deployment to validate. Model names None: the layout's defaults (module docstring)."""

    url: str  # triton: gRPC host:port; openai: the API's base URL (host:port, http://host:port[/v1])
    tokenizer: str  # a local tokenizer directory or a Hugging Face model name
    protocol: str = "triton"
    layout: str = "inflight_batcher_llm"  # the Triton layout (protocol triton)
    speculative_model: str | None = None
    control_model: str | None = None
    control_url: str | None = None  # the control served by another server of the same protocol
    control_loading: str = "side_by_side"  # llmapi: load_unload swaps the two models by explicit model control
    triton_url: str | None = None  # openai: the Triton deployment under the front (exact tokens, configs, triage)
    canary_model: str | None = None  # openai, specdeploy's front: where a request without num_draft_tokens goes
    fixed_num_draft_tokens: int | None = None  # openai, specdeploy's front: the k it always sends
    use_draft_logits: bool | None = None  # inflight_batcher_llm: the BLS's use_draft_logits input (None: not sent)
    metrics_url: str | None = None  # Triton's metrics endpoint (HOST:PORT or a /metrics URL)
    name: str = ""  # the report's title: the recipe's name, else the URL
    foreign: bool = True  # not built from a recipe: no manifests, policy or price beyond what the server shows
    policy: dict = field(default_factory=dict)  # the speculation policy the recipe configured (served config wins)
    quality: dict = field(default_factory=dict)  # the quantize stage's quality reports, by role
    price_per_hour: float = 0.0  # 0: no cost section
    currency: str = "USD"

    def __post_init__(self):
        check_choice("--protocol", self.protocol, PROTOCOLS)
        check_choice("--layout", self.layout, LAYOUTS)
        check_choice("--control-loading", self.control_loading, CONTROL_LOADINGS)
        if not self.url:
            raise ConfigError(
                "no deployment address given",
                "pass --url HOST:PORT (Triton gRPC, or the OpenAI API's base URL with --protocol openai)",
            )
        if self.control_loading == "load_unload" and (self.layout != "llmapi" or self.protocol != "triton"):
            raise ConfigError(
                "--control-loading load_unload swaps the llmapi layout's two models by Triton's explicit model control",
                "use it with --layout llmapi over --protocol triton, or serve the control elsewhere (--control-url)",
            )
        if self.use_draft_logits is not None and not self.per_request_draft_tokens:
            raise ConfigError(
                "--use-draft-logits/--no-draft-logits is an input of the inflight_batcher_llm layout's BLS",
                "drop it, or validate an inflight_batcher_llm deployment over Triton",
            )
        if self.control_loading == "load_unload" and self.control_url:
            raise ConfigError(
                "--control-loading load_unload and --control-url both say where the control is", "give one of them"
            )
        if self.protocol == "triton" and self.control_loading != "load_unload":  # (load_unload swaps one name's model)
            names = self.names()
            speculative = (self.url, names[SPECULATIVE_MODEL])
            control = (self.control_url or self.url, names[CONTROL_MODEL])
            if speculative == control:  # parity and speedup would compare a path with itself, and pass
                raise ConfigError(
                    f"the speculative and the control path are the same model ({speculative[1]} at {speculative[0]})",
                    "point --control-model or --control-url at the target alone (for llmapi: the control's own server)",
                )

    @property
    def title(self) -> str:
        return self.name or self.url

    def names(self) -> dict[str, str]:
        """Core model name -> served model name (openai: model ids; empty until `openai_ids` resolves them)."""
        if self.protocol == "openai":
            return {
                k: v for k, v in ((SPECULATIVE_MODEL, self.speculative_model), (CONTROL_MODEL, self.control_model)) if v
            }
        defaults = DEFAULT_NAMES[self.layout]
        control_default = (
            defaults[SPECULATIVE_MODEL] if (self.layout == "llmapi" and self.control_url) else defaults[CONTROL_MODEL]
        )
        return {
            SPECULATIVE_MODEL: self.speculative_model or defaults[SPECULATIVE_MODEL],
            CONTROL_MODEL: self.control_model or control_default,
            TARGET_MODEL: TARGET_MODEL,
            PREPROCESSING_MODEL: PREPROCESSING_MODEL,
        }

    @property
    def per_request_draft_tokens(self) -> bool:
        """Whether a request can carry its own num_draft_tokens (the BLS input); llmapi and OpenAI fix k per
        deployment."""
        return self.protocol == "triton" and self.layout == "inflight_batcher_llm"

    def describe(self) -> dict:
        """The report's `deployment` section (no recipe internals)."""
        d = asdict(self)
        for key in ("policy", "quality"):
            d.pop(key)
        d["served_names"] = self.names()
        return d


def check_choice(option: str, value: str, choices) -> None:
    if value not in choices:
        raise ConfigError(
            f"{option} {value!r} is not one of {', '.join(choices)}", f"use {option} " + " or ".join(choices)
        )


def open_endpoint(deployment: Deployment):
    """The Endpoint over the deployment (a Triton gRPC, llmapi or OpenAI adapter; the control routed to its own
    server when `control_url` is set). Creating it sends nothing: readiness is checked by the run."""
    names = deployment.names()
    if deployment.protocol == "openai":
        from specdeploy.client.openai_adapter import OpenAIEndpoint
        from specdeploy.client.triton_adapter import TritonEndpoint

        triton = TritonEndpoint(deployment.triton_url) if deployment.triton_url else None
        return OpenAIEndpoint(
            deployment.url,
            triton=triton,
            num_draft_tokens=deployment.fixed_num_draft_tokens,
            ids=names,
            canary_id=deployment.canary_model,
            control_url=deployment.control_url,
        )
    if deployment.layout == "llmapi":
        from specdeploy.client.llmapi_adapter import LlmapiEndpoint

        main = LlmapiEndpoint(
            deployment.url,
            load_unload=deployment.control_loading == "load_unload",
            names=names,
            missing_hint=_missing_hint(deployment),
        )
        control = (
            LlmapiEndpoint(deployment.control_url, names=names, missing_hint=_missing_hint(deployment))
            if deployment.control_url
            else None
        )
    else:
        from specdeploy.client.triton_adapter import TritonEndpoint

        # use_draft_logits: an input of NVIDIA's BLS (NVIDIA/TensorRT-LLM@0193dbd
        # triton_backend/all_models/inflight_batcher_llm/tensorrt_llm_bls/config.pbtxt:237), beside num_draft_tokens
        # (:231)
        knobs = {} if deployment.use_draft_logits is None else {"use_draft_logits": deployment.use_draft_logits}
        main = TritonEndpoint(
            deployment.url, names=names, missing_hint=_missing_hint(deployment), speculative_inputs=knobs
        )
        control = (
            TritonEndpoint(deployment.control_url, names=names, missing_hint=_missing_hint(deployment))
            if deployment.control_url
            else None
        )
    return ControlElsewhere(main, control) if control is not None else main


def _missing_hint(deployment: Deployment) -> str | None:
    if not deployment.foreign:
        return None  # the adapter's own hint: regenerate the repository
    return (
        "name the served models: --speculative-model NAME and --control-model NAME "
        f"(defaults for --layout {deployment.layout}: {', '.join(DEFAULT_NAMES[deployment.layout].values())})"
    )


class ControlElsewhere:
    """An Endpoint whose control path is served by a second server (`--control-url`); all else goes to `main`."""

    def __init__(self, main, control):
        self.main, self.control = main, control
        self.url = main.url
        self.control_url = control.url
        self.served_names = getattr(main, "served_names", {})

    def _for(self, model: str):
        return self.control if model == CONTROL_MODEL else self.main

    def check_ready(self, models) -> None:
        self.main.check_ready([m for m in models if m != CONTROL_MODEL])
        if CONTROL_MODEL in models:
            self.control.check_ready([CONTROL_MODEL])

    def is_decoupled(self, model: str) -> bool:
        return self._for(model).is_decoupled(model)

    def model_parameters(self, model: str) -> dict[str, str]:
        return self._for(model).model_parameters(model)

    def generate(self, model, request, timeout_s, *args, **kwargs):
        return self._for(model).generate(model, request, timeout_s, *args, **kwargs)

    def trace(self, *args, **kwargs):
        return self.main.trace(*args, **kwargs)

    @property
    def dropped_inputs(self) -> dict:
        return {**getattr(self.control, "dropped_inputs", {}), **getattr(self.main, "dropped_inputs", {})}

    def close(self) -> None:
        self.main.close()
        self.control.close()
