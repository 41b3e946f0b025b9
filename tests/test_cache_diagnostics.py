"""Why a prompt missed the cache: each response says how many prompt tokens came
from the prompt cache, and when fewer than a cached prompt could have given,
where this one diverged (token position, chat message) and why."""

from __future__ import annotations

import json

import httpx
import trio
from conftest import loaded, running_server, sse_events

TIMEOUT = 120

SYSTEM = "You are agent seven. Follow the build plan, step by step, and report in one line."
USER = "Step one: list the modules."


def chat(system: str, user: str = USER) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def first_difference(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


async def test_a_changed_character_names_the_position_and_message_and_the_same_prompt_reuses_all(
    tmp_path,
):
    _, tokenizer = loaded("llama")
    changed = SYSTEM.replace("seven", "seveN")
    ids = [tokenizer.apply_chat_template(chat(s), add_generation_prompt=True)
           for s in (SYSTEM, changed)]  # fmt: skip
    log = tmp_path / "requests.jsonl"
    with trio.fail_after(TIMEOUT):
        async with (
            running_server(request_log=log) as (url, _),
            httpx.AsyncClient(base_url=url, timeout=60) as client,
        ):

            async def ask(messages, request_id, stream=False):
                body = {"model": "llama", "messages": messages, "max_tokens": 4}
                if stream:
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                headers = {"X-Request-Id": request_id}
                if not stream:
                    r = await client.post("/v1/chat/completions", json=body, headers=headers)
                    assert r.status_code == 200, r.text
                    return r.json()["usage"]
                async with client.stream(
                    "POST", "/v1/chat/completions", json=body, headers=headers
                ) as r:
                    events = await sse_events(r)
                return next(e["usage"] for e in events if e.get("usage"))

            first = await ask(chat(SYSTEM), "agent-a-1")
            assert first["prompt_cache"]["reason"] == "no_entry"
            assert first["prompt_cache"]["diverged_at"] == 0

            again = await ask(chat(SYSTEM), "agent-a-2", stream=True)
            assert again["prompt_cache"]["reason"] == "full"
            assert again["prompt_cache"]["diverged_at"] is None
            assert again["prompt_cache"]["tier"] == "memory"
            assert again["prompt_tokens_details"]["cached_tokens"] == len(ids[0]) - 1

            other = await ask(chat(changed), "agent-b-1")
            where = first_difference(ids[0], ids[1])
            assert other["prompt_cache"] == {
                "reason": "diverged",
                "cached_tokens": where,
                "shared_tokens": where,
                "diverged_at": where,
                "diverged_message": 0,  # the system message
                "tier": "memory",
            }
            assert other["prompt_tokens_details"]["cached_tokens"] == where

            stats = (await client.get("/stats")).json()
            recent = {r["request_id"]: r for r in stats["recent_requests"]}
            assert recent["agent-b-1"]["prompt_cache"]["diverged_message"] == 0
            assert recent["agent-a-2"]["prompt_cache"]["reason"] == "full"

    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["request_id"] for r in lines] == ["agent-a-1", "agent-a-2", "agent-b-1"]
    assert lines[2]["prompt_cache"]["diverged_at"] == where
    text = log.read_text()
    assert "agent seven" not in text and "modules" not in text, "no prompt text in the log"


async def test_a_later_message_that_differs_is_named():
    _, tokenizer = loaded("llama")
    history = [*chat(SYSTEM), {"role": "assistant", "content": "core, io, net."}]
    turn_a = [*history, {"role": "user", "content": "Step two: test io."}]
    turn_b = [*history, {"role": "user", "content": "Step two: test net."}]
    with trio.fail_after(TIMEOUT):
        async with (
            running_server() as (url, _),
            httpx.AsyncClient(base_url=url, timeout=60) as client,
        ):
            for messages in (turn_a, turn_b):
                body = {"model": "llama", "messages": messages, "max_tokens": 2}
                r = await client.post("/v1/chat/completions", json=body)
            report = r.json()["usage"]["prompt_cache"]
    a = tokenizer.apply_chat_template(turn_a, add_generation_prompt=True)
    b = tokenizer.apply_chat_template(turn_b, add_generation_prompt=True)
    assert report["reason"] == "diverged"
    assert report["diverged_at"] == first_difference(a, b)
    assert report["diverged_message"] == 3
