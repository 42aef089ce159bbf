"""The single HF <-> Megatron parameter mapping (names and layouts) of megaprm.

Conversion (checkpoint_tools), loading HF weights into a stage, and weight sync into rollout
engines all go through `rule_for` + `to_megatron_shard` / `to_hf`. Layouts handled here:

* fused QKV with GQA interleaving: Megatron stores, per query group g, [q heads of g | k_g | v_g]
  along dim 0; tp splits whole groups, so a full tensor is the concatenation of tp shards.
* fused gate/up: each tp rank holds [gate_r ; up_r] (its slice of each), so the full tensor
  gathered along dim 0 is [gate_0; up_0; gate_1; up_1; ...].
* vocab-parallel embedding / output layer: rows padded to `ModelSpec.padded_vocab_size(tp)`.
* PRM heads: HF `score.*` parameters map to Megatron `score.*` one to one, replicated over tp.

Megatron names are local to a pipeline stage (`decoder.layers.{i}` with i counted from the
stage's first layer); HF names are global (`model.layers.{offset + i}`).

Mixture-of-experts (Qwen2-MoE, Qwen3-MoE): the router `mlp.router.weight` is HF's `mlp.gate.weight`;
expert e's SwiGLU (`mlp.experts.{e}.gate_proj/up_proj/down_proj`) is a gate_up + row pair like a
dense MLP, split over tp the same way (Megatron's expert tensor parallelism = tp). Megatron names an
expert by its index on this ep rank, j (`experts.local_experts.{j}.` on the local specs,
`experts.linear_fc1.weight{j}` in TE's grouped MLP); e = ep_rank * num_experts / ep + j. Qwen2-MoE's
shared expert is `mlp.shared_experts.*` with its sigmoid gate `gate_weight` ([1, hidden]).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import torch

from megaprm.models.hf_spec import ModelSpec, spec_from_hf

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# an expert's parameter: SequentialMLP's `local_experts.{j}.linear_fcN.weight`, or TEGroupedMLP's
# `linear_fcN.weight{j}` -> (j, "linear_fcN.weight")
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12]\.weight)|"
                     r"(linear_fc[12]\.weight)(\d+))$")
_EXPERT_RULES = {"linear_fc1.weight": ("gate_up", ["gate_proj.weight", "up_proj.weight"]),
                 "linear_fc2.weight": ("row", ["down_proj.weight"])}

# Megatron suffix inside a layer -> (kind, HF suffixes). Both the local and the TE layer spec.
_LAYER_RULES = {
    "input_layernorm.weight": ("replicated", ["input_layernorm.weight"]),
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", ["input_layernorm.weight"]),
    "pre_mlp_layernorm.weight": ("replicated", ["post_attention_layernorm.weight"]),
    "mlp.linear_fc1.layer_norm_weight": ("replicated", ["post_attention_layernorm.weight"]),
    "self_attention.q_layernorm.weight": ("replicated", ["self_attn.q_norm.weight"]),
    "self_attention.k_layernorm.weight": ("replicated", ["self_attn.k_norm.weight"]),
    "self_attention.linear_qkv.weight": (
        "qkv", ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]),
    "self_attention.linear_qkv.bias": (
        "qkv", ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]),
    "self_attention.linear_proj.weight": ("row", ["self_attn.o_proj.weight"]),
    "mlp.linear_fc1.weight": ("gate_up", ["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
    "mlp.linear_fc2.weight": ("row", ["mlp.down_proj.weight"]),
    # MoE: router and Qwen2-MoE's shared expert (experts: `_EXPERT`)
    "mlp.router.weight": ("replicated", ["mlp.gate.weight"]),
    "mlp.shared_experts.linear_fc1.weight": (
        "gate_up", ["mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"]),
    "mlp.shared_experts.linear_fc2.weight": ("row", ["mlp.shared_expert.down_proj.weight"]),
    "mlp.shared_experts.gate_weight": ("replicated", ["mlp.shared_expert_gate.weight"]),
}
# tp split dimension of each kind (None = replicated on every tp rank)
TP_DIM = {"replicated": None, "qkv": 0, "gate_up": 0, "row": 1, "vocab": 0, "head": None}


@dataclass(frozen=True)
class Rule:
    """How one Megatron parameter is made of HF tensors."""

    megatron_name: str
    kind: str
    hf_names: tuple

    @property
    def tp_dim(self) -> Optional[int]:
        return TP_DIM[self.kind]


def layer_offset(spec: ModelSpec, pp: int, pp_rank: int) -> int:
    return pp_rank * spec.layers_per_stage(pp)


def rule_for(name: str, spec: ModelSpec, pp: int = 1, pp_rank: int = 0, *, ep: int = 1,
             ep_rank: int = 0) -> Optional[Rule]:
    """The rule of Megatron parameter `name` on stage `pp_rank` (and expert-parallel rank
    `ep_rank` of `ep`); None for parameters that have no HF counterpart of their own (the tied
    output layer copy, a PRM's unused LM head)."""
    m = _LAYER.match(name)
    if m:
        idx, suffix = int(m.group(1)) + layer_offset(spec, pp, pp_rank), m.group(2)
        e = _EXPERT.match(suffix)
        if e:
            j, fc = (int(e.group(1)), e.group(2)) if e.group(1) else (int(e.group(4)), e.group(3))
            expert = ep_rank * (spec.num_experts // ep) + j
            kind, hf = _EXPERT_RULES[fc]
            return Rule(name, kind, tuple(f"model.layers.{idx}.mlp.experts.{expert}.{s}"
                                          for s in hf))
        if suffix not in _LAYER_RULES:
            raise KeyError(f"no HF mapping for Megatron parameter {name!r}")
        kind, hf = _LAYER_RULES[suffix]
        return Rule(name, kind, tuple(f"model.layers.{idx}.{s}" for s in hf))
    if name == "embedding.word_embeddings.weight":
        return Rule(name, "vocab", ("model.embed_tokens.weight",))
    if name == "decoder.final_layernorm.weight":
        return Rule(name, "replicated", ("model.norm.weight",))
    if name == "output_layer.weight":
        if spec.head != "lm":
            return None
        return Rule(name, "vocab", ("model.embed_tokens.weight" if spec.tie_embeddings
                                    else "lm_head.weight",))
    if name.startswith("score."):
        return Rule(name, "head", (name,))
    raise KeyError(f"no HF mapping for Megatron parameter {name!r}")


def is_expert(megatron_name: str) -> bool:
    """Whether a Megatron parameter is one of an MoE layer's experts (split over ep)."""
    m = _LAYER.match(megatron_name)
    return bool(m and _EXPERT.match(m.group(2)))


def exported(rule: Rule) -> bool:
    """A tied output layer is a copy of the embedding: export it once (from the embedding)."""
    return not (rule.megatron_name == "output_layer.weight"
                and rule.hf_names == ("model.embed_tokens.weight",))


def _chunk(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if t.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} does not split over tp={size}")
    return t.chunk(size, dim=dim)[rank]


def _qkv_full(q, k, v, spec: ModelSpec) -> torch.Tensor:
    """[nq*d, ...], [ng*d, ...], [ng*d, ...] -> Megatron's grouped layout [ng*(nq/ng+2)*d, ...]."""
    ng, d = spec.num_kv_heads, spec.head_dim
    per = spec.num_heads // ng
    rest = q.shape[1:]
    q = q.reshape(ng, per * d, *rest)
    k = k.reshape(ng, d, *rest)
    v = v.reshape(ng, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(ng * (per + 2) * d, *rest)


def to_megatron_shard(rule: Rule, get_hf: Callable[[str], torch.Tensor], spec: ModelSpec,
                      tp_rank: int, tp_size: int) -> torch.Tensor:
    """This tp rank's shard of `rule.megatron_name`, built from HF tensors fetched by name."""
    ts = [get_hf(n) for n in rule.hf_names]
    if rule.kind in ("replicated", "head"):
        return ts[0]
    if rule.kind == "qkv":
        return _chunk(_qkv_full(*ts, spec), 0, tp_rank, tp_size)
    if rule.kind == "gate_up":
        return torch.cat([_chunk(ts[0], 0, tp_rank, tp_size), _chunk(ts[1], 0, tp_rank, tp_size)])
    if rule.kind == "row":
        return _chunk(ts[0], 1, tp_rank, tp_size)
    if rule.kind == "vocab":
        padded = spec.padded_vocab_size(tp_size)
        full = torch.zeros(padded, *ts[0].shape[1:], dtype=ts[0].dtype)
        full[: ts[0].shape[0]] = ts[0]
        return _chunk(full, 0, tp_rank, tp_size)
    raise AssertionError(rule.kind)


def row_blocks(rule: Rule, spec: ModelSpec, local_rows: int, tp_rank: int,
               tp_size: int) -> Optional[list]:
    """`to_megatron_shard` as copies of dim-0 row ranges: [(hf_name, src_row, dst_row, n)] with
    shard[dst_row:dst_row + n] = hf[src_row:src_row + n]; shard rows no block covers are zero
    (vocab padding). `local_rows` = the shard's dim 0. None where the shard is not whole rows
    of the HF tensors (a row-parallel weight split over tp > 1): use `to_megatron_shard`.
    Lets a loader read HF bytes straight into a parameter, with no temporary."""
    if rule.kind in ("replicated", "head"):
        return [(rule.hf_names[0], 0, 0, local_rows)]
    if rule.kind == "row":
        return [(rule.hf_names[0], 0, 0, local_rows)] if tp_size == 1 else None
    if rule.kind == "gate_up":
        n = local_rows // 2
        return [(rule.hf_names[0], tp_rank * n, 0, n), (rule.hf_names[1], tp_rank * n, n, n)]
    if rule.kind == "vocab":
        start = tp_rank * local_rows
        n = max(0, min(local_rows, spec.vocab_size - start))
        return [(rule.hf_names[0], start, 0, n)] if n else []
    if rule.kind == "qkv":
        ng, d = spec.num_kv_heads, spec.head_dim
        per = spec.num_heads // ng
        blocks = []
        for j in range(ng // tp_size):  # this rank's query groups: [q heads | k | v] each
            g, base = tp_rank * (ng // tp_size) + j, j * (per + 2) * d
            q, k, v = rule.hf_names
            blocks += [(q, g * per * d, base, per * d), (k, g * d, base + per * d, d),
                       (v, g * d, base + (per + 1) * d, d)]
        return blocks
    raise AssertionError(rule.kind)


def to_hf(rule: Rule, full: torch.Tensor, spec: ModelSpec, tp_size: int) -> list:
    """HF (name, tensor) pairs from a full Megatron tensor (tp shards concatenated on tp_dim)."""
    if rule.kind in ("replicated", "head", "row"):
        return [(rule.hf_names[0], full)]
    if rule.kind == "vocab":
        return [(rule.hf_names[0], full[: spec.vocab_size])]
    if rule.kind == "gate_up":
        rest = full.shape[1:]
        halves = full.reshape(tp_size, 2, -1, *rest)
        gate = halves[:, 0].reshape(-1, *rest)
        up = halves[:, 1].reshape(-1, *rest)
        return [(rule.hf_names[0], gate), (rule.hf_names[1], up)]
    if rule.kind == "qkv":
        ng, d = spec.num_kv_heads, spec.head_dim
        per = spec.num_heads // ng
        rest = full.shape[1:]
        g = full.reshape(ng, (per + 2) * d, *rest)
        q = g[:, : per * d].reshape(ng * per * d, *rest)
        k = g[:, per * d: (per + 1) * d].reshape(ng * d, *rest)
        v = g[:, (per + 1) * d:].reshape(ng * d, *rest)
        return list(zip(rule.hf_names, (q, k, v)))
    raise AssertionError(rule.kind)


def stage_rules(model, spec: ModelSpec, pp: int, pp_rank: int, *, ep: int = 1,
                ep_rank: int = 0) -> Iterator[tuple]:
    """(rule, parameter) for every parameter of a stage that has an HF counterpart, in order."""
    for name, param in model.named_parameters():
        name = name.removeprefix("module.")
        rule = rule_for(name, spec, pp, pp_rank, ep=ep, ep_rank=ep_rank)
        if rule is not None:
            yield rule, param


def required_hf_names(model, spec: ModelSpec, pp: int, pp_rank: int, *, ep: int = 1,
                      ep_rank: int = 0) -> list:
    return [n for rule, _ in stage_rules(model, spec, pp, pp_rank, ep=ep, ep_rank=ep_rank)
            for n in rule.hf_names]


@torch.no_grad()
def load_stage(model, get_hf: Callable[[str], torch.Tensor], spec: ModelSpec, *,
               tp_rank: int, tp_size: int, pp: int, pp_rank: int, ep: int = 1,
               ep_rank: int = 0) -> None:
    """Copy HF tensors into this rank's stage; shape mismatches and NaN/inf name the tensor."""
    for rule, param in stage_rules(model, spec, pp, pp_rank, ep=ep, ep_rank=ep_rank):
        load_param(rule, param, get_hf, spec, tp_rank=tp_rank, tp_size=tp_size)


@torch.no_grad()
def load_param(rule: Rule, param: torch.Tensor, get_hf: Callable[[str], torch.Tensor],
               spec: ModelSpec, *, tp_rank: int, tp_size: int) -> None:
    """`load_stage` for one parameter."""
    shard = to_megatron_shard(rule, get_hf, spec, tp_rank, tp_size)
    # a sum is finite iff every term is (or it overflowed: then the exact test decides);
    # isfinite(...).all() is a bool pass ~8x slower, most of a conversion's read time
    if not math.isfinite(float(shard.sum())) and not torch.isfinite(shard).all():
        bad = [n for n in rule.hf_names if not torch.isfinite(get_hf(n)).all()]
        raise ValueError(f"HF tensor {', '.join(bad or rule.hf_names)} holds NaN/inf: the "
                         "checkpoint is corrupt; re-download or re-save it")
    if shard.shape != param.shape:
        raise ValueError(
            f"shape mismatch for {rule.megatron_name} (from {', '.join(rule.hf_names)}): "
            f"model expects {tuple(param.shape)}, checkpoint gives {tuple(shard.shape)} "
            f"at tp={tp_size}; does config.json match the weights?")
    param.copy_(shard.to(param.dtype))


class HFWeights:
    """Lazy, memory-bounded reader of an HF safetensors checkpoint (single or sharded+index)."""

    def __init__(self, model_dir: str):
        import json
        import os

        from safetensors import safe_open

        self.dir = model_dir
        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(model_dir, "model.safetensors")):
            files, weight_map = ["model.safetensors"], None
        else:
            raise FileNotFoundError(
                f"no model.safetensors or model.safetensors.index.json in {model_dir!r}: "
                "save the model with save_pretrained(..., safe_serialization=True)")
        self._handles = {}
        self._where = {}
        for fname in files:
            path = os.path.join(model_dir, fname)
            try:
                h = safe_open(path, framework="pt")
            except Exception as e:  # truncated / corrupt header
                raise ValueError(f"cannot read safetensors file {path!r} ({e}); "
                                 "the file is truncated or corrupt: re-download or re-save it")
            self._handles[fname] = h
            for k in h.keys():
                self._where[k] = fname
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self._where))
            if missing:
                raise ValueError(f"index.json lists tensors absent from the shards: {missing[:10]}")

    def keys(self) -> list:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(name)
        return self._handles[self._where[name]].get_tensor(name)

    def check(self, required: Iterable[str], *, expected: Optional[Iterable[str]] = None,
              ignore_unexpected: bool = False) -> None:
        """Raise, before any copy, listing every missing tensor and every tensor nothing would
        use. `required`: what this stage loads; `expected`: every HF name of the whole model
        (all stages; default: what the directory's own config.json describes). A tensor outside
        `expected` is as fatal as a missing one (it would be dropped without a word) unless
        `ignore_unexpected`."""
        required = set(required)
        missing = sorted(required - set(self._where))
        if missing:
            raise ValueError(
                f"HF checkpoint {self.dir!r} is missing {len(missing)} tensor(s) the model needs: "
                f"{missing[:20]}{' ...' if len(missing) > 20 else ''}; the checkpoint does not "
                "match its config.json (wrong num_hidden_layers / architecture?) or is incomplete")
        if ignore_unexpected:
            return
        if expected is None:
            import os

            if not os.path.isfile(os.path.join(self.dir, "config.json")):
                return  # nothing describes the checkpoint: only `required` can be checked
            spec = spec_from_hf(self.dir)
        else:
            spec = None
        expected = set(expected) if spec is None else expected_hf_names(spec)
        expected |= required
        unexpected = sorted(n for n in set(self._where) - expected
                            if not n.endswith("rotary_emb.inv_freq"))  # old rope buffers
        hint = ""
        if "lm_head.weight" in unexpected and "model.embed_tokens.weight" in self._where:
            # A tied model may store its output layer: harmless only if it is the embedding.
            if torch.equal(self("lm_head.weight"), self("model.embed_tokens.weight")):
                unexpected.remove("lm_head.weight")
            else:
                hint = (" (lm_head.weight differs from model.embed_tokens.weight: set "
                        "tie_word_embeddings=false in config.json if the model has its own "
                        "LM head)")
        if unexpected:
            raise ValueError(
                f"HF checkpoint {self.dir!r} holds {len(unexpected)} tensor(s) the model would "
                f"not use: {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}{hint}; its "
                "config.json does not describe them (biases? more layers? another head?): fix "
                "config.json, or pass ignore_unexpected=True to drop them knowingly")


def expected_hf_names(spec: ModelSpec) -> set:
    """Every HF tensor name of the whole model `spec` describes (all pipeline stages)."""
    layer = ["input_layernorm.weight", "post_attention_layernorm.weight",
             "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight"]
    mlp = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    if spec.is_moe:
        layer += ["mlp.gate.weight"] + [f"mlp.experts.{e}.{s}" for e in range(spec.num_experts)
                                        for s in mlp]
        if spec.shared_expert_ffn_hidden_size:
            layer += [f"mlp.shared_expert.{s}" for s in mlp] + ["mlp.shared_expert_gate.weight"]
    else:
        layer += [f"mlp.{s}" for s in mlp]
    if spec.qkv_bias:
        layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    if spec.qk_norm:
        layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    names = {f"model.layers.{i}.{s}" for i in range(spec.num_layers) for s in layer}
    names |= {"model.embed_tokens.weight", "model.norm.weight"}
    if spec.head == "lm" and not spec.tie_embeddings:
        names.add("lm_head.weight")
    elif spec.head == "token_cls":
        names |= {"score.weight", "score.bias"}
    elif spec.head == "prm_mlp":
        names |= {"score.0.weight", "score.0.bias", "score.2.weight", "score.2.bias"}
    return names


def load_hf_weights(model, model_dir: str, spec: ModelSpec, *, tp_rank: int, tp_size: int,
                    pp: int, pp_rank: int, ep: int = 1, ep_rank: int = 0,
                    ignore_unexpected: bool = False) -> None:
    """Load an HF directory into this rank's stage, reading only this stage's tensors (and of
    the experts, only this ep rank's). Every tensor of the directory must belong to the model
    (`HFWeights.check`)."""
    weights = HFWeights(model_dir)
    weights.check(required_hf_names(model, spec, pp, pp_rank, ep=ep, ep_rank=ep_rank),
                  expected=expected_hf_names(spec), ignore_unexpected=ignore_unexpected)
    load_stage(model, weights, spec, tp_rank=tp_rank, tp_size=tp_size, pp=pp, pp_rank=pp_rank,
               ep=ep, ep_rank=ep_rank)
