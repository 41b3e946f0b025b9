"""RMSNorm and RoPE under ``mx.compile`` in decode steps (``--compile``).

On the CPU, ``mx.fast.rms_norm`` and ``mx.fast.rope`` fall back to compositions
of 9 and 21 operations, each dispatched alone on arrays of a few thousand
floats. Under ``mx.compile`` their elementwise runs are fused into a kernel or
two. These blocks do not touch the KV cache, so their shapes repeat from step
to step (one compiled version per batch size) without the fixed-capacity cache
a whole compiled forward needs, and their results are the same bits
(``bench/decode_floor.py`` checks the logits; the parity suites run with them
on). On SmolLM2 float32 the forward runs 1.04-1.19x faster at B = 1, 4 and 8
(docs/benchmarks.md, the decode-floor section).

:func:`install` swaps the class of a model's exact ``nn.RMSNorm`` and
``nn.RoPE`` modules for the subclasses below (that model only: another model in
the process, mlx-lm's own included, is untouched). A call on one position a row
(a decode step, either lane) runs compiled; any other shape (a prefill chunk, a
verify step's few positions) runs as before. Runs on the GPU thread.
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

_ATTR = "_mlx_nursery_fused"


@attrs.define
class Figures:
    """One model's compiled blocks: calls run compiled, calls run as before
    (other shapes), and traces (a shape seen for the first time: a recompile)."""

    modules: int = 0  # the model's modules that run compiled in decode steps
    compiled: int = 0
    plain: int = 0
    _seen: set = attrs.field(factory=set, repr=False)  # (block, input shapes) traced
    _fns: dict = attrs.field(factory=dict, repr=False)

    def fn(self, key: tuple, make: Any) -> Any:
        """The compiled function for ``key`` (made on first use)."""
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = mx.compile(make())
        return fn

    def traced(self, key: tuple, *arrays: mx.array) -> None:
        self._seen.add((key, *((a.shape, a.dtype) for a in arrays)))

    @property
    def traces(self) -> int:
        return len(self._seen)


class FusedRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm``; compiled on ``(rows, 1, dims)``."""

    def __call__(self, x: mx.array) -> mx.array:
        figures: Figures = getattr(self, _ATTR)
        if x.ndim != 3 or x.shape[1] != 1:
            figures.plain += 1
            return super().__call__(x)
        eps = self.eps
        key = ("rms_norm", eps)
        fn = figures.fn(key, lambda: lambda x, w: mx.fast.rms_norm(x, w, eps))
        figures.traced(key, x, self["weight"])
        figures.compiled += 1
        return fn(x, self["weight"])


class FusedRoPE(nn.RoPE):
    """``nn.RoPE``; compiled on ``(rows, heads, 1, dims)``, the offset (a row's
    position, an int or one a row) passed as an array so a step's trace repeats."""

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        figures: Figures = getattr(self, _ATTR)
        if x.ndim != 4 or x.shape[2] != 1:
            figures.plain += 1
            return super().__call__(x, offset)
        dims, traditional, base, scale = self.dims, self.traditional, self.base, self.scale
        key = ("rope", dims, traditional, base, scale)

        def make():
            return lambda x, at: mx.fast.rope(
                x, dims, traditional=traditional, base=base, scale=scale, offset=at
            )

        fn = figures.fn(key, make)
        at = offset if isinstance(offset, mx.array) else mx.array(offset)
        figures.traced(key, x, at)
        figures.compiled += 1
        return fn(x, at)


_FUSED = {nn.RMSNorm: FusedRMSNorm, nn.RoPE: FusedRoPE}


def install(model: Any) -> Figures:
    """Compile the decode-step norms and RoPE of ``model`` (its exact
    ``nn.RMSNorm`` and ``nn.RoPE`` modules; other kinds stay as they are)."""
    figures = figures_of(model) or Figures()
    for _, module in model.named_modules():
        fused = _FUSED.get(type(module))
        if fused is not None:
            object.__setattr__(module, _ATTR, figures)
            module.__class__ = fused
    figures.modules = installed(model)
    object.__setattr__(model, _ATTR, figures)
    return figures


def uninstall(model: Any) -> None:
    """The model's norms and RoPE back as mlx builds them."""
    plain = {fused: base for base, fused in _FUSED.items()}
    for _, module in model.named_modules():
        if type(module) in plain:
            module.__class__ = plain[type(module)]
    if figures_of(model) is not None:
        object.__delattr__(model, _ATTR)


def figures_of(model: Any) -> Figures | None:
    """The model's figures (None: not installed)."""
    return getattr(model, _ATTR, None)


def installed(model: Any) -> int:
    """How many of the model's modules run compiled in decode steps."""
    return sum(type(m) in (FusedRMSNorm, FusedRoPE) for _, m in model.named_modules())
