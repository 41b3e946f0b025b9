"""OpenAI Responses, tested with the official SDK's ``responses`` API: text, the
stream rebuilt by the SDK into the same output, a function call and its output
round trip, and ``text.format`` json_schema answers that validate."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import trio
from conftest import running_server

WEATHER = {
    "type": "function", "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False},
}  # fmt: skip


async def test_text_stream_function_calls_and_formats_through_the_sdk():
    with trio.fail_after(120):
        async with running_server() as (url, _):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
            r = await client.responses.create(
                model="llama", input="Say hello.", instructions="Be brief.", max_output_tokens=16
            )
            assert r.object == "response" and r.status in ("completed", "incomplete")
            assert r.output_text and r.usage.output_tokens > 0
            stream = await client.responses.create(
                model="llama", input="Say hello.", instructions="Be brief.", max_output_tokens=16,
                stream=True,
            )  # fmt: skip
            events = [e async for e in stream]
            # as OpenAI's: a cut answer ends in response.incomplete, a whole one in completed
            last = events[-1]
            assert last.type == f"response.{r.status}", [e.type for e in events[-3:]]
            assert last.response.output_text == r.output_text

            called = await client.responses.create(
                model="llama", input="Weather in Paris?", tools=[WEATHER],
                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200,
            )  # fmt: skip
            (call,) = [o for o in called.output if o.type == "function_call"]
            jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
            async with client.responses.stream(
                model="llama",
                input="Weather in Paris?",
                tools=[WEATHER],
                tool_choice="required",
                max_output_tokens=200,
            ) as stream:
                again = await stream.get_final_response()
            (call2,) = [o for o in again.output if o.type == "function_call"]
            assert (call2.name, call2.arguments) == (call.name, call.arguments)

            follow = await client.responses.create(
                model="llama", tools=[WEATHER], tool_choice="none", max_output_tokens=8,
                input=[{"role": "user", "content": "Weather in Paris?"},
                       {"type": "function_call", "call_id": call.call_id, "name": call.name,
                        "arguments": call.arguments},
                       {"type": "function_call_output", "call_id": call.call_id,
                        "output": "sunny, 21 C"}],
            )  # fmt: skip
            assert not [o for o in follow.output if o.type == "function_call"]

            schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
                      "required": ["ok"], "additionalProperties": False}  # fmt: skip
            shaped = await client.responses.create(
                model="llama", input="Is it ok?", max_output_tokens=100,
                text={"format": {"type": "json_schema", "name": "verdict", "schema": schema,
                                 "strict": True}},
            )  # fmt: skip
            jsonschema.validate(json.loads(shaped.output_text), schema)

            with pytest.raises(openai.BadRequestError, match="previous_response_id"):
                await client.responses.create(
                    model="llama", input="hi", previous_response_id="resp_1"
                )
            # a hosted tool this server cannot run is left out, and said so
            async with client.responses.with_streaming_response.create(
                model="llama", input="hi", tools=[{"type": "web_search"}], max_output_tokens=4
            ) as raw:
                assert raw.headers["x-ignored-tools"] == "web_search"
                await raw.parse()
            await client.close()
