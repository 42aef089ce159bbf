"""The process groups of one rank, handed down explicitly (never read from globals below init)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class Groups:
    """Sizes, ranks and process groups of this rank. A group of size 1 may be None.

    `dp` is the data-parallel group; `mp` is the model-parallel group (tp x pp) a checkpoint
    shard belongs to. `dp_host` / `world_host` are gloo groups over the same ranks for host-side
    work (estimators' group statistics, metrics, fault agreement): under NCCL the device groups
    take only CUDA tensors, and host work stays on the CPU (parallel/device.py). On CPU they are
    the same groups as `dp` / the default group (None).
    """

    world_size: int
    rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    cp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    tp: Optional[Any] = None
    pp: Optional[Any] = None
    dp: Optional[Any] = None
    cp: Optional[Any] = None
    mp: Optional[Any] = None
    embd: Optional[Any] = None  # first + last pp stage (tied embeddings)
    vpp_size: Optional[int] = None
    backend: str = "gloo"
    dp_host: Optional[Any] = None
    world_host: Optional[Any] = None
    agree: Optional[Any] = None  # gloo, all ranks, short timeout (trainer fault agreement)
    # expert parallelism (MoE models): the experts of each layer are split over the ep ranks of
    # a pipeline stage (ranks that hold different data); each expert over tp as a dense MLP
    ep_size: int = 1
    ep_rank: int = 0
    ep: Optional[Any] = None

    @property
    def host_dp(self) -> Optional[Any]:
        """The dp group for CPU tensors."""
        return self.dp_host if self.dp_host is not None else self.dp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} tp {self.tp_rank}/{self.tp_size} "
                f"pp {self.pp_rank}/{self.pp_size} dp {self.dp_rank}/{self.dp_size} "
                f"cp {self.cp_rank}/{self.cp_size} ({self.backend})")
