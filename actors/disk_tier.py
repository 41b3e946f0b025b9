"""The prompt cache's tiers, asked one way: memory and disk alike.

Each tier answers the prompt-cache actor (``prompt_cache.py``) the same way:

- ``nearest(tokens)``: an :class:`Offer`, the most of a prompt the tier
  serves (how many tokens, from where), or None; ``await offer.load()`` gives
  its caches (None: they could not be had, e.g. a bad file, then removed);
- ``keep(put)``: an entry the actor was given (memory stores it and says what
  it evicted; the disk queues its write where its policy says), and
  ``evicted(puts)``: what the tier above let go.

The actor takes the offer that serves the most (memory's on a tie) and keeps
only what spans the tiers (the pins, the budget's ceiling, the figures). Memory
is ``prompt_cache.MemoryTier``; the disk is :class:`Disk` here, with its whole
policy: which entries are written and when (``disk_cache.LONG_PREFIX`` soon
after their put, ``disk_cache.WRITE_DELAY``; any other that memory evicts at
once), and that an entry on its way to disk serves from memory until written
(``DiskWriter.held``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import trio
from mlx_lm.models.cache import trim_prompt_cache

from . import disk_cache
from .disk_cache import BadFile, DiskEntry, DiskTier, as_tokens
from .disk_writer import DiskWriter
from .gpu import Gpu
from .messages import PUT_MIN_PROMPT, Put
from .request import CacheReport, CacheTier
from .stats import Count, Gauge, Metric, Observe, Stats
from .step.kv import clone


@attrs.frozen
class Offer:
    """What a tier can serve of a prompt: ``usable`` tokens from ``tier``."""

    usable: int
    tier: CacheTier
    load: Callable[[], Awaitable[list[Any] | None]] = attrs.field(repr=False)
    report: CacheReport | None = None  # memory's: why that much (the others' start from it)


def ready(caches: list[Any] | None) -> Callable[[], Awaitable[list[Any] | None]]:
    """A ``load`` for caches already in hand (memory takes as it searches)."""

    async def load() -> list[Any] | None:
        return caches

    return load


@attrs.define(eq=False)
class Disk:
    """The disk tier as the actor asks it: the files (``disk_cache.DiskTier``),
    the queue of entries on their way (``DiskWriter``), and when an entry goes.
    ``moved`` is called after each write (written or not)."""

    index: DiskTier
    gpu: Gpu
    stats: Stats
    moved: Callable[[], None]
    writer: DiskWriter = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.writer = DiskWriter(self.index, self.gpu, self.stats, self._written)

    async def run(self) -> None:
        """The writer task, until cancelled."""
        await self.writer.run()

    @property
    def busy(self) -> bool:
        return self.writer.busy

    async def nearest(self, tokens: Sequence[int]) -> Offer | None:
        """The queue's entry or the file serving most of ``tokens`` (the queue's
        on a tie: its KV is in memory yet, no load)."""
        mine = as_tokens(tokens)
        held, kept = self.writer.held(mine)
        entry, usable = self.index.nearest(mine)
        if held is not None and kept > 0 and kept >= usable:
            trim = len(held.tokens) - kept

            async def cut() -> list[Any] | None:
                return await self.gpu.call_here(_cut, held.caches, trim)

            return Offer(kept, CacheTier.MEMORY, cut)
        if entry is not None and usable > 0:

            async def load() -> list[Any] | None:
                return await self._load(entry, len(entry.tokens) - usable)

            return Offer(usable, CacheTier.DISK, load)
        return None

    def keep(self, put: Put) -> None:
        """An entry memory was given: a long one is written ``WRITE_DELAY`` after
        its put, unless the conversation's next turn supersedes it first."""
        if len(put.tokens) >= disk_cache.LONG_PREFIX:
            self.writer.queue(put.tokens, put.caches, put.kind, disk_cache.WRITE_DELAY)

    def evicted(self, puts: Sequence[Put]) -> None:
        """Entries memory evicted: each written at once, unless the disk holds it."""
        for put in puts:
            if len(put.tokens) >= PUT_MIN_PROMPT:
                self.writer.queue(put.tokens, put.caches, put.kind)

    def hurried(self) -> contextlib.AbstractContextManager[None]:
        """Within: every queued write is due now (the actor's flush)."""
        return self.writer.hurried()

    def figures(self) -> None:
        self.stats.post(
            Gauge(Metric.PROMPT_CACHE_DISK_ENTRIES, len(self.index.entries)),
            Gauge(Metric.PROMPT_CACHE_DISK_BYTES, self.index.nbytes),
            Gauge(Metric.PROMPT_CACHE_DISK_CAP, self.index.cap),
            Gauge(Metric.PROMPT_CACHE_DISK_PENDING, self.writer.pending),
        )

    def _written(self) -> None:
        self.figures()
        self.moved()

    async def _load(self, entry: DiskEntry, trim: int) -> list[Any] | None:
        """One file's caches, cut back by ``trim`` tokens; None if the file is bad
        (then it is removed, with one log line)."""
        start = trio.current_time()
        # The writer may supersede or evict this entry while it loads (both
        # await): its file then stays until the load is done.
        self.index.reading(entry)
        try:
            await trio.to_thread.run_sync(self.index.verify, entry)
            caches = await self.gpu.call_here(_loaded, entry.path, trim)
        except (BadFile, ValueError, KeyError, RuntimeError) as exc:
            why = str(exc) if isinstance(exc, BadFile) else f"it does not load ({exc})"
            await trio.to_thread.run_sync(self.index.drop, entry.path, why)
            self.stats.post(Count(Metric.PROMPT_CACHE_DISK_BAD))
            self.figures()
            return None
        finally:
            if doomed := self.index.read(entry):  # unindexed while it loaded
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(disk_cache.remove, doomed)
        self.stats.post(
            Count(Metric.PROMPT_CACHE_DISK_HITS),
            Count(Metric.PROMPT_CACHE_DISK_READ_BYTES, entry.nbytes),
            Observe(Metric.PROMPT_CACHE_DISK_LOAD_TIME, trio.current_time() - start),
        )
        return caches


def _cut(caches: Sequence[Any], trim: int) -> list[Any]:
    """Clones of a held entry's caches, cut back by ``trim`` tokens (GPU thread)."""
    out = [clone(c) for c in caches]
    if trim:
        trim_prompt_cache(out, trim)
    return out


def _loaded(path: Any, trim: int) -> list[Any]:
    """A disk entry's caches, cut back by ``trim`` tokens (GPU thread)."""
    caches = disk_cache.load(path)
    if trim:
        trim_prompt_cache(caches, trim)
    return caches

