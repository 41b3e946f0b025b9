"""The stats actor: counters, gauges and histograms fed by every other actor.

Actors post with ``stats.post(...)``, which never blocks: the mailbox is large,
and a post that would block is counted as dropped rather than waited for. The
actor serves frozen snapshots (``snapshot()``) for ``engine.stats()``, ``/stats``
and ``/metrics``.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Callable

import attrs
import trio

from .request import Priority

MAILBOX_SIZE = 65536

# Bucket upper bounds in seconds, Prometheus style (the last bucket is +Inf).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class Kind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class Metric(enum.Enum):
    """Every figure the stats actor keeps: its kind, its name in ``/metrics``
    (None: kept for the snapshot only) and its help text. Posting a name that is
    not here fails at import, not inside a running actor."""

    # counters
    SUBMITTED = (Kind.COUNTER, "requests_submitted", "Requests admitted to the engine.")
    FINISHED = (Kind.COUNTER, "requests_finished", "Requests that ended with stop or length.")
    ERRORED = (Kind.COUNTER, "requests_errored", "Requests that ended in an error.")
    CANCELLED = (Kind.COUNTER, "requests_cancelled", "Requests cancelled (client gone, shutdown).")
    REJECTED = (Kind.COUNTER, "requests_rejected", "Requests refused at submit as invalid.")
    STEPS = (Kind.COUNTER, "decode_steps", "Continuous-lane decode steps.")
    PROMPT_TOKENS = (Kind.COUNTER, "prompt_tokens", "Prompt tokens of admitted requests.")
    PREFILL_TOKENS = (Kind.COUNTER, "prefill_tokens", "Prompt tokens actually computed.")
    GENERATED_TOKENS = (Kind.COUNTER, "generated_tokens", "Tokens delivered to clients.")
    BATCH_FAULTS = (Kind.COUNTER, "batch_faults", "Batch steps that failed (every row errored).")
    ROW_FAULTS = (
        Kind.COUNTER, "row_faults", "Rows ended by a fault in their own work (batch went on)."
    )
    DROPPED_STATS = (Kind.COUNTER, None, "Stats posts dropped: the stats mailbox was full.")
    OVERLOADED = (
        Kind.COUNTER, "requests_overloaded", "Requests refused with 429: the queue was full."
    )
    QUEUE_TIMEOUTS = (
        Kind.COUNTER, "queue_timeouts", "Requests that waited past the queue timeout."
    )
    STALLS = (Kind.COUNTER, "gpu_stalls", "GPU calls that ran past the step timeout.")
    PROMPT_CACHE_HITS = (
        Kind.COUNTER, "prompt_cache_hits", "Prompt-cache takes that found a prefix."
    )
    PROMPT_CACHE_MISSES = (
        Kind.COUNTER, "prompt_cache_misses", "Prompt-cache takes that found none."
    )
    PROMPT_CACHE_HIT_TOKENS = (
        Kind.COUNTER, "prompt_cache_hit_tokens", "Prompt tokens served cached."
    )
    PROMPT_CACHE_EVICTIONS = (
        Kind.COUNTER, "prompt_cache_evictions", "Prompt-cache entries evicted from memory."
    )
    PROMPT_CACHE_DISK_HITS = (
        Kind.COUNTER, "prompt_cache_disk_hits", "Prompt-cache takes served from the disk tier."
    )
    PROMPT_CACHE_DISK_READ_BYTES = (
        Kind.COUNTER, "prompt_cache_disk_read_bytes", "Bytes loaded from the disk tier."
    )
    PROMPT_CACHE_DISK_WRITES = (
        Kind.COUNTER, "prompt_cache_disk_writes", "Entries written to the disk tier."
    )
    PROMPT_CACHE_DISK_WRITE_BYTES = (
        Kind.COUNTER, "prompt_cache_disk_write_bytes", "Bytes written to the disk tier."
    )
    PROMPT_CACHE_DISK_EVICTIONS = (
        Kind.COUNTER, "prompt_cache_disk_evictions",
        "Disk-tier files removed: past the size cap, or held whole by a longer entry.",
    )  # fmt: skip
    PROMPT_CACHE_DISK_BAD = (
        Kind.COUNTER, "prompt_cache_disk_bad_files",
        "Disk-tier files skipped and removed: truncated, corrupt or another model's.",
    )  # fmt: skip
    PROMPT_CACHE_DISK_DROPPED = (
        Kind.COUNTER, "prompt_cache_disk_dropped",
        "Entries not written: the write queue was full, the entry over the cap, or a write failed.",
    )  # fmt: skip
    PREFILLED_TOGETHER = (
        Kind.COUNTER, "prefilled_together", "Rows prefilled in one padded batch."
    )
    FORKED = (
        Kind.COUNTER, "forked", "Rows that rode on another row's prefill of the same prompt."
    )
    KV_COPIED_BYTES = (
        Kind.COUNTER, "kv_copied_bytes", "KV bytes copied by batch joins and leaves."
    )
    REFILLED = (Kind.COUNTER, "joins_in_place", "Joiners written over a retired batch slot.")
    PAUSED = (
        Kind.COUNTER, "rows_paused",
        "Decoding rows paused (KV kept) to give their slot to a session below its share.",
    )  # fmt: skip
    RESUMED = (Kind.COUNTER, "rows_resumed", "Paused rows that rejoined the batch.")
    # speculative decoding (actors/speculation/), by drafter
    DRAFTED_PROMPT = (
        Kind.COUNTER, "draft_tokens_prompt", "Draft tokens proposed by prompt lookup."
    )
    ACCEPTED_PROMPT = (
        Kind.COUNTER, "draft_accepted_prompt", "Prompt-lookup draft tokens kept."
    )
    DRAFTED_SUFFIX = (
        Kind.COUNTER, "draft_tokens_suffix", "Draft tokens proposed by the shared suffix index."
    )
    ACCEPTED_SUFFIX = (
        Kind.COUNTER, "draft_accepted_suffix", "Shared-suffix-index draft tokens kept."
    )
    DRAFTED_MODEL = (
        Kind.COUNTER, "draft_tokens_model", "Draft tokens proposed by the draft model."
    )
    ACCEPTED_MODEL = (Kind.COUNTER, "draft_accepted_model", "Draft-model tokens kept.")
    VERIFY_STEPS = (
        Kind.COUNTER, "verify_steps", "Decode steps that verified draft tokens."
    )
    DECODE_TOKENS = (
        Kind.COUNTER, "decode_tokens", "Tokens read by continuous-lane decode steps."
    )
    ROW_FORWARDS = (
        Kind.COUNTER, "row_forwards", "Rows read per decode step, summed over steps."
    )
    # gauges (each has one writer: admission the rows, decode batch_*, prefill
    # prefill_*, serial serial_*)
    ACTIVE_ROWS = (Kind.GAUGE, "active_rows", "Requests admitted and not finished.")
    PENDING_ROWS = (Kind.GAUGE, "pending_rows", "Requests queued for admission.")
    PAUSED_ROWS = (Kind.GAUGE, "paused_rows", "Paused rows waiting to resume (in pending_rows).")
    DECODING_ROWS = (Kind.GAUGE, "decoding_rows", "Rows in the continuous batch.")
    BATCH_KV_BYTES = (Kind.GAUGE, None, "KV bytes of the continuous batch.")
    BATCH_KV_TOKENS = (
        Kind.GAUGE, "batch_kv_tokens", "Tokens the continuous batch's rows hold in their KV."
    )
    PREFILL_KV_BYTES = (Kind.GAUGE, None, "KV bytes of the prefills in flight.")
    SERIAL_KV_BYTES = (Kind.GAUGE, None, "KV bytes of the serial lane's row.")
    PAUSED_KV_BYTES = (Kind.GAUGE, None, "KV bytes the paused rows keep.")
    PADDING_WASTE = (
        Kind.GAUGE, "padding_waste_ratio", "Fraction of the batch KV width that is padding."
    )
    PROMPT_CACHE_ENTRIES = (Kind.GAUGE, "prompt_cache_entries", "Prompt-cache entries.")
    PROMPT_CACHE_BYTES = (Kind.GAUGE, "prompt_cache_bytes", "Prompt-cache bytes.")
    PROMPT_CACHE_CEILING = (
        Kind.GAUGE, "prompt_cache_ceiling_bytes",
        "Most bytes the prompt cache may hold now: its cap, or what the budget leaves.",
    )  # fmt: skip
    PROMPT_CACHE_DISK_ENTRIES = (
        Kind.GAUGE, "prompt_cache_disk_entries", "Disk-tier entries."
    )
    PROMPT_CACHE_DISK_BYTES = (Kind.GAUGE, "prompt_cache_disk_bytes", "Disk-tier bytes.")
    PROMPT_CACHE_DISK_CAP = (
        Kind.GAUGE, "prompt_cache_disk_cap_bytes", "The disk tier's size cap (0: off)."
    )
    PROMPT_CACHE_DISK_PENDING = (
        Kind.GAUGE, "prompt_cache_disk_pending", "Entries waiting to be written to disk."
    )
    KV_PROJECTED_BYTES = (
        Kind.GAUGE, "kv_projected_bytes", "Worst-case KV of the admitted rows."
    )
    QUEUE_OLDEST_WAIT = (
        Kind.GAUGE, "queue_oldest_wait_seconds", "How long the oldest queued request has waited."
    )
    # histograms
    TIME_TO_FIRST_TOKEN = (Kind.HISTOGRAM, "time_to_first_token_seconds", "Submit to first token.")
    QUEUE_WAIT = (Kind.HISTOGRAM, "queue_wait_seconds", "Submit to admission.")
    STEP_TIME = (Kind.HISTOGRAM, "decode_step_seconds", "GPU time of one continuous-lane step.")
    # a plain decode step by phase (docs/batching.md, "The host's share")
    HOST_BUILD = (
        Kind.HISTOGRAM, "decode_host_build_seconds",
        "A decode step's graph built and started on the GPU thread.",
    )  # fmt: skip
    DEVICE_WAIT = (
        Kind.HISTOGRAM, "decode_device_wait_seconds",
        "A decode step's one wait on the device, for the step before.",
    )  # fmt: skip
    HOST_READ = (
        Kind.HISTOGRAM, "decode_host_read_seconds",
        "A decode step's tokens, logprobs and rows read on the GPU thread.",
    )  # fmt: skip
    HANDOFF = (
        Kind.HISTOGRAM, "decode_handoff_seconds",
        "A decode step handed to the GPU thread and its result back to the event loop.",
    )  # fmt: skip
    LOOP_TURN = (
        Kind.HISTOGRAM, "decode_loop_seconds",
        "The event loop's turn between two decode steps (emitting, ends, stats).",
    )  # fmt: skip
    PROMPT_CACHE_DISK_LOAD_TIME = (
        Kind.HISTOGRAM, "prompt_cache_disk_load_seconds",
        "Time to check and load one disk-tier entry.",
    )  # fmt: skip

    def __init__(self, kind: Kind, exposed: str | None, help: str) -> None:
        self.kind, self.exposed, self.help = kind, exposed, help

    @property
    def key(self) -> str:
        """Its field in :class:`StatsSnapshot`."""
        return self.name.lower()


def of_kind(kind: Kind) -> tuple[Metric, ...]:
    return tuple(m for m in Metric if m.kind is kind)


class Mode(enum.StrEnum):
    """How the engine places rows."""

    OFF = "off"  # --batch 1: every row on the serial lane
    SERIAL = "serial"  # the model's caches cannot batch: the serial lane
    BATCH = "batch"  # the continuous batch


@attrs.frozen
class Count:
    name: Metric
    n: int = 1


@attrs.frozen
class Gauge:
    name: Metric
    value: float


@attrs.frozen
class Observe:
    name: Metric
    value: float


@attrs.frozen
class ByClass:
    """A figure of one request class (``request.Priority``): ``field`` is one of
    :class:`ClassFigures`' (``queued`` and ``running`` are set, ``tokens`` added
    to, ``queue_wait`` observed)."""

    klass: Priority
    field: str
    value: float


@attrs.frozen
class HistogramSnapshot:
    buckets: tuple[float, ...]  # upper bounds, +Inf implied last
    counts: tuple[int, ...]  # per bucket, not cumulative; len(buckets) + 1
    count: int
    sum: float

    def quantile(self, q: float) -> float | None:
        """Upper bound of the bucket holding the q-quantile (None when empty)."""
        if not self.count:
            return None
        target, seen = q * self.count, 0
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            seen += n
            if seen >= target:
                return bound
        return math.inf


@attrs.define
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = attrs.field(init=False)
    count: int = 0
    sum: float = 0.0

    def __attrs_post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.count += 1
        self.sum += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.buckets, tuple(self.counts), self.count, self.sum)


@attrs.frozen
class ClassFigures:
    """One request class's figures (``/stats`` ``classes``, ``/metrics`` by class)."""

    queued: int  # rows waiting for a slot now (paused ones included)
    running: int  # rows admitted now
    tokens: int  # tokens delivered to clients
    queue_wait: HistogramSnapshot  # seconds from submit to admission (paused rows: not again)


@attrs.define
class _ClassTally:
    queued: int = 0
    running: int = 0
    tokens: int = 0
    queue_wait: Histogram = attrs.Factory(Histogram)

    def apply(self, field: str, value: float) -> None:
        if field == "queue_wait":
            self.queue_wait.observe(value)
        elif field == "tokens":
            self.tokens += int(value)
        elif field in ("queued", "running"):
            setattr(self, field, int(value))
        else:
            raise ValueError(f"no class figure {field!r}")

    def snapshot(self) -> ClassFigures:
        return ClassFigures(self.queued, self.running, self.tokens, self.queue_wait.snapshot())


COUNTERS = of_kind(Kind.COUNTER)
GAUGES = of_kind(Kind.GAUGE)
HISTOGRAMS = of_kind(Kind.HISTOGRAM)


@attrs.frozen
class KvPrecision:
    """The KV's precision and what a token of it costs (summed over the layers,
    from the model's probe): ``bits`` None is float KV in the model's dtype."""

    bits: int | None
    group_size: int | None
    start: int | None  # a row is quantized once it holds this many tokens
    token_bytes: float  # a token's KV at this precision
    float_token_bytes: float  # the same token's KV in float

    @property
    def name(self) -> str:
        return "float" if self.bits is None else f"{self.bits}-bit"


@attrs.frozen
class CompiledFigures:
    """The decode steps' blocks under ``mx.compile`` (``--compile``; ``kernels.fused``)."""

    modules: int  # the model's norms and RoPE that run compiled in decode steps
    calls: int  # their calls that ran compiled (one position a row)
    plain_calls: int  # their calls at other shapes: prefill chunks, verify steps
    recompiles: int  # traces: one a block and input shape (batch size, heads) seen

    @property
    def share(self) -> float:
        """The share of those blocks' calls that ran compiled."""
        calls = self.calls + self.plain_calls
        return self.calls / calls if calls else 0.0


@attrs.frozen
class ImageFigures:
    """A vision model's images (``models.vision``; docs/vision.md)."""

    family: str  # the vision family served
    encoded: int  # images through the vision tower
    encode_seconds: float  # their time there
    hits: int  # images whose embeddings were kept (the tower spared)
    held: int  # images kept for rows still to prefill them
    kept_embeddings: int  # images whose embeddings are kept


@attrs.frozen
class PackedFigures:
    """The products read from packed weights (``--packed-weights``; ``kernels.packed``)."""

    modules: int  # the model's products routed to the extension at some row counts
    bytes: int  # the bytes of their packed copies
    calls: int  # calls that ran from the panels (a decode step's few rows)
    small_calls: int  # calls with the small-matrix kernel's sums, the weight in place
    plain_calls: int  # calls on mlx's matmul: prefill chunks, row counts not routed

    @property
    def share(self) -> float:
        """The share of those products' calls that ran in the extension."""
        calls = self.calls + self.small_calls + self.plain_calls
        return (self.calls + self.small_calls) / calls if calls else 0.0


@attrs.frozen
class HostFigures:
    """The plain decode steps by phase, in ms, means since start: on the GPU
    thread building the graph, waiting on the device, reading the step; the
    hand-off to the thread and back; the event loop's turn between two steps.
    All but the wait is the host's."""

    steps: int
    build_ms: float
    wait_ms: float
    read_ms: float
    handoff_ms: float
    loop_ms: float

    @property
    def step_ms(self) -> float:
        return self.build_ms + self.wait_ms + self.read_ms + self.handoff_ms + self.loop_ms

    @property
    def host_ms(self) -> float:
        return self.step_ms - self.wait_ms

    @property
    def share(self) -> float:
        """The host's share of a step."""
        return self.host_ms / self.step_ms if self.step_ms else 0.0

    @classmethod
    def of(cls, build: HistogramSnapshot, wait: HistogramSnapshot, read: HistogramSnapshot,
           handoff: HistogramSnapshot, loop: HistogramSnapshot) -> HostFigures:  # fmt: skip
        def ms(h: HistogramSnapshot) -> float:
            return 1e3 * h.sum / h.count if h.count else 0.0

        return cls(build.count, ms(build), ms(wait), ms(read), ms(handoff), ms(loop))


@attrs.frozen
class StatsSnapshot:
    """What ``engine.stats()`` returns."""

    configured: int  # the --batch cap
    mode: Mode
    active_rows: int  # admitted and not finished: prefilling, decoding or serial
    pending_rows: int  # queued, not yet admitted (paused rows included)
    paused_rows: int  # paused to give another session its share, waiting to resume
    submitted: int
    finished: int
    errored: int
    cancelled: int
    rejected: int  # refused at submit (never admitted; not in the ledger)
    kv_bytes: int  # live KV: the batch, prefills, the serial row, paused rows (not the cache)
    kv_budget_bytes: int | None
    kv_precision: KvPrecision | None  # the KV's precision and its bytes per token
    kv_projected_bytes: int  # worst case of the admitted rows, what the budget is held to
    padding_waste: float  # fraction of the batch KV width that is left padding
    batch_kv_bytes: int  # the continuous batch's KV
    batch_kv_tokens: int  # tokens its rows hold
    decoding_rows: int  # rows in the continuous batch
    steps: int
    prompt_tokens: int
    prefill_tokens: int  # prompt tokens actually computed (prompt minus cached)
    generated_tokens: int
    batch_faults: int
    row_faults: int  # rows ended by a fault in their own work (the batch went on)
    overloaded: int  # refused because the queue was full (not in the ledger)
    queue_timeouts: int  # failed after waiting longer than the queue timeout
    stalls: int  # GPU calls that ran past the step timeout
    queue_oldest_wait: float  # seconds the oldest queued row has waited
    dropped_stats: int
    prompt_cache_entries: int
    prompt_cache_bytes: int
    prompt_cache_hits: int
    prompt_cache_misses: int
    prompt_cache_hit_tokens: int
    prompt_cache_evictions: int  # entries evicted from memory (by count, bytes or budget)
    prompt_cache_ceiling: int  # most bytes the cache may hold now
    # the disk tier (all 0 when it is off)
    prompt_cache_disk_entries: int
    prompt_cache_disk_bytes: int
    prompt_cache_disk_cap: int
    prompt_cache_disk_pending: int
    prompt_cache_disk_hits: int
    prompt_cache_disk_read_bytes: int
    prompt_cache_disk_writes: int
    prompt_cache_disk_write_bytes: int
    prompt_cache_disk_evictions: int
    prompt_cache_disk_bad: int
    prompt_cache_disk_dropped: int
    prompt_cache_disk_load_time: HistogramSnapshot
    prefilled_together: int  # rows whose prompts were prefilled as one padded batch
    forked: int  # rows that took their first token from another row's prime (same prompt)
    kv_copied_bytes: int  # KV bytes copied by the batch's joins and leaves
    refilled: int  # joiners written in place over a finished row's retired slot
    paused: int  # decoding rows paused (KV kept) for a session below its share
    resumed: int  # paused rows that rejoined the batch
    # speculative decoding: draft tokens proposed and kept, by drafter
    drafted_prompt: int
    accepted_prompt: int
    drafted_suffix: int
    accepted_suffix: int
    drafted_model: int
    accepted_model: int
    verify_steps: int  # decode steps that verified drafts
    decode_tokens: int  # tokens the decode steps read
    row_forwards: int  # rows read per decode step, summed: tokens per forward's divisor
    time_to_first_token: HistogramSnapshot
    queue_wait: HistogramSnapshot
    step_time: HistogramSnapshot
    host_build: HistogramSnapshot
    device_wait: HistogramSnapshot
    host_read: HistogramSnapshot
    handoff: HistogramSnapshot
    loop_turn: HistogramSnapshot
    compiled: CompiledFigures | None = None  # None: --compile off
    packed: PackedFigures | None = None  # None: --packed-weights off, or nothing routed
    images: ImageFigures | None = None  # None: a text model
    # Each request class's figures, by name (interactive, subagent, background).
    classes: dict[str, ClassFigures] = attrs.field(factory=dict)

    @property
    def batch_kv_bytes_per_token(self) -> float | None:
        """The batch's KV bytes over the tokens its rows hold (padding and the
        buffers' room to grow included), as it runs: quantized or float."""
        return self.batch_kv_bytes / self.batch_kv_tokens if self.batch_kv_tokens else None

    @property
    def batch_kv_bytes_per_row(self) -> float | None:
        return self.batch_kv_bytes / self.decoding_rows if self.decoding_rows else None

    @property
    def tokens_per_forward(self) -> float | None:
        """Tokens a row got per decode step it was in (1.0 without drafting)."""
        return self.decode_tokens / self.row_forwards if self.row_forwards else None

    @property
    def host(self) -> HostFigures:
        """The plain decode steps' time by phase."""
        return HostFigures.of(self.host_build, self.device_wait, self.host_read, self.handoff,
                              self.loop_turn)  # fmt: skip

    @property
    def host_share(self) -> float:
        return self.host.share

    @property
    def ledger_balanced(self) -> bool:
        return self.submitted == self.finished + self.errored + self.cancelled


@attrs.define(eq=False)
class Stats:
    configured: int
    mode: Mode
    kv_budget_bytes: int | None = None
    kv_precision: KvPrecision | None = None
    _send: trio.MemorySendChannel = attrs.field(init=False)
    _receive: trio.MemoryReceiveChannel = attrs.field(init=False)
    _counters: dict[Metric, int] = attrs.field(init=False)
    _gauges: dict[Metric, float] = attrs.field(init=False)
    _histograms: dict[Metric, Histogram] = attrs.field(init=False)
    _classes: dict[Priority, _ClassTally] = attrs.field(
        factory=lambda: {k: _ClassTally() for k in Priority}, init=False
    )
    _changed: trio.Event = attrs.field(factory=trio.Event, init=False)  # set after each apply
    # Posts sent and applied: a post handed straight to the waiting actor task is
    # in no buffer, yet not applied until that task runs.
    _posted: int = attrs.field(default=0, init=False)
    _applied: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel(MAILBOX_SIZE)
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._gauges = dict.fromkeys(GAUGES, 0.0)
        self._histograms = {name: Histogram() for name in HISTOGRAMS}

    def post(self, *messages: Count | Gauge | Observe | ByClass) -> None:
        """Post figures; several in one call travel as one mailbox message."""
        try:
            self._send.send_nowait(messages)
            self._posted += 1
        except trio.WouldBlock:
            self._counters[Metric.DROPPED_STATS] += 1
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # engine closing; figures no longer served

    def _apply(self, message: Count | Gauge | Observe | ByClass) -> None:
        match message:
            case ByClass(klass, field, value):
                self._classes[klass].apply(field, value)
            case Count(name, n):
                self._counters[name] += n
            case Gauge(name, value):
                self._gauges[name] = value
            case Observe(name, value):
                self._histograms[name].observe(value)
            case _:
                raise TypeError(f"stats got an unexpected message: {message!r}")

    @property
    def backlog(self) -> int:
        """Posts not yet applied."""
        return self._posted - self._applied

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self._receive:
            task_status.started()
            async for messages in self._receive:
                # Every post waiting is applied in this one turn: a decode step
                # posts several, and a turn each would cost the loop a round each.
                while True:
                    for message in messages:
                        self._apply(message)
                    self._applied += 1
                    try:
                        messages = self._receive.receive_nowait()
                    except trio.WouldBlock:
                        break
                self._changed.set()
                self._changed = trio.Event()

    async def wait_for(self, predicate: Callable[[StatsSnapshot], bool]) -> None:
        """Wait until every posted figure is in and ``predicate(snapshot)`` holds."""
        while self.backlog or not predicate(self.snapshot()):
            await self._changed.wait()

    def counter(self, name: Metric) -> int:
        return self._counters[name]

    def snapshot(self) -> StatsSnapshot:
        c, g, h = self._counters, self._gauges, self._histograms
        kv = sum(g[m] for m in (Metric.BATCH_KV_BYTES, Metric.PREFILL_KV_BYTES,
                                Metric.SERIAL_KV_BYTES, Metric.PAUSED_KV_BYTES))  # fmt: skip
        gauges = {m.key: float(g[m]) if m in _FRACTIONAL else int(g[m]) for m in GAUGES
                  if m.exposed is not None}  # fmt: skip
        return StatsSnapshot(
            configured=self.configured,
            mode=self.mode,
            kv_bytes=int(kv),
            kv_budget_bytes=self.kv_budget_bytes,
            batch_kv_bytes=int(g[Metric.BATCH_KV_BYTES]),
            kv_precision=self.kv_precision,
            **gauges,
            **{m.key: h[m].snapshot() for m in HISTOGRAMS},
            **{m.key: c[m] for m in COUNTERS},
            classes={k.label: t.snapshot() for k, t in self._classes.items()},
        )


_FRACTIONAL = frozenset({Metric.PADDING_WASTE, Metric.QUEUE_OLDEST_WAIT})  # the rest count
