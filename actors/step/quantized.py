"""Quantized KV in the batch: mlx-lm's ``QuantizedKVCache`` bits, batch-shaped.

mlx-lm quantizes a lone row's KV (``generate``'s ``kv_bits``): after a forward,
every layer cache whose length reached ``quantized_kv_start`` becomes a
``QuantizedKVCache`` (keys and values packed ``bits`` to a number, a scale and
a bias per ``group_size`` values), and attention reads it through
``quantized_matmul``. Its batch cache has no quantized kind, so ``mlx_lm.server``
serves such a request alone. :class:`QuantizedBatchKVCache` is that kind: the
layout of ``BatchKVCache`` (left-padded rows, one write position, per-row
offsets) with each of keys and values a (packed, scales, biases) triple.
``mx.quantize`` works group by group along a head's dimension, so a position's
bits do not depend on when or beside which rows it was quantized: a row moved
between a solo quantized cache and a batch keeps the same bits, and the same
attention (mlx-lm's ``quantized_scaled_dot_product_attention``, chosen by the
cache's ``bits``).

:class:`KvBits` is the setting (``--kv-bits``, ``--kv-group-size``,
``--quantized-kv-start``) and the rule of when a cache turns quantized.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

log = logging.getLogger(__name__)

GROUP_SIZES = (32, 64, 128)
BITS = (4, 8)
# mlx-lm's default is 5000. A batch holds one precision, so a row below the start
# that shares a batch with one past it is quantized early; from 0, every row is
# quantized exactly where mlx-lm's ``generate`` would quantize it.
DEFAULT_QUANTIZED_KV_START = 0


@attrs.frozen
class KvBits:
    """KV quantization: ``bits`` per value in groups of ``group_size``, for a
    cache once it holds ``start`` tokens (mlx-lm's ``quantized_kv_start``)."""

    bits: int
    group_size: int = 64
    start: int = DEFAULT_QUANTIZED_KV_START

    def after_forward(self, caches: list[Any]) -> None:
        """mlx-lm's rule after a lone row's forward (``maybe_quantize_kv_cache``):
        each plain cache that reached ``start`` is quantized, in place in the list.
        As there, only a layer that is a plain cache: a sliding window (mlx-lm's
        raises) and a hybrid layer's ``CacheList`` (it has no ``to_quantized``)
        stay as they are."""
        self._quantize(caches, self.start)

    def quantized(self, c: Any) -> Any:
        """A plain cache (solo or batch) as its quantized kind, now."""
        if type(c) is KVCache:
            return c.to_quantized(group_size=self.group_size, bits=self.bits)
        out = QuantizedBatchKVCache([], self.group_size, self.bits)
        out.left_padding, out.offset, out._idx = c.left_padding, c.offset, c._idx
        if c.keys is not None:
            out.keys, out.values = (
                mx.quantize(x[..., : c._idx, :], group_size=self.group_size, bits=self.bits)
                for x in (c.keys, c.values)
            )
        return out

    def all_quantized(self, caches: list[Any]) -> None:
        """Every plain cache in ``caches`` quantized, whatever its length (a row
        joining a quantized batch: one batch holds one precision)."""
        self._quantize(caches, 0)

    def _quantize(self, caches: list[Any], least: int) -> None:
        for i, c in enumerate(caches):
            if _plain(c) and _length(c) >= least:
                caches[i] = self.quantized(c)

    def check(self, head_dims: Sequence[int]) -> None:
        """A model whose heads the groups do not divide cannot take these bits."""
        bad = sorted({d for d in head_dims if d % self.group_size})
        if not bad:
            return
        fits = [g for g in GROUP_SIZES if all(d % g == 0 for d in head_dims)]
        instead = (
            f"pick --kv-group-size {' or '.join(map(str, fits))}"
            if fits
            else f"its heads are too narrow for mlx's groups ({', '.join(map(str, GROUP_SIZES))})"
        )
        raise ValueError(
            f"--kv-group-size {self.group_size} does not divide this model's attention head "
            f"size ({', '.join(map(str, bad))}): {instead}, or leave --kv-bits off"
        )


def runs_here(kv: KvBits, model: Any) -> None:
    """mlx's quantized attention tried on this device before any request needs
    it: a prompt of a few tokens, then a prefill chunk and a decode step through
    the caches quantized. mlx's CUDA build has no ``quantized_matmul`` for a
    prefill's shapes (seen on an H200, mlx 0.32.4: every prompt's prefill
    failed), so there ``--kv-bits`` is refused at load, saying so, instead of
    failing each request (GPU thread)."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    model(mx.array([[0] * 4]), cache=caches)
    kv.all_quantized(caches)
    if not any(quantized_kind(c) for c in caches):
        return  # no layer mlx-lm would quantize
    try:
        mx.eval(model(mx.array([[0] * 8]), cache=caches))
        mx.eval(model(mx.array([[0]]), cache=caches))
    except RuntimeError as exc:
        raise ValueError(
            f"--kv-bits {kv.bits}: mlx on this device ({mx.default_device()}) cannot run "
            f"quantized attention for this model (mlx says: {exc}); leave --kv-bits off "
            "here (mlx's CPU and Metal builds have it)"
        ) from exc


def _plain(c: Any) -> bool:
    return type(c) in (KVCache, BatchKVCache)


def _length(c: Any) -> int:
    return c.offset if type(c) is KVCache else c._idx


def quantized_kind(c: Any) -> bool:
    return type(c) in (QuantizedKVCache, QuantizedBatchKVCache)


def first(x: Any) -> mx.array:
    """The packed array of a quantized triple, or the array itself."""
    return x[0] if isinstance(x, tuple | list) else x


def arrays(keys: Any, values: Any) -> list[mx.array]:
    """Every array of some keys and values (one each, or three each)."""
    return [a for _, a in tree_flatten((keys, values))]


def planes(c: Any) -> list[mx.array]:
    """Every array of a cache's keys and values."""
    return arrays(c.keys, c.values)


class QuantizedBatchKVCache(BatchKVCache):
    """``BatchKVCache``'s layout over quantized keys and values (see the module).
    Solo quantized caches become one with ``kv.side_by_side`` (``kv.merge``)."""

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size, self.bits = group_size, bits

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        prev, n = self._idx, keys.shape[2]
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            b, heads = keys.shape[:2]
            grow = (self.step + n - 1) // self.step * self.step
            per = 32 // self.bits

            def empty(dim: int):
                return (
                    mx.zeros((b, heads, grow, dim // per), mx.uint32),
                    mx.zeros((b, heads, grow, dim // self.group_size), keys.dtype),
                    mx.zeros((b, heads, grow, dim // self.group_size), keys.dtype),
                )

            new_k, new_v = empty(keys.shape[3]), empty(values.shape[3])
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys, self.values = (
                    tuple(
                        mx.concatenate([a[..., :prev, :], z], axis=2)
                        for a, z in zip(x, y, strict=True)
                    )
                    for x, y in ((self.keys, new_k), (self.values, new_v))
                )
        self.offset = self.offset + n
        self._idx += n
        for x, new in ((self.keys, keys), (self.values, values)):
            q = mx.quantize(new, group_size=self.group_size, bits=self.bits)
            for a, part in zip(x, q, strict=True):
                a[..., prev : self._idx, :] = part
        return self.keys_and_values()

    def keys_and_values(self):
        return tree_map(lambda a: a[..., : self._idx, :], (self.keys, self.values))

    def filter(self, batch_indices) -> None:
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda a: a[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        cut = min(self.left_padding.tolist())
        if cut > 0:
            if self.keys is not None:
                self.keys, self.values = tree_map(
                    lambda a: a[..., cut:, :], (self.keys, self.values)
                )
            self._idx -= cut
            self.left_padding = self.left_padding - cut

    def extend(self, other: QuantizedBatchKVCache) -> None:
        end = max(self._idx, other._idx)
        size = max(first(c.keys).shape[2] for c in (self, other))

        def placed(c):
            left = end - c._idx
            right = size - first(c.keys).shape[2] - left
            keys, values = c.keys, c.values
            if right < 0:
                keys, values = tree_map(lambda a: a[..., :right, :], (keys, values))
                right = 0
            if left or right:
                pad = [(0, 0), (0, 0), (left, right), (0, 0)]
                keys, values = tree_map(lambda a: mx.pad(a, pad), (keys, values))
            return keys, values, c.offset, c.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = placed(self), placed(other)
        self.keys, self.values = (
            tuple(mx.concatenate([a, b]) for a, b in zip(x, y, strict=True))
            for x, y in ((k1, k2), (v1, v2))
        )
        self.offset, self.left_padding = mx.concatenate([o1, o2]), mx.concatenate([p1, p2])
        self._idx = end

    def extract(self, idx: int) -> QuantizedKVCache:
        pad = self.left_padding[idx].item()
        out = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        out.keys, out.values = tree_map(
            lambda a: mx.contiguous(a[idx : idx + 1, :, pad : self._idx]), (self.keys, self.values)
        )
        out.offset = self._idx - pad
        return out

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else sum(a.nbytes for a in planes(self))


