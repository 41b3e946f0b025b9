"""Build the model the real clients (Claude Code, Codex, the Agents SDK) talk to
in the suite: a tiny deterministic float32 llama with a 16,384-entry byte-level
BPE tokenizer and a 131,072-token context, so a coding agent's whole first
request (Claude Code's is ~19k tokens of system prompt and tools) fits with the
output it asks for. What it says is noise: the protocol is under test.

The tokenizer is trained on a fixed corpus committed for the purpose
(``corpus/client-english.json``: the strings of the clients' requests as they
were captured): a tokenizer that knows that text keeps their prompts short, and
the prefill (quadratic in length) cheap. Nothing it is built from changes with
the docs or the code, and its cache is keyed by a hash of this file, its
corpus and the libraries that train it (``keyed.py``).

Its answers end by construction, never by luck: two residual dimensions carry
constants the layer never writes (its attention and MLP outputs are zero there),
one the same for every token, one that says whether the current token is the
answer word (``WORD``). The output head reads only those two for the end token,
the answer word and the JSON closers: after any other token the answer word wins,
after the answer word the end token does. A free answer is the answer word, then
the end; inside a grammar (a tool call's arguments, a schema), where the end
token is masked, a string holds the word and closes, an object or array closes
as soon as the grammar lets it; whitespace, which JSON allows between any two
tokens, always loses. The other logits are the random model's noise, well
below those (``check`` holds the margins at build time). No network.

    python goldens/make_client_model.py [--out DIR]    # default: ensure()'s keyed folder
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from keyed import built, keyed_dir
from make_models import CHAT_TEMPLATE, ONE_LAYER, _weights
from mlx_lm.utils import _get_classes

HERE = Path(__file__).resolve().parent
CONTEXT = 131072
VOCAB = 16384
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CONFIG = {**ONE_LAYER, "max_position_embeddings": CONTEXT, "vocab_size": VOCAB,
          "tie_word_embeddings": False}  # fmt: skip
# The two residual dimensions the answer's shape is written in (see the module
# docstring), and the constant each carries: large beside the rest of the residual
# (the random layer writes a std of about 17 there), so after the final norm they
# hold most of it.
CONSTANT, IS_WORD, CARRY = 0, 1, 64.0
WORD = "ok"  # what a free answer says
# The head's weight on the constant dimension, per token, in units of ``GAIN``; the
# answer word also reads the word dimension (minus: high after any other token).
GAIN = 6.0
# The quote above the brackets: inside a JSON string a bracket is a character too,
# and only the quote closes it.
ROWS = {"end": 3.0, '"': 2.5, "}": 2.0, "]": 2.0}
WORD_ROW = (2.0, -2.0)  # after another token 4.0, after itself 0.0
# Tokens of whitespace alone read the constant dimension negatively: a grammar
# lets JSON hold whitespace between any two of its tokens, and a random model
# that picks a space there picks it again after it, forever.
SPACE_ROW = -2.0
MARGIN = 8.0  # the least a decision must win by, in logits (check)
CORPUS = HERE / "corpus" / "client-english.json"


def corpus() -> list[str]:
    """The committed corpus the tokenizer learns from."""
    return json.loads(CORPUS.read_text())


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


def _spaces(path: Path) -> list[int]:
    """The ids of the tokens that decode to whitespace alone."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    return [i for i in range(tok.get_vocab_size()) if not tok.decode([i]).strip()
            and tok.id_to_token(i) not in SPECIALS]  # fmt: skip


def _shaped(weights: dict[str, mx.array], vocab: dict[str, int],
            spaces: list[int]) -> dict[str, mx.array]:  # fmt: skip
    """The random weights with the answer's shape written in (module docstring)."""
    w = {k: np.array(v) for k, v in weights.items()}
    prefix = "model.layers.0."
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        w[prefix + name][[CONSTANT, IS_WORD]] = 0.0  # the layer never writes them
    embed = w["model.embed_tokens.weight"]
    embed[:, CONSTANT] = CARRY
    embed[:, IS_WORD] = -CARRY
    embed[vocab[WORD], IS_WORD] = CARRY
    head = w["lm_head.weight"]
    head[:, [CONSTANT, IS_WORD]] = 0.0
    head[spaces] = 0.0
    head[spaces, CONSTANT] = GAIN * SPACE_ROW
    for name, weight in ROWS.items():
        row = head[vocab["<|im_end|>" if name == "end" else name]]
        row[:] = 0.0
        row[CONSTANT] = GAIN * weight
    row = head[vocab[WORD]]
    row[:] = 0.0
    row[CONSTANT], row[IS_WORD] = GAIN * WORD_ROW[0], GAIN * WORD_ROW[1]
    return {k: mx.array(v) for k, v in w.items()}


def check(model, vocab: dict[str, int], spaces: list[int]) -> None:
    """Every position of a sample of the corpus decides as the docstring says, each
    decision winning by ``MARGIN``: after the word the end token, after any other
    the word; a quote beats every token outside the shape, and every token
    beats whitespace."""
    special = {vocab[WORD], vocab["<|im_end|>"], *(vocab[n] for n in ROWS if n != "end"), *spaces}
    noise = np.array([i for i in range(model.args.vocab_size) if i not in special])
    ids = [vocab.get(c, 0) for c in "".join(corpus()[:40])[:2000]]  # a byte-ish sample
    ids = [*ids[:500], vocab[WORD], *ids[500:520], vocab[WORD], vocab[WORD]]
    logits = np.array(model(mx.array([ids]))[0])
    word, end, quote = vocab[WORD], vocab["<|im_end|>"], vocab['"']
    for tok, row in zip(ids, logits, strict=True):
        best = int(np.argmax(row))
        want = end if tok == word else word
        rest = np.delete(row, want)
        if best != want or row[want] - rest.max() < MARGIN:
            raise RuntimeError(f"client model: after token {tok} the {want} does not win by "
                               f"{MARGIN} (best {best}, margin {row[want] - rest.max():.1f})")
        if row[quote] - row[noise].max() < MARGIN:
            raise RuntimeError(f"client model: a quote does not beat the noise by {MARGIN}")
        if row[noise].min() - row[spaces].max() < MARGIN:
            raise RuntimeError(f"client model: whitespace does not lose to every token by {MARGIN}")


def build(out: Path) -> Path:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    build_tokenizer(out)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    config = {**CONFIG, "eos_token_id": vocab["<|im_end|>"],
              "vocab_size": max(VOCAB, len(vocab))}  # fmt: skip
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    spaces = _spaces(out)
    weights = _shaped(_weights(model, 4040), vocab, spaces)
    model.load_weights(list(weights.items()))
    check(model, vocab, spaces)
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    return out


def default_dir() -> Path:
    """The cache folder keyed by this builder, its corpus and what trains it."""
    sources = [Path(__file__), HERE / "make_models.py", CORPUS]
    return keyed_dir("client-llama", sources, CONFIG)


def ensure(out: Path | None = None) -> Path:
    """The model directory, built once for what builds it."""
    return built(out or default_dir(), build)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--if-missing", action="store_true", help="keep an existing build")
    args = parser.parse_args()
    out = args.out or default_dir()
    print(ensure(out) if args.if_missing else build(out))


if __name__ == "__main__":
    main()
