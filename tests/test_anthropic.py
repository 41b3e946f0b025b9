"""Anthropic Messages, tested with Anthropic's own SDK against a real server:
text, the stream rebuilt by the SDK's accumulator, forced tool use, a tool_result
round trip, count_tokens, and each error as the SDK's matching exception."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
import trio
from conftest import running_server

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string",
                     "maxLength": 8}}, "required": ["city"], "additionalProperties": False},
}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


async def test_text_stream_and_tools_through_the_anthropic_sdk():
    with trio.fail_after(120):
        async with running_server() as (url, _):
            client = anthropic.AsyncAnthropic(base_url=url, api_key="unused")
            msg = await client.messages.create(
                model="llama", max_tokens=24, system="Be brief.", messages=ASK,
                extra_body={"temperature": 0},
            )  # fmt: skip
            assert msg.type == "message" and msg.role == "assistant"
            assert msg.stop_reason in ("end_turn", "max_tokens")
            assert msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0
            async with client.messages.stream(
                model="llama", max_tokens=24, system="Be brief.", messages=ASK
            ) as stream:
                streamed = await stream.get_final_message()
            assert [b.model_dump() for b in streamed.content] == [
                b.model_dump() for b in msg.content
            ]
            assert streamed.stop_reason == msg.stop_reason

            forced = await client.messages.create(
                model="llama", max_tokens=200, messages=ASK, tools=[WEATHER],
                tool_choice={"type": "tool", "name": "get_weather"},
            )  # fmt: skip
            assert forced.stop_reason == "tool_use"
            (use,) = [b for b in forced.content if b.type == "tool_use"]
            assert use.name == "get_weather" and use.id.startswith("toolu_")
            jsonschema.validate(use.input, WEATHER["input_schema"])

            follow = [*ASK, {"role": "assistant", "content": [use.model_dump()]},
                      {"role": "user", "content": [{"type": "tool_result",
                       "tool_use_id": use.id, "content": "sunny, 21 C"}]}]  # fmt: skip
            final = await client.messages.create(
                model="llama", max_tokens=8, messages=follow, tools=[WEATHER],
                tool_choice={"type": "none"},
            )  # fmt: skip
            assert final.stop_reason in ("end_turn", "max_tokens")
            counted = await client.messages.count_tokens(
                model="llama", messages=ASK, tools=[WEATHER]
            )
            prompt = forced.usage.input_tokens + (forced.usage.cache_read_input_tokens or 0)
            assert counted.input_tokens == prompt
            await client.close()


async def test_the_structured_output_of_the_current_sdk_is_honoured():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}  # fmt: skip
    with trio.fail_after(60):
        async with running_server() as (url, _):
            client = anthropic.AsyncAnthropic(base_url=url, api_key="unused")
            msg = await client.messages.create(
                model="llama", max_tokens=100, messages=ASK,
                extra_body={"output_config": {"format": {"type": "json_schema",
                                                         "schema": schema}}},
            )  # fmt: skip
            await client.close()
    assert msg.stop_reason == "end_turn"
    jsonschema.validate(json.loads(msg.content[0].text), schema)


async def test_each_error_is_the_sdks_matching_exception():
    with trio.fail_after(60):
        async with running_server(api_key="k", max_request_bytes=4096) as (url, _):
            client = anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0)
            with pytest.raises(anthropic.BadRequestError) as err:
                await client.messages.create(
                    model="llama", max_tokens=8,
                    messages=[{"role": "user", "content": [{"type": "image", "source": {
                        "type": "base64", "media_type": "image/png", "data": "AA=="}}]}],
                )  # fmt: skip
            assert "image" in str(err.value)
            with pytest.raises(anthropic.NotFoundError):
                # (claude-* names are this server's model: Claude Code asks for them)
                await client.messages.create(model="gpt-17", max_tokens=8, messages=ASK)
            with pytest.raises(anthropic.BadRequestError):
                await client.messages.create(model="llama", max_tokens=0, messages=ASK)
            with pytest.raises(anthropic.APIStatusError) as err:
                big = [{"role": "user", "content": "x" * 5000}]
                await client.messages.create(model="llama", max_tokens=8, messages=big)
            assert err.value.status_code == 413
            bad_key = anthropic.AsyncAnthropic(base_url=url, api_key="nope", max_retries=0)
            with pytest.raises(anthropic.AuthenticationError):
                await bad_key.messages.create(model="llama", max_tokens=8, messages=ASK)
            await client.close()
            await bad_key.close()


async def test_eight_agents_sharing_a_long_system_prompt_read_it_from_the_cache():
    system = " ".join(f"Rule {i}: keep module {i % 7} tidy." for i in range(60))  # ~1,700 bytes
    assert len(system) > 1500  # the golden tokenizer: one token a byte
    usages = {}

    async def agent(client, i):
        msg = await client.messages.create(
            model="llama", max_tokens=4, system=system,
            messages=[{"role": "user", "content": f"Agent {i}: report."}],
        )  # fmt: skip
        usages[i] = msg.usage

    with trio.fail_after(120):
        async with running_server() as (url, _):
            client = anthropic.AsyncAnthropic(base_url=url, api_key="unused")
            await agent(client, 1)
            async with trio.open_nursery() as nursery:
                for i in range(2, 9):
                    nursery.start_soon(agent, client, i)
            await client.close()
    assert (usages[1].cache_read_input_tokens or 0) == 0
    for i in range(2, 9):
        assert usages[i].cache_read_input_tokens >= 1000, (i, usages[i])


async def test_overload_and_a_failed_generation_are_the_sdks_exceptions_too():
    from conftest import FaultyModel, loaded

    with trio.fail_after(60):
        async with running_server(max_queued_requests=0) as (url, _):
            client = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
            with pytest.raises(anthropic.APIStatusError) as err:  # OverloadedError where defined
                await client.messages.create(model="llama", max_tokens=8, messages=ASK)
            assert err.value.status_code == 529
            assert err.value.body["error"]["type"] == "overloaded_error"
            await client.close()
        model, tokenizer = loaded("llama")
        faulty = FaultyModel(model)
        async with running_server(model=(faulty, tokenizer)) as (url, _):
            client = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
            faulty.fail_prefill = True
            with pytest.raises(anthropic.InternalServerError) as err:
                await client.messages.create(model="model", max_tokens=8, messages=ASK)
            assert err.value.body["error"]["type"] == "api_error"
            await client.close()
