"""Parameters held by one rank of a tp x pp layout.

`stage_params` builds Megatron's own stage (GPTModel, or the PRM's PRMModel) on the meta device
- no memory, no weights - and counts what one tp rank holds: a parameter Megatron marks
`tensor_model_parallel` is split along its `partition_dim`, the rest (norms, the PRM's score
head) is replicated. One layer is built per stage kind and the rest are copies of it, so a 7B
plan costs milliseconds. `closed_form_params` is the same count written out by hand; the tests
hold the two equal and equal to the stages the trainer really builds.

Mixture-of-experts layers hold a router ([experts, hidden], replicated), num_experts / ep experts
(each a SwiGLU MLP split over tp) and, in Qwen2-MoE, a shared expert with its [1, hidden] gate.
The meta build is a world of one (ep = 1): at ep > 1 the experts of the other ep ranks are taken
off its count. `active_params` counts what one token runs through: the top-k experts of each
layer instead of all of them (the model cards' "activated parameters", embeddings included).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass

from megaprm.models.hf_spec import ModelSpec, decoder_spec, transformer_config
from megaprm.parallel import cpu

PRM_HEADS = ("token_cls", "prm_mlp")


@dataclass(frozen=True)
class StageParams:
    """Parameters of the largest pp stage on one tp rank, and of the whole model."""

    per_rank: int        # the largest stage's share on one tp rank
    total: int           # the model (one copy, unpadded vocabulary counted as Megatron pads it)
    stage: int           # which pp stage is the largest
    active: int = 0      # parameters one token runs through (= total for a dense model)
    expert_per_rank: int = 0  # of per_rank, the MoE experts' (num_experts / ep of each layer)


def _heads_params(spec: ModelSpec) -> int:
    h = spec.hidden_size
    if spec.head == "token_cls":
        return h * spec.num_labels + spec.num_labels
    if spec.head == "prm_mlp":
        return h * h + h + h * 2 + 2
    return 0


def _layer_params(spec: ModelSpec, tp: int, ep: int = 1) -> int:
    h, d = spec.hidden_size, spec.head_dim
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * d
    n = 2 * h                                   # input and pre-MLP RMSNorm (replicated)
    n += qkv * h // tp + spec.num_heads * d * h // tp   # linear_qkv, linear_proj
    n += (qkv // tp) if spec.qkv_bias else 0
    n += 2 * d if spec.qk_norm else 0           # q/k RMSNorm over head_dim (replicated)
    if not spec.is_moe:
        return n + 3 * spec.ffn_hidden_size * h // tp   # fc1 (gate + up), fc2
    n += spec.num_experts * h                   # router (replicated)
    n += _expert_params(spec, tp, ep)
    if spec.shared_expert_ffn_hidden_size:      # shared expert's fc1, fc2 + its gate [1, h]
        n += 3 * spec.shared_expert_ffn_hidden_size * h // tp + h
    return n


def _expert_params(spec: ModelSpec, tp: int, ep: int, experts: int | None = None) -> int:
    """One layer's experts on one rank: `experts` of them (default num_experts / ep), each a
    SwiGLU MLP (fc1 = gate + up, fc2) of width moe_ffn_hidden_size split over tp."""
    n = spec.num_experts // ep if experts is None else experts
    return n * 3 * spec.moe_ffn_hidden_size * spec.hidden_size // tp


def closed_form_params(spec: ModelSpec, tp: int, pp: int, pp_rank: int, ep: int = 1) -> int:
    """This rank's parameters, by hand (the reference `stage_params` is tested against)."""
    h, vp = spec.hidden_size, spec.padded_vocab_size(tp)
    first, last = pp_rank == 0, pp_rank == pp - 1
    n = spec.layers_per_stage(pp) * _layer_params(spec, tp, ep)
    n += vp * h // tp if first else 0
    if last:
        n += h                                  # final norm
        if spec.head in PRM_HEADS:
            n += _heads_params(spec)
        elif not spec.tie_embeddings or not first:
            n += vp * h // tp                   # output layer (a tied copy on the last stage)
    return n


@contextlib.contextmanager
def _world_of_one():
    """A process group of one and Megatron's parallel state at tp = pp = 1, for as long as the
    build lasts (nothing is created when the caller already has one)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    made_pg = made_ps = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), world_size=1, rank=0)
        made_pg = True
    if not ps.model_parallel_is_initialized():
        import torch

        if not torch.cuda.is_available():
            cpu.install()
        ps.initialize_model_parallel(1, 1)
        made_ps = True
    try:
        yield
    finally:
        if made_ps:
            ps.destroy_model_parallel()
        if made_pg:
            dist.destroy_process_group()


def _spec_key(spec: ModelSpec) -> tuple:
    return tuple((f.name, getattr(spec, f.name)) for f in dataclasses.fields(spec)
                 if f.compare and f.name != "rope_scaling")


@functools.lru_cache(maxsize=64)
def _meta_counts(key: tuple, tp: int, pre: bool, post: bool, tie: bool) -> tuple:
    """(stage with one layer, that layer) on one tp rank, counted from a meta-device build."""
    import torch
    from megatron.core.models.gpt import GPTModel

    # deferred: megatron
    from megaprm.models.prm import PRMModel

    spec = ModelSpec(**dict(key))
    one = dataclasses.replace(spec, num_layers=1)
    config = transformer_config(one, tp=1, pp=1, dtype=torch.bfloat16, impl="sdpa",
                                use_cpu_initialization=True, perform_initialization=True)
    cls = GPTModel
    kw = {"share_embeddings_and_output_weights": tie}
    if spec.head in PRM_HEADS:
        cls = functools.partial(PRMModel, head=spec.head, num_labels=spec.num_labels)
        kw = {}
    with _world_of_one(), torch.device("meta"):
        model = cls(config=config, transformer_layer_spec=decoder_spec(one, 1, "sdpa"),
                    vocab_size=spec.padded_vocab_size(tp), max_sequence_length=8,
                    pre_process=pre, post_process=post, position_embedding_type="rope",
                    rotary_base=int(spec.rope_theta), parallel_output=True, **kw)

    def share(p) -> int:
        return p.numel() // tp if getattr(p, "tensor_model_parallel", False) else p.numel()

    stage = sum(share(p) for p in model.parameters())
    layer = sum(share(p) for p in model.decoder.layers[0].parameters())
    return stage, layer


def rank_params(spec: ModelSpec, tp: int, pp: int, pp_rank: int, exact: bool = True,
                ep: int = 1) -> int:
    """Parameters on one rank of stage `pp_rank` (exact: from Megatron's meta-device build)."""
    if not exact:
        return closed_form_params(spec, tp, pp, pp_rank, ep)
    first, last = pp_rank == 0, pp_rank == pp - 1
    # a tied output layer is a separate copy on the last stage when pp > 1
    stage, layer = _meta_counts(_spec_key(spec), tp, first, last, spec.tie_embeddings and first)
    n = stage + (spec.layers_per_stage(pp) - 1) * layer
    if spec.is_moe and ep > 1:  # built at ep = 1: the other ep ranks' experts off
        n -= spec.layers_per_stage(pp) * (_expert_params(spec, tp, 1)
                                          - _expert_params(spec, tp, ep))
    return n


def active_params(spec: ModelSpec) -> int:
    """Parameters one token runs through (whole model, tp = pp = 1): a dense model's all, an MoE
    model's with moe_topk experts per layer instead of num_experts."""
    n = closed_form_params(spec, 1, 1, 0)
    if spec.is_moe:
        n -= spec.num_layers * (_expert_params(spec, 1, 1)
                                - _expert_params(spec, 1, 1, spec.moe_topk))
    return n


def stage_params(spec: ModelSpec, tp: int, pp: int, exact: bool = True,
                 ep: int = 1) -> StageParams:
    spec.check_parallel(tp, pp, ep)
    per = [rank_params(spec, tp, pp, r, exact, ep) for r in range(pp)]
    big = max(range(pp), key=per.__getitem__)
    total = rank_params(spec, 1, 1, 0, exact)
    experts = spec.layers_per_stage(pp) * _expert_params(spec, tp, ep) if spec.is_moe else 0
    return StageParams(per_rank=per[big], total=total, stage=big, active=active_params(spec),
                       expert_per_rank=experts)
