"""torchrun environment -> process group (nccl | gloo) -> Megatron parallel_state -> `Groups`.

This is the only module that touches Megatron's global `parallel_state`; everything below it
receives the returned `Groups`. A plain `python` run (no torchrun variables) is world size 1.
"""
from __future__ import annotations

import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist

from megaprm.parallel import cpu
from megaprm.parallel.device import configure_cuda_math, default_backend, rank_device
from megaprm.parallel.groups import Groups
from megaprm.parallel.ports import free_port


class ParallelConfigError(ValueError):
    """A tp/pp/cp/world-size combination that cannot be laid out."""


def check_layout(world_size: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> int:
    """Return dp for a layout, or raise naming the sizes and a valid alternative."""
    for name, v in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if not isinstance(v, int) or v < 1:
            raise ParallelConfigError(f"parallel.{name}={v!r}: must be a positive integer")
    mp = tp * pp * cp
    if world_size % mp:
        raise ParallelConfigError(
            f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {mp}; "
            f"launch a multiple of {mp} processes (megaprm's --nproc) or lower tp/pp/cp")
    # Experts are split over ep ranks within one pipeline stage, each expert over tp (Megatron's
    # expert tensor parallelism = tp): tp*ep must divide a stage's tp*cp*dp ranks.
    if (world_size // pp) % (tp * ep):
        raise ParallelConfigError(
            f"parallel.ep={ep}: tp*ep = {tp}*{ep} = {tp * ep} does not divide the "
            f"{world_size // pp} ranks of a pipeline stage (world size {world_size} / pp {pp}); "
            f"launch a multiple of {tp * ep * pp} processes or lower ep")
    return world_size // mp


def init_distributed(tp: int = 1, pp: int = 1, cp: int = 1, vpp: Optional[int] = None,
                     seed: int = 1234, backend: Optional[str] = None,
                     timeout_minutes: int = 30, agree_timeout_s: float = 300.0,
                     ep: int = 1) -> Groups:
    """Create (or reuse) the default process group, initialise Megatron, seed its RNG tracker.

    torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; without them this is
    a single process on a private loopback port. NCCL when each rank has its own GPU, gloo
    otherwise (no CUDA, or local ranks sharing one GPU: `device.default_backend`).
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    cpu.install()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dp = check_layout(world_size, tp, pp, cp, ep)
    if vpp is not None and pp == 1:
        raise ParallelConfigError(f"parallel.vpp={vpp} needs pp > 1 (interleaved pipeline)")
    # a group started by the caller (tests' run_distributed: gloo) keeps its backend
    backend = backend or (dist.get_backend() if dist.is_initialized() else default_backend())
    if torch.cuda.is_available():
        torch.cuda.set_device(rank_device())
    configure_cuda_math()
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if "MASTER_ADDR" not in os.environ and world_size == 1:
            # a world of one needs no rendezvous: an in-process store, no port to race for
            dist.init_process_group(backend=backend, store=dist.HashStore(), world_size=1,
                                    rank=0, timeout=timeout)
        else:
            if "MASTER_ADDR" not in os.environ:
                os.environ["MASTER_ADDR"] = "127.0.0.1"
                os.environ["MASTER_PORT"] = str(free_port())
            dist.init_process_group(backend=backend, world_size=world_size, rank=rank,
                                    timeout=timeout)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    dp_host = world_host = None
    if backend == "nccl":  # host-side collectives (estimators, metrics) use gloo
        dp_host = ps.get_data_parallel_group_gloo()
        world_host = dist.new_group(backend="gloo")
    # the trainer's fault agreement: a short timeout, so a dead rank is an error in minutes,
    # not after the 30-minute default
    agree = (dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=agree_timeout_s))
             if world_size > 1 else None)
    return Groups(
        world_size=world_size, rank=rank, tp_size=tp, pp_size=pp, dp_size=dp, cp_size=cp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        tp=ps.get_tensor_model_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(),
        dp=ps.get_data_parallel_group(),
        cp=ps.get_context_parallel_group(),
        mp=ps.get_model_parallel_group(),
        embd=ps.get_embedding_group(),
        vpp_size=vpp, backend=backend, dp_host=dp_host, world_host=world_host,
        agree=agree, ep_size=ep, ep_rank=ps.get_expert_model_parallel_rank(),
        ep=ps.get_expert_model_parallel_group(),
    )


def destroy() -> None:
    """Tear down Megatron's state and the default group (tests re-initialise in one process)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
