"""Scale-out: one engine sharded across ``mlx.distributed`` ranks.

Rank 0 runs the actor graph (and the HTTP front) as on one machine. Every other
rank runs a *follower*: it holds its shard of the weights and of every KV cache,
and executes the same GPU calls in the same order. Tensors cross between ranks
only inside the model, through mlx's own collectives (mlx-lm's ``shard()`` puts
an ``all_sum`` after each attention and MLP block). What rank 0 sends a follower
before each GPU call is a *plan*: the call and its host-side arguments (token
ids, row indices, chunk bounds, sampling left out), pickled with every
mlx-holding object (a batch, a joiner's prefill, a cache layer, the prompt-cache
store) replaced by an id both ranks give it. A follower resolves the ids to its
own objects, runs the call, and both ranks then number the objects the call
made, in the same order (see :class:`plans.Plans`).

Sampling happens on rank 0 only. With tensor parallelism the logits are complete
on every rank (the head is not sharded, the last block's ``all_sum`` is), so
rank 0 alone runs the samplers, logits processors and grammar masks; the token
ids it sampled reach the followers inside the next forward: the model's input
goes through one ``all_sum`` to which followers add zeros (:class:`SharedInputs`),
a few bytes per row and step, with no host round trip, so the pipelined step
stays pipelined.

Failure: collectives do not time out, so rank 0 watches its followers. Each
holds one TCP connection to rank 0 (plans one way, a heartbeat with its figures
every ``HEARTBEAT_SECONDS`` the other). A connection that closes, or a follower
silent for ``RANK_TIMEOUT``, loses the ranks: ``/health`` turns 503 with the
reason and every pending and later GPU call raises ``errors.RanksLost``, so every
live row ends with an error (see ``Gpu.lose``). A follower whose connection to
rank 0 ends exits.
"""

from .follower import follow
from .leader import Leader, RankWatch, lead, rank_figures
from .plans import Mirrored, mirrored
from .shard import SharedInputs, check_shardable, shard_error, sharded_load

__all__ = [
    "Leader",
    "Mirrored",
    "RankWatch",
    "SharedInputs",
    "check_shardable",
    "follow",
    "lead",
    "mirrored",
    "rank_figures",
    "shard_error",
    "sharded_load",
]
