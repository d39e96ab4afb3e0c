"""The run's acceptance over every prompt served speculatively, with an interval (the report's `acceptance` section).

Greedy answers repeat exactly, so each prompt counts once: its parity-phase answer (every prompt of the set), else
its first timed answer. Acceptance length = output tokens / target passes, passes = output tokens - accepted drafts
(as `latency.acceptance`). The 95 % interval is a percentile bootstrap over prompts (they, not rounds, are the
independent draws: a prompt's rounds are correlated). Where the deployment splits its drafts by source (the EAGLE-3
head or the request's own-text lookup: `speculation.lookup`, from the metrics endpoint), so does the section.
"""

from __future__ import annotations

import numpy as np

RESAMPLES = 2000
SEED = 0  # the interval is the same for the same report


def per_prompt(report: dict) -> list[dict]:
    """(prompt id, category, drafted, accepted, tokens) once per prompt that returned draft counts."""
    rows: dict[str, dict] = {}
    for item in (report.get("parity") or {}).get("items") or []:
        tokens = item.get("speculative_tokens")
        if tokens is None and item["speculative_text"] == item["control_text"]:
            tokens = item["control_tokens"]
        if item.get("drafted") is not None and item.get("accepted") is not None and tokens:
            rows[item["prompt_id"]] = _row(item, tokens, "parity")
    for run in (report.get("latency") or {}).get("runs") or []:
        for s in run["samples"] if run["mode"] == "speculative" else ():
            counted = s.get("drafted") is not None and s.get("accepted") is not None and s["output_tokens"]
            if s["prompt_id"] not in rows and counted:
                rows[s["prompt_id"]] = _row(s, s["output_tokens"], "latency")
    return list(rows.values())


def _row(answer: dict, tokens: int, phase: str) -> dict:
    return {
        "prompt_id": answer["prompt_id"],
        "category": answer["category"],
        "drafted": answer["drafted"],
        "accepted": answer["accepted"],
        "tokens": tokens,
        "phase": phase,
    }


def _figures(drafted: np.ndarray, accepted: np.ndarray, tokens: np.ndarray) -> tuple[float, float]:
    passes = np.maximum(tokens - accepted, 1).sum(axis=-1)
    return accepted.sum(axis=-1) / np.maximum(drafted.sum(axis=-1), 1), tokens.sum(axis=-1) / passes


def summarize(rows: list[dict]) -> dict | None:
    """Rate and length over `rows`, each with its 95 % bootstrap interval over prompts."""
    if not rows:
        return None
    d, a, t = (np.array([r[k] for r in rows], dtype=float) for k in ("drafted", "accepted", "tokens"))
    rate, length = _figures(d, a, t)
    picks = np.random.default_rng(SEED).integers(0, len(rows), size=(RESAMPLES, len(rows)))
    rates, lengths = _figures(d[picks], a[picks], t[picks])
    return {
        "prompts": len(rows),
        "drafted": int(d.sum()),
        "accepted": int(a.sum()),
        "tokens": int(t.sum()),
        "acceptance_rate": float(rate),
        "acceptance_rate_ci95": _interval(rates),
        "acceptance_length": float(length),
        "acceptance_length_ci95": _interval(lengths),
    }


def _interval(values: np.ndarray) -> list[float]:
    return [float(x) for x in np.percentile(values, (2.5, 97.5))]


def section(report: dict) -> dict | None:
    """The report's `acceptance` section; None where no speculative answer returned draft counts."""
    rows = per_prompt(report)
    overall = summarize(rows)
    if overall is None:
        return None
    categories = sorted({r["category"] for r in rows})
    by_category = {c: summarize([r for r in rows if r["category"] == c]) for c in categories}
    out = {"all": overall, "by_category": by_category, "phases": sorted({r["phase"] for r in rows}), "by_source": None}
    lookup = (report.get("speculation") or {}).get("lookup")
    if lookup:  # the deployment's own split of its drafting rounds (whole run, from its metrics endpoint)
        out["by_source"] = {
            name: {
                "rounds": rounds,
                "drafted": drafted,
                "accepted": accepted,
                "accepted_per_round": accepted / rounds if rounds else None,
            }
            for name, rounds, drafted, accepted in (
                ("head", lookup["head_rounds"], lookup["head_drafted"], lookup["head_accepted"]),
                ("lookup", lookup["rounds"], lookup["drafted"], lookup["accepted"]),
            )
        }
    return out
