"""The Quart-Trio app: OpenAI-compatible routes over one engine.

The engine lives in the app's own nursery (``app.nursery``, opened by the ASGI
lifespan), started in the background so ``/health`` can answer 503 while the
model loads. Handlers never touch mlx: they validate, submit, and stream.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import attrs
import trio
from mlx_nursery.actors import Engine, GenerationFailed, InvalidRequest, open_engine
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

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
)

log = logging.getLogger("mlx_nursery.server")

# Model names that mean "whatever this server serves" ("default_model" as in mlx_lm.server).
ALIASES = ("default_model", "default")


@attrs.frozen
class Settings:
    model: str
    host: str = "127.0.0.1"
    port: int = 8080
    batch: int = 8
    prefill_step_size: int = 2048
    defaults: Defaults = attrs.field(factory=Defaults)
    chat_template: str | None = None
    chat_template_args: dict = attrs.field(factory=dict)
    dtype: str = "auto"
    allowed_origins: tuple[str, ...] = ("*",)
    max_request_bytes: int = 16 * 1024 * 1024
    drain_seconds: float = 30.0  # in-flight requests get this long at shutdown
    context_length: int | None = None
    prompt_cache_size: int = 10
    prompt_cache_bytes: int | None = None
    kv_budget: int | str | None = None


@attrs.define(eq=False)
class ServerState:
    """The engine's place in the app, and the server's phase."""

    settings: Settings
    engine: Engine | None = None
    phase: str = "starting"  # starting | serving | draining | stopped | failed
    error: str | None = None
    failed: trio.Event = attrs.field(factory=trio.Event)
    _stop: trio.Event = attrs.field(factory=trio.Event)
    _stopped: trio.Event = attrs.field(factory=trio.Event)

    @property
    def model_id(self) -> str:
        return self.settings.model

    async def host_engine(self) -> None:
        s = self.settings
        try:
            async with open_engine(
                s.model,
                batch=s.batch,
                prefill_step_size=s.prefill_step_size,
                max_tokens=s.defaults.max_tokens,
                context_length=s.context_length,
                dtype=s.dtype,
                prompt_cache_size=s.prompt_cache_size,
                prompt_cache_bytes=s.prompt_cache_bytes,
                chat_template=s.chat_template,
                chat_template_args=s.chat_template_args,
                kv_budget=s.kv_budget,
            ) as engine:
                self.engine, self.phase = engine, "serving"
                log.info("serving %s (batch %d, mode %s)", s.model, s.batch, engine.stats().mode)
                await self._stop.wait()
        except Exception as exc:
            self.phase, self.error = "failed", f"{type(exc).__name__}: {exc}"
            log.error("the engine failed to start: %s", self.error)
            self.failed.set()
        finally:
            if self.phase != "failed":
                self.phase = "stopped"
            self._stopped.set()

    async def drain(self, deadline: float) -> None:
        """Refuse new work, let in-flight requests finish within ``deadline`` seconds,
        then cancel the rest (each stream still gets its terminal event)."""
        if self.engine is None or self.phase != "serving":
            return
        self.phase = "draining"
        with trio.move_on_after(deadline):
            await self.engine.wait_idle()
        await self.engine.close("the server is shutting down")

    async def stop(self) -> None:
        self._stop.set()
        await self._stopped.wait()


def _error(err: ApiError) -> Response:
    return Response(json.dumps(err.body()), status=err.status, content_type="application/json")


def _json(body: Any, status: int = 200) -> Response:
    return Response(json.dumps(body), status=status, content_type="application/json")


def create_app(settings: Settings) -> QuartTrio:
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # streams last as long as generation does
    state = ServerState(settings)
    app.extensions["mlx_nursery"] = state

    @app.before_serving
    async def start_engine() -> None:
        app.nursery.start_soon(state.host_engine)

    @app.after_serving
    async def stop_engine() -> None:
        await state.stop()

    @app.after_request
    async def cors(response: Response) -> Response:
        origin = request.headers.get("Origin")
        allowed = settings.allowed_origins
        if origin and ("*" in allowed or origin in allowed):
            response.headers["Access-Control-Allow-Origin"] = "*" if "*" in allowed else origin
            response.headers["Access-Control-Allow-Headers"] = "*"
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
        return response

    @app.errorhandler(ApiError)
    async def api_error(err: ApiError) -> Response:
        return _error(err)

    @app.errorhandler(HTTPException)
    async def http_error(err: HTTPException) -> Response:
        if err.code == 413:
            return _error(
                ApiError(
                    413,
                    f"request body is larger than {settings.max_request_bytes:,} bytes",
                    code="request_too_large",
                )
            )
        kind = "not_found_error" if err.code == 404 else "invalid_request_error"
        return _error(ApiError(err.code or 500, err.description or err.name, type=kind))

    def engine_or_503() -> Engine:
        if state.phase != "serving" or state.engine is None:
            message = {
                "starting": "the model is still loading; retry shortly",
                "draining": "the server is shutting down",
                "stopped": "the server is shutting down",
                "failed": f"the engine failed to start: {state.error}",
            }[state.phase]
            raise ApiError(503, message, type="service_unavailable", code=state.phase)
        return state.engine

    async def body_json() -> Any:
        raw = await request.get_data()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad(f"the request body is not valid JSON: {exc}") from None

    def check_model(parsed: Parsed) -> None:
        name = parsed.model
        served = (state.model_id, state.model_id.rstrip("/").split("/")[-1])
        if name is None or name in ALIASES or name in served:
            return
        raise ApiError(
            404,
            f"model {name!r} does not exist; this server serves {state.model_id!r}",
            param="model",
            type="not_found_error",
            code="model_not_found",
        )

    async def complete(parser) -> Response:
        engine = engine_or_503()
        parsed = parser(await body_json(), settings.defaults)
        check_model(parsed)
        try:
            stream = engine.submit(parsed.prompt, **parsed.params)
        except InvalidRequest as exc:
            raise bad(str(exc), exc.param) from None
        if parsed.stream:
            response = Response(
                _sse(stream, ChunkShaper(parsed, state.model_id, engine.tokenizer), parsed),
                content_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
            response.timeout = None
            return response
        try:
            async with stream:
                result = await stream.result()
        except GenerationFailed as exc:
            raise ApiError(500, str(exc), type="server_error") from None
        if result.finish_reason == "cancelled":
            raise ApiError(503, "the request was cancelled: the server is shutting down",
                           type="service_unavailable")  # fmt: skip
        return _json(full_response(parsed, state.model_id, result, engine.tokenizer))

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await complete(parse_chat)

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await complete(parse_completion)

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": state.model_id,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "mlx-nursery",
                    }
                ],
            }
        )

    @app.get("/health")
    async def health() -> Response:
        if state.phase == "serving":
            return _json({"status": "ok"})
        return _json({"status": state.phase, "error": state.error}, status=503)

    @app.get("/stats")
    async def stats() -> Response:
        engine = engine_or_503()
        return _json(stats_json(engine.stats()))

    @app.get("/metrics")
    async def metrics() -> Response:
        engine = engine_or_503()
        return Response(prometheus(engine.stats()), content_type="text/plain; version=0.0.4")

    return app


def _sse_data(body: Any) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _frames(event, shaper: ChunkShaper, parsed: Parsed) -> tuple[bytes, bool]:
    """The SSE frames for one event, and whether the stream ends with it."""
    if event.finish_reason in ("error", "cancelled"):
        message = event.error or "the request was cancelled"
        kind = "server_error" if event.finish_reason == "error" else "cancelled"
        return _sse_data(ApiError(500, message, type=kind).body()), True
    out = b""
    chunk = shaper.chunk(event)
    if chunk is not None:
        out += _sse_data(chunk)
    if event.terminal and parsed.include_usage and event.usage is not None:
        out += _sse_data(shaper.usage_chunk(event.usage))
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
                while not ended and (more := stream.next_nowait()) is not None:
                    frames, ended = _frames(more, shaper, parsed)
                    body += frames
                if body:
                    yield body
                if ended:
                    break
        yield b"data: [DONE]\n\n"
    except trio.Cancelled:
        raise  # the client went away: leaving `async with stream` cancelled the row
