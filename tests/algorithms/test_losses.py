"""Policy / KL / entropy / implicit-PRM losses vs per-token loops."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megaprm.algorithms import losses as L

SEEDS = st.integers(0, 2**31 - 1)


def _data(seed, b=4, t=6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    old = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).double()
    return logp, old, adv, mask


def _ref_token_loss(lp, old, a, el, eh, c):
    r = math.exp(max(min(lp - old, 20.0), -20.0))
    l = max(-a * r, -a * min(max(r, 1 - el), 1 + eh))
    if c is not None and a < 0:
        l = min(l, -a * c)
    return l


def _ref_agg(loss, mask, mode, tokens=None, seqs=None, norm_len=None):
    b, t = len(loss), len(loss[0])
    if mode == "token-mean":
        n = sum(sum(r) for r in mask) if tokens is None else tokens
        return sum(loss[i][s] * mask[i][s] for i in range(b) for s in range(t)) / n
    per = []
    for i in range(b):
        tot = sum(loss[i][s] * mask[i][s] for s in range(t))
        if mode == "seq-mean-token-mean":
            tot = tot / sum(mask[i])
        elif mode == "seq-mean-token-sum-norm":  # Dr.GRPO: token sum / a constant length
            tot = tot / (t if norm_len is None else norm_len)
        per.append(tot)
    return sum(per) / (b if seqs is None else seqs)


@settings(max_examples=30, deadline=None)
@given(seed=SEEDS, eps=st.sampled_from([(0.2, 0.2), (0.2, 0.28)]), c=st.sampled_from([None, 3.0]),
       agg=st.sampled_from(list(L.AGG_MODES)), norm=st.booleans())
def test_ppo_clip_matches_loop(seed, eps, c, agg, norm):
    logp, old, adv, mask = _data(seed)
    tokens, seqs, norm_len = (37.0, 9.0, 64.0) if norm else (None, None, None)
    loss, m = L.ppo_clip_loss(logp, old, adv, mask, eps_low=eps[0], eps_high=eps[1], dual_clip_c=c,
                              agg=agg, global_tokens=tokens, global_seqs=seqs, norm_len=norm_len)
    per = [[_ref_token_loss(logp[i, s].item(), old[i, s].item(), adv[i, s].item(), *eps, c)
            for s in range(logp.shape[1])] for i in range(logp.shape[0])]
    want = _ref_agg(per, mask.tolist(), agg, tokens, seqs, norm_len)
    assert loss.item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert 0.0 <= m.clip_frac <= 1.0 and 0.0 <= m.dual_clip_frac <= 1.0
    assert set(m.as_dict()) >= {"actor/clip_frac", "actor/approx_kl"}


def test_clip_fraction_and_dual_clip_counts():
    logp = torch.log(torch.tensor([[2.0, 1.0, 10.0, 0.5]]))
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, m = L.ppo_clip_loss(logp, old, adv, torch.ones(1, 4), dual_clip_c=3.0)
    # token 0 clipped above (ratio 2 > 1.2, A>0); token 2 dual-clipped (ratio 10 > c=3, A<0);
    # token 3 clipped below (ratio 0.5 < 0.8, A<0): clip_frac counts tokens where pg2 > pg1.
    assert m.clip_frac == pytest.approx(2 / 4)
    assert m.dual_clip_frac == pytest.approx(1 / 4)
    assert loss.item() == pytest.approx((-1.2 - 1.0 + 3.0 + 0.8) / 4)


def test_token_mean_over_microbatches_equals_full_batch():
    logp, old, adv, mask = _data(5, b=6)
    full, _ = L.ppo_clip_loss(logp, old, adv, mask)
    n = mask.sum().item()
    parts = [L.ppo_clip_loss(logp[s], old[s], adv[s], mask[s], global_tokens=n)[0]
             for s in (slice(0, 2), slice(2, 6))]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-12)


def test_drgrpo_seq_mean_token_sum_norm():
    """Dr.GRPO: sum_t l_{i,t} / MAX_LEN averaged over sequences, on a hand-computed batch; the
    micro-batch split with global counts gives the full-batch value; length does not normalise
    (a response twice as long with the same per-token loss contributes twice as much)."""
    loss = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 4.0, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float64)
    got = L.aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_len=10)
    assert got.item() == pytest.approx(((1 + 2 + 3) / 10 + (4 + 4) / 10) / 2, rel=1e-12)
    # verl's default divisor is the padded width T
    assert L.aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == \
        pytest.approx(((1 + 2 + 3) / 4 + (4 + 4) / 4) / 2, rel=1e-12)
    parts = [L.aggregate_loss(loss[s], mask[s], "seq-mean-token-sum-norm", global_seqs=2,
                              norm_len=10) for s in (slice(0, 1), slice(1, 2))]
    assert (parts[0] + parts[1]).item() == pytest.approx(got.item(), rel=1e-12)
    flat = torch.ones(2, 4, dtype=torch.float64)
    short_long = L.aggregate_loss(flat, torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0]]).double(),
                                  "seq-mean-token-sum-norm", global_seqs=1, norm_len=4)
    assert short_long.item() == pytest.approx((1 + 2) / 4)
    with pytest.raises(ValueError, match="norm_len=0"):
        L.aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_len=0)
    lp, old, adv, m = _data(3)
    total, _ = L.actor_loss(lp, old, adv, m, agg="seq-mean-token-sum-norm", norm_len=32,
                            entropy=torch.ones_like(lp), entropy_coef=0.5)
    pg, _ = L.ppo_clip_loss(lp, old, adv, m, agg="seq-mean-token-sum-norm", norm_len=32)
    ent = (m.sum(1) / 32).mean()
    assert total.item() == pytest.approx((pg - 0.5 * ent).item(), rel=1e-12)


@settings(max_examples=30, deadline=None)
@given(seed=SEEDS, kind=st.sampled_from(list(L.KL_KINDS)))
def test_kl_estimators(seed, kind):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 30
    ref = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 30
    got = L.kl_penalty(lp, ref, kind)
    for i in range(3):
        for s in range(5):
            d = lp[i, s].item() - ref[i, s].item()
            if kind == "k1":
                want = d
            elif kind == "k2":
                want = 0.5 * d * d
            else:
                x = max(min(-d, 20.0), -20.0)
                want = max(min(math.exp(x) - x - 1, 10.0), -10.0)
            assert got[i, s].item() == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_actor_loss_adds_entropy_and_kl():
    logp, old, adv, mask = _data(2)
    ent = torch.rand_like(logp)
    ref = logp - 0.1
    pg, _ = L.ppo_clip_loss(logp, old, adv, mask)
    total, metrics = L.actor_loss(logp, old, adv, mask, entropy=ent, entropy_coef=0.01,
                                  logp_ref=ref, kl_coef=0.001)
    want = pg - 0.01 * L.aggregate_loss(ent, mask) + 0.001 * L.aggregate_loss(L.kl_penalty(logp, ref), mask)
    assert total.item() == pytest.approx(want.item(), rel=1e-12)
    assert "actor/entropy" in metrics and "actor/kl_loss" in metrics
    with pytest.raises(ValueError, match="entropy_coef"):
        L.actor_loss(logp, old, adv, mask, entropy_coef=0.01)


def test_implicit_prm_ce_loss_and_gradient():
    g = torch.Generator().manual_seed(0)
    prm = (-torch.rand(4, 5, generator=g, dtype=torch.float64)).requires_grad_()
    ref = -torch.rand(4, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]).double()
    o = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    loss = L.implicit_prm_ce_loss(prm, ref, mask, o, beta=0.05)
    want = 0.0
    for i in range(4):
        z = 0.05 * sum((prm[i, s].item() - ref[i, s].item()) * mask[i, s].item() for s in range(5))
        p = 1 / (1 + math.exp(-z))
        want -= (o[i].item() * math.log(p) + (1 - o[i].item()) * math.log(1 - p)) / 4
    assert loss.item() == pytest.approx(want, rel=1e-9)
    loss.backward()
    assert (prm.grad[mask == 0] == 0).all()


def test_loss_validation():
    logp, old, adv, mask = _data(1)
    with pytest.raises(ValueError, match="dual_clip_c=1.0"):
        L.ppo_clip_loss(logp, old, adv, mask, dual_clip_c=1.0)
    with pytest.raises(ValueError, match="loss_agg_mode='mean'"):
        L.ppo_clip_loss(logp, old, adv, mask, agg="mean")
    with pytest.raises(ValueError, match="advantages has shape"):
        L.ppo_clip_loss(logp, old, adv[:2], mask)
    with pytest.raises(ValueError, match="kind='k4'"):
        L.kl_penalty(logp, old, "k4")


def test_device_metrics_equal_host_metrics():
    """`host=False` keeps every metric a 0-d tensor (the trainer reads a mini-batch's at once);
    the values are the host path's, ratio_max over valid tokens only (NaN outside the mask)."""
    gen = torch.Generator().manual_seed(3)
    logp, old, adv = (torch.randn(3, 6, generator=gen) for _ in range(3))
    mask = (torch.rand(3, 6, generator=gen) > 0.3).float()
    old = torch.where(mask.bool(), old, torch.tensor(float("nan")))
    kw = {"entropy": torch.rand(3, 6, generator=gen), "entropy_coef": 0.01,
          "logp_ref": torch.randn(3, 6, generator=gen), "kl_coef": 0.1}
    _, host = L.actor_loss(logp, old.nan_to_num(), adv, mask, **kw)
    _, dev = L.actor_loss(logp, old.nan_to_num(), adv, mask, host=False, **kw)
    assert set(host) == set(dev)
    for k, v in dev.items():
        assert isinstance(v, torch.Tensor) and v.dim() == 0, k
        assert float(v) == pytest.approx(host[k], rel=1e-6, abs=1e-7), k
    _, m = L.ppo_clip_loss(logp, old, adv, mask, host=False)
    ratio = torch.exp((logp - old).clamp(-20, 20))
    assert float(m.ratio_max) == pytest.approx(float(ratio[mask.bool()].max()))


@pytest.mark.parametrize("seed", range(3))
def test_guard_ratio_mean_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    lp, old = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
    mask = (torch.rand(4, 7, generator=g) > 0.3).float()
    mask[2] = 0  # a row with no valid token (pp padding) is not a sequence
    ratios = [[math.exp(float(lp[i, t] - old[i, t])) for t in range(7) if mask[i, t]]
              for i in range(4)]
    flat = [r for row in ratios for r in row]
    per_seq = [sum(row) / len(row) for row in ratios if row]
    assert float(L.guard_ratio_mean(lp, old, mask, "token")) == pytest.approx(
        sum(flat) / len(flat))
    assert float(L.guard_ratio_mean(lp, old, mask, "sequence")) == pytest.approx(
        sum(per_seq) / len(per_seq))


def test_guard_scopes_disagree_where_pure_skips():
    """PURE's released scope (per-sequence means) skips a micro-batch whose short sequence blew
    up even when the token mean stays under 10."""
    old = torch.zeros(2, 10)
    lp = torch.zeros(2, 10)
    lp[1, 0] = math.log(30.0)
    mask = torch.zeros(2, 10)
    mask[0] = 1
    mask[1, 0] = 1
    assert float(L.guard_ratio_mean(lp, old, mask, "token")) == pytest.approx(40 / 11)
    assert float(L.guard_ratio_mean(lp, old, mask, "sequence")) == pytest.approx(15.5)
