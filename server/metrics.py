"""The engine's stats snapshot for /metrics (prometheus_client: Prometheus text
0.0.4, or OpenMetrics on request) and as JSON for /stats."""

from __future__ import annotations

import math

import attrs
from mlx_nursery.actors import HistogramSnapshot, StatsSnapshot
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.utils import floatToGoString

PREFIX = "mlx_nursery"

_COUNTERS = {
    "submitted": ("requests_submitted_total", "Requests admitted to the engine."),
    "finished": ("requests_finished_total", "Requests that ended with stop or length."),
    "errored": ("requests_errored_total", "Requests that ended in an error."),
    "cancelled": ("requests_cancelled_total", "Requests cancelled (client gone, shutdown)."),
    "rejected": ("requests_rejected_total", "Requests refused at submit as invalid."),
    "steps": ("decode_steps_total", "Continuous-lane decode steps."),
    "prompt_tokens": ("prompt_tokens_total", "Prompt tokens of admitted requests."),
    "prefill_tokens": ("prefill_tokens_total", "Prompt tokens actually computed."),
    "generated_tokens": ("generated_tokens_total", "Tokens delivered to clients."),
    "batch_faults": ("batch_faults_total", "Batch steps that failed (every row errored)."),
    "row_faults": ("row_faults_total", "Rows ended by a fault in their own work (batch went on)."),
    "overloaded": ("requests_overloaded_total", "Requests refused with 429: the queue was full."),
    "queue_timeouts": ("queue_timeouts_total", "Requests that waited past the queue timeout."),
    "stalls": ("gpu_stalls_total", "GPU calls that ran past the step timeout."),
    "prompt_cache_hits": ("prompt_cache_hits_total", "Prompt-cache takes that found a prefix."),
    "prompt_cache_misses": ("prompt_cache_misses_total", "Prompt-cache takes that found none."),
    "prompt_cache_hit_tokens": ("prompt_cache_hit_tokens_total", "Prompt tokens served cached."),
    "prefilled_together": ("prefilled_together_total", "Rows prefilled in one padded batch."),
    "kv_copied_bytes": ("kv_copied_bytes_total", "KV bytes copied by batch joins and leaves."),
    "refilled": ("joins_in_place_total", "Joiners written over a retired batch slot."),
}
_GAUGES = {
    "configured": ("batch_configured", "The concurrency cap (--batch)."),
    "active_rows": ("active_rows", "Requests admitted and not finished."),
    "pending_rows": ("pending_rows", "Requests queued for admission."),
    "decoding_rows": ("decoding_rows", "Rows in the continuous batch."),
    "kv_bytes": ("kv_bytes", "Live KV cache bytes (batch and prefills)."),
    "padding_waste": ("padding_waste_ratio", "Fraction of the batch KV width that is padding."),
    "kv_projected_bytes": ("kv_projected_bytes", "Worst-case KV of the admitted rows."),
    "kv_budget_bytes": ("kv_budget_bytes", "The KV budget (-1: none)."),
    "prompt_cache_entries": ("prompt_cache_entries", "Prompt-cache entries."),
    "prompt_cache_bytes": ("prompt_cache_bytes", "Prompt-cache bytes."),
    "queue_oldest_wait": (
        "queue_oldest_wait_seconds",
        "How long the oldest queued request has waited.",
    ),
}
_HISTOGRAMS = {
    "time_to_first_token": ("time_to_first_token_seconds", "Submit to first token."),
    "queue_wait": ("queue_wait_seconds", "Submit to admission."),
    "step_time": ("decode_step_seconds", "GPU time of one continuous-lane step."),
}


class _Snapshot:
    """A prometheus_client collector over one engine snapshot: it yields the
    metric families; the library writes the exposition format."""

    def __init__(self, s: StatsSnapshot, ranks: list[dict] | None = None) -> None:
        self.s, self.ranks = s, ranks

    def collect(self):
        s = self.s
        for field, (name, help_) in _COUNTERS.items():
            yield CounterMetricFamily(
                f"{PREFIX}_{name.removesuffix('_total')}", help_, value=getattr(s, field)
            )
        for field, (name, help_) in _GAUGES.items():
            raw = getattr(s, field)
            yield GaugeMetricFamily(f"{PREFIX}_{name}", help_, value=-1 if raw is None else raw)
        mode = GaugeMetricFamily(
            f"{PREFIX}_mode", "Batching mode (1 for the current one).", labels=["mode"]
        )
        for m in ("off", "serial", "batch"):
            mode.add_metric([m], int(m == s.mode))
        yield mode
        for field, (name, help_) in _HISTOGRAMS.items():
            h: HistogramSnapshot = getattr(s, field)
            buckets, cumulative = [], 0
            for bound, n in zip((*h.buckets, math.inf), h.counts, strict=True):
                cumulative += n
                buckets.append((floatToGoString(bound), cumulative))
            yield HistogramMetricFamily(f"{PREFIX}_{name}", help_, buckets=buckets, sum_value=h.sum)
        if self.ranks:
            yield from _rank_families(self.ranks)


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
    s: StatsSnapshot, accept: str = "", ranks: list[dict] | None = None
) -> tuple[bytes, str]:
    """The snapshot (and a sharded engine's per-rank figures) as Prometheus text
    (0.0.4), or OpenMetrics when the scraper's ``Accept`` asks for it; returns
    the body and its content type."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(s, ranks))
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
    body["batch"] = {
        k: getattr(s, k)
        for k in (
            "configured", "mode", "active_rows", "pending_rows",
            "kv_bytes", "kv_budget_bytes", "padding_waste",
        )
    }  # fmt: skip
    return body
