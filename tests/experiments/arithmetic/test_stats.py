"""experiments/arithmetic/stats.py (the comparison's intervals) against independent references: Wilson against a
textbook value and its defining score equation; the two-level paired bootstrap against the exact
bootstrap distribution, enumerated by brute force on a tiny case; the noise split against a case
whose seed noise is zero by construction."""
import itertools
import math

import numpy as np
import pytest

from megaprm.experiments.arithmetic import stats


def test_wilson_matches_closed_form_table_value():
    # 8 of 10 at 95%: (0.4902, 0.9433) (Brown, Cai & DasGupta 2001's Wilson form, by hand)
    lo, hi = stats.wilson(8, 10)
    assert (lo, hi) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    # 0 of 20: the lower end is 0 and the upper end is z^2 / (n + z^2)
    lo, hi = stats.wilson(0, 20)
    z2 = stats.Z95 ** 2
    assert lo == pytest.approx(0.0, abs=1e-12) and hi == pytest.approx(z2 / (20 + z2))
    assert all(math.isnan(x) for x in stats.wilson(0, 0))


@pytest.mark.parametrize("k,n", [(3, 7), (50, 200), (199, 200), (412, 1000)])
def test_wilson_ends_solve_the_score_equation(k, n):
    """Wilson's interval is {p : |k/n - p| <= z sqrt(p(1-p)/n)}: both ends satisfy it with
    equality (away from the 0/1 clamps)."""
    for p in stats.wilson(k, n):
        assert abs(k / n - p) == pytest.approx(stats.Z95 * math.sqrt(p * (1 - p) / n), rel=1e-9)


def _exact_bootstrap(num, den, ref_num=None, ref_den=None):
    """Every equally likely two-level resample of a tiny [seeds, problems] case: seeds with
    replacement (ordered draws), then problems with replacement within each drawn seed; the
    statistic is the mean over drawn seeds of sum(num)/sum(den) (minus the reference's)."""
    seeds, probs = num.shape
    vals = []
    prob_draws = list(itertools.product(range(probs), repeat=probs))
    for sd in itertools.product(range(seeds), repeat=seeds):
        for pds in itertools.product(prob_draws, repeat=seeds):
            tot, ok = 0.0, True
            for s, pd in zip(sd, pds):
                n, d = sum(num[s, p] for p in pd), sum(den[s, p] for p in pd)
                if d == 0:
                    ok = False
                    break
                v = n / d
                if ref_num is not None:
                    rn, rd = sum(ref_num[s, p] for p in pd), sum(ref_den[s, p] for p in pd)
                    if rd == 0:
                        ok = False
                        break
                    v -= rn / rd
                tot += v
            if ok:
                vals.append(tot / seeds)
    return np.array(vals)


def test_hier_bootstrap_matches_exact_enumeration():
    # 2 seeds x 3 problems, accuracy-like (den = samples per problem = 2)
    num = np.array([[2, 1, 0], [1, 1, 2]], float)
    den = np.full_like(num, 2.0)
    exact = _exact_bootstrap(num, den)
    got = stats.hier_bootstrap(num, den, reps=40_000, seed=1)
    assert got["mean"] == pytest.approx((3 / 6 + 4 / 6) / 2)
    lo, hi = np.quantile(exact, [0.025, 0.975])
    # the Monte Carlo quantiles of 40k draws sit within a grid step of the exact ones
    assert got["lo"] == pytest.approx(lo, abs=0.05) and got["hi"] == pytest.approx(hi, abs=0.05)
    assert got["sd"] == pytest.approx(exact.std(), rel=0.03)


def test_paired_bootstrap_matches_exact_enumeration_with_a_ratio():
    # a wrong-step share: numerator wrong steps, denominator correct answers; problems paired
    num = np.array([[1, 0, 1], [0, 0, 1]], float)
    den = np.array([[1, 1, 2], [1, 2, 1]], float)
    rnum = np.array([[1, 1, 1], [1, 0, 1]], float)
    rden = np.array([[1, 2, 1], [1, 1, 2]], float)
    exact = _exact_bootstrap(num, den, rnum, rden)
    got = stats.hier_bootstrap(num, den, rnum, rden, reps=40_000, seed=2)
    point = ((2 / 4 - 3 / 4) + (1 / 4 - 2 / 4)) / 2
    assert got["mean"] == pytest.approx(point)
    assert got["sd"] == pytest.approx(exact.std(), rel=0.03)
    loop = _loop_draw_means(num, den, rnum, rden)
    assert np.mean(exact) == pytest.approx(np.mean(loop), abs=0.01)
    assert np.std(exact) == pytest.approx(np.std(loop), rel=0.03)
    lo, hi = np.quantile(exact, [0.025, 0.975])
    assert got["lo"] == pytest.approx(lo, abs=0.05) and got["hi"] == pytest.approx(hi, abs=0.05)


def _loop_draw_means(num, den, rnum, rden, reps=20_000):
    """A plain loop: draws the seeds and problems one at a time (the definition, no numpy
    indexing tricks)."""
    rng = np.random.default_rng(3)
    seeds, probs = num.shape
    out = []
    for _ in range(reps):
        tot = 0.0
        for _s in range(seeds):
            s = rng.integers(seeds)
            pd = rng.integers(probs, size=probs)
            tot += num[s, pd].sum() / den[s, pd].sum() - rnum[s, pd].sum() / rden[s, pd].sum()
        out.append(tot / seeds)
    return out


def test_intervals_stay_in_unit_interval_and_pairing_cancels_shared_noise():
    rng = np.random.default_rng(0)
    # 5 seeds of 400 problems; the method's correct answers are GRPO's plus 1 on 10% of them:
    # a tiny difference that a paired interval resolves and two separate intervals would not
    base = (rng.random((5, 400)) < rng.uniform(0.2, 0.8, size=(5, 1))).astype(float)
    better = np.maximum(base, (rng.random((5, 400)) < 0.1).astype(float))
    ones = np.ones_like(base)
    a = stats.hier_bootstrap(base, ones, reps=1000)
    assert 0.0 <= a["lo"] <= a["mean"] <= a["hi"] <= 1.0
    d = stats.hier_bootstrap(better, ones, base, ones, reps=1000)
    assert d["lo"] > 0  # separated when paired ...
    assert d["hi"] - d["lo"] < 0.3 * (a["hi"] - a["lo"])  # ... far narrower than unpaired
    z = stats.hier_bootstrap(np.zeros((2, 5)), ones[:2, :5], reps=200)
    assert z["lo"] == z["hi"] == z["mean"] == 0.0


def test_noise_split():
    rng = np.random.default_rng(4)
    # identical seeds: between-seed spread 0, so the seed SD is 0 and the evaluation SD is the
    # binomial SD of one seed's accuracy, sqrt(p(1-p)/n)
    row = (rng.random(1000) < 0.3).astype(float)
    num, den = np.stack([row] * 4), np.ones((4, 1000))
    nz = stats.noise(num, den, reps=4000)
    p = row.mean()
    assert nz["between_sd"] == 0 and nz["seed_sd"] == 0
    assert nz["eval_sd"] == pytest.approx(math.sqrt(p * (1 - p) / 1000), rel=0.06)
    # seeds far apart: the seed SD is about the spread of their means
    num = np.stack([(rng.random(1000) < q).astype(float) for q in (0.1, 0.4, 0.7)])
    nz = stats.noise(num, np.ones((3, 1000)), reps=1000)
    assert nz["seed_sd"] == pytest.approx(np.std(num.mean(1), ddof=1), rel=0.05)
    assert nz["eval_sd"] < 0.1 * nz["seed_sd"]


def test_paired_shapes_must_match():
    with pytest.raises(ValueError, match="same seeds and problems"):
        stats.hier_bootstrap(np.ones((2, 3)), np.ones((2, 3)), np.ones((3, 3)), np.ones((3, 3)))
