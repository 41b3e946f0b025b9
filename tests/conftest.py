"""Shared fixtures: the tiny golden models and their mlx-lm goldens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GOLDENS = ROOT / "goldens"
sys.path.insert(0, str(GOLDENS))

FAMILIES = ("llama", "qwen3", "gemma3_text", "mamba2", "falcon_h1")


def model_path(family: str) -> Path:
    return GOLDENS / "models" / family


def golden(family: str) -> dict:
    return json.loads((GOLDENS / "tokens" / f"{family}.json").read_text())


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param
