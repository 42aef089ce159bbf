"""Published step times of 7B-class RL runs, the workloads they describe, and the one
efficiency taken from them.

NeMo-RL v0.4 performance summary (docs/about/performance-summary.md of NVIDIA-NeMo/RL,
https://docs.nvidia.com/nemo/rl/latest/about/performance-summary.html), GRPO on
OpenMathInstruct-2, DGX-H100, BF16 training and generation, Megatron-core backend,
Llama-3.1-8B on 16 GPUs, generation TP 1, training TP 1 / PP 1, T-max sequence length 4096,
G-GBS 2048 rollouts per step, T-GBS 512 (4 optimiser steps per step):

    on policy    G-average sequence length 1,060   step 97.7 s
    1-step off   G-average sequence length 1,129   step 74.6 s

The on-policy row calibrates the decode bandwidth efficiency (`calibrated_decode_bw`); the
off-policy row (generation overlapped with training) is the check it is not fitted to.
Assumed where the table is silent: prompts of 128 tokens (OpenMathInstruct-2 problems are
short), vLLM's gpu_memory_utilization 0.6, a reference model (GRPO's KL term) and the old
log-prob pass, no activation recompute.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megaprm.planner.hardware import DEFAULT_EFFICIENCY, GPUS, Efficiency
from megaprm.planner.models import hf_config_for

SOURCE = "https://docs.nvidia.com/nemo/rl/latest/about/performance-summary.html"
PROMPT_TOKENS = 128   # assumed


@dataclass(frozen=True)
class PublishedRun:
    name: str
    model: str
    gpus: int
    gpu: str
    rollouts: int
    mean_seq: float
    max_seq: int
    optimiser_steps: int
    overlap: bool
    step_s: float
    source: str = SOURCE


RUNS = (
    PublishedRun("NeMo-RL v0.4 Llama-3.1-8B GRPO on-policy", "Llama-3.1-8B", 16, "h100", 2048,
                 1060, 4096, 4, False, 97.7),
    PublishedRun("NeMo-RL v0.4 Llama-3.1-8B GRPO 1-step off-policy", "Llama-3.1-8B", 16,
                 "h100", 2048, 1129, 4096, 4, True, 74.6),
)


def workload_of(run: PublishedRun):
    # deferred: torch (published imports without it)
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.planner.workload import Workload

    spec = spec_from_hf(hf_config_for(run.model, "model").config)
    return Workload(actor=spec, prm=None, world=run.gpus, tp=1, pp=1, dtype_bytes=2,
                    prompts=run.rollouts, n=1, prompt_tokens=PROMPT_TOKENS,
                    max_tokens=run.max_seq - PROMPT_TOKENS, mean_prompt=PROMPT_TOKENS,
                    mean_response=run.mean_seq - PROMPT_TOKENS, micro_batch_size=1,
                    max_tokens_per_micro_batch=run.max_seq, mini_batches=run.optimiser_steps,
                    recompute=False, needs_ref=True, implicit=False, judge=False,
                    engine="vllm", gpu_memory_utilization=0.6)


def predicted_step(run: PublishedRun, eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    # deferred: torch (published imports without it)
    from megaprm.planner.memory import Params
    from megaprm.planner.params import closed_form_params
    from megaprm.planner.timing import phase_seconds, step_seconds

    w = workload_of(run)
    n = closed_form_params(w.actor, 1, 1, 0)
    return step_seconds(phase_seconds(w, Params(n, n), GPUS[run.gpu], eff), run.overlap)


def calibrated_decode_bw(run: PublishedRun = RUNS[0]) -> float:
    """The decode bandwidth efficiency at which `run`'s predicted step equals its published
    one (bisection; the step time falls as the efficiency rises)."""
    lo, hi = 0.01, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if predicted_step(run, dataclasses.replace(DEFAULT_EFFICIENCY, decode_bw=mid)) > run.step_s:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
