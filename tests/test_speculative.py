"""Speculative decoding (actors/speculation/): drafts verified in
the continuous batch give mlx-lm's own tokens.

The golden models are tiny and random: left to the gate, they rarely draft (their
answers copy little and a step costs next to nothing). Where a test is about the
verify step itself (every row drafting, keeping some, rolling back the rest), the
gate's decision is forced to "draft all you have" with ``forced_drafts``; the
gate's own choice is tested on its own, below.
"""

from __future__ import annotations

import json
import shutil
from functools import partial

import httpx
import mlx.core as mx
import pytest
import trio
from conftest import checked_engine, golden, loaded, model_path, running_server
from mlx_lm.models.cache import make_prompt_cache
from mlx_nursery.actors.errors import InvalidRequest
from mlx_nursery.actors.request import SamplingParams
from mlx_nursery.actors.speculation.drafters import Drafter, Matches, NgramIndex, SharedIndex
from mlx_nursery.actors.speculation.gate import Gate
from mlx_nursery.actors.speculation.verify import Speculation, Verifier
from mlx_nursery.actors.step.batch import Batch
from mlx_nursery.actors.step.joiner import Prefill
from test_parity import _play_scenarios

PLAIN_KV = ("llama", "qwen3")  # the golden families whose caches can be cut back


@pytest.fixture
def forced_drafts(monkeypatch):
    """Every step with an offer drafts all it offers (the gate's choice, forced)."""

    def choose(self, batch, offers, ends=None):
        self.steps += 1
        return max((n for _, n, _ in offers), default=0)

    monkeypatch.setattr(Gate, "choose", choose)
    monkeypatch.setattr(Gate, "stale", lambda self, batch, width: False)


# -- drafters and gate ---------------------------------------------------------------


def test_ngram_index_finds_the_latest_earlier_occurrence():
    index = NgramIndex((3, 2), [1, 2, 3, 4, 5, 1, 2, 3, 9, 1, 2])
    # "1 2" ends the list: its latest earlier occurrence is followed by 3, 9
    assert index.lookup(index.tokens, 2) == ([3, 9], 2)
    index.append(3)  # "1 2 3" now: two earlier occurrences, the latest wins
    assert index.lookup(index.tokens, 3) == ([9, 1, 2], 3)
    assert index.lookup([7, 7, 7], 4) == ([], 0)


def test_shared_index_keeps_texts_apart_and_bounded():
    shared = SharedIndex(limit=64)
    shared.add([10, 11, 12, 13, 14, 15, 16])
    shared.add([20, 21, 22, 23, 24])
    found, n = shared.lookup([11, 12, 13, 14], 8)
    assert (found, n) == ([15, 16], 4)  # stops at the end of its text
    for start in range(100, 400, 20):
        shared.add(list(range(start, start + 20)))
    assert len(shared) <= 64
    assert shared.lookup([11, 12, 13, 14], 8) == ([], 0)  # the oldest text is gone
    assert shared.lookup([381, 382, 383, 384], 3) == ([385, 386, 387], 4)


def test_drafter_prefers_its_own_tokens_then_its_siblings():
    shared = SharedIndex()
    shared.add([5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    drafter = Drafter.start([1, 2, 3, 4, 1, 2], shared, Matches(), limit=4)
    assert drafter.propose(8) == [3, 4, 1, 2]  # its own prompt, capped at its limit
    assert drafter.match == ("prompt", 2)
    for token in (5, 6, 7, 8):
        drafter.known(token)
    assert drafter.propose(3) == [9, 10, 11]  # a sibling's text matched longer
    assert drafter.match == ("suffix", 4)


def test_drafter_learns_from_runs_and_from_proposals_it_did_not_draft():
    matches = Matches()
    good = Drafter.start([1, 2, 3, 4, 5, 6], None, matches, limit=8)
    for _ in range(6):
        good.drafted(8, 8)
    bad = Drafter.start([1, 2, 3, 4, 5, 6], None, matches, limit=8)
    for _ in range(6):
        bad.drafted(8, 0)
    assert good.rates()[0] > 0.75 and bad.rates()[0] < 0.3
    # an undrafted proposal is checked against the tokens that come
    shadow = Drafter.start([1, 2, 3, 9, 1, 2], None, Matches(), limit=8)
    before = shadow.rates()[0]
    for _ in range(4):
        shadow.shadow_of(shadow.propose(2))
        for token in shadow.shadow[:]:
            shadow.known(token)
    assert shadow.rates()[0] > before


def test_gate_drafts_only_where_the_measured_cost_pays():
    gate = Gate()
    for _ in range(3):
        gate.observe(4, 1, 0.100)
        gate.observe(4, 5, 0.200)
    sure = Drafter.start([1, 2, 3], None, Matches(), limit=8)
    for _ in range(8):
        sure.drafted(4, 4)
    unsure = Drafter.start([1, 2, 3], None, Matches(), limit=8)
    for _ in range(8):
        unsure.drafted(4, 0)
    # four rows that keep what they draft: twice the cost, nearly five times the tokens
    assert gate.choose(4, [(sure, 4, False)] * 4) == 4
    # rows that never keep a draft: the plain step
    assert gate.choose(4, [(unsure, 4, False)] * 4) == 0
    assert gate.cost(4, 3) == pytest.approx(0.150)  # between two measured widths
    # beyond them: 0.1 s more for 4 rows x 4 tokens, so 4 x 2 tokens more cost 0.05 s
    assert gate.token_cost() == pytest.approx(0.100 / 16)
    assert gate.cost(4, 7) == pytest.approx(0.250)
    # at another batch size, the same cost per token: 8 rows' column costs 8 tokens
    gate.observe(8, 1, 0.150)
    assert gate.cost(8, 3) == pytest.approx(0.150 + 16 * 0.100 / 16)
    assert gate.stale(8, 1) and not gate.stale(4, 1)


def test_gate_prices_a_verify_step_at_todays_plain_cost():
    """A verify step measured while contexts were short keeps its multiple of
    the plain step, not its seconds: as every step grows dearer with the rows'
    contexts it grows with them, so it does not come to look free."""
    gate = Gate()
    for _ in range(3):
        gate.observe(8, 1, 0.200)
        gate.observe(8, 2, 0.300)
    assert gate.cost(8, 2) == pytest.approx(0.300)
    for _ in range(40):  # later, longer contexts: only plain steps are timed
        gate.observe(8, 1, 0.300)
    assert gate.cost(8, 1) == pytest.approx(0.300, rel=1e-3)
    assert gate.cost(8, 2) == pytest.approx(0.450, rel=1e-3)
    assert gate.token_cost() == pytest.approx(0.150 / 8, rel=1e-3)
    sure = Drafter.start([1, 2, 3], None, Matches(), limit=8)
    for _ in range(8):
        sure.drafted(4, 4)
    # three rows of eight that keep nearly every draft: 1.3x the tokens for 1.5x
    # the cost (at the old 0.3 s it would pay)
    assert gate.choose(8, [(sure, 1, False)] * 3) == 0
    assert gate.choose(8, [(sure, 1, False)] * 8) == 1


def test_gate_measures_a_wider_step_at_the_first_offer():
    """Until a wider step is measured its cost is the prior's guess; the first
    offer takes one (the widest offered), and the measured cost decides after it."""
    gate = Gate()
    for _ in range(3):
        gate.observe(8, 1, 0.100)
    unsure = Drafter.start([1, 2, 3], None, Matches(), limit=8)
    assert not gate.measured_wider()
    assert gate.choose(8, [(unsure, 4, True), (unsure, 2, True)]) == 4
    for _ in range(3):
        gate.observe(8, 5, 0.700)  # dear columns: 0.15 s each
    assert gate.measured_wider()
    assert gate.choose(8, [(unsure, 4, True)] * 2) == 0


def test_a_wrong_guess_of_the_pending_token_counts_against_the_offer():
    """An offer made before the pending token is known guesses it; the guess is
    scored when the token is known, so rows whose guesses fail offer less."""
    right, wrong = (Drafter.start([1, 2, 3], None, Matches(), limit=8) for _ in range(2))
    for drafter, guess in ((right, True), (wrong, False)):
        for _ in range(8):
            drafter.guessed(guess)
            if guess:
                drafter.drafted(4, 4)
    assert wrong.expected(4, True) < 0.1 < 0.8 < right.expected(4, True)


def test_gate_with_nobody_waiting_values_drafts_by_the_time_they_save():
    gate = Gate()
    for _ in range(3):
        gate.observe(8, 1, 0.200)
        gate.observe(1, 1, 0.090)
        gate.observe(8, 2, 0.300)
    sure = Drafter.start([1, 2, 3], None, Matches(), limit=8)
    for _ in range(8):
        sure.drafted(4, 4)
    assert sure.expected(1, False) > 0.8
    assert gate.token_cost() == pytest.approx(0.100 / 8)
    assert gate.plain_cost(4) == pytest.approx(0.090 + 3 / 7 * 0.110)  # between 1 and 8
    assert gate.plain_cost(9) == pytest.approx(0.200 + 0.100 / 8)  # a row's token more
    seven = [(sure, 1, False)] * 7
    # requests wait: seven rows' kept tokens pay for the wider step
    assert gate.choose(8, seven) == 1
    # nobody waits, and the row that ends last (three times the steps left of
    # the rest) drafts nothing: the seven only leave the batch a step sooner,
    # each saving its share of a step
    assert gate.choose(8, seven, [100] * 7 + [300]) == 0
    # every row is in the tail (at least half the most steps left): the whole
    # batch ends a step sooner when they keep their drafts, and the seven are
    # worth what they are while requests wait
    assert gate.choose(8, seven, [100] * 7 + [180]) == 1
    # one row alone: it is the tail, and a kept token is a whole step of its own
    assert gate.choose(1, [(sure, 1, False)], [100]) == gate.choose(1, [(sure, 1, False)])


# -- the verify step: mlx-lm's tokens --------------------------------------------------


@pytest.mark.parametrize("family", PLAIN_KV)
async def test_lone_row_drafting_matches_stream_generate(family, forced_drafts):
    """Each prompt twice: the second time its rows draft from the first's text
    (the shared index) on top of its own, after a prompt-cache hit."""
    g = golden(family)
    async with checked_engine(family, batch=8) as engine:
        for case in g["serial"] * 2:
            result = await engine.generate(case["prompt_ids"], max_tokens=case["max_tokens"])
            assert result.tokens == case["tokens"], case["prompt"]
            assert result.finish_reason == case["finish_reason"], case["prompt"]
        stats = engine.stats()
    assert stats.verify_steps > 0 and stats.accepted_suffix > 0
    assert stats.tokens_per_forward > 1.0


async def test_greedy_verify_steps_keep_mlx_lms_tokens_under_near_ties(forced_drafts, monkeypatch):
    """A greedy verify step takes its tokens from the logits too (no logsumexp
    over the vocabulary for every position), and where a near tie may change
    one (a model made to put one at every position), mlx-lm's: the tokens are
    ``generate_step``'s on the same model."""
    from mlx_lm.generate import generate_step
    from mlx_nursery.actors.speculation import verify
    from test_host import NearTies

    model, tokenizer = loaded("llama")
    tied = NearTies(model)
    fixed = []
    ties = verify.ties
    monkeypatch.setattr(verify, "ties", lambda *a: fixed.append(ties(*a)) or fixed[-1])
    async with checked_engine((tied, tokenizer), batch=8) as engine:
        for case in golden("llama")["serial"] * 2:
            prompt = case["prompt_ids"]
            want = [int(t) for t, _ in generate_step(mx.array(prompt), tied, max_tokens=24)]
            result = await engine.generate(prompt, max_tokens=24)
            assert result.tokens == want[: len(result.tokens)], case["prompt"]
        assert engine.stats().verify_steps > 0
    assert tied.ties > 0 and any(fixed)


async def test_verify_steps_attend_folded_and_stay_exact(forced_drafts, monkeypatch):
    """A verify step's forward, and only it, takes the CPU attention's verify path
    (the query heads of each key head folded into one matmul), and its rows keep
    mlx-lm's tokens: under the reference BLAS the folded matmul has the same bits."""
    from mlx_nursery.actors.kernels import cpu_attention

    seen, attention = [], cpu_attention.attention

    def recorded(queries, *args, verify=False, **kwargs):
        seen.append((queries.shape[2], verify))
        return attention(queries, *args, verify=verify, **kwargs)

    monkeypatch.setattr(cpu_attention, "attention", recorded)
    g = golden("llama")
    async with checked_engine("llama", batch=8) as engine:
        for case in g["serial"] * 2:
            result = await engine.generate(case["prompt_ids"], max_tokens=case["max_tokens"])
            assert result.tokens == case["tokens"], case["prompt"]
        assert engine.stats().verify_steps > 0
    assert any(verify for _, verify in seen)
    assert all(queries > 1 for queries, verify in seen if verify)
    assert not any(verify for queries, verify in seen if queries == 1)


@pytest.mark.parametrize("family", PLAIN_KV)
async def test_batch_drafting_matches_batch_generator(family, forced_drafts):
    """Rows of every scripted scenario draft (differently each step), keep what
    they keep and are rolled back row by row; each row's tokens are mlx-lm's."""
    stats = await _play_scenarios(family)
    assert sum(s.verify_steps for s in stats) > 0


async def test_a_row_ends_inside_a_kept_run(forced_drafts):
    """max_tokens, a stop id, or a stop string in the middle of the drafts a
    step kept: the row ends exactly where it ends without drafting."""
    case = golden("llama")["serial"][0]
    prompt, tokens = case["prompt_ids"], case["tokens"]
    async with checked_engine("llama", batch=8) as engine:
        for max_tokens in (2, 5, 11):
            result = await engine.generate(prompt, max_tokens=max_tokens)
            assert result.tokens == tokens[:max_tokens]
            assert result.finish_reason == "length"
        stop = tokens[7]
        result = await engine.generate(prompt, max_tokens=40, stop_token_ids=[stop])
        assert result.tokens == tokens[: tokens.index(stop)]  # a stop id is not shown
        assert result.finish_reason == "stop"
        text = engine.tokenizer.decode(tokens[:12])
        result = await engine.generate(prompt, max_tokens=40, stop=[text[-6:]])
        assert result.finish_reason == "stop"
        assert engine.stats().verify_steps > 0


async def test_cancel_during_drafting_and_cache_hit_then_drafting(forced_drafts):
    """A row cancelled mid-stream leaves its neighbours exact; a prompt served
    from the prompt cache drafts like one computed."""
    g = golden("llama")
    cases = g["serial"]
    async with checked_engine("llama", batch=8) as engine:
        results = {}

        async def run(i):
            case = cases[i]
            results[i] = await engine.generate(case["prompt_ids"], max_tokens=case["max_tokens"])

        async with trio.open_nursery() as nursery:
            for i in range(1, 4):
                nursery.start_soon(run, i)
            async with engine.submit(cases[0]["prompt_ids"], max_tokens=40) as stream:
                async for event in stream:
                    if event.token is not None:
                        stream.cancel()
                        break
        for i in range(1, 4):
            assert results[i].tokens == cases[i]["tokens"]
        again = await engine.generate(cases[1]["prompt_ids"], max_tokens=cases[1]["max_tokens"])
        assert again.usage.cached_tokens > 0
        assert again.tokens == cases[1]["tokens"]


async def test_per_request_switch_and_usage(forced_drafts):
    case = golden("llama")["serial"][0]
    async with checked_engine("llama", batch=8) as engine:
        await engine.generate(case["prompt_ids"], max_tokens=40)  # its text: drafts for the rest
        on = await engine.generate(case["prompt_ids"], max_tokens=40)
        off = await engine.generate(case["prompt_ids"], max_tokens=40, speculative=False)
        two = await engine.generate(case["prompt_ids"], max_tokens=40, speculative=2)
    assert on.tokens == off.tokens == two.tokens == case["tokens"]
    assert on.usage.drafts is not None and on.usage.drafts.accepted > 0
    assert on.usage.drafts.tokens_per_forward > 1.0
    assert off.usage.drafts is None
    assert two.usage.drafts is not None
    for bad in (-1, "yes"):
        with pytest.raises(InvalidRequest, match="speculative must be") as caught:
            SamplingParams(speculative=bad)
        assert caught.value.param == "speculative"


async def test_engine_without_speculation_never_drafts(forced_drafts):
    case = golden("llama")["serial"][0]
    async with checked_engine("llama", batch=8, speculative=False) as engine:
        result = await engine.generate(case["prompt_ids"], max_tokens=40)
        assert result.tokens == case["tokens"]
        assert engine.stats().verify_steps == 0


# -- the batch's KV after verify steps ----------------------------------------------------


def _prefill_alone(model, tokens: list[int]) -> list:
    caches = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def test_rows_rolled_back_apart_keep_their_kv_in_token_order(forced_drafts):
    """Rows that keep different numbers of drafts are rolled back apart (a few
    slots copied, the row's order kept on its slot); a row taken out of the
    batch holds its tokens' KV in token order, as a fresh prefill of them would."""
    model, _ = loaded("llama")
    g = golden("llama")
    cases = g["serial"][:3]
    prompts = [c["prompt_ids"] for c in cases]
    batch = Batch(model, verifier=Verifier(Speculation(8)))
    # What the rows will say, for them to draft from: rows 0 and 2 right, row 1
    # with every fifth token wrong (it keeps part of each run).
    for i, case in enumerate(cases):
        said = list(case["tokens"])
        if i == 1:
            said[4::5] = [t + 1 for t in said[4::5]]
        batch.verifier.spec.shared.add(case["prompt_ids"] + said)
    for i, prompt in enumerate(prompts):
        job = Prefill(model, prompt, SamplingParams(max_tokens=40), 32, row_id=i)
        while job.remaining > 0:
            job.chunk()
        joiner = job.prime()
        joiner.read_first()
        batch.join([joiner])
    tokens = [[s.first] for s in batch.slots]
    reordered = False
    for _ in range(12):
        for i, read in enumerate(batch.step()):
            tokens[i] += [s.token for s in read.tokens]
        reordered |= any(s.order is not None for s in batch.slots)
    assert reordered
    # the KV holds each row's prompt and every token it read (read = fed)
    (saved,) = batch.retire([1], [1])
    expect = _prefill_alone(model, prompts[1] + tokens[1])
    for got, want in zip(saved, expect, strict=True):
        assert got.offset == want.offset == len(prompts[1]) + len(tokens[1])
        assert mx.allclose(got.keys[..., : got.offset, :], want.keys[..., : want.offset, :],
                           atol=1e-4)  # fmt: skip
        assert mx.allclose(got.values[..., : got.offset, :], want.values[..., : want.offset, :],
                           atol=1e-4)  # fmt: skip


# -- over HTTP ------------------------------------------------------------------------------


async def test_http_field_usage_stats_and_metrics(forced_drafts):
    case = golden("llama")["serial"][0]
    body = {"model": "llama", "prompt": case["prompt_ids"], "max_tokens": 40}
    with trio.fail_after(120):
        async with running_server() as (url, _), httpx.AsyncClient(base_url=url) as client:
            await client.post("/v1/completions", json=body)  # its text: drafts for the next
            drafted = (await client.post("/v1/completions", json=body)).json()
            usage = drafted["usage"]["speculative"]
            assert usage["accepted_tokens"] > 0
            assert usage["draft_tokens"] == usage["accepted_tokens"] + usage["rejected_tokens"]
            assert usage["tokens_per_step"] > 1.0
            plain = await client.post("/v1/completions", json={**body, "speculative": False})
            assert "speculative" not in plain.json()["usage"]
            assert plain.json()["choices"][0]["text"] == drafted["choices"][0]["text"]
            for path, extra in (
                ("/v1/completions", {**body, "speculative": "yes"}),
                ("/v1/messages", {"model": "llama", "max_tokens": 8, "speculative": -1,
                                  "messages": [{"role": "user", "content": "hi"}]}),
            ):  # fmt: skip
                bad = await client.post(path, json=extra)
                assert bad.status_code == 400, bad.text
                assert "speculative" in bad.text
            stats = (await client.get("/stats")).json()
            assert stats["verify_steps"] > 0 and stats["tokens_per_forward"] > 1.0
            metrics = (await client.get("/metrics")).text
            assert "mlx_nursery_draft_accepted_suffix_total" in metrics


async def test_a_verify_step_mixes_greedy_sampled_and_processor_rows(forced_drafts):
    """One batch: greedy rows that draft, a sampled row (drafts checked against
    its own draws) and a row with a repetition penalty (a processor: it does not
    draft; its processor runs on its first position). The greedy and penalty rows
    give what they give without speculation; every row completes."""
    cases = golden("llama")["serial"][:3]
    penalty = {"repetition_penalty": 1.3}

    async def mix(engine) -> list:
        out = [None] * 4

        async def run(i, prompt, **params):
            out[i] = await engine.generate(prompt, max_tokens=40, **params)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(run, 0, cases[0]["prompt_ids"]))
            nursery.start_soon(partial(run, 1, cases[1]["prompt_ids"]))
            nursery.start_soon(partial(run, 2, cases[2]["prompt_ids"], **penalty))
            nursery.start_soon(partial(run, 3, cases[0]["prompt_ids"], temperature=0.9))
        return out

    async with checked_engine("llama", batch=8, speculative=False) as engine:
        plain = await mix(engine)
    async with checked_engine("llama", batch=8) as engine:
        for case in cases[:2]:  # their texts: drafts for the mix
            await engine.generate(case["prompt_ids"], max_tokens=40)
        drafted = await mix(engine)
        assert engine.stats().verify_steps > 0
    for i in (0, 1, 2):
        assert drafted[i].tokens == plain[i].tokens, i
    assert drafted[3].finish_reason in ("length", "stop") and drafted[3].tokens


# -- a draft model ----------------------------------------------------------------------------


def _draft_dir(tmp_path, family: str, layers: int | None = None, rename: bool = False):
    """A copy of a golden model to draft with: its first ``layers`` layers only
    (a smaller, correlated model of the same tokenizer), or with one vocabulary
    entry renamed (another tokenizer)."""
    out = tmp_path / f"draft-{family}-{layers}-{rename}"
    shutil.copytree(model_path(family), out)
    if layers is not None:
        config = json.loads((out / "config.json").read_text())
        config["num_hidden_layers"] = layers
        (out / "config.json").write_text(json.dumps(config))
        weights = mx.load(str(out / "model.safetensors"))
        kept = {k: v for k, v in weights.items()
                if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}  # fmt: skip
        mx.save_safetensors(str(out / "model.safetensors"), kept)
    if rename:
        tok = json.loads((out / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        vocab["\u00a7"] = vocab.pop("!")
        (out / "tokenizer.json").write_text(json.dumps(tok))
    return str(out)


DRAFT_PAIRS = (("llama", "llama", 1), ("llama", "llama", None), ("qwen3", "llama", None))


@pytest.mark.parametrize(("family", "drafter", "layers"), DRAFT_PAIRS)
async def test_draft_model_gives_mlx_lm_tokens(family, drafter, layers, tmp_path, forced_drafts):
    """A draft model drafts for every row: the target's first layer alone (keeps
    some of each run), the target itself (keeps nearly all), another family of
    the same tokenizer (keeps little). Lone rows and every scripted batch
    scenario give mlx-lm's tokens; the draft's KV follows each row's."""
    g = golden(family)
    draft = _draft_dir(tmp_path, drafter, layers)
    drafted = kept = 0
    async with checked_engine(family, batch=8, draft_model=draft) as engine:
        for case in g["serial"]:
            result = await engine.generate(case["prompt_ids"], max_tokens=case["max_tokens"])
            assert result.tokens == case["tokens"], case["prompt"]
            assert result.finish_reason == case["finish_reason"], case["prompt"]
        stats = engine.stats()
        drafted, kept = stats.drafted_model, stats.accepted_model
        assert stats.drafted_prompt == stats.drafted_suffix == 0
    for stats in await _play_scenarios(family, draft_model=draft):
        drafted += stats.drafted_model
        kept += stats.accepted_model
    assert drafted > 0
    if layers is None and family == drafter:  # the target drafting for itself
        assert kept > 0.8 * drafted
    elif family == drafter:
        assert 0 < kept < drafted


async def test_draft_model_that_cannot_draft_is_refused(tmp_path):
    for draft, why in (
        (_draft_dir(tmp_path, "llama", rename=True), "another tokenizer"),
        (str(model_path("mamba2")), "cannot be cut back"),
    ):
        with pytest.raises(InvalidRequest, match=why) as caught:
            async with checked_engine("llama", draft_model=draft):
                pass
        assert caught.value.param == "draft_model"


def test_gate_times_a_plain_step_only_by_an_uninterrupted_period(monkeypatch):
    """A plain step's period is a cost figure only when the GPU call before its
    own was the last plain step's, with the same rows and no join: a prefill
    chunk, a leave or a join in between is not the step's cost."""
    from mlx_nursery.actors.speculation import verify

    model, _ = loaded("llama")
    case = golden("llama")["serial"][0]
    batch = Batch(model, verifier=Verifier(Speculation(8)))
    job = Prefill(model, case["prompt_ids"], SamplingParams(max_tokens=40), 32, row_id=0)
    while job.remaining > 0:
        job.chunk()
    joiner = job.prime()
    joiner.read_first()
    batch.join([joiner])
    gate = batch.verifier.spec.gate
    for _ in range(3):  # measured lately: no timed step
        gate.observe(1, 1, 0.05)
    call = iter([10, 11, 12, 14, 15, 16, 17])
    monkeypatch.setattr(verify, "calls_begun", lambda: next(call))

    def plain_steps(n: int) -> int:
        before = gate.counts[(1, 1)]
        for _ in range(n):
            batch.plain()
        return gate.counts[(1, 1)] - before

    assert plain_steps(3) == 2  # calls 10, 11, 12: two periods
    assert plain_steps(1) == 0  # call 14: another call ran at 13
    assert plain_steps(1) == 1  # call 15
    batch.join([])  # no joiner: nothing changes
    assert plain_steps(1) == 1  # call 16
    other = Prefill(model, case["prompt_ids"], SamplingParams(max_tokens=40), 32, row_id=1)
    while other.remaining > 0:
        other.chunk()
    primed = other.prime()
    primed.read_first()
    batch.join([primed])  # a joiner: the next period would hold its join
    assert batch.verifier._plain_at is None


async def test_wrong_drafts_leave_a_seeded_rows_draws_as_they_were(forced_drafts, monkeypatch):
    """Every step drafts three tokens the row almost never draws, so a verify step
    keeps the first of its draws and throws the others away: the row's next draw
    is still its next token's own (``SeededSampler.keep``), and its tokens are the
    plain steps' ones."""
    case = golden("llama")["serial"][0]

    def wrong(self, k: int) -> list[int]:
        self.match = ("prompt", 3)
        return [0, 0, 0][: min(k, self.limit)]

    async def seeded(engine) -> list[list[int]]:
        return [(await engine.generate(case["prompt_ids"], max_tokens=30, temperature=0.9,
                                       seed=seed)).tokens for seed in (4, 5)]  # fmt: skip

    async with checked_engine("llama", batch=8, speculative=False) as engine:
        off = await seeded(engine)
    monkeypatch.setattr(Drafter, "propose", wrong)
    async with checked_engine("llama", batch=8) as engine:
        on = await seeded(engine)
        assert engine.stats().verify_steps >= 40
    assert on == off


async def test_seeded_rows_give_the_same_tokens_with_speculation_on_and_off(forced_drafts):
    """A seeded sampled row gives the same tokens with speculation on (every
    step that can draft does) and off: a seeded row draws its ``i``-th token with
    its own key, so a verify step's draws at each position are the plain step's
    draws there, and it keeps those its accepted drafts used."""
    case = golden("llama")["serial"][0]

    async def seeded(engine) -> list[list[int]]:
        out = []
        for seed in (1, 2, 3):
            result = await engine.generate(
                case["prompt_ids"], max_tokens=40, temperature=0.9, seed=seed
            )
            out.append(result.tokens)
        return out

    async with checked_engine("llama", batch=8) as engine:
        first = await seeded(engine)  # their texts go to the shared index
        before = engine.stats()
        on = await seeded(engine)  # each drafts from its own earlier text
        after = engine.stats()
    # the seeded rows verified drafts, and kept most of them
    assert after.verify_steps - before.verify_steps >= 3
    kept = lambda st: st.accepted_prompt + st.accepted_suffix  # noqa: E731
    assert kept(after) - kept(before) >= 60
    async with checked_engine("llama", batch=8, speculative=False) as engine:
        off = await seeded(engine)
    assert on == first == off
    assert len({tuple(t) for t in on}) > 1  # the seeds matter
