"""`megaprm eval`: avg@k / pass@k of a model on the shipped math benchmarks (see eval/run.py)."""
from __future__ import annotations

import json
import os
import sys

from eval.run import EvalConfig, evaluate_benchmarks, format_table
from megaprm.outputs import check_output
from megaprm.tasks.datasets import BENCHMARKS


def cmd_eval(args) -> int:
    if args.out:  # before the evaluation's minutes or hours, not after
        check_output(args.out, "--out", {"--model": args.model})
    benches = tuple(b.strip() for b in args.benchmarks.split(",") if b.strip())
    cfg = EvalConfig(model=args.model, benchmarks=benches, k=args.k,
                     temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                     engine=args.engine, limit=args.limit, seed=args.seed,
                     batch_prompts=args.batch_prompts, verify_timeout_s=args.verify_timeout_s,
                     progress=not args.no_progress)
    report = evaluate_benchmarks(cfg)
    print(format_table(report))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"report: {args.out}", file=sys.stderr)
    return 0


def add_cli(sub) -> None:
    e = sub.add_parser("eval", help="avg@k / pass@k on MATH500, AIME24, AMC23, Minerva, "
                                    "OlympiadBench (offline, math-verify graded)")
    e.add_argument("--model", required=True,
                   help="HF model dir, or a checkpoint_tools Megatron checkpoint (exported on the fly)")
    e.add_argument("--benchmarks", default=",".join(BENCHMARKS))
    e.add_argument("--k", type=int, default=16, help="samples per problem")
    e.add_argument("--temperature", type=float, default=1.0)
    e.add_argument("--top-p", type=float, default=1.0)
    e.add_argument("--max-tokens", type=int, default=4096)
    e.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    e.add_argument("--limit", type=int, default=None, help="first N problems per benchmark")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--batch-prompts", type=int, default=8, help="prompts per generate() call")
    e.add_argument("--verify-timeout-s", type=float, default=5.0,
                   help="math-verify wall-time limit per sample (raise on a busy machine)")
    e.add_argument("--out", default=None, help="write the JSON report here")
    e.add_argument("--no-progress", action="store_true")
    e.set_defaults(fn=cmd_eval)
