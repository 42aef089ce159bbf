"""Slow, obvious Python-loop references for the estimators and filters (research § in each).

Written from the formulas in docs/algorithms.md, one sample and one token at a time,
with plain floats; the vectorised / distributed code in megaprm.algorithms is tested against
these. Also the random-batch generator the tests share.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# --------------------------------------------------------------------------- random batches

@dataclass
class Batch:
    outcome: torch.Tensor        # [B] {0,1}
    process: torch.Tensor        # [B]
    group_ids: torch.Tensor      # [B] int64, shuffled, non-contiguous
    num_steps: torch.Tensor      # [B]
    response_mask: torch.Tensor  # [B, T] float, right-padded, >= 1 token
    logp_a: torch.Tensor         # [B, T]
    logp_b: torch.Tensor         # [B, T]
    step_scores: torch.Tensor    # [B, S]
    step_mask: torch.Tensor      # [B, S] bool prefix
    step_end_index: torch.Tensor  # [B, S] long
    step_end_mask: torch.Tensor  # [B, T] bool


def random_batch(seed: int, n_groups: int = 5, max_size: int = 6, t: int = 10,
                 discrete: bool | None = None) -> Batch:
    """Groups of 1..max_size samples with all-correct, all-wrong, tied and mixed groups, shuffled."""
    gen = torch.Generator().manual_seed(seed)

    def ri(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    if discrete is None:
        discrete = bool(ri(0, 1))
    outcomes, ids = [], []
    for g in range(n_groups):
        n = ri(1, max_size)
        kind = ri(0, 3)  # 0 all wrong, 1 all correct, 2/3 mixed
        o = [0.0] * n if kind == 0 else [1.0] * n if kind == 1 else \
            [float(v) for v in torch.randint(0, 2, (n,), generator=gen).tolist()]
        outcomes += o
        ids += [g * 7919 + 3] * n
    b = len(outcomes)
    perm = torch.randperm(b, generator=gen)
    outcome = torch.tensor(outcomes)[perm]
    group_ids = torch.tensor(ids, dtype=torch.long)[perm]
    if discrete:  # PAPO-like grades {0, .5, 1}: many ties and flat groups
        process = torch.randint(0, 3, (b,), generator=gen).float() / 2
    else:
        process = torch.rand(b, generator=gen)
    num_steps = torch.randint(0, 34, (b,), generator=gen)

    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    response_mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    logp_a = -torch.rand(b, t, generator=gen) * 3
    logp_b = -torch.rand(b, t, generator=gen) * 3
    s = t
    step_scores = torch.rand(b, s, generator=gen) * 2 - 1
    if discrete:
        step_scores = torch.round(step_scores * 2) / 2
    step_mask = torch.zeros(b, s, dtype=torch.bool)
    step_end_index = torch.zeros(b, s, dtype=torch.long)
    step_end_mask = torch.zeros(b, t, dtype=torch.bool)
    for i in range(b):
        n_tok = int(lengths[i])
        inner = [p for p in range(n_tok - 1) if torch.rand(1, generator=gen).item() < 0.3]
        ends = inner + [n_tok - 1]  # the last step closes at the last valid token
        for k, e in enumerate(ends):
            step_mask[i, k] = True
            step_end_index[i, k] = e
            step_end_mask[i, e] = True
    return Batch(outcome, process, group_ids, num_steps, response_mask, logp_a, logp_b,
                 step_scores, step_mask, step_end_index, step_end_mask)


class Members:
    """`members(i)`: indices of sample i's group, in original batch order."""

    def __init__(self, group_ids: torch.Tensor):
        self.ids = group_ids.tolist()
        self.groups: dict[int, list[int]] = {}
        for j, g in enumerate(self.ids):
            self.groups.setdefault(g, []).append(j)

    def __call__(self, i: int) -> list[int]:
        return self.groups[self.ids[i]]


def _mean(v: list[float]) -> float:
    return sum(v) / len(v)


def _std(v: list[float]) -> float:
    m = _mean(v)
    return math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))


# --------------------------------------------------------------------------- sequence level

def ref_grpo(o, gids, eps=1e-6, scale_by_std=True, keep=None):
    """§3.5; size-1 groups (after `keep`) -> 0, dropped samples -> 0."""
    o = [float(x) for x in o]
    keep = [True] * len(o) if keep is None else [bool(k) for k in keep]
    mem = Members(gids)
    out = []
    for i in range(len(o)):
        grp = [o[j] for j in mem(i) if keep[j]]
        if not keep[i] or len(grp) < 2:
            out.append(0.0)
            continue
        c = o[i] - _mean(grp)
        out.append(c / (_std(grp) + eps) if scale_by_std else c)
    return out


def ref_rloo(o, gids):
    o = [float(x) for x in o]
    mem = Members(gids)
    out = []
    for i in range(len(o)):
        others = [o[j] for j in mem(i) if j != i]
        out.append(o[i] - _mean(others) if others else 0.0)
    return out


def _guarded_z(x: float, grp: list[float], eps: float) -> float:
    if len(grp) < 2 or _std(grp) <= eps:
        return 0.0
    return (x - _mean(grp)) / (_std(grp) + eps)


def ref_papo(o, p, gids, lam=1.0, eps=1e-6, mode="decoupled"):
    """§4.2 (decoupled), §4.3 (fullnorm, multiplicative)."""
    o, p = [float(x) for x in o], [float(x) for x in p]
    if mode == "multiplicative":
        return ref_grpo([a * b for a, b in zip(o, p)], gids, eps)
    mem = Members(gids)
    out = []
    for i in range(len(o)):
        m = mem(i)
        a_out = _guarded_z(o[i], [o[j] for j in m], eps)
        if mode == "decoupled":
            correct = [p[j] for j in m if o[j] == 1.0]
            a_proc = _guarded_z(p[i], correct, eps) if o[i] == 1.0 else 0.0
        else:
            pp = [p[j] if o[j] == 1.0 else 0.0 for j in m]
            a_proc = _guarded_z(p[i] if o[i] == 1.0 else 0.0, pp, eps)
        out.append(a_out + lam * a_proc)
    return out


def ref_blend(o, p, gids, beta=0.8):
    return ref_grpo([float(a) + beta * float(b) for a, b in zip(o, p)], gids)


# --------------------------------------------------------------------------- filters

def ref_accuracy(o, gids, low=0.2, high=0.8):
    o, mem = o.tolist(), Members(gids)
    return [low <= _mean([float(o[j]) for j in mem(i)]) <= high for i in range(len(o))]


def ref_critic(o, p, num_steps=None, len_penalty=10.0, min_steps=2, max_steps=30):
    """§3.2: c_i = 2 (p_i - mu_B)(2 o_i - 1), mu_B over all valid steps of the batch."""
    b = len(o)
    h = [1.0] * b if num_steps is None else [float(x) for x in num_steps]
    mu = sum(h[i] * float(p[i]) for i in range(b)) / max(sum(h), 1.0)
    out = []
    for i in range(b):
        c = 2 * (float(p[i]) - mu) * (2 * float(o[i]) - 1)
        if num_steps is not None:
            if h[i] == 0:
                c = 0.0
            if h[i] < min_steps or h[i] > max_steps:
                c -= len_penalty
        out.append(c)
    return out


def ref_prof(o, p, gids, remove, mode="both", num_steps=None):
    """§3.3 filter_trajectories with Python's stable sort and round(); returns keep list."""
    c = ref_critic(o, p, num_steps)
    o, mem = o.tolist(), Members(gids)
    removed = set()
    seen = set()
    for i in range(len(o)):
        g = mem.ids[i]
        if g in seen:
            continue
        seen.add(g)
        m = mem(i)  # original order
        if mode == "no_separation":
            removed.update(sorted(m, key=lambda j: c[j])[:remove])
            continue
        pos = [j for j in m if float(o[j]) == 1.0]
        neg = [j for j in m if float(o[j]) != 1.0]
        k_plus = min(remove, round((len(pos) - len(neg) + remove) / 2))
        if k_plus > 0:
            rm_pos = sorted(pos, key=lambda j: c[j])[:min(k_plus, len(pos))]
            rm_neg = sorted(neg, key=lambda j: c[j])[:min(remove - len(rm_pos), len(neg))]
        else:
            rm_pos, rm_neg = [], sorted(neg, key=lambda j: c[j])[:min(remove, len(neg))]
        removed.update(rm_pos + rm_neg)
    return [i not in removed for i in range(len(o))]


# --------------------------------------------------------------------------- PRIME (§1.2-1.4)

def _last(mask_row) -> int:
    return max(t for t in range(len(mask_row)) if mask_row[t] > 0)


def _discounted(r: list[float], gamma: float) -> list[float]:
    out, run = [0.0] * len(r), 0.0
    for t in range(len(r) - 1, -1, -1):
        run = r[t] + gamma * run
        out[t] = run
    return out


def ref_whiten(values, mask, eps=1e-8):
    vals = [values[i][t] for i in range(len(values)) for t in range(len(values[i])) if mask[i][t] > 0]
    mean = _mean(vals)
    var = sum((v - mean) ** 2 for v in vals) / max(len(vals) - 1, 1)
    return [[(values[i][t] - mean) / math.sqrt(var + eps) if mask[i][t] > 0 else 0.0
             for t in range(len(values[i]))] for i in range(len(values))]


def ref_prime(o, lp_prm, lp_ref, mask, gids, granularity="token", step_end_mask=None,
              norm="batch_norm", rloo_form="code", gamma_o=1.0, gamma_p=1.0, co=1.0, cp=1.0):
    b, t = mask.shape
    m, mem, o = mask.tolist(), Members(gids), o.tolist()
    lp_prm, lp_ref = lp_prm.tolist(), lp_ref.tolist()
    sem = None if step_end_mask is None else step_end_mask.tolist()
    q = [[(lp_prm[i][s] - lp_ref[i][s]) * m[i][s] for s in range(t)] for i in range(b)]
    r = [[0.0] * t for _ in range(b)]
    for i in range(b):
        if granularity == "token":
            r[i] = list(q[i])
            continue
        last = _last(m[i])
        acc = 0.0
        for s in range(t):
            acc += q[i][s]
            is_end = s == last or (granularity == "step" and sem[i][s] and m[i][s] > 0)
            if is_end:
                r[i][s], acc = acc, 0.0
    if norm == "batch_norm":
        peak = max(abs(v) for i in range(b) for v in _discounted(r[i], 1.0))
        r = [[v / (peak + 1e-6) for v in row] for row in r]
    mu = [sum(r[i][s] * m[i][s] for s in range(t)) / sum(m[i]) for i in range(b)]
    returns = []
    for i in range(b):
        grp = mem(i)
        k = len(grp)
        out_r, proc = [0.0] * t, [0.0] * t
        if k >= 2:
            others_o = [float(o[j]) for j in grp if j != i]
            out_r[_last(m[i])] = float(o[i]) - _mean(others_o)
            sum_mu = sum(mu[j] for j in grp)
            for s in range(t):
                if m[i][s] > 0:
                    if rloo_form == "code":
                        proc[s] = r[i][s] * k / (k - 1) - sum_mu / (k - 1)
                    else:
                        proc[s] = r[i][s] - (sum_mu - mu[i]) / (k - 1)
        go, gp = _discounted(out_r, gamma_o), _discounted(proc, gamma_p)
        returns.append([(co * go[s] + cp * gp[s]) * m[i][s] for s in range(t)])
    return ref_whiten(returns, m), returns


# --------------------------------------------------------------------------- PURE (§2.3-2.5)

def ref_pure(o, scores, smask, ends, mask, gids, credit="min", temperature=0.1, baseline="token",
             reward_mode="PRMVR", vr_coef=1.0, kl=None, kl_coef=0.0, mask_separator=True,
             whiten=True, var_includes_zeros=True):
    b, t = mask.shape
    m, mem, o = mask.tolist(), Members(gids), o.tolist()
    scores, ends = scores.tolist(), ends.tolist()
    kl = None if kl is None else kl.tolist()
    steps = [[k for k, v in enumerate(row) if v] for row in smask.tolist()]
    w, big_o, ylen, lk = [], [], [], []
    for i in range(b):
        pr = [scores[i][k] for k in steps[i]]
        if credit == "min":
            z = [math.exp(-(v - min(pr)) / temperature) for v in pr]
            wi = [x / sum(z) for x in z]
        elif credit == "uniform":
            wi = [1.0 / len(pr)] * len(pr)
        else:
            wi = [1.0] * len(pr)
        w.append(wi)
        big_o.append(sum(a * c for a, c in zip(wi, pr)))
        ylen.append(sum(m[i]))
        prev, li = -1, []
        for k in steps[i]:
            e = ends[i][k]
            li.append(sum(m[i][prev + 1:e + 1]) - 1)
            prev = e
        lk.append(li)
    rewards = [[0.0] * t for _ in range(b)]
    for i in range(b):
        others = [j for j in mem(i) if j != i]
        if reward_mode in ("PRM", "PRMVR"):
            if baseline == "token" and others:
                bi = sum(big_o[j] for j in others) / sum(ylen[j] for j in others)
            elif baseline == "step" and others:
                bi = _mean([big_o[j] / len(steps[j]) for j in others])
            else:
                bi = 0.0
            for n, k in enumerate(steps[i]):
                sub = bi * lk[i][n] if baseline == "token" else bi if baseline == "step" else 0.0
                rewards[i][ends[i][k]] += w[i][n] * scores[i][k] - sub
        if reward_mode in ("VR", "PRMVR") and others:
            vr = float(o[i]) - _mean([float(o[j]) for j in others])
            rewards[i][_last(m[i])] += vr_coef * vr
        for s in range(t):
            if kl is not None:
                rewards[i][s] -= kl_coef * kl[i][s]
            rewards[i][s] *= m[i][s]
    returns = [_discounted(row, 1.0) for row in rewards]
    adv = [list(row) for row in returns]
    if mask_separator:
        for i in range(b):
            for k in steps[i]:
                adv[i][ends[i][k]] = 0.0
            adv[i][_last(m[i])] = 0.0
    if whiten:
        valid = [(i, s) for i in range(b) for s in range(t) if m[i][s] > 0]
        nz = [(i, s) for (i, s) in valid if adv[i][s] != 0.0]
        count = len(nz)
        mean = sum(adv[i][s] for i, s in valid) / max(count, 1)
        pool = valid if var_includes_zeros else nz
        var_sum = sum((adv[i][s] - mean) ** 2 for i, s in pool)
        rstd = 1.0 / math.sqrt(max(var_sum / max(count, 1), 1e-8))
        nzs = set(nz)
        adv = [[(adv[i][s] - mean) * rstd if (i, s) in nzs else 0.0 for s in range(t)]
               for i in range(b)]
    return adv, returns
