"""Per-request sampling parameters with TensorRT-LLM's meaning, shared by the loops, the client and the front."""

from __future__ import annotations

from dataclasses import dataclass

from specdeploy.core.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, with TensorRT-LLM's meaning (see `is_greedy`).

    top_k = 0 and top_p = 0 mean "not set". seed None means "draw one".
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0 or self.temperature == float("inf"):  # NaN fails >=; NaN logits break sampling
            raise ConfigError(f"temperature is {self.temperature}, must be a finite number >= 0")
        if self.top_k < 0:
            raise ConfigError(f"top_k is {self.top_k}, must be >= 0 (0 = not set)")
        if not 0.0 <= self.top_p <= 1.0:
            raise ConfigError(f"top_p is {self.top_p}, must be in [0, 1] (0 = not set)")


GREEDY = SamplingParams()


def is_greedy(params: SamplingParams) -> bool:
    """True when a request decodes greedily.

    TensorRT-LLM's C++ runtime has no `do_sample`: a request that sets neither top_k
    (`runtime_top_k`) nor top_p (`runtime_top_p`), or sets both to 0, is decoded greedily and its
    temperature has no effect. Found with the search tool:
      - NVIDIA/TensorRT-LLM issue #646 (maintainer byshiue): "When both topk and topp are 0, TRT LLM
        will set it to greedy search automatically."
      - NVIDIA/TensorRT-LLM issue #1341 (byshiue): "temperature does not bring effect on greedy
        search"; the reporter: "top_k and top_p by default were 1 and 0, which makes temperature
        redundant."
      - deepjavalibrary/djl-serving PR #1659 (TensorRT-LLM parameter unification): "if top_p=0 and
        top_k=0, then it automatically does greedy".
    top_k == 1 (argmax of the filtered distribution) and temperature == 0 (the limit of
    temperature scaling) are the same argmax, so they are greedy here too: exact-match verification
    is then the rejection rule itself, and outputs agree token for token.
    """
    if params.top_k == 1 or params.temperature == 0.0:
        return True
    return params.top_k <= 0 and params.top_p <= 0.0
