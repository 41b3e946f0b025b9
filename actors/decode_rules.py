"""When a row ends, token by token, and whether its KV is worth keeping: shared
by the decode actor, prefill (a row's first token) and the serial lane."""

from __future__ import annotations

from collections.abc import Collection

from .request import Row

# A finished row's KV is handed to the prompt cache when its prompt has at least
# this many tokens (shorter ones are cheaper to recompute than to store; a merged
# row's must also be copied out of the batch first).
PUT_MIN_PROMPT = 16


def finish_reason(row: Row, token: int, generated: int, eos: Collection[int]) -> str | None:
    """Why ``row`` ends on ``token``, its ``generated``-th token (1-based), if it does."""
    if token in eos or token in row.params.stop_token_ids:
        return "stop"
    if generated >= row.params.max_tokens:
        return "length"
    return None
