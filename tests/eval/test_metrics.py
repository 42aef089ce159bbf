"""eval/run.py metrics: unbiased pass@k against brute-force subset enumeration; avg@k."""
import itertools
import random
from math import comb

import pytest

from eval.run import pass_at_k, summarize


def brute_pass_at_k(outcomes, k):
    """Fraction of the k-subsets of the n samples that hold at least one correct sample."""
    subsets = list(itertools.combinations(range(len(outcomes)), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("seed", range(20))
def test_pass_at_k_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 10)
    outcomes = [rng.random() < rng.random() for _ in range(n)]
    for k in range(1, n + 1):
        got = pass_at_k(n, sum(outcomes), k)
        assert got == pytest.approx(brute_pass_at_k(outcomes, k), abs=1e-12)
        assert got == pytest.approx(1 - comb(n - sum(outcomes), k) / comb(n, k), abs=1e-12)


def test_pass_at_k_edges():
    assert pass_at_k(16, 0, 16) == 0.0
    assert pass_at_k(16, 1, 16) == 1.0  # n = k: pass@k is "any sample correct"
    assert pass_at_k(16, 16, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)


def test_summarize_avg_and_pass():
    correct = [[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    s = summarize(correct, k=4)
    assert s["avg@k"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert s["pass@k"] == pytest.approx(2 / 3)
