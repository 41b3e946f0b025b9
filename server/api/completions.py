"""OpenAI text completions (``POST /v1/completions``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlx_nursery.actors import ContextOverflow

from .base import (
    ApiError,
    Parsed,
    Style,
    bad,
    check_bool,
    model_of,
    openai_context_error,
    session_of,
)
from .openai import OpenAIApi, check_fields, common, session_hints, stream_flags


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
    style, session = Style.COMPLETION, session_of(headers, *session_hints(body))
    return Parsed(prompt, params, stream, include_usage, model_of(body), style, fields, ids,
                  session)  # fmt: skip


class Completions(OpenAIApi):
    name = "completions"

    def parse(self, body: Any, headers: Mapping[str, str] | None = None) -> Parsed:
        return parse_completion(body, headers)

    def context_error(self, exc: ContextOverflow, param: str | None) -> ApiError:
        return openai_context_error(exc, "prompt", param)
