"""Images for vision models: one image's way from a request's bytes to the KV of
the rows that show it (docs/vision.md).

A vision checkpoint (Gemma 3's image-text models) loads as two parts: mlx-lm's
text model, which the batch runs like any other, and mlx-vlm's vision tower and
projector, which turn an image into its soft tokens' embeddings. An image in a
prompt is a run of **image ids**: ids past any vocabulary (``IMAGE_BASE`` up),
one a soft token, a run an image, the same run for the same bytes (their hash;
:class:`Images`). The ids are the prompt's tokens everywhere the engine keeps
them, so the prompt cache keys an image by what it shows: two screenshots with
the same text around them never share KV, and the same screenshot sent again
is found with its encoding. The runs are this process's: the disk tier writes
an entry's images by hash and reads them back as this process places them. Only the model's first
layer reads them: the text model's ``__call__`` (:func:`attach`) swaps a chunk's
image ids for the image's embeddings, merged exactly as mlx-vlm merges them,
and encodes an image (vision tower, projector) the first time it is needed,
keeping its embeddings by content for the next row that shows it.

mlx-vlm is the optional ``vision`` extra: without it a vision checkpoint loads as
its text model and an image gets a 400 that names the extra.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from ..errors import InvalidRequest
from ..stats import ImageFigures

IMAGE_BASE = 1 << 30  # the first image id: past every vocabulary
SPAN = 1 << 14  # ids an image may take (its soft tokens)
# The families whose images this engine places: mlx-vlm's model_type.
FAMILIES = ("gemma3",)
EXTRA = "pip install 'mlx-nursery[vision]'"
MAX_IMAGE_BYTES = 20 << 20  # an image's encoded size
MAX_PIXELS = 40_000_000  # width times height (PIL's bomb guard is 89M)
MAX_IMAGES = 16  # a request's images
KEPT_FEATURES = 256 << 20  # bytes of image embeddings kept by content
KEPT_IMAGES = 512 << 20  # bytes of images kept for the rows still to prefill them


def shows_images(tokens: Sequence[int] | np.ndarray) -> bool:
    """Whether a prompt holds an image's ids."""
    return len(tokens) > 0 and int(np.max(tokens)) >= IMAGE_BASE


def vision_family(config: dict) -> str | None:
    """The vision family of a checkpoint's config (None: a text model)."""
    if "vision_config" not in config:
        return None
    return str(config.get("model_type"))


@attrs.frozen(eq=False)
class Picture:
    """One image of a request: its bytes (checked to decode), their hash, where its
    ids start, and how many soft tokens it takes."""

    data: bytes = attrs.field(repr=False)
    sha: str
    width: int
    height: int
    first: int = 0  # its first image id (set by Images.place)
    tokens: int = 0


def picture(data: bytes) -> Picture:
    """Check an image's bytes (a format PIL reads, within the limits) and hash them.
    Raises :class:`InvalidRequest` saying what to change."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidRequest(
            f"an image is {len(data)} bytes, over the limit of {MAX_IMAGE_BYTES}: send a "
            "smaller or more compressed image", param="messages",
        )  # fmt: skip
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > MAX_PIXELS:
                raise InvalidRequest(
                    f"an image is {width}x{height} pixels, over the limit of {MAX_PIXELS}: "
                    "send it scaled down", param="messages",
                )  # fmt: skip
            image.load()
    except InvalidRequest:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise InvalidRequest(
            f"an image could not be decoded ({exc}): send PNG, JPEG, GIF or WebP bytes",
            param="messages",
        ) from None
    return Picture(data, hashlib.sha256(data).hexdigest(), width, height)


def _rgb(data: bytes) -> Any:
    """An image as mlx-vlm's ``load_image`` gives it: EXIF orientation applied, RGB."""
    from PIL import Image, ImageOps

    return ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")


@attrs.define(eq=False)
class Images:
    """Where each image's ids lie: a run of ``SPAN`` ids an image, by content (the
    same bytes, the same run, for this process's life). The images placed are
    kept, the least recently placed let go past ``KEPT_IMAGES`` bytes (a row
    whose image was let go before its prefill fails, saying so)."""

    _runs: dict[str, int] = attrs.field(factory=dict)  # sha -> run
    _shas: dict[int, str] = attrs.field(factory=dict)  # run -> sha
    _held: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)  # run -> it
    _bytes: int = 0
    _lock: threading.RLock = attrs.field(factory=threading.RLock)

    def run_of(self, sha: str) -> int:
        """The run of the image whose bytes hash to ``sha`` (given now if new)."""
        with self._lock:
            run = self._runs.setdefault(sha, len(self._runs))
            if run >= ((1 << 31) - IMAGE_BASE) // SPAN:
                raise InvalidRequest("this server has placed every image it can: restart it")
            self._shas[run] = sha
            return run

    def shown(self, tokens: np.ndarray) -> dict[int, str]:
        """The images a prompt's ids show: their runs, and each one's hash."""
        runs = np.unique((tokens[tokens >= IMAGE_BASE] - IMAGE_BASE) // SPAN)
        with self._lock:
            return {int(r): self._shas[int(r)] for r in runs}

    def here(self, tokens: np.ndarray, shown: dict[int, str]) -> np.ndarray:
        """A prompt's ids as another process placed them (``shown``: its runs'
        hashes), placed as this one places the same images."""
        out = tokens.copy()
        for run, sha in shown.items():
            at = (tokens >= IMAGE_BASE) & ((tokens - IMAGE_BASE) // SPAN == run)
            out[at] += (self.run_of(sha) - run) * SPAN
        return out

    def place(self, image: Picture, tokens: int) -> Picture:
        with self._lock:
            run = self.run_of(image.sha)
            placed = attrs.evolve(image, first=IMAGE_BASE + run * SPAN, tokens=tokens)
            old = self._held.pop(run, None)
            self._bytes += len(image.data) - (len(old.data) if old else 0)
            self._held[run] = placed
            while self._bytes > KEPT_IMAGES and len(self._held) > 1:
                _, gone = self._held.popitem(last=False)
                self._bytes -= len(gone.data)
            return placed

    def __len__(self) -> int:
        return len(self._held)

    def of(self, image_id: int) -> Picture:
        with self._lock:
            held = self._held.get((image_id - IMAGE_BASE) // SPAN)
        if held is None:
            raise LookupError(
                f"an image of this prompt was let go before its prefill (over "
                f"{KEPT_IMAGES >> 20} MB of images came after it): send it again"
            )
        return held


@attrs.define(eq=False)
class Vision:
    """A vision checkpoint's image side: mlx-vlm's vision tower and projector,
    its processor, the image ids placed, and the embeddings kept by content."""

    family: str
    vlm: Any  # mlx-vlm's model, its language model dropped
    processor: Any
    image_token: int  # the soft token's id (what the template's expansion holds)
    soft_tokens: int  # an image's soft tokens
    images: Images = attrs.field(factory=Images)
    _features: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)
    _kept: int = 0
    encoded: int = 0  # images through the vision tower
    encode_seconds: float = 0.0
    hits: int = 0  # images whose embeddings were kept

    # -- the prompt (intake) --------------------------------------------------------

    def expand(self, text: str, tokenizer: Any, pictures: Sequence[Picture],
               whole: bool = True) -> list[int]:  # fmt: skip
        """A rendered chat's token ids with its images in place: each marker widened
        as the processor widens it (mlx-vlm's ``prepare_inputs``: no special tokens
        added), then its soft tokens swapped for the image's ids. ``whole``: the
        text holds every picture (else the first ones: a conversation's start)."""
        processor = self.processor
        shown = text.count(processor.boi_token)
        if shown > len(pictures) or (whole and shown != len(pictures)):
            raise InvalidRequest(
                f"the chat template placed {shown} of {len(pictures)} images: send images in "
                "user turns or tool results", param="messages",
            )  # fmt: skip
        pictures = pictures[:shown]
        text = text.replace(processor.boi_token, processor.full_image_sequence)
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        at = [i for i, t in enumerate(ids) if t == self.image_token]
        if len(at) != len(pictures) * self.soft_tokens:
            raise InvalidRequest(
                "an image's soft token appears in the text itself: send it without",
                param="messages",
            )
        placed = [self.images.place(p, self.soft_tokens) for p in pictures]
        for n, i in enumerate(at):
            ids[i] = placed[n // self.soft_tokens].first + n % self.soft_tokens
        return ids

    # -- the forward (GPU thread) ---------------------------------------------------

    def features(self, image: Picture, counted: bool = True) -> mx.array:
        """An image's soft tokens' embeddings as mlx-vlm merges them (before the text
        model's input scale), encoded once and kept by content. ``counted``: a hit
        counts (not for an image's rest, after a chunk that held its start)."""
        kept = self._features.get(image.sha)
        if kept is not None:
            self._features.move_to_end(image.sha)
            self.hits += counted
            return kept
        t0 = time.perf_counter()
        pixels = self.processor.image_processor(images=[_rgb(image.data)])["pixel_values"]
        pixels = mx.array(np.asarray(pixels))
        hidden, _, _ = self.vlm.vision_tower(
            pixels.transpose(0, 2, 3, 1).astype(self.dtype), output_hidden_states=True
        )
        out = self.vlm.multi_modal_projector(hidden)[0]
        mx.eval(out)
        self.encoded += 1
        self.encode_seconds += time.perf_counter() - t0
        self._features[image.sha] = out
        self._kept += out.nbytes
        while self._kept > KEPT_FEATURES and len(self._features) > 1:
            _, old = self._features.popitem(last=False)
            self._kept -= old.nbytes
        return out

    def figures(self) -> ImageFigures:
        return ImageFigures(self.family, self.encoded, self.encode_seconds, self.hits,
                            len(self.images), len(self._features))  # fmt: skip

    @property
    def dtype(self) -> mx.Dtype:
        return self.vlm.multi_modal_projector.mm_input_projection_weight.dtype

    def embeddings(self, embed: Any, inputs: mx.array) -> mx.array | None:
        """A chunk's input embeddings where it holds image ids (None: it holds none):
        the text's from ``embed``, each image id's its image's, merged by mlx-vlm's
        own ``prepare_inputs_for_multimodal``."""
        ids = np.asarray(inputs)
        where = ids >= IMAGE_BASE
        if not where.any():
            return None
        held = ids[where]
        runs = (held - IMAGE_BASE) // SPAN
        starts = np.flatnonzero(np.diff(runs, prepend=-1))  # where each image's stretch begins
        parts = []
        for begin, end in zip(starts, [*starts[1:], len(held)], strict=True):
            image = self.images.of(int(held[begin]))
            at = held[begin:end] - image.first
            parts.append(self.features(image, counted=bool(at[0] == 0))[mx.array(at)])
        image_features = mx.concatenate(parts)[None]
        text = np.where(where, self.image_token, ids)
        config = self.vlm.config
        merged, _ = self.vlm.prepare_inputs_for_multimodal(
            config.hidden_size, config.pad_token_id, self.image_token, image_features,
            embed(mx.array(text)), mx.array(text), mx.ones(text.shape, mx.int32),
        )  # fmt: skip
        return merged


def load_vision(path: Path, config: dict) -> Vision | None:
    """The image side of a vision checkpoint (None: a text model). A family this
    engine does not place, or no mlx-vlm, loads as the text model alone (logged
    by the caller; an image then gets a 400 that says why)."""
    family = vision_family(config)
    if family is None:
        return None
    if family not in FAMILIES:
        raise VisionUnavailable(
            f"images are not served for {family!r} models yet (served: {', '.join(FAMILIES)})"
        )
    try:
        from mlx_vlm.utils import load_model, load_processor
    except ImportError:
        raise VisionUnavailable(
            f"this {family} checkpoint takes images, but mlx-vlm is not installed: {EXTRA}"
        ) from None
    vlm = _family_model(Path(path), config, load_model)
    vlm.language_model = None  # mlx-lm's text model runs the prompt; its weights stay unread
    mx.eval(vlm.vision_tower.parameters(), vlm.multi_modal_projector.parameters())
    processor = load_processor(path, add_detokenizer=False)
    return Vision(
        family, vlm, processor, image_token=int(processor.image_token_id),
        soft_tokens=int(processor.image_seq_length),
    )  # fmt: skip


def _family_model(path: Path, config: dict, load_model: Any) -> Any:
    """mlx-vlm's model of the checkpoint's family, its weights read lazily. Where the
    config names custom code for its text model (``model_file``, which mlx-vlm
    would run instead), the family's own model is built, from a view of the
    folder whose config leaves that out."""
    if "model_file" not in config:
        return load_model(path, lazy=True)
    with tempfile.TemporaryDirectory(prefix="vision-") as view:
        for item in path.iterdir():
            if item.name != "config.json":
                (Path(view) / item.name).symlink_to(item.resolve())
        plain = {k: v for k, v in config.items() if k != "model_file"}
        (Path(view) / "config.json").write_text(json.dumps(plain))
        return load_model(Path(view), lazy=False)  # read before the view goes


class VisionUnavailable(Exception):
    """A checkpoint takes images that this install cannot place (why: the message)."""


def attach(model: Any, vision: Vision) -> None:
    """Give mlx-lm's text model its images: a chunk holding image ids runs on the
    embeddings :meth:`Vision.embeddings` makes (a decode step, one token wide,
    never holds one, and is not looked at)."""
    base = type(model)
    inner = model.language_model.model if hasattr(model, "language_model") else model.model

    def __call__(self, inputs, cache=None, input_embeddings=None):
        if input_embeddings is None and inputs.shape[-1] > 1:
            input_embeddings = vision.embeddings(inner.embed_tokens, inputs)
        return base.__call__(self, inputs, cache=cache, input_embeddings=input_embeddings)

    model.__class__ = type(f"Seeing{base.__name__}", (base,), {"__call__": __call__})
    model.vision = vision
