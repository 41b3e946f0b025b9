"""Every message the actors exchange, and the helpers that send them.

Actors meet only through these (and the rows they carry): an actor imports
this module, ``row``, ``request``, ``stats`` and the GPU actor, never another
actor, so the actors are peers and the engine (``engine.py``) wires them. Each
message's docstring names its sender and its receiver. ``docs/engine.md``
draws the graph.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .request import CacheReason, CacheReport, FinishReason, Priority, TopLogprob
from .row import Phase, Row

if TYPE_CHECKING:
    from .step.batch import Batch


# -- admission ----------------------------------------------------------------------


@attrs.frozen
class Enqueue:
    """engine -> admission: queue ``row``; ``reply`` gets :class:`Accepted` or
    :class:`Refused` at once (the queue is full)."""

    row: Row
    reply: trio.MemorySendChannel = attrs.field(repr=False)


@attrs.frozen
class Accepted:
    """admission -> engine: the row is queued."""


@attrs.frozen
class Refused:
    """admission -> engine: the queue is full (an HTTP 429 with ``Retry-After``)."""

    queued: int  # rows waiting when it was refused
    retry_after: float  # seconds, estimated from the queue ahead and the step rate


@attrs.frozen
class Submit:
    """Hands a row over: admission -> prefill or serial."""

    row: Row


@attrs.frozen
class Left:
    """A row owner (prefill, decode, serial) -> admission: the row left its lane
    (ended); its slot and KV projection are free."""

    row_id: int


@attrs.frozen
class Shutdown:
    """engine -> admission: end every queued and running row with ``reason``."""

    reason: str


async def release(
    row: Row,
    *,
    to_emitter: trio.MemorySendChannel,
    to_admission: trio.MemorySendChannel,
    announced: bool,
) -> None:
    """How every row owner (prefill, decode, serial) lets a row go once it has
    ended: its work dropped, its terminal event to the emitter unless its last
    token carried it (``announced``), its slot back to admission."""
    row.work = None
    if row.phase is not Phase.ENDED:
        row.move(Phase.ENDED)
    if not announced:
        await to_emitter.send(Ended(row))
    await to_admission.send(Left(row.id))


# -- about one row: routed by admission to its owner --------------------------------


@attrs.frozen
class Pause:
    """admission -> decode (through prefill): take a decoding row out of the
    batch, its KV and pending token kept, to give its slot to another session.
    Decode answers :class:`Paused`, or :class:`NotPaused` when the row is not
    decoding (still joining, ending, gone)."""

    row_id: int


@attrs.frozen
class Paused:
    """decode -> admission: the row is out of the batch, its KV kept (``row.work``)."""

    row: Row


@attrs.frozen
class NotPaused:
    """decode -> admission: the row was not decoding (joining, ending, gone)."""

    row_id: int


@attrs.frozen
class Backlog:
    """admission -> decode (through prefill): whether requests now wait for a
    slot of the batch (queued or paused), sent when that changes. With nobody
    waiting, a draft kept only shortens the batch's own work, and the gate
    values drafts so (``speculation.gate.Gate.choose``)."""

    waiting: bool


# -- the emitter --------------------------------------------------------------------


@attrs.frozen
class TokenOut:
    """A row owner -> the emitter: one token of one row. ``token`` is None when the row ends
    without a token to show (EOS or a stop token id); ``ends`` is set on the row's
    last token, and then the row has been handed over with it."""

    row: Row
    token: int | None
    logprob: float | None = None
    top_logprobs: tuple[TopLogprob, ...] | None = None
    ends: bool = False

    @classmethod
    def accepted(
        cls, row: Row, token: int, logprob: float | None, top: tuple[TopLogprob, ...] | None
    ) -> TokenOut:
        """A sampled token recorded on its row (every row owner alike): EOS and the
        stop ids end the row as ``stop`` and are never shown; max_tokens ends it too."""
        reason = row.accept(token)
        shown = None if reason is FinishReason.STOP else token
        return cls(row, shown, logprob, top, ends=reason is not None)


@attrs.frozen
class Tokens:
    """A row owner -> the emitter: one step's tokens, every row's at once."""

    items: tuple[TokenOut, ...]


@attrs.frozen
class Ended:
    """A row owner -> the emitter: it ended ``row`` (``row.end`` says why) with no
    token to show."""

    row: Row


# -- prefill -> decode ------------------------------------------------------------


@attrs.frozen
class Join:
    """prefill -> decode: primed rows. ``batch`` holds their KV and pending first
    tokens, one slot per row in this order (one row's solo caches, or a group
    prefilled together). Rows that ended at their first token stay in the
    tuple, ENDED: decode drops their slots when the rest join."""

    rows: tuple[Row, ...]
    batch: Batch


# -- the prompt cache --------------------------------------------------------------


class EntryKind(enum.StrEnum):
    """mlx-lm's entry types, which set its eviction preference (a str enum: the
    store takes the string)."""

    SYSTEM = "system"  # a boundary snapshot: a prefix that later prompts share
    USER = "user"
    ASSISTANT = "assistant"  # a finished row: its prompt and its answer


# Whose latest entry is pinned: a session and a class (``Row.pin``), so a session's
# sub-agents keep their latest entry and never unpin its main agent's.
Pin = tuple[str, Priority]


@attrs.frozen
class Take:
    """A row owner -> the prompt cache: the longest usable cached prefix of
    ``tokens`` (:func:`take` sends it and waits for the :class:`Hit`)."""

    tokens: list[int] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    reply: trio.MemorySendChannel = attrs.field(repr=False)  # gets one Hit
    session: Pin | None = None  # the asking row's (it is active)


@attrs.frozen
class Put:
    """A row owner -> the prompt cache: keep ``caches`` (the KV of ``tokens``)."""

    tokens: list[int] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    caches: list[Any] = attrs.field(repr=False)
    kind: EntryKind = EntryKind.ASSISTANT
    session: Pin | None = None  # whose: each pin's latest entry is kept while it is active


@attrs.frozen
class Trim:
    """admission -> the prompt cache: keep at most ``max_bytes`` (the budget minus
    the live batch)."""

    max_bytes: int


@attrs.frozen
class Hit:
    """The prompt cache -> the row owner that sent a :class:`Take`."""

    caches: list[Any] | None  # None: nothing usable
    cached: int  # prompt tokens already in ``caches``
    report: CacheReport | None = None  # why that much (and no more)


async def take(
    to_cache: trio.MemorySendChannel | None, tokens: list[int], session: Pin | None = None
) -> Hit:
    """Ask the prompt cache (through its mailbox) for the longest usable cached
    prefix of ``tokens``: a request-reply any actor can make from its own task."""
    if to_cache is None:
        return Hit(None, 0, CacheReport(CacheReason.DISABLED))
    send, receive = trio.open_memory_channel(1)
    await to_cache.send(Take(tokens, send, session))
    with receive:
        try:
            return await receive.receive()
        except trio.EndOfChannel:
            return Hit(None, 0)


# A finished row's KV is handed to the prompt cache when its prompt has at least
# this many tokens (shorter ones are cheaper to recompute than to store; a merged
# row's must also be copied out of the batch first).
PUT_MIN_PROMPT = 16


def worth_keeping(row: Row) -> bool:
    """Whether an ended row's KV goes to the prompt cache (both lanes)."""
    return row.end is not None and row.end.reason.finished and len(row.prompt) >= PUT_MIN_PROMPT
