"""Scenarios scripted by engine step (never by sleeping), on the real tiny models.

Each reads like the scenario it scripts; the autouse fixture in conftest checks
afterwards that every row ended, nothing is queued and no KV is left.
"""

from __future__ import annotations

import random
import threading
from functools import partial

import pytest
import trio
import trio.testing
from conftest import FaultyModel, checked_engine, golden, loaded
from mlx_nursery.actors import GenerationFailed, Overloaded, open_engine
from mlx_nursery.actors.decode import RETIRED_TURNS

FAMILY = "llama"


def serial_cases(family=FAMILY):
    return {c["prompt"]: c for c in golden(family)["serial"]}


async def settle(engine):
    """Let every actor (stats included) catch up with what has happened so far."""
    await trio.testing.wait_all_tasks_blocked()


async def test_eight_concurrent_rows_batch_and_match_goldens():
    cases = list(serial_cases().values())
    prompts = [cases[i % len(cases)] for i in range(8)]
    results = [None] * 8
    seen_rows = []

    async def run(i):
        results[i] = await engine.generate(prompts[i]["prompt_ids"], max_tokens=40)

    async with checked_engine(FAMILY, batch=8) as engine, trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(run, i)
        while not all(results):
            await engine.wait_step(engine.steps + 1)
            await settle(engine)
            seen_rows.append(engine.stats().decoding_rows)
    assert max(seen_rows) == 8, seen_rows
    for case, result in zip(prompts, results, strict=True):
        assert result.tokens == case["tokens"], case["prompt"]
    assert engine.stats().padding_waste == 0.0  # after all rows left


async def test_a_row_joins_at_step_k_and_starts_after_it():
    cases = serial_cases()
    first_event_step = {}

    finished = set()

    async def run(name):
        async with engine.submit(cases[name]["prompt_ids"], max_tokens=40) as stream:
            tokens = []
            async for event in stream:
                first_event_step.setdefault(name, engine.steps)
                if event.token is not None:
                    tokens.append(event.token)
        assert tokens == cases[name]["tokens"], name
        finished.add(name)

    waste = []
    async with checked_engine(FAMILY, batch=4) as engine, trio.open_nursery() as nursery:
        nursery.start_soon(run, "sentence")
        await engine.wait_step(6)
        joined_at = engine.steps
        nursery.start_soon(run, "long")  # 216 tokens: prefilled in 7 chunks of 32
        while not finished:  # until the first of the two rows is done
            await engine.wait_step(engine.steps + 1)
            await settle(engine)
            waste.append(engine.stats().padding_waste)
    assert first_event_step["long"] > joined_at
    # the short row is left-padded to the long one's width while both decode
    assert max(waste) > 0.25, waste


async def test_a_row_cancelled_at_step_k_leaves_and_frees_its_kv():
    cases = serial_cases()
    names = ["sentence", "utf8", "chat"]
    results = {}

    async def run(name, scope_box):
        with trio.CancelScope() as scope:
            scope_box.append(scope)
            results[name] = await engine.generate(cases[name]["prompt_ids"], max_tokens=40)

    async with checked_engine(FAMILY, batch=4) as engine, trio.open_nursery() as nursery:
        scopes = {n: [] for n in names}
        for n in names:
            nursery.start_soon(run, n, scopes[n])
        while engine.stats().decoding_rows < 3:  # all three prefilled and joined
            await engine.wait_step(engine.steps + 1)
            await settle(engine)
        await engine.wait_step(engine.steps + 2)
        await settle(engine)
        before = engine.stats()
        assert before.decoding_rows == 3
        scopes["utf8"][0].cancel()
        # one step to see it, one already queued when it was seen (--pipeline 2), one to be sure
        await engine.wait_step(engine.steps + 3)
        await settle(engine)
        assert engine.stats().decoding_rows == 2
        # Its slot waits a few turns for a joiner to be written over it, then the
        # batch is compacted and the KV freed.
        await engine.wait_step(engine.steps + RETIRED_TURNS + 2)
        await settle(engine)
        after = engine.stats()
        assert after.decoding_rows == 2
        assert after.kv_bytes < before.kv_bytes
    assert "utf8" not in results
    for n in ("sentence", "chat"):
        assert results[n].tokens == cases[n]["tokens"], n
    assert engine.stats().cancelled == 1


async def test_with_requests_waiting_a_retired_slot_waits_for_its_joiner():
    """While requests queue, a leaving row's replacement is already prefilling,
    so its retired slot waits for it and the joiner is written over it in place,
    however many turns the prefill takes; compacting first would have the join
    copy the whole batch (a main agent's long row makes that hundreds of MB)."""
    rng = random.Random(5)

    def prompt(n):
        return [rng.randrange(3, 250) for _ in range(n)]

    prompts = {"stay": prompt(700), "leave": prompt(650), "slow": prompt(400), "next": prompt(20)}
    tokens = {"stay": 60, "leave": 3, "slow": 4, "next": 4}
    results = {}

    async def run(name):
        results[name] = await engine.generate(prompts[name], max_tokens=tokens[name])

    async with checked_engine(FAMILY, batch=2) as engine, trio.open_nursery() as nursery:
        for name in prompts:  # "slow" (13 prefill chunks) and "next" queue behind the two
            nursery.start_soon(run, name)
            await settle(engine)
    stats = engine.stats()
    assert stats.refilled >= 1, "the slow joiner was written over the retired slot"
    assert set(results) == set(prompts)


async def test_rows_refilled_in_place_do_not_grow_the_batch_without_bound():
    """Ninety-six queued requests through a batch of three, ending at different
    steps: every joiner is written over a retired slot at the batch's write
    position and nothing compacts the batch, so the left padding all rows share
    grows by each row's length. Growing the buffer drops it (``rows._make_room``):
    the buffer stays within a few hundred positions of its longest row instead of
    a third of the sum of every row's (about 1,200 positions here)."""
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 250) for _ in range(10)] for _ in range(96)]
    lengths = [(20, 27, 34)[i % 3] for i in range(len(prompts))]
    results, widths = {}, []

    async def run(i):
        results[i] = await engine.generate(prompts[i], max_tokens=lengths[i])

    async with (
        checked_engine(FAMILY, batch=3, max_queued_requests=len(prompts)) as engine,
        trio.open_nursery() as nursery,
    ):
        for i in range(len(prompts)):
            nursery.start_soon(run, i)
        while len(results) < len(prompts):
            await engine.wait_step(engine.steps + 1)
            await settle(engine)
            widths.append(engine.stats().kv_bytes)
    args = loaded(FAMILY)[0].args
    position = 2 * args.num_hidden_layers * args.num_key_value_heads * (
        args.hidden_size // args.num_attention_heads) * 4  # K and V of one row, float32
    assert engine.stats().refilled >= 60
    # rows of at most 44 positions; mlx-lm grows by 256, and a cut needs 256 shared
    assert max(widths) <= 3 * position * (44 + 3 * 256), max(widths) // (3 * position)
    for i in (0, 1, 2, 95):  # the same tokens as each prompt alone
        assert results[i].tokens == await solo(prompts[i], lengths[i]), i


async def solo(prompt, max_tokens):
    async with checked_engine(FAMILY, batch=1) as engine:
        return (await engine.generate(prompt, max_tokens=max_tokens)).tokens


async def test_submitters_cancelled_before_their_answer_leave_the_engine_serving():
    """A nursery of submitters against a full queue: the first refused one cancels
    the rest, some of them while they wait for admission's answer. Admission then
    finds their reply channels closed; it used to raise there, and the engine died
    with every request in it. Now such a row is dropped (or cancelled, if it was
    queued before its caller left) and the engine serves on."""
    prompt = serial_cases()["sentence"]["prompt_ids"]
    async with checked_engine(FAMILY, batch=1, max_queued_requests=2) as engine:
        with pytest.raises(ExceptionGroup) as caught:
            async with trio.open_nursery() as nursery:
                for _ in range(12):
                    nursery.start_soon(partial(engine.generate, prompt, max_tokens=30))
        assert caught.group_contains(Overloaded)
        await settle(engine)  # the queued ones' cancels handled
        after = await engine.generate(prompt, max_tokens=8)
        assert after.tokens == serial_cases()["sentence"]["tokens"][:8]


async def test_a_raising_consumer_loses_only_its_own_row():
    cases = serial_cases()
    sibling = {}

    async def run_sibling():
        sibling["r"] = await engine.generate(cases["chat"]["prompt_ids"], max_tokens=40)

    async with checked_engine(FAMILY, batch=4) as engine, trio.open_nursery() as nursery:
        nursery.start_soon(run_sibling)
        await engine.wait_step(2)
        with pytest.raises(ValueError, match="consumer broke"):
            async with engine.submit(cases["sentence"]["prompt_ids"], max_tokens=40) as stream:
                n = 0
                async for _ in stream:
                    n += 1
                    if n == 3:
                        raise ValueError("consumer broke")
    assert sibling["r"].tokens == cases["chat"]["tokens"]
    assert engine.stats().cancelled == 1


@pytest.mark.parametrize("pipeline", [0, 1, 2])
async def test_a_forward_fault_fails_the_batch_and_the_next_request_is_served(pipeline):
    """With steps queued behind the one that fails too (``--pipeline 2``): they
    ran on the batch the fault dropped, and their results are void."""
    model, tokenizer = loaded(FAMILY)
    faulty = FaultyModel(model)
    cases = serial_cases()
    errors = []

    async def run(name):
        try:
            await engine.generate(cases[name]["prompt_ids"], max_tokens=40)
        except GenerationFailed as exc:
            errors.append(str(exc))

    async with checked_engine((faulty, tokenizer), batch=4, pipeline=pipeline) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "sentence")
            nursery.start_soon(run, "chat")
            await engine.wait_step(4)
            faulty.fail_decode = True
        assert len(errors) == 2 and all("injected decode fault" in e for e in errors)
        after = await engine.generate(cases["utf8"]["prompt_ids"], max_tokens=40)
        assert after.tokens == cases["utf8"]["tokens"]
        await settle(engine)
        assert engine.stats().batch_faults == 1
        assert engine.stats().errored == 2


async def test_a_prefill_fault_fails_only_its_joiner():
    model, tokenizer = loaded(FAMILY)
    faulty = FaultyModel(model)
    cases = serial_cases()
    out = {}

    async def run(name):
        try:
            out[name] = await engine.generate(cases[name]["prompt_ids"], max_tokens=40)
        except GenerationFailed as exc:
            out[name] = exc

    async with checked_engine((faulty, tokenizer), batch=4) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "sentence")
            await engine.wait_step(3)
            faulty.fail_prefill = True
            nursery.start_soon(run, "long")
    assert isinstance(out["long"], GenerationFailed)
    assert "injected prefill fault" in str(out["long"])
    assert out["sentence"].tokens == cases["sentence"]["tokens"]


async def test_a_seeded_row_joins_the_batch_and_draws_as_it_does_alone_and_serially():
    """A seeded sampled row joins a running batch (its first token comes while its
    neighbours decode) and samples the same tokens as alone, as on the serial
    lane, whatever its neighbours draw; another seed draws otherwise."""
    cases = serial_cases()
    seeded = {"max_tokens": 24, "temperature": 1.0, "top_p": 0.95, "seed": 7}
    prompt = cases["utf8"]["prompt_ids"]
    async with checked_engine(FAMILY, batch=1) as engine:  # the serial lane
        serial = (await engine.generate(prompt, **seeded)).tokens
    log, out = [], {}

    async def run(name, ids, params):
        tokens = []
        async with engine.submit(ids, **params) as stream:
            async for event in stream:
                if event.token is not None and not tokens:
                    log.append(("first", name, trio.current_time()))
                tokens += [event.token] if event.token is not None else []
        log.append(("end", name, trio.current_time()))
        out[name] = tokens

    async with checked_engine(FAMILY, batch=8) as engine:
        alone = (await engine.generate(prompt, **seeded)).tokens
        other = (await engine.generate(prompt, **{**seeded, "seed": 8})).tokens
        async with trio.open_nursery() as nursery:
            for i, name in enumerate(["sentence", "chat", "long", "short"]):
                params = {"max_tokens": 40, "temperature": 1.0} if i % 2 else {"max_tokens": 40}
                nursery.start_soon(run, name, cases[name]["prompt_ids"], params)
            await engine.wait_step(3)
            nursery.start_soon(run, "seeded", prompt, seeded)
            for name in ("sentence", "chat"):  # more sampled neighbours, after it
                nursery.start_soon(run, name + "+", cases[name]["prompt_ids"],
                                   {"max_tokens": 30, "temperature": 1.0})  # fmt: skip
    at = {(what, name): t for what, name, t in log}
    assert at[("first", "seeded")] < max(at[("end", n)] for n in ("sentence", "chat", "long"))
    assert out["seeded"] == alone == serial
    assert other != alone


async def test_seeded_requests_are_reproducible():
    cases = serial_cases()
    async with checked_engine(FAMILY, batch=8) as engine:
        params = {"max_tokens": 20, "temperature": 1.0, "seed": 1234}
        a = await engine.generate(cases["sentence"]["prompt_ids"], **params)
        b = await engine.generate(cases["sentence"]["prompt_ids"], **params)
    assert a.tokens == b.tokens


async def test_shutdown_with_rows_in_flight_ends_each_with_a_terminal_event():
    cases = serial_cases()
    terminals = {}

    async def run(name):
        async with engine.submit(cases[name]["prompt_ids"], max_tokens=200) as stream:
            async for event in stream:
                if event.terminal:
                    terminals[name] = event

    model = loaded(FAMILY)
    async with trio.open_nursery() as outer:
        async with open_engine(model, batch=2, prefill_step_size=32) as engine:
            for name in ("sentence", "chat", "utf8"):  # the third waits in the queue
                outer.start_soon(run, name)
            await engine.wait_step(4)
    assert {e.finish_reason for e in terminals.values()} == {"cancelled"}
    assert len(terminals) == 3
    snap = engine.stats()
    assert snap.ledger_balanced and snap.cancelled == 3
    assert not [t for t in threading.enumerate() if t.name == "mlx-nursery-gpu"]


async def test_an_embedding_app_runs_the_engine_beside_its_own_tasks():
    ticks = []

    async def ticker():
        while True:
            ticks.append(trio.current_time())
            await trio.sleep(0.01)

    cases = serial_cases()
    async with trio.open_nursery() as app:
        app.start_soon(ticker)
        async with checked_engine(FAMILY, batch=4) as engine:
            r = await engine.generate(cases["sentence"]["prompt_ids"], max_tokens=40)
        app.cancel_scope.cancel()
    assert r.tokens == cases["sentence"]["tokens"]
    assert len(ticks) >= 1


async def test_cancellation_from_outside_closes_the_engine_cleanly():
    cases = serial_cases()
    model = loaded(FAMILY)
    with trio.move_on_after(30) as outer:
        async with trio.open_nursery() as app:
            async with open_engine(model, batch=4, prefill_step_size=32) as engine:
                app.start_soon(engine.generate, cases["long"]["prompt_ids"])
                await engine.wait_step(3)
                app.cancel_scope.cancel()  # the app goes away mid-request
                await trio.sleep_forever()
    assert not outer.cancelled_caught, "engine shutdown hung"
    assert not [t for t in threading.enumerate() if t.name == "mlx-nursery-gpu"]
    assert engine.stats().ledger_balanced


async def test_the_event_loop_stays_responsive_while_eight_rows_decode(capsys):
    cases = list(serial_cases().values())
    lateness = []

    async def probe():
        while True:
            t0 = trio.current_time()
            await trio.sleep(0.001)
            lateness.append(trio.current_time() - t0 - 0.001)

    async with checked_engine(FAMILY, batch=8) as engine, trio.open_nursery() as nursery:
        async with trio.open_nursery() as rows:
            for i in range(8):
                rows.start_soon(engine.generate, cases[i % len(cases)]["prompt_ids"])
            await engine.wait_step(2)
            nursery.start_soon(probe)
        nursery.cancel_scope.cancel()
    lateness.sort()
    p50, worst = lateness[len(lateness) // 2], lateness[-1]
    with capsys.disabled():
        print(
            f"\nscheduling latency while 8 rows decode: p50 {p50 * 1e3:.2f} ms, "
            f"max {worst * 1e3:.2f} ms over {len(lateness)} probes"
        )
    assert worst < 0.25


async def test_a_row_that_ends_at_its_first_token_never_joins_the_batch():
    case = serial_cases()["sentence"]
    async with checked_engine(FAMILY, batch=8) as engine:
        one = await engine.generate(case["prompt_ids"], max_tokens=1)
        none = await engine.generate(case["prompt_ids"], stop_token_ids=[case["tokens"][0]])
        assert engine.steps == 0  # neither row took a decode step
    assert (one.tokens, one.finish_reason) == (case["tokens"][:1], "length")
    assert (none.tokens, none.finish_reason) == ([], "stop")
    assert one.usage.time_to_first_token > 0


def stop_string_at(tokenizer, tokens, k=6):
    """A stop string that first appears once the k-th token (1-based) or a later
    one is read, as the emitter's streaming detokenizer sees the text, and the
    index of that token."""
    detok = tokenizer.detokenizer
    detok.reset()
    texts, text = [], ""
    for token in tokens:
        detok.add_token(token)
        text += detok.last_segment
        texts.append(text)
    for i in range(k, len(tokens)):
        before, now = texts[i - 1], texts[i]
        for n in (3, 2, 4):
            stop = now[-n:]
            fresh = stop not in before and now.find(stop) == len(now) - n
            if len(now) > n and stop.strip() and fresh:
                return stop, i
    raise AssertionError("no usable stop string in the golden")


async def test_a_stop_string_and_a_cancel_for_the_same_row_end_it_once():
    _, tokenizer = loaded(FAMILY)
    cases = serial_cases()
    case = cases["long"]
    stop, at = stop_string_at(tokenizer, case["tokens"])
    sibling = {}

    async def run_sibling():
        sibling["r"] = await engine.generate(cases["chat"]["prompt_ids"], max_tokens=40)

    terminals, tokens = [], []
    async with checked_engine(FAMILY, batch=4) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_sibling)
            await engine.wait_step(2)
            async with engine.submit(case["prompt_ids"], max_tokens=60, stop=stop) as stream:
                async for event in stream:
                    if event.token is not None:
                        tokens.append(event.token)
                        if len(tokens) == at + 1:
                            # The emitter has just found the stop string and asked for
                            # the row to finish; the client's cancel follows at once.
                            stream.cancel("the client gave up")
                    if event.terminal:
                        terminals.append(event)
        await engine.wait_idle()
        snap = engine.stats()
    assert len(terminals) == 1
    assert terminals[0].finish_reason in ("stop", "cancelled")
    assert stop not in "".join(e.text for e in terminals)
    assert tokens == case["tokens"][: at + 1]
    assert snap.finished + snap.cancelled == 2 and snap.errored == 0  # the row and its sibling
    assert sibling["r"].tokens == cases["chat"]["tokens"]


@pytest.mark.parametrize("batch", [1, 4])
async def test_a_stop_string_ends_a_row_like_a_finish_and_keeps_its_kv(batch):
    _, tokenizer = loaded(FAMILY)
    case = serial_cases()["long"]
    stop, at = stop_string_at(tokenizer, case["tokens"])
    async with checked_engine(FAMILY, batch=batch) as engine:
        result = await engine.generate(case["prompt_ids"], max_tokens=60, stop=stop)
        assert result.finish_reason == "stop"
        assert result.tokens == case["tokens"][: at + 1]
        assert result.usage.completion_tokens == at + 1
        assert stop not in result.text
        follow = case["prompt_ids"] + result.tokens
        again = await engine.generate(follow, max_tokens=5)
    assert again.usage.cached_tokens >= len(case["prompt_ids"]), "its KV went to the cache"
