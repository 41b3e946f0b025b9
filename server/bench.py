"""`mlx-nursery bench URL`: concurrent streaming load against any OpenAI-compatible server.

Each client streams `/v1/completions` requests back to back until the request
budget is spent; a probe times `/health` throughout. Reported: TTFT p50/p95/p99
(at the first streamed content token), inter-token latency p50, aggregate
wall-clock tok/s, request latency, errors, and `/health` latency p50/p99.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import time
from collections.abc import Sequence

import attrs
import httpx
import trio

# Common English words: prompts made of them cost about one token per word.
WORDS = tuple(
    " ".join(
        (
            "the of and to in is was for on are with as by at be this from or an have not",
            "they which one you were all we when there can more if out so said what up its",
            "about into than them only other new some could time these two may first then do",
            "any like my now over such our man me even most made after also did many before",
            "must through back years",
        )
    ).split(" ")
)


@attrs.frozen
class LoadSpec:
    url: str
    clients: int = 8
    requests: int = 16
    max_tokens: int = 128
    prompt_tokens: int = 64  # approximate: one word per token
    shared_prefix: int = 0  # words every prompt starts with (the agent-harness case)
    model: str = "default_model"
    health_interval: float = 0.05
    timeout: float = 600.0
    seed: int = 0


def prompts(spec: LoadSpec) -> list[str]:
    """Deterministic prompts: a shared prefix, then words unique to each request."""
    rng = random.Random(spec.seed)
    prefix = [rng.choice(WORDS) for _ in range(spec.shared_prefix)]
    own = max(1, spec.prompt_tokens - spec.shared_prefix)
    return [
        " ".join([*prefix, f"request {i}:", *(rng.choice(WORDS) for _ in range(own))])
        for i in range(spec.requests)
    ]


@attrs.define
class RequestRecord:
    start: float
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    chunks: list[float] = attrs.field(factory=list)
    error: str | None = None


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


@attrs.frozen
class Report:
    clients: int
    requests: int
    errors: int
    wall_seconds: float
    completion_tokens: int
    aggregate_tokens_per_second: float
    ttft_p50: float | None
    ttft_p95: float | None
    ttft_p99: float | None
    itl_p50: float | None
    latency_p50: float | None
    latency_p95: float | None
    health_p50: float | None
    health_p99: float | None
    health_max: float | None
    first_error: str | None = None

    def table(self) -> str:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1e3:.1f} ms"

        ttft = f"{ms(self.ttft_p50)} / {ms(self.ttft_p95)} / {ms(self.ttft_p99)}"
        health = f"{ms(self.health_p50)} / {ms(self.health_p99)} / {ms(self.health_max)}"
        rows = [
            ("clients / requests", f"{self.clients} / {self.requests}"),
            ("errors", str(self.errors) + (f" ({self.first_error})" if self.first_error else "")),
            ("aggregate", f"{self.aggregate_tokens_per_second:.1f} tok/s "
                          f"({self.completion_tokens} tokens in {self.wall_seconds:.2f} s)"),
            ("TTFT p50 / p95 / p99", ttft),
            ("inter-token p50", ms(self.itl_p50)),
            ("request latency p50 / p95", f"{ms(self.latency_p50)} / {ms(self.latency_p95)}"),
            ("/health p50 / p99 / max", health),
        ]  # fmt: skip
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


async def one_request(client: httpx.AsyncClient, spec: LoadSpec, prompt: str) -> RequestRecord:
    rec = RequestRecord(start=time.perf_counter())
    body = {
        "model": spec.model,
        "prompt": prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage_tokens = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = str(chunk["error"])[:200]
                    break
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        now = time.perf_counter()
                        rec.first = rec.first or now
                        rec.chunks.append(now)
                        rec.tokens += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.end = time.perf_counter()
    if usage_tokens is not None:
        rec.tokens = usage_tokens
    return rec


async def run_load(spec: LoadSpec, progress=None) -> Report:
    texts = prompts(spec)
    records: list[RequestRecord] = []
    health: list[float] = []
    next_index = iter(range(spec.requests))
    limits = httpx.Limits(max_connections=spec.clients + 4)
    timeout = httpx.Timeout(spec.timeout, connect=30.0)
    # Both clients made before anything is timed: making one builds an SSL context
    # (~27 ms here) and blocks this event loop, which made a load's first request
    # look that much slower when the probe made its client after that request left.
    async with (
        httpx.AsyncClient(base_url=spec.url, limits=limits, timeout=timeout) as client,
        httpx.AsyncClient(base_url=spec.url, timeout=timeout) as own,
    ):

        async def worker() -> None:
            for i in next_index:
                records.append(await one_request(client, spec, texts[i]))
                if progress:
                    progress(len(records), spec.requests)

        async def probe() -> None:
            while True:
                t0 = time.perf_counter()
                try:
                    await own.get("/health")
                    health.append(time.perf_counter() - t0)
                except httpx.HTTPError:
                    pass
                await trio.sleep(spec.health_interval)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe)
            async with trio.open_nursery() as workers:
                for _ in range(spec.clients):
                    workers.start_soon(worker)
            nursery.cancel_scope.cancel()
        wall = time.perf_counter() - t0
    ok = [r for r in records if r.error is None]
    tokens = sum(r.tokens for r in ok)
    ttft = [r.first - r.start for r in ok if r.first is not None]
    itl = [b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:], strict=False)]
    latency = [r.end - r.start for r in ok if r.end is not None]
    errors = [r for r in records if r.error is not None]
    return Report(
        clients=spec.clients,
        requests=spec.requests,
        errors=len(errors),
        wall_seconds=wall,
        completion_tokens=tokens,
        aggregate_tokens_per_second=tokens / wall if wall > 0 else 0.0,
        ttft_p50=percentile(ttft, 0.5),
        ttft_p95=percentile(ttft, 0.95),
        ttft_p99=percentile(ttft, 0.99),
        itl_p50=percentile(itl, 0.5),
        latency_p50=percentile(latency, 0.5),
        latency_p95=percentile(latency, 0.95),
        health_p50=percentile(health, 0.5),
        health_p99=percentile(health, 0.99),
        health_max=max(health) if health else None,
        first_error=errors[0].error if errors else None,
    )


# /health latencies, probed every 5 ms until a line arrives on stdin; JSON on stdout.
_PROBE = """
import json, sys, threading, time, httpx
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
out = []
with httpx.Client(base_url=sys.argv[1], timeout=10) as c:
    while not stop.is_set():
        t0 = time.perf_counter()
        status = c.get("/health").status_code
        out.append(time.perf_counter() - t0 if status == 200 else -status)
        time.sleep(0.005)
print(json.dumps(out))
"""


@attrs.frozen
class Answer:
    agent: int
    turn: int
    status: int  # 0: the connection failed (body["error"] says how)
    body: dict
    retry_after: str | None  # the header, on a 429


@attrs.frozen
class Storm:
    answers: list[Answer]
    health: list[float]  # seconds per probe; a probe that was not a 200 is -status
    wall_seconds: float

    def health_percentile(self, q: float) -> float | None:
        return percentile([h for h in self.health if h >= 0], q)


async def storm(
    url: str, prompts: Sequence, *, agents: int = 64, turns: int = 5, max_tokens: int = 40
) -> Storm:
    """An overload storm: ``agents`` clients arrive at once, each making ``turns``
    non-streaming completions (agent i's turn n sends ``prompts[(i + n) % len]``)
    and honouring ``Retry-After`` after a 429, as an agent loop should; meanwhile
    ``/health`` is probed every 5 ms from a process of its own, so the figure is
    the server's, not this event loop's (busy with the agents)."""
    answers: list[Answer] = []
    limits = httpx.Limits(max_connections=agents + 16)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def agent(i: int) -> None:
            for n in range(turns):
                body = {"prompt": prompts[(i + n) % len(prompts)], "max_tokens": max_tokens}
                try:
                    r = await client.post("/v1/completions", json=body)
                except httpx.HTTPError as exc:  # status 0: no answer at all
                    answers.append(Answer(i, n, 0, {"error": f"{type(exc).__name__}: {exc}"}, None))
                    continue
                retry = r.headers.get("Retry-After") if r.status_code == 429 else None
                answers.append(Answer(i, n, r.status_code, r.json(), retry))
                if retry is not None:
                    await trio.sleep(int(retry))

        prober = await trio.lowlevel.open_process(
            [sys.executable, "-c", _PROBE, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        t0 = time.perf_counter()
        try:
            async with trio.open_nursery() as nursery:
                for i in range(agents):
                    nursery.start_soon(agent, i)
        finally:
            wall = time.perf_counter() - t0
            with trio.CancelScope(shield=True):
                await prober.stdin.send_all(b"stop\n")
                out = []
                while chunk := await prober.stdout.receive_some():
                    out.append(chunk)
                await prober.wait()
    return Storm(answers, json.loads(b"".join(out)), wall)


def _progress_bar(done: int, total: int) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def add_arguments(p) -> None:
    p.add_argument("url", help="server base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (8)")
    p.add_argument("--requests", type=int, default=16, help="requests in all (16)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request (128)")
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=64,
        help="prompt length in words, about one token each (64)",
    )
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="words every prompt shares at its start, as agents share a system prompt (0)",
    )
    p.add_argument("--model", default="default_model", help="model name to send (default_model)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")  # fmt: skip


def main(args) -> int:
    spec = LoadSpec(
        url=args.url.rstrip("/"),
        clients=args.clients,
        requests=args.requests,
        max_tokens=args.max_tokens,
        prompt_tokens=args.prompt_tokens,
        shared_prefix=args.shared_prefix,
        model=args.model,
    )
    progress = _progress_bar if sys.stderr.isatty() and not args.json else None
    report = trio.run(run_load, spec, progress)
    print(json.dumps(attrs.asdict(report), indent=1) if args.json else report.table())
    return 1 if report.errors == report.requests else 0
