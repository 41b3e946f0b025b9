"""OpenAI chat completions (``POST /v1/chat/completions``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from mlx_nursery.actors import Event, FinishReason, Result
from mlx_nursery.actors.tools import ToolCall

from .base import (
    Parsed,
    bad,
    check_bool,
    image_url_part,
    joined,
    model_of,
    priority_field,
    request_of,
)
from .openai import (
    TOOL_FIELDS,
    ChunkShaper,
    OpenAIApi,
    TokenText,
    check_fields,
    common,
    session_hints,
    stream_flags,
    thinking_of,
)


def _content(content: Any, i: int) -> str | list[dict]:
    """A message's content: its text, or its text and image parts (``image_url``,
    a data: URL) in order."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            where = f"messages[{i}].content[{j}]"
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind == "image_url":
                url = part.get("image_url")
                parts.append(image_url_part(url.get("url") if isinstance(url, Mapping) else url,
                                            where))  # fmt: skip
            else:
                raise bad(f"{where}: part type {kind!r} is not supported: send text or "
                          "image_url parts", "messages")  # fmt: skip
        return joined(parts)
    if content is None:
        return ""
    raise bad(f"messages[{i}].content must be a string or a list of parts", "messages")


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
    request = request_of(rendered, params, headers, *session_hints(body),
                         priority=priority_field(body, headers, fields))  # fmt: skip
    return Parsed(request, stream, include_usage, model_of(body), fields, ids, ignored,
                  n=body.get("n") or 1)  # fmt: skip


def chat_logprobs(text_of: TokenText, tokens, logprobs, tops) -> dict:
    content = []
    for token, lp, top in zip(tokens, logprobs, tops or [None] * len(tokens), strict=True):
        text = text_of(token)
        content.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": (t := text_of(alt.token)),
                        "logprob": alt.logprob,
                        "bytes": list(t.encode()),
                    }
                    for alt in (top or ())
                ],
            }
        )
    return {"content": content}


def tool_call_body(call: ToolCall) -> dict:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


@attrs.define
class ChatShaper(ChunkShaper):
    """Chat's chunks: deltas (the role once, content, reasoning, tool calls)."""

    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"
    calls: int = 0  # tool calls streamed so far (their indices)

    def text_choice(self, text: str) -> dict:
        return {"index": self.index, "delta": {"content": text}}

    def choice(self, event: Event, finish: FinishReason | None, logprobs: dict | None) -> dict:
        delta: dict[str, Any] = {"content": event.text} if event.text or not finish else {}
        if event.reasoning:
            delta["reasoning_content"] = event.reasoning
            if not event.text:
                delta.pop("content", None)
        if not self.sent_role:
            delta["role"], self.sent_role = "assistant", True
        return {"index": self.index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}

    def logprobs(self, tokens: list[int], logprobs: list[float], tops: list) -> dict:
        return chat_logprobs(self.text_of, tokens, logprobs, tops)

    def tool_chunks(self, event: Event) -> list[dict]:
        """OpenAI's streamed tool calls: for each call, its index, id and name first
        (arguments empty), then its arguments."""
        out = []
        for call in event.tool_calls:
            head = {"index": self.calls, "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": ""}}  # fmt: skip
            first: dict[str, Any] = {"tool_calls": [head]}
            if not self.sent_role:
                first["role"], self.sent_role = "assistant", True
            args = {
                "tool_calls": [{"index": self.calls, "function": {"arguments": call.arguments}}]
            }
            for delta in (first, args):
                out.append(self._wrap([{"index": self.index, "delta": delta, "finish_reason": None,
                                        "logprobs": None}]))  # fmt: skip
            self.calls += 1
        return out


class Chat(OpenAIApi):
    name = "chat.completions"
    response_object, shaper_class = "chat.completion", ChatShaper

    def parse(self, body: Any, headers: Mapping[str, str] | None = None) -> Parsed:
        return parse_chat(body, headers)

    def choice(self, result: Result, text_of: TokenText) -> dict:
        lp = None
        if result.logprobs is not None:
            lp = chat_logprobs(text_of, result.tokens, result.logprobs, result.top_logprobs)
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        if result.reasoning:
            message["reasoning_content"] = result.reasoning
        if result.tool_calls:
            message["content"] = result.text or None
            message["tool_calls"] = [tool_call_body(c) for c in result.tool_calls]
        return {"index": 0, "message": message, "finish_reason": result.finish_reason,
                "logprobs": lp}  # fmt: skip
