"""HF checkpoint names of MoE experts -> the fused expert tensors of transformers' models.

A Qwen2-MoE / Qwen3-MoE checkpoint (and megaprm's weight stream, `weight_sync`) names each
expert's SwiGLU: `model.layers.{L}.mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H],
`down_proj` [H, I]. transformers >= 5 holds a layer's experts fused: `mlp.experts.gate_up_proj`
[E, 2I, H] (expert e's gate in rows [:I], its up in rows [I:], as its forward's
`.chunk(2, dim=-1)` reads them) and `mlp.experts.down_proj` [E, H, I]; its loader converts on
load. vLLM's Qwen MoE models take the checkpoint names themselves (their `load_weights` maps
them onto the fused `w13_weight` / `w2_weight` with an expert id and shard id), so the stream
keeps them and only this engine converts.
"""
from __future__ import annotations

import re
from typing import Optional

import torch

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fused_target(name: str, params: dict) -> Optional[tuple]:
    """(fused parameter name, view of the fused parameter that `name` fills), or None when
    `name` is not a per-expert name or the model holds that expert unfused."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
    fused = f"{prefix}.down_proj" if proj == "down_proj" else f"{prefix}.gate_up_proj"
    p = params.get(fused)
    if p is None or p.dim() != 3 or e >= p.shape[0]:
        return None
    if proj == "down_proj":
        return fused, p[e]
    half = p.shape[1] // 2
    return fused, p[e, :half] if proj == "gate_proj" else p[e, half:]


def pieces(param: torch.Tensor, fused_name: str) -> int:
    """How many per-expert tensors fill a fused parameter (gate + up per expert, or down)."""
    return param.shape[0] * (2 if fused_name.endswith("gate_up_proj") else 1)
