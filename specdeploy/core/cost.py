"""Cost per response and per 1,000 output tokens, from the machine's price per hour and measured rates.

A machine that costs P per hour and finishes R requests/s while it serves T output tokens/s costs
P / 3600 / R per response and 1000 * P / 3600 / T per 1,000 output tokens: the rate is what the
deployment sustained at that concurrency, so idle capacity is charged to the responses it did serve.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cost:
    per_response: float | None  # in the recipe's currency; None when the rate is unknown or zero
    per_1k_output_tokens: float | None
    currency: str

    def to_dict(self) -> dict:
        return {
            "per_response": self.per_response,
            "per_1k_output_tokens": self.per_1k_output_tokens,
            "currency": self.currency,
        }


def cost_of(
    price_per_hour: float, requests_per_s: float | None, output_tokens_per_s: float | None, currency: str = "USD"
) -> Cost:
    """Cost per response and per 1,000 output tokens for a machine at `price_per_hour`."""
    if price_per_hour < 0:
        raise ValueError(f"price_per_hour is {price_per_hour}, must be >= 0")
    per_second = price_per_hour / 3600.0
    per_response = per_second / requests_per_s if requests_per_s else None
    per_1k = 1000.0 * per_second / output_tokens_per_s if output_tokens_per_s else None
    return Cost(per_response, per_1k, currency)


def level_cost(level: dict, price_per_hour: float, currency: str = "USD") -> Cost:
    """Cost of one latency level summary (`client.latency.level_stats`: requests_per_s, output_tokens_per_s)."""
    return cost_of(price_per_hour, level.get("requests_per_s"), level.get("output_tokens_per_s"), currency)


def format_money(value: float | None, currency: str) -> str:
    if value is None:
        return "–"
    digits = 2 if value >= 1 else 6 if value < 0.001 else 4
    return f"{value:.{digits}f} {currency}"


def cost_section(
    levels: list[dict],
    price_per_hour: float,
    currency: str = "USD",
    source: str = "recipe `cost.machine_price_per_hour`",
) -> dict | None:
    """Cost per response and per 1k output tokens for every (path, concurrency) of a latency summary
    (`client.latency.summarize_levels`), for the report; None when no price is set."""
    if price_per_hour <= 0:
        return None
    rows = []
    for level in levels:
        c = level_cost(level, price_per_hour, currency)
        rows.append({"mode": level.get("mode"), "concurrency": level.get("concurrency"), **c.to_dict()})
    return {"machine_price_per_hour": price_per_hour, "currency": currency, "price_source": source, "levels": rows}


def cost_markdown(section: dict | None) -> list[str]:
    if not section:
        return []
    cur = section["currency"]
    lines = [
        "## Cost",
        "",
        (
            f"At {section['machine_price_per_hour']:g} {cur} per machine-hour"
            f" ({section.get('price_source') or 'recipe `cost.machine_price_per_hour`'}), at the rate each level"
            " sustained: per response = price / 3600 / requests per second; per 1,000 output tokens = 1000 x price /"
            " 3600 / output tokens per second."
        ),
        "",
        "| conc. | path | per response | per 1k output tokens |",
        "|---|---|---|---|",
    ]
    for r in section["levels"]:
        lines.append(
            f"| {r['concurrency']} | {r['mode']} | {format_money(r['per_response'], cur)} |"
            f" {format_money(r['per_1k_output_tokens'], cur)} |"
        )
    return lines + [""]
