"""What a mixture-of-experts actor adds to a plan: its active and total parameters, the expert
weights each GPU holds at `parallel.ep`, and the all-to-all traffic of its token dispatch.

All-to-all (Megatron's alltoall dispatcher, one dispatch and one combine per MoE layer and pass):
each of a rank's tokens goes to moe_topk experts, (ep - 1) / ep of them on other ranks, as a
hidden-size vector in the model dtype, and comes back the same way. Per step and rank that is
tokens x topk x hidden x bytes x 2 (dispatch + combine) x (ep - 1) / ep x layers x passes, with
passes = 2 for the update (forward and backward each move the tokens both ways), 1 for the old
log-probs (unless the engine's are used) and 1 for a reference model. The time is that over the
GPU's one-direction link bandwidth (NVLink within a node: ep is meant to stay inside one),
without overlap; the step time of `timing` does not include it.
"""
from __future__ import annotations

from dataclasses import dataclass

from megaprm.planner.hardware import GPU
from megaprm.planner.params import StageParams
from megaprm.planner.workload import Workload


@dataclass(frozen=True)
class ExpertPlan:
    active: int            # parameters one token runs through
    total: int
    expert_per_rank: int   # expert parameters on one GPU of the largest stage
    expert_bytes: int      # their weights in the model dtype
    alltoall_bytes: float  # per step and GPU, sent (as much is received)
    alltoall_s: float


def alltoall_bytes(w: Workload) -> float:
    s = w.actor
    if not s.is_moe or w.ep == 1:
        return 0.0
    tokens = w.samples * (w.mean_prompt + w.mean_response) / w.dp
    passes = 2 + (0 if w.rollout_logprobs else 1) + (1 if w.needs_ref else 0)
    per_token = s.moe_topk * s.hidden_size * w.dtype_bytes * 2 * (w.ep - 1) / w.ep
    return tokens * per_token * s.layers_per_stage(w.pp) * passes


def expert_plan(w: Workload, gpu: GPU, actor: StageParams) -> ExpertPlan:
    sent = alltoall_bytes(w)
    return ExpertPlan(active=actor.active, total=actor.total,
                      expert_per_rank=actor.expert_per_rank,
                      expert_bytes=actor.expert_per_rank * w.dtype_bytes,
                      alltoall_bytes=sent, alltoall_s=sent / (gpu.link_gbps * 1e9))


def note(p: ExpertPlan, ep: int) -> str:
    return (f"mixture-of-experts actor: {p.active / 1e9:.2f} B of {p.total / 1e9:.2f} B "
            f"parameters active per token; experts {p.expert_per_rank / 1e9:.2f} B parameters "
            f"({p.expert_bytes / 1e9:.1f} GB) per GPU at parallel.ep={ep}; all-to-all "
            f"{p.alltoall_bytes / 1e9:.1f} GB per GPU and step, ~{p.alltoall_s:.1f} s at the "
            "link's bandwidth (not in the step time)")
