"""Faults, each performed for real on the tiny CPU deployment (tests/ops_deploy.py), and what specdeploy does about
them.

(a) a python stub SIGKILLed mid-request; (b) tritonserver SIGKILLed mid-request; (c) SIGKILL during quantize, build
and repo generation (the CLI run as a subprocess, killed when it says it reached the point: tests/stage_pause.py);
(d) the disk full during a stage (a small tmpfs mounted under the project); (e) a second `specdeploy` run on the
same recipe while a first holds it. docs/reliability.md has the figures of one run of each.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import ops_deploy
import pytest

TESTS = Path(__file__).resolve().parent
NAME = "faults"
STUB = "triton_python_backend_stub"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ops_deploy.make_model(tmp_path_factory.mktemp("faults-model"))


@pytest.fixture
def project(tmp_path, model_dir):
    """(recipe, layout, recipe_path) of a fully built deployment (quantize, build, repo) of its own."""
    return ops_deploy.build(tmp_path / "project", model_dir, NAME, triton={"decoupled": True})


def specdeploy(layout, *args, point: str = "none") -> subprocess.Popen:
    """The real CLI as a subprocess (with a pause point, tests/stage_pause.py); stdout and stderr as lines."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(TESTS.parent)}
    return subprocess.Popen(
        [sys.executable, str(TESTS / "stage_pause.py"), point, "--root", str(layout.root), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


class Lines:
    """A process's output lines, read in a thread; `wait_for` blocks until a line holds the text (a signal, not a
    sleep)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.seen, self.queue = proc, [], queue.Queue()
        threading.Thread(target=lambda: [self.queue.put(line) for line in proc.stdout] and None, daemon=True).start()

    def wait_for(self, text: str, timeout_s: float = 300) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.queue.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None and self.queue.empty():
                    break
                continue
            self.seen.append(line)
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r}; the process said:\n{''.join(self.seen)}")

    def rest(self, timeout_s: float = 300) -> str:
        self.proc.wait(timeout=timeout_s)
        while True:
            try:
                self.seen.append(self.queue.get(timeout=2))
            except queue.Empty:
                return "".join(self.seen)


def run_cli(layout, *args, timeout_s: float = 300) -> tuple[int, str]:
    proc = specdeploy(layout, *args)
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, out


def tree_hash(path: Path) -> str:
    """Hash of every file's relative name and bytes under `path` (the manifest's creation time included)."""
    h = hashlib.sha256()
    for file in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        h.update(str(file.relative_to(path)).encode())
        h.update(file.read_bytes())
    return h.hexdigest()


def outputs(layout) -> dict[str, list[Path]]:
    return {
        "quantize": [layout.checkpoint("target"), layout.checkpoint("draft")],
        "build": [layout.engine("target"), layout.engine("draft")],
        "repo": [layout.repo],
    }


def next_run(recipe, layout, recipe_path) -> tuple[list[str], bool]:
    """The three stages again, in-process, as `specdeploy run` chains them: (what they said, whether repo wrote)."""
    from specdeploy.deploy import backend_stages
    from specdeploy.deploy.cpu_build import build_recipe
    from specdeploy.quantize.stage import quantize_recipe

    said: list[str] = []
    quantize_recipe(recipe, layout, echo=said.append, progress=False)
    build_recipe(recipe, layout, echo=said.append)
    _, written = backend_stages.of(recipe).write_repository(recipe, layout, recipe_path=str(recipe_path))
    return said, written


# ---------------------------------------------------------------- (c) SIGKILL during a stage


@pytest.mark.parametrize("stage", ["quantize", "build", "repo"])
def test_sigkill_mid_stage_leaves_nothing_half_written_and_the_next_run_redoes_only_that_stage(project, stage):
    recipe, layout, recipe_path = project
    every = [p for paths in outputs(layout).values() for p in paths]
    before = {p: tree_hash(p) for p in every}
    victim = outputs(layout)[stage][0]  # the target's checkpoint / engine, or the repository: this stage must make it
    fingerprint = json.loads((victim / "manifest.json").read_text())["fingerprint"]
    shutil.rmtree(victim)

    proc = specdeploy(layout, stage, str(recipe_path), point="write")
    Lines(proc).wait_for(
        f"PAUSED write {victim.parent}/.{victim.name}.tmp-"
    )  # its files are written, the manifest is next
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert not victim.exists()  # nothing half-written in place
    assert list(victim.parent.glob(f".{victim.name}.tmp-*")), (
        "the kill must have come mid-write (the dead writer's folder)"
    )
    for path in every:
        if path != victim:
            assert tree_hash(path) == before[path], f"{path} changed"

    said, repo_written = next_run(recipe, layout, recipe_path)
    print(f"{stage}: killed mid-write; the next run said:", said, "repo written:", repo_written)
    redone = [line for line in said if "up to date" not in line and line.startswith(("target", "draft"))]
    assert all(line.startswith("target") for line in redone) and (redone or stage == "repo"), said
    assert repo_written == (stage == "repo")
    assert json.loads((victim / "manifest.json").read_text())["fingerprint"] == fingerprint
    assert not list(victim.parent.glob(f".{victim.name}.*")), "the dead writer's folder must be gone"
    for path in every:
        if path != victim:
            assert tree_hash(path) == before[path], f"{path} was redone"


@pytest.mark.parametrize("stage", ["quantize", "build", "repo"])
def test_sigkill_mid_swap_keeps_the_previous_artifact_loadable(project, stage):
    """Killed between the two renames of atomic_output (`--force`: the previous output set aside, the new one not yet
    in place): the next reader puts the previous one back, byte for byte, and it still loads."""
    from specdeploy.core import artifacts
    from specdeploy.triton.repository import require_repository

    recipe, layout, recipe_path = project
    victim = outputs(layout)[stage][0]
    before = tree_hash(victim)
    proc = specdeploy(layout, stage, "--force", str(recipe_path), point="swap")
    Lines(proc).wait_for("PAUSED swap")
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert not victim.exists() and list(victim.parent.glob(f".{victim.name}.old-*"))  # killed with no output in place
    if stage == "repo":
        require_repository(recipe, layout, str(recipe_path))  # what `serve` checks first
    else:
        artifacts.require(victim, {"quantize": "quantize", "build": "build"}[stage], "rerun")
    assert tree_hash(victim) == before
    assert sorted(p.name for p in victim.parent.iterdir() if p.name.startswith(f".{victim.name}.")) == []
    said, repo_written = next_run(recipe, layout, recipe_path)
    assert not repo_written and all("up to date" in line for line in said if line.startswith(("target", "draft"))), said


# ---------------------------------------------------------------- (e) a second run on the same recipe


def test_a_second_run_on_the_same_recipe_fails_or_waits_and_goes_on_when_the_first_dies(project):
    recipe, layout, recipe_path = project
    first = specdeploy(layout, "quantize", "--force", str(recipe_path), point="write")
    Lines(first).wait_for("PAUSED write")  # it holds the recipe's lock while writing

    code, out = run_cli(layout, "--lock-timeout", "0", "build", str(recipe_path))
    print("second run, --lock-timeout 0:", out)
    assert code == 1
    assert (
        f"another specdeploy run on {NAME} holds {layout.engines / '.lock'} (pid {first.pid}: specdeploy quantize"
        f" {recipe_path})" in out
    ), out
    assert "hint:" in out and "kill PID" in out

    waiter = specdeploy(layout, "build", str(recipe_path))
    lines = Lines(waiter)
    lines.wait_for(f"waiting for another specdeploy run on {NAME} (pid {first.pid}")
    assert waiter.poll() is None
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    lines.wait_for(f"got the lock on {NAME}; going on")
    out = lines.rest()
    print("waiting second run:", "".join(lines.seen))
    assert waiter.returncode == 0 and "target: up to date" in out and "draft: up to date" in out, out


# ---------------------------------------------------------------- (d) disk full


@pytest.mark.parametrize("stage", ["quantize", "build", "repo"])
def test_disk_full_during_a_stage_names_the_path_and_space_and_leaves_nothing(project, full_disk, stage):
    recipe, layout, recipe_path = project
    victim = outputs(layout)[stage][0]
    others = {p: tree_hash(p) for paths in outputs(layout).values() for p in paths if p.parent != victim.parent}
    # the stage's folder is now a full filesystem holding only the stage's inputs (build reads the checkpoints beside
    # its engines); its previous outputs are hidden until the end
    there = full_disk(victim.parent, keep=("checkpoints",) if stage == "build" else ())
    code, out = run_cli(layout, stage, str(recipe_path))
    print(f"{stage} on a full disk:", out)
    assert code == 1, out
    assert "Traceback" not in out
    if stage == "quantize":  # quantize checks the room it needs before writing (the checkpoint's estimated size)
        assert f"error: not enough disk space for the checkpoint in {victim.parent}/.{victim.name}.tmp-" in out, out
        assert "MiB needed, 0 MiB free" in out and "hint: free some space on that disk" in out, out
    else:  # the others run out mid-write: atomic_output says where, what is free and what it had written
        assert f"error: no space left writing {victim} (No space left on device): it ran out after writing " in out, out
        assert f"free on the filesystem of {victim.parent}; nothing was left half-written" in out, out
        assert "hint: make more than" in out and "free there, or point --root at a larger disk" in out, out
    left = sorted(
        set(os.listdir(victim.parent)) - {".lock"}
    )  # the recipe's lock file (specdeploy/core/lock.py) stays, empty
    assert left == there, "nothing half-written may be left"
    for path, digest in others.items():
        assert tree_hash(path) == digest


# ---------------------------------------------------------------- (b) tritonserver killed mid-request


def _stream_one(grpc_url: str, prompt: str = "seven lanterns under the bridge", max_tokens: int = 200):
    """Start a streamed speculative request in a thread: (first response arrived, done, outcome holder)."""
    from specdeploy.client.protocol import SPECULATIVE_MODEL, GenerateRequest
    from specdeploy.client.triton_adapter import TritonEndpoint
    from specdeploy.core.errors import ClientError

    first, done, outcome = threading.Event(), threading.Event(), {}

    def go():
        try:
            request = GenerateRequest(prompt, max_tokens, 3, stream=True)
            outcome["result"] = TritonEndpoint(grpc_url).generate(
                SPECULATIVE_MODEL, request, 120, on_text=lambda piece: first.set()
            )
        except ClientError as exc:
            outcome["error"] = exc
        finally:
            first.set()
            done.set()

    threading.Thread(target=go, daemon=True).start()
    return first, done, outcome


def _serve(layout, recipe_path) -> dict:
    code, out = run_cli(layout, "serve", "--detach", str(recipe_path), timeout_s=600)
    assert code == 0, out
    return json.loads((layout.server_state / "server.json").read_text())


def _stubs(server_pid: int) -> dict[int, str]:
    import psutil

    out = {}
    for child in psutil.Process(server_pid).children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if cmd and STUB in cmd[0]:
            out[child.pid] = " ".join(cmd)
    return out


def _regions(state: dict) -> list[str]:
    from specdeploy.triton import shm

    return sorted(p.name for prefix in shm.prefixes_in(state["cmdline"]) for p in shm.SHM_DIR.glob(prefix + "*"))


def _gone(pids, timeout_s: float = 60) -> bool:
    from specdeploy.core.artifacts import pid_alive

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.server
def test_tritonserver_killed_mid_request_status_stop_and_serve_recover(project):
    """SIGKILL of tritonserver while a request streams: the client gets an error naming the lost server; the python
    stubs outlive it (tritonserver 2.51), and `status` says so; `stop` (or the next `serve`) removes them and the
    shared-memory regions, and a new server serves."""
    recipe, layout, recipe_path = project

    def kill_mid_request(state):
        stubs = _stubs(state["pid"])
        assert len(stubs) >= 6 and _regions(state)
        first, done, outcome = _stream_one(f"127.0.0.1:{state['grpc_port']}")
        assert first.wait(300) and not done.is_set(), outcome  # mid-request: the first tokens came, more are coming
        os.kill(state["pid"], signal.SIGKILL)
        assert done.wait(120)
        assert "went away" in outcome["error"].message or "unreachable" in outcome["error"].message, outcome
        print("in flight:", outcome["error"].message)
        return stubs

    state = _serve(layout, recipe_path)
    try:
        stubs = kill_mid_request(state)
        code, out = run_cli(layout, "status", str(recipe_path))
        print("status:", out)
        assert code == 3 and f"not running (pid {state['pid']} has exited" in out, out  # 3: not running (LSB)
        assert "python stubs running" in out or _gone(stubs, 0), out
        code, out = run_cli(layout, "stop", str(recipe_path))
        print("stop:", out)
        assert code == 0 and f"tritonserver (pid {state['pid']}) had already exited" in out, out
        assert _gone(stubs, 30) and _regions(state) == [] and not (layout.server_state / "server.json").exists()

        again = _serve(layout, recipe_path)  # a new server, and killed again: this time `serve` itself cleans up
        stubs = kill_mid_request(again)
        third = _serve(layout, recipe_path)
        assert _gone(stubs, 30) and _regions(again) == []
        code, out = run_cli(layout, "status", str(recipe_path))
        assert code == 0 and f"running, ready: pid {third['pid']}" in out, out
        _, done, outcome = _stream_one(f"127.0.0.1:{third['grpc_port']}", max_tokens=8)
        assert done.wait(300) and "result" in outcome, outcome
    finally:
        run_cli(layout, "stop", str(recipe_path))


# ---------------------------------------------------------------- (a) a python stub killed mid-request


@pytest.mark.server
def test_a_python_stub_killed_mid_request(project):
    """SIGKILL of the target model's stub while the speculative entry point streams through it: tritonserver 2.51 does
    not restart it; the request in flight and every later one to that model fail at once with "Stub process
    'tensorrt_llm_0_0' is not healthy", the model stays READY, and `status` names the dead stub and the fix."""
    recipe, layout, recipe_path = project
    state = _serve(layout, recipe_path)
    try:
        grpc_url = f"127.0.0.1:{state['grpc_port']}"
        stubs = _stubs(state["pid"])
        target = [pid for pid, cmd in stubs.items() if cmd.endswith("tensorrt_llm_0_0 DEFAULT")]
        assert len(target) == 1, stubs
        # every stub waits for OpenMP work passively (server.OMP_WAIT_POLICY): no spinning for a core another stub holds
        for pid in stubs:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert b"OMP_WAIT_POLICY=PASSIVE" in environ, (pid, stubs[pid])
        first, done, outcome = _stream_one(grpc_url)
        assert first.wait(300) and not done.is_set(), outcome
        os.kill(target[0], signal.SIGKILL)
        assert done.wait(180), "the request in flight must end (answered or failed), not hang"
        unhealthy = "tensorrt_llm: Stub process 'tensorrt_llm_0_0' is not healthy"
        assert unhealthy in outcome["error"].message, outcome
        print("in flight:", outcome["error"].message)
        for _ in range(2):  # the next requests: refused with the same message
            started = time.monotonic()
            _, done, nxt = _stream_one(grpc_url, max_tokens=8)
            assert done.wait(180) and unhealthy in nxt["error"].message, nxt
            print(f"next: refused after {time.monotonic() - started:.2f} s: {nxt['error'].message}")
        code, out = run_cli(layout, "status", str(recipe_path))
        print("status:", out)
        assert code == 1 and f"python stub tensorrt_llm_0_0 (pid {target[0]}) has exited (killed or crashed)" in out, (
            out
        )  # degraded
        assert "restart the server" in out
        assert len(_stubs(state["pid"])) == len(stubs) - 1  # nothing restarted it
    finally:
        code, out = run_cli(layout, "stop", str(recipe_path))
        assert code == 0 and "stopped tritonserver" in out, out
