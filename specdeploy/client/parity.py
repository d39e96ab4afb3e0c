"""Parity of the speculative path against the control: exact match, divergence triage, sampling statistics.

Greedy: for each prompt the speculative output (`tensorrt_llm_bls`) must equal the control
(`ensemble`, same target engine, no speculation). A divergence is located in the control's exact
tokens and triaged by re-scoring with the target alone: when the target's logits of the two
competing tokens differ by at most `near_tie_margin` (logit units), the flip is a numerical near-tie
(batched verification in reduced precision can flip a tie); otherwise it is a real mismatch.

Sampling: outputs are random, so many seeded samples per prompt are compared with a chi-square
test of homogeneity (speculative vs control distributions of the continuation); per-prompt
p-values are combined with Fisher's method.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from specdeploy.client.prompts import Prompt
from specdeploy.client.protocol import (
    CONTROL_MODEL,
    SPECULATIVE_MODEL,
    Endpoint,
    GenerateRequest,
    Sampling,
    TargetTrace,
    TokenCodec,
)

MATCH, NEAR_TIE, MISMATCH, UNTRIAGED = "match", "near_tie", "mismatch", "untriaged"
SAMPLING_ALPHA = 0.01  # the sampling comparison fails when the combined p-value is below this


@dataclass
class PromptParity:
    prompt_id: str
    category: str
    verdict: str  # match | near_tie | mismatch | untriaged (no logits to triage with)
    control_text: str
    speculative_text: str
    control_tokens: int  # length of the control output in tokens
    matched_tokens: int  # tokens before the first divergence (== control_tokens on a match)
    divergence_index: int | None = None  # index into the generated tokens
    control_token: int | None = None
    speculative_token: int | None = None  # None: the speculative output ended there
    control_token_text: str | None = None
    speculative_token_text: str | None = None
    top1_top2_margin: float | None = None  # target logits at the divergence
    token_margin: float | None = None  # logit(control token) - logit(speculative token)
    note: str = ""

    @property
    def passes(self) -> bool:
        return self.verdict in (MATCH, NEAR_TIE)


@dataclass
class ParitySummary:
    prompts: int = 0
    exact: int = 0
    near_ties: int = 0
    mismatches: int = 0  # real mismatches plus untriaged divergences
    tokens: int = 0
    matched_tokens: int = 0

    @property
    def exact_match_rate(self) -> float:
        return self.exact / self.prompts if self.prompts else 0.0

    @property
    def parity_rate(self) -> float:
        """Share of prompts that pass: exact matches plus near-ties (what the gate checks)."""
        return (self.exact + self.near_ties) / self.prompts if self.prompts else 0.0

    @property
    def token_agreement(self) -> float:
        """Tokens before the first divergence over all control tokens."""
        return self.matched_tokens / self.tokens if self.tokens else 1.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(exact_match_rate=self.exact_match_rate, parity_rate=self.parity_rate, token_agreement=self.token_agreement)
        return d


def summarize(items: Sequence[PromptParity]) -> dict[str, ParitySummary]:
    """Per category, plus "all"."""
    out: dict[str, ParitySummary] = {"all": ParitySummary()}
    for item in items:
        for key in ("all", item.category):
            s = out.setdefault(key, ParitySummary())
            s.prompts += 1
            s.exact += item.verdict == MATCH
            s.near_ties += item.verdict == NEAR_TIE
            s.mismatches += item.verdict in (MISMATCH, UNTRIAGED)
            s.tokens += item.control_tokens
            s.matched_tokens += item.matched_tokens
    return out


# ---------------------------------------------------------------- locating and triaging a divergence


def _decoded_prefix(codec: TokenCodec, ids: Sequence[int]) -> str:
    # A byte-level token can end inside a UTF-8 character; drop the replacement char it decodes to.
    return codec.decode(list(ids)).rstrip("\ufffd")


def locate_divergence(control_ids: Sequence[int], speculative_text: str, codec: TokenCodec) -> tuple[int | None, int | None]:
    """(index of the first control token the speculative text does not reproduce, the speculative token there).

    Returns (None, None) when the texts agree. The speculative token is None when the speculative
    output ends at the divergence.
    """
    if codec.decode(list(control_ids)) == speculative_text:
        return None, None
    index = len(control_ids)
    for i in range(len(control_ids)):
        if not speculative_text.startswith(_decoded_prefix(codec, control_ids[: i + 1])):
            index = i
            break
    prefix_text = codec.decode(list(control_ids[:index]))
    return index, _token_after(speculative_text, prefix_text, codec)


def _token_after(text: str, prefix_text: str, codec: TokenCodec) -> int | None:
    if len(text) <= len(prefix_text):
        return None
    ids = codec.encode(text)
    for j in range(len(ids)):
        if codec.decode(ids[:j]) == prefix_text:
            return ids[j]
    rest = codec.encode(text[len(prefix_text) :])
    return rest[0] if rest else None


def margins(logits_row: np.ndarray, control_token: int | None, speculative_token: int | None) -> tuple[float, float | None]:
    """(top-1 minus top-2 logit, logit of the control token minus that of the speculative token)."""
    row = np.asarray(logits_row, dtype=np.float64)  # [vocab]
    top2 = np.partition(row, -2)[-2:]
    top1_top2 = float(top2.max() - top2.min())
    token_margin = None
    if control_token is not None and speculative_token is not None and max(control_token, speculative_token) < row.size:
        token_margin = float(row[control_token] - row[speculative_token])
    return top1_top2, token_margin


def classify(top1_top2: float | None, token_margin: float | None, near_tie_margin: float) -> str:
    """Near-tie when the two competing tokens are within `near_tie_margin` logits of each other."""
    margin = token_margin if token_margin is not None else top1_top2
    if margin is None:
        return UNTRIAGED
    return NEAR_TIE if abs(margin) <= near_tie_margin else MISMATCH


def compare_greedy(
    prompt: Prompt,
    control_text: str,
    speculative_text: str,
    codec: TokenCodec,
    trace: TargetTrace | None,
    near_tie_margin: float,
    speculative_ids: Sequence[int] | None = None,
) -> PromptParity:
    """Compare one prompt's outputs; `trace` (the target alone, with logits) is needed only on a divergence.

    With `speculative_ids` (deployments that return `output_ids`) the comparison is exact in token
    space; otherwise the divergence is located by decoding the control's tokens against the text.
    """
    control_ids = list(trace.output_ids) if trace is not None else None
    same_ids = speculative_ids is None or control_ids is None or list(speculative_ids) == control_ids
    if control_text == speculative_text and same_ids:
        n = len(control_ids) if control_ids is not None else len(codec.encode(control_text))
        return PromptParity(prompt.id, prompt.category, MATCH, control_text, speculative_text, n, n)
    note = ""
    if control_ids is None:
        control_ids = codec.encode(control_text)
        note = "no trace from the target: divergence located in re-tokenized control text"
    elif codec.decode(control_ids) != control_text:
        note = "the target alone (tensorrt_llm) and the ensemble returned different text; divergence located in the target's tokens"
    if speculative_ids is not None:
        speculative_ids = list(speculative_ids)
        index = next((i for i, (a, b) in enumerate(zip(control_ids, speculative_ids)) if a != b), None)
        if index is None:
            index = min(len(control_ids), len(speculative_ids)) if len(control_ids) != len(speculative_ids) else None
        spec_token = speculative_ids[index] if index is not None and index < len(speculative_ids) else None
    else:
        index, spec_token = locate_divergence(control_ids, speculative_text, codec)
        if spec_token is not None:
            note = (note + "; " if note else "") + "speculative token re-tokenized from text (the model returns no output_ids)"
        if index is not None and index == len(control_ids) and len(speculative_text) <= len(control_text):
            note = (note + "; " if note else "") + "the texts differ inside undecodable bytes: the index is approximate"
    if index is None:  # the speculative output equals the target's own: the ensemble differed
        n = len(control_ids)
        return PromptParity(prompt.id, prompt.category, MATCH, control_text, speculative_text, n, n, note=note)
    control_token = control_ids[index] if index < len(control_ids) else None
    top1_top2 = token_margin = None
    if trace is not None and trace.logits is not None and index < len(trace.logits):
        top1_top2, token_margin = margins(trace.logits[index], control_token, spec_token)
    elif trace is not None:
        note = (note + "; " if note else "") + (
            "the target returned no generation logits to triage with (TensorRT engines need --gather_generation_logits)"
        )
    if control_token is None or spec_token is None:
        token_margin = None  # one side ended early: an end-id tie, judged by the top-1/top-2 margin
    verdict = classify(top1_top2, token_margin, near_tie_margin)
    return PromptParity(
        prompt.id,
        prompt.category,
        verdict,
        control_text,
        speculative_text,
        control_tokens=len(control_ids),
        matched_tokens=index,
        divergence_index=index,
        control_token=control_token,
        speculative_token=spec_token,
        control_token_text=None if control_token is None else codec.decode([control_token]),
        speculative_token_text=None if spec_token is None else codec.decode([spec_token]),
        top1_top2_margin=top1_top2,
        token_margin=token_margin,
        note=note,
    )


def check_prompt(
    endpoint: Endpoint,
    prompt: Prompt,
    codec: TokenCodec,
    num_draft_tokens: int,
    near_tie_margin: float,
    timeout_s: float,
    triage: bool = True,
) -> PromptParity:
    """Greedy control and speculative outputs for one prompt, triaged with the target's logits on a divergence."""
    control = endpoint.generate(CONTROL_MODEL, GenerateRequest(prompt.text, prompt.max_tokens), timeout_s)
    speculative = endpoint.generate(
        SPECULATIVE_MODEL, GenerateRequest(prompt.text, prompt.max_tokens, num_draft_tokens=num_draft_tokens), timeout_s
    )
    differ = speculative.text != control.text or (
        speculative.token_ids is not None and control.token_ids is not None and speculative.token_ids != control.token_ids
    )
    trace = endpoint.trace(prompt.text, prompt.max_tokens, timeout_s) if differ and triage else None
    return compare_greedy(prompt, control.text, speculative.text, codec, trace, near_tie_margin, speculative.token_ids)


# ---------------------------------------------------------------- sampling


@dataclass
class SampleTest:
    prompt_id: str
    category: str
    samples: int  # per side
    statistic: float
    dof: int
    p_value: float
    outcomes: int  # distinct outcomes before pooling
    control_counts: dict = field(default_factory=dict)  # outcome -> count, every sample
    speculative_counts: dict = field(default_factory=dict)


def homogeneity_test(control: Sequence[str], speculative: Sequence[str], min_expected: float = 5.0) -> tuple[float, int, float]:
    """Chi-square test that two samples come from one distribution: (statistic, dof, p-value).

    Outcomes whose pooled expected count is below `min_expected` are merged into one bin so the
    chi-square approximation holds.
    """
    from scipy.stats import chi2_contingency

    c_counts, s_counts = Counter(control), Counter(speculative)
    n_c, n_s = len(control), len(speculative)
    total = n_c + n_s
    keep, rare_c, rare_s = [], 0, 0
    for outcome in set(c_counts) | set(s_counts):
        pooled = c_counts[outcome] + s_counts[outcome]
        if pooled * min(n_c, n_s) / total >= min_expected:
            keep.append((c_counts[outcome], s_counts[outcome]))
        else:
            rare_c += c_counts[outcome]
            rare_s += s_counts[outcome]
    if rare_c + rare_s:
        keep.append((rare_c, rare_s))
    if len(keep) < 2:
        return 0.0, 0, 1.0
    table = np.array(keep, dtype=np.float64).T  # [2, outcomes]
    statistic, p_value, dof, _ = chi2_contingency(table, correction=False)
    return float(statistic), int(dof), float(p_value)


def combine_p_values(p_values: Sequence[float]) -> float:
    """Fisher's method over independent per-prompt tests."""
    from scipy.stats import combine_pvalues

    if not p_values:
        return 1.0
    return float(combine_pvalues(np.clip(p_values, 1e-300, 1.0), method="fisher").pvalue)


def check_prompt_sampling(
    endpoint: Endpoint,
    prompt: Prompt,
    sampling: Sampling,
    samples: int,
    max_tokens: int,
    num_draft_tokens: int,
    timeout_s: float,
    seed_base: int = 0,
    progress=None,
) -> SampleTest:
    """`samples` seeded outputs per side; control and speculative use disjoint seeds (independent samples)."""
    outputs: dict[str, list[str]] = {CONTROL_MODEL: [], SPECULATIVE_MODEL: []}
    for i in range(samples):
        for side, (model, k) in enumerate(((CONTROL_MODEL, None), (SPECULATIVE_MODEL, num_draft_tokens))):
            seeded = Sampling(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed_base + 2 * i + side)
            request = GenerateRequest(prompt.text, max_tokens, num_draft_tokens=k, sampling=seeded)
            outputs[model].append(endpoint.generate(model, request, timeout_s).text)
        if progress is not None:
            progress(1)
    control, speculative = outputs[CONTROL_MODEL], outputs[SPECULATIVE_MODEL]
    statistic, dof, p_value = homogeneity_test(control, speculative)
    return SampleTest(
        prompt.id,
        prompt.category,
        samples,
        statistic,
        dof,
        p_value,
        outcomes=len(set(control) | set(speculative)),
        control_counts=dict(Counter(control).most_common()),
        speculative_counts=dict(Counter(speculative).most_common()),
    )
