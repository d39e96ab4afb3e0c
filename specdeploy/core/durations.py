"""How long something takes, written for a person (estimates, ETAs in progress lines)."""

from __future__ import annotations


def duration_text(seconds: float) -> str:
    """'45 s', '12 min', '1.5 h' or '3.2 days': the unit a reader takes in at a glance."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
