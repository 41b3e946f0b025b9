"""Ragged attention in decode steps: each row attends over its own keys only.

mlx-lm's ``BatchKVCache`` left-pads every row to the longest one, and a decode
step's attention then reads ``rows x longest`` keys, the padding masked out. On
a memory-bound device that is most of a step when one row is much longer than
the rest: a main agent's long history beside its sub-agents' short prompts
(``bench/step_lengths.py``: three 600-token rows beside a 1,700-token one spend
50 ms of a 76 ms step in attention, against 15 ms for four 600-token rows).

:func:`install` wraps the ``scaled_dot_product_attention`` the model's modules
call (mlx-lm's own, unchanged otherwise): in a decode step (one query per row)
over a ``BatchKVCache`` whose padding is at least ``WASTE`` of the keys, each
row's attention runs on its own keys (from its left padding on), without a
mask. That is the computation a lone row does, so the result is a lone row's
(to float rounding; the masked padded form differs from it alike). Prefill
chunks, rotating caches, and batches with little padding take the original
path; quantized caches mlx-lm's quantized attention (``quantized_attention.attention``: the
C library's on the CPU, else its decode steps with the query heads folded).

The same wrapper swaps in :func:`cpu_attention.attention` (mlx's own CPU attention,
its softmax vectorized to the same bits) for float32 attention on the CPU, in
the row-by-row path and the original one alike: ``install(model, rows=...,
exact_softmax=...)`` chooses either or both. A forward built inside
:func:`verify_step` tells it that its few queries a row are a verify step's.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

from . import cpu_attention, quantized_attention

WASTE = 0.25  # the share of padded keys above which rows attend one by one
# The model modules whose decode mask is the padding and nothing else (a sliding
# window lives in their rotating caches, which take the original path).
FAMILIES = (
    "llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3", "gemma3_text",
    "smollm3",
)  # fmt: skip
_MARKER = "_mlx_nursery_ragged"
calls = 0  # attention calls taken row by row in this process (for tests and benchmarks)
_step = threading.local()  # what the forward this thread builds is (verify_step)


@contextlib.contextmanager
def verify_step() -> Iterator[None]:
    """The forward built inside is a verify step: its attention takes
    ``cpu_attention.attention(..., verify=True)`` where the library is used."""
    before = getattr(_step, "verify", False)
    _step.verify = True
    try:
        yield
    finally:
        _step.verify = before


def _namespaces(model: Any) -> list[Any]:
    """The mlx-lm model modules (of ``FAMILIES``) ``model`` is built from."""
    found = {}
    for _, module in model.named_modules():
        name = type(module).__module__
        if name.rpartition(".")[2] in FAMILIES and name in sys.modules:
            found[name] = sys.modules[name]
    return list(found.values())


def install(model: Any, rows: bool = True, exact_softmax: bool = True) -> int:
    """Wrap the attention of the mlx-lm modules ``model`` is built from (for the
    whole process): ``rows``, ragged attention in decode steps; ``exact_softmax``,
    the vectorized CPU softmax. Returns how many were wrapped now (0: already
    so, or none). Neither: mlx-lm's own attention."""
    if not (rows or exact_softmax):
        uninstall(model)
        return 0
    wrapped = 0
    for namespace in _namespaces(model):
        current = getattr(namespace, "scaled_dot_product_attention", None)
        if current is None:
            continue
        if getattr(current, _MARKER, None) == (rows, exact_softmax):
            continue
        original = getattr(current, "__wrapped__", current)
        namespace.scaled_dot_product_attention = ragged(original, rows, exact_softmax)
        wrapped += 1
    return wrapped


def uninstall(model: Any) -> None:
    """mlx-lm's own attention back in the modules ``model`` is built from."""
    for namespace in _namespaces(model):
        current = getattr(namespace, "scaled_dot_product_attention", None)
        if getattr(current, _MARKER, None):
            namespace.scaled_dot_product_attention = current.__wrapped__


def ragged(original: Any, rows: bool = True, exact_softmax: bool = True) -> Any:
    import mlx.core as mx

    def sdpa(queries, keys, values, scale, mask=None):
        if exact_softmax:
            verify = getattr(_step, "verify", False)
            return cpu_attention.attention(queries, keys, values, scale, mask, verify=verify)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    def attention(queries, keys, values, cache, scale, mask, sinks=None, **extra):
        if sinks is None and not extra and hasattr(cache, "bits"):  # quantized KV
            out = quantized_attention.attention(
                queries, keys, values, scale, mask, cache.group_size, cache.bits,
                library=exact_softmax,
            )  # fmt: skip
            if out is not None:
                return out
        if sinks is not None or extra or hasattr(cache, "bits"):  # mlx-lm's path
            return original(queries, keys, values, cache, scale, mask, sinks=sinks, **extra)
        pads = padding(cache, queries, keys) if rows else None
        if pads is None:
            return sdpa(queries, keys, values, scale, mask)

        global calls
        calls += 1
        return mx.concatenate(
            [
                sdpa(queries[i : i + 1], keys[i : i + 1, :, p:], values[i : i + 1, :, p:], scale)
                for i, p in enumerate(pads)
            ],
            axis=0,
        )

    setattr(attention, _MARKER, (rows, exact_softmax))
    attention.__wrapped__ = original
    return attention


def padding(cache: Any, queries: Any, keys: Any) -> list[int] | None:
    """Each row's left padding when rows should attend one by one, else None."""
    from mlx_lm.models.cache import BatchKVCache

    if type(cache) is not BatchKVCache or queries.shape[2] != 1 or queries.shape[0] < 2:
        return None
    pads = cache.left_padding.tolist()
    length = keys.shape[2]
    if sum(pads) < WASTE * length * len(pads) or max(pads) >= length:
        return None
    return pads
