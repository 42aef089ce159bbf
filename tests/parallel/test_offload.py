"""parallel/offload.py on the CPU: a model's device storages are really released (0 bytes) and
come back bit for bit - parameters, Megatron DDP's flat buffers, the optimizer's fp32 masters and
Adam moments - grads as zeros, and the next optimizer step equals the one of a twin that was
never offloaded. Both optimizers, at dp=2: torch AdamW (the CPU path) and Megatron's
DistributedOptimizer (parameters as views of DDP's `param_data`, masters and moments sharded)."""
import pytest
import torch

from tests.distributed_utils import run_distributed
from tests.parallel.test_optimizer_state import TINY, _cuda_type_names, _train


def _everything(ddp, opt) -> dict:
    """Every value the offload must restore, as clones: the module's state, DDP's flat buffers,
    each inner torch optimiser's parameters (Megatron: fp32 masters) and state tensors."""
    from megaprm.parallel.optimizer import torch_optimizers

    out = {f"model/{k}": v.detach().clone() for k, v in ddp.module.state_dict().items()
           if isinstance(v, torch.Tensor)}
    for i, buf in enumerate(ddp.buffers):
        if buf.param_data is not None:
            out[f"param_data/{i}"] = buf.param_data.clone()
    for i, o in enumerate(torch_optimizers(opt.impl)):
        for j, group in enumerate(o.param_groups):
            for k, p in enumerate(group["params"]):
                out[f"opt{i}/param/{j}/{k}"] = p.detach().clone()
                for name, v in o.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        out[f"opt{i}/state/{j}/{k}/{name}"] = v.clone()
    return out


def _device_bytes(ddp, opt) -> int:
    """Bytes still held by the tensors the model and optimiser reach (found here without
    offload.py's walk)."""
    from megaprm.parallel.optimizer import torch_optimizers

    ts = [*ddp.module.parameters(), *ddp.module.buffers()]
    ts += [p.main_grad for p in ddp.module.parameters() if hasattr(p, "main_grad")]
    ts += [t for b in ddp.buffers for t in (b.param_data, b.grad_data) if t is not None]
    for o in torch_optimizers(opt.impl):
        ts += [p for g in o.param_groups for p in g["params"]]
        ts += [v for st in o.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0]  # AdamW's 0-d step is host state
    return sum(t.untyped_storage().nbytes() for t in ts)


def _offload_work(rank, world, hf):
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.mapping import load_hf_weights
    from megaprm.models.actor import build_stage
    from megaprm.parallel import pipeline
    from megaprm.parallel.optimizer import OptimConfig, Optimizer
    from megaprm.parallel.init import init_distributed
    from megaprm.parallel.offload import Offload

    g = init_distributed()
    spec = spec_from_hf(hf)
    _cuda_type_names()  # Megatron's optimizer checks the type names of CUDA tensors

    def build(megatron):
        model = build_stage(spec, g)
        load_hf_weights(model, hf, spec, tp_rank=g.tp_rank, tp_size=g.tp_size, pp=1, pp_rank=0)
        ddp = pipeline.wrap_ddp(model, g, distributed_optimizer=megatron)
        return ddp, Optimizer(ddp, OptimConfig(lr=1e-2, weight_decay=0.1), g,
                                       megatron=megatron)
    out = {}
    for kind, megatron in (("adamw", False), ("distributed", True)):
        (a, opt_a), (b, opt_b) = build(megatron), build(megatron)
        _train(a, opt_a, g, [0, 1])
        _train(b, opt_b, g, [0, 1])
        before = _everything(a, opt_a)
        off = Offload("actor", a, opt_a)
        held = _device_bytes(a, opt_a)
        freed = off.offload()
        r = {"held": held, "freed": freed, "left": _device_bytes(a, opt_a),
             "storages": len(off.storages()),
             "zero_storages": all(st.nbytes() == 0 for st, _ in off.storages()),
             "second_offload": off.offload()}
        restored = off.reload()
        after = _everything(a, opt_a)
        r["restored"] = restored
        r["second_reload"] = off.reload()
        r["same_keys"] = before.keys() == after.keys()
        r["bit_exact"] = [k for k in before if not torch.equal(before[k], after[k])]
        r["grads_zero"] = all(bool((p.main_grad == 0).all()) for p in a.module.parameters())
        r["twin_equal"] = [k for k, v in _everything(b, opt_b).items()
                           if not torch.equal(v, after[k])]
        # the next steps (one more offload between them) equal the never-offloaded twin's
        norms_a = _train(a, opt_a, g, [2])
        off.offload()
        off.reload()
        norms_a += _train(a, opt_a, g, [3])
        norms_b = _train(b, opt_b, g, [2, 3])
        r["norms_equal"] = norms_a == norms_b
        ea, eb = _everything(a, opt_a), _everything(b, opt_b)
        r["after_steps_diff"] = [k for k in ea if not torch.equal(ea[k], eb[k])]
        r["entries"] = len(before)
        out[kind] = r
    return out


def _check(r):
    assert r["held"] > 0 and r["freed"] > 0, r
    assert r["left"] == 0, "storage still on the device after offload"
    assert r["zero_storages"] and r["storages"] > 0
    assert r["second_offload"] == 0 and r["second_reload"] == 0  # idempotent
    assert r["restored"] == r["freed"]
    assert r["same_keys"] and r["entries"] > 0
    assert r["bit_exact"] == [], f"values changed by offload/reload: {r['bit_exact'][:5]}"
    assert r["grads_zero"]
    assert r["twin_equal"] == []
    assert r["norms_equal"] and r["after_steps_diff"] == []


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from megaprm.models.tiny import save_tiny_model

    hf = save_tiny_model("qwen2", str(tmp_path_factory.mktemp("offload") / "policy"), **TINY)
    return run_distributed(_offload_work, 2, hf, timeout=300)


def test_offload_releases_storage_and_restores_adamw_state_bit_exactly(results):
    for r in results:
        _check(r["adamw"])


def test_offload_with_megatrons_distributed_optimizer_at_dp2(results):
    for r in results:
        _check(r["distributed"])
