"""The engine's warm-up: what a first request runs, run once before it comes.

Whatever a kernel, a compiled block or a shape costs the first time it is used
(the packed weights' per-shape check, the C softmax's once-a-process check, a
compiled block's trace, mlx's own kernel builds on a GPU) would otherwise fall
on the first user of a fresh server: 0.6 s of a micro model's first answer,
where its second takes 29 ms. ``open_engine`` runs :func:`warm_up` on the GPU
thread before it yields, so a server's ``/health`` turns 200 only after it.

It runs the engine's own code on scratch state, never the actors' (no row, no
stats, no prompt cache): a prompt longer than a prefill chunk's C-softmax
threshold prefilled and primed as a joiner is, plain decode steps alone, then,
where the engine batches, one more row joined at a time up to ``rows`` with a
step at each size (forks of the one prefill: a real model's prefill is the
warm-up's dearest part). Its caches are dropped at the end.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..request import SamplingParams
from .joiner import Prefill
from .quantized import KvBits

PROMPT_TOKENS = 40  # past cpu_attention.MIN_QUERIES in one chunk
STEPS = 3  # plain steps alone (the first of which reads the primed token)
MAX_ROWS = 8  # the batch's row counts warmed, at most
TEXT = "The quick brown fox jumps over the lazy dog while the sun rises over the hills. "


def prompt(tokenizer: Any, n: int = PROMPT_TOKENS) -> list[int]:
    """``n`` tokens of plain English in this tokenizer (any model's ids)."""
    ids = list(tokenizer.encode(TEXT * 8))
    while len(ids) < n:
        ids += ids
    return ids[:n]


def warm_up(model: Any, tokenizer: Any, rows: int, step_size: int,
            kv: KvBits | None = None) -> int:  # fmt: skip
    """Run a first request's shapes once (GPU thread); ``rows`` > 1: the batch's
    row counts up to ``rows`` too, the other rows forks of the first one's
    prefill (as a request's ``n`` choices are: one prefill, the KV copied as each
    joins). Returns the decode steps taken."""
    ids = prompt(tokenizer)
    params = SamplingParams(max_tokens=STEPS + rows + 1)
    job = Prefill(model, ids, params, step_size, kv=kv)
    job.forks = [Prefill(model, ids, params, step_size, kv=kv) for _ in range(rows - 1)]
    while job.remaining > 0:
        job.chunk()
    primed = job.prime()
    primed.read_first()
    batch, *others = primed.forked()
    steps = 0
    for _ in range(STEPS):
        batch.step()
        steps += 1
    for other in others:
        batch.join([other])
        batch.step()
        steps += 1
    mx.eval(batch.next_tokens)
    mx.clear_cache()
    return steps
