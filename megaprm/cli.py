"""`megaprm {demo,compare,train,train-prm,eval-prm,plan,data,eval,bench,plot,convert}`: the
parser, composed of each command's own (`add_parser(sub)` in the module that owns the command,
which sets `fn` to its `run(args)`), and `main`.

    demo, compare                  megaprm/experiments/arithmetic/{demo,compare}_command.py
    train, train-prm, eval-prm,    megaprm/trainer/commands/
    plot, plan, data
    eval                           eval/cli.py
    bench                          megaprm/bench.py
    convert                        checkpoint_tools (python -m checkpoint_tools)

Commands that need several ranks validate everything they can without ranks (config, model vs
tp/pp, paths, resume layout), then re-launch themselves under torchrun through
`parallel.on_ranks` (`--nproc` ranks per node; `--nnodes/--node-rank/--master-addr` for several
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
    from megaprm.errors import ConfigError
    from megaprm.outputs import OutputPathError
    from megaprm.parallel.init import ParallelConfigError
    from megaprm.parallel.launch import LaunchError
    from megaprm.trainer.checkpoint.store import CheckpointError
    from megaprm.trainer.run_lock import RunLockError

    types = [ConfigError, OutputPathError, ParallelConfigError, LaunchError, CheckpointError,
             RunLockError, FileNotFoundError, ValueError]
    try:
        # deferred: keeps --help fast
        from checkpoint_tools.layout import ConversionError
        types.append(ConversionError)
    except ImportError:
        pass
    return tuple(types)


def cmd_convert(args) -> int:
    # deferred: keeps --help fast
    from checkpoint_tools.__main__ import main as convert_main

    return convert_main(args.convert_args)


DESCRIPTION = """\
RL of reasoning LLMs with process rewards on Megatron-Core.

Start with `megaprm demo` (CPU, a few minutes). Multi-rank commands take --nproc N
(default: one rank per GPU, else the CPU default) and start the ranks themselves; a
mistake is reported in one line before any rank starts. `megaprm <command> --help`
describes each command."""


def _parser() -> argparse.ArgumentParser:
    # imports here stay light (no torch): `megaprm --help` answers in well under a second
    # deferred: keeps --help fast
    from eval.cli import add_cli as add_eval
    from megaprm.bench import add_cli as add_bench
    from megaprm.experiments.arithmetic import compare_command, demo_command
    from megaprm.trainer.commands import data, eval_prm, plan, plot, train, train_prm

    ap = argparse.ArgumentParser(prog="megaprm", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for command in (demo_command, compare_command, train, train_prm, eval_prm, data, plot,
                    plan):
        command.add_parser(sub)

    c = sub.add_parser("convert", help="HF <-> Megatron checkpoints: same as `python -m "
                                       "checkpoint_tools {import-hf,export-hf,verify} ...`")
    c.add_argument("convert_args", nargs=argparse.REMAINDER)
    c.set_defaults(fn=cmd_convert)
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
