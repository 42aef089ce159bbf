"""Policy and reward-model losses: PPO clip (asymmetric + dual clip), KL estimators, entropy,
loss aggregation, and PRIME's implicit-PRM cross-entropy (§1.3, §5.3–5.6).

Pure tensor functions of `[B, T]` per-token values with a float/bool `mask[B, T]`. The global
normalisers (token or sequence counts of the whole mini-batch over DP ranks and micro-batches)
are passed in, so the trainer normalises in one place and gradient accumulation stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from megaprm.algorithms.validation import check_choice, check_mask, check_tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3", "low_var_kl")


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *,
                   global_tokens: float | None = None,
                   global_seqs: float | None = None,
                   norm_len: float | None = None) -> torch.Tensor:
    """Reduce a per-token `loss[B, T]` to a scalar (§5.4).

    * `"token-mean"`: `sum(loss * mask) / global_tokens` — pass the valid-token count of the whole
      mini-batch (all DP ranks, all micro-batches) so summing micro-batch losses and averaging
      gradients over DP reproduces the mini-batch token mean (PRIME, PROF, PAPO).
    * `"seq-mean-token-mean"`: per-sequence token mean, summed and divided by `global_seqs` (PURE).
    * `"seq-mean-token-sum"`: per-sequence token sum, summed and divided by `global_seqs`.
    * `"seq-mean-token-sum-norm"` (Dr.GRPO, arXiv 2503.20783; verl's `agg_loss` mode of that
      name): per-sequence token sum divided by a constant `norm_len` (the generation budget,
      e.g. rollout.max_tokens; default the padded width T as in verl), then the mean over
      sequences (`global_seqs`), so no response length enters the normaliser.
    Without the global counts the local ones are used (single micro-batch, single rank).
    """
    check_choice(mode, "loss_agg_mode", AGG_MODES)
    m = mask.to(loss.dtype)
    if mode == "token-mean":
        denom = m.sum() if global_tokens is None else torch.as_tensor(global_tokens, dtype=loss.dtype)
        return (loss * m).sum() / denom.clamp(min=1)
    per_seq = (loss * m).sum(1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / m.sum(1).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        width = float(loss.shape[-1]) if norm_len is None else float(norm_len)
        if width <= 0:
            raise ValueError(f"norm_len={norm_len!r}: seq-mean-token-sum-norm needs a constant > 0 "
                             "(the generation budget, e.g. rollout.max_tokens)")
        per_seq = per_seq / width
    denom = float(loss.shape[0]) if global_seqs is None else float(global_seqs)
    return per_seq.sum() / max(denom, 1.0)


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate `[B, T]` from log-probs of the sampled tokens (§5.5).

    * `"k1"`: `logp - logp_ref` (PURE's in-reward KL).
    * `"k2"`: `0.5 (logp - logp_ref)^2`.
    * `"k3"` / `"low_var_kl"`: `exp(d) - d - 1` with `d = logp_ref - logp` clamped to [-20, 20],
      the result clamped to [-10, 10] (verl; PROF's KL loss).
    Use it in the reward (`reward -= beta * kl`) or as a loss (`aggregate_loss(kl, mask)`).
    """
    check_choice(kind, "kind", KL_KINDS)
    if kind == "k1":
        return logp - logp_ref
    if kind == "k2":
        return 0.5 * (logp - logp_ref) ** 2
    d = torch.clamp(logp_ref - logp, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(d) - d - 1.0, min=-10.0, max=10.0)


@dataclass(frozen=True)
class PolicyLossMetrics:
    """Masked token means over this micro-batch (rank-local; the trainer averages them): floats,
    or 0-d device tensors with `host=False` (the trainer reads a whole mini-batch's at once)."""

    clip_frac: float        # tokens where the clipped branch is active (eps_low / eps_high)
    dual_clip_frac: float   # tokens with A < 0 where the dual clip -A*c bounds the loss
    approx_kl: float        # mean(logp_old - logp), k1 between the rollout and current policy
    ratio_mean: float
    ratio_max: float

    def as_dict(self, prefix: str = "actor/") -> dict[str, float]:
        return {prefix + f.name: getattr(self, f.name) for f in fields(self)}


def ppo_clip_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, *, eps_low: float = 0.2, eps_high: float = 0.2,
                  dual_clip_c: float | None = 3.0, agg: str = "token-mean",
                  global_tokens: float | None = None, global_seqs: float | None = None,
                  norm_len: float | None = None,
                  host: bool = True) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """PPO clipped surrogate with clip-higher and dual clip (§5.3) -> `(loss, metrics)`.

    `rho = exp(logp - logp_old)` (log-ratio clamped to [-20, 20]); per token
    `l = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))`; where A < 0 and `dual_clip_c`
    is set, `l = min(l, -A c)` (c > 1; verl default 3; `None` disables it as in PRIME/PURE).
    Shapes `[B, T]`; aggregated with `aggregate_loss(agg, global_tokens, global_seqs, norm_len)`.
    """
    shape = tuple(logp.shape)
    check_tensor(logp, "logp", (None, None), finite=False, dims="[B, T]")
    check_tensor(logp_old, "logp_old", shape, finite=False, dims="[B, T]")
    check_tensor(advantages, "advantages", shape, dims="[B, T]")
    m = check_mask(mask, "mask", shape, "[B, T]").to(logp.dtype)
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"eps_low={eps_low}, eps_high={eps_high}: clip ranges must be >= 0")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c={dual_clip_c}: must be > 1 (verl uses 3.0) or None to disable")
    log_ratio = torch.clamp(logp - logp_old, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    clipped = torch.maximum(pg1, pg2)
    per_token = clipped
    dual = torch.zeros_like(clipped, dtype=torch.bool)
    if dual_clip_c is not None:
        pg3 = -advantages * dual_clip_c
        dual = (advantages < 0) & (clipped > pg3)
        per_token = torch.where(advantages < 0, torch.minimum(clipped, pg3), clipped)
    loss = aggregate_loss(per_token, m, agg, global_tokens=global_tokens, global_seqs=global_seqs,
                          norm_len=norm_len)

    with torch.no_grad():
        n = m.sum().clamp(min=1)
        # ratio > 0, so the max over masked-out zeros is the max over valid tokens, or 0 if none
        values = torch.stack([((pg2 > pg1).to(m.dtype) * m).sum() / n,
                              (dual.to(m.dtype) * m).sum() / n, (-log_ratio * m).sum() / n,
                              (ratio * m).sum() / n,
                              torch.where(m.bool(), ratio, 0.0).max()])
        metrics = PolicyLossMetrics(*(values.tolist() if host else values.unbind()))
    return loss, metrics


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean", *,
                  global_tokens: float | None = None,
                  global_seqs: float | None = None,
                  norm_len: float | None = None) -> torch.Tensor:
    """Aggregated token entropy `[B, T]` -> scalar; the actor loss subtracts `coef * this` (§5.6)."""
    return aggregate_loss(entropy, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs,
                          norm_len=norm_len)


def actor_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, *, eps_low: float = 0.2, eps_high: float = 0.2,
               dual_clip_c: float | None = 3.0, agg: str = "token-mean",
               entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
               logp_ref: torch.Tensor | None = None, kl_coef: float = 0.0,
               kl_kind: str = "low_var_kl", global_tokens: float | None = None,
               global_seqs: float | None = None,
               norm_len: float | None = None, host: bool = True) -> tuple[torch.Tensor, dict]:
    """PPO loss `- entropy_coef * H + kl_coef * KL(pi || ref)` (KL as a loss, §5.5) -> `(loss, metrics)`.

    The entropy and KL terms use the same aggregation and global normalisers as the PPO term;
    `norm_len` is seq-mean-token-sum-norm's constant (pass rollout.max_tokens). `host=False`:
    the metrics stay 0-d device tensors (no host read here).
    """
    norms = dict(global_tokens=global_tokens, global_seqs=global_seqs, norm_len=norm_len)
    loss, pm = ppo_clip_loss(logp, logp_old, advantages, mask, eps_low=eps_low, eps_high=eps_high,
                             dual_clip_c=dual_clip_c, agg=agg, host=host, **norms)
    metrics = pm.as_dict()
    read = float if host else torch.Tensor.detach
    metrics["actor/pg_loss"] = read(loss.detach())
    if entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef != 0 needs entropy[B, T]; pass it or set entropy_coef=0")
        ent = entropy_bonus(entropy, mask, agg, **norms)
        loss = loss - entropy_coef * ent
        metrics["actor/entropy"] = read(ent.detach())
    if kl_coef:
        if logp_ref is None:
            raise ValueError("kl_coef != 0 needs logp_ref[B, T] (reference policy); pass it or set kl_coef=0")
        kl = aggregate_loss(kl_penalty(logp, logp_ref, kl_kind), mask.to(logp.dtype), agg, **norms)
        loss = loss + kl_coef * kl
        metrics["actor/kl_loss"] = read(kl.detach())
    return loss, metrics


def implicit_prm_ce_loss(logp_prm: torch.Tensor, logp_ref: torch.Tensor, response_mask: torch.Tensor,
                         outcome: torch.Tensor, *, beta: float = 0.05,
                         global_seqs: float | None = None) -> torch.Tensor:
    """PRIME implicit-PRM loss `BCE(sigmoid(beta * sum_t m_t (logp_prm - logp_ref)_t), o)` (§1.3).

    `logp_prm[B, T]` carries gradients (the PRM), `logp_ref[B, T]` is frozen, `outcome[B]` in
    {0,1}. Summed over responses and divided by `global_seqs` (default B, the micro-batch mean).
    """
    shape = tuple(logp_prm.shape)
    check_tensor(logp_ref, "logp_ref", shape, dims="[B, T]")
    m = check_mask(response_mask, "response_mask", shape, "[B, T]").to(logp_prm.dtype)
    check_tensor(outcome, "outcome", (shape[0],), dims="[B]")
    logits = beta * ((logp_prm - logp_ref) * m).sum(1)
    loss = F.binary_cross_entropy_with_logits(logits, outcome.to(logits.dtype), reduction="sum")
    return loss / max(float(shape[0] if global_seqs is None else global_seqs), 1.0)


def guard_ratio_mean(logp: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor,
                     scope: str = "token") -> torch.Tensor:
    """The mean PPO ratio a skip guard (PURE's, actor.skip_ratio_above) compares with its bound,
    over one micro-batch [B, T], as a 0-d tensor on the inputs' device (no host read): `token`,
    the mean over its valid tokens; `sequence`, the mean over its sequences (those with a valid
    token) of each one's token mean, as released (CJReinforce/PURE models/loss.py:78-81,
    masked_mean over dim=-1 then .mean()); 0 for a micro-batch with no valid token."""
    ratio = torch.exp(logp.detach() - logp_old) * mask
    if scope == "token":
        return ratio.sum() / mask.sum().clamp(min=1)
    tokens = mask.sum(1)
    real = (tokens > 0).to(ratio.dtype)
    per_seq = ratio.sum(1) / tokens.clamp(min=1)
    return (per_seq * real).sum() / real.sum().clamp(min=1)
