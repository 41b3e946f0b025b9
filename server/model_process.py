"""A model served from a process of its own (``--model-processes``), behind the
server that owns it. See ``docs/models.md``, "A process a model".

Loading a model holds Python's GIL for seconds in single C calls (the
tokenizers' JSON, their Rust build, llguidance's trie: ``docs/benchmarks.md``,
Several models), and every step of every model in that process needs the GIL
between its mlx calls. So a model other than the default can be served by a
child server: the same code (``serve``) for that one model, on a loopback port
with a key of its own, niced, started on the model's first request and ended
on its unload. The parent keeps the names, the memory budget, keep-alive and
eviction (``pool.py``); a request for the model is forwarded to the child as it
came (its ``model`` field the served name) and the answer streamed back.

Both processes' engines take one device lock (``gpu.DeviceLock``: a lock
file), so two models still never run a forward at once. The child ends when
told (SIGTERM: it drains and exits) or when its parent is gone (its standard
input closes): ``model_child.py`` is its side.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import attrs
import httpx
import trio
from mlx_nursery.actors import EngineSettings

from .settings import Settings

log = logging.getLogger("mlx_nursery.server")

NICE = 10  # the child's niceness once loaded
READY_POLL = 0.1  # seconds between looks at the child's /health while it loads
THROTTLE_PERIOD = 0.1  # seconds: a loading child's turn, when the other models decode
LOAD_SHARE = 0.1  # of which it runs this share
FIGURES_EVERY = 1.0  # seconds between reads of the child's figures
FAILED = "failed:"  # the child's last line on stdout when its model did not load
LOG_LEVEL_ENV = "MLX_NURSERY_CHILD_LOG_LEVEL"  # the parent's, for the child's log
STOP_GRACE = 20.0  # seconds the child gets to drain after SIGTERM, then it is killed
# Request headers not passed on (the hop's own, and the client's key: the child has its own).
HOP = frozenset({
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade",
    "authorization", "x-api-key", "te", "trailer", "proxy-authorization",
})  # fmt: skip
HOP_BACK = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding",
                      "date", "server"})  # fmt: skip


class ChildFailed(Exception):
    """The child server could not start its model (the message says why)."""


@attrs.define(eq=False)
class ModelProcess:
    """The parent's handle on one child server: its process, URL and client,
    and its model's figures as last read."""

    process: trio.Process
    url: str
    key: str
    client: httpx.AsyncClient
    figures: dict[str, Any] = attrs.field(factory=dict)  # the child's /stats "models"[0]
    stats: dict[str, Any] = attrs.field(factory=dict)  # the child's whole /stats body
    stopping: bool = False
    _calls: set[trio.CancelScope] = attrs.field(factory=set)  # short calls in flight
    _quiet: trio.Event | None = None  # set when the last of them has ended

    @property
    def pid(self) -> int:
        return self.process.pid

    async def call(self, method: str, path: str) -> httpx.Response | None:
        """One short call to the child (figures, sessions): its answer, read
        whole, or None when the child could not be asked (stopping, or gone).

        Such calls run beside the slot's life, so :meth:`stop` cancels those in
        flight and waits for them before it closes the client: one still
        connecting when the client's pool closed would come back with a socket
        that pool no longer knows, left to the garbage collector."""
        if self.stopping:
            return None
        with trio.CancelScope() as scope:
            self._calls.add(scope)
            try:
                return await self.client.request(method, path)
            except httpx.HTTPError:
                return None
            finally:
                self._calls.discard(scope)
                if not self._calls and self._quiet is not None:
                    self._quiet.set()
        return None  # cancelled by stop

    async def refresh(self) -> None:
        """Read the child's figures (resident bytes, requests, tokens)."""
        r = await self.call("GET", "/stats")
        if r is not None and r.status_code == 200:
            with contextlib.suppress(ValueError, KeyError, IndexError):
                self.stats = r.json()
                self.figures = self.stats["models"][0]

    async def stop(self) -> None:
        """SIGTERM, then wait for the child to drain and exit (killed after
        ``STOP_GRACE``)."""
        with trio.CancelScope(shield=True):
            self.stopping = True
            while self._calls:
                self._quiet = trio.Event()
                for scope in self._calls:
                    scope.cancel()
                await self._quiet.wait()
            await self.client.aclose()
            if self.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self.process.send_signal(signal.SIGTERM)
                with trio.move_on_after(STOP_GRACE):
                    await self.process.wait()
                if self.process.returncode is None:
                    log.warning("model process %d did not end on SIGTERM: killed", self.pid)
                    self.process.kill()
                    await self.process.wait()
            if self.process.stdin is not None:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self.process.stdin.aclose()


def child_settings(template: Settings, name: str, ref: Any, engine: EngineSettings) -> Settings:
    """The settings of the child serving ``ref`` as ``name``: one model, pinned,
    on a loopback port the OS picks, with a key of its own, no memory bound of
    its own (the parent's budget counts it), the parent's engine settings and
    request log (a line a request, appended: the two processes' lines interleave
    whole)."""
    return attrs.evolve(
        template, model=ref, model_name=name, models=(), aliases={}, keep_alive={},
        memory_budget=None, host="127.0.0.1", port=0, api_key=secrets.token_urlsafe(24),
        no_api_key=False, protect_stats=True, allowed_origins=(), allowed_hosts=(),
        model_processes=False, own_process=True, engine=engine,
        drain_seconds=min(template.drain_seconds, STOP_GRACE - 5),
    )  # fmt: skip


async def start(settings: Settings, busy: Callable[[], bool] = lambda: False) -> ModelProcess:
    """Start a child server with ``settings`` (:func:`child_settings`) and wait
    until its model is loaded; :class:`ChildFailed` with its reason if it is not.
    While it loads, it runs a ``LOAD_SHARE`` of the time whenever ``busy()`` (the
    other models decode): :func:`_throttle`."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "mlx_nursery.server.model_child"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env={**os.environ, LOG_LEVEL_ENV: str(logging.getLogger().getEffectiveLevel())},
    )  # fmt: skip
    handle: ModelProcess | None = None
    try:
        assert process.stdin is not None and process.stdout is not None
        await process.stdin.send_all(pickle.dumps(settings))
        url = (await _line(process.stdout)).strip()
        if not url.startswith("http"):
            raise ChildFailed(f"the model's process ended before it served (exit code "
                              f"{await process.wait()})")  # fmt: skip
        client = httpx.AsyncClient(
            base_url=url, timeout=httpx.Timeout(None, connect=10.0),
            headers={"Authorization": f"Bearer {settings.api_key}"},
        )  # fmt: skip
        handle = ModelProcess(process, url, settings.api_key, client)
        failure: ChildFailed | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_throttle, process, busy)
            try:
                await _ready(process, client)
            except ChildFailed as exc:
                failure = exc  # raised below, outside the nursery's exception group
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure
        await handle.refresh()
        return handle
    except BaseException:
        if handle is not None:
            await handle.stop()
        else:
            with trio.CancelScope(shield=True):
                process.kill()
                await process.wait()
        raise


async def _ready(process: trio.Process, client: httpx.AsyncClient) -> None:
    """Until the child's /health says its model serves; :class:`ChildFailed`
    with the reason the child gave (its last line) if it ends first."""
    while True:
        if process.returncode is not None:
            assert process.stdout is not None
            said = ""
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                while chunk := await process.stdout.receive_some():
                    said += chunk.decode(errors="replace")
            why = said.partition(FAILED)[2].strip()
            raise ChildFailed(why or f"the model's process ended while loading (exit code "
                              f"{process.returncode})")  # fmt: skip
        try:
            r = await client.get("/health")
        except httpx.TransportError:
            r = None
        if r is not None and r.status_code == 200:
            return
        if r is not None and r.json().get("status") == "failed":
            raise ChildFailed(r.json().get("error") or "its engine failed to start")
        await trio.sleep(READY_POLL)


async def _throttle(process: trio.Process, busy: Callable[[], bool]) -> None:
    """While the other models decode, let the loading child run ``LOAD_SHARE`` of
    each ``THROTTLE_PERIOD`` (SIGSTOP, SIGCONT); at full speed when they idle.
    Its load is tokenizer parsing and weight casts: memory-heavy work that slows
    a decode step sharing the memory bus and caches whatever the scheduler
    does (``docs/models.md``)."""
    stopped = False
    try:
        while process.returncode is None:
            if busy():
                process.send_signal(signal.SIGSTOP)
                stopped = True
                await trio.sleep(THROTTLE_PERIOD * (1 - LOAD_SHARE))
                process.send_signal(signal.SIGCONT)
                stopped = False
                await trio.sleep(THROTTLE_PERIOD * LOAD_SHARE)
            else:
                await trio.sleep(THROTTLE_PERIOD * LOAD_SHARE)
    except ProcessLookupError:
        pass
    finally:
        if stopped:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGCONT)


async def _line(stream: trio.abc.ReceiveStream) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = await stream.receive_some(1)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace")


def forward_headers(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP}


def back_headers(headers: Any) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers.multi_items() if k.lower() not in HOP_BACK]
