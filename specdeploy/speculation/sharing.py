"""What the BLS instances (processes) of one server share of the speculation policy, through files in one folder:
how many of them are generating now (`ActiveCount`) and the deployment's measured state (`SharedState`), and the
sweep of folders that servers left behind. Not pure (files, pids), so kept apart from the policies, which only
receive the numbers.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

from specdeploy.core.artifacts import pid_alive


class ActiveCount:
    """How many BLS instances (processes) are generating now: each instance keeps a file `<pid>` in
    `folder` holding 1 while it serves a request; dead processes are not counted. Not pure (files), so
    kept apart from the policies, which only receive the number."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.mine = self.folder / str(os.getpid())
        self.set_busy(False)

    def set_busy(self, busy: bool) -> None:
        tmp = self.mine.with_suffix(".tmp")
        tmp.write_text("1" if busy else "0")
        os.replace(tmp, self.mine)

    def close(self, when_last=()) -> None:
        """Remove this process's file; once no live instance is left, also the files `when_last` and the folder
        (each instance removes its own file before it looks, so the last one to look sees none)."""
        self.mine.unlink(missing_ok=True)
        if any(self._live()):
            return
        for path in when_last:
            path.unlink(missing_ok=True)
        try:
            self.folder.rmdir()
        except OSError:
            pass

    def __call__(self) -> int:
        return max(1, sum(busy for _, busy in self._live()))

    def _live(self):
        """(file, busy) of each instance whose process is alive."""
        for path in self.folder.iterdir():
            if path.name.isdigit() and pid_alive(int(path.name)):
                try:
                    yield path, path.read_text().strip() == "1"
                except OSError:  # gone since the listing
                    continue


INSTANCES_PREFIX = "specdeploy-active-"  # + a hash of the model repository: ActiveCount's and SharedState's folder
ABANDONED_AFTER_S = 60.0


def instances_folder(parent, model_repository: str) -> Path:
    """The folder the BLS instances serving `model_repository` share (ActiveCount, SharedState)."""
    digest = hashlib.sha256(str(model_repository).encode()).hexdigest()[:12]
    return Path(parent) / (INSTANCES_PREFIX + digest)


def remove_abandoned(parent) -> int:
    """Remove the instances' folders (INSTANCES_PREFIX) under `parent` that no live process uses: no file in them
    is named after a live pid (an instance `<pid>`, a server's `policy-<pid>.*`) and nothing in them changed for
    ABANDONED_AFTER_S (a server that is starting keeps its new folder). A server that was killed, or stopped before
    its stubs finalized, leaves its folder behind; each BLS instance sweeps when it starts. Returns how many went."""
    now, removed = time.time(), 0
    for folder in Path(parent).glob(INSTANCES_PREFIX + "*"):
        try:
            if now - folder.stat().st_mtime < ABANDONED_AFTER_S:
                continue
            files = list(folder.iterdir())
            if any(_owned_by_live_process(f.name) for f in files):
                continue
            for f in files:
                f.unlink(missing_ok=True)
            folder.rmdir()
            removed += 1
        except OSError:  # changed meanwhile, or not ours to remove
            continue
    return removed


class SharedState:
    """One server's measured deployment state (costs, acceptance, the gate), shared by its BLS instances through
    `policy-<server pid>.json` in the instances' folder. An instance loads the newest state before each request
    (`pull`) and, when the request ends, replays that request's round outcomes onto the newest state under a lock
    (`push`): the instances calibrate, learn acceptance and trip the gate as one deployment (TensorRT-LLM's gate
    belongs to the executor), instead of each one exploring on its own share of the requests. A restarted server
    starts afresh (its pid names a new file); files of servers that are gone are removed."""

    def __init__(self, folder, deployment, server_pid: int):
        # deployment: a specdeploy.speculation.policy.SharedPolicy (not imported: the policy re-exports this module's
        # names)
        self.path = Path(folder) / f"policy-{server_pid}.json"
        self.deployment = deployment
        self.version = 0  # of the state this instance last loaded or wrote
        deployment.journal = []
        for stale in Path(folder).glob("policy-*"):
            if not _owned_by_live_process(stale.name):
                stale.unlink(missing_ok=True)

    def pull(self) -> None:
        shared = self._read()
        if shared is not None and shared["version"] != self.version:
            self.deployment.load_state(shared["state"])
            self.version = shared["version"]

    def push(self) -> None:
        """Add the rounds recorded since the last push to the shared state. Sharing saves calibration, it is not
        needed to serve: when the folder cannot be written (disk full, removed) this instance goes on with what it
        measured itself and says so on stderr (the server log)."""
        d = self.deployment
        journal, d.journal = d.journal, []
        if not journal:
            return
        try:
            with open(self.files[1], "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                shared = self._read()
                d.load_state(shared["state"] if shared else None)
                for outcome in journal:
                    d.record(outcome)
                d.journal = []
                self.version = (shared["version"] if shared else 0) + 1
                tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"version": self.version, "state": d.state()}))
                os.replace(tmp, self.path)
        except OSError as exc:
            d.journal = []
            print(
                f"specdeploy: could not share the speculation policy's measurements ({exc}); this instance keeps"
                " its own",
                file=sys.stderr,
            )

    @property
    def files(self) -> tuple[Path, Path]:
        """The state and its lock: the server's last instance removes them (ActiveCount.close)."""
        return self.path, self.path.with_suffix(".lock")

    def _read(self) -> dict | None:
        """The shared state; None when there is none yet, or what is there cannot be read (then it starts afresh)."""
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None


def _owned_by_live_process(name: str) -> bool:
    """Whether the pid a file of the instances' folder is named after (`<pid>`, `policy-<server pid>.json`, the
    first number in the name) is alive."""
    found = re.search(r"\d+", name)
    return found is not None and pid_alive(int(found.group()))
