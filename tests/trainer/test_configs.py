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
    for m in set(METHODS) - {"drgrpo"}:
        assert {m, f"{m}_tiny"} <= names, m


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: os.path.basename(p))
def test_recipe_loads(path):
    cfg = load_config(path)
    name = os.path.basename(path)[:-5].removesuffix("_tiny")
    assert cfg.advantage.method == name
    if not path.endswith("_tiny.yaml"):
        assert cfg.model.dtype == "bf16" and cfg.rollout.engine == "vllm"


def test_released_defaults():
    prime = load_config(os.path.join(ROOT, "configs", "prime.yaml"))
    assert (prime.rollout.n, prime.actor.optim.lr, prime.prm.beta) == (4, 5e-7, 0.05)
    pure = load_config(os.path.join(ROOT, "configs", "pure.yaml"))
    assert pure.rollout.temperature == 0.5 and pure.advantage.pure.temperature == 0.1
    prof = load_config(os.path.join(ROOT, "configs", "prof_grpo.yaml"))
    assert (prof.rollout.n, prof.advantage.prof.remove, prof.actor.kl_coef) == (8, 4, 0.001)
    papo = load_config(os.path.join(ROOT, "configs", "papo.yaml"))
    assert (papo.actor.eps_high, papo.advantage.papo.lam) == (0.28, 1.0)
