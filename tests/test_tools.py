"""Tool calls in the generic format, through the official openai SDK: a full round
trip, streamed deltas that rebuild the non-streamed call, and on a random-weight
model (whose free text is noise) required calls whose arguments always validate."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import openai
import trio
from conftest import checked_engine, running_server
from test_structured import random_schema

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                       "maxLength": 8}}, "required": ["city"], "additionalProperties": False},
    },
}  # fmt: skip
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}},
}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def streamed_calls(chunks) -> list[dict]:
    """Rebuild tool calls from OpenAI stream deltas, as a client does."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


async def test_a_tool_round_trip_streamed_and_not():
    with trio.fail_after(120):
        async with running_server() as (url, _):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
            args = {"model": "llama", "messages": ASK, "tools": [WEATHER, CLOCK],
                    "tool_choice": "required", "max_tokens": 200}  # fmt: skip
            reply = await client.chat.completions.create(**args)
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            (call,) = choice.message.tool_calls
            assert call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
            stream = await client.chat.completions.create(**args, stream=True)
            chunks = [c async for c in stream]
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            assert all("<tool_call>" not in (c.choices[0].delta.content or "") for c in chunks)
            (again,) = streamed_calls(chunks)
            assert (again["name"], again["arguments"]) == (
                call.function.name,
                call.function.arguments,
            )
            called = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
            result = {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}
            follow = [*ASK, called, result]
            final = await client.chat.completions.create(
                model="llama", messages=follow, tools=[WEATHER], tool_choice="none", max_tokens=16
            )
            assert final.choices[0].message.tool_calls is None
            assert final.choices[0].finish_reason in ("stop", "length")
            await client.close()


async def test_required_calls_on_a_noise_model_always_match_twenty_seeded_schemas():
    rng = random.Random(4321)
    with trio.fail_after(300):
        async with running_server() as (url, _):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
            for i in range(20):
                schema = random_schema(rng)
                tool = {"type": "function", "function": {"name": f"tool_{i}",
                                                         "parameters": schema}}  # fmt: skip
                # `required` with this one tool, then (odd ones) it named beside another.
                choices = [([tool], "required")]
                if i % 2:
                    named = {"type": "function", "function": {"name": f"tool_{i}"}}
                    choices.append(([tool, CLOCK], named))
                for tools, choice in choices:
                    reply = await client.chat.completions.create(
                        model="llama", messages=ASK, tools=tools, tool_choice=choice,
                        max_tokens=300,
                    )  # fmt: skip
                    choice_ = reply.choices[0]
                    assert choice_.finish_reason == "tool_calls", (i, choice_.message)
                    assert choice_.message.tool_calls  # parallel calls allowed: each valid
                    for call in choice_.message.tool_calls:
                        assert call.function.name == f"tool_{i}"
                        jsonschema.validate(json.loads(call.function.arguments), schema)
            await client.close()


async def test_bad_tools_are_400s_naming_the_field():
    cases = [
        ({"tools": [{"type": "code_interpreter"}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                              "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": "f"}, "functions"),  # the deprecated form is read, and checked
    ]  # fmt: skip
    with trio.fail_after(60):
        async with running_server() as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                for extra, param in cases:
                    body = {"messages": ASK, "max_tokens": 8, **extra}
                    r = await client.post("/v1/chat/completions", json=body)
                    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
                body = {"prompt": "hi", "tools": [WEATHER]}
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


async def test_the_embedding_api_runs_an_agent_step_without_http():
    async with checked_engine("llama", batch=4) as engine:
        result = await engine.generate(ASK, tools=[WEATHER], tool_choice="required", max_tokens=200)
    assert result.finish_reason == "tool_calls"
    (call,) = result.tool_calls
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)


async def test_a_template_with_its_own_tool_markup_uses_it_and_mlx_lms_parser():
    """The golden qwen3's template carries Qwen-style tool markup (mlx-lm: json_tools)."""
    from conftest import loaded

    model, tokenizer = loaded("qwen3")
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"
    rendered = tokenizer.decode(tokenizer.apply_chat_template(ASK, tools=[WEATHER]))
    assert "<tools>" in rendered and "get_weather" in rendered  # the template's own listing
    async with checked_engine((model, tokenizer), batch=4) as engine:
        ids = engine.encode(ASK)
        result = await engine.generate(ASK, tools=[WEATHER], tool_choice="required", max_tokens=200)
        (call,) = result.tool_calls
        called = {"role": "assistant", "content": "",
                  "tool_calls": [{"id": call.id, "type": "function", "function": {
                      "name": call.name, "arguments": call.arguments}}]}  # fmt: skip
        follow = [*ASK, called, {"role": "tool", "content": "sunny"}]
        again = await engine.generate(follow, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert result.finish_reason == "tool_calls" and call.name == "get_weather"
    listed = tokenizer.apply_chat_template(ASK, tools=[WEATHER], add_generation_prompt=True)
    assert result.usage.prompt_tokens == len(listed)  # the engine rendered the template's way
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    assert "<tools>" not in tokenizer.decode(ids)  # no tools asked: none listed
    assert again.finish_reason in ("stop", "length")


class Prefix:
    """A logits processor that makes the model write ``text`` first, then lets it go."""

    def __init__(self, tokenizer, prompt_len: int, text: str):
        self.ids = tokenizer.encode(text, add_special_tokens=False)
        self.prompt_len = prompt_len

    def __call__(self, tokens, logits):
        import mlx.core as mx

        at = tokens.size - self.prompt_len
        if at >= len(self.ids):
            return logits
        return mx.where(mx.arange(logits.shape[-1]) == self.ids[at], logits, -mx.inf)


async def test_under_auto_a_call_the_model_opens_is_held_to_the_schema():
    async with checked_engine("llama", batch=4) as engine:
        ids = engine.intake.encode(ASK, (WEATHER,))[0]  # the prompt the row will run
        opener = Prefix(engine.tokenizer, len(ids), "Let me check. <tool_call>")
        result = await engine.generate(
            ASK, tools=[WEATHER], max_tokens=200, logits_processors=[opener]
        )
        free = await engine.generate(ASK, tools=[WEATHER], max_tokens=30)
    assert result.text.startswith("Let me check. ")
    (call,) = result.tool_calls
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    assert "<tool_call>" not in free.text  # a noise model's free text: no markup leaks
