"""`megaprm plot RUN_DIR`: the curves of a run's metrics.jsonl as PNGs, one figure per metric
family (reward, actor, response, prm, eval, timing, ...), one panel per metric over steps."""
from __future__ import annotations

import math
import os
from collections import defaultdict

from megaprm.trainer.metrics import read_metrics


def plot_run(run_dir: str, out_dir: str | None = None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist; pass a run directory written by "
                                "`megaprm train` or `megaprm demo` (e.g. runs/demo/rl/prof_grpo)")
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{path} is empty: the run has not logged a step yet")
    series: dict = defaultdict(lambda: ([], []))
    for row in rows:
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                xs, ys = series[k]
                xs.append(row["step"])
                ys.append(v)
    families: dict = defaultdict(list)
    for k in sorted(series):
        families[k.split("/")[0] if "/" in k else "other"].append(k)
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for fam, keys in sorted(families.items()):
        cols = min(3, len(keys))
        nrows = math.ceil(len(keys) / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 2.8 * nrows), squeeze=False)
        for ax, k in zip(axes.flat, keys):
            xs, ys = series[k]
            ax.plot(xs, ys, marker="." if len(xs) < 50 else None, lw=1.2)
            ax.set_title(k, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(keys):]:
            ax.axis("off")
        fig.suptitle(f"{os.path.basename(os.path.abspath(run_dir))}: {fam}", fontsize=10)
        fig.tight_layout()
        out = os.path.join(out_dir, f"{fam}.png")
        fig.savefig(out, dpi=90)
        plt.close(fig)
        written.append(out)
    return written
