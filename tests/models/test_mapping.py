"""Every tensor of an HF checkpoint is used or named in an error; tiny models are random in
every tensor (a zero bias or a unit norm looks the same in any layout)."""
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from megaprm.models.actor import build_stage
from megaprm.models.hf_spec import UnsupportedModelError, spec_from_hf
from megaprm.models.mapping import HFWeights, expected_hf_names, load_hf_weights
from megaprm.models.tiny import build_hf_model, save_tiny_model, tiny_config


@pytest.mark.parametrize("family,head", [("qwen2", "lm"), ("llama", "lm"), ("qwen3", "lm"),
                                         ("qwen2", "token_cls"), ("qwen3", "token_cls")])
def test_expected_names_are_transformers_state_dict(family, head):
    """The independent reference: the names transformers itself gives the model."""
    cfg = tiny_config(family, head=head)
    model = build_hf_model(cfg)
    hf_names = {n for n in model.state_dict() if not n.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        hf_names.discard("lm_head.weight")  # save_pretrained drops the tied copy
    assert expected_hf_names(spec_from_hf(cfg.to_dict())) == hf_names


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_tiny_models_randomise_every_tensor(family):
    model = build_hf_model(tiny_config(family, head="token_cls"), seed=3)
    for name, p in model.named_parameters():
        assert p.float().std() > 1e-3, f"{name} is constant"
    if family == "qwen2":
        b = dict(model.named_parameters())["model.layers.0.self_attn.q_proj.bias"]
        assert b.abs().min() > 0  # no zero entries that would hide a permutation


def _session():
    from megaprm.parallel.init import init_distributed

    return init_distributed()


def test_unexpected_tensor_is_fatal_unless_ignored(tmp_path):
    from megaprm.parallel.init import destroy

    d = save_tiny_model("qwen2", str(tmp_path / "m"))
    sd = load_file(f"{d}/model.safetensors")
    sd["model.layers.0.self_attn.o_proj.bias"] = torch.randn(64)
    save_file(sd, f"{d}/model.safetensors", metadata={"format": "pt"})
    spec = spec_from_hf(d)
    g = _session()
    try:
        model = build_stage(spec, g)
        with pytest.raises(ValueError, match=r"holds 1 tensor\(s\) the model would not use: "
                                             r"\['model.layers.0.self_attn.o_proj.bias'\]"):
            load_hf_weights(model, d, spec, tp_rank=0, tp_size=1, pp=1, pp_rank=0)
        load_hf_weights(model, d, spec, tp_rank=0, tp_size=1, pp=1, pp_rank=0,
                        ignore_unexpected=True)
        ref = dict(model.named_parameters())["decoder.final_layernorm.weight"]
        assert torch.equal(ref.detach(), sd["model.norm.weight"])
    finally:
        destroy()


def test_pipeline_stage_accepts_other_stages_tensors(tmp_path):
    """pp=2, stage 0 alone: the tensors of stage 1 are expected, not unexpected."""
    d = save_tiny_model("llama", str(tmp_path / "m"))
    spec = spec_from_hf(d)
    w = HFWeights(d)
    stage0 = [n for n in w.keys() if n.startswith(("model.layers.0.", "model.layers.1.",
                                                   "model.embed_tokens"))]
    w.check(stage0, expected=expected_hf_names(spec))
    with pytest.raises(ValueError, match=r"would not use: \['lm_head.weight', 'model.layers.2"):
        w.check(stage0, expected=stage0)


def test_default_expected_comes_from_config_json(tmp_path):
    d = save_tiny_model("qwen3", str(tmp_path / "m"))
    sd = load_file(f"{d}/model.safetensors")
    sd["model.layers.9.mlp.up_proj.weight"] = torch.randn(4, 4)
    save_file(sd, f"{d}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape("['model.layers.9.mlp.up_proj.weight']")):
        HFWeights(d).check(["model.norm.weight"])


def test_tied_lm_head_copy_must_equal_embedding(tmp_path):
    d = save_tiny_model("qwen2", str(tmp_path / "m"))  # tied
    sd = load_file(f"{d}/model.safetensors")
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, f"{d}/model.safetensors", metadata={"format": "pt"})
    HFWeights(d).check(["model.norm.weight"])  # an equal copy is harmless
    sd["lm_head.weight"] = torch.randn_like(sd["lm_head.weight"])
    save_file(sd, f"{d}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"\['lm_head.weight'\] \(lm_head.weight differs from model.embed_tokens"):
        HFWeights(d).check(["model.norm.weight"])


def test_qwen3_attention_bias_refused():
    cfg = tiny_config("qwen3").to_dict()
    cfg["attention_bias"] = True
    with pytest.raises(UnsupportedModelError, match="attention_bias=true on Qwen3"):
        spec_from_hf(cfg)
    cfg["attention_bias"] = False
    assert not spec_from_hf(cfg).qkv_bias


def test_nonfinite_hf_tensor_is_named(tmp_path):
    from megaprm.parallel.init import destroy

    d = save_tiny_model("llama", str(tmp_path / "m"))
    sd = load_file(f"{d}/model.safetensors")
    sd["model.layers.1.self_attn.k_proj.weight"][3, 5] = float("nan")
    save_file(sd, f"{d}/model.safetensors", metadata={"format": "pt"})
    spec = spec_from_hf(d)
    g = _session()
    try:
        model = build_stage(spec, g)
        with pytest.raises(ValueError, match=r"HF tensor model.layers.1.self_attn.k_proj.weight "
                                             r"holds NaN/inf"):
            load_hf_weights(model, d, spec, tp_rank=0, tp_size=1, pp=1, pp_rank=0)
    finally:
        destroy()
