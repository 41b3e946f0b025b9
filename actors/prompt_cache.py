"""The prompt-cache actor: KV caches of past prompts, shared without copying.

The store is mlx-lm's ``LRUPromptCache`` (a trie keyed by token ids, LRU under an
entry cap and a byte cap, entries typed ``system`` / ``user`` / ``assistant``
with mlx-lm's eviction preference). What is ours is the take:

- non-consuming and copy-free: a take returns a *clone* whose arrays are new
  handles onto the same buffers (``a[...]``), never the stored handles. mlx's
  ``__setitem__`` rewrites the handle it is called on, so a cache sharing a
  handle with the store would write into the store's buffer; a view handle
  copies on its first write instead (``tests/test_prompt_cache.py`` shows both);
- usable only as a strict prefix of the prompt (at least the last token must
  still be forwarded to get logits): a longer or equal entry is trimmed to
  the shared prefix where every layer allows it (plain KV, a ring not yet
  wrapped); recurrent state and wrapped rings match exactly or not at all.

Every mlx touch (clone, trim, byte counts) runs on the GPU thread, called from
this actor's own task only, so the store has one owner.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import enum
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import trio
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from .errors import RanksLost
from .gpu import Gpu
from .ranks import Mirrored, mirrored
from .request import CacheReason, CacheReport
from .row import Row
from .stats import Count, Gauge, Metric, Stats

MAILBOX_SIZE = 4096
KEY = "model"  # one model per engine: the trie's model key is a constant

# A finished row's KV is handed to the prompt cache when its prompt has at least
# this many tokens (shorter ones are cheaper to recompute than to store; a merged
# row's must also be copied out of the batch first).
PUT_MIN_PROMPT = 16


def worth_keeping(row: Row) -> bool:
    """Whether an ended row's KV goes to the prompt cache (both lanes)."""
    return row.end is not None and row.end.reason.finished and len(row.prompt) >= PUT_MIN_PROMPT


def clone(cache: Any) -> Any:
    """A copy of one layer's cache object whose arrays are view handles (no KV copied)."""
    import mlx.core as mx

    new = copy.copy(cache)
    for name, value in vars(cache).items():
        if isinstance(value, mx.array):
            setattr(new, name, value[...])
        elif isinstance(value, list | tuple) and value:
            items = [
                v[...] if isinstance(v, mx.array) else clone(v) if hasattr(v, "state") else v
                for v in value
            ]
            setattr(new, name, type(value)(items))
    return new


@attrs.frozen
class Hit:
    caches: list[Any] | None  # None: nothing usable
    cached: int  # prompt tokens already in ``caches``
    report: CacheReport | None = None  # why that much (and no more)


# Evicted entries' token ids (no KV) kept to tell "evicted" from "never cached".
EVICTED_KEPT = 32


class _RecordingLRU:
    """mlx-lm's LRU order, noting the tokens of every entry it gives up (its
    ``pop`` is only called to evict, by entry count or bytes)."""

    def __init__(self, inner: Any, evicted: collections.deque) -> None:
        self._inner, self._evicted = inner, evicted

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def pop(self) -> Any:
        model, tokens = self._inner.pop()
        self._evicted.append(np.asarray(tokens))
        return model, tokens


@mirrored(Mirrored.STORE)
class Store(LRUPromptCache):
    """mlx-lm's LRU prompt cache with a copy-free, prefix-strict take (GPU thread)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._evicted: collections.deque = collections.deque(maxlen=EVICTED_KEPT)
        self._lru = _RecordingLRU(self._lru, self._evicted)

    def take(self, tokens: list[int]) -> Hit:
        """The longest usable cached prefix of ``tokens``, with its report."""
        found = self._trie.search(KEY, tokens)
        hit = self._take(tokens, found)
        shared = max(found.common_prefix, len(found.shorter or ()), hit.cached)
        if found.exact is not None:
            shared = len(tokens)
        return attrs.evolve(hit, report=self._report(tokens, shared, hit.cached))

    def _report(self, tokens: list[int], shared: int, cached: int) -> CacheReport:
        if cached >= len(tokens) - 1:
            return CacheReport(CacheReason.FULL, cached, shared)
        if shared > cached:
            return CacheReport(CacheReason.NOT_TRIMMABLE, cached, shared, diverged_at=cached)
        gone = 0
        if self._evicted:  # vectorised: this runs on the GPU thread, per partial miss
            mine = np.asarray(tokens)
            gone = max(_shared_array(mine, old) for old in self._evicted)
        if gone > shared:
            return CacheReport(CacheReason.EVICTED, cached, gone, diverged_at=cached)
        reason = CacheReason.DIVERGED if shared else CacheReason.NO_ENTRY
        return CacheReport(reason, cached, shared, diverged_at=shared)

    def _take(self, tokens: list[int], found: Any) -> Hit:
        limit = len(tokens) - 1  # the last prompt token is always forwarded
        short = len(found.shorter) if found.shorter is not None else 0
        candidates = []
        if found.exact is not None:
            candidates.append((found.exact, limit))
        if found.longer is not None:
            candidates.append((found.longer, min(limit, found.common_prefix)))
        for key, usable in candidates:
            if usable <= short:
                continue
            entry = self._trie.get(KEY, key)
            if can_trim_prompt_cache(entry.prompt_cache):
                caches = [clone(c) for c in entry.prompt_cache]
                trim_prompt_cache(caches, len(key) - usable)
                self._touch(key)
                return Hit(caches, usable)
        if 0 < short <= limit:
            entry = self._trie.get(KEY, found.shorter)
            self._touch(found.shorter)
            return Hit([clone(c) for c in entry.prompt_cache], short)
        return Hit(None, 0)

    def _touch(self, tokens: list[int]) -> None:
        """Move an entry to the young end of its LRU."""
        entry = self._trie.get(KEY, tokens)
        self._lru.remove(KEY, tokens)
        self._lru.push(KEY, tokens, entry.cache_type)

    def put(self, tokens: list[int], caches: list[Any], kind: EntryKind, ceiling: int) -> None:
        self.insert_cache(KEY, list(tokens), caches, cache_type=kind)
        self.trim_to(n_bytes=ceiling)

    def trim_bytes(self, ceiling: int) -> None:
        self.trim_to(n_bytes=ceiling)


class EntryKind(enum.StrEnum):
    """mlx-lm's entry types, which set its eviction preference (a str enum: the
    store takes the string)."""

    SYSTEM = "system"  # a boundary snapshot: a prefix that later prompts share
    USER = "user"
    ASSISTANT = "assistant"  # a finished row: its prompt and its answer


@attrs.frozen
class Take:
    tokens: list[int] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    reply: trio.MemorySendChannel = attrs.field(repr=False)  # gets one Hit


@attrs.frozen
class Put:
    tokens: list[int] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    caches: list[Any] = attrs.field(repr=False)
    kind: EntryKind = EntryKind.ASSISTANT


@attrs.frozen
class Trim:
    """Keep at most ``max_bytes`` (the budget minus the live batch)."""

    max_bytes: int


@attrs.define(eq=False)
class PromptCacheActor:
    gpu: Gpu
    stats: Stats
    inbox: trio.MemoryReceiveChannel
    max_entries: int = 10
    max_bytes: int = 1 << 62
    _store: Store = attrs.field(init=False)
    _ceiling: int = attrs.field(init=False)  # the budget's share, lowered by Trim

    def __attrs_post_init__(self) -> None:
        self._store = Store(max_size=self.max_entries, max_bytes=self.max_bytes)
        self._ceiling = self.max_bytes

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self.inbox:
            task_status.started()
            async for message in self.inbox:
                await self.dispatch(message)
                self.stats.post(
                    Gauge(Metric.PROMPT_CACHE_ENTRIES, len(self._store)),
                    Gauge(Metric.PROMPT_CACHE_BYTES, self._store.nbytes),
                )

    async def dispatch(self, message: Take | Put | Trim) -> None:
        match message:
            case Take(tokens, reply):
                try:
                    hit = await self.gpu.call(self._store.take, tokens)
                except RanksLost:  # the call never ran
                    hit = Hit(None, 0)
                if hit.caches is None:
                    self.stats.post(Count(Metric.PROMPT_CACHE_MISSES))
                else:
                    self.stats.post(
                        Count(Metric.PROMPT_CACHE_HITS),
                        Count(Metric.PROMPT_CACHE_HIT_TOKENS, hit.cached),
                    )
                # The asker may be gone (cancelled): then the clone just drops.
                with reply, contextlib.suppress(trio.BrokenResourceError, trio.WouldBlock):
                    reply.send_nowait(hit)
            case Put(tokens, caches, kind):
                with contextlib.suppress(RanksLost):
                    await self.gpu.call(self._store.put, tokens, caches, kind, self._ceiling)
            case Trim(max_bytes):
                self._ceiling = min(self.max_bytes, max(0, max_bytes))
                with contextlib.suppress(RanksLost):
                    await self.gpu.call(self._store.trim_bytes, self._ceiling)
            case _:
                raise TypeError(f"prompt cache got an unexpected message: {message!r}")


def _shared_array(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two prompts share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


async def take(to_cache: trio.MemorySendChannel | None, tokens: list[int]) -> Hit:
    """Ask the prompt cache (through its mailbox) for the longest usable cached
    prefix of ``tokens``: a request-reply any actor can make from its own task."""
    if to_cache is None:
        return Hit(None, 0, CacheReport(CacheReason.DISABLED))
    send, receive = trio.open_memory_channel(1)
    await to_cache.send(Take(tokens, send))
    with receive:
        try:
            return await receive.receive()
        except trio.EndOfChannel:
            return Hit(None, 0)
