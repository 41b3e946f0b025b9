"""The HTTP routes over one :class:`ServerState`; handlers never touch mlx.

Every API goes through one handler, :meth:`Routes.generate`: read the body,
let the API parse it, check the model, submit, then either shape the result or
stream the API's frames through the one SSE loop (``api.base.sse``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import attrs
import httpx
import trio
from mlx_nursery.actors import (
    ContextOverflow,
    Engine,
    EngineClosed,
    Event,
    FinishReason,
    GenerationFailed,
    InvalidRequest,
    Overloaded,
    RequestStream,
    Result,
)
from quart import Response, current_app, request

from . import dashboard, image_urls, model_process
from .api.base import Api, ApiError, Parsed, Served, bad, dumps, sse
from .api.messages import Messages, count_body
from .api.openai import OpenAIApi
from .choices import Choices, choice_request, sse_choices
from .metrics import prometheus
from .model_process import ModelProcess
from .pool import Slot
from .request_log import record_of
from .settings import Settings
from .state import ServerState

log = logging.getLogger("mlx_nursery.server")


def json_response(body: Any, status: int = 200) -> Response:
    return Response(dumps(body), status=status, content_type="application/json")


def event_stream(body: Any) -> Response:
    response = Response(
        body,
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    response.timeout = None
    return response


async def body_json(seconds: float) -> Any:
    """The request body as JSON; a body that does not arrive within ``seconds`` is
    a 408 (a slow or half-sent request cannot hold the server). NaN and the
    infinities are refused: they are not JSON."""
    with trio.move_on_after(seconds) as scope:
        raw = await request.get_data()
    if scope.cancelled_caught:
        raise ApiError(408, f"the request body did not arrive within {seconds:g} s",
                       code="request_timeout")  # fmt: skip
    try:
        return json.loads(raw, parse_constant=_not_json)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad("the request body nests too deeply") from None


def _not_json(name: str) -> Any:
    raise json.JSONDecodeError(f"{name} is not JSON", name, 0)


@attrs.frozen
class Routes:
    """The routes' handlers over one server's state."""

    state: ServerState

    @property
    def settings(self) -> Settings:
        return self.state.settings

    async def generate(self, api: Api) -> Response:
        """Every API's generation route: the same path, the API's shapes. The
        request holds a lease on its model (loaded if need be) while it starts."""
        self.state.check_serving()
        body = await body_json(self.settings.body_timeout)
        if self.settings.image_urls:
            body = await image_urls.fetched(body)
        parsed = api.parse(body, request.headers)
        slot = self.state.pool.resolve(parsed.model)
        self.state.requests.adjusted.update(parsed.adjusted)
        async with self.state.pool.lease(slot) as host:
            return await host.answer(self, slot, body, parsed, api)

    async def forward(self, child: ModelProcess, slot: Slot, body: dict) -> Response:
        """A request for a model served by a process of its own (``hosts.InChild``),
        passed on as it came (its ``model`` the served name) and its answer
        streamed back; the slot is leased until the answer ends."""
        pool = self.state.pool
        outgoing = child.client.build_request(
            request.method, request.path, params=list(request.args.items(multi=True)),
            content=dumps({**body, "model": slot.name}),
            headers=model_process.forward_headers(request.headers),
        )  # fmt: skip
        try:
            upstream = await child.client.send(outgoing, stream=True)
        except httpx.TransportError as exc:
            raise ApiError(503, f"model {slot.name!r} did not answer from its process "
                           f"{child.pid}: {exc}", type="service_unavailable",
                           code="model_process_lost") from None  # fmt: skip
        nursery = current_app.nursery

        async def relay() -> Any:
            with pool.held(slot):
                try:
                    async for chunk in upstream.aiter_raw():
                        yield chunk
                finally:
                    with trio.CancelScope(shield=True):
                        await upstream.aclose()
                    if upstream.status_code < 400:
                        slot.requests += 1
                    with contextlib.suppress(RuntimeError):  # the server is closing
                        nursery.start_soon(pool.refresh, slot)

        headers = model_process.back_headers(upstream.headers)
        response = Response(relay(), status=upstream.status_code, headers=headers)
        response.timeout = None
        return response

    async def generate_here(self, engine: Engine, slot: Slot, parsed: Parsed, api: Api
                            ) -> Response:  # fmt: skip
        """A request for a model whose engine runs here (``hosts.InProcess``)."""
        if parsed.n > 1:
            return await self._choices(engine, slot, parsed, api)
        stream = await self._start(engine, slot, parsed, api)
        served = Served(slot.name, engine.tokenizer, stream.prompt_tokens)
        if parsed.stream:
            response = event_stream(sse(stream, api.shaper(parsed, served)))
        else:
            result = await self._result(stream)
            response = json_response(api.body(parsed, result, served))
        if parsed.ignored_tools:
            response.headers["X-Ignored-Tools"] = ", ".join(parsed.ignored_tools)
        return response

    async def _choices(
        self, engine: Engine, slot: Slot, parsed: Parsed, api: OpenAIApi
    ) -> Response:
        """``n`` choices: a row each, queued together (a refusal of any is the
        request's, and cancels those queued before it)."""
        streams: list[RequestStream] = []
        try:
            for i in range(parsed.n):
                one = attrs.evolve(parsed, request=choice_request(parsed.request, i))
                streams.append(await self._start(engine, slot, one, api))
        except BaseException:
            for stream in streams:
                stream.cancel("another choice of its request was refused")
            raise
        served = Served(slot.name, engine.tokenizer, streams[0].prompt_tokens)
        if parsed.stream:
            choices = Choices(streams).start(current_app.nursery)
            shapers = api.choice_shapers(parsed, served, parsed.n)
            return event_stream(sse_choices(choices, shapers, parsed.include_usage))
        results: list[Result | None] = [None] * parsed.n
        failed: list[ApiError] = []

        async def read(i: int, stream: RequestStream) -> None:
            try:
                results[i] = await self._result(stream)
            except ApiError as exc:
                failed.append(exc)

        async with trio.open_nursery() as nursery:
            for i, stream in enumerate(streams):
                nursery.start_soon(read, i, stream)
        if failed:
            raise failed[0]
        return json_response(api.choices_body(parsed, results, served))

    async def count_tokens(self, api: Messages) -> Response:
        """Anthropic's ``/v1/messages/count_tokens``: the prompt a message would have
        (its model loaded to count it)."""
        self.state.check_serving()
        body = await body_json(self.settings.body_timeout)
        if isinstance(body, dict):
            body = {"max_tokens": 1, **body}
        parsed = api.parse(body, request.headers)
        slot = self.state.pool.resolve(parsed.model)
        async with self.state.pool.lease(slot) as host:
            return await host.count(self, slot, body, parsed)

    async def count_here(self, engine: Engine, parsed: Parsed) -> Response:
        """Counting for a model whose engine runs here (``hosts.InProcess``)."""
        try:
            tokens = len(engine.encode(parsed.request.prompt, **parsed.prompt_params))
        except InvalidRequest as exc:
            raise bad(str(exc), parsed.field(exc.param)) from None
        return json_response(count_body(tokens))

    async def _start(self, engine: Engine, slot: Slot, parsed: Parsed, api: Api) -> RequestStream:
        """Submit and queue the request: a bad one is a 400, a full queue a 429,
        both before any byte of a stream."""
        request_id = parsed.request.request_id
        if parsed.ignored_tools:
            log.info("%s: left out tools this server cannot run: %s", request_id,
                     ", ".join(parsed.ignored_tools))  # fmt: skip
        try:
            stream = engine.submit_request(parsed.request)
            stream.on_end = self._on_end(engine, slot, parsed, request_id, api.name)
            await stream.start()
        except ContextOverflow as exc:
            raise api.context_error(exc, parsed.field(exc.param)) from None
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

    def _on_end(
        self, engine: Engine, slot: Slot, parsed: Parsed, request_id: str, api: str
    ) -> Callable[[Event], Event]:
        """What the server adds to a request's terminal event (in the handler's
        task, never the engine's): the chat message a cache miss diverged in; the
        request's record (recent requests, the request log); its model's figures."""

        def on_end(event: Event) -> Event:
            slot.requests += 1
            slot.tokens += event.usage.completion_tokens if event.usage is not None else 0
            cache = event.usage.cache if event.usage is not None else None
            prompt = parsed.request.prompt
            chat = isinstance(prompt, list) and any(isinstance(m, dict) for m in prompt)
            if cache is not None and cache.diverged_at is not None and chat:
                at = cache.diverged_at
                message = engine.message_at(prompt, at, **parsed.prompt_params)
                cache = attrs.evolve(cache, message=message)
                event = attrs.evolve(event, usage=attrs.evolve(event.usage, cache=cache))
            session = parsed.request.session
            record = record_of(event, request_id=request_id, api=api, session=session)
            record["model"] = slot.name
            self.state.requests.record(record)
            return event

        return on_end

    async def _result(self, stream: RequestStream) -> Result:
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
        """Every configured model, loaded or not, with its state and context."""
        pool, created = self.state.pool, int(time.time())
        cards = []
        for slot in pool.slots.values():
            card = {"id": slot.name, "object": "model", "created": created,
                    "owned_by": "mlx-nursery", "state": str(slot.state),
                    "default": slot.default, "aliases": pool.aliases_of(slot.name)}  # fmt: skip
            if slot.context_length is not None:
                # the served context (--context-length), as vLLM names it and as a number
                card["max_model_len"] = card["context_length"] = slot.context_length
            cards.append(card)
        return json_response({"object": "list", "data": cards})

    async def sessions(self) -> Response:
        """``GET /v1/sessions``: the live sessions, each with its rows."""
        self.state.check_serving()
        data = []
        for host in self.state.pool.hosts():
            data += await host.sessions()
        return json_response({"object": "list", "data": data})

    async def cancel_session(self, session: str) -> Response:
        """``DELETE /v1/sessions/{id}``: end every queued and running row of the
        session and of the sessions under it."""
        self.state.check_serving()
        why = f"session {session} was cancelled by DELETE"
        n = 0
        for host in self.state.pool.hosts():
            n += await host.cancel_session(session, why)
        if not n:
            raise ApiError(404, f"no live session {session!r}; GET /v1/sessions lists them",
                           type="not_found_error", code="session_not_found")  # fmt: skip
        return json_response({"id": session, "object": "session.cancelled", "cancelled": n})

    async def stats(self) -> Response:
        """The engine figures of one model (``?model=NAME``; the default one), the
        pool's per-model figures, the recent requests and the HTTP refusals."""
        self.state.check_serving()
        slot = self.state.pool.resolve(request.args.get("model"))
        await self.state.pool.refresh(slot)  # a child's figures read again
        host = slot.host
        body = await host.figures() if host is not None else {}
        body["model"] = slot.name
        body.update(self.state.pool.figures())
        body["recent_requests"] = list(self.state.requests.recent)
        body["refusals"] = self.state.requests.refusal_figures()
        body["prompt_adjusted"] = dict(self.state.requests.adjusted)
        return json_response(body)

    async def dashboard(self) -> Response:
        """The live page: self-contained, fed by /dashboard/events."""
        return Response(dashboard.page(), content_type="text/html; charset=utf-8")

    async def dashboard_events(self) -> Response:
        return event_stream(dashboard.feed(self.state))

    async def dashboard_snapshot(self) -> Response:
        return json_response(dashboard.snapshot(self.state))

    async def metrics(self) -> Response:
        """The default model's engine figures, and every model's, labelled ``model``."""
        accept = request.headers.get("Accept", "")
        self.state.check_serving()
        engine = self.state.engine
        refusals = self.state.requests.refusal_figures()
        adjusted = dict(self.state.requests.adjusted)
        body, content_type = prometheus(
            engine.stats() if engine is not None else None, accept,
            engine.ranks() if engine is not None else None, refusals, adjusted,
            self.state.pool.figures(),
        )  # fmt: skip
        return Response(body, content_type=content_type)
