"""``open_engine``: the actor graph in one nursery, and the embedding API.

    async with open_engine("path/to/model", batch=8) as engine:
        async with engine.submit("Hello", max_tokens=64) as stream:
            async for event in stream:
                ...
        result = await engine.generate("Hello", max_tokens=64)

Mailboxes: engine -> admission -> prefill -> decode / serial -> emitter -> each
request's own channel; every actor posts figures to stats; all mlx work runs on
the GPU actor's thread. See ``docs/engine.md`` for the graph and a row's life.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from . import admission, decode, disk_cache, emitter, prefill, prompt_cache, serial
from .admission import Admission
from .budget import auto_budget
from .constrain import ll_tokenizer
from .decode import Decode
from .emitter import Emitter
from .errors import EngineClosed, InvalidRequest, Overloaded
from .gpu import DeviceLock, Gpu
from .intake import Intake
from .kernels import fused, packed
from .mailbox import Mailbox
from .messages import Enqueue, Refused, Shutdown
from .models.load import ModelInfo, kernels_of, load_draft, load_model
from .prefill import PrefillActor
from .prompt_cache import PromptCacheActor
from .ranks import RankWatch, follow, lead, rank_figures
from .request import Prompt, Request, Result
from .row import Cancel, Phase, Row, RowView, SessionView, sessions, tree, view
from .serial import Serial
from .settings import EngineSettings
from .speculation.drafters import DraftModel
from .speculation.verify import Speculation
from .stats import (
    CompiledFigures,
    Count,
    KvPrecision,
    Metric,
    Mode,
    PackedFigures,
    Stats,
    StatsSnapshot,
)
from .step import warmup
from .stream import RequestStream
from .watchdog import Watchdog, stall_reason

log = logging.getLogger("mlx_nursery.engine")

SHUTDOWN_GRACE_SECONDS = 10.0  # rows in flight get this long to take their terminal event
DISK_FLUSH_SECONDS = 5.0  # then the disk tier's queued writes get this long


@attrs.define(eq=False)
class Engine:
    model: Any
    tokenizer: Any
    info: ModelInfo
    settings: EngineSettings
    intake: Intake
    stats_actor: Stats
    _to_admission: trio.MemorySendChannel
    _admission: Admission  # read only: its refusal, before a row is built
    _gpu: Gpu
    _cache_actor: PromptCacheActor | None = None
    _closed: bool = False
    # Submitted rows, for `live`; a row drops out once nothing else holds it.
    _live: weakref.WeakValueDictionary = attrs.field(factory=weakref.WeakValueDictionary)

    # -- the API ----------------------------------------------------------------

    def submit(self, prompt: Prompt, **params: Any) -> RequestStream:
        """:meth:`submit_request` in keyword form (:meth:`Request.of`): ``params``
        are :class:`SamplingParams` fields (``stop`` may be a string), plus
        ``request_id``, ``session``, ``parent``, ``session_weight`` and
        ``priority`` (a class name or vLLM's integer: ``request.priority_of``)."""
        return self.submit_request(Request.of(prompt, **params))

    def submit_request(self, request: Request) -> RequestStream:
        """Validate and place one request; enter the returned stream to run it.
        Its labels and session stay on the row for dashboards, logs and
        :meth:`cancel_session`. Raises :class:`InvalidRequest` at once for a
        request the engine cannot run, and :class:`Overloaded` while the queue is
        full: that is checked first, so shedding load costs no rendering or
        tokenizing (the stream's ``start`` still asks admission, which refuses
        what arrives as the queue fills)."""
        if self._closed:
            raise EngineClosed("the engine is shutting down and takes no new requests")
        if self._gpu.lost is not None:
            raise EngineClosed(self._gpu.lost)
        refused = self._admission.refusal()
        if refused is not None:
            self.stats_actor.post(Count(Metric.OVERLOADED))
            raise _overloaded(refused)
        try:
            row, receive = self.intake.row(request)
        except InvalidRequest:
            self.stats_actor.post(Count(Metric.REJECTED))
            raise
        self._live[row.id] = row
        return RequestStream(
            self._enqueue, self._cancel, row, row.id, row.params, receive, len(row.prompt)
        )

    def live(self) -> list[RowView]:
        """Every live row (queued, prefilling, decoding, serial), oldest first: a
        read-only view for dashboards (see :func:`row.view`)."""
        now = trio.current_time()
        rows = [r for r in list(self._live.values()) if r.phase is not Phase.ENDED]
        return [view(r, now) for r in sorted(rows, key=lambda r: r.id)]

    def sessions(self) -> list[SessionView]:
        """The live sessions, each with its queued and running rows."""
        return sessions(self.live())

    def cancel_session(self, session: str, reason: str | None = None) -> int:
        """Cancel every queued and running row of ``session`` and of the sessions
        under it (their ``parent``); each ends with its terminal event within a
        step. Returns how many rows were cancelled."""
        live = [r for r in list(self._live.values()) if r.phase is not Phase.ENDED]
        doomed = tree(live, session)
        for row in doomed:
            self._cancel(row.id, reason or f"session {session} was cancelled")
        return len(doomed)

    async def generate(self, prompt: Prompt, **params: Any) -> Result:
        """Run one request to its end; raises :class:`GenerationFailed` on an error event."""
        async with self.submit(prompt, **params) as stream:
            return await stream.result()

    def health(self) -> str | None:
        """None when healthy; else why not (the ranks lost, a GPU call past the
        step timeout)."""
        return self._gpu.lost or stall_reason(self._gpu, self.settings.step_timeout)

    def ranks(self) -> list[dict] | None:
        """Sharded: each rank's figures (pid, host, KV bytes, GPU calls and their
        seconds, the last call's), rank 0 first; None on one rank."""
        leader = self._gpu.replica
        if leader is None:
            return None
        gpu, snap = self._gpu.statistics(), self.stats()
        own = {
            "calls": gpu.calls,
            "busy_seconds": gpu.busy_seconds,
            "step_seconds": gpu.last_seconds,
            "kv_bytes": snap.kv_bytes + snap.prompt_cache_bytes,  # as a follower counts
        }
        return rank_figures(leader, own)

    @property
    def model_id(self) -> str:
        """The served model's public name (a file or directory stem, never a path)."""
        return self.info.id

    def encode(self, prompt: Prompt, **params: Any) -> list[int]:
        """The token ids ``submit`` would run for ``prompt`` (tools rendered in)."""
        return self.intake.prompt(prompt, params)[1]

    def message_at(self, messages: list, position: int, **params: Any) -> int | None:
        """Which chat message holds prompt token ``position`` (e.g. where a prompt
        diverged from the cache): a binary search over rendered prefixes, about
        log2(len(messages)) template renders. None when the template does not
        render a conversation's prefixes as prefixes of it."""

        def start(m: int) -> int:  # where message m starts
            boundary = self.intake.prompt(messages[: m + 1], params)[2] if m else 0
            if boundary is None:
                raise LookupError(m)
            return boundary

        lo, hi = 0, len(messages) - 1
        try:
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if start(mid) <= position:
                    lo = mid
                else:
                    hi = mid - 1
        except (LookupError, InvalidRequest):
            return None
        return lo

    def project(self, tokens: int) -> int:
        """Worst-case KV bytes of one row holding ``tokens`` tokens (the budget's unit)."""
        return self.intake.project(tokens)

    def stats(self) -> StatsSnapshot:
        snapshot = self.stats_actor.snapshot()
        figures = fused.figures_of(self.model)
        if figures is not None:
            snapshot = attrs.evolve(snapshot, compiled=CompiledFigures(
                figures.modules, figures.compiled, figures.plain, figures.traces))  # fmt: skip
        weights = packed.figures_of(self.model)
        if weights is not None:
            snapshot = attrs.evolve(snapshot, packed=PackedFigures(
                weights.modules, weights.bytes, weights.packed, weights.small,
                weights.plain))  # fmt: skip
        if self.intake.vision is not None:
            snapshot = attrs.evolve(snapshot, images=self.intake.vision.figures())
        return snapshot

    @property
    def kv_budget(self) -> int | None:
        return self.intake.budget

    @property
    def steps(self) -> int:
        """Continuous-lane decode steps run so far (as counted by stats)."""
        return self.stats_actor.counter(Metric.STEPS)

    async def wait_step(self, n: int) -> None:
        """Wait until the continuous lane has run ``n`` decode steps: tests and load
        scripts order their events by engine step rather than by sleeping."""
        await self.stats_actor.wait_for(lambda s: s.steps >= n)

    def idle(self) -> bool:
        """No row queued, admitted or decoding, as the stats last saw."""
        return _idle(self.stats())

    async def wait_idle(self) -> None:
        """Wait until no row is queued, admitted or decoding, and every figure is in."""
        await self.stats_actor.wait_for(_idle)

    async def flush_prompt_cache(self, seconds: float = math.inf) -> bool:
        """Wait (up to ``seconds``) until no row runs, the prompt cache has taken
        every ended row's entry, its disk tier has written every queued one, and
        every figure is in. False when time ran out."""
        with trio.move_on_after(seconds):
            await self.wait_idle()
            if self._cache_actor is not None:
                await self._cache_actor.flush()
            await self.stats_actor.wait_for(lambda s: True)
            return True
        return False

    async def close(self, reason: str = "the engine is shutting down") -> None:
        """Stop taking requests, cancel every queued and running row (each gets its
        terminal event, ``cancelled`` with ``reason``) and wait until all have ended."""
        if not self._closed:
            self._closed = True
            await self._to_admission.send(Shutdown(reason))
        await self.wait_idle()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- for RequestStream ------------------------------------------------------------

    async def _enqueue(self, row: Row) -> None:
        if self._closed:
            raise EngineClosed("the engine is shutting down and takes no new requests")
        send, receive = trio.open_memory_channel(1)
        await self._to_admission.send(Enqueue(row, send))
        try:
            with receive:
                answer = await receive.receive()
        except trio.Cancelled:  # admission may have queued it already: no one reads it
            self._cancel(row.id, "the caller left before the request started")
            raise
        if isinstance(answer, Refused):
            raise _overloaded(answer)

    def _cancel(self, row_id: int, reason: str) -> None:
        # When closing, shutdown cancels every row anyway.
        closed = (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError)
        with contextlib.suppress(*closed):
            self._to_admission.send_nowait(Cancel(row_id, reason))


def _overloaded(refused: Refused) -> Overloaded:
    return Overloaded(
        f"the server is busy: {refused.queued} requests are already waiting; "
        f"retry in {math.ceil(refused.retry_after)} s",
        queued=refused.queued,
        retry_after=refused.retry_after,
    )


def _idle(s: StatsSnapshot) -> bool:
    live = s.submitted - (s.finished + s.errored + s.cancelled)
    return not (live or s.active_rows or s.pending_rows or s.decoding_rows or s.kv_bytes)


def _mode(cap: int, batchable: bool) -> Mode:
    if cap <= 1:
        return Mode.OFF
    return Mode.BATCH if batchable else Mode.SERIAL


@asynccontextmanager
async def open_engine(
    model: str | Path | tuple[Any, Any],
    settings: EngineSettings | None = None,
    *,
    group: Any = None,
    device: threading.Lock | DeviceLock | None = None,
    **options: Any,
) -> AsyncIterator[Engine | None]:
    """Start the actor graph in a nursery of its own; yields once every actor runs.

    ``model`` is a path (loaded with ``mlx_lm.load``) or a ``(model, tokenizer)``
    pair. Settings come whole as ``settings`` or as :class:`EngineSettings`
    keywords: ``batch`` caps concurrent rows (1 pins the serial lane),
    ``prefill_step_size``, ``max_tokens`` (a request's default), ``dtype``
    (``auto``: float32 on a CPU device), ``context_length``,
    ``prompt_cache_size`` / ``prompt_cache_bytes`` (0 entries: no cache),
    ``chat_template`` / ``chat_template_args``, and ``kv_budget`` (bytes,
    ``"auto"`` or None: rows queue until they fit, a row that never could is
    refused, the prompt cache gets what is left), ``speculative`` /
    ``draft_tokens`` / ``draft_model`` (docs/speculative.md), ``kv_bits`` /
    ``kv_group_size`` / ``quantized_kv_start`` (docs/quantized-kv.md). On exit,
    rows still in flight are cancelled and each gets its terminal event.

    ``group`` (an ``mx.distributed`` group, under ``mlx.launch``) shards the
    engine across its ranks; every rank calls ``open_engine`` alike. Rank 0
    yields the engine; any other rank follows rank 0's GPU calls on its shard
    until rank 0's engine closes, then yields None (see ``docs/scale-out.md``).

    ``device`` (a ``threading.Lock``, or a :class:`gpu.DeviceLock` to share it with
    other processes) is shared by engines serving several models: their steps
    take turns, never running a forward at once; loading runs beside them (see
    ``docs/models.md``).
    """
    if settings is None:
        settings = EngineSettings(**options)
    elif options:
        settings = attrs.evolve(settings, **options)
    gpu = Gpu(device=device)
    gpu.start()
    try:
        loaded = await _load(gpu, model, settings, group)
        if loaded is None:  # a follower rank: it followed rank 0 until that one closed
            yield None
            return
        if loaded.settings.warmup and not loaded.sharded:
            await _warm_up(gpu, loaded)
        engine, actors = await _build(gpu, loaded)
        async with _running(actors) as actors_scope:
            try:
                yield engine
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(SHUTDOWN_GRACE_SECONDS):
                    await engine.close()
                with trio.CancelScope(shield=True):
                    cache_actor = engine._cache_actor
                    if cache_actor and not await cache_actor.flush(DISK_FLUSH_SECONDS):
                        log.warning("prompt cache: shut down with disk writes still queued")
                actors_scope.cancel()
    finally:
        await gpu.stop()


@attrs.frozen
class _Loaded:
    """A loaded model and what the engine is built from: the settings as this
    rank runs them, the draft model (or None), whether it leads other ranks."""

    model: Any
    tokenizer: Any
    info: ModelInfo
    settings: EngineSettings
    draft: DraftModel | None
    sharded: bool


async def _load(
    gpu: Gpu, model: str | Path | tuple[Any, Any], settings: EngineSettings, group: Any
) -> _Loaded | None:
    """Load the model (its shard, under ``group``) and the draft model. A rank
    other than 0 follows rank 0's GPU calls here until rank 0 closes: None."""
    sharded = group is not None and group.size() > 1
    if sharded and settings.kv is not None:
        raise InvalidRequest(
            "--kv-bits is not served across ranks yet (followers keep float KV): run the "
            "sharded engine without it", param="kv_bits",
        )  # fmt: skip
    kernels = kernels_of(settings)
    loaded, tokenizer, info = await gpu.call_loading(functools.partial(
        load_model, model, settings.dtype, group, kernels=kernels,
        trust_remote_code=settings.trust_remote_code, kv=settings.kv))  # fmt: skip
    if sharded and group.rank() != 0:
        await gpu.call_here(follow, loaded, group)
        return None
    if sharded:
        gpu.replica = await gpu.call_here(lead, loaded, group)
        # Followers do not mirror a paused row's one-row batch (yet): never pause.
        # Nor a verify step (drafts and what was kept are rank 0's): never draft.
        settings = attrs.evolve(settings, pause_after=None, speculative=False)
    if settings.context_length is not None:
        info = attrs.evolve(info, context_length=settings.context_length)
    draft = None
    if settings.draft_model is not None and settings.speculative:
        draft, drafts = await gpu.call_loading(
            load_draft, settings.draft_model, settings.dtype, tokenizer, info, kernels)
        # a row's budget holds its draft KV too (whether or not it drafts)
        info = attrs.evolve(
            info, kv_costs=info.kv_costs + drafts.kv_costs,
            weights_bytes=info.weights_bytes + drafts.weights_bytes,
        )  # fmt: skip
    return _Loaded(loaded, tokenizer, info, settings, draft, sharded)


async def _warm_up(gpu: Gpu, loaded: _Loaded) -> None:
    """A first request's shapes run once before any request (``step.warmup``)."""
    settings = loaded.settings
    batching = _mode(settings.batch, loaded.info.batchable) is Mode.BATCH
    rows = min(settings.batch, warmup.MAX_ROWS) if batching else 1
    t0 = trio.current_time()
    try:
        steps = await gpu.call(
            warmup.warm_up, loaded.model, loaded.tokenizer, rows, settings.prefill_step_size,
            settings.kv,
        )  # fmt: skip
    except Exception as exc:  # its scratch state only: requests will meet their own errors
        log.warning("warm-up failed, serving unwarmed: %s: %s", type(exc).__name__, exc)
        return
    log.info("warmed up in %.2f s (%d decode steps, up to %d rows)",
             trio.current_time() - t0, steps, rows)  # fmt: skip


async def _build(gpu: Gpu, loaded: _Loaded) -> tuple[Engine, list[Any]]:
    """The engine and its actors (not yet running), around a loaded model: the KV
    budget, the stats, the disk tier, every mailbox and actor, the intake."""
    settings, info = loaded.settings, loaded.info
    budget = settings.kv_budget
    if budget == "auto":
        budget = auto_budget(info.weights_bytes)
    stats = Stats(
        configured=settings.batch, mode=_mode(settings.batch, info.batchable),
        kv_budget_bytes=budget, kv_precision=_precision(settings, info),
    )  # fmt: skip
    disk = None
    if settings.prompt_cache_size and settings.prompt_cache_disk != 0 and not loaded.sharded:
        disk = await disk_cache.open_tier(
            gpu, loaded.model, info.id, settings.prompt_cache_dir, settings.prompt_cache_disk,
            settings.kv,
        )  # fmt: skip
    actors, to_admission, admitter = _wire(loaded, budget, gpu, stats, disk)
    if loaded.sharded:
        actors.append(RankWatch(gpu.replica, gpu))
    # host-side and long for a large vocabulary (seconds): off the shared device lock
    ll_tok = await gpu.call_loading(ll_tokenizer, loaded.tokenizer, info.vocab_size)
    intake = Intake(loaded.tokenizer, info, settings, budget, ll_tok,
                    vision=getattr(loaded.model, "vision", None))  # fmt: skip
    cache_actor = next((a for a in actors if isinstance(a, PromptCacheActor)), None)
    engine = Engine(
        loaded.model, loaded.tokenizer, info, settings, intake, stats, to_admission, admitter,
        gpu, cache_actor,
    )  # fmt: skip
    return engine, actors


def _precision(settings: EngineSettings, info: ModelInfo) -> KvPrecision:
    """The KV's precision and its bytes per token, from the model's probe: a
    quantized token where the layer would be quantized, else a float one."""
    floats = sum(c.per_token for c in info.kv_costs)
    kv = settings.kv
    if kv is None:
        return KvPrecision(None, None, None, floats, floats)
    token = sum(c.token_bytes for c in info.kv_costs)
    return KvPrecision(kv.bits, kv.group_size, kv.start, token, floats)


@attrs.frozen
class _Boxes:
    """Every actor's mailbox, opened before any actor is built (the prompt
    cache's only where there is one)."""

    adm: Mailbox
    pre: Mailbox
    dec: Mailbox
    ser: Mailbox
    emit: Mailbox
    cache: Mailbox | None

    @classmethod
    def open(cls, settings: EngineSettings) -> _Boxes:
        cache = Mailbox.open(prompt_cache.MAILBOX_SIZE) if settings.prompt_cache_size else None
        return cls(
            Mailbox.open(admission.MAILBOX_SIZE),
            Mailbox.open(prefill.MAILBOX_SIZE),
            Mailbox.open(decode.MAILBOX_SIZE),
            Mailbox.open(serial.MAILBOX_SIZE),
            Mailbox.open(emitter.MAILBOX_SIZE),
            cache,
        )

    def to_cache(self) -> trio.MemorySendChannel | None:
        return self.cache.clone() if self.cache is not None else None

    def ends(self) -> dict[str, Any]:
        """What every row owner sends to, each end its own clone."""
        return {
            "to_emitter": self.emit.clone(),
            "to_admission": self.adm.clone(),
            "to_prompt_cache": self.to_cache(),
        }

    def close_originals(self) -> None:
        """Every original send end but admission's (the engine keeps that one)."""
        for box in (self.pre, self.dec, self.ser, self.emit, self.cache):
            if box is not None:
                box.send.close()


def _admission(
    settings: EngineSettings, budget: int | None, gpu: Gpu, stats: Stats, boxes: _Boxes
) -> Admission:
    """The admission actor, on its ends: it sends rows to prefill and serial, ends
    queued ones itself, and trims the prompt cache's share."""
    return Admission(
        settings.batch,
        budget,
        gpu,
        stats,
        inbox=boxes.adm.inbox,
        to_prefill=boxes.pre.clone(),
        to_serial=boxes.ser.clone(),
        to_emitter=boxes.emit.clone(),
        to_prompt_cache=boxes.to_cache(),
        max_queued=settings.queue_limit,
        queue_timeout=settings.queue_timeout,
        pause_after=settings.pause_after,
        aging=settings.priority_aging,
        room=settings.priority_room,
    )


def _wire(
    loaded: _Loaded,
    budget: int | None,
    gpu: Gpu,
    stats: Stats,
    disk: disk_cache.DiskTier | None = None,
) -> tuple[list[Any], trio.MemorySendChannel, Admission]:
    """Open every mailbox, then build each actor with its ends, in one pass. Each
    producer gets its own clone of a send end and closes it when it stops; the
    originals are closed here, but admission's, which the engine keeps (with
    the admission actor, whose refusal it reads)."""
    model, info, settings = loaded.model, loaded.info, loaded.settings
    boxes = _Boxes.open(settings)
    steps = settings.prefill_step_size
    speculation = None
    if settings.speculative:
        speculation = Speculation(
            settings.draft_tokens, draft=loaded.draft, library=settings.cpu_softmax
        )
    admitter = _admission(settings, budget, gpu, stats, boxes)
    emitter_actor = Emitter(
        loaded.tokenizer,
        stats,
        inbox=boxes.emit.inbox,
        to_admission=boxes.adm.clone(),
        think=info.think,
    )
    actors: list[Any] = [
        stats,
        emitter_actor,
        Decode(
            model,
            gpu,
            stats,
            inbox=boxes.dec.inbox,
            speculation=speculation,
            kv=settings.kv,
            pipeline=settings.pipeline,
            **boxes.ends(),
        ),
        Serial(model, gpu, stats, steps, inbox=boxes.ser.inbox, kv=settings.kv, **boxes.ends()),
        PrefillActor(
            model,
            gpu,
            stats,
            steps,
            inbox=boxes.pre.inbox,
            to_decode=boxes.dec.clone(),
            # under --kv-bits, rows that quantize at their prompt's end (a start of 0)
            together=info.padded_prefill and (settings.kv is None or settings.kv.start == 0),
            kv=settings.kv,
            forks=not loaded.sharded,
            aging=settings.priority_aging,
            **boxes.ends(),
        ),
        admitter,
        Watchdog(gpu, stats, settings.step_timeout),
    ]
    if boxes.cache is not None:
        # The cache lives inside the budget: it starts with all of it, and admission
        # lowers its share as live rows take some (Trim).
        cap = min(settings.prompt_cache_bytes or 1 << 62, 1 << 62 if budget is None else budget)
        actors.insert(
            1,
            PromptCacheActor(gpu, stats, boxes.cache.inbox, settings.prompt_cache_size, cap, disk),
        )
    boxes.close_originals()
    return actors, boxes.adm.send, admitter


@asynccontextmanager
async def _running(actors: list[Any]) -> AsyncIterator[trio.CancelScope]:
    """Run the actors shielded from the caller's cancellation: a caller cancelled
    from outside still gets a graceful shutdown (every row its terminal event);
    the returned scope then cancels them on purpose."""
    scope = trio.CancelScope(shield=True)

    async def run_actors(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                for actor in actors:
                    await nursery.start(actor.run)
                task_status.started()

    async with trio.open_nursery() as nursery:
        await nursery.start(run_actors)
        yield scope
