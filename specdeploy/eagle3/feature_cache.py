"""The target's side of each training sample computed once (draft.train.feature_cache): the engine's aux features and
top-k labels (`features.SampleFeatures`) kept on disk on a sample's first use and read back in later epochs and by a
resumed run, so that only the first epoch pays for the engine's prefill.

A folder of flat files mapped into memory, one row per training token (sample i owns rows offsets[i]..offsets[i+1]):
aux.bin [rows, aux width] (the engine's dtype), top_ids.bin [rows, k] int32, top_logits.bin [rows, k] float32, and
done.bin, one byte per sample set once its rows are flushed. The values are the engine's own bits, so a step fed
from the cache is the step fed from the engine (tests/test_draft_train.py -k feature_cache). key.json names what
the rows were made from (the training samples' hash, the engine, the aux layers, the draft vocabulary, k, seq_len):
another key empties the folder. The folder is made under a temporary name and renamed (the files inside are written
in place, sample by sample: a temporary file per step would copy the whole cache); a sample whose flag was not
written after its rows (an interrupted run) is computed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from specdeploy.eagle3.features import SampleFeatures, TopKFeatures

FORMAT = 1
KEY_FILE = "key.json"
FIELDS = ("aux", "top_ids", "top_logits")


def samples_hash(samples, seq_len: int) -> str:
    """The training samples as a step reads them (their first seq_len tokens, in order)."""
    import numpy as np

    h = hashlib.sha256()
    for s in samples:
        ids = np.asarray(s.input_ids[:seq_len], dtype=np.int64)
        h.update(len(ids).to_bytes(8, "little"))
        h.update(ids.tobytes())
    return h.hexdigest()


def cache_bytes(samples, seq_len: int, aux_width: int, k: int, aux_bytes: int = 2) -> int:
    """Disk the cache of these samples takes once every sample was used."""
    rows = sum(min(len(s.input_ids), seq_len) for s in samples)
    return rows * (aux_width * aux_bytes + k * 8) + len(samples)


class FeatureCache:
    """The files of one key; `get(i)` a sample's features (None until `put`), `put(items)` several samples'."""

    def __init__(self, folder: Path, key: dict, lengths: list[int], aux_width: int, k: int, aux_dtype):
        import numpy as np
        import torch

        self.folder = Path(folder)
        self.lengths = lengths
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        rows = int(self.offsets[-1])
        self.aux_dtype = aux_dtype
        numpy_aux = {torch.bfloat16: np.int16, torch.float16: np.float16, torch.float32: np.float32}[aux_dtype]
        shapes = {
            "aux": (numpy_aux, (rows, aux_width)),
            "top_ids": (np.int32, (rows, k)),
            "top_logits": (np.float32, (rows, k)),
            "done": (np.uint8, (len(lengths),)),
        }
        key = {"format": FORMAT, **key, "rows": rows, "aux_width": aux_width, "k": k, "aux_dtype": str(aux_dtype)}
        if _read_key(self.folder) != key:
            self._create(key, shapes)
        self.arrays = {
            name: np.memmap(self.folder / f"{name}.bin", dtype=dtype, mode="r+", shape=shape)
            for name, (dtype, shape) in shapes.items()
        }

    def _create(self, key: dict, shapes: dict) -> None:
        """An empty cache (sparse files: disk is taken as samples are written), replacing any other key's."""
        import numpy as np

        tmp = self.folder.with_name(self.folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name, (dtype, shape) in shapes.items():
            size = int(np.dtype(dtype).itemsize * np.prod(shape))
            with open(tmp / f"{name}.bin", "wb") as fh:
                fh.truncate(size)
        (tmp / KEY_FILE).write_text(json.dumps(key, indent=1) + "\n")
        shutil.rmtree(self.folder, ignore_errors=True)
        os.replace(tmp, self.folder)

    def cached(self, i: int) -> bool:
        return bool(self.arrays["done"][i])

    def get(self, i: int) -> SampleFeatures:
        import torch

        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        aux = torch.from_numpy(self.arrays["aux"][a:b].copy())
        if self.aux_dtype == torch.bfloat16:
            aux = aux.view(torch.bfloat16)
        ids = torch.from_numpy(self.arrays["top_ids"][a:b].astype("int64"))
        return SampleFeatures(aux, ids, torch.from_numpy(self.arrays["top_logits"][a:b].copy()))

    def put(self, items: list[tuple[int, SampleFeatures]]) -> None:
        """The samples' rows, flushed, then their flags, flushed: a flag never stands for rows not on disk."""
        import torch

        for i, f in items:
            a, b = int(self.offsets[i]), int(self.offsets[i + 1])
            assert len(f.aux) == b - a, (i, len(f.aux), b - a)
            aux = f.aux.contiguous()
            self.arrays["aux"][a:b] = (aux.view(torch.int16) if aux.dtype == torch.bfloat16 else aux).numpy()
            self.arrays["top_ids"][a:b] = f.top_ids.numpy()
            self.arrays["top_logits"][a:b] = f.top_logits.numpy()
        for name in FIELDS:
            self.arrays[name].flush()
        for i, _ in items:
            self.arrays["done"][i] = 1
        self.arrays["done"].flush()


def _read_key(folder: Path) -> dict | None:
    try:
        return json.loads((folder / KEY_FILE).read_text())
    except (OSError, ValueError):
        return None


class CachedFeatures:
    """`TopKFeatures` with each training sample's features computed once: `features(samples, width)` reads the
    cached samples and computes the others together (one engine call for the batch), storing them. Samples are
    found by their content (the training set's, as `train_head` passes them); another sample is computed each
    time. `width` must be at least each sample's length in the cache (seq_len: make_batch never cuts below it)."""

    def __init__(self, top_k: TopKFeatures, folder: Path, train_samples, seq_len: int, extra_key: dict):
        self.top_k, self.seq_len = top_k, seq_len
        self.identity = top_k.identity
        self.slots: dict = {}
        for i, s in enumerate(train_samples):
            self.slots.setdefault(s, i)
        engine = top_k.full.engine
        key = {
            "samples": samples_hash(train_samples, seq_len),
            "seq_len": seq_len,
            "engine": top_k.identity,
            "aux_layers": list(top_k.full.aux_ids),
            "draft_ids": hashlib.sha256(top_k.draft_ids.numpy().tobytes()).hexdigest(),
            **extra_key,
        }
        lengths = [min(len(s.input_ids), seq_len) for s in train_samples]
        self.cache = FeatureCache(
            folder, key, lengths, len(top_k.full.aux_ids) * top_k.full.hidden, top_k.k, engine.dtype
        )
        self.computed = 0  # samples the engine prefilled (the rest came from the cache)

    def __call__(self, samples, width: int) -> dict:
        slots = [self.slots.get(s) for s in samples]
        missing = [j for j, slot in enumerate(slots) if slot is None or not self.cache.cached(slot)]
        fresh = dict(zip(missing, self.top_k.samples([samples[j] for j in missing], self.seq_len)))
        self.computed += len(missing)
        self.cache.put([(slots[j], f) for j, f in fresh.items() if slots[j] is not None])
        features = [fresh[j] if j in fresh else self.cache.get(slots[j]) for j in range(len(samples))]
        return self.top_k.assemble(features, width)
