"""Group-wise (per prompt) reductions across the data-parallel group.

A *group* is the n responses sampled for one prompt, named by an int64 id per sample. After
length balancing the members of one group can sit on different DP ranks, so every per-group
statistic is reduced over the DP group. The contract every caller relies on:

* **A fixed number of collectives per call**, independent of the number of groups and of the
  batch size: group ids are mapped to a dense index with one all-gather of the (padded) unique
  ids, sums are scatter-added into a dense `[G, K]` table and reduced with ONE all-reduce, and
  rank-based filters all-gather per-sample scalars only (one all-gather of sizes, one of values).
* **`group=None` means single-process** (not "the default world group" as in torch.distributed):
  nothing is communicated. A group of size 1 is a no-op too, so one code path serves 1 CPU and
  1024 GPUs.
* Statistics are accumulated in float64, so the result equals the single-process one up to the
  order of floating-point summation (far below 1e-6 for reward-sized values).

Every collective goes through `_all_reduce` / `_all_gather`, which bump a module counter; tests
read it with `count_collectives()` to show the count does not grow with the number of groups.
`megaprm/algorithms` never imports `torch.distributed`; it reduces through this module.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_COLLECTIVES = 0  # total collectives issued by this process through this module

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass
class CollectiveCounter:
    """Collectives issued inside a `count_collectives()` block (read `.n` after the block)."""

    start: int
    n: int = 0


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounter]:
    """Count the collectives this module issues inside the `with` block (test hook)."""
    counter = CollectiveCounter(start=_COLLECTIVES)
    try:
        yield counter
    finally:
        counter.n = _COLLECTIVES - counter.start


def is_distributed(group: Any | None) -> bool:
    """True when `group` is a process group with more than one rank (so collectives are real)."""
    return (group is not None and dist.is_available() and dist.is_initialized()
            and dist.get_world_size(group) > 1)


def _all_reduce(tensor: torch.Tensor, op: str, group: Any | None) -> torch.Tensor:
    """In-place all-reduce of `tensor` with `op` in {"sum","max","min"}; no-op when single-process."""
    global _COLLECTIVES
    if is_distributed(group):
        _COLLECTIVES += 1
        dist.all_reduce(tensor, op=_OPS[op], group=group)
    return tensor


def _all_gather(tensor: torch.Tensor, group: Any | None) -> list[torch.Tensor]:
    """All-gather equal-shape tensors -> one tensor per rank, in rank order."""
    global _COLLECTIVES
    if not is_distributed(group):
        return [tensor]
    _COLLECTIVES += 1
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Any | None = None) -> torch.Tensor:
    """All-reduce a small stacked tensor in place (one collective; none when single-process)."""
    if op not in _OPS:
        raise ValueError(f"all_reduce op={op!r}: must be one of {sorted(_OPS)}")
    return _all_reduce(tensor, op, group)


def all_gather_rows(rows: torch.Tensor, group: Any | None = None) -> list[torch.Tensor]:
    """All-gather `rows[N_r, ...]` whose first dimension differs per rank: two collectives.

    One all-gather of the row counts, one of the rows padded to the largest count. Returns the
    list of each rank's rows (unpadded) in rank order; `[rows]` when single-process.
    """
    if not is_distributed(group):
        return [rows]
    n = torch.tensor([rows.shape[0]], dtype=torch.int64, device=rows.device)
    sizes = [int(s.item()) for s in _all_gather(n, group)]
    padded = rows.new_zeros((max(max(sizes), 1),) + tuple(rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    return [g[:s] for g, s in zip(_all_gather(padded, group), sizes)]


def check_group_ids(group_ids: torch.Tensor, batch_size: int | None = None,
                    name: str = "group_ids") -> int:
    """Raise ValueError unless `group_ids` is a 1-D non-negative integer tensor of `batch_size`.

    Returns the largest id (-1 for an empty batch); min and max come from one `aminmax` pass.
    """
    if not isinstance(group_ids, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of int64 prompt ids, got "
                         f"{type(group_ids).__name__}; build it with torch.tensor(ids, dtype=torch.int64)")
    if group_ids.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B], got shape {tuple(group_ids.shape)}")
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"{name} has dtype {group_ids.dtype}; pass integer prompt ids (int64), "
                         f"e.g. group_ids.long() on ids that are exact integers")
    if batch_size is not None and group_ids.shape[0] != batch_size:
        raise ValueError(f"{name} has {group_ids.shape[0]} entries but the batch has {batch_size} "
                         f"samples; pass one prompt id per sample")
    if not group_ids.numel():
        return -1
    lo, hi = (int(v) for v in torch.aminmax(group_ids))
    if lo < 0:
        raise ValueError(f"{name} contains a negative id ({lo}); group ids must be >= 0 "
                         f"(e.g. the prompt's index in the dataset)")
    return hi


@dataclass(frozen=True)
class GroupIndex:
    """Which row of a per-group table each of this rank's samples adds into; same on all ranks.

    `dense[B]` is the row of each sample, `num_groups` the table size, and `ids()` the group id
    of every row (sorted). Rows are either the global list of ids present on any rank
    (distributed, or ids spread over a large range) or, single-process with ids in a small
    range, the ids themselves: then rows of absent ids simply have count 0. Skipping the
    compaction is what makes the single-process path as cheap as a plain bincount.
    """

    dense: torch.Tensor
    num_groups: int
    group: Any | None
    row_ids: torch.Tensor | None = None  # None: row r is group id r

    def ids(self) -> torch.Tensor:
        if self.row_ids is not None:
            return self.row_ids
        return torch.arange(self.num_groups, device=self.dense.device)

    def per_sample(self, table: torch.Tensor) -> torch.Tensor:
        """Row of `table[G, ...]` for each sample -> `[B, ...]` (`index_select`, which on CPU
        costs less than half of the equivalent advanced indexing `table[dense]`)."""
        return table.index_select(0, self.dense)


def group_index(group_ids: torch.Tensor, group: Any | None = None,
                batch_size: int | None = None) -> GroupIndex:
    """Map int64 group ids to table rows shared by all ranks (2 collectives, or none).

    Ids may be any non-negative int64 (dataset indices, hashes): distributed, only the ids
    present are gathered (one all-gather of sizes, one of the padded unique ids), so the
    table size is the global number of groups, never the id range.
    """
    top = check_group_ids(group_ids, batch_size)
    ids = group_ids.long()
    if not is_distributed(group):
        if top < 4 * ids.numel() + 256:  # small id range: rows = ids, no sort, no compaction
            return GroupIndex(dense=ids, num_groups=top + 1, group=group)
        local, inverse = torch.unique(ids, return_inverse=True)
        return GroupIndex(dense=inverse, num_groups=int(local.shape[0]), group=group, row_ids=local)
    local, inverse = torch.unique(ids, return_inverse=True)
    rows = torch.unique(torch.cat(all_gather_rows(local, group)))
    return GroupIndex(dense=torch.searchsorted(rows, local)[inverse], num_groups=int(rows.shape[0]),
                      group=group, row_ids=rows)


def _as_index(group_ids: torch.Tensor | GroupIndex, group: Any | None,
              batch_size: int) -> GroupIndex:
    if isinstance(group_ids, GroupIndex):
        assert group_ids.dense.shape[0] == batch_size, "GroupIndex built for another batch"
        return group_ids
    return group_index(group_ids, group, batch_size)


def group_sums(values: torch.Tensor, group_ids: torch.Tensor | GroupIndex,
               group: Any | None = None) -> torch.Tensor:
    """Per-group sums of `values[B, ...]` over every rank -> float64 table `[G, ...]`.

    Stack several statistics as columns (`[B, K]`) so they share ONE all-reduce. `group_ids`
    is either the raw `[B]` ids (costs the 2 collectives of `group_index`) or a `GroupIndex`
    built once and reused (then this is exactly one collective). Row r belongs to group
    `index.ids()[r]`.
    """
    index = _as_index(group_ids, group, values.shape[0])
    values = values.to(torch.float64)
    if values.dim() == 2 and values.shape[1] <= 8:
        # One 1-D index_add_ per column into a [K, G] table, returned as its [G, K] view: on
        # CPU a 2-D index_add_ costs ~5x and bincount rescans the index for its min and max.
        table = values.new_zeros((values.shape[1], index.num_groups))
        for k in range(values.shape[1]):
            table[k].index_add_(0, index.dense, values[:, k])
        table = table.t()
        if is_distributed(index.group):
            table = table.contiguous()  # collectives need contiguous buffers
    else:
        table = values.new_zeros((index.num_groups,) + tuple(values.shape[1:]))
        table.index_add_(0, index.dense, values)
    return _all_reduce(table, "sum", index.group)


@dataclass(frozen=True)
class GroupMoments:
    """Per-group count, mean and centred sum of squares of one or more masked columns.

    Tables `[G, K]` (K columns). `var(unbiased)` is `m2 / (count - 1)`; groups with fewer than
    two members have variance 0.
    """

    count: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor
    centred: torch.Tensor  # [B, K] this rank's (x - group mean) * mask, float64

    def unbiased_std(self) -> torch.Tensor:
        return (self.m2 / (self.count - 1).clamp(min=1)).sqrt_()


def group_moments(x: torch.Tensor, index: GroupIndex,
                  mask: torch.Tensor | None = None) -> GroupMoments:
    """Count / mean / centred M2 per group of `x[B, K]` over members where `mask[B, K]` is set.

    Two all-reduces (sum+count, then centred squares): the two-pass form keeps zero-variance
    groups at exactly zero variance even for large values, which a one-pass sum-of-squares
    does not (the eps tests of PAPO depend on it).
    """
    x = x.to(torch.float64)
    k = x.shape[1]
    if mask is None and not is_distributed(index.group):
        count = x.new_zeros((index.num_groups, 1))
        count[:, 0].index_add_(0, index.dense, x.new_ones(x.shape[0]))
        mean = group_sums(x, index).div_(count.clamp(min=1))
        count = count.expand(-1, k)
        centred = x - index.per_sample(mean)
    elif mask is None:
        s = group_sums(torch.cat([x, x.new_ones((x.shape[0], 1))], dim=1), index)  # [G, K+1]
        total, count = s[:, :k], s[:, k:].expand(-1, k)
        mean = total / count.clamp(min=1)
        centred = x - index.per_sample(mean)
    else:
        m = mask.to(torch.float64)
        s = group_sums(torch.cat([x * m, m], dim=1), index)                          # [G, 2K]
        total, count = s[:, :k], s[:, k:]
        mean = total / count.clamp(min=1)
        centred = (x - index.per_sample(mean)) * m
    m2 = group_sums(centred * centred, index)                                         # [G, K]
    return GroupMoments(count=count, mean=mean, m2=m2, centred=centred)


@dataclass(frozen=True)
class GatheredSamples:
    """Per-sample scalars of every rank, in global order (group, rank, local index).

    `values[N, F]` float64; `rank[N]` and `local[N]` say where each row came from; `mine[B]`
    gives, for this rank's samples in local order, their row in the gathered table.
    """

    values: torch.Tensor
    dense: torch.Tensor
    rank: torch.Tensor
    local: torch.Tensor
    mine: torch.Tensor


def gather_samples(values: torch.Tensor, index: GroupIndex) -> GatheredSamples:
    """All-gather per-sample scalars `values[B, F]` and sort them by (group, rank, local index).

    Two collectives (sizes, padded rows). With `group=None` this is the local batch sorted by
    (group, local index). When rank r holds the r-th contiguous slice of the global batch,
    (rank, local index) order *is* the original batch order.
    """
    b = values.shape[0]
    rank_id = dist.get_rank(index.group) if is_distributed(index.group) else 0
    dev = values.device
    local_rows = torch.cat([values.to(torch.float64),
                            index.dense.to(torch.float64)[:, None],
                            torch.full((b, 1), float(rank_id), dtype=torch.float64, device=dev),
                            torch.arange(b, dtype=torch.float64, device=dev)[:, None]], dim=1)
    rows = torch.cat(all_gather_rows(local_rows, index.group))
    dense, rank, local = rows[:, -3].long(), rows[:, -2].long(), rows[:, -1].long()
    # Lexicographic (dense, rank, local) as one int64 key: N * world * B_max stays far below 2^63.
    n_rank = int(rank.max()) + 1 if rows.shape[0] else 1
    n_local = int(local.max()) + 1 if rows.shape[0] else 1
    order = torch.argsort((dense * n_rank + rank) * n_local + local)
    rows, dense, rank, local = rows[order], dense[order], rank[order], local[order]
    mine_rows = torch.nonzero(rank == rank_id).flatten()
    mine = torch.empty(b, dtype=torch.long, device=dev)
    mine[local[mine_rows]] = mine_rows
    return GatheredSamples(values=rows[:, :-3], dense=dense, rank=rank, local=local, mine=mine)
