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

Memory (:class:`MemoryTier`) and, with one, the disk (``disk_tier.Disk``) are
asked one way (``disk_tier``: ``nearest``, an offer's ``load``, ``keep``): a take
is served by the tier that serves the most of the prompt, memory on a tie. What
goes to disk and when is the disk's own policy, not this actor's. What spans
the tiers stays here: each agent session's latest entry is pinned while the
session is active (see ``PIN_SECONDS``), and the budget's ceiling.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import trio
from mlx_lm.models.cache import (
    LRUPromptCache,
    PromptTrieResult,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

from .disk_cache import DiskTier, shared_length
from .disk_tier import Disk, Offer, ready
from .errors import RanksLost
from .gpu import Gpu
from .messages import PUT_MIN_PROMPT, EntryKind, Hit, Pin, Put, Take, Trim
from .ranks import Mirrored, mirrored
from .request import CacheReason, CacheReport, CacheTier
from .stats import Count, Gauge, Metric, Stats
from .step.kv import clone

log = logging.getLogger("mlx_nursery.engine")

MAILBOX_SIZE = 4096
KEY = "model"  # one model per engine: the trie's model key is a constant


# A session's latest entry of each class is pinned (evicted only when nothing else is
# left) while it was seen this recently: an agent's next turn comes within seconds.
PIN_SECONDS = 120.0

# Evicted entries' token ids (no KV) kept to tell "evicted" from "never cached".
EVICTED_KEPT = 32


class _RecordingLRU:
    """mlx-lm's LRU order, noting every entry it gives up (its ``pop`` is only
    called to evict, by entry count or bytes): the tokens (no KV) to tell
    "evicted" from "never cached", and with ``spill`` on, the whole entry, for
    the disk tier to write."""

    def __init__(self, inner: Any, store: Store) -> None:
        self._inner, self._store = inner, store

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def pop(self) -> Any:
        model, tokens = self._pop_unpinned()
        store = self._store
        store.evicted.append(np.asarray(tokens))
        store.evictions += 1
        if store.spill:
            entry = store._trie.get(KEY, tokens)
            store.spilled.append(Put(list(tokens), entry.prompt_cache, EntryKind(entry.cache_type)))
        return model, tokens

    def _pop_unpinned(self) -> Any:
        """mlx-lm's choice of victim, passing over pinned entries while another is
        left (they go back to their old ends, in order). When every entry is
        pinned, the worst class's go first (a main agent's history last), and
        within it the one being put if it is among them, else the oldest: a
        session that puts every half second (a sub-agent fan-out) would otherwise
        evict another session's history the moment their pins outgrow the cap."""
        passed, pinned = [], self._store.pinned
        try:
            while True:
                model, tokens = self._inner.pop()
                if tuple(tokens) not in pinned:
                    return model, tokens
                passed.append((model, tokens))
                if not len(self._inner):  # every entry is pinned
                    worst = max(pinned[tuple(t)] for _, t in passed)
                    putting = (i for i, (_, t) in enumerate(passed)
                               if tuple(t) == self._store.putting
                               and pinned[tuple(t)] == worst)  # fmt: skip
                    oldest = (i for i, (_, t) in enumerate(passed) if pinned[tuple(t)] == worst)
                    at = next(putting, None)
                    return passed.pop(next(oldest) if at is None else at)
        finally:
            for model, tokens in reversed(passed):
                kind = self._store._trie.get(KEY, tokens).cache_type
                self._inner._lrus[kind].appendleft((model, tokens))


@mirrored(Mirrored.STORE)
class Store(LRUPromptCache):
    """mlx-lm's LRU prompt cache with a copy-free, prefix-strict take (GPU thread)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.evicted: collections.deque = collections.deque(maxlen=EVICTED_KEPT)
        self.evictions = 0  # entries evicted so far
        # With a disk tier: the entries evicted since the actor last took them.
        # Read and cleared by the actor between its GPU calls (it owns the store).
        self.spill = False
        self.spilled: list[Put] = []
        # Entries (token tuples) eviction passes over while any other is left: each
        # active session's latest. Set by every put and trim (an argument, so a
        # sharded engine's followers evict alike).
        self.pinned: Mapping[tuple[int, ...], int] = {}  # entry -> its pin's class
        self.putting: tuple[int, ...] | None = None  # the entry a put is inserting
        self._lru = _RecordingLRU(self._lru, self)

    def take(self, tokens: list[int]) -> Hit:
        """The longest usable cached prefix of ``tokens``, with its report."""
        found = self._search(tokens)
        hit = self._take(tokens, found)
        shared = max(found.common_prefix, len(found.shorter or ()), hit.cached)
        if found.exact is not None:
            shared = len(tokens)
        return attrs.evolve(hit, report=self._report(tokens, shared, hit.cached))

    def _search(self, tokens: list[int]) -> PromptTrieResult:
        """mlx-lm's ``PromptTrie.search``, its longer match found by comparing the
        entries' tokens (vectorised) where mlx-lm walks every branch below the
        point of divergence, copying the path at each node: quadratic in an
        entry's length, 2 to 7 s of the GPU thread (every row waits) for a
        46k-token prompt diverging from a longer one (a sub-agent from its main
        agent; tests/test_prompt_cache.py)."""
        node, last, index = self._trie._trie.get(KEY, {}), -1, 0
        if not tokens and "__value__" in node:
            return PromptTrieResult(KEY, [], None, None, 0)
        while index < len(tokens) and tokens[index] in node:
            node = node[tokens[index]]
            if "__value__" in node:
                last = index
            index += 1
        if last == len(tokens) - 1 >= 0:
            return PromptTrieResult(KEY, tokens, None, None, 0)
        shorter = tokens[: last + 1] if last > 0 else None
        longer = None
        if index > 0:  # the shortest entry through the node where the walk stopped
            mine = np.asarray(tokens[:index])
            through = [held for lru in self._lru._lrus.values() for _, held in lru
                       if len(held) >= index and shared_length(mine, np.asarray(held[:index]))
                       == index]  # fmt: skip
            if through:
                longer = tokens[:index] + list(min(through, key=len)[index:])
        return PromptTrieResult(KEY, None, shorter, longer, index)

    def _report(self, tokens: list[int], shared: int, cached: int) -> CacheReport:
        if cached >= len(tokens) - 1:
            return CacheReport(CacheReason.FULL, cached, shared, tier=CacheTier.MEMORY)
        if shared > cached:
            return CacheReport(CacheReason.NOT_TRIMMABLE, cached, shared, diverged_at=cached,
                               tier=CacheTier.MEMORY)  # fmt: skip
        gone = 0
        if self.evicted:  # vectorised: this runs on the GPU thread, per partial miss
            mine = np.asarray(tokens)
            gone = max(shared_length(mine, old) for old in self.evicted)
        if gone > shared:
            return CacheReport(CacheReason.EVICTED, cached, gone, diverged_at=cached,
                               tier=CacheTier.MEMORY if cached else None)  # fmt: skip
        reason = CacheReason.DIVERGED if shared else CacheReason.NO_ENTRY
        return CacheReport(reason, cached, shared, diverged_at=shared,
                           tier=CacheTier.MEMORY if cached else None)  # fmt: skip

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

    def put(
        self, tokens: list[int], caches: list[Any], kind: EntryKind, ceiling: int,
        pinned: Mapping[tuple[int, ...], int] = types.MappingProxyType({}),
    ) -> None:  # fmt: skip
        self.pinned, self.putting = pinned, tuple(tokens)
        try:
            self.insert_cache(KEY, list(tokens), caches, cache_type=kind)
            self.trim_to(n_bytes=ceiling)
        finally:
            self.putting = None

    def trim_bytes(
        self, ceiling: int, pinned: Mapping[tuple[int, ...], int] = types.MappingProxyType({})
    ) -> None:
        self.pinned = pinned
        self.trim_to(n_bytes=ceiling)


@attrs.define(eq=False)
class MemoryTier:
    """Memory as the actor asks a tier (``disk_tier``): the store, touched on
    the GPU thread only. Its search and its take are one call: an offer from
    memory comes with its caches already cloned."""

    store: Store
    gpu: Gpu
    stats: Stats

    async def nearest(self, tokens: list[int]) -> Offer:
        hit = await self.gpu.call(self.store.take, tokens)
        return Offer(hit.cached, CacheTier.MEMORY, ready(hit.caches), hit.report)

    async def keep(self, put: Put, ceiling: int, pinned: Mapping) -> list[Put]:
        """Store ``put``, within ``ceiling`` bytes; what that evicted."""
        with contextlib.suppress(RanksLost):
            await self.gpu.call(self.store.put, put.tokens, put.caches, put.kind, ceiling, pinned)
        return self._evicted()

    async def trim(self, ceiling: int, pinned: Mapping) -> list[Put]:
        """Evict down to ``ceiling`` bytes; what that evicted."""
        with contextlib.suppress(RanksLost):
            await self.gpu.call(self.store.trim_bytes, ceiling, pinned)
        return self._evicted()

    def _evicted(self) -> list[Put]:
        """Count what the store evicted; those with KV kept for a tier below."""
        store = self.store
        if store.evictions:
            self.stats.post(Count(Metric.PROMPT_CACHE_EVICTIONS, store.evictions))
            store.evictions = 0
        spilled, store.spilled = store.spilled, []
        return spilled


@attrs.define(eq=False)
class PromptCacheActor:
    gpu: Gpu
    stats: Stats
    inbox: trio.MemoryReceiveChannel
    max_entries: int = 10
    max_bytes: int = 1 << 62
    disk: DiskTier | None = None  # the disk tier's files, or None
    _memory: MemoryTier = attrs.field(init=False)
    _disk: Disk | None = attrs.field(default=None, init=False)  # asked as memory is
    _ceiling: int = attrs.field(init=False)  # the budget's share, lowered by Trim
    # Each pin's (a session's, by class) latest entry and when it was last seen (a
    # put or a take): pinned while seen within PIN_SECONDS.
    _pins: dict[Pin, tuple[tuple[int, ...], float]] = attrs.field(factory=dict, init=False)
    _handling: bool = attrs.field(default=False, init=False)  # a message in hand
    _moved: trio.Event = attrs.field(factory=trio.Event, init=False)  # set after each

    def __attrs_post_init__(self) -> None:
        store = Store(max_size=self.max_entries, max_bytes=self.max_bytes)
        store.spill = self.disk is not None
        self._memory = MemoryTier(store, self.gpu, self.stats)
        self._ceiling = self.max_bytes
        if self.disk is not None:
            self._disk = Disk(self.disk, self.gpu, self.stats, self._step)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self.inbox:
            async with trio.open_nursery() as nursery:
                if self._disk is not None:
                    nursery.start_soon(self._disk.run)
                    self._disk.figures()
                task_status.started()
                async for message in self.inbox:
                    self._handling = True
                    await self.dispatch(message)
                    self._handling = False
                    self._step()
                    store = self._memory.store
                    self.stats.post(
                        Gauge(Metric.PROMPT_CACHE_ENTRIES, len(store)),
                        Gauge(Metric.PROMPT_CACHE_BYTES, store.nbytes),
                        Gauge(Metric.PROMPT_CACHE_CEILING, min(self._ceiling, self.max_bytes)),
                    )
                await self.flush()
                nursery.cancel_scope.cancel()

    async def dispatch(self, message: Take | Put | Trim) -> None:
        match message:
            case Take(tokens, reply, session):
                self._seen(session)
                hit = await self._take(tokens)
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
            case Put(tokens, _, _, session):
                self._seen(session, tokens)
                evicted = await self._memory.keep(message, self._ceiling, self._pinned())
                if self._disk is not None:
                    self._disk.keep(message)
                    self._disk.evicted(evicted)
            case Trim(max_bytes):
                self._ceiling = min(self.max_bytes, max(0, max_bytes))
                evicted = await self._memory.trim(self._ceiling, self._pinned())
                if self._disk is not None:
                    self._disk.evicted(evicted)
            case _:
                raise TypeError(f"prompt cache got an unexpected message: {message!r}")

    def _seen(self, session: Pin | None, tokens: list[int] | None = None) -> None:
        if session is None:
            return
        now = trio.current_time()
        if tokens is not None and len(tokens) >= PUT_MIN_PROMPT:
            self._pins[session] = (tuple(tokens), now)
        elif session in self._pins:
            self._pins[session] = (self._pins[session][0], now)

    def _pinned(self) -> dict[tuple[int, ...], int]:
        """The latest entry of every pin seen within PIN_SECONDS (the others are
        forgotten), with its class: when only pinned entries are left, the worst
        class goes first (a main agent's history last)."""
        since = trio.current_time() - PIN_SECONDS
        self._pins = {s: pin for s, pin in self._pins.items() if pin[1] >= since}
        out: dict[tuple[int, ...], int] = {}
        for (_, klass), (key, _) in self._pins.items():
            out[key] = min(out.get(key, int(klass)), int(klass))
        return out

    async def _take(self, tokens: list[int]) -> Hit:
        """The tier that serves the most of the prompt (memory on a tie)."""
        try:
            memory = await self._memory.nearest(tokens)
        except RanksLost:  # the call never ran
            return Hit(None, 0)
        if self._disk is not None:
            offer = await self._disk.nearest(tokens)
            if offer is not None and offer.usable > memory.usable:
                caches = await offer.load()
                if caches is not None:
                    report = _served(memory.report, tokens, offer.usable, offer.tier)
                    return Hit(caches, offer.usable, report)
        return Hit(await memory.load(), memory.usable, memory.report)

    def _step(self) -> None:
        self._moved.set()
        self._moved = trio.Event()

    async def flush(self, seconds: float = math.inf) -> bool:
        """Wait (up to ``seconds``) until every message is handled and every queued
        write is on disk. False when time ran out (True at once without a disk)."""
        hurried = self._disk.hurried() if self._disk else contextlib.nullcontext()
        with hurried, trio.move_on_after(seconds):
            while self._busy():
                await self._moved.wait()
            return True
        return False

    def _busy(self) -> bool:
        """A message in hand or waiting, or a disk write queued or under way."""
        writing = self._disk is not None and self._disk.busy
        return writing or self._handling or bool(self.inbox.statistics().current_buffer_used)


def _served(report: CacheReport | None, tokens: Sequence[int], usable: int,
            tier: CacheTier) -> CacheReport:  # fmt: skip
    """Memory's report for a take another source served ``usable`` tokens of."""
    report = report or CacheReport(CacheReason.NO_ENTRY)
    full = usable >= len(tokens) - 1
    return attrs.evolve(
        report,
        reason=CacheReason.FULL if full else report.reason,
        cached=usable,
        shared=max(report.shared, usable),
        diverged_at=None if full else max(usable, report.diverged_at or 0),
        tier=tier,
    )
