"""The front end's promises that hold across APIs: the server's request defaults
apply to every API alike, a zero token cap is refused everywhere, tool call
arguments are strict JSON as the model wrote them, a call cut short is never
content, and the CLI's flags are the declared settings."""

from __future__ import annotations

import json
import random

import attrs
import httpx
import jsonschema
import pytest
import trio
from conftest import running_server
from test_structured import random_schema

ASK = [{"role": "user", "content": "Tell me about the sea."}]


def strict(text: str | bytes) -> object:
    """JSON as JavaScript's JSON.parse and serde read it: NaN and the infinities
    refused (a number too large for a float is still JSON, and reads as inf)."""

    def refuse(name: str) -> object:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def texts(api: str, body: dict) -> str:
    if api == "chat":
        return body["choices"][0]["message"]["content"]
    if api == "messages":
        return "".join(b.get("text", "") for b in body["content"])
    return "".join(p["text"] for item in body["output"] for p in item.get("content", ()))


REQUESTS = {
    "chat": ("/v1/chat/completions", {"messages": ASK, "max_tokens": 12}),
    "messages": ("/v1/messages", {"messages": ASK, "max_tokens": 12}),
    "responses": ("/v1/responses", {"input": ASK, "max_output_tokens": 12}),
}


async def test_the_servers_sampling_defaults_hold_on_every_api():
    """Under --temp 1.5 --top-k 1 every API is greedy: one text, nine times."""
    with trio.fail_after(120):
        async with running_server(temperature=1.5, top_k=1) as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                seen = set()
                for api, (path, body) in REQUESTS.items():
                    for _ in range(3):
                        r = await http.post(path, json={"model": "llama", **body})
                        assert r.status_code == 200, r.text
                        seen.add(texts(api, r.json()))
    assert len(seen) == 1, seen


ZERO = [
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": ASK, "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/messages", {"messages": ASK, "max_tokens": 0}, None),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
]  # fmt: skip


async def test_a_zero_token_cap_is_a_400_on_every_api():
    with trio.fail_after(60):
        async with running_server() as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                for path, body, param in ZERO:
                    r = await http.post(path, json=body)
                    assert r.status_code == 400, (path, r.text)
                    error = r.json()["error"]
                    assert "max_tokens" in error["message"] or "at least 1" in error["message"]
                    if param is not None:
                        assert error["param"] == param, (path, error)


def test_star_imports_work():
    namespace: dict = {}
    exec("from mlx_nursery.actors import *", namespace)
    assert "RowView" in namespace and "open_engine" in namespace


def number_schema(rng: random.Random) -> dict:
    """random_schema plus an unbounded number: the model may write any exponent."""
    schema = random_schema(rng)
    schema["properties"]["num"] = {"type": "number"}
    schema["required"] = sorted(schema["properties"])
    return schema


async def test_tool_arguments_are_strict_json_as_the_model_wrote_them():
    """Twenty seeded schemas at temperature 1 on a noise model, required calls on
    chat completions and Anthropic Messages: every body parses as strict JSON, and
    the arguments validate against their schema."""
    rng = random.Random(2026)
    with trio.fail_after(400):
        async with running_server() as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                called = 0
                for i in range(20):
                    schema = number_schema(rng)
                    fn = {"name": f"tool_{i}", "parameters": schema}
                    r = await http.post("/v1/chat/completions", json={
                        "messages": ASK, "tools": [{"type": "function", "function": fn}],
                        "tool_choice": "required", "max_tokens": 300, "temperature": 1.0,
                        "seed": i,
                    })  # fmt: skip
                    assert r.status_code == 200, r.text
                    (choice,) = strict(r.content)["choices"]
                    assert choice["finish_reason"] == "tool_calls", choice
                    for call in choice["message"]["tool_calls"]:
                        jsonschema.validate(strict(call["function"]["arguments"]), schema)
                    tool = {"name": f"tool_{i}", "input_schema": schema}
                    r = await http.post("/v1/messages", json={
                        "messages": ASK, "tools": [tool], "tool_choice": {"type": "any"},
                        "max_tokens": 1000, "temperature": 1.0,
                    })  # fmt: skip
                    assert r.status_code == 200, r.text
                    body = strict(r.content)
                    if body["stop_reason"] == "max_tokens":
                        # Messages has no seed: a noise model may write a number of a
                        # thousand digits. A cut call is never content, and never a call.
                        assert body["content"] == [], body
                        continue
                    assert body["stop_reason"] == "tool_use", body
                    blocks = [b for b in body["content"] if b["type"] == "tool_use"]
                    assert blocks
                    for block in blocks:
                        jsonschema.validate(block["input"], schema)
                    called += 1
                assert called >= 15, called


async def test_a_call_cut_by_max_tokens_is_never_content():
    weather = {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    tool = {"type": "function", "function": weather}
    with trio.fail_after(60):
        async with running_server() as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                r = await http.post("/v1/chat/completions", json={
                    "messages": ASK, "tools": [tool], "tool_choice": "required",
                    "max_tokens": 4})  # fmt: skip
                (choice,) = r.json()["choices"]
                assert choice["finish_reason"] == "length"
                assert not choice["message"]["content"] and "tool_calls" not in choice["message"]
                r = await http.post("/v1/responses", json={
                    "input": ASK, "tools": [{"type": "function", **weather}],
                    "tool_choice": "required", "max_output_tokens": 4})  # fmt: skip
                body = r.json()
                assert body["status"] == "incomplete" and body["output"] == []


def test_the_clis_flags_are_the_declared_settings():
    from mlx_nursery.server.cli import build_parser, settings_from
    from mlx_nursery.server.settings import Settings

    declared = Settings(model="m")
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert attrs.evolve(settings_from(args), own_process=False) == declared
    args = build_parser().parse_args(
        ["serve", "--model", "m", "--temp", "0.7", "--top-k", "5", "--max-tokens", "64",
         "--prompt-cache-bytes", "1G", "--allowed-origins", "http://a, http://b"]
    )  # fmt: skip
    got = settings_from(args)
    assert (got.engine.temperature, got.engine.top_k, got.engine.max_tokens) == (0.7, 5, 64)
    assert got.engine.prompt_cache_bytes == 1 << 30
    assert got.allowed_origins == ("http://a", "http://b")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--prompt-cache-bytes", "lots"])


async def test_context_errors_are_worded_as_each_api_words_them():
    """Clients parse these to recover (Claude Code retries with a smaller
    max_tokens on Anthropic's): the exact upstream wording, with the numbers."""
    long = [{"role": "user", "content": "x " * 3000}]
    with trio.fail_after(60):
        async with running_server() as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                r = await http.post("/v1/messages", json={"messages": ASK, "max_tokens": 5000})
                n = int(r.json()["error"]["message"].split(": ")[1].split(" + ")[0])
                assert r.status_code == 400 and r.json() == {"type": "error", "error": {
                    "type": "invalid_request_error",
                    "message": f"input length and `max_tokens` exceed context limit: {n} + "
                               "5000 > 4096, decrease input length or `max_tokens` and try "
                               "again"}}  # fmt: skip
                r = await http.post("/v1/messages", json={"messages": long, "max_tokens": 5})
                message = r.json()["error"]["message"]
                assert r.status_code == 400 and message.startswith("prompt is too long: ")
                assert message.endswith(" tokens > 4096 maximum")
                r = await http.post("/v1/chat/completions", json={"messages": ASK,
                                                                  "max_tokens": 5000})
                error = r.json()["error"]
                assert r.status_code == 400 and error["code"] == "context_length_exceeded"
                assert error["message"].startswith(
                    f"This model's maximum context length is 4096 tokens. However, you "
                    f"requested {n + 5000} tokens ({n} in the messages, 5000 in the "
                    "completion). Please reduce the length of the messages or completion."
                )
                r = await http.post("/v1/responses", json={"input": ASK,
                                                           "max_output_tokens": 5000})
                error = r.json()["error"]
                assert error["code"] == "context_length_exceeded"
                assert error["message"].startswith("Your input exceeds the context window")


async def test_refusals_are_counted_by_api_and_reason():
    with trio.fail_after(60):
        async with running_server() as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                r = await http.post("/v1/messages", json={"messages": ASK, "max_tokens": 4,
                                                          "no_such_field": 1})  # fmt: skip
                assert r.status_code == 400 and "no_such_field" in r.text
                r = await http.post("/v1/responses", json={"input": "hi",
                                                           "previous_response_id": "r"})
                assert r.status_code == 400
                stats = (await http.get("/stats")).json()
                metrics = (await http.get("/metrics")).text
    counted = {(f["api"], f["status"], f["reason"]): f["count"] for f in stats["refusals"]}
    assert counted == {("messages", 400, "invalid_request_error"): 1,
                       ("responses", 400, "invalid_request_error"): 1}  # fmt: skip
    refused = [r for r in stats["recent_requests"] if r["finish_reason"] == "refused"]
    assert [r["api"] for r in refused] == ["messages", "responses"]
    assert ('mlx_nursery_http_refusals_total{api="messages",reason="invalid_request_error",'
            'status="400"} 1.0') in metrics
