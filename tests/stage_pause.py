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

from specdeploy import artifacts

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
elif point == "swap":

    class _Os:  # os for the artifacts module, whose rename pauses after setting the previous artifact aside
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def rename(src, dst, *args, **kwargs):
            os.rename(src, dst, *args, **kwargs)
            if ".old-" in os.path.basename(str(dst)):
                pause(str(src))

    artifacts.os = _Os()
elif point == "checkpoint":
    from specdeploy import draft_train

    class _TrainOs:  # os for draft_train, whose replace pauses once the resume checkpoint is in place
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def replace(src, dst, *args, **kwargs):
            os.replace(src, dst, *args, **kwargs)
            if os.path.basename(str(dst)) == draft_train.RESUME_STATE:
                pause(str(dst))

    draft_train.os = _TrainOs()
elif point != "none":
    raise SystemExit(f"unknown pause point {point!r}")

from specdeploy.cli import main  # noqa: E402

main(prog_name="specdeploy")
