"""The disk tier's write-back queue and its one writer task.

The prompt-cache actor queues an entry (:meth:`DiskWriter.queue`): a long one
``disk_cache.WRITE_DELAY`` seconds after its put, one memory evicted at once.
One task (:meth:`DiskWriter.run`, in the actor's nursery) drains the queue, a due
entry at a time: frozen on the GPU thread (plain KV cut to length, evaluated),
written on a worker thread, so no write waits on the GPU thread or blocks the
loop. Until it is written an entry's KV is still in memory, and a take may be
served from it (:meth:`DiskWriter.held`). A flush (:meth:`DiskWriter.hurried`)
makes every queued write due at once.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import numpy as np
import trio
from mlx_lm.models.cache import can_trim_prompt_cache

from . import disk_cache
from .disk_cache import DiskTier, as_tokens, holds
from .gpu import Gpu
from .stats import Count, Metric, Stats

log = logging.getLogger("mlx_nursery.engine")


@attrs.define(eq=False)
class PendingWrite:
    """An entry queued for the disk: its KV held in memory until written."""

    tokens: np.ndarray = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    caches: list[Any] = attrs.field(repr=False)
    kind: str
    trimmable: bool
    due: float  # trio time: written no sooner (a longer entry may supersede it first)

    def covers(self, tokens: np.ndarray) -> bool:
        return holds(self.tokens, self.trimmable, tokens)

    def usable(self, prompt: np.ndarray) -> int:
        return disk_cache.serves(self.tokens, self.trimmable, prompt)


@attrs.define(eq=False)
class DiskWriter:
    """The queue of entries on their way to ``disk``, and the task writing them.

    ``done`` is called after each write (written or not): the actor posts its
    figures and wakes whoever waits for the queue to move."""

    disk: DiskTier
    gpu: Gpu
    stats: Stats
    done: Callable[[], None]
    _pending: list[PendingWrite] = attrs.field(factory=list, init=False)
    _writing: PendingWrite | None = attrs.field(default=None, init=False)  # in hand
    _wake: trio.Event = attrs.field(factory=trio.Event, init=False)  # a write was queued
    _hurry: bool = attrs.field(default=False, init=False)  # flushing: every write is due

    @property
    def pending(self) -> int:
        """Entries queued, not yet in hand."""
        return len(self._pending)

    @property
    def busy(self) -> bool:
        """A write is queued or under way."""
        return bool(self._pending) or self._writing is not None

    def queue(self, tokens: list[int], caches: list[Any], kind: str, delay: float = 0.0) -> None:
        """Queue an entry's write, due in ``delay`` seconds. Where a queued write
        holds it already, that one falls due no later: memory evicting an entry
        whose put queued it (its session's pinned latest, when the pins outgrew
        the cap) must not wait out the put's delay, or the session's next turn
        a second later finds neither memory nor disk holding it."""
        mine = as_tokens(tokens)
        due = trio.current_time() + delay
        if self.disk.covered(mine):
            return
        holding = [p for p in self._pending if p.covers(mine)]
        for p in holding:
            p.due = min(p.due, due)
        if holding:
            self._wake.set()
            return
        job = PendingWrite(mine, caches, str(kind), can_trim_prompt_cache(caches), due)
        # A longer entry that can be cut back makes a queued prefix of it moot.
        kept = [p for p in self._pending if not (job.trimmable and job.covers(p.tokens))]
        self._pending = [*kept, job]
        while len(self._pending) > disk_cache.MAX_PENDING:
            self._pending.pop(0)
            self.stats.post(Count(Metric.PROMPT_CACHE_DISK_DROPPED))
        self._wake.set()

    def held(self, prompt: np.ndarray) -> tuple[PendingWrite | None, int]:
        """The queued (or writing) entry serving most of ``prompt``, and how many
        tokens: its KV is in memory yet."""
        jobs = [*self._pending, *([] if self._writing is None else [self._writing])]
        return disk_cache.serving_most(jobs, prompt)

    @contextlib.contextmanager
    def hurried(self) -> Iterator[None]:
        """Within: every queued write is due now (a flush)."""
        self._hurry = True
        self._wake.set()
        try:
            yield
        finally:
            self._hurry = False

    async def run(self) -> None:
        """Drain the queue, one due entry at a time, until cancelled."""
        while True:
            job = self._next_due()
            if job is None:
                await self._nudged()
                continue
            self._pending.remove(job)
            self._writing = job
            try:
                await self._write(job)
            finally:
                self._writing = None
                self.done()

    def _next_due(self) -> PendingWrite | None:
        if not self._pending:
            return None
        job = min(self._pending, key=lambda p: p.due)
        return job if self._hurry or job.due <= trio.current_time() else None

    async def _nudged(self) -> None:
        """Wait for a new write, a flush, or the next write falling due."""
        due = min((p.due for p in self._pending), default=math.inf)
        with trio.move_on_at(due):
            await self._wake.wait()
        self._wake = trio.Event()

    async def _write(self, job: PendingWrite) -> None:
        disk = self.disk
        try:
            frozen = await self.gpu.call_here(disk_cache.freeze, job.caches)
            if frozen is None or frozen.nbytes > disk.cap:
                self.stats.post(Count(Metric.PROMPT_CACHE_DISK_DROPPED))
                return
            entry = await trio.to_thread.run_sync(disk.write, job.tokens, frozen, job.kind)
        except Exception as exc:  # a full disk, a lost rank: the entry stays in memory only
            log.warning("prompt cache: could not write an entry to disk: %s", exc)
            self.stats.post(Count(Metric.PROMPT_CACHE_DISK_DROPPED))
            return
        gone = disk.add(entry)
        await trio.to_thread.run_sync(disk_cache.remove, gone)
        self.stats.post(
            Count(Metric.PROMPT_CACHE_DISK_WRITES),
            Count(Metric.PROMPT_CACHE_DISK_WRITE_BYTES, entry.nbytes),
            Count(Metric.PROMPT_CACHE_DISK_EVICTIONS, len(gone)),
        )
