"""Megatron's MoE layer as megaprm runs it: tensor parallelism without sequence parallelism.

megaprm keeps sequence parallelism off (whole sequences on every tp rank; the batch-major logits
of `models.actor` rely on it). Megatron-Core 0.16's `MoELayer.forward` refuses tp > 1 without
sequence parallelism in training mode: a performance guard. Its token dispatchers treat each tp
rank's tokens as that rank's share: they gather the tokens of the tp x ep group, run each expert
(split over tp) on all of them and reduce-scatter the outputs back. With whole sequences every tp
rank holds the same tokens, so:

* forward: each token comes back with its full expert output (the reduce-scatter sums the tp
  shards' partial outputs of the rank's own copy): the same values as one rank;
* backward: the input, router and shared-expert gradients are right (each copy's gradient is
  reduced the same way), but every expert sees each token tp times, so its weight gradient is
  tp times the true one. A gradient hook divides the expert weights' gradients by tp.

tests/models/test_moe.py compares log-probs and one AdamW step with transformers' at tp=2.
"""
from __future__ import annotations


def allow_tp_without_sequence_parallel(model, tp: int) -> None:
    """Let every MoE layer of `model` run at tp > 1 without sequence parallelism.

    The guard reads `MoELayer.training` and nothing else in MoELayer.forward does (the router
    and the experts are modules with their own flags: the router's load-balancing and z-losses
    read the router's), so a pre-hook clears the layer's flag for the call and a hook restores
    it; the module and its parameter names stay Megatron's. The experts' weight gradients are
    divided by tp (the module docstring says why)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    def clear(module, _args):
        module.megaprm_training = module.training
        module.training = False

    def restore(module, _args, _out):
        module.training = module.megaprm_training

    for m in model.modules():
        if isinstance(m, MoELayer):
            m.register_forward_pre_hook(clear)
            m.register_forward_hook(restore)
            for p in m.experts.parameters():
                p.register_hook(lambda g: g / tp)
