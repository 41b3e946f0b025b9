"""The gate: every lane reproduces mlx-lm's own tokens, for every golden family.

- serial lane (``batch=1``) and the lone-row path of the continuous lane against
  ``stream_generate``;
- every scripted ``BatchGenerator`` scenario, played through the continuous lane
  with rows submitted at the same decode steps, against its per-row golden.
"""

from __future__ import annotations

import pytest
import trio
from conftest import checked_engine, golden


async def test_serial_lane_matches_stream_generate(family):
    g = golden(family)
    async with checked_engine(family, batch=1) as engine:
        for case in g["serial"]:
            result = await engine.generate(case["prompt_ids"], max_tokens=case["max_tokens"])
            assert result.tokens == case["tokens"], case["prompt"]
            assert result.text == case["text"], case["prompt"]
            assert result.finish_reason == case["finish_reason"], case["prompt"]


async def test_lone_row_matches_stream_generate(family):
    g = golden(family)
    async with checked_engine(family, batch=8) as engine:
        assert engine.stats().mode == "batch"
        for case in g["serial"]:
            result = await engine.generate(case["prompt_ids"], max_tokens=case["max_tokens"])
            assert result.tokens == case["tokens"], case["prompt"]
            assert result.text == case["text"], case["prompt"]
            assert result.finish_reason == case["finish_reason"], case["prompt"]


async def _play(engine, prompts, rows):
    """Submit each row when the engine reaches its step; collect its result. A
    step that cannot come (every row submitted so far ended in fewer steps: verify
    steps read several tokens) is not waited for: the next rows go in at once."""
    results = [None] * len(rows)
    running = 0
    idle = trio.Event()

    async def run(i, row):
        nonlocal running
        try:
            results[i] = await engine.generate(prompts[row["prompt"]], max_tokens=row["max_tokens"])
        finally:
            running -= 1
            if not running:
                idle.set()

    async def step_or_idle(step):
        if not running:
            return  # nothing runs to make the step come
        async with trio.open_nursery() as race:

            async def reached():
                await engine.wait_step(step)
                race.cancel_scope.cancel()

            async def ended():
                await idle.wait()
                race.cancel_scope.cancel()

            race.start_soon(reached)
            race.start_soon(ended)

    async with trio.open_nursery() as nursery:
        for step in sorted({r["insert_at"] for r in rows}):
            await step_or_idle(step)
            idle = trio.Event()
            for i, row in enumerate(rows):
                if row["insert_at"] == step:
                    running += 1
                    nursery.start_soon(run, i, row)
            # let this step's rows reach admission before the next step is awaited
            await trio.testing.wait_all_tasks_blocked()
    return results


async def _play_scenarios(family: str, **options) -> list:
    """Every scripted batch scenario of the family's goldens, each in an engine of
    its own (``checked_engine`` with ``options``): each row's tokens, text and
    finish reason are mlx-lm's. Returns each engine's stats when its rows ended.
    One step queued ahead (``--pipeline 1``): the goldens insert rows at given
    steps, and at 2 a joiner enters a step later."""
    options.setdefault("pipeline", 1)
    g = golden(family)
    stats = []
    for name, rows in g["batch"].items():
        async with checked_engine(family, batch=8, **options) as engine:
            results = await _play(engine, g["prompts"], rows)
            for row, result in zip(rows, results, strict=True):
                where = f"{name}/{row['prompt']}@{row['insert_at']}"
                assert result.tokens == row["tokens"], where
                assert result.text == row["text"], where
                assert result.finish_reason == row["finish_reason"], where
            stats.append(engine.stats())
    return stats


@pytest.mark.parametrize("step_size", [32, 2048], ids=["chunked", "together"])
async def test_batch_scenarios_match_batch_generator(family, step_size):
    """At 32 tokens a turn most rows prefill alone, chunk by chunk (short ones
    together); at 2048 every row that arrives with others is prefilled in one
    padded batch with them, where the caches allow it (plain KV: llama, qwen3),
    as mlx-lm's own batch prefill does."""
    stats = await _play_scenarios(family, prefill_step_size=step_size)
    assert all(s.steps > 0 for s in stats)
    together = sum(s.prefilled_together for s in stats)
    refilled = sum(s.refilled for s in stats)
    if step_size > 32:
        assert (together > 0) == (family in ("llama", "qwen3")), together
    # Rows that join after others left are written over their slots in place.
    assert (refilled > 0) == (family in ("llama", "qwen3")), refilled
