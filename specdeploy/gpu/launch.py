"""Launching a GPU deployment: print how (`print_lines`), or start tritonserver here, wait until it is ready and
serve (`serve_gpu`); `start` refuses without the server binary.

The parts, one module each: `launch_command` (the launch plan, after tensorrtllm_backend's launch_triton_server.py,
and its docker equivalent), `launch_k8s` (the Kubernetes manifests); their names stay importable from here.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from specdeploy.core.artifacts import Layout
from specdeploy.core.errors import ServerError
from specdeploy.gpu import image as packaging
from specdeploy.gpu.k8s import k8s_yaml
from specdeploy.gpu.launch_command import TRITONSERVER, _ports, docker_command, launch_plan
from specdeploy.recipe.config import Recipe


def print_lines(
    recipe: Recipe, layout: Layout, image: str | None = None, tritonserver: str = TRITONSERVER
) -> list[str]:
    plan = launch_plan(recipe, layout, tritonserver)
    lines = [
        f"# launch ({plan.mode}, {plan.gpus} GPU(s)):",
        plan.command_line,
        (
            f"# the same in a container: build the image ({packaging.image_context(layout)}/Dockerfile installs "
            f"specdeploy into {packaging.base_image(recipe, image)}), then run it:"
        ),
        shlex.join(packaging.build_command(recipe, layout)),
        shlex.join(docker_command(plan, recipe, layout)),
    ]
    if plan.mode == "llmapi":
        lines.append(
            "# the container copies the image's TensorRT-LLM llmapi model.py and helpers.py into the "
            "repository as it starts; the launch outside it needs them there: specdeploy repo RECIPE "
            "--trtllm-src <TensorRT-LLM checkout>"
        )
    return lines


def find_tritonserver(explicit: str | None = None) -> str | None:
    for candidate in (explicit, shutil.which("tritonserver"), TRITONSERVER):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def start(
    recipe: Recipe,
    layout: Layout,
    tritonserver: str | None = None,
    log_path: Path | None = None,
    timeout_s: float | None = None,
    die_with_parent: bool = True,
) -> subprocess.Popen:
    """Start the GPU deployment here (its own process group) and wait for /v2/health/ready; ServerError with the
    log tail otherwise. die_with_parent=False leaves it running after specdeploy exits (serve --detach)."""
    from specdeploy.triton import server

    exe = find_tritonserver(tritonserver)
    if exe is None:
        raise ServerError(
            "no tritonserver with the TensorRT-LLM backend on this machine",
            "run inside the image (see the docker commands from specdeploy serve --print-only), or pass"
            " --server-binary",
        )
    plan = launch_plan(recipe, layout, exe)
    _require_llmapi_files(plan, layout)
    if plan.command[0] == "mpirun" and shutil.which("mpirun") is None:
        raise ServerError(
            "mpirun is not on PATH but the orchestrator launch (TP/PP > 1) runs under it",
            "install OpenMPI or use the NGC image",
        )
    log_path = Path(log_path or Path(layout.server_state) / server.LOG_FILE)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + plan.command_line + "\n")
        log.flush()
        proc = subprocess.Popen(
            plan.command,
            env={**os.environ, **plan.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=server._die_with_parent if die_with_parent else None,
        )
    url = f"http://127.0.0.1:{_ports(recipe)['http']}/v2/health/ready"
    deadline = time.monotonic() + (timeout_s or recipe.triton.startup_timeout_s)
    try:  # Ctrl-C or SIGTERM while it starts: stop it (it is not recorded yet, so `stop` could not reach it)
        with server.terminate_as_interrupt():
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    break
                try:
                    with urllib.request.urlopen(url, timeout=2) as resp:
                        if resp.status == 200:
                            return proc
                except (urllib.error.URLError, OSError):
                    pass
                time.sleep(0.5)
    except BaseException:
        server.stop_pid(proc.pid, process=proc)
        raise
    if proc.poll() is None:
        server.stop_pid(proc.pid, process=proc)
    tail = log_path.read_text(errors="replace").splitlines()[-30:] if log_path.is_file() else []
    raise ServerError("tritonserver did not become ready; last log lines:\n" + "\n".join(tail), f"full log: {log_path}")


def _require_llmapi_files(plan, layout: Layout) -> None:
    """TensorRT-LLM's llmapi models load only with its model.py and helpers.py, which a start outside the image's
    container (launch_command.container_command copies them there) must find in the repository."""
    from specdeploy.gpu import llmapi_repository as llmapi
    from specdeploy.gpu import llmapi_upstream

    missing = llmapi_upstream.repository_missing(Path(layout.repo), llmapi.MODELS) if plan.mode == "llmapi" else []
    if missing:
        raise ServerError(
            f"the repository {layout.repo} lacks TensorRT-LLM's llmapi model files: {', '.join(missing)}",
            "copy them from a TensorRT-LLM checkout of this machine's release: specdeploy repo RECIPE "
            "--trtllm-src <checkout>; or start in the image (specdeploy serve --print-only prints the "
            "docker run that copies the image's own)",
        )


def server_state(recipe: Recipe, layout: Layout, proc: subprocess.Popen, log_path: Path):
    """What `specdeploy status` / `stop` read for this GPU server (the CPU server's state file format)."""
    from specdeploy.core.artifacts import process_identity
    from specdeploy.triton.server_state import ServerState

    ports = _ports(recipe)
    me = process_identity(proc.pid)
    return ServerState(
        proc.pid,
        ports["grpc"],
        ports["http"],
        ports["metrics"],
        str(log_path),
        str(Path(layout.repo).resolve()),
        time.time(),
        me.start_ticks if me else None,
        list(me.cmdline) if me else None,
    )


def serve_gpu(
    recipe: Recipe,
    layout: Layout,
    *,
    print_k8s: bool = False,
    print_only: bool = False,
    image: str | None = None,
    tritonserver: str | None = None,
    k8s_out: Path | None = None,
    detach: bool = False,
    recipe_path: str = "RECIPE",
    echo=print,
):
    """`specdeploy serve` for a GPU backend.

    print_k8s: the Kubernetes manifests. print_only: write the image's build context (packaging.write_context,
    `image` is its base) and print the launch, `docker build` and `docker run`; start nothing. Otherwise run the
    pre-flight checks, start the server here and record it in layout.server_state so `status` and `stop` work;
    detach leaves it running and returns its state, else serve until Ctrl-C / SIGTERM and stop it.
    """
    from specdeploy.triton import server
    from specdeploy.triton import server_state as triton_server_state

    if print_k8s:
        text = k8s_yaml(recipe, layout, image=image)
        if k8s_out:
            Path(k8s_out).write_text(text)
            echo(f"wrote {k8s_out}")
        else:
            echo(text.rstrip())
        return None
    if print_only:
        context = packaging.write_context(recipe, layout, image)
        echo(f"# wrote {context / 'Dockerfile'} (specdeploy installed into the image, for docker and Kubernetes)")
    for line in print_lines(recipe, layout, image, tritonserver or TRITONSERVER):
        echo(line)
    if print_only:
        return None
    server.refuse_running(layout.server_state, recipe_path)
    from specdeploy.deploy import preflight

    preflight.enforce(preflight.run_all(recipe, layout), echo)
    log_path = Path(layout.server_state) / server.LOG_FILE
    proc = start(recipe, layout, tritonserver, log_path, die_with_parent=not detach)
    state = server_state(recipe, layout, proc, log_path)
    state.write(Path(layout.server_state))
    echo(
        f"tritonserver is ready (pid {proc.pid}); http {state.http_port}, grpc {state.grpc_port}, metrics"
        f" {state.metrics_port}"
    )
    echo(f"  log: {log_path}")
    if detach:
        echo(f"detached; stop it with: specdeploy stop {recipe_path}")
        return state

    try:
        return server.serve_in_foreground(proc, log_path, lambda: server.stop_pid(proc.pid, process=proc), echo, state)
    finally:
        (Path(layout.server_state) / triton_server_state.STATE_FILE).unlink(missing_ok=True)
