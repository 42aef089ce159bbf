"""A compact decode step for Llama-family causal LMs (Qwen2, Llama) in the transformers engine.

At the sizes the CPU runs (the demo's policy, the tests' tiny models) a decode step of
transformers' model is bound by per-call work, not arithmetic: each layer goes through module
calls, mask and cache bookkeeping and output dataclasses, and a step costs the same for 32 rows as
for 64 (docs/benchmark-history.md, "RL step vs TRL"). This module computes the same step as a short list of
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
                        a.k_proj.bias, a.v_proj.bias, m.gate_proj.weight, m.up_proj.weight,
                        layer.input_layernorm.weight, layer.post_attention_layernorm.weight)

    def _weights(self) -> list:
        """Per layer: (ln1, qkv weight, qkv bias, o weight^T, ln2, gate/up weight, down weight^T).

        The q/k/v weight also carries rotate_half applied to the q and k rows (a signed
        permutation of each head's rows: exact), so one matmul gives q, k, v and the rotated q
        and k, and the rotary embedding is q * cos + rotate_half(q) * sin with no reshuffle. In
        fp32 the two RMSNorm weights are folded into the columns of the projection after them
        (linear(x / rms(x) * g, W) = linear(x, W * g) / rms(x)), and ln1 / ln2 are None: the
        step then scales the projection's output rows by 1 / rms(x) (`_normed_linear`). The fused
        copies are remade when any of these parameters changes; the others are the parameters
        themselves (transposed views), so in-place updates reach them."""
        key = tuple((p.data_ptr(), p._version) for p in self._params() if p is not None)
        if self._key == key:
            return self._fused
        d = self.model.model.layers[0].self_attn.head_dim
        fused = []
        for layer in self.model.model.layers:
            a, m = layer.self_attn, layer.mlp
            ln1, ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
            parts = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight,
                     _rotated(a.q_proj.weight, d), _rotated(a.k_proj.weight, d)]
            bias = None
            if a.q_proj.bias is not None:
                bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias,
                                  _rotated(a.q_proj.bias, d), _rotated(a.k_proj.bias, d)])
            w_qkv, w_gu = torch.cat(parts), torch.cat([m.gate_proj.weight, m.up_proj.weight])
            if w_qkv.dtype == torch.float32:
                w_qkv, w_gu, ln1, ln2 = w_qkv * ln1, w_gu * ln2, None, None
            fused.append((ln1, w_qkv, bias, a.o_proj.weight.t(), ln2, w_gu,
                          m.down_proj.weight.t()))
        self._fused, self._key = fused, key
        return fused

    def start(self, cache, attention_mask: torch.Tensor, max_new: int) -> None:
        cfg, inner = self.model.config, self.model.model
        b, p = attention_mask.shape
        cap = p + max_new
        self.eps = cfg.rms_norm_eps
        self.eps_t = torch.tensor(self.eps, dtype=torch.float32, device=attention_mask.device)
        self.head_dim = inner.layers[0].self_attn.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.weights = self._weights()  # fixed for the call
        self.col = p  # the next column of the key/value buffers
        self.mask = torch.zeros((b, 1, 1, cap), dtype=self.weights[0][1].dtype,
                                device=attention_mask.device)  # additive: 0 or -inf
        self.mask[:, 0, 0, :p].masked_fill_(attention_mask == 0, float("-inf"))
        # per layer one buffer [b, keys then values of the kv heads, cap, d]: the step writes a
        # column of both with one copy
        self.kv = []
        for layer in cache.layers:
            kv = layer.keys.new_empty((b, 2 * self.n_kv, cap, self.head_dim))
            kv[:, :self.n_kv, :p] = layer.keys
            kv[:, self.n_kv:, :p] = layer.values
            self.kv.append(kv)
        self.live = None  # rows of the buffers still generating (None: all)
        dtype = self.kv[0].dtype
        pos = torch.arange(cap, device=attention_mask.device)[None]
        cos, sin = inner.rotary_emb(self.kv[0], pos)  # [1, cap, head_dim]
        self.cos, self.sin = cos[0].to(dtype), sin[0].to(dtype)

    def select(self, rows: torch.Tensor) -> None:
        """Keep `rows` (indices into the current batch). The buffers are compacted only when at
        most half of their rows are live; until then finished rows ride along unread."""
        live = rows if self.live is None else self.live[rows]
        if 2 * live.numel() > self.mask.shape[0]:
            self.live = live
            return
        self.mask = self.mask[live]
        self.kv = [kv[live] for kv in self.kv]
        self.live = None

    def _normed_linear(self, x, ln, w, b=None):
        """linear(RMSNorm(x) with weight ln, w, b); ln None: folded into w (`_weights`), so the
        output rows are scaled by 1 / rms(x) = rsqrt(|x|^2 / H + eps) instead (3 kernels in
        place of the CPU's ~9-kernel composite rms_norm)."""
        if ln is not None:
            return F.linear(self._norm(x, ln), w, b)
        n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        r = torch.addcmul(self.eps_t, n, n, value=1.0 / x.shape[-1]).rsqrt_()
        y = F.linear(x, w)
        return y.mul_(r) if b is None else torch.addcmul(b, y, r)

    def _norm(self, x, w):
        if x.dtype == torch.float32:
            return torch.rms_norm(x, (x.shape[-1],), w, self.eps)
        return w * torch.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

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
        # the modules' own calls (embedding, final norm, head) spelled as their functions: at
        # the CPU's sizes a module call costs as much as its kernel
        x = F.embedding(tokens, inner.embed_tokens.weight)  # [b, H]
        for (ln1, w_qkv, b_qkv, w_o_t, ln2, w_gu, w_down_t), kv in zip(self.weights, self.kv):
            out = self._normed_linear(x, ln1, w_qkv, b_qkv).view(b, -1, d)
            # [q, k, v | rotate_half(q), rotate_half(k)] heads; rotary in place on q and k, so
            # out[:, nh:nh + 2 nkv] is this step's [keys, values] column
            out[:, :nh + nkv].mul_(cos).addcmul_(out[:, nh + 2 * nkv:], sin)
            kv[:, :, c] = out[:, nh:nh + 2 * nkv]
            # grouped-query heads as queries of their key/value head: [b, nkv, nh/nkv, d]
            o = F.scaled_dot_product_attention(
                out[:, :nh].view(b, nkv, nh // nkv, d), kv[:, :nkv, :c + 1], kv[:, nkv:, :c + 1],
                attn_mask=mask)
            x = torch.addmm(x, o.reshape(b, nh * d), w_o_t)
            gate, up = self._normed_linear(x, ln2, w_gu).chunk(2, -1)
            x = torch.addmm(x, F.silu(gate) * up, w_down_t)
        self.col = c + 1
        head = self.model.lm_head
        logits = F.linear(self._norm(x, inner.norm.weight), head.weight, head.bias).float()
        return logits if self.live is None else logits[self.live]


def _rotated(w: torch.Tensor, d: int) -> torch.Tensor:
    """rotate_half applied to each head's d rows of a projection (weight [heads*d, H] or bias):
    row i of the result is -row (i + d/2) for i < d/2 and row (i - d/2) after."""
    h = w.view(-1, d, *w.shape[1:])
    return torch.cat((-h[:, d // 2:], h[:, :d // 2]), 1).reshape(w.shape)
