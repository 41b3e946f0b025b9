"""``n`` > 1 on chat and text completions: one prompt, n choices, each a row of
its own in the batch with its own draws, through the official openai SDK."""

from __future__ import annotations

import httpx
import openai
import pytest
import trio
from conftest import checked_engine, golden, running_server
from test_quantized_kv import reference

LONG = "Tell me a story about the sea. " * 30  # a prompt worth computing once


async def test_n_choices_each_its_own_draws_the_prompt_counted_once():
    with trio.fail_after(120):
        async with running_server(batch=8) as (url, _):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
            ask = {"model": "llama", "messages": [{"role": "user", "content": LONG}],
                   "max_tokens": 24, "temperature": 1.0, "seed": 11}  # fmt: skip
            reply = await client.chat.completions.create(**ask, n=3)
            assert [c.index for c in reply.choices] == [0, 1, 2]
            texts = [c.message.content for c in reply.choices]
            assert len(set(texts)) == 3  # each its own draws
            # choice i draws as a request of its own with the seed + i
            for i in range(3):
                one = await client.chat.completions.create(**{**ask, "seed": 11 + i})
                assert one.choices[0].message.content == texts[i]
            usage = reply.usage
            assert usage.prompt_tokens == one.usage.prompt_tokens
            assert usage.completion_tokens == sum(24 for _ in texts)
            # streamed: the same choices, each chunk with its index, one usage at the end
            stream = await client.chat.completions.create(
                **ask, n=3, stream=True, stream_options={"include_usage": True}
            )
            got, usages = ["", "", ""], []
            async for chunk in stream:
                for c in chunk.choices:
                    got[c.index] += c.delta.content or ""
                if chunk.usage is not None:
                    usages.append(chunk.usage)
            assert got == texts
            assert len(usages) == 1 and usages[0].completion_tokens == 72
            await client.close()


async def test_n_choices_share_one_prefill_of_the_prompt():
    """The later choices ride on the first: the prompt is computed and its last
    token forwarded once, and every choice samples its first token from that."""
    with trio.fail_after(120):
        async with running_server(batch=8) as (url, state):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
            before = state.engine.stats()
            prompt = LONG + "Once upon a time"
            reply = await client.completions.create(
                model="llama", prompt=prompt, max_tokens=8, temperature=1.0, n=4
            )
            after = state.engine.stats()
            assert [c.index for c in reply.choices] == [0, 1, 2, 3]
            computed = after.prefill_tokens - before.prefill_tokens
            assert computed == reply.usage.prompt_tokens, computed
            await client.close()


async def test_n_out_of_range_and_other_apis_are_refused_naming_the_field():
    with trio.fail_after(60):
        async with running_server() as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
                for n in (0, 17, "2", True):
                    r = await client.post("/v1/chat/completions", json={**chat, "n": n})
                    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
                r = await client.post("/v1/responses", json={"input": "hi", "n": 2})
                assert r.status_code == 400, r.text


async def test_leaving_a_stream_of_choices_early_cancels_every_choice():
    with trio.fail_after(120):
        async with running_server(batch=8) as (url, state):
            # <|im_end|> (258) barred: a choice that drew it early would finish, not be cancelled
            body = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 400,
                    "temperature": 1.0, "n": 3, "stream": True,
                    "logit_bias": {"258": -100}}  # fmt: skip
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: ")
                        if seen >= 6:
                            break
                with trio.fail_after(30):
                    while state.engine.stats().active_rows:  # noqa: ASYNC110 (polled)
                        await trio.sleep(0.05)
                stats = state.engine.stats()
                assert stats.cancelled >= 3, stats
                ok = await client.post("/v1/chat/completions", json={**body, "stream": False,
                                                                     "max_tokens": 4})  # fmt: skip
                assert ok.status_code == 200 and len(ok.json()["choices"]) == 3


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "falcon_h1", "mamba2", "llama_h64"])
async def test_rows_of_one_prompt_fork_from_one_prefill_on_every_cache_kind(family):
    """Three rows of one prompt at once ride on the first (plain, sliding-window,
    recurrent and quantized caches): the prompt is computed and primed once, and
    each row's tokens are a lone row's."""
    case = next(c for c in golden(family.removesuffix("_h64"))["serial"] if c["prompt"] == "long")
    kv = {"kv_bits": 8} if family.endswith("_h64") else {}
    want = case["tokens"]
    if kv:  # mlx-lm's generate with the same KV bits
        want = reference(family, case["prompt_ids"], case["max_tokens"], 8)
    async with checked_engine(family, batch=8, **kv) as engine:
        out = [None] * 3

        async def run(i):
            result = await engine.generate(case["prompt_ids"], max_tokens=case["max_tokens"])
            out[i] = result.tokens

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(run, i)
        assert out == [want] * 3
        stats = engine.stats()
        assert stats.prefill_tokens == len(case["prompt_ids"]) and stats.forked == 2
