"""The watchdog: a GPU call that runs past the step timeout is reported.

The GPU thread cannot be interrupted (a call is never abandoned), so a stalled
call is only seen: while one runs longer than ``step_timeout``, ``Engine.health()``
names it (``/health`` answers 503 with the reason), the stall is logged and
counted once, and all returns to healthy when the call completes. On a sharded
engine such a call is a collective that will not end (a rank out of step): the
ranks are lost (``Gpu.lose``), so every row ends with an error.
"""

from __future__ import annotations

import logging

import attrs
import trio

from .gpu import Gpu
from .stats import Count, Metric, Stats

log = logging.getLogger("mlx_nursery.engine")

CHECK_EVERY = 0.25  # seconds between two looks at the GPU thread


def stall_reason(gpu: Gpu, step_timeout: float) -> str | None:
    """Why the engine is unhealthy now, if a GPU call has run too long."""
    busy = gpu.busy_for()
    if busy <= step_timeout:
        return None
    return f"a GPU call has been running for {busy:.1f} s (step timeout {step_timeout:g} s)"


@attrs.define(eq=False)
class Watchdog:
    gpu: Gpu
    stats: Stats
    step_timeout: float

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        stalled = False
        while True:
            await trio.sleep(CHECK_EVERY)
            reason = stall_reason(self.gpu, self.step_timeout)
            if reason is not None and not stalled:
                log.warning("engine unhealthy: %s", reason)
                self.stats.post(Count(Metric.STALLS))
                if self.gpu.replica is not None:  # sharded: a collective waits for good
                    self.gpu.lose(f"{reason}: a collective is waiting on a rank that does not "
                                  "answer; the sharded engine is stopped")  # fmt: skip
            elif reason is None and stalled:
                log.warning("engine healthy again: the GPU call completed")
            stalled = reason is not None
