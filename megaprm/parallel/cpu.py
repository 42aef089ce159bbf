"""Let megatron-core 0.16 run on a machine without CUDA (tests, the demo, CI).

Installed once by `parallel.init` only when `torch.cuda.is_available()` is False; it never edits
megatron-core's files. Each redirect below is one CUDA entry point that megatron-core reaches on
the paths megaprm uses (building GPTModel from the local spec, DDP, pipeline schedules,
dist_checkpointing); the redirects below are the list (each names what it stands in for).
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False
_CPU = torch.device("cpu")
_MODE = None  # the installed _CudaToCpuMode


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int)  # a bare int means a CUDA ordinal in torch's API


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites `device="cuda..."` arguments to CPU and makes `.cuda()` a no-op.

    Covers megatron-core's literal CUDA allocations: `total_num_tokens` in
    pipeline_parallel/schedules.py, a warm-up tensor in distributed/param_and_grad_buffer.py,
    broadcasts in tensor_parallel/data.py, the overflow buffer of the optimizer's gradient
    clipping. The model's forward, the loss and the backward step run without it (`paused`,
    `pipeline.run`; the causal masks of the local spec's softmax are redirected below).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0].to(_CPU)
        if func is torch.Tensor.to:
            if args[1:] and _is_cuda(args[1]) and not isinstance(args[1], int):
                args = (args[0], _CPU, *args[2:])
            elif args[1:] and isinstance(args[1], int) and not isinstance(args[1], bool):
                args = (args[0], _CPU, *args[2:])
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        return func(*args, **kwargs)


def _cpu_rng_state(device="cuda", clone=False, graph_safe=False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def install() -> None:
    """Idempotently redirect the CUDA entry points megatron-core uses; no-op with CUDA."""
    global _INSTALLED, _MODE
    if _INSTALLED or torch.cuda.is_available():
        return
    _redirect_entry_points()
    # 4. Literal device="cuda" allocations and .cuda() calls inside megatron-core.
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _INSTALLED = True


@contextlib.contextmanager
def paused():
    """Run a block without the CUDA->CPU function mode: for code that never names CUDA (the
    rollout engine's decode loop, the model's forward and backward, the loss). Inside the mode
    every torch call goes through its Python `__torch_function__` (a measured ~28k calls per RL
    step of the demo's shape, +20% on generation when measured). A no-op where the mode is not
    installed or is not the innermost one (then it stays in force)."""
    from torch.overrides import _get_current_function_mode_stack

    stack = _get_current_function_mode_stack()
    if _MODE is None or not stack or stack[-1] is not _MODE:
        yield
        return
    _MODE.__exit__(None, None, None)
    try:
        yield
    finally:
        _MODE.__enter__()


def _redirect_entry_points() -> None:
    # 1. Layers and schedules ask for the current CUDA device: answer "cpu".
    torch.cuda.current_device = lambda: _CPU
    # 2. Seeding / sync / device queries: the CPU generator stands in for the CUDA one.
    # (torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.empty_cache = lambda: None
    # 3. Megatron's RNG tracker reads/writes CUDA RNG state through two private helpers.
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = _cpu_rng_state
    mp_random._set_cuda_rng_state = _set_cpu_rng_state
    # 5. Code that runs without the function mode (`paused`): the local spec's softmax builds
    # its causal masks with a literal device="cuda"; the schedules' backward step is paused.
    from megatron.core.fusions import fused_softmax
    from megatron.core.pipeline_parallel import schedules

    fused_softmax.get_default_causal_mask = lambda sq: torch.ones(
        sq, sq, dtype=torch.bool, device=_CPU).triu(1)
    fused_softmax.get_sliding_window_causal_mask = _cpu_sliding_window_mask
    schedules.backward_step = _without_mode(schedules.backward_step)
    # 6. The MoE router's gating matmul names `te_general_gemm`, which moe_utils defines only
    # when Transformer Engine imports: None selects its torch.mm path.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # 7. The tp linear layers warn once per process to set CUDA_DEVICE_MAX_CONNECTIONS=1 (a CUDA
    # stream setting; it means nothing on the host): marked as warned already.
    from megatron.core.tensor_parallel import layers

    layers.linear_with_grad_accumulation_and_async_allreduce.warned = True


def _cpu_sliding_window_mask(sq, skv, window_size):
    """megatron.core.transformer.utils.get_sliding_window_causal_mask on the host."""
    m = torch.ones(sq, skv, dtype=torch.bool, device=_CPU)
    return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]),
                       diagonal=skv - sq + window_size[1])


def _without_mode(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with paused():
            return fn(*args, **kwargs)

    return call


def host_only() -> None:
    """Make this process a CPU-only one, on a GPU node too: megaprm's `torch.cuda.is_available()`
    branches (device, backend, initialisation, layer implementation) and megatron-core's CUDA
    entry points (`install`) all take the CPU path. For host work that runs megatron-core in a
    process of its own: checkpoint conversion, whose reads and writes go through the
    parameters' host memory. Call before `init_distributed` builds anything."""
    global _CPU
    torch.cuda.is_available = lambda: False
    _CPU = torch.device("cpu")  # CUDA requests land on the host (whatever the stand-in set)
    _redirect_entry_points()  # again where `install` ran before: every one to the host
    install()


def installed() -> bool:
    return _INSTALLED


@functools.lru_cache(maxsize=None)
def device() -> torch.device:
    """The device megaprm computes on: the local CUDA device if present, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return _CPU
