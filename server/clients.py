"""`mlx-nursery launch claude|codex [flags] [-- client args]`: a coding agent ready
to work against this server.

It uses the server already answering at ``--url`` (default: the ``--host`` and
``--port`` a ``serve`` would bind), or starts ``mlx-nursery serve`` with the
flags given and stops it when the client exits. Then it reads the served model
and its context from ``/v1/models`` and refuses, before the client starts, a
model whose context cannot hold the client's own prompt (`NEEDS`). It runs the
client with this server as its only endpoint, the served model under every name
the client asks for, its context window and output cap fitted to the served
context, and its telemetry and non-essential traffic off:

- Claude Code through environment variables: the base URL and a token, the model
  for its main, small/fast, haiku/sonnet/opus and sub-agent tiers, the context
  window (``CLAUDE_CODE_MAX_CONTEXT_TOKENS``, read for a non-``claude-`` model
  name, and the auto-compact window), the output cap, and the attribution block
  off (``CLAUDE_CODE_ATTRIBUTION_HEADER=0``: the server drops it too);
- Codex through ``-c`` overrides (a model provider with this base URL on the
  Responses wire API, the model, its context window and compaction limit), so
  no config file of the user's is written.

The client is found on PATH, else in ``make clients``' cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
import httpx

from .settings import API_KEY_ENV

CLIENTS_ENV = "MLX_NURSERY_CLIENTS"  # where `make clients` installs the pinned clients
START_TIMEOUT = 600.0  # seconds a started server may take to load (a first GGUF conversion)
OUTPUT_CAP = 32000  # Claude Code's own default output cap, lowered to fit a short context


@attrs.frozen
class Client:
    command: str
    title: str
    package: str  # on npm
    # Its first request as measured (tokens of system prompt, tools and one short
    # message, on SmolLM2's tokenizer; tests/fixtures/clients/ holds the bodies).
    prompt_tokens: int
    # The least context it can work in: that first request and room for the turns after.
    needs: int


# Claude Code's telemetry, error reporting, updater and non-essential traffic off.
QUIET = {"DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
         "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}  # fmt: skip

CLAUDE = Client("claude", "Claude Code", "@anthropic-ai/claude-code", 20_904, 32_768)
CODEX = Client("codex", "Codex", "@openai/codex", 8_755, 16_384)
CLIENTS = {c.command: c for c in (CLAUDE, CODEX)}


class LaunchError(Exception):
    """What stops a launch, worded for the person who ran it."""


def cache_dir() -> Path:
    """Where `make clients` installs the pinned clients."""
    default = Path.home() / ".cache" / "mlx-nursery" / "clients"
    return Path(os.environ.get(CLIENTS_ENV) or default)


def find(client: Client) -> str:
    """The client's executable: on PATH, else in `make clients`' cache."""
    found = shutil.which(client.command)
    cached = cache_dir() / "node_modules" / ".bin" / client.command
    if found is None and cached.exists():
        found = str(cached)
    if found is None:
        raise LaunchError(
            f"{client.title} ({client.command}) is not on PATH nor in {cache_dir()}: install "
            f"it with `npm install -g {client.package}`, or `make clients` in the mlx-nursery "
            "checkout for the versions its tests pin"
        )
    return found


def check_fits(client: Client, model: str, context: int | None) -> None:
    """Refuse a served context that cannot hold the client's prompt and its work."""
    from mlx_nursery.actors.models.registry import DEFAULT

    if context is None or context >= client.needs:
        return
    default = " The default model is for trying the API." if model == DEFAULT.id else ""
    raise LaunchError(
        f"{client.title} cannot work on {model}: it serves {context:,} tokens of context, and "
        f"{client.title}'s first request alone is about {client.prompt_tokens:,} tokens (its "
        f"system prompt and tools); it needs at least {client.needs:,}.{default} Serve a model "
        "with a longer context, e.g. "
        f"`mlx-nursery launch {client.command} --model ollama:qwen3:8b` (40,960 tokens), or "
        f"any GGUF file or mlx-lm model directory whose context is {client.needs:,} tokens "
        "or more (docs/clients.md)"
    )


def claude_env(url: str, key: str, model: str, context: int | None) -> dict[str, str]:
    """Claude Code's environment for this server."""
    env = {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_AUTH_TOKEN": key,  # a bearer token: no prompt to approve an API key
        "ANTHROPIC_API_KEY": "",
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        **QUIET,
    }
    for tier in ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL",
                 "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL",
                 "CLAUDE_CODE_SUBAGENT_MODEL"):  # fmt: skip
        env[tier] = model
    if context is not None:
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(context)
        env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(context)  # read from 100,000 tokens on
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(min(OUTPUT_CAP, context // 4))
    return env


def small_model_env(client: Client, url: str, key: str, small: str) -> dict[str, str]:
    """Claude Code's small, fast tier on a second served model (checked against
    the server's /v1/models, its names and aliases)."""
    if client is not CLAUDE:
        raise LaunchError("--small-model is Claude Code's (its haiku tier); Codex has none")
    reply = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5)
    names = {n for card in reply.json().get("data") or []
             for n in (card["id"], *card.get("aliases", ()))}  # fmt: skip
    if small not in names:
        raise LaunchError(f"--small-model {small}: the server at {url} serves no such model "
                          f"(it serves {', '.join(sorted(names))}); add it with --model "
                          f"{small}=PATH")  # fmt: skip
    return {"ANTHROPIC_SMALL_FAST_MODEL": small, "ANTHROPIC_DEFAULT_HAIKU_MODEL": small}


def codex_overrides(url: str, model: str, context: int | None) -> list[str]:
    """Codex's ``-c`` overrides for this server (the key comes in ``API_KEY_ENV``)."""
    provider = "model_providers.mlx_nursery"
    pairs = [
        ("model_provider", '"mlx_nursery"'),
        (f"{provider}.name", '"mlx-nursery"'),
        (f"{provider}.base_url", json.dumps(f"{url}/v1")),
        (f"{provider}.wire_api", '"responses"'),
        (f"{provider}.env_key", json.dumps(API_KEY_ENV)),
        ("model", json.dumps(model)),
        ("analytics.enabled", "false"),
        ("feedback.enabled", "false"),
        ("check_for_update_on_startup", "false"),
    ]
    if context is not None:
        pairs += [("model_context_window", str(context)),
                  ("model_auto_compact_token_limit", str(context * 4 // 5))]  # fmt: skip
    return [arg for key, value in pairs for arg in ("-c", f"{key}={value}")]


def command(
    client: Client, url: str, key: str, model: str, context: int | None, args: Sequence[str]
) -> tuple[list[str], dict[str, str]]:
    """The client's argv and the environment it adds to the caller's."""
    exe = find(client)
    if client is CLAUDE:
        return [exe, *args], claude_env(url, key, model, context)
    return [exe, *codex_overrides(url, model, context), *args], {API_KEY_ENV: key}


def served(url: str, key: str) -> tuple[str, int | None] | None:
    """The model id and context a server at ``url`` serves; None: nothing answers."""
    try:
        reply = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"},
                          timeout=3)  # fmt: skip
    except httpx.HTTPError:
        return None
    if reply.status_code == 401:
        raise LaunchError(f"the server at {url} wants an API key: set ${API_KEY_ENV}")
    if reply.status_code != 200:
        return None
    cards = reply.json().get("data") or []
    if not cards:
        raise LaunchError(f"the server at {url} lists no model at /v1/models")
    return cards[0]["id"], cards[0].get("context_length")


def peek_context(model: str | None, context_length: int | None) -> tuple[str, int] | None:
    """A model's name and context read without loading it, where that is cheap
    (``--context-length``, the default model, a directory's config)."""
    from mlx_nursery.actors.models import registry

    if model is None:
        return registry.DEFAULT.id, context_length or registry.DEFAULT.context_length
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    found = json.loads(config.read_text())
    found = found.get("text_config", found) | found
    context = context_length or found.get("max_position_embeddings")
    return (registry.short_id(model), int(context)) if context else None


def _wait_healthy(url: str, key: str, proc: subprocess.Popen) -> tuple[str, int | None]:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LaunchError(f"the server exited ({proc.returncode}) before it served: its "
                              "log is above")  # fmt: skip
        got = served(url, key)
        if got is not None:
            return got
        time.sleep(0.5)
    raise LaunchError(f"the server did not answer at {url} within {START_TIMEOUT:.0f} s")


def launch(
    client: Client,
    url: str,
    serve_argv: Sequence[str],
    client_args: Sequence[str],
    model: str | None,
    context_length: int | None,
    key: str | None,
    small: str | None = None,
) -> int:
    """Run ``client`` against the server at ``url``, started with ``serve_argv``
    when nothing answers there; the client's exit code."""
    key = key or os.environ.get(API_KEY_ENV) or "mlx-nursery"
    find(client)  # before any server starts: say how to install it first
    proc = None
    got = served(url, key)
    if got is not None and serve_flags(serve_argv, {"--host": True, "--port": True}):
        print(f"mlx-nursery launch: a server already answers at {url} (serving {got[0]}); "
              f"the serve flags given are not applied to it", file=sys.stderr)  # fmt: skip
    if got is None:
        peeked = peek_context(model, context_length)
        if peeked is not None:
            check_fits(client, *peeked)
        argv = [sys.executable, "-m", "mlx_nursery.server.cli", "serve", *serve_argv]
        print(f"mlx-nursery launch: starting `mlx-nursery serve {' '.join(serve_argv)}`",
              file=sys.stderr)  # fmt: skip
        proc = subprocess.Popen(argv, env={**os.environ, API_KEY_ENV: key})
    try:
        if proc is not None:
            got = _wait_healthy(url, key, proc)
        served_model, context = got
        check_fits(client, served_model, context)
        argv, env = command(client, url, key, served_model, context, client_args)
        if small is not None:
            env.update(small_model_env(client, url, key, small))
        print(f"mlx-nursery launch: {client.title} on {served_model} at {url} "
              f"({context or 'unknown'} tokens of context)", file=sys.stderr)  # fmt: skip
        return subprocess.call(argv, env={**os.environ, **env})
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def split_client_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``launch``'s own flags, and the client's (after ``--``)."""
    argv = list(argv)
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1 :]
    return argv, []


def serve_flags(argv: Sequence[str], own: Mapping[str, bool]) -> list[str]:
    """``launch``'s flags less its own (``own``: flag -> takes a value), which
    ``serve`` would not know."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in own:
            skip = own[name] and "=" not in arg
            continue
        out.append(arg)
    return out
