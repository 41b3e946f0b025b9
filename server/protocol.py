"""OpenAI request parsing and response shaping: pure functions, no I/O.

``parse_chat`` / ``parse_completion`` turn a JSON body into engine arguments or
raise :class:`ApiError` naming the field; the ``*_response`` / ``*_chunk``
functions shape engine results into OpenAI's objects.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from typing import Any

import attrs
from mlx_nursery.actors import Event, Result, Usage
from mlx_nursery.actors.request import MAX_TOP_LOGPROBS


@attrs.frozen
class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    status: int
    message: str
    param: str | None = None
    type: str = "invalid_request_error"
    code: str | None = None

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


@attrs.frozen
class Defaults:
    """Server-wide defaults from the CLI; a request's own fields win."""

    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


@attrs.frozen
class Parsed:
    prompt: Any  # token ids, text, or chat messages
    params: dict[str, Any]  # SamplingParams fields
    stream: bool
    include_usage: bool
    model: str | None
    logprobs_style: str  # chat | completion


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _number(body, name, lo=None, hi=None, *, integer=False):
    v = body.get(name)
    if v is None:
        return None
    if integer:
        ok = isinstance(v, int) and not isinstance(v, bool)
        kind = "an integer"
    else:
        ok = _is_number(v)
        kind = "a number"
    if not ok:
        raise bad(f"'{name}' must be {kind}, got {type(v).__name__}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        span = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise bad(f"'{name}' must be {span}, got {v}", name)
    return v


def _bool(body, name) -> bool | None:
    v = body.get(name)
    if v is None or isinstance(v, bool):
        return v
    raise bad(f"'{name}' must be a boolean, got {type(v).__name__}", name)


def _common(body: Mapping[str, Any], defaults: Defaults) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise bad("the request body must be a JSON object")
    n = _number(body, "n", 1, integer=True)
    if n not in (None, 1):
        raise bad(f"'n' must be 1: this server returns one choice per request, got {n}", "n")
    max_tokens = _number(body, "max_completion_tokens", 1, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", 1, integer=True)
    params: dict[str, Any] = {
        "max_tokens": max_tokens if max_tokens is not None else defaults.max_tokens,
        "temperature": _pick(_number(body, "temperature", 0, 2), defaults.temperature),
        "top_p": _pick(_number(body, "top_p", 0, 1), defaults.top_p),
        "top_k": _pick(_number(body, "top_k", 0, integer=True), defaults.top_k),
        "min_p": _pick(_number(body, "min_p", 0, 1), defaults.min_p),
    }
    if params["top_p"] == 0:
        raise bad("'top_p' must be greater than 0", "top_p")
    for name in ("presence_penalty", "frequency_penalty"):
        v = _number(body, name, -2, 2)
        if v:
            params[name] = float(v)
    rep = _number(body, "repetition_penalty", 0)
    if rep is not None:
        if rep <= 0:
            raise bad("'repetition_penalty' must be greater than 0", "repetition_penalty")
        params["repetition_penalty"] = float(rep)
    seed = _number(body, "seed", integer=True)
    if seed is not None:
        params["seed"] = seed
    params["stop"] = _stop(body.get("stop"))
    bias = body.get("logit_bias")
    if bias is not None:
        params["logit_bias"] = _logit_bias(bias)
    return params


def _pick(v, default):
    return default if v is None else v


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("'stop' must be a non-empty string or a list of them", "stop")
    return tuple(stop)


def _logit_bias(bias) -> dict[int, float]:
    if not isinstance(bias, Mapping):
        raise bad("'logit_bias' must be an object of token id to bias", "logit_bias")
    out = {}
    for k, v in bias.items():
        try:
            token = int(k)
        except (TypeError, ValueError):
            raise bad(f"'logit_bias' key {k!r} is not a token id", "logit_bias") from None
        if not _is_number(v) or not -100 <= v <= 100:
            raise bad(f"'logit_bias' value for {k} must be between -100 and 100", "logit_bias")
        out[token] = float(v)
    return out


def _stream(body) -> tuple[bool, bool]:
    stream = bool(_bool(body, "stream"))
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, Mapping):
            raise bad("'stream_options' must be an object", "stream_options")
        include_usage = bool(_bool(opts, "include_usage"))
    return stream, include_usage


def _model(body) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    return model


def _content(content, i: int) -> str:
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


def parse_chat(body: Mapping[str, Any], defaults: Defaults) -> Parsed:
    params = _common(body, defaults)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of messages", "messages")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        rendered.append({**m, "content": _content(m.get("content"), i)})
    if _bool(body, "logprobs"):
        params["logprobs"] = True
        top = _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
        params["top_logprobs"] = top or 0
    elif body.get("top_logprobs"):
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    stream, include_usage = _stream(body)
    return Parsed(rendered, params, stream, include_usage, _model(body), "chat")


def parse_completion(body: Mapping[str, Any], defaults: Defaults) -> Parsed:
    params = _common(body, defaults)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("'prompt' is empty", "prompt")
    elif isinstance(prompt, list) and prompt:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad("'prompt' must be a string or a list of token ids", "prompt")
    else:
        raise bad("'prompt' must be a non-empty string or a list of token ids", "prompt")
    top = _number(body, "logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
    if top is not None:
        params["logprobs"] = True
        params["top_logprobs"] = top
    stream, include_usage = _stream(body)
    return Parsed(prompt, params, stream, include_usage, _model(body), "completion")


# -- responses ------------------------------------------------------------------


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def usage_body(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "queue_wait_seconds": usage.queue_wait,
        "time_to_first_token_seconds": usage.time_to_first_token,
        "prefill_tokens_per_second": usage.prefill_tokens_per_second,
        "decode_tokens_per_second": usage.decode_tokens_per_second,
    }


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def chat_logprobs(tokenizer, tokens, logprobs, tops) -> dict:
    content = []
    for token, lp, top in zip(tokens, logprobs, tops or [None] * len(tokens), strict=True):
        text = _token_text(tokenizer, token)
        content.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": (t := _token_text(tokenizer, alt.token)),
                        "logprob": alt.logprob,
                        "bytes": list(t.encode()),
                    }
                    for alt in (top or ())
                ],
            }
        )
    return {"content": content}


def completion_logprobs(tokenizer, tokens, logprobs, tops, offset: int = 0) -> dict:
    texts = [_token_text(tokenizer, t) for t in tokens]
    offsets, pos = [], offset
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": texts,
        "token_logprobs": list(logprobs),
        "top_logprobs": [
            {_token_text(tokenizer, alt.token): alt.logprob for alt in (top or ())}
            for top in (tops or [None] * len(tokens))
        ],
        "text_offset": offsets,
    }


def full_response(parsed: Parsed, model: str, result: Result, tokenizer) -> dict:
    created = int(time.time())
    if parsed.logprobs_style == "chat":
        lp = None
        if result.logprobs is not None:
            lp = chat_logprobs(tokenizer, result.tokens, result.logprobs, result.top_logprobs)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": result.text},
            "finish_reason": result.finish_reason,
            "logprobs": lp,
        }
        kind, obj = "chatcmpl", "chat.completion"
    else:
        lp = None
        if result.logprobs is not None:
            lp = completion_logprobs(tokenizer, result.tokens, result.logprobs, result.top_logprobs)
        choice = {
            "index": 0,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "logprobs": lp,
        }
        kind, obj = "cmpl", "text_completion"
    return {
        "id": new_id(kind),
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_body(result.usage),
    }


@attrs.define
class ChunkShaper:
    """Shapes one stream's events into OpenAI chunks (keeps the id and text offset)."""

    parsed: Parsed
    model: str
    tokenizer: Any
    id: str = attrs.field(init=False)
    created: int = attrs.field(factory=lambda: int(time.time()))
    sent_role: bool = False
    offset: int = 0

    def __attrs_post_init__(self) -> None:
        self.id = new_id("chatcmpl" if self.parsed.logprobs_style == "chat" else "cmpl")

    def _wrap(self, choices: list[dict]) -> dict:
        chat = self.parsed.logprobs_style == "chat"
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, event: Event) -> dict | None:
        """The chunk for one event, or None when it carries nothing to send."""
        chat = self.parsed.logprobs_style == "chat"
        finish = event.finish_reason if event.finish_reason in ("stop", "length") else None
        if not event.text and finish is None and event.logprob is None:
            return None
        lp = None
        if event.token is not None and event.logprob is not None:
            tops = [event.top_logprobs]
            if chat:
                lp = chat_logprobs(self.tokenizer, [event.token], [event.logprob], tops)
            else:
                lp = completion_logprobs(
                    self.tokenizer, [event.token], [event.logprob], tops, self.offset
                )
        if chat:
            delta: dict[str, Any] = {"content": event.text} if event.text or not finish else {}
            if not self.sent_role:
                delta["role"], self.sent_role = "assistant", True
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
        else:
            choice = {"index": 0, "text": event.text, "finish_reason": finish, "logprobs": lp}
        self.offset += len(event.text)
        return self._wrap([choice])

    def usage_chunk(self, usage: Usage) -> dict:
        """The final chunk of a stream with ``include_usage``: no choices, the usage."""
        return {**self._wrap([]), "usage": usage_body(usage)}
