"""The real clients' captured first requests (tests/fixtures/clients/, kept whole:
Claude Code 2.1.197's `claude -p`, the Codex CLI 0.171.0's `codex exec`), read
without node: every field accepted, and the fields documented as honoured take
effect (the session hint, the system turn where it stands, the namespaced and
hosted tools, the tools whose schemas the grammar engine cannot fully compile)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import trio
from conftest import GOLDENS, server_process
from mlx_nursery.actors import EngineSettings
from mlx_nursery.actors.request import Priority
from mlx_nursery.server.api.messages import DROPPED_ATTRIBUTION, SYSTEM_FIRST, parse_messages
from mlx_nursery.server.api.messages import HONOURED as MESSAGES_HONOURED
from mlx_nursery.server.api.messages import IGNORED as MESSAGES_IGNORED
from mlx_nursery.server.api.openai import IGNORED as CHAT_IGNORED
from mlx_nursery.server.api.responses import HONOURED as RESPONSES_HONOURED
from mlx_nursery.server.api.responses import IGNORED as RESPONSES_IGNORED
from mlx_nursery.server.api.responses import STATEFUL, parse_responses
from mlx_nursery.server.pool import ModelSpec, Pool

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "clients"


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_claude_codes_traffic_says_each_requests_class():
    """The captured main-agent request is interactive; the same request from a
    sub-agent (its agent id header, as Claude Code 2.1.197 sends it, or the
    attribution line's ``cc_is_subagent=true;``) is a sub-agent's; one with no
    tools (a title, a summary) is background; the X-Priority header overrides
    all of it; another client's request is left interactive."""
    sent = fixture("claude_code_messages")
    body, headers = sent["body"], sent["headers"]
    assert parse_messages(body, headers).request.priority == Priority.INTERACTIVE
    sub = {**headers, "x-claude-code-agent-id": "adb97ff53ced2634a"}
    assert parse_messages(body, sub).request.priority == Priority.SUBAGENT
    line = body["system"][0]["text"] + " cc_is_subagent=true;"
    flagged = {**body, "system": [{"type": "text", "text": line}, *body["system"][1:]]}
    assert parse_messages(flagged, headers).request.priority == Priority.SUBAGENT
    bare = {k: v for k, v in body.items() if k != "tools"}
    assert parse_messages(bare, headers).request.priority == Priority.BACKGROUND
    told = parse_messages(body, {**sub, "X-Priority": "interactive"})
    assert told.request.priority == "interactive"
    other = {"content-type": "application/json", "user-agent": "Anthropic/Python 0.40.0"}
    assert parse_messages(bare, other).request.priority is None


def test_claude_codes_request_is_read_with_its_shared_parts_first():
    """By default the attribution block is dropped and the system turn Claude Code
    sends after the first user message (agent types and skills) joins the system
    prompt: what every conversation and sub-agent shares comes first."""
    sent = fixture("claude_code_messages")
    body, headers = sent["body"], sent["headers"]
    assert {"context_management", "output_config", "thinking"} <= set(body)
    parsed = parse_messages(body, headers)
    assert parsed.request.session == headers["x-claude-code-session-id"]
    assert [m["role"] for m in parsed.request.prompt] == ["system", "user"]
    system = parsed.request.prompt[0]["content"]
    assert system.startswith(body["system"][1]["text"]) and "x-anthropic-billing" not in system
    assert system.endswith(body["messages"][1]["content"])  # the agent types, after it
    assert parsed.adjusted == (DROPPED_ATTRIBUTION, SYSTEM_FIRST)
    assert len(parsed.request.params["tools"]) == len(body["tools"]) and not parsed.ignored_tools
    assert parsed.request.params["max_tokens"] == body["max_tokens"]
    # adaptive thinking: the model decides
    assert "chat_template_kwargs" not in parsed.request.params
    # The name passes through; with one model served, the pool maps claude-* to it.
    assert parsed.model == body["model"]
    pool = Pool.of([ModelSpec("served", "served-ref", None)], EngineSettings(), aliases={},
                   budget=None, wait=1.0)  # fmt: skip
    assert pool.resolve(parsed.model) is pool.default


def test_claude_codes_request_as_sent():
    sent = fixture("claude_code_messages")
    body = sent["body"]
    parsed = parse_messages(body, sent["headers"], as_sent=True)
    roles = [m["role"] for m in parsed.request.prompt]
    # the system blocks first, then the turns, the mid-conversation system turn in its place
    assert roles == ["system", "user", "system"] and not parsed.adjusted
    assert parsed.request.prompt[0]["content"].startswith(body["system"][0]["text"])


def _with(body: dict, system: list | str | None = None, prompt: str | None = None) -> dict:
    out = json.loads(json.dumps(body))
    if system is not None:
        out["system"] = system
    if prompt is not None:
        out["messages"][0]["content"][-1]["text"] = prompt
    return out


@pytest.mark.parametrize(
    "line",
    [
        "x-anthropic-billing-header: cc_version=2.1.197.3d1; cc_entrypoint=sdk-cli;",
        "x-anthropic-billing-header: cc_version=2.1.197.ec9; cc_entrypoint=cli; "
        "cc_is_subagent=true;",
        "x-anthropic-billing-header: cc_version=2.2.0.a0f; cc_entrypoint=claude-vscode; cch=00000; "
        "cc_workload=ci;",
    ],
)
def test_the_attribution_block_is_dropped_in_each_of_its_forms(line):
    body = fixture("claude_code_messages")["body"]
    parsed = parse_messages(_with(body, [{"type": "text", "text": line}, *body["system"][1:]]))
    assert DROPPED_ATTRIBUTION in parsed.adjusted
    assert "x-anthropic-billing-header" not in parsed.request.prompt[0]["content"]


def test_only_the_attribution_block_is_dropped():
    """A look-alike elsewhere, with more text, or of another form stays in the prompt."""
    body = fixture("claude_code_messages")["body"]
    line, rest = body["system"][0], body["system"][1:]
    block = {"type": "text", "text": line["text"]}
    kept = [
        [rest[0], block, *rest[1:]],  # the same line, not first
        [{"type": "text", "text": line["text"] + " Be brief."}, *rest],  # more than the line
        [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2; tier=pro;"}, *rest],
        [{"type": "text", "text": " " + line["text"]}, *rest],
        line["text"],  # a plain string system prompt: the client's own text
    ]
    for system in kept:
        parsed = parse_messages(_with(body, system))
        assert DROPPED_ATTRIBUTION not in parsed.adjusted, system
        assert "x-anthropic-billing-header: cc_version=" in parsed.request.prompt[0]["content"]


def test_two_conversations_differ_only_in_their_last_message():
    """Two conversations (another first message, so another attribution hash) render
    the same system prompt, tools and system turn, and differ only in the user
    message, which comes last: a second conversation finds all before it cached."""
    body = fixture("claude_code_messages")["body"]
    other = _with(body, prompt="say bye")
    other["system"][0]["text"] = other["system"][0]["text"].replace(".123;", ".9fe;")
    one, two = parse_messages(body).request, parse_messages(other).request
    assert one.prompt[:-1] == two.prompt[:-1] and one.params == two.params
    assert one.prompt[-1] != two.prompt[-1] and one.prompt[-1]["role"] == "user"
    # a later turn of the conversation still extends its first request
    later = json.loads(json.dumps(body))
    later["messages"] += [{"role": "assistant", "content": "hi"},
                          {"role": "user", "content": "and again"},
                          {"role": "system", "content": "a reminder"}]  # fmt: skip
    turns = parse_messages(later).request.prompt
    assert turns[: len(one.prompt)] == one.prompt and turns[-1]["role"] == "system"


def test_codexs_request_is_read_as_sent():
    sent = fixture("codex_responses")
    body, headers = sent["body"], sent["headers"]
    assert {"include", "prompt_cache_key", "client_metadata", "store"} <= set(body)
    parsed = parse_responses(body, headers)
    assert parsed.request.session == body["prompt_cache_key"]
    assert parsed.ignored_tools == ("web_search",)
    (group,) = [t for t in body["tools"] if t["type"] == "namespace"]
    names = [t["function"]["name"] for t in parsed.request.params["tools"]]
    for inner in group["tools"]:
        flat = f"{group['name']}.{inner['name']}"
        assert flat in names and parsed.tool_names[flat] == (group["name"], inner["name"])
    functions = [t for t in body["tools"] if t["type"] == "function"]
    assert len(names) == len(functions) + len(group["tools"])
    assert [m["role"] for m in parsed.request.prompt][:2] == ["system", "system"]  # developer turns


def test_every_field_the_sdks_document_is_accepted():
    """The official SDKs' request types list each API's documented fields: each
    is honoured or ignored here, none refused as unknown."""
    import typing

    from anthropic.types.beta import message_create_params as anthropic_beta
    from openai.types.chat import completion_create_params as chat
    from openai.types.responses import response_create_params as responses

    def fields(cls) -> set[str]:
        return {k for c in cls.__mro__ for k in getattr(c, "__annotations__", {})}

    assert fields(anthropic_beta.MessageCreateParamsBase) <= MESSAGES_HONOURED | MESSAGES_IGNORED
    assert fields(responses.ResponseCreateParamsBase) <= (
        RESPONSES_HONOURED | RESPONSES_IGNORED | set(STATEFUL)
    )
    from mlx_nursery.server.api.openai import _FIELDS

    assert fields(chat.CompletionCreateParamsBase) <= _FIELDS["chat"]
    assert _FIELDS["chat"] >= CHAT_IGNORED
    assert typing  # the SDK types are TypedDicts: their annotations are the fields


@pytest.fixture(scope="module")
def client_model() -> str:
    import sys

    sys.path.insert(0, str(GOLDENS))
    from make_client_model import ensure

    return f"client-llama={ensure()}"  # the name the clients are set up with


async def test_the_captured_requests_get_2xx_from_a_server(client_model):
    """Both bodies as sent (streamed), and Claude Code's count_tokens, through a
    real server: 200s, Codex's hosted tool named in X-Ignored-Tools, and the
    session hints in the request log."""
    claude, codex = fixture("claude_code_messages"), fixture("codex_responses")
    with trio.fail_after(600):
        async with server_process("--model", client_model, openblas=True) as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=300) as http:
                r = await http.post("/v1/messages/count_tokens", json={
                    k: v for k, v in claude["body"].items()
                    if k in ("model", "messages", "system", "tools", "thinking")
                }, headers=claude["headers"])  # fmt: skip
                assert r.status_code == 200 and r.json()["input_tokens"] > 5000, r.text
                for sent, path in ((claude, "/v1/messages"), (codex, "/v1/responses")):
                    # Codex names the model its config names; Claude Code's claude-* is ours
                    body = {**sent["body"], "model": sent["body"]["model"].replace(
                        "llama", "client-llama")}  # fmt: skip
                    async with http.stream("POST", path, json=body, headers=sent["headers"]) as r:
                        text = (await r.aread()).decode()
                        assert r.status_code == 200, text[:500]
                    if path == "/v1/responses":
                        assert r.headers["x-ignored-tools"] == "web_search"
                        assert "event: response.completed" in text or "response.incomplete" in text
                    else:
                        assert "event: message_stop" in text
                recent = (await http.get("/stats")).json()["recent_requests"]
    sessions = {r["api"]: r["session"] for r in recent}
    assert sessions["messages"] == claude["headers"]["x-claude-code-session-id"]
    assert sessions["responses"] == codex["body"]["prompt_cache_key"]
