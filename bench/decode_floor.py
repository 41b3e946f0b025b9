"""Where a decode step's time goes on SmolLM2-135M float32 (and the bench llama
30M): issue 47's "measure first", and the probe of what ``mx.compile`` can win.

Six figures, from one process, one after the other:

- mlx-lm: greedy decode with mlx-lm's own caches, pipelined as ``generate_step``
  is (the next step built while this one computes);
- compiled: the whole forward under ``mx.compile`` with its shapes held fixed:
  a KV buffer of fixed capacity written with ``mx.slice_update`` at an array
  offset, the positions past the offset masked, the model's code unchanged;
  its first call (tracing and the CPU backend's C++ build) timed apart;
- static: the same fixed-capacity step without ``mx.compile`` (what the mask over
  the capacity costs by itself);
- mlx-lm's ``BatchGenerator`` at B=8: aggregate decode tok/s after every row's
  first token;
- the matmul floor: every ``Linear`` of the model and the tied head as one
  ``x @ W.T`` each at B=1 and B=8 (the bytes a step must read, and nothing else);
- the breakdown at B=1, 4 and 8 on both models (rows of ``KEYS`` keys in
  mlx-lm's ``BatchKVCache``): the forward, its attention, its matmul floor, the
  rest; and the forward with the engine's compiled blocks (``--compile``: the
  RMSNorms and RoPE under ``mx.compile`` at decode shapes, no fixed capacity
  needed), its logits checked bit-equal to the plain forward's.

The compiled and static tokens are checked equal to mlx-lm's.

    python bench/decode_floor.py [--tokens N]   (re-runs itself with OpenBLAS preloaded)

Writes its table into docs/benchmarks.md (section ``decode-floor``).
"""

from __future__ import annotations

import argparse
import contextlib
import time

from benchsuite import _write_section, bench_llama, blas, float32_copy
from compiled_step import CAPACITY, fixed_decode, mlx_lm_decode, with_openblas
from mlx_nursery.actors.models import registry
from step_lengths import timed

PROMPT = "Write a short story about a robot who learns to paint."


def batch_decode(model, tokenizer, rows: int, n: int) -> float:
    """mlx-lm's ``BatchGenerator`` at ``rows`` rows: aggregate decode tok/s, timed
    from the step after every row has its first token."""
    from benchsuite import batch_prompts
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, stop_tokens=[])
    gen.insert(batch_prompts(tokenizer, rows), max_tokens=[n] * rows)
    first = 0
    while first < rows:
        first += len(gen.next_generated())
    tokens, start = 0, time.perf_counter()
    while responses := gen.next_generated():
        tokens += len(responses)
    gen.close()
    return tokens / (time.perf_counter() - start)


def matmul_floor(model, batch: int) -> tuple[float, int, int]:
    """ms a step for every weight matrix read once (one ``x @ W.T`` each), how
    many matrices, their bytes."""
    import mlx.core as mx
    import mlx.nn as nn

    weights = [m.weight for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    weights.append(model.model.embed_tokens.weight)
    xs = {w.shape[1]: mx.random.normal((batch, w.shape[1])) for w in weights}
    mx.eval(xs)

    def once():
        return [xs[w.shape[1]] @ w.T for w in weights]

    return timed(once, runs=10), len(weights), sum(w.nbytes for w in weights)


KEYS = 450  # keys a row holds in the breakdown (a short agent turn)


@contextlib.contextmanager
def compiled_norms_and_rope(model):
    """The engine's compiled blocks (``--compile``: ``actors/kernels/fused.py``) on
    ``model`` for the time of the block."""
    from mlx_nursery.actors.kernels import fused

    fused.install(model)
    try:
        yield
    finally:
        fused.uninstall(model)


def breakdown(model, rows: int) -> dict[str, float | bool]:
    """One decode step of ``rows`` rows of ``KEYS`` keys each in mlx-lm's
    ``BatchKVCache`` (ms): the forward, the forward with attention left out, the
    matmul floor; the forward with norms and RoPE compiled (alternated with the
    plain one three times, medians), and whether its logits equal the plain
    forward's bit for bit."""
    import statistics

    import mlx.core as mx
    from step_lengths import no_attention, step_ms

    def logits(caches):
        return model(mx.array([[7]] * rows), cache=caches)

    plain, fused = [], []
    for _ in range(3):
        plain.append(step_ms(model, [KEYS] * rows))
        with compiled_norms_and_rope(model):
            fused.append(step_ms(model, [KEYS] * rows))
    with no_attention(model):
        weights = step_ms(model, [KEYS] * rows)
    a, b = _caches(model, rows), _caches(model, rows)
    want = logits(a)
    with compiled_norms_and_rope(model):
        got = logits(b)
    return {"forward": statistics.median(plain), "no_attention": weights,
            "floor": matmul_floor(model, rows)[0], "fused": statistics.median(fused),
            "equal": bool(mx.array_equal(want, got).item())}  # fmt: skip


def _caches(model, rows: int) -> list:
    """``rows`` rows of ``KEYS`` tokens prefilled into mlx-lm's batch caches."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    caches = [BatchKVCache([0] * rows) for _ in model.layers]
    model(mx.array([[5 + i] * KEYS for i in range(rows)]), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def breakdown_table(models: dict[str, object]) -> list[str]:
    lines = [
        f"Where a decode step's time goes (rows of {KEYS} keys, mlx-lm's forward on its "
        "`BatchKVCache`, ms a step; attention = forward - forward without it; the rest = "
        "forward without attention - the matmul floor):",
        "",
        "| model | B | forward | matmul floor | attention | the rest | norms + RoPE compiled "
        "| against plain | logits equal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, model in models.items():
        for rows in (1, 4, 8):
            f = breakdown(model, rows)
            lines.append(
                f"| {name} | {rows} | {f['forward']:.1f} | {f['floor']:.1f} | "
                f"{f['forward'] - f['no_attention']:.1f} | {f['no_attention'] - f['floor']:.1f} "
                f"| {f['fused']:.1f} | {f['forward'] / f['fused']:.2f}x | {f['equal']} |"
            )
            print(lines[-1], flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    with_openblas(__file__)
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(float32_copy(registry.fetch(registry.DEFAULT))))
    prompt = mx.array(tokenizer.encode(PROMPT))
    n = args.tokens
    base, base_rate = mlx_lm_decode(model, prompt, n)
    _, base_rate2 = mlx_lm_decode(model, prompt, n)
    fixed, fixed_rate, _ = fixed_decode(model, prompt, n, compiled=False)
    comp, comp_rate, first = fixed_decode(model, prompt, n, compiled=True)
    batch8 = batch_decode(model, tokenizer, 8, n)
    floors = {b: matmul_floor(model, b) for b in (1, 8)}
    ms1, count, nbytes = floors[1]
    mlx_rate = (base_rate + base_rate2) / 2
    rows = [
        ("mlx-lm (its caches, pipelined), two runs",
         f"{base_rate:.1f}, {base_rate2:.1f}", f"{1000 / mlx_rate:.1f}", "1.00x", "-"),
        ("fixed capacity, not compiled", f"{fixed_rate:.1f}", f"{1000 / fixed_rate:.1f}",
         f"{fixed_rate / mlx_rate:.2f}x", str(fixed == base)),
        (f"fixed capacity, `mx.compile` (first call {first:.1f} s)", f"{comp_rate:.1f}",
         f"{1000 / comp_rate:.1f}", f"{comp_rate / mlx_rate:.2f}x", str(comp == base)),
        (f"the matmul floor: {count} weights, {nbytes / 2**20:.0f} MiB, read once",
         f"{1000 / ms1:.1f}", f"{ms1:.1f}", f"{1000 / ms1 / mlx_rate:.2f}x", "-"),
    ]  # fmt: skip
    lines = [
        f"Run {time.strftime('%Y-%m-%d')}; BLAS: {blas()}; float32; SmolLM2-135M-Instruct "
        f"(dequantized from its Q4_1 GGUF); B=1 greedy, {n} tokens after a "
        f"{prompt.size}-token prompt; fixed capacity {CAPACITY}. At B=8: mlx-lm's "
        f"`BatchGenerator` decodes {batch8:.1f} tok/s in all ({8000 / batch8:.1f} ms a "
        f"step); the matmul floor is {floors[8][0]:.1f} ms a step, "
        f"{8000 / floors[8][0]:.1f} tok/s, {8000 / floors[8][0] / batch8:.2f}x.",
        "",
        "| decode step | tok/s | ms a token | against mlx-lm | tokens equal |",
        "|---|---|---|---|---|",
        *[f"| {' | '.join(row)} |" for row in rows],
    ]
    others = {"SmolLM2-135M": model, "bench llama 30M": load(str(bench_llama()))[0]}
    lines += ["", *breakdown_table(others)]
    body = "\n".join(lines)
    print(body)
    _write_section("decode-floor", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
