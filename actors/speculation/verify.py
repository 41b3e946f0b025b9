"""Speculation's side of the running batch: offers, the verify step, its rollback.

A :class:`Verifier` rides on a :class:`batch.Batch` that drafts (GPU thread),
which reaches it only through ``batch.Verifying``, the surface below. Before
each step the batch asks it for a verify step (:meth:`Verifier.step`); the gate
(``speculation.gate.Gate``) sizes it from what the slots' drafters offer and from what
steps cost, which the verifier measures: plain steps' periods
(:meth:`Verifier.plain_clock`) and verify steps' spans (:meth:`Verifier.settle`). A
verify step feeds each slot's pending token and its drafts in one forward, keeps
each row's drafts up to the first the target did not sample, and rolls the rest
out of the KV (:meth:`Verifier.roll_back`). The batch tells it of joins
(:meth:`Verifier.interrupted`) and hands it new slots (:meth:`Verifier.drafters`)
and ending ones (:meth:`Verifier.remember`); nothing else crosses.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence

import attrs
import mlx.core as mx

from ..kernels import cpu_attention, ragged
from ..models.vision import shows_images
from ..step.batch import Batch, greedy, ties
from ..step.calls import calls_begun
from ..step.slots import Read, Sampled, SeededSampler, Slot
from .drafters import Drafter, DraftModel, Matches, ModelDrafter, SharedIndex
from .gate import Gate


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
    """A verify step whose cost the gate gets at the next step (:meth:`Verifier.settle`):
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


@attrs.frozen
class _Clock:
    """A plain step being timed by waiting for its forward (the gate's figure is stale)."""

    rows: int
    start: float


@attrs.define(eq=False)
class Verifier:
    """Drafting for one running batch: the gate's figures, the verify step."""

    spec: Speculation
    # The last plain step: (rows, when it started, the GPU call it ran in), for the
    # gate's cost figures.
    _plain_at: tuple[int, float, int] | None = attrs.field(default=None, repr=False)
    _verified: _Verified | None = attrs.field(default=None, repr=False)  # the last verify step
    # Each drafting slot's drafter (a slot leaves the batch: its entry goes with it).
    _drafters: weakref.WeakKeyDictionary[Slot, Drafter] = attrs.field(
        factory=weakref.WeakKeyDictionary, repr=False)

    # -- what the batch tells it ------------------------------------------------

    def interrupted(self) -> None:
        """A join comes before the next step: the next period would hold it, and
        the last verify step's cost ends at its rollback."""
        self._plain_at = None
        self.settle(clean=False)

    def unclocked(self) -> None:
        """Something not the step's ran since the last plain step (a row written in place)."""
        self._plain_at = None

    def drafters(self, slots: Sequence[Slot]) -> None:
        """Give each newly joined slot its drafter (its prompt and first token
        indexed), where the row allows it."""
        spec = self.spec
        for slot in slots:
            if slot in self._drafters or slot.prompt is None or slot.dead:
                continue
            asked = slot.params.max_draft
            limit = spec.max_draft if asked is None else min(asked, spec.max_draft)
            if limit > 0 and not slot.processors and slot.first is not None:
                if spec.draft is None or shows_images(slot.prompt):  # images: n-gram drafts
                    drafter = Drafter.start(slot.prompt, spec.shared, spec.matches, limit)
                else:
                    drafter = ModelDrafter.start(
                        slot.prompt, spec.shared, spec.matches, limit, spec.draft
                    )
                self._drafters[slot] = drafter
                drafter.known(slot.first)  # read at prime: known
                slot.pending_known = True
            slot.prompt = None

    def known(self, slot: Slot, token: int) -> None:
        """A plain step read ``slot``'s pending ``token``: its drafter learns it."""
        drafter = self._drafters.get(slot)
        if drafter is not None:
            drafter.known(token)

    def remember(self, slots: Sequence[Slot]) -> None:
        """These slots' rows are ending: their prompts and outputs go to the shared
        index, for the rows that come after them to draft from."""
        if self.spec.shared is None:
            return
        for slot in slots:
            drafter = self._drafters.pop(slot, None)
            if drafter is not None:
                self.spec.shared.add(drafter.own.tokens)

    # -- the step ---------------------------------------------------------------

    def step(self, batch: Batch, waiting: bool) -> list[Read | None] | None:
        """A verify step where the gate finds drafts worth one, else None (a plain
        step follows; the slots' proposals are shadowed to score them)."""
        plan = self._offers(batch.slots)
        rows = len(batch.slots)
        if plan is None or self.spec.gate.stale(rows, 1):
            return None
        width = self.spec.gate.choose(rows, plan.offers, None if waiting else plan.ends)
        if width:
            return self._verify(batch, width, plan.proposals)
        for slot, proposal in zip(batch.slots, plan.proposals, strict=True):
            if proposal:
                self._drafters[slot].shadow_of(proposal)
        return None

    def plain_clock(self, batch: Batch) -> _Clock | None:
        """Before a plain step's forward: time it for the gate, from the last plain
        step's start when that one was plain too, in the GPU call just before this
        one, with the same rows (the pipeline's period: no join, leave or prefill
        chunk in between). Where the figure is stale, a :class:`_Clock`: the step
        then waits for its forward once (:meth:`plain_timed`). Nothing is timed
        where the batch cannot verify at all (its caches cannot be cut back)."""
        if not batch.drafts_fit:
            self._plain_at = None
            return None
        gate, rows = self.spec.gate, len(batch.slots)
        timed = gate.stale(rows, 1)
        if timed:  # joins and leaves settled first: their copies are not the step's
            mx.eval(batch.next_tokens, batch.next_logprobs, [c.state for c in batch.caches])
        now, call = time.perf_counter(), calls_begun()
        if self._plain_at is not None:
            was_rows, then, was_call = self._plain_at
            if was_rows == rows and was_call == call - 1:
                gate.observe(rows, 1, now - then)
        self._plain_at = (rows, now, call)
        return _Clock(rows, now) if timed else None

    def plain_timed(self, batch: Batch, clock: _Clock) -> None:
        """A stale figure's plain step: wait for its forward and give the gate its time."""
        mx.eval(batch.next_tokens)
        self.spec.gate.observe(clock.rows, 1, time.perf_counter() - clock.start)
        self._plain_at = None

    def settle(self, clean: bool) -> None:
        """Give the gate the last verify step's cost: from its start (its pending
        tokens in) to the next step's start, where the next GPU call is that step
        (``clean``): the host's work on what it read runs with no forward in
        flight, unlike a plain step's, and is its cost too; else up to its
        rollback (a join, a leave or a prefill chunk ran in between)."""
        done, self._verified = self._verified, None
        if done is not None:
            clean = clean and calls_begun() == done.call + 1
            seconds = time.perf_counter() - done.start if clean else done.seconds
            self.spec.gate.observe(done.rows, done.width, seconds)

    def _offers(self, slots: Sequence[Slot]) -> _Plan | None:
        """What each slot could draft now (from what its host side knows: its
        pending token only when a verify step evaluated it), for the gate."""
        offers, proposals, ends, others = [], [], [], []
        for slot in slots:
            drafter = self._drafters.get(slot)
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

    def _verify(
        self, batch: Batch, width: int, offered: list[list[int]]
    ) -> list[Read | None] | None:
        """A verify step: each slot's pending token and up to ``width`` drafts in
        one forward; a slot keeps its drafts up to the first the target did not
        sample (or its end), reads its pending token and those, and its KV is
        rolled back by the rest. The pending tokens are evaluated first (the
        drafts follow them exactly); the step then waits for its own samples.
        ``offered``: each slot's proposal to the gate (a guess of its pending
        token first where that was not known), whose guess is scored now. None
        when no slot drafts after all (a plain step follows)."""
        self._plain_at = None
        pending = batch.resolve()
        if not batch.from_logits():  # else no row reads them: left unevaluated
            mx.eval(batch.next_logprobs)
        t0 = time.perf_counter()
        offers = [
            self._offer(slot, token, proposal, width)
            for slot, token, proposal in zip(batch.slots, pending, offered, strict=True)
        ]
        width = max((len(o.tokens) for o in offers if o is not None), default=0)
        if width == 0:
            return None
        start, pads = 0, []
        if batch.batched:
            batch.make_room(width + 1)
            start, pads = batch.caches[0]._idx, batch.caches[0].left_padding.tolist()
        rows = [[t, *(o.tokens if o else [])] for t, o in zip(pending, offers, strict=True)]
        inputs = mx.array([r + [0] * (width + 1 - len(r)) for r in rows], dtype=mx.uint32)
        with ragged.verify_step():
            logits = batch.model(inputs, cache=batch.caches)
        logprobs, samples, near = self._sample_all(batch, inputs, logits)
        current_lp = batch.next_logprobs
        if near is None:
            mx.eval(samples, logprobs, current_lp)
            drawn = samples.tolist()
        else:
            mx.eval(samples, near)
            drawn = _exact(batch, samples.tolist(), near.tolist(), logprobs)
        out: list[Read | None] = []
        kept: list[int | None] = []
        for e, slot in enumerate(batch.slots):
            read, k = self._settled_row(slot, pending[e], current_lp[e], offers[e], drawn[e],
                                        logprobs[e])  # fmt: skip
            out.append(read)
            kept.append(k)
        batch.settle(mx.array([drawn[e][k or 0] for e, k in enumerate(kept)], mx.uint32),
                     [logprobs[e, k or 0] for e, k in enumerate(kept)])
        batch.roll_back(kept, width, start, pads)
        batch.settle_precision()
        self._verified = _Verified(len(batch.slots), width + 1, t0, time.perf_counter() - t0)
        return out

    def _offer(self, slot: Slot, token: int, proposal: list[int],
               width: int) -> _Offer | None:  # fmt: skip
        """One slot's drafts after its pending ``token`` (now known: its guess scored)."""
        drafter = self._drafters.get(slot)
        if drafter is None or slot.dead or slot.fault is not None:
            return None
        if not slot.pending_known:
            drafter.known(token)
            slot.pending_known = True
            if proposal:
                drafter.guessed(proposal[0] == token)
        if token in slot.stop_ids or (slot.left <= 1 and not slot.pending_read):
            return None
        budget = slot.left - (0 if slot.pending_read else 1)
        tokens = drafter.propose(min(width, budget))
        return _Offer(tokens, drafter.match[0]) if tokens else None

    def _settled_row(
        self, slot: Slot, token: int, token_lp: mx.array, offer: _Offer | None,
        drawn: list[int], logprobs: mx.array,
    ) -> tuple[Read | None, int | None]:  # fmt: skip
        """What one slot read from a verify step (its pending ``token``, then its
        drafts while the target drew the same), and how many drafts it kept."""
        if slot.dead:
            return None, None
        if slot.fault is not None:
            return Read((Sampled(token, None, None, error=slot.fault),)), 0
        tokens, ended = [], False
        if slot.pending_read:
            slot.pending_read = False
        else:
            ended = slot.counted(token)
            tokens.append(slot.sampled(token, token_lp))
        a, drafter = 0, self._drafters.get(slot)
        if offer is not None and drafter is not None:
            while not ended and a < len(offer.tokens) and drawn[a] == offer.tokens[a]:
                draft = offer.tokens[a]
                tokens.append(slot.sampled(draft, logprobs[a]))
                drafter.known(draft)
                ended = slot.counted(draft)
                a += 1
            drafter.drafted(len(offer.tokens), a)
        if isinstance(slot.sampler, SeededSampler):
            slot.sampler.keep(a + 1)  # the drafts it kept, and the token after them
        if drafter is not None:
            drafter.known(drawn[a])
        slot.pending_known = drafter is not None
        if offer is None:
            return Read(tuple(tokens)), a
        return Read(tuple(tokens), offer.drafter, len(offer.tokens), a), a

    def _sample_all(
        self, batch: Batch, inputs: mx.array, logits: mx.array
    ) -> tuple[mx.array, mx.array, mx.array | None]:
        """The target's token at every position of a verify step, per row: its
        sampler over each position's logprobs, as in a plain step (a row with
        processors drafts nothing, so they run on its first position only); and
        where the batch may take greedy tokens from the logits, as a plain step
        does (``Batch.from_logits``), each one's near index (else None), the
        logprobs then left unevaluated unless read."""
        if batch.from_logits() and logits.dtype == mx.float32:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return logprobs, *greedy(logits)
        if any(s.processors for s in batch.slots):
            first, _ = batch.processed(logits[:, 0], inputs[:, 0])
            logits = mx.concatenate([first[:, None], logits[:, 1:]], axis=1)
        if self.spec.library:  # mlx's bits, many lanes wide (the step waits anyway)
            logprobs = logits - cpu_attention.logsumexp(logits)
        else:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return logprobs, batch.sample(logprobs), None  # samplers take any leading shape


def _exact(batch: Batch, drawn: list[list[int]], near: list[list[int]],
           logprobs: mx.array) -> list[list[int]]:  # fmt: skip
    """A verify step's greedy tokens taken from the logits (``drawn``, a row a
    slot, a position a column), each made mlx-lm's where a near tie may have
    changed it (``step.batch.ties``; a retired slot's are never read)."""
    width = len(drawn[0])
    flat = [t for row in drawn for t in row]
    close = [t if s.dead else n for s, row, nrow in zip(batch.slots, drawn, near, strict=True)
             for t, n in zip(row, nrow, strict=True)]  # fmt: skip
    stacked = lambda at: mx.stack([logprobs[i // width, i % width] for i in at])  # noqa: E731
    for i, token in ties(flat, close, stacked).items():
        drawn[i // width][i % width] = token
    return drawn
