"""The speed phases of a validation run: latency at each concurrency (control and speculative interleaved, or one
model after the other on a deployment that holds one at a time), the draft-length sweep, and the warnings read from
their results. Each phase writes its section of the report, also when a run stops it midway.
"""

from __future__ import annotations

from specdeploy.client import latency as lat
from specdeploy.client import parity as par
from specdeploy.client.options import Options
from specdeploy.core.errors import ClientError


def one_model_at_a_time(endpoint) -> bool:
    """The deployment holds one of its two models at a time (llmapi layout, triton.control load_unload)."""
    return bool(getattr(endpoint, "one_model_at_a_time", False))


def _references(report) -> dict[str, dict]:
    """Per latency mode: prompt id -> (text, generated tokens) from the parity phase."""
    out = {lat.CONTROL: {}, lat.SPECULATIVE: {}}
    for i in (report.get("parity") or {}).get("items", []):
        out[lat.CONTROL][i["prompt_id"]] = (i["control_text"], i["generated_tokens"])
        same = i["speculative_text"] == i["control_text"] and i["verdict"] in (par.MATCH, par.TOO_SHORT)
        out[lat.SPECULATIVE][i["prompt_id"]] = (i["speculative_text"], i["generated_tokens"] if same else None)
    return out


def _run_levels(report, report_section, endpoint, codec, options, prompts, decoupled, bar, plan, counters=None) -> None:
    """Run (mode, concurrency, repeat, k) in order; stop at the first failed run (its samples are kept). `counters`
    (runtime_counters.RuntimeCounters): the runtime's metrics endpoint, read before and after each speculative run."""
    references = _references(report)
    for mode, level, repeat, k in plan:
        before = counters.before() if counters is not None and mode == lat.SPECULATIVE else None
        run = lat.run_level(
            endpoint,
            codec,
            prompts,
            mode,
            level,
            repeat,
            options.request_timeout_s,
            k,
            decoupled,
            progress=bar,
            reference=references[mode],  # greedy: the same text for every k
        )
        window = counters.after(before) if before is not None else None
        run.counters = window.to_dict() if window is not None else None
        report_section["runs"].append(run)
        if run.error is not None:
            raise ClientError(f"{mode} run at concurrency {level} stopped: {run.error}")


def run_latency(report, endpoint, codec, options, prompts, decoupled, bar, counters=None) -> None:
    section = {"runs": []}
    plan = [
        (mode, level, repeat, options.num_draft_tokens)
        for repeat in range(options.repeats)
        for level in options.concurrency
        for mode in lat.paired_order(repeat)  # interleaved so drift hits both sides alike
    ]
    try:
        if not one_model_at_a_time(endpoint):
            _run_levels(report, section, endpoint, codec, options, prompts, decoupled, bar, plan, counters)
        for mode in (
            (lat.CONTROL, lat.SPECULATIVE) if one_model_at_a_time(endpoint) else ()
        ):  # a model swap between them
            lat.warm_up(
                endpoint, prompts, options.num_draft_tokens, options.request_timeout_s, options.warmup_requests, (mode,)
            )
            mine = [p for p in plan if p[0] == mode]
            _run_levels(report, section, endpoint, codec, options, prompts, decoupled, bar, mine, counters)
    finally:
        runs = section["runs"]
        report["latency"] = {
            "runs": [r.to_dict() for r in runs],
            "levels": lat.summarize_levels(runs),
            "speedups": lat.speedup_table(runs),
            "round_profile": lat.round_profile(runs),
        }


def run_sweep(report, endpoint, codec, options, prompts, decoupled, bar) -> None:
    section = {"runs": []}
    plan = []
    for repeat in range(options.repeats):
        plan.append((lat.CONTROL, 1, repeat, None))
        plan += [(lat.SPECULATIVE, 1, repeat, k) for k in options.sweep_draft_tokens]
    try:
        _run_levels(report, section, endpoint, codec, options, prompts, decoupled, bar, plan)
    finally:
        runs = section["runs"]
        points = lat.sweep_points(runs)
        alpha, cost_ratio = lat.fit_speedup_model(points)
        report["sweep"] = {
            "runs": [r.to_dict() for r in runs],
            "points": points,
            "alpha": alpha,
            "cost_ratio": cost_ratio,
            "recommendation": lat.recommend_k(points, alpha, cost_ratio, options.max_draft_len),
        }
        for p in points:
            if p.get("most_drafts") is not None and p["most_drafts"] < p["k"]:
                report["warnings"].append(
                    f"draft-length sweep: at k={p['k']} no round drafted more than {p['most_drafts']} tokens, so that"
                    f" row measures k <= {p['most_drafts']}: the deployment capped the request's num_draft_tokens"
                    " (speculative.dynamic draft_len_schedule, the engine's max_draft_len) or the draft never proposed"
                    " more"
                )


def speed_warnings(report: dict, options: Options) -> None:
    timed = len((report.get("settings") or {}).get("latency_prompt_ids") or [])
    if report.get("latency") and options.repeats > 1 and options.repeats % 2:
        first = {
            mode: sum(lat.paired_order(r)[0] == mode for r in range(options.repeats))
            for mode in (lat.CONTROL, lat.SPECULATIVE)
        }
        report["warnings"].append(
            f"{options.repeats} repeats (odd): the control ran first in {first[lat.CONTROL]} and the speculative path"
            f" in {first[lat.SPECULATIVE]}, so the median speedup leans on one order; an even --repeats"
            " (validation.repeats) gives each side the first run equally often"
        )
    for level in sorted(c for c in options.concurrency if timed and c > timed):
        report["warnings"].append(
            f"concurrency {level} had at most {timed} requests in flight: only {timed} prompts are timed (a level runs"
            " each prompt once a repeat); raise validation.latency_prompts or --max-prompts to load it fully"
        )
    for level in (report["latency"] or {}).get("levels", []):
        ttft, e2e = level.get("ttft_s_p50"), level.get("e2e_s_p50")
        if level.get("ttft_source") == "server" and ttft is not None and e2e and ttft > 0.9 * e2e:
            report["warnings"].append(
                f"TTFT of the {level['mode']} path comes from the server's perf outputs and is close to the whole"
                " latency: the server seems to stamp first_token_time_ns when the output is complete, so its TTFT and"
                " TPOT are not real; deploy in decoupled mode (triton.decoupled: true) to measure them on the stream"
            )
            break
    for level in (report["latency"] or {}).get("levels", []):
        if level.get("different_text"):
            report["warnings"].append(
                f"{level['different_text']} of {level['requests']} {level['mode']} outputs at concurrency"
                f" {level['concurrency']} differ from the same prompt's output in the parity phase (greedy outputs"
                " should repeat exactly)"
            )
    rows = [
        r for r in (report["latency"] or {}).get("speedups", []) if r["category"] == "all" and r["median"] is not None
    ]
    lowest = min(options.concurrency)
    for row in rows:
        if row["median"] < 1.0:
            why = (
                " (expected at high concurrency: the target is then busy with other requests' tokens, so the"
                " draft's work and the rejected tokens cost real throughput)"
                if row["concurrency"] > lowest
                else ""
            )
            report["warnings"].append(
                f"speculation is slower than the control at concurrency {row['concurrency']}: {row['median']:.2f}x{why}"
            )
    sweep = report.get("sweep")
    if sweep and sweep["recommendation"].get("recommended_k") is not None:
        rec = sweep["recommendation"]
        best = rec.get("best_measured_speedup")
        if best is not None and best < 1.0:
            report["warnings"].append(
                f"no draft length made speculation faster (best {best:.2f}x at k={rec['best_measured_k']})"
            )
        if rec["recommended_k"] != options.num_draft_tokens:
            report["warnings"].append(
                f"the sweep recommends num_draft_tokens={rec['recommended_k']} (recipe: {options.num_draft_tokens})"
            )
