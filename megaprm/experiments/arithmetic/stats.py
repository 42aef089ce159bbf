"""Intervals for `megaprm compare` that stay inside [0, 1] and respect the design: several seeds
(training noise), each evaluated on the same held-out problems (evaluation noise).

* `wilson`: the Wilson score interval of a binomial proportion (E. B. Wilson, "Probable
  inference, the law of succession, and statistical inference", JASA 22, 1927; the form of
  Brown, Cai & DasGupta, Statistical Science 16, 2001, eq. 4). Used for one seed's evaluation:
  the binomial part alone, problems as the only source of noise.
* `hier_bootstrap`: a two-level (hierarchical) percentile bootstrap, resampling seeds with
  replacement and then, inside every drawn seed, the held-out problems with replacement (Davison
  & Hinkley, "Bootstrap Methods and their Application", 1997, sec. 3.8: resampling at both
  stages). Paired: a method and its reference (GRPO) share the drawn seeds and, within a seed,
  the drawn problems, since a method's run with seed s and GRPO's run with seed s start from the
  same warm-up with the same sampling seed and are evaluated on the same problems.
* `hier_bootstrap3`: the same with independently built starts (warm-up + PRM) as the outer
  level: starts, then seeds inside a start, then problems (ragged seed counts allowed).
* `noise` / `noise3`: the noise of one run's value split into evaluation, seed (and start)
  parts; `eval_components` / `eval_design`: how many held-out problems (and samples per
  problem) put the evaluation's part below the seed's.

A cell's statistic is a ratio of sums over problems: accuracy = sum(correct) / sum(samples),
"correct with a wrong step" = sum(wrong-step) / sum(correct); per seed, then averaged over seeds
(every seed weighs the same). Percentiles of ratios in [0, 1] stay in [0, 1].

The comparison's rows (`aggregate`, the last section): what `megaprm compare` reports of its
cells' records, every column's intervals, noise split and evaluation design, the paired
differences from GRPO, the training monitors' means (`evaluation_sizes`, `cells_to_go_s`,
`response_tokens` beside it). Pure functions of numbers and records: no file is read here
(compare.py reads the cells) and nothing is formatted (report.py does).
"""
from __future__ import annotations

import math
import statistics

import numpy as np

from megaprm.experiments.arithmetic.runs import (
    READS_STEP_SCORES,
    REFERENCE,
    VARIANTS,
    CompareConfig,
    base_method,
)

Z95 = 1.959963984540054  # the standard normal's 0.975 quantile
CHUNK = 256              # bootstrap replicates drawn at once


def wilson(k: float, n: float, z: float = Z95) -> tuple:
    """Wilson score interval (lo, hi) for k successes out of n; (nan, nan) for n == 0."""
    if n <= 0:
        return (math.nan, math.nan)
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (max(0.0, centre - half), min(1.0, centre + half))


def _div(n: np.ndarray, d: np.ndarray) -> np.ndarray:
    """n / d elementwise; nan where d is 0."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(d > 0, n / np.where(d > 0, d, 1), np.nan)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """sum(num) / sum(den) over the last axis; nan where the denominator is 0."""
    return _div(num.sum(-1), den.sum(-1))


def seed_values(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """The statistic of every seed: `num`, `den` are [seeds, problems] -> [seeds]."""
    return _ratio(np.asarray(num, float), np.asarray(den, float))


def hier_bootstrap(num: np.ndarray, den: np.ndarray, ref_num: np.ndarray | None = None,
                   ref_den: np.ndarray | None = None, *, reps: int = 2000, seed: int = 0,
                   level: float = 0.95) -> dict:
    """Two-level paired bootstrap of mean-over-seeds of sum(num)/sum(den) (or of its difference
    from the reference's, when `ref_*` are given; same shapes [seeds, problems]).

    Returns the point estimate (on the data), the percentile interval, and the replicates' SD.
    A replicate whose ratio is undefined (no correct answer in a drawn seed) is dropped; the
    share of dropped replicates is returned as `undefined`."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    paired = ref_num is not None
    if paired:
        ref_num, ref_den = np.asarray(ref_num, float), np.asarray(ref_den, float)
        if ref_num.shape != num.shape or ref_den.shape != den.shape:
            raise ValueError(f"paired bootstrap: shapes differ ({num.shape} vs {ref_num.shape}); "
                             "the two rows need the same seeds and problems")
    seeds, probs = num.shape
    rng = np.random.default_rng(seed)
    s_idx = rng.integers(0, seeds, size=(reps, seeds))           # seeds drawn per replicate

    def draws():  # problems drawn within every drawn seed, in chunks (memory: chunk x S x P)
        for lo in range(0, reps, CHUNK):
            hi = min(reps, lo + CHUNK)
            yield s_idx[lo:hi], rng.integers(0, probs, size=(hi - lo, seeds, probs))

    def stat(a, b, si, pi):
        ra = np.take_along_axis(a[si], pi, axis=2)               # [chunk, seeds, problems]
        rb = np.take_along_axis(b[si], pi, axis=2)
        return _ratio(ra, rb)                                    # [chunk, seeds]

    point = np.nanmean(seed_values(num, den)) if seeds else math.nan
    if paired:
        point = point - np.nanmean(seed_values(ref_num, ref_den))
    parts = []
    for si, pi in draws():
        v = stat(num, den, si, pi)
        if paired:
            v = v - stat(ref_num, ref_den, si, pi)
        parts.append(v)
    reps_v = np.concatenate(parts)
    ok = ~np.isnan(reps_v).any(axis=1)
    means = reps_v[ok].mean(axis=1)
    a = (1 - level) / 2
    if means.size == 0:
        lo = hi = sd = math.nan
    else:
        lo, hi = np.quantile(means, [a, 1 - a])
        sd = float(means.std(ddof=1)) if means.size > 1 else math.nan
    return {"mean": float(point), "lo": float(lo), "hi": float(hi), "sd": sd,
            "undefined": float(1 - ok.mean()), "reps": reps, "level": level}


def eval_only_bootstrap(num: np.ndarray, den: np.ndarray, *, reps: int = 2000,
                        seed: int = 0) -> float:
    """SD of the mean over seeds when only the problems are resampled (seeds fixed): the
    evaluation's share of the noise of a row's mean."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    seeds, probs = num.shape
    rng = np.random.default_rng(seed)
    parts = []
    for lo in range(0, reps, CHUNK):
        pi = rng.integers(0, probs, size=(min(reps, lo + CHUNK) - lo, seeds, probs))
        parts.append(_ratio(np.take_along_axis(np.broadcast_to(num, pi.shape), pi, axis=2),
                            np.take_along_axis(np.broadcast_to(den, pi.shape), pi, axis=2)))
    r = np.concatenate(parts)
    m = r[~np.isnan(r).any(axis=1)].mean(axis=1)
    return float(m.std(ddof=1)) if m.size > 1 else math.nan


def noise(num: np.ndarray, den: np.ndarray, *, reps: int = 2000, seed: int = 0) -> dict:
    """The two noise sources of one row, as standard deviations of a *single* seed's value:
    `eval_sd` (the problems' binomial noise: the bootstrap over problems, averaged over seeds)
    and `seed_sd` (the spread across seeds, less what evaluation noise explains:
    sqrt(max(0, var_between - eval_sd^2))), plus the raw `between_sd`."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    seeds = num.shape[0]
    vals = seed_values(num, den)
    # per-seed evaluation SD: sqrt(mean over seeds of the per-seed bootstrap variance) =
    # sqrt(seeds) x the SD of the mean over seeds under problem resampling alone
    ev = eval_only_bootstrap(num, den, reps=reps, seed=seed) * math.sqrt(seeds)
    between = float(np.nanstd(vals, ddof=1)) if seeds > 1 else math.nan
    seed_sd = (math.sqrt(max(0.0, between ** 2 - ev ** 2)) if not math.isnan(between)
               else math.nan)
    return {"eval_sd": ev, "between_sd": between, "seed_sd": seed_sd}


# ------------------------------------------------------------------ t-intervals over seeds

# two-sided 95% Student-t quantiles t_{0.975, df} (standard tables), df = seeds - 1
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042}


def t975(df: int) -> float:
    if df in _T975:
        return _T975[df]
    below = max(k for k in _T975 if k <= df) if df < 30 else None
    return _T975[below] if below else 1.96 + 2.4 / df  # conservative between table rows


def mean_ci(xs: list) -> dict:
    """Mean and the half-width of a 95% t-interval over seeds (None with one seed)."""
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        return {"mean": None, "ci95": None, "n": 0}
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return {"mean": m, "ci95": None, "n": len(xs)}
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return {"mean": m, "ci95": t975(len(xs) - 1) * sd / math.sqrt(len(xs)), "n": len(xs)}


# ------------------------------------------------------------ three levels: starts, seeds, problems
#
# A *start* is an independently built warm-up policy + PRM; every RL run (seed) starts from one
# start, and every run is evaluated on the same held-out problems. Counts come as an array
# [starts, seeds, problems] or, where starts finished different numbers of seeds (a run cut
# short), as a list of [seeds_t, problems] arrays, one per start.

GATHER = 1 << 21  # problem indices drawn at once by `hier_bootstrap3` (memory: 8 bytes each)


def _by_start(x, name: str) -> list:
    """[starts, seeds, problems] array or list of [seeds_t, problems] arrays -> list of 2-D
    float arrays, one per start; every start has >= 1 seed and all share one problem count."""
    arrs = [np.asarray(a, float) for a in x]
    if not arrs or any(a.ndim != 2 or a.shape[0] < 1 for a in arrs):
        raise ValueError(f"{name}: expected [starts, seeds, problems] or a list of [seeds, "
                         f"problems] arrays with >= 1 seed each, got shapes "
                         f"{[a.shape for a in arrs]}")
    if len({a.shape[1] for a in arrs}) != 1:
        raise ValueError(f"{name}: starts have different problem counts "
                         f"{[a.shape[1] for a in arrs]}; every run is evaluated on the same "
                         "held-out problems")
    return arrs


def _layout(rows: list, names: list) -> None:
    """Every array list in `rows` has the first one's shape, start by start."""
    want = [a.shape for a in rows[0]]
    for arrs, name in zip(rows[1:], names[1:]):
        if [a.shape for a in arrs] != want:
            raise ValueError(f"{name}: shapes {[a.shape for a in arrs]} differ from {names[0]}'s "
                             f"{want}; paired rows need the same starts, seeds and problems")


def start_values(num, den) -> np.ndarray:
    """Each start's statistic: the mean over its seeds of sum(num)/sum(den) -> [starts]."""
    return np.array([np.nanmean(seed_values(n, d)) for n, d in
                     zip(_by_start(num, "num"), _by_start(den, "den"))])


def hier_bootstrap3(num, den, ref_num=None, ref_den=None, *, reps: int = 2000, seed: int = 0,
                    level: float = 0.95) -> dict:
    """Three-level paired percentile bootstrap of the mean over starts of the mean over seeds
    of sum(num)/sum(den) (minus the reference's, when `ref_*` are given in the same layout).

    Resampling at every stage (Davison & Hinkley 1997, sec. 3.8; Field & Welsh, "Bootstrapping
    clustered data", JRSS-B 69, 2007): draw the starts with replacement; inside each drawn start
    draw as many seeds as it has, with replacement; inside each drawn (start, seed) draw the
    problems with replacement. The reference shares every draw. A start with fewer seeds keeps
    its own seed count, and the mean over its drawn seeds weighs it like any other start.

    With one start the random stream is `hier_bootstrap`'s (no start draw; seeds, then problems,
    from the same generator), so both return identical numbers for the same `seed`.
    Returns the point estimate (on the data), the percentile interval, the replicates' SD, and
    `undefined`, the share of replicates dropped because a drawn run's ratio had no denominator.

    Few starts: a percentile bootstrap over a clusters has SD sqrt((a-1)/a) of the usual
    standard error and normal-like tails, so it undercovers when the start spread dominates
    (simulated, start SD 0.03 > seed SD 0.02, 5 seeds x 400 problems, 300 datasets: 85% of
    nominal 95% at 3 starts, 92% at 5, 94% at 8). `t_lo`, `t_hi` give the interval that holds
    with few starts: Student's t over the per-start values (each start's mean over its seeds,
    or of its paired differences), mean +- t_{0.975, a-1} sd / sqrt(a) (93.7%, 95.3%, 94.7% in
    the same simulation); nan with one start.
    """
    names = ["num", "den"] + (["ref_num", "ref_den"] if ref_num is not None else [])
    rows = [_by_start(x, n) for x, n in zip((num, den, ref_num, ref_den), names)]
    _layout(rows, names)
    paired = len(rows) == 4
    starts, probs = len(rows[0]), rows[0][0].shape[1]
    n_seeds = np.array([a.shape[0] for a in rows[0]])
    width = int(n_seeds.max())
    # channels [num, den(, ref_num, ref_den)], each flattened [starts * width * problems];
    # the padding rows of a start with fewer seeds are never drawn
    flat = np.zeros((len(rows), starts, width, probs))
    for c, arrs in enumerate(rows):
        for t, a in enumerate(arrs):
            flat[c, t, :a.shape[0]] = a
    flat = flat.reshape(len(rows), -1)

    per_start = start_values(num, den)
    if paired:
        per_start = per_start - start_values(ref_num, ref_den)
    point = np.mean(per_start)
    if starts > 1:
        half = t975(starts - 1) * np.std(per_start, ddof=1) / math.sqrt(starts)
        t_lo, t_hi = point - half, point + half
    else:
        t_lo = t_hi = math.nan

    rng = np.random.default_rng(seed)
    st = (rng.integers(0, starts, size=(reps, starts)) if starts > 1
          else np.zeros((reps, 1), np.int64))                       # [reps, starts]
    ns = n_seeds[st]                                                 # seeds of each drawn start
    si = rng.integers(0, ns[..., None], size=(reps, starts, width))  # [reps, starts, width]
    used = np.arange(width) < ns[..., None]                          # slots past ns: unused
    row0 = (st[..., None] * width + si) * probs                      # offset of each drawn run
    chunk = max(1, GATHER // (starts * width * probs))
    means, bad = [], []
    for lo in range(0, reps, chunk):
        hi = min(reps, lo + chunk)
        idx = rng.integers(0, probs, size=(hi - lo, starts, width, probs))
        idx += row0[lo:hi, ..., None]                                # [chunk, starts, width, P]
        sums = [np.take(ch, idx).sum(-1) for ch in flat]             # each [chunk, starts, width]
        v = _div(sums[0], sums[1])
        if paired:
            v = v - _div(sums[2], sums[3])
        u = used[lo:hi]
        v = np.where(u, v, 0.0)                                      # nan stays where used
        m = (v.sum(2) / ns[lo:hi]).mean(1)                           # [chunk]
        bad.append(np.isnan(m))
        means.append(m)
    means, bad = np.concatenate(means), np.concatenate(bad)
    means = means[~bad]
    a = (1 - level) / 2
    if means.size == 0:
        lo_q = hi_q = sd = math.nan
    else:
        lo_q, hi_q = np.quantile(means, [a, 1 - a])
        sd = float(means.std(ddof=1)) if means.size > 1 else math.nan
    return {"mean": float(point), "lo": float(lo_q), "hi": float(hi_q), "sd": sd,
            "undefined": float(bad.mean()), "reps": reps, "level": level,
            "t_lo": float(t_lo), "t_hi": float(t_hi), "seeds": n_seeds.tolist()}


def _eval_residuals(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """The linearised evaluation error of every run's ratio R = sum(num)/sum(den), per problem:
    z_p = (num_p - R den_p) / sum(den) ([runs, problems] -> [runs, problems]). Resampling the
    problems moves R by sum_p z_p to first order (delta method; Cochran, "Sampling Techniques",
    3rd ed. 1977, ch. 6, ratio estimators), so the bootstrap variance of one run's R is
    sum_p z_p^2 and the covariance of two runs' R under the same problem draws is
    sum_p z_p z'_p."""
    r = _ratio(num, den)[:, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        return (num - r * den) / den.sum(-1, keepdims=True)


def noise3(num, den, ref_num=None, ref_den=None) -> dict:
    """The three noise sources of a row, each as the SD of *one* run's value (closed form, no
    Monte Carlo).

    Model (a nested random-effects model; Searle, Casella & McCulloch, "Variance Components",
    1992, ch. 3 and 5): run j of start i has value y_ij = mu + A_i + B_ij + E_ij, with
    start effect A (variance s_a^2), seed effect B (s_s^2) and evaluation error E. All runs are
    evaluated on the same problems, so E is correlated: from the linearised residuals z
    (`_eval_residuals`), v = mean over runs of sum_p z^2 (one run's evaluation variance),
    c_w = mean over pairs of runs in one start of sum_p z z' and c_b the same over pairs in
    different starts. The part c_b is common to every run (the problem set's difficulty) and
    moves no comparison; c_w - c_b is common to a start's runs; v - c_w is each run's own.

    One-way ANOVA of the runs on their start (unbalanced; Searle et al. ch. 3):
      MS_W = sum_ij (y_ij - ybar_i)^2 / (N - a),  E[MS_W] = s_s^2 + (v - c_w)
      MS_A = sum_i n_i (ybar_i - ybar)^2 / (a - 1),
             E[MS_A] = n0 (s_a^2 + c_w - c_b) + s_s^2 + (v - c_w),
      n0 = (N - sum_i n_i^2 / N) / (a - 1)
    (N runs, a starts, n_i seeds of start i, ybar the mean over runs), giving the
    method-of-moments estimates
      seed_var  = MS_W - (v - c_w)
      start_var = (MS_A - MS_W) / n0 - (c_w - c_b).
    `seed_sd`, `start_sd` are their square roots floored at 0 (the raw, possibly negative,
    `seed_var` and `start_var` are returned too: unbiased to first order, the floored SDs not);
    `eval_sd` = sqrt(v) is the SD of one run's value under resampling the problems (the
    quantity `noise` bootstraps), `eval_run_sd` = sqrt(v - c_w) its part that differs between
    runs of one start. A component that the layout cannot estimate (one start; no start with
    two seeds) is nan. Unlike `noise`, the seed variance subtracts only the runs' own
    evaluation variance, not the shared part: with heterogeneous problems, subtracting all of
    v understates the seed spread. Runs whose ratio is undefined (den sums to 0) are left out.

    Paired (`ref_*` in the same layout): the same split of the difference from the reference's
    run of the same start and seed, y = R - R_ref, z = z - z_ref (the two share the problems).
    """
    names = ["num", "den"] + (["ref_num", "ref_den"] if ref_num is not None else [])
    rows = [_by_start(x, n) for x, n in zip((num, den, ref_num, ref_den), names)]
    _layout(rows, names)
    ys, zs = [], []                                                # per start: [n_i], [n_i, P]
    for t in range(len(rows[0])):
        y, z = _ratio(rows[0][t], rows[1][t]), _eval_residuals(rows[0][t], rows[1][t])
        if len(rows) == 4:
            y = y - _ratio(rows[2][t], rows[3][t])
            z = z - _eval_residuals(rows[2][t], rows[3][t])
        if (~np.isnan(y)).any():
            ys.append(y[~np.isnan(y)])
            zs.append(z[~np.isnan(y)])
    n_i = np.array([y.size for y in ys])
    a, n_runs = len(ys), int(n_i.sum())
    if n_runs == 0:
        raise ValueError("noise3: no run has a defined ratio (every denominator sums to 0)")
    # block sums of the runs' covariance matrix sum_p z z', without forming it: within start i
    # the off-diagonal pairs sum to |S_i|^2 - sum_j |z_ij|^2 (S_i = sum_j z_ij), and pairs in
    # different starts to |T|^2 - sum_i |S_i|^2 (T = sum_i S_i)
    diag = sum(float((z ** 2).sum()) for z in zs)
    s_i = np.stack([z.sum(0) for z in zs])                         # [a, P]
    ss_i = float((s_i ** 2).sum())
    v = diag / n_runs
    same_pairs = int((n_i * (n_i - 1)).sum())
    other_pairs = n_runs ** 2 - int((n_i ** 2).sum())
    c_w = (ss_i - diag) / same_pairs if same_pairs else math.nan
    c_b = (float((s_i.sum(0) ** 2).sum()) - ss_i) / other_pairs if other_pairs else math.nan
    y_all = np.concatenate(ys)
    means = np.array([y.mean() for y in ys])
    ms_w = (float(sum(((y - y.mean()) ** 2).sum() for y in ys) / (n_runs - a))
            if n_runs > a else math.nan)
    seed_var = ms_w - (v - c_w)
    if a > 1:
        ms_a = float((n_i * (means - y_all.mean()) ** 2).sum() / (a - 1))
        n0 = (n_runs - (n_i ** 2).sum() / n_runs) / (a - 1)
        start_var = (ms_a - ms_w) / n0 - (c_w - c_b)
    else:
        start_var = n0 = math.nan

    def sd(var):
        return math.nan if math.isnan(var) else math.sqrt(max(0.0, var))

    return {"eval_sd": math.sqrt(v), "eval_run_sd": sd(v - c_w), "seed_sd": sd(seed_var),
            "start_sd": sd(start_var), "seed_var": seed_var, "start_var": start_var,
            "within_sd": sd(ms_w), "between_sd": float(np.std(means, ddof=1)) if a > 1
            else math.nan, "n0": n0, "seeds": n_i.tolist()}


# ------------------------------------------------------------ how many problems (and samples)

def _sample_parts(n_p: np.ndarray, d_p: np.ndarray, k: int):
    """One run's linearised per-sample values u, summarised per problem: the mean ubar_p and
    the sample variance s2_p (ddof 1; zeros for k = 1), or None when sum(den) is 0."""
    if d_p.sum() == 0:
        return None
    r = n_p.sum() / d_p.sum()
    dbar = d_p.sum() / (n_p.size * k)
    hi, lo = (1 - r) / dbar, -r / dbar                           # u on num / den-only samples
    ubar = (n_p * hi + (d_p - n_p) * lo) / k                     # [P]
    s2 = ((n_p * hi ** 2 + (d_p - n_p) * lo ** 2 - k * ubar ** 2) / (k - 1) if k > 1
          else np.zeros_like(ubar))
    return ubar, s2


def eval_components(num, den, k: int, ref_num=None, ref_den=None) -> dict:
    """Between- and within-problem variance of the evaluation, for choosing its size.

    Each problem is sampled k times; sample s of problem p has indicators num_ps <= den_ps in
    {0, 1} (accuracy: den = 1, num = correct; wrong-step share: den = correct, num = correct
    with a wrong step), and the counts given are their sums over the k samples. To first order
    a run's ratio R = sum num / sum den moves with the mean over problems and samples of
    u_ps = (num_ps - R den_ps) / dbar (dbar = sum den / (N k)), so with N problems drawn from
    a population and k samples each
        Var(R) = s_b^2 / N + s_w^2 / (N k),
    s_w^2 = E_p[Var_s(u_ps)] (the samples' spread inside a problem) and
    s_b^2 = Var_p(E_s u_ps) (the problems' spread) -- the variance of a two-stage sample mean
    (Cochran 1977, ch. 10, two-stage sampling). From the counts, u takes (1 - R)/dbar on num_p samples,
    -R/dbar on den_p - num_p samples and 0 on the rest, which gives each problem's sample
    variance s_p^2 (ddof 1) exactly; s_w^2 = mean_p s_p^2 and s_b^2 = Var_p(ubar_p) (ddof 1)
    - s_w^2 / k (unbiased; the mean of ubar_p is 0 by the choice of R). Averaged over runs.
    With k = 1 the two are not separable: s_w^2 is nan and s_b^2 holds their sum.

    Paired (`ref_*`: the reference's run of the same start and seed, same problems): the same
    for the difference R - R_ref, whose per-problem mean is ubar_p - ubar_ref,p and whose
    within-problem variance is s_p^2 + s_ref,p^2 (the two runs' samples are drawn apart).
    Counts: any layout `_by_start` accepts (one run: shape [1, 1, problems])."""
    names = ["num", "den"] + (["ref_num", "ref_den"] if ref_num is not None else [])
    rows = [np.concatenate(_by_start(x, n)) for x, n in zip((num, den, ref_num, ref_den), names)]
    if any(r.shape != rows[0].shape for r in rows):
        raise ValueError(f"eval_components: shapes {[r.shape for r in rows]} differ ({names})")
    pairs = list(zip(rows[0::2], rows[1::2]))
    if k < 1 or any((n < 0).any() or (n > d).any() or (d > k).any() for n, d in pairs):
        raise ValueError(f"eval_components: need 0 <= num <= den <= k per problem (k = {k} "
                         "samples per problem, counts of 0/1 indicators)")
    b_parts, w_parts = [], []
    for run in range(rows[0].shape[0]):
        parts = [_sample_parts(n[run], d[run], k) for n, d in pairs]
        if any(p is None for p in parts):
            continue
        ubar = parts[0][0] - (parts[1][0] if len(parts) == 2 else 0.0)
        w = float(sum(p[1] for p in parts).mean())
        b_parts.append(float(ubar.var(ddof=1)) - w / k)
        w_parts.append(w)
    if not b_parts:
        raise ValueError("eval_components: no run has a defined ratio (every den sums to 0)")
    return {"between_var": float(np.mean(b_parts)),
            "within_var": float(np.mean(w_parts)) if k > 1 else math.nan, "k": k,
            "problems": rows[0].shape[1]}


def eval_sd_at(comp: dict, problems: int, k: int) -> float:
    """The SD of one run's value at `problems` held-out problems and `k` samples each, from
    `eval_components` (between-problem variance floored at 0)."""
    if k != comp["k"] and math.isnan(comp["within_var"]):
        return math.nan  # measured with one sample per problem: k's effect is not identified
    within = 0.0 if math.isnan(comp["within_var"]) else comp["within_var"]
    return math.sqrt(max(0.0, comp["between_var"]) / problems + within / (problems * k))


def eval_design(num, den, ref_num=None, ref_den=None, *, k: int = 1,
                ks: tuple = (1, 2, 4, 8, 16)) -> dict:
    """Does evaluation noise stay below seed noise for this column, and if not, how large must
    the evaluation be? `num`, `den`: one column's counts over starts, seeds and problems (any
    `_by_start` layout), measured with k samples per problem; with `ref_*`, of the column's
    paired difference from the reference (both noises then of one run's difference).

    `holds`: eval_sd < seed_sd (both from `noise3`, SDs of one run's value). `problems_needed`
    maps each k' in `ks` to the smallest N with eval_sd_at(N, k') < seed_sd, i.e.
    N = floor((s_b^2 + s_w^2 / k') / seed_sd^2) + 1; None where no N suffices (seed_sd 0 or not
    estimable) or k' is not identified (measured with k = 1: only k' = 1 is given)."""
    nz = noise3(num, den, ref_num, ref_den)
    comp = eval_components(num, den, k, ref_num, ref_den)
    target = nz["seed_sd"]
    need = {}
    for kk in ks:
        var1 = eval_sd_at(comp, 1, kk) ** 2                      # variance at N = 1
        ok = not (math.isnan(var1) or math.isnan(target) or target <= 0)
        need[kk] = int(math.floor(var1 / target ** 2)) + 1 if ok else None
    return {"holds": bool(nz["eval_sd"] < target), "eval_sd": nz["eval_sd"],
            "seed_sd": target, "start_sd": nz["start_sd"], **comp, "problems_needed": need}


def cheapest_evaluation(greedy: list, sampled: list, *, max_sequences: int | None = None,
                        margin: float = 1.1, ks: tuple = (1, 2, 4, 8, 16)) -> list:
    """The evaluation sizes (problems N, samples k per problem) that put the evaluation noise
    below the seed noise in as many columns as a budget allows, cheapest first.

    `greedy`, `sampled`: the `problems_needed` maps ({k: N or None}, `eval_design`) of every
    greedy and every sampled column. The greedy evaluation decodes one sequence a problem (a
    greedy column's need is its need at k = 1), the sampled one k, both on the same N problems,
    so a size costs N (1 + k) decoded sequences. Per k, a column is met when
    margin * need * (1 + k) <= `max_sequences` (None: no cap); a column whose need is None (its
    seed SD is 0 or not estimable: no size suffices, or k not identified) or over the cap is
    `left_out`. N_k = ceil(margin * the largest need met). Sorted by (left out, sequences):
    the first entry meets the most columns at the least cost. `margin`: headroom for the needs
    being estimates."""
    def need(m, k):
        return (m or {}).get(k, (m or {}).get(str(k)))

    out = []
    for k in ks:
        needs = [need(m, 1) for m in greedy] + [need(m, k) for m in sampled]
        met = [x for x in needs if x is not None
               and (max_sequences is None or margin * x * (1 + k) <= max_sequences)]
        n = math.ceil(round(margin * max([*met, 2]), 6))  # 1.1 * 200 is 220, not 221
        out.append({"k": k, "problems": n, "sequences": n * (1 + k), "met": len(met),
                    "left_out": len(needs) - len(met)})
    return sorted(out, key=lambda d: (d["left_out"], d["sequences"], d["k"]))


# ------------------------------------------------------------ the comparison's rows, from its cells
#
# What `megaprm compare` measures, from its cells' records (each cell's result.json, with its
# curves read back from its metrics.jsonl): the columns and the paired differences the report
# shows (report.py formats them), each row's intervals and noise split, and the monitors' means.

# (label, path into a result) of every column of the table
COLUMNS = (("greedy accuracy", ("greedy", "accuracy")),
           ("greedy fully correct", ("greedy", "all_steps_correct")),
           ("greedy correct with a wrong step", ("greedy", "correct_with_wrong_step")),
           ("sampled accuracy", ("sampled", "accuracy")),
           ("sampled correct with a wrong step", ("sampled", "correct_with_wrong_step")),
           ("train reward (last 5 steps)", ("train_end", "reward/outcome_mean")),
           ("PRM/outcome agreement (last 5)", ("train_end", "prm/outcome_agreement")))


# the evaluation columns as ratios of per-problem counts: label -> (evaluation, numerator,
# denominator); "samples" is the samples per problem (1 greedy, sampled_n sampled)
EVAL_RATIOS = {"greedy accuracy": ("greedy", "correct", "samples"),
               "greedy fully correct": ("greedy", "clean", "samples"),
               "greedy correct with a wrong step": ("greedy", "wrong_step", "correct"),
               "sampled accuracy": ("sampled", "correct", "samples"),
               "sampled correct with a wrong step": ("sampled", "wrong_step", "correct")}


# the paired differences the report leads with
PAIRED = ("greedy correct with a wrong step", "greedy accuracy",
          "sampled correct with a wrong step", "sampled accuracy")


def lookup(rec: dict, path: tuple):
    """The value at `path` (keys) inside a result, None where a key is missing."""
    for k in path:
        rec = rec.get(k) if isinstance(rec, dict) else None
    return rec


def tail_mean(xs: list, n: int = 5) -> float | None:
    """The mean of the last `n` finite values of a per-step monitor (None without one)."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs[-n:]) / len(xs[-n:]) if xs else None


def cells_by_start(recs: list) -> dict:
    """start -> its cells sorted by seed (cells written before starts were a level: start 0)."""
    out: dict = {}
    for r in sorted(recs, key=lambda r: (r.get("start", 0), r["seed"])):
        out.setdefault(r.get("start", 0), []).append(r)
    return out


def _counts(recs: list, label: str):
    """[seeds, problems] numerator and denominator arrays of an evaluation column, or None when
    a run lacks per-problem counts."""
    ev, num, den = EVAL_RATIOS[label]
    nums, dens = [], []
    for r in recs:
        pp = lookup(r, (ev, "per_problem"))
        if not pp:
            return None
        per = r[ev]["samples"] // max(r[ev]["problems"], 1)
        nums.append(pp[num])
        dens.append(pp[den] if den != "samples" else [per] * len(pp[num]))
    return np.asarray(nums, float), np.asarray(dens, float)


def _start_counts(recs: list, label: str):
    """Per start, the [seeds, problems] numerator and denominator arrays of a column (the
    layout of `hier_bootstrap3`), or None when a cell lacks per-problem counts."""
    cnt = [_counts(g, label) for g in cells_by_start(recs).values()]
    if any(c is None for c in cnt):
        return None
    return [c[0] for c in cnt], [c[1] for c in cnt]


def _seed_wilson(recs: list, label: str) -> list:
    """Each seed's Wilson 95% interval: the evaluation's binomial noise alone (the samples of
    one run as the trials; for the wrong-step share, the correct answers)."""
    ev, num, den = EVAL_RATIOS[label]
    out = []
    for r in recs:
        pp = r[ev]["per_problem"]
        k = sum(pp[num])
        n = r[ev]["samples"] if den == "samples" else sum(pp[den])
        out.append(list(wilson(k, n)))
    return out


def cell_value(r: dict, label: str, path: tuple):
    """A run's value of a column; None for a ratio without a denominator: the wrong-step share
    of a run with no correct answer, which the evaluation records as 0 (the bootstrap, the
    noises and the design leave such a run out of that column too)."""
    if label in EVAL_RATIOS:
        ev, _, den = EVAL_RATIOS[label]
        pp = lookup(r, (ev, "per_problem"))
        if den != "samples" and pp and not sum(pp[den]):
            return None
    return lookup(r, path)


def _separated(boot: dict) -> bool:
    return bool(boot["lo"] > 0 or boot["hi"] < 0)


def _noise3_or_nan(num, den, ref_num=None, ref_den=None) -> dict:
    """`noise3` (of the paired difference with `ref_*`), or every component nan where no run
    has the ratio defined (a wrong-step share of runs without a correct answer)."""
    try:
        return noise3(num, den, ref_num, ref_den)
    except ValueError:
        return {"eval_sd": math.nan, "seed_sd": math.nan, "start_sd": math.nan}


def _design(num, den, k: int) -> dict | None:
    """Is the evaluation noise below the seed noise for this column, and how many held-out
    problems (at k' samples each) would make it so (`eval_design`); None where the counts
    cannot say (no defined ratio, or too few runs for a seed spread)."""
    try:
        d = eval_design(num, den, k=k)
    except ValueError:
        return None
    return {"holds": d["holds"], "eval_sd": d["eval_sd"], "seed_sd": d["seed_sd"],
            "problems_needed": {str(kk): n for kk, n in d["problems_needed"].items()}}


def aggregate(results: list, ccfg: CompareConfig) -> list:
    """One row per (method, process reward), over every start and seed: per-cell values, mean
    and intervals per column. An oracle row of a method that reads no step scores is its
    learned row (same run).

    Per evaluation column: `mean`, `lo`/`hi`, the three-level bootstrap's 95% interval of the
    mean over starts of the mean over seeds (starts, then seeds, then problems;
    `hier_bootstrap3`; with one start it is the two-level bootstrap), `per_start` each
    start's mean over its seeds, `ci95` the old t half-width over cells (kept for readers of
    earlier reports), `wilson` every cell's Wilson interval, and `noise` (`noise3`:
    evaluation, seed and start SD of one run's value). `paired`: per column of PAIRED, the
    row's difference from GRPO's run of the same start and seed, per cell, with the paired
    three-level bootstrap's 95% interval over the cells both rows have; `separated` when it
    excludes 0; `by_start`: the same per start (two levels: its seeds, then problems);
    `noise`: the evaluation, seed and start SD of one run's difference."""
    by_key = {}
    for r in results:
        if not r.get("hack"):
            by_key.setdefault((r["method"], r["prm"]), []).append(r)
    keys = list(by_key)
    for m in ccfg.oracle:
        if m not in READS_STEP_SCORES and (m, "oracle") not in by_key:
            src = (m, "implicit" if base_method(m) == "prime" else "learned")
            if src in by_key:
                by_key[(m, "oracle")] = by_key[src]
                keys.append((m, "oracle"))
    ref = {(r.get("start", 0), r["seed"]): r for r in by_key.get((REFERENCE, "learned"), [])}
    rows = []
    for key in keys:
        recs = [r for g in cells_by_start(by_key[key]).values() for r in g]
        row = {"method": key[0], "prm": key[1], "seeds": [r["seed"] for r in recs],
               "starts": [r.get("start", 0) for r in recs],
               "same_run_as_learned": key[1] == "oracle" and key[0] not in READS_STEP_SCORES,
               "variant_of": VARIANTS[key[0]][0] if key[0] in VARIANTS else None,
               "variant_overrides": VARIANTS[key[0]][1] if key[0] in VARIANTS else []}
        row.update(_columns(recs, ccfg))
        both = [r for r in recs if (r.get("start", 0), r["seed"]) in ref]
        if key != (REFERENCE, "learned") and not row["same_run_as_learned"] and both:
            row["paired"] = _paired(both, ref, ccfg.bootstrap_reps)
        row.update(_monitors(recs, key[0]))
        rows.append(row)
    return rows


def _columns(recs: list, ccfg: CompareConfig) -> dict:
    """A row's columns (`aggregate`): label -> per-cell values, mean, t half-width and, for an
    evaluation column with per-problem counts, the bootstrap interval, the per-start means,
    the Wilson intervals, the noise split and the evaluation design."""
    out = {}
    for label, path in COLUMNS:
        vals = [cell_value(r, label, path) for r in recs]
        out[label] = {"per_seed": vals, **mean_ci(vals)}
        cnt = _start_counts(recs, label) if label in EVAL_RATIOS else None
        if cnt is not None:
            boot = hier_bootstrap3(*cnt, reps=ccfg.bootstrap_reps)
            out[label].update(mean=boot["mean"], lo=boot["lo"], hi=boot["hi"],
                              per_start=[float(x) for x in start_values(*cnt)],
                              wilson=_seed_wilson(recs, label), noise=_noise3_or_nan(*cnt),
                              design=_design(*cnt, k=1 if label.startswith("greedy")
                                             else ccfg.sampled_n))
    return out


def _paired(both: list, ref: dict, reps: int) -> dict:
    """A row's paired differences from the reference (`aggregate`): its cells `both` that the
    reference has too (`ref`: (start, seed) -> the reference's cell), per column of PAIRED."""
    out = {"reference": REFERENCE, "seeds": [r["seed"] for r in both],
           "starts": [r.get("start", 0) for r in both]}
    theirs_recs = [ref[(r.get("start", 0), r["seed"])] for r in both]
    for label in PAIRED:
        mine = _start_counts(both, label)
        theirs = _start_counts(theirs_recs, label)
        if mine is None or theirs is None:
            continue
        boot = hier_bootstrap3(*mine, *theirs, reps=reps)
        path = dict(COLUMNS)[label]
        by_start = {}
        for k, (mn, md, tn, td) in zip(cells_by_start(both), zip(*mine, *theirs)):
            b = hier_bootstrap(mn, md, tn, td, reps=reps)
            by_start[str(k)] = {"seeds": int(mn.shape[0]), "mean": b["mean"],
                                "lo": b["lo"], "hi": b["hi"], "separated": _separated(b)}
        pairs = [(cell_value(r, label, path), cell_value(t, label, path))
                 for r, t in zip(both, theirs_recs)]
        out[label] = {
            "per_seed": [None if None in ab else ab[0] - ab[1] for ab in pairs],
            "mean": boot["mean"], "lo": boot["lo"], "hi": boot["hi"],
            "separated": _separated(boot), "by_start": by_start,
            "noise": _noise3_or_nan(*mine, *theirs)}
    return out


def _monitors(recs: list, method: str) -> dict:
    """A row's training monitors (`aggregate`): where its seed-averaged curves flatten, the
    PRM's step AUROC first and last, the final implicit PRMs' judgement and PRIME's implicit
    PRM loss."""
    out = {"plateau": _plateau(_mean_curve(
               [r["curves"].get("reward/outcome_mean", []) for r in recs])),
           "plateau_wrong_step": _plateau(_mean_curve(
               [r["curves"].get("exact/correct_with_wrong_step_frac", []) for r in recs]))}
    for name, k in (("step_auroc", "prm/step_auroc"),
                    ("implicit_step_auroc", "prm/implicit_step_auroc")):
        if any(r["curves"].get(k) for r in recs):
            out[name] = _first_last([_finite(r["curves"].get(k, [])) for r in recs])
    judged = [r["implicit_judged"] for r in recs if r.get("implicit_judged")]
    if judged:  # the final implicit PRM of each run, judged on the judging set
        out["implicit_judged"] = {
            "cells": len(judged),
            **{k: float(np.nanmean([j[k] for j in judged]))
               for k in ("f1", "acc_erroneous", "acc_correct", "step_auroc")}}
    if base_method(method) == "prime":  # the implicit PRM's loss: ln 2 = not learning
        # steps where no row passed the accuracy filter train nothing (loss 0): left out;
        # each run's own first and last 10 trained steps, so a run that trained on few
        # steps (its filter kept no group) does not cut the others' curves short
        out["implicit_prm_loss"] = _first_last([_trained(r["curves"]) for r in recs])
    return out


def _plateau(mean_curve: list, window: int = 10) -> dict:
    """Where a (seed-averaged) training curve flattens: the first step whose trailing
    `window`-step mean has made 90% of the rise from the first window to the last, and the
    slope (per 100 steps) of a least-squares line through the last quarter of the steps."""
    xs = [x for x in mean_curve if x is not None and math.isfinite(x)]
    if len(xs) < 2 * window:
        return {"steps": len(xs), "step90": None, "first": None, "last": None,
                "slope_last_quarter": None}
    trail = [sum(xs[i - window + 1:i + 1]) / window for i in range(window - 1, len(xs))]
    first, last = trail[0], trail[-1]
    rise = last - first
    step90 = (next(i + window - 1 for i, v in enumerate(trail) if v >= first + 0.9 * rise)
              if rise > 0 else None)
    q = xs[-max(len(xs) // 4, 2):]
    mx = (len(q) - 1) / 2
    my = sum(q) / len(q)
    slope = (sum((i - mx) * (y - my) for i, y in enumerate(q))
             / sum((i - mx) ** 2 for i in range(len(q))))
    return {"steps": len(xs), "step90": step90, "first": first, "last": last,
            "slope_last_quarter": 100 * slope}


def evaluation_sizes(rows: list, results: list) -> dict | None:
    """The evaluation size to choose next (`cheapest_evaluation`): the fewest decoded
    sequences that put the evaluation SD below the seed SD in the most columns, for an
    evaluation costing at most what the cell's RL costs (the cap: the cells' median RL
    seconds over their median seconds per evaluated sequence). None without a noise split."""
    greedy, sampled = [], []
    for r in rows:
        if r["same_run_as_learned"]:
            continue
        for label in EVAL_RATIOS:
            design = r.get(label, {}).get("design")
            if design is not None and label != "greedy fully correct":
                (greedy if label.startswith("greedy") else sampled).append(
                    design["problems_needed"])
    cells = [c for c in results if not c.get("hack") and c.get("eval_s")]
    if not greedy or not cells:
        return None
    seq_s = float(np.median([c["eval_s"] / (c["greedy"]["samples"] + c["sampled"]["samples"])
                             for c in cells]))
    rl_s = float(np.median([c["rl_s"] for c in cells]))
    cap = int(rl_s / seq_s)
    return {"max_sequences": cap, "rl_s": rl_s, "seconds_per_sequence": seq_s,
            "sizes": cheapest_evaluation(greedy, sampled, max_sequences=cap)}


def cells_to_go_s(done: list, todo: list) -> float | None:
    """Seconds the cells in `todo` (RunSpecs) would take at the recorded cost (RL + evaluation
    seconds) of the finished cells in `done` of the same kind (method, process reward, hack),
    the median over those; of every finished cell for a kind none has finished yet. None
    before any finished cell has a recorded cost. Cells of `todo` already finished on disk
    would cost nothing: a resumed run's estimate is an upper bound until it passes them."""
    cost: dict = {}
    for r in done:
        if r.get("rl_s") is not None:
            kind = (r["method"], r["prm"], bool(r.get("hack")))
            cost.setdefault(kind, []).append(r["rl_s"] + (r.get("eval_s") or 0.0))
    if not cost:
        return None
    every = statistics.median(x for xs in cost.values() for x in xs)
    return sum(statistics.median(cost.get((s.method, s.prm, s.hack), [every])) for s in todo)


def _first_last(series: list, n: int = 10) -> dict:
    """Mean over the runs of each run's first and last `n` defined values of a per-step
    monitor that is undefined at some steps (a step AUROC: no right or no wrong step among the
    rows scored), and how many steps each run had it defined."""
    runs = [xs for xs in series if xs]
    if not runs:
        return {"first": None, "last": None, "defined_steps": []}
    return {"first": sum(sum(x[:n]) / len(x[:n]) for x in runs) / len(runs),
            "last": sum(sum(x[-n:]) / len(x[-n:]) for x in runs) / len(runs),
            "defined_steps": [len(x) for x in series]}


def _finite(xs: list) -> list:
    return [x for x in xs if x is not None and math.isfinite(x)]


def _trained(curves: dict) -> list:
    """The implicit PRM's loss at the steps where it trained on some row."""
    loss, rows = curves.get("prm/loss", []), curves.get("prm/trained_rows")
    if rows is None:
        return _finite(loss)
    return [x for x, n in zip(loss, rows) if n and x is not None and math.isfinite(x)]


def _mean_curve(series: list) -> list:
    series = [s for s in series if s]
    if not series:
        return []
    steps = min(map(len, series))
    return [sum((s[i] or 0.0) for s in series) / len(series) for i in range(steps)]


def response_tokens(results: list) -> dict | None:
    """The training responses' mean length (tokens) over the cells: first and last 5 steps."""
    curves = [r["curves"].get("response/length_mean") for r in results if not r.get("hack")]
    curves = [[x for x in c if x is not None] for c in curves if c]
    if not curves:
        return None
    return {"first5": sum(sum(c[:5]) / len(c[:5]) for c in curves) / len(curves),
            "last5": sum(sum(c[-5:]) / len(c[-5:]) for c in curves) / len(curves)}
