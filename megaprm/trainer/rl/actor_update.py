"""Phase: the actor update (PPO-clip through Megatron's schedule, `actor.mini_batches` optimiser
steps, all or nothing), and the order of its rows (`actor.shuffle_mini_batches`).

pi_old comes from `logprob_phase`; when that phase skipped its forward (one mini-batch
on-policy, `logprob_phase.reuses_new_logprobs`) the update takes the detach of its own new
log-probs as pi_old and returns them for the monitor."""
from __future__ import annotations

import math
from typing import Optional

import torch

from megaprm.algorithms.losses import actor_loss, guard_ratio_mean
from megaprm.models.logprobs import next_token_logprobs
from megaprm.parallel import microbatch, pipeline
from megaprm.parallel.device import to_host
from megaprm.parallel.host import dp_reduce
from megaprm.config import ActorConfig
from megaprm.rollout.engine import RightPadded
from megaprm.trainer.rl.batch import StepSkipped, UpdateResult
from megaprm.trainer.rl.policy import Policy


# Per micro-batch sums the update reports; the step's value of each is sum / count over every
# micro-batch, mini-batch and dp rank ("tokens" counts valid tokens, "minibatches" updates).
_TOKEN_MEANS = ("actor/clip_frac", "actor/dual_clip_frac", "actor/approx_kl", "actor/ratio_mean",
                "actor/entropy_token_mean")
_MINIBATCH_MEANS = ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/loss")

def update_actor(actor: Policy, cfg: ActorConfig, norm_len: int, rp: RightPadded, adv_t,
                 logp_old_t, logp_ref_t, keep) -> UpdateResult:
    """Phase: PPO-clip through Megatron's schedule, `cfg.mini_batches` optimiser steps.
    rp: the batch right-padded; adv_t, logp_old_t, logp_ref_t [B, L-1] target-aligned; keep [B]
    bool (False: no gradient from the row); norm_len: rollout.max_tokens (the seq-mean-token-sum
    normaliser). Normalisers are global (all dp ranks, all micro-batches) so any layout takes
    the same step. All or nothing: a non-finite loss or grad norm in any mini-batch restores
    the parameters and optimiser state of before the first one and raises StepSkipped.
    `logp_old_t` None (one mini-batch only): the old log-probs are the detached new ones, and
    the result's `logprobs_t` [B, L-1] holds them (None when no mini-batch had a valid token)."""
    assert logp_old_t is not None or cfg.mini_batches == 1, "old log-probs needed"
    new_logprobs_t = None
    mask_t = rp.loss_mask[:, :-1] * keep[:, None].float()
    lengths = rp.attention_mask.long().sum(1)
    B = rp.input_ids.shape[0]
    rows_per = B // cfg.mini_batches  # check_batch: mini_batches divides B
    sums: dict = {}
    maxes = {"actor/ratio_max": 0.0, "actor/grad_norm_max": 0.0}
    updates = 0
    try:  # one mini-batch needs no rollback: its step is skipped before anything moves
        with actor.opt.all_or_nothing(enabled=cfg.mini_batches > 1):
            for k in range(cfg.mini_batches):
                rows = slice(k * rows_per, (k + 1) * rows_per)
                mb_metrics = update_minibatch(
                    actor, cfg, norm_len, rp.input_ids[rows], mask_t[rows], adv_t[rows],
                    None if logp_old_t is None else logp_old_t[rows],
                    None if logp_ref_t is None else logp_ref_t[rows],
                    lengths=lengths[rows])
                if mb_metrics is None:  # no valid token in this mini-batch on any rank
                    continue
                new_logprobs_t = mb_metrics.pop("logprobs", None)
                updates += 1
                if updates == 1:  # live guard: 1 when the trainer sees the sampler's policy
                    first = mb_metrics["actor/ratio_mean"] / mb_metrics["tokens"]
                for key, v in mb_metrics.items():
                    if key in maxes:
                        maxes[key] = max(maxes[key], v)
                    else:
                        sums[key] = sums.get(key, 0.0) + v
    except StepSkipped:
        actor.opt.zero_grad()
        raise
    out = {"actor/updates": float(updates), **maxes}
    tokens = max(sums.get("tokens", 0.0), 1.0)
    for key in _TOKEN_MEANS:
        if key in sums:
            out[key] = sums[key] / tokens
    for key in _MINIBATCH_MEANS:
        if key in sums:
            out[key] = sums[key] / max(updates, 1)
    if updates:
        out["actor/ratio_first_minibatch"] = first
    out["actor/grad_norm"] = sums.get("actor/grad_norm", 0.0) / max(updates, 1)
    out["actor/lr"] = cfg.optim.lr
    if cfg.skip_ratio_above is not None:
        out["actor/ratio_skipped_microbatches"] = sums.get(
            "actor/ratio_skipped_microbatches", 0.0)
    return UpdateResult(out, new_logprobs_t)


def update_minibatch(actor: Policy, cfg: ActorConfig, norm_len: int, ids, m, adv, old, ref,
                     lengths=None) -> Optional[dict]:
    """One optimiser step on one mini-batch; returns dp-reduced sums (token-weighted means
    as sums x tokens) or None when the mini-batch has no valid token anywhere. `old` None: the
    detached new log-probs are the old ones, and the result's "logprobs" [n, L-1] are they."""
    g = actor.groups
    counts = dp_reduce({"tokens": float(m.sum()), "seqs": float((m.sum(1) > 0).sum())}, g)
    tokens, seqs = counts["tokens"], counts["seqs"]
    if tokens == 0:
        return None
    payload = {"adv": adv, "m": m}
    if old is not None:
        payload["old"] = old
    if ref is not None:
        payload["ref"] = ref
    mbs = actor.batching.split(ids, m, payload, lengths)
    temperature = actor.temperature
    old_given = old is not None

    def post(mb, logits):
        lp, ent = next_token_logprobs(
            logits, mb.input_ids, tp_group=g.tp, tp_rank=g.tp_rank,
            vocab_size=actor.spec.vocab_size, with_entropy=True, temperature=temperature)
        lp, ent = microbatch.unpack(mb, lp), microbatch.unpack(mb, ent)  # rows of payload
        p = mb.payload
        old = p["old"] if old_given else lp.detach()  # ratio 1 by construction (module doc)
        loss, met = actor_loss(lp, old, p["adv"], p["m"], eps_low=cfg.eps_low,
                               eps_high=cfg.eps_high, dual_clip_c=cfg.dual_clip_c,
                               agg=cfg.loss_agg, entropy=ent, entropy_coef=cfg.entropy_coef,
                               logp_ref=p.get("ref"), kl_coef=cfg.kl_coef,
                               kl_kind=cfg.kl_kind, global_tokens=tokens, global_seqs=seqs,
                               norm_len=norm_len, host=False)
        # Metrics stay on the device: `update_minibatch` reads the whole mini-batch's at once
        n = p["m"].sum()
        skipped = torch.zeros((), dtype=loss.dtype, device=loss.device)
        if cfg.skip_ratio_above is not None:  # PURE: this micro-batch moves nothing
            ratio = guard_ratio_mean(lp, old, p["m"], cfg.skip_ratio_scope)
            skipped = (ratio > cfg.skip_ratio_above).to(loss.dtype)
            loss = loss * (1.0 - skipped)
        sums = {k: met[k] * n for k in ("actor/clip_frac", "actor/dual_clip_frac",
                                        "actor/approx_kl", "actor/ratio_mean")}
        sums["actor/ratio_skipped_microbatches"] = skipped
        sums["actor/entropy_token_mean"] = (ent.detach() * p["m"]).sum()
        for k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss"):
            if k in met:
                sums[k] = met[k]  # already divided by the global normaliser
        sums["actor/loss"] = loss.detach()
        sums["ratio_max"] = met["actor/ratio_max"]
        out = {"keys": list(sums), "values": torch.stack(
            [v.to(torch.float32) for v in sums.values()])}
        if not old_given:
            out["lp"] = lp.detach()
        return loss, out

    actor.opt.zero_grad()
    parts = pipeline.run(actor.model, mbs, groups=g, post=post, forward_only=False)
    local, ratio_max = {}, 0.0
    if parts:  # the one host read of the mini-batch's metrics (last stage)
        keys = parts[0]["keys"]
        rows = torch.stack([part["values"] for part in parts]).tolist()
        for i, k in enumerate(keys):
            if k == "ratio_max":
                ratio_max = max(r[i] for r in rows)
            else:
                local[k] = sum(r[i] for r in rows)
    new_lp = None
    if not old_given:  # the update forward's log-probs, rows in `ids` order, on every stage
        new_lp = (to_host(microbatch.to_rows(mbs, [part["lp"] for part in parts], len(ids)))
                  if parts else None)
        new_lp = pipeline.broadcast_from_last_stage(new_lp, g)
    local = pipeline.broadcast_from_last_stage(local, g)
    ratio_max = pipeline.broadcast_from_last_stage(ratio_max, g)
    summed = dp_reduce(local, g)
    loss = summed.get("actor/loss", 0.0)
    if not math.isfinite(loss):
        raise StepSkipped(f"actor loss is {loss}")
    grad_norm, applied = actor.opt.step()
    if not applied:
        raise StepSkipped(f"actor grad norm is {grad_norm}")
    out = {**summed, "tokens": tokens, "actor/grad_norm": grad_norm,
           "actor/grad_norm_max": grad_norm,
           "actor/ratio_max": dp_reduce({"r": ratio_max}, g, op="max")["r"]}
    if new_lp is not None:
        out["logprobs"] = new_lp
    return out


def mini_batch_order(rows: int, seed: int, step: int, dp_rank: int) -> torch.Tensor:
    """actor.shuffle_mini_batches: this rank's row order for the update, a permutation [rows]
    fixed by (seed, step, dp rank), so a resumed run shuffles as the uninterrupted one."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step * 7919 + dp_rank * 104_729)
                                        % (2**63))
    return torch.randperm(rows, generator=gen)


def permute_rows(update: tuple, order: torch.Tensor) -> tuple:
    """update_actor's arguments (RightPadded, adv, old, ref or None, keep) with rows in `order`."""
    rp, *rest = update
    return (RightPadded(*(x[order] for x in rp)),
            *(None if x is None else x[order] for x in rest))




def update_inputs(rp: RightPadded, adv_t, old_t, ref_t, keep, order=None) -> tuple:
    """update_actor's row-aligned arguments (rp, adv_t, old_t, ref_t, keep) with rows in
    `order` (`mini_batch_order`; None: as they are)."""
    update = (rp, adv_t, old_t, ref_t, keep)
    return update if order is None else permute_rows(update, order)
