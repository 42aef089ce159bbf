"""PROF consistency filter and PRIME accuracy filter vs loop references (single process)."""
from __future__ import annotations

import pytest
import torch
from advantage_reference import random_batch, ref_accuracy, ref_prof
from hypothesis import given, settings
from hypothesis import strategies as st

from megaprm.algorithms import filters as F

SEEDS = st.integers(0, 2**31 - 1)


@pytest.mark.parametrize("n_correct, kept", [
    (0, (0, 4)), (1, (1, 3)), (2, (2, 2)), (3, (2, 2)), (4, (2, 2)), (5, (2, 2)), (6, (2, 2)),
    (7, (3, 1)), (8, (4, 0)),
])
@pytest.mark.parametrize("mode", ["both", "correct"])
def test_prof_keep_table_n8_remove4(n_correct, kept, mode):
    """§3.3: n = 8, remove k = 4 -> kept (correct, incorrect)."""
    o = torch.tensor([1.0] * n_correct + [0.0] * (8 - n_correct))
    p = torch.rand(8, generator=torch.Generator().manual_seed(n_correct))
    keep = F.prof(o, p, torch.zeros(8, dtype=torch.long), remove=4, mode=mode,
                  generator=torch.Generator().manual_seed(0))
    assert (int(keep[o == 1].sum()), int(keep[o == 0].sum())) == kept


def test_prof_removes_low_prm_correct_and_high_prm_incorrect():
    o = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    p = torch.tensor([0.9, 0.1, 0.5, 0.3, 0.9, 0.1, 0.5, 0.3])
    keep = F.prof(o, p, torch.zeros(8, dtype=torch.long), remove=4)
    assert keep.tolist() == [True, False, True, False, False, True, False, True]


def test_prof_ties_remove_earlier_sample_first():
    o = torch.ones(4)
    keep = F.prof(o, torch.full((4,), 0.5), torch.zeros(4, dtype=torch.long), remove=2)
    assert keep.tolist() == [False, False, True, True]


def test_prof_length_penalty_removes_out_of_range_first():
    o = torch.ones(4)
    p = torch.tensor([0.9, 0.1, 0.2, 0.3])
    steps = torch.tensor([1, 5, 5, 31])  # sample 0 (< 2 steps) and 3 (> 30) go first
    keep = F.prof(o, p, torch.zeros(4, dtype=torch.long), remove=2, num_steps=steps)
    assert keep.tolist() == [False, True, True, False]


@settings(max_examples=40, deadline=None)
@given(seed=SEEDS, remove=st.integers(0, 5), mode=st.sampled_from(["both", "no_separation"]),
       with_steps=st.booleans())
def test_prof_matches_loop(seed, remove, mode, with_steps):
    b = random_batch(seed, n_groups=6, max_size=9)
    steps = b.num_steps if with_steps else None
    keep = F.prof(b.outcome, b.process, b.group_ids, remove=remove, mode=mode, num_steps=steps)
    assert keep.tolist() == ref_prof(b.outcome, b.process, b.group_ids, remove, mode, steps)


@settings(max_examples=25, deadline=None)
@given(seed=SEEDS, remove=st.integers(0, 5))
def test_prof_correct_mode_same_counts_random_incorrect(seed, remove):
    b = random_batch(seed, n_groups=6, max_size=9)
    both = F.prof(b.outcome, b.process, b.group_ids, remove=remove)
    rand = F.prof(b.outcome, b.process, b.group_ids, remove=remove, mode="correct",
                  generator=torch.Generator().manual_seed(seed))
    again = F.prof(b.outcome, b.process, b.group_ids, remove=remove, mode="correct",
                   generator=torch.Generator().manual_seed(seed))
    assert torch.equal(rand, again)
    correct = b.outcome == 1
    assert torch.equal(rand[correct], both[correct])  # correct side ranked by PRM as in "both"
    for g in b.group_ids.unique():
        m = (b.group_ids == g) & ~correct
        assert int(rand[m].sum()) == int(both[m].sum())


def test_prof_validation():
    o, g = torch.ones(4), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="generator"):
        F.prof(o, o, g, remove=2, mode="correct")
    with pytest.raises(ValueError, match="remove=-1"):
        F.prof(o, o, g, remove=-1)
    with pytest.raises(ValueError, match="mode='x'"):
        F.prof(o, o, g, remove=1, mode="x")
    with pytest.raises(ValueError, match="process contains 1 NaN"):
        F.prof(o, torch.tensor([0.0, float("nan"), 0.0, 0.0]), g, remove=1)


@settings(max_examples=30, deadline=None)
@given(seed=SEEDS, bounds=st.sampled_from([(0.2, 0.8), (0.0, 1.0), (0.25, 0.75), (0.5, 0.5)]))
def test_accuracy_matches_loop(seed, bounds):
    b = random_batch(seed, max_size=10)
    keep = F.accuracy(b.outcome, b.group_ids, low=bounds[0], high=bounds[1])
    assert keep.tolist() == ref_accuracy(b.outcome, b.group_ids, *bounds)


def test_accuracy_bounds_inclusive():
    o = torch.tensor([1.0, 0, 0, 0, 0] + [1.0, 1, 1, 1, 0] + [1.0] * 5)
    g = torch.arange(3).repeat_interleave(5)
    assert F.accuracy(o, g).tolist() == [True] * 10 + [False] * 5


def _released_critic_f32(o, scores, mask, num_steps, len_penalty=10.0):
    """prof_ray_trainer.py:1377-1432 and :1450 transcribed with numpy float32: per step
    ((s - mu) * 2) * (2o - 1), summed over valid steps, / max(H, 1); then the length penalty."""
    import numpy as np

    s = scores.numpy().astype(np.float32)
    m = mask.numpy()
    mu = np.float32(s[m].astype(np.float64).sum() / m.sum())
    out = []
    for i in range(s.shape[0]):
        sign = np.float32(2 * float(o[i]) - 1)
        total = np.float32(0)
        for h in range(s.shape[1]):
            if m[i, h]:
                total = np.float32(total + np.float32((s[i, h] - mu) * np.float32(2)) * sign)
        h_i = int(m[i].sum())
        c = np.float32(total / np.float32(max(h_i, 1))) if h_i else np.float32(0)
        if num_steps[i] < 2 or num_steps[i] > 30:
            c = np.float32(c - np.float32(len_penalty))
        out.append(float(c))
    return out


def test_prof_released_precision_decides_ties_as_released():
    """advantage.prof.precision=released: the critic in float32 per step. Samples 0 and 2 tie
    in exact arithmetic (mean step score 423/997); float64 and the release's float32 round the
    tie differently, so they remove different samples."""
    q = torch.tensor([[247, 39, 983, 0], [580, 151, 843, 900], [325, 521, 0, 0],
                      [716, 741, 743, 830]], dtype=torch.float32) / 997
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]]).bool()
    o, gids, steps = torch.ones(4), torch.zeros(4, dtype=torch.long), mask.sum(1)
    p = (q * mask).sum(1) / mask.sum(1)
    critic = F.consistency_scores_released(o, q, mask, steps, len_penalty=10.0, min_steps=2,
                                           max_steps=30, group=None)
    assert critic.tolist() == _released_critic_f32(o, q, mask, steps)
    released = F.prof(o, p, gids, remove=1, num_steps=steps, released_steps=(q, mask))
    exact = F.prof(o, p, gids, remove=1, num_steps=steps)
    lowest = min(range(4), key=lambda i: critic[i].item())  # Python's stable sort, as released
    assert released.tolist() == [i != lowest for i in range(4)]
    assert not torch.equal(released, exact)


@settings(max_examples=20, deadline=None)
@given(seed=SEEDS)
def test_prof_released_critic_matches_transcription(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.3
    o = (torch.rand(6, generator=g) > 0.5).float()
    steps = mask.sum(1)
    critic = F.consistency_scores_released(o, q, mask, steps, len_penalty=10.0, min_steps=2,
                                           max_steps=30, group=None)
    # float32 throughout; the order of the per-row sum (torch's vectorised reduction, as in
    # the release, vs this loop) may move the last bit
    assert critic.tolist() == pytest.approx(_released_critic_f32(o, q, mask, steps), rel=1e-6,
                                            abs=5e-7)
