"""Per-phase RL step time as a function of the (tp, pp, dp) layout, tiny model, CPU/gloo.

    python scripts/bench_rl_step.py [--steps 3] [--warmup 1] [--layouts 1,1,1 2,1,1 1,2,1 1,1,2]
                                    [--out runs/bench/bench_rl_step.json]

Each layout runs `RLTrainer.step` (rollout -> outcome reward -> old log-probs -> advantages ->
PPO update -> weight sync) on world = tp*pp*dp local ranks started by `parallel.launch.spawn`
(gloo; NCCL where CUDA is present). The workload is the same for every layout: a tiny
Qwen2-shaped policy on the embedded arithmetic task, the global prompt batch fixed
(`data.prompts_per_step`), `prm.kind=none` and `advantage.method=grpo` (no PRM needed).
A phase's time is the slowest rank's (the step waits for it), median over the measured steps
after `--warmup` untimed ones. The baseline every layout is compared with is the (1,1,1)
layout measured in the same run (`vs_1_1_1` = layout time / (1,1,1) time; < 1 is faster).

On a 2-core CPU this measures the overhead of the parallel plumbing (collectives, pipeline
schedule, resharded weight sync), not a speed-up: two ranks share two cores.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = ("rollout", "outcome_reward", "process_reward", "old_logprobs", "advantages", "update",
          "weight_sync")
MODEL = {"family": "qwen2", "hidden_size": 64, "num_layers": 4, "num_heads": 4,
         "num_kv_heads": 2, "intermediate_size": 192}


def make_model(out_dir: str) -> str:
    from megaprm.models.tiny import save_tiny_model
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    kw = {k: v for k, v in MODEL.items() if k != "family"}
    return save_tiny_model(MODEL["family"], out_dir, tokenizer=tok, vocab_size=len(tok),
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id, **kw)


def rank_main(model_dir: str, run_dir: str, tp: int, pp: int, steps: int, warmup: int,
              overrides: list) -> dict:
    """One rank: build the trainer, run warmup + steps RL steps, return per-step phase times."""
    from megaprm.config import load_config
    from megaprm.parallel.init import destroy, init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.loop import RLTrainer

    groups = init_distributed(tp=tp, pp=pp, seed=0)
    cfg = load_config(str(ROOT / "megaprm" / "configs" / "demo.yaml"), [
        f"model.path={model_dir}", f"trainer.run_dir={run_dir}", f"parallel.tp={tp}",
        f"parallel.pp={pp}", "prm.kind=none", "advantage.method=grpo", "trainer.wandb=disabled",
        "trainer.progress=false", f"trainer.steps={steps + warmup}", *overrides])
    t0 = time.perf_counter()
    trainer = RLTrainer(cfg, groups, build_char_tokenizer())
    build_s = time.perf_counter() - t0
    rows = []
    for s in range(warmup + steps):
        t0 = time.perf_counter()
        m = trainer.step(s)
        total = time.perf_counter() - t0
        if s >= warmup:
            rows.append({"step_s": total, **{p: m.get(f"timing/{p}_s", 0.0) for p in PHASES}})
    destroy()
    return {"build_s": build_s, "steps": rows}


def run_layout(model_dir: str, tp: int, pp: int, dp: int, args) -> dict:
    from megaprm.parallel.launch import spawn

    with tempfile.TemporaryDirectory(prefix="bench-rl-step-") as run_dir:
        ranks = spawn(rank_main, tp * pp * dp, model_dir, run_dir, tp, pp, args.steps,
                      args.warmup, args.overrides)
    keys = ("step_s", *PHASES)
    # per step: slowest rank; then median over steps
    per_step = [{k: max(r["steps"][i][k] for r in ranks) for k in keys}
                for i in range(args.steps)]
    return {"tp": tp, "pp": pp, "dp": dp, "world_size": tp * pp * dp,
            "build_s": round(max(r["build_s"] for r in ranks), 3),
            "median_s": {k: round(statistics.median(s[k] for s in per_step), 4) for k in keys},
            "steps_s": [{k: round(v, 4) for k, v in s.items()} for s in per_step]}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None) -> int:
    from megaprm.bench import default_out  # runs/bench/, or $MEGAPRM_BENCH_RESULTS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--layouts", nargs="+", default=["1,1,1", "2,1,1", "1,2,1", "1,1,2"],
                    help="tp,pp,dp triples")
    ap.add_argument("--overrides", nargs="*",
                    default=["data.prompts_per_step=4", "rollout.n=4", "rollout.max_tokens=32",
                             "actor.micro_batch_size=8", "actor.mini_batches=1"],
                    help="config overrides shared by every layout (the workload)")
    ap.add_argument("--out", default=default_out("bench_rl_step.json"))
    args = ap.parse_args(argv)

    import torch

    layouts = [tuple(int(x) for x in s.split(",")) for s in args.layouts]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-rl-model-") as tmp:
        model_dir = make_model(os.path.join(tmp, "policy"))
        for tp, pp, dp in layouts:
            print(f"layout tp={tp} pp={pp} dp={dp} ...", file=sys.stderr, flush=True)
            results.append(run_layout(model_dir, tp, pp, dp, args))
    base = next((r for r in results if (r["tp"], r["pp"], r["dp"]) == (1, 1, 1)), None)
    for r in results:
        if base is not None:
            r["vs_1_1_1"] = {k: round(v / base["median_s"][k], 3) if base["median_s"][k] else None
                             for k, v in r["median_s"].items()}
    out = {
        "benchmark": "RL step time per phase vs (tp, pp, dp) layout; slowest rank, median over steps",
        "baseline": "the (1,1,1) layout, same workload, same run",
        "device": {"kind": "cuda" if torch.cuda.is_available() else "cpu", "cpu": cpu_name(),
                   "cores": os.cpu_count(),
                   "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]},
        "backend": "nccl" if torch.cuda.is_available() else "gloo",
        "torch": torch.__version__, "python": platform.python_version(),
        "model": MODEL, "workload": {"overrides": args.overrides, "prm": "none",
                                     "advantage": "grpo", "task": "arithmetic"},
        "steps": args.steps, "warmup": args.warmup, "phases": list(PHASES), "layouts": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for r in results:
        print(f"tp={r['tp']} pp={r['pp']} dp={r['dp']}: step {r['median_s']['step_s']:.3f} s"
              + (f" ({r['vs_1_1_1']['step_s']:.2f}x of 1,1,1)" if base else ""))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
