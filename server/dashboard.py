"""The live view of the engine: ``GET /`` (one self-contained page), its feed
``GET /dashboard/events`` (SSE snapshots) and ``GET /dashboard/snapshot`` (one
snapshot as JSON, for ``mlx-nursery top``).

A snapshot is built from what the event loop already holds (the stats snapshot,
the live rows' records, the recent requests): no GPU call, no actor's state
changed. A viewer's feed builds its next snapshot only once the last one was
sent (Hypercorn's send waits on the client), so at most one is in flight per
viewer and a slow viewer gets fewer, never a queue. No prompt or answer text
is in a snapshot.
"""

from __future__ import annotations

import json
import time
from importlib import resources
from typing import Any

import attrs
import trio

from .metrics import stats_json

FEED_SECONDS = 0.25  # a snapshot every quarter second per viewer (at most)
RECENT_SHOWN = 20


def snapshot(state: Any) -> dict[str, Any]:
    """What the dashboard and ``top`` show, as JSON-ready data."""
    engine = state.engine
    out: dict[str, Any] = {
        "time": time.time(),
        "model": state.model_id,
        "phase": str(state.phase),
        "recent_requests": list(state.requests.recent)[-RECENT_SHOWN:],
        **state.pool.figures(),  # every model's state and figures, the memory budget
    }
    if engine is None:
        return out
    stats = stats_json(engine.stats())
    out["stats"] = {k: v for k, v in stats.items() if k != "batch"}
    out["rows"] = [attrs.asdict(r) for r in engine.live()]
    return out


async def feed(state: Any):
    """SSE: one snapshot frame every ``FEED_SECONDS``, built when it is sent; the
    feed ends once the server drains (an open tab must not hold up shutdown)."""
    while state.phase in ("starting", "serving"):
        body = json.dumps(snapshot(state), separators=(",", ":"))
        yield f"event: snapshot\ndata: {body}\n\n".encode()
        await trio.sleep(FEED_SECONDS)


def page() -> bytes:
    return resources.files("mlx_nursery.server").joinpath("dashboard.html").read_bytes()
