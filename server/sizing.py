"""What a model costs the memory budget (``docs/models.md``): a loaded model's
charge (its weights, its KV budget and a step's workspace), and the estimate
before its first load, read from its safetensors headers and config.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from mlx_nursery.actors import Engine, EngineSettings
from mlx_nursery.actors.budget import auto_budget
from mlx_nursery.actors.kernels import packed
from mlx_nursery.actors.models.load import float_dtype
from mlx_nursery.actors.models.registry import resolve

SHARE_OF_BUDGET = 4  # several models: an ``auto`` KV budget is the memory budget / this


def charge_of(engine: Engine) -> int:
    """A loaded model's reservation: its weights, its KV budget and a step's
    workspace."""
    info, s = engine.info, engine.settings
    args = vars(getattr(engine.model, "args", None) or {})
    return (
        info.weights_bytes
        + (engine.kv_budget or 0)
        + workspace(Shape.of(args, info.vocab_size), s.prefill_step_size, s.batch)
    )


@attrs.frozen
class Shape:
    """What a step's transient bytes scale with."""

    vocab: int
    hidden: int
    heads: int

    @classmethod
    def of(cls, config: Mapping[str, Any], vocab: int | None = None) -> Shape:
        config = {**(config.get("text_config") or {}), **config}
        return cls(
            vocab or config.get("vocab_size") or 32_000,
            config.get("hidden_size") or config.get("d_model") or 4096,
            config.get("num_attention_heads") or config.get("n_heads") or 32,
        )


def workspace(shape: Shape, prefill_step: int, batch: int) -> int:
    """A step's transient bytes, roughly, in float32: a decode batch's logits
    and what sampling makes of them; a prefill chunk's hidden states and MLP
    activations (16 hidden-widths a token) and its attention scores."""
    logits = (batch + 1) * shape.vocab * 4 * 2
    chunk = prefill_step * shape.hidden * 4 * 16 + shape.heads * prefill_step**2 * 4
    return logits + chunk


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4,
                "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}  # fmt: skip


_FLOATS = ("F64", "F32", "F16", "BF16")


def estimate(ref: Any, settings: EngineSettings) -> int:
    """A model's charge before its first load, from its safetensors headers and
    config: float tensors at the dtype it will be cast to, and quantized layers
    dequantized where it is cast to float32 (as ``load.cast`` does); 0 where it
    cannot be read (measured once loaded). Runs in a worker thread (a GGUF file
    is converted here, once)."""
    if not isinstance(ref, str | Path):
        return 0
    dtype = float_dtype(settings.dtype)
    path = Path(resolve(ref, dtype))
    if not path.is_dir():
        return 0
    config_file = path / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    tensors: dict[str, dict] = {}
    for file in path.glob("*.safetensors"):
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            tensors.update(json.loads(f.read(size)))
    tensors.pop("__metadata__", None)
    quantization = config.get("quantization") or {}
    weights = weights_bytes(tensors, quantization, dtype)
    if settings.packed_weights:
        weights += packed_bytes(tensors, quantization, dtype)
    kv = settings.kv_budget if isinstance(settings.kv_budget, int) else 0
    return weights + kv + workspace(Shape.of(config), settings.prefill_step_size, settings.batch)


def weights_bytes(tensors: Mapping[str, dict], quantization: Mapping[str, Any],
                  dtype: str | None) -> int:  # fmt: skip
    """The bytes of a model's weights once loaded and cast to ``dtype``, from its
    safetensors headers (name -> dtype and shape) and its quantization config."""
    cast = {"float32": 4, "float16": 2, "bfloat16": 2}.get(str(dtype))
    dequantize = dtype == "float32"
    total = 0
    for name, t in tensors.items():
        base, _, part = name.rpartition(".")
        packed = dequantize and f"{base}.scales" in tensors
        if packed and part in ("scales", "biases"):
            continue  # folded into the dequantized weight
        n = math.prod(t["shape"])
        if packed and part == "weight":
            n = n * 32 // _bits(quantization, base)
            total += n * 4
            continue
        width = cast if cast and t["dtype"] in _FLOATS else _DTYPE_BYTES.get(t["dtype"], 4)
        total += n * width
    return total


def packed_bytes(tensors: Mapping[str, dict], quantization: Mapping[str, Any],
                 dtype: str | None) -> int:  # fmt: skip
    """The packed copies ``--packed-weights`` will add at load (``kernels.packed``):
    the model's 2-D float32 weights (quantized ones dequantized to float32)."""
    shapes = {}
    for name, t in tensors.items():
        base, _, part = name.rpartition(".")
        if part != "weight" or len(t["shape"]) != 2:
            continue
        n, k = t["shape"]
        if f"{base}.scales" in tensors:  # packed words: dequantized where cast to float32
            if dtype != "float32":
                continue
            k = k * 32 // _bits(quantization, base)
        elif (dtype or t["dtype"].lower()) not in ("float32", "f32"):
            continue
        shapes[base] = (n, k, f"{base}.bias" in tensors)
    return packed.estimate(shapes)


def _bits(quantization: Mapping[str, Any], base: str) -> int:
    layer = quantization.get(base)
    bits = (layer or {}).get("bits") if isinstance(layer, Mapping) else None
    return bits or quantization.get("bits") or 4


def auto_memory_budget() -> int:
    """Device memory less the headroom an ``auto`` KV budget keeps."""
    return auto_budget(0)


def model_kv_budget(engine: EngineSettings, budget: int | str | None, several: bool) -> Any:
    """Each model's KV budget: as set; with several models under a budget, an
    ``auto`` one is a share of the memory budget (``auto`` alone would give each
    the whole device)."""
    if not several or engine.kv_budget != "auto" or budget is None:
        return engine.kv_budget
    if budget == "auto":
        budget = auto_memory_budget()
    return int(budget) // SHARE_OF_BUDGET
