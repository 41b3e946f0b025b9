"""The scripted test model (goldens/scripted_model.py) answers by its script, turn
by turn, the same under mlx-lm's own generate and in the engine's batch, where
its rows sit beside others of different lengths (left padding, joins): what it
reads is what its cache's mask shows, so a neighbour never leaks in."""

from __future__ import annotations

import json
import sys

import pytest
import trio
from conftest import GOLDENS
from mlx_nursery.actors import open_engine

sys.path.insert(0, str(GOLDENS))
from make_scripted_model import build

TOOLS = [{"type": "function", "function": {
    "name": "Read", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
}}]  # fmt: skip
SCRIPT = {"rules": [
    {"when": "read x", "turns": [
        {"text": "Looking.", "calls": [{"name": "Read", "arguments": {"path": "x"}}]},
        {"text": "x says: {last_result}"},
    ]},
    {"when": "count", "turns": [{"text": "one two three four five six seven eight nine ten"}]},
], "default": {"text": "ok"}}  # fmt: skip
CALLED = [{"role": "user", "content": "please read x"},
          {"role": "assistant", "content": "Looking.", "tool_calls": [
              {"id": "c1", "type": "function",
               "function": {"name": "Read", "arguments": json.dumps({"path": "x"})}}]},
          {"role": "tool", "tool_call_id": "c1",
           "content": "hello there\nsecond line"}]  # fmt: skip


@pytest.fixture(scope="module")
def scripted(tmp_path_factory) -> str:
    return str(build(tmp_path_factory.mktemp("scripted") / "scripted", SCRIPT))


def test_mlx_lm_generate_follows_the_script_turn_by_turn(scripted):
    from mlx_lm import generate, load

    model, tokenizer = load(scripted, trust_remote_code=True)

    def answer(messages: list[dict]) -> str:
        prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
        return generate(model, tokenizer, prompt, max_tokens=200)

    assert answer(CALLED[:1]) == 'Looking.<tool_call>\n{"name": "Read", "arguments": {"path": "x"}}\n</tool_call>'  # noqa: E501
    assert answer(CALLED) == "x says: hello there"
    assert answer([{"role": "user", "content": "hi"}]) == "ok"


async def test_the_engine_batches_scripted_rows_as_it_runs_them_alone(scripted):
    """Rows of very different lengths decode together, join while others run, and
    each gets its own conversation's answer, with its calls parsed."""
    long_user = {"role": "user", "content": "count, after a long preamble: " + "word " * 400}
    asks = [CALLED[:1], CALLED, [long_user], [{"role": "user", "content": "hi"}]] * 2
    async with open_engine(scripted, batch=4, prefill_step_size=64,
                           trust_remote_code=True) as engine:  # fmt: skip
        alone = [await engine.generate(m, tools=TOOLS, max_tokens=120) for m in asks[:4]]
        before = engine.stats()
        together = [None] * len(asks)

        async def run(i: int) -> None:
            await trio.sleep(0.01 * i)  # arrivals spread: later rows join a running batch
            together[i] = await engine.generate(asks[i], tools=TOOLS, max_tokens=120)

        async with trio.open_nursery() as nursery:
            for i in range(len(asks)):
                nursery.start_soon(run, i)
        after = engine.stats()
    # rows shared decode steps: more row-forwards than steps
    steps = after.step_time.count - before.step_time.count
    assert after.row_forwards - before.row_forwards > 1.5 * steps
    counted = "one two three four five six seven eight nine ten"
    assert [r.text for r in alone] == ["Looking.", "x says: hello there", counted, "ok"]

    def said(r) -> tuple:
        return r.text, [(c.name, c.arguments) for c in r.tool_calls]

    assert said(alone[0])[1] == [("Read", '{"path": "x"}')]
    for i, r in enumerate(together):
        assert said(r) == said(alone[i % 4]), i


async def test_a_required_call_in_the_templates_own_format_keeps_its_spacing(tmp_path):
    """Under ``tool_choice: required`` the answer is constrained to the template's
    own call markup, spaced as the template writes calls: what a model trained on
    it writes passes the grammar unchanged."""
    script = {"rules": [{"when": "read y", "turns": [
        {"calls": [{"name": "Read", "arguments": {"path": "y"}},
                   {"name": "Read", "arguments": {"path": "z"}}]}]}]}  # fmt: skip
    model = str(build(tmp_path / "scripted", script))
    async with open_engine(model, trust_remote_code=True) as engine:
        ask = [{"role": "user", "content": "please read y"}]
        for choice in ("required", {"type": "function", "function": {"name": "Read"}}):
            result = await engine.generate(ask, tools=TOOLS, tool_choice=choice, max_tokens=200)
            calls = [(c.name, c.arguments) for c in result.tool_calls]
            assert calls == [("Read", '{"path": "y"}'), ("Read", '{"path": "z"}')], result
