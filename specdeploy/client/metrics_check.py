"""Does the deployment's metrics endpoint agree with what `validate` itself sent and received?

`CountingEndpoint` wraps the run's endpoint and counts, per path, the requests that finished, their
draft tokens proposed/accepted (the server's per-request perf outputs), their texts and, where the BLS
returns `speculative_k_history`, their rounds (= target passes). `MetricsCheck`
scrapes the metrics endpoint before and after the run; `compare` turns the window and the client's
counts into the report's `metrics_check` section (a mismatch names the metric and fails the gate),
and `speculation_section` reads the speculation the deployment did over the run from the same window
(rounds on/off by reason, k per round) for the report. Pure functions except the scrapes.

Output tokens: the client knows them exactly only for texts whose ids it has (`output_ids` returned,
or the parity phase's exact count for that greedy text); a request whose count is unknown (a sampled
text) leaves output tokens unchecked, with a note. The check assumes validate is the deployment's only
client during its run (other traffic shows up as a mismatch, and the report says so).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from specdeploy.client.protocol import CONTROL_MODEL, SPECULATIVE_MODEL, GenerateRequest, GenerateResult
from specdeploy.core.errors import ClientError
from specdeploy.core.metrics import names as core_metrics_names
from specdeploy.core.metrics import reader

# Triton's own counter of successful requests of a model (the control `ensemble` has no metrics of ours)
TRITON_SUCCESS = "nv_inference_request_success"
SETTLE_S = 5.0  # how long to wait for the endpoint's counters to stop moving after the run


@dataclass
class PathCounts:
    requests: int = 0
    errors: int = 0
    drafted: int = 0
    accepted: int = 0
    perf_missing: int = 0  # finished requests without draft counts in their perf outputs
    texts: list[str] = field(default_factory=list)
    token_counts: list[int | None] = field(default_factory=list)  # len(output_ids) where returned
    k_histories: list[list[int]] = field(
        default_factory=list
    )  # `speculative_k_history` per request, in finishing order


class CountingEndpoint:
    """An Endpoint that forwards everything and counts what finished, per model."""

    def __init__(self, inner):
        self.inner = inner
        self.url = inner.url
        self.counts: dict[str, PathCounts] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name):  # check_ready, is_decoupled, trace, close, model_parameters, ...
        return getattr(self.inner, name)

    def generate(self, model: str, request: GenerateRequest, timeout_s: float, *args, **kwargs) -> GenerateResult:
        try:
            result = self.inner.generate(model, request, timeout_s, *args, **kwargs)
        except ClientError:
            with self._lock:
                self.counts.setdefault(model, PathCounts()).errors += 1
            raise
        with self._lock:
            c = self.counts.setdefault(model, PathCounts())
            c.requests += 1
            perf = result.perf
            if perf.total_draft_tokens is None or perf.total_accepted_draft_tokens is None:
                c.perf_missing += 1
            else:
                c.drafted += perf.total_draft_tokens
                c.accepted += perf.total_accepted_draft_tokens
            c.texts.append(result.text)
            c.token_counts.append(None if result.token_ids is None else len(result.token_ids))
            if result.k_history is not None:
                c.k_histories.append(list(result.k_history))
        return result


def exact_token_counts(report: dict) -> dict[str, int]:
    """Greedy text -> generated tokens (a final end_id included), from the parity phase's exact ids."""
    out = {}
    for item in (report.get("parity") or {}).get("items", []):
        if item.get("generated_tokens") is None:
            continue
        out[item["control_text"]] = item["generated_tokens"]
        if item["speculative_text"] == item["control_text"]:
            out[item["speculative_text"]] = item["generated_tokens"]
    return out


def output_tokens(counts: PathCounts, exact: dict[str, int]) -> tuple[int | None, int]:
    """(total output tokens, requests whose count is unknown); the total is None when any is unknown."""
    total, unknown = 0, 0
    for text, n in zip(counts.texts, counts.token_counts):
        n = n if n is not None else exact.get(text)
        if n is None:
            unknown += 1
        else:
            total += n
    return (None if unknown else total), unknown


def compare(
    window: reader.Snapshot,
    counts: dict[str, PathCounts],
    exact: dict[str, int],
    spec_model: str = SPECULATIVE_MODEL,
    control_model: str = CONTROL_MODEL,
    control_here: bool = True,
) -> dict:
    """The report's `metrics_check` section: per path, metric name -> (metrics, client) and the mismatches.
    `counts` are keyed by the core's model names; `spec_model`/`control_model` are the served models' labels;
    `control_here`: the control is served by this endpoint's server (not by a second one).

    An endpoint without specdeploy's families (a deployment specdeploy did not make: NVIDIA's BLS exports none for
    speculation) is checked on Triton's own request counters only, and the notes say what that leaves out."""
    if not window.has(core_metrics_names.REQUESTS.name):
        return _compare_triton_only(window, counts, spec_model, control_model, control_here)
    rows, notes = [], []
    spec = counts.get(SPECULATIVE_MODEL, PathCounts())
    control = counts.get(CONTROL_MODEL, PathCounts())
    if spec.errors or control.errors:
        notes.append(
            f"{spec.errors + control.errors} requests failed on the client side; their server-side outcome is unknown,"
            " so requests are not compared"
        )
    stats = reader.arm_stats(window, core_metrics_names.SPECULATIVE_ARM, spec_model)

    def row(path: str, metric: str, got: float, want: float | None, why_unchecked: str | None = None):
        rows.append(
            {
                "path": path,
                "metric": metric,
                "metrics": got,
                "client": want,
                "agree": None if want is None else abs(got - want) < 1e-6,
                "note": why_unchecked,
            }
        )

    if not (spec.errors or control.errors):
        row(
            "speculative",
            core_metrics_names.REQUESTS.name + f'{{model="{spec_model}",arm="speculative"}}',
            stats.requests,
            spec.requests,
        )
        if not control_here:
            notes.append(
                "the control is served by another server (--control-url): its requests are not checked on this endpoint"
            )
        elif window.has(TRITON_SUCCESS):
            got = window.sum(TRITON_SUCCESS, model=control_model)
            row("control", TRITON_SUCCESS + f'{{model="{control_model}"}}', got, control.requests)
        else:
            notes.append(f"the endpoint exports no {TRITON_SUCCESS}: the control's requests are not checked")
    if spec.perf_missing:
        notes.append(f"{spec.perf_missing} speculative responses carried no draft counts: draft tokens are not checked")
    else:
        row("speculative", core_metrics_names.DRAFT_TOKENS.name, stats.drafted, spec.drafted)
        row("speculative", core_metrics_names.ACCEPTED_TOKENS.name, stats.accepted, spec.accepted)
    total, unknown = output_tokens(spec, exact)
    if total is None:
        notes.append(
            f"{unknown} of {len(spec.texts)} speculative outputs have no exact token count (sampled texts): output"
            " tokens are not checked"
        )
    else:
        row("speculative", core_metrics_names.GENERATION_TOKENS.name, stats.output_tokens, total)
    if spec.k_histories and len(spec.k_histories) == spec.requests:  # one entry per round, one round per target call
        row(
            "speculative",
            core_metrics_names.TARGET_PASSES.name,
            stats.target_passes,
            sum(len(h) for h in spec.k_histories),
        )
    control_arm = reader.arm_stats(window, core_metrics_names.CONTROL_ARM, spec_model)
    if control_arm.requests:  # validate always sends num_draft_tokens: the canary never picks its requests
        row(
            "speculative",
            core_metrics_names.REQUESTS.name + f'{{model="{spec_model}",arm="control"}}',
            control_arm.requests,
            0,
        )
    mismatches = [
        f"{r['metric']}: the metrics endpoint counted {r['metrics']:g}, validate counted {r['client']:g} ({r['path']}"
        " path)"
        for r in rows
        if r["agree"] is False
    ]
    if mismatches:
        notes.append("another client sending to the deployment during the run also makes the counts differ")
    return {"checked": True, "rows": rows, "mismatches": mismatches, "notes": notes, "window_s": window.taken_s}


def _compare_triton_only(
    window: reader.Snapshot, counts: dict[str, PathCounts], spec_model: str, control_model: str, control_here: bool
) -> dict:
    """Requests per path from Triton's `nv_inference_request_success`; draft tokens, output tokens and rounds are
    not exported, so not checked (said in the notes)."""
    rows, notes = (
        [],
        [
            f"the endpoint exports no {core_metrics_names.PREFIX}* speculation metrics: draft tokens, accepted tokens,"
            " output tokens and rounds are not checked against it"
        ],
    )
    if not window.has(TRITON_SUCCESS):
        notes.append(f"the endpoint exports no {TRITON_SUCCESS} either: nothing to check")
        return {"checked": False, "rows": [], "mismatches": [], "notes": notes, "window_s": window.taken_s}
    spec, control = counts.get(SPECULATIVE_MODEL, PathCounts()), counts.get(CONTROL_MODEL, PathCounts())
    if spec.errors or control.errors:
        notes.append(
            f"{spec.errors + control.errors} requests failed on the client side; their server-side outcome is unknown,"
            " so requests are not compared"
        )
        return {"checked": False, "rows": [], "mismatches": [], "notes": notes, "window_s": window.taken_s}
    paths = [("speculative", spec_model, spec)] + ([("control", control_model, control)] if control_here else [])
    for path, label, c in paths:
        got = window.sum(TRITON_SUCCESS, model=label)
        rows.append(
            {
                "path": path,
                "metric": TRITON_SUCCESS + f'{{model="{label}"}}',
                "metrics": got,
                "client": c.requests,
                "agree": abs(got - c.requests) < 1e-6,
                "note": None,
            }
        )
    mismatches = [
        f"{r['metric']}: the metrics endpoint counted {r['metrics']:g}, validate counted {r['client']:g} ({r['path']}"
        " path)"
        for r in rows
        if not r["agree"]
    ]
    if mismatches:
        notes.append("another client sending to the deployment during the run also makes the counts differ")
    return {"checked": True, "rows": rows, "mismatches": mismatches, "notes": notes, "window_s": window.taken_s}


def settled(url: str, earliest: reader.Snapshot, names: Sequence[str], timeout_s: float) -> reader.Snapshot:
    """Scrape until the named counters stop moving (Triton refreshes its own counters lazily)."""
    deadline = time.monotonic() + timeout_s
    previous = reader.scrape(url)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        snap = reader.scrape(url)
        if all(snap.sum(n) == previous.sum(n) for n in names) and any(snap.sum(n) != earliest.sum(n) for n in names):
            return snap
        previous = snap
    return previous


class MetricsCheck:
    """Scrape before the run (`start`), wrap the endpoint, and after it add the check to the report (`finish`)."""

    def __init__(self, endpoint, metrics_url: str | None, control_here: bool = True):
        self.metrics_url = metrics_url
        self.control_here = control_here
        self.endpoint = CountingEndpoint(endpoint)
        self.before: reader.Snapshot | None = None
        self.error: str | None = None
        if metrics_url:
            try:
                self.before = reader.scrape(metrics_url)
            except ClientError as exc:
                self.error = exc.message

    def finish(self, report: dict, policy: dict | None = None) -> dict:
        """Add `metrics_check` and `speculation` to the report; returns the check section."""
        section: dict = {"checked": False, "url": self.metrics_url, "rows": [], "mismatches": [], "notes": []}
        window = None
        if not self.metrics_url:
            section["notes"].append(
                "no metrics endpoint given (pass --metrics-url HOST:PORT): the counters are not checked"
            )
        elif getattr(self.endpoint.inner, "one_model_at_a_time", False):
            section["notes"].append(
                "the models were unloaded and loaded during the run (triton.control load_unload), which "
                "resets their counters: the counters are not checked"
            )
        elif self.error or self.before is None:
            section["notes"].append(f"the metrics endpoint could not be read before the run: {self.error}")
        else:
            try:
                after = settled(
                    self.metrics_url, self.before, (core_metrics_names.REQUESTS.name, TRITON_SUCCESS), SETTLE_S
                )
                window = after.minus(self.before)
                window = dataclasses.replace(window, taken_s=after.taken_s - self.before.taken_s)
            except ClientError as exc:
                section["notes"].append(f"the metrics endpoint could not be read after the run: {exc.message}")
            if window is not None and not report.get("complete", True):
                section["notes"].append(
                    "the run is incomplete (a request may have ended on the server only): the counters are not checked"
                )
            elif window is not None:
                section = {
                    **compare(
                        window, self.endpoint.counts, exact_token_counts(report), *self.labels, self.control_here
                    ),
                    "url": self.metrics_url,
                }
        report["metrics_check"] = section
        report["speculation"] = speculation_section(
            window, self.endpoint.counts.get(SPECULATIVE_MODEL, PathCounts()), policy, self.labels[0]
        )
        return section

    @property
    def labels(self) -> tuple[str, str]:
        """The `model` labels of the speculative and the control path on the metrics endpoint (the served names)."""
        names = getattr(self.endpoint.inner, "served_names", {})
        return names.get(SPECULATIVE_MODEL, SPECULATIVE_MODEL), names.get(CONTROL_MODEL, CONTROL_MODEL)


def k_counts_from_metrics(stats: reader.ArmStats) -> dict[int, float]:
    """Rounds per draft length from the per-position counters: rounds with k > p = drafted at position p."""
    out: dict[int, float] = {}
    if stats.rounds_off:
        out[0] = stats.rounds_off
    positions = sorted(stats.drafted_per_pos)
    for p in positions:
        at_least = stats.drafted_per_pos[p]
        more = stats.drafted_per_pos.get(p + 1, 0.0)
        if at_least - more > 0:
            out[p + 1] = at_least - more
    return out


def acceptance_by_position(stats: reader.ArmStats) -> list[dict]:
    """Per draft position (1-based) from the per-position counters: drafts proposed there, accepted there, their
    ratio (a draft at position p is accepted only after every earlier one of its round was), and the share of the
    rounds that drafted at all whose draft at p was accepted."""
    rounds = stats.rounds_on or 0
    rows = []
    for p in sorted(stats.drafted_per_pos):
        drafted, accepted = stats.drafted_per_pos[p], stats.accepted_per_pos.get(p, 0.0)
        rows.append(
            {
                "position": p + 1,
                "drafted": drafted,
                "accepted": accepted,
                "rate": accepted / drafted if drafted else None,
                "of_drafting_rounds": accepted / rounds if rounds else None,
            }
        )
    return rows


def speculation_section(
    window: reader.Snapshot | None, spec: PathCounts, policy: dict | None, spec_label: str = SPECULATIVE_MODEL
) -> dict:
    """What the deployment's policy did over the run: rounds on/off (and why), k per round."""
    section: dict = {
        "policy": policy or {},
        "source": None,
        "rounds_on": None,
        "rounds_off": None,
        "speculated_share": None,
        "off_reasons": {},
        "k_counts": {},
        "k_history": None,
    }
    if spec.k_histories:
        history = [k for h in spec.k_histories for k in h]
        section["k_history"] = history
        section["k_history_requests"] = [len(h) for h in spec.k_histories]
        counts: dict[int, int] = {}
        for k in history:
            counts[k] = counts.get(k, 0) + 1
        section["k_counts"] = dict(sorted(counts.items()))
        section["source"] = "speculative_k_history"
        on = sum(1 for k in history if k > 0)
        section["rounds_on"], section["rounds_off"] = on, len(history) - on
    if window is not None:
        stats = reader.arm_stats(window, core_metrics_names.SPECULATIVE_ARM, spec_label)
        if stats.rounds_on or stats.rounds_off:
            section["off_reasons"] = dict(sorted(stats.off_reasons.items(), key=lambda kv: -kv[1]))
            section["metrics_rounds_on"], section["metrics_rounds_off"] = stats.rounds_on, stats.rounds_off
            if section["source"] is None:
                section["source"] = "metrics"
                section["rounds_on"], section["rounds_off"] = stats.rounds_on, stats.rounds_off
                section["k_counts"] = k_counts_from_metrics(stats)
            section["acceptance_by_position"] = acceptance_by_position(stats)
            if stats.lookup_rounds:  # EAGLE-3 draft.sa_config: the drafting rounds the request's own text drafted
                section["lookup"] = {
                    "rounds": stats.lookup_rounds,
                    "drafted": stats.lookup_drafted,
                    "accepted": stats.lookup_accepted,
                    "head_rounds": stats.rounds_on - stats.lookup_rounds,
                    "head_drafted": stats.drafted - stats.lookup_drafted,
                    "head_accepted": stats.accepted - stats.lookup_accepted,
                }
    total = (section["rounds_on"] or 0) + (section["rounds_off"] or 0)
    if total:
        section["speculated_share"] = section["rounds_on"] / total
    return section


POLICY_PARAMETERS = (
    "speculation_policy",
    "num_draft_tokens",
    "max_draft_len",
    "draft_len_schedule",
    "max_concurrency",
    "acceptance_rate_window_size",
    "acceptance_rate_threshold",
    "acceptance_measure",
    "probe_interval",
    "canary_control_percent",
)


def served_policy(endpoint, configured: dict | None = None) -> dict:
    """The speculation policy the served BLS runs (its config parameters), else the one the deployment's description
    carries (`configured`, from the recipe); {} when neither says."""
    params, source = {}, "recipe"
    try:
        params = {k: v for k, v in endpoint.model_parameters(SPECULATIVE_MODEL).items() if k in POLICY_PARAMETERS}
        source = "served config" if params else source
    except (AttributeError, ClientError):  # an endpoint without configs (an OpenAI API), or unreadable
        pass
    configured = dict(configured or {})
    if not params:
        if not configured:
            return {}
        params = {k: v for k, v in configured.items() if k != "draft_kind"}
    return {
        "source": source,
        **({"draft_kind": configured["draft_kind"]} if "draft_kind" in configured else {}),
        **{k: v for k, v in params.items() if v not in ("", "{}")},
    }


def summary_lines(report: dict) -> list[str]:
    """Terminal lines: the policy that ran, the share of rounds that speculated and why it was off; the metrics
    check."""
    lines = []
    spec = report.get("speculation") or {}
    total = (spec.get("rounds_on") or 0) + (spec.get("rounds_off") or 0)
    if total:
        reasons = ", ".join(f"{r} {n:g}" for r, n in (spec.get("off_reasons") or {}).items())
        policy = (spec.get("policy") or {}).get("speculation_policy")  # a deployment without a recipe may not say
        lines.append(
            "speculation: "
            + (f"policy {policy}, " if policy else "")
            + f"{spec['speculated_share']:.0%} of {total:g} rounds speculated"
            + (f"; off: {reasons}" if reasons else "")
        )
    check = report.get("metrics_check") or {}
    if check.get("checked"):
        agreed = sum(1 for r in check.get("rows", []) if r.get("agree"))
        lines.append(
            f"metrics endpoint: {agreed} counts agree"
            + (f", {len(check['mismatches'])} differ" if check.get("mismatches") else "")
        )
    elif check.get("notes"):
        lines.append(f"metrics endpoint: {check['notes'][0]}")
    return lines
