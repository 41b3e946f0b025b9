"""Where the flood's time goes (issue #25): one flood (sessions, pausing) against
a server whose every GPU call is timed, then the measured window's GPU time by
kind: decode steps by batch size, with or without B's long row, and prefill
turns with the tokens they prefilled.

    python bench/flood_trace.py --model $(python goldens/make_bench_model.py --if-missing)

The server runs in this process's child (``serve`` with the tracer patched into
``Gpu._run``); OpenBLAS is preloaded as for ``benchsuite.py``."""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

B_ROW = 1400  # a row this long (KV tokens) is B's: A's rows stay near 800


def serve_traced(trace: str, argv: list[str]) -> int:
    """``serve`` with each GPU call's (start, seconds, name, detail) kept, written
    to ``trace`` on SIGUSR1."""
    import outcome
    from mlx_nursery.actors import gpu
    from mlx_nursery.server.cli import main

    events: list = []
    run = gpu.Gpu._run

    def traced(self, fn, args, here):
        t0 = time.perf_counter()
        result = run(self, fn, args, here)
        name, detail = getattr(fn, "__qualname__", repr(fn)), {}
        if name == "_advance" and args[0].batched:
            cache = args[0].caches[0]
            detail["lengths"] = [cache._idx - p for p in cache.left_padding.tolist()]
            detail["width"] = cache.keys.shape[2]
            if isinstance(result, outcome.Value):  # KV bytes a join or compaction copied
                detail["copied"] = result.value.step.copied
                detail["refilled"] = result.value.step.refilled
        elif name == "_advance" and args[0].caches:
            detail["lengths"] = [args[0].caches[0].offset]
        elif name == "prefill_turn" and isinstance(result, outcome.Value):
            detail["tokens"] = sum(done.tokens for done in result.value)
        events.append((t0, time.perf_counter() - t0, name, detail))
        return result

    gpu.Gpu._run = traced

    def dump(*_):
        with open(trace, "w") as f:
            json.dump(events, f)

    signal.signal(signal.SIGUSR1, dump)
    return main(argv)


def report(trace: str, seconds: float) -> None:
    with open(trace) as f:
        events = sorted(json.load(f))
    steps = [e for e in events if e[2] == "_advance" and e[3].get("lengths")]
    with_b = [t for t, _, _, d in steps if max(d["lengths"]) >= B_ROW]
    end = with_b[-1]
    start = end - seconds
    busy, count, tokens = collections.Counter(), collections.Counter(), collections.Counter()
    for t, d, name, detail in events:
        if not start <= t <= end:
            continue
        if name == "_advance" and detail.get("lengths"):
            lengths = detail["lengths"]
            key = f"decode step, {len(lengths)} rows" + (
                " (B's among them)" if max(lengths) >= B_ROW else ""
            )
        elif name == "prefill_turn":
            key = "prefill turn"
            tokens[key] += detail.get("tokens", 0)
        else:
            key = "other (leaves, pauses, prompt cache)"
        busy[key] += d
        count[key] += 1
    print(f"\n| GPU call, in B's {seconds:.1f} s | calls | seconds | share | mean (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for key in sorted(busy, key=lambda k: -busy[k]):
        extra = f" ({tokens[key]} tokens)" if key in tokens else ""
        print(f"| {key}{extra} | {count[key]} | {busy[key]:.2f} | "
              f"{100 * busy[key] / seconds:.0f}% | {1000 * busy[key] / count[key]:.0f} |")
    mixed = [d for t, d, _, x in steps if start <= t <= end and max(x["lengths"]) >= B_ROW]
    alone = [d for t, d, _, x in steps if t < start and len(x["lengths"]) == 4
             and max(x["lengths"]) < B_ROW]  # fmt: skip
    print(f"\nA's four rows alone (before the window): {1000 * statistics.median(alone):.0f} ms "
          f"a step (median); with B's row among four: {1000 * statistics.median(mixed):.0f} ms")


def main() -> int:
    if sys.argv[1:2] == ["serve-traced"]:  # the child: serve-traced TRACE serve ...
        return serve_traced(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, default=8939)
    args = parser.parse_args()
    import subprocess

    import httpx
    import trio
    from flood import FloodSpec, run_flood

    sys.path.insert(0, os.path.dirname(__file__))
    from benchsuite import FLOOD_FLAGS
    from mlx_nursery.server.blas import find_openblas

    scratch = tempfile.mkdtemp(prefix="flood-trace-")  # the trace and the disk tier
    trace = os.path.join(scratch, "trace.json")
    env = dict(os.environ, MLX_NURSERY_KV_DIR=os.path.join(scratch, "kv"))
    if find_openblas():
        env["LD_PRELOAD"] = find_openblas()
    server = subprocess.Popen(
        [sys.executable, __file__, "serve-traced", trace, "serve",
         "--model", args.model, *FLOOD_FLAGS, "--port", str(args.port), "--log-level",
         "WARNING"], env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(120):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        flood = trio.run(functools.partial(run_flood, FloodSpec(url=url)))
        server.send_signal(signal.SIGUSR1)
        time.sleep(3)
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(os.path.join(scratch, "kv"), ignore_errors=True)  # the trace stays
    turns = ", ".join(f"{t:.2f}" for t in flood.turn_seconds)
    print(f"B's turns [{turns}] s; A {flood.agent_tokens_per_second:.1f} tok/s over "
          f"{flood.seconds:.1f} s; rows paused {flood.paused}")
    report(trace, flood.seconds)
    print(f"\nthe trace (every GPU call): {trace}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
