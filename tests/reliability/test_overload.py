"""Overload is refused honestly (429 with Retry-After, never a hang); a stalled GPU
call turns /health to 503 with the reason; the API key guards /v1."""

from __future__ import annotations

import httpx
import pytest
import trio
import trio.testing
from conftest import (
    FaultyModel,
    checked_engine,
    golden,
    loaded,
    model_path,
    running_server,
    served,
    server_process,
)
from mlx_nursery.actors import GenerationFailed, Overloaded
from mlx_nursery.server.bench import storm

FAMILY = "llama"
CASES = golden(FAMILY)["serial"]
AGENTS, TURNS = 64, 5


async def test_sixty_four_clients_against_a_queue_of_eight_get_only_429s_and_answers():
    """The storm (``bench.storm``): 64 agents at once, 5 requests each, honouring
    Retry-After, against a queue of 8; the server in its own process and /health
    probed every 5 ms from a third. The /health target (p99 under 20 ms) is a
    timing figure, met and recorded by ``make bench`` (docs/reliability.md); here
    the check is that the loop never stops answering: every probe a 200, and its
    p99 far from a blocked loop's (mlx_lm.server's worst was 1 s)."""
    with trio.fail_after(180):
        model = str(model_path(FAMILY))
        flags = ("--model", model, "--batch", "8", "--max-queued-requests", "8")
        async with server_process(*flags) as (url, _):
            prompts = [case["prompt_ids"] for case in CASES]
            result = await storm(url, prompts, agents=AGENTS, turns=TURNS, max_tokens=40)
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                s = (await client.get("/stats")).json()
                metrics = (await client.get("/metrics")).text
    statuses = [a.status for a in result.answers]
    assert set(statuses) <= {200, 429} and len(statuses) == AGENTS * TURNS
    assert statuses.count(429) >= 1 and statuses.count(200) >= 16
    for a in result.answers:
        if a.status == 429:
            assert a.body["error"]["code"] == "queue_full" and int(a.retry_after) >= 1
        else:
            case = CASES[(a.agent + a.turn) % len(CASES)]
            assert a.body["choices"][0]["text"] == served(case["text"])
    assert s["overloaded"] == statuses.count(429)
    assert f"mlx_nursery_requests_overloaded_total {statuses.count(429)}" in metrics
    assert result.health and all(h >= 0 for h in result.health)  # every probe a 200
    p99 = result.health_percentile(0.99)
    print(f"\n/health under {AGENTS} clients: p99 {p99 * 1e3:.1f} ms over "
          f"{len(result.health)} probes")  # fmt: skip
    assert p99 < 0.25


async def test_the_embedding_api_raises_a_typed_error_when_the_queue_is_full():
    async with checked_engine(FAMILY, batch=1, max_queued_requests=1) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.generate, CASES[0]["prompt_ids"])  # runs
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(engine.generate, CASES[1]["prompt_ids"])  # waits
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(Overloaded, match="retry in") as err:
                await engine.generate(CASES[2]["prompt_ids"])
            assert err.value.retry_after >= 1 and err.value.queued == 1
            # Shedding comes first: the row is not built (no rendering, no
            # tokenizing), so even a prompt past the context is "busy", not a 400.
            with pytest.raises(Overloaded):
                engine.submit([7] * (engine.info.context_length + 1))
    assert engine.stats().overloaded == 2 and engine.stats().ledger_balanced


async def test_a_request_that_waits_past_the_queue_timeout_fails_with_its_code():
    model, tokenizer = loaded(FAMILY)
    faulty = FaultyModel(model)
    async with checked_engine((faulty, tokenizer), batch=1, queue_timeout=0.2) as engine:
        faulty.stall_seconds = 1.0  # the running request holds the only slot a while
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.generate, CASES[0]["prompt_ids"])
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(GenerationFailed, match="longer than the queue timeout") as err:
                await engine.generate(CASES[1]["prompt_ids"])
            assert err.value.code == "queue_timeout"
    assert engine.stats().queue_timeouts == 1


async def test_a_stalled_gpu_call_turns_health_to_503_until_it_completes():
    model, tokenizer = loaded(FAMILY)
    faulty = FaultyModel(model)
    with trio.fail_after(60):
        async with running_server(model=(faulty, tokenizer), step_timeout=0.3) as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                assert (await client.get("/health")).status_code == 200
                faulty.stall_seconds = 1.5

                async def request():
                    body = {"prompt": "hi", "max_tokens": 3}
                    assert (await client.post("/v1/completions", json=body)).status_code == 200

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(request)
                    await trio.sleep(0.9)
                    r = await client.get("/health")
                    assert r.status_code == 503 and "step timeout" in r.json()["error"]
                r = await client.get("/health")
                assert r.status_code == 200
                assert (await client.get("/stats")).json()["stalls"] == 1


async def test_the_api_key_guards_v1_and_health_stays_open():
    with trio.fail_after(60):
        async with running_server(api_key="s3cret", protect_stats=True) as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                assert (await client.get("/health")).status_code == 200
                for headers in ({}, {"Authorization": "Bearer nope"}, {"x-api-key": "s3cre"}):
                    r = await client.get("/v1/models", headers=headers)
                    assert r.status_code == 401
                    assert r.json()["error"]["type"] == "authentication_error"
                assert (await client.get("/stats")).status_code == 401
                ok = {"Authorization": "Bearer s3cret"}
                assert (await client.get("/v1/models", headers=ok)).status_code == 200
                assert (await client.get("/stats", headers=ok)).status_code == 200
                r = await client.post(
                    "/v1/completions",
                    json={"prompt": "hi", "max_tokens": 2},
                    headers={"x-api-key": "s3cret"},
                )
                assert r.status_code == 200
