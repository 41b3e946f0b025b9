"""The serial lane: one request at a time, with mlx-lm's own ``generate_step``.

Used for every request when the cap is 1 (the determinism pin), and for models
whose caches cannot merge. A seeded row draws here as in the batch (its own keys,
``step.slots.SeededSampler``), so a seed gives the same tokens on either lane.
Admission hands a row over only when the batch lane has drained, so the row has
the GPU alone. One token per GPU call, so cancels and the event loop get a turn
between tokens.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from .gpu import Gpu
from .mailbox import closing
from .messages import (
    Hit,
    Put,
    Submit,
    TokenOut,
    Tokens,
    release,
    take,
    worth_keeping,
)
from .ranks import Mirrored, mirrored
from .request import FinishReason
from .row import Cancel, End, Finish, Phase, Row
from .stats import Count, Gauge, Metric, Stats
from .step.quantized import KvBits
from .step.slots import build_sampling, read_logprobs

MAILBOX_SIZE = 4096


@mirrored(Mirrored.GENERATION)
@attrs.define(eq=False)
class _Generation:
    """GPU-thread side: mlx-lm's generate_step for one row."""

    row: Row
    steps: Any  # the generate_step generator
    caches: list  # its KV, kept here so its bytes can be reported

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    @classmethod
    def start(
        cls, model: Any, row: Row, prefill_step_size: int, hit: Hit, kv: KvBits | None = None
    ) -> _Generation:
        """Set up generate_step, starting after a prompt-cache hit if there is one.
        Processors see only the uncached part of the prompt, as in mlx_lm.server.
        Under ``kv`` the model quantizes its caches after every forward, as
        generate_step's own ``kv_bits`` does, by the rule the batch follows
        (full-attention layers only: mlx-lm's raises on a sliding window)."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        sampler, processors = build_sampling(row.params)
        cached = hit.cached if hit.caches is not None else 0
        caches = hit.caches if cached else make_prompt_cache(model)
        steps = generate_step(
            mx.array(row.prompt[cached:]),
            model if kv is None else _Quantizing(model, kv),
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


@attrs.frozen
class _Quantizing:
    """The model, followed after each forward by the KV quantization rule."""

    model: Any
    kv: KvBits

    def __call__(self, inputs: Any, cache: list[Any], **kwargs: Any) -> Any:
        out = self.model(inputs, cache=cache, **kwargs)
        self.kv.after_forward(cache)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


@attrs.define(eq=False)
class Serial:
    model: Any
    gpu: Gpu
    stats: Stats
    prefill_step_size: int
    inbox: trio.MemoryReceiveChannel  # Submit, Cancel, Finish
    to_emitter: trio.MemorySendChannel
    to_admission: trio.MemorySendChannel
    to_prompt_cache: trio.MemorySendChannel | None
    kv: KvBits | None = None  # KV quantization (docs/quantized-kv.md)
    _current: Row | None = attrs.field(default=None, init=False)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with closing(self.inbox, self.to_emitter, self.to_admission, self.to_prompt_cache):
            task_status.started()
            async for message in self.inbox:
                match message:
                    case Submit(row):
                        await self._generate(row)
                    case Cancel() | Finish():
                        pass  # for a row that already ended
                    case _:
                        raise TypeError(f"serial got an unexpected message: {message!r}")

    def _drain(self) -> None:
        """End requests for the running row, between two of its tokens."""
        while True:
            try:
                message = self.inbox.receive_nowait()
            except trio.WouldBlock:
                return
            match message:
                case Cancel(row_id) | Finish(row_id) if row_id == self._current.id:
                    self._current.ask(message)
                case Cancel() | Finish():
                    pass
                case _:
                    raise TypeError(f"serial got {message!r} while running a row")

    async def _generate(self, row: Row) -> None:
        row.move(Phase.SERIAL)
        self._current, gen = row, None
        try:
            row.times.prefill_started = trio.current_time()
            self.stats.post(Count(Metric.PROMPT_TOKENS, len(row.prompt)))
            hit = await take(self.to_prompt_cache, row.prompt, row.pin)
            row.cached_tokens = hit.cached if hit.caches is not None else 0
            row.cache_report = hit.report
            gen = await self.gpu.call(
                _Generation.start, self.model, row, self.prefill_step_size, hit, self.kv
            )
            await self._tokens(row, gen)
        except Exception as exc:
            row.ask_end(End(FinishReason.ERROR, f"generation failed: {type(exc).__name__}: {exc}"))
        finally:
            self._current = None
            with trio.CancelScope(shield=True):
                await self._close(row, gen)

    async def _tokens(self, row: Row, gen: _Generation) -> None:
        """Generate until the row ends; its last token (if any) carries the end."""
        while row.end is None:
            token, logprob, top, kv_bytes = await self.gpu.call(gen.next)
            if len(row.tokens) % 16 == 0:  # the serial KV grows slowly: a sample is enough
                self.stats.post(Gauge(Metric.SERIAL_KV_BYTES, kv_bytes))
            if not row.tokens:
                row.times.prefill_ended = trio.current_time()
                self.stats.post(Count(Metric.PREFILL_TOKENS, len(row.prompt) - row.cached_tokens))
            self._drain()
            if row.end is not None:  # ended while this token was computed: not shown
                row.tokens.append(token)  # yielded = fed: what the caches now hold
                return
            out = TokenOut.accepted(row, token, logprob, top)
            if out.ends:
                row.move(Phase.ENDED)
            await self.to_emitter.send(Tokens((out,)))

    async def _close(self, row: Row, gen: _Generation | None) -> None:
        """Free the row (its KV to the prompt cache if it finished), its terminal
        to the emitter unless its last token carried it, its slot to admission."""
        if gen is not None:
            try:
                caches = await self.gpu.call(gen.close)
            except Exception:  # the call never ran (a sharded engine's ranks lost)
                caches = None
            if caches and self.to_prompt_cache is not None and worth_keeping(row):
                await self.to_prompt_cache.send(
                    Put(row.prompt + row.tokens, caches, session=row.pin)
                )
        self.stats.post(Gauge(Metric.SERIAL_KV_BYTES, 0))
        announced = row.phase is Phase.ENDED  # its last token carried the end
        if not announced:
            row.ask_end(End(FinishReason.CANCELLED, "the engine stopped the row"))
        await release(
            row, to_emitter=self.to_emitter, to_admission=self.to_admission, announced=announced
        )
