"""The models' pool in the app, and the server's phase."""

from __future__ import annotations

import enum
import gc
import logging
import os
import tempfile
from pathlib import Path

import attrs
import trio
from mlx_nursery.actors import Engine
from mlx_nursery.actors.families import family_of
from mlx_nursery.actors.gpu import DeviceLock
from mlx_nursery.actors.models.registry import short_id

from .api.base import ApiError
from .pool import DEFAULT_KEEP_ALIVE, ModelSpec, Pool, Slot
from .request_log import RequestLog
from .settings import Settings
from .sizing import model_kv_budget
from .specs import ModelState

log = logging.getLogger("mlx_nursery.server")


class ServerPhase(enum.StrEnum):
    STARTING = "starting"  # the model loads; /health is 503
    SERVING = "serving"
    DRAINING = "draining"  # shutting down: no new work, in-flight requests finish
    STOPPED = "stopped"
    FAILED = "failed"  # the engine could not start (``error`` says why)


def freeze_startup_heap() -> None:
    """In a process that is the server's own, once the model is loaded: what
    loading made (the model, tokenizer and libraries, ~100k objects) lives as
    long as the server, so it is frozen out of the cyclic GC and a full
    collection walks only what requests allocated since. Unfrozen, a full
    collection under load stalled the event loop ~60 ms on 2 cores."""
    gc.collect()
    gc.freeze()


_UNAVAILABLE = {
    ServerPhase.STARTING: "the model is still loading; retry shortly",
    ServerPhase.DRAINING: "the server is shutting down",
    ServerPhase.STOPPED: "the server is shutting down",
}


@attrs.define(eq=False)
class ServerState:
    """The models' pool, and the server's phase (which follows the default model:
    serving once it has loaded, failed if it cannot)."""

    settings: Settings
    phase: ServerPhase = ServerPhase.STARTING
    error: str | None = None
    failed: trio.Event = attrs.field(factory=trio.Event)
    requests: RequestLog = attrs.field(init=False)
    pool: Pool = attrs.field(init=False)
    _stop: trio.Event = attrs.field(factory=trio.Event)
    _stopped: trio.Event = attrs.field(factory=trio.Event)

    def __attrs_post_init__(self) -> None:
        self.requests = RequestLog(self.settings.request_log)
        self.pool = pool_of(self.settings)
        self.pool.on_loaded = self._loaded

    @property
    def engine(self) -> Engine | None:
        """The default model's engine, while it is loaded."""
        slot = self.pool.default
        return slot.engine if slot.state is ModelState.LOADED else None

    @property
    def model_id(self) -> str:
        """The default model's public name (never a filesystem path)."""
        return self.pool.default.name

    def _loaded(self, slot: Slot, error: str | None) -> None:
        """A load ended: the first of the default model starts (or fails) the server."""
        if not slot.default or self.phase is not ServerPhase.STARTING:
            return
        if error is not None:
            self.phase, self.error = ServerPhase.FAILED, error
            log.error("the engine failed to start: %s", error)
            self.failed.set()
            return
        engine = slot.engine
        assert engine is not None
        if self.settings.own_process:
            freeze_startup_heap()
        self.phase = ServerPhase.SERVING
        stats = engine.stats()
        family = family_of(engine.tokenizer)
        calls = family.name if family is not None else "the generic format"
        log.info("serving %s (batch %d, mode %s, tool calls: %s, KV %s)", self.model_id,
                 slot.settings.batch, stats.mode, calls, stats.kv_precision.name)  # fmt: skip
        others = [n for n in self.pool.slots if n != slot.name]
        if others:
            log.info("also serving, loaded on first request: %s", ", ".join(others))

    async def host_engine(self) -> None:
        try:
            await self.pool.run(self._stop)
        finally:
            if self.phase is not ServerPhase.FAILED:
                self.phase = ServerPhase.STOPPED
            self._stopped.set()

    async def drain(self, deadline: float) -> None:
        """Refuse new work, let in-flight requests finish within ``deadline`` seconds,
        then cancel the rest (each stream still gets its terminal event)."""
        if self.phase is not ServerPhase.SERVING:
            return
        self.phase = ServerPhase.DRAINING
        with trio.move_on_after(deadline):
            await self.pool.wait_idle()
        await self.pool.close("the server is shutting down")

    async def stop(self) -> None:
        self._stop.set()
        await self._stopped.wait()

    def health(self) -> tuple[int, dict]:
        """``/health``'s status and body: 200 while serving and healthy; else 503
        with the phase, or the engine's reason (the ranks lost, a stalled call)."""
        if self.phase is ServerPhase.SERVING:
            for slot in self.pool.loaded():
                assert slot.engine is not None
                problem = slot.engine.health()
                if problem is not None:
                    return 503, {"status": "unhealthy", "error": problem, "model": slot.name}
            return 200, {"status": "ok"}
        return 503, {"status": self.phase.value, "error": self.error}

    def check_serving(self) -> None:
        """A 503 unless the server serves (it starts, drains, or failed)."""
        if self.phase is ServerPhase.SERVING:
            return
        message = _UNAVAILABLE.get(self.phase) or f"the engine failed to start: {self.error}"
        raise ApiError(503, message, type="service_unavailable", code=self.phase.value)

    def engine_or_503(self) -> Engine:
        """The default model's engine (a 503 while the server is not serving or
        the default model is unloaded)."""
        self.check_serving()
        if self.engine is None:
            raise ApiError(503, f"the default model {self.model_id!r} is not loaded now",
                           type="service_unavailable", code="model_unloaded")  # fmt: skip
        return self.engine


def pool_of(settings: Settings) -> Pool:
    """The pool of the configured models: ``settings.model`` (the default) first."""
    several = bool(settings.models)
    engine = attrs.evolve(settings.engine, kv_budget=model_kv_budget(
        settings.engine, settings.memory_budget, several))  # fmt: skip
    keep, name = settings.keep_alive, settings.model_name or short_id(settings.model)
    specs = [ModelSpec(name, settings.model, keep.get(name))]  # pinned unless named
    for name, ref in settings.models:
        specs.append(ModelSpec(name, ref, keep.get(name, keep.get("", DEFAULT_KEEP_ALIVE))))
    processes, lock = None, settings.device_lock
    if settings.model_processes and several:  # docs/models.md, "A process a model"
        lock = lock or Path(tempfile.gettempdir()) / f"mlx-nursery-{os.getpid()}.device.lock"
        processes = attrs.evolve(settings, device_lock=lock)
    return Pool.of(specs, engine, aliases=settings.aliases, budget=settings.memory_budget,
                   wait=settings.model_wait, own_process=settings.own_process,
                   group=settings.group, processes=processes,
                   device=None if lock is None else DeviceLock(lock))  # fmt: skip
