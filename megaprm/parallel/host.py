"""Host-side collectives: scalars and small Python objects that live on the CPU (metrics,
normalising counts, evaluation counts, fault verdicts), reduced on the gloo host groups of
`Groups` (under NCCL the device groups take only CUDA tensors; parallel/device.py)."""
from __future__ import annotations

from typing import Callable, Optional

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


def all_failures(failure, group, world_size: int) -> list:
    """Every rank learns which ranks failed: [(rank in `group`, failure)] for each rank whose
    `failure` is not None, the same list on every rank, [] when none failed. The one home of
    "every rank raises the same error, none waits in a collective while another raises".

    One all-reduce of a flag on `group`, and only when some rank failed a gather of the
    failures (any picklable value): the common path is one small all-reduce instead of a
    pickled gather whose size grows with the world. `group` takes CPU tensors (a gloo group,
    or None for a gloo default group); `world_size` is its size."""
    if world_size == 1 or not dist.is_initialized():
        return [] if failure is None else [(0, failure)]
    flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag):
        return []
    found: list = [None] * world_size
    dist.all_gather_object(found, failure, group=group)
    return [(r, f) for r, f in enumerate(found) if f is not None]


def run_agreed(fn: Callable[[], object], where: Callable[[], tuple],
               failure_of: Callable[[Exception], object] = repr) -> tuple:
    """Run `fn` on every rank; returns (its result or None, `all_failures`): every rank gets
    the same failures, so all of them raise (or go on) together and none is left waiting in
    the next collective. `where()` -> (group, its size), asked after `fn` ran (the step may be
    the one that sets the group up). `failure_of(e)` turns an exception `fn` raised into the
    picklable failure to share, or re-raises it (an error that is not the step's to report)."""
    result = failure = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - shared with every rank by all_failures
        failure = failure_of(e)
    return result, all_failures(failure, *where())


def agree(fault: Optional[str], groups: Groups) -> Optional[str]:
    """Every rank learns whether any rank faulted; returns the first faulting rank's message
    ("rank R: ..."), or None. On the agreement group (all ranks, short timeout, so a dead rank
    is an error in minutes)."""
    if groups.world_size == 1 or not dist.is_initialized():
        return fault
    found = all_failures(fault, groups.agree, groups.world_size)
    return f"rank {found[0][0]}: {found[0][1]}" if found else None
