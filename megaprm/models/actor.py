"""The actor: one pipeline stage of a Megatron GPTModel built from an HF config.

Pre/post-process flags follow the stage: only the first stage embeds tokens and only the last
has the final norm + output layer. Logits come back vocab-sharded over tp: [b, s, padded_vocab/tp].

Layer implementation (`impl`, see `hf_spec.IMPLS`): Transformer Engine where it imports with
CUDA, else megaprm's fast local spec (torch SDPA core attention, `models.attention`). Two
switches trade speed for memory or build time: `recompute` (Megatron's full activation
recompute, one layer per checkpoint) and `compile` (torch.compile of each transformer layer).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megaprm.models.hf_spec import ModelSpec, decoder_spec, llama3_inv_freq, transformer_config
from megaprm.models.moe import allow_tp_without_sequence_parallel
from megaprm.parallel.device import resolve_dtype
from megaprm.parallel.groups import Groups


def build_gpt(spec: ModelSpec, *, tp: int, pp: int, pp_rank: int, ep: int = 1,
              dtype: Optional[torch.dtype] = None, impl: Optional[str] = None,
              seq_length: Optional[int] = None, model_cls: Optional[Callable] = None,
              compile=False, recompute: bool = False, **config_overrides):
    """Build this rank's stage of a GPTModel equal to the HF model `spec` describes.

    Megatron's own init fills the weights; load real ones with `models.mapping.load_hf_weights`.
    `model_cls` builds a GPTModel subclass with the same arguments (the PRM: `models.prm`).
    `dtype`: of the parameters (default: bf16 on CUDA, fp32 on the CPU: `device.resolve_dtype`).
    `impl`: "te" | "sdpa" | "local" (default: "te" where TE imports with CUDA, else "sdpa").
    `ep`: expert parallelism of an MoE model (this rank builds num_experts / ep experts).
    `recompute`: recompute each layer's activations in backward (less memory, ~1/3 more
    compute). `compile`: torch.compile each transformer layer (first steps pay the compile);
    True = inductor, a string names another torch.compile backend (tests use "eager").
    """
    from megatron.core.models.gpt import GPTModel

    dtype = dtype if dtype is not None else resolve_dtype("auto")
    if recompute:
        config_overrides = {"recompute_granularity": "full", "recompute_method": "uniform",
                            "recompute_num_layers": 1, **config_overrides}
    config = transformer_config(spec, tp=tp, pp=pp, dtype=dtype, impl=impl, ep=ep,
                                **config_overrides)
    model = (model_cls or GPTModel)(
        config=config,
        transformer_layer_spec=decoder_spec(spec, pp, impl),
        vocab_size=spec.padded_vocab_size(tp),
        max_sequence_length=seq_length or spec.max_position_embeddings,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
        parallel_output=True,
    )
    if spec.is_moe and tp > 1:
        allow_tp_without_sequence_parallel(model, tp)
    inv_freq = llama3_inv_freq(spec)
    if inv_freq is not None:  # the config's own llama3 factors (Megatron hard-codes 1/4/8192)
        model.rotary_pos_emb.inv_freq = inv_freq.to(model.rotary_pos_emb.inv_freq.device)
    if model.post_process and hasattr(model, "output_layer"):
        _batch_major_logits(model.output_layer)
    if torch.cuda.is_available():
        model = model.cuda()
    if compile:
        for layer in model.decoder.layers:  # in place: parameter names stay as they are
            layer.compile(**({"backend": compile} if isinstance(compile, str) else {}))
    model.megaprm_spec = spec  # read by mapping / weight sync; never changes after build
    return model


def build_stage(spec: ModelSpec, groups: Groups, *, dtype=None, **kw):
    """Build this rank's GPTModel stage for `spec` under `groups` (dtype None: bf16 on CUDA,
    fp32 on the CPU)."""
    return build_gpt(spec, tp=groups.tp_size, pp=groups.pp_size, pp_rank=groups.pp_rank,
                     ep=groups.ep_size, dtype=dtype, **kw)


def _batch_major_logits(output_layer) -> None:
    """Let the output layer write its logits [b, s, V/tp] batch-major.

    GPTModel's output layer makes sequence-major logits [s, b, V/tp] and GPTModel returns
    `logits.transpose(0, 1).contiguous()`: a second logits-sized copy, and in backward Megatron
    makes the transposed gradient contiguous again, a third. Fed the hidden states batch-major
    ([b, s, h]: an h-sized copy), the layer (a plain matmul without sequence parallelism)
    computes [b, s, V/tp] directly; handing it back as a [s, b, V/tp] view makes GPTModel's
    transpose a view of a contiguous tensor and its `.contiguous()` a no-op, forward and back.
    Same values; a forward pre-hook and a forward hook, so GPTModel itself is unchanged."""
    assert not output_layer.sequence_parallel, "batch-major logits need sequence_parallel off"
    output_layer.register_forward_pre_hook(
        lambda _m, args: (args[0].transpose(0, 1).contiguous(), *args[1:]))
    output_layer.register_forward_hook(
        lambda _m, _args, out: (out[0].transpose(0, 1), *out[1:]))
