"""Host-side collectives: scalars and small Python objects that live on the CPU (metrics,
normalising counts, evaluation counts, fault verdicts), reduced on the gloo host groups of
`Groups` (under NCCL the device groups take only CUDA tensors; parallel/device.py)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megaprm.parallel.groups import Groups


def dp_reduce(values: dict, groups: Groups, op: str = "sum") -> dict:
    """Reduce rank-local scalars over the dp group (one all-reduce). op: sum | max."""
    if not values:
        return {}
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    if groups.dp_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM,
                        group=groups.host_dp)
    return dict(zip(keys, t.tolist()))


def dp_mean(values: dict, groups: Groups) -> dict:
    return {k: v / groups.dp_size for k, v in dp_reduce(values, groups).items()}


def dp_sum(x: float, groups: Groups) -> float:
    return dp_reduce({"x": x}, groups)["x"]


def agree(fault: Optional[str], groups: Groups) -> Optional[str]:
    """Every rank learns whether any rank faulted (one gather over all ranks, on the agreement
    group whose timeout is short); returns the first fault's message, or None."""
    if groups.world_size == 1 or not dist.is_initialized():
        return fault
    msgs: list = [None] * groups.world_size
    dist.all_gather_object(msgs, fault, group=groups.agree)
    return next(((f"rank {r}: {m}") for r, m in enumerate(msgs) if m is not None), None)
