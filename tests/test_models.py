"""Several models in one server (server/pool.py, docs/models.md), on the golden
models: names and aliases, load on first request, keep-alive, eviction under a
memory budget, the 429 while a model waits, and a swap storm whose answers
equal single-model servers' while the memory stays within the budget."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import threading

import httpx
import pytest
import trio
from conftest import model_path, running_server, server_process
from mlx_nursery.actors import EngineSettings
from mlx_nursery.actors.gpu import DeviceLock
from mlx_nursery.server.sizing import SHARE_OF_BUDGET, auto_memory_budget, estimate
from mlx_nursery.server.specs import ModelState
from mlx_nursery.server.top import render
from rich.console import Console

KV = 8 << 20  # each model's KV budget in these tests


def models(*names: str) -> tuple[tuple[str, str], ...]:
    return tuple((n, str(model_path(n))) for n in names)


async def chat(http: httpx.AsyncClient, model: str, text: str, **extra) -> httpx.Response:
    return await http.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": text}],
        "max_tokens": 8, "temperature": 0, **extra,
    })  # fmt: skip


async def complete(http: httpx.AsyncClient, model: str, text: str) -> httpx.Response:
    """A base model (no chat template): a plain completion."""
    return await http.post("/v1/completions", json={
        "model": model, "prompt": text, "max_tokens": 8, "temperature": 0})  # fmt: skip


def states(body: dict) -> dict[str, str]:
    return {card["id"]: card["state"] for card in body["data"]}


@pytest.mark.parametrize("processes", [False, True], ids=["one-process", "model-processes"])
async def test_models_by_name_alias_and_a_404_naming_what_is_served(processes):
    async with running_server(
        model_name="main", models=models("qwen3"),
        aliases={"claude-haiku-*": "qwen3", "gpt-small": "qwen3"}, model_processes=processes,
    ) as (url, state):  # fmt: skip
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            listed = (await http.get("/v1/models")).json()
            assert states(listed) == {"main": "loaded", "qwen3": "unloaded"}
            card = next(c for c in listed["data"] if c["id"] == "qwen3")
            assert sorted(card["aliases"]) == ["claude-haiku-*", "gpt-small"]
            assert next(c for c in listed["data"] if c["id"] == "main")["context_length"]

            r = await chat(http, "nope", "hi")
            assert r.status_code == 404, r.text
            error = r.json()["error"]
            assert error["code"] == "model_not_found" and error["param"] == "model"
            assert "'main'" in error["message"] and "'qwen3'" in error["message"]
            # several models: a Claude name is a model only through an alias
            r = await http.post("/v1/messages", json={
                "model": "claude-sonnet-4-5", "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
            assert r.status_code == 404 and r.json()["type"] == "error", r.text

            r = await http.post("/v1/messages", json={
                "model": "claude-haiku-4-5", "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "qwen3"
            assert states((await http.get("/v1/models")).json())["qwen3"] == "loaded"
            r = await chat(http, "gpt-small", "hi")
            assert r.status_code == 200 and r.json()["model"] == "qwen3"
            r = await chat(http, str(model_path("qwen3")), "hi")  # the reference it was given as
            assert r.status_code == 200 and r.json()["model"] == "qwen3"
            r = await chat(http, "default", "hi")
            assert r.json()["model"] == "main"

            stats = (await http.get("/stats")).json()
            figures = {m["name"]: m for m in stats["models"]}
            assert figures["qwen3"]["requests"] == 3 and figures["qwen3"]["loads"] == 1
            assert figures["qwen3"]["tokens"] > 0 and figures["qwen3"]["load_seconds"] > 0
            assert figures["main"]["pinned"] and not figures["qwen3"]["pinned"]
            assert figures["qwen3"]["resident_bytes"] > 0
            assert (await http.get("/stats", params={"model": "qwen3"})).json()["model"] == "qwen3"
            snap = (await http.get("/dashboard/snapshot")).json()
            assert [m["name"] for m in snap["models"]] == ["main", "qwen3"]
            console = Console(record=True, width=200)
            console.print(render(snap, None))
            shown = console.export_text()
            assert "qwen3" in shown and "main (default)" in shown and "pinned" in shown
            metrics = (await http.get("/metrics")).text
            assert 'mlx_nursery_model_state{model="qwen3",state="loaded"} 1.0' in metrics
            assert 'mlx_nursery_model_requests_total{model="qwen3"} 3.0' in metrics
            assert 'mlx_nursery_model_resident_bytes{model="main"}' in metrics
            child = state.pool.slots["qwen3"].process
            assert (child is not None) == processes and figures["qwen3"]["process"] == (
                child and child.pid
            )
            if processes:  # its engine's figures are its process's
                engine = (await http.get("/stats", params={"model": "qwen3"})).json()
                assert engine["batch"]["configured"] and engine["models"][1]["name"] == "qwen3"
                streamed = await http.post("/v1/chat/completions", json={
                    "model": "gpt-small", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 8, "temperature": 0, "stream": True,
                })  # fmt: skip
                assert streamed.headers["content-type"].startswith("text/event-stream")
                assert streamed.text.rstrip().endswith("data: [DONE]")
                counted = await http.post("/v1/messages/count_tokens", json={
                    "model": "claude-haiku-4-5", "messages": [{"role": "user", "content": "hi"}]
                })  # fmt: skip
                assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
                sessions = await http.get("/v1/sessions")  # every process's, none live
                assert sessions.status_code == 200 and sessions.json()["data"] == []
                assert (await http.delete("/v1/sessions/none")).status_code == 404
    assert state.pool.slots["qwen3"].state is ModelState.UNLOADED  # closed with the server
    if processes:
        assert child.process.returncode == 0  # told to stop, it drained and exited


@pytest.mark.parametrize("processes", [False, True], ids=["one-process", "model-processes"])
async def test_an_idle_model_unloads_after_its_keep_alive_and_loads_again(processes):
    async with running_server(
        models=models("qwen3"), keep_alive={"": 0.5}, model_processes=processes
    ) as (url, state):
        slot = state.pool.slots["qwen3"]
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            first = (await chat(http, "qwen3", "hello there")).json()
            assert slot.state is ModelState.LOADED
            with trio.fail_after(0.5 + 5):
                while slot.state is not ModelState.UNLOADED:  # noqa: ASYNC110 (polled)
                    await trio.sleep(0.05)
            assert slot.unloads == 1 and slot.engine is None and slot.process is None
            assert state.pool.default.state is ModelState.LOADED  # pinned
            again = (await chat(http, "qwen3", "hello there")).json()
            assert again["choices"] == first["choices"] and slot.loads == 2
            if processes:  # the answer is the one-process server's
                async with running_server(models=models("qwen3")) as (alone_url, _):
                    async with httpx.AsyncClient(base_url=alone_url, timeout=60) as alone:
                        alone_answer = (await chat(alone, "qwen3", "hello there")).json()
                assert alone_answer["choices"] == first["choices"]


async def test_a_model_waiting_for_a_busy_one_is_a_429_with_retry_after_then_loads():
    """Room for one model: while the default streams a long answer, a request for
    the other waits its bound and gets a 429 (the busy rows are never failed);
    once the stream ends, the other loads."""
    charge = max(estimate(str(model_path(n)), _settings()) for n in ("llama", "qwen3"))
    async with running_server(
        model_name="llama", models=models("qwen3"), keep_alive={"llama": 60, "": 60},
        memory_budget=charge + charge // 2, model_wait=0.3, kv_budget=KV,
    ) as (url, state):  # fmt: skip
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async with http.stream("POST", "/v1/chat/completions", json={
                "model": "llama", "messages": [{"role": "user", "content": "go"}],
                "max_tokens": 3000, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "logit_bias": {"258": -100},
            }) as stream:  # fmt: skip
                lines = stream.aiter_lines()
                await anext(lines)  # the stream runs
                r = await chat(http, "qwen3", "hi")
                assert r.status_code == 429, r.text
                assert r.json()["error"]["code"] == "model_loading"
                assert int(r.headers["Retry-After"]) >= 1
                assert state.pool.slots["llama"].evicting  # takes no new request meanwhile
                body = [line async for line in lines]
            body = [line for line in body if line]
            assert body[-1] == "data: [DONE]" and not any('"error"' in b for b in body)
            for _ in range(50):  # its load began with the first request, and may not be done
                r = await chat(http, "qwen3", "hi")
                if r.status_code != 429:
                    break
                await trio.sleep(0.1)
            assert r.status_code == 200, r.text
            assert states((await http.get("/v1/models")).json()) == {
                "llama": "unloaded", "qwen3": "loaded"}  # fmt: skip


def _settings():
    return EngineSettings(dtype="auto", prefill_step_size=32, kv_budget=KV)


async def test_a_swap_storm_stays_in_budget_and_answers_as_single_model_servers():
    """Three models whose charges fit two at a time; 100 random requests across
    them from 8 clients: each is a 200 (or a 429 with Retry-After), mlx's active
    memory sampled every 100 ms never passes the budget, and every answer equals
    the one a single-model server gives."""
    import mlx.core as mx

    names = ("llama", "qwen3", "gemma3_text")
    prompts = ["the tide", "a lamp in the window", "seven geese", "under the bridge"]
    reference: dict[tuple[str, str], str] = {}
    for name in names:
        async with running_server(model_path(name), kv_budget=KV) as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                for p in prompts:
                    body = (await chat(http, "default", p)).json()
                    reference[name, p] = body["choices"][0]["message"]["content"]
    charges = sorted(estimate(str(model_path(n)), _settings()) for n in names)
    budget = charges[1] + charges[2] + charges[0] // 2  # any two fit, never three
    rng = random.Random(46)
    work = [(rng.choice(names), rng.choice(prompts)) for _ in range(100)]
    peak, sampling = [0], threading.Event()
    base = mx.get_active_memory()

    def sample() -> None:
        while not sampling.wait(0.1):
            peak[0] = max(peak[0], mx.get_active_memory() - base)

    codes: list[int] = []
    async with running_server(
        model_name="llama", models=models("qwen3", "gemma3_text"), kv_budget=KV,
        keep_alive={"llama": 30, "": 30}, memory_budget=budget,
    ) as (url, state):  # fmt: skip
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:

            async def client() -> None:
                while work:
                    name, p = work.pop()
                    r = await chat(http, name, p)
                    codes.append(r.status_code)
                    if r.status_code == 429:
                        assert int(r.headers["Retry-After"]) >= 1
                        continue
                    assert r.status_code == 200, r.text
                    assert r.json()["choices"][0]["message"]["content"] == reference[name, p]

            with trio.fail_after(240):
                async with trio.open_nursery() as nursery:
                    for _ in range(8):
                        nursery.start_soon(client)
        sampling.set()
        sampler.join()
        slots = state.pool.slots.values()
        assert all(s.charge == estimate(str(model_path(s.name)), _settings()) for s in slots)
        assert sum(s.loads for s in slots) > 3  # it swapped
    print(
        "storm:",
        {s: codes.count(s) for s in set(codes)},
        "peak",
        peak[0],
        "budget",
        budget,
        "loads",
        [s.loads for s in slots],
    )
    assert len(codes) == 100 and set(codes) <= {200, 429}, codes
    assert codes.count(200) >= 90, codes
    assert 0 < peak[0] <= budget, (peak[0], budget)


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--model", "a=x", "--model", "a=y"], "two models are named 'a'"),
        (["--model", "x", "--alias", "gpt=nope"], "no model is named 'nope'"),
        (["--keep-alive", "soon"], "not a duration"),
        (["--alias", "gpt"], "is not NAME=MODEL"),
    ],
)
def test_bad_model_flags_are_refused_with_what_to_change(argv, error, capsys):
    from mlx_nursery.server.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["serve", *argv])
    assert exited.value.code == 2
    assert error in capsys.readouterr().err


def test_model_flags_make_the_settings():
    from mlx_nursery.server.cli import build_parser, settings_from
    from mlx_nursery.server.state import pool_of

    args = build_parser().parse_args([
        "serve", "--model", "main=/m/a", "--model", "/m/b", "--model", "coder=ollama:qwen3:8b",
        "--alias", "claude-haiku-*=b", "--keep-alive", "2m", "--keep-alive", "coder=forever",
        "--memory-budget", "8G",
    ])  # fmt: skip
    pool = pool_of(settings_from(args))
    assert list(pool.slots) == ["main", "b", "coder"]
    assert [s.spec.keep_alive for s in pool.slots.values()] == [None, 120.0, None]
    assert pool.budget == 8 << 30 and pool.resolve("claude-haiku-4-5").name == "b"
    assert all(s.settings.kv_budget == 2 << 30 for s in pool.slots.values())  # a quarter


def rss(pid: int) -> int:
    """A process's resident set and its children's (a model's own process), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    return int(line.split()[1]) * 1024 + sum(rss(c) for c in children)


@pytest.mark.real
@pytest.mark.own_blas
@pytest.mark.slow
@pytest.mark.parametrize("processes", ["on", "off"])
async def test_real_models_share_a_server_and_an_idle_one_gives_its_memory_back(processes):
    """SmolLM2 (the default, pinned) and Gemma 3 270M (keep-alive 2 s) in one
    server, run as users run it, Gemma in a process of its own or not: Gemma
    loads on its first request, and within keep-alive + 5 s of its last one the
    server's RSS (its children's included) is back within 10% of what it was
    before Gemma loaded; loaded again, it answers the same."""
    from mlx_nursery.actors.models import registry

    for model in (registry.DEFAULT, registry.GEMMA3_270M):
        if not model.file.is_file():
            pytest.skip(f"{model.id} is not in the cache (`mlx-nursery models --fetch {model.id}`)")
    keep = 2.0
    async with server_process(
        "--model", str(registry.DEFAULT.file), "--model", f"gemma={registry.GEMMA3_270M.file}",
        "--keep-alive", f"gemma={keep:g}", "--model-processes", processes,
        "--model-wait", "240",  # Gemma's load on a machine the suite's other lane keeps busy
        # Memory given back is under test, not the packed copies: on an AVX-512 CPU
        # they add 1.6 GB of charges, and Gemma then waited for memory the suite's
        # other lane held (a 300 s read timeout once)
        "--packed-weights", "off",
        openblas=True,
    ) as (url, pid):  # fmt: skip
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            main = (await http.get("/v1/models")).json()["data"][0]["id"]
            assert (await chat(http, main, "Name a colour.")).status_code == 200
            before = rss(pid)
            first = await complete(http, "gemma", "The opposite of hot is")
            assert first.status_code == 200, first.text
            done = trio.current_time()
            loaded = rss(pid)
            assert loaded > before + (100 << 20), (before, loaded)  # its weights, in float32
            with trio.fail_after(keep + 5 + 5):
                while states((await http.get("/v1/models")).json())["gemma"] != "unloaded":  # noqa: ASYNC110 (another process)
                    await trio.sleep(0.1)
            unloaded_after = trio.current_time() - done
            after = rss(pid)
            print(
                f"RSS before {before >> 20} MiB, loaded {loaded >> 20} MiB, after "
                f"{after >> 20} MiB; unloaded {unloaded_after:.1f} s after its request"
            )
            assert unloaded_after <= keep + 5
            assert after <= before * 1.10, (before, loaded, after)
            again = await complete(http, "gemma", "The opposite of hot is")
            assert again.json()["choices"] == first.json()["choices"]
            gemma = next(m for m in (await http.get("/stats")).json()["models"]
                         if m["name"] == "gemma")  # fmt: skip
            assert gemma["loads"] == 2 and gemma["unloads"] == 1 and gemma["load_seconds"] > 0
    # its charge, estimated from the files before a load, is what the load measured
    # (its K-quants dequantized to float32; a quarter of the auto budget for KV)
    kv = auto_memory_budget() // SHARE_OF_BUDGET
    settings = EngineSettings(dtype="auto", kv_budget=kv, packed_weights=False)
    assert gemma["charge_bytes"] == estimate(str(registry.GEMMA3_270M.file), settings)


async def test_two_engines_in_one_process_share_the_device_lock_and_match_goldens():
    """The embedding API's way to several models: one lock for both engines'
    GPU threads; each row of each, batched, gives its golden tokens."""
    from conftest import checked_engine, golden

    lock = threading.Lock()
    cases = {f: golden(f)["serial"][:3] for f in ("llama", "qwen3")}
    results: dict = {}
    async with (
        checked_engine("llama", device=lock) as a,
        checked_engine("qwen3", device=lock) as b,
        trio.open_nursery() as nursery,
    ):
        for family, engine in (("llama", a), ("qwen3", b)):
            for i, case in enumerate(cases[family]):

                async def run(engine=engine, key=(family, i), case=case) -> None:
                    n = len(case["tokens"])
                    results[key] = (await engine.generate(case["prompt_ids"], max_tokens=n)).tokens

                nursery.start_soon(run)
    for family, family_cases in cases.items():
        for i, case in enumerate(family_cases):
            assert results[family, i] == case["tokens"], (family, case["prompt"])
    assert a._gpu.device is lock and b._gpu.device is lock


def test_the_device_lock_file_excludes_another_process(tmp_path):
    """`--model-processes`: the parent's engines and a child's take one lock file."""
    path = tmp_path / "device.lock"
    script = (
        "import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\nsys.stdin.read()"
    )
    lock = DeviceLock(path)
    entered = threading.Event()

    def take() -> None:
        with lock:
            entered.set()

    with subprocess.Popen([sys.executable, "-c", script, str(path)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as holder:  # fmt: skip
        try:
            assert holder.stdout.readline().strip() == "held"
            taker = threading.Thread(target=take)
            taker.start()
            assert not entered.wait(0.5)  # the other process holds it
            holder.stdin.close()
            assert holder.wait(10) == 0
            assert entered.wait(10)
            taker.join()
        finally:
            holder.kill()
            lock.close()


async def test_a_model_that_cannot_load_in_its_own_process_is_a_503_saying_why(tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(model_path("qwen3"), broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "no_such_family"}))
    async with running_server(models=(("broken", str(broken)),)) as (url, state):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            r = await chat(http, "broken", "hi")
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "model_load_failed" and "no_such_family" in error["message"]
            assert state.pool.slots["broken"].process is None
            assert (await chat(http, "default", "hi")).status_code == 200  # the rest serves


async def test_a_child_stopped_while_its_figures_are_read_leaves_no_socket_behind():
    """Reads of a child's figures run beside its slot's life (a relay that ended,
    /stats): a stop that closes the child's client while some are still
    connecting must cancel and wait for them, else their sockets come back to a
    pool that no longer knows them and are left to the garbage collector (a
    ResourceWarning, an error in this suite)."""
    import gc

    from mlx_nursery.server import model_process
    from mlx_nursery.server.settings import Settings

    template = Settings(model=str(model_path("llama")), port=0)
    for _ in range(3):
        settings = model_process.child_settings(template, "qwen3", str(model_path("qwen3")),
                                                _settings())  # fmt: skip
        child = await model_process.start(settings)
        assert child.figures["name"] == "qwen3"
        async with trio.open_nursery() as nursery:
            for _ in range(16):
                nursery.start_soon(child.refresh)
            await trio.lowlevel.checkpoint()  # they are connecting
            await child.stop()
        assert child.stopping and not child._calls and child.process.returncode == 0
        await child.refresh()  # once stopped, a no-op
        gc.collect()
