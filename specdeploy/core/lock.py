"""One specdeploy run per recipe at a time: an exclusive lock on `engines/<recipe>/.lock`.

Two runs of the stages of one recipe (say `build` in two terminals, or `run` while `quantize` is
still going) would write the same folders. The CLI takes this lock around every command that writes
a recipe's outputs; a second run waits for the first, saying so, and gives up after a timeout with an
error naming the holder. The lock is `flock(2)` on an open file, so the kernel releases it when its
holder exits, however it exits (SIGKILL included): there is never a stale lock to delete by hand.
The file records the holder's pid and command, only for the messages.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from pathlib import Path

from specdeploy.core.errors import BusyError, ConfigError

LOCK_FILE = ".lock"
LOCK_TIMEOUT_S = 3600.0  # how long a second run waits for the first (CLI --lock-timeout)
POLL_S = 0.2

_held: dict[str, int] = {}  # lock path -> nesting depth in this process (flock is per open file, not per process)


def holder(path: Path) -> str:
    """'pid N: COMMAND' of the process that last took the lock at `path` (the one holding it, while held)."""
    try:
        pid, _, command = Path(path).read_text().strip().partition(" ")
    except OSError:
        pid = command = ""
    return f"pid {pid}: {command}" if pid.isdigit() else "pid unknown"


@contextlib.contextmanager
def recipe_lock(engines_dir: Path, recipe_name: str, command: str, timeout_s: float = LOCK_TIMEOUT_S, echo=print):
    """Hold the lock of one recipe (engines_dir = engines/<recipe>/) for the duration of the block.

    Waits for another holder up to `timeout_s` (0: not at all), printing once who it waits for, then
    raises BusyError naming that process and the fix. Nested use in one process is allowed.
    """
    path = Path(engines_dir) / LOCK_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # --root on a file, a read-only or a special file system
        raise ConfigError(
            f"cannot create {path.parent}: {exc.strerror or exc}",
            "pass --root (or $SPECDEPLOY_ROOT) a folder you can write to",
        ) from None
    key = str(path.resolve())
    if key in _held:
        _held[key] += 1
        try:
            yield path
        finally:
            _held[key] -= 1
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        _acquire(fd, path, recipe_name, timeout_s, echo)
        try:  # who holds it, for a waiting run's message; the flock is the lock, so a full disk only loses the name
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {command}\n".encode(), 0)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
        _held[key] = 1
        try:
            yield path
        finally:
            del _held[key]
    finally:
        os.close(fd)  # releases the lock


def _acquire(fd: int, path: Path, recipe_name: str, timeout_s: float, echo) -> None:
    deadline = time.monotonic() + timeout_s
    announced = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if announced:
                echo(f"got the lock on {recipe_name}; going on")
            return
        except BlockingIOError:
            pass
        who = holder(path)
        if time.monotonic() >= deadline:
            raise BusyError(
                f"another specdeploy run on {recipe_name} holds {path} ({who})"
                + (f"; waited {timeout_s:.0f} s" if timeout_s else ""),
                "wait for it to finish (or stop it: kill PID) and run again, or wait longer with "
                "specdeploy --lock-timeout SECONDS; the lock goes away by itself when that process exits",
            )
        if not announced and (who != "pid unknown" or time.monotonic() > deadline - timeout_s + 1):
            echo(f"waiting for another specdeploy run on {recipe_name} ({who}) ...")
            announced = True
        time.sleep(POLL_S)
