"""Build one rank's model stage for a spec (LM or PRM head) and run it on a fixed batch.

Causal LMs are `models.actor.build_stage` (GPTModel); PRM heads ("token_cls", "prm_mlp")
are `models.prm.build_prm` (GPTModel trunk whose last stage ends in `score`, HF names `score.*`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megaprm.models.actor import build_stage
from megaprm.models.hf_spec import ModelSpec
from megaprm.parallel import pipeline
from megaprm.parallel.device import to_host
from megaprm.parallel.groups import Groups


def build(spec: ModelSpec, groups: Groups, dtype: torch.dtype, *, init: bool = True):
    """This rank's stage for `spec` (initial weights; load a checkpoint or HF weights into it).
    `init=False` leaves the parameters uninitialised (Megatron's `perform_initialization`):
    for callers that overwrite every one of them (~1 s per 100 M parameters on CPU)."""
    kw = {} if init else {"perform_initialization": False}
    if spec.head == "lm":
        return build_stage(spec, groups, dtype=dtype, **kw)
    # deferred: models.prm imports megatron-core (seconds), which a streamed export never needs
    from megaprm.models.prm import build_prm

    return build_prm(spec, tp=groups.tp_size, pp=groups.pp_size, pp_rank=groups.pp_rank,
                     dtype=dtype, **kw)


def sharded_state_dict(model) -> dict:
    """The stage's sharded state dict (global keys, so it saves/loads at any tp/pp).

    On a PRM's last stage GPTModel's own method fails: LanguageModule marks
    `output_layer.weight` for vocab padding, and PRMModel has removed that layer. With no output
    layer, no tying and no MTP, MegatronModule's generic walk is exactly what remains.
    """
    if getattr(model, "post_process", False) and not hasattr(model, "output_layer"):
        from megatron.core.transformer.module import MegatronModule

        return MegatronModule.sharded_state_dict(model)
    return model.sharded_state_dict()


def full_outputs(model, spec: ModelSpec, groups: Groups, input_ids: torch.Tensor) -> torch.Tensor:
    """Forward a [b, s] batch; every rank gets fp32 [b, s, vocab] logits (LM, tp shards gathered,
    padding rows cut) or [b, s, num_labels] head logits (PRM, replicated over tp), on the host."""
    mb = pipeline.TokenBatch(input_ids, torch.ones_like(input_ids, dtype=torch.float32))

    def post(_mb, out):
        if spec.head == "lm":
            if groups.tp_size > 1:
                parts = [torch.empty_like(out) for _ in range(groups.tp_size)]
                dist.all_gather(parts, out.contiguous(), group=groups.tp)
                out = torch.cat(parts, dim=-1)
            out = out[..., : spec.vocab_size]
        return None, out.detach().float()

    model.eval()
    with torch.no_grad():
        outs = pipeline.run(model, [mb], groups=groups, post=post, forward_only=True)
    return pipeline.broadcast_from_last_stage(to_host(outs[0]) if outs else None, groups)
