"""The admission actor: the queue, placement on a lane, and the lane hand-over.

Every request enters here. Sessions share the slots by weight: the next row
admitted is the oldest queued row of the waiting session with the fewest
admitted rows per unit of weight (ties: whose oldest row came first), so one
agent tree's fan-out cannot hold every slot while another session waits. When
no slot frees within ``pause_after`` seconds for a session below its share
(:func:`shares`), a decoding row of the session furthest over its share is
paused (:func:`to_pause`): decode takes it out of the batch with its KV and
pending token, and it waits here, first of its session, to rejoin exactly where
it stopped. Within a session, and among requests without one (each is a session
of its own, never over its share), the order is arrival: with no sessions the
queue is plain FIFO and nothing is paused. The chosen row is the head of line:
one that does not fit holds admission. A continuous-lane head is admitted when
a batch slot is free and no serial request runs; a serial head waits until the
batch lane has drained (its rows finish; no new ones join behind the waiter),
then gets the GPU alone: drain, never starve. Admission also routes
:class:`Cancel` and :class:`Finish` to whichever actor owns the row, and ends
queued (and paused) rows itself.

The scheduling decisions are the plain functions :func:`plan` and
:func:`to_pause`, testable without a model; the actor only applies them.
"""

from __future__ import annotations

import collections
import contextlib
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import trio

from .gpu import Gpu
from .mailbox import closing
from .messages import (
    Accepted,
    Backlog,
    Ended,
    Enqueue,
    Left,
    NotPaused,
    Pause,
    Paused,
    Refused,
    Shutdown,
    Submit,
    Trim,
)
from .request import FinishReason, Lane, Priority
from .row import Cancel, End, Finish, Phase, Row, rank_now
from .stats import ByClass, Count, Gauge, Metric, Observe, Stats

MAILBOX_SIZE = 4096
DEFAULT_STEP_SECONDS = 0.05  # for Retry-After before any step has been measured
# A starving session with no decoding row to pause for it yet looks again this often.
PAUSE_RETRY_SECONDS = 0.05


@attrs.frozen
class Plan:
    to_batch: tuple[Row, ...]
    to_serial: Row | None


def share_key(row: Row) -> str | tuple[str, int]:
    """Whom a row's slot is counted against: its session, else the row alone."""
    return row.session if row.session is not None else ("row", row.id)


def weights_of(rows: Iterable[Row]) -> dict[Any, float]:
    """Each share key's weight: its latest row's (rows in arrival order)."""
    return {share_key(r): r.weight for r in sorted(rows, key=lambda r: r.id)}


def next_head(
    queue: deque[Row],
    admitted: Mapping[Any, int],
    weights: Mapping[Any, float] | None = None,
    now: float | None = None,
    aging: float | None = None,
) -> Row:
    """The row admission considers next: among the queued rows of the best rank
    (:func:`rank_now`), the oldest of the session with the fewest ``admitted``
    rows per unit of its weight (ties: the session whose oldest row came first).
    With one rank and no sessions, the queue's head."""
    weights = weights or {}
    ranks = [rank_now(row, now, aging) for row in queue]
    best_rank = min(ranks)
    if best_rank != max(ranks):
        queue = deque(row for row, rank in zip(queue, ranks, strict=True) if rank == best_rank)
    best, best_load, seen = queue[0], math.inf, set()
    for row in queue:
        key = share_key(row)
        if key in seen:
            continue
        seen.add(key)
        load = admitted.get(key, 0) / weights.get(key, 1.0)
        if load < best_load:
            best, best_load = row, load
            if load == 0:
                break  # nobody has less; the earliest such session wins
    return best


def shares(demand: Mapping[Any, int], weights: Mapping[Any, float], cap: int) -> dict[Any, float]:
    """Each key's fair share of ``cap`` slots: by weight, but never more than
    its ``demand`` (rows admitted plus queued); what a key cannot use goes to
    the others by weight (water filling)."""
    out: dict[Any, float] = {}
    left, free = float(cap), {k for k, d in demand.items() if d > 0}
    while free:
        total = sum(weights.get(k, 1.0) for k in free)
        fair = {k: left * weights.get(k, 1.0) / total for k in free}
        full = {k for k in free if demand[k] <= fair[k]}
        if not full:
            out.update(fair)
            break
        for k in full:
            out[k] = float(demand[k])
            left -= demand[k]
        free -= full
    return out


@attrs.frozen
class Starving:
    """A waiting session below its share while the batch is full (see :func:`starving`)."""

    held: collections.Counter  # admitted rows per share key
    fair: dict[Any, float]  # each key's share
    weights: dict[Any, float]
    head: Row  # the row waiting


def _full(queue: deque[Row], admitted: Sequence[Row], cap: int) -> bool:
    """Whether a queued row can only get a slot by pausing a running one: the
    batch is full (and no serial row runs, which the batch drains for)."""
    batch = sum(1 for r in admitted if r.lane is Lane.CONTINUOUS)
    return bool(queue) and batch >= cap and batch == len(admitted)


def limit(cap: int, room: int, priority: int, best: int | None) -> int:
    """The slots rows of class ``priority`` may hold while a row of class
    ``best`` runs: all of them, or, beside a better class, ``room`` fewer (at
    least one). A better class's decode steps are then smaller: on a CPU a
    step's cost grows with its rows (docs/sessions.md)."""
    return cap if best is None or priority <= best else max(1, cap - room)


def outranked(
    queue: deque[Row], admitted: Sequence[Row], *, cap: int, now: float,
    aging: float | None = None, room: int = 0,
) -> Row | None:  # fmt: skip
    """The running row to pause at once for a better class (a main agent's turn
    behind its own sub-agents, a sub-agent behind background work): the
    decoding row of the worst class, the latest of them, while the batch holds
    more rows than it may: a slot short when the row admission takes next
    (:func:`next_head`) is of a better class than a row in the full batch, and
    ``room`` slots short while a better class runs beside worse ones
    (:func:`limit`). Classes are the rows' own (``Row.priority``): a row that
    ranks better only by waiting is admitted first, but pauses nobody."""
    batch = [r for r in admitted if r.lane is Lane.CONTINUOUS]
    if not batch or len(batch) != len(admitted):
        return None  # an empty batch, or a serial row runs (the batch drains for it)
    best, most = min(r.priority for r in batch), cap
    if queue and len(batch) >= cap:
        held = collections.Counter(share_key(r) for r in admitted)
        head = next_head(queue, held, weights_of([*queue, *admitted]), now, aging)
        if head.lane is Lane.CONTINUOUS and head.priority < max(r.priority for r in batch):
            best, most = min(best, head.priority), cap - 1
    worse = [r for r in batch if r.priority > best and r.phase is Phase.DECODING]
    if worse:
        most = min(most, limit(cap, room, max(r.priority for r in worse), best))
    if len(batch) <= most:
        return None
    return max(worse, key=lambda r: (r.priority, r.id), default=None)


def starving(
    queue: deque[Row], admitted: Sequence[Row], *, cap: int, now: float, pause_after: float,
    aging: float | None = None,
) -> Starving | None:  # fmt: skip
    """Whether a row should be paused for the queue now: the batch is full, the
    row admission would take next (:func:`next_head`) has waited ``pause_after``
    seconds (since it was queued, or paused) and its session holds fewer slots
    than the floor of its share (:func:`shares` of the admitted and queued rows)."""
    if not _full(queue, admitted, cap):
        return None  # a free slot (or a serial row, which the batch drains for)
    batch = [r for r in admitted if r.lane is Lane.CONTINUOUS]
    held = collections.Counter(share_key(r) for r in batch)
    weights = weights_of([*queue, *admitted])
    head = next_head(queue, held, weights, now, aging)
    if head.lane is not Lane.CONTINUOUS or now - head.times.queued < pause_after:
        return None
    fair = shares(held + collections.Counter(share_key(r) for r in queue), weights, cap)
    if held[share_key(head)] >= math.floor(fair[share_key(head)] + _EPS):
        return None  # it holds its share already: it waits for a slot to free
    return Starving(held, fair, weights, head)


_EPS = 1e-9


def to_pause(
    queue: deque[Row],
    admitted: Sequence[Row],
    *,
    cap: int,
    now: float,
    pause_after: float,
    aging: float | None = None,
    room: int = 0,
) -> Row | None:
    """The running row to pause now, or None: for a better class at once
    (:func:`outranked`); else for a waiting session (:func:`starving`), the
    decoding row of the session furthest over its share (per unit of weight),
    its worst class first, then the latest-arrived, never of a better class than
    the waiting row's. After the pause that session still holds at least the
    floor of its share, so pausing never swings back and forth. ``admitted``
    are the admitted rows."""
    row = outranked(queue, admitted, cap=cap, now=now, aging=aging, room=room)
    if row is not None:
        return row
    s = starving(queue, admitted, cap=cap, now=now, pause_after=pause_after, aging=aging)
    if s is None:
        return None
    over = sorted(
        (k for k in s.held if s.held[k] > s.fair.get(k, 0.0) + _EPS),
        key=lambda k: (s.held[k] - s.fair[k]) / s.weights.get(k, 1.0),
        reverse=True,
    )
    for key in over:  # never a better class than the waiting row's (that would swing back)
        decoding = [r for r in admitted if share_key(r) == key and r.phase is Phase.DECODING
                    and r.priority >= s.head.priority]  # fmt: skip
        if decoding:
            return max(decoding, key=lambda r: (r.priority, r.id))
    return None


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
    weights: Mapping[Any, float] | None = None,
    now: float | None = None,
    aging: float | None = None,
    best: int | None = None,
    room: int = 0,
) -> Plan:
    """Take the rows to admit now out of ``queue`` (mutates it).

    ``admitted`` counts the admitted rows per :func:`share_key`; the next row is
    :func:`next_head`'s (by ``weights``). That row is the head of line: when it
    does not fit (slots, the serial lane, the KV budget) it holds every other
    row. ``live_bytes`` counts paused rows' KV already: a paused head needs none.
    ``best`` is the best class among the admitted rows: while one runs, a row of
    a worse class takes no more than ``cap - room`` slots (:func:`limit`)."""
    counts = collections.Counter(admitted or {})
    to_batch: list[Row] = []
    to_serial = None
    while queue and not closing:
        head = next_head(queue, counts, weights, now, aging)
        need = 0 if head.phase is Phase.PAUSED else head.kv_projected
        if budget is not None and live_bytes + need > budget:
            break  # queue, don't OOM: it joins when enough live rows have left
        if head.lane is Lane.SERIAL:
            if in_batch + len(to_batch) == 0 and not serial_running and to_serial is None:
                queue.remove(head)
                to_serial = head
            break  # a serial head holds admission until it has run
        if serial_running or to_serial is not None or in_batch + len(to_batch) >= cap:
            break
        if in_batch + len(to_batch) >= limit(cap, room, head.priority, best):
            break  # the room is kept for the better class running
        queue.remove(head)
        best = head.priority if best is None else min(best, head.priority)
        to_batch.append(head)
        counts[share_key(head)] += 1
        live_bytes += need
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
    pause_after: float | None = None  # see to_pause; None: never pause a row
    # Seconds of waiting that lift a queued row one class (see rank_now); None: never.
    aging: float | None = None
    room: int = 0  # slots a worse class leaves free while a better one runs (see limit)
    _queue: deque[Row] = attrs.field(factory=deque, init=False)  # arrival order
    _admitted: dict[int, Row] = attrs.field(factory=dict, init=False)  # by id, each on its lane
    # KV bytes of the admitted rows (their projection) and of the paused ones (held)
    _projected: dict[int, int] = attrs.field(factory=dict, init=False)
    _pausing: set[int] = attrs.field(factory=set, init=False)  # Pause sent, no answer yet
    # An end request routed while its row was being paused: applied if it was.
    _held: dict[int, Cancel | Finish] = attrs.field(factory=dict, init=False)
    _closing: bool = attrs.field(default=False, init=False)
    _backlog: bool = attrs.field(default=False, init=False)  # the last Backlog sent

    @property
    def _in_batch(self) -> int:
        return sum(1 for r in self._admitted.values() if r.lane is Lane.CONTINUOUS)

    @property
    def _serial_running(self) -> bool:
        return any(r.lane is Lane.SERIAL for r in self._admitted.values())

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        channels = (self.inbox, self.to_prefill, self.to_serial, self.to_emitter)
        with closing(*channels, self.to_prompt_cache):
            task_status.started()
            live = 0
            while True:
                # Only the wait is bounded by the next timer: a message taken is
                # dispatched whole (cancelled mid-dispatch, a row's Ended to the
                # emitter could be lost, and its stream would wait forever).
                message = None
                with trio.move_on_at(min(self._next_expiry(), self._next_pause())):
                    try:
                        message = await self.inbox.receive()
                    except trio.EndOfChannel:
                        return
                if message is not None:
                    await self.dispatch(message)
                await self._expire()
                await self._admit()
                await self._pause()
                if bool(self._queue) != self._backlog:
                    self._backlog = bool(self._queue)
                    await self.to_prefill.send(Backlog(self._backlog))  # on to decode
                now_live = sum(self._projected.values())
                self._report(now_live)
                if now_live != live:
                    live = now_live
                    self._trim_prompt_cache(live)

    def _report(self, live: int) -> None:
        waiting = self._waiting()
        oldest = trio.current_time() - waiting[0].times.submitted if waiting else 0.0
        paused = [r for r in self._queue if r.phase is Phase.PAUSED]
        queued = collections.Counter(r.klass for r in self._queue)
        running = collections.Counter(r.klass for r in self._admitted.values())
        self.stats.post(
            *(ByClass(k, "queued", queued[k]) for k in Priority),
            *(ByClass(k, "running", running[k]) for k in Priority),
            Gauge(Metric.PENDING_ROWS, len(self._queue)),
            Gauge(Metric.PAUSED_ROWS, len(paused)),
            Gauge(Metric.PAUSED_KV_BYTES, sum(r.work.nbytes for r in paused)),
            Gauge(Metric.ACTIVE_ROWS, len(self._admitted)),
            Gauge(Metric.KV_PROJECTED_BYTES, live),
            Gauge(Metric.QUEUE_OLDEST_WAIT, oldest),
        )

    def _waiting(self) -> list[Row]:
        """The queued rows that were never admitted, oldest first (paused rows
        have run: the queue timeout is not theirs)."""
        return [r for r in self._queue if r.phase is Phase.QUEUED]

    def _next_expiry(self) -> float:
        waiting = self._waiting() if self.queue_timeout is not None else None
        if not waiting:
            return math.inf
        return waiting[0].times.submitted + self.queue_timeout

    def _next_pause(self) -> float:
        """When to look again for a row to pause: once the row admission takes
        next will have waited ``pause_after``, or soon while a session starves
        with no row to pause yet (the rows over their share still joining)."""
        if self.pause_after is None or not self._queue or self._pausing:
            return math.inf
        now = trio.current_time()
        head = next_head(self._queue, self._held_slots(), weights_of(self._rows()), now,
                         self.aging)  # fmt: skip
        due = head.times.queued + self.pause_after
        if due > now:
            return due
        starved = starving(self._queue, list(self._admitted.values()), cap=self.cap, now=now,
                           pause_after=self.pause_after, aging=self.aging)  # fmt: skip
        return math.inf if starved is None else now + PAUSE_RETRY_SECONDS

    def _held_slots(self) -> collections.Counter:
        return collections.Counter(share_key(r) for r in self._admitted.values())

    def _rows(self) -> list[Row]:
        return [*self._queue, *self._admitted.values()]

    async def _expire(self) -> None:
        """Rows that waited longer than the queue timeout fail (oldest first)."""
        now = trio.current_time()
        while now >= self._next_expiry():
            row = self._waiting()[0]
            self._queue.remove(row)
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
                    refused = self.refusal()  # (None while closing)
                    try:
                        reply.send_nowait(refused or Accepted())
                    except trio.BrokenResourceError:  # the caller left before its answer
                        row.events.close()
                        return
                    if self._closing:
                        self.stats.post(Count(Metric.SUBMITTED))
                        await self._end_queued(
                            row, End(FinishReason.CANCELLED, "engine shutting down")
                        )
                    elif refused is not None:
                        self.stats.post(Count(Metric.OVERLOADED))
                        row.events.close()
                    else:
                        self.stats.post(Count(Metric.SUBMITTED))
                        self._queue.append(row)
            case Cancel(row_id, _) | Finish(row_id, _):
                if row_id in self._pausing:
                    self._held[row_id] = message
                await self._route(row_id, message)
            case Left(row_id):
                self._leave(row_id)
                del self._projected[row_id]
                self._pausing.discard(row_id)
                self._held.pop(row_id, None)
            case Paused(row):
                self._leave(row.id)  # its slot is free; its KV stays counted, held
                self._pausing.discard(row.id)
                held = self._held.pop(row.id, None)
                if held is None and self._closing:  # shut down while it was leaving
                    held = Cancel(row.id, "engine shutting down")
                if held is not None:  # ended while it was leaving the batch
                    row.ask(held)
                    await self._end_queued(row, row.end)
                else:
                    row.times.paused = trio.current_time()
                    self._requeue(row)
            case NotPaused(row_id):
                self._pausing.discard(row_id)
                self._held.pop(row_id, None)  # routed to its owner as well
            case Shutdown(reason):
                self._closing = True
                for row_id in [r.id for r in self._queue] + list(self._admitted):
                    await self._route(row_id, Cancel(row_id, reason))
            case _:
                raise TypeError(f"admission got an unexpected message: {message!r}")

    def _leave(self, row_id: int) -> None:
        """An admitted row gave its slot back (it ended, or was paused)."""
        row = self._admitted.pop(row_id, None)
        if row is None:  # every admitted row leaves exactly once
            raise RuntimeError(f"row {row_id} left twice (or was never admitted)")
        if not any(r.lane is row.lane for r in self._admitted.values()):
            self.gpu.give_lane(row.lane)

    def _requeue(self, row: Row) -> None:
        """A paused row goes back in arrival order: first of its session's waiting rows."""
        at = next((i for i, r in enumerate(self._queue) if r.id > row.id), len(self._queue))
        self._queue.insert(at, row)

    async def _end_queued(self, row: Row, end: End) -> None:
        """A queued (or paused) row ends here; a paused row's kept KV goes with it."""
        row.ask_end(end)
        row.work = None
        self._projected.pop(row.id, None)
        row.move(Phase.ENDED)
        await self.to_emitter.send(Ended(row))

    async def _route(self, row_id: int, message: Cancel | Finish) -> None:
        """A queued row is cancelled here; an admitted one's owner gets the message."""
        for row in self._queue:
            if row.id == row_id:
                if isinstance(message, Cancel):
                    self._queue.remove(row)
                    await self._end_queued(row, End(FinishReason.CANCELLED, message.reason))
                elif row.phase is Phase.PAUSED:  # a stop string in what it wrote before
                    self._queue.remove(row)
                    await self._end_queued(row, End(message.reason, message.detail))
                return
        row = self._admitted.get(row_id)
        lane = row.lane if row is not None else None
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
            admitted=self._held_slots(),
            weights=weights_of(self._rows()),
            now=trio.current_time(),
            aging=self.aging,
            best=min((r.priority for r in self._admitted.values()), default=None),
            room=self.room,
        )
        now = trio.current_time()
        for row in (*p.to_batch, *([p.to_serial] if p.to_serial else [])):
            if self.gpu.lane is not row.lane:
                self.gpu.take_lane(row.lane)
            self._admitted[row.id] = row
            self._projected[row.id] = row.kv_projected
            if row.phase is Phase.PAUSED:
                self.stats.post(Count(Metric.RESUMED))
            else:
                waited = now - row.times.submitted
                self.stats.post(Observe(Metric.QUEUE_WAIT, waited),
                                ByClass(row.klass, "queue_wait", waited))  # fmt: skip
            target = self.to_serial if row.lane is Lane.SERIAL else self.to_prefill
            await target.send(Submit(row))

    async def _pause(self) -> None:
        """Ask decode to pause the row :func:`to_pause` picks, if any (one at a time)."""
        if self.pause_after is None or self._pausing or self._closing:
            return
        row = to_pause(
            self._queue,
            list(self._admitted.values()),
            cap=self.cap,
            now=trio.current_time(),
            pause_after=self.pause_after,
            aging=self.aging,
            room=self.room,
        )
        if row is not None:
            self._pausing.add(row.id)
            await self.to_prefill.send(Pause(row.id))  # prefill forwards it to decode
