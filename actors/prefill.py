"""The prefill actor: each joiner's prompt, alone, a bounded chunk per GPU turn.

Rows arrive from admission in FIFO order. Each is prefilled on fresh solo caches
(never padded, never batched with another prompt). A GPU turn spends at most
``prefill_step_size`` prompt tokens, oldest joiner first: a long prompt takes
several turns, while several short prompts that arrive together share one turn.
Between two turns the decode actor's step gets the GPU (calls run FIFO), so
running rows stall at most one turn's worth of prefill. A joiner whose prompt is
in is primed (its last token forwarded and its first token sampled on its solo
caches) and goes to decode to join the batch. A prefill error fails only its row.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from .admission import Left, Submit
from .emitter import Ended, TokenOut, Tokens
from .gpu import Gpu
from .mailbox import closing
from .prompt_cache import EntryKind, Put, take
from .request import FinishReason
from .row import Cancel, End, Finish, Phase, Row
from .rows import Batch, Prefill, Sampled
from .stats import Count, Gauge, Stats

MAILBOX_SIZE = 4096

# A turn ends once this many joiners have their prompt in: their first tokens go
# out then, instead of waiting for every short prompt that arrived with them.
# (One a turn put a decode step between every two short prompts; all at once made
# the first joiner wait for the last.)
PRIMES_PER_TURN = 2

# Joiners sharing at least this many prompt tokens with an earlier joiner wait for
# its snapshot there instead of computing the shared part again.
MIN_SHARED = 16


@attrs.frozen
class Join:
    """Hands a primed row (JOINING; ``row.work`` is its one-row batch) to decode."""

    row: Row


@attrs.frozen
class _Done:
    """What one joiner got from a turn: tokens prefilled, and its primed batch when
    its prompt is complete (or the error that ended it)."""

    tokens: int
    primed: Batch | None = None
    first: Sampled | None = None  # the row's first token, read at once
    error: BaseException | None = None


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def prefill_turn(plan: list[tuple[Prefill, int]]) -> list[_Done]:
    """One GPU turn (GPU thread): run each planned chunk; prime what is complete.
    A fault is caught per joiner, so it fails that joiner alone."""
    results = []
    for job, budget in plan:
        try:
            done = 0
            while done < budget and job.remaining > 0:
                done += job.chunk(budget - done)
            primed = first = None
            if job.remaining == 0:
                primed = job.prime()
                first = primed.read_first()
            results.append(_Done(done + (primed is not None), primed, first))
        except Exception as exc:
            results.append(_Done(0, error=exc))
    return results


def plan_turn(active: list[Prefill], step_size: int) -> list[tuple[Prefill, int]]:
    """Share one turn's token budget among joiners, oldest first. Each planned
    joiner gets at least one token (its prime, when nothing else is left).

    A joiner that has not started and shares a prefix of ``MIN_SHARED`` tokens or
    more with an earlier joiner still short of that point is held back, and the
    earlier one told to snapshot there: the shared part is computed once."""
    # Every joiner not yet started is checked, budget or not, so that earlier ones
    # learn where to snapshot before they pass that point.
    waiting = {
        id(job)
        for i, job in enumerate(active)
        if not job.started and _waits_for_earlier(job, active[:i])
    }
    plan, budget, primes = [], step_size, 0
    for job in active:
        if budget <= 0 or primes >= PRIMES_PER_TURN:
            break
        if id(job) in waiting:
            continue
        left = job.remaining
        take_now = min(budget, max(left, 0))
        plan.append((job, take_now))
        budget -= max(take_now, 1)
        primes += take_now == left
    return plan


def _waits_for_earlier(job: Prefill, earlier: list[Prefill]) -> bool:
    """Hold ``job`` back while an earlier joiner computes a prefix they share and
    ``job``'s own take does not cover (by ``MIN_SHARED`` tokens or more); tell
    that joiner to snapshot there. A held-back joiner takes again once released."""
    waits = False
    for other in earlier:
        shared = min(shared_prefix(job.prompt, other.prompt), len(job.prompt) - 1)
        if shared - job.done >= MIN_SHARED and other.done < shared:
            other.snapshot_at.add(min(shared, len(other.prompt) - 1))
            waits = True
    if waits:
        job.forget_take()  # stale by the time it may start: take again then
    return waits


@attrs.define(eq=False)
class PrefillActor:
    model: Any
    gpu: Gpu
    stats: Stats
    step_size: int
    inbox: trio.MemoryReceiveChannel  # Submit, Cancel, Finish
    to_decode: trio.MemorySendChannel  # Join, and end requests for rows handed over
    to_emitter: trio.MemorySendChannel
    to_admission: trio.MemorySendChannel
    to_prompt_cache: trio.MemorySendChannel | None
    _active: list[Row] = attrs.field(factory=list, init=False)  # PREFILLING, FIFO

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        channels = (self.inbox, self.to_decode, self.to_emitter, self.to_admission)
        with closing(*channels, self.to_prompt_cache):
            task_status.started()
            while True:
                if not self._active:
                    await self._take(await self.inbox.receive())
                while True:
                    try:
                        await self._take(self.inbox.receive_nowait())
                    except trio.WouldBlock:
                        break
                await self._drop_ending()
                if self._active:
                    await self._turn()

    async def _take(self, message: Submit | Cancel | Finish) -> None:
        match message:
            case Submit(row):
                row.move(Phase.PREFILLING)
                row.times.prefill_started = trio.current_time()
                row.work = Prefill(self.model, row.prompt, row.params, self.step_size)
                if row.snapshot_at is not None and 0 < row.snapshot_at < len(row.prompt):
                    row.work.snapshot_at.add(row.snapshot_at)
                self.stats.post(Count("prompt_tokens", len(row.prompt)))
                self._active.append(row)
            case Cancel(row_id) | Finish(row_id):
                for row in self._active:
                    if row.id == row_id:
                        row.ask(message)
                        return
                await self.to_decode.send(message)  # already handed over (or gone)
            case _:
                raise TypeError(f"prefill got an unexpected message: {message!r}")

    async def _end(self, row: Row) -> None:
        """The row ends here: its solo KV goes with its job."""
        row.work = None
        row.move(Phase.ENDED)
        await self.to_emitter.send(Ended(row))
        await self.to_admission.send(Left(row.id))

    async def _drop_ending(self) -> None:
        for row in [r for r in self._active if r.end is not None]:
            self._active.remove(row)
            await self._end(row)
        self._report()

    async def _turn(self) -> None:
        for row in self._active:  # arrivals (and joiners released from waiting) take
            if not row.work.taken:
                hit = await take(self.to_prompt_cache, row.prompt)
                row.work.start_from(hit.caches, hit.cached)
                row.cached_tokens = row.work.done
        plan = plan_turn([r.work for r in self._active], self.step_size)
        by_job = {id(r.work): r for r in self._active}
        results = await self.gpu.call(prefill_turn, plan)
        now = trio.current_time()
        for (job, _), done in zip(plan, results, strict=True):
            row = by_job[id(job)]
            self.stats.post(Count("prefill_tokens", done.tokens))
            await self._put_snapshots(row)
            if done.error is None and done.primed is None:
                continue  # more chunks to come
            self._active.remove(row)
            if done.error is not None:
                err = done.error
                row.ask_end(End(FinishReason.ERROR, f"prefill failed: {type(err).__name__}: {err}"))
                await self._end(row)
            elif row.end is not None:
                await self._end(row)
            else:
                row.times.prefill_ended = now
                await self._first_token(row, done)
        self._report()

    async def _first_token(self, row: Row, done: _Done) -> None:
        """Deliver the row's first token now (time to first token does not wait for
        the join), then hand the primed row to decode; a row that ends at its
        first token (EOS, a stop id, max_tokens 1) never joins."""
        first = done.first
        reason = row.accept(first.token)
        shown = None if reason is FinishReason.STOP else first.token
        if reason is None:
            row.work = done.primed
            row.move(Phase.JOINING)
            await self.to_emitter.send(
                Tokens((TokenOut(row, shown, first.logprob, first.top_logprobs),))
            )
            await self.to_decode.send(Join(row))
            return
        row.work = None
        row.move(Phase.ENDED)
        out = TokenOut(row, shown, first.logprob, first.top_logprobs, ends=True)
        await self.to_emitter.send(Tokens((out,)))
        await self.to_admission.send(Left(row.id))

    async def _put_snapshots(self, row: Row) -> None:
        job = row.work
        if job is None or not job.snapshots:
            return
        snapshots, job.snapshots = job.snapshots, []
        if self.to_prompt_cache is None:
            return
        for n, caches in snapshots:
            await self.to_prompt_cache.send(Put(row.prompt[:n], caches, EntryKind.SYSTEM))

    def _report(self) -> None:
        nbytes = sum(r.work.nbytes for r in self._active)
        self.stats.post(Gauge("prefill_kv_bytes", nbytes))
