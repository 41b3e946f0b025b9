"""The engine's stats snapshot for /metrics (prometheus_client: Prometheus text
0.0.4, or OpenMetrics on request) and as JSON for /stats."""

from __future__ import annotations

import math

import attrs
from mlx_nursery.actors import HistogramSnapshot, StatsSnapshot
from mlx_nursery.actors.stats import COUNTERS, GAUGES, HISTOGRAMS, ImageFigures, Mode
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.utils import floatToGoString

from .specs import ModelState

PREFIX = "mlx_nursery"

# Figures of the snapshot that are not posted metrics: (field, name, help).
_SNAPSHOT_GAUGES = (
    ("configured", "batch_configured", "The concurrency cap (--batch)."),
    ("kv_bytes", "kv_bytes", "Live KV cache bytes (batch and prefills)."),
    ("kv_budget_bytes", "kv_budget_bytes", "The KV budget (-1: none)."),
    ("batch_kv_bytes", "batch_kv_bytes", "KV bytes of the continuous batch."),
    ("batch_kv_bytes_per_token", "batch_kv_bytes_per_token",
     "The batch's KV bytes over the tokens its rows hold (-1: no row)."),
    ("batch_kv_bytes_per_row", "batch_kv_bytes_per_row",
     "The batch's KV bytes over its rows (-1: no row)."),
    ("host_share", "decode_host_share",
     "The host's share of a plain decode step (all but its wait on the device), mean."),
)  # fmt: skip


class _Snapshot:
    """A prometheus_client collector over one engine snapshot: it yields the
    metric families; the library writes the exposition format."""

    def __init__(
        self,
        s: StatsSnapshot | None,
        ranks: list[dict] | None = None,
        refusals: list[dict] = (),
        adjusted: dict[str, int] | None = None,
        pool: dict | None = None,
    ) -> None:
        self.s, self.ranks, self.refusals, self.adjusted = s, ranks, refusals, adjusted or {}
        self.pool = pool

    def collect(self):
        if self.s is not None:
            yield from self._engine(self.s)
        if self.pool is not None:
            yield from _pool_families(self.pool)
        refused = CounterMetricFamily(
            f"{PREFIX}_http_refusals", "Requests answered 4xx at the HTTP layer.",
            labels=["api", "status", "reason"],
        )  # fmt: skip
        for r in self.refusals:
            refused.add_metric([r["api"], str(r["status"]), r["reason"]], r["count"])
        yield refused
        adjusted = CounterMetricFamily(
            f"{PREFIX}_prompt_adjusted", "Prompts the intake changed, by what it changed "
            "(Claude Code's attribution block dropped, its early system turns moved first).",
            labels=["kind"],
        )  # fmt: skip
        for kind, n in sorted(self.adjusted.items()):
            adjusted.add_metric([kind], n)
        yield adjusted
        if self.ranks:
            yield from _rank_families(self.ranks)

    def _engine(self, s: StatsSnapshot):
        """The default model's engine figures (unlabelled, as with one model)."""
        for m in COUNTERS:
            if m.exposed is not None:
                yield CounterMetricFamily(f"{PREFIX}_{m.exposed}", m.help, value=getattr(s, m.key))
        gauges = [(m.key, m.exposed, m.help) for m in GAUGES if m.exposed is not None]
        for field, name, help_ in (*_SNAPSHOT_GAUGES, *gauges):
            raw = getattr(s, field)
            yield GaugeMetricFamily(f"{PREFIX}_{name}", help_, value=-1 if raw is None else raw)
        p = s.kv_precision
        if p is not None:
            token = GaugeMetricFamily(
                f"{PREFIX}_kv_token_bytes",
                "KV bytes a token costs, by precision (the served one, and float beside it).",
                labels=["precision", "served"],
            )
            token.add_metric([p.name, "1"], p.token_bytes)
            if p.bits is not None:
                token.add_metric(["float", "0"], p.float_token_bytes)
            yield token
        mode = GaugeMetricFamily(
            f"{PREFIX}_mode", "Batching mode (1 for the current one).", labels=["mode"]
        )
        for m in Mode:
            mode.add_metric([m.value], int(m is s.mode))
        yield mode
        for m in HISTOGRAMS:
            h: HistogramSnapshot = getattr(s, m.key)
            yield HistogramMetricFamily(
                f"{PREFIX}_{m.exposed}", m.help, buckets=_buckets(h), sum_value=h.sum
            )
        yield from _class_families(s)
        if s.images is not None:
            yield from _image_families(s.images)


def _image_families(images: ImageFigures):
    """A vision model's images (docs/vision.md)."""
    yield CounterMetricFamily(f"{PREFIX}_images_encoded", "Images through the vision tower.",
                              value=images.encoded)  # fmt: skip
    yield CounterMetricFamily(f"{PREFIX}_image_encode_seconds",
                              "Seconds images spent in the vision tower.",
                              value=images.encode_seconds)  # fmt: skip
    yield CounterMetricFamily(f"{PREFIX}_image_cache_hits", "Images whose embeddings were "
                              "kept by content (the vision tower spared).",
                              value=images.hits)  # fmt: skip
    yield GaugeMetricFamily(f"{PREFIX}_images_kept", "Images whose embeddings are kept.",
                            value=images.kept_embeddings)  # fmt: skip


def _buckets(h: HistogramSnapshot) -> list[tuple[str, int]]:
    """A histogram's cumulative buckets, as prometheus_client takes them."""
    out, cumulative = [], 0
    for bound, n in zip((*h.buckets, math.inf), h.counts, strict=True):
        cumulative += n
        out.append((floatToGoString(bound), cumulative))
    return out


def _class_families(s: StatsSnapshot):
    """Each request class's figures (interactive, subagent, background), labelled."""
    queued = GaugeMetricFamily(f"{PREFIX}_class_queued", "Requests waiting for a slot "
                               "(paused ones included), by class.", labels=["class"])  # fmt: skip
    running = GaugeMetricFamily(
        f"{PREFIX}_class_running", "Requests admitted, by class.", labels=["class"]
    )
    tokens = CounterMetricFamily(
        f"{PREFIX}_class_generated_tokens", "Tokens delivered to clients, by class.",
        labels=["class"],
    )  # fmt: skip
    wait = HistogramMetricFamily(
        f"{PREFIX}_class_queue_wait_seconds", "Seconds from submit to admission, by class.",
        labels=["class"],
    )  # fmt: skip
    for name, c in s.classes.items():
        queued.add_metric([name], c.queued)
        running.add_metric([name], c.running)
        tokens.add_metric([name], c.tokens)
        wait.add_metric([name], _buckets(c.queue_wait), c.queue_wait.sum)
    yield from (queued, running, tokens, wait)


# Per-model figures of the pool (server/pool.py), each labelled with the model's name.
_MODEL_GAUGES = (
    ("resident_bytes", "model_resident_bytes", "A loaded model's weights, live KV and prompt "
     "cache (0: unloaded)."),
    ("charge_bytes", "model_reserved_bytes", "What a model is charged against the memory "
     "budget: weights, KV budget, a step's workspace (estimated until first loaded)."),
    ("load_seconds", "model_load_seconds", "Seconds the model's last load took (-1: never)."),
)  # fmt: skip
_MODEL_COUNTERS = (
    ("loads", "model_loads", "Times the model was loaded."),
    ("unloads", "model_unloads", "Times the model was unloaded (idle, evicted or at exit)."),
    ("requests", "model_requests", "Requests the model finished (any finish reason)."),
    ("tokens", "model_tokens", "Tokens the model generated."),
)


def _pool_families(pool: dict):
    models = pool["models"]
    state = GaugeMetricFamily(f"{PREFIX}_model_state", "A model's state (1 for the current "
                              "one).", labels=["model", "state"])  # fmt: skip
    for m in models:
        for st in ModelState:
            state.add_metric([m["name"], st.value], int(m["state"] == st.value))
    yield state
    for field, name, help_ in _MODEL_GAUGES:
        family = GaugeMetricFamily(f"{PREFIX}_{name}", help_, labels=["model"])
        for m in models:
            family.add_metric([m["name"]], -1 if m[field] is None else m[field])
        yield family
    for field, name, help_ in _MODEL_COUNTERS:
        family = CounterMetricFamily(f"{PREFIX}_{name}", help_, labels=["model"])
        for m in models:
            family.add_metric([m["name"]], m[field])
        yield family
    budget = pool["memory_budget_bytes"]
    yield GaugeMetricFamily(f"{PREFIX}_memory_budget_bytes", "The models' memory budget "
                            "(-1: none).", value=-1 if budget is None else budget)  # fmt: skip
    yield GaugeMetricFamily(f"{PREFIX}_memory_reserved_bytes", "What the loaded models are "
                            "charged against it.", value=pool["reserved_bytes"])  # fmt: skip


_RANK_GAUGES = {
    "kv_bytes": ("rank_kv_bytes", "KV bytes this rank holds (its shard of every cache)."),
    "step_seconds": ("rank_step_seconds", "Seconds of this rank's last GPU call."),
    "busy_seconds": ("rank_busy_seconds", "Seconds this rank spent in GPU calls so far."),
    "calls": ("rank_calls", "GPU calls this rank has run."),
}


def _rank_families(ranks: list[dict]):
    """Sharded engines: one series per rank, labelled with its number."""
    for field, (name, help_) in _RANK_GAUGES.items():
        family = GaugeMetricFamily(f"{PREFIX}_{name}", help_, labels=["rank"])
        for r in ranks:
            family.add_metric([str(r["rank"])], float(r.get(field, 0) or 0))
        yield family


def prometheus(
    s: StatsSnapshot | None,
    accept: str = "",
    ranks: list[dict] | None = None,
    refusals: list[dict] = (),
    adjusted: dict[str, int] | None = None,
    pool: dict | None = None,
) -> tuple[bytes, str]:
    """The snapshot (and a sharded engine's per-rank figures, and the models'
    pool) as Prometheus text (0.0.4), or OpenMetrics when the scraper's
    ``Accept`` asks for it; returns the body and its content type."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(s, ranks, refusals, adjusted, pool))
    if "application/openmetrics-text" in accept:
        return openmetrics.generate_latest(registry), openmetrics.CONTENT_TYPE_LATEST
    return generate_latest(registry), CONTENT_TYPE_LATEST


def _quantile(h: HistogramSnapshot, q: float) -> float | None:
    v = h.quantile(q)
    return None if v is None or math.isinf(v) else v  # JSON has no infinity


def _hist_json(h: HistogramSnapshot) -> dict:
    """Quantiles are bucket upper bounds (null: no data, or past the last bound)."""
    return {
        "count": h.count,
        "sum": h.sum,
        "p50": _quantile(h, 0.5),
        "p95": _quantile(h, 0.95),
        "p99": _quantile(h, 0.99),
    }


def stats_json(s: StatsSnapshot) -> dict:
    body = {
        k: (_hist_json(v) if isinstance(v, HistogramSnapshot) else v)
        for k, v in attrs.asdict(s, recurse=False).items()
    }
    body["tokens_per_forward"] = s.tokens_per_forward
    body["batch_kv_bytes_per_token"] = s.batch_kv_bytes_per_token
    body["batch_kv_bytes_per_row"] = s.batch_kv_bytes_per_row
    if s.kv_precision is not None:
        body["kv_precision"] = {**attrs.asdict(s.kv_precision), "name": s.kv_precision.name}
    if s.compiled is not None:
        body["compiled"] = {**attrs.asdict(s.compiled), "share": s.compiled.share}
    if s.packed is not None:
        body["packed"] = {**attrs.asdict(s.packed), "share": s.packed.share}
    if s.images is not None:
        body["images"] = attrs.asdict(s.images)
    body["classes"] = {
        name: {"queued": c.queued, "running": c.running, "tokens": c.tokens,
               "queue_wait": _hist_json(c.queue_wait)}
        for name, c in s.classes.items()
    }  # fmt: skip
    host = s.host
    body["host"] = {**attrs.asdict(host), "step_ms": host.step_ms, "host_ms": host.host_ms,
                    "share": host.share}  # fmt: skip
    body["batch"] = {
        k: getattr(s, k)
        for k in (
            "configured", "mode", "active_rows", "pending_rows",
            "kv_bytes", "kv_budget_bytes", "padding_waste",
        )
    }  # fmt: skip
    return body
