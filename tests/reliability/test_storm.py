"""Clients that vanish, and ends that race: a disconnect storm over HTTP, and a
thousand cancel/finish races in the embedding API. Afterwards nothing is live, the
KV is back to its baseline, every stream that stayed is exact, and the ledger
balances (every request exactly one terminal event)."""

from __future__ import annotations

import json
import random

import httpx
import trio
import trio.lowlevel
from conftest import checked_engine, golden, running_server, sse_payloads

FAMILY = "llama"
CASES = golden(FAMILY)["serial"]
STORM = 500
DROP = 0.3
TOKENS = 16


async def test_a_disconnect_storm_leaves_nothing_live_and_every_other_stream_exact():
    rng = random.Random(7)
    plan = []  # (case index, chunks to read before dropping; None: read it all)
    for _ in range(STORM):
        drop = rng.random() < DROP
        plan.append((rng.randrange(len(CASES)), rng.choice([0, 0, 1, 3, 8]) if drop else None))
    texts, dropped = {}, 0
    with trio.fail_after(600):
        async with running_server(batch=8, max_queued_requests=STORM) as (url, _):
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
                expected = {}
                for i, case in enumerate(CASES):  # solo runs, one at a time
                    body = {"prompt": case["prompt_ids"], "max_tokens": TOKENS}
                    r = await client.post("/v1/completions", json=body)
                    expected[i] = r.json()["choices"][0]["text"]
                baseline = (await client.get("/stats")).json()["kv_bytes"]

                async def one(n, case_i, keep):
                    nonlocal dropped
                    body = {"prompt": CASES[case_i]["prompt_ids"], "max_tokens": TOKENS,
                            "stream": True}  # fmt: skip
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        text, chunks = [], 0
                        async for payload in sse_payloads(r):
                            if keep is not None and chunks >= keep:
                                dropped += 1
                                return  # the client goes away mid-stream
                            if payload.startswith("{"):
                                chunk = json.loads(payload)
                                text += [c["text"] for c in chunk["choices"]]
                                chunks += 1
                        texts[n] = (case_i, "".join(text))

                async with trio.open_nursery() as nursery:
                    for n, (case_i, keep) in enumerate(plan):
                        nursery.start_soon(one, n, case_i, keep)
                with trio.fail_after(1):  # KV back to baseline within 1 s of the last client
                    while True:
                        s = (await client.get("/stats")).json()
                        if not s["active_rows"] and s["kv_bytes"] == baseline:
                            break
                        await trio.sleep(0.01)
    assert dropped > 0.2 * STORM and len(texts) + dropped == STORM
    for n, (case_i, text) in texts.items():
        assert text == expected[case_i], f"request {n}"
    assert s["pending_rows"] == 0 and s["decoding_rows"] == 0
    print(f"\nstorm: {STORM} streams, {dropped} dropped, {s['cancelled']} cancelled")


async def test_a_thousand_cancel_and_finish_races_each_end_exactly_once():
    rng = random.Random(11)
    terminals = []

    async def one(i):
        case = CASES[i % len(CASES)]
        max_tokens = rng.randint(1, 6)
        cancel_after = rng.choice([None, 0, 1, 2, max_tokens - 1, max_tokens])
        stop = rng.choice([None, None, " ", "e"])
        params = {"max_tokens": max_tokens, **({"stop": stop} if stop else {})}
        seen, ends = 0, 0
        async with engine.submit(case["prompt_ids"], **params) as stream:
            if cancel_after == 0:
                stream.cancel("raced at once")
            async for event in stream:
                seen += 1
                if seen == cancel_after:
                    stream.cancel("raced")
                ends += event.terminal
        terminals.append(ends)

    # A lost terminal event hangs a stream: the bound makes it a failure. (Admission
    # once dispatched under its timer's cancel scope and, now and then, lost one.)
    with trio.fail_after(120):
        async with checked_engine(FAMILY, batch=8, max_queued_requests=1000) as engine:
            async with trio.open_nursery() as nursery:
                for i in range(1000):
                    nursery.start_soon(one, i)
                    if i % 16 == 15:
                        await trio.lowlevel.checkpoint()
            await engine.wait_idle()
            s = engine.stats()
    assert terminals == [1] * 1000
    assert s.submitted == 1000 and s.finished + s.cancelled + s.errored == 1000 and s.errored == 0
    assert s.active_rows == 0 and s.kv_bytes == 0
