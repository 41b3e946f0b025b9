"""Several models under one memory budget: names, load on first request, idle
unload, eviction. See ``docs/models.md``.

Each configured model is a :class:`Slot`. A loaded slot holds one engine (its
own actor graph, prompt cache and disk tier) opened in the pool's nursery; all
engines share one ``device`` lock, so two models never run a forward at once,
while a load runs beside the others' steps.

A request takes a *lease* on its model's slot for as long as its handler runs
(the engine's own row count covers a stream after that). A slot that is not
loaded is loaded on its first lease; loads run one at a time, FIFO. Before a
load, room is made under the memory budget: each loaded model is charged its
weights, its KV budget and a step's workspace; the least recently used idle,
unpinned model is unloaded first; when only busy ones are left, the least
recently used is marked *evicting* (no new lease) and unloaded once it drains,
so its rows finish rather than fail. A lease that waits longer than
``--model-wait`` is a 429 with ``Retry-After``. A slot idle for its keep-alive
is unloaded; a pinned one (keep-alive ``forever``) never is.

With ``--model-processes``, a model other than the default is served by a child
server of its own (``model_process.py``): the slot then holds that process
instead of an engine, and the routes forward its requests; the device lock is a
lock file both processes take.
"""

from __future__ import annotations

import contextlib
import ctypes
import fnmatch
import gc
import logging
import math
import sys
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import mlx.core as mx
import trio
from mlx_nursery.actors import Engine, EngineSettings, open_engine
from mlx_nursery.actors.gpu import DeviceLock

from . import model_process
from .api.base import ApiError
from .hosts import Host, InChild, InProcess
from .model_process import ModelProcess
from .settings import Settings
from .sizing import auto_memory_budget, charge_of, estimate
from .specs import ModelState

log = logging.getLogger("mlx_nursery.server")

DEFAULT_KEEP_ALIVE = 300.0  # seconds a model other than the default stays loaded idle
KEEP_ALIVE_TICK = 0.25  # seconds between the keep-alive sweeps
DRAIN_POLL = 0.05  # seconds between looks at an evicting model's rows
CLAUDE_PREFIX = "claude-"


@attrs.frozen
class ModelSpec:
    """A served model: its public ``name``, what to load (``ref``: a directory,
    hub id, GGUF file, store name, or a ``(model, tokenizer)`` pair) and how long
    it stays loaded when idle (``keep_alive`` seconds; None: pinned, loaded at
    start and never unloaded)."""

    name: str
    ref: Any
    keep_alive: float | None = None


class NoRoom(Exception):
    """The model cannot fit beside the pinned ones, whatever is unloaded."""


@attrs.define(eq=False)
class Slot:
    """One model's place in the pool: its state, its engine while loaded, and
    figures that outlive its loads."""

    spec: ModelSpec
    settings: EngineSettings
    default: bool = False
    state: ModelState = ModelState.UNLOADED
    engine: Engine | None = None
    process: ModelProcess | None = None  # served from a process of its own, while loaded
    charge: int | None = None  # bytes reserved while loaded (estimated, then measured)
    context_length: int | None = None
    load_seconds: float | None = None
    loads: int = 0
    unloads: int = 0
    leases: int = 0
    waiters: int = 0  # requests waiting for it to load
    evicting: bool = False
    last_used: float = 0.0  # trio time of the last lease or busy sweep
    requests: int = 0
    tokens: int = 0
    tokens_before: int = 0  # a process-served model's tokens in its earlier processes
    error: str | None = None
    failed_at: float = -math.inf
    stop: trio.Event = attrs.field(factory=trio.Event)
    stopped: trio.Event = attrs.field(factory=trio.Event)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pinned(self) -> bool:
        return self.spec.keep_alive is None

    @property
    def host(self) -> Host | None:
        """How the loaded model is hosted, asked one way (``hosts.py``): its engine
        here, or its process; None while neither is up."""
        if self.engine is not None:
            return InProcess(self.engine)
        return None if self.process is None else InChild(self.process)

    def idle(self) -> bool:
        """No request holds it and its engine has no row (requests that wait
        for it do not count: an evicting model is unloaded under them)."""
        host = self.host
        return self.leases == 0 and (host is None or host.idle())

    def serving(self) -> bool:
        """Loaded, here or in a process of its own."""
        return self.state is ModelState.LOADED and self.host is not None

    def resident_bytes(self) -> int:
        """Weights, live KV and the prompt cache of the loaded model (0 unloaded)."""
        host = self.host
        return host.resident_bytes() if host and self.state is ModelState.LOADED else 0

    def figures(self, now: float) -> dict[str, Any]:
        return {
            "name": self.name,
            "default": self.default,
            "state": str(self.state),
            "pinned": self.pinned,
            "keep_alive_seconds": self.spec.keep_alive,
            "evicting": self.evicting,
            "loads": self.loads,
            "unloads": self.unloads,
            "load_seconds": self.load_seconds,
            "charge_bytes": self.charge,
            "resident_bytes": self.resident_bytes(),
            "requests": self.requests,
            "tokens": self.tokens,
            "idle_seconds": None if self.leases or self.state is not ModelState.LOADED
            else round(now - self.last_used, 3),
            "context_length": self.context_length,
            "process": None if self.host is None else self.host.pid,
            "error": self.error,
        }  # fmt: skip


@attrs.define(eq=False)
class Pool:
    """The configured models, and the one memory budget they share."""

    slots: dict[str, Slot]
    aliases: Mapping[str, str]  # a client's name (or glob) -> a served model's name
    budget: int | str | None  # bytes, "auto" (resolved at start) or None: no bound
    wait: float  # seconds a lease waits for its model before a 429
    refs: Mapping[str, str] = attrs.field(factory=dict)  # a model's reference -> its name
    device: threading.Lock | DeviceLock = attrs.field(factory=threading.Lock)
    # Called once a slot's load ends: (slot, error or None).
    on_loaded: Callable[[Slot, str | None], None] | None = None
    own_process: bool = False
    group: Any = None  # sharded (``--ranks``): the mx.distributed group of its one model
    # --model-processes: the server's settings a child's are made from (None: one process)
    processes: Settings | None = None
    _nursery: trio.Nursery | None = None
    _loading: trio.Lock = attrs.field(factory=trio.Lock)
    _change: trio.Event = attrs.field(factory=trio.Event)

    @classmethod
    def of(
        cls, specs: list[ModelSpec], engine: EngineSettings, *, aliases: Mapping[str, str],
        budget: int | str | None, wait: float, own_process: bool = False, group: Any = None,
        device: threading.Lock | DeviceLock | None = None, processes: Settings | None = None,
    ) -> Pool:  # fmt: skip
        """The pool over ``specs`` (the first is the default model). With several
        models, an ``auto`` KV budget is a share of the memory budget, and the
        draft model serves the default model only."""
        several = len(specs) > 1
        slots: dict[str, Slot] = {}
        for i, spec in enumerate(specs):
            if spec.name in slots:
                raise ValueError(f"two models are named {spec.name!r}: give one an alias "
                                 "(--model NAME=MODEL)")  # fmt: skip
            settings = engine if i == 0 or not several else attrs.evolve(engine, draft_model=None)
            slots[spec.name] = Slot(spec, settings, default=i == 0)
        for alias, target in aliases.items():
            if target not in slots:
                served = ", ".join(slots)
                raise ValueError(f"--alias {alias}={target}: no model is named {target!r} "
                                 f"(served: {served})")  # fmt: skip
        refs = {str(s.spec.ref): s.name for s in slots.values() if isinstance(s.spec.ref, str)}
        return cls(slots, dict(aliases), budget, wait, refs, own_process=own_process, group=group,
                   device=device or threading.Lock(), processes=processes)  # fmt: skip

    @property
    def default(self) -> Slot:
        return next(iter(self.slots.values()))

    # -- names ------------------------------------------------------------------------

    def resolve(self, name: str | None) -> Slot:
        """The slot a client's model name means: a served name, an alias (globs
        allowed: ``claude-haiku-*``), the reference a model was given as; none,
        ``default`` or, with one model, any ``claude-*`` name: the default. Else
        a 404 naming what is served."""
        if name is None or name in ("default", "default_model"):
            return self.default
        if name in self.slots:
            return self.slots[name]
        target = self.aliases.get(name) or self.refs.get(name)
        if target is None:
            target = next((t for a, t in self.aliases.items() if fnmatch.fnmatchcase(name, a)),
                          None)  # fmt: skip
        if target is not None:
            return self.slots[target]
        if len(self.slots) == 1 and name.startswith(CLAUDE_PREFIX):
            return self.default  # Claude Code asks for Claude models by name
        served = ", ".join(repr(n) for n in self.slots)
        aliases = f"; aliases: {', '.join(self.aliases)}" if self.aliases else ""
        raise ApiError(404, f"model {name!r} does not exist; this server serves {served}"
                       f"{aliases}", param="model", type="not_found_error",
                       code="model_not_found")  # fmt: skip

    def aliases_of(self, name: str) -> list[str]:
        return [a for a, t in self.aliases.items() if t == name]

    # -- leases -----------------------------------------------------------------------

    @asynccontextmanager
    async def lease(self, slot: Slot) -> AsyncIterator[Host]:
        """The slot's host, loaded if need be, held from eviction while the
        caller runs."""
        host = await self._acquire(slot)
        try:
            yield host
        finally:
            slot.leases -= 1
            slot.last_used = trio.current_time()
            self._changed()

    @contextlib.contextmanager
    def held(self, slot: Slot) -> Any:
        """One more lease on a loaded slot while the block runs (a forwarded
        answer's stream, after its handler returned)."""
        slot.leases += 1
        try:
            yield
        finally:
            slot.leases -= 1
            slot.last_used = trio.current_time()
            self._changed()

    async def _acquire(self, slot: Slot) -> Host:
        asked = trio.current_time()
        deadline = asked + self.wait
        while True:
            host = slot.host
            if host is not None and slot.serving() and not slot.evicting:
                slot.leases += 1
                slot.last_used = trio.current_time()
                return host
            if slot.failed_at >= asked:
                raise ApiError(503, f"model {slot.name!r} could not be loaded: {slot.error}",
                               type="service_unavailable", code="model_load_failed")  # fmt: skip
            if slot.state is ModelState.UNLOADED:
                self._start_load(slot)
            slot.waiters += 1
            try:
                with trio.move_on_at(deadline):
                    await self._change.wait()
                    continue
            finally:
                slot.waiters -= 1
            retry = max(1, math.ceil(slot.load_seconds or 1.0))
            why = "memory to be freed" if slot.state is ModelState.WAITING else "its load"
            raise ApiError(429, f"model {slot.name!r} is not loaded yet: waited {self.wait:g} s "
                           f"for {why}; retry in {retry} s", type="rate_limit_error",
                           code="model_loading", retry_after=retry)  # fmt: skip

    def _changed(self) -> None:
        self._change.set()
        self._change = trio.Event()

    # -- loading and unloading ----------------------------------------------------------

    def _start_load(self, slot: Slot) -> None:
        if self._nursery is None:
            raise ApiError(503, "the server is not serving yet", type="service_unavailable")
        slot.state, slot.error = ModelState.WAITING, None
        self._nursery.start_soon(self._load, slot)
        self._changed()

    async def _load(self, slot: Slot) -> None:
        """Make room, then load (one load at a time, in the order asked)."""
        async with self._loading:
            try:
                if slot.charge is None:
                    slot.charge = await trio.to_thread.run_sync(estimate, slot.spec.ref,
                                                                slot.settings)  # fmt: skip
                await self._make_room(slot)
            except Exception as exc:
                self._failed(slot, f"{type(exc).__name__}: {exc}")
                slot.state = ModelState.UNLOADED
                self._changed()
                return
            slot.state, slot.stop, slot.stopped = ModelState.LOADING, trio.Event(), trio.Event()
            self._changed()
            ready = trio.Event()
            assert self._nursery is not None
            self._nursery.start_soon(self._host, slot, ready)
            await ready.wait()

    async def _host(self, slot: Slot, ready: trio.Event) -> None:
        """The slot's engine, from its load until it is told to stop; then its
        memory handed back (once nothing, this frame included, holds it)."""
        try:
            await self._serve(slot, ready)
        except Exception as exc:
            self._failed(slot, f"{type(exc).__name__}: {exc}")
        finally:
            loaded = slot.engine is not None
            slot.engine = None
            if loaded:
                slot.unloads += 1
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(release_memory, self.own_process)
            slot.state, slot.evicting = ModelState.UNLOADED, False
            slot.stopped.set()
            ready.set()
            self._changed()

    def in_process(self, slot: Slot) -> bool:
        """Whether the slot's model is served in this process (else by a child)."""
        return self.processes is None or slot.default or not isinstance(slot.spec.ref, str)

    async def _serve(self, slot: Slot, ready: trio.Event) -> None:
        if not self.in_process(slot):
            return await self._serve_process(slot, ready)
        t0 = trio.current_time()
        group = self.group if slot.default else None
        async with open_engine(slot.spec.ref, slot.settings, device=self.device,
                               group=group) as engine:  # fmt: skip
            slot.engine, slot.state = engine, ModelState.LOADED
            slot.load_seconds = round(trio.current_time() - t0, 3)
            slot.loads += 1
            slot.charge = charge_of(engine)
            slot.context_length = engine.info.context_length
            slot.last_used = trio.current_time()
            log.info("model %s loaded in %.2f s (%s reserved)", slot.name,
                     slot.load_seconds, _mb(slot.charge))  # fmt: skip
            if self.on_loaded is not None:
                self.on_loaded(slot, None)
            ready.set()
            self._changed()
            await slot.stop.wait()
            slot.state = ModelState.UNLOADING
            self._changed()

    async def _serve_process(self, slot: Slot, ready: trio.Event) -> None:
        """As :meth:`_serve`, the model in a child server: started, watched (its
        figures read every ``FIGURES_EVERY`` s; its death is the slot's
        failure), then told to stop and waited for."""
        t0 = trio.current_time()
        settings = model_process.child_settings(self.processes, slot.name, slot.spec.ref,
                                                slot.settings)  # fmt: skip
        child = await model_process.start(settings, busy=lambda: self._busy_beside(slot))
        try:
            slot.process, slot.state = child, ModelState.LOADED
            slot.load_seconds = round(trio.current_time() - t0, 3)
            slot.loads += 1
            slot.context_length = next(
                (m.get("context_length") for m in child.stats.get("models", [])), None
            )
            slot.last_used = trio.current_time()
            log.info("model %s loaded in %.2f s in process %d (%s reserved)", slot.name,
                     slot.load_seconds, child.pid, _mb(slot.charge))  # fmt: skip
            if self.on_loaded is not None:
                self.on_loaded(slot, None)
            ready.set()
            self._changed()
            while not slot.stop.is_set():
                with trio.move_on_after(model_process.FIGURES_EVERY):
                    await slot.stop.wait()
                await self.refresh(slot)
                if child.process.returncode is not None:
                    raise model_process.ChildFailed(
                        f"its process {child.pid} ended (exit code {child.process.returncode})"
                    )
            slot.state = ModelState.UNLOADING
            self._changed()
        finally:
            if slot.process is not None:
                slot.unloads += 1
            slot.process = None
            slot.tokens_before = slot.tokens
            await child.stop()

    def _busy_beside(self, slot: Slot) -> bool:
        """Whether a model other than ``slot`` has work (rows, or requests)."""
        return any(not s.idle() for s in self.slots.values() if s is not slot and s.serving())

    async def refresh(self, slot: Slot) -> None:
        """A process-served model's figures read again from its child."""
        child = slot.process
        if child is None:
            return
        await child.refresh()
        slot.tokens = slot.tokens_before + int(child.figures.get("tokens") or 0)

    def _failed(self, slot: Slot, error: str) -> None:
        slot.error, slot.failed_at = error, trio.current_time()
        log.error("model %s could not be loaded: %s", slot.name, error)
        if self.on_loaded is not None:
            self.on_loaded(slot, error)

    async def _make_room(self, slot: Slot) -> None:
        """Unload idle models (least recently used first) until ``slot`` fits; when
        only busy ones are left, mark the least recently used evicting and wait
        for its rows to finish."""
        budget = self.budget if isinstance(self.budget, int) else None
        need = slot.charge or 0
        while budget is not None:
            others = [s for s in self.slots.values() if s is not slot and s.state in (
                ModelState.LOADING, ModelState.LOADED, ModelState.UNLOADING)]  # fmt: skip
            if sum(s.charge or 0 for s in others) + need <= budget:
                return
            movable = sorted((s for s in others if not s.pinned), key=lambda s: s.last_used)
            pinned = sum(s.charge or 0 for s in others if s.pinned)
            if not movable or pinned + need > budget:
                raise NoRoom(
                    f"model {slot.name!r} needs {_mb(need)} (weights, KV budget and a step's "
                    f"workspace) and the memory budget is {_mb(budget)}, "
                    f"{_mb(pinned)} of it held by pinned models: raise --memory-budget, "
                    "lower --kv-budget, or pin fewer models"
                )
            idle = [s for s in movable if s.state is ModelState.LOADED and s.idle()]
            if idle:
                await self.unload(idle[0], "to make room for " + slot.name)
                continue
            victim = next((s for s in movable if s.state is ModelState.LOADED), None)
            if victim is not None and not victim.evicting:
                victim.evicting = True
                log.info("model %s: taking no new requests, to make room for %s once its "
                         "rows finish", victim.name, slot.name)  # fmt: skip
                self._changed()
            await trio.sleep(DRAIN_POLL)

    async def unload(self, slot: Slot, why: str) -> None:
        if slot.state is ModelState.LOADED:
            self._stop(slot, why)
        await slot.stopped.wait()

    def _stop(self, slot: Slot, why: str) -> None:
        """Tell a loaded slot's engine to close (its host task unloads it)."""
        log.info("model %s: unloading (%s)", slot.name, why)
        slot.state = ModelState.UNLOADING
        slot.stop.set()

    # -- the pool's life ----------------------------------------------------------------

    async def run(self, stop: trio.Event) -> None:
        """Load the default and pinned models, unload idle ones on their keep-alive, until
        ``stop``; then unload every model (their rows cancelled)."""
        if self.budget == "auto":
            self.budget = await trio.to_thread.run_sync(auto_memory_budget)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for slot in self.slots.values():
                if slot.pinned or slot.default:
                    self._start_load(slot)
            nursery.start_soon(self._keep_alive)
            await stop.wait()
            for slot in self.slots.values():
                slot.stop.set()
            nursery.cancel_scope.cancel()

    async def _keep_alive(self) -> None:
        while True:
            await trio.sleep(KEEP_ALIVE_TICK)
            now = trio.current_time()
            for slot in list(self.slots.values()):
                if slot.state is not ModelState.LOADED:
                    continue
                if not slot.idle() or slot.waiters:  # just loaded: its waiters are due
                    slot.last_used = now
                elif slot.spec.keep_alive is not None and (
                    now - slot.last_used >= slot.spec.keep_alive
                ):
                    self._stop(slot, f"idle for {slot.spec.keep_alive:g} s")

    def loaded(self) -> list[Slot]:
        """The slots whose engines are loaded in this process."""
        return [s for s in self.slots.values() if s.state is ModelState.LOADED and s.engine]

    def hosts(self) -> list[Host]:
        """The hosts of the models that serve now, here or in processes."""
        return [s.host for s in self.slots.values() if s.serving() and s.host is not None]

    async def wait_idle(self) -> None:
        for slot in self.loaded():
            assert slot.engine is not None
            await slot.engine.wait_idle()

    async def close(self, reason: str) -> None:
        for slot in self.loaded():
            assert slot.engine is not None
            await slot.engine.close(reason)

    def figures(self) -> dict[str, Any]:
        now = trio.current_time()
        budget = self.budget if isinstance(self.budget, int) else None
        models = [{**s.figures(now), "aliases": self.aliases_of(s.name)}
                  for s in self.slots.values()]  # fmt: skip
        held = sum((s.charge or 0) for s in self.slots.values() if s.state in (
            ModelState.LOADING, ModelState.LOADED, ModelState.UNLOADING))  # fmt: skip
        return {"memory_budget_bytes": budget, "reserved_bytes": held, "models": models}


def release_memory(own_process: bool) -> None:
    """After an engine closed: collect what it held, hand mlx's buffer cache and
    the C heap's free pages back to the system. A server process re-freezes its
    long-lived heap (``state.freeze_startup_heap``) around the collection."""
    if own_process:
        gc.unfreeze()
    gc.collect()
    if own_process:
        gc.freeze()
    mx.clear_cache()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:,.0f} MiB"
