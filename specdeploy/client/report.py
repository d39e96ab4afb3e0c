"""The validation report: report.json (every raw sample), report.md (tables a person reads), PNG plots.

Files are written one by one through a temporary name, so a report directory the user points at
(`--report-dir`) keeps its other files, and a crash never leaves a half-written report.json.
The tables are rendered in `report_markdown`, the plots drawn in `report_plots`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from specdeploy.client.report_markdown import render_markdown
from specdeploy.client.report_plots import plot_categories, plot_draft_length, plot_latency, plot_sweep


def write_report(report: dict, report_dir: str | Path) -> dict[str, Path]:
    """Write report.json, report.md and the plots that the report has data for; returns name -> path."""
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for name, plot in (
        ("latency", plot_latency),
        ("categories", plot_categories),
        ("sweep", plot_sweep),
        ("draft_length", plot_draft_length),
    ):
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
