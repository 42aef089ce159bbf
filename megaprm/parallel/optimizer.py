"""The optimiser of a Megatron DDP model: Megatron's (distributed) optimizer on GPU, a torch
AdamW over `param.main_grad` on CPU; grad clipping over the model-parallel group, a step that
is skipped on every rank when any rank's grad norm is not finite, and `all_or_nothing` for an
update spanning several mini-batches."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megaprm.parallel import cpu
from megaprm.parallel.device import comm_device
from megaprm.parallel.groups import Groups


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0
    # Megatron's DDP option: reduce and keep the grad buffer in fp32 (true, megaprm's default)
    # or in the parameters' dtype (false: half the buffer in bf16, as NeMo-RL's recipes set it;
    # the optimiser then makes fp32 grads of its own shard at each step)
    grad_reduce_in_fp32: bool = True

    def __post_init__(self):
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"optim.lr={self.lr!r}: must be a positive finite number")
        if self.clip_grad < 0:
            raise ValueError(f"optim.clip_grad={self.clip_grad!r}: must be >= 0 (0 disables)")
        if not isinstance(self.grad_reduce_in_fp32, bool):
            raise ValueError(f"optim.grad_reduce_in_fp32={self.grad_reduce_in_fp32!r}: must be "
                             "true or false")


class Optimizer:
    """Megatron's optimizer on GPU; on CPU a torch AdamW over the DDP module's parameters.

    Megatron's DistributedOptimizer rejects non-CUDA parameters and its fp32 optimizer asserts
    on CUDA when clipping (megatron-core 0.16.1), so on CPU we step torch.optim
    after `finalize_model_grads`, with the grads Megatron accumulated in `param.main_grad` and a
    grad norm reduced over the model-parallel group (tp duplicates counted once).
    """

    def __init__(self, ddp_model, cfg: OptimConfig, groups: Groups, params=None,
                 megatron: Optional[bool] = None):
        """`params`: the parameters to train (default: all that require grad), e.g. a PRM's head
        alone; may be empty on a pp stage that holds none of them: its `step` still joins the
        collectives (grad sync, grad norm) and updates nothing. `megatron`: use Megatron's
        optimizer (default: on CUDA; the CPU tests force it to exercise the DistributedOptimizer).
        """
        self.model, self.cfg, self.groups = ddp_model, cfg, groups
        trainable = [p for p in ddp_model.parameters() if p.requires_grad]
        self.params = trainable if params is None else list(params)
        chosen = {id(p) for p in self.params}
        # Parameters DDP holds but this optimiser must not move (stage 1 of PRM training).
        self.frozen = [p for p in trainable if id(p) not in chosen]
        self.megatron = torch.cuda.is_available() if megatron is None else megatron
        self._rollback = None  # set inside `all_or_nothing`
        self._host = []  # the rollback copy's host buffers, reused by every update
        if self.megatron:
            self.impl = _megatron_optimizer(ddp_model, cfg, chosen)
        else:
            # foreach: one multi-tensor call per Adam op, not one Python loop step per
            # parameter (torch picks it only on CUDA by default); the same update, bit for bit
            self.impl = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                          weight_decay=cfg.weight_decay,
                                          foreach=True) if self.params else None

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        if self.megatron:
            self.impl.zero_grad()
        else:
            for p in self.params:
                p.grad = None

    def set_lr(self, lr: float) -> None:
        for g in (self.impl.param_groups if self.impl is not None else []):
            g["lr"] = lr * g.get("lr_mult", 1.0)  # 0 for the frozen group (_megatron_optimizer)

    def grad_norm(self) -> float:
        """L2 norm of the full model's grads: tp duplicates once, shared embedding once, and an
        MoE model's experts (Megatron marks them `allreduce=False` under expert parallelism:
        each ep rank holds others) summed over the ep group, so every rank clips alike."""
        # a per-parameter sum of squares, not torch._foreach_norm: that one takes each norm
        # through a sqrt and back, which can round the clip scale (and every weight after it)
        # differently, and a rebuild of the demo's shipped start must stay bit-identical
        sq = torch.zeros((), dtype=torch.float64, device=comm_device(self.groups.backend))
        experts = torch.zeros_like(sq)
        for p in self.params:
            g = p.main_grad if hasattr(p, "main_grad") else p.grad
            if g is None:
                continue
            duplicate = (not getattr(p, "tensor_model_parallel", False)) and self.groups.tp_rank > 0
            shared_copy = getattr(p, "shared_embedding", False) and not self.groups.is_first_stage
            if not duplicate and not shared_copy:
                part = experts if not getattr(p, "allreduce", True) else sq
                part += g.double().pow(2).sum().to(sq.device)
        if self.groups.ep_size > 1:
            dist.all_reduce(experts, group=self.groups.ep)
        sq += experts
        if self.groups.mp is not None and dist.get_world_size(self.groups.mp) > 1:
            dist.all_reduce(sq, group=self.groups.mp)
        return float(sq.sqrt())

    def step(self) -> tuple:
        """finalize grads over dp/embedding groups, clip, step. Returns (grad_norm, applied)."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model])
        if self.megatron:
            for p in self.frozen:  # not trained here: out of the grad norm, Adam sees zeros
                p.main_grad.zero_()
            # bf16 without a grad scaler: Megatron reports success on a NaN grad norm, so check
            # the grads ourselves (agreed over all ranks) before any parameter moves
            if not self.grads_finite():
                self.zero_grad()
                return float("nan"), False
            self._before_apply()
            ok, norm, _ = self.impl.step()
            return float(norm or 0.0), bool(ok)
        # host tensors only from here: no torch call through the CUDA->CPU shim's
        # __torch_function__ (parallel.cpu), which every call of the update paid before
        with cpu.paused():
            return self._host_step()

    def _host_step(self) -> tuple:
        """The CPU path's clip and AdamW step on the reduced grads (`step`)."""
        grads = []
        for p in self.params:
            p.grad = p.main_grad.to(p.dtype) if hasattr(p, "main_grad") else p.grad
            if p.grad is not None:
                grads.append(p.grad)
        norm = self.grad_norm()
        if not math.isfinite(norm):
            return norm, False
        if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad and grads:
            torch._foreach_mul_(grads, self.cfg.clip_grad / (norm + 1e-6))
        if self.impl is not None:
            self._before_apply()
            self.impl.step()
        return norm, True

    def grads_finite(self) -> bool:
        """True iff every rank's accumulated grads are finite (one all-reduce over the world;
        with the distributed optimizer each rank may hold only its shard of the reduced grads)."""
        bad = torch.zeros((), dtype=torch.float32, device=comm_device(self.groups.backend))
        for p in self.params:
            g = p.main_grad if hasattr(p, "main_grad") else p.grad
            if g is not None:
                bad += (~torch.isfinite(g)).any().to(bad.dtype).to(bad.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad)
        return float(bad) == 0.0

    @contextlib.contextmanager
    def all_or_nothing(self, enabled: bool = True):
        """Several `step`s applied wholly or not at all: on an exception inside, every parameter
        and optimiser tensor is put back as it was on entry (lazily created optimiser state is
        dropped) and the exception propagates.

        The copy is taken lazily, by the first `step` that is about to apply (its grads already
        agreed finite): nothing is copied when no step applies. It is kept in host memory, not
        on the device (a device copy of parameters, fp32 masters and moments was 28 GB per
        rank for an 8 B model at dp 8): buffers allocated once (pinned on CUDA) and reused by
        every update, filled by copies queued on the current stream ahead of the step's own
        kernels, so the step never waits for them."""
        if not enabled:
            yield
            return
        self._rollback = {"snapshot": None}
        try:
            yield
        except BaseException:
            snap = self._rollback["snapshot"]
            if snap is not None:
                _restore(snap)
            raise
        finally:
            self._rollback = None

    def _before_apply(self) -> None:
        rb = self._rollback
        if rb is not None and rb["snapshot"] is None:
            rb["snapshot"] = self._snapshot()

    def _snapshot(self) -> dict:
        """Host copies of everything a step changes: the model's parameters and the
        optimiser's (main) parameters and state tensors."""
        opts = torch_optimizers(self.impl)
        # the Parameters themselves (each `.data` is a new object, so ids of those would count
        # a parameter held by the model and by a param group twice)
        tensors = list(self.model.parameters())
        for opt in opts:
            for group in opt.param_groups:
                tensors += list(group["params"])
            for st in opt.state.values():
                tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
        seen, unique = set(), []
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                unique.append(t)
        if [(b.shape, b.dtype) for b in self._host] != [(t.shape, t.dtype) for t in unique]:
            pin = torch.cuda.is_available()
            self._host = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                          for t in unique]
        saved = []
        for t, buf in zip(unique, self._host):
            buf.copy_(t.detach(), non_blocking=buf.is_pinned())
            saved.append((t, buf))
        had_state = [set(map(id, opt.state)) for opt in opts]
        return {"tensors": saved, "opts": opts, "had_state": had_state}

    def state_dict(self) -> dict:
        """Everything a resume needs, on the host. Megatron's DistributedOptimizer keeps the
        fp32 master weights and the Adam moments out of its `state_dict()` (a load allocates them
        with torch.empty and expects `load_parameter_state`): its part of them, this dp rank's
        shard, rides along as `param_state` (the rank files are per rank, and a resume needs the
        same world/tp/pp)."""
        if self.impl is None:
            return {}
        sd = self.impl.state_dict()
        dist_opts = _distributed_optimizers(self.impl)
        if not dist_opts:
            return sd
        return {"optimizer": sd, "param_state": [_param_state(o) for o in dist_opts]}

    def load_state_dict(self, sd) -> None:
        if self.impl is None:
            return
        dist_opts = _distributed_optimizers(self.impl)
        if not dist_opts:
            self.impl.load_state_dict(sd)
            return
        if not (isinstance(sd, dict) and "param_state" in sd):
            raise ValueError("this checkpoint holds no fp32 master weights or Adam moments for "
                             "the distributed optimizer (written by an older megaprm): resume "
                             "from a newer checkpoint or start the run afresh")
        self.impl.load_state_dict(sd["optimizer"])
        # Without apex/TE, Megatron's load gives every parameter's torch-Adam state one shared
        # `step` tensor, which each parameter's update then increments: one tensor each.
        for opt in torch_optimizers(self.impl):
            for st in opt.state.values():
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"] = st["step"].clone()
        with torch.no_grad():  # fp32 masters are views of the (leaf) model parameters
            for opt, state in zip(dist_opts, sd["param_state"], strict=True):
                opt.load_parameter_state_from_dp_reshardable(state)


def _megatron_optimizer(ddp_model, cfg: OptimConfig, chosen: set):
    """Megatron's (chained) optimiser over every parameter DDP holds. The DistributedOptimizer
    maps each grad-buffer slot to a param group, so a parameter DDP holds cannot be left out
    (KeyError in `_build_optimizer_group_ranges`): those not in `chosen` go to a group with
    lr_mult 0 (`set_lr`) and get zero grads (`step`), so they never move."""
    from megatron.core.optimizer import (
        OptimizerConfig,
        get_megatron_optimizer,
        get_standard_config_overrides,
    )
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate
    from megatron.core.optimizer_param_scheduler import ParamGroupOverride

    oc = OptimizerConfig(optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay,
                         adam_beta1=cfg.betas[0], adam_beta2=cfg.betas[1], adam_eps=cfg.eps,
                         clip_grad=cfg.clip_grad, bf16=ddp_model.config.bf16,
                         use_distributed_optimizer=ddp_model.ddp_config.use_distributed_optimizer)
    use_multi_tensor_l2norm()
    overrides = get_standard_config_overrides(oc)
    frozen = ParamPredicate(name="megaprm_frozen", fn=lambda p: id(p) not in chosen)
    overrides[ParamKey(predicate=frozen)] = ParamGroupOverride(lr_mult=0.0)
    impl = get_megatron_optimizer(oc, [ddp_model], config_overrides=overrides)
    for g in impl.param_groups:
        g["lr"] = cfg.lr * g.get("lr_mult", 1.0)
    return impl


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for apex's `amp_C.multi_tensor_l2norm`: torch's foreach norms, no host read.
    Returns ([1] float32 L2 norm of all tensors of tensor_lists[0], per-tensor norms or None)."""
    norms = torch._foreach_norm(tensor_lists[0])
    total = torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1)
    return total, (torch.stack(norms) if per_tensor else None)


def use_multi_tensor_l2norm() -> None:
    """Without apex or Transformer Engine, Megatron's grad-norm falls back to
    `local_multi_tensor_l2_norm`, which builds `torch.tensor([norm ...])` from 0-d device
    tensors: one host read per parameter per step. Swap in `multi_tensor_l2norm` there."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    if clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = multi_tensor_l2norm


def _distributed_optimizers(impl) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(impl, "chained_optimizers", [impl])
    return [o for o in inner if isinstance(o, DistributedOptimizer)]


def _param_state(opt) -> dict:
    """This dp rank's shard of fp32 masters, Adam moments and step counts, as host copies, in
    Megatron's bucket-space layout (`get_parameter_state_dp_reshardable`; each entry marked
    unpadded, which `load_parameter_state_from_dp_reshardable` filters on)."""
    state = opt.get_parameter_state_dp_reshardable()
    for gbuf_idx, per_dtype in state.items():
        if not isinstance(gbuf_idx, int):
            continue
        for buckets in per_dtype.values():
            for bucket in buckets:
                for i, entry in enumerate(bucket):
                    bucket[i] = {k: v.detach().to("cpu", copy=True)
                                 if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
                    bucket[i]["padding"] = False
    return state


def _restore(snapshot: dict) -> None:
    if torch.cuda.is_available():  # the host copies queued on the stream have landed
        torch.cuda.synchronize()
    with torch.no_grad():
        for t, saved in snapshot["tensors"]:
            t.copy_(saved)
    for opt, had in zip(snapshot["opts"], snapshot["had_state"]):
        for p in [p for p in opt.state if id(p) not in had]:
            del opt.state[p]


def torch_optimizers(impl) -> list:
    """The torch optimisers inside a (chained) Megatron optimiser, or the torch one itself."""
    if impl is None:
        return []
    if isinstance(impl, torch.optim.Optimizer):
        return [impl]
    chained = getattr(impl, "chained_optimizers", None)
    if chained is not None:
        return [o for c in chained for o in torch_optimizers(c)]
    inner = getattr(impl, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []
