"""One validation run: readiness -> greedy parity -> (sampling) -> warm-up -> latency -> (draft-length sweep).

Transport-free: it drives an `Endpoint` (Triton gRPC in production, a scripted fake in tests) and
returns the report as a plain dict. A fault (server unreachable, model not ready, timeout, server
gone) never escapes as an exception: it ends the run, and the report keeps what finished, marked
incomplete, with the error. `validate_deployment` runs it end to end on a `Deployment` (metrics check, gate,
cost, the `not_checked` list of what the deployment does not expose, the report files).

This module runs the phases in order and builds the report; the phases themselves are in `parity_phases`
(correctness) and `speed_phases` (latency, sweep), the run's settings in `options`, the tokenizer in `hf_codec`, and
what a finished report says in a few words in `summary`.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from specdeploy.client import acceptance, metrics_check
from specdeploy.client import latency as lat
from specdeploy.client.deployment import Deployment
from specdeploy.client.hf_codec import HFCodec
from specdeploy.client.options import Options, check_sweep
from specdeploy.client.parity_phases import run_baseline_parity, run_parity, run_sampling
from specdeploy.client.prompts import Prompt, PromptFit, load_prompt_set, render_prompts, spread_over_categories
from specdeploy.client.protocol import CONTROL_MODEL, REQUIRED_MODELS, TRIAGE_MODELS, Endpoint, TokenCodec
from specdeploy.client.speed_phases import one_model_at_a_time, run_latency, run_sweep, speed_warnings
from specdeploy.client.summary import not_checked
from specdeploy.core.errors import ClientError

REPORT_SCHEMA_VERSION = 1


class _Progress:
    """A tqdm bar on stderr (progress=True), a callback per finished request (a callable), or nothing."""

    def __init__(self, total: int, enabled):
        self.bar = None
        self.callback = enabled if callable(enabled) else None
        if enabled is True:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="validate", unit="req", dynamic_ncols=True, leave=False)

    def phase(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_description(name)

    def note(self, line: str) -> None:
        """A line for the user (the plan, the ETA): above the bar, or on stderr without one (a log)."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def __call__(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)
        if self.callback is not None:
            self.callback(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def validate(
    endpoint: Endpoint,
    codec: TokenCodec,
    options: Options,
    recipe_name: str = "",
    baseline: Endpoint | None = None,
    quality: dict | None = None,
    progress=True,
    counters=None,
) -> dict:
    """Run every phase against `endpoint` and return the report dict (never raises on a server fault). `counters`
    (runtime_counters.RuntimeCounters): the runtime's metrics endpoint, read around each speculative latency run."""
    prompts, template, skipped = prepare_prompts(options, codec)
    report = _new_report(recipe_name, endpoint, baseline, options, prompts, quality)
    report["settings"]["chat_template_used"] = template
    report["settings"]["prompts_skipped_too_long"] = [{"id": i, "tokens": n} for i, n in skipped]
    if skipped:
        report["warnings"].append(
            f"{len(skipped)} drawn prompt(s) longer than max_input_len ({options.max_input_len:,} tokens) skipped,"
            f" others drawn in their place: {', '.join(i for i, _ in skipped)}"
        )
    bar = _Progress(_total_steps(options, prompts, baseline is not None), progress)
    started = time.perf_counter()
    try:
        _run_phases(report, endpoint, codec, options, prompts, baseline, bar, counters, started)
    except ClientError as exc:
        _fail(report, f"{exc.message} (hint: {exc.hint})" if exc.hint else exc.message)
    except KeyboardInterrupt:
        _fail(report, "interrupted (Ctrl-C)")
    finally:
        bar.close()
        report["duration_s"] = time.perf_counter() - started
        report["acceptance"] = acceptance.section(report)
    return report


def prepare_prompts(options: Options, codec: TokenCodec) -> tuple[list[Prompt], bool, list[tuple[str, int]]]:
    """The prompt set, rendered with the tokenizer's chat template (chat_template auto and one exists); whether it
    was; and the drawn prompts skipped as longer than options.max_input_len ((id, tokens) each). A prompt of a named
    set (builtin, a file) that is longer is refused here, before any request."""
    renderer = codec.chat_renderer() if options.chat_template == "auto" else None
    fit = PromptFit(codec, renderer, options.max_input_len) if options.max_input_len > 0 else None
    prompts = render_prompts(
        load_prompt_set(options.prompt_set, options.max_tokens, options.max_prompts, fit), renderer
    )
    if fit is not None:
        fit.refuse_misfits(prompts, options.prompt_set)
    return prompts, renderer is not None, fit.skipped if fit is not None else []


def latency_subset(options: Options, prompts: list[Prompt]) -> list[Prompt]:
    """The prompts each latency run sends: `latency_prompts` of them spread over the categories (0: all)."""
    return spread_over_categories(prompts, options.latency_prompts) if options.latency_prompts > 0 else list(prompts)


def _run_phases(report, endpoint, codec, options, prompts, baseline, bar, counters, started) -> None:
    bar.phase("connect")
    endpoint.check_ready(REQUIRED_MODELS)
    if baseline is not None:
        baseline.check_ready((CONTROL_MODEL,))
    decoupled = options.stream or endpoint.is_decoupled(CONTROL_MODEL)
    report["settings"]["stream"] = decoupled
    timed = latency_subset(options, prompts)
    plan = report["plan"] = planned_requests(options, len(prompts), len(timed), baseline is not None, decoupled)
    bar.note(plan_line(plan))

    bar.phase("parity")
    try:
        endpoint.check_ready(TRIAGE_MODELS)
        triage = True
    except ClientError as exc:
        triage = False
        report["warnings"].append(f"divergences cannot be triaged: {exc.message}")
    run_parity(report, endpoint, codec, options, prompts, triage, decoupled, bar)
    if baseline is not None:
        run_baseline_parity(report, endpoint, baseline, codec, options, prompts, bar)
    if options.sampling is not None:
        bar.phase("sampling")
        run_sampling(report, endpoint, options, prompts, bar)

    report["settings"]["latency_prompt_ids"] = [p.id for p in timed]
    if not one_model_at_a_time(endpoint):  # else each mode warms up after its model is loaded (_latency)
        bar.phase("warm-up")
        lat.warm_up(endpoint, timed, options.num_draft_tokens, options.request_timeout_s, options.warmup_requests)
    elapsed, left = time.perf_counter() - started, plan["latency"] + plan["sweep"]
    plan["eta_s_after_warm_up"] = (
        elapsed / max(plan["parity"] + plan["baseline"] + plan["sampling"] + plan["warm_up"], 1) * left
    )
    bar.note(
        f"warm-up done after {elapsed:.0f} s; about {plan['eta_s_after_warm_up'] / 60:.1f} min left "
        f"({left} requests at the mean time of those so far)"
    )
    if options.time_budget_s:
        fitted, kept = fit_budget(options, timed, elapsed, plan)
        if fitted.repeats != options.repeats or len(kept) != len(timed) or not plan["budget"]["fits"]:
            line = (
                f"--time-budget {options.time_budget_s / 60:g} min: the timed phases cut to {fitted.repeats} repeats"
                f" (of {options.repeats}) over {len(kept)} prompts (of {len(timed)}) for the"
                f" {max(plan['budget']['left_s'], 0):.0f} s left; parity is never cut"
                + ("" if plan["budget"]["fits"] else "; even this smallest run does not fit the budget")
            )
            report["warnings"].append(line)
            bar.note(line)
            report["settings"].update(repeats=fitted.repeats, latency_prompt_ids=[p.id for p in kept])
            options, timed = fitted, kept
    bar.phase("latency")
    run_latency(report, endpoint, codec, options, timed, decoupled, bar, counters)
    if options.sweep_draft_tokens:
        bar.phase("sweep")
        run_sweep(report, endpoint, codec, options, timed, decoupled, bar)
    speed_warnings(report, options)
    if one_model_at_a_time(endpoint):
        report["settings"]["control_loading"] = {
            "mode": "load_unload",
            "swaps": [{"loaded": name, "seconds": round(seconds, 3)} for name, seconds in endpoint.swaps],
            "note": (
                "one model loaded at a time: the control and the speculative path were measured one after the "
                "other (not interleaved), each after its own warm-up"
            ),
        }


MIN_BUDGET_REPEATS = 2  # one repeat with each side first (ABBA): fewer, and the order would decide the speedup


def fit_budget(options: Options, timed: list[Prompt], elapsed_s: float, plan: dict) -> tuple[Options, list[Prompt]]:
    """The timed phases cut to fit options.time_budget_s, at the mean time of the requests sent so far: repeats
    first (down to MIN_BUDGET_REPEATS, even), then the timed prompts (down to one a category). Records
    plan["budget"]; a budget too small for the smallest run keeps the smallest (the warning says so)."""
    done = plan["parity"] + plan["baseline"] + plan["sampling"] + plan["warm_up"]
    per_request = elapsed_s / max(done, 1)
    left_s = options.time_budget_s - elapsed_s

    def seconds(repeats: int, prompts: int) -> float:
        latency = 2 * prompts * len(options.concurrency) * repeats
        sweep = prompts * (1 + len(options.sweep_draft_tokens)) * repeats if options.sweep_draft_tokens else 0
        return per_request * (latency + sweep)

    floor = min(MIN_BUDGET_REPEATS, options.repeats)
    # even counts below the asked one, so each side runs first equally often
    candidates = [options.repeats, *(r for r in range(options.repeats - 1, floor - 1, -1) if r % 2 == 0 or r == floor)]
    prompts = len(timed)
    repeats = next((r for r in candidates if seconds(r, prompts) <= left_s), candidates[-1])
    categories = len({p.category for p in timed})
    while seconds(repeats, prompts) > left_s and prompts > categories:
        prompts -= 1
    kept = spread_over_categories(timed, prompts) if prompts < len(timed) else timed
    plan["budget"] = {
        "budget_s": options.time_budget_s,
        "left_s": left_s,
        "per_request_s": per_request,
        "repeats": repeats,
        "timed_prompts": len(kept),
        "fits": seconds(repeats, prompts) <= left_s,
    }
    return dataclasses.replace(options, repeats=repeats), kept


def planned_requests(options: Options, prompts: int, timed: int, with_baseline: bool, streams: bool) -> dict:
    """Requests each phase will send, known before the first one (parity: each side once, and once more streamed
    where the run streams; the triage calls on a divergence are not counted)."""
    sides = 2 * (2 if streams else 1)
    plan = {
        "parity": prompts * sides,
        "baseline": prompts if with_baseline else 0,
        "sampling": 2 * options.sample_prompts * options.samples_per_prompt if options.sampling is not None else 0,
        "warm_up": 2 * min(options.warmup_requests, timed),
        "latency": 2 * timed * len(options.concurrency) * options.repeats,
        "sweep": timed * (1 + len(options.sweep_draft_tokens)) * options.repeats if options.sweep_draft_tokens else 0,
    }
    return {**plan, "total": sum(plan.values()), "prompts": prompts, "timed_prompts": timed}


def plan_line(plan: dict) -> str:
    phases = ("parity", "baseline", "sampling", "warm_up", "latency", "sweep")
    parts = ", ".join(f"{name.replace('_', '-')} {plan[name]}" for name in phases if plan[name])
    return (
        f"plan: {plan['total']} requests ({parts}) over {plan['prompts']} prompts, {plan['timed_prompts']} of them"
        " timed; --quick or --max-prompts / --concurrency / --repeats change it"
    )


def _new_report(recipe_name, endpoint, baseline, options, prompts, quality) -> dict:
    settings = dataclasses.asdict(options)
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "recipe": recipe_name,
        "url": endpoint.url,
        "baseline_url": baseline.url if baseline is not None else None,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "complete": True,
        "errors": [],
        "warnings": [],
        "settings": settings,
        "prompts": [dataclasses.asdict(p) for p in prompts],
        "parity": None,
        "baseline_parity": None,
        "sampling": None,
        "latency": None,
        "sweep": None,
        "quality": quality or {},
        "plan": None,
    }


def _fail(report: dict, message: str) -> None:
    report["complete"] = False
    report["errors"].append(message)


def _total_steps(options: Options, prompts: list[Prompt], with_baseline: bool) -> int:
    n = len(prompts)
    steps = n * (2 if with_baseline else 1)
    if options.sampling is not None:
        steps += options.sample_prompts * options.samples_per_prompt
    timed = len(latency_subset(options, prompts))
    steps += 2 * timed * len(options.concurrency) * options.repeats
    steps += timed * (1 + len(options.sweep_draft_tokens)) * options.repeats
    return steps


# ---------------------------------------------------------------- one deployment, end to end


def validate_deployment(
    deployment: Deployment, options: Options, report_dir: str | Path, progress=True, baseline_url: str | None = None
):
    """Validate `deployment` (a `client.deployment.Deployment`) and write the report; returns (report, paths, verdict).

    Server faults do not raise: the verdict then fails with exit code 1 and the report is marked incomplete.
    What the deployment does not expose is listed in the report's `not_checked` section, never skipped silently.
    """
    from specdeploy.client import gate
    from specdeploy.client.deployment import open_endpoint
    from specdeploy.client.openai_adapter import OpenAIEndpoint
    from specdeploy.client.report import write_report
    from specdeploy.client.runtime_counters import RuntimeCounters
    from specdeploy.client.triton_adapter import TritonEndpoint
    from specdeploy.core.cost import cost_section  # cost per response / per 1k tokens at the machine's price

    check_sweep(
        options, deployment.per_request_draft_tokens, deployment.layout if deployment.protocol == "triton" else "OpenAI"
    )
    codec = HFCodec(deployment.tokenizer)
    # an OpenAI server specdeploy did not make: --metrics-url is its runtime's endpoint, read for acceptance
    runtime = deployment.foreign and deployment.protocol == "openai" and deployment.metrics_url is not None
    counters = RuntimeCounters(deployment.metrics_url) if runtime else None
    check = metrics_check.MetricsCheck(
        open_endpoint(deployment),
        None if runtime else deployment.metrics_url,
        control_here=deployment.control_url is None,
    )
    endpoint = check.endpoint
    baseline = TritonEndpoint(baseline_url) if baseline_url else None
    try:
        report = validate(endpoint, codec, options, deployment.title, baseline, deployment.quality, progress, counters)
        report["deployment"] = deployment.describe()
        report["deployment"]["endpoints"] = endpoint.describe() if isinstance(endpoint.inner, OpenAIEndpoint) else None
        if counters is not None:
            report["runtime_counters"] = {
                "url": deployment.metrics_url,
                "errors": counters.errors,
                "read": [w.to_dict() for w in counters.windows],
            }
        check.finish(report, metrics_check.served_policy(endpoint, deployment.policy))
        report["acceptance"] = acceptance.section(report)  # again: the speculation section may split it by source
        report["not_checked"] = not_checked(report, deployment, endpoint)
    finally:
        endpoint.close()
        if baseline is not None:
            baseline.close()
    verdict = gate.evaluate(report, options.min_parity, options.min_speedup, options.min_compared_share)
    report["gate"] = verdict.to_dict()
    report["cost"] = cost_section(
        (report.get("latency") or {}).get("levels", []),
        deployment.price_per_hour,
        deployment.currency,
        "`--price-per-hour`" if deployment.foreign else "recipe `cost.machine_price_per_hour`",
    )
    paths = write_report(report, Path(report_dir))
    return report, paths, verdict
