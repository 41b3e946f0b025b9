"""Build the benchmark model: a deterministic float32 llama of about 30M parameters
with an 8,192-entry byte-level BPE tokenizer (every id decodes), into a cache
directory (not committed) keyed by a hash of this builder and what trains it
(``keyed.py``). No network: the tokenizer is trained on a seeded synthetic corpus.

    python goldens/make_bench_model.py [--out DIR]    # default: ensure()'s keyed folder
    python goldens/make_bench_model.py --if-missing   # build once, print the folder

``--shardable`` builds its scale-out twin, ``bench-llama-30m-h12``: hidden 576 in
12 attention heads and 6 KV heads of 48 dims (the 30M's 8 and 8 heads split 2
ways, not 3), so one model runs on 1, 2 and 3 ranks.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from keyed import built, keyed_dir
from make_models import CHAT_TEMPLATE, _weights
from mlx_lm.utils import _get_classes

VOCAB = 8192
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CONFIG = {
    "model_type": "llama",
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "vocab_size": VOCAB,
    "tie_word_embeddings": True,
}

SHARDABLE = {**CONFIG, "hidden_size": 576, "num_attention_heads": 12, "num_key_value_heads": 6}


def default_dir(shardable: bool = False) -> Path:
    """The cache folder keyed by this builder and the libraries that build it."""
    name = "bench-llama-30m-h12" if shardable else "bench-llama-30m"
    sources = [Path(__file__), Path(__file__).with_name("make_models.py")]
    return keyed_dir(name, sources, SHARDABLE if shardable else CONFIG)


def _corpus(rng: np.random.Generator, n_words: int = 200_000) -> list[str]:
    """Seeded pseudo-words with a Zipf-like frequency, so BPE learns real merges."""
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    weights = 1.0 / np.arange(1, 27)
    weights /= weights.sum()
    lexicon = [
        "".join(rng.choice(letters, size=rng.integers(2, 9), p=weights)) for _ in range(6000)
    ]
    ranks = rng.zipf(1.3, size=n_words) % len(lexicon)
    words = [lexicon[r] for r in ranks]
    return [" ".join(words[i : i + 50]) + "." for i in range(0, n_words, 50)]


def build_tokenizer(
    path: Path, rng: np.random.Generator, max_length: int = CONFIG["max_position_embeddings"]
) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(rng), trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": max_length,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
            sort_keys=True,
        )
    )


def build(out: Path, base: dict = CONFIG) -> Path:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    rng = np.random.default_rng(30)
    build_tokenizer(out, rng)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    config = {**base, "eos_token_id": vocab.get("<|im_end|>", 2)}
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.save_safetensors(str(out / "model.safetensors"), _weights(model, 3030), {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    return out


def ensure(out: Path | None = None, shardable: bool = False) -> Path:
    """The model directory, built once for what builds it."""
    config = SHARDABLE if shardable else CONFIG
    return built(out or default_dir(shardable), lambda folder: build(folder, config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--if-missing", action="store_true", help="keep an existing build")
    parser.add_argument("--shardable", action="store_true", help="the 12/6-head twin")
    args = parser.parse_args()
    out = args.out or default_dir(args.shardable)
    config = SHARDABLE if args.shardable else CONFIG
    print(ensure(out, args.shardable) if args.if_missing else build(out, config))


if __name__ == "__main__":
    main()
