"""ModelOpt's EAGLE-3 loss against one that reads only the k label columns (issue 57 item 4): the same value, and the
CPU time of each, forward and backward, on one training-time-test step's tensors.

With `draft.train.label_top_k` the labels are the target's distribution renormalized over its k likeliest draft
tokens (zero elsewhere), so ModelOpt's soft cross-entropy -sum_i p_i log_softmax(z)_i (plugins/hf_eagle.py
`_eagle_loss`) equals logsumexp(z) * sum_k p - sum_k p_i z_i. `TopKCrossEntropy` computes that form: a logsumexp and
a gather forward; backward exp(z - lse) scaled, with -p scattered into its k columns. The arms take turns; the
first call of each is a warm-up. Both run under bf16 autocast, as a training step does: ModelOpt's log-softmax of
the bf16 logits is bf16 there, the k-column form computes in fp32, so the two agree to bf16's precision.

    .venv/bin/python bench/eagle3_topk_loss.py [--batch 16 --positions 350 --vocab 8192 --k 64 --repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


class TopKCrossEntropy(torch.autograd.Function):
    """sum over positions of weight * (logsumexp(z) * sum p - sum_k p_i z_ids_i): z [B, S, V] logits (any float
    dtype), ids / p [B, S, k] the label columns and their probabilities, weight [B, S] (the loss mask over its
    count)."""

    @staticmethod
    def forward(ctx, z, ids, p, weight):
        zf = z.float()
        lse = torch.logsumexp(zf, 2)
        per = lse * p.sum(2) - (p * zf.gather(2, ids)).sum(2)
        ctx.save_for_backward(z, ids, p, weight, lse)
        return (per * weight).sum()

    @staticmethod
    def backward(ctx, g):
        z, ids, p, weight, lse = ctx.saved_tensors
        w = (g * weight).unsqueeze(2)
        grad = torch.exp(z.float() - lse.unsqueeze(2)).mul_(w * p.sum(2, keepdim=True))
        grad.scatter_add_(2, ids, -(w * p))
        return grad.to(z.dtype), None, None, None


def modelopt_loss(probs, z, mask):
    """ModelOpt 0.47's `_eagle_loss` classification term (hf_eagle.py:852-866), mask [B, S, 1]."""
    return -torch.sum(torch.sum(mask * probs * torch.log_softmax(z, dim=2), 2)) / (mask.sum() + 1e-5)


def columns_loss(ids, p, z, mask):
    m = mask[:, :, 0]
    return TopKCrossEntropy.apply(z, ids, p, m / (m.sum() + 1e-5))


def tensors(batch: int, positions: int, vocab: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(batch, positions, vocab, generator=g).to(torch.bfloat16).requires_grad_(True)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(batch * positions)])
    ids = ids.view(batch, positions, k)
    labels = torch.full((batch, positions, vocab), float("-inf"))
    labels.scatter_(2, ids, torch.randn(batch, positions, k, generator=g) * 3)
    probs = torch.softmax(labels, 2)  # as ModelOpt's base_output_softmax_logits
    mask = (torch.rand(batch, positions, 1, generator=g) < 0.8).float()
    top_p, top_ids = probs.topk(k, dim=2)
    return z, probs, top_ids, top_p, mask


def compare(batch: int, positions: int, vocab: int, k: int, repeats: int) -> dict:
    z, probs, ids, p, mask = tensors(batch, positions, vocab, k)
    arms = {"modelopt": lambda: modelopt_loss(probs, z, mask), "k columns": lambda: columns_loss(ids, p, z, mask)}
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    values, grads = {}, {}
    for rep in range(repeats + 1):
        for name in list(arms) if rep % 2 == 0 else list(arms)[::-1]:
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):  # as a training step (draft.train.precision auto)
                loss = arms[name]()
            loss.backward()
            if rep:  # the first call of each arm warms up
                seconds[name].append(time.perf_counter() - t0)
            values[name], grads[name] = float(loss.detach()), z.grad.float()
            z.grad = None
    a, b = grads["modelopt"], grads["k columns"]
    return {
        "shape": [batch, positions, vocab, k],
        "seconds": {name: statistics.median(v) for name, v in seconds.items()},
        "loss": values,
        "loss_rel_diff": abs(values["modelopt"] - values["k columns"]) / abs(values["modelopt"]),
        "grad_max_diff": float((a - b).abs().max()),
        "grad_max": float(a.abs().max()),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--positions", type=int, default=350)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    r = compare(args.batch, args.positions, args.vocab, args.k, args.repeats)
    s = r["seconds"]
    print(
        f"[B, S, V, k] = {r['shape']}, {args.threads} threads, medians of {args.repeats}, forward + backward: "
        f"ModelOpt's {s['modelopt']:.3f} s, k columns {s['k columns']:.3f} s "
        f"({s['modelopt'] / s['k columns']:.2f}x); loss {r['loss']['modelopt']:.6f} against "
        f"{r['loss']['k columns']:.6f}, gradients within {r['grad_max_diff']:.1e} (largest {r['grad_max']:.1e})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
