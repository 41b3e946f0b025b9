"""Issue 62's table: what the host costs a token, where the forward costs nothing.

On the micro model (``goldens/make_micro_model.py``: one layer at hidden 64,
SmolLM2's tokenizer, random weights) a server's speed is its per-token host
work; on SmolLM2-135M (float32) the forward is most of a step. For each, in one
process and one run:

- in process, B = 1: mlx-lm's ``generate_step`` against the engine's decode
  (its ``decode_tokens_per_second``), on the portable path (``--compile off
  --packed-weights off --cpu-softmax off``: what runs on a GPU) and with the
  defaults;
- in process, B = 8: ``BatchGenerator`` against the engine, aggregate tok/s;
- the engine's step split by phase (``/stats`` ``host``): building the graph,
  waiting on the device, reading the step (sampling's results, logprobs, each
  row's bookkeeping) on the GPU thread, the hand-off both ways, and the event
  loop's turn between two steps (emitting, stop checks, stats);
- over HTTP (micro model): ours on the portable path against ``mlx_lm.server``,
  both warmed by one request, at 1 and 8 streaming clients (tok/s, TTFT p95);
- a fresh server's first request and its second (defaults), against
  ``mlx_lm.server``'s.

Sides take turns over ``--rounds`` after ``--warmup`` untimed rounds; medians.

    python bench/host_step.py [--rounds 3] [--tokens 256] [--no-http] [--section host-step]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx
import trio
from benchsuite import Server, _write_section, blas, float32_copy, free_port, load
from compiled_step import QUESTIONS, chat, mlx_batch, mlx_lm_decode, with_openblas
from mlx_nursery.server.bench import LoadSpec, one_request

PORTABLE = {"compile": "off", "packed_weights": False, "cpu_softmax": False}
PORTABLE_FLAGS = ["--compile", "off", "--packed-weights", "off", "--cpu-softmax", "off"]
# The portable path as served (two steps queued ahead), the same with one step
# queued and one step at a time, the defaults.
SIDES = {"portable": PORTABLE, "one-ahead": {**PORTABLE, "pipeline": 1},
         "one-step": {**PORTABLE, "pipeline": 0}, "defaults": {}}  # fmt: skip
PROMPT = "Write a short story about a robot who learns to paint."
# Requests of the one-client load: a p95 of four requests was their slowest, one
# scheduling hiccup of the VM (theirs as ours); sixteen make it a p95.
ONE_CLIENT = 16


def micro_model() -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "goldens"))
    from make_micro_model import ensure

    return ensure()


def engine_run(model, tokenizer, prompts: list[list[int]], n: int, options: dict) -> dict:
    """The engine on ``prompts`` at once (greedy, ``n`` tokens, no speculation,
    no prompt cache): aggregate tok/s, the first row's decode tok/s, its tokens,
    and the host figures of its steps."""
    from mlx_nursery.actors import open_engine
    from mlx_nursery.actors.kernels import fused, packed

    async def go():
        async with open_engine((model, tokenizer), batch=8, speculative=False,
                               prompt_cache_size=0, **options) as engine:  # fmt: skip
            results = [None] * len(prompts)

            async def one(i):
                results[i] = await engine.generate(prompts[i], max_tokens=n, temperature=0.0)

            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)
            wall = time.perf_counter() - start
            host = engine.stats().host
        return {
            "rate": sum(len(r.tokens) for r in results) / wall,
            "row_rate": results[0].usage.decode_tokens_per_second,
            "tokens": list(results[0].tokens),
            "host": host,
        }

    try:
        return trio.run(go)
    finally:  # mlx-lm's own runs on this model object must find its modules again
        fused.uninstall(model)
        packed.uninstall(model)


def in_process(label: str, folder: Path, n: int, rounds: int, warmup: int) -> dict:
    import mlx.core as mx
    from mlx_lm import load as mlx_load

    model, tokenizer = mlx_load(str(folder))
    stop = set(tokenizer.eos_token_ids)
    prompt = chat(tokenizer, PROMPT)
    batch = [chat(tokenizer, q) for q in QUESTIONS[:8]]
    runs: dict[str, list] = {k: [] for k in ("mlx1", "mlx8", *(f"{s}{b}" for s in SIDES
                                                                 for b in (1, 8)))}  # fmt: skip
    hosts: dict[str, list] = {f"{s}{b}": [] for s in SIDES for b in (1, 8)}
    equal = dict.fromkeys(SIDES, True)
    # The engine stops where mlx-lm does only on an end token; both decode n tokens.
    for i in range(warmup + rounds):
        want, rate = mlx_lm_decode(model, mx.array(prompt), n, stop)
        runs["mlx1"].append(rate)
        runs["mlx8"].append(mlx_batch(model, batch, n, stop))
        for side, options in SIDES.items():
            one = engine_run(model, tokenizer, [prompt], n, options)
            runs[f"{side}1"].append(one["row_rate"])
            hosts[f"{side}1"].append(one["host"])
            equal[side] &= one["tokens"] == [t for t in want if t not in stop]
            eight = engine_run(model, tokenizer, batch, n, options)
            runs[f"{side}8"].append(eight["rate"])
            hosts[f"{side}8"].append(eight["host"])
        print(f"  {label} round {i}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()),
              flush=True)  # fmt: skip
    med = {k: statistics.median(v[warmup:]) for k, v in runs.items()}
    # The phase split of the fastest timed round of each side.
    split = {k: min(v[warmup:], key=lambda h: h.step_ms) for k, v in hosts.items()}
    return {"label": label, "rates": med, "split": split, "equal": equal, "n": n}


def _ttft(url: str) -> float:
    async def ask():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            rec = await one_request(client, LoadSpec(url=url, max_tokens=16), PROMPT)
            return rec.first - rec.start

    return trio.run(ask)


def over_http(folder: Path, rounds: int) -> dict:
    """Ours (portable path) against mlx_lm.server on the micro model, both warmed
    by one request; then fresh servers' first and second requests (defaults)."""
    model = str(folder)
    ours = Server("mlx-nursery", [sys.executable, "-m", "mlx_nursery.server.cli", "serve",
                                  "--model", model, "--batch", "8", *PORTABLE_FLAGS,
                                  "--log-level", "WARNING"], free_port())  # fmt: skip
    theirs = Server("mlx_lm.server", [sys.executable, "-m", "mlx_lm.server", "--model", model,
                                      "--decode-concurrency", "8", "--log-level", "WARNING"],
                    free_port())  # fmt: skip
    out: dict = {"ours": {1: [], 8: []}, "mlx_lm": {1: [], 8: []}}
    with ours, theirs:
        for server in (ours, theirs):
            _ttft(server.url)  # warmed by one request
        for r in range(rounds):
            for clients in (1, 8):
                for key, server in (("ours", ours), ("mlx_lm", theirs)):
                    n = 2 * clients if clients > 1 else ONE_CLIENT
                    rep = load(server, clients, n, seed=r + 1)
                    out[key][clients].append(rep)
                    rate, ttft = rep["aggregate_tokens_per_second"], rep["ttft_p95"]
                    print(f"  http {clients} {key}: {rate:.1f} tok/s, TTFT p95 "
                          f"{ttft * 1e3:.1f} ms", flush=True)  # fmt: skip
    fresh = {}
    defaults = Server("mlx-nursery", [sys.executable, "-m", "mlx_nursery.server.cli", "serve",
                                      "--model", model, "--log-level", "WARNING"], free_port())
    for key, server in (("ours", defaults), ("mlx_lm", theirs)):
        firsts = []
        for _ in range(rounds):
            with server:
                firsts.append((_ttft(server.url), _ttft(server.url)))
        fresh[key] = firsts
        print(f"  fresh {key}: {firsts}", flush=True)
    out["fresh"] = fresh
    return out


def _median(reports: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in reports)


def tables(rows: list[dict], http: dict | None, n: int, rounds: int) -> str:
    lines = [
        f"Run {time.strftime('%Y-%m-%d')}; {blas()}; float32; {n} greedy tokens a row, medians "
        f"of {rounds} rounds after a warm-up round, all sides in one process. Portable: "
        "`--compile off --packed-weights off --cpu-softmax off`.",
        "",
        "| model | B | mlx-lm tok/s | portable | ratio | portable, `--pipeline 1` | ratio "
        "| portable, `--pipeline off` | ratio | defaults | ratio | tokens equal (B = 1) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        m = r["rates"]
        for b in (1, 8):
            base = m[f"mlx{b}"]
            sides = " | ".join(f"{m[f'{s}{b}']:.1f} | {m[f'{s}{b}'] / base:.2f}x" for s in SIDES)
            equal = "/".join("yes" if v else "no" for v in r["equal"].values()) if b == 1 else "-"
            lines.append(f"| {r['label']} | {b} | {base:.1f} | {sides} | {equal} |")
    lines += [
        "",
        "A step by phase (ms; the engine's `/stats` `host`): on the GPU thread, building the "
        "graph, waiting on the device, reading the step; the hand-off to and from the thread; "
        "the event loop's turn between two steps. Host share: all but the wait.",
        "",
        "| model | side | B | step | build | wait | read | hand-off | loop | host share |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        for key, h in r["split"].items():
            side, b = key[:-1], key[-1]
            lines.append(
                f"| {r['label']} | {side} | {b} | {h.step_ms:.3f} | {h.build_ms:.3f} | "
                f"{h.wait_ms:.3f} | {h.read_ms:.3f} | {h.handoff_ms:.3f} | {h.loop_ms:.3f} | "
                f"{h.share:.0%} |"
            )
    if http:
        lines += [
            "",
            "Over HTTP, micro model, ours on the portable path (`--batch 8`) against "
            "`mlx_lm.server --decode-concurrency 8`, both warmed by one request; streamed "
            f"completions of 128 tokens, ~64-word prompts ({ONE_CLIENT} requests at one client, "
            "16 at eight); medians of the rounds.",
            "",
            "| clients | ours tok/s | mlx_lm.server | ratio | ours TTFT p95 | theirs | ratio |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for c in (1, 8):
            o, t = http["ours"][c], http["mlx_lm"][c]
            rate = "aggregate_tokens_per_second"
            ro, rt = _median(o, rate), _median(t, rate)
            to, tt = _median(o, "ttft_p95"), _median(t, "ttft_p95")
            lines.append(f"| {c} | {ro:.0f} | {rt:.0f} | {ro / rt:.2f}x | {to * 1e3:.1f} ms | "
                         f"{tt * 1e3:.1f} ms | {to / tt:.2f}x |")  # fmt: skip
        lines += [
            "", "A fresh server (defaults; `mlx_lm.server` as it comes): TTFT of its first "
            "and second request, 16-token completions, each start a new process.", "",
            "| server | first | second | first / theirs |", "| --- | --- | --- | --- |",
        ]  # fmt: skip
        theirs = statistics.median(f for f, _ in http["fresh"]["mlx_lm"])
        for key in ("ours", "mlx_lm"):
            first = statistics.median(f for f, _ in http["fresh"][key])
            second = statistics.median(s for _, s in http["fresh"][key])
            lines.append(f"| {key} | {first * 1e3:.0f} ms | {second * 1e3:.0f} ms | "
                         f"{first / theirs:.2f}x |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-http", action="store_true")
    parser.add_argument("--no-real", action="store_true", help="the micro model alone")
    parser.add_argument("--section", help="write into docs/benchmarks.md's section")
    args = parser.parse_args()
    with_openblas(__file__)
    from mlx_nursery.actors.models.registry import DEFAULT, fetch

    micro = micro_model()
    models = [("micro (1 layer, hidden 64)", micro)]
    if not args.no_real:
        models.append(("SmolLM2-135M (float32)", float32_copy(fetch(DEFAULT))))
    rows = [in_process(label, folder, args.tokens, args.rounds, args.warmup)
            for label, folder in models]  # fmt: skip
    http = None if args.no_http else over_http(micro, args.rounds)
    text = tables(rows, http, args.tokens, args.rounds)
    print(text)
    if args.section:
        _write_section(args.section, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
