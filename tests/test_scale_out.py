"""Scale-out: the engine sharded over two ranks of ``mlx.launch`` on loopback.

The oracle is mlx-lm's own tensor-parallel generation under a launch of the same
size (``scale_out/reference.py``: ``sharded_load`` and ``stream_generate``). The
sharded server is the real thing: ``mlx-nursery serve --ranks 2`` in a process
of its own, spoken to over HTTP; its answers carry their token ids
(``return_token_ids``), compared token for token.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import httpx
import pytest
import trio
from conftest import free_port, model_path, sse_events, sse_payloads, wait_healthy
from mlx_nursery.actors.ranks import shard_error
from mlx_nursery.actors.ranks.link import RANK_TIMEOUT
from mlx_nursery.server.launch import MLX_LAUNCH

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
LAUNCH_TIMEOUT = 180  # seconds for a launch to load and answer /health
# A lost follower: every live stream gets its error event and [DONE] within this.
LOSS_SECONDS = RANK_TIMEOUT + 5.0


def held_out(n: int, seed: int) -> list[dict]:
    """Prompts no golden holds: byte-level token ids, lengths 3 to 90 (past one
    prefill chunk of 32), each with its max_tokens."""
    rng = random.Random(seed)
    return [
        {
            "ids": [rng.randrange(3, 256) for _ in range(rng.randrange(3, 90))],
            "max_tokens": rng.randrange(16, 40),
        }
        for _ in range(n)
    ]


# Ranks share the machine's cores: one BLAS thread each (where OpenBLAS is preloaded,
# the real set's), or their spinning threads oversubscribe the cores several times
# over. The engine's ranks and mlx-lm's reference ranks alike.
RANK_ENV = {"OPENBLAS_NUM_THREADS": "1"}


def reference(ranks: int, model: Path, prompts: list[dict]) -> list[list[int]]:
    """mlx-lm's tensor-parallel stream_generate on ``ranks`` ranks of a launch."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "prompts.json", Path(tmp) / "out.json"
        src.write_text(json.dumps(prompts))
        script = HERE / "scale_out" / "reference.py"
        argv = [sys.executable, "-c", MLX_LAUNCH, "--backend", "ring", "--hosts",
                "127.0.0.1", "-n", str(ranks), "--", sys.executable,
                str(script), str(model), str(src), str(out)]  # fmt: skip
        env = {**os.environ, **RANK_ENV}
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
        assert out.is_file(), done.stderr[-3000:]
        return json.loads(out.read_text())


@asynccontextmanager
async def sharded_server(ranks: int, model: Path, *args: str):
    """``mlx-nursery serve --ranks N`` (the launcher, mlx.launch, N ranks); yields
    (url, launcher). On exit every rank is stopped, by SIGTERM if still up."""
    port = free_port()
    argv = [sys.executable, "-m", "mlx_nursery.server.cli", "serve", "--model", str(model),
            "--ranks", str(ranks), "--port", str(port), "--prefill-step-size", "32",
            *args]  # fmt: skip
    env = {**os.environ, "MLX_NURSERY_OPENBLAS": "0", **RANK_ENV}
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in the finally below)
    launcher = subprocess.Popen(argv, env=env, stdout=log, stderr=log)  # noqa: ASYNC220
    url = f"http://127.0.0.1:{port}"
    pids: list[int] = []
    try:
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            with trio.move_on_after(LAUNCH_TIMEOUT) as waiting:
                await wait_healthy(client, launcher, lambda: _tail(log))
            assert not waiting.cancelled_caught, (
                f"not healthy after {LAUNCH_TIMEOUT} s; the launch's output:\n{_tail(log)}"
            )
            pids = [r["pid"] for r in (await client.get("/stats")).json()["ranks"]]
        launcher.log = log
        yield url, launcher
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
        with trio.CancelScope(shield=True):
            try:
                await trio.to_thread.run_sync(launcher.wait, 60)
            except subprocess.TimeoutExpired:
                launcher.kill()
        for pid in pids:  # a test failing midway must not leave ranks behind
            _kill(pid)
        log.close()


def _kill(pid: int) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (ended, not yet reaped by mlx.launch) counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def _tail(log) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-4000:]


async def complete(
    client: httpx.AsyncClient, prompt: dict, delay: float = 0.0, **extra: object
) -> dict:
    """One streamed completion of ``prompt``: its token ids and its usage."""
    await trio.sleep(delay)
    body = {"prompt": prompt["ids"], "max_tokens": prompt["max_tokens"], "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True},
            **extra}  # fmt: skip
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        events = await sse_events(r)
    tokens = [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids", [])]
    return {"tokens": tokens, "usage": events[-2]["usage"]}


async def test_two_ranks_equal_mlx_lm_tensor_parallel_and_stop_on_sigterm():
    model = model_path("llama")  # 4 heads / 2 KV heads: two ranks hold 2 / 1 each
    prompts = held_out(8, seed=16)
    expected = reference(2, model, prompts)
    async with sharded_server(2, model) as (url, launcher):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            solo = [await complete(client, p) for p in prompts]  # B=1
            results = [None] * len(prompts)

            async def staggered(i: int) -> None:  # B=8: each joins a running batch
                results[i] = await complete(client, prompts[i], delay=0.15 * i)

            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(staggered, i)
            hit = await complete(client, prompts[0])  # a prompt-cache hit
            serial = await complete(client, prompts[1], seed=5)  # a seed: its own draws
            with trio.fail_after(10):  # the follower's figures come with its heartbeat
                while True:
                    stats = (await client.get("/stats")).json()
                    if stats["ranks"][1]["calls"] == stats["ranks"][0]["plans"]:
                        break
                    await trio.sleep(0.1)
            metrics = (await client.get("/metrics")).text
        assert [r["tokens"] for r in solo] == expected
        assert [r["tokens"] for r in results] == expected
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert hit["tokens"] == expected[0]
        assert serial["tokens"] == expected[1]
        ranks = stats["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        assert ranks[0]["plans"] > 0
        # its shard of the prompt cache, and nothing else: what rank 0 let go of,
        # it let go of too
        assert ranks[1]["kv_bytes"] == ranks[0]["kv_bytes"] > 0
        assert 'mlx_nursery_rank_kv_bytes{rank="1"}' in metrics
        # SIGTERM to the launcher: rank 0 drains and exits, its follower with it.
        launcher.send_signal(signal.SIGTERM)
        assert await trio.to_thread.run_sync(launcher.wait, 60) == 0, _tail(launcher.log)
        for r in ranks:
            assert not _alive(r["pid"]), f"rank {r['rank']} outlived the launcher"


async def _streams_end_with_errors(url: str, lose) -> tuple[list, float, dict]:
    """Start three long streams, call ``lose()`` once all are decoding, and
    return each stream's events, the seconds from the loss to the last [DONE],
    and /health as it answered after."""
    prompts = held_out(3, seed=7)
    events: list = [None] * 3
    ended = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        started = trio.Event()
        firsts = []

        async def stream(i: int) -> None:
            body = {"prompt": prompts[i]["ids"], "max_tokens": 3000, "stream": True,
                    "logit_bias": {"258": -100}}  # fmt: skip
            async with client.stream("POST", "/v1/completions", json=body) as r:
                chunks = []
                async for payload in sse_payloads(r):
                    chunks.append(payload)
                    if len(chunks) == 2:
                        firsts.append(i)
                        if len(firsts) == 3:
                            started.set()
                events[i] = chunks
                ended.append(time.monotonic())

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(stream, i)
            await started.wait()
            lost_at = time.monotonic()
            lose()
        health = await client.get("/health")
    return events, max(ended) - lost_at, {"code": health.status_code, **health.json()}


def _assert_error_then_done(events: list) -> None:
    for chunks in events:
        assert chunks[-1] == "[DONE]", chunks[-3:]
        last = json.loads(chunks[-2])
        assert "error" in last, last
        assert "rank 1" in last["error"]["message"] or "shutting down" in last["error"][
            "message"
        ], last


async def test_a_killed_follower_ends_every_stream_with_an_error():
    async with sharded_server(2, model_path("llama")) as (url, launcher):
        async with httpx.AsyncClient(base_url=url) as client:
            follower = (await client.get("/stats")).json()["ranks"][1]["pid"]
        events, seconds, _ = await _streams_end_with_errors(
            url, lambda: os.kill(follower, signal.SIGKILL)
        )
        assert seconds < LOSS_SECONDS, seconds
        _assert_error_then_done(events)
        # mlx.launch stops the other ranks when one dies: rank 0 drains and exits,
        # and the launcher says a rank failed
        assert await trio.to_thread.run_sync(launcher.wait, 60) == 1, _tail(launcher.log)
        assert "Node with rank 1 exited with code -9" in _tail(launcher.log)


async def test_a_stalled_follower_turns_health_503_and_ends_every_stream():
    async with sharded_server(2, model_path("llama")) as (url, _):
        async with httpx.AsyncClient(base_url=url) as client:
            follower = (await client.get("/stats")).json()["ranks"][1]["pid"]
        try:
            events, seconds, health = await _streams_end_with_errors(
                url, lambda: os.kill(follower, signal.SIGSTOP)
            )
            assert seconds < LOSS_SECONDS, seconds
            _assert_error_then_done(events)
            assert health["code"] == 503
            assert "rank 1" in health["error"] and "stalled" in health["error"], health
            async with httpx.AsyncClient(base_url=url) as client:
                r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            assert r.status_code == 503 and "rank 1" in r.json()["error"]["message"]
        finally:
            os.kill(follower, signal.SIGCONT)
            _kill(follower)


async def test_the_watch_counts_heartbeats_that_arrived_while_its_own_loop_was_held_up():
    """Rank 0's watch loses the ranks after ``timeout`` seconds with nothing from
    a follower, and a follower is heard when its listener reads. When rank 0's
    event loop is held up past the timeout (a call holding the GIL, a starved
    core), the watch and the listener wake together, in either order: heartbeats
    that arrived meanwhile must count, or a live follower reads as stalled and
    /health stays 503. A follower that really sends nothing is still lost."""
    from mlx_nursery.actors.gpu import Gpu
    from mlx_nursery.actors.ranks import Leader, RankWatch
    from mlx_nursery.actors.ranks.leader import Follower
    from mlx_nursery.actors.ranks.plans import Plans

    ours, theirs = socket.socketpair()
    beating = threading.Event()
    beating.set()
    done = threading.Event()

    def heartbeat() -> None:  # a follower's: a line of figures every 0.1 s
        while not done.wait(0.1):
            if beating.is_set():
                theirs.sendall(b'{"calls": 0}\n')

    gpu = Gpu()
    watch = RankWatch(Leader(Plans(None), [Follower(1, "here", os.getpid(), ours)]), gpu,
                      timeout=0.6)  # fmt: skip
    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(watch.run)
            for _ in range(6):  # each wake-up is a coin toss between the two tasks
                time.sleep(0.9)  # noqa: ASYNC251 (the event loop held up, on purpose)
                await trio.sleep(0.6)
                assert gpu.lost is None, gpu.lost
            beating.clear()  # alive, connected, silent: stalled
            await trio.sleep(2.5)  # past the timeout and the watch's next look
            assert gpu.lost is not None and "rank 1" in gpu.lost and "stalled" in gpu.lost
            nursery.cancel_scope.cancel()
    finally:
        done.set()
        beat.join()
        ours.close()
        theirs.close()


def test_a_model_that_cannot_be_split_is_refused_before_launch():
    llama = json.loads((model_path("llama") / "config.json").read_text())
    assert shard_error(llama, 2) is None
    smollm2 = {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}
    assert shard_error(smollm2, 3) is None
    assert shard_error(smollm2, 2) == (
        "the model cannot be split 2 ways: its 9 attention heads and 3 KV heads do not "
        "divide by 2; it splits 3 ways"
    )
    argv = [sys.executable, "-m", "mlx_nursery.server.cli", "serve", "--model",
            str(model_path("llama")), "--ranks", "3", "--port", "0"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--ranks: llama cannot be split 3 ways: its 4 attention heads and 2 KV heads" in (
        done.stderr
    ), done.stderr


@pytest.mark.real
async def test_three_ranks_of_smollm2_equal_mlx_lm_tensor_parallel():
    """The real SmolLM2-135M (9 heads / 3 KV heads: three ranks of 3 / 1), chat
    prompts one at a time and staggered, against mlx-lm's three-rank TP."""
    from mlx_lm.utils import load_tokenizer
    from mlx_nursery.actors.models import registry

    if not registry.DEFAULT.file.is_file():
        pytest.skip(f"{registry.DEFAULT.id} is not in the cache (`mlx-nursery models --fetch`)")
    model = registry.resolve(registry.DEFAULT.file)
    tokenizer = load_tokenizer(model)
    questions = [  # four: each staggered arrival joins a running batch
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers.",
        "What is 12 times 12?",
    ]
    prompts = [
        {"ids": list(tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True)),
         "max_tokens": 10}
        for q in questions
    ]  # fmt: skip
    expected = reference(3, model, prompts)
    async with sharded_server(3, model) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            solo = [await complete(client, p) for p in prompts]
            results = [None] * len(prompts)

            async def staggered(i: int) -> None:
                results[i] = await complete(client, prompts[i], delay=0.3 * i)

            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(staggered, i)
            ranks = (await client.get("/stats")).json()["ranks"]
    assert [r["tokens"] for r in solo] == expected
    assert [r["tokens"] for r in results] == expected
    assert [r["rank"] for r in ranks] == [0, 1, 2]
