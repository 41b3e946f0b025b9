"""What OpenAI's chat and text completions share: the sampling fields, usage,
logprobs, the response object and the chunk stream (``ChunkShaper``)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import attrs
from mlx_nursery.actors import Event, FinishReason, Result, Usage
from mlx_nursery.actors.tools import ToolCall

from ..request_log import cache_body
from .base import (
    Api,
    ApiError,
    Parsed,
    Served,
    Shaper,
    Style,
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
    "speculative",
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


def common(body: Any) -> tuple[Mapping[str, Any], dict[str, Any], dict]:
    """The body, the SamplingParams keywords it gives, and the engine-name ->
    body-name map for errors."""
    body = object_body(body)
    n = body.get("n")
    if n is not None and (n != 1 or isinstance(n, bool)):
        raise bad(f"'n' must be 1: this server returns one choice per request, got {n!r}", "n")
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


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def chat_logprobs(tokenizer, tokens, logprobs, tops) -> dict:
    content = []
    for token, lp, top in zip(tokens, logprobs, tops or [None] * len(tokens), strict=True):
        text = _token_text(tokenizer, token)
        content.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": (t := _token_text(tokenizer, alt.token)),
                        "logprob": alt.logprob,
                        "bytes": list(t.encode()),
                    }
                    for alt in (top or ())
                ],
            }
        )
    return {"content": content}


def completion_logprobs(tokenizer, tokens, logprobs, tops, offset: int = 0) -> dict:
    texts = [_token_text(tokenizer, t) for t in tokens]
    offsets, pos = [], offset
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": texts,
        "token_logprobs": list(logprobs),
        "top_logprobs": [
            {_token_text(tokenizer, alt.token): alt.logprob for alt in (top or ())}
            for top in (tops or [None] * len(tokens))
        ],
        "text_offset": offsets,
    }


def tool_call_body(call: ToolCall) -> dict:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def full_response(parsed: Parsed, model: str, result: Result, tokenizer: Any) -> dict:
    created = int(time.time())
    if parsed.style is Style.CHAT:
        lp = None
        if result.logprobs is not None:
            lp = chat_logprobs(tokenizer, result.tokens, result.logprobs, result.top_logprobs)
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        if result.reasoning:
            message["reasoning_content"] = result.reasoning
        if result.tool_calls:
            message["content"] = result.text or None
            message["tool_calls"] = [tool_call_body(c) for c in result.tool_calls]
        choice = {
            "index": 0,
            "message": message,
            "finish_reason": result.finish_reason,
            "logprobs": lp,
        }
        kind, obj = "chatcmpl", "chat.completion"
    else:
        lp = None
        if result.logprobs is not None:
            lp = completion_logprobs(tokenizer, result.tokens, result.logprobs, result.top_logprobs)
        choice = {
            "index": 0,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "logprobs": lp,
        }
        kind, obj = "cmpl", "text_completion"
    if parsed.token_ids:
        choice["token_ids"] = list(result.tokens)
    return {
        "id": new_id(kind),
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_body(result.usage),
    }


@attrs.define
class ChunkShaper(Shaper):
    """Shapes one stream's events into OpenAI chunks (keeps the id and text offset)."""

    parsed: Parsed
    model: str
    tokenizer: Any
    id: str = attrs.field(init=False)
    created: int = attrs.field(factory=lambda: int(time.time()))
    sent_role: bool = False
    offset: int = 0
    calls: int = 0  # tool calls streamed so far (their indices)

    # A plain text chunk's bytes around its JSON-encoded text (see text_frame).
    _head: bytes = attrs.field(init=False, repr=False)
    _tail: bytes = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self.id = new_id("chatcmpl" if self.parsed.style is Style.CHAT else "cmpl")
        marker = "\x00"
        if self.parsed.style is Style.CHAT:
            choice = {"index": 0, "delta": {"content": marker}, "finish_reason": None,
                      "logprobs": None}  # fmt: skip
        else:
            choice = {"index": 0, "text": marker, "finish_reason": None, "logprobs": None}
        head, tail = sse_frame(self._wrap([choice])).split(json.dumps(marker).encode())
        self._head, self._tail = head, tail

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
        chat = self.parsed.style is Style.CHAT
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, event: Event) -> dict | None:
        """The chunk for one event, or None when it carries nothing to send."""
        chat = self.parsed.style is Style.CHAT
        finish = event.finish_reason if event.terminal and event.finish_reason.finished else None
        carries_id = self.parsed.token_ids and event.token is not None
        if not (event.text or event.reasoning or finish or event.logprob is not None or carries_id):
            return None
        lp = None
        if event.token is not None and event.logprob is not None:
            tops = [event.top_logprobs]
            if chat:
                lp = chat_logprobs(self.tokenizer, [event.token], [event.logprob], tops)
            else:
                lp = completion_logprobs(
                    self.tokenizer, [event.token], [event.logprob], tops, self.offset
                )
        if chat:
            delta: dict[str, Any] = {"content": event.text} if event.text or not finish else {}
            if event.reasoning:
                delta["reasoning_content"] = event.reasoning
                if not event.text:
                    delta.pop("content", None)
            if not self.sent_role:
                delta["role"], self.sent_role = "assistant", True
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
        else:
            choice = {"index": 0, "text": event.text, "finish_reason": finish, "logprobs": lp}
        if self.parsed.token_ids:
            choice["token_ids"] = [] if event.token is None else [event.token]
        self.offset += len(event.text)
        return self._wrap([choice])

    def tool_chunks(self, event: Event) -> list[dict]:
        """OpenAI's streamed tool calls: for each call, its index, id and name first
        (arguments empty), then its arguments."""
        out = []
        for call in event.tool_calls:
            head = {"index": self.calls, "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": ""}}  # fmt: skip
            first: dict[str, Any] = {"tool_calls": [head]}
            if not self.sent_role:
                first["role"], self.sent_role = "assistant", True
            args = {
                "tool_calls": [{"index": self.calls, "function": {"arguments": call.arguments}}]
            }
            for delta in (first, args):
                out.append(self._wrap([{"index": 0, "delta": delta, "finish_reason": None,
                                        "logprobs": None}]))  # fmt: skip
            self.calls += 1
        return out

    def usage_chunk(self, usage: Usage) -> dict:
        """The final chunk of a stream with ``include_usage``: no choices, the usage."""
        return {**self._wrap([]), "usage": usage_body(usage)}


class OpenAIApi(Api):
    """Chat and text completions: one response object family, one chunk stream;
    each says only how it parses (and, for text, its context wording)."""

    def body(self, parsed: Parsed, result: Result, served: Served) -> dict:
        return full_response(parsed, served.model, result, served.tokenizer)

    def shaper(self, parsed: Parsed, served: Served) -> ChunkShaper:
        return ChunkShaper(parsed, served.model, served.tokenizer)
