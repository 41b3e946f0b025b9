"""Overload is refused honestly (429 with Retry-After, never a hang); a stalled GPU
call turns /health to 503 with the reason; the API key guards /v1."""

from __future__ import annotations

import json
import math
import subprocess
import sys

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
    server_process,
)
from mlx_nursery.actors import GenerationFailed, Overloaded

FAMILY = "llama"
CASES = golden(FAMILY)["serial"]
REQUESTS_EACH = 5
# /health latencies, probed every 5 ms until a line arrives on stdin; JSON on stdout.
PROBE = """
import json, sys, threading, time, httpx
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
out = []
with httpx.Client(base_url=sys.argv[1], timeout=10) as c:
    while not stop.is_set():
        t0 = time.perf_counter()
        assert c.get("/health").status_code == 200
        out.append(time.perf_counter() - t0)
        time.sleep(0.005)
print(json.dumps(out))
"""


async def test_sixty_four_clients_against_a_queue_of_eight_get_only_429s_and_answers():
    statuses, retry_afters, health = [], [], []
    with trio.fail_after(180):
        model = str(model_path(FAMILY))
        flags = ("--model", model, "--batch", "8", "--max-queued-requests", "8")
        async with server_process(*flags) as (url, _):
            limits = httpx.Limits(max_connections=80)
            async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

                async def agent(i):
                    for n in range(REQUESTS_EACH):  # an agent loop, honouring Retry-After
                        case = CASES[(i + n) % len(CASES)]
                        body = {"prompt": case["prompt_ids"], "max_tokens": 40}
                        r = await client.post("/v1/completions", json=body)
                        statuses.append(r.status_code)
                        if r.status_code == 429:
                            retry_afters.append(r.headers.get("Retry-After"))
                            assert r.json()["error"]["code"] == "queue_full"
                            await trio.sleep(int(retry_afters[-1]))  # as a client should
                        else:
                            assert r.json()["choices"][0]["text"] == case["text"]

                # The probe runs in a process of its own: the figure is the server's,
                # not this process's event loop (and GIL), busy with 64 clients.
                prober = subprocess.Popen(  # noqa: ASYNC220
                    [sys.executable, "-c", PROBE, url],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                )
                try:
                    async with trio.open_nursery() as agents:
                        for i in range(64):
                            agents.start_soon(agent, i)
                finally:
                    out, _ = await trio.to_thread.run_sync(prober.communicate, b"stop\n")
                health.extend(json.loads(out))
                s = (await client.get("/stats")).json()
                metrics = (await client.get("/metrics")).text
    assert set(statuses) <= {200, 429} and len(statuses) == 64 * REQUESTS_EACH
    assert statuses.count(429) >= 1 and statuses.count(200) >= 16
    assert all(ra is not None and int(ra) >= 1 for ra in retry_afters)
    assert s["overloaded"] == statuses.count(429)
    assert f"mlx_nursery_requests_overloaded_total {statuses.count(429)}" in metrics
    health.sort()
    p99 = health[min(len(health) - 1, math.ceil(0.99 * len(health)) - 1)]
    print(f"\n/health under 64 clients: p99 {p99 * 1e3:.1f} ms over {len(health)} probes")
    assert p99 < 0.020


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
    assert engine.stats().overloaded == 1 and engine.stats().ledger_balanced


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
