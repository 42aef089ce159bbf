"""The one device rule (docs/architecture.md "One device rule").

* A rank's models live on `rank_device()`: `cuda:LOCAL_RANK` when CUDA is present, else the CPU.
  With MEGAPRM_RANKS_SHARE_DEVICE=1 every local rank takes cuda:0 instead: 2-4 ranks on one GPU
  (the GPU session's multi-rank checks, scripts/gpu_session.sh). NCCL refuses two ranks of a
  communicator on one GPU ("Duplicate GPU detected"), so such ranks talk over gloo, with CUDA
  tensors (`default_backend`; MEGAPRM_BACKEND=gloo|nccl forces one).
* Host-side work - tokenising, verifiers, estimators' Python bookkeeping, metrics - stays on the
  CPU. Tensors cross between the two only at phase boundaries, through `to_device` (host ->
  model) and `to_host` (model -> host), so a test can check the rule by looking at devices.
  Host values (`.item()`, `.tolist()`, `.numpy()`, `float()`) are read from host tensors only:
  a value the model's device computed is first brought over by `to_host`.
* Every tensor that changes device goes through `_cross`, one function, so that the CPU
  stand-in test (tests/parallel/test_device.py, model on `meta`) can intercept the crossing.
* Collectives run on the process group's device: CUDA tensors for NCCL, CPU tensors for gloo
  (`comm_device`).
"""
from __future__ import annotations

import dataclasses
import os

import torch


SHARE_ENV = "MEGAPRM_RANKS_SHARE_DEVICE"
BACKEND_ENV = "MEGAPRM_BACKEND"
BACKENDS = ("gloo", "nccl")


def ranks_share_device() -> bool:
    """Every local rank on device 0 (MEGAPRM_RANKS_SHARE_DEVICE=1)."""
    return os.environ.get(SHARE_ENV, "0") not in ("", "0")


def rank_device() -> torch.device:
    if torch.cuda.is_available():
        index = 0 if ranks_share_device() else int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", index)
    return torch.device("cpu")


def default_backend() -> str:
    """The default process group's backend: MEGAPRM_BACKEND when set; else NCCL where each rank
    has its own GPU, gloo where there is no CUDA or local ranks share one GPU (gloo's allreduce,
    broadcast and allgather take CUDA tensors; what else it does on CUDA is measured by
    scripts/gpu_checks.py `collectives`)."""
    forced = os.environ.get(BACKEND_ENV, "")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV}={forced!r}: expected one of {BACKENDS}")
        if forced == "nccl" and not torch.cuda.is_available():
            raise ValueError(f"{BACKEND_ENV}=nccl needs CUDA, and this machine has none; "
                             "unset it (gloo is the CPU's backend)")
        return forced
    if not torch.cuda.is_available():
        return "gloo"
    sharing = ranks_share_device() and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1
    return "gloo" if sharing else "nccl"


# Parameter dtypes by config name. "auto": bf16 where the models run on CUDA (tensor cores; fp32
# with GQA also forces SDPA's slow math kernel there), fp32 on the CPU (bf16 matmuls are slow
# on most CPUs, and the tests compare with transformers in fp32).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)


def resolve_dtype_name(name: str) -> str:
    """A config's dtype name with "auto" resolved for this machine: bf16 on CUDA, else fp32."""
    if name == "auto":
        return "bf16" if torch.cuda.is_available() else "fp32"
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {DTYPE_CHOICES}")
    return name


def resolve_dtype(name: str) -> torch.dtype:
    return DTYPES[resolve_dtype_name(name)]


def configure_cuda_math() -> None:
    """TF32 for the fp32 matmuls left on CUDA (an fp32 run, fp32 heads and losses): ~8x the
    fp32 throughput on Ampere and later, 10-bit mantissa products accumulated in fp32 (cuDNN's
    convolutions use TF32 by default already). No-op without CUDA."""
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")


def model_device(model) -> torch.device:
    """The device of a model's parameters (the CPU for a stage that holds none)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def comm_device(backend: str) -> torch.device:
    """Where a collective's tensors must live for `backend` (nccl: this rank's GPU)."""
    return rank_device() if backend == "nccl" else torch.device("cpu")


def to_device(obj, device: torch.device):
    """Move every tensor inside `obj` (tensors, dataclasses, dicts, lists, tuples) to `device`;
    other values pass through. Returns a new container; tensors already there are not copied."""
    if isinstance(obj, torch.Tensor):
        return _cross(obj, device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: to_device(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def to_host(obj):
    """`to_device(obj, cpu)`: results of the model's device, made readable on the host."""
    return to_device(obj, torch.device("cpu"))


def _cross(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The one place a tensor changes device. Host -> GPU copies are asynchronous (pinned or
    not, stream-ordered before any kernel that reads them); GPU -> host ones are synchronous,
    so the host can read the values right after."""
    if t.device == device:
        return t
    return t.to(device, non_blocking=device.type == "cuda")
