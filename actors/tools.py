"""Tool calls: the chat template's own format where mlx-lm knows it, else a generic one.

A template with its own tool markup (mlx-lm's ``tokenizer.has_tool_calling``) is
rendered with ``tools=`` and its calls parsed by mlx-lm's tool parser
(:func:`tool_format`). For every other model, the generic format: the
request's tools are described in the system prompt and the model is asked to
call one as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the
Hermes convention). Earlier calls and tool results in the conversation are
rendered the same way, so any chat template can carry them. ``tool_choice``
``required`` or a named function constrains the answer to exactly such calls
(an llguidance grammar over the tools' JSON schemas); ``auto`` leaves the model
free and parses what it writes; ``none`` renders no tools and parses nothing.
The emitter's :class:`ToolScanner` lifts calls out of the text, so markup never
reaches a client's content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import jsonschema

from .constrain import loosen
from .errors import InvalidRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _json_call(body: str, tools: Any = None) -> dict:
    return json.loads(body)


@attrs.frozen
class ToolFormat:
    """How calls look in the text: between ``open`` and ``close``, parsed by
    ``parse(body, tools) -> {"name", "arguments"}``. ``native``: the chat
    template's own (rendered with ``tools=``, parsed by mlx-lm's tool parser);
    else the generic format. ``json``: the body is one JSON object, so a grammar
    can constrain it."""

    open: str = OPEN
    close: str = CLOSE
    parse: Any = attrs.field(default=_json_call, repr=False)
    native: bool = False
    json: bool = True
    # The request's tools with their full schemas, where the constraint had to
    # leave keywords out (see ``loosen_tools``): a call is checked against these.
    strict: tuple = attrs.field(default=(), repr=False)


GENERIC = ToolFormat()


def tool_format(tokenizer: Any, choice: str | None) -> ToolFormat:
    """The template's own format where mlx-lm knows it (its JSON ones, or any when
    the answer is free); otherwise the generic one."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return GENERIC
    parse = tokenizer.tool_parser
    is_json = getattr(parse, "__module__", "").endswith(".json_tools")
    if choice not in ("auto", "none") and not is_json:
        return GENERIC  # a constrained call needs a JSON body
    return ToolFormat(tokenizer.tool_call_start, tokenizer.tool_call_end, parse, True, is_json)


def native_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Messages for a template with its own tool markup: call arguments as objects
    (OpenAI sends them as JSON text; templates render them with ``tojson``)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if not calls:
            out.append(dict(m))
            continue
        fixed = []
        for c in calls:
            fn = dict(c.get("function") or {}) if isinstance(c, Mapping) else {}
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"] or "{}")
                except json.JSONDecodeError:
                    _fail("an assistant message's tool call arguments must be JSON", "messages")
            fixed.append({**c, "function": fn})
        out.append({**m, "tool_calls": fixed})
    return out


@attrs.frozen
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object


def loosen_tools(tools: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> tuple:
    """The tools with the schema keywords ``keys`` left out of their parameters."""
    out = []
    for tool in tools:
        fn = dict(tool["function"])
        fn["parameters"] = loosen(fn.get("parameters") or {"type": "object"}, keys)
        out.append({**tool, "function": fn})
    return tuple(out)


def meets_schema(tools: Sequence[Mapping[str, Any]], name: str, arguments: str) -> bool:
    """Whether a call's arguments meet its tool's full schema."""
    for tool in tools:
        if tool["function"]["name"] == name:
            schema = tool["function"].get("parameters") or {"type": "object"}
            try:
                jsonschema.validate(json.loads(arguments), schema)
            except (jsonschema.ValidationError, jsonschema.SchemaError, ValueError):
                return False
            return True
    return False


def _fail(message: str, param: str = "tools") -> None:
    raise InvalidRequest(message, param=param)


def check_tools(tools: Any) -> tuple[Mapping[str, Any], ...]:
    """OpenAI function tools; anything else is refused naming the problem."""
    if tools is None:
        return ()
    if not isinstance(tools, list | tuple):
        _fail("tools must be a list of function tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            _fail(f"tools[{i}]: only type 'function' is supported")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            _fail(f"tools[{i}].function needs a non-empty 'name'")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, Mapping):
            _fail(f"tools[{i}].function.parameters must be a JSON schema object")
    return tuple(tools)


def chosen(tools: Sequence[Mapping[str, Any]], choice: Any) -> str | None:
    """The tool_choice as ``auto``, ``none``, ``required`` or a tool's name."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none", "required"):
        if choice != "none" and not tools:
            _fail(f"tool_choice {choice!r} needs tools", "tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    names = [t["function"]["name"] for t in tools]
    if not isinstance(name, str) or name not in names:
        _fail(
            f"tool_choice must be auto, none, required or a function among {names}", "tool_choice"
        )
    return name


def _schema(tool: Mapping[str, Any]) -> dict:
    fn = tool["function"]
    return {
        "type": "object",
        "properties": {
            "name": {"const": fn["name"]},
            "arguments": fn.get("parameters") or {"type": "object"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _calls_schema(tools: Sequence[Mapping[str, Any]], fmt: ToolFormat = GENERIC) -> dict:
    """One call to any of ``tools``, with no free whitespace for a model to loop
    on: compact in the generic format; in a template's own, spaced as the template
    writes earlier calls (``tojson``: ``", "`` and ``": "``), which is what a model
    trained on it writes."""
    schema = _schema(tools[0]) if len(tools) == 1 else {"anyOf": [_schema(t) for t in tools]}
    spacing = {"item_separator": ", ", "key_separator": ": "} if fmt.native else {}
    return {"x-guidance": {"whitespace_flexible": False, **spacing}, **schema}


def _body(fmt: ToolFormat) -> str:
    """A call's body in the grammar: a template's own format puts a newline on
    each side of the JSON (``<tool_call>\\n{...}\\n</tool_call>``); either may be
    left out."""
    return "obj" if not fmt.native else '"\\n"? obj "\\n"?'


def call_grammar(
    tools: Sequence[Mapping[str, Any]], choice: str, parallel: bool, fmt: ToolFormat = GENERIC
) -> str | None:
    """The lark grammar a ``required`` or named choice constrains the answer to."""
    if choice in ("auto", "none") or not fmt.json:
        return None
    pool = [t for t in tools if choice == "required" or t["function"]["name"] == choice]
    schema = _calls_schema(pool, fmt)
    repeat = "+" if parallel else ""
    return (
        f"start: call{repeat}\ncall: {json.dumps(fmt.open)} {_body(fmt)} {json.dumps(fmt.close)}\n"
        f"obj: %json {json.dumps(schema)}\n"
    )


def calls_or_answer_grammar(
    tools: Sequence[Mapping[str, Any]], parallel: bool, fmt: ToolFormat, schema: Mapping[str, Any]
) -> str:
    """``auto`` tools with a response format: the answer is either tool calls or
    the final message in the format (as OpenAI applies a format to the final
    message only, never to a call)."""
    repeat = "+" if parallel else ""
    return (
        f"start: calls | answer\ncalls: call{repeat}\n"
        f"call: {json.dumps(fmt.open)} {_body(fmt)} {json.dumps(fmt.close)}\n"
        f"obj: %json {json.dumps(_calls_schema(tools, fmt))}\n"
        f"answer: %json {json.dumps(schema)}\n"
    )


def body_grammar(tools: Sequence[Mapping[str, Any]], fmt: ToolFormat = GENERIC) -> str | None:
    """The lark grammar of one call's body and closing tag, for ``auto`` calls
    once opened (None where the format's body is not JSON)."""
    if not tools or not fmt.json:
        return None
    schema = _calls_schema(tools, fmt)
    return f"start: {_body(fmt)} {json.dumps(fmt.close)}\nobj: %json {json.dumps(schema)}\n"


def system_text(tools: Sequence[Mapping[str, Any]]) -> str:
    lines = [
        "You can call these functions. To call one, reply with",
        f'{OPEN}{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}{CLOSE}',
        "and nothing else for that call. Functions:",
    ]
    for tool in tools:
        fn = tool["function"]
        spec = {"name": fn["name"], "description": fn.get("description", ""),
                "parameters": fn.get("parameters") or {"type": "object"}}  # fmt: skip
        lines.append(json.dumps(spec))
    return "\n".join(lines)


def render_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[dict]:
    """Messages any chat template can render: the tools in the system prompt,
    earlier calls as markup in the assistant's content, results as user turns."""
    out: list[dict] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [_markup(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": content + "".join(calls)})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>{content}</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        text = system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _markup(call: Any) -> str:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        _fail("an assistant message's tool_calls need function.name", "messages")
    args = fn.get("arguments") or "{}"
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        _fail("an assistant message's tool call arguments must be JSON", "messages")
    return f"{OPEN}{json.dumps({'name': fn['name'], 'arguments': parsed})}{CLOSE}"


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_not_json)  # strict: no NaN, no Infinity


def written_arguments(body: str) -> str | None:
    """The ``arguments`` value of a JSON call body exactly as the model wrote it
    (never parsed and written again: ``1E+400`` stays ``1E+400``, where a float
    would print ``Infinity``, which is not JSON). ``{}`` where there is none;
    None where it is not an object or the body is not one JSON object."""
    text = body.strip()
    if not text.startswith("{"):
        return None
    found, at = "{}", 1
    try:
        while True:
            at = _skip(text, at)
            if text[at] == "}":
                return found if _skip(text, at + 1) == len(text) else None
            key, at = _DECODER.raw_decode(text, at)
            at = _skip(text, at)
            if not isinstance(key, str) or text[at] != ":":
                return None
            start = _skip(text, at + 1)
            value, end = _DECODER.raw_decode(text, start)
            if key == "arguments":
                if not isinstance(value, dict):
                    return None
                found = text[start:end]
            at = _skip(text, end)
            if text[at] == ",":
                at += 1
            elif text[at] != "}":
                return None
    except (ValueError, IndexError):
        return None


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\n\r":
        at += 1
    return at


@attrs.define
class ToolScanner:
    """Splits a row's streamed text into content and tool calls (emitter-side)."""

    format: ToolFormat = GENERIC
    tools: Any = None  # the request's tools (some of mlx-lm's parsers need them)
    text: str = ""  # held back: a possible tag start, or an open call's body
    inside: bool = False
    calls: int = 0
    cut: str | None = None  # the body of a call the row ended inside, dropped

    def feed(
        self, piece: str, *, final: bool = False, cut: bool = False
    ) -> tuple[str, list[ToolCall]]:
        """Content and calls that can be shown now. ``final``: the row's text is
        all in; ``cut``: it ended at max_tokens, so an opening tag begun at its
        end is a call cut short too, not text."""
        self.text += piece
        shown, found = [], []
        opening, closing = self.format.open, self.format.close
        while True:
            if not self.inside:
                at = self.text.find(opening)
                if at < 0:
                    keep = held_prefix(self.text, opening)
                    if final and cut and keep:
                        self.cut, self.text = self.text[len(self.text) - keep :], self.text[:-keep]
                    keep = 0 if final else keep
                    shown.append(self.text[: len(self.text) - keep])
                    self.text = self.text[len(self.text) - keep :]
                    break
                shown.append(self.text[:at])
                self.text, self.inside = self.text[at + len(opening) :], True
            end = self.text.find(closing)
            if end < 0:
                if final:  # a call cut short (max_tokens): neither a call nor content
                    self.cut = self.text
                    self.text, self.inside = "", False
                break
            body, self.text, self.inside = self.text[:end], self.text[end + len(closing) :], False
            call = self._parse(body)
            if call is None:
                shown.append(body)
            else:
                found.append(call)
        return "".join(shown), found

    def _parse(self, body: str) -> ToolCall | None:
        try:
            obj = self.format.parse(body, list(self.tools or ()))
        except Exception:  # a parser's own error: the text stays text
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", {})
        if self.format.json:
            args = written_arguments(body)
        elif not isinstance(args, str):
            try:
                args = json.dumps(args, allow_nan=False)
            except ValueError:  # a number no JSON can carry: the text stays text
                return None
        if args is None:
            return None
        if self.format.strict and not meets_schema(self.format.strict, obj["name"], args):
            return None  # the loosened constraint let through what the full schema refuses
        self.calls += 1
        return ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], args)


@attrs.define
class ReasoningScanner:
    """Splits a thinking model's text into content and reasoning (between its think
    markers, e.g. ``<think>`` ... ``</think>``); holds back a possible tag start."""

    start: str
    end: str
    inside: bool = False  # the prompt may open the block (the template's doing)
    text: str = ""

    def feed(self, piece: str, *, final: bool = False) -> tuple[str, str]:
        """(content, reasoning) that can be shown now."""
        self.text += piece
        content, reasoning = [], []
        while True:
            tag = self.end if self.inside else self.start
            part = reasoning if self.inside else content
            at = self.text.find(tag)
            if at < 0:
                keep = 0 if final else held_prefix(self.text, tag)
                part.append(self.text[: len(self.text) - keep])
                self.text = self.text[len(self.text) - keep :]
                return "".join(content), "".join(reasoning)
            part.append(self.text[:at])
            self.text, self.inside = self.text[at + len(tag) :], not self.inside


def held_prefix(text: str, tag: str) -> int:
    """How many of ``text``'s last characters could begin ``tag`` (to hold back)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
