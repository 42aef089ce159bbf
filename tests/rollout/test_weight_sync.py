"""Bucketed weight sync: Megatron actor (tp, pp) -> HF rollout engine on every rank.

References: the unbucketed `iter_hf_weights` stream and the HF state dict on disk (bitwise), the
Megatron model's own logits, a greedy loop over `pipeline.run` with full recompute, and the
trainer's `vocab_parallel_logprobs` for the engine's sampler log-probs. One spawned world per
layout runs every check (process start-up dominates the runtime).
"""
import os

import pytest
import torch

from megaprm.models.tiny import save_tiny_model
from megaprm.parallel import launch

# (tp, pp, family): llama is untied (lm_head streamed), qwen2 tied (lm_head = embedding)
LAYOUTS = [(2, 1, "qwen2"), (1, 2, "llama"), (2, 2, "qwen2")]
EOS = 1
PROMPTS = [[5, 9, 13, 2, 7], [4, 4, 60], [33, 12, 90, 17, 3, 8, 21]]
GREEDY_TOKENS = 8
BUCKETS = (1, 40_000, 1 << 30)  # one parameter per bucket, a few params per bucket, one per stage


def _all_gather_vocab(logits, g, vocab):
    """[b, s, V/tp] on each tp rank -> [b, s, V] (padding rows dropped)."""
    if g.tp_size > 1:
        parts = [torch.empty_like(logits) for _ in range(g.tp_size)]
        torch.distributed.all_gather(parts, logits.contiguous(), group=g.tp)
        logits = torch.cat(parts, dim=-1)
    return logits[..., :vocab]


def _megatron_logits(model, g, ids, vocab):
    """Full logits [b, s, V] of right-padded ids, on every rank."""
    from megaprm.parallel import pipeline

    mb = pipeline.TokenBatch(ids, torch.ones_like(ids, dtype=torch.float32))
    with torch.no_grad():
        out = pipeline.run(model, [mb], groups=g, forward_only=True,
                           post=lambda mb, lg: (None, _all_gather_vocab(lg, g, vocab)))
    return pipeline.broadcast_from_last_stage(out, g)[0]


def _megatron_greedy(model, g, prompts, steps, vocab):
    """Greedy decoding with full recompute: each step re-runs every sequence right-padded."""
    seqs = [list(p) for p in prompts]
    for _ in range(steps):
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        logits = _megatron_logits(model, g, ids, vocab)
        for i, s in enumerate(seqs):
            s.append(int(logits[i, len(s) - 1].argmax()))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


def _megatron_logprobs(model, g, rp, vocab, temperature):
    """Trainer path: token-aligned log-probs [B, L] (0 at t = 0) at `temperature`."""
    from megaprm.models.logprobs import vocab_parallel_logprobs
    from megaprm.parallel import pipeline

    def post(mb, logits):
        lp = vocab_parallel_logprobs(logits[:, :-1], mb.input_ids[:, 1:], tp_group=g.tp,
                                     tp_rank=g.tp_rank, vocab_size=vocab, temperature=temperature)
        return None, torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)

    mb = pipeline.TokenBatch(rp.input_ids, rp.loss_mask)
    with torch.no_grad():
        out = pipeline.run(model, [mb], groups=g, post=post, forward_only=True)
    return pipeline.broadcast_from_last_stage(out, g)[0]


def _rank_work(model_dir, prm_dir, tp, pp):
    import transformers as tf

    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.mapping import load_hf_weights
    from megaprm.models.actor import build_stage
    from megaprm.parallel.init import init_distributed
    from megaprm.rollout import weight_sync
    from megaprm.rollout.engine import SamplingParams
    from megaprm.rollout.hf_engine import HFEngine, HFEngineConfig

    g = init_distributed(tp=tp, pp=pp)
    spec = spec_from_hf(model_dir)
    model = build_stage(spec, g)
    load_hf_weights(model, model_dir, spec, tp_rank=g.tp_rank, tp_size=tp, pp=pp,
                    pp_rank=g.pp_rank)
    res = {}

    # 1. the bucketed stream is the unbucketed one, bit for bit, at every bucket size, through
    # the gloo collectives and through same-host shared memory (what "auto" picks here)
    ref = list(weight_sync.iter_hf_weights(model, g))
    res["names"] = [n for n, _ in ref]
    res["num_buckets"] = []
    res["auto"] = weight_sync._transport("auto", g, torch.device("cpu"))
    for transport in ("collective", "shm"):
        for bb in BUCKETS:
            # a bucket's tensors live in buffers the next bucket reuses: keep copies
            buckets = [[(n, t.clone()) for n, t in b]
                       for b in weight_sync.iter_hf_buckets(model, g, bb, transport=transport)]
            flat = [x for b in buckets for x in b]
            assert [n for n, _ in flat] == res["names"], (transport, bb)
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(flat, ref)), (transport, bb)
            if transport == "shm":
                res["num_buckets"].append(len(buckets))
    res["shm_files"] = [f for f in os.listdir(weight_sync.SHM_DIR)
                        if f.startswith("megaprm-weight-sync-")]
    # gloo gathers a bucket in slices of the flat buffer: force many small, uneven slices
    slice_bytes, weight_sync.GLOO_SLICE_BYTES = weight_sync.GLOO_SLICE_BYTES, 1000
    try:
        flat = [(n, t.clone()) for b in weight_sync.iter_hf_buckets(model, g, 1 << 30,
                                                                    transport="collective")
                for n, t in b]
    finally:
        weight_sync.GLOO_SLICE_BYTES = slice_bytes
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(flat, ref)) and len(flat) == len(ref)
    if g.rank == 0:
        res["weights"] = dict(ref)

    # 2. sync into an engine that starts from different random weights on every rank
    hf_cfg = tf.AutoConfig.from_pretrained(model_dir)
    engine = HFEngine.from_config(hf_cfg, HFEngineConfig(eos_token_ids=(EOS,), pad_token_id=0),
                                  seed=100 + g.rank)
    ids = torch.tensor([[5, 9, 13, 2, 7, 4, 4, 60, 33, 12], [90, 17, 3, 8, 21, 5, 5, 6, 7, 8]])
    with torch.no_grad():
        before = engine.model(ids).logits
    stats = weight_sync.sync_weights(model, g, engine, bucket_bytes=BUCKETS[1])
    res["stats"] = stats
    with torch.no_grad():
        after = engine.model(ids).logits
    mlogits = _megatron_logits(model, g, ids, spec.vocab_size)
    res["logits_diff_before"] = float((before - mlogits).abs().max())
    res["logits_diff"] = float((after - mlogits).abs().max())

    # 3. greedy generation == greedy over the Megatron model itself
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS))
    res["engine_greedy"] = out.response_token_lists()
    res["engine_finish"] = out.finish_reason
    res["megatron_greedy"] = _megatron_greedy(model, g, PROMPTS, GREEDY_TOKENS, spec.vocab_size)

    # 4. sampler log-probs == trainer log-probs of the same tokens at the same temperature
    res["logprob_diff"] = {}
    for temp in (1.0, 0.7):
        batch = engine.generate(PROMPTS, SamplingParams(n=2, temperature=temp, max_tokens=12,
                                                        seed=11))
        rp = batch.to_right_padded()
        trainer = _megatron_logprobs(model, g, rp, spec.vocab_size, temp)
        diff = (rp.to_response(trainer, batch.response_ids.shape[1])
                - batch.sampler_logprobs).abs()[batch.response_mask.bool()]
        res["logprob_diff"][temp] = (float(diff.mean()), float(diff.max()), int(diff.numel()))

    # 5. an online-updated PRM (score head on the last stage) streams through the same path
    if prm_dir is not None:
        pspec = spec_from_hf(prm_dir)
        prm = build_stage(pspec, g)
        if g.is_last_stage:
            prm.score = torch.nn.Linear(pspec.hidden_size, pspec.num_labels)
        load_hf_weights(prm, prm_dir, pspec, tp_rank=g.tp_rank, tp_size=tp, pp=pp,
                        pp_rank=g.pp_rank)
        prm_stream = [(n, t.clone()) for b in weight_sync.iter_hf_buckets(prm, g, 30_000, spec=pspec)
                      for n, t in b]
        if g.rank == 0:
            res["prm_weights"] = dict(prm_stream)
    return res


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws")
    dirs = {f: save_tiny_model(f, str(root / f), seed=3) for f in ("qwen2", "llama")}
    dirs["prm"] = save_tiny_model("qwen2", str(root / "prm"), seed=5, head="token_cls", tie=False)
    return dirs


def _hf_state(model_dir, head="lm"):
    import transformers as tf

    cls = tf.AutoModelForCausalLM if head == "lm" else tf.AutoModelForTokenClassification
    m = cls.from_pretrained(model_dir, dtype=torch.float32)
    return {k: v for k, v in m.state_dict().items()}, m.config.tie_word_embeddings


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "tp{}-pp{}-{}".format(*lay))
def test_sync_into_hf_engine(model_dirs, layout):
    tp, pp, family = layout
    prm_dir = model_dirs["prm"] if (tp, pp) == (2, 2) else None
    results = launch.spawn(_rank_work, tp * pp, model_dirs[family], prm_dir, tp, pp)

    # the stream is the HF state dict, bitwise (a tied lm_head is the embedding: not streamed)
    hf, tied = _hf_state(model_dirs[family])
    weights = results[0]["weights"]
    assert set(weights) == {k for k in hf if not (tied and k == "lm_head.weight")}
    assert all(torch.equal(weights[k], hf[k]) for k in weights)
    for r in results:
        assert r["names"] == results[0]["names"]
        assert r["auto"] == "shm"  # one host, CPU, gloo
        assert r["shm_files"] == []  # the shared buffer's file is unlinked once mapped
        nb = r["num_buckets"]
        assert nb[0] > nb[1] > nb[2] == pp  # one bucket per stage when everything fits

    for r in results:
        s = r["stats"]
        assert s.bytes == sum(t.numel() * 4 for t in weights.values())
        # a parameter larger than the bucket travels alone; one fused Megatron parameter is at
        # most 3 HF tensors (q, k, v)
        largest = max(t.numel() * 4 for t in weights.values())
        assert s.peak_bucket_bytes <= max(BUCKETS[1], 3 * largest) and s.num_buckets == nb[1]
        print(f"tp{tp} pp{pp} rank: sync {s.bytes} B in {s.num_buckets} buckets, "
              f"{s.seconds * 1e3:.1f} ms; logits diff before {r['logits_diff_before']:.3g} "
              f"after {r['logits_diff']:.3g}")
        assert r["logits_diff_before"] > 1e-2  # the engine really started elsewhere
        assert r["logits_diff"] <= 1e-4

        for eng, ref, fin in zip(r["engine_greedy"], r["megatron_greedy"], r["engine_finish"]):
            if fin == "stop":  # the engine stopped on EOS: the reference must have produced it
                assert eng[-1] == EOS and ref[: len(eng)] == eng
            else:
                assert eng == ref

        for temp, (mean, mx, n) in r["logprob_diff"].items():
            print(f"  sampler vs trainer log-probs at T={temp}: mean {mean:.2e} max {mx:.2e} "
                  f"over {n} tokens")
            assert n > 0 and mx < 1e-4

    if prm_dir is not None:
        phf, _ = _hf_state(prm_dir, head="token_cls")
        pw = results[0]["prm_weights"]
        assert set(pw) == set(phf) and "score.weight" in pw and "score.bias" in pw
        assert all(torch.equal(pw[k], phf[k]) for k in pw)


def test_plan_buckets_respects_size_stage_and_dtype():
    from megaprm.models.mapping import Rule
    from megaprm.rollout.weight_sync import plan_buckets

    rep = Rule("decoder.final_layernorm.weight", "replicated", ("model.norm.weight",))
    row = Rule("decoder.layers.0.mlp.linear_fc2.weight", "row", ("x",))
    f32, bf16 = torch.float32, torch.bfloat16
    metas = [[(row, (4, 8), f32), (rep, (8,), f32), (row, (4, 8), bf16), (row, (4, 8), bf16)],
             [(rep, (100,), f32)]]
    # tp=2: a row shard of 32 elements is 64 full elements = 256 B in fp32, 128 B in bf16
    buckets = plan_buckets(metas, tp_size=2, bucket_bytes=300)
    assert [(b.stage, b.split, b.repl, b.nbytes) for b in buckets] == [
        (0, (0,), (1,), 288), (0, (2, 3), (), 256), (1, (), (0,), 400)]
    assert all(b.dtype == (bf16 if b.split == (2, 3) else f32) for b in buckets)
    with pytest.raises(ValueError, match="bucket_bytes"):
        from megaprm.rollout.weight_sync import iter_hf_buckets

        next(iter_hf_buckets(None, None, 0))
    with pytest.raises(ValueError, match="transport='ipc': must be one of auto, collective, shm"):
        next(iter_hf_buckets(None, None, 1, transport="ipc"))


def _single_rank(model_dir):
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.mapping import load_hf_weights
    from megaprm.models.actor import build_stage
    from megaprm.parallel.init import init_distributed
    from megaprm.rollout import weight_sync
    from megaprm.rollout.hf_engine import HFEngine

    g = init_distributed(tp=1, pp=1)
    spec = spec_from_hf(model_dir)
    model = build_stage(spec, g)
    load_hf_weights(model, model_dir, spec, tp_rank=0, tp_size=1, pp=1, pp_rank=0)
    ref = list(weight_sync.iter_hf_weights(model, g))
    flat = [(n, t.clone()) for b in weight_sync.iter_hf_buckets(model, g, 50_000) for n, t in b]
    same = [n for n, _ in flat] == [n for n, _ in ref] and all(
        torch.equal(a, b) for (_, a), (_, b) in zip(flat, ref))
    engine = HFEngine.from_pretrained(model_dir)
    with torch.no_grad():
        for p in engine.model.parameters():
            p.zero_()
    stats = weight_sync.sync_weights(model, g, engine, bucket_bytes=50_000)
    ids = torch.tensor([[5, 9, 13, 2, 7, 4]])
    with torch.no_grad():
        diff = (engine.model(ids).logits - _megatron_logits(model, g, ids, spec.vocab_size))
    return same, stats, float(diff.abs().max())


def test_tp1_pp1_buckets_are_views_and_sync(model_dirs):
    (same, stats, diff), = launch.spawn(_single_rank, 1, model_dirs["llama"])
    assert same and stats.num_buckets > 1 and diff <= 1e-4
