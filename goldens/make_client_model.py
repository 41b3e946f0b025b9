"""Build the model the real clients (Claude Code, Codex, the Agents SDK) talk to
in the suite: a tiny deterministic float32 llama with the benchmark model's
8,192-entry BPE tokenizer and a 131,072-token context, so a coding agent's whole
first request (Claude Code's is ~19k tokens of system prompt and tools) fits
with the output it asks for. What it says is noise: the protocol is under test.

Its output head makes the end token likely (``EOS_GAIN``): a noise model would
otherwise write until ``max_tokens`` (Claude Code asks 64,000), and a short
answer is all the suite needs. No network: the tokenizer is trained on the
benchmark's seeded synthetic corpus.

    python goldens/make_client_model.py [--out DIR]    # default ~/.cache/mlx-nursery/client-llama
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from make_bench_model import build_tokenizer
from make_models import _weights
from mlx_lm.utils import _get_classes

CONTEXT = 131072
CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": CONTEXT,
    "vocab_size": 8192,
    "tie_word_embeddings": False,
}
# The end token's row of the output head: this many times a fixed unit vector.
# Other logits spread with a std of about 3 (so their max is about 12): the end
# token wins at roughly one position in five.
EOS_GAIN = 15.0


def default_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "mlx-nursery" / "client-llama"


def build(out: Path) -> Path:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    build_tokenizer(out, np.random.default_rng(30), CONTEXT)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    eos = vocab["<|im_end|>"]
    config = {**CONFIG, "eos_token_id": eos}
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = _weights(model, 4040)
    head = np.array(weights["lm_head.weight"])
    unit = np.ones(CONFIG["hidden_size"], np.float32) / np.sqrt(CONFIG["hidden_size"])
    head[eos] = EOS_GAIN * unit
    weights["lm_head.weight"] = mx.array(head)
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    return out


def ensure(out: Path | None = None) -> Path:
    """The model directory, built once."""
    out = out or default_dir()
    if not (out / "model.safetensors").exists():
        build(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--if-missing", action="store_true", help="keep an existing build")
    args = parser.parse_args()
    print(ensure(args.out) if args.if_missing else build(args.out or default_dir()))


if __name__ == "__main__":
    main()
