"""Model loading and inspection (runs on the GPU thread: it calls mlx)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import attrs

from ..budget import LayerCost, probe
from ..errors import InvalidRequest
from ..families import family_of
from ..kernels import Kernels, install
from ..ranks import SharedInputs, sharded_load
from ..speculation.drafters import DraftModel
from ..step.quantized import runs_here
from .registry import resolve, short_id
from .vision import VisionUnavailable, attach, load_vision

log = logging.getLogger(__name__)


@attrs.frozen
class ModelInfo:
    id: str  # the public name (a file or directory stem, never a path)
    batchable: bool  # every cache layer has mlx-lm's merge (mlx_lm.server's test)
    # Joiners may be prefilled as one padded batch: every layer is a plain KVCache,
    # which takes right padding exactly (sliding windows and recurrent state do not).
    padded_prefill: bool
    context_length: int | None
    eos: frozenset[int]
    vocab_size: int | None
    cache_kinds: tuple[str, ...]  # the cache classes, layer by layer (for logs and /stats)
    kv_costs: tuple[LayerCost, ...]  # per layer: how its KV bytes grow with length
    weights_bytes: int
    # The tokenizer's thinking markers, e.g. ("<think>", "</think>"); None: no thinking.
    think: tuple[str, str] | None = None
    # Images: the vision family served (models/vision.py), or why a checkpoint that
    # takes images cannot have them here (None and None: a text model).
    vision: str | None = None
    no_images: str | None = None


def load_model(
    model: Any,
    dtype: str | None,
    group: Any = None,
    *,
    kernels: Kernels = Kernels(),  # noqa: B008 (frozen)
    trust_remote_code: bool = False,
    kv: Any = None,
) -> tuple[Any, Any, ModelInfo]:
    """Load (a directory, hub id or GGUF file; or take a ``(model, tokenizer)``
    pair), cast (see :func:`cast`), and inspect the model's caches.

    With ``group`` (an ``mx.distributed`` group of two or more ranks), every rank
    calls this alike: mlx-lm's ``sharded_load`` gives each its shard, and the
    model's inputs go through :class:`ranks.SharedInputs`. The figures (KV costs,
    weight bytes) are then one rank's share. ``kv`` (a ``KvBits``): the KV costs
    count quantized bytes, and a model whose heads its groups do not divide is
    refused. ``kernels``: what ``kernels.install`` puts on the model (the packed
    products' bytes are counted in the weights')."""
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    name, path = "model", None
    sharded = group is not None and group.size() > 1
    if isinstance(model, str | Path):
        name = short_id(model)
        path = resolve(model, float_dtype(dtype))
        if sharded:
            model, tokenizer = sharded_load(path, group)
        else:
            _check_model_file(path, trust_remote_code)
            model, tokenizer = load(str(path), trust_remote_code=trust_remote_code)
    elif sharded:
        raise ValueError("a sharded engine loads its model itself: pass a path, not a model")
    else:
        model, tokenizer = model
    cast(model, dtype)
    installed = install(model, kernels)
    log.debug("kernels on %s: %s", name, installed)
    packing = installed.packed
    vision, no_images = _vision(model, path, sharded)
    if sharded:
        model = SharedInputs(model, group)
    caches = make_prompt_cache(model)
    args = getattr(model, "args", None)
    context = getattr(args, "max_position_embeddings", None)
    info = ModelInfo(
        id=name,
        batchable=all(hasattr(c, "merge") for c in caches),
        padded_prefill=all(type(c) is KVCache for c in caches),
        context_length=int(context) if context else None,
        eos=frozenset(tokenizer.eos_token_ids),
        vocab_size=getattr(args, "vocab_size", None),
        cache_kinds=tuple(type(c).__name__ for c in caches),
        kv_costs=probe(model, kv),
        weights_bytes=sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        + (packing.bytes if packing else 0),
        think=thinking_markers(tokenizer),
        vision=vision,
        no_images=no_images,
    )
    if kv is not None:
        runs_here(kv, model)
    return model, tokenizer, info


def _vision(model: Any, path: Path | None, sharded: bool) -> tuple[str | None, str | None]:
    """A vision checkpoint's image side, attached to its text model (models/vision.py):
    the family served, or why images cannot be (logged once here)."""
    config_file = None if path is None else Path(path) / "config.json"
    if config_file is None or not config_file.is_file():
        return None, None
    try:
        if sharded:
            raise VisionUnavailable("images are not served across ranks yet: serve on one")
        vision = load_vision(Path(path), json.loads(config_file.read_text()))
    except VisionUnavailable as exc:
        log.warning("%s; serving it as a text model", exc)
        return None, str(exc)
    if vision is None:
        return None, None
    attach(model, vision)
    return vision.family, None


def thinking_markers(tokenizer: Any) -> tuple[str, str] | None:
    """The reasoning markers: mlx-lm's (``<think>`` and kin, found in the vocabulary),
    else the model family's where its tokenizer holds them (Mistral's ``[THINK]``)."""
    if getattr(tokenizer, "has_thinking", False):
        return tokenizer.think_start, tokenizer.think_end
    family = family_of(tokenizer)
    vocab = tokenizer.get_vocab() if family and family.think else {}
    if family and family.think and all(m in vocab for m in family.think):
        return family.think
    return None


def _check_model_file(path: Path | str, trusted: bool) -> None:
    """A directory whose config names its own architecture file runs that file:
    refused unless the caller trusts it (``--trust-remote-code``)."""
    config = Path(path) / "config.json"
    if trusted or not config.is_file():
        return
    model_file = json.loads(config.read_text()).get("model_file")
    if model_file is not None:
        raise InvalidRequest(
            f"the model at {path} builds its architecture from its own Python file "
            f"({model_file!r}), which runs in this process: serve it with "
            "--trust-remote-code if you trust it",
            param="trust_remote_code",
        )


def load_draft(
    path: Any,
    dtype: str | None,
    tokenizer: Any,
    info: ModelInfo,
    kernels: Kernels = Kernels(),  # noqa: B008 (frozen)
) -> tuple[DraftModel, ModelInfo]:
    """Load a draft model for ``--draft-model`` as the target was loaded, and
    check that it can draft for it: the same vocabulary (token for token) and
    plain KV caches (a row's draft KV is cut back after every proposal). A
    mismatch is an :class:`InvalidRequest` naming ``draft_model``."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    model, draft_tokenizer, draft_info = load_model(path, dtype, kernels=kernels)
    ours, theirs = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if ours != theirs:
        differ = len(set(ours.items()) ^ set(theirs.items()))
        raise InvalidRequest(
            f"draft_model {draft_info.id!r} has another tokenizer than {info.id!r} "
            f"({len(theirs)} tokens against {len(ours)}, {differ} entries differ): a "
            "draft model must share the model's vocabulary, e.g. a smaller model of "
            "the same family",
            param="draft_model",
        )
    kinds = {type(c).__name__ for c in make_prompt_cache(model) if type(c) is not KVCache}
    if kinds:
        raise InvalidRequest(
            f"draft_model {draft_info.id!r} keeps {', '.join(sorted(kinds))} caches, which "
            "cannot be cut back after a proposal: a draft model needs full attention "
            "in every layer (plain KV caches)",
            param="draft_model",
        )
    return DraftModel(model, info.vocab_size), draft_info


def cast(model: Any, dtype: str | None) -> None:
    """Cast the weights in place: ``auto`` is float32 on a CPU device (bf16/fp16
    matmuls are emulated there, quantized ones are slow), else the stored dtype;
    None keeps it. Casting to float32 dequantizes a quantized model first."""
    import mlx.core as mx

    dtype = float_dtype(dtype)
    if dtype == "float32":
        # Scales first: dequantizing with float16 scales would round every weight.
        model.set_dtype(mx.float32)
        _dequantize(model)
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
        mx.eval(model.parameters())


def kernels_of(settings: Any) -> Kernels:
    """The kernels an engine's settings ask for, ``--compile auto`` resolved."""
    return Kernels(settings.ragged_attention, settings.cpu_softmax, compiled(settings.compile),
                   settings.packed_weights)  # fmt: skip


def compiled(setting: str) -> bool:
    """Whether ``--compile`` means on here: auto is on on a CPU device (where
    it was measured to pay), off elsewhere."""
    import mlx.core as mx

    if setting == "auto":
        return mx.default_device().type == mx.DeviceType.cpu
    return setting == "on"


def float_dtype(dtype: str | None) -> str | None:
    """The dtype ``dtype`` means here: ``auto`` is float32 on a CPU device,
    else None (keep what is stored)."""
    import mlx.core as mx

    if dtype == "auto":
        return "float32" if mx.default_device().type == mx.DeviceType.cpu else None
    return dtype


def _dequantize(model: Any) -> None:
    """Replace quantized layers with float ones, in place (mlx-lm's own helper;
    a sharded model's quantized shards too, see :func:`_dequantize_shards`)."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear
    from mlx_lm.utils import dequantize_model

    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)
    if any(isinstance(m, quantized) for _, m in model.named_modules()):
        dequantize_model(model)
    _dequantize_shards(model)


def _dequantize_shards(model: Any) -> None:
    """mlx's sharded quantized linears (what ``shard()`` makes of a quantized
    model) as sharded float ones: each rank dequantizes its own shard."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    kinds = {
        nn.QuantizedAllToShardedLinear: nn.AllToShardedLinear,
        nn.QuantizedShardedToAllLinear: nn.ShardedToAllLinear,
    }
    swaps = []
    for name, module in model.named_modules():
        float_kind = kinds.get(type(module))
        if float_kind is None:
            continue
        weight = mx.dequantize(
            module.weight, module.scales, module.biases, module.group_size, module.bits,
            mode=module.mode,
        )  # fmt: skip
        n = module.group.size()
        out_dims, in_dims = weight.shape
        if float_kind is nn.AllToShardedLinear:
            out_dims *= n
        else:
            in_dims *= n
        layer = float_kind(in_dims, out_dims, bias="bias" in module, group=module.group)
        layer.weight = weight
        if "bias" in module:
            layer.bias = module.bias
        swaps.append((name, layer))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
