"""Where the flood's decode time goes: one decode step of a batch under
mlx-lm's ``BatchKVCache`` as the rows' lengths vary, with mlx-lm's padded
attention, with ``actors/kernels/ragged.py``'s row by row (as served), and with the
attention left out (what the weights cost), plus the attention alone.

The flood (issue #25) puts B's ~2,400-token row beside A's ~600-token rows, and
A has three of the four slots. This measures what B's row adds to a step on the
benchmark model (``docs/benchmarks.md``, the flood section).

    python bench/step_lengths.py [MODEL_DIR]   (default: the 31M bench model)
"""

from __future__ import annotations

import contextlib
import sys
import time


def timed(fn, runs: int = 30) -> float:
    import mlx.core as mx

    for _ in range(3):
        mx.eval(fn())
    start = time.perf_counter()
    for _ in range(runs):
        mx.eval(fn())
    return (time.perf_counter() - start) / runs * 1000


def step_ms(model, lengths: list[int]) -> float:
    """One decode step of rows of these lengths, left-padded in one batch."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    longest = max(lengths)
    pads = [longest - n for n in lengths]
    caches = [BatchKVCache(pads) for _ in model.layers]
    tokens = mx.array([[0] * p + [5] * n for p, n in zip(pads, lengths, strict=True)])
    for i in range(0, longest, 512):
        model(tokens[:, i : i + 512], cache=caches)
        mx.eval([c.state for c in caches])
    step = mx.array([[7]] * len(lengths))
    return timed(lambda: model(step, cache=caches))


def attention_ms(rows: int, heads: int, head_dim: int, length: int, layers: int) -> float:
    import mlx.core as mx

    q = mx.random.normal((rows, heads, 1, head_dim))
    k = mx.random.normal((rows, heads, length, head_dim))
    v = mx.random.normal((rows, heads, length, head_dim))
    scale = head_dim**-0.5
    return layers * timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale), 100)


@contextlib.contextmanager
def no_attention(model):
    """The model's attention replaced by its queries (the step's other work only)."""
    from mlx_nursery.actors.kernels import ragged

    namespaces = ragged._namespaces(model)
    kept = [n.scaled_dot_product_attention for n in namespaces]
    for n in namespaces:
        n.scaled_dot_product_attention = lambda q, k, v, cache, scale, mask, **_: q
    try:
        yield
    finally:
        for n, fn in zip(namespaces, kept, strict=True):
            n.scaled_dot_product_attention = fn


def main() -> None:
    from benchsuite import bench_llama
    from mlx_lm import load
    from mlx_nursery.actors.kernels import ragged

    folder = sys.argv[1] if len(sys.argv) > 1 else bench_llama()
    model, _ = load(str(folder))
    args = model.args
    heads, layers = args.num_attention_heads, args.num_hidden_layers
    head_dim = args.hidden_size // heads
    print(f"{folder}: one decode step (ms)\n")
    print("| rows' lengths (keys) | padded | ragged (as served) | attention left out |")
    print("| --- | --- | --- | --- |")
    a, b = 600, 2400
    for lengths in ([a], [a] * 3, [a] * 4, [a] * 3 + [b], [b], [b] * 4):
        ragged.uninstall(model)
        padded = step_ms(model, lengths)
        ragged.install(model)
        rowwise = step_ms(model, lengths)
        with no_attention(model):
            weights = step_ms(model, lengths)
        print(f"| {', '.join(map(str, lengths))} | {padded:.1f} | {rowwise:.1f} | "
              f"{weights:.1f} |", flush=True)  # fmt: skip
    print("\n| attention alone, 4 rows x all layers | ms |\n| --- | --- |")
    for length in (600, 2400):
        print(f"| {length} keys | {attention_ms(4, heads, head_dim, length, layers):.1f} |")


if __name__ == "__main__":
    main()
