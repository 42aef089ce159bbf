"""The vLLM engine: a clear error without vLLM; the real checks need a GPU and the `gpu` extra."""
import importlib.util

import pytest

from megaprm.rollout.engine import SamplingParams

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def test_without_vllm_construction_names_the_extra():
    if HAVE_VLLM:
        pytest.skip("vLLM is installed: the missing-dependency error cannot be shown")
    from megaprm.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

    with pytest.raises(ImportError, match=r"pip install -e \.\[gpu\]"):
        VLLMEngine.from_pretrained("/nonexistent/model", VLLMEngineConfig())


def test_config_validation():
    from megaprm.rollout.vllm_engine import VLLMEngineConfig

    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VLLMEngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        VLLMEngineConfig(tensor_parallel_size=0)


@pytest.mark.gpu
def test_vllm_generate_sleep_wake_and_weight_load(tmp_path):
    try:
        import torch
    except ImportError:  # pragma: no cover
        pytest.skip("torch missing")
    if not HAVE_VLLM or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU and vLLM: install with `pip install -e .[gpu]` "
                    f"(vllm installed: {HAVE_VLLM}, cuda: {torch.cuda.is_available()})")
    from megaprm.models.tiny import build_hf_model, save_tiny_model, tiny_config
    from megaprm.rollout.hf_engine import HFEngine, HFEngineConfig
    from megaprm.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

    model_dir = save_tiny_model("qwen2", str(tmp_path / "m"), seed=0)
    eng = VLLMEngine(model_dir, VLLMEngineConfig(gpu_memory_utilization=0.2, enforce_eager=True,
                                                 dtype="float32"))
    out = eng.generate([[5, 6, 7], [8, 9]], SamplingParams(n=2, max_tokens=8, seed=1))
    assert out.batch_size == 4 and out.group_index.tolist() == [0, 0, 1, 1]
    eng.sleep()
    eng.wake()
    other = build_hf_model(tiny_config("qwen2"), seed=9)
    eng.load_weights(other.state_dict().items())
    greedy = SamplingParams(temperature=0, max_tokens=8)
    ref = HFEngine(other, HFEngineConfig(device="cuda")).generate([[5, 6, 7]], greedy)
    got = eng.generate([[5, 6, 7]], greedy)
    assert got.response_token_lists() == ref.response_token_lists()
