"""`make soak`: mixed traffic against `mlx-nursery serve` for a while, with figures.

Streams read to the end, streams dropped part way, bad bodies, long prompts and
plain completions, from 12 clients, for ``--minutes`` (10). Every 5 s it samples
the server process's RSS and the engine's live KV; at the end it fits a slope to
each (bytes per minute over the second half, after warm-up), checks the ledger
(submitted = finished + errored + cancelled, nothing live) and counts 5xx answers.
The figures go to docs/reliability.md between its `soak:start` / `soak:end` marks.
Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "goldens"))

from conftest import golden, model_path, server_process  # noqa: E402

CASES = golden("llama")["serial"]
CLIENTS = 12
SAMPLE_EVERY = 5.0


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def slope_per_minute(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value), as value per minute."""
    if len(samples) < 2:
        return 0.0
    xs, ys = [t for t, _ in samples], [v for _, v in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs) or 1.0
    return 60 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


async def client_loop(client, rng, until, tally) -> None:
    while trio.current_time() < until:
        kind = rng.choice(["stream", "stream", "drop", "bad", "long", "plain"])
        case = rng.choice(CASES)
        body = {"prompt": case["prompt_ids"], "max_tokens": rng.randint(4, 48)}
        if kind == "bad":
            r = await client.post("/v1/completions", content=b'{"prompt": [1, "x"')
            tally[r.status_code // 100] += 1
            continue
        if kind == "long":
            body["prompt"] = [rng.randrange(3, 250) for _ in range(rng.randint(1000, 3000))]
        if kind in ("stream", "drop"):
            body["stream"] = True
            keep = rng.randint(0, 10) if kind == "drop" else None
            async with client.stream("POST", "/v1/completions", json=body) as r:
                tally[r.status_code // 100] += 1
                n = 0
                async for _ in r.aiter_lines():
                    n += 1
                    if keep is not None and n > keep:
                        break
            continue
        r = await client.post("/v1/completions", json=body)
        tally[r.status_code // 100] += 1


async def soak(minutes: float) -> dict:
    samples: list[tuple[float, int, int]] = []
    tally = {2: 0, 4: 0, 5: 0}
    flags = ("--model", str(model_path("llama")), "--batch", "8", "--max-queued-requests", "64")
    async with server_process(*flags) as (url, pid):
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            start = trio.current_time()
            until = start + minutes * 60

            async def sampler():
                while trio.current_time() < until:
                    s = (await client.get("/stats")).json()
                    samples.append((trio.current_time() - start, rss_bytes(pid), s["kv_bytes"]))
                    await trio.sleep(SAMPLE_EVERY)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(sampler)
                for i in range(CLIENTS):
                    nursery.start_soon(client_loop, client, random.Random(i), until, tally)
            with trio.fail_after(30):
                while (s := (await client.get("/stats")).json())["active_rows"]:  # noqa: ASYNC110 (polling over HTTP: no event crosses the wire)
                    await trio.sleep(0.1)
    half = [x for x in samples if x[0] >= minutes * 30]
    return {
        "minutes": minutes,
        "answers": {f"{k}xx": v for k, v in tally.items()},
        "ledger": {k: s[k] for k in ("submitted", "finished", "errored", "cancelled")},
        "balanced": s["submitted"] == s["finished"] + s["errored"] + s["cancelled"],
        "live_after": {"active_rows": s["active_rows"], "kv_bytes": s["kv_bytes"]},
        "rss_start_mb": samples[0][1] / 1e6,
        "rss_end_mb": samples[-1][1] / 1e6,
        "rss_slope_mb_per_min": slope_per_minute([(t, r / 1e6) for t, r, _ in half]),
        "kv_slope_mb_per_min": slope_per_minute([(t, k / 1e6) for t, _, k in half]),
        "samples": len(samples),
    }


def write_doc(r: dict) -> None:
    doc = ROOT / "docs" / "reliability.md"
    text = doc.read_text()
    start, end = "<!-- soak:start -->", "<!-- soak:end -->"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    machine = f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores"
    body = "\n".join([
        f"Run {time.strftime('%Y-%m-%d')} on {machine}; golden llama (float32, mlx's bundled "
        f"BLAS); {r['minutes']:g} minutes, {CLIENTS} clients, `--batch 8`.",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| answers | 2xx {r['answers']['2xx']:,}, 4xx {r['answers']['4xx']:,}, "
        f"5xx {r['answers']['5xx']:,} |",
        f"| ledger | submitted {r['ledger']['submitted']:,} = finished "
        f"{r['ledger']['finished']:,} + errored {r['ledger']['errored']:,} + cancelled "
        f"{r['ledger']['cancelled']:,}: {'balanced' if r['balanced'] else 'NOT balanced'} |",
        f"| live after | {r['live_after']['active_rows']} rows, "
        f"{r['live_after']['kv_bytes']:,} KV bytes |",
        f"| server RSS | {r['rss_start_mb']:.0f} MB at start, {r['rss_end_mb']:.0f} MB at end; "
        f"slope over the second half {r['rss_slope_mb_per_min']:+.2f} MB/min |",
        f"| live KV slope (second half) | {r['kv_slope_mb_per_min']:+.3f} MB/min |",
    ])  # fmt: skip
    doc.write_text(f"{head}{start}\n{body}\n{end}{tail}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--no-doc", action="store_true", help="print, do not write the doc")
    args = parser.parse_args()
    r = trio.run(soak, args.minutes)
    print(json.dumps(r, indent=1))
    if not args.no_doc:
        write_doc(r)
    ok = r["balanced"] and r["answers"]["5xx"] == 0 and not r["live_after"]["active_rows"]
    ok = ok and r["live_after"]["kv_bytes"] == 0 and abs(r["rss_slope_mb_per_min"]) < 5
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
