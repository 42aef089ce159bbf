"""The Megatron actor equals transformers' own model under every (tp, pp, dp) layout.

Reference: transformers' forward of the same HF weights (log-probs), and one step of
`torch.optim.AdamW` on the transformers model with the same loss (updated weights). The layouts
run megaprm's default spec on CPU (the fast local spec: SDPA core attention), right-padded and
packed into rows by a token budget (`parallel.microbatch`); in-process checks compare the three
layer implementations and the recompute / compile switches at tp = pp = 1.
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


# Real tokens per row: the loss mask's last counted position + 2 (the target), or more; packed
# rows hold only these, so positions past them are not compared.
LENGTHS = torch.tensor([9, 12, 11, 12])
MAX_TOKENS = 24  # packs the 4 rows into 2 micro-batches of <= 24 tokens


def _packed_sft_step(ddp, opt, g, ids, mask, lengths, vocab_size):
    """sft_step's token-mean loss over packed micro-batches, computed on per-sequence rows
    (`microbatch.unpack`) so the loss code is the one for right-padded rows."""
    from megaprm.models.logprobs import vocab_parallel_logprobs
    from megaprm.parallel import microbatch, pipeline
    from megaprm.parallel.host import dp_sum

    m = mask[:, :-1]
    denom = dp_sum(m.sum().item(), g)
    mbs = microbatch.make_micro_batches(ids, mask, {"m": m}, max_tokens=MAX_TOKENS,
                                        lengths=lengths, pp_size=g.pp_size)
    assert all(mb.input_ids.shape[0] == 1 for mb in mbs) and len(mbs) < ids.shape[0]

    def post(mb, logits):
        lp = vocab_parallel_logprobs(logits[:, :-1], mb.input_ids[:, 1:], tp_group=g.tp,
                                     tp_rank=g.tp_rank, vocab_size=vocab_size)
        loss = -(microbatch.unpack(mb, lp) * mb.payload["m"]).sum() / denom
        return loss, loss.detach()

    opt.zero_grad()
    parts = pipeline.run(ddp, mbs, groups=g, post=post, forward_only=False)
    opt.step()
    loss = dp_sum(float(sum(p.item() for p in parts)) if parts else 0.0, g)
    return pipeline.broadcast_from_last_stage(loss, g)


def _packed_logprobs(model, g, ids, lengths, vocab_size):
    from megaprm.models.logprobs import vocab_parallel_logprobs
    from megaprm.parallel import microbatch, pipeline

    mbs = microbatch.make_micro_batches(ids, torch.zeros(ids.shape), max_tokens=MAX_TOKENS,
                                        lengths=lengths, pp_size=g.pp_size)

    def post(mb, logits):
        return None, microbatch.unpack(mb, vocab_parallel_logprobs(
            logits[:, :-1], mb.input_ids[:, 1:], tp_group=g.tp, tp_rank=g.tp_rank,
            vocab_size=vocab_size))

    with torch.no_grad():
        parts = pipeline.run(model, mbs, groups=g, post=post, forward_only=True)
    out = microbatch.to_rows(mbs, parts, ids.shape[0]) if parts else None
    return pipeline.broadcast_from_last_stage(out, g)


def _rank_work(model_dir, tp, pp, packed=False):
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.logprobs import vocab_parallel_logprobs
    from megaprm.models.mapping import load_hf_weights
    from megaprm.models.actor import build_stage
    from megaprm.parallel import pipeline
    from megaprm.parallel.optimizer import OptimConfig, Optimizer
    from megaprm.parallel.init import init_distributed
    from megaprm.rollout import weight_sync
    from megaprm.trainer.sft import sft_step

    g = init_distributed(tp=tp, pp=pp)
    spec = spec_from_hf(model_dir)
    model = build_stage(spec, g)
    load_hf_weights(model, model_dir, spec, tp_rank=g.tp_rank, tp_size=tp, pp=pp,
                    pp_rank=g.pp_rank)
    ids, mask = _batch(spec.vocab_size)
    rows = slice(g.dp_rank * B // g.dp_size, (g.dp_rank + 1) * B // g.dp_size)
    ids, mask, lengths = ids[rows], mask[rows], LENGTHS[rows]
    if packed:
        lp = _packed_logprobs(model, g, ids, lengths, spec.vocab_size)
        ddp = pipeline.wrap_ddp(model, g)
        opt = Optimizer(ddp, OptimConfig(lr=LR, clip_grad=0.0, eps=EPS), g)
        loss = _packed_sft_step(ddp, opt, g, ids, mask, lengths, spec.vocab_size)
        weights = dict(weight_sync.iter_hf_weights(ddp, g))
        return {"rows": (rows.start, rows.stop), "logprobs": lp, "loss": loss,
                "weights": weights if g.rank == 0 else None}

    def post(mb, logits):
        return None, vocab_parallel_logprobs(logits[:, :-1], mb.input_ids[:, 1:], tp_group=g.tp,
                                             tp_rank=g.tp_rank, vocab_size=spec.vocab_size)

    with torch.no_grad():
        lp = pipeline.run(model, [pipeline.TokenBatch(ids, mask)], groups=g, post=post,
                          forward_only=True)
    lp = pipeline.broadcast_from_last_stage(lp, g)[0]
    ddp = pipeline.wrap_ddp(model, g)
    opt = Optimizer(ddp, OptimConfig(lr=LR, clip_grad=0.0, eps=EPS), g)
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


# Packed rows: one layout per parallelism (tp with pp pads every row to the budget; dp packs
# each rank's rows separately).
PACKED = [("qwen2", (1, 1, 1)), ("qwen2", (2, 2, 1)), ("qwen3", (1, 1, 2))]


@pytest.mark.parametrize("family,layout,packed",
                         [c + (False,) for c in CASES] + [c + (True,) for c in PACKED],
                         ids=[f"{f}-tp%d-pp%d-dp%d" % l for f, l in CASES]
                         + [f"{f}-tp%d-pp%d-dp%d-packed" % l for f, l in PACKED])
def test_actor_matches_transformers(model_dirs, family, layout, packed):
    model_dir = model_dirs(family)
    tp, pp, dp = layout
    ref_lp, ref_loss, ref_w = _hf_reference(model_dir)
    results = launch.spawn(_rank_work, tp * pp * dp, model_dir, tp, pp, packed)
    # packed rows hold each sequence's real tokens only: compare where a target exists
    real = torch.arange(S - 1)[None] < (LENGTHS[:, None] - 1) if packed else torch.ones(B, S - 1)
    for r in results:
        lo, hi = r["rows"]
        err = (r["logprobs"] - ref_lp[lo:hi]).abs() * real[lo:hi]
        assert err.max() <= 1e-4
        assert abs(r["loss"] - ref_loss) <= 1e-5
    weights = results[0]["weights"]
    tied = "lm_head.weight" not in weights
    expected = {k for k in ref_w if not (tied and k == "lm_head.weight")}
    assert set(weights) == expected
    for k in expected:
        # one AdamW step at lr 1e-2 moves weights by ~1e-2; the layouts agree to fp32 noise
        assert torch.allclose(weights[k], ref_w[k], atol=2e-5, rtol=0), k


def _in_process_model(model_dir, **build):
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.mapping import load_hf_weights
    from megaprm.models.actor import build_stage
    from megaprm.parallel.init import init_distributed

    g = init_distributed()
    spec = spec_from_hf(model_dir)
    model = build_stage(spec, g, **build)
    load_hf_weights(model, model_dir, spec, tp_rank=0, tp_size=1, pp=1, pp_rank=0)
    return model, spec


def _logprobs_and_grads(model, spec, ids):
    from megaprm.models.logprobs import vocab_parallel_logprobs
    from megaprm.parallel import pipeline

    logits = pipeline.gpt_forward(model, pipeline.TokenBatch(ids, torch.ones(ids.shape)))
    lp = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], vocab_size=spec.vocab_size)
    lp.sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("build", [{"impl": "local"}, {"impl": "sdpa"},
                                   {"impl": "sdpa", "recompute": True},
                                   {"impl": "sdpa", "compile": "eager"}],
                         ids=["megatron-local", "sdpa", "sdpa-recompute", "sdpa-compile"])
def test_layer_impls_and_switches_match_transformers(model_dirs, build):
    """Every layer implementation and switch computes transformers' log-probs, and the switches
    do not change the gradients of the plain fast spec."""
    from megaprm.parallel.init import destroy

    model_dir = model_dirs("qwen2")
    ref_lp = _hf_reference(model_dir)[0]
    try:
        model, spec = _in_process_model(model_dir, **build)
        ids, _ = _batch(spec.vocab_size)
        lp, grads = _logprobs_and_grads(model, spec, ids)
        assert (lp - ref_lp).abs().max() <= 1e-4
        core = type(model.decoder.layers[0].self_attention.core_attention).__name__
        assert core == {"local": "DotProductAttention", "sdpa": "SDPAttention"}[build["impl"]]
        if build != {"impl": "sdpa"}:
            base, spec = _in_process_model(model_dir, impl="sdpa")
            _, base_grads = _logprobs_and_grads(base, spec, ids)
            for n, gr in base_grads.items():
                assert torch.allclose(grads[n], gr, atol=1e-5, rtol=1e-4), n
    finally:
        destroy()


def test_fast_spec_holds_norm_weights_in_bf16(model_dirs):
    """Megatron's local spec leaves RMSNorm weights fp32 in a bf16 model; the fast spec holds
    every parameter in bf16, and its bf16 log-probs stay close to transformers' fp32 ones."""
    from megaprm.parallel.init import destroy

    model_dir = model_dirs("qwen3")  # q/k norms too
    ref_lp = _hf_reference(model_dir)[0]
    try:
        local, _ = _in_process_model(model_dir, impl="local", dtype=torch.bfloat16)
        assert {p.dtype for n, p in local.named_parameters() if "layernorm" in n} == {torch.float32}
        fast, spec = _in_process_model(model_dir, impl="sdpa", dtype=torch.bfloat16)
        dtypes = {n: p.dtype for n, p in fast.named_parameters()}
        assert set(dtypes.values()) == {torch.bfloat16}, dtypes
        assert any("q_layernorm" in n for n in dtypes) and any("final_layernorm" in n for n in dtypes)
        ids, _ = _batch(spec.vocab_size)
        lp, _ = _logprobs_and_grads(fast, spec, ids)
        assert (lp - ref_lp).abs().mean() <= 0.05  # bf16 rounding, not a different function
    finally:
        destroy()


def test_logits_are_made_once_forward_and_back(tmp_path):
    """Logits memory: a training forward and backward through GPTModel and the
    next-token log-probs allocate exactly two logits-sized tensors, the logits and their
    gradient (GPTModel's [s, b] -> [b, s] transpose used to add one copy each way, the sliced
    `logits[:, :-1]` a third gradient). The values: every test here compares with transformers
    through the same hooks."""
    from megaprm.models.logprobs import next_token_logprobs
    from megaprm.parallel import pipeline
    from megaprm.parallel.init import destroy
    from tests.memory_utils import LiveBytes

    # a vocabulary large enough that no other activation has the logits' size
    model_dir = save_tiny_model("qwen2", str(tmp_path / "m"), seed=3, vocab_size=1000)
    try:
        model, spec = _in_process_model(model_dir)
        ids, _ = _batch(spec.vocab_size)
        with LiveBytes() as mem:
            logits = pipeline.gpt_forward(model, pipeline.TokenBatch(ids, torch.ones(ids.shape)))
            lp = next_token_logprobs(logits, ids, vocab_size=spec.vocab_size)
            lp.sum().backward()
        size = logits.numel() * logits.element_size()
        assert mem.sizes.count(size) == 2, (size, sorted(mem.sizes)[-6:])
    finally:
        destroy()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA->CPU shim is CPU-only")
@pytest.mark.parametrize("impl", ["local", "sdpa"])
def test_forward_loss_and_backward_run_outside_the_cpu_shim(model_dirs, monkeypatch, impl):
    """`pipeline.run` takes the model's forward, the loss and the backward step out of
    `parallel.cpu`'s function mode (the local spec's causal mask is redirected to the host):
    the gradients are the same as with the mode in force, and the mode no longer sees the
    model's torch calls."""
    import contextlib

    from megatron.core.pipeline_parallel import schedules

    from megaprm.models.logprobs import vocab_parallel_logprobs
    from megaprm.parallel import cpu, pipeline
    from megaprm.parallel.init import destroy

    calls, mode = [0], cpu._CudaToCpuMode.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        calls[0] += 1
        return mode(self, func, types, args, kwargs)

    def run(model, spec, ids):
        def post(mb, logits):
            lp = vocab_parallel_logprobs(logits[:, :-1], mb.input_ids[:, 1:],
                                         vocab_size=spec.vocab_size)
            return lp.sum(), lp.detach()

        model.zero_grad()
        calls[0] = 0
        mbs = [pipeline.TokenBatch(ids[:2], torch.ones(2, ids.shape[1])),
               pipeline.TokenBatch(ids[2:], torch.ones(2, ids.shape[1]))]
        out = pipeline.run(model, mbs, groups=g, post=post, forward_only=False)
        return torch.cat(out), {n: p.grad.clone() for n, p in model.named_parameters()}, calls[0]

    model_dir = model_dirs("qwen2")
    monkeypatch.setattr(cpu._CudaToCpuMode, "__torch_function__", counting)
    try:
        model, spec = _in_process_model(model_dir, impl=impl)
        from megaprm.parallel.init import init_distributed

        g = init_distributed()
        ids, _ = _batch(spec.vocab_size)
        lp, grads, outside = run(model, spec, ids)
        assert (lp - _hf_reference(model_dir)[0]).abs().max() <= 1e-4
        # the same run with the mode in force everywhere (as before)
        monkeypatch.setattr(cpu, "paused", contextlib.nullcontext)
        monkeypatch.setattr(schedules, "backward_step", schedules.backward_step.__wrapped__)
        lp_in, grads_in, inside = run(model, spec, ids)
        assert torch.equal(lp, lp_in)
        for n, gr in grads_in.items():
            assert torch.equal(grads[n], gr), n
        print(f"{impl}: torch calls through the mode {inside} -> {outside}")
        assert outside * 10 < inside
    finally:
        destroy()
