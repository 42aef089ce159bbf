"""Seconds per phase of one RL step: FLOPs and bytes over the device's peak rates times an
efficiency (hardware.Efficiency). All GPUs work in parallel on their share.

update     6 x params x tokens (forward + backward, Kaplan et al. 2020 / Megatron's count) plus
           causal attention 6 x layers x (heads x head_dim) x seq per token; x 4/3 with full
           recompute; the 1F1B bubble (pp - 1) / micro-batches on top.
log-probs  forward only (2 x params x tokens + attention) for each model that scores the
           rollouts: the actor's old log-probs, the reference, the PRM (PRIME: implicit PRM
           and its reference).
rollout    vLLM decode is memory bound: every decode step streams the engine's weights, and
           each sequence's KV cache is read once per generated token; prefill is compute
           bound. A batch runs until its longest sequence ends (RL rollouts nearly always have
           one at rollout.max_tokens), so a wave costs max_tokens decode steps; the engine
           runs ceil(sequences / KV-cache concurrency) waves.
overlap    `overlap=True` (a 1-step off-policy schedule: generation of step k+1 runs while step
           k trains; a separate placement with rollout.max_staleness >= 1): the step is the
           longer of rollout and log-probs + update, plus the sync. Separate placement: the
           update and log-probs run on the trainer's GPUs only, each rollout GPU is an engine.
sync       the actor's weights into the engine over NVLink.
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


def phase_seconds(w: Workload, p: Params, gpu: GPU, eff: Efficiency) -> dict:
    peak = gpu.bf16_tflops * 1e12
    bw = gpu.hbm_tbps * 1e12
    seq = w.mean_prompt + w.mean_response
    tokens = w.samples * seq
    fwd_tok = 2 * p.actor_total + _attn_flops_per_token(w, seq)
    micro = max(1, math.ceil(w.samples / w.dp / w.mini_batches
                             / max(1, w.micro_batch_size)))
    bubble = 1 + (w.pp - 1) / micro

    update = 3 * fwd_tok * tokens * (4 / 3 if w.recompute else 1)
    if w.implicit:
        update *= 2
    forwards = 1 + int(w.needs_ref) + (2 if w.implicit else 0)
    logprob = forwards * fwd_tok * tokens
    if p.prm_total:
        logprob += (2 * p.prm_total + _attn_flops_per_token(w, seq)) * tokens
    t_update = update * bubble / (w.trainer_world * peak * eff.train_mfu)
    t_logprob = logprob * bubble / (w.trainer_world * peak * eff.train_mfu)

    # rollout, per engine (colocated one per tp group, its tp ranks splitting weights, KV and
    # FLOPs; separate one per rollout GPU, tp 1)
    S = engine_sequences(w)
    tp = w.engine_tp
    weights = w.dtype_bytes * p.actor_total / tp
    cap_tokens = kv_capacity_tokens(w, gpu.mem_gb * 1e9)
    # vLLM pages the KV cache: a sequence holds blocks for the tokens it has, so the engine
    # runs as many sequences at once as their mean length fits (it preempts past that)
    concurrent = max(1, min(S, int(cap_tokens // (w.mean_prompt + w.mean_response))))
    waves = math.ceil(S / concurrent)
    kv_read = S * kv_bytes_per_token(w) * (w.mean_response * w.mean_prompt
                                           + w.mean_response ** 2 / 2)
    t_decode_mem = (waves * w.max_tokens * weights + kv_read) / (bw * eff.decode_bw)
    decode_flops = S * w.mean_response * fwd_tok / tp
    t_decode = max(t_decode_mem, decode_flops / (peak * eff.train_mfu))
    t_prefill = S * w.mean_prompt * fwd_tok / tp / (peak * eff.prefill_mfu)
    t_sync = weights / (gpu.link_gbps * 1e9 * eff.link)
    return {"rollout": t_decode + t_prefill, "log-probs": t_logprob, "update": t_update,
            "weight sync": t_sync, "_waves": waves, "_concurrent": concurrent}


def step_seconds(seconds: dict, overlap: bool = False) -> float:
    """One step from the phases: their sum, or with generation overlapped with training the
    longer of the two plus the weight sync."""
    if overlap:
        return (max(seconds["rollout"], seconds["log-probs"] + seconds["update"])
                + seconds["weight sync"])
    return sum(v for k, v in seconds.items() if not k.startswith("_"))
