"""The engine's place in the app, and the server's phase."""

from __future__ import annotations

import enum
import gc
import logging

import attrs
import trio
from mlx_nursery.actors import Engine, open_engine
from mlx_nursery.actors.families import family_of
from mlx_nursery.actors.models.registry import short_id

from .api.base import ApiError
from .request_log import RequestLog
from .settings import Settings

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
    """The engine's place in the app, and the server's phase."""

    settings: Settings
    engine: Engine | None = None
    phase: ServerPhase = ServerPhase.STARTING
    error: str | None = None
    failed: trio.Event = attrs.field(factory=trio.Event)
    requests: RequestLog = attrs.field(init=False)
    _stop: trio.Event = attrs.field(factory=trio.Event)
    _stopped: trio.Event = attrs.field(factory=trio.Event)

    def __attrs_post_init__(self) -> None:
        self.requests = RequestLog(self.settings.request_log)

    @property
    def model_id(self) -> str:
        """The served model's public name (never a filesystem path)."""
        return self.engine.model_id if self.engine is not None else short_id(self.settings.model)

    async def host_engine(self) -> None:
        s = self.settings
        try:
            async with open_engine(s.model, s.engine, group=s.group) as engine:
                if s.own_process:
                    freeze_startup_heap()
                self.engine, self.phase = engine, ServerPhase.SERVING
                stats = engine.stats()
                family = family_of(engine.tokenizer)
                calls = family.name if family is not None else "the generic format"
                log.info("serving %s (batch %d, mode %s, tool calls: %s, KV %s)", self.model_id,
                         s.engine.batch, stats.mode, calls, stats.kv_precision.name)  # fmt: skip
                await self._stop.wait()
        except Exception as exc:
            self.phase, self.error = ServerPhase.FAILED, f"{type(exc).__name__}: {exc}"
            log.error("the engine failed to start: %s", self.error)
            self.failed.set()
        finally:
            if self.phase is not ServerPhase.FAILED:
                self.phase = ServerPhase.STOPPED
            self._stopped.set()

    async def drain(self, deadline: float) -> None:
        """Refuse new work, let in-flight requests finish within ``deadline`` seconds,
        then cancel the rest (each stream still gets its terminal event)."""
        if self.engine is None or self.phase is not ServerPhase.SERVING:
            return
        self.phase = ServerPhase.DRAINING
        with trio.move_on_after(deadline):
            await self.engine.wait_idle()
        await self.engine.close("the server is shutting down")

    async def stop(self) -> None:
        self._stop.set()
        await self._stopped.wait()

    def health(self) -> tuple[int, dict]:
        """``/health``'s status and body: 200 while serving and healthy; else 503
        with the phase, or the engine's reason (the ranks lost, a stalled call)."""
        if self.phase is ServerPhase.SERVING:
            problem = self.engine.health()
            if problem is not None:
                return 503, {"status": "unhealthy", "error": problem}
            return 200, {"status": "ok"}
        return 503, {"status": self.phase.value, "error": self.error}

    def engine_or_503(self) -> Engine:
        if self.phase is ServerPhase.SERVING and self.engine is not None:
            return self.engine
        message = _UNAVAILABLE.get(self.phase) or f"the engine failed to start: {self.error}"
        raise ApiError(503, message, type="service_unavailable", code=self.phase.value)
