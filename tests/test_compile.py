"""``--compile``: the decode steps' RMSNorm and RoPE under ``mx.compile``
(``actors/kernels/fused.py``). The parity suites run with it on (the default on a
CPU); here: the switch, the same tokens either way on both lanes, the figures."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import checked_engine, golden, loaded
from mlx_lm.models.cache import make_prompt_cache
from mlx_nursery.actors.kernels import fused

FAMILIES = ("llama", "qwen3", "gemma3_text", "falcon_h1", "mamba2")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fused_blocks_give_the_same_logits_bit_for_bit(family):
    model, _ = loaded(family)
    prompt = mx.array(golden(family)["serial"][3]["prompt_ids"])[None]

    def decode() -> list[mx.array]:
        cache = make_prompt_cache(model)
        token = mx.argmax(model(prompt, cache=cache)[:, -1], -1)
        out = []
        for _ in range(12):
            logits = model(token[:, None], cache=cache)[:, -1]
            out.append(logits)
            token = mx.argmax(logits, -1)
        mx.eval(out)
        return out

    fused.uninstall(model)
    want = decode()
    figures = fused.install(model)
    try:
        got = decode()
    finally:
        fused.uninstall(model)
    assert figures.modules > 0 and figures.compiled > 0 and figures.plain > 0
    assert all(mx.array_equal(a, b).item() for a, b in zip(want, got, strict=True))


@pytest.mark.parametrize("batch", [1, 8])
async def test_on_and_off_give_the_same_tokens_and_on_reports_its_figures(batch):
    cases = golden("llama")["serial"]
    for setting in ("off", "on"):
        async with checked_engine("llama", batch=batch, compile=setting) as engine:
            for case in cases:
                result = await engine.generate(case["prompt_ids"], max_tokens=case["max_tokens"])
                assert result.tokens == case["tokens"], (setting, case["prompt"])
            stats = engine.stats()
    assert stats.compiled is not None  # the last engine: on
    assert stats.compiled.modules == fused.installed(loaded("llama")[0]) > 0
    assert stats.compiled.calls > 0 and 0 < stats.compiled.share < 1
    # a trace a block and shape (batch size, heads): the steps' shapes repeat
    assert 0 < stats.compiled.recompiles < stats.compiled.calls / 10


async def test_off_reports_none_and_a_bad_value_names_the_setting():
    from mlx_nursery.actors import EngineSettings
    from mlx_nursery.actors.errors import InvalidRequest

    async with checked_engine("llama", compile="off") as engine:
        await engine.generate(golden("llama")["serial"][0]["prompt_ids"], max_tokens=4)
        assert engine.stats().compiled is None
    with pytest.raises(InvalidRequest, match="compile must be one of auto, on, off"):
        EngineSettings(compile="fast")
