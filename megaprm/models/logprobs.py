"""Token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tp rank holds logits[..., V/tp] for vocabulary rows [rank*V/tp, (rank+1)*V/tp). Three
all-reduces over the tp group (max, sum of exp, the target's logit) give exact log-softmax
values; entropy needs one more (sum of p*z). Padded vocabulary rows (>= the true vocab size)
are masked to -inf so they carry no probability, as in the HF model.

By default the computation is chunked over tokens (`_ChunkedLogProb`): the fp32 softmax of
`chunk_tokens` tokens at a time (`default_chunk_tokens`: 1024 on an accelerator, a few MiB of
fp32 per chunk on the CPU), recomputed chunk by chunk in backward, so neither an
fp32 copy of the [b, s, V/tp] logits nor its exp / probabilities are kept; the collectives are
batched over all chunks (one MAX and one SUM all-reduce per call). With the vocabulary whole
(tp = 1) a chunk is one fused `log_softmax` forward and one fused `softmax` in backward
(`_ChunkedLogSoftmax`: no collectives to place between the passes). `chunk_tokens=0` is the
unchunked path, kept as the reference the tests and the benchmark compare with.
`next_token_logprobs` is the causal-LM call: full logits, rolled targets (no sliced copy).

The tp group is passed in (None or size 1 = no communication); this module never reads
Megatron's globals.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _vocab_split(group) -> bool:
    """Whether the vocabulary is split over ranks of `group` (None or size 1: held whole)."""
    return group is not None and dist.get_world_size(group) > 1


CHUNK_TOKENS_ACCELERATOR = 1024
CHUNK_BYTES_CPU = 4 << 20


def default_chunk_tokens(local_vocab: int, device: torch.device) -> int:
    """Tokens per log-prob chunk: 1024 on an accelerator (few kernel launches; the planner's
    memory model assumes it); on the CPU as many as keep one chunk's fp32 softmax within
    CHUNK_BYTES_CPU (at least 16 tokens). A chunk's temporaries of a few MiB are reused from
    the heap and stay in cache; at 1024 tokens they are hundreds of MiB, which the C
    allocator maps and unmaps afresh each time, so every chunk pays page faults: 512 tokens x
    151,936 fp32, fwd + bwd, took 0.52 CPU-s chunked by 1024 and 0.25 by 6 (one thread;
    docs/benchmark-history.md, actor)."""
    if device.type != "cpu":
        return CHUNK_TOKENS_ACCELERATOR
    return max(16, CHUNK_BYTES_CPU // (4 * max(1, local_vocab)))


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if _vocab_split(group):
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


def _blocks(b: int, s: int, chunk_tokens: int):
    """(row slice, token slice) blocks of at most ~chunk_tokens tokens covering [b, s]: whole
    rows together when rows are short, else token ranges within each row."""
    if s <= chunk_tokens:
        step = max(1, chunk_tokens // max(s, 1))
        for r in range(0, b, step):
            yield slice(r, min(r + step, b)), slice(0, s)
    else:
        for r in range(b):
            for t in range(0, s, chunk_tokens):
                yield slice(r, r + 1), slice(t, min(t + chunk_tokens, s))


class _ChunkedLogProb(torch.autograd.Function):
    """log p(target) and entropy, chunk by chunk in fp32; backward recomputes each chunk.

    Per token, with z = x - max (x = logits / temperature over the valid vocabulary columns):
    S = sum exp z, log p(target) = z_target - log S, H = log S - sum(exp z * z) / S.
    Saved for backward: the input logits (already alive: the output layer made them), the
    max [b, s], S [b, s] and E_p[z] [b, s]. d logp / dx = onehot - p; dH / dx = -p (z - E_p[z]).
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_start, n_valid, group, with_entropy, temperature,
                chunk_tokens):
        b, s, _ = logits.shape
        dev = logits.device
        z_max = torch.empty(b, s, dtype=torch.float32, device=dev)
        blocks = list(_blocks(b, s, chunk_tokens))
        for rows, toks in blocks:
            x = logits[rows, toks, :n_valid].float()
            z_max[rows, toks] = x.max(-1).values / temperature if n_valid else float("-inf")
        _all_reduce(z_max, dist.ReduceOp.MAX, group)
        in_shard = (target >= vocab_start) & (target < vocab_start + n_valid)
        local_idx = (target - vocab_start).clamp(0, max(n_valid - 1, 0))
        # stats[0] = S, stats[1] = z_target (0 off this shard), stats[2] = sum exp(z) * z
        stats = torch.zeros(3, b, s, dtype=torch.float32, device=dev)
        for rows, toks in blocks:
            if not n_valid:
                break
            z = logits[rows, toks, :n_valid].float() / temperature - z_max[rows, toks, None]
            e = z.exp()
            stats[0, rows, toks] = e.sum(-1)
            zt = z.gather(-1, local_idx[rows, toks, None]).squeeze(-1)
            stats[1, rows, toks] = torch.where(in_shard[rows, toks], zt, torch.zeros_like(zt))
            if with_entropy:
                stats[2, rows, toks] = (e * z).sum(-1)
        _all_reduce(stats, dist.ReduceOp.SUM, group)
        sum_exp, tgt, sum_ez = stats
        log_z = sum_exp.log()
        logp = tgt - log_z
        e_z = sum_ez / sum_exp
        entropy = log_z - e_z if with_entropy else torch.zeros_like(logp)
        ctx.save_for_backward(logits, z_max, sum_exp, e_z, local_idx, in_shard)
        ctx.args = (n_valid, with_entropy, temperature, blocks)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, z_max, sum_exp, e_z, local_idx, in_shard = ctx.saved_tensors
        n_valid, with_entropy, temperature, blocks = ctx.args
        # every [row, token, :n_valid] block is written below: only the padded vocabulary
        # columns need zeros (no full-size memset)
        grad = torch.empty_like(logits)
        grad[..., n_valid:] = 0
        for rows, toks in blocks:
            if not n_valid:
                break
            z = logits[rows, toks, :n_valid].float() / temperature - z_max[rows, toks, None]
            p = z.exp() / sum_exp[rows, toks, None]
            gl = g_logp[rows, toks, None]
            g = -p * gl
            onehot = in_shard[rows, toks, None].to(g.dtype) * gl
            g.scatter_add_(-1, local_idx[rows, toks, None], onehot)
            if with_entropy:
                g -= p * (z - e_z[rows, toks, None]) * g_ent[rows, toks, None]
            grad[rows, toks, :n_valid] = (g / temperature).to(grad.dtype)
        return grad, None, None, None, None, None, None, None


class _ChunkedLogSoftmax(torch.autograd.Function):
    """`_ChunkedLogProb` for a vocabulary held whole (tp = 1): per chunk one fused
    `log_softmax` forward and one fused `softmax` recomputed in backward, instead of the
    max / shift / exp / sum passes and their temporaries that a vocabulary split over ranks
    needs (its max and sum must be all-reduced between them). Same maths: d logp / dx =
    onehot - p, dH / dx = -p (log p + H); saved for backward: the input logits and H."""

    @staticmethod
    def forward(ctx, logits, target, n_valid, with_entropy, temperature, chunk_tokens):
        b, s, _ = logits.shape
        logp = torch.empty(b, s, dtype=torch.float32, device=logits.device)
        entropy = torch.zeros_like(logp)
        idx = target.clamp(0, max(n_valid - 1, 0))
        blocks = list(_blocks(b, s, chunk_tokens))
        for rows, toks in blocks:
            ls = torch.log_softmax(_scaled(logits[rows, toks, :n_valid], temperature), -1)
            logp[rows, toks] = ls.gather(-1, idx[rows, toks, None]).squeeze(-1)
            if with_entropy:
                entropy[rows, toks] = -(ls.exp() * ls).sum(-1)
        ctx.save_for_backward(logits, idx, entropy)
        ctx.args = (n_valid, with_entropy, temperature, blocks)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, idx, entropy = ctx.saved_tensors
        n_valid, with_entropy, temperature, blocks = ctx.args
        grad = torch.empty_like(logits)
        grad[..., n_valid:] = 0  # padded vocabulary columns; every block writes the rest
        for rows, toks in blocks:
            x = _scaled(logits[rows, toks, :n_valid], temperature)
            gl = g_logp[rows, toks, None]
            if with_entropy:
                ls = torch.log_softmax(x, -1)
                g = ls.exp()
                g.mul_(ls.add_(entropy[rows, toks, None]).mul_(g_ent[rows, toks, None])
                       .add_(gl)).neg_()
            else:
                g = torch.softmax(x, -1).mul_(gl.neg())
            g.scatter_add_(-1, idx[rows, toks, None], gl)
            if temperature != 1.0:
                g.div_(temperature)
            grad[rows, toks, :n_valid] = g
        return grad, None, None, None, None, None


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """x / temperature in fp32 (no copy of an fp32 x at temperature 1)."""
    x = x.float()
    return x if temperature == 1.0 else x / temperature


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor, *, tp_group=None,
                            tp_rank: int = 0, vocab_size: Optional[int] = None,
                            with_entropy: bool = False, temperature: float = 1.0,
                            chunk_tokens: Optional[int] = None):
    """log p(target) [b, s] (and entropy [b, s]) from logits [b, s, V/tp] of this tp rank.

    `vocab_size` is the true (unpadded) vocabulary; rows past it are excluded. Computed in fp32
    (of logits / temperature), `chunk_tokens` tokens at a time (None: `default_chunk_tokens`;
    0 = all at once, unchunked).
    """
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(logits.shape[-1], logits.device)
    if chunk_tokens:
        assert temperature > 0, f"temperature={temperature} must be > 0"
        lead = logits.shape[:-1]
        if logits.dim() != 3:  # [b, s, V] blocks; any other leading shape as one row
            logits, target = logits.reshape(1, -1, logits.shape[-1]), target.reshape(1, -1)
        local_v = logits.shape[-1]
        vocab_start = tp_rank * local_v
        n_valid = local_v if vocab_size is None else max(0, min(local_v, vocab_size - vocab_start))
        if not _vocab_split(tp_group):
            logp, ent = _ChunkedLogSoftmax.apply(logits, target, n_valid, with_entropy,
                                                 float(temperature), int(chunk_tokens))
        else:
            logp, ent = _ChunkedLogProb.apply(logits, target, vocab_start, n_valid, tp_group,
                                              with_entropy, float(temperature),
                                              int(chunk_tokens))
        logp, ent = logp.reshape(lead), ent.reshape(lead)
        return (logp, ent) if with_entropy else logp
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    vocab_start = tp_rank * logits.shape[-1]
    logits = _mask_padding(logits, vocab_start, vocab_size)
    logp, ent = _VocabParallelLogProb.apply(logits, target, vocab_start, tp_group, with_entropy)
    return (logp, ent) if with_entropy else logp


def next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, **kw):
    """log p(input_ids[:, t + 1] | input_ids[:, <= t]) [b, s - 1] (and entropy [b, s - 1]) from
    the full logits [b, s, V/tp]; keywords as `vocab_parallel_logprobs`.

    The targets are rolled rather than the logits sliced: backward then produces one gradient
    of the logits' own shape. `logits[:, :-1]` would make autograd's slice backward allocate a
    second full-size, zero-filled gradient and copy the first into it. The last position's
    value (its target wraps around) is computed and dropped: one token of work."""
    out = vocab_parallel_logprobs(logits, torch.roll(input_ids, -1, dims=1), **kw)
    return tuple(o[:, :-1] for o in out) if isinstance(out, tuple) else out[:, :-1]


def reference_logprobs(full_logits: torch.Tensor, target: torch.Tensor, temperature=1.0):
    """The obvious full-softmax computation (tests compare against it)."""
    lp = torch.log_softmax(full_logits.float() / temperature, dim=-1)
    p = lp.exp()
    ent = -(p * lp).sum(-1)
    return lp.gather(-1, target.unsqueeze(-1)).squeeze(-1), ent
