"""Group-wise reductions: single-process vs Python loops, and multi-rank (gloo) vs single-process."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from megaprm.parallel import reductions as R
from tests.distributed_utils import DistributedTestError, run_distributed


def _random_ids(gen: torch.Generator, b: int, n_groups: int) -> torch.Tensor:
    """Non-contiguous, large, shuffled group ids."""
    pool = torch.randperm(10_000, generator=gen)[:n_groups] * 1_000_003
    return pool[torch.randint(0, n_groups, (b,), generator=gen)]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(0, 40), n_groups=st.integers(1, 8),
       k=st.integers(1, 3))
def test_group_sums_and_moments_match_loops(seed, b, n_groups, k):
    gen = torch.Generator().manual_seed(seed)
    ids = _random_ids(gen, b, n_groups)
    x = torch.randn(b, k, generator=gen) * 10
    mask = torch.rand(b, k, generator=gen) > 0.3
    index = R.group_index(ids)
    assert set(index.ids()[index.dense].tolist()) == set(ids.tolist())
    table = R.group_sums(x, index)
    mom = R.group_moments(x, index, mask)
    for g, gid in enumerate(index.ids().tolist()):
        rows = [i for i in range(b) if ids[i] == gid]
        for c in range(k):
            assert math.isclose(table[g, c].item(), sum(x[i, c].item() for i in rows), abs_tol=1e-9)
            vals = [x[i, c].item() for i in rows if mask[i, c]]
            assert mom.count[g, c].item() == len(vals)
            mean = sum(vals) / len(vals) if vals else 0.0
            assert math.isclose(mom.mean[g, c].item(), mean, abs_tol=1e-9)
            m2 = sum((v - mean) ** 2 for v in vals)
            assert math.isclose(mom.m2[g, c].item(), m2, rel_tol=1e-9, abs_tol=1e-9)


def test_small_id_range_uses_ids_as_rows():
    ids = torch.tensor([5, 2, 5, 0])
    index = R.group_index(ids)
    assert index.num_groups == 6 and torch.equal(index.dense, ids)
    table = R.group_sums(torch.ones(4, 1), index)
    assert table[:, 0].tolist() == [1, 0, 1, 0, 0, 2]


def test_zero_variance_group_is_exactly_zero_for_large_values():
    x = torch.full((8, 1), 12345.678, dtype=torch.float32)
    mom = R.group_moments(x, R.group_index(torch.zeros(8, dtype=torch.long)))
    assert mom.m2.item() == 0.0


def test_single_process_issues_no_collectives():
    with R.count_collectives() as c:
        index = R.group_index(torch.tensor([3, 1, 3]))
        R.group_sums(torch.ones(3, 2), index)
        R.all_reduce(torch.ones(1), "max", None)
    assert c.n == 0


@pytest.mark.parametrize("ids, match", [
    (torch.tensor([0, -1, 2]), "negative id"),
    (torch.tensor([0.0, 1.0]), "dtype"),
    (torch.tensor([[0, 1]]), "1-D"),
    ([0, 1], "torch.Tensor"),
])
def test_group_ids_validation(ids, match):
    with pytest.raises(ValueError, match=match):
        R.group_index(ids)


def test_length_mismatch_names_argument():
    with pytest.raises(ValueError, match="group_ids has 3 entries but the batch has 4"):
        R.group_index(torch.tensor([0, 1, 2]), batch_size=4)


def test_bad_op():
    with pytest.raises(ValueError, match="op='mean'"):
        R.all_reduce(torch.ones(1), "mean")


# --------------------------------------------------------------------------- multi-rank

def _layout(seed: int, b: int, world: int) -> list[torch.Tensor]:
    """Random split of a random permutation of 0..b-1 over `world` ranks (some may be empty)."""
    gen = torch.Generator().manual_seed(seed + 7)
    perm = torch.randperm(b, generator=gen)
    cuts = sorted(torch.randint(0, b + 1, (world - 1,), generator=gen).tolist())
    bounds = [0] + cuts + [b]
    return [perm[bounds[r]:bounds[r + 1]] for r in range(world)]


def _reductions_world(rank: int, world: int) -> dict:
    out = {"tables": [], "moments": [], "gathers": [], "counts": {}}
    g = dist.group.WORLD
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        b = 30 + 7 * seed
        ids = _random_ids(gen, b, 6)
        x = torch.randn(b, 3, generator=gen)
        mine = _layout(seed, b, world)[rank]
        index = R.group_index(ids[mine], g)
        out["tables"].append((index.ids(), R.group_sums(x[mine], index)))
        mom = R.group_moments(x[mine], index)
        out["moments"].append((mom.count, mom.mean, mom.m2))
        rows = R.gather_samples(x[mine, :1], index)
        out["gathers"].append((rows.values, rows.rank, rows.local, rows.mine, mine))
    for n_groups in (4, 400):
        ids = torch.arange(n_groups).repeat_interleave(4)
        mine = _layout(1, ids.shape[0], world)[rank]
        with R.count_collectives() as c:
            index = R.group_index(ids[mine], g)
            R.group_sums(torch.ones(mine.shape[0], 2), index)
            R.group_moments(torch.ones(mine.shape[0], 1), index)
            R.gather_samples(torch.ones(mine.shape[0], 1), index)
        out["counts"][n_groups] = c.n
    return out


def _raise_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise KeyError("boom from rank one")
    return rank


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_reductions_equal_single_process(world):
    results = run_distributed(_reductions_world, world)
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        b = 30 + 7 * seed
        ids = _random_ids(gen, b, 6)
        x = torch.randn(b, 3, generator=gen)
        index = R.group_index(ids)  # ids span a large range: rows = sorted present ids
        assert torch.equal(index.ids(), torch.unique(ids))
        ref = R.group_sums(x, index)
        ref_m = R.group_moments(x, index)
        for r in range(world):
            got_ids, table = results[r]["tables"][seed]
            assert torch.equal(got_ids, index.ids())
            torch.testing.assert_close(table, ref, rtol=0, atol=1e-9)
            for a, e in zip(results[r]["moments"][seed], (ref_m.count, ref_m.mean, ref_m.m2)):
                torch.testing.assert_close(a, e, rtol=0, atol=1e-9)
            values, rank, local, mine_rows, mine = results[r]["gathers"][seed]
            # global order is (group, rank, local index); this rank's rows point back to its samples
            assert values.shape[0] == b
            layout = _layout(seed, b, world)
            order = [int(layout[rk][lc]) for rk, lc in zip(rank.tolist(), local.tolist())]
            keys = [(int(index.dense[i]), rk, lc) for i, rk, lc in zip(order, rank.tolist(), local.tolist())]
            assert keys == sorted(keys)
            torch.testing.assert_close(values[:, 0], x[order, 0].double())
            assert [order[i] for i in mine_rows.tolist()] == mine.tolist()
    for r in range(world):
        assert results[r]["counts"][4] == results[r]["counts"][400] == 2 + 1 + 2 + 2


def test_run_distributed_propagates_rank_traceback():
    with pytest.raises(DistributedTestError, match="boom from rank one") as err:
        run_distributed(_raise_on_rank_one, 2)
    assert "Traceback" in str(err.value) and "rank 1 raised" in str(err.value)
