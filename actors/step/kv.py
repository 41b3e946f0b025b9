"""KV cache helpers shared by the batch, a joiner's prefill and the prompt cache.

Everything here runs on the GPU thread. mlx-lm's cache objects hold a row's keys
and values; these functions copy, merge, cut and move rows between them without
knowing who owns them: :func:`clone` (view handles, no KV copied: what the prompt
cache hands out), :func:`merge` and :func:`side_by_side` (rows into one batch
cache), :func:`make_room` (growth without the shared left padding),
:func:`row_kv` / :func:`write_row` / :func:`extracted` (one row out of or into a
batch buffer), :func:`fit` (a leaving row cut to what it read).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import BatchKVCache, CacheList, KVCache, QuantizedKVCache

from .quantized import QuantizedBatchKVCache, arrays, first, planes, quantized_kind

SOLO = (KVCache, QuantizedKVCache)  # a row's plain caches: float or quantized
BATCHED = (BatchKVCache, QuantizedBatchKVCache)  # the same, batch-shaped


def clone(cache: Any) -> Any:
    """A copy of one layer's cache object whose arrays are view handles (no KV copied)."""
    new = copy.copy(cache)
    for name, value in vars(cache).items():
        if isinstance(value, mx.array):
            setattr(new, name, value[...])
        elif isinstance(value, list | tuple) and value:
            items = [
                v[...] if isinstance(v, mx.array) else clone(v) if hasattr(v, "state") else v
                for v in value
            ]
            setattr(new, name, type(value)(items))
    return new


def merge(solo: Sequence[list[Any]]) -> list[Any]:
    """Several rows' solo caches as one batch, layer by layer (mlx-lm's merge;
    quantized rows, which it has no batch kind for: :func:`side_by_side`)."""
    return [
        side_by_side(layer) if quantized_kind(layer[0]) else type(layer[0]).merge(list(layer))
        for layer in zip(*solo, strict=True)
    ]


def side_by_side(layer: Sequence[Any]) -> BatchKVCache | None:
    """One layer's caches, in slot order (solo ``KVCache``s and ``BatchKVCache``s),
    as one batch cache written in a single copy: each row right-aligned at the
    longest row's end, with room left for the next step's write. mlx-lm's
    ``merge`` then ``extend`` pad and concatenate, and the next write grows the
    buffer again: three copies of the whole batch, most of a second when a long
    row joins short ones (a main agent's history beside its sub-agents'). The
    rows' keys and values, padding and positions are the same. None where a
    cache is of another kind (those take mlx-lm's way)."""
    kinds = {type(c) for c in layer}
    if not (kinds <= {KVCache, BatchKVCache} or kinds <= {QuantizedKVCache, QuantizedBatchKVCache}):
        return None
    if any(c.keys is None for c in layer):
        return None
    ends = [c.offset if type(c) in SOLO else c._idx for c in layer]
    end = max(ends)
    size = (end // BatchKVCache.step + 1) * BatchKVCache.step
    rows = sum(first(c.keys).shape[0] for c in layer)
    head = layer[0]
    if quantized_kind(head):
        out = QuantizedBatchKVCache([], head.group_size, head.bits)
    else:
        out = BatchKVCache([])
    out.keys, out.values = tree_map(
        lambda a: mx.zeros((rows, a.shape[1], size, a.shape[3]), a.dtype), (head.keys, head.values)
    )
    pads, offsets, at = [], [], 0
    for c, n in zip(layer, ends, strict=True):
        b, shift = first(c.keys).shape[0], end - n
        for a, x in zip(planes(out), planes(c), strict=True):
            a[at : at + b, :, shift:end] = x[..., :n, :]
        if type(c) in SOLO:
            pads.append(mx.array([shift]))
            offsets.append(mx.array([n]))
        else:
            pads.append(c.left_padding + shift)
            offsets.append(c.offset)
        at += b
    out._idx = end
    out.left_padding, out.offset = mx.concatenate(pads), mx.concatenate(offsets)
    return out


def make_room(caches: Sequence[Any], feed: int, live: Sequence[bool]) -> None:
    """Before a forward that writes ``feed`` positions a row into plain batch KV
    caches: where the buffers are full, grow them here, without the left padding
    every live row shares. mlx-lm grows a buffer by a copy of all of it, padding
    included. Rows refilled in place (``Batch._fill``) are written at the batch's
    write position, and nothing else trims the batch until it is compacted: under
    a steady stream of joiners the shared padding, and with it every growth copy
    and the KV held, only grew (the flood's batch of four went from 768 to 2,816
    positions for rows of 730-870 tokens). The rows' keys, values and positions
    are unchanged; a retired slot's stale KV may be cut (it is never read)."""
    kv = first_kv(caches)
    if kv is None or kv._idx + feed <= first(kv.keys).shape[2]:
        return
    pads = [p for p, alive in zip(kv.left_padding.tolist(), live, strict=True) if alive]
    cut = min(pads, default=0)
    if cut < BatchKVCache.step:  # mlx-lm's own growth copies about as much
        return
    grow = (feed + BatchKVCache.step - 1) // BatchKVCache.step * BatchKVCache.step
    for c in caches:

        def grown(a: mx.array, c=c) -> mx.array:
            room = mx.zeros((a.shape[0], a.shape[1], grow, a.shape[3]), a.dtype)
            return mx.concatenate([a[..., cut : c._idx, :], room], axis=2)

        c.keys, c.values = tree_map(grown, (c.keys, c.values))
        c._idx -= cut
        c.left_padding = mx.maximum(c.left_padding - cut, 0)


def row_kv(cache: Any, i: int, batched: bool) -> tuple[Any, Any]:
    """Row ``i``'s keys and values, shaped (1, heads, length, dim), no padding
    (each a triple of such arrays where the KV is quantized)."""
    if not batched:
        return tree_map(lambda a: a[..., : cache.offset, :], (cache.keys, cache.values))
    pad = cache.left_padding[i].item()
    end = cache._idx
    return tree_map(lambda a: a[i : i + 1, :, pad:end], (cache.keys, cache.values))


def write_row(cache: BatchKVCache, d: int, keys: Any, values: Any) -> None:
    """Put one row's KV (:func:`row_kv`) in slot ``d`` of a batch KV cache,
    right-aligned at its write position, in place (the buffer is updated, not
    rebuilt)."""
    n = first(keys).shape[2]
    start = cache._idx - n
    for a, x in zip(planes(cache), arrays(keys, values), strict=True):
        a[d : d + 1, :, start : cache._idx] = x
    here = mx.arange(cache.left_padding.size) == d
    cache.left_padding = mx.where(here, start, cache.left_padding)
    cache.offset = mx.where(here, n, cache.offset)


def extracted(caches: Sequence[Any], i: int, order: list[int] | None = None) -> list[Any]:
    """Row ``i``'s caches out of a batch, copied now: a lazy extract would keep
    the whole batch buffer alive in the prompt cache (and stop the batch's next
    write into it from happening in place). ``order``: where its tokens sit
    (see ``Slot.order``), gathered back into token order."""
    out = [c.extract(i) if order is None else gathered(c, i, order) for c in caches]
    mx.eval([c.state for c in out])
    return out


def gathered(cache: BatchKVCache, i: int, order: list[int]) -> Any:
    """Row ``i`` of a batch KV cache, its tokens gathered into token order
    (``order`` for its first tokens; the rest were written in order after them)."""
    pad = cache.left_padding[i].item()
    at = mx.array([*order, *range(len(order), cache._idx - pad)]) + pad
    if quantized_kind(cache):
        out = QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
    else:
        out = KVCache()
    out.keys, out.values = tree_map(
        lambda a: mx.contiguous(a[i : i + 1, :, at]), (cache.keys, cache.values)
    )
    out.offset = at.size
    return out


def fit(caches: list[Any], n: int) -> list[Any]:
    """A leaving row's caches cut to its first ``n`` tokens: a step may have fed
    it more than it read before it ended (a verify step's drafts past its end)."""
    for c in caches:
        if type(c) in SOLO and c.offset > n:
            c.trim(c.offset - n)
    return caches


def nbytes(caches: Sequence[Any]) -> int:
    return sum(c.nbytes for c in caches)


def first_kv(caches: Sequence[Any]) -> BatchKVCache | None:
    for c in caches:
        if isinstance(c, CacheList):
            found = first_kv(c.caches)
            if found is not None:
                return found
        if isinstance(c, BatchKVCache) and c.keys is not None:
            return c
    return None
