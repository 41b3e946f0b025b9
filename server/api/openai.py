"""What OpenAI's chat and text completions share: the sampling fields, usage,
logprobs, the response object and the chunk stream (``ChunkShaper``)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
from mlx_nursery.actors import Event, FinishReason, Result, Usage

from ..request_log import cache_body
from .base import (
    Api,
    ApiError,
    Parsed,
    Served,
    Shaper,
    bad,
    check_bool,
    new_id,
    object_body,
    refuse_unknown,
    sse_frame,
)

# Body fields that are SamplingParams fields of the same name. Their types and
# ranges are the engine's to check (one place: SamplingParams).
_SAMPLING = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "seed", "stop", "logit_bias", "response_format",
    "speculative", "skip_special_tokens",
)  # fmt: skip


# Every field OpenAI's API reference documents for the route is accepted; those
# listed here have no meaning on this server and are ignored (docs/http.md has
# the table). A field no API documents is a 400 naming it.
IGNORED = frozenset((
    "metadata", "store", "service_tier", "prompt_cache_options", "prompt_cache_retention",
    "verbosity", "moderation", "prediction", "modalities", "audio",
))  # fmt: skip
# Honoured: the sampling fields above, and these.
_COMMON = (
    *_SAMPLING, "model", "max_completion_tokens", "n", "stream", "stream_options",
    "return_token_ids", "user", "safety_identifier", "prompt_cache_key",
    "priority",  # vLLM's: the request's class or rank (docs/sessions.md)
)  # fmt: skip
_CHAT = (
    "messages", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "functions", "function_call", "chat_template_kwargs", "reasoning_effort",
    "web_search_options",
)  # fmt: skip
_COMPLETION = ("prompt", "logprobs", "echo", "suffix", "best_of")
_FIELDS = {
    "chat": frozenset((*_COMMON, *IGNORED, *_CHAT)),
    "completion": frozenset((*_COMMON, "metadata", "store", "service_tier", *_COMPLETION)),
}
# Chat only; checked by the engine.
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs")


def check_fields(body: Mapping[str, Any], route: str) -> None:
    """Every documented field is accepted; one no API documents is refused naming
    it; a value this server cannot honour and must not silently drop (echo, an
    audio answer) is refused saying why."""
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    refuse_unknown(body, _FIELDS[route], path)
    if route == "completion":
        for name in TOOL_FIELDS:
            if body.get(name) is not None:
                raise bad(f"'{name}' needs chat messages: use /v1/chat/completions", name)
    if body.get("echo"):
        raise bad("'echo' is not supported: the prompt is not repeated back", "echo")
    if body.get("suffix") not in (None, ""):
        raise bad("'suffix' (insertion) is not supported", "suffix")
    if body.get("best_of") not in (None, 1):
        raise bad("'best_of' must be 1: this server returns one candidate", "best_of")
    modalities = body.get("modalities")
    if body.get("audio") is not None or (isinstance(modalities, list) and "audio" in modalities):
        raise bad("audio output is not supported: this server answers in text", "modalities")


def session_hints(body: Mapping[str, Any]) -> tuple:
    """An OpenAI body's session hints (chat, completions and Responses alike), in
    the documented order (after the headers)."""
    return (body.get("prompt_cache_key"), body.get("user"), body.get("safety_identifier"))


MAX_CHOICES = 16  # ``n``: choices a request may ask for (each is a row)


def common(body: Any) -> tuple[Mapping[str, Any], dict[str, Any], dict]:
    """The body, the SamplingParams keywords it gives, and the engine-name ->
    body-name map for errors."""
    body = object_body(body)
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise bad(f"'n' must be an integer from 1 to {MAX_CHOICES}, got {n!r}", "n")
    params = {name: body[name] for name in _SAMPLING if body.get(name) is not None}
    fields = {}
    if body.get("max_completion_tokens") is not None:
        params["max_tokens"] = body["max_completion_tokens"]
        fields["max_tokens"] = "max_completion_tokens"
    return body, params, fields


def stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = bool(check_bool(body, "stream"))
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, Mapping):
            raise bad("'stream_options' must be an object", "stream_options")
        include_usage = bool(check_bool(opts, "include_usage"))
    return stream, include_usage


def thinking_of(effort: Any) -> dict | None:
    """A reasoning effort as the chat template's switch: ``none`` and ``minimal``
    turn thinking off, any other effort on (a template without it ignores it)."""
    if not isinstance(effort, str):
        return None
    return {"enable_thinking": effort not in ("none", "minimal")}


def usage_body(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "queue_wait_seconds": usage.queue_wait,
        "time_to_first_token_seconds": usage.time_to_first_token,
        "prefill_tokens_per_second": usage.prefill_tokens_per_second,
        "decode_tokens_per_second": usage.decode_tokens_per_second,
        **({"prompt_cache": cache_body(usage.cache)} if usage.cache is not None else {}),
        **({"session": usage.session} if usage.session is not None else {}),
        **({"speculative": drafts_body(usage.drafts)} if usage.drafts is not None else {}),
    }


def drafts_body(drafts) -> dict:
    return {
        "draft_tokens": drafts.drafted,
        "accepted_tokens": drafts.accepted,
        "rejected_tokens": drafts.drafted - drafts.accepted,
        "decode_steps": drafts.forwards,
        "tokens_per_step": drafts.tokens_per_forward,
    }


@attrs.frozen
class TokenText:
    """A token's text as logprobs show it: a control token of the tokenizer reads
    empty unless the request asked for them (``skip_special_tokens: false``), as
    in the text itself (docs/http.md)."""

    tokenizer: Any
    skip: bool = True

    @classmethod
    def of(cls, parsed: Parsed, tokenizer: Any) -> TokenText:
        return cls(tokenizer, bool(parsed.request.params.get("skip_special_tokens", True)))

    def __call__(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=self.skip)


@attrs.define
class ChunkShaper(Shaper):
    """Shapes one stream's events into OpenAI chunks (keeps the id and text
    offset). Chat and text completions say how a choice reads (``choice``,
    ``text_choice``) and what the chunks are called (``id_prefix``, ``chunk_object``)."""

    id_prefix: ClassVar[str]
    chunk_object: ClassVar[str]

    parsed: Parsed
    model: str
    tokenizer: Any
    index: int = 0  # the choice this stream is (``n`` > 1: one shaper a choice)
    id: str = attrs.field(default=None)  # the response's (choices share one)
    created: int = attrs.field(factory=lambda: int(time.time()))
    sent_role: bool = False
    offset: int = 0

    # A plain text chunk's bytes around its JSON-encoded text (see text_frame).
    _head: bytes = attrs.field(init=False, repr=False)
    _tail: bytes = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self.id = self.id or new_id(self.id_prefix)
        marker = "\x00"
        choice = {**self.text_choice(marker), "finish_reason": None, "logprobs": None}
        head, tail = sse_frame(self._wrap([choice])).split(json.dumps(marker).encode())
        self._head, self._tail = head, tail

    @property
    def text_of(self) -> TokenText:
        """Logprobs' token texts for this request."""
        return TokenText.of(self.parsed, self.tokenizer)

    def text_choice(self, text: str) -> dict:
        """A choice carrying only ``text`` (index first; finish and logprobs follow)."""
        raise NotImplementedError

    def choice(self, event: Event, finish: FinishReason | None, logprobs: dict | None) -> dict:
        """The choice for one event that carries something."""
        raise NotImplementedError

    def logprobs(self, tokens: list[int], logprobs: list[float], tops: list) -> dict:
        """One event's logprobs, as this API writes them."""
        raise NotImplementedError

    def event(self, event: Event) -> bytes:
        """The frames for one event: its text, then the calls it ends on (or
        before them, when it carries text), then the usage where asked."""
        if self.plain(event):
            return self.text_frame(event.text)
        out = b""
        chunk = self.chunk(event)
        if chunk is not None and (event.text or event.reasoning):  # then the calls it preceded
            out += sse_frame(chunk)
            chunk = None
        for tool_chunk in self.tool_chunks(event):
            out += sse_frame(tool_chunk)
        if chunk is not None:
            out += sse_frame(chunk)
        if event.terminal and self.parsed.include_usage and event.usage is not None:
            out += sse_frame(self.usage_chunk(event.usage))
        return out

    def failed(self, event: Event) -> bytes:
        message = event.error or "the request was cancelled"
        kind = "server_error" if event.finish_reason is FinishReason.ERROR else "cancelled"
        return sse_frame(ApiError(500, message, type=kind, code=event.error_code).body())

    def end(self) -> bytes:
        return b"data: [DONE]\n\n"

    def plain(self, event: Event) -> bool:
        """Whether the event is only more text (most of a stream): see text_frame."""
        return (
            self.sent_role
            and not self.parsed.token_ids
            and bool(event.text)
            and event.finish_reason is None
            and event.logprob is None
            and not event.reasoning
            and not event.tool_calls
        )

    def text_frame(self, text: str) -> bytes:
        """The SSE frame of a plain text chunk, from bytes encoded once per stream:
        only the text is JSON-encoded per token. Equal to ``sse_frame(chunk(...))``."""
        self.offset += len(text)
        return self._head + json.dumps(text).encode() + self._tail

    def _wrap(self, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, event: Event) -> dict | None:
        """The chunk for one event, or None when it carries nothing to send."""
        finish = event.finish_reason if event.terminal and event.finish_reason.finished else None
        carries_id = self.parsed.token_ids and event.token is not None
        if not (event.text or event.reasoning or finish or event.logprob is not None or carries_id):
            return None
        lp = None
        if event.token is not None and event.logprob is not None:
            lp = self.logprobs([event.token], [event.logprob], [event.top_logprobs])
        choice = self.choice(event, finish, lp)
        if self.parsed.token_ids:
            choice["token_ids"] = [] if event.token is None else [event.token]
        self.offset += len(event.text)
        return self._wrap([choice])

    def usage_chunk(self, usage: Usage) -> dict:
        """The final chunk of a stream with ``include_usage``: no choices, the usage."""
        return {**self._wrap([]), "usage": usage_body(usage)}

    def tool_chunks(self, event: Event) -> list[dict]:
        """The chunks of the tool calls an event ends on (chat's; none elsewhere)."""
        return []


class OpenAIApi(Api):
    """Chat and text completions: one response object family, one chunk stream;
    each says how it parses, how its choice reads, and its shaper."""

    response_object: ClassVar[str]
    shaper_class: ClassVar[type[ChunkShaper]]  # its chunks' id prefix is the response's

    def choice(self, result: Result, text_of: TokenText) -> dict:
        """The response's one choice (index, its content, finish reason, logprobs)."""
        raise NotImplementedError

    def body(self, parsed: Parsed, result: Result, served: Served) -> dict:
        return self.choices_body(parsed, [result], served)

    def choices_body(self, parsed: Parsed, results: list[Result], served: Served) -> dict:
        """The response for ``n`` choices (``results[i]`` is choice ``i``); usage
        counts the prompt once and every choice's completion."""
        choices, text_of = [], TokenText.of(parsed, served.tokenizer)
        for i, result in enumerate(results):
            choice = {**self.choice(result, text_of), "index": i}
            if parsed.token_ids:
                choice["token_ids"] = list(result.tokens)
            choices.append(choice)
        return {
            "id": new_id(self.shaper_class.id_prefix),
            "object": self.response_object,
            "created": int(time.time()),
            "model": served.model,
            "choices": choices,
            "usage": usage_body(usage_of_choices([r.usage for r in results])),
        }

    def shaper(self, parsed: Parsed, served: Served) -> ChunkShaper:
        return self.shaper_class(parsed, served.model, served.tokenizer)

    def choice_shapers(self, parsed: Parsed, served: Served, n: int) -> list[ChunkShaper]:
        """One shaper a choice, sharing the response's id; none sends usage (the
        response's one usage chunk comes after every choice has ended)."""
        quiet = attrs.evolve(parsed, include_usage=False)
        first = self.shaper_class(quiet, served.model, served.tokenizer)
        rest = [self.shaper_class(quiet, served.model, served.tokenizer, index=i, id=first.id)
                for i in range(1, n)]  # fmt: skip
        return [first, *rest]


def usage_of_choices(usages: list[Usage]) -> Usage:
    """Several choices of one prompt: the prompt (and its cache use) once, as the
    first choice's; the completions added up."""
    first = usages[0]
    return attrs.evolve(first, completion_tokens=sum(u.completion_tokens for u in usages))
