"""The front of a replica set (``serve --replicas N``): the server on the user's
address, in front of the router and its replicas (``replicas.py``).

It is a single server's HTTP surface without an engine: the same host check,
CORS and API key (``app.py``), the same model names (``pool.resolve``: aliases,
globs, ``claude-*``), each generation request passed to the router with the
served name, its answer streamed back as it comes. A stream that ends without
its API's last event (a replica died under it) gets the API's own error event,
so a client reads a clear error, never a silent end. ``/health``,
``/v1/models``, ``/v1/sessions``, ``/stats``, ``/metrics`` and the dashboard
(``/``) answer for every replica.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

import attrs
import httpx
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from . import model_process
from .api.base import ApiError, dumps, model_of, object_body
from .app import (
    APIS,
    TUNNEL,
    TUNNEL_ERROR,
    TUNNEL_ROUTE,
    Guard,
    HealthFirst,
    HostCheck,
    _async,
    error_response,
)
from .pool import Pool
from .replicas import ROUTING_KEY, SESSION_HEADERS, ReplicaSet
from .request_log import RequestLog
from .routes import body_json, json_response
from .serve import arm_exit_deadline, hosted, until_any
from .settings import Settings
from .state import ServerPhase, pool_of

log = logging.getLogger("mlx_nursery.server")

# What ends each API's stream; a stream that closes without one of these was cut.
ENDS = {
    "/v1/chat/completions": (b"data: [DONE]",),
    "/v1/completions": (b"data: [DONE]",),
    "/v1/messages": (b"event: message_stop", b"event: error"),
    "/v1/responses": (b"event: response.completed", b"event: response.incomplete",
                      b"event: response.failed", b"event: error"),
}  # fmt: skip
# How the router's own error event starts, which it writes (in the Messages API's
# shape, on every route) where a replica's stream broke: replaced by the API's own.
ROUTER_ERROR = b'data: {"type":"error","error":'
RETRIES = 4  # tries of a request the router could not place (RETRY_WAIT, 2x, 3x apart)
RETRY_WAIT = 0.5  # seconds
ROUTED = "x-smg-routed-worker-id"  # the router's word of the replica it chose
PLACEMENTS = 65536  # conversations whose replica the front remembers (the newest)
OPENING = 1024  # characters of a bare prompt that name its conversation (routing_key)
TAIL = 64  # bytes of a stream kept to find an end marker split across chunks
# /stats figures summed over the replicas
TOTALS = ("submitted", "finished", "errored", "cancelled", "rejected", "prompt_tokens",
          "prefill_tokens", "generated_tokens", "prompt_cache_hits", "prompt_cache_misses",
          "prompt_cache_hit_tokens", "active_rows", "pending_rows")  # fmt: skip


def cut_frame(path: str, message: str) -> bytes:
    """The API's own error event for a stream cut short."""
    error = {"message": message, "type": "server_error", "code": "replica_lost"}
    if path == "/v1/messages":
        body = {"type": "error", "error": {"type": "api_error", "message": message}}
        return f"event: error\ndata: {dumps(body)}\n\n".encode()
    if path == "/v1/responses":
        body = {"type": "error", "code": "replica_lost", "message": message, "param": None}
        return f"event: error\ndata: {dumps(body)}\n\n".encode()
    return f"data: {dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()


@attrs.define(eq=False)
class Placements:
    """Where the router placed each conversation (its key, ``routing_key``), as
    its answer's ``ROUTED`` header says. A conversation whose replica has gone
    down is sent under a new key (``key#n``): the router places it on a live
    replica and keeps it there. Under the old key it would return to its old
    replica once that serves again (smg keeps both), to a cache that died with
    the process."""

    placed: dict[str, tuple[str | None, int]] = attrs.field(factory=dict)  # key: (url, moves)

    def key(self, key: str, serving: set[str]) -> str:
        url, moves = self.placed.get(key, (None, 0))
        if url is not None and url not in serving:
            moves += 1
            self.placed[key] = (None, moves)
        return f"{key}#{moves}" if moves else key

    def went(self, key: str, url: str | None) -> None:
        _, moves = self.placed.pop(key, (None, 0))
        self.placed[key] = (url, moves)  # the newest last
        while len(self.placed) > PLACEMENTS:
            del self.placed[next(iter(self.placed))]


@attrs.define(eq=False)
class FrontState:
    """What the front's routes read: its settings, the set, the model names."""

    settings: Settings
    replicas: ReplicaSet
    phase: ServerPhase = ServerPhase.STARTING
    error: str | None = None
    failed: trio.Event = attrs.field(factory=trio.Event)
    requests: RequestLog = attrs.field(factory=RequestLog)  # refusals here, in memory
    pool: Pool = attrs.field(init=False)  # names only: nothing is loaded here
    keys: Placements = attrs.field(factory=Placements)  # where conversations went

    def __attrs_post_init__(self) -> None:
        self.pool = pool_of(self.settings)

    async def run(self) -> None:
        """The replica set, for as long as the front serves."""
        try:
            await self.replicas.run(task_status=_Started(self))
        except Exception as exc:  # the router could not start, or ended
            self.phase, self.error = ServerPhase.FAILED, str(exc)
            log.error("the replica set failed: %s", exc)
            self.failed.set()

    def health(self) -> tuple[int, dict]:
        replicas = [r.figures() for r in self.replicas.replicas]
        if self.phase is ServerPhase.SERVING and self.replicas.healthy():
            return 200, {"status": "ok", "replicas": replicas}
        status = "unhealthy" if self.phase is ServerPhase.SERVING else self.phase.value
        return 503, {"status": status, "error": self.error, "replicas": replicas}

    def check_serving(self) -> None:
        if self.phase is ServerPhase.SERVING:
            return
        message = {ServerPhase.STARTING: "the replicas are still starting; retry shortly",
                   ServerPhase.FAILED: f"the replica set failed: {self.error}"}.get(
                       self.phase, "the server is shutting down")  # fmt: skip
        raise ApiError(503, message, type="service_unavailable", code=self.phase.value)


@attrs.define
class _Started:
    """``task_status`` for the set: started means serving."""

    state: FrontState

    def started(self, value: Any = None) -> None:
        self.state.phase = ServerPhase.SERVING
        log.info("serving %s on %d replicas behind the router (%s)", self.state.pool.default.name,
                 len(self.state.replicas.replicas), self.state.replicas.policy)  # fmt: skip


@attrs.frozen
class FrontRoutes:
    state: FrontState

    @property
    def set(self) -> ReplicaSet:
        return self.state.replicas

    async def generate(self) -> Response:
        """A generation request, to the router with the served model's name."""
        return await self._pass(self.set.router_url)

    async def count_tokens(self) -> Response:
        """Counting moves no cache: any serving replica answers it."""
        healthy = self.set.healthy()
        if not healthy:
            raise ApiError(503, "no replica is serving now; retry shortly",
                           type="service_unavailable", code="replica_unavailable")  # fmt: skip
        return await self._pass(healthy[0].url)

    async def _pass(self, base: str) -> Response:
        self.state.check_serving()
        body = dict(object_body(await body_json(self.state.settings.body_timeout)))
        body["model"] = self.state.pool.resolve(model_of(body)).name
        headers = model_process.forward_headers(request.headers)
        path, content, key = request.path, dumps(body), ""
        if base == self.set.router_url:  # through the router: tunnelled (app.Tunnel)
            path, content = TUNNEL_ROUTE, dumps(tunnel_body(request.path, body, headers))
            key = routing_key(body, headers)  # what sticky pins
            serving = {r.url for r in self.set.healthy()}
            headers[ROUTING_KEY] = self.state.keys.key(key, serving)
        client = self.set.client
        for attempt in range(1, RETRIES + 1):
            outgoing = client.build_request(
                "POST", base + path, params=list(request.args.items(multi=True)),
                content=content, headers={**headers, "Authorization": f"Bearer {self.set.key}"},
            )  # fmt: skip
            try:
                upstream = await client.send(outgoing, stream=True)
            # No answer began: the router died under the send (a pooled connection
            # reset) or is being started again. Again, shortly.
            except httpx.TransportError as exc:
                if attempt == RETRIES:
                    raise ApiError(503, f"no replica answered: {exc}",
                                   type="service_unavailable",
                                   code="replica_unavailable") from None  # fmt: skip
                await trio.sleep(RETRY_WAIT * attempt)
                continue
            # A 5xx is the router's own (a replica's errors come in band): no replica
            # took the request, as when the one it chose has just died. Again, shortly.
            if upstream.status_code < 500 or attempt == RETRIES:
                if base == self.set.router_url:
                    self.state.keys.went(key, upstream.headers.get(ROUTED))
                break
            await upstream.aclose()
            await trio.sleep(RETRY_WAIT * attempt)
        if upstream.status_code >= 400 or not upstream.headers.get(
                "content-type", "").startswith("text/event-stream"):  # fmt: skip
            return await _whole(upstream)
        response = Response(_relay(upstream, request.path), status=upstream.status_code,
                            headers=_back(upstream))  # fmt: skip
        response.timeout = None
        return response

    async def models(self) -> Response:
        """The replicas' models (as one replica lists them), and every replica."""
        data: list = []
        for replica in self.set.healthy():
            r = await self._get(replica.url + "/v1/models")
            if r is not None:
                data = r.json().get("data", [])
                break
        replicas = [r.figures() for r in self.set.replicas]
        return json_response({"object": "list", "data": data, "replicas": replicas})

    async def sessions(self) -> Response:
        self.state.check_serving()
        data: list = []
        for replica in self.set.healthy():
            r = await self._get(replica.url + "/v1/sessions")
            if r is not None:
                data += [{**s, "replica": replica.index} for s in r.json().get("data", [])]
        return json_response({"object": "list", "data": data})

    async def cancel_session(self, session: str) -> Response:
        self.state.check_serving()
        n = 0
        for replica in self.set.healthy():
            try:
                r = await self.set.client.delete(f"{replica.url}/v1/sessions/{session}")
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                n += r.json().get("cancelled", 0)
        if not n:
            raise ApiError(404, f"no live session {session!r}; GET /v1/sessions lists them",
                           type="not_found_error", code="session_not_found")  # fmt: skip
        return json_response({"id": session, "object": "session.cancelled", "cancelled": n})

    async def stats(self) -> Response:
        """Every replica's figures (as its /stats gave them, last read), their
        sums, and the router's view of its workers."""
        self.state.check_serving()
        replicas = [{**r.figures(), "stats": r.stats} for r in self.set.replicas]
        totals = {k: sum(r.stats.get(k) or 0 for r in self.set.replicas) for k in TOTALS}
        return json_response({
            "model": self.state.pool.default.name, "replicas": replicas, "totals": totals,
            "router": {"policy": self.set.policy, "url": self.set.router_url,
                       "restarts": self.set.router_restarts,
                       "workers": await self.set.router_workers()},
            "refusals": self.state.requests.refusal_figures(),
        })  # fmt: skip

    async def metrics(self) -> Response:
        """Every serving replica's /metrics, each sample labelled ``replica``."""
        self.state.check_serving()
        texts = []
        for replica in self.set.healthy():
            r = await self._get(replica.url + "/metrics")
            if r is not None:
                texts.append((replica.index, r.text))
        return Response(merge_metrics(texts), content_type="text/plain; version=0.0.4")

    async def dashboard(self) -> Response:
        return Response(PAGE, content_type="text/html; charset=utf-8")

    async def _get(self, url: str) -> httpx.Response | None:
        try:
            r = await self.set.client.get(url, timeout=10.0)
        except httpx.HTTPError:
            return None
        return r if r.status_code == 200 else None


async def _whole(upstream: httpx.Response) -> Response:
    """A whole answer: the replica's (its error, carried in band, as it was), or
    the router's own error in the request's API's shape."""
    try:
        data = await upstream.aread()
    except httpx.HTTPError as exc:
        raise ApiError(503, f"the replica serving this request was lost ({exc}); retry it",
                       type="service_unavailable", code="replica_lost") from None  # fmt: skip
    finally:
        await upstream.aclose()
    if upstream.status_code >= 400:  # the router's: no replica took the request
        try:
            said = json.loads(data)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            said = data.decode(errors="replace")[:200]
        raise ApiError(503 if upstream.status_code >= 500 else upstream.status_code,
                       f"the router: {said}", type="service_unavailable",
                       code="replica_unavailable")  # fmt: skip
    if data.startswith(b'{"' + TUNNEL_ERROR.encode()):
        error = json.loads(data)[TUNNEL_ERROR]
        response = json_response(error["body"], error["status"])
        if error.get("retry_after"):
            response.headers["Retry-After"] = error["retry_after"]
        return response
    return Response(data, status=upstream.status_code,
                    headers=_back(upstream))  # fmt: skip


def _back(upstream: httpx.Response) -> list[tuple[str, str]]:
    """The answer's headers for the client: the replica's, less the router's own
    word of which replica it was (a loopback URL, of no use past the front)."""
    return [(k, v) for k, v in model_process.back_headers(upstream.headers)
            if k.lower() != ROUTED]  # fmt: skip


async def _relay(upstream: httpx.Response, path: str) -> AsyncIterator[bytes]:
    """The router's stream, chunk by chunk; one that breaks or ends without its
    API's last event (the replica under it died) ends with the API's error event."""
    ends, tail, ended, lost = ENDS.get(path, ()), b"", False, None
    try:
        async for raw in upstream.aiter_raw():
            chunk, router, said = raw.partition(ROUTER_ERROR)
            if router:  # its event's name line too, where it wrote one
                chunk = chunk.removesuffix(b"event: error\n")
            if chunk:
                yield chunk
                tail = tail[-TAIL:] + chunk
                ended = ended or any(end in tail for end in ends)
            if router:  # the router's word that the replica's stream broke
                lost = said.partition(b"\n\n")[0].decode(errors="replace")
                break
    except httpx.HTTPError as exc:
        lost = str(exc)
    finally:
        with trio.CancelScope(shield=True):
            await upstream.aclose()
    if ends and not ended:
        why = lost or "it ended before the answer did"
        yield cut_frame(path, f"the replica serving this request was lost ({why}); retry "
                              "the request")  # fmt: skip


def routing_key(body: dict[str, Any], headers: dict[str, str]) -> str:
    """The conversation a request belongs to, which the router keeps on one
    replica: the session its client names (a header of ``SESSION_HEADERS``:
    Claude Code's sub-agents share its id, so its whole tree stays together),
    else its ``prompt_cache_key`` (OpenAI's field for this), else a hash of how
    it opens: system prompt, tools and the turns up to the first user turn,
    which every later turn of the conversation repeats (a bare prompt: its
    first ``OPENING`` characters)."""
    named = {k.lower(): v for k, v in headers.items()}
    for name in SESSION_HEADERS:
        if named.get(name):
            return "session:" + named[name][:200]
    if isinstance(body.get("prompt_cache_key"), str) and body["prompt_cache_key"]:
        return "key:" + body["prompt_cache_key"][:200]
    turns = next((body[k] for k in ("messages", "input", "prompt") if k in body), None)
    if isinstance(turns, list):
        first = next((i for i, t in enumerate(turns)
                      if isinstance(t, dict) and t.get("role") == "user"), 0)  # fmt: skip
        turns = turns[: first + 1]
    elif isinstance(turns, str):
        turns = turns[:OPENING]
    head = [body.get(k) for k in ("model", "system", "instructions", "tools")]
    return "opening:" + hashlib.sha256(dumps([*head, turns]).encode()).hexdigest()[:32]


def tunnel_body(path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    """The request as the router carries it to a replica (``app.Tunnel``): a
    Messages body whose text is the request's routing text (what the router's
    prefix tree matches: system prompt and tools first, then the conversation
    in order, so a conversation's turns and the requests that share its system
    prompt share a prefix), the request itself, whole, in ``TUNNEL``."""
    head = [body.get(k) for k in ("system", "instructions", "tools")]
    turns = [body.get(k) for k in ("messages", "input", "prompt")]
    text = "".join(dumps(part) for part in (*head, *turns) if part is not None)
    limit = (body.get("max_tokens") or body.get("max_output_tokens")
             or body.get("max_completion_tokens") or 1)  # fmt: skip
    return {
        "model": body["model"], "max_tokens": limit, "stream": bool(body.get("stream")),
        "messages": [{"role": "user", "content": text}],
        TUNNEL: {"path": path, "headers": headers, "body": body},
    }  # fmt: skip


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?(\s.*)$")


def merge_metrics(texts: Sequence[tuple[int, str]]) -> str:
    """Prometheus texts, one a replica, as one: each family's HELP and TYPE once,
    then its samples from every replica, each labelled ``replica``."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for index, text in texts:
        current = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                current = line.split()[2]
                meta, _ = families.setdefault(current, ([], []))
                if line not in meta:
                    meta.append(line)
                continue
            m = _SAMPLE.match(line)
            if m is None or current is None:
                continue
            name, labels, rest = m.groups()
            inner = f'replica="{index}"' + ("," + labels[1:-1] if labels and labels != "{}" else "")
            families[current][1].append(f"{name}{{{inner}}}{rest}")
    lines = [line for meta, samples in families.values() for line in (*meta, *samples)]
    return "\n".join(lines) + "\n"


def create_front(settings: Settings, replicas: ReplicaSet) -> QuartTrio:
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    app.config["RESPONSE_TIMEOUT"] = None
    state = FrontState(settings, replicas)
    app.extensions["mlx_nursery"] = state
    routes, guard = FrontRoutes(state), Guard(settings)

    @app.before_serving
    async def start_replicas() -> None:
        app.nursery.start_soon(state.run)

    app.asgi_app = HostCheck(HealthFirst(app.asgi_app, state), state)
    app.before_request(_async(guard.authorize))
    app.after_request(_async(guard.cors))
    app.register_error_handler(ApiError, _async(error_response))
    app.register_error_handler(HTTPException, _async(guard.http_error))
    for path in APIS:
        app.add_url_rule(path, endpoint=path, view_func=routes.generate, methods=["POST"])
    app.add_url_rule("/v1/messages/count_tokens", view_func=routes.count_tokens,
                     methods=["POST"])  # fmt: skip
    app.add_url_rule("/v1/sessions/<session>", view_func=routes.cancel_session,
                     methods=["DELETE"])  # fmt: skip
    for path, view in (("/v1/models", routes.models), ("/v1/sessions", routes.sessions),
                       ("/stats", routes.stats), ("/metrics", routes.metrics),
                       ("/", routes.dashboard)):  # fmt: skip
        app.add_url_rule(path, view_func=view, methods=["GET"])
    return app


async def serve_front(settings: Settings, replicas: ReplicaSet, *, handle_signals: bool = True,
                      task_status=trio.TASK_STATUS_IGNORED) -> FrontState:  # fmt: skip
    """Serve the front until a signal (or the set fails): then stop taking
    requests, stop the set (each replica drains what it runs), and end."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line a look at a replica
    app = create_front(settings, replicas)
    state: FrontState = app.extensions["mlx_nursery"]

    async def trigger() -> None:
        await until_any(state.failed, signals=handle_signals)
        if state.phase is not ServerPhase.FAILED:
            state.phase = ServerPhase.DRAINING
        log.info("shutting down: the replicas drain (up to %.0f s)", settings.drain_seconds)
        arm_exit_deadline(settings.drain_seconds + 45.0)
        await replicas.stop()

    await hosted(app, settings, trigger, state, task_status)
    return state


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>mlx-nursery replicas</title>
<style>body{font:14px system-ui,sans-serif;margin:2em}table{border-collapse:collapse}
td,th{padding:4px 10px;border-bottom:1px solid #ddd;text-align:right}th{background:#f4f4f4}
td:first-child,th:first-child{text-align:left}.down{color:#b00}</style></head>
<body><h1>Replicas of <span id="model"></span></h1>
<p>Router: <span id="router"></span>. Each replica's own dashboard is its URL.</p>
<table><thead><tr><th>replica</th><th>status</th><th>pid</th><th>restarts</th>
<th>running</th><th>queued</th><th>requests</th><th>prompt tokens</th><th>cached</th>
<th>generated</th><th>router load</th></tr></thead><tbody id="rows"></tbody></table>
<script>
const key = new URLSearchParams(location.search).get("key");
const q = key ? "?key=" + encodeURIComponent(key) : "";
async function tick() {
  try {
    const s = await (await fetch("/stats" + q)).json();
    document.getElementById("model").textContent = s.model;
    document.getElementById("router").textContent = s.router.policy;
    const load = Object.fromEntries(s.router.workers.map(w => [w.url, w.load]));
    document.getElementById("rows").innerHTML = s.replicas.map(r => {
      const f = r.stats || {}, cached = f.prompt_tokens ?
        Math.round(100 * (f.prompt_cache_hit_tokens || 0) / f.prompt_tokens) + "%" : "";
      return `<tr><td>${r.index} ${r.url}</td><td class="${r.status == "serving" ? "" :
        "down"}">${r.status}</td><td>${r.pid ?? ""}</td><td>${r.restarts}</td>
        <td>${f.active_rows ?? ""}</td><td>${f.pending_rows ?? ""}</td>
        <td>${f.finished ?? ""}</td><td>${f.prompt_tokens ?? ""}</td><td>${cached}</td>
        <td>${f.generated_tokens ?? ""}</td><td>${load[r.url] ?? ""}</td></tr>`;
    }).join("");
  } catch (e) {}
}
tick(); setInterval(tick, 1000);
</script></body></html>
"""
