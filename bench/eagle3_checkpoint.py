"""Held-out acceptance of a head run's checkpoint beside the head it started from, mid-run.

`specdeploy draft train` measures its held-out acceptance at each epoch end; a run over several sittings (make
head-tune: one epoch, ~7 h on 2 cores) says nothing in between. This reads the run's resume checkpoint
(engines/<recipe>/eagle3-head.partial/resume.pt) and measures, with the recipe's own measure
(draft_train_loop.heldout_acceptance: greedy chains of ttt_steps drafts against the target's tokens, the target's side
as the recipe trains it), the checkpoint's head and the head the run started from (draft.train.init_head, else none)
on the first --count held-out samples of the recipe's data: the same positions for both, never trained on.

    .venv/bin/python bench/eagle3_checkpoint.py [--recipe build/smollm2-135m-eagle3-tune.yaml] [--count 200]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def measure(recipe, layout, count: int, echo=print) -> dict:
    """{"start": ..., "checkpoint": ...} acceptance rows (start only with draft.train.init_head) and the step."""
    import torch

    from specdeploy.core import model_store as models
    from specdeploy.eagle3 import train as draft_train
    from specdeploy.eagle3.modelopt import aux_layer_ids, build_model, choose_draft_vocab, load_exported_head
    from specdeploy.eagle3.samples import read_draft_data
    from specdeploy.eagle3.train_loop import RESUME_STATE, heldout_acceptance

    t = recipe.draft.train
    target_dir = models.resolve(recipe.target.model)
    target_config = json.loads((target_dir / "config.json").read_text())
    data = read_draft_data(layout.train_data(recipe.draft.train.data_dir), target_config["vocab_size"])
    state_path = draft_train.resume_dir(layout.eagle3_head) / RESUME_STATE
    if not state_path.is_file():
        raise SystemExit(f"no checkpoint at {state_path}: start the run first (specdeploy draft train RECIPE)")
    state = torch.load(state_path, map_location="cpu", weights_only=False)
    aux = aux_layer_ids(target_config, t)
    features = draft_train.engine_features(recipe, layout, aux) if t.features == "engine" else None
    model = build_model(
        target_dir,
        t,
        choose_draft_vocab(data.train, target_config["vocab_size"], t.draft_vocab_size),
        aux,
        offline=features is not None,
    )
    pad = draft_train.pad_id_of(target_config)
    samples = list(data.heldout)[:count]
    rows = {}
    init = draft_train.init_head_folder(recipe, layout, aux)
    if init is not None:
        load_exported_head(model, init)
        rows["start"] = heldout_acceptance(model, samples, t.ttt_steps, t.seq_len, t.batch_size, pad, "cpu", features)
        echo(f"start ({init}): {rows['start'].line()}")
    model.eagle_module.load_state_dict(state["head"])
    rows["checkpoint"] = heldout_acceptance(model, samples, t.ttt_steps, t.seq_len, t.batch_size, pad, "cpu", features)
    echo(f"checkpoint (step {state['step']} of {state['total_steps']}): {rows['checkpoint'].line()}")
    return {
        "recipe": recipe.name,
        "samples": len(samples),
        "step": state["step"],
        "total_steps": state["total_steps"],
        **{
            k: {"per_position": v.per_position, "mean_accepted": v.mean_accepted, "positions": v.positions}
            for k, v in rows.items()
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="build/smollm2-135m-eagle3-tune.yaml")
    p.add_argument("--count", type=int, default=200, help="held-out samples measured (the first N of heldout.jsonl)")
    p.add_argument("--root", default=None, help="specdeploy --root of the run (default: the project)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from specdeploy.core.artifacts import Layout
    from specdeploy.recipe.load import load_recipe

    recipe = load_recipe(a.recipe)
    result = measure(recipe, Layout.of(recipe, a.root), a.count)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
