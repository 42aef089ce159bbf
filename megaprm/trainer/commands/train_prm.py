"""`megaprm train-prm`: a discriminative PRM (`prm_training.train_prm`) on every rank, after
the launcher checked the layout and the output directory.
"""
from __future__ import annotations

import sys

from megaprm.parallel.launch import add_launch_args
from megaprm.parallel.on_ranks import on_ranks
from megaprm.parallel.ray_launch import add_ray_args


def add_parser(sub) -> None:
    p = sub.add_parser("train-prm", help="train a discriminative PRM (two-stage PURE recipe) on "
                                         "the arithmetic task or stepwise JSONL")
    p.add_argument("--config", required=True, help="YAML of PRMTrainConfig fields, e.g. "
                                                   "configs/prm/tiny.yaml")
    p.add_argument("overrides", nargs="*", help="e.g. stage2_steps=200 arithmetic.operand_max=9")
    add_launch_args(p, cpu_default=1)
    add_ray_args(p)
    p.set_defaults(fn=run)


def run(args) -> int:
    # deferred: keeps --help fast
    from megaprm.trainer.prm_training import load_prm_config

    cfg, tp, pp = load_prm_config(args.config, args.overrides)

    def preflight():
        # deferred: keeps --help fast
        from megaprm.outputs import check_output
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

    return on_ranks(args, sys.argv[1:], preflight, body)
