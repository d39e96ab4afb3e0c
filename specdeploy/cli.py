"""The `specdeploy` command line. The only place that turns SpecDeployError into exit codes."""

from __future__ import annotations

import functools
import sys
import traceback

import click

from specdeploy import config as cfg
from specdeploy.errors import SpecDeployError

RECIPE = click.argument("recipe", type=click.Path(dir_okay=False))


class Context:
    def __init__(self, verbose: bool, root: str | None):
        self.verbose = verbose
        self.root = root

    def recipe(self, path: str) -> cfg.Recipe:
        return cfg.load_recipe(path)

    def layout(self, recipe: cfg.Recipe):
        from specdeploy.artifacts import Layout

        return Layout.of(recipe, self.root)


def handle_errors(fn):
    """Print a SpecDeployError as one line plus its hint and exit with its code; --verbose adds the traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpecDeployError as exc:
            ctx = click.get_current_context().find_object(Context)
            if ctx is not None and ctx.verbose:
                traceback.print_exc()
            click.secho(f"error: {exc.message}", fg="red", err=True)
            if exc.hint:
                click.echo(f"hint: {exc.hint}", err=True)
            sys.exit(exc.exit_code)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--verbose", "-v", is_flag=True, help="Show tracebacks and debug output.")
@click.option(
    "--root",
    type=click.Path(file_okay=False),
    default=None,
    help="Project root holding engines/ and triton_repo/ (default: $SPECDEPLOY_ROOT or the current directory).",
)
@click.version_option(package_name="specdeploy")
@click.pass_context
def main(ctx, verbose, root):
    """Quantize, build, serve and validate speculative-decoding deployments on Triton."""
    ctx.obj = Context(verbose, root)


pass_ctx = click.make_pass_decorator(Context)


# ---------------------------------------------------------------- recipe and environment


@main.command()
@RECIPE
@pass_ctx
@handle_errors
def check(ctx, recipe):
    """Validate RECIPE and print the resolved plan: every stage, its inputs, outputs and state."""
    from specdeploy import plan

    r = ctx.recipe(recipe)
    click.echo(plan.describe(r, ctx.layout(r), recipe))


@main.command()
@handle_errors
def doctor():
    """One line per check of this machine: Python, torch, GPU, TensorRT-LLM, ModelOpt, tritonserver, ports, cache."""
    from specdeploy import doctor as doc

    for line in doc.report_lines():
        click.echo(line)


@main.group()
def models():
    """Bundled pretrained models."""


@models.command("list")
@handle_errors
def models_list():
    """List the bundled models and whether they are fetched."""
    from specdeploy import models as mdl

    for line in mdl.list_lines():
        click.echo(line)


@models.command("fetch")
@click.argument("name", type=click.Choice(sorted(__import__("specdeploy.models").models.BUNDLED)))
@handle_errors
def models_fetch(name):
    """Download and convert a bundled model into the cache (instant when done before)."""
    from specdeploy import models as mdl

    path = mdl.fetch(name)
    click.echo(f"{name}: {path}")


# ---------------------------------------------------------------- stages
# Each stage adds its command below, in pipeline order.
