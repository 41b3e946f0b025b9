"""The decode-step actor: owns the running batch and steps it.

Its rows are one ordered list, ``_rows``, in batch order: every batch index is
derived from it, never kept beside it. Between steps it ends rows that asked to
(``row.end`` set: by their own token, a routed :class:`Finish` or a
:class:`Cancel`), by ``filter``; then joins primed rows (adopt, merge or extend
by cache kind: see ``rows.Batch.join``); then runs one pipelined step, all in
one GPU call. A row's end is decided by :meth:`Row.accept` for its tokens and
by the first end request it gets; this actor then frees it: finished rows' KV
to the prompt cache, the terminal to the emitter, the slot to admission.

A fault in the step cannot be blamed on one row: every row in the batch gets
the error, the batch KV is dropped, and decoding goes on with whatever joins next.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import trio

from .admission import Left
from .emitter import Ended, TokenOut, Tokens
from .gpu import Gpu
from .mailbox import closing
from .prefill import Join
from .prompt_cache import Put, worth_keeping
from .request import FinishReason
from .row import Cancel, End, Finish, Phase, Row
from .rows import Batch, Sampled
from .stats import Count, Gauge, Observe, Stats

MAILBOX_SIZE = 4096
CLEAR_CACHE_EVERY = 256  # steps between mx.clear_cache(), as generate_step does


@attrs.frozen
class StepResult:
    sampled: list[Sampled | None]  # one per row, in batch order
    kv_bytes: int
    padding_waste: float
    seconds: float


@attrs.frozen
class LeaveResult:
    saved: list[list[Any]]  # the kept rows' caches, in the order asked
    kv_bytes: int
    padding_waste: float


def _leave(batch: Batch, keep: list[int], save: list[int]) -> LeaveResult:
    """Rows not in ``keep`` leave the batch; ``save`` rows' caches come back first
    (a lone row's own caches, else extracted from the batch). GPU thread."""
    if save and not batch.batched:
        saved = [batch.caches]  # the lone row's own caches: no copy
    else:
        saved = [[c.extract(i) for c in batch.caches] for i in save]
    batch.filter(keep)
    return LeaveResult(saved, batch.nbytes, batch.padding_waste())


def _advance(batch: Batch, joiners: list[Batch], step: int) -> StepResult:
    """One GPU turn: join, then step (GPU thread)."""
    import mlx.core as mx

    t0 = time.perf_counter()
    batch.join(joiners)
    sampled = batch.step() if len(batch) else []
    if step % CLEAR_CACHE_EVERY == 0:
        mx.clear_cache()
    seconds = time.perf_counter() - t0
    return StepResult(sampled, batch.nbytes, batch.padding_waste(), seconds)


@attrs.define(eq=False)
class Decode:
    model: Any
    gpu: Gpu
    stats: Stats
    inbox: trio.MemoryReceiveChannel  # Join, Cancel, Finish
    to_emitter: trio.MemorySendChannel
    to_admission: trio.MemorySendChannel
    to_prompt_cache: trio.MemorySendChannel | None
    _batch: Batch = attrs.field(init=False)
    _rows: list[Row] = attrs.field(factory=list, init=False)  # DECODING, in batch order
    _joining: list[Row] = attrs.field(factory=list, init=False)  # JOINING, FIFO
    _turns: int = attrs.field(default=0, init=False)  # GPU turns taken

    def __attrs_post_init__(self) -> None:
        self._batch = Batch(self.model)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with closing(self.inbox, self.to_emitter, self.to_admission, self.to_prompt_cache):
            task_status.started()
            while True:
                if not self._rows and not self._joining:
                    self._take(await self.inbox.receive())
                while True:
                    try:
                        self._take(self.inbox.receive_nowait())
                    except trio.WouldBlock:
                        break
                await self._turn()

    def _take(self, message: Join | Cancel | Finish) -> None:
        match message:
            case Join(row):
                self._joining.append(row)
            case Cancel(row_id) | Finish(row_id):
                for row in (*self._rows, *self._joining):
                    if row.id == row_id:
                        row.ask(message)
                # unknown: the row already ended; ending it twice is a no-op
            case _:
                raise TypeError(f"decode got an unexpected message: {message!r}")

    async def _turn(self) -> None:
        await self._leave()
        joins, self._joining = self._joining, []
        if not joins and not self._rows:
            return
        joiners = []
        for row in joins:
            row.move(Phase.DECODING)
            joiners.append(row.work)
            row.work = None
        self._rows.extend(joins)
        self._turns += 1
        try:
            result = await self.gpu.call(_advance, self._batch, joiners, self._turns)
        except Exception as exc:
            await self._fault(exc)
            return
        self._report(result.kv_bytes, result.padding_waste)
        await self._emit(result.sampled)
        if result.sampled:  # counted once its tokens are out: scripts wait on this count
            self.stats.post(Count("steps"), Observe("step_time", result.seconds))

    async def _emit(self, sampled: list[Sampled | None]) -> None:
        out = []
        for row, s in zip(self._rows, sampled, strict=True):
            if s is None or row.end is not None:
                continue  # a first token already delivered, or a row already ending
            if s.error is not None:  # its own work failed: it alone ends
                row.ask_end(End(FinishReason.ERROR, s.error))
                self.stats.post(Count("row_faults"))
                continue
            reason = row.accept(s.token)  # read = fed: exactly what the row's KV holds
            shown = None if reason is FinishReason.STOP else s.token  # EOS is never shown
            out.append(TokenOut(row, shown, s.logprob, s.top_logprobs, ends=reason is not None))
        # Finished rows leave before their last event goes out: their KV is in the
        # prompt cache and their slot free by the time a client can follow up.
        if await self._leave(pending=tuple(out)) and out:
            await self.to_emitter.send(Tokens(tuple(out)))

    async def _leave(self, pending: tuple[TokenOut, ...] = ()) -> bool:
        """Rows that are ending leave now: out of the batch (their kept KV to the
        prompt cache), ``Ended`` to the emitter unless their last token in
        ``pending`` carries the end, and their slot back to admission. False when
        the batch failed instead (then :meth:`_fault` has sent ``pending``)."""
        dropped = [r for r in self._joining if r.end is not None]
        self._joining = [r for r in self._joining if r.end is None]
        for row in dropped:
            # A joiner's solo caches hold its prompt (its first token is not fed yet).
            if self._keeps(row):
                await self.to_prompt_cache.send(Put(row.prompt, row.work.caches))
            await self._free(row, announced=False)
        gone = [r for r in self._rows if r.end is not None]
        if not gone:
            return True
        keep = [i for i, r in enumerate(self._rows) if r.end is None]
        save = [i for i, r in enumerate(self._rows) if self._keeps(r)]
        try:
            left = await self.gpu.call(_leave, self._batch, keep, save)
        except Exception as exc:
            await self._fault(exc, pending)
            return False
        for i, caches in zip(save, left.saved, strict=True):
            row = self._rows[i]
            await self.to_prompt_cache.send(Put(row.prompt + row.tokens, caches))
        self._rows = [self._rows[i] for i in keep]
        self._report(left.kv_bytes, left.padding_waste)
        announced = {o.row.id for o in pending if o.ends}
        for row in gone:
            await self._free(row, announced=row.id in announced)
        return True

    async def _free(self, row: Row, *, announced: bool) -> None:
        row.work = None
        row.move(Phase.ENDED)
        if not announced:
            await self.to_emitter.send(Ended(row))
        await self.to_admission.send(Left(row.id))

    def _keeps(self, row: Row) -> bool:
        return self.to_prompt_cache is not None and worth_keeping(row)

    def _report(self, kv_bytes: int, padding_waste: float) -> None:
        self.stats.post(
            Gauge("batch_kv_bytes", kv_bytes),
            Gauge("decoding_rows", len(self._rows)),
            Gauge("padding_waste", padding_waste),
        )

    async def _fault(self, exc: Exception, pending: tuple[TokenOut, ...] = ()) -> None:
        """A GPU call on the batch failed: every row in it fails (rows already
        ending keep their own end), and the batch starts over empty. ``pending``
        (tokens read before the fault) goes out first."""
        message = f"batch step failed: {type(exc).__name__}: {exc}"
        self.stats.post(Count("batch_faults"))
        if pending:
            await self.to_emitter.send(Tokens(pending))
        announced = {o.row.id for o in pending if o.ends}
        rows, self._rows = self._rows, []
        self._batch = Batch(self.model)
        for row in rows:
            row.ask_end(End(FinishReason.ERROR, message))
            await self._free(row, announced=row.id in announced)
        self._report(0, 0.0)
