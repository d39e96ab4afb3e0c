import pytest

from specdeploy import artifacts
from specdeploy.artifacts import Manifest
from specdeploy.errors import StaleArtifactError


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
    from specdeploy.config import load_recipe

    layout = artifacts.Layout.of(load_recipe("build/smollm2-135m.yaml"), tmp_path)
    assert layout.checkpoint("target") == tmp_path / "engines/smollm2-135m/checkpoints/target"
    assert layout.engine("draft") == tmp_path / "engines/smollm2-135m/draft"
    assert layout.repo == tmp_path / "triton_repo/smollm2-135m"
    assert layout.report == tmp_path / "engines/smollm2-135m/report"


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
