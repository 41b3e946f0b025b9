"""Intake: a caller's prompt and parameters become a :class:`Row`, or a typed error.

Every check of a request happens here, before anything is queued: the prompt's
shape, each sampling parameter (through :class:`SamplingParams`), the model's
context and the KV budget. Placement on a lane is decided here too.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import trio

from .budget import project
from .constrain import (
    GrammarMask,
    OpenedCallMask,
    compile_lark,
    compile_schema,
    loosened_schema,
    schema_of,
    unimplemented_keys,
)
from .errors import ContextOverflow, InvalidRequest
from .families import Lit, harmony_template, literal
from .models.load import ModelInfo
from .models.vision import MAX_IMAGES, Picture, picture
from .request import Lane, Prompt, Request, SamplingParams, priority_of, session_weight
from .row import Row, RowTimes
from .settings import EngineSettings
from .tools import (
    GENERIC,
    ToolFormat,
    chosen,
    constraint,
    loosen_tools,
    native_messages,
    native_tools,
    render_messages,
    tool_format,
)


@attrs.define(eq=False)
class Intake:
    tokenizer: Any
    info: ModelInfo
    settings: EngineSettings
    budget: int | None  # resolved KV budget in bytes (None: no budget)
    ll_tokenizer: Any = None  # llguidance's view of the tokenizer (None: no constraints)
    vision: Any = None  # the model's image side (models/vision.Vision; None: text only)
    _ids: itertools.count = attrs.field(factory=lambda: itertools.count(1), init=False)
    # Call markers as grammar terminals (a special token as itself), made once.
    lit: Lit = attrs.field(init=False, default=attrs.Factory(lambda s: literal(s.tokenizer),
                                                             takes_self=True))  # fmt: skip
    # Every rendering's template arguments: the settings', gpt-oss's template as Harmony's.
    _template: dict = attrs.field(init=False, default=attrs.Factory(
        lambda s: template_arguments(s.tokenizer, s.settings), takes_self=True))  # fmt: skip

    def row(self, request: Request) -> tuple[Row, trio.MemoryReceiveChannel]:
        """A QUEUED row for this request, and the receive end of its event channel
        (sized for every token plus the terminal event: delivery never blocks).
        Raises :class:`InvalidRequest` for anything the engine cannot run."""
        weight = 1.0 if request.weight is None else session_weight(request.weight)
        priority = 0 if request.priority is None else priority_of(request.priority)
        priority = priority if self.settings.priorities else 0
        sampling, ids, boundary = self.prompt(request.prompt, request.params)
        thinking = self._opens_thinking(ids)
        sampling = self._constrain(sampling, thinking)
        self._check_token_ids(sampling)
        self._check_context(ids, sampling)
        kv = self.project(len(ids) + sampling.max_tokens)
        self._check_budget(ids, sampling, kv)
        send, receive = trio.open_memory_channel(sampling.max_tokens + 2)
        row = Row(
            id=next(self._ids),
            prompt=ids,
            params=sampling,
            lane=self.place(sampling),
            events=send,
            times=RowTimes(submitted=trio.current_time()),
            stop_ids=self.info.eos | frozenset(sampling.stop_token_ids),
            snapshot_at=boundary,
            kv_projected=kv,
            starts_thinking=thinking,
            request_id=request.request_id,
            session=request.session,
            parent=request.parent if request.session is not None else None,
            weight=weight,
            priority=priority,
        )
        return row, receive

    def prompt(
        self, prompt: Prompt, params: Mapping[str, Any]
    ) -> tuple[SamplingParams, list[int], int | None]:
        """The request's parameters (tool choice settled) and its prompt's token ids,
        tools rendered in; and where its last chat message starts."""
        sampling = SamplingParams.build({**self.settings.request_defaults, **params})
        choice = chosen(sampling.tools, sampling.tool_choice)
        fmt = tool_format(self.tokenizer, choice)
        sampling = attrs.evolve(sampling, tool_choice=choice, tool_format=fmt)
        extra = dict(sampling.chat_template_kwargs or {})
        tools = sampling.tools if choice != "none" else ()
        ids, boundary = self.encode(prompt, tools, extra, fmt)
        return sampling, ids, boundary

    def place(self, params: SamplingParams) -> Lane:
        """Serial only when batching is off or impossible: a seeded row draws with
        keys of its own (``SeededSampler``), so it batches like any row."""
        if self.settings.batch <= 1 or not self.info.batchable:
            return Lane.SERIAL
        return Lane.CONTINUOUS

    def project(self, tokens: int) -> int:
        """Worst-case KV bytes of one row holding ``tokens`` tokens."""
        return project(self.info.kv_costs, tokens, self.settings.prefill_step_size)

    def _constrain(self, params: SamplingParams, thinking: bool = False) -> SamplingParams:
        """The tools room's constraint for this request (``tools.constraint``)
        becomes a mask of the row's own (one matcher per request), after the
        caller's processors: a grammar over the answer, or over a call's body once
        the model opens one. Where the prompt opened a think block, a required
        call's grammar closes it first. A model without constrained decoding
        refuses a required call or a format, and lets ``auto`` calls run free."""
        schema = schema_of(params.response_format) if params.response_format else None
        closing = self.lit(self.info.think[1]) if thinking and self.info.think else None
        plan = constraint(params, schema, self.lit, closing)
        if plan is None:
            return params
        if self.ll_tokenizer is None or self.info.vocab_size is None:
            if plan.opened is not None:
                return params
            raise InvalidRequest(
                f"{plan.param} needs constrained decoding, which this model's tokenizer "
                "does not support",
                param=plan.param,
            )
        schema = None if plan.schema is None else loosened_schema(self.ll_tokenizer, plan.schema)
        if plan.lark is None:
            grammar = compile_schema(self.ll_tokenizer, schema)
        else:
            grammar = self._compile_tools(plan.tools, lambda tools: plan.lark(tools, schema))
        if plan.opened is not None:
            mask = OpenedCallMask(
                self.ll_tokenizer, self.tokenizer, grammar, plan.opened, self.info.vocab_size
            )
        else:
            mask = GrammarMask(self.ll_tokenizer, grammar, self.info.vocab_size)
        return attrs.evolve(params, logits_processors=(*params.logits_processors, mask))

    def _compile_tools(self, tools: tuple, lark: Callable[[tuple], str]) -> str:
        """The grammar over the tools' schemas. Keywords the grammar engine cannot
        compile (``propertyNames``, ...) are left out of the constraint, not the
        request: the constraint is what compiles, and calls are checked against
        the full schemas when they are parsed (every call is)."""
        for _ in range(8):
            try:
                return compile_lark(self.ll_tokenizer, lark(tools), "tools")
            except InvalidRequest as exc:
                keys = unimplemented_keys(str(exc))
                if not keys:
                    raise
                tools = loosen_tools(tools, keys)
        return compile_lark(self.ll_tokenizer, lark(tools), "tools")

    # -- the prompt ---------------------------------------------------------------

    def _opens_thinking(self, ids: list[int]) -> bool:
        """Whether the prompt ends inside a think block (templates that open it)."""
        if self.info.think is None:
            return False
        start, end = self.info.think
        tail = self.tokenizer.decode(ids[-64:])
        return tail.rfind(start) > tail.rfind(end)

    def encode(
        self,
        prompt: Prompt,
        tools: tuple = (),
        template: dict | None = None,
        fmt: ToolFormat = GENERIC,
    ) -> tuple[list[int], int | None]:
        """Token ids, and for chat messages where the last message starts (with
        ``tools``, the messages are rendered in the generic tool format first)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt is empty", param="prompt")
            bos = self.tokenizer.bos_token  # stream_generate's rule for special tokens
            special = bos is None or not prompt.startswith(bos)
            return list(self.tokenizer.encode(prompt, add_special_tokens=special)), None
        items = list(prompt)
        if not items:
            raise InvalidRequest("prompt is empty", param="prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            vocab = self.info.vocab_size
            bad = [t for t in items if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise InvalidRequest(
                    f"prompt token id {bad[0]} is out of range for a vocabulary of {vocab}",
                    param="prompt",
                )
            return items, None
        if all(isinstance(m, Mapping) for m in items):
            return self._chat(*tool_rendering(items, tools, template or {}, fmt))
        raise InvalidRequest(
            "prompt must be a string, a list of token ids, or a list of chat messages",
            param="prompt",
        )

    def _chat(
        self, messages: list[Mapping[str, Any]], template: dict
    ) -> tuple[list[int], int | None]:
        for i, m in enumerate(messages):
            if "role" not in m or "content" not in m:
                raise InvalidRequest(
                    f"messages[{i}] needs a 'role' and a 'content'", param="messages"
                )
        messages, pictures = self._pictures(messages)
        ids = self.render(messages, generation_prompt=True, pictures=pictures, **template)
        boundary = None
        if len(messages) > 1:
            try:  # a template may refuse the shorter conversation (Llama 3's tools in the
                before = self.render(messages[:-1], generation_prompt=False, pictures=pictures,
                                     **template)  # fmt: skip
            except InvalidRequest:  # first user message): then there is no boundary
                before = None
            if before is not None and ids[: len(before)] == before:
                boundary = len(before)
        return ids, boundary

    def _pictures(self, messages: list) -> tuple[list, list[Picture]]:
        """The messages as their template takes them (an image part as ``{"type":
        "image"}``) and their images, checked, in order. An image for a model that
        takes none is refused here, saying why."""
        parts = [p for m in messages if isinstance(m.get("content"), list)
                 for p in m["content"] if _is_image(p)]  # fmt: skip
        if not parts:
            return messages, []
        for i, m in enumerate(messages):
            content = m.get("content")
            if m.get("role") not in ("user", "tool") and isinstance(content, list) and any(
                map(_is_image, content)
            ):
                raise InvalidRequest(f"messages[{i}]: images go in user turns or tool "
                                     f"results, not in a {m.get('role')} turn",
                                     param="messages")  # fmt: skip
        if self.vision is None:
            why = self.info.no_images or (
                f"model {self.info.id!r} is a text model and takes no images: send text only, "
                "or serve a vision model (docs/vision.md)"
            )
            raise InvalidRequest(why, param="messages")
        if len(parts) > MAX_IMAGES:
            raise InvalidRequest(
                f"{len(parts)} images in one request, over the limit of {MAX_IMAGES}: send "
                "fewer (an agent can drop old screenshots from its context)", param="messages",
            )  # fmt: skip
        pictures = [picture(p["image"]) for p in parts]
        images = {id(p) for p in parts}
        bare = [
            {**m, "content": [{"type": "image"} if id(p) in images else p for p in m["content"]]}
            if isinstance(m.get("content"), list) else m
            for m in messages
        ]  # fmt: skip
        return bare, pictures

    def render(self, messages: list, *, generation_prompt: bool,
               pictures: list[Picture] | None = None, **extra: Any) -> list[int]:  # fmt: skip
        """A chat's token ids through the model's template; where it holds
        ``pictures``, each image's ids in its place (``Vision.expand``)."""
        arguments = {**self._template, **extra}
        try:
            if not pictures:
                return list(self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=generation_prompt, **arguments))  # fmt: skip
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tokenize=False,
                **arguments,
            )  # fmt: skip
        except Exception as exc:  # a template error is the request's (or the settings')
            merged = merge_system(messages)
            if merged is not None:  # a template that takes system text only first
                return self.render(merged, generation_prompt=generation_prompt,
                                   pictures=pictures, **extra)  # fmt: skip
            raise InvalidRequest(
                f"the chat template could not render these messages: {exc}", param="messages"
            ) from None
        return self.vision.expand(text, self.tokenizer, pictures, whole=generation_prompt)

    # -- limits ---------------------------------------------------------------------

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Token ids in the parameters must exist in this model's vocabulary."""
        vocab = self.info.vocab_size
        if vocab is None:
            return
        for param, ids in (
            ("logit_bias", params.logit_bias or ()),
            ("stop_token_ids", params.stop_token_ids),
        ):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequest(
                    f"{param}: token id {bad[0]} is out of range for a vocabulary of {vocab}",
                    param=param,
                )

    def _check_context(self, ids: list[int], params: SamplingParams) -> None:
        limit = self.info.context_length
        if limit is None:
            return
        if len(ids) >= limit:
            raise ContextOverflow(
                f"prompt is {len(ids):,} tokens; this model's context is {limit:,}",
                param="prompt", prompt_tokens=len(ids), max_tokens=None, limit=limit,
            )  # fmt: skip
        if len(ids) + params.max_tokens > limit:
            raise ContextOverflow(
                f"prompt ({len(ids):,} tokens) plus max_tokens ({params.max_tokens:,}) is "
                f"{len(ids) + params.max_tokens:,}; this model's context is {limit:,}: "
                f"lower max_tokens to at most {limit - len(ids):,}",
                param="max_tokens", prompt_tokens=len(ids), max_tokens=params.max_tokens,
                limit=limit,
            )  # fmt: skip

    def _check_budget(self, ids: list[int], params: SamplingParams, kv: int) -> None:
        budget = self.budget
        if budget is None or kv <= budget:
            return
        fits = max(
            (n for n in range(0, params.max_tokens, 16) if self.project(len(ids) + n) <= budget),
            default=None,
        )
        hint = (
            f"lower max_tokens to {fits:,} or less, or raise the KV budget"
            if fits
            else "shorten the prompt or raise the KV budget"
        )
        raise InvalidRequest(
            f"this request needs up to {kv:,} bytes of KV cache (prompt {len(ids):,} tokens "
            f"+ max_tokens {params.max_tokens:,}); the KV budget is {budget:,} bytes: {hint}",
            param="max_tokens",
        )


def _is_image(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "image"


def merge_system(messages: list) -> list | None:
    """Messages with every system message after the first folded into one leading
    system message, in order (None: there are none to fold). For templates that
    refuse a system turn mid-conversation (Anthropic's mid-conversation system)."""
    later = [i for i, m in enumerate(messages) if m.get("role") == "system" and i > 0]
    if not later:
        return None
    system = [m for m in messages if m.get("role") == "system"]
    text = "\n\n".join(str(m.get("content") or "") for m in system)
    return [{"role": "system", "content": text}, *(m for m in messages if m["role"] != "system")]


def template_arguments(tokenizer: Any, settings: EngineSettings) -> dict[str, Any]:
    """The settings' template arguments, with the template (the settings' or the
    tokenizer's) made to render what its family's reference renderer does
    (gpt-oss: :func:`families.harmony_template`)."""
    out = dict(settings.template)
    template = out.get("chat_template") or getattr(tokenizer, "chat_template", None)
    fixed = harmony_template(template) if isinstance(template, str) else template
    if fixed != template:
        out["chat_template"] = fixed
    return out


def tool_rendering(
    messages: list, tools: tuple, template: dict, fmt: ToolFormat
) -> tuple[list, dict]:
    """Messages and template arguments for a conversation that may hold tools: a
    template with its own tool markup gets ``tools=``; any other gets the generic
    format written into the messages."""
    history = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if fmt.native:
        extra = {**template, "tools": native_tools(tools)} if tools else template
        return (native_messages(messages, fmt.family) if history else messages), extra
    if tools or history:
        return render_messages(messages, tools), template
    return messages, template
