"""OpenAI Responses (``POST /v1/responses``): translation only, no I/O.

Request in: ``input`` (a string, or items: messages with text and
``input_image`` parts, ``function_call``, ``function_call_output`` with the
same), ``instructions``, function ``tools`` and ``namespace``
groups of them (flattened to ``namespace.name``, calls mapped back), hosted tools
left out (listed in ``X-Ignored-Tools``), ``tool_choice``, ``max_output_tokens``,
``temperature``, ``top_p``, ``text.format`` (a JSON schema through the
constrained decoding) and ``reasoning``; out: the engine's chat messages and
parameters, the same path as the chat route. Stateless: nothing is stored, so
``previous_response_id``, ``conversation`` and ``background`` are refused.
Results and events in: the Response object and its stream events out (a cut
answer ends in ``response.incomplete``, a failure in ``response.failed``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import attrs
from mlx_nursery.actors import ContextOverflow, Event, FinishReason, Result, Usage

from .base import (
    Api,
    ApiError,
    Parsed,
    Served,
    Shaper,
    bad,
    check_bool,
    image_url_part,
    joined,
    json_schema_format,
    model_of,
    new_id,
    object_body,
    priority_field,
    refuse_unknown,
    request_of,
    sse_event,
)
from .openai import session_hints, thinking_of

HONOURED = frozenset((
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
    "max_output_tokens", "temperature", "top_p", "text", "reasoning", "stream",
    "prompt_cache_key", "user", "safety_identifier", "speculative",
    "priority",  # vLLM's: the request's class or rank (docs/sessions.md)
))  # fmt: skip
# Documented with no meaning here: accepted and ignored (docs/http.md). ``include``
# asks for extras (encrypted reasoning, logprobs...): none apply, none are sent.
IGNORED = frozenset((
    "metadata", "store", "service_tier", "truncation", "include", "max_tool_calls",
    "top_logprobs", "prompt_cache_options", "prompt_cache_retention", "stream_options",
    "context_management", "moderation", "client_metadata", "image", "access_programs",
    "background_options",
))  # fmt: skip
# Documented, but they ask for state this server does not keep: refused saying so.
STATEFUL = ("previous_response_id", "conversation", "prompt", "background")
_FIELDS = HONOURED | IGNORED | frozenset(STATEFUL)
# Tools the server runs for the model upstream; here they are left out.
_FUNCTION_KINDS = ("function", "namespace")


def _new(prefix: str) -> str:
    return new_id(prefix, "_")


def _content(content: Any, where: str) -> str | list[dict]:
    """An item's content: its text, or its text and images (``input_image``, a
    data: URL) in order."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of parts", "input")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "input_image":
            if part.get("image_url") is None and part.get("file_id") is not None:
                raise bad(f"{where}.content[{j}]: file_id needs stored files; this server keeps "
                          "none: send the image as a data: URL in image_url", "input")  # fmt: skip
            out.append(image_url_part(part.get("image_url"), f"{where}.content[{j}]", "input"))
        elif kind in ("input_text", "output_text", "text"):
            out.append({"type": "text", "text": str(part.get("text", ""))})
        else:
            raise bad(f"{where}: part type {kind!r} is not supported (text and input_image)",
                      "input")  # fmt: skip
    return joined(out)


def _items(items: Any, aliases: Mapping[tuple[str, str], str]) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("'input' must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    thought = None  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise bad(f"input[{i}] must be an object", "input")
        kind = item.get("type", "message")
        if kind == "reasoning":
            thought = _reasoning_text(item)
            continue
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("user", "assistant", "system"):
                raise bad(f"input[{i}].role must be user, assistant, system or developer", "input")
            out.append({"role": role, "content": _content(item.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            name = item.get("name")
            name = aliases.get((item.get("namespace"), name), name)
            fn = {"name": name, "arguments": item.get("arguments")}
            call = {"id": item.get("call_id"), "type": "function", "function": fn}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):  # parts: text and images (a screenshot a tool took)
                body = _content(output, f"input[{i}].output")
            else:
                body = output if isinstance(output, str) else json.dumps(output)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": body})
        elif kind in _HOSTED_ITEMS:
            continue  # hosted tools' own turns are not fed back
        elif kind == "item_reference":
            raise bad(f"input[{i}]: item_reference needs stored items; this server keeps "
                      "none: send the item itself", "input")  # fmt: skip
        else:
            raise bad(f"input[{i}]: item type {kind!r} is not supported", "input")
        if thought and _opens_turn(item):
            out[-1]["reasoning_content"], thought = thought, None
    return out


def _reasoning_text(item: Mapping[str, Any]) -> str:
    """A reasoning item's text (its content, else its summary)."""
    parts = item.get("content") or item.get("summary") or []
    return "".join(str(p.get("text", "")) for p in parts if isinstance(p, Mapping))


def _opens_turn(item: Mapping[str, Any]) -> bool:
    """Whether ``item`` is an assistant turn's first item (its reasoning goes there)."""
    return item.get("type") == "function_call" or item.get("role") == "assistant"


_HOSTED_ITEMS = ("web_search_call", "file_search_call", "computer_call", "image_generation_call",
                 "code_interpreter_call", "mcp_call", "mcp_list_tools", "mcp_approval_request",
                 "mcp_approval_response", "tool_search_call", "compaction")  # fmt: skip


def _function(t: Mapping[str, Any], name: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": t.get("description", ""),
        "parameters": t.get("parameters") or {"type": "object"}}}  # fmt: skip


def _tools(body: Mapping[str, Any], params: dict) -> tuple[tuple[str, ...], dict]:
    """Function tools to the engine; a ``namespace`` (Codex's group of function
    tools) flattened into its functions, named ``namespace.name`` for the model;
    hosted and custom tools left out. Returns the names left out, and the
    flattened names: (namespace, name) -> the name the model sees."""
    tools, ignored, aliases = body.get("tools"), [], {}
    if tools:
        out = []
        for i, t in enumerate(tools if isinstance(tools, list) else [None]):
            kind = t.get("type") if isinstance(t, Mapping) else None
            if kind is None:
                raise bad(f"tools[{i}] must be a tool object with a 'type'", "tools")
            if kind == "function":
                out.append(_function(t, t.get("name")))
            elif kind == "namespace":
                ns = t.get("name")
                for inner in t.get("tools") or ():
                    if isinstance(inner, Mapping) and inner.get("type") == "function":
                        aliases[(ns, inner.get("name"))] = f"{ns}.{inner.get('name')}"
                        out.append(_function(inner, aliases[(ns, inner.get("name"))]))
                    elif isinstance(inner, Mapping):
                        ignored.append(f"{ns}.{inner.get('name', inner.get('type'))}")
            else:
                ignored.append(str(t.get("name") or kind))
        if out:
            params["tools"] = out
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if kind == "function":
        name = aliases.get((choice.get("namespace"), choice.get("name")), choice.get("name"))
        params["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif kind is not None:  # a hosted tool, or an allowed-tools list: the model chooses
        params["tool_choice"] = "auto" if "tools" in params else "none"
    elif choice is not None and (choice == "none" or "tools" in params):
        params["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        params["parallel_tool_calls"] = body["parallel_tool_calls"]
    return tuple(ignored), aliases


def _format(body: Mapping[str, Any], params: dict) -> None:
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "json_schema":
        params["response_format"] = json_schema_format(fmt.get("schema"))
    elif kind in ("json_object", "text"):
        params["response_format"] = {"type": kind}
    else:
        raise bad("text.format.type must be text, json_object or json_schema", "text")


def parse_responses(body: Any, headers: Mapping[str, str] | None = None) -> Parsed:
    body = object_body(body)
    refuse_unknown(body, _FIELDS, "/v1/responses")
    for name in STATEFUL:
        if body.get(name) not in (None, False):
            raise bad(f"{name} is not supported: this server keeps no responses or "
                      "conversations; send the whole conversation in 'input'", name)  # fmt: skip
    params: dict[str, Any] = {}
    ignored, aliases = _tools(body, params)
    chat = _items(body.get("input"), aliases)
    if body.get("instructions") is not None:
        chat.insert(
            0, {"role": "system", "content": _content(body["instructions"], "instructions")}
        )
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("speculative", "speculative")):  # fmt: skip
        if body.get(theirs) is not None:
            params[ours] = body[theirs]
    _format(body, params)
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, Mapping):
        raise bad("reasoning must be an object", "reasoning")
    thinking = thinking_of((reasoning or {}).get("effort"))
    if thinking is not None:
        params["chat_template_kwargs"] = thinking
    stream, model = bool(check_bool(body, "stream")), model_of(body)
    fields = {"max_tokens": "max_output_tokens", "response_format": "text"}
    names = {flat: key for key, flat in aliases.items()}
    request = request_of(chat, params, headers, *session_hints(body),
                         priority=priority_field(body, headers, fields))  # fmt: skip
    return Parsed(request, stream, False, model, fields, ignored_tools=ignored, tool_names=names)


def usage_body(usage: Usage | None) -> dict | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def _message(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": []}] if text else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": content}  # fmt: skip


def _reasoning(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def _call(
    item_id: str, call: Any, arguments: str, names: Mapping, status: str = "completed"
) -> dict:
    """A function call item; a namespaced function's call names its namespace."""
    namespace, name = names.get(call.name, (None, call.name))
    item = {"type": "function_call", "id": item_id, "call_id": call.id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip
    if namespace is not None:
        item["namespace"] = namespace
    return item


def response_body(
    rid: str, model: str, parsed: Parsed, output: list[dict], end: Event | Result | None
) -> dict:
    """The Response object: ``end`` is the result or terminal event (None: in progress)."""
    reason = end.finish_reason if end is not None else None
    status = "in_progress" if end is None else "completed"
    if reason is FinishReason.LENGTH:
        status = "incomplete"
    p = parsed.request.params
    return {
        "id": rid, "object": "response", "created_at": time.time(), "model": model,
        "status": status, "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": None, "metadata": {},
        "parallel_tool_calls": p.get("parallel_tool_calls", True),
        "temperature": p.get("temperature"), "top_p": p.get("top_p"),
        "tool_choice": _choice_body(p.get("tool_choice")),
        "tools": [{"type": "function", **t["function"]} for t in p.get("tools", ())],
        "max_output_tokens": p.get("max_tokens"),
        "usage": usage_body(end.usage) if end is not None else None,
    }  # fmt: skip


def _choice_body(choice: Any) -> Any:
    if isinstance(choice, Mapping):
        return {"type": "function", "name": choice["function"]["name"]}
    return choice or "auto"


def full_output(result: Result, names: Mapping) -> list[dict]:
    out = []
    if result.reasoning:
        out.append(_reasoning(_new("rs"), result.reasoning))
    if result.text:
        out.append(_message(_new("msg"), result.text))
    for call in result.tool_calls:
        out.append(_call(_new("fc"), call, call.arguments, names))
    return out


@attrs.define
class StreamShaper(Shaper):
    """One response's stream events, numbered; a text item is closed before a
    function call item opens, and everything before ``response.completed``."""

    model: str
    parsed: Parsed
    id: str = attrs.field(factory=lambda: _new("resp"))
    seq: int = 0
    output: list[dict] = attrs.field(factory=list)
    text_item: dict | None = None  # the message item open now
    thought: dict | None = None  # the reasoning item open now

    def _event(self, kind: str, **body: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **body}
        self.seq += 1
        return sse_event(kind, payload)

    def start(self) -> bytes:
        snapshot = response_body(self.id, self.model, self.parsed, [], None)
        return self._event("response.created", response=snapshot) + self._event(
            "response.in_progress", response=snapshot
        )

    def _reason(self, text: str) -> bytes:
        """Reasoning text, into the reasoning item (opened on its first text)."""
        out, index = b"", len(self.output)
        if self.thought is None:
            out += self._close_text()
            index = len(self.output)
            self.thought = _reasoning(_new("rs"), "", status="in_progress")
            out += self._event("response.output_item.added", output_index=index,
                               item=self.thought)  # fmt: skip
        self.thought["content"][0]["text"] += text
        return out + self._event("response.reasoning_text.delta", item_id=self.thought["id"],
                                 output_index=index, content_index=0, delta=text)  # fmt: skip

    def _close_reasoning(self) -> bytes:
        item, self.thought = self.thought, None
        if item is None:
            return b""
        index, text = len(self.output), item["content"][0]["text"]
        done = _reasoning(item["id"], text)
        self.output.append(done)
        return self._event(
            "response.reasoning_text.done", item_id=item["id"], output_index=index,
            content_index=0, text=text,
        ) + self._event("response.output_item.done", output_index=index, item=done)  # fmt: skip

    def _close_text(self) -> bytes:
        item, self.text_item = self.text_item, None
        if item is None:
            return b""
        index, text = len(self.output), item["content"][0]["text"]
        done = _message(item["id"], text)
        self.output.append(done)
        part = done["content"][0]
        return (
            self._event("response.output_text.done", item_id=item["id"], output_index=index,
                        content_index=0, text=text, logprobs=[])
            + self._event("response.content_part.done", item_id=item["id"], output_index=index,
                          content_index=0, part=part)
            + self._event("response.output_item.done", output_index=index, item=done)
        )  # fmt: skip

    def event(self, event: Event) -> bytes:
        out = self._reason(event.reasoning) if event.reasoning else b""
        if event.text or event.tool_calls or event.terminal:
            out += self._close_reasoning()
        index = len(self.output)
        if event.text:
            if self.text_item is None:
                self.text_item = _message(_new("msg"), "", status="in_progress")
                part = {"type": "output_text", "text": "", "annotations": []}
                out += self._event("response.output_item.added", output_index=index,
                                   item=self.text_item)  # fmt: skip
                out += self._event("response.content_part.added", item_id=self.text_item["id"],
                                   output_index=index, content_index=0, part=part)  # fmt: skip
                self.text_item["content"] = [dict(part)]
            self.text_item["content"][0]["text"] += event.text
            out += self._event("response.output_text.delta", item_id=self.text_item["id"],
                               output_index=index, content_index=0, delta=event.text,
                               logprobs=[])  # fmt: skip
        names = self.parsed.tool_names
        for call in event.tool_calls:
            out += self._close_text()
            index, item_id = len(self.output), _new("fc")
            opened = _call(item_id, call, "", names, status="in_progress")
            out += self._event("response.output_item.added", output_index=index, item=opened)
            out += self._event("response.function_call_arguments.delta", item_id=item_id,
                               output_index=index, delta=call.arguments)  # fmt: skip
            out += self._event(
                "response.function_call_arguments.done", item_id=item_id, output_index=index,
                arguments=call.arguments, name=names.get(call.name, (None, call.name))[1],
            )  # fmt: skip
            done = _call(item_id, call, call.arguments, names)
            self.output.append(done)
            out += self._event("response.output_item.done", output_index=index, item=done)
        if event.terminal:
            out += self._close_text()
            # As OpenAI's: a cut answer ends in response.incomplete (status
            # incomplete, incomplete_details), any other in response.completed.
            final = response_body(self.id, self.model, self.parsed, self.output, event)
            cut = final["status"] == "incomplete"
            out += self._event(f"response.{'incomplete' if cut else 'completed'}", response=final)
        return out

    def failed(self, event: Event) -> bytes:
        """As OpenAI's: an ``error`` event, then ``response.failed`` with the error."""
        message = event.error or "the request was cancelled"
        code = "server_error" if event.finish_reason is FinishReason.ERROR else "cancelled"
        out = self._close_reasoning() + self._close_text()
        final = response_body(self.id, self.model, self.parsed, self.output, event)
        final.update(status="failed", error={"code": code, "message": message})
        out += self._event("error", code=code, message=message, param=None)
        return out + self._event("response.failed", response=final)


class Responses(Api):
    name = "responses"

    def parse(self, body: Any, headers: Mapping[str, str] | None = None) -> Parsed:
        return parse_responses(body, headers)

    def context_error(self, exc: ContextOverflow, param: str | None) -> ApiError:
        """OpenAI's Responses wording, with the numbers after it."""
        message = ("Your input exceeds the context window of this model. Please adjust your "
                   f"input and try again. ({exc})")  # fmt: skip
        return ApiError(400, message, param, code="context_length_exceeded")

    def body(self, parsed: Parsed, result: Result, served: Served) -> dict:
        output = full_output(result, parsed.tool_names)
        return response_body(_new("resp"), served.model, parsed, output, result)

    def shaper(self, parsed: Parsed, served: Served) -> StreamShaper:
        return StreamShaper(served.model, parsed)
