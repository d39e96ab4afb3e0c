"""The CI gate: thresholds over a validation report, an exit code, and a one-line verdict.

Exit codes: 0 every check holds; 1 the run is incomplete (a fault stopped it); 3 parity not shown:
below `min_parity` over the compared prompts, fewer compared prompts than `min_compared_share` (the
rest too short to compare), a stream that differs from the non-streamed text, or the sampling
comparison rejecting equal distributions; 4 speedup below `min_speedup` at the lowest concurrency
level; 5 the deployment's metrics endpoint disagrees with validate's own counts of its run (requests,
output tokens, draft tokens proposed/accepted per path). With several failures, the first in that
order wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdeploy.client.parity import SAMPLING_ALPHA

EXIT_OK, EXIT_INCOMPLETE, EXIT_PARITY, EXIT_SPEED, EXIT_METRICS = 0, 1, 3, 4, 5


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    exit_code: int


@dataclass
class Verdict:
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def exit_code(self) -> int:
        failed = [c.exit_code for c in self.checks if not c.ok]
        return min(failed) if failed else EXIT_OK

    @property
    def line(self) -> str:
        word = "PASS" if self.passed else "FAIL"
        return f"{word}: " + "; ".join(c.detail for c in self.checks)

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "exit_code": self.exit_code,
            "line": self.line,
            "checks": [c.__dict__ for c in self.checks],
        }


def evaluate(report: dict, min_parity: float, min_speedup: float, min_compared_share: float | None = None) -> Verdict:
    """Check completeness, greedy parity and its evidence (compared prompts and tokens, streams), the
    sampling test (if run) and the speedup at the lowest concurrency.

    `min_compared_share`: default the report's own setting (`parity.min_compared_share`).
    """
    verdict = Verdict()
    if not report.get("complete", False):
        errors = "; ".join(report.get("errors", [])) or "unknown error"
        verdict.checks.append(Check("complete", False, f"incomplete run ({errors})", EXIT_INCOMPLETE))

    parity = report.get("parity") or {}
    summary = (parity.get("summary") or {}).get("all")
    if summary and summary["prompts"]:
        if min_compared_share is None:
            min_compared_share = parity.get("min_compared_share", 1.0)
        verdict.checks += _parity_checks(report, parity, summary, min_parity, min_compared_share)
    else:
        verdict.checks.append(Check("parity", False, "parity not measured", EXIT_INCOMPLETE))

    sampling = report.get("sampling")
    if sampling and sampling.get("combined_p_value") is not None:
        p = sampling["combined_p_value"]
        ok = p >= SAMPLING_ALPHA
        verdict.checks.append(
            Check("sampling", ok, f"sampling p={p:.3g} {'>=' if ok else '<'} {SAMPLING_ALPHA}", EXIT_PARITY)
        )

    if min_speedup > 0:
        verdict.checks.append(_speed_check(report, min_speedup))
    drafts = _drafts_check(report)  # also where the speedup is reported, not gated: speculation must have happened
    if drafts is not None:
        verdict.checks.append(drafts)
    check = report.get("metrics_check") or {}
    if check.get("checked"):
        verdict.checks.append(_metrics_check(check))
    return verdict


def _metrics_check(check: dict) -> Check:
    """The metrics endpoint against validate's own counts; a mismatch names the metric."""
    compared = [r for r in check.get("rows", []) if r.get("agree") is not None]
    bad = check.get("mismatches") or []
    if bad:
        return Check("metrics", False, "metrics endpoint disagrees: " + "; ".join(bad), EXIT_METRICS)
    return Check("metrics", True, f"metrics endpoint agrees on {len(compared)} counts", EXIT_METRICS)


def _parity_checks(report: dict, parity: dict, s: dict, min_parity: float, min_compared_share: float) -> list[Check]:
    planned = len(report.get("prompts") or []) or s["prompts"]
    short = f"; {s['too_short']} too short (< {parity.get('min_compared_tokens')} tokens)" if s["too_short"] else ""
    unchecked = f"; only {s['prompts']} of {planned} prompts checked" if s["prompts"] < planned else ""
    mode = (
        "exact verification" if parity.get("exact_verification") else f"near-tie margin {parity.get('near_tie_margin')}"
    )
    if s["compared"]:
        rate = s["parity_rate"]
        ok = rate >= min_parity
        parity_check = Check(
            "parity",
            ok,
            f"parity {rate:.1%} {'>=' if ok else '<'} {min_parity:.1%} over {s['compared']} prompts and {s['tokens']}"
            f" tokens compared ({s['exact']} exact, {s['near_ties']} near-ties, {s['mismatches']} mismatches;"
            f" {mode}{short}{unchecked})",
            EXIT_PARITY,
        )
    else:
        parity_check = Check(
            "parity", False, f"no prompt compared: all {s['prompts']} too short{unchecked}", EXIT_PARITY
        )
    share = s["compared"] / planned
    ok = share >= min_compared_share
    checks = [
        parity_check,
        Check(
            "evidence",
            ok,
            f"{s['compared']}/{planned} prompts comparable ({share:.0%} {'>=' if ok else '<'}"
            f" {min_compared_share:.0%})",
            EXIT_PARITY,
        ),
    ]
    if s.get("streams_checked"):
        bad = s["stream_mismatches"]
        checks.append(
            Check(
                "streams",
                bad == 0,
                f"streams {s['streams_checked'] - bad}/{s['streams_checked']} equal to the non-streamed text",
                EXIT_PARITY,
            )
        )
    return checks


def _drafts_check(report: dict) -> Check | None:
    """Fails where the speculative path returned its draft counts and proposed none in any request: it ran as the
    target alone, so parity and speedup say nothing of speculation. None where no counts came back (not_checked)."""
    levels = [
        r
        for r in (report.get("latency") or {}).get("levels") or []
        if r["mode"] == "speculative" and r.get("drafted") is not None
    ]
    if not levels or any(r["drafted"] for r in levels):
        return None
    requests = sum(r["requests"] for r in levels)
    return Check(
        "drafts",
        False,
        f"the speculative path proposed no draft token in {requests} timed requests: it ran as the target "
        "alone (a policy, a gate or a schedule that turned speculation off, or the control's model)",
        EXIT_SPEED,
    )


def _speed_check(report: dict, min_speedup: float) -> Check:
    rows = [
        r
        for r in (report.get("latency") or {}).get("speedups") or []
        if r["category"] == "all" and r["median"] is not None
    ]
    if not rows:
        return Check("speedup", False, "speedup not measured", EXIT_INCOMPLETE)
    row = min(rows, key=lambda r: r["concurrency"])
    levels = {r["concurrency"]: r for r in report["latency"].get("levels") or [] if r["mode"] == "speculative"}
    rate = (levels.get(row["concurrency"]) or {}).get("acceptance_rate")
    k = (report.get("settings") or {}).get("num_draft_tokens")
    extra = f", k={k}" + (f", acceptance {rate:.2f}" if rate is not None else "")
    ok = row["median"] >= min_speedup
    return Check(
        "speedup",
        ok,
        f"speedup {row['median']:.2f}x {'>=' if ok else '<'} {min_speedup:.2f}x at concurrency {row['concurrency']}"
        f" (repeats {row['min']:.2f}..{row['max']:.2f}{extra})",
        EXIT_SPEED,
    )
