"""The HTTP front, tested the way users reach it: a real Hypercorn server on an
ephemeral loopback port, the official `openai` client (sync and async) and raw
httpx for SSE framing and every error case.

Guide: loopback only, port 0, an absolute `fail_after` on every I/O test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest
import trio
from conftest import golden, model_path, running_server, sse_events
from make_goldens import CHAT
from prometheus_client.parser import text_string_to_metric_families

FAMILY = "llama"
CASES = {c["prompt"]: c for c in golden(FAMILY)["serial"]}
NO_EOS = {"258": -100}  # keeps a random toy model talking for as long as a test needs
TIMEOUT = 60


async def stats(client: httpx.AsyncClient) -> dict:
    r = await client.get("/stats")
    assert r.status_code == 200
    return r.json()


async def until(client: httpx.AsyncClient, predicate) -> dict:
    """Poll /stats until ``predicate(stats)`` holds: from outside the server, over
    HTTP, polling is what a client can do (no event crosses the wire)."""
    while not predicate(s := await stats(client)):  # noqa: ASYNC110
        await trio.sleep(0.005)
    return s


async def test_openai_client_async_chat_and_completions():
    with trio.fail_after(TIMEOUT):
        async with running_server() as (url, _):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
            chat = await client.chat.completions.create(
                model=str(model_path(FAMILY)), messages=CHAT, max_tokens=40
            )
            assert chat.choices[0].message.content == CASES["chat"]["text"]
            assert chat.choices[0].finish_reason == CASES["chat"]["finish_reason"]
            assert chat.usage.prompt_tokens == len(CASES["chat"]["prompt_ids"])
            assert chat.usage.prompt_tokens_details.cached_tokens == 0

            text = []
            stream = await client.completions.create(
                model="llama",
                prompt=CASES["sentence"]["prompt_ids"],
                max_tokens=40,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage = None
            async with stream:
                async for chunk in stream:
                    if chunk.choices:
                        text.append(chunk.choices[0].text)
                    if chunk.usage:
                        usage = chunk.usage
            assert "".join(text) == CASES["sentence"]["text"]
            assert usage.completion_tokens == 40
            await client.close()


async def test_openai_client_sync_chat_stream_and_completion():
    def sync_calls(url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        deltas = []
        for chunk in client.chat.completions.create(
            model="llama", messages=CHAT, max_tokens=40, stream=True
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                deltas.append(chunk.choices[0].delta.content)
        completion = client.completions.create(
            model="llama", prompt=CASES["utf8"]["prompt_ids"], max_tokens=40, logprobs=3
        )
        models = client.models.list()
        client.close()
        return "".join(deltas), completion, models

    with trio.fail_after(TIMEOUT):
        async with running_server() as (url, _):
            chat_text, completion, models = await trio.to_thread.run_sync(sync_calls, url)
    assert chat_text == CASES["chat"]["text"]
    assert completion.choices[0].text == CASES["utf8"]["text"]
    lp = completion.choices[0].logprobs
    assert len(lp.token_logprobs) == 40
    # legacy completions key alternatives by token text: byte tokens of one partial
    # UTF-8 sequence all read "\ufffd", so they may collapse into one key
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert [m.id for m in models.data] == ["llama"]  # a short id, never a path


async def test_sse_framing_and_chat_logprobs():
    with trio.fail_after(TIMEOUT):
        async with running_server() as (url, _), httpx.AsyncClient(base_url=url) as client:
            body = {
                "messages": CHAT,
                "max_tokens": 10,
                "stream": True,
                "logprobs": True,
                "top_logprobs": 2,
                "stream_options": {"include_usage": True},
            }
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                events = await sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish[-1]["choices"][0]["finish_reason"] == "length"
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    assert sum(len(lp["content"]) for lp in lps if lp) == 10
    assert all(len(e["top_logprobs"]) == 2 for lp in lps if lp for e in lp["content"])


ERROR_CASES = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"prompt": "hi", "max_tokens": "many"}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "hi", "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "hi", "n": 17}).encode(), 400, "n"),
    (json.dumps({"prompt": "hi", "stop": 5}).encode(), 400, "stop"),
    (json.dumps({"prompt": "", "max_tokens": 4}).encode(), 400, "prompt"),
    (json.dumps({"prompt": [1, 99999]}).encode(), 400, "prompt"),
    (json.dumps({"prompt": [7] * 5000}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "hi", "max_tokens": 5000}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "hi", "model": "gpt-17"}).encode(), 404, "model"),
    (json.dumps({"prompt": "x" * 70_000}).encode(), 413, None),
]


async def test_every_error_is_an_openai_error_and_the_server_stays_up():
    with trio.fail_after(TIMEOUT):
        async with running_server(max_request_bytes=64 * 1024) as (url, _):
            async with httpx.AsyncClient(base_url=url) as client:
                for raw, status, param in ERROR_CASES:
                    for stream in (False, True):
                        data = raw
                        if stream and raw.startswith(b'{"'):
                            data = json.dumps({**json.loads(raw), "stream": True}).encode()
                        r = await client.post(
                            "/v1/completions",
                            content=data,
                            headers={"content-type": "application/json"},
                        )
                        assert r.status_code == status, (raw[:60], r.text)
                        assert r.headers["content-type"].startswith("application/json")
                        err = r.json()["error"]
                        assert set(err) == {"message", "type", "param", "code"}
                        assert err["param"] == param, (raw[:60], err)
                        assert err["message"]
                r = await client.post("/v1/completions", json={"prompt": [7] * 5000})
                assert "prompt is 5,000 tokens; this model's context is 4,096" in r.text
                r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5000})
                assert "lower max_tokens to at most 4,094" in r.text
                assert (await client.get("/health")).status_code == 200
                s = await stats(client)
                assert s["submitted"] == 0 and s["active_rows"] == 0


async def test_health_answers_before_the_app_with_the_same_cors_and_error_shape():
    """/health is answered in front of the routed app (it stays fast under load):
    the same JSON, the same CORS headers as a routed answer, HEAD and OPTIONS as
    Quart answers them, a 405 in the API's shape for any other method."""
    with trio.fail_after(TIMEOUT):
        async with running_server(allowed_origins=("http://agents.local",)) as (url, _):
            async with httpx.AsyncClient(base_url=url) as client:
                origin = {"Origin": "http://agents.local"}
                r = await client.get("/health", headers=origin)
                assert (r.status_code, r.json()) == (200, {"status": "ok"})
                assert r.headers["content-type"] == "application/json"
                routed = await client.get("/v1/models", headers=origin)
                for name in ("allow-origin", "allow-headers", "allow-methods"):
                    key = f"access-control-{name}"
                    assert r.headers[key] == routed.headers[key]
                r = await client.get("/health", headers={"Origin": "http://elsewhere"})
                assert "access-control-allow-origin" not in r.headers
                r = await client.head("/health")
                assert (r.status_code, r.content, r.headers["content-length"]) == (200, b"", "16")
                r = await client.options("/health", headers=origin)
                assert (r.status_code, r.headers["allow"]) == (200, "GET, HEAD, OPTIONS")
                assert r.headers["access-control-allow-origin"] == "http://agents.local"
                r = await client.post("/health", json={})
                assert (r.status_code, r.headers["allow"]) == (405, "GET, HEAD, OPTIONS")
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert "use GET" in err["message"]


async def test_a_request_beyond_the_kv_budget_is_a_400_and_the_server_stays_up():
    with trio.fail_after(TIMEOUT):
        async with running_server(kv_budget=256 * 512 * 2) as (url, _):
            async with httpx.AsyncClient(base_url=url) as client:
                body = {"prompt": CASES["long"]["prompt_ids"], "max_tokens": 300}
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 400
                err = r.json()["error"]
                assert (
                    err["param"] == "max_tokens" and "KV budget is 262,144 bytes" in err["message"]
                )
                r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
                assert r.status_code == 200
                s = await stats(client)
                assert s["kv_budget_bytes"] == 262_144 and s["rejected"] == 1
                metrics = (await client.get("/metrics")).text
                assert "mlx_nursery_kv_budget_bytes 262144" in metrics
                assert "mlx_nursery_prompt_cache_hits_total" in metrics


async def test_eight_concurrent_streams_batch_and_match_solo_runs():
    prompts = [c["prompt_ids"] for c in CASES.values()]
    prompts = [prompts[i % len(prompts)] + [65 + i] for i in range(8)]
    params = {"max_tokens": 120, "logit_bias": NO_EOS}
    with trio.fail_after(TIMEOUT):
        async with running_server() as (url, _), httpx.AsyncClient(base_url=url) as client:
            solo = []
            for p in prompts:
                r = await client.post("/v1/completions", json={"prompt": p, **params})
                solo.append(r.json()["choices"][0]["text"])
            texts = [None] * 8
            seen = []
            health, metrics = [], []

            async def stream(i):
                body = {"prompt": prompts[i], "stream": True, **params}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    events = await sse_events(r)
                texts[i] = "".join(e["choices"][0]["text"] for e in events[:-1])

            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(stream, i)
                while None in texts:
                    s = await stats(client)
                    seen.append(s["decoding_rows"])
                    h = await client.get("/health")
                    health.append(h.status_code)
                    m = await client.get("/metrics")
                    metrics.append(m.text)
                    await trio.sleep(0.005)
    assert texts == solo
    assert max(seen) >= 4, seen  # the streams decoded together
    assert set(health) == {200}
    families = {f.name for f in text_string_to_metric_families(metrics[len(metrics) // 2])}
    assert "mlx_nursery_time_to_first_token_seconds" in families
    assert "mlx_nursery_requests_submitted" in families  # counters drop _total in the parser


async def test_a_client_that_drops_mid_stream_frees_its_row_and_others_finish():
    base = CASES["sentence"]["prompt_ids"]
    params = {"max_tokens": 150, "logit_bias": NO_EOS}
    with trio.fail_after(TIMEOUT):
        async with running_server() as (url, _), httpx.AsyncClient(base_url=url) as client:
            solo = (await client.post("/v1/completions", json={"prompt": base, **params})).json()
            results = {}

            async def full(i):
                body = {"prompt": base, "stream": True, **params}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    events = await sse_events(r)
                results[i] = "".join(e["choices"][0]["text"] for e in events[:-1])

            async def dropper():
                body = {"prompt": base, "stream": True, **params}
                async with httpx.AsyncClient(base_url=url) as own:
                    async with own.stream("POST", "/v1/completions", json=body) as r:
                        n = 0
                        async for _ in r.aiter_bytes():
                            n += 1
                            if n >= 3:
                                break  # leaving closes the connection

            async with trio.open_nursery() as nursery:
                nursery.start_soon(full, 0)
                nursery.start_soon(dropper)
                nursery.start_soon(full, 1)
            s = await until(client, lambda s: not s["active_rows"] and not s["kv_bytes"])
            assert s["cancelled"] == 1
    assert results == {0: solo["choices"][0]["text"], 1: solo["choices"][0]["text"]}


async def test_disconnects_cancel_queued_and_non_streaming_requests():
    base = CASES["chat"]["prompt_ids"]
    long = {"prompt": base, "max_tokens": 3000, "logit_bias": NO_EOS}
    with trio.fail_after(TIMEOUT):
        async with running_server(batch=1) as (url, _), httpx.AsyncClient(base_url=url) as client:

            async def request(scope_box):
                with trio.CancelScope() as scope:
                    scope_box.append(scope)
                    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as own:
                        await own.post("/v1/completions", json=long)

            running, queued = [], []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(request, running)  # non-streaming, decoding
                await until(client, lambda s: s["active_rows"] >= 1 and s["kv_bytes"] > 0)
                nursery.start_soon(request, queued)  # waits: batch=1 runs one at a time
                await until(client, lambda s: s["pending_rows"] >= 1)
                queued[0].cancel()  # the queued client goes away
                s = await until(client, lambda s: s["cancelled"] >= 1 and not s["pending_rows"])
                assert s["active_rows"] == 1  # the running one is untouched
                running[0].cancel()  # and so does the one decoding
                s = await until(client, lambda s: s["cancelled"] >= 2)
            s = await until(client, lambda s: not s["active_rows"] and not s["kv_bytes"])
            assert s["finished"] == 0


async def test_shutdown_ends_streams_in_flight_with_an_error_event_and_done():
    with trio.fail_after(TIMEOUT):
        async with running_server(drain_seconds=0.05) as (url, state):
            async with httpx.AsyncClient(base_url=url) as client:
                body = {"prompt": "hi", "stream": True, "max_tokens": 3000, "logit_bias": NO_EOS}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    chunks = r.aiter_bytes()
                    received = [await chunks.__anext__()]  # it is decoding: shut down now
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(state.drain, 0.05)
                        received += [chunk async for chunk in chunks]
                h = await client.get("/health")
    rest = b"".join(received)
    assert rest.endswith(b"data: [DONE]\n\n")
    assert b'"error"' in rest and b"shutting down" in rest
    assert h.status_code == 503 and h.json()["status"] == "draining"


def test_cli_serves_and_stops_on_sigterm(tmp_path):
    with socket_port() as port:
        env = dict(os.environ, MLX_NURSERY_OPENBLAS="0")
        exe = os.path.join(os.path.dirname(sys.executable), "mlx-nursery")
        proc = subprocess.Popen(
            [exe, "serve", "--port", str(port), "--batch", "2"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            for _ in range(300):
                try:
                    r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                    if r.status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                trio.run(trio.sleep, 0.1)
            else:
                pytest.fail("the server did not come up")
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"prompt": "Hi", "max_tokens": 5},
                timeout=30,
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode == 0, out.decode()
    assert b"shutting down" in out


def test_cli_help_documents_every_flag():
    exe = os.path.join(os.path.dirname(sys.executable), "mlx-nursery")
    out = subprocess.run([exe, "serve", "--help"], capture_output=True, text=True, check=True)
    for flag in (
        "--model", "--host", "--port", "--batch", "--decode-concurrency", "--prefill-step-size",
        "--max-tokens", "--temp", "--top-p", "--top-k", "--min-p", "--chat-template",
        "--chat-template-args", "--dtype", "--allowed-origins", "--log-level",
    ):  # fmt: skip
        assert flag in out.stdout, flag


class socket_port:
    """A free loopback port (bound and released; good enough for one test)."""

    def __enter__(self) -> int:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        return port

    def __exit__(self, *exc) -> None:
        return None


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_plain_text_frame_is_the_chunk_it_stands_for(kind):
    """The pre-encoded fast path writes the same JSON the full chunk would."""
    from mlx_nursery.actors import Event, FinishReason
    from mlx_nursery.server.api.base import sse_frame
    from mlx_nursery.server.api.chat import ChatShaper, parse_chat
    from mlx_nursery.server.api.completions import CompletionShaper, parse_completion

    if kind == "chat":
        parsed, shaper = parse_chat({"messages": [{"role": "user", "content": "hi"}]}), ChatShaper
    else:
        parsed, shaper = parse_completion({"prompt": "hi"}), CompletionShaper
    fast, full = shaper(parsed, 'm"odel', None), shaper(parsed, 'm"odel', None)
    full.id, full.created = fast.id, fast.created
    first = Event(1, "Hi")
    assert not fast.plain(first) or kind == "completion"
    fast.sent_role = full.sent_role = True
    for text in ("Hi", ' "quoted" \\ ', "Grüße 東京 🌸", "\n\t\x01"):
        event = Event(2, text)
        assert fast.plain(event)
        frame = fast.text_frame(text)
        assert frame == sse_frame(full.chunk(event))
        assert json.loads(frame.removeprefix(b"data: "))["id"] == full.id
    assert fast.offset == full.offset
    assert not fast.plain(Event(3, "x", logprob=-0.5))
    assert not fast.plain(Event(None, "", finish_reason=FinishReason.STOP))


async def test_control_tokens_are_left_out_of_the_text_unless_asked_for():
    """The golden llama's 'long' answer holds its tokenizer's ``<|endoftext|>``
    mid-text (mlx-lm's own text has it): a client reads the text without it,
    streamed and not, unless it sends ``skip_special_tokens: false`` (vLLM's
    field); the tokens are the same either way."""
    case = CASES["long"]
    assert "<|endoftext|>" in case["text"]
    plain = case["text"].replace("<|endoftext|>", "")
    body = {"model": "llama", "prompt": case["prompt_ids"], "max_tokens": case["max_tokens"]}
    with trio.fail_after(TIMEOUT):
        async with running_server() as (url, _), httpx.AsyncClient(base_url=url) as client:
            for extra, want in (({}, plain), ({"skip_special_tokens": False}, case["text"])):
                r = await client.post("/v1/completions", json={**body, **extra})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == want, extra
                r = await client.post("/v1/completions", json={**body, **extra, "stream": True})
                events = await sse_events(r)
                assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want, extra
            r = await client.post("/v1/completions", json={**body, "skip_special_tokens": "no"})
            assert r.status_code == 400 and "skip_special_tokens" in r.text, r.text


def test_a_control_token_split_across_pieces_is_held_then_left_out():
    from mlx_nursery.actors.emitter import SpecialText

    text = SpecialText.of(("<|im_start|>", "<|endoftext|>"))
    pieces = ["Hi <", "|endof", "text|> there <|", "im_start|><", "b>"]
    out = [text.feed(p) for p in pieces]
    assert out == ["Hi ", "", " there ", "", "<b>"], out
    assert "".join(out) + text.feed("", final=True) == "Hi  there <b>"
    held = SpecialText.of(("<|im_start|>",))
    assert held.feed("a <|im") == "a " and held.feed("", final=True) == "<|im"
