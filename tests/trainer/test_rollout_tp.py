"""Separate placement with engines of several ranks (`rollout.tp`, rollout/remote.py "Engines"):
1 trainer rank + 2 rollout ranks at rollout.tp=2 (one vLLM engine of two workers, vLLM being the
recording stand-in tests/rollout/fake_vllm.py on gloo) against 1 trainer + 1 rollout rank at
rollout.tp=1. Both workers of the engine are built as vLLM's external_launcher wants (the rollout
ranks' own default group, RANK their place in it, tensor_parallel_size=2), receive the same orders
and the whole weight stream (bytes and digest equal to what trainer rank 0 sent, every version),
draw alike, and only the leader replies; the trainer logs the same metrics as with one tp-1
engine, step by step, the held-out evaluation included."""
import hashlib

import pytest
import torch

from megaprm.parallel import launch
from tests.rl_setup import rl_config

PER_RANK = ("timing/", "throughput/", "weight_sync/")  # wall-clock: differs between runs
BASE = ["rollout.engine=vllm", "rollout.max_tokens=12", "actor.micro_batch_size=8",
        "trainer.save_every=0", "trainer.steps=2", "trainer.eval_every=2",
        "trainer.eval_problems=4", "actor.entropy_coef=0.01", "rollout.placement=separate"]


def _digest(pairs) -> tuple:
    """(bytes, sha256) of a stream of (name, tensor): names, dtypes, shapes and raw bytes."""
    h, n = hashlib.sha256(), 0
    for name, t in pairs:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
        h.update(raw.numpy().tobytes())
        n += raw.numel()
    return n, h.hexdigest()


def _run(run_dir, policy, prm, extra):
    """One rank of the launch, as `megaprm train` runs it, with the transport watched: what each
    rollout rank receives (orders, weight bytes) and sends, what trainer rank 0 sends."""
    from tests.rollout import fake_vllm

    from megaprm.parallel.init import init_distributed
    from megaprm.rollout import remote
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl import rollout_source
    from megaprm.trainer.rl.loop import RLTrainer

    fake_vllm.install()  # this rank's `import vllm`
    cfg = rl_config(run_dir, policy, prm, "grpo", [*BASE, *extra])
    tok = build_char_tokenizer()
    placement = remote.split_world(cfg)
    seen = {"orders": [], "weights": [], "sent": []}
    recv, send = remote.recv, remote.send

    def recv_(p, src, tag):
        msg = recv(p, src, tag)
        if tag == remote.CTRL:
            seen["orders"].append(msg)
        return msg

    def send_(p, obj, dst, tag, wait=True):
        seen["sent"].append((tag, dst))
        return send(p, obj, dst, tag, wait)

    remote.recv, remote.send = recv_, send_
    if placement.is_rollout:
        receive = remote.WeightReceiver.receive

        def receive_(self, plan=None):
            got = []
            for name, t in receive(self, plan):
                got.append((name, t.clone()))
                yield name, t
            seen["weights"].append(_digest(got))

        remote.WeightReceiver.receive = receive_
        seen["drawn"] = rollout_source.serve(cfg, placement, tok)
        llm = fake_vllm.LLM.instances[-1]
        seen["llm"] = {"kwargs": llm.kwargs, "tp_group": llm.tp_group, "world": llm.world,
                       "in_default_group": llm.in_default_group,
                       "local_rank": llm.local_rank, "calls": fake_vllm.call_names(llm.log),
                       "weights": _digest(llm.model.hf.named_parameters())}
        return seen
    send_weights = remote.WeightSender.send

    def send_weights_(self, version, buckets):
        buckets = [list(b) for b in buckets]
        seen["weights"].append(_digest(x for b in buckets for x in b))
        return send_weights(self, version, buckets)

    remote.WeightSender.send = send_weights_
    seen["history"] = RLTrainer(cfg, init_distributed(), tok).fit()
    return seen


def _same(a: dict, b: dict) -> None:
    for k, v in a.items():
        if not k.startswith(PER_RANK):
            assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_engine_of_two_ranks_gets_the_same_orders_and_weights_and_equals_tp1(tiny_models, tmp_path):
    policy, prm = tiny_models
    one = launch.spawn(_run, 2, str(tmp_path / "tp1"), policy, prm, ["rollout.ranks=1"])
    two = launch.spawn(_run, 3, str(tmp_path / "tp2"), policy, prm,
                       ["rollout.ranks=2", "rollout.tp=2"])
    trainer, leader, follower = two
    # vLLM's SPMD layout: one engine of two workers over the rollout ranks' own default group,
    # each on its launch rank's device (LOCAL_RANK), told its rank in that group (RANK)
    for launch_rank, r in ((1, leader), (2, follower)):
        kw = r["llm"]["kwargs"]
        assert kw["distributed_executor_backend"] == "external_launcher"
        assert kw["tensor_parallel_size"] == 2 and kw["seed"] == one[1]["llm"]["kwargs"]["seed"]
        assert r["llm"]["in_default_group"] and r["llm"]["world"] == 2
        assert r["llm"]["tp_group"] == [0, 1]
        assert r["llm"]["local_rank"] == launch_rank
    assert one[1]["llm"]["kwargs"]["distributed_executor_backend"] == "external_launcher"
    # both workers: the same orders, in the same order (weights, blocks with their prompts and
    # sampling seeds, the evaluation, stop), the same engine calls, the same final weights
    assert leader["orders"] == follower["orders"] and len(leader["orders"]) >= 6
    assert [o[0] for o in leader["orders"]] == [o[0] for o in one[1]["orders"]]
    assert leader["llm"]["calls"] == follower["llm"]["calls"]
    assert leader["llm"]["weights"] == follower["llm"]["weights"]
    assert leader["drawn"] == follower["drawn"] == one[1]["drawn"] == 2
    # every rank of the engine took every weight version whole: bytes and digest as sent
    sent = trainer["weights"]  # the first weights, then one version after each step
    assert len(sent) == 3 and all(n > 0 for n, _ in sent)
    assert leader["weights"] == follower["weights"] == sent == one[0]["weights"]
    # only the leader replies: a batch per drawn block to the trainer, and the evaluation
    from megaprm.rollout import remote

    assert sorted(leader["sent"]) == [(remote.DATA, 0)] * 2 + [(remote.EVAL, 0)]
    assert follower["sent"] == []
    # trainer rank 0 sent each order to both ranks of the engine
    ctrl = [dst for tag, dst in trainer["sent"] if tag == remote.CTRL]
    assert ctrl.count(1) == ctrl.count(2) == len(leader["orders"])
    # the step: the same as one tp-1 engine, every metric of every step, the evaluation included
    assert len(trainer["history"]) == len(one[0]["history"]) == 2
    assert "eval/accuracy" in trainer["history"][-1]
    for a, b in zip(one[0]["history"], trainer["history"]):
        _same(a, b)
