"""The child's side of a model served from a process of its own
(``model_process.py``): ``python -m mlx_nursery.server.model_child`` reads its
settings, pickled, on standard input, announces its URL on standard output and
serves its one model."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import sys
import threading
from typing import Any

import trio

from .model_process import FAILED, LOG_LEVEL_ENV, NICE, READY_POLL
from .serve import exit_now, serve


def watch_parent() -> None:
    """End this process (as on SIGTERM) once the parent's end of stdin closes."""
    with contextlib.suppress(OSError):  # the descriptor, not sys.stdin's buffer: a
        while os.read(0, 4096):  # daemon thread in its lock aborts the interpreter's exit
            pass
    os.kill(os.getpid(), signal.SIGTERM)


def _policy(policy: int) -> None:
    """Every thread of this process under the scheduling ``policy``."""
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))


async def _loaded(state: Any) -> None:
    """Once the model serves: the normal scheduling policy back (still niced)."""
    while state.phase == "starting":  # noqa: ASYNC110 (the model loads meanwhile)
        await trio.sleep(READY_POLL)
    _policy(getattr(os, "SCHED_OTHER", 0))


def main() -> None:
    """The child: read its settings (pickled, on stdin), announce its URL on
    stdout, serve its one model until SIGTERM or the parent's end. It loads
    under ``SCHED_IDLE`` (Linux: it runs on what the other processes leave
    idle; the parent also throttles it while they decode), then serves niced."""
    settings = pickle.load(sys.stdin.buffer)
    with contextlib.suppress(OSError):
        os.nice(NICE)
    if hasattr(os, "SCHED_IDLE"):
        _policy(os.SCHED_IDLE)
    logging.basicConfig(
        level=int(os.environ.get(LOG_LEVEL_ENV, logging.WARNING)),
        format=f"%(asctime)s %(levelname)s %(name)s [{settings.model_name}]: %(message)s",
    )
    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()

    async def run() -> Any:
        async with trio.open_nursery() as nursery:
            urls, state = await nursery.start(
                lambda task_status: serve(settings, handle_signals=True, task_status=task_status)
            )
            print(urls[0], flush=True)
            nursery.start_soon(_loaded, state)
        return state

    state = trio.run(run)
    if state.phase == "failed":
        print(FAILED, state.error, flush=True)  # the parent's reason for the load's failure
        exit_now(1, f"the engine failed: {state.error}")
    exit_now(0, "shut down")


if __name__ == "__main__":
    main()
