"""mlx-lm's quantized attention (``quantized_scaled_dot_product_attention``, over
``--kv-bits`` caches) to the same bits: the C library's (``cpu_attention``) on
the CPU once it has been checked against mlx-lm's here, else mlx's kernels
with the query heads that share a key head folded into one matmul's rows.
The caches themselves are ``step.quantized``."""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from . import cpu_attention

log = logging.getLogger(__name__)


_library_checked: bool | None = None


def library_agrees() -> bool:
    """Whether the C library's quantized attention gives mlx-lm's bits here:
    checked once a process against mlx-lm's ``quantized_scaled_dot_product_attention``
    on a small sample at 4 and 8 bits, one query a row and three, masked and not."""
    global _library_checked
    if _library_checked is None:
        _library_checked = cpu_attention.library() is not None and _library_matches()
        if cpu_attention.library() is not None and not _library_checked:
            log.warning("the library's quantized attention disagrees with mlx's: not used")
    return _library_checked


def _library_matches() -> bool:
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    rng = mx.random.key(45)
    for bits, group, length, n in ((8, 64, 37, 1), (4, 32, 70, 1), (8, 32, 40, 3)):
        k1, k2, k3, rng = mx.random.split(rng, 4)
        queries = mx.random.normal((3, 6, n, 64), key=k1)
        keys = mx.quantize(mx.random.normal((3, 2, length + 5, 64), key=k2), group, bits)
        values = mx.quantize(mx.random.normal((3, 2, length + 5, 64), key=k3), group, bits)
        keys = tuple(a[..., :length, :] for a in keys)
        values = tuple(a[..., :length, :] for a in values)
        padded = (mx.arange(length) >= mx.array([0, 5, 30])[:, None])[:, None, None]
        for mask in (None, padded & _causal(n, length)):
            want = quantized_scaled_dot_product_attention(  # it scales its queries in place
                mx.array(queries), keys, values, 0.125, mask, group, bits
            )
            q = (queries * 0.125).reshape(3, 2, 3 * n, 64)
            got = cpu_attention.quantized_attention(q, keys, values, mask, group, bits, n)
            if got is None or not mx.array_equal(want, got.reshape(want.shape)).item():
                return False
    return True


def _causal(queries: int, length: int) -> mx.array:
    """mlx-lm's causal mask for the last ``queries`` of ``length`` positions."""
    return (mx.arange(length - queries, length)[:, None] >= mx.arange(length)[None])[None, None]


def attention(
    queries: mx.array, keys: tuple, values: tuple, scale: float, mask: Any, group_size: int,
    bits: int, library: bool = True,
) -> mx.array | None:  # fmt: skip
    """mlx-lm's ``quantized_scaled_dot_product_attention``, to the same bits.
    ``library`` (``--cpu-softmax``): on the CPU, the C library's quantized
    attention (``cpu_attention.quantized_attention``) for any number of queries
    a row (a decode step's one, a verify step's or a prefill chunk's several).
    Else, for one query a row, mlx's kernels with the query heads that share a
    key head folded into one matmul's rows: mlx-lm broadcasts the keys across
    them, and the CPU kernel then reads each key head once per query head (8
    rows of 1,000 tokens, 9 query heads over 3: 7.1 ms a layer, 5.7 folded).
    None where neither applies (mlx-lm's own path then)."""
    b, heads, length, dim = queries.shape
    kv_heads = keys[0].shape[-3]
    if isinstance(mask, str):
        if mask != "causal":
            return None
        # mlx-lm's causal mask by name: the last ``length`` positions' rows
        total = keys[0].shape[-2]
        mask = None if length == 1 else _causal(length, total)
    if heads % kv_heads or (length != 1 and not library):
        return None
    q = (queries * scale).reshape(b, kv_heads, heads // kv_heads * length, dim)
    if library and mx.default_device() == mx.cpu and library_agrees():
        out = cpu_attention.quantized_attention(q, keys, values, mask, group_size, bits, length)
        if out is not None:
            return out.reshape(b, heads, length, dim)
    if length != 1:
        return None
    scores = mx.quantized_matmul(q, *keys, transpose=True, group_size=group_size, bits=bits)
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(scores, *values, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(b, heads, 1, dim)
