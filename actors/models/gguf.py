"""GGUF in, mlx-lm model directory out.

A GGUF file (llama.cpp's format) becomes a directory mlx-lm loads as it is:
``model*.safetensors``, ``config.json``, ``tokenizer.json`` and
``tokenizer_config.json`` (with the file's chat template and special tokens).
It is built once into a cache directory keyed by the file's sha256 (and, for a
file that has to be re-quantized, by the mode), written to a temporary
directory first and renamed into place, so a failed conversion never leaves a
half-written model behind.

Weights, tensor by tensor (``gguf_tensors``): floats pass through; Q4_0, Q4_1 and
Q8_0 are repacked exactly into MLX's affine layout; every other type the
``gguf`` package reads (K-quants, Q5_x, IQ...) goes into MLX's affine 4 or 8 bits,
its levels kept where its blocks allow, else re-quantized (mode ``affine``, the
default), or is dequantized to the float dtype the model is loaded in (modes
``float32``, ``float16``, ``bfloat16``), so ``--dtype float32`` computes with the
file's exact values.

Architectures (``ARCHITECTURES``) map to the mlx-lm model class of the same
family: ``llama`` (SmolLM2, Llama 2/3 with Llama-3 RoPE scaling, Mistral-style;
llama.cpp stores the Q/K rows in the interleaved RoPE order, hence
``rope_traditional``), ``qwen2``, ``qwen3``, ``qwen2moe`` and ``qwen3moe`` (experts
into mlx-lm's switch layers), ``phi3`` and ``gemma3``. Anything else is refused
by name. Tokenizers (``gguf_tokenizer``): byte-level BPE and SentencePiece.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from ..paths import cache_root, sha256
from .gguf_tensors import FLOAT, REPACKED, TensorError, convert_tensor, dequantize
from .gguf_tokenizer import TokenizerError, build_tokenizer

MAGIC = b"GGUF"
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "phi3", "gemma3")
MODEL_TYPE = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
MODES = ("affine", "float32", "float16", "bfloat16")
SHARD_BYTES = 2 << 30  # safetensors files of at most about this much

_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    # mixture of experts: the router, the stacked experts, the shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_ARCH_LAYER = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # gate and up, fused as in the HF model
    "gemma3": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Not weights: RoPE frequency factors, read into the config.
_ROPE_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")


class GGUFError(ValueError):
    """A GGUF file this server cannot serve; the message names the file and why."""


def file_digest(path: Path) -> str:
    """The file's sha256: read from the name of a content-addressed blob
    (Ollama's ``sha256-<hex>``, checked by Ollama when it pulled it), else
    computed (a large file takes a while)."""
    if re.fullmatch(r"sha256-[0-9a-f]{64}", path.name):
        return path.name.removeprefix("sha256-")
    return sha256(path)


def converted(
    path: str | Path, cache: Path | None = None, mode: str = "affine", name: str | None = None
) -> Path:
    """The mlx-lm directory for GGUF file ``path``: converted once, reused after.

    ``mode`` says what becomes of tensors MLX cannot keep as they are (see the
    module doc); a file without any shares one directory across modes. ``name``
    names the cache entry (default: the file's stem)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    with path.open("rb") as f:
        if f.read(4) != MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
    root = (cache or cache_root()) / "models"
    stem = (name or path.stem).lower().replace("/", "-").replace(":", "-")
    base = root / f"{stem}-{file_digest(path)[:16]}"
    out = base if mode == "affine" else base.with_name(f"{base.name}-{mode}")
    for candidate in (out, base):
        if (candidate / "config.json").is_file() and (
            candidate == out or not _source(candidate).get("converted")
        ):
            return candidate
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=root))
    try:
        if not convert(path, tmp, mode):
            out = base  # nothing depended on the mode
        if (out / "config.json").is_file():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _source(folder: Path) -> dict:
    try:
        return json.loads((folder / "gguf_source.json").read_text())
    except (OSError, ValueError):
        return {}


def convert(path: Path, out: Path, mode: str = "affine") -> bool:
    """Write the mlx-lm model for GGUF ``path`` into directory ``out``; True
    when some tensor was re-quantized or dequantized (the result depends on
    ``mode``)."""
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
    try:
        tokenizer, tokenizer_config = build_tokenizer(meta)
        names, quant, rope = _write_weights(reader, types, arch, mode, out)
    except (TensorError, TokenizerError) as exc:
        raise GGUFError(f"{path}: {exc}") from None
    config = _config(path, meta, arch, names, rope)
    if quant:
        widths = Counter((q["bits"], q["group_size"]) for q in quant.values())
        ((bits, group), _) = widths.most_common(1)[0]
        config["quantization"] = {"group_size": group, "bits": bits, "mode": "affine", **quant}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    changed = any(t not in FLOAT | REPACKED for t in types.values())
    source = {
        "file": path.name,
        "tensor_types": dict(Counter(types.values())),
        "converted": mode if changed else None,
    }
    (out / "gguf_source.json").write_text(json.dumps(source, indent=2))
    return changed


def _hf_name(name: str, arch: str) -> str:
    base, _, suffix = name.rpartition(".")  # weight | bias
    parts = base.split(".")
    layer = _LAYER | _ARCH_LAYER.get(arch, {})
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}.{suffix}"
    if len(parts) == 1 and parts[0] in _TOP:
        return f"{_TOP[parts[0]]}.{suffix}"
    raise TensorError(f"tensor {name!r} has no place in a {arch} model")


def _write_weights(
    reader: Any, types: dict[str, str], arch: str, mode: str, out: Path
) -> tuple[set[str], dict[str, dict], dict[str, np.ndarray]]:
    """Every tensor under its mlx-lm name, written tensor by tensor into
    safetensors shards (so a large file is never held in float32 at once).
    Returns the names written, each quantized layer's quantization, and the
    RoPE factor tensors (which go into the config)."""
    shards = _Shards(out)
    quant: dict[str, dict] = {}
    rope: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        qtype = types[tensor.name]
        base = tensor.name.removesuffix(".weight")
        if base in _ROPE_TENSORS:
            size = int(np.prod(tensor.shape))
            rope[base] = dequantize(tensor.name, np.asarray(tensor.data), qtype, (size,))
            continue
        name = _hf_name(tensor.name, arch)
        made = convert_tensor(tensor, qtype, mode)
        if name.endswith(".bias"):
            shards.add(name, made.arrays["weight"])
            continue
        layer = name.removesuffix(".weight")
        if arch == "gemma3" and layer.endswith("norm"):
            # llama.cpp stores Gemma's norms as 1 + w; mlx-lm's RMSNorm adds the 1.
            made.arrays["weight"] = made.arrays["weight"] - 1
        for suffix, array in made.arrays.items():
            shards.add(f"{layer}.{suffix}", array)
        if made.bits is not None:
            quant[layer] = {"group_size": made.group_size, "bits": made.bits}
    shards.close()
    return shards.names, quant, rope


class _Shards:
    """safetensors files of about ``SHARD_BYTES`` each, with mlx-lm's index."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._pending: dict[str, Any] = {}
        self._bytes, self._files, self._index = 0, 0, {}

    @property
    def names(self) -> set[str]:
        """Every tensor name added."""
        return {*self._index, *self._pending}

    def add(self, name: str, array: Any) -> None:
        import mlx.core as mx

        mx.eval(array)
        self._pending[name] = array
        self._bytes += array.nbytes
        if self._bytes >= SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        import mlx.core as mx

        if not self._pending:
            return
        self._files += 1
        file = f"model-{self._files:05d}.safetensors"
        mx.save_safetensors(str(self.out / file), self._pending, metadata={"format": "mlx"})
        self._index |= dict.fromkeys(self._pending, file)
        self._pending, self._bytes = {}, 0

    def close(self) -> None:
        self._flush()
        index = {"metadata": {}, "weight_map": dict(sorted(self._index.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _config(path: Path, meta: dict, arch: str, names: set[str], rope: dict) -> dict:
    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"{path}: metadata {arch}.{key} is missing")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    vocab = int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"]))
    layers = int(get("block_count"))
    config = {
        "model_type": MODEL_TYPE.get(arch, arch),
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": int(get("feed_forward_length", 0)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "vocab_size": vocab,
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        # llama.cpp permutes llama's Q/K rows into the interleaved RoPE order.
        "rope_traditional": arch == "llama",
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "lm_head.weight" not in names,
        "eos_token_id": _eos_ids(meta),
    }
    if arch == "llama":
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in names
        config["mlp_bias"] = False
    if arch in ("qwen2moe", "qwen3moe"):
        config |= {
            "num_experts": int(get("expert_count")),
            "num_experts_per_tok": int(get("expert_used_count")),
            "moe_intermediate_size": int(get("expert_feed_forward_length")),
        }
    if arch == "qwen2moe":
        config["shared_expert_intermediate_size"] = int(
            get("expert_shared_feed_forward_length")
        )
    if arch == "qwen3moe":
        # llama.cpp always renormalizes Qwen3-MoE's top-k router weights.
        config |= {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    if arch == "phi3":
        rotary = int(meta.get("phi3.rope.dimension_count") or head_dim)
        config["partial_rotary_factor"] = rotary / head_dim
        original = meta.get("phi3.rope.scaling.original_context_length")
        if original:
            config["original_max_position_embeddings"] = int(original)
    if arch == "gemma3":
        config |= _gemma3(meta, hidden, heads, head_dim, layers)
    scaling = _rope_scaling(path, meta, arch, rope, head_dim, config)
    if scaling:
        config["rope_scaling"] = scaling
    return config


def _eos_ids(meta: dict) -> list[int] | int:
    """The end-of-sequence token and the end-of-turn ones the file names
    (Gemma marks turns with ``<end_of_turn>``, which its metadata may not name)."""
    ids = [int(meta["tokenizer.ggml.eos_token_id"])]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if meta.get(key) is not None:
            ids.append(int(meta[key]))
    if meta.get("general.architecture") == "gemma3":
        tokens = meta["tokenizer.ggml.tokens"]
        ids += [i for i, t in enumerate(tokens[:1024]) if t == "<end_of_turn>"]
    ids = list(dict.fromkeys(ids))
    return ids[0] if len(ids) == 1 else ids


def _gemma3(meta: dict, hidden: int, heads: int, head_dim: int, layers: int) -> dict:
    """What a Gemma 3 file leaves to the loader (llama.cpp's own choices):
    the local RoPE base, the window pattern, and the query scale (27B, 62
    layers, scales by hidden / heads, the others by the head size)."""
    return {
        "sliding_window": int(meta.get("gemma3.attention.sliding_window") or 512),
        "sliding_window_pattern": int(meta.get("gemma3.attention.sliding_window_pattern") or 6),
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
    }


def _rope_scaling(
    path: Path, meta: dict, arch: str, rope: dict, head_dim: int, config: dict
) -> dict | None:
    """mlx-lm's ``rope_scaling`` for the file: Llama 3's (recovered from the
    ``rope_freqs`` factors llama.cpp precomputes), Phi-3's long/short factors,
    or linear scaling from the metadata."""
    if "rope_freqs" in rope:
        return _llama3_scaling(path, rope["rope_freqs"], config, head_dim)
    if "rope_factors_long" in rope:
        long = [float(x) for x in rope["rope_factors_long"]]
        short = rope.get("rope_factors_short")
        return {
            "type": "longrope",
            "long_factor": long,
            "short_factor": long if short is None else [float(x) for x in short],
        }
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or not factor or float(factor) == 1.0:
        return None
    if kind != "linear":
        raise GGUFError(
            f"{path}: RoPE scaling {kind!r} is not supported (linear and Llama 3's are)"
        )
    return {"type": "linear", "rope_type": "linear", "factor": float(factor)}


def _llama3_scaling(path: Path, factors: np.ndarray, config: dict, head_dim: int) -> dict:
    """Llama 3's RoPE scaling from llama.cpp's per-frequency factors.

    Each frequency's wavelength is divided by 1 (high frequencies), by
    ``factor`` (low ones) or, between, by ``1 / ((1 - s) / factor + s)`` where
    ``s = C / wavelength * a - b`` is linear in the inverse wavelength. Two
    in-between frequencies fix ``a`` and ``b``; any original context ``C`` then
    gives the same frequencies (the file's own, else 8192). The recovered
    parameters are checked by recomputing every factor."""
    base = config["rope_theta"]
    dims = 2 * len(factors)
    freqs = base ** (-np.arange(0, dims, 2) / dims)
    wavelen = 2 * math.pi / freqs
    factor = float(factors.max())
    original = 8192
    if factor <= 1.0:
        return None  # type: ignore[return-value]
    middle = np.where((factors > 1.0 + 1e-6) & (factors < factor - 1e-6))[0]
    if len(middle) >= 2:
        s = (1 / factors[middle] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(1 / wavelen[middle], s, 1)  # s = a / wavelength + b
        spread = original / a  # high_freq_factor - low_freq_factor
        low = -b * spread
        high = low + spread
    else:  # a sharp step: place both edges at it
        step = int(np.argmax(factors > 1.0 + 1e-6))
        low = original / wavelen[step] * 0.999
        high = original / wavelen[max(step - 1, 0)] * 1.001
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(low),
        "high_freq_factor": float(high),
        "original_max_position_embeddings": original,
    }
    if not np.allclose(_llama3_factors(scaling, wavelen), factors, rtol=1e-3, atol=1e-4):
        raise GGUFError(f"{path}: its rope_freqs are not Llama 3's RoPE scaling")
    return scaling


def _llama3_factors(scaling: dict, wavelen: np.ndarray) -> np.ndarray:
    """The factors llama.cpp writes for ``scaling`` (the inverse of mlx-lm's
    frequency rule), to check a recovery against."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    smooth = (original / wavelen - low) / (high - low)
    out = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < original / high, 1.0, out)
    return np.where(wavelen > original / low, factor, out)
