"""mlx's CPU attention with its softmax computed many lanes wide, to the same bits
(and its quantized attention over ``--kv-bits`` caches).

On Linux x86-64, mlx's CPU kernels run one lane at a time, and its ``exp`` is a
polynomial whose fused multiply-adds are libm calls: about 20 ns an element.
In a CPU attention that is most of the time over a long chunk (a 900-token
prefill chunk of the 31M model: 180 of 227 ms a layer). ``cpu_attention.c`` does
the same arithmetic operation for operation (its ``exp`` was checked equal to
mlx's on all 2^32 float32 inputs; ``tests/test_cpu_attention.py`` checks every
exponent and the branch edges), keeps the softmax's left-to-right sum, and is
vectorized by the compiler, so the numbers are mlx's bit for bit and
parity with mlx-lm is untouched.

:func:`attention` is the composition mlx's ``scaled_dot_product_attention``
falls back to on the CPU (scale, grouped-query reshape, scores, mask, softmax,
values), with that softmax swapped in. The scores are evaluated first and the
softmax runs outside the graph (through numpy views, over the scores' own
buffer; a ``"causal"`` mask applied in it, never built), so each attention call
costs one synchronisation, and the step can no longer be built while the one
before it computes. That pays for chunks of many queries (a prefill of 900
tokens: 3.06 to 2.21 s on the 31M model, 13.9 to 11.0 s on SmolLM2, engine
level, OpenBLAS) but not for decode steps: a forward of one query per row ran
20% faster alone, yet whole engines at batch 8 were level within this VM's
noise. So only chunks of ``MIN_QUERIES`` queries or more take it, and verify
steps, which wait for their samples anyway (:func:`attention`'s ``verify``).
Verify steps also take its :func:`logsumexp` of their logits (mlx's bits; mlx's
own is a tenth of a width-9 step at batch 8 on SmolLM2's vocabulary).

The same library holds mlx-lm's quantized attention (decode, verify, prefill)
(:func:`quantized_attention`, over ``--kv-bits`` caches): mlx's CPU
``quantized_matmul`` also runs one lane at a time, and reads each key once per
query head; the library's sums keep mlx's order, many outputs at a time.

The library is compiled on first use with the system C compiler into
``~/.cache/mlx-nursery/native`` (``-march=native``; the cache key holds the
CPU's flags) and checked against mlx on a sample before it is used. Without a
compiler, on another platform, or if the check fails, :func:`available` is
False and attention is mlx's own.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from .build import built

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.c")
# -ffp-contract=off: no multiply and add fused that mlx keeps apart. The other two
# only drop errno and trap semantics (they let floorf vectorize; no value changes).
FLAGS = (
    "-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno",
    "-fPIC", "-shared",
)  # fmt: skip
# Quantized attention runs on one thread below this many query-key pairs (rows x
# query heads x queries x keys): a decode step of 8 rows of 100 keys took 150 us
# on one and 210 us on two (the thread's start, and a core the step's other
# threads hold); two pay from about 70,000 (8 rows of 1,000 keys: 1.0 and 0.6 ms).
SPLIT_WORK = 50_000
MIN_QUERIES = 32  # fewer queries a row (decode, verify steps): mlx's own path
MIN_SCORES = 4096  # below this many scores mlx's own softmax is as quick as a sync
THREADS = max(1, min(4, os.cpu_count() or 1))

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def _build() -> Path | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: CPU attention keeps mlx's own softmax")
        return None
    return built(
        "cpu_attention.so", [SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler.encode()],
        lambda out: [compiler, *FLAGS, "-o", str(out), str(SOURCE), "-lm", "-lpthread"],
        "CPU attention keeps mlx's own softmax",
    )  # fmt: skip


def _agrees(lib: ctypes.CDLL) -> bool:
    """The library's exp and softmax give mlx's bits on a sample that covers the
    edges (masked -inf and float32-min scores, NaN, overflow, rows of 1)."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    edges = [0.0, -0.0, 88.0, -88.0, 88.5, -88.5, -87.9, 1e30, -1e30, np.inf, -np.inf, np.nan]
    edges += [0.5 / 1.442695, -0.5 / 1.442695, 3.4e38, -3.4e38]
    x = np.concatenate([np.array(edges, np.float32), rng.normal(0, 30, 200_000).astype(np.float32)])
    out = np.empty_like(x)
    lib.exp_rows(x.ctypes.data, out.ctypes.data, x.size)
    if not _same(out, np.asarray(mx.exp(mx.array(x)))):
        return False
    for rows, m in ((7, 1), (33, 601), (4, 4099)):
        s = (rng.normal(0, 8, (rows, m))).astype(np.float32)
        s[:, : m // 3] = np.finfo(np.float32).min
        s[0, -1] = -np.inf
        if rows > 5:
            s[5, :] = -np.inf
        for threads in (1, THREADS):
            out = np.empty_like(s)
            lib.softmax_rows(s.ctypes.data, out.ctypes.data, rows, m, threads)
            if not _same(out, np.asarray(mx.softmax(mx.array(s), axis=-1, precise=True))):
                return False
            causal = np.empty_like(s)
            length, offset = (rows, m - rows) if m >= rows else (1, 0)
            lib.softmax_causal_rows(s.ctypes.data, causal.ctypes.data, rows, m, length, offset,
                                    threads)  # fmt: skip
            want = mx.softmax(_masked(mx.array(s), length, offset), axis=-1, precise=True)
            if not _same(causal, np.asarray(want)):
                return False
            sums = np.empty(rows, np.float32)
            lib.logsumexp_rows(s.ctypes.data, sums.ctypes.data, rows, m, threads)
            if not _same(sums, np.asarray(mx.logsumexp(mx.array(s), axis=-1))):
                return False
    return True


def _same(a: Any, b: Any) -> bool:
    import numpy as np

    return bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))))


def library() -> ctypes.CDLL | None:
    """The built and checked library, or None (then mlx's own path is used)."""
    global _library, _tried
    with _lock:
        if _tried:
            return _library
        _tried = True
        if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
            return None  # elsewhere mlx's CPU kernels run several lanes, summing otherwise
        try:
            path = _build()
            if path is None:
                return None
            lib = ctypes.CDLL(str(path))
            p, n = ctypes.c_void_p, ctypes.c_long
            lib.exp_rows.argtypes, lib.exp_rows.restype = [p, p, n], None
            lib.softmax_rows.argtypes = [p, p, n, n, ctypes.c_int]
            lib.softmax_rows.restype = None
            lib.softmax_causal_rows.argtypes = [p, p, n, n, n, n, ctypes.c_int]
            lib.softmax_causal_rows.restype = None
            lib.logsumexp_rows.argtypes = [p, p, n, n, ctypes.c_int]
            lib.logsumexp_rows.restype = None
            longs = ctypes.POINTER(ctypes.c_long)  # a plane's strides
            lib.quantized_attention.argtypes = [
                p, p, p, p, longs, p, p, p, longs, p, p, n, n, n, n, n, n, *[ctypes.c_int] * 3,
            ]  # fmt: skip
            lib.quantized_attention.restype = ctypes.c_int
            if not _agrees(lib):
                log.warning("%s disagrees with mlx's softmax: not used", path.name)
                return None
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("CPU softmax unavailable (%s): mlx's own is used", exc)
            return None
        _library = lib
        return lib


def available() -> bool:
    return library() is not None


def softmax(scores: Any, causal: tuple[int, int] | None = None, in_place: bool = False) -> Any:
    """``mx.softmax(scores, axis=-1, precise=True)`` for a float32 array on the
    CPU, the same bits; evaluates ``scores`` (one synchronisation).

    ``causal``: ``(length, offset)``, mlx's attention's causal mask applied
    first (rows in blocks of ``length`` queries, the first at ``offset``; each
    sees the keys up to its own position, the others hold float32's lowest
    value), in the library without building the mask. ``in_place``: the result
    is written over ``scores`` (an intermediate nobody else holds), which
    saves allocating and copying a buffer as large as the scores."""
    import mlx.core as mx

    lib = library()
    if lib is None or scores.size < MIN_SCORES:
        if causal is not None:
            scores = _masked(scores, *causal)
        return mx.softmax(scores, axis=-1, precise=True)
    if causal is None:
        return _by_rows(lib.softmax_rows, scores, keep_last=True, in_place=in_place)
    length, offset = causal

    def kernel(x: int, out: int, rows: int, m: int, threads: int) -> None:
        lib.softmax_causal_rows(x, out, rows, m, length, offset, threads)

    return _by_rows(kernel, scores, keep_last=True, in_place=in_place)


def _masked(scores: Any, length: int, offset: int) -> Any:
    """mlx's attention's causal mask over ``scores`` (``length`` queries from
    ``offset`` against every key), float32's lowest value where masked."""
    import mlx.core as mx

    keys = scores.shape[-1]
    mask = mx.arange(offset, length + offset)[:, None] >= mx.arange(0, keys)[None]
    return mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))


def _by_rows(kernel: Any, x: Any, keep_last: bool, in_place: bool = False) -> Any:
    """``kernel`` over the last axis of ``x`` (evaluated first: one
    synchronisation), through numpy views; out has that axis (``keep_last``)
    or one value a row. ``in_place`` (with ``keep_last``): written over ``x``'s
    own buffer where it is contiguous, and ``x`` returned."""
    import mlx.core as mx
    import numpy as np

    mx.eval(x)
    values = np.asarray(x)  # a view of x's buffer
    m = values.shape[-1]
    if in_place and keep_last and values.flags.c_contiguous and values.flags.writeable:
        kernel(values.ctypes.data, values.ctypes.data, values.size // m, m, THREADS)
        return x
    values = np.ascontiguousarray(values)
    out = np.empty((*values.shape[:-1], m if keep_last else 1), np.float32)
    kernel(values.ctypes.data, out.ctypes.data, values.size // m, m, THREADS)
    return mx.array(out)


def logsumexp(x: Any) -> Any:
    """``mx.logsumexp(x, axis=-1, keepdims=True)`` for a float32 array on the
    CPU, the same bits; evaluates ``x`` (one synchronisation). A verify step's
    logits (rows x positions x vocabulary) take it: mlx's own runs one lane at a
    time, 44 ms for 72 positions of SmolLM2's 49k vocabulary."""
    import mlx.core as mx

    lib = library()
    if lib is None or x.dtype != mx.float32 or mx.default_device() != mx.cpu:
        return mx.logsumexp(x, axis=-1, keepdims=True)
    return _by_rows(lib.logsumexp_rows, x, keep_last=False)


def attention(
    queries: Any, keys: Any, values: Any, scale: float, mask: Any = None, verify: bool = False
) -> Any:
    """mlx's CPU ``scaled_dot_product_attention`` (its fallback composition, op for
    op) with :func:`softmax`; the same bits. Chunks of fewer than
    ``MIN_QUERIES`` queries or ``MIN_SCORES`` scores, other dtypes and devices
    take ``mx.fast.scaled_dot_product_attention``.

    ``verify``: a verify step's few queries a row take it too (that step waits
    for its samples anyway, so a synchronisation costs it little), with each key
    head's query heads folded into one matmul. mlx's layout runs one BLAS call
    per row, query head and query (72 a layer for SmolLM2 at batch 8); folded it
    is one per row and key head. The reference BLAS gives the same bits either
    way; OpenBLAS rounds the folded call differently, within a float's last bits
    (docs/speculative.md, "The verify step")."""
    import mlx.core as mx

    fast = mx.fast.scaled_dot_product_attention
    small = (
        queries.shape[2] < MIN_QUERIES
        or queries.shape[2] * keys.shape[2] * queries.shape[0] * queries.shape[1] < MIN_SCORES
    )
    if (small and not verify) or not usable(queries, keys, values):
        return fast(queries, keys, values, scale=scale, mask=mask)
    b, heads, length, dim = queries.shape
    kv_heads = keys.shape[1]
    repeats = heads // kv_heads
    q = mx.array(scale, queries.dtype) * queries
    k, v = keys, values
    fold = verify and repeats > 1
    if fold:  # (b, kv_heads, repeats * length, dim): one matmul per row and key head
        q = q.reshape(b, kv_heads, repeats * length, dim)
        scores = (q @ k.swapaxes(-1, -2)).reshape(b, kv_heads, repeats, length, -1)
    else:
        if repeats > 1:
            q = q.reshape(b, kv_heads, repeats, length, dim)
            k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
        scores = q @ k.swapaxes(-1, -2)
    causal = None
    if isinstance(mask, str):  # "causal": the last queries against every key, in the library
        causal, mask = (length, k.shape[-2] - length), None
    elif mask is not None and repeats > 1 and mask.ndim >= 3:
        mask = (
            mx.expand_dims(mask, -3)
            if mask.shape[-3] == 1
            else mask.reshape(*mask.shape[:-3], kv_heads, repeats, *mask.shape[-2:])
        )
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    weights = softmax(scores, causal=causal, in_place=True)  # scores: this call's own
    if fold:
        weights = weights.reshape(b, kv_heads, repeats * length, -1)
    out = weights @ v
    return out.reshape(b, heads, length, dim) if repeats > 1 else out


def quantized_attention(
    q: Any, keys: tuple, values: tuple, mask: Any, group_size: int, bits: int, queries: int = 1
) -> Any | None:
    """mlx-lm's quantized attention, the same bits, in one call of the library
    (one synchronisation): ``q`` (rows, key heads, query heads a key head x
    ``queries``, dim), scaled, each query head's ``queries`` queries a row
    together (one in a decode step); ``keys`` and ``values`` a quantized
    cache's planes (packed words, scales, biases); ``mask`` None or boolean,
    (rows or 1, 1, ``queries`` or 1, keys). mlx's CPU kernel for
    ``quantized_matmul`` sums each output one lane at a time and reads every
    key once per query; the library dequantizes a block of keys once and sums
    16 outputs at a time in vector lanes, each still left to right. One layer
    of SmolLM2 (2-core CPU), mlx-lm's function against the library: 8 rows, one
    query, 453 keys at 8 bits, 2.9 and 0.6 ms; 8 rows of 4 queries over 1,100
    keys, 29.7 and 2.6 ms; a 512-token chunk over 1,100 keys, 380 and 23 ms
    (``quantized_attention`` in the C file). The result has ``q``'s shape;
    None where this path does not apply (mlx's then)."""
    import mlx.core as mx
    import numpy as np

    lib = library()
    planes = (*keys, *values)
    if (
        lib is None
        or bits not in (4, 8)
        or mx.default_device() != mx.cpu
        or q.dtype != mx.float32
        or any(a.dtype != mx.float32 for a in (*keys[1:], *values[1:]))
        or (mask is not None and (mask.dtype != mx.bool_ or mask.ndim != 4))
    ):
        return None
    rows, heads, repeats, dim = q.shape
    length = keys[0].shape[-2]
    if repeats % queries or (
        mask is not None
        and (mask.shape[0] not in (1, rows) or mask.shape[1] != 1
             or mask.shape[2] not in (1, queries) or mask.shape[-1] != length)
    ):  # fmt: skip
        return None
    mx.eval(q, *planes, *(() if mask is None else (mask,)))
    views = [np.asarray(a) for a in planes]
    strides = []
    for words, scales, biases in (views[:3], views[3:]):
        w = [x // words.itemsize for x in words.strides]
        g = [x // scales.itemsize for x in scales.strides]
        if (
            w[2:] != [dim * bits // 32, 1]
            or g[2:] != [dim // group_size, 1]
            or [x // biases.itemsize for x in biases.strides] != g
        ):
            return None  # not the layout the kernel walks
        strides.append((ctypes.c_long * 4)(w[0], w[1], g[0], g[1]))
    scaled = np.ascontiguousarray(np.asarray(q))
    allowed = None
    if mask is not None:
        allowed = np.ascontiguousarray(
            np.broadcast_to(np.asarray(mask)[:, 0], (rows, queries, length)), dtype=np.uint8
        )
    out = np.empty(q.shape, np.float32)
    status = lib.quantized_attention(
        scaled.ctypes.data, *(v.ctypes.data for v in views[:3]), strides[0],
        *(v.ctypes.data for v in views[3:]), strides[1],
        None if allowed is None else allowed.ctypes.data, out.ctypes.data,
        rows, heads, repeats // queries, queries, length, dim, bits, group_size,
        THREADS if rows * heads * repeats * length >= SPLIT_WORK else 1,
    )  # fmt: skip
    if status < 0:
        return None
    if status > 0:
        raise MemoryError("quantized attention: no memory for a row's scores")
    return mx.array(out)


def usable(queries: Any, keys: Any, values: Any) -> bool:
    """float32 throughout, on the CPU, with the library at hand."""
    import mlx.core as mx

    return (
        queries.dtype == keys.dtype == values.dtype == mx.float32
        and mx.default_device() == mx.cpu
        and available()
    )
