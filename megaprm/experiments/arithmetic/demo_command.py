"""`megaprm demo`: its parser (`add_parser`) and its run (`run`): the preflight in the launcher,
then `demo.run` on every rank. Light at import: the CLI builds its parser from this module.
"""
from __future__ import annotations

import os
import sys

from megaprm.experiments.arithmetic.runs import PRM_INITS, TASK_DEFAULTS
from megaprm.parallel.launch import add_launch_args
from megaprm.parallel.on_ranks import on_ranks
from megaprm.parallel.ray_launch import add_ray_args

# algorithms.registry.METHODS, spelled out: the registry imports torch, --help must not
DEMO_METHODS = ("prof_grpo", "grpo", "drgrpo", "rloo", "papo", "pure", "prime", "blend")


def add_parser(sub) -> None:
    d = sub.add_parser("demo", help="a process reward vs GRPO on the embedded task (CPU, minutes)",
                       description="From a shipped warm-up policy and PRM (held-out step AUROC "
                       ">= 0.9; --from-scratch rebuilds both), run RL with GRPO and with a "
                       "process-reward method (PURE by default), evaluate both on the same "
                       "held-out problems with the exact step checker and print one table "
                       "before/after, a PNG of both runs' curves and whether the difference is "
                       "within the spread of the full comparison's paired runs (docs/compare.md).")
    d.add_argument("--method", default="pure", choices=DEMO_METHODS,
                   help="the process-reward method set against GRPO (default pure: the "
                        "comparison's largest cut in wrong steps); prime trains its own "
                        "implicit PRM from outcome labels and does not learn at the demo's "
                        "scale")
    d.add_argument("--run-dir", default="",
                   help="default runs/demo (--task short), runs/demo-TASK otherwise")
    d.add_argument("--task", default="short", choices=("short", "long"),
                   help="short: the shipped start (2-4 steps); long: 8-11-step restating chains, its "
                   "warm-up and PRM trained first (not shipped: ~30 CPU minutes on 2 cores)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--from-scratch", action="store_true",
                   help="train the warm-up policy and the PRM instead of using the shipped "
                        "ones (~6 CPU minutes; reports whether the tensors equal the shipped)")
    d.add_argument("--write-readme", action="store_true",
                   help="copy demo.json and the PNG to docs/demo/ and regenerate README.md's "
                        "demo block from them (run from the repo root)")
    d.add_argument("--from-json", default="",
                   help="no runs: pair a finished demo.json's difference again with the "
                        "committed comparison's spread (written back into it) and print it; "
                        "with --write-readme, regenerate README.md's demo block from it")
    d.add_argument("--rl-steps", type=int, default=0, help="override the RL steps (40)")
    d.add_argument("--warmup-steps", type=int, default=0,
                   help="override the warm-up's steps (400; not the shipped start: rebuilds)")
    d.add_argument("--prm-steps", type=int, default=0,
                   help="override the PRM's whole-model steps (3000; rebuilds the start)")
    d.add_argument("--prm-examples", type=int, default=0,
                   help="override the PRM's training solutions (16000; rebuilds the start)")
    d.add_argument("--prm-init", default=None, choices=PRM_INITS,
                   help="the PRM's trunk: random (short's default: the shipped start) or the "
                        "warm-up policy (long's default); another than the task's rebuilds")
    d.add_argument("--eval-problems", type=int, default=0,
                   help="override the held-out problems of the evaluations (200)")
    add_launch_args(d, cpu_default=2)
    add_ray_args(d)
    d.set_defaults(fn=run)


def run(args) -> int:
    # deferred: keeps --help fast
    from megaprm.experiments.arithmetic import demo

    if args.from_json:  # no runs: the finished demo paired again with the committed comparison
        # deferred: keeps --help fast
        from megaprm.experiments.readme import read_block

        if not os.path.isfile(args.from_json):
            raise FileNotFoundError(f"--from-json {args.from_json}: no such file; give a "
                                    "demo.json a `megaprm demo` run wrote (docs/demo/demo.json)")
        if args.write_readme:
            read_block("README.md", "demo")  # the markers are there before anything is written
        summary = demo.respread(args.from_json)
        for line in demo.spread_sentences(summary["spread"]):
            print(line)
        if args.write_readme:
            demo.write_readme(args.from_json)
            print(f"wrote {args.from_json} (its spread) and README.md's demo block")
        return 0

    overrides = {**TASK_DEFAULTS.get(args.task, {}),  # the task's start recipe, then flags
                 **{k: v for k, v in {"rl_steps": args.rl_steps,
                                      "warmup_steps": args.warmup_steps,
                                      "eval_problems": args.eval_problems,
                                      "prm_steps": args.prm_steps,
                                      "prm_examples": args.prm_examples,
                                      "prm_init": args.prm_init}.items() if v}}
    dcfg = demo.DemoConfig(run_dir=args.run_dir or ("runs/demo" if args.task == "short"
                                                    else f"runs/demo-{args.task}"),
                           method=args.method, seed=args.seed, task=args.task,
                           from_scratch=args.from_scratch, **overrides)

    def preflight():
        # deferred: keeps --help fast
        from megaprm.outputs import check_output
        from megaprm.experiments.readme import read_block
        from megaprm.parallel.launch import world_size_of

        world_size_of(args)  # --nproc vs GPUs, node rank
        check_output(dcfg.run_dir, "--run-dir", {}, holds_runs=True)
        if args.write_readme and args.task != "short":
            raise ValueError(f"--write-readme with --task {args.task}: README's demo block and "
                             "docs/demo/ are the shipped short-task demo's; drop --write-readme "
                             f"(the run's demo.json and PNG stay in {dcfg.run_dir})")
        if args.write_readme:  # the markers are there before minutes of work
            read_block("README.md", "demo")

    def body():
        # deferred: keeps --help fast
        from megaprm.parallel.init import destroy, init_distributed

        groups = init_distributed(tp=1, pp=1, seed=args.seed)
        summary = demo.run(dcfg, groups)
        if groups.rank == 0:
            demo.print_summary(summary)
            if args.write_readme:
                demo.write_readme(os.path.join(dcfg.run_dir, "demo.json"))
                print(f"wrote {demo.DOCS_DIR}/demo.json, {demo.DOCS_DIR}/demo_curves.png and "
                      "README.md's demo block")
        destroy()
        return 0

    return on_ranks(args, sys.argv[1:], preflight, body)
