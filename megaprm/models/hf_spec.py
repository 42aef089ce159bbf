"""Hugging Face config (Qwen2 / Qwen2.5, Llama 3.x, Qwen3) -> Megatron TransformerConfig + layer spec.

`ModelSpec` is everything needed to build one pipeline stage of a GPTModel that computes the same
function as the HF model. It never imports torch.distributed: the tp/pp sizes come in as ints.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

# architectures -> family. The token-classification and Qwen2.5-Math-PRM heads share the trunk.
_FAMILIES = {
    "Qwen2ForCausalLM": "qwen2", "Qwen2ForTokenClassification": "qwen2",
    "Qwen2ForProcessRewardModel": "qwen2",
    "LlamaForCausalLM": "llama", "LlamaForTokenClassification": "llama",
    "Qwen3ForCausalLM": "qwen3", "Qwen3ForTokenClassification": "qwen3",
}
# HF head kinds: "lm" = lm_head (causal LM), "token_cls" = Linear(hidden, num_labels) named `score`,
# "prm_mlp" = Qwen2.5-Math-PRM's Sequential(Linear(h, h), ReLU, Linear(h, 2)) named `score`.
_HEADS = {"ForCausalLM": "lm", "ForTokenClassification": "token_cls", "ForProcessRewardModel": "prm_mlp"}


class UnsupportedModelError(ValueError):
    """An HF config megaprm cannot reproduce exactly."""


@dataclass(frozen=True)
class ModelSpec:
    """What the HF config says, in the terms Megatron needs (all sizes before tp splitting)."""

    architecture: str
    family: str
    head: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    qk_norm: bool
    tie_embeddings: bool
    num_labels: int = 2
    rope_scaling: Optional[dict] = None
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    def padded_vocab_size(self, tp: int, multiple: int = 128) -> int:
        """Megatron pads the vocabulary to a multiple of `multiple * tp` (padded rows are masked)."""
        step = multiple * tp
        return int(math.ceil(self.vocab_size / step) * step)

    def layers_per_stage(self, pp: int) -> int:
        return self.num_layers // pp

    def check_parallel(self, tp: int, pp: int) -> None:
        """Raise a clear error when tp/pp cannot split this model evenly."""
        problems = []
        if self.num_heads % tp:
            problems.append(f"num_attention_heads={self.num_heads}")
        if self.num_kv_heads % tp:
            problems.append(f"num_key_value_heads={self.num_kv_heads}")
        if self.ffn_hidden_size % tp:
            problems.append(f"intermediate_size={self.ffn_hidden_size}")
        if problems:
            raise UnsupportedModelError(
                f"tp={tp} does not divide {', '.join(problems)} of {self.architecture}; "
                f"choose a tp that divides them (e.g. tp=1 or a common divisor)")
        if self.num_layers % pp:
            raise UnsupportedModelError(
                f"pp={pp} does not divide num_hidden_layers={self.num_layers}; "
                f"choose pp among the divisors of {self.num_layers}")


def _get(cfg: dict, key: str, default=None):
    return cfg.get(key, default) if cfg.get(key) is not None else default


def load_hf_config(path_or_dict) -> dict:
    """config.json of an HF model directory (or the dict itself)."""
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    if hasattr(path_or_dict, "to_dict"):
        return path_or_dict.to_dict()
    path = os.fspath(path_or_dict)
    cfg_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(cfg_file):
        raise FileNotFoundError(
            f"no config.json at {cfg_file!r}: pass an HF model directory (config.json + safetensors)")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError names no file
        raise UnsupportedModelError(f"{cfg_file} is not valid JSON ({e}); restore it or re-save "
                                    "the model with transformers' save_pretrained") from None
    if not isinstance(cfg, dict):
        raise UnsupportedModelError(f"{cfg_file} holds a JSON {type(cfg).__name__}, not the "
                                    "config object of an HF model")
    return cfg


def spec_from_hf(path_or_config) -> ModelSpec:
    """Read an HF config and refuse what the Megatron local/TE spec would silently compute wrong."""
    cfg = load_hf_config(path_or_config)
    archs = cfg.get("architectures") or []
    if len(archs) != 1 or archs[0] not in _FAMILIES:
        raise UnsupportedModelError(
            f"architectures={archs!r} is not supported; supported: {sorted(_FAMILIES)}")
    arch = archs[0]
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "vocab_size")
    missing = [k for k in required if cfg.get(k) is None]
    if missing:
        raise UnsupportedModelError(
            f"{arch} config is missing {missing}: config.json is incomplete (re-save it with "
            "transformers' save_pretrained)")
    family = _FAMILIES[arch]
    head = next(v for k, v in _HEADS.items() if arch.endswith(k))
    unsupported = []
    if cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("moe_intermediate_size"):
        unsupported.append("mixture-of-experts (num_experts/num_local_experts)")
    if cfg.get("use_sliding_window"):
        unsupported.append("sliding window attention (use_sliding_window=true)")
    if cfg.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={cfg.get('hidden_act')!r} (only silu/SwiGLU)")
    if family == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        unsupported.append("attention_bias/mlp_bias on Llama")
    if family == "qwen3" and cfg.get("attention_bias"):
        # q/k/v/o biases: Megatron ties an o_proj bias to MLP biases (add_bias_linear), which
        # Qwen3 does not have, so the biases would be dropped or wrong; refuse instead.
        unsupported.append("attention_bias=true on Qwen3 (q/k/v/o_proj biases)")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    rope_type = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
    if rope_type not in ("default", "llama3"):
        unsupported.append(f"rope_scaling type {rope_type!r} (only default and llama3)")
    if unsupported:
        raise UnsupportedModelError(f"{arch}: unsupported feature(s): {'; '.join(unsupported)}")
    heads = cfg["num_attention_heads"]
    theta = _get(cfg, "rope_theta") or (rope or {}).get("rope_theta") or 10000.0
    return ModelSpec(
        architecture=arch, family=family, head=head,
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        num_heads=heads, num_kv_heads=_get(cfg, "num_key_value_heads", heads),
        head_dim=_get(cfg, "head_dim", cfg["hidden_size"] // heads),
        ffn_hidden_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
        max_position_embeddings=_get(cfg, "max_position_embeddings", 4096),
        rms_norm_eps=_get(cfg, "rms_norm_eps", 1e-6), rope_theta=float(theta),
        qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", family != "llama")),
        num_labels=_get(cfg, "num_labels", len(cfg.get("id2label") or {}) or 2),
        rope_scaling=dict(rope) if rope_type == "llama3" else None,
        hf_config=cfg,
    )


def te_available() -> bool:
    """Transformer Engine spec only when TE imports and CUDA is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


# Layer implementations: "te" = Megatron's Transformer Engine spec (GPU with TE installed);
# "sdpa" = megaprm's fast local spec (Megatron's local spec with core attention on torch SDPA and
# RMSNorm weights in the params dtype, `models.attention`); "local" = Megatron's local spec as is
# (kept as the slow reference the benchmark measures against).
IMPLS = ("te", "sdpa", "local")


def default_impl() -> str:
    return "te" if te_available() else "sdpa"


def layer_spec(spec: ModelSpec, impl: Optional[str] = None):
    """The ModuleSpec of one transformer layer for `impl` (default: TE where it imports, else
    the fast local spec)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    impl = impl or default_impl()
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: choose one of {IMPLS}")
    if impl == "te":
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm)
    local = specs.get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm, normalization="RMSNorm")
    if impl == "local":
        return local
    # deferred: megatron
    from megaprm.models.attention import RMSNorm, SDPAttention, SwiGLU

    layer = local.submodules
    attn = layer.self_attention.submodules
    attn.core_attention = SDPAttention
    if spec.qk_norm:
        attn.q_layernorm = attn.k_layernorm = RMSNorm
    layer.input_layernorm = layer.pre_mlp_layernorm = RMSNorm
    layer.mlp.submodules.activation_func = SwiGLU  # called when use_te_activation_func is set
    return local


def decoder_spec(spec: ModelSpec, pp: int, impl: Optional[str] = None):
    """What GPTModel takes as `transformer_layer_spec`: the layer spec, or for the fast local
    spec a block spec so the final norm is megaprm's RMSNorm too (this stage's layers only)."""
    impl = impl or default_impl()
    layer = layer_spec(spec, impl)
    if impl != "sdpa":
        return layer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock, TransformerBlockSubmodules)

    # deferred: megatron
    from megaprm.models.attention import RMSNorm

    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=[layer] * spec.layers_per_stage(pp), layer_norm=RMSNorm))


def transformer_config(spec: ModelSpec, tp: int = 1, pp: int = 1,
                       dtype: torch.dtype = torch.float32, impl: Optional[str] = None,
                       **overrides):
    """TransformerConfig equal to the HF model's math (no dropout, no fused CUDA-only kernels),
    for the layer implementation `impl` (default as `layer_spec`'s): the fast local spec's MLP
    calls its own activation module (`attention.SwiGLU`) on the whole fc1 output, which Megatron
    does when `use_te_activation_func` is set."""
    from megatron.core.transformer import TransformerConfig

    spec.check_parallel(tp, pp)
    impl = impl or default_impl()
    on_gpu = torch.cuda.is_available()
    kwargs = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads, num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not on_gpu, perform_initialization=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        # The trainer normalises losses by the global token count itself (one place); Megatron
        # must then neither divide by the micro-batch count nor average grads over dp.
        calculate_per_token_loss=True,
        sequence_parallel=False,
        use_te_activation_func=impl == "sdpa",
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def llama3_inv_freq(spec: ModelSpec) -> Optional[torch.Tensor]:
    """HF's llama3 rope scaling with the config's own factors (Megatron hard-codes 1/4/8192)."""
    if not spec.rope_scaling:
        return None
    r = spec.rope_scaling
    factor = float(r.get("factor", 8.0))
    low, high = float(r.get("low_freq_factor", 1.0)), float(r.get("high_freq_factor", 4.0))
    old_ctx = float(r.get("original_max_position_embeddings", 8192))
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float32)
                                     / spec.head_dim))
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, (1 - smooth) * inv / factor + smooth * inv, scaled)
