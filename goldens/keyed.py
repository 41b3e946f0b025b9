"""Where a built test or benchmark model is kept: a directory named by a hash of
everything that built it, so a changed builder or input rebuilds and an unchanged
one is reused, and a machine that built it weeks ago uses what a fresh one would.

The key covers the builder's own source files, its committed inputs (a corpus),
its settings, and the versions of the libraries whose output it keeps (a BPE
trainer's merges, mlx-lm's parameter names). A build is written into a temporary
folder beside its target and renamed into place only when whole: a killed build
leaves nothing that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path

LIBRARIES = ("mlx", "mlx-lm", "numpy", "tokenizers")


def cache_root() -> Path:
    """``MLX_NURSERY_CACHE``, else ``$XDG_CACHE_HOME/mlx-nursery`` (``~/.cache``)."""
    if env := os.environ.get("MLX_NURSERY_CACHE"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx-nursery"


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def key(files: Iterable[Path], settings: object = None) -> str:
    """A short hash of ``files``' names and bytes, ``settings`` (JSON) and the
    versions of :data:`LIBRARIES` (where the checkout lies is not part of it)."""
    digest = hashlib.sha256()
    for path in sorted(Path(f).resolve() for f in files):
        digest.update(path.name.encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode() + b"\0")
    for name in LIBRARIES:
        digest.update(f"{name}=={_version(name)}\0".encode())
    return digest.hexdigest()[:12]


def keyed_dir(name: str, files: Iterable[Path], settings: object = None) -> Path:
    """``<cache root>/<name>-<key>``: where the build of ``name`` from these inputs lives."""
    return cache_root() / f"{name}-{key(files, settings)}"


def built(out: Path, build: Callable[[Path], object]) -> Path:
    """``out``, built by ``build(folder)`` unless a whole build is already there."""
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        build(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process finished the same build first
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
