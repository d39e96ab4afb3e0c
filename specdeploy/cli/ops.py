"""`specdeploy monitor` and `canary`: a running deployment read through its metrics endpoint."""

from __future__ import annotations

import sys

import click

from specdeploy.cli.common import RECIPE, handle_errors, pass_ctx

METRICS_URL = click.option(
    "--url",
    default=None,
    help="Triton's metrics endpoint, HOST:PORT or a /metrics URL [the server `serve --detach` started].",
)


def _metrics_url(ctx, r, url: str | None, recipe_path: str) -> str:
    if url:
        return url
    from specdeploy.core.errors import ServerError
    from specdeploy.triton.server_state import ServerState

    state = ServerState.read(ctx.layout(r).server_state)
    if state is None:
        raise ServerError(
            f"no detached server is recorded for {r.name}",
            f"start one (specdeploy serve {recipe_path} --detach) or pass --url HOST:METRICS_PORT",
        )
    return state.metrics_url


@click.command("monitor")
@RECIPE
@METRICS_URL
@click.option(
    "--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True, help="Seconds between frames."
)
@click.option("--once", is_flag=True, help="Print one frame (after one interval) and exit.")
@pass_ctx
@handle_errors
def monitor(ctx, recipe, url, interval, once):
    """Live view of the deployment: acceptance, tokens per round, TPOT p50/p99, speculation on/off, in flight, cost."""
    from specdeploy.ops import monitor as mon

    r = ctx.recipe(recipe)
    mon.run(_metrics_url(ctx, r, url, recipe), r.cost, interval_s=interval, once=once, echo=click.echo, title=r.name)


@click.command("canary")
@RECIPE
@METRICS_URL
@click.option(
    "--window",
    type=click.FloatRange(min=0.1),
    default=None,
    help="Seconds of live traffic to compare [recipe canary.window_s].",
)
@click.option(
    "--min-requests",
    type=click.IntRange(min=1),
    default=None,
    help="Requests each arm needs in the window [recipe canary.min_requests].",
)
@click.option(
    "--drive",
    type=click.Choice(["triton", "openai"]),
    default=None,
    help=(
        "Also send the recipe's validation prompts down the canary path during the window, over Triton gRPC or the"
        " OpenAI front."
    ),
)
@click.option("--grpc-url", default=None, help="--drive triton: the deployment's gRPC HOST:PORT [the detached server].")
@click.option("--openai-url", default=None, help="--drive openai: the OpenAI front, http://127.0.0.1:PORT.")
@click.option(
    "--concurrency", type=click.IntRange(min=1), default=1, show_default=True, help="--drive: requests in flight."
)
@click.option(
    "--until-enough",
    is_flag=True,
    help="End the window as soon as each arm has --min-requests (--window is then the most).",
)
@pass_ctx
@handle_errors
def canary(ctx, recipe, url, window, min_requests, drive, grpc_url, openai_url, concurrency, until_enough):
    """Compare the speculative and control arms on live traffic; promote (exit 0), roll back (3) or inconclusive (1).

    The control arm exists when the recipe sets canary.control_percent > 0 (the BLS then sends that share down
    the plain path).
    """
    import dataclasses

    from specdeploy.ops import canary as can

    r = ctx.recipe(recipe)
    config = r.canary if min_requests is None else dataclasses.replace(r.canary, min_requests=min_requests)
    if r.canary.control_percent <= 0:
        click.echo(f"warning: canary.control_percent is 0 in {recipe}: the deployment has no control arm", err=True)
    traffic = can.traffic_for(r, ctx.layout(r), drive, grpc_url, openai_url, concurrency).start() if drive else None
    try:
        verdict = can.watch(
            _metrics_url(ctx, r, url, recipe),
            config,
            window or config.window_s,
            echo=lambda s: click.echo(s, err=True),
            tick_s=2.0 if until_enough else 5.0,
            until_enough=until_enough,
        )
    finally:
        if traffic is not None:
            sent, failed, error = traffic.stop()
            click.echo(f"drove {sent} requests over {drive} ({failed} failed{': ' + error if error else ''})", err=True)
    for line in can.lines(verdict):
        click.echo(line)
    click.secho(verdict.line, fg={"promote": "green", "rollback": "red"}.get(verdict.decision, "yellow"), bold=True)
    sys.exit(verdict.exit_code)
