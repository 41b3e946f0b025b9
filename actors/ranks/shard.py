"""Whether a model splits N ways, loading one rank's shard, and the model as
every rank calls it (rank 0's sampled ids shared through one ``all_sum``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..errors import InvalidRequest


def shard_error(config: dict, ranks: int, name: str = "the model") -> str | None:
    """Why ``config``'s model cannot be split ``ranks`` ways (None: it can).
    Tensor parallelism splits attention by heads and the MLP by columns."""
    heads = config.get("num_attention_heads")
    kv = config.get("num_key_value_heads", heads)
    mlp = config.get("intermediate_size")
    bad = [
        f"{n} {what}"
        for n, what in ((heads, "attention heads"), (kv, "KV heads"), (mlp, "MLP columns"))
        if isinstance(n, int) and n % ranks
    ]
    if not bad:
        return None
    fits = [
        k
        for k in range(2, 9)
        if all(not isinstance(n, int) or n % k == 0 for n in (heads, kv, mlp))
    ]
    hint = f"; it splits {' or '.join(map(str, fits))} ways" if fits else ""
    return (
        f"{name} cannot be split {ranks} ways: its {' and '.join(bad)} do not divide "
        f"by {ranks}{hint}"
    )


def check_shardable(path: str | Path, ranks: int) -> None:
    """Raise :class:`InvalidRequest` where the model at ``path`` cannot be split."""
    config_file = Path(path) / "config.json"
    if ranks <= 1 or not config_file.is_file():
        return
    problem = shard_error(json.loads(config_file.read_text()), ranks, Path(path).name)
    if problem:
        raise InvalidRequest(problem, param="ranks")


def sharded_load(path: str | Path, group: Any) -> tuple[Any, Any]:
    """mlx-lm's ``sharded_load``: tensor parallel where the model has ``shard()``,
    else pipeline where it has ``pipeline()``."""
    from mlx_lm.utils import load_model as lazy_model
    from mlx_lm.utils import sharded_load as mlx_sharded_load

    check_shardable(path, group.size())
    model, _ = lazy_model(Path(path), lazy=True, strict=False)
    if hasattr(model, "shard"):
        return mlx_sharded_load(str(path), tensor_group=group)
    return mlx_sharded_load(str(path), pipeline_group=group)


class SharedInputs:
    """The model as every rank calls it: its token ids go through one
    ``all_sum`` first, to which followers add zeros, so every rank forwards the
    ids rank 0 chose (sampled there, in the graph, never read back to the host).
    A follower's own ids are multiplied by zero rather than replaced, which keeps
    this ``all_sum`` after the last forward's in every rank's graph."""

    def __init__(self, model: Any, group: Any) -> None:
        self._model, self._group, self._lead = model, group, group.rank() == 0

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        ids = inputs.astype(mx.int32)
        if not self._lead:
            ids = ids * 0
        return self._model(mx.distributed.all_sum(ids, group=self._group), *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)
