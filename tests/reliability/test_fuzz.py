"""2,000 seeded malformed bodies across every route: each answer is a 4xx in the
API's error shape, the same server process stays up, and a golden request after
them is exact. Boundaries of every limit are honoured or refused, never ignored."""

from __future__ import annotations

import json
import random

import httpx
import pytest
import trio
from conftest import golden, running_server

CASES = {c["prompt"]: c for c in golden("llama")["serial"]}
BODIES = 2000
SEED = 20261130
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"prompt": "hi", "max_tokens": 4}

# Values no field accepts where they are put, by field.
WRONG = {
    "max_tokens": ["x", [], {}, True, 1.5, -3, 0, 10**30, "NoneType"],
    "temperature": ["hot", [], True, -1, float("nan"), float("inf"), -1e-9],
    "top_p": ["x", 0, 1.5, 1e30, float("nan"), False],
    "top_k": ["x", -1, 1.5, True, [5]],
    "min_p": [-0.1, 2, float("nan"), "x"],
    "presence_penalty": [3, -3, 1e30, float("nan"), "x"],
    "frequency_penalty": [3, -3, float("-inf"), {}, "x"],
    "repetition_penalty": [0, -1, float("nan"), "x"],
    "seed": ["x", 1.5, -1, 2**70, True],
    "stop": [5, [1], [""], "", {"a": 1}, [["x"]]],
    "logit_bias": [[], "x", {"abc": 1}, {"5": "x"}, {"5": 1e9}, {"999999": 1}, {"-1": 1}],
    "stream": ["yes", 1, [], {}],
    "n": [17, 0, "1", 10**30, True],
    "model": [5, [], {}, "gpt-17"],
    "stream_options": ["x", 5, {"include_usage": "yes"}],
    "tools": [
        [{"type": "retrieval"}],
        "x",
        [{"type": "function"}],
        [{"type": "function", "function": {"name": "f", "parameters": 5}}],
    ],
    "tool_choice": ["required", {"type": "function", "function": {"name": "f"}}],
    "response_format": ["json", {"type": "yaml"}, {"type": "json_schema"}, [1]],
}
WRONG_CHAT = {
    "messages": ["hi", [], [5], [{"role": 5, "content": "x"}], [{"content": "x"}],
                 [{"role": "user", "content": 5}],
                 [{"role": "user", "content": [{"type": "image"}]}],
                 [{"role": "user", "content": {"a": 1}}]],
    "logprobs": ["yes", 2],
    "top_logprobs": [21, -1, "x"],
}  # fmt: skip
WRONG_COMPLETION = {
    "prompt": [5, {}, [1.5], [True], [-1], [10**9], "", [], [[1, 2], [3]], [{"role": "user"}]],
    "logprobs": [21, -1, "x", True],
    "echo": [True],
    "best_of": [3],
    "suffix": ["tail"],
}


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def malformed(rng: random.Random) -> tuple[str, bytes]:
    """One (route, raw body) that no server may accept."""
    chat = rng.random() < 0.5
    route = "/v1/chat/completions" if chat else "/v1/completions"
    base = dict(CHAT if chat else COMPLETION)
    kind = rng.choice(["field", "field", "field", "unknown", "utf8", "truncated", "nesting",
                       "not_object", "stream"])  # fmt: skip
    if kind in ("field", "stream"):
        pool = {**WRONG, **(WRONG_CHAT if chat else WRONG_COMPLETION)}
        name = rng.choice(sorted(pool))
        base[name] = rng.choice(pool[name])
        if kind == "stream" and name != "stream":
            base["stream"] = True
        return route, json.dumps(base).encode()
    if kind == "unknown":
        base[f"zz_{rng.randrange(10**6)}"] = rng.choice([1, "x", None, [1]])
        return route, json.dumps(base).encode()
    if kind == "utf8":
        return route, b'{"prompt": "\xff\xfe\xc3", "max_tokens": 4}'
    if kind == "truncated":
        raw = json.dumps(base).encode()
        return route, raw[: rng.randrange(1, len(raw) - 1)]
    if kind == "nesting":
        depth = rng.choice([50, 5000, 100_000])
        return route, f'{{"prompt": {nested(depth)}, "max_tokens": 4}}'.encode()
    return route, rng.choice([b"[1, 2]", b'"text"', b"5", b"null", b"", b"NaN"])


async def test_two_thousand_malformed_bodies_are_each_refused_and_the_server_stays_exact():
    rng = random.Random(SEED)
    bodies = [malformed(rng) for _ in range(BODIES)]
    statuses = []
    with trio.fail_after(300):
        async with running_server() as (url, state):
            engine = state.engine
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                for route, raw in bodies:
                    headers = {"content-type": "application/json"}
                    r = await client.post(route, content=raw, headers=headers)
                    assert 400 <= r.status_code < 500, (route, raw[:120], r.status_code, r.text)
                    err = r.json()["error"]
                    assert set(err) == {"message", "type", "param", "code"} and err["message"]
                    statuses.append(r.status_code)
                for method, path in (("POST", "/v1/models"), ("POST", "/health"),
                                     ("GET", "/v1/completions"), ("PUT", "/stats"),
                                     ("POST", "/v1/nothing-here")):  # fmt: skip
                    r = await client.request(method, path, content=b"{}")
                    assert r.status_code in (404, 405) and "error" in r.json()
                assert state.engine is engine and (await client.get("/health")).status_code == 200
                case = CASES["sentence"]
                body = {"prompt": case["prompt_ids"], "max_tokens": 40}
                r = await client.post("/v1/completions", json=body)
                assert r.json()["choices"][0]["text"] == case["text"]
                s = (await client.get("/stats")).json()
    assert s["submitted"] == 1 and s["errored"] == 0  # nothing malformed reached a lane
    print(f"\nfuzz: {len(statuses)} bodies, statuses {sorted(set(statuses))}")


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": 1}, 200, None),
        ({"stop": ""}, 400, "stop"),
        ({"stop": [" "]}, 200, None),
        ({"n": 17}, 400, "n"),
        ({"n": 1}, 200, None),
        ({"n": 2}, 200, None),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 200, None),
        ({"tools": [{"type": "code_interpreter"}]}, 400, "tools"),
        ({"tool_choice": "required"}, 400, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, 200, None),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, 400, "response_format"),
        ({"user": "agent-7", "metadata": {"run": "a"}}, 200, None),
    ],
)
async def test_boundaries_are_honoured_or_refused_by_name(body, status, param):
    with trio.fail_after(60):
        async with running_server() as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                full = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **body}
                r = await client.post("/v1/chat/completions", json=full)
    assert r.status_code == status, r.text
    if status != 200:
        assert r.json()["error"]["param"] == param
        return
    choice = r.json()["choices"][0]
    if body.get("max_tokens") == 1:
        assert r.json()["usage"]["completion_tokens"] == 1
    if "stop" in body:
        assert " " not in choice["message"]["content"]
    if "response_format" in body and choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)


async def test_the_context_is_usable_to_its_last_token_and_not_one_more():
    context = 4096  # the golden llama's
    with trio.fail_after(120):
        async with running_server() as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:

                async def post(prompt_len, max_tokens):
                    body = {"prompt": [7] * prompt_len, "max_tokens": max_tokens}
                    return await client.post("/v1/completions", json=body)

                r = await post(context - 1, 1)  # the prompt at context - 1: one token left
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 1
                r = await post(context - 40, 40)  # the context's remainder exactly
                assert r.status_code == 200
                r = await post(context, 1)
                assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
                r = await post(context - 40, 41)
                assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
