"""The validation report: report.json (every raw sample), report.md (tables a person reads), PNG plots.

Files are written one by one through a temporary name, so a report directory the user points at
(`--report-dir`) keeps its other files, and a crash never leaves a half-written report.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from specdeploy.cost import cost_markdown

CONTROL_COLOR, SPEC_COLOR = "#7f7f7f", "#1f77b4"


def write_report(report: dict, report_dir: str | Path) -> dict[str, Path]:
    """Write report.json, report.md and the plots that the report has data for; returns name -> path."""
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for name, plot in (("latency", plot_latency), ("categories", plot_categories), ("sweep", plot_sweep), ("draft_length", plot_draft_length)):
        path = out / f"{name}.png"
        if plot(report, path):
            paths[name] = path
        elif path.exists():
            path.unlink()  # a stale plot from an earlier run would contradict this report
    report = {**report, "plots": {k: p.name for k, p in paths.items()}}
    _write_text(out / "report.json", json.dumps(report, indent=1, default=_json_default) + "\n")
    _write_text(out / "report.md", render_markdown(report))
    paths["json"], paths["markdown"] = out / "report.json", out / "report.md"
    return paths


def _json_default(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


# ---------------------------------------------------------------- markdown


def _fmt(value, spec: str = ".3f", unit: str = "") -> str:
    if value is None:
        return "–"
    return f"{value:{spec}}{unit}"


def _ms(value) -> str:
    return _fmt(None if value is None else value * 1000, ".1f")


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|").replace("\n", "⏎") for c in row) + " |" for row in rows]
    return lines + [""]


def render_markdown(report: dict) -> str:
    settings = report.get("settings") or {}
    deployment = report.get("deployment") or {}
    names = deployment.get("served_names") or {}
    lines = [f"# Validation report: {report.get('recipe') or 'deployment'}", ""]
    gate = report.get("gate")
    if gate:
        lines += [f"**{gate['line']}**", ""]
    if not report.get("complete", True):
        lines += ["> **INCOMPLETE**: the run stopped early; the tables below hold what finished.", ">"]
        lines += [f"> error: {e}" for e in report.get("errors", [])] + [""]
    lines += [
        f"- server: `{report.get('url')}`" + (f", baseline: `{report['baseline_url']}`" if report.get("baseline_url") else ""),
        f"- created {report.get('created')}, took {_fmt(report.get('duration_s'), '.1f', ' s')}",
        f"- control: `{names.get('ensemble', 'ensemble')}` (target alone); speculative: `{names.get('tensorrt_llm_bls', 'tensorrt_llm_bls')}` "
        f"with num_draft_tokens={settings.get('num_draft_tokens')} (max_draft_len {settings.get('max_draft_len')})"
        + (f"; {deployment['protocol']} protocol" + (f", {deployment['layout']} layout" if deployment["protocol"] == "triton" else "")
           + (f", control at `{deployment['control_url']}`" if deployment.get("control_url") else "")
           + (" (a deployment described by its address and tokenizer, no recipe)" if deployment.get("foreign") else "") if deployment else ""),
        f"- prompts: {len(report.get('prompts') or [])} ({settings.get('prompt_set')}), max_tokens {settings.get('max_tokens')}, "
        f"concurrency {settings.get('concurrency')}, repeats {settings.get('repeats')}",
        "",
    ]
    if report.get("warnings"):
        lines += ["## Warnings", ""] + [f"- {w}" for w in report["warnings"]] + [""]
    lines += _parity_md(report)
    lines += _sampling_md(report)
    lines += _latency_md(report)
    lines += cost_markdown(report.get("cost"))
    lines += _speculation_md(report)
    lines += _metrics_check_md(report)
    lines += _not_checked_md(report)
    lines += _sweep_md(report)
    lines += _quality_md(report)
    for name, title in (("latency", "Latency distribution"), ("categories", "Per category"), ("sweep", "Draft-length sweep"),
                        ("draft_length", "Draft length the policy chose")):  # fmt: skip
        if name in (report.get("plots") or {}):
            lines += [f"![{title}]({report['plots'][name]})", ""]
    return "\n".join(lines)


def _parity_md(report: dict) -> list[str]:
    parity = report.get("parity")
    if not parity:
        return []
    if parity.get("exact_verification", False):
        rule = ("The backend verifies bit-exactly (the CPU engine's row-invariant kernels), so any divergence is a "
                "failure; the logit margins below are informative.")
    else:
        rule = (f"A divergence is a near-tie when the target's logits of the two competing tokens (end_id for a side that "
                f"ended there) differ by at most {parity.get('near_tie_margin')}; near-ties pass the gate and are counted, "
                "real mismatches fail it.")
    sources = sorted({i.get("token_source") for i in parity["items"] if i.get("token_source")})
    lines = [
        "## Greedy parity (speculative vs control)",
        "",
        f"{rule} A prompt whose control output has fewer than {parity.get('min_compared_tokens')} tokens is too short "
        f"to compare: it counts as neither match nor mismatch, and the gate needs at least "
        f"{_fmt(parity.get('min_compared_share'), '.0%')} of the prompts compared. Control tokens from: "
        f"{', '.join(sources) or '–'} (output_ids: returned by the model; target: the target alone's ids; "
        "retokenized: the text re-tokenized). Token agreement = tokens before the first divergence / control tokens."
        + (" Decoupled deployment: every prompt was also streamed on both paths, and the concatenated stream must "
           "equal the non-streamed text." if parity.get("streams_checked") else ""),
        "",
    ]
    rows = []
    for category, s in parity["summary"].items():
        rows.append([
            category, s["prompts"], s["compared"], s["tokens"], s["too_short"], s["exact"], s["near_ties"], s["mismatches"],
            f"{s['token_agreement']:.1%}", f"{s['parity_rate']:.1%}",
        ] + ([f"{s['streams_checked'] - s['stream_mismatches']}/{s['streams_checked']}"] if parity.get("streams_checked") else []))
    header = ["category", "prompts", "compared", "tokens compared", "too short", "exact", "near-ties", "mismatches", "token agreement", "parity"]
    lines += _table(header + (["streams equal"] if parity.get("streams_checked") else []), rows)
    short = [i for i in parity["items"] if i["verdict"] == "too_short"]
    if short:
        lines += ["Too short to compare: " + ", ".join(f"{i['prompt_id']} ({i['control_tokens']} tokens)" for i in short), ""]
    diverged = [i for i in parity["items"] if i["verdict"] not in ("match", "too_short") or i.get("stream_equal") is False]
    if diverged:
        lines += ["### Divergences", ""]
        rows = [
            [
                i["prompt_id"],
                i["verdict"],
                i["divergence_index"],
                f"{i['control_token']} {i['control_token_text']!r}" if i["control_token"] is not None else "(end)",
                f"{i['speculative_token']} {i['speculative_token_text']!r}" if i["speculative_token"] is not None else "(end)",
                _fmt(i["top1_top2_margin"], ".4f"),
                _fmt(i["token_margin"], ".4f"),
                i.get("note", ""),
            ]
            for i in diverged[:50]
        ]
        lines += _table(["prompt", "verdict", "first divergence", "control token", "speculative token", "top1-top2", "control-spec logit", "note"], rows)
    baseline = report.get("baseline_parity")
    if baseline and baseline.get("summary"):
        s = baseline["summary"]["all"]
        lines += [
            f"Against the baseline deployment (informative, not gated): exact match {s['exact_match_rate']:.1%}, "
            f"token agreement {s['token_agreement']:.1%} over {s['prompts']} prompts.",
            "",
        ]
    return lines


def _sampling_md(report: dict) -> list[str]:
    sampling = report.get("sampling")
    if not sampling:
        return []
    lines = [
        "## Sampling (statistical comparison)",
        "",
        f"{sampling['samples_per_prompt']} seeded samples per side and prompt, {sampling['max_tokens']} tokens, "
        f"settings {sampling['settings']}; chi-square test of homogeneity per prompt, combined with Fisher's method: "
        f"**p = {_fmt(sampling['combined_p_value'], '.3g')}** (fails below {sampling['alpha']}).",
        "",
    ]
    rows = [[t["prompt_id"], t["outcomes"], f"{t['statistic']:.2f}", t["dof"], f"{t['p_value']:.3g}"] for t in sampling["tests"]]
    return lines + _table(["prompt", "distinct outcomes", "chi-square", "dof", "p-value"], rows)


def _latency_md(report: dict) -> list[str]:
    latency = report.get("latency")
    if not latency or not latency.get("levels"):
        return []
    sources = sorted({r["ttft_source"] for r in latency["levels"] if r.get("ttft_source")})
    explain = {
        "stream": "stream (client clock: request sent → first non-empty streamed response → last response)",
        "server": "server (the model's perf outputs: arrival_time_ns → first_token_time_ns → last_token_time_ns)",
    }
    counted = sorted({t for r in latency["levels"] for t in r.get("tokens_source") or []})
    settings = report.get("settings") or {}
    timed = settings.get("latency_prompt_ids")
    lines = [
        "## Latency",
        "",
        f"Milliseconds. TTFT and TPOT = (last token − first token) / (output tokens − 1) from: "
        f"{'; '.join(explain.get(s, s) for s in sources) or 'n/a'}. Output tokens counted from: {', '.join(counted) or '–'} "
        "(output_ids: returned by the model; parity: the parity phase's exact ids for the same text; retokenized: the text "
        "re-tokenized). Acceptance rate = accepted / drafted draft tokens (server counts); acceptance length = output "
        "tokens / target iterations, with iterations = output tokens − accepted tokens."
        + (f" Each run sends {len(timed)} of the {len(report.get('prompts') or [])} prompts ({', '.join(timed)})." if timed and len(timed) < len(report.get("prompts") or []) else ""),
        "",
    ]
    rows = [
        [
            r["concurrency"],
            r["mode"],
            r["requests"],
            _ms(r["ttft_s_p50"]),
            _ms(r["tpot_s_p50"]),
            r.get("ttft_source") or "–",
            _ms(r["e2e_s_p50"]),
            _ms(r["e2e_s_p90"]),
            _ms(r["e2e_s_p99"]),
            _fmt(r["output_tokens_per_s"], ".1f"),
            _fmt(r["requests_per_s"], ".2f"),
            _fmt(r["acceptance_rate"], ".2f"),
            _fmt(r["acceptance_length"], ".2f"),
        ]
        for r in latency["levels"]
    ]
    lines += _table(
        ["conc.", "path", "requests", "TTFT p50", "TPOT p50", "timing from", "e2e p50", "e2e p90", "e2e p99", "out tok/s", "req/s", "accept rate", "accept len"],
        rows,
    )
    lines += ["### Speedup (control latency / speculative latency; median and range over repeats)", ""]
    rows = [
        [r["concurrency"], r["category"], _fmt(r["median"], ".2f", "x"), f"{_fmt(r['min'], '.2f')}..{_fmt(r['max'], '.2f')}", _fmt(r["std"], ".3f")]
        for r in latency["speedups"]
    ]
    return lines + _table(["concurrency", "category", "speedup", "range", "std"], rows)


REASONS = {
    "last_token": "one token left to generate: nothing to draft",
    "no_proposal": "the draft proposed nothing (no n-gram match): a plain run instead",
    "gate": "the acceptance gate turned speculation off (rolling acceptance below acceptance_rate_threshold)",
    "schedule": "draft_len_schedule / max_concurrency: too many active sequences",
    "policy": "the cost policy predicted a plain target step pays more",
    "control_arm": "the canary sent the request down the plain path",
    "num_draft_tokens_0": "the request asked for no draft tokens",
}


def _speculation_md(report: dict) -> list[str]:
    spec = report.get("speculation")
    if not spec:
        return []
    policy = spec.get("policy") or {}
    lines = ["## Speculation policy and what it did", ""]
    if policy:
        settings = ", ".join(f"{k} {v}" for k, v in policy.items() if k not in ("source", "speculation_policy"))
        lines += [f"Policy **{policy.get('speculation_policy', '?')}** (from the {policy.get('source', 'recipe')}): {settings}.", ""]
    total = (spec.get("rounds_on") or 0) + (spec.get("rounds_off") or 0)
    if not total:
        return lines + ["No rounds counted (no metrics endpoint and no `speculative_k_history` output).", ""]
    source = {"speculative_k_history": "the BLS's `speculative_k_history` output of every speculative request",
              "metrics": "the metrics endpoint over the run (`specdeploy_spec_decode_rounds_total`, per-position draft counters)"}  # fmt: skip
    lines += [
        f"Over the run ({source.get(spec.get('source'), spec.get('source'))}): {total} target passes on the speculative path, "
        f"**{spec['speculated_share']:.0%} speculated** ({spec['rounds_on']:g} with a draft, {spec['rounds_off']:g} plain steps).",
        "",
    ]
    if spec.get("k_counts"):
        lines += _table(["k (draft tokens)", "rounds", "share"],
                        [[k, f"{n:g}", f"{n / total:.0%}"] for k, n in sorted(spec["k_counts"].items(), key=lambda kv: int(kv[0]))])  # fmt: skip
    reasons = spec.get("off_reasons") or {}
    if reasons:
        off = sum(reasons.values())
        lines += ["Where speculation was off, and why (metrics endpoint):", ""]
        lines += _table(["reason", "rounds", "share of plain steps", "meaning"],
                        [[r, f"{n:g}", f"{n / off:.0%}", REASONS.get(r, "")] for r, n in reasons.items()])  # fmt: skip
    return lines


def _metrics_check_md(report: dict) -> list[str]:
    check = report.get("metrics_check")
    if not check:
        return []
    lines = ["## Metrics endpoint against validate's own counts", ""]
    if check.get("url"):
        lines += [f"Endpoint `{check['url']}`, read before and after the run.", ""]
    rows = check.get("rows") or []
    if rows:
        lines += _table(["path", "metric", "metrics endpoint", "validate counted", "agree"],
                        [[r["path"], f"`{r['metric']}`", f"{r['metrics']:g}", "–" if r["client"] is None else f"{r['client']:g}",
                          {True: "yes", False: "**NO**", None: "–"}[r["agree"]]] for r in rows])  # fmt: skip
    lines += [f"- {n}" for n in check.get("notes") or []]
    return lines + ([""] if check.get("notes") else [])


def _not_checked_md(report: dict) -> list[str]:
    items = report.get("not_checked") or []
    if not items:
        return []
    lines = ["## Not checked", "", "What this deployment does not expose, so this run could not check it:", ""]
    return lines + [f"- **{i['what']}**: not checked, because {i['because']}" for i in items] + [""]


def _sweep_md(report: dict) -> list[str]:
    sweep = report.get("sweep")
    if not sweep or not sweep.get("points"):
        return []
    rec = sweep["recommendation"]
    lines = ["## Draft-length sweep (concurrency 1)", ""]
    rows = [
        [
            p["k"],
            _fmt(p["acceptance_rate"], ".2f"),
            _fmt(p["acceptance_length"], ".2f"),
            _fmt(p["speedup"], ".2f", "x"),
            f"{_fmt(p['speedup_spread']['min'], '.2f')}..{_fmt(p['speedup_spread']['max'], '.2f')}",
            _fmt(rec.get("predicted", {}).get(p["k"], rec.get("predicted", {}).get(str(p["k"]))), ".2f", "x"),
        ]
        for p in sweep["points"]
    ]
    lines += _table(["k", "acceptance rate", "acceptance length", "speedup", "range", "model"], rows)
    lines += [
        f"Fitted expected-speedup model (Leviathan et al. 2023): α = {_fmt(sweep['alpha'], '.3f')}, "
        f"c = draft/target cost = {_fmt(sweep['cost_ratio'], '.3f')}. "
        f"**Recommended num_draft_tokens: {rec.get('recommended_k')}** "
        f"(model {_fmt(rec.get('predicted_speedup'), '.2f', 'x')}; best measured {_fmt(rec.get('best_measured_speedup'), '.2f', 'x')} "
        f"at k={rec.get('best_measured_k')}).",
        "",
    ]
    return lines


def _quality_md(report: dict) -> list[str]:
    quality = report.get("quality") or {}
    if not quality:
        return []
    known = ["qformat", "kv_cache_dtype", "source_perplexity", "quantized_perplexity", "top1_agreement", "mean_kl", "num_sequences", "num_tokens"]
    present = {k for q in quality.values() for k in q if not isinstance(q[k], (dict, list))}
    keys = [k for k in known if k in present] + sorted(present - set(known))
    rows = [[role] + [_cell(q.get(k)) for k in keys] for role, q in quality.items()]
    return ["## Quantization quality (quantize stage)", ""] + _table(["model"] + keys, rows)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "–" if value is None else str(value)


# ---------------------------------------------------------------- plots


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
                values = [s[key] * 1000 for s in samples if s["concurrency"] == level and s["mode"] == mode and s.get(key) is not None]
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
    fig.suptitle(f"{report.get('recipe') or 'deployment'}: latency per request (box: quartiles, whiskers: 1.5 IQR)", fontsize=11)
    fig.legend(handles, ["control (ensemble)", f"speculative (BLS, k={k})"], loc="upper center", bbox_to_anchor=(0.5, 0.93), ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.87))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_categories(report: dict, path: Path) -> bool:
    """Speedup per category and concurrency (median, bars show the range over repeats) and parity per category."""
    speedups = [r for r in ((report.get("latency") or {}).get("speedups") or []) if r["median"] is not None]
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
        ax_speed.bar(x, med, width, yerr=[low, high], capsize=3, color=cmap(0.4 + 0.5 * j / max(len(levels) - 1, 1)), label=f"concurrency {level}")
        for xi, m in zip(x, med):
            if not np.isnan(m):  # rotated, inside the bar (above a bar too short to hold it): readable at any count
                inside = m >= 0.3
                ax_speed.text(xi, 0.03 if inside else m + 0.03, f"{m:.2f}x", ha="center", va="bottom", rotation=90,
                              fontsize=8, color="white" if inside else "black", weight="bold")
    ax_speed.axhline(1.0, color="red", lw=1, ls="--", label="control (1.0x)")
    ax_speed.set_xticks(np.arange(len(categories)))
    ax_speed.set_xticklabels(categories)
    ax_speed.set_ylabel("speedup (control / speculative latency)")
    ax_speed.set_title("speedup per category", fontsize=10)
    ax_speed.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, frameon=False)  # below: never over a bar
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
        ax_speed.plot(fine, [expected_speedup(alpha, k, c) for k in fine], "-", color="orange", label=f"model α={alpha:.2f}, c={c:.2f}")
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
        ax.plot(x[window - 1:], np.convolve(k, np.ones(window) / window, mode="valid"), color="#08306b", linewidth=1.2,
                label=f"mean k, rolling {window} rounds")  # fmt: skip
        twin = ax.twinx()
        twin.plot(x[window - 1:], share * 100, color="#d62728", linewidth=1.2, label=f"speculated, rolling {window} rounds (%)")
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
        ax.legend(handles, [h.get_label() for h in handles], loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize=8, frameon=False)
        ax.set_title(f"policy {policy}: k over the run ({spec.get('speculated_share', 0):.0%} of rounds speculated)", fontsize=10, pad=22)
    else:
        ks = sorted(counts, key=int)
        ax.bar([str(k) for k in ks], [counts[k] for k in ks], color=[CONTROL_COLOR if int(k) == 0 else SPEC_COLOR for k in ks])
        ax.set_xlabel("draft tokens k (0 = plain step)")
        ax.set_ylabel("rounds")
        ax.set_title(f"policy {policy}: rounds per k over the run (metrics; the BLS returns no k per round)", fontsize=10)
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
