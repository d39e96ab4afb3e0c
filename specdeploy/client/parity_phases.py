"""The correctness phases of a validation run: greedy parity of the speculative path against the control (with
triage of divergences), against a separate baseline deployment, and the statistical sampling comparison. Each phase
writes its section of the report, also when a fault stops it midway.
"""

from __future__ import annotations

import dataclasses

from specdeploy.client import parity as par
from specdeploy.client.options import Options
from specdeploy.client.prompts import spread_over_categories
from specdeploy.client.protocol import CONTROL_MODEL, GenerateRequest
from specdeploy.client.speed_phases import one_model_at_a_time


class _ReplayControl:
    """Forwards everything, except that the control's requests come from results recorded before (load_unload:
    the control answered them while it was loaded)."""

    def __init__(self, inner, recorded: dict):
        self.inner, self.recorded = inner, recorded

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, model, request, timeout_s, *args, **kwargs):
        if model == CONTROL_MODEL:
            return self.recorded[(request.prompt, request.stream)]
        return self.inner.generate(model, request, timeout_s, *args, **kwargs)


def greedy_policy(options: Options) -> par.GreedyPolicy:
    return par.GreedyPolicy(options.exact_verification, options.near_tie_margin, options.min_compared_tokens)


def run_parity(report, endpoint, codec, options, prompts, triage: bool, decoupled: bool, bar) -> None:
    items: list[par.PromptParity] = []
    policy = greedy_policy(options)
    report["parity"] = {
        "items": [],
        "summary": {},
        "exact_verification": policy.exact,
        "near_tie_margin": options.near_tie_margin,
        "min_compared_tokens": options.min_compared_tokens,
        "min_compared_share": options.min_compared_share,
        "num_draft_tokens": options.num_draft_tokens,
        "streams_checked": decoupled,
    }

    def publish():
        report["parity"]["items"] = [dataclasses.asdict(i) for i in items]
        report["parity"]["summary"] = {k: v.to_dict() for k, v in par.summarize(items).items()}

    if one_model_at_a_time(endpoint):  # the control's answers first, while it is loaded; then the speculative model
        recorded = {}
        for prompt in prompts:
            for stream in (False, True) if decoupled else (False,):
                request = GenerateRequest(prompt.text, prompt.max_tokens, stream=stream)
                recorded[(prompt.text, stream)] = endpoint.generate(CONTROL_MODEL, request, options.request_timeout_s)
        endpoint = _ReplayControl(endpoint, recorded)
    try:
        for prompt in prompts:
            items.append(
                par.check_prompt(
                    endpoint,
                    prompt,
                    codec,
                    options.num_draft_tokens,
                    policy,
                    options.request_timeout_s,
                    triage,
                    check_streams=decoupled,
                )
            )
            publish()
            bar(1)
    finally:
        publish()


def run_baseline_parity(report, endpoint, baseline, codec, options, prompts, bar) -> None:
    """Speculative output against a separate deployment's control (e.g. an unquantized target); informative."""
    items: list[par.PromptParity] = []
    report["baseline_parity"] = {"items": [], "summary": {}}
    control_texts = {i["prompt_id"]: i["speculative_text"] for i in report["parity"]["items"]}
    try:
        for prompt in prompts:
            base = baseline.generate(
                CONTROL_MODEL, GenerateRequest(prompt.text, prompt.max_tokens), options.request_timeout_s
            )
            policy = par.GreedyPolicy(
                False, options.near_tie_margin, options.min_compared_tokens
            )  # another deployment: never exact
            items.append(par.compare_greedy(prompt, base.text, control_texts[prompt.id], codec, None, policy))
            bar(1)
    finally:
        report["baseline_parity"]["items"] = [dataclasses.asdict(i) for i in items]
        report["baseline_parity"]["summary"] = {k: v.to_dict() for k, v in par.summarize(items).items()}


def run_sampling(report, endpoint, options, prompts, bar) -> None:
    s = options.sampling
    section = report["sampling"] = {
        "settings": dataclasses.asdict(s),
        "samples_per_prompt": options.samples_per_prompt,
        "max_tokens": options.sample_max_tokens,
        "alpha": par.SAMPLING_ALPHA,
        "tests": [],
        "combined_p_value": None,
    }
    chosen = spread_over_categories(prompts, options.sample_prompts)  # round-robin: not the first category's alone
    try:
        for i, prompt in enumerate(chosen):
            test = par.check_prompt_sampling(
                endpoint,
                prompt,
                s,
                options.samples_per_prompt,
                options.sample_max_tokens,
                options.num_draft_tokens,
                options.request_timeout_s,
                seed_base=(s.seed or 0) + i * 1_000_003,
                progress=bar,
            )
            section["tests"].append(dataclasses.asdict(test))
    finally:
        section["combined_p_value"] = (
            par.combine_p_values([t["p_value"] for t in section["tests"]]) if section["tests"] else None
        )
