"""Tool calls: the chat template's own format where its family is known, else a generic one.

A template with its own tool markup is rendered with ``tools=`` and its calls
read in its family's syntax (:func:`tool_format`; ``families.py``: our parsers
for the families we know, mlx-lm's tool parser for a template only mlx-lm
knows). For every other model, the generic format: the
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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import jsonschema

from .constrain import loosen
from .errors import InvalidRequest
from .families import (
    BY_NAME,
    DECODER,
    Family,
    Lit,
    complete_objects,
    family_of,
    guided,
    held_prefix,
    hermes_schema,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@attrs.frozen
class ToolFormat:
    """How calls look in the text: a :class:`families.Family`'s markup.
    ``native``: the chat template's own (rendered with ``tools=``); else the
    generic format, Hermes' markup described in the system prompt."""

    family: Family = BY_NAME["hermes"]
    native: bool = False

    @property
    def open(self) -> str:
        return self.family.open

    @property
    def close(self) -> str:
        return self.family.close

    @property
    def json(self) -> bool:
        """The body is one JSON object ``{"name", "arguments"}`` (Hermes'), which
        the ``auto`` grammars (an opened call, calls or a format) are built on."""
        return self.family.name == "hermes"


GENERIC = ToolFormat()


def tool_format(tokenizer: Any, choice: str | None) -> ToolFormat:
    """The template's own format where its family is known (and, for a constrained
    call, can be constrained); else the generic one."""
    family = family_of(tokenizer)
    if family is None or (family.grammar is None and choice not in ("auto", "none")):
        return GENERIC
    return ToolFormat(family, True)


def native_messages(
    messages: Sequence[Mapping[str, Any]], family: Family | None = None
) -> list[dict]:
    """Messages for a template with its own tool markup: call arguments as objects
    (OpenAI sends them as JSON text; templates render them with ``tojson``), or as
    text where the family's template joins them as text (DeepSeek's). Harmony's
    template takes an analysis (``thinking``) or a content beside a call, not
    both: the analysis (what gpt-oss wrote before the call) is kept, and the
    template drops it once a final answer follows, as Harmony does."""
    out = []
    as_text = family is not None and family.arguments_as_text
    for m in messages:
        calls = m.get("tool_calls")
        if not calls:
            out.append(dict(m))
            continue
        fixed = []
        for c in calls:
            fn = dict(c.get("function") or {}) if isinstance(c, Mapping) else {}
            args = fn.get("arguments")
            try:
                if isinstance(args, str) and not as_text:
                    fn["arguments"] = json.loads(args or "{}")
                elif as_text and not isinstance(args, str):
                    fn["arguments"] = json.dumps(args or {})
            except (json.JSONDecodeError, TypeError):
                _fail("an assistant message's tool call arguments must be JSON", "messages")
            fixed.append({**c, "function": fn})
        message = {**m, "tool_calls": fixed}
        if family is not None and family.name == "harmony" and m.get("reasoning_content"):
            message["content"], message["thinking"] = "", m["reasoning_content"]
        out.append(message)
    return out


def native_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Tools for a template's own rendering: each function with a description
    (gpt-oss's template reads it unguarded; an empty one renders as none)."""
    return [{**t, "function": {"description": "", **t["function"]}} for t in tools]


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
                jsonschema.validate(DECODER.decode(arguments), schema)
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


def _calls_schema(tools: Sequence[Mapping[str, Any]], fmt: ToolFormat = GENERIC) -> dict:
    """One call to any of ``tools``: compact in the generic format, spaced as the
    template writes calls in its own."""
    return guided(hermes_schema(tools), spaced=fmt.native)


def _call_rule(fmt: ToolFormat, lit: Lit) -> str:
    """A Hermes call: a template's own format puts a newline on each side of the
    JSON (``<tool_call>\\n{...}\\n</tool_call>``), either may be left out; its
    tags are the special tokens they are in the model's vocabulary."""
    if not fmt.native:
        return f"call: {json.dumps(OPEN)} obj {json.dumps(CLOSE)}"
    return f'call: {lit(OPEN)} "\\n"? obj "\\n"? {lit(CLOSE)}'


def call_grammar(
    tools: Sequence[Mapping[str, Any]],
    choice: str,
    parallel: bool,
    fmt: ToolFormat = GENERIC,
    lit: Lit = json.dumps,
) -> str | None:
    """The lark grammar a ``required`` or named choice constrains the answer to:
    the family's own markup where the template has one."""
    if choice in ("auto", "none"):
        return None
    pool = [t for t in tools if choice == "required" or t["function"]["name"] == choice]
    if fmt.native:
        return fmt.family.grammar(pool, parallel, lit)
    repeat = "+" if parallel else ""
    schema = _calls_schema(pool, fmt)
    return f"start: call{repeat}\n{_call_rule(fmt, lit)}\nobj: %json {json.dumps(schema)}\n"


def calls_or_answer_grammar(
    tools: Sequence[Mapping[str, Any]],
    parallel: bool,
    fmt: ToolFormat,
    schema: Mapping[str, Any],
    lit: Lit = json.dumps,
) -> str:
    """``auto`` tools with a response format: the answer is either tool calls or
    the final message in the format (as OpenAI applies a format to the final
    message only, never to a call)."""
    repeat = "+" if parallel else ""
    return (
        f"start: calls | answer\ncalls: call{repeat}\n{_call_rule(fmt, lit)}\n"
        f"obj: %json {json.dumps(_calls_schema(tools, fmt))}\n"
        f"answer: %json {json.dumps(schema)}\n"
    )


def body_grammar(
    tools: Sequence[Mapping[str, Any]], fmt: ToolFormat = GENERIC, lit: Lit = json.dumps
) -> str | None:
    """The lark grammar of one call's body and closing tag, for ``auto`` calls
    once opened (None where the format's body is not Hermes' JSON)."""
    if not tools or not fmt.json:
        return None
    body, close = ('"\\n"? obj "\\n"?', lit(CLOSE)) if fmt.native else ("obj", json.dumps(CLOSE))
    schema = _calls_schema(tools, fmt)
    return f"start: {body} {close}\nobj: %json {json.dumps(schema)}\n"


@attrs.frozen
class Constraint:
    """What a request's tools, tool choice and response format ask of the decoder,
    worked out once (:func:`constraint`): a grammar over the whole answer, or
    over a call's body once the model opens one (``opened``: the marker that
    opens it). ``lark`` writes the grammar from the tools (the intake may drop
    schema keywords its grammar engine cannot compile and ask again) and the
    response format's schema as the engine reads it; None: the schema alone
    is the grammar. ``param`` names what asked for it, for a refusal."""

    param: str
    tools: tuple = ()
    schema: Mapping[str, Any] | None = None
    lark: Callable[[tuple, Mapping[str, Any] | None], str] | None = None
    opened: str | None = None


def constraint(
    params: Any, schema: Mapping[str, Any] | None, lit: Lit, closing: str | None = None
) -> Constraint | None:
    """The constraint a request's ``params`` ask for (tool choice settled, its
    format chosen; ``schema``: its response format's), or None. A required or
    named call is constrained to the calls (``closing`` first: the think block
    the prompt opened); under ``auto`` with a format (Hermes' JSON body), the
    answer is calls or the final message in the format; a format alone shapes
    the answer; under ``auto`` without one, a call the model opens is held to
    the tools' schemas."""
    fmt = params.tool_format or GENERIC
    tools, choice, parallel = params.tools, params.tool_choice, params.parallel_tool_calls
    if choice not in ("auto", "none"):
        return Constraint("tool_choice", tools, None, lambda ts, _: after(
            closing, call_grammar(ts, choice, parallel, fmt, lit)))  # fmt: skip
    if schema is not None and choice == "auto" and fmt.json and tools:
        return Constraint("response_format", tools, schema,
                          lambda ts, s: calls_or_answer_grammar(ts, parallel, fmt, s, lit))
    if schema is not None:
        return Constraint("response_format", (), schema)
    if choice == "auto" and body_grammar(tools, fmt) is not None:
        return Constraint("tool_choice", tools, None, lambda ts, _: body_grammar(ts, fmt, lit),
                          opened=fmt.open)  # fmt: skip
    return None


def after(closing: str | None, lark: str) -> str:
    """``lark``'s answer after ``closing`` (a think block's end) and any blank space."""
    if closing is None:
        return lark
    first, rest = lark.split("\n", 1)
    return f"start: {closing} /[ \\n]*/ ({first.removeprefix('start:').strip()})\n{rest}"


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
            out.append({"role": "user", "content": _wrapped(content, "<tool_response>",
                                                             "</tool_response>")})  # fmt: skip
        else:
            out.append({"role": role, "content": content})
    if tools:
        text = system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _wrapped(content: str | list, before: str, after: str) -> str | list:
    """Text around a message's content: a string's, or a list of parts' (an image
    in a tool result stays a part of its own)."""
    if isinstance(content, str):
        return f"{before}{content}{after}"
    return [{"type": "text", "text": before}, *content, {"type": "text", "text": after}]


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


@attrs.define
class ToolScanner:
    """Splits a row's streamed text into content and tool calls (emitter-side):
    the family's blocks of calls are lifted out; a block whose calls do not all
    read (a call cut short, an unknown function, arguments that break the tool's
    schema) stays text, as the model wrote it."""

    format: ToolFormat = GENERIC
    tools: Any = None  # the request's tools, with their full schemas
    text: str = ""  # held back: a possible tag start, or an open block
    inside: bool = False
    calls: int = 0
    cut: str | None = None  # the body of a block the row ended inside, dropped
    shown: bool = False  # content has been shown (a whole-answer family: not a call)

    def feed(
        self, piece: str, *, final: bool = False, cut: bool = False
    ) -> tuple[str, list[ToolCall]]:
        """Content and calls that can be shown now. ``final``: the row's text is
        all in; ``cut``: it ended at max_tokens, so a block open at its end, or
        an opening tag begun there, is a call cut short, not text."""
        self.text += piece
        if not self.format.open:
            return self._whole(final, cut)
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
            end = self.text.find(closing or opening)
            if end < 0 and closing == "" and final and not cut:
                end = len(self.text)  # a block with no closing tag ends with the answer
            if end < 0:
                if final and cut:  # a block cut short (max_tokens): its whole calls are kept,
                    found.extend(self._whole_calls())  # the cut one is neither call nor text
                    self.text, self.inside = "", False
                elif final:  # the model ended inside a block: what it wrote is text
                    shown.append(opening + self.text)
                    self.text, self.inside = "", False
                break
            body, self.text = self.text[:end], self.text[end + len(closing) :]
            self.inside = False
            calls = self._parse(body)
            shown.append(opening + body + closing if calls is None else "")
            found.extend(calls or ())
        return "".join(shown), found

    def _whole_calls(self) -> list[ToolCall]:
        """The calls whole in a block ``max_tokens`` cut (where the family's blocks
        hold several); what follows the last is the cut call, kept in ``cut``."""
        each = self.format.family.each
        at = self.text.rfind(each) if each else -1
        calls = self._parse(self.text[: at + len(each)]) if at >= 0 else None
        self.cut = self.text if calls is None else self.text[at + len(each) :]
        return calls or []

    def _whole(self, final: bool, cut: bool) -> tuple[str, list[ToolCall]]:
        """A family whose calls are the whole answer (Llama 3's JSON): text that
        starts like a call is held to the end, then read; any other is content."""
        if self.shown or not _may_be_a_call(self.text.lstrip()):
            self.shown, out, self.text = True, self.text, ""
            return out, []
        if not final:
            return "", []
        body, self.text = self.text, ""
        calls_text = body.strip().removeprefix("<|python_tag|>")
        if cut:  # the calls whole before the cut are the answer's; the cut one is dropped
            found, rest = complete_objects(calls_text)
            calls = self._read(found)
            self.cut = body if calls is None else rest
            return "", calls or []
        calls = self._parse(calls_text)
        return (body, []) if calls is None else ("", calls)

    def _parse(self, body: str) -> list[ToolCall] | None:
        parse = self.format.family.parse
        if parse is None:  # Harmony: its calls are messages, read by their channels
            return None
        try:
            found = parse(body, list(self.tools or ()))
        except Exception:  # a parser's own error: the text stays text
            return None
        return self._read(found)

    def _read(self, found: Sequence) -> list[ToolCall] | None:
        """The calls parsed, checked against the request's tools; None where
        there is none or one does not meet its tool."""
        calls = [self.checked(name, args) for name, args in found]
        if not calls or None in calls:
            return None
        self.calls += len(calls)
        return calls

    def checked(self, name: Any, args: Any) -> ToolCall | None:
        """A call, where its function is one of the request's and its arguments
        (JSON text, or a value to write as JSON) meet that tool's schema."""
        if not isinstance(name, str):
            return None
        if not isinstance(args, str):
            try:
                args = json.dumps(args, allow_nan=False)
            except (TypeError, ValueError):  # a number no JSON can carry
                return None
        if not meets_schema(self.tools or (), name, args):
            return None
        return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, args)

    def harmony_call(self, name: str, body: str) -> ToolCall | None:
        """A Harmony message to ``functions.name`` (its body the JSON arguments)."""
        call = self.checked(name, body.strip())
        self.calls += call is not None
        return call


def _may_be_a_call(start: str) -> bool:
    """Whether an answer beginning ``start`` may be a Llama 3 call (JSON, perhaps
    after ``<|python_tag|>``), so far."""
    tag = "<|python_tag|>"
    return start == "" or start.startswith(("{", tag)) or tag.startswith(start[: len(tag)])


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
