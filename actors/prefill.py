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

from .admission import Cancel, Left, Submit
from .decode_rules import finish_reason
from .emitter import Terminal, TokenOut, Tokens
from .gpu import Gpu
from .prompt_cache import Hit, PromptCacheActor, Put
from .request import Row
from .rows import Batch, Prefill, Sampled
from .stats import Count, Gauge, Stats

MAILBOX_SIZE = 4096


@attrs.frozen
class Join:
    """A primed row, ready to join the running batch. Its first token was already
    delivered; the batch's first step reads it again and must not re-emit it."""

    row: Row
    joiner: Batch = attrs.field(repr=False)
    first_token: int


@attrs.define(eq=False)
class _Work:
    row: Row
    job: Prefill | None = None  # made on the GPU thread at the row's first turn
    hit: Hit | None = None  # the prompt-cache take, made just before that turn
    snapshot_at: set[int] = attrs.field(factory=set)  # boundaries to store on the way
    cancelled: str | None = None

    @property
    def done(self) -> int:
        if self.job is not None:
            return self.job.done
        return self.hit.cached if self.hit is not None else 0


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@attrs.frozen
class _Done:
    """What one joiner got from a turn: tokens prefilled, and its primed batch when
    its prompt is complete (or the error that ended it)."""

    tokens: int
    primed: Batch | None = None
    first: Sampled | None = None  # the row's first token, read at once
    error: BaseException | None = None


def prefill_turn(model: Any, plan: list[tuple[_Work, int]], step_size: int) -> list[_Done]:
    """One GPU turn (GPU thread): run each planned chunk; prime what is complete.
    A fault is caught per joiner, so it fails that joiner alone."""
    results = []
    for work, budget in plan:
        try:
            if work.job is None:
                r, hit = work.row, work.hit
                caches = hit.caches if hit is not None else None
                cached = hit.cached if hit is not None else 0
                work.job = Prefill(model, r.id, r.prompt, r.params, step_size, caches, cached)
            work.job.snapshot_at = {b for b in work.snapshot_at if b > work.job.done}
            done = 0
            while done < budget and work.job.remaining > 0:
                done += work.job.chunk(budget - done)
            primed = first = None
            if work.job.remaining == 0:
                primed = work.job.prime()
                first = primed.read_first()
            results.append(_Done(done + (primed is not None), primed, first))
        except Exception as exc:
            results.append(_Done(0, error=exc))
    return results


# A turn ends once this many joiners have their prompt in: their first tokens go
# out then, instead of waiting for every short prompt that arrived with them.
# (One a turn put a decode step between every two short prompts; all at once made
# the first joiner wait for the last.)
PRIMES_PER_TURN = 2

# Joiners sharing at least this many prompt tokens with an earlier joiner wait for
# its snapshot there instead of computing the shared part again.
MIN_SHARED = 16


def plan_turn(active: list[_Work], step_size: int) -> list[tuple[_Work, int]]:
    """Share one turn's token budget among joiners, oldest first. Each planned
    joiner gets at least one token (its prime, when nothing else is left).

    A joiner that has not started and shares a prefix of ``MIN_SHARED`` tokens or
    more with an earlier joiner still short of that point is held back, and the
    earlier one told to snapshot there: the shared part is computed once."""
    # Every joiner not yet started is checked, budget or not, so that earlier ones
    # learn where to snapshot before they pass that point.
    waiting = {
        id(w) for i, w in enumerate(active) if w.job is None and _waits_for_earlier(w, active[:i])
    }
    plan, budget, primes = [], step_size, 0
    for work in active:
        if budget <= 0 or primes >= PRIMES_PER_TURN:
            break
        if id(work) in waiting:
            continue
        left = len(work.row.prompt) - 1 - work.done
        take = min(budget, max(left, 0))
        plan.append((work, take))
        budget -= max(take, 1)
        primes += take == left
    return plan


def _waits_for_earlier(work: _Work, earlier: list[_Work]) -> bool:
    """Hold ``work`` back while an earlier joiner computes a prefix they share and
    ``work``'s own take does not cover (by ``MIN_SHARED`` tokens or more); tell
    that joiner to snapshot there. A held-back joiner takes again once released."""
    waits = False
    for other in earlier:
        shared = min(shared_prefix(work.row.prompt, other.row.prompt), len(work.row.prompt) - 1)
        if shared - work.done >= MIN_SHARED and other.done < shared:
            other.snapshot_at.add(min(shared, len(other.row.prompt) - 1))
            waits = True
    if waits:
        work.hit = None  # stale by the time it may start: take again then
    return waits


@attrs.define(eq=False)
class PrefillActor:
    model: Any
    gpu: Gpu
    stats: Stats
    step_size: int
    eos: frozenset[int]
    to_decode: trio.MemorySendChannel
    to_emitter: trio.MemorySendChannel
    to_admission: trio.MemorySendChannel
    send: trio.MemorySendChannel = attrs.field(init=False)
    _receive: trio.MemoryReceiveChannel = attrs.field(init=False)
    _active: list[_Work] = attrs.field(factory=list, init=False)  # FIFO

    prompt_cache: PromptCacheActor | None = None

    def __attrs_post_init__(self) -> None:
        self.send, self._receive = trio.open_memory_channel(MAILBOX_SIZE)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self._receive, self.to_decode, self.to_emitter, self.to_admission:
            task_status.started()
            while True:
                if not self._active:
                    await self._take(await self._receive.receive())
                await self._drain()
                await self._drop_cancelled()
                if self._active:
                    await self._turn()

    async def _drain(self) -> None:
        while True:
            try:
                message = self._receive.receive_nowait()
            except trio.WouldBlock:
                return
            await self._take(message)

    async def _take(self, message: Submit | Cancel) -> None:
        match message:
            case Submit(row):
                row.times.prefill_started = trio.current_time()
                self.stats.post(Count("prompt_tokens", len(row.prompt)))
                self._active.append(_Work(row))
            case Cancel(row_id, reason):
                for work in self._active:
                    if work.row.id == row_id:
                        work.cancelled = work.cancelled or reason
                        return
                await self.to_decode.send(message)  # already handed over (or gone)
            case _:
                raise TypeError(f"prefill got an unexpected message: {message!r}")

    async def _end(self, row: Row, reason: str, error: str | None) -> None:
        await self.to_emitter.send(Terminal(row, reason, error))
        await self.to_admission.send(Left(row.id))

    async def _drop_cancelled(self) -> None:
        # A cancelled row's solo KV goes with its job, between turns.
        for work in [w for w in self._active if w.cancelled is not None]:
            self._active.remove(work)
            await self._end(work.row, "cancelled", work.cancelled)
        self._report()

    async def _turn(self) -> None:
        for work in self._active:  # arrivals (and joiners released from waiting) take
            if work.job is None and work.hit is None:
                await self._take_cached(work)
        plan = plan_turn(self._active, self.step_size)
        results = await self.gpu.call(prefill_turn, self.model, plan, self.step_size)
        now = trio.current_time()
        for (work, _), done in zip(plan, results, strict=True):
            self.stats.post(Count("prefill_tokens", done.tokens))
            await self._put_snapshots(work)
            if done.error is None and done.primed is None:
                continue  # more chunks to come
            self._active.remove(work)
            if done.error is not None:
                err = done.error
                await self._end(work.row, "error", f"prefill failed: {type(err).__name__}: {err}")
            elif work.cancelled is not None:
                await self._end(work.row, "cancelled", work.cancelled)
            else:
                work.row.times.prefill_ended = now
                await self._first_token(work.row, done)
        self._report()

    async def _first_token(self, row: Row, done: _Done) -> None:
        """Deliver the row's first token now (time to first token does not wait for
        the join), then hand the primed row to decode; a row that ends at its
        first token (EOS, a stop id, max_tokens 1) never joins."""
        first = done.first
        reason = finish_reason(row, first.token, 1, self.eos)
        shown = None if reason == "stop" else first.token
        out = TokenOut(row, shown, first.logprob, first.top_logprobs, reason)
        await self.to_emitter.send(Tokens((out,)))
        if reason is None:
            await self.to_decode.send(Join(row, done.primed, first.token))
        else:
            await self.to_admission.send(Left(row.id))

    async def _take_cached(self, work: _Work) -> None:
        """Start from the longest usable cached prefix; store a snapshot where the
        prompt's last message starts, so a follow-up can reuse all before it."""
        row = work.row
        if row.snapshot_at is not None and 0 < row.snapshot_at < len(row.prompt):
            work.snapshot_at.add(row.snapshot_at)
        if self.prompt_cache is None:
            work.hit = Hit(None, 0)
            return
        work.hit = await self.prompt_cache.take(row.prompt)
        row.cached_tokens = work.hit.cached

    async def _put_snapshots(self, work: _Work) -> None:
        if work.job is None or not work.job.snapshots:
            return
        snapshots, work.job.snapshots = work.job.snapshots, []
        if self.prompt_cache is None:
            return
        for n, caches in snapshots:
            await self.prompt_cache.send.send(Put(work.row.prompt[:n], caches, "system"))

    def _report(self) -> None:
        nbytes = sum(w.job.nbytes for w in self._active if w.job is not None)
        self.stats.post(Gauge("prefill_kv_bytes", nbytes))
