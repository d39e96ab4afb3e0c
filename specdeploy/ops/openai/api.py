"""An OpenAI-compatible HTTP front (FastAPI + uvicorn) over a Triton deployment of the inflight_batcher_llm layout.

Endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (the model's chat
template, from the repository's tokenizer), `GET /health`. It speaks to Triton through
`specdeploy.client.triton_adapter.TritonEndpoint` (gRPC, every call with a deadline).

The `model` field picks the path (`/v1/models` lists them):
- `<recipe>` and `<recipe>-speculative` -> `tensorrt_llm_bls`, always speculative (sends
  `num_draft_tokens`, which also keeps a canary from sending it down the plain path);
- `<recipe>-control` -> `ensemble` (target only, the unaccelerated control);
- `<recipe>-canary` -> `tensorrt_llm_bls` without `num_draft_tokens`: the BLS sends
  `canary.control_percent` % of these down the plain path (listed only when that share is > 0).

Semantics:
- `temperature` 0 decodes greedily (the same tokens as the Triton path for the same prompt);
  `temperature` > 0 (OpenAI's default is 1) samples with `top_p` (default 1.0) and `seed`.
- `max_tokens` (chat also `max_completion_tokens`) defaults to the recipe's `validation.max_tokens`.
- `stop` strings are applied here: the text is cut before the first one and `finish_reason` is
  `stop` (the server may generate a few tokens past it). `n` > 1, `logprobs`, `echo`, `best_of`,
  `suffix` and `tools` are refused with a 400 in OpenAI's error format.
- `usage.prompt_tokens` tokenizes the prompt (template applied) with the server's tokenizer and
  settings (`add_special_tokens`): the count preprocessing makes. `usage.completion_tokens` is the
  server's count of the output tokens (the end token not counted, as TensorRT-LLM counts): the
  `output_ids` where the model returns them, else specdeploy's `sequence_length` output of `ensemble`
  and `tensorrt_llm_bls` (NVIDIA's text-level interface returns only text). Only where neither comes
  back (another deployment; a text cut at a stop string) does it re-tokenize the output text, which can
  count fewer tokens where the model wrote apart what the tokenizer would merge
  (`specdeploy.completion_tokens_exact` says which). `finish_reason` is `length` where that count
  reached `max_tokens`, or the prompt and the answer the engine's `max_seq_len`.
- Streaming (`stream: true`, server-sent events, `stream_options.include_usage`): on a decoupled
  deployment (`triton.decoupled: true`) each Triton response becomes a chunk as it arrives; on a
  unary deployment the whole answer comes as one content chunk (then the final chunk), so SSE
  clients work unchanged but see no incremental tokens.
- Extension field `specdeploy` on every completion (and on the final stream chunk):
  `{"path", "triton_model", "draft_tokens", "accepted_draft_tokens", "acceptance_rate",
  "server_ttft_s", "completion_tokens_exact"}` from the BLS perf outputs (null on the control path).
- Errors: `{"error": {"message", "type", "param", "code"}}` with 400 (bad request), 401 (API key
  missing or wrong), 404 (unknown model), 413 (body too large), 503 (Triton unreachable), 504
  (deadline), 500 (server fault).

Security: it binds 127.0.0.1 unless a host is named (a non-loopback host needs an API key). With an
API key (`--api-key` / `SPECDEPLOY_API_KEY`) every route but `/health` wants `Authorization: Bearer
<key>`, as OpenAI's API does. Request bodies are capped (`--max-body-bytes`, 413) and `max_tokens`
by the deployment (`engine.max_seq_len - 1`, or a lower `--max-tokens-limit`; 400 naming it).
FastAPI's /docs and /openapi.json are off.

This module runs the front (in a thread, in the foreground, or detached in its own process); the app is in
`openai_app` and what a request means in `openai_requests` (their public names are importable from here too).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import threading
import time
from pathlib import Path

from specdeploy.core.errors import ConfigError
from specdeploy.ops.openai.app import API_KEY_ENV, MAX_BODY_BYTES, Front, create_app
from specdeploy.ops.openai.requests import Codec, routes

HOST = "127.0.0.1"


# ---------------------------------------------------------------- running it


def deployment_max_tokens(recipe, option: int | None = None) -> int:
    """The most tokens one request may ask for: the engine's max_seq_len less one prompt token, or a lower option."""
    limit = recipe.engine.max_seq_len - 1
    if option is not None:
        if not 1 <= option <= limit:
            raise ConfigError(
                f"--max-tokens-limit is {option}, must be in [1, {limit}]",
                f"engine.max_seq_len is {recipe.engine.max_seq_len}",
            )
        limit = option
    return limit


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to listen beyond loopback without an API key: anyone who reaches the port could use the deployment."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not api_key:
        raise ConfigError(
            f"the OpenAI front would listen on {host} (beyond this machine) without an API key",
            f"pass --api-key KEY (or set ${API_KEY_ENV}), or keep the default host {HOST}",
        )


def check_port(host: str, port: int) -> None:
    """Refuse a port another process listens on, before anything starts: otherwise whatever answers there could pass
    for the front's readiness check while the front itself fails to bind (SO_REUSEADDR, as uvicorn binds, so a port
    in TIME_WAIT is free)."""
    import socket

    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise ConfigError(
                f"the OpenAI front cannot listen on {host}:{port}: {exc.strerror or exc} (another process holds it?)",
                "pick another --openai-port, or stop what listens there",
            ) from None


def build_front(
    recipe,
    layout,
    grpc_url: str,
    timeout_s: float | None = None,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_tokens_limit: int | None = None,
) -> Front:
    """A Front over the deployment at grpc_url with the recipe's routes and its repository's tokenizer."""
    from specdeploy.client.protocol import REQUIRED_MODELS
    from specdeploy.client.triton_adapter import TritonEndpoint
    from specdeploy.deploy.recipe_deployment import tokenizer_dir

    endpoint = TritonEndpoint(grpc_url)
    endpoint.check_ready(REQUIRED_MODELS)
    codec = Codec(tokenizer_dir(recipe, layout))
    return Front(
        endpoint,
        codec,
        routes(recipe),
        recipe.validation.max_tokens,
        recipe.speculative.num_draft_tokens,
        timeout_s or recipe.validation.request_timeout_s,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        max_tokens_limit=deployment_max_tokens(recipe, max_tokens_limit),
        max_seq_len=recipe.engine.max_seq_len,
    )


def _dial_host(host: str) -> str:
    return HOST if host in ("0.0.0.0", "::", "") else host  # a wildcard bind is reached on loopback


class ApiServer:
    """uvicorn on host:port (127.0.0.1 by default) in a background thread; `stop()` shuts it down."""

    def __init__(self, app, port: int, host: str = HOST):
        import uvicorn

        self.port, self.host = port, host
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, name="openai-api", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{_dial_host(self.host)}:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> "ApiServer":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError(
                    f"the OpenAI front could not listen on {self.host}:{self.port}",
                    "pick another --openai-port (is it taken?)",
                )
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


STATE_FILE = "openai.json"  # beside the server state of `serve --detach`
LOG_FILE = "openai.log"


def wait_listening(port: int, timeout_s: float, alive=lambda: True, host: str = HOST) -> bool:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        try:
            with urllib.request.urlopen(f"http://{_dial_host(host)}:{port}/health", timeout=1.0) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    return False


def start_detached(
    recipe_path: str,
    root: str | None,
    grpc_url: str,
    port: int,
    state_dir: Path,
    timeout_s: float = 120.0,
    echo=print,
    host: str = HOST,
    api_key: str | None = None,
    request_timeout_s: float | None = None,
) -> int:
    """Start the front in its own process (`python -m specdeploy.ops.openai.api`) and record it for `stop`.

    The API key goes to the child in its environment, never on its command line (which `ps` shows and
    the state file records)."""
    import subprocess
    import sys

    from specdeploy.core.artifacts import process_identity
    from specdeploy.core.errors import ServerError

    check_bind(host, api_key)
    check_port(host, port)
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    log = state_dir / LOG_FILE
    cmd = [
        sys.executable,
        "-m",
        "specdeploy.ops.openai.api",
        str(recipe_path),
        "--grpc-url",
        grpc_url,
        "--port",
        str(port),
        "--host",
        host,
    ]
    if root:
        cmd += ["--root", str(root)]
    if request_timeout_s:
        cmd += ["--request-timeout", str(request_timeout_s)]
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    if api_key:
        env[API_KEY_ENV] = api_key
    with open(log, "w") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
        )
    if (
        not wait_listening(port, timeout_s, alive=lambda: process.poll() is None, host=host)
        or process.poll() is not None
    ):
        process.kill()
        process.wait(timeout=5)
        tail = log.read_text()[-1500:] if log.is_file() else ""
        raise ServerError(f"the OpenAI front did not start on {host}:{port}:\n{tail}", f"full log: {log}")
    ident = process_identity(process.pid)
    (state_dir / STATE_FILE).write_text(
        json.dumps(
            {
                "pid": process.pid,
                "port": port,
                "host": host,
                "log": str(log),
                "start_ticks": ident.start_ticks if ident else None,
                "cmdline": list(ident.cmdline) if ident else cmd,
            }
        )
    )
    echo(f"  openai:  http://{_dial_host(host)}:{port}/v1 (pid {process.pid}, log {log})")
    return process.pid


def _recorded(state_dir: Path):
    """(record, its ProcessIdentity, whether that process still runs) of the front `start_detached` recorded in
    state_dir; None when there is none."""
    from specdeploy.core.artifacts import ProcessIdentity
    from specdeploy.triton.server_state import is_same_process

    path = Path(state_dir) / STATE_FILE
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    identity = ProcessIdentity(state["pid"], state.get("start_ticks"), tuple(state.get("cmdline") or ()))
    return state, identity, is_same_process(state["pid"], identity)


def detached_status(state_dir: Path) -> tuple[bool, str] | None:
    """(alive, a line for `status`) of the front `start_detached` recorded in state_dir; None when there is none."""
    recorded = _recorded(state_dir)
    if recorded is None:
        return None
    state, _, alive = recorded
    if not alive:
        return (
            False,
            (
                f"the OpenAI front (pid {state['pid']}) has exited: see its log"
                f" {state.get('log') or Path(state_dir) / LOG_FILE}; stop and serve again to restart it"
            ),
        )
    host = state.get("host") or HOST
    return True, f"openai front: http://{_dial_host(host)}:{state['port']}/v1 (pid {state['pid']}, bound to {host})"


def stop_detached(state_dir: Path) -> str | None:
    """Stop the front `start_detached` recorded in state_dir; None when there was none."""
    from specdeploy.triton.server import stop_pid

    recorded = _recorded(state_dir)
    if recorded is None:
        return None
    state, identity, alive = recorded
    path = Path(state_dir) / STATE_FILE
    if not alive:  # it died (or its port was taken from it): nothing to stop
        path.unlink(missing_ok=True)
        return f"the OpenAI front (pid {state['pid']}) had already exited (its log: {Path(state_dir) / LOG_FILE})"
    stop_pid(state["pid"], timeout_s=10, expected=identity)
    path.unlink(missing_ok=True)
    return f"stopped the OpenAI front (pid {state['pid']})"


def serve_foreground(
    front: Front, port: int, echo=print, stop: threading.Event | None = None, host: str = HOST
) -> None:
    """Serve the front on host:port (127.0.0.1 by default) until Ctrl-C (or `stop` is set); says where once it
    listens."""
    check_bind(host, front.api_key)
    server = ApiServer(create_app(front), port, host).start()  # listening before it says so (a taken port fails here)
    echo(f"  openai:  {server.url} (Ctrl-C stops it and the server)")
    try:
        while server.thread.is_alive() and not (stop is not None and stop.is_set()):
            server.thread.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    """`python -m specdeploy.ops.openai.api RECIPE --grpc-url H:P --port N [--host H] [--root DIR]` (what `serve
    --detach --openai-port` runs); the API key comes from $SPECDEPLOY_API_KEY (or --api-key)."""
    from specdeploy.core.artifacts import Layout
    from specdeploy.recipe.load import load_recipe

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("recipe")
    parser.add_argument("--grpc-url", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default=HOST)
    parser.add_argument("--root", default=None)
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None)
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    parser.add_argument("--max-tokens-limit", type=int, default=None)
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="deadline of each Triton call, s [recipe validation.request_timeout_s]",
    )
    args = parser.parse_args(argv)
    from specdeploy.core.errors import SpecDeployError

    try:
        check_bind(args.host, args.api_key)
        recipe = load_recipe(args.recipe)
        front = build_front(
            recipe,
            Layout.of(recipe, args.root),
            args.grpc_url,
            timeout_s=args.request_timeout,
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
            max_tokens_limit=args.max_tokens_limit,
        )
    except SpecDeployError as exc:  # the message and its fix, as the CLI prints them, not a traceback
        hint = re.sub(
            r"(?<![\w-])--url\b", "--grpc-url", exc.hint
        )  # the client's hint names validate's option; this is ours
        raise SystemExit(f"error: {exc.message}" + (f"\nhint: {hint}" if hint else "")) from None
    import uvicorn

    uvicorn.run(create_app(front), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
