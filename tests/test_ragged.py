"""Ragged attention (``actors/kernels/ragged.py``): in a decode step whose rows' lengths
differ widely, each row attends over its own keys. The result equals mlx-lm's
padded, masked attention to float rounding, and rows decoded that way give a
lone row's tokens (mlx-lm's ``stream_generate``)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import trio
from conftest import checked_engine, loaded
from mlx_lm import stream_generate
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache
from mlx_nursery.actors.kernels import Kernels, ragged


def test_row_by_row_attention_equals_the_padded_masked_one():
    pads, length = [300, 0, 290, 310], 400
    cache = BatchKVCache(pads)
    keys = mx.random.normal((4, 2, length, 16))
    values = mx.random.normal((4, 2, length, 16))
    cache.update_and_fetch(keys, values)
    queries = mx.random.normal((4, 2, 1, 16))
    mask = mx.array(np.arange(length)[None, :] >= np.array(pads)[:, None])[:, None, None, :]
    want = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.25, mask=mask)
    attention = ragged.ragged(lambda *a, **k: pytest.fail("took the padded path"))
    got = attention(queries, keys, values, cache, 0.25, mask)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)

    # Little padding, prefill chunks and rotating caches keep mlx-lm's path.
    assert ragged.padding(BatchKVCache([1, 0, 2, 0]), queries, keys) is None
    assert ragged.padding(cache, mx.zeros((4, 2, 8, 16)), keys) is None
    assert ragged.padding(BatchRotatingKVCache(64, pads), queries, keys) is None


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
async def test_rows_of_very_different_lengths_decode_as_lone_rows(family):
    model, tokenizer = loaded(family)
    rng = np.random.default_rng(3)
    vocab = min(tokenizer.vocab_size, 200)
    prompts = [[int(t) for t in rng.integers(3, vocab, n)] for n in (300, 9, 12, 7)]
    want = []
    for prompt in prompts:
        tokens = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=12)]
        want.append([t for t in tokens if t not in tokenizer.eos_token_ids])  # ends, not tokens
    before, results = ragged.calls, {}

    async def run(i: int) -> None:
        results[i] = (await engine.generate(prompts[i], max_tokens=12)).tokens

    # One step queued ahead: at 2 a joiner waits a step longer, and the short rows
    # can be done before the long one joins them (the case this test is about).
    async with checked_engine(family, batch=4, pipeline=1) as engine:
        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(run, i)
    assert ragged.calls > before, "the long row made the short ones attend row by row"
    for i, tokens in enumerate(want):
        assert results[i] == tokens, i


def test_the_flag_turns_it_off_for_the_process(capsys):
    import mlx_lm.models.llama as llama_module
    from mlx_nursery.actors.models.load import load_model
    from mlx_nursery.server.cli import build_parser, main, settings_from

    args = build_parser().parse_args(["serve", "--model", "x", "--ragged-attention", "off"])
    assert settings_from(args).engine.ragged_attention is False
    with pytest.raises(SystemExit):
        main(["serve", "--model", "x", "--ragged-attention", "maybe"])
    assert "--ragged-attention: expected on or off" in capsys.readouterr().err

    from conftest import model_path

    load_model(str(model_path("llama")), None,
               kernels=Kernels(ragged_attention=False, cpu_softmax=False))  # fmt: skip
    assert not hasattr(llama_module.scaled_dot_product_attention, "__wrapped__")
    load_model(str(model_path("llama")), None,
               kernels=Kernels(ragged_attention=False))  # the softmax alone
    assert llama_module.scaled_dot_product_attention._mlx_nursery_ragged == (False, True)
    load_model(str(model_path("llama")), None)
    assert llama_module.scaled_dot_product_attention.__wrapped__ is not None
