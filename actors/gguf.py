"""GGUF in, mlx-lm model directory out.

A GGUF file (llama.cpp's format) becomes a directory mlx-lm loads as it is:
``model.safetensors``, ``config.json``, ``tokenizer.json`` and
``tokenizer_config.json`` (with the file's chat template and special tokens).
It is built once into a cache directory keyed by the file's sha256, written to a
temporary directory first and renamed into place, so a failed conversion never
leaves a half-written model behind.

Weights: Q4_0, Q4_1 and Q8_0 tensors stay quantized, read by ``mx.load`` straight
into MLX's affine layout (group 32; one file may mix widths, e.g. a Q8_0
embedding beside Q4_1 layers: each quantized layer is listed in the config with
its own bits); F32/F16/BF16 pass through; any other type (the K-quants, ...) is
dequantized to float32 with the ``gguf`` package, or refused naming the type.

Architectures: ``llama`` (SmolLM2, Llama, Mistral-style; llama.cpp stores the
Q/K rows in the interleaved RoPE order, hence ``rope_traditional``), ``qwen2`` and
``qwen3`` (stored in the original order). Anything else is refused by name.
Tokenizers: byte-level BPE (``tokenizer.ggml.model`` ``gpt2``), rebuilt from the
file's vocabulary and merges with the ``tokenizers`` library.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
# Read by mx.load into MLX's own layout: kept as they are.
NATIVE = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"}
ARCHITECTURES = ("llama", "qwen2", "qwen3")

_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp's pre-tokenizer names -> the split regex HF's tokenizer.json uses.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"\p{N}|", r"\p{N}{1,3}|", 1)
_PRE_SPLITS = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT}


class GGUFError(ValueError):
    """A GGUF file this server cannot serve; the message names the file and why."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_root() -> Path:
    """Where converted and downloaded models live (``MLX_NURSERY_CACHE`` overrides)."""
    env = os.environ.get("MLX_NURSERY_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "mlx-nursery"


def converted(path: str | Path, cache: Path | None = None) -> Path:
    """The mlx-lm directory for GGUF file ``path``: converted once, reused after."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    with path.open("rb") as f:
        if f.read(4) != MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
    root = (cache or cache_root()) / "models"
    out = root / f"{path.stem.lower()}-{sha256(path)[:16]}"
    if (out / "config.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=root))
    try:
        convert(path, tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def convert(path: Path, out: Path) -> None:
    """Write the mlx-lm model for GGUF ``path`` into directory ``out``."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # truncated or corrupt: the reader checks every offset
        raise GGUFError(f"{path}: cannot read the file ({type(exc).__name__}: {exc})") from None
    meta = {key: field.contents() for key, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    types = {t.name: gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors}
    if "rope_freqs.weight" in types:
        raise GGUFError(f"{path}: Llama-3-style RoPE scaling (rope_freqs) is not supported yet")
    weights = _weights(path, reader, types)
    config = _config(path, meta, arch, weights)
    tokenizer, tokenizer_config = _tokenizer(path, meta)
    import mlx.core as mx

    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    source = {"file": path.name, "tensor_types": dict(Counter(types.values()))}
    (out / "gguf_source.json").write_text(json.dumps(source, indent=2))


def _hf_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")  # weight | bias | scales | biases
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{suffix}"
    if len(parts) == 1 and parts[0] in _TOP:
        return f"{_TOP[parts[0]]}.{suffix}"
    raise GGUFError(f"tensor {name!r} has no place in the model")


def _weights(path: Path, reader: Any, types: dict[str, str]) -> dict[str, Any]:
    """Every tensor under its mlx-lm name: native types through mx.load, the rest
    dequantized to float32."""
    import mlx.core as mx

    if set(types.values()) <= NATIVE:
        loaded = mx.load(str(path))
    else:
        loaded = {t.name: mx.array(_dequantize(path, t)) for t in reader.tensors}
    try:
        return {_hf_name(name): value for name, value in loaded.items()}
    except GGUFError as exc:
        raise GGUFError(f"{path}: {exc}") from None


def _dequantize(path: Path, tensor: Any) -> np.ndarray:
    import gguf

    qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))
    if qtype.name in ("F32", "F16"):
        return np.asarray(tensor.data, dtype=np.float32).reshape(shape)
    try:
        values = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise GGUFError(
            f"{path}: tensor {tensor.name} uses quantization {qtype.name}, which cannot be "
            "read here; use a file quantized as Q4_0, Q4_1, Q8_0, a K-quant or F16"
        ) from None
    return np.asarray(values, dtype=np.float32).reshape(shape)


def _config(path: Path, meta: dict, arch: str, weights: dict) -> dict:
    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"{path}: metadata {arch}.{key} is missing")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    vocab = int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"]))
    config = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "vocab_size": vocab,
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        # llama.cpp permutes llama's Q/K rows into the interleaved RoPE order.
        "rope_traditional": arch == "llama",
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
    }
    if arch == "llama":
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in weights
        config["mlp_bias"] = False
    quantization = _quantization(weights)
    if quantization:
        config["quantization"] = quantization
    return config


def _quantization(weights: dict) -> dict | None:
    """mlx-lm's quantization config: the common width, and each layer's own."""
    layers = {}
    for name, scales in weights.items():
        if not name.endswith(".scales"):
            continue
        layer = name.removesuffix(".scales")
        packed = weights[f"{layer}.weight"].shape[-1]
        group = 32
        bits = packed * 32 // (scales.shape[-1] * group)
        layers[layer] = {"group_size": group, "bits": int(bits)}
    if not layers:
        return None
    ((bits, _),) = Counter(q["bits"] for q in layers.values()).most_common(1)
    return {"group_size": 32, "bits": bits, "mode": "affine", **layers}


def _tokenizer(path: Path, meta: dict) -> tuple[Any, dict]:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"{path}: tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tokenizer = Tokenizer(bpe)
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _PRE_SPLITS)
    steps = []
    if pre in _PRE_SPLITS:
        steps.append(pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"))
    elif pre == "smollm":
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*steps, byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    special = [t for t, kind in zip(tokens, types, strict=True) if kind in (3, 4)]  # control, user
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if add_bos and token("bos") is not None:
        from tokenizers import processors

        bos = token("bos")
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
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
    return tokenizer, {k: v for k, v in config.items() if v is not None}
