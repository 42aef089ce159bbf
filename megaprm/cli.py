"""`megaprm {demo,train,train-prm,eval,bench,convert}`: thin wrappers over the packages.

Commands that need several ranks re-launch themselves under torchrun when they are not already
running under it (`--nproc` ranks on this node). User errors print one line and exit 2.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys


def _torchrun(nproc: int, argv: list) -> int:
    """Re-run `megaprm <argv>` as `nproc` torchrun ranks on this machine."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "megaprm.cli", *argv]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.call(cmd, env=env)


def _under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def cmd_demo(args) -> int:
    if not _under_torchrun():
        return _torchrun(args.nproc, sys.argv[1:])
    from megaprm import demo
    from megaprm.parallel.init import destroy, init_distributed

    dcfg = demo.DemoConfig(run_dir=args.run_dir, method=args.method, seed=args.seed,
                           **({"rl_steps": args.rl_steps} if args.rl_steps else {}),
                           **({"warmup_steps": args.warmup_steps} if args.warmup_steps else {}))
    groups = init_distributed(tp=1, pp=1, seed=args.seed)
    summary = demo.run(dcfg, groups)
    if groups.rank == 0:
        demo.print_summary(summary)
    destroy()
    return 0


def cmd_train(args) -> int:
    from megaprm.config import load_config

    cfg = load_config(args.config, args.overrides)  # validate before launching ranks
    if not _under_torchrun():
        return _torchrun(args.nproc, sys.argv[1:])
    from megaprm.parallel.init import destroy, init_distributed
    from megaprm.rewards.prm_training import load_tokenizer
    from megaprm.trainer.loop import RLTrainer

    groups = init_distributed(tp=cfg.parallel.tp, pp=cfg.parallel.pp, seed=cfg.trainer.seed)
    # not AutoTokenizer: next to a Qwen2 config it would rebuild the char tokenizer as
    # Qwen2Tokenizer, which splits the "\n\n" step separator into two tokens
    tok = load_tokenizer(cfg.model.path)
    RLTrainer(cfg, groups, tok).fit()
    destroy()
    return 0


def main(argv=None) -> int:
    from megaprm.config import ConfigError

    ap = argparse.ArgumentParser(prog="megaprm", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="the embedded CPU demo (warm-up, PRM, RL, summary)")
    d.add_argument("--method", default="prof_grpo")
    d.add_argument("--run-dir", default="runs/demo")
    d.add_argument("--nproc", type=int, default=2)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--rl-steps", type=int, default=0, help="override the demo's RL steps")
    d.add_argument("--warmup-steps", type=int, default=0, help="override warm-up steps")
    d.set_defaults(fn=cmd_demo)
    t = sub.add_parser("train", help="RL from a YAML recipe (configs/) + dotted overrides")
    t.add_argument("--config", required=True)
    t.add_argument("--nproc", type=int, default=1)
    t.add_argument("overrides", nargs="*", help="e.g. actor.optim.lr=1e-6 trainer.steps=10")
    t.set_defaults(fn=cmd_train)
    _register_optional(sub)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"megaprm {args.cmd}: error: {e}", file=sys.stderr)
        return 2


def _register_optional(sub) -> None:
    """Subcommands owned by other packages (PRM training, eval, bench, conversion)."""
    try:
        from megaprm.rewards.prm_training import add_cli as add_prm
        add_prm(sub)
    except ImportError:
        pass
    for mod in ("eval.cli", "megaprm.bench", "checkpoint_tools.cli"):
        try:
            __import__(mod, fromlist=["add_cli"]).add_cli(sub)
        except (ImportError, AttributeError):
            pass


if __name__ == "__main__":
    sys.exit(main())
