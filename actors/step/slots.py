"""A row's sampling state inside a batch, and what a step reads from it.

Everything here runs on the GPU thread (samplers and processors hold arrays).
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import TokenBuffer
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
    make_sampler,
)

from ..request import SamplingParams, TopLogprob


class SeededSampler:
    """A seeded row's draws, whatever its neighbours and however its steps are cut:
    its answer's ``i``-th token is drawn with a key of its own, made from the seed
    and ``i`` (mlx-lm's sampling otherwise: the same top-p, min-p and top-k, then
    a categorical draw at the temperature). A call draws the next token, or one a
    position (a verify step's ``(1, L, vocab)``); :meth:`keep` then says how many
    of those draws the row used, so the next call draws the token after them."""

    def __init__(self, seed: int, params: SamplingParams):
        self.seed = (seed >> 32, seed & 0xFFFFFFFF)
        self.temp = params.temperature
        self.top_p, self.min_p, self.top_k = params.top_p, params.min_p, params.top_k
        self.drawn = 0  # the index of the next token to draw
        self.began = 0  # where the last call's draws began

    def key(self, i: int) -> mx.array:
        hi, lo = self.seed
        return mx.random.split(mx.array([(hi + i) & 0xFFFFFFFF, lo], mx.uint32))[0]

    def __call__(self, logprobs: mx.array) -> mx.array:
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0.0:
            logprobs = apply_min_p(logprobs, self.min_p, 1)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        flat = logprobs.reshape(-1, logprobs.shape[-1]) * (1 / self.temp)
        self.began = self.drawn
        draws = [mx.random.categorical(flat[i], key=self.key(self.drawn + i))
                 for i in range(flat.shape[0])]  # fmt: skip
        self.drawn += len(draws)
        return mx.stack(draws).reshape(logprobs.shape[:-1])

    def keep(self, used: int) -> None:
        """Of the last call's draws, the row used the first ``used``."""
        self.drawn = self.began + used


def build_sampling(params: SamplingParams):
    """mlx-lm's sampler and logits processors for one row (GPU thread: they hold
    arrays); a seeded row's sampler draws with keys of its own."""
    if params.greedy:
        sampler = greedy_sampler  # one shared object: an all-greedy batch samples once
    elif params.seed is not None:
        sampler = SeededSampler(params.seed, params)
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


# A row's steps left are its tokens left to max_tokens over its pace so far: tokens
# read per step, from a prior of one a step over this many steps (``Slot.steps_left``).
PACE_PRIOR = 8

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


@attrs.frozen
class LogprobReads:
    """The logprobs a step's rows asked for, as one graph for the whole batch:
    each asking row's chosen token's logprob and its top-N (N the most any row
    asks), read with the step's tokens in its one wait on the device."""

    rows: list[int]  # the asking rows' batch indices
    tops: list[int]  # how many alternatives each asks
    chosen: mx.array  # (rows,)
    top_ids: mx.array | None  # (rows, N), unordered
    top_values: mx.array | None

    @classmethod
    def of(cls, slots: list[Slot], tokens: mx.array | None,
           logprobs: list[mx.array]) -> LogprobReads | None:  # fmt: skip
        """The reads for ``tokens`` (one a slot) under ``logprobs``; None when no
        live slot asks."""
        rows = [e for e, s in enumerate(slots) if s.params.wants_logprobs and not s.dead]
        if not rows or tokens is None:
            return None
        lp = mx.stack([logprobs[e] for e in rows])
        chosen = mx.take_along_axis(lp, tokens[mx.array(rows)][:, None], axis=-1)[:, 0]
        tops = [slots[e].params.top_logprobs for e in rows]
        ids = values = None
        if k := max(tops):
            ids = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
            values = mx.take_along_axis(lp, ids, axis=-1)
        return cls(rows, tops, chosen, ids, values)

    @property
    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top_ids, self.top_values) if a is not None]

    def read(self) -> dict[int, tuple[float, tuple[TopLogprob, ...] | None]]:
        """Each asking row's (logprob, top-N) by batch index, as plain Python
        (the arrays already evaluated)."""
        chosen = self.chosen.tolist()
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        values = self.top_values.tolist() if self.top_values is not None else None
        out = {}
        for i, (e, k) in enumerate(zip(self.rows, self.tops, strict=True)):
            top = None
            if k:
                pairs = sorted(zip(ids[i], values[i], strict=True), key=lambda p: -p[1])[:k]
                top = tuple(TopLogprob(int(t), float(v)) for t, v in pairs)
            out[e] = (chosen[i], top)
        return out


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
    # Drafting (actors/speculation/). The row's ids that end it, and how many tokens it
    # may still read, so a verify step keeps no draft past its end (Row.accept
    # decides the same on the event loop); its prompt, for its drafter, made when
    # it joins a batch that drafts.
    stop_ids: frozenset[int] = frozenset()
    left: int = 0
    read: int = 0  # tokens read, and steps taken, in this batch: its pace
    steps: int = 0
    prompt: list[int] | None = attrs.field(default=None, repr=False)
    pending_known: bool = False  # the pending token is evaluated and in its drafter
    first: int | None = None  # its first token, read at prime (for its drafter)
    # Where its first tokens sit in the batch KV buffer, relative to its left
    # padding, in token order (the tokens after them sit in order after them);
    # None: all in order. Verify steps reorder a row's keys (``Batch.roll_back``);
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

    def sampled(self, token: int, logprobs: mx.array) -> Sampled:
        """The token read, with its logprobs where asked; a failure there is this row's fault."""
        try:
            logprob, top = read_logprobs(logprobs, token, self.params)
        except Exception as exc:
            self.fault = row_fault(exc)
            return Sampled(token, None, None, error=self.fault)
        return Sampled(token, logprob, top)

    @classmethod
    def retired(cls) -> Slot:
        return cls(SamplingParams(), greedy_sampler, [], None, dead=True)
