"""The decode-step actor: owns the running batch and steps it.

Between steps it joins primed rows (adopt, merge or extend by cache kind: see
``rows.Batch.join``) and evicts rows that finished or were cancelled (``filter``),
all inside one GPU call with the next pipelined step. Finish by EOS, stop token
or ``max_tokens`` is decided here, per token, by :func:`finish_reason`; text and
stop strings are the emitter's. A fault in the step cannot be blamed on one row:
every row in the batch gets the error, the batch KV is dropped, and decoding goes
on with whatever joins next.
"""

from __future__ import annotations

import contextlib
from typing import Any

import attrs
import trio

from .admission import Cancel, Left
from .decode_rules import PUT_MIN_PROMPT, finish_reason
from .emitter import Terminal, TokenOut, Tokens
from .gpu import Gpu
from .prefill import Join
from .prompt_cache import Put
from .request import Row
from .rows import Batch, Sampled
from .stats import Count, Gauge, Observe, Stats

MAILBOX_SIZE = 4096
CLEAR_CACHE_EVERY = 256  # steps between mx.clear_cache(), as generate_step does


@attrs.frozen
class StepResult:
    sampled: list[Sampled]
    kv_bytes: int
    padding_waste: float
    seconds: float


def _leave(batch: Batch, keep: list[int], save: list[int]) -> tuple[list[list[Any]], int, float]:
    """Rows not in ``keep`` leave the batch; ``save`` rows' caches come back first
    (a lone row's own caches, else extracted from the batch). GPU thread."""
    if save and not batch.batched:
        saved = [batch.caches]  # the lone row's own caches: no copy
    else:
        saved = [[c.extract(i) for c in batch.caches] for i in save]
    batch.filter(keep)
    return saved, batch.nbytes, batch.padding_waste()


def _advance(batch: Batch, joiners: list[Batch], step: int) -> StepResult:
    """One GPU turn: join, then step (GPU thread)."""
    import time

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
    eos: frozenset[int]
    to_emitter: trio.MemorySendChannel
    to_admission: trio.MemorySendChannel
    to_prompt_cache: trio.MemorySendChannel | None = None
    send: trio.MemorySendChannel = attrs.field(init=False)
    _receive: trio.MemoryReceiveChannel = attrs.field(init=False)
    _batch: Batch = attrs.field(init=False)
    _rows: list[Row] = attrs.field(factory=list, init=False)  # batch order, as in _batch
    _joining: list[Join] = attrs.field(factory=list, init=False)
    _leaving: dict[int, str | None] = attrs.field(factory=dict, init=False)  # id -> cancel reason
    _steps: int = attrs.field(default=0, init=False)  # GPU turns taken
    steps_done: int = attrs.field(default=0, init=False)  # turns that stepped at least one row
    _tokens: dict[int, list[int]] = attrs.field(factory=dict, init=False)  # read per row
    _first_pending: set[int] = attrs.field(factory=set, init=False)  # joined, token 0 unread
    _stepped: trio.Event = attrs.field(factory=trio.Event, init=False)  # set after each step

    def __attrs_post_init__(self) -> None:
        self.send, self._receive = trio.open_memory_channel(MAILBOX_SIZE)
        self._batch = Batch(self.model)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        cache = self.to_prompt_cache or contextlib.nullcontext()
        with self._receive, self.to_emitter, self.to_admission, cache:
            task_status.started()
            while True:
                if not self._rows and not self._joining:
                    self._take(await self._receive.receive())
                self._drain()
                await self._turn()

    def _drain(self) -> None:
        while True:
            try:
                self._take(self._receive.receive_nowait())
            except trio.WouldBlock:
                return

    def _take(self, message: Join | Cancel) -> None:
        match message:
            case Join(row, _, first_token):
                self._joining.append(message)
                self._tokens[row.id] = [first_token]
                self._first_pending.add(row.id)
            case Cancel(row_id, reason):
                if any(r.id == row_id for r in self._rows):
                    self._leaving.setdefault(row_id, reason)
                for join in self._joining:
                    if join.row.id == row_id:
                        self._leaving.setdefault(row_id, reason)
                # unknown id: the row already left; a repeated cancel is a no-op
            case _:
                raise TypeError(f"decode got an unexpected message: {message!r}")

    async def _turn(self) -> None:
        if self._leaving:
            await self._leave()
        joins, self._joining = self._joining, []
        if not joins and not self._rows:
            return
        self._rows.extend(j.row for j in joins)
        self._steps += 1
        try:
            result = await self.gpu.call(
                _advance, self._batch, [j.joiner for j in joins], self._steps
            )
        except Exception as exc:
            await self._fault(exc)
            return
        self._report(result)
        await self._emit(result.sampled)
        if result.sampled:
            self.steps_done += 1
            self._stepped.set()
            self._stepped = trio.Event()

    async def _leave(self) -> None:
        """Rows marked leaving go now: cancelled ones get their terminal event, every
        one's slot goes back to admission, and (with a prompt cache) each one's KV
        is handed to it before its slot is free."""
        leaving, self._leaving = self._leaving, {}
        # A row cancelled while it waited to join never enters the batch.
        dropped = [j.row for j in self._joining if j.row.id in leaving]
        self._joining = [j for j in self._joining if j.row.id not in leaving]
        order = self._rows
        gone = [r for r in order if r.id in leaving]
        self._rows = [r for r in order if r.id not in leaving]
        if gone:
            keep = [i for i, r in enumerate(order) if r.id not in leaving]
            save = []
            if self.to_prompt_cache is not None:
                save = [
                    i
                    for i, r in enumerate(order)
                    if r.id in leaving and len(r.prompt) >= PUT_MIN_PROMPT
                ]
            try:
                saved, kv_bytes, waste = await self.gpu.call(_leave, self._batch, keep, save)
            except Exception as exc:
                await self._fault(exc, gone + dropped, leaving)
                return
            for i, caches in zip(save, saved, strict=True):
                row = order[i]
                key = row.prompt + self._tokens.get(row.id, [])
                await self.to_prompt_cache.send(Put(key, caches, "assistant"))
            self.stats.post(
                Gauge("batch_kv_bytes", kv_bytes),
                Gauge("decoding_rows", len(self._rows)),
                Gauge("padding_waste", waste),
            )
        for row in gone + dropped:
            self._tokens.pop(row.id, None)
            self._first_pending.discard(row.id)
            if leaving[row.id] is not None:
                await self.to_emitter.send(Terminal(row, "cancelled", leaving[row.id]))
            await self.to_admission.send(Left(row.id))

    async def wait_steps(self, n: int) -> None:
        """Wait until ``n`` decode steps have run since the engine started (for scripts)."""
        while self.steps_done < n:
            await self._stepped.wait()

    def _report(self, result: StepResult) -> None:
        figures = [
            Gauge("batch_kv_bytes", result.kv_bytes),
            Gauge("decoding_rows", len(self._rows)),
            Gauge("padding_waste", result.padding_waste),
        ]
        if result.sampled:
            figures += [Count("steps"), Observe("step_time", result.seconds)]
        self.stats.post(*figures)

    async def _emit(self, sampled: list[Sampled]) -> None:
        out = []
        by_id = {r.id: r for r in self._rows}
        for s in sampled:
            row = by_id[s.row_id]
            if row.id in self._first_pending:  # the first token, delivered by prefill
                self._first_pending.discard(row.id)
                continue
            tokens = self._tokens.setdefault(row.id, [])
            tokens.append(s.token)  # read = fed: exactly what the row's KV holds
            reason = finish_reason(row, s.token, len(tokens), self.eos)
            shown = None if reason == "stop" else s.token  # EOS and stop ids are never shown
            out.append(TokenOut(row, shown, s.logprob, s.top_logprobs, reason))
            if reason is not None:
                self._leaving[row.id] = None
        if self._leaving:
            # Finished rows leave before their last event goes out: their KV is in
            # the prompt cache and their slot free by the time a client can follow up.
            await self._leave()
        if out:
            await self.to_emitter.send(Tokens(tuple(out)))

    async def _fault(
        self, exc: Exception, gone: list[Row] = (), leaving: dict | None = None
    ) -> None:
        """The step failed: every row in it fails, and the batch starts over empty."""
        message = f"batch step failed: {type(exc).__name__}: {exc}"
        self.stats.post(Count("batch_faults"))
        rows, self._rows = self._rows, []
        self._batch = Batch(self.model)
        for row in rows:
            self._tokens.pop(row.id, None)
            self._first_pending.discard(row.id)
            await self.to_emitter.send(Terminal(row, "error", message))
            await self.to_admission.send(Left(row.id))
        for row in gone:
            reason = (leaving or {}).get(row.id)
            if reason is not None:
                await self.to_emitter.send(Terminal(row, "cancelled", reason))
            await self.to_admission.send(Left(row.id))
        self._report(StepResult([], 0, 0.0, 0.0))
