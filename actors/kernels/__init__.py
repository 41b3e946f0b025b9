"""The kernels a model runs with, apart from the batch that runs it: put on a
model at load by :func:`install`, each with what it does and when it applies.

- ``ragged``: mlx-lm's attention wrapped: ragged attention in decode steps
  (``--ragged-attention``), and the two below where they apply;
- ``cpu_attention`` (and ``cpu_attention.c``): mlx's CPU attention with its
  softmax computed many lanes wide, its logsumexp, and the quantized
  attention's sums, to mlx's bits (``--cpu-softmax``);
- ``quantized_attention``: mlx-lm's quantized attention over ``--kv-bits``
  caches, through the library or mlx's kernels folded;
- ``fused``: the decode steps' RMSNorm and RoPE under ``mx.compile``
  (``--compile``);
- ``packed`` (and ``packed.cpp``): decode-step products from float32 weights
  packed once at load, an mlx primitive of our own (``--packed-weights``);
- ``build``: the one build cache the native ones are compiled into.

Nothing here imports an actor or the step state; importers name the module
(``kernels.packed``).
"""

from __future__ import annotations

from typing import Any

import attrs

from . import fused, packed, ragged


@attrs.frozen
class Kernels:
    """Which kernels a model is loaded with (``--ragged-attention``,
    ``--cpu-softmax``, ``--compile`` resolved to on or off, ``--packed-weights``)."""

    ragged_attention: bool = True
    cpu_softmax: bool = True
    compile: bool = False
    packed_weights: bool = False


@attrs.frozen
class Installed:
    """What :func:`install` put on a model."""

    attention: int  # mlx-lm modules whose attention was wrapped now (0: already, or none)
    fused: fused.Figures | None  # the compiled blocks, where --compile put them
    packed: packed.Figures | None  # the packed products, where --packed-weights put them

    def __str__(self) -> str:
        parts = [f"attention wrapped in {self.attention} module(s)"]
        if self.fused is not None:
            parts.append(f"compiled blocks: {self.fused}")
        if self.packed is not None:
            parts.append(f"packed products: {self.packed}")
        return "; ".join(parts)


def install(model: Any, kernels: Kernels = Kernels()) -> Installed:
    """Put the kernels ``kernels`` asks for on ``model``, and take off those a
    model object given again still carries that it no longer asks for; say
    what was put."""
    attention = ragged.install(model, rows=kernels.ragged_attention,
                               exact_softmax=kernels.cpu_softmax)  # fmt: skip
    if kernels.compile:
        figures = fused.install(model)
    else:
        fused.uninstall(model)
        figures = None
    packed.uninstall(model)  # packed anew, or not
    packing = packed.install(model) if kernels.packed_weights else None
    return Installed(attention, figures, packing)
