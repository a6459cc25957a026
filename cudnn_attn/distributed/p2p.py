"""Point-to-point exchanges on ``torch.distributed`` (NCCL on GPUs, gloo on CPUs), started before
the compute they overlap with and waited on after it."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Exchange"]


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


class Exchange:
    """A batch of sends and receives in flight; ``wait()`` returns the received tensors.

    ``Exchange.bytes_sent`` counts every byte this process has sent (benchmarks reset it)."""

    bytes_sent = 0

    def __init__(self, group=None):
        self.group = group
        self.ops: list = []
        self.received: list[torch.Tensor] = []

    def send(self, tensor: torch.Tensor, to: int) -> "Exchange":
        Exchange.bytes_sent += tensor.numel() * tensor.element_size()
        self.ops.append(dist.P2POp(dist.isend, tensor.contiguous(), _global(self.group, to),
                                   self.group))
        return self

    def recv(self, like: torch.Tensor, shape, frm: int) -> torch.Tensor:
        buf = like.new_empty(shape)
        self.ops.append(dist.P2POp(dist.irecv, buf, _global(self.group, frm), self.group))
        self.received.append(buf)
        return buf

    def start(self) -> "Exchange":
        self.requests = dist.batch_isend_irecv(self.ops) if self.ops else []
        return self

    def wait(self) -> list[torch.Tensor]:
        for request in self.requests:
            request.wait()
        return self.received
