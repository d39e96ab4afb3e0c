"""What a finished validation report says in a few words: what the run could not check on this deployment, each
with its reason (`not_checked`, the report's section), and the lines printed on the terminal (`summary_lines`).
"""

from __future__ import annotations

from specdeploy.client import metrics_check
from specdeploy.client import parity as par
from specdeploy.client.deployment import Deployment
from specdeploy.client.protocol import SPECULATIVE_MODEL

DRAFT_LENGTH_NOT_SENT = "the draft length the options name"  # a Not checked item's `what`; the report's header reads it


def not_checked(report: dict, deployment: Deployment, endpoint) -> list[dict]:
    """What this run could not check on this deployment, each with the reason: [{"what", "because"}]."""
    out: list[dict] = []

    def add(what: str, because: str) -> None:
        out.append({"what": what, "because": because})

    items = (report.get("parity") or {}).get("items") or []
    if any(i.get("token_source") == par.IDS_RETOKENIZED for i in items):
        add(
            "exact token ids of the outputs",
            "the deployment returns no output_ids and has no target-only model (preprocessing + tensorrt_llm) to trace:"
            " outputs were compared as text and tokens counted by re-tokenizing it with the given tokenizer",
        )
    if any("divergences cannot be triaged" in w for w in report.get("warnings", [])) and not (
        report.get("parity") or {}
    ).get("exact_verification"):
        add(
            "near-tie triage of divergences",
            "the deployment has no target-only model returning generation logits: a divergence counts as a mismatch",
        )
    counts = getattr(endpoint, "counts", {}).get(SPECULATIVE_MODEL)
    levels = (report.get("latency") or {}).get("levels") or []
    counted = any(level.get("acceptance_source") for level in levels)
    if counts is not None and counts.requests and counts.perf_missing == counts.requests and not counted:
        runtime = report.get("runtime_counters")
        add(
            "acceptance rate and acceptance length (draft tokens proposed / accepted)",
            "the speculative path returned no draft counts with its responses (no total_draft_tokens / "
            "total_accepted_draft_tokens, no llama.cpp timings.draft_n) and "
            + (
                "its metrics endpoint (" + runtime["url"] + ") exported no speculation counters this run reads (vLLM "
                "vllm:spec_decode_*, SGLang sglang:spec_accept_*, trtllm-serve specDecodingStats)"
                + (": " + "; ".join(runtime["errors"][:1]) if runtime["errors"] else "")
                if runtime
                else "no runtime metrics endpoint was given (--metrics-url)"
            ),
        )
    if levels and not any(level.get("ttft_source") for level in levels):
        add(
            "TTFT and TPOT",
            "the deployment neither streams (not decoupled) nor returns arrival/first/last_token_time_ns: "
            "only end-to-end latency and throughput were measured",
        )
    dropped = getattr(endpoint, "dropped_inputs", {}) or {}
    spec_name = deployment.names().get(SPECULATIVE_MODEL, SPECULATIVE_MODEL)
    if "num_draft_tokens" in dropped.get(spec_name, set()) or (
        deployment.foreign and not deployment.per_request_draft_tokens
    ):
        add(
            f"{DRAFT_LENGTH_NOT_SENT} (num_draft_tokens={report['settings'].get('num_draft_tokens')})",
            "the speculative path takes no per-request num_draft_tokens: it ran with the deployment's own draft length",
        )
    for model, names in sorted(dropped.items()):
        rest = sorted(n for n in names if n != "num_draft_tokens")
        if rest:
            add(
                f"request inputs {', '.join(rest)} of {model}",
                f"model '{model}' does not declare them, so they were not sent",
            )
    spec = report.get("speculation") or {}
    if spec.get("source") is None:
        add(
            "speculation rounds (with / without a draft) and the draft length per round",
            "the deployment returns no speculative_k_history and exports no specdeploy_spec_decode_rounds_total",
        )
    if levels and not (report.get("latency") or {}).get("round_profile"):
        if spec.get("source") is not None and not spec.get("rounds_on"):  # rounds were counted, none drafted
            why = (
                "no round of the speculative path drafted (off: "
                + (", ".join(spec.get("off_reasons") or {}) or "-")
                + "): there is no speculative round to profile"
            )
        else:
            why = (
                "no speculative request returned the seconds of two or more rounds (speculative_draft_seconds / "
                "speculative_target_seconds beside speculative_k_history)"
            )
        add("where a speculative round's time goes (draft work, target call, the rest)", why)
    if not spec.get("policy"):
        add(
            "the speculation policy",
            "the speculative model's config carries no policy parameters and no recipe describes it",
        )
    check = report.get("metrics_check") or {}
    if report.get("runtime_counters"):
        add(
            "the metrics endpoint against validate's own counts",
            "--metrics-url is the serving runtime's, read for acceptance only: its counters are not specdeploy's",
        )
    elif not check.get("checked"):
        add("the metrics endpoint against validate's own counts", "; ".join(check.get("notes") or ["not read"]))
    else:
        for note in check.get("notes") or []:
            if "not checked" in note or "exports no" in note:
                add("part of the metrics endpoint", note)
    if deployment.foreign:
        add("quantization quality", "no checkpoint manifests: the deployment was not built by specdeploy")
    if deployment.price_per_hour <= 0:
        add(
            "cost per response and per 1k tokens",
            "no machine price given (--price-per-hour, or cost.machine_price_per_hour in a recipe)",
        )
    return out


def summary_lines(report: dict) -> list[str]:
    """A few lines for the terminal: parity, speed per concurrency, sweep recommendation, warnings, errors."""
    lines = []
    parity = (report.get("parity") or {}).get("summary", {}).get("all")
    if parity:
        lines.append(
            f"parity: {parity['compared']}/{parity['prompts']} prompts compared ({parity['tokens']} tokens; "
            f"{parity['too_short']} too short), {parity['exact']} exact, {parity['near_ties']} near-ties, "
            f"{parity['mismatches']} mismatches, token agreement {parity['token_agreement']:.1%}"
        )
    levels = {(r["mode"], r["concurrency"]): r for r in (report.get("latency") or {}).get("levels", [])}
    for (mode, level), row in sorted(levels.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if row.get("ttft_s_p50") is not None:
            tpot = row.get("tpot_s_p50")
            lines.append(
                f"concurrency {level} {mode}: TTFT p50 {row['ttft_s_p50'] * 1000:.1f} ms, TPOT p50 "
                + (f"{tpot * 1000:.1f} ms" if tpot is not None else "–")
                + f" ({row.get('ttft_source')}), {row['output_tokens_per_s'] or 0:.1f} tok/s"
            )
    for row in (report.get("latency") or {}).get("speedups", []):
        if row["category"] != "all" or row["median"] is None:
            continue
        spec = levels.get(("speculative", row["concurrency"]), {})
        rate = spec.get("acceptance_rate")
        lines.append(
            f"concurrency {row['concurrency']}: speedup {row['median']:.2f}x (repeats"
            f" {row['min']:.2f}..{row['max']:.2f})"
            + (
                f", acceptance rate {rate:.2f}, acceptance length {spec['acceptance_length']:.2f}"
                if rate is not None
                else ""
            )
            + (f" (from {spec['acceptance_source']})" if rate is not None and spec.get("acceptance_source") else "")
        )
    acc = (report.get("acceptance") or {}).get("all")
    if acc:
        lo, hi = acc["acceptance_length_ci95"]
        lines.append(
            f"acceptance over {acc['prompts']} prompts served speculatively: length "
            f"{acc['acceptance_length']:.2f} (95 % interval {lo:.2f}-{hi:.2f}), rate {acc['acceptance_rate']:.2f}"
        )
    for p in (report.get("latency") or {}).get("round_profile") or []:
        lines.append(
            f"concurrency {p['concurrency']}: a round costs {p['round_steps']:.2f} control steps (draft"
            f" {p['draft_steps']:.2f}, target call {p['target_steps']:.2f}, rest {p['rest_steps']:.2f}) for"
            f" {p['tokens_per_round']:.2f} tokens: TPOT {p['tpot_speedup']:.2f}x"
        )
    sweep = report.get("sweep")
    if sweep and sweep["recommendation"].get("no_recommendation"):
        lines.append(f"sweep: no num_draft_tokens recommended: {sweep['recommendation']['no_recommendation']}")
    elif sweep and sweep["recommendation"].get("recommended_k") is not None:
        rec = sweep["recommendation"]
        lines.append(
            f"sweep: alpha {sweep['alpha']:.3f}, c {sweep['cost_ratio'] or 0:.3f}; recommended num_draft_tokens"
            f" {rec['recommended_k']}"
        )
    lines += metrics_check.summary_lines(report)  # policy, rounds on/off, metrics check
    lines += [f"not checked: {n['what']} ({n['because']})" for n in report.get("not_checked") or []]
    lines += [f"warning: {w}" for w in report.get("warnings", [])]
    lines += [f"error: {e}" for e in report.get("errors", [])]
    return lines
