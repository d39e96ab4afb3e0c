"""Run the `specdeploy` CLI with one pause point, for tests that SIGKILL a stage at a known moment (test_faults.py).

    python tests/stage_pause.py POINT [specdeploy arguments...]

POINT: `write`  - the stage has written its artifact into atomic_output's temporary folder and is about to write the
                  manifest (a half-written artifact: what a kill during the model export leaves);
       `swap`   - the previous artifact has just been set aside (renamed to .NAME.old-...) and the new one is not yet
                  in place (between the two renames of atomic_output's swap);
       `checkpoint` - `draft train` has saved its first resume checkpoint (engines/<recipe>/eagle3-head.partial);
       `none`   - no pause.
At the point it prints `PAUSED <point> <folder>` on stderr and blocks until killed, so the test waits on that line
(a signal, not a sleep) and sends SIGKILL. Nothing else of the CLI or the stages is changed.
"""

from __future__ import annotations

import os
import sys
import threading

from specdeploy.core import artifacts

point = sys.argv.pop(1)


def pause(what: str) -> None:
    sys.stderr.write(f"PAUSED {point} {what}\n")
    sys.stderr.flush()
    threading.Event().wait()  # until SIGKILL


if point == "write":
    real_write = artifacts.Manifest.write

    def write(self, directory):
        if ".tmp-" in os.path.basename(str(directory)):
            pause(str(directory))
        return real_write(self, directory)

    artifacts.Manifest.write = write
elif point in ("swap", "checkpoint"):

    def pausing_os(call: str, pause_after):
        """os for one module, whose `call` (rename / replace) pauses once pause_after(src, dst) holds."""

        class _Os:
            def __getattr__(self, name):
                return getattr(os, name)

        def wrapped(src, dst, *args, **kwargs):
            getattr(os, call)(src, dst, *args, **kwargs)
            if pause_after(src, dst):
                pause(str(src if point == "swap" else dst))

        setattr(_Os, call, staticmethod(wrapped))
        return _Os()

    if point == "swap":  # after setting the previous artifact aside (the first rename of the swap)
        artifacts.os = pausing_os("rename", lambda src, dst: ".old-" in os.path.basename(str(dst)))
    else:  # once draft train's resume checkpoint is in place
        from specdeploy.eagle3 import train_loop as draft_train_loop  # where train_head saves the checkpoint

        draft_train_loop.os = pausing_os(
            "replace", lambda src, dst: os.path.basename(str(dst)) == draft_train_loop.RESUME_STATE
        )
elif point != "none":
    raise SystemExit(f"unknown pause point {point!r}")

from specdeploy.cli.main import main  # noqa: E402

main(prog_name="specdeploy")
