"""The Quart-Trio app: OpenAI-compatible routes over one engine.

The engine lives in the app's own nursery (``app.nursery``, opened by the ASGI
lifespan), started in the background so ``/health`` can answer 503 while the
model loads. Handlers never touch mlx: they validate, submit, and stream.
"""

from __future__ import annotations

import enum
import gc
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio
from mlx_nursery.actors import (
    Engine,
    EngineClosed,
    EngineSettings,
    Event,
    FinishReason,
    GenerationFailed,
    InvalidRequest,
    Overloaded,
    open_engine,
)
from mlx_nursery.actors.models import short_id
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from . import anthropic, dashboard, responses
from .metrics import prometheus, stats_json
from .protocol import (
    ApiError,
    ChunkShaper,
    Defaults,
    Parsed,
    bad,
    full_response,
    parse_chat,
    parse_completion,
    sse_frame,
)
from .request_log import RequestLog, record_of

log = logging.getLogger("mlx_nursery.server")

# Model names that mean "whatever this server serves" ("default_model" as in mlx_lm.server).
ALIASES = ("default_model", "default")


@attrs.frozen
class Settings:
    """The server's settings: the engine's, whole, plus the HTTP front's own."""

    model: Any  # a directory, hub id or GGUF file; or a (model, tokenizer) pair
    engine: EngineSettings = attrs.field(factory=lambda: EngineSettings(dtype="auto"))
    host: str = "127.0.0.1"
    port: int = 8080
    defaults: Defaults = attrs.field(factory=Defaults)
    allowed_origins: tuple[str, ...] = ("*",)
    max_request_bytes: int = 16 * 1024 * 1024  # a larger body is a 413
    drain_seconds: float = 30.0  # in-flight requests get this long at shutdown
    # Access: with a key, every /v1 route needs `Authorization: Bearer KEY` (or
    # `x-api-key: KEY`); /stats and /metrics too when protect_stats is set.
    api_key: str | None = attrs.field(default=None, repr=False)
    protect_stats: bool = False
    # Connection limits (Hypercorn's, and the body read), so a slow or half-sent
    # request cannot hold the server.
    keep_alive_timeout: float = 75.0  # an idle keep-alive connection is closed after this
    max_header_bytes: int = 16 * 1024  # request line and headers beyond this are refused
    body_timeout: float = 30.0  # seconds for the whole request body to arrive (else 408)
    request_log: Path | None = None  # one JSON line per finished request (no prompt text)
    # Sharded (under mlx.launch): the mx.distributed group; this process is rank 0.
    group: Any = None
    # The process is the server's own (the CLI): its startup heap is frozen out of
    # the GC once the model is loaded (``freeze_startup_heap``).
    own_process: bool = False


class ServerPhase(enum.StrEnum):
    STARTING = "starting"  # the model loads; /health is 503
    SERVING = "serving"
    DRAINING = "draining"  # shutting down: no new work, in-flight requests finish
    STOPPED = "stopped"
    FAILED = "failed"  # the engine could not start (``error`` says why)


def freeze_startup_heap() -> None:
    """In a process that is the server's own, once the model is loaded: what
    loading made (the model, tokenizer and libraries, ~100k objects) lives as
    long as the server, so it is frozen out of the cyclic GC and a full
    collection walks only what requests allocated since. Unfrozen, a full
    collection under load stalled the event loop ~60 ms on 2 cores."""
    gc.collect()
    gc.freeze()


_UNAVAILABLE = {
    ServerPhase.STARTING: "the model is still loading; retry shortly",
    ServerPhase.DRAINING: "the server is shutting down",
    ServerPhase.STOPPED: "the server is shutting down",
}


@attrs.define(eq=False)
class ServerState:
    """The engine's place in the app, and the server's phase."""

    settings: Settings
    engine: Engine | None = None
    phase: ServerPhase = ServerPhase.STARTING
    error: str | None = None
    failed: trio.Event = attrs.field(factory=trio.Event)
    requests: RequestLog = attrs.field(init=False)
    _stop: trio.Event = attrs.field(factory=trio.Event)
    _stopped: trio.Event = attrs.field(factory=trio.Event)

    def __attrs_post_init__(self) -> None:
        self.requests = RequestLog(self.settings.request_log)

    @property
    def model_id(self) -> str:
        """The served model's public name (never a filesystem path)."""
        return self.engine.model_id if self.engine is not None else short_id(self.settings.model)

    async def host_engine(self) -> None:
        s = self.settings
        try:
            async with open_engine(s.model, s.engine, group=s.group) as engine:
                if s.own_process:
                    freeze_startup_heap()
                self.engine, self.phase = engine, ServerPhase.SERVING
                mode = engine.stats().mode
                log.info("serving %s (batch %d, mode %s)", self.model_id, s.engine.batch, mode)
                await self._stop.wait()
        except Exception as exc:
            self.phase, self.error = ServerPhase.FAILED, f"{type(exc).__name__}: {exc}"
            log.error("the engine failed to start: %s", self.error)
            self.failed.set()
        finally:
            if self.phase is not ServerPhase.FAILED:
                self.phase = ServerPhase.STOPPED
            self._stopped.set()

    async def drain(self, deadline: float) -> None:
        """Refuse new work, let in-flight requests finish within ``deadline`` seconds,
        then cancel the rest (each stream still gets its terminal event)."""
        if self.engine is None or self.phase is not ServerPhase.SERVING:
            return
        self.phase = ServerPhase.DRAINING
        with trio.move_on_after(deadline):
            await self.engine.wait_idle()
        await self.engine.close("the server is shutting down")

    async def stop(self) -> None:
        self._stop.set()
        await self._stopped.wait()

    def health(self) -> tuple[int, dict]:
        """``/health``'s status and body: 200 while serving and healthy; else 503
        with the phase, or the engine's reason (the ranks lost, a stalled call)."""
        if self.phase is ServerPhase.SERVING:
            problem = self.engine.health()
            if problem is not None:
                return 503, {"status": "unhealthy", "error": problem}
            return 200, {"status": "ok"}
        return 503, {"status": self.phase.value, "error": self.error}

    def engine_or_503(self) -> Engine:
        if self.phase is ServerPhase.SERVING and self.engine is not None:
            return self.engine
        message = _UNAVAILABLE.get(self.phase) or f"the engine failed to start: {self.error}"
        raise ApiError(503, message, type="service_unavailable", code=self.phase.value)


def _error(err: ApiError) -> Response:
    body, status = err.body(), err.status
    if request.path.startswith("/v1/messages"):  # Anthropic's shape and codes there
        body, status = anthropic.error_body(err)
    response = Response(json.dumps(body), status=status, content_type="application/json")
    if err.retry_after is not None:
        response.headers["Retry-After"] = str(err.retry_after)
    return response


def _json(body: Any, status: int = 200) -> Response:
    return Response(json.dumps(body), status=status, content_type="application/json")


async def _body_json(seconds: float) -> Any:
    """The request body as JSON; a body that does not arrive within ``seconds`` is
    a 408 (a slow or half-sent request cannot hold the server)."""
    with trio.move_on_after(seconds) as scope:
        raw = await request.get_data()
    if scope.cancelled_caught:
        raise ApiError(408, f"the request body did not arrive within {seconds:g} s",
                       code="request_timeout")  # fmt: skip
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad("the request body nests too deeply") from None


@attrs.frozen
class Routes:
    """The HTTP routes over one :class:`ServerState`; handlers never touch mlx."""

    state: ServerState

    @property
    def settings(self) -> Settings:
        return self.state.settings

    async def chat_completions(self) -> Response:
        return await self._complete(parse_chat)

    async def completions(self) -> Response:
        return await self._complete(parse_completion)

    async def messages(self) -> Response:
        """Anthropic Messages: the same engine path, Anthropic's shapes."""
        engine = self.state.engine_or_503()
        body = await _body_json(self.settings.body_timeout)
        parsed = anthropic.parse_messages(body, self.settings.defaults)
        self._check_model(parsed)
        stream = await self._start(engine, parsed)
        if parsed.stream:
            shaper = anthropic.StreamShaper(self.state.model_id, len(engine.encode(
                parsed.prompt, **_prompt_params(parsed.params))))  # fmt: skip
            return _event_stream(_anthropic_sse(stream, shaper))
        result = await self._result(stream)
        return _json(anthropic.message_body(result, self.state.model_id))

    async def responses(self) -> Response:
        """OpenAI Responses: the same engine path, the Response object and its events."""
        engine = self.state.engine_or_503()
        body = await _body_json(self.settings.body_timeout)
        parsed = responses.parse_responses(body, self.settings.defaults)
        self._check_model(parsed)
        stream = await self._start(engine, parsed)
        if parsed.stream:
            shaper = responses.StreamShaper(self.state.model_id, parsed)
            return _event_stream(_responses_sse(stream, shaper))
        result = await self._result(stream)
        rid = f"resp_{uuid.uuid4().hex[:24]}"
        output = responses.full_output(result)
        return _json(responses.response_body(rid, self.state.model_id, parsed, output, result))

    async def count_tokens(self) -> Response:
        engine = self.state.engine_or_503()
        body = await _body_json(self.settings.body_timeout)
        if isinstance(body, dict):
            body = {"max_tokens": 1, **body}
        parsed = anthropic.parse_messages(body, self.settings.defaults)
        try:
            ids = engine.encode(parsed.prompt, **_prompt_params(parsed.params))
        except InvalidRequest as exc:
            raise bad(str(exc), parsed.field(exc.param)) from None
        return _json(anthropic.count_body(len(ids)))

    async def _start(self, engine: Engine, parsed: Parsed) -> Any:
        """Submit and queue the request: a bad one is a 400, a full queue a 429,
        both before any byte of a stream."""
        request_id = request.headers.get("X-Request-Id") or f"req-{uuid.uuid4().hex[:16]}"
        try:
            stream = engine.submit(parsed.prompt, request_id=request_id, **parsed.params)
            stream.on_end = self._on_end(engine, parsed, request_id)
            await stream.start()
        except InvalidRequest as exc:
            raise bad(str(exc), parsed.field(exc.param)) from None
        except Overloaded as exc:
            raise ApiError(
                429, str(exc), type="rate_limit_error", code="queue_full",
                retry_after=math.ceil(exc.retry_after),
            ) from None  # fmt: skip
        except EngineClosed as exc:  # shutting down, or a sharded engine's ranks lost
            kind = "service_unavailable"
            raise ApiError(503, str(exc), type=kind, code="engine_closed") from None
        return stream

    def _on_end(self, engine: Engine, parsed: Parsed, request_id: str) -> Callable[[Event], Event]:
        """What the server adds to a request's terminal event (in the handler's
        task, never the engine's): the chat message a cache miss diverged in; and
        the request's record (recent requests, the request log)."""
        api = request.path.rsplit("/", 1)[-1]

        def on_end(event: Event) -> Event:
            cache = event.usage.cache if event.usage is not None else None
            prompt = parsed.prompt
            chat = isinstance(prompt, list) and any(isinstance(m, dict) for m in prompt)
            if cache is not None and cache.diverged_at is not None and chat:
                params = _prompt_params(parsed.params)
                message = engine.message_at(parsed.prompt, cache.diverged_at, **params)
                cache = attrs.evolve(cache, message=message)
                event = attrs.evolve(event, usage=attrs.evolve(event.usage, cache=cache))
            self.state.requests.record(record_of(event, request_id=request_id, api=api))
            return event

        return on_end

    async def _result(self, stream: Any) -> Any:
        try:
            async with stream:
                result = await stream.result()
        except GenerationFailed as exc:
            if exc.code == "queue_timeout":
                raise ApiError(503, str(exc), type="service_unavailable", code=exc.code) from None
            raise ApiError(500, str(exc), type="server_error", code=exc.code) from None
        if result.finish_reason is FinishReason.CANCELLED:
            message = "the request was cancelled: the server is shutting down"
            raise ApiError(503, message, type="service_unavailable")
        return result

    async def models(self) -> Response:
        card = {
            "id": self.state.model_id,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "mlx-nursery",
        }
        return _json({"object": "list", "data": [card]})

    async def stats(self) -> Response:
        engine = self.state.engine_or_503()
        body = stats_json(engine.stats())
        body["recent_requests"] = list(self.state.requests.recent)
        ranks = engine.ranks()
        if ranks is not None:
            body["ranks"] = ranks
        return _json(body)

    async def dashboard(self) -> Response:
        """The live page: self-contained, fed by /dashboard/events."""
        return Response(dashboard.page(), content_type="text/html; charset=utf-8")

    async def dashboard_events(self) -> Response:
        return _event_stream(dashboard.feed(self.state))

    async def dashboard_snapshot(self) -> Response:
        return _json(dashboard.snapshot(self.state))

    async def metrics(self) -> Response:
        accept = request.headers.get("Accept", "")
        engine = self.state.engine_or_503()
        body, content_type = prometheus(engine.stats(), accept, engine.ranks())
        return Response(body, content_type=content_type)

    def _check_model(self, parsed: Parsed) -> None:
        name, served = parsed.model, self.state.model_id
        # The short id; also the reference it was started with (a path or hub id).
        if name is None or name in ALIASES or name in (served, self.settings.model):
            return
        raise ApiError(
            404,
            f"model {name!r} does not exist; this server serves {served!r}",
            param="model",
            type="not_found_error",
            code="model_not_found",
        )

    async def _complete(self, parser: Callable[..., Parsed]) -> Response:
        engine = self.state.engine_or_503()
        parsed = parser(await _body_json(self.settings.body_timeout), self.settings.defaults)
        self._check_model(parsed)
        stream = await self._start(engine, parsed)
        if parsed.stream:
            shaper = ChunkShaper(parsed, self.state.model_id, engine.tokenizer)
            return _event_stream(_sse(stream, shaper, parsed))
        result = await self._result(stream)
        return _json(full_response(parsed, self.state.model_id, result, engine.tokenizer))

    def authorize(self) -> None:
        """With an API key set, /v1 (and, when protected, /stats, /metrics and the
        dashboard) need it as a bearer token or ``x-api-key`` (the dashboard also
        takes ``?key=``); compared in constant time."""
        key = self.settings.api_key
        path = request.path
        watch = path in ("/stats", "/metrics", "/", "/dashboard/events", "/dashboard/snapshot")
        guarded = path.startswith("/v1/") or (self.settings.protect_stats and watch)
        if key is None or not guarded or request.method == "OPTIONS":
            return
        auth = request.headers.get("Authorization", "")
        given = auth[7:] if auth[:7].lower() == "bearer " else request.headers.get("x-api-key")
        if given is None and watch:
            given = request.args.get("key")  # a browser's EventSource cannot send headers
        if given is None or not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(
                401,
                "a valid API key is required: send 'Authorization: Bearer KEY' "
                "(or 'x-api-key: KEY')",
                type="authentication_error",
                code="invalid_api_key",
            )

    def cors(self, response: Response) -> Response:
        origin = request.headers.get("Origin")
        response.headers.update(cors_headers(origin, self.settings.allowed_origins))
        return response

    def http_error(self, err: HTTPException) -> Response:
        if err.code == 413:
            limit = self.settings.max_request_bytes
            message = f"request body is larger than {limit:,} bytes"
            return _error(ApiError(413, message, code="request_too_large"))
        kind = "not_found_error" if err.code == 404 else "invalid_request_error"
        return _error(ApiError(err.code or 500, err.description or err.name, type=kind))


def cors_headers(origin: str | None, allowed: tuple[str, ...]) -> dict[str, str]:
    """The CORS headers an answer to ``origin`` carries (none for an origin not allowed)."""
    if not origin or ("*" not in allowed and origin not in allowed):
        return {}
    return {
        "Access-Control-Allow-Origin": "*" if "*" in allowed else origin,
        "Access-Control-Allow-Headers": "*",
        "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
    }


@attrs.frozen
class HealthFirst:
    """ASGI in front of the Quart app: ``/health`` is answered here.

    A routed request costs the event loop Quart's request context, hooks and
    two handler tasks, and passes through several scheduling rounds; while a
    burst fills the loop (64 agents' retries landing at once) each round is
    long, and a health probe waits a round per step. Here it is one task and
    two sends, so the probe stays fast whatever else the loop is doing."""

    app: Callable[..., Any]  # the Quart app's own asgi_app
    state: ServerState

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] != "/health":
            await self.app(scope, receive, send)
            return
        method, allow = scope["method"], "GET, HEAD, OPTIONS"
        if method in ("GET", "HEAD"):
            status, body = self.state.health()
            data, headers = json.dumps(body).encode(), {"Content-Type": "application/json"}
        elif method == "OPTIONS":  # as Quart answers it on its routes
            status, data, headers = 200, b"", {"Allow": allow}
        else:
            err = ApiError(405, f"{method} is not allowed on /health; use GET")
            status, data = 405, json.dumps(err.body()).encode()
            headers = {"Content-Type": "application/json", "Allow": allow}
        origin = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"origin"), None)
        headers.update(cors_headers(origin, self.state.settings.allowed_origins))
        headers["Content-Length"] = str(len(data))
        fields = [(k.lower().encode(), v.encode("latin-1")) for k, v in headers.items()]
        await send({"type": "http.response.start", "status": status, "headers": fields})
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else data})


def create_app(settings: Settings) -> QuartTrio:
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # streams last as long as generation does
    state = ServerState(settings)
    app.extensions["mlx_nursery"] = state
    routes = Routes(state)

    @app.before_serving
    async def start_engine() -> None:
        app.nursery.start_soon(state.host_engine)

    @app.after_serving
    async def stop_engine() -> None:
        await state.stop()

    app.asgi_app = HealthFirst(app.asgi_app, state)
    app.before_request(_async(routes.authorize))
    app.after_request(_async(routes.cors))
    app.register_error_handler(ApiError, _async(_error))
    app.register_error_handler(HTTPException, _async(routes.http_error))
    app.add_url_rule("/v1/chat/completions", view_func=routes.chat_completions, methods=["POST"])
    app.add_url_rule("/v1/completions", view_func=routes.completions, methods=["POST"])
    app.add_url_rule("/v1/messages", view_func=routes.messages, methods=["POST"])
    app.add_url_rule("/v1/responses", view_func=routes.responses, methods=["POST"])
    app.add_url_rule("/v1/messages/count_tokens", view_func=routes.count_tokens, methods=["POST"])
    for path, view in (
        ("/v1/models", routes.models),
        ("/stats", routes.stats),
        ("/metrics", routes.metrics),
        ("/", routes.dashboard),
        ("/dashboard/events", routes.dashboard_events),
        ("/dashboard/snapshot", routes.dashboard_snapshot),
    ):
        app.add_url_rule(path, view_func=view, methods=["GET"])
    return app


def _async(fn: Callable[..., Any]) -> Callable:
    """Quart awaits its hooks: wrap a plain function as a coroutine function."""

    async def hook(*args: Any) -> Any:
        return fn(*args)

    hook.__name__ = fn.__name__
    return hook


def _event_stream(body: Any) -> Response:
    response = Response(
        body,
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    response.timeout = None
    return response


def _prompt_params(params: dict) -> dict:
    """The parameters that shape the prompt (tools, template arguments)."""
    keys = ("tools", "tool_choice", "chat_template_kwargs")
    return {k: v for k, v in params.items() if k in keys}


PING_SECONDS = 5.0  # a ping while the first token is not there yet (a long prefill)


async def _anthropic_sse(stream, shaper: anthropic.StreamShaper):
    """Anthropic's event sequence for one request; an error ends it with an error event."""
    try:
        async with stream:
            yield shaper.start()
            while True:
                event = None
                with trio.move_on_after(PING_SECONDS):
                    event = await stream.__anext__()
                if event is None:
                    yield anthropic.sse("ping", {"type": "ping"})
                    continue
                if event.terminal and not event.finish_reason.finished:
                    err = ApiError(500, event.error or "the request was cancelled")
                    yield anthropic.sse("error", anthropic.error_body(err)[0])
                    return
                yield shaper.event(event)
                if event.terminal:
                    return
    except StopAsyncIteration:
        return
    except trio.Cancelled:
        raise  # the client went away: leaving `async with stream` cancelled the row


async def _responses_sse(stream, shaper: responses.StreamShaper):
    """The Responses event sequence; an error ends it with an ``error`` event."""
    try:
        async with stream:
            yield shaper.start()
            async for event in stream:
                if event.terminal and not event.finish_reason.finished:
                    yield shaper.error(event.error or "the request was cancelled")
                    return
                yield shaper.event(event)
                if event.terminal:
                    return
    except trio.Cancelled:
        raise  # the client went away: leaving `async with stream` cancelled the row


def _frames(event, shaper: ChunkShaper, parsed: Parsed) -> tuple[bytes, bool]:
    """The SSE frames for one event, and whether the stream ends with it."""
    if event.terminal and not event.finish_reason.finished:
        message = event.error or "the request was cancelled"
        kind = "server_error" if event.finish_reason is FinishReason.ERROR else "cancelled"
        return sse_frame(ApiError(500, message, type=kind, code=event.error_code).body()), True
    if shaper.plain(event):
        return shaper.text_frame(event.text), False
    out = b""
    chunk = shaper.chunk(event)
    if chunk is not None and (event.text or event.reasoning):  # then the calls it preceded
        out += sse_frame(chunk)
        chunk = None
    for tool_chunk in shaper.tool_chunks(event):
        out += sse_frame(tool_chunk)
    if chunk is not None:
        out += sse_frame(chunk)
    if event.terminal and parsed.include_usage and event.usage is not None:
        out += sse_frame(shaper.usage_chunk(event.usage))
    return out, event.terminal


async def _sse(stream, shaper: ChunkShaper, parsed: Parsed):
    """SSE frames for one request; always ends in ``data: [DONE]``.

    Events already waiting when one is written go out in the same body chunk:
    a client (or a loaded event loop) that falls behind costs one send, not one
    per token."""
    try:
        async with stream:
            async for event in stream:
                body, ended = _frames(event, shaper, parsed)
                while not ended:
                    try:
                        more = stream.next_nowait()
                    except trio.WouldBlock:
                        break
                    frames, ended = _frames(more, shaper, parsed)
                    body += frames
                if body:
                    yield body
                if ended:
                    break
        yield b"data: [DONE]\n\n"
    except trio.Cancelled:
        raise  # the client went away: leaving `async with stream` cancelled the row
