"""Real agent loops against a scripted model (goldens/scripted_model.py): the
scripts, the clients' runs, and each request's cache figures read back from the
recorded traffic. Shared by tests/test_agent_loops.py and `make bench`
(bench/benchsuite.py --agent-loop)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import attrs
from clients import client_bin, posts, quiet_env, sse_data
from conftest import GOLDENS
from recording import Exchange

FILES = {"a.txt": "alpha first\nmore\n", "b.txt": "beta first\n", "c.txt": "gamma first\n",
         "notes.txt": "status: draft\n"}  # fmt: skip
FAN_OUT = "Fan out: three sub-agents read a.txt, b.txt and c.txt; then mark notes.txt reviewed."


def workdir(root: Path) -> Path:
    """A project with the files the scripts read and edit."""
    root.mkdir(parents=True, exist_ok=True)
    for name, text in FILES.items():
        (root / name).write_text(text)
    return root


def claude_script(work: Path) -> dict:
    """Claude Code's loop: the main agent starts three sub-agents at once (its
    Agent tool), each reads its file and reports the first line; then the main
    agent reads notes.txt, edits it and answers."""
    sub = [{"when": f"Report the first line of {work / n}", "turns": [
        {"calls": [{"name": "Read", "arguments": {"file_path": str(work / n)}}]},
        {"text": f"{n}: {{last_result}}"},
    ]} for n in ("a.txt", "b.txt", "c.txt")]  # fmt: skip
    agents = [{"name": "Agent", "arguments": {
        "description": f"Read {n}", "prompt": f"Report the first line of {work / n}",
        "subagent_type": "general-purpose"}} for n in ("a.txt", "b.txt", "c.txt")]  # fmt: skip
    notes = str(work / "notes.txt")
    main = {"when": "Fan out:", "turns": [
        {"calls": agents},
        {"calls": [{"name": "Read", "arguments": {"file_path": notes}}]},
        {"calls": [{"name": "Edit", "arguments": {"file_path": notes, "old_string": "status: draft",
                                                   "new_string": "status: reviewed"}}]},
        {"text": "Done: notes.txt is marked reviewed."},
    ]}  # fmt: skip
    return {"rules": [main, *sub], "default": {"text": "ok"}}


def codex_script(work: Path) -> dict:
    """Codex's loop: read notes.txt in the shell, edit it there, answer."""
    return {"rules": [{"when": "mark notes.txt reviewed", "turns": [
        {"calls": [{"name": "exec_command", "arguments": {"cmd": "cat notes.txt"}}]},
        {"calls": [{"name": "exec_command",
                    "arguments": {"cmd": "sed -i 's/status: draft/status: reviewed/' notes.txt"}}]},
        {"text": "Done: notes.txt is marked reviewed."},
    ]}], "default": {"text": "ok"}}  # fmt: skip


# The Agents SDK loops' function tools (a script body for ``clients.agents_sdk``).
FILE_TOOLS = """
@function_tool
def read_file(path: str) -> str:
    "A file's text."
    return Path(path).read_text()


@function_tool
def write_file(path: str, content: str) -> str:
    "Write a file."
    Path(path).write_text(content)
    return f"wrote {len(content)} characters to {Path(path).name}"
"""


def agents_sdk_script(work: Path) -> dict:
    """The Agents SDK's loop: read notes.txt, write it back reviewed, answer; and a
    structured verdict."""
    notes = str(work / "notes.txt")
    return {"rules": [
        {"when": "Mark notes.txt reviewed", "turns": [
            {"calls": [{"name": "read_file", "arguments": {"path": notes}}]},
            {"calls": [{"name": "write_file",
                        "arguments": {"path": notes, "content": "status: reviewed\n"}}]},
            {"text": "Done: {last_result}"},
        ]},
        {"when": "Is it reviewed?", "turns": [{"text": '{"ok": true}'}]},
    ], "default": {"text": "ok"}}  # fmt: skip


sys.path.insert(0, str(GOLDENS))
from make_scripted_model import build  # noqa: E402 (goldens/ on the path)


def build_model(
    out: Path, script: dict, body: dict | None = None, family: str | None = None,
    vision: bool = False,
) -> str:  # fmt: skip
    return str(build(out, script, body, family, vision))


def claude(home: Path, port: int, prompt: str) -> tuple[list[str], dict]:
    """`claude -p`, allowed the loop's tools, pointed at the proxy."""
    env = quiet_env(home, ANTHROPIC_BASE_URL=f"http://127.0.0.1:{port}",
                    ANTHROPIC_API_KEY="sk-local")  # fmt: skip
    return [client_bin("claude"), "-p", prompt, "--allowedTools", "Read", "Edit", "Agent"], env


@attrs.frozen
class Turn:
    """One request of a loop, as the recorded traffic shows it."""

    conversation: str  # "main", "sub-agent 1", ... in order of first appearance
    turn: int  # 1: the conversation's first request
    prompt_tokens: int
    cached_tokens: int
    ttft: float | None  # from the server's request log where known
    diverged_at: int | None

    @property
    def share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _usage(e: Exchange) -> tuple[int, int]:
    """(prompt, cached) tokens from a streamed answer's closing usage."""
    (usage,) = [x["usage"] for x in sse_data(e) if x.get("type") == "message_delta"]
    cached = usage["cache_read_input_tokens"]
    return usage["input_tokens"] + cached, cached


def first_message(body: dict) -> str:
    """The text of a conversation's first message (its blocks' ``cache_control``
    moves on as the conversation grows)."""
    first = body["messages"][0]["content"]
    return first if isinstance(first, str) else "".join(b.get("text", "") for b in first)


def _conversation_key(body: dict) -> str:
    return json.dumps([len(body.get("tools", [])), first_message(body)])


def messages_turns(exchanges: list[Exchange], log: list[dict] = ()) -> list[Turn]:
    """Each Messages request of the run, by conversation and turn, with its cache
    figures; ``log`` (the server's request log, in order) adds TTFT and where the
    prompt diverged, matched by prompt length and cached tokens."""
    names: dict[str, str] = {}
    counts: dict[str, int] = {}
    turns = []
    for e in sorted(posts(exchanges, "/v1/messages"), key=lambda e: len(e.json()["messages"])):
        body = e.json()
        key = _conversation_key(body)
        if key not in names:
            subs = sum(n.startswith("sub-agent") for n in names.values())
            mains = sum(n.startswith("conversation") for n in names.values())
            is_sub = "cc_is_subagent=true" in json.dumps(body.get("system", ""))
            names[key] = f"sub-agent {subs + 1}" if is_sub else f"conversation {mains + 1}"
        counts[key] = counts.get(key, 0) + 1
        prompt, cached = _usage(e)
        found = [r for r in log if r.get("prompt_tokens") == prompt
                 and r.get("cached_tokens") == cached]  # fmt: skip
        ttft = found[0].get("time_to_first_token_seconds") if found else None
        diverged = (found[0].get("prompt_cache") or {}).get("diverged_at") if found else None
        turns.append(Turn(names[key], counts[key], prompt, cached, ttft, diverged))
    return turns


def responses_turns(exchanges: list[Exchange]) -> list[tuple[int, int]]:
    """(prompt, cached) tokens of each Responses request, in the order sent."""
    out = []
    for e in posts(exchanges, "/v1/responses"):
        (done,) = [x for x in sse_data(e) if x.get("type") == "response.completed"]
        usage = done["response"]["usage"]
        out.append((usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]))
    return out


def table(turns: list[Turn]) -> str:
    """The timeline as a markdown table."""
    rows = ["| conversation | turn | prompt tokens | cached | share | diverged at | TTFT (s) |",
            "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for t in turns:
        ttft = f"{t.ttft:.3f}" if t.ttft is not None else "-"
        rows.append(f"| {t.conversation} | {t.turn} | {t.prompt_tokens:,} | {t.cached_tokens:,} "
                    f"| {t.share:.1%} | {t.diverged_at if t.diverged_at is not None else '-'} "
                    f"| {ttft} |")  # fmt: skip
    return "\n".join(rows)
