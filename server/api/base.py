"""What every API shares: the parsed request, the error, the API's shape, and
the one SSE loop every stream goes through.

An API is a small object (:class:`Api`): its ``name``, ``parse`` (a JSON body
into the engine's request, or :class:`ApiError` naming the field), ``body`` (a
finished result into the API's response object), ``shaper`` (one stream's
events into the API's frames, a :class:`Shaper`) and ``error`` (an
:class:`ApiError` into the API's error body and status). The routes drive it;
nothing here does I/O.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import attrs
import trio
from mlx_nursery.actors import ContextOverflow, Event, Request, RequestStream, Result
from mlx_nursery.actors.request import Priority


@attrs.frozen
class ApiError(Exception):
    """An error a client gets, in its API's shape (OpenAI's by default)."""

    status: int
    message: str
    param: str | None = None
    type: str = "invalid_request_error"
    code: str | None = None
    retry_after: int | None = None  # seconds, sent as the Retry-After header

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


@attrs.frozen
class Parsed:
    """A request as an API parsed it: the engine's :class:`Request` (whose
    ``params`` hold only what the client gave: the engine fills in the server's
    request defaults, one place for every API) and what the response needs."""

    request: Request
    stream: bool
    include_usage: bool
    model: str | None
    # Engine parameter -> the body field (or header) it came from, where the names
    # differ, so an engine error names what the client sent.
    fields: dict[str, str] = attrs.field(factory=dict)
    # vLLM's extension: each choice (and each streamed chunk) carries the ids of
    # the tokens it holds, as ``token_ids``.
    token_ids: bool = False
    # Tools the request named that this server cannot run (hosted ones: web search,
    # MCP servers...): left out of the prompt, listed in the X-Ignored-Tools header.
    ignored_tools: tuple[str, ...] = ()
    # What the intake changed in the prompt, by kind (Claude Code's attribution
    # block dropped, its early system turns moved first: see ``api/messages.py``);
    # counted in /stats and /metrics.
    adjusted: tuple[str, ...] = ()
    # A flattened tool's name as the model sees it -> (namespace, name) as the
    # client knows it (Responses' namespace tools).
    tool_names: Mapping[str, tuple[str, str]] = attrs.field(factory=dict)
    # Chat and text completions' ``n``: this many choices of the one prompt.
    n: int = 1

    def field(self, param: str | None) -> str | None:
        if param == "session_weight":
            return WEIGHT_HEADER
        return self.fields.get(param, param) if param else param

    @property
    def prompt_params(self) -> dict[str, Any]:
        """The parameters that shape the prompt (tools, template arguments)."""
        keys = ("tools", "tool_choice", "chat_template_kwargs")
        return {k: v for k, v in self.request.params.items() if k in keys}


@attrs.frozen
class Served:
    """What a response needs to know of the server and the request: the model's
    public name, its tokenizer (logprobs' token texts) and the prompt's length in
    tokens (as the engine tokenized it at submit)."""

    model: str
    tokenizer: Any
    prompt_tokens: int


class Shaper:
    """One stream's frames. ``start`` before the first event; ``event`` for each
    event that is not a failure (the terminal one included); ``failed`` for a
    terminal error or cancel; ``end`` once the stream is over, either way.
    ``ping``: a keep-alive frame sent while no event comes for ``PING_SECONDS``
    (None: the API has none)."""

    ping: bytes | None = None

    def start(self) -> bytes:
        return b""

    def event(self, event: Event) -> bytes:
        raise NotImplementedError

    def failed(self, event: Event) -> bytes:
        raise NotImplementedError

    def end(self) -> bytes:
        return b""


class Api:
    """One API's translations (see the module's docstring)."""

    name: str  # in the request log, /stats and the dashboard

    def parse(self, body: Any, headers: Mapping[str, str] | None = None) -> Parsed:
        raise NotImplementedError

    def body(self, parsed: Parsed, result: Result, served: Served) -> dict | bytes:
        raise NotImplementedError

    def shaper(self, parsed: Parsed, served: Served) -> Shaper:
        raise NotImplementedError

    def error(self, err: ApiError) -> tuple[dict, int]:
        return err.body(), err.status

    def context_error(self, exc: ContextOverflow, param: str | None) -> ApiError:
        """OpenAI's wording (clients match it to recover)."""
        return openai_context_error(exc, "messages", param)


def openai_context_error(exc: ContextOverflow, where: str, param: str | None) -> ApiError:
    """OpenAI's ``context_length_exceeded`` for chat (``messages``) or text
    completions (``prompt``), with the numbers; our own hint (what to lower it
    to) follows in brackets."""
    head = f"This model's maximum context length is {exc.limit} tokens. However, "
    if exc.max_tokens is None:
        message = (f"{head}your {where} resulted in {exc.prompt_tokens} tokens. "
                   f"Please reduce the length of the {where}.")  # fmt: skip
    else:
        total = exc.prompt_tokens + exc.max_tokens
        message = (f"{head}you requested {total} tokens ({exc.prompt_tokens} in the {where}, "
                   f"{exc.max_tokens} in the completion). Please reduce the length of the "
                   f"{where} or completion.")  # fmt: skip
    return ApiError(400, f"{message} ({exc})", param, code="context_length_exceeded")


PING_SECONDS = 5.0  # a ping while the first token is not there yet (a long prefill)


def frames(shaper: Shaper, event: Event) -> tuple[bytes, bool]:
    """One event's frames, and whether it ended the stream."""
    if event.terminal and not event.finish_reason.finished:
        return shaper.failed(event), True
    return shaper.event(event), event.terminal


async def sse(stream: RequestStream, shaper: Shaper) -> AsyncIterator[bytes]:
    """Every API's stream: the shaper's frames for each event, then its end.

    Events already waiting when one is written go out in the same body chunk:
    a client (or a loaded event loop) that falls behind costs one send, not one
    per token. Leaving early (the client went away) leaves ``async with
    stream``, which cancels the row."""
    async with stream:
        yield shaper.start()
        ended = False
        while not ended:
            event = None
            with trio.move_on_after(PING_SECONDS if shaper.ping is not None else float("inf")):
                event = await anext(stream, _END)
            if event is None:
                yield shaper.ping or b""
                continue
            if event is _END:
                break
            body, ended = frames(shaper, event)
            while not ended:
                try:
                    more = stream.next_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                later, ended = frames(shaper, more)
                body += later
            if body:
                yield body
    yield shaper.end()


_END: Any = object()


# -- parsing helpers ------------------------------------------------------------------


def check_bool(body: Mapping[str, Any], name: str) -> bool | None:
    v = body.get(name)
    if v is None or isinstance(v, bool):
        return v
    raise bad(f"'{name}' must be a boolean, got {type(v).__name__}", name)


def model_of(body: Mapping[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    return model


def object_body(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise bad("the request body must be a JSON object")
    return body


def refuse_unknown(body: Mapping[str, Any], known: frozenset[str], route: str) -> None:
    """A field no API documents is refused naming it (a typo must not pass silently);
    ``known`` is every field the route's API reference documents, honoured or not."""
    for name in body:
        if name not in known:
            raise bad(f"unknown field {name!r}: {route} does not take it", name)


# The headers clients name their session by, ours first (see docs/http.md).
SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id")
# A sub-agent's request names the session it runs under (Claude Code's sub-agents
# share its session id; a harness that gives each its own can link them so).
PARENT_HEADER = "X-Parent-Session-Id"
# The session's weight in sharing the batch's slots (1 by default; see docs/sessions.md).
WEIGHT_HEADER = "X-Session-Weight"
REQUEST_ID_HEADER = "X-Request-Id"
# The request's class or rank (docs/sessions.md), on every route; a body's
# ``priority`` (vLLM's field: chat, completions, responses) comes first.
PRIORITY_HEADER = "X-Priority"


def priority_field(body: Mapping[str, Any], headers: Mapping[str, str] | None,
                   fields: dict[str, str]) -> Any:  # fmt: skip
    """The body's ``priority`` (vLLM's field), if any; where the header gives it
    instead, an error about it names the header (``fields``)."""
    if body.get("priority") is None and headers is not None and PRIORITY_HEADER in headers:
        fields["priority"] = PRIORITY_HEADER
    return body.get("priority")


def request_of(
    prompt: Any,
    params: dict[str, Any],
    headers: Mapping[str, str] | None,
    *hints: Any,
    priority: Any = None,
    reading: Priority | None = None,
) -> Request:
    """The engine's request: the prompt, the client's fields, and who sent it,
    all read here: the request id, the session (see :func:`session_of`; ``hints``
    are the body's), the parent session, the session's weight, and the priority:
    the body's (``priority``), else the header's, else the class the API read
    from the client's traffic (``reading``: Claude Code's sub-agents), else none
    (interactive)."""
    headers = headers if headers is not None else {}
    if priority is None:
        priority = headers.get(PRIORITY_HEADER)
    if priority is None:
        priority = reading
    return Request(
        prompt,
        # What a client reads never carries the tokenizer's control tokens unless it
        # asks (vLLM's field; the engine's own default keeps mlx-lm's text).
        {"skip_special_tokens": True, **params},
        request_id=headers.get(REQUEST_ID_HEADER) or f"req-{uuid.uuid4().hex[:16]}",
        session=session_of(headers, *hints),
        parent=headers.get(PARENT_HEADER),
        weight=headers.get(WEIGHT_HEADER),
        priority=priority,
    )


def session_of(headers: Mapping[str, str] | None, *hints: Any) -> str | None:
    """The request's session: our header, the clients' own headers, then the
    body's hints in the order given (the first that is a non-empty string)."""
    for name in SESSION_HEADERS:
        value = headers.get(name) if headers is not None else None
        if value:
            return str(value)[:200]
    for hint in hints:
        if isinstance(hint, str) and hint:
            return hint[:200]
    return None


def json_schema_format(schema: Any) -> dict:
    """The engine's ``response_format`` for a JSON schema (every API's structured output)."""
    return {"type": "json_schema", "json_schema": {"schema": schema}}


def new_id(prefix: str, sep: str = "-") -> str:
    return f"{prefix}{sep}{uuid.uuid4().hex[:24]}"


# -- JSON out -----------------------------------------------------------------------------


@attrs.frozen
class RawJson:
    """JSON text written into a response as it is (a tool call's arguments as the
    model wrote them), never parsed and written again: a number like ``1E+400``
    stays that number instead of becoming ``Infinity``, which is not JSON."""

    text: str


def dumps(body: Any, **options: Any) -> str:
    """``json.dumps`` that writes :class:`RawJson` values as their text, and
    refuses NaN and infinities (strict clients reject them)."""
    raws: dict[str, str] = {}

    def default(obj: Any) -> Any:
        if isinstance(obj, RawJson):
            key = f"\x00raw{len(raws)}\x00"
            raws[key] = obj.text
            return key
        raise TypeError(f"{type(obj).__name__} is not JSON serializable")

    out = json.dumps(body, default=default, allow_nan=False, **options)
    for key, text in raws.items():
        out = out.replace(json.dumps(key), text, 1)
    return out


def sse_frame(body: Any) -> bytes:
    """One server-sent event carrying ``body`` as compact JSON."""
    return b"data: " + dumps(body, separators=(",", ":")).encode() + b"\n\n"


def sse_event(kind: str, body: dict) -> bytes:
    """One named server-sent event (Anthropic's and Responses' streams)."""
    return f"event: {kind}\ndata: {dumps(body)}\n\n".encode()


# -- images (docs/vision.md) -------------------------------------------------------

IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")


def image_part(data: str, media_type: str | None, where: str, param: str = "messages") -> dict:
    """An image for the engine (``{"type": "image", "image": bytes}``) from base64
    text; ``media_type`` is checked where the API names one."""
    if media_type is not None and media_type not in IMAGE_TYPES:
        raise bad(f"{where}: media type {media_type!r} is not an image this server reads: "
                  f"send one of {', '.join(IMAGE_TYPES)}", param)  # fmt: skip
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise bad(f"{where}: the image data is not valid base64", param) from None
    return {"type": "image", "image": raw}


def image_url_part(url: Any, where: str, param: str = "messages") -> dict:
    """An image from an OpenAI ``image_url`` (a ``data:`` URL). A remote URL is
    refused: a server on a person's machine does not fetch what a request
    (which a web page may have written) points it at, unless started with
    ``--image-urls`` (``server/image_urls.py`` then fetches it first)."""
    if not isinstance(url, str) or not url:
        raise bad(f"{where}: an image needs its URL (a data: URL)", param)
    if not url.startswith("data:"):
        raise bad(f"{where}: remote image URLs are not fetched by this server: send the "
                  "image inline as a data: URL (data:image/png;base64,...), or start the "
                  "server with --image-urls", param)  # fmt: skip
    head, sep, data = url[5:].partition(",")
    if not sep or not head.endswith(";base64"):
        raise bad(f"{where}: a data: URL must be base64 (data:image/png;base64,...)", param)
    return image_part(data, head.removesuffix(";base64") or None, where, param)


def joined(parts: list[dict]) -> str | list[dict]:
    """A message's content: its text when it has no image, else its parts."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts
