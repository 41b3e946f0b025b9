"""A GGUF file's tokenizer, rebuilt with the ``tokenizers`` library.

- ``gpt2`` (byte-level BPE): the vocabulary and merges as the file spells them;
  the split pattern from ``tokenizer.ggml.pre``.
- ``llama`` (SentencePiece BPE: Llama 2, Mistral, Phi-3, Gemma): the file has
  pieces, scores and token types but no merges. SentencePiece merges, at each
  step, the adjacent pair whose joined piece scores best, so the merges are
  every split of a normal piece into two normal pieces, ranked by the joined
  piece's score (Gemma's scores do not follow its merge order: its file order
  does). Byte fallback (``<0xNN>`` pieces) covers what the vocabulary lacks.
  The space marker ``▁`` replaces spaces and is prefixed to each stretch of
  text (``add_space_prefix``, on unless the file says otherwise; Gemma's is
  off); the decoder undoes all of it.
  Control tokens are special; user-defined ones are matched whole, in the
  normalized text as SentencePiece matches them.
"""

from __future__ import annotations

from typing import Any

SPACE = "\u2581"  # SentencePiece's space marker
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's pre-tokenizer names -> the split regex HF's tokenizer.json uses (any
# other name: ByteLevel's own GPT-2 split).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"\p{N}|", r"\p{N}{1,3}|", 1)
_PRE_SPLITS = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT}
MODELS = ("gpt2", "llama")


class TokenizerError(ValueError):
    """A tokenizer this converter cannot rebuild; the message says which and why."""


def build_tokenizer(meta: dict) -> tuple[Any, dict]:
    """The ``tokenizers.Tokenizer`` and the ``tokenizer_config.json`` for the
    file whose metadata is ``meta``."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level(meta)
    elif kind == "llama":
        tokenizer = _sentencepiece(meta)
    else:
        raise TokenizerError(
            f"tokenizer model {kind!r} is not supported; supported: {', '.join(MODELS)} "
            "(byte-level BPE and SentencePiece BPE)"
        )
    return tokenizer, _config(meta, tokenizer)


def _byte_level(meta: dict) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _PRE_SPLITS)
    steps = []
    if pre in _PRE_SPLITS:
        steps.append(pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"))
    elif pre == "smollm":
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*steps, byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    types = _types(meta, tokens)
    special = [t for t, kind in zip(tokens, types, strict=True) if kind in (CONTROL, USER_DEFINED)]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tokenizer


def _sentencepiece(meta: dict) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    arch = meta.get("general.architecture")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = _types(meta, tokens)
    if arch == "gemma3":
        # Gemma stores its runs of spaces as spaces; its text has them as the marker.
        tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
        rank = {i: i for i in range(len(tokens))}
    else:
        scores = list(meta.get("tokenizer.ggml.scores") or [-i for i in range(len(tokens))])
        rank = {i: -float(s) for i, s in enumerate(scores)}
    vocab = {t: i for i, t in enumerate(tokens)}
    unknown = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unknown)] if unknown is not None else None
    bpe = models.BPE(
        vocab=vocab, merges=spm_merges(tokens, types, rank), unk_token=unk, fuse_unk=True,
        byte_fallback=True,
    )  # fmt: skip
    tokenizer = Tokenizer(bpe)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # SentencePiece's own rule (and the Llama 2 / Mistral tokenizer.json files'):
    # the marker before every stretch of text, a leading space kept as a second
    # marker. llama.cpp prefixes each stretch between special tokens alike.
    replace = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if prefix else replace
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    kinds = list(zip(tokens, types, strict=True))
    control = [AddedToken(t, special=True, normalized=False) for t, k in kinds if k == CONTROL]
    tokenizer.add_special_tokens(control)
    # SentencePiece matches user-defined pieces whole in the normalized text
    # (Gemma's runs of spaces and newlines among them).
    tokenizer.add_tokens([AddedToken(t, normalized=True) for t, k in kinds if k == USER_DEFINED])
    return tokenizer


def spm_merges(tokens: list[str], types: list[int], rank: dict[int, float]) -> list[tuple]:
    """SentencePiece BPE's merges: every split of a normal piece into two
    normal pieces, best joined piece first (``rank``: lower is better)."""
    normal = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    found = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                found.append((rank[i], normal[left], normal[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _types(meta: dict, tokens: list[str]) -> list[int]:
    return [int(k) for k in meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]


def _config(meta: dict, tokenizer: Any) -> dict:
    """``tokenizer_config.json``: the special tokens, BOS handling, the chat
    template (a BOS post-processor is set on ``tokenizer`` when the file asks
    for one)."""
    from tokenizers import processors

    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is None or not 0 <= int(i) < len(tokens):
            return None
        return tokenizer.id_to_token(int(i))

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    bos = token("bos")
    if add_bos and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, int(meta["tokenizer.ggml.bos_token_id"]))],
        )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": add_bos,
        "model_max_length": int(meta.get(f"{meta['general.architecture']}.context_length", 0)),
        "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return {k: v for k, v in config.items() if v is not None}
