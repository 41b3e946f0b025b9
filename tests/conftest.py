"""Shared fixtures: the tiny golden models and their mlx-lm goldens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GOLDENS = ROOT / "goldens"
sys.path.insert(0, str(GOLDENS))

FAMILIES = ("llama", "qwen3", "gemma3_text", "mamba2", "falcon_h1")


def model_path(family: str) -> Path:
    return GOLDENS / "models" / family


def golden(family: str) -> dict:
    return json.loads((GOLDENS / "tokens" / f"{family}.json").read_text())


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


# -- engine tests ---------------------------------------------------------------
#
# Engine tests open engines through `checked_engine`: when the test body is done
# it waits for the engine to settle and records a snapshot; the autouse fixture
# below then checks that nothing was lost or leaked.

import threading  # noqa: E402
from contextlib import asynccontextmanager  # noqa: E402
from functools import cache  # noqa: E402

import trio  # noqa: E402

_SETTLED: list = []


@cache
def loaded(family: str):
    """The family's (model, tokenizer), loaded once per session (outside any event loop)."""
    from mlx_lm import load

    return load(str(model_path(family)))


@asynccontextmanager
async def checked_engine(family_or_model, **kwargs):
    from mlx_nursery.actors import open_engine

    model = loaded(family_or_model) if isinstance(family_or_model, str) else family_or_model
    kwargs.setdefault("prefill_step_size", 32)
    async with open_engine(model, **kwargs) as engine:
        yield engine
        with trio.fail_after(60):
            await engine.wait_idle()
        _SETTLED.append(engine.stats())


def _gpu_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mlx-nursery-gpu"]


@pytest.fixture(autouse=True)
def nothing_lost_nothing_leaked():
    _SETTLED.clear()
    yield
    for snap in _SETTLED:
        assert snap.active_rows == 0, snap
        assert snap.pending_rows == 0, snap
        assert snap.decoding_rows == 0, snap
        assert snap.kv_bytes == 0, snap
        assert snap.ledger_balanced, (
            f"submitted {snap.submitted} != finished {snap.finished} + errored "
            f"{snap.errored} + cancelled {snap.cancelled}"
        )
    assert not _gpu_threads(), "an engine's GPU thread outlived its engine"
