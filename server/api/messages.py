"""Anthropic Messages (``POST /v1/messages``): translation only, no I/O.

Request in: ``system``, content blocks (``text``, ``image`` (base64, in user
turns and tool results), ``tool_use``, ``tool_result``), ``tools`` /
``tool_choice``, ``stop_sequences``, ``max_tokens``, sampling fields (older
clients still send them in the body), ``output_config.format`` (a JSON schema,
through the constrained decoding) and ``thinking``; out: the engine's chat
messages and parameters, the same ones the OpenAI routes produce. Engine results
and events in: Anthropic's message and its stream events out. ``cache_control``
blocks are accepted: the prompt cache keeps
prefixes by itself, so they are a hint with nothing to add.

Two things Claude Code sends would make each of its conversations and sub-agents
diverge from its siblings early, so that none shares the prompt cache past them
(``docs/clients.md`` has the traffic); unless ``--prompt-as-sent``:

- its system prompt opens with an attribution block,
  ``x-anthropic-billing-header: cc_version=2.1.197.1a2; cc_entrypoint=cli;``,
  whose last three hex digits hash the conversation's first user message (a
  sub-agent's adds `` cc_is_subagent=true;``). Anthropic's API reads it as
  billing metadata, not prompt. That block, the first of ``system`` and exactly
  of :data:`ATTRIBUTION`'s form, is dropped;
- the list of agent types and skills (5-6 kB, the same for every conversation)
  comes as a system turn after the first user message. System turns before the
  first answer join the system prompt, ahead of the first user message (as
  every chat template accepts a system message: first). A conversation's later
  requests move the same turns, so they still extend its earlier ones.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import attrs
from mlx_nursery.actors import ContextOverflow, Event, FinishReason, Result, Usage
from mlx_nursery.actors.request import Priority

from .base import (
    PRIORITY_HEADER,
    Api,
    ApiError,
    Parsed,
    RawJson,
    Served,
    Shaper,
    bad,
    check_bool,
    image_part,
    joined,
    json_schema_format,
    model_of,
    new_id,
    object_body,
    refuse_unknown,
    request_of,
    sse_event,
)

# Honoured (docs/http.md has the table). temperature, top_p and top_k are no
# longer in the reference, but older clients send them and they mean what they say.
HONOURED = frozenset((
    "model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k",
    "stop_sequences", "stream", "tools", "tool_choice", "metadata", "thinking",
    "output_config", "speculative",
))  # fmt: skip
# Documented (the betas included) with no meaning here: accepted, ignored. MCP
# servers are remote tools this server cannot run: listed as left out.
IGNORED = frozenset((
    "service_tier", "cache_control", "container", "diagnostics", "inference_geo", "speed",
    "user_profile_id", "workspace_id", "context_management", "betas", "billing_policy",
    "compaction", "fallback_credit_token", "fallbacks", "mcp_servers", "thread",
))  # fmt: skip
_FIELDS = HONOURED | IGNORED

# Claude Code's attribution line, as its code writes it: the version with the
# message hash, the entry point, then the optional fields in their fixed order.
ATTRIBUTION = re.compile(
    r"x-anthropic-billing-header: cc_version=[0-9A-Za-z.+-]+; cc_entrypoint=[\w.-]+;"
    r"(?: cch=[0-9a-f]+;)?(?: cc_workload=[\w.-]+;)?(?: cc_is_subagent=true;)?"
)
# A Claude Code sub-agent's requests carry its agent's id (and, where the
# attribution line is on, ``cc_is_subagent=true;``).
AGENT_ID_HEADER = "x-claude-code-agent-id"
CLAUDE_CODE_SESSION = "x-claude-code-session-id"
# What the intake changed in a prompt (``Parsed.adjusted``), as /stats counts it.
DROPPED_ATTRIBUTION = "claude_code_attribution_dropped"
SYSTEM_FIRST = "early_system_turns_moved_first"

STOP_REASONS = {
    FinishReason.STOP: "end_turn",
    FinishReason.LENGTH: "max_tokens",
    FinishReason.TOOL_CALLS: "tool_use",
}

# Anthropic's error type and status for each of ours (429, a full queue, is its 529).
_ERRORS = {
    400: ("invalid_request_error", 400),
    401: ("authentication_error", 401),
    404: ("not_found_error", 404),
    408: ("timeout_error", 408),
    403: ("permission_error", 403),
    413: ("request_too_large", 413),
    429: ("overloaded_error", 529),
    503: ("overloaded_error", 529),
}


def error_body(err: ApiError) -> tuple[dict, int]:
    kind, status = _ERRORS.get(err.status, ("api_error", 500 if err.status >= 500 else 400))
    return {"type": "error", "error": {"type": kind, "message": err.message}}, status


def _text(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad(f"{where} must be a string or a list of text blocks", "messages")
    out = []
    for block in blocks:
        if not isinstance(block, Mapping) or block.get("type") != "text":
            raise bad(f"{where}: only text blocks are allowed here", "messages")
        out.append(str(block.get("text", "")))
    return "".join(out)


def _image(block: Mapping[str, Any], where: str) -> dict:
    """An image block (a base64 source) as the engine's image part."""
    source = block.get("source")
    if not isinstance(source, Mapping) or source.get("type") != "base64":
        kind = source.get("type") if isinstance(source, Mapping) else None
        raise bad(f"{where}: image source {kind!r} is not read by this server: send the image "
                  "inline (source type 'base64'), or start the server with --image-urls",
                  "messages")  # fmt: skip
    return image_part(source.get("data"), source.get("media_type"), where)


def _result_content(content: Any, where: str) -> str | list[dict]:
    """A tool result's content: its text, and its images where it holds some (a
    screenshot, a PNG a Read tool opened); another kind of block is named in its
    place, since this server reads text and images."""
    if isinstance(content, str) or content is None:
        return content or ""
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of blocks", "messages")
    out = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "image":
            out.append(_image(block, f"{where}.content[{j}]"))
        else:
            text = str(block.get("text", "")) if kind == "text" else f"[{kind} omitted]"
            out.append({"type": "text", "text": text})
    return joined(out)


# Blocks of the server tools' own turns (web search and the like): nothing to render.
_SERVER_BLOCKS = ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                  "code_execution_tool_result", "bash_code_execution_tool_result",
                  "text_editor_code_execution_tool_result", "mcp_tool_use", "mcp_tool_result",
                  "container_upload", "tool_search_tool_result")  # fmt: skip


def _message(i: int, m: Any) -> list[dict]:
    """One Anthropic message as the engine's chat messages."""
    if not isinstance(m, Mapping) or m.get("role") not in ("user", "assistant", "system"):
        raise bad(f"messages[{i}] needs role 'user', 'assistant' or 'system'", "messages")
    if m["role"] == "system":  # mid-conversation system text: a system turn where it stands
        return [{"role": "system", "content": _text(m.get("content", ""), f"messages[{i}]")}]
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise bad(f"messages[{i}].content must be a string or a list of blocks", "messages")
    text, calls, results, thought = [], [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, Mapping) else None
        where = f"messages[{i}].content[{j}]"
        if kind == "text":
            text.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "image" and m["role"] == "user":
            text.append(_image(block, where))
        elif kind == "tool_use" and m["role"] == "assistant":
            args = json.dumps(block.get("input") or {})
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": args}})  # fmt: skip
        elif kind == "tool_result" and m["role"] == "user":
            body = _result_content(block.get("content", ""), where)
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": body})  # fmt: skip
        elif kind == "thinking" and m["role"] == "assistant":
            thought.append(str(block.get("thinking", "")))  # the template keeps or drops it
        elif (
            (kind == "redacted_thinking" and m["role"] == "assistant")
            or kind in _SERVER_BLOCKS
            or kind == "search_result"
        ):
            continue
        elif kind in ("image", "document"):
            raise bad(f"{where}: {kind} blocks are not read here: send images in user turns "
                      "(documents as text)", "messages")  # fmt: skip
        else:
            raise bad(f"{where}: block type {kind!r} is not supported here", "messages")
    out = [*results]
    if calls:
        out.append({"role": "assistant", "content": joined(text), "tool_calls": calls})
    elif text or not results:
        out.append({"role": m["role"], "content": joined(text)})
    if thought and out and out[-1]["role"] == "assistant":
        out[-1]["reasoning_content"] = "".join(thought)
    return out


def _tools(body: Mapping[str, Any], params: dict) -> tuple[str, ...]:
    """Custom tools (a name and an input schema) go to the engine as functions;
    Anthropic's own tools (server tools such as web search, and the versioned
    client tools whose schema is Anthropic's) and MCP servers are left out, and
    their names returned."""
    tools, ignored = body.get("tools"), []
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("'tools' must be a list", "tools")
        converted = []
        for i, t in enumerate(tools):
            if not isinstance(t, Mapping) or not isinstance(t.get("name"), str):
                raise bad(f"tools[{i}] needs a 'name'", "tools")
            if t.get("type") not in (None, "custom") or "input_schema" not in t:
                ignored.append(t["name"])
                continue
            converted.append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description", ""),
                "parameters": t.get("input_schema") or {"type": "object"}}})  # fmt: skip
        if converted:
            params["tools"] = converted
    for server in body.get("mcp_servers") or ():
        if isinstance(server, Mapping):
            ignored.append(f"mcp:{server.get('name', '?')}")
    choice = body.get("tool_choice")
    if choice is None:
        return tuple(ignored)
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        mapped = {"type": "function", "function": {"name": choice.get("name")}}
    if mapped is None:
        raise bad("tool_choice.type must be auto, any, tool or none", "tool_choice")
    if mapped != "none" or "tools" in params:
        params["tool_choice"] = mapped
    if choice.get("disable_parallel_tool_use"):
        params["parallel_tool_calls"] = False
    return tuple(ignored)


def _system(system: Any, as_sent: bool) -> tuple[str, tuple[str, ...]]:
    """The system text, and what was dropped from it: the attribution block,
    where it is the first block and nothing but the attribution line."""
    if as_sent or not isinstance(system, list) or not system:
        return _text(system, "system"), ()
    first = system[0]
    line = first.get("text") if isinstance(first, Mapping) and first.get("type") == "text" else None
    if isinstance(line, str) and ATTRIBUTION.fullmatch(line):
        return _text(system[1:], "system"), (DROPPED_ATTRIBUTION,)
    return _text(system, "system"), ()


def _system_first(
    chat: list[dict], system: str | None, move: bool
) -> tuple[list[dict], tuple[str, ...]]:
    """The conversation with the system prompt first, joined (where ``move``) by
    the system turns that come before the first answer, after a user turn."""
    answer = next((i for i, m in enumerate(chat) if m["role"] == "assistant"), len(chat))
    early = [i for i in range(answer) if chat[i]["role"] == "system"]
    moved = any(chat[j]["role"] != "system" for j in range(early[-1])) if early else False
    if not (moved and move):
        return ([{"role": "system", "content": system}] if system is not None else []) + chat, ()
    texts = [t for t in (system, *(chat[i]["content"] for i in early)) if t]
    rest = [m for i, m in enumerate(chat) if i not in early]
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest], (SYSTEM_FIRST,)


def claude_code_class(
    body: Mapping[str, Any], headers: Mapping[str, str] | None
) -> Priority | None:
    """The class Claude Code's traffic shows (None: not Claude Code's): a
    sub-agent's requests carry its agent id header, and ``cc_is_subagent=true;``
    in the attribution line where that is on; a request with no tools is
    background work (a title, a summary, the small/fast model's checks); the rest
    are the main agent's, which the person waits on."""
    lower = {k.lower(): v for k, v in (headers or {}).items()}
    if CLAUDE_CODE_SESSION not in lower and not lower.get("user-agent", "").startswith(
        "claude-cli"
    ):
        return None
    system = body.get("system")
    first = system[0] if isinstance(system, list) and system else None
    line = first.get("text") if isinstance(first, Mapping) else None
    if AGENT_ID_HEADER in lower or (
        isinstance(line, str) and ATTRIBUTION.fullmatch(line) and "cc_is_subagent=true;" in line
    ):
        return Priority.SUBAGENT
    return Priority.INTERACTIVE if body.get("tools") else Priority.BACKGROUND


def parse_messages(
    body: Any, headers: Mapping[str, str] | None = None, as_sent: bool = False
) -> Parsed:
    body = object_body(body)
    refuse_unknown(body, _FIELDS, "/v1/messages")
    if body.get("max_tokens") is None:
        raise bad("'max_tokens' is required", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    chat = [x for i, m in enumerate(messages) for x in _message(i, m)]
    system, adjusted = None, ()
    if body.get("system") is not None:
        system, adjusted = _system(body["system"], as_sent)
    chat, moved = _system_first(chat, system, move=not as_sent)
    adjusted += moved
    params: dict[str, Any] = {"max_tokens": body["max_tokens"]}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                         ("stop", "stop_sequences"), ("speculative", "speculative")):  # fmt: skip
        if body.get(theirs) is not None:
            params[ours] = body[theirs]
    ignored = _tools(body, params)
    config = body.get("output_config")
    if config is not None and not isinstance(config, Mapping):
        raise bad("output_config must be an object", "output_config")
    fmt = (config or {}).get("format")
    if fmt is not None:
        if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema":
            raise bad("output_config.format must be {type: json_schema, schema}", "output_config")
        params["response_format"] = json_schema_format(fmt.get("schema"))
    thinking = body.get("thinking")
    kind = thinking.get("type") if isinstance(thinking, Mapping) else None
    if thinking is not None and kind not in ("enabled", "disabled", "adaptive"):
        raise bad("thinking.type must be enabled, disabled or adaptive", "thinking")
    if kind in ("enabled", "disabled"):  # adaptive: the model decides (the template's default)
        params["chat_template_kwargs"] = {"enable_thinking": kind == "enabled"}
    # Claude Code asks for Claude models by name: the pool maps them (server/pool.py).
    stream, model = bool(check_bool(body, "stream")), model_of(body)
    fields = {"stop": "stop_sequences", "response_format": "output_config"}
    metadata = body.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, Mapping) else None
    fields["priority"] = PRIORITY_HEADER  # Anthropic's API has no field for it
    request = request_of(chat, params, headers, user, reading=claude_code_class(body, headers))
    return Parsed(request, stream, False, model, fields, ignored_tools=ignored, adjusted=adjusted)


def _message_id() -> str:
    return new_id("msg", "_")


def usage_body(usage: Usage | None, *, output: bool = True) -> dict:
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    out = {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }
    if output:
        out["output_tokens"] = usage.completion_tokens
    return out


def message_body(result: Result, model: str) -> dict:
    content: list[dict] = []
    if result.reasoning:
        content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
    if result.text:
        content.append({"type": "text", "text": result.text})
    for call in result.tool_calls:
        content.append({"type": "tool_use", "id": call.id.replace("call_", "toolu_"),
                        "name": call.name, "input": RawJson(call.arguments)})  # fmt: skip
    return {
        "id": _message_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": _stop_reason(result.finish_reason, result.stop_sequence),
        "stop_sequence": result.stop_sequence,
        "usage": usage_body(result.usage),
    }


def _stop_reason(reason: FinishReason, stop_sequence: str | None) -> str:
    if reason is FinishReason.STOP and stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(reason, "end_turn")


@attrs.define
class StreamShaper(Shaper):
    """One message's stream: content blocks opened and closed as the kind of text
    changes (thinking, text, tool_use), then message_delta and message_stop."""

    model: str
    prompt_tokens: int
    id: str = attrs.field(factory=_message_id)
    index: int = -1
    open_kind: str | None = None
    ping: bytes = sse_event("ping", {"type": "ping"})

    def start(self) -> bytes:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}  # fmt: skip
        return sse_event("message_start", {"type": "message_start", "message": message})

    def _block(self, kind: str, block: dict) -> bytes:
        out = self._close()
        self.index += 1
        self.open_kind = kind
        return out + sse_event(
            "content_block_start",
            {"type": "content_block_start", "index": self.index, "content_block": block},
        )

    def _close(self) -> bytes:
        if self.open_kind is None:
            return b""
        self.open_kind = None
        return sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _delta(self, delta: dict) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                           "delta": delta})  # fmt: skip

    def event(self, event: Event) -> bytes:
        out = b""
        if event.reasoning:
            if self.open_kind != "thinking":
                out += self._block("thinking", {"type": "thinking", "thinking": "",
                                                "signature": ""})  # fmt: skip
            out += self._delta({"type": "thinking_delta", "thinking": event.reasoning})
        if event.text:
            if self.open_kind != "text":
                out += self._block("text", {"type": "text", "text": ""})
            out += self._delta({"type": "text_delta", "text": event.text})
        for call in event.tool_calls:
            tool_id = call.id.replace("call_", "toolu_")
            out += self._block("tool_use", {"type": "tool_use", "id": tool_id, "name": call.name,
                                            "input": {}})  # fmt: skip
            out += self._delta({"type": "input_json_delta", "partial_json": call.arguments})
            out += self._close()
        if event.terminal:
            out += self._close()
            delta = {"stop_reason": _stop_reason(event.finish_reason, event.stop_sequence),
                     "stop_sequence": event.stop_sequence}  # fmt: skip
            # the whole usage, as Anthropic's message_delta now carries it: what the
            # prompt cache held is known only once the prompt is in
            usage = usage_body(event.usage)
            body = {"type": "message_delta", "delta": delta, "usage": usage}
            out += sse_event("message_delta", body)
            out += sse_event("message_stop", {"type": "message_stop"})
        return out

    def failed(self, event: Event) -> bytes:
        err = ApiError(500, event.error or "the request was cancelled")
        return sse_event("error", error_body(err)[0])


def count_body(tokens: int) -> dict:
    return {"input_tokens": tokens}


class Messages(Api):
    name = "messages"

    def __init__(self, as_sent: bool = False) -> None:
        self.as_sent = as_sent  # --prompt-as-sent: Claude Code's prompt unchanged

    def parse(self, body: Any, headers: Mapping[str, str] | None = None) -> Parsed:
        return parse_messages(body, headers, self.as_sent)

    def context_error(self, exc: ContextOverflow, param: str | None) -> ApiError:
        """Anthropic's own words, which Claude Code parses to retry with a smaller
        ``max_tokens``."""
        if exc.max_tokens is None:
            message = f"prompt is too long: {exc.prompt_tokens} tokens > {exc.limit} maximum"
        else:
            message = (f"input length and `max_tokens` exceed context limit: "
                       f"{exc.prompt_tokens} + {exc.max_tokens} > {exc.limit}, decrease input "
                       "length or `max_tokens` and try again")  # fmt: skip
        return ApiError(400, message, param)

    def body(self, parsed: Parsed, result: Result, served: Served) -> dict:
        return message_body(result, served.model)

    def shaper(self, parsed: Parsed, served: Served) -> StreamShaper:
        return StreamShaper(served.model, served.prompt_tokens)

    def error(self, err: ApiError) -> tuple[dict, int]:
        return error_body(err)
