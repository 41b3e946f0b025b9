"""Decode-step products from packed weights (``--packed-weights``, actors/kernels/packed.py):
mlx's own bits where they are routed, mlx's matmul wherever the bits would differ."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_nursery.actors.kernels import packed
from mlx_nursery.server.blas import find_openblas

# A two-layer llama whose products are the size of SmolLM2's (hidden 576, MLP 1,536,
# a tied head): the shapes OpenBLAS's packing path takes at a few rows.
MODEL = """
import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache
args = llama.ModelArgs(model_type="llama", hidden_size=576, num_hidden_layers=2,
    intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5,
    vocab_size=4096, tie_word_embeddings=True)
mx.random.seed(3)
model = llama.Model(args)
mx.eval(model.parameters())

def decode(rows, positions=1):
    cache = make_prompt_cache(model)
    model(mx.array([[7 + i for i in range(40)]] * rows), cache=cache)
    return model(mx.array([[11 + i for i in range(positions)]] * rows), cache=cache)
"""


def _under_openblas(script: str) -> None:
    """Run ``script`` in a child with OpenBLAS preloaded (as `serve` runs); it
    prints "ok" when its checks hold."""
    lib = find_openblas()
    if lib is None:
        pytest.skip("needs OpenBLAS")
    env = dict(os.environ, LD_PRELOAD=lib)
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    if "unavailable" in run.stderr:
        pytest.skip("needs a C++ compiler, Python's headers and an AVX-512 CPU")
    if "no small-matrix kernel" in run.stderr:
        pytest.skip(f"OpenBLAS's core here has {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]


def test_packed_products_are_mlxs_bits_under_openblas():
    """With OpenBLAS preloaded (as `serve` runs): the packed products and the
    small-matrix kernel's serve 1 to 32 rows (positions) on SmolLM2-sized
    shapes, and a decode step's logits at 1, 2, 4 and 8 rows, and a verify
    step's at 24 and 32 positions, are the same bits with them and without."""
    script = MODEL + textwrap.dedent("""
        from mlx_nursery.actors.kernels import packed
        if packed.module() is None:
            raise SystemExit("unavailable")
        # decode steps of 1-8 rows; verify steps of 8 x 3 and 4 x 8 positions
        shapes = [(1, 1), (2, 1), (4, 1), (8, 1), (8, 3), (4, 8)]
        plain = [decode(*shape) for shape in shapes]
        figures = packed.install(model)
        assert figures is not None and figures.modules == 15, figures  # 7 a layer + head
        got = [decode(*shape) for shape in shapes]
        for a, b in zip(plain, got):
            assert mx.array_equal(a, b).item()
        # decode steps from the panels and in place (where OpenBLAS's core has its
        # small-matrix kernel); prefill on mlx's matmul
        kernel = packed.openblas_core() in packed.SMALL_KERNEL_CORES
        assert figures.packed > 0 and (figures.small > 0) == kernel and figures.plain > 0, (
            figures, packed.openblas_core())
        # every row count on SkylakeX's cores; elsewhere those whose sums OpenBLAS
        # keeps (Haswell's: fewer rows, and fewer on one thread than on two) and
        # always one row's; the rest keep mlx's matmul (the logits above are equal)
        every = list(range(1, packed.MAX_ROWS + 1))
        served = sorted(packed.routes(1536, 576, False))
        assert served == every if kernel else served[:1] == [1], served
        # OpenBLAS's small-matrix kernel takes q and o at one and two rows, k and v
        # at up to six, down at one: those read the weight where it lies
        small = {shape: sorted(r for r, route in packed.routes(*shape, False).items()
                               if route == packed.SMALL)
                 for shape in ((576, 576), (192, 576), (576, 1536), (1536, 576))}
        want = {(576, 576): [1, 2], (192, 576): list(range(1, 7)), (576, 1536): [1],
                (1536, 576): []}
        assert small == (want if kernel else {shape: [] for shape in want}), small
        served = sorted(packed.routes(192, 576, False))
        assert served == every if kernel else served[:1] == [1], served
        packed.uninstall(model)
        assert type(model.model.layers[0].mlp.gate_proj).__name__ == "Linear"
        print("ok")
    """)
    _under_openblas(script)


def test_nothing_is_packed_where_the_bits_would_differ():
    """Under mlx's bundled BLAS (this suite's) the kernel is not even built: the
    model keeps mlx's matmul, module for module."""
    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("OpenBLAS is preloaded here")
    layer = nn.Linear(576, 1536, bias=False)
    model = nn.Sequential(layer)
    assert packed.install(model) is None
    assert type(layer) is nn.Linear
    assert packed.routes(1536, 576, False) == {}


def test_bounds_are_openblas_k_blocks():
    assert packed.bounds(576, 320) == (0, 288, 576)
    assert packed.bounds(1536, 320) == (0, 320, 640, 960, 1248, 1536)
    assert packed.bounds(300, 320) == (0, 300)
    x = mx.arange(2 * 16 * 3, dtype=mx.float32).reshape(32, 3)
    p = packed.panels(x).reshape(2, 3, 16)
    assert mx.array_equal(p[1, 2], x[16:, 2]).item()


def test_small_matrix_sums_match_openblas_on_odd_shapes():
    """Where OpenBLAS's small-matrix kernel sums an output alone (outputs past a
    multiple of four, a K past a multiple of sixteen, a bias), the extension's
    sums are still mlx's bits, at every row count that kernel takes."""
    script = textwrap.dedent("""
        import mlx.core as mx
        from mlx_nursery.actors.kernels import packed
        ext = packed.module()
        if ext is None:
            raise SystemExit("unavailable")
        if packed.openblas_core() not in packed.SMALL_KERNEL_CORES:
            raise SystemExit(f"no small-matrix kernel on {packed.openblas_core()}")
        for n, k in ((577, 100), (3, 40), (198, 57)):
            w = mx.random.normal((n, k), key=mx.random.key(n))
            b = mx.random.normal((n,), key=mx.random.key(k))
            for rows in range(1, packed.MAX_ROWS + 1):
                if n * rows > 1200:
                    continue  # OpenBLAS's packing path: not this kernel's sums
                x = mx.random.normal((rows, k), key=mx.random.key(rows))
                assert mx.array_equal(x @ w.T, ext.small_matmul(x, w)).item(), (n, k, rows)
                got = ext.small_matmul(x, w, b)
                assert mx.array_equal(mx.addmm(b, x, w.T), got).item(), (n, k, rows)
        print("ok")
    """)
    _under_openblas(script)
