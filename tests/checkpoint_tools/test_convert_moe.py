"""checkpoint_tools on mixture-of-experts models: HF -> Megatron -> HF is bit for bit at ep2, tp2
and pp2 (Qwen2-MoE: shared expert, gate, qkv bias; Qwen3-MoE: q/k norms, renormalised top-k),
the import's and export's logit checks against transformers pass, and the checkpoint (experts at
their global index) exports file to file whatever ep it was written at."""
import os

import pytest
import torch

from checkpoint_tools import export_hf, import_hf
from checkpoint_tools.layout import ConversionError
from megaprm.models.mapping import HFWeights
from megaprm.models.tiny import save_tiny_model
from megaprm.parallel import launch

# (family, tp, pp, ep): every 2-rank layout on Qwen2-MoE, expert parallelism on Qwen3-MoE too
LAYOUTS = [("qwen2_moe", 1, 1, 2), ("qwen2_moe", 2, 1, 1), ("qwen2_moe", 1, 2, 1),
           ("qwen3_moe", 1, 1, 2)]


def _name(family, tp, pp, ep):
    return f"{family}-tp{tp}-pp{pp}-ep{ep}"


@pytest.fixture(scope="module")
def moe_hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_hf")
    return {f: save_tiny_model(f, str(root / f), seed=5) for f in ("qwen2_moe", "qwen3_moe")}


def _world(dirs: dict, root: str) -> dict:
    """Both ranks run this (as under torchrun); rank 0's return value is the report."""
    out = {}
    for family, tp, pp, ep in LAYOUTS:
        name = _name(family, tp, pp, ep)
        ck, hf = os.path.join(root, name + ".ckpt"), os.path.join(root, name + ".hf")
        imp = import_hf(dirs[family], ck, tp=tp, pp=pp, ep=ep)
        exp = export_hf(ck, hf, ep=ep)  # loaded at the saved tp/pp and this ep, then gathered
        out[name] = {"ckpt": ck, "hf": hf, "import": imp, "export": exp}
    return out


@pytest.fixture(scope="module")
def world(moe_hf, tmp_path_factory):
    return launch.spawn(_world, 2, moe_hf, str(tmp_path_factory.mktemp("moe_ckpt")))[0]


def _tensors(d: str) -> dict:
    w = HFWeights(d)
    return {k: w(k) for k in w.keys()}  # noqa: SIM118 (not a dict)


def _assert_bitwise(got: str, want: str) -> None:
    a, b = _tensors(got), _tensors(want)
    assert set(a) == set(b)
    for k, t in b.items():
        assert a[k].dtype == t.dtype and torch.equal(a[k], t), k


@pytest.mark.parametrize("layout", LAYOUTS, ids=[_name(*x) for x in LAYOUTS])
def test_moe_roundtrip_bitwise(world, moe_hf, tmp_path, layout):
    r = world[_name(*layout)]
    family, ep = layout[0], layout[3]
    assert r["import"]["ep"] == r["export"]["ep"] == ep
    assert r["import"]["verify"]["passed"] and r["export"]["verify"]["passed"]
    assert r["import"]["verify"]["max_abs_diff"] < 1e-4
    _assert_bitwise(r["hf"], moe_hf[family])
    # file to file from the torch_dist files, in this process: no ranks, no model
    streamed = export_hf(r["ckpt"], str(tmp_path / "streamed"), verify=False)
    assert streamed["streamed"]
    _assert_bitwise(str(tmp_path / "streamed"), moe_hf[family])


def test_ep_that_does_not_divide(moe_hf, tmp_path):
    with pytest.raises(ConversionError, match=r"ep=3 \(parallel.ep / --ep\) does not divide num_experts=4"):
        import_hf(moe_hf["qwen3_moe"], str(tmp_path / "out"), ep=3)
    dense = save_tiny_model("qwen2", str(tmp_path / "dense"), seed=1)
    with pytest.raises(ConversionError, match=r"ep=2 \(parallel.ep / --ep\) needs a mixture-of-experts"):
        import_hf(dense, str(tmp_path / "out"), ep=2)
    with pytest.raises(ConversionError, match=r"--ep=0: must be a positive integer"):
        import_hf(moe_hf["qwen3_moe"], str(tmp_path / "out"), ep=0)
    assert sorted(os.listdir(tmp_path)) == ["dense"]
