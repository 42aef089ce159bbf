"""Bytes per GPU in the two phases that peak, each term named.

train   the PPO update of the actor (largest pp stage, one tp rank): its parameters, grad
        buffer (fp32, or the parameters' dtype with actor.optim.grad_reduce_in_fp32=false, and
        then the optimiser's fp32 grads of its shard), Adam state (fp32 master copy for bf16
        parameters + two moments, sharded over dp by Megatron's distributed optimizer), the
        models that stay resident (reference, PRM), one micro-batch's activations and its
        logits. The update's rollback copy (`Optimizer.all_or_nothing`, several mini-batches)
        is in host memory (`host_terms`).
sync    the engine's weights awake and loaded while the trainer's state is still on the
        device (it is offloaded after the sync, `*.offload`).
rollout the vLLM engine awake: what the trainer keeps on the device plus the engine's
        `gpu_memory_utilization` share of the GPU (weights + KV cache + its reserve).

KV cache per token (vLLM's formula, vllm/worker cache engine: layers x 2 x kv_heads x head_dim
x dtype bytes), split over the engine's tp ranks.

Separate placement (`rollout.placement=separate`, docs/rollout.md): the trainer's GPUs hold no
engine (no sync phase on them; train as above plus, on trainer rank 0, the two device buckets
the weight versions in flight stream through; the versions themselves, up to max(1, k) packed
HF copies, wait in host memory, rollout/remote.py);
a rollout GPU holds its engine's share alone (tp rollout.tp): the rollout column is that GPU's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megaprm.planner.hardware import ENGINE_RESERVE, RUNTIME_OVERHEAD
from megaprm.planner.params import closed_form_params
from megaprm.planner.workload import Workload
from megaprm.rollout.weight_sync import default_bucket_bytes


@dataclass(frozen=True)
class Params:
    actor_rank: int       # largest stage, one tp rank
    actor_total: int
    prm_rank: int = 0     # discriminative PRM (0: none)
    prm_total: int = 0
    actor_active: int = 0  # parameters one token runs through (MoE: top-k experts); 0 = total

    @property
    def actor_flops_params(self) -> int:
        """The actor's parameters in its per-token FLOPs (2 x this forward): the active ones."""
        return self.actor_active or self.actor_total


def optimizer_bytes_per_param(w: Workload) -> float:
    """Adam: two fp32 moments, plus an fp32 master copy when the parameters are bf16."""
    per = 8 + (4 if w.dtype_bytes == 2 else 0)
    return per / w.dp if w.sharded_optimizer else per


def activation_bytes(w: Workload, tokens: int) -> int:
    """Saved-for-backward bytes of one micro-batch of `tokens` on one rank of the largest stage.

    Per token and layer, counted from what the local SDPA layer keeps alive (measured op by op
    on the CPU, tests/planner/test_plan.py): 5h whole on every tp rank (RMSNorm products and residual
    sums; sequence parallelism is off) and, split over tp, 4 q + 3 k + 3 f (q = heads x
    head_dim, k = kv_heads x head_dim: the qkv projection, RoPE's rotated copies, the attention
    output; f = ffn size: fc1's [gate | up] output and the SwiGLU product, as
    `models.attention.SwiGLU` keeps nothing else; Megatron's unfused `glu` also kept SiLU and a
    copy of up). Outside the layers: the embedding output and the final norm (3h). With full
    recompute only each layer's input (h) is kept, plus one layer recomputed in backward. With
    pp > 1, 1F1B keeps up to pp micro-batches in flight on the first stage."""
    s, b = w.actor, w.dtype_bytes
    h, f = s.hidden_size, s.ffn_hidden_size
    if s.is_moe:  # each token's top-k experts' [gate | up] and products, the shared expert's
        f = s.moe_topk * s.moe_ffn_hidden_size + s.shared_expert_ffn_hidden_size
    q, k = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    layer = b * (5 * h + (4 * q + 3 * k + 3 * f) / w.tp) * tokens
    layers = s.layers_per_stage(w.pp)
    total = (layers * b * h * tokens + layer) if w.recompute else layers * layer
    total += 3 * h * b * tokens
    micro = max(1, w.samples // max(1, w.dp * w.mini_batches * w.micro_batch_size))
    return int(total * min(w.pp, micro))


def logits_bytes(w: Workload, tokens: int) -> int:
    """The last stage's logits [tokens, V/tp] in the model dtype and their gradient, plus the
    fp32 softmax of one log-prob chunk (`models.logprobs`: chunk_tokens at a time, and the
    chunk's gradient)."""
    v = w.actor.padded_vocab_size(w.tp) // w.tp
    chunk = min(tokens, w.logprob_chunk) if w.logprob_chunk else tokens
    return int(tokens * v * w.dtype_bytes * 2 + chunk * v * 4 * 2)


def kv_bytes_per_token(w: Workload) -> float:
    """vLLM: layers x 2 (K and V) x kv_heads x head_dim x dtype bytes, per engine tp rank (KV
    heads are split over tp, and replicated when tp exceeds them)."""
    s = w.actor
    kv_heads = max(1, s.num_kv_heads // w.engine_tp)
    return s.num_layers * 2 * kv_heads * s.head_dim * w.dtype_bytes


def engine_sequences(w: Workload) -> int:
    """Sequences each engine generates per step: colocated one engine per tp group, separate
    one per rollout.tp rollout GPUs."""
    engines = w.rollout_ranks // w.rollout_tp if w.separate else w.world // w.tp
    return math.ceil(w.samples / engines)


def kv_capacity_tokens(w: Workload, gpu_bytes: float) -> float:
    """Tokens of KV cache the engine's share leaves after its weights and reserve."""
    weights = w.dtype_bytes * _engine_params(w)
    free = w.gpu_memory_utilization * gpu_bytes - weights - ENGINE_RESERVE
    return max(0.0, free / kv_bytes_per_token(w))


def _engine_params(w: Workload) -> float:
    return closed_form_params(w.actor, w.engine_tp, 1, 0)


def in_flight_versions(w: Workload) -> int:
    """Weight versions trainer rank 0 may hold packed for the rollout ranks (separate)."""
    return max(1, w.max_staleness) if w.separate else 0


def grad_terms(w: Workload, n: int) -> list:
    """The grad buffer of `n` parameters (Megatron's DDP: fp32, or the parameters' dtype with
    grad_reduce_in_fp32 off) and, in that case, the fp32 grads Megatron's optimiser makes of
    its part at each step (`main_param.grad = model_grad.float()`: the dp shard with the
    distributed optimizer, every parameter without)."""
    if w.grad_reduce_in_fp32 or w.dtype_bytes == 4:
        return [("actor grads (fp32)", n * 4)]
    shard = n * 4 / w.dp if w.sharded_optimizer else n * 4
    return [("actor grads (bf16)", n * w.dtype_bytes),
            ("optimizer's fp32 grads", shard)]


def largest_bucket_bytes(w: Workload) -> int:
    """The largest bucket of the weight stream (rollout/weight_sync.py): 256 MiB, or a whole HF
    tensor larger than that (the embedding or output layer, vocabulary x hidden)."""
    s = w.actor
    return max(default_bucket_bytes(), s.vocab_size * s.hidden_size * w.dtype_bytes)


def host_terms(w: Workload, p: Params) -> list:
    """[(name, bytes)] of host memory per trainer rank: the update's rollback copy
    (`Optimizer.all_or_nothing` with several mini-batches: parameters and optimiser tensors)
    and, on trainer rank 0 of a separate placement, the packed HF weight versions in flight
    (up to max(1, k), rollout/remote.py)."""
    out = []
    if w.mini_batches > 1:
        out.append(("update rollback copy", p.actor_rank * (w.dtype_bytes
                                                            + optimizer_bytes_per_param(w))))
    if w.separate:
        out.append((f"weight versions in flight (x{in_flight_versions(w)}, rank 0)",
                    in_flight_versions(w) * closed_form_params(w.actor, 1, 1, 0)
                    * w.dtype_bytes))
    return out


def train_terms(w: Workload, p: Params) -> list:
    """[(name, bytes)] of the update's peak on one GPU."""
    b = w.dtype_bytes
    tokens = w.micro_tokens
    terms = [("actor weights", p.actor_rank * b), *grad_terms(w, p.actor_rank),
             ("actor optimizer", p.actor_rank * optimizer_bytes_per_param(w))]
    if w.needs_ref and not w.ref_offload:
        terms.append(("reference weights", p.actor_rank * b))
    if w.implicit:  # PRIME's implicit PRM: a second trained policy
        terms.append(("implicit PRM weights+grads+optimizer",
                      p.actor_rank * (b + 4 + optimizer_bytes_per_param(w))))
    if p.prm_rank and not w.prm_offload:
        terms.append(("PRM weights", p.prm_rank * b))
    terms.append(("activations (1 micro-batch)", activation_bytes(w, tokens)))
    terms.append(("logits", logits_bytes(w, tokens)))
    if w.separate:  # rank 0 streams the versions in flight through two device buckets
        terms.append(("weight buckets in flight (rank 0)", 2 * largest_bucket_bytes(w)))
    terms.append(("runtime overhead (assumed)", RUNTIME_OVERHEAD))
    return terms


def _resident(w: Workload, p: Params, offloaded: bool) -> list:
    """The trainer's models on the device outside the update; `offloaded`: after the
    lifecycle moved the `*.offload` ones to host (trainer/lifecycle.py)."""
    b = w.dtype_bytes
    terms = []
    if not (offloaded and w.actor_offload):
        terms += [("actor weights", p.actor_rank * b), grad_terms(w, p.actor_rank)[0],
                  ("actor optimizer", p.actor_rank * optimizer_bytes_per_param(w))]
    if w.needs_ref and not (offloaded and w.ref_offload):
        terms.append(("reference weights", p.actor_rank * b))
    if w.implicit and not (offloaded and w.prm_offload):
        terms.append(("implicit PRM weights+grads+optimizer",
                      p.actor_rank * (b + 4 + optimizer_bytes_per_param(w))))
    if p.prm_rank and not (offloaded and w.prm_offload):
        terms.append(("PRM weights", p.prm_rank * b))
    return terms


def sync_terms(w: Workload, p: Params) -> list:
    """[(name, bytes)] while the engine's weights are awake and loaded, before the trainer's
    state is offloaded (the lifecycle: wake weights -> sync -> offload -> wake KV cache)."""
    if w.engine != "vllm" or w.separate:  # separate: no engine on the trainer's GPUs
        return []
    return [*_resident(w, p, offloaded=False),
            ("vLLM engine weights", _engine_params(w) * w.dtype_bytes),
            ("runtime overhead (assumed)", RUNTIME_OVERHEAD)]


def rollout_terms(w: Workload, p: Params, gpu_bytes: float) -> list:
    """[(name, bytes)] while the engine generates (separate: on a rollout GPU, the engine
    alone)."""
    b = w.dtype_bytes
    terms = [] if w.separate else _resident(w, p, offloaded=True)
    if w.engine == "vllm":
        terms.append((f"vLLM engine ({w.gpu_memory_utilization:g} of the GPU)",
                      w.gpu_memory_utilization * gpu_bytes))
    else:  # transformers generate: weights + the whole batch's KV cache
        terms.append(("HF engine weights", _engine_params(w) * b))
        terms.append(("HF engine KV cache",
                      engine_sequences(w) * w.seq_len * kv_bytes_per_token(w)))
    terms.append(("runtime overhead (assumed)", RUNTIME_OVERHEAD))
    return terms
