"""Scheduling decisions and small mechanisms, without a model."""

from __future__ import annotations

import threading
import time
from collections import deque

import attrs
import pytest
import trio
from mlx_nursery.actors import InvalidRequest
from mlx_nursery.actors.admission import plan, shares, to_pause
from mlx_nursery.actors.emitter import _split_stop
from mlx_nursery.actors.gpu import Gpu
from mlx_nursery.actors.prefill import MIN_SHARED, PRIMES_PER_TURN, plan_turn
from mlx_nursery.actors.request import FinishReason, Lane, SamplingParams, session_weight
from mlx_nursery.actors.row import Cancel, End, Finish, IllegalTransition, Phase, Row, RowTimes
from mlx_nursery.actors.settings import EngineSettings
from mlx_nursery.actors.stats import Histogram
from mlx_nursery.actors.step.joiner import Prefill


def row(i, lane=Lane.CONTINUOUS, prompt=(1, 2), eos=(), **params):
    send, _ = trio.open_memory_channel(1)
    p = SamplingParams(**params)
    stop_ids = frozenset(eos) | frozenset(p.stop_token_ids)
    return Row(i, list(prompt), p, lane, send, RowTimes(0.0), stop_ids=stop_ids)


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


def of(session, i, **kw):
    r = row(i, **kw)
    r.session = session
    return r


def test_plan_gives_a_waiting_session_the_next_free_slot():
    # Session A fanned out: four rows admitted, eight more queued. B's one request
    # came after all of them; it gets the next free slot, then A's rows in order.
    q = deque([*(of("A", i) for i in range(4, 12)), of("B", 12)])
    p = plan(q, cap=4, in_batch=3, serial_running=False, closing=False,
             admitted={"A": 3})  # fmt: skip
    assert ids(p.to_batch) == [12]
    p = plan(q, cap=4, in_batch=3, serial_running=False, closing=False,
             admitted={"A": 2, "B": 1})  # fmt: skip
    assert ids(p.to_batch) == [4]
    assert ids(q) == list(range(5, 12))


def test_plan_shares_free_slots_between_sessions_in_turn():
    q = deque([of("A", 0), of("A", 1), of("A", 2), of("B", 3), of("B", 4), of("C", 5)])
    p = plan(q, cap=5, in_batch=0, serial_running=False, closing=False)
    # rounds: A, B, C each one (fewest admitted, earliest first), then A, B
    assert ids(p.to_batch) == [0, 3, 5, 1, 4]
    assert ids(q) == [2]


def test_plan_without_sessions_is_fifo_and_a_lone_request_is_its_own_session():
    q = deque([row(0), of("A", 1), of("A", 2), row(3)])
    p = plan(q, cap=3, in_batch=0, serial_running=False, closing=False,
             admitted={"A": 2})  # fmt: skip
    # the lone requests have nothing admitted: they go before A's third and fourth
    assert ids(p.to_batch) == [0, 3, 1]


def test_plan_the_chosen_head_holds_admission_when_it_does_not_fit():
    big = of("B", 2)
    big.kv_projected = 900
    q = deque([of("A", 0), of("A", 1), big])
    p = plan(q, cap=8, in_batch=1, serial_running=False, closing=False, budget=1000,
             live_bytes=200, admitted={"A": 1})  # fmt: skip
    assert p.to_batch == () and ids(q) == [0, 1, 2]  # B is next, and waits for room


def test_plan_weights_share_free_slots_in_proportion():
    heavy = [of("A", i) for i in range(6)]
    for r in heavy:
        r.weight = 2.0
    q = deque([*heavy, *(of("B", i) for i in range(6, 12))])
    p = plan(q, cap=6, in_batch=0, serial_running=False, closing=False,
             weights={"A": 2.0, "B": 1.0})  # fmt: skip
    sessions = [r.session for r in p.to_batch]
    assert sessions.count("A") == 4 and sessions.count("B") == 2, sessions


def test_plan_a_paused_head_needs_no_new_kv():
    paused = of("A", 0)
    paused.phase, paused.kv_projected = Phase.PAUSED, 900  # its KV is held already
    q = deque([paused])
    p = plan(q, cap=8, in_batch=1, serial_running=False, closing=False, budget=1000,
             live_bytes=950, admitted={"B": 1})  # fmt: skip
    assert ids(p.to_batch) == [0]


def test_shares_fill_by_weight_up_to_each_demand():
    assert shares({"A": 12, "B": 1}, {}, 4) == {"A": 3.0, "B": 1.0}
    assert shares({"A": 12, "B": 12}, {}, 4) == {"A": 2.0, "B": 2.0}
    assert shares({"A": 12, "B": 12}, {"A": 3.0}, 4) == {"A": 3.0, "B": 1.0}
    fair = shares({"A": 5, "B": 5, "C": 5}, {}, 4)
    assert all(abs(v - 4 / 3) < 1e-9 for v in fair.values())
    assert shares({"A": 1, "B": 1}, {}, 8) == {"A": 1.0, "B": 1.0}  # slots left over
    assert shares({"A": 0}, {}, 4) == {}


def running(session, i, phase=Phase.DECODING):
    r = of(session, i)
    r.phase = phase
    return r


def test_to_pause_takes_the_latest_decoding_row_of_the_session_over_its_share():
    admitted = [running("A", i) for i in range(4)]
    q = deque([*(of("A", i) for i in range(4, 12)), of("B", 12)])  # B came at t=0
    assert to_pause(q, admitted, cap=4, now=0.3, pause_after=0.5) is None  # not yet
    assert to_pause(q, admitted, cap=4, now=0.5, pause_after=0.5).id == 3
    admitted[3].phase = Phase.JOINING  # not decoding: the next latest goes
    assert to_pause(q, admitted, cap=4, now=0.5, pause_after=0.5).id == 2
    free = admitted[:3]  # a slot is free: B takes it, nothing is paused
    assert to_pause(q, free, cap=4, now=9.0, pause_after=0.5) is None


def test_to_pause_never_swings_back_and_forth():
    # A was paused for B: A holds 3 of 4 (its share), B 1; A's paused row waits.
    paused = of("A", 3)
    paused.phase, paused.times.paused = Phase.PAUSED, 0.0
    admitted = [running("A", 0), running("A", 1), running("A", 2), running("B", 12)]
    q = deque([paused, *(of("A", i) for i in range(4, 12))])
    assert to_pause(q, admitted, cap=4, now=9.0, pause_after=0.5) is None
    # three sessions over four slots (shares 4/3): the one with none takes one
    # from a session with two, and then nobody is below the floor of its share
    admitted = [running("A", 0), running("A", 1), running("B", 2), running("B", 3)]
    q = deque([of("A", 4), of("B", 5), of("C", 6)])
    victim = to_pause(q, admitted, cap=4, now=9.0, pause_after=0.5)
    assert victim.session in ("A", "B")
    admitted.remove(victim)
    admitted.append(running("C", 6))
    victim.phase = Phase.PAUSED
    q = deque([victim, of("A", 4), of("B", 5)])
    assert to_pause(q, admitted, cap=4, now=9.0, pause_after=0.5) is None


def test_to_pause_leaves_fifo_alone_and_weights_move_the_share():
    admitted = [running(None, i) for i in range(4)]
    q = deque([of(None, 4), of(None, 5)])
    assert to_pause(q, admitted, cap=4, now=9.0, pause_after=0.5) is None  # FIFO
    # B weighs 3: its share of 4 slots is 3 against A's 1
    admitted = [running("A", 0), running("A", 1), running("A", 2), running("B", 3)]
    bs = [of("B", i) for i in (4, 5)]
    for r in (*bs, admitted[3]):
        r.weight = 3.0
    q = deque([of("A", 6), *bs])
    assert to_pause(q, admitted, cap=4, now=9.0, pause_after=0.5).id == 2
    serial = [*admitted[:3], row(9, Lane.SERIAL)]
    assert to_pause(q, serial, cap=4, now=9.0, pause_after=0.5) is None


def ranked(session, i, priority, phase=None):
    r = of(session, i) if phase is None else running(session, i, phase)
    r.priority = priority
    return r


def test_plan_admits_the_best_class_first_and_aging_lifts_the_others():
    """A main agent's row (interactive) goes ahead of its own sub-agents' queued
    before it, and of background work; after ``aging`` seconds a sub-agent ranks
    with it (then the older row first), a background row after twice that."""
    q = deque([ranked("A", 0, 1), ranked("A", 1, 2), ranked("A", 2, 0), ranked("A", 3, 1)])
    p = plan(deque(q), cap=2, in_batch=0, serial_running=False, closing=False, now=5.0,
             aging=10.0)  # fmt: skip
    assert ids(p.to_batch) == [2, 0]
    p = plan(deque(q), cap=2, in_batch=0, serial_running=False, closing=False, now=10.0,
             aging=10.0)  # fmt: skip
    assert ids(p.to_batch) == [0, 2]  # the sub-agent waited 10 s: it ranks as interactive
    p = plan(deque(q), cap=4, in_batch=0, serial_running=False, closing=False, now=20.0,
             aging=10.0)  # fmt: skip
    assert ids(p.to_batch) == [0, 1, 2, 3]  # everyone interactive at 20 s: arrival order
    p = plan(deque(q), cap=4, in_batch=0, serial_running=False, closing=False)
    assert ids(p.to_batch) == [2, 0, 3, 1]  # no aging: by class, then arrival


def test_to_pause_makes_room_at_once_for_a_better_class():
    """The batch full of a session's sub-agents: its main agent's turn pauses the
    latest sub-agent at once (no ``pause_after`` wait), background before that;
    a sub-agent that ranks better only by waiting pauses nobody."""
    admitted = [ranked("A", i, 1, Phase.DECODING) for i in range(3)]
    admitted.append(ranked("A", 3, 2, Phase.DECODING))
    q = deque([ranked("A", 5, 1), ranked("A", 6, 0)])
    assert to_pause(q, admitted, cap=4, now=0.0, pause_after=0.5).id == 3  # background first
    admitted[3].priority = 1
    assert to_pause(q, admitted, cap=4, now=0.0, pause_after=0.5).id == 3  # then the latest
    q = deque([ranked("A", 5, 1)])
    assert to_pause(q, admitted, cap=4, now=99.0, pause_after=0.5, aging=10.0) is None
    everyone = [ranked("A", i, 0, Phase.DECODING) for i in range(4)]
    assert to_pause(deque([ranked("A", 6, 0)]), everyone, cap=4, now=0.0, pause_after=0.5) is None


def test_a_room_is_kept_free_of_a_worse_class_while_a_better_one_runs():
    """With ``room`` 1 and four slots, a main agent's row beside its sub-agents:
    one sub-agent is paused to make it a slot, a second to keep the room free,
    and admission does not fill the room with a sub-agent; once no better class
    runs, the sub-agents take every slot again."""
    subs = [ranked("A", i, 1, Phase.DECODING) for i in range(4)]
    main = ranked("A", 9, 0)
    assert to_pause(deque([main]), subs, cap=4, now=0.0, pause_after=0.5, room=1).id == 3
    main.phase = Phase.DECODING
    batch = [*subs[:3], main]
    assert to_pause(deque(), batch, cap=4, now=0.0, pause_after=0.5, room=1).id == 2
    assert to_pause(deque(), batch, cap=4, now=0.0, pause_after=0.5) is None  # room 0
    q = deque([ranked("A", 10, 1)])
    p = plan(deque(q), cap=4, in_batch=3, serial_running=False, closing=False, best=0, room=1)
    assert p.to_batch == ()
    p = plan(deque(q), cap=4, in_batch=3, serial_running=False, closing=False, best=1, room=1)
    assert ids(p.to_batch) == [10]
    p = plan(deque([ranked("A", 11, 0)]), cap=4, in_batch=3, serial_running=False,
             closing=False, best=1, room=1)  # fmt: skip
    assert ids(p.to_batch) == [11]  # the better class takes the room


def test_to_pause_for_a_session_takes_a_worse_class_first():
    admitted = [ranked("A", 0, 1, Phase.DECODING), ranked("A", 1, 0, Phase.DECODING),
                ranked("A", 2, 1, Phase.DECODING), ranked("A", 3, 0, Phase.DECODING)]  # fmt: skip
    q = deque([ranked("B", 4, 0)])
    assert to_pause(q, admitted, cap=4, now=9.0, pause_after=0.5).id == 2
    # a sub-agent of a session below its share never pauses an interactive row
    # (its class would pause the sub-agent back): it waits for a slot
    mains = [ranked("A", i, 0, Phase.DECODING) for i in range(4)]
    assert to_pause(deque([ranked("B", 4, 1)]), mains, cap=4, now=9.0, pause_after=0.5) is None


def test_priority_is_read_as_a_class_or_vllms_integer():
    from mlx_nursery.actors.request import Priority, priority_of

    assert priority_of("subagent") == 1 and priority_of(" Background ") == 2
    assert priority_of(0) == 0 and priority_of("-3") == -3 and priority_of(7.0) == 7
    assert Priority.of_rank(-3) is Priority.INTERACTIVE and Priority.of_rank(7).name == "BACKGROUND"
    for bad in ("urgent", True, 1.5, 10**6, None, [1]):
        with pytest.raises(InvalidRequest, match="priority must be") as e:
            priority_of(bad)
        assert e.value.param == "priority"


def test_session_weight_is_checked():
    assert session_weight("2.5") == 2.5
    for bad in ("0", "-1", "nan", "inf", "heavy", True, 10_000):
        with pytest.raises(InvalidRequest, match="session_weight must be"):
            session_weight(bad)


def test_plan_admits_nothing_while_closing():
    q = deque([row(0)])
    assert plan(q, cap=8, in_batch=0, serial_running=False, closing=True).to_batch == ()


def test_the_finish_decision_by_eos_stop_id_and_length():
    r = row(0, max_tokens=3, stop_token_ids=(7,), eos=(9,))
    assert r.accept(5) is None and r.end is None
    assert r.accept(5) is None
    assert r.accept(5) is FinishReason.LENGTH and r.end == End(FinishReason.LENGTH)
    for stop in (9, 7):
        r = row(0, max_tokens=3, stop_token_ids=(7,), eos=(9,))
        assert r.accept(stop) is FinishReason.STOP and r.tokens == [stop]


def test_the_first_end_wins_and_a_second_is_a_no_op():
    r = row(0)
    assert r.ask(Finish(0, FinishReason.STOP))
    assert not r.ask(Cancel(0, "client gone"))
    assert r.end == End(FinishReason.STOP)
    r = row(1)
    assert r.ask(Cancel(1, "client gone"))
    assert not r.ask(Finish(1, FinishReason.STOP))
    assert r.end == End(FinishReason.CANCELLED, "client gone")
    r.move(Phase.PREFILLING)
    r.move(Phase.ENDED)
    assert not r.ask_end(End(FinishReason.ERROR, "late")), "an ended row takes no end"


@pytest.mark.parametrize(
    "path",
    [
        [Phase.PREFILLING, Phase.JOINING, Phase.DECODING, Phase.ENDED],
        [Phase.SERIAL, Phase.ENDED],
        [Phase.ENDED],
        [Phase.PREFILLING, Phase.ENDED],
        [Phase.PREFILLING, Phase.JOINING, Phase.ENDED],
    ],
)
def test_a_row_moves_along_its_legal_phases(path):
    r = row(0)
    for phase in path:
        r.move(phase)
    assert r.phase is path[-1]


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        ([], Phase.DECODING),  # queued rows prefill first
        ([Phase.PREFILLING], Phase.DECODING),  # a row joins before it decodes
        ([Phase.SERIAL], Phase.DECODING),  # lanes never mix
        ([Phase.ENDED], Phase.ENDED),  # ended once
        ([Phase.PREFILLING, Phase.ENDED], Phase.PREFILLING),
    ],
)
def test_an_illegal_transition_raises(path, bad):
    r = row(0)
    for phase in path:
        r.move(phase)
    with pytest.raises(IllegalTransition, match="cannot go from"):
        r.move(bad)


def job(prompt, done=0, started=False):
    p = Prefill(None, list(prompt), SamplingParams(), step_size=32)
    p.start_from([object()] if done else None, done)
    p.started = started
    return p


def test_plan_turn_shares_the_budget_oldest_first():
    a, b, c = job(range(100)), job(range(200, 210)), job(range(300, 340))
    plan = plan_turn([a, b, c], step_size=64)
    assert plan == [([a], 64)], "the oldest takes the whole budget when its prompt needs it"
    a.done = 99  # its prompt is in but its last token: the prime is all that is left
    plan = plan_turn([a, b, c], step_size=64)
    assert plan == [([a], 0), ([b], 9)]
    assert len(plan) == PRIMES_PER_TURN  # a turn ends after two primes


def test_plan_turn_prefills_what_fits_together_and_keeps_half_for_the_oldest():
    a, b, c = job(range(100)), job(range(200, 210)), job(range(300, 340))
    d = job(range(400, 402))
    # b and c padded to c's 40 tokens take 80 > 64: no group, a goes alone.
    assert plan_turn([a, b, c], step_size=64, together=True) == [([a], 64)]
    assert plan_turn([b, c], step_size=128, together=True) == [([b, c], None)]
    # The shortest whole prompts go together, first, in arrival order; the oldest
    # (a, 99 tokens to go) keeps the rest of the turn and is primed in it too.
    plan = plan_turn([a, b, d], step_size=128, together=True)
    assert plan == [([b, d], None), ([a], 99)]
    # With a in the group too, 3 x 100 tokens would pass 256: b and c go together.
    plan = plan_turn([a, b, c], step_size=256, together=True)
    assert plan == [([b, c], None), ([a], 99)]
    assert plan_turn([a, b, c], step_size=512, together=True) == [([a, b, c], None)]
    # A joiner that took a long prefix from the prompt cache goes alone.
    shared = list(range(1000, 1300))
    e, f = job([*shared, 1, 2], done=300), job([*shared, 3, 4], done=300)
    assert plan_turn([e, f], step_size=512, together=True) == [([e], 1), ([f], 1)]


def test_plan_turn_holds_back_a_joiner_that_shares_an_earlier_ones_prefix():
    shared = list(range(1000, 1000 + MIN_SHARED + 8))
    first = job([*shared, 1, 2, 3], started=True)
    second = job([*shared, 7, 8, 9])
    plan = plan_turn([first, second], step_size=8)
    assert plan == [([first], 8)], "the second waits for the shared part"
    assert len(shared) in first.snapshot_at, "the first snapshots where they part"
    first.done = len(shared)
    plan = plan_turn([first, second], step_size=64)
    assert any(second in jobs for jobs, _ in plan), "released once the shared part is in"


def test_settings_are_checked_once_by_type():
    with pytest.raises(InvalidRequest) as err:
        EngineSettings(batch=0)
    assert err.value.param == "batch"
    with pytest.raises(InvalidRequest, match="dtype must be one of"):
        EngineSettings(dtype="int3")
    assert EngineSettings(kv_budget="1G").kv_budget == 1 << 30
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(max_tokens="many")
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(stop=5)
    assert err.value.param == "stop"


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


def _kv_cache(length: int, seed: int):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    k = mx.random.normal((1, 2, length, 4), key=mx.random.key(seed))
    cache.update_and_fetch(k, k + 1)
    return cache


def test_a_join_writes_the_batch_in_one_copy_as_mlx_lms_merge_and_extend_would():
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, RotatingKVCache
    from mlx_nursery.actors.step.kv import side_by_side

    def parts():
        batch = BatchKVCache.merge([_kv_cache(5, 1), _kv_cache(9, 2)])
        step = mx.random.normal((2, 2, 1, 4), key=mx.random.key(3))
        batch.update_and_fetch(step, step)
        return [batch, _kv_cache(30, 4), _kv_cache(3, 5)]

    batch, *solo = parts()
    batch.extend(BatchKVCache.merge(solo))  # mlx-lm's way
    ours = side_by_side(parts())
    assert ours.keys.shape[2] > ours._idx == batch._idx == 30  # room for the next write
    assert ours.left_padding.tolist() == batch.left_padding.tolist() == [24, 20, 0, 27]
    assert ours.offset.tolist() == batch.offset.tolist() == [6, 10, 30, 3]
    for got, want in zip(ours.keys_and_values(), batch.keys_and_values(), strict=True):
        assert mx.array_equal(got, want).item()
    new = mx.random.normal((4, 2, 1, 4), key=mx.random.key(6))
    size = ours.keys.shape[2]
    written = zip(ours.update_and_fetch(new, new), batch.update_and_fetch(new, new), strict=True)
    assert all(mx.array_equal(got, want).item() for got, want in written)
    assert ours.keys.shape[2] == size  # written in place, not grown by a copy
    assert side_by_side([batch, RotatingKVCache(max_size=8)]) is None  # mlx-lm's way
