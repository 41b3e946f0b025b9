"""Models by name from the local stores of Ollama and LM Studio (read only).

- ``ollama:<name>[:<tag>]``: Ollama's manifest for the name
  (``manifests/<host>/<namespace>/<model>/<tag>``; host ``registry.ollama.ai``,
  namespace ``library`` and tag ``latest`` unless given) names the model layer's
  blob (``blobs/sha256-<hex>``), a GGUF file. The store is ``$OLLAMA_MODELS``,
  else ``~/.ollama/models``, else the Linux service's
  ``/usr/share/ollama/.ollama/models``.
- ``lmstudio:<publisher>/<name>[/<file>.gguf]``: the GGUF file in that folder of
  LM Studio's models folder (``downloadsFolder`` in ``~/.lmstudio/settings.json``,
  else ``~/.lmstudio/models``, else ``~/.cache/lm-studio/models``); a folder with
  several model files needs the file named. Vision projectors (``mmproj-*``)
  are not models.

Nothing is downloaded from either; the short id is the name after the prefix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import attrs

PREFIXES = ("ollama:", "lmstudio:")
OLLAMA_HOST, OLLAMA_NAMESPACE, OLLAMA_TAG = "registry.ollama.ai", "library", "latest"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"


class StoreError(ValueError):
    """A store reference that does not resolve; the message says what to change."""


@attrs.frozen
class StoreModel:
    ref: str  # as the user writes it: ollama:qwen3:8b
    name: str  # the short id: qwen3:8b
    file: Path  # the GGUF file
    size: int


def is_store_ref(ref: object) -> bool:
    return isinstance(ref, str) and ref.startswith(PREFIXES)


def short_name(ref: str) -> str:
    """The model's name in a store reference (``ollama:qwen3:8b`` -> ``qwen3:8b``)."""
    name = ref.split(":", 1)[1]
    if ref.startswith("ollama:") and ":" not in name.rsplit("/", 1)[-1]:
        name = f"{name}:{OLLAMA_TAG}"
    if ref.startswith("lmstudio:") and name.lower().endswith(".gguf"):
        name = name.rsplit("/", 1)[0]
    return name


def locate(ref: str) -> StoreModel:
    """The GGUF file a store reference names."""
    if ref.startswith("ollama:"):
        return _ollama(ref)
    if ref.startswith("lmstudio:"):
        return _lmstudio(ref)
    raise StoreError(
        f"{ref!r} names no store; use ollama:<name>[:<tag>] or lmstudio:<publisher>/<name>"
    )


# -- Ollama -----------------------------------------------------------------------


def ollama_root() -> Path:
    env = os.environ.get("OLLAMA_MODELS")
    if env:
        return Path(env)
    home = Path.home() / ".ollama" / "models"
    service = Path("/usr/share/ollama/.ollama/models")
    return service if not home.is_dir() and service.is_dir() else home


def _ollama_parts(name: str) -> tuple[str, str, str, str]:
    """(host, namespace, model, tag) of an Ollama name, defaults filled in."""
    path, _, tag = name.partition(":")
    parts = path.split("/")
    if not path or len(parts) > 3 or not all(parts):
        raise StoreError(f"ollama:{name} is not an Ollama model name (e.g. ollama:qwen3:8b)")
    host = parts[0] if len(parts) == 3 else OLLAMA_HOST
    namespace = parts[-2] if len(parts) >= 2 else OLLAMA_NAMESPACE
    return host, namespace, parts[-1], tag or OLLAMA_TAG


def _ollama(ref: str) -> StoreModel:
    root = ollama_root()
    host, namespace, model, tag = _ollama_parts(ref.split(":", 1)[1])
    manifest = root / "manifests" / host / namespace / model / tag
    if not manifest.is_file():
        held = ", ".join(m.ref for m in ollama_models()) or "none"
        raise StoreError(
            f"{ref}: Ollama has no manifest {manifest} (models there: {held}); "
            "pull it with Ollama first, or set OLLAMA_MODELS to its store"
        )
    try:
        layers = json.loads(manifest.read_text())["layers"]
        digest = next(la["digest"] for la in layers if la["mediaType"] == OLLAMA_MODEL_LAYER)
    except (ValueError, KeyError, TypeError, StopIteration):
        raise StoreError(f"{ref}: {manifest} lists no model layer") from None
    blob = root / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise StoreError(f"{ref}: the model's blob {blob} is missing from Ollama's store")
    return StoreModel(ref, short_name(ref), blob, blob.stat().st_size)


def ollama_models() -> list[StoreModel]:
    """Every model in Ollama's store whose model blob is present."""
    manifests = ollama_root() / "manifests"
    found = []
    for manifest in sorted(manifests.glob("*/*/*/*")) if manifests.is_dir() else []:
        if not manifest.is_file():
            continue
        host, namespace, model, tag = manifest.relative_to(manifests).parts
        name = f"{model}:{tag}"
        if namespace != OLLAMA_NAMESPACE or host != OLLAMA_HOST:
            name = f"{namespace}/{name}" if host == OLLAMA_HOST else f"{host}/{namespace}/{name}"
        try:
            found.append(_ollama(f"ollama:{name}"))
        except StoreError:
            continue
    return sorted(found, key=lambda m: m.ref)


# -- LM Studio ---------------------------------------------------------------------


def lmstudio_root() -> Path:
    home = Path.home()
    try:
        settings = json.loads((home / ".lmstudio" / "settings.json").read_text())
        folder = settings.get("downloadsFolder")
        if folder:
            return Path(folder).expanduser()
    except (OSError, ValueError, AttributeError):
        pass
    current, legacy = home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"
    return legacy if not current.is_dir() and legacy.is_dir() else current


def _model_files(folder: Path) -> list[Path]:
    return sorted(
        f for f in folder.glob("*.gguf") if f.is_file() and not f.name.lower().startswith("mmproj")
    )


def _lmstudio(ref: str) -> StoreModel:
    root = lmstudio_root()
    name = ref.split(":", 1)[1].strip("/")
    target = root / name
    if name.lower().endswith(".gguf"):
        if not target.is_file():
            raise StoreError(f"{ref}: no file {target} in LM Studio's models folder")
        return StoreModel(ref, short_name(ref), target, target.stat().st_size)
    if name.count("/") != 1 or not target.is_dir():
        held = ", ".join(m.ref for m in lmstudio_models()) or "none"
        raise StoreError(
            f"{ref}: LM Studio's models folder {root} has no {name!r} "
            f"(use lmstudio:<publisher>/<name>; models there: {held})"
        )
    files = _model_files(target)
    if len(files) != 1:
        choices = ", ".join(f"lmstudio:{name}/{f.name}" for f in files) or "no GGUF file"
        raise StoreError(f"{ref}: {target} holds {len(files)} model files; name one: {choices}")
    return StoreModel(ref, short_name(ref), files[0], files[0].stat().st_size)


def lmstudio_models() -> list[StoreModel]:
    """Every GGUF model file in LM Studio's models folder."""
    root = lmstudio_root()
    found = []
    for folder in sorted(root.glob("*/*")) if root.is_dir() else []:
        files = _model_files(folder) if folder.is_dir() else []
        name = folder.relative_to(root).as_posix()
        for f in files:
            ref = f"lmstudio:{name}" if len(files) == 1 else f"lmstudio:{name}/{f.name}"
            found.append(StoreModel(ref, name, f, f.stat().st_size))
    return found
