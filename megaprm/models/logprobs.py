"""Token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tp rank holds logits[..., V/tp] for vocabulary rows [rank*V/tp, (rank+1)*V/tp). Three
all-reduces over the tp group (max, sum of exp, the target's logit) give exact log-softmax
values; entropy needs one more (sum of p*z). Padded vocabulary rows (>= the true vocab size)
are masked to -inf so they carry no probability, as in the HF model.

The tp group is passed in (None or size 1 = no communication); this module never reads
Megatron's globals.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _mask_padding(logits: torch.Tensor, vocab_start: int, vocab_size: Optional[int]):
    if vocab_size is None:
        return logits
    local = logits.shape[-1]
    n_valid = max(0, min(local, vocab_size - vocab_start))
    if n_valid == local:
        return logits
    out = logits.clone()
    out[..., n_valid:] = float("-inf")
    return out


class _VocabParallelLogProb(torch.autograd.Function):
    """log p(target) and (optionally) entropy; backward is local: d/dz = onehot - p, etc."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group, with_entropy):
        local_v = logits.shape[-1]
        z_max = logits.max(dim=-1).values
        _all_reduce(z_max, dist.ReduceOp.MAX, group)
        z = logits - z_max.unsqueeze(-1)
        exp_z = z.exp()
        sum_exp = _all_reduce(exp_z.sum(-1), dist.ReduceOp.SUM, group)
        in_shard = (target >= vocab_start) & (target < vocab_start + local_v)
        local_idx = (target - vocab_start).clamp(0, local_v - 1)
        tgt = torch.where(in_shard, z.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1),
                          torch.zeros_like(z_max))
        _all_reduce(tgt, dist.ReduceOp.SUM, group)
        log_z = sum_exp.log()
        logp = tgt - log_z
        p = exp_z / sum_exp.unsqueeze(-1)
        if with_entropy:
            # H = log Z - E_p[z]; padded rows have p = 0 and z = -inf: count them as 0
            pz = torch.where(p > 0, p * z, torch.zeros_like(p)).sum(-1)
            e_z = _all_reduce(pz, dist.ReduceOp.SUM, group)
            entropy = log_z - e_z
        else:
            e_z = entropy = torch.zeros_like(logp)
        ctx.save_for_backward(p, z, e_z, local_idx, in_shard)
        ctx.with_entropy = with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        p, z, e_z, local_idx, in_shard = ctx.saved_tensors
        grad = -p * g_logp.unsqueeze(-1)
        onehot = torch.zeros_like(p).scatter_(-1, local_idx.unsqueeze(-1),
                                              in_shard.unsqueeze(-1).to(p.dtype))
        grad = grad + onehot * g_logp.unsqueeze(-1)
        if ctx.with_entropy:
            # dH/dz_j = -p_j (z_j - E_p[z])
            zc = torch.where(p > 0, z - e_z.unsqueeze(-1), torch.zeros_like(z))
            grad = grad - p * zc * g_ent.unsqueeze(-1)
        return grad, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor, *, tp_group=None,
                            tp_rank: int = 0, vocab_size: Optional[int] = None,
                            with_entropy: bool = False, temperature: float = 1.0):
    """log p(target) [b, s] (and entropy [b, s]) from logits [b, s, V/tp] of this tp rank.

    `vocab_size` is the true (unpadded) vocabulary; rows past it are excluded. Computed in fp32.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    vocab_start = tp_rank * logits.shape[-1]
    logits = _mask_padding(logits, vocab_start, vocab_size)
    logp, ent = _VocabParallelLogProb.apply(logits, target, vocab_start, tp_group, with_entropy)
    return (logp, ent) if with_entropy else logp


def reference_logprobs(full_logits: torch.Tensor, target: torch.Tensor, temperature=1.0):
    """The obvious full-softmax computation (tests compare against it)."""
    lp = torch.log_softmax(full_logits.float() / temperature, dim=-1)
    p = lp.exp()
    ent = -(p * lp).sum(-1)
    return lp.gather(-1, target.unsqueeze(-1)).squeeze(-1), ent
