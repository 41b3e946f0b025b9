"""What a request is (:class:`Request`), what it asks (:class:`SamplingParams`) and
what it yields (events, results).

Every parameter a caller can set is checked here, once, by type and range; a
bad one raises :class:`InvalidRequest` naming it. The HTTP front only maps names.
"""

from __future__ import annotations

import contextlib
import enum
import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from .errors import InvalidRequest
from .tools import ToolCall, check_tools

# A request's max_tokens when neither it nor the engine's settings say (as mlx_lm.server).
DEFAULT_MAX_TOKENS = 512

MAX_TOP_LOGPROBS = 20

# What a request's prompt may be: text (special tokens added as mlx-lm's
# ``stream_generate`` does), token ids, or chat messages (the chat template's).
Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]


def _label(value: Any) -> str | None:
    return None if value is None else str(value)


@attrs.frozen
class Request:
    """One request as the engine takes it, the same from an API's parser through
    ``Engine.submit_request`` to its row: the prompt, the :class:`SamplingParams`
    fields the caller gave (the intake fills in the engine's request defaults and
    checks them), and who sent it. ``session`` names the agent session it belongs
    to (sessions share the batch's slots, see ``admission.py``), ``parent`` the
    session that one runs under (kept only with a session), ``weight`` its
    session's weight in sharing the slots, as given (the intake checks it: see
    :func:`session_weight`); ``priority`` its class or rank, as given (see
    :func:`priority_of`; None: interactive); ``request_id`` is the caller's label."""

    prompt: Prompt
    params: Mapping[str, Any] = attrs.field(
        factory=dict, converter=lambda p: types.MappingProxyType(dict(p))
    )
    request_id: str | None = attrs.field(default=None, converter=_label)
    session: str | None = attrs.field(default=None, converter=_label)
    parent: str | None = attrs.field(default=None, converter=_label)
    weight: Any = None  # None: the default share (1)
    priority: Any = None  # None: interactive

    @classmethod
    def of(cls, prompt: Prompt, **params: Any) -> Request:
        """The keyword form: :class:`SamplingParams` fields, plus ``request_id``,
        ``session``, ``parent``, ``session_weight`` and ``priority``."""
        labels = {k: params.pop(k, None) for k in ("request_id", "session", "parent")}
        weight = params.pop("session_weight", None)
        priority = params.pop("priority", None)
        return cls(prompt, params, weight=weight, priority=priority, **labels)


class Priority(enum.IntEnum):
    """A request's class, its rank in admission (lower first, as vLLM's
    ``priority``): the person's turn and a main agent's; a sub-agent's; work
    nobody waits on (titles, summaries, a small/fast model's requests)."""

    INTERACTIVE = 0
    SUBAGENT = 1
    BACKGROUND = 2

    @classmethod
    def of_rank(cls, rank: int) -> Priority:
        """The class a rank falls in (vLLM's integers: at or below 0 interactive,
        1 sub-agent, 2 and above background)."""
        return _CLASSES[min(max(rank, 0), 2)]

    @property
    def label(self) -> str:
        """Its name as figures, records and the ``priority`` field write it."""
        return self.name.lower()


_CLASSES = tuple(Priority)


MAX_PRIORITY = 1000


def priority_of(value: Any) -> int:
    """A request's rank from its ``priority`` as given (a body field, a header's
    text): a class name (``interactive``, ``subagent``, ``background``) or an
    integer (vLLM's field: lower first), checked."""
    if isinstance(value, str) and value.strip().upper() in Priority.__members__:
        return int(Priority[value.strip().upper()])
    rank = None
    if isinstance(value, int | str) and not isinstance(value, bool):
        with contextlib.suppress(ValueError):
            rank = int(value)
    elif isinstance(value, float) and value.is_integer():
        rank = int(value)
    if rank is None or not -MAX_PRIORITY <= rank <= MAX_PRIORITY:
        raise InvalidRequest(
            "priority must be interactive, subagent or background, or an integer from "
            f"{-MAX_PRIORITY} to {MAX_PRIORITY} (lower runs first; 0 is interactive), got "
            f"{value!r}",
            param="priority",
        )
    return rank


MAX_WEIGHT = 1000.0


def session_weight(value: Any) -> float:
    """A session weight as given (a header's text, a number), checked."""
    try:
        weight = float(value)
    except (TypeError, ValueError):
        weight = math.nan
    if isinstance(value, bool) or not 0 < weight <= MAX_WEIGHT:
        raise InvalidRequest(
            f"session_weight must be a number above 0 and at most {MAX_WEIGHT:g} (1 is "
            f"the default share), got {value!r}",
            param="session_weight",
        )
    return weight


class Lane(enum.StrEnum):
    SERIAL = "serial"
    CONTINUOUS = "continuous"


class FinishReason(enum.StrEnum):
    """How a row ended. A str enum: it compares equal to OpenAI's strings."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens
    TOOL_CALLS = "tool_calls"  # stopped after calling tools
    ERROR = "error"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        """The row ran to its natural end (its KV is worth keeping)."""
        return self in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.TOOL_CALLS)


def _fail(param: str, message: str) -> None:
    raise InvalidRequest(message, param=param)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _integer(lo: int, hi: int | None = None) -> Callable:
    def check(_, attribute, value) -> None:
        name = attribute.name
        if not _is_int(value):
            _fail(name, f"{name} must be an integer, got {type(value).__name__}")
        if value < lo or (hi is not None and value > hi):
            span = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
            _fail(name, f"{name} must be {span}, got {value}")

    return check


def _number(lo: float, hi: float | None = None, *, open_lo: bool = False, optional=False):
    def check(_, attribute, value) -> None:
        name = attribute.name
        if value is None and optional:
            return
        if not (isinstance(value, int | float) and not isinstance(value, bool)):
            _fail(name, f"{name} must be a number, got {type(value).__name__}")
        if not math.isfinite(value):
            _fail(name, f"{name} must be a finite number, got {value}")
        low_ok = value > lo if open_lo else value >= lo
        if not low_ok or (hi is not None and value > hi):
            if hi is not None:
                span = f"in {'(' if open_lo else '['}{lo:g}, {hi:g}]"
            else:
                span = f"{'>' if open_lo else '>='} {lo:g}"
            _fail(name, f"{name} must be {span}, got {value!r}")

    return check


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, list | tuple) or not all(isinstance(s, str) and s for s in value):
        _fail("stop", "stop must be a non-empty string or a list of non-empty strings")
    return tuple(value)


def _stop_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple) or not all(_is_int(t) for t in value):
        _fail("stop_token_ids", "stop_token_ids must be a list of token ids")
    return tuple(value)


def _logit_bias(value: Any) -> Mapping[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        _fail("logit_bias", "logit_bias must be an object of token id to bias")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            _fail("logit_bias", f"logit_bias key {key!r} is not a token id")
        ok = isinstance(bias, int | float) and not isinstance(bias, bool) and math.isfinite(bias)
        if not ok or not -100 <= bias <= 100:
            _fail("logit_bias", f"logit_bias value for {key} must be between -100 and 100")
        out[token] = float(bias)
    return out or None


def _flag(_, attribute, value) -> None:
    if not isinstance(value, bool):
        _fail(attribute.name, f"{attribute.name} must be a boolean")


@attrs.frozen
class SamplingParams:
    """What one request asks of generation. Validated on construction."""

    max_tokens: int = attrs.field(default=DEFAULT_MAX_TOKENS, validator=_integer(1))
    temperature: float = attrs.field(default=0.0, validator=_number(0.0))
    top_p: float = attrs.field(default=1.0, validator=_number(0.0, 1.0, open_lo=True))
    top_k: int = attrs.field(default=0, validator=_integer(0))
    min_p: float = attrs.field(default=0.0, validator=_number(0.0, 1.0))
    repetition_penalty: float | None = attrs.field(
        default=None, validator=_number(0.0, open_lo=True, optional=True)
    )
    repetition_context_size: int = attrs.field(default=20, validator=_integer(1))
    presence_penalty: float | None = attrs.field(
        default=None, validator=_number(-2.0, 2.0, optional=True)
    )
    frequency_penalty: float | None = attrs.field(
        default=None, validator=_number(-2.0, 2.0, optional=True)
    )
    logit_bias: Mapping[int, float] | None = attrs.field(default=None, converter=_logit_bias)
    logprobs: bool = attrs.field(default=False, validator=_flag)
    # True: the tokenizer's control tokens are left out of the text (the HTTP
    # routes' default, as vLLM's); False: mlx-lm's text, as the model wrote it.
    skip_special_tokens: bool = attrs.field(default=False, validator=_flag)
    top_logprobs: int = attrs.field(default=0, validator=_integer(0, MAX_TOP_LOGPROBS))
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_stop_ids)
    seed: int | None = attrs.field(default=None)
    # mlx-lm's signature, ``fn(tokens, logits) -> logits``, run after the built-in
    # ones (embedding API only). One that raises ends its own row, no other.
    logits_processors: tuple[Callable, ...] = attrs.field(default=(), converter=tuple)
    # OpenAI's shape: {"type": "text" | "json_object" | "json_schema", "json_schema":
    # {"schema": {...}}}. The engine's intake turns it into a grammar mask (a
    # processor of the row's own); checked there, against the model's tokenizer.
    response_format: Mapping[str, Any] | None = None
    # OpenAI function tools, in the generic format (actors/tools.py). The intake
    # settles tool_choice to auto | none | required | a tool's name.
    tools: tuple[Mapping[str, Any], ...] = attrs.field(default=(), converter=check_tools)
    tool_choice: Any = None
    parallel_tool_calls: bool = attrs.field(default=True, validator=_flag)
    tool_format: Any = None  # set by the intake: a tools.ToolFormat
    # Speculative decoding for this request (an extension field): true (the
    # server's drafting), false (none), or the most draft tokens per step.
    speculative: bool | int = attrs.field(default=True)
    # Extra chat-template arguments for this request (e.g. {"enable_thinking": false}
    # where the template switches thinking), on top of the engine's.
    chat_template_kwargs: Mapping[str, Any] | None = attrs.field(default=None)

    @chat_template_kwargs.validator
    def _template_kwargs(self, attribute, value) -> None:
        if value is not None and not isinstance(value, Mapping):
            _fail("chat_template_kwargs", "chat_template_kwargs must be an object")

    @logits_processors.validator
    def _processors(self, attribute, value) -> None:
        if not all(callable(p) for p in value):
            _fail("logits_processors", "logits_processors must be callables fn(tokens, logits)")

    @speculative.validator
    def _speculative(self, attribute, value) -> None:
        if not isinstance(value, bool) and not (_is_int(value) and 0 <= value <= 64):
            _fail(
                "speculative",
                f"speculative must be true, false or a number of draft tokens from 0 to 64, "
                f"got {value!r}",
            )

    @seed.validator
    def _seed(self, attribute, value) -> None:
        if value is not None and not _is_int(value):
            _fail("seed", f"seed must be an integer, got {type(value).__name__}")
        if value is not None and not 0 <= value < 2**64:
            _fail("seed", f"seed must be between 0 and 2**64 - 1, got {value}")

    @classmethod
    def build(cls, params: Mapping[str, Any]) -> SamplingParams:
        """From a caller's keywords; an unknown one is an error naming it."""
        unknown = sorted(set(params) - set(attrs.fields_dict(cls)))
        if unknown:
            _fail(unknown[0], f"unknown parameter {unknown[0]!r}")
        return cls(**params)

    @property
    def max_draft(self) -> int | None:
        """The most draft tokens this request allows per step (None: the server's)."""
        if self.speculative is True:
            return None
        return int(self.speculative)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def has_processors(self) -> bool:
        return bool(
            self.logits_processors
            or self.response_format
            or self.logit_bias
            or self.repetition_penalty not in (None, 1.0)
            or self.presence_penalty
            or self.frequency_penalty
        )


class CacheReason(enum.StrEnum):
    """Why a prompt reused what it did from the prompt cache."""

    FULL = "full"  # every prompt token but the last came from the cache
    NO_ENTRY = "no_entry"  # no cached prompt shares even its first token
    DIVERGED = "diverged"  # the nearest cached prompt differs at ``diverged_at``
    EVICTED = "evicted"  # a longer shared prefix was cached, but evicted (entry or byte cap)
    NOT_TRIMMABLE = "not_trimmable"  # an entry shares more, but its cache kind cannot be cut there
    DISABLED = "disabled"  # the engine runs without a prompt cache
    SERIAL = "serial"  # not looked up: a request whose lane does not reuse


class CacheTier(enum.StrEnum):
    """Where a prompt's cached prefix came from."""

    MEMORY = "memory"
    DISK = "disk"  # loaded from the disk tier (disk_cache.py)


@attrs.frozen
class CacheReport:
    """What the prompt cache gave one request, and where it fell short."""

    reason: CacheReason
    cached: int = 0  # prompt tokens reused
    # The longest prefix any cached (or recently evicted) prompt shares with this
    # one; where it stops is where the prompt diverged from it.
    shared: int = 0
    diverged_at: int | None = None  # first prompt position not reusable (None: full reuse)
    message: int | None = None  # the chat message holding it, where the caller worked it out
    tier: CacheTier | None = None  # where the reused prefix came from (None: nothing reused)


@attrs.frozen
class Drafts:
    """One request's speculative decoding: draft tokens proposed and kept, and
    the decode steps its tokens took."""

    drafted: int
    accepted: int
    forwards: int  # decode steps that read tokens from it
    tokens: int  # tokens those steps read

    @property
    def tokens_per_forward(self) -> float | None:
        return self.tokens / self.forwards if self.forwards else None


@attrs.frozen
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_wait: float  # seconds from submit to the start of prefill
    time_to_first_token: float | None  # seconds from submit to the first token
    prefill_tokens_per_second: float | None
    decode_tokens_per_second: float | None
    cache: CacheReport | None = None  # the prompt-cache lookup, where there was one
    session: str | None = None  # the agent session the request ran in
    drafts: Drafts | None = None  # its speculative decoding, where it drafted
    priority: str | None = None  # the class it ran in: interactive, subagent, background

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
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: str | None = None  # a machine-readable kind of error, where there is one
    usage: Usage | None = None
    tool_calls: tuple[ToolCall, ...] = ()  # calls completed with this event
    reasoning: str = ""  # a thinking model's reasoning text (split out of ``text``)
    stop_sequence: str | None = None  # on the terminal event: the stop string that ended it

    @property
    def terminal(self) -> bool:
        return self.finish_reason is not None


@attrs.frozen
class Result:
    tokens: list[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[TopLogprob, ...]] | None = None
    tool_calls: list[ToolCall] = attrs.field(factory=list)
    reasoning: str = ""
    stop_sequence: str | None = None
