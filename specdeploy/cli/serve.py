"""`specdeploy serve`, `stop`, `status`: the recipe's server (and its OpenAI front)."""

from __future__ import annotations

import functools

import click

from specdeploy.cli.common import RECIPE, SERVER_BINARY, handle_errors, pass_ctx


@click.command("serve")
@RECIPE
@click.option("--detach", is_flag=True, help="Leave the server running in the background (see `stop`, `status`).")
@SERVER_BINARY
@click.option(
    "--print-only", is_flag=True, help="GPU backends: print the launch and its docker equivalent; start nothing."
)
@click.option("--print-k8s", is_flag=True, help="GPU backends: print Kubernetes manifests (Deployment, Service, HPA).")
@click.option(
    "--image",
    default=None,
    help=(
        "GPU backends: the NGC base image the generated Dockerfile installs specdeploy into (--print-only), or the"
        " image the pods run (--print-k8s)."
    ),
)
@click.option(
    "--openai-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Also serve an OpenAI-compatible API (/v1/...) on 127.0.0.1:PORT over the deployment.",
)
@click.option(
    "--openai-host",
    default="127.0.0.1",
    show_default=True,
    help="--openai-port: the address the front binds; beyond loopback it needs --api-key.",
)
@click.option(
    "--api-key",
    envvar="SPECDEPLOY_API_KEY",
    default=None,
    show_envvar=True,
    help="--openai-port: every route but /health wants 'Authorization: Bearer KEY'.",
)
@pass_ctx
@handle_errors
def serve(ctx, recipe, detach, server_binary, print_only, print_k8s, image, openai_port, openai_host, api_key):
    """Serve the recipe's model repository on tritonserver (loopback; ports from the recipe or free ones)."""
    from specdeploy.deploy import backend_stages

    r = ctx.recipe(recipe)
    layout = ctx.layout(r)
    if openai_port is not None:
        _serve_openai(ctx, r, layout, recipe, detach, server_binary, openai_port, openai_host, api_key or None)
        return
    serve_here = functools.partial(
        backend_stages.of(r).serve,
        r,
        layout,
        detach=detach,
        server_binary=server_binary,
        recipe_path=recipe,
        echo=click.echo,
        print_only=print_only,
        print_k8s=print_k8s,
        image=image,
    )
    if print_only or print_k8s:  # prints (and writes the image context); starts nothing, takes no lock
        serve_here()
        return
    if detach:
        with ctx.locked(r, recipe):  # a detached start holds the lock until the server is ready
            serve_here()
        return
    with ctx.locked(r, recipe):  # a foreground serve only waits for writers (it must not hold the lock)
        pass
    serve_here()


def _serve_openai(ctx, r, layout, recipe, detach, server_binary, port, host, api_key):
    """`serve --openai-port`: tritonserver (detached, recorded for `stop`) plus the OpenAI front, in the
    background with --detach, else in the foreground until Ctrl-C, which then stops both."""
    from specdeploy.core import backends
    from specdeploy.core.errors import ConfigError
    from specdeploy.deploy import backend_stages
    from specdeploy.ops.openai import api as openai_api
    from specdeploy.triton import server

    if backends.of(r).gpu:
        raise ConfigError(
            "--openai-port starts the front beside a local CPU deployment",
            f"for a GPU deployment run: python -m specdeploy.ops.openai.api {recipe} --grpc-url HOST:PORT --port N",
        )
    if r.layout == "llmapi":
        raise ConfigError(
            "--openai-port fronts the inflight_batcher_llm layout (ensemble and tensorrt_llm_bls); this recipe "
            "serves the llmapi layout",
            "serve without --openai-port, or set triton.layout: inflight_batcher_llm",
        )
    openai_api.check_bind(host, api_key)  # before starting anything
    server.refuse_running(layout.server_state, recipe)  # served already: say so, not that its front holds the port
    openai_api.check_port(host, port)

    def echo(line):  # in the foreground the server is recorded as detached (status, stop), but Ctrl-C here ends it
        click.echo(
            line
            if detach or not line.startswith(server.DETACHED_LINE)
            else f"recorded for `specdeploy status {recipe}`; Ctrl-C here stops it and the front"
        )

    with ctx.locked(r, recipe):
        state = backend_stages.of(r).serve(
            r, layout, detach=True, server_binary=server_binary, recipe_path=recipe, echo=echo
        )
    try:
        if detach:
            openai_api.start_detached(
                recipe, ctx.root, state.grpc_url, port, layout.server_state, echo=click.echo, host=host, api_key=api_key
            )
            return
        front = openai_api.build_front(r, layout, state.grpc_url, api_key=api_key)
        openai_api.serve_foreground(front, port, echo=click.echo, host=host)
    except BaseException:
        click.echo(server.stop(layout.server_state))
        raise
    click.echo(server.stop(layout.server_state))


@click.command("stop")
@RECIPE
@pass_ctx
@handle_errors
def stop(ctx, recipe):
    """Stop the server that `serve --detach` started for RECIPE (and its OpenAI front, if any)."""
    from specdeploy.deploy import backend_stages
    from specdeploy.ops.openai import api as openai_api

    r = ctx.recipe(recipe)
    front = openai_api.stop_detached(ctx.layout(r).server_state)
    if front:
        click.echo(front)
    click.echo(backend_stages.of(r).stop(ctx.layout(r)))


@click.command("status")
@RECIPE
@pass_ctx
@handle_errors
def status(ctx, recipe):
    """Say whether the detached server of RECIPE (and its OpenAI front, if started with one) is running and ready, and
    where. Exit code 0: running and ready, 1: running but not ready, a python stub died or the front exited, 3: not
    running (as LSB init scripts answer `status`)."""
    from specdeploy.ops.openai import api as openai_api
    from specdeploy.triton import server

    r = ctx.recipe(recipe)
    state, line = server.status(ctx.layout(r).server_state)
    click.echo(line)
    code = server.status_code(state, line)
    front = openai_api.detached_status(ctx.layout(r).server_state) if state is not None else None
    if front is not None:
        click.echo(front[1])
        if not front[0] and code == 0:  # the server is fine, the front it was started with is gone
            code = 1
    raise SystemExit(code)
