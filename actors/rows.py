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

import itertools
import time
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import (
    BatchKVCache,
    CacheList,
    KVCache,
    TokenBuffer,
    make_prompt_cache,
)
from mlx_lm.sample_utils import greedy_sampler, make_logits_processors, make_sampler

from . import cpu_softmax, ragged
from .gpu import calls_begun
from .prompt_cache import clone
from .ranks import Mirrored, mirrored
from .request import SamplingParams, TopLogprob
from .speculate import PACE_PRIOR, Drafter, DraftModel, Gate, Matches, ModelDrafter, SharedIndex


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


@attrs.frozen
class Read:
    """What one step read from one slot: its tokens in order (a plain step reads
    one, a verify step one and the drafts it kept; none when its pending token was
    read at prime and no draft was kept), and what it drafted: ``drafted`` tokens
    by ``drafter``, ``accepted`` of them kept."""

    tokens: tuple[Sampled, ...]
    drafter: str | None = None
    drafted: int = 0
    accepted: int = 0


@attrs.define(eq=False)
class Speculation:
    """The running batch's drafting: the gate that sizes each step, the index
    shared by every row, the most drafts a row carries into a step, and the
    draft model where one is loaded."""

    max_draft: int
    gate: Gate = attrs.field(factory=Gate)
    shared: SharedIndex | None = attrs.field(factory=SharedIndex)
    matches: Matches = attrs.field(factory=Matches)
    draft: DraftModel | None = None  # a draft model drafts instead of the n-gram indexes
    # verify steps' logsumexp in the CPU library (``--cpu-softmax``), mlx's bits
    library: bool = True


@attrs.frozen
class _Plan:
    """What the slots could draft before a step: the gate's offers (drafter, tokens
    proposed, whether the pending token is guessed) and each slot's proposal."""

    offers: list[tuple[Drafter, int, bool]]
    proposals: list[list[int]]
    ends: list[float]  # each live row's steps_left: the offering rows' first


@attrs.frozen
class _Verified:
    """A verify step whose cost the gate gets at the next step (``Batch._settle``):
    its rows and width, when it started (its pending tokens in) and the GPU call
    it ran in, and its seconds up to its rollback."""

    rows: int
    width: int
    start: float
    seconds: float
    call: int = attrs.field(factory=calls_begun)


@attrs.frozen
class _Offer:
    """One slot's drafts for a verify step (``tokens`` follow its pending token)."""

    tokens: list[int]
    drafter: str


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
    # Drafting (speculate.py). The row's ids that end it, and how many tokens it
    # may still read, so a verify step keeps no draft past its end (Row.accept
    # decides the same on the event loop); its prompt, for its drafter, made when
    # it joins a batch that drafts.
    stop_ids: frozenset[int] = frozenset()
    left: int = 0
    read: int = 0  # tokens read, and steps taken, in this batch: its pace
    steps: int = 0
    prompt: list[int] | None = attrs.field(default=None, repr=False)
    drafter: Drafter | None = None
    pending_known: bool = False  # the pending token is evaluated and in the drafter
    first: int | None = None  # its first token, read at prime (for its drafter)
    # Where its first tokens sit in the batch KV buffer, relative to its left
    # padding, in token order (the tokens after them sit in order after them);
    # None: all in order. Verify steps reorder a row's keys (Batch._roll_back);
    # taking its KV out puts them back in order.
    order: list[int] | None = attrs.field(default=None, repr=False)

    def counted(self, token: int) -> bool:
        """One more token read; True when the row ends on it."""
        self.left -= 1
        self.read += 1
        return token in self.stop_ids or self.left <= 0

    def steps_left(self) -> float:
        """Steps until it reaches its ``max_tokens`` at its pace so far (tokens
        read per step, from a prior of one a step over PACE_PRIOR steps)."""
        return self.left * (self.steps + PACE_PRIOR) / (self.read + PACE_PRIOR)

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


def _side_by_side(layer: Sequence[Any]) -> BatchKVCache | None:
    """One layer's caches, in slot order (solo ``KVCache``s and ``BatchKVCache``s),
    as one batch cache written in a single copy: each row right-aligned at the
    longest row's end, with room left for the next step's write. mlx-lm's
    ``merge`` then ``extend`` pad and concatenate, and the next write grows the
    buffer again: three copies of the whole batch, most of a second when a long
    row joins short ones (a main agent's history beside its sub-agents'). The
    rows' keys and values, padding and positions are the same. None where a
    cache is of another kind (those take mlx-lm's way)."""
    if not all(type(c) in (KVCache, BatchKVCache) and c.keys is not None for c in layer):
        return None
    ends = [c.offset if type(c) is KVCache else c._idx for c in layer]
    end = max(ends)
    size = (end // BatchKVCache.step + 1) * BatchKVCache.step
    rows = sum(c.keys.shape[0] for c in layer)
    k, v = layer[0].keys, layer[0].values
    keys = mx.zeros((rows, k.shape[1], size, k.shape[3]), k.dtype)
    values = mx.zeros((rows, v.shape[1], size, v.shape[3]), v.dtype)
    pads, offsets, at = [], [], 0
    for c, n in zip(layer, ends, strict=True):
        b, shift = c.keys.shape[0], end - n
        keys[at : at + b, :, shift:end] = c.keys[..., :n, :]
        values[at : at + b, :, shift:end] = c.values[..., :n, :]
        if type(c) is KVCache:
            pads.append(mx.array([shift]))
            offsets.append(mx.array([n]))
        else:
            pads.append(c.left_padding + shift)
            offsets.append(c.offset)
        at += b
    out = BatchKVCache([])
    out.keys, out.values, out._idx = keys, values, end
    out.left_padding, out.offset = mx.concatenate(pads), mx.concatenate(offsets)
    return out


def _make_room(caches: Sequence[Any], feed: int, live: Sequence[bool]) -> None:
    """Before a forward that writes ``feed`` positions a row into plain batch KV
    caches: where the buffers are full, grow them here, without the left padding
    every live row shares. mlx-lm grows a buffer by a copy of all of it, padding
    included. Rows refilled in place (``Batch._fill``) are written at the batch's
    write position, and nothing else trims the batch until it is compacted: under
    a steady stream of joiners the shared padding, and with it every growth copy
    and the KV held, only grew (the flood's batch of four went from 768 to 2,816
    positions for rows of 730-870 tokens). The rows' keys, values and positions
    are unchanged; a retired slot's stale KV may be cut (it is never read)."""
    kv = _first_kv(caches)
    if kv is None or kv._idx + feed <= kv.keys.shape[2]:
        return
    pads = [p for p, alive in zip(kv.left_padding.tolist(), live, strict=True) if alive]
    cut = min(pads, default=0)
    if cut < BatchKVCache.step:  # mlx-lm's own growth copies about as much
        return
    grow = (feed + BatchKVCache.step - 1) // BatchKVCache.step * BatchKVCache.step
    for c in caches:
        rows, heads, _, k_dim = c.keys.shape
        v_dim = c.values.shape[3]
        c.keys = mx.concatenate(
            [c.keys[..., cut : c._idx, :], mx.zeros((rows, heads, grow, k_dim), c.keys.dtype)],
            axis=2,
        )
        c.values = mx.concatenate(
            [c.values[..., cut : c._idx, :], mx.zeros((rows, heads, grow, v_dim), c.values.dtype)],
            axis=2,
        )
        c._idx -= cut
        c.left_padding = mx.maximum(c.left_padding - cut, 0)


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


def _extracted(caches: Sequence[Any], i: int, order: list[int] | None = None) -> list[Any]:
    """Row ``i``'s caches out of a batch, copied now: a lazy extract would keep
    the whole batch buffer alive in the prompt cache (and stop the batch's next
    write into it from happening in place). ``order``: where its tokens sit
    (see ``Slot.order``), gathered back into token order."""
    out = [c.extract(i) if order is None else _gathered(c, i, order) for c in caches]
    mx.eval([c.state for c in out])
    return out


def _gathered(cache: BatchKVCache, i: int, order: list[int]) -> KVCache:
    """Row ``i`` of a batch KV cache, its tokens gathered into token order
    (``order`` for its first tokens; the rest were written in order after them)."""
    pad = cache.left_padding[i].item()
    at = mx.array([*order, *range(len(order), cache._idx - pad)]) + pad
    out = KVCache()
    out.keys = mx.contiguous(cache.keys[i : i + 1, :, at])
    out.values = mx.contiguous(cache.values[i : i + 1, :, at])
    out.offset = at.size
    return out


def fit(caches: list[Any], n: int) -> list[Any]:
    """A leaving row's caches cut to its first ``n`` tokens: a step may have fed
    it more than it read before it ended (a verify step's drafts past its end)."""
    for c in caches:
        if type(c) is KVCache and c.offset > n:
            c.trim(c.offset - n)
    return caches


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
    # The running batch's drafting (None: plain steps only; a joiner's batch).
    spec: Speculation | None = None
    # The last plain step: (rows, when it started, the GPU call it ran in), for the
    # gate's cost figures.
    _plain_at: tuple[int, float, int] | None = attrs.field(default=None, repr=False)
    _verified: _Verified | None = attrs.field(default=None, repr=False)  # the last verify step

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
        if not self.caches or self.spec is None:
            return False
        kind = BatchKVCache if self.batched else KVCache
        return all(type(c) is kind for c in self.caches)

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
        if joiners:  # the next step's period would hold this join
            self._plain_at = None
            self._settle(clean=False)
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
            self.slots = list(other.slots)
        else:
            layers = [_side_by_side(c) for c in zip(*(p.caches for p in parts), strict=True)]
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
            self.next_logprobs = [lp for p in parts for lp in p.next_logprobs]
            self.slots = [s for p in parts for s in p.slots]
        for j in joiners:
            j.slots, j.caches, j.next_tokens, j.next_logprobs = [], None, None, []
        self._drafters()

    def _drafters(self) -> None:
        """Give each newly joined slot its drafter (its prompt and first token
        indexed), where this batch drafts and the row allows it."""
        if self.spec is None:
            return
        for slot in self.slots:
            if slot.drafter is not None or slot.prompt is None or slot.dead:
                continue
            asked = slot.params.max_draft
            limit = self.spec.max_draft if asked is None else min(asked, self.spec.max_draft)
            if limit > 0 and not slot.processors and slot.first is not None:
                shared, matches, draft = self.spec.shared, self.spec.matches, self.spec.draft
                if draft is None:
                    slot.drafter = Drafter.start(slot.prompt, shared, matches, limit)
                else:
                    slot.drafter = ModelDrafter.start(slot.prompt, shared, matches, limit, draft)
                slot.drafter.known(slot.first)  # read at prime: known
                slot.pending_known = True
            slot.prompt = None

    def remember(self, rows: Sequence[int]) -> None:
        """Rows at ``rows`` are ending: their prompts and outputs go to the shared
        index, for the rows that come after them to draft from."""
        if self.spec is None or self.spec.shared is None:
            return
        for i in rows:
            drafter = self.slots[i].drafter
            if drafter is not None:
                self.spec.shared.add(drafter.own.tokens)

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
            self._plain_at = None  # the next step's time includes this write
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
            slot.order = None  # taken out in token order
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
        saved = [_extracted(self.caches, i, self.slots[i].order) for i in save]
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

    def _make_room(self, feed: int) -> None:
        if self.reusable:
            _make_room(self.caches, feed, [not s.dead for s in self.slots])

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
            logits, contexts = self._processed(logits, inputs)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        self.next_tokens = self._sample(logprobs)
        self.next_logprobs = list(logprobs)
        mx.async_eval(self.next_tokens, self.next_logprobs, contexts)
        return inputs, contexts

    def _processed(self, logits: mx.array, inputs: mx.array) -> tuple[mx.array, list[Any]]:
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
            slot.counted(token)
            slot.first = token
            out.append(sampled)
        return out

    def step(self, waiting: bool = True) -> list[Read | None]:
        """One decode step: what it read from each slot, in batch order (None: a
        retired slot). A row whose own work failed reads as a :class:`Sampled`
        with ``error``. Plain, pipelined (start step n+1, then read step n), unless
        the gate finds drafts worth a verify step (:meth:`_verify`); ``waiting``:
        whether requests wait for a slot (the gate values drafts by it)."""
        self._settle(clean=True)
        for slot in self.slots:
            slot.steps += 1
        plan = self._offers() if self.drafts_fit else None
        if plan is not None and not self.spec.gate.stale(len(self.slots), 1):
            ends = None if waiting else plan.ends
            width = self.spec.gate.choose(len(self.slots), plan.offers, ends)
            if width:
                return self._verify(width, plan.proposals)
            for slot, proposal in zip(self.slots, plan.proposals, strict=True):
                if proposal:
                    slot.drafter.shadow_of(proposal)
        return self._plain()

    def _plain(self) -> list[Read | None]:
        """A plain step. Where it drafts, the batch also times it for the gate:
        from the last plain step's start when that one was plain too, in the GPU
        call just before this one, with the same rows (the pipeline's period:
        no join, leave or prefill chunk in between), else, when the figure is
        stale, by waiting for its forward once."""
        current_lp = self.next_logprobs
        gate, rows = self.spec.gate if self.drafts_fit else None, len(self.slots)
        timed = gate is not None and gate.stale(rows, 1)
        if timed:  # joins and leaves settled first: their copies are not the step's
            mx.eval(self.next_tokens, current_lp, [c.state for c in self.caches])
        now, call = time.perf_counter(), calls_begun()
        if gate is not None and self._plain_at is not None:
            was_rows, then, was_call = self._plain_at
            if was_rows == rows and was_call == call - 1:
                gate.observe(rows, 1, now - then)
        self._plain_at = (rows, now, call) if gate is not None else None
        self._make_room(1)
        inputs, _ = self._forward()
        if timed:
            mx.eval(self.next_tokens)
            gate.observe(rows, 1, time.perf_counter() - now)
            self._plain_at = None
        mx.eval(inputs, current_lp)
        tokens = inputs.tolist()
        out: list[Read | None] = []
        for slot, token, lp in zip(self.slots, tokens, current_lp, strict=True):
            if slot.dead:
                out.append(None)
                continue
            known, slot.pending_known = slot.pending_known, False
            if slot.drafter is not None and not known:
                slot.drafter.known(token)
            if slot.fault is not None:
                out.append(Read((Sampled(token, None, None, error=slot.fault),)))
            elif slot.pending_read:
                slot.pending_read = False
                out.append(Read(()))
            else:
                slot.counted(token)
                out.append(Read((self._read(slot, token, lp),)))
        return out

    def _offers(self) -> _Plan | None:
        """What each slot could draft now (from what its host side knows: its
        pending token only when a verify step evaluated it), for the gate."""
        offers, proposals, ends, others = [], [], [], []
        for slot in self.slots:
            drafter = slot.drafter
            proposal: list[int] = []
            n = 0
            if drafter is not None and not slot.dead and slot.fault is None and slot.left > 1:
                proposal, n, guessing = drafter.offer(slot.left, not slot.pending_known)
                if n:
                    offers.append((drafter, n, guessing))
            if not slot.dead:
                (ends if n else others).append(slot.steps_left())
            proposals.append(proposal)
        return _Plan(offers, proposals, ends + others) if offers else None

    def _verify(self, width: int, offered: list[list[int]]) -> list[Read | None]:
        """A verify step: each slot's pending token and up to ``width`` drafts in
        one forward; a slot keeps its drafts up to the first the target did not
        sample (or its end), reads its pending token and those, and its KV is
        rolled back by the rest. The pending tokens are evaluated first (the
        drafts follow them exactly); the step then waits for its own samples.
        ``offered``: each slot's proposal to the gate (a guess of its pending
        token first where that was not known), whose guess is scored now."""
        self._plain_at = None
        mx.eval(self.next_tokens, self.next_logprobs)
        t0 = time.perf_counter()
        pending = self.next_tokens.tolist()
        offers: list[_Offer | None] = []
        for slot, token, proposal in zip(self.slots, pending, offered, strict=True):
            offer = None
            if slot.drafter is not None and not slot.dead and slot.fault is None:
                if not slot.pending_known:
                    slot.drafter.known(token)
                    slot.pending_known = True
                    if proposal:
                        slot.drafter.guessed(proposal[0] == token)
                ends = token in slot.stop_ids or (slot.left <= 1 and not slot.pending_read)
                if not ends:
                    budget = slot.left - (0 if slot.pending_read else 1)
                    tokens = slot.drafter.propose(min(width, budget))
                    if tokens:
                        offer = _Offer(tokens, slot.drafter.match[0])
            offers.append(offer)
        width = max((len(o.tokens) for o in offers if o is not None), default=0)
        if width == 0:
            return self._plain()
        start, pads = 0, []
        if self.batched:
            self._make_room(width + 1)
            start, pads = self.caches[0]._idx, self.caches[0].left_padding.tolist()
        rows = [[t, *(o.tokens if o else [])] for t, o in zip(pending, offers, strict=True)]
        inputs = mx.array([r + [0] * (width + 1 - len(r)) for r in rows], dtype=mx.uint32)
        with ragged.verify_step():
            logits = self.model(inputs, cache=self.caches)
        logprobs, samples = self._sample_all(inputs, logits)
        current_lp = self.next_logprobs
        mx.eval(samples, logprobs, current_lp)
        drawn = samples.tolist()
        out: list[Read | None] = []
        kept: list[int | None] = []
        for e, slot in enumerate(self.slots):
            if slot.dead:
                out.append(None)
                kept.append(None)
                continue
            token = pending[e]
            if slot.fault is not None:
                out.append(Read((Sampled(token, None, None, error=slot.fault),)))
                kept.append(0)
                continue
            tokens, ended = [], False
            if slot.pending_read:
                slot.pending_read = False
            else:
                ended = slot.counted(token)
                tokens.append(self._read(slot, token, current_lp[e]))
            offer, a = offers[e], 0
            if offer is not None:
                while not ended and a < len(offer.tokens) and drawn[e][a] == offer.tokens[a]:
                    draft = offer.tokens[a]
                    tokens.append(self._read(slot, draft, logprobs[e, a]))
                    slot.drafter.known(draft)
                    ended = slot.counted(draft)
                    a += 1
                slot.drafter.drafted(len(offer.tokens), a)
            if slot.drafter is not None:
                slot.drafter.known(drawn[e][a])
            slot.pending_known = slot.drafter is not None
            kept.append(a)
            out.append(
                Read(tuple(tokens), offer.drafter, len(offer.tokens), a)
                if offer is not None
                else Read(tuple(tokens))
            )
        self.next_tokens = mx.array([drawn[e][k or 0] for e, k in enumerate(kept)], mx.uint32)
        self.next_logprobs = [logprobs[e, k or 0] for e, k in enumerate(kept)]
        self._roll_back(kept, width, start, pads)
        self._verified = _Verified(len(self.slots), width + 1, t0, time.perf_counter() - t0)
        return out

    def _settle(self, clean: bool) -> None:
        """Give the gate the last verify step's cost: from its start (its pending
        tokens in) to the next step's start, where the next GPU call is that step
        (``clean``): the host's work on what it read runs with no forward in
        flight, unlike a plain step's, and is its cost too; else up to its
        rollback (a join, a leave or a prefill chunk ran in between)."""
        done, self._verified = self._verified, None
        if done is not None and self.spec is not None:
            clean = clean and calls_begun() == done.call + 1
            seconds = time.perf_counter() - done.start if clean else done.seconds
            self.spec.gate.observe(done.rows, done.width, seconds)

    def _sample_all(self, inputs: mx.array, logits: mx.array) -> tuple[mx.array, mx.array]:
        """The target's token at every position of a verify step, per row: its
        sampler over each position's logprobs, as in a plain step (a row with
        processors drafts nothing, so they run on its first position only)."""
        if any(s.processors for s in self.slots):
            first, _ = self._processed(logits[:, 0], inputs[:, 0])
            logits = mx.concatenate([first[:, None], logits[:, 1:]], axis=1)
        if self.spec.library:  # mlx's bits, many lanes wide (the step waits anyway)
            logprobs = logits - cpu_softmax.logsumexp(logits)
        else:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return logprobs, self._sample(logprobs)  # samplers take any leading shape

    def _roll_back(self, kept: list[int | None], width: int, start: int, pads: list[int]) -> None:
        """Take the drafts each row did not keep (``width`` minus ``kept``) out of
        its KV. A lone row's caches are trimmed. A batch is trimmed by the fewest
        any row rejected; a row that rejected more has that many stale slots
        left before the write position: its first tokens are copied into them
        and its left padding moved past where they were. Attention does not care
        where in the buffer a key sits (its position is rotated into it), so a
        few slots are copied instead of the row; the row's token order is kept
        on its slot (``Slot.order``) for when its KV is taken out. ``start`` is
        where the step began writing, ``pads`` the rows' left padding then."""
        rejected = [None if k is None else width - k for k in kept]
        least = min((r for r in rejected if r is not None), default=0)
        for c in self.caches:
            c.trim(least)
        if not self.batched:
            return
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
            return
        b, s, d, by = mx.array(rows), mx.array(src), mx.array(dst), mx.array(shifts)
        for c in self.caches:
            c.keys[b, :, d] = c.keys[b, :, s]
            c.values[b, :, d] = c.values[b, :, s]
            c.offset = c.offset - by
            c.left_padding = c.left_padding + by
        self.copied += sum(c.keys[:1, :, :1].nbytes * 2 for c in self.caches) * len(rows)

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
    stop_ids: frozenset[int] = frozenset()  # the row's, carried into its slot

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
        return Slot(
            self.params, sampler, processors, context, row_id=self.row_id,
            stop_ids=self.stop_ids, left=self.params.max_tokens, prompt=self.prompt,
        )  # fmt: skip

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
