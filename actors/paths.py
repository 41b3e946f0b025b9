"""Where mlx-nursery keeps files, and how it names them by content.

One root (``MLX_NURSERY_CACHE``, default ``~/.cache/mlx-nursery``) holds
converted and downloaded models (``models/``, ``downloads/``) and the prompt
cache's disk tier (``kv/``); files there are checked by their sha256.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    """The root of every file mlx-nursery keeps (``MLX_NURSERY_CACHE`` overrides)."""
    env = os.environ.get("MLX_NURSERY_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "mlx-nursery"


def sha256(path: Path) -> str:
    """The file's sha256, as hex (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
