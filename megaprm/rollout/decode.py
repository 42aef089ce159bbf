"""A compact decode step for Llama-family causal LMs (Qwen2, Llama) in the transformers engine.

At the sizes the CPU runs (the demo's policy, the tests' tiny models) a decode step of
transformers' model is bound by per-call work, not arithmetic: each layer goes through module
calls, mask and cache bookkeeping and output dataclasses, and a step costs the same for 32 rows as
for 64 (BENCHMARKS.md, "RL step vs TRL"). This module computes the same step as a short list of
tensor calls over the model's own parameters, the way a serving engine's model runner does:

* one fused q/k/v projection and one fused gate/up projection per layer (the concatenated
  weights are rebuilt only when a parameter changes: `torch.Tensor._version` counts in-place
  updates such as `load_weights`' `copy_`);
* rotary cos/sin looked up in a table made once per call by the model's own rotary module;
* a preallocated key/value buffer per layer (filled from transformers' prefill cache), written
  one column per step; attention is torch's `scaled_dot_product_attention` with a boolean mask
  over the columns (left-padding of the prompt), grouped-query heads via `enable_gqa`.

The maths is transformers' Qwen2/Llama decoder layer (RMSNorm in fp32 then cast, rotate-half
rotary embedding, softmax attention scaled by head_dim^-0.5, SwiGLU MLP); the prefill stays
transformers' own forward. tests/rollout/test_decode.py checks logits step by step against
transformers' cached forward and the engine's samples against its transformers path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

FAMILIES = ("qwen2", "llama")
_STATIC_ROPE = ("default", "linear", "llama3")


def unsupported(model) -> str | None:
    """Why `model` cannot use the compact step (None when it can)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in FAMILIES:
        return f"model_type {getattr(cfg, 'model_type', None)!r} is not one of {FAMILIES}"
    if getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention"
    rope = getattr(getattr(model.model, "rotary_emb", None), "rope_type", None)
    if rope not in _STATIC_ROPE:
        return f"rope_type {rope!r} (positions-dependent scaling)"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(cfg, 'hidden_act', None)!r}"
    if getattr(cfg, "mlp_bias", False):
        return "MLP bias"
    for layer in model.model.layers:
        attn = layer.self_attn
        if attn.o_proj.bias is not None or abs(attn.scaling - attn.head_dim ** -0.5) > 1e-12:
            return "o_proj bias or a non-default attention scale"
    return None


class CompactDecoder:
    """The decode step of `model` (an `AutoModelForCausalLM` of a FAMILIES architecture).

    `start(cache, attention_mask, max_new)` takes the prefill's `DynamicCache` and mask [b, P];
    `step(tokens [b], positions [b, 1])` returns the next logits [b, V] (fp32) and appends the
    step's keys and values; `select(rows)` keeps only those rows of the batch."""

    def __init__(self, model):
        self.model = model
        self._fused: list | None = None
        self._key: tuple | None = None

    def _params(self):
        for layer in self.model.model.layers:
            a, m = layer.self_attn, layer.mlp
            yield from (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.q_proj.bias,
                        a.k_proj.bias, a.v_proj.bias, m.gate_proj.weight, m.up_proj.weight)

    def _weights(self) -> list:
        """Per layer: (ln1, qkv weight, qkv bias, o weight^T, ln2, gate/up weight, down weight^T).

        The q/k/v weight also carries rotate_half applied to the q and k rows (a signed
        permutation of each head's rows: exact), so one matmul gives q, k, v and the rotated q
        and k, and the rotary embedding is q * cos + rotate_half(q) * sin with no reshuffle. The
        fused copies are remade when a q/k/v or gate/up parameter changes; the others are the
        parameters themselves (transposed views), so in-place updates reach them."""
        key = tuple((p.data_ptr(), p._version) for p in self._params() if p is not None)
        if self._key == key:
            return self._fused
        d = self.model.model.layers[0].self_attn.head_dim
        fused = []
        for layer in self.model.model.layers:
            a, m = layer.self_attn, layer.mlp
            parts = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight,
                     _rotated(a.q_proj.weight, d), _rotated(a.k_proj.weight, d)]
            bias = None
            if a.q_proj.bias is not None:
                bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias,
                                  _rotated(a.q_proj.bias, d), _rotated(a.k_proj.bias, d)])
            fused.append((
                layer.input_layernorm.weight, torch.cat(parts), bias, a.o_proj.weight.t(),
                layer.post_attention_layernorm.weight,
                torch.cat([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight.t()))
        self._fused, self._key = fused, key
        return fused

    def start(self, cache, attention_mask: torch.Tensor, max_new: int) -> None:
        cfg, inner = self.model.config, self.model.model
        b, p = attention_mask.shape
        cap = p + max_new
        self.eps = cfg.rms_norm_eps
        self.head_dim = inner.layers[0].self_attn.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.weights = self._weights()  # fixed for the call
        self.col = p  # the next column of the key/value buffers
        self.mask = torch.zeros((b, 1, 1, cap), dtype=self.weights[0][0].dtype,
                                device=attention_mask.device)  # additive: 0 or -inf
        self.mask[:, 0, 0, :p].masked_fill_(attention_mask == 0, float("-inf"))
        self.keys, self.values = [], []
        for layer in cache.layers:
            k = layer.keys.new_empty((b, self.n_kv, cap, self.head_dim))
            v = layer.values.new_empty((b, self.n_kv, cap, self.head_dim))
            k[:, :, :p] = layer.keys
            v[:, :, :p] = layer.values
            self.keys.append(k)
            self.values.append(v)
        self.live = None  # rows of the buffers still generating (None: all)
        dtype = self.keys[0].dtype
        pos = torch.arange(cap, device=attention_mask.device)[None]
        cos, sin = inner.rotary_emb(self.keys[0], pos)  # [1, cap, head_dim]
        self.cos, self.sin = cos[0].to(dtype), sin[0].to(dtype)

    def select(self, rows: torch.Tensor) -> None:
        """Keep `rows` (indices into the current batch). The buffers are compacted only when at
        most half of their rows are live; until then finished rows ride along unread."""
        live = rows if self.live is None else self.live[rows]
        if 2 * live.numel() > self.mask.shape[0]:
            self.live = live
            return
        self.mask = self.mask[live]
        self.keys = [k[live] for k in self.keys]
        self.values = [v[live] for v in self.values]
        self.live = None

    def _norm(self, x, w):
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        return w * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        inner = self.model.model
        d, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        if self.live is not None:  # finished rows in the buffers: feed them a dummy token
            full = tokens.new_zeros(self.mask.shape[0])
            full[self.live] = tokens
            tokens = full
            full = positions.new_zeros((self.mask.shape[0], 1))
            full[self.live] = positions
            positions = full
        b, c = tokens.shape[0], self.col
        cos = self.cos[positions]  # [b, 1, d]: broadcasts over the heads of [b, heads, d]
        sin = self.sin[positions]
        mask = self.mask[..., :c + 1]
        x = inner.embed_tokens(tokens)  # [b, H]
        for (ln1, w_qkv, b_qkv, w_o_t, ln2, w_gu, w_down_t), k_buf, v_buf in zip(
                self.weights, self.keys, self.values):
            out = F.linear(self._norm(x, ln1), w_qkv, b_qkv).view(b, -1, d)
            # [q, k | v | rotate_half(q), rotate_half(k)] heads
            qk = torch.addcmul(out[:, :nh + nkv] * cos, out[:, nh + 2 * nkv:], sin)
            k_buf[:, :, c] = qk[:, nh:]
            v_buf[:, :, c] = out[:, nh + nkv:nh + 2 * nkv]
            # grouped-query heads as queries of their key/value head: [b, nkv, nh/nkv, d]
            o = F.scaled_dot_product_attention(
                qk[:, :nh].view(b, nkv, nh // nkv, d), k_buf[:, :, :c + 1], v_buf[:, :, :c + 1],
                attn_mask=mask)
            x = torch.addmm(x, o.reshape(b, nh * d), w_o_t)
            gate, up = F.linear(self._norm(x, ln2), w_gu).chunk(2, -1)
            x = torch.addmm(x, F.silu(gate) * up, w_down_t)
        self.col = c + 1
        logits = self.model.lm_head(inner.norm(x)).float()
        return logits if self.live is None else logits[self.live]


def _rotated(w: torch.Tensor, d: int) -> torch.Tensor:
    """rotate_half applied to each head's d rows of a projection (weight [heads*d, H] or bias):
    row i of the result is -row (i + d/2) for i < d/2 and row (i - d/2) after."""
    h = w.view(-1, d, *w.shape[1:])
    return torch.cat((-h[:, d // 2:], h[:, :d // 2]), 1).reshape(w.shape)
