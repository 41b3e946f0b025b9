"""Running the real clients (Claude Code, the Codex CLI, the Agents SDK) in tests:
the pinned installs, a quiet environment, a server with the recording proxy in
front of it, and what each request got.

Every client runs with a fresh HOME, telemetry and non-essential traffic off,
and the proxy's loopback URL as its only base URL: nothing it does leaves this
machine. `make clients` (part of `make test`) installs the pinned clients into
~/.cache/mlx-nursery/clients (or $MLX_NURSERY_CLIENTS)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import trio
from conftest import server_process, sse_body_chunks
from mlx_nursery.server.clients import QUIET, cache_dir
from recording import Exchange, Recording

RUN_TIMEOUT = 400


def client_bin(name: str) -> str:
    path = cache_dir() / "node_modules" / ".bin" / name
    if not path.exists():
        pytest.fail(f"{name} is not installed in {cache_dir()}: `make clients` installs the "
                    "pinned real clients (npm)")  # fmt: skip
    return str(path)


def quiet_env(home: Path, **extra: str) -> dict[str, str]:
    """A fresh HOME, no telemetry, and nothing from this process's environment
    but the PATH (node)."""
    home.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join([str(Path(shutil.which("node") or "/usr/bin/node").parent),
                            "/usr/bin", "/bin"])  # fmt: skip
    return {"PATH": path, "HOME": str(home), "TERM": "dumb", "NO_COLOR": "1", **QUIET,
            **extra}  # fmt: skip


async def run_client(argv: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    await trio.Path(cwd).mkdir(parents=True, exist_ok=True)
    with trio.fail_after(RUN_TIMEOUT):
        return await trio.run_process(argv, env=env, cwd=cwd, capture_stdout=True,
                                      capture_stderr=True, check=False,
                                      stdin=subprocess.DEVNULL)  # fmt: skip


# The head of an Agents SDK script (run in a process of its own; its body defines
# the tools and ``main(url, kind)``): tracing off, a structured verdict, and the
# SDK's Responses or chat-completions model on the server at a URL.
AGENTS_SDK_HEAD = """
import asyncio, json, sys
from pathlib import Path
from openai import AsyncOpenAI
from pydantic import BaseModel
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                    Runner, function_tool, set_tracing_disabled)

set_tracing_disabled(True)


class Verdict(BaseModel):
    ok: bool


def sdk_model(url, kind, name):
    client = AsyncOpenAI(base_url=url + "/v1", api_key="sk-local")
    cls = OpenAIResponsesModel if kind == "responses" else OpenAIChatCompletionsModel
    return cls(model=name, openai_client=client)
"""


def agents_sdk(body: str, root: Path, port: int, kind: str) -> tuple[list[str], dict]:
    """An Agents SDK script (``AGENTS_SDK_HEAD`` + ``body``) written under ``root``,
    as (argv, env) running ``main`` against the server on ``port``."""
    script = root / "agent.py"
    script.write_text(f"{AGENTS_SDK_HEAD}\n{body}\n\nasyncio.run(main(sys.argv[1], sys.argv[2]))\n")
    env = quiet_env(root / "home", OPENAI_AGENTS_DISABLE_TRACING="1")
    return [sys.executable, str(script), f"http://127.0.0.1:{port}", kind], env


def said(done: subprocess.CompletedProcess) -> str:
    return (done.stdout + done.stderr).decode(errors="replace")[-3000:]


def assert_all_2xx(exchanges: list[Exchange], done: subprocess.CompletedProcess) -> None:
    assert exchanges, f"the client sent nothing: {said(done)}"
    bad = [(e.method, e.target, e.status, e.response[:300]) for e in exchanges
           if e.status is None or not 200 <= e.status < 300]  # fmt: skip
    assert not bad, (bad, said(done))
    assert done.returncode == 0, said(done)


@contextlib.asynccontextmanager
async def recorded_server(*server_args: str) -> AsyncIterator[Recording]:
    """A server (``server_args``, OpenBLAS as users run it) with the recording
    proxy in front of it: clients talk to ``recording.port``."""
    async with server_process(*server_args, openblas=True) as (url, _):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        rec = Recording((host, int(port)))
        async with trio.open_nursery() as nursery:
            await nursery.start(rec.serve)
            yield rec
            nursery.cancel_scope.cancel()


async def recorded_run(
    client: Callable[[int], tuple[list[str], dict]], cwd: Path, *server_args: str
) -> tuple[list[Exchange], subprocess.CompletedProcess]:
    """A recorded server and one run of the client that ``client(proxy_port)``
    gives as (argv, env); what the client sent and got, and how it ended."""
    async with recorded_server(*server_args) as rec:
        argv, env = client(rec.port)
        done = await run_client(argv, env, cwd)
    return rec.exchanges(), done


def posts(exchanges: list[Exchange], path: str) -> list[Exchange]:
    return [e for e in exchanges if e.method == "POST" and e.target.split("?")[0] == path]


def sse_data(exchange: Exchange) -> list[dict]:
    """The JSON payloads of a recorded streamed response's events (Anthropic's and
    Responses' ``event:`` frames included; ``conftest.sse_events`` reads a live
    chat stream strictly)."""
    return sse_body_chunks(exchange.response)
