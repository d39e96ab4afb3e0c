"""What a detached server leaves for `status` and `stop` (`ServerState`, in STATE_FILE), and whether its PID is
still that server."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from specdeploy.core.artifacts import ProcessIdentity, process_identity
from specdeploy.triton.ports import HOST

STATE_FILE = "server.json"


@dataclass
class ServerState:
    """What `serve --detach` leaves for `status` and `stop`."""

    pid: int
    grpc_port: int
    http_port: int
    metrics_port: int
    log: str
    repo: str
    started: float
    # who `pid` was when the server started: a PID can be reused once the server exits, so status and
    # stop act only on a process with this start time and command line (None: a state from before they were kept)
    start_ticks: int | None = None
    cmdline: list[str] | None = None
    # python-backend instance -> its stub's pid once the server was ready: status says which stub went away
    stubs: dict[str, int] | None = None

    def identity(self) -> ProcessIdentity | None:
        return (
            None if self.start_ticks is None else ProcessIdentity(self.pid, self.start_ticks, tuple(self.cmdline or ()))
        )

    def running(self) -> bool:
        """True when `pid` is still the server this state recorded (not a later process given the same PID)."""
        return is_same_process(self.pid, self.identity())

    @property
    def grpc_url(self) -> str:
        return f"{HOST}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{HOST}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{HOST}:{self.metrics_port}/metrics"

    def write(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / STATE_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, directory: Path) -> "ServerState | None":
        try:
            return cls(**json.loads((Path(directory) / STATE_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            return None


def is_same_process(pid: int, expected: ProcessIdentity | None) -> bool:
    """Whether `pid` runs and is the process `expected` describes (start time and command line). Without an
    expected identity (a state written by an older specdeploy) the process must at least be a tritonserver."""
    current = process_identity(pid)
    if current is None:
        return False
    if expected is None:
        return bool(current.cmdline) and "tritonserver" in os.path.basename(current.cmdline[0])
    if None not in (expected.start_ticks, current.start_ticks) and current.start_ticks != expected.start_ticks:
        return False
    return not expected.cmdline or current.cmdline == expected.cmdline
