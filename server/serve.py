"""Run the app under Hypercorn inside one ``trio.run``, with graceful shutdown.

Shutdown (SIGINT/SIGTERM, or ``shutdown`` set by an embedding caller): the
server refuses new completions (503) and ``/health`` turns 503; in-flight
requests get ``drain_seconds`` to finish; the rest are cancelled with a reason,
each stream still ending in an error event and ``data: [DONE]``; then Hypercorn
stops.

A server in its own process (the CLI) then ends with ``os._exit``
(:func:`exit_now`) once logs are flushed (the disk tier flushes as the engine
closes): a native library's exit handler cannot hang it (OpenBLAS's
``gotoblas_quit`` joining a BLAS worker that never wakes did, now and then). A
timer armed at the signal (:func:`arm_exit_deadline`) ends it even if the drain
itself never returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from .access import reach
from .app import ServerState, create_app
from .settings import Settings

log = logging.getLogger("mlx_nursery.server")

def hypercorn_config(settings: Settings) -> Config:
    config = Config()
    config.bind = [f"{settings.host}:{settings.port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = 5.0  # after our own drain, streams end within a step or two
    config.keep_alive_timeout = settings.keep_alive_timeout
    config.h11_max_incomplete_size = settings.max_header_bytes
    config.h2_max_header_list_size = settings.max_header_bytes
    # read_timeout stays unset: Hypercorn applies it to every read, and a client
    # streaming a long answer sends nothing for minutes. The body read has its own
    # deadline (Settings.body_timeout).
    return config


async def serve(
    settings: Settings,
    *,
    shutdown: trio.Event | None = None,
    handle_signals: bool = False,
    task_status=trio.TASK_STATUS_IGNORED,
) -> ServerState:
    """Serve until ``shutdown`` is set (or a signal arrives); reports the bound URLs
    and the server state through ``task_status``. Returns the final state."""
    app = create_app(settings)
    state: ServerState = app.extensions["mlx_nursery"]
    shutdown = trio.Event() if shutdown is None else shutdown

    async def trigger() -> None:
        await until_any(shutdown, state.failed, signals=handle_signals)
        log.info(
            "shutting down: draining in-flight requests (up to %.0f s)", settings.drain_seconds
        )
        if settings.own_process:
            arm_exit_deadline(settings.drain_seconds + EXIT_GRACE_SECONDS)
        await state.drain(settings.drain_seconds)

    await hosted(app, settings, trigger, state, task_status)
    return state


async def hosted(app: Any, settings: Settings, trigger: Any, state: Any,
                 task_status=trio.TASK_STATUS_IGNORED) -> None:  # fmt: skip
    """Serve ``app`` under Hypercorn until ``trigger`` returns (it drains); report
    the bound URLs and ``state`` through ``task_status`` once listening."""
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(
            lambda task_status: hypercorn_serve(
                app, hypercorn_config(settings), shutdown_trigger=trigger, task_status=task_status
            )
        )
        log.info("listening on %s; reachable from %s", ", ".join(urls), reach(settings))
        task_status.started((urls, state))


# After the drain: the engine's close (rows' terminal events, the disk tier's
# pending writes), Hypercorn's own stop, and the GPU thread's last call.
EXIT_GRACE_SECONDS = 15.0


def exit_now(code: int, why: str) -> None:
    """End the process at once: flush the logs and stdio, then ``os._exit``,
    which runs no native exit handler (a hang there is what this avoids)."""
    log.info("exiting (%s), code %d", why, code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def arm_exit_deadline(seconds: float) -> threading.Timer:
    """End the process ``seconds`` from now whatever is still running: the last
    resort if the drain or the engine's close never returns."""
    timer = threading.Timer(seconds, exit_now, (1, f"shutdown took over {seconds:.0f} s"))
    timer.daemon = True
    timer.start()
    return timer


async def until_any(*events: trio.Event, signals: bool = False) -> None:
    """Until one of ``events`` is set, or (``signals``) SIGINT or SIGTERM arrives."""
    async with trio.open_nursery() as waiters:

        async def stop_on(event: trio.Event) -> None:
            await event.wait()
            waiters.cancel_scope.cancel()

        for event in events:
            waiters.start_soon(stop_on, event)
        if signals:
            waiters.start_soon(_signals, waiters.cancel_scope)


async def _signals(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("got %s", signal.Signals(signum).name)
            scope.cancel()
            return
