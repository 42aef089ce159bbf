"""HF config -> Megatron config mapping, and the errors users meet first."""
import json
import re

import pytest

from megaprm.models.hf_spec import UnsupportedModelError, spec_from_hf
from megaprm.models.mapping import load_hf_weights
from megaprm.models.tiny import save_tiny_model, tiny_config
from megaprm.parallel.init import ParallelConfigError, check_layout


def test_families_read():
    q2 = spec_from_hf(tiny_config("qwen2").to_dict())
    assert (q2.family, q2.qkv_bias, q2.qk_norm, q2.tie_embeddings) == ("qwen2", True, False, True)
    ll = spec_from_hf(tiny_config("llama").to_dict())
    assert ll.rope_scaling["rope_type"] == "llama3" and not ll.tie_embeddings
    q3 = spec_from_hf(tiny_config("qwen3").to_dict())
    assert q3.qk_norm and q3.head_dim == 32 and q3.head_dim * q3.num_heads != q3.hidden_size
    cls = spec_from_hf(tiny_config("qwen2", head="token_cls").to_dict())
    assert cls.head == "token_cls" and cls.num_labels == 2


def test_vocab_padding_divides_tp():
    spec = spec_from_hf(tiny_config("qwen2", vocab_size=1000).to_dict())
    for tp in (1, 2, 4, 8):
        assert spec.padded_vocab_size(tp) % (128 * tp) == 0 >= 0
        assert spec.padded_vocab_size(tp) >= 1000


@pytest.mark.parametrize("change,needle", [
    ({"architectures": ["MistralForCausalLM"]}, "architectures=['MistralForCausalLM']"),
    ({"num_experts": 8}, "mixture-of-experts"),
    ({"use_sliding_window": True}, "sliding window"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
])
def test_unsupported_features_named(change, needle):
    cfg = tiny_config("qwen2").to_dict()
    cfg.update(change)
    with pytest.raises(UnsupportedModelError, match=re.escape(needle)):
        spec_from_hf(cfg)


def test_tp_must_divide_heads_and_pp_layers():
    spec = spec_from_hf(tiny_config("qwen2", num_heads=6, num_kv_heads=3,
                                    hidden_size=48).to_dict())
    with pytest.raises(UnsupportedModelError, match=r"tp=4 does not divide num_attention_heads=6"):
        spec.check_parallel(4, 1)
    with pytest.raises(UnsupportedModelError, match=r"num_key_value_heads=3"):
        spec.check_parallel(2, 1)
    with pytest.raises(UnsupportedModelError, match=r"pp=3 does not divide num_hidden_layers=4"):
        spec.check_parallel(1, 3)


def test_world_size_must_divide():
    assert check_layout(8, 2, 2) == 2
    with pytest.raises(ParallelConfigError, match=r"world size 6 is not divisible by tp\*pp\*cp"):
        check_layout(6, 2, 2)
    with pytest.raises(ParallelConfigError, match=r"parallel.tp=0"):
        check_layout(2, 0, 1)


def test_missing_weight_and_missing_config(tmp_path):
    from safetensors.torch import load_file, save_file

    from megaprm.models.actor import build_stage
    from megaprm.parallel.init import destroy, init_distributed

    d = save_tiny_model("qwen2", str(tmp_path / "m"))
    sd = load_file(f"{d}/model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, f"{d}/model.safetensors", metadata={"format": "pt"})
    spec = spec_from_hf(d)
    g = init_distributed()
    try:
        model = build_stage(spec, g)
        with pytest.raises(ValueError, match=r"missing 1 tensor.*model.layers.1.mlp.up_proj"):
            load_hf_weights(model, d, spec, tp_rank=0, tp_size=1, pp=1, pp_rank=0)
    finally:
        destroy()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        spec_from_hf(str(tmp_path / "nowhere"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match=r"config is missing \['hidden_size'"):
        spec_from_hf(str(bad))
