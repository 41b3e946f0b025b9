"""The serial lane: one request at a time, with mlx-lm's own ``generate_step``.

Used for every request when the cap is 1 (the determinism pin), for requests
with a user seed (reproducible sampling must not depend on batch neighbours),
and for models whose caches cannot merge. Admission hands a row over only when
the batch lane has drained, so the row has the GPU alone. One token per GPU
call, so cancels and the event loop get a turn between tokens.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from .admission import Cancel, Left, Submit
from .decode_rules import PUT_MIN_PROMPT, finish_reason
from .emitter import Terminal, TokenOut, Tokens
from .gpu import Gpu
from .prompt_cache import Hit, PromptCacheActor, Put
from .request import Row
from .rows import build_sampling, read_logprobs
from .stats import Count, Gauge, Stats

MAILBOX_SIZE = 4096


@attrs.define(eq=False)
class _Generation:
    """GPU-thread side: mlx-lm's generate_step for one row."""

    row: Row
    steps: Any  # the generate_step generator
    caches: list  # its KV, kept here so its bytes can be reported

    @classmethod
    def start(cls, model: Any, row: Row, prefill_step_size: int, hit: Hit | None) -> _Generation:
        """Set up generate_step, starting after a prompt-cache hit if there is one.
        Processors see only the uncached part of the prompt, as in mlx_lm.server."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        if row.params.seed is not None:
            mx.random.seed(row.params.seed)
        sampler, processors = build_sampling(row.params)
        cached = hit.cached if hit is not None and hit.caches is not None else 0
        caches = hit.caches if cached else make_prompt_cache(model)
        steps = generate_step(
            mx.array(row.prompt[cached:]),
            model,
            max_tokens=row.params.max_tokens,
            sampler=sampler,
            logits_processors=processors or None,
            prompt_cache=caches,
            prefill_step_size=prefill_step_size,
        )
        return cls(row, steps, caches)

    def next(self) -> tuple[int, float | None, Any, int]:
        """The next token, its logprobs, and the KV bytes now held."""
        token, logprobs = next(self.steps)
        logprob, top = read_logprobs(logprobs, token, self.row.params)
        return token, logprob, top, sum(c.nbytes for c in self.caches)

    def close(self) -> list:
        """End generation; returns the caches (prompt and every yielded token)."""
        self.steps.close()
        caches, self.caches = self.caches, []
        return caches


@attrs.define(eq=False)
class Serial:
    model: Any
    gpu: Gpu
    stats: Stats
    eos: frozenset[int]
    prefill_step_size: int
    to_emitter: trio.MemorySendChannel
    to_admission: trio.MemorySendChannel
    prompt_cache: PromptCacheActor | None = None
    send: trio.MemorySendChannel = attrs.field(init=False)
    _receive: trio.MemoryReceiveChannel = attrs.field(init=False)
    _cancelled: str | None = attrs.field(default=None, init=False)
    _current: int | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        self.send, self._receive = trio.open_memory_channel(MAILBOX_SIZE)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self._receive, self.to_emitter, self.to_admission:
            task_status.started()
            async for message in self._receive:
                match message:
                    case Submit(row):
                        await self._generate(row)
                    case Cancel():
                        pass  # for a row that already ended
                    case _:
                        raise TypeError(f"serial got an unexpected message: {message!r}")

    def _drain(self) -> None:
        while True:
            try:
                message = self._receive.receive_nowait()
            except trio.WouldBlock:
                return
            match message:
                case Cancel(row_id, reason) if row_id == self._current:
                    self._cancelled = self._cancelled or reason
                case Cancel():
                    pass
                case _:
                    raise TypeError(f"serial got {message!r} while running a row")

    async def _generate(self, row: Row) -> None:
        self._current, self._cancelled = row.id, None
        gen, tokens, ended = None, [], False
        try:
            row.times.prefill_started = trio.current_time()
            self.stats.post(Count("prompt_tokens", len(row.prompt)))
            hit = await self.prompt_cache.take(row.prompt) if self.prompt_cache else None
            row.cached_tokens = hit.cached if hit is not None else 0
            gen = await self.gpu.call(
                _Generation.start, self.model, row, self.prefill_step_size, hit
            )
            generated = 0
            while True:
                token, logprob, top, kv_bytes = await self.gpu.call(gen.next)
                if generated % 16 == 0:  # the serial KV grows slowly: a sample is enough
                    self.stats.post(Gauge("serial_kv_bytes", kv_bytes))
                if generated == 0:
                    row.times.prefill_ended = trio.current_time()
                    self.stats.post(Count("prefill_tokens", len(row.prompt) - row.cached_tokens))
                generated += 1
                tokens.append(token)  # yielded = fed: what the caches now hold
                self._drain()
                if self._cancelled is not None:
                    await self.to_emitter.send(Terminal(row, "cancelled", self._cancelled))
                    return
                reason = finish_reason(row, token, generated, self.eos)
                shown = None if reason == "stop" else token
                await self.to_emitter.send(Tokens((TokenOut(row, shown, logprob, top, reason),)))
                if reason is not None:
                    ended = True
                    return
        except Exception as exc:
            msg = f"generation failed: {type(exc).__name__}: {exc}"
            await self.to_emitter.send(Terminal(row, "error", msg))
        finally:
            self._current = None
            with trio.CancelScope(shield=True):
                if gen is not None:
                    caches = await self.gpu.call(gen.close)
                    if (
                        ended
                        and self.prompt_cache is not None
                        and len(row.prompt) >= PUT_MIN_PROMPT
                    ):
                        put = Put(row.prompt + tokens, caches, "assistant")
                        await self.prompt_cache.send.send(put)
                self.stats.post(Gauge("serial_kv_bytes", 0))
                await self.to_admission.send(Left(row.id))
