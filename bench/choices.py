"""`n` = 4 from one request against four sequential `n` = 1 requests (issue 45's
target: >= 2.5x the tok/s), on one server, each round on a prompt no earlier
round used (so neither side finds the other's prompt in the cache).

    python bench/choices.py --model $(python goldens/make_bench_model.py --if-missing)

Prints the figures and the markdown row for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import httpx
from benchsuite import Server, free_port  # bench/ (this script's folder)

WORDS = [
    "river",
    "stone",
    "lantern",
    "harbor",
    "meadow",
    "copper",
    "violet",
    "thunder",
    "orchard",
    "ember",
]


def prompt(round_: int) -> list[dict]:
    text = " ".join(WORDS[(round_ * 7 + i) % len(WORDS)] for i in range(300))
    return [{"role": "user", "content": f"Round {round_}. Continue: {text}"}]


def ask(client: httpx.Client, messages: list[dict], n: int, tokens: int, seed: int) -> int:
    body = {"messages": messages, "max_tokens": tokens, "temperature": 1.0,
            "seed": seed, "n": n}  # fmt: skip
    r = client.post("/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("serve", nargs="*", help="more flags for the server (after --)")
    args = parser.parse_args()
    argv = [sys.executable, "-m", "mlx_nursery.server.cli", "serve", "--model", args.model,
            "--batch", "8", "--log-level", "WARNING", *args.serve]  # fmt: skip
    together, apart = [], []
    with (
        Server("mlx-nursery", argv, free_port()) as server,
        httpx.Client(base_url=server.url) as client,
    ):
        ask(client, prompt(99), 1, 8, 0)  # warm up
        for r in range(args.rounds):
            t0 = time.perf_counter()
            made = ask(client, prompt(2 * r), args.n, args.tokens, r)
            together.append(made / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            made = sum(ask(client, prompt(2 * r + 1), 1, args.tokens, r + i)
                       for i in range(args.n))  # fmt: skip
            apart.append(made / (time.perf_counter() - t0))
    a, b = statistics.median(together), statistics.median(apart)
    print(f"n={args.n} in one request: {a:.1f} tok/s; {args.n} sequential n=1: {b:.1f} tok/s; "
          f"ratio {a / b:.2f}x (target >= 2.5x)")  # fmt: skip
    print(f"| `n` = {args.n}, {args.tokens} tokens each | {a:.1f} | {b:.1f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
