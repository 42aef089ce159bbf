"""Separate placement (rollout/remote.py): the last rollout.ranks ranks of one launch draw the
samples, the first ones train. On-policy (max_staleness 0) a run equals the colocated run on the
trainer's ranks; with max_staleness 1 the rollout ranks draw one block ahead and no batch is
consumed more than one weight version after the one it was drawn with."""
import pytest

from megaprm.parallel import launch
from tests.rl_setup import rl_config

PER_RANK = ("timing/", "throughput/", "weight_sync/")  # wall-clock: differs between runs
BASE = ["rollout.max_tokens=16", "actor.micro_batch_size=8", "trainer.save_every=0",
        "trainer.steps=3", "trainer.eval_every=3", "trainer.eval_problems=8",
        "actor.entropy_coef=0.01"]  # a gradient every step (the tiny policy earns no reward)


def _run(run_dir, policy, prm, extra):
    """One rank of a launch, as `megaprm train` runs it: split the world, then train or serve."""
    from megaprm.parallel.init import init_distributed
    from megaprm.rollout import remote
    from megaprm.trainer.rl import rollout_source
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.loop import RLTrainer

    cfg = rl_config(run_dir, policy, prm, "grpo", [*BASE, *extra])
    tok = build_char_tokenizer()
    placement = remote.split_world(cfg)
    if placement is not None and placement.is_rollout:
        return {"drawn": rollout_source.serve(cfg, placement, tok)}
    return RLTrainer(cfg, init_distributed(), tok).fit()


def _same(a: dict, b: dict) -> None:
    for k, v in a.items():
        if not k.startswith(PER_RANK):
            assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_separate_on_policy_equals_colocated_and_stale_stays_within_k(tiny_models, tmp_path):
    policy, prm = tiny_models
    colocated = launch.spawn(_run, 2, str(tmp_path / "colocated"), policy, prm, [])
    sep = ["rollout.placement=separate", "rollout.ranks=1"]
    separate = launch.spawn(_run, 3, str(tmp_path / "separate"), policy, prm, sep)
    # the same samples, the same updates: every logged metric of every step (the trainer's two
    # ranks log the same dp-reduced values), the held-out evaluation included
    for step_c, step_s in zip(colocated[0], separate[0]):
        _same(step_c, step_s)
        assert step_s["rollout/staleness_max"] == 0.0
        # the whole HF model crossed to the rollout rank, as into the colocated engine
        assert step_s["weight_sync/gbytes"] == step_c["weight_sync/gbytes"] > 0
    assert len(separate[0]) == 3 and "eval/accuracy" in separate[0][-1]
    # 3 blocks x 2 dp shards drawn by the one rollout rank, nothing more
    assert separate[2] == {"drawn": 6}

    stale = launch.spawn(_run, 3, str(tmp_path / "stale"), policy, prm,
                         [*sep, "rollout.max_staleness=1"])
    hist = stale[0]
    # block 0 is drawn with the first weights; block s > 0 was ordered while step s-1 trained
    assert [m["rollout/staleness_max"] for m in hist] == [0.0, 1.0, 1.0]
    assert all("rollout/logprob_gap_lag1" in m for m in hist[1:])
    for m in hist[1:]:  # the correction's weights, truncated at the cap
        assert 0 < m["rollout/is_weight_mean"] <= 2.0 and m["rollout/is_weight_max"] > 0
        assert 0.0 <= m["rollout/is_truncated_frac"] <= 1.0
    # step 0 is on-policy in both runs: the same samples and the same update
    _same({k: v for k, v in colocated[0][0].items() if not k.startswith("rollout/is_")},
          hist[0])
    # one block ahead: 4 blocks ordered (the last one never consumed)
    assert stale[2] == {"drawn": 8}


def _run_method(run_dir, policy, prm, method, extra):
    from megaprm.parallel.init import init_distributed
    from megaprm.rollout import remote
    from megaprm.trainer.rl import rollout_source
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.loop import RLTrainer

    cfg = rl_config(run_dir, policy, prm, method, [*BASE, "trainer.steps=2", *extra])
    tok = build_char_tokenizer()
    placement = remote.split_world(cfg)
    if placement is not None and placement.is_rollout:
        return {"drawn": rollout_source.serve(cfg, placement, tok)}
    return RLTrainer(cfg, init_distributed(), tok).fit()


@pytest.mark.parametrize("method,extra", [
    ("prime", ["rollout.refill=std", "rollout.max_refill_rounds=2"]),
    ("prof_grpo", [])], ids=["prime-refill", "prof_grpo-prm"])
def test_every_kind_of_method_runs_one_step_stale(tiny_models, tmp_path, method, extra):
    """max_staleness 1 with PRIME's online implicit PRM and refill drawing further blocks from
    the stream, and with a discriminative PRM scoring on the trainer ranks."""
    policy, prm = tiny_models
    out = launch.spawn(_run_method, 3, str(tmp_path), policy, prm, method,
                       ["rollout.placement=separate", "rollout.ranks=1",
                        "rollout.max_staleness=1", *extra])
    hist = out[0]
    assert len(hist) == 2 and all(m["guard/skipped_total"] == 0 for m in hist)
    assert all(m["rollout/staleness_max"] <= 1 for m in hist)
    assert hist[1]["rollout/staleness_max"] == 1.0
    if method == "prime":
        assert all("prm/loss" in m for m in hist)
        rounds = sum(m["rollout/refill_rounds"] + 1 for m in hist)
        # every round took one block of the stream; one block ordered ahead; 2 dp shards each
        assert out[2]["drawn"] == 2 * (rounds + 1)
    else:
        assert all("prm/outcome_agreement" in m for m in hist)


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_in_one_line_and_resume_continues(tiny_models, tmp_path):
    """`megaprm train --nproc 3 rollout.placement=separate rollout.ranks=1`: kill -9 of the
    rollout rank (drawing block 2), then of the trainer ranks (after step 2's log) each end the
    whole launch with one line naming the killed rank, leave no rank behind, and the next start
    resumes from the last checkpoint (step 1) and finishes the run."""
    import json
    import os
    import signal
    import subprocess

    from tests.test_megaprm_cli import FAST, MEGAPRM, ROOT, _assert_none_left, _pids_with

    policy, _ = tiny_models
    run_dir = str(tmp_path / "run")
    cmd = [*MEGAPRM, "train", "--config", "configs/grpo_tiny.yaml", f"model.path={policy}",
           f"trainer.run_dir={run_dir}", *FAST, "--nproc", "3", "rollout.placement=separate",
           "rollout.ranks=1", "trainer.steps=4", "trainer.save_every=1"]

    def launch_(**env):
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                              env=dict(os.environ, OMP_NUM_THREADS="1", **env))

    # 2 prompts on 2 dp ranks: the rollout rank draws 2 batches a block; 4 = blocks 0 and 1
    for env, victim in (({"MEGAPRM_KILL_ROLLOUT_AT": "4"}, "rank 2"),
                        ({"MEGAPRM_KILL_AT": "2:after_log"}, "rank ")):
        p = launch_(**env)
        last = p.stderr.strip().splitlines()[-1]
        assert p.returncode == 128 + signal.SIGKILL, p.stderr[-3000:]
        assert last.startswith(f"megaprm: {victim}") and "killed by SIGKILL" in last, last
        _assert_none_left(lambda: _pids_with(run_dir), "ranks outlived the killed rank")
        ckpts = os.path.join(run_dir, "checkpoints")
        assert open(os.path.join(ckpts, "latest")).read() == "step_000001"
    p = launch_()
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stdout and "step_000001" in p.stdout
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]


@pytest.mark.parametrize("overrides,says", [
    (["rollout.placement=separate"], "rollout.ranks=0 is not valid: >= 1"),
    (["rollout.max_staleness=1"], "rollout.max_staleness=1 is not valid: 0 with rollout."),
    (["rollout.placement=separate", "rollout.ranks=1", "rollout.refill=std",
      "rollout.refill_surplus=requeue"], "rollout.refill_surplus='requeue' is not valid: drop"),
    (["rollout.correction=is"], "rollout.correction='is' is not valid: none, tis"),
])
def test_async_keys_are_checked_in_one_line(overrides, says):
    from megaprm.config import load_config
    from megaprm.errors import ConfigError
    from tests.rl_setup import DEMO_YAML

    with pytest.raises(ConfigError) as e:
        load_config(DEMO_YAML, overrides)
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_preflight_counts_only_the_trainer_ranks():
    from megaprm.config import load_config
    from megaprm.errors import ConfigError
    from megaprm.trainer.preflight import check_batch, trainer_world
    from tests.rl_setup import DEMO_YAML

    cfg = load_config(DEMO_YAML, ["rollout.placement=separate", "rollout.ranks=1"])
    assert trainer_world(cfg, 3) == 2 and trainer_world(load_config(DEMO_YAML), 3) == 3
    with pytest.raises(ConfigError, match="leaves no trainer rank"):
        trainer_world(cfg, 1)
    check_batch(cfg, trainer_world(cfg, 3))  # 2 trainer dp ranks divide the prompts
