"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with its gated shared expert) on Megatron's
MoE layer: the config read, the parallel checks, and the actor's log-probs against transformers'
own forward of the same HF checkpoint at ep1 (in process) and at ep2 / tp2 / pp2 (2 gloo ranks),
and HF -> Megatron -> HF through the weight-sync streams (per tensor and bucketed), bit for bit;
one SFT step (AdamW) at each layout updates the weights as torch.optim.AdamW does on
transformers' model with the same loss.
"""
import os
import re

import pytest
import torch

from megaprm import planner
from megaprm.models.hf_spec import UnsupportedModelError, spec_from_hf
from megaprm.models.tiny import save_tiny_model, tiny_config
from megaprm.parallel import launch
from megaprm.parallel.init import ParallelConfigError, check_layout

MOE = ("qwen3_moe", "qwen2_moe")
B, S = 4, 10
LR, EPS = 1e-2, 1e-4  # as tests/models/test_actor.py: eps keeps Adam's step continuous in the grad


def test_moe_configs_read():
    q3 = spec_from_hf(tiny_config("qwen3_moe").to_dict())
    assert (q3.num_experts, q3.moe_topk, q3.moe_ffn_hidden_size, q3.norm_topk_prob) == (4, 2, 32, True)
    assert q3.qk_norm and not q3.qkv_bias and q3.shared_expert_ffn_hidden_size == 0
    q2 = spec_from_hf(tiny_config("qwen2_moe").to_dict())
    assert q2.qkv_bias and not q2.norm_topk_prob and q2.shared_expert_ffn_hidden_size == 80
    # the released Qwen3-30B-A3B config spells the expert count num_experts
    real = spec_from_hf(os.path.join(os.path.dirname(planner.__file__), "hf_configs",
                                     "Qwen3-30B-A3B.json"))
    assert (real.num_experts, real.moe_topk, real.moe_ffn_hidden_size) == (128, 8, 768)


@pytest.mark.parametrize("change,needle", [
    ({"decoder_sparse_step": 2}, "dense layers among MoE layers"),
    ({"mlp_only_layers": [0]}, "dense layers among MoE layers"),
    ({"num_experts_per_tok": None}, "without num_experts, moe_intermediate_size"),
])
def test_unsupported_moe_named(change, needle):
    cfg = tiny_config("qwen3_moe").to_dict()
    cfg.update(change)
    with pytest.raises(UnsupportedModelError, match=re.escape(needle)):
        spec_from_hf(cfg)


def test_ep_checks():
    spec = spec_from_hf(tiny_config("qwen3_moe").to_dict())
    spec.check_parallel(2, 2, 4)
    with pytest.raises(UnsupportedModelError,
                       match=r"ep=3 \(parallel.ep / --ep\) does not divide num_experts=4 .*divisors of 4"):
        spec.check_parallel(1, 1, 3)
    with pytest.raises(UnsupportedModelError, match=r"moe_intermediate_size=32"):
        spec.check_parallel(64, 1, 1)
    dense = spec_from_hf(tiny_config("qwen2").to_dict())
    with pytest.raises(UnsupportedModelError, match=r"ep=2 \(parallel.ep / --ep\) needs a mixture-of-experts"):
        dense.check_parallel(1, 1, 2)
    assert check_layout(8, 2, 2, 1, 2) == 2
    with pytest.raises(ParallelConfigError, match=r"parallel.ep=4: tp\*ep = 2\*4 = 8 does not "
                                                  r"divide the 4 ranks of a pipeline stage"):
        check_layout(8, 2, 2, 1, 4)


def _ids(vocab):
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(1))


def _assert_hf_weights(got: dict, model_dir: str):
    from safetensors.torch import load_file

    ref = load_file(f"{model_dir}/model.safetensors")
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert torch.equal(got[k], v), k


def _hf_logprobs(model_dir):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        logits = model(ids).logits
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def hf_step(moe_dirs, tmp_path_factory):
    """transformers' model after one AdamW step on the token-mean NLL of the batch: (loss, its
    weights under the checkpoint's per-expert names, as save_pretrained writes them)."""
    import transformers as tf
    from safetensors.torch import load_file

    out = {}
    for family, d in moe_dirs.items():
        model = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        ids = _ids(model.config.vocab_size)
        lp = torch.log_softmax(model(ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])
        loss = -lp.mean()
        loss.backward()
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, eps=EPS).step()
        saved = str(tmp_path_factory.mktemp(f"{family}_stepped"))
        model.save_pretrained(saved)
        out[family] = (float(loss), load_file(f"{saved}/model.safetensors"))
    return out


def _assert_stepped(got: dict, loss: float, ref: tuple):
    assert abs(loss - ref[0]) <= 1e-5
    assert set(got) == set(ref[1])
    for k, v in ref[1].items():
        # one AdamW step at lr 1e-2 moves weights by ~1e-2; the layouts agree to fp32 noise
        assert torch.allclose(got[k], v, atol=2e-5, rtol=0), k


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    return {f: save_tiny_model(f, str(tmp_path_factory.mktemp(f)), seed=3) for f in MOE}


def _rank_logprobs(model_dir, tp, pp, ep):
    from megaprm.models.actor import build_stage
    from megaprm.models.logprobs import vocab_parallel_logprobs
    from megaprm.models.mapping import load_hf_weights
    from megaprm.parallel import pipeline
    from megaprm.parallel.init import init_distributed
    from megaprm.parallel.optimizer import OptimConfig, Optimizer
    from megaprm.rollout import weight_sync
    from megaprm.trainer.sft import sft_step

    g = init_distributed(tp=tp, pp=pp, ep=ep)
    spec = spec_from_hf(model_dir)
    model = build_stage(spec, g)  # left in training mode: the MoE layer's tp guard is live
    load_hf_weights(model, model_dir, spec, tp_rank=g.tp_rank, tp_size=tp, pp=pp,
                    pp_rank=g.pp_rank, ep=ep, ep_rank=g.ep_rank)
    n_local = sum(1 for n, _ in model.named_parameters()
                  if n.startswith("decoder.layers.0.mlp.experts.") and n.endswith("fc1.weight"))
    rows = slice(g.dp_rank * B // g.dp_size, (g.dp_rank + 1) * B // g.dp_size)
    ids = _ids(spec.vocab_size)[rows]

    def post(mb, logits):
        return None, vocab_parallel_logprobs(logits[:, :-1], mb.input_ids[:, 1:], tp_group=g.tp,
                                             tp_rank=g.tp_rank, vocab_size=spec.vocab_size)

    with torch.no_grad():
        lp = pipeline.run(model, [pipeline.TokenBatch(ids, torch.ones(ids.shape))], groups=g,
                          post=post, forward_only=True)
    lp = pipeline.broadcast_from_last_stage(lp, g)[0]
    # HF names back from every rank's shards: the per-tensor stream and the bucketed one
    weights = {k: v.clone() for k, v in weight_sync.iter_hf_weights(model, g)}
    buckets = {k: v.clone() for b in weight_sync.iter_hf_buckets(model, g, bucket_bytes=1 << 14)
               for k, v in b}
    ddp = pipeline.wrap_ddp(model, g)
    opt = Optimizer(ddp, OptimConfig(lr=LR, clip_grad=0.0, eps=EPS), g)
    res = sft_step(ddp, opt, g, ids, torch.ones(ids.shape), micro_batch_size=1,
                   vocab_size=spec.vocab_size)
    stepped = {k: v.clone() for k, v in weight_sync.iter_hf_weights(ddp, g)}
    return {"rows": (rows.start, rows.stop), "logprobs": lp, "ep_rank": g.ep_rank,
            "local_experts": n_local, "weights": weights, "buckets": buckets,
            "loss": res.loss, "stepped": stepped}


@pytest.mark.parametrize("family", MOE)
def test_moe_actor_matches_transformers_in_process(moe_dirs, hf_step, family):
    from megaprm.parallel.init import destroy

    try:
        got = _rank_logprobs(moe_dirs[family], 1, 1, 1)
    finally:
        destroy()
    assert got["local_experts"] == 4
    assert (got["logprobs"] - _hf_logprobs(moe_dirs[family])).abs().max() <= 1e-5
    _assert_hf_weights(got["weights"], moe_dirs[family])
    _assert_hf_weights(got["buckets"], moe_dirs[family])
    _assert_stepped(got["stepped"], got["loss"], hf_step[family])


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("layout", [(1, 1, 2), (2, 1, 1), (1, 2, 1)],
                         ids=["ep2", "tp2", "pp2"])
def test_moe_actor_matches_transformers_on_two_ranks(moe_dirs, hf_step, family, layout):
    ref = _hf_logprobs(moe_dirs[family])
    results = launch.spawn(_rank_logprobs, 2, moe_dirs[family], *layout)
    ep = layout[2]
    assert sorted(r["ep_rank"] for r in results) == list(range(ep)) * (2 // ep)
    for r in results:
        assert r["local_experts"] == 4 // ep
        lo, hi = r["rows"]
        assert (r["logprobs"] - ref[lo:hi]).abs().max() <= 1e-5
        _assert_hf_weights(r["weights"], moe_dirs[family])  # every rank gets the whole model
        _assert_hf_weights(r["buckets"], moe_dirs[family])
        _assert_stepped(r["stepped"], r["loss"], hf_step[family])


def test_router_losses_are_switches(moe_dirs):
    """model.moe_aux_loss_coef / moe_z_loss_coef: 0 leaves the update the plain loss's (the
    default); > 0 adds Megatron's load-balancing / z-loss gradient to the routers (and what feeds
    them) without changing the log-probs."""
    from megaprm.models.actor import build_stage
    from megaprm.models.logprobs import vocab_parallel_logprobs
    from megaprm.models.mapping import load_hf_weights
    from megaprm.parallel import pipeline
    from megaprm.parallel.init import destroy, init_distributed

    d = moe_dirs["qwen3_moe"]
    spec = spec_from_hf(d)
    ids = _ids(spec.vocab_size)
    out = {}
    try:
        g = init_distributed()
        for coefs in [(0.0, 0.0), (0.1, 0.0), (0.0, 0.1)]:
            model = build_stage(spec, g, moe_aux_loss_coef=coefs[0], moe_z_loss_coef=coefs[1])
            load_hf_weights(model, d, spec, tp_rank=0, tp_size=1, pp=1, pp_rank=0)
            logits = pipeline.gpt_forward(model, pipeline.TokenBatch(ids, torch.ones(ids.shape)))
            lp = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], vocab_size=spec.vocab_size)
            lp.sum().backward()
            out[coefs] = lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    finally:
        destroy()
    base_lp, base = out[(0.0, 0.0)]
    assert (base_lp - _hf_logprobs(d)).abs().max() <= 1e-5
    for coefs in [(0.1, 0.0), (0.0, 0.1)]:
        lp, grads = out[coefs]
        assert torch.equal(lp, base_lp)
        router = "decoder.layers.3.mlp.router.weight"
        assert not torch.allclose(grads[router], base[router], atol=1e-6), coefs
        # the last layer's experts see the same tokens and output gradient
        expert = "decoder.layers.3.mlp.experts.local_experts.0.linear_fc2.weight"
        assert torch.allclose(grads[expert], base[expert], atol=1e-6), coefs


def test_config_fields_are_checked():
    from megaprm.config import ModelConfig, ParallelConfig
    from megaprm.errors import ConfigError

    assert ParallelConfig(ep=2).ep == 2
    with pytest.raises(ConfigError, match=r"parallel.ep=0 is not valid: a positive integer"):
        ParallelConfig(ep=0)
    with pytest.raises(ConfigError, match=r"model.moe_aux_loss_coef=-0.1 is not valid"):
        ModelConfig(moe_aux_loss_coef=-0.1)
