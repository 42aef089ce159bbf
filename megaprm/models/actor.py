"""The actor: one pipeline stage of a Megatron GPTModel built from an HF config.

Pre/post-process flags follow the stage: only the first stage embeds tokens and only the last
has the final norm + output layer. Logits come back vocab-sharded over tp: [b, s, padded_vocab/tp].
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megaprm.models.hf_spec import ModelSpec, layer_spec, llama3_inv_freq, transformer_config


def build_gpt(spec: ModelSpec, *, tp: int, pp: int, pp_rank: int,
              dtype: torch.dtype = torch.float32, use_te: Optional[bool] = None,
              seq_length: Optional[int] = None, model_cls: Optional[Callable] = None,
              **config_overrides):
    """Build this rank's stage of a GPTModel equal to the HF model `spec` describes.

    Megatron's own init fills the weights; load real ones with `models.mapping.load_hf_weights`.
    `model_cls` builds a GPTModel subclass with the same arguments (the PRM: `models.prm`).
    """
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(spec, tp=tp, pp=pp, dtype=dtype, **config_overrides)
    model = (model_cls or GPTModel)(
        config=config,
        transformer_layer_spec=layer_spec(spec, use_te),
        vocab_size=spec.padded_vocab_size(tp),
        max_sequence_length=seq_length or spec.max_position_embeddings,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
        parallel_output=True,
    )
    inv_freq = llama3_inv_freq(spec)
    if inv_freq is not None:  # the config's own llama3 factors (Megatron hard-codes 1/4/8192)
        model.rotary_pos_emb.inv_freq = inv_freq.to(model.rotary_pos_emb.inv_freq.device)
    if torch.cuda.is_available():
        model = model.cuda()
    model.megaprm_spec = spec  # read by mapping / weight sync; never changes after build
    return model
