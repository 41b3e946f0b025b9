"""GPU calls begun in this process, by every engine's GPU thread.

The GPU actor counts each call as it begins (:func:`began`). A decode step that
sees the count one past its last step's knows nothing else ran in between: its
period is its own (``verify.Verifier`` times plain steps so).
"""

from __future__ import annotations

import itertools

_begun = itertools.count(1)
_last = 0


def began() -> None:
    """A GPU call begins (the GPU thread, before it runs)."""
    global _last
    _last = next(_begun)


def calls_begun() -> int:
    """How many GPU calls have begun so far."""
    return _last
