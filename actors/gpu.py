"""The GPU actor: the one OS thread on which every mlx call runs.

The event loop never touches mlx. Actors hand work to this thread with
``await gpu.call(fn, *args)``; calls run one at a time in FIFO order, so a decode
step and a prefill chunk submitted together alternate. A call is never abandoned
mid-way: a caller cancelled while its call runs waits for it to finish, then sees
the cancellation at its next checkpoint (STYLE habit 9).

The actor also owns the lane token: one of the two lanes (continuous or serial)
holds the GPU at a time. Admission takes and hands it over FIFO (drain, never
starve); the token makes the exclusion an invariant that can be checked, rather
than a convention.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import attrs
import outcome
import trio

from .request import Lane


@attrs.frozen
class GpuStatistics:
    calls: int  # calls completed since start
    busy_seconds: float  # wall time the thread spent inside calls
    lane: Lane | None  # which lane holds the GPU now


@attrs.define(eq=False)
class Gpu:
    name: str = "mlx-nursery-gpu"
    _jobs: queue.SimpleQueue = attrs.field(factory=queue.SimpleQueue, init=False)
    _thread: threading.Thread | None = attrs.field(default=None, init=False)
    _calls: int = attrs.field(default=0, init=False)
    _busy: float = attrs.field(default=0.0, init=False)
    _lane: Lane | None = attrs.field(default=None, init=False)
    # time.monotonic() when the running call began (None: idle). Written by the GPU
    # thread, read by the watchdog: one float assignment, atomic in CPython. (The
    # GPU thread cannot read trio's clock, hence monotonic here.)
    _call_started: float | None = attrs.field(default=None, init=False)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import time

        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, deliver = job
            t0 = time.perf_counter()
            self._call_started = time.monotonic()
            result = outcome.capture(fn, *args)
            self._call_started = None
            self._busy += time.perf_counter() - t0
            self._calls += 1
            deliver(result)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the GPU thread and return its result (or raise its error)."""
        if self._thread is None:
            raise RuntimeError("the GPU actor is not running")
        await trio.lowlevel.checkpoint_if_cancelled()
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()

        def deliver(result: outcome.Outcome) -> None:
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

        self._jobs.put((fn, args, deliver))
        # FAILED: the thread cannot be interrupted, so the caller waits it out.
        return await trio.lowlevel.wait_task_rescheduled(
            lambda _raise_cancel: trio.lowlevel.Abort.FAILED
        )

    async def stop(self) -> None:
        """Let queued calls finish, then end the thread (runs shielded: used in cleanup)."""
        if self._thread is None:
            return
        self._jobs.put(None)
        thread, self._thread = self._thread, None
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(thread.join)

    # The lane token. Only admission takes it; whoever ends a lane's turn gives it back.
    def take_lane(self, lane: Lane) -> None:
        if self._lane is not None:
            raise RuntimeError(f"lane {lane!r} asked for the GPU while {self._lane!r} holds it")
        self._lane = lane

    def give_lane(self, lane: Lane) -> None:
        if self._lane != lane:
            raise RuntimeError(f"lane {lane!r} gave back a GPU held by {self._lane!r}")
        self._lane = None

    @property
    def lane(self) -> Lane | None:
        return self._lane

    def busy_for(self) -> float:
        """Seconds the call now running has taken so far (0 when idle)."""
        import time

        started = self._call_started
        return 0.0 if started is None else time.monotonic() - started

    def statistics(self) -> GpuStatistics:
        return GpuStatistics(calls=self._calls, busy_seconds=self._busy, lane=self._lane)
