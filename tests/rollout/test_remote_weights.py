"""The separate placement's weight transfer (rollout/remote.py: WeightSender -> WeightReceiver over
the weights group that split_world builds; gloo, 2 processes): the rollout side receives the
trainer's bucketed stream bit for bit (mixed dtypes and shapes, a strided tensor, NaN/inf bit
patterns, an empty tensor), the bucket plan travels only when it changes, and the trainer side
returns before a busy receiver has even posted its side, waiting only when more versions than
allowed are outstanding; the versions in flight wait in host memory (a thread streams them)."""
import os
import time
from types import SimpleNamespace

import torch

from megaprm.parallel import launch

SPECS = [("embed.weight", (7, 3), torch.float32), ("norm.bias", (), torch.float64),
         ("proj.weight", (5, 2), torch.bfloat16), ("gate.weight", (3, 4), torch.float16),
         ("idx", (9,), torch.int64), ("mask", (2, 3), torch.bool),
         ("empty", (0,), torch.float32), ("odd", (13,), torch.int8)]


def _stream(version: int) -> list:
    """Version `version` of a model: buckets of (name, tensor), random bytes of every dtype
    (any bit pattern: NaN, inf, denormals), one tensor strided (a transpose); version 2 drops a
    tensor and reshapes another, so its plan differs."""
    g = torch.Generator().manual_seed(version)
    specs = SPECS if version < 2 else [(n, (3, 7) if n == "embed.weight" else s, d)
                                       for n, s, d in SPECS if n != "idx"]
    out = []
    for name, shape, dtype in specs:
        numel = 1
        for d in shape:
            numel *= d
        if dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=g).bool()
        else:
            raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
            t = raw.view(dtype).view(shape)
        out.append((name, t))
    out.append(("lm_head.weight", torch.randn(6, 4, generator=g).t()))  # not contiguous
    return [out[:3], out[3:5], out[5:]]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _rank():
    from megaprm.rollout import remote

    cfg = SimpleNamespace(rollout=SimpleNamespace(placement="separate", ranks=1, tp=1))
    p = remote.split_world(cfg, timeout_minutes=2)
    if not p.is_rollout:
        sender = remote.WeightSender(p, in_flight=2)
        returned, done = [], []
        for v in range(3):
            sender.send(v, _stream(v))
            # had the receiver posted before this call returned? (it sleeps 2 s first)
            returned.append(p.store.check(["test/posted"]))
            done.append(sender.outstanding[-1][0].is_set())
            # the version waits in host memory: nothing of it on the weights group's device
            # but the two staging buffers (CUDA), none on the CPU
            assert all(b.device.type == "cpu" for _, bufs in sender.outstanding for b in bufs)
            assert len(sender.staging) in (0, 2)
        sender.drain()
        assert not sender.outstanding
        return {"posted_before_return": returned, "any_done_at_return": done[:2]}
    time.sleep(2.0)  # busy drawing
    p.store.set("test/posted", "1")
    receiver = remote.WeightReceiver(p)
    got = []
    for v in range(3):
        kind, version, plan = remote.recv(p, 0, remote.CTRL)
        assert (kind, version) == ("weights", v)
        # the engine copies each tensor before asking for the next (the views are reused)
        received = [(n, t.clone()) for n, t in receiver.receive(plan)]
        expected = [x for bucket in _stream(v) for x in bucket]
        assert [n for n, _ in received] == [n for n, _ in expected]
        for (name, a), (_, b) in zip(received, expected):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(_bits(a), _bits(b)), name
        got.append(plan is None)
    return {"plan_omitted": got}


def test_weights_arrive_bit_for_bit_and_the_sender_does_not_wait_for_a_busy_receiver():
    trainer, rollout = launch.spawn(_rank, 2, timeout_s=120)
    # the plan rides with the first version and when it changes (version 2), not otherwise
    assert rollout == {"plan_omitted": [False, True, False]}
    # versions 0 and 1 were issued (and returned) before the receiver posted anything; version
    # 2 exceeded the 2 versions allowed in flight, so its call waited for the receiver
    assert trainer["posted_before_return"] == [False, False, True]
    assert trainer["any_done_at_return"] == [False, False]


def test_engines_are_vllms_tp_groups_over_the_rollout_ranks(monkeypatch):
    """rollout.tp = tp: the engines are vLLM's external_launcher tp groups over the rollout ranks'
    own default group (`initialize_model_parallel`: ranks reshape(-1, dp, pp, pcp, tp), dp = pp =
    pcp = 1), in launch ranks; the first rank of each replies. While an engine is built, RANK and
    WORLD_SIZE are the rank's place among the rollout ranks, and the launch's afterwards."""
    from megaprm.rollout.remote import Placement

    for trainers, ranks, tp in ((1, 2, 2), (3, 8, 4), (2, 6, 3), (4, 4, 1)):
        world = trainers + ranks
        vllm_groups = (torch.arange(ranks).reshape(-1, 1, 1, 1, tp).view(-1, tp) + trainers)
        for rank in range(trainers, world):
            p = Placement(rank, world, trainers, list(range(trainers, world)), tp=tp)
            assert p.engines == vllm_groups.tolist()
            assert p.leaders == vllm_groups[:, 0].tolist()
            assert p.is_leader == ((rank - trainers) % tp == 0)
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setenv("WORLD_SIZE", str(world))
            with p.engine_env():
                assert (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) == (
                    rank - trainers, ranks)
            assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == (str(rank), str(world))
