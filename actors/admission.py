"""The admission actor: the queue, placement on a lane, and the lane hand-over.

Every request enters here. Sessions share the slots: the next row admitted is
the oldest queued row of the waiting session with the fewest admitted rows
(ties: whose oldest row came first), so one agent tree's fan-out cannot hold
every slot while another session waits. Within a session, and among requests
without one (each is a session of its own), the order is arrival: with no
sessions the queue is plain FIFO. The chosen row is the head of line: one that
does not fit holds admission. A continuous-lane head is admitted when a batch
slot is free and no serial request runs; a serial head waits until the batch
lane has drained (its rows finish; no new ones join behind the waiter), then
gets the GPU alone: drain, never starve. Admission also routes :class:`Cancel`
and :class:`Finish` to whichever actor owns the row, and ends queued rows itself.

The scheduling decision is the plain function :func:`plan`, testable without a
model; the actor only applies it.
"""

from __future__ import annotations

import collections
import contextlib
import math
from collections import deque
from collections.abc import Mapping
from typing import Any

import attrs
import trio

from .emitter import Ended
from .gpu import Gpu
from .mailbox import closing
from .prompt_cache import Trim
from .request import FinishReason, Lane
from .row import Cancel, End, Finish, Phase, Row
from .stats import Count, Gauge, Metric, Observe, Stats

MAILBOX_SIZE = 4096
DEFAULT_STEP_SECONDS = 0.05  # for Retry-After before any step has been measured


@attrs.frozen
class Submit:
    """Hands a row over: admission -> prefill or serial."""

    row: Row


@attrs.frozen
class Enqueue:
    """engine -> admission: queue ``row``; ``reply`` gets :class:`Accepted` or
    :class:`Refused` at once (the queue is full)."""

    row: Row
    reply: trio.MemorySendChannel = attrs.field(repr=False)


@attrs.frozen
class Accepted:
    pass


@attrs.frozen
class Refused:
    queued: int  # rows waiting when it was refused
    retry_after: float  # seconds, estimated from the queue ahead and the step rate


@attrs.frozen
class Left:
    """A row left its lane (ended): its slot and KV projection are free."""

    row_id: int


async def release(
    row: Row,
    *,
    to_emitter: trio.MemorySendChannel,
    to_admission: trio.MemorySendChannel,
    announced: bool,
) -> None:
    """How every row owner (prefill, decode, serial) lets a row go once it has
    ended: its work dropped, its terminal event to the emitter unless its last
    token carried it (``announced``), its slot back to admission."""
    row.work = None
    if row.phase is not Phase.ENDED:
        row.move(Phase.ENDED)
    if not announced:
        await to_emitter.send(Ended(row))
    await to_admission.send(Left(row.id))


@attrs.frozen
class Shutdown:
    reason: str


@attrs.frozen
class Plan:
    to_batch: tuple[Row, ...]
    to_serial: Row | None


def share_key(row: Row) -> str | tuple[str, int]:
    """Whom a row's slot is counted against: its session, else the row alone."""
    return row.session if row.session is not None else ("row", row.id)


def next_head(queue: deque[Row], admitted: Mapping[Any, int]) -> Row:
    """The row admission considers next: the oldest queued row of the session
    with the fewest ``admitted`` rows (ties: the session whose oldest row came
    first). With no sessions, the queue's head."""
    best, best_count, seen = queue[0], math.inf, set()
    for row in queue:
        key = share_key(row)
        if key in seen:
            continue
        seen.add(key)
        count = admitted.get(key, 0)
        if count < best_count:
            best, best_count = row, count
            if count == 0:
                break  # nobody has fewer; the earliest such session wins
    return best


def plan(
    queue: deque[Row],
    *,
    cap: int,
    in_batch: int,
    serial_running: bool,
    closing: bool,
    budget: int | None = None,
    live_bytes: int = 0,
    admitted: Mapping[Any, int] | None = None,
) -> Plan:
    """Take the rows to admit now out of ``queue`` (mutates it).

    ``admitted`` counts the admitted rows per :func:`share_key`; the next row is
    :func:`next_head`'s. That row is the head of line: when it does not fit
    (slots, the serial lane, the KV budget) it holds every other row."""
    counts = collections.Counter(admitted or {})
    to_batch: list[Row] = []
    to_serial = None
    while queue and not closing:
        head = next_head(queue, counts)
        if budget is not None and live_bytes + head.kv_projected > budget:
            break  # queue, don't OOM: it joins when enough live rows have left
        if head.lane is Lane.SERIAL:
            if in_batch + len(to_batch) == 0 and not serial_running and to_serial is None:
                queue.remove(head)
                to_serial = head
            break  # a serial head holds admission until it has run
        if serial_running or to_serial is not None or in_batch + len(to_batch) >= cap:
            break
        queue.remove(head)
        to_batch.append(head)
        counts[share_key(head)] += 1
        live_bytes += head.kv_projected
    return Plan(tuple(to_batch), to_serial)


@attrs.define(eq=False)
class Admission:
    cap: int
    budget: int | None  # KV bytes the admitted rows may project to
    gpu: Gpu
    stats: Stats
    inbox: trio.MemoryReceiveChannel
    to_prefill: trio.MemorySendChannel
    to_serial: trio.MemorySendChannel
    to_emitter: trio.MemorySendChannel
    to_prompt_cache: trio.MemorySendChannel | None  # gets Trim as the live KV moves
    max_queued: int = 64  # rows waiting beyond this are refused (Overloaded, HTTP 429)
    queue_timeout: float | None = None  # seconds a row may wait before it fails
    _queue: deque[Row] = attrs.field(factory=deque, init=False)
    _lanes: dict[int, Lane] = attrs.field(factory=dict, init=False)  # admitted rows
    _projected: dict[int, int] = attrs.field(factory=dict, init=False)  # their KV bytes
    _shares: dict[int, Any] = attrs.field(factory=dict, init=False)  # their share_key
    _closing: bool = attrs.field(default=False, init=False)

    @property
    def _in_batch(self) -> int:
        return sum(1 for lane in self._lanes.values() if lane is Lane.CONTINUOUS)

    @property
    def _serial_running(self) -> bool:
        return any(lane is Lane.SERIAL for lane in self._lanes.values())

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        channels = (self.inbox, self.to_prefill, self.to_serial, self.to_emitter)
        with closing(*channels, self.to_prompt_cache):
            task_status.started()
            live = 0
            while True:
                with trio.move_on_at(self._next_expiry()):
                    try:
                        message = await self.inbox.receive()
                    except trio.EndOfChannel:
                        return
                    await self.dispatch(message)
                await self._expire()
                await self._admit()
                now_live = sum(self._projected.values())
                self._report(now_live)
                if now_live != live:
                    live = now_live
                    self._trim_prompt_cache(live)

    def _report(self, live: int) -> None:
        oldest = trio.current_time() - self._queue[0].times.submitted if self._queue else 0.0
        self.stats.post(
            Gauge(Metric.PENDING_ROWS, len(self._queue)),
            Gauge(Metric.ACTIVE_ROWS, len(self._lanes)),
            Gauge(Metric.KV_PROJECTED_BYTES, live),
            Gauge(Metric.QUEUE_OLDEST_WAIT, oldest),
        )

    def _next_expiry(self) -> float:
        if self.queue_timeout is None or not self._queue:
            return math.inf
        return self._queue[0].times.submitted + self.queue_timeout

    async def _expire(self) -> None:
        """Rows that waited longer than the queue timeout fail (oldest first)."""
        now = trio.current_time()
        while self._queue and now >= self._next_expiry():
            row = self._queue.popleft()
            waited = now - row.times.submitted
            detail = (
                f"the request waited {waited:.1f} s in the queue, longer than the queue "
                f"timeout ({self.queue_timeout:g} s); retry later"
            )
            self.stats.post(Count(Metric.QUEUE_TIMEOUTS))
            await self._end_queued(row, End(FinishReason.ERROR, detail, code="queue_timeout"))

    def refusal(self) -> Refused | None:
        """What an :class:`Enqueue` gets now: :class:`Refused` while the queue is
        full, else None. The engine reads it before building a row, so a refused
        request costs no template rendering or tokenizing (``Engine.submit``)."""
        if self._closing or len(self._queue) < self.max_queued:
            return None
        return Refused(len(self._queue), self.retry_after())

    def retry_after(self) -> float:
        """Seconds until the queue ahead has likely drained: its tokens, at the
        measured step time, shared among the batch's slots (at least 1 s)."""
        steps = self.stats.snapshot().step_time
        step = steps.sum / steps.count if steps.count else DEFAULT_STEP_SECONDS
        ahead = sum(r.params.max_tokens for r in self._queue)
        return max(1.0, step * ahead / max(1, self.cap))

    def _trim_prompt_cache(self, live: int) -> None:
        """The prompt cache and the live rows share the budget: the cache keeps what
        the live rows leave (mlx-lm trims its cache to total minus active)."""
        if self.budget is None or self.to_prompt_cache is None:
            return
        with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError):
            self.to_prompt_cache.send_nowait(Trim(self.budget - live))

    async def dispatch(self, message: Enqueue | Cancel | Finish | Left | Shutdown) -> None:
        match message:
            case Enqueue(row, reply):
                with reply:
                    if self._closing:
                        reply.send_nowait(Accepted())
                        self.stats.post(Count(Metric.SUBMITTED))
                        await self._end_queued(
                            row, End(FinishReason.CANCELLED, "engine shutting down")
                        )
                    elif (refused := self.refusal()) is not None:
                        self.stats.post(Count(Metric.OVERLOADED))
                        reply.send_nowait(refused)
                        row.events.close()
                    else:
                        reply.send_nowait(Accepted())
                        self.stats.post(Count(Metric.SUBMITTED))
                        self._queue.append(row)
            case Cancel(row_id, _) | Finish(row_id, _):
                await self._route(row_id, message)
            case Left(row_id):
                if row_id not in self._lanes:  # every admitted row leaves exactly once
                    raise RuntimeError(f"row {row_id} left twice (or was never admitted)")
                del self._projected[row_id]
                del self._shares[row_id]
                lane = self._lanes.pop(row_id)
                if not any(v is lane for v in self._lanes.values()):
                    self.gpu.give_lane(lane)
            case Shutdown(reason):
                self._closing = True
                for row_id in [r.id for r in self._queue] + list(self._lanes):
                    await self._route(row_id, Cancel(row_id, reason))
            case _:
                raise TypeError(f"admission got an unexpected message: {message!r}")

    async def _end_queued(self, row: Row, end: End) -> None:
        row.ask_end(end)
        row.move(Phase.ENDED)
        await self.to_emitter.send(Ended(row))

    async def _route(self, row_id: int, message: Cancel | Finish) -> None:
        """A queued row is cancelled here; an admitted one's owner gets the message."""
        for row in self._queue:
            if row.id == row_id:
                if isinstance(message, Cancel):
                    self._queue.remove(row)
                    await self._end_queued(row, End(FinishReason.CANCELLED, message.reason))
                return
        lane = self._lanes.get(row_id)
        if lane is Lane.CONTINUOUS:
            await self.to_prefill.send(message)  # prefill forwards what it does not hold
        elif lane is Lane.SERIAL:
            await self.to_serial.send(message)
        # unknown: the row already ended; ending it twice is a no-op

    async def _admit(self) -> None:
        p = plan(
            self._queue,
            cap=self.cap,
            in_batch=self._in_batch,
            serial_running=self._serial_running,
            closing=self._closing,
            budget=self.budget,
            live_bytes=sum(self._projected.values()),
            admitted=collections.Counter(self._shares.values()),
        )
        now = trio.current_time()
        for row in (*p.to_batch, *([p.to_serial] if p.to_serial else [])):
            if self.gpu.lane is not row.lane:
                self.gpu.take_lane(row.lane)
            self._lanes[row.id] = row.lane
            self._projected[row.id] = row.kv_projected
            self._shares[row.id] = share_key(row)
            self.stats.post(Observe(Metric.QUEUE_WAIT, now - row.times.submitted))
            target = self.to_serial if row.lane is Lane.SERIAL else self.to_prefill
            await target.send(Submit(row))
