"""``n`` choices of one prompt (chat and text completions' ``n``): n rows, one response.

Each choice is a row of its own, queued together: the prompt is computed and
its last token forwarded once (the later rows ride on the first as forks, each
sampling its first token from that forward: see docs/prompt-cache.md), and each
samples with its own draws (a request's ``seed`` gives choice ``i`` the seed
``seed + i``).

A stream reads every choice's events as they come: a pump task a choice, in
the app's nursery (an async generator cannot hold one across its yields),
forwards ``(index, event)`` into one channel that the response reads. Leaving
the response early cancels the pumps, and each pump leaving its stream cancels
its row.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Sequence

import attrs
import trio
from mlx_nursery.actors import Event, Request, RequestStream

from .api.base import frames, sse_frame
from .api.openai import ChunkShaper, usage_of_choices

log = logging.getLogger("mlx_nursery.server")


def choice_request(request: Request, i: int) -> Request:
    """Choice ``i``'s request: its own seed (``seed + i``) and label."""
    if i == 0:
        return request
    params = dict(request.params)
    if params.get("seed") is not None and isinstance(params["seed"], int):
        params["seed"] = (params["seed"] + i) % 2**64
    label = f"{request.request_id}-{i}" if request.request_id else None
    return attrs.evolve(request, params=params, request_id=label)


@attrs.define(eq=False)
class Choices:
    """The choices' streams read as one: ``(index, event)`` in arrival order."""

    streams: Sequence[RequestStream]
    _send: trio.MemorySendChannel = attrs.field(init=False)
    _receive: trio.MemoryReceiveChannel = attrs.field(init=False)
    _scope: trio.CancelScope = attrs.field(factory=trio.CancelScope, init=False)

    def __attrs_post_init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel(math.inf)

    def start(self, nursery: trio.Nursery) -> Choices:
        nursery.start_soon(self._pumps)
        return self

    async def _pumps(self) -> None:
        """Runs in the app's nursery: nothing it meets may reach the app."""
        with self._scope:
            try:
                async with self._send, trio.open_nursery() as nursery:
                    for i, stream in enumerate(self.streams):
                        nursery.start_soon(self._pump, i, stream, self._send.clone())
            except Exception:
                log.exception("the choices of one response stopped being read")

    @staticmethod
    async def _pump(i: int, stream: RequestStream, send: trio.MemorySendChannel) -> None:
        async with send, stream:
            try:
                async for event in stream:
                    await send.send((i, event))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the response is gone: leaving the stream cancels the row

    def close(self) -> None:
        """Stop reading: the pumps leave their streams, which cancels their rows."""
        self._scope.cancel()

    def __aiter__(self) -> AsyncIterator[tuple[int, Event]]:
        return self._receive.__aiter__()


async def sse_choices(
    choices: Choices, shapers: Sequence[ChunkShaper], include_usage: bool
) -> AsyncIterator[bytes]:
    """The choices' chunks as they come, each with its index; one usage chunk
    (where asked) once every choice has ended, then ``[DONE]``. A choice that
    fails ends the response with its error, as one stream's would."""
    usages: list = [None] * len(shapers)
    try:
        async for i, event in choices:
            body, ended = frames(shapers[i], event)
            if body:
                yield body
            if ended and not event.finish_reason.finished:
                return  # the error frame was the response's end
            if ended:
                usages[i] = event.usage
                if all(u is not None for u in usages):
                    break
        if include_usage and all(u is not None for u in usages):
            yield sse_frame(shapers[0].usage_chunk(usage_of_choices(usages)))
        yield shapers[0].end()
    finally:
        choices.close()
