"""Seconds per phase of one RL step: FLOPs and bytes over the device's peak rates times an
efficiency, plus fixed per-step costs (hardware.Efficiency). All GPUs work in parallel on
their share.

update     6 x params x tokens (forward + backward, Kaplan et al. 2020 / Megatron's count; an
           MoE actor's active parameters, its top-k experts per token) plus
           causal attention 6 x layers x (heads x head_dim) x seq per token; x 4/3 with full
           recompute; the 1F1B bubble (pp - 1) / micro-batches on top; over `train_mfu`.
log-probs  forward only (2 x params x tokens + attention) for each model that scores the
           rollouts: the actor's old log-probs (not when the engine's log-probs are used),
           the reference, the PRM (PRIME: implicit PRM and its reference); over `logprob_mfu`.
rollout    per engine. Each decode step costs max(bytes / (HBM x decode_bw), FLOPs /
           (peak x prefill_mfu)) plus a floor (`step_floor_s`, and 2 x layers x `allreduce_s`
           for tp > 1). Bytes: the engine's weights once per step, each sequence's KV cache
           once per generated token. Steps: the engine runs as many sequences at once as the
           paged KV cache fits at their mean length (C), so S sequences of mean length m take
           S x m / C steps while it is full; a synchronous batch then waits for its longest
           response (max - m more steps, the tail), which in-flight weight updates and partial
           rollout do not (the engine stays fed). Prefill is compute bound.
overlap    `overlap=True` (a 1-step off-policy schedule: generation of step k+1 runs while step
           k trains; a separate placement with rollout.max_staleness >= 1): the step is the
           longer of rollout and log-probs + update, plus the sync. Separate placement: the
           update and log-probs run on the trainer's GPUs only, each rollout.tp rollout GPUs
           are an engine.
sync       the actor's weights into the engine over NVLink.

A rollout whose KV cache cannot hold one sequence has no time (None: not applicable).
"""
from __future__ import annotations

import math

from megaprm.planner.hardware import GPU, Efficiency
from megaprm.planner.memory import (
    Params,
    engine_sequences,
    kv_bytes_per_token,
    kv_capacity_tokens,
)
from megaprm.planner.workload import Workload


def _attn_flops_per_token(w: Workload, seq: float) -> float:
    """Forward attention FLOPs per token over a causal sequence of `seq` (QK^T and AV, the
    mean context being seq / 2)."""
    s = w.actor
    return 2 * 2 * s.num_layers * s.num_heads * s.head_dim * seq / 2


def decode_steps(w: Workload, sequences: int, concurrent: int) -> float:
    """Decode steps of one engine: S x m / C while full, plus the synchronous batch's tail to
    its longest response (none in flight)."""
    full = sequences * w.mean_response / concurrent
    tail = 0.0 if w.in_flight else max(0.0, w.longest_response - w.mean_response)
    return full + tail


def rollout_seconds(w: Workload, p: Params, gpu: GPU, eff: Efficiency) -> dict:
    """Seconds of one engine's rollout and what they come from; `rollout` None when the KV
    cache cannot hold one sequence."""
    peak = gpu.bf16_tflops * 1e12
    bw = gpu.hbm_tbps * 1e12
    S = engine_sequences(w)
    tp = w.engine_tp
    seq = w.mean_prompt + w.mean_response
    fwd_tok = 2 * p.actor_flops_params + _attn_flops_per_token(w, seq)
    cap_tokens = kv_capacity_tokens(w, gpu.mem_gb * 1e9)
    if cap_tokens < w.prompt_tokens + w.longest_response:
        return {"rollout": None, "_waves": 0, "_concurrent": 0, "_decode_steps": 0}
    # vLLM pages the KV cache: a sequence holds blocks for the tokens it has, so the engine
    # runs as many sequences at once as their mean length fits (it preempts past that)
    concurrent = max(1, min(S, int(cap_tokens // seq)))
    steps = decode_steps(w, S, concurrent)
    weights = w.dtype_bytes * p.actor_total / tp
    kv_read = S * kv_bytes_per_token(w) * (w.mean_response * w.mean_prompt
                                           + w.mean_response ** 2 / 2)
    t_mem = (steps * weights + kv_read) / (bw * eff.decode_bw)
    t_flops = S * w.mean_response * fwd_tok / tp / (peak * eff.prefill_mfu)
    floor = eff.step_floor_s + (2 * w.actor.num_layers * eff.allreduce_s if tp > 1 else 0.0)
    t_decode = max(t_mem, t_flops) + steps * floor
    t_prefill = S * w.mean_prompt * fwd_tok / tp / (peak * eff.prefill_mfu)
    return {"rollout": t_decode + t_prefill, "_waves": math.ceil(S / concurrent),
            "_concurrent": concurrent, "_decode_steps": steps}


def phase_seconds(w: Workload, p: Params, gpu: GPU, eff: Efficiency) -> dict:
    peak = gpu.bf16_tflops * 1e12
    seq = w.mean_prompt + w.mean_response
    tokens = w.samples * seq
    fwd_tok = 2 * p.actor_flops_params + _attn_flops_per_token(w, seq)
    micro = max(1, math.ceil(w.samples / w.dp / w.mini_batches
                             / max(1, w.micro_batch_size)))
    bubble = 1 + (w.pp - 1) / micro

    update = 3 * fwd_tok * tokens * (4 / 3 if w.recompute else 1)
    if w.implicit:
        update *= 2
    forwards = int(not w.rollout_logprobs) + int(w.needs_ref) + (2 if w.implicit else 0)
    logprob = forwards * fwd_tok * tokens
    if p.prm_total:
        logprob += (2 * p.prm_total + _attn_flops_per_token(w, seq)) * tokens
    t_update = update * bubble / (w.trainer_world * peak * eff.train_mfu)
    t_logprob = logprob * bubble / (w.trainer_world * peak * eff.logprob_mfu)

    rollout = rollout_seconds(w, p, gpu, eff)
    weights = w.dtype_bytes * p.actor_total / w.engine_tp
    t_sync = weights / (gpu.link_gbps * 1e9 * eff.link)
    return {"rollout": rollout["rollout"], "log-probs": t_logprob, "update": t_update,
            "weight sync": t_sync, **{k: v for k, v in rollout.items() if k.startswith("_")}}


def step_seconds(seconds: dict, overlap: bool = False) -> float | None:
    """One step from the phases: their sum, or with generation overlapped with training the
    longer of the two plus the weight sync; None when the rollout has no time."""
    if seconds["rollout"] is None:
        return None
    if overlap:
        return (max(seconds["rollout"], seconds["log-probs"] + seconds["update"])
                + seconds["weight sync"])
    return sum(v for k, v in seconds.items() if not k.startswith("_"))
