"""Phase: PRIME's implicit PRM, trained on the step's (accuracy-filtered) rollouts and scoring
them, q = log pi_prm - log pi_ref per token (research §1.3/§1.6)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from megaprm.algorithms import filters
from megaprm.algorithms.losses import implicit_prm_ce_loss
from megaprm.models.logprobs import next_token_logprobs
from megaprm.parallel import microbatch, pipeline
from megaprm.parallel.device import to_host
from megaprm.parallel.host import agree, dp_sum
from megaprm.rollout.engine import RightPadded
from megaprm.trainer.rl.batch import ScoredBatch, StepSkipped
from megaprm.trainer.rl.policy import Policy, targets_to_response


@dataclass(frozen=True)
class ImplicitPRM:
    """prm.kind=implicit (PRIME): the implicit PRM, a policy trained with its own optimiser, and
    its reference at T = 1 (the actor's reference where that is at T = 1 too, else a policy of
    its own). One of the trainer's PRM slot kinds (the other: reward_phase.DiscriminativePRM)."""

    kind: ClassVar[str] = "implicit"
    policy: Policy
    ref: Policy


def prime_prm(implicit: Policy, prm_cfg, prime_cfg, sb: ScoredBatch, rp: RightPadded,
              lengths, logp_ref_t) -> tuple:
    """Phase (PRIME, released `update=after`, research §1.3/§1.6): the implicit PRM is
    trained with BCE(sigmoid(beta * sum_t q_t), outcome) on the accuracy-filtered rollouts
    in `prm.mini_batches` optimiser steps, and each mini-batch's q = log pi_prm - log pi_ref
    is the one computed inside the update (mini-batch k is scored by the PRM after k-1
    steps). Filtered-out rows are never trained on and get q = 0 (the policy loss masks
    them). `prm.update=none` scores all rows with the current PRM and never trains it.
    prm_cfg: `prm`; prime_cfg: `advantage.prime`; rp, lengths [B]: the batch right-padded;
    logp_ref_t [B, L-1]: the PRM's reference at T = 1. Returns (`sb` with q [B, R], metrics)."""
    g, pc = implicit.groups, prime_cfg
    B = rp.input_ids.shape[0]
    if prm_cfg.update == "none":
        lp = implicit.logprobs(rp.input_ids, lengths)
        return with_q(sb, rp, lp - logp_ref_t, g), {}
    keep = (filters.accuracy(sb.outcome.float(), sb.group_ids, low=pc.acc_low,
                             high=pc.acc_high, group=pipeline.optional_group(g.host_dp))
            if pc.accuracy_filter else torch.ones(B, dtype=torch.bool))
    rows = keep.nonzero()[:, 0]
    q_t = torch.zeros(B, rp.input_ids.shape[1] - 1)
    losses, norms, applied = [], [], []
    for idx in rows.tensor_split(prm_cfg.mini_batches):
        lp, loss, grad_norm, ok = prm_minibatch(implicit, prm_cfg.beta, rp, idx, logp_ref_t,
                                                lengths, sb.outcome)
        if idx.numel():
            q_t[idx] = lp - logp_ref_t[idx]
        losses.append(loss)
        norms.append(grad_norm)
        applied.append(ok)
    sb = with_q(sb, rp, q_t, g)
    return sb, {"prm/loss": sum(losses) / len(losses), "prm/grad_norm": max(norms),
                "prm/applied": float(all(applied)), "prm/updates": float(len(losses)),
                "prm/trained_rows": dp_sum(float(rows.numel()), g)}


def with_q(sb: ScoredBatch, rp: RightPadded, q_t: torch.Tensor, groups) -> ScoredBatch:
    """`sb` with q [B, R] from the target-aligned q_t [B, L-1]; a non-finite q on any rank skips
    the step on every rank."""
    b = sb.rollout
    q = targets_to_response(q_t, rp, b.response_ids.shape[1]) * b.response_mask
    fault = None if torch.isfinite(q).all() else "implicit PRM produced non-finite q"
    fault = agree(fault, groups)
    if fault is not None:
        raise StepSkipped(fault)
    return dataclasses.replace(sb, q=q)


def prm_minibatch(implicit: Policy, beta: float, rp: RightPadded, idx, logp_ref_t, lengths,
                  outcome):
    """One implicit-PRM optimiser step on rows `idx` of this rank (maybe none: the step's
    collectives still run); returns (log-probs [n, L-1] before the step, loss, grad norm,
    applied)."""
    g = implicit.groups
    mask_t = rp.loss_mask[:, :-1][idx]
    seqs = dp_sum(float(idx.numel()), g)
    payload = {"ref": logp_ref_t[idx], "m": mask_t,
               "o": outcome.float()[idx][:, None].expand_as(mask_t)}
    mbs = (implicit.batching.split(rp.input_ids[idx], mask_t, payload, lengths[idx])
           if idx.numel() else [])

    def post(mb, logits):
        lp = microbatch.unpack(mb, next_token_logprobs(
            logits, mb.input_ids, tp_group=g.tp, tp_rank=g.tp_rank,
            vocab_size=implicit.spec.vocab_size))
        p = mb.payload
        real = p["m"].sum(1) > 0  # pp padding rows carry no mask and no loss
        loss = implicit_prm_ce_loss(lp[real], p["ref"][real], p["m"][real],
                                    p["o"][real, 0], beta=beta, global_seqs=max(seqs, 1.0))
        return loss, {"lp": lp.detach(), "loss": float(loss.detach())}

    implicit.opt.zero_grad()
    parts = pipeline.run(implicit.model, mbs, groups=g, post=post, forward_only=False)
    lp = (to_host(microbatch.to_rows(mbs, [p["lp"] for p in parts], idx.numel()))
          if parts else None)
    loss = sum(p["loss"] for p in parts)
    lp, loss = pipeline.broadcast_from_last_stage((lp, loss), g)
    grad_norm, applied = implicit.opt.step()
    return lp, dp_sum(loss, g), grad_norm, applied

