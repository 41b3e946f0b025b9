"""The emitter actor: token ids become text and events on each request's channel.

Per row it owns the streaming detokenizer, the stop-string matcher (text never
contains a stop string) and the delivery state. Delivery is ``send_nowait`` into
the row's own buffer, sized for its ``max_tokens`` plus the terminal event, so
the emitter never waits on a client: a closed or full buffer means the consumer
is gone, and becomes a cancel for that row. The emitter sends every row's one
terminal event, and ignores anything that arrives for a row after it.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

from .request import Event, Row, TopLogprob, Usage
from .stats import Count, Observe, Stats

MAILBOX_SIZE = 4096


@attrs.frozen
class TokenOut:
    """One token of one row, from decode or serial. ``token`` is None when the row
    ends without a new token (EOS or a stop token id, which are never shown)."""

    row: Row
    token: int | None
    logprob: float | None = None
    top_logprobs: tuple[TopLogprob, ...] | None = None
    finish_reason: str | None = None  # stop | length, decided by the token's producer


@attrs.frozen
class Tokens:
    items: tuple[TokenOut, ...]


@attrs.frozen
class Terminal:
    """End a row without a token: error or cancelled."""

    row: Row
    finish_reason: str  # error | cancelled
    error: str | None = None


@attrs.define(eq=False)
class _Delivery:
    detokenizer: object
    held: str = ""  # text withheld: it could be the start of a stop string


def _split_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str, bool]:
    """(text safe to show, text to hold back, whether a stop string matched)."""
    if not stops:
        return text, "", False
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut], "", True
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return text[: len(text) - hold], text[len(text) - hold :], False


@attrs.define(eq=False)
class Emitter:
    tokenizer: object
    stats: Stats
    cancel: Callable[[int, str], None]  # ask admission to stop a row (consumer gone, stop string)
    send: trio.MemorySendChannel = attrs.field(init=False)
    _receive: trio.MemoryReceiveChannel = attrs.field(init=False)
    _rows: dict[int, _Delivery] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        self.send, self._receive = trio.open_memory_channel(MAILBOX_SIZE)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self._receive:
            task_status.started()
            async for message in self._receive:
                self.dispatch(message)

    def dispatch(self, message: Tokens | Terminal) -> None:
        match message:
            case Tokens(items):
                delivered = sum(self._token(item) for item in items)
                if delivered:
                    self.stats.post(Count("generated_tokens", delivered))
            case Terminal(row, reason, error):
                self._finish(row, reason, error=error)
            case _:
                raise TypeError(f"emitter got an unexpected message: {message!r}")

    def _delivery(self, row: Row) -> _Delivery:
        d = self._rows.get(row.id)
        if d is None:
            d = self._rows[row.id] = _Delivery(self.tokenizer.detokenizer)
        return d

    def _deliver(self, row: Row, event: Event) -> bool:
        try:
            row.events.send_nowait(event)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    def _token(self, item: TokenOut) -> int:
        """Deliver one token (and the row's end, if it ends); returns tokens delivered."""
        row = item.row
        if row.done:
            return 0  # late output of a row that already ended (pipelined step)
        d = self._delivery(row)
        if item.token is not None:
            now = trio.current_time()
            if row.times.first_token is None:
                row.times.first_token = now
                self.stats.post(Observe("time_to_first_token", now - row.times.submitted))
            row.completion_tokens += 1
            d.detokenizer.add_token(item.token)
            shown, d.held, stopped = _split_stop(
                d.held + d.detokenizer.last_segment, row.params.stop
            )
            event = Event(item.token, shown, item.logprob, item.top_logprobs)
            if not self._deliver(row, event):
                self._finish(row, "cancelled")
                self.cancel(row.id, "the consumer stopped reading")
                return 0
            if stopped:
                self._finish(row, "stop", flush=False)
                self.cancel(row.id, "stop string")
                return 1
        if item.finish_reason is not None:
            self._finish(row, item.finish_reason)
        return int(item.token is not None)

    def _finish(self, row: Row, reason: str, *, error: str | None = None, flush=True) -> None:
        if row.done:
            return
        row.done, row.finish_reason = True, reason
        d = self._rows.pop(row.id, None)
        text = ""
        if flush and d is not None and reason in ("stop", "length"):
            d.detokenizer.finalize()
            text, _, _ = _split_stop(d.held + d.detokenizer.last_segment, row.params.stop)
        row.times.finished = trio.current_time()
        event = Event(None, text, finish_reason=reason, error=error, usage=usage_of(row))
        self._deliver(row, event)
        row.events.close()
        counter = {"stop": "finished", "length": "finished", "error": "errored"}
        self.stats.post(Count(counter.get(reason, "cancelled")))


def usage_of(row: Row) -> Usage:
    t = row.times
    start = t.prefill_started if t.prefill_started is not None else t.finished or t.submitted
    computed = len(row.prompt) - row.cached_tokens
    prefill_rate = None
    if t.prefill_started is not None and t.prefill_ended is not None:
        span = t.prefill_ended - t.prefill_started
        prefill_rate = computed / span if span > 0 else None
    decode_rate = None
    if t.first_token is not None and t.finished is not None and row.completion_tokens > 1:
        span = t.finished - t.first_token
        decode_rate = (row.completion_tokens - 1) / span if span > 0 else None
    return Usage(
        prompt_tokens=len(row.prompt),
        cached_tokens=row.cached_tokens,
        completion_tokens=row.completion_tokens,
        queue_wait=start - t.submitted,
        time_to_first_token=None if t.first_token is None else t.first_token - t.submitted,
        prefill_tokens_per_second=prefill_rate,
        decode_tokens_per_second=decode_rate,
    )
