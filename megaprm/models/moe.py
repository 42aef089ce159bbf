"""Megatron's MoE layer as megaprm runs it: tensor parallelism without sequence parallelism.

megaprm keeps sequence parallelism off (whole sequences on every tp rank; the batch-major logits
of `models.actor` rely on it). Megatron-Core 0.16's `MoELayer.forward` refuses tp > 1 without
sequence parallelism in training mode: a performance guard, not a correctness one. Its token
dispatchers treat each tp rank's tokens as that rank's share, gather them over the tp x ep group,
run the experts (each split over tp) and reduce-scatter the outputs back, so with whole
sequences every tp rank computes every token's experts once more, and gets the same output.
tests/models/test_moe.py compares the result with transformers' at tp=2.
"""
from __future__ import annotations


def allow_tp_without_sequence_parallel(model) -> None:
    """Let every MoE layer of `model` run at tp > 1 without sequence parallelism.

    The guard reads `MoELayer.training` and nothing else in MoELayer.forward does (the router
    and the experts are modules with their own flags: the router's load-balancing and z-losses
    read the router's), so a pre-hook clears the layer's flag for the call and a hook restores
    it; the module and its parameter names stay Megatron's."""
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
