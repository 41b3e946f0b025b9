"""Shared fixtures: the tiny golden models and their mlx-lm goldens."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GOLDENS = ROOT / "goldens"
sys.path.insert(0, str(GOLDENS))
sys.path.append(str(ROOT / "bench"))  # the flood client (bench/flood.py) the sessions tests run

FAMILIES = ("llama", "qwen3", "gemma3_text", "mamba2", "falcon_h1")


def model_path(family: str) -> Path:
    return GOLDENS / "models" / family


def golden(family: str) -> dict:
    return json.loads((GOLDENS / "tokens" / f"{family}.json").read_text())


def served(text: str) -> str:
    """A golden's text (mlx-lm's) as a client reads it over HTTP: without the
    golden tokenizers' control tokens (docs/http.md)."""
    from make_models import SPECIALS

    for special in SPECIALS:
        text = text.replace(special, "")
    return text


@pytest.fixture
def model_cache(tmp_path, monkeypatch) -> Path:
    """A fresh model cache (``MLX_NURSERY_CACHE``): converted and downloaded models."""
    root = tmp_path / "cache"
    monkeypatch.setenv("MLX_NURSERY_CACHE", str(root))
    return root


# A test that runs past this is taken for hung: its stacks and its name are
# printed and the run stops (exit 1), rather than CI's whole time going to one
# test (pyproject's faulthandler_timeout only dumps the stacks, every 300 s).
TEST_LIMIT = float(os.environ.get("MLX_NURSERY_TEST_LIMIT", "900"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import faulthandler
    import threading

    def hung():
        capture = item.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.suspend_global_capture(in_=True)
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.write(f"\n{item.nodeid} ran past {TEST_LIMIT} s, taken for hung: "
                         "the run is stopped (its threads' stacks above)\n")  # fmt: skip
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(TEST_LIMIT, hung)
    timer.daemon = True
    timer.name = "test-watchdog"
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


# -- engine tests ---------------------------------------------------------------
#
# Engine tests open engines through `checked_engine`: when the test body is done
# it waits for the engine to settle and records a snapshot; the autouse fixture
# below then checks that nothing was lost or leaked.

import threading  # noqa: E402
import time  # noqa: E402
from contextlib import asynccontextmanager  # noqa: E402
from functools import cache  # noqa: E402

import trio  # noqa: E402

_SETTLED: list = []


@cache
def loaded(family: str):
    """The family's (model, tokenizer), loaded once per session (outside any event loop)."""
    from mlx_lm import load

    return load(str(model_path(family)))


def generate_to_eos(model, tokenizer, prompt: list[int], **kwargs) -> list[int]:
    """mlx-lm's own ``generate_step`` (greedy), its tokens up to the first EOS."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(mx.array(prompt), model, **kwargs):
        if int(token) in tokenizer.eos_token_ids:
            break
        out.append(int(token))
    return out


@asynccontextmanager
async def checked_engine(family_or_model, **kwargs):
    from mlx_nursery.actors import open_engine

    model = loaded(family_or_model) if isinstance(family_or_model, str) else family_or_model
    kwargs.setdefault("prefill_step_size", 32)
    async with open_engine(model, **kwargs) as engine:
        yield engine
        with trio.fail_after(60):
            await engine.wait_idle()
        _SETTLED.append(engine.stats())


def _gpu_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mlx-nursery-gpu"]


@pytest.fixture(autouse=True)
def own_disk_tier(tmp_path, monkeypatch):
    """Each test's engines and servers keep the prompt cache's disk tier in a
    folder of the test's own: nothing one test wrote serves another."""
    monkeypatch.setenv("MLX_NURSERY_KV_DIR", str(tmp_path / "kv"))


@pytest.fixture(autouse=True)
def nothing_lost_nothing_leaked():
    _SETTLED.clear()
    yield
    for snap in _SETTLED:
        assert snap.active_rows == 0, snap
        assert snap.pending_rows == 0, snap
        assert snap.decoding_rows == 0, snap
        assert snap.kv_bytes == 0, snap
        assert snap.ledger_balanced, (
            f"submitted {snap.submitted} != finished {snap.finished} + errored "
            f"{snap.errored} + cancelled {snap.cancelled}"
        )
    assert not _gpu_threads(), "an engine's GPU thread outlived its engine"


class FaultyModel:
    """Fault injection for tests (nothing else uses it, and HTTP cannot reach it):
    a hand-written fake at the model boundary, the real model plus armed faults.

    ``fail_decode`` raises in the next batched decode forward (B >= 2, one token
    each); ``fail_prefill`` in the next prompt chunk (more than one token);
    ``stall_seconds`` makes the next forward hold the GPU thread that long."""

    def __init__(self, model):
        self._model = model
        self.fail_decode = False
        self.fail_prefill = False
        self.stall_seconds = 0.0

    def __call__(self, inputs, cache=None, **kwargs):
        if self.stall_seconds:
            stall, self.stall_seconds = self.stall_seconds, 0.0
            time.sleep(stall)
        if self.fail_decode and inputs.shape[0] >= 2 and inputs.shape[1] == 1:
            self.fail_decode = False
            raise RuntimeError("injected decode fault")
        if self.fail_prefill and inputs.shape[1] > 1:
            self.fail_prefill = False
            raise RuntimeError("injected prefill fault")
        return self._model(inputs, cache=cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


# -- HTTP tests -----------------------------------------------------------------
#
# Loopback only, port 0, an absolute fail_after on every I/O test.

from collections.abc import AsyncIterator  # noqa: E402
from functools import partial  # noqa: E402
from typing import Any  # noqa: E402

import attrs  # noqa: E402
import httpx  # noqa: E402

SERVER_TIMEOUT = 60


@asynccontextmanager
async def running_server(model=None, **overrides):
    """A real server on an ephemeral loopback port, over the golden llama (or
    ``model``: a path or a (model, tokenizer) pair); ``overrides`` are server or
    engine settings by name. Yields (url, state); checks the ledger afterwards."""
    from mlx_nursery.actors import EngineSettings
    from mlx_nursery.server.serve import serve
    from mlx_nursery.server.settings import Settings

    engine_fields = attrs.fields_dict(EngineSettings)
    engine = {k: v for k, v in overrides.items() if k in engine_fields}
    server = {k: v for k, v in overrides.items() if k not in engine_fields}
    engine = EngineSettings(**{"dtype": "auto", "prefill_step_size": 32, **engine})
    model = str(model_path("llama")) if model is None else model
    settings = Settings(model=model, port=0, engine=engine, **server)
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        urls, state = await nursery.start(partial(serve, settings, shutdown=shutdown))
        with trio.fail_after(SERVER_TIMEOUT):
            while state.phase == "starting":  # noqa: ASYNC110 (the model loads meanwhile)
                await trio.sleep(0.01)
        assert state.phase == "serving", state.error
        try:
            yield urls[0], state
            with trio.fail_after(SERVER_TIMEOUT):
                await state.pool.wait_idle()
            _SETTLED.extend(slot.engine.stats() for slot in state.pool.loaded())
        finally:
            shutdown.set()


async def sse_events(response: httpx.Response) -> list:
    """Parse an SSE body strictly: `data: ...` lines, each followed by a blank line."""
    body = (await response.aread()).decode()
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    frames = body.split("\n\n")[:-1]
    out = []
    for frame in frames:
        assert frame.startswith("data: ") and "\n" not in frame, frame
        payload = frame[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


class _Payloads:
    """A live stream's ``data:`` payloads as they arrive: ``event:`` lines and
    the blank lines between frames skipped; ``chunks``: JSON objects only
    (``[DONE]`` left out), decoded. An iterator, not an async generator: a
    reader may leave it early without closing it."""

    def __init__(self, response: httpx.Response, chunks: bool) -> None:
        self._lines, self._chunks = response.aiter_lines(), chunks

    def __aiter__(self) -> _Payloads:
        return self

    async def __anext__(self) -> Any:
        while True:
            line = await self._lines.__anext__()
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            if not self._chunks:
                return payload
            if payload.startswith("{"):
                return json.loads(payload)


def sse_payloads(response: httpx.Response) -> AsyncIterator[str]:
    """A live stream's ``data:`` payloads as they arrive (JSON text, or ``[DONE]``)."""
    return _Payloads(response, chunks=False)


def sse_chunks(response: httpx.Response) -> AsyncIterator[dict]:
    """A live stream's JSON payloads as they arrive, decoded (``[DONE]`` left out)."""
    return _Payloads(response, chunks=True)


def sse_body_chunks(body: bytes) -> list[dict]:
    """The JSON payloads of a whole recorded stream (any API's frames)."""
    out = []
    for line in body.decode(errors="replace").splitlines():
        if line.startswith("data: ") and line[6:].strip().startswith("{"):
            out.append(json.loads(line[6:]))
    return out


def free_port() -> int:
    """A free TCP port on loopback."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_healthy(client: httpx.AsyncClient, proc, output) -> None:
    """Poll /health until it answers 200; fail with ``output()`` (the process's
    last words) if ``proc`` ends first. The caller bounds the wait."""
    while True:
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, output()
        await trio.sleep(0.05)


@asynccontextmanager
async def server_process(*args: str, openblas: bool = False):
    """`mlx-nursery serve` (the command's entry, `server/entry.py`) in a process of
    its own on a free loopback port (its event loop then carries no test-side
    load); yields (url, pid). SIGTERM at the end.
    On the suite's bundled BLAS, unless ``openblas`` (for tests that compare no
    tokens): then as users run it, with OpenBLAS preloaded where installed."""
    import os
    import subprocess
    import sys

    port = free_port()
    argv = [sys.executable, "-m", "mlx_nursery.server.entry", "serve", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if not openblas:
        env["MLX_NURSERY_OPENBLAS"] = "0"
    proc = subprocess.Popen([*argv, *args], env=env, stderr=subprocess.PIPE)  # noqa: ASYNC220
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            with trio.fail_after(SERVER_TIMEOUT):
                await wait_healthy(client, proc, lambda: proc.stderr.read().decode()[-2000:])
        yield url, proc.pid
    finally:
        proc.terminate()
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(proc.wait, 30)
        proc.stderr.close()
