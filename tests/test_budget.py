"""The KV budget: projected bytes per cache kind, FIFO queueing instead of OOM,
refusal of what could never fit, and a prompt cache that yields to live rows."""

from __future__ import annotations

import pytest
import trio
from conftest import FAMILIES, checked_engine, golden
from mlx_nursery.actors import InvalidRequest
from mlx_nursery.actors.budget import parse_budget

FAMILY = "llama"
CASES = {c["prompt"]: c for c in golden(FAMILY)["serial"]}
ROW = 256 * 512  # a llama toy row under 256 tokens: one 256-token granule, 512 B a token


@pytest.mark.parametrize("family", FAMILIES)
async def test_projection_bounds_what_a_row_really_holds(family):
    prompt = golden(family)["prompts"]["long"]
    async with checked_engine(family, batch=1) as engine:
        kinds = {c.kind.value for c in engine.info.kv_costs}
        projected = engine.project(len(prompt) + 40)
        async with engine.submit(prompt, max_tokens=40) as stream:
            seen = 0
            async for _ in stream:
                await trio.testing.wait_all_tasks_blocked()
                seen = max(seen, engine.stats().kv_bytes)
    assert 0 < seen <= projected
    if kinds == {"full"}:
        assert seen == projected  # plain KV: the projection is exact
    if "window" in kinds:  # windows stop growing: 10x the length costs far less than 10x
        assert engine.project(10_000) < 10 * engine.project(1_000)
    if kinds == {"state"}:
        assert engine.project(10_000) == engine.project(10)


async def test_rows_beyond_the_budget_queue_fifo_and_all_complete():
    names = ["sentence", "utf8", "chat", "short", "sentence", "utf8"]
    admitted, decoding = {}, []
    results = {}

    async def run(i):
        submitted = trio.current_time()
        async with engine.submit(CASES[names[i]]["prompt_ids"], max_tokens=40) as stream:
            results[i] = await stream.result()
            admitted[i] = submitted + results[i].usage.queue_wait

    async with checked_engine(FAMILY, batch=8, kv_budget=2 * ROW) as engine:
        assert engine.project(len(CASES["chat"]["prompt_ids"]) + 40) == ROW
        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(run, i)
                await trio.testing.wait_all_tasks_blocked()  # submit in this order
            while len(results) < 6:
                await engine.wait_step(engine.steps + 1)
                await trio.testing.wait_all_tasks_blocked()
                s = engine.stats()
                decoding.append(s.decoding_rows)
                assert s.kv_projected_bytes <= 2 * ROW
    assert max(decoding) == 2
    assert sorted(range(6), key=admitted.get) == list(range(6))  # admitted in FIFO order
    assert all(results[i].tokens == CASES[names[i]]["tokens"] for i in range(6))


async def test_a_row_that_could_never_fit_is_refused_and_the_rest_proceed():
    async with checked_engine(FAMILY, batch=8, kv_budget=2 * ROW) as engine:
        ok = []

        async def run(name):
            ok.append(await engine.generate(CASES[name]["prompt_ids"], max_tokens=40))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "sentence")
            too_big = r"needs up to 393,216 bytes .* budget is 262,144 bytes: lower max_tokens"
            with pytest.raises(InvalidRequest, match=too_big):
                engine.submit(CASES["long"]["prompt_ids"], max_tokens=300)
            nursery.start_soon(run, "chat")
    assert [r.tokens for r in ok] and all(r.finish_reason == "length" for r in ok)
    assert engine.stats().rejected == 1


async def test_the_prompt_cache_shrinks_when_the_live_batch_grows():
    budget = 3 * ROW
    async with checked_engine(FAMILY, batch=8, kv_budget=budget) as engine:
        for name in ("sentence", "utf8", "chat"):
            await engine.generate(CASES[name]["prompt_ids"], max_tokens=10)
        await trio.testing.wait_all_tasks_blocked()
        alone = engine.stats().prompt_cache_bytes
        assert alone >= 2 * ROW  # with nothing live, the cache may use the budget

        async def long_row(name):
            await engine.generate(CASES[name]["prompt_ids"] + [1, 2, 3], max_tokens=40)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_row, "sentence")
            nursery.start_soon(long_row, "short")
            await engine.wait_step(3)
            for _ in range(5):  # the trim runs on the GPU thread: give it a step or two
                await engine.wait_step(engine.steps + 1)
                await trio.testing.wait_all_tasks_blocked()
                s = engine.stats()
                if s.prompt_cache_bytes <= budget - s.kv_projected_bytes:
                    break
            assert s.kv_projected_bytes == 2 * ROW
            assert s.prompt_cache_bytes <= budget - s.kv_projected_bytes < alone


def test_budget_values():
    assert parse_budget(None) is None and parse_budget("auto") == "auto"
    assert parse_budget("2G") == 2 << 30 and parse_budget("512MiB") == 512 << 20
    assert parse_budget(1234) == 1234
    with pytest.raises(ValueError, match="not a byte count"):
        parse_budget("lots")
