"""One row's fault stays its own: a poison row among eight, at every point of its
life, ends alone with an error; the seven others equal their solo runs, with no
token lost or repeated. Only the shared forward pass can fail a whole batch.
"""

from __future__ import annotations

import httpx
import pytest
import trio
import trio.lowlevel
from conftest import (
    FaultyModel,
    checked_engine,
    golden,
    loaded,
    running_server,
    served,
    sse_events,
)
from mlx_nursery.actors import GenerationFailed

FAMILY = "llama"
CASES = golden(FAMILY)["serial"]
MAX_TOKENS = 40


class Poison:
    """A logits processor (mlx-lm's signature) that raises once its row has
    generated ``k`` tokens: k=0 is the row's first token (sampled at prefill's
    prime), k=MAX_TOKENS-1 its last."""

    def __init__(self, prompt_len: int, k: int):
        self.prompt_len, self.k = prompt_len, k

    def __call__(self, tokens, logits):
        if tokens.size - self.prompt_len >= self.k:
            raise ValueError(f"poisoned at token {self.k}")
        return logits


def prompts8() -> list[dict]:
    return [CASES[i % len(CASES)] for i in range(8)]


async def run_eight(engine, poison_at: int | None, victim: int = 3) -> dict:
    out = {}

    async def run(i, case):
        params = {"max_tokens": MAX_TOKENS}
        if i == victim and poison_at is not None:
            params["logits_processors"] = [Poison(len(case["prompt_ids"]), poison_at)]
        try:
            out[i] = await engine.generate(case["prompt_ids"], **params)
        except GenerationFailed as exc:
            out[i] = exc

    async with trio.open_nursery() as nursery:
        for i, case in enumerate(prompts8()):
            nursery.start_soon(run, i, case)
            await trio.lowlevel.checkpoint()
    return out


@pytest.mark.parametrize("k", [0, 1, 7, MAX_TOKENS - 1], ids=["first", "second", "mid", "last"])
async def test_a_poison_row_ends_alone_and_the_seven_others_are_exact(k):
    async with checked_engine(FAMILY, batch=8) as engine:
        out = await run_eight(engine, poison_at=k)
        snap = engine.stats()
    victim = out.pop(3)
    assert isinstance(victim, GenerationFailed) and f"poisoned at token {k}" in str(victim)
    for i, result in out.items():
        assert result.tokens == prompts8()[i]["tokens"], f"row {i}"
    assert snap.errored == 1 and snap.batch_faults == 0


async def test_a_fault_in_one_rows_prefill_fails_only_that_row():
    model, tokenizer = loaded(FAMILY)
    faulty = FaultyModel(model)
    out = {}

    async def run(i, case):
        try:
            out[i] = await engine.generate(case["prompt_ids"], max_tokens=MAX_TOKENS)
        except GenerationFailed as exc:
            out[i] = exc

    cases = prompts8()
    async with checked_engine((faulty, tokenizer), batch=8) as engine:
        async with trio.open_nursery() as nursery:
            for i in range(7):
                nursery.start_soon(run, i, cases[i])
            while engine.stats().decoding_rows < 7:  # all seven prefilled and decoding
                await engine.wait_step(engine.steps + 1)
            faulty.fail_prefill = True
            nursery.start_soon(run, 7, CASES[3])  # 216 tokens: prefilled in chunks
    assert isinstance(out.pop(7), GenerationFailed)
    for i, result in out.items():
        assert result.tokens == cases[i]["tokens"], f"row {i}"


async def test_the_shared_forward_failing_fails_every_row_and_the_next_eight_are_exact():
    model, tokenizer = loaded(FAMILY)
    faulty = FaultyModel(model)
    async with checked_engine((faulty, tokenizer), batch=8) as engine:
        async with trio.open_nursery() as nursery:
            results = {}

            async def run(i, case):
                try:
                    results[i] = await engine.generate(case["prompt_ids"], max_tokens=MAX_TOKENS)
                except GenerationFailed as exc:
                    results[i] = exc

            for i, case in enumerate(prompts8()):
                nursery.start_soon(run, i, case)
            while engine.stats().decoding_rows < 8:
                await engine.wait_step(engine.steps + 1)
            faulty.fail_decode = True
        assert all(isinstance(r, GenerationFailed) for r in results.values())
        after = await run_eight(engine, poison_at=None)
    for i, result in after.items():
        assert result.tokens == prompts8()[i]["tokens"], f"row {i}"


class FaultyDetokenizerTokenizer:
    """A fake at the tokenizer boundary: the real tokenizer, whose streaming
    detokenizer raises on one token id (the emitter's per-row work)."""

    def __init__(self, tokenizer, poison_token: int):
        self._tokenizer, self._poison = tokenizer, poison_token

    @property
    def detokenizer(self):
        inner, poison = self._tokenizer.detokenizer, self._poison

        class Detokenizer:
            def add_token(self, token):
                if token == poison:
                    raise UnicodeError(f"cannot render token {token}")
                inner.add_token(token)

            def __getattr__(self, name):
                return getattr(inner, name)

        return Detokenizer()

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


async def test_over_http_a_row_whose_text_fails_gets_an_error_event_and_the_others_are_exact():
    model, tokenizer = loaded(FAMILY)
    poison = 200  # forced into the victim's stream with logit_bias; never in the goldens
    assert all(poison not in c["tokens"] for c in prompts8())
    fake = FaultyDetokenizerTokenizer(tokenizer, poison)
    expected = {i: served(c["text"]) for i, c in enumerate(prompts8())}
    with trio.fail_after(120):
        async with running_server(model=(model, fake)) as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                bodies = {}

                async def run(i, case):
                    body = {"prompt": case["prompt_ids"], "max_tokens": MAX_TOKENS, "stream": True}
                    if i == 3:
                        body["logit_bias"] = {str(poison): 100}
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        bodies[i] = await sse_events(r)

                async with trio.open_nursery() as nursery:
                    for i, case in enumerate(prompts8()):
                        nursery.start_soon(run, i, case)
    victim = bodies.pop(3)
    assert victim[-1] == "[DONE]" and "error" in victim[-2]
    assert "cannot render token" in victim[-2]["error"]["message"]
    for i, events in bodies.items():
        text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
        assert text == expected[i], f"row {i}"


async def test_over_http_a_forward_fault_ends_all_eight_streams_within_a_second():
    model, tokenizer = loaded(FAMILY)
    faulty = FaultyModel(model)
    ended, bodies = {}, {}  # the first eight: when each stream ended, and its events
    with trio.fail_after(120):
        async with running_server(model=(faulty, tokenizer)) as (url, state):
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:

                async def run(i, case, store, times=None):
                    body = {"prompt": case["prompt_ids"], "max_tokens": MAX_TOKENS, "stream": True}
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        store[i] = await sse_events(r)
                        if times is not None:
                            times[i] = trio.current_time()

                async with trio.open_nursery() as nursery:
                    for i, case in enumerate(prompts8()):
                        nursery.start_soon(run, i, case, bodies, ended)
                    engine = state.engine
                    while engine.stats().decoding_rows < 8:
                        await engine.wait_step(engine.steps + 1)
                    faulty.fail_decode = True
                    armed = trio.current_time()
                after = {}
                async with trio.open_nursery() as nursery:
                    for i, case in enumerate(prompts8()):
                        nursery.start_soon(run, i, case, after)
    for events in bodies.values():
        assert events[-1] == "[DONE]" and "injected decode fault" in events[-2]["error"]["message"]
    assert len(ended) == 8 and max(ended.values()) - armed < 1.0
    for i, events in after.items():
        text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
        assert text == served(prompts8()[i]["text"]), f"row {i}"
