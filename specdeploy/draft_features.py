"""The target's side of a head's training step from specdeploy's own CPU engine (draft.train.features: engine).

ModelOpt's EAGLE-3 model runs the target's Hugging Face weights inside every training step (its online mode) or
takes the target's outputs from the caller (its offline mode: `eagle_offline`, the step's `base_model_outputs`
with `aux_hidden_states`, `base_model_hidden_states` and `base_model_logits`; plugins/hf_eagle.py `forward` and
`EagleBaseModelOutput.from_offline_dict`). Here the caller is the recipe's built CPU engine: the quantized target
the head will draft for (its features and its distribution, as served), at ~700 tokens/s on 2 cores where torch
runs the unquantized target at ~200-400 (docs/eagle3-train.md). ModelOpt has no engine of its own on CPU, so this
part is written here; the head's forward, training-time test, loss and export stay ModelOpt's.
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

    @classmethod
    def load(cls, engine_dir: Path, aux_ids: list[int], identity: str = "") -> "EngineFeatures":
        from specdeploy.generate import load_engine

        return cls(load_engine(Path(engine_dir), "target", ""), aux_ids, identity)

    def __call__(self, samples, width: int) -> dict:
        import torch

        rows = len(samples)
        aux = torch.zeros(rows, width, len(self.aux_ids) * self.hidden)
        logits = torch.zeros(rows, width, self.vocab)
        with torch.no_grad():
            for row, sample in enumerate(samples):
                n = min(len(sample.input_ids), width)
                cache = self.engine.new_cache(n)
                out, features = self.engine.forward(cache, torch.tensor(sample.input_ids[:n]), aux_layers=self.aux_ids)
                aux[row, :n] = features.float()
                logits[row, :n] = out.float()
        # only its shape is read when the logits are given (ModelOpt recomputes logits from it otherwise)
        hidden = torch.zeros(1, 1, self.hidden).expand(rows, width, self.hidden)
        return {"base_model_outputs": {"base_model_hidden_states": hidden, "aux_hidden_states": aux,
                                       "base_model_logits": logits}}  # fmt: skip
