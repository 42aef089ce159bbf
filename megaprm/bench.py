"""`megaprm bench` (and `make bench`): run every benchmark script, then plot the results.

Each `scripts/bench_*.py` runs as its own process (a crash or a hang in one does not stop the
others) and writes its JSON into the results directory; `scripts/plot_benchmarks.py` then turns
every JSON present into a PNG. Scripts that are not in the checkout (yet) are reported and
skipped. The results directory is `runs/bench/` (not tracked), so a user's run leaves the
committed results alone; `--update-results` writes `scripts/results/`, the JSONs BENCHMARKS.md
quotes. Every script takes the directory from `$MEGAPRM_BENCH_RESULTS` (set by `megaprm bench`)
through `default_out`, and its own `--out` still wins.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
# order: cheap single-process benches first, the multi-rank RL step last
BENCHES = ("actor", "convert", "weight_sync", "advantages", "rl_step")
COMMITTED_RESULTS = SCRIPTS / "results"  # quoted by BENCHMARKS.md; written on request only
RESULTS_ENV = "MEGAPRM_BENCH_RESULTS"
DURATIONS = "bench_durations.json"  # each bench's last wall time, for the next run's estimate


def results_dir() -> Path:
    """Where benchmark JSONs and plots go: $MEGAPRM_BENCH_RESULTS, else runs/bench/."""
    return Path(os.environ.get(RESULTS_ENV) or ROOT / "runs" / "bench")


def default_out(filename: str) -> str:
    """A benchmark script's default `--out`: `filename` in `results_dir()`."""
    return str(results_dir() / filename)


def write_result(path: str | os.PathLike, result: dict, *, missing: list[str] | tuple = ()) -> Path:
    """Write a benchmark's JSON without ever replacing a complete result with a partial one.

    `missing` names the parts this run could not measure (e.g. "verl" when verl is not
    installed); they are recorded as `result["missing"]` and `result["complete"]`. A complete run
    writes `path`. A partial run writes `path` only if no complete result is there; otherwise it
    goes to `<stem>.partial.json` next to it (plotted too) and a warning says so. Returns the
    path written.
    """
    path = Path(path)
    result = {**result, "complete": not missing, "missing": list(missing)}
    target = path
    if missing and path.is_file():
        try:
            old = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            old = None
        # results written before this flag existed count as complete
        if isinstance(old, dict) and old.get("complete", True):
            target = path.with_name(path.stem + ".partial.json")
            print(f"bench: this run lacks {', '.join(missing)}; {path} holds a complete result "
                  f"and is kept; wrote {target.name} instead", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, target)
    return target


def load_module_at(rev: str, relpath: str, name: str):
    """Import `relpath` as it was at git revision `rev` (module `name`), for a "before" column
    measured in the same run as the current code. Its imports resolve to the current tree."""
    import importlib.util
    import tempfile

    src = subprocess.run(["git", "show", f"{rev}:{relpath}"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    d = tempfile.mkdtemp(prefix="megaprm-before-")
    path = os.path.join(d, f"{name}.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_average() -> dict:
    """`uptime`'s load averages, recorded with every result (a loaded run is visible as such)."""
    one, five, fifteen = os.getloadavg()
    return {"1m": round(one, 2), "5m": round(five, 2), "15m": round(fifteen, 2),
            "cores": os.cpu_count()}


def _durations(where: Path) -> dict:
    for d in (where, COMMITTED_RESULTS):
        try:
            return json.loads((d / DURATIONS).read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return {}


def run_benches(names, timeout_s: float, out_dir: Path) -> dict:
    """name -> "ok" | "missing" | "failed (exit N)" | "timeout"; then the plots. Says up front
    how long the run will take (each bench's last measured wall time, where one is known) and
    prints progress as it goes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                     os.environ.get("PYTHONPATH")])))
    env[RESULTS_ENV] = str(out_dir)
    last = _durations(out_dir)
    known = sum(last.get(n, 0.0) for n in names)
    unknown = [n for n in names if n not in last]
    measured = len(unknown) < len(names)  # a measured duration may round to 0.0 s
    print(f"bench: {len(names)} benchmark(s) one after another, results in {out_dir}/; "
          + (f"the last run took {known / 60:.0f} min" if measured else "no duration measured yet")
          + (f" ({', '.join(unknown)}: not measured)" if measured and unknown else "")
          + "; each is minutes on a 2-core CPU (the whole set well over 10 min)",
          file=sys.stderr, flush=True)
    status, t_start = {}, time.perf_counter()
    for i, name in enumerate(names, 1):
        script = SCRIPTS / f"bench_{name}.py"
        if not script.is_file():
            status[name] = "missing"
            print(f"bench: {script.relative_to(ROOT)} not found; skipped", file=sys.stderr)
            continue
        hint = f", last took {last[name]:.0f} s" if name in last else ""
        print(f"bench: [{i}/{len(names)}] {name} ...{hint}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            rc = subprocess.call([sys.executable, str(script)], cwd=ROOT, env=env,
                                 timeout=timeout_s)
            status[name] = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            status[name] = "timeout"
        took = time.perf_counter() - t0
        if status[name] == "ok":
            last[name] = round(took, 1)
            (out_dir / DURATIONS).write_text(json.dumps(last, indent=2) + "\n")
        print(f"bench: [{i}/{len(names)}] {name}: {status[name]} in {took:.0f} s "
              f"({(time.perf_counter() - t_start) / 60:.1f} min so far)", file=sys.stderr,
              flush=True)
    rc = subprocess.call([sys.executable, str(SCRIPTS / "plot_benchmarks.py")], cwd=ROOT, env=env)
    status["plots"] = "ok" if rc == 0 else f"failed (exit {rc})"
    return status


def cmd_bench(args) -> int:
    names = [n.strip() for n in args.only.split(",")] if args.only else list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        raise ValueError(f"--only {args.only}: unknown {unknown}; expected names from "
                         f"{','.join(BENCHES)}")
    out_dir = COMMITTED_RESULTS if args.update_results else Path(args.results or results_dir())
    status = run_benches(names, args.timeout_s, out_dir)
    width = max(len(k) for k in status)
    for k, v in status.items():
        print(f"{k:<{width}}  {v}")
    print(f"results: {out_dir}/ (bench_*.json and .png)")
    return 0 if all(v in ("ok", "missing") for v in status.values()) else 1


def add_cli(sub) -> None:
    b = sub.add_parser("bench", help="run scripts/bench_*.py (tens of minutes on CPU) and plot "
                                     "them into runs/bench/",
                       description="Run every benchmark script one after another, then plot "
                                   "them. On a 2-core CPU the whole set takes well over 10 "
                                   "minutes; progress is printed per benchmark.")
    b.add_argument("--only", default="", help=f"comma list from {','.join(BENCHES)}")
    b.add_argument("--timeout-s", type=float, default=3600.0, help="per script")
    b.add_argument("--results", default=None,
                   help="directory for the JSONs and plots (default runs/bench/)")
    b.add_argument("--update-results", action="store_true",
                   help="write the committed scripts/results/ that BENCHMARKS.md quotes")
    b.set_defaults(fn=cmd_bench)
