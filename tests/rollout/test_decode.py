"""The compact decode step (megaprm/rollout/decode.py) against transformers' own forward.

References: the model's cached forward (`model(input_ids, attention_mask, position_ids, cache)`)
step by step, and the engine's transformers path (`compact_decode=False`) for whole generations.
"""
import pytest
import torch
from transformers import DynamicCache

from megaprm.models.tiny import build_hf_model, tiny_config
from megaprm.rollout import decode
from megaprm.rollout.engine import SamplingParams, left_pad
from megaprm.rollout.hf_engine import HFEngine, HFEngineConfig

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [3], [20, 21, 22, 23]]


def _model(family, seed=0, **kw):
    model = build_hf_model(tiny_config(family, **kw), seed)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # peaked: rows stop at different steps
    return model


@pytest.mark.parametrize("family,kw", [
    ("qwen2", {}),                                           # q/k/v bias, GQA, tied head
    ("llama", {}),                                           # llama3 rope scaling, no bias
    ("llama", {"num_kv_heads": 4, "tie": True}),             # plain multi-head attention
])
def test_logits_match_transformers_step_by_step_with_rows_dropped(family, kw):
    model = _model(family, **kw)
    assert decode.unsupported(model) is None
    ids, mask = left_pad(PROMPTS, 0, 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache,
                    use_cache=True)
    ref_cache = DynamicCache(config=model.config)
    with torch.no_grad():  # an independent prefill for the reference
        model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=ref_cache,
              use_cache=True)
    dec = decode.CompactDecoder(model)
    dec.start(cache, mask, max_new=8)
    tok = out.logits[:, -1].argmax(-1)
    next_pos = mask.sum(1, keepdim=True)
    attn = mask
    # rows kept after each step: one dropped (buffers kept, row rides along), then down to
    # half (buffers compacted), then one more
    drops = {1: [0, 1, 2, 4], 3: [0, 2], 5: [1]}
    for t in range(7):
        if t in drops:
            keep = torch.tensor(drops[t])
            dec.select(keep)
            ref_cache.batch_select_indices(keep)
            tok, next_pos, attn = tok[keep], next_pos[keep], attn[keep]
        got = dec.step(tok, next_pos)
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
        with torch.no_grad():
            ref = model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos,
                        cache=ref_cache, use_cache=True).logits[:, -1].float()
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        tok = ref.argmax(-1)
        next_pos = next_pos + 1


def _engines(model, **cfg):
    fast = HFEngine(model, HFEngineConfig(**cfg))
    slow = HFEngine(model, HFEngineConfig(compact_decode=False, **cfg))
    assert fast.decoder is not None and slow.decoder is None
    return fast, slow


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_engine_generations_equal_the_transformers_path(family):
    fast, slow = _engines(_model(family), eos_token_ids=(1, 2, 3), pad_token_id=0)
    params = SamplingParams(n=4, max_tokens=24, temperature=1.0, top_p=0.9, seed=7)
    a, b = fast.generate(PROMPTS, params), slow.generate(PROMPTS, params)
    stops = sum(r == "stop" for r in a.finish_reason)
    assert 0 < stops < len(a.finish_reason)  # rows finished at different steps
    assert torch.equal(a.response_ids, b.response_ids)
    assert a.finish_reason == b.finish_reason
    torch.testing.assert_close(a.sampler_logprobs, b.sampler_logprobs, rtol=0, atol=2e-5)
    g = SamplingParams(n=1, max_tokens=12, temperature=0.0)
    assert torch.equal(fast.generate(PROMPTS, g).response_ids, slow.generate(PROMPTS, g).response_ids)


def test_weight_updates_reach_the_fused_weights():
    fast, slow = _engines(_model("qwen2"), eos_token_ids=(1,), pad_token_id=0)
    g = SamplingParams(n=1, max_tokens=10, temperature=0.0)
    before = fast.generate(PROMPTS, g).response_ids
    new = build_hf_model(tiny_config("qwen2"), seed=5)
    fast.update_weights(new.state_dict().items())  # the same model object: both engines see it
    after = fast.generate(PROMPTS, g)
    assert not torch.equal(before, after.response_ids)
    ref = slow.generate(PROMPTS, g)
    assert torch.equal(after.response_ids, ref.response_ids)
    torch.testing.assert_close(after.sampler_logprobs, ref.sampler_logprobs, rtol=0, atol=2e-5)


def test_unsupported_architectures_use_the_transformers_step():
    qwen3 = build_hf_model(tiny_config("qwen3"), 0)
    assert "qwen3" in decode.unsupported(qwen3)
    assert HFEngine(qwen3, HFEngineConfig(eos_token_ids=(1,))).decoder is None
    sliding = build_hf_model(tiny_config("qwen2", use_sliding_window=True, sliding_window=4), 0)
    assert decode.unsupported(sliding) == "sliding-window attention"


def test_rotated_rows_are_rotate_half():
    from transformers.models.qwen2.modeling_qwen2 import rotate_half

    w = torch.randn(3 * 8, 5)  # 3 heads of head_dim 8
    x = torch.randn(5)
    got = decode._rotated(w, 8) @ x
    assert torch.equal(got.view(3, 8), rotate_half((w @ x).view(3, 8)))
