"""report.md of a validation run: the tables a person reads (parity, sampling, latency, speculation, metrics check,
what was not checked, sweep, quantization quality, cost), rendered from the report dict.
"""

from __future__ import annotations

from specdeploy.client.summary import DRAFT_LENGTH_NOT_SENT
from specdeploy.core.cost import cost_markdown


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
    k_not_sent = any(i["what"].startswith(DRAFT_LENGTH_NOT_SENT) for i in report.get("not_checked") or [])
    draft_length = (
        "with the deployment's own draft length (num_draft_tokens not sent: see Not checked)"
        if k_not_sent
        else f"with num_draft_tokens={settings.get('num_draft_tokens')} (max_draft_len {settings.get('max_draft_len')})"
    )
    gate = report.get("gate")
    if gate:
        lines += [f"**{gate['line']}**", ""]
    if not report.get("complete", True):
        lines += ["> **INCOMPLETE**: the run stopped early; the tables below hold what finished.", ">"]
        lines += [f"> error: {e}" for e in report.get("errors", [])] + [""]
    lines += [
        f"- server: `{report.get('url')}`"
        + (f", baseline: `{report['baseline_url']}`" if report.get("baseline_url") else ""),
        f"- created {report.get('created')}, took {_fmt(report.get('duration_s'), '.1f', ' s')}",
        _paths_line(deployment, names)
        + draft_length
        + (
            f"; {deployment['protocol']} protocol"
            + (f", {deployment['layout']} layout" if deployment["protocol"] == "triton" else "")
            + (f", control at `{deployment['control_url']}`" if deployment.get("control_url") else "")
            + (" (a deployment described by its address and tokenizer, no recipe)" if deployment.get("foreign") else "")
            if deployment
            else ""
        ),
        (
            f"- prompts: {len(report.get('prompts') or [])} ({settings.get('prompt_set')}), max_tokens"
            f" {settings.get('max_tokens')}, concurrency {settings.get('concurrency')}, repeats"
            f" {settings.get('repeats')}"
        ),
        "",
    ]
    if report.get("warnings"):
        lines += ["## Warnings", ""] + [f"- {w}" for w in report["warnings"]] + [""]
    lines += _parity_md(report)
    lines += _sampling_md(report)
    lines += _latency_md(report)
    lines += _acceptance_md(report)
    lines += cost_markdown(report.get("cost"))
    lines += _speculation_md(report)
    lines += _metrics_check_md(report)
    lines += _not_checked_md(report)
    lines += _sweep_md(report)
    lines += _quality_md(report)
    for name, title in (
        ("latency", "Latency distribution"),
        ("categories", "Per category"),
        ("sweep", "Draft-length sweep"),
        ("draft_length", "Draft length the policy chose"),
    ):
        if name in (report.get("plots") or {}):
            lines += [f"![{title}]({report['plots'][name]})", ""]
    return "\n".join(lines)


def _paths_line(deployment: dict, names: dict) -> str:
    """The two paths as the run reached them: over OpenAI, each one's model id and base URL; over Triton, the models."""
    ends = deployment.get("endpoints")
    if ends:
        control, spec = ends["control"], ends["speculative"]
        return (
            f"- control: model `{control['model']}` at `{control['url']}` (target alone); speculative: "
            f"model `{spec['model']}` at `{spec['url']}` "
        )
    control, spec = names.get("ensemble", "ensemble"), names.get("tensorrt_llm_bls", "tensorrt_llm_bls")
    return f"- control: `{control}` (target alone); speculative: `{spec}` "


def _parity_md(report: dict) -> list[str]:
    parity = report.get("parity")
    if not parity:
        return []
    if parity.get("exact_verification", False):
        rule = (
            "The backend verifies bit-exactly (the CPU engine's row-invariant kernels), so any divergence is a "
            "failure; the logit margins below are informative."
        )
    else:
        rule = (
            "A divergence is a near-tie when the target's logits of the two competing tokens (end_id for a side that "
            f"ended there) differ by at most {parity.get('near_tie_margin')}; near-ties pass the gate and are counted, "
            "real mismatches fail it."
        )
    sources = sorted({i.get("token_source") for i in parity["items"] if i.get("token_source")})
    lines = [
        "## Greedy parity (speculative vs control)",
        "",
        f"{rule} A prompt whose control output has fewer than {parity.get('min_compared_tokens')} tokens is too short "
        "to compare: it counts as neither match nor mismatch, and the gate needs at least "
        f"{_fmt(parity.get('min_compared_share'), '.0%')} of the prompts compared. Control tokens from: "
        f"{', '.join(sources) or '–'} (output_ids: returned by the model; target: the target alone's ids; "
        "retokenized: the text re-tokenized). Token agreement = tokens before the first divergence / control tokens."
        + (
            " Decoupled deployment: every prompt was also streamed on both paths, and the concatenated stream must "
            "equal the non-streamed text."
            if parity.get("streams_checked")
            else ""
        ),
        "",
    ]
    rows = []
    for category, s in parity["summary"].items():
        rows.append(
            [
                category,
                s["prompts"],
                s["compared"],
                s["tokens"],
                s["too_short"],
                s["exact"],
                s["near_ties"],
                s["mismatches"],
                f"{s['token_agreement']:.1%}",
                f"{s['parity_rate']:.1%}",
            ]
            + (
                [f"{s['streams_checked'] - s['stream_mismatches']}/{s['streams_checked']}"]
                if parity.get("streams_checked")
                else []
            )
        )
    header = [
        "category",
        "prompts",
        "compared",
        "tokens compared",
        "too short",
        "exact",
        "near-ties",
        "mismatches",
        "token agreement",
        "parity",
    ]
    lines += _table(header + (["streams equal"] if parity.get("streams_checked") else []), rows)
    short = [i for i in parity["items"] if i["verdict"] == "too_short"]
    if short:
        lines += [
            "Too short to compare: " + ", ".join(f"{i['prompt_id']} ({i['control_tokens']} tokens)" for i in short),
            "",
        ]
    diverged = [
        i for i in parity["items"] if i["verdict"] not in ("match", "too_short") or i.get("stream_equal") is False
    ]
    if diverged:
        lines += ["### Divergences", ""]
        rows = [
            [
                i["prompt_id"],
                i["verdict"],
                i["divergence_index"],
                f"{i['control_token']} {i['control_token_text']!r}" if i["control_token"] is not None else "(end)",
                (
                    f"{i['speculative_token']} {i['speculative_token_text']!r}"
                    if i["speculative_token"] is not None
                    else "(end)"
                ),
                _fmt(i["top1_top2_margin"], ".4f"),
                _fmt(i["token_margin"], ".4f"),
                i.get("note", ""),
            ]
            for i in diverged[:50]
        ]
        lines += _table(
            [
                "prompt",
                "verdict",
                "first divergence",
                "control token",
                "speculative token",
                "top1-top2",
                "control-spec logit",
                "note",
            ],
            rows,
        )
    baseline = report.get("baseline_parity")
    if baseline and baseline.get("summary"):
        s = baseline["summary"]["all"]
        lines += [
            (
                f"Against the baseline deployment (informative, not gated): exact match {s['exact_match_rate']:.1%}, "
                f"token agreement {s['token_agreement']:.1%} over {s['prompts']} prompts."
            ),
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
        (
            f"{sampling['samples_per_prompt']} seeded samples per side and prompt, {sampling['max_tokens']} tokens,"
            f" settings {sampling['settings']}; chi-square test of homogeneity per prompt, combined with Fisher's"
            f" method: **p = {_fmt(sampling['combined_p_value'], '.3g')}** (fails below {sampling['alpha']})."
        ),
        "",
    ]
    rows = [
        [t["prompt_id"], t["outcomes"], f"{t['statistic']:.2f}", t["dof"], f"{t['p_value']:.3g}"]
        for t in sampling["tests"]
    ]
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
    accepted_from = sorted({r["acceptance_source"] for r in latency["levels"] if r.get("acceptance_source")})
    settings = report.get("settings") or {}
    timed = settings.get("latency_prompt_ids")
    lines = [
        "## Latency",
        "",
        "Milliseconds. TTFT and TPOT = (last token − first token) / (output tokens − 1) from:"
        f" {'; '.join(explain.get(s, s) for s in sources) or 'n/a'}. Output tokens counted from:"
        f" {', '.join(counted) or '–'} (output_ids: returned by the model; usage: the server's usage.completion_tokens;"
        " parity: the parity phase's exact ids for the same text; retokenized: the text re-tokenized). Acceptance rate"
        " = accepted / drafted draft tokens (server counts); acceptance length = output tokens / target iterations,"
        " with iterations = output tokens − accepted tokens (from a runtime's metrics endpoint: 1 + accepted /"
        " verification passes that held drafts)."
        + (f" Acceptance counted from: {'; '.join(accepted_from)}." if accepted_from else "")
        + (
            f" Each run sends {len(timed)} of the {len(report.get('prompts') or [])} prompts ({', '.join(timed)})."
            if timed and len(timed) < len(report.get("prompts") or [])
            else ""
        ),
        "",
    ]
    rows = [
        [
            r["concurrency"],
            r["mode"],
            r["requests"],
            _ms(r["ttft_s_p50"]),
            _ms(r["ttft_s_p90"]),
            _ms(r["ttft_s_p99"]),
            _ms(r["tpot_s_p50"]),
            _ms(r["tpot_s_p90"]),
            _ms(r["tpot_s_p99"]),
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
        [
            "conc.",
            "path",
            "requests",
            "TTFT p50",
            "p90",
            "p99",
            "TPOT p50",
            "p90",
            "p99",
            "timing from",
            "e2e p50",
            "e2e p90",
            "e2e p99",
            "out tok/s",
            "req/s",
            "accept rate",
            "accept len",
        ],
        rows,
    )
    lines += [
        "### Speedup (control latency / speculative latency; median and range over repeats) and acceptance by category",
        "",
    ]
    rows = [
        [
            r["concurrency"],
            r["category"],
            _fmt(r["median"], ".2f", "x"),
            f"{_fmt(r['min'], '.2f')}..{_fmt(r['max'], '.2f')}",
            _fmt(r["std"], ".3f"),
            _fmt(r.get("acceptance_rate"), ".2f"),
            _fmt(r.get("acceptance_length"), ".2f"),
        ]
        for r in latency["speedups"]
    ]
    lines += _table(["concurrency", "category", "speedup", "range", "std", "accept rate", "accept len"], rows)
    return lines + _round_profile_md(latency.get("round_profile") or [])


def _round_profile_md(profile: list[dict]) -> list[str]:
    if not profile:
        return []
    lines = [
        "### Where a speculative round's time goes (the server's clocks)",
        "",
        (
            "After the first token, per round of the speculative path (one target call: fused EAGLE-3, one engine pass"
            " of k + 1 rows; the BLS's other paths, a Triton call, and a round of k = 0 there may be a plain run of"
            " several tokens): the draft's work before it (fused: the head's catch-up and draft steps), the target"
            " call, and the rest of the server's first-to-last-token time (the loop, scheduling, the Triton hop), in"
            " milliseconds and in control steps (the control's decode time a token at the same concurrency). TPOT"
            " speedup = tokens a round / a round in control steps. At concurrency above 1 a pass shared with other"
            " requests counts whole for each. From the BLS's `speculative_draft_seconds` / `speculative_target_seconds`"
            " beside `speculative_k_history`."
        ),
        "",
    ]
    rows = [
        [
            p["concurrency"],
            p["rounds"],
            _fmt(p["tokens_per_round"], ".2f"),
            _ms(p["control_step_s"]),
            f"{_ms(p['draft_s_per_round'])} ({_fmt(p['draft_steps'], '.2f')})",
            f"{_ms(p['target_s_per_round'])} ({_fmt(p['target_steps'], '.2f')})",
            f"{_ms(p['rest_s_per_round'])} ({_fmt(p['rest_steps'], '.2f')})",
            _fmt(p["round_steps"], ".2f"),
            _fmt(p["tpot_speedup"], ".2f", "x"),
        ]
        for p in profile
    ]
    lines += _table(
        [
            "conc.",
            "rounds",
            "tokens a round",
            "control step",
            "draft (steps)",
            "target call (steps)",
            "rest (steps)",
            "round in steps",
            "TPOT speedup",
        ],
        rows,
    )
    lines += ["The target call by draft tokens verified (k drafts: k + 1 rows):", ""]
    rows = [
        [p["concurrency"], b["k"], b["rounds"], _ms(b["target_s"]), _fmt(b["target_steps"], ".2f"), _ms(b["draft_s"])]
        for p in profile
        for b in p["by_k"]
    ]
    return lines + _table(["conc.", "k", "rounds", "target call", "in control steps", "draft work before it"], rows)


REASONS = {
    "last_token": "one token left to generate: nothing to draft",
    "no_proposal": "the draft proposed nothing (no n-gram match): a plain run instead",
    "draft_p_min": "the EAGLE-3 head gave its first draft less than speculative.draft_p_min: one target row, no drafts",
    "gate": "the acceptance gate turned speculation off (rolling acceptance below acceptance_rate_threshold)",
    "schedule": "draft_len_schedule / max_concurrency: too many active sequences",
    "policy": "the cost policy predicted a plain target step pays more",
    "control_arm": "the canary sent the request down the plain path",
    "num_draft_tokens_0": "the request asked for no draft tokens",
}


def _acceptance_md(report: dict) -> list[str]:
    acc = report.get("acceptance")
    if not acc:
        return []

    def row(name, f):
        lo, hi = f["acceptance_length_ci95"]
        rlo, rhi = f["acceptance_rate_ci95"]
        return [
            name,
            f["prompts"],
            f["drafted"],
            f["accepted"],
            f"{f['acceptance_length']:.2f}",
            f"{lo:.2f} – {hi:.2f}",
            f"{f['acceptance_rate']:.2f}",
            f"{rlo:.2f} – {rhi:.2f}",
        ]

    lines = [
        "## Acceptance over every prompt served speculatively",
        "",
        (
            f"Each prompt once (greedy answers repeat), from the {' and '.join(acc['phases'])} phase; 95 % interval: "
            "percentile bootstrap over prompts. Length = output tokens / target passes."
        ),
        "",
    ]
    lines += _table(
        ["category", "prompts", "drafted", "accepted", "acc. length", "95 % interval", "acc. rate", "95 % interval"],
        [row("all", acc["all"])] + [row(c, f) for c, f in acc["by_category"].items()],
    )
    if acc.get("by_source"):
        lines += ["By draft source (the deployment's metrics endpoint, whole run):", ""]
        lines += _table(
            ["source", "drafting rounds", "drafted", "accepted", "accepted / round"],
            [
                [k, f"{v['rounds']:g}", f"{v['drafted']:g}", f"{v['accepted']:g}", _fmt(v["accepted_per_round"], ".2f")]
                for k, v in acc["by_source"].items()
            ],
        )
    return lines


def _speculation_md(report: dict) -> list[str]:
    spec = report.get("speculation")
    if not spec:
        return []
    policy = spec.get("policy") or {}
    lines = ["## Speculation policy and what it did", ""]
    if policy:
        settings = ", ".join(f"{k} {v}" for k, v in policy.items() if k not in ("source", "speculation_policy"))
        lines += [
            (
                f"Policy **{policy.get('speculation_policy', '?')}** (from the {policy.get('source', 'recipe')}):"
                f" {settings}."
            ),
            "",
        ]
    total = (spec.get("rounds_on") or 0) + (spec.get("rounds_off") or 0)
    if not total:
        return lines + ["No rounds counted (no metrics endpoint and no `speculative_k_history` output).", ""]
    source = {
        "speculative_k_history": "the BLS's `speculative_k_history` output of every speculative request",
        "metrics": (
            "the metrics endpoint over the run (`specdeploy_spec_decode_rounds_total`, per-position draft counters)"
        ),
    }
    lines += [
        (
            f"Over the run ({source.get(spec.get('source'), spec.get('source'))}): {total} target passes on the"
            f" speculative path, **{spec['speculated_share']:.0%} speculated** ({spec['rounds_on']:g} with a draft,"
            f" {spec['rounds_off']:g} plain steps)."
        ),
        "",
    ]
    if spec.get("k_counts"):
        lines += _table(
            ["k (draft tokens)", "rounds", "share"],
            [[k, f"{n:g}", f"{n / total:.0%}"] for k, n in sorted(spec["k_counts"].items(), key=lambda kv: int(kv[0]))],
        )
    by_position = spec.get("acceptance_by_position") or []
    if by_position:
        lines += ["Acceptance by draft position (metrics endpoint, per-position counters):", ""]
        lines += _table(
            ["draft position", "drafted", "accepted", "accepted / drafted", "accepted / drafting rounds"],
            [
                [
                    r["position"],
                    f"{r['drafted']:g}",
                    f"{r['accepted']:g}",
                    _fmt(r["rate"], ".2f"),
                    _fmt(r["of_drafting_rounds"], ".2f"),
                ]
                for r in by_position
            ],
        )
    lookup = spec.get("lookup")
    if lookup:
        lines += [
            (
                "Who drafted (metrics endpoint: `draft.sa_config`'s suffix lookup in the request's own text, else the"
                " head):"
            ),
            "",
        ]
        lines += _table(
            ["drafted by", "rounds", "draft tokens", "accepted", "accepted a round"],
            [
                [
                    who,
                    f"{lookup[r]:g}",
                    f"{lookup[d]:g}",
                    f"{lookup[a]:g}",
                    _fmt(lookup[a] / lookup[r] if lookup[r] else None, ".2f"),
                ]
                for who, r, d, a in (
                    ("suffix lookup", "rounds", "drafted", "accepted"),
                    ("head", "head_rounds", "head_drafted", "head_accepted"),
                )
            ],
        )
    reasons = spec.get("off_reasons") or {}
    if reasons:
        off = sum(reasons.values())
        lines += ["Where speculation was off, and why (metrics endpoint):", ""]
        lines += _table(
            ["reason", "rounds", "share of plain steps", "meaning"],
            [[r, f"{n:g}", f"{n / off:.0%}", REASONS.get(r, "")] for r, n in reasons.items()],
        )
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
        lines += _table(
            ["path", "metric", "metrics endpoint", "validate counted", "agree"],
            [
                [
                    r["path"],
                    f"`{r['metric']}`",
                    f"{r['metrics']:g}",
                    "–" if r["client"] is None else f"{r['client']:g}",
                    {True: "yes", False: "**NO**", None: "–"}[r["agree"]],
                ]
                for r in rows
            ],
        )
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
            _fmt(p.get("most_drafts"), "d"),
        ]
        for p in sweep["points"]
    ]
    lines += _table(
        ["k", "acceptance rate", "acceptance length", "speedup", "range", "model", "most drafts in a round"], rows
    )
    verdict = (
        f"**No num_draft_tokens recommended: {rec['no_recommendation']}** "
        if rec.get("no_recommendation")
        else f"**Recommended num_draft_tokens: {rec.get('recommended_k')}** "
    )
    lines += [
        f"Fitted expected-speedup model (Leviathan et al. 2023): α = {_fmt(sweep['alpha'], '.3f')}, "
        f"c = draft/target cost = {_fmt(sweep['cost_ratio'], '.3f')}. "
        + verdict
        + f"(model {_fmt(rec.get('predicted_speedup'), '.2f', 'x')}; best measured"
        f" {_fmt(rec.get('best_measured_speedup'), '.2f', 'x')} at k={rec.get('best_measured_k')}).",
        "",
    ]
    return lines


def _quality_md(report: dict) -> list[str]:
    quality = report.get("quality") or {}
    if not quality:
        return []
    known = [
        "qformat",
        "kv_cache_dtype",
        "source_perplexity",
        "quantized_perplexity",
        "top1_agreement",
        "mean_kl",
        "num_sequences",
        "num_tokens",
    ]
    present = {k for q in quality.values() for k in q if not isinstance(q[k], (dict, list))}
    keys = [k for k in known if k in present] + sorted(present - set(known))
    rows = [[role] + [_cell(q.get(k)) for k in keys] for role, q in quality.items()]
    return ["## Quantization quality (quantize stage)", ""] + _table(["model"] + keys, rows)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "–" if value is None else str(value)
