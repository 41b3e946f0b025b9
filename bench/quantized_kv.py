"""Quantized KV (``--kv-bits``) on SmolLM2-135M-Instruct: issue 45's figures.

- memory: a token's KV bytes at 8 and 4 bits against float16's (the model cast
  to float16, as a Mac serves it) and float32's (as this CPU serves it), from the
  engine's probe; and under one fixed ``--kv-budget``, the context the batch
  holds at once (tokens its rows hold, sampled each step) at each precision;
- speed: 8 streaming HTTP clients, 16 requests of 128 tokens, against a server
  with float KV and one with ``--kv-bits 8`` (and 4), alternated, each on a
  fresh disk tier; the ratio of aggregate tok/s;
- agreement: 4-bit (and 8-bit) KV against float KV on a held-out text, teacher
  forced in 32-token chunks as a prefill runs: top-1 agreement and mean KL of
  the next-token distributions.

    python bench/quantized_kv.py   (re-runs itself with OpenBLAS preloaded)

Writes the table into docs/benchmarks.md (section ``quantized-kv``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import trio
from benchsuite import Server, _write_section, blas, float32_copy, free_port, load
from mlx_nursery.actors.models import registry
from mlx_nursery.server.blas import find_openblas

STEP = 32
CLIENTS = 8
HELD_OUT = """\
The committee met on a wet Thursday to decide what the town would do about the
bridge. Some wanted it rebuilt in stone, others argued that a ferry would serve
the farms on the far bank better, and a few said nothing at all. The engineer
brought drawings of three designs, each cheaper than the last, and explained
how the river had moved its bed twice in forty years. By evening the only thing
agreed was that the old timbers could not carry another winter of carts, and
that the schoolchildren should cross by boat until the spring. The mayor wrote
to the county for money; the reply, when it came in March, asked for a survey
first. So the surveyors came, measured everything twice, drank in the inn, and
left a report that recommended stone. Nobody was surprised, and the ferryman,
who had hoped for steady work, bought a second boat anyway.
"""


def token_bytes(path: str) -> dict:
    """A token's KV bytes by precision, from the engine's own probe."""
    from mlx_nursery.actors.models.load import load_model
    from mlx_nursery.actors.step.quantized import KvBits

    out = {}
    for dtype in ("float16", "float32"):
        for bits in (None, 8, 4):
            kv = None if bits is None else KvBits(bits, 64, 0)
            _, _, info = load_model(path, dtype, kv=kv)
            per = sum(c.token_bytes for c in info.kv_costs)
            out[(dtype, bits)] = per
    return out


async def _held(path: str, bits: int | None, budget: int, prompt: list[int], rows: int) -> dict:
    """Rows of ``prompt`` (each made unique) under ``budget``: the most rows and
    tokens the batch held at once."""
    from mlx_nursery.actors import open_engine

    most = {"rows": 0, "tokens": 0}
    async with open_engine(
        path, batch=8, kv_budget=budget, kv_bits=bits, prompt_cache_size=0,
        prefill_step_size=512, dtype="float32",
    ) as engine:  # fmt: skip

        async def one(i: int) -> None:
            await engine.generate([*prompt, 100 + i], max_tokens=48)

        async def watch() -> None:
            step = 1
            while True:
                await engine.wait_step(step)
                s = engine.stats()
                most["rows"] = max(most["rows"], s.decoding_rows)
                most["tokens"] = max(most["tokens"], s.batch_kv_tokens)
                step += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            async with trio.open_nursery() as clients:
                for i in range(rows):
                    clients.start_soon(one, i)
            nursery.cancel_scope.cancel()
    return most


def held(path: str, tokenizer, budget: int) -> dict:
    words = HELD_OUT.split()
    text = " ".join(words[i % len(words)] for i in range(1100))
    prompt = tokenizer.encode(text)
    return {bits: trio.run(_held, path, bits, budget, prompt, 8) for bits in (None, 8, 4)}


def agreement(path: str, bits: int) -> dict:
    """Teacher-forced next-token distributions over HELD_OUT (repeated to some
    1,000 tokens), float KV against ``bits`` KV: top-1 agreement and mean KL."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_nursery.actors.models.load import load_model
    from mlx_nursery.actors.step.quantized import KvBits

    model, tokenizer, _ = load_model(path, "float32")
    ids = tokenizer.encode(HELD_OUT * 4)
    kv = KvBits(bits, 64, 0)

    def logprobs(quantized: bool) -> mx.array:
        caches, out = make_prompt_cache(model), []
        for at in range(0, len(ids), STEP):
            logits = model(mx.array(ids[at : at + STEP])[None], cache=caches)[0]
            if quantized:
                kv.after_forward(caches)
            out.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
            mx.eval(out[-1], [c.state for c in caches])
        return mx.concatenate(out)

    p, q = logprobs(False), logprobs(True)
    kl = (mx.exp(p) * (p - q)).sum(axis=-1)
    top1 = (p.argmax(axis=-1) == q.argmax(axis=-1)).astype(mx.float32)
    return {"tokens": len(ids), "top1": top1.mean().item(), "kl": kl.mean().item(),
            "kl_max": kl.max().item()}  # fmt: skip


def speed(path: str, repeats: int) -> dict:
    argv = [sys.executable, "-m", "mlx_nursery.server.cli", "serve", "--model", path,
            "--batch", "8", "--log-level", "WARNING"]  # fmt: skip
    runs: dict[int | None, list[float]] = {None: [], 8: [], 4: []}
    for r in range(repeats):
        for bits in (None, 8, 4):
            extra = [] if bits is None else ["--kv-bits", str(bits)]
            with Server(f"kv{bits}", [*argv, *extra], free_port()) as server:
                load(server, 2, 2, seed=1000 + r)  # warm up
                report = load(server, CLIENTS, 16, seed=r)
            runs[bits].append(report["aggregate_tokens_per_second"])
    return {bits: statistics.median(v) for bits, v in runs.items()}


def main() -> None:
    lib = find_openblas()  # the in-process figures on the servers' BLAS
    if lib and "openblas" not in os.environ.get("LD_PRELOAD", ""):
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]],
                  dict(os.environ, LD_PRELOAD=lib))  # fmt: skip
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budget", type=int, default=96 << 20)
    args = parser.parse_args()
    from mlx_lm import load as mlx_load

    path = str(float32_copy(registry.fetch(registry.DEFAULT)))
    _, tokenizer = mlx_load(path)
    sizes = token_bytes(path)
    f16 = sizes[("float16", None)]
    kept = held(path, tokenizer, args.budget)
    agree = {bits: agreement(path, bits) for bits in (8, 4)}
    tps = speed(path, args.repeats)
    lines = [
        f"SmolLM2-135M-Instruct, float32 weights, {blas()}, 2-core CPU. A token's KV "
        "from the engine's probe (30 layers, 3 KV heads of 64); the context held at "
        f"once under `--kv-budget {args.budget >> 20}M` by 8 rows of ~1,100 prompt "
        "tokens + 48 (`batch_kv_tokens`, sampled each step); 8 streaming HTTP clients, "
        f"16 requests x 128 tokens (median of {args.repeats}); agreement teacher-forced "
        f"over {agree[4]['tokens']} held-out tokens in 32-token chunks.",
        "",
        "| KV | bytes/token | vs float16 (target) | vs float32 | rows at once | "
        "context at once | vs float | 8 clients tok/s | vs float (target) | "
        "top-1 vs float | mean KL |",
        "| --- " * 11 + "|",
    ]
    for bits in (None, 8, 4):
        b16 = sizes[("float16", bits)]
        b32 = sizes[("float32", bits)]
        name = "float" if bits is None else f"{bits}-bit"
        target = {None: "", 8: " (<= 0.55x)", 4: " (<= 0.30x)"}[bits]
        ctx = kept[bits]["tokens"] / max(1, kept[None]["tokens"])
        ctx_target = " (>= 1.8x)" if bits == 8 else ""
        speed_target = " (>= 0.9x)" if bits == 8 else ""
        a = agree.get(bits)
        top1 = "" if a is None else f"{100 * a['top1']:.1f}%"
        kl = "" if a is None else f"{a['kl']:.4f} (max {a['kl_max']:.3f})"
        lines.append(
            f"| {name} | {b16:,.0f} (f16) / {b32:,.0f} (f32) | {b16 / f16:.2f}x{target} | "
            f"{b32 / sizes[('float32', None)]:.2f}x | {kept[bits]['rows']} | "
            f"{kept[bits]['tokens']:,} | {ctx:.2f}x{ctx_target} | {tps[bits]:.1f} | "
            f"{tps[bits] / tps[None]:.2f}x{speed_target} | "
            f"{top1} | {kl} |"
        )
    body = "\n".join(lines)
    print(body)
    _write_section("quantized-kv", body)


if __name__ == "__main__":
    main()
