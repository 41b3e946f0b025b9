"""Structured output: ``response_format`` json_schema / json_object, a grammar mask
per row. On a random-weight golden model (whose free output is noise) every
constrained answer still validates against its schema; constrained and free rows
share a batch, and the free ones stay token-exact."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import openai
import trio
import trio.testing
from conftest import checked_engine, golden, running_server

FAMILY = "llama"
CASES = golden(FAMILY)["serial"]
SCHEMAS = 20


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A closed object schema with bounded values (a noise model must be able to
    finish it inside max_tokens)."""
    props = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(["string", "integer", "boolean", "enum", "array", "object"])
        if kind == "object" and depth >= 1:
            kind = "boolean"
        name = f"{kind[:3]}_{i}"
        props[name] = {
            "string": {"type": "string", "maxLength": rng.randint(1, 8)},
            "integer": {"type": "integer", "minimum": 0, "maximum": rng.choice([9, 99, 999])},
            "boolean": {"type": "boolean"},
            "enum": {"enum": rng.sample(["red", "green", "blue", "amber", "teal"], 3)},
            "array": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "maxItems": 3,
            },
            "object": None,
        }[kind] or random_schema(rng, depth + 1)
    return {"type": "object", "properties": props, "required": sorted(props),
            "additionalProperties": False}  # fmt: skip


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                   "strict": True}}  # fmt: skip


async def test_twenty_seeded_schemas_are_met_every_time_through_the_openai_sdk():
    rng = random.Random(1234)
    schemas = [random_schema(rng) for _ in range(SCHEMAS)]
    with trio.fail_after(300):
        async with running_server() as (url, _):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
            for i, schema in enumerate(schemas):
                reply = await client.chat.completions.create(
                    model="llama",
                    messages=[{"role": "user", "content": f"Fill in form {i}."}],
                    max_tokens=300,
                    response_format=response_format(schema),
                )
                choice = reply.choices[0]
                assert choice.finish_reason == "stop", (i, choice.message.content)
                jsonschema.validate(json.loads(choice.message.content), schema)
            reply = await client.chat.completions.create(
                model="llama",
                messages=[{"role": "user", "content": "Any object."}],
                max_tokens=300,
                response_format={"type": "json_object"},
            )
            assert isinstance(json.loads(reply.choices[0].message.content), dict)
            await client.close()


async def test_constrained_and_free_rows_share_the_batch_and_the_free_ones_stay_exact():
    rng = random.Random(99)
    schemas = [random_schema(rng) for _ in range(4)]
    out = {}

    async def run(i):
        case = CASES[i % len(CASES)]
        if i % 2:
            fmt = response_format(schemas[i // 2])
            out[i] = await engine.generate(case["prompt_ids"], max_tokens=300, response_format=fmt)
        else:
            out[i] = await engine.generate(case["prompt_ids"], max_tokens=40)

    seen = []
    async with checked_engine(FAMILY, batch=8) as engine:
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(run, i)
            while len(out) < 8:
                await engine.wait_step(engine.steps + 1)
                # every actor and run caught up: a last step's rows have their results
                # (else the loop could wait for a step after the last one)
                await trio.testing.wait_all_tasks_blocked()
                seen.append(engine.stats().decoding_rows)
    assert max(seen) == 8, seen
    for i, result in out.items():
        if i % 2:
            assert result.finish_reason == "stop"
            jsonschema.validate(json.loads(result.text), schemas[i // 2])
        else:
            assert result.tokens == CASES[i % len(CASES)]["tokens"], f"row {i}"


async def test_an_invalid_schema_is_a_400_naming_response_format():
    bad = [
        {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}},
        },
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "yaml"},
    ]
    with trio.fail_after(60):
        async with running_server() as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                for fmt in bad:
                    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                            "response_format": fmt}  # fmt: skip
                    r = await client.post("/v1/chat/completions", json=body)
                    assert r.status_code == 400, (fmt, r.text)
                    assert r.json()["error"]["param"] == "response_format"


def test_llguidances_tokenizer_is_built_without_a_second_parse():
    """``ll_tokenizer`` builds llguidance's tokenizer from the model tokenizer's
    JSON without ``from_tokenizer``'s copy of it (a second parse under the GIL):
    the same tokenizer, token for token, as ``from_tokenizer``'s."""
    from conftest import loaded
    from llguidance.hf import from_tokenizer
    from mlx_nursery.actors.constrain import ll_tokenizer

    for family in ("llama", "qwen3", "gemma3_text"):
        _, tokenizer = loaded(family)
        hf = tokenizer._tokenizer
        ours = ll_tokenizer(tokenizer, None)
        theirs = from_tokenizer(hf, eos_token=list(tokenizer.eos_token_ids))
        every = list(range(theirs.vocab_size))
        figures = ("vocab_size", "eos_tokens", "is_canonical")
        assert [getattr(ours, f) for f in figures] == [getattr(theirs, f) for f in figures]
        assert ours.dbg_tokens(every) == theirs.dbg_tokens(every)
        text = 'Tool call: {"name": "get", "x": 12}\n'
        assert ours.tokenize_str(text) == theirs.tokenize_str(text)
