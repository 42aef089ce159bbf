"""experiments/arithmetic/stats.py (the comparison's intervals) against independent references: Wilson against a
textbook value and its defining score equation; the two-level paired bootstrap against the exact
bootstrap distribution, enumerated by brute force on a tiny case; the noise split against a case
whose seed noise is zero by construction; the comparison's rows (`stats.aggregate`) on made-up
cells, by hand and by loops."""
import itertools
import math
import os
import statistics

import numpy as np
import pytest

from megaprm.experiments.arithmetic import report, runs, stats


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


# ------------------------------------------------------------ three levels: starts, seeds, problems

def _seeds_layout_exact(nums, dens, rnums, rdens):
    """Every resample of a tiny ragged [start][seed, problem] case with its probability: starts
    drawn with replacement, then inside each drawn start as many seeds as it has, then the
    problems inside each drawn run; the statistic is the mean over start slots of the mean
    over seed slots of sum(num)/sum(den) - the reference's. Returns (values, probabilities)."""
    starts, probs = len(nums), nums[0].shape[1]

    def run_dist(t, s):  # the drawn run's value over all problem draws (equally likely)
        out = []
        for pd in itertools.product(range(probs), repeat=probs):
            pd = list(pd)
            out.append(nums[t][s, pd].sum() / dens[t][s, pd].sum()
                       - rnums[t][s, pd].sum() / rdens[t][s, pd].sum())
        return out

    def start_dist(t):  # {value of the mean over seed slots: probability}
        n = nums[t].shape[0]
        dist = {}
        for sd in itertools.product(range(n), repeat=n):
            for vals in itertools.product(*[run_dist(t, s) for s in sd]):
                v = sum(vals) / n
                dist[v] = dist.get(v, 0.0) + 1.0 / (n ** n * (probs ** probs) ** n)
        return dist

    per_start = [start_dist(t) for t in range(starts)]
    values, probs_out = [], []
    for td in itertools.product(range(starts), repeat=starts):
        for combo in itertools.product(*[per_start[t].items() for t in td]):
            values.append(sum(v for v, _ in combo) / starts)
            probs_out.append(math.prod(p for _, p in combo) / starts ** starts)
    return np.array(values), np.array(probs_out)


def _tiny_ragged():
    # start 0 has 2 seeds, start 1 one seed (a run cut short); 2 problems, wrong-step-like ratio
    nums = [np.array([[1, 0], [2, 1]], float), np.array([[0, 1]], float)]
    dens = [np.array([[2, 1], [2, 2]], float), np.array([[1, 2]], float)]
    rnums = [np.array([[1, 1], [1, 1]], float), np.array([[1, 1]], float)]
    rdens = [np.array([[2, 2], [1, 2]], float), np.array([[2, 1]], float)]
    return nums, dens, rnums, rdens


def test_hier_bootstrap3_matches_exact_enumeration_on_ragged_starts():
    nums, dens, rnums, rdens = _tiny_ragged()
    vals, prob = _seeds_layout_exact(nums, dens, rnums, rdens)
    assert prob.sum() == pytest.approx(1.0)
    mean = (vals * prob).sum()
    sd = math.sqrt(((vals - mean) ** 2 * prob).sum())
    got = stats.hier_bootstrap3(nums, dens, rnums, rdens, reps=40_000, seed=5)
    # the point: the mean over starts of each start's mean over its seeds
    m = lambda n, d: n.sum(1) / d.sum(1)  # noqa: E731
    point = (np.mean([m(a, b).mean() for a, b in zip(nums, dens)])
             - np.mean([m(a, b).mean() for a, b in zip(rnums, rdens)]))
    assert got["mean"] == pytest.approx(point) and got["seeds"] == [2, 1]
    assert got["sd"] == pytest.approx(sd, rel=0.03)
    order = np.argsort(vals)
    cdf = np.cumsum(prob[order])
    lo, hi = vals[order][np.searchsorted(cdf, 0.025)], vals[order][np.searchsorted(cdf, 0.975)]
    assert got["lo"] == pytest.approx(lo, abs=0.03) and got["hi"] == pytest.approx(hi, abs=0.03)


def _loop_replicates(nums, dens, rnums, rdens, reps, seed):
    """Plain loops over the draws `hier_bootstrap3` documents, from the same generator in the
    same order: starts [reps, starts] (skipped for one start), seeds [reps, starts, max seeds]
    below each drawn start's seed count, problems [reps, starts, max seeds, problems]."""
    starts, probs = len(nums), nums[0].shape[1]
    n = [a.shape[0] for a in nums]
    width = max(n)
    rng = np.random.default_rng(seed)
    st = rng.integers(0, starts, size=(reps, starts)) if starts > 1 else np.zeros((reps, 1), int)
    si = rng.integers(0, np.array(n)[st][..., None], size=(reps, starts, width))
    pi = rng.integers(0, probs, size=(reps, starts, width, probs))
    out = []
    for r in range(reps):
        tot = 0.0
        for slot in range(starts):
            t = st[r, slot]
            sub = 0.0
            for j in range(n[t]):
                s = si[r, slot, j]
                a = b = c = d = 0.0
                for p in pi[r, slot, j]:
                    a, b = a + nums[t][s, p], b + dens[t][s, p]
                    c, d = c + rnums[t][s, p], d + rdens[t][s, p]
                sub += a / b - c / d
            tot += sub / n[t]
        out.append(tot / starts)
    return np.array(out)


def test_hier_bootstrap3_equals_a_loop_over_the_same_draws():
    rng = np.random.default_rng(6)
    shape = [3, 1, 2]  # seeds finished per start
    nums = [rng.integers(0, 3, size=(s, 4)).astype(float) for s in shape]
    dens = [n + rng.integers(1, 3, size=n.shape) for n in nums]
    rnums = [rng.integers(0, 3, size=(s, 4)).astype(float) for s in shape]
    rdens = [n + rng.integers(1, 3, size=n.shape) for n in rnums]
    loop = _loop_replicates(nums, dens, rnums, rdens, reps=300, seed=8)
    got = stats.hier_bootstrap3(nums, dens, rnums, rdens, reps=300, seed=8)
    assert got["sd"] == pytest.approx(loop.std(ddof=1), rel=1e-12)
    assert [got["lo"], got["hi"]] == pytest.approx(np.quantile(loop, [0.025, 0.975]), rel=1e-12)


def test_hier_bootstrap3_with_one_start_is_hier_bootstrap():
    """Decided: identical numbers for the same seed (one start draws nothing at the start
    level, and the seed and problem draws come in hier_bootstrap's order)."""
    rng = np.random.default_rng(7)
    num = (rng.random((4, 300)) < 0.3).astype(float)
    ref = np.maximum(num, (rng.random((4, 300)) < 0.1).astype(float))
    den = np.ones_like(num)
    for args in ((num, den), (num, den, ref, den)):
        two = stats.hier_bootstrap(*args, reps=700, seed=3)        # 700: not a chunk multiple
        three = stats.hier_bootstrap3(*[a[None] for a in args], reps=700, seed=3)
        assert {k: three[k] for k in two} == two


def test_hier_bootstrap3_start_level_widens_the_interval_and_layouts_are_checked():
    rng = np.random.default_rng(9)
    # three starts whose accuracy differs (0.2, 0.3, 0.4), five seeds each, 200 problems
    num = np.stack([(rng.random((5, 200)) < p).astype(float) for p in (0.2, 0.3, 0.4)])
    den = np.ones_like(num)
    three = stats.hier_bootstrap3(num, den, reps=500)
    pooled = stats.hier_bootstrap(num.reshape(15, 200), den.reshape(15, 200), reps=500)
    assert three["mean"] == pytest.approx(pooled["mean"])
    # the start spread (SD 0.1 over 3 starts: the mean's SD ~ 0.1 * sqrt(2/3) / sqrt(3)) shows
    assert three["sd"] == pytest.approx(0.1 * math.sqrt(2 / 3) / math.sqrt(3), rel=0.25)
    assert three["sd"] > 2 * pooled["sd"]
    # Student's t over the three starts' means (a loop), the few-starts interval
    m = [num[t].mean() for t in range(3)]
    half = 4.303 * math.sqrt(sum((x - sum(m) / 3) ** 2 for x in m) / 2) / math.sqrt(3)
    assert [three["t_lo"], three["t_hi"]] == pytest.approx([sum(m) / 3 - half, sum(m) / 3 + half])
    ref = num[::-1]  # a paired reference: the t interval is over per-start differences
    diff = stats.hier_bootstrap3(num, den, ref, den, reps=10)
    d = [num[t].mean() - ref[t].mean() for t in range(3)]
    half = 4.303 * np.std(d, ddof=1) / math.sqrt(3)
    assert [diff["t_lo"], diff["t_hi"]] == pytest.approx([np.mean(d) - half, np.mean(d) + half])
    with pytest.raises(ValueError, match="same starts, seeds and problems"):
        stats.hier_bootstrap3(num, den, num[:, :4], den[:, :4])
    with pytest.raises(ValueError, match="same held-out problems"):
        stats.hier_bootstrap3([num[0], num[1, :, :5]], [den[0], den[1, :, :5]])


def _simulated_rows(rng, seeds=(5, 5, 4, 3, 5, 2), problems=1000, start_sd=0.03, seed_sd=0.02,
                    base=(0.1, 0.9), knows=0.0):
    """One comparison row: problem p of the held-out set (shared by every run) is solved with
    probability base_p + A_start + B_seed (+ G_start,p), one sample each; base_p ~ U(base), so
    the problems' difficulty is shared noise and each run's own evaluation noise is binomial.
    G = +-`knows` at random per (start, problem): each start knows its own problems, which
    moves its runs together on this problem set but not on the population (E G = 0)."""
    base = rng.uniform(*base, problems)
    nums = []
    for n in seeds:
        g = knows * rng.choice([-1.0, 1.0], problems)
        q = np.clip(base + g + rng.normal(0, start_sd) + rng.normal(0, seed_sd, (n, 1)), 0, 1)
        nums.append((rng.random(q.shape) < q).astype(float))
    return nums, [np.ones_like(x) for x in nums], base


def test_noise3_recovers_known_components_over_simulated_datasets():
    rng = np.random.default_rng(10)
    res, own = [], []
    for _ in range(400):
        nums, dens, base = _simulated_rows(rng)
        res.append(stats.noise3(nums, dens))
        own.append((base * (1 - base)).mean() / base.size)  # a run's binomial variance
    get = lambda k: np.array([r[k] for r in res])  # noqa: E731
    for key, truth in (("seed_var", 0.02 ** 2), ("start_var", 0.03 ** 2)):
        x = get(key)
        se = x.std() / math.sqrt(x.size)
        assert abs(x.mean() - truth) < 4 * se and abs(x.mean() - truth) < 0.1 * truth, key
    assert np.mean(get("eval_run_sd") ** 2) == pytest.approx(np.mean(own), rel=0.03)
    # one run's total evaluation variance adds the problems' spread: Var(base)/N + own
    assert np.mean(get("eval_sd") ** 2) == pytest.approx(np.mean(own) + 0.8 ** 2 / 12 / 1000,
                                                          rel=0.05)
    # subtracting the whole evaluation variance (as `noise` does) understates the seed spread
    naive = get("within_sd") ** 2 - get("eval_sd") ** 2
    assert naive.mean() < 0.02 ** 2 - 5 * naive.std() / math.sqrt(naive.size)


def test_noise3_separates_a_start_that_knows_its_own_problems_from_the_start_effect():
    """Starts that solve different problems (G = +-0.3 per problem; its share on 400 problems,
    Var = 0.09 / 400, equals the start variance 0.015^2) look like start spread on one problem
    set; noise3 takes it out (c_w - c_b) and recovers the start variance."""
    rng = np.random.default_rng(14)
    res = [stats.noise3(*_simulated_rows(rng, problems=400, start_sd=0.015, base=(0.35, 0.65),
                                         knows=0.3)[:2]) for _ in range(300)]
    x = np.array([r["start_var"] for r in res])
    se = x.std() / math.sqrt(x.size)
    assert abs(x.mean() - 0.015 ** 2) < 4 * se and 4 * se < 0.5 * 0.015 ** 2
    y = np.array([r["seed_var"] for r in res])
    assert abs(y.mean() - 0.02 ** 2) < 4 * y.std() / math.sqrt(y.size)


def test_noise3_evaluation_parts_and_degenerate_layouts():
    rng = np.random.default_rng(11)
    # a wrong-step share (num <= den, den = correct answers of 4 samples): eval_sd is the
    # problem bootstrap's SD of one run's value (delta method vs resampling)
    den = rng.binomial(4, rng.uniform(0, 1, (1, 2000))).astype(float)
    num = rng.binomial(den.astype(int), 0.3).astype(float)
    boot = stats.eval_only_bootstrap(num, den, reps=3000, seed=1)
    assert stats.noise3(num[None], den[None])["eval_sd"] == pytest.approx(boot, rel=0.05)
    # identical seeds: no seed spread and no evaluation noise of their own; one start: no
    # start component
    row = (rng.random(500) < 0.4).astype(float)
    nz = stats.noise3(np.stack([row] * 3)[None], np.ones((1, 3, 500)))
    assert nz["seed_var"] == pytest.approx(0.0, abs=1e-15) and nz["seed_sd"] == 0
    assert nz["eval_run_sd"] == pytest.approx(0.0, abs=1e-7)
    assert nz["eval_sd"] == pytest.approx(math.sqrt(row.mean() * (1 - row.mean()) / 500))
    assert math.isnan(nz["start_sd"]) and math.isnan(nz["start_var"])


def test_noise3_paired_splits_the_difference_from_the_reference():
    """GRPO and a method share each start's and seed's effects; the method adds its own
    (start SD 0.02, seed SD 0.015): the paired split recovers those, not the shared ones, and
    its evaluation SD is the paired problem bootstrap's of one run's difference."""
    rng = np.random.default_rng(15)
    res = []
    for _ in range(200):
        base = rng.uniform(0.2, 0.8, 400)
        rows = [[], [], [], []]
        for n in (4, 4, 3):
            q = base + rng.normal(0, 0.03) + rng.normal(0, 0.02, (n, 1))     # shared
            d = rng.normal(0, 0.02) + rng.normal(0, 0.015, (n, 1))           # the method's
            for i, qq in ((0, np.clip(q + d, 0, 1)), (2, np.clip(q, 0, 1))):
                rows[i].append(rng.binomial(2, qq).astype(float))
                rows[i + 1].append(np.full(qq.shape, 2.0))
        res.append(stats.noise3(*rows))
    for key, truth in (("seed_var", 0.015 ** 2), ("start_var", 0.02 ** 2)):
        x = np.array([r[key] for r in res])
        assert abs(x.mean() - truth) < 4 * x.std() / math.sqrt(x.size), key
    one = [[r[0][:1]] for r in rows]                   # one start, one seed: only problems
    boot = stats.hier_bootstrap3(*one, reps=3000, seed=2)
    assert stats.noise3(*one)["eval_sd"] == pytest.approx(boot["sd"], rel=0.05)


def _population_eval(rng, problems, k, wrong_step):
    """An evaluation of N fresh problems drawn from a population, k samples each: counts
    (num, den) of accuracy or of the wrong-step share among correct answers."""
    q = rng.beta(0.6, 0.6, problems)
    correct = rng.binomial(k, q).astype(float)
    if not wrong_step:
        return correct, np.full(problems, float(k))
    return rng.binomial(correct.astype(int), rng.beta(1, 3, problems)).astype(float), correct


@pytest.mark.parametrize("wrong_step", [False, True])
def test_eval_components_predict_the_sd_at_other_sizes(wrong_step):
    """Measured on 4000 problems x 4 samples, the SD of one run's value predicted at other
    (N, k) matches the SD over 1500 fresh simulated evaluations of that size."""
    rng = np.random.default_rng(12)
    n, d = _population_eval(rng, 4000, 4, wrong_step)
    comp = stats.eval_components(n[None, None], d[None, None], 4)
    for problems, k in ((400, 1), (400, 16)):
        vals = [np.divide(*[x.sum() for x in _population_eval(rng, problems, k, wrong_step)])
                for _ in range(1500)]
        assert stats.eval_sd_at(comp, problems, k) == pytest.approx(np.std(vals), rel=0.06)


def test_eval_components_predict_the_paired_sd_at_other_sizes():
    """The same for a method's accuracy minus GRPO's on the same fresh problems: the method
    solves each problem with probability q_p +- 0.15, its samples drawn apart from GRPO's."""
    rng = np.random.default_rng(16)

    def pair(problems, k):
        q = rng.uniform(0.2, 0.8, problems)
        qm = q + 0.15 * rng.choice([-1.0, 1.0], problems)
        return [rng.binomial(k, x).astype(float) for x in (qm, q)], np.full(problems, float(k))

    (m, r), d = pair(4000, 4)
    comp = stats.eval_components(m[None, None], d[None, None], 4, r[None, None], d[None, None])
    for problems, k in ((400, 1), (400, 16)):
        vals = []
        for _ in range(1500):
            (a, b), dd = pair(problems, k)
            vals.append((a.sum() - b.sum()) / dd.sum())
        assert stats.eval_sd_at(comp, problems, k) == pytest.approx(np.std(vals), rel=0.06)


def test_eval_design_says_when_evaluation_noise_is_below_seed_noise():
    rng = np.random.default_rng(13)
    nums, dens, _ = _simulated_rows(rng, seeds=(5, 5, 5), problems=400, seed_sd=0.03)
    d = stats.eval_design(nums, dens, k=1)
    assert d["holds"] == (d["eval_sd"] < d["seed_sd"])
    assert d["problems_needed"][2] is None  # one sample per problem: k's effect unidentified
    need = d["problems_needed"][1]
    comp = stats.eval_components(nums, dens, 1)
    # the smallest N: below the seed SD at N, not at N - 1
    assert stats.eval_sd_at(comp, need, 1) < d["seed_sd"] <= stats.eval_sd_at(comp, need - 1, 1)
    ref = stats.eval_design(nums, dens, nums[::-1], dens, k=1)  # paired: of the difference
    assert ref["holds"] == (ref["eval_sd"] < ref["seed_sd"]) and ref["between_var"] > 0
    with pytest.raises(ValueError, match="num <= den <= k"):
        stats.eval_components(nums, [x * 0 for x in dens], 1)


def test_cheapest_evaluation_by_hand():
    """Two greedy and two sampled columns, one of each whose seeds do not differ (no size
    meets it). A size (N, k) decodes N greedy + N k sampled sequences; per k it must cover the
    largest need met, greedy needs at k = 1."""
    greedy = [{"1": 100}, {"1": None}]
    sampled = [{"1": 300, "2": 200, "4": 150}, {"1": None, "2": None, "4": None}]
    got = stats.cheapest_evaluation(greedy, sampled, margin=1.0, ks=(1, 2, 4))
    # k=1: N=300, 600 sequences; k=2: N=200, 600; k=4: N=150, 750; ties go to the smaller k
    assert [(d["k"], d["problems"], d["sequences"], d["met"], d["left_out"]) for d in got] == [
        (1, 300, 600, 2, 2), (2, 200, 600, 2, 2), (4, 150, 750, 2, 2)]
    # at most 500 sequences: the sampled column fits no k (600, 600, 750), the greedy one all
    # (200, 300, 500), so the cheapest covers the greedy need alone
    got = stats.cheapest_evaluation(greedy, sampled, margin=1.0, ks=(1, 2, 4),
                                    max_sequences=500)
    assert [(d["k"], d["problems"], d["sequences"], d["left_out"]) for d in got] == [
        (1, 100, 200, 3), (2, 100, 300, 3), (4, 100, 500, 3)]
    # the margin scales every need (and rounds up)
    assert stats.cheapest_evaluation(greedy, sampled, margin=1.1, ks=(2,))[0]["problems"] == 220


# ------------------------------------------------------------------ the comparison's rows
# `stats.aggregate` and the monitors' statistics on made-up cells, checked by hand or by a
# loop; the report's tables and plots of the rows they make.

def test_mean_ci_matches_statistics_module():
    xs = [0.62, 0.70, 0.81]
    got = stats.mean_ci(xs)
    assert got["mean"] == pytest.approx(statistics.mean(xs))
    # t_{0.975, 2} = 4.303 (two-sided 95%, 2 degrees of freedom)
    assert got["ci95"] == pytest.approx(4.303 * statistics.stdev(xs) / 3 ** 0.5)
    assert stats.mean_ci([0.5])["ci95"] is None and stats.mean_ci([])["mean"] is None


def _fake_eval(rng, p_correct, p_wrong, problems=60, n=1):
    correct = [int(x) for x in rng.binomial(n, p_correct, size=problems)]
    wrong = [int(rng.binomial(c, p_wrong)) for c in correct]
    tot = problems * n
    return {"accuracy": sum(correct) / tot, "all_steps_correct": (sum(correct) - sum(wrong)) / tot,
            "correct_with_wrong_step": sum(wrong) / max(sum(correct), 1), "problems": problems,
            "samples": tot, "per_problem": {"correct": correct, "wrong_step": wrong,
                                            "clean": [c - w for c, w in zip(correct, wrong)]}}


def test_aggregate_rows_paired_differences_and_sentences(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    ccfg = runs.CompareConfig(methods=("grpo", "papo", "pure"), seeds=3,
                                 method_seeds={"pure": 2}, oracle=("grpo", "papo"),
                                 bootstrap_reps=500)
    # pure: far fewer wrong steps than GRPO (separated); papo: the same as GRPO
    p_wrong = {"grpo": 0.4, "papo": 0.4, "pure": 0.05}
    results = []
    for r in runs.plan(ccfg):
        results.append({**r.__dict__, "name": r.name,
                        "greedy": _fake_eval(rng, 0.5, p_wrong[r.method], problems=300),
                        "sampled": _fake_eval(rng, 0.4, p_wrong[r.method], problems=300, n=2),
                        "train_end": {"reward/outcome_mean": 0.3},
                        "curves": {"reward/outcome_mean": [min(0.1 + 0.01 * i, 0.4)
                                                           for i in range(60)]}})
    rows = {(r["method"], r["prm"]): r for r in stats.aggregate(results, ccfg)}
    assert rows[("grpo", "oracle")]["same_run_as_learned"]
    assert "paired" not in rows[("grpo", "learned")] and "paired" not in rows[("grpo", "oracle")]
    assert ("pure", "learned") not in rows or rows[("pure", "learned")]["seeds"] == [0, 1]
    by = {(r["method"], r["prm"], r["seed"]): r for r in results if not r["hack"]}
    for key, seeds in ((("papo", "oracle"), [0, 1, 2]), (("pure", "learned"), [0, 1])):
        p = rows[key]["paired"]
        assert p["seeds"] == seeds
        for label, path in (("greedy accuracy", ("greedy", "accuracy")),
                            ("sampled correct with a wrong step",
                             ("sampled", "correct_with_wrong_step"))):
            want = [by[(*key, s)][path[0]][path[1]] - by[("grpo", "learned", s)][path[0]][path[1]]
                    for s in seeds]
            assert p[label]["per_seed"] == pytest.approx(want)
            assert p[label]["mean"] == pytest.approx(sum(want) / len(want))
            assert p[label]["lo"] <= p[label]["mean"] <= p[label]["hi"]
    w = rows[("pure", "learned")]["paired"]["greedy correct with a wrong step"]
    assert w["separated"] and w["hi"] < 0
    assert not rows[("papo", "learned")]["paired"]["greedy accuracy"]["separated"]
    cell = rows[("papo", "learned")]["greedy accuracy"]
    assert 0 <= cell["lo"] <= cell["mean"] <= cell["hi"] <= 1 and len(cell["wilson"]) == 3
    assert cell["noise"]["eval_sd"] == pytest.approx((0.25 / 300) ** 0.5, rel=0.25)
    # the curves rise over 30 steps, then stay: 90% of the rise is made by then
    pl = rows[("grpo", "learned")]["plateau"]
    assert 24 <= pl["step90"] <= 36 and pl["slope_last_quarter"] == pytest.approx(0.0, abs=1e-9)
    rep = {"rows": list(rows.values()), "baseline": {"greedy": results[0]["greedy"]},
           "rl_steps": 60, "eval_problems": 300, "seeds": 3, "sampled_n": 2,
           "prm": {"auroc": 0.9}, "compute_s": {"warmup": 1, "prm_train": 1, "runs": 1},
           "device": "CPU", "load": [1.0], "total_s": 1, "hack": None}
    md = report.markdown(rep)
    assert "below GRPO in the greedy wrong-step share" in md
    assert "**papo / learned**" in md and "not separated from GRPO in greedy accuracy" in md
    table = report.readme_table(rep)
    assert "| pure, learned | 2 |" in table and "grpo, oracle" not in table
    # the plots of these rows, the reward-hacking one included
    rep["hack"] = {"seed": 0, "curves": {"reward/outcome_mean": [0.1] * 60}}
    written = report.plot(rep, results, str(tmp_path))
    assert [os.path.basename(p) for p in written] == [
        "compare_bars.png", "compare_paired.png", "compare_curves.png", "reward_hacking.png"]
    assert all(os.path.getsize(p) > 10_000 for p in written)


def test_a_run_without_a_correct_answer_has_no_wrong_step_share(tmp_path):
    """A collapsed run (0 correct answers) records its wrong-step share as 0; the row leaves it
    out (None per seed, the mean over the other seeds) instead of averaging a 0 in."""
    import numpy as np

    rng = np.random.default_rng(1)
    ccfg = runs.CompareConfig(methods=("grpo", "pure"), seeds=3, oracle=(), bootstrap_reps=200)
    results = []
    for r in runs.plan(ccfg):
        collapsed = r.method == "pure" and r.seed == 1
        results.append({**r.__dict__, "name": r.name,
                        "greedy": _fake_eval(rng, 0.0 if collapsed else 0.5, 0.9, problems=200),
                        "sampled": _fake_eval(rng, 0.4, 0.9, problems=200, n=2),
                        "train_end": {}, "curves": {"reward/outcome_mean": [0.1] * 60}})
    rows = {(r["method"], r["prm"]): r for r in stats.aggregate(results, ccfg)}
    pure = {r["seed"]: r["greedy"] for r in results if r["method"] == "pure" and not r["hack"]}
    assert pure[1]["correct_with_wrong_step"] == 0.0  # what the evaluation records
    cell = rows[("pure", "learned")]["greedy correct with a wrong step"]
    assert cell["per_seed"][1] is None and cell["n"] == 2
    want = [sum(pure[s]["per_problem"]["wrong_step"]) / sum(pure[s]["per_problem"]["correct"])
            for s in (0, 2)]
    assert cell["per_seed"][0] == pytest.approx(want[0])
    assert cell["mean"] == pytest.approx(sum(want) / 2)  # the bootstrap's point, same rule
    paired = rows[("pure", "learned")]["paired"]["greedy correct with a wrong step"]
    assert paired["per_seed"][1] is None and None not in paired["per_seed"][::2]
    # the accuracy of that run is a real 0, kept
    assert rows[("pure", "learned")]["greedy accuracy"]["per_seed"][1] == 0.0
    rep = {"rows": list(rows.values()), "hack": None,
           "baseline": {"greedy": results[0]["greedy"], "sampled": results[0]["sampled"]}}
    assert "compare_paired.png" in [os.path.basename(p) for p in report.plot(rep, results,
                                                                              str(tmp_path))]


def test_the_implicit_prm_loss_is_each_runs_first_and_last_trained_steps():
    """PRIME's implicit-PRM loss in the report: each run's first and last 10 steps on which it
    trained some row (a step whose accuracy filter kept no group trains nothing and is left
    out), averaged over the runs; a run that trained on only 12 steps counts with those, and
    does not cut the other runs short (as a mean curve over the shortest run would)."""
    import numpy as np

    rng = np.random.default_rng(1)
    ccfg = runs.CompareConfig(methods=("grpo", "prime"), seeds=2, oracle=(), bootstrap_reps=50)
    losses = {0: [0.70] * 10 + [0.80] * 40 + [0.95] * 10,       # trained on all 60 steps
              1: [0.60] * 12}                                   # trained on 12 of 60
    results = []
    for r in runs.plan(ccfg):
        curves = {"reward/outcome_mean": [0.2] * 60}
        if r.method == "prime":
            trained = losses[r.seed]
            rows = [8] * len(trained) + [0] * (60 - len(trained))
            curves.update({"prm/loss": trained + [0.0] * (60 - len(trained)),
                           "prm/trained_rows": rows})
        results.append({**r.__dict__, "name": r.name,
                        "greedy": _fake_eval(rng, 0.5, 0.3, problems=100),
                        "sampled": _fake_eval(rng, 0.4, 0.3, problems=100, n=2),
                        "train_end": {}, "curves": curves})
    rows = {(r["method"], r["prm"]): r for r in stats.aggregate(results, ccfg)}
    pl = rows[("prime", "implicit")]["implicit_prm_loss"]
    assert pl["first"] == pytest.approx((0.70 + 0.60) / 2)
    assert pl["last"] == pytest.approx((0.95 + 0.60) / 2)
    assert pl["defined_steps"] == [60, 12]
    assert "implicit_prm_loss" not in rows[("grpo", "learned")]


def test_the_time_to_go_is_each_kinds_median_recorded_cost():
    """The progress line's estimate, by hand: GRPO cells cost 100 and 300 s (median 200),
    PRIME's 600 s; of the three cells to go, GRPO's costs 200, PRIME's 600 and PURE's, a kind
    none has finished, the median of every finished cell (300)."""
    spec = runs.RunSpec
    done = [{"method": "grpo", "prm": "learned", "rl_s": 90.0, "eval_s": 10.0},
            {"method": "grpo", "prm": "learned", "rl_s": 280.0, "eval_s": 20.0},
            {"method": "prime", "prm": "implicit", "rl_s": 550.0, "eval_s": 50.0}]
    todo = [spec("grpo", "learned", 1), spec("prime", "implicit", 1), spec("pure", "learned", 1)]
    assert stats.cells_to_go_s(done, todo) == pytest.approx(200 + 600 + 300)
    # the hack run is a kind of its own (not GRPO's 200); nothing finished: no estimate
    assert stats.cells_to_go_s(done, [spec("grpo", "learned", 0, hack=True)]) == 300
    assert stats.cells_to_go_s([], todo) is None
    assert stats.cells_to_go_s(done, []) == 0


def test_aggregate_over_starts_and_the_report_of_each_start(tmp_path):
    """Starts are the outer level: a row's value is the mean over starts of the mean over
    seeds (checked by a loop), its paired difference pairs (start, seed) with GRPO's, each
    start has its own paired difference, and the noise splits into evaluation, seed and start;
    the report shows the starts' table and the per-start differences."""
    import numpy as np

    rng = np.random.default_rng(1)
    ccfg = runs.CompareConfig(methods=("grpo", "pure"), seeds=2, oracle=(), starts=3,
                              hack_steps=0, bootstrap_reps=300)
    # start 2 is a weak start: every run there is less accurate; PURE helps on starts 0-1 only
    acc = {0: 0.6, 1: 0.55, 2: 0.3}
    wrong = {("grpo", 0): 0.4, ("grpo", 1): 0.4, ("grpo", 2): 0.4,
             ("pure", 0): 0.1, ("pure", 1): 0.1, ("pure", 2): 0.4}
    results = []
    for r in runs.plan(ccfg):
        results.append({**r.__dict__, "name": r.name,
                        "greedy": _fake_eval(rng, acc[r.start], wrong[(r.method, r.start)], 400),
                        "sampled": _fake_eval(rng, acc[r.start], wrong[(r.method, r.start)], 400,
                                              n=2),
                        "train_end": {}, "curves": {}})
    rows = {(r["method"], r["prm"]): r for r in stats.aggregate(results, ccfg)}
    pure = rows[("pure", "learned")]
    assert pure["starts"] == [0, 0, 1, 1, 2, 2] and pure["seeds"] == [0, 1] * 3
    cell = pure["greedy accuracy"]
    by = {(r["method"], r["start"], r["seed"]): r for r in results}
    want = [np.mean([by[("pure", k, s)]["greedy"]["accuracy"] for s in (0, 1)])
            for k in range(3)]
    assert cell["per_start"] == pytest.approx(want)
    assert cell["mean"] == pytest.approx(np.mean(want))
    assert cell["lo"] <= cell["mean"] <= cell["hi"]
    assert cell["noise"]["start_sd"] > 0.05  # start 2 is far from the others
    d = pure["paired"]["greedy correct with a wrong step"]
    assert d["per_seed"] == pytest.approx([
        by[("pure", k, s)]["greedy"]["correct_with_wrong_step"]
        - by[("grpo", k, s)]["greedy"]["correct_with_wrong_step"]
        for k in range(3) for s in (0, 1)])
    per = d["by_start"]
    assert per["0"]["separated"] and per["1"]["separated"] and per["0"]["hi"] < 0
    assert not per["2"]["separated"]  # the weak start disagrees: no effect there
    # the difference's evaluation SD, by a loop: each run's ratio moves by sum_p z_p under a
    # resampling of the problems (z_p = (num_p - R den_p) / sum(den)); the two runs of a pair
    # share the problems, so the difference moves by sum_p (z_p - z_ref,p)
    def z(rec):
        pp = rec["greedy"]["per_problem"]
        num, den = pp["wrong_step"], pp["correct"]
        ratio = sum(num) / sum(den)
        return [(a - ratio * b) / sum(den) for a, b in zip(num, den)]

    var = [sum((a - b) ** 2 for a, b in zip(z(by[("pure", k, s)]), z(by[("grpo", k, s)])))
           for k in range(3) for s in (0, 1)]
    assert d["noise"]["eval_sd"] == pytest.approx((sum(var) / len(var)) ** 0.5)
    assert d["noise"]["start_sd"] > 0.05  # PURE's effect differs between the starts
    rep = {"rows": list(rows.values()), "baseline": {"greedy": results[0]["greedy"]},
           "rl_steps": 60, "eval_problems": 400, "seeds": 2, "sampled_n": 2,
           "prm": {"auroc": 0.9}, "compute_s": {"warmup": 1, "prm_train": 1, "runs": 1},
           "device": "CPU", "load": [1.0], "total_s": 1, "hack": None, "task": "long",
           "task_config": "ArithmeticConfig(...)", "max_tokens": 224,
           "response_tokens": {"first5": 150, "last5": 152},
           "starts": [{"start": k, "baseline": {"greedy": {"accuracy": acc[k]}},
                       "prm": {"auroc": 0.9}, "prm_judged": {"f1": 0.8}, "cells": 4}
                      for k in range(3)]}
    md = report.markdown(rep)
    # the next evaluation size: the columns it leaves out are named only where there are some
    size = {"k": 2, "problems": 300, "sequences": 900, "met": 8, "left_out": 0}
    sizes = {"max_sequences": 1000, "rl_s": 10.0, "seconds_per_sequence": 0.01, "sizes": [size]}
    assert "300 problems x 2 samples (8 of 8 columns)." in report.markdown(
        {**rep, "evaluation_sizes": sizes})
    assert "(6 of 8 columns; the other 2: seed SD 0" in report.markdown(
        {**rep, "evaluation_sizes": {**sizes, "sizes": [{**size, "met": 6, "left_out": 2}]}})
    assert "Task **long**" in md and "### The starts" in md
    assert "| 2 | 0.300 | - | 0.900 | 0.800 | 4 |" in md
    assert "The paired differences start by start" in md and "| pure | learned | 2 | 2 |" in md
    nz = d["noise"]
    cell = (f"{nz['eval_sd']:.3f} / {nz['seed_sd']:.3f} / {nz['start_sd']:.3f}"
            + (" ✓" if nz["eval_sd"] < nz["seed_sd"] else ""))
    table = md.split("### The same split for the paired differences from GRPO")[1]
    assert f"| pure | learned | {cell} |" in table
    below = sum(pure["paired"][c]["noise"]["eval_sd"] < pure["paired"][c]["noise"]["seed_sd"]
                for c in stats.PAIRED)
    assert f"Evaluation below seed noise in {below} of 4 paired cells." in table
    assert report.block_name({"task": "long"}) == "compare-long"
    assert report.block_name({"task": "ArithmeticConfig(num_ops=(2, 4))"}) == "compare"
