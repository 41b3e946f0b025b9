"""GPU-thread state of decoding rows: per-row sampling, the batch, its step.

Everything here runs on the GPU actor's thread (it calls mlx). :class:`Batch` is
the continuous lane's running batch, modelled on mlx-lm's ``GenerationBatch``:
the same pipelined step (build and ``async_eval`` step n+1, then read step n),
the same per-row samplers and logits processors, and mlx-lm's own batch caches
for joins and leaves. A joiner is itself a one-row :class:`Batch` on solo
(serial-class) caches, primed once so its first token is sampled before it
joins; a lone row therefore runs the plain serial graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, CacheList, TokenBuffer, make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler, make_logits_processors, make_sampler

from .prompt_cache import clone
from .ranks import Mirrored, mirrored
from .request import SamplingParams, TopLogprob


def build_sampling(params: SamplingParams):
    """mlx-lm's sampler and logits processors for one row (GPU thread: they hold arrays)."""
    if params.greedy:
        sampler = greedy_sampler  # one shared object: an all-greedy batch samples once
    else:
        sampler = make_sampler(
            params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k
        )
    processors = make_logits_processors(
        logit_bias=dict(params.logit_bias) if params.logit_bias else None,
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=params.repetition_context_size,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
    )
    return sampler, processors + list(params.logits_processors)


@attrs.frozen
class Sampled:
    """One row's token read from one step, or the fault that ended the row there."""

    token: int
    logprob: float | None
    top_logprobs: tuple[TopLogprob, ...] | None
    error: str | None = None  # this row's own work (processors, sampler, logprobs) failed


def row_fault(exc: BaseException) -> str:
    return f"this request failed while generating: {type(exc).__name__}: {exc}"


def read_logprobs(
    logprobs: mx.array, token: int, params: SamplingParams
) -> tuple[float | None, tuple[TopLogprob, ...] | None]:
    """The chosen token's logprob and the top-N alternatives, as plain Python."""
    if not params.wants_logprobs:
        return None, None
    chosen = logprobs[token].item()
    top = None
    if params.top_logprobs:
        k = params.top_logprobs
        idx = mx.argpartition(-logprobs, k - 1)[:k]
        vals = logprobs[idx]
        pairs = sorted(zip(idx.tolist(), vals.tolist(), strict=True), key=lambda p: -p[1])
        top = tuple(TopLogprob(int(i), float(v)) for i, v in pairs)
    return chosen, top


@attrs.define(eq=False)
class Slot:
    """One row inside a batch: its sampling state. Never holds prompt text."""

    params: SamplingParams
    sampler: Any
    processors: list
    context: TokenBuffer | None  # tokens seen so far, kept only for processors
    # The pending token was already read (a joiner's first token, read at prime):
    # the next step feeds it and must not hand it out again.
    pending_read: bool = False
    # This row's own work failed while building a step (its processors, sampler):
    # the next read ends the row with it. Its siblings are untouched.
    fault: str | None = None
    row_id: int | None = None  # the row it holds, for the owner's bookkeeping
    # A retired row's slot: still stepped (its output never read) until a joiner
    # is written over it in place or the batch is compacted.
    dead: bool = False

    @classmethod
    def retired(cls) -> Slot:
        return cls(SamplingParams(), greedy_sampler, [], None, dead=True)


def _merge(solo: Sequence[list[Any]]) -> list[Any]:
    """Several rows' solo caches as one batch, layer by layer (mlx-lm's merge)."""
    return [type(layer[0]).merge(list(layer)) for layer in zip(*solo, strict=True)]


def _blocks(parts: Sequence[Batch]) -> tuple[list[list[Any]], int]:
    """The parts' caches as batch caches, in slot order: each run of solo parts
    merged into one (a copy), batched parts as they are; and the bytes merged."""
    blocks: list[list[Any]] = []
    solo: list[list[Any]] = []
    merged = 0
    for part in [*parts, None]:
        if solo and (part is None or part.batched):
            blocks.append(_merge(solo))
            merged += _nbytes(blocks[-1])
            solo = []
        if part is not None:
            (blocks if part.batched else solo).append(part.caches)
    return blocks, merged


def _row_kv(cache: Any, i: int, batched: bool) -> tuple[mx.array, mx.array]:
    """Row ``i``'s keys and values, shaped (1, heads, length, dim), no padding."""
    if not batched:
        return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
    pad = cache.left_padding[i].item()
    end = cache._idx
    return cache.keys[i : i + 1, :, pad:end], cache.values[i : i + 1, :, pad:end]


def _write_row(cache: BatchKVCache, d: int, keys: mx.array, values: mx.array) -> None:
    """Put one row's KV in slot ``d`` of a batch KV cache, right-aligned at its
    write position, in place (the buffer is updated, not rebuilt)."""
    n = keys.shape[2]
    start = cache._idx - n
    cache.keys[d : d + 1, :, start : cache._idx] = keys
    cache.values[d : d + 1, :, start : cache._idx] = values
    here = mx.arange(cache.left_padding.size) == d
    cache.left_padding = mx.where(here, start, cache.left_padding)
    cache.offset = mx.where(here, n, cache.offset)


def _extracted(caches: Sequence[Any], i: int) -> list[Any]:
    """Row ``i``'s caches out of a batch, copied now: a lazy extract would keep
    the whole batch buffer alive in the prompt cache (and stop the batch's next
    write into it from happening in place)."""
    out = [c.extract(i) for c in caches]
    mx.eval([c.state for c in out])
    return out


def _nbytes(caches: Sequence[Any]) -> int:
    return sum(c.nbytes for c in caches)


def _first_kv(caches: Sequence[Any]) -> BatchKVCache | None:
    for c in caches:
        if isinstance(c, CacheList):
            found = _first_kv(c.caches)
            if found is not None:
                return found
        if isinstance(c, BatchKVCache) and c.keys is not None:
            return c
    return None


@mirrored(Mirrored.BATCH)
@attrs.define(eq=False)
class Batch:
    """Rows decoding together. ``batched`` is False while the caches are one row's
    solo caches (the serial graph); the first join turns them into batch caches."""

    model: Any
    slots: list[Slot] = attrs.field(factory=list)
    caches: list[Any] | None = None
    batched: bool = False
    # Tokens sampled by the last step, fed by the next: lazily computing, one per slot.
    next_tokens: mx.array | None = None
    next_logprobs: list[mx.array] = attrs.field(factory=list)
    # KV bytes copied so far by joins and leaves (merge, extend, filter, extract).
    copied: int = 0
    refilled: int = 0  # rows written over a retired slot so far

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches) if self.caches else 0

    @property
    def dead(self) -> int:
        return sum(s.dead for s in self.slots)

    def layout(self) -> list[int | None]:
        """The row id in each slot, in batch order (None: a retired slot)."""
        return [None if s.dead else s.row_id for s in self.slots]

    @property
    def reusable(self) -> bool:
        """Whether a slot can be retired and refilled in place: every layer is a
        plain batch KV cache, where a row is a stretch of one buffer."""
        return self.batched and all(type(c) is BatchKVCache for c in self.caches)

    def padding_waste(self) -> float:
        """Fraction of the full-attention KV width that is left padding (a
        retired slot counts whole)."""
        if not self.batched or not self.caches:
            return 0.0
        kv = _first_kv(self.caches)
        if kv is None or kv._idx == 0:
            return 0.0
        pads = kv.left_padding.tolist()
        pads = [kv._idx if slot.dead else p for slot, p in zip(self.slots, pads, strict=True)]
        return sum(pads) / (len(pads) * kv._idx)

    # -- membership -------------------------------------------------------------

    def join(self, joiners: Sequence[Batch]) -> None:
        """Take the joiners' rows into this batch. First into retired slots, in
        place: only the joiner's own KV is written. The rest by cache kind: adopt
        a lone joiner's caches when the batch is empty; otherwise merge each run of
        solo caches (a lone running row's, single joiners') in one pass and extend
        the batch (compacted first, if slots are still retired) with the result
        and with each batched joiner (a group prefilled together)."""
        joiners = [j for j in joiners if j.slots]
        if joiners and self.dead:
            joiners = [j for j in joiners if self._fill(j)]
            if joiners:
                self.compact()
        if not joiners:
            return
        parts = ([self] if self.slots else []) + joiners
        if len(parts) == 1:
            (other,) = parts
            self.caches, self.batched = other.caches, other.batched
            self.next_tokens, self.next_logprobs = other.next_tokens, list(other.next_logprobs)
            self.slots = list(other.slots)
        else:
            blocks, merged = _blocks(parts)
            base, *rest = blocks
            for other in rest:
                for c, o in zip(base, other, strict=True):
                    c.extend(o)
            self.caches, self.batched = base, True
            self.copied += merged + self.nbytes * len(rest)
            self.next_tokens = mx.concatenate([p.next_tokens for p in parts])
            self.next_logprobs = [lp for p in parts for lp in p.next_logprobs]
            self.slots = [s for p in parts for s in p.slots]
        for j in joiners:
            j.slots, j.caches, j.next_tokens, j.next_logprobs = [], None, None, []

    def _fill(self, joiner: Batch) -> bool:
        """Write the joiner's rows over retired slots where their KV fits before
        the batch's write position; True when rows are left to join otherwise."""
        width = self.caches[0]._idx
        pending = joiner.next_tokens.tolist()
        placed = []
        for i, slot in enumerate(joiner.slots):
            free = [d for d, s in enumerate(self.slots) if s.dead]
            rows = [_row_kv(c, i, joiner.batched) for c in joiner.caches]
            if not free or any(k.shape[2] > width for k, _ in rows):
                continue
            d = free[0]
            for c, (k, v) in zip(self.caches, rows, strict=True):
                _write_row(c, d, k, v)
                self.copied += k.nbytes + v.nbytes
            self.slots[d] = slot
            self.refilled += 1
            self.next_tokens[d] = pending[i]
            self.next_logprobs[d] = joiner.next_logprobs[i]
            placed.append(i)
        if not placed:
            return True
        rest = [i for i in range(len(joiner.slots)) if i not in placed]
        joiner.filter(rest)
        return bool(rest)

    def retire(self, leave: Sequence[int], save: Sequence[int]) -> list[list[Any]]:
        """Rows at ``leave`` end; ``save`` rows' caches come back, in the order
        asked (a lone row's own caches without a copy, else extracted). Where slots
        can be refilled in place and rows remain, the leaving slots stay, retired:
        a joiner is written over them or :meth:`compact` drops them (a copy of the
        batch it spares when a joiner comes first). Else they are filtered out now."""
        saved = self._save(save)
        gone = set(leave)
        if self.reusable and self.dead + len(gone) < len(self.slots):
            for i in gone:
                self.slots[i] = Slot.retired()
        else:
            self.filter([i for i, s in enumerate(self.slots) if i not in gone and not s.dead])
        return saved

    def take_out(self, rows: Sequence[int]) -> list[Batch]:
        """Rows at ``rows`` leave with their whole state, each as a one-row batch
        on solo caches (its KV, its slot, its pending token): what a primed
        joiner is, so it can join again and go on exactly where it stopped."""
        kept = [(self.slots[i], self.next_tokens[i : i + 1], self.next_logprobs[i]) for i in rows]
        saved = self.retire(rows, rows)
        out = []
        for caches, (slot, pending, logprobs) in zip(saved, kept, strict=True):
            alone = Batch(self.model, [slot], caches, batched=False)
            alone.next_tokens, alone.next_logprobs = pending, [logprobs]
            out.append(alone)
        return out

    def compact(self) -> None:
        """Drop the retired slots (a copy of the rows that stay)."""
        if self.dead:
            self.filter([i for i, s in enumerate(self.slots) if not s.dead])

    def split_off(self, keep: Sequence[int], save: Sequence[int]) -> list[list[Any]]:
        """Rows not in ``keep`` leave now (filtered); ``save`` rows' caches come back."""
        saved = self._save(save)
        self.filter(keep)
        return saved

    def _save(self, save: Sequence[int]) -> list[list[Any]]:
        if save and not self.batched:
            return [self.caches]  # the lone row's own caches: no copy
        saved = [_extracted(self.caches, i) for i in save]
        self.copied += sum(_nbytes(s) for s in saved)
        return saved

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only the slots at ``keep`` (indices); the rest leave and their KV is freed."""
        keep = list(keep)
        if len(keep) == len(self.slots):
            return
        self.slots = [self.slots[i] for i in keep]
        if not keep:
            self.caches, self.batched = None, False
            self.next_tokens, self.next_logprobs = None, []
            return
        if self.batched:
            for c in self.caches:
                c.filter(keep)
            self.copied += self.nbytes
        self.next_tokens = self.next_tokens[mx.array(keep)]
        self.next_logprobs = [self.next_logprobs[i] for i in keep]

    # -- the step ---------------------------------------------------------------

    def _forward(self) -> tuple[mx.array, list[Any]]:
        """Build step n+1 from the pending tokens; returns them and the processor contexts.

        The forward pass is shared: if it fails, the batch fails. Everything after
        it runs per row and is contained: a row whose processors or sampler raise
        gets a stand-in token (argmax of its raw logits, never read) and a
        ``fault``; the other rows' logits and samples are computed exactly as if
        it were not there (rows never mix after the forward)."""
        inputs = self.next_tokens
        logits = self.model(inputs[:, None], cache=self.caches)[:, -1, :]
        contexts = []
        if any(getattr(p, "reads_tokens", False) for s in self.slots for p in s.processors):
            # A grammar mask needs this step's input tokens as numbers: start the
            # forward now, so its mask work overlaps the forward instead of delaying it.
            mx.async_eval(logits)
        if any(s.processors for s in self.slots):
            rows = []
            for e, slot in enumerate(self.slots):
                row_logits = logits[e : e + 1]
                if slot.processors and slot.fault is None:
                    try:
                        ctx = slot.context.update_and_fetch(inputs[e : e + 1])
                        for processor in slot.processors:
                            row_logits = processor(ctx, row_logits)
                        contexts.append(ctx)
                    except Exception as exc:
                        slot.fault, row_logits = row_fault(exc), logits[e : e + 1]
                rows.append(row_logits)
            logits = mx.concatenate(rows, axis=0)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        self.next_tokens = self._sample(logprobs)
        self.next_logprobs = list(logprobs)
        mx.async_eval(self.next_tokens, self.next_logprobs, contexts)
        return inputs, contexts

    def _sample(self, logprobs: mx.array) -> mx.array:
        samplers = [s.sampler for s in self.slots]
        if all(s is samplers[0] for s in samplers):
            return samplers[0](logprobs)  # all greedy: one argmax for the batch
        out = []
        for e, slot in enumerate(self.slots):
            row = logprobs[e : e + 1]
            try:
                out.append(slot.sampler(row) if slot.fault is None else mx.argmax(row, axis=-1))
            except Exception as exc:
                slot.fault = row_fault(exc)
                out.append(mx.argmax(row, axis=-1))
        return mx.concatenate(out, axis=0)

    def read_first(self) -> list[Sampled]:
        """Read the pending tokens of a freshly primed batch, one per slot (they stay
        pending: the first step feeds them and skips reading them again). A row
        whose own work failed reads as a :class:`Sampled` with ``error``: it never
        joins."""
        mx.eval(self.next_tokens, self.next_logprobs)
        tokens = self.next_tokens.tolist()
        out = []
        for slot, token, lp in zip(self.slots, tokens, self.next_logprobs, strict=True):
            sampled = Sampled(token, None, None, error=slot.fault)
            if slot.fault is None:
                sampled = self._read(slot, token, lp)
            slot.pending_read = True
            out.append(sampled)
        return out

    def step(self) -> list[Sampled | None]:
        """Start step n+1, then read step n: the tokens the last step sampled, one
        per slot in batch order (None for a token already read at prime). A row
        whose own work failed reads as a :class:`Sampled` with ``error``."""
        current_lp = self.next_logprobs
        inputs, _ = self._forward()
        mx.eval(inputs, current_lp)
        tokens = inputs.tolist()
        out: list[Sampled | None] = []
        for slot, token, lp in zip(self.slots, tokens, current_lp, strict=True):
            if slot.dead:
                out.append(None)
            elif slot.fault is not None:
                out.append(Sampled(token, None, None, error=slot.fault))
            elif slot.pending_read:
                slot.pending_read = False
                out.append(None)
            else:
                out.append(self._read(slot, token, lp))
        return out

    @staticmethod
    def _read(slot: Slot, token: int, logprobs: mx.array) -> Sampled:
        try:
            logprob, top = read_logprobs(logprobs, token, slot.params)
        except Exception as exc:
            slot.fault = row_fault(exc)
            return Sampled(token, None, None, error=slot.fault)
        return Sampled(token, logprob, top)


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

    def start_from(self, caches: list[Any] | None, cached: int) -> None:
        """Begin from a prompt-cache take (no caches: from scratch)."""
        self.caches, self.done, self.taken = caches, cached if caches else 0, True

    def forget_take(self) -> None:
        """Drop a take gone stale before the first chunk; take again later."""
        self.caches, self.done, self.taken = None, 0, False

    @property
    def remaining(self) -> int:
        """Tokens still to prefill before the last one."""
        return len(self.prompt) - 1 - self.done

    def next_take(self, budget: int | None = None) -> int:
        """Tokens the next chunk takes: at most ``step_size`` and ``budget``, and
        never past the next snapshot boundary."""
        n = min(self.step_size, self.remaining, budget or self.step_size)
        ahead = [b - self.done for b in self.snapshot_at if b > self.done]
        return min(n, *ahead) if ahead else n

    def chunk(self, budget: int | None = None) -> int:
        """Prefill the next chunk alone (see :meth:`next_take`)."""
        self._start()
        n = self.next_take(budget)
        if n > 0:
            tokens = mx.array(self.prompt[self.done : self.done + n])
            self.model(tokens[None], cache=self.caches)
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
        return Slot(self.params, sampler, processors, context, row_id=self.row_id)

    def prime(self) -> Batch:
        self._start()
        batch = Batch(self.model, [self.slot()], self.caches, batched=False)
        batch.next_tokens = mx.array(self.prompt[-1:])
        batch._forward()
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
    exactly (plain ``KVCache``); the caller checks."""
    for job in jobs:
        job._start()
    caches = _merge([job.caches for job in jobs])
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
            job.advanced(n, lambda i=i: _extracted(caches, i))
        mx.clear_cache()
    batch = Batch(jobs[0].model, [job.slot() for job in jobs], caches, batched=True)
    batch.next_tokens = mx.array([job.prompt[-1] for job in jobs])
    batch._forward()
    return batch
