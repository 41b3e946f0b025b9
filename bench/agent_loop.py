"""Claude Code's agent loop against the scripted model, request by request: each
request's prompt, what the prompt cache held and where it diverged, and TTFT,
as a timeline; and a sub-agent's first request against the same request cold.

Three runs of the real `claude -p` (pinned, `make clients`) in one fresh server:
a fan-out (the main agent starts three sub-agents through its Agent tool, each
reads a file, then it reads and edits notes.txt), a second fan-out with another
prompt (a new conversation, as a user's next task), and a `say hi`. Then a
fresh server answers the first sub-agent's first request with nothing cached:
the cold TTFT the warm ones are measured against. Writes the
``agent-loop`` section of docs/benchmarks.md.

    python bench/agent_loop.py
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]

from agent_loops import (  # noqa: E402 (tests/ on the path first)
    FAN_OUT,
    build_model,
    claude,
    claude_script,
    messages_turns,
    table,
    workdir,
)
from benchsuite import _write_section  # noqa: E402
from clients import assert_all_2xx, posts, run_client  # noqa: E402
from clients import recorded_server as recorded  # noqa: E402
from conftest import server_process  # noqa: E402
from make_scripted_model import BODY  # noqa: E402 (goldens/, put on the path by agent_loops)
from mlx_nursery.server.blas import find_openblas  # noqa: E402

SECOND = FAN_OUT.replace("Fan out:", "Fan out: again,")  # the next task: a new conversation
FLAGS = ("--trust-remote-code", "--prompt-cache-disk", "0")


def _log(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


async def loop(root: Path) -> tuple[list[tuple[str, list]], dict]:
    work = workdir(root / "work")
    model = build_model(root / "scripted", claude_script(work), BODY)
    log = root / "requests.jsonl"
    runs = []
    async with recorded("--model", model, *FLAGS, "--request-log", str(log)) as rec:
        for label, prompt in (("fan-out", FAN_OUT), ("fan-out 2", SECOND), ("say hi", "say hi")):
            (work / "notes.txt").write_text("status: draft\n")
            before = len(rec.exchanges())
            done = await run_client(*claude(root / "home", rec.port, prompt), work)
            exchanges = rec.exchanges()[before:]
            assert_all_2xx(exchanges, done)
            runs.append((label, messages_turns(exchanges, _log(log))))
        sub = next(e for e in posts(rec.exchanges(), "/v1/messages")
                   if "cc_is_subagent=true" in json.dumps(e.json()["system"])
                   and len(e.json()["messages"]) == 2)  # fmt: skip
    return runs, {"model": model, "body": sub.json()}


async def cold(model: str, body: dict, root: Path) -> float:
    """The sub-agent's first request in a fresh server: its TTFT from the log."""
    log = root / "cold.jsonl"
    served = server_process("--model", model, *FLAGS, "--request-log", str(log), openblas=True)
    async with served as (url, _), httpx.AsyncClient(base_url=url, timeout=600) as client:
        reply = await client.post("/v1/messages", json={**body, "stream": False})
        reply.raise_for_status()
    return _log(log)[-1]["time_to_first_token_seconds"]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        runs, sub = trio.run(loop, root)
        cold_ttft = trio.run(cold, sub["model"], sub["body"], root)
    lines = [
        f"Run {time.strftime('%Y-%m-%d')}; BLAS: "
        f"{'OpenBLAS (preloaded by the servers)' if find_openblas() else 'mlx bundled'}; "
        "float32; the scripted model with a one-layer, one-head llama body "
        "(`goldens/make_scripted_model.py` `BODY`; byte-level tokens, so a prompt is its "
        "length in bytes); "
        "Claude Code 2.1.197 (`claude -p`) through a recording proxy, one fresh server "
        "(`--prompt-cache-disk 0`); TTFT from the server's request log.",
        "",
        f"A sub-agent's first request cold (a fresh server, nothing cached): "
        f"**{cold_ttft:.3f} s**.",
        "",
        "| run | sub-agent first requests: TTFT (s) | / cold | cached |",
        "| --- | --- | --- | --- |",
    ]
    for label, turns in runs:
        firsts = [t for t in turns if t.conversation.startswith("sub-agent") and t.turn == 1]
        if firsts:
            ttfts = ", ".join(f"{t.ttft:.3f}" for t in firsts if t.ttft is not None)
            ratios = ", ".join(f"{t.ttft / cold_ttft:.3f}x" for t in firsts if t.ttft)
            shares = ", ".join(f"{t.share:.1%}" for t in firsts)
            lines.append(f"| {label} | {ttfts} | {ratios} | {shares} |")
    for label, turns in runs:
        lines += ["", f"**{label}**", "", table(turns)]
    warm = [t.share for _, ts in runs for t in ts if t.turn > 1]
    lines += ["", f"Every later turn: median {statistics.median(warm):.1%} of its prompt "
              f"cached, least {min(warm):.1%}."]  # fmt: skip
    body = "\n".join(lines)
    print(body)
    _write_section("agent-loop", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
