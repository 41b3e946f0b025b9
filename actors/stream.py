"""One request's events, as the embedding API hands them out."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs
import trio

from .errors import GenerationFailed
from .request import Event, FinishReason, Result, SamplingParams
from .row import Row


@attrs.define(eq=False)
class RequestStream:
    """One request's events. Use as ``async with engine.submit(...) as stream``.

    Leaving the block before the terminal event (break, an exception, a cancel)
    cancels the request: its row is evicted within one step and its KV freed.
    """

    # The engine's two doors: queue a row (raises Overloaded), ask a row to end.
    _enqueue: Callable[[Row], Awaitable[None]]
    _cancel: Callable[[int, str], None]
    _row: Row | None  # handed to admission on entering; never touched after
    id: int
    params: SamplingParams
    _receive: trio.MemoryReceiveChannel
    prompt_tokens: int = 0  # the prompt's length, as the engine tokenized it
    _ended: bool = False  # the terminal event has been read
    # Called with the terminal event as it is read, in the reader's task; what it
    # returns is handed out instead (the server adds what it knows, then records).
    on_end: Callable[[Event], Event] | None = None

    async def start(self) -> None:
        """Queue the request (entering the stream does this when not done yet).
        Raises :class:`Overloaded` when the queue is full."""
        row, self._row = self._row, None
        if row is None:
            raise RuntimeError("a request stream starts once")
        await self._enqueue(row)

    async def __aenter__(self) -> RequestStream:
        if self._row is not None:
            await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._receive.close()
        if not self._ended:
            self.cancel("the consumer left the stream")

    def cancel(self, reason: str = "cancelled by the caller") -> None:
        """Ask for the request to end now; its terminal event (``cancelled``, or
        whatever end it reached first) still arrives on the stream."""
        self._cancel(self.id, reason)

    async def result(self) -> Result:
        """Read the rest of the stream into a :class:`Result`; raises
        :class:`GenerationFailed` if it ends in an error event."""
        tokens, text, logprobs, tops, calls, reasoning = [], [], [], [], [], []
        async for event in self:
            text.append(event.text)
            reasoning.append(event.reasoning)
            calls.extend(event.tool_calls)
            if event.token is not None:
                tokens.append(event.token)
                logprobs.append(event.logprob)
                tops.append(event.top_logprobs)
            if event.terminal:
                if event.finish_reason is FinishReason.ERROR:
                    raise GenerationFailed(event.error, code=event.error_code)
                return Result(
                    tokens=tokens,
                    text="".join(text),
                    finish_reason=event.finish_reason,
                    usage=event.usage,
                    logprobs=logprobs if self.params.wants_logprobs else None,
                    top_logprobs=tops if self.params.top_logprobs else None,
                    tool_calls=calls,
                    reasoning="".join(reasoning),
                    stop_sequence=event.stop_sequence,
                )
        raise GenerationFailed("the stream ended without a terminal event")

    def next_nowait(self) -> Event:
        """The next event if one is already waiting; raises :class:`trio.WouldBlock`
        if none is, and :class:`trio.EndOfChannel` after the terminal event."""
        if self._ended:
            raise trio.EndOfChannel
        return self._seen(self._receive.receive_nowait())

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        if self._ended:
            raise StopAsyncIteration
        try:
            event = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise StopAsyncIteration from None
        return self._seen(event)

    def _seen(self, event: Event) -> Event:
        self._ended = event.terminal
        if event.terminal and self.on_end is not None:
            return self.on_end(event)
        return event
