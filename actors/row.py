"""One live request: the :class:`Row` record and its :class:`Phase` machine.

A row is one record from submit to its end. Exactly one actor owns it at a time
and it moves between actors inside the message that hands it over:

    engine.submit -> admission (QUEUED) -> prefill (PREFILLING) -> decode (JOINING,
    DECODING); or admission -> serial (SERIAL); then the owner ends it (ENDED)
    and hands it to the emitter, which sends its one terminal event. A decoding
    row may be paused to make room for another session (decode -> admission,
    PAUSED, its KV kept on the row) and resumed (-> prefill -> decode, JOINING).

Only the owner writes the row's mutable fields. The emitter reads the fixed
fields (id, prompt, params, events) of a row it is handed tokens for, and the
rest once the owner has ended the row and handed it over.

Two decisions live here, so every owner makes them the same way:
:meth:`Row.accept` (does this token end the row?) and :meth:`Row.ask_end` (the
first reason to end wins; a later finish or cancel for the same row is a no-op).
"""

from __future__ import annotations

import enum
from typing import Any

import attrs
import trio

from .request import CacheReport, FinishReason, Lane, Priority, SamplingParams


class Phase(enum.Enum):
    QUEUED = "queued"  # admission's FIFO
    PREFILLING = "prefilling"  # prefill: prompt chunks, then the first token
    JOINING = "joining"  # decode: primed, waiting for the next turn to join
    DECODING = "decoding"  # decode: in the running batch
    SERIAL = "serial"  # serial lane: generate_step, alone on the GPU
    PAUSED = "paused"  # admission's queue again, its KV and pending token on the row
    ENDED = "ended"  # handed to the emitter with its end


_NEXT = {
    Phase.QUEUED: {Phase.PREFILLING, Phase.SERIAL, Phase.ENDED},
    Phase.PREFILLING: {Phase.JOINING, Phase.ENDED},
    Phase.JOINING: {Phase.DECODING, Phase.ENDED},
    Phase.DECODING: {Phase.PAUSED, Phase.ENDED},
    Phase.SERIAL: {Phase.ENDED},
    Phase.PAUSED: {Phase.JOINING, Phase.ENDED},
    Phase.ENDED: set(),
}


class IllegalTransition(RuntimeError):
    """A row was moved to a phase it cannot reach from where it is: an engine bug."""


@attrs.frozen
class End:
    """Why a row ends. ``detail`` says more (an error message, who cancelled)."""

    reason: FinishReason
    detail: str | None = None
    code: str | None = None  # a machine-readable kind of error (e.g. queue_timeout)


@attrs.frozen
class Cancel:
    """End a row that has not finished. Accepted by every owner of a row; admission
    routes it to the one that holds the row now."""

    row_id: int
    reason: str


@attrs.frozen
class Finish:
    """A row reached its end where its owner cannot see it, in the emitter: a stop
    string (``stop``: ended like a finish, its KV kept) or a fault in its own
    delivery (``error``, with ``detail``). Routed like :class:`Cancel`."""

    row_id: int
    reason: FinishReason
    detail: str | None = None


@attrs.define(eq=False, repr=False)
class RowTimes:
    """Clock readings (``trio.current_time()``), each written once by the row's owner."""

    submitted: float  # engine.submit
    prefill_started: float | None = None  # prefill / serial
    prefill_ended: float | None = None  # prefill / serial
    paused: float | None = None  # admission: when it was last paused (None: never)

    @property
    def queued(self) -> float:
        """When it last entered admission's queue: submitted, or paused since."""
        return self.submitted if self.paused is None else self.paused


@attrs.define(eq=False)
class Row:
    """One request from submit to its end."""

    id: int
    prompt: list[int] = attrs.field(repr=lambda p: f"<{len(p)} tokens>")  # no text in logs
    params: SamplingParams
    lane: Lane
    events: trio.MemorySendChannel = attrs.field(repr=False)  # the request's own channel
    times: RowTimes = attrs.field(repr=False)
    # Token ids that end the row when sampled: the model's EOS and the request's stop ids.
    stop_ids: frozenset[int] = attrs.field(default=frozenset(), repr=False)
    # Where the prompt's last message starts (chat prompts): a snapshot there lets
    # the next turn of the conversation reuse everything before it.
    snapshot_at: int | None = None
    kv_projected: int = 0  # worst-case KV bytes (prompt + max_tokens), for the budget
    starts_thinking: bool = False  # the prompt opens a think block the answer continues
    request_id: str | None = None  # the client's label for it (dashboards, logs)
    session: str | None = None  # the agent session it belongs to (a client's hint)
    parent: str | None = None  # the session that session runs under (a sub-agent's tree)
    weight: float = 1.0  # its session's weight in sharing the slots (see admission.py)
    priority: int = 0  # its rank (lower first: see request.Priority and admission.py)
    phase: Phase = Phase.QUEUED
    cached_tokens: int = 0  # prompt tokens taken from the prompt cache
    cache_report: CacheReport | None = attrs.field(default=None, repr=False)  # and why
    # Generated tokens read so far, the first one included. In the continuous lane a
    # token is read once it has also been fed: these are exactly what the KV holds.
    tokens: list[int] = attrs.field(factory=list, repr=len)
    # The current phase's GPU-thread state, touched only inside gpu.call: a
    # ``step.joiner.Prefill`` while PREFILLING, the primed one-row ``step.batch.Batch``
    # while JOINING (and while PAUSED: the row's own KV and pending token, taken out of
    # the batch). Typed loosely: the step's state builds on this record, not the reverse.
    work: Any = attrs.field(default=None, repr=False)
    end: End | None = None  # set once, by ask_end
    # Speculative decoding figures (decode writes them): draft tokens proposed and
    # kept, decode steps that read tokens from the row, and the tokens they read.
    drafted: int = 0
    accepted: int = 0
    forwards: int = 0
    decoded: int = 0

    @property
    def klass(self) -> Priority:
        """Its class (interactive, sub-agent, background): figures are kept by it."""
        return Priority.of_rank(self.priority)

    @property
    def pin(self) -> tuple[str, Priority] | None:
        """Whose latest prompt-cache entry it puts (pinned while active: see
        prompt_cache.py): its session's, one a class, so a session's sub-agents
        never unpin its main agent's history."""
        return None if self.session is None else (self.session, self.klass)

    def move(self, phase: Phase) -> None:
        if phase not in _NEXT[self.phase]:
            raise IllegalTransition(f"row {self.id} cannot go from {self.phase} to {phase}")
        self.phase = phase

    def accept(self, token: int) -> FinishReason | None:
        """Record a generated token; returns why the row ends on it, if it does
        (and asks for that end). EOS and stop ids end it as ``stop``, never shown."""
        self.tokens.append(token)
        if token in self.stop_ids:
            reason = FinishReason.STOP
        elif len(self.tokens) >= self.params.max_tokens:
            reason = FinishReason.LENGTH
        else:
            return None
        self.ask_end(End(reason))
        return reason

    def ask_end(self, end: End) -> bool:
        """Ask for the row to end; the first reason wins. False if it was already ending."""
        if self.end is not None or self.phase is Phase.ENDED:
            return False
        self.end = end
        return True

    def ask(self, message: Cancel | Finish) -> bool:
        """Apply a routed end request; False when the row was already ending."""
        if isinstance(message, Cancel):
            return self.ask_end(End(FinishReason.CANCELLED, message.reason))
        return self.ask_end(End(message.reason, message.detail))


@attrs.frozen
class RowView:
    """A read-only look at one live row, for dashboards: figures only, no text."""

    id: int
    request_id: str | None
    session: str | None
    parent: str | None
    weight: float  # its session's weight in sharing the slots
    priority: str  # its class: interactive, subagent, background
    lane: str
    phase: str
    prompt_tokens: int
    cached_tokens: int
    prefilled: int | None  # prompt tokens in so far, while prefilling
    tokens: int  # generated so far
    age: float  # seconds since submit
    time_to_first_token: float | None
    tokens_per_second: float | None
    tokens_per_step: float | None = None  # tokens per decode step it was in (drafting > 1)


def view(row: Row, now: float) -> RowView:
    """Taken on the event loop between actor steps: it reads the record, changes
    nothing and makes no GPU call (a prefill's progress is one int its job keeps)."""
    t = row.times
    first = t.prefill_ended
    prefilled = getattr(row.work, "done", None) if row.phase is Phase.PREFILLING else None
    rate = None
    if first is not None and len(row.tokens) > 1 and now > first:
        rate = (len(row.tokens) - 1) / (now - first)
    return RowView(
        id=row.id,
        request_id=row.request_id,
        session=row.session,
        parent=row.parent,
        weight=row.weight,
        priority=row.klass.label,
        lane=str(row.lane),
        phase=row.phase.value,
        prompt_tokens=len(row.prompt),
        cached_tokens=row.cached_tokens,
        prefilled=prefilled,
        tokens=len(row.tokens),
        age=now - t.submitted,
        time_to_first_token=None if first is None else first - t.submitted,
        tokens_per_second=rate,
        tokens_per_step=row.decoded / row.forwards if row.forwards else None,
    )


@attrs.frozen
class SessionView:
    """One live session: its rows (queued and running) and their figures."""

    id: str
    parent: str | None
    rows: tuple[RowView, ...]

    @property
    def weight(self) -> float:
        return self.rows[-1].weight  # its latest row's

    @property
    def queued(self) -> int:
        return sum(1 for r in self.rows if r.phase == Phase.QUEUED.value)

    @property
    def paused(self) -> int:
        return sum(1 for r in self.rows if r.phase == Phase.PAUSED.value)

    @property
    def running(self) -> int:
        return len(self.rows) - self.queued - self.paused


def sessions(rows: list[RowView]) -> list[SessionView]:
    """The live rows grouped by session (rows without one are left out), in the
    order each session's oldest row arrived."""
    grouped: dict[str, list[RowView]] = {}
    for r in rows:
        if r.session is not None:
            grouped.setdefault(r.session, []).append(r)
    return [
        SessionView(sid, next((r.parent for r in rs if r.parent is not None), None), tuple(rs))
        for sid, rs in grouped.items()
    ]


def tree(rows: list[Row], root: str) -> list[Row]:
    """The live rows of session ``root`` and of every session under it."""
    ids, grew = {root}, True
    while grew:
        more = {r.session for r in rows if r.parent in ids and r.session is not None}
        grew = not more <= ids
        ids |= more
    return [r for r in rows if r.session in ids]


def rank_now(row: Row, now: float | None = None, aging: float | None = None) -> int:
    """A queued row's rank as admission reads it: its own (``Row.priority``),
    one better for every ``aging`` seconds it has waited since it was last
    queued, up to interactive (0). So a sub-agent's row ranks with the main
    agent's after ``aging`` seconds, a background row after twice that, and no
    row waits forever behind better ones (None: no aging)."""
    if now is None or aging is None or row.priority <= 0:
        return row.priority
    return max(0, row.priority - int((now - row.times.queued) // aging))
