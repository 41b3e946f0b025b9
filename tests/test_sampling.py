"""Per-row sampling on both lanes: processors, logprobs, stops, max_tokens.

Deterministic features (greedy with logits processors, logprobs) are checked
against mlx-lm run live on the same model; sampled rows are checked for not
disturbing their greedy neighbours.
"""

from __future__ import annotations

import math

import pytest
import trio
from conftest import checked_engine, golden, loaded
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_logits_processors
from mlx_nursery.actors import ContextOverflow, InvalidRequest

FAMILY = "llama"
CASES = {c["prompt"]: c for c in golden(FAMILY)["serial"]}
PROCESSORS = {
    "repetition_penalty": 1.5,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.3,
    "logit_bias": {101: 4.0, 32: 2.0},
}


def oracle(ids, max_tokens, top=5, **processors):
    """mlx-lm's stream_generate: tokens, chosen logprobs, top-N ids per token."""
    import mlx.core as mx

    model, tokenizer = loaded(FAMILY)
    lps = make_logits_processors(**processors) if processors else None
    tokens, chosen, tops = [], [], []
    for r in stream_generate(
        model, tokenizer, ids, max_tokens=max_tokens, prefill_step_size=32, logits_processors=lps
    ):
        if r.finish_reason == "stop":
            break
        tokens.append(r.token)
        chosen.append(r.logprobs[r.token].item())
        tops.append(set(mx.argsort(-r.logprobs)[:top].tolist()))
    return tokens, chosen, tops


@pytest.mark.parametrize("batch", [1, 8], ids=["serial", "lone-row"])
async def test_logprobs_match_mlx_lm(batch):
    ids = CASES["sentence"]["prompt_ids"]
    tokens, chosen, tops = oracle(ids, 12)
    async with checked_engine(FAMILY, batch=batch) as engine:
        r = await engine.generate(ids, max_tokens=12, logprobs=True, top_logprobs=5)
    assert r.tokens == tokens
    for got, want in zip(r.logprobs, chosen, strict=True):
        assert math.isclose(got, want, abs_tol=1e-4)
    for got, want in zip(r.top_logprobs, tops, strict=True):
        assert {t.token for t in got} == want
        assert [t.logprob for t in got] == sorted((t.logprob for t in got), reverse=True)


async def test_batched_rows_carry_their_own_logprobs():
    names = ["sentence", "utf8", "chat"]
    results = {}

    async def run(name, want):
        results[name] = await engine.generate(
            CASES[name]["prompt_ids"], max_tokens=20, logprobs=want, top_logprobs=3 if want else 0
        )

    async with checked_engine(FAMILY, batch=4) as engine, trio.open_nursery() as nursery:
        for i, n in enumerate(names):
            nursery.start_soon(run, n, i != 1)
    for n in names:
        assert results[n].tokens == CASES[n]["tokens"][:20], n
    assert results["utf8"].logprobs is None
    for n in ("sentence", "chat"):
        for token, lp, top in zip(
            results[n].tokens, results[n].logprobs, results[n].top_logprobs, strict=True
        ):
            assert top[0].token == token and math.isclose(top[0].logprob, lp)
            assert lp <= 0.0


@pytest.mark.parametrize("batch", [1, 8], ids=["serial", "lone-row"])
async def test_logits_processors_match_mlx_lm(batch):
    ids = CASES["chat"]["prompt_ids"]
    tokens, _, _ = oracle(ids, 30, **PROCESSORS)
    assert tokens != CASES["chat"]["tokens"][:30], "processors should change the output"
    async with checked_engine(FAMILY, batch=batch) as engine:
        r = await engine.generate(ids, max_tokens=30, **PROCESSORS)
    assert r.tokens == tokens


async def test_each_batched_row_keeps_its_own_processors_and_sampler():
    ids = CASES["chat"]["prompt_ids"]
    with_processors, _, _ = oracle(ids, 30, **PROCESSORS)
    out = {}

    async def run(key, name, params):
        out[key] = await engine.generate(CASES[name]["prompt_ids"], max_tokens=30, **params)

    sampled = {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "min_p": 0.05}
    async with checked_engine(FAMILY, batch=4) as engine, trio.open_nursery() as nursery:
        nursery.start_soon(run, "greedy", "sentence", {})
        nursery.start_soon(run, "processed", "chat", PROCESSORS)
        nursery.start_soon(run, "sampled", "utf8", sampled)
        nursery.start_soon(run, "greedy2", "utf8", {})
    assert out["greedy"].tokens == CASES["sentence"]["tokens"][:30]
    assert out["greedy2"].tokens == CASES["utf8"]["tokens"][:30]
    assert out["processed"].tokens == with_processors
    assert 1 <= len(out["sampled"].tokens) <= 30


@pytest.mark.parametrize("batch", [1, 8], ids=["serial", "lone-row"])
async def test_stop_strings_end_the_text_before_them(batch):
    case = CASES["long"]
    text = case["text"]
    stop = next(text[i : i + 2] for i in range(6, len(text)) if text[i : i + 2].isprintable())
    async with checked_engine(FAMILY, batch=batch) as engine:
        r = await engine.generate(case["prompt_ids"], max_tokens=40, stop=[stop, "never-seen"])
    assert r.finish_reason == "stop"
    assert stop not in r.text
    assert r.text == text[: text.find(stop)]


@pytest.mark.parametrize("batch", [1, 8], ids=["serial", "lone-row"])
async def test_stop_token_ids_and_max_tokens(batch):
    case = CASES["sentence"]
    stop_id = case["tokens"][5]
    cut = case["tokens"].index(stop_id)
    async with checked_engine(FAMILY, batch=batch) as engine:
        r = await engine.generate(case["prompt_ids"], max_tokens=40, stop_token_ids=[stop_id])
        assert (r.tokens, r.finish_reason) == (case["tokens"][:cut], "stop")
        r = await engine.generate(case["prompt_ids"], max_tokens=7)
        assert (r.tokens, r.finish_reason) == (case["tokens"][:7], "length")
        assert r.usage.completion_tokens == 7
        assert r.usage.prompt_tokens == len(case["prompt_ids"])
        assert r.usage.time_to_first_token > 0 and r.usage.queue_wait >= 0
        assert r.usage.decode_tokens_per_second > 0


async def test_prompts_as_text_and_chat_messages():
    from make_goldens import CHAT, PROMPTS

    async with checked_engine(FAMILY, batch=8) as engine:
        r = await engine.generate(PROMPTS["sentence"], max_tokens=40)
        assert r.tokens == CASES["sentence"]["tokens"]
        r = await engine.generate(CHAT, max_tokens=40)
        assert r.tokens == CASES["chat"]["tokens"]


async def test_bad_requests_are_refused_with_what_to_change():
    async with checked_engine(FAMILY, batch=8, context_length=64) as engine:
        with pytest.raises(
            ContextOverflow, match=r"prompt is 80 tokens; this model's context is 64"
        ):
            engine.submit(CASES["chat"]["prompt_ids"])
        with pytest.raises(ContextOverflow, match=r"lower max_tokens to at most 20"):
            engine.submit(CASES["sentence"]["prompt_ids"], max_tokens=100)
        with pytest.raises(InvalidRequest, match="prompt is empty"):
            engine.submit("")
        with pytest.raises(InvalidRequest, match="out of range") as exc:
            engine.submit([1, 2, 99999])
        assert exc.value.param == "prompt"
        with pytest.raises(InvalidRequest, match="top_logprobs must be between 0 and 20"):
            engine.submit("hi", top_logprobs=21)
        with pytest.raises(InvalidRequest, match="temperature must be >= 0"):
            engine.submit("hi", temperature=-1)
        with pytest.raises(InvalidRequest, match="unknown parameter 'bogus'"):
            engine.submit("hi", bogus=1)
        with pytest.raises(InvalidRequest, match="needs a 'role' and a 'content'"):
            engine.submit([{"role": "user"}])
        # nothing running was touched: the engine still serves
        r = await engine.generate(CASES["short"]["prompt_ids"], max_tokens=5)
        assert r.tokens == CASES["short"]["tokens"][:5]
        assert engine.stats().rejected == 8
