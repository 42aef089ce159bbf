"""Tiny random models of the real architectures, saved in the real HF format.

Tests, the demo and the benchmarks build these instead of downloading anything: transformers'
own classes with small shapes, written with `save_pretrained` (config.json + safetensors).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

FAMILIES = ("qwen2", "llama", "qwen3", "qwen2_moe", "qwen3_moe")


def tiny_config(family: str, *, head: str = "lm", vocab_size: int = 96, hidden_size: int = 64,
                num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                intermediate_size: int = 128, tie: Optional[bool] = None, **extra):
    """A transformers config of `family` with small shapes (GQA on by default)."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size,
                  intermediate_size=intermediate_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=512, rms_norm_eps=1e-6)
    if family == "qwen2":
        cfg = tf.Qwen2Config(**common, rope_theta=10000.0,
                             tie_word_embeddings=True if tie is None else tie)
    elif family == "llama":
        cfg = tf.LlamaConfig(**common, tie_word_embeddings=False if tie is None else tie,
                             rope_theta=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64})
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=hidden_size // num_heads * 2,
                             tie_word_embeddings=False if tie is None else tie,
                             rope_theta=1000000.0)
    elif family == "qwen3_moe":  # 4 experts, 2 per token, renormalised top-k (as Qwen3-30B-A3B)
        cfg = tf.Qwen3MoeConfig(**common, head_dim=hidden_size // num_heads * 2,
                                moe_intermediate_size=intermediate_size // 4, num_experts=4,
                                num_experts_per_tok=2, norm_topk_prob=True,
                                tie_word_embeddings=False if tie is None else tie,
                                rope_theta=1000000.0)
    elif family == "qwen2_moe":  # + a gated shared expert; top-k probabilities not renormalised
        cfg = tf.Qwen2MoeConfig(**common, moe_intermediate_size=intermediate_size // 4,
                                shared_expert_intermediate_size=intermediate_size // 2 + 16,
                                num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                                tie_word_embeddings=False if tie is None else tie,
                                rope_theta=1000000.0)
    else:
        raise ValueError(f"family={family!r}: expected one of {FAMILIES}")
    arch = {"qwen2": "Qwen2", "llama": "Llama", "qwen3": "Qwen3", "qwen2_moe": "Qwen2Moe",
            "qwen3_moe": "Qwen3Moe"}[family]
    cfg.architectures = [arch + {"lm": "ForCausalLM", "token_cls": "ForTokenClassification"}[head]]
    if head == "token_cls":
        cfg.num_labels = 2
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


def build_hf_model(cfg, seed: int = 0):
    """Instantiate the transformers model of `cfg` in fp32 with seeded random weights."""
    import transformers as tf

    torch.manual_seed(seed)
    arch = cfg.architectures[0]
    cls = getattr(tf, arch)
    model = cls(cfg).float().eval()
    # Every tensor random: HF inits norms to 1 and biases to 0, and a zero bias (or a unit norm)
    # looks the same in any order, so a layout bug in one would not change the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
        constant = [n for n, p in model.named_parameters()
                    if p.numel() > 1 and bool((p == p.flatten()[0]).all())]
        assert not constant, f"tiny model tensors left constant: {constant}"
    return model


def save_tiny_model(family: str, out_dir: str, *, seed: int = 0, tokenizer=None, **kw) -> str:
    """Build, save (safetensors) and return the directory of a tiny random `family` model."""
    cfg = tiny_config(family, **kw)
    model = build_hf_model(cfg, seed)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir
