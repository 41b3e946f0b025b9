"""Images a request names by URL, fetched before it is read (``--image-urls``).

Off by default: a server on a person's machine should not fetch what a request
(which a web page may have written) points it at, so a remote image URL is then
a 400 that says to send the image inline. With the flag, every ``http(s)`` image
of a body (chat ``image_url`` parts, Responses ``input_image`` parts, Messages
image blocks with a ``url`` source) is fetched, checked to be an image within
the limits, and put in its place as inline data; the APIs then read it as any
inline image (docs/vision.md).
"""

from __future__ import annotations

import base64
from typing import Any

import httpx
import trio
from mlx_nursery.actors.models.vision import MAX_IMAGE_BYTES, MAX_IMAGES

from .api.base import IMAGE_TYPES, bad

TIMEOUT = 10.0  # seconds for one image


async def fetched(body: Any) -> Any:
    """``body`` with each remote image URL replaced by the image's data (in place)."""
    found: list[tuple[dict, str, str]] = []  # (where, key, url)
    _find(body, found)
    if not found:
        return body
    if len(found) > MAX_IMAGES:
        raise bad(f"{len(found)} image URLs, over the limit of {MAX_IMAGES}: send fewer")
    async with httpx.AsyncClient(timeout=TIMEOUT, follow_redirects=True) as client:
        fetched_ = {}
        async with trio.open_nursery() as nursery:
            for url in {url for _, _, url in found}:
                nursery.start_soon(_fetch, client, url, fetched_)
    for where, key, url in found:
        media, data = fetched_[url]
        if key == "source":  # Messages: an image block's source
            where["source"] = {"type": "base64", "media_type": media, "data": data}
        else:
            at = where[key]
            inline = f"data:{media};base64,{data}"
            if isinstance(at, dict):
                at["url"] = inline
            else:
                where[key] = inline
    return body


def _find(node: Any, found: list) -> None:
    if isinstance(node, list):
        for item in node:
            _find(item, found)
        return
    if not isinstance(node, dict):
        return
    kind = node.get("type")
    if kind in ("image_url", "input_image"):
        at = node.get("image_url")
        url = at.get("url") if isinstance(at, dict) else at
        if _remote(url):
            found.append((node, "image_url", url))
    elif kind == "image" and isinstance(node.get("source"), dict):
        source = node["source"]
        if source.get("type") == "url" and _remote(source.get("url")):
            found.append((node, "source", source["url"]))
    for value in node.values():
        if isinstance(value, list | dict):
            _find(value, found)


def _remote(url: Any) -> bool:
    return isinstance(url, str) and url.startswith(("http://", "https://"))


async def _fetch(client: httpx.AsyncClient, url: str, out: dict) -> None:
    try:
        async with client.stream("GET", url) as response:
            if response.status_code != 200:
                raise bad(f"image URL {url} answered {response.status_code}: send the image "
                          "inline as a data: URL", "messages")  # fmt: skip
            media = response.headers.get("content-type", "").split(";")[0].strip()
            if media not in IMAGE_TYPES:
                raise bad(f"image URL {url} is {media or 'of no type'}, not an image this "
                          f"server reads ({', '.join(IMAGE_TYPES)})", "messages")  # fmt: skip
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > MAX_IMAGE_BYTES:
                    raise bad(f"image URL {url} is over {MAX_IMAGE_BYTES} bytes: send a "
                              "smaller image", "messages")  # fmt: skip
    except httpx.HTTPError as exc:
        raise bad(f"image URL {url} could not be fetched ({type(exc).__name__}): send the "
                  "image inline as a data: URL", "messages") from None  # fmt: skip
    out[url] = (media, base64.b64encode(bytes(data)).decode())
