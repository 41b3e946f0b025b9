"""KV byte projection and the budget: queue instead of running out of memory.

Each layer's cache kind fixes how its bytes grow with a row's length: plain KV
grows in 256-token granules, a sliding window stops at its window (plus one
prefill chunk while a prompt streams in), recurrent state is a fixed size. A
probe on the GPU thread (one token through fresh caches) reads the sizes per
layer; :func:`project` is then plain arithmetic, usable at submit and at
admission. Projections are per row, as if alone: the left padding a row pays
inside a batch of longer rows is not counted (``padding_waste`` shows it).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from typing import Any

import attrs

HEADROOM_FRACTION = 0.2  # of device memory, kept free under an ``auto`` budget
HEADROOM_MIN = 1 << 30


class LayerKind(enum.Enum):
    FULL = "full"  # plain KV: grows with every token
    WINDOW = "window"  # a ring: stops at its window
    STATE = "state"  # recurrent state: a fixed size


@attrs.frozen
class LayerCost:
    kind: LayerKind
    per_token: float  # bytes per cached token (full, window); 0 for state
    granule: int = 256  # tokens a full layer allocates at a time
    window: int = 0  # window layers: tokens kept
    fixed: int = 0  # state layers: bytes
    # Full layers under --kv-bits: bytes per token once quantized, from this length on.
    quantized: float = 0.0
    quantized_from: int | None = None

    @property
    def token_bytes(self) -> float:
        """A token's bytes at the precision served (quantized where the layer
        would be)."""
        return self.quantized if self.quantized_from is not None else self.per_token

    def bytes_for(self, tokens: int, prefill_step: int) -> int:
        if self.kind is LayerKind.STATE:
            return self.fixed
        held = -(-tokens // self.granule) * self.granule
        if self.kind is LayerKind.WINDOW:
            held = min(held, self.window + prefill_step)
        if self.quantized_from is not None and tokens >= self.quantized_from:
            return int(held * self.quantized)
        return int(held * self.per_token)


def probe(model: Any, kv: Any = None) -> tuple[LayerCost, ...]:
    """Per-layer costs, read from one token through fresh caches (GPU thread).
    With ``kv`` (a ``KvBits``), full layers also say what a token costs once
    quantized, and from which length (a row shorter than that stays float; one
    in a quantized batch costs less than projected)."""
    import mlx.core as mx
    from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache, make_prompt_cache

    caches = make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    mx.eval([c.state for c in caches])

    def cost(c, top: bool = True) -> list[LayerCost]:
        if isinstance(c, CacheList):
            return [x for sub in c.caches for x in cost(sub, top=False)]
        if isinstance(c, RotatingKVCache):
            return [LayerCost(LayerKind.WINDOW, c.nbytes / c.keys.shape[2], window=c.max_size)]
        if isinstance(c, KVCache):
            full = LayerCost(LayerKind.FULL, c.nbytes / c.keys.shape[2], granule=KVCache.step)
            if kv is None or not top:  # quantized only where mlx-lm would (a top layer)
                return [full]
            kv.check([c.keys.shape[3], c.values.shape[3]])
            q = kv.quantized(c)
            per = q.nbytes / q.keys[0].shape[2]
            return [attrs.evolve(full, quantized=per, quantized_from=kv.start)]
        return [LayerCost(LayerKind.STATE, 0.0, fixed=c.nbytes)]

    return tuple(x for c in caches for x in cost(c))


def project(costs: Sequence[LayerCost], tokens: int, prefill_step: int) -> int:
    """Worst-case KV bytes of one row holding ``tokens`` (prompt plus max_tokens)."""
    return sum(c.bytes_for(tokens, prefill_step) for c in costs)


def auto_budget(weights_bytes: int) -> int:
    """Device memory minus the weights and a headroom (20%, at least 1 GiB)."""
    import mlx.core as mx

    info = mx.device_info()
    total = info.get("memory_size") or info.get("max_recommended_working_set_size")
    if not total:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    headroom = max(int(total * HEADROOM_FRACTION), HEADROOM_MIN)
    return max(0, int(total) - weights_bytes - headroom)


_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(value: str) -> int:
    """A byte count: 1234, 512M, 2G, 1.5G (binary units; a trailing B or iB is fine)."""
    text = value.strip().upper().removesuffix("IB").removesuffix("B")
    scale = _UNITS.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in _UNITS else text
    try:
        n = int(float(number) * scale)
    except ValueError:
        raise ValueError(f"not a byte count: {value!r} (try 512M or 2G)") from None
    if n < 0:
        raise ValueError(f"a byte count cannot be negative, got {value!r}")
    return n


def parse_budget(value: int | str | None) -> int | str | None:
    """None (no budget; also 'none'), 'auto', or a byte count (an int, or a string
    like 4G)."""
    if value is None or isinstance(value, int):
        return value
    word = value.strip().lower()
    if word == "none":
        return None
    return "auto" if word == "auto" else parse_bytes(value)
