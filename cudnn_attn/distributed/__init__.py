"""Past one GPU: context parallelism over ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

* :func:`context_parallel_attention` — ring attention for dense, causal and sliding-window masks.
* :func:`neighborhood_attention` — NATTEN neighborhoods sharded on the first spatial axis; each
  rank fetches only the halo rows its queries reach.
* :func:`shard_sequence` / :func:`unshard_sequence` — the shardings both use.
* :class:`RankDisagreement` — what every rank raises, before any exchange, when the ranks'
  arguments differ where they must agree or one rank's arguments are invalid.
"""

from .agreement import RankDisagreement
from .context_parallel import context_parallel_attention
from .halo import neighborhood_attention
from .sharding import shard_sequence, unshard_sequence

__all__ = ["RankDisagreement", "context_parallel_attention", "neighborhood_attention", "shard_sequence",
           "unshard_sequence"]
