"""Each finished request's timings and prompt-cache figures: the most recent
ones for ``/stats`` and the dashboard, and, with ``--request-log FILE``, one JSON
line per request appended to a file for people who graph their own.

A record never holds prompt or answer text: token counts, timings, and where a
prompt stopped matching the prompt cache (a token position, a message index).
"""

from __future__ import annotations

import collections
import json
import logging
import time
from pathlib import Path
from typing import Any

import attrs
from mlx_nursery.actors import Event

log = logging.getLogger("mlx_nursery.server")

RECENT = 64  # records kept for /stats and the dashboard


def record_of(
    event: Event, *, request_id: str, api: str, session: str | None = None
) -> dict[str, Any]:
    """One request's record, from its terminal event."""
    usage, cache = event.usage, event.usage.cache if event.usage is not None else None
    out: dict[str, Any] = {
        "request_id": request_id,
        "api": api,
        "session": session,
        "ended_at": round(time.time(), 3),
        "finish_reason": str(event.finish_reason),
    }
    if usage is not None:
        out.update(
            priority=usage.priority,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
            queue_wait_seconds=usage.queue_wait,
            time_to_first_token_seconds=usage.time_to_first_token,
            prefill_tokens_per_second=usage.prefill_tokens_per_second,
            decode_tokens_per_second=usage.decode_tokens_per_second,
        )
    if cache is not None:
        out["prompt_cache"] = cache_body(cache)
    return out


def cache_body(cache: Any) -> dict[str, Any]:
    """The prompt-cache report as JSON (the ``usage.prompt_cache`` extension)."""
    return {
        "reason": str(cache.reason),
        "cached_tokens": cache.cached,
        "shared_tokens": cache.shared,
        "diverged_at": cache.diverged_at,
        "diverged_message": cache.message,
        "tier": str(cache.tier) if cache.tier is not None else None,
    }


@attrs.define(eq=False)
class RequestLog:
    path: Path | None = None
    recent: collections.deque = attrs.field(factory=lambda: collections.deque(maxlen=RECENT))
    # Requests answered 4xx at the HTTP layer (never reached the engine, or refused
    # by it at submit): (api, status, reason) -> count, for /stats and /metrics.
    refusals: collections.Counter = attrs.field(factory=collections.Counter)
    # What the intake changed in prompts (``Parsed.adjusted``): kind -> count.
    adjusted: collections.Counter = attrs.field(factory=collections.Counter)
    _failed: bool = False

    def refuse(self, *, api: str, status: int, reason: str, request_id: str | None) -> None:
        """Count one refused request and list it among the recent ones."""
        self.refusals[(api, status, reason)] += 1
        self.record({"request_id": request_id, "api": api, "ended_at": round(time.time(), 3),
                     "finish_reason": "refused", "status": status, "reason": reason})  # fmt: skip

    def refusal_figures(self) -> list[dict[str, Any]]:
        return [{"api": api, "status": status, "reason": reason, "count": n}
                for (api, status, reason), n in sorted(self.refusals.items())]  # fmt: skip

    def record(self, entry: dict[str, Any]) -> None:
        self.recent.append(entry)
        if self.path is None or self._failed:
            return
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(entry, separators=(",", ":")) + "\n")
        except OSError as exc:  # a full disk must not fail requests: say so once
            self._failed = True
            log.error("the request log %s cannot be written (%s); not logging", self.path, exc)
