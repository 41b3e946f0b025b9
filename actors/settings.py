"""The engine's settings: one frozen record, checked once, passed whole.

The CLI builds it from flags, ``open_engine`` from its keywords; every actor that
needs a setting reads it from here. A bad value raises :class:`InvalidRequest`
naming the setting and what to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from .budget import parse_budget
from .errors import InvalidRequest

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUEUE_PER_SLOT = 8  # the default queue bound: this many waiting rows per batch slot


def _seconds(*, optional: bool = False):
    def check(_, attribute, value) -> None:
        if value is None and optional:
            return
        ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        if not ok or value != value or value == float("inf"):
            raise InvalidRequest(
                f"{attribute.name} must be a positive number of seconds, got {value!r}",
                param=attribute.name,
            )

    return check


def _at_least(n: int, *, optional: bool = False):
    def check(_, attribute, value) -> None:
        if value is None and optional:
            return
        if not isinstance(value, int) or isinstance(value, bool) or value < n:
            raise InvalidRequest(
                f"{attribute.name} must be an integer of at least {n}, got {value!r}",
                param=attribute.name,
            )

    return check


def _dtype(_, attribute, value) -> None:
    if value is not None and value not in DTYPES:
        raise InvalidRequest(
            f"dtype must be one of {', '.join(DTYPES)}, got {value!r}", param="dtype"
        )


def _budget(value: Any) -> int | str | None:
    try:
        return parse_budget(value)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="kv_budget") from None


def _template_args(value: Any) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidRequest(
            'chat_template_args must be an object, e.g. {"enable_thinking": false}',
            param="chat_template_args",
        )
    return dict(value)


@attrs.frozen
class EngineSettings:
    batch: int = attrs.field(default=8, validator=_at_least(1))  # rows decoding at once; 1: serial
    prefill_step_size: int = attrs.field(default=2048, validator=_at_least(1))  # tokens a chunk
    max_tokens: int = attrs.field(default=256, validator=_at_least(1))  # a request's default
    context_length: int | None = attrs.field(default=None, validator=_at_least(1, optional=True))
    dtype: str | None = attrs.field(default=None, validator=_dtype)  # None: as stored
    prompt_cache_size: int = attrs.field(default=10, validator=_at_least(0))  # 0: no cache
    prompt_cache_bytes: int | None = attrs.field(
        default=None, validator=_at_least(0, optional=True)
    )
    chat_template: str | None = None  # replaces the tokenizer's
    chat_template_args: Mapping[str, Any] = attrs.field(factory=dict, converter=_template_args)
    kv_budget: int | str | None = attrs.field(default=None, converter=_budget)  # bytes | auto
    # Rows waiting for admission beyond this are refused (Overloaded; HTTP 429 with
    # Retry-After). None: QUEUE_PER_SLOT per batch slot.
    max_queued_requests: int | None = attrs.field(
        default=None, validator=_at_least(0, optional=True)
    )
    queue_timeout: float | None = attrs.field(default=None, validator=_seconds(optional=True))
    # A GPU call running longer than this marks the engine unhealthy (/health 503).
    step_timeout: float = attrs.field(default=120.0, validator=_seconds())

    @property
    def queue_limit(self) -> int:
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        return QUEUE_PER_SLOT * self.batch

    @property
    def template(self) -> dict[str, Any]:
        """Keyword arguments for every chat-template rendering."""
        out = dict(self.chat_template_args)
        if self.chat_template is not None:
            out["chat_template"] = self.chat_template
        return out
