"""The prefill actor: joiners' prompts, a bounded number of tokens per GPU turn.

Rows arrive from admission; a turn serves them by rank (a main agent's prompt
before its sub-agents': ``row.rank_now``), then in arrival order (below:
"oldest" is first in that order). A GPU turn spends at most
``prefill_step_size`` prompt tokens. Where the model's caches take padding
exactly (plain KV; under ``--kv-bits``, fresh rows that quantize at their
prompt's end), joiners whose whole prompts fit the turn padded to the
longest of them are prefilled as one right-padded batch and primed together,
as mlx-lm's batch prefill does: one large forward instead of one small one per
row, and their first tokens all come out of that turn. Other joiners (a long
prompt, a model with sliding-window or recurrent caches) are prefilled alone
on fresh solo caches, oldest first, a chunk per turn. Between two turns the
decode actor's step gets the GPU (calls run FIFO), so running rows stall at
most one turn's worth of prefill. A joiner whose prompt is in is primed (its
last token forwarded and its first token sampled) and goes to decode to join
the batch. A prefill error fails only the rows of that forward.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio
import trio.lowlevel

from .disk_cache import shared_length
from .gpu import Gpu
from .mailbox import closing
from .messages import (
    Backlog,
    EntryKind,
    Join,
    Left,
    Pause,
    Put,
    Submit,
    TokenOut,
    Tokens,
    release,
    take,
)
from .request import FinishReason
from .row import Cancel, End, Finish, Phase, Row, rank_now
from .stats import Count, Gauge, Metric, Stats
from .step.batch import Batch
from .step.joiner import Prefill, prefill_together
from .step.quantized import KvBits
from .step.slots import Sampled

MAILBOX_SIZE = 4096

# A turn ends once this many joiners have their prompt in: their first tokens go
# out then, instead of waiting for every short prompt that arrived with them.
# (One a turn put a decode step between every two short prompts; all at once made
# the first joiner wait for the last.)
PRIMES_PER_TURN = 2

# A joiner holding this many cached prompt tokens is prefilled alone (see _group).
GROUP_MAX_CACHED = 256

# Scheduling rounds an idle prefill waits for rows submitted in the same tick.
GATHER_ROUNDS = 32
QUIET_ROUNDS = 4

# Joiners sharing at least this many prompt tokens with an earlier joiner wait for
# its snapshot there instead of computing the shared part again.
MIN_SHARED = 16
# When joiners are prefilled together, a shorter shared prefix (a chat template's
# system preamble) costs less computed again inside one padded forward than the
# turn a held-back joiner would wait.
MIN_SHARED_TOGETHER = 256


@attrs.frozen
class _Done:
    """What one unit of a turn (one joiner's chunks, or a group prefilled
    together) got: tokens prefilled, and its primed batches and first tokens
    once the prompts are in (or the error that ended them). The batches hold
    the unit's rows in order: a group's in one, a joiner's and its forks' one
    each."""

    tokens: int
    primed: list[Batch] | None = None
    firsts: list[Sampled] = attrs.field(factory=list)  # read at once, one per row
    error: BaseException | None = None


# A unit of a turn: one joiner with its token budget, or a group (budget None).
Unit = tuple[list[Prefill], int | None]


def prefill_turn(plan: list[Unit]) -> list[_Done]:
    """One GPU turn (GPU thread): run each unit; prime what is complete. A fault
    is caught per unit, so it fails that joiner (or that group) alone."""
    results = []
    for jobs, budget in plan:
        try:
            if budget is None:
                tokens = sum(job.remaining + 1 for job in jobs)
                primed = prefill_together(jobs)
                results.append(_Done(tokens, [primed], primed.read_first()))
                continue
            (job,) = jobs
            done = 0
            while done < budget and job.remaining > 0:
                done += job.chunk(budget - done)
            if job.remaining > 0:
                results.append(_Done(done))
                continue
            primed = job.prime()
            firsts = primed.read_first()
            results.append(_Done(done + 1, primed.forked(), firsts))
        except Exception as exc:
            results.append(_Done(0, error=exc))
    return results


def plan_turn(
    active: list[Prefill],
    step_size: int,
    together: bool = False,
    min_shared: int | None = MIN_SHARED,
) -> list[Unit]:
    """Share one turn's token budget among joiners, oldest first.

    With ``together`` (caches that take padding exactly), the most joiners whose
    whole prompts fit the budget padded to the longest of them are prefilled and
    primed as one group, first; when the oldest joiner is not among them it keeps
    at least half the turn. The rest go alone, oldest first, each planned one
    getting at least one token (its prime, when nothing else is left).

    A joiner that has not started and shares a prefix of ``min_shared`` tokens or
    more with an earlier joiner still short of that point is held back, and the
    earlier one told to snapshot there: the shared part is computed once (None:
    never, as without a prompt cache to hand the snapshot over)."""
    # Every joiner not yet started is checked, budget or not, so that earlier ones
    # learn where to snapshot before they pass that point.
    waiting = {
        id(job)
        for i, job in enumerate(active)
        if min_shared is not None
        and not job.started
        and _waits_for_earlier(job, active[:i], min_shared)
    }
    ready = [job for job in active if id(job) not in waiting]
    plan: list[Unit] = []
    budget = step_size
    if together:
        group = _group(ready, step_size)
        if group and group[0] is not ready[0]:  # the oldest goes alone: keep it half
            group = _group(ready, step_size // 2)
        if len(group) >= 2:
            plan.append((group, None))
            budget -= len(group) * (max(job.remaining for job in group) + 1)
            ready = [job for job in ready if job not in group]
    primes = 0
    for job in ready:
        if budget <= 0 or primes >= PRIMES_PER_TURN:
            break
        left = job.remaining
        take_now = min(budget, max(left, 0))
        plan.append(([job], take_now))
        budget -= max(take_now, 1)
        primes += take_now == left
    return plan


def _group(ready: list[Prefill], cap: int) -> list[Prefill]:
    """The most joiners whose whole prompts fit ``cap`` tokens padded to the
    longest of them (its last token, the prime, included): shortest first, then
    back in arrival order. A joiner that took a long prefix from the prompt cache
    goes alone: its work is a short suffix, and merging and padding its cached KV
    would cost more than the forward it shares (and hold its first token back
    until the whole group's)."""
    chosen: set[int] = set()
    fresh = [job for job in ready if _groupable(job)]
    for n, job in enumerate(sorted(fresh, key=lambda j: j.remaining), start=1):
        if n * (job.remaining + 1) > cap:
            break
        chosen.add(id(job))
    return [job for job in ready if id(job) in chosen]


def _groupable(job: Prefill) -> bool:
    """Whether ``job`` may be prefilled in a group. Under quantized KV only a
    fresh row (no prompt-cache take: its caches would be quantized, the others'
    float) whose prompt ends where mlx-lm quantizes it: the group's float
    forward, then every row quantized, is then each row's own prefill."""
    if job.forks:
        return False
    if job.kv is None:
        return job.done < GROUP_MAX_CACHED
    return job.caches is None and job.quantize_at() == len(job.prompt) - 1


def _waits_for_earlier(job: Prefill, earlier: list[Prefill], min_shared: int) -> bool:
    """Hold ``job`` back while an earlier joiner computes a prefix they share and
    ``job``'s own take does not cover (by ``min_shared`` tokens or more); tell
    that joiner to snapshot there. A held-back joiner takes again once released."""
    waits = False
    for other in earlier:
        shared = min(shared_length(job.prompt, other.prompt), len(job.prompt) - 1)
        if shared - job.done >= min_shared and other.done < shared:
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
    inbox: trio.MemoryReceiveChannel  # Submit, Cancel, Finish, Pause, Backlog
    to_decode: trio.MemorySendChannel  # Join, and end requests for rows handed over
    to_emitter: trio.MemorySendChannel
    to_admission: trio.MemorySendChannel
    to_prompt_cache: trio.MemorySendChannel | None
    together: bool = False  # joiners may be prefilled as one padded batch (plain KV)
    kv: KvBits | None = None  # KV quantization (docs/quantized-kv.md)
    forks: bool = True  # rows with one prompt share its prefill (not across ranks)
    aging: float | None = None  # see row.rank_now: joiners go by rank, then arrival
    _active: list[Row] = attrs.field(factory=list, init=False)  # PREFILLING, FIFO

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        channels = (self.inbox, self.to_decode, self.to_emitter, self.to_admission)
        with closing(*channels, self.to_prompt_cache):
            task_status.started()
            while True:
                if not self._active:
                    await self._take(await self.inbox.receive())
                    await self._gather()
                await self._drain()
                await self._drop_ending()
                if self._active:
                    await self._turn()

    async def _drain(self) -> None:
        while True:
            try:
                await self._take(self.inbox.receive_nowait())
            except trio.WouldBlock:
                return

    async def _gather(self) -> None:
        """Woken from idle by one row: let the rows submitted with it (same tick,
        a harness fanning out its agents) come through admission first, so the
        first turn prefills them together. Scheduling rounds only, no timer: it
        stops at the first round that brings nothing (at most ``GATHER_ROUNDS``)."""
        quiet = 0
        for _ in range(GATHER_ROUNDS):
            await trio.lowlevel.checkpoint()
            before = len(self._active)
            await self._drain()
            quiet = quiet + 1 if len(self._active) == before else 0
            if quiet >= QUIET_ROUNDS:
                return

    async def _take(self, message: Submit | Cancel | Finish | Pause | Backlog) -> None:
        match message:
            case Submit(row) if row.phase is Phase.PAUSED:
                # A paused row resumes: its own one-row batch, as it left, joins again.
                row.move(Phase.JOINING)
                await self.to_decode.send(Join((row,), row.work))
            case Submit(row):
                row.move(Phase.PREFILLING)
                row.times.prefill_started = trio.current_time()
                row.work = Prefill(
                    self.model, row.prompt, row.params, self.step_size, row_id=row.id,
                    stop_ids=row.stop_ids, kv=self.kv,
                )  # fmt: skip
                if row.snapshot_at is not None and 0 < row.snapshot_at < len(row.prompt):
                    row.work.snapshot_at.add(row.snapshot_at)
                self.stats.post(Count(Metric.PROMPT_TOKENS, len(row.prompt)))
                self._active.append(row)
            case Cancel(row_id) | Finish(row_id):
                for row in self._active:
                    if row.id == row_id:
                        row.ask(message)
                        return
                await self.to_decode.send(message)  # already handed over (or gone)
            case Pause() | Backlog():
                await self.to_decode.send(message)  # for decode (only a decoding row pauses)
            case _:
                raise TypeError(f"prefill got an unexpected message: {message!r}")

    async def _end(self, row: Row) -> None:
        """The row ends here: its solo KV goes with its job."""
        await release(
            row, to_emitter=self.to_emitter, to_admission=self.to_admission, announced=False
        )

    async def _drop_ending(self) -> None:
        for row in [r for r in self._active if r.end is not None]:
            self._active.remove(row)
            await self._end(row)
        self._report()

    def _fork(self) -> set[int]:
        """Rows whose prompt equals an earlier row's, not yet started, ride on it
        as its forks (``n`` choices of one request; agents sending one prompt at
        once): the prompt is computed and its last token forwarded once, and each
        fork samples its first token from that forward. Set afresh each turn (a
        fork whose row ended drops out; if the row it rides on ends, the first
        fork leads). Returns the riders' row ids."""
        leads: dict[int, list[Prefill]] = {}  # by prompt length
        riders = set()
        for row in self._active:
            job = row.work
            job.forks = []
            same = leads.get(len(row.prompt), [])
            lead = next((j for j in same if j.prompt == row.prompt), None)
            if self.forks and lead is not None and not job.started:
                lead.forks.append(job)
                job.forget_take()  # it computes nothing: it takes again if it ever leads
                riders.add(row.id)
            else:
                same.append(job)
                leads[len(row.prompt)] = same
        return riders

    async def _turn(self) -> None:
        riders = self._fork()
        for row in self._active:  # arrivals (and joiners released from waiting) take
            if row.id not in riders and not row.work.taken:
                hit = await take(self.to_prompt_cache, row.prompt, row.pin)
                row.work.start_from(hit.caches, hit.cached)
                row.cached_tokens, row.cache_report = row.work.done, hit.report
        min_shared = MIN_SHARED_TOGETHER if self.together else MIN_SHARED
        if self.to_prompt_cache is None:
            min_shared = None
        now = trio.current_time()  # a main agent's prompt first, before its sub-agents'
        ranked = sorted(self._active, key=lambda r: rank_now(r, now, self.aging))
        jobs = [r.work for r in ranked if r.id not in riders]
        plan = plan_turn(jobs, self.step_size, self.together, min_shared)
        by_job = {id(r.work): r for r in self._active}
        try:
            results = await self.gpu.call(prefill_turn, plan)
        except Exception as exc:  # the call never ran (a sharded engine's ranks lost)
            results = [_Done(0, error=exc) for _ in plan]
        for (jobs, _), done in zip(plan, results, strict=True):
            rows = [by_job[id(job)] for job in jobs]
            self.stats.post(Count(Metric.PREFILL_TOKENS, done.tokens))
            for row in rows:
                await self._put_snapshots(row)
            if done.error is None and done.primed is None:
                continue  # more chunks to come
            if len(rows) > 1:
                self.stats.post(Count(Metric.PREFILLED_TOGETHER, len(rows)))
            for lead, fork in [(r, f) for r in rows for f in r.work.forks]:
                rider = by_job[id(fork)]
                rider.cached_tokens, rider.cache_report = lead.cached_tokens, lead.cache_report
                rows.append(rider)
                self.stats.post(Count(Metric.FORKED))
            for row in rows:
                self._active.remove(row)
            if done.error is not None:
                err = done.error
                for row in rows:
                    row.ask_end(
                        End(FinishReason.ERROR, f"prefill failed: {type(err).__name__}: {err}")
                    )
                    await self._end(row)
            else:
                await self._first_tokens(rows, done)
        self._report()

    async def _first_tokens(self, rows: list[Row], done: _Done) -> None:
        """Deliver the rows' first tokens now (time to first token does not wait
        for the join), then hand the primed rows to decode, a :class:`Join` a
        primed batch. A row that ends at its first token (EOS, a stop id,
        max_tokens 1), was cancelled meanwhile, or whose own sampling failed
        never joins."""
        now = trio.current_time()
        out, joins, left = [], [], []
        firsts = iter(zip(rows, done.firsts, strict=True))
        for batch in done.primed:
            group = [next(firsts) for _ in batch.slots]
            joining = False
            for row, first in group:
                row.times.prefill_ended = now
                if row.end is None and first.error is not None:
                    row.ask_end(End(FinishReason.ERROR, first.error))
                    self.stats.post(Count(Metric.ROW_FAULTS))
                if row.end is not None:
                    await self._end(row)
                    continue
                item = TokenOut.accepted(row, first.token, first.logprob, first.top_logprobs)
                out.append(item)
                if not item.ends:
                    row.work = batch
                    row.move(Phase.JOINING)
                    joining = True
                else:
                    row.work = None
                    row.move(Phase.ENDED)
                    left.append(row)
            if joining:
                joins.append(Join(tuple(row for row, _ in group), batch))
        if out:
            await self.to_emitter.send(Tokens(tuple(out)))
        for row in left:
            await self.to_admission.send(Left(row.id))
        for join in joins:
            await self.to_decode.send(join)

    async def _put_snapshots(self, row: Row) -> None:
        job = row.work
        if job is None or not job.snapshots:
            return
        snapshots, job.snapshots = job.snapshots, []
        if self.to_prompt_cache is None:
            return
        for n, caches in snapshots:
            await self.to_prompt_cache.send(
                Put(row.prompt[:n], caches, EntryKind.SYSTEM, session=row.pin)
            )

    def _report(self) -> None:
        nbytes = sum(r.work.nbytes for r in self._active)
        self.stats.post(Gauge(Metric.PREFILL_KV_BYTES, nbytes))
