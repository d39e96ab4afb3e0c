"""bench/eagle3_topk_loss.py: the loss over the k label columns is ModelOpt's loss on top-k labels, value and
gradient, so its timing compares the same computation (docs/eagle3-train.md "Training throughput")."""

from __future__ import annotations

import bench_modules


def test_the_k_column_loss_equals_modelopts_on_top_k_labels_and_a_wrong_column_moves_it():
    bench = bench_modules.load("eagle3_topk_loss")
    r = bench.compare(batch=2, positions=9, vocab=64, k=5, repeats=1)
    # ModelOpt's log-softmax of bf16 logits is bf16 (2^-8 relative); the k-column form is fp32
    assert r["loss_rel_diff"] < 4e-3 and r["grad_max_diff"] < 1e-2 * r["grad_max"], r
    assert all(t > 0 for t in r["seconds"].values())
    z, probs, ids, p, mask = bench.tensors(2, 9, 64, 5)
    shifted = bench.columns_loss((ids + 1) % 64, p, z, mask)  # the labels read from the next column
    assert abs(float(shifted) - float(bench.modelopt_loss(probs, z, mask))) > 1e-3
