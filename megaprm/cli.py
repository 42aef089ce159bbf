"""`megaprm {demo,compare,train,train-prm,eval-prm,plan,data,eval,bench,plot,convert}`: thin
wrappers over the packages.

Commands that need several ranks validate everything they can without ranks (config, model vs
tp/pp, paths, resume layout), then re-launch themselves under torchrun through
`parallel.launch` (`--nproc` ranks per node; `--nnodes/--node-rank/--master-addr` for several
nodes). A user error prints one line, once, and exits 2 - in the launcher or in any rank.
The CLI imports the packages; no package imports the CLI.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback


def _user_errors() -> tuple:
    """Exception types that are the user's to fix (one line, exit 2), not megaprm bugs."""
    # deferred: keeps --help fast
    from megaprm.config import ConfigError
    from megaprm.parallel.init import ParallelConfigError
    from megaprm.parallel.launch import LaunchError
    from megaprm.trainer.checkpoint.store import CheckpointError
    from megaprm.trainer.run_lock import RunLockError

    types = [ConfigError, ParallelConfigError, LaunchError, CheckpointError, RunLockError,
             FileNotFoundError, ValueError]
    try:
        # deferred: keeps --help fast
        from checkpoint_tools.layout import ConversionError
        types.append(ConversionError)
    except ImportError:
        pass
    return tuple(types)


NOTHING_TO_DO = object()  # a preflight's answer when no rank needs to start


def _on_ranks(args, argv, preflight, body) -> int:
    """`preflight()` in the launcher, then `body()` on every torchrun rank. A preflight may
    return a lock the launcher holds while its ranks run, or NOTHING_TO_DO (no rank starts)."""
    # deferred: keeps --help fast
    from megaprm.parallel import launch, ray_launch

    if not launch.under_torchrun():
        lock = preflight()
        if lock is NOTHING_TO_DO:  # the preflight said why, in one line
            return 0
        try:
            if ray_launch.wanted(args):
                return ray_launch.relaunch(args, argv)
            return launch.relaunch(args, argv)
        finally:
            if lock is not None:
                lock.release()
    launch.die_with_parent()
    return body()


# ------------------------------------------------------------------------------ subcommands

def cmd_demo(args) -> int:
    # deferred: keeps --help fast
    from megaprm.experiments.arithmetic import demo
    from megaprm.experiments.arithmetic.runs import TASK_DEFAULTS

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
        from checkpoint_tools.layout import check_output
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

    return _on_ranks(args, sys.argv[1:], preflight, body)


def cmd_compare(args) -> int:
    # deferred: keeps --help fast
    from megaprm.experiments.arithmetic import report as tables
    from megaprm.experiments.arithmetic.runs import RL_YAML, TASK_DEFAULTS, CompareConfig

    def csv(text):
        return tuple(x for x in (text or "").split(",") if x)

    def method_seeds(text):
        out = {}
        for item in csv(text):
            name, _, k = item.partition("=")
            if not k.isdigit():
                raise ValueError(f"--method-seeds {item!r}: write METHOD=SEEDS, e.g. "
                                 "--method-seeds rloo=3,blend=3")
            out[name] = int(k)
        return out

    if args.from_json:  # tables only: no ranks, no runs
        import json

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

    if args.bootstrap_reps < 100:  # fewer draws put a 95% interval's ends on 2-3 replicates
        raise ValueError(f"--bootstrap-reps {args.bootstrap_reps}: give at least 100 (the "
                         "default 2000 for the published intervals, ~200 for a quick look)")
    ccfg = CompareConfig(
        run_dir=args.run_dir or ("runs/compare" if args.task == "short"
                                 else f"runs/compare-{args.task}"),
        task=args.task, starts=args.starts, methods=csv(args.methods), seeds=args.seeds,
        method_seeds=method_seeds(args.method_seeds),
        oracle=csv(args.oracle), rl_steps=args.rl_steps, hack_steps=args.hack_steps,
        eval_problems=args.eval_problems, sampled_n=args.sampled_n,
        **{k: (getattr(args, k) if getattr(args, k) is not None
               else TASK_DEFAULTS.get(args.task, {}).get(k, getattr(CompareConfig, k)))
           for k in ("warmup_steps", "prm_steps", "prm_init")},
        prm_examples=args.prm_examples, bootstrap_reps=args.bootstrap_reps, wandb=args.wandb,
        extra=list(args.overrides))
    if args.write_readme:  # the markers must be there before an hour of runs
        # deferred: keeps --help fast
        from megaprm.experiments.readme import read_block

        for path in (args.readme, args.doc):
            read_block(path, "compare" if ccfg.task == "short" else f"compare-{ccfg.task}")

    def preflight():
        # deferred: keeps --help fast
        from checkpoint_tools.layout import check_output
        from megaprm.config import load_config
        from megaprm.parallel.launch import world_size_of
        from megaprm.trainer.preflight import check_batch

        world = world_size_of(args)
        check_output(ccfg.run_dir, "--run-dir", {}, holds_runs=True)
        cfg = load_config(RL_YAML, ccfg.extra)  # the overrides every run gets are valid
        check_batch(cfg, world)
        # one comparison per run directory, as one run per trainer run directory: a second
        # compare there would train into the same warm-up, PRM and cells
        # deferred: keeps --help fast
        from megaprm.trainer.run_lock import RunLock

        existed = os.path.isdir(ccfg.run_dir)
        lock = RunLock(ccfg.run_dir).acquire()
        try:
            if args.state_dir:  # before the ranks: they find the restored run directory
                # deferred: keeps --help fast
                from megaprm.experiments.arithmetic import run_state

                copied, kept = run_state.restore(args.state_dir, ccfg.run_dir)
                print(f"[compare] --state-dir {args.state_dir}: restored {copied} unit(s) (a "
                      f"start's stage, a cell, a file) into {ccfg.run_dir}, kept {kept} "
                      "already there", flush=True)
            if args.only_finished:
                # deferred: keeps --help fast
                from megaprm.experiments.arithmetic.compare import check_only_finished

                check_only_finished(ccfg)
        except BaseException:
            lock.release()
            if not existed and not os.listdir(ccfg.run_dir):
                os.rmdir(ccfg.run_dir)  # refused: nothing left behind
            raise
        return lock

    def body():
        # deferred: keeps --help fast
        from megaprm.experiments.arithmetic import compare
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

    return _on_ranks(args, sys.argv[1:], preflight, body)


def cmd_train(args) -> int:
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
        from megaprm.trainer.loop import RLTrainer
        from megaprm.trainer.prm_training import load_tokenizer
        from megaprm.trainer.rollout_source import serve

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

    rc = _on_ranks(args, sys.argv[1:], preflight, body)
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


def cmd_train_prm(args) -> int:
    # deferred: keeps --help fast
    from megaprm.trainer.prm_training import load_prm_config

    cfg, tp, pp = load_prm_config(args.config, args.overrides)

    def preflight():
        # deferred: keeps --help fast
        from checkpoint_tools.layout import check_output
        from megaprm.parallel.init import check_layout
        from megaprm.parallel.launch import world_size_of

        check_layout(world_size_of(args), tp, pp)
        if cfg.output_dir:
            check_output(cfg.output_dir, "output_dir", {
                "model_dir": cfg.model_dir, "tokenizer_dir": cfg.tokenizer_dir,
                "train_jsonl": cfg.train_jsonl, "eval_jsonl": cfg.eval_jsonl})

    def body():
        import json

        # deferred: keeps --help fast
        from megaprm.parallel.init import destroy, init_distributed
        from megaprm.trainer.prm_training import train_prm

        groups = init_distributed(tp=tp, pp=pp, seed=cfg.seed)
        result = train_prm(cfg, groups)
        if groups.rank == 0:
            ev = result.eval
            print(json.dumps({"auroc": ev.auroc, "f1": ev.f1, "accuracy": ev.accuracy,
                              "held_out_steps": ev.num_steps, "bad_steps": ev.num_bad,
                              "train_minutes": round(result.train_seconds / 60, 2),
                              "skipped_rows": len(result.skipped),
                              "output_dir": result.output_dir}))
        destroy()
        return 0

    return _on_ranks(args, sys.argv[1:], preflight, body)


def _arithmetic_task(name: str, settings) -> object:
    """The arithmetic task `name` of the comparison (runs.TASKS where it exists, else the one
    runs.TASK), with `key=value` settings of ArithmeticConfig on top."""
    import dataclasses

    # deferred: keeps --help fast
    from megaprm.experiments.arithmetic import runs

    tasks = getattr(runs, "TASKS", None) or {"short": runs.TASK}
    if name not in tasks:
        raise ValueError(f"--arith-task {name}: valid tasks are {sorted(tasks)}")
    fields = {f.name: f.type for f in dataclasses.fields(tasks[name])}
    changes = {}
    for item in settings:
        key, eq, value = item.partition("=")
        if not eq or key not in fields:
            raise ValueError(f"--task-config {item!r}: write KEY=VALUE with KEY one of "
                             f"{sorted(fields)}, e.g. --task-config num_ops=2,4 operand_max=20")
        try:
            if key == "num_ops":
                changes[key] = tuple(int(v) for v in value.split(","))
            elif key == "allow_negative":
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                changes[key] = value.lower() in ("true", "1")
            elif key == "ops":
                changes[key] = value
            else:
                changes[key] = int(value)
        except ValueError:
            raise ValueError(f"--task-config {item!r}: {value!r} is not a valid {key} (e.g. "
                             "num_ops=2,4 operand_max=20 ops=+- allow_negative=false)") from None
    return dataclasses.replace(tasks[name], **changes)


def cmd_eval_prm(args) -> int:
    import json
    import math

    # deferred: keeps --help fast
    from checkpoint_tools.layout import check_output
    from megaprm.rewards import prm_eval

    if bool(args.prm) == bool(args.implicit or args.ref):
        raise ValueError("give one PRM: --prm DIR (a discriminative PRM), or --implicit DIR "
                         "--ref DIR (PRIME's implicit PRM and its reference)")
    if not args.prm and not (args.implicit and args.ref):
        raise ValueError("PRIME's implicit PRM needs both --implicit DIR and --ref DIR")
    if bool(args.task) == bool(args.jsonl):
        raise ValueError("give one solution set: --task arithmetic (exact step labels) or "
                         "--jsonl FILE ... (ProcessBench's format)")
    if args.num < 1:
        raise ValueError(f"--num {args.num}: give the number of solutions, >= 1")
    if not (math.isfinite(args.beta) and args.beta > 0):
        raise ValueError(f"--beta {args.beta}: PRIME's beta must be a positive number "
                         "(released 0.05)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("megaprm eval-prm runs on one process; start it without torchrun or "
                         "with --nproc-per-node 1")
    for path in args.jsonl or ():
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--jsonl {path}: no such file; give ProcessBench-format "
                                    "JSONL (one file per subset)")
    subsets = [(os.path.splitext(os.path.basename(path))[0],
                prm_eval.read_processbench_jsonl(path)) for path in args.jsonl or ()]
    if args.out:
        inputs = {"--prm": args.prm, "--implicit": args.implicit, "--ref": args.ref}
        inputs.update({f"--jsonl[{i}]": p for i, p in enumerate(args.jsonl or ())})
        check_output(args.out, "--out", inputs)
    threshold = args.threshold if args.threshold is not None else (0.5 if args.prm else 0.0)

    # deferred: torch and the trainer's packages
    from megaprm.trainer import prm_judge

    if args.task:
        task = _arithmetic_task(args.arith_task, args.task_config)
        examples, labels, step_labels = prm_judge.arithmetic_set(task, args.num, args.seed)
        data = {"task": "arithmetic", "arith_task": args.arith_task, "config": repr(task),
                "num": args.num, "seed": args.seed}
    else:
        examples, labels, step_labels = [], [], []
        for kind, rows in subsets:
            ex, y, sl = prm_judge.processbench_set(rows, kind)
            examples += ex
            labels += y
            step_labels += sl
        data = {"jsonl": list(args.jsonl)}

    # deferred: megatron
    from megaprm.parallel.init import destroy, init_distributed

    t0 = time.perf_counter()
    groups = init_distributed(tp=1, pp=1, seed=0)
    try:
        if args.prm:
            scores = prm_judge.score_discriminative(args.prm, examples, groups,
                                                    input_format=args.input_format,
                                                    micro_batch_size=args.micro_batch_size)
            what = "P(good) of the PRM's head"
        else:
            scores = prm_judge.score_implicit(args.implicit, args.ref, examples, groups,
                                              beta=args.beta,
                                              micro_batch_size=args.micro_batch_size)
            what = f"PRIME's implicit reward: {args.beta:g} * sum(log pi_phi - log pi_ref)"
    finally:
        destroy()
    j = prm_judge.judged(examples, labels, step_labels, scores, threshold, what)
    if not j.solutions:
        raise ValueError(f"no solution could be scored ({len(j.skipped)} skipped, e.g. "
                         f"{j.skipped[0]}); the PRM's tokenizer must keep each step apart")
    report = prm_eval.judge(j.solutions, threshold, pooled_kinds=bool(args.task))
    title = (f"{args.prm or args.implicit}: step score = {what}; "
             f"{len(j.solutions)} solutions" + (f", {len(j.skipped)} not scored" if j.skipped
                                                 else ""))
    print(prm_eval.format_table(report, title))
    if args.jsonl:
        print(f"mean F1 over the {len(report['per_kind'])} file(s) (ProcessBench's average): "
              f"{report['mean_f1']:.3f}")
    for line in j.skipped[:3]:
        print(f"not scored: {line}")
    if args.out:
        def clean(x):  # strict JSON: nan -> null
            if isinstance(x, float) and not math.isfinite(x):
                return None
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            return [clean(v) for v in x] if isinstance(x, list) else x

        doc = {"prm": {"prm": args.prm, "implicit": args.implicit, "ref": args.ref,
                       "beta": args.beta if not args.prm else None, "score": what,
                       "input_format": args.input_format if args.prm else None},
               "data": data, "report": clean(report), "skipped": j.skipped,
               "solutions": prm_eval.solution_rows(j.solutions, threshold),
               "seconds": round(time.perf_counter() - t0, 1)}
        parent = os.path.dirname(os.path.abspath(args.out))
        os.makedirs(parent, exist_ok=True)
        tmp = f"{args.out}.tmp.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, args.out)
        print(f"[eval-prm] wrote {args.out}")
    return 0


def cmd_data(args) -> int:
    # deferred: keeps --help fast
    from megaprm.config import load_config
    from megaprm.tasks.convert import LAYOUTS, convert

    cfg = load_config(args.config, args.overrides)
    layout = args.layout or cfg.advantage.method
    if layout not in LAYOUTS:
        raise ValueError(f"{args.config} is a {layout} recipe, which has no released row "
                         f"layout; pass --layout {' | '.join(LAYOUTS)}")
    rows, _ = convert(args.src, args.out, layout, cfg.data, force=args.force, log=print)
    print(f"[megaprm] data: wrote {len(rows)} rows in {layout}'s released layout to {args.out}")
    if layout == "papo":
        missing = sum(not r["extra_info"]["reference_solution"] for r in rows)
        if missing:
            print(f"[megaprm] data: {missing} rows have no reference solution (no `solution` or "
                  "`reference_solution` field); PAPO's grader scores their process grade 0")
    return 0


def cmd_plot(args) -> int:
    # deferred: keeps --help fast
    from checkpoint_tools.layout import check_output
    from megaprm.trainer.plots import plot_run

    if args.out:  # RUN_DIR/plots (the default) is the run's own place for them
        check_output(args.out, "--out", {"run_dir": args.run_dir},
                     allowed=(os.path.join(args.run_dir, "plots"),))
    paths = plot_run(args.run_dir, out_dir=args.out)
    for p in paths:
        print(p)
    return 0


def cmd_plan(args) -> int:
    import json

    # deferred: keeps --help fast
    from megaprm.config import load_config, read_yaml_with_overrides
    from megaprm.planner import plan as planner
    from megaprm.planner.hardware import gpu_of
    from megaprm.trainer.preflight import check_launch_layout

    gpu = gpu_of(args.gpu, args.gpu_mem, args.gpu_spec)
    if args.gpus < 1:
        raise ValueError(f"--gpus {args.gpus} must be a positive number of GPUs")
    for flag, v in (("--prompt-tokens", args.prompt_tokens),
                    ("--mean-response", args.mean_response),
                    ("--max-response", args.max_response)):
        if v is not None and not v > 0:
            raise ValueError(f"{flag} {v!r} must be a positive number of tokens")
    cfg = load_config(args.config, args.overrides)
    # the launcher's own layout checks first: plan never says "fits" where train would refuse
    check_launch_layout(cfg, args.gpus)
    raw = read_yaml_with_overrides(args.config, args.overrides, example="configs/prof_grpo.yaml",
                                   override_example="parallel.tp=2")
    w, sources = planner.workload_of(cfg, raw, args.gpus, prompt_tokens=args.prompt_tokens,
                                     mean_response=args.mean_response,
                                     max_response=args.max_response)
    plan = planner.plan_workload(w, gpu, sources=sources, knobs_of=planner.override_keys(cfg))
    found = planner.search(w, gpu) if args.search else None
    if args.json:
        out = planner.to_json(plan)
        if found is not None:
            out["search"] = [planner.to_json(p) for p in found]
        print(json.dumps(out, indent=1))
    else:
        print(planner.table(plan))
        if found is not None:
            print(f"\nlayouts that fit on {w.world} x {gpu.name.upper()}, fastest first:")
            print(planner.search_table(found))
    return 0


def cmd_convert(args) -> int:
    # deferred: keeps --help fast
    from checkpoint_tools.__main__ import main as convert_main

    return convert_main(args.convert_args)


# ------------------------------------------------------------------------------ parser

DESCRIPTION = """\
RL of reasoning LLMs with process rewards on Megatron-Core.

Start with `megaprm demo` (CPU, a few minutes). Multi-rank commands take --nproc N
(default: one rank per GPU, else the CPU default) and start the ranks themselves; a
mistake is reported in one line before any rank starts. `megaprm <command> --help`
describes each command."""

TRAIN_HELP = """\
--config is a YAML recipe (configs/<method>.yaml for 7B on GPUs, configs/<method>_tiny.yaml
for CPU); any key can be overridden as section.key=value after it, e.g.
  megaprm train --config configs/grpo_tiny.yaml trainer.steps=10 actor.optim.lr=1e-5
The keys, their defaults and meanings: the recipe YAMLs and megaprm/config.py. An unknown
or invalid key is reported in one line that lists the valid keys of its section."""

# algorithms.registry.METHODS, spelled out: the registry imports torch, --help must not
DEMO_METHODS = ("prof_grpo", "grpo", "drgrpo", "rloo", "papo", "pure", "prime", "blend")


def _parser() -> argparse.ArgumentParser:
    # imports here stay light (no torch): `megaprm --help` answers in well under a second
    # deferred: keeps --help fast
    from megaprm.experiments.arithmetic.runs import PRM_INITS
    from megaprm.parallel.launch import add_launch_args
    from megaprm.parallel.ray_launch import add_ray_args

    ap = argparse.ArgumentParser(prog="megaprm", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

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
    d.set_defaults(fn=cmd_demo)

    from dataclasses import fields

    # deferred: keeps --help fast
    from megaprm.experiments.arithmetic.runs import ALL_METHODS, TASK_DEFAULTS, TASKS, CompareConfig

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
    cp.set_defaults(fn=cmd_compare)

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
    t.set_defaults(fn=cmd_train)

    p = sub.add_parser("train-prm", help="train a discriminative PRM (two-stage PURE recipe) on "
                                         "the arithmetic task or stepwise JSONL")
    p.add_argument("--config", required=True, help="YAML of PRMTrainConfig fields, e.g. "
                                                   "configs/prm/tiny.yaml")
    p.add_argument("overrides", nargs="*", help="e.g. stage2_steps=200 arithmetic.operand_max=9")
    add_launch_args(p, cpu_default=1)
    add_ray_args(p)
    p.set_defaults(fn=cmd_train_prm)

    ep = sub.add_parser("eval-prm", help="judge a PRM as the field does: ProcessBench's "
                                          "first-error F1 and step AUROC, per error kind",
                        description="Score solutions with labelled steps by a PRM and report "
                        "ProcessBench's metric (the first step scored below --threshold is the "
                        "predicted first error, -1 if none; accuracy on erroneous solutions "
                        "at finding the first wrong step, on correct ones at finding none, and "
                        "their harmonic mean F1) and, with exact step labels, the step AUROC, "
                        "overall and per error kind. One process; "
                        "docs/prm.md, 'Judging a PRM'.")
    ep.add_argument("--prm", default=None, metavar="DIR",
                    help="a discriminative PRM: megaprm train-prm output or an HF "
                         "Qwen2.5-Math-PRM-shaped checkpoint; step score = P(good)")
    ep.add_argument("--implicit", default=None, metavar="DIR",
                    help="PRIME's implicit PRM (a causal LM); step score = beta * the sum of "
                         "log pi_phi - log pi_ref over the step's tokens")
    ep.add_argument("--ref", default=None, metavar="DIR", help="the implicit PRM's reference")
    ep.add_argument("--beta", type=float, default=0.05, help="PRIME's beta (released 0.05)")
    ep.add_argument("--threshold", type=float, default=None,
                    help="a step is called bad when its score is below this (default 0.5 for "
                         "--prm, 0 for --implicit: a negative process reward)")
    ep.add_argument("--input-format", default="auto",
                    help="how the --prm reads a solution (prm.input_format: auto | "
                         "qwen25_math_prm | pure | raw | megaprm)")
    ep.add_argument("--task", default=None, choices=("arithmetic",),
                    help="held-out solutions of the arithmetic task with exact step labels: "
                         "half reference, half corrupted (every corruption kind)")
    ep.add_argument("--arith-task", default="short",
                    help="which of the comparison's arithmetic tasks (default short)")
    ep.add_argument("--task-config", nargs="*", default=[], metavar="KEY=VALUE",
                    help="ArithmeticConfig settings on top, e.g. num_ops=2,4 operand_max=20")
    ep.add_argument("--num", "--num-solutions", dest="num", type=int, default=512,
                    help="arithmetic solutions (default 512; under torchrun write "
                         "--num-solutions: torchrun reads --num as its own --numa-binding)")
    ep.add_argument("--seed", type=int, default=1_000_000,
                    help="the solutions' seed (default 1000000: the held-out set train-prm "
                         "evaluates a seed-0 PRM on)")
    ep.add_argument("--jsonl", nargs="+", default=None, metavar="FILE",
                    help="ProcessBench-format JSONL, one file per subset (id, generator, "
                         "problem, steps, final_answer_correct, label)")
    ep.add_argument("--micro-batch-size", type=int, default=16)
    ep.add_argument("--out", default=None, metavar="FILE.json", help="write the report here")
    ep.set_defaults(fn=cmd_eval_prm)

    dt = sub.add_parser("data", help="write a plain question file (JSONL/parquet) in a recipe's "
                                     "released row layout (PRIME, PROF-GRPO, PAPO, PURE)",
                        description="Read a prompt file of plain questions (fields problem | "
                        "question | prompt, answer | final_answer | a \\boxed{} in solution; "
                        "PAPO's grader also reads solution or reference_solution) and write it "
                        "in the row layout of the recipe's release: its system message and "
                        "instruction (data.system_prompt, data.prompt_template) put where the "
                        "release's preprocessing puts them. megaprm train renders the same "
                        "prompt from either file; the converted one also runs in the released "
                        "code. Rows of another layout are skipped and reported.")
    dt.add_argument("config", help="the recipe whose prompt settings apply, e.g. "
                                   "configs/prime.yaml")
    dt.add_argument("overrides", nargs="*", help="section.key=value, e.g. "
                                                 "data.prompt_template='{question}'")
    dt.add_argument("--in", dest="src", required=True, metavar="FILE",
                    help="the plain question file (.jsonl or .parquet)")
    dt.add_argument("--out", required=True, metavar="FILE",
                    help="the converted file; .parquet (as the verl-based releases read) or "
                    ".jsonl. Never the input; an existing file only with --force")
    dt.add_argument("--layout", default=None, choices=("prime", "prof_grpo", "papo", "pure"),
                    help="the release's layout (default: the recipe's advantage.method)")
    dt.add_argument("--force", action="store_true", help="replace an existing --out file")
    dt.set_defaults(fn=cmd_data)

    pl = sub.add_parser("plot", help="draw a run's metrics.jsonl curves into PNGs")
    pl.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    pl.add_argument("--out", default=None, help="PNG directory (default RUN_DIR/plots)")
    pl.set_defaults(fn=cmd_plot)

    pn = sub.add_parser("plan", help="per-GPU memory by phase, fits or not, and time per step, "
                                     "from a recipe and the models' config.json (no weights)",
                        description="Plan an RL recipe on N GPUs before any rank starts: "
                        "parameters per GPU (Megatron's stage built on the meta device), memory "
                        "of the update and of the rollout, the verdict with the largest terms "
                        "and the overrides that would make it fit, and time per phase. The "
                        "model, its constants and measured error: docs/plan.md.")
    pn.add_argument("config", help="YAML recipe, e.g. configs/prof_grpo.yaml")
    pn.add_argument("overrides", nargs="*", help="section.key=value, e.g. parallel.tp=4")
    pn.add_argument("--gpus", type=int, default=8, help="GPUs in the run (default 8)")
    pn.add_argument("--gpu", default="h100",
                    help="h100 | h200 | a100 | h20 | b200 | gb200 | mi300x (default h100)")
    pn.add_argument("--gpu-spec", default=None,
                    help="a GPU from its datasheet instead of --gpu: name=...,tflops=(dense "
                    "BF16),hbm_tbps=...,mem_gb=...[,link_gbps=(one way)]")
    pn.add_argument("--gpu-mem", type=float, default=None,
                    help="GB per GPU (default: the --gpu's own)")
    pn.add_argument("--prompt-tokens", type=int, default=None,
                    help="longest prompt (default data.max_prompt_tokens, else 1024)")
    pn.add_argument("--mean-response", type=float, default=None,
                    help="expected response length for the times (default rollout.max_tokens)")
    pn.add_argument("--max-response", type=float, default=None,
                    help="the longest response of a step's batch, which a synchronous step "
                    "waits for (default rollout.max_tokens)")
    pn.add_argument("--search", action="store_true",
                    help="also rank the tp/pp layouts that fit by predicted step time")
    pn.add_argument("--json", action="store_true", help="print the same numbers as JSON")
    pn.set_defaults(fn=cmd_plan)

    c = sub.add_parser("convert", help="HF <-> Megatron checkpoints: same as `python -m "
                                       "checkpoint_tools {import-hf,export-hf,verify} ...`")
    c.add_argument("convert_args", nargs=argparse.REMAINDER)
    c.set_defaults(fn=cmd_convert)

    # deferred: keeps --help fast
    from eval.cli import add_cli as add_eval
    from megaprm.bench import add_cli as add_bench

    add_eval(sub)
    add_bench(sub)
    return ap


def main(argv=None) -> int:
    # deferred: keeps --help fast
    from megaprm.parallel.launch import LAUNCH_T0_ENV, under_torchrun

    # the ranks inherit the start time; a command started by a process that ran one before
    # (a test, a script calling main twice) starts its own clock
    if not under_torchrun() or LAUNCH_T0_ENV not in os.environ:
        os.environ[LAUNCH_T0_ENV] = str(time.time())
    ap = _parser()
    # `key=value` overrides may sit before or after the flags (`--nproc 2 trainer.steps=2`)
    args, rest = ap.parse_known_args(argv)
    if rest:
        if not hasattr(args, "overrides") or any(r.startswith("-") for r in rest):
            ap.error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides = [*args.overrides, *rest]
    try:
        return args.fn(args)
    except KeyboardInterrupt:  # Ctrl-C: one line (ranks under the launcher ignore SIGINT)
        if os.environ.get("RANK", "0") == "0":
            print(f"megaprm {args.cmd}: stopped by SIGINT (Ctrl-C)", file=sys.stderr)
        return 128 + 2
    except _user_errors() as e:
        # deferred: keeps --help fast
        from megaprm.parallel.launch import report_user_error

        msg = f"megaprm {args.cmd}: error: {e}".splitlines()[0]
        if os.environ.get("MEGAPRM_DEBUG"):
            traceback.print_exc()
        return report_user_error(msg)


if __name__ == "__main__":
    sys.exit(main())
