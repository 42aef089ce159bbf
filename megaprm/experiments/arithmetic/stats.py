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

A cell's statistic is a ratio of sums over problems: accuracy = sum(correct) / sum(samples),
"correct with a wrong step" = sum(wrong-step) / sum(correct); per seed, then averaged over seeds
(every seed weighs the same). Percentiles of ratios in [0, 1] stay in [0, 1].
"""
from __future__ import annotations

import math

import numpy as np

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


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """sum(num) / sum(den) over the last axis; nan where the denominator is 0."""
    n, d = num.sum(-1), den.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(d > 0, n / np.where(d > 0, d, 1), np.nan)


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
