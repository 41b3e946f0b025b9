"""A request's life: its parameters, its row record, and the events it yields.

A request is one :class:`Row` from submit to its terminal event. The row moves
between actors inside messages; at any moment exactly one actor holds it, and the
fields each actor writes are marked below. Every row ends in exactly one terminal
event (``stop``, ``length``, ``error`` or ``cancelled``), sent by the emitter.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence

import attrs
import trio

from .errors import InvalidRequest

MAX_TOP_LOGPROBS = 20


class Lane(enum.Enum):
    SERIAL = "serial"
    CONTINUOUS = "continuous"


def _check(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise InvalidRequest(message, param=param)


@attrs.frozen
class SamplingParams:
    """What one request asks of generation. Validated on construction."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[int, float] | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __attrs_post_init__(self) -> None:
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            f"max_tokens must be a positive integer, got {self.max_tokens!r}",
            "max_tokens",
        )
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0.0,
            f"temperature must be >= 0, got {self.temperature!r}",
            "temperature",
        )
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        _check(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k!r}", "top_k")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        _check(
            self.repetition_penalty is None or self.repetition_penalty > 0,
            f"repetition_penalty must be > 0, got {self.repetition_penalty!r}",
            "repetition_penalty",
        )
        _check(
            0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
            f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs!r}",
            "top_logprobs",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop must be non-empty strings",
            "stop",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def has_processors(self) -> bool:
        return bool(
            self.logit_bias
            or self.repetition_penalty not in (None, 1.0)
            or self.presence_penalty
            or self.frequency_penalty
        )


@attrs.frozen
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_wait: float  # seconds from submit to the start of prefill
    time_to_first_token: float | None  # seconds from submit to the first token
    prefill_tokens_per_second: float | None
    decode_tokens_per_second: float | None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class TopLogprob:
    token: int
    logprob: float


@attrs.frozen
class Event:
    """One step of a request's stream. The last event has ``finish_reason`` set."""

    token: int | None  # None on a terminal event that carries no new token
    text: str
    logprob: float | None = None
    top_logprobs: tuple[TopLogprob, ...] | None = None
    finish_reason: str | None = None  # stop | length | error | cancelled
    error: str | None = None
    usage: Usage | None = None

    @property
    def terminal(self) -> bool:
        return self.finish_reason is not None


@attrs.frozen
class Result:
    tokens: list[int]
    text: str
    finish_reason: str
    usage: Usage
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[TopLogprob, ...]] | None = None


@attrs.define(eq=False, repr=False)
class RowTimes:
    """Clock readings (``trio.current_time()``); each written once by the actor named."""

    submitted: float  # engine.submit
    prefill_started: float | None = None  # prefill / serial
    prefill_ended: float | None = None  # prefill / serial
    first_token: float | None = None  # emitter
    finished: float | None = None  # emitter


@attrs.define(eq=False)
class Row:
    """One request from submit to terminal event."""

    id: int
    prompt: list[int] = attrs.field(repr=lambda p: f"<{len(p)} tokens>")  # no text in logs
    params: SamplingParams
    lane: Lane
    events: trio.MemorySendChannel = attrs.field(repr=False)
    times: RowTimes = attrs.field(repr=False)
    cached_tokens: int = 0  # written by prefill / serial (the prompt-cache take)
    # Where the prompt's last message starts (chat prompts): a boundary snapshot
    # there lets the next turn of the conversation reuse everything before it.
    snapshot_at: int | None = None
    kv_projected: int = 0  # worst-case KV bytes (prompt + max_tokens), for the budget
    completion_tokens: int = 0  # written by the emitter
    # Emitter-owned delivery state: set once the terminal event has been sent.
    done: bool = False
    finish_reason: str | None = None


def normalize_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    return tuple(stop)
