"""The decode-step actor: owns the running batch and steps it.

Its rows are one ordered list, ``_rows``, in batch order: every batch index is
derived from it, never kept beside it. Between steps it ends rows that asked to
(``row.end`` set: by their own token, a routed :class:`Finish` or a
:class:`Cancel`), by ``filter``; then joins primed rows (adopt, merge or extend
by cache kind: see ``step.batch.Batch.join``); then runs one pipelined step, all in
one GPU call. With ``pipeline`` at n, up to n such calls are queued
(``_flights``): the next as soon as the oldest is back and before its tokens go
out (at 2, the GPU thread goes from one step to the next without waiting for
the event loop), unless a join, a leave or a pause must come first
(:meth:`Decode._ahead`; docs/batching.md, "One step ahead"). A row's end is
decided by :meth:`Row.accept` for its tokens and by the first end request it
gets; this actor then frees it: finished rows' KV to the prompt cache, the
terminal to the emitter, the slot to admission.

A fault in the step cannot be blamed on one row: every row in the batch gets
the error, the batch KV is dropped, and decoding goes on with whatever joins next.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import attrs
import trio

from .gpu import Gpu, Pending
from .mailbox import closing
from .messages import (
    Backlog,
    Join,
    NotPaused,
    Pause,
    Paused,
    Put,
    TokenOut,
    Tokens,
    release,
    worth_keeping,
)
from .request import FinishReason
from .row import Cancel, End, Finish, Phase, Row
from .speculation.drafters import DRAFTERS
from .speculation.verify import Speculation, Verifier
from .stats import Count, Gauge, Metric, Observe, Stats
from .step.batch import Batch
from .step.kv import fit
from .step.quantized import KvBits
from .step.slots import Read
from .step.syncs import Phases

log = logging.getLogger("mlx_nursery.engine")

MAILBOX_SIZE = 4096
CLEAR_CACHE_EVERY = 256  # steps between mx.clear_cache(), as generate_step does
# A retired slot waits this many turns for a joiner to be written over it before
# the batch is compacted (a copy of every row that stays); sooner when half the
# batch is retired. Each turn it waits costs one row's share of a step.
RETIRED_TURNS = 8
# While requests wait for a slot, each retired slot's replacement is already on
# its way (admission gave the slot out when the row left; its prefill runs), so
# the slot waits this long instead, whatever share of the batch is retired.
# Compacting first would be undone by the joiner: a join with no retired slot
# copies the whole batch, and with a main agent's long row in it that is 300-450
# MB, 0.2-0.3 s on two cores, where a retired slot costs one row's share of a
# step (docs/batching.md).
RETIRED_TURNS_BACKLOG = 64
DRAFTED = {d: Metric[f"DRAFTED_{d.upper()}"] for d in DRAFTERS}  # per drafter
ACCEPTED = {d: Metric[f"ACCEPTED_{d.upper()}"] for d in DRAFTERS}


@attrs.frozen
class StepResult:
    sampled: list[Read | None]  # one per slot, in batch order
    layout: list[int | None]  # the row id in each slot (None: retired), after the joins
    kv_bytes: int
    padding_waste: float
    seconds: float
    copied: int  # KV bytes the joins of this turn copied
    refilled: int  # joiners written over retired slots this turn
    phases: Phases | None  # a plain step's time by phase (None: no step, or a verify step)


@attrs.frozen
class LeaveResult:
    # the kept rows' caches (a pause: their one-row batches), in the order asked
    saved: list[Any]
    layout: list[int | None]
    kv_bytes: int
    padding_waste: float
    copied: int  # KV bytes the leave copied (filter, extract)


def _take_out(batch: Batch, rows: list[int]) -> LeaveResult:
    """Rows at ``rows`` leave the batch with their state kept, each as a one-row
    batch in ``saved`` (GPU thread)."""
    before = batch.copied
    alone = batch.take_out(rows)
    copied = batch.copied - before
    return LeaveResult(alone, batch.layout(), batch.nbytes, batch.padding_waste(), copied)


@attrs.frozen
class Joining:
    """One :class:`Join` as decode takes it in: which of its slots join (``keep``)
    and which leave first with their KV kept (``save``)."""

    batch: Batch
    keep: list[int]
    save: list[int]


@attrs.frozen
class AdvanceResult:
    step: StepResult
    saved: list[list[Any]]  # the leaving joiners' caches, in ``save`` order


def _leave(batch: Batch, leave: list[int], save: list[int], lengths: list[int]) -> LeaveResult:
    """Rows at ``leave`` end (retired in place, or filtered out); ``save`` rows'
    caches come back first, cut to ``lengths`` tokens (what their rows read: a
    verify step may have fed a row more before it ended). GPU thread."""
    before = batch.copied
    batch.remember(leave)
    saved = [fit(c, n) for c, n in zip(batch.retire(leave, save), lengths, strict=True)]
    copied = batch.copied - before
    return LeaveResult(saved, batch.layout(), batch.nbytes, batch.padding_waste(), copied)


def _advance(
    batch: Batch, joins: list[Joining], step: int, compact: bool, waiting: bool
) -> AdvanceResult:
    """One GPU turn: joiners that left drop out of their groups, the rest join
    (over retired slots first), the batch is compacted if asked, then one step
    (GPU thread; ``waiting``: requests wait for a slot)."""
    import mlx.core as mx

    t0 = time.perf_counter()
    saved = []
    before, refilled = batch.copied, batch.refilled
    for j in joins:
        saved += j.batch.split_off(j.keep, j.save)
        before -= j.batch.copied
    batch.join([j.batch for j in joins])
    if compact:
        batch.compact()
    copied = batch.copied - before
    batch.phases = None
    sampled = batch.step(waiting) if len(batch) else []
    if step % CLEAR_CACHE_EVERY == 0:
        mx.clear_cache()
    seconds = time.perf_counter() - t0
    refilled = batch.refilled - refilled
    waste = batch.padding_waste()
    step_result = StepResult(
        sampled, batch.layout(), batch.nbytes, waste, seconds, copied, refilled, batch.phases
    )
    return AdvanceResult(step_result, saved)


@attrs.frozen
class Flight:
    """A GPU turn queued and not yet settled: the call, when it was queued, the
    joiners of that turn that ended before joining (``saving``: those whose KV
    goes to the prompt cache), and the batch it runs on (a turn queued behind
    one that failed ran on the batch the fault dropped: its result is void)."""

    pending: Pending
    submitted: float  # perf_counter()
    gone: list[Row]
    saving: list[Row]
    batch: Batch


@attrs.define(eq=False)
class Decode:
    model: Any
    gpu: Gpu
    stats: Stats
    inbox: trio.MemoryReceiveChannel  # Join, Cancel, Finish, Pause, Backlog
    to_emitter: trio.MemorySendChannel
    to_admission: trio.MemorySendChannel
    to_prompt_cache: trio.MemorySendChannel | None
    speculation: Speculation | None = None  # drafting (None: plain steps only)
    kv: KvBits | None = None  # KV quantization (docs/quantized-kv.md)
    # Steps kept queued on the GPU thread, the next before this one's tokens go
    # out (docs/batching.md, "One step ahead"); 0: each step waits until the
    # last one's tokens are out.
    pipeline: int = 1
    _batch: Batch = attrs.field(init=False)
    # DECODING rows in batch order; None: a retired slot (see step.batch.Batch.retire).
    _rows: list[Row | None] = attrs.field(factory=list, init=False)
    _joining: list[Join] = attrs.field(factory=list, init=False)  # FIFO
    _turns: int = attrs.field(default=0, init=False)  # GPU turns taken
    _retired_turns: int = attrs.field(default=0, init=False)  # turns with a retired slot
    _pausing: list[int] = attrs.field(factory=list, init=False)  # row ids asked to pause
    _waiting: bool = attrs.field(default=False, init=False)  # admission's last Backlog
    # perf_counter() when the last step's result came back, while steps follow
    # each other (None: the loop idled since, so the next gap is not a step's).
    _returned: float | None = attrs.field(default=None, init=False)
    # the GPU turns queued, oldest first (more than one: none but the first joins rows)
    _flights: collections.deque[Flight] = attrs.field(factory=collections.deque, init=False)
    # Rows' last tokens read while a step was in flight: out once the rows have left.
    _held: list[TokenOut] = attrs.field(factory=list, init=False)
    _uncounted: list[float] = attrs.field(factory=list, init=False)  # steps' seconds, to count

    def __attrs_post_init__(self) -> None:
        self._batch = self._new_batch()

    def _new_batch(self) -> Batch:
        verifier = None if self.speculation is None else Verifier(self.speculation)
        return Batch(self.model, verifier=verifier, kv=self.kv)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with closing(self.inbox, self.to_emitter, self.to_admission, self.to_prompt_cache):
            task_status.started()
            while True:
                if not self._live() and not self._joining and not self._flights:
                    self._returned = None  # idle: the next step's gap is no step's
                    try:
                        self._take(await self.inbox.receive())
                    except trio.EndOfChannel:  # every sender gone, nothing running
                        return
                while True:
                    try:
                        self._take(self.inbox.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break  # closed: what runs still runs to its end
                await self._turn()

    def _take(self, message: Join | Cancel | Finish | Pause | Backlog) -> None:
        match message:
            case Join():
                self._joining.append(message)
            case Backlog(waiting):
                self._waiting = waiting
            case Pause(row_id):
                self._pausing.append(row_id)
            case Cancel(row_id) | Finish(row_id):
                joining = (r for j in self._joining for r in j.rows)
                for row in (*self._rows, *joining):
                    if row is not None and row.id == row_id and row.phase is not Phase.ENDED:
                        row.ask(message)
                # unknown: the row already ended; ending it twice is a no-op
            case _:
                raise TypeError(f"decode got an unexpected message: {message!r}")

    async def _turn(self) -> None:
        """Settle the oldest step in flight, queueing the next ones before its
        tokens go out where nothing must happen first (:meth:`_ahead`); with none
        in flight, ending rows leave, asked rows pause, and a step is queued first."""
        if not self._flights:
            await self._leave()
            if self._pausing:
                await self._pause()
            if not await self._submit():
                return
        await self._settle()

    async def _submit(self) -> bool:
        """Take this turn's joiners and queue one GPU turn (joins, then a step) on
        ``_flights``; False when nothing is left to run."""
        joins, self._joining = self._joining, []
        taking, joined, gone, saving = [], [], [], []
        for join in joins:
            # Slots of rows that ended at their first token (ENDED by prefill) or
            # while waiting here (end set) leave the group before it joins.
            keep, save = [], []
            for i, row in enumerate(join.rows):
                if row.phase is Phase.ENDED:
                    continue
                row.work = None
                if row.end is None:
                    keep.append(i)
                    joined.append(row)
                    continue
                gone.append(row)
                if self._keeps(row):  # its KV holds its prompt (its first token is not fed)
                    save.append(i)
                    saving.append(row)
            taking.append(Joining(join.batch, keep, save))
        if not joined and not self._live():
            if taking:
                await self._drop_joiners(taking, gone, saving)
            return False
        for row in joined:
            row.move(Phase.DECODING)
        self._rows.extend(joined)  # where they go is the batch's to say (the layout)
        self._turns += 1
        compact = self._compact_due(len(joined))
        pending = self.gpu.submit(
            _advance, self._batch, taking, self._turns, compact, self._waiting
        )
        self._flights.append(Flight(pending, time.perf_counter(), gone, saving, self._batch))
        return True

    def _ahead(self) -> bool:
        """Whether another step may be queued before this one's tokens go out:
        fewer than ``pipeline`` are, rows decode, none is ending or asked to pause
        (their leave comes first), no request waits for a slot, and no joiner
        waits while a step is in flight (a joiner's rows take their slots in the
        layout the step before it returns). Rows this step's tokens end ride the
        steps already queued, their tokens from them dropped and their KV cut
        back when they leave: their slot frees later, which a waiting request
        would pay (a main agent's turn behind its sub-agents, docs/benchmarks.md);
        nor one that no row wants (:meth:`_wanted`)."""
        live = self._live()
        return (len(self._flights) < self.pipeline and bool(live)
                and not self._pausing and not self._waiting
                and not (self._joining and self._flights)
                and all(r.end is None for r in live)
                and self._wanted(live))  # fmt: skip

    def _wanted(self, live: list[Row]) -> bool:
        """Whether a step more gives some row a token it may keep: one whose tokens
        so far, the settling step's and one from each step in flight leave it
        short of its ``max_tokens``. A row that ends at its ``max_tokens`` needs
        no step after its last (mlx-lm's ``generate_step`` computes none); a lone
        row's would only delay the next request's prefill on the device."""
        coming = len(self._flights) + 1
        return any(len(r.tokens) + coming < r.params.max_tokens for r in live)

    async def _settle(self) -> None:
        """Await the oldest step in flight and take its result: joiners that left, the
        batch's new layout and figures, then its tokens out (the next step
        already queued where :meth:`_ahead` lets it)."""
        flight = self._flights.popleft()
        fault = None
        try:
            result = await flight.pending.result()
        except Exception as exc:
            fault = exc
        void = flight.batch is not self._batch  # queued on a batch that failed since
        if fault is not None or void:
            if not void:  # this batch failed: every row in it fails
                held, self._held = tuple(self._held), []
                await self._fault(fault, held)
            for row in flight.gone:
                await self._free(row, announced=False)
            return
        step = result.step
        self._time(step, flight.submitted, time.perf_counter())
        await self._freed_joiners(flight.gone, flight.saving, result.saved)
        self._relayout(step.layout)
        rows = list(self._rows)  # the slots this step's reads are in
        self._report(step.kv_bytes, step.padding_waste)
        if step.copied or step.refilled:
            self.stats.post(
                Count(Metric.KV_COPIED_BYTES, step.copied), Count(Metric.REFILLED, step.refilled)
            )
        while self._ahead() and await self._submit():
            pass
        if step.sampled:
            self._uncounted.append(step.seconds)
        await self._emit(rows, step.sampled)
        self._count_steps()

    def _count_steps(self) -> None:
        """Steps are counted once all their tokens are out (scripts wait on this
        count): not while a row's last token is held."""
        if self._held or not self._uncounted:
            return
        steps, self._uncounted = self._uncounted, []
        self.stats.post(Count(Metric.STEPS, len(steps)),
                        *(Observe(Metric.STEP_TIME, s) for s in steps))  # fmt: skip

    def _time(self, step: StepResult, submitted: float, returned: float) -> None:
        """A plain step's time by phase to stats: its GPU call's (build, wait,
        read), the hand-off to the thread and back, and the event loop's turn
        since the step before (when the loop went from one to the next). A step
        queued while the one before still ran waited for no loop: its loop turn
        is 0 and its hand-off what its period (return to return) has beyond its
        call, the part of the host's work the queue did not hide."""
        before, self._returned = self._returned, returned
        if step.phases is None:
            return
        loop = None if before is None else max(0.0, submitted - before)
        start = submitted if before is None else max(submitted, before)
        p = step.phases
        self.stats.post(
            Observe(Metric.HOST_BUILD, p.build), Observe(Metric.DEVICE_WAIT, p.wait),
            Observe(Metric.HOST_READ, p.read),
            Observe(Metric.HANDOFF, max(0.0, returned - start - step.seconds)),
            *([Observe(Metric.LOOP_TURN, loop)] if loop is not None else []),
        )  # fmt: skip

    async def _drop_joiners(
        self, taking: list[Joining], gone: list[Row], saving: list[Row]
    ) -> None:
        """Every joiner of this turn ended before joining, and nothing runs."""
        saved = []
        try:
            for j in taking:
                saved += await self.gpu.call(j.batch.split_off, j.keep, j.save)
        except Exception:
            saved, saving = [], []
        await self._freed_joiners(gone, saving, saved)

    async def _freed_joiners(self, gone: list[Row], saving: list[Row], saved: list) -> None:
        for row, caches in zip(saving, saved, strict=True):
            await self.to_prompt_cache.send(Put(row.prompt, caches, session=row.pin))
        for row in gone:
            await self._free(row, announced=False)

    async def _emit(self, rows: list[Row | None], reads: list[Read | None]) -> None:
        """A step's tokens out, in ``rows``' slots; rows they end leave first (or,
        with the next step in flight, once it has settled: their last tokens
        wait in ``_held``)."""
        out = []
        drafted = dict.fromkeys(DRAFTERS, 0)
        kept = dict.fromkeys(DRAFTERS, 0)
        tokens = forwards = verified = 0
        for row, read in zip(rows, reads, strict=True):
            if read is None or row is None:
                continue
            if read.drafter is not None:
                verified = 1
                drafted[read.drafter] += read.drafted
                kept[read.drafter] += read.accepted
            if row.end is not None:
                continue  # a row already ending
            row.drafted += read.drafted
            row.accepted += read.accepted
            if read.tokens:
                row.forwards += 1
                row.decoded += len(read.tokens)
                forwards += 1
                tokens += len(read.tokens)
            for s in read.tokens:
                if s.error is not None:  # its own work failed: it alone ends
                    row.ask_end(End(FinishReason.ERROR, s.error))
                    self.stats.post(Count(Metric.ROW_FAULTS))
                    break
                # read = fed: what the row's KV holds (beyond an end: cut when it leaves)
                out.append(TokenOut.accepted(row, s.token, s.logprob, s.top_logprobs))
                if out[-1].ends:
                    break
        self.stats.post(
            Count(Metric.DECODE_TOKENS, tokens), Count(Metric.ROW_FORWARDS, forwards),
            Count(Metric.VERIFY_STEPS, verified),
            *(Count(DRAFTED[d], n) for d, n in drafted.items() if n),
            *(Count(ACCEPTED[d], n) for d, n in kept.items() if n),
        )  # fmt: skip
        # Finished rows leave before their last event goes out: their KV is in the
        # prompt cache and their slot free by the time a client can follow up.
        if not self._flights:
            await self._leave(pending=tuple(out))
            return
        now = tuple(o for o in out if not o.ends)
        self._held += [o for o in out if o.ends]
        if now:
            await self.to_emitter.send(Tokens(now))

    async def _leave(self, pending: tuple[TokenOut, ...] = ()) -> None:
        """Rows that are ending leave now: out of the batch (their kept KV to the
        prompt cache), ``Ended`` to the emitter unless their last token in
        ``pending`` (or held) carries the end, and their slot back to admission;
        then ``pending`` goes out. If the batch fails instead, :meth:`_fault`
        sends it. Never with a step in flight."""
        pending, self._held = (*self._held, *pending), []
        leave = [i for i, r in enumerate(self._rows) if r is not None and r.end is not None]
        if not leave:
            if pending:
                await self.to_emitter.send(Tokens(pending))
            self._count_steps()
            return
        gone = [self._rows[i] for i in leave]
        save = [i for i in leave if self._keeps(self._rows[i])]
        lengths = [len(self._rows[i].prompt) + len(self._rows[i].tokens) for i in save]
        try:
            left = await self.gpu.call(_leave, self._batch, leave, save, lengths)
        except Exception as exc:
            await self._fault(exc, pending)
            return
        for i, caches in zip(save, left.saved, strict=True):
            row = self._rows[i]
            await self.to_prompt_cache.send(
                Put(row.prompt + row.tokens, caches, session=row.pin)
            )
        self._left(left)
        announced = {o.row.id for o in pending if o.ends}
        for row in gone:
            await self._free(row, announced=row.id in announced)
        if pending:
            await self.to_emitter.send(Tokens(pending))
        self._count_steps()

    async def _pause(self) -> None:
        """Rows admission asked to pause leave the batch with their KV and pending
        token on the row (``row.work``) and go back to admission, which queues them
        to resume; a row that is not decoding (joining, ending, gone) stays."""
        asked, self._pausing = set(self._pausing), []
        rows = [
            i for i, r in enumerate(self._rows) if r is not None and r.id in asked and r.end is None
        ]
        found = {self._rows[i].id for i in rows}
        for row_id in asked - found:
            await self.to_admission.send(NotPaused(row_id))
        if not rows:
            return
        paused = [self._rows[i] for i in rows]
        try:
            out = await self.gpu.call(_take_out, self._batch, rows)
        except Exception as exc:
            await self._fault(exc)
            for row in paused:
                await self.to_admission.send(NotPaused(row.id))
            return
        for row, alone in zip(paused, out.saved, strict=True):
            row.work = alone
            row.move(Phase.PAUSED)
        self._left(out)
        self.stats.post(Count(Metric.PAUSED, len(paused)))
        for row in paused:
            await self.to_admission.send(Paused(row))

    def _left(self, result: LeaveResult) -> None:
        """Rows left the batch (ended or paused): take its new layout and figures."""
        self._relayout(result.layout)
        self._report(result.kv_bytes, result.padding_waste)
        if result.copied:
            self.stats.post(Count(Metric.KV_COPIED_BYTES, result.copied))

    def _live(self) -> list[Row]:
        return [r for r in self._rows if r is not None]

    def _relayout(self, layout: list[int | None]) -> None:
        """Take the batch's slot order as ``_rows`` (rows that left are gone)."""
        live = {r.id: r for r in self._live()}
        self._rows = [None if i is None else live[i] for i in layout]

    def _compact_due(self, joining: int) -> bool:
        """Compact the retired slots that joiners this turn will not fill, once
        they have waited ``RETIRED_TURNS`` turns or are half the batch; while
        requests wait for a slot, once they have waited ``RETIRED_TURNS_BACKLOG``."""
        retired = self._rows.count(None) - joining
        if retired <= 0:
            self._retired_turns = 0
            return False
        self._retired_turns += 1
        if self._waiting:
            due = self._retired_turns > RETIRED_TURNS_BACKLOG
        else:
            due = self._retired_turns > RETIRED_TURNS or retired >= len(self._live())
        if due:
            self._retired_turns = 0
            return True
        return False

    async def _free(self, row: Row, *, announced: bool) -> None:
        await release(
            row, to_emitter=self.to_emitter, to_admission=self.to_admission, announced=announced
        )

    def _keeps(self, row: Row) -> bool:
        return self.to_prompt_cache is not None and worth_keeping(row)

    def _report(self, kv_bytes: int, padding_waste: float) -> None:
        self.stats.post(
            Gauge(Metric.BATCH_KV_BYTES, kv_bytes),
            Gauge(Metric.BATCH_KV_TOKENS, sum(len(r.prompt) + len(r.tokens) for r in self._live())),
            Gauge(Metric.DECODING_ROWS, len(self._live())),
            Gauge(Metric.PADDING_WASTE, padding_waste),
        )

    async def _fault(self, exc: Exception, pending: tuple[TokenOut, ...] = ()) -> None:
        """A GPU call on the batch failed: every row in it fails (rows already
        ending keep their own end), and the batch starts over empty. ``pending``
        (tokens read before the fault) goes out first."""
        message = f"batch step failed: {type(exc).__name__}: {exc}"
        log.error("%s (%d rows fail)", message, len(self._live()), exc_info=exc)
        self.stats.post(Count(Metric.BATCH_FAULTS))
        if pending:
            await self.to_emitter.send(Tokens(pending))
        announced = {o.row.id for o in pending if o.ends}
        rows, self._rows = self._live(), []
        self._batch = self._new_batch()
        for row in rows:
            row.ask_end(End(FinishReason.ERROR, message))
            await self._free(row, announced=row.id in announced)
        self._report(0, 0.0)
        self._count_steps()
