"""The prompt cache's disk tier: entries survive a restart, bad files are skipped
and removed, and both tiers stay inside their bounds (``docs/prompt-cache.md``)."""

from __future__ import annotations

import logging
import random
import threading
from pathlib import Path

import httpx
import pytest
import trio
from conftest import ROOT, checked_engine, loaded, model_path, server_process, sse_chunks
from mlx_nursery.actors import CacheTier
from mlx_nursery.actors.disk_cache import LONG_PREFIX, SUFFIX, read_header

LONG = LONG_PREFIX + 200  # written to disk as soon as it is put


def prompt_of(seed: int, n: int = LONG) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def files(folder: Path) -> list[Path]:
    return sorted(folder.rglob(f"*{SUFFIX}"))


async def answer(prompt: list[int], **settings):
    async with checked_engine("llama", **settings) as engine:
        result = await engine.generate(prompt, max_tokens=12)
        assert await engine.flush_prompt_cache()
        return result, engine.stats()


async def test_a_restart_serves_the_same_prompt_from_disk(tmp_path):
    folder = tmp_path / "tier"
    prompt = prompt_of(1)
    cold, stats = await answer(prompt, prompt_cache_dir=str(folder))
    assert cold.usage.cached_tokens == 0
    assert stats.prompt_cache_disk_writes == 1 and stats.prompt_cache_disk_entries == 1
    (written,) = files(folder)
    meta, size = read_header(written)
    assert meta["format"] == "mlx-nursery-kv/1" and size == written.stat().st_size

    warm, stats = await answer(prompt, prompt_cache_dir=str(folder))  # a new engine
    assert warm.text == cold.text and warm.tokens == cold.tokens
    assert warm.usage.cached_tokens == len(prompt) - 1
    assert warm.usage.cache.tier is CacheTier.DISK
    assert stats.prompt_cache_disk_hits == 1
    assert stats.prompt_cache_disk_read_bytes == written.stat().st_size
    assert stats.prompt_cache_disk_load_time.count == 1

    # A prompt that shares only a prefix reuses it (the entry is cut back).
    longer = prompt[:900] + prompt_of(2, 300)
    fresh, _ = await answer(longer, prompt_cache_disk=0)
    reused, _ = await answer(longer, prompt_cache_dir=str(folder))
    assert reused.usage.cached_tokens == 900 and reused.usage.cache.tier is CacheTier.DISK
    assert reused.tokens == fresh.tokens


async def test_truncated_corrupt_and_other_models_files_are_skipped_and_removed(tmp_path, caplog):
    folder = tmp_path / "tier"
    prompt = prompt_of(1)
    cold, _ = await answer(prompt, prompt_cache_dir=str(folder))
    assert cold.tokens  # (a row that ends at its first token leaves no entry)
    (good,) = files(folder)
    data = good.read_bytes()
    truncated = folder / f"0000000000000000-{'a' * 32}{SUFFIX}"
    truncated.write_bytes(data[: len(data) // 2])
    flipped = bytearray(data)
    for i in range(len(data) - 4000, len(data), 97):  # in the KV, past the header
        flipped[i] ^= 0xFF
    good.write_bytes(bytes(flipped))  # same name: its checksum no longer matches
    garbage = folder / f"1111111111111111-{'b' * 32}{SUFFIX}"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")

    # Another model's entry, copied into this model's folder.
    async with checked_engine("qwen3", prompt_cache_dir=str(tmp_path / "other")) as other:
        await other.generate(prompt_of(4), max_tokens=2)
        assert await other.flush_prompt_cache()
    (theirs,) = files(tmp_path / "other")
    foreign = folder / theirs.name
    foreign.write_bytes(theirs.read_bytes())

    caplog.set_level(logging.WARNING, logger="mlx_nursery.engine")
    again, stats = await answer(prompt, prompt_cache_dir=str(folder))
    assert again.tokens == cold.tokens  # computed afresh, the same answer
    assert again.usage.cache.tier is None
    assert stats.prompt_cache_disk_bad == 1  # the corrupt one, found at load
    removed = [r.getMessage() for r in caplog.records if "prompt cache: removed" in r.getMessage()]
    assert len(removed) == 4, removed  # one line per file
    assert any("another model" in m for m in removed)
    assert any("truncated" in m for m in removed)
    assert any("checksum" in m for m in removed)
    assert any("does not parse" in m for m in removed)
    for path in (truncated, garbage, foreign):
        assert not path.exists()
    # The answer's own entry, written afresh: the same bytes as the first time.
    assert files(folder) == [good] and good.read_bytes() == data


@pytest.mark.slow
async def test_thirty_distinct_long_prompts_stay_inside_both_bounds(tmp_path):
    folder = tmp_path / "tier"
    entry = 2_000_000  # bytes: about one entry of this model at LONG tokens, rounded up
    memory, disk = 3 * entry, 5 * entry
    async with checked_engine(
        "llama", prompt_cache_dir=str(folder), prompt_cache_bytes=memory,
        prompt_cache_disk=disk,
    ) as engine:  # fmt: skip
        for i in range(30):
            await engine.generate(prompt_of(100 + i), max_tokens=4)
            assert await engine.flush_prompt_cache()
            stats = engine.stats()
            on_disk = sum(p.stat().st_size for p in files(folder))
            assert stats.prompt_cache_bytes <= memory
            assert stats.prompt_cache_disk_bytes == on_disk <= disk
        assert stats.prompt_cache_evictions > 0 and stats.prompt_cache_disk_evictions > 0
        assert stats.prompt_cache_disk_writes == 30
        # The newest entries are the ones kept, and the tier still serves them.
        last = await engine.generate(prompt_of(129), max_tokens=4)
        assert last.usage.cached_tokens == LONG - 1


async def test_evicted_entries_are_written_and_memory_misses_load_them(tmp_path):
    """An entry shorter than a long prefix reaches the disk when memory lets it go."""
    folder = tmp_path / "tier"
    short = [prompt_of(200 + i, 300) for i in range(3)]
    async with checked_engine(
        "llama", prompt_cache_dir=str(folder), prompt_cache_size=1
    ) as engine:  # fmt: skip
        first = await engine.generate(short[0], max_tokens=4)
        for prompt in short[1:]:
            await engine.generate(prompt, max_tokens=4)
        assert await engine.flush_prompt_cache()
        stats = engine.stats()
        assert stats.prompt_cache_evictions == 2 and stats.prompt_cache_disk_writes == 2
        again = await engine.generate(short[0], max_tokens=4)
        assert again.usage.cache.tier is CacheTier.DISK
        assert again.usage.cached_tokens == len(short[0]) - 1
        assert again.tokens == first.tokens


async def test_the_disk_tier_is_off_at_zero_and_the_budget_is_auto_by_default(tmp_path):
    async with checked_engine("llama", prompt_cache_disk=0) as engine:
        await engine.generate(prompt_of(5), max_tokens=2)
        assert await engine.flush_prompt_cache()
        stats = engine.stats()
    assert stats.prompt_cache_disk_cap == 0 and stats.prompt_cache_disk_writes == 0
    assert not files(tmp_path)
    assert stats.kv_budget_bytes and stats.kv_budget_bytes > 0  # auto
    assert 0 < stats.prompt_cache_ceiling <= stats.kv_budget_bytes
    model, _ = loaded("llama")
    async with checked_engine((model, loaded("llama")[1]), kv_budget="none") as engine:
        assert engine.stats().kv_budget_bytes is None


async def ask_streaming(url: str, body: dict) -> tuple[float, str, dict]:
    """Time to the first content chunk, the text, and the usage."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    text, usage, first = "", None, None
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = trio.current_time()
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for chunk in sse_chunks(response):
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk["choices"]:
                    if choice["delta"].get("content"):
                        first = first or trio.current_time() - start
                        text += choice["delta"]["content"]
    return first, text, usage


async def test_a_restarted_server_answers_from_the_disk_tier(tmp_path):
    """`serve` as users start it, twice: /stats shows the budget and both tiers,
    and the second process serves the first one's prompt from disk."""
    body = {"model": "llama", "max_tokens": 16,
            "messages": [{"role": "user", "content": "lanterns by the harbour " * 60}]}  # fmt: skip
    answers = []
    for _ in range(2):
        async with server_process("--model", str(model_path("llama"))) as (url, _):
            answers.append(await ask_streaming(url, body))
            async with httpx.AsyncClient(base_url=url) as client:
                stats = (await client.get("/stats")).json()
                metrics = (await client.get("/metrics")).text
    (_, cold, _), (_, warm, usage) = answers
    assert warm == cold
    assert usage["prompt_cache"]["tier"] == "disk"
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert stats["kv_budget_bytes"] > 0 and stats["prompt_cache_disk_cap"] > 0
    assert stats["prompt_cache_disk_hits"] == 1
    assert "mlx_nursery_prompt_cache_disk_hits_total 1.0" in metrics
    assert "mlx_nursery_prompt_cache_disk_load_seconds_count 1.0" in metrics


def agent_messages(tokens: int, tokenizer) -> list[dict]:
    """An agent-like request of about ``tokens`` tokens: a system prompt made of
    this repository's own docs (prose, tables, code), then one user turn."""
    text = ""
    for doc in sorted((ROOT / "docs").glob("*.md")):
        text += doc.read_text() + "\n"
        if len(tokenizer.encode(text)) > tokens:
            break
    ids = tokenizer.encode(text)[:tokens]
    system = tokenizer.decode(ids)
    question = "Which command starts the server? Answer in one sentence."
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


@pytest.mark.real
@pytest.mark.own_blas
@pytest.mark.slow
async def test_smollm2_serves_a_6k_agent_prompt_from_disk_after_a_restart():
    """The issue's check: default `serve` (SmolLM2, float32 on CPU), a ~6k-token
    agent prompt, a restart, the same prompt at a tenth of the cold TTFT or less."""
    from test_real_models import smollm2

    _, tokenizer = smollm2()
    body = {"model": "default", "max_tokens": 24, "messages": agent_messages(6000, tokenizer)}
    runs = []
    for _ in range(2):
        async with server_process(openblas=True) as (url, _):
            async with httpx.AsyncClient(base_url=url) as client:
                stats = (await client.get("/stats")).json()
            assert stats["kv_budget_bytes"] > 0
            runs.append(await ask_streaming(url, body))
    (cold_ttft, cold, cold_usage), (warm_ttft, warm, usage) = runs
    print(f"\n6k agent prompt ({usage['prompt_tokens']} tokens): cold TTFT {cold_ttft:.2f} s, "
          f"after a restart {warm_ttft:.2f} s ({warm_ttft / cold_ttft:.3f}x)")  # fmt: skip
    assert cold_usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage["prompt_tokens"] >= 5500
    assert usage["prompt_cache"]["tier"] == "disk"
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.9 * usage["prompt_tokens"]
    assert warm == cold
    assert warm_ttft <= 0.1 * cold_ttft


def test_an_entry_superseded_while_it_loads_keeps_its_file_until_the_load_ends(tmp_path):
    """The flood found it: a turn's take picked the main agent's history on disk,
    and while it waited to load, the writer indexed the longer next entry, which
    supersedes it, and removed its file: the load failed ("does not load") and the
    turn lost its history. The file now goes when the last load of it ends."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache
    from mlx_nursery.actors import disk_cache

    def frozen(tokens: int) -> disk_cache.Frozen:
        caches = [KVCache() for _ in range(2)]
        for c in caches:
            c.update_and_fetch(mx.ones((1, 2, tokens, 8)), mx.ones((1, 2, tokens, 8)))
        return disk_cache.freeze(caches)

    tier = disk_cache.DiskTier(tmp_path, "identity", cap=1 << 30)
    prompt = prompt_of(7, 40)
    short = tier.write(disk_cache.as_tokens(prompt[:30]), frozen(30), "assistant")
    assert tier.add(short) == []
    entry, usable = tier.nearest(prompt)
    assert entry is short and usable == 30

    tier.reading(entry)
    tier.reading(entry)  # two turns load it at once
    longer = tier.write(disk_cache.as_tokens(prompt), frozen(40), "assistant")
    assert tier.add(longer) == []  # it supersedes the short one: nothing to remove yet
    assert list(tier.entries) == [longer.path.name] and short.path.exists()
    assert [c.offset for c in disk_cache.load(short.path)] == [30, 30]  # still loads
    assert tier.read(entry) == []  # the other load still holds it
    assert tier.read(entry) == [short]  # the last one done: now it goes
    disk_cache.remove([short])
    assert files(tmp_path) == [longer.path]
    # an entry nobody reads goes at once, as before
    tier.reading(longer)
    assert tier.read(longer) == []
    again = tier.write(disk_cache.as_tokens([*prompt, 9]), frozen(41), "assistant")
    assert tier.add(again) == [longer]


async def test_an_evicted_entry_serves_from_memory_until_its_write_lands(tmp_path, monkeypatch):
    """The flood found it: when the pins outgrew the cap, memory let go of the main
    agent's newest history at its put, and the disk write its put had queued was
    not due for ten seconds, so its next turn a second later found an older
    entry (86-88% of its history). Memory letting an entry go now makes its
    queued write due at once, and until the write lands the entry's KV (held
    for it) serves takes from memory."""
    from mlx_nursery.actors import disk_cache

    monkeypatch.setattr(disk_cache, "WRITE_DELAY", 600.0)  # a put's own write: not due here
    writing, release = threading.Event(), threading.Event()
    write = disk_cache.DiskTier.write

    def held(self, *args):
        writing.set()
        release.wait(60)
        return write(self, *args)

    monkeypatch.setattr(disk_cache.DiskTier, "write", held)
    first_prompt = prompt_of(300)
    try:
        async with checked_engine(
            "llama", prompt_cache_dir=str(tmp_path / "tier"), prompt_cache_size=1
        ) as engine:  # fmt: skip
            first = await engine.generate(first_prompt, max_tokens=4)  # its write: in 600 s
            await engine.generate(prompt_of(301), max_tokens=4)  # memory lets first's go
            with trio.fail_after(30):  # first's write falls due now, not in 600 s
                while not writing.is_set():  # noqa: ASYNC110
                    await trio.sleep(0.01)
            follow_up = [*first_prompt, *first.tokens, 7, 8, 9]
            again = await engine.generate(follow_up, max_tokens=6)
            assert again.usage.cache.tier is CacheTier.MEMORY
            assert again.usage.cached_tokens >= len(first_prompt)
            assert engine.stats().prompt_cache_disk_hits == 0
            release.set()
            assert await engine.flush_prompt_cache()
            # first's, the second's (the follow-up's put let it go) and the follow-up's
            assert engine.stats().prompt_cache_disk_writes == 3
    finally:
        release.set()
    async with checked_engine("llama", prompt_cache_size=0) as engine:
        fresh = await engine.generate(follow_up, max_tokens=6)
    assert again.tokens == fresh.tokens
