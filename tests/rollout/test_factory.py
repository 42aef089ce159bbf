"""`rollout.engine`: auto resolves to vLLM only where vLLM is installed and CUDA is present, else
to the transformers engine, with the one line that says which and why; an explicit vllm on a
machine without either is refused before any rank starts, naming rollout.engine=hf."""
import importlib.util

import pytest
import torch

from megaprm.errors import ConfigError
from megaprm.rollout import factory
from megaprm.rollout.config import RolloutConfig
from megaprm.rollout.hf_engine import HFEngine
from tests.test_megaprm_cli import FAST, MEGAPRM, one_line_error, run


def _machine(monkeypatch, vllm: bool, cuda: bool):
    real = importlib.util.find_spec
    monkeypatch.setattr(factory.importlib.util, "find_spec",
                        lambda name, *a: (real("json") if vllm else None) if name == "vllm"
                        else real(name, *a))
    monkeypatch.setattr(factory.torch.cuda, "is_available", lambda: cuda)


@pytest.mark.parametrize("vllm,cuda,want,why", [
    (True, True, "vllm", "rollout.engine=auto: vLLM (installed, CUDA present)"),
    (True, False, "hf", "the transformers engine (no CUDA here; vLLM needs both)"),
    (False, True, "hf", "the transformers engine (no vLLM here; vLLM needs both)"),
    (False, False, "hf", "the transformers engine (no vLLM and no CUDA here; vLLM needs both)"),
])
def test_auto_resolves_per_machine(monkeypatch, vllm, cuda, want, why):
    _machine(monkeypatch, vllm, cuda)
    name, line = factory.resolve_engine("auto")
    assert name == want and why in line and "\n" not in line
    for explicit in ("hf", "vllm"):  # an explicit choice is never changed
        assert factory.resolve_engine(explicit)[0] == explicit
    if vllm and cuda:
        factory.check_engine("vllm")
    else:
        with pytest.raises(ConfigError, match=r"^rollout.engine=vllm: .*; pass rollout.engine="
                                              r"hf \(transformers\) or rollout.engine=auto$"):
            factory.check_engine("vllm")
    factory.check_engine("auto")
    factory.check_engine("hf")


def test_recipes_default_to_auto():
    assert RolloutConfig().engine == "auto"
    with pytest.raises(ConfigError, match="rollout.engine"):
        RolloutConfig(engine="vlm")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from megaprm.models.tiny import save_tiny_model
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    return save_tiny_model("qwen2", str(tmp_path_factory.mktemp("engine") / "p"), tokenizer=tok,
                           vocab_size=len(tok), hidden_size=32, num_layers=1, num_heads=4,
                           num_kv_heads=2, intermediate_size=64, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's resolution")
def test_auto_builds_the_transformers_engine_on_the_cpu(policy, capsys):
    from megaprm.config import load_config
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.preflight import check_rl_launch

    engine = factory.build_engine(RolloutConfig(engine="auto"), policy, build_char_tokenizer(),
                                  world_size=1, tp_size=1, seed=0, device="cpu")
    assert isinstance(engine, HFEngine)
    # the launcher says which, once, in one line
    check_rl_launch(load_config("configs/grpo_tiny.yaml", [
        f"model.path={policy}", "rollout.engine=auto", "trainer.wandb=disabled"]), 1)
    out = capsys.readouterr().out.splitlines()
    assert out == [f"megaprm train: {factory.resolve_engine('auto')[1]}"], out
    assert isinstance(engine, HFEngine)


@pytest.mark.skipif(torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None,
                    reason="vLLM runs here")
def test_vllm_where_it_cannot_run_is_one_line_before_ranks(policy, tmp_path):
    """The recipe as a user types it on a CPU machine with rollout.engine=vllm: one line, exit 2
    (was: a traceback from every rank)."""
    p = run([*MEGAPRM, "train", "--config", "configs/grpo_tiny.yaml", "--nproc", "2",
             f"model.path={policy}", f"trainer.run_dir={tmp_path / 'run'}", *FAST,
             "rollout.engine=vllm"], timeout=300)
    one_line_error(p, "megaprm train: error: rollout.engine=vllm: ", "pass rollout.engine=hf")
    assert not (tmp_path / "run").exists()
