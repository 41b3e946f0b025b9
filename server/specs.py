"""The CLI's words for models (``--model NAME=MODEL``, ``--keep-alive``,
``--models-dir``), as the pool reads them, and the states a model goes through
in it (``docs/models.md``)."""

from __future__ import annotations

import enum
import math
from pathlib import Path

from mlx_nursery.actors.models.registry import short_id


class ModelState(enum.StrEnum):
    """A configured model's state in the pool."""

    UNLOADED = "unloaded"
    WAITING = "waiting"  # asked for: waits for its turn to load, or for memory
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"

def spec_name(text: str) -> tuple[str | None, str]:
    """``NAME=MODEL`` -> (NAME, MODEL); a bare reference -> (None, MODEL). A name
    holds no ``/`` or ``:`` (so a path or store name with ``=`` in it stays whole)."""
    name, sep, ref = text.partition("=")
    if sep and name and ref and not any(c in name for c in "/:\\"):
        return name, ref
    return None, text


_UNIT = {"s": 1, "m": 60, "h": 3600}


def parse_duration(text: str) -> float | None:
    """Seconds: 300, 30s, 5m, 1h; ``forever`` (or -1): None, pinned."""
    word = text.strip().lower()
    if word in ("forever", "never", "-1", "pin", "pinned"):
        return None
    scale = _UNIT.get(word[-1:])
    try:
        seconds = float(word[:-1] if scale else word) * (scale or 1)
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (try 300, 5m, 1h or forever)") from None
    if seconds < 0 or seconds != seconds or seconds == math.inf:
        raise ValueError(f"a keep-alive is 0 or more seconds, or forever; got {text!r}")
    return seconds


def models_in(folder: Path) -> list[tuple[str, str]]:
    """A models folder's entries: each directory with a ``config.json`` and each
    GGUF file, by name."""
    found = []
    for entry in sorted(Path(folder).iterdir()):
        if entry.is_dir() and (entry / "config.json").is_file():
            found.append((entry.name, str(entry)))
        elif entry.suffix.lower() == ".gguf":
            found.append((short_id(entry), str(entry)))
    return found
