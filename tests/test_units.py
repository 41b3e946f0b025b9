"""Scheduling decisions and small mechanisms, without a model."""

from __future__ import annotations

import threading
import time
from collections import deque

import attrs
import pytest
import trio
from mlx_nursery.actors.admission import plan
from mlx_nursery.actors.decode import finish_reason
from mlx_nursery.actors.emitter import _split_stop
from mlx_nursery.actors.gpu import Gpu
from mlx_nursery.actors.request import Lane, Row, RowTimes, SamplingParams
from mlx_nursery.actors.stats import Histogram


def row(i, lane=Lane.CONTINUOUS, **params):
    send, _ = trio.open_memory_channel(1)
    return Row(i, [1, 2], SamplingParams(**params), lane, send, RowTimes(0.0))


def ids(rows):
    return [r.id for r in rows]


def test_plan_admits_fifo_up_to_the_cap():
    q = deque(row(i) for i in range(5))
    p = plan(q, cap=3, in_batch=1, serial_running=False, closing=False)
    assert ids(p.to_batch) == [0, 1] and p.to_serial is None
    assert ids(q) == [2, 3, 4]


def test_plan_a_serial_head_holds_admission_until_the_batch_drains():
    q = deque([row(0, Lane.SERIAL), row(1)])
    p = plan(q, cap=8, in_batch=2, serial_running=False, closing=False)
    assert p.to_batch == () and p.to_serial is None and ids(q) == [0, 1]
    p = plan(q, cap=8, in_batch=0, serial_running=False, closing=False)
    assert p.to_serial.id == 0 and p.to_batch == () and ids(q) == [1]
    p = plan(q, cap=8, in_batch=0, serial_running=True, closing=False)
    assert p.to_batch == ()  # the row behind waits for the serial one to finish


def test_plan_rows_before_a_serial_waiter_still_join_and_nothing_is_reordered():
    q = deque([row(0), row(1, Lane.SERIAL), row(2)])
    p = plan(q, cap=8, in_batch=1, serial_running=False, closing=False)
    assert ids(p.to_batch) == [0] and p.to_serial is None and ids(q) == [1, 2]


def test_plan_admits_nothing_while_closing():
    q = deque([row(0)])
    assert plan(q, cap=8, in_batch=0, serial_running=False, closing=True).to_batch == ()


def test_finish_reason_by_eos_stop_id_and_length():
    r = row(0, max_tokens=3, stop_token_ids=(7,))
    assert finish_reason(r, 5, 1, {9}) is None
    assert finish_reason(r, 9, 1, {9}) == "stop"
    assert finish_reason(r, 7, 2, {9}) == "stop"
    assert finish_reason(r, 5, 3, {9}) == "length"


@pytest.mark.parametrize(
    ("text", "stops", "expect"),
    [
        ("hello world", ("wor",), ("hello ", "", True)),
        ("hello wo", ("world",), ("hello ", "wo", False)),
        ("hello", ("xyz",), ("hello", "", False)),
        ("abc", (), ("abc", "", False)),
        ("a STOP b STO", ("STOP", "b"), ("a ", "", True)),
    ],
)
def test_split_stop_never_shows_a_stop_string(text, stops, expect):
    assert _split_stop(text, stops) == expect


def test_histogram_quantiles_are_bucket_bounds():
    h = Histogram(buckets=(0.1, 1.0))
    for v in (0.05, 0.05, 0.5, 5.0):
        h.observe(v)
    snap = h.snapshot()
    assert snap.counts == (2, 1, 1) and snap.count == 4
    assert snap.quantile(0.5) == 0.1 and snap.quantile(0.75) == 1.0
    assert snap.quantile(1.0) == float("inf")


def test_sampling_params_are_frozen_and_validated():
    p = SamplingParams(max_tokens=4)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        p.max_tokens = 5
    assert p.greedy and not p.wants_logprobs


async def test_gpu_calls_run_on_one_thread_in_order_and_are_never_abandoned():
    gpu = Gpu()
    gpu.start()
    seen, done = [], []
    try:
        await gpu.call(lambda: seen.append(threading.current_thread().name))
        with trio.move_on_after(0.01):
            await gpu.call(lambda: (time.sleep(0.2), done.append(1)))  # outlives the deadline
        assert done == [1], "a cancelled caller waits for its call to finish"
        await gpu.call(lambda: seen.append(threading.current_thread().name))
        assert seen == ["mlx-nursery-gpu"] * 2
        with pytest.raises(ZeroDivisionError):
            await gpu.call(lambda: 1 / 0)
    finally:
        await gpu.stop()


def test_the_lane_token_is_held_by_one_lane_at_a_time():
    gpu = Gpu()
    gpu.take_lane("batch")
    with pytest.raises(RuntimeError, match="holds it"):
        gpu.take_lane("serial")
    gpu.give_lane("batch")
    gpu.take_lane("serial")
    assert gpu.statistics().lane == "serial"
