"""`megaprm compare`: its parser (`add_parser`) and its run (`run`): the tables of an existing
compare.json, or the preflight in the launcher (`compare.claim_run_dir` holds the run directory)
and `compare.run` on every rank. Light at import: the CLI builds its parser from this module.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields

from megaprm.experiments.arithmetic.runs import (
    ALL_METHODS,
    PRM_INITS,
    RL_YAML,
    TASK_DEFAULTS,
    TASKS,
    CompareConfig,
)
from megaprm.parallel.launch import add_launch_args
from megaprm.parallel.on_ranks import on_ranks
from megaprm.parallel.ray_launch import add_ray_args


def add_parser(sub) -> None:
    defaults = argparse.Namespace(**{f.name: f.default for f in fields(CompareConfig)})
    cp = sub.add_parser("compare", help="every method side by side on the exact-label task: "
                                        "shared warm-up and PRM, RL per (method, seed), table")
    cp.add_argument("--methods", default=",".join(ALL_METHODS), help="comma-separated subset")
    cp.add_argument("--seeds", type=int, default=defaults.seeds)
    cp.add_argument("--oracle", default=",".join(defaults.oracle),
                    help="methods also run with the exact step labels as process reward "
                         "('' for none)")
    cp.add_argument("--run-dir", default="",
                    help="default runs/compare (--task short), runs/compare-TASK otherwise")
    cp.add_argument("--task", default=defaults.task, choices=tuple(TASKS),
                    help="short: 2-4 steps (~32-token solutions); long: 8-11 steps restating the "
                    "operations still to apply (114-208 tokens), each with its own warm-up "
                    "and PRM")
    cp.add_argument("--starts", type=int, default=defaults.starts,
                    help="independently built starts (warm-up policy + PRM, seed k each): the "
                    "outer level of the paired design")
    cp.add_argument("--rl-steps", type=int, default=defaults.rl_steps)
    cp.add_argument("--hack-steps", type=int, default=defaults.hack_steps,
                    help="steps of the reward-hacking run (PURE on the PRM alone); 0: none")
    cp.add_argument("--eval-problems", type=int, default=defaults.eval_problems)
    cp.add_argument("--sampled-n", type=int, default=defaults.sampled_n,
                    help="samples per held-out problem in the sampled evaluation")
    cp.add_argument("--warmup-steps", type=int, default=None,
                    help=f"default {defaults.warmup_steps} (--task long: "
                    f"{TASK_DEFAULTS['long']['warmup_steps']})")
    cp.add_argument("--prm-steps", type=int, default=None,
                    help=f"default {defaults.prm_steps} (--task long: "
                    f"{TASK_DEFAULTS['long']['prm_steps']})")
    cp.add_argument("--prm-examples", type=int, default=defaults.prm_examples)
    cp.add_argument("--prm-init", default=None, choices=PRM_INITS,
                    help=f"the PRM's trunk: a random-init qwen2 or the start's warm-up policy "
                    f"(default {defaults.prm_init}; --task long: "
                    f"{TASK_DEFAULTS['long']['prm_init']})")
    cp.add_argument("--wandb", default=defaults.wandb, choices=("offline", "online", "disabled"))
    cp.add_argument("--method-seeds", default="",
                    help="fewer seeds for some rows, e.g. rloo=3,blend=3 (each <= --seeds; the "
                         "runs are seed-major, so a run cut short keeps complete seeds)")
    cp.add_argument("--only-finished", action="store_true",
                    help="run nothing new: report the cells already finished in --run-dir")
    cp.add_argument("--bootstrap-reps", type=int, default=defaults.bootstrap_reps,
                    help="replicates of every bootstrap interval (default %(default)s); the "
                         "report's cost grows with it and with --eval-problems: ~200 gives "
                         "a quick --only-finished look at a run still going (no cell's key "
                         "holds it)")
    cp.add_argument("--state-dir", default="",
                    help="keep what a resumed run reads back (built starts, finished cells; "
                         "sha256 manifest) in this directory too, and restore it into --run-dir "
                         "first: for a run directory that does not outlive the machine")
    cp.add_argument("--from-json", default="",
                    help="no runs: print (or with --write-readme, write) the tables of an "
                         "existing compare.json")
    cp.add_argument("--write-readme", action="store_true",
                    help="regenerate the '<!-- megaprm:compare -->' blocks of --readme and --doc "
                         "from the run's report")
    cp.add_argument("--readme", default="README.md")
    cp.add_argument("--doc", default="docs/compare.md")
    cp.add_argument("overrides", nargs="*", help="dotted overrides for every RL run, e.g. "
                                                 "actor.optim.lr=1e-4")
    add_launch_args(cp, cpu_default=2)
    add_ray_args(cp)
    cp.set_defaults(fn=run)


def _csv(text):
    return tuple(x for x in (text or "").split(",") if x)


def _method_seeds(text):
    out = {}
    for item in _csv(text):
        name, _, k = item.partition("=")
        if not k.isdigit():
            raise ValueError(f"--method-seeds {item!r}: write METHOD=SEEDS, e.g. "
                             "--method-seeds rloo=3,blend=3")
        out[name] = int(k)
    return out


def _from_json(args) -> int:
    """--from-json: the tables of an existing compare.json; no ranks, no runs."""
    import json

    # deferred: keeps --help fast
    from megaprm.experiments.arithmetic import report as tables

    if not os.path.isfile(args.from_json):
        raise FileNotFoundError(f"--from-json {args.from_json}: no such file; give a "
                                "compare.json written by `megaprm compare`")
    with open(args.from_json, encoding="utf-8") as f:
        report = json.load(f)
    if args.write_readme:
        for path in tables.write_docs(report, readme=args.readme, doc=args.doc):
            print(f"[compare] regenerated the compare block of {path}")
    else:
        print(tables.markdown(report), end="")
    return 0


def _config(args) -> CompareConfig:
    if args.bootstrap_reps < 100:  # fewer draws put a 95% interval's ends on 2-3 replicates
        raise ValueError(f"--bootstrap-reps {args.bootstrap_reps}: give at least 100 (the "
                         "default 2000 for the published intervals, ~200 for a quick look)")
    return CompareConfig(
        run_dir=args.run_dir or ("runs/compare" if args.task == "short"
                                 else f"runs/compare-{args.task}"),
        task=args.task, starts=args.starts, methods=_csv(args.methods), seeds=args.seeds,
        method_seeds=_method_seeds(args.method_seeds),
        oracle=_csv(args.oracle), rl_steps=args.rl_steps, hack_steps=args.hack_steps,
        eval_problems=args.eval_problems, sampled_n=args.sampled_n,
        **{k: (getattr(args, k) if getattr(args, k) is not None
               else TASK_DEFAULTS.get(args.task, {}).get(k, getattr(CompareConfig, k)))
           for k in ("warmup_steps", "prm_steps", "prm_init")},
        prm_examples=args.prm_examples, bootstrap_reps=args.bootstrap_reps, wandb=args.wandb,
        extra=list(args.overrides))


def run(args) -> int:
    if args.from_json:
        return _from_json(args)
    ccfg = _config(args)
    if args.write_readme:  # the markers must be there before an hour of runs
        # deferred: keeps --help fast
        from megaprm.experiments.readme import read_block

        for path in (args.readme, args.doc):
            read_block(path, "compare" if ccfg.task == "short" else f"compare-{ccfg.task}")

    def preflight():
        # deferred: keeps --help fast
        from megaprm.outputs import check_output
        from megaprm.config import load_config
        from megaprm.experiments.arithmetic.compare import claim_run_dir
        from megaprm.parallel.launch import world_size_of
        from megaprm.trainer.preflight import check_batch

        world = world_size_of(args)
        check_output(ccfg.run_dir, "--run-dir", {}, holds_runs=True)
        cfg = load_config(RL_YAML, ccfg.extra)  # the overrides every run gets are valid
        check_batch(cfg, world)
        return claim_run_dir(ccfg, args.state_dir, args.only_finished)

    def body():
        # deferred: keeps --help fast
        from megaprm.experiments.arithmetic import compare
        from megaprm.experiments.arithmetic import report as tables
        from megaprm.parallel.init import destroy, init_distributed

        groups = init_distributed(tp=1, pp=1, seed=0)
        report = compare.run(ccfg, groups, only_finished=args.only_finished,
                             state_dir=args.state_dir or None)
        if groups.rank == 0:
            print("\n" + tables.markdown(report))
            if args.write_readme:
                for path in tables.write_docs(report, readme=args.readme, doc=args.doc):
                    print(f"[compare] regenerated the compare block of {path}")
            print(f"[compare] wrote {ccfg.run_dir}/compare.json, compare.md and "
                  + ", ".join(report["plots"]))
        destroy()
        return 0

    return on_ranks(args, sys.argv[1:], preflight, body)
