"""Agent sessions: slots shared between sessions, one cancel for a session's
tree, the live sessions listed (``docs/sessions.md``)."""

from __future__ import annotations

import functools
import json

import httpx
import pytest
import trio
from conftest import checked_engine, running_server, sse_payloads
from flood import FloodReport, FloodSpec, run_flood
from mlx_nursery.actors import FinishReason

EOS = 258  # the golden tokenizer's end token: suppressed, so rows run to max_tokens
NO_END = {EOS: -100.0}


async def test_a_waiting_session_gets_the_next_free_slot_before_anothers_backlog():
    """Session A fans out six requests over two slots; B's one request, sent after
    all of them, is admitted when the first slot frees, ahead of A's last four."""
    results = {}
    async with checked_engine("llama", batch=2) as engine:

        async def run(name, session, prompt):
            results[name] = await engine.generate(
                prompt, session=session, max_tokens=200, logit_bias=NO_END
            )

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(run, f"a{i}", "A", [5 + i] * 40)
                await trio.sleep(0.01)
            # all six queued (counted at enqueue: a row that already ended counts too)
            await engine.stats_actor.wait_for(lambda s: s.submitted >= 6)
            nursery.start_soon(run, "b", "B", [70] * 40)
    waits = {name: r.usage.queue_wait for name, r in results.items()}
    assert results["b"].usage.session == "B" and results["a0"].usage.session == "A"
    assert all(r.finish_reason is FinishReason.LENGTH for r in results.values())
    assert waits["b"] < min(waits[f"a{i}"] for i in range(2, 6)), waits


async def test_cancelling_a_session_ends_its_tree_and_nothing_else():
    """Eight rows of a session (two of them mid-prefill, six queued), a sub-agent
    session under it, and another session: one cancel ends the first two, each
    row with its terminal event; the other session runs on."""
    ended = {}
    async with checked_engine("llama", batch=4, prefill_step_size=16) as engine:

        async def run(name, prompt, session, parent=None):
            ended[name] = await engine.generate(
                prompt, max_tokens=2500, logit_bias=NO_END, session=session, parent=parent
            )

        async with trio.open_nursery() as nursery:
            rows = [("long0", [40] * 1500, "main"), ("long1", [41] * 1500, "main"),
                    ("sub", [60] * 24, "sub", "main"), ("other", [61] * 24, "other"),
                    *((f"main{i}", [5 + i] * 24, "main") for i in range(6))]  # fmt: skip
            for i, spec in enumerate(rows):  # in this order: admission sees them so
                nursery.start_soon(run, *spec)
                while len(engine.live()) <= i:  # noqa: ASYNC110
                    await trio.sleep(0.001)
            phases = [(r.session, r.phase) for r in engine.live()]
            assert phases.count(("main", "prefilling")) == 2, phases
            assert phases.count(("main", "queued")) == 6, phases
            listed = {s.id: s for s in engine.sessions()}
            assert len(listed["main"].rows) == 8 and listed["sub"].parent == "main"
            assert engine.cancel_session("main") == 9
            with trio.fail_after(10):
                while len(ended) < 9:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            assert "other" not in ended  # still running
            assert engine.cancel_session("other") == 1
            assert engine.cancel_session("nobody") == 0
    for name, result in ended.items():
        assert result.finish_reason is FinishReason.CANCELLED, name
    assert len(ended) == 10


async def test_the_sessions_endpoints_list_and_cancel_a_claude_code_session():
    headers = {"X-Claude-Code-Session-Id": "cc-1"}
    body = {"model": "llama", "prompt": "Agent, report:", "max_tokens": 2000, "stream": True,
            "logit_bias": {str(EOS): -100}}  # fmt: skip
    async with running_server(batch=4) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            streams = []

            async def agent(i):
                sub = {**headers, "X-Parent-Session-Id": "cc-1",
                       "X-Session-Id": f"cc-1-sub{i}"} if i else headers  # fmt: skip
                events = []
                async with client.stream("POST", "/v1/completions", json=body,
                                         headers=sub) as r:  # fmt: skip
                    assert r.status_code == 200
                    async for payload in sse_payloads(r):
                        events.append(payload)
                streams.append(events)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(agent, i)
                with trio.fail_after(30):
                    while True:
                        listed = (await client.get("/v1/sessions")).json()["data"]
                        if len(listed) == 3 and all(s["running"] for s in listed):
                            break
                        await trio.sleep(0.02)
                by_id = {s["id"]: s for s in listed}
                assert by_id["cc-1-sub1"]["parent"] == "cc-1"
                assert by_id["cc-1"]["rows"][0]["request_id"]
                gone = await client.delete("/v1/sessions/cc-1")
                assert gone.status_code == 200, gone.text
                assert gone.json() == {"id": "cc-1", "object": "session.cancelled",
                                       "cancelled": 3}  # fmt: skip
            missing = await client.delete("/v1/sessions/cc-1")
            assert missing.status_code == 404
            assert missing.json()["error"]["code"] == "session_not_found"
            assert (await client.get("/v1/sessions")).json()["data"] == []
            one = {"model": "llama", "prompt": "Hi", "max_tokens": 2}
            done = await client.post("/v1/completions", json=one, headers=headers)
            assert done.json()["usage"]["session"] == "cc-1"  # the extension field
    for events in streams:
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert "cancelled" in json.dumps(last), last


async def churn_then_return(session: str | None) -> tuple[int, int]:
    """B asks once, A churns ten entries through a three-entry cache, B's next
    turn extends its history: how much of that history came from the cache."""
    history = [90] * 60
    async with checked_engine("llama", prompt_cache_size=3, prompt_cache_disk=0) as engine:
        first = await engine.generate(history, session=session, max_tokens=8,
                                      logit_bias=NO_END)  # fmt: skip
        for i in range(10):
            await engine.generate([20 + i] * 40, session="A", max_tokens=8, logit_bias=NO_END)
        turn = history + first.tokens + [91] * 10
        second = await engine.generate(turn, session=session, max_tokens=2)
        return second.usage.cached_tokens, len(history) + len(first.tokens)


async def test_an_active_sessions_history_stays_cached_through_anothers_churn():
    cached, history = await churn_then_return("B")
    assert cached >= history - 1  # all of it (the last token may be fed again)
    cached, _ = await churn_then_return(None)  # the same without a session
    assert cached == 0


async def paused_and_resumed(family: str, **options) -> tuple[dict, dict, object]:
    """Session A decodes two rows in both slots; B arrives and waits past
    ``pause_after``: one of A's rows is paused for it, then resumes. Returns A's
    results, the same prompts run alone, and the stats."""
    prompts = {"a0": [7, 8, 9] * 12, "a1": [30, 31] * 20}
    extra = {"a0": {"repetition_penalty": 1.3}, "a1": {"logprobs": True, "top_logprobs": 2}}
    results = {}
    async with checked_engine(family, batch=2, pause_after=0.05, **options) as engine:
        alone = {n: await engine.generate(p, max_tokens=60, logit_bias=NO_END, **extra[n])
                 for n, p in prompts.items()}  # fmt: skip

        async def run(name, session, prompt, **kw):
            results[name] = await engine.generate(prompt, session=session, logit_bias=NO_END,
                                                  **kw)  # fmt: skip

        async with trio.open_nursery() as nursery:
            for name, prompt in prompts.items():
                nursery.start_soon(functools.partial(
                    run, name, "A", prompt, max_tokens=60, **extra[name]))  # fmt: skip
            with trio.fail_after(30):
                while sum(r.phase == "decoding" for r in engine.live()) < 2:  # noqa: ASYNC110
                    await trio.sleep(0.001)
            nursery.start_soon(functools.partial(run, "b", "B", [50] * 20, max_tokens=4))
        stats = engine.stats()
    return results, alone, stats


@pytest.mark.parametrize(
    ("family", "options"),
    [("llama", {}), ("gemma3_text", {}), ("falcon_h1", {}), ("llama_h64", {"kv_bits": 4})],
    ids=["llama", "gemma3_text", "falcon_h1", "llama_h64-kv4"],
)
async def test_a_row_paused_for_another_session_resumes_token_exact(family, options):
    """(Quantized KV too: the paused row's bits leave the batch and come back.)"""
    results, alone, stats = await paused_and_resumed(family, **options)
    assert stats.paused >= 1 and stats.resumed == stats.paused, stats
    for name in ("a0", "a1"):
        assert results[name].tokens == alone[name].tokens, name
        assert results[name].finish_reason is FinishReason.LENGTH
    assert results["a1"].logprobs == pytest.approx(alone["a1"].logprobs, abs=1e-4)
    assert results["b"].usage.queue_wait < 5


async def test_a_paused_row_cancelled_ends_and_frees_its_kv():
    ended = {}
    async with checked_engine("llama", batch=2, pause_after=0.05) as engine:

        async def run(name, session, prompt, max_tokens):
            ended[name] = await engine.generate(prompt, session=session, logit_bias=NO_END,
                                                max_tokens=max_tokens)  # fmt: skip

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "a0", "A", [7] * 30, 3000)
            nursery.start_soon(run, "a1", "A", [8] * 30, 3000)
            with trio.fail_after(30):
                while sum(r.phase == "decoding" for r in engine.live()) < 2:  # noqa: ASYNC110
                    await trio.sleep(0.001)
            nursery.start_soon(run, "b", "B", [50] * 20, 3000)
            with trio.fail_after(30):
                await engine.stats_actor.wait_for(lambda s: s.paused_rows == 1)
            (paused,) = [r for r in engine.live() if r.phase == "paused"]
            assert paused.session == "A" and paused.tokens > 0
            listed = {s.id: s for s in engine.sessions()}
            assert listed["A"].paused == 1 and listed["A"].running == 1
            assert engine.stats().kv_bytes > 0
            assert engine.cancel_session("A") == 2
            with trio.fail_after(10):
                while len(ended) < 2:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            assert engine.stats().paused_rows == 0
            assert engine.cancel_session("B") == 1
    assert {n: r.finish_reason for n, r in ended.items()} == dict.fromkeys(
        ("a0", "a1", "b"), FinishReason.CANCELLED
    )


async def flood_over_http(sessions: bool) -> FloodReport:
    """Issue #25's flood on the golden model, small: A's six sub-agents over two
    slots against B's three turns, under a 1 MB prompt-cache cap (B's history is
    about 0.4 MB, A's entries 0.1-0.2 MB each), over /v1/messages."""
    async with running_server(batch=2, prompt_cache_bytes=1 << 20, prompt_cache_disk=0,
                              pause_after=0.1) as (url, _):  # fmt: skip
        spec = FloodSpec(url, agents=6, turns=3, history_words=120, agent_system_words=20,
                         task_words=20, agent_tokens=40, turn_tokens=8, gap=0.3,
                         before=0.5, warmup_requests=6, sessions=sessions)  # fmt: skip
        with trio.fail_after(120):
            return await run_flood(spec)


async def test_a_main_agents_history_stays_cached_through_a_sub_agent_flood_over_http():
    """With Claude Code's session header, B's later turns find their history in
    the cache that A's churn runs through; without sessions A's churn evicts it."""
    report = await flood_over_http(sessions=True)
    assert report.errors == () and report.agent_requests >= 6
    assert len(report.turn_seconds) == 3 and len(report.history_cached) == 3
    assert min(report.history_cached) >= 0.9, report
    assert all(r > 0 for r in (report.agent_before, report.agent_in_turns, report.agent_between))
    fifo = await flood_over_http(sessions=False)
    assert fifo.errors == ()
    assert max(fifo.history_cached) < 0.5, fifo


async def test_a_session_weight_header_is_checked_and_listed():
    body = {"model": "llama", "prompt": "Hi", "max_tokens": 2000, "stream": True,
            "logit_bias": {str(EOS): -100}}  # fmt: skip
    async with running_server(batch=2) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            bad = await client.post("/v1/completions", json={**body, "stream": False},
                                    headers={"X-Session-Weight": "0"})  # fmt: skip
            assert bad.status_code == 400
            assert "session_weight" in bad.json()["error"]["message"]
            assert bad.json()["error"]["param"] == "X-Session-Weight"
            headers = {"X-Session-Id": "heavy", "X-Session-Weight": "2.5"}
            async with client.stream("POST", "/v1/completions", json=body,
                                     headers=headers) as r:  # fmt: skip
                assert r.status_code == 200
                listed = (await client.get("/v1/sessions")).json()["data"]
                assert [(s["id"], s["weight"]) for s in listed] == [("heavy", 2.5)]
                assert (await client.delete("/v1/sessions/heavy")).status_code == 200
                async for _ in r.aiter_lines():
                    pass


async def test_a_background_row_under_a_long_interactive_load_finishes_within_its_bound():
    """Two slots kept full by four interactive loops: a background row waits
    behind them, but ``priority_aging`` seconds of waiting lift it a class, so it
    is admitted at the first slot that frees after twice that (the bound in
    docs/sessions.md); with aging off it waits for the load to end."""

    async def waited(aging: float | None) -> tuple[float, float]:
        """The background row's queue wait and its time to its end."""
        async with checked_engine("llama", batch=2, priority_aging=aging) as engine:
            end = trio.current_time() + 4.0  # the interactive load: four seconds

            async def interactive(i: int) -> None:
                while trio.current_time() < end:
                    await engine.generate([5 + i] * 20, max_tokens=12, logit_bias=NO_END)

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(interactive, i)
                await engine.stats_actor.wait_for(lambda s: s.pending_rows >= 2)
                start = trio.current_time()
                low = await engine.generate([90] * 20, max_tokens=4, logit_bias=NO_END,
                                            priority="background")  # fmt: skip
                took = trio.current_time() - start
            assert low.usage.priority == "background"
            return low.usage.queue_wait, took

    wait, _ = await waited(0.25)
    assert wait < 2 * 0.25 + 1.0, wait  # its bound: twice the aging, then the next free slot
    _, starved = await waited(None)
    assert starved >= 3.0, starved  # no aging: behind every interactive row to the end


async def subagent_flood(priorities: bool) -> tuple[FloodReport, dict]:
    """The main agent's three turns while six of its own sub-agents flood two
    slots, all in one Claude Code session, over /v1/messages (the sub-agents'
    attribution line says ``cc_is_subagent=true;``)."""
    async with running_server(batch=2, prompt_cache_bytes=1 << 20, prompt_cache_disk=0,
                              priorities=priorities) as (url, _):  # fmt: skip
        spec = FloodSpec(url, agents=6, turns=3, history_words=120, agent_system_words=20,
                         task_words=20, agent_tokens=40, turn_tokens=8, gap=0.3,
                         before=0.5, warmup_requests=6, subagents=True)  # fmt: skip
        with trio.fail_after(120):
            report = await run_flood(spec)
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            stats = (await client.get("/stats")).json()
            metrics = (await client.get("/metrics")).text
    return report, {**stats, "metrics": metrics}


async def test_a_main_agent_goes_ahead_of_its_own_sub_agents_over_http():
    """Claude Code's traffic shape: the main agent's turns (interactive) pause a
    sub-agent at once and are admitted ahead of the queued sub-agents; its
    history stays cached; the classes' figures are in /stats and /metrics, and
    each request's class in the recent requests. With --priorities off the main
    agent's turns queue behind the sub-agents, first come first served."""
    report, stats = await subagent_flood(priorities=True)
    assert report.errors == () and len(report.turn_seconds) == 3, report
    assert min(report.history_cached) >= 0.9, report
    classes = stats["classes"]
    assert classes["interactive"]["tokens"] > 0 and classes["subagent"]["tokens"] > 0
    assert report.paused >= 1 and stats["paused"] >= 1
    recent = stats["recent_requests"]
    main = [r for r in recent if r.get("priority") == "interactive"]
    subs = [r for r in recent if r.get("priority") == "subagent"]
    assert main and subs, recent
    slowest_main = max(r["queue_wait_seconds"] for r in main)
    typical_sub = sorted(r["queue_wait_seconds"] for r in subs)[len(subs) // 2]
    assert slowest_main < typical_sub, (slowest_main, typical_sub)
    assert 'mlx_nursery_class_generated_tokens_total{class="subagent"}' in stats["metrics"]
    assert 'mlx_nursery_class_queued{class="interactive"}' in stats["metrics"]
    fcfs, plain = await subagent_flood(priorities=False)
    assert fcfs.errors == () and fcfs.paused == 0
    assert {r.get("priority") for r in plain["recent_requests"] if "priority" in r} == {
        "interactive"
    }


async def test_a_priority_is_checked_on_the_body_and_the_header():
    body = {"model": "llama", "prompt": "Hi", "max_tokens": 4}
    async with running_server(batch=2) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            bad = await client.post("/v1/completions", json={**body, "priority": "urgent"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
            assert "interactive, subagent or background" in bad.json()["error"]["message"]
            bad = await client.post("/v1/completions", json=body, headers={"X-Priority": "9999"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Priority"
            ok = await client.post("/v1/completions", json={**body, "priority": 2})
            assert ok.status_code == 200
            ok = await client.post("/v1/completions", json=body,
                                   headers={"X-Priority": "subagent"})  # fmt: skip
            assert ok.status_code == 200
            recent = (await client.get("/stats")).json()["recent_requests"]
            assert [r["priority"] for r in recent[-2:]] == ["background", "subagent"]
