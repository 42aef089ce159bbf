"""The Megatron actor equals transformers' own model under every (tp, pp, dp) layout.

Reference: transformers' forward of the same HF weights (log-probs), and one step of
`torch.optim.AdamW` on the transformers model with the same loss (updated weights).
"""
import pytest
import torch

from megaprm.models.tiny import save_tiny_model
from megaprm.parallel import launch

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2)]
LR = 1e-2
# Adam divides by sqrt(v) + eps: with eps tiny, a gradient of 1e-9 (summation-order noise)
# moves a weight by a full lr. eps = 1e-4 keeps the step a continuous function of the grad.
EPS = 1e-4
B, S = 4, 12


def _batch(vocab):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    mask = torch.ones(B, S)
    mask[0, 8:] = 0  # ragged: a shorter sequence (right padding)
    mask[2, 10:] = 0
    return ids, mask


def _rank_work(model_dir, tp, pp):
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.logprobs import vocab_parallel_logprobs
    from megaprm.models.mapping import load_hf_weights
    from megaprm.parallel import pipeline, weight_sync
    from megaprm.parallel.init import init_distributed
    from megaprm.trainer.sft import sft_step

    g = init_distributed(tp=tp, pp=pp)
    spec = spec_from_hf(model_dir)
    model = pipeline.build_stage(spec, g)
    load_hf_weights(model, model_dir, spec, tp_rank=g.tp_rank, tp_size=tp, pp=pp,
                    pp_rank=g.pp_rank)
    ids, mask = _batch(spec.vocab_size)
    rows = slice(g.dp_rank * B // g.dp_size, (g.dp_rank + 1) * B // g.dp_size)
    ids, mask = ids[rows], mask[rows]

    def post(mb, logits):
        return None, vocab_parallel_logprobs(logits[:, :-1], mb.input_ids[:, 1:], tp_group=g.tp,
                                             tp_rank=g.tp_rank, vocab_size=spec.vocab_size)

    with torch.no_grad():
        lp = pipeline.run(model, [pipeline.TokenBatch(ids, mask)], groups=g, post=post,
                          forward_only=True)
    lp = pipeline.broadcast_from_last_stage(lp, g)[0]
    ddp = pipeline.wrap_ddp(model, g)
    opt = pipeline.Optimizer(ddp, pipeline.OptimConfig(lr=LR, clip_grad=0.0, eps=EPS), g)
    res = sft_step(ddp, opt, g, ids, mask, micro_batch_size=1, vocab_size=spec.vocab_size)
    weights = dict(weight_sync.iter_hf_weights(ddp, g))
    return {"rows": (rows.start, rows.stop), "logprobs": lp, "loss": res.loss,
            "weights": weights if g.rank == 0 else None}


def _hf_reference(model_dir):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids, mask = _batch(model.config.vocab_size)
    logits = model(ids).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(lp * mask[:, :-1]).sum() / mask[:, :-1].sum()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, eps=EPS)
    loss.backward()
    loss = loss.detach()
    opt.step()
    return lp.detach(), float(loss), {k: v.detach() for k, v in model.state_dict().items()}


# Every layout on Qwen2 (QKV bias, tied embeddings); the two 4-rank layouts on Llama (untied,
# llama3 rope scaling) and Qwen3 (q/k norm, head_dim != hidden/heads) to bound CI time.
CASES = [("qwen2", l) for l in LAYOUTS] + [(f, l) for f in ("llama", "qwen3")
                                           for l in [(2, 2, 1), (2, 1, 2)]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = save_tiny_model(family, str(tmp_path_factory.mktemp(family)), seed=3)
        return cache[family]
    return get


@pytest.mark.parametrize("family,layout", CASES,
                         ids=[f"{f}-tp%d-pp%d-dp%d" % l for f, l in CASES])
def test_actor_matches_transformers(model_dirs, family, layout):
    model_dir = model_dirs(family)
    tp, pp, dp = layout
    ref_lp, ref_loss, ref_w = _hf_reference(model_dir)
    results = launch.spawn(_rank_work, tp * pp * dp, model_dir, tp, pp)
    for r in results:
        lo, hi = r["rows"]
        assert (r["logprobs"] - ref_lp[lo:hi]).abs().max() <= 1e-4
        assert abs(r["loss"] - ref_loss) <= 1e-5
    weights = results[0]["weights"]
    tied = "lm_head.weight" not in weights
    expected = {k for k in ref_w if not (tied and k == "lm_head.weight")}
    assert set(weights) == expected
    for k in expected:
        # one AdamW step at lr 1e-2 moves weights by ~1e-2; the layouts agree to fp32 noise
        assert torch.allclose(weights[k], ref_w[k], atol=2e-5, rtol=0), k
