"""One GGUF tensor in, MLX arrays out: kept, repacked, re-quantized or dequantized.

- F32, F16 and BF16 pass through.
- Q4_0, Q4_1 and Q8_0 are repacked, bit for bit, into MLX's affine layout
  (group 32, float16 scales and biases): each block's scale ``d`` and offset
  (``-8d``, ``m``, ``-128d``) are exactly what the block computes, so nothing
  changes but the bytes' order.
- Every other type the ``gguf`` package dequantizes (the K-quants Q2_K-Q6_K,
  Q5_0/Q5_1, the IQ types, ...) becomes, by mode: a float dtype: floats of that
  dtype, exact; ``affine`` (:func:`requant_plan` picks 4 or 8 bits and the group
  size for the tensor):
  - where the type's blocks are affine in groups of 32 (Q4_K: 4 bits; Q5_0,
    Q5_1, Q5_K: 5 bits, held in 8), the same levels with each group's scale and
    offset (:func:`block_affine`): exact but for the scales' float16 rounding;
  - else re-quantized with ``mx.quantize`` from the dequantized values (Q6_K's
    16-value sub-blocks to 8 bits; Q2_K, Q3_K and the IQ types to 4).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

FLOAT = {"F32", "F16", "BF16"}
REPACKED = {"Q4_0", "Q4_1", "Q8_0"}  # exact in MLX's affine layout
# Affine per group of 32 values: their levels kept, in 4 or 8 bits.
BLOCK_AFFINE = {"Q4_K": 4, "Q5_0": 8, "Q5_1": 8, "Q5_K": 8}
# Re-quantized from the dequantized values: at 6 bits or more, to 8 bits; else to 4.
EIGHT_BIT = {"Q6_K", "Q8_1", "Q8_K"}
GROUPS = {4: (32,), 8: (64, 32)}  # finest first for 4 bits; 8 bits loses little at 64


class TensorError(ValueError):
    """A tensor this converter cannot read; the message names it and its type."""


@attrs.frozen
class Converted:
    """One tensor's arrays under their suffixes (``weight`` or ``weight``,
    ``scales``, ``biases``), and its quantization when quantized."""

    arrays: dict[str, Any]
    bits: int | None = None
    group_size: int | None = None


def requant_plan(qtype: str, row: int) -> tuple[int, int] | None:
    """(bits, group size) a ``qtype`` tensor with rows of ``row`` values is
    re-quantized to; None: no group divides the row, keep it as floats."""
    if qtype in BLOCK_AFFINE:
        return BLOCK_AFFINE[qtype], 32
    bits = 8 if qtype in EIGHT_BIT else 4
    for group in GROUPS[bits]:
        if row % group == 0:
            return bits, group
    return None


def convert_tensor(tensor: Any, qtype: str, mode: str) -> Converted:
    """The arrays for GGUF reader tensor ``tensor`` of type ``qtype``;
    ``mode`` is ``affine`` or a float dtype name (``float32``, ``float16``,
    ``bfloat16``) for the types that are not kept as they are."""
    import mlx.core as mx

    shape = tuple(int(n) for n in reversed(tensor.shape))
    data = np.asarray(tensor.data)
    if qtype == "F32":
        return Converted({"weight": mx.array(data.astype(np.float32).reshape(shape))})
    if qtype == "F16":
        return Converted({"weight": mx.array(data.view(np.float16).reshape(shape))})
    if qtype == "BF16":
        raw = mx.array(data.view(np.uint16).reshape(shape))
        return Converted({"weight": raw.view(mx.bfloat16)})
    if qtype in REPACKED:
        return repack(data, qtype, shape)
    values = dequantize(tensor.name, data, qtype, shape)
    if mode != "affine" or len(shape) < 2:
        return Converted({"weight": mx.array(values).astype(getattr(mx, mode, mx.float32))})
    plan = requant_plan(qtype, shape[-1])
    if plan is None:
        return Converted({"weight": mx.array(values).astype(mx.float16)})
    bits, group = plan
    if qtype in BLOCK_AFFINE:
        levels, scales, biases = block_affine(data, qtype, values)
        return packed(levels, scales, biases, bits, shape)
    weight, scales, biases = mx.quantize(mx.array(values), group_size=group, bits=bits)
    arrays = {"weight": weight, "scales": scales.astype(mx.float16)}
    arrays["biases"] = biases.astype(mx.float16)
    return Converted(arrays, bits, group)


def block_affine(
    data: np.ndarray, qtype: str, values: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(levels, scale, offset per group of 32) of a type whose blocks compute
    ``scale * level + offset``, from the blocks' own scales and the dequantized
    ``values`` (each level is ``(value - offset) / scale``, an integer)."""
    import gguf

    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1]
    blocks = data.view(np.uint8).reshape(-1, size)

    def f16(at: int) -> np.ndarray:
        return _f16(blocks, at).astype(np.float32)

    if qtype in ("Q4_K", "Q5_K"):  # super-blocks of 8 groups: d * sc and -dmin * m
        sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
        scales = (f16(0)[:, None] * sc).reshape(-1)
        biases = (-f16(2)[:, None] * m).reshape(-1)
    else:  # one group: d * (q - 16), or d * q + m
        scales = f16(0)
        biases = f16(2) if qtype == "Q5_1" else -16 * scales
    groups = values.reshape(-1, 32)
    safe = np.where(scales == 0, 1, scales)[:, None]
    levels = np.rint((groups - biases[:, None]) / safe)
    levels = np.clip(np.where(scales[:, None] == 0, 0, levels), 0, 31).astype(np.uint8)
    return levels, scales, biases


def packed(
    levels: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, shape: tuple
) -> Converted:
    """MLX affine arrays (group 32) from levels in order and per-group scales
    and offsets: 4-bit levels two to a byte, the first in the low nibble."""
    import mlx.core as mx

    flat = levels.reshape(-1)
    if bits == 4:
        flat = (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)
    rows, groups = shape[:-1], shape[-1] // 32
    return Converted(
        {
            "weight": mx.array(flat.view(np.uint32).reshape(*rows, shape[-1] * bits // 32)),
            "scales": mx.array(scales.astype(np.float16).reshape(*rows, groups)),
            "biases": mx.array(biases.astype(np.float16).reshape(*rows, groups)),
        },
        bits,
        32,
    )


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 field at byte ``at`` of each block (a row of ``blocks``)."""
    return blocks[:, at : at + 2].copy().view(np.float16)[:, 0]


def dequantize(name: str, data: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor ``name``'s raw ``data`` as float32, dequantized by the ``gguf`` package."""
    import gguf

    try:
        values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype])
    except NotImplementedError:
        raise TensorError(
            f"tensor {name} uses quantization {qtype}, which cannot be read here; "
            "use a file quantized as Q4_0, Q4_1, Q8_0, Q5_x, a K-quant (Q2_K-Q6_K), "
            "an IQ type, F16 or BF16"
        ) from None
    return np.asarray(values, dtype=np.float32).reshape(shape)


def repack(data: np.ndarray, qtype: str, shape: tuple[int, ...]) -> Converted:
    """Q4_0 / Q4_1 / Q8_0 blocks as MLX affine arrays (group 32), exactly.

    Blocks of 32 values: Q4_0 is ``d`` (f16) and 16 bytes of nibbles, value
    ``d * (q - 8)``; Q4_1 adds ``m`` (f16), value ``d * q + m``; Q8_0 is ``d``
    and 32 signed bytes, value ``d * q``. A nibble block holds values 0-15 in
    the low nibbles and 16-31 in the high ones; MLX packs values in order, the
    first in the lowest bits of each 32-bit word."""
    head = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}[qtype]
    size = head + (32 if qtype == "Q8_0" else 16)
    blocks = data.view(np.uint8).reshape(-1, size)
    d = _f16(blocks, 0)
    body = blocks[:, head:]
    if qtype == "Q8_0":
        levels = (body.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return packed(levels, d, -128 * d, 8, shape)  # a power of two: exact in float16
    levels = np.concatenate([body & 0x0F, body >> 4], axis=1)  # (blocks, 32) in order
    biases = _f16(blocks, 2) if qtype == "Q4_1" else -8 * d
    return packed(levels, d, biases, 4, shape)
