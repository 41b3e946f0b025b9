"""Secure defaults on a person's own machine: no CORS grant to a foreign origin,
no answer to a foreign Host (DNS rebinding), no keyless network exposure by
accident; and a real browser cannot read a completion from another origin.
Loopback only."""

from __future__ import annotations

import subprocess
import sys
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from conftest import free_port, running_server, server_process
from test_dashboard import browse

TIMEOUT = 120
CHAT = {"model": "llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
EVIL = "http://evil.example"
TOY = str(Path(__file__).resolve().parent.parent / "goldens" / "models" / "llama")


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_a_foreign_origin_gets_no_cors_grant_and_the_servers_own_does():
    with trio.fail_after(TIMEOUT):
        async with running_server() as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                preflight = {"Origin": EVIL, "Access-Control-Request-Method": "POST",
                             "Access-Control-Request-Headers": "content-type"}  # fmt: skip
                r = await client.options("/v1/chat/completions", headers=preflight)
                assert not [h for h in r.headers if h.startswith("access-control-")], r.headers
                r = await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": EVIL})
                assert "access-control-allow-origin" not in r.headers
                for own in (url, url.replace("127.0.0.1", "localhost")):
                    host = own.removeprefix("http://")
                    r = await client.post(
                        "/v1/chat/completions", json=CHAT, headers={"Origin": own, "Host": host}
                    )
                    assert r.headers["access-control-allow-origin"] == own
        async with running_server(allowed_origins=("*",)) as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                r = await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": EVIL})
                assert r.headers["access-control-allow-origin"] == "*"


ROUTES = [
    ("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
    ("POST", "/v1/messages"), ("GET", "/stats"), ("GET", "/metrics"), ("GET", "/"),
]  # fmt: skip


async def test_a_foreign_host_is_refused_on_every_route():
    with trio.fail_after(TIMEOUT):
        async with running_server() as (url, _):
            port = port_of(url)
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                for method, path in ROUTES:
                    body = {**CHAT, "max_tokens": 4} if method == "POST" else None
                    r = await client.request(
                        method, path, json=body, headers={"Host": f"evil.example:{port}"}
                    )
                    assert r.status_code == 403, (path, r.status_code)
                    error = r.json()["error"]
                    message = error["message"] if isinstance(error, dict) else error
                    assert "--allowed-hosts" in str(message), r.text
                for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
                    r = await client.get("/v1/models", headers={"Host": host})
                    assert r.status_code == 200, host
        async with running_server(allowed_hosts=("box.lan",)) as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                r = await client.get("/health", headers={"Host": f"box.lan:{port_of(url)}"})
                assert r.status_code == 200
                r = await client.get("/health", headers={"Host": "evil.example"})
                assert r.status_code == 403


def serve_cli(*flags: str) -> subprocess.CompletedProcess:
    """`mlx-nursery serve` as a user runs it (it exits at once on a usage error)."""
    argv = [sys.executable, "-m", "mlx_nursery.server.cli", "serve", "--model", TOY, *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "MLX_NURSERY_OPENBLAS": "0"})  # fmt: skip


def test_a_network_address_without_a_key_is_a_usage_error():
    done = serve_cli("--host", "0.0.0.0", "--port", "0")
    assert done.returncode == 2 and "--api-key" in done.stderr and "--no-api-key" in done.stderr


@pytest.mark.parametrize("flag", [("--api-key", "k"), ("--no-api-key",)])
async def test_a_network_address_with_a_key_or_no_api_key_starts(flag):
    with trio.fail_after(TIMEOUT):
        async with server_process("--model", TOY, "--host", "0.0.0.0", *flag) as (url, _):
            async with httpx.AsyncClient(base_url=url) as client:
                assert (await client.get("/health")).status_code == 200


def test_the_start_log_says_who_can_reach_the_server():
    from mlx_nursery.server.access import reach
    from mlx_nursery.server.settings import Settings

    assert reach(Settings(model="m")).startswith("this machine only (loopback)")
    keyless = reach(Settings(model="m", host="0.0.0.0", no_api_key=True))
    assert "the network through 0.0.0.0, WITHOUT an API key" in keyless
    assert "any web page" in reach(Settings(model="m", allowed_origins=("*",)))


PAGE = """<!doctype html><html><body data-result="pending"><script>
fetch("%s/v1/chat/completions", {method: "POST", headers: {"content-type": "application/json"},
  body: JSON.stringify({messages: [{role: "user", content: "Hi"}], max_tokens: 4})})
  .then(r => r.text()).then(t => { document.body.dataset.result = "read " + t.length; })
  .catch(e => { document.body.dataset.result = "blocked"; });
</script></body></html>"""


async def test_a_page_from_another_origin_cannot_read_a_completion(tmp_path):
    """Headless Chromium opens a page served from another loopback port: by
    default its fetch is blocked; with that origin allowed it reads the answer."""
    page_port = free_port()
    page_origin = f"http://127.0.0.1:{page_port}"
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            argv = [sys.executable, "-m", "http.server", str(page_port), "--bind", "127.0.0.1",
                    "--directory", str(tmp_path)]  # fmt: skip
            quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
            pages = await nursery.start(partial(trio.run_process, argv, check=False, **quiet))
            results = []
            for allowed in ((), (page_origin,)):
                async with running_server(allowed_origins=allowed) as (url, _):
                    (tmp_path / "page.html").write_text(PAGE % url)
                    done = await browse(f"{page_origin}/page.html", "--dump-dom")
                    results.append(done.stdout.decode())
            pages.terminate()
    assert 'data-result="blocked"' in results[0], results[0]
    assert 'data-result="read ' in results[1], results[1]
