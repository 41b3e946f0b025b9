"""Images for vision models (docs/vision.md): the tiny Gemma 3 vision model
(goldens/make_vision_model.py) against mlx-vlm's own ``generate``, alone and in
the batch beside text rows and other image rows; the prompt cache keying an
image by its content; the bad inputs."""

from __future__ import annotations

import base64
import contextlib
import functools
import http.server
import io
import threading

import httpx
import numpy as np
import pytest
import trio
from conftest import checked_engine, generate_to_eos, model_path, running_server, sse_chunks
from mlx_nursery.actors import InvalidRequest
from mlx_nursery.actors.models.vision import IMAGE_BASE
from mlx_nursery.actors.request import CacheTier

VISION = model_path("gemma3_vision")
TOKENS = 12
MODEL = "gemma3_vision"  # its name on the server: the folder's
QUESTIONS = ["What is this?", "Describe the picture in detail please", "Which colours?"]


def png(seed: int, size: tuple[int, int] = (40, 50)) -> bytes:
    """A seeded noise image, PNG-encoded."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def asking(text: str, *images: bytes) -> list[dict]:
    parts = [{"type": "image", "image": data} for data in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@functools.cache
def _vlm():
    import mlx_vlm

    return mlx_vlm.load(str(VISION))


@functools.cache
def oracle(text: str, *images: bytes) -> list[int]:
    """mlx-vlm's own greedy ``generate`` for a user turn of ``images`` then ``text``."""
    from mlx_vlm import generate
    from mlx_vlm.utils import load_image

    model, processor = _vlm()
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    out = generate(model, processor, prompt, image=[load_image(io.BytesIO(d)) for d in images],
                   max_tokens=TOKENS, temperature=0.0, verbose=False)  # fmt: skip
    return list(out.token_ids)


@functools.cache
def text_oracle(text: str) -> list[int]:
    from mlx_lm import load

    model, tokenizer = load(str(VISION))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True)  # fmt: skip
    return generate_to_eos(model, tokenizer, ids, max_tokens=TOKENS)


async def test_an_image_row_reads_as_mlx_vlm_generates_it_alone():
    cases = [(q, png(i)) for i, q in enumerate(QUESTIONS)]
    expected = [oracle(q, image) for q, image in cases]
    assert len({tuple(e) for e in expected}) > 1  # the images reach the tokens
    async with checked_engine(VISION, batch=1) as engine:
        for (q, image), want in zip(cases, expected, strict=True):
            result = await engine.generate(asking(q, image), max_tokens=TOKENS, logit_bias={})
            assert result.tokens == want, q


@pytest.mark.parametrize("step", [7, 32, 2048])
async def test_image_rows_and_text_rows_decode_together_as_alone(step):
    """Image rows and text rows joining one batch at once and one after another
    (over retired slots too): each reads what it reads alone, whatever the prefill
    chunk (an image split across chunks at 7)."""
    images = [png(10 + i) for i in range(3)]
    jobs = [("image", QUESTIONS[i], images[i]) for i in range(3)]
    jobs += [("text", "Hello there, how are you?", None), ("text", "Count to ten", None)]
    jobs += [("image", "Two pictures: what differs?", (images[0], images[1]))]
    want = []
    for kind, q, image in jobs:
        shown = image if isinstance(image, tuple) else (image,)
        want.append(oracle(q, *shown) if kind == "image" else text_oracle(q))
    async with checked_engine(VISION, batch=3, prefill_step_size=step) as engine:
        got: dict[int, list[int]] = {}

        async def run(i: int, delay: float) -> None:
            kind, q, image = jobs[i]
            await trio.sleep(delay)
            shown = image if isinstance(image, tuple) else (image,)
            prompt = asking(q, *shown) if kind == "image" else [{"role": "user", "content": q}]
            got[i] = (await engine.generate(prompt, max_tokens=TOKENS)).tokens

        async with trio.open_nursery() as nursery:
            for i in range(len(jobs)):
                nursery.start_soon(run, i, 0.0 if i < 4 else 0.05 * i)
    assert [got[i] for i in range(len(jobs))] == want


async def test_the_cache_keys_an_image_by_what_it_shows():
    """Two screenshots with the same text around them share the text before them
    and nothing of the image; a conversation's next turn finds its screenshot in
    the cache, and the image is not encoded again. (Gemma 3's sliding-window
    layers cannot be cut back: an entry serves a prompt it is a prefix of, as a
    conversation's next turn is.)"""
    first, second = png(21), png(22)
    system = {"role": "system", "content": "You look at screenshots. " * 4}
    turn = [system, *asking("What is this?", first)]
    async with checked_engine(VISION, batch=2) as engine:
        vision = engine.intake.vision
        a = await engine.generate(turn, max_tokens=4, logit_bias={ord("a"): 100})
        assert a.text == "aaaa" and vision.encoded == 1
        ids = engine.intake.prompt([system, *asking("What is this?", second)], {})[1]
        image_at = next(i for i, t in enumerate(ids) if t >= IMAGE_BASE)
        b = await engine.generate([system, *asking("What is this?", second)], max_tokens=4)
        assert b.usage.cached_tokens <= image_at and vision.encoded == 2
        later = [*turn, {"role": "assistant", "content": a.text},
                 {"role": "user", "content": "And now?"}]  # fmt: skip
        again = await engine.generate(later, max_tokens=4)
        assert again.usage.cached_tokens >= a.usage.prompt_tokens + 4
        assert vision.encoded == 2  # its KV found: the image is not looked at again
        same = await engine.generate([system, *asking("Which colours?", first)], max_tokens=4)
        assert same.usage.cached_tokens <= image_at  # a new turn after it: its snapshot
        assert vision.encoded == 2 and vision.hits == 1  # its embeddings were kept


@pytest.mark.parametrize(
    ("images", "says"),
    [
        ([b"not an image at all"], "could not be decoded"),
        ([png(1)] * 17, "over the limit of 16"),
    ],
)
async def test_a_bad_image_is_refused_saying_what_to_change(images, says):
    async with checked_engine(VISION, batch=2) as engine:
        with pytest.raises(InvalidRequest, match=says):
            await engine.generate(asking("What is this?", *images), max_tokens=2)
        ok = await engine.generate(asking("What is this?", png(1)), max_tokens=2)
        assert len(ok.tokens) == 2


async def test_an_image_outside_a_user_turn_or_tool_result_is_refused():
    said = {"role": "assistant", "content": [{"type": "image", "image": png(1)}]}
    async with checked_engine(VISION, batch=2) as engine:
        with pytest.raises(InvalidRequest, match="images go in user turns or tool results"):
            await engine.generate([*asking("Hi"), said, *asking("And?")], max_tokens=2)


async def test_an_image_for_a_text_model_is_refused():
    async with checked_engine(model_path("llama"), batch=2) as engine:
        with pytest.raises(InvalidRequest, match="takes no images"):
            await engine.generate(asking("What is this?", png(1)), max_tokens=2)


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


async def _three_apis(url: str, image: bytes, stream: bool) -> list[str]:
    """One question about ``image`` through chat (``image_url``), Responses
    (``input_image``) and Messages (an image block): each answer's text (chat's
    and Messages' streamed where ``stream``)."""
    import anthropic
    import openai

    async with (
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused") as oa,
        anthropic.AsyncAnthropic(base_url=url, api_key="unused") as an,
    ):
        return await _asked(oa, an, image, stream)


async def _asked(oa, an, image: bytes, stream: bool) -> list[str]:
    q, n = "What is this?", 6
    texts = []
    shown = {"type": "image_url", "image_url": {"url": data_url(image)}}
    chat = [{"role": "user", "content": [shown, {"type": "text", "text": q}]}]
    shown = {"type": "input_image", "image_url": data_url(image)}
    responses = [{"role": "user", "content": [shown, {"type": "input_text", "text": q}]}]
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(image).decode()}}  # fmt: skip
    messages = [{"role": "user", "content": [block, {"type": "text", "text": q}]}]
    if not stream:
        r = await oa.chat.completions.create(model=MODEL, messages=chat, max_tokens=n,
                                             temperature=0)  # fmt: skip
        texts.append(r.choices[0].message.content)
        r = await oa.responses.create(model=MODEL, input=responses, max_output_tokens=n,
                                      temperature=0)  # fmt: skip
        texts.append(r.output_text)
        r = await an.messages.create(model=MODEL, messages=messages, max_tokens=n,
                                     extra_body={"temperature": 0})  # fmt: skip
        texts.append(r.content[0].text)
        return texts
    parts = []
    async for chunk in await oa.chat.completions.create(model=MODEL, messages=chat, max_tokens=n,
                                                        temperature=0, stream=True):  # fmt: skip
        parts += [c.delta.content or "" for c in chunk.choices]
    texts.append("".join(parts))
    async with an.messages.stream(model=MODEL, messages=messages, max_tokens=n,
                                  extra_body={"temperature": 0}) as s:  # fmt: skip
        texts.append(await s.get_final_text())
    return texts


async def test_an_image_reaches_the_model_through_all_three_apis():
    """The same screenshot through chat, Responses and Messages (streamed and not)
    reads the same answer; another screenshot reads another."""
    async with running_server(VISION, batch=2) as (url, _):
        one = await _three_apis(url, png(31), stream=False)
        one += await _three_apis(url, png(31), stream=True)
        other = await _three_apis(url, png(32), stream=False)
    assert len(set(one)) == 1, one
    assert set(other) != set(one)


async def test_a_tool_result_carries_its_image_to_the_model():
    """A PNG that a tool returned (Messages ``tool_result``, Responses
    ``function_call_output``) reaches the model as an image, not as words."""
    image = base64.b64encode(png(41)).decode()
    call = {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a.png"}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": image}}]}
    body = {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "Read a.png"}, {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]}]}  # fmt: skip
    async with running_server(VISION, batch=2) as (url, state):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            r = await client.post("/v1/messages", json=body)
            assert r.status_code == 200, r.text
            shown = {"type": "input_image", "image_url": f"data:image/png;base64,{image}"}
            out = [{"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{}"},
                   {"type": "function_call_output", "call_id": "c1",
                    "output": [shown]}]  # fmt: skip
            r2 = await client.post("/v1/responses", json={
                "model": MODEL, "max_output_tokens": 4,
                "input": [{"role": "user", "content": "Read a.png"}, *out]})  # fmt: skip
            assert r2.status_code == 200, r2.text
            stats = (await client.get("/stats")).json()
            metrics = (await client.get("/metrics")).text
        (slot,) = state.pool.loaded()
        assert slot.engine.intake.vision.encoded == 1  # one image, found by content the 2nd time
        images = stats["images"]
        assert images["family"] == "gemma3" and images["encoded"] == 1
        assert images["hits"] == 1 and images["encode_seconds"] > 0
        assert "mlx_nursery_images_encoded_total 1.0" in metrics
        assert "mlx_nursery_image_cache_hits_total 1.0" in metrics


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
         "remote image URLs are not fetched"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}],
         "not valid base64"),
        ([{"type": "image_url", "image_url": {"url": data_url(b"GIF89a broken")}}],
         "could not be decoded"),
        ([{"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}],
         "is not an image"),
        ([{"type": "input_audio", "input_audio": {}}], "not supported"),
    ],
)
async def test_bad_images_over_http_are_400s_and_the_batch_runs_on(content, says):
    long = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story"}],
            "max_tokens": 40, "stream": True}  # fmt: skip
    async with running_server(VISION, batch=2) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async with client.stream("POST", "/v1/chat/completions", json=long) as running:
                assert running.status_code == 200
                r = await client.post("/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 4,
                    "messages": [{"role": "user", "content": content}]})  # fmt: skip
                assert r.status_code == 400, r.text
                assert says in r.json()["error"]["message"]
                assert r.json()["error"]["param"] == "messages"
                chunks = [c async for c in sse_chunks(running)]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@contextlib.contextmanager
def files_served(folder):
    """``folder`` over HTTP on a loopback port (a thread): the base URL."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


async def test_image_urls_are_fetched_only_when_the_server_is_told_to(tmp_path):
    """A remote image URL is a 400 by default; with ``--image-urls`` the image is
    fetched and read as if it were sent inline (the same answer), and a URL that
    is not an image, or not there, is a 400 that names it."""
    (tmp_path / "shot.png").write_bytes(png(61))
    (tmp_path / "notes.txt").write_text("not an image")

    def asked(url: str) -> dict:
        return {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [{
            "role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": "What is this?"}]}]}  # fmt: skip

    with files_served(tmp_path) as base:
        async with running_server(VISION, batch=2) as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                refused = await client.post("/v1/chat/completions", json=asked(f"{base}/shot.png"))
                inline = await client.post("/v1/chat/completions",
                                           json=asked(data_url(png(61))))  # fmt: skip
        assert refused.status_code == 400 and "--image-urls" in refused.json()["error"]["message"]
        async with running_server(VISION, batch=2, image_urls=True) as (url, _):
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                fetched = await client.post("/v1/chat/completions", json=asked(f"{base}/shot.png"))
                text = await client.post("/v1/chat/completions", json=asked(f"{base}/notes.txt"))
                gone = await client.post("/v1/chat/completions", json=asked(f"{base}/gone.png"))
    assert fetched.status_code == 200, fetched.text
    content = fetched.json()["choices"][0]["message"]["content"]
    assert content == inline.json()["choices"][0]["message"]["content"]
    assert text.status_code == 400 and "not an image" in text.json()["error"]["message"]
    assert gone.status_code == 400 and "answered 404" in gone.json()["error"]["message"]


def test_a_vision_family_not_served_yet_loads_as_its_text_model_and_says_why():
    from mlx_nursery.actors.models.vision import VisionUnavailable, load_vision

    with pytest.raises(VisionUnavailable, match="not served for 'qwen2_5_vl' models yet"):
        load_vision(VISION, {"model_type": "qwen2_5_vl", "vision_config": {}})
    assert load_vision(VISION, {"model_type": "llama"}) is None  # a text model


async def test_the_disk_tier_keeps_an_image_by_its_hash_across_a_restart(tmp_path):
    """A screenshot conversation written to the disk tier is found after a restart
    by the same screenshot, and never by another one with the same text around
    it, though image ids are a process's own: here the written screenshot's ids
    are the other one's after the restart (the entry records its images' hashes
    and is read back as the new process places them)."""
    first, other = png(71), png(72)
    system = {"role": "system", "content": "You look at screenshots. " * 60}  # past LONG_PREFIX
    turn = [system, *asking("What is this?", first)]
    settings = {"batch": 2, "prompt_cache_dir": str(tmp_path / "tier")}
    async with checked_engine(VISION, **settings) as engine:
        await engine.generate(asking("Hi", other), max_tokens=2)  # short: kept in memory only
        a = await engine.generate(turn, max_tokens=4, logit_bias={ord("a"): 100})
        written = engine.intake.prompt(turn, {})[1]
        assert await engine.flush_prompt_cache()
    later = [*turn, {"role": "assistant", "content": a.text},
             {"role": "user", "content": "And now?"}]  # fmt: skip
    async with checked_engine(VISION, **settings) as engine:
        ids = engine.intake.prompt([system, *asking("What is this?", other)], {})[1]
        image_at = next(i for i, t in enumerate(ids) if t >= IMAGE_BASE)
        assert ids[image_at] == written[image_at]  # the written screenshot's ids, another image
        swapped = [system, *asking("What is this?", other), *later[2:]]  # the same turns
        b = await engine.generate(swapped, max_tokens=4)
        assert b.usage.cached_tokens <= image_at
        again = await engine.generate(later, max_tokens=4)
        assert again.usage.cache.tier is CacheTier.DISK
        assert again.usage.cached_tokens >= a.usage.prompt_tokens + 4
        assert engine.intake.vision.encoded == 1  # only the other screenshot was looked at
    async with checked_engine(VISION, prompt_cache_disk=0, batch=2) as engine:
        fresh = await engine.generate(later, max_tokens=4)
    assert again.tokens == fresh.tokens
