"""Waits on the device in decode steps, counted, and a step's time by phase.

A decode step waits on the device once: for the tokens (and logprobs) of the
step before, while the next step, already built and started, runs (mlx-lm's
``generate_step`` does the same). Any other wait on the hot path (an ``.item()``,
a ``.tolist()`` of an array not yet computed, an ``mx.eval``) stalls the host
until the device's queue drains, and on a GPU that is every step's pipeline
lost. The step's code waits only through :func:`wait`, which counts; a test
holds steady-state decode at one wait a step (``tests/test_host.py``), and reads
the steps' code for any other.

Runs on the GPU thread; the counter is read from any thread (one int).
"""

from __future__ import annotations

import time

import attrs
import mlx.core as mx

_waits = 0


def wait(*arrays) -> float:
    """Evaluate ``arrays`` (wait for the device); the seconds it took."""
    global _waits
    t0 = time.perf_counter()
    mx.eval(*arrays)
    _waits += 1
    return time.perf_counter() - t0


def waits() -> int:
    """Device waits made through :func:`wait` in this process so far."""
    return _waits


@attrs.frozen
class Phases:
    """One decode step's time on the GPU thread, in seconds: building the graph
    (and starting it), waiting on the device for the step before, reading what
    that step sampled (tokens, logprobs, each row's bookkeeping)."""

    build: float = 0.0
    wait: float = 0.0
    read: float = 0.0
