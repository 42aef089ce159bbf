"""`megaprm bench` (and `make bench`): run every benchmark script, then plot the results.

Each `scripts/bench_*.py` runs as its own process (a crash or a hang in one does not stop the
others) and writes its JSON under `scripts/results/`; `scripts/plot_benchmarks.py` then turns
every JSON present into a PNG, and BENCHMARKS.md quotes them. Scripts that are not in the
checkout (yet) are reported and skipped.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
# order: cheap single-process benches first, the multi-rank RL step last
BENCHES = ("actor", "convert", "weight_sync", "advantages", "rl_step")


def run_benches(names, timeout_s: float) -> dict:
    """name -> "ok" | "missing" | "failed (exit N)" | "timeout"; then the plots."""
    status = {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                     os.environ.get("PYTHONPATH")])))
    for name in names:
        script = SCRIPTS / f"bench_{name}.py"
        if not script.is_file():
            status[name] = "missing"
            print(f"bench: {script.relative_to(ROOT)} not found; skipped", file=sys.stderr)
            continue
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            rc = subprocess.call([sys.executable, str(script)], cwd=ROOT, env=env,
                                 timeout=timeout_s)
            status[name] = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            status[name] = "timeout"
        print(f"bench: {name}: {status[name]} in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
    rc = subprocess.call([sys.executable, str(SCRIPTS / "plot_benchmarks.py")], cwd=ROOT, env=env)
    status["plots"] = "ok" if rc == 0 else f"failed (exit {rc})"
    return status


def cmd_bench(args) -> int:
    names = [n.strip() for n in args.only.split(",")] if args.only else list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        raise ValueError(f"--only {args.only}: unknown {unknown}; expected names from "
                         f"{','.join(BENCHES)}")
    status = run_benches(names, args.timeout_s)
    width = max(len(k) for k in status)
    for k, v in status.items():
        print(f"{k:<{width}}  {v}")
    return 0 if all(v in ("ok", "missing") for v in status.values()) else 1


def add_cli(sub) -> None:
    b = sub.add_parser("bench", help="run scripts/bench_*.py and plot scripts/results/")
    b.add_argument("--only", default="", help=f"comma list from {','.join(BENCHES)}")
    b.add_argument("--timeout-s", type=float, default=3600.0, help="per script")
    b.set_defaults(fn=cmd_bench)
