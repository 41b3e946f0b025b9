"""Speculative decoding in the continuous batch: the drafters.

A row may carry draft tokens into a decode step: guesses of what it will say
next. The step feeds each row its pending token and its drafts in one forward,
samples the target's token at every position, and keeps a row's drafts up to
the first one that differs from what the target sampled there (mlx-lm's rule,
so the output is exactly the target's). Each row's KV is then rolled back by
what it did not keep (the batch's ``roll_back``, asked by ``speculation.verify``).
A draft costs a column of the step for every row, so the gate
(``speculation.gate``) drafts only where the expected tokens per step pay for
the wider step at this batch size (docs/speculative.md).

The drafters:

* **prompt**: n-gram lookup in the row's own prompt and output. A coding agent
  that rewrites a file it was shown copies most of its answer from its prompt.
* **suffix**: the same lookup over a shared index of recent rows' prompts and
  outputs (:class:`SharedIndex`), so a sub-agent can draft from what its
  siblings just wrote.
* **model**: a small draft model of the same tokenizer, where the user gives
  one (``--draft-model``): its greedy tokens, from its own KV kept per row
  (:class:`ModelDrafter`), as mlx-lm's ``speculative_generate_step`` for one row.

Everything here runs on the GPU actor's thread (the batch calls it inside its
step), except the figures, which the decode actor reads from each step's result.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..models.vision import IMAGE_BASE

DRAFTERS = ("prompt", "suffix", "model")
MAX_DRAFT = 8  # most draft tokens one row carries into a step
# n-gram lengths matched against the row's own tokens, longest first; the shared
# index asks for longer matches (another text continues the same way less often).
OWN_NGRAMS = (8, 6, 4, 3, 2)
SHARED_NGRAMS = (8, 6, 4)
SHARED_TOKENS = 65536  # tokens the shared index keeps (the most recent rows')
# Acceptance estimates (decayed counts of drafts kept and of rejections) are
# kept per row and per kind of match (drafter and n-gram length: a draft found
# by a long match is kept far more often). A row's own counts forget old steps
# at DECAY per observation; its estimate leans on its kind's by MATCH_WEIGHT.
DECAY = 0.85
MATCH_DECAY = 0.98
MATCH_WEIGHT = 3.0
PRIOR_SHARE = 0.5  # a kind of match's estimate before any observation
MODEL = "model"
DRAFT_PREFILL = 512  # tokens per chunk when a draft model catches up on a prompt


class NgramIndex:
    """Where each n-gram of a token list last occurred, for n in ``sizes``.

    An n-gram is indexed one token late: the n-gram ending at the last token is
    not yet in, so a lookup of the list's own suffix finds its latest earlier
    occurrence, never itself."""

    def __init__(self, sizes: Sequence[int], tokens: Sequence[int] = ()) -> None:
        self.sizes = tuple(sizes)
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> the position after it
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        end = len(self.tokens)  # the n-grams ending here get their continuation now
        self.tokens.append(token)
        for n in self.sizes:
            if end >= n:
                self._after[tuple(self.tokens[end - n : end])] = end

    def lookup(self, suffix: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the longest indexed n-gram ending
        ``suffix``, and that n (empty and 0 when none matches)."""
        for n in self.sizes:
            if len(suffix) < n:
                continue
            start = self._after.get(tuple(suffix[-n:]))
            if start is not None:
                found = self.continuation(start, k)
                if found:
                    return found, n
        return [], 0

    def continuation(self, start: int, k: int) -> list[int]:
        return self.tokens[start : start + k]

    def __len__(self) -> int:
        return len(self.tokens)


SEPARATOR = -1  # between two texts in the shared index: no n-gram spans it


class SharedIndex(NgramIndex):
    """Recent rows' prompts and outputs, one index for every row. When it holds
    more than ``limit`` tokens it is rebuilt from the newer half of its texts."""

    def __init__(self, limit: int = SHARED_TOKENS) -> None:
        super().__init__(SHARED_NGRAMS)
        self.limit = limit
        self._texts: deque[list[int]] = deque()

    def add(self, tokens: Sequence[int]) -> None:
        text = list(tokens)[-self.limit // 2 :]
        if len(text) < min(self.sizes) + 1:
            return
        if len(self) + len(text) + 1 > self.limit:
            kept, total = [], len(text)
            for old in reversed(self._texts):
                if total + len(old) > self.limit // 2:
                    break
                kept.append(old)
                total += len(old)
            self._texts = deque(reversed(kept))
            self.tokens, self._after = [], {}
            for old in self._texts:
                self.extend([*old, SEPARATOR])
        self._texts.append(text)
        self.extend([*text, SEPARATOR])

    def continuation(self, start: int, k: int) -> list[int]:
        out = self.tokens[start : start + k]
        return out[: out.index(SEPARATOR)] if SEPARATOR in out else out


@attrs.define(eq=False)
class Odds:
    """How drafts fare: decayed counts for a run's first draft (kept or not)
    and for the drafts after a kept one. Drafts found by a long match either
    miss at once or run on (a copied stretch), so one rate would not do."""

    first: list[float] = attrs.field(factory=lambda: [0.0, 0.0])  # kept, rejected
    then: list[float] = attrs.field(factory=lambda: [0.0, 0.0])
    decay: float = DECAY

    def observe(self, kept: int, drafted: int) -> None:
        """A run of ``drafted`` drafts of which the first ``kept`` were kept."""
        for counts in (self.first, self.then):
            counts[0] *= self.decay
            counts[1] *= self.decay
        self.first[0 if kept else 1] += 1
        if kept:
            self.then[0] += kept - 1
            self.then[1] += kept < drafted

    def rates(self, prior: tuple[float, float], weight: float) -> tuple[float, float]:
        return tuple(
            (kept + p * weight) / (kept + rejected + weight)
            for (kept, rejected), p in zip((self.first, self.then), prior, strict=True)
        )


Match = tuple[str, int]  # a proposal's drafter and the n-gram length it matched


@attrs.define(eq=False)
class Matches:
    """Every row's acceptance by kind of match, shared by the running batch."""

    odds: dict[Match, Odds] = attrs.field(factory=dict)

    def of(self, match: Match) -> Odds:
        if match not in self.odds:
            self.odds[match] = Odds(decay=MATCH_DECAY)
        return self.odds[match]

    def rates(self, match: Match) -> tuple[float, float]:
        return self.of(match).rates((PRIOR_SHARE, PRIOR_SHARE), 2.0)


@attrs.define(eq=False)
class Drafter:
    """One row's drafting state: its own tokens indexed (prompt and every
    generated token known so far), its acceptance, and a proposal it made but
    did not draft, checked against the tokens that come (a free observation of
    how well it would have done)."""

    own: NgramIndex
    shared: SharedIndex | None
    matches: Matches
    limit: int = MAX_DRAFT  # the request's own cap (0: never drafts)
    odds: Odds = attrs.field(factory=Odds)
    match: Match | None = None  # what the latest proposal matched
    shadow: list[int] = attrs.field(factory=list)  # proposed, not drafted: to check
    shadow_match: Match | None = None
    shadow_kept: int = 0  # of the shadow's tokens, those that came so far

    @classmethod
    def start(
        cls, prompt: Sequence[int], shared: SharedIndex | None, matches: Matches, limit: int
    ) -> Drafter:
        return cls(NgramIndex(OWN_NGRAMS, prompt), shared, matches, limit)

    def rates(self) -> tuple[float, float]:
        """The estimated chances that a run's first draft of the latest
        proposal's kind is kept, and that a draft after a kept one is: the row's
        own record, leaning on its kind's."""
        prior = self.matches.rates(self.match) if self.match else (PRIOR_SHARE, PRIOR_SHARE)
        return self.odds.rates(prior, MATCH_WEIGHT)

    def known(self, token: int) -> None:
        """A generated token is known on the host: index it, and check the shadow."""
        if self.shadow:
            kept = self.shadow[self.shadow_kept] == token
            self.shadow_kept += kept
            if not kept or self.shadow_kept == len(self.shadow):  # the run is over
                self._observe(self.shadow_match, self.shadow_kept, len(self.shadow))
                self.shadow = []
        self.own.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens to follow what is known (:attr:`match` says how
        they were found)."""
        k = min(k, self.limit)
        self.match = None
        if k <= 0:
            return []
        tokens = self.own.tokens
        found, n = self.own.lookup(tokens, k)
        source = "prompt"
        if self.shared is not None and n < max(self.shared.sizes):
            more, m = self.shared.lookup(tokens[-max(self.shared.sizes) :], k)
            if m > n:
                found, n, source = more, m, "suffix"
        found = list(itertools.takewhile(lambda t: t < IMAGE_BASE, found))  # never an image's id
        if found:
            self.match = (source, n)
        return found

    def offer(self, left: int, guessing: bool) -> tuple[list[int], int, bool]:
        """Before a step, for the gate: a proposal for a row that may read ``left``
        more tokens, how many drafts it offers, and whether its first token is a
        guess of the pending one (the pending token is not known yet: the
        proposal is cheap, so it guesses, and drafts again once it is known)."""
        proposal = self.propose(left + guessing)
        return proposal, max(0, len(proposal) - guessing), guessing

    def shadow_of(self, proposal: list[int]) -> None:
        """Keep an undrafted proposal to check against the coming tokens."""
        if not self.shadow and self.match is not None:
            self.shadow, self.shadow_match, self.shadow_kept = list(proposal), self.match, 0

    def guessed(self, right: bool) -> None:
        """The pending token an offer guessed is known: the guess was one draft
        more to pass (:meth:`expected`), scored like one. Unscored, a wrong guess
        left no trace (the row then proposes afresh, often nothing), and rows
        offered drafts at their kept drafts' rate that never reached a step."""
        self._observe(self.match, int(right), 1)

    def drafted(self, n: int, kept: int) -> None:
        """One verify step's outcome for the latest proposal: ``n`` drafted, ``kept`` kept."""
        self.shadow = []
        self._observe(self.match, kept, n)

    def _observe(self, match: Match | None, kept: int, drafted: int) -> None:
        self.odds.observe(kept, drafted)
        if match is not None:
            self.matches.of(match).observe(kept, drafted)

    def expected(self, k: int, guessing: bool) -> float:
        """Tokens kept beyond the plain step's one, in expectation, from ``k``
        drafts: the first kept with the first rate, each after a kept one with
        the second. A guessed pending token is one more draft to pass first."""
        first, then = self.rates()
        run = first * sum(then**j for j in range(k))
        return run * first if guessing else run


@attrs.frozen
class DraftModel:
    """A draft model loaded beside the target (same tokenizer, plain KV caches):
    the model, and the target's vocabulary size (a draft past it is dropped)."""

    model: Any
    vocab: int | None = None


@attrs.define(eq=False)
class ModelDrafter(Drafter):
    """A row's drafter that asks a draft model: the row's tokens (``own``, also
    what the shared index gets when it leaves) and the draft model's KV of them,
    kept beside the target's. Each proposal first feeds the draft what it has
    not seen (the prompt at the start, then the tokens the row read since), then
    its greedy tokens one by one; the draft's KV keeps the proposal's tokens
    that the row then read (checked at the next proposal) and drops the rest."""

    draft: DraftModel | None = None
    cache: list[Any] | None = attrs.field(default=None, repr=False)
    fed: int = 0  # the row's tokens in the draft's KV
    guess: list[int] = attrs.field(factory=list)  # fed past ``fed`` by the last proposal

    @classmethod
    def start(  # type: ignore[override]
        cls, prompt: Sequence[int], shared: SharedIndex | None, matches: Matches, limit: int,
        draft: DraftModel,
    ) -> ModelDrafter:  # fmt: skip
        drafter = cls(NgramIndex(OWN_NGRAMS, prompt), shared, matches, limit, draft=draft)
        drafter.cache = make_prompt_cache(draft.model)
        if drafter._feed(list(prompt[:-1])) is not None:  # the rest comes with the first proposal
            mx.eval([c.state for c in drafter.cache])
        return drafter

    def offer(self, left: int, guessing: bool) -> tuple[list[int], int, bool]:
        """A draft model proposes only once the pending token is known (inside a
        verify step: a guess would cost forwards); it offers up to its limit."""
        self.match = (MODEL, 0)
        return [], min(self.limit, left), False

    def propose(self, k: int) -> list[int]:
        k = min(k, self.limit)
        self.match = (MODEL, 0)
        if k <= 0:
            return []
        tokens = self.own.tokens
        kept = 0  # the last proposal's fed tokens that the row read since
        while kept < len(self.guess) and self.fed + kept < len(tokens):
            if tokens[self.fed + kept] != self.guess[kept]:
                break
            kept += 1
        self._trim(len(self.guess) - kept)
        self.fed += kept
        logits = self._feed(tokens[self.fed :])
        model, out = self.draft.model, []
        for i in range(k):
            token = mx.argmax(logits, axis=-1)
            out.append(token)
            if i < k - 1:
                logits = model(token[None], cache=self.cache)[:, -1, :]
        mx.eval(out)
        found = [int(t.item()) for t in out]
        self.guess = found[:-1]
        if self.draft.vocab is not None:  # a token only the draft's embedding has
            bad = [i for i, t in enumerate(found) if t >= self.draft.vocab]
            found = found[: bad[0]] if bad else found
        return found

    def _feed(self, tokens: list[int]) -> mx.array | None:
        """Feed the draft ``tokens`` (chunked), return the last position's logits."""
        logits = None
        for at in range(0, len(tokens), DRAFT_PREFILL):
            chunk = mx.array(tokens[at : at + DRAFT_PREFILL])[None]
            logits = self.draft.model(chunk, cache=self.cache)[:, -1, :]
            if at + DRAFT_PREFILL < len(tokens):
                mx.eval([c.state for c in self.cache])
        self.fed += len(tokens)
        return logits

    def _trim(self, n: int) -> None:
        if n:
            for c in self.cache:
                c.trim(n)
        self.guess = []


