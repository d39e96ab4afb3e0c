"""The python backend's shared-memory regions do not outlive their server (specdeploy.triton.shm): each server
names its own, stopping it removes them, and a start removes those of servers that no process runs."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_models import SERVER_READY_TIMEOUT_S

from specdeploy.triton import ports, server, shm

ECHO_MODEL = """
import os, sys
sys.path[:0] = [p for p in os.environ.get("SPECDEPLOY_SITE", "").split(os.pathsep) if p]
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
                for r in requests]
"""
ECHO_CONFIG = """
backend: "python"
max_batch_size: 0
input [{ name: "IN", data_type: TYPE_INT32, dims: [-1] }]
output [{ name: "OUT", data_type: TYPE_INT32, dims: [-1] }]
instance_group [{ count: 2, kind: KIND_CPU }]
"""


def echo_repo(root: Path) -> Path:
    (root / "repo" / "echo" / "1").mkdir(parents=True)
    (root / "repo" / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (root / "repo" / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    return root / "repo"


def regions(prefix: str) -> list[Path]:
    return sorted(shm.SHM_DIR.glob(prefix + "*"))


@pytest.mark.server
@pytest.mark.parametrize("how", ["stop", "sigkill"])
def test_a_servers_regions_are_removed_when_it_stops(tmp_path, how):
    """Stopped cleanly, or killed with its stubs (the case that leaked them before): nothing stays in /dev/shm."""
    running = server.start(echo_repo(tmp_path), ports.Ports.pick(), tmp_path / "tritonserver.log")
    with running:
        server.wait_ready(running, SERVER_READY_TIMEOUT_S)
        [prefix] = shm.prefixes_in(running.process.args)
        assert len(regions(prefix)) >= 2, "one region per python model instance, named with this server's prefix"
        if how == "sigkill":  # what a crashed run leaves: the server and its stubs gone, their regions not
            import os

            os.killpg(running.process.pid, signal.SIGKILL)
            running.process.wait(timeout=10)
            deadline = time.monotonic() + 60
            while set(regions(prefix)) - set(shm.unused(min_age_s=0)):  # until no stub names the prefix any more
                assert time.monotonic() < deadline, "the killed server's stubs did not die"
                time.sleep(0.05)
            assert regions(prefix), "a killed server's regions stay behind (else this test proves nothing)"
    assert regions(prefix) == []


def test_orphaned_regions_are_removed_and_live_ones_kept(tmp_path):
    dead, live = shm.new_prefix(), shm.new_prefix()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", shm.backend_arg(live)])
    try:
        for prefix in (dead, live):
            (tmp_path / f"{prefix}0123-abcd").write_bytes(b"x")
        (tmp_path / "triton_python_backend_shm_region_0123").write_bytes(b"x")  # another Triton's: not ours to judge
        assert shm.remove_orphaned(tmp_path) == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [f"{live}0123-abcd", "triton_python_backend_shm_region_0123"]
        )
    finally:
        holder.kill()
        holder.wait()
    assert shm.remove_orphaned(tmp_path) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["triton_python_backend_shm_region_0123"]


def test_only_this_projects_prefixes_are_read_or_removed(tmp_path):
    prefix = shm.new_prefix()
    cmdline = ["tritonserver", shm.backend_arg(prefix), "--backend-config=python,shm-region-prefix-name=prefix0_"]
    assert shm.prefixes_in(cmdline) == [prefix]
    (tmp_path / "prefix0_abc").write_bytes(b"x")
    assert shm.remove("prefix0_", tmp_path) == 0 and (tmp_path / "prefix0_abc").exists()


def test_doctor_reports_unused_regions_and_cleans_them(tmp_path, monkeypatch):
    """Any Triton's regions count (the default prefix too) once no process names them and they are a minute old."""
    import os

    from click.testing import CliRunner

    from specdeploy.cli.main import main

    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    unused, young = tmp_path / f"{shm.TRITON_DEFAULT}dead", tmp_path / f"{shm.TRITON_DEFAULT}young"
    for path in (unused, young):
        path.write_bytes(b"x" * 8192)
    os.utime(unused, (time.time() - 3600, time.time() - 3600))
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"{shm.TRITON_DEFAULT}held"])
    try:
        held = tmp_path / f"{shm.TRITON_DEFAULT}held"
        held.write_bytes(b"x")
        os.utime(held, (time.time() - 3600, time.time() - 3600))
        report = CliRunner().invoke(main, ["doctor"])
        assert report.exit_code == 0
        assert "1 Triton python-backend regions" in report.output and "doctor --clean-shm" in report.output
        cleaned = CliRunner().invoke(main, ["doctor", "--clean-shm"])
        assert cleaned.exit_code == 0 and "removed 1 unused" in cleaned.output
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([young.name, held.name])
        assert "ok  shared memory" in cleaned.output
    finally:
        holder.kill()
        holder.wait()
