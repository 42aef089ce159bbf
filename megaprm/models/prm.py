"""Process reward models: a discriminative PRM (GPTModel trunk + `score` head) and PRIME's implicit PRM.

Discriminative PRM (research notes §2.1, §3.1). The trunk is Megatron's own `GPTModel` built by
`actor.build_gpt`, final norm included; only the last pipeline stage differs: `PRMModel`
overrides the one post-processing hook so the final hidden states [s, b, h] go through a small
head named `score` instead of the vocab-parallel output layer. Two head formats, both 2-class:

* "token_cls" (PURE's PRM, `*ForTokenClassification`): score = Linear(h, 2);
  step score PR = softmax[1] - softmax[0] = 2 p_good - 1, in [-1, 1];
* "prm_mlp" (Qwen2.5-Math-PRM, `Qwen2ForProcessRewardModel`): score = Linear(h, h), ReLU,
  Linear(h, 2); step score = softmax[1] = p_good, in [0, 1].

The head is replicated over tp (the hidden states are too), so it needs no collective in forward
or backward, and its parameters are named `score.*` exactly like the HF checkpoints: the one
mapping (`models.mapping`) loads and exports them unchanged. The output layer GPTModel builds on
the last stage is dropped right after construction (it is never used and must not be trained).

Implicit PRM (PRIME, arXiv 2502.01456; research notes §1.2): per response token
q_t = log pi_prm(y_t | y_<t) - log pi_ref(y_t | y_<t); the process reward of step j is the sum
of q over its tokens (e_{j-1}, e_j]. The log-probs come from two causal-LM actors
(`rewards.scoring.implicit_prm_rewards` runs them); the functions here are the pure tensor math.

This module never imports torch.distributed.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.models.gpt import GPTModel

from megaprm.models import mapping
from megaprm.models.actor import build_gpt
from megaprm.models.hf_spec import ModelSpec

PRM_HEADS = ("token_cls", "prm_mlp")
# HF architecture of each (family, head): what a saved PRM's config.json says.
_PRM_ARCH = {("qwen2", "token_cls"): "Qwen2ForTokenClassification",
             ("qwen2", "prm_mlp"): "Qwen2ForProcessRewardModel",
             ("llama", "token_cls"): "LlamaForTokenClassification",
             ("qwen3", "token_cls"): "Qwen3ForTokenClassification"}


class PRMHeadError(ValueError):
    """A head / model combination a PRM cannot be built from."""


def build_head(head: str, hidden_size: int, num_labels: int, *, dtype: torch.dtype,
               init_std: float, seed: int) -> torch.nn.Module:
    """The `score` module. Initialised from its own generator so every tp rank (which each
    hold a full replica) starts from the same weights whatever their global RNG state."""
    if head == "token_cls":
        score = torch.nn.Linear(hidden_size, num_labels, dtype=dtype)
    elif head == "prm_mlp":
        score = torch.nn.Sequential(torch.nn.Linear(hidden_size, hidden_size, dtype=dtype),
                                    torch.nn.ReLU(),
                                    torch.nn.Linear(hidden_size, num_labels, dtype=dtype))
    else:
        raise PRMHeadError(f"head={head!r}: valid PRM heads are {PRM_HEADS}")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in score.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * init_std)
                m.bias.zero_()
    return score


class PRMModel(GPTModel):
    """One pipeline stage of a PRM: GPTModel, with `score` in place of the output layer.

    On the last stage forward returns head logits [b, s, num_labels] (full, not tp-sharded);
    on the others the hidden states, as GPTModel does. Everything else (embedding, rotary,
    decoder, `set_input_tensor`, `sharded_state_dict`, parameter names) is GPTModel's own.
    """

    def __init__(self, *args, head: str, num_labels: int = 2, head_seed: int = 0,
                 aux_lm: bool = False, **kwargs):
        # Untied: a PRM has no output layer to tie to the embedding (and no embedding-group
        # all-reduce between the first and last stage).
        kwargs["share_embeddings_and_output_weights"] = False
        super().__init__(*args, **kwargs)
        if self.config.mtp_num_layers:
            raise PRMHeadError("a PRM cannot use multi-token prediction (mtp_num_layers)")
        self.prm_head = head
        self.num_labels = num_labels
        self.aux_lm = aux_lm
        self.emit_lm_logits = False  # PRM training switches it on for its auxiliary LM loss
        if self.post_process:
            if not aux_lm:
                del self.output_layer
            self.score = build_head(head, self.config.hidden_size, num_labels,
                                    dtype=self.config.params_dtype,
                                    init_std=self.config.init_method_std, seed=head_seed)

    def _postprocess(self, hidden_states, **_):
        """GPTModel's hook after the decoder: [s, b, h] -> head logits [b, s, num_labels].

        With `aux_lm` and `emit_lm_logits` set, the final hidden states follow the head logits
        on the last dim: [b, s, num_labels + h], for PRM training's auxiliary next-token loss,
        which puts through `lm_logits` only the positions it scores (not every position's
        vocabulary-sized logits: with a 151k vocabulary those dominated a CPU PRM's step).
        The LM head (`output_layer`) has no HF counterpart in a PRM checkpoint, so it is
        neither loaded by `mapping.load_hf_weights` nor exported.
        """
        if not self.post_process:
            return hidden_states
        out = self.score(hidden_states)
        if self.aux_lm and self.emit_lm_logits:
            out = torch.cat([out, hidden_states.to(out.dtype)], dim=-1)
        return out.transpose(0, 1).contiguous()

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This tp rank's vocab-parallel LM logits [n, V/tp] of final hidden states [n, h]
        (the `aux_lm` output layer; every tp rank passes the same rows)."""
        logits, _ = self.output_layer(hidden[:, None, :])  # the layer reads [s, b, h]
        return logits[:, 0]


def as_prm_spec(spec: ModelSpec, head: str) -> ModelSpec:
    """The spec of a PRM with `head` on `spec`'s trunk (an LM spec starts a PRM from an LM)."""
    if head not in PRM_HEADS:
        raise PRMHeadError(f"head={head!r}: valid PRM heads are {PRM_HEADS}")
    if spec.head == head:
        return spec
    if spec.head != "lm":
        raise PRMHeadError(f"{spec.architecture} already has a {spec.head!r} head; "
                           f"cannot turn it into a {head!r} PRM (use head={spec.head!r})")
    arch = _PRM_ARCH.get((spec.family, head))
    if arch is None:
        raise PRMHeadError(f"head={head!r} is not defined for family {spec.family!r}; "
                           f"valid: {sorted(k for k in _PRM_ARCH if k[0] == spec.family)}")
    return dataclasses.replace(spec, architecture=arch, head=head, num_labels=2)


def build_prm(spec: ModelSpec, *, tp: int, pp: int, pp_rank: int,
              dtype: Optional[torch.dtype] = None, head_seed: int = 0, aux_lm: bool = False,
              **kw) -> PRMModel:
    """This rank's stage of the PRM `spec` describes (spec.head in PRM_HEADS). Weights: Megatron's
    init for the trunk, `build_head`'s for the head; load real ones with `mapping.load_hf_weights`
    (a PRM checkpoint) or `load_trunk_from_hf` (an LM checkpoint). `aux_lm` keeps GPTModel's
    vocab-parallel output layer on the last stage for an auxiliary LM loss (training only).
    `dtype`: trunk and head (default: bf16 on CUDA, fp32 on the CPU, like `build_gpt`)."""
    if spec.head not in PRM_HEADS:
        raise PRMHeadError(f"{spec.architecture} has head {spec.head!r}; build a PRM from "
                           f"as_prm_spec(spec, head) with head in {PRM_HEADS}")
    if spec.num_labels != 2:
        raise PRMHeadError(f"{spec.architecture}: num_labels={spec.num_labels}; a PRM head "
                           "has 2 classes (0 = bad step, 1 = good step)")
    cls = functools.partial(PRMModel, head=spec.head, num_labels=2, head_seed=head_seed,
                            aux_lm=aux_lm)
    return build_gpt(spec, tp=tp, pp=pp, pp_rank=pp_rank, dtype=dtype, model_cls=cls, **kw)


@torch.no_grad()
def load_trunk_from_hf(model, model_dir: str, spec: ModelSpec, *, tp_rank: int, tp_size: int,
                       pp: int, pp_rank: int) -> None:
    """Load an HF checkpoint (typically a causal LM) into every non-head parameter of a PRM
    stage (and the LM head of an `aux_lm` PRM); the head keeps its initialisation. Same
    mapping and checks as `load_hf_weights`."""
    rules = [(r, p) for r, p in mapping.stage_rules(model, spec, pp, pp_rank) if r.kind != "head"]
    if getattr(model, "aux_lm", False) and model.post_process:  # the LM head, for aux_lm
        lm_spec = dataclasses.replace(spec, head="lm")
        rules.append((mapping.rule_for("output_layer.weight", lm_spec, pp, pp_rank),
                      model.output_layer.weight))
    weights = mapping.HFWeights(model_dir)
    weights.check([n for r, _ in rules for n in r.hf_names])
    for rule, param in rules:
        shard = mapping.to_megatron_shard(rule, weights, spec, tp_rank, tp_size)
        if shard.shape != param.shape:
            raise ValueError(f"shape mismatch for {rule.megatron_name}: model expects "
                             f"{tuple(param.shape)}, {model_dir!r} gives {tuple(shard.shape)}")
        param.copy_(shard.to(param.dtype))


def hf_prm_config(spec: ModelSpec, **extra) -> dict:
    """config.json of the PRM `spec` describes (the trunk's HF config, the PRM architecture)."""
    cfg = dict(spec.hf_config)
    cfg["architectures"] = [spec.architecture]
    cfg["num_labels"] = 2
    cfg["id2label"] = {"0": "bad", "1": "good"}
    cfg["label2id"] = {"bad": 0, "good": 1}
    cfg.update(extra)
    return cfg


# ------------------------------------------------------------------------------ step scores

@dataclass(frozen=True)
class StepScores:
    """Per-step process rewards of B responses with at most S steps.

    scores [B, S] float32 (0 where ~step_mask); step_mask [B, S] bool;
    logits [B, S, 2] float32 head logits at the scored positions (discriminative PRM only).
    """

    scores: torch.Tensor
    step_mask: torch.Tensor
    logits: Optional[torch.Tensor] = None


def gather_positions(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...] at positions index [B, S] -> [B, S, ...]."""
    idx = index.long().reshape(*index.shape, *([1] * (x.dim() - 2)))
    return x.gather(1, idx.expand(*index.shape, *x.shape[2:]))


def head_step_scores(step_logits: torch.Tensor, step_mask: torch.Tensor, head: str,
                     keep_logits: bool = False) -> StepScores:
    """Head logits at the step-closing positions [B, S, 2] -> StepScores.

    token_cls (PURE): PR = p_good - p_bad; prm_mlp (Qwen2.5-Math-PRM): p_good. fp32 softmax.
    """
    if head not in PRM_HEADS:
        raise PRMHeadError(f"head={head!r}: valid PRM heads are {PRM_HEADS}")
    logits = step_logits.float()
    p = torch.softmax(logits, dim=-1)
    s = p[..., 1] - p[..., 0] if head == "token_cls" else p[..., 1]
    mask = step_mask.bool()
    return StepScores(scores=torch.where(mask, s, torch.zeros_like(s)), step_mask=mask,
                      logits=logits if keep_logits else None)


def implicit_token_rewards(logp_prm: torch.Tensor, logp_ref: torch.Tensor,
                           mask: torch.Tensor) -> torch.Tensor:
    """PRIME's q [B, T] = log pi_prm - log pi_ref on response tokens (0 where mask is 0).

    Raw q, without beta: the original PRIME code stores it so and normalises later (§1.2).
    """
    q = logp_prm.float() - logp_ref.float()
    return torch.where(mask.bool(), q, torch.zeros_like(q))


def implicit_step_scores(q: torch.Tensor, token_to_step: torch.Tensor,
                         step_mask: torch.Tensor) -> StepScores:
    """Step j's reward = sum of q over its tokens (e_{j-1}, e_j], closing token included.

    q [B, T]; token_to_step [B, T] long (-1 on padding, `rewards.steps.segment_steps`);
    step_mask [B, S]. Token granularity is the case where every token closes a step.
    """
    B, S = step_mask.shape
    out = torch.zeros(B, S + 1, dtype=torch.float32, device=q.device)
    slot = torch.where(token_to_step >= 0, token_to_step, S)  # padding -> a dropped column
    out.scatter_add_(1, slot, q.float())
    mask = step_mask.bool()
    return StepScores(scores=torch.where(mask, out[:, :S], torch.zeros_like(out[:, :S])),
                      step_mask=mask)
