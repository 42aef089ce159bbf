"""trainer/lifecycle.py: verl's order around every generation, and the `*.offload` switches.

* A CPU RL run with actor.offload, ref.offload and prm.offload on gives the same metrics (every
  value but wall-clock ones), the same metrics.jsonl and the same final actor, bit for bit, as
  the run with them off: PRIME (actor, reference, implicit PRM with its optimizer) and
  PROF-GRPO with a KL term and evaluations (actor, reference, discriminative PRM). While the
  engine generates, the offloaded models' parameters, grads and optimizer state hold 0 bytes.
* The stand-in device (tests/parallel/test_device.py: the models on `meta`, "cuda" means meta,
  a meta tensor reaches the host as zeros) sees no tensor at all while the engine generates:
  a scan of every live tensor finds none on `meta` with storage left. Without the switches it
  finds the models' (the check can fail); after the rollout the models train again there.
"""
import functools
import gc
import json
import os

import pytest
import torch

from megaprm.parallel import launch
from tests.rl_setup import rl_config

PER_RANK = ("timing/", "throughput/", "weight_sync/")  # wall-clock: differs between runs
OFF = ("actor.offload=false", "ref.offload=false", "prm.offload=false")
ON = ("actor.offload=true", "ref.offload=true", "prm.offload=true")
RUNS = {"prime": ["actor.kl_coef=0.01"],
        "prof_grpo": ["actor.kl_coef=0.01", "trainer.eval_every=1", "trainer.eval_problems=4"]}


def _held_bytes(tr) -> int:
    """Bytes the trainer's models hold (parameters, buffers, grads, optimizer tensors), found by
    walking them here (not through offload.py)."""
    ts = []
    implicit = tr.prm is not None and tr.prm.kind == "implicit"
    for pol in (tr.actor, tr.ref, *((tr.prm.policy, tr.prm.ref) if implicit else ())):
        if pol is None:
            continue
        ts += [*pol.model.parameters(), *getattr(pol.model, "module", pol.model).buffers()]
        ts += [p.main_grad for p in pol.model.parameters() if hasattr(p, "main_grad")]
        if pol.opt is not None:
            ts += [v for st in pol.opt.impl.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0]  # not AdamW's step count
    if tr.prm is not None and tr.prm.kind == "discriminative":
        ts += [*tr.prm.model.parameters(), *tr.prm.model.buffers()]
    return sum(t.untyped_storage().nbytes() for t in ts)


def _record_held_bytes(tr) -> list:
    """The bytes the models hold at the start of every generation of the engine (a list that
    fills as the trainer runs)."""
    during, real = [], tr.engine.generate

    def generate(*a, **k):
        during.append(_held_bytes(tr))
        return real(*a, **k)
    tr.engine.generate = generate
    return during


def _runs(run_root, policy, prm):
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.loop import RLTrainer

    g = init_distributed()
    out = {}
    for method, extra in RUNS.items():
        for name, switches in (("off", OFF), ("on", ON)):
            cfg = rl_config(os.path.join(run_root, f"{method}-{name}"), policy, prm, method,
                            ["rollout.max_tokens=12", "actor.micro_batch_size=4",
                             "trainer.steps=2", "trainer.save_every=0", *extra, *switches])
            tr = RLTrainer(cfg, g, build_char_tokenizer())
            during = _record_held_bytes(tr)
            history = tr.fit()
            out[(method, name)] = {
                "history": history, "during": during, "after": _held_bytes(tr),
                "offloads": [o.name for o in tr.lifecycle.offloads],
                "actor": {k: v.detach().clone()
                          for k, v in tr.actor.model.module.state_dict().items()
                          if isinstance(v, torch.Tensor)}}
    return out


def test_every_offload_switch_on_gives_the_same_run_bit_for_bit(tiny_models, tmp_path):
    policy, prm = tiny_models
    results = launch.spawn(_runs, 2, str(tmp_path), policy, prm)
    for res in results:
        for method in RUNS:
            off, on = res[(method, "off")], res[(method, "on")]
            assert off["offloads"] == []
            assert on["offloads"] == ["actor", "ref", "prm"], on["offloads"]
            # 2 rollouts (+ 2 evaluations for prof_grpo): nothing held while generating
            assert len(on["during"]) == (4 if method == "prof_grpo" else 2)
            assert set(on["during"]) == {0}, on["during"]
            assert min(off["during"]) > 0 and on["after"] == off["after"] > 0
            assert len(on["history"]) == 2
            for a, b in zip(off["history"], on["history"]):
                assert {k: v for k, v in a.items() if not k.startswith(PER_RANK)} == \
                       {k: v for k, v in b.items() if not k.startswith(PER_RANK)}, method
            assert off["actor"].keys() == on["actor"].keys()
            assert all(torch.equal(off["actor"][k], on["actor"][k]) for k in off["actor"])
    for method in RUNS:
        rows = {name: [{k: v for k, v in json.loads(x).items() if not k.startswith(PER_RANK)}
                       for x in (tmp_path / f"{method}-{name}" / "metrics.jsonl").read_text()
                       .splitlines()]
                for name in ("off", "on")}
        assert len(rows["on"]) == 2 and rows["on"] == rows["off"], method


# ------------------------------------------------------------------ the stand-in device

class _Engine:
    """A recording engine: its generate() scans every live tensor for device (meta) storage."""

    def __init__(self):
        self.log, self.seen, self.asleep = [], [], True

    def update_weights(self, weights, *, strict=True, wake_kv_cache=True):
        self.log.append("load")

    def wake(self):
        self.log.append("wake_kv")
        self.asleep = False

    def sleep(self):
        self.log.append("sleep")
        self.asleep = True

    def generate(self):
        self.log.append("generate")
        gc.collect()
        self.seen.append({tuple(o.shape): o.untyped_storage().nbytes() for o in gc.get_objects()
                          if isinstance(o, torch.Tensor) and o.device.type == "meta"
                          and o.untyped_storage().nbytes()})


def _stand_in_lifecycle(rank, world, hf):
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.prm import as_prm_spec, build_prm
    from megaprm.models.actor import build_stage
    from megaprm.parallel import offload, pipeline
    from megaprm.parallel.optimizer import OptimConfig, Optimizer
    from megaprm.parallel.init import init_distributed
    from megaprm.trainer.rl.policy import fixed_micro_batches, logprob_post
    from megaprm.trainer.rl.lifecycle import Lifecycle
    from tests.parallel.test_device import _stand_in

    g = init_distributed()
    meta = _stand_in()
    # the stand-in's crossing rule for the offload's copy: a meta tensor reaches the host as
    # zeros (there are no values on `meta`; offload.py's values are tested on the CPU)
    offload._host_copy = lambda view, host: torch.zeros(view.numel(), dtype=torch.uint8)
    spec = spec_from_hf(hf)
    actor = pipeline.wrap_ddp(build_stage(spec, g).to(meta), g)
    opt = Optimizer(actor, OptimConfig(lr=1e-3), g)
    for p in actor.module.parameters():  # Adam moments on the device: one step's worth
        p.grad = torch.randn_like(p)
    opt.impl.step()
    ref = build_stage(spec, g).to(meta).eval()
    prm = build_prm(as_prm_spec(spec, "token_cls"), tp=1, pp=1, pp_rank=0).to(meta).eval()
    sizes = [p.untyped_storage().nbytes() for m in (actor, ref, prm) for p in m.parameters()]
    ids = torch.randint(0, spec.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))

    def post(mb, logits):
        lp = logprob_post(spec, g, 1.0)(mb, logits)[1]
        return -lp.sum(), None

    def train():  # a forward and backward of the actor on the device, as the update's
        opt.zero_grad()
        pipeline.run(actor, fixed_micro_batches(ids, torch.ones(2, 8), None, 2, 1), groups=g,
                     post=post, forward_only=False)
    train()  # what the step before left behind (caches of the forward included)
    with torch.no_grad():
        pipeline.run(ref, fixed_micro_batches(ids, torch.ones(2, 8), None, 2, 1), groups=g,
                     post=logprob_post(spec, g, 1.0), forward_only=True)
    out = {}
    for name, switches in (("off", []), ("on", [offload.Offload("actor", actor, opt),
                                                offload.Offload("ref", ref),
                                                offload.Offload("prm", prm)])):
        engine = _Engine()
        life = Lifecycle(engine, functools.partial(engine.update_weights, None,
                                                   wake_kv_cache=False), switches)
        life.generate(engine.generate)
        out[name] = {"seen": engine.seen, "log": engine.log}
    out["restored"] = sizes == [p.untyped_storage().nbytes()
                                for m in (actor, ref, prm) for p in m.parameters()]
    train()
    out["trains_after"] = {p.main_grad.device.type for p in actor.module.parameters()}
    return out


def test_the_stand_in_device_holds_no_tensor_while_the_engine_generates(tmp_path):
    from megaprm.models.tiny import save_tiny_model
    from tests.distributed_utils import run_distributed

    hf = save_tiny_model("qwen2", str(tmp_path / "m"), vocab_size=96, hidden_size=32,
                         num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    out = run_distributed(_stand_in_lifecycle, 1, hf)[0]
    assert out["on"]["log"] == ["load", "wake_kv", "generate", "sleep"]  # verl's order
    assert out["on"]["seen"] == [{}], f"left on the device while generating: {out['on']['seen']}"
    assert out["off"]["seen"][0]  # without the switches the models are there
    assert out["restored"] and out["trains_after"] == {"meta"}


def test_offload_switches_are_booleans_outside_the_config_digest(tmp_path):
    """The three keys the planner reads; a non-boolean names the field; switching them changes
    no digested field (a run resumes with them changed)."""
    from megaprm.config import load_config
    from megaprm.errors import ConfigError
    from megaprm.trainer.run_config import config_digest_fields

    cfg = load_config(None, list(ON))
    assert (cfg.actor.offload, cfg.ref.offload, cfg.prm.offload) == (True, True, True)
    assert config_digest_fields(cfg) == config_digest_fields(load_config(None, list(OFF)))
    for key in ("actor.offload", "ref.offload", "prm.offload"):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [f"{key}=1"])
