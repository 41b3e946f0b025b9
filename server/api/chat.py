"""OpenAI chat completions (``POST /v1/chat/completions``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlx_nursery.actors import Result

from .base import Api, Parsed, Served, Style, bad, check_bool, model_of
from .openai import TOOL_FIELDS, ChunkShaper, check_fields, common, full_response, stream_flags


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


def parse_chat(body: Any) -> Parsed:
    body, params, fields = common(body)
    check_fields(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of messages", "messages")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        rendered.append({**m, "content": _content(m.get("content"), i)})
    if check_bool(body, "logprobs"):
        params["logprobs"] = True
        params["top_logprobs"] = body.get("top_logprobs") or 0
    elif body.get("top_logprobs"):
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    for name in TOOL_FIELDS:
        if body.get(name) is not None:
            params[name] = body[name]
    stream, include_usage = stream_flags(body)
    ids = bool(check_bool(body, "return_token_ids"))
    return Parsed(rendered, params, stream, include_usage, model_of(body), Style.CHAT, fields, ids)


class Chat(Api):
    name = "chat.completions"

    def parse(self, body: Any) -> Parsed:
        return parse_chat(body)

    def body(self, parsed: Parsed, result: Result, served: Served) -> dict:
        return full_response(parsed, served.model, result, served.tokenizer)

    def shaper(self, parsed: Parsed, served: Served) -> ChunkShaper:
        return ChunkShaper(parsed, served.model, served.tokenizer)
