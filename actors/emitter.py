"""The emitter actor: token ids become text and events on each request's channel.

Per row it owns the streaming detokenizer, the stop-string matcher (text never
contains a stop string) and the delivery state. Delivery is ``send_nowait`` into
the row's own buffer, sized for its ``max_tokens`` plus the terminal event, so
the emitter never waits on a client.

The emitter never decides that a row ends; it reports what it sees to the row's
owner (through admission, which knows where the row is): a stop string as
:class:`Finish`, a closed or full buffer (the consumer is gone) as
:class:`Cancel`. Until the owner's answer comes, the row's later tokens are
dropped. The owner's answer, a token carrying the end or :class:`Ended`, makes
the emitter send the row's one terminal event and count it in the ledger.
"""

from __future__ import annotations

import collections
import contextlib
import enum
from typing import Any

import attrs
import trio

from .families import HarmonySplitter, family_of, held_prefix
from .messages import Ended, TokenOut, Tokens
from .request import Drafts, Event, FinishReason, Usage
from .row import Cancel, Finish, Row
from .stats import ByClass, Count, Metric, Observe, Stats
from .tools import GENERIC, ReasoningScanner, ToolScanner

MAILBOX_SIZE = 4096


class Halt(enum.Enum):
    """Why delivery of a row stopped before its owner ended it."""

    STOP_STRING = "stop string"
    GONE = "the consumer stopped reading"
    FAULT = "its text could not be made"  # the detokenizer or stop matching raised


@attrs.define(eq=False)
class _Delivery:
    detokenizer: object
    held: str = ""  # text withheld: it could be the start of a stop string
    delivered: int = 0  # tokens delivered (usage's completion_tokens)
    first_token_at: float | None = None
    halted: Halt | None = None  # set once the owner has been asked to end the row
    tools: ToolScanner | None = None  # lifts tool calls out of the text (rows with tools)
    thinking: ReasoningScanner | None = None  # splits a thinking model's reasoning out
    harmony: HarmonySplitter | None = None  # gpt-oss: channels are content, reasoning, calls
    stop_sequence: str | None = None  # the stop string that ended the row
    fault: str | None = None  # what went wrong in this row's delivery
    # the tokenizer's control tokens left out of content and reasoning (None: kept)
    plain: tuple[SpecialText, SpecialText] | None = None


@attrs.define(eq=False)
class SpecialText:
    """One stream of a row's text (content or reasoning) without the tokenizer's
    control tokens (``<|start|>``, ``[TOOL_CALLS]``, DeepSeek's pad): what the
    family's parser did not consume (a lone token, a malformed block kept as
    text) is left out, as vLLM's ``skip_special_tokens`` does. A piece that may
    begin one is held until the next piece or the end."""

    specials: tuple[str, ...]  # longest first
    starts: frozenset[str]  # their first characters
    held: str = ""

    @classmethod
    def of(cls, specials: tuple[str, ...]) -> SpecialText:
        return cls(specials, frozenset(s[0] for s in specials))

    def feed(self, text: str, *, final: bool = False) -> str:
        text, self.held = self.held + text, ""
        if not self.starts.intersection(text):
            return text
        for special in self.specials:
            if special in text:
                text = text.replace(special, "")
        if not final:
            keep = max(held_prefix(text, s) for s in self.specials)
            text, self.held = text[: len(text) - keep], text[len(text) - keep :]
        return text


def special_texts(tokenizer: Any) -> tuple[str, ...]:
    """The tokenizer's control tokens as text, longest first: its special tokens
    and the added tokens it marks special."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    found = set(getattr(hf, "all_special_tokens", ()) or ())
    for added in (getattr(hf, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            found.add(str(added.content))
    return tuple(sorted((s for s in found if s), key=lambda s: (-len(s), s)))


def _split_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str, bool]:
    """(text safe to show, text to hold back, whether a stop string matched)."""
    if not stops:
        return text, "", False
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut], "", True
    hold = max(held_prefix(text, s) for s in stops)
    return text[: len(text) - hold], text[len(text) - hold :], False


_LEDGER = {
    FinishReason.STOP: Metric.FINISHED,
    FinishReason.LENGTH: Metric.FINISHED,
    FinishReason.TOOL_CALLS: Metric.FINISHED,
    FinishReason.ERROR: Metric.ERRORED,
    FinishReason.CANCELLED: Metric.CANCELLED,
}


@attrs.define(eq=False)
class Emitter:
    tokenizer: object
    stats: Stats
    inbox: trio.MemoryReceiveChannel
    to_admission: trio.MemorySendChannel  # Finish / Cancel for the row's owner
    think: tuple[str, str] | None = None  # the model's thinking markers
    _rows: dict[int, _Delivery] = attrs.field(factory=dict, init=False)
    # gpt-oss: every row's text is read by its Harmony channels (known once, at start)
    _harmony: bool = attrs.field(init=False)
    _specials: tuple[str, ...] = attrs.field(init=False)  # special_texts(tokenizer)

    def __attrs_post_init__(self) -> None:
        family = family_of(self.tokenizer)
        self._harmony = family is not None and family.name == "harmony"
        self._specials = special_texts(self.tokenizer)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self.inbox, self.to_admission:
            task_status.started()
            async for message in self.inbox:
                self.dispatch(message)

    def dispatch(self, message: Tokens | Ended) -> None:
        match message:
            case Tokens(items):
                by_class: collections.Counter = collections.Counter()
                for item in items:
                    by_class[item.row.klass] += self._token(item)
                delivered = by_class.total()
                if delivered:
                    each = (ByClass(k, "tokens", n) for k, n in by_class.items() if n)
                    self.stats.post(Count(Metric.GENERATED_TOKENS, delivered), *each)
            case Ended(row):
                self._end(row)
            case _:
                raise TypeError(f"emitter got an unexpected message: {message!r}")

    def _delivery(self, row: Row) -> _Delivery:
        d = self._rows.get(row.id)
        if d is None:
            d = self._rows[row.id] = self._new_delivery(row)
        return d

    def _new_delivery(self, row: Row) -> _Delivery:
        scans = bool(row.params.tools) and row.params.tool_choice != "none"
        fmt = row.params.tool_format or GENERIC
        tools = ToolScanner(fmt, row.params.tools if scans else ())
        d = _Delivery(self.tokenizer.detokenizer, tools=tools if scans else None)
        if self._harmony:
            d.tools, d.harmony = tools, HarmonySplitter(tools.harmony_call)
        elif self.think is not None:
            d.thinking = ReasoningScanner(*self.think, inside=row.starts_thinking)
        if self._specials and row.params.skip_special_tokens:
            d.plain = (SpecialText.of(self._specials), SpecialText.of(self._specials))
        return d

    @staticmethod
    def _split(
        d: _Delivery, text: str, *, final: bool = False, cut: bool = False
    ) -> tuple[str, str, list]:
        """(content, reasoning, tool calls) of newly shown text; ``cut``: the row
        ended at max_tokens (a call it was opening is dropped, never shown)."""
        reasoning, calls = "", []
        if d.harmony is not None:
            text, reasoning, calls = d.harmony.feed(text, final=final, cut=cut)
        else:
            if d.thinking is not None:
                text, reasoning = d.thinking.feed(text, final=final)
            if d.tools is not None:
                text, calls = d.tools.feed(text, final=final, cut=cut)
        if d.plain is not None:
            content, thoughts = d.plain
            text, reasoning = content.feed(text, final=final), thoughts.feed(reasoning, final=final)
        return text, reasoning, calls

    def _token(self, item: TokenOut) -> int:
        """Deliver one token (and the row's end, if it ends); returns tokens delivered."""
        row, d = item.row, self._delivery(item.row)
        shown = 0
        if item.token is not None and d.halted is None:
            try:
                shown = self._show(row, d, item)
            except Exception as exc:  # this row's text alone: the others go on
                d.fault = f"this request failed in delivery: {type(exc).__name__}: {exc}"
                self._halt(row, d, Halt.FAULT)
        if item.ends:
            self._end(row)
        return shown

    def _show(self, row: Row, d: _Delivery, item: TokenOut) -> int:
        now = trio.current_time()
        if d.first_token_at is None:
            d.first_token_at = now
            self.stats.post(Observe(Metric.TIME_TO_FIRST_TOKEN, now - row.times.submitted))
        d.detokenizer.add_token(item.token)
        text = d.held + d.detokenizer.last_segment
        shown, d.held, stopped = _split_stop(text, row.params.stop)
        if stopped:
            d.stop_sequence = min(
                (s for s in row.params.stop if s in text), key=lambda s: (text.find(s), -len(s))
            )
        shown, reasoning, calls = self._split(d, shown)
        event = Event(
            item.token, shown, item.logprob, item.top_logprobs,
            tool_calls=tuple(calls), reasoning=reasoning,
        )  # fmt: skip
        if not self._deliver(row, event):
            self._halt(row, d, Halt.GONE)
            return 0
        d.delivered += 1
        if stopped:
            self._halt(row, d, Halt.STOP_STRING)
        return 1

    def _halt(self, row: Row, d: _Delivery, why: Halt) -> None:
        """Stop delivering ``row`` and ask its owner to end it."""
        d.halted = why
        match why:
            case Halt.STOP_STRING:
                ask = Finish(row.id, FinishReason.STOP)
            case Halt.FAULT:
                ask = Finish(row.id, FinishReason.ERROR, d.fault)
            case Halt.GONE:
                ask = Cancel(row.id, why.value)
        # Admission's mailbox is large and never waits on us; if it is closed the
        # engine is shutting down, and shutdown ends every row anyway.
        closed = (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError)
        with contextlib.suppress(*closed):
            self.to_admission.send_nowait(ask)

    def _deliver(self, row: Row, event: Event) -> bool:
        try:
            row.events.send_nowait(event)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    def _end(self, row: Row) -> None:
        """The row's one terminal event, and its count in the ledger."""
        reason, detail = row.end.reason, row.end.detail
        d = self._rows.pop(row.id, None) or self._new_delivery(row)
        text, reasoning, calls = "", "", []
        if reason.finished and d.halted in (None, Halt.STOP_STRING):
            try:
                if d.halted is None:
                    d.detokenizer.finalize()
                    text, _, _ = _split_stop(d.held + d.detokenizer.last_segment, row.params.stop)
                cut = reason is FinishReason.LENGTH
                text, reasoning, calls = self._split(d, text, final=True, cut=cut)
                if reason is FinishReason.STOP and d.tools is not None and d.tools.calls:
                    reason = FinishReason.TOOL_CALLS
            except Exception as exc:
                reason = FinishReason.ERROR
                detail = f"this request failed in delivery: {type(exc).__name__}: {exc}"
        usage = usage_of(row, d, trio.current_time())
        event = Event(
            None, text, finish_reason=reason, error=detail, error_code=row.end.code, usage=usage,
            tool_calls=tuple(calls), reasoning=reasoning,
            stop_sequence=d.stop_sequence if reason is FinishReason.STOP else None,
        )  # fmt: skip
        self._deliver(row, event)
        row.events.close()
        self.stats.post(Count(_LEDGER[reason]))


def usage_of(row: Row, d: _Delivery, finished: float) -> Usage:
    t = row.times
    start = t.prefill_started if t.prefill_started is not None else finished
    computed = len(row.prompt) - row.cached_tokens
    prefill_rate = None
    if t.prefill_started is not None and t.prefill_ended is not None:
        span = t.prefill_ended - t.prefill_started
        prefill_rate = computed / span if span > 0 else None
    decode_rate = None
    if d.first_token_at is not None and d.delivered > 1:
        span = finished - d.first_token_at
        decode_rate = (d.delivered - 1) / span if span > 0 else None
    return Usage(
        prompt_tokens=len(row.prompt),
        cached_tokens=row.cached_tokens,
        completion_tokens=d.delivered,
        queue_wait=start - t.submitted,
        time_to_first_token=None if d.first_token_at is None else d.first_token_at - t.submitted,
        prefill_tokens_per_second=prefill_rate,
        decode_tokens_per_second=decode_rate,
        cache=row.cache_report,
        session=row.session,
        priority=row.klass.label,
        drafts=Drafts(row.drafted, row.accepted, row.forwards, row.decoded)
        if row.drafted
        else None,
    )
