"""The RL loop end to end on CPU: every estimator under dp=2 and tp=2, NaN guard, and
kill-during-save + resume reproducing the uninterrupted run."""
import json
import os
import subprocess
import sys

import pytest
import torch

from megaprm.algorithms.registry import METHODS
from megaprm.config import ConfigError, load_config
from megaprm.parallel import launch

DEMO_YAML = os.path.join(os.path.dirname(__file__), "..", "..", "megaprm", "configs", "demo.yaml")
SMALL = ["trainer.wandb=disabled", "trainer.progress=false", "rollout.max_tokens=20",
         "data.prompts_per_step=4", "rollout.n=4", "actor.micro_batch_size=4",
         "actor.optim.lr=1e-3", "advantage.prof.remove=2"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny policy and a tiny token-classification PRM sharing the char tokenizer."""
    from megaprm.models.tiny import build_hf_model, save_tiny_model, tiny_config
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    root = tmp_path_factory.mktemp("models")
    kw = dict(vocab_size=len(tok), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
              intermediate_size=64, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    policy = save_tiny_model("qwen2", str(root / "policy"), tokenizer=tok, **kw)
    prm = build_hf_model(tiny_config("qwen2", head="token_cls", **kw), seed=1)
    prm.save_pretrained(str(root / "prm"))
    return policy, str(root / "prm")


def _config(run_dir, policy, prm, method, extra=()):
    kind = "implicit" if method == "prime" else (
        "discriminative" if method in ("pure", "prof_grpo", "papo", "blend") else "none")
    return load_config(DEMO_YAML, [f"trainer.run_dir={run_dir}", f"model.path={policy}",
                                   f"prm.path={prm}", f"prm.kind={kind}",
                                   f"advantage.method={method}", *SMALL, *extra])


def _run_methods(run_root, policy, prm, tp, steps):
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.loop import RLTrainer

    g = init_distributed(tp=tp)
    out = {}
    for method in METHODS:
        cfg = _config(os.path.join(run_root, f"{method}-tp{tp}"), policy, prm, method,
                      [f"trainer.steps={steps}", "trainer.save_every=0"])
        history = RLTrainer(cfg, g, build_char_tokenizer()).fit()
        out[method] = history
    return out


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_every_method_runs_on_two_ranks(models, tmp_path, tp):
    policy, prm = models
    results = launch.spawn(_run_methods, 2, str(tmp_path), policy, prm, tp, 2)
    for method in METHODS:
        for rank_hist in results:
            hist = rank_hist[method]
            assert len(hist) == 2
            for m in hist:
                assert m["guard/skipped_total"] == 0, (method, m)
                assert all(v == v for v in m.values()), (method, m)  # no NaN
                assert 0.0 <= m["reward/outcome_mean"] <= 1.0
                assert m["timing/update_s"] > 0 and m["timing/rollout_s"] > 0
        # both ranks see the same (dp-reduced) training metrics; timings are per rank
        same = [{k: v for k, v in r[method][-1].items() if not k.startswith("timing/")}
                for r in results]
        assert same[0] == pytest.approx(same[1])
        jsonl = os.path.join(tmp_path, f"{method}-tp{tp}", "metrics.jsonl")
        assert len(open(jsonl).read().splitlines()) == 2
        if method in ("pure", "prof_grpo", "papo", "blend"):
            assert "prm/outcome_agreement" in results[0][method][0]
        if method == "prime":
            assert "prm/loss" in results[0][method][0]


def _resume_work(run_dir, policy, prm, crash_at):
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.loop import RLTrainer

    if crash_at is not None:
        os.environ["MEGAPRM_CRASH_DURING_SAVE_AT"] = str(crash_at)
    g = init_distributed()
    cfg = _config(run_dir, policy, prm, "rloo", ["trainer.steps=4", "trainer.save_every=2"])
    return RLTrainer(cfg, g, build_char_tokenizer()).fit()


def test_kill_during_save_then_resume_reproduces(models, tmp_path):
    policy, prm = models
    ref = launch.spawn(_resume_work, 2, str(tmp_path / "ref"), policy, prm, None)[0]
    run = str(tmp_path / "crashy")
    with pytest.raises(launch.RankFailed):  # killed while writing the step-3 checkpoint
        launch.spawn(_resume_work, 2, run, policy, prm, 3)
    ckpts = os.path.join(run, "checkpoints")
    assert open(os.path.join(ckpts, "latest")).read() == "step_000001"
    assert os.path.isdir(os.path.join(ckpts, "step_000003.tmp"))  # the torn one, not named
    resumed = launch.spawn(_resume_work, 2, run, policy, prm, None)[0]
    assert len(resumed) == 2  # steps 2 and 3 only
    for a, b in zip(resumed, ref[2:]):
        for k in a:
            if not k.startswith("timing/"):
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
    rows = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert not os.path.exists(os.path.join(ckpts, "step_000003.tmp"))


def _nan_work(run_dir, policy, prm):
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer import loop

    g = init_distributed()
    cfg = _config(run_dir, policy, prm, "grpo", ["trainer.steps=2"])
    tr = loop.RLTrainer(cfg, g, build_char_tokenizer())
    before = [p.detach().clone() for p in tr.actor.model.parameters()]
    real = tr.outcome_reward

    def poisoned(*a):
        sb = real(*a)
        sb.outcome[0] = float("nan")
        if not torch.isfinite(sb.outcome).all():
            raise FloatingPointError("verifier returned non-finite rewards")
        return sb
    tr.outcome_reward = poisoned
    hist = tr.fit()
    after = list(tr.actor.model.parameters())
    return hist, all(torch.equal(a, b) for a, b in zip(after, before))


def test_nan_reward_step_is_skipped_not_applied(models, tmp_path):
    policy, prm = models
    hist, unchanged = launch.spawn(_nan_work, 1, str(tmp_path), policy, prm)[0]
    assert [h["guard/skipped_total"] for h in hist] == [1.0, 2.0]
    assert unchanged


def test_bad_config_is_one_line_error(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.n=1 is not valid"):
        load_config(DEMO_YAML, ["rollout.n=1"])
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['actor.lrr'\]"):
        load_config(DEMO_YAML, ["actor.lrr=1"])
    with pytest.raises(ConfigError, match=r"advantage.method='prime' needs prm.kind=implicit"):
        load_config(DEMO_YAML, ["advantage.method=prime"])
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    cli = [sys.executable, "-m", "megaprm.cli", "train", "--config", DEMO_YAML,
           "advantage.method=nope"]
    p = subprocess.run(cli, capture_output=True, text=True)
    assert p.returncode == 2
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "advantage.method='nope' is not valid" in err[0], p.stderr
