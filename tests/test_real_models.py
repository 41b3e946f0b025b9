"""Parity on real weights: SmolLM2-135M-Instruct (dequantized to float32) through
every lane and join path equals mlx-lm's own ``stream_generate``, token for token.

Marked ``real``: `make test` runs this set in its own pytest run with OpenBLAS
preloaded (it compares the engine with live mlx-lm in one process, and the
bundled BLAS would take many minutes), after fetching the model into the cache.
Without the model (offline, nothing cached) the set is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import trio
from conftest import checked_engine, generate_to_eos
from mlx_lm import stream_generate
from mlx_nursery.actors.models import registry

pytestmark = [pytest.mark.real, pytest.mark.slow]

MAX_TOKENS = 10
# Prompts longer than this go through several prefill chunks (and, in the batch,
# several turns while other rows decode): the path a long prompt takes. A longer
# prompt adds minutes on a CPU and no path.
STEP = 256

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Translate to French: the cat is on the table.",
    "Répète exactement : « Ça va ? Très bien — 日本語, naïve café 🚀 »",
    "What is 12 times 12?",
]


def long_document() -> str:
    """A held-out prompt of some 800 tokens (several prefill chunks of ``STEP``):
    varied sentences, no repeats of a block."""
    subjects = ["The river", "A lighthouse keeper", "The old library", "Every winter", "The market"]
    verbs = ["remembers", "measures", "carries", "hides", "counts"]
    objects = [
        "the tides",
        "forty lanterns",
        "a map of the coast",
        "the first snow",
        "copper coins",
    ]
    lines = [
        f"{i}. {subjects[i % 5]} {verbs[(i // 5) % 5]} {objects[(i // 25) % 5]} near harbour {i}."
        for i in range(64)
    ]
    return "\n".join(lines)


@cache
def smollm2():
    """The real model, loaded once per session: (model, tokenizer)."""
    from mlx_nursery.actors.models.load import load_model

    if not registry.DEFAULT.file.is_file():
        pytest.skip(f"{registry.DEFAULT.id} is not in the cache (`mlx-nursery models --fetch`)")
    model, tokenizer, _ = load_model(str(registry.DEFAULT.file), "float32")
    return model, tokenizer


@cache
def prompts() -> list[list[int]]:
    _, tokenizer = smollm2()
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    chats.append(
        [
            {"role": "system", "content": "Answer from this log:\n" + long_document()},
            {"role": "user", "content": "What does harbour 7 hold? Answer briefly."},
        ]
    )
    return [list(tokenizer.apply_chat_template(c, add_generation_prompt=True)) for c in chats]


@cache
def expected() -> list[list[int]]:
    model, tokenizer = smollm2()
    out = []
    for ids in prompts():
        steps = stream_generate(model, tokenizer, ids, max_tokens=MAX_TOKENS)
        out.append([r.token for r in steps if r.token not in tokenizer.eos_token_ids])
    return out


def test_the_held_out_prompts_are_what_the_issue_asks():
    assert max(len(p) for p in prompts()) > 3 * STEP
    _, tokenizer = smollm2()
    assert any(ord(c) > 0x7FF for c in tokenizer.decode(prompts()[5]))  # multi-byte UTF-8
    answer = tokenizer.decode(expected()[0])
    assert "Paris" in answer, answer


async def test_the_serial_lane_equals_stream_generate():
    settings = {"prompt_cache_size": 0, "prefill_step_size": STEP}
    async with checked_engine(smollm2(), batch=1, **settings) as e:
        for ids, want in zip(prompts(), expected(), strict=True):
            got = await e.generate(ids, max_tokens=MAX_TOKENS)
            assert got.tokens == want


async def test_a_lone_row_equals_stream_generate():
    """A lone row in the batch lane; where the packed-weights extension runs
    (OpenBLAS on an AVX-512 CPU), its one-row steps read the packed panels and,
    where OpenBLAS's core has its small-matrix kernel, that kernel's sums, and
    the tokens are still mlx-lm's."""
    from mlx_nursery.actors.kernels import packed

    settings = {"prompt_cache_size": 0, "prefill_step_size": STEP}
    async with checked_engine(smollm2(), batch=8, **settings) as e:
        for ids, want in list(zip(prompts(), expected(), strict=True))[:4]:
            got = await e.generate(ids, max_tokens=MAX_TOKENS)
            assert got.tokens == want
        figures = e.stats().packed
    if packed.module() is not None:
        kernel = packed.openblas_core() in packed.SMALL_KERNEL_CORES  # its small-matrix one
        assert figures is not None and figures.calls > 0, figures
        assert (figures.small_calls > 0) == kernel, (figures, packed.openblas_core())


@pytest.mark.parametrize("batch", [4, 8])
async def test_staggered_arrivals_in_the_batch_equal_stream_generate(batch):
    """Rows arrive at different decode steps and join a running batch."""
    cases = list(zip(prompts(), expected(), strict=True))
    if batch == 4:
        cases = cases[:4]  # the long prompt runs at B=8 only (it takes a while here)
    results = {}

    async def run(i, ids):
        results[i] = await e.generate(ids, max_tokens=MAX_TOKENS)

    async with checked_engine(
        smollm2(), batch=batch, prompt_cache_size=0, prefill_step_size=STEP
    ) as e:
        async with trio.open_nursery() as nursery:
            for i, (ids, _) in enumerate(cases):
                nursery.start_soon(run, i, ids)
                if i < len(cases) - 1:
                    await e.wait_step(e.steps + 2)
    for i, (_, want) in enumerate(cases):
        assert results[i].tokens == want, f"prompt {i}"


def batch_generator_tokens(cases: list[list[int]]) -> list[list[int]]:
    """mlx-lm's own BatchGenerator, every prompt inserted at once (its padded batch
    prefill), greedy, ``MAX_TOKENS`` each."""
    from mlx_lm.generate import BatchGenerator

    model, tokenizer = smollm2()
    gen = BatchGenerator(
        model,
        max_tokens=MAX_TOKENS,
        stop_tokens=[[t] for t in tokenizer.eos_token_ids],
        prefill_step_size=2048,
    )
    uids = gen.insert(cases)
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    done: set[int] = set()
    while len(done) < len(uids):
        for r in gen.next_generated():
            if r.token not in tokenizer.eos_token_ids:
                out[r.uid].append(r.token)
            if r.finish_reason is not None:
                done.add(r.uid)
    gen.close()
    return [out[uid] for uid in uids]


async def test_rows_arriving_together_equal_batch_generator():
    """The seven short prompts arrive at once: prefilled as one padded batch, as
    mlx-lm's BatchGenerator does, and token for token what it produces."""
    cases = prompts()[:7]
    want = batch_generator_tokens(cases)
    results = {}

    async def run(i, ids):
        results[i] = await e.generate(ids, max_tokens=MAX_TOKENS)

    async with checked_engine(smollm2(), batch=8, prompt_cache_size=0, prefill_step_size=2048) as e:
        async with trio.open_nursery() as nursery:
            for i, ids in enumerate(cases):
                nursery.start_soon(run, i, ids)
    assert e.stats().prefilled_together >= 2
    for i, tokens in enumerate(want):
        assert results[i].tokens == tokens, f"prompt {i}"


def kv_bits_reference(cases: list[list[int]], bits: int) -> list[list[int]]:
    """mlx-lm's ``generate_step`` with ``kv_bits`` (greedy, to the first EOS)."""
    model, tokenizer = smollm2()
    return [generate_to_eos(model, tokenizer, ids, max_tokens=MAX_TOKENS, kv_bits=bits,
                            quantized_kv_start=0, prefill_step_size=STEP)
            for ids in cases]  # fmt: skip


async def quantized_lanes(cases: list[list[int]], bits: int) -> tuple[list, list]:
    """The first case on the serial lane, then every case arriving two steps
    apart into a quantized batch: (serial, batch) tokens."""
    settings = {"prompt_cache_size": 0, "prefill_step_size": STEP, "kv_bits": bits}
    async with checked_engine(smollm2(), batch=1, **settings) as e:
        serial = (await e.generate(cases[0], max_tokens=MAX_TOKENS)).tokens
    results = {}

    async def run(i, ids):
        results[i] = (await e.generate(ids, max_tokens=MAX_TOKENS)).tokens

    async with checked_engine(smollm2(), batch=8, **settings) as e:
        async with trio.open_nursery() as nursery:
            for i, ids in enumerate(cases):
                nursery.start_soon(run, i, ids)
                if i < len(cases) - 1:
                    await e.wait_step(e.steps + 2)
    return [serial], [results[i] for i in range(len(cases))]


async def test_8_bit_kv_equals_generate_with_kv_bits():
    """``--kv-bits 8``: the serial lane, and rows arriving at different steps
    into a quantized batch, equal mlx-lm's ``generate_step`` with the same
    ``kv_bits`` (a long prompt's chunks: tests/test_quantized_kv.py)."""
    cases = [prompts()[i] for i in (0, 5, 2, 3)]
    want = kv_bits_reference(cases, 8)
    serial, batch = await quantized_lanes(cases, 8)
    assert serial == want[:1]
    assert batch == want


@pytest.mark.own_blas
def test_4_bit_kv_equals_generate_with_kv_bits_on_mlx_blas():
    """``--kv-bits 4`` on mlx's own BLAS, in a process of its own (whatever the
    suite's lane preloads). Under OpenBLAS a batch's matmuls differ from a lone
    row's in the last bits (another kernel for more rows); float KV absorbs
    that, but 4-bit KV can round such a value to another level, and the row
    then decodes otherwise (docs/quantized-kv.md). On mlx's BLAS the batch is
    bit for bit the lone row: the KV and logprobs are equal."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    # Ended as the server ends (server/serve.py): os._exit once the check is done,
    # since mlx's teardown at interpreter exit can abort ("terminate called
    # without an active exception", -6: once in a suite run) after every assertion held.
    code = ("import os, sys, test_real_models as t; t._four_bits_on_mlx_blas(); "
            "sys.stdout.flush(); sys.stderr.flush(); os._exit(0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _four_bits_on_mlx_blas() -> None:
    cases = [prompts()[i] for i in (0, 5, 2)]
    want = kv_bits_reference(cases, 4)
    serial, batch = trio.run(quantized_lanes, cases, 4)
    assert serial == want[:1] and batch == want, (serial, batch, want)
