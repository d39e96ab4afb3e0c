from pathlib import Path

import pytest

from specdeploy.core import artifacts
from specdeploy.core.artifacts import Manifest
from specdeploy.core.errors import StaleArtifactError


def write_artifact(dest, content, fp="fp1", fail=False):
    with artifacts.atomic_output(dest) as tmp:
        (tmp / "weights.bin").write_text(content)
        if fail:
            raise RuntimeError("interrupted half way")
        Manifest(stage="quantize", recipe_name="r", fingerprint=fp).write(tmp)


def test_atomic_output_replaces_only_on_success(tmp_path):
    dest = tmp_path / "ckpt"
    write_artifact(dest, "good")
    with pytest.raises(RuntimeError):
        write_artifact(dest, "half-written", fail=True)
    assert (dest / "weights.bin").read_text() == "good"
    assert Manifest.read(dest).fingerprint == "fp1"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], "temporary folders must be cleaned up"
    write_artifact(dest, "better", fp="fp2")
    assert (dest / "weights.bin").read_text() == "better"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_interrupt_keeps_previous(tmp_path):
    dest = tmp_path / "ckpt"
    write_artifact(dest, "good")
    with pytest.raises(KeyboardInterrupt):
        with artifacts.atomic_output(dest) as tmp:
            (tmp / "weights.bin").write_text("partial")
            raise KeyboardInterrupt
    assert (dest / "weights.bin").read_text() == "good"


def test_up_to_date_and_stale_detection(tmp_path):
    dest = tmp_path / "ckpt"
    assert not artifacts.is_up_to_date(dest, "fp1")
    write_artifact(dest, "good", fp="fp1")
    assert artifacts.is_up_to_date(dest, "fp1")
    assert not artifacts.is_up_to_date(dest, "fp2")
    assert artifacts.require(dest, "quantize", "specdeploy quantize R", "fp1").stage == "quantize"
    with pytest.raises(StaleArtifactError) as err:
        artifacts.require(dest, "quantize", "specdeploy quantize R", "fp2")
    assert err.value.hint == "run: specdeploy quantize R"
    with pytest.raises(StaleArtifactError, match="expected 'build'"):
        artifacts.require(dest, "build", "specdeploy build R")
    with pytest.raises(StaleArtifactError, match="no quantize output"):
        artifacts.require(tmp_path / "nothing", "quantize", "specdeploy quantize R")


def test_corrupt_manifest_reads_as_missing(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    assert Manifest.read(tmp_path) is None


def test_fingerprint_and_dir_hash(tmp_path):
    assert artifacts.fingerprint(a=1, b=[1, 2]) == artifacts.fingerprint(b=[1, 2], a=1)
    assert artifacts.fingerprint(a=1) != artifacts.fingerprint(a=2)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    h1 = artifacts.dir_hash(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"abd")
    assert artifacts.dir_hash(tmp_path) != h1


def test_layout_paths(tmp_path):
    from specdeploy.recipe.load import load_recipe

    layout = artifacts.Layout.of(load_recipe("build/smollm2-135m.yaml"), tmp_path)
    assert layout.checkpoint("target") == tmp_path / "engines/smollm2-135m/checkpoints/target"
    assert layout.engine("draft") == tmp_path / "engines/smollm2-135m/draft"
    assert layout.repo == tmp_path / "triton_repo/smollm2-135m"
    assert layout.report == tmp_path / "engines/smollm2-135m/report"


def test_eagle3_head_source_is_trained_bundled_or_a_path(tmp_path, monkeypatch):
    from specdeploy.recipe.load import load_recipe

    layout = artifacts.Layout.of(load_recipe("build/smollm2-135m.yaml"), tmp_path)
    assert layout.eagle3_head_source("trained") == layout.eagle3_head == tmp_path / "engines/smollm2-135m/eagle3-head"
    bundled = tmp_path / "heads"
    (bundled / "tiny-eagle3").mkdir(parents=True)
    (bundled / "tiny-eagle3" / "config.json").write_text("{}")
    monkeypatch.setattr(artifacts, "BUNDLED_HEADS", bundled)
    assert layout.eagle3_head_source("tiny-eagle3") == bundled / "tiny-eagle3"
    # a name with no bundled head, or a path, is the path itself
    assert layout.eagle3_head_source("other-head") == Path("other-head")
    assert layout.eagle3_head_source("./tiny-eagle3") == Path("./tiny-eagle3")
    assert layout.eagle3_head_source("~/h") == Path.home() / "h"


def test_leftovers_of_a_killed_process_are_removed(tmp_path):
    dest = tmp_path / "ckpt"
    write_artifact(dest, "good")
    orphan = tmp_path / ".ckpt.tmp-999999999-123"  # a pid that cannot be alive
    orphan.mkdir()
    mine = tmp_path / f".ckpt.tmp-{__import__('os').getpid()}-456"  # a live writer's folder stays
    mine.mkdir()
    write_artifact(dest, "better")
    assert not orphan.exists()
    assert mine.exists()
    assert (dest / "weights.bin").read_text() == "better"


# ---------------------------------------------------------------- SIGKILL at every step of the swap

KILLED_WRITER = r"""
import os, signal, sys
from pathlib import Path
from specdeploy.core import artifacts

dest, point, content = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
real_rename, real_unlink = os.rename, os.unlink
unlinked = []

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def rename(src, dst, *args, **kwargs):
    real_rename(src, dst, *args, **kwargs)
    src, dst = os.path.basename(src), os.path.basename(dst)
    if (point == "set_aside" and ".old-" in dst) or (point == "published" and ".tmp-" in src) \
            or (point == "trashed" and ".trash-" in dst) or (point == "restored" and ".old-" in src):
        die()

def unlink(path, *args, **kwargs):
    real_unlink(path, *args, **kwargs)
    unlinked.append(path)
    if point == "rmtree" and len(unlinked) == 2:  # half way through deleting the previous artifact
        die()

os.rename, os.unlink = rename, unlink
with artifacts.atomic_output(dest) as tmp:
    for i in range(4):
        (tmp / f"part{i}.bin").write_text(content)
    artifacts.Manifest(stage="quantize", recipe_name="r", fingerprint=content).write(tmp)
    if point == "body":
        die()
sys.exit(3)  # the kill point was never reached
"""


def write_parts(dest, content):
    with artifacts.atomic_output(dest) as tmp:
        for i in range(4):
            (tmp / f"part{i}.bin").write_text(content)
        Manifest(stage="quantize", recipe_name="r", fingerprint=content).write(tmp)


def killed_writer(dest, point, content):
    import signal
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, str(dest), point, content], capture_output=True, text=True
    )
    assert proc.returncode == -signal.SIGKILL, (
        f"the writer was not killed at {point}: rc {proc.returncode}\n{proc.stderr}"
    )


def assert_intact(dest, content):
    assert Manifest.read(dest).fingerprint == content  # first: a reader is what puts a set-aside artifact back
    assert sorted(p.name for p in dest.iterdir()) == [
        "manifest.json",
        "part0.bin",
        "part1.bin",
        "part2.bin",
        "part3.bin",
    ]
    assert {(dest / f"part{i}.bin").read_text() for i in range(4)} == {content}


@pytest.mark.parametrize(
    "point, survivor, on_disk_before_recovery",
    [
        ("body", "v1", {"ckpt", ".ckpt.tmp"}),
        ("set_aside", "v1", {".ckpt.old", ".ckpt.tmp"}),  # between the two renames: no ckpt at all
        ("published", "v2", {"ckpt", ".ckpt.old"}),
        ("trashed", "v2", {"ckpt", ".ckpt.trash"}),
        ("rmtree", "v2", {"ckpt", ".ckpt.trash"}),
    ],
)
@pytest.mark.parametrize("next_user", ["reader", "writer"])
def test_sigkill_at_any_step_keeps_a_complete_artifact(tmp_path, point, survivor, on_disk_before_recovery, next_user):
    dest = tmp_path / "ckpt"
    write_parts(dest, "v1")
    killed_writer(dest, point, "v2")
    assert {p.name.split("-")[0] for p in tmp_path.iterdir()} == on_disk_before_recovery
    if next_user == "reader":  # e.g. the next stage checking its input: Manifest.read puts it back
        assert_intact(dest, survivor)
        assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], "a dead writer's folders must be removed"
    else:  # the next run of the same stage: it starts from the previous artifact, then replaces it
        with artifacts.atomic_output(dest) as tmp:
            assert_intact(dest, survivor)
            (tmp / "new").write_text("v3")
        assert (dest / "new").read_text() == "v3"
        assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_sigkill_twice_in_a_row_and_during_recovery(tmp_path):
    dest = tmp_path / "ckpt"
    write_parts(dest, "v1")
    killed_writer(dest, "set_aside", "v2")
    killed_writer(dest, "set_aside", "v3")  # recovers v1 on entry, then is killed between its own renames
    assert not dest.exists()
    killed_writer(dest, "restored", "v4")  # killed right after putting v1 back
    assert_intact(dest, "v1")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_a_reused_pid_does_not_keep_a_dead_writers_folder(tmp_path):
    import os

    dest = tmp_path / "ckpt"
    write_parts(dest, "v1")
    me = artifacts.process_identity(os.getpid())
    assert me is not None and me.start_ticks, "this platform reports process start times"
    (dest).rename(tmp_path / f".ckpt.old-{os.getpid()}-{me.start_ticks - 1}-1")  # our pid, another start time
    assert_intact(dest, "v1")


def test_a_live_writers_set_aside_artifact_is_left_alone(tmp_path):
    import os

    dest = tmp_path / "ckpt"
    write_parts(dest, "v1")
    held = tmp_path / f".ckpt.old-{os.getpid()}-{artifacts.process_identity(os.getpid()).start_ticks}-1"
    dest.rename(held)  # as if this (live) process were between its two renames
    assert Manifest.read(dest) is None
    assert held.exists()
