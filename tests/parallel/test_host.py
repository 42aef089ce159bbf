"""Host-side metric reduction (`host.dp_metrics`) on gloo ranks against plain Python over every
rank's values."""
from __future__ import annotations

import types

import pytest
import torch.distributed as dist

from megaprm.parallel import host
from tests.distributed_utils import run_distributed


def _values(rank: int) -> dict:
    """Rank-local metrics whose extrema sit on different ranks (and one negative maximum)."""
    return {"reward/mean": 0.25 * rank + 0.1, "response/length_max": [48, 7, 30][rank],
            "response/length_min": [3, 9, 1][rank], "adv/abs_max": [-2.0, -0.5, -1.0][rank],
            "timing/step_s": 1.0 + rank}


def _metrics_world(rank: int, world: int) -> dict:
    groups = types.SimpleNamespace(dp_size=world, dp_rank=rank, host_dp=dist.group.WORLD)
    calls, real = [], dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        out = host.dp_metrics(_values(rank), groups)
    finally:
        dist.all_reduce = real
    return {"metrics": out, "collectives": len(calls)}


def test_dp_metrics_takes_maxima_minima_and_means_in_one_all_reduce():
    world = 3
    results = run_distributed(_metrics_world, world)
    ranks = [_values(r) for r in range(world)]
    want = {k: (max(v[k] for v in ranks) if k.endswith("_max") else
                min(v[k] for v in ranks) if k.endswith("_min") else
                sum(v[k] for v in ranks) / world) for k in ranks[0]}
    for r in results:
        assert r["collectives"] == 1
        assert r["metrics"].keys() == want.keys()
        for k, v in want.items():
            assert r["metrics"][k] == pytest.approx(v, rel=1e-12), k


def test_dp_metrics_single_rank_is_the_identity():
    groups = types.SimpleNamespace(dp_size=1, dp_rank=0, host_dp=None)
    assert host.dp_metrics(_values(1), groups) == _values(1)
    assert host.dp_metrics({}, groups) == {}


def _failures_world(rank: int, world: int) -> dict:
    """Rounds of all_failures on the default gloo group: none fail, the middle rank fails, every
    odd rank fails (with any picklable value); and how many collectives the quiet round took."""
    calls, real = [], dist.all_gather_object
    dist.all_gather_object = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        quiet = host.all_failures(None, dist.group.WORLD, world)
        quiet_gathers = len(calls)
        middle = host.all_failures("disk full" if rank == 1 else None, dist.group.WORLD, world)
        odd = host.all_failures((rank, "nan") if rank % 2 else None, dist.group.WORLD, world)

        def step():
            if rank == 2:
                raise ValueError("rank 2's step")
            return rank * 10

        ran = host.run_agreed(step, lambda: (dist.group.WORLD, world), str)
    finally:
        dist.all_gather_object = real
    return {"quiet": quiet, "quiet_gathers": quiet_gathers, "middle": middle, "odd": odd,
            "ran": ran}


def test_all_failures_gives_every_rank_the_same_list():
    results = run_distributed(_failures_world, 3)
    for r in results:
        assert r["quiet"] == [] and r["quiet_gathers"] == 0  # the common path: one all-reduce
        assert r["middle"] == [(1, "disk full")]
        assert r["odd"] == [(1, (1, "nan"))]
    assert [r["ran"] for r in results] == [(0, [(2, "rank 2's step")]),
                                           (10, [(2, "rank 2's step")]),
                                           (None, [(2, "rank 2's step")])]


def test_all_failures_single_rank_needs_no_group():
    assert host.all_failures(None, None, 1) == []
    assert host.all_failures("bad", None, 1) == [(0, "bad")]
