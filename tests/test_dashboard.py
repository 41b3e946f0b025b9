"""The dashboard under load, in a real browser: Debian's headless Chromium (no
browser download at test time; `make test` installs the package) loads ``GET /``
while eight streams decode, and the page shows their rows, updates from the feed,
and logs nothing to the console. A screenshot is kept as a test artifact."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import httpx
import trio
from conftest import running_server

TIMEOUT = 180
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
EOS = 258  # the golden tokenizer's end token: suppressed, so rows run to max_tokens


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "Chromium is missing: `make test` installs Debian's chromium package"
    return found


async def browse(url: str, *flags: str) -> trio.CompletedProcess:
    argv = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
            "--v=0", "--virtual-time-budget=20000", *flags, url]  # fmt: skip
    return await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=True)


async def test_the_dashboard_shows_the_live_rows_and_updates_without_console_errors():
    with trio.fail_after(TIMEOUT):
        async with running_server(batch=8) as (url, _), trio.open_nursery() as nursery:

            async def agent(i: int) -> None:
                # rows long enough to outlive both page loads: a row that ends while the
                # page takes its snapshots leaves a gap until its agent's next request
                # is admitted, and the last snapshot may fall in it (CI saw 3 of 8)
                body = {"model": "llama", "prompt": f"Agent {i}, report:", "max_tokens": 4000,
                        "stream": True, "logit_bias": {str(EOS): -100}}  # fmt: skip
                headers = {"X-Request-Id": f"agent-{i}"}
                if i < 6:  # two agent trees of three, and two lone requests
                    headers["X-Session-Id"] = f"tree-{i % 2}"
                async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                    while True:
                        async with client.stream(
                            "POST", "/v1/completions", json=body, headers=headers
                        ) as r:
                            async for _ in r.aiter_lines():
                                pass

            for i in range(8):
                nursery.start_soon(agent, i)
            async with httpx.AsyncClient(base_url=url) as client:
                while (await client.get("/stats")).json()["decoding_rows"] < 6:  # noqa: ASYNC110
                    await trio.sleep(0.05)
                done = await browse(f"{url}/?frames=8", "--dump-dom")
                after = (await client.get("/stats")).json()  # the load still runs
                ARTIFACTS.mkdir(exist_ok=True)
                shot = ARTIFACTS / "dashboard.png"
                await browse(f"{url}/?frames=12", "--window-size=1280,1100",
                             f"--screenshot={shot}")  # fmt: skip
            nursery.cancel_scope.cancel()  # the agents hang up: their rows are cancelled

    dom = done.stdout.decode()
    assert 'data-done="1"' in dom, "the page took its snapshots"
    updates = int(re.search(r'data-updates="(\d+)"', dom).group(1))
    assert updates >= 8, "the page updated from the feed"
    rows = re.findall(r'<tr data-row="(\d+)"', dom)
    active = int(re.search(r'data-active="(\d+)"', dom).group(1))
    live = int(re.search(r'data-live="(\d+)"', dom).group(1))
    # live rows include queued ones; active_rows (a gauge, posted a moment later) not
    assert len(rows) == live, "one table row per live row of that snapshot"
    assert active >= 6 and after["active_rows"] >= 6, (active, after["active_rows"])
    assert "agent-" in dom, "rows show their client's request id"
    # rows are grouped under their session: each tree's head, then its rows
    assert set(re.findall(r'<tr class="session" data-session="([^"]+)"', dom)) == {
        "tree-0", "tree-1"
    }, "the two trees' rows are grouped under them"
    # the memory and disk tiers' figures are filled in (the disk tier is on by default)
    for card in ("pc-evicted", "pd-entries", "pd-hits", "pd-io"):
        shown = re.search(rf'id="{card}">([^<]*)<', dom).group(1)
        assert shown not in ("", "–", "off"), (card, shown)
    assert re.search(r'id="pd-bytes">[^<]+ / [^<]+<', dom)
    console = [line for line in done.stderr.decode().splitlines() if ":CONSOLE" in line
               or "Uncaught" in line]  # fmt: skip
    assert not console, console
    assert shot.stat().st_size > 20_000
