"""Constrained decoding: a JSON schema as one more per-row logits processor.

The grammar is llguidance's (its JSON-schema compiler and token-mask computation,
through its numpy path: its MLX helper needs Metal). A :class:`GrammarMask` is a
plain mlx-lm logits processor, ``fn(tokens, logits) -> logits``, so rows with
and without constraints share a batch step; it is made per request at intake
(one matcher each) and runs on the GPU thread inside the row's contained work:
a grammar error ends that row alone.

Each call consumes the tokens generated since the last call, fills the token
bitmask for the next position, and sends every disallowed token to -inf. Once
the grammar is complete only EOS is allowed, so a constrained answer always ends
well-formed when it ends by itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import InvalidRequest


def ll_tokenizer(tokenizer: Any, vocab_size: int | None) -> Any | None:
    """llguidance's view of the model's tokenizer (about a second for a large
    vocabulary: built once, at load), or None where it cannot be made."""
    try:
        from llguidance import LLTokenizer
        from llguidance.hf import from_tokenizer

        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        eos = list(getattr(tokenizer, "eos_token_ids", []) or []) or None
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None or backend.padding is not None or backend.truncation is not None:
            return from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
        # What from_tokenizer builds from, without its copy of the Rust tokenizer
        # (made only to turn padding and truncation off, which are off here): the
        # copy parses the tokenizer's JSON once more, holding the GIL (Gemma 3's
        # 262k vocabulary: 1.2 s in which no other model decodes or streams).
        eos = eos if eos is not None else hf.eos_token_id
        return LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    except Exception:
        return None


def schema_of(response_format: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The JSON schema a ``response_format`` asks for (None: free text)."""
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise InvalidRequest(
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format",
            )
        return schema
    raise InvalidRequest(
        "response_format.type must be text, json_object or json_schema", param="response_format"
    )


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")


def unimplemented_keys(message: str) -> list[str]:
    """The schema keywords llguidance names as not implemented in an error."""
    found = _UNIMPLEMENTED.search(message)
    return re.findall(r'"([^"]+)"', found.group(1)) if found else []


def loosen(schema: Any, keys: Sequence[str]) -> Any:
    """``schema`` without the keywords ``keys``, at every depth (a property that
    happens to be named like one is kept: only keywords of a schema object go)."""
    if isinstance(schema, list):
        return [loosen(s, keys) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {}
    for k, v in schema.items():
        if k in keys:
            continue
        if k in ("properties", "patternProperties", "$defs", "definitions"):
            out[k] = {name: loosen(s, keys) for name, s in v.items()} if isinstance(
                v, Mapping) else v  # fmt: skip
        else:
            out[k] = loosen(v, keys)
    return out


def loosened_schema(ll_tok: Any, schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """``schema`` as far as the grammar engine can compile it: keywords it names as
    unimplemented are left out of the constraint (the real APIs accept them)."""
    from llguidance import LLMatcher

    for _ in range(8):
        try:
            LLMatcher.grammar_from_json_schema(json.dumps(schema))
            return schema
        except ValueError as exc:
            keys = unimplemented_keys(str(exc))
            if not keys:
                return schema  # compile_schema says what is wrong
            schema = loosen(schema, keys)
    return schema


def compile_schema(ll_tok: Any, schema: Mapping[str, Any]) -> str:
    """The llguidance grammar for ``schema``; an invalid one is an InvalidRequest
    naming the problem."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False}
        )
    except ValueError as exc:
        raise InvalidRequest(f"response_format: {exc}", param="response_format") from None
    message = LLMatcher.validate_grammar(grammar, ll_tok)
    if message:
        raise InvalidRequest(
            f"response_format: the JSON schema cannot be used: {message}", param="response_format"
        )
    return grammar


class GrammarMask:
    """Per-row logits processor holding one llguidance matcher."""

    reads_tokens = True  # it reads the tokens as numbers: the batch starts its forward first

    def __init__(self, ll_tok: Any, grammar: str, vocab_size: int):
        from llguidance import LLMatcher
        from llguidance.numpy import allocate_token_bitmask

        self._matcher = LLMatcher(ll_tok, grammar, log_level=0)
        self._bitmask = allocate_token_bitmask(1, vocab_size)
        self._vocab = vocab_size
        self._seen: int | None = None  # context length at the last call

    def done_after(self, tokens: list[int]) -> bool:
        """Consume ``tokens``; True once the grammar is complete (it then only
        allows EOS, which a free-text caller does not want)."""
        for token in tokens:
            if not self._matcher.consume_token(int(token)):
                raise ValueError(f"constraint: {self._matcher.get_error()}")
        if self._seen is not None:
            self._seen += len(tokens)
        return self._matcher.is_accepting()

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx
        from llguidance.numpy import fill_next_token_bitmask

        n = int(tokens.size)
        if self._seen is not None and n > self._seen:
            for token in tokens[self._seen :].tolist():
                if not self._matcher.consume_token(int(token)):
                    raise ValueError(f"constraint: {self._matcher.get_error()}")
        self._seen = n
        if self._matcher.is_error():
            raise ValueError(f"constraint: {self._matcher.get_error()}")
        fill_next_token_bitmask(self._matcher, self._bitmask)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self._vocab]
        width = logits.shape[-1]
        allowed = np.zeros(width, dtype=bool)
        allowed[: min(width, self._vocab)] = bits[:width].astype(bool)
        return mx.where(mx.array(allowed), logits, -mx.inf)


def compile_lark(ll_tok: Any, lark: str, param: str) -> str:
    """The llguidance grammar for a lark grammar built here (tool calls)."""
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_lark(lark)
    message = LLMatcher.validate_grammar(grammar, ll_tok)
    if message:
        raise InvalidRequest(f"{param}: the schema cannot be used: {message}", param=param)
    return grammar


class OpenedCallMask:
    """Under ``tool_choice: auto`` the model writes freely; once its text ends with
    the call's opening tag, the call's body is constrained to the tools' schemas
    (and its closing tag), then the text is free again. A per-row processor like
    :class:`GrammarMask`. The tag is seen on token boundaries (a token that runs
    past the tag leaves that call unconstrained: it is parsed as written)."""

    reads_tokens = True

    def __init__(self, ll_tok: Any, tokenizer: Any, body_grammar: str, opening: str, vocab: int):
        self._ll, self._tokenizer, self._grammar = ll_tok, tokenizer, body_grammar
        self._opening, self._vocab = opening, vocab
        self._generated: list[int] = []
        self._seen: int | None = None
        self._call: GrammarMask | None = None  # the open call's mask, while one is open

    def __call__(self, tokens: Any, logits: Any) -> Any:
        n = int(tokens.size)
        new = tokens[self._seen :].tolist() if self._seen is not None and n > self._seen else []
        self._seen = n
        self._generated.extend(int(t) for t in new)
        if self._call is not None and self._call.done_after(new):
            self._call = None  # the call closed: free text again
        if self._call is None and new:
            tail = self._tokenizer.decode(self._generated[-16:])
            if tail.endswith(self._opening):
                self._call = GrammarMask(self._ll, self._grammar, self._vocab)
                return self._call(tokens, logits)
        if self._call is None:
            return logits
        return self._call(tokens, logits)
