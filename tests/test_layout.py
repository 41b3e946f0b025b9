"""The package installs under one namespace and the CLI is on PATH."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_namespaced_imports():
    subprocess.run(
        [sys.executable, "-c", "import mlx_nursery.actors, mlx_nursery.server"], check=True
    )


def test_console_script_is_installed():
    exe = Path(sys.executable).parent / "mlx-nursery"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True)
    assert "serve" in out.stdout
