"""What every command of the `specdeploy` command line shares: the RECIPE argument, the context (recipe, layout,
lock) and the one place that turns SpecDeployError into exit codes."""

from __future__ import annotations

import functools
import sys
import traceback

import click

from specdeploy.core.errors import SpecDeployError
from specdeploy.recipe import config as cfg
from specdeploy.recipe.load import load_recipe

RECIPE = click.argument("recipe", type=click.Path(dir_okay=False))
# the commands that start tritonserver here: serve, run
SERVER_BINARY = click.option(
    "--server-binary",
    type=click.Path(dir_okay=False),
    default=None,
    help="A tritonserver binary (default: $SPECDEPLOY_TRITONSERVER, else the one in the nvidia-pytriton wheel).",
)


class Context:
    def __init__(self, verbose: bool, root: str | None, lock_timeout_s: float | None = None):
        self.verbose = verbose
        self.root = root
        self.lock_timeout_s = lock_timeout_s

    def recipe(self, path: str) -> cfg.Recipe:
        return load_recipe(path)

    def layout(self, recipe: cfg.Recipe):
        from specdeploy.core.artifacts import Layout

        return Layout.of(recipe, self.root)

    def locked(self, recipe: cfg.Recipe, recipe_path: str):
        """The recipe's lock (specdeploy.core.lock), taken by every command that writes its outputs, so that
        two runs on one recipe take turns."""
        from specdeploy.core import lock

        command = f"{click.get_current_context().command_path} {recipe_path}"
        timeout = lock.LOCK_TIMEOUT_S if self.lock_timeout_s is None else self.lock_timeout_s
        return lock.recipe_lock(
            self.layout(recipe).engines, recipe.name, command, timeout, echo=lambda m: click.echo(m, err=True)
        )


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


pass_ctx = click.make_pass_decorator(Context)
