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
# H20: NVIDIA HGX H20 product brief (148 TFLOP/s dense BF16, 96 GB HBM3 at 4.0 TB/s, NVLink
# 900 GB/s both directions). B200: NVIDIA DGX B200 datasheet
# https://www.nvidia.com/en-us/data-center/dgx-b200/ (72 PFLOP/s FP8 training with sparsity, 1,440
# GB at 64 TB/s over 8 GPUs: 2.25 PFLOP/s dense BF16, 180 GB, 8 TB/s each; NVLink 5 1.8 TB/s).
# GB200: NVIDIA GB200 NVL72 datasheet https://www.nvidia.com/en-us/data-center/gb200-nvl72/ (360
# PFLOP/s FP16/BF16 with sparsity, 13.4 TB HBM3e at 576 TB/s over 72 GPUs: 2.5 PFLOP/s dense,
# 186 GB, 8 TB/s each; NVLink 130 TB/s over 72). MI300X: AMD Instinct MI300X datasheet
# https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html (1,307.4 TFLOP/s dense
# BF16, 192 GB HBM3 at 5.3 TB/s, Infinity Fabric 896 GB/s peak over 7 links, both directions).
GPUS = {
    "h100": GPU("h100", 80, 989.0, 3.35, 450.0, "NVIDIA H100 SXM5 datasheet"),
    "h200": GPU("h200", 141, 989.0, 4.8, 450.0, "NVIDIA H200 SXM datasheet"),
    "a100": GPU("a100", 80, 312.0, 2.039, 300.0, "NVIDIA A100 SXM 80GB datasheet"),
    "h20": GPU("h20", 96, 148.0, 4.0, 450.0, "NVIDIA HGX H20 product brief"),
    "b200": GPU("b200", 180, 2250.0, 8.0, 900.0, "NVIDIA DGX B200 datasheet"),
    "gb200": GPU("gb200", 186, 2500.0, 8.0, 900.0, "NVIDIA GB200 NVL72 datasheet"),
    "mi300x": GPU("mi300x", 192, 1307.4, 5.3, 448.0, "AMD Instinct MI300X datasheet"),
}


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak and fixed costs; docs/plan.md gives each one's source, which published
    runs a fitted one was fitted on, and the error it leaves on the others.

    `train_mfu`: the update's FLOPs (forward + backward, the recompute included) over peak
    BF16; fitted on NeMo-RL's trainer (Megatron with Transformer Engine): megaprm's own actor
    measured 0.36-0.40 on one H100/H200 without Transformer Engine (docs/plan.md), so its
    update may take up to 1.4x the planned time. `logprob_mfu`: the forward-only log-prob passes (old
    log-probs, reference, PRM): smaller GEMM work per launch, the vocabulary's log-softmax and,
    for FSDP, a parameter all-gather per forward; fitted as a ratio to `train_mfu` on verl's two
    colocated H20 runs (`published.py`). `prefill_mfu`: prompt processing in the engine
    (assumed as train). `decode_bw`: the fraction of HBM bandwidth a decode step streams
    weights and KV cache at; `step_floor_s`: the fixed cost of one decode step (scheduling,
    sampling, kernel launches) and `allreduce_s`: one tensor-parallel all-reduce's latency,
    paid twice per layer per step by an engine of tp > 1 (Megatron's layer: after attention
    and after the MLP); the three fitted on NeMo-RL v0.5's on-policy rows (`published.py`).
    `link`: NVLink share for the weight sync (assumed)."""

    train_mfu: float = 0.53      # fitted: NeMo-RL v0.5's two 1-step off-policy rows
    logprob_mfu: float = 0.53 * 0.61   # fitted ratio: verl's two colocated H20 rows
    prefill_mfu: float = 0.53    # assumed as train
    decode_bw: float = 0.5       # assumed
    step_floor_s: float = 3.4e-3   # fitted: NeMo-RL v0.5 Llama-3.1-8B on-policy
    allreduce_s: float = 57e-6     # fitted: NeMo-RL v0.5 Qwen3-32B on-policy (engines tp 4)
    link: float = 0.5            # assumed


DEFAULT_EFFICIENCY = Efficiency()

# Memory no term accounts for: the CUDA context, NCCL buffers, allocator fragmentation and the
# sleeping engine's own state. An assumption (2 GiB), named in every plan.
RUNTIME_OVERHEAD = 2 * GiB
# vLLM's activation/profiling reserve inside its gpu_memory_utilization share (assumed).
ENGINE_RESERVE = 1 * GiB


def gpu_named(name: str, mem_gb: float | None = None) -> GPU:
    key = name.lower().replace("-", "").replace(" ", "")
    key = {"h100sxm": "h100", "h200sxm": "h200", "a10080gb": "a100", "h20sxm": "h20",
           "hgxb200": "b200", "gb200nvl72": "gb200"}.get(key, key)
    if key not in GPUS:
        raise ValueError(f"--gpu {name!r} is not known; choose one of {', '.join(GPUS)}")
    gpu = GPUS[key]
    if mem_gb is not None:
        if not mem_gb > 0:
            raise ValueError(f"--gpu-mem {mem_gb!r} must be a positive number of GB")
        from dataclasses import replace

        gpu = replace(gpu, mem_gb=float(mem_gb))
    return gpu


def gpu_of(name: str, mem_gb: float | None = None, spec: str | None = None) -> GPU:
    """The GPU of `--gpu NAME` or, when given, `--gpu-spec SPEC`; `--gpu-mem` overrides its
    memory either way."""
    if not spec:
        return gpu_named(name, mem_gb)
    gpu = gpu_from_spec(spec)
    if mem_gb is not None:
        if not mem_gb > 0:
            raise ValueError(f"--gpu-mem {mem_gb!r} must be a positive number of GB")
        from dataclasses import replace

        gpu = replace(gpu, mem_gb=float(mem_gb))
    return gpu


SPEC_FIELDS = {"tflops": "bf16_tflops", "hbm_tbps": "hbm_tbps", "mem_gb": "mem_gb",
               "link_gbps": "link_gbps"}


def gpu_from_spec(text: str) -> GPU:
    """`--gpu-spec name=H20,tflops=148,hbm_tbps=4.0,mem_gb=96[,link_gbps=450]`: a GPU the table
    does not hold, from its datasheet (dense BF16 TFLOP/s, HBM TB/s, GB, NVLink GB/s one way;
    without link_gbps 450, an H100's)."""
    example = "name=H20,tflops=148,hbm_tbps=4.0,mem_gb=96[,link_gbps=450]"
    fields = {}
    for item in text.split(","):
        key, sep, value = (x.strip() for x in item.partition("="))
        if not sep or key not in ("name", *SPEC_FIELDS):
            raise ValueError(f"--gpu-spec {text!r}: {item.strip()!r} is not one of name=, "
                             f"{'=, '.join(SPEC_FIELDS)}=; e.g. --gpu-spec {example}")
        fields[key] = value
    missing = [k for k in ("name", "tflops", "hbm_tbps", "mem_gb") if k not in fields]
    if missing:
        raise ValueError(f"--gpu-spec {text!r} lacks {', '.join(missing)}; e.g. --gpu-spec "
                         f"{example}")
    numbers = {}
    for key, attr in SPEC_FIELDS.items():
        if key not in fields:
            continue
        try:
            numbers[attr] = float(fields[key])
        except ValueError:
            numbers[attr] = float("nan")
        if not numbers[attr] > 0:
            raise ValueError(f"--gpu-spec {key}={fields[key]!r} must be a positive number")
    return GPU(fields["name"], numbers["mem_gb"], numbers["bf16_tflops"], numbers["hbm_tbps"],
               numbers.get("link_gbps", 450.0), "--gpu-spec")


def local_gpu() -> GPU | None:
    """The GPU this machine's ranks will run on (its own memory), or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    from dataclasses import replace

    name = torch.cuda.get_device_name(0).lower()
    # the longest name first: "gb200" before "b200", "h200" before "h20"
    known = next((GPUS[k] for k in sorted(GPUS, key=len, reverse=True) if k in name),
                 GPUS["h100"])
    return replace(known, mem_gb=torch.cuda.get_device_properties(0).total_memory / 1e9)
