"""The prompt cache: copy-free takes, reuse that changes no token, shared system
prompts computed once."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
import trio
from conftest import FAMILIES, checked_engine, golden, loaded
from mlx_lm import stream_generate
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_nursery.actors.prompt_cache import Store, clone

FAMILY = "llama"
CASES = {c["prompt"]: c for c in golden(FAMILY)["serial"]}


def filled_kv(n: int = 8) -> KVCache:
    c = KVCache()
    c.update_and_fetch(mx.ones((1, 2, n, 4)), mx.ones((1, 2, n, 4)))
    mx.eval(c.keys, c.values)
    return c


def test_a_shared_handle_leaks_writes_and_a_view_handle_does_not():
    original = filled_kv()
    shared = copy.copy(original)  # same mx.array handles
    shared.update_and_fetch(mx.full((1, 2, 1, 4), 7.0), mx.full((1, 2, 1, 4), 7.0))
    mx.eval(shared.keys)
    assert original.keys[0, 0, 8, 0].item() == 7.0, "a shared handle leaks the write"

    original = filled_kv()
    viewed = clone(original)
    assert viewed.keys is not original.keys
    viewed.update_and_fetch(mx.full((1, 2, 1, 4), 7.0), mx.full((1, 2, 1, 4), 7.0))
    mx.eval(viewed.keys)
    assert viewed.keys[0, 0, 8, 0].item() == 7.0
    assert original.keys[0, 0, 8, 0].item() == 0.0, "a view handle keeps the original"
    assert original.offset == 8 and viewed.offset == 9


def test_a_clone_copies_no_kv():
    big = filled_kv(4096)
    mx.synchronize()
    before = mx.get_active_memory()
    clones = [clone(big) for _ in range(8)]
    mx.eval([c.keys for c in clones], [c.values for c in clones])
    grown = mx.get_active_memory() - before
    assert grown < big.nbytes // 4, f"8 clones of {big.nbytes} bytes grew memory by {grown}"


def _prefilled(model, tokens):
    caches = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=caches)
    mx.eval([c.state for c in caches])
    return caches


@pytest.mark.parametrize("family", FAMILIES)
def test_takes_trim_where_the_cache_allows_and_match_exactly_elsewhere(family):
    model, _ = loaded(family)
    prompt = golden(family)["prompts"]["long"]  # 216 tokens: past gemma's 16-token window
    store = Store(max_size=10)
    store.put(prompt[:100], _prefilled(model, prompt[:100]), "assistant", 1 << 40)
    trimmable = family in ("llama", "qwen3")

    hit = store.take([*prompt[:60], 1, 2, 3])  # shares 60 tokens with the 100-token entry
    assert hit.cached == (60 if trimmable else 0)

    hit = store.take(prompt[:150])  # the entry is a strict prefix: usable as it is
    assert hit.cached == 100
    stored = store._trie.get("model", prompt[:100]).prompt_cache
    assert [c.nbytes for c in hit.caches] == [c.nbytes for c in stored]

    hit = store.take(prompt[:100])  # equal: the last token must be forwarded again
    assert hit.cached == (99 if trimmable else 0)


@pytest.mark.parametrize("family", ["llama", "mamba2"])
def test_every_take_says_why_it_reused_what_it_did(family):
    model, _ = loaded(family)
    prompt = golden(family)["prompts"]["long"]
    store = Store(max_size=2)
    reason = lambda tokens: store.take(tokens).report  # noqa: E731

    assert reason(prompt[:50]).reason == "no_entry"
    store.put(prompt[:100], _prefilled(model, prompt[:100]), "assistant", 1 << 40)
    full = reason(prompt[:101])
    assert (full.reason, full.cached, full.diverged_at) == ("full", 100, None)

    report = reason([*prompt[:60], 7, 7])  # shares 60 tokens with the entry
    if family == "llama":
        assert (report.reason, report.cached, report.diverged_at) == ("diverged", 60, 60)
    else:  # recurrent state cannot be cut back to 60 tokens
        assert (report.reason, report.cached, report.shared) == ("not_trimmable", 0, 60)

    assert reason([9, 9, 9]).reason == "no_entry"
    for other in ([1] * 20, [2] * 20):  # two more entries evict the first (max_size=2)
        store.put(other, _prefilled(model, other), "assistant", 1 << 40)
    gone = reason(prompt[:101])
    assert (gone.reason, gone.cached, gone.shared) == ("evicted", 0, 100)


async def test_eight_agents_share_a_system_prompt_computed_once():
    model, tokenizer = loaded(FAMILY)
    system = ("You are one of eight careful sub-agents working on one codebase. " * 24)[:1500]
    asks = [f"Agent {i}: review module {i} and list its bugs." for i in range(8)]
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": a}] for a in asks]
    prompts = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True)) for c in chats]
    shared = min(
        next(i for i, (a, b) in enumerate(zip(p, prompts[0], strict=False)) if a != b)
        for p in prompts[1:]
    )
    assert shared >= 1500
    oracle = [
        [r.token for r in stream_generate(model, tokenizer, p, max_tokens=12)] for p in prompts
    ]
    results = [None] * 8

    async def agent(i):
        results[i] = await engine.generate(chats[i], max_tokens=12)

    async with checked_engine(FAMILY, batch=8, prefill_step_size=512) as engine:
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(agent, i)
        await trio.testing.wait_all_tasks_blocked()
        computed = engine.stats().prefill_tokens
    suffixes = sum(len(p) - shared for p in prompts)
    assert computed <= shared + suffixes + 8, (computed, shared, suffixes)
    for i, r in enumerate(results):
        want = oracle[i][: oracle[i].index(258)] if 258 in oracle[i] else oracle[i]
        assert r.tokens == want, i
    cached = sorted(r.usage.cached_tokens for r in results)
    assert cached[0] == 0 and all(c >= shared - 1 for c in cached[1:]), cached


@pytest.mark.parametrize("batch", [1, 8], ids=["serial", "continuous"])
async def test_turn_two_reuses_turn_one_prompt_and_answer(batch):
    first = CASES["chat"]["prompt_ids"]
    async with checked_engine(FAMILY, batch=batch) as engine:
        one = await engine.generate(first, max_tokens=20)
        follow = first + one.tokens + [258, 10] + list(b"more, please")
        two = await engine.generate(follow, max_tokens=20)
    async with checked_engine(FAMILY, batch=batch, prompt_cache_size=0) as cold_engine:
        cold = await cold_engine.generate(follow, max_tokens=20)
    assert two.usage.cached_tokens >= len(first) + len(one.tokens)
    assert cold.usage.cached_tokens == 0
    assert two.tokens == cold.tokens


@pytest.mark.parametrize("family", FAMILIES)
async def test_a_cache_hit_gives_the_same_tokens_as_a_cold_run(family):
    g = golden(family)
    base = g["prompts"]["long"]
    async with checked_engine(family, batch=8) as engine:
        first = await engine.generate(base, max_tokens=10)
        follow = base + first.tokens + list(b" and then?")
        warm = await engine.generate(follow, max_tokens=16)
        assert warm.usage.cached_tokens > len(base) // 2, warm.usage
        s = engine.stats()
        assert s.prompt_cache_hits >= 1 and s.prompt_cache_entries >= 1
    async with checked_engine(family, batch=8, prompt_cache_size=0) as cold_engine:
        cold = await cold_engine.generate(follow, max_tokens=16)
    assert warm.tokens == cold.tokens


HISTORY, TASK = (1,) * 40, (2,) * 12


@pytest.mark.parametrize(
    ("first", "classes"),
    [(HISTORY, {HISTORY: 0, TASK: 0}), (TASK, {HISTORY: 0, TASK: 1})],
    ids=["the-one-being-put-goes", "the-worst-class-goes-first"],
)
def test_when_only_pinned_entries_are_left_the_history_stays(first, classes):
    """Two pinned entries that outgrow the cap together: a main agent's long
    history and a sub-agent's task. Of one class (two sessions), the one being
    put goes (evicted, and spilled where a disk tier is on), not the history;
    when the task is a sub-agent's (class 1) of the main agent's own session,
    it goes even while the history is the one being put."""
    caches = {HISTORY: [filled_kv(40)], TASK: [filled_kv(12)]}
    both = sum(c[0].nbytes for c in caches.values())
    store = Store(max_size=10, max_bytes=both - 1)
    second = TASK if first == HISTORY else HISTORY
    store.put(list(first), caches[first], "assistant", both, {first: classes[first]})
    store.put(list(second), caches[second], "assistant", both - 1, classes)
    assert store.take([*HISTORY, 3]).cached == 40
    assert store.take([*TASK, 3]).cached == 0
    assert store.evicted and tuple(store.evicted[-1]) == TASK


def test_the_search_finds_what_mlx_lms_trie_search_finds():
    """The store's own search (linear in the entries' lengths, where mlx-lm's
    walk below the point of divergence copies the path at every node) answers as
    mlx-lm's ``PromptTrie.search`` does: exact, shorter, common prefix, and a
    shortest longer entry."""
    import random

    rng = random.Random(7)
    for _ in range(40):
        store = Store(max_size=20)
        base = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        for _ in range(rng.randrange(1, 6)):
            cut = rng.randrange(len(base) + 1)
            held = base[:cut] + [rng.randrange(4) for _ in range(rng.randrange(0, 20))]
            if held:
                store.put(held, [KVCache()], "assistant", 1 << 40)
        for _ in range(10):
            cut = rng.randrange(len(base) + 1)
            asked = base[:cut] + [rng.randrange(4) for _ in range(rng.randrange(0, 10))]
            ours, theirs = store._search(asked), store._trie.search("model", asked)
            assert (ours.exact, ours.shorter, ours.common_prefix) == (
                theirs.exact, theirs.shorter, theirs.common_prefix)  # fmt: skip
            if theirs.longer is None:
                assert ours.longer is None
            else:  # any shortest entry through the same node
                assert len(ours.longer) == len(theirs.longer)
                assert ours.longer[: theirs.common_prefix] == asked[: theirs.common_prefix]
                store._trie.get("model", ours.longer)  # an entry
