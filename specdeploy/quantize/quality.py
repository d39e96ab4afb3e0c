"""The quality report of the quantize stage: perplexity, top-1 agreement and KL of the fake-quantized model against
its unquantized source on held-out text, and the table the stage prints.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from specdeploy.recipe.config import QuantConfig


@dataclass(frozen=True)
class QualityReport:
    """How far the quantized model (ModelOpt's fake-quantized simulation in torch) is from its source."""

    qformat: str
    kv_cache_dtype: str | None
    num_sequences: int
    num_tokens: int  # predicted positions
    source_perplexity: float
    quantized_perplexity: float
    top1_agreement: float  # fraction of positions where both models pick the same next token
    mean_kl: float  # mean over positions of KL(source || quantized), in nats

    def as_dict(self) -> dict:
        return asdict(self)

    def table(self, title: str = "") -> str:
        label = self.qformat + (f" + {self.kv_cache_dtype} KV" if self.kv_cache_dtype else "")
        rows = [
            ("perplexity (source)", f"{self.source_perplexity:.3f}"),
            (f"perplexity ({label})", f"{self.quantized_perplexity:.3f}"),
            ("top-1 agreement", f"{100 * self.top1_agreement:.2f} %"),
            ("mean KL(source||quant)", f"{self.mean_kl:.5f} nats"),
            ("held-out text", f"{self.num_sequences} passages, {self.num_tokens} tokens"),
        ]
        width = max(len(r[0]) for r in rows)
        head = [f"quality{' of ' + title if title else ''} vs unquantized source:"]
        return "\n".join(head + [f"  {name:<{width}}  {value}" for name, value in rows])


def evaluate_quality(
    source_model, quant_model, token_lists, quant: QuantConfig, progress=True, num_passages=None
) -> QualityReport:
    """Perplexity of both models, top-1 agreement and mean KL on held-out token rows (one forward each)."""
    import torch
    import torch.nn.functional as F
    from tqdm.auto import tqdm

    nll_source = nll_quant = kl_sum = 0.0
    agree = count = 0
    with torch.inference_mode():
        for ids in tqdm(token_lists, desc="quality", disable=not progress, leave=False):
            input_ids = torch.tensor([ids], dtype=torch.long)  # [1, T]
            targets = input_ids[0, 1:]  # [T-1]
            logp_source = F.log_softmax(source_model(input_ids).logits[0, :-1].float(), dim=-1)  # [T-1, vocab]
            if quant_model is source_model:
                logp_quant = logp_source
            else:
                logp_quant = F.log_softmax(quant_model(input_ids).logits[0, :-1].float(), dim=-1)
            nll_source -= logp_source.gather(1, targets[:, None]).sum().item()
            nll_quant -= logp_quant.gather(1, targets[:, None]).sum().item()
            kl_sum += (logp_source.exp() * (logp_source - logp_quant)).sum().item()
            agree += (logp_source.argmax(-1) == logp_quant.argmax(-1)).sum().item()
            count += targets.numel()
    return QualityReport(
        qformat=quant.qformat,
        kv_cache_dtype=quant.kv_cache_dtype,
        num_sequences=num_passages or len(token_lists),
        num_tokens=count,
        source_perplexity=math.exp(nll_source / count),
        quantized_perplexity=math.exp(nll_quant / count),
        top1_agreement=agree / count,
        mean_kl=max(kl_sum / count, 0.0),
    )
