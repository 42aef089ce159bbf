"""Megatron's DistributedOptimizer at dp=2 on gloo: a checkpoint resume continues bit-exactly as
the uninterrupted run (fp32 masters, Adam moments and step counts saved and restored), and a
head-only optimiser over a DDP that holds every parameter builds and moves only the head.

Megatron's optimizer checks parameter types by name ('torch.cuda.FloatTensor'); the rank
function makes CPU tensors answer with the CUDA names (`_cuda_type_names`), so the real
DistributedOptimizer (sharding, reduce-scatter, clipping) runs on the CPU."""
import os

import torch

from tests.distributed_utils import run_distributed

TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
        "intermediate_size": 64}


def _cuda_type_names() -> None:
    real = torch.Tensor.type

    def typed(self, *args, **kwargs):
        name = real(self, *args, **kwargs)
        if args or kwargs or ".cuda." in name:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = typed


def _build(hf, g, params=None):
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.mapping import load_hf_weights
    from megaprm.models.actor import build_stage
    from megaprm.parallel import pipeline
    from megaprm.parallel.optimizer import OptimConfig, Optimizer

    spec = spec_from_hf(hf)
    model = build_stage(spec, g)
    load_hf_weights(model, hf, spec, tp_rank=g.tp_rank, tp_size=g.tp_size, pp=g.pp_size,
                    pp_rank=g.pp_rank)
    ddp = pipeline.wrap_ddp(model, g, distributed_optimizer=True)
    chosen = None if params is None else [p for n, p in ddp.module.named_parameters()
                                          if params(n)]
    opt = Optimizer(ddp, OptimConfig(lr=1e-2, weight_decay=0.1), g,
                             params=chosen, megatron=True)
    return ddp, opt


def _train(ddp, opt, g, steps) -> list:
    """Steps with grads fixed by (rank, step): the same in both runs; large enough to clip."""
    norms = []
    for step in steps:
        opt.zero_grad()
        gen = torch.Generator().manual_seed(1000 * step + g.rank)
        for p in ddp.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=gen))
        norm, applied = opt.step()
        assert applied
        norms.append(norm)
    return norms


def _weights(ddp) -> dict:
    return {k: v.detach().clone() for k, v in ddp.module.state_dict().items()
            if not k.endswith("_extra_state")}


def _shard_state(opt) -> list:
    """(param, exp_avg, exp_avg_sq, step) of every entry of this rank's shard."""
    out = []
    for state in opt.state_dict()["param_state"]:
        for gbuf_idx, per_dtype in state.items():
            if isinstance(gbuf_idx, int):
                for buckets in per_dtype.values():
                    for bucket in buckets:
                        out += [tuple(e[k].clone() for k in ("param", "exp_avg", "exp_avg_sq",
                                                              "step")) for e in bucket]
    return out


def _resume_work(rank, world, hf, root):
    import multiprocessing

    from megaprm.parallel.init import init_distributed
    from megaprm.trainer.checkpoint.load import load
    from megaprm.trainer.checkpoint.save import save

    multiprocessing.current_process()._config["daemon"] = False  # dist_checkpointing's writers
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    g = init_distributed()
    _cuda_type_names()
    out = {}

    ddp, opt = _build(hf, g)
    out["dist_opt"] = [type(o).__name__ for o in opt.impl.chained_optimizers]
    _train(ddp, opt, g, [0, 1])
    save(root, 2, g, models={"actor": ddp}, optimizers={"actor": opt},
         trainer_state={"next_step": 2})
    saved = _shard_state(opt)
    out["norms_a"] = _train(ddp, opt, g, [2, 3])
    uninterrupted = _weights(ddp)

    ddp, opt = _build(hf, g)  # a fresh process's state: initial weights, no optimiser state
    load(root, g, models={"actor": ddp}, optimizers={"actor": opt})
    loaded = _shard_state(opt)
    out["entries"] = len(saved)
    out["shard_restored"] = len(saved) == len(loaded) and all(
        torch.equal(a, b) for s, t in zip(saved, loaded) for a, b in zip(s, t))
    out["moments_nonzero"] = all(bool(e[2].abs().sum() > 0) for e in saved if e[0].numel())
    out["norms_b"] = _train(ddp, opt, g, [2, 3])
    resumed = _weights(ddp)
    out["same_weights"] = uninterrupted.keys() == resumed.keys() and all(
        torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)

    # head-only (PRM training's stage 1): DDP holds every parameter, the optimiser only some
    head = lambda name: name.startswith("decoder.final_layernorm.")  # noqa: E731
    ddp, opt = _build(hf, g, params=head)
    before = _weights(ddp)
    _train(ddp, opt, g, [0])
    after = _weights(ddp)
    out["head_moved"] = [k for k in before if not torch.equal(before[k], after[k])]
    return out


def test_distributed_optimizer_resume_is_bit_exact_and_head_only_builds(tmp_path):
    from megaprm.models.tiny import save_tiny_model

    hf = save_tiny_model("qwen2", str(tmp_path / "policy"), **TINY)
    r0, r1 = run_distributed(_resume_work, 2, hf, str(tmp_path / "ckpt"), timeout=300)
    for r in (r0, r1):
        assert r["dist_opt"] == ["DistributedOptimizer"]
        assert r["entries"] > 0 and r["moments_nonzero"]
        assert r["shard_restored"], "fp32 masters / Adam moments not restored bit-exactly"
        assert r["norms_a"] == r["norms_b"]
        assert r["same_weights"], "the resumed run diverged from the uninterrupted one"
        assert r["head_moved"] == ["decoder.final_layernorm.weight"]


# ------------------------------------------------------------------ all or nothing (one process)

def _steps_then_fail(ddp, opt, g, steps):
    try:
        with opt.all_or_nothing():
            _train(ddp, opt, g, steps)
            raise RuntimeError("a later mini-batch went NaN")
    except RuntimeError:
        pass


def test_all_or_nothing_restores_lazily_from_a_host_copy(tmp_path, monkeypatch):
    """Two applied steps then a failure: parameters and AdamW state are as before, bit-exact,
    and the state the steps created is gone; no copy is taken when no step applies. The copy
    is host memory of its own (pinned where CUDA is), allocated once and reused by the next
    update, so the device holds no second copy (planner: `host_terms`' update rollback copy)."""
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.tiny import save_tiny_model
    from megaprm.models.actor import build_stage
    from megaprm.parallel import pipeline
    from megaprm.parallel.optimizer import OptimConfig, Optimizer
    from megaprm.parallel.init import destroy, init_distributed

    hf = save_tiny_model("qwen2", str(tmp_path / "policy"), **TINY)
    g = init_distributed()
    try:
        ddp = pipeline.wrap_ddp(build_stage(spec_from_hf(hf), g), g)
        opt = Optimizer(ddp, OptimConfig(lr=1e-2), g)
        _train(ddp, opt, g, [0])  # AdamW state exists before the transaction
        before = _weights(ddp)
        state = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.impl.state.items()}
        copies, snaps = [], []
        real = opt._snapshot
        monkeypatch.setattr(opt, "_snapshot",
                            lambda: copies.append(1) or snaps.append(real()) or snaps[-1])
        _steps_then_fail(ddp, opt, g, [1, 2])
        assert copies == [1]  # one copy, however many steps
        saved = snaps[0]["tensors"]
        assert saved and all(buf.device.type == "cpu" and buf.data_ptr() != t.data_ptr()
                             and buf.is_pinned() == torch.cuda.is_available()
                             for t, buf in saved)
        # every parameter and state tensor once: the planner's 4 + 8 bytes per fp32 parameter,
        # plus AdamW's 0-d fp32 step count per tensor (left out of the plan)
        n = sum(p.numel() for p in ddp.parameters())
        assert sum(buf.numel() * buf.element_size() for _, buf in saved) == \
            (4 + 8) * n + 4 * len(opt.impl.state)
        buffers = [buf for _, buf in saved]
        after = _weights(ddp)
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert {id(p) for p in opt.impl.state} == set(state)
        _steps_then_fail(ddp, opt, g, [3])  # the next update reuses the same host buffers
        assert all(a is b for a, (_, b) in zip(buffers, snaps[1]["tensors"]))
        assert all(torch.equal(before[k], v) for k, v in _weights(ddp).items())
        for p, st in opt.impl.state.items():
            assert all(torch.equal(v, state[id(p)][k]) for k, v in st.items())

        fresh = Optimizer(ddp, OptimConfig(lr=1e-2), g)
        real_fresh = fresh._snapshot
        monkeypatch.setattr(fresh, "_snapshot", lambda: copies.append(2) or real_fresh())
        try:
            with fresh.all_or_nothing():
                raise RuntimeError("the first mini-batch's loss is NaN")
        except RuntimeError:
            pass
        assert copies == [1, 1] and len(fresh.impl.state) == 0
        _steps_then_fail(ddp, fresh, g, [1])
        assert copies == [1, 1, 2] and len(fresh.impl.state) == 0  # lazily created state of a rolled-back step dropped
        assert all(torch.equal(before[k], v) for k, v in _weights(ddp).items())
    finally:
        destroy()


def test_multi_tensor_l2norm_matches_megatrons_local_norm_without_host_reads():
    """The grad norm Megatron computes without apex/TE: same value as its local fallback (which
    reads every per-tensor norm to the host), from one stacked device tensor."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    from megaprm.parallel.optimizer import multi_tensor_l2norm, use_multi_tensor_l2norm

    gen = torch.Generator().manual_seed(0)
    shapes = [((7,), 1.0), ((3, 5), 1e-3), ((64,), 30.0), ((0,), 1.0)]
    grads = [torch.randn(n, generator=gen) * s for n, s in shapes]
    ref, _ = local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    got, per = multi_tensor_l2norm(2048 * 32, None, [grads], True)
    exact = torch.cat([g.double().flatten() for g in grads]).norm()
    assert got.shape == (1,) and got.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=1e-6) and abs(float(got) - float(exact)) < 1e-4
    assert torch.allclose(per, torch.stack([g.norm() for g in grads]))
    real = clip_grads.l2_norm_impl
    try:
        clip_grads.l2_norm_impl = local_multi_tensor_l2_norm
        use_multi_tensor_l2norm()
        assert clip_grads.l2_norm_impl is multi_tensor_l2norm
    finally:
        clip_grads.l2_norm_impl = real
