"""The executor's pool of KV caches: prefix reuse across calls (TensorRT-LLM's `enable_kv_cache_reuse`).

Finished requests leave their KV cache in a small LRU pool; a request whose input starts with cached tokens takes
that cache, truncated to the common prefix (the position pointer moves back), and computes only the suffix. The
speculative loop sends the whole sequence every round, so each round computes only its new tokens. Memory is
bounded by `max_sequences` caches of at most `cache_len` positions each (more only for a request that needs more).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence


@dataclass
class CachedSequence:
    """A KV cache and the tokens whose KV it holds (len(tokens) == cache.length)."""

    cache: object
    capacity: int
    tokens: list[int] = field(default_factory=list)
    drafter: object = None  # an eagle3.Eagle3Drafter: the head's rows 0..drafter.length-1 follow `tokens`
    # the EAGLE-3 head's aux features (the target's outputs at its aux layers) of positions 0..aux_length-1, kept by
    # an executor with a head from its fused passes and plain prefills (Executor.run_passes): a fused request that
    # reuses a prompt a plain request computed catches its head up from them instead of computing the prompt again
    aux: object = None  # torch.Tensor [capacity, len(aux layers) * hidden], allocated at the first store
    aux_length: int = 0

    def truncate(self, length: int) -> None:
        """Forget positions >= length; the head's row p reads the token at p + 1, so it keeps rows < length - 1."""
        self.roll_back(length)
        if self.drafter is not None and self.drafter.length > max(0, length - 1):
            self.drafter.truncate(max(0, length - 1))

    def roll_back(self, length: int) -> None:
        """Forget the target's positions >= length (KV, tokens, kept aux features); the head's rows stay as they are
        (the fused loop's own to manage within a request)."""
        self.cache.truncate(length)
        del self.tokens[length:]
        self.aux_length = min(self.aux_length, length)

    def store_aux(self, start: int, rows) -> None:
        """Keep the aux features `rows` [n, width] of positions start..start+n-1, where they extend the kept ones (a
        pass right after them) and fit the capacity; else leave the kept ones as they are."""
        n = int(rows.shape[0])
        if start != self.aux_length or start + n > self.capacity:
            return
        if self.aux is None or self.aux.shape[1] != rows.shape[1] or self.aux.dtype != rows.dtype:
            self.aux = rows.new_empty(self.capacity, rows.shape[1])
        self.aux[start : start + n] = rows
        self.aux_length = start + n

    def nbytes(self) -> int:
        """The KV cache's bytes (where it reports them) and the kept aux features'."""
        kv = int(self.cache.nbytes()) if hasattr(self.cache, "nbytes") else 0
        return kv + (self.aux.numel() * self.aux.element_size() if self.aux is not None else 0)


def reusable_prefix_len(cached_tokens: Sequence[int], input_ids: Sequence[int]) -> int:
    """How many leading input positions can keep their cached KV.

    The common prefix of the cached tokens and the input, less at least one position: the last
    input token is always run, since its logits choose the next token.

    This is also where the one subtle step of speculative decoding is handled. The draft samples
    its k tokens one after another and feeds each back except the last: its cache ends at
    sequence + d1..d(k-1). When the target accepts every draft token, the next round's sequence is
    sequence + d1..dk + t (t the target's own token), so the draft has never seen its own last token
    dk: the common prefix stops before dk and both dk and t (two positions) are computed. A loop
    that assumed "one new token per round" would run t at dk's position and silently diverge.
    """
    limit = min(len(cached_tokens), len(input_ids) - 1)
    if limit <= 0:
        return 0
    if cached_tokens[:limit] == input_ids[:limit]:  # the common case: input extends the cache
        return limit
    n = 0
    while n < limit and cached_tokens[n] == input_ids[n]:
        n += 1
    return n


class KvPool:
    """Finished sequences' KV caches, least recently used first: `acquire` takes the best one out, `release` puts
    it back. Thread-safe: a BatchScheduler's thread and the callers of `Executor.generate` share one pool."""

    def __init__(self, new_cache: Callable[[int], object], max_sequences: int, cache_len: int):
        self.new_cache = new_cache  # capacity -> an empty engine cache
        self.max_sequences = max_sequences
        self.cache_len = cache_len
        self._pool: OrderedDict[int, CachedSequence] = OrderedDict()  # LRU order: oldest first
        self._next_id = 0
        self._lock = threading.Lock()

    @property
    def cached_sequences(self) -> list[list[int]]:
        return [list(e.tokens) for e in self._pool.values()]

    def nbytes(self) -> int:
        """Bytes held by the pooled KV caches (caches that report `nbytes()`) and their kept aux features."""
        return sum(e.nbytes() for e in self._pool.values())

    def clear(self) -> None:
        with self._lock:
            self._pool.clear()

    def acquire(self, input_ids: list[int], needed: int) -> tuple[CachedSequence, int]:
        """Take the pool entry sharing the longest prefix with input_ids, rolled back to that prefix."""
        with self._lock:
            best_id, best_len = None, 0
            for entry_id, entry in self._pool.items():
                n = reusable_prefix_len(entry.tokens, input_ids)
                if n > best_len and entry.capacity >= needed:
                    best_id, best_len = entry_id, n
            if best_id is not None:
                entry = self._pool.pop(best_id)
                entry.truncate(best_len)  # the KV pointer moves back
                return entry, best_len
            if len(self._pool) >= self.max_sequences:
                _, victim = self._pool.popitem(last=False)  # evict the least recently used
                if victim.capacity >= needed:
                    victim.truncate(0)
                    return victim, 0
                del victim
        capacity = max(self.cache_len, needed)
        return CachedSequence(self.new_cache(capacity), capacity), 0

    def release(self, entry: CachedSequence) -> None:
        assert entry.cache.length == len(entry.tokens), (entry.cache.length, len(entry.tokens))
        with self._lock:
            self._pool[self._next_id] = entry
            self._next_id += 1
            while len(self._pool) > self.max_sequences:
                self._pool.popitem(last=False)
