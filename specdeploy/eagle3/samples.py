"""The training data of an EAGLE-3 head, as `specdeploy draft train` reads it: the samples `specdeploy draft data`
wrote (train.jsonl, heldout.jsonl, manifest.json), every line checked against the target's vocabulary."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdeploy.core.errors import SpecDeployError, StaleArtifactError

DATA_COMMAND = "specdeploy draft data RECIPE"
TRAIN_FILE, HELDOUT_FILE = "train.jsonl", "heldout.jsonl"


class DraftTrainError(SpecDeployError):
    """The head cannot be trained from what is on disk (missing or broken training data)."""


@dataclass(frozen=True)
class Sample:
    id: str
    input_ids: tuple[int, ...]
    loss_start: int
    sampled: bool = False


@dataclass(frozen=True)
class DraftData:
    folder: Path
    train: tuple[Sample, ...]
    heldout: tuple[Sample, ...]
    fingerprint: str  # the data manifest's


def read_draft_data(folder: Path, vocab_size: int, rerun: str = DATA_COMMAND) -> DraftData:
    """The training data of `specdeploy draft data`, every line checked (ids inside the target's vocabulary)."""
    from specdeploy.core.artifacts import MANIFEST, Manifest

    folder = Path(folder)
    if not folder.is_dir():
        raise StaleArtifactError(f"no EAGLE-3 training data in {folder}", f"run: {rerun}")
    missing = [name for name in (TRAIN_FILE, HELDOUT_FILE, MANIFEST) if not (folder / name).is_file()]
    if missing:
        raise StaleArtifactError(f"the training data in {folder} lacks {', '.join(missing)}", f"run: {rerun}")
    manifest = Manifest.read(folder)
    if manifest is None:
        raise StaleArtifactError(f"{folder / MANIFEST} is unreadable", f"run: {rerun}")
    train = _read_samples(folder / TRAIN_FILE, vocab_size, rerun)
    heldout = _read_samples(folder / HELDOUT_FILE, vocab_size, rerun)
    if not train:
        raise DraftTrainError(f"{folder / TRAIN_FILE} holds no sample with an answer to train on", f"run: {rerun}")
    return DraftData(folder, train, heldout, manifest.fingerprint)


def _read_samples(path: Path, vocab_size: int, rerun: str) -> tuple[Sample, ...]:
    samples = []
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
                ids = tuple(int(t) for t in row["input_ids"])
                sample = Sample(str(row["id"]), ids, int(row["loss_start"]), bool(row.get("sampled", False)))
            except (ValueError, KeyError, TypeError) as exc:
                raise DraftTrainError(
                    f"{where}: not a training sample ({exc!r}); each line needs id, input_ids, loss_start",
                    f"run: {rerun} --force",
                ) from exc
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise DraftTrainError(
                    f"{where}: token id {bad[0]} is outside the target's vocabulary (0..{vocab_size - 1})",
                    f"the data was made for another tokenizer; run: {rerun} --force",
                )
            if not 0 <= sample.loss_start < len(ids):
                raise DraftTrainError(
                    f"{where}: loss_start {sample.loss_start} is outside its {len(ids)} tokens", f"run: {rerun} --force"
                )
            if len(ids) >= 3:  # a draft needs a context token, the target's token and one to predict
                samples.append(sample)
    return tuple(samples)
