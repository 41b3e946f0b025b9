"""Errors a caller can cause, typed, each saying what to change."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises to a caller."""


class InvalidRequest(EngineError, ValueError):
    """A request the engine will not run as given; the message says what to change.

    ``param`` names the offending field where there is one (the HTTP front maps it
    to the OpenAI error's ``param``).
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextOverflow(InvalidRequest):
    """Prompt, or prompt plus max_tokens, beyond the model's context: the numbers
    are kept so a front end can say it in its API's own words (clients parse them
    to recover). ``max_tokens`` is None when the prompt alone does not fit."""

    def __init__(
        self, message: str, *, param: str, prompt_tokens: int, max_tokens: int | None, limit: int
    ) -> None:
        super().__init__(message, param=param)
        self.prompt_tokens, self.max_tokens, self.limit = prompt_tokens, max_tokens, limit


class EngineClosed(EngineError):
    """The engine is shutting down or closed; it takes no new requests."""


class Overloaded(EngineError):
    """The queue is full (``max_queued_requests``): retry after ``retry_after`` seconds."""

    def __init__(self, message: str, *, queued: int, retry_after: float) -> None:
        super().__init__(message)
        self.queued, self.retry_after = queued, retry_after


class GenerationFailed(EngineError):
    """A request ended in an error event (``engine.generate`` raises this); ``code``
    names the kind where there is one (``queue_timeout``)."""

    def __init__(self, message: str | None, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class RanksLost(EngineError):
    """A follower died or stalled: the sharded engine cannot run another step."""
