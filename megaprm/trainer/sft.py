"""Supervised next-token training through the pipeline seam (the demo's warm-up, PRM-free).

The loss is token-mean over the *global* batch: every rank divides its summed token losses by
the number of loss tokens over all dp ranks, and Megatron sums grads over dp and micro-batches
(`calculate_per_token_loss`), so any (tp, pp, dp, micro-batch) layout takes the same step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megaprm.models.logprobs import next_token_logprobs
from megaprm.parallel import pipeline
from megaprm.parallel.groups import Groups
from megaprm.parallel.host import dp_sum


@dataclass
class StepResult:
    loss: float          # global token-mean loss (on every rank)
    grad_norm: float
    applied: bool
    tokens: int


def micro_batches(input_ids: torch.Tensor, loss_mask: torch.Tensor, size: int,
                  pad_to: int | None = None) -> list:
    """Split [b, s] tensors into TokenBatches of `size` rows (the last may be smaller)."""
    out = []
    for i in range(0, input_ids.shape[0], size):
        ids, m = input_ids[i:i + size], loss_mask[i:i + size]
        if pad_to is not None:
            ids, m = pipeline.pad_to(ids, pad_to), pipeline.pad_to(m, pad_to)
        out.append(pipeline.TokenBatch(ids, m))
    return out


def sft_step(model, optimizer, groups: Groups, input_ids: torch.Tensor,
             loss_mask: torch.Tensor, *, micro_batch_size: int, vocab_size: int) -> StepResult:
    """One optimiser step on this dp rank's rows. loss_mask[b, t] = 1 where token t+1 is a target.

    input_ids [b, s] long (right-padded); loss_mask [b, s] float, last column ignored.
    """
    denom = dp_sum(loss_mask[:, :-1].sum().item(), groups)
    if denom == 0:
        raise ValueError("sft_step: the batch has no loss tokens on any rank")
    pad = input_ids.shape[1] if groups.pp_size > 1 else None
    mbs = micro_batches(input_ids, loss_mask, micro_batch_size, pad)

    def post(mb, logits):
        logp = next_token_logprobs(logits, mb.input_ids, tp_group=groups.tp,
                                   tp_rank=groups.tp_rank, vocab_size=vocab_size)
        loss = -(logp * mb.loss_mask[:, :-1]).sum() / denom
        return loss, loss.detach()

    optimizer.zero_grad()
    parts = pipeline.run(model, mbs, groups=groups, post=post, forward_only=False)
    grad_norm, applied = optimizer.step()
    local = float(sum(p.item() for p in parts)) if parts else 0.0
    loss = dp_sum(local, groups)  # dp sum of per-rank sums of already-normalised parts
    loss = pipeline.broadcast_from_last_stage(loss, groups)
    return StepResult(loss=loss, grad_norm=grad_norm, applied=applied, tokens=int(denom))
