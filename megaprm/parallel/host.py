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


def dp_metrics(values: dict, groups: Groups) -> dict:
    """A step's rank-local metrics made the same on every rank in ONE all-reduce: keys ending in
    `_max` take the maximum over dp, `_min` the minimum, every other key the mean.

    The sum carries the extrema too: each rank writes its `_max` / `_min` values into its own
    row of a `[dp, K]` block that is zero elsewhere, so the summed block holds every rank's
    values exactly and the extrema are taken after it (K x dp floats; a metrics step has a
    handful of extrema)."""
    if not values:
        return {}
    keys = sorted(values)
    ext = [k for k in keys if k.endswith(("_max", "_min"))]
    mean = [k for k in keys if k not in ext]
    dp = groups.dp_size
    t = torch.zeros(len(mean) + dp * len(ext), dtype=torch.float64)
    t[:len(mean)] = torch.tensor([float(values[k]) for k in mean], dtype=torch.float64)
    block = t[len(mean):].view(dp, len(ext))
    block[groups.dp_rank] = torch.tensor([float(values[k]) for k in ext], dtype=torch.float64)
    if dp > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=groups.host_dp)
    out = dict(zip(mean, (t[:len(mean)] / dp).tolist()))
    hi, lo = block.amax(0).tolist(), block.amin(0).tolist()
    out.update({k: hi[i] if k.endswith("_max") else lo[i] for i, k in enumerate(ext)})
    return out


def dp_sum(x: float, groups: Groups) -> float:
    return dp_reduce({"x": x}, groups)["x"]


def agree(fault: Optional[str], groups: Groups) -> Optional[str]:
    """Every rank learns whether any rank faulted; returns the first faulting rank's message, or
    None. On the agreement group (all ranks, short timeout): one all-reduce of a flag, and only
    when some rank faulted a gather of the messages. The common path is one small all-reduce a
    step instead of a pickled gather of every rank's message (two gathers whose size grows with
    the world)."""
    if groups.world_size == 1 or not dist.is_initialized():
        return fault
    flag = torch.tensor([0 if fault is None else 1], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=groups.agree)
    if not int(flag):
        return None
    msgs: list = [None] * groups.world_size
    dist.all_gather_object(msgs, fault, group=groups.agree)
    return next(((f"rank {r}: {m}") for r, m in enumerate(msgs) if m is not None), None)
