"""The target's side of a head's training step from specdeploy's own CPU engine (draft.train.features: engine).

ModelOpt's EAGLE-3 model runs the target's Hugging Face weights inside every training step (its online mode) or
takes the target's outputs from the caller (its offline mode: `eagle_offline`, the step's `base_model_outputs`
with `aux_hidden_states`, `base_model_hidden_states` and `base_model_logits`; plugins/hf_eagle.py `forward` and
`EagleBaseModelOutput.from_offline_dict`). Here the caller is the recipe's built CPU engine: the quantized target
the head will draft for (its features and its distribution, as served), several times faster than torch runs the
unquantized target (docs/eagle3-train.md "Training further on the CPU"). ModelOpt has no engine of its own on CPU,
so this part is written here; the head's forward, training-time test, loss and export stay ModelOpt's.

`TopKFeatures` reduces a sample to what a training step reads (its aux features and its top-k labels), which
`feature_cache.CachedFeatures` keeps on disk for the epochs after the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# samples' prefills per engine call (forward_batch: each weight read once for all of them), up to this many rows: the
# call's logits stay bounded (2,048 x 49,152 fp32 = 400 MB where the whole vocabulary is asked for)
PREFILL_ROWS = 2048


class EngineFeatures:
    """`features(samples, width)` -> the keyword arguments of one ModelOpt forward: each sample's first `width`
    tokens (at most) run through the engine in a prefill with a fresh cache, its aux layers captured; rows past a
    sample's length are zeros (the loss mask and attention mask never read them).

    The logits stay float32 over the whole vocabulary: the target's greedy token (ModelOpt's
    `base_output_predict_tok`, and the held-out acceptance's reference) is the argmax the engine serves, which bf16
    rounding could tie or move."""

    def __init__(self, engine, aux_ids: list[int], identity: str = ""):
        self.engine = engine
        self.aux_ids = tuple(aux_ids)
        self.identity = identity  # the built engine's fingerprint (part of the head's)
        self.hidden = int(engine.spec.hidden_size)
        self.vocab = int(engine.spec.vocab_size)

    def top_k(self, k: int, draft_ids: list[int] | None) -> "TopKFeatures":
        """The same engine's features with the labels kept as the top `k` of the draft vocabulary (training steps)."""
        return TopKFeatures(self, k, draft_ids)

    @classmethod
    def load(cls, engine_dir: Path, aux_ids: list[int], identity: str = "") -> "EngineFeatures":
        from specdeploy.engine.generate import load_engine

        return cls(load_engine(Path(engine_dir), "target", ""), aux_ids, identity)

    def prefill(self, samples, width: int, lm_rows=None):
        """(aux [n, len(aux_ids) * hidden] in the engine's dtype, logits [n, vocab or len(lm_rows)] fp32) of each
        sample's first n <= width tokens, several samples per engine call; the same bits as one call each (the
        engine's rows do not depend on their neighbours: batch invariance, specdeploy/engine/model.py)."""
        import torch

        lengths = [min(len(s.input_ids), width) for s in samples]
        out = []
        with torch.no_grad():
            for group in _groups(lengths, PREFILL_ROWS):
                caches = [self.engine.new_cache(lengths[i]) for i in group]
                ids = [torch.tensor(samples[i].input_ids[: lengths[i]]) for i in group]
                logits, aux = self.engine.forward_batch(caches, ids, aux_layers=self.aux_ids, lm_rows=lm_rows)
                out += list(zip(aux, logits))
        return out

    def __call__(self, samples, width: int) -> dict:
        import torch

        aux = torch.zeros(len(samples), width, len(self.aux_ids) * self.hidden)
        logits = torch.zeros(len(samples), width, self.vocab)
        for row, (features, out) in enumerate(self.prefill(samples, width)):
            aux[row, : len(out)] = features.float()
            logits[row, : len(out)] = out
        return offline_outputs(aux, logits, self.hidden)


def _groups(lengths: list[int], rows: int) -> list[list[int]]:
    """Consecutive indices cut into groups of at most `rows` rows (a longer sample alone)."""
    groups, current, filled = [], [], 0
    for i, n in enumerate(lengths):
        if current and filled + n > rows:
            groups.append(current)
            current, filled = [], 0
        current.append(i)
        filled += n
    return groups + [current] if current else groups


def offline_outputs(aux, logits, hidden: int) -> dict:
    """ModelOpt's `base_model_outputs` for one batch: aux [rows, width, len * hidden], logits [rows, width, labels]."""
    import torch

    # only its shape is read when the logits are given (ModelOpt recomputes logits from it otherwise)
    hidden_states = torch.zeros(1, 1, hidden).expand(aux.shape[0], aux.shape[1], hidden)
    return {
        "base_model_outputs": {
            "base_model_hidden_states": hidden_states,
            "aux_hidden_states": aux,
            "base_model_logits": logits,
        }
    }


@dataclass
class SampleFeatures:
    """What a training step reads of one sample (n = its tokens, at most seq_len): all that the cache stores."""

    aux: object  # [n, len(aux_ids) * hidden], the engine's dtype (bf16: exact in fp32)
    top_ids: object  # [n, k] int64 draft ids, the target's k likeliest
    top_logits: object  # [n, k] float32, their logits


class TopKFeatures:
    """The training steps' features: the labels are the target's logits over the head's draft vocabulary (ModelOpt's
    `_map_logits_to_draft_vocab`: target id = draft id + d2t), of which the top `k` are kept and the rest set to
    -inf, so ModelOpt's softmax gives the target's distribution renormalized over its k likeliest draft tokens.

    A [rows, width, draft vocabulary] tensor replaces the [rows, width, vocabulary] one (49,152 -> 8,192 columns for
    SmolLM2), and only the k columns carry mass: what the loss drops is the tail past the k-th token
    (tests/test_draft_train.py bounds it). The engine computes the LM head over the draft vocabulary's rows alone
    (`forward_batch(lm_rows=...)`). The model must take the draft-space logits as they are
    (`modelopt_eagle3.accept_draft_space_logits`). The held-out acceptance keeps `EngineFeatures` (the target's
    argmax over the whole vocabulary)."""

    def __init__(self, full: EngineFeatures, k: int, draft_ids: list[int] | None):
        import torch

        self.full, self.k = full, k
        self.draft_ids = torch.tensor(draft_ids if draft_ids is not None else range(full.vocab))
        self.identity = full.identity

    def samples(self, samples, width: int) -> list[SampleFeatures]:
        out = []
        for aux, draft_logits in self.full.prefill(samples, width, lm_rows=self.draft_ids):
            top = draft_logits.topk(min(self.k, draft_logits.shape[-1]), dim=-1)  # over [n, draft vocabulary]
            out.append(SampleFeatures(aux, top.indices, top.values))
        return out

    def assemble(self, features: list[SampleFeatures], width: int) -> dict:
        """The batch's tensors from its samples' features: rows past a sample's end are zeros (finite, so ModelOpt's
        softmax over them stays a number; the loss mask drops them)."""
        import torch

        rows = len(features)
        aux = torch.zeros(rows, width, len(self.full.aux_ids) * self.full.hidden)
        logits = torch.zeros(rows, width, len(self.draft_ids))
        for row, f in enumerate(features):
            n = len(f.aux)
            aux[row, :n] = f.aux.float()
            logits[row, :n] = float("-inf")
            logits[row, :n].scatter_(-1, f.top_ids.long(), f.top_logits)
        return offline_outputs(aux, logits, self.full.hidden)

    def __call__(self, samples, width: int) -> dict:
        return self.assemble(self.samples(samples, width), width)
