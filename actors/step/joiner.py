"""A joiner's prefill: its prompt into KV, chunk by chunk, then its first token.

Runs on the GPU thread. A :class:`Prefill` job fills one row's solo caches and
primes it into a one-row ``batch.Batch`` (its first token sampled, pending);
:func:`prefill_together` does several as one padded batch. Either way the result
joins the running batch as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import TokenBuffer, make_prompt_cache

from ..ranks import Mirrored, mirrored
from ..request import SamplingParams
from .batch import Batch
from .kv import clone, extracted, merge
from .quantized import KvBits
from .slots import Slot, build_sampling


@mirrored(Mirrored.PREFILL)
@attrs.define(eq=False)
class Prefill:
    """A joiner's solo prefill: its prompt but the last token, chunk by chunk, on
    serial-class caches (fresh, or a prompt-cache clone already holding the first
    ``done`` tokens). ``prime`` then forwards the last token and samples the row's
    first token on those caches (mlx-lm's tail convention).

    Chunks split exactly at each boundary in ``snapshot_at``; there a clone of
    the caches is kept in ``snapshots`` for the prompt cache. Made on the event
    loop (no mlx until the first chunk); between GPU calls the prefill actor reads
    ``done`` and adds to ``snapshot_at``."""

    model: Any
    prompt: list[int]
    params: SamplingParams
    step_size: int
    caches: list[Any] | None = None  # None until the take or the first chunk
    done: int = 0  # prompt tokens already in the caches
    taken: bool = False  # the prompt-cache take is in (caches/done set from it)
    started: bool = False  # a chunk (or the prime) has run: the take is final
    snapshot_at: set[int] = attrs.field(factory=set)
    snapshots: list[tuple[int, list[Any]]] = attrs.field(factory=list)
    row_id: int | None = None  # carried into the row's batch slot
    stop_ids: frozenset[int] = frozenset()  # the row's, carried into its slot
    kv: KvBits | None = None  # KV quantization (see quantize_at)
    taken_at: int = 0  # tokens the prompt-cache take held (generate's chunks count from here)
    # Rows with this very prompt that ride on this job (``n`` choices of one
    # request): set by the prefill actor before each turn; ``prime`` samples
    # their first tokens from the same forward.
    forks: list[Prefill] = attrs.field(factory=list)

    def start_from(self, caches: list[Any] | None, cached: int) -> None:
        """Begin from a prompt-cache take (no caches: from scratch)."""
        self.caches, self.done, self.taken = caches, cached if caches else 0, True
        self.taken_at = self.done

    def forget_take(self) -> None:
        """Drop a take gone stale before the first chunk; take again later."""
        self.caches, self.done, self.taken, self.taken_at = None, 0, False, 0

    @property
    def remaining(self) -> int:
        """Tokens still to prefill before the last one."""
        return len(self.prompt) - 1 - self.done

    def next_take(self, budget: int | None = None) -> int:
        """Tokens the next chunk takes: at most ``step_size`` and ``budget``, and
        never past the next snapshot boundary, nor past where quantized KV begins
        (:meth:`quantize_at`)."""
        n = min(self.step_size, self.remaining, budget or self.step_size)
        ahead = [b - self.done for b in self.snapshot_at if b > self.done]
        at = self.quantize_at()
        if at is not None and at > self.done:
            ahead.append(at - self.done)
        return min(n, *ahead) if ahead else n

    def quantize_at(self) -> int | None:
        """Under ``kv``, how many tokens the caches hold when they turn quantized:
        where mlx-lm's ``generate`` quantizes, the end of its first prefill chunk
        (chunks of ``step_size`` from the cached tokens on) that reaches
        ``kv.start``; None when no chunk does (the last token's forward decides).
        The tokens before it attend float KV, those after quantized, so where a
        chunk ends matters only here: attention over quantized KV gives the same
        bits however many queries a chunk holds, float attention too."""
        if self.kv is None:
            return None
        base, last = self.taken_at, len(self.prompt) - 1
        k = max(1, -(-(self.kv.start - base) // self.step_size))
        end = min(base + k * self.step_size, last)
        return end if end >= self.kv.start and end > base else None

    def at_quantize(self, caches: list[Any]) -> list[Any]:
        """``caches`` (this row's, holding ``done`` tokens) as they are at this
        point of its own prefill: quantized once it reached ``quantize_at``."""
        if self.kv is not None and self.done == self.quantize_at():
            self.kv.all_quantized(caches)
        return caches

    def chunk(self, budget: int | None = None) -> int:
        """Prefill the next chunk alone (see :meth:`next_take`)."""
        self._start()
        n = self.next_take(budget)
        if n > 0:
            tokens = mx.array(self.prompt[self.done : self.done + n])
            self.model(tokens[None], cache=self.caches)
            if self.kv is not None and self.done + n == self.quantize_at():
                self.kv.after_forward(self.caches)
            mx.eval([c.state for c in self.caches])
            self.advanced(n, lambda: [clone(c) for c in self.caches])
            mx.clear_cache()
        return n

    def advanced(self, n: int, snapshot) -> None:
        """``n`` more prompt tokens are in; keep ``snapshot()`` at a boundary."""
        self.done += n
        if self.done in self.snapshot_at:
            self.snapshots.append((self.done, snapshot()))

    def _start(self) -> None:
        self.started = True
        if self.caches is None:
            self.caches = make_prompt_cache(self.model)

    def slot(self) -> Slot:
        sampler, processors = build_sampling(self.params)
        context = TokenBuffer(self.prompt[:-1]) if processors else None
        return Slot(
            self.params, sampler, processors, context, row_id=self.row_id,
            stop_ids=self.stop_ids, left=self.params.max_tokens, prompt=self.prompt,
        )  # fmt: skip

    def prime(self) -> Batch:
        """Forward the last prompt token and sample the first token: a slot for
        this row and one for each fork, all on this row's solo caches (split
        into one-row batches by ``Batch.forked``)."""
        self._start()
        slots = [self.slot(), *(fork.slot() for fork in self.forks)]
        batch = Batch(self.model, slots, self.caches, batched=False, kv=self.kv)
        batch.next_tokens = mx.array(self.prompt[-1:])
        batch.forward()
        return batch

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches) if self.caches else 0


def prefill_together(jobs: Sequence[Prefill]) -> Batch:
    """Prefill several joiners' remaining prompts as one padded batch and prime
    them together: one batched :class:`Batch` whose first tokens are pending.

    As mlx-lm's ``PromptProcessingBatch``: the rows' caches are merged (mlx-lm's
    ``merge`` left-pads what a prompt-cache take already holds), each chunk is
    right-padded to its widest row with the cache told the lengths
    (``prepare``), and ``finalize`` rolls the pads to the left, where the batch
    mask hides them (a finite bias; see docs/batching.md). A row takes at most
    ``step_size`` tokens a chunk and stops at its snapshot boundaries, where its
    KV is extracted for the prompt cache. Only for caches that take padding
    exactly (plain ``KVCache``); the caller checks. Under quantized KV, only
    fresh rows whose prompts end where mlx-lm quantizes them (``quantize_at``):
    their float prefill, then the caches quantized, row by row the same bits
    as mlx-lm's (quantization is per token; a snapshot taken at a row's end is
    quantized as its solo caches would be)."""
    for job in jobs:
        job._start()
    caches = merge([job.caches for job in jobs])
    for job in jobs:
        job.caches = None  # the rows' KV lives in the batch now
    while any(job.remaining > 0 for job in jobs):
        takes = [job.next_take() for job in jobs]
        width = max(takes)
        pads = [width - n for n in takes]
        rows = [
            job.prompt[job.done : job.done + n] + [0] * p
            for job, n, p in zip(jobs, takes, pads, strict=True)
        ]
        if max(pads) > 0:
            for c in caches:
                c.prepare(lengths=takes, right_padding=pads)
        jobs[0].model(mx.array(rows), cache=caches)
        if max(pads) > 0:
            for c in caches:
                c.finalize()
        mx.eval([c.state for c in caches])
        for i, (job, n) in enumerate(zip(jobs, takes, strict=True)):
            job.advanced(n, lambda i=i, job=job: job.at_quantize(extracted(caches, i)))
        mx.clear_cache()
    kv = jobs[0].kv
    if kv is not None:
        kv.all_quantized(caches)
    batch = Batch(jobs[0].model, [job.slot() for job in jobs], caches, batched=True)
    batch.next_tokens = mx.array([job.prompt[-1] for job in jobs])
    batch.forward()
    return batch
