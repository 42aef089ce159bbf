"""The off-policy corrections (trainer/correction.py) against their definitions, token by token.

References written out here as plain loops: verl's token-level truncated IS (rollout_corr_math.md:
w = min(pi_old / pi_behav, C)) and AReaL's decoupled PPO objective (its ppo_actor_loss_fn with
behav_imp_weight_cap: per valid token, max(-A r, -A clip(r)) * w with r = pi / pi_prox and
w = pi_prox / pi_behav, tokens with w > C dropped, the sum divided by every valid token).
"""
import math

import pytest
import torch

from megaprm.algorithms.losses import actor_loss
from megaprm.trainer.rl.correction import tis_weights


def _batch(seed=0, b=4, r=7):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(b, r, generator=g) * 3
    prox = behav + torch.randn(b, r, generator=g) * 0.8  # stale: pi_prox differs from pi_behav
    cur = prox + torch.randn(b, r, generator=g) * 0.3
    adv = torch.randn(b, r, generator=g)
    mask = (torch.rand(b, r, generator=g) > 0.2).float()
    return behav, prox, cur, adv, mask


@pytest.mark.parametrize("mode", ["tis", "decoupled"])
def test_weights_are_the_definitions_token_by_token(mode):
    behav, prox, _, _, mask = _batch()
    cap = 1.5
    w, m = tis_weights(prox, behav, mask, cap, mode)
    above = 0
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            ratio = math.exp(prox[i, t] - behav[i, t])
            if not mask[i, t]:
                want = 0.0
            elif ratio > cap:
                above += 1
                want = cap if mode == "tis" else 0.0
            else:
                want = ratio
            assert float(w[i, t]) == pytest.approx(want, rel=1e-6)
    assert above > 0  # the batch exercises the cap
    assert m["rollout/is_truncated_frac"] == pytest.approx(above / float(mask.sum()))
    assert m["rollout/is_weight_mean"] == pytest.approx(float(w.sum() / mask.sum()))


def test_decoupled_loss_equals_areals_objective():
    """Weights on the advantages (what the loop does) give AReaL's loss and gradient."""
    behav, prox, cur, adv, mask = _batch(seed=3)
    cap, eps_low, eps_high = 1.5, 0.2, 0.28
    w, _ = tis_weights(prox, behav, mask, cap, "decoupled")
    logp = cur.clone().requires_grad_(True)
    ours, _ = actor_loss(logp, prox, adv * w, mask, eps_low=eps_low, eps_high=eps_high,
                         dual_clip_c=None, agg="token-mean")
    ours.backward()

    ref_logp = cur.clone().requires_grad_(True)
    total, count = 0.0, 0
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            count += 1
            wt = torch.exp(prox[i, t] - behav[i, t])
            if wt > cap:
                continue  # AReaL: dropped from the sum, still in the denominator
            r = torch.exp(ref_logp[i, t] - prox[i, t])
            a = adv[i, t]
            total = total + torch.maximum(-a * r, -a * r.clamp(1 - eps_low, 1 + eps_high)) * wt
    ref = total / count
    ref.backward()
    assert float(ours.detach()) == pytest.approx(float(ref.detach()), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(logp.grad, ref_logp.grad, rtol=1e-5, atol=1e-7)
