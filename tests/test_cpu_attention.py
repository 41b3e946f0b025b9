"""The vectorized CPU softmax (``actors/step/cpu_attention.py``): mlx's bits, always.

The library must give exactly the floats mlx computes (its ``exp``, its
softmax's left-to-right sum, its attention's composition around it), so that
parity with mlx-lm holds with it on; the goldens and parity suites run with it
on (the default). Here: the pieces against mlx directly, on the shapes and
masks models use, and the switch."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_nursery.actors.kernels import cpu_attention, ragged

pytestmark = pytest.mark.skipif(
    not cpu_attention.available(), reason="no C compiler, or not Linux x86-64: mlx's own softmax"
)


def bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint32)


@pytest.fixture
def every_call(monkeypatch) -> list:
    """Every softmax and attention call through the library, whatever its size
    (by default decode steps and small calls keep mlx's path, and a check of
    them would compare mlx with itself); the list records each library call."""
    monkeypatch.setattr(cpu_attention, "MIN_SCORES", 0)
    monkeypatch.setattr(cpu_attention, "MIN_QUERIES", 0)
    used, library = [], cpu_attention.library()

    class Counting:
        exp_rows = library.exp_rows

        def softmax_rows(self, *args):
            used.append(args[2:4])
            return library.softmax_rows(*args)

        def softmax_causal_rows(self, *args):
            used.append(args[2:4])
            return library.softmax_causal_rows(*args)

    monkeypatch.setattr(cpu_attention, "library", lambda: Counting())
    return used


def test_exp_is_mlx_exp_on_every_exponent_and_the_edges():
    """Every float32 exponent (all 256, both signs) with random mantissas, plus
    the values where mlx's exp switches branch (±88, NaN, ±inf, the rounding
    ties of x·log2(e) + 0.5). The check over all 2^32 inputs takes minutes; it
    was run when the library was written and agreed everywhere."""
    rng = np.random.default_rng(0)
    mantissas = rng.integers(0, 1 << 23, (512, 2048), dtype=np.uint32)
    exponents = (np.arange(512, dtype=np.uint32) << 23)[:, None]
    x = (exponents | mantissas).ravel().view(np.float32)
    ties = (np.arange(-130, 130, dtype=np.float32) + 0.5) / np.float32(1.442695)
    near = np.concatenate([np.nextafter(ties, np.inf), ties, np.nextafter(ties, -np.inf)])
    edges = np.array([88.0, -88.0, np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)
    x = np.concatenate([x, near.astype(np.float32), edges])
    out = np.empty_like(x)
    cpu_attention.library().exp_rows(x.ctypes.data, out.ctypes.data, x.size)
    want = np.asarray(mx.exp(mx.array(x)))
    assert np.all((bits(out) == bits(want)) | (np.isnan(out) & np.isnan(want)))


@pytest.mark.parametrize("shape", [(3, 1), (9, 601), (2, 8, 17, 4099), (1, 8, 900, 900)])
def test_softmax_is_mlx_softmax(shape, every_call):
    rng = np.random.default_rng(len(shape))
    scores = rng.normal(0, 10, shape).astype(np.float32)
    scores[..., : shape[-1] // 4] = np.finfo(np.float32).min  # masked the way mlx masks
    scores.reshape(-1, shape[-1])[0, -1] = -np.inf
    s = mx.array(scores)
    got = cpu_attention.softmax(s)
    assert np.array_equal(bits(got), bits(mx.softmax(s, axis=-1, precise=True)))
    assert every_call, "the library was not reached"


CAUSAL = [  # (blocks, queries a block, keys): the first query sees keys - queries + 1
    (1, 5, 10),
    (3, 33, 601),
    (2, 4, 50),
    (1, 8, 8),
    (9, 512, 4608),
]


@pytest.mark.parametrize("case", CAUSAL, ids=[str(c) for c in CAUSAL])
@pytest.mark.parametrize("in_place", [False, True])
def test_the_causal_softmax_is_mlxs_mask_then_softmax(case, in_place):
    """The causal mask applied in the library (its masked values never read) is
    mlx's: float32's lowest value where masked, then the softmax; also on the
    rows where that shortcut does not hold (all -inf, a NaN, +inf, values near
    the lowest), and written over the scores."""
    blocks, length, keys = case
    rng = np.random.default_rng(keys)
    scores = rng.normal(0, 8, (blocks, length, keys)).astype(np.float32)
    flat = scores.reshape(-1, keys)
    flat[0, :] = -np.inf
    flat[1, 0] = np.nan
    flat[2, :3] = -3.4e38
    flat[3, 1] = np.inf
    s = mx.array(scores)
    mx.eval(s)
    want = mx.softmax(cpu_attention._masked(s, length, keys - length), axis=-1, precise=True)
    mx.eval(want)  # before the scores are written over
    got = cpu_attention.softmax(s, causal=(length, keys - length), in_place=in_place)
    same = (bits(got) == bits(want)) | (np.isnan(np.asarray(got)) & np.isnan(np.asarray(want)))
    assert np.all(same)
    assert (got is s) == (in_place and scores.size >= cpu_attention.MIN_SCORES)


@pytest.mark.parametrize("shape", [(1, 1), (3, 601), (8, 9, 49152), (2, 3, 151936)])
def test_logsumexp_is_mlx_logsumexp(shape):
    """A verify step's logits (rows x positions x vocabulary), and the edges:
    a row all -inf (mlx gives -inf), one with +inf (+inf), one with a NaN."""
    rng = np.random.default_rng(len(shape) + shape[-1])
    logits = rng.normal(2, 6, shape).astype(np.float32)
    flat = logits.reshape(-1, shape[-1])
    if flat.shape[0] >= 3:
        flat[0, :] = -np.inf
        flat[1, -1] = np.inf
        flat[2, 0] = np.nan
    x = mx.array(logits)
    got, want = cpu_attention.logsumexp(x), mx.logsumexp(x, axis=-1, keepdims=True)
    assert got.shape == want.shape
    got, want = np.asarray(got), np.asarray(want)
    assert np.all((bits(got) == bits(want)) | (np.isnan(got) & np.isnan(want)))


CASES = [
    # (batch, heads, kv heads, queries, keys, mask): a decode step, a verify step,
    # prefill chunks (from scratch and after a cached prefix), the masks mlx-lm builds
    (8, 9, 3, 1, 601, None),
    (8, 9, 3, 3, 603, "causal"),
    (1, 8, 8, 300, 300, "causal"),
    (1, 9, 3, 110, 900, "causal"),
    (4, 9, 3, 2, 300, "bool"),
    (4, 4, 2, 2, 300, "additive"),
    (2, 8, 8, 5, 700, "bool 2-d"),
    (2, 8, 2, 5, 700, "bool per head"),
]


def normal(rng, *shape) -> mx.array:
    return mx.array(rng.normal(0, 1, shape).astype(np.float32))


def attention_inputs(rng, b, heads, kv_heads, length, keys) -> tuple[mx.array, ...]:
    """Queries, keys and values of one attention call (head dim 64)."""
    q = normal(rng, b, heads, length, 64)
    return q, normal(rng, b, kv_heads, keys, 64), normal(rng, b, kv_heads, keys, 64)


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_attention_is_mlx_attention(case, every_call):
    b, heads, kv_heads, length, keys, kind = case
    rng = np.random.default_rng(7)
    q, k, v = attention_inputs(rng, b, heads, kv_heads, length, keys)
    mask = {
        None: None,
        "causal": "causal",
        "bool": mx.array(rng.random((b, 1, length, keys)) > 0.3),
        "additive": normal(rng, b, 1, length, keys),
        "bool 2-d": mx.array(rng.random((length, keys)) > 0.3),
        "bool per head": mx.array(rng.random((b, heads, length, keys)) > 0.3),
    }[kind]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    got = cpu_attention.attention(q, k, v, 0.125, mask)
    assert got.shape == want.shape
    assert np.array_equal(bits(got), bits(want))
    assert every_call, "the library was not reached"


VERIFY_CASES = [
    # (batch, heads, kv heads, queries, keys, mask) of verify steps: a batch with
    # the mask mlx-lm's BatchKVCache builds, a lone row's "causal", no grouping
    (8, 9, 3, 3, 603, "bool"),
    (8, 9, 3, 9, 700, "bool"),
    (1, 9, 3, 4, 650, "causal"),
    (4, 4, 4, 3, 500, "bool"),
]


@pytest.mark.parametrize("case", VERIFY_CASES, ids=[str(c) for c in VERIFY_CASES])
def test_a_verify_step_folds_the_query_heads_and_keeps_mlxs_numbers(case, monkeypatch):
    """A verify step's few queries a row take the library at the usual thresholds,
    each key head's query heads folded into one matmul. Under the reference BLAS
    the suite runs on, the same bits as mlx's attention; under OpenBLAS the folded
    matmul rounds differently, so there only close."""
    b, heads, kv_heads, length, keys, kind = case
    rng = np.random.default_rng(11)
    q, k, v = attention_inputs(rng, b, heads, kv_heads, length, keys)
    pads = mx.array(rng.integers(0, keys // 3, (b,)))
    causal = mx.arange(keys - length, keys)[:, None] >= mx.arange(keys)[None]
    mask = "causal" if kind == "causal" else (causal & (mx.arange(keys) >= pads[:, None, None]))[
        :, None
    ]
    reached, softmax = [], cpu_attention.softmax
    monkeypatch.setattr(
        cpu_attention, "softmax", lambda s, **kw: reached.append(s.shape) or softmax(s, **kw)
    )
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    got = cpu_attention.attention(q, k, v, 0.125, mask, verify=True)
    assert got.shape == want.shape
    if "libopenblas" in Path("/proc/self/maps").read_text():
        assert np.allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    else:
        assert np.array_equal(bits(got), bits(want))
    assert len(reached) == 1, "the library was not reached"
    cpu_attention.attention(q[:, :, :1], k, v, 0.125)  # a decode step's: mlx's own
    assert len(reached) == 1


def test_other_dtypes_and_small_calls_take_mlx_path(monkeypatch):
    """float16 attention, decode steps and calls below ``MIN_SCORES`` never reach
    the library."""
    monkeypatch.setattr(cpu_attention, "softmax", lambda s, **kw: pytest.fail("used the library"))
    q = mx.zeros((1, 2, 1, 16), mx.float16)
    cpu_attention.attention(q, q, q, 0.25)
    small = mx.zeros((1, 2, 40, 16))
    cpu_attention.attention(small, small, small, 0.25, "causal")
    step, keys = mx.zeros((8, 9, 1, 64)), mx.zeros((8, 3, 900, 64))
    cpu_attention.attention(step, keys, keys, 0.125)


def test_the_flag_parses():
    from mlx_nursery.server.cli import build_parser, settings_from

    args = build_parser().parse_args(["serve", "--model", "x", "--cpu-softmax", "off"])
    assert settings_from(args).engine.cpu_softmax is False
    assert settings_from(build_parser().parse_args(["serve", "--model", "x"])).engine.cpu_softmax


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_a_model_generates_the_same_bits_through_the_library(family, every_call):
    """mlx-lm's own generation, every attention call (prefill and decode) through
    the library, against mlx's attention: the same tokens and logprobs, bit for bit."""
    from conftest import loaded
    from mlx_lm import stream_generate

    model, tokenizer = loaded(family)
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 200, 90)]

    def run() -> list:
        return [(r.token, bits(r.logprobs).tobytes())
                for r in stream_generate(model, tokenizer, prompt, max_tokens=16)]  # fmt: skip

    try:
        ragged.install(model, rows=False, exact_softmax=False)
        want = run()
        assert not every_call
        ragged.install(model, rows=False, exact_softmax=True)
        assert run() == want
        assert every_call, "the library was not reached"
    finally:
        ragged.install(model)


QUANTIZED = [  # rows, query heads, key heads, keys, dim, bits, group, queries a row
    (8, 9, 3, 453, 64, 8, 64, 1),
    (8, 9, 3, 1100, 64, 4, 64, 1),
    (2, 4, 4, 37, 64, 8, 32, 1),
    (1, 8, 2, 300, 128, 4, 128, 1),
    (3, 6, 2, 17, 64, 4, 32, 1),
    (4, 9, 3, 200, 64, 8, 64, 5),  # a verify step's few queries
    (1, 9, 3, 300, 64, 4, 32, 64),  # a prefill chunk
    (2, 4, 2, 50, 64, 8, 64, 50),  # a whole prompt at once
]


@pytest.mark.parametrize("case", QUANTIZED, ids=[str(c) for c in QUANTIZED])
def test_quantized_attention_is_mlx_lms_to_the_bit(case, monkeypatch):
    """Queries against a quantized cache's planes, sliced out of a larger buffer
    as the cache hands them over (strided, not copied), masked (the rows'
    padding, causal over several queries, and the causal mask by name) and not:
    the library's floats are those of mlx-lm's quantized attention."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention
    from mlx_nursery.actors.kernels.quantized_attention import attention, library_agrees

    rows, heads, kv_heads, length, dim, nbits, group, n = case
    rng = np.random.default_rng(length)
    q = normal(rng, rows, heads, n, dim)
    k, v = (
        tuple(a[..., :length, :] for a in mx.quantize(normal(rng, rows, kv_heads, length + 40, dim),
                                                      group, nbits))
        for _ in "kv"
    )  # fmt: skip
    assert library_agrees()  # its own check, made first
    calls = []
    library = cpu_attention.quantized_attention
    monkeypatch.setattr(cpu_attention, "quantized_attention",
                        lambda *a: calls.append(a[-2:]) or library(*a))  # fmt: skip
    pads = mx.array([(i * 7) % (length - n + 1) for i in range(rows)])
    causal = mx.arange(length - n, length)[:, None] >= mx.arange(length)[None]
    masks = [None, (mx.arange(length)[None] >= pads[:, None])[:, None, None, :] & causal, "causal"]
    for mask in masks:
        want = quantized_scaled_dot_product_attention(  # it scales its queries in place
            mx.array(q), k, v, scale=dim**-0.5, mask=mask, group_size=group, bits=nbits
        )
        got = attention(q, k, v, dim**-0.5, mask, group, nbits)
        assert bits(got).tobytes() == bits(want).tobytes()
        mlxs = attention(q, k, v, dim**-0.5, mask, group, nbits, library=False)
        if n == 1:
            assert bits(mlxs).tobytes() == bits(want).tobytes()  # --cpu-softmax off: mlx's
        else:
            assert mlxs is None  # mlx-lm's own path
    assert calls == [(nbits, n)] * 3


def test_quantized_attention_leaves_what_it_does_not_cover_to_mlx():
    """Other bit widths, additive masks and other dtypes: None (mlx's path)."""
    rng = np.random.default_rng(3)
    q = normal(rng, 2, 2, 3, 64)
    for nbits in (2, 8):
        k = mx.quantize(normal(rng, 2, 2, 20, 64), 64, nbits)
        v = mx.quantize(normal(rng, 2, 2, 20, 64), 64, nbits)
        additive = mx.zeros((2, 1, 1, 20))
        mask = additive if nbits == 8 else None
        got = cpu_attention.quantized_attention(q, k, v, mask, 64, nbits)
        assert got is None
    k16 = mx.quantize(normal(rng, 2, 2, 20, 64).astype(mx.float16), 64, 8)
    assert cpu_attention.quantized_attention(q.astype(mx.float16), k16, k16, None, 64, 8) is None
