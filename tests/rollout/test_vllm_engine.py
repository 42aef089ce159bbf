"""The vLLM engine against a recording stand-in of `vllm.LLM` (tests/rollout/fake_vllm.py, every
rule citing the vLLM 0.33.0 source it mirrors), plus the clear error without vLLM and a GPU test
that runs only where vLLM and CUDA are installed.

Reference for generations: the transformers engine (HFEngine) over the same weights: greedy tokens
must match exactly, sampler log-probs to fp32 rounding.
"""
import importlib.util
import random
import sys

import fake_vllm
import numpy as np
import pytest
import torch

from megaprm.models.tiny import build_hf_model, save_tiny_model, tiny_config
from megaprm.rollout.engine import EngineAsleepError, SamplingParams, finish_reason
from megaprm.rollout.hf_engine import HFEngine, HFEngineConfig

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
PROMPTS = [[5, 6, 7], [8, 9]]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model("qwen2", str(tmp_path_factory.mktemp("m") / "m"), seed=0)


@pytest.fixture
def vllm(monkeypatch):
    """The stand-in as `vllm`, a single-process job, multiprocessing unset."""
    mod = fake_vllm.module()
    monkeypatch.setitem(sys.modules, "vllm", mod)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(fake_vllm.LLM, "finish_rule", fake_vllm.VERSION)
    return mod


def _engine(model_dir, **kw):
    from megaprm.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

    return VLLMEngine(model_dir, VLLMEngineConfig(**kw))


def _ops(llm):
    """The call log without the constructor, wake tags folded into the name."""
    return fake_vllm.call_names(llm.log)


def _other_weights(seed=9):
    model = build_hf_model(tiny_config("qwen2"), seed=seed)
    return model, [(n, p.detach().clone()) for n, p in model.named_parameters()]


@pytest.mark.parametrize("level", [1, 2])
def test_lifecycle_in_vllms_order_serves_the_new_weights(vllm, model_dir, level):
    eng = _engine(model_dir, sleep_level=level)
    llm = eng.llm
    before = eng.generate(PROMPTS, GREEDY)
    eng.sleep()
    eng.sleep()  # idempotent: vLLM's executor would only warn on a second sleep
    assert eng.asleep and llm.executor.sleeping_tags == {"weights", "kv_cache"}
    other, stream = _other_weights()
    assert eng.update_weights(iter(stream)) == len(stream)
    assert not eng.asleep
    got = eng.generate(PROMPTS, GREEDY)
    assert _ops(llm) == ["generate", f"sleep:{level}", "wake_up:weights", "load_weights",
                         "reset_prefix_cache", "wake_up:kv_cache", "generate"]
    assert llm.warnings == [] and llm.stale_prefix_hits == 0
    ref = HFEngine(other).generate(PROMPTS, GREEDY)
    assert got.response_token_lists() == ref.response_token_lists()
    assert got.response_token_lists() != before.response_token_lists()
    mask = got.response_mask.bool()
    assert torch.allclose(got.sampler_logprobs[mask], ref.sampler_logprobs[mask], atol=1e-5)
    # the stand-in's buffers (rotary inverse frequencies) survived a level-2 sleep
    hf = llm.model.hf
    assert all(torch.isfinite(b).all() for _, b in hf.named_buffers())


@pytest.mark.parametrize("level", [1, 2])
def test_update_without_the_kv_cache_then_wake_is_the_same_order(vllm, model_dir, level):
    """The RL loop's split (trainer/lifecycle.py): update_weights(wake_kv_cache=False) stops
    before the KV cache, generate is refused until wake() wakes it, and the calls reaching vLLM
    are the ones of a plain update_weights."""
    from megaprm.rollout.engine import EngineAsleepError

    eng = _engine(model_dir, sleep_level=level)
    llm = eng.llm
    eng.sleep()
    other, stream = _other_weights()
    assert eng.update_weights(iter(stream), wake_kv_cache=False) == len(stream)
    assert eng.asleep and llm.executor.sleeping_tags == {"kv_cache"}
    with pytest.raises(EngineAsleepError, match="kv_cache"):
        eng.generate(PROMPTS, GREEDY)
    eng.wake()
    got = eng.generate(PROMPTS, GREEDY)
    assert _ops(llm) == [f"sleep:{level}", "wake_up:weights", "load_weights",
                         "reset_prefix_cache", "wake_up:kv_cache", "generate"]
    assert llm.warnings == [] and llm.stale_prefix_hits == 0
    assert got.response_token_lists() == HFEngine(other).generate(
        PROMPTS, GREEDY).response_token_lists()


def test_sampled_rollout_after_update_matches_the_transformers_distribution(vllm, model_dir):
    """Sampler log-probs are the tempered, nucleus-renormalised log-probs of the new weights."""
    eng = _engine(model_dir)
    eng.sleep()
    other, stream = _other_weights(3)
    eng.update_weights(stream)
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, max_tokens=6, seed=11)
    out = eng.generate(PROMPTS, params)
    assert out.group_index.tolist() == [0, 0, 0, 1, 1, 1]
    rp = out.to_right_padded()
    with torch.no_grad():
        logits = other(rp.input_ids, attention_mask=rp.attention_mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1] / params.temperature, -1)
    p = lp.exp()
    sorted_p, order = p.sort(-1, descending=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < params.top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    nucleus = torch.log_softmax(lp.masked_fill(~keep, float("-inf")), -1)
    ref = nucleus.gather(-1, rp.input_ids[:, 1:, None]).squeeze(-1)
    ref = rp.to_response(torch.cat([torch.zeros_like(ref[:, :1]), ref], 1),
                         out.response_ids.shape[1])
    mask = out.response_mask.bool()
    assert (ref - out.sampler_logprobs)[mask].abs().max() < 1e-4


def test_the_stand_in_punishes_the_wrong_orders(vllm, model_dir):
    """The rules the engine's order avoids (so the lifecycle test above can fail)."""
    eng = _engine(model_dir, sleep_level=1)
    llm = eng.llm
    before = eng.generate(PROMPTS, GREEDY)
    _, stream = _other_weights()
    llm.sleep(level=1)
    with pytest.raises(fake_vllm.IllegalMemoryAccess):  # load into unmapped weights
        llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model() \
            .load_weights(iter(stream))
    with pytest.raises(RuntimeError, match="would hang"):  # generate while paused
        llm.generate([{"prompt_token_ids": [5]}], fake_vllm.SamplingParams(max_tokens=1))
    llm.wake_up(tags=["weights"])
    llm.wake_up(tags=["weights"])  # already awake: vLLM warns and does nothing
    assert llm.warnings and "not in sleeping tags" in llm.warnings[-1]
    llm.wake_up(tags=["kv_cache"])
    # level 1 keeps the old weights: waking without a load serves the stale model
    assert eng.generate(PROMPTS, GREEDY).response_token_lists() == before.response_token_lists()
    # level 2 keeps nothing: waking without a load serves garbage (NaN here)
    llm.sleep(level=2)
    llm.wake_up()
    assert all(torch.isnan(p).all() for _, p in llm.model.hf.named_parameters())


def test_engine_errors_while_asleep_and_partial_level2_updates(vllm, model_dir):
    eng = _engine(model_dir, sleep_level=2)
    _, stream = _other_weights()
    eng.sleep()
    with pytest.raises(EngineAsleepError, match="update_weights"):
        eng.load_weights(iter(stream))
    with pytest.raises(EngineAsleepError, match="update_weights"):
        eng.generate(PROMPTS, GREEDY)
    with pytest.raises(EngineAsleepError, match="level-2"):
        eng.wake()
    with pytest.raises(ValueError, match=r"strict=False\) after a level-2 sleep"):
        eng.update_weights(iter(stream[:3]), strict=False)
    with pytest.raises(ValueError, match="vLLM parameters not loaded"):
        eng.update_weights(iter(stream[:3]))
    # awake engine: load_weights works and resets the prefix cache
    eng2 = _engine(model_dir, sleep_level=1)
    assert eng2.load_weights(iter(stream)) == len(stream)
    assert _ops(eng2.llm) == ["load_weights", "reset_prefix_cache"]
    eng2.sleep()
    eng2.wake()  # level 1: the offloaded weights come back
    assert _ops(eng2.llm)[-1] == "wake_up:weights,kv_cache" and not eng2.asleep


def test_llm_arguments_and_multiprocessing_error(vllm, model_dir, monkeypatch):
    eng = _engine(model_dir, seed=7, gpu_memory_utilization=0.3)
    kw = eng.llm.kwargs
    assert kw["skip_tokenizer_init"] is True and kw["enable_sleep_mode"] is True
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["seed"] == 7
    assert "distributed_executor_backend" not in kw and eng.llm.local_rank == 0
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(RuntimeError, match="set VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        _engine(model_dir)
    # built in multiprocess mode anyway (the env read after our check): the same one line
    from megaprm.rollout.vllm_engine import VLLMEngine

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    eng = _engine(model_dir)
    eng.llm.llm_engine = fake_vllm.LLMEngine(None)
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        VLLMEngine._model(eng)


def test_external_launcher_when_world_is_larger_than_one(vllm, model_dir, monkeypatch):
    from megaprm.rollout.config import RolloutConfig
    from megaprm.rollout.factory import build_engine
    from megaprm.tasks.tokenizer import build_char_tokenizer

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    tok = build_char_tokenizer()
    eng = build_engine(RolloutConfig(engine="vllm"), model_dir, tok, world_size=4, tp_size=2,
                       seed=5, device="cpu")
    kw = eng.llm.kwargs
    assert kw["distributed_executor_backend"] == "external_launcher"
    assert kw["tensor_parallel_size"] == 2 and kw["seed"] == 5
    assert eng.llm.local_rank == 3 and eng.llm.tp_group == [2, 3]
    assert eng.cfg.eos_token_ids == (tok.eos_token_id,)
    # tp = 1 but two ranks: still external_launcher (else every rank lands on local rank 0)
    eng = build_engine(RolloutConfig(engine="vllm"), model_dir, tok, world_size=4, tp_size=1,
                       seed=5, device="cpu")
    assert eng.llm.kwargs["distributed_executor_backend"] == "external_launcher"
    assert eng.llm.local_rank == 3
    with pytest.raises(ValueError, match="multiple of tp_size=3"):
        build_engine(RolloutConfig(engine="vllm"), model_dir, tok, world_size=4, tp_size=3,
                     seed=5, device="cpu")
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(RuntimeError, match="MASTER_PORT"):
        build_engine(RolloutConfig(engine="vllm"), model_dir, tok, world_size=4, tp_size=1,
                     seed=5, device="cpu")


class _FakeCuda:
    """torch.cuda's device / RNG calls on a CPU box, to watch what building an engine does."""

    def __init__(self):
        self.device, self.states = 1, [torch.tensor([1, 2, 3], dtype=torch.uint8)]

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.device)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: setattr(self, "device", int(d)))
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in
                                                                       self.states])
        monkeypatch.setattr(torch.cuda, "set_rng_state_all",
                            lambda ss: setattr(self, "states", [s.clone() for s in ss]))
        monkeypatch.setattr(torch.cuda, "manual_seed_all",
                            lambda seed: setattr(self, "states", [torch.tensor([seed % 256],
                                                                               dtype=torch.uint8)]))


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_building_keeps_the_callers_rng_and_device(vllm, model_dir, monkeypatch, engine):
    from megaprm.rollout.config import RolloutConfig
    from megaprm.rollout.factory import build_engine
    from megaprm.tasks.tokenizer import build_char_tokenizer

    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    if engine == "hf":  # the HF engine would move the model to the (fake) GPU: stay on CPU
        device = "cpu"
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    else:
        device = "cuda:0"
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    expect = (random.random(), np.random.rand(), torch.rand(2))
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    cuda.states = [torch.tensor([1, 2, 3], dtype=torch.uint8)]  # manual_seed reseeded them
    build_engine(RolloutConfig(engine=engine), model_dir, build_char_tokenizer(),
                 world_size=1, tp_size=1, seed=0, device=device)
    got = (random.random(), np.random.rand(), torch.rand(2))
    assert got[0] == expect[0] and got[1] == expect[1] and torch.equal(got[2], expect[2])
    assert cuda.device == 1 and cuda.states[0].tolist() == [1, 2, 3]
    if engine == "vllm":  # the stand-in did reseed and switch device: the factory undid it
        assert fake_vllm.LLM.instances[-1].local_rank == 0


def test_eos_as_the_last_allowed_token_is_stop_whatever_vllm_says(vllm, model_dir, monkeypatch):
    """0.10.2 labels an EOS sampled as the max_tokens-th token "length"; the engine reads the
    tokens. Reference: the greedy continuation from the transformers engine."""
    ref = HFEngine.from_pretrained(model_dir).generate([[5, 6, 7]], SamplingParams(
        temperature=0, max_tokens=4)).response_token_lists()[0]
    other = next(t for t in range(96) if t not in ref)
    for rule in ("0.10.2", "0.33.0"):
        monkeypatch.setattr(fake_vllm.LLM, "finish_rule", rule)
        eng = _engine(model_dir, eos_token_ids=(ref[0],))
        out = eng.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=1))
        assert out.response_token_lists() == [ref[:1]] and out.finish_reason == ["stop"], rule
        eng = _engine(model_dir, eos_token_ids=(other,))
        out = eng.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
        assert out.response_token_lists() == [ref] and out.finish_reason == ["length"], rule
    assert finish_reason([3, 4], {4}) == "stop" and finish_reason([4, 3], {4}) == "length"
    assert finish_reason([], {4}) == "length"


def test_without_vllm_construction_names_the_extra(monkeypatch):
    if HAVE_VLLM:
        pytest.skip("vLLM is installed: the missing-dependency error cannot be shown")
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    from megaprm.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

    with pytest.raises(ImportError, match=r"pip install -e \.\[gpu\]"):
        VLLMEngine.from_pretrained("/nonexistent/model", VLLMEngineConfig())


def test_config_validation():
    from megaprm.rollout.vllm_engine import VLLMEngineConfig

    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VLLMEngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        VLLMEngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="sleep_level"):
        VLLMEngineConfig(sleep_level=3)
    with pytest.raises(ValueError, match="external_launcher"):
        VLLMEngineConfig(tensor_parallel_size=2)


@pytest.mark.gpu
@pytest.mark.parametrize("level", [1, 2])
def test_vllm_lifecycle_on_a_gpu(tmp_path, level):
    """Not run in megaprm's development (no GPU with vLLM): the same lifecycle on real vLLM."""
    if not HAVE_VLLM or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU and vLLM: install with `pip install -e .[gpu]` "
                    f"(vllm installed: {HAVE_VLLM}, cuda: {torch.cuda.is_available()})")
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model_dir = save_tiny_model("qwen2", str(tmp_path / "m"), seed=0, tokenizer=tok,
                                vocab_size=len(tok))
    eng = _engine(model_dir, gpu_memory_utilization=0.2, enforce_eager=True, dtype="float32",
                  sleep_level=level)
    out = eng.generate([[5, 6, 7], [8, 9]], SamplingParams(n=2, max_tokens=8, seed=1))
    assert out.batch_size == 4 and out.group_index.tolist() == [0, 0, 1, 1]
    eng.sleep()
    other = build_hf_model(tiny_config("qwen2", vocab_size=len(tok)), seed=9)
    eng.update_weights((n, p.detach().cuda()) for n, p in other.named_parameters())
    ref = HFEngine(other, HFEngineConfig(device="cuda")).generate([[5, 6, 7]], GREEDY)
    got = eng.generate([[5, 6, 7]], GREEDY)
    assert got.response_token_lists() == ref.response_token_lists()
