"""Tool calls and reasoning in each model family's own syntax, through a real server.

Each family is served with its real chat template (``goldens/family_fixtures.py``:
the publishers' templates as llama.cpp keeps them, from the llama-cpp-python
source package) and a tokenizer holding its special tokens. A scripted model
(``goldens/scripted_model.py`` in the family's dialect) writes the exact markup a
model of that family writes: reasoning, text, 0, 1 or 3 calls. The matrix runs
every case through the three APIs, streamed and not, with the official SDKs,
and checks each call's arguments exactly, content free of markup, reasoning
apart. Then, on a random-weight model with the same tokenizer, ``required`` calls
are constrained to the family's own markup and parse every time; and bad markup
stays text.
"""

from __future__ import annotations

import json
import sys
from typing import NamedTuple

import anthropic
import jsonschema
import openai
import pytest
import trio
from conftest import GOLDENS, running_server

sys.path.insert(0, str(GOLDENS))
from family_fixtures import FIXTURES, fetch
from make_scripted_model import build, build_noise
from mlx_nursery.actors.families import BY_NAME, HarmonySplitter
from mlx_nursery.actors.tools import ToolFormat, ToolScanner

READ = {"type": "function", "function": {
    "name": "Read", "description": "Read a file",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "maxLength": 12},
        "limit": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["path"], "additionalProperties": False}}}  # fmt: skip
GREP = {"type": "function", "function": {
    "name": "Grep", "description": "Search files",
    "parameters": {"type": "object", "properties": {
        "pattern": {"type": "string", "maxLength": 12}, "recurse": {"type": "boolean"}},
        "required": ["pattern", "recurse"], "additionalProperties": False}}}  # fmt: skip
TOOLS = [READ, GREP]
CALLS = [{"name": "Read", "arguments": {"path": "a.txt", "limit": 3}},
         {"name": "Grep", "arguments": {"pattern": "TODO x", "recurse": True}},
         {"name": "Read", "arguments": {"path": "b/c.py"}}]  # fmt: skip
CASES = [(n, thinks) for n in (0, 1, 3) for thinks in (False, True)]
MARKUP = ("<tool_call", "</tool_call", "<function=", "<parameter", "<arg_", "<invoke",
          "minimax:", "<|", "<｜", "[TOOL_CALLS]", "[ARGS]", "<think>", "</think>",
          "[THINK]", '"parameters"')  # fmt: skip


def _when(n: int, thinks: bool) -> str:
    return f"case {n} calls {'with' if thinks else 'without'} reasoning"


def script() -> dict:
    rules = []
    for n, thinks in CASES:
        turn = {"text": "Looking around." if n else "Nothing to call.", "calls": CALLS[:n]}
        if thinks:
            turn["reasoning"] = "Let me think."
        rules.append({"when": _when(n, thinks), "turns": [turn]})
    rules.append(
        {
            "when": "call a stranger",
            "turns": [{"text": "Trying.", "calls": [{"name": "Nope", "arguments": {"path": "x"}}]}],
        }
    )
    return {"rules": rules, "default": {"text": "ok"}}


@pytest.fixture(scope="module")
def templates():
    found = fetch()
    if found is None:
        pytest.skip("the family templates could not be fetched (no package registry)")
    return found


def expected(family: str, n: int, thinks: bool) -> tuple[str, str, list]:
    fixture = FIXTURES[family]
    calls = CALLS[: min(n, 1 if not fixture.parallel else n)]
    text = "Looking around." if n else "Nothing to call."
    if family == "llama3" and calls:
        text = ""  # a Llama 3 call is the whole answer
    reasoning = "Let me think." if thinks and fixture.reasoning else ""
    return text, reasoning, [(c["name"], c["arguments"]) for c in calls]


# -- reading each API's answer back, as a client does ------------------------------


def _extra(obj, name: str) -> str:
    return (obj.model_extra or {}).get(name) or ""


class Answer(NamedTuple):
    """An answer as a client reads it: text, reasoning, calls (name, arguments)
    and why it ended, in the API's own words (``length``, ``max_output_tokens``,
    ``max_tokens``...)."""

    text: str
    reasoning: str
    calls: list
    stop: str | None


async def chat(client: openai.AsyncOpenAI, stream: bool, **body) -> Answer:
    if not stream:
        choice = (await client.chat.completions.create(**body)).choices[0]
        msg = choice.message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or ()]
        return Answer(msg.content or "", _extra(msg, "reasoning_content"), calls,
                      choice.finish_reason)  # fmt: skip
    text, reasoning, calls, stop = "", "", {}, None
    async for chunk in await client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reasoning += _extra(choice.delta, "reasoning_content")
            stop = choice.finish_reason or stop
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, ["", ""])
                call[0] += d.function.name or ""
                call[1] += d.function.arguments or ""
    calls = [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))]
    return Answer(text, reasoning, calls, stop)


def _status(response) -> str:
    """A response's end: ``completed``, or why it is incomplete."""
    if response.status == "incomplete":
        return response.incomplete_details.reason
    return response.status


async def responses(client: openai.AsyncOpenAI, stream: bool, **chat_body) -> Answer:
    """The chat body as a Responses request (its temperature kept, where given)."""
    body = {"model": chat_body["model"], "input": chat_body["messages"], "tools": [
        {"type": "function", **t["function"]} for t in chat_body["tools"]],
        "max_output_tokens": chat_body["max_tokens"]}  # fmt: skip
    body |= {k: v for k, v in chat_body.items() if k == "temperature"}
    if "tool_choice" in chat_body:  # "required", or a function named
        choice = chat_body["tool_choice"]
        body["tool_choice"] = choice if isinstance(choice, str) else {
            "type": "function", "name": choice["function"]["name"]}  # fmt: skip
    if "parallel_tool_calls" in chat_body:
        body["parallel_tool_calls"] = chat_body["parallel_tool_calls"]
    if not stream:
        response = await client.responses.create(**body)
        out = response.output
        text = "".join(p.text for i in out if i.type == "message" for p in i.content)
        reasoning = "".join(c.text for i in out if i.type == "reasoning" for c in i.content or ())
        calls = [(i.name, json.loads(i.arguments)) for i in out if i.type == "function_call"]
        return Answer(text, reasoning, calls, _status(response))
    text, reasoning, calls, stop = "", "", {}, None
    async for event in await client.responses.create(**body, stream=True):
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.reasoning_text.delta":
            reasoning += event.delta
        elif event.type == "response.output_item.added" and event.item.type == "function_call":
            calls[event.item.id] = [event.item.name, ""]
        elif event.type == "response.function_call_arguments.delta":
            calls[event.item_id][1] += event.delta
        elif event.type in ("response.completed", "response.incomplete"):
            stop = _status(event.response)
    calls = [(name, json.loads(args)) for name, args in calls.values()]
    return Answer(text, reasoning, calls, stop)


async def messages(client: anthropic.AsyncAnthropic, stream: bool, **chat_body) -> Answer:
    """The chat body as a Messages request (its temperature kept, where given)."""
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in chat_body["tools"]]  # fmt: skip
    body = {"model": chat_body["model"], "messages": chat_body["messages"], "tools": tools,
            "max_tokens": chat_body["max_tokens"]}  # fmt: skip
    if "temperature" in chat_body:  # (not a parameter of this SDK's create)
        body["extra_body"] = {"temperature": chat_body["temperature"]}
    if "tool_choice" in chat_body:  # "required" is "any"; a function named, "tool"
        choice = chat_body["tool_choice"]
        body["tool_choice"] = {"type": "any"} if choice == "required" else {
            "type": "tool", "name": choice["function"]["name"]}  # fmt: skip
        if chat_body.get("parallel_tool_calls") is False:
            body["tool_choice"]["disable_parallel_tool_use"] = True
    if not stream:
        message = await client.messages.create(**body)
    else:
        async with client.messages.stream(**body) as s:
            async for _ in s:
                pass
            message = await s.get_final_message()
    blocks = message.content
    text = "".join(b.text for b in blocks if b.type == "text")
    reasoning = "".join(b.thinking for b in blocks if b.type == "thinking")
    calls = [(b.name, b.input) for b in blocks if b.type == "tool_use"]
    return Answer(text, reasoning, calls, message.stop_reason)


def _clean(text: str) -> None:
    for mark in MARKUP:
        assert mark not in text, (mark, text)


def _plain(family: str, *texts: str) -> None:
    """No control token of the family's tokenizer in any of ``texts``."""
    for text in texts:
        for special in FIXTURES[family].specials:
            assert special not in text, (family, special, text)


# A control token each family's parsers do not read, written mid-text.
LONE = {"hermes": "<|im_start|>", "qwen3_coder": "<|im_start|>", "glm": "<|assistant|>",
        "minimax": "]~b]", "kimi": "<|im_middle|>", "deepseek": "<｜Assistant｜>",
        "mistral": "[INST]", "llama3": "<|start_header_id|>",
        "harmony": "<|startoftext|>"}  # fmt: skip


def lone_rules(family: str) -> list:
    lone = LONE[family]
    return [{"when": "say a control token", "turns": [{"text": f"Before{lone}after."}]},
            {"when": "think a control token", "turns": [
                {"reasoning": f"Think{lone}ing.", "text": f"Before{lone}after."}]}]  # fmt: skip


HISTORY = {"when": "take two turns", "turns": [
    {"reasoning": "Plan.", "text": "", "calls": CALLS[:1]},
    {"text": "Got: {last_result}"}]}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FIXTURES))
async def test_a_scripted_model_of_the_family_over_every_api_and_a_real_client(
    family, templates, tmp_path
):
    """One server a family (its model scripted with every rule below), four
    checks: every API reads the family's calls and reasoning; a call cut short
    or to an unknown function is never an error; a history of calls, results
    and reasoning renders in the family's template; the Agents SDK runs its
    loop."""
    from agent_loops import agents_sdk_script, workdir

    work = workdir(tmp_path / "work")
    rules = [*script()["rules"], HISTORY, *lone_rules(family), agents_sdk_script(work)["rules"][0]]
    model = build(tmp_path / family, {"rules": rules, "default": {"text": "ok"}}, family=family)
    with trio.fail_after(900):
        async with running_server(str(model), trust_remote_code=True,
                                  prefill_step_size=512) as (url, _):  # fmt: skip
            async with (
                openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused") as oa,
                anthropic.AsyncAnthropic(base_url=url, api_key="unused") as an,
            ):
                await every_api_reads_the_calls_and_reasoning(family, oa, an)
                await a_call_cut_short_or_to_an_unknown_function_is_never_an_error(family, oa)
                await calls_whole_before_a_cut_are_kept_on_every_api(family, oa, an, model)
                await control_tokens_never_reach_the_text(family, oa, an)
                await a_history_of_calls_results_and_reasoning_renders(family, oa)
            await the_agents_sdk_runs_its_loop(family, url, work, tmp_path)


async def every_api_reads_the_calls_and_reasoning(family, oa, an) -> None:
    for n, thinks in CASES:
        want = expected(family, n, thinks)
        body = {"model": family, "max_tokens": 400, "tools": TOOLS,
                "messages": [{"role": "user", "content": _when(n, thinks)}]}  # fmt: skip
        for api, client in ((chat, oa), (responses, oa), (messages, an)):
            for stream in (False, True):
                got = await api(client, stream, **body)
                where = (family, api.__name__, stream, n, thinks)
                _clean(got[0]), _clean(got[1])
                assert got[2] == want[2], (where, got)
                assert (got[0].strip(), got[1].strip()) == want[:2], (where, got)


async def a_call_cut_short_or_to_an_unknown_function_is_never_an_error(family, oa) -> None:
    """A call cut by ``max_tokens`` is dropped (``length``, no call, no markup); a
    call to a function the request did not offer stays text, markup and all."""
    cut = {"model": family, "max_tokens": 40, "tools": TOOLS,
           "messages": [{"role": "user", "content": _when(1, False)}]}  # fmt: skip
    for stream in (False, True):
        text, _, calls, _ = await chat(oa, stream, **cut)
        _clean(text)
        assert calls == [] and text.strip() == expected(family, 1, False)[0], (stream, text)
    if family != "hermes":  # Hermes' opened calls are held to the tools (auto)
        reply = await oa.chat.completions.create(
            model=family, max_tokens=300, tools=TOOLS,
            messages=[{"role": "user", "content": "call a stranger"}])  # fmt: skip
        answer = reply.choices[0]
        assert answer.finish_reason == "stop" and not answer.message.tool_calls
        assert "Nope" in answer.message.content, answer.message.content


CUT_STOP = {"chat": "length", "responses": "max_output_tokens", "messages": "max_tokens"}


async def calls_whole_before_a_cut_are_kept_on_every_api(family, oa, an, model) -> None:
    """``max_tokens`` cuts the last of three calls (Harmony: its one call) two
    tokens into its arguments: the calls before it are the answer's, the cut one
    is neither a call nor text, and the stop reason is each API's own."""
    from scripted_model import WRITERS, _value
    from tokenizers import Tokenizer

    fixture = FIXTURES[family]
    body = {"model": family, "max_tokens": 400, "tools": TOOLS,
            "messages": [{"role": "user", "content": _when(3, False)}]}  # fmt: skip
    whole = (await oa.chat.completions.create(**body)).usage.completion_tokens
    written = WRITERS[fixture.dialect]("", "Looking around.", CALLS, False)
    last = (CALLS if fixture.parallel else CALLS[:1])[-1]
    tail = written[written.rindex(_value(next(iter(last["arguments"].values())))) :]
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    body["max_tokens"] = whole - len(tokenizer.encode(tail, add_special_tokens=False).ids) + 2
    want = [(c["name"], c["arguments"]) for c in CALLS[:2]] if fixture.parallel else []
    for api, client in ((chat, oa), (responses, oa), (messages, an)):
        for stream in (False, True):
            got = await api(client, stream, **body)
            where = (family, api.__name__, stream, body["max_tokens"])
            _clean(got.text)
            assert got.calls == want, (where, got)
            assert got.text.strip() == expected(family, 3, False)[0], (where, got)
            assert got.stop == CUT_STOP[api.__name__], (where, got)


async def control_tokens_never_reach_the_text(family, oa, an) -> None:
    """A control token the parsers do not read, in the middle of the text and the
    reasoning, is left out of both on every API, streamed and not, and out of
    logprobs' token texts; ``skip_special_tokens: false`` keeps it (vLLM's field)."""
    lone, fixture = LONE[family], FIXTURES[family]
    body = {"model": family, "max_tokens": 300, "tools": TOOLS,
            "messages": [{"role": "user", "content": "think a control token"}]}  # fmt: skip
    for api, client in ((chat, oa), (responses, oa), (messages, an)):
        for stream in (False, True):
            got = await api(client, stream, **body)
            where = (family, api.__name__, stream)
            _plain(family, got.text, got.reasoning)
            assert got.text.strip() == "Beforeafter.", (where, got)
            assert got.reasoning.strip() == ("Thinking." if fixture.reasoning else ""), (where, got)
    said = [{"role": "user", "content": "say a control token"}]
    for stream in (False, True):
        kept = await chat(oa, stream, **{**body, "messages": said},
                          extra_body={"skip_special_tokens": False})  # fmt: skip
        assert f"Before{lone}after." in kept.text, (family, stream, kept)
    reply = await oa.chat.completions.create(**{**body, "messages": said}, logprobs=True)
    tokens = [t.token for t in reply.choices[0].logprobs.content]
    _plain(family, *tokens)
    if family != "harmony":  # (gpt-oss's channel names are text the splitter reads)
        content = reply.choices[0].message.content
        assert "".join(tokens) == content and content.strip() == "Beforeafter.", tokens
    kept = await oa.chat.completions.create(**{**body, "messages": said}, logprobs=True,
                                            extra_body={"skip_special_tokens": False})  # fmt: skip
    assert lone in [t.token for t in kept.choices[0].logprobs.content]


async def a_history_of_calls_results_and_reasoning_renders(family, oa) -> None:
    """A second turn: the assistant's calls (with its reasoning) and the tool
    results are rendered back by the family's template, and the model, reading
    them, answers with the result."""
    ask = [{"role": "user", "content": HISTORY["when"]}]
    first = (await oa.chat.completions.create(model=family, messages=ask, tools=TOOLS,
                                              max_tokens=300)).choices[0]  # fmt: skip
    assert first.finish_reason == "tool_calls"
    (call,) = first.message.tool_calls
    turn = {"role": "assistant", "content": first.message.content,
            "reasoning_content": _extra(first.message, "reasoning_content") or None,
            "tool_calls": [call.model_dump()]}  # fmt: skip
    result = {"role": "tool", "tool_call_id": call.id, "name": "Read",
              "content": "the file says hi\nmore"}  # fmt: skip
    second = await oa.chat.completions.create(
        model=family, messages=[*ask, turn, result], tools=TOOLS, max_tokens=300
    )
    assert second.choices[0].message.content.strip() == "Got: the file says hi"
    assert second.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("family", sorted(FIXTURES))
async def test_required_calls_on_a_noise_model_parse_in_the_familys_syntax(
    family, templates, tmp_path
):
    """A random-weight model under ``required`` (and a named function) writes the
    family's own markup, with valid arguments, every one of twenty seeded runs."""
    model = build_noise(tmp_path / family, family)
    with trio.fail_after(600):
        async with running_server(str(model), prefill_step_size=512) as (url, _):
            oa = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
            try:
                await required_calls_parse(family, oa, url)
                await free_noise_carries_no_control_token(family, oa, url)
            finally:
                await oa.close()


async def required_calls_parse(family, oa, url) -> None:
    """Twenty seeded ``required`` (every fourth: a named function) answers on
    chat; then ``required`` and a named function on every API, streamed and not."""
    for seed in range(20):
        named = {"type": "function", "function": {"name": "Grep"}}
        choice = named if seed % 4 == 3 else "required"
        reply = await oa.chat.completions.create(
            model=family, messages=[{"role": "user", "content": "look"}], tools=TOOLS,
            tool_choice=choice, max_tokens=300, temperature=1.0, seed=seed,
            parallel_tool_calls=False,
        )  # fmt: skip
        answer = reply.choices[0]
        assert answer.finish_reason == "tool_calls", (seed, answer.message)
        for call in answer.message.tool_calls:
            tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
            assert choice == "required" or call.function.name == "Grep"
            args = json.loads(call.function.arguments)
            jsonschema.validate(args, tool["function"]["parameters"])
    async with anthropic.AsyncAnthropic(base_url=url, api_key="unused") as an:
        for i, (api, client) in enumerate(((chat, oa), (responses, oa), (messages, an))):
            for stream in (False, True):
                named = {"type": "function", "function": {"name": "Grep"}}
                choice = named if stream else "required"
                ask = [{"role": "user", "content": f"look {i}"}]
                got = await api(client, stream, model=family, tools=TOOLS, max_tokens=300,
                                messages=ask, tool_choice=choice, temperature=1.0,
                                parallel_tool_calls=False)  # fmt: skip
                where = (family, api.__name__, stream, got)
                assert got.calls and got.stop in ("tool_calls", "completed", "tool_use"), where
                for name, args in got.calls:
                    tool = next(t for t in TOOLS if t["function"]["name"] == name)
                    assert choice == "required" or name == "Grep", where
                    jsonschema.validate(args, tool["function"]["parameters"])


async def free_noise_carries_no_control_token(family, oa, url) -> None:
    """The same model under ``auto`` writes noise: lone control tokens, broken
    call blocks. On every API, streamed and not, no control token reaches the
    text or the reasoning (a broken block stays text without them). On chat the
    noise is made rich in control tokens (a logit bias on each, and against the
    end tokens: a random model may end at once), and the raw answers
    (``skip_special_tokens: false``) show it."""
    fixture = FIXTURES[family]
    ends = {256 + fixture.specials.index(e) for e in fixture.eos}
    bias = {str(256 + i): -100 if 256 + i in ends else 4 for i in range(len(fixture.specials))}
    raw = 0
    async with anthropic.AsyncAnthropic(base_url=url, api_key="unused") as an:
        for i in range(4):
            body = {"model": family, "max_tokens": 60, "tools": TOOLS, "temperature": 1.0,
                    "messages": [{"role": "user", "content": f"look {i}"}]}  # fmt: skip
            for api, client in ((chat, oa), (responses, oa), (messages, an)):
                for stream in (False, True):
                    got = await api(client, stream, **body)
                    _plain(family, got.text, got.reasoning, json.dumps(got.calls))
            for stream in (False, True):
                got = await chat(oa, stream, **body, logit_bias=bias, seed=i)
                _plain(family, got.text, got.reasoning, json.dumps(got.calls))
            kept = await chat(oa, False, **body, logit_bias=bias, seed=i,
                              extra_body={"skip_special_tokens": False})  # fmt: skip
            raw += any(s in kept.text + kept.reasoning for s in fixture.specials)
    assert raw, f"{family}: no raw answer held a control token"


@pytest.mark.parametrize("family", sorted(FIXTURES))
def test_the_required_grammar_accepts_what_the_familys_model_writes(family, templates, tmp_path):
    """Three calls (one for Harmony) as the family's model writes them, token by
    token, through the ``required`` grammar with parallel calls: every token is
    allowed and the grammar ends complete."""
    from llguidance import LLMatcher
    from mlx_lm import load
    from mlx_nursery.actors.constrain import compile_lark, ll_tokenizer
    from mlx_nursery.actors.families import literal
    from mlx_nursery.actors.tools import call_grammar
    from scripted_model import WRITERS

    path = build(tmp_path / family, script(), family=family)
    model, tokenizer = load(str(path), trust_remote_code=True)
    fixture = FIXTURES[family]
    calls = CALLS if fixture.parallel else CALLS[:1]
    written = WRITERS[fixture.dialect]("", "", calls, False).lstrip("\n")
    ids = model.script.ids(written).tolist()
    if ids[-1] in tokenizer.eos_token_ids and family != "harmony":
        ids = ids[:-1]  # the end token: the grammar's end, not in it
    ll = ll_tokenizer(tokenizer, 256 + len(fixture.specials))
    fmt = ToolFormat(BY_NAME[family], True)
    lark = call_grammar(TOOLS, "required", True, fmt, literal(tokenizer))
    matcher = LLMatcher(ll, compile_lark(ll, lark, "tools"))
    for i, token in enumerate(ids):
        assert matcher.consume_token(token), (family, i, written, matcher.get_error())
    assert matcher.is_accepting(), (family, written)


# -- bad markup stays text -----------------------------------------------------------


def scan(family: str, text: str, *, cut: bool = False, pieces: int = 1) -> tuple[str, list]:
    """The text through a family's scanner in ``pieces`` parts, as the emitter feeds it."""
    scanner = ToolScanner(ToolFormat(BY_NAME[family], True), TOOLS)
    shown, calls, step = "", [], max(1, len(text) // pieces)
    parts = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    for i, part in enumerate(parts):
        out, found = scanner.feed(part, final=i == len(parts) - 1, cut=cut)
        shown, calls = shown + out, calls + found
    return shown, [(c.name, json.loads(c.arguments)) for c in calls]


XML = ("<tool_call>\n<function=Read>\n<parameter=path>\na.txt\n</parameter>\n"
       "<parameter=limit>\n3\n</parameter>\n</function>\n</tool_call>")  # fmt: skip


@pytest.mark.parametrize("pieces", [1, 7, 200])
def test_xml_calls_read_in_any_pieces(pieces):
    assert scan("qwen3_coder", "Hi." + XML, pieces=pieces) == (
        "Hi.",
        [("Read", {"path": "a.txt", "limit": 3})],
    )


@pytest.mark.parametrize("pieces", [1, 9])
def test_calls_whole_before_a_cut_are_kept_and_the_cut_one_dropped(pieces):
    """``max_tokens`` cuts the second call: the first, whole, is the answer's
    (the emitter keeps ``length`` as the finish); the cut one is neither a call
    nor text. Llama 3 writes its calls as the whole answer, one object after
    another; the tagged families, a block each."""
    first = '{"name": "Read", "parameters": {"path": "a.txt", "limit": 3}}'
    for cut_at in ('; {"name": "Gr', "; ", ';{"name": "Grep", "parameters": {"pattern": "TO'):
        assert scan("llama3", first + cut_at, cut=True, pieces=pieces) == (
            "", [("Read", {"path": "a.txt", "limit": 3})]
        ), cut_at
    assert scan("llama3", '{"name": "Read", "param', cut=True, pieces=pieces) == ("", [])
    read = [("Read", {"path": "a.txt", "limit": 3})]
    assert scan("qwen3_coder", XML + XML[:40], cut=True, pieces=pieces) == ("", read)
    mistral = '[TOOL_CALLS]Read[ARGS]{"path": "a.txt", "limit": 3}'
    assert scan("mistral", mistral + mistral[:20], cut=True, pieces=pieces) == ("", read)
    # families whose one block holds several calls: the whole ones before the cut
    deepseek = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>Read<｜tool▁sep｜>'
                '{"path": "a.txt", "limit": 3}<｜tool▁call▁end｜>')  # fmt: skip
    cut = '<｜tool▁call▁begin｜>Grep<｜tool▁sep｜>{"pat'
    assert scan("deepseek", "Hi." + deepseek + cut, cut=True, pieces=pieces) == ("Hi.", read)
    kimi = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.Read:0"
            '<|tool_call_argument_begin|>{"path": "a.txt", "limit": 3}<|tool_call_end|>')
    assert scan("kimi", kimi + "<|tool_call_begin|>functions.Gr", cut=True, pieces=pieces) == (
        "", read)  # fmt: skip
    minimax = ('<minimax:tool_call>\n<invoke name="Read">\n<parameter name="path">a.txt'
               '</parameter>\n<parameter name="limit">3</parameter>\n</invoke>\n')
    assert scan("minimax", minimax + '<invoke name="Grep">', cut=True, pieces=pieces) == ("", read)
    assert scan("minimax", minimax[:60], cut=True, pieces=pieces) == ("", [])  # only the cut one


def test_bad_markup_stays_text():
    truncated = XML[: XML.index("</function>")]
    assert scan("qwen3_coder", "Hi." + truncated) == ("Hi." + truncated, [])  # ended inside
    assert scan("qwen3_coder", "Hi." + truncated, cut=True) == ("Hi.", [])  # max_tokens: as today
    wrong_type = XML.replace("\n3\n", "\nthree\n")
    assert scan("qwen3_coder", wrong_type) == (wrong_type, [])
    unknown = XML.replace("=Read>", "=Delete>")
    assert scan("qwen3_coder", unknown) == (unknown, [])
    glm_unknown = "<tool_call>Nope\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"
    assert scan("glm", glm_unknown) == (glm_unknown, [])
    bad_json = '[TOOL_CALLS]Read[ARGS]{"path": "a.txt",'
    assert scan("mistral", bad_json) == (bad_json, [])
    assert scan("llama3", '{"name": "Nope", "parameters": {}}')[1] == []
    assert scan("llama3", "{not json at all") == ("{not json at all", [])
    assert scan("llama3", "Plain words.") == ("Plain words.", [])


def harmony(text: str, pieces: int = 1) -> tuple[str, str, list]:
    scanner = ToolScanner(ToolFormat(BY_NAME["harmony"], True), TOOLS)
    split = HarmonySplitter(scanner.harmony_call)
    step = max(1, len(text) // pieces)
    parts = [text[i : i + step] for i in range(0, len(text), step)]
    content, reasoning, calls = "", "", []
    for i, part in enumerate(parts):
        c, r, k = split.feed(part, final=i == len(parts) - 1)
        content, reasoning, calls = content + c, reasoning + r, calls + k
    return content, reasoning, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("pieces", [1, 9, 300])
def test_harmony_channels_split_in_any_pieces(pieces):
    both = ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
            "<|channel|>final<|message|>Answer.")  # fmt: skip
    assert harmony(both, pieces) == ("Answer.", "Think.", [])
    # the recipient in the header after the channel, as gpt-oss also writes it
    call = ('<|channel|>commentary to=functions.Read <|constrain|>json<|message|>'
            '{"path": "a.txt", "limit": 3}')  # fmt: skip
    assert harmony(call, pieces) == ("", "", [("Read", {"path": "a.txt", "limit": 3})])


def test_harmony_without_a_channel_or_to_an_unknown_function_stays_text():
    assert harmony("just words, no header") == ("just words, no header", "", [])
    assert harmony("<|message|>no channel") == ("no channel", "", [])
    unknown = " to=functions.Nope<|channel|>commentary json<|message|>{}"
    assert harmony(unknown) == (unknown, "", [])


def test_earlier_reasoning_from_every_api_reaches_the_template(templates, tmp_path):
    """Anthropic ``thinking`` blocks and Responses ``reasoning`` items go back on
    their assistant turn as ``reasoning_content``, which a template that keeps
    earlier reasoning (GLM's) renders in its own markers."""
    from mlx_lm import load
    from mlx_nursery.server.api.messages import parse_messages
    from mlx_nursery.server.api.responses import parse_responses

    anthropic_body = {"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Plan the read.", "signature": ""},
            {"type": "tool_use", "id": "t1", "name": "Read", "input": {"path": "a"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "hi"}]}]}  # fmt: skip
    responses_body = {"model": "m", "input": [
        {"role": "user", "content": "go"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Plan the read."}]},
        {"type": "function_call", "call_id": "t1", "name": "Read", "arguments": '{"path": "a"}'},
        {"type": "function_call_output", "call_id": "t1", "output": "hi"}]}  # fmt: skip
    path = build(tmp_path / "glm", script(), family="glm")
    _, tokenizer = load(str(path), trust_remote_code=True)
    for parsed in (parse_messages(anthropic_body), parse_responses(responses_body)):
        messages = parsed.request.prompt
        (turn,) = [m for m in messages if m["role"] == "assistant"]
        assert turn["reasoning_content"] == "Plan the read.", messages
        for m in messages:
            for call in m.get("tool_calls", ()):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        assert "<think>Plan the read.</think>" in text, text[-400:]


def test_a_template_only_mlx_lm_knows_is_read_by_its_parser():
    """A family of mlx-lm's that is not ours (LFM2's pythonic calls) is read by
    mlx-lm's parser; a constrained call asks for the generic format instead."""
    from mlx_lm.tool_parsers import pythonic
    from mlx_nursery.actors.families import family_of
    from mlx_nursery.actors.tools import GENERIC, tool_format

    class Tokenizer:
        chat_template = "{{ messages }} <|tool_call_start|>"
        has_tool_calling = True
        tool_parser = staticmethod(pythonic.parse_tool_call)
        tool_call_start, tool_call_end = pythonic.tool_call_start, pythonic.tool_call_end

    family = family_of(Tokenizer())
    assert family.name == "pythonic" and family.grammar is None
    assert tool_format(Tokenizer(), "required") is GENERIC
    scanner = ToolScanner(tool_format(Tokenizer(), "auto"), TOOLS)
    text = 'Ok.<|tool_call_start|>[Read(path="a.txt", limit=3)]<|tool_call_end|>'
    shown, calls = scanner.feed(text, final=True)
    assert shown == "Ok." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("Read", {"path": "a.txt", "limit": 3})
    ]


LOOP = """

async def main(url, kind):
    agent = Agent(name="editor", instructions="Edit files.", tools=[read_file, write_file],
                  model=sdk_model(url, kind, "scripted"))
    result = await Runner.run(agent, "Mark notes.txt reviewed.", max_turns=6)
    print(json.dumps({"final": str(result.final_output)}))
"""


async def the_agents_sdk_runs_its_loop(family, url, work, tmp_path) -> None:
    """A real client's multi-step loop (read a file, write it, answer) where each
    step's call is written in the family's own markup and its result goes back
    through the family's template; Harmony and Qwen3-Coder also through Responses."""
    from agent_loops import FILE_TOOLS
    from clients import agents_sdk, run_client, said

    kinds = ["chat", "responses"] if family in ("harmony", "qwen3_coder") else ["chat"]
    port = int(url.rsplit(":", 1)[1])
    for kind in kinds:
        (work / "notes.txt").write_text("status: draft\n")
        loop = LOOP.replace('"scripted"', f'"{family}"')  # the served model's name
        done = await run_client(*agents_sdk(FILE_TOOLS + loop, tmp_path, port, kind), work)
        assert done.returncode == 0, said(done)
        out = json.loads(done.stdout.decode().strip().splitlines()[-1])
        assert out["final"].strip() == "Done: wrote 17 characters to notes.txt", (kind, out)
        assert (work / "notes.txt").read_text() == "status: reviewed\n"
