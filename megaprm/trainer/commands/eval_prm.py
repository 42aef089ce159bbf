"""`megaprm eval-prm`: judge a PRM on labelled solutions in one process. The flags are checked
here; the solutions, the scoring and the judging are `prm_judge`'s (`labelled_set`,
`judge_prm`), the metrics and the table `rewards.prm_eval`'s.
"""
from __future__ import annotations

import os
import time


def add_parser(sub) -> None:
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
    ep.set_defaults(fn=run)


def _arithmetic_task(name: str, settings) -> object:
    """The arithmetic task `name` of the comparison (tasks.arithmetic.TASKS), with `key=value`
    settings of ArithmeticConfig on top."""
    import dataclasses

    # deferred: keeps --help fast
    from megaprm.tasks.arithmetic import TASKS as tasks

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


def _check_args(args) -> None:
    """The flags' own errors, in one line each, before any file is read."""
    import math

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


def _strict(x):
    """`x` as strict JSON takes it: nan -> null."""
    import math

    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    return [_strict(v) for v in x] if isinstance(x, list) else x


def _write_json(path: str, doc: dict) -> None:
    """`doc` written whole or not at all."""
    import json

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def run(args) -> int:
    # deferred: keeps --help fast
    from megaprm.outputs import check_output
    from megaprm.rewards import prm_eval

    _check_args(args)
    subsets = [(os.path.splitext(os.path.basename(path))[0],
                prm_eval.read_processbench_jsonl(path)) for path in args.jsonl or ()]
    if args.out:
        inputs = {"--prm": args.prm, "--implicit": args.implicit, "--ref": args.ref}
        inputs.update({f"--jsonl[{i}]": p for i, p in enumerate(args.jsonl or ())})
        check_output(args.out, "--out", inputs)
    threshold = args.threshold if args.threshold is not None else (0.5 if args.prm else 0.0)
    task = _arithmetic_task(args.arith_task, args.task_config) if args.task else None

    # deferred: torch and the trainer's packages
    from megaprm.trainer import prm_judge

    examples, labels, step_labels = prm_judge.labelled_set(task, args.num, args.seed, subsets)
    if task is not None:
        data = {"task": "arithmetic", "arith_task": args.arith_task, "config": repr(task),
                "num": args.num, "seed": args.seed}
    else:
        data = {"jsonl": list(args.jsonl)}
    t0 = time.perf_counter()
    report, j = prm_judge.judge_prm(
        examples, labels, step_labels, threshold, prm=args.prm, implicit=args.implicit,
        ref=args.ref, beta=args.beta, input_format=args.input_format,
        micro_batch_size=args.micro_batch_size, pooled_kinds=bool(args.task))
    title = (f"{args.prm or args.implicit}: step score = {j.score}; "
             f"{len(j.solutions)} solutions" + (f", {len(j.skipped)} not scored" if j.skipped
                                                 else ""))
    print(prm_eval.format_table(report, title))
    if args.jsonl:
        print(f"mean F1 over the {len(report['per_kind'])} file(s) (ProcessBench's average): "
              f"{report['mean_f1']:.3f}")
    for line in j.skipped[:3]:
        print(f"not scored: {line}")
    if args.out:
        _write_json(args.out, {
            "prm": {"prm": args.prm, "implicit": args.implicit, "ref": args.ref,
                    "beta": args.beta if not args.prm else None, "score": j.score,
                    "input_format": args.input_format if args.prm else None},
            "data": data, "report": _strict(report), "skipped": j.skipped,
            "solutions": prm_eval.solution_rows(j.solutions, threshold),
            "seconds": round(time.perf_counter() - t0, 1)})
        print(f"[eval-prm] wrote {args.out}")
    return 0
