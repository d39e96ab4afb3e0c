"""State safety with real processes: `stop` never signals a PID that another process now holds, and
two specdeploy runs on one recipe take turns on its lock. (SIGKILL during atomic_output: test_artifacts.py.)"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from specdeploy.core import artifacts, lock
from specdeploy.core.artifacts import process_identity
from specdeploy.core.errors import BusyError
from specdeploy.triton import ports, server, server_state

# ---------------------------------------------------------------- stop and PID reuse


def _deaf():
    """In the child before exec: the signals `stop` sends (all but SIGKILL) stay blocked, so one sent is still pending
    (in /proc, at once and also after a later SIGKILL) instead of ending the process some time later."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})


def signals_sent_to(pid: int) -> int:
    """The pending signals of `pid` (process- and thread-directed): a signal sent to it shows here once kill()
    returned."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)


def _start_bystander(preexec_fn=None) -> subprocess.Popen:
    """An unrelated live process, in its own session like a tritonserver started by specdeploy."""
    proc = subprocess.Popen(["sleep", "120"], start_new_session=True, preexec_fn=preexec_fn)
    deadline = time.monotonic() + 10
    while process_identity(proc.pid).cmdline != ("sleep", "120") and time.monotonic() < deadline:
        time.sleep(0.05)  # some kernels (and sandboxes) show the new command line a moment after exec
    return proc


@pytest.fixture
def bystander():
    proc = _start_bystander()
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def deaf_bystander():
    """A bystander that blocks the signals `stop` sends: whether one was sent can be read at once."""
    proc = _start_bystander(_deaf)
    yield proc
    proc.kill()
    proc.wait()


def state_for(pid: int, start_ticks, cmdline) -> server_state.ServerState:
    return server_state.ServerState(pid, 1, 2, 3, "tritonserver.log", "repo", 0.0, start_ticks, cmdline)


TRITON_CMDLINE = ["/opt/tritonserver/bin/tritonserver", "--model-repository=/models"]


@pytest.mark.parametrize(
    "recorded",
    ["other start time", "other command line", "state without identity"],
)
def test_stop_leaves_a_process_that_reused_the_pid_alone(tmp_path, deaf_bystander, recorded):
    bystander = deaf_bystander
    me = process_identity(bystander.pid)
    assert me is not None and me.start_ticks and me.cmdline == ("sleep", "120")
    state = {
        "other start time": state_for(bystander.pid, me.start_ticks - 1, list(me.cmdline)),
        "other command line": state_for(bystander.pid, me.start_ticks, TRITON_CMDLINE),
        "state without identity": state_for(bystander.pid, None, None),  # written by an older specdeploy
    }[recorded]
    state.write(tmp_path)
    assert not server_state.ServerState.read(tmp_path).running()
    assert "not running" in server.status(tmp_path)[1] and "another process" in server.status(tmp_path)[1]
    message = server.stop(tmp_path)
    assert "had already exited" in message and "another process, left alone" in message
    assert signals_sent_to(bystander.pid) == 0, "stop signalled a process that is not the server it started"
    assert not (tmp_path / server_state.STATE_FILE).exists(), "the stale state is cleaned up"
    server.stop_pid(
        bystander.pid, timeout_s=1, expected=state.identity() or artifacts.ProcessIdentity(bystander.pid, 1, ())
    )
    assert signals_sent_to(bystander.pid) == 0 and bystander.poll() is None


def test_stop_signals_the_process_it_recorded(tmp_path, bystander):
    me = process_identity(bystander.pid)
    state_for(bystander.pid, me.start_ticks, list(me.cmdline)).write(tmp_path)
    assert server_state.ServerState.read(tmp_path).running()
    assert server.stop(tmp_path) == f"stopped tritonserver (pid {bystander.pid})"
    assert bystander.wait(timeout=10) == -signal.SIGTERM
    assert not (tmp_path / server_state.STATE_FILE).exists()


@pytest.mark.server
def test_a_started_server_records_who_it_is(tmp_path):
    """The identity comes from the real tritonserver process (its command line, its start time)."""
    (tmp_path / "repo").mkdir()
    running = server.start(tmp_path / "repo", ports.Ports.pick(), tmp_path / "tritonserver.log")
    with running:
        state = running.state
        assert Path(state.cmdline[0]).name == "tritonserver" and f"--grpc-port={state.grpc_port}" in state.cmdline
        assert state.start_ticks == process_identity(state.pid).start_ticks
        state.write(tmp_path / "state")
        assert server_state.ServerState.read(tmp_path / "state").running()
    assert not server_state.ServerState.read(tmp_path / "state").running()


# ---------------------------------------------------------------- one run per recipe


HOLDER = r"""
import sys, time
from pathlib import Path
from specdeploy.core import lock
engines, release = Path(sys.argv[1]), Path(sys.argv[2])
with lock.recipe_lock(engines, "smollm2-135m", "specdeploy build recipe.yaml"):
    (engines / "held").write_text("")
    while not release.exists():
        time.sleep(0.05)
"""


@pytest.fixture
def project(tmp_path):
    raw = yaml.safe_load(open("build/smollm2-135m.yaml"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    return tmp_path, recipe, tmp_path / "engines" / raw["name"]


@pytest.fixture
def holder(project):
    root, _, engines = project
    engines.mkdir(parents=True)
    release = root / "release"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(engines), str(release)])
    deadline = time.monotonic() + 60
    while not (engines / "held").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the holder did not take the lock"
        time.sleep(0.05)
    yield proc, release
    release.touch()
    proc.kill()
    proc.wait()


def cli(root, *args) -> subprocess.Popen:
    code = "from specdeploy.cli.main import main; main(prog_name='specdeploy')"
    return subprocess.Popen(
        [sys.executable, "-c", code, "--root", str(root), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def lines_of(proc) -> queue.Queue:
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    return lines


def wait_for_line(lines: queue.Queue, needle: str, timeout_s: float = 60) -> list[str]:
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            seen.append(lines.get(timeout=0.5))
        except queue.Empty:
            continue
        if needle in seen[-1]:
            return seen
    raise AssertionError(f"no line with {needle!r} within {timeout_s} s; got {seen}")


def test_a_second_run_waits_for_the_first(project, holder):
    root, recipe, _ = project
    first, release = holder
    second = cli(root, "repo", str(recipe))  # `repo` takes the lock before it looks at its inputs
    lines = lines_of(second)
    wait_for_line(
        lines, f"waiting for another specdeploy run on smollm2-135m (pid {first.pid}: specdeploy build recipe.yaml)"
    )
    assert second.poll() is None, "the second run must wait while the first holds the recipe"
    release.touch()
    assert first.wait(timeout=30) == 0
    # it went on only with the lock: nothing of its work came before that line (a run that went on without the
    # lock would never print it)
    assert not any("hint:" in line for line in wait_for_line(lines, "got the lock on smollm2-135m"))
    assert second.wait(timeout=60) == 1  # then it ran: this empty project has no engines to make a repository of
    wait_for_line(lines, "hint: run: specdeploy build")


def test_a_second_run_gives_up_after_the_timeout_naming_the_holder(project, holder):
    root, recipe, engines = project
    first, _ = holder
    second = cli(root, "--lock-timeout", "0.5", "build", str(recipe))
    out, _ = second.communicate(timeout=60)
    assert second.returncode == 1, out
    assert (
        f"another specdeploy run on smollm2-135m holds {engines / '.lock'} (pid {first.pid}: specdeploy build"
        " recipe.yaml)" in out
    )
    assert "kill PID" in out and "--lock-timeout" in out
    assert first.poll() is None


def test_the_lock_dies_with_its_holder(project, holder):
    root, recipe, engines = project
    first, _ = holder
    with pytest.raises(BusyError):
        with lock.recipe_lock(engines, "smollm2-135m", "test", timeout_s=0):
            pass
    first.send_signal(signal.SIGKILL)
    first.wait()
    with lock.recipe_lock(engines, "smollm2-135m", "test", timeout_s=10) as path:
        assert lock.holder(path) == f"pid {os.getpid()}: test"
        with lock.recipe_lock(engines, "smollm2-135m", "nested", timeout_s=0):  # one process may nest it
            pass
        third = cli(root, "--lock-timeout", "0", "repo", str(recipe))
        out, _ = third.communicate(timeout=60)
        assert third.returncode == 1 and f"(pid {os.getpid()}: test)" in out


def test_every_command_that_writes_a_recipes_outputs_takes_its_lock(project, holder):
    from click.testing import CliRunner

    from specdeploy.cli.main import main

    root, recipe, _ = project
    first, _ = holder
    writers = [["quantize"], ["build"], ["repo"], ["serve", "--detach"], ["validate"], ["run"]]
    for command in writers:
        result = CliRunner().invoke(main, ["--root", str(root), "--lock-timeout", "0", *command, str(recipe)])
        assert result.exit_code == 1 and f"(pid {first.pid}: specdeploy build recipe.yaml)" in result.output, (
            command,
            result.output,
        )
    for command in (["build", "--dry-run"], ["status"], ["stop"], ["check"]):  # these write no recipe output
        result = CliRunner().invoke(main, ["--root", str(root), "--lock-timeout", "0", *command, str(recipe)])
        assert "holds" not in result.output, (command, result.output)
