"""The oracle itself: models load offline, rebuild byte for byte, and mlx-lm still
reproduces the committed goldens (a drift here is a changed mlx, mlx-lm or BLAS,
not an engine bug)."""

from __future__ import annotations

import filecmp

import make_goldens
import make_models
import pytest
from conftest import FAMILIES, GOLDENS, golden, model_path
from mlx_lm import load, stream_generate

HEAD_64 = tuple(f"{f}_h64" for f in make_models.HEAD_64)


def test_every_model_dir_loads_and_generates(family):
    model, tokenizer = load(str(model_path(family)))
    out = list(stream_generate(model, tokenizer, "Hello", max_tokens=4))
    assert out, "no tokens generated"
    assert tokenizer.eos_token_ids == {make_models.VOCAB - 1}


def test_models_are_small():
    for family in (*FAMILIES, *HEAD_64):
        size = sum(f.stat().st_size for f in model_path(family).iterdir())
        assert size < 1_000_000, f"{family} is {size} bytes"


def test_rebuilding_models_is_byte_identical(tmp_path):
    for family in (*FAMILIES, *HEAD_64):
        make_models.build(family, tmp_path)
        cmp = filecmp.dircmp(model_path(family), tmp_path / family)
        files = [p.name for p in model_path(family).iterdir()]
        _, mismatch, errors = filecmp.cmpfiles(
            model_path(family), tmp_path / family, files, shallow=False
        )
        assert not cmp.left_only and not cmp.right_only, family
        assert not mismatch and not errors, f"{family}: {mismatch or errors} differ"


def test_the_servers_default_model_is_the_llama_toy():
    shipped = make_models.DEFAULT_MODEL
    files = [p.name for p in model_path("llama").iterdir()]
    _, mismatch, errors = filecmp.cmpfiles(model_path("llama"), shipped, files, shallow=False)
    assert not mismatch and not errors


def test_goldens_do_not_drift(family):
    committed = golden(family)
    live = make_goldens.model_goldens(family)
    env_now, env_then = live["environment"], committed["environment"]
    if env_now != env_then:
        pytest.fail(
            f"the oracle's environment changed: goldens were recorded with {env_then}, "
            f"this run has {env_now}; re-run `make goldens` and review the diff"
        )
    assert live == committed


def test_goldens_cover_the_scenarios():
    g = golden("gemma3_text")
    window = 16
    assert any(len(s["prompt_ids"]) > window for s in g["serial"])
    assert any(len(s["prompt_ids"]) > 2 * g["prefill_step_size"] for s in g["serial"])
    assert any(r["insert_at"] > 0 for r in g["batch"]["joins"])
    lengths = {len(r["tokens"]) for r in g["batch"]["static"]}
    assert len(lengths) > 1, "rows should leave at different steps"
    assert (GOLDENS / "tokens" / "falcon_h1.json").exists()
