"""The target's side of a head's training step from specdeploy's own CPU engine (draft.train.features: engine).

ModelOpt's EAGLE-3 model runs the target's Hugging Face weights inside every training step (its online mode) or
takes the target's outputs from the caller (its offline mode: `eagle_offline`, the step's `base_model_outputs`
with `aux_hidden_states`, `base_model_hidden_states` and `base_model_logits`; plugins/hf_eagle.py `forward` and
`EagleBaseModelOutput.from_offline_dict`). Here the caller is the recipe's built CPU engine: the quantized target
the head will draft for (its features and its distribution, as served), several times faster than torch runs the
unquantized target (docs/eagle3-train.md "Training further on the CPU"). ModelOpt has no engine of its own on CPU,
so this part is written here; the head's forward, training-time test, loss and export stay ModelOpt's.
"""

from __future__ import annotations

from pathlib import Path


class EngineFeatures:
    """`features(samples, width)` -> the keyword arguments of one ModelOpt forward: each sample's first `width`
    tokens (at most) run through the engine in one prefill with a fresh cache, its aux layers captured; rows past a
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

    def __call__(self, samples, width: int) -> dict:
        return self.outputs(samples, width, lambda out: out.float(), self.vocab)

    def outputs(self, samples, width: int, labels, label_width: int) -> dict:
        """ModelOpt's `base_model_outputs` for one batch; `labels(logits [n, vocab]) -> [n, label_width]` turns each
        row's logits into what is passed as base_model_logits."""
        import torch

        rows = len(samples)
        aux = torch.zeros(rows, width, len(self.aux_ids) * self.hidden)
        logits = torch.zeros(rows, width, label_width)
        with torch.no_grad():
            for row, sample in enumerate(samples):
                n = min(len(sample.input_ids), width)
                cache = self.engine.new_cache(n)
                out, features = self.engine.forward(cache, torch.tensor(sample.input_ids[:n]), aux_layers=self.aux_ids)
                aux[row, :n] = features.float()
                logits[row, :n] = labels(out)
        # only its shape is read when the logits are given (ModelOpt recomputes logits from it otherwise)
        hidden = torch.zeros(1, 1, self.hidden).expand(rows, width, self.hidden)
        return {
            "base_model_outputs": {
                "base_model_hidden_states": hidden,
                "aux_hidden_states": aux,
                "base_model_logits": logits,
            }
        }


class TopKFeatures:
    """The training steps' features: the labels are the target's logits over the head's draft vocabulary (ModelOpt's
    `_map_logits_to_draft_vocab`: target id = draft id + d2t), of which the top `k` are kept and the rest set to
    -inf, so ModelOpt's softmax gives the target's distribution renormalized over its k likeliest draft tokens.

    A [rows, width, draft vocabulary] tensor replaces the [rows, width, vocabulary] one (49,152 -> 8,192 columns for
    SmolLM2), and only the k columns carry mass: what the loss drops is the tail past the k-th token
    (tests/test_draft_train.py bounds it). The model must take the draft-space logits as they are
    (`modelopt_eagle3.accept_draft_space_logits`). The held-out acceptance keeps `EngineFeatures` (the target's
    argmax over the whole vocabulary)."""

    def __init__(self, full: EngineFeatures, k: int, draft_ids: list[int] | None):
        import torch

        self.full, self.k = full, k
        self.draft_ids = torch.tensor(draft_ids if draft_ids is not None else range(full.vocab))
        self.identity = full.identity

    def labels(self, logits):
        import torch

        draft = logits.float().index_select(-1, self.draft_ids)  # [n, draft vocabulary]
        top = draft.topk(min(self.k, draft.shape[-1]), dim=-1)
        return torch.full_like(draft, float("-inf")).scatter_(-1, top.indices, top.values)

    def __call__(self, samples, width: int) -> dict:
        return self.full.outputs(samples, width, self.labels, len(self.draft_ids))
