"""The gate: whether a decode step drafts, and how wide (``docs/speculative.md``).

A draft costs a column of the step for every row, so the gate drafts only
where the expected tokens per step pay for the wider step at this batch size:
it keeps each width's measured cost (the verifier times plain and verify
steps), each kind of draft's odds of being kept, and chooses the width with
the most tokens per second, by a margin.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from .drafters import Drafter

# A wider step is taken only when it is expected to deliver this much more
# tokens per second than a plain one (it must beat noise in the measured costs).
MARGIN = 1.05
# Until a verify step has been measured, each extra token a step feeds is assumed
# to cost this share of the cheapest plain step (the cost model's prior; see
# ``Gate.token_cost``).
PRIOR_TOKEN_COST = 0.15
COST_DECAY = 0.8  # weight of the older figure in a step cost's moving average
# Of a few hundred steps, one in this many tries a width the gate has not
# measured lately, so a stale or unlucky figure cannot shut a width out forever.
EXPLORE_EVERY = 64
# A plain step's cost is measured by waiting for its forward (a pipeline bubble)
# when it was last measured more than this many steps ago.
REMEASURE = 32
# With nobody waiting for a slot, the rows that end last (their kept drafts end
# the batch sooner): those with at least this share of the most steps left. A
# row's steps left are its tokens left to max_tokens over its pace so far
# (tokens read per step, from a prior of one a step over PACE_PRIOR steps).
TAIL_SHARE = 0.5


def _along(
    known: dict[int, float], x: int, slope: Callable[[], float], floor: float = 0.0
) -> float:
    """The measured figure at ``x``; else the line between the measured points
    around it; else the nearest one's plus ``slope()`` per unit beyond it (at
    least ``floor``)."""
    if x in known:
        return known[x]
    below = max((k for k in known if k < x), default=None)
    above = min((k for k in known if k > x), default=None)
    if below is not None and above is not None:
        share = (x - below) / (above - below)
        return known[below] + share * (known[above] - known[below])
    nearest = below if below is not None else above
    return max(floor, known[nearest] + slope() * (x - nearest))


@attrs.define(eq=False)
class Gate:
    """The measured cost of a decode step by batch size and width (tokens fed
    per row), and the choice of each step's width.

    A step of width ``w`` costs ``cost(b, w)`` seconds and delivers, per row, one
    token plus the drafts it keeps. The gate takes the width with the most
    expected tokens per second, and a wider step only when that beats a plain
    step by :data:`MARGIN`.

    A plain step is timed nearly every step (the pipeline's period), a wider one
    only when it is taken, so the figures would age apart as the rows' contexts
    grow (attention over more keys makes every width dearer): a wider step's
    cost is kept as a multiple of the plain step's at the time it was measured,
    and priced at today's plain cost. Kept in seconds, a verify step timed early
    on short contexts (1.3 plain steps then) later looked nearly free beside
    plain steps that had grown by a third, and the gate drafted at a loss."""

    # (batch, 1): seconds; (batch, width > 1): a multiple of that batch's plain cost
    times: dict[tuple[int, int], float] = attrs.field(factory=dict)
    seen: dict[tuple[int, int], int] = attrs.field(factory=dict)  # step number last measured
    counts: dict[tuple[int, int], int] = attrs.field(factory=dict)  # measurements so far
    steps: int = 0

    def observe(self, batch: int, width: int, seconds: float) -> None:
        key = (batch, width)
        figure = seconds if width == 1 else seconds / self.plain_cost(batch)
        old = self.times.get(key)
        self.times[key] = figure if old is None else COST_DECAY * old + (1 - COST_DECAY) * figure
        self.seen[key] = self.steps
        self.counts[key] = self.counts.get(key, 0) + 1

    def stale(self, batch: int, width: int) -> bool:
        """Whether a width's cost at this batch size is unmeasured or older than
        :data:`REMEASURE` steps (the plain step's is measured on purpose then)."""
        seen = self.seen.get((batch, width))
        if seen is None or self.counts.get((batch, width), 0) < 3:
            return True
        return self.steps - seen > REMEASURE

    def cost(self, batch: int, width: int) -> float:
        """Seconds for one step: measured; else between the measured widths around
        it; else the nearest measured width's cost plus :meth:`token_cost` for
        each token more that the step feeds (``batch`` per column). With nothing
        measured at this batch size, in units of a plain step."""
        figures = {w: t for (b, w), t in self.times.items() if b == batch}
        if not figures:  # in units of a plain step
            return 1.0 + PRIOR_TOKEN_COST * batch * (width - 1)
        plain = self.plain_cost(batch)
        known = {w: t * plain if w > 1 else t for w, t in figures.items()}
        return _along(known, width, lambda: self.token_cost() * batch, known.get(1, 0.0))

    def token_cost(self) -> float:
        """Seconds one more token fed adds to a step, whatever the batch size:
        the median over measured widths of (cost - plain cost) / extra tokens.
        On a CPU a step's extra positions cost compute in proportion to the
        tokens fed (SmolLM2: 11-17 ms a token at batch 1 and at batch 8), so one
        figure carries across batch sizes, where a share of a plain step would
        not (a column at batch 8 costs eight tokens). Before any is measured:
        :data:`PRIOR_TOKEN_COST` of the cheapest plain step."""
        estimates = sorted(
            max(0.0, (t - 1) * self.times[(b, 1)] / (b * (w - 1)))
            for (b, w), t in self.times.items()
            if w > 1 and (b, 1) in self.times
        )
        if estimates:
            return estimates[len(estimates) // 2]
        plains = [t for (b, w), t in self.times.items() if w == 1]
        return PRIOR_TOKEN_COST * (min(plains) if plains else 1.0)

    def plain_cost(self, batch: int) -> float:
        """Seconds for a plain step of ``batch`` rows: measured; else between the
        measured batch sizes around it; else the nearest one's plus
        :meth:`token_cost` per row more (or less)."""
        known = {b: t for (b, w), t in self.times.items() if w == 1}
        if not known:
            return 1.0
        return _along(known, batch, self.token_cost)

    def choose(
        self,
        batch: int,
        offers: Sequence[tuple[Drafter, int, bool]],
        ends: Sequence[float] | None = None,
    ) -> int:
        """The width (extra columns) for a step whose rows offer these drafts:
        (the row's drafter, how many tokens it proposes, whether its pending token
        is guessed). 0: a plain step.

        ``ends`` (None while requests wait for a slot) gives, offer by offer and
        then for the rows that offer nothing, each row's steps left (``Slot.
        steps_left``): with nobody waiting a kept token no longer frees a slot
        for someone else, and is worth only the time it takes off the batch's
        remaining work (:meth:`_worth`)."""
        self.steps += 1
        longest = max((n for _, n, _ in offers), default=0)
        if longest == 0:
            return 0
        plain_cost = self.cost(batch, 1)
        plain = batch / plain_cost
        worth = self._worth(batch, len(offers), ends, plain_cost)
        best, best_rate = 0, plain * MARGIN
        for w in range(1, longest + 1):
            tokens = batch + worth([d.expected(min(n, w), g) for d, n, g in offers])
            rate = tokens / self.cost(batch, w + 1)
            if rate > best_rate:
                best, best_rate = w, rate
        if best == 0 and (self.steps % EXPLORE_EVERY == 0 or not self.measured_wider()):
            # a width measured long ago (or never) gets a fresh look, the widest
            # offered among equals (a verify step's fixed cost, its wait for the
            # samples, spread over more columns, so the slope :meth:`token_cost`
            # takes from it is the columns' own); until some wider step is
            # measured at all, every cost above a plain step's is the prior's
            # guess, so the first offer measures one
            widths = range(longest, 0, -1)
            return min(widths, key=lambda w: self.seen.get((batch, w + 1), -1))
        return best

    def measured_wider(self) -> bool:
        """Whether any step wider than a plain one has been measured (at any
        batch size: :meth:`token_cost` carries across them)."""
        return any(w > 1 for _, w in self.times)

    def _worth(
        self, batch: int, offering: int, ends: Sequence[float] | None, plain_cost: float
    ) -> Callable[[list[float]], float]:
        """What the offers' expected kept tokens are worth, in tokens of a plain
        step (each ``plain_cost / batch`` seconds).

        While requests wait for a slot every kept token is worth one: a row that
        ends sooner hands its slot on sooner. With nobody waiting, the batch's
        work is what it is: a row that keeps a token leaves one step earlier and
        saves only its own share of that step (``token_cost``). The batch ends a
        step sooner only when every row of the tail keeps one (the rows that
        would end last: the most steps left, within TAIL_SHARE), and that step
        costs a plain step of the tail's size; so the tail's kept tokens are
        worth that step's cost beyond the rows' shares, by their mean (a tail
        row that drafts nothing this step may next). Without this, eight rows
        of which a few draft pay for wider steps that only let those few finish
        early while the rest, drafting nothing, set the wall time."""
        if ends is None:
            return sum
        share = self.token_cost()
        most = max(ends)
        tail = [i for i, n in enumerate(ends) if n >= TAIL_SHARE * most]
        end = max(0.0, self.plain_cost(len(tail)) - len(tail) * share)
        scale = batch / plain_cost

        def worth(kept: list[float]) -> float:
            last = sum(kept[i] for i in tail if i < offering) / len(tail)
            return (share * sum(kept) + end * last) * scale

        return worth
