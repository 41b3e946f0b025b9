"""``open_engine``: the actor graph in one nursery, and the embedding API.

    async with open_engine("path/to/model", batch=8) as engine:
        async with engine.submit("Hello", max_tokens=64) as stream:
            async for event in stream:
                ...
        result = await engine.generate("Hello", max_tokens=64)

Mailboxes: engine -> admission -> prefill -> decode / serial -> emitter -> each
request's own channel; every actor posts figures to stats; all mlx work runs on
the GPU actor's thread.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from .admission import Admission, Cancel, Shutdown, Submit
from .budget import LayerCost, auto_budget, parse_budget, probe, project
from .decode import Decode
from .emitter import Emitter
from .errors import ContextOverflow, EngineClosed, GenerationFailed, InvalidRequest
from .gpu import Gpu
from .prefill import PrefillActor
from .prompt_cache import PromptCacheActor
from .request import (
    Event,
    Lane,
    Result,
    Row,
    RowTimes,
    SamplingParams,
    normalize_stop,
)
from .serial import Serial
from .stats import Count, Stats, StatsSnapshot

Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]

SHUTDOWN_GRACE_SECONDS = 10.0  # rows in flight get this long to take their terminal event


@attrs.frozen
class ModelInfo:
    batchable: bool  # every cache layer has mlx-lm's merge (mlx_lm.server's test)
    context_length: int | None
    eos: frozenset[int]
    cache_kinds: tuple[str, ...]
    kv_costs: tuple[LayerCost, ...]  # per layer: how its KV bytes grow with length
    weights_bytes: int


DTYPES = ("auto", "float32", "bfloat16", "float16")


def _load(model: Any, dtype: str | None) -> tuple[Any, Any, ModelInfo]:
    """Runs on the GPU thread: load (if a path), cast, and inspect the model's caches."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    if isinstance(model, str | Path):
        model, tokenizer = load(str(model))
    else:
        model, tokenizer = model
    if dtype == "auto":
        # On a CPU device float32 is the fast dtype (bf16/fp16 matmuls are emulated).
        dtype = "float32" if mx.default_device().type == mx.DeviceType.cpu else None
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
        mx.eval(model.parameters())
    from mlx.utils import tree_flatten

    caches = make_prompt_cache(model)
    args = getattr(model, "args", None)
    context = getattr(args, "max_position_embeddings", None)
    info = ModelInfo(
        batchable=all(hasattr(c, "merge") for c in caches),
        context_length=int(context) if context else None,
        eos=frozenset(tokenizer.eos_token_ids),
        cache_kinds=tuple(type(c).__name__ for c in caches),
        kv_costs=probe(model),
        weights_bytes=sum(v.nbytes for _, v in tree_flatten(model.parameters())),
    )
    return model, tokenizer, info


@attrs.define(eq=False)
class RequestStream:
    """One request's events. Use as ``async with engine.submit(...) as stream``.

    Leaving the block before the terminal event (break, an exception, a cancel)
    cancels the request: its row is evicted within one step and its KV freed.
    """

    _engine: Engine
    row: Row
    _receive: trio.MemoryReceiveChannel
    _ended: bool = False  # the terminal event has been read

    async def __aenter__(self) -> RequestStream:
        await self._engine._enqueue(self.row)
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._receive.close()
        if not self.row.done:
            self._engine._cancel(self.row.id, "the consumer left the stream")

    async def result(self) -> Result:
        """Read the rest of the stream into a :class:`Result`; raises
        :class:`GenerationFailed` if it ends in an error event."""
        tokens, text, logprobs, tops = [], [], [], []
        async for event in self:
            text.append(event.text)
            if event.token is not None:
                tokens.append(event.token)
                logprobs.append(event.logprob)
                tops.append(event.top_logprobs)
            if event.terminal:
                if event.finish_reason == "error":
                    raise GenerationFailed(event.error)
                params = self.row.params
                return Result(
                    tokens=tokens,
                    text="".join(text),
                    finish_reason=event.finish_reason,
                    usage=event.usage,
                    logprobs=logprobs if params.wants_logprobs else None,
                    top_logprobs=tops if params.top_logprobs else None,
                )
        raise GenerationFailed("the stream ended without a terminal event")

    def next_nowait(self) -> Event | None:
        """The next event if one is already waiting, else None (never blocks)."""
        if self._ended:
            return None
        try:
            event = self._receive.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return None
        self._ended = event.terminal
        return event

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        if self._ended:
            raise StopAsyncIteration
        try:
            event = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise StopAsyncIteration from None
        self._ended = event.terminal
        return event


@attrs.define(eq=False)
class Engine:
    model: Any
    tokenizer: Any
    info: ModelInfo
    cap: int
    default_max_tokens: int
    stats_actor: Stats
    _admission: Admission
    _decode: Decode
    _template: dict[str, Any] = attrs.field(factory=dict)  # chat template overrides and args
    prefill_step_size: int = 2048
    kv_budget: int | None = None  # bytes the live rows may project to; None: no budget
    _ids: itertools.count = attrs.field(factory=lambda: itertools.count(1))
    _closed: bool = False

    # -- the API ----------------------------------------------------------------

    def submit(self, prompt: Prompt, **params: Any) -> RequestStream:
        """Validate and place one request; enter the returned stream to run it.

        ``params`` are :class:`SamplingParams` fields (``stop`` may be a string).
        Raises :class:`InvalidRequest` at once for a request the engine cannot run.
        """
        if self._closed:
            raise EngineClosed("the engine is shutting down and takes no new requests")
        try:
            ids, boundary = self._encode(prompt)
            row_params = self._params(params)
            self._check_context(ids, row_params)
            kv = self.project(len(ids) + row_params.max_tokens)
            self._check_budget(ids, row_params, kv)
        except InvalidRequest:
            self.stats_actor.post(Count("rejected"))
            raise
        send, receive = trio.open_memory_channel(row_params.max_tokens + 2)
        row = Row(
            id=next(self._ids),
            prompt=ids,
            params=row_params,
            lane=self.place(row_params),
            events=send,
            times=RowTimes(submitted=trio.current_time()),
            snapshot_at=boundary,
            kv_projected=kv,
        )
        return RequestStream(self, row, receive)

    async def generate(self, prompt: Prompt, **params: Any) -> Result:
        """Run one request to its end; raises :class:`GenerationFailed` on an error event."""
        async with self.submit(prompt, **params) as stream:
            return await stream.result()

    def stats(self) -> StatsSnapshot:
        return self.stats_actor.snapshot()

    @property
    def steps(self) -> int:
        """Continuous-lane decode steps run so far."""
        return self._decode.steps_done

    async def wait_step(self, n: int) -> None:
        """Wait until the continuous lane has run ``n`` decode steps: tests and load
        scripts order their events by engine step rather than by sleeping."""
        await self._decode.wait_steps(n)

    async def close(self, reason: str = "the engine is shutting down") -> None:
        """Stop taking requests, cancel every queued and running row (each gets its
        terminal event, ``cancelled`` with ``reason``) and wait until all have ended."""
        if not self._closed:
            self._closed = True
            await self._admission.send.send(Shutdown(reason))
        await self.wait_idle()

    @property
    def closed(self) -> bool:
        return self._closed

    async def wait_idle(self) -> None:
        """Wait until no row is queued, admitted or decoding, and every figure is in."""
        while True:
            s = self.stats()
            live = s.submitted - (s.finished + s.errored + s.cancelled)
            if (
                not live
                and not s.active_rows
                and not s.pending_rows
                and not s.decoding_rows
                and not s.kv_bytes
                and not self.stats_actor.backlog
            ):
                return
            await trio.sleep(0.005)

    # -- helpers ----------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """The token ids ``submit`` would run for ``prompt``."""
        return self._encode(prompt)[0]

    def _render(self, messages: list, *, generation_prompt: bool) -> list[int]:
        try:
            return list(
                self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=generation_prompt, **self._template
                )
            )
        except Exception as exc:  # a template error is the request's (or the settings')
            raise InvalidRequest(
                f"the chat template could not render these messages: {exc}", param="messages"
            ) from None

    def _encode(self, prompt: Prompt) -> tuple[list[int], int | None]:
        """Token ids, and for chat messages where the last message starts."""
        tok = self.tokenizer
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt is empty", param="prompt")
            bos = tok.bos_token  # stream_generate's rule for adding special tokens
            special = bos is None or not prompt.startswith(bos)
            return list(tok.encode(prompt, add_special_tokens=special)), None
        items = list(prompt)
        if not items:
            raise InvalidRequest("prompt is empty", param="prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            vocab = getattr(getattr(self.model, "args", None), "vocab_size", None)
            bad = [t for t in items if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise InvalidRequest(
                    f"prompt token id {bad[0]} is out of range for a vocabulary of {vocab}",
                    param="prompt",
                )
            return items, None
        if all(isinstance(m, Mapping) for m in items):
            for i, m in enumerate(items):
                if "role" not in m or "content" not in m:
                    raise InvalidRequest(
                        f"messages[{i}] needs a 'role' and a 'content'", param="messages"
                    )
            ids = self._render(items, generation_prompt=True)
            boundary = None
            if len(items) > 1:
                before = self._render(items[:-1], generation_prompt=False)
                boundary = len(before) if ids[: len(before)] == before else None
            return ids, boundary
        raise InvalidRequest(
            "prompt must be a string, a list of token ids, or a list of chat messages",
            param="prompt",
        )

    def _params(self, params: dict[str, Any]) -> SamplingParams:
        params = dict(params)
        params.setdefault("max_tokens", self.default_max_tokens)
        params["stop"] = normalize_stop(params.get("stop"))
        params["stop_token_ids"] = tuple(params.get("stop_token_ids") or ())
        fields = attrs.fields_dict(SamplingParams)
        unknown = sorted(set(params) - set(fields))
        if unknown:
            raise InvalidRequest(f"unknown parameter {unknown[0]!r}", param=unknown[0])
        try:
            return SamplingParams(**params)
        except TypeError as exc:
            raise InvalidRequest(str(exc)) from exc

    def _check_context(self, ids: list[int], params: SamplingParams) -> None:
        limit = self.info.context_length
        if limit is None:
            return
        if len(ids) >= limit:
            raise ContextOverflow(
                f"prompt is {len(ids):,} tokens; this model's context is {limit:,}",
                param="prompt",
            )
        if len(ids) + params.max_tokens > limit:
            raise ContextOverflow(
                f"prompt ({len(ids):,} tokens) plus max_tokens ({params.max_tokens:,}) is "
                f"{len(ids) + params.max_tokens:,}; this model's context is {limit:,}: "
                f"lower max_tokens to at most {limit - len(ids):,}",
                param="max_tokens",
            )

    def project(self, tokens: int) -> int:
        """Worst-case KV bytes of one row holding ``tokens`` tokens."""
        return project(self.info.kv_costs, tokens, self.prefill_step_size)

    def _check_budget(self, ids: list[int], params: SamplingParams, kv: int) -> None:
        budget = self.kv_budget
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

    def place(self, params: SamplingParams) -> Lane:
        """Serial when batching is off or impossible, or a seed asks for reproducibility."""
        if self.cap <= 1 or not self.info.batchable or params.seed is not None:
            return Lane.SERIAL
        return Lane.CONTINUOUS

    async def _enqueue(self, row: Row) -> None:
        if self._closed:
            raise EngineClosed("the engine is shutting down and takes no new requests")
        self.stats_actor.post(Count("submitted"))
        await self._admission.send.send(Submit(row))

    def _cancel(self, row_id: int, reason: str) -> None:
        # When closing, shutdown cancels every row anyway.
        closed = (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError)
        with contextlib.suppress(*closed):
            self._admission.send.send_nowait(Cancel(row_id, reason))


def _mode(cap: int, batchable: bool) -> str:
    if cap <= 1:
        return "off"
    return "batch" if batchable else "serial"


@asynccontextmanager
async def open_engine(
    model: str | Path | tuple[Any, Any],
    *,
    batch: int = 8,
    prefill_step_size: int = 2048,
    max_tokens: int = 256,
    context_length: int | None = None,
    dtype: str | None = None,
    prompt_cache_size: int = 10,
    prompt_cache_bytes: int | None = None,
    chat_template: str | None = None,
    chat_template_args: Mapping[str, Any] | None = None,
    kv_budget: int | str | None = None,
) -> AsyncIterator[Engine]:
    """Start the actor graph in a nursery of its own; yields once every actor runs.

    ``model`` is a path (loaded with ``mlx_lm.load``) or a ``(model, tokenizer)``
    pair. ``batch`` caps concurrent rows (1 pins the serial lane). ``dtype``
    casts the weights (``auto``: float32 on a CPU device, else as stored).
    ``prompt_cache_size`` / ``prompt_cache_bytes`` cap the prompt cache (entries,
    bytes; a size of 0 turns it off). ``chat_template`` replaces the tokenizer's;
    ``chat_template_args`` go to every rendering. ``kv_budget`` (bytes, ``"auto"``
    or None) caps the KV the live rows may project to: rows queue until they
    fit, a row that never could is refused, the prompt cache gets what is left.
    On exit, rows still in flight are cancelled and each gets its terminal event.
    """
    kv_budget = parse_budget(kv_budget)
    if dtype is not None and dtype not in DTYPES:
        raise InvalidRequest(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if batch < 1:
        raise InvalidRequest(f"batch must be at least 1, got {batch}", param="batch")
    if prefill_step_size < 1:
        raise InvalidRequest("prefill_step_size must be at least 1", param="prefill_step_size")
    gpu = Gpu()
    gpu.start()
    try:
        loaded, tokenizer, info = await gpu.call(_load, model, dtype)
        if context_length is not None:
            info = attrs.evolve(info, context_length=context_length)
        budget = auto_budget(info.weights_bytes) if kv_budget == "auto" else kv_budget
        stats = Stats(configured=batch, mode=_mode(batch, info.batchable), kv_budget_bytes=budget)
        cache = None
        if prompt_cache_size > 0:
            cache = PromptCacheActor(gpu, stats, prompt_cache_size, prompt_cache_bytes or 1 << 62)
        emitter = Emitter(tokenizer, stats, cancel=lambda rid, why: engine._cancel(rid, why))
        decode = Decode(loaded, gpu, stats, info.eos, emitter.send.clone(), None)
        decode.to_prompt_cache = cache.send.clone() if cache else None
        serial = Serial(
            loaded, gpu, stats, info.eos, prefill_step_size, emitter.send.clone(), None, cache
        )
        prefill = PrefillActor(
            loaded,
            gpu,
            stats,
            prefill_step_size,
            info.eos,
            decode.send,
            emitter.send.clone(),
            None,
            cache,
        )
        admission = Admission(batch, gpu, stats, prefill.send, serial.send, emitter.send)
        admission.budget = budget
        admission.to_prompt_cache = cache.send.clone() if cache else None
        decode.to_admission = admission.send.clone()
        serial.to_admission = admission.send.clone()
        prefill.to_admission = admission.send.clone()
        template = dict(chat_template_args or {})
        if chat_template is not None:
            template["chat_template"] = chat_template
        engine = Engine(
            loaded, tokenizer, info, batch, max_tokens, stats, admission, decode, template,
            prefill_step_size, budget,
        )  # fmt: skip
        # The actors run shielded from the caller's cancellation: a caller cancelled
        # from outside still gets the graceful shutdown below (every row its
        # terminal event), then the actors are cancelled on purpose.
        actors_scope = trio.CancelScope(shield=True)

        async def run_actors(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
            with actors_scope:
                async with trio.open_nursery() as actors:
                    for actor in (stats, cache, emitter, decode, serial, prefill, admission):
                        if actor is not None:
                            await actors.start(actor.run)
                    task_status.started()

        async with trio.open_nursery() as nursery:
            await nursery.start(run_actors)
            try:
                yield engine
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(SHUTDOWN_GRACE_SECONDS):
                    await engine.close()
                actors_scope.cancel()
    finally:
        await gpu.stop()
