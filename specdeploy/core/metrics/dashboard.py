"""A Grafana dashboard (JSON model) over the metrics of metric_names, per arm."""

from __future__ import annotations

import re

from specdeploy.core.metrics.names import (
    ACCEPTED_PER_POS,
    ACCEPTED_TOKENS,
    DRAFT_SECONDS,
    DRAFT_TOKENS,
    DRAFT_TOKENS_PER_POS,
    E2E,
    GENERATION_TOKENS,
    REQUEST_ERRORS,
    REQUESTS,
    ROUNDS,
    RUNNING,
    TARGET_PASSES,
    TARGET_SECONDS,
    TPOT,
    TTFT,
    MetricDef,
)


def grafana_dashboard(title: str, price_per_hour: float = 0.0, currency: str = "USD", rate_window: str = "5m") -> dict:
    """A Grafana dashboard (JSON model, Prometheus data source variable) over the metrics above, per arm."""

    def rate(metric: MetricDef, by: str = "arm", suffix: str = "") -> str:
        return f'sum by ({by}) (rate({metric.name}{suffix}{{job=~"$job"}}[{rate_window}]))'

    def quantile(q: float, metric: MetricDef) -> str:
        return f"histogram_quantile({q}, {rate(metric, 'le, arm', '_bucket')})"

    panels = [
        ("Acceptance rate (accepted / drafted)", f"{rate(ACCEPTED_TOKENS)} / {rate(DRAFT_TOKENS)}", "percentunit"),
        ("Tokens per target pass", f"{rate(GENERATION_TOKENS)} / {rate(TARGET_PASSES)}", "short"),
        (
            "Acceptance by draft position",
            f"{rate(ACCEPTED_PER_POS, 'position')} / {rate(DRAFT_TOKENS_PER_POS, 'position')}",
            "percentunit",
        ),
        ("Output tokens/s", rate(GENERATION_TOKENS), "short"),
        ("TPOT p50", quantile(0.5, TPOT), "s"),
        ("TPOT p99", quantile(0.99, TPOT), "s"),
        ("End-to-end latency p50", quantile(0.5, E2E), "s"),
        ("End-to-end latency p99", quantile(0.99, E2E), "s"),
        ("Time to first token p50", quantile(0.5, TTFT), "s"),
        ("Requests running", f'sum by (arm) ({RUNNING.name}{{job=~"$job"}})', "short"),
        (
            "Requests/s (ok, failed)",
            f'{rate(REQUESTS)} or label_replace({rate(REQUEST_ERRORS)}, "arm", "$1 failed", "arm", "(.*)")',
            "reqps",
        ),
        ("Rounds with speculation on/off (by reason)", rate(ROUNDS, "speculation, reason"), "short"),
        ("Draft time / target time", f"{rate(DRAFT_SECONDS)} / {rate(TARGET_SECONDS)}", "percentunit"),
    ]
    if price_per_hour > 0:
        pods = f'count(count by (pod) ({RUNNING.name}{{job=~"$job"}}))'
        panels.append(
            (
                f"Cost per 1k output tokens ({currency}, {price_per_hour:g}/h per replica)",
                (
                    f"{price_per_hour} / 3600 * 1000 * {pods} /"
                    f' sum(rate({GENERATION_TOKENS.name}{{job=~"$job"}}[{rate_window}]))'
                ),
                "short",
            )
        )
    out = []
    for i, (panel_title, expr, unit) in enumerate(panels):
        out.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": panel_title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {
                        "refId": "A",
                        "expr": expr,
                        "legendFormat": "{{arm}}{{position}}{{speculation}} {{reason}}".strip(),
                    }
                ],
            }
        )
    return {
        "title": title,
        "uid": re.sub(r"[^a-zA-Z0-9-]", "-", title)[:40],
        "schemaVersion": 39,
        "tags": ["specdeploy", "speculative-decoding", "triton"],
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus"},
                {
                    "name": "job",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": f"label_values({REQUESTS.name}, job)",
                    "includeAll": True,
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                },
            ]
        },
        "panels": out,
    }
