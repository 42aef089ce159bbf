"""One RL step at tp2 and at pp2 equals the same step at world size 1, for a method with a
discriminative PRM (PURE) and PRIME (implicit PRM, trained in the step).

Why they can be equal: the sampling seed of a prompt block is fixed by (trainer seed, block,
dp rank) and both layouts have dp = 1, so every layout draws the same rollouts from the same
initial weights; rewards, filters and advantages are then the same numbers, and only the
sharded matmuls' summation order differs. Compared: every metric of the step (wall-clock ones
aside) and each tensor's update (the engine's full HF tensors after the step's sync minus before,
on every rank), within `TOL` (fp32, TF32 off). dp2's step draws other samples on its second
rank, so its reference is the single-batch one of tests/trainer/test_loop.py::
test_update_metrics_equal_a_single_batch_reference[2ranks-*] and tests/algorithms/
test_distributed.py (estimators, any placement). A tp2 run's checkpoint, exported, loads in
transformers on the device with the weights the run trained. ~1 min on two cores.

The same test is the GPU session's multi-rank check: with MEGAPRM_RANKS_SHARE_DEVICE=1 on a
one-GPU machine its ranks all run on cuda:0 over gloo (scripts/gpu_session.sh)."""
import os

import pytest
import torch

from megaprm.parallel import launch
from tests.rl_setup import rl_config

METHODS = ("pure", "prime")
EXTRA = ["rollout.max_tokens=12", "actor.micro_batch_size=4", "model.dtype=fp32"]
# PRIME: every group kept (the tiny random policy solves nothing, and the accuracy filter,
# 0.2..0.8, would drop them all) and two steps: at step 0 the implicit PRM equals its reference,
# so its process rewards (and with all outcomes 0 the advantages) are 0; the PRM trains, and at
# step 1 its rewards move the actor. The actor is unchanged by step 0, so step 1 draws the same
# rollouts in every layout.
BY_METHOD = {"pure": ["trainer.steps=1", "trainer.save_every=1"],
             "prime": ["trainer.steps=2", "trainer.save_every=0", "advantage.prime.acc_low=0.0",
                       "advantage.prime.acc_high=1.0"]}
# Tolerances, fp32 (measured on the CPU: PURE's metrics within 2.4e-7 absolute and each tensor's
# update within 1.4e-5 of its norm at tp2 and pp2). PRIME's step 1: its process rewards are
# beta x (log pi_prm - log pi_ref) of two models one PRM step apart, a difference ~1e-3 of two
# log-probs whose fp32 rounding differs by layout (~1e-6), so the rewards, advantages and
# losses move by up to 1e-2 relative (measured 8.3e-3, approx_kl) and Adam's update by up to
# 5.2e-2 of its norm.
TOL = {"pure": {"metrics_rel": [1e-4], "update_rel": 1e-4},
       "prime": {"metrics_rel": [1e-4, 2e-2], "update_rel": 1e-1}}
PER_RUN = ("timing/", "throughput/", "weight_sync/seconds", "weight_sync/gbps", "memory/")


def _step(run_root, policy, prm, tp, pp):
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.loop import RLTrainer

    g = init_distributed(tp=tp, pp=pp)
    torch.set_float32_matmul_precision("highest")  # fp32 references: TF32 off on CUDA
    out = {}
    for method in METHODS:
        cfg = rl_config(os.path.join(run_root, f"{method}-tp{tp}-pp{pp}"), policy, prm, method,
                        [*EXTRA, *BY_METHOD[method]])
        tr = RLTrainer(cfg, g, build_char_tokenizer())
        before = _engine_weights(tr)
        history = tr.fit()
        after = _engine_weights(tr)
        out[method] = {"history": history, "method": method, "run_dir": cfg.trainer.run_dir,
                       "after": after if method == "pure" else None,
                       "update": {k: after[k] - before[k] for k in before},
                       "device": str(next(tr.actor.model.parameters()).device)}
    return out


def _engine_weights(tr) -> dict:
    """The rollout engine's full HF tensors (the actor's, after each sync), on the host."""
    return {k: v.detach().double().cpu() for k, v in tr.engine.model.state_dict().items()}


def _compare(one, other) -> tuple:
    """Assert `other` equals `one` within the method's tolerance (`TOL`); return the largest
    metric difference (absolute) and update difference (relative norm) for the report."""
    tol = TOL[one["method"]]
    worst, wmax = 0.0, 0.0
    assert len(one["history"]) == len(other["history"])
    for step, (ours, theirs) in enumerate(zip(one["history"], other["history"])):
        assert set(ours) == set(theirs)
        rel = tol["metrics_rel"][step]
        for k, v in ours.items():
            if k.startswith(PER_RUN) or isinstance(v, str):
                continue
            assert theirs[k] == pytest.approx(v, rel=rel, abs=1e-5), (step, k)
            worst = max(worst, abs(theirs[k] - v))
    for name, t in one["update"].items():
        diff = float((other["update"][name] - t).norm() / (t.norm() + 1e-12))
        assert diff <= tol["update_rel"], (name, diff)
        wmax = max(wmax, diff)
    return worst, wmax


@pytest.fixture(scope="module")
def reference(tiny_models, tmp_path_factory):
    """The world-size-1 step, run once for both layouts."""
    policy, prm = tiny_models
    return launch.spawn(_step, 1, str(tmp_path_factory.mktemp("ws1")), policy, prm, 1, 1)[0]


@pytest.fixture(scope="module")
def layouts(tiny_models, tmp_path_factory):
    """layout -> its ranks' results, each layout run once for the tests below."""
    policy, prm = tiny_models
    runs = {}

    def run(tp, pp):
        if (tp, pp) not in runs:
            runs[tp, pp] = launch.spawn(_step, tp * pp,
                                        str(tmp_path_factory.mktemp(f"tp{tp}pp{pp}")), policy,
                                        prm, tp, pp)
        return runs[tp, pp]
    return run


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_a_step_at_tp2_and_pp2_equals_the_step_at_world_size_1(reference, layouts, tp, pp):
    ref = reference
    ranks = layouts(tp, pp)
    for method in METHODS:
        last = ref[method]["history"][-1]
        assert last["actor/grad_norm"] > 0 and last["adv/abs_max"] > 0, last  # the actor trains
        if method == "prime":
            assert ref[method]["history"][0]["prm/grad_norm"] > 0  # and so does the PRM
        for r in ranks:
            worst, wmax = _compare(ref[method], r[method])
            print(f"{method} tp{tp} pp{pp} rank device {r[method]['device']}: metrics |diff| "
                  f"<= {worst:.2g}, update diff <= {wmax:.2g} of its norm")

def _hf_on_device(hf_dir, ids):
    """transformers' model of an exported checkpoint on this machine's device (cuda:0 on a
    GPU), its fp32 state (host) and logits for `ids`."""
    from transformers import AutoModelForCausalLM

    from megaprm.parallel.device import rank_device

    torch.set_float32_matmul_precision("highest")
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(rank_device())
    with torch.no_grad():
        logits = model(ids.to(rank_device())).logits.float().cpu()
    return ({k: v.detach().double().cpu() for k, v in model.state_dict().items()}, logits,
            str(rank_device()))


def test_a_tp2_training_checkpoint_exports_to_what_the_run_trained(layouts, tmp_path):
    """The tp2 run's checkpoint (written by its 2 ranks) exported by `checkpoint_tools
    export-hf` and loaded by transformers on the device: every tensor equals the actor's
    weights after the step as the rollout engine received them (fp32, exact), and the logits
    of transformers on the device equal those of a host copy within 1e-5."""
    import subprocess
    import sys

    rank0 = layouts(2, 1)[0]["pure"]
    out = str(tmp_path / "exported")
    p = subprocess.run([sys.executable, "-W", "ignore", "-m", "checkpoint_tools", "export-hf",
                        "--ckpt", rank0["run_dir"], "--out", out], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    ids = torch.randint(0, 30, (2, 16), generator=torch.Generator().manual_seed(0))
    state, logits, where = launch.spawn(_hf_on_device, 1, out, ids)[0]
    for name, t in rank0["after"].items():
        assert torch.equal(state[name], t), name
    from transformers import AutoModelForCausalLM

    host = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        ref = host(ids).logits.float()
    assert float((logits - ref).abs().max()) <= 1e-5, where
