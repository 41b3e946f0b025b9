"""The app's assembly: middleware, routes and lifecycle over one engine.

The engine lives in the app's own nursery (``app.nursery``, opened by the ASGI
lifespan), started in the background so ``/health`` can answer 503 while the
model loads. Every generation route is :meth:`Routes.generate` with its API's
object (``server/api/``); an error is answered in the shape of the API whose
route it came from.
"""

from __future__ import annotations

import functools
import hmac
import json
from collections.abc import Callable
from typing import Any

import attrs
from quart import Response, current_app, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from .access import cors_headers, host_allowed
from .api.base import Api, ApiError
from .api.chat import Chat
from .api.completions import Completions
from .api.messages import Messages
from .api.responses import Responses
from .routes import Routes, json_response
from .settings import Settings
from .state import ServerState

# Each generation route and the API it speaks (count_tokens answers as Messages).
APIS: dict[str, Api] = {
    "/v1/chat/completions": Chat(),
    "/v1/completions": Completions(),
    "/v1/messages": Messages(),
    "/v1/responses": Responses(),
}


def api_of(path: str) -> Api:
    """The API a path speaks, for its errors (OpenAI's shape off the API routes)."""
    if path == "/v1/messages/count_tokens":
        return APIS["/v1/messages"]
    return APIS.get(path) or APIS["/v1/chat/completions"]


def error_response(err: ApiError) -> Response:
    api = api_of(request.path)
    body, status = api.error(err)
    if 400 <= err.status < 500:
        state: ServerState = current_app.extensions["mlx_nursery"]
        state.requests.refuse(api=api.name, status=status, reason=err.code or err.type,
                              request_id=request.headers.get("X-Request-Id"))  # fmt: skip
    response = json_response(body, status)
    if err.retry_after is not None:
        response.headers["Retry-After"] = str(err.retry_after)
    return response


@attrs.frozen
class Guard:
    """Access and CORS for every routed request."""

    settings: Settings

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
        origin, host = request.headers.get("Origin"), request.headers.get("Host")
        response.headers.update(cors_headers(origin, host, self.settings))
        return response

    def http_error(self, err: HTTPException) -> Response:
        if err.code == 413:
            limit = self.settings.max_request_bytes
            message = f"request body is larger than {limit:,} bytes"
            return error_response(ApiError(413, message, code="request_too_large"))
        kind = "not_found_error" if err.code == 404 else "invalid_request_error"
        return error_response(ApiError(err.code or 500, err.description or err.name, type=kind))


@attrs.frozen
class HostCheck:
    """ASGI in front of everything: a request whose ``Host`` is not this server's
    (``access.host_allowed``: DNS rebinding) is answered 403 in its API's error
    shape before any route, ``/health`` included."""

    app: Callable[..., Any]
    state: ServerState

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        host = _header(scope, b"host") if scope["type"] == "http" else None
        if host is None or host_allowed(host, self.state.settings):
            await self.app(scope, receive, send)
            return
        message = (f"Host {host!r} is not this server's: it answers loopback names and its "
                   "bound address; add the name with --allowed-hosts to serve it")  # fmt: skip
        api = api_of(scope["path"])
        body, status = api.error(ApiError(403, message, type="forbidden", code="host_not_allowed"))
        self.state.requests.refuse(api=api.name, status=status, reason="host_not_allowed",
                                   request_id=_header(scope, b"x-request-id"))  # fmt: skip
        headers = {"Content-Type": "application/json"}
        await _answer(send, status, headers, json.dumps(body).encode())


def _header(scope: dict, name: bytes) -> str | None:
    return next((v.decode("latin-1") for k, v in scope["headers"] if k == name), None)


async def _answer(send: Callable, status: int, headers: dict[str, str], data: bytes,
                  *, head: bool = False) -> None:  # fmt: skip
    """A whole answer sent in front of the app (one task, two sends); ``head``:
    the headers of ``data`` without its body."""
    headers = {**headers, "Content-Length": str(len(data))}
    fields = [(k.lower().encode(), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": fields})
    await send({"type": "http.response.body", "body": b"" if head else data})


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
        origin, host = _header(scope, b"origin"), _header(scope, b"host")
        headers.update(cors_headers(origin, host, self.state.settings))
        await _answer(send, status, headers, data, head=method == "HEAD")


TUNNEL = "mlx_nursery_tunnel"  # the body field a replica set's front tunnels a request in
TUNNEL_ROUTE = "/v1/messages"  # the router's route the tunnel takes (it passes bodies as sent)
TUNNEL_ERROR = "mlx_nursery_tunnel_error"  # a tunnelled request's error answer, in band


@attrs.frozen
class Tunnel:
    """ASGI in front of a replica (``--replica``): a request the set's front
    tunnelled through the router (``front.py``) is taken as the front received
    it: its path, its headers (the router passes few) and its body.

    The router (SGLang's Model Gateway) forwards a Messages body as sent, but
    drops the headers sessions and classes are read from and rewrites a
    Responses body with its own defaults (``temperature: 1.0``, ``top_k``); so
    the front sends every request as a Messages body whose own text is only the
    routing text, the request itself in ``TUNNEL``."""

    app: Callable[..., Any]

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] != TUNNEL_ROUTE or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        data = b"".join(chunks)
        tunnel = None
        if TUNNEL.encode() in data:
            try:
                tunnel = json.loads(data).get(TUNNEL)
            except (ValueError, AttributeError):
                tunnel = None
        if not isinstance(tunnel, dict):
            await self.app(scope, _replay([{"type": "http.request", "body": data}], receive), send)
            return
        data = json.dumps(tunnel.get("body")).encode()
        given = {k.lower().encode("latin-1"): str(v).encode("latin-1")
                 for k, v in (tunnel.get("headers") or {}).items()}  # fmt: skip
        kept = [(k, v) for k, v in scope["headers"] if k not in given and k != b"content-length"]
        headers = [*kept, *given.items(), (b"content-length", str(len(data)).encode())]
        path = str(tunnel.get("path") or TUNNEL_ROUTE)
        scope = {**scope, "path": path, "raw_path": path.encode(), "headers": headers}
        await self.app(scope, _replay([{"type": "http.request", "body": data}], receive),
                       _errors_in_band(send))  # fmt: skip


def _errors_in_band(send: Callable) -> Callable:
    """``send`` for a tunnelled request: an error answer (4xx, 5xx) goes back as
    a 200 whose body is ``{TUNNEL_ERROR: {status, retry_after, body}}``, which
    the front answers as it was (the router reshapes a worker's error bodies
    into its own, in the Messages API's shape)."""
    failed: dict | None = None
    chunks: list[bytes] = []

    async def tunnel_send(message: dict) -> None:
        nonlocal failed
        if message["type"] == "http.response.start" and message["status"] >= 400:
            failed = message
            return
        if failed is None or message["type"] != "http.response.body":
            await send(message)
            return
        chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in failed["headers"]}
        try:
            body = json.loads(b"".join(chunks) or b"null")
        except ValueError:
            body = b"".join(chunks).decode(errors="replace")
        error = {"status": failed["status"], "retry_after": headers.get("retry-after"),
                 "body": body}  # fmt: skip
        await _answer(send, 200, {"Content-Type": "application/json"},
                      json.dumps({TUNNEL_ERROR: error}).encode())  # fmt: skip

    return tunnel_send


def _replay(messages: list[dict], receive: Callable) -> Callable:
    """``receive`` for a body already read: its messages, then the connection's
    own (its disconnect ends a stream whose client went away)."""
    pending = list(messages)

    async def replay() -> dict:
        return pending.pop(0) if pending else await receive()

    return replay


def create_app(settings: Settings) -> QuartTrio:
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # streams last as long as generation does
    state = ServerState(settings)
    app.extensions["mlx_nursery"] = state
    routes, guard = Routes(state), Guard(settings)

    @app.before_serving
    async def start_engine() -> None:
        app.nursery.start_soon(state.host_engine)

    @app.after_serving
    async def stop_engine() -> None:
        await state.stop()

    app.asgi_app = HostCheck(HealthFirst(app.asgi_app, state), state)
    if settings.replica:
        app.asgi_app = Tunnel(app.asgi_app)
    app.before_request(_async(guard.authorize))
    app.after_request(_async(guard.cors))
    app.register_error_handler(ApiError, _async(error_response))
    app.register_error_handler(HTTPException, _async(guard.http_error))
    messages = Messages(as_sent=settings.prompt_as_sent)  # parses by the setting
    for path, api in {**APIS, "/v1/messages": messages}.items():
        view = functools.partial(routes.generate, api)
        app.add_url_rule(path, endpoint=api.name, view_func=view, methods=["POST"])
    count = functools.partial(routes.count_tokens, messages)
    app.add_url_rule("/v1/messages/count_tokens", endpoint="count_tokens", view_func=count,
                     methods=["POST"])  # fmt: skip
    app.add_url_rule("/v1/sessions/<session>", view_func=routes.cancel_session,
                     methods=["DELETE"])  # fmt: skip
    for path, view in (
        ("/v1/models", routes.models),
        ("/v1/sessions", routes.sessions),
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
