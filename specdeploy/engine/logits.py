"""Logits processing for one position, as pure functions: what TensorRT-LLM's decoder does to a
logits row before it draws a token.

The order is TensorRT-LLM's, from `cpp/tensorrt_llm/kernels/penaltyKernels.cu` (`batchApplyPenalty`,
NVIDIA/TensorRT-LLM) followed by its bad-words layer (`banBadWords.cu`), then sampling:

1. embedding bias: `logit += bias[token]`;
2. temperature: `logit /= temperature` (only when it is not 1; see `process_row` for 0);
3. for every token that occurs in the sequence so far, **prompt and output alike** (the kernel's
   context phase counts `outputIds[0:inputLen]`, i.e. the prompt, and every generation step adds the
   token it produced):
   - repetition penalty: `logit < 0 ? logit * penalty : logit / penalty`,
   - presence penalty: `logit -= presence`,
   - frequency penalty: `logit -= frequency * count`;
4. min_tokens: the end id is set to -inf while fewer than `min_tokens` tokens have been generated
   by this request (`currentStep - inputLen < minLength` in the kernel);
5. bad words: the last token of every bad word whose other tokens end the sequence is set to -inf;
6. the token is chosen from the result: argmax when greedy, else a draw from
   `specdeploy.speculation.verify.sampling_distribution` with temperature 1 (it was applied in step 2).

Because the penalties count the whole sequence (prompt + output), a position's processing depends
only on the tokens before it: a (k + 1)-row verification pass over `input + draft` processes row i
over `input + draft[:i]` and gives exactly what k + 1 single decode steps give. min_tokens counts
tokens generated *by this request*: row i of a verification pass has generated i tokens (a caller
that splits one generation over several requests, such as the BLS, passes the remaining count).

Log probabilities (`output_log_probs`, `cum_log_probs`) are those of the distribution the token was
chosen from. TensorRT-LLM's sampling kernels (`samplingTopKKernels.cu`, `samplingTopPKernels.cu`)
compute them from the processed logits; with the model parameter `normalize_log_probs` (default
true in tensorrtllm_backend, `inflight_batcher_llm/src/model_instance_state.cc`) they are
renormalized over the tokens top-k/top-p kept, so a greedy token has log probability 0 (maintainer
byshiue, tensorrtllm_backend issue #276: "the default setting is greedy search and the probability
of candidate is always 1"); without it they are `log_softmax` of the processed row over the whole
vocabulary.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from specdeploy.core.errors import ConfigError
from specdeploy.speculation import sampling as speculation_sampling
from specdeploy.speculation import verify
from specdeploy.speculation.sampling import SamplingParams


@dataclass(frozen=True)
class LogitsParams:
    """What processes a request's logits rows (TensorRT-LLM's names; neutral values by default)."""

    temperature: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    end_id: int | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    embedding_bias: torch.Tensor | None = field(default=None, compare=False)  # [vocab] fp32

    def __post_init__(self):
        if not self.repetition_penalty > 0:
            raise ConfigError(
                f"repetition_penalty is {self.repetition_penalty}, must be > 0", "use 1.0 for no repetition penalty"
            )
        if self.min_tokens < 0:
            raise ConfigError(f"min_tokens is {self.min_tokens}, must be >= 0")
        if self.embedding_bias is not None and self.embedding_bias.dim() != 1:
            raise ConfigError(
                f"embedding_bias has shape {list(self.embedding_bias.shape)}, expected [vocab]",
                "send one bias value per vocabulary token",
            )

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def processes_nothing(self) -> bool:
        """Whether `process_row` returns every row as it is (as f32): no bias, no temperature to divide by, no
        penalties, no min_tokens, no bad words."""
        return (
            self.embedding_bias is None
            and self.temperature in (0.0, 1.0)
            and not self.uses_penalties
            and self.min_tokens == 0
            and not self.bad_words
        )


def apply_penalties(
    row: torch.Tensor, sequence: Sequence[int], repetition: float = 1.0, presence: float = 0.0, frequency: float = 0.0
) -> torch.Tensor:
    """Repetition, presence and frequency penalties on one row [vocab] for the tokens of `sequence`
    (prompt + output so far), in TensorRT-LLM's order. Returns a new row."""
    if repetition == 1.0 and presence == 0.0 and frequency == 0.0:
        return row
    counts = Counter(int(t) for t in sequence if 0 <= int(t) < row.shape[-1])
    if not counts:
        return row
    ids = torch.tensor(list(counts.keys()), dtype=torch.long)  # [m]
    n = torch.tensor(list(counts.values()), dtype=row.dtype)  # [m]
    values = row[ids]
    if repetition != 1.0:
        values = torch.where(values < 0, values * repetition, values / repetition)
    values = values - presence - frequency * n
    row = row.clone()
    row[ids] = values
    return row


def ban_min_tokens(row: torch.Tensor, end_id: int | None, generated: int, min_tokens: int) -> torch.Tensor:
    """The end id at -inf while fewer than `min_tokens` tokens have been generated."""
    if end_id is None or generated >= min_tokens or not 0 <= end_id < row.shape[-1]:
        return row
    row = row.clone()
    row[end_id] = float("-inf")
    return row


def mask_bad_words(logits: torch.Tensor, sequence: Sequence[int], bad_words: Sequence[Sequence[int]]) -> torch.Tensor:
    """Set to -inf the last token of every bad word whose other tokens end `sequence` ([vocab] row)."""
    banned = []
    for word in bad_words:
        n = len(word)
        if n == 0:
            continue
        if n == 1 or (len(sequence) >= n - 1 and list(sequence[len(sequence) - (n - 1) :]) == list(word[:-1])):
            banned.append(word[-1])
    if not banned:
        return logits
    logits = logits.clone()
    logits[banned] = float("-inf")
    return logits


def process_row(row: torch.Tensor, sequence: Sequence[int], generated: int, params: LogitsParams) -> torch.Tensor:
    """The processed logits [vocab] (fp32) a token is chosen from, at the position after `sequence`.

    `sequence` is everything before the position (prompt + output so far); `generated` is how many
    tokens this request has generated before it (for min_tokens). Temperature 0 (greedy) scales
    nothing: the argmax is taken from the biased, penalized row.
    """
    row = row.float()
    if params.embedding_bias is not None:
        if params.embedding_bias.shape[-1] != row.shape[-1]:
            raise ConfigError(
                f"embedding_bias has {params.embedding_bias.shape[-1]} values, the vocabulary has {row.shape[-1]}",
                "send one bias value per vocabulary token",
            )
        row = row + params.embedding_bias.float()
    if params.temperature not in (0.0, 1.0):
        row = row / params.temperature
    row = apply_penalties(row, sequence, params.repetition_penalty, params.presence_penalty, params.frequency_penalty)
    row = ban_min_tokens(row, params.end_id, generated, params.min_tokens)
    return mask_bad_words(row, sequence, params.bad_words)


def process_rows(
    rows: torch.Tensor, context: Sequence[int], start: int, generated: int, params: LogitsParams
) -> torch.Tensor:
    """Rows [n, vocab] scoring positions start, start + 1, ... of `context`: row i is processed over
    context[: start + i] with generated + i tokens generated (a verification pass over input + draft
    is `start = len(input)`, `generated = 0`)."""
    if params.processes_nothing:  # the rows themselves: no per-row calls, no [n, vocab] copy (every fused round)
        return rows.float()
    return torch.stack(
        [process_row(rows[i], context[: start + i], generated + i, params) for i in range(rows.shape[0])]
    )


def sampler_params(sampling: SamplingParams) -> SamplingParams:
    """The parameters to draw from a processed row with: temperature was applied by `process_row`,
    so it is 1 here, unless the request is greedy (then argmax, whatever the temperature)."""
    if speculation_sampling.is_greedy(sampling) or sampling.temperature == 1.0:
        return sampling
    return replace(sampling, temperature=1.0)


def token_log_prob(processed: torch.Tensor, token: int, sampling: SamplingParams, normalize: bool) -> float:
    """The log probability of `token` under the distribution it was chosen from.

    normalize=True (TensorRT-LLM's default): log of the sampling distribution after top-k/top-p
    renormalization, 0 for a greedy token. normalize=False: log_softmax of the processed row.
    """
    if normalize:
        probs = verify.sampling_distribution(processed, sampler_params(sampling))  # [vocab]
        return float(torch.log(probs[token]))
    return float(torch.log_softmax(processed.float(), dim=-1)[token])
