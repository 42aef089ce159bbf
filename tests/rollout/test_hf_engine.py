"""The transformers engine: sampling statistics, seeding, stopping, grouping, weight loading.

References: softmax of the model's own logits (distribution of the first sampled token), a full
recompute without KV cache of the generated sequences (greedy tokens and sampler log-probs).
"""
import pytest
import torch

from megaprm.models.tiny import build_hf_model, tiny_config
from megaprm.rollout.engine import SamplingParams
from megaprm.rollout.hf_engine import HFEngine, HFEngineConfig, sample_tokens

EOS, PAD = 1, 0
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]


def _peaked_model(family="llama", seed=0, **kw):
    """A tiny model whose next-token distributions are far from uniform (scaled LM head)."""
    model = build_hf_model(tiny_config(family, **kw), seed)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.mul_(8.0)  # max p ~ 0.2, ~20 tokens hold 80% of the mass
    return model


@pytest.fixture(scope="module")
def engine():
    return HFEngine(_peaked_model(), HFEngineConfig(eos_token_ids=(EOS,), pad_token_id=PAD))


def _last_logits(engine, prompt):
    with torch.no_grad():
        return engine.model(torch.tensor([prompt])).logits[0, -1].float()


def _nucleus(probs, top_p):
    p, order = probs.sort(descending=True)
    keep = (p.cumsum(0) - p) < top_p
    out = torch.zeros_like(probs)
    out[order[keep]] = p[keep]
    return out / out.sum()


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_first_token_distribution_matches_softmax(engine, temperature, top_p):
    n = 8000
    out = engine.generate([PROMPTS[0]], SamplingParams(n=n, temperature=temperature, top_p=top_p,
                                                       max_tokens=1, seed=123))
    expected = _nucleus(torch.softmax(_last_logits(engine, PROMPTS[0]) / temperature, -1), top_p)
    first = out.response_ids[:, 0]
    empirical = torch.bincount(first, minlength=expected.numel()).float() / n
    tv = 0.5 * (empirical - expected).abs().sum()
    print(f"T={temperature} top_p={top_p}: TV(empirical, softmax) = {tv:.4f} over {n} samples, "
          f"max p = {expected.max():.3f}")
    assert tv < 0.05
    # the bound discriminates: a sampler at the wrong temperature would be far outside it
    wrong = _nucleus(torch.softmax(_last_logits(engine, PROMPTS[0]) / (temperature * 1.5), -1),
                     top_p)
    assert 0.5 * (wrong - expected).abs().sum() > 0.1
    assert expected[first].min() > 0  # never a token outside the nucleus
    # the sampler log-prob is the log of the distribution actually sampled from
    assert torch.allclose(out.sampler_logprobs[:, 0], expected[first].log(), atol=1e-5)


def test_sampler_logprobs_and_greedy_match_full_recompute(engine):
    for params in (SamplingParams(n=2, max_tokens=10, seed=5),
                   SamplingParams(temperature=0.0, max_tokens=10)):
        out = engine.generate(PROMPTS, params)
        rp = out.to_right_padded()
        with torch.no_grad():  # no cache, no left padding: the obvious computation
            logits = engine.model(rp.input_ids, attention_mask=rp.attention_mask).logits.float()
        temp = 1.0 if params.greedy else params.temperature
        lp = torch.log_softmax(logits[:, :-1] / temp, -1).gather(
            -1, rp.input_ids[:, 1:, None]).squeeze(-1)
        lp = rp.to_response(torch.cat([torch.zeros_like(lp[:, :1]), lp], 1), out.response_ids.shape[1])
        mask = out.response_mask.bool()
        assert (lp - out.sampler_logprobs)[mask].abs().max() < 1e-4
        if params.greedy:  # each generated token is the argmax of the recomputed logits
            arg = rp.to_response(torch.cat([torch.zeros_like(rp.input_ids[:, :1]),
                                            logits[:, :-1].argmax(-1)], 1), mask.shape[1])
            assert torch.equal(arg[mask], out.response_ids[mask])


def test_seeds_reproduce_and_rows_are_independent_of_the_batch(engine):
    p = SamplingParams(n=3, max_tokens=12, seed=7)
    a, b = engine.generate(PROMPTS, p), engine.generate(PROMPTS, p)
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.sampler_logprobs, b.sampler_logprobs)
    c = engine.generate(PROMPTS, SamplingParams(n=3, max_tokens=12, seed=8))
    assert not torch.equal(a.response_ids, c.response_ids)
    # row r uses seed + r: row 4 (prompt 1, sample 1) alone with seed 7 + 4 gives the same tokens
    alone = engine.generate([PROMPTS[1]], SamplingParams(n=1, max_tokens=12, seed=7 + 4))
    assert alone.response_token_lists()[0] == a.response_token_lists()[4]


def test_grouping_stop_padding_and_finish_reason(engine):
    greedy_first = int(_last_logits(engine, PROMPTS[2]).argmax())
    # the frequent tokens stop generation: rows end at different steps, some hit max_tokens
    probs = torch.softmax(_last_logits(engine, PROMPTS[0]), -1)
    stops = tuple(int(t) for t in probs.argsort(descending=True)[:2] if int(t) != greedy_first)
    n, max_tokens = 4, 6
    out = engine.generate(PROMPTS, SamplingParams(n=n, max_tokens=max_tokens, seed=3,
                                                  stop_token_ids=stops))
    assert out.group_index.tolist() == [i // n for i in range(len(PROMPTS) * n)]
    for i, prompt in enumerate(PROMPTS):
        for r in range(i * n, i * n + n):
            assert out.prompt_token_lists()[r] == prompt
    stop_ids = set(stops) | {EOS}
    for r, (toks, reason) in enumerate(zip(out.response_token_lists(), out.finish_reason)):
        assert all(t not in stop_ids for t in toks[:-1])
        if reason == "stop":
            assert toks[-1] in stop_ids
        else:
            assert reason == "length" and len(toks) == max_tokens and toks[-1] not in stop_ids
        pad = ~out.response_mask[r].bool()
        assert (out.response_ids[r][pad] == PAD).all() and (out.sampler_logprobs[r][pad] == 0).all()
    assert set(out.finish_reason) == {"stop", "length"}
    assert out.response_ids.shape[1] == int(out.response_lengths.max())

    # greedy that stops at once: a one-token response, finish "stop"
    g = engine.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=5,
                                                     stop_token_ids=(greedy_first,)))
    assert g.response_token_lists() == [[greedy_first]] and g.finish_reason == ["stop"]


def test_load_weights_strict_and_tied_head():
    src = build_hf_model(tiny_config("qwen2"), seed=1)  # tied embeddings
    dst = HFEngine(build_hf_model(tiny_config("qwen2"), seed=2))
    state = dict(src.state_dict())  # contains lm_head.weight (the tied copy)
    assert dst.load_weights(state.items()) == len(dict(src.named_parameters()))
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(src(ids).logits, dst.model(ids).logits)
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        dst.load_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        dst.load_weights([("model.norm.weight", torch.zeros(3))], strict=False)
    with pytest.raises(ValueError, match="were not in the stream"):
        dst.load_weights([("model.norm.weight", state["model.norm.weight"])])
    assert dst.load_weights([("model.norm.weight", state["model.norm.weight"])], strict=False) == 1


def test_user_errors(engine):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate([[5]], SamplingParams(max_tokens=10_000))
    # a prompt longer than the positions (a 400 KB row) names the settings that fix it
    too_long = engine.max_positions + 1
    with pytest.raises(ValueError) as e:
        engine.generate([[5] * too_long], SamplingParams(max_tokens=4))
    assert f"data.max_prompt_tokens={engine.max_positions - 4} with data.long_prompt=" in str(
        e.value) and "rollout.max_tokens" in str(e.value)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[5, 10_000]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="HFEngineConfig.dtype"):
        HFEngineConfig(dtype="fp8")


def test_sample_tokens_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(top_p=0.8)
    # u near 1 lands on the last token of the nucleus {0, 1}; never on 2 or 3
    tok, lp = sample_tokens(logits, p, torch.tensor([1.0]))
    assert int(tok) == 1 and abs(float(lp) - float(torch.tensor(0.3 / 0.8).log())) < 1e-6


def test_with_the_task_tokenizer():
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = build_hf_model(tiny_config("qwen2", vocab_size=len(tok)), seed=4)
    eng = HFEngine(model, HFEngineConfig(eos_token_ids=(tok.eos_token_id,),
                                         pad_token_id=tok.pad_token_id))
    prompts = [tok.encode("1+2=?"), tok.encode("3*4=")]
    out = eng.generate(prompts, SamplingParams(n=2, max_tokens=8, seed=0))
    assert out.decode_prompts(tok) == ["1+2=?", "1+2=?", "3*4=", "3*4="]
    texts = out.decode_responses(tok)
    assert len(texts) == 4 and all(isinstance(t, str) for t in texts)


def test_update_without_the_kv_cache_refuses_generate_until_wake():
    """The RL loop's split (trainer/lifecycle.py), as on vLLM: update_weights(wake_kv_cache=
    False) loads, generate is refused until wake(), which then serves the loaded weights."""
    from megaprm.rollout.engine import EngineAsleepError

    model = _peaked_model("qwen2", seed=5)
    other = _peaked_model("qwen2", seed=6)
    eng = HFEngine(model, HFEngineConfig(eos_token_ids=(EOS,), pad_token_id=PAD))
    params = SamplingParams(n=2, max_tokens=10, seed=4)
    eng.sleep()
    stream = [(n, p.detach()) for n, p in other.named_parameters()]
    assert eng.update_weights(iter(stream), wake_kv_cache=False) == len(stream) and eng.asleep
    with pytest.raises(EngineAsleepError):
        eng.generate(PROMPTS, params)
    eng.wake()
    fresh = HFEngine(other, HFEngineConfig(eos_token_ids=(EOS,), pad_token_id=PAD))
    assert not eng.asleep and torch.equal(eng.generate(PROMPTS, params).response_ids,
                                          fresh.generate(PROMPTS, params).response_ids)


def test_lifecycle_sleep_update_gives_the_same_generations():
    """generate -> sleep -> update_weights(same weights) -> generate repeats the first rollout
    bit for bit; a different stream gives the fresh engine's rollout; the errors of a sleeping
    engine are the vLLM engine's (the CPU run goes through the GPU run's calls)."""
    from megaprm.rollout.engine import EngineAsleepError

    model = _peaked_model("qwen2", seed=5)
    state = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    eng = HFEngine(model, HFEngineConfig(eos_token_ids=(EOS,), pad_token_id=PAD))
    params = SamplingParams(n=2, max_tokens=10, seed=4)
    before = eng.generate(PROMPTS, params)
    eng.sleep()
    assert eng.asleep
    with pytest.raises(EngineAsleepError, match="update_weights"):
        eng.generate(PROMPTS, params)
    with pytest.raises(EngineAsleepError, match="update_weights"):
        eng.load_weights(iter(state))
    assert eng.update_weights(iter(state)) == len(state) and not eng.asleep
    after = eng.generate(PROMPTS, params)
    assert torch.equal(before.response_ids, after.response_ids)
    assert torch.equal(before.sampler_logprobs, after.sampler_logprobs)
    assert before.finish_reason == after.finish_reason

    other = _peaked_model("qwen2", seed=6)
    eng.sleep()
    eng.update_weights((n, p.detach()) for n, p in other.named_parameters())
    fresh = HFEngine(other, HFEngineConfig(eos_token_ids=(EOS,), pad_token_id=PAD))
    assert torch.equal(eng.generate(PROMPTS, params).response_ids,
                       fresh.generate(PROMPTS, params).response_ids)
    eng.sleep()
    eng.wake()  # evaluation: wake without loading keeps the weights held at sleep()
    assert torch.equal(eng.generate(PROMPTS, params).response_ids,
                       fresh.generate(PROMPTS, params).response_ids)


def test_eos_as_the_last_allowed_token_is_stop(engine):
    first = int(_last_logits(engine, PROMPTS[0]).argmax())
    eng = HFEngine(engine.model, HFEngineConfig(eos_token_ids=(first,), pad_token_id=PAD))
    out = eng.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=1))
    assert out.response_token_lists() == [[first]] and out.finish_reason == ["stop"]


def test_generate_raises_no_deprecation_warning(engine):
    """The KV cache goes in under the name the installed transformers takes (`cache` since 5.24;
    `past_key_values` there is a FutureWarning on every generate call)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        out = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=4, seed=1))
    assert out.response_ids.shape[0] == 2 * len(PROMPTS)
