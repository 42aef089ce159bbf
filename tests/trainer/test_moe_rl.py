"""An RL step of GRPO and of PURE on a mixture-of-experts policy (a tiny Qwen3-MoE) on two gloo
ranks with its experts split over them (ep2): the update moves the experts, the metrics are
finite and agree across ranks, and the weight sync leaves transformers' rollout engine (its
fused expert tensors) holding the trainer's updated weights exactly."""
import os

import pytest
import torch

from megaprm.parallel import launch
from tests.rl_setup import rl_config, tiny_policy_and_prm

METHODS = ("grpo", "pure")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Qwen3-MoE policy (4 experts, 2 per token) and the tiny dense PRM of rl_setup."""
    from megaprm.models.tiny import save_tiny_model
    from megaprm.tasks.tokenizer import build_char_tokenizer

    root = tmp_path_factory.mktemp("moe_models")
    _, prm = tiny_policy_and_prm(root)
    tok = build_char_tokenizer()
    policy = save_tiny_model("qwen3_moe", str(root / "moe_policy"), tokenizer=tok,
                             vocab_size=len(tok), hidden_size=32, num_layers=2, num_heads=4,
                             num_kv_heads=2, intermediate_size=64,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return policy, prm


def _engine_state(engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def _step(run_root, policy, prm, ep):
    from megaprm.parallel.init import init_distributed
    from megaprm.rollout import weight_sync
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.loop import RLTrainer

    g = init_distributed(ep=ep)
    out = {}
    for method in METHODS:
        cfg = rl_config(os.path.join(run_root, method), policy, prm, method,
                        ["rollout.max_tokens=20", "actor.micro_batch_size=4", "trainer.steps=1",
                         "trainer.save_every=0", "actor.entropy_coef=0.01"])
        tr = RLTrainer(cfg, g, build_char_tokenizer())
        before = {k: v.clone() for k, v in weight_sync.iter_hf_weights(tr.actor.model, g)}
        history = tr.fit()
        after = {k: v.clone() for k, v in weight_sync.iter_hf_weights(tr.actor.model, g)}
        engine = _engine_state(tr.engine) if tr.engine is not None else None
        out[method] = {"history": history, "before": before, "after": after, "engine": engine}
    return out


def test_grpo_and_pure_train_an_moe_policy_at_ep2(models, tmp_path):
    import transformers as tf

    policy, prm = models
    results = launch.spawn(_step, 2, str(tmp_path), policy, prm, 2)
    for method in METHODS:
        runs = [r[method] for r in results]
        for run in runs:
            (m,) = run["history"]
            assert m["guard/skipped_total"] == 0 and all(v == v for v in m.values()), method
        # the dp-reduced metrics are the same on both ranks (timings are per rank)
        same = [{k: v for k, v in r["history"][-1].items()
                 if not k.startswith(("timing/", "throughput/", "weight_sync/"))} for r in runs]
        assert same[0] == pytest.approx(same[1])
        before, after = runs[0]["before"], runs[0]["after"]
        moved = [k for k in before if not torch.equal(before[k], after[k])]
        # every expert of every layer sits on one of the two ep ranks; the router moved too
        assert any(".mlp.experts.0." in k for k in moved), method
        assert any(".mlp.experts.3." in k for k in moved), method
        assert any(k.endswith(".mlp.gate.weight") for k in moved), method
        assert runs[1]["after"].keys() == after.keys()
        assert all(torch.equal(runs[1]["after"][k], v) for k, v in after.items())
        # the rollout engine of each rank holds the updated weights: its fused experts are the
        # stream's per-expert tensors (transformers' own loader converts the same names)
        ref = tf.AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
        ref.load_state_dict({**ref.state_dict(), **_fused(after, ref)}, strict=True)
        for run in runs:
            if run["engine"] is not None:
                for k, v in ref.state_dict().items():
                    assert torch.equal(run["engine"][k], v), (method, k)


def _fused(hf: dict, model) -> dict:
    """The per-expert HF tensors stacked the way transformers holds them (the reference for the
    engine's slices): gate_up_proj [E, 2I, H] = [gate_e; up_e], down_proj [E, H, I]."""
    out = {k: v for k, v in hf.items() if ".mlp.experts." not in k}
    for name, p in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name[: -len("gate_up_proj")]
            out[name] = torch.stack([torch.cat([hf[f"{pre}{e}.gate_proj.weight"],
                                                hf[f"{pre}{e}.up_proj.weight"]])
                                     for e in range(p.shape[0])])
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[: -len("down_proj")]
            out[name] = torch.stack([hf[f"{pre}{e}.down_proj.weight"] for e in range(p.shape[0])])
    return out
