"""OpenAI text completions (``POST /v1/completions``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from mlx_nursery.actors import ContextOverflow, Event, FinishReason, Result

from .base import (
    ApiError,
    Parsed,
    bad,
    check_bool,
    model_of,
    openai_context_error,
    priority_field,
    request_of,
)
from .openai import (
    ChunkShaper,
    OpenAIApi,
    TokenText,
    check_fields,
    common,
    session_hints,
    stream_flags,
)


def parse_completion(body: Any, headers: Mapping[str, str] | None = None) -> Parsed:
    body, params, fields = common(body)
    check_fields(body, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    tokens = isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    )
    if not (isinstance(prompt, str) or tokens):
        raise bad("'prompt' must be a string or a list of token ids", "prompt")
    if body.get("logprobs") is not None:  # completions: the number of alternatives
        params["logprobs"] = True
        params["top_logprobs"] = body["logprobs"]
        fields["top_logprobs"] = "logprobs"
    stream, include_usage = stream_flags(body)
    ids = bool(check_bool(body, "return_token_ids"))
    request = request_of(prompt, params, headers, *session_hints(body),
                         priority=priority_field(body, headers, fields))  # fmt: skip
    return Parsed(request, stream, include_usage, model_of(body), fields, ids,
                  n=body.get("n") or 1)  # fmt: skip


def completion_logprobs(text_of: TokenText, tokens, logprobs, tops, offset: int = 0) -> dict:
    texts = [text_of(t) for t in tokens]
    offsets, pos = [], offset
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": texts,
        "token_logprobs": list(logprobs),
        "top_logprobs": [
            {text_of(alt.token): alt.logprob for alt in (top or ())}
            for top in (tops or [None] * len(tokens))
        ],
        "text_offset": offsets,
    }


@attrs.define
class CompletionShaper(ChunkShaper):
    """Text completions' chunks: text and its offsets, no roles or tools."""

    id_prefix = "cmpl"
    chunk_object = "text_completion"

    def text_choice(self, text: str) -> dict:
        return {"index": self.index, "text": text}

    def choice(self, event: Event, finish: FinishReason | None, logprobs: dict | None) -> dict:
        return {"index": self.index, "text": event.text, "finish_reason": finish,
                "logprobs": logprobs}  # fmt: skip

    def logprobs(self, tokens: list[int], logprobs: list[float], tops: list) -> dict:
        return completion_logprobs(self.text_of, tokens, logprobs, tops, self.offset)


class Completions(OpenAIApi):
    name = "completions"
    response_object, shaper_class = "text_completion", CompletionShaper

    def parse(self, body: Any, headers: Mapping[str, str] | None = None) -> Parsed:
        return parse_completion(body, headers)

    def choice(self, result: Result, text_of: TokenText) -> dict:
        lp = None
        if result.logprobs is not None:
            lp = completion_logprobs(text_of, result.tokens, result.logprobs, result.top_logprobs)
        return {"index": 0, "text": result.text, "finish_reason": result.finish_reason,
                "logprobs": lp}  # fmt: skip

    def context_error(self, exc: ContextOverflow, param: str | None) -> ApiError:
        return openai_context_error(exc, "prompt", param)
