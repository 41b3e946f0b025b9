"""`mlx-nursery launch`'s decisions, without a client or a server: which flags go
to `serve` and which to the client, what each client is told, what is refused.
The runs themselves are in tests/test_agent_loops.py."""

from __future__ import annotations

import pytest
from conftest import GOLDENS
from mlx_nursery.server import clients


def test_the_client_gets_what_follows_the_double_dash():
    own, theirs = clients.split_client_args(["launch", "claude", "--port", "1", "--", "-p", "x"])
    assert own == ["launch", "claude", "--port", "1"] and theirs == ["-p", "x"]
    assert clients.split_client_args(["launch", "codex"]) == (["launch", "codex"], [])


def test_serve_gets_every_flag_but_launchs_own():
    given = ["--url", "http://h:1", "--model", "m", "--url=http://h:2", "--trust-remote-code"]
    assert clients.serve_flags(given, {"--url": True}) == ["--model", "m", "--trust-remote-code"]


def test_claude_code_is_told_the_served_model_for_every_tier_and_the_context():
    env = clients.claude_env("http://127.0.0.1:8080", "k", "qwen3-8b", 40960)
    tiers = ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL",
             "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL",
             "CLAUDE_CODE_SUBAGENT_MODEL")  # fmt: skip
    assert {env[t] for t in tiers} == {"qwen3-8b"}
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8080"
    assert env["ANTHROPIC_AUTH_TOKEN"] == "k"
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "40960"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == str(40960 // 4)
    assert env["DISABLE_TELEMETRY"] == env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"


def test_codex_is_configured_by_overrides_alone():
    args = clients.codex_overrides("http://127.0.0.1:8080", "qwen3-8b", 40960)
    pairs = dict(a.split("=", 1) for a in args[1::2])
    assert set(args[::2]) == {"-c"}
    assert pairs["model_provider"] == '"mlx_nursery"' and pairs["model"] == '"qwen3-8b"'
    assert pairs["model_providers.mlx_nursery.base_url"] == '"http://127.0.0.1:8080/v1"'
    assert pairs["model_providers.mlx_nursery.wire_api"] == '"responses"'
    assert pairs["model_context_window"] == "40960"
    assert int(pairs["model_auto_compact_token_limit"]) < 40960
    assert pairs["analytics.enabled"] == "false"


def test_the_context_is_read_without_loading_where_that_is_cheap():
    assert clients.peek_context(None, None) == ("smollm2-135m-instruct", 8192)
    assert clients.peek_context(str(GOLDENS / "models" / "llama"), None) == ("llama", 4096)
    assert clients.peek_context(str(GOLDENS / "models" / "llama"), 2048)[1] == 2048
    assert clients.peek_context("org/some-hub-model", None) is None  # the server will say


@pytest.mark.parametrize("client", [clients.CLAUDE, clients.CODEX])
def test_a_short_context_is_refused_with_what_to_do(client):
    with pytest.raises(clients.LaunchError) as err:
        clients.check_fits(client, "smollm2-135m-instruct", 8192)
    message = str(err.value)
    assert f"needs at least {client.needs:,}" in message and "for trying the API" in message
    assert f"mlx-nursery launch {client.command} --model" in message
    clients.check_fits(client, "big", client.needs)  # enough: no error
    clients.check_fits(client, "unknown", None)


def test_a_missing_client_is_named_with_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv(clients.CLIENTS_ENV, str(tmp_path / "none"))
    with pytest.raises(clients.LaunchError) as err:
        clients.find(clients.CODEX)
    assert "npm install -g @openai/codex" in str(err.value) and "make clients" in str(err.value)
    found = tmp_path / "none" / "node_modules" / ".bin" / "codex"
    found.parent.mkdir(parents=True)
    found.write_text("#!/bin/sh\n")
    assert clients.find(clients.CODEX) == str(found)  # make clients' cache, when not on PATH
