"""When a row ends, token by token: shared by the decode actor, prefill (a row's
first token) and the serial lane."""

from __future__ import annotations

from collections.abc import Collection

from .request import Row


def finish_reason(row: Row, token: int, generated: int, eos: Collection[int]) -> str | None:
    """Why ``row`` ends on ``token``, its ``generated``-th token (1-based), if it does."""
    if token in eos or token in row.params.stop_token_ids:
        return "stop"
    if generated >= row.params.max_tokens:
        return "length"
    return None
