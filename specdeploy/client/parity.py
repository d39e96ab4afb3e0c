"""Parity of the speculative path against the control: exact match, divergence triage, sampling statistics.

Greedy: for each prompt the speculative output (`tensorrt_llm_bls`) must equal the control
(`ensemble`, same target engine, no speculation). Evidence first: the control's exact tokens come
from `output_ids` where the model returns them, else from the target alone (preprocessing +
`tensorrt_llm`, the engine the ensemble runs), and only without either from re-tokenized text. A
prompt whose control output has fewer than `min_compared_tokens` tokens proves nothing and is
"too short to compare", never a match.

A divergence fails outright on a backend whose verification is exact by construction
(`Backend.exact_verification` in specdeploy/core/backends.py: the CPU engine). On the others (GPU engines
verify k+1 rows in reduced precision with batch-dependent kernels) it is triaged with the target's
logits at the diverging position: when the logits of the two competing tokens (the control's and
the speculative one's; end_id for a side that ended there) differ by at most `near_tie_margin`, the
flip is a numerical near-tie; otherwise a real mismatch.

SamplingParams: outputs are random, so many seeded samples per prompt are compared with a chi-square
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
    GenerateResult,
    TargetTrace,
    TokenCodec,
)
from specdeploy.speculation.sampling import SamplingParams

MATCH, NEAR_TIE, MISMATCH, UNTRIAGED, TOO_SHORT = "match", "near_tie", "mismatch", "untriaged", "too_short"
# Where the control's token count comes from, best first.
IDS_FROM_MODEL, IDS_FROM_TARGET, IDS_RETOKENIZED = "output_ids", "target", "retokenized"
SAMPLING_ALPHA = 0.01  # the sampling comparison fails when the combined p-value is below this


@dataclass(frozen=True)
class GreedyPolicy:
    """How divergences and short outputs are judged."""

    exact: bool  # the backend's verification is bit-exact: any divergence is a failure
    near_tie_margin: float  # used only when not exact
    min_compared_tokens: int


@dataclass
class PromptParity:
    prompt_id: str
    category: str
    verdict: str  # match | near_tie | mismatch | untriaged (no logits to triage with) | too_short
    control_text: str
    speculative_text: str
    control_tokens: int  # length of the control output in tokens (a final end_id not counted)
    matched_tokens: int  # tokens before the first divergence (== control_tokens on a match)
    token_source: str = IDS_RETOKENIZED  # output_ids | target | retokenized: where control_tokens comes from
    generated_tokens: int | None = (
        None  # ids the engine generated for the control, a final end_id included (None: retokenized)
    )
    divergence_index: int | None = None  # index into the generated tokens
    control_token: int | None = None  # end_id where the control ended there
    speculative_token: int | None = None  # end_id where the speculative output ended there (None: unknown)
    control_token_text: str | None = None
    speculative_token_text: str | None = None
    top1_top2_margin: float | None = None  # target logits at the divergence (informative)
    token_margin: float | None = None  # logit(control token) - logit(speculative token), the triage margin
    stream_equal: bool | None = None  # decoupled: both streams, concatenated, equal the non-streamed texts
    note: str = ""
    # the speculative answer's draft counts and output tokens as the server gave them (None: not returned)
    drafted: int | None = None
    accepted: int | None = None
    speculative_tokens: int | None = None

    @property
    def compared(self) -> bool:
        return self.verdict != TOO_SHORT

    @property
    def passes(self) -> bool:
        return self.verdict in (MATCH, NEAR_TIE) and self.stream_equal is not False


@dataclass
class ParitySummary:
    prompts: int = 0
    compared: int = 0  # prompts with a verdict other than too_short
    too_short: int = 0
    exact: int = 0
    near_ties: int = 0
    mismatches: int = 0  # real mismatches plus untriaged divergences
    tokens: int = 0  # control tokens of the compared prompts
    matched_tokens: int = 0
    streams_checked: int = 0
    stream_mismatches: int = 0

    @property
    def compared_share(self) -> float:
        return self.compared / self.prompts if self.prompts else 0.0

    @property
    def exact_match_rate(self) -> float:
        return self.exact / self.compared if self.compared else 0.0

    @property
    def parity_rate(self) -> float:
        """Share of the compared prompts that pass: exact matches plus near-ties (what the gate checks)."""
        return (self.exact + self.near_ties) / self.compared if self.compared else 0.0

    @property
    def token_agreement(self) -> float:
        """Tokens before the first divergence over all compared control tokens."""
        return self.matched_tokens / self.tokens if self.tokens else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            compared_share=self.compared_share,
            exact_match_rate=self.exact_match_rate,
            parity_rate=self.parity_rate,
            token_agreement=self.token_agreement,
        )
        return d


def summarize(items: Sequence[PromptParity]) -> dict[str, ParitySummary]:
    """Per category, plus "all"."""
    out: dict[str, ParitySummary] = {"all": ParitySummary()}
    for item in items:
        for key in ("all", item.category):
            s = out.setdefault(key, ParitySummary())
            s.prompts += 1
            s.too_short += item.verdict == TOO_SHORT
            s.exact += item.verdict == MATCH
            s.near_ties += item.verdict == NEAR_TIE
            s.mismatches += item.verdict in (MISMATCH, UNTRIAGED)
            if item.compared:
                s.compared += 1
                s.tokens += item.control_tokens
                s.matched_tokens += item.matched_tokens
            if item.stream_equal is not None:
                s.streams_checked += 1
                s.stream_mismatches += not item.stream_equal
    return out


# ---------------------------------------------------------------- locating and triaging a divergence


def _decoded_prefix(codec: TokenCodec, ids: Sequence[int]) -> str:
    # A byte-level token can end inside a UTF-8 character; drop the replacement char it decodes to.
    return codec.decode(list(ids)).rstrip("\ufffd")


def content_ids(ids: Sequence[int], end_id: int | None) -> list[int]:
    """The generated ids without a final end_id (engines differ in whether they return it)."""
    ids = list(ids)
    return ids[:-1] if ids and end_id is not None and ids[-1] == end_id else ids


def locate_divergence(
    control_ids: Sequence[int], speculative_text: str, codec: TokenCodec
) -> tuple[int | None, int | None]:
    """(index of the first control token the speculative text does not reproduce, the speculative token there).

    Returns (None, None) when the texts agree. The speculative token is None when the speculative
    output ends at the divergence. Index len(control_ids): the speculative text goes on past the
    control's end.
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


def first_difference(control_ids: Sequence[int], speculative_ids: Sequence[int]) -> int | None:
    """Index of the first differing token, len(shorter) when one is a prefix of the other, None when equal."""
    for i, (a, b) in enumerate(zip(control_ids, speculative_ids)):
        if a != b:
            return i
    return None if len(control_ids) == len(speculative_ids) else min(len(control_ids), len(speculative_ids))


def margins(
    logits_row: np.ndarray, control_token: int | None, speculative_token: int | None
) -> tuple[float, float | None]:
    """(top-1 minus top-2 logit, logit of the control token minus that of the speculative token)."""
    row = np.asarray(logits_row, dtype=np.float64)  # [vocab]
    top2 = np.partition(row, -2)[-2:]
    top1_top2 = float(top2.max() - top2.min())
    token_margin = None
    if (
        control_token is not None
        and speculative_token is not None
        and 0 <= min(control_token, speculative_token)
        and max(control_token, speculative_token) < row.size
    ):
        token_margin = float(row[control_token] - row[speculative_token])
    return top1_top2, token_margin


def classify(token_margin: float | None, policy: GreedyPolicy) -> str:
    """The verdict of a divergence: a failure on an exact backend; else a near-tie when the two
    competing tokens are within `near_tie_margin` logits of each other."""
    if policy.exact:
        return MISMATCH
    if token_margin is None:
        return UNTRIAGED
    return NEAR_TIE if abs(token_margin) <= policy.near_tie_margin else MISMATCH


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def compare_greedy(
    prompt: Prompt,
    control_text: str,
    speculative_text: str,
    codec: TokenCodec,
    trace: TargetTrace | None,
    policy: GreedyPolicy,
    speculative_ids: Sequence[int] | None = None,
    control_ids: Sequence[int] | None = None,
) -> PromptParity:
    """Compare one prompt's outputs.

    `control_ids`: the control's own `output_ids` when its model returns them; else the ids of
    `trace` (the target alone); else the re-tokenized control text. `trace.logits` (the target's
    logits at every generated position) triage a divergence on a non-exact backend.
    `speculative_ids`: the speculative path's `output_ids`, when returned (exact comparison in token space).
    """
    end_id = trace.end_id if trace is not None else None
    notes = []
    ids, source = _control_ids(control_text, codec, trace, control_ids, notes)
    control = content_ids(ids, end_id)
    generated = len(ids) if source != IDS_RETOKENIZED else None
    spec = content_ids(speculative_ids, end_id) if speculative_ids is not None else None
    index, spec_token = _first_divergence(control, spec, control_text, speculative_text, codec, notes)
    if control_text != speculative_text and index is None:
        index = len(control)  # equal ids, different text: cannot happen with one detokenizer
        notes.append("equal token ids decoded to different texts")
    if index is None:
        verdict = MATCH if len(control) >= policy.min_compared_tokens else TOO_SHORT
        if verdict == TOO_SHORT:
            notes.append(f"too short to compare: {len(control)} tokens < {policy.min_compared_tokens}")
        return PromptParity(
            prompt.id,
            prompt.category,
            verdict,
            control_text,
            speculative_text,
            len(control),
            len(control),
            source,
            generated,
            note=_join(*notes),
        )

    # The competing tokens at `index`; a side that ended there competes with end_id.
    control_token = control[index] if index < len(control) else end_id
    ended_early = spec_token is None and (
        len(speculative_text) < len(control_text) or (spec is not None and len(spec) < len(control))
    )
    if ended_early:
        spec_token = end_id
    if spec_token is not None and spec_token == control_token:
        spec_token = None  # both "ended" (a divergence inside undecodable bytes): no competing token to weigh
    top1_top2 = token_margin = None
    # the target's logits at `index` weigh this divergence only where the target alone wrote the control's tokens before
    # it (a row's logits follow the tokens before it; where they differ, the row is another context's)
    same_context = trace is not None and list(trace.output_ids[:index]) == list(control[:index])
    if trace is not None and trace.logits is not None and index < len(trace.logits) and same_context:
        top1_top2, token_margin = margins(trace.logits[index], control_token, spec_token)
        if token_margin is None:
            notes.append("one competing token is unknown (no end_id from the server): no margin")
    elif not policy.exact and trace is not None and trace.logits is not None and not same_context:
        notes.append("the target alone wrote other tokens before the divergence: its logits there cannot triage it")
    elif not policy.exact:
        notes.append(
            "the target returned no generation logits at the divergence to triage with"
            + (" (TensorRT engines need --gather_generation_logits)" if trace is not None else "")
        )
    if policy.exact:
        notes.append("the backend verifies bit-exactly: any divergence is a failure")
    verdict = classify(token_margin, policy)
    if verdict == NEAR_TIE and index < policy.min_compared_tokens:
        # a tie that parted the outputs before min_compared_tokens leaves fewer tokens compared than a prompt needs to
        # count as evidence: too short, as a short answer is (it counted as a passing prompt however early it parted)
        verdict = TOO_SHORT
        notes.append(f"too short to compare: a near-tie after {index} tokens < {policy.min_compared_tokens}")
    return PromptParity(
        prompt.id,
        prompt.category,
        verdict,
        control_text,
        speculative_text,
        control_tokens=len(control),
        matched_tokens=index,
        token_source=source,
        generated_tokens=generated,
        divergence_index=index,
        control_token=control_token,
        speculative_token=spec_token,
        control_token_text=None if control_token is None else codec.decode([control_token]),
        speculative_token_text=None if spec_token is None else codec.decode([spec_token]),
        top1_top2_margin=top1_top2,
        token_margin=token_margin,
        note=_join(*notes),
    )


def _control_ids(
    control_text: str, codec: TokenCodec, trace: TargetTrace | None, control_ids, notes: list
) -> tuple[list[int], str]:
    """The control's token ids and where they came from: its model's output_ids, the target alone's, or its text
    re-tokenized (each but the first adds a note)."""
    if control_ids is not None:
        return list(control_ids), IDS_FROM_MODEL
    if trace is not None:
        if codec.decode(list(trace.output_ids)) == control_text:
            return list(trace.output_ids), IDS_FROM_TARGET
        # the target alone answered other text than the control: its ids are not the control's, and comparing the
        # speculative text against them would call equal outputs a mismatch; the control's own text, re-tokenized, is
        notes.append(
            "the target alone (tensorrt_llm) and the control returned different text: control tokens counted by "
            "re-tokenizing the control's text"
        )
        return codec.encode(control_text), IDS_RETOKENIZED
    notes.append("no token ids from the server: control tokens counted by re-tokenizing its text")
    return codec.encode(control_text), IDS_RETOKENIZED


def _first_divergence(
    control: list[int], spec, control_text: str, speculative_text: str, codec: TokenCodec, notes: list
):
    """(index of the first differing token or None, the speculative token there or None): in token space when the
    speculative path returned ids, else located in its text."""
    if spec is not None:
        index = first_difference(control, spec)
        return index, spec[index] if index is not None and index < len(spec) else None
    index, spec_token = locate_divergence(control, speculative_text, codec)
    if spec_token is not None:
        notes.append("speculative token re-tokenized from text (the model returns no output_ids)")
    if index is not None and index == len(control) and len(speculative_text) <= len(control_text):
        notes.append("the texts differ inside undecodable bytes: the index is approximate")
    return index, spec_token


def _differ(control: GenerateResult, speculative: GenerateResult) -> bool:
    return speculative.text != control.text or (
        speculative.token_ids is not None
        and control.token_ids is not None
        and speculative.token_ids != control.token_ids
    )


def check_prompt(
    endpoint: Endpoint,
    prompt: Prompt,
    codec: TokenCodec,
    num_draft_tokens: int,
    policy: GreedyPolicy,
    timeout_s: float,
    triage: bool = True,
    check_streams: bool = False,
) -> PromptParity:
    """Greedy control and speculative outputs for one prompt, compared in the control's exact tokens.

    `triage`: the target alone (preprocessing + tensorrt_llm) can be called: it gives the control's
    ids when the ensemble returns none, and its logits on a divergence. `check_streams` (decoupled
    deployments): also stream both and require the concatenated stream to equal the non-streamed text.
    """
    control = endpoint.generate(CONTROL_MODEL, GenerateRequest(prompt.text, prompt.max_tokens), timeout_s)
    spec_request = GenerateRequest(prompt.text, prompt.max_tokens, num_draft_tokens=num_draft_tokens)
    speculative = endpoint.generate(SPECULATIVE_MODEL, spec_request, timeout_s)
    differ = _differ(control, speculative)
    trace = None
    if triage and (differ or control.token_ids is None):
        trace = endpoint.trace(prompt.text, prompt.max_tokens, timeout_s, with_logits=differ)
    item = compare_greedy(
        prompt, control.text, speculative.text, codec, trace, policy, speculative.token_ids, control.token_ids
    )
    item.drafted, item.accepted = speculative.perf.total_draft_tokens, speculative.perf.total_accepted_draft_tokens
    tokens = speculative.output_tokens
    item.speculative_tokens = tokens if tokens is not None else speculative.usage_tokens
    if check_streams:
        notes = []
        for model, request, unary in (
            (CONTROL_MODEL, GenerateRequest(prompt.text, prompt.max_tokens, stream=True), control),
            (
                SPECULATIVE_MODEL,
                GenerateRequest(prompt.text, prompt.max_tokens, num_draft_tokens=num_draft_tokens, stream=True),
                speculative,
            ),
        ):
            streamed = endpoint.generate(model, request, timeout_s)
            if streamed.text != unary.text:
                at = next(
                    (i for i, (a, b) in enumerate(zip(streamed.text, unary.text)) if a != b),
                    min(len(streamed.text), len(unary.text)),
                )
                notes.append(
                    f"{model}: the concatenated stream ({streamed.responses} responses) differs from the non-streamed"
                    f" text at character {at}"
                )
        item.stream_equal = not notes
        item.note = _join(item.note, *notes)
    return item


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


def homogeneity_test(
    control: Sequence[str], speculative: Sequence[str], min_expected: float = 5.0
) -> tuple[float, int, float]:
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
    sampling: SamplingParams,
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
            seeded = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed_base + 2 * i + side)
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
