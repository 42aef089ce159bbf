"""Published RL runs the planner is checked against, each with its recipe's workload and
placement, and the efficiencies fitted on them.

NeMo-RL v0.5 performance summary (docs/about/performance-summary.md of NVIDIA-NeMo/RL at commit
9dbd9adc9, "Nemo RL v0.5", H100 BF16; https://docs.nvidia.com/nemo/rl/latest/about/
performance-summary.html), GRPO on OpenMathInstruct-2, DGX-H100, Megatron-core backend. The
recipes are examples/configs/recipes/llm/performance/*.yaml at tag v0.5.0 over
examples/configs/grpo_math_1B.yaml: 64 prompts x 32 generations = 2048 rollouts, training
batch 512 (4 optimiser steps), sequences of at most 4096 tokens (prompt + response), sequence
packing (no padding), a reference model (reference_policy_kl_penalty 0.01) and the trainer's
own old log-probs in every mode, vLLM gpu_memory_utilization 0.6 colocated and 0.8 on
dedicated GPUs, in-flight weight updates in the 1-step off-policy recipes, gradients reduced in bf16
(distributed_data_parallel_config.grad_reduce_in_fp32: false). The table gives the
mean generated length and the step; the mean prompt follows from its tokens/s/GPU (tokens of
the batch over step x GPUs): tokens/s/GPU x step x GPUs / 2048 - mean generated length.

verl (verl-project/verl docs), DAPO on Qwen2.5-Math-7B, 512 prompts x 16 = 8192 rollouts,
mini-batches of 32 prompts (16 optimiser steps), prompts <= 2048 tokens, no reference (no KL),
vLLM, gradient checkpointing, on H20, colocated: docs/advance/one_step_off.md (Megatron tp 2 pp 2
on 16 GPUs, engines tp 2, responses <= 8192: gen 207 s, old_log_prob 119 s, update_actor 344 s,
step 699 s; recipe verl/experimental/one_step_off_policy/shell/dapo_7b_math_megatron_colocate.sh)
and docs/advance/fully_async.md ("colocate sync" on 128 GPUs, FSDP2, responses <= 28K: gen
177.85 s, old_log_prob 53.92 s, update_actor 113.81 s, step 356.30 s). Neither publishes the
mean response length, so only the length-free ratio update / old log-prob is checked on them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megaprm.planner.hardware import DEFAULT_EFFICIENCY, GPUS, Efficiency

NEMO_V05 = ("https://github.com/NVIDIA-NeMo/RL/blob/9dbd9adc9/docs/about/performance-summary.md; "
            "recipes examples/configs/recipes/llm/performance/ at v0.5.0")
VERL_1OFF = "https://github.com/verl-project/verl/blob/main/docs/advance/one_step_off.md"
VERL_ASYNC = "https://github.com/verl-project/verl/blob/main/docs/advance/fully_async.md"


@dataclass(frozen=True)
class PublishedRun:
    name: str
    model: str
    gpu: str
    gpus: int                 # the whole run
    rollout_gpus: int         # dedicated generation GPUs (0: colocated)
    train_tp: int
    train_pp: int
    engine_tp: int
    rollouts: int
    mini_batches: int
    max_seq: int              # prompt + response bound
    max_response: int
    mean_prompt: float | None
    mean_response: float | None   # None: not published
    recompute: bool
    needs_ref: bool
    overlap: bool             # 1-step off-policy: generation overlapped with training
    in_flight: bool
    gpu_memory_utilization: float
    step_s: float
    phases: dict              # published seconds per phase ({} where only the step is)
    source: str
    grad_reduce_in_fp32: bool = True   # NeMo-RL's grpo_math_1B.yaml: false


RUNS = (
    PublishedRun("NeMo-RL v0.5 Llama-3.1-8B GRPO on-policy", "Llama-3.1-8B", "h100", 16, 0,
                 1, 2, 1, 2048, 4, 4096, 4096, 1581 * 92.8 * 16 / 2048 - 1019, 1019, True,
                 True, False, False, 0.6, 92.8, {}, NEMO_V05, False),
    PublishedRun("NeMo-RL v0.5 Llama-3.1-8B GRPO 1-step off", "Llama-3.1-8B", "h100", 16, 8,
                 1, 1, 1, 2048, 4, 4096, 4096, 2478 * 64.8 * 16 / 2048 - 1123, 1123, True,
                 True, True, True, 0.8, 64.8, {}, NEMO_V05, False),
    PublishedRun("NeMo-RL v0.5 Qwen3-32B GRPO on-policy", "Qwen3-32B", "h100", 32, 0, 4, 4, 4,
                 2048, 4, 4096, 4096, 571 * 376 * 32 / 2048 - 3251, 3251, False, True, False,
                 False, 0.6, 376.0, {}, NEMO_V05, False),
    PublishedRun("NeMo-RL v0.5 Qwen3-32B GRPO 1-step off", "Qwen3-32B", "h100", 64, 32, 4, 4,
                 4, 2048, 4, 4096, 4096, 538 * 200 * 64 / 2048 - 3252, 3252, False, True, True,
                 True, 0.8, 200.0, {}, NEMO_V05, False),
    PublishedRun("verl DAPO Qwen2.5-Math-7B colocated, Megatron, 16 x H20", "Qwen2.5-Math-7B",
                 "h20", 16, 0, 2, 2, 2, 8192, 16, 2048 + 8192, 8192, None, None, True, False,
                 False, False, 0.8, 699.0,
                 {"rollout": 207.0, "log-probs": 119.0, "update": 344.0}, VERL_1OFF),
    PublishedRun("verl DAPO Qwen2.5-Math-7B colocated, FSDP2, 128 x H20", "Qwen2.5-Math-7B",
                 "h20", 128, 0, 1, 1, 4, 8192, 16, 2048 + 28 * 1024, 28 * 1024, None, None,
                 True, False, False, False, 0.8, 356.30,
                 {"rollout": 177.85, "log-probs": 53.92, "update": 113.81}, VERL_ASYNC),
)

# The fitted constants are hardware.DEFAULT_EFFICIENCY's (docs/plan.md, "Measured error"):
# logprob_mfu / train_mfu = 0.61 on the two verl runs (their update / old-log-prob ratios 2.89
# and 2.11 under recompute's 4:1 FLOPs: 0.72 and 0.53, the geometric middle); train_mfu on the
# two NeMo-RL 1-step off rows (their trainers bound the step: the value that puts both within
# 15%, +13% and -10%); step_floor_s on the NeMo-RL Llama on-policy row and allreduce_s on the
# Qwen3-32B on-policy row (each reproduced exactly), decode_bw assumed.
FITTED = DEFAULT_EFFICIENCY


def workload_of(run: PublishedRun, mean_response: float | None = None):
    """The run's recipe as a Workload; `mean_response` for the runs that do not publish it
    (default: half the bound, which the ratio checks do not depend on)."""
    # deferred: torch (published imports without it)
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.planner.models import hf_config_for
    from megaprm.planner.workload import Workload

    spec = spec_from_hf(hf_config_for(run.model, "model").config)
    prompt = run.mean_prompt or 512.0
    mean = mean_response or run.mean_response or run.max_response / 2
    return Workload(
        actor=spec, prm=None, world=run.gpus, tp=run.train_tp, pp=run.train_pp, dtype_bytes=2,
        prompts=run.rollouts, n=1, prompt_tokens=int(round(prompt)),
        max_tokens=run.max_seq - int(round(prompt)), mean_prompt=prompt,
        mean_response=mean, micro_batch_size=1, max_tokens_per_micro_batch=run.max_seq,
        mini_batches=run.mini_batches, recompute=run.recompute, needs_ref=run.needs_ref,
        implicit=False, judge=False, engine="vllm",
        gpu_memory_utilization=run.gpu_memory_utilization, rollout_ranks=run.rollout_gpus,
        max_staleness=1 if run.overlap else 0,
        rollout_tp=run.engine_tp if run.rollout_gpus else 1,
        max_response=min(run.max_response, run.max_seq - prompt), in_flight=run.in_flight,
        grad_reduce_in_fp32=run.grad_reduce_in_fp32)


def predicted(run: PublishedRun, eff: Efficiency = FITTED,
              mean_response: float | None = None) -> dict:
    """Seconds per phase and the step (`step`) the planner gives the run."""
    # deferred: torch (published imports without it)
    from megaprm.planner.memory import Params
    from megaprm.planner.params import closed_form_params
    from megaprm.planner.timing import phase_seconds, step_seconds

    w = workload_of(run, mean_response)
    n = closed_form_params(w.actor, 1, 1, 0)
    sec = phase_seconds(w, Params(n, n), GPUS[run.gpu], eff)
    return {**{k: v for k, v in sec.items() if not k.startswith("_")},
            "step": step_seconds(sec, run.overlap)}


def predicted_step(run: PublishedRun, eff: Efficiency = FITTED) -> float:
    return predicted(run, eff)["step"]


def update_logprob_ratio(run: PublishedRun, eff: Efficiency = FITTED) -> float:
    p = predicted(run, eff)
    return p["update"] / p["log-probs"]


def with_efficiency(**changes) -> Efficiency:
    return dataclasses.replace(FITTED, **changes)
