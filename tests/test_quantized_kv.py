"""Quantized KV (``--kv-bits``): the batch, both lanes, every join path, speculation,
the prompt cache and the disk tier keep mlx-lm's bits (docs/quantized-kv.md).

The reference is mlx-lm's own ``generate_step`` with the same ``kv_bits``,
``kv_group_size`` and ``quantized_kv_start``, run live on the head-64 golden
variants (mlx quantizes in groups of 32 or more along a head: the head-16 toys
cannot take it). On gemma3, whose sliding-window layers mlx-lm's ``to_quantized``
refuses (``NotImplementedError``), the reference is ``generate_step`` with those
layers left float and mlx-lm's ``to_quantized`` on the others, the rule we serve.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import trio
from conftest import checked_engine, generate_to_eos, golden, loaded
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from mlx_nursery.actors.budget import project
from mlx_nursery.actors.errors import InvalidRequest
from test_parity import _play
from test_speculative import forced_drafts  # noqa: F401 (a fixture)

FAMILIES = ("llama_h64", "qwen3_h64", "gemma3_text_h64", "falcon_h1_h64")
STEP = 32  # prefill_step_size, as the goldens'


def base(family: str) -> str:
    return family.removesuffix("_h64")


class _FullLayersOnly:
    """gemma3's reference: mlx-lm's ``to_quantized`` after each forward on the
    plain layers only (its own rule raises on the sliding-window ones)."""

    def __init__(self, model, bits: int, start: int):
        self.model, self.bits, self.start = model, bits, start

    def __call__(self, inputs, cache, **kwargs):
        out = self.model(inputs, cache=cache, **kwargs)
        for i, c in enumerate(cache):
            if type(c) is KVCache and c.offset >= self.start:
                cache[i] = c.to_quantized(group_size=64, bits=self.bits)
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


def reference(family: str, prompt: list[int], max_tokens: int, bits: int, start: int = 0):
    model, tokenizer = loaded(family)
    kwargs = {"kv_bits": bits, "kv_group_size": 64, "quantized_kv_start": start}
    if family.startswith("gemma3"):
        model, kwargs = _FullLayersOnly(model, bits, start), {}
    return generate_to_eos(
        model, tokenizer, prompt, max_tokens=max_tokens, prefill_step_size=STEP, **kwargs
    )


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.mark.parametrize("bits", [8, 4])
async def test_both_lanes_match_generate_with_kv_bits(family, bits):
    cases = golden(base(family))["serial"]
    expected = [reference(family, c["prompt_ids"], c["max_tokens"], bits) for c in cases]
    for batch in (1, 8):
        async with checked_engine(family, batch=batch, kv_bits=bits) as engine:
            for case, want in zip(cases, expected, strict=True):
                result = await engine.generate(case["prompt_ids"], max_tokens=case["max_tokens"])
                assert result.tokens == want, (batch, case["prompt"])


@pytest.mark.parametrize("bits", [8, 4])
async def test_every_join_path_matches_generate_with_kv_bits(family, bits):
    """The goldens' scripted scenarios (rows joining a running batch at given
    steps, leaving by length or EOS, refilled over retired slots), each row
    against ``generate`` alone: a quantized batch changes no row's tokens."""
    g = golden(base(family))
    refilled = 0
    for name, rows in g["batch"].items():
        # The scenarios insert rows at given steps: played one step ahead, as in test_parity.
        async with checked_engine(family, batch=8, kv_bits=bits, pipeline=1) as engine:
            results = await _play(engine, g["prompts"], rows)
            for row, result in zip(rows, results, strict=True):
                want = reference(family, g["prompts"][row["prompt"]], row["max_tokens"], bits)
                assert result.tokens == want, f"{name}/{row['prompt']}@{row['insert_at']}"
            refilled += engine.stats().refilled
    if base(family) in ("llama", "qwen3"):
        assert refilled > 0  # rows written in place over retired slots, quantized


@pytest.mark.parametrize("bits", [8, 4])
async def test_rows_arriving_together_are_prefilled_as_one_group_exactly(family, bits,
                                                                          monkeypatch):  # fmt: skip
    """Fresh rows that arrive together under ``--kv-bits`` (start 0) are
    prefilled as one padded float batch and then quantized, as float rows are
    (one forward for all): each row still equals ``generate`` alone."""
    from mlx_nursery.actors import prefill

    groups = []
    real = prefill.prefill_together
    monkeypatch.setattr(prefill, "prefill_together", lambda jobs: groups.append(len(jobs))
                        or real(jobs))  # fmt: skip
    # short enough for several to share one chunk (the goldens' prefill step is 32)
    texts = golden(base(family))["prompts"].values()
    prompts = [p[:n] for p, n in zip(texts, (2, 6, 7, 8, 9), strict=True)]
    results = {}
    async with checked_engine(family, batch=8, kv_bits=bits) as engine:

        async def one(i: int) -> None:
            results[i] = (await engine.generate(prompts[i], max_tokens=10)).tokens

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
    for i, prompt in enumerate(prompts):
        assert results[i] == reference(family, prompt, 10, bits), i
    if family in ("llama_h64", "qwen3_h64"):  # gemma3's windows, falcon's recurrence: alone
        assert groups and max(groups) >= 2


@pytest.mark.parametrize("family", ["llama_h64", "qwen3_h64"])
async def test_verify_steps_roll_back_quantized_kv_exactly(family, forced_drafts):  # noqa: F811
    g = golden(base(family))
    async with checked_engine(family, batch=8, kv_bits=8) as engine:
        for rows in g["batch"].values():
            results = await _play(engine, g["prompts"], rows)
            for row, result in zip(rows, results, strict=True):
                want = reference(family, g["prompts"][row["prompt"]], row["max_tokens"], 8)
                assert result.tokens == want
        assert engine.stats().verify_steps > 0


async def test_quantized_kv_start_turns_a_row_quantized_where_generate_does():
    """With a start past the prompt, a lone row decodes on float KV, then on
    quantized KV from the step its length reaches the start, as ``generate``."""
    case = golden("llama")["serial"][3]  # 216 tokens
    start = len(case["prompt_ids"]) + 10
    want = reference("llama_h64", case["prompt_ids"], 40, 4, start)
    assert want != reference("llama_h64", case["prompt_ids"], 40, 4, 0)
    for batch in (1, 8):
        async with checked_engine(
            "llama_h64", batch=batch, kv_bits=4, quantized_kv_start=start, prompt_cache_size=0
        ) as engine:
            assert (await engine.generate(case["prompt_ids"], max_tokens=40)).tokens == want


async def test_a_seeded_row_draws_the_same_in_a_quantized_batch():
    cases = {c["prompt"]: c["prompt_ids"] for c in golden("llama")["serial"]}
    seeded = {"max_tokens": 24, "temperature": 1.0, "seed": 11}
    async with checked_engine("llama_h64", batch=8, kv_bits=8) as engine:
        alone = (await engine.generate(cases["utf8"], **seeded)).tokens
        out = {}

        async def run(name, prompt, params):
            out[name] = (await engine.generate(prompt, **params)).tokens

        async with trio.open_nursery() as nursery:
            for name in ("sentence", "chat", "long"):
                nursery.start_soon(run, name, cases[name], {"max_tokens": 40, "temperature": 1.0})
            await engine.wait_step(2)
            nursery.start_soon(run, "seeded", cases["utf8"], seeded)
    assert out["seeded"] == alone


async def test_a_prompt_cache_hit_gives_back_the_same_bits():
    """The entry a row leaves is quantized; a later row that shares its prefix
    takes those bits as they are and decodes as the first did."""
    case = golden("llama")["serial"][3]
    async with checked_engine("llama_h64", batch=8, kv_bits=4) as engine:
        first = await engine.generate(case["prompt_ids"], max_tokens=30)
        second = await engine.generate(case["prompt_ids"], max_tokens=30)
        assert engine.stats().prompt_cache_hits >= 1
    assert second.tokens == first.tokens == reference("llama_h64", case["prompt_ids"], 30, 4)


def test_the_disk_tier_stores_quantized_entries_bit_for_bit(tmp_path):
    from mlx_nursery.actors import disk_cache

    model, _ = loaded("llama_h64")
    caches = [KVCache() for _ in model.layers]
    model(mx.array([list(range(40, 140))]), cache=caches)
    caches = [c.to_quantized(group_size=64, bits=4) for c in caches]
    frozen = disk_cache.freeze(caches)
    tier = disk_cache.DiskTier(tmp_path, "identity-kv4", 1 << 30)
    entry = tier.write(np.arange(40, 140), frozen, "prompt")
    back = disk_cache.load(entry.path)
    assert all(type(c) is QuantizedKVCache and c.bits == 4 and c.offset == 100 for c in back)
    for a, b in zip(caches, back, strict=True):
        for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True):
            assert mx.array_equal(x[..., :100, :], y).item()


async def test_the_same_budget_holds_more_rows_at_8_bits():
    """Under one fixed budget, quantized rows are projected at their real bytes:
    the budget admits several times the float rows (float32 toys: 3.6x at 8
    bits, 6.4x at 4), and the batch decodes them together."""
    prompt = golden("llama")["serial"][3]["prompt_ids"]
    rows = {}
    for bits in (None, 8):
        async with checked_engine("llama_h64", batch=1, kv_bits=bits) as engine:
            rows[bits] = project(engine.info.kv_costs, len(prompt) + 64, STEP)
    assert rows[None] / rows[8] >= 3.5
    budget = 2 * rows[None] + rows[None] // 2  # two float rows, not three
    seen = 0
    async with checked_engine("llama_h64", batch=8, kv_bits=8, kv_budget=budget,
                              prompt_cache_size=0) as engine:  # fmt: skip

        async def run():
            await engine.generate(prompt, max_tokens=64)

        async def watch():
            nonlocal seen
            for step in range(1, 60):
                await engine.wait_step(step)
                seen = max(seen, engine.stats().decoding_rows)

        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(run)
            with trio.move_on_after(60):
                await watch()
    assert seen >= 4  # float KV: two at a time under this budget


def test_refusals_say_what_to_change():
    from mlx_nursery.actors.settings import EngineSettings

    with pytest.raises(InvalidRequest, match="kv_bits must be one of 4, 8"):
        EngineSettings(kv_bits=3)
    with pytest.raises(InvalidRequest, match="kv_group_size must be one of 32, 64, 128"):
        EngineSettings(kv_bits=8, kv_group_size=48)


async def test_a_model_whose_heads_the_groups_do_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"head size \(16\): its heads are too narrow"):
        async with checked_engine("llama", kv_bits=8):
            pass
    with pytest.raises(ValueError, match="pick --kv-group-size 32 or 64, or leave --kv-bits off"):
        async with checked_engine("llama_h64", kv_bits=8, kv_group_size=128):
            pass


async def test_stats_name_the_precision_and_its_bytes():
    async with checked_engine("llama_h64", batch=8, kv_bits=8) as engine:
        async with trio.open_nursery() as nursery:
            for c in golden("llama")["serial"][:3]:
                nursery.start_soon(lambda p=c["prompt_ids"]: engine.generate(p, max_tokens=30))
            await engine.wait_step(3)
            s = engine.stats()
            assert s.batch_kv_tokens > 0 and s.batch_kv_bytes_per_token > 0
            assert s.batch_kv_bytes_per_row > 0
    p = s.kv_precision
    assert (p.bits, p.group_size, p.start, p.name) == (8, 64, 0, "8-bit")
    # 2 layers x (keys + values) x 2 kv heads x 64 values: float32 2,048 bytes a
    # token; 8 bits: 64 bytes packed + a 4-byte scale and bias a 64-value group, 576
    assert (p.float_token_bytes, p.token_bytes) == (2048, 576)


def test_a_prefill_in_uneven_chunks_quantizes_where_generate_does():
    """A turn's budget cuts a joiner's chunks anywhere; the tokens before the
    cache turns quantized attend float KV, so the chunk that turns it must end
    where ``generate``'s does (its grid of ``step_size`` from the cached
    tokens). Elsewhere chunk ends change no bit."""
    from mlx_nursery.actors.request import SamplingParams
    from mlx_nursery.actors.step.joiner import Prefill
    from mlx_nursery.actors.step.quantized import KvBits

    model, _ = loaded("llama_h64")
    prompt = golden("llama")["serial"][3]["prompt_ids"]
    for start in (0, 50):
        kv = KvBits(4, 64, start)
        job = Prefill(model, prompt, SamplingParams(max_tokens=20), STEP, kv=kv)
        assert job.quantize_at() == (STEP if start == 0 else 64)
        budgets = iter([5, 7, 40, 3, *[11] * 40])
        while job.remaining:
            job.chunk(next(budgets))
        primed = job.prime()
        tokens = [primed.read_first()[0].token]
        while len(tokens) < 20:
            tokens += [s.token for read in primed.step() for s in read.tokens]
        assert tokens == reference("llama_h64", prompt, 20, 4, start)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("rows", "heads", "kv_heads", "length"), [(1, 4, 2, 37), (3, 9, 3, 300),
                                                                   (8, 6, 6, 129)])  # fmt: skip
def test_folded_decode_attention_is_mlx_lms_to_the_bit(bits, rows, heads, kv_heads, length):
    from mlx_lm.models.base import quantized_scaled_dot_product_attention
    from mlx_nursery.actors.kernels.quantized_attention import attention

    mx.random.seed(rows * 31 + length)
    q = mx.random.normal((rows, heads, 1, 64))
    k, v = (mx.quantize(mx.random.normal((rows, kv_heads, length, 64)), 64, bits) for _ in "kv")
    pads = mx.array([i * 5 for i in range(rows)])
    for mask in (None, (mx.arange(length)[None] >= pads[:, None])[:, None, None, :]):
        want = quantized_scaled_dot_product_attention(
            mx.array(q), k, v, scale=0.125, mask=mask, group_size=64, bits=bits
        )
        got = attention(q, k, v, 0.125, mask, 64, bits, library=False)
        assert mx.array_equal(got, want).item()


async def test_a_device_without_quantized_attention_refuses_kv_bits_at_load(monkeypatch):
    """mlx's CUDA build has no ``quantized_matmul`` for a prefill's shapes (seen on
    an H200, mlx 0.32.4: every prompt's prefill failed). ``--kv-bits`` is then
    refused at load, naming the flag, rather than failing each request. The CPU's
    ``quantized_matmul`` is made to refuse more than one query as CUDA's does (and
    the C library, which covers such chunks on a CPU only, is kept out)."""
    from mlx_nursery.actors.kernels import quantized_attention

    real = mx.quantized_matmul
    monkeypatch.setattr(quantized_attention, "library_agrees", lambda: False)

    def cuda_like(x, *args, **kwargs):
        if x.shape[-2] > 1:
            raise RuntimeError("[quantized_matmul] No implementation for problem shape")
        return real(x, *args, **kwargs)

    monkeypatch.setattr(mx, "quantized_matmul", cuda_like)
    with pytest.raises(ValueError, match=r"--kv-bits 8: mlx on this device .* leave --kv-bits off"):
        async with checked_engine("llama_h64", kv_bits=8):
            pass
    monkeypatch.setattr(mx, "quantized_matmul", real)
    async with checked_engine("llama_h64", kv_bits=8) as engine:  # where mlx has it: served
        assert len((await engine.generate([5, 6, 7], max_tokens=4)).tokens) == 4
