"""Advantage estimators: GRPO, Dr.GRPO, RLOO, PAPO, Blend (sequence level), PRIME and PURE (token level).

Every estimator takes this rank's samples and `group`, the data-parallel process group
(`None` = single process). A *group of samples* is the n responses to one prompt, named by
`group_ids[B]` (int64); its members may sit on different DP ranks, and all per-group and
per-batch statistics are reduced through `megaprm.parallel.reductions` with a fixed number of
collectives per call. The result equals the single-process computation on the concatenated
batch up to floating-point summation order.

Section numbers (§) refer to docs/algorithms.md; where paper and released code differ
("code ≠ paper" there), the released code is the default and the paper form is a switch.

Shapes: B samples on this rank, T response tokens (right padding), S steps per response.
"""
from __future__ import annotations

from typing import Any

import torch

from megaprm.algorithms.validation import (
    check_choice,
    check_mask,
    check_tensor,
    check_vector,
)
from megaprm.parallel.reductions import (
    GroupIndex,
    all_reduce,
    group_index,
    group_moments,
    group_sums,
    is_distributed,
)

# --------------------------------------------------------------------------- group z-scores

def _zscore(x: torch.Tensor, index: GroupIndex, mask: torch.Tensor | None, *, eps: float,
            scale_by_std: bool, zero_if_flat: bool) -> torch.Tensor:
    """Column-wise group z-score of `x[B, K]` over members `mask[B, K]` -> float64 `[B, K]`.

    Groups (of members) smaller than 2 give 0; with `zero_if_flat` so do groups whose unbiased
    std is <= eps (PAPO). Non-members give 0. All K columns share one pair of all-reduces.
    """
    mom = group_moments(x, index, mask)
    std = mom.unbiased_std()                                          # [G, K]
    ok = mom.count >= 2
    if zero_if_flat:
        ok = ok & (std > eps)
    scale = ok / std.add_(eps) if scale_by_std else ok.to(std.dtype)  # bool / float -> float64
    return mom.centred * index.per_sample(scale)                      # centred is 0 off-mask


def grpo(outcome: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6,
         scale_by_std: bool = True, keep: torch.Tensor | None = None,
         group: Any | None = None) -> torch.Tensor:
    """GRPO group z-score `(o_i - mean_g) / (std_g + eps)` -> `[B]` (§3.5, §5.7).

    `outcome[B]` is the sequence reward, `group_ids[B]` the prompt id. std is unbiased (Bessel),
    eps is added to the std as in verl. A group of size 1 gets 0 (verl gives `o/(1+eps)` by
    using mean 0, std 1; a lone sample carries no group-relative signal, so we return 0).
    `scale_by_std=False` is Dr.GRPO: mean-centred only. `keep[B]` (bool, optional) leaves the
    samples a filter dropped out of the group statistics and gives them 0 (PROF-GRPO's "GRPO on
    the kept responses", §3.5). 4 collectives when distributed.
    """
    check_vector(outcome, "outcome")
    if keep is not None:
        check_tensor(keep, "keep", (outcome.shape[0],), dims="[B]")
    index = group_index(group_ids, group, outcome.shape[0])
    if keep is None and not is_distributed(group):
        return _grpo_local(outcome.to(torch.float64), index, eps, scale_by_std).to(outcome.dtype)
    member = None if keep is None else keep.bool()[:, None]
    adv = _zscore(outcome[:, None], index, member, eps=eps, scale_by_std=scale_by_std,
                  zero_if_flat=False)
    return adv[:, 0].to(outcome.dtype)


def _grpo_local(x: torch.Tensor, index: GroupIndex, eps: float, scale_by_std: bool) -> torch.Tensor:
    """`_zscore` of one unmasked float64 column on one process: the hot path of GRPO.

    Same two-pass maths on 1-D tensors with in-place updates: ~65 ATen calls instead of the
    generic `[B, K]` path's ~100, which is what a call costs on CPU at 8192 samples (see the
    verl comparison in `scripts/bench_advantages.py`). Distributed calls take the generic path.
    """
    g, n_groups = index.dense, index.num_groups
    count = x.new_zeros(n_groups).index_add_(0, g, torch.ones_like(x))
    mean = x.new_zeros(n_groups).index_add_(0, g, x).div_(count.clamp(min=1))
    centred = x - mean.index_select(0, g)
    ok = count >= 2
    if not scale_by_std:
        return centred.mul_(ok.index_select(0, g))
    m2 = x.new_zeros(n_groups).index_add_(0, g, centred * centred)
    std = m2.div_((count - 1).clamp_(min=1)).sqrt_()
    return centred.mul_((ok / std.add_(eps)).index_select(0, g))


def rloo(outcome: torch.Tensor, group_ids: torch.Tensor, *,
         group: Any | None = None) -> torch.Tensor:
    """RLOO `o_i - mean_{j != i} o_j` -> `[B]` (§1.4 outcome part, §2.4 VR term).

    Computed as `(n o_i - sum_g) / (n - 1)`; a group of size 1 gets 0. 3 collectives.
    """
    check_vector(outcome, "outcome")
    index = group_index(group_ids, group, outcome.shape[0])
    return _rloo(outcome.to(torch.float64), index).to(outcome.dtype)


def _rloo(x: torch.Tensor, index: GroupIndex) -> torch.Tensor:
    s = index.per_sample(group_sums(torch.stack([torch.ones_like(x), x], dim=1), index))
    n, total = s[:, 0], s[:, 1]
    return torch.where(n >= 2, (n * x - total) / (n - 1).clamp(min=1), torch.zeros_like(x))


def papo(outcome: torch.Tensor, process: torch.Tensor, group_ids: torch.Tensor, *,
         lam: float = 1.0, eps: float = 1e-6, mode: str = "decoupled",
         group: Any | None = None) -> torch.Tensor:
    """PAPO decoupled advantage `A_out + lam * A_proc` -> `[B]` (§4.2; ablations §4.3).

    `outcome[B]` in {0,1} (correct = `outcome == 1`), `process[B]` the sequence process score.
    * `"decoupled"` (released default): A_out = z-score of o over the group, 0 when the group has
      < 2 samples or std <= eps; A_proc = z-score of p among the correct responses only, 0 when
      < 2 are correct or their std <= eps, and 0 for wrong responses. λ is fixed (the adaptive
      λ_safety clipping of one script is not in the released estimator, §4.2 ⚠).
    * `"fullnorm"`: A_proc = z-score over all G of p with p := 0 for wrong responses, as released
      (so correctness is counted twice, §4.3 ⚠); same guards as A_out.
    * `"multiplicative"`: GRPO on the single reward o·p (`lam` unused).
    """
    check_choice(mode, "mode", ("decoupled", "fullnorm", "multiplicative"))
    check_vector(outcome, "outcome")
    check_vector(process, "process", outcome.shape[0])
    index = group_index(group_ids, group, outcome.shape[0])
    o, p = outcome.to(torch.float64), process.to(torch.float64)
    correct = outcome == 1
    if mode == "multiplicative":
        adv = _zscore((o * p)[:, None], index, None, eps=eps, scale_by_std=True, zero_if_flat=False)
        return adv[:, 0].to(outcome.dtype)
    if mode == "decoupled":
        x = torch.stack([o, p], dim=1)
        mask = torch.stack([torch.ones_like(correct), correct], dim=1)
    else:
        x = torch.stack([o, torch.where(correct, p, torch.zeros_like(p))], dim=1)
        mask = None
    z = _zscore(x, index, mask, eps=eps, scale_by_std=True, zero_if_flat=True)
    return (z[:, 0] + lam * z[:, 1]).to(outcome.dtype)


def blend(outcome: torch.Tensor, process: torch.Tensor, group_ids: torch.Tensor, *,
          beta: float = 0.8, group: Any | None = None) -> torch.Tensor:
    """PROF's Blend-PRM-GRPO baseline: GRPO on `o_i + beta * p_i` -> `[B]` (§3.4).

    The released `blend_grpo` adds `beta * ave_prm` to token 0 of the token rewards and GRPO
    sums rewards over tokens, so the sequence reward is exactly `o + beta * mean_h s_{i,h}`;
    `process[B]` is that step-mean PRM score. eps = 1e-6, unbiased std.
    """
    check_vector(outcome, "outcome")
    check_vector(process, "process", outcome.shape[0])
    reward = outcome.to(torch.float64) + beta * process.to(torch.float64)
    return grpo(reward, group_ids, group=group).to(outcome.dtype)


def _group_sums_per_sample(index: GroupIndex, *columns: torch.Tensor) -> list[torch.Tensor]:
    """Group sums of several `[B]` columns (one collective), each mapped back to its samples
    as a `[B]` float64 vector: a 1-D `index_select` per column costs far less on CPU than one
    on the strided `[G, K]` table."""
    table = group_sums(torch.stack(columns, dim=1), index)
    return [index.per_sample(table[:, k]) for k in range(len(columns))]


# --------------------------------------------------------------------------- token helpers

def last_token_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index `[B]` of the last valid token of each row of `response_mask[B, T]` (-1 if empty)."""
    b, t = response_mask.shape
    if t == 0:
        return torch.full((b,), -1, dtype=torch.long, device=response_mask.device)
    pos = torch.arange(t, device=response_mask.device).expand(b, t)
    return torch.where(response_mask.bool(), pos, torch.full_like(pos, -1)).amax(dim=1)


def _put_last(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place `values[B]` at each row's last valid token of a zero `[B, T]` (empty rows stay 0)."""
    out = torch.zeros(response_mask.shape, dtype=values.dtype, device=values.device)
    last = last_token_index(response_mask)
    rows = torch.nonzero(last >= 0).flatten()
    out[rows, last[rows]] = values[rows]
    return out


def discounted_returns(rewards: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Return-to-go `G_t = sum_{s>=t} gamma^(s-t) r_s` along T of `rewards[B, T]` (§1.4, §2.5).

    gamma = 1 is a reverse cumsum; otherwise a backward scan over T (no gamma^-t rescaling,
    which underflows for long responses). Padded rewards must already be 0.
    """
    if gamma == 1.0:
        return rewards.flip(1).cumsum(1).flip(1)
    out = torch.empty_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = rewards[:, t] + gamma * running
        out[:, t] = running
    return out


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8,
                  group: Any | None = None) -> torch.Tensor:
    """verl's `masked_whiten` over the GLOBAL batch: `(x - mean) * rsqrt(var + eps)`, masked.

    mean and unbiased variance over all valid tokens of `values[B, T]` on every DP rank (two
    all-reduces; §1.4 "Whiten"). Padded positions are returned as 0.

    Row sums and row sums of squares (float32 over T, accumulated in float64 over rows) give
    the centred sum of squares as `sum x^2 - 2 mean sum x + n mean^2`: two reading passes and
    two writing passes over `[B, T]`, no float64 `[B, T]` temporaries.
    """
    m = mask.to(values.dtype)
    n_local = m.sum(1).to(torch.float64).sum()
    return _whiten_masked(values * m, m, n_local, eps=eps, group=group,
                          inplace=True).to(values.dtype)


def _whiten_masked(x: torch.Tensor, m: torch.Tensor, n_local: torch.Tensor, *, eps: float,
                   group: Any | None, inplace: bool,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """`masked_whiten` of `x[B, T]` that is already 0 off the mask `m` (same dtype), whose
    valid-token count on this rank is `n_local` (float64 scalar)."""
    s_local = x.sum(1).to(torch.float64).sum()
    s = all_reduce(torch.stack([n_local, s_local]), "sum", group)
    n, mean = s[0], s[1] / s[0].clamp(min=1)
    sq = torch.linalg.vector_norm(x, dim=1).to(torch.float64).square().sum()
    local = sq - 2 * mean * s_local + mean * mean * n_local
    ss = all_reduce(local.clamp(min=0).reshape(1), "sum", group)[0]
    var = ss / (n - 1).clamp(min=1)
    rstd = float(torch.rsqrt(var + eps))
    if inplace:
        return x.sub_(m, alpha=float(mean)).mul_(rstd)
    return torch.sub(x, m, alpha=float(mean), out=out).mul_(rstd)


# --------------------------------------------------------------------------- PRIME (§1)

def implicit_process_reward(logp_prm: torch.Tensor, logp_ref: torch.Tensor,
                            response_mask: torch.Tensor) -> torch.Tensor:
    """Implicit PRM token reward `q_t = log pi_prm(y_t) - log pi_ref(y_t)` -> `[B, T]` (§1.2).

    As in the released code the raw log-ratio is used, without beta: PRIME's batch_norm fixes the
    scale afterwards (§1.2 ⚠). Padded positions are 0.
    """
    check_tensor(logp_prm, "logp_prm", (None, None), dims="[B, T]")
    check_tensor(logp_ref, "logp_ref", tuple(logp_prm.shape), dims="[B, T]")
    mask = check_mask(response_mask, "response_mask", tuple(logp_prm.shape), "[B, T]")
    return torch.sub(logp_prm, logp_ref).mul_(mask.to(logp_prm.dtype))


def prime_step_rewards(q: torch.Tensor, response_mask: torch.Tensor, granularity: str = "token",
                       step_end_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Process reward per token from `q[B, T]` at the chosen granularity (§1.2).

    * `"token"`: every valid token keeps its own q.
    * `"whole"`: the last valid token carries `sum_t q_t` (an implicit ORM).
    * `"step"`: `step_end_mask[B, T]` (bool) marks step-closing tokens; the end e_j carries
      `sum_{t in (e_{j-1}, e_j]} q_t`. The last valid token always closes a step, so no q is lost.
    """
    check_choice(granularity, "granularity", ("token", "whole", "step"))
    mask = response_mask.to(q.dtype)
    q = q * mask
    if granularity == "token":
        return q
    ends = torch.zeros(q.shape, dtype=torch.bool, device=q.device)
    if granularity == "step":
        if step_end_mask is None:
            raise ValueError("granularity='step' needs step_end_mask[B, T] (bool, True at each "
                             "step-closing token); pass it or use granularity='token'|'whole'")
        check_tensor(step_end_mask, "step_end_mask", tuple(q.shape), dims="[B, T]")
        ends = step_end_mask.bool() & response_mask.bool()
    ends |= _put_last(torch.ones(q.shape[0], device=q.device), response_mask).bool()
    csum = q.cumsum(1)
    rows, cols = torch.nonzero(ends, as_tuple=True)      # row-major: ends sorted within a row
    at_end = csum[rows, cols]
    prev = torch.cat([at_end.new_zeros(1), at_end[:-1]])
    first_in_row = torch.ones_like(rows, dtype=torch.bool)
    first_in_row[1:] = rows[1:] != rows[:-1]
    out = torch.zeros_like(q)
    out[rows, cols] = at_end - torch.where(first_in_row, torch.zeros_like(prev), prev)
    return out


def prime_batch_norm(scores: torch.Tensor, response_mask: torch.Tensor, *, scope: str = "global",
                     group: Any | None = None) -> torch.Tensor:
    """PRIME `batch_norm`: divide by `max_{i,t} |reverse cumsum_t score| + 1e-6` (§1.2).

    `scope="global"` (our default) takes the max over the whole DP batch with one all-reduce
    MAX; `scope="shard"` is the released behaviour, the max over this rank's shard (§1.2 ⚠).
    """
    check_choice(scope, "scope", ("global", "shard"))
    rtg = discounted_returns(scores * response_mask.to(scores.dtype), 1.0)
    peak = rtg.abs().amax().to(torch.float64).reshape(1) if rtg.numel() else \
        torch.zeros(1, dtype=torch.float64, device=scores.device)
    if scope == "global":
        peak = all_reduce(peak, "max", group)
    return (scores / (peak + 1e-6)).to(scores.dtype)


def prime(outcome: torch.Tensor, logp_prm: torch.Tensor, logp_ref: torch.Tensor,
          response_mask: torch.Tensor, group_ids: torch.Tensor, *, granularity: str = "token",
          step_end_mask: torch.Tensor | None = None, norm: str = "batch_norm",
          norm_scope: str = "global", rloo_form: str = "code", gamma_outcome: float = 1.0,
          gamma_process: float = 1.0, outcome_coef: float = 1.0, process_coef: float = 1.0,
          group: Any | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PRIME advantage: RLOO on outcome and implicit process reward, returns, whitening (§1.2–1.4).

    Inputs: `outcome[B]`, `logp_prm[B, T]`, `logp_ref[B, T]`, `response_mask[B, T]`,
    `group_ids[B]`. Returns `(advantages[B, T], returns[B, T])`, returns un-whitened.

    1. q = logp_prm - logp_ref, at `granularity` (token | whole | step via `step_end_mask`).
    2. `norm="batch_norm"`: scale by the max |process return-to-go| (global or per shard); "none".
    3. RLOO with K group members (K = 1 gives 0 for both terms: no leave-one-out exists):
       outcome at the last valid token `(K o_i - sum_j o_j)/(K-1)`; process on every valid token,
       with mu_j = per-token mean process reward of response j:
       `rloo_form="code"` (released) `r_t K/(K-1) - sum_j mu_j/(K-1)`;
       `"paper"` (Algorithm 1) `r_t - sum_{j!=i} mu_j/(K-1)` (§1.4 ⚠).
    4. `R = outcome_coef * G^o + process_coef * G^p` with discounts gamma_outcome/gamma_process
       (released: coefficients 1 — its rm_coef/reward_coef never reach the advantage, §1.4 ⚠).
    5. advantages = masked_whiten(R) over the global batch.

    With gamma = 1 (the released setting) every step is a per-row affine map of one forward
    cumsum: with C the cumsum of r and V_t the valid tokens at or after t,
    `G^p_t = a_i (C_T - C_{t-1}) - c_i V_t` and `G^o_t = o_i` on valid tokens (see
    `_prime_returns_gamma1`). At token granularity with a right-padded mask this runs as three
    sweeps over blocks of rows that stay in cache (`_prime_cumsum_sweep`,
    `_prime_finish_sweeps`): inputs read once, outputs written about twice.
    """
    check_choice(norm, "norm", ("batch_norm", "none"))
    check_choice(rloo_form, "rloo_form", ("code", "paper"))
    check_vector(outcome, "outcome")
    b = outcome.shape[0]
    if granularity == "token" and gamma_outcome == 1.0 and gamma_process == 1.0:
        check_tensor(logp_prm, "logp_prm", (b, None), finite=False, dims="[B, T]")
        sweep = _prime_cumsum_sweep(logp_prm, logp_ref, response_mask, norm)
        if sweep is not None:
            index = group_index(group_ids, group, b)
            return _prime_finish_sweeps(outcome, sweep, response_mask, index, norm=norm,
                                        norm_scope=norm_scope, rloo_form=rloo_form,
                                        outcome_coef=outcome_coef, process_coef=process_coef,
                                        group=group)
    check_tensor(logp_prm, "logp_prm", (b, None), dims="[B, T]")
    q = implicit_process_reward(logp_prm, logp_ref, response_mask)
    mask = response_mask.to(q.dtype)
    # q is already 0 off-mask; token granularity keeps it as is
    r = q if granularity == "token" else prime_step_rewards(q, response_mask, granularity,
                                                             step_end_mask)
    index = group_index(group_ids, group, b)
    if gamma_outcome == 1.0 and gamma_process == 1.0:
        returns, n_tok = _prime_returns_gamma1(
            outcome, r, mask, index, norm=norm, norm_scope=norm_scope, rloo_form=rloo_form,
            outcome_coef=outcome_coef, process_coef=process_coef, group=group)
        # r's buffer (now its cumsum, no longer needed) receives the advantages: one fresh
        # [B, T] allocation less, which on CPU is a page-faulting pass of its own
        adv = _whiten_masked(returns, mask, n_tok.sum(), eps=1e-8, group=group, inplace=False,
                             out=r if r.dtype == returns.dtype else None)
        return adv.to(logp_prm.dtype), returns.to(logp_prm.dtype)
    if norm == "batch_norm":
        r = prime_batch_norm(r, response_mask, scope=norm_scope, group=group)
    r = r.to(torch.float64)
    n_tok = mask.sum(1).to(torch.float64)
    mu = (r * mask).sum(1) / n_tok.clamp(min=1)                       # [B] per-token mean
    a, c, out_last = _prime_rloo_coefficients(outcome, mu, index, rloo_form)
    proc = (r * a[:, None] - c[:, None]) * mask
    g_out = discounted_returns(_put_last(out_last, response_mask), gamma_outcome)
    g_proc = discounted_returns(proc, gamma_process)
    returns = (outcome_coef * g_out + process_coef * g_proc) * mask
    adv = masked_whiten(returns, mask, group=group)
    return adv.to(logp_prm.dtype), returns.to(logp_prm.dtype)


def _prime_rloo_coefficients(outcome: torch.Tensor, mu: torch.Tensor, index: GroupIndex,
                             rloo_form: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RLOO of step 3 as per-row coefficients (float64 `[B]` each, one all-reduce):
    process reward `a_i r_t - c_i` on valid tokens, outcome term `out_i` at the last token;
    all three 0 for a group of one."""
    o = outcome.to(torch.float64)
    k, sum_o, sum_mu = _group_sums_per_sample(index, torch.ones_like(o), o, mu)
    loo = (k >= 2).to(torch.float64)
    km1 = (k - 1).clamp(min=1)
    out_last = (k * o - sum_o) / km1 * loo
    if rloo_form == "code":
        a, c = k / km1, sum_mu / km1
    else:
        a, c = torch.ones_like(k), (sum_mu - mu) / km1
    return a * loo, c * loo, out_last


def _prime_returns_gamma1(outcome: torch.Tensor, r: torch.Tensor, mask: torch.Tensor,
                          index: GroupIndex, *, norm: str, norm_scope: str, rloo_form: str,
                          outcome_coef: float, process_coef: float,
                          group: Any | None) -> tuple[torch.Tensor, torch.Tensor]:
    """PRIME returns `[B, T]` (and the valid tokens per row, float64 `[B]`) for gamma = 1 from one cumsum of `r[B, T]` (zero off-mask;
    overwritten).

    reverse-cumsum_t r = C_T - C_{t-1} (C the forward cumsum, C_{-1} = 0), so
    * batch_norm's max |return-to-go| is `max_i max(C_T - min_t C_{t-1}, max_t C_{t-1} - C_T)`
      (row min / max of C, no `[B, T]` temporary);
    * returns_t = m_t (kappa_i - alpha_i C_{t-1} + gamma_i W_{t-1}), W the cumsum of the mask
      (W_{t-1} = t for a right-padded mask), with alpha = pc a / peak, gamma = pc c and
      kappa = oc out + alpha C_T - gamma n: three fused passes.
    """
    b, t = r.shape
    dt = r.dtype
    csum = r.cumsum_(1)                              # [B, T], in place: r is this call's own
    total = csum[:, -1].to(torch.float64) if t else r.new_zeros(b, dtype=torch.float64)
    scale = torch.ones((), dtype=torch.float64, device=r.device)
    if norm == "batch_norm":
        if t > 1:
            prev = csum[:, :-1]
            lo = prev.amin(1).to(torch.float64).clamp(max=0)
            hi = prev.amax(1).to(torch.float64).clamp(min=0)
        else:
            lo = hi = torch.zeros_like(total)
        peak = torch.maximum(total - lo, hi - total).amax().reshape(1) if b else \
            torch.zeros(1, dtype=torch.float64, device=r.device)
        if norm_scope == "global":
            peak = all_reduce(peak, "max", group)
        scale = 1.0 / (peak[0] + 1e-6)
    n_tok, prefix = _row_counts(mask)
    mu = total * scale / n_tok.clamp(min=1)                           # per-token mean of r / peak
    a, c, out_last = _prime_rloo_coefficients(outcome, mu, index, rloo_form)
    alpha = process_coef * a * scale
    gamma = process_coef * c
    kappa = outcome_coef * out_last + alpha * total - gamma * n_tok
    if prefix:
        counts_before = torch.arange(t, dtype=dt, device=r.device)   # W_{t-1} = t
        ret = torch.addcmul(kappa.to(dt)[:, None], gamma.to(dt)[:, None], counts_before[None, :])
    else:
        w = mask.cumsum(1)
        ret = kappa.to(dt)[:, None].expand(b, t).clone()
        ret[:, 1:].addcmul_(gamma.to(dt)[:, None], w[:, :-1])
    ret[:, 1:].addcmul_(csum[:, :-1], alpha.to(dt)[:, None], value=-1.0)
    return ret.mul_(mask), n_tok


def _row_counts(mask: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """`(n[B] float64 valid tokens per row, prefix)` for a {0,1} `mask[B, T]`; `prefix` is True
    when every row is right-padded (valid tokens = positions 0..n-1).

    A row's n ones sit at positions summing to at least n(n-1)/2, with equality only for the
    prefix, so one matrix-vector product checks it (exact: float32 sums of integers < 2^24, or
    float64 for long rows).
    """
    b, t = mask.shape
    dt = torch.float32 if t <= 5792 else torch.float64
    m = mask.to(dt)
    n = m.sum(1)
    pos = m @ torch.arange(t, dtype=dt, device=mask.device)
    prefix = bool(torch.equal(pos, n * (n - 1) / 2)) if b else True
    return n.to(torch.float64), prefix


# --------------------------------------------------------------------------- row sweeps

# The token-level fast paths (PRIME at gamma = 1, PURE's per-step path) make their passes over
# `[B, T]` one block of rows at a time, the block about this many bytes: the several passes over
# a block then find it in cache, and each input and output crosses the memory bus about once.
SWEEP_BLOCK_BYTES = 1 << 21


def _row_blocks(b: int, t: int, itemsize: int, device: torch.device) -> list[slice]:
    """Row slices of `[B, T]` covering it in blocks (one block off CPU: kernels there are
    launched per block and the caches are not the point)."""
    if device.type != "cpu":
        return [slice(0, b)]
    rows = max(1, SWEEP_BLOCK_BYTES // max(1, t * itemsize))
    return [slice(i, min(i + rows, b)) for i in range(0, b, rows)]


def _float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float mask as given (checked in its own dtype), a bool / integer one as `dtype`."""
    return mask if mask.dtype.is_floating_point else mask.to(dtype)


def _prefix_count(mask: torch.Tensor, scratch: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor | None:
    """Valid tokens per row of `mask[R, T]` when it is exactly right-padded {0, 1} (row i = n_i
    ones, then zeros); None otherwise, the caller then takes its general path, whose checks
    reject non-binary and non-finite masks.

    Exact: n_i is the row sum and `mask - (positions < n_i)`, built in `scratch` (float, the
    mask's dtype, >= R rows), must be 0 everywhere (a NaN/inf or fractional entry never gives
    0). Four cheap passes over a cached block; `torch.equal` and bool temporaries cost several
    times more on CPU.
    """
    n = mask.sum(1)
    diff = scratch[: mask.shape[0]]
    torch.lt(positions, n[:, None], out=diff)
    lo, hi = torch.sub(mask, diff, out=diff).aminmax()
    return n if float(lo) == 0.0 and float(hi) == 0.0 else None


def _prefix_counts(mask: torch.Tensor) -> torch.Tensor | None:
    """`_prefix_count` over all rows of `mask[B, T]` in blocks -> float64 `[B]`, or None."""
    b, t = mask.shape
    if b == 0 or t == 0:
        return None
    dt = mask.dtype if mask.dtype.is_floating_point else torch.float32
    blocks = _row_blocks(b, t, dt.itemsize, mask.device)
    scratch = torch.empty((blocks[0].stop, t), dtype=dt, device=mask.device)
    positions = torch.arange(t, device=mask.device)
    counts = []
    for rows in blocks:
        n = _prefix_count(_float_mask(mask[rows], dt), scratch, positions)
        if n is None:
            return None
        counts.append(n)
    return torch.cat(counts).to(torch.float64)


def _prime_cumsum_sweep(logp_prm: torch.Tensor, logp_ref: torch.Tensor,
                        response_mask: torch.Tensor,
                        norm: str) -> tuple[torch.Tensor, ...] | None:
    """First sweep of PRIME's fast path (token granularity, gamma = 1, right-padded mask):
    per row block, check the mask (`_prefix_count`), `C = cumsum_t (logp_prm - logp_ref) m`
    in a fresh `[B, T]` buffer, and the row min / max of C for batch_norm.

    Returns `(C, ret buffer, row_min, row_max, n_tokens float64 [B])`, or None, before any
    collective, when the inputs are off that layout (other shapes or dtypes, a mask that is not right-padded
    {0,1}) or not finite: the general path then runs, and its checks raise on bad values.
    Finiteness rides on the cumsum: NaN/inf anywhere in a row (padding included) makes the
    row's last C non-finite; so does an overflow of finite inputs, which the general path
    then computes as before.
    """
    b, t = logp_prm.shape
    dt = logp_prm.dtype
    if (not dt.is_floating_point or b == 0 or t == 0
            or not isinstance(logp_ref, torch.Tensor) or logp_ref.dtype != dt
            or tuple(logp_ref.shape) != (b, t) or not isinstance(response_mask, torch.Tensor)
            or tuple(response_mask.shape) != (b, t) or logp_ref.device != logp_prm.device
            or response_mask.device != logp_prm.device):
        return None
    blocks = _row_blocks(b, t, dt.itemsize, logp_prm.device)
    positions = torch.arange(t, device=logp_prm.device)
    mask_dt = response_mask.dtype if response_mask.dtype.is_floating_point else dt
    scratch = torch.empty((blocks[0].stop, t), dtype=mask_dt, device=logp_prm.device)
    csum = torch.empty((b, t), dtype=dt, device=logp_prm.device)
    ret = torch.empty_like(csum)   # both outputs first (fresh heap pages fault on first touch)
    row_min, row_max = torch.empty(b, dtype=dt, device=csum.device), torch.empty_like(csum[:, 0])
    counts = []
    for rows in blocks:
        m = _float_mask(response_mask[rows], dt)
        n = _prefix_count(m, scratch, positions)
        if n is None:
            return None
        counts.append(n)
        c = torch.sub(logp_prm[rows], logp_ref[rows], out=csum[rows])
        c.mul_(m if m.dtype == dt else m.to(dt)).cumsum_(1)
        if norm == "batch_norm":
            torch.amin(c, 1, out=row_min[rows])
            torch.amax(c, 1, out=row_max[rows])
    if not bool(torch.isfinite(csum[:, -1]).all()):
        return None
    return csum, ret, row_min, row_max, torch.cat(counts).to(torch.float64)


def _prime_finish_sweeps(outcome: torch.Tensor, sweep: tuple[torch.Tensor, ...],
                         response_mask: torch.Tensor, index: GroupIndex, *, norm: str,
                         norm_scope: str, rloo_form: str, outcome_coef: float,
                         process_coef: float,
                         group: Any | None) -> tuple[torch.Tensor, torch.Tensor]:
    """PRIME's fast path after `_prime_cumsum_sweep`: the maths of `_prime_returns_gamma1`
    and `_whiten_masked` (same collectives, same float operations) in two more sweeps over row
    blocks: returns and their row sums / norms, then the whitened advantages into C's buffer.

    batch_norm takes the row min / max over all of C rather than C_{t-1}: the extra value is
    C_T itself, which moves neither `C_T - min` nor `max - C_T` above the clamped peak.
    """
    csum, ret, row_min, row_max, n_tok = sweep
    b, t = csum.shape
    dt = csum.dtype
    total = csum[:, -1].to(torch.float64)
    scale = torch.ones((), dtype=torch.float64, device=csum.device)
    if norm == "batch_norm":
        lo = row_min.to(torch.float64).clamp_(max=0)
        hi = row_max.to(torch.float64).clamp_(min=0)
        peak = torch.maximum(total - lo, hi - total).amax().reshape(1)
        if norm_scope == "global":
            peak = all_reduce(peak, "max", group)
        scale = 1.0 / (peak[0] + 1e-6)
    mu = total * scale / n_tok.clamp(min=1)                           # per-token mean of r / peak
    a, c, out_last = _prime_rloo_coefficients(outcome, mu, index, rloo_form)
    alpha = process_coef * a * scale
    gamma = process_coef * c
    kappa = outcome_coef * out_last + alpha * total - gamma * n_tok
    alpha, gamma, kappa = (x.to(dt)[:, None] for x in (alpha, gamma, kappa))
    counts_before = torch.arange(t, dtype=dt, device=csum.device)[None, :]   # W_{t-1} = t
    row_sum, row_norm = torch.empty_like(csum[:, 0]), torch.empty_like(csum[:, 0])
    blocks = _row_blocks(b, t, dt.itemsize, csum.device)
    # the mask, known to be `positions < n`, is rebuilt per block in cache instead of being
    # read from memory again
    positions, n_dt = counts_before[0], n_tok.to(dt)[:, None]
    scratch = torch.empty((blocks[0].stop, t), dtype=dt, device=csum.device)

    def mask_block(rows: slice) -> torch.Tensor:
        return torch.lt(positions, n_dt[rows], out=scratch[: rows.stop - rows.start])

    for rows in blocks:
        r = torch.addcmul(kappa[rows], gamma[rows], counts_before, out=ret[rows])
        r[:, 1:].addcmul_(csum[rows, :-1], alpha[rows], value=-1.0)
        r.mul_(mask_block(rows))
        torch.sum(r, 1, out=row_sum[rows])
        torch.linalg.vector_norm(r, dim=1, out=row_norm[rows])
    # _whiten_masked's statistics from the row sums and norms
    n_local, s_local = n_tok.sum(), row_sum.to(torch.float64).sum()
    s = all_reduce(torch.stack([n_local, s_local]), "sum", group)
    n, mean = s[0], s[1] / s[0].clamp(min=1)
    sq = row_norm.to(torch.float64).square().sum()
    local = sq - 2 * mean * s_local + mean * mean * n_local
    ss = all_reduce(local.clamp(min=0).reshape(1), "sum", group)[0]
    var = ss / (n - 1).clamp(min=1)
    rstd = float(torch.rsqrt(var + 1e-8))
    mean_f = float(mean)
    for rows in blocks:
        torch.sub(ret[rows], mask_block(rows), alpha=mean_f, out=csum[rows]).mul_(rstd)
    return csum, ret


# --------------------------------------------------------------------------- PURE (§2)

def step_end_index_from_token_to_step(token_to_step: torch.Tensor, response_mask: torch.Tensor,
                                      num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_to_step[B, T]` (long, step number of each token, -1 outside the response) ->
    `(step_end_index[B, S], step_mask[B, S])` with S = `num_steps`: the closing token of step k
    is the last token mapped to k; steps with no token are masked out (index 0)."""
    b, t = token_to_step.shape
    valid = response_mask.bool() & (token_to_step >= 0) & (token_to_step < num_steps)
    slot = torch.where(valid, token_to_step, torch.full_like(token_to_step, num_steps))
    pos = torch.arange(t, device=token_to_step.device).expand(b, t)
    ends = torch.full((b, num_steps + 1), -1, dtype=torch.long, device=token_to_step.device)
    ends.scatter_reduce_(1, slot, pos, reduce="amax")
    ends = ends[:, :num_steps]
    step_mask = ends >= 0
    return ends.clamp(min=0), step_mask


def pure_step_weights(step_scores: torch.Tensor, step_mask: torch.Tensor, *, credit: str = "min",
                      temperature: float = 0.1) -> torch.Tensor:
    """Per-step credit weights `w[B, S]` over the valid steps of each response (§2.3).

    * `"min"` (released min-form): `softmax_k(-PR_k / T)`, so `sum_k w_k PR_k -> min_k PR_k`.
    * `"uniform"` (`--disable_weighted_reward`): `1 / K_i`.
    * `"sum"` (verl `gamma-decay`): weight 1, the plain sum form.
    Masked steps get weight 0; a response without steps gets all zeros.
    """
    check_choice(credit, "credit", ("min", "uniform", "sum"))
    m = step_mask.bool()
    if credit == "sum":
        return m.to(step_scores.dtype)
    if credit == "uniform":
        return m.to(step_scores.dtype) / m.sum(1, keepdim=True).clamp(min=1).to(step_scores.dtype)
    # softmax over the valid steps, spelt out: torch.softmax over a short last dim and where()
    # with a bool mask cost ~10x these float ops on CPU.
    if not step_scores.shape[1]:
        return torch.zeros_like(step_scores)
    off = torch.reciprocal(m.to(step_scores.dtype)).neg_().add_(1.0)   # 0 valid, -inf not
    logits = torch.div(step_scores, -temperature).add_(off)
    top = logits.amax(1, keepdim=True).nan_to_num_(neginf=0.0)   # a row without steps: 0
    e = logits.sub_(top).exp_()
    return e.div_(e.sum(1, keepdim=True).clamp_(min=1.0))        # valid rows sum to >= 1


def pure_whiten(adv: torch.Tensor, response_mask: torch.Tensor, *, var_includes_zeros: bool = True,
                exclude_zeros: bool = True, group: Any | None = None) -> torch.Tensor:
    """PURE's global whitening (§2.5): `(x - mean) * rsqrt(clamp(var_sum / count, 1e-8))`.

    `exclude_zeros=True` (the released code with separator masking): tokens whose advantage is
    exactly 0 are left at 0 and not counted, mean = sum / count; the released var_sum still
    includes the zero tokens' `(0 - mean)^2` (§2.5 ⚠, `var_includes_zeros=True`); False sums
    only over the counted tokens. `exclude_zeros=False` (released with
    `--nomask_separator_adv`): every valid token is counted and whitened. 2 all-reduces.
    """
    valid = response_mask.bool()
    nz = valid & (adv != 0) if exclude_zeros else valid
    x = adv.to(torch.float64)
    s = all_reduce(torch.stack([(x * valid).sum(), nz.sum().to(torch.float64)]), "sum", group)
    count = s[1]
    mean = s[0] / count.clamp(min=1)
    keep = valid if var_includes_zeros else nz
    var_sum = all_reduce((((x - mean) ** 2) * keep).sum().reshape(1), "sum", group)[0]
    rstd = torch.rsqrt((var_sum / count.clamp(min=1)).clamp(min=1e-8))
    return torch.where(nz, (x - mean) * rstd, torch.zeros_like(x)).to(adv.dtype)


WHITEN_ZEROS = ("released", "exclude")


def pure(outcome: torch.Tensor, step_scores: torch.Tensor, step_mask: torch.Tensor,
         step_end_index: torch.Tensor, response_mask: torch.Tensor, group_ids: torch.Tensor, *,
         credit: str = "min", temperature: float = 0.1, baseline: str = "token",
         reward_mode: str = "PRMVR", vr_coef: float = 1.0, kl: torch.Tensor | None = None,
         kl_coef: float = 0.0, mask_separator: bool = True, whiten: bool = True,
         whiten_var_includes_zeros: bool = True, whiten_zeros: str = "released",
         group: Any | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PURE min-form token advantages, OpenRLHF branch (§2.3–2.5) -> `(advantages, returns)` `[B, T]`.

    Inputs: `outcome[B]` (solved in {0,1}), `step_scores[B, S]` PR_k in [-1, 1] (= 2 p_good - 1),
    `step_mask[B, S]` (valid steps, a prefix of each row), `step_end_index[B, S]` (long, token
    position in [0, T) of the token closing step k, increasing in k; the last step closes at the
    last valid token), `response_mask[B, T]`, `group_ids[B]`; optional `kl[B, T]` (k1 per token).

    Token reward: at the closing token of step k, `w_k PR_k - baseline_k` (modes PRM, PRMVR);
    at the last valid token, `vr_coef * RLOO(solved - 1)` (modes VR, PRMVR); at every token
    `-kl_coef * kl_t`. Returns G = reverse cumsum (gamma = 1); advantages = G, then 0 at every
    step-closing token (`mask_separator`), then `pure_whiten` over the DP group (`whiten`).
    With O_j = sum_k w_jk PR_jk, |y_j| the valid tokens and L_k the tokens of step k without its
    closing token, the baselines (leave-one-out over the group; 0 for a group of size 1) are
    `"token"` (released script): `b_i L_k`, `b_i = sum_{j!=i} O_j / sum_{j!=i} |y_j|`;
    `"step"` (the older default): `b_i` at every step end, `b_i = mean_{j!=i} O_j / K_j`; `"none"`.

    `whiten_zeros`: `"released"` (default) excludes zero-advantage tokens from the whitening
    count and leaves them at 0 only with `mask_separator`, as CJReinforce/PURE's
    `NaiveReplayBuffer.normalize`; `"exclude"` always does (megaprm's earlier behaviour).

    Without the KL term the rewards sit only at step ends, so G is constant on each step's
    tokens: inputs that follow the documented layout (right-padded mask, steps tiling the
    response) are computed per step `[B, S]` and run-length decoded to tokens
    (`_expand_runs`); other inputs take the dense `[B, T]` path.
    """
    check_choice(baseline, "baseline", ("token", "step", "none"))
    check_choice(reward_mode, "reward_mode", ("PRM", "VR", "PRMVR"))
    check_choice(whiten_zeros, "whiten_zeros", WHITEN_ZEROS)
    check_vector(outcome, "outcome")
    b = outcome.shape[0]
    check_tensor(step_scores, "step_scores", (b, None), dims="[B, S]")
    n_steps = step_scores.shape[1]
    smask = check_tensor(step_mask, "step_mask", (b, n_steps), dims="[B, S]") \
        if isinstance(step_mask, torch.Tensor) and step_mask.dtype == torch.bool else \
        check_mask(step_mask, "step_mask", (b, n_steps), "[B, S]").bool()
    check_tensor(step_end_index, "step_end_index", (b, n_steps), dims="[B, S]")
    check_tensor(response_mask, "response_mask", (b, None), finite=False, dims="[B, T]")
    y_len = _prefix_counts(response_mask)   # float64 [B], None unless right-padded {0, 1}
    tmask = None if y_len is not None else \
        check_mask(response_mask, "response_mask", (b, None), "[B, T]")   # raises if bad
    t = response_mask.shape[1]
    # [B, S] work in float64 (exact here): on CPU, int64 reductions and elementwise ops with a
    # bool operand cost several times the float64 ones
    sm = smask.to(torch.float64)
    ends_f = step_end_index.long().to(torch.float64).mul_(sm)   # 0 at masked-out steps
    lo, hi = ends_f.aminmax() if ends_f.numel() else (0, 0)
    if float(lo) < 0 or float(hi) >= max(t, 1) or (t == 0 and bool(smask.any())):
        raise ValueError(f"step_end_index has valid steps outside [0, T={t}); it must hold the "
                         f"token position of each step's closing token within the response")
    if kl_coef and kl is None:
        raise ValueError("kl_coef > 0 needs kl[B, T] (per-token k1 = logp_old - logp_ref); "
                         "pass it or set kl_coef=0")
    if kl is not None:
        check_tensor(kl, "kl", (b, t), dims="[B, T]")
    index = group_index(group_ids, group, b)
    exclude_zeros = mask_separator or whiten_zeros == "exclude"
    prefix = y_len is not None
    if tmask is None:
        tmask = response_mask.float() if response_mask.dtype == torch.bool else response_mask
    else:
        y_len, prefix = _row_counts(tmask)
    kl_on = kl is not None and bool(kl_coef)
    tiled = not kl_on and prefix and _steps_tile_rows(ends_f, sm, y_len)
    ends = ends_f if tiled else step_end_index.long() * smask
    # the [B, T] outputs before the [B, S] temporaries: allocated last they would extend the
    # heap, whose fresh pages fault on first touch (~2 us per 4 KiB on the 2-core development VM)
    out = tuple(torch.empty((b, t), dtype=step_scores.dtype, device=step_scores.device)
                for _ in range(2)) if tiled else None
    step_reward, vr, seg_len = _pure_step_rewards(
        outcome, step_scores, smask, sm, ends, y_len, None if tiled else tmask, index,
        credit=credit, temperature=temperature, baseline=baseline, reward_mode=reward_mode,
        vr_coef=vr_coef)
    whiten_args = {"whiten": whiten, "mask_separator": mask_separator,
                   "exclude_zeros": exclude_zeros, "var_includes_zeros": whiten_var_includes_zeros,
                   "group": group}
    if tiled:
        tables = _pure_step_tables(step_reward, vr, seg_len, ends, smask, sm, y_len, t,
                                   dtype=step_scores.dtype, **whiten_args)
        return _expand_runs(*tables, out)
    return _pure_dense(step_reward, vr, ends, smask, tmask, kl if kl_on else None, kl_coef,
                       dtype=step_scores.dtype, **whiten_args)


def _pure_step_rewards(outcome: torch.Tensor, step_scores: torch.Tensor, smask: torch.Tensor,
                       sm: torch.Tensor, ends: torch.Tensor, y_len: torch.Tensor,
                       tmask: torch.Tensor | None,
                       index: GroupIndex, *, credit: str, temperature: float, baseline: str,
                       reward_mode: str, vr_coef: float
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """PURE's per-step rewards (float64 `[B, S]`, at each step's closing token), the verifiable
    reward `vr[B]` (at the last token, or None) and, when the steps tile the rows (`tmask` is
    None; then `ends` is float64), the tokens per step `seg_len[B, S]` (float64; None
    otherwise). `sm` is the step mask as float64. One collective.
    """
    b = step_scores.shape[0]
    pr = step_scores.to(torch.float64)
    rew_step = pure_step_weights(pr, smask, credit=credit, temperature=temperature).mul_(pr)
    big_o = rew_step.sum(1)                                                # O_i ~ min PR
    k_i = sm.sum(1)
    seg_len = None
    if tmask is None:   # step k holds the tokens (e_{k-1}, e_k]
        seg_len = ends.diff(dim=1, prepend=ends.new_full((b, 1), -1.0)).mul_(sm)
        l_k = (seg_len - 1).mul_(sm)
    else:
        csum = tmask.to(torch.float64).cumsum(1)
        at_end = torch.gather(csum, 1, ends) * smask                       # tokens up to e_k
        prev_c = torch.cat([torch.zeros_like(at_end[:, :1]), at_end.cummax(1).values[:, :-1]], dim=1)
        l_k = ((at_end - prev_c - 1).clamp(min=0)) * smask                 # L_k, closing token excluded
    o = outcome.to(torch.float64)
    o_per_k = big_o / k_i.clamp(min=1)
    s = _group_sums_per_sample(index, torch.ones_like(o), big_o, y_len, o_per_k, o,
                               big_o.abs(), o_per_k.abs())
    n = s[0]
    loo = n >= 2
    zero = torch.zeros_like(o)
    if reward_mode in ("PRM", "PRMVR"):
        if baseline == "token":
            denom = s[2] - y_len
            b_i = torch.where(loo & (denom > 0),
                              _others_sum(s[1], big_o, s[5], n) / denom.clamp(min=1), zero)
            rew_step.sub_(l_k.mul_(b_i[:, None]))
        elif baseline == "step":
            b_i = torch.where(loo, _others_sum(s[3], o_per_k, s[6], n) / (n - 1).clamp(min=1),
                              zero)
            rew_step.sub_(b_i[:, None] * sm)
        step_reward = rew_step.mul_(sm)
    else:
        step_reward = torch.zeros_like(rew_step)
    vr = None
    if reward_mode in ("VR", "PRMVR"):
        # RLOO(solved - 1)
        vr = vr_coef * torch.where(loo, (n * o - s[4]) / (n - 1).clamp(min=1), zero)
    return step_reward, vr, seg_len


def _others_sum(total: torch.Tensor, own: torch.Tensor, abs_total: torch.Tensor,
                n: torch.Tensor) -> torch.Tensor:
    """The leave-one-out sum `total - own` (`total` the group's float64 sum of n terms,
    `abs_total` the group's sum of their magnitudes), 0 where it is within the rounding error
    of its computation (4 n eps Σ|x|): where the others cancel exactly (scores on a coarse
    grid, oracle labels), the subtraction leaves a residue of ~1e-17 that the loop over the
    others does not, and with `exclude_zeros` a token whose return should be 0 would be counted
    and whitened to a non-zero advantage."""
    d = total - own
    tol = abs_total * n * (4 * torch.finfo(torch.float64).eps)
    return d.masked_fill_(d.abs() <= tol, 0.0)


def _steps_tile_rows(ends: torch.Tensor, sm: torch.Tensor, n_tok: torch.Tensor) -> bool:
    """True when the valid steps of every row are a prefix of `[B, S]`, close at strictly
    increasing positions, and the last one closes at the last valid token (rows without tokens
    have no steps): then step k covers exactly the tokens (e_{k-1}, e_k] of a right-padded row.

    `ends` and the step mask `sm` as float64 (exact), `ends` 0 at masked-out steps: with a
    valid prefix and increasing ends, the last end is the row max.
    """
    if not sm.numel():
        return bool((n_tok == 0).all())
    if sm.shape[1] > 1:  # one step per row (S = 1): nothing to order, and no empty amax
        if float(sm.diff(dim=1).amax()) > 0:                # a valid step after a masked one
            return False
        if float(ends.diff(dim=1).sub_(1).mul_(sm[:, 1:]).amin()) < 0:  # e_k <= e_{k-1}
            return False
    covered = ends.amax(1).add_(sm[:, 0])                   # last end + 1, or 0 without steps
    return bool(torch.equal(covered, n_tok))


def _pure_step_tables(step_reward: torch.Tensor, vr: torch.Tensor | None, seg_len: torch.Tensor,
                      ends: torch.Tensor, smask: torch.Tensor, sm: torch.Tensor,
                      y_len: torch.Tensor, t: int, *, whiten: bool, mask_separator: bool,
                      exclude_zeros: bool, var_includes_zeros: bool, group: Any | None,
                      dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """PURE returns / advantages per step (no KL term, steps tiling each row) as run-length
    tables for `_expand_runs`: `(adv_values, ret_values, lengths)`, each `[B, S + 1]`, and the
    step-closing token positions `[B, S]` whose advantage is 0 (`mask_separator`; else None).

    `step_reward[B, S]` float64 sits at each step's closing token, `vr[B]` at the last one. G on
    the tokens of step k is the reverse cumsum over steps, `G_k` (the same float64 additions as
    a token-by-token scan, whose extra terms are exact zeros). The whitening statistics are
    per-step counts times values. Each row is a run of segments: one per step (its tokens), then
    the padding (value 0). `ends`, `seg_len` and `sm` are float64.
    """
    b, n_steps = step_reward.shape
    k_i = smask.sum(1)
    rew = step_reward
    if vr is not None and n_steps:
        last = (k_i - 1).clamp_(min=0)[:, None]
        rew = rew.scatter_add(1, last, (vr * (k_i > 0))[:, None])
    g = rew.flip(1).cumsum(1).flip(1).mul_(sm)                                 # [B, S] G_k
    cnt = seg_len - sm if mask_separator else seg_len     # tokens valued G_k
    adv_val = g
    if whiten:
        nz = torch.ne(g, 0, out=torch.empty_like(g)) if exclude_zeros else None  # float 0/1
        cnt_nz = cnt * nz if exclude_zeros else cnt                            # tokens counted
        count_local = cnt_nz.sum()
        s = all_reduce(torch.stack([(cnt * g).sum(), count_local]), "sum", group)
        count = s[1].clamp(min=1)
        mean = s[0] / count
        # valid tokens not counted (separators, zero G_k) contribute (0 - mean)^2 when the
        # released var_sum includes them
        dev = g - mean
        var_local = (cnt_nz * (dev * dev)).sum()
        if exclude_zeros and var_includes_zeros:
            var_local = var_local + (y_len.sum() - count_local) * mean * mean
        var_sum = all_reduce(var_local.reshape(1), "sum", group)[0]
        rstd = torch.rsqrt((var_sum / count).clamp(min=1e-8))
        adv_val = dev.mul_(rstd)
        if exclude_zeros:
            adv_val.mul_(nz)
    adv_tab = g.new_zeros((b, n_steps + 1), dtype=dtype)
    ret_tab = torch.zeros_like(adv_tab)
    adv_tab[:, :-1] = adv_val
    ret_tab[:, :-1] = g
    lengths = torch.empty((b, n_steps + 1), dtype=torch.long, device=g.device)
    lengths[:, :-1] = seg_len
    lengths[:, -1] = t - y_len
    separators = None
    if mask_separator and n_steps:   # masked-out steps point at the row's last closing token
        separators = ends.addcmul(1 - sm, ends.amax(1, keepdim=True)).long()
    return adv_tab, ret_tab, lengths, separators


def _expand_runs(adv_tab: torch.Tensor, ret_tab: torch.Tensor, lengths: torch.Tensor,
                 zero_adv_at: torch.Tensor | None,
                 out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run-length decode two `[B, R]` value tables with shared `lengths[B, R]` (int64, each row
    summing to T) into the two `[B, T]` tensors `out`, then zero the advantages at the token
    positions `zero_adv_at[B, K]`: per block of rows one `repeat_interleave` builds the token ->
    run index (int64, which `index_select` reads faster than int32; half a block of bytes so
    that it stays in cache), one `index_select` per output reads the values."""
    adv, ret = out
    b, t = adv.shape
    for rows in _row_blocks(b, t, 2 * lengths.element_size(), adv.device):
        n_rows = rows.stop - rows.start
        idx = torch.repeat_interleave(lengths[rows].reshape(-1), output_size=n_rows * t)
        a = adv[rows]
        torch.index_select(adv_tab[rows].reshape(-1), 0, idx, out=a.view(-1))
        torch.index_select(ret_tab[rows].reshape(-1), 0, idx, out=ret[rows].view(-1))
        if zero_adv_at is not None:
            a.scatter_(1, zero_adv_at[rows], 0.0)
    return adv, ret


def _pure_dense(step_reward: torch.Tensor, vr: torch.Tensor | None, ends: torch.Tensor,
                smask: torch.Tensor, tmask: torch.Tensor, kl: torch.Tensor | None, kl_coef: float,
                *, whiten: bool, mask_separator: bool, exclude_zeros: bool,
                var_includes_zeros: bool, group: Any | None,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """PURE on `[B, T]` token rewards: any mask layout and the per-token KL term."""
    b, t = tmask.shape
    device = step_reward.device
    rewards = torch.zeros((b, t), dtype=torch.float64, device=device)
    rewards.scatter_add_(1, ends, step_reward * smask)
    if vr is not None:
        rewards += _put_last(vr, tmask)
    if kl is not None:
        rewards -= kl_coef * kl.to(torch.float64)
    rewards = rewards * tmask
    returns = discounted_returns(rewards, 1.0)
    adv = returns.clone()
    if mask_separator:
        sep = torch.zeros((b, t), dtype=torch.bool, device=device)
        rows, steps = torch.nonzero(smask, as_tuple=True)
        sep[rows, ends[rows, steps]] = True
        sep |= _put_last(torch.ones(b, device=device), tmask).bool()
        adv = torch.where(sep, torch.zeros_like(adv), adv)
    if whiten:
        adv = pure_whiten(adv, tmask, var_includes_zeros=var_includes_zeros,
                          exclude_zeros=exclude_zeros, group=group)
    return adv.to(dtype), returns.to(dtype)
