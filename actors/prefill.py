"""The prefill actor: each joiner's prompt, alone, one chunk per GPU turn.

Rows arrive from admission in FIFO order and are prefilled one at a time on fresh
solo caches, ``prefill_step_size`` tokens per GPU call. Between two chunks the
decode actor's step gets its turn on the GPU (the GPU actor runs calls FIFO), so
running rows keep decoding while a long prompt comes in. The last prompt token is
forwarded on the solo caches and the row's first token sampled there; the primed
row then goes to decode to join the batch. A prefill error fails only its row.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import attrs
import trio

from .admission import Cancel, Left, Submit
from .emitter import Terminal
from .gpu import Gpu
from .request import Row
from .rows import Batch, Prefill
from .stats import Count, Gauge, Stats

MAILBOX_SIZE = 4096


@attrs.frozen
class Join:
    """A primed row, ready to join the running batch."""

    row: Row
    joiner: Batch = attrs.field(repr=False)


@attrs.define(eq=False)
class PrefillActor:
    model: Any
    gpu: Gpu
    stats: Stats
    step_size: int
    to_decode: trio.MemorySendChannel
    to_emitter: trio.MemorySendChannel
    to_admission: trio.MemorySendChannel
    send: trio.MemorySendChannel = attrs.field(init=False)
    _receive: trio.MemoryReceiveChannel = attrs.field(init=False)
    _waiting: deque[Row] = attrs.field(factory=deque, init=False)
    _current: Row | None = attrs.field(default=None, init=False)
    _cancelled: str | None = attrs.field(default=None, init=False)  # why _current must stop

    def __attrs_post_init__(self) -> None:
        self.send, self._receive = trio.open_memory_channel(MAILBOX_SIZE)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self._receive, self.to_decode, self.to_emitter, self.to_admission:
            task_status.started()
            while True:
                if not self._waiting:
                    await self._take(await self._receive.receive())
                await self._drain()
                if self._waiting:
                    await self._prefill(self._waiting.popleft())

    async def _drain(self) -> None:
        while True:
            try:
                message = self._receive.receive_nowait()
            except trio.WouldBlock:
                return
            await self._take(message)

    async def _take(self, message: Submit | Cancel) -> None:
        match message:
            case Submit(row):
                self._waiting.append(row)
            case Cancel(row_id, reason):
                if self._current is not None and self._current.id == row_id:
                    self._cancelled = reason
                    return
                for row in self._waiting:
                    if row.id == row_id:
                        self._waiting.remove(row)
                        await self._end(row, "cancelled", reason)
                        return
                await self.to_decode.send(message)  # already handed over (or gone)
            case _:
                raise TypeError(f"prefill got an unexpected message: {message!r}")

    async def _end(self, row: Row, reason: str, error: str | None) -> None:
        await self.to_emitter.send(Terminal(row, reason, error))
        await self.to_admission.send(Left(row.id))

    async def _prefill(self, row: Row) -> None:
        self._current, self._cancelled = row, None
        row.times.prefill_started = trio.current_time()
        self.stats.post(Count("prompt_tokens", len(row.prompt)))
        try:
            job = await self.gpu.call(
                Prefill, self.model, row.id, row.prompt, row.params, self.step_size
            )
            while job.remaining > 0 and self._cancelled is None:
                self.stats.post(Count("prefill_tokens", await self.gpu.call(job.chunk)))
                self.stats.post(Gauge("prefill_kv_bytes", job.nbytes))
                await self._drain()
            if self._cancelled is not None:
                await self._end(row, "cancelled", self._cancelled)
                return
            joiner = await self.gpu.call(job.prime)
            self.stats.post(Count("prefill_tokens"))
        except Exception as exc:  # a prefill fault is this row's alone
            await self._end(row, "error", f"prefill failed: {type(exc).__name__}: {exc}")
            return
        finally:
            # A cancelled or failed row's solo KV goes with ``job``; a primed row's
            # caches now belong to its joiner.
            self._current = None
            self.stats.post(Gauge("prefill_kv_bytes", 0))
        row.times.prefill_ended = trio.current_time()
        await self.to_decode.send(Join(row, joiner))
