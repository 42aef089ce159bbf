"""Plot every runs/bench/bench_*.json that exists into a PNG next to it (matplotlib, Agg).

    python scripts/plot_benchmarks.py [--results runs/bench] [--out runs/bench]

Each figure names, in its title, the baseline measured in the same run that it is compared
with: actor vs transformers, conversion vs raw safetensors I/O, weight sync vs memcpy,
advantage estimators vs the loop reference (and verl when installed), RL step per layout vs
the (1,1,1) layout. A missing file is skipped; a file whose layout this script does not know
(or that fails to plot) gets a generic bar chart of its numeric fields, with a warning.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]


def _device(d: dict) -> str:
    dev = d.get("device")
    if isinstance(dev, dict):
        parts = [str(dev[k]) for k in ("kind", "cpu") if k in dev]
        return ", ".join(parts + ([f"{dev['cores']} cores"] if "cores" in dev else []))
    if isinstance(dev, str):
        return dev
    return f"{d.get('machine', '?')}, {d.get('cpus', '?')} cores"


def plot_actor(d: dict, ax) -> None:
    """The default path (sdpa_chunked) against transformers, one pair of bars per shape (the
    GPU runs measure two), with MFU where the device has a known peak."""
    shapes = d.get("shapes") or [{"shape": "", "rows": [
        {"variant": "sdpa_chunked", "tokens_per_s": d["megaprm_tokens_per_s"]},
        {"variant": "transformers", "tokens_per_s": d["transformers_tokens_per_s"]}]}]
    # a run with torch.compile rows (`--compile-rows-only`) gets a third bar per shape
    bars = [("sdpa_chunked", "tab:blue", "megaprm actor"),
            ("sdpa_chunked_compile", "tab:orange", "megaprm actor, torch.compile"),
            ("transformers", "tab:gray", "transformers")]
    bars = [b for b in bars if any(r["variant"] == b[0] for sh in shapes for r in sh["rows"])]
    w = 0.76 / len(bars)
    for i, sh in enumerate(shapes):
        rows = {r["variant"]: r for r in sh["rows"]}
        for k, (variant, color, label) in enumerate(bars):
            r = rows.get(variant)
            if not r or not r.get("tokens_per_s"):
                continue
            dx = (k - (len(bars) - 1) / 2) * w
            v = r["tokens_per_s"]
            ax.bar(i + dx, v, w, color=color, label=label if i == 0 else None)
            mfu = f"\nMFU {r['mfu']:.2f}" if r.get("mfu") else ""
            ax.text(i + dx, v, f"{v:,.0f}{mfu}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(shapes)), [sh["shape"] for sh in shapes])
    ax.set_ylabel("fwd+bwd tokens/s")
    ax.legend(fontsize=8)
    ratios = ", ".join(f"{sh['shape']} {r['ratio_vs_transformers']:.2f}" for sh in shapes
                       for r in sh["rows"] if r["variant"] == "sdpa_chunked"
                       and r.get("ratio_vs_transformers")) or \
        f"{d['ratio_megaprm_over_transformers']:.2f}"
    ax.set_title(f"Actor fwd+bwd throughput (baseline: transformers, same run, "
                 f"{d.get('dtype', '')})\nratio {ratios} | {_device(d)}", fontsize=9)


def _ms(row: dict, prefix: str) -> float:
    """A per-call time in ms: thread-CPU time where recorded (`<prefix>_cpu_ms`), else wall
    (`<prefix>_wall_ms`), else the older single `<prefix>_ms` field."""
    for key in (f"{prefix}_cpu_ms", f"{prefix}_wall_ms", f"{prefix}_ms"):
        if key in row:
            return row[key]
    raise KeyError(f"{prefix}_cpu_ms")


def plot_advantages(d: dict, ax) -> None:
    single = d["single_process"]
    names = list(single)
    ours = [_ms(single[n], "ours") for n in names]
    loop = [_ms(single[n], "loop_reference") for n in names]
    x = range(len(names))
    w = 0.38
    ax.bar([i - w / 2 for i in x], ours, w, label="megaprm (vectorised)")
    ax.bar([i + w / 2 for i in x], loop, w, label="loop reference", color="tab:gray")
    verl = d.get("verl") or {}
    if verl.get("available"):
        for n, r in verl.items():
            if isinstance(r, dict) and n in names:
                for kind, marker in (("verl_vectorized", "^"), ("verl_loop", "v")):
                    try:
                        v = _ms(r, kind)
                    except KeyError:
                        continue
                    ax.scatter([names.index(n)], [v], marker=marker, color="k", zorder=3,
                               label=f"{kind} (verl's own interleaved run)")
    ax.set_yscale("log")
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("ms per call (median thread-CPU, log)")
    base = "loop reference" + (" and verl" if verl.get("available") else " (verl not installed)")
    ax.set_title(f"Advantage estimators (baseline: {base}, same run)\n{_device(d)}", fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    ax.legend(seen.values(), seen.keys(), fontsize=8)


def plot_convert(d: dict, ax) -> None:
    bars = {"raw safetensors\nread+write": d["raw_safetensors"]["seconds"]}
    for side in ("import_hf", "export_hf"):
        if side in d:
            bars[f"{side}\ncore"] = d[side]["core_s"]
            bars[f"{side}\nend to end"] = d[side]["end_to_end_s"]
    ax.bar(list(bars), list(bars.values()),
           color=["tab:gray"] + ["tab:blue", "tab:cyan"] * ((len(bars) - 1) // 2))
    for i, v in enumerate(bars.values()):
        ax.text(i, v, f"{v:.1f} s", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("seconds")
    m, mach = d.get("model", {}), d.get("machine", {})
    ax.set_title(f"HF <-> Megatron conversion (baseline: raw safetensors I/O of the same bytes, "
                 f"same run)\n{m.get('params', '?'):,} params {m.get('dtype', '')}, "
                 f"{mach.get('cpu', '?')}, {mach.get('cores', '?')} cores", fontsize=9)


def plot_weight_sync(d: dict, ax) -> None:
    labels, vals, memcpy = [], [], []
    for lay in d["layouts"]:
        for row in lay["rows"]:
            labels.append(f"tp{lay['tp']} pp{lay['pp']} {row['mode'].replace('bucket ', 'b')}")
            vals.append(row["gbytes_per_s"])
            memcpy.append(row["memcpy_gbytes_per_s"])
    ax.bar(range(len(vals)), vals, label="weight sync")
    ax.plot(range(len(vals)), memcpy, "k_", markersize=20, mew=2, label="memcpy (same bytes)")
    ax.set_xticks(range(len(vals)), labels, fontsize=7, rotation=35, ha="right")
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=8)
    ax.set_title(f"Weight sync throughput (baseline: memcpy of the same bytes, same run)\n"
                 f"{d.get('backend', '')}, {d.get('world_size', '?')} ranks, {_device(d)}",
                 fontsize=9)


def plot_rl_step(d: dict, ax) -> None:
    layouts = d["layouts"]
    labels = [f"tp{r['tp']} pp{r['pp']} dp{r['dp']}" for r in layouts]
    bottom = [0.0] * len(layouts)
    for phase in d["phases"]:
        vals = [r["median_s"].get(phase, 0.0) for r in layouts]
        ax.bar(labels, vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(layouts):
        ratio = (r.get("vs_1_1_1") or {}).get("step_s")
        text = f"{r['median_s']['step_s']:.2f} s" + (f"\n{ratio:.2f}x" if ratio else "")
        ax.text(i, max(bottom[i], r["median_s"]["step_s"]), text, ha="center", va="bottom",
                fontsize=8)
    ax.set_ylabel("seconds per RL step (slowest rank, median)")
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title(f"RL step per phase vs layout (baseline: the (1,1,1) layout, same run)\n"
                 f"{d.get('backend', '')}, {_device(d)}", fontsize=9)


def plot_peer_trl(d: dict, ax) -> None:
    """CPU-s per RL step of each row (summed over ranks), TRL's as the baseline line."""
    rows = d["rows"]
    names = list(rows)
    vals = [rows[n]["cpu_s_per_step"] for n in names]
    ax.bar(range(len(vals)), vals, color=["C1" if n == "trl" else "C0" for n in names])
    trl = rows.get("trl", {}).get("cpu_s_per_step")
    for i, v in enumerate(vals):
        text = f"{v:.3f}" + (f"\n{v / trl:.2f}x TRL" if trl else "")
        ax.text(i, v, text, ha="center", va="bottom", fontsize=8)
    if trl:
        ax.axhline(0.7 * trl, color="k", ls=":", lw=1, label="0.7x TRL")
        ax.legend(fontsize=8)
    labels = [n.replace("megaprm_", "").replace("_rank", " rank").replace("_packed_", "\npacked ")
              for n in names]
    ax.set_xticks(range(len(vals)), labels, fontsize=8)
    ax.margins(y=0.15)
    ax.set_ylabel("CPU-s per RL step (sum over ranks, median)")
    load = d.get("load", {})
    ax.set_title(f"One RL step, megaprm vs TRL GRPOTrainer (baseline: TRL, same run)\n"
                 f"{_device(d)}, load {load.get('before_1_5_15m', ['?'])[0]} -> "
                 f"{load.get('after_1_5_15m', ['?'])[0]}", fontsize=9)


def _numeric_leaves(obj, prefix=""):
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        yield prefix, float(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numeric_leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _numeric_leaves(v, f"{prefix}[{i}]")


def plot_generic(d: dict, ax) -> None:
    """Fallback: the timing / throughput fields of any JSON, as recorded."""
    keys = ("_s", "_ms", "seconds", "per_s", "ratio", "speedup")
    leaves = [(k, v) for k, v in _numeric_leaves(d) if any(s in k.split(".")[-1] for s in keys)]
    leaves = leaves[:30]
    ax.barh([k for k, _ in leaves], [v for _, v in leaves])
    ax.tick_params(axis="y", labelsize=6)
    ax.invert_yaxis()
    base = d.get("baseline", "as recorded in the JSON (see its fields)")
    ax.set_title(f"{d.get('benchmark', 'benchmark')} (baseline: {base})", fontsize=9)


PLOTTERS = {"bench_actor": plot_actor, "bench_convert": plot_convert, "bench_advantages": plot_advantages,
            "bench_weight_sync": plot_weight_sync, "bench_rl_step": plot_rl_step,
            "bench_peer_trl": plot_peer_trl}


def plot_file(path: Path, out_dir: Path) -> Path:
    d = json.loads(path.read_text())
    # bench_x.partial.json (a run that could not measure everything) plots like bench_x.json
    # and bench_x_<variant>.json (bench_convert_tp2, bench_actor_gpu_h200) like bench_x.json
    stem = path.name.split(".")[0]
    fn = next((PLOTTERS[k] for k in sorted(PLOTTERS, key=len, reverse=True)
               if stem == k or stem.startswith(k + "_")), plot_generic)
    fig, ax = plt.subplots(figsize=(9, 5))
    try:
        fn(d, ax)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        print(f"plot_benchmarks: {path.name}: layout not understood ({type(e).__name__}: {e}); "
              "plotting its numeric fields instead", file=sys.stderr)
        fig.clf()
        ax = fig.add_subplot()
        plot_generic(d, ax)
    fig.tight_layout()
    if d.get("missing"):
        ax.set_title(ax.get_title() + f"\nPARTIAL run: no {', '.join(d['missing'])}", fontsize=9)
    out = out_dir / f"{path.stem}.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_all(results_dir: Path, out_dir: Path) -> list:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(Path(results_dir).glob("bench_*.json")):
        try:
            written.append(plot_file(path, out_dir))
        except json.JSONDecodeError as e:
            print(f"plot_benchmarks: {path}: not valid JSON ({e}); skipped", file=sys.stderr)
    return written


def main(argv=None) -> int:
    from megaprm.bench import results_dir  # runs/bench/, or $MEGAPRM_BENCH_RESULTS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(results_dir()),
                    help="directory of bench_*.json (default: $MEGAPRM_BENCH_RESULTS or "
                         "runs/bench/; the committed ones: scripts/results)")
    ap.add_argument("--out", default=None, help="where PNGs go (default: --results)")
    args = ap.parse_args(argv)
    written = plot_all(Path(args.results), Path(args.out or args.results))
    for p in written:
        print(f"wrote {p}")
    if not written:
        print(f"plot_benchmarks: no bench_*.json under {args.results}; nothing to plot",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
