"""The running batch: its rows' membership, their KV, the plain decode step.

Everything here runs on the GPU actor's thread (it calls mlx). :class:`Batch` is
the continuous lane's running batch, modelled on mlx-lm's ``GenerationBatch``:
the same pipelined step (build and ``async_eval`` step n+1, then read step n),
the same per-row samplers and logits processors, and mlx-lm's own batch caches
for joins and leaves. A joiner is itself a one-row :class:`Batch` on solo
(serial-class) caches, primed once so its first token is sampled before it
joins (``joiner.py``); a lone row therefore runs the plain serial graph. Where
the batch drafts, its :class:`Verifying` (``verify.Verifier``) may run a verify
step in place of a plain one; the batch knows it only through that surface.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from ..ranks import Mirrored, SharedInputs, mirrored
from .kv import (
    BATCHED,
    SOLO,
    clone,
    extracted,
    first_kv,
    make_room,
    merge,
    nbytes,
    row_kv,
    side_by_side,
    write_row,
)  # fmt: skip
from .quantized import KvBits, arrays, first, planes, quantized_kind
from .slots import LogprobReads, Read, Sampled, Slot, row_fault
from .syncs import Phases, wait

# A greedy token is mlx-lm's argmax of the logprobs, ``logits - logsumexp(logits)``.
# Subtracting one number from every logit keeps their order, but two float32 logits
# closer than a spacing at a logprob's magnitude (below 16: 2**-20) can round to
# one logprob, and the argmax then takes the lower index. So a greedy step without
# logprobs to read takes the argmax of the logits (the logsumexp over the vocabulary
# is most of a small model's step), and checks for a logit before it within this
# (four spacings) of the top; only there is the logprobs' argmax computed (see
# ``Batch.plain``), and the tokens are mlx-lm's either way.
NEAR = 2.0**-18


def greedy(logits: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy tokens from float32 ``logits`` (any leading shape): each one's
    argmax, and its first index within NEAR of the top (where that is not the
    token, mlx-lm's may differ: :func:`ties`)."""
    top = mx.max(logits, axis=-1, keepdims=True)
    return mx.argmax(logits, axis=-1), mx.argmax(logits >= top - NEAR, axis=-1)


def ties(tokens: list[int], near: list[int],
         logprobs: Callable[[list[int]], mx.array]) -> dict[int, int]:  # fmt: skip
    """Of ``tokens`` taken from the logits (:func:`greedy`), mlx-lm's where it
    differs, by index: at each index whose near index is not its token, the
    argmax of its logprobs (``logprobs(indices)``: theirs, stacked; a wait, on
    a rare step)."""
    at = [i for i, (t, n) in enumerate(zip(tokens, near, strict=True)) if t != n]
    if not at:
        return {}
    argmax = mx.argmax(logprobs(at), axis=-1)
    wait(argmax)
    return {i: t for i, t in zip(at, argmax.tolist(), strict=True) if t != tokens[i]}


class Verifying(Protocol):
    """What the batch asks of its drafting (``verify.Verifier``)."""

    def interrupted(self) -> None:
        """A join comes before the next step."""

    def unclocked(self) -> None:
        """A row was written in place since the last plain step."""

    def drafters(self, slots: Sequence[Slot]) -> None:
        """Newly joined slots get their drafters."""

    def known(self, slot: Slot, token: int) -> None:
        """A plain step read ``slot``'s pending ``token`` (its drafter learns it)."""

    def remember(self, slots: Sequence[Slot]) -> None:
        """Ending slots' tokens go to the shared index."""

    def settle(self, clean: bool) -> None:
        """The last verify step's cost goes to the gate."""

    def step(self, batch: Batch, waiting: bool) -> list[Read | None] | None:
        """A verify step, or None for a plain one."""

    def plain_clock(self, batch: Batch) -> Any:
        """Before a plain step's forward: its timing (a clock to finish, or None)."""

    def plain_timed(self, batch: Batch, clock: Any) -> None:
        """After the forward of a plain step the clock waits for."""


def _blocks(parts: Sequence[Batch]) -> tuple[list[list[Any]], int]:
    """The parts' caches as batch caches, in slot order: each run of solo parts
    merged into one (a copy), batched parts as they are; and the bytes merged."""
    blocks: list[list[Any]] = []
    solo: list[list[Any]] = []
    merged = 0
    for part in [*parts, None]:
        if solo and (part is None or part.batched):
            blocks.append(merge(solo))
            merged += nbytes(blocks[-1])
            solo = []
        if part is not None:
            (blocks if part.batched else solo).append(part.caches)
    return blocks, merged


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
    # Where the last step took greedy tokens from the logits (``NEAR``): each row's
    # first index within NEAR of its top logit; a row where it is not its token
    # may differ from mlx-lm's. None: the pending tokens are sampled from logprobs.
    next_near: mx.array | None = None
    # KV bytes copied so far by joins and leaves (merge, extend, filter, extract).
    copied: int = 0
    refilled: int = 0  # rows written over a retired slot so far
    # The running batch's drafting (None: plain steps only; a joiner's batch).
    verifier: Verifying | None = None
    kv: KvBits | None = None  # KV quantization (None: float KV)
    phases: Phases | None = None  # the last plain step's time by phase (None: none yet)

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
    def drafts_fit(self) -> bool:
        """Whether a verify step can run here: every layer's cache can be cut back
        row by row (plain KV caches; a lone row's solo ones)."""
        if not self.caches or self.verifier is None:
            return False
        kinds = BATCHED if self.batched else SOLO
        return all(type(c) in kinds for c in self.caches)

    @property
    def reusable(self) -> bool:
        """Whether a slot can be retired and refilled in place: every layer is a
        plain batch KV cache, where a row is a stretch of one buffer."""
        return self.batched and all(type(c) in BATCHED for c in self.caches)

    def padding_waste(self) -> float:
        """Fraction of the full-attention KV width that is left padding (a
        retired slot counts whole)."""
        if not self.batched or not self.caches:
            return 0.0
        kv = first_kv(self.caches)
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
        if joiners and self.verifier is not None:
            self.verifier.interrupted()
        if joiners:
            self._one_precision(joiners)
        if joiners and self.dead:
            joiners = [j for j in joiners if self._fill(j)]
            if joiners:
                self.compact()
        if not joiners:
            self._drafters()  # for those written over retired slots
            return
        parts = ([self] if self.slots else []) + joiners
        if len(parts) == 1:
            (other,) = parts
            self.caches, self.batched = other.caches, other.batched
            self.next_tokens, self.next_logprobs = other.next_tokens, list(other.next_logprobs)
            self.next_near = other.next_near
            self.slots = list(other.slots)
        else:
            layers = [side_by_side(c) for c in zip(*(p.caches for p in parts), strict=True)]
            if all(c is not None for c in layers):
                self.caches, self.batched = layers, True
                self.copied += self.nbytes
            else:
                blocks, merged = _blocks(parts)
                base, *rest = blocks
                for other in rest:
                    for c, o in zip(base, other, strict=True):
                        c.extend(o)
                self.caches, self.batched = base, True
                self.copied += merged + self.nbytes * len(rest)
            self.next_tokens = mx.concatenate([p.next_tokens for p in parts])
            self.next_near = None
            if any(p.next_near is not None for p in parts):  # an exact row's is its token
                self.next_near = mx.concatenate([p.near for p in parts])
            self.next_logprobs = [lp for p in parts for lp in p.next_logprobs]
            self.slots = [s for p in parts for s in p.slots]
        for j in joiners:
            j.slots, j.caches, j.next_tokens, j.next_logprobs = [], None, None, []
            j.next_near = None
        self._drafters()

    def _one_precision(self, joiners: Sequence[Batch]) -> None:
        """One batch holds one precision: where this batch or a joiner holds
        quantized KV, every part is quantized before they join."""
        parts = [p for p in (self, *joiners) if p.caches]
        if self.kv is not None and any(p.quantized for p in parts):
            for p in parts:
                self.kv.all_quantized(p.caches)

    @property
    def quantized(self) -> bool:
        return bool(self.caches) and any(quantized_kind(c) for c in self.caches)

    def settle_precision(self) -> None:
        """After a forward, under ``kv``: a lone row follows mlx-lm's rule (each
        full-attention layer quantized once it holds ``kv.start`` tokens:
        ``generate``'s exactly); a batch is quantized whole once its longest row
        does (one precision a batch)."""
        if self.kv is None or not self.caches:
            return
        if not self.batched:
            self.kv.after_forward(self.caches)
            return
        kv = first_kv(self.caches)
        if kv is not None and not quantized_kind(kv) and mx.max(kv.offset).item() >= self.kv.start:
            self.kv.all_quantized(self.caches)

    def _drafters(self) -> None:
        """Newly joined slots get their drafters, where this batch drafts."""
        if self.verifier is not None:
            self.verifier.drafters(self.slots)

    def remember(self, rows: Sequence[int]) -> None:
        """Rows at ``rows`` are ending: their prompts and outputs go to the shared
        index, for the rows that come after them to draft from."""
        if self.verifier is not None:
            self.verifier.remember([self.slots[i] for i in rows])

    def _fill(self, joiner: Batch) -> bool:
        """Write the joiner's rows over retired slots where their KV fits before
        the batch's write position; True when rows are left to join otherwise."""
        width = self.caches[0]._idx
        pending = joiner.resolve()
        placed = []
        for i, slot in enumerate(joiner.slots):
            free = [d for d, s in enumerate(self.slots) if s.dead]
            rows = [row_kv(c, i, joiner.batched) for c in joiner.caches]
            if not free or any(first(k).shape[2] > width for k, _ in rows):
                continue
            d = free[0]
            for c, (k, v) in zip(self.caches, rows, strict=True):
                write_row(c, d, k, v)
                self.copied += sum(a.nbytes for a in arrays(k, v))
            self.slots[d] = slot
            self.refilled += 1
            if self.verifier is not None:  # the next step's time includes this write
                self.verifier.unclocked()
            self.next_tokens[d] = pending[i]
            if self.next_near is not None:
                self.next_near[d] = pending[i]
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
        near = self.near
        kept = [(self.slots[i], self.next_tokens[i : i + 1], near[i : i + 1], self.next_logprobs[i])
                for i in rows]  # fmt: skip
        guarded = self.next_near is not None
        saved = self.retire(rows, rows)
        out = []
        for caches, (slot, pending, close, logprobs) in zip(saved, kept, strict=True):
            slot.order = None  # taken out in token order
            alone = Batch(self.model, [slot], caches, batched=False, kv=self.kv)
            alone.next_tokens, alone.next_logprobs = pending, [logprobs]
            alone.next_near = close if guarded else None
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
        saved = [extracted(self.caches, i, self.slots[i].order) for i in save]
        self.copied += sum(nbytes(s) for s in saved)
        return saved

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only the slots at ``keep`` (indices); the rest leave and their KV is freed."""
        keep = list(keep)
        if len(keep) == len(self.slots):
            return
        self.slots = [self.slots[i] for i in keep]
        if not keep:
            self.caches, self.batched = None, False
            self.next_tokens, self.next_logprobs, self.next_near = None, [], None
            return
        if self.batched:
            for c in self.caches:
                c.filter(keep)
            self.copied += self.nbytes
        self.next_tokens = self.next_tokens[mx.array(keep)]
        if self.next_near is not None:
            self.next_near = self.next_near[mx.array(keep)]
        self.next_logprobs = [self.next_logprobs[i] for i in keep]

    def forked(self) -> list[Batch]:
        """A freshly primed batch, one per row: a prompt's forks (several slots on
        one row's solo caches) split into one-row batches whose caches view the
        same KV (nothing copied here; joining copies each into the running
        batch, as it does any joiner's). Any other batch as it is."""
        if self.batched or len(self.slots) == 1:
            return [self]
        out = []
        for i, (slot, lp) in enumerate(zip(self.slots, self.next_logprobs, strict=True)):
            caches = self.caches if i == 0 else [clone(c) for c in self.caches]
            tokens = self.next_tokens[i : i + 1]
            out.append(Batch(self.model, [slot], caches, next_tokens=tokens, next_logprobs=[lp],
                             kv=self.kv))  # fmt: skip
        return out

    # -- the step ---------------------------------------------------------------

    def make_room(self, feed: int) -> None:
        """Room for ``feed`` more positions a row (see ``kv.make_room``)."""
        if self.reusable:
            make_room(self.caches, feed, [not s.dead for s in self.slots])

    def forward(self, from_logits: bool = False) -> tuple[mx.array, list[Any]]:
        """Build step n+1 from the pending tokens; returns them and the processor contexts.

        The forward pass is shared: if it fails, the batch fails. Everything after
        it runs per row and is contained: a row whose processors or sampler raise
        gets a stand-in token (argmax of its raw logits, never read) and a
        ``fault``; the other rows' logits and samples are computed exactly as if
        it were not there (rows never mix after the forward). ``from_logits``
        (see the method): float32 logits give the tokens by their own argmax,
        the logprobs left unevaluated unless read (``NEAR``)."""
        inputs = self.next_tokens
        logits = self.model(inputs[:, None], cache=self.caches)[:, -1, :]
        if from_logits and logits.dtype == mx.float32:
            self.next_logprobs = list(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
            self.next_tokens, self.next_near = greedy(logits)
            mx.async_eval(self.next_tokens, self.next_near)
            return inputs, []
        self.next_near = None
        if len(self.slots) > logits.shape[0]:  # forks of one prompt: one row's logits
            logits = mx.repeat(logits, len(self.slots), axis=0)
            inputs = mx.repeat(inputs, len(self.slots), axis=0)
        self.settle_precision()
        contexts = []
        if any(getattr(p, "reads_tokens", False) for s in self.slots for p in s.processors):
            # A grammar mask needs this step's input tokens as numbers: start the
            # forward now, so its mask work overlaps the forward instead of delaying it.
            mx.async_eval(logits)
        if any(s.processors for s in self.slots):
            logits, contexts = self.processed(logits, inputs)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        self.next_tokens = self.sample(logprobs)
        self.next_logprobs = list(logprobs)
        mx.async_eval(self.next_tokens, self.next_logprobs, contexts)
        return inputs, contexts

    def from_logits(self) -> bool:
        """Whether the next step may take its tokens from the logits (``NEAR``):
        every live row greedy, with no processors and no logprobs to read, on
        float KV that a step can be taken back out of (:meth:`redo`), on one rank."""
        if self.kv is not None or isinstance(self.model, SharedInputs) or not self.caches:
            return False
        if not self.batched and len(self.slots) > 1:  # a prompt's forks
            return False
        kinds = BATCHED if self.batched else SOLO
        return all(type(c) in kinds for c in self.caches) and all(
            s.dead or (s.sampler is greedy_sampler and not s.processors and s.fault is None
                       and not s.params.wants_logprobs)
            for s in self.slots
        )  # fmt: skip

    @property
    def near(self) -> mx.array:
        """Each row's first index within NEAR of its top logit (an exact row's: its token)."""
        return self.next_near if self.next_near is not None else self.next_tokens

    def resolve(self) -> list[int]:
        """The pending tokens, evaluated (a wait), as mlx-lm samples them: where
        the last step took one from the logits under a near tie, the argmax of
        its logprobs instead, written back."""
        near, self.next_near = self.next_near, None
        wait(self.next_tokens, *([] if near is None else [near]))
        tokens = self.next_tokens.tolist()
        if near is not None:
            for e, token in self.exact(tokens, near.tolist(), self.next_logprobs).items():
                self.next_tokens[e] = tokens[e] = token
        return tokens

    def exact(self, tokens: list[int], near: list[int],
              logprobs: list[mx.array]) -> dict[int, int]:  # fmt: skip
        """Where a step took ``tokens`` from the logits: mlx-lm's token for each
        live row whose first near index is not its token and where it differs
        (the argmax of its logprobs: a wait, on a rare step), by batch index."""
        near = [t if s.dead else n for s, t, n in zip(self.slots, tokens, near, strict=True)]
        return ties(tokens, near, lambda rows: mx.stack([logprobs[e] for e in rows]))

    def redo(self, fixed: dict[int, int], tokens: list[int], inputs: mx.array) -> None:
        """Step n fed ``tokens`` (``inputs``), of which those at ``fixed`` were not
        mlx-lm's: take its position back out of every row's KV and build it again
        from the right ones (``tokens`` corrected in place)."""
        for e, token in fixed.items():
            tokens[e] = token
        for c in self.caches:
            c.trim(1)
        self.next_tokens = mx.array(tokens, dtype=inputs.dtype)
        self.forward(self.from_logits())

    def processed(self, logits: mx.array, inputs: mx.array) -> tuple[mx.array, list[Any]]:
        """Each row's logits (one position, ``(rows, vocab)``) through its
        processors, which first see its input token; and their contexts. A row
        whose processors raise keeps its raw logits and gets a ``fault``."""
        rows, contexts = [], []
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
        return mx.concatenate(rows, axis=0), contexts

    def sample(self, logprobs: mx.array) -> mx.array:
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
                sampled = slot.sampled(token, lp)
            slot.pending_read = True
            slot.counted(token)
            slot.first = token
            out.append(sampled)
        return out

    def step(self, waiting: bool = True) -> list[Read | None]:
        """One decode step: what it read from each slot, in batch order (None: a
        retired slot). A row whose own work failed reads as a :class:`Sampled`
        with ``error``. Plain, pipelined (start step n+1, then read step n), unless
        the verifier runs a verify step with drafts the gate finds worth it;
        ``waiting``: whether requests wait for a slot (the gate values drafts by it)."""
        if self.verifier is not None:
            self.verifier.settle(clean=True)
        for slot in self.slots:
            slot.steps += 1
        if self.drafts_fit:
            reads = self.verifier.step(self, waiting)
            if reads is not None:
                return reads
        return self.plain()

    def plain(self) -> list[Read | None]:
        """A plain step: feed each slot's pending token, sample the next, read the
        pending ones (the verifier times it where the batch drafts). One wait on
        the device: for the pending tokens, their logprobs where rows ask, while
        the step just started runs. Whatever the read needs is queued before that
        step, so the wait never waits for it too."""
        t0 = time.perf_counter()
        current_lp, current_near = self.next_logprobs, self.next_near
        reads = LogprobReads.of(self.slots, self.next_tokens, current_lp)
        if reads is not None:
            mx.async_eval(reads.arrays)
        clock = None
        if self.verifier is not None:
            clock = self.verifier.plain_clock(self)
        self.make_room(1)
        inputs, _ = self.forward(self.from_logits())
        if clock is not None:
            self.verifier.plain_timed(self, clock)
        built = time.perf_counter()
        checked = [current_lp] if current_near is None else [current_near]
        waited = wait(inputs, checked, reads.arrays if reads is not None else [])
        tokens = inputs.tolist()
        if current_near is not None and (
            fixed := self.exact(tokens, current_near.tolist(), current_lp)
        ):
            self.redo(fixed, tokens, inputs)
        read = reads.read() if reads is not None else {}
        out: list[Read | None] = []
        for e, (slot, token) in enumerate(zip(self.slots, tokens, strict=True)):
            if slot.dead:
                out.append(None)
                continue
            known, slot.pending_known = slot.pending_known, False
            if self.verifier is not None and not known:
                self.verifier.known(slot, token)
            if slot.fault is not None:
                out.append(Read((Sampled(token, None, None, error=slot.fault),)))
            elif slot.pending_read:
                slot.pending_read = False
                out.append(Read(()))
            else:
                slot.counted(token)
                logprob, top = read.get(e, (None, None))
                out.append(Read((Sampled(token, logprob, top),)))
        self.phases = Phases(built - t0, waited, time.perf_counter() - built - waited)
        return out

    def settle(self, tokens: mx.array, logprobs: list[mx.array]) -> None:
        """A verify step's outcome: each slot's next pending token and its
        logprobs (the token after the drafts it kept)."""
        self.next_tokens, self.next_logprobs, self.next_near = tokens, logprobs, None

    def roll_back(self, kept: list[int | None], width: int, start: int, pads: list[int]) -> int:
        """Take the drafts each row did not keep (``width`` minus ``kept``) out of
        its KV. A lone row's caches are trimmed. A batch is trimmed by the fewest
        any row rejected; a row that rejected more has that many stale slots
        left before the write position: its first tokens are copied into them
        and its left padding moved past where they were. Attention does not care
        where in the buffer a key sits (its position is rotated into it), so a
        few slots are copied instead of the row; the row's token order is kept
        on its slot (``Slot.order``) for when its KV is taken out. ``start`` is
        where the step began writing, ``pads`` the rows' left padding then.
        Returns the KV bytes it copied."""
        rejected = [None if k is None else width - k for k in kept]
        least = min((r for r in rejected if r is not None), default=0)
        for c in self.caches:
            c.trim(least)
        if not self.batched:
            return 0
        rows, src, dst, shifts = [], [], [], []
        for i, (slot, k) in enumerate(zip(self.slots, kept, strict=True)):
            stale = 0 if k is None else width - k - least
            shifts.append(stale)
            if not stale:
                continue
            before = start - pads[i]  # tokens it held before the step
            valid = before + 1 + k
            moving, to = min(stale, valid), max(valid, stale)
            rows += [i] * moving
            src += [pads[i] + p for p in range(moving)]
            dst += [pads[i] + to + p for p in range(moving)]
            order = slot.order or []
            slot.order = [
                (to + p if p < moving else p) - stale
                for p in itertools.chain(order, range(len(order), valid))
            ]
        if not rows:
            return 0
        b, s, d, by = mx.array(rows), mx.array(src), mx.array(dst), mx.array(shifts)
        for c in self.caches:
            for a in planes(c):
                a[b, :, d] = a[b, :, s]
            c.offset = c.offset - by
            c.left_padding = c.left_padding + by
        per_slot = sum(a[:1, :, :1].nbytes for c in self.caches for a in planes(c))
        self.copied += per_slot * len(rows)
        return per_slot * len(rows)
