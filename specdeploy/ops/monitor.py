"""`specdeploy monitor`: a live terminal view of a deployment, read from Triton's metrics endpoint.

Each frame shows, per arm (speculative, and control when a canary runs): requests and requests in
flight, output tokens/s over the last interval, acceptance rate, tokens per target pass, TPOT p50/p99,
rounds with speculation on/off (and why off), and the cost per response and per 1,000 output tokens
at the recipe's machine price. Totals are since the server started; rates are over the interval.
Triton's own per-model request counters cover the control entry point (`ensemble`).
`frame` is a pure function of two scrapes, so one frame is testable (`--once`).
"""

from __future__ import annotations

import time

from specdeploy.core.cost import cost_of, format_money
from specdeploy.core.errors import ClientError
from specdeploy.core.metrics import names, reader
from specdeploy.recipe.config import CostConfig

TRITON_SUCCESS = "nv_inference_request_success"  # Triton's own counter, per model
TRITON_PENDING = "nv_inference_pending_request_count"
CLEAR = "\x1b[2J\x1b[H"


def _f(value, digits: int = 3, scale: float = 1.0, unit: str = "") -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}{unit}"


def frame(
    total: reader.Snapshot, window: reader.Snapshot, window_s: float, cost: CostConfig, title: str = ""
) -> list[str]:
    """The lines of one frame: `total` is the latest scrape, `window` its difference from the previous one."""
    lines = [f"specdeploy monitor {title}".rstrip() + f"  (interval {window_s:.1f} s)"]
    arms = [
        a
        for a in names.ARMS
        if a == names.SPECULATIVE_ARM or total.sum(names.REQUESTS.name, arm=a) or total.sum(names.RUNNING.name, arm=a)
    ]
    header = (
        f"{'arm':<12} {'requests':>8} {'running':>7} {'tok/s':>8} {'acc.rate':>8} {'tok/round':>9} {'TPOT p50':>9}"
        f" {'TPOT p99':>9} {'spec on/off':>12}"
    )
    lines.append(header)
    cost_lines = []
    for arm in arms:
        all_time = reader.arm_stats(total, arm)
        recent = reader.arm_stats(window, arm)
        # acceptance and TPOT over the interval when it saw traffic, else since start
        shown = recent if recent.requests or recent.target_passes else all_time
        onoff = f"{all_time.rounds_on:.0f}/{all_time.rounds_off:.0f}"
        lines.append(
            f"{arm:<12} {all_time.requests:>8.0f} {all_time.running:>7.0f} {_f(recent.tokens_per_s(window_s), 1):>8}"
            f" {_f(shown.acceptance_rate):>8} {_f(shown.tokens_per_round, 2):>9}"
            f" {_f(shown.tpot_p50_s, 1, 1000, 'ms'):>9} {_f(shown.tpot_p99_s, 1, 1000, 'ms'):>9} {onoff:>12}"
        )
        if all_time.lookup_rounds:
            lines.append(
                f"{'':<12} suffix lookup drafted {all_time.lookup_rounds:.0f} of {all_time.rounds_on:.0f} drafting"
                f" rounds, {all_time.lookup_accepted:.0f} of its {all_time.lookup_drafted:.0f} drafts accepted"
            )
        if all_time.off_reasons:
            reasons = ", ".join(f"{k} {v:.0f}" for k, v in sorted(all_time.off_reasons.items()))
            lines.append(f"{'':<12} speculation off: {reasons}")
        if cost.machine_price_per_hour > 0:
            rps = recent.requests / window_s if window_s > 0 else None
            c = cost_of(cost.machine_price_per_hour, rps or None, recent.tokens_per_s(window_s) or None, cost.currency)
            cost_lines.append(
                f"cost {arm:<12} per response {format_money(c.per_response, c.currency)}, "
                f"per 1k output tokens {format_money(c.per_1k_output_tokens, c.currency)}"
            )
    per_model = total.by_label(TRITON_SUCCESS, "model")
    if per_model:
        lines.append("triton requests: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(per_model.items()) if v))
    pending = total.sum(TRITON_PENDING)
    if total.has(TRITON_PENDING):
        lines.append(f"queued in triton: {pending:.0f}")
    if not total.has(names.REQUESTS.name) and not total.has(names.RUNNING.name):
        lines.append("no specdeploy metrics yet: send a request to tensorrt_llm_bls (the families appear on first use)")
    if cost.machine_price_per_hour > 0:
        lines += cost_lines + [
            f"(machine {cost.machine_price_per_hour:g} {cost.currency}/h; cost from the interval's rates, idle time"
            " included)"
        ]
    return lines


def run(
    url: str,
    cost: CostConfig,
    interval_s: float = 2.0,
    once: bool = False,
    echo=print,
    title: str = "",
    sleep=time.sleep,
    frames: int | None = None,
) -> None:
    """Print frames every `interval_s` until Ctrl-C (`once`: a single frame after one interval)."""
    previous = reader.scrape(url)
    shown = 0
    try:
        while True:
            sleep(interval_s)
            try:
                current = reader.scrape(url)
            except ClientError as exc:  # a server restarting: say so and keep watching (Ctrl-C ends it)
                if once:
                    raise
                echo(CLEAR + f"{exc.message}; retrying every {interval_s:g} s (Ctrl-C stops)")
                continue
            window_s = max(current.taken_s - previous.taken_s, 1e-9)
            lines = frame(current, current.minus(previous), window_s, cost, title)
            if current.resets(previous):  # the counters began again: the window holds what came after the restart
                lines.append("the server restarted: counters began again (this frame counts from the restart)")
            text = "\n".join(lines)
            echo(text if once else CLEAR + text)
            shown += 1
            if once or (frames is not None and shown >= frames):
                return
            previous = current
    except KeyboardInterrupt:
        return
