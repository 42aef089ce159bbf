"""Hugging Face config (Qwen2 / Qwen2.5, Llama 3.x, Qwen3, Qwen2-MoE, Qwen3-MoE) -> Megatron
TransformerConfig + layer spec.

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
    # mixture-of-experts: the attention of their dense family, every layer's MLP an MoE block
    "Qwen2MoeForCausalLM": "qwen2", "Qwen3MoeForCausalLM": "qwen3",
}
_MOE_ARCHS = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
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
    # mixture-of-experts (num_experts = 0: a dense model). Every layer's MLP is a router over
    # `num_experts` SwiGLU experts of width `moe_ffn_hidden_size`, `moe_topk` chosen per token;
    # `norm_topk_prob`: the chosen probabilities renormalised to sum to 1. Qwen2-MoE adds a
    # shared expert (`shared_expert_ffn_hidden_size`) scaled by sigmoid(its own gate).
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    norm_topk_prob: bool = False
    shared_expert_ffn_hidden_size: int = 0
    router_aux_loss_coef: float = 0.0
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    def padded_vocab_size(self, tp: int, multiple: int = 128) -> int:
        """Megatron pads the vocabulary to a multiple of `multiple * tp` (padded rows are masked)."""
        step = multiple * tp
        return int(math.ceil(self.vocab_size / step) * step)

    def layers_per_stage(self, pp: int) -> int:
        return self.num_layers // pp

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def check_parallel(self, tp: int, pp: int, ep: int = 1) -> None:
        """Raise a clear error when tp/pp/ep cannot split this model evenly (experts are split
        over tp too: Megatron's expert tensor parallelism defaults to tp)."""
        problems = []
        if self.num_heads % tp:
            problems.append(f"num_attention_heads={self.num_heads}")
        if self.num_kv_heads % tp:
            problems.append(f"num_key_value_heads={self.num_kv_heads}")
        if self.is_moe:
            if self.moe_ffn_hidden_size % tp:
                problems.append(f"moe_intermediate_size={self.moe_ffn_hidden_size}")
            if self.shared_expert_ffn_hidden_size % tp:
                problems.append(
                    f"shared_expert_intermediate_size={self.shared_expert_ffn_hidden_size}")
        elif self.ffn_hidden_size % tp:
            problems.append(f"intermediate_size={self.ffn_hidden_size}")
        if problems:
            raise UnsupportedModelError(
                f"tp={tp} does not divide {', '.join(problems)} of {self.architecture}; "
                f"choose a tp that divides them (e.g. tp=1 or a common divisor)")
        if self.num_layers % pp:
            raise UnsupportedModelError(
                f"pp={pp} does not divide num_hidden_layers={self.num_layers}; "
                f"choose pp among the divisors of {self.num_layers}")
        if not isinstance(ep, int) or ep < 1:
            raise UnsupportedModelError(f"ep={ep!r} (parallel.ep / --ep): must be a positive "
                                        "integer")
        if ep > 1 and not self.is_moe:
            raise UnsupportedModelError(
                f"ep={ep} (parallel.ep / --ep) needs a mixture-of-experts model; "
                f"{self.architecture} is dense: use ep=1")
        if self.is_moe and self.num_experts % ep:
            raise UnsupportedModelError(
                f"ep={ep} (parallel.ep / --ep) does not divide num_experts={self.num_experts} of "
                f"{self.architecture}; choose ep among the divisors of {self.num_experts}")


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
    moe = _moe_fields(cfg, arch, unsupported)
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
        ffn_hidden_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"], **moe,
        max_position_embeddings=_get(cfg, "max_position_embeddings", 4096),
        rms_norm_eps=_get(cfg, "rms_norm_eps", 1e-6), rope_theta=float(theta),
        qkv_bias=family == "qwen2" and bool(cfg.get("qkv_bias", True)), qk_norm=family == "qwen3",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", family != "llama")),
        num_labels=_get(cfg, "num_labels", len(cfg.get("id2label") or {}) or 2),
        rope_scaling=dict(rope) if rope_type == "llama3" else None,
        hf_config=cfg,
    )


def _moe_fields(cfg: dict, arch: str, unsupported: list) -> dict:
    """ModelSpec's mixture-of-experts fields from an HF config (transformers 5 writes Qwen3-MoE's
    expert count as num_local_experts, the released configs as num_experts); what Megatron's
    MoE layer would compute differently goes into `unsupported`."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    if arch not in _MOE_ARCHS:
        if experts or cfg.get("moe_intermediate_size"):
            unsupported.append(f"mixture-of-experts (num_experts) on {arch}; MoE is read from "
                               f"{' and '.join(_MOE_ARCHS)}")
        return {}
    if not experts or not cfg.get("moe_intermediate_size") or not cfg.get("num_experts_per_tok"):
        unsupported.append("a mixture-of-experts config without num_experts, "
                           "moe_intermediate_size and num_experts_per_tok")
        return {}
    if _get(cfg, "decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        # Megatron's moe_layer_freq could mix dense and MoE layers; not mapped yet
        unsupported.append(f"dense layers among MoE layers (decoder_sparse_step="
                           f"{cfg.get('decoder_sparse_step')}, mlp_only_layers="
                           f"{cfg.get('mlp_only_layers')}); only every layer MoE")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return dict(num_experts=int(experts), moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                moe_topk=int(cfg["num_experts_per_tok"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                shared_expert_ffn_hidden_size=shared,
                router_aux_loss_coef=float(_get(cfg, "router_aux_loss_coef", 0.0)))


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
    # MoE: Megatron's MoELayer (router + experts + shared expert). Experts are TEGroupedMLP under
    # TE (one grouped GEMM; parameters `experts.linear_fc1.weight{j}`), SequentialMLP on the
    # local specs (one MLP per local expert: `experts.local_experts.{j}.linear_fc1.weight`).
    experts = spec.num_experts or None
    if impl == "te":
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=spec.is_moe, qk_layernorm=spec.qk_norm)
    local = specs.get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=spec.qk_norm,
                                           normalization="RMSNorm")
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
    # called when use_te_activation_func is set: the dense MLP, or each expert and shared expert
    mlps = ([layer.mlp.submodules.experts.submodules, layer.mlp.submodules.shared_experts.submodules]
            if spec.is_moe else [layer.mlp.submodules])
    for mlp in mlps:
        mlp.activation_func = SwiGLU
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


def moe_config(spec: ModelSpec, ep: int = 1, *, aux_loss_coef: float = 0.0,
               z_loss_coef: float = 0.0, dispatcher: Optional[str] = None) -> dict:
    """TransformerConfig fields of Megatron's MoE layer that compute HF's Qwen MoE block.

    HF: p = softmax(router logits) over all experts, the top-k kept, renormalised to sum 1 when
    norm_topk_prob. Megatron's softmax router either takes softmax then top-k
    (moe_router_pre_softmax) or top-k logits then softmax over those k; the latter equals
    p_i / sum_topk p (the softmax's normaliser cancels), so norm_topk_prob picks it.
    `aux_loss_coef` > 0: Megatron's switch load-balancing loss (HF's router_aux_loss_coef
    applies it the same way; off by default for RL); `z_loss_coef` > 0: the router z-loss.
    Tokens are never dropped (no capacity factor), as in HF. `dispatcher` (default: "alltoall"
    on CUDA; on the CPU "allgather", since the all-to-all dispatcher opens a CUDA stream when it
    is built) moves tokens to the ep rank of their experts and back."""
    if not spec.is_moe:
        return {}
    dispatcher = dispatcher or ("alltoall" if torch.cuda.is_available() else "allgather")
    return dict(
        num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_topk=spec.moe_topk, moe_router_score_function="softmax",
        moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if aux_loss_coef > 0 else "none",
        moe_aux_loss_coeff=aux_loss_coef, moe_z_loss_coeff=z_loss_coef or None,
        moe_router_dtype="fp32", moe_token_dispatcher_type=dispatcher,
        moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=spec.shared_expert_ffn_hidden_size > 0,
        moe_grouped_gemm=False, expert_model_parallel_size=ep,
    )


def transformer_config(spec: ModelSpec, tp: int = 1, pp: int = 1,
                       dtype: torch.dtype = torch.float32, impl: Optional[str] = None,
                       ep: int = 1, moe_aux_loss_coef: float = 0.0, moe_z_loss_coef: float = 0.0,
                       **overrides):
    """TransformerConfig equal to the HF model's math (no dropout, no fused CUDA-only kernels),
    for the layer implementation `impl` (default as `layer_spec`'s): the fast local spec's MLP
    calls its own activation module (`attention.SwiGLU`) on the whole fc1 output, which Megatron
    does when `use_te_activation_func` is set. MoE fields: `moe_config` (with the router's
    load-balancing and z-loss coefficients; override any of them here)."""
    from megatron.core.transformer import TransformerConfig

    spec.check_parallel(tp, pp, ep)
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
        **moe_config(spec, ep, aux_loss_coef=moe_aux_loss_coef, z_loss_coef=moe_z_loss_coef),
    )
    if spec.is_moe and impl == "te":
        kwargs["moe_grouped_gemm"] = True  # TEGroupedMLP, as `layer_spec` builds it
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
