"""`specdeploy check`, `doctor` and `models`: the recipe's plan, this machine, the bundled models."""

from __future__ import annotations

import click

from specdeploy.cli.common import RECIPE, handle_errors, pass_ctx
from specdeploy.core.model_store import BUNDLED


@click.command("check")
@RECIPE
@pass_ctx
@handle_errors
def check(ctx, recipe):
    """Validate RECIPE and print the resolved plan: every stage, its inputs, outputs and state."""
    from specdeploy.deploy import plan

    r = ctx.recipe(recipe)
    click.echo(plan.describe(r, ctx.layout(r), recipe))


@click.command("doctor")
@click.option("--clean-shm", is_flag=True, help="Remove Triton python-backend shared-memory regions no process uses.")
@handle_errors
def doctor(clean_shm):
    """One line per check of this machine: Python, torch, GPU, TensorRT-LLM, ModelOpt, tritonserver, shared
    memory, ports, cache."""
    from specdeploy.ops import doctor as doc

    if clean_shm:
        click.echo(doc.clean_shm())
    for line in doc.report_lines():
        click.echo(line)


@click.group("models")
def models():
    """Bundled pretrained models."""


@models.command("list")
@handle_errors
def models_list():
    """List the bundled models and whether they are fetched."""
    from specdeploy.core import model_store as mdl

    for line in mdl.list_lines():
        click.echo(line)


@models.command("fetch")
@click.argument("name", type=click.Choice(sorted(BUNDLED)))
@handle_errors
def models_fetch(name):
    """Download and convert a bundled model into the cache (instant when done before)."""
    from specdeploy.core import model_store as mdl

    path = mdl.fetch(name)
    click.echo(f"{name}: {path}")
