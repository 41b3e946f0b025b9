"""`mlx-nursery top URL`: the dashboard's figures in a terminal, refreshed in place.

It polls ``URL/dashboard/snapshot`` (the same snapshot the page's feed sends)
and draws it with ``rich``: the batch, tok/s and step time (from the change
between two snapshots), the KV bar, the live rows, the prompt cache and the
recent requests with where their prompts diverged from the cache.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", nargs="?", default="http://127.0.0.1:8080", help="the server")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--key", help="the API key, when the server protects its stats")
    p.add_argument("--once", action="store_true", help="print one view and exit")


def fetch(url: str, key: str | None) -> dict[str, Any]:
    req = urllib.request.Request(url.rstrip("/") + "/dashboard/snapshot")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.load(r)


def _bytes(n: float | None) -> str:
    if n is None or n < 0:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _num(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def render(snap: dict[str, Any], prev: dict[str, Any] | None) -> Group:
    s = snap.get("stats")
    head = Text(f"mlx-nursery  {snap['model']}  ({snap['phase']})", style="bold")
    if s is None:
        return Group(head)
    tps = step = None
    if prev is not None and prev.get("stats") and snap["time"] > prev["time"]:
        p = prev["stats"]
        tps = (s["generated_tokens"] - p["generated_tokens"]) / (snap["time"] - prev["time"])
        n = s["step_time"]["count"] - p["step_time"]["count"]
        step = (s["step_time"]["sum"] - p["step_time"]["sum"]) / n * 1e3 if n else None
    summary = Text(
        f"mode {s['mode']}  decoding {s['decoding_rows']}/{s['configured']}  "
        f"tok/s {_num(tps, 1)}  step {_num(step, 1)} ms  "
        f"padding {100 * s['padding_waste']:.1f}%  queued {s['pending_rows']} "
        f"(oldest {s['queue_oldest_wait']:.1f} s, paused {s.get('paused_rows', 0)})  "
        f"429s {s['overloaded']}  "
        f"errors {s['errored']}  cancelled {s['cancelled']}"
    )
    budget = s.get("kv_budget_bytes")
    kv = Text(
        f"KV live {_bytes(s['kv_bytes'])}  prompt cache {_bytes(s['prompt_cache_bytes'])}  "
        f"budget {_bytes(budget) if budget else 'none'}{_precision(s)}"
    )
    parts = [head, summary, kv, _cache_line(s)]
    if len(snap.get("models", [])) > 1:
        parts.append(_models(snap))
    return Group(*parts, _live_rows(snap), _recent(snap))


def _models(snap: dict[str, Any]) -> Table:
    """Every served model: its state, memory and figures."""
    budget = snap.get("memory_budget_bytes")
    title = "models" + (f" ({_bytes(snap['reserved_bytes'])} of {_bytes(budget)} reserved)"
                        if budget else "")  # fmt: skip
    table = Table(title=title, expand=True)
    for col in ("model", "state", "resident", "reserved", "load s", "loads", "requests",
                "tokens", "keep-alive"):  # fmt: skip
        table.add_column(col)
    for m in snap["models"]:
        keep = "pinned" if m["pinned"] else f"{m['keep_alive_seconds']:g} s"
        table.add_row(
            m["name"] + (" (default)" if m["default"] else ""),
            m["state"] + (", evicting" if m["evicting"] else ""),
            _bytes(m["resident_bytes"]), _bytes(m["charge_bytes"]), _num(m["load_seconds"], 2),
            str(m["loads"]), str(m["requests"]), str(m["tokens"]), keep,
        )  # fmt: skip
    return table


def _precision(s: dict[str, Any]) -> str:
    """The KV's precision, a token's bytes in it, and the batch's as it runs."""
    p = s.get("kv_precision")
    if not p:
        return ""
    text = f"  KV {p['name']} {_bytes(p['token_bytes'])}/token"
    if p["bits"]:
        text += f" (float {_bytes(p['float_token_bytes'])})"
    if s.get("batch_kv_bytes_per_token"):
        text += (f", batch {_bytes(s['batch_kv_bytes_per_token'])}/token "
                 f"{_bytes(s['batch_kv_bytes_per_row'])}/row")  # fmt: skip
    return text


def _cache_line(s: dict[str, Any]) -> Text:
    """The prompt cache's line: memory's entries and hit rate, then the disk tier's."""
    hits, misses = s["prompt_cache_hits"], s["prompt_cache_misses"]
    rate = f"{100 * hits / (hits + misses):.0f}%" if hits + misses else "-"
    disk = s.get("prompt_cache_disk_cap") or 0
    return Text(
        f"prompt cache: {s['prompt_cache_entries']} entries, hit rate {rate}, "
        f"{s['prompt_cache_hit_tokens']} prompt tokens saved, "
        f"{s['prompt_cache_evictions']} evicted; disk "
        + (
            f"{s['prompt_cache_disk_entries']} entries {_bytes(s['prompt_cache_disk_bytes'])}"
            f" of {_bytes(disk)}, {s['prompt_cache_disk_hits']} hits, "
            f"{s['prompt_cache_disk_writes']} writes"
            if disk
            else "off"
        )
    )


def _live_rows(snap: dict[str, Any]) -> Table:
    """Every live row: its lane, phase (a prefill's progress), tokens and speed."""
    rows = Table(title="live rows", expand=True)
    for col in ("row", "request id", "lane", "phase", "prompt", "cached", "tokens", "tok/s",
                "TTFT ms"):  # fmt: skip
        rows.add_column(col, justify="right" if col in ("prompt", "cached", "tokens") else "left")
    for r in snap.get("rows", []):
        phase = r["phase"]
        if phase == "prefilling" and r.get("prefilled") is not None:
            phase += f" {100 * r['prefilled'] / max(1, r['prompt_tokens']):.0f}%"
        ttft = r.get("time_to_first_token")
        rows.add_row(
            str(r["id"]), r.get("request_id") or "-", r["lane"], phase, str(r["prompt_tokens"]),
            str(r["cached_tokens"]), str(r["tokens"]), _num(r.get("tokens_per_second"), 1),
            "-" if ttft is None else f"{ttft * 1e3:.0f}",
        )  # fmt: skip
    return rows


def _recent(snap: dict[str, Any]) -> Table:
    """The last requests, newest first, with what the prompt cache made of each."""
    recent = Table(title="recent requests", expand=True)
    for col in ("request id", "api", "finish", "prompt", "cached", "cache", "diverged at",
                "message"):  # fmt: skip
        recent.add_column(col)
    for r in reversed(snap.get("recent_requests", [])[-8:]):
        c = r.get("prompt_cache") or {}
        recent.add_row(
            r.get("request_id") or "-", r["api"], _finish(r), str(r.get("prompt_tokens", "-")),
            str(r.get("cached_tokens", "-")), c.get("reason", "-"),
            _num(c.get("diverged_at")), _num(c.get("diverged_message")),
        )  # fmt: skip
    return recent


def _finish(record: dict) -> str:
    """How a request ended; a refused one with its status and reason."""
    if record["finish_reason"] == "refused":
        return f"refused {record.get('status')} {record.get('reason')}"
    return record["finish_reason"]


def main(args: argparse.Namespace) -> int:
    prev = None
    try:
        snap = fetch(args.url, args.key)
    except (urllib.error.URLError, OSError) as exc:
        print(f"mlx-nursery top: cannot read {args.url}/dashboard/snapshot: {exc}")
        return 1
    if args.once:
        from rich.console import Console

        Console().print(render(snap, None))
        return 0
    with Live(render(snap, None), auto_refresh=False, screen=False) as live:
        try:
            while True:
                time.sleep(args.interval)
                prev, snap = snap, fetch(args.url, args.key)
                live.update(render(snap, prev), refresh=True)
        except KeyboardInterrupt:
            return 0
        except (urllib.error.URLError, OSError) as exc:
            live.console.print(f"the server went away: {exc}")
            return 1
