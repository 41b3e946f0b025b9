"""The host's work in decode (issue 62): one wait on the device a steady step,
whatever its rows ask; the warm-up that pays a first request's first uses
before the engine takes requests; the decode loop one step ahead of its tokens,
answering as the loop that waits for each step does."""

from __future__ import annotations

import mlx.core as mx
import pytest
import trio
from conftest import checked_engine, loaded, model_path
from mlx_lm import load
from mlx_nursery.actors.decode import _advance
from mlx_nursery.actors.request import SamplingParams
from mlx_nursery.actors.step import syncs, warmup
from mlx_nursery.actors.step.joiner import Prefill

# One row of each kind a step reads differently: greedy, logprobs with top-3,
# sampled (top-p), a seeded row, a penalty (a processor that reads the tokens).
PARAMS = [
    SamplingParams(max_tokens=64),
    SamplingParams(max_tokens=64, logprobs=True, top_logprobs=3),
    SamplingParams(max_tokens=64, temperature=0.8, top_p=0.9),
    SamplingParams(max_tokens=64, temperature=0.8, seed=7, logprobs=True),
    SamplingParams(max_tokens=64, repetition_penalty=1.2),
]


def _batch(model, tokenizer, rows: int):
    ids = warmup.prompt(tokenizer, 40)
    batch = None
    for i in range(rows):
        job = Prefill(model, ids[i:] + ids[:i], PARAMS[i % len(PARAMS)], 32)
        while job.remaining > 0:
            job.chunk()
        joiner = job.prime()
        joiner.read_first()
        if batch is None:
            batch = joiner
        else:
            batch.join([joiner])
    return batch


class Reads:
    """What a step asks of the device: each ``mx.eval`` and ``.item()``, and each
    ``.tolist()`` with the array it read."""

    def __init__(self, monkeypatch) -> None:
        self.events: list[tuple[str, object]] = []
        real_eval, real_item, real_tolist = mx.eval, mx.array.item, mx.array.tolist

        def eval_(*args):
            self.events.append(("eval", None))
            return real_eval(*args)

        def item(a):
            self.events.append(("item", a))
            return real_item(a)

        def tolist(a):
            self.events.append(("tolist", a))
            return real_tolist(a)

        monkeypatch.setattr(mx, "eval", eval_)
        monkeypatch.setattr(mx.array, "item", item)
        monkeypatch.setattr(mx.array, "tolist", tolist)


@pytest.mark.parametrize("rows", [1, 5])
def test_a_steady_decode_step_waits_on_the_device_once(rows, monkeypatch):
    """Steady state, whatever the rows ask (logprobs and top-N included): one
    ``mx.eval`` a step, no ``.item()``, and before the wait no read but of the
    batch's padding (its own, computed at the last join)."""
    model, tokenizer = loaded("llama")
    batch = _batch(model, tokenizer, rows)
    for turn in range(1, 3):  # the primed tokens read, the first steps past
        _advance(batch, [], turn, False, False)
    reads = Reads(monkeypatch)
    waits = syncs.waits()
    for turn in range(3, 11):
        reads.events.clear()
        result = _advance(batch, [], turn, False, False)
        kinds = [k for k, _ in reads.events]
        assert kinds.count("eval") == 1 and "item" not in kinds, kinds
        first = kinds.index("eval")
        padding = [getattr(c, "left_padding", None) for c in batch.caches]
        early = [a for k, a in reads.events[:first] if k == "tolist"]
        assert all(any(a is p for p in padding) for a in early), kinds
        assert all(r is not None and len(r.tokens) == 1 for r in result.step.sampled)
        assert result.step.phases is not None and result.step.phases.wait >= 0
    assert syncs.waits() - waits == 8
    asked = [r.tokens[0] for r in result.step.sampled]
    assert asked[1 % rows].logprob is not None or rows == 1


async def test_the_warm_up_pays_a_first_request_before_it_comes():
    """Warmed, the engine's compiled blocks are traced for one row and for the
    batch's sizes before any request (the figures are the model's: a fresh copy
    of it), a first request traces nothing new, and
    nothing of the warm-up shows: no request, step or token counted."""
    model = load(str(model_path("llama")))
    async with checked_engine(model, batch=4, compile="on", warmup=True) as engine:
        before = engine.stats()
        assert before.compiled.recompiles > 0
        assert (before.submitted, before.steps, before.generated_tokens) == (0, 0, 0)
        await engine.generate("Hello there", max_tokens=8)
        assert engine.stats().compiled.recompiles == before.compiled.recompiles


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "mamba2"])
async def test_one_step_ahead_answers_as_one_step_at_a_time(family):
    """Rows that end at different steps (max_tokens, a stop string, EOS), queue
    for a slot and join as others leave, and ask for logprobs, answer the same
    with one and two steps queued as one step at a time, and every row's KV is
    given back."""

    async def run(pipeline: int) -> list:
        async with checked_engine(family, batch=4, pipeline=pipeline) as engine:
            out = [None] * 6

            async def one(i):
                out[i] = await engine.generate(
                    f"Row {i} says", max_tokens=4 + 5 * i, logprobs=i % 2 == 1,
                    top_logprobs=2 * (i % 2), stop=["zq"] if i == 3 else (),
                )  # fmt: skip

            async with trio.open_nursery() as nursery:
                for i in range(6):
                    nursery.start_soon(one, i)
            return out

    apart = await run(0)
    for ahead in (await run(1), await run(2)):
        _same_answers(ahead, apart)


def _same_answers(ahead: list, apart: list) -> None:
    for a, b in zip(ahead, apart, strict=True):
        assert (a.tokens, a.text, a.finish_reason) == (b.tokens, b.text, b.finish_reason)
        # A row riding one more step changes the batch's size at that step, and
        # a step's float sums with it (the last bits; the tokens are the same).
        assert (a.logprobs is None) == (b.logprobs is None)
        assert a.logprobs is None or a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        for x, y in zip(a.top_logprobs or (), b.top_logprobs or (), strict=True):
            assert [t.token for t in x] == [t.token for t in y]
            assert [t.logprob for t in x] == pytest.approx([t.logprob for t in y], abs=1e-4)


async def test_the_host_share_of_a_step_is_in_the_figures():
    """Plain steps' phases reach the snapshot, ``/stats``'s body and ``/metrics``."""
    from mlx_nursery.server.metrics import prometheus, stats_json

    async with checked_engine("llama", batch=2, speculative=False) as engine:
        await engine.generate("Hello there", max_tokens=12)
        await engine.stats_actor.wait_for(lambda s: s.host.steps >= 10)
        snap = engine.stats()
    host = snap.host
    assert host.steps >= 10 and 0.0 < host.share <= 1.0
    assert host.build_ms > 0 and host.wait_ms >= 0 and host.loop_ms > 0
    body = stats_json(snap)["host"]
    assert body["steps"] == host.steps and body["share"] == host.share
    text, _ = prometheus(snap)
    assert b"mlx_nursery_decode_host_share" in text
    assert b"mlx_nursery_decode_device_wait_seconds_count" in text


async def test_a_warm_up_that_fails_leaves_the_engine_serving(monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(warmup, "warm_up", broken)
    async with checked_engine("llama", batch=2, warmup=True) as engine:
        result = await engine.generate("Hello there", max_tokens=4)
    assert len(result.tokens) == 4
    assert "warm-up failed, serving unwarmed: RuntimeError: no kernel" in caplog.text


class NearTies:
    """A model whose every logit row is shifted to a top of 0 and has the logit
    just before its top set to -1e-10: so close that mlx-lm's logprobs
    (``logits - logsumexp``) round the two to one value and its argmax takes the
    lower index, where the argmax of the logits takes the top. Counts the rows
    where the rounding did that."""

    def __init__(self, model) -> None:
        self._model, self.ties = model, 0

    def __call__(self, inputs, cache=None, **kwargs):
        import numpy as np

        logits = self._model(inputs, cache=cache, **kwargs)
        tied = np.array(logits.astype(mx.float32))
        for row in tied.reshape(-1, tied.shape[-1]):
            top = int(row.argmax())
            row -= row[top]
            if top > 0:
                row[top - 1] = -1e-10
                lse = np.float32(mx.logsumexp(mx.array(row)).item())
                self.ties += int(row[top - 1] - lse == row[top] - lse)
        return mx.array(tied).astype(logits.dtype)

    def __getattr__(self, name):
        return getattr(self._model, name)


def _greedy_rows(model, tokenizer, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """The batch on greedy ``prompts`` (each joining the first), ``steps`` plain
    steps: each row's tokens."""
    batch = None
    for ids in prompts:
        job = Prefill(model, ids, SamplingParams(max_tokens=steps + 2), 32)
        while job.remaining > 0:
            job.chunk()
        joiner = job.prime()
        first = [s.token for s in joiner.read_first()]
        if batch is None:
            batch, out = joiner, [first]
        else:
            batch.join([joiner])
            out.append(first)
    for _ in range(steps):
        for e, read in enumerate(batch.step()):
            out[e] += [s.token for s in read.tokens]
        assert (batch.next_near is not None) == batch.from_logits()
    return out


@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_rows_take_the_logits_argmax_and_keep_mlx_lms_tokens(rows, monkeypatch):
    """Greedy rows without logprobs take their tokens from the logits (the
    logsumexp over the vocabulary left unevaluated); under near ties on every
    step, where mlx-lm's logprobs round the top two logits to one value, each
    such step is taken back and built again from mlx-lm's token: the tokens
    are mlx-lm's ``generate_step``'s alone, and the batch's with the logprobs'
    argmax throughout."""
    from mlx_lm.generate import generate_step
    from mlx_nursery.actors.step.batch import Batch

    model, tokenizer = loaded("llama")
    tied = NearTies(model)
    ids = warmup.prompt(tokenizer, 24)
    prompts = [ids[i:] + ids[:i] for i in range(rows)]
    redone = []
    redo = Batch.redo
    monkeypatch.setattr(Batch, "redo", lambda self, *a: redone.append(a) or redo(self, *a))
    fast = _greedy_rows(tied, tokenizer, prompts, 12)
    assert tied.ties > 0 and redone
    if rows == 1:
        steps = generate_step(mx.array(prompts[0]), tied, max_tokens=len(fast[0]))
        assert fast[0] == [int(t) for t, _ in steps]
    monkeypatch.setattr(Batch, "from_logits", lambda self: False)
    assert fast == _greedy_rows(tied, tokenizer, prompts, 12)
