"""The devices the planner knows and the efficiencies it applies to their peak rates.

Peak rates are the vendors' datasheet numbers (dense BF16 tensor-core FLOP/s, HBM bandwidth,
memory). The efficiencies are the fractions of peak that the planner assumes a phase reaches;
docs/plan.md gives each one's source and the error they produce against published runs.
"""
from __future__ import annotations

from dataclasses import dataclass

GiB = 1024 ** 3


@dataclass(frozen=True)
class GPU:
    name: str
    mem_gb: float        # GB (10^9) as sold; `--gpu-mem` overrides
    bf16_tflops: float   # dense, no sparsity
    hbm_tbps: float      # TB/s
    link_gbps: float     # GB/s per GPU within a node (NVLink), one direction
    source: str


# NVIDIA datasheets: H100 SXM5 https://www.nvidia.com/en-us/data-center/h100/ ; H200 SXM
# https://www.nvidia.com/en-us/data-center/h200/ ; A100 SXM 80GB
# https://www.nvidia.com/en-us/data-center/a100/ (dense BF16 = half the "with sparsity" figure).
GPUS = {
    "h100": GPU("h100", 80, 989.0, 3.35, 450.0, "NVIDIA H100 SXM5 datasheet"),
    "h200": GPU("h200", 141, 989.0, 4.8, 450.0, "NVIDIA H200 SXM datasheet"),
    "a100": GPU("a100", 80, 312.0, 2.039, 300.0, "NVIDIA A100 SXM 80GB datasheet"),
}


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak. `train_mfu`: model FLOPs of forward+backward (and forward-only
    log-prob passes) over peak BF16 FLOP/s; Megatron-LM reports up to 47% MFU on H100 for large
    GEMMs (https://github.com/NVIDIA/Megatron-LM README); RL micro-batches of a 7B model are
    shorter, so 0.40 is assumed (not measured: no GPU was at hand). `decode_bw`: fraction of
    HBM bandwidth a vLLM decode step reaches, per-step scheduling and sampling included: 0.32,
    taken from a published run (NeMo-RL's Llama-3.1-8B GRPO on 16 H100,
    `published.calibrated_decode_bw`; its off-policy row is the check). `prefill_mfu`: prompt
    processing in the engine (assumed as train). `link`: NVLink share for the weight sync
    (assumed)."""

    train_mfu: float = 0.40
    prefill_mfu: float = 0.40
    decode_bw: float = 0.32
    link: float = 0.5


DEFAULT_EFFICIENCY = Efficiency()

# Memory no term accounts for: the CUDA context, NCCL buffers, allocator fragmentation and the
# sleeping engine's own state. An assumption (2 GiB), named in every plan.
RUNTIME_OVERHEAD = 2 * GiB
# vLLM's activation/profiling reserve inside its gpu_memory_utilization share (assumed).
ENGINE_RESERVE = 1 * GiB


def gpu_named(name: str, mem_gb: float | None = None) -> GPU:
    key = name.lower().replace("-", "").replace(" ", "")
    key = {"h100sxm": "h100", "h200sxm": "h200", "a10080gb": "a100"}.get(key, key)
    if key not in GPUS:
        raise ValueError(f"--gpu {name!r} is not known; choose one of {', '.join(GPUS)}")
    gpu = GPUS[key]
    if mem_gb is not None:
        if not mem_gb > 0:
            raise ValueError(f"--gpu-mem {mem_gb!r} must be a positive number of GB")
        from dataclasses import replace

        gpu = replace(gpu, mem_gb=float(mem_gb))
    return gpu


def local_gpu() -> GPU | None:
    """The GPU this machine's ranks will run on (its own memory), or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    from dataclasses import replace

    name = torch.cuda.get_device_name(0).lower()
    known = next((g for k, g in GPUS.items() if k in name), GPUS["h100"])
    return replace(known, mem_gb=torch.cuda.get_device_properties(0).total_memory / 1e9)
