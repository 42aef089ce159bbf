"""Megatron tp/pp shards -> a stream of (hf_name, full tensor) on every rank.

Stage by stage: the owning stage's tp ranks all-gather each parameter along its tp dimension,
convert it to HF names/layouts with `models.mapping` (the one mapping), and the full tensor is
broadcast over the pp group so every rank (every colocated rollout engine) receives it.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from megaprm.models import mapping
from megaprm.parallel.groups import Groups


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def gather_tp(shard: torch.Tensor, dim, groups: Groups) -> torch.Tensor:
    """Full tensor from tp shards (concatenated on `dim`); replicated params pass through."""
    if dim is None or groups.tp_size == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(groups.tp_size)]
    dist.all_gather(parts, shard.contiguous(), group=groups.tp)
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def iter_hf_weights(model, groups: Groups, spec=None) -> Iterator[tuple]:
    """Yield (hf_name, tensor) for the whole model, in stage order, identically on all ranks."""
    spec = spec or mapping_spec(model)
    own = [(rule, p) for rule, p in mapping.stage_rules(model, spec, groups.pp_size,
                                                        groups.pp_rank) if mapping.exported(rule)]
    for stage in range(groups.pp_size):
        meta = [[(r, tuple(p.shape), p.dtype) for r, p in own] if stage == groups.pp_rank
                else None]
        if groups.pp_size > 1:
            dist.broadcast_object_list(meta, src=dist.get_global_rank(groups.pp, stage),
                                       group=groups.pp)
        for i, (rule, shape, dtype) in enumerate(meta[0]):
            if stage == groups.pp_rank:
                full = gather_tp(own[i][1].detach(), rule.tp_dim, groups)
            else:
                full_shape = list(shape)
                if rule.tp_dim is not None:
                    full_shape[rule.tp_dim] *= groups.tp_size
                full = torch.empty(full_shape, dtype=dtype, device=own[0][1].device if own
                                   else "cpu")
            if groups.pp_size > 1:
                dist.broadcast(full, src=dist.get_global_rank(groups.pp, stage), group=groups.pp)
            yield from mapping.to_hf(rule, full, spec, groups.tp_size)


def mapping_spec(model):
    m = model.module if hasattr(model, "module") else model
    return m.megaprm_spec
