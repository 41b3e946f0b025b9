"""The stats actor: counters, gauges and histograms fed by every other actor.

Actors post with ``stats.post(...)``, which never blocks: the mailbox is large,
and a post that would block is counted as dropped rather than waited for. The
actor serves frozen snapshots (``snapshot()``) for ``engine.stats()``, ``/stats``
and ``/metrics``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

import attrs
import trio

MAILBOX_SIZE = 65536

# Bucket upper bounds in seconds, Prometheus style (the last bucket is +Inf).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


@attrs.frozen
class Count:
    name: str
    n: int = 1


@attrs.frozen
class Gauge:
    name: str
    value: float


@attrs.frozen
class Observe:
    name: str
    value: float


@attrs.frozen
class HistogramSnapshot:
    buckets: tuple[float, ...]  # upper bounds, +Inf implied last
    counts: tuple[int, ...]  # per bucket, not cumulative; len(buckets) + 1
    count: int
    sum: float

    def quantile(self, q: float) -> float | None:
        """Upper bound of the bucket holding the q-quantile (None when empty)."""
        if not self.count:
            return None
        target, seen = q * self.count, 0
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            seen += n
            if seen >= target:
                return bound
        return math.inf


@attrs.define
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = attrs.field(init=False)
    count: int = 0
    sum: float = 0.0

    def __attrs_post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.count += 1
        self.sum += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.buckets, tuple(self.counts), self.count, self.sum)


COUNTERS = (
    "submitted", "finished", "errored", "cancelled", "rejected",
    "steps", "prompt_tokens", "prefill_tokens", "generated_tokens", "batch_faults", "row_faults",
    "dropped_stats", "overloaded", "queue_timeouts", "stalls",
    "prompt_cache_hits", "prompt_cache_misses", "prompt_cache_hit_tokens",
    "prefilled_together", "kv_copied_bytes", "refilled",
)  # fmt: skip
# Each gauge has one writer: admission (rows), decode (batch_*), prefill (prefill_*),
# serial (serial_*).
GAUGES = (
    "active_rows", "pending_rows", "decoding_rows",
    "batch_kv_bytes", "prefill_kv_bytes", "serial_kv_bytes", "padding_waste",
    "prompt_cache_entries", "prompt_cache_bytes", "kv_projected_bytes", "queue_oldest_wait",
)  # fmt: skip
HISTOGRAMS = ("time_to_first_token", "queue_wait", "step_time")


@attrs.frozen
class StatsSnapshot:
    """What ``engine.stats()`` returns."""

    configured: int  # the --batch cap
    mode: str  # off (cap 1) | serial (model cannot batch) | batch
    active_rows: int  # admitted and not finished: prefilling, decoding or serial
    pending_rows: int  # queued, not yet admitted
    decoding_rows: int  # rows in the continuous batch
    submitted: int
    finished: int
    errored: int
    cancelled: int
    rejected: int  # refused at submit (never admitted; not in the ledger)
    kv_bytes: int  # live KV: the batch, prefills in flight, the serial row (prompt cache apart)
    kv_budget_bytes: int | None
    kv_projected_bytes: int  # worst case of the admitted rows, what the budget is held to
    padding_waste: float  # fraction of the batch KV width that is left padding
    steps: int
    prompt_tokens: int
    prefill_tokens: int  # prompt tokens actually computed (prompt minus cached)
    generated_tokens: int
    batch_faults: int
    row_faults: int  # rows ended by a fault in their own work (the batch went on)
    overloaded: int  # refused because the queue was full (not in the ledger)
    queue_timeouts: int  # failed after waiting longer than the queue timeout
    stalls: int  # GPU calls that ran past the step timeout
    queue_oldest_wait: float  # seconds the oldest queued row has waited
    dropped_stats: int
    prompt_cache_entries: int
    prompt_cache_bytes: int
    prompt_cache_hits: int
    prompt_cache_misses: int
    prompt_cache_hit_tokens: int
    prefilled_together: int  # rows whose prompts were prefilled as one padded batch
    kv_copied_bytes: int  # KV bytes copied by the batch's joins and leaves
    refilled: int  # joiners written in place over a finished row's retired slot
    time_to_first_token: HistogramSnapshot
    queue_wait: HistogramSnapshot
    step_time: HistogramSnapshot

    @property
    def ledger_balanced(self) -> bool:
        return self.submitted == self.finished + self.errored + self.cancelled


@attrs.define(eq=False)
class Stats:
    configured: int
    mode: str
    kv_budget_bytes: int | None = None
    _send: trio.MemorySendChannel = attrs.field(init=False)
    _receive: trio.MemoryReceiveChannel = attrs.field(init=False)
    _counters: dict[str, int] = attrs.field(init=False)
    _gauges: dict[str, float] = attrs.field(init=False)
    _histograms: dict[str, Histogram] = attrs.field(init=False)
    _changed: trio.Event = attrs.field(factory=trio.Event, init=False)  # set after each apply

    def __attrs_post_init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel(MAILBOX_SIZE)
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._gauges = dict.fromkeys(GAUGES, 0.0)
        self._histograms = {name: Histogram() for name in HISTOGRAMS}

    def post(self, *messages: Count | Gauge | Observe) -> None:
        """Post figures; several in one call travel as one mailbox message."""
        try:
            self._send.send_nowait(messages)
        except trio.WouldBlock:
            self._counters["dropped_stats"] += 1
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # engine closing; figures no longer served

    def _apply(self, message: Count | Gauge | Observe) -> None:
        match message:
            case Count(name, n):
                self._counters[name] += n
            case Gauge(name, value):
                self._gauges[name] = value
            case Observe(name, value):
                self._histograms[name].observe(value)
            case _:
                raise TypeError(f"stats got an unexpected message: {message!r}")

    @property
    def backlog(self) -> int:
        return self._receive.statistics().current_buffer_used

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self._receive:
            task_status.started()
            async for messages in self._receive:
                for message in messages:
                    self._apply(message)
                self._changed.set()
                self._changed = trio.Event()

    async def wait_for(self, predicate: Callable[[StatsSnapshot], bool]) -> None:
        """Wait until every posted figure is in and ``predicate(snapshot)`` holds."""
        while self.backlog or not predicate(self.snapshot()):
            await self._changed.wait()

    def counter(self, name: str) -> int:
        return self._counters[name]

    def snapshot(self) -> StatsSnapshot:
        c, g, h = self._counters, self._gauges, self._histograms
        return StatsSnapshot(
            configured=self.configured,
            mode=self.mode,
            active_rows=int(g["active_rows"]),
            pending_rows=int(g["pending_rows"]),
            decoding_rows=int(g["decoding_rows"]),
            kv_bytes=int(g["batch_kv_bytes"] + g["prefill_kv_bytes"] + g["serial_kv_bytes"]),
            kv_budget_bytes=self.kv_budget_bytes,
            kv_projected_bytes=int(g["kv_projected_bytes"]),
            padding_waste=float(g["padding_waste"]),
            queue_oldest_wait=float(g["queue_oldest_wait"]),
            prompt_cache_entries=int(g["prompt_cache_entries"]),
            prompt_cache_bytes=int(g["prompt_cache_bytes"]),
            time_to_first_token=h["time_to_first_token"].snapshot(),
            queue_wait=h["queue_wait"].snapshot(),
            step_time=h["step_time"].snapshot(),
            **{name: c[name] for name in COUNTERS},
        )
