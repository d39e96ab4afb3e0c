"""The tritonserver process: start, wait, stop; serve / status / stop for the CLI.

Where the binary comes from and how its python backend is set up is `triton.install` (`find_binary`, `prepare`,
`site_paths`): the python backend stub runs the system's Python of the same minor version in isolated mode, so
PYTHONPATH is ignored: the models read `SPECDEPLOY_SITE` (our site-packages and source root) and put it on sys.path
themselves.

A server started here runs in its own process group, logs to a file, binds to 127.0.0.1 on free
ports (or the recipe's), and is stopped with SIGTERM (then SIGKILL to the whole group).

The parts, one module each: `triton.ports` (free or the recipe's ports), `triton.server_state` (what `serve --detach`
records), `triton.stubs` (the python-backend stubs under a server, and what a dead one left); their names stay
importable from here.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from specdeploy.core.artifacts import ProcessIdentity, pid_alive, process_identity
from specdeploy.core.errors import ServerError
from specdeploy.triton import shm
from specdeploy.triton.install import find_binary, prepare, python_lib_dir, site_paths
from specdeploy.triton.ports import HOST, Ports
from specdeploy.triton.server_state import STATE_FILE, ServerState, is_same_process
from specdeploy.triton.stubs import DEAD_STUB, orphans_line, python_stubs, reap, stub_changes

LOG_FILE = "tritonserver.log"
STUB_SHM_BYTES = 64 * 2**20
# The python stubs of one server (preprocessing, BLS, tensorrt_llm, draft, postprocessing) share the machine's
# cores, each with its own OpenMP pool. libgomp's default waits for work by spinning, so a pool whose threads lost
# their core to another stub spins at every barrier (docs/stages.md "Why native kernels" has the figures). Passive
# waiting sleeps instead; a user's own OMP_WAIT_POLICY wins. The CPU engine runs each step's parallel loops on one team
# that spins only within the step (engine/csrc/step_team.h), so sleeping costs a wake-up per step, not per loop.
OMP_WAIT_POLICY = "PASSIVE"
EXIT_TIMEOUT_S = 10


class Server:
    """A started tritonserver process (own process group). Use as a context manager to always stop it."""

    def __init__(self, process: subprocess.Popen, state: ServerState, exit_timeout_s: int = EXIT_TIMEOUT_S):
        self.process = process
        self.state = state
        self.exit_timeout_s = exit_timeout_s

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        stop_pid(self.process.pid, self.exit_timeout_s + 10, self.process)


def start(
    repo: Path,
    ports: Ports,
    log_path: Path,
    binary: str | os.PathLike | None = None,
    extra_site: tuple[str, ...] = (),
    extra_args: tuple[str, ...] = (),
    exit_timeout_s: int = EXIT_TIMEOUT_S,
    die_with_parent: bool = True,
) -> Server:
    """Start tritonserver on `repo` (returns at once; call wait_ready). Logs go to `log_path`.

    die_with_parent: the kernel sends the server SIGTERM when this process dies, even by SIGKILL
    (Linux), so a crashed test run or CLI never leaves a server behind; `serve --detach` turns it off.
    """
    install = prepare(find_binary(binary))
    env = dict(os.environ)
    libs = [*map(str, install.lib_dirs), *python_lib_dir(), *filter(None, [env.get("LD_LIBRARY_PATH")])]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    env["SPECDEPLOY_SITE"] = os.pathsep.join(site_paths(extra_site))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
    cmd = [
        str(install.binary),
        f"--model-repository={Path(repo).resolve()}",
        f"--backend-directory={install.backend_dir}",
        f"--grpc-address={HOST}",
        f"--grpc-port={ports.grpc}",
        f"--http-address={HOST}",
        f"--http-port={ports.http}",
        f"--metrics-address={HOST}",
        f"--metrics-port={ports.metrics}",
        f"--exit-timeout-secs={exit_timeout_s}",
        "--pinned-memory-pool-byte-size=0",
        # Each python stub starts with this much shared memory (tmpfs pages, taken as they are touched) and grows by
        # as much, so a first request does not grow the 1 MiB default pool while decoupled responses are in flight:
        # the suspected trigger of the decoupled BLS stub's heap corruption (README, section 3, "Known limit").
        f"--backend-config=python,shm-default-byte-size={STUB_SHM_BYTES}",
        f"--backend-config=python,shm-growth-byte-size={STUB_SHM_BYTES}",
        shm.backend_arg(shm.new_prefix()),  # its regions are removed when it stops (specdeploy.triton.shm)
        "--disable-auto-complete-config",
        *extra_args,
    ]
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    shm.remove_orphaned()
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        process = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent if die_with_parent else None,
        )
    me = process_identity(process.pid)  # Popen returns after the exec, so this is tritonserver's command line
    state = ServerState(
        process.pid,
        ports.grpc,
        ports.http,
        ports.metrics,
        str(log_path),
        str(repo),
        time.time(),
        me.start_ticks if me else None,
        list(me.cmdline) if me else None,
    )
    return Server(process, state, exit_timeout_s)


def _die_with_parent() -> None:
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the finalizers still stop it
        pass


def _answers_ok(url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def is_ready(http_port: int, timeout_s: float = 2.0) -> bool:
    return _answers_ok(f"http://{HOST}:{http_port}/v2/health/ready", timeout_s)


def metrics_listening(metrics_port: int, timeout_s: float = 2.0) -> bool:
    """The metrics endpoint answers (tritonserver starts it after HTTP says ready: 40 ms later in one CI log)."""
    return _answers_ok(f"http://{HOST}:{metrics_port}/metrics", timeout_s)


def wait_ready(server: Server, timeout_s: float) -> None:
    """Block until the server says ready and its metrics endpoint answers (a scrape right after this must not find
    the port closed); on exit or timeout stop it and raise ServerError with the log's gist."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not server.alive():
            raise ServerError(
                f"tritonserver exited with code {server.process.returncode} while"
                f" starting\n{relevant_log(server.state.log)}",
                f"full log: {server.state.log}",
            )
        if is_ready(server.state.http_port) and metrics_listening(server.state.metrics_port):
            return
        time.sleep(0.25)
    server.stop()
    raise ServerError(
        f"tritonserver was not ready within {timeout_s:.0f} s\n{relevant_log(server.state.log)}",
        f"full log: {server.state.log}; raise triton.startup_timeout_s if models are slow to load",
    )


_ERROR_LINE = re.compile(r"^E\d{4} |^error|\w+Error\b|UNAVAILABLE|failed to load")
_NOISE = ("CUDA", "cuda", "DCGM", "NVML", "pinned memory", "CudaDriverHelper", "GPU")


def relevant_log(path: str | os.PathLike, tail: int = 25) -> str:
    """Error lines and tracebacks from the log (GPU/DCGM noise left out), or its last lines."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    picked, in_trace = [], False
    for line in lines:
        if "Traceback" in line:
            in_trace = True
        if in_trace or _ERROR_LINE.search(line):
            if not any(word in line for word in _NOISE):
                picked.append(line)
        if in_trace and line and not line.startswith((" ", "Traceback")):
            in_trace = False
    chosen = picked[-tail:] if picked else lines[-tail:]
    return "\n".join("  | " + line for line in chosen)


def stop_pid(
    pid: int,
    timeout_s: float = EXIT_TIMEOUT_S + 10,
    process: subprocess.Popen | None = None,
    expected: ProcessIdentity | None = None,
) -> None:
    """SIGTERM the server (it finishes in-flight requests), then SIGKILL its process group (python stubs), then
    remove the shared-memory regions it leaves behind (specdeploy.triton.shm).

    expected: who `pid` must be (see ServerState.running); a PID now held by another process is not signalled.
    """
    if process is None and expected is not None and not is_same_process(pid, expected):
        return
    me = process_identity(pid) if process is None else None
    regions = shm.prefixes_in(process.args if process is not None else me.cmdline if me else ())
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        pgid = None
    if pgid is not None:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                break
            if process is None and not pid_alive(pid):
                break
            time.sleep(0.1)
        replaced = process is None and expected is not None and pid_alive(pid) and not is_same_process(pid, expected)
        if pgid == pid and not replaced:  # our own session: take the stub processes down with it
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    if process is not None:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    for prefix in regions:
        shm.remove(prefix)


# ---------------------------------------------------------------- serve / status / stop for the CLI


DETACHED_LINE = "detached; stop it with: specdeploy stop"  # + the recipe: what `serve --detach` says last


def refuse_running(state_dir, recipe_path: str = "RECIPE") -> "ServerState | None":
    """The recorded server of `state_dir` if it has exited (None if there is none); a ServerError if it still runs."""
    existing = ServerState.read(state_dir)
    if existing is not None and existing.running():
        raise ServerError(
            f"a server for this recipe is already running (pid {existing.pid}, grpc {existing.grpc_url})",
            f"stop it first: specdeploy stop {recipe_path}",
        )
    return existing


def serve(
    repo: Path,
    state_dir: Path,
    triton_cfg,
    binary: str | None = None,
    detach: bool = False,
    echo=print,
    extra_site: tuple[str, ...] = (),
    recipe_path: str = "RECIPE",
    extra_args: tuple[str, ...] = (),
) -> ServerState:
    """Start the server on `repo`, wait until ready and print its addresses.

    detach=True: leave it running and record it in state_dir for `status`/`stop`. Otherwise block
    until Ctrl-C (SIGINT) or SIGTERM, then stop it cleanly.
    """
    existing = refuse_running(state_dir, recipe_path)
    if existing is not None:  # a server that died (killed, crashed): its stubs and regions go before a new one starts
        said = reap(existing)
        if said:
            echo(f"the previous tritonserver (pid {existing.pid}) had exited{said}")
    ports = Ports.pick(triton_cfg.grpc_port, triton_cfg.http_port, triton_cfg.metrics_port)
    server = start(
        repo,
        ports,
        Path(state_dir) / LOG_FILE,
        binary=binary,
        extra_site=extra_site,
        extra_args=extra_args,
        die_with_parent=not detach,
    )
    try:
        with terminate_as_interrupt():  # a SIGTERM (a job's time limit) mid-start stops it too, not only Ctrl-C
            wait_ready(server, triton_cfg.startup_timeout_s)
    except BaseException:
        server.stop()
        raise
    state = server.state
    state.stubs = python_stubs(state.pid)
    echo(f"tritonserver ready (pid {state.pid})")
    echo(f"  grpc:    {state.grpc_url}")
    echo(f"  http:    {state.http_url}")
    echo(f"  metrics: {state.metrics_url}")
    echo(f"  log:     {state.log}")
    if detach:
        state.write(Path(state_dir))
        echo(f"{DETACHED_LINE} {recipe_path}")
        return state

    return serve_in_foreground(server.process, state.log, server.stop, echo, state)


@contextlib.contextmanager
def terminate_as_interrupt(signals=(signal.SIGTERM,)):
    """`signals` raise KeyboardInterrupt inside the block (in the main thread), so the cleanup that Ctrl-C gets runs for
    SIGTERM too: a detached server is recorded only once it is ready, and one left by a start that SIGTERM ended
    (`timeout`, a CI job's limit) ran on unrecorded, out of reach of `status` and `stop`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _terminate(signum, frame):
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, _terminate) for sig in signals}
    try:
        yield
    finally:  # None: a handler set outside Python, which cannot be put back; the default then
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def serve_in_foreground(process, log_path, stop, echo, result):
    """Wait on a started tritonserver until Ctrl-C or SIGTERM (also when SIGINT was ignored at start-up), then
    `stop()` it and return `result`; ServerError with the relevant log lines when it exits by itself."""
    try:
        with terminate_as_interrupt((signal.SIGINT, signal.SIGTERM)):
            echo("serving; press Ctrl-C to stop")
            code = process.wait()
        raise ServerError(f"tritonserver exited with code {code}\n{relevant_log(log_path)}", f"full log: {log_path}")
    except KeyboardInterrupt:
        echo("stopping tritonserver ...")
        stop()
        echo("stopped")
        return result
    finally:
        if process.poll() is None:
            stop()


# `specdeploy status`'s exit codes, as LSB init scripts give them: 0 running and ready with every python stub alive, 1
# running but not ready or with a stub that died (requests to it fail), 3 not running (none recorded, or it exited)
STATUS_READY, STATUS_DEGRADED, STATUS_NOT_RUNNING = 0, 1, 3


def status_code(state: ServerState | None, line: str) -> int:
    """The exit code of a `status` answer (above)."""
    if state is None or not line.startswith("running"):
        return STATUS_NOT_RUNNING
    if not line.startswith("running, ready") or DEAD_STUB in line:
        return STATUS_DEGRADED
    return STATUS_READY


def status(state_dir: Path) -> tuple[ServerState | None, str]:
    """(state, one-line description) of the detached server recorded in state_dir."""
    state = ServerState.read(state_dir)
    if state is None:
        return None, "not running (no server started with --detach)"
    if not state.running():
        return state, f"not running (pid {state.pid} has exited{_reused(state)}; log: {state.log}){orphans_line(state)}"
    ready = "ready" if is_ready(state.http_port) else "not ready"
    line = (
        f"running, {ready}: pid {state.pid}, grpc {state.grpc_url}, http {state.http_url}, metrics {state.metrics_url}"
    )
    return state, line + stub_changes(state)


def stop(state_dir: Path) -> str:
    state = ServerState.read(state_dir)
    if state is None:
        return "no server to stop"
    if state.running():
        stop_pid(state.pid, expected=state.identity())
        message = f"stopped tritonserver (pid {state.pid})"
    else:
        message = f"tritonserver (pid {state.pid}) had already exited{_reused(state)}" + reap(state)
    (Path(state_dir) / STATE_FILE).unlink(missing_ok=True)
    return message


def _reused(state: ServerState) -> str:
    return "; that pid now belongs to another process, left alone" if pid_alive(state.pid) else ""
