"""Build the model the real clients (Claude Code, Codex, the Agents SDK) talk to
in the suite: a tiny deterministic float32 llama with a 16,384-entry byte-level
BPE tokenizer and a 131,072-token context, so a coding agent's whole first
request (Claude Code's is ~19k tokens of system prompt and tools) fits with the
output it asks for. What it says is noise: the protocol is under test.

The tokenizer is trained on the repository's own English: the clients' captured
requests (tests/fixtures/clients/) and docs/. A tokenizer that knows that text
keeps their prompts short, and the prefill (quadratic in length) cheap.

Its output head makes the end token likely (``EOS_GAIN``): a noise model would
otherwise write until ``max_tokens`` (Claude Code asks 64,000), and a short
answer is all the suite needs. No network.

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
from make_models import CHAT_TEMPLATE, _weights
from mlx_lm.utils import _get_classes

HERE = Path(__file__).resolve().parent
CONTEXT = 131072
VOCAB = 16384
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    # One layer of one head: on a CPU, attention over a long prompt costs a score
    # matrix per head and layer, and that is most of a 20k-token prefill.
    "num_hidden_layers": 1,
    "intermediate_size": 128,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": CONTEXT,
    "vocab_size": VOCAB,
    "tie_word_embeddings": False,
}
# The end token's row of the output head: this many times a fixed unit vector.
# Other logits spread with a std of about 3 (so their max is about 12): the end
# token wins at roughly one position in five. The quote and the closing brace get
# a gain too, so a JSON string or object the grammar holds open (a tool call's
# arguments, where the end token is masked) closes within a few tokens.
EOS_GAIN = 15.0
CLOSERS_GAIN = 13.0


def default_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "mlx-nursery" / "client-llama"


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def corpus() -> list[str]:
    """The repository's English, in a fixed order."""
    root = HERE.parent
    texts = []
    for path in sorted((root / "tests" / "fixtures" / "clients").glob("*.json")):
        texts.extend(_strings(json.loads(path.read_text())))
    texts.extend(p.read_text() for p in sorted((root / "docs").glob("*.md")))
    return texts


def build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "model_max_length": CONTEXT, "chat_template": CHAT_TEMPLATE}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1, sort_keys=True))


def build(out: Path) -> Path:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    build_tokenizer(out)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    eos = vocab["<|im_end|>"]
    config = {**CONFIG, "eos_token_id": eos, "vocab_size": max(VOCAB, len(vocab))}
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = _weights(model, 4040)
    head = np.array(weights["lm_head.weight"])
    unit = np.ones(CONFIG["hidden_size"], np.float32) / np.sqrt(CONFIG["hidden_size"])
    head[eos] = EOS_GAIN * unit
    for closer in ('"', "}"):
        head[vocab[closer]] = CLOSERS_GAIN * unit
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
