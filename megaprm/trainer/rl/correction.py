"""The off-policy side of a step: how stale its samples are, how far the sampler's log-probs
are from the trainer's per version lag, and the correction of the update for the difference.

Correction (`rollout.correction: tis`, applied when `rollout.max_staleness` > 0): token-level
truncated importance sampling as in verl's rollout correction (docs/algo/rollout_corr.md and
rollout_corr_math.md, `rollout_is: token` with `rollout_is_threshold`; Liu, Li et al. 2025,
"When Speed Kills Stability"). Decoupled PPO: the PPO ratio is taken against the trainer's own
log-probs before the update (the proximal policy pi_old, recomputed by the old-log-prob
forward), and each token's policy-gradient term is weighted by

    w_t = min(pi_old(a_t) / pi_behav(a_t), C),    detached,

pi_behav the engine's log-probs of the sampled token (the policy that drew it, `rollout.tis_cap`
= C). Since w_t >= 0 multiplies the whole clipped term, min(r A, clip(r) A) * w = min(r (w A),
clip(r) (w A)) (and likewise for the dual clip), the weight is applied to the advantages; the
entropy and KL terms are left unweighted, as verl does. Both log-probs are at the sampling
temperature (the one the engine drew at).

`rollout.correction: decoupled` is AReaL's decoupled PPO objective instead (Fu et al. 2025,
"AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning",
eq. 5; its `ppo_actor_loss_fn` with `behav_imp_weight_cap`): the same proximal ratio and
behaviour weight pi_old / pi_behav, but a token whose weight exceeds C is dropped (weight 0)
rather than truncated to C; the token-mean's denominator still counts it (AReaL divides by
every valid token).
"""
from __future__ import annotations

import dataclasses

import torch

from megaprm.algorithms.registry import AdvantageOutputs
from megaprm.rollout.engine import RolloutBatch

MAX_LOG_RATIO = 20.0  # as the PPO ratio's clamp (algorithms/losses.py)


def off_policy(rollout_cfg) -> bool:
    """Whether a batch may be stale (`rollout.max_staleness` > 0): then pi_old is recomputed
    before the update and the update is corrected (module doc)."""
    return rollout_cfg.max_staleness > 0


def row_lag(batch: RolloutBatch, version: int) -> torch.Tensor:
    """[B] long: the trainer's weight version - the version each row was drawn with (zeros
    when the batch carries no `row_versions`)."""
    if batch.row_versions is None:
        return torch.zeros(batch.batch_size, dtype=torch.long)
    return version - batch.row_versions


def correct(adv: AdvantageOutputs, trainer_lp: torch.Tensor, batch: RolloutBatch,
            rollout_cfg) -> tuple:
    """The update's advantages corrected for the sampler's distance (`rollout.correction`, only
    off-policy): (AdvantageOutputs with w * advantages, the weights' metrics); `adv` itself and
    {} when nothing is corrected. trainer_lp [B, R]: pi_old at the sampling temperature."""
    if not off_policy(rollout_cfg) or rollout_cfg.correction == "none":
        return adv, {}
    w, metrics = tis_weights(trainer_lp, batch.sampler_logprobs, batch.response_mask.float(),
                             rollout_cfg.tis_cap, rollout_cfg.correction)
    return dataclasses.replace(adv, advantages=adv.advantages * w), metrics


def lag_metrics(lag: torch.Tensor, trainer_lp: torch.Tensor, sampler_lp: torch.Tensor,
                mask: torch.Tensor) -> dict:
    """lag [B]: trainer version - the version each row was drawn with; trainer_lp, sampler_lp
    [B, R] at the sampling temperature; mask [B, R]. `rollout/staleness` (mean over rows),
    `rollout/staleness_max`, and per lag d present `rollout/logprob_gap_lag{d}`: mean |trainer -
    sampler| over its rows' tokens."""
    m = {"rollout/staleness": float(lag.float().mean()),
         "rollout/staleness_max": float(lag.max())}
    diff = (trainer_lp - sampler_lp).abs() * mask
    for d in sorted(set(lag.tolist())):
        rows = lag == d
        m[f"rollout/logprob_gap_lag{d}"] = float(diff[rows].sum()
                                                 / mask[rows].sum().clamp(min=1))
    return m


def tis_weights(trainer_lp: torch.Tensor, sampler_lp: torch.Tensor, mask: torch.Tensor,
                cap: float, mode: str = "tis") -> tuple:
    """w [B, R] on valid tokens (0 elsewhere): `tis` min(exp(trainer - sampler), cap); `decoupled`
    exp(trainer - sampler) where it is <= cap, else 0 (AReaL's filter). Metrics:
    `rollout/is_weight_mean` (after truncation or filtering), `rollout/is_weight_max` (before),
    `rollout/is_truncated_frac` (share of valid tokens above the cap: truncated, or dropped)."""
    if mode not in ("tis", "decoupled"):
        raise ValueError(f"correction mode {mode!r}: tis or decoupled")
    ratio = torch.exp((trainer_lp - sampler_lp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)) * mask
    above = (ratio > cap) & (mask > 0)
    w = ratio.clamp(max=cap) if mode == "tis" else ratio.masked_fill(above, 0.0)
    n = mask.sum().clamp(min=1)
    return w, {"rollout/is_weight_mean": float(w.sum() / n),
               "rollout/is_weight_max": float(ratio.max()) if ratio.numel() else 0.0,
               "rollout/is_truncated_frac": float(above.sum() / n)}
