"""`megaprm train`: RL from a recipe. Its parser (`add_parser`) and its run (`run`): every
check in the launcher (`preflight.check_rl_launch`, the plan, the run directory's lock), then
`RLTrainer.fit` (or the rollout server) on every rank, and a last line saying where the run is.
"""
from __future__ import annotations

import argparse
import os
import sys

from megaprm.parallel.launch import add_launch_args
from megaprm.parallel.on_ranks import NOTHING_TO_DO, on_ranks
from megaprm.parallel.ray_launch import add_ray_args

TRAIN_HELP = """\
--config is a YAML recipe (configs/<method>.yaml for 7B on GPUs, configs/<method>_tiny.yaml
for CPU); any key can be overridden as section.key=value after it, e.g.
  megaprm train --config configs/grpo_tiny.yaml trainer.steps=10 actor.optim.lr=1e-5
The keys, their defaults and meanings: the recipe YAMLs and megaprm/config.py. An unknown
or invalid key is reported in one line that lists the valid keys of its section."""


def add_parser(sub) -> None:
    t = sub.add_parser("train", help="RL from a YAML recipe (configs/) + dotted overrides",
                       description=TRAIN_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--config", required=True,
                   help="YAML recipe, e.g. configs/prof_grpo_tiny.yaml (see above)")
    t.add_argument("overrides", nargs="*", help="section.key=value, e.g. actor.optim.lr=1e-6 "
                                                "trainer.steps=10")
    t.add_argument("--no-plan-check", action="store_true",
                   help="start even when `megaprm plan` says the run does not fit the GPUs "
                        "(the check runs only on CUDA machines)")
    add_launch_args(t, cpu_default=1)
    add_ray_args(t)
    t.set_defaults(fn=run)


def run(args) -> int:
    # deferred: keeps --help fast
    from megaprm.config import load_config

    cfg = load_config(args.config, args.overrides)
    finished = []  # the line of a resume of a run that has run all its steps

    def preflight():
        # deferred: keeps --help fast
        from megaprm.parallel.launch import world_size_of
        from megaprm.trainer.preflight import check_plan, check_rl_launch, finished_line

        world = world_size_of(args)
        done = finished_line(cfg, check_rl_launch(cfg, world))
        if done is not None:
            print(done, flush=True)
            finished.append(done)
            return NOTHING_TO_DO
        if not args.no_plan_check:
            check_plan(cfg, world)
        if args.node_rank != 0:  # node 0's launcher holds the (shared) run directory
            return None
        # deferred: keeps --help fast
        from megaprm.trainer.run_config import LOCK_ENV
        from megaprm.trainer.run_lock import RunLock

        lock = RunLock(cfg.trainer.run_dir).acquire()
        os.environ[LOCK_ENV] = os.path.abspath(cfg.trainer.run_dir)  # inherited by the ranks
        return lock

    def body():
        # deferred: keeps --help fast
        from megaprm.parallel.init import destroy, init_distributed
        from megaprm.rollout import remote
        from megaprm.trainer.rl.loop import RLTrainer
        from megaprm.trainer.prm_training import load_tokenizer
        from megaprm.trainer.rl.rollout_source import serve

        # not AutoTokenizer: next to a Qwen2 config it would rebuild the char tokenizer as
        # Qwen2Tokenizer, which splits the "\n\n" step separator into two tokens
        tok = load_tokenizer(RLTrainer.tokenizer_dir(cfg.model.path))
        placement = remote.split_world(cfg)  # rollout.placement=separate: the last ranks
        if placement is not None and placement.is_rollout:
            serve(cfg, placement, tok)
            destroy()  # the rollout ranks' default group (split_world), as the trainer's below
            return 0
        groups = init_distributed(tp=cfg.parallel.tp, pp=cfg.parallel.pp, ep=cfg.parallel.ep,
                                  seed=cfg.trainer.seed)
        RLTrainer(cfg, groups, tok).fit()
        destroy()
        return 0

    # deferred: keeps --help fast
    from megaprm.parallel.launch import under_torchrun

    rc = on_ranks(args, sys.argv[1:], preflight, body)
    if rc == 0 and args.node_rank == 0 and not under_torchrun() and not finished:
        _say_where_the_run_is(cfg.trainer.run_dir)
    return rc


def _say_where_the_run_is(run_dir: str) -> None:
    """The last line of a finished `megaprm train` (after wandb's summary): where to look."""
    # deferred: keeps --help fast
    from megaprm.trainer.plots import plot_run

    plots = os.path.join(run_dir, "plots")
    try:
        plot_run(run_dir, out_dir=plots)
        drawn = f"plots {plots}/ (`megaprm plot {run_dir}` redraws them)"
    except (FileNotFoundError, ValueError):  # no step logged (e.g. trainer.steps=0)
        drawn = "no plots (no step logged)"
    last = _last_step_line(run_dir)
    if last:
        print(last, flush=True)
    print(f"[train] done: run {run_dir} (config.yaml, checkpoints/), metrics "
          f"{os.path.join(run_dir, 'metrics.jsonl')}, {drawn}", flush=True)


# what megaprm's own summary shows of the last step (wandb's is off by default)
SUMMARY_KEYS = ("reward/outcome_mean", "prm/score_mean", "prm/outcome_agreement",
                "exact/correct_with_wrong_step_frac",
                "actor/entropy", "actor/kl_loss", "response/length_mean", "timing/step_s")


def _last_step_line(run_dir: str) -> str | None:
    """One line of the last logged step's headline metrics, or None when none was logged."""
    # deferred: keeps --help fast
    from megaprm.trainer.metrics import read_metrics

    try:
        rows = read_metrics(run_dir)
    except (OSError, ValueError):
        return None
    if not rows:
        return None
    row = rows[-1]
    shown = [f"{k}={row[k]:.4g}" for k in SUMMARY_KEYS if isinstance(row.get(k), (int, float))]
    return f"[train] last step {row.get('step')}: " + ", ".join(shown)
