"""Prompt-lookup drafting: weights-free Proposers over the request's prompt + output: n-gram (draft.kind ngram,
below) and the suffix automaton (draft.kind suffix and EAGLE-3's sa_config: SuffixLookup, SuffixProposer at the end).

TensorRT-LLM's NGram speculative decoding (`NGramDecodingConfig`; the pool is
`tensorrt_llm/_torch/speculative/ngram.py`, `NGramPoolManager`), with its field names and meaning:

  - the pool maps a *pattern* (a tuple of 1..`max_matching_ngram_size` tokens) to its *matches*: the
    up to `max_draft_len` tokens that followed the pattern earlier in the sequence;
  - each call first adds the pairs of the sequence's new tail to the pool, then looks up the longest
    suffix of the sequence (`max_matching_ngram_size` tokens down to 1) that is a pattern, and proposes
    one of its matches;
  - `is_keep_all`: keep every distinct match of a pattern (a new, longer match drops the shorter ones);
    false: keep one match per pattern, replaced only by a longer one;
  - `is_use_oldest`: propose the oldest match of the pattern; false: the newest;
  - `is_public_pool`: one pool shared by all requests of the deployment; false: each request has its
    own pool, dropped when the request ends.

One field of specdeploy's own, not TensorRT-LLM's (vLLM calls it `prompt_lookup_min`):
  - `min_matching_ngram_size` (default 1, TensorRT-LLM's behaviour): the shortest pattern that may propose.
    A lone last token matches often and is right rarely (SmolLM2's answers to the built-in prompts: a
    2-token minimum raised the predicted speedup in every category, docs/adaptive-speculation.md), and on
    a CPU every drafted row costs real time. The GPU configurations refuse a value other than 1.

A pattern's match never crosses the end of the sequence, and the tail that is rescanned on each call
(the last max_draft_len + max_matching_ngram_size - 1 tokens) lets a match that was cut short by the
end of the sequence grow as the sequence does. Proposals are deterministic, so there are no draft
logits: with sampling the target accepts by token matching (`verify_token_match`), which keeps the
target's distribution exactly as rejection sampling against a one-hot draft would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdeploy.recipe.config import NGRAM_MAX_MATCHING_NGRAM_SIZE, DraftConfig
from specdeploy.speculation.loop import Proposal
from specdeploy.speculation.sampling import SamplingParams

Pattern = tuple[int, ...]
FIELDS = DraftConfig.NGRAM_KEYS  # the recipe's draft keys, NGramSettings' fields and the model's parameters
TRTLLM_FIELDS = FIELDS[:5]  # NGramDecodingConfig's; min_matching_ngram_size is specdeploy's own


@dataclass(frozen=True)
class NGramSettings:
    """TensorRT-LLM's NGramDecodingConfig fields (defaults from the recipe's `draft` section)."""

    max_draft_len: int = 4
    max_matching_ngram_size: int = NGRAM_MAX_MATCHING_NGRAM_SIZE
    is_keep_all: bool = True
    is_use_oldest: bool = True
    is_public_pool: bool = True
    min_matching_ngram_size: int = 1  # specdeploy's own (vLLM: prompt_lookup_min); 1 = TensorRT-LLM's behaviour

    def __post_init__(self):
        assert self.max_draft_len >= 1 and 1 <= self.min_matching_ngram_size <= self.max_matching_ngram_size, self


@dataclass
class NGramPool:
    """Pattern -> matches (insertion-ordered, oldest first), filled from token sequences."""

    settings: NGramSettings
    matches: dict[Pattern, list[Pattern]] = field(default_factory=dict)

    def add(self, sequence: list[int], start: int) -> None:
        """Add every (pattern, match) pair of sequence[start:] (a pattern needs one following token)."""
        s = self.settings
        tail = sequence[start:]
        for size in range(min(s.max_matching_ngram_size, len(sequence) - 1), s.min_matching_ngram_size - 1, -1):
            for left in range(len(tail) - size):
                pattern = tuple(tail[left : left + size])
                match = tuple(tail[left + size : left + size + s.max_draft_len])
                self._insert(pattern, match)

    def _insert(self, pattern: Pattern, match: Pattern) -> None:
        known = self.matches.get(pattern)
        if known is None:
            self.matches[pattern] = [match]
        elif not self.settings.is_keep_all:
            if len(match) > len(known[0]):
                self.matches[pattern] = [match]
        elif match not in known:
            # A longer match makes the shorter ones (its cut-short prefixes, mostly) redundant.
            self.matches[pattern] = [m for m in known if len(m) >= len(match)] + [match]

    def lookup(self, sequence: list[int], num_tokens: int) -> list[int]:
        """The match of the longest pattern (at least min_matching_ngram_size tokens) that ends the sequence,
        at most num_tokens long."""
        s = self.settings
        for size in range(min(s.max_matching_ngram_size, len(sequence) - 1), s.min_matching_ngram_size - 1, -1):
            known = self.matches.get(tuple(sequence[-size:]))
            if known:
                match = known[0] if s.is_use_oldest else known[-1]
                return list(match[:num_tokens])
        return []


class NGramProposer:
    """specdeploy.speculation.loop.Proposer: proposes from the pool, after adding the sequence's new tail.

    One proposer serves one request (`pool` private) or shares `pool` with others (public). `start`
    remembers how far this request's sequence is already in the pool.
    """

    def __init__(self, settings: NGramSettings, pool: NGramPool | None = None):
        self.settings = settings
        self.pool = pool if pool is not None else NGramPool(settings)
        self.start = 0

    def propose(
        self, sequence: list[int], num_tokens: int, sampling: SamplingParams | None = None, return_logits: bool = False
    ) -> Proposal:
        return Proposal(self.draft(sequence, num_tokens))

    def draft(self, sequence: list[int], num_tokens: int) -> list[int]:
        s = self.settings
        self.pool.add(sequence, self.start)
        self.start = max(0, len(sequence) - (s.max_draft_len + s.max_matching_ngram_size - 1))
        if num_tokens <= 0:
            return []
        return self.pool.lookup(sequence, min(num_tokens, s.max_draft_len))


class NGramDrafts:
    """Proposers for a server that sees only token sequences (the `tensorrt_llm_draft` model): a
    public pool is one pool; private pools are found again by sequence, the way the KV cache finds
    a prefix: a call continues the request whose last sequence is a prefix of this one.

    At most `max_requests` private pools are kept (least recently used dropped first).
    """

    def __init__(self, settings: NGramSettings, max_requests: int = 64):
        self.settings = settings
        self.public = NGramPool(settings) if settings.is_public_pool else None
        self.max_requests = max_requests
        self.requests: list[tuple[list[int], NGramProposer]] = []  # most recent last

    def draft(self, sequence: list[int], num_tokens: int) -> list[int]:
        proposer = self._proposer_for(sequence)
        tokens = proposer.draft(sequence, num_tokens)
        self.requests.append((list(sequence), proposer))
        if len(self.requests) > self.max_requests:
            self.requests.pop(0)
        return tokens

    def _proposer_for(self, sequence: list[int]) -> NGramProposer:
        best, best_len = None, -1
        for i, (seen, proposer) in enumerate(self.requests):
            if len(seen) > best_len and len(seen) <= len(sequence) and sequence[: len(seen)] == seen:
                best, best_len = i, len(seen)
        if best is not None:
            return self.requests.pop(best)[1]
        return NGramProposer(self.settings, self.public)


def settings_from_recipe(recipe) -> NGramSettings:
    """NGramSettings of a recipe whose draft.kind is ngram; a null key takes the default above, a null
    max_draft_len takes speculative.num_draft_tokens."""
    d = recipe.draft
    given = {f: getattr(d, f) for f in FIELDS if getattr(d, f) is not None}
    return NGramSettings(**{"max_draft_len": recipe.speculative.num_draft_tokens, **given})


def to_parameters(settings: NGramSettings) -> dict[str, str]:
    """The settings as Triton model parameters (ngram_draft.py reads them with `from_parameters`)."""
    return {
        f: str(getattr(settings, f)).lower() if isinstance(getattr(settings, f), bool) else str(getattr(settings, f))
        for f in FIELDS
    }


def from_parameters(params: dict[str, str]) -> NGramSettings:
    flag = lambda name: params[name].strip().lower() == "true"  # noqa: E731
    return NGramSettings(
        int(params["max_draft_len"]),
        int(params["max_matching_ngram_size"]),
        flag("is_keep_all"),
        flag("is_use_oldest"),
        flag("is_public_pool"),
        int(params.get("min_matching_ngram_size", "1")),
    )


class SuffixLookup:
    """The request's own text as a draft, tried before an EAGLE-3 head: TensorRT-LLM's suffix automaton enhancement
    (`Eagle3DecodingConfig.sa_config`, `SAEnhancerConfig.threshold`), with its rule: where the longest suffix of the
    sequence that occurred earlier (prompt or output) is at least `threshold` tokens long, the tokens that followed
    its first occurrence are the round's drafts, and the head's are not used (`sa_enhancer.py`: the override when
    match_len >= threshold; `suffixAutomaton.h` `lookup()`: the state's pos, set where the state was created, is
    where the substring first ended). The head does not draft such a round at all here (TensorRT-LLM runs it and
    discards its drafts): its catch-up waits for the next round it drafts.

    One per request, fed every token of its sequence in order (`extend`); a lookup follows each earlier occurrence
    of the last token back at most MAX_MATCH tokens (a suffix automaton finds the match in constant time; at the
    sequence lengths of this engine the walk costs less than a target step's thousandth)."""

    MAX_MATCH = 64  # matches are compared up to this length (two longer ones: the first of them, as if equal)

    def __init__(self, threshold: int, tokens: list[int] | None = None, max_match: int = MAX_MATCH):
        assert 1 <= threshold <= max_match, (threshold, max_match)
        self.threshold = threshold
        self.max_match = max_match
        self.tokens: list[int] = []
        self._positions: dict[int, list[int]] = {}  # token -> where it occurs, in order
        self.extend(tokens or [])

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self._positions.setdefault(token, []).append(len(self.tokens))
            self.tokens.append(token)

    def draft(self, num_tokens: int) -> list[int]:
        """Up to num_tokens tokens that followed the first occurrence of the longest earlier match of the sequence's
        suffix, if that match is at least `threshold` tokens long; else none."""
        seq, n = self.tokens, len(self.tokens)
        if num_tokens <= 0 or n < 2:
            return []
        best_len, best_end = 0, -1
        for end in self._positions[seq[-1]][:-1]:  # earlier occurrences of the last token, oldest first
            length = 1
            while length < self.max_match and length <= end and seq[end - length] == seq[n - 1 - length]:
                length += 1
            if length > best_len:  # strictly longer: the first occurrence keeps a tie
                best_len, best_end = length, end
        if best_len < self.threshold:
            return []
        return seq[best_end + 1 : best_end + 1 + num_tokens]


# ---------------------------------------------------------------- draft.kind suffix: the automaton alone


@dataclass(frozen=True)
class SuffixSettings:
    """TensorRT-LLM's SADecodingConfig (standalone suffix automaton, no draft model) as the CPU runs it.

    `max_matching_ngram_size` -1: the longest earlier match of the sequence's suffix, of any length, drafts (up to
    SuffixLookup.MAX_MATCH tokens compared, TensorRT-LLM's own cap for its global pool); n > 0: matches are
    compared over at most n tokens ("try ngram sizes from max down to 1", suffix_automaton.py extend_ngram).
    Either way the tokens that followed the match's first occurrence are the draft (SuffixLookup)."""

    max_draft_len: int = 4
    max_matching_ngram_size: int = -1

    def __post_init__(self):
        assert self.max_draft_len >= 1 and (self.max_matching_ngram_size == -1 or self.max_matching_ngram_size >= 1)

    @property
    def max_match(self) -> int:
        return SuffixLookup.MAX_MATCH if self.max_matching_ngram_size == -1 else self.max_matching_ngram_size

    def to_parameters(self) -> dict[str, str]:
        """As Triton model parameters (`suffix_from_parameters` reads them back)."""
        return {
            "draft_kind": "suffix",
            "max_draft_len": str(self.max_draft_len),
            "max_matching_ngram_size": str(self.max_matching_ngram_size),
        }


def suffix_settings_from_recipe(recipe) -> SuffixSettings:
    """SuffixSettings of a recipe whose draft.kind is suffix: a null max_draft_len takes
    speculative.num_draft_tokens, a null max_matching_ngram_size TensorRT-LLM's -1 (longest match)."""
    d = recipe.draft
    return SuffixSettings(
        d.max_draft_len if d.max_draft_len is not None else recipe.speculative.num_draft_tokens,
        d.max_matching_ngram_size if d.max_matching_ngram_size is not None else -1,
    )


def suffix_from_parameters(params: dict[str, str]) -> SuffixSettings:
    return SuffixSettings(int(params["max_draft_len"]), int(params["max_matching_ngram_size"]))


class SuffixProposer:
    """specdeploy.speculation.loop.Proposer for one request: the request's own text (prompt + output so far) through
    a SuffixLookup fed incrementally; drafts wherever any earlier match exists (the standalone automaton has no
    threshold). A sequence that is not a continuation of the last one (a new request) starts a new lookup."""

    def __init__(self, settings: SuffixSettings):
        self.settings = settings
        self.lookup: SuffixLookup | None = None

    def propose(
        self, sequence: list[int], num_tokens: int, sampling: SamplingParams | None = None, return_logits: bool = False
    ) -> Proposal:
        return Proposal(self.draft(sequence, num_tokens))

    def draft(self, sequence: list[int], num_tokens: int) -> list[int]:
        seen = self.lookup.tokens if self.lookup is not None else None
        if seen is None or len(seen) > len(sequence) or sequence[: len(seen)] != seen:
            self.lookup = SuffixLookup(1, [], self.settings.max_match)
            seen = self.lookup.tokens
        self.lookup.extend(sequence[len(seen) :])
        return self.lookup.draft(min(num_tokens, self.settings.max_draft_len))


class SuffixDrafts:
    """The suffix kind's tensorrt_llm_draft model (ngram_draft.py): each call sees the whole sequence, so the lookup
    is rebuilt from it (no state to find again; a call costs a pass over the sequence)."""

    def __init__(self, settings: SuffixSettings):
        self.settings = settings

    def draft(self, sequence: list[int], num_tokens: int) -> list[int]:
        return SuffixProposer(self.settings).draft(sequence, num_tokens)


def drafts_from_parameters(params: dict[str, str]) -> "NGramDrafts | SuffixDrafts":
    """The draft model's proposer from its Triton parameters: draft_kind suffix, else n-gram."""
    if params.get("draft_kind") == "suffix":
        return SuffixDrafts(suffix_from_parameters(params))
    return NGramDrafts(from_parameters(params))
