"""`specdeploy build`: the recipe's backend builds (`Backend.build` in specdeploy/backends.py)."""

from __future__ import annotations


def build(recipe, layout, force: bool = False, echo=print, dry_run: bool = False):
    """Build the engines of `recipe` with its backend; dry_run prints the external commands (GPU backends)."""
    from specdeploy import backends

    return backends.of(recipe).build(recipe, layout, force=force, echo=echo, dry_run=dry_run)
