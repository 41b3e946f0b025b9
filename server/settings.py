"""The server's settings: the engine's, whole, plus the HTTP front's own.

Declared once each (``actors.settings.setting``): the CLI's flags are built
from these declarations and from :class:`EngineSettings`', defaults included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
from mlx_nursery.actors import EngineSettings
from mlx_nursery.actors.budget import parse_budget
from mlx_nursery.actors.settings import _on_off, setting

API_KEY_ENV = "MLX_NURSERY_API_KEY"


def _names(text: str) -> tuple[str, ...]:
    return tuple(o.strip() for o in text.split(",") if o.strip())


@attrs.frozen
class Settings:
    model: Any = setting(
        help="a model directory, hub id or GGUF file; or a (model, tokenizer) pair", cli=False
    )
    model_name: str | None = setting(
        None, cli=False, help="the default model's public name (NAME in --model NAME=MODEL)"
    )
    # Several models (docs/models.md): the others, by name, loaded on first request.
    models: tuple[tuple[str, Any], ...] = setting(
        (), cli=False, help="(name, model) pairs served beside the default model"
    )
    aliases: dict[str, str] = setting(
        factory=dict, cli=False, help="a client's model name (or glob) -> a served model's name"
    )
    keep_alive: dict[str, float | None] = setting(
        factory=dict, cli=False,
        help="seconds a model stays loaded idle, by name ('' for every model but the "
        "default); None pins it",
    )  # fmt: skip
    memory_budget: int | str | None = setting(
        "auto", converter=parse_budget, parse=str,
        help="bytes the loaded models' weights, KV budgets and workspace share (e.g. 12G); "
        "auto is device memory less 20%% headroom, none is no bound; loading a model that "
        "does not fit first unloads the least recently used idle one",
    )  # fmt: skip
    model_wait: float = setting(
        60.0, help="seconds a request waits for its model to load (or for memory to be "
        "freed) before a 429 with Retry-After",
    )  # fmt: skip
    engine: EngineSettings = setting(
        factory=lambda: EngineSettings(dtype="auto"), help="the engine's settings", cli=False
    )
    host: str = setting("127.0.0.1", help="address to bind")
    port: int = setting(8080, help="port to bind; 0 picks one")
    # Browsers: CORS grants beyond the server's own origin (see access.py).
    allowed_origins: tuple[str, ...] = setting(
        (), parse=_names, shown="the server's own only",
        help="comma-separated origins whose web pages may use the server (CORS), or * for any",
    )  # fmt: skip
    # DNS rebinding: Host names answered beyond the loopback ones and the bound address.
    allowed_hosts: tuple[str, ...] = setting(
        (), parse=_names, shown="loopback names and the bound address",
        help="comma-separated Host names to answer besides those, or * for any",
    )  # fmt: skip
    max_request_bytes: int = setting(16 * 1024 * 1024, cli=False, help="a larger body is a 413")
    image_urls: bool = setting(
        False, help="fetch the images a request names by http(s) URL (off: such a request "
        "is refused, as a server on a person's machine should not fetch what a request "
        "points it at; inline data: images are always read)",
    )  # fmt: skip
    drain_seconds: float = setting(
        30.0, cli=False, help="in-flight requests get this long at shutdown"
    )
    # Access: with a key, every /v1 route needs `Authorization: Bearer KEY` (or
    # `x-api-key: KEY`); /stats and /metrics too when protect_stats is set.
    api_key: str | None = setting(
        None, repr=False, parse=str, shown=f"${API_KEY_ENV} if set, else no key",
        help="require this key on every /v1 route (Authorization: Bearer, or x-api-key)",
    )  # fmt: skip
    protect_stats: bool = setting(False, help="require the API key on /stats and /metrics too")
    no_api_key: bool = setting(
        False, help="serve a non-loopback --host without an API key, on purpose"
    )
    # Connection limits (Hypercorn's, and the body read), so a slow or half-sent
    # request cannot hold the server.
    keep_alive_timeout: float = setting(75.0, help="seconds an idle keep-alive connection is kept")
    max_header_bytes: int = setting(16 * 1024, help="most bytes of request line and headers")
    body_timeout: float = setting(
        30.0, help="seconds for a request body to arrive, else 408"
    )
    prompt_as_sent: bool = setting(
        False, help="render Claude Code's Messages requests as sent: by default its "
        "attribution block (x-anthropic-billing-header: ..., which hashes the first user "
        "message) is dropped and the system turns before the first answer join the system "
        "prompt, so every conversation and sub-agent of a client shares the prompt cache",
    )  # fmt: skip
    request_log: Path | None = setting(
        None, parse=Path, shown="none",
        help="append one JSON line per finished request to FILE: timings and prompt-cache "
        "figures, no prompt text",
    )  # fmt: skip
    # One replica of a set (--replicas): requests its front tunnels through the
    # router's Messages route are taken as sent (``app.Tunnel``).
    replica: bool = setting(
        False, help="serve as one replica of a set behind its front and router "
        "(--replicas starts them so; see docs/scale-out.md)",
    )  # fmt: skip
    # Sharded (under mlx.launch): the mx.distributed group; this process is rank 0.
    group: Any = setting(None, cli=False, help="the mx.distributed group (rank 0)")
    # The process is the server's own (the CLI): its startup heap is frozen out of
    # the GC once the model is loaded (``state.freeze_startup_heap``).
    own_process: bool = setting(False, cli=False, help="the process is the server's own")
    # Several models (docs/models.md, "A process a model"): the others each in a
    # child server of their own, on loopback, proxied; one device lock file.
    model_processes: bool = setting(
        True, parse=_on_off, shown="on",
        help="serve each model but the default from a process of its own, behind this "
        "server: its load (the tokenizers' seconds under Python's GIL) stays out of the "
        "other models' process and yields to their decoding; off: one process",
    )  # fmt: skip
    device_lock: Path | None = setting(
        None, cli=False, help="the lock file the processes of one server's models share"
    )
