"""How a loaded model is hosted, asked one way (``docs/models.md``): an engine in
this process (:class:`InProcess`) or a child server of its own
(:class:`InChild`, ``model_process.py``). The pool and the routes ask a slot's
``host`` and never which it is:

- ``answer(routes, slot, body, parsed, api)``: a generation request's response
  (the engine's own streams, or the child's answer passed back as it comes),
  and ``count(...)``: a count of a prompt's tokens;
- ``sessions()``, ``cancel_session(session, why)``: its live sessions;
- ``figures()``: its engine's ``/stats`` figures;
- ``idle()``, ``resident_bytes()``, ``pid``: what the pool weighs it by.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Protocol

import attrs
from mlx_nursery.actors import Engine

from .metrics import stats_json
from .model_process import ModelProcess

if TYPE_CHECKING:
    from quart import Response

    from .api.base import Api, Parsed

Slot = Any  # the pool's slot (``pool.Slot``), passed through to what answers


class Routes(Protocol):
    """What answers a request (``routes.Routes``): here, or passed to a child."""

    async def generate_here(self, engine: Engine, slot: Slot, parsed: Parsed, api: Api
                            ) -> Response: ...  # fmt: skip

    async def count_here(self, engine: Engine, parsed: Parsed) -> Response: ...

    async def forward(self, child: ModelProcess, slot: Slot, body: dict) -> Response: ...

# /stats keys that are the server's, not a model engine's
SERVER_FIGURES = frozenset({"model", "models", "memory_budget_bytes", "reserved_bytes",
                            "recent_requests", "refusals", "prompt_adjusted"})  # fmt: skip


class Host(Protocol):
    pid: int | None

    async def answer(self, routes: Routes, slot: Slot, body: dict, parsed: Parsed,
                     api: Api) -> Response: ...  # fmt: skip

    async def count(self, routes: Routes, slot: Slot, body: dict, parsed: Parsed
                    ) -> Response: ...  # fmt: skip

    async def sessions(self) -> list[dict]: ...

    async def cancel_session(self, session: str, why: str) -> int: ...

    async def figures(self) -> dict[str, Any]: ...

    def idle(self) -> bool: ...

    def resident_bytes(self) -> int: ...


@attrs.frozen
class InProcess:
    """A model whose engine runs in this process."""

    engine: Engine
    pid: int | None = None  # this process

    async def answer(self, routes: Routes, slot: Slot, body: dict, parsed: Parsed,
                     api: Api) -> Response:  # fmt: skip
        return await routes.generate_here(self.engine, slot, parsed, api)

    async def count(self, routes: Routes, slot: Slot, body: dict, parsed: Parsed) -> Response:
        return await routes.count_here(self.engine, parsed)

    async def sessions(self) -> list[dict]:
        return [session_json(s) for s in self.engine.sessions()]

    async def cancel_session(self, session: str, why: str) -> int:
        return self.engine.cancel_session(session, why)

    async def figures(self) -> dict[str, Any]:
        body = stats_json(self.engine.stats())
        ranks = self.engine.ranks()
        if ranks is not None:
            body["ranks"] = ranks
        return body

    def idle(self) -> bool:
        return self.engine.idle()

    def resident_bytes(self) -> int:
        s = self.engine.stats()
        return self.engine.info.weights_bytes + s.kv_bytes + s.prompt_cache_bytes


@attrs.frozen
class InChild:
    """A model served by a child server of its own; its figures as last read
    (every ``model_process.FIGURES_EVERY`` s, and by ``Pool.refresh``)."""

    child: ModelProcess

    @property
    def pid(self) -> int | None:
        return self.child.pid

    async def answer(self, routes: Routes, slot: Slot, body: dict, parsed: Parsed,
                     api: Api) -> Response:  # fmt: skip
        return await routes.forward(self.child, slot, body)

    async def count(self, routes: Routes, slot: Slot, body: dict, parsed: Parsed) -> Response:
        return await routes.forward(self.child, slot, body)

    async def sessions(self) -> list[dict]:
        r = await self.child.call("GET", "/v1/sessions")
        if r is not None and r.status_code == 200:
            with contextlib.suppress(ValueError, KeyError):
                return list(r.json()["data"])
        return []

    async def cancel_session(self, session: str, why: str) -> int:
        r = await self.child.call("DELETE", f"/v1/sessions/{session}")
        if r is not None and r.status_code == 200:
            with contextlib.suppress(ValueError, KeyError):
                return int(r.json()["cancelled"])
        return 0

    async def figures(self) -> dict[str, Any]:
        return {k: v for k, v in self.child.stats.items() if k not in SERVER_FIGURES}

    def idle(self) -> bool:
        return True  # its rows are the child's: the slot's leases cover its requests

    def resident_bytes(self) -> int:
        return int(self.child.figures.get("resident_bytes") or 0)


def session_json(s: Any) -> dict:
    """A live session (``Engine.sessions``) as ``/v1/sessions`` lists it."""
    rows = [attrs.asdict(r) for r in s.rows]
    return {
        "id": s.id,
        "object": "session",
        "parent": s.parent,
        "weight": s.weight,
        "queued": s.queued,
        "paused": s.paused,
        "running": s.running,
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "cached_tokens": sum(r["cached_tokens"] for r in rows),
        "tokens": sum(r["tokens"] for r in rows),
        "rows": rows,
    }
