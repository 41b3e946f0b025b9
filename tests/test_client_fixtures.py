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
from mlx_nursery.server.api.messages import HONOURED as MESSAGES_HONOURED
from mlx_nursery.server.api.messages import IGNORED as MESSAGES_IGNORED
from mlx_nursery.server.api.messages import parse_messages
from mlx_nursery.server.api.openai import IGNORED as CHAT_IGNORED
from mlx_nursery.server.api.responses import HONOURED as RESPONSES_HONOURED
from mlx_nursery.server.api.responses import IGNORED as RESPONSES_IGNORED
from mlx_nursery.server.api.responses import STATEFUL, parse_responses

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "clients"


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_claude_codes_request_is_read_as_sent():
    sent = fixture("claude_code_messages")
    body, headers = sent["body"], sent["headers"]
    assert {"context_management", "output_config", "thinking"} <= set(body)
    parsed = parse_messages(body, headers)
    assert parsed.session == headers["x-claude-code-session-id"]
    roles = [m["role"] for m in parsed.prompt]
    # the system blocks first, then the turns, the mid-conversation system turn in its place
    assert roles[0] == "system" and roles.count("system") == 2
    assert roles.index("system", 1) == 1 + [m["role"] for m in body["messages"]].index("system")
    assert len(parsed.params["tools"]) == len(body["tools"]) and not parsed.ignored_tools
    assert parsed.params["max_tokens"] == body["max_tokens"]
    assert "chat_template_kwargs" not in parsed.params  # adaptive thinking: the model decides
    assert parsed.model is None  # claude-* names are served by this server's model


def test_codexs_request_is_read_as_sent():
    sent = fixture("codex_responses")
    body, headers = sent["body"], sent["headers"]
    assert {"include", "prompt_cache_key", "client_metadata", "store"} <= set(body)
    parsed = parse_responses(body, headers)
    assert parsed.session == body["prompt_cache_key"]
    assert parsed.ignored_tools == ("web_search",)
    (group,) = [t for t in body["tools"] if t["type"] == "namespace"]
    names = [t["function"]["name"] for t in parsed.params["tools"]]
    for inner in group["tools"]:
        flat = f"{group['name']}.{inner['name']}"
        assert flat in names and parsed.tool_names[flat] == (group["name"], inner["name"])
    functions = [t for t in body["tools"] if t["type"] == "function"]
    assert len(names) == len(functions) + len(group["tools"])
    assert [m["role"] for m in parsed.prompt][:2] == ["system", "system"]  # developer turns


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

    return str(ensure())


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
