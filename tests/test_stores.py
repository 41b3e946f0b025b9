"""Models by name from Ollama's and LM Studio's stores, laid out here as those
apps lay them out (Ollama: a manifest naming a content-addressed blob; LM
Studio: publisher/name folders of GGUF files), served by name over HTTP and
listed by ``mlx-nursery models``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from mlx_nursery.actors.models import stores
from mlx_nursery.actors.models.registry import resolve, short_id
from test_gguf import assert_served_as, write_gguf


def ollama_store(root: Path, name: str, tag: str, gguf: Path, namespace: str = "library") -> Path:
    """Put ``gguf`` in an Ollama store at ``root`` as ``ollama pull`` would."""
    data = gguf.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    blob = root / "blobs" / f"sha256-{digest}"
    blob.write_bytes(data)
    template = b"{{ .Prompt }}"
    template_digest = hashlib.sha256(template).hexdigest()
    (root / "blobs" / f"sha256-{template_digest}").write_bytes(template)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": "sha256:" + "0" * 64, "size": 2},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
             "size": len(data)},
            {"mediaType": "application/vnd.ollama.image.template",
             "digest": f"sha256:{template_digest}", "size": len(template)},
        ],
    }  # fmt: skip
    folder = root / "manifests" / "registry.ollama.ai" / namespace / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / tag).write_text(json.dumps(manifest))
    return blob


@pytest.fixture
def homes(tmp_path, monkeypatch) -> Path:
    """A fresh HOME (LM Studio's folders), Ollama's store and our cache under tmp_path."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    monkeypatch.setenv("MLX_NURSERY_CACHE", str(tmp_path / "cache"))
    (tmp_path / "home").mkdir()
    return tmp_path


def test_an_ollama_name_resolves_through_its_manifest_to_the_blob(homes):
    gguf = homes / "tiny.gguf"
    write_gguf(gguf)
    blob = ollama_store(homes / "ollama", "tinyllama", "1b", gguf)
    ollama_store(homes / "ollama", "tinyllama", "latest", gguf)
    ollama_store(homes / "ollama", "coder", "q4", gguf, namespace="someone")
    found = stores.locate("ollama:tinyllama:1b")
    assert found.file == blob and found.name == "tinyllama:1b"
    assert stores.locate("ollama:tinyllama").name == "tinyllama:latest"
    assert stores.locate("ollama:someone/coder:q4").file == blob
    assert short_id("ollama:tinyllama:1b") == "tinyllama:1b"
    assert (Path(resolve("ollama:tinyllama:1b")) / "config.json").is_file()
    refs = [m.ref for m in stores.ollama_models()]
    assert refs == ["ollama:someone/coder:q4", "ollama:tinyllama:1b", "ollama:tinyllama:latest"]

    with pytest.raises(stores.StoreError, match=r"no manifest .* \(models there: ollama:someone"):
        stores.locate("ollama:qwen3:8b")
    blob.unlink()
    with pytest.raises(stores.StoreError, match=r"blob .* is missing"):
        stores.locate("ollama:tinyllama:1b")


def test_an_lmstudio_name_resolves_to_the_folder_s_model_file(homes):
    root = homes / "home" / ".lmstudio" / "models"
    one = root / "acme" / "Tiny-GGUF"
    one.mkdir(parents=True)
    write_gguf(one / "tiny-Q4_1.gguf")
    (one / "mmproj-tiny-f16.gguf").write_bytes(b"GGUF")  # a vision projector: not a model
    two = root / "acme" / "Two-GGUF"
    two.mkdir(parents=True)
    write_gguf(two / "two-Q4_1.gguf")
    write_gguf(two / "two-Q8_0.gguf")
    found = stores.locate("lmstudio:acme/Tiny-GGUF")
    assert found.file == one / "tiny-Q4_1.gguf" and found.name == "acme/Tiny-GGUF"
    assert short_id("lmstudio:acme/Tiny-GGUF") == "acme/Tiny-GGUF"
    with pytest.raises(stores.StoreError, match="holds 2 model files; name one: lmstudio:acme/"):
        stores.locate("lmstudio:acme/Two-GGUF")
    assert stores.locate("lmstudio:acme/Two-GGUF/two-Q8_0.gguf").file == two / "two-Q8_0.gguf"
    with pytest.raises(stores.StoreError, match="has no 'acme/None'"):
        stores.locate("lmstudio:acme/None")
    # LM Studio's settings move its models folder.
    moved = homes / "elsewhere"
    (moved / "p" / "m").mkdir(parents=True)
    write_gguf(moved / "p" / "m" / "m.gguf")
    settings = homes / "home" / ".lmstudio" / "settings.json"
    settings.write_text(json.dumps({"downloadsFolder": str(moved)}))
    assert [m.ref for m in stores.lmstudio_models()] == ["lmstudio:p/m"]


def test_models_lists_what_the_stores_hold(homes, capsys):
    from mlx_nursery.server.cli import main

    gguf = homes / "tiny.gguf"
    write_gguf(gguf)
    ollama_store(homes / "ollama", "tinyllama", "1b", gguf)
    folder = homes / "home" / ".lmstudio" / "models" / "acme" / "Tiny-GGUF"
    folder.mkdir(parents=True)
    write_gguf(folder / "tiny.gguf")
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "Ollama" in out and "ollama:tinyllama:1b" in out
    assert "LM Studio" in out and "lmstudio:acme/Tiny-GGUF" in out


def test_a_missing_store_model_is_a_usage_error_naming_the_flag(homes, capsys):
    from mlx_nursery.server.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", "ollama:nothing:here"])
    assert exit_.value.code == 2
    assert "--model: ollama:nothing:here: Ollama has no manifest" in capsys.readouterr().err


async def test_serve_takes_an_ollama_model_by_name(homes):
    gguf = homes / "tiny.gguf"
    write_gguf(gguf)
    ollama_store(homes / "ollama", "tinyllama", "1b", gguf)
    await assert_served_as("ollama:tinyllama:1b", "tinyllama:1b")
