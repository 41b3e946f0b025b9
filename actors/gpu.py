"""The GPU actor: the one OS thread on which every mlx call runs.

The event loop never touches mlx. Actors hand work to this thread with
``await gpu.call(fn, *args)``; calls run one at a time in FIFO order, so a decode
step and a prefill chunk submitted together alternate. A call is never abandoned
mid-way: a caller cancelled while its call runs waits for it to finish, then sees
the cancellation at its next checkpoint: abandoning the thread mid-step would
leave the caches half-written.

On a sharded engine (``actors/ranks/``) the thread sends each call's plan
to the followers before running it, and the ranks can be *lost* (a follower died
or stalled): then every call waiting or yet to come raises ``RanksLost`` at once,
even one stuck in a collective that will never end.

Several engines in one process (a server with several models) each have their
own thread, and share one ``device`` lock: a call holds it while it runs, so two
models never run a forward at once. Loading a model (:meth:`call_loading`) runs
without it, beside the other models' steps. A model served from a process of its
own (``--model-processes``) shares it through a lock file (:class:`DeviceLock`).

The actor also owns the lane token: one of the two lanes (continuous or serial)
holds the GPU at a time. Admission takes and hands it over FIFO (drain, never
starve); the token makes the exclusion an invariant that can be checked, rather
than a convention.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import outcome
import trio

from .errors import RanksLost
from .request import Lane
from .step import calls

log = logging.getLogger("mlx_nursery.engine")


@attrs.frozen
class GpuStatistics:
    calls: int  # calls completed since start
    busy_seconds: float  # wall time the thread spent inside calls
    last_seconds: float  # the last call's
    lane: Lane | None  # which lane holds the GPU now


class DeviceLock:
    """The device lock, as a ``threading.Lock`` is one, shared with other
    processes too: the engines of this process take the thread lock first, then
    an exclusive ``flock`` on ``path`` (every process serving a model of one
    server opens the same file). Without ``path``, the thread lock alone."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = path
        self._thread = threading.Lock()
        self._fd = None if path is None else os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def __enter__(self) -> DeviceLock:
        self._thread.acquire()
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            except BaseException:
                self._thread.release()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._thread.release()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@attrs.define(eq=False)
class Pending:
    """A call :meth:`Gpu.submit` queued: its outcome, once the GPU thread has it,
    for one caller to await. Like :meth:`Gpu.call`, awaiting it cannot abandon
    the call: a cancelled caller waits it out."""

    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _outcome: outcome.Outcome | None = attrs.field(default=None, init=False)
    _waiter: tuple | None = attrs.field(default=None, init=False)  # (trio token, task)

    def deliver(self, result: outcome.Outcome) -> None:
        """The outcome (any thread): to the waiting task, or kept for it."""
        with self._lock:
            waiter, self._waiter = self._waiter, None
            if waiter is None:
                self._outcome = result
        if waiter is not None:
            token, task = waiter
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

    async def result(self) -> Any:
        """The call's result (or its error), once it has run."""
        with self._lock:
            result = self._outcome
            if result is None:
                task = trio.lowlevel.current_task()
                self._waiter = (trio.lowlevel.current_trio_token(), task)
        if result is not None:
            await trio.lowlevel.checkpoint()
            return result.unwrap()
        return await trio.lowlevel.wait_task_rescheduled(
            lambda _raise_cancel: trio.lowlevel.Abort.FAILED
        )


@attrs.define(eq=False)
class Gpu:
    name: str = "mlx-nursery-gpu"
    # Shared by the engines of one process: held by each call but a load's.
    device: threading.Lock | DeviceLock | None = None
    _jobs: queue.SimpleQueue = attrs.field(factory=queue.SimpleQueue, init=False)
    _thread: threading.Thread | None = attrs.field(default=None, init=False)
    _calls: int = attrs.field(default=0, init=False)
    _busy: float = attrs.field(default=0.0, init=False)
    _last: float = attrs.field(default=0.0, init=False)
    _lane: Lane | None = attrs.field(default=None, init=False)
    # time.monotonic() when the running call began (None: idle). Written by the GPU
    # thread, read by the watchdog: one float assignment, atomic in CPython. (The
    # GPU thread cannot read trio's clock, hence monotonic here.)
    _call_started: float | None = attrs.field(default=None, init=False)
    # Sharded: rank 0's end of the followers (a ranks.Leader); None on one rank.
    replica: Any = attrs.field(default=None, init=False)
    lost: str | None = attrs.field(default=None, init=False)  # why the ranks were lost
    stopping: bool = attrs.field(default=False, init=False)
    # job id -> (token, task) of a call's caller, or the Pending of a submitted one
    _pending: dict = attrs.field(factory=dict, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _ids: Any = attrs.field(factory=itertools.count, init=False)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, deliver, here, locked = job
            device = self.device if locked and self.device is not None else contextlib.nullcontext()
            with device:
                calls.began()
                t0 = time.perf_counter()
                self._call_started = time.monotonic()
                result = self._run(fn, args, here)
                self._call_started = None
            self._last = time.perf_counter() - t0
            self._busy += self._last
            self._calls += 1
            deliver(result)

    def _run(self, fn: Callable[..., Any], args: tuple, here: bool) -> outcome.Outcome:
        """One call; sharded, its plan goes to the followers first (and after it,
        both sides number what it made)."""
        if self.lost is not None:
            return outcome.Error(RanksLost(self.lost))
        replica = None if here else self.replica
        if replica is not None:
            try:
                replica.send(fn, args)
            except OSError as exc:
                self.lose(f"a follower could not be reached ({exc}); the sharded engine is stopped")
                return outcome.Error(RanksLost(self.lost))
            except Exception as exc:  # no plan, no call: the ranks stay in step
                log.exception("no plan for %r", fn)
                return outcome.Error(exc)
        result = outcome.capture(fn, *args)
        if replica is not None:
            try:  # a follower walks a failed call's arguments too (and no result)
                replica.walk(args, result.value if isinstance(result, outcome.Value) else None)
                if isinstance(result, outcome.Error) and (
                    "[ring]" in str(result.error) or "[jaccl]" in str(result.error)
                ):
                    who = replica.blame()
                    why = f"{who}: " if who else ""
                    self.lose(f"{why}a collective failed ({result.error}); the engine is stopped")
            except Exception as exc:
                log.exception("walking %r", fn)
                self.lose(f"the ranks fell out of step after {fn!r}: {exc}")
        return result

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the GPU thread and return its result (or raise its error)."""
        return await self._call(fn, args, here=False)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Pending:
        """Queue ``fn(*args)`` as :meth:`call` does, without waiting: its outcome
        is kept in the returned :class:`Pending` until the caller awaits it
        (``await pending.result()``), so the event loop works while it runs."""
        if self._thread is None:
            raise RuntimeError("the GPU actor is not running")
        pending = Pending()
        if self.lost is not None:
            pending.deliver(outcome.Error(RanksLost(self.lost)))
            return pending
        job_id = next(self._ids)
        with self._lock:
            self._pending[job_id] = pending
        self._jobs.put((fn, args, functools.partial(self._deliver, job_id), False, True))
        return pending

    async def call_here(self, fn: Callable[..., Any], *args: Any) -> Any:
        """As :meth:`call`, but never replayed on other ranks (host-side work)."""
        return await self._call(fn, args, here=True)

    async def call_loading(self, fn: Callable[..., Any], *args: Any) -> Any:
        """As :meth:`call_here`, without the shared ``device`` lock: a model's
        load runs beside the other engines' steps."""
        return await self._call(fn, args, here=True, locked=False)

    async def _call(self, fn: Callable[..., Any], args: tuple, here: bool,
                    locked: bool = True) -> Any:  # fmt: skip
        if self._thread is None:
            raise RuntimeError("the GPU actor is not running")
        if self.lost is not None:
            raise RanksLost(self.lost)
        await trio.lowlevel.checkpoint_if_cancelled()
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()
        job_id = next(self._ids)
        with self._lock:
            self._pending[job_id] = (token, task)
        deliver = functools.partial(self._deliver, job_id)
        self._jobs.put((fn, args, deliver, here, locked))
        # FAILED: the thread cannot be interrupted, so the caller waits it out.
        return await trio.lowlevel.wait_task_rescheduled(
            lambda _raise_cancel: trio.lowlevel.Abort.FAILED
        )

    def _deliver(self, job_id: int, result: outcome.Outcome) -> None:
        """Hand a call's outcome to its caller, once: by the thread, or by
        :meth:`lose` if that came first."""
        with self._lock:
            waiter = self._pending.pop(job_id, None)
        if isinstance(waiter, Pending):
            waiter.deliver(result)
        elif waiter is not None:
            token, task = waiter
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

    def lose(self, reason: str) -> None:
        """The ranks are lost (any thread): every call waiting, and every later
        one, raises ``RanksLost(reason)``; a call stuck in a collective is
        abandoned to its thread."""
        if self.lost is not None:
            return
        self.lost = reason
        with self._lock:
            waiting = list(self._pending)
        for job_id in waiting:
            self._deliver(job_id, outcome.Error(RanksLost(reason)))

    async def stop(self) -> None:
        """Let queued calls finish, then end the thread (runs shielded: used in cleanup).
        Sharded, the followers' connections close after it (so they exit); with the
        ranks lost, the thread may be stuck in a collective and is left behind."""
        if self._thread is None:
            return
        self.stopping = True
        self._jobs.put(None)
        thread, self._thread = self._thread, None
        with trio.CancelScope(shield=True):
            if self.lost is None:
                await trio.to_thread.run_sync(thread.join)
            if self.replica is not None:
                self.replica.close()

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
        started = self._call_started
        return 0.0 if started is None else time.monotonic() - started

    def statistics(self) -> GpuStatistics:
        return GpuStatistics(self._calls, self._busy, self._last, self._lane)
