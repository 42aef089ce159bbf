"""Core attention and RMSNorm modules of megaprm's fast local spec (machines without TE).

Megatron's local `DotProductAttention` materialises the [b, np, s, s] scores (and a boolean mask
of the same size), repeats K/V for GQA and runs softmax in eager ops. `SDPAttention` keeps its
constructor and forward contract but calls `torch.nn.functional.scaled_dot_product_attention`,
which picks flash / cuDNN / memory-efficient kernels on GPU and a fused kernel on CPU:

* right-padded causal batches (`attention_mask is None`): `is_causal=True`, no mask tensor at
  all. A padded position attends causally to everything before it, exactly as transformers
  treats right padding, so every real position sees only real tokens;
* GQA: `enable_gqa=True`, K/V are not repeated;
* packed rows (`packed_seq_params.qkv_format == "thd"`, cu_seqlens over one row):
  block-diagonal causal attention without a mask tensor: torch's varlen flash kernel on CUDA
  in bf16/fp16 (GQA included, `varlen_call`), else one causal SDPA call per sequence.

`RMSNorm` holds its weight in the model's params dtype (Megatron's local spec wraps
`torch.nn.RMSNorm`, whose weight stays fp32 in a bf16 model) and calls torch's fused
`F.rms_norm`.

`SwiGLU` is the MLP's activation, silu(gate) * up of fc1's [gate | up] output, as one autograd
function (Megatron's unfused `glu`: `chunk`, `x_linear + 0.0`, silu and mul on strided halves,
and in backward the two halves' gradients `cat`-ed into a new tensor). It saves only fc1's
output and writes both halves' gradients into one buffer. Megatron calls it on the whole fc1
output when `use_te_activation_func` is set (`hf_spec.transformer_config` sets it for this
spec only; the name is Megatron's, the module is this one).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

# torch >= 2.5 repeats K/V inside SDPA's kernels when asked; older torch needs it done here
_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


@functools.lru_cache(maxsize=None)
def _varlen_attn():
    """torch's varlen flash attention (CUDA) as `varlen_call`'s f(q, k, v, cu, max_len, scale),
    or None where this torch has none (then one SDPA call per sequence)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_call(varlen_attn)


def varlen_call(varlen_attn):
    """Causal block-diagonal attention f(q [t, np, hn], k/v [t, ng, hn], cu_seqlens int32,
    max_len, scale) -> [t, np, hn] through a torch `varlen_attn`, whatever its release's
    keywords (read once with inspect), or None if it cannot be made causal.

    * causal: `window_size=(-1, 0)` (torch >= 2.12) or `is_causal=True` (earlier);
    * GQA: `enable_gqa=True` where it exists, else K/V heads repeated to np here (flash's own
      GQA needs no copy; the copy is still one kernel call per layer, not one per sequence);
    * scale: passed where it exists; else q is pre-scaled so that the kernel's 1/sqrt(hn)
      gives `scale` (the same product up to rounding)."""
    import inspect

    params = inspect.signature(varlen_attn).parameters
    kw = {}
    if "window_size" in params:
        kw["window_size"] = (-1, 0)
    elif "is_causal" in params:
        kw["is_causal"] = True
    else:
        return None
    has_gqa, has_scale = "enable_gqa" in params, "scale" in params

    def call(q, k, v, cu, max_len, scale):
        extra = dict(kw)
        if q.shape[1] != k.shape[1]:
            if has_gqa:
                extra["enable_gqa"] = True
            else:
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if scale is not None:
            if has_scale:
                extra["scale"] = scale
            else:
                q = q * (scale * q.shape[-1] ** 0.5)
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **extra)

    return call


def _sdpa(q, k, v, *, mask=None, causal=False, scale=None, dropout=0.0):
    """q [b, np, sq, hn], k/v [b, ng, sk, hn] -> [b, np, sq, hn]."""
    if q.shape[1] != k.shape[1] and not _HAS_GQA:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    kw = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                          is_causal=causal, scale=scale, **kw)


class SDPAttention(DotProductAttention):
    """Megatron core attention on torch SDPA (same constructor / forward contract)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        assert not config.apply_query_key_layer_scaling, "SDPAttention: no query-key scaling"
        assert config.softmax_type == "vanilla", "SDPAttention: vanilla softmax only"
        assert config.window_size is None, "SDPAttention: no sliding window"
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        """bshd: query [sq, b, np, hn], key/value [sk, b, ng, hn] -> [sq, b, np*hn].
        thd (packed): query [t, np, hn], key/value [t, ng, hn] -> [t, np*hn]."""
        assert attention_bias is None, "SDPAttention: attention_bias is not supported"
        dropout = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None:
            assert packed_seq_params.qkv_format == "thd", "SDPAttention: packed rows need thd"
            return self._packed(query, key, value, packed_seq_params, dropout)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if attention_mask is None:
            out = _sdpa(q, k, v, causal=True, scale=self.softmax_scale, dropout=dropout)
        else:  # Megatron's convention: True = masked; SDPA's: True = attend
            out = _sdpa(q, k, v, mask=~attention_mask, scale=self.softmax_scale, dropout=dropout)
        # [b, np, sq, hn] -> [sq, b, np*hn]
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

    def _packed(self, query, key, value, params, dropout):
        t = query.shape[0]
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None \
            else params.cu_seqlens_q
        varlen = _varlen_attn() if query.is_cuda else None
        if varlen is not None and query.dtype in (torch.float16, torch.bfloat16) and dropout == 0:
            out = varlen(query, key, value, cu.to(torch.int32), int(params.max_seqlen_q),
                         self.softmax_scale)
            return out.reshape(t, -1)
        out = packed_attention(query, key, value, cu, scale=self.softmax_scale, dropout=dropout)
        return out.reshape(t, -1)


def packed_attention(query, key, value, cu_seqlens, *, scale=None, dropout=0.0):
    """Block-diagonal causal attention over one packed row: q [t, np, hn], k/v [t, ng, hn] ->
    [t, np, hn], one causal SDPA call per sequence. No [t, t] mask and sum(len^2) work (an
    explicit block mask would cost t^2: a CPU kernel does not skip masked blocks)."""
    # [t, n, d] -> [1, n, t, d]
    q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))
    bounds = cu_seqlens.tolist()
    outs = [_sdpa(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True, scale=scale,
                  dropout=dropout)
            for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return torch.cat(outs, dim=2)[0].permute(1, 0, 2)


class RMSNorm(torch.nn.Module):
    """RMSNorm with its weight in the model's params dtype; torch's fused kernel.

    Constructed like Megatron's norms: RMSNorm(config=, hidden_size=, eps=). The parameter is
    named `weight`, as in torch.nn.RMSNorm, so checkpoints and the HF mapping are unchanged.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        assert config.normalization == "RMSNorm", "megaprm's RMSNorm for RMSNorm configs only"
        assert not config.sequence_parallel, "RMSNorm: sequence parallel is not supported"
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        self.eps = eps
        self.shape = (hidden_size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.shape, self.weight.to(x.dtype), self.eps)


class _SwiGLUFn(torch.autograd.Function):
    """silu(gate) * up of x = [gate | up] (last dim): d up = g * silu(gate),
    d gate = g * up * silu'(gate) (torch's `silu_backward`), both written into one buffer."""

    @staticmethod
    def forward(ctx, x):
        gate, up = x.chunk(2, dim=-1)
        ctx.save_for_backward(x)
        return F.silu(gate).mul_(up)  # in place on silu's fresh output: one buffer, not two

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        grad = torch.empty_like(x)
        d_gate, d_up = grad.chunk(2, dim=-1)
        torch.mul(g, F.silu(gate), out=d_up)
        torch.ops.aten.silu_backward.grad_input(g * up, gate, grad_input=d_gate)
        return grad


class SwiGLU(torch.nn.Module):
    """The MLP's gated activation (Megatron's `MLPSubmodules.activation_func`), for configs with
    silu, a gated linear unit, no offset and no clamp (every HF model megaprm maps)."""

    def __init__(self, config, **_unused):
        super().__init__()
        assert config.gated_linear_unit and config.activation_func is F.silu, \
            "SwiGLU: silu with a gated linear unit only"
        assert not config.glu_linear_offset and config.activation_func_clamp_value is None, \
            "SwiGLU: no glu_linear_offset / activation_func_clamp_value"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SwiGLUFn.apply(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """No state: Megatron's MLP asks each of its children for one when checkpointing."""
        return {}
