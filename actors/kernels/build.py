"""The one build cache of the native kernels: a library compiled once with the
system compiler into ``~/.cache/mlx-nursery/native`` (or
``$MLX_NURSERY_NATIVE_DIR``), keyed by its sources, flags and this CPU's model
and flags (``-march=native`` builds run on this CPU only)."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("MLX_NURSERY_NATIVE_DIR", Path.home() / ".cache/mlx-nursery/native"))


def cpu_key() -> str:
    """The CPU's model and flags (a library built with -march=native is for it only)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def built(name: str, parts: list[bytes], command: Any, instead: str,
          timeout: int = 120) -> Path | None:  # fmt: skip
    """The library ``name`` (``stem.suffix``) built once into :func:`cache_dir` by
    ``command(output_path)``, keyed by ``parts`` and this CPU; None where the
    build fails (logged, saying ``instead``: what runs in its place)."""
    key = hashlib.sha256(b"\0".join([*parts, cpu_key().encode()])).hexdigest()[:16]
    stem, _, suffix = name.partition(".")
    target = cache_dir() / f"{stem}-{key}.{suffix}"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        result = subprocess.run(command(out), capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            log.warning("building %s failed (%s): %s", name, result.stderr.strip()[-300:],
                        instead)  # fmt: skip
            return None
        os.replace(out, target)  # atomic: a concurrent builder finds a whole file
    return target
