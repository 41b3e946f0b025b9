"""`make bench`: the engine and the server against mlx-lm, paired, in one run.

1. one request: engine decode tok/s vs ``mlx_lm.stream_generate``;
2. 4 and 8 concurrent requests: engine aggregate tok/s vs mlx-lm's
   ``BatchGenerator`` driven in a plain loop;
3. HTTP: ``mlx-nursery serve`` vs ``mlx_lm.server --decode-concurrency 8`` under the
   same ``mlx-nursery bench`` load (8 clients, 16 requests, 128 tokens);
4. the same HTTP comparison at 1, 2, 4 and 8 clients, drawn as a PNG.

Each paired measurement is repeated (``--repeats``, 3) alternating the two sides;
tables give medians with min-max. Results go to ``docs/bench/results.json``, the
plot to ``docs/bench/http_clients.png`` and the tables into ``docs/benchmarks.md``
between its ``bench:start`` / ``bench:end`` markers.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import attrs
import httpx
import trio
from compiled_step import chat
from compiled_step import mlx_batch as batch_generator
from edits import edit_messages, natural_messages  # bench/ (this script's folder)
from mlx_nursery.actors.disk_cache import KV_DIR_ENV
from mlx_nursery.actors.models.load import cast
from mlx_nursery.server.bench import WORDS, LoadSpec, one_request, prompts, run_load, storm
from mlx_nursery.server.blas import OPENBLAS_ENV, find_openblas
from mlx_nursery.server.launch import MLX_LAUNCH

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SINGLE_TOKENS = 256
BATCH_TOKENS = 128
PROMPT = "Write a short story about a lighthouse keeper who collects sea glass."



def bench_llama(shardable: bool = False) -> Path:
    """The 30M benchmark model (goldens/make_bench_model.py), built once into its
    keyed cache folder."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "goldens"))
    from make_bench_model import ensure

    return ensure(shardable=shardable)

def blas() -> str:
    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
    return "OpenBLAS (preloaded)" if "libopenblas" in maps else "mlx bundled reference BLAS"


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "all": values}  # fmt: skip


# -- 1 and 2: in-process ----------------------------------------------------------


def single_prompt(tokenizer) -> list[int]:
    """The one-request prompt: chat-templated where the model has a template (an
    instruct model answers a bare instruction with its end token)."""
    return chat(tokenizer, PROMPT)


def mlx_single(model, tokenizer) -> float:
    from mlx_lm import stream_generate

    prompt = single_prompt(tokenizer)
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=SINGLE_TOKENS))
    return responses[-1].generation_tps


def engine_single(model, tokenizer) -> float:
    from mlx_nursery.actors import open_engine

    async def go():
        async with open_engine((model, tokenizer), batch=8) as engine:
            r = await engine.generate(single_prompt(tokenizer), max_tokens=SINGLE_TOKENS)
            return r.usage.decode_tokens_per_second

    return trio.run(go)


def batch_prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.encode(p) for p in prompts(LoadSpec(url="", requests=n, prompt_tokens=32))]


def mlx_batch(model, tokenizer, n: int) -> float:
    return batch_generator(model, batch_prompts(tokenizer, n), BATCH_TOKENS,
                           tokenizer.eos_token_ids)  # fmt: skip


def engine_batch(model, tokenizer, n: int) -> float:
    from mlx_nursery.actors import open_engine

    ids = batch_prompts(tokenizer, n)

    async def go():
        async with open_engine((model, tokenizer), batch=8) as engine:
            results = []

            async def one(p):
                results.append(await engine.generate(p, max_tokens=BATCH_TOKENS))

            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for p in ids:
                    nursery.start_soon(one, p)
            return sum(len(r.tokens) for r in results) / (time.perf_counter() - t0)

    return trio.run(go)


# A schema an answer can fill for a while: constrained decoding's cost is per step.
CONSTRAINT_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "notes": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "notes"],
}


def constrained_step_time(model, tokenizer, constrained: bool, n: int = 8) -> float:
    """Mean decode step time (GPU seconds) of ``n`` rows decoding together, every
    row constrained to a JSON schema or none."""
    from mlx_nursery.actors import open_engine

    ids = batch_prompts(tokenizer, n)
    fmt = {"type": "json_schema", "json_schema": {"schema": CONSTRAINT_SCHEMA}}

    async def go():
        async with open_engine((model, tokenizer), batch=n) as engine:
            extra = {"response_format": fmt} if constrained else {}
            async with trio.open_nursery() as nursery:
                for p in ids:
                    nursery.start_soon(lambda p=p: engine.generate(p, max_tokens=64, **extra))
            steps = engine.stats().step_time
            return steps.sum / steps.count

    return trio.run(go)


def constraint_cost(model, tokenizer, repeats: int) -> dict:
    return paired(
        "8 rows, decode step ms: all constrained (JSON schema) vs none",
        lambda: 1e3 * constrained_step_time(model, tokenizer, True),
        lambda: 1e3 * constrained_step_time(model, tokenizer, False),
        repeats,
    )


def copy_traffic(model, tokenizer, *, legacy: bool) -> dict:
    """KV bytes copied by joins and leaves per generated token, and tok/s, under a
    closed loop of 8 agents whose answers end at different lengths (so rows leave
    and others join mid-batch) on ~300-token prompts. ``legacy`` turns off this
    issue's mechanisms (padded group prefill, retired slots refilled in place):
    every joiner prefilled alone and merged in, every leave filtered out at once."""
    from unittest import mock

    from mlx_nursery.actors import open_engine
    from mlx_nursery.actors import prefill as prefill_module
    from mlx_nursery.actors.step import batch as batch_module

    rng = random.Random(11)
    spec = LoadSpec(url="", requests=32, prompt_tokens=300, seed=11)
    jobs = [(tokenizer.encode(p), rng.randint(24, 160)) for p in prompts(spec)]

    async def go():
        async with open_engine((model, tokenizer), batch=8, prompt_cache_size=0) as engine:
            queue = list(jobs)

            async def agent():
                while queue:
                    ids, n = queue.pop()
                    await engine.generate(ids, max_tokens=n)

            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(agent)
            wall = time.perf_counter() - t0
            st = engine.stats()
            return {
                "bytes_per_token": st.kv_copied_bytes / st.generated_tokens,
                "tokens_per_second": st.generated_tokens / wall,
                "refilled": st.refilled,
                "prefilled_together": st.prefilled_together,
            }

    if not legacy:
        return trio.run(go)
    plan = prefill_module.plan_turn

    def alone(jobs, step_size, together=False, min_shared=None):
        return plan(jobs, step_size, False, min_shared)

    with (
        mock.patch.object(batch_module.Batch, "reusable", property(lambda self: False)),
        mock.patch.object(prefill_module, "plan_turn", alone),
    ):
        return trio.run(go)


def paired(name: str, ours, theirs, repeats: int) -> dict:
    a, b = [], []
    ours()  # warm-up: first-call kernel and allocation costs are nobody's figure
    theirs()
    for _ in range(repeats):
        a.append(ours())
        b.append(theirs())
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    row = {"name": name, "ours": summary(a), "mlx_lm": summary(b), "ratio": summary(ratios)}
    print(f"  {name}: ours {row['ours']['median']:.1f} vs mlx-lm {row['mlx_lm']['median']:.1f} "
          f"-> {row['ratio']['median']:.3f}x", flush=True)  # fmt: skip
    return row


# -- 3 and 4: HTTP ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FRESH_HOME = "<fresh>"  # Server.home: an empty HOME for each start


@attrs.define
class Server:
    name: str
    argv: list[str]
    port: int
    proc: subprocess.Popen | None = None
    # A HOME for servers that keep state there (FRESH_HOME: an empty one each start).
    home: str | None = None
    start_seconds: float = 120.0
    env: dict[str, str] = attrs.field(factory=dict)  # over this process's environment
    scratch: list[str] = attrs.field(factory=list)  # this start's folders, removed at exit

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        env = dict(os.environ, **{OPENBLAS_ENV: "1"}, **self.env)
        # Ours keeps its prompt cache's disk tier across restarts: unless a bench
        # names the folder (the restart and flood figures), each start gets an
        # empty one, so no earlier server's or run's prompts are served from disk.
        if KV_DIR_ENV not in self.env:
            env[KV_DIR_ENV] = self._scratch("kv-")
        if self.home is not None:
            env["HOME"] = self._scratch("home-") if self.home == FRESH_HOME else self.home
        self.proc = subprocess.Popen(
            [*self.argv, "--port", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + self.start_seconds
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError(f"{self.name} did not start")

    def loop_cpu(self) -> float:
        """CPU seconds the server's main thread (its event loop: HTTP, SSE and the
        actors; the GPU thread and BLAS threads apart) has used so far. Linux."""
        pid = self.proc.pid
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def _scratch(self, prefix: str) -> str:
        self.scratch.append(tempfile.mkdtemp(prefix=f"bench-{prefix}"))
        return self.scratch[-1]

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        for folder in self.scratch:
            shutil.rmtree(folder, ignore_errors=True)
        self.scratch.clear()


@contextlib.contextmanager
def dashboard_viewers(url: str, n: int):
    """``n`` browsers' worth of dashboard feeds (``/dashboard/events``), read in a
    thread of their own for as long as the block runs."""
    stop = threading.Event()

    async def view(client: httpx.AsyncClient) -> None:
        async with client.stream("GET", "/dashboard/events") as r:
            async for _ in r.aiter_raw():
                if stop.is_set():
                    return

    async def main() -> None:
        client = httpx.AsyncClient(base_url=url, timeout=None)
        async with client, trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(view, client)

    thread = threading.Thread(target=lambda: trio.run(main), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def probe_cpu(server: Server, seconds: float = 5.0) -> float:
    """Event-loop CPU seconds per wall second that the load's own ``/health``
    probe (one request every 50 ms) costs the server with nothing else running:
    subtracted from the per-token figure, which is about streaming."""

    async def go() -> None:
        async with httpx.AsyncClient(base_url=server.url) as client:
            with trio.move_on_after(seconds):
                while True:
                    await client.get("/health")
                    await trio.sleep(LoadSpec(url="").health_interval)

    cpu = server.loop_cpu()
    trio.run(go)
    return (server.loop_cpu() - cpu) / seconds


def load(server: Server, clients: int, requests: int, seed: int = 0) -> dict:
    """One load; each ``seed`` draws other prompts, so that no server's prefix cache
    turns a repeat into a cache benchmark (the shared-prompt table measures that)."""
    spec = LoadSpec(
        url=server.url, clients=clients, requests=requests, max_tokens=BATCH_TOKENS, seed=seed
    )
    return attrs.asdict(trio.run(run_load, spec, None))


async def _ttft(client: httpx.AsyncClient, prompt: str) -> float:
    """Seconds to the first streamed content token of one 16-token completion."""
    rec = await one_request(client, LoadSpec(url="", max_tokens=16), prompt)
    return math.nan if rec.first is None else rec.first - rec.start


def shared_prefix_prompts(tokenizer, tokens: int = 2000, agents: int = 8) -> list[str]:
    """Eight agent prompts: one ~``tokens``-token system prompt, then each its own task."""
    words, rng = [], random.Random(7)
    while len(tokenizer.encode(" ".join(words))) < tokens:
        words += [rng.choice(WORDS) for _ in range(50)]
    prefix = " ".join(words)
    return [
        f"{prefix}\nAgent {i}: your task is module {i}; report in one line." for i in range(agents)
    ]


def shared_prefix(server: Server, prompts: list[str]) -> dict:
    """Agent 1 alone first (it computes the shared prompt), then agents 2-8 at once."""

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
            first = await _ttft(client, prompts[0])
            rest = [0.0] * (len(prompts) - 1)

            async def agent(i):
                rest[i - 1] = await _ttft(client, prompts[i])

            async with trio.open_nursery() as nursery:
                for i in range(1, len(prompts)):
                    nursery.start_soon(agent, i)
            return first, rest

    first, rest = trio.run(go)
    return {"agent1_ttft": first, "others_ttft": rest,
            "ratio_median": statistics.median(rest) / first}  # fmt: skip


# MLX servers people choose instead of mlx_lm.server, each in its own venv under
# the cache (installed on first use: each pulls torch, about 6.5 GB), with mlx's
# CPU backend added (their wheels bring mlx without one on Linux). Both batch:
# vllm-mlx only with --continuous-batching.
PEERS = {
    "vllm-mlx": (
        "vllm-mlx==0.6.0",
        [
            "vllm-mlx",
            "serve",
            "{model}",
            "--continuous-batching",
            "--served-model-name",
            "default_model",
        ],
    ),
    "rapid-mlx": (
        "rapid-mlx==0.16.10",
        ["rapid-mlx", "serve", "{model}", "--served-model-name", "default_model"],
    ),
}
MLX_CPU = "mlx[cpu]==0.32.4"
VIEWERS = 5  # dashboard feeds open during one 8-client load (the /health check)


def peer_venv(name: str) -> Path:
    """The peer's venv, made and installed on first use."""
    venv = Path.home() / ".cache" / "mlx-nursery" / "peers" / name
    spec, argv = PEERS[name]
    if not (venv / "bin" / argv[0]).exists():
        print(f"installing {spec} into {venv} (once; it pulls torch)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, spec, MLX_CPU], check=True)
    return venv


def peer_server(name: str, model: str) -> Server:
    """One peer on a free port, with a fresh HOME (both keep a prefix cache there
    across restarts, which would carry one run's prompts into the next)."""
    venv = peer_venv(name)
    _, argv = PEERS[name]
    argv = [str(venv / "bin" / argv[0]), *(a.format(model=model) for a in argv[1:])]
    return Server(name, argv, free_port(), home=FRESH_HOME, start_seconds=600)


def peers_http(model: str, repeats: int, names: list[str]) -> dict:
    """Each peer alone (one server alive at a time): the 8-client headline load and
    the clients sweep, as for the other two."""
    out = {}
    for name in names:
        with peer_server(name, model) as server:
            load(server, 8, 8, seed=100)  # warm-up
            headline = []
            for repeat in range(repeats):
                r = load(server, 8, 16, seed=repeat + 1)
                headline.append(r)
                print(f"  http 8 clients {name}: {r['aggregate_tokens_per_second']:.1f} tok/s, "
                      f"TTFT p95 {r['ttft_p95'] * 1e3:.0f} ms", flush=True)  # fmt: skip
            sweep = {c: load(server, c, 2 * c, seed=200 + c) for c in (1, 2, 4, 8)}
        out[name] = {"headline": headline, "sweep": sweep}
    return out


def both_servers(model: str, *ours_flags: str) -> tuple[Server, Server]:
    """Ours (``--batch 8`` and ``ours_flags``) and ``mlx_lm.server
    --decode-concurrency 8`` on the same model, each on a free port."""
    ours = Server(
        "mlx-nursery",
        [sys.executable, "-m", "mlx_nursery.server.cli", "serve", "--model", model,
         "--batch", "8", *ours_flags, "--log-level", "WARNING"],
        free_port(),
    )  # fmt: skip
    theirs = Server(
        "mlx_lm.server",
        [sys.executable, "-m", "mlx_lm.server", "--model", model, "--decode-concurrency", "8",
         "--log-level", "WARNING"],
        free_port(),
    )  # fmt: skip
    return ours, theirs


def http(model: str, repeats: int, tokenizer) -> dict:
    ours, theirs = both_servers(model)
    out: dict = {"headline": {"ours": [], "mlx_lm": []}, "sweep": {"ours": {}, "mlx_lm": {}}}
    with ours, theirs:
        for server in (ours, theirs):
            load(server, 8, 8, seed=100)  # warm-up
        probing = probe_cpu(ours)
        for repeat in range(repeats):
            for key, server in (("ours", ours), ("mlx_lm", theirs)):
                cpu = server.loop_cpu()
                r = load(server, 8, 16, seed=repeat + 1)
                # Per streamed token (one SSE chunk unless events queue up), the
                # probe's share taken out; the raw figure stays in the results.
                used = server.loop_cpu() - cpu
                r["loop_ms_per_token_raw"] = used * 1e3 / r["completion_tokens"]
                used -= probing * r["wall_seconds"]
                r["loop_ms_per_token"] = used * 1e3 / r["completion_tokens"]
                out["headline"][key].append(r)
                print(f"  http 8 clients {server.name}: {r['aggregate_tokens_per_second']:.1f} "
                      f"tok/s, TTFT p95 {r['ttft_p95'] * 1e3:.0f} ms, /health p99 "
                      f"{r['health_p99'] * 1e3:.1f} ms", flush=True)  # fmt: skip
        with dashboard_viewers(ours.url, VIEWERS):
            r = out["with_viewers"] = load(ours, 8, 16, seed=50)
        print(f"  http 8 clients mlx-nursery, {VIEWERS} dashboard viewers: "
              f"{r['aggregate_tokens_per_second']:.1f} tok/s, /health p99 "
              f"{r['health_p99'] * 1e3:.1f} ms", flush=True)  # fmt: skip
        for clients in (1, 2, 4, 8):
            for key, server in (("ours", ours), ("mlx_lm", theirs)):
                out["sweep"][key][clients] = load(server, clients, 2 * clients, seed=200 + clients)
        prompts = shared_prefix_prompts(tokenizer)
        out["shared_prefix"] = {"prompt_tokens": len(tokenizer.encode(prompts[0]))}
        for key, server in (("ours", ours), ("mlx_lm", theirs)):
            r = out["shared_prefix"][key] = shared_prefix(server, prompts)
            print(f"  shared prefix {server.name}: agent 1 TTFT {r['agent1_ttft'] * 1e3:.0f} ms, "
                  f"agents 2-8 median {statistics.median(r['others_ttft']) * 1e3:.0f} ms "
                  f"({r['ratio_median']:.3f}x)", flush=True)  # fmt: skip
    return out


# -- report ---------------------------------------------------------------------------


def fmt(s: dict, scale: float = 1.0, digits: int = 1) -> str:
    return (f"{s['median'] * scale:.{digits}f} ({s['min'] * scale:.{digits}f}-"
            f"{s['max'] * scale:.{digits}f})")  # fmt: skip


def http_rows(h: dict) -> list[tuple[str, dict, dict, str]]:
    def col(key, field):
        return summary([r[field] for r in h["headline"][key]])

    rows = []
    for label, field, scale, better in (
        ("aggregate tok/s", "aggregate_tokens_per_second", 1.0, "higher"),
        ("TTFT p50 (ms)", "ttft_p50", 1e3, "lower"),
        ("TTFT p95 (ms)", "ttft_p95", 1e3, "lower"),
        ("inter-token p50 (ms)", "itl_p50", 1e3, "lower"),
        ("/health p99 (ms)", "health_p99", 1e3, "lower"),
        ("/health max (ms)", "health_max", 1e3, "lower"),
    ):
        a, b = col("ours", field), col("mlx_lm", field)
        a = {k: (v * scale if k != "all" else v) for k, v in a.items()}
        b = {k: (v * scale if k != "all" else v) for k, v in b.items()}
        rows.append((label, a, b, f"{a['median'] / b['median']:.2f}x ({better} is better)"))
    # Our event loop runs HTTP, SSE and every actor; theirs hands work to threads,
    # so only our own figure means something (the target: 0.3 ms or less).
    loop = col("ours", "loop_ms_per_token")
    if loop["all"]:
        label = "event-loop CPU per streamed token, /health probes taken out (ms)"
        rows.append((label, loop, None, "target <= 0.3"))
    return rows


def plot(h: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("ours", "mlx-nursery serve"), ("mlx_lm", "mlx_lm.server")):
        clients = sorted(h["sweep"][key], key=int)
        xs = [int(c) for c in clients]
        ax1.plot(xs, [h["sweep"][key][c]["aggregate_tokens_per_second"] for c in clients],
                 marker="o", label=label)  # fmt: skip
        ax2.plot(xs, [h["sweep"][key][c]["ttft_p95"] * 1e3 for c in clients], marker="o",
                 label=label)  # fmt: skip
    ax1.set(xlabel="concurrent streaming clients", ylabel="aggregate tok/s (wall clock)",
            title="Throughput")  # fmt: skip
    ax2.set(xlabel="concurrent streaming clients", ylabel="TTFT p95 (ms)",
            title="Time to first token")  # fmt: skip
    for ax in (ax1, ax2):
        ax.set_xticks([1, 2, 4, 8])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [
        f"Run {env['date']} on {env['machine']}; BLAS: {env['blas']}; model: {env['model']} "
        f"(float32); mlx {env['mlx']}, mlx-lm {env['mlx_lm']}; {env['repeats']} paired repeats, "
        "median (min-max).",
        "",
        "| measurement | mlx-nursery | mlx-lm | ratio |",
        "| --- | --- | --- | --- |",
    ]
    for row in results["engine"]:
        lines.append(f"| {row['name']} | {fmt(row['ours'])} | {fmt(row['mlx_lm'])} | "
                     f"{fmt(row['ratio'], digits=3)} |")  # fmt: skip
    lines += [
        "",
        "HTTP, 8 streaming clients, 16 requests x 128 tokens, ~64-word prompts "
        "(`mlx-nursery serve --batch 8` vs `mlx_lm.server --decode-concurrency 8`):",
        "",
        "| figure | mlx-nursery | mlx_lm.server | ours / theirs |",
        "| --- | --- | --- | --- |",
    ]
    for label, a, b, ratio in http_rows(results["http"]):
        theirs = "-" if b is None else fmt(b)
        lines.append(f"| {label} | {fmt(a, digits=2 if b is None else 1)} | {theirs} | {ratio} |")
    lines += ["", "Clients sweep (requests = 2 x clients):", "",
              "| clients | ours tok/s | theirs tok/s | ours TTFT p95 (ms) | theirs TTFT p95 (ms) |",
              "| --- | --- | --- | --- | --- |"]  # fmt: skip
    sweep = results["http"]["sweep"]
    for c in sorted(sweep["ours"], key=int):
        a, b = sweep["ours"][c], sweep["mlx_lm"][c]
        lines.append(f"| {c} | {a['aggregate_tokens_per_second']:.1f} | "
                     f"{b['aggregate_tokens_per_second']:.1f} | {a['ttft_p95'] * 1e3:.0f} | "
                     f"{b['ttft_p95'] * 1e3:.0f} |")  # fmt: skip
    wv = results["http"].get("with_viewers")
    if wv:
        lines += ["", f"With {VIEWERS} dashboard viewers open (`/dashboard/events`) during one "
                  f"more 8-client load: {wv['aggregate_tokens_per_second']:.1f} tok/s, "
                  f"/health p99 {wv['health_p99'] * 1e3:.1f} ms, max "
                  f"{wv['health_max'] * 1e3:.1f} ms."]  # fmt: skip
    lines += ["", "![HTTP comparison by clients](bench/http_clients.png)"]
    lines += peer_rows(results["http"])
    sp = results["http"].get("shared_prefix")
    if sp:
        lines += [
            "",
            f"Shared system prompt ({sp['prompt_tokens']:,} tokens): agent 1 alone, then agents "
            "2-8 at once, each with its own last line (TTFT, 16-token answers):",
            "",
            "| server | agent 1 TTFT (ms) | agents 2-8 TTFT median / max (ms) | ratio (median) |",
            "| --- | --- | --- | --- |",
        ]
        for key, label in (("ours", "mlx-nursery"), ("mlx_lm", "mlx_lm.server")):
            r = sp[key]
            lines.append(
                f"| {label} | {r['agent1_ttft'] * 1e3:.0f} | "
                f"{statistics.median(r['others_ttft']) * 1e3:.0f} / "
                f"{max(r['others_ttft']) * 1e3:.0f} | {r['ratio_median']:.3f}x |"
            )
    return "\n".join(lines)


def peer_rows(h: dict) -> list[str]:
    """The peers against us: 8 clients (medians of the repeats), then the sweep."""
    peers = h.get("peers") or {}
    if not peers:
        return []

    def med(runs: list[dict], field: str) -> float:
        return statistics.median(r[field] for r in runs)

    ours = h["headline"]["ours"]
    tok, p95 = med(ours, "aggregate_tokens_per_second"), med(ours, "ttft_p95")
    lines = ["", "Peers, each alone on the same load (`vllm-mlx serve --continuous-batching`, "
             "`rapid-mlx serve`; a fresh `HOME` each, so no prefix cache carries over):", "",
             "| server | aggregate tok/s | TTFT p50 (ms) | TTFT p95 (ms) | ours / theirs tok/s "
             "| ours / theirs TTFT p95 |", "| --- | --- | --- | --- | --- | --- |",
             f"| mlx-nursery | {tok:.1f} | {med(ours, 'ttft_p50') * 1e3:.0f} | {p95 * 1e3:.0f} "
             "| 1.00x | 1.00x |"]  # fmt: skip
    for name, r in peers.items():
        t, q = med(r["headline"], "aggregate_tokens_per_second"), med(r["headline"], "ttft_p95")
        lines.append(f"| {name} | {t:.1f} | {med(r['headline'], 'ttft_p50') * 1e3:.0f} | "
                     f"{q * 1e3:.0f} | {tok / t:.2f}x | {p95 / q:.2f}x |")  # fmt: skip
    lines += ["", "| clients | " + " | ".join(f"{n} tok/s / TTFT p95 (ms)" for n in peers) + " |",
              "| --- |" + " --- |" * len(peers)]  # fmt: skip
    for c in sorted(h["sweep"]["ours"], key=int):
        cells = [f"{r['sweep'][c]['aggregate_tokens_per_second']:.1f} / "
                 f"{r['sweep'][c]['ttft_p95'] * 1e3:.0f}" for r in peers.values()]  # fmt: skip
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines


def write_docs(results: dict, section: str) -> None:
    """Raw figures, the plot and the tables of one section (one model) of the page."""
    out = DOCS / "bench"
    out.mkdir(parents=True, exist_ok=True)
    suffix = f"-{section}" if section else ""
    (out / f"results{suffix}.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results["http"], out / f"http_clients{suffix}.png")
    doc = DOCS / "benchmarks.md"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    tag = f"bench:{section}:" if section else "bench:"
    start, end = f"<!-- {tag}start -->", f"<!-- {tag}end -->"
    if start not in text:
        text += f"\n{start}\n{end}\n"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    body = markdown(results).replace("bench/http_clients.png", f"bench/http_clients{suffix}.png")
    doc.write_text(f"{head}{start}\n{body}\n{end}{tail}")


def _write_section(tag: str, body: str, page: str = "benchmarks.md") -> None:
    """Replace (or add) the ``<!-- bench:TAG:start/end -->`` block of the page."""
    doc = DOCS / page
    start, end = f"<!-- bench:{tag}:start -->", f"<!-- bench:{tag}:end -->"
    text = doc.read_text()
    if start not in text:
        text += f"\n{start}\n{end}\n"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{start}\n{body}\n{end}{tail}")


def write_constraint_doc(row: dict, label: str) -> None:
    body = "\n".join([
        f"Run {time.strftime('%Y-%m-%d')}; BLAS: {blas()}; model: {label} (float32); "
        "8 rows x 64 tokens at B=8, mean GPU time of a decode step, median (min-max) of "
        "paired repeats.",
        "",
        "| measurement | constrained | free | ratio |",
        "| --- | --- | --- | --- |",
        f"| {row['name']} | {fmt(row['ours'])} | {fmt(row['mlx_lm'])} | "
        f"{fmt(row['ratio'], digits=3)} |",
    ])  # fmt: skip
    _write_section("constraints", body)


def copies(model, tokenizer, repeats: int, label: str) -> None:
    """Join/leave copy traffic before (legacy) and after this engine's mechanisms."""
    runs = {"now": [], "legacy": []}
    for _ in range(repeats):
        for key in runs:
            runs[key].append(copy_traffic(model, tokenizer, legacy=key == "legacy"))
            print(f"  copies {key}: {runs[key][-1]}", flush=True)

    def med(key: str, field: str) -> float:
        return statistics.median(r[field] for r in runs[key])

    rows = []
    modes = (
        ("legacy", "alone + merge on join, filter on leave"),
        ("now", "padded group prefill, retired slots refilled in place"),
    )
    for key, what in modes:
        rows.append(f"| {what} | {med(key, 'bytes_per_token') / 1e3:.1f} | "
                    f"{med(key, 'tokens_per_second'):.1f} | {med(key, 'refilled'):.0f} | "
                    f"{med(key, 'prefilled_together'):.0f} |")  # fmt: skip
    body = "\n".join([
        f"Run {time.strftime('%Y-%m-%d')}; BLAS: {blas()}; model: {label} (float32); 8 agents "
        "in a closed loop over 32 requests (~300-token prompts, answers of 24-160 tokens, "
        f"so rows leave and join mid-batch), no prompt cache; medians of {repeats} runs.",
        "",
        "| joins and leaves | KV KB copied per generated token | tok/s | joins in place "
        "| rows prefilled together |",
        "| --- | --- | --- | --- | --- |",
        *rows,
    ])  # fmt: skip
    _write_section("copies", body)


def _loopback_bytes() -> int:
    """Bytes through the loopback interface so far (Linux; every rank's sends)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[0])
    return 0


def _config(model: str) -> dict:
    return json.loads((Path(model) / "config.json").read_text())


def _rank_threads(ranks: int) -> str:
    """OpenBLAS threads for each of ``ranks`` processes: the cores shared out."""
    return str(max(1, (os.cpu_count() or 1) // ranks))


def scale_out_run(model: str, ranks: int, clients: int) -> dict:
    """One sharded server (``--ranks``), one load: tok/s, TTFT, and what crossed
    the loopback per token (every rank's collectives, the plans, and the HTTP
    of the load itself), with the plans alone from rank 0's figures."""
    threads = _rank_threads(ranks)
    argv = [sys.executable, "-m", "mlx_nursery.server.cli", "serve", "--model", model,
            "--ranks", str(ranks), "--log-level", "WARNING"]  # fmt: skip
    env = {"OPENBLAS_NUM_THREADS": threads}
    with Server(f"{ranks} ranks", argv, free_port(), start_seconds=300, env=env) as server:
        load(server, 1, 1, seed=99)  # warm-up
        before = httpx.get(f"{server.url}/stats").json()
        lo0 = _loopback_bytes()
        report = load(server, clients, clients * 2, seed=ranks)
        lo = _loopback_bytes() - lo0
        after = httpx.get(f"{server.url}/stats").json()
    plans = plan_seconds = 0
    if ranks > 1:
        r0, b0 = after["ranks"][0], before["ranks"][0]
        plans = (r0["plan_bytes"] - b0["plan_bytes"]) * (ranks - 1)
        plan_seconds = r0["plan_seconds"] - b0["plan_seconds"]
    tokens = report["completion_tokens"]
    processed = tokens + after["prefill_tokens"] - before["prefill_tokens"]
    return {
        "ranks": ranks,
        "clients": clients,
        "openblas_threads": int(threads),
        "tok_s": report["aggregate_tokens_per_second"],
        "ttft_p50": report["ttft_p50"],
        "errors": report["errors"],
        "tokens": tokens,
        "processed_tokens": processed,
        "loopback_bytes_per_processed_token": lo / max(1, processed),
        "plan_bytes_per_token": plans / max(1, tokens),
        "plan_us_per_token": plan_seconds / max(1, tokens) * 1e6,
    }


def mlx_lm_tp_rank(model: str) -> None:
    """One rank of mlx-lm's own tensor-parallel generation (``--tp-rank``, run
    under the launcher by :func:`mlx_lm_tp`): ``sharded_load`` (plain ``load`` on
    one rank), then mlx-lm's ``generate_step`` (what ``stream_generate`` runs)
    for 128 greedy tokens after a 64-token prompt, twice; rank 0 prints the
    second run's decode tok/s as JSON."""
    import mlx.core as mx
    from mlx_lm import load as mlx_load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import sharded_load


    group = mx.distributed.init(backend="ring", strict=False)
    if group.size() > 1:
        loaded, _ = sharded_load(model, tensor_group=group)
    else:
        loaded, _ = mlx_load(model)
    cast(loaded, "auto")  # the engine's dtype: float32 on a CPU
    prompt = mx.array(list(range(10, 74)))
    for _ in range(2):  # the first warms up
        steps = generate_step(prompt, loaded, max_tokens=BATCH_TOKENS, sampler=make_sampler(0.0))
        next(steps)  # the prompt's token: timed from here, as stream_generate does
        t0 = time.perf_counter()
        decoded = sum(1 for _ in steps)  # no stop at EOS: every run decodes as many
        tok_s = decoded / (time.perf_counter() - t0)
    if group.rank() == 0:
        print(json.dumps({"tp_tok_s": tok_s}), flush=True)


def mlx_lm_tp(model: str, ranks: int) -> float:
    """mlx-lm's own tensor-parallel generation at B=1 on ``ranks``
    ranks, under the same launcher and BLAS threads as the server: the ceiling
    the sharded engine is measured against (no HTTP, no batching)."""

    threads = _rank_threads(ranks)
    rank = [sys.executable, str(Path(__file__).resolve()), "--tp-rank", model]
    command = rank
    if ranks > 1:
        command = [sys.executable, "-c", MLX_LAUNCH, "--backend", "ring", "--hosts",
                   "127.0.0.1", "-n", str(ranks), "--", *rank]  # fmt: skip
    out = subprocess.run(command, env=dict(os.environ, OPENBLAS_NUM_THREADS=threads),
                         stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         timeout=900, check=True).stdout  # fmt: skip
    line = next(x for x in out.splitlines() if x.lstrip().startswith('{"tp_tok_s"'))
    return json.loads(line)["tp_tok_s"]


def collective_bytes(config: dict, ranks: int) -> float:
    """What mlx-lm's tensor parallel sends per token, all ranks together: two
    float32 all_sums of the hidden state a layer; mlx's ring all_sum moves
    2(N-1) times the array in all (reduce-scatter, then all-gather; measured)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    return 2 * layers * hidden * 4 * 2 * (ranks - 1)


def scale_out(models: list[tuple[str, str, list[int]]]) -> None:
    rows = []
    tp: dict[tuple[str, int], float] = {}
    for label, model, counts in models:
        base = None
        for ranks in counts:
            tp[model, ranks] = mlx_lm_tp(model, ranks)
            print(json.dumps({"ranks": ranks, "mlx_lm_tp_tok_s": tp[model, ranks]}), flush=True)
            for clients in (1, 8):
                run = scale_out_run(model, ranks, clients)
                print(json.dumps(run), flush=True)
                if ranks == counts[0]:
                    base = base or {}
                    base[clients] = run
                rows.append((label, model, run, base[clients]))
    lines = [
        f"Run {time.strftime('%Y-%m-%d')} on this machine ({os.cpu_count()} cores, "
        f"{platform.machine()} Linux, no GPU); BLAS: {blas()}, OpenBLAS threads per rank "
        "= cores / ranks; float32; ring backend on loopback. Each load: the benchmark "
        f"client, {BATCH_TOKENS} tokens per request, about 64-token prompts, 2 requests "
        "per client. Loopback bytes count every rank's sends (collectives, plans, "
        "heartbeats) and the load's own HTTP (the HTTP alone: the 1-rank rows), per "
        "processed token (prompt tokens computed plus tokens generated); plans per "
        "generated token, bytes to all followers and rank 0's GPU-thread time making, "
        "sending and walking them. mlx-lm TP: mlx-lm's own tensor-parallel generation "
        "(`generate_step`, what `stream_generate` runs) on as many ranks under the same "
        "launcher, one request, no HTTP (decode tok/s, and against its own one-rank "
        "figure).",
        "",
        "| model | ranks | clients | tok/s | vs 1 rank | mlx-lm TP, B=1 | TTFT p50 | "
        "loopback B/token | collectives B/token, arithmetic | plans B/token | "
        "plans, rank 0 us/token |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    first = {model: counts[0] for _, model, counts in models}
    for label, model, run, base in rows:
        ref = "-"
        if run["clients"] == 1:
            own = tp[model, run["ranks"]]
            ref = f"{own:.1f} ({own / tp[model, first[model]]:.2f}x)"
        arith = collective_bytes(_config(model), run["ranks"])
        ttft = "-" if run["ttft_p50"] is None else f"{run['ttft_p50'] * 1e3:.0f} ms"
        lines.append(
            f"| {label} | {run['ranks']} | {run['clients']} | {run['tok_s']:.1f} | "
            f"{run['tok_s'] / base['tok_s']:.2f}x | {ref} | {ttft} | "
            f"{run['loopback_bytes_per_processed_token']:,.0f} | {arith:,.0f} | "
            f"{run['plan_bytes_per_token']:,.0f} | {run['plan_us_per_token']:,.0f} |"
        )
    _write_section("scale-out", "\n".join(lines), page="scale-out.md")
    print("\n".join(lines))


# -- the overload storm ------------------------------------------------------------

HEALTH_TARGET = 0.020  # /health p99 under the storm (issue 11)


RESTART_TOKENS = 4000  # an agent's context (Codex's first request is ~6k)


def restart_ttft(server: Server, prompt: str) -> tuple[float, float]:
    """TTFT of one agent prompt, cold, then again from a restarted process."""
    out = []
    for _ in range(2):
        with server:

            async def ask():
                async with httpx.AsyncClient(base_url=server.url, timeout=900) as client:
                    return await _ttft(client, prompt)

            out.append(trio.run(ask))
    return out[0], out[1]


def restart(models: list[tuple[str, str]], tokens: int, repeats: int) -> None:
    """An agent prompt of ``tokens`` tokens, cold and after a restart: ours (the
    disk tier on by default, in a fresh folder) against ``mlx_lm.server``."""
    rows = []
    for label, model in models:
        from mlx_lm import load as mlx_load

        _, tokenizer = mlx_load(model)
        prompt = shared_prefix_prompts(tokenizer, tokens, agents=1)[0]
        figures = {"ours": [], "mlx_lm.server": []}
        for r in range(repeats):
            with tempfile.TemporaryDirectory() as kv:
                ours, theirs = both_servers(model)
                ours.env = {KV_DIR_ENV: kv}
                figures["ours"].append(restart_ttft(ours, f"{prompt} ({r})"))
                figures["mlx_lm.server"].append(restart_ttft(theirs, f"{prompt} ({r})"))
        for name, runs in figures.items():
            cold = statistics.median(c for c, _ in runs)
            warm = statistics.median(w for _, w in runs)
            rows.append(f"| {label} | {name} | {cold:.2f} | {warm:.2f} | {warm / cold:.3f} |")
        print(rows[-2], rows[-1], sep="\n", flush=True)
    body = (
        f"Run {time.strftime('%Y-%m-%d')}; BLAS: {blas()}; float32; one agent prompt of "
        f"~{tokens} tokens (a 16-token answer), TTFT in a fresh process, then again after "
        f"SIGTERM and a new start; {repeats} run(s), medians (a new prompt each).\n\n"
        "| model | server | TTFT cold (s) | TTFT after a restart (s) | ratio |\n"
        "| --- | --- | --- | --- | --- |\n" + "\n".join(rows)
    )
    _write_section("restart", body)


FLOOD_FLAGS = ("--batch", "4", "--prompt-cache-bytes", "96M")


def flood_server(model: str, *flags: str) -> Server:
    """Its disk tier in an empty scratch folder, removed when it stops (a named
    folder here was never removed: dozens of runs filled the disk, and the tier's
    default cap, a share of the free disk, shrank until the FIFO row's history
    was evicted from disk as well as memory)."""
    return Server(
        "mlx-nursery",
        [sys.executable, "-m", "mlx_nursery.server.cli", "serve", "--model", model,
         *FLOOD_FLAGS, *flags, "--log-level", "WARNING"],
        free_port(),
    )  # fmt: skip


def _against(values: list[float], base: float, digits: int) -> str:
    """The median of ``values`` and its ratio to ``base``."""
    if not values:
        return "-"
    m = statistics.median(values)
    return f"{m:.{digits}f} ({m / base:.2f}x)"


def _beside(reports: list, phase: str) -> str:
    """A's rate in ``phase`` against its rate before B, in the same runs (median)."""
    ratios = [getattr(r, phase) / r.agent_before for r in reports
              if getattr(r, phase) is not None and r.agent_before]  # fmt: skip
    return f"{statistics.median(ratios):.2f}x" if ratios else "-"


def _flood_runs(model: str, cases: dict, spec_of: Callable, repeats: int,
                tag: str) -> dict[str, list]:  # fmt: skip
    """Each case's reports over ``repeats`` rounds, a fresh server a run: a case is
    (the server's flags, ``run_flood``'s sides ``agents`` / ``main`` and the
    spec's own fields, e.g. ``sessions``)."""
    from flood import run_flood

    runs: dict[str, list] = {name: [] for name in cases}
    for r in range(repeats):
        for name, (flags, how) in cases.items():
            sides = {k: v for k, v in how.items() if k in ("agents", "main")}
            fields = {k: v for k, v in how.items() if k not in sides}
            with flood_server(model, *flags) as server:
                spec = spec_of(url=server.url, seed=r, **fields)
                report = trio.run(functools.partial(run_flood, spec, **sides))
            runs[name].append(report)
            turns = ", ".join(f"{t:.2f}" for t in report.turn_seconds)
            cached = ", ".join(f"{c:.2f}" for c in report.history_cached)
            rate = report.agent_tokens_per_second
            phases = "/".join("-" if v is None else f"{v:.1f}" for v in
                              (report.agent_before, report.agent_in_turns, report.agent_between))
            print(f"  {tag} {name}: B turns [{turns}] s, cached [{cached}], A "
                  f"{'-' if rate is None else f'{rate:.1f}'} tok/s (before/in turns/between "
                  f"{phases}), everyone {report.tokens_per_second:.1f} tok/s, paused "
                  f"{report.paused}, errors {len(report.errors)}", flush=True)  # fmt: skip
    return runs


def flood(model: str, label: str, repeats: int) -> None:
    """Issue #25's flood (``bench/flood.py``): B's turns alone, A's sub-agents
    alone, then both, with sessions (pausing on, and off) and without (every
    request alone: one FIFO); each run on a fresh server (batch 4, a 96 MB
    prompt-cache cap, no disk tier carried over)."""
    from flood import FloodSpec

    cases = {
        "B alone": ((), {"agents": False}),
        "A alone": ((), {"main": False}),
        "sessions, pausing": ((), {}),
        "sessions, no pausing": (("--pause-after", "off"), {}),
        "one FIFO (no session header)": ((), {"sessions": False}),
    }
    runs = _flood_runs(model, cases, FloodSpec, repeats, "flood")
    solo = statistics.median(t for rep in runs["B alone"] for t in rep.turn_seconds)
    alone = statistics.median(rep.agent_tokens_per_second for rep in runs["A alone"])
    rows = []
    for name, reps in runs.items():
        turns = [t for rep in reps for t in rep.turn_seconds]
        cached = [c for rep in reps for c in rep.history_cached]
        rates = [rep.agent_tokens_per_second for rep in reps if rep.agent_tokens_per_second]
        b = _against(turns, solo, 2)
        c = f"{100 * min(cached):.0f}%" if cached else "-"
        a = _against(rates, alone, 1)
        worst = f"{max(turns):.2f}" if turns else "-"
        paused = sum(rep.paused for rep in reps)
        total = _against([rep.tokens_per_second for rep in reps], alone, 1)
        during, between = (_beside(reps, phase) for phase in ("agent_in_turns", "agent_between"))
        rows.append(f"| {name} | {b} | {worst} | {c} | {a} | {total} | {paused} | {during} | "
                    f"{between} |")  # fmt: skip
    spec = FloodSpec(url="")
    body = (
        f"Run {time.strftime('%Y-%m-%d')}; BLAS: {blas()}; float32; {label}; "
        f"`serve {' '.join(FLOOD_FLAGS)}`; {repeats} run(s), a fresh server each. Session "
        f"A keeps {spec.agents} sub-agent requests in flight (a shared ~"
        f"{spec.agent_system_words}-word system prompt, then a ~{spec.task_words}-word task; "
        f"{spec.agent_tokens}-token answers); session B runs {spec.turns} turns over a "
        f"~{spec.history_words}-word history ({spec.turn_tokens}-token answers, {spec.gap:g} s "
        f"between turns), once A has finished {spec.warmup_requests} requests. Both over "
        "`/v1/messages` with Claude Code's `X-Claude-Code-Session-Id`, except in the FIFO "
        "row. B's history is warm when A starts (its turn 0 ran first, unmeasured). B's "
        "turn: request to last token (median, and its ratio to B alone; worst); cached: "
        "the least share of a turn's history (the last turn's prompt and answer) served "
        "from the prompt cache; A's and everyone's completion tok/s over B's run (ratio "
        f"to A alone). The last two columns are A's tok/s while B's turns ran and in B's "
        f"gaps, against A's own over the {spec.before:g} s before B's first turn in the "
        "same server (the host's drift between runs does not reach them).\n\n"
        "| run | B's turn, median (s) | B's worst turn (s) | B's history cached | "
        "A's tok/s | everyone's tok/s | rows paused | A during B's turns | A between "
        "B's turns |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n" + "\n".join(rows)
    )
    print(body, flush=True)
    _write_section("flood", body)


def priority_flood(model: str, label: str, repeats: int) -> None:
    """Issue #64's flood (``bench/flood.py``, ``subagents``): the main agent's
    4-turn conversation over a 600-word history while eight of its own
    sub-agents flood ``/v1/messages`` with 192-token answers, all in one Claude
    Code session (the sub-agents' attribution line says ``cc_is_subagent=true;``):
    the main agent alone, then beside the flood with request classes (the
    default) and first come, first served (``--priorities off``), each run on a
    fresh server (batch 4, a 96 MB prompt-cache cap)."""
    from flood import FloodSpec

    spec_of = functools.partial(FloodSpec, agents=8, agent_tokens=192, history_words=600,
                                subagents=True)  # fmt: skip
    cases = {
        "main agent alone": ((), {"agents": False}),
        "classes (default)": ((), {}),
        "classes, a slot of room (--priority-room 1)": (("--priority-room", "1"), {}),
        "classes, two slots of room (--priority-room 2)": (("--priority-room", "2"), {}),
        "first come, first served (--priorities off)": (("--priorities", "off"), {}),
    }
    runs = _flood_runs(model, cases, spec_of, repeats, "priority flood")
    solo = statistics.median(t for rep in runs["main agent alone"] for t in rep.turn_seconds)
    fcfs = runs["first come, first served (--priorities off)"]
    base = statistics.median(rep.tokens_per_second for rep in fcfs)
    rows = []
    for name, reps in runs.items():
        turns = [t for rep in reps for t in rep.turn_seconds]
        cached = [c for rep in reps for c in rep.history_cached]
        c = f"{100 * min(cached):.0f}%" if cached else "-"
        total = "-" if name == "main agent alone" else _against(
            [rep.tokens_per_second for rep in reps], base, 1)  # fmt: skip
        rows.append(f"| {name} | {_against(turns, solo, 2)} | {max(turns):.2f} | {c} | {total} | "
                    f"{sum(rep.paused for rep in reps)} |")  # fmt: skip
    spec = spec_of(url="")
    body = (
        f"Run {time.strftime('%Y-%m-%d')}; BLAS: {blas()}; float32; {label}; "
        f"`serve {' '.join(FLOOD_FLAGS)}`; {repeats} run(s), a fresh server each. The main "
        f"agent runs {spec.turns} turns over a ~{spec.history_words}-word history "
        f"({spec.turn_tokens}-token answers, {spec.gap:g} s between turns) while "
        f"{spec.agents} of its own sub-agents keep a request each in flight (a shared "
        f"~{spec.agent_system_words}-word system prompt, a ~{spec.task_words}-word task, "
        f"{spec.agent_tokens}-token answers), once they have finished "
        f"{spec.warmup_requests} requests; one Claude Code session over `/v1/messages`, "
        "every request with Claude Code's attribution line (the sub-agents' with "
        "`cc_is_subagent=true;`) and a tool. The main agent's turn: request to last token "
        "(median, and its ratio to the main agent alone; worst); cached: the least share "
        "of a turn's history served from the prompt cache; everyone's completion tok/s "
        "over the main agent's run, against the same flood first come, first served.\n\n"
        "| run | main agent's turn, median (s) | worst (s) | history cached | "
        "everyone's tok/s | rows paused |\n"
        "| --- | --- | --- | --- | --- | --- |\n" + "\n".join(rows)
    )
    print(body, flush=True)
    _write_section("priority-flood", body)


def storm_figures(result) -> dict:
    statuses = [a.status for a in result.answers]
    return {
        "health_p50": result.health_percentile(0.5),
        "health_p99": result.health_percentile(0.99),
        "health_max": result.health_percentile(1.0),
        "ok": statuses.count(200),
        "refused": statuses.count(429),
        "other": len(statuses) - statuses.count(200) - statuses.count(429),
        "wall_seconds": result.wall_seconds,
    }


def overload(models: list[tuple[str, str]], repeats: int) -> None:
    """The reliability suite's storm (``bench.storm``: 64 agents x 5 requests of 40
    tokens, honouring Retry-After) as a benchmark: /health latency from a third
    process, ours with a queue of 8 against mlx_lm.server (which bounds nothing:
    it takes every request); into docs/reliability.md."""
    texts = prompts(LoadSpec(url="", requests=16, seed=7))
    lines = [
        f"Run {time.strftime('%Y-%m-%d')} on {platform.machine()} Linux, {os.cpu_count()} "
        f"cores; BLAS: {blas()}; float32; {repeats} storms per server, alternating, "
        "median (min-max). Target: /health p99 under "
        f"{HEALTH_TARGET * 1e3:.0f} ms.",
        "",
        "| model | server | /health p50 (ms) | /health p99 (ms) | /health max (ms) | "
        "200s | 429s | other | storm (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for label, model in models:
        ours, theirs = both_servers(model, "--max-queued-requests", "8")
        runs: dict[str, list[dict]] = {"mlx-nursery": [], "mlx_lm.server": []}
        with ours, theirs:
            for _ in range(repeats):
                for server in (ours, theirs):
                    r = storm_figures(trio.run(storm, server.url, texts))
                    runs[server.name].append(r)
                    p99, worst = r["health_p99"] * 1e3, r["health_max"] * 1e3
                    print(f"  storm {label} {server.name}: /health p99 {p99:.1f} ms, max "
                          f"{worst:.1f} ms, {r['ok']} answered, {r['refused']} refused",
                          flush=True)  # fmt: skip
        for name, rs in runs.items():
            cells = [fmt(summary([r[k] for r in rs]), 1e3) for k in
                     ("health_p50", "health_p99", "health_max")]  # fmt: skip
            counts = [fmt(summary([r[k] for r in rs]), digits=0) for k in
                      ("ok", "refused", "other", "wall_seconds")]  # fmt: skip
            lines.append(f"| {label} | {name} | {' | '.join(cells + counts)} |")
    _write_section("overload", "\n".join(lines), page="reliability.md")


# -- speculative decoding (issue #24) --------------------------------------------------

SPEC_TOKENS = 256  # tokens per answer, greedy
# (load, clients, requests): one client works through its tasks one after another
SPEC_LOADS = (("edit", 1, 4), ("edit", 8, 8), ("natural", 1, 2), ("natural", 8, 8))


# A server's first request, before each load: in none of the loads, so no load's
# answer is in the shared draft index (or mlx_lm.server's prompt cache) before it runs.
WARMUP = "Name three colours and one thing of each colour."


def _warmup_messages(i: int) -> list[dict]:
    return [{"role": "user", "content": WARMUP}]


async def _chat_load(
    url: str, kind: str, clients: int, requests: int, tokens: int = SPEC_TOKENS
) -> dict:
    """``requests`` chat completions (the edit tasks, natural questions or the
    warm-up, greedy, ``tokens`` each) from ``clients`` clients; end-to-end tok/s
    is the completion tokens over the load's wall time."""
    messages = {"edit": edit_messages, "natural": natural_messages}.get(kind, _warmup_messages)
    todo = list(range(requests))
    texts: dict[int, str] = {}
    usage: dict[int, dict] = {}

    async def client(http: httpx.AsyncClient) -> None:
        while todo:
            i = todo.pop(0)
            body = {"model": "default_model", "messages": messages(i), "temperature": 0.0,
                    "max_tokens": tokens}  # fmt: skip
            r = await http.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            data = r.json()
            texts[i] = data["choices"][0]["message"]["content"]
            usage[i] = data["usage"]

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=1800) as http, trio.open_nursery() as n:
        for _ in range(clients):
            n.start_soon(client, http)
    wall = time.perf_counter() - start
    tokens = sum(u["completion_tokens"] for u in usage.values())
    drafts = [u["speculative"] for u in usage.values() if "speculative" in u]
    return {
        "tokens": tokens, "wall": wall, "tps": tokens / wall,
        "texts": [texts[i] for i in range(requests)],
        "tokens_per_step": (
            sum(d["tokens_per_step"] * d["decode_steps"] for d in drafts)
            / sum(d["decode_steps"] for d in drafts) if drafts else None
        ),
        "kept": sum(d["accepted_tokens"] for d in drafts),
        "drafted": sum(d["draft_tokens"] for d in drafts),
    }  # fmt: skip


def _copied_share(model: str) -> float:
    """Of the edit answers' 3-grams (mlx_lm.server's texts, tokenized), the share
    found in their prompts: how much of an answer a prompt lookup could draft."""
    from mlx_lm import load as mlx_load

    _, tokenizer = mlx_load(model)
    seen = total = 0
    for i, text in enumerate(SPEC_TEXTS):
        prompt = tokenizer.apply_chat_template(edit_messages(i), add_generation_prompt=True)
        grams = {tuple(prompt[j : j + 3]) for j in range(len(prompt) - 2)}
        out = tokenizer.encode(text, add_special_tokens=False)
        total += max(0, len(out) - 2)
        seen += sum(tuple(out[j : j + 3]) in grams for j in range(len(out) - 2))
    return seen / total if total else 0.0


SPEC_TEXTS: list[str] = []


def speculative(
    models: list[tuple[str, str]],
    loads: tuple = SPEC_LOADS,
    rounds: int = 1,
    peers: tuple[str, ...] = (),
    section: str | None = None,
) -> None:
    """The edit workload and natural chat at 1 and 8 clients: ours (the
    defaults), ours with ``--speculative off``, ``--cpu-softmax off`` and
    ``--compile off``, ``--packed-weights off``, ``mlx_lm.server`` and the ``peers``, one
    server alive at a time. With
    ``rounds`` above 1 the servers take turns that many times, in reverse order
    every other round (this VM drifts by up to 20% over minutes: in one order,
    the side that runs last takes the drift), and each figure is the mean over
    rounds. The whole set of loads writes the bench:speculative section; a
    subset writes ``section`` (default bench:speculative-rounds)."""
    rows = []
    for label, model in models:
        sides = {
            "mlx_lm.server": Server(
                "mlx_lm.server",
                [sys.executable, "-m", "mlx_lm.server", "--model", model,
                 "--decode-concurrency", "8", "--log-level", "WARNING"],
                free_port(),
            ),
            "ours, speculation off": both_servers(model, "--speculative", "off")[0],
            "ours, mlx's softmax": both_servers(model, "--cpu-softmax", "off")[0],
            "ours, compile off": both_servers(model, "--compile", "off")[0],
            "ours, packed off": both_servers(model, "--packed-weights", "off")[0],
            "ours": both_servers(model)[0],
            **{p: peer_server(p, model) for p in peers},
        }  # fmt: skip
        runs: dict[str, dict[tuple, list[dict]]] = {name: {} for name in sides}
        for turn in range(rounds):
            for name in list(sides)[:: -1 if turn % 2 else 1]:
                # A fresh server for each load: the edit tasks of edit x1 recur in
                # edit x8, and a server that had answered them drafts edit x8's
                # answers whole from its shared index (1.53x where a fresh one
                # read 1.33x).
                for kind, clients, requests in loads:
                    with sides[name] as server:
                        trio.run(_chat_load, server.url, "warmup", 1, 1, 64)
                        r = trio.run(_chat_load, server.url, kind, clients, requests)
                        runs[name].setdefault((kind, clients), []).append(r)
                        print(f"  speculative {label} {name} {kind} x{clients}: "
                              f"{r['tps']:.1f} tok/s ({r['tokens']} tokens, {r['wall']:.1f} s), "
                              f"tokens/step {r['tokens_per_step']}", flush=True)  # fmt: skip
        got = {  # the median round's figures, with the mean rate over rounds
            name: {
                key: {**sorted(rs, key=lambda r: r["tps"])[len(rs) // 2],
                      "tps": sum(r["tps"] for r in rs) / len(rs)}
                for key, rs in by.items()
            }
            for name, by in runs.items()
        }  # fmt: skip
        base = got["mlx_lm.server"]
        for kind, clients, _ in loads:
            key = (kind, clients)
            same = sum(a == b for a, b in zip(got["ours"][key]["texts"], base[key]["texts"],
                                              strict=True))  # fmt: skip
            ours, off = got["ours"][key], got["ours, speculation off"][key]
            slow = got["ours, mlx's softmax"][key]
            plain = got["ours, compile off"][key]
            unpacked = got["ours, packed off"][key]
            spread = ""
            if rounds > 1:
                spread = " | " + ", ".join(
                    f"{o['tps'] / b['tps']:.2f}x"
                    for o, b in zip(runs["ours"][key], runs["mlx_lm.server"][key], strict=True)
                )
            sides_here = (off, slow, plain, unpacked, ours, *(got[p][key] for p in peers))
            rate = " | ".join(f"{r['tps']:.1f} ({r['tps'] / base[key]['tps']:.2f}x)"
                              for r in sides_here)  # fmt: skip
            rows.append(
                f"| {label} | {kind} | {clients} | {base[key]['tps']:.1f} | {rate} | "
                f"{ours['tokens_per_step'] or 1:.2f} | {ours['kept']} / {ours['drafted']} | "
                f"{same} / {len(base[key]['texts'])}{spread} |"
            )
        if ("edit", 1) in got["mlx_lm.server"]:
            SPEC_TEXTS[:] = base[("edit", 1)]["texts"]
            share = _copied_share(model)
            rows.append(f"| {label} | edit answers' 3-grams found in their prompt | "
                        f"{100 * share:.0f}% |" + " |" * (8 + len(peers)))  # fmt: skip
    rounds_note = (
        f" {rounds} rounds, the servers taking turns in reverse order every other round; "
        "each rate is the mean over rounds (the other figures are the median round's), "
        "and the last column has each round's ratio of ours to mlx_lm.server."
        if rounds > 1 else ""
    )
    peers_note = (
        " Peers (" + ", ".join(f"`{PEERS[p][0]}`" for p in peers) + ") run alone on the same "
        "loads, each with a fresh HOME; neither drafts." if peers else ""
    )
    body = "\n".join([
        f"Run {time.strftime('%Y-%m-%d')}; BLAS: {blas()}; float32; greedy, {SPEC_TOKENS} "
        "tokens per answer over `/v1/chat/completions`; one server alive at a time, "
        "`--batch 8` / `--decode-concurrency 8`. Edit: `bench/edits.py`, a 15-40 line file "
        "and one small change, \"output only the code\" (1 client works through 4 tasks, 8 "
        "clients through 8); natural: open questions (2 and 8). tok/s: completion tokens "
        "over the load's wall time, ratio to mlx_lm.server. Same text: answers identical "
        f"to mlx_lm.server's.{rounds_note}{peers_note}",
        "",
        "| model | load | clients | mlx_lm.server tok/s | ours, speculation off | ours, "
        "mlx's softmax (`--cpu-softmax off`) | ours, `--compile off` | ours, "
        "`--packed-weights off` | ours (defaults) | "
        + "".join(f"{p} | " for p in peers)
        + "tokens per step (row) | drafts kept / drafted | same text |"
        + (" rounds |" if rounds > 1 else ""),
        "| --- " * (12 + len(peers)) + "|" + (" --- |" if rounds > 1 else ""),
        *rows,
    ])  # fmt: skip
    whole = set(loads) == set(SPEC_LOADS)
    _write_section("speculative" if whole else section or "speculative-rounds", body)


def float32_copy(gguf_file: Path) -> Path:
    """The converted GGUF model, dequantized to float32 and saved, so that both
    servers (mlx_lm.server has no dtype flag) and both in-process sides run the
    same float32 weights."""
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model, load, save_model
    from mlx_nursery.actors.models.registry import resolve

    source = Path(resolve(gguf_file))
    out = source.with_name(source.name + "-dequantized")
    if (out / "config.json").is_file():
        return out
    model, _ = load(str(source))
    model.set_dtype(mx.float32)
    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(tmp, model)
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp / name)
    tmp.replace(out)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="the benchmark model directory")
    parser.add_argument(
        "--real",
        action="store_true",
        help="benchmark the default real model (SmolLM2-135M-Instruct) in float32",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument(
        "--peers",
        action="store_true",
        help="also vllm-mlx and rapid-mlx over HTTP (installed on first use; slow)",
    )
    parser.add_argument(
        "--constraints", action="store_true", help="only the constrained-decoding step cost"
    )
    parser.add_argument(
        "--copies", action="store_true", help="only the KV copy traffic of joins and leaves"
    )
    parser.add_argument(
        "--scale-out",
        action="store_true",
        help="only the sharded server: tok/s and bytes per token on 1-3 ranks "
        "(the 30M's 12-head twin, and SmolLM2 on 1 and 3); writes docs/scale-out.md",
    )
    parser.add_argument(
        "--overload",
        action="store_true",
        help="only the overload storm: /health latency while 64 agents overrun a queue "
        "of 8, against mlx_lm.server (the golden llama and --model); writes "
        "docs/reliability.md",
    )
    parser.add_argument(
        "--restart",
        action="store_true",
        help="only the restart: an agent prompt's TTFT cold and after a restart, against "
        "mlx_lm.server (--model, and SmolLM2 with --real)",
    )
    parser.add_argument(
        "--flood",
        action="store_true",
        help="only the session flood (issue #25): a sub-agent fan-out against a main "
        "agent's turns, with and without sessions (--model)",
    )
    parser.add_argument(
        "--priority-flood",
        action="store_true",
        help="only the main agent against its own sub-agents (issue #64): request classes "
        "against first come, first served (--model)",
    )
    parser.add_argument(
        "--speculative",
        action="store_true",
        help="only speculative decoding (issue #24): the edit workload and natural chat at "
        "1 and 8 clients against mlx_lm.server (SmolLM2 float32, and --model)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="--speculative: the servers take turns this many times (median round)",
    )  # fmt: skip
    parser.add_argument(
        "--spec-loads", metavar="KIND:CLIENTS,...",
        help="--speculative: only these loads, e.g. natural:8 (written to their own section)",
    )  # fmt: skip
    parser.add_argument(
        "--spec-section", metavar="NAME",
        help="--speculative with --spec-loads: the docs/benchmarks.md section to write "
        "(default speculative-rounds)",
    )  # fmt: skip
    parser.add_argument("--tp-rank", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tp_rank:  # one rank of mlx_lm_tp, under the launcher
        mlx_lm_tp_rank(args.tp_rank)
        return 0

    lib = find_openblas()
    if lib and "openblas" not in os.environ.get("LD_PRELOAD", ""):
        os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()),
                                   *sys.argv[1:]], dict(os.environ, LD_PRELOAD=lib))  # fmt: skip

    from mlx_lm import load as mlx_load
    from mlx_nursery.actors.models.registry import DEFAULT, fetch

    if args.scale_out:
        twin = "bench-llama-30m-h12 (hidden 576, 12 / 6 heads; otherwise the 30M)"
        smollm2 = "SmolLM2-135M-Instruct (9 / 3 heads)"
        scale_out([
            (twin, str(bench_llama(shardable=True)), [1, 2, 3]),
            (smollm2, str(float32_copy(fetch(DEFAULT))), [1, 3]),
        ])  # fmt: skip
        return 0
    if args.overload:
        golden = ROOT / "goldens" / "models" / "llama"
        models = [("golden llama (the suite's)", str(golden))]
        if args.model:
            models.append(("bench-llama-30m", args.model))
        overload(models, args.repeats)
        return 0
    if args.restart:
        models = [("bench-llama-30m", args.model)] if args.model else []
        if args.real:
            models.append(("SmolLM2-135M-Instruct", str(float32_copy(fetch(DEFAULT)))))
        restart(models, RESTART_TOKENS, args.repeats)
        return 0
    if args.flood:
        flood(args.model, "bench-llama-30m (31M parameters)", args.repeats)
        return 0
    if args.priority_flood:
        priority_flood(args.model, "bench-llama-30m (31M parameters)", args.repeats)
        return 0
    if args.speculative:
        models = [("SmolLM2-135M-Instruct", str(float32_copy(fetch(DEFAULT))))]
        if args.model:
            models.append(("bench-llama-30m", args.model))
        loads = SPEC_LOADS
        if args.spec_loads:
            wanted = {tuple(x.split(":")) for x in args.spec_loads.split(",")}
            loads = tuple(load for load in SPEC_LOADS if (load[0], str(load[1])) in wanted)
        peers = tuple(PEERS) if args.peers else ()
        speculative(models, loads, args.rounds, peers, args.spec_section)
        return 0
    if args.real:
        args.model = str(float32_copy(fetch(DEFAULT)))
        label, section = "SmolLM2-135M-Instruct (dequantized from its Q4_1 GGUF)", "smollm2"
    elif args.model:
        label, section = "bench-llama-30m (hidden 512, 8 layers, vocab 8192)", ""
    else:
        parser.error("give --model DIR or --real")
    model, tokenizer = mlx_load(args.model)
    print(f"benchmarking {args.model} on {blas()}", flush=True)
    if args.constraints:
        row = constraint_cost(model, tokenizer, args.repeats)
        write_constraint_doc(row, label)
        return 0
    if args.copies:
        copies(model, tokenizer, args.repeats, label)
        return 0
    results = {
        "environment": {
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()} Linux, {os.cpu_count()} cores"
            if sys.platform.startswith("linux")
            else platform.platform(),
            "blas": blas(),
            "model": label,
            "mlx": metadata.version("mlx"),
            "mlx_lm": metadata.version("mlx-lm"),
            "repeats": args.repeats,
        },
        "engine": [
            paired(
                "1 request, decode tok/s (vs stream_generate)",
                lambda: engine_single(model, tokenizer),
                lambda: mlx_single(model, tokenizer),
                args.repeats,
            ),
            paired(
                "4 requests, aggregate tok/s (vs BatchGenerator)",
                lambda: engine_batch(model, tokenizer, 4),
                lambda: mlx_batch(model, tokenizer, 4),
                args.repeats,
            ),
            paired(
                "8 requests, aggregate tok/s (vs BatchGenerator)",
                lambda: engine_batch(model, tokenizer, 8),
                lambda: mlx_batch(model, tokenizer, 8),
                args.repeats,
            ),
        ],
    }
    if not args.skip_http:
        results["http"] = http(args.model, args.repeats, tokenizer)
        if args.peers:
            results["http"]["peers"] = peers_http(args.model, args.repeats, list(PEERS))
        write_docs(results, section)
    print(markdown(results) if "http" in results else json.dumps(results["engine"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
