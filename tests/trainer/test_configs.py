"""Every shipped recipe parses and validates, and carries its method's released defaults."""
import glob
import os

import pytest

from megaprm.config import load_config

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
RECIPES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def test_one_gpu_and_one_tiny_recipe_per_method():
    from megaprm.algorithms.registry import METHODS

    names = {os.path.basename(p)[:-5] for p in RECIPES}
    for m in METHODS:
        assert {m, f"{m}_tiny"} <= names, m


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: os.path.basename(p))
def test_recipe_loads(path):
    cfg = load_config(path)
    name = os.path.basename(path)[:-5].removesuffix("_tiny")
    assert cfg.advantage.method == name
    if not path.endswith("_tiny.yaml"):
        assert cfg.model.dtype == "bf16" and cfg.rollout.engine == "auto"


def test_released_defaults():
    prime = load_config(os.path.join(ROOT, "configs", "prime.yaml"))
    assert (prime.rollout.n, prime.actor.optim.lr, prime.prm.beta) == (4, 5e-7, 0.05)
    pure = load_config(os.path.join(ROOT, "configs", "pure.yaml"))
    assert pure.rollout.temperature == 0.5 and pure.advantage.pure.temperature == 0.1
    prof = load_config(os.path.join(ROOT, "configs", "prof_grpo.yaml"))
    assert (prof.rollout.n, prof.advantage.prof.remove, prof.actor.kl_coef) == (8, 4, 0.001)
    papo = load_config(os.path.join(ROOT, "configs", "papo.yaml"))
    assert (papo.actor.eps_high, papo.advantage.papo.lam) == (0.28, 1.0)


def _recipe(name):
    return load_config(os.path.join(ROOT, "configs", f"{name}.yaml"))


def test_recipes_follow_the_released_scripts():
    """Values the released scripts / their yaml defaults set."""
    for name in ("prime", "prof_grpo", "grpo", "blend", "drgrpo", "papo"):
        assert _recipe(name).actor.optim.weight_decay == 0.01, name  # verl / AdamW default
    prime = _recipe("prime")
    assert prime.model.path.endswith("Eurus-2-7B-SFT") and prime.prm.path == prime.model.path
    assert (prime.prm.optim.weight_decay, prime.prm.optim.clip_grad) == (0.0, 10.0)
    assert prime.actor.mini_batches == 4
    for name in ("prof_grpo", "blend"):
        cfg = _recipe(name)
        assert cfg.prm.path.endswith("Qwen2.5-Math-PRM-7B")
        assert cfg.prm.input_format == "qwen25_math_prm"
    grpo = _recipe("grpo")  # run_grpo.sh
    assert grpo.model.path.endswith("Qwen2.5-Math-1.5B")
    assert (grpo.rollout.n, grpo.data.prompts_per_step, grpo.actor.mini_batches) == (8, 1024, 4)
    assert (grpo.actor.kl_coef, grpo.actor.kl_kind, grpo.actor.entropy_coef) == \
        (0.001, "low_var_kl", 0.001)
    papo = _recipe("papo")
    assert papo.model.path.endswith("Qwen2.5-7B") and papo.trainer.steps == 7 * (20000 // 128)
    assert (papo.actor.kl_coef, papo.actor.entropy_coef) == (0.0, 0.0)
    # the smaller released quirks, each as released in its recipe
    assert (prime.actor.shuffle_mini_batches, prime.advantage.prime.norm_scope) == (True, "shard")
    pure = _recipe("pure")
    assert (pure.actor.micro_batch_size, pure.actor.skip_ratio_scope) == (2, "sequence")
    assert (pure.rollout.temperature, pure.actor.logprob_temperature) == (0.5, 1.0)
    assert (pure.reward.verifier, prime.reward.verifier) == ("hendrycks_math", "prime_math")
    prof = _recipe("prof_grpo")
    assert (prof.reward.verifier, prof.advantage.prof.precision) == ("prof_math_verify", "released")
    assert (prof.data.prompt_format, prof.prm.forward) == ("chat", "compact")
    dr = _recipe("drgrpo")
    assert dr.actor.loss_agg == "seq-mean-token-sum-norm" and dr.advantage.method == "drgrpo"
    for field in ("model", "data", "rollout"):  # otherwise the GRPO run
        assert getattr(dr, field) == getattr(grpo, field), field


def test_blend_uses_grpo_eps():
    """advantage.grpo.eps reaches Blend's GRPO (registry), checked against a loop."""
    import torch

    from megaprm.algorithms.registry import (AdvantageConfig, AdvantageInputs, GrpoConfig,
                                             compute_advantages)

    o = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    p = torch.tensor([0.9, 0.2, 0.4, 0.7, 0.1, 0.3])
    gids = torch.tensor([0, 0, 0, 1, 1, 1])
    x = AdvantageInputs(outcome=o, group_ids=gids, response_mask=torch.ones(6, 2),
                        process_step_scores=p[:, None], step_mask=torch.ones(6, 1, dtype=torch.bool))
    for eps in (1e-6, 0.5):
        cfg = AdvantageConfig(method="blend", grpo=GrpoConfig(eps=eps))
        got = compute_advantages(cfg, x).advantages[:, 0]
        for i in range(6):
            r = [o[j].item() + 0.8 * p[j].item() for j in range(6) if gids[j] == gids[i]]
            mean = sum(r) / 3
            std = (sum((v - mean) ** 2 for v in r) / 2) ** 0.5
            want = (o[i].item() + 0.8 * p[i].item() - mean) / (std + eps)
            assert abs(got[i].item() - want) < 1e-5


@pytest.mark.parametrize("overrides", [["data.path=mine.jsonl"],
                                       ["data.eval_path=held.jsonl", "data.long_prompt=drop"]])
def test_prompt_file_keys_with_the_embedded_task_are_an_error(overrides):
    """data.task=arithmetic reads no file: a data file setting there used to be ignored silently."""
    from megaprm.errors import ConfigError

    with pytest.raises(ConfigError, match=r"would be ignored: data.task='arithmetic'") as e:
        load_config("configs/grpo_tiny.yaml", overrides)
    assert all(o.split("=")[0] in str(e.value) for o in overrides) and "\n" not in str(e.value)
    cfg = load_config("configs/grpo_tiny.yaml", ["data.task=math", "data.path=p.jsonl", *overrides])
    assert cfg.data.task == "math"
