"""The BLAS a server runs: on Linux, a system OpenBLAS preloaded (mlx's bundled
reference BLAS is 5-20x slower for float32 matmuls). Light on purpose: the
``mlx-nursery`` command (``entry.py``) restarts a server with OpenBLAS before
it imports anything heavy."""

from __future__ import annotations

import ctypes.util
import glob
import logging
import os
import sys

log = logging.getLogger("mlx_nursery.server")

OPENBLAS_ENV = "MLX_NURSERY_OPENBLAS"  # set to 0 to keep mlx's bundled reference BLAS
_OPENBLAS_GLOBS = (
    "/usr/lib/*/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)


def find_openblas() -> str | None:
    """The system OpenBLAS library's path, or None."""
    for pattern in _OPENBLAS_GLOBS:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    name = ctypes.util.find_library("openblas")
    return name if name and os.path.isabs(name) else None


def wanted_openblas() -> str | None:
    """The OpenBLAS this process should restart with: found, on Linux, not
    turned off, and not preloaded already; else None."""
    if not sys.platform.startswith("linux") or os.environ.get(OPENBLAS_ENV) == "0":
        return None
    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        return None
    return find_openblas()


def reexec_with(lib: str, argv: list[str]) -> None:
    """Restart this process as the server's CLI with ``lib`` preloaded."""
    log.warning("BLAS: restarting with OpenBLAS preloaded (%s); %s=0 turns this off", lib,
                OPENBLAS_ENV)  # fmt: skip
    env = dict(os.environ, LD_PRELOAD=lib)
    os.execve(sys.executable, [sys.executable, "-m", "mlx_nursery.server.cli", *argv], env)


def maybe_reexec_with_openblas(argv: list[str]) -> None:
    """On Linux, restart this process with a system OpenBLAS preloaded: mlx's
    bundled reference BLAS is 5-20x slower for float32 matmuls."""
    if not sys.platform.startswith("linux") or os.environ.get(OPENBLAS_ENV) == "0":
        return
    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        log.info("BLAS: OpenBLAS preloaded (%s)", os.environ["LD_PRELOAD"])
        return
    lib = find_openblas()
    if lib is None:
        log.warning(
            "BLAS: mlx is using its bundled reference BLAS, which is slow on CPU; install "
            "OpenBLAS (Debian/Ubuntu: apt-get install libopenblas0-pthread) and restart, "
            "or set %s=0 to silence this",
            OPENBLAS_ENV,
        )
        return
    reexec_with(lib, argv)
