"""OpenAI chat completions (``POST /v1/chat/completions``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import Parsed, Style, bad, check_bool, model_of, session_of
from .openai import (
    TOOL_FIELDS,
    OpenAIApi,
    check_fields,
    common,
    session_hints,
    stream_flags,
    thinking_of,
)


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise bad(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    if content is None:
        return ""
    raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _functions(body: Mapping[str, Any], params: dict[str, Any], fields: dict) -> None:
    """The deprecated ``functions`` / ``function_call`` as the tools they stand for
    (answers still carry ``tool_calls``)."""
    functions = body.get("functions")
    if functions is not None and body.get("tools") is None:
        if not isinstance(functions, list):
            raise bad("'functions' must be a list of functions", "functions")
        params["tools"] = [{"type": "function", "function": f} for f in functions]
        fields["tools"] = "functions"
    call = body.get("function_call")
    if call is not None and body.get("tool_choice") is None:
        if isinstance(call, Mapping):
            call = {"type": "function", "function": {"name": call.get("name")}}
        params["tool_choice"] = call
        fields["tool_choice"] = "function_call"


def _tools(body: Mapping[str, Any], params: dict[str, Any]) -> tuple[str, ...]:
    """Function tools go to the engine; the others (custom tools, the hosted web
    search) are left out, and their names returned."""
    ignored = ["web_search"] if body.get("web_search_options") is not None else []
    tools = params.get("tools")
    if isinstance(tools, list):
        kept = []
        for tool in tools:
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            if kind == "custom":
                ignored.append(str((tool.get("custom") or {}).get("name") or "custom"))
            else:
                kept.append(tool)
        params["tools"] = kept
        if not kept and params.get("tool_choice") in ("auto", None):
            params.pop("tools")
    return tuple(ignored)


def parse_chat(body: Any, headers: Mapping[str, str] | None = None) -> Parsed:
    body, params, fields = common(body)
    check_fields(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of messages", "messages")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        rendered.append({**m, "role": role, "content": _content(m.get("content"), i)})
    if check_bool(body, "logprobs"):
        params["logprobs"] = True
        params["top_logprobs"] = body.get("top_logprobs") or 0
    elif body.get("top_logprobs"):
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    for name in TOOL_FIELDS:
        if body.get(name) is not None:
            params[name] = body[name]
    _functions(body, params, fields)
    ignored = _tools(body, params)
    thinking = thinking_of(body.get("reasoning_effort"))
    if thinking is not None and "chat_template_kwargs" not in params:
        params["chat_template_kwargs"] = thinking
    stream, include_usage = stream_flags(body)
    ids = bool(check_bool(body, "return_token_ids"))
    session = session_of(headers, *session_hints(body))
    return Parsed(rendered, params, stream, include_usage, model_of(body), Style.CHAT, fields,
                  ids, session, ignored)  # fmt: skip


class Chat(OpenAIApi):
    name = "chat.completions"

    def parse(self, body: Any, headers: Mapping[str, str] | None = None) -> Parsed:
        return parse_chat(body, headers)
