"""The ``mlx-nursery`` command. ``serve`` restarts itself with OpenBLAS preloaded
(``blas.py``) before the server is imported: importing it (mlx-lm,
transformers' tokenizers, the APIs and actors) takes about 2 s, which a server
that restarts itself after importing would pay twice. Everything else goes to
``cli.main`` as it is (``python -m mlx_nursery.server.cli`` is the same command,
restarting after its imports)."""

from __future__ import annotations

import importlib
import os
import sys

from .blas import reexec_with, wanted_openblas


def main() -> int:
    argv = sys.argv[1:]
    # A rank under mlx.launch runs on what its launcher (restarted already) chose.
    if argv[:1] == ["serve"] and "MLX_RANK" not in os.environ:
        lib = wanted_openblas()
        if lib is not None:
            reexec_with(lib, argv)
    # imported here, after the restart: the point of this module
    return importlib.import_module("mlx_nursery.server.cli").main(argv)


if __name__ == "__main__":
    sys.exit(main())
