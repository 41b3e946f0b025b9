"""Decode-step products from packed weights (``--packed-weights``, actors/step/packed.py):
mlx's own bits where they are routed, mlx's matmul wherever the bits would differ."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_nursery.actors.step import packed
from mlx_nursery.server.serve import find_openblas

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

def decode(rows):
    cache = make_prompt_cache(model)
    model(mx.array([[7 + i for i in range(40)]] * rows), cache=cache)
    return model(mx.array([[11]] * rows), cache=cache)
"""


def test_packed_products_are_mlxs_bits_under_openblas():
    """With OpenBLAS preloaded (as `serve` runs): the packed products serve one to
    eight rows on SmolLM2-sized shapes, and a decode step's logits at 1, 4 and 8
    rows are the same bits with them and without."""
    lib = find_openblas()
    if lib is None:
        pytest.skip("needs OpenBLAS")
    script = MODEL + textwrap.dedent("""
        from mlx_nursery.actors.step import packed
        if packed.module() is None:
            raise SystemExit("unavailable")
        plain = [decode(r) for r in (1, 4, 8)]
        figures = packed.install(model)
        assert figures is not None and figures.modules == 15, figures  # 7 a layer + head
        got = [decode(r) for r in (1, 4, 8)]
        for a, b in zip(plain, got):
            assert mx.array_equal(a, b).item()
        assert figures.packed > 0 and figures.plain > 0, figures  # decode and prefill
        assert sorted(packed.routes(1536, 576, False)) == list(range(1, 9))
        packed.uninstall(model)
        assert type(model.model.layers[0].mlp.gate_proj).__name__ == "Linear"
        print("ok")
    """)
    env = dict(os.environ, LD_PRELOAD=lib)
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    if "unavailable" in run.stderr:
        pytest.skip("needs a C++ compiler, Python's headers and an AVX-512 CPU")
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]


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
