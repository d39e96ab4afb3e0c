"""What one validation run is asked to do (`Options`, from a recipe or from CLI options, checked) and the checks of
those settings against the deployment (`check_sweep`); `parse_range` reads --sweep-draft-tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdeploy.core.errors import ConfigError
from specdeploy.recipe.config import SpeculativeConfig, ValidationConfig, exact_verification
from specdeploy.speculation.sampling import SamplingParams


@dataclass(frozen=True)
class Options:
    """Everything a run needs; `from_recipe` takes the recipe's `validation`/`speculative` sections."""

    # Defaults are the recipe's (specdeploy.recipe.config), written once there.
    prompt_set: str = ValidationConfig.prompt_set
    max_prompts: int = ValidationConfig.max_prompts
    max_tokens: int = ValidationConfig.max_tokens
    concurrency: tuple[int, ...] = ValidationConfig.concurrency
    repeats: int = ValidationConfig.repeats
    min_parity: float = ValidationConfig.min_parity
    min_speedup: float = ValidationConfig.min_speedup
    near_tie_margin: float = ValidationConfig.near_tie_margin
    request_timeout_s: float = ValidationConfig.request_timeout_s
    chat_template: str = ValidationConfig.chat_template
    min_compared_tokens: int = ValidationConfig.min_compared_tokens
    min_compared_share: float = ValidationConfig.min_compared_share
    latency_prompts: int = ValidationConfig.latency_prompts
    exact_verification: bool = True  # from the recipe's backend (specdeploy.recipe.config.exact_verification)
    num_draft_tokens: int = SpeculativeConfig.num_draft_tokens
    max_draft_len: int = SpeculativeConfig.max_draft_len
    stream: bool = False  # decoupled deployments: stream for a client-side TTFT
    sweep_draft_tokens: tuple[int, ...] = ()
    sampling: SamplingParams | None = None  # set: also run the statistical sampling comparison
    samples_per_prompt: int = 200
    sample_prompts: int = 4
    sample_max_tokens: int = 2
    warmup_requests: int = 2
    # the deployment's max_input_len (recipe engine.max_input_len, --max-input-len); 0: not known, nothing checked.
    # A drawn ShareGPT prompt longer is skipped, a longer prompt of a named set refused before any request.
    max_input_len: int = 0
    # --time-budget: seconds the whole run should take; 0: no budget. After the warm-up the timed phases are cut to
    # what fits at the mean request time so far (client.validate.fit_budget); parity is never cut.
    time_budget_s: float = 0.0

    @classmethod
    def from_recipe(cls, recipe, **overrides) -> "Options":
        v, s = recipe.validation, recipe.speculative
        base = dict(
            prompt_set=v.prompt_set,
            max_prompts=v.max_prompts,
            max_tokens=v.max_tokens,
            concurrency=tuple(v.concurrency),
            repeats=v.repeats,
            min_parity=v.min_parity,
            min_speedup=v.min_speedup,
            near_tie_margin=v.near_tie_margin,
            request_timeout_s=v.request_timeout_s,
            chat_template=v.chat_template,
            min_compared_tokens=v.min_compared_tokens,
            min_compared_share=v.min_compared_share,
            latency_prompts=v.latency_prompts,
            exact_verification=exact_verification(recipe.backend),
            num_draft_tokens=s.num_draft_tokens,
            max_draft_len=s.max_draft_len,
            stream=recipe.triton.decoupled,
            max_input_len=recipe.engine.max_input_len,
        )
        return cls.build(**{**base, **{k: v for k, v in overrides.items() if v is not None}})

    @classmethod
    def build(cls, **fields) -> "Options":
        """Options from fields (None: the default), checked: a run that could compare nothing is refused."""
        options = cls(**{k: v for k, v in fields.items() if v is not None})
        if options.min_compared_tokens > options.max_tokens:
            raise ConfigError(
                f"min_compared_tokens ({options.min_compared_tokens}) is larger than max_tokens ({options.max_tokens}):"
                " no output could be compared",
                f"raise --max-tokens (validation.max_tokens) to at least {options.min_compared_tokens}, or lower"
                " --min-compared-tokens",
            )
        for k in options.sweep_draft_tokens:
            if not 1 <= k <= options.max_draft_len:
                raise ConfigError(
                    f"--sweep-draft-tokens asks for k={k}, outside 1..{options.max_draft_len}"
                    " (speculative.max_draft_len)",
                    f"sweep within 1..{options.max_draft_len}; the target engine is built for at most that many draft"
                    " tokens",
                )
        return options


# The run's size where no recipe sets it: the default recipe's (build/smollm2-135m.yaml validation; a test holds them
# equal): docs/validate.md "A deployment specdeploy did not make".
FOREIGN_SIZE = {"max_prompts": 32, "latency_prompts": 8, "concurrency": (1, 2), "repeats": 4}
# --quick: parity on 8 prompts (2 a category), 4 of them timed at concurrency 1 over 2 repeats: ~50 requests.
QUICK_SIZE = {"max_prompts": 8, "latency_prompts": 4, "concurrency": (1,), "repeats": 2}


def sized(overrides: dict, size: dict) -> dict:
    """`overrides` with `size` filling the run-size fields the user left unset (None)."""
    return {**overrides, **{k: v for k, v in size.items() if overrides.get(k) is None}}


def parse_range(text: str) -> tuple[int, ...]:
    """'1..6' -> (1, ..., 6); '1,2,4' -> (1, 2, 4)."""
    try:
        if ".." in text:
            low, high = (int(x) for x in text.split("..", 1))
            values = tuple(range(low, high + 1))
        else:
            values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise ConfigError(f"--sweep-draft-tokens {text!r} is not a range", "write e.g. 1..6 or 1,2,4") from exc
    if not values:
        raise ConfigError(f"--sweep-draft-tokens {text!r} is empty", "write e.g. 1..6")
    return values


def check_sweep(options: Options, per_request_draft_tokens: bool, kind: str) -> None:
    """Refuse a draft-length sweep on a deployment whose requests cannot carry their own draft length."""
    if options.sweep_draft_tokens and not per_request_draft_tokens:
        raise ConfigError(
            f"--sweep-draft-tokens needs a draft length per request, and the {kind} deployment fixes it per deployment"
            " (the llmapi layout: speculative_config.max_draft_len in model.yaml; an OpenAI server: its settings)",
            "sweep on the inflight_batcher_llm layout over Triton, or change the draft length and redeploy",
        )
