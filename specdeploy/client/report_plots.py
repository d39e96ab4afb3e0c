"""The PNG plots of a validation report (latency per concurrency, speedup per category, the draft-length sweep,
the draft length per round), drawn with matplotlib's Agg backend; each returns False when the report has no data
for it.
"""

from __future__ import annotations

from pathlib import Path

CONTROL_COLOR, SPEC_COLOR = "#7f7f7f", "#1f77b4"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency(report: dict, path: Path) -> bool:
    """End-to-end latency and TPOT distributions, control vs speculative, per concurrency level."""
    runs = (report.get("latency") or {}).get("runs") or []
    samples = [s for r in runs for s in r["samples"]]
    if not samples:
        return False
    plt = _pyplot()
    levels = sorted({s["concurrency"] for s in samples})
    metrics = [("latency_s", "end-to-end latency (ms)"), ("tpot_s", "time per output token (ms)")]
    metrics = [m for m in metrics if any(s.get(m[0]) is not None for s in samples)]
    fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 4.5), squeeze=False)
    for ax, (key, label) in zip(axes[0], metrics):
        data, positions, colors = [], [], []
        for i, level in enumerate(levels):
            for j, (mode, color) in enumerate((("control", CONTROL_COLOR), ("speculative", SPEC_COLOR))):
                values = [
                    s[key] * 1000
                    for s in samples
                    if s["concurrency"] == level and s["mode"] == mode and s.get(key) is not None
                ]
                if values:
                    data.append(values)
                    positions.append(i * 3 + j)
                    colors.append(color)
        parts = ax.boxplot(data, positions=positions, widths=0.8, patch_artist=True, showfliers=True)
        for box, color in zip(parts["boxes"], colors):
            box.set_facecolor(color)
            box.set_alpha(0.6)
        for median in parts["medians"]:
            median.set_color("black")
        ax.set_xticks([i * 3 + 0.5 for i in range(len(levels))])
        ax.set_xticklabels([f"concurrency {c}" for c in levels])
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.6) for c in (CONTROL_COLOR, SPEC_COLOR)]
    k = (report.get("settings") or {}).get("num_draft_tokens")
    fig.suptitle(
        f"{report.get('recipe') or 'deployment'}: latency per request (box: quartiles, whiskers: 1.5 IQR)", fontsize=11
    )
    fig.legend(
        handles,
        ["control (ensemble)", f"speculative (BLS, k={k})"],
        loc="upper center",
        bbox_to_anchor=(0.5, 0.93),
        ncol=2,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.87))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_categories(report: dict, path: Path) -> bool:
    """Speedup per category and concurrency (median, bars show the range over repeats) and parity per category."""
    speedups = [r for r in (report.get("latency") or {}).get("speedups") or [] if r["median"] is not None]
    summary = (report.get("parity") or {}).get("summary") or {}
    if not speedups and not summary:
        return False
    plt = _pyplot()
    import numpy as np

    fig, (ax_speed, ax_parity) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    categories = list(dict.fromkeys(r["category"] for r in speedups))
    levels = sorted({r["concurrency"] for r in speedups})
    width = 0.8 / max(len(levels), 1)
    cmap = plt.get_cmap("Blues")
    for j, level in enumerate(levels):
        rows = {r["category"]: r for r in speedups if r["concurrency"] == level}
        x = np.arange(len(categories)) + (j - (len(levels) - 1) / 2) * width
        med = [rows[c]["median"] if c in rows else np.nan for c in categories]
        low = [rows[c]["median"] - rows[c]["min"] if c in rows else 0 for c in categories]
        high = [rows[c]["max"] - rows[c]["median"] if c in rows else 0 for c in categories]
        ax_speed.bar(
            x,
            med,
            width,
            yerr=[low, high],
            capsize=3,
            color=cmap(0.4 + 0.5 * j / max(len(levels) - 1, 1)),
            label=f"concurrency {level}",
        )
        for xi, m in zip(x, med):
            if not np.isnan(m):  # rotated, inside the bar (above a bar too short to hold it): readable at any count
                inside = m >= 0.3
                ax_speed.text(
                    xi,
                    0.03 if inside else m + 0.03,
                    f"{m:.2f}x",
                    ha="center",
                    va="bottom",
                    rotation=90,
                    fontsize=8,
                    color="white" if inside else "black",
                    weight="bold",
                )
    ax_speed.axhline(1.0, color="red", lw=1, ls="--", label="control (1.0x)")
    ax_speed.set_xticks(np.arange(len(categories)))
    ax_speed.set_xticklabels(categories)
    ax_speed.set_ylabel("speedup (control / speculative latency)")
    ax_speed.set_title("speedup per category", fontsize=10)
    ax_speed.legend(
        fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, frameon=False
    )  # below: never over a bar
    ax_speed.grid(axis="y", alpha=0.3)

    cats = [c for c in summary if c != "all"] + (["all"] if "all" in summary else [])
    exact = np.array([summary[c]["exact"] for c in cats], dtype=float)
    near = np.array([summary[c]["near_ties"] for c in cats], dtype=float)
    bad = np.array([summary[c]["mismatches"] for c in cats], dtype=float)
    short = np.array([summary[c].get("too_short", 0) for c in cats], dtype=float)
    total = np.maximum(exact + near + bad + short, 1)
    y = np.arange(len(cats))
    ax_parity.barh(y, exact / total, color="#2ca02c", label="exact")
    ax_parity.barh(y, near / total, left=exact / total, color="#ffbf00", label="near-tie")
    ax_parity.barh(y, bad / total, left=(exact + near) / total, color="#d62728", label="mismatch")
    ax_parity.barh(y, short / total, left=(exact + near + bad) / total, color="#c7c7c7", label="too short")
    for yi, c in zip(y, cats):
        ax_parity.text(1.01, yi, f"{summary[c]['exact']}/{summary[c]['prompts']}", va="center", fontsize=8)
    ax_parity.set_yticks(y)
    ax_parity.set_yticklabels(cats)
    ax_parity.set_xlim(0, 1.15)
    ax_parity.set_xlabel("share of prompts")
    ax_parity.set_title("greedy parity per category", fontsize=10)
    ax_parity.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_sweep(report: dict, path: Path) -> bool:
    """Speedup (measured with range, and the fitted model) and acceptance vs k."""
    sweep = report.get("sweep") or {}
    points = sweep.get("points") or []
    if not points:
        return False
    plt = _pyplot()
    from specdeploy.client.latency import expected_speedup

    ks = [p["k"] for p in points]
    fig, (ax_speed, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    med = [p["speedup"] if p["speedup"] is not None else float("nan") for p in points]
    low = [(p["speedup"] - p["speedup_spread"]["min"]) if p["speedup"] is not None else 0 for p in points]
    high = [(p["speedup_spread"]["max"] - p["speedup"]) if p["speedup"] is not None else 0 for p in points]
    ax_speed.errorbar(ks, med, yerr=[low, high], fmt="o", color=SPEC_COLOR, capsize=4, label="measured (median, range)")
    alpha, c = sweep.get("alpha"), sweep.get("cost_ratio")
    if alpha is not None and c is not None:
        fine = list(range(1, max(ks) + 1))
        ax_speed.plot(
            fine,
            [expected_speedup(alpha, k, c) for k in fine],
            "-",
            color="orange",
            label=f"model α={alpha:.2f}, c={c:.2f}",
        )
    rec = (sweep.get("recommendation") or {}).get("recommended_k")
    if rec is not None:
        ax_speed.axvline(rec, color="green", ls=":", label=f"recommended k={rec}")
    ax_speed.axhline(1.0, color="red", lw=1, ls="--", label="control (1.0x)")
    ax_speed.set_xlabel("num_draft_tokens (k)")
    ax_speed.set_ylabel("speedup at concurrency 1")
    ax_speed.set_xticks(ks)
    ax_speed.legend(fontsize=8)
    ax_speed.grid(alpha=0.3)
    ax_speed.set_title("speedup vs draft length", fontsize=10)

    rates = [p["acceptance_rate"] if p["acceptance_rate"] is not None else float("nan") for p in points]
    lengths = [p["acceptance_length"] if p["acceptance_length"] is not None else float("nan") for p in points]
    ax_acc.plot(ks, rates, "o-", color=SPEC_COLOR, label="acceptance rate")
    ax_acc.set_ylim(0, 1.05)
    ax_acc.set_ylabel("acceptance rate (accepted / drafted)", color=SPEC_COLOR)
    ax_acc.set_xlabel("num_draft_tokens (k)")
    ax_acc.set_xticks(ks)
    ax_len = ax_acc.twinx()
    ax_len.plot(ks, lengths, "s--", color="purple", label="acceptance length")
    ax_len.set_ylim(0, max(ks) + 1.5)
    ax_len.set_ylabel("acceptance length (tokens / target call)", color="purple")
    ax_acc.set_title("acceptance vs draft length", fontsize=10)
    ax_acc.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_draft_length(report: dict, path: Path) -> bool:
    """The k the policy chose: per round over the run (from `speculative_k_history`) with the rolling share
    of rounds that speculated; else the rounds per k from the metrics. Beside it: plain steps by reason."""
    spec = report.get("speculation") or {}
    history, counts, reasons = spec.get("k_history"), spec.get("k_counts") or {}, spec.get("off_reasons") or {}
    if not history and not counts:
        return False
    plt = _pyplot()
    import numpy as np

    fig, (ax, ax_why) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    policy = (spec.get("policy") or {}).get("speculation_policy", "?")
    if history:
        k = np.asarray(history, dtype=float)
        x = np.arange(1, len(k) + 1)
        ax.scatter(x, k, s=9, color=SPEC_COLOR, alpha=0.5, linewidths=0, label="k per round")
        window = max(1, min(50, len(k) // 10 or 1))
        share = np.convolve((k > 0).astype(float), np.ones(window) / window, mode="valid")
        ax.plot(
            x[window - 1 :],
            np.convolve(k, np.ones(window) / window, mode="valid"),
            color="#08306b",
            linewidth=1.2,
            label=f"mean k, rolling {window} rounds",
        )
        twin = ax.twinx()
        twin.plot(
            x[window - 1 :],
            share * 100,
            color="#d62728",
            linewidth=1.2,
            label=f"speculated, rolling {window} rounds (%)",
        )
        twin.set_ylim(0, 105)
        twin.set_ylabel("rounds that speculated (%)")
        bounds = np.cumsum(spec.get("k_history_requests") or [])[:-1]
        if 0 < len(bounds) <= 200:
            for b in bounds:
                ax.axvline(b + 0.5, color="#cccccc", linewidth=0.4, zorder=0)
        ax.set_xlabel("target pass (speculative requests in the order they finished; grey lines: request boundaries)")
        ax.set_ylabel("draft tokens k (0 = plain step)")
        ax.set_ylim(-0.2, max(1, k.max()) + 0.5)
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(
            handles,
            [h.get_label() for h in handles],
            loc="lower center",
            bbox_to_anchor=(0.5, 1.0),
            ncol=3,
            fontsize=8,
            frameon=False,
        )
        ax.set_title(
            f"policy {policy}: k over the run ({spec.get('speculated_share', 0):.0%} of rounds speculated)",
            fontsize=10,
            pad=22,
        )
    else:
        ks = sorted(counts, key=int)
        ax.bar(
            [str(k) for k in ks],
            [counts[k] for k in ks],
            color=[CONTROL_COLOR if int(k) == 0 else SPEC_COLOR for k in ks],
        )
        ax.set_xlabel("draft tokens k (0 = plain step)")
        ax.set_ylabel("rounds")
        ax.set_title(
            f"policy {policy}: rounds per k over the run (metrics; the BLS returns no k per round)", fontsize=10
        )
    ax.grid(axis="y", alpha=0.3)
    if reasons:
        names = list(reasons)
        ax_why.barh(names, [reasons[n] for n in names], color=CONTROL_COLOR)
        ax_why.invert_yaxis()
        ax_why.set_xlabel("plain steps")
        ax_why.set_title("why speculation was off", fontsize=10)
    else:
        ax_why.axis("off")
        ax_why.text(0.5, 0.5, "reasons off: none\n(or the metrics were not read)", ha="center", va="center", fontsize=9)
    fig.suptitle(f"{report.get('recipe') or 'deployment'}: draft length chosen by the speculation policy", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
