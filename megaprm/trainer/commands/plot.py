"""`megaprm plot`: a run's metrics.jsonl curves into PNGs (`trainer.plots.plot_run`)."""
from __future__ import annotations

import os


def add_parser(sub) -> None:
    pl = sub.add_parser("plot", help="draw a run's metrics.jsonl curves into PNGs")
    pl.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    pl.add_argument("--out", default=None, help="PNG directory (default RUN_DIR/plots)")
    pl.set_defaults(fn=run)


def run(args) -> int:
    # deferred: keeps --help fast
    from megaprm.outputs import check_output
    from megaprm.trainer.plots import plot_run

    if args.out:  # RUN_DIR/plots (the default) is the run's own place for them
        check_output(args.out, "--out", {"run_dir": args.run_dir},
                     allowed=(os.path.join(args.run_dir, "plots"),))
    paths = plot_run(args.run_dir, out_dir=args.out)
    for p in paths:
        print(p)
    return 0
