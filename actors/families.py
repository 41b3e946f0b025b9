"""Tool-call families: each model family's own call markup, read and constrained.

A family is known by its chat template (:func:`family_of`). For each, the text
a model writes is cut into *blocks* between the family's ``open`` and ``close``
markers (a ``close`` of ``""``: a block runs to the next ``open`` or to the end
of the answer), and a block's calls are read by ``parse`` into ``(name,
arguments)``, the arguments as JSON text: written through verbatim where the
model wrote JSON, made from the values where it wrote XML. A family's ``grammar``
is the llguidance lark grammar that ``tool_choice: required`` or a named function
holds the answer to: its own markup, with its markers as the special tokens they
are, and the tools' schemas in the arguments; so a model keeps the syntax it was
trained on.

=============  ==============================================  ==============
family         a call                                          parser
=============  ==============================================  ==============
hermes         ``<tool_call>{"name":..,"arguments":..}</tool_call>``  ours
qwen3_coder    ``<tool_call><function=N><parameter=K>V</parameter>``  mlx-lm's
glm            ``<tool_call>N<arg_key>K</arg_key><arg_value>V..``     ours
minimax        ``<minimax:tool_call><invoke name="N"><parameter..``   ours
kimi           ``<|tool_call_begin|>functions.N:0<|tool_call_argument_begin|>{}``  ours
deepseek       ``tool call begin``, N, ``tool sep``, ``{}`` (fullwidth-bar tokens)  ours
mistral        ``[TOOL_CALLS]N[ARGS]{}``                                ours
llama3         the whole answer: ``{"name": N, "parameters": {}}``    ours
harmony        ``<|start|>assistant to=functions.N<|channel|>commentary json<|message|>{}``
=============  ==============================================  ==============

mlx-lm's GLM and MiniMax parsers strip a string value's blank space: a file a
coding agent writes would lose its trailing newline, so ours keep a declared
string exactly as written.

Harmony (gpt-oss) is a stream of channel messages rather than tagged blocks:
:class:`HarmonySplitter` reads it whole (analysis is reasoning, final and plain
commentary are content, a message to ``functions.N`` is a call).
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

Parsed = list[tuple[str, Any]]  # (name, arguments: JSON text, or a value to write as JSON)


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


DECODER = json.JSONDecoder(parse_constant=_not_json)  # strict: no NaN, no Infinity


def json_object_at(text: str, at: int = 0) -> tuple[str, dict, int]:
    """The JSON object starting at ``text[at:]`` (leading whitespace skipped):
    as the model wrote it, decoded, and where it ends; ValueError where there is
    none."""
    start = len(text) - len(text[at:].lstrip())
    value, end = DECODER.raw_decode(text, start)
    if not isinstance(value, dict):
        raise ValueError("the arguments are not a JSON object")
    return text[start:end], value, end


# -- what the parsers share ----------------------------------------------------


def _mlx_lm(module: str) -> Callable[[str, Sequence], Parsed]:
    """mlx-lm's parser of that name: its one call or list of calls, as pairs."""

    def parse(body: str, tools: Sequence) -> Parsed:
        from importlib import import_module

        return _pairs(import_module(f"mlx_lm.tool_parsers.{module}").parse_tool_call(body, tools))

    return parse


def _pairs(found: Any) -> Parsed:
    found = found if isinstance(found, list) else [found]
    return [(c["name"], c.get("arguments", {})) for c in found]


def _covering(pattern: re.Pattern, text: str) -> list[re.Match]:
    """The matches of ``pattern`` that, with blank space between them, are all
    of ``text``; ValueError where anything else is there."""
    found, at = [], 0
    for match in pattern.finditer(text):
        if text[at : match.start()].strip():
            raise ValueError("text between the parts of a block")
        found.append(match)
        at = match.end()
    if text[at:].strip():
        raise ValueError("text after the parts of a block")
    return found


def _parse_pairs(pattern: re.Pattern, name_of: Callable[[str], str]) -> Callable:
    """Blocks holding one or more ``pattern`` matches, each (name part, JSON)."""

    def parse(body: str, tools: Sequence) -> Parsed:
        found = [(name_of(m.group(1)), _whole_json(m.group(2))) for m in _covering(pattern, body)]
        if not found:
            raise ValueError("not a block of calls")
        return found

    return parse


def _whole_json(text: str) -> str:
    args, _, end = json_object_at(text)
    if text[end:].strip():
        raise ValueError("text after the arguments")
    return args


def _objects(text: str, key: str, separators: str) -> Any:
    """Each call object ``{"name": N, key: {..}}`` of ``text`` in turn (between
    them only whitespace and ``separators``): (name, arguments as written) and
    where the object ends; ValueError at one that does not read."""
    at = 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at == len(text):
            return
        whole, obj, end = json_object_at(text, at)
        name, args = obj.get("name"), obj.get(key, obj.get("arguments", {}))
        extra = set(obj) - {"name", key, "arguments"}
        if not isinstance(name, str) or not isinstance(args, dict) or extra:
            raise ValueError("not a call object")
        yield (name, _value_text(whole, key if key in obj else "arguments")), end
        at = end


def _parse_objects(body: str, key: str, separators: str = ";") -> Parsed:
    """JSON call objects one after another: their arguments as written."""
    found = [call for call, _ in _objects(body.strip(), key, separators)]
    if not found:
        raise ValueError("no call")
    return found


def complete_objects(
    body: str, key: str = "parameters", separators: str = ";"
) -> tuple[Parsed, str]:
    """An answer of call objects (Llama 3's) that ``max_tokens`` cut short: the
    whole objects before the cut, and the rest (the one being written)."""
    text, found, rest = body.strip(), [], 0
    with contextlib.suppress(ValueError):  # the cut object (json's errors are ValueErrors)
        for call, end in _objects(text, key, separators):
            found.append(call)
            rest = end
    return found, text[rest:].lstrip(separators + " \n\t")


def _value_text(whole: str, key: str) -> str:
    """The value of ``key`` in the JSON object ``whole``, as written."""
    at = 1
    while True:
        k, at = DECODER.raw_decode(whole, len(whole) - len(whole[at:].lstrip()))
        at = whole.index(":", at) + 1
        start = len(whole) - len(whole[at:].lstrip())
        _, end = DECODER.raw_decode(whole, start)
        if k == key:
            return whole[start:end]
        at = whole.index(",", end) + 1


def _xml_value(text: str, name: str, key: str, tools: Sequence) -> Any:
    """A parameter's value as written in XML: raw text where the tool declares a
    string (exactly: a file's trailing newline is the file's), else JSON (and the
    text itself where it is not JSON: the schema check then judges it)."""
    for tool in tools:
        if tool.get("function", {}).get("name") == name:
            prop = (_params(tool).get("properties") or {}).get(key) or {}
            if prop.get("type") == "string":
                return text
    try:
        return DECODER.decode(text)
    except ValueError:
        return text


def _xml_pairs(text: str, pattern: re.Pattern, name: str, tools: Sequence) -> dict:
    """Key-value pairs that are all of ``text`` (but blank space)."""
    return {m.group(1): _xml_value(m.group(2), name, m.group(1), tools)
            for m in _covering(pattern, text)}  # fmt: skip


# -- what the grammars share ---------------------------------------------------

Lit = Callable[[str], str]  # a marker as a lark terminal: its special token, or its text


def _quoted(text: str) -> str:
    return json.dumps(text)


def _params(tool: Mapping) -> Mapping:
    return tool["function"].get("parameters") or {"type": "object"}


def guided(schema: Mapping, spaced: bool = True) -> dict:
    """``schema`` with no free whitespace for a model to loop on: compact, or
    spaced as templates write earlier calls (``tojson``: ``", "`` and ``": "``),
    which is what a model trained on them writes."""
    flags = {"whitespace_flexible": False}
    if spaced:
        flags |= {"item_separator": ", ", "key_separator": ": "}
    return {"x-guidance": flags, **schema}


def _json(schema: Mapping) -> str:
    return f"%json {json.dumps(guided(schema))}"


def _xml_params(tool: Mapping, one: Callable[[str, Mapping], str]) -> str:
    """A tool's parameters in XML, declared order, the optional ones optional."""
    schema = _params(tool)
    required = set(schema.get("required", ()))
    props = schema.get("properties") or {}
    parts = [f"({one(k, s)})" + ("" if k in required else "?") for k, s in props.items()]
    return " ".join(parts) or '""'


def _regex(body: str) -> str:
    """A lark regex literal of ``body`` (a Python regex)."""
    return "/" + body.replace("/", "\\/") + "/"


def _raw(schema: Mapping, until: str) -> str | None:
    """A plain string value written raw, then ``until``: one lark regex (so the
    value cannot swallow its closing text); None where the schema wants JSON."""
    plain = {"type", "description", "minLength", "maxLength", "title"}
    if schema.get("type") != "string" or set(schema) - plain:
        return None
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    count = f"{{{lo},{hi}}}" if hi is not None else (f"{{{lo},}}" if lo else "*")
    return _regex(f"[^<]{count}" + "".join("\\n" if c == "\n" else re.escape(c) for c in until))


def _xml_param(head: str, schema: Mapping, closing: str) -> str:
    """One XML parameter: its ``head``, its value (raw, or JSON), ``closing``."""
    raw = _raw(schema, closing)
    return f"{head} {raw}" if raw else f"{head} {_json(schema)} {_quoted(closing)}"


def _call_object(tool: Mapping, key: str) -> dict:
    """One call as a JSON object: ``{"name": N, key: {its arguments}}``."""
    return {"type": "object", "properties": {"name": {"const": _name(tool)}, key: _params(tool)},
            "required": ["name", key], "additionalProperties": False}  # fmt: skip


def _name(tool: Mapping) -> str:
    return tool["function"]["name"]


def _rules(calls: Sequence[str], parallel: bool, joiner: str = "") -> str:
    more = f"({joiner} call)*" if parallel else ""
    return f"start: call {more}\ncall: {' | '.join(f'({c})' for c in calls)}\n"


def _section(opening: str, calls: Sequence[str], closing: str, parallel: bool) -> str:
    """Calls inside one block between ``opening`` and ``closing`` markers."""
    more = "+" if parallel else ""
    return (f"start: {opening} (call){more} {closing}\n"
            f"call: {' | '.join(f'({c})' for c in calls)}\n")  # fmt: skip


# -- each family's parser and grammar: Hermes ----------------------------------


def _parse_hermes(body: str, tools: Sequence) -> Parsed:
    return _parse_objects(body, "arguments", separators="")


def hermes_schema(tools: Sequence) -> dict:
    """One Hermes call ``{"name", "arguments"}`` to any of ``tools``."""
    one = [_call_object(t, "arguments") for t in tools]
    return one[0] if len(one) == 1 else {"anyOf": one}


def _hermes(tools: Sequence, parallel: bool, lit: Lit) -> str:
    """A newline on each side of the JSON, as the template writes them (either
    may be left out)."""
    more = "+" if parallel else ""
    call = f'{lit("<tool_call>")} "\\n"? obj "\\n"? {lit("</tool_call>")}'
    return f"start: call{more}\ncall: {call}\nobj: {_json(hermes_schema(tools))}\n"


# -- Qwen3-Coder (mlx-lm's parser) ---------------------------------------------


def _qwen3_coder(tools: Sequence, parallel: bool, lit: Lit) -> str:
    def param(key: str, schema: Mapping) -> str:
        return _xml_param(_quoted(f"<parameter={key}>\n"), schema, "\n</parameter>\n")

    def call(tool: Mapping) -> str:
        head = _quoted("\n<function=" + _name(tool) + ">\n")
        body = f'{_xml_params(tool, param)} "</function>\\n"'
        return f"{lit('<tool_call>')} {head} {body} {lit('</tool_call>')}"

    return _rules([call(t) for t in tools], parallel, joiner='"\\n"')


# -- GLM -----------------------------------------------------------------------

_GLM = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _parse_glm(body: str, tools: Sequence) -> Parsed:
    """``NAME`` then ``<arg_key>K</arg_key><arg_value>V</arg_value>`` pairs (with
    newlines between them in GLM-4.5/4.6, none in 4.7)."""
    name, _, rest = body.partition("<arg_key>")
    name = name.strip()
    if not name or "<" in name:
        raise ValueError("not a GLM call")
    return [(name, _xml_pairs("<arg_key>" + rest if rest else "", _GLM, name, tools))]


def _glm(tools: Sequence, parallel: bool, lit: Lit) -> str:
    def param(key: str, schema: Mapping) -> str:
        head = f'{lit("<arg_key>")} {_quoted(key)} {lit("</arg_key>")} "\\n" {lit("<arg_value>")}'
        return f'{head} {_raw(schema, "") or _json(schema)} {lit("</arg_value>")} "\\n"'

    calls = [f'{lit("<tool_call>")} {_quoted(_name(t) + chr(10))} {_xml_params(t, param)} '
             f'{lit("</tool_call>")}' for t in tools]  # fmt: skip
    return _rules(calls, parallel, joiner='"\\n"')


# -- MiniMax -------------------------------------------------------------------

_MINIMAX_INVOKE = re.compile(r'\s*<invoke name="([^"]+)">(.*?)</invoke>', re.S)

_MINIMAX_PARAM = re.compile(r'\s*<parameter name="([^"]+)">(.*?)</parameter>', re.S)


def _parse_minimax(body: str, tools: Sequence) -> Parsed:
    """``<invoke name="N"><parameter name="K">V</parameter>...</invoke>``, one or more."""
    found = [(m.group(1), _xml_pairs(m.group(2), _MINIMAX_PARAM, m.group(1), tools))
             for m in _covering(_MINIMAX_INVOKE, body)]  # fmt: skip
    if not found:
        raise ValueError("not a MiniMax block")
    return found


def _minimax(tools: Sequence, parallel: bool, lit: Lit) -> str:
    """Every call in one block: ``<invoke>`` after ``<invoke>``."""

    def param(key: str, schema: Mapping) -> str:
        return _xml_param(_quoted(f'<parameter name="{key}">'), schema, "</parameter>\n")

    def call(tool: Mapping) -> str:
        head = _quoted('<invoke name="' + _name(tool) + '">\n')
        return f'{head} {_xml_params(tool, param)} "</invoke>\\n"'

    calls = [call(t) for t in tools]
    return _section(lit("<minimax:tool_call>") + ' "\\n"', calls, lit("</minimax:tool_call>"),
                    parallel)  # fmt: skip


# -- Kimi ----------------------------------------------------------------------


def _kimi_name(head: str) -> str:
    match = re.fullmatch(r"\s*(?:functions\.)?(.+?):\d+\s*", head)
    if match is None:
        raise ValueError("not a Kimi call id")
    return match.group(1)


def _kimi(tools: Sequence, parallel: bool, lit: Lit) -> str:
    calls = [f"{lit('<|tool_call_begin|>')} {_quoted(f'functions.{_name(t)}:')} "
             f"{_regex('[0-9]{1,2}')} {lit('<|tool_call_argument_begin|>')} {_json(_params(t))} "
             f"{lit('<|tool_call_end|>')}" for t in tools]  # fmt: skip
    return _section(lit("<|tool_calls_section_begin|>"), calls, lit("<|tool_calls_section_end|>"),
                    parallel)  # fmt: skip


# -- DeepSeek ------------------------------------------------------------------


def _deepseek(tools: Sequence, parallel: bool, lit: Lit) -> str:
    calls = [f"{lit('<｜tool▁call▁begin｜>')} {_quoted(_name(t))} {lit('<｜tool▁sep｜>')} "
             f"{_json(_params(t))} {lit('<｜tool▁call▁end｜>')}" for t in tools]  # fmt: skip
    return _section(lit("<｜tool▁calls▁begin｜>"), calls, lit("<｜tool▁calls▁end｜>"), parallel)


# -- Mistral -------------------------------------------------------------------


def _parse_mistral(body: str, tools: Sequence) -> Parsed:
    """``NAME[ARGS]{...}`` (Devstral, Mistral Small 3.2), or the older list
    ``[{"name": .., "arguments": {..}}]``."""
    if body.lstrip().startswith("["):
        return _parse_objects(body, "arguments", separators="[],")
    match = re.match(r"\s*([\w.-]+)\s*\[ARGS\]", body)
    if match is None:
        raise ValueError("not a Mistral call")
    return [(match.group(1), _whole_json(body[match.end() :]))]


def _mistral(tools: Sequence, parallel: bool, lit: Lit) -> str:
    calls = [f"{lit('[TOOL_CALLS]')} {_quoted(_name(t))} {lit('[ARGS]')} {_json(_params(t))}"
             for t in tools]  # fmt: skip
    return _rules(calls, parallel)


# -- Llama 3 -------------------------------------------------------------------


def _parse_llama3(body: str, tools: Sequence) -> Parsed:
    return _parse_objects(body, "parameters")


def _llama3(tools: Sequence, parallel: bool, lit: Lit) -> str:
    return _rules([_json(_call_object(t, "parameters")) for t in tools], parallel,
                  joiner='"; "')  # fmt: skip


# -- Harmony's calls (its messages: HarmonySplitter, below) --------------------


def _harmony(tools: Sequence, parallel: bool, lit: Lit) -> str:
    """One call (a Harmony call ends the answer: ``<|call|>`` is an end token),
    as the template writes one after the generation prompt's ``<|start|>assistant``."""
    calls = [f"{_quoted(f' to=functions.{_name(t)}')} {lit('<|channel|>')} "
             f'"commentary json" {lit("<|message|>")} {_json(_params(t))} {lit("<|call|>")}'
             for t in tools]  # fmt: skip
    return _rules(calls, False)


# -- the families -------------------------------------------------------------


@attrs.frozen
class Family:
    name: str
    open: str  # a block of calls opens with this (``""``: the whole answer is one)
    close: str  # and closes with this (``""``: at the next ``open``, or the end)
    # A block's calls (None: Harmony, whose messages ``HarmonySplitter`` reads).
    parse: Callable[[str, Sequence], Parsed] | None = attrs.field(repr=False)
    # The lark grammar of ``required`` calls (None: a family mlx-lm reads that we
    # cannot constrain: such calls are asked for in the generic format).
    grammar: Callable[[Sequence, bool, Lit], str] | None = attrs.field(repr=False)
    marks: tuple[str, ...] = ()  # all of these in a chat template: this family
    think: tuple[str, str] | None = None  # reasoning markers the tokenizer may not name
    # How the template wants earlier calls' arguments: as objects, or as text.
    arguments_as_text: bool = False
    # Where a block holds several calls: what ends one (a block cut by max_tokens
    # keeps the calls whole before the cut).
    each: str = ""


FAMILIES = (
    Family("harmony", "", "", None, _harmony, ("<|channel|>", "<|start|>functions.")),
    Family(
        "qwen3_coder",
        "<tool_call>",
        "</tool_call>",
        _mlx_lm("qwen3_coder"),
        _qwen3_coder,
        ("<function=", "<parameter="),
    ),
    Family("glm", "<tool_call>", "</tool_call>", _parse_glm, _glm, ("<arg_key>",)),
    Family(
        "minimax",
        "<minimax:tool_call>",
        "</minimax:tool_call>",
        _parse_minimax,
        _minimax,
        ("<minimax:tool_call>",),
        each="</invoke>",
    ),
    Family(
        "kimi",
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        _parse_pairs(
            re.compile(
                r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>"
                r"(.*?)<\|tool_call_end\|>",
                re.S,
            ),
            _kimi_name,
        ),
        _kimi,
        ("<|tool_calls_section_begin|>",),
        each="<|tool_call_end|>",
    ),
    Family(
        "deepseek",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        _parse_pairs(
            re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.S),
            str.strip,
        ),
        _deepseek,
        ("<｜tool▁calls▁begin｜>",),
        arguments_as_text=True,
        each="<｜tool▁call▁end｜>",
    ),
    Family(
        "mistral",
        "[TOOL_CALLS]",
        "",
        _parse_mistral,
        _mistral,
        ("[TOOL_CALLS]",),
        think=("[THINK]", "[/THINK]"),
    ),
    Family("llama3", "", "", _parse_llama3, _llama3, ("<|start_header_id|>", "ipython")),
    Family(
        "hermes",
        "<tool_call>",
        "</tool_call>",
        _parse_hermes,
        _hermes,
        ("<tool_call>", "tool_call.name"),
    ),
)
BY_NAME = {f.name: f for f in FAMILIES}


@functools.lru_cache(maxsize=16)
def family_for(template: str | None) -> Family | None:
    """The family whose marks the chat template holds (None: a template without
    tool markup of its own, served in the generic format)."""
    if not isinstance(template, str):
        return None
    return next((f for f in FAMILIES if all(m in template for m in f.marks)), None)


def family_of(tokenizer: Any) -> Family | None:
    """The tokenizer's family: one of ours by its template, else the one mlx-lm
    recognises (Gemma 4, LFM2's pythonic calls...), read by mlx-lm's parser and
    with no grammar of its own (None: neither)."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        template = getattr(getattr(tokenizer, "_tokenizer", None), "chat_template", None)
    found = family_for(template if isinstance(template, str) else None)
    if found is not None or not getattr(tokenizer, "has_tool_calling", False):
        return found
    return _mlx_lm_family(tokenizer.tool_parser, tokenizer.tool_call_start, tokenizer.tool_call_end)


@functools.lru_cache(maxsize=16)
def _mlx_lm_family(parser: Callable, start: str, end: str) -> Family:
    def parse(body: str, tools: Sequence) -> Parsed:
        return _pairs(parser(body, list(tools)))

    name = getattr(parser, "__module__", "mlx_lm").rsplit(".", 1)[-1]
    return Family(name, start, end or "", parse, None)


def literal(tokenizer: Any) -> Lit:
    """Markers as lark terminals for this tokenizer: a marker that is one special
    token is that token (a text literal would never match it: the model writes
    the token, not its bytes), any other its text."""
    added = {}
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    with contextlib.suppress(AttributeError):
        added = {t.content: i for i, t in hf.added_tokens_decoder.items()}

    def lit(marker: str) -> str:
        return f"<[{added[marker]}]>" if marker in added else _quoted(marker)

    return lit


# -- Harmony --------------------------------------------------------------------

_HEADER = re.compile(
    r"^\s*(?:to=(?P<to>\S+?))?\s*(?:<\|channel\|>(?P<channel>\w+))?"
    r"\s*(?:to=(?P<to2>\S+?))?\s*(?:<\|constrain\|>)?\s*(?P<kind>\w+)?\s*$",
    re.S,
)


@attrs.define
class HarmonySplitter:
    """Splits a gpt-oss answer into content, reasoning and calls as it streams.
    The answer is messages, each a header (``<|channel|>analysis``, ``
    to=functions.N<|channel|>commentary json``...) then ``<|message|>`` and a
    body to ``<|end|>`` (``<|call|>`` and ``<|return|>`` end the answer: they are
    end tokens, never text). A header that never reaches ``<|message|>`` is
    text, as is a body whose header has no channel."""

    parse_call: Callable[[str, str], Any]  # (name, JSON body) -> a call, or None
    text: str = ""
    in_body: bool = False
    channel: str | None = None
    recipient: str | None = None
    body: str = ""
    head: str = ""  # the open message's header, as written
    calls: int = 0
    cut: str | None = None

    def feed(self, piece: str, *, final: bool = False, cut: bool = False) -> tuple[str, str, list]:
        self.text += piece
        content, reasoning, calls = [], [], []
        while True:
            if not self.in_body:
                at = self.text.find("<|message|>")
                if at < 0:
                    if final and cut:  # cut short (max_tokens) in a header: dropped
                        self.cut, self.text = self.text, ""
                    elif final:  # a header that never reached a body: text
                        content.append(self.text)
                        self.text = ""
                    break
                head, self.text = self.text[:at], self.text[at + len("<|message|>") :]
                self._header(head.removeprefix("<|start|>"))
                self.head = head + "<|message|>"
                self.in_body = True
            end = self.text.find("<|end|>")
            if end < 0:
                if not final:
                    keep = held_prefix(self.text, "<|end|>")
                    self._body(self.text[: len(self.text) - keep], content, reasoning)
                    self.text = self.text[len(self.text) - keep :]
                    break
                self._body(self.text, content, reasoning)
                self.text = ""
                self._close(content, calls, cut)
                break
            self._body(self.text[:end], content, reasoning)
            self.text = self.text[end + len("<|end|>") :].removeprefix("<|start|>")
            self._close(content, calls, False)
        return "".join(content), "".join(reasoning), calls

    def _header(self, head: str) -> None:
        match = _HEADER.match(head.removeprefix("assistant"))
        self.channel = match.group("channel") if match else None
        to = match and (match.group("to") or match.group("to2"))
        self.recipient = to or None
        self.body = ""

    def _body(self, text: str, content: list, reasoning: list) -> None:
        if self.recipient:
            self.body += text  # a call's arguments: whole, at its end
        elif self.channel == "analysis":
            reasoning.append(text)
        else:
            content.append(text)

    def _close(self, content: list, calls: list, cut: bool) -> None:
        if self.recipient:
            if cut:
                self.cut = self.body
            else:
                name = self.recipient.removeprefix("functions.")
                call = (
                    self.parse_call(name, self.body)
                    if self.recipient.startswith("functions.")
                    else None
                )
                if call is None:  # not a call after all: the message as written
                    content.append(self.head + self.body)
                else:
                    self.calls += 1
                    calls.append(call)
        self.in_body, self.channel, self.recipient, self.body = False, None, None, ""


# gpt-oss's published template writes a tool's result as a JSON string (quoted, its
# newlines escaped); Harmony, which the model was trained on and OpenAI's renderer
# writes, has the result as it is.
_TOOL_RESULT_AS_JSON = re.compile(
    r'(to=assistant<\|channel\|>commentary<\|message\|>"\s*\+\s*message\.content)\s*\|\s*tojson'
)


def harmony_template(template: str) -> str:
    """gpt-oss's chat template rendering what OpenAI's Harmony renderer does
    (``openai-harmony``, held to it in tests/test_harmony.py); any other
    template as it is."""
    return _TOOL_RESULT_AS_JSON.sub(r"\1", template)


def held_prefix(text: str, tag: str) -> int:
    """How many of ``text``'s last characters could begin ``tag`` (to hold back)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
