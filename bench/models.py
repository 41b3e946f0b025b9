"""Several models in one server (docs/models.md): issue 46's figures.

- load beside decoding: SmolLM2 (the default, pinned) streams a long answer
  while Gemma 3 270M, already converted, loads for a request of its own; the
  load's time (from /stats) and SmolLM2's tok/s during it against its tok/s
  alone (target >= 0.8x), with ``--model-processes off`` (Gemma in the server's
  process) and on (the default: Gemma in a child server, its load throttled
  while SmolLM2 decodes);
- swap storm: SmolLM2, Gemma 3 270M and the 30M bench llama under a memory
  budget that holds any two of them (their charges, as the server estimates
  them) but never three; 100 random requests across the three from 8 clients:
  every status (200, or 429 with Retry-After; never a 5xx), the loads, what the
  loaded models hold (weights, KV, prompt cache; /stats every 100 ms) against
  the budget, the server's RSS, and whether every answer equals a single-model
  server's; with ``--model-processes`` off and on.

    python bench/models.py   (the servers run with OpenBLAS preloaded)

Writes the table into docs/benchmarks.md (section ``models``).
"""

from __future__ import annotations

import random
import sys
import threading
import time

import httpx
from benchsuite import Server, _write_section, bench_llama, free_port
from mlx_nursery.actors import EngineSettings
from mlx_nursery.actors.models import registry
from mlx_nursery.server.sizing import estimate

KV = "256M"  # each model's KV budget
SERVE = [sys.executable, "-m", "mlx_nursery.server.cli", "serve", "--log-level", "WARNING",
         "--kv-budget", KV]  # fmt: skip
PROMPTS = ["The capital of France is", "Monday, Tuesday, Wednesday,", "def add(a, b):",
           "Once upon a time", "1, 2, 3, 4,", "The opposite of hot is"]  # fmt: skip


def models() -> dict[str, str]:
    llama = bench_llama()
    return {"smollm2": str(registry.DEFAULT.file), "gemma": str(registry.GEMMA3_270M.file),
            "llama30m": str(llama)}  # fmt: skip


def complete(http: httpx.Client, model: str, prompt: str, tokens: int = 16, **extra):
    return http.post("/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, **extra,
    }, timeout=600)  # fmt: skip


def state_of(http: httpx.Client, name: str) -> str:
    return next(c["state"] for c in http.get("/v1/models").json()["data"] if c["id"] == name)


def stream_times(http: httpx.Client, model: str, tokens: int, out: list[float]) -> None:
    """Stream a completion that never stops early; each token's arrival time."""
    body = {"model": model, "prompt": "Write a long story about a lighthouse.",
            "max_tokens": tokens, "temperature": 0, "stream": True,
            "logit_bias": {"2": -100, "0": -100}}  # fmt: skip
    with http.stream("POST", "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(time.perf_counter())


def rate(times: list[float], start: float, end: float) -> float:
    inside = [t for t in times if start <= t <= end]
    return (len(inside) - 1) / (inside[-1] - inside[0]) if len(inside) > 2 else float("nan")


def load_beside_decode(processes: bool) -> dict:
    m = models()
    argv = [*SERVE, "--model", f"smollm2={m['smollm2']}", "--model", f"gemma={m['gemma']}",
            "--keep-alive", "gemma=1",
            # a throttled load takes longer than the default minute a request waits
            *(["--model-wait", "300"] if processes else ["--model-processes", "off"])]  # fmt: skip
    with Server("models", argv, free_port()) as server, httpx.Client(base_url=server.url) as http:
        complete(http, "smollm2", "Hello")
        complete(http, "gemma", "Hello")  # the first load (its conversion is cached already)
        while state_of(http, "gemma") != "unloaded":
            time.sleep(0.2)
        alone: list[float] = []
        stream_times(http, "smollm2", 300, alone)
        base = rate(alone, alone[20], alone[-1])
        during: list[float] = []
        streamer = threading.Thread(target=stream_times, args=(http, "smollm2", 1200, during))
        streamer.start()
        while len(during) < 40:
            time.sleep(0.01)
        t0 = time.perf_counter()
        complete(http, "gemma", "Hello", tokens=1)
        t1 = time.perf_counter()
        streamer.join()
        gemma = next(x for x in http.get("/stats").json()["models"] if x["name"] == "gemma")
    load = gemma["load_seconds"]
    beside = rate(during, t0, t0 + load)
    return {"load_seconds": load, "request_seconds": t1 - t0, "alone": base, "beside": beside,
            "ratio": beside / base, "loads": gemma["loads"]}  # fmt: skip


def rss(pid: int) -> int:
    """The process's RSS and its children's (a model in a process of its own)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            own = int(next(x for x in f if x.startswith("VmRSS:")).split()[1]) * 1024
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except (OSError, StopIteration):
        return 0
    return own + sum(rss(c) for c in children)


def storm(seed: int = 46, processes: bool = False) -> dict:
    m = models()
    settings = EngineSettings(dtype="auto", kv_budget=256 << 20)
    charges = sorted(estimate(ref, settings) for ref in m.values())
    budget = charges[1] + charges[2] + charges[0] // 2
    reference = {}
    for name, ref in m.items():
        with (
            Server(name, [*SERVE, "--model", ref], free_port()) as server,
            httpx.Client(base_url=server.url) as http,
        ):
            for p in PROMPTS:
                reference[name, p] = complete(http, "default", p).json()["choices"][0]["text"]
    argv = [*SERVE, *(a for name, ref in m.items() for a in ("--model", f"{name}={ref}")),
            "--keep-alive", "smollm2=30", "--keep-alive", "30",
            "--memory-budget", str(budget),
            "--model-processes", "on" if processes else "off"]  # fmt: skip
    rng = random.Random(seed)
    work = [(rng.choice(list(m)), rng.choice(PROMPTS)) for _ in range(100)]
    codes, wrong, bare, peak, peak_rss = [], [], [], [0], [0]
    with Server("storm", argv, free_port()) as server:
        idle_rss = rss(server.proc.pid)
        done = threading.Event()

        def sample() -> None:
            with httpx.Client(base_url=server.url) as http:
                while not done.is_set():
                    figures = http.get("/stats").json()["models"]
                    peak[0] = max(peak[0], sum(x["resident_bytes"] for x in figures))
                    peak_rss[0] = max(peak_rss[0], rss(server.proc.pid))
                    time.sleep(0.1)

        def client() -> None:
            with httpx.Client(base_url=server.url) as http:
                while work:
                    name, p = work.pop()
                    r = complete(http, name, p)
                    codes.append(r.status_code)
                    if (
                        r.status_code == 200
                        and r.json()["choices"][0]["text"] != reference[name, p]
                    ):
                        wrong.append((name, p))
                    elif r.status_code == 429 and not r.headers.get("Retry-After"):
                        bare.append((name, p))

        sampler = threading.Thread(target=sample)
        sampler.start()
        t0 = time.perf_counter()
        clients = [threading.Thread(target=client) for _ in range(8)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        seconds = time.perf_counter() - t0
        done.set()
        sampler.join()
        with httpx.Client(base_url=server.url) as http:
            figures = http.get("/stats").json()["models"]
    return {
        "budget": budget, "charges": charges, "codes": {c: codes.count(c) for c in set(codes)},
        "wrong": wrong, "bare_429": bare, "peak_resident": peak[0], "peak_rss": peak_rss[0],
        "idle_rss": idle_rss,
        "seconds": seconds, "loads": {x["name"]: x["loads"] for x in figures},
        "load_seconds": {x["name"]: x["load_seconds"] for x in figures},
    }  # fmt: skip


def main() -> None:
    beside = load_beside_decode(processes=False)
    print(beside)
    apart = load_beside_decode(processes=True)
    print(apart)
    s = storm()
    print(s)
    sp = storm(processes=True)
    print(sp)
    mib = 2**20
    statuses = ", ".join(f"{n} x {c}" for c, n in sorted(s["codes"].items()))
    lines = [
        "Issue 46, several models in one server: the servers run with OpenBLAS preloaded (as "
        "`serve` restarts itself), float32 (`dtype auto` on CPU), "
        f"`--kv-budget {KV}` per model, 2-core VM.",
        "",
        "| figure | measured | target |",
        "|---|---|---|",
        f"| `--model-processes off`: Gemma 3 270M second load (converted already), in the "
        f"server's process | {beside['load_seconds']:.2f} s "
        f"(its request: {beside['request_seconds']:.2f} s) | reported |",
        f"| SmolLM2 decode during that load vs alone | {beside['beside']:.1f} / "
        f"{beside['alone']:.1f} tok/s = {beside['ratio']:.2f}x | >= 0.8x |",
        f"| `--model-processes on` (the default: Gemma in a child server): its load | "
        f"{apart['load_seconds']:.2f} s (its request: {apart['request_seconds']:.2f} s) | "
        "reported |",
        f"| SmolLM2 decode during that load vs alone, `--model-processes on` | "
        f"{apart['beside']:.1f} / {apart['alone']:.1f} tok/s = {apart['ratio']:.2f}x | "
        ">= 0.8x |",
        f"| `off`: swap storm: 100 requests, 3 models, 8 clients | {statuses} in "
        f"{s['seconds']:.1f} s; loads {s['loads']} | 200 or 429, never 5xx |",
        f"| what the loaded models hold, peak (sampled every 100 ms) | "
        f"{s['peak_resident'] / mib:,.0f} MiB of a {s['budget'] / mib:,.0f} MiB budget | "
        "<= budget |",
        f"| server RSS, peak (idle, the default model loaded: {s['idle_rss'] / mib:,.0f} MiB) | "
        f"{s['peak_rss'] / mib:,.0f} MiB | (the runtime plus the budget) |",
        f"| answers equal to single-model servers | {s['codes'].get(200, 0) - len(s['wrong'])} "
        f"of {s['codes'].get(200, 0)}; 429s without Retry-After: {len(s['bare_429'])} | all |",
        f"| `on`: the storm: statuses; what the models hold, peak; RSS of "
        f"the server and its children, peak; answers equal | "
        f"{', '.join(f'{n} x {c}' for c, n in sorted(sp['codes'].items()))} in "
        f"{sp['seconds']:.1f} s, loads {sp['loads']}; {sp['peak_resident'] / mib:,.0f} MiB; "
        f"{sp['peak_rss'] / mib:,.0f} MiB; {sp['codes'].get(200, 0) - len(sp['wrong'])} of "
        f"{sp['codes'].get(200, 0)}, 429s without Retry-After: {len(sp['bare_429'])} | "
        "as above |",
        "",
        f"Charges (weights + KV budget + a step's workspace), smallest first: "
        f"{', '.join(f'{c / mib:,.0f} MiB' for c in s['charges'])}; the budget is the two "
        "largest plus half the smallest. Each model's last load in the storm: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in s["load_seconds"].items() if v),
    ]
    _write_section("models", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
