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

    python scripts/bench_rl_step.py --placements colocated separate:0 separate:1 separate:2
                                    [--out runs/bench/bench_rl_step_async.json]

compares placements instead (docs/rollout.md): one trainer rank with the engine colocated, vs
one trainer rank + one rollout rank (`rollout.placement=separate rollout.ranks=1`) at
`rollout.max_staleness` k. Per phase the trainer's wall time (its `rollout` phase is then the
wait for the batch), the step's wall time, and each rank's CPU seconds per step; the
colocated run of the same invocation is the baseline (`vs_colocated`).
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
              overrides: list, threads: int = 0) -> dict:
    """One rank: build the trainer, run warmup + steps RL steps, return per-step phase times
    (a separate placement's rollout rank serves and returns its CPU seconds)."""
    from megaprm.config import load_config
    from megaprm.parallel.init import destroy, init_distributed
    from megaprm.rollout import remote
    from megaprm.trainer.rl import rollout_source
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.loop import RLTrainer

    cfg = load_config(str(ROOT / "megaprm" / "configs" / "demo.yaml"), [
        f"model.path={model_dir}", f"trainer.run_dir={run_dir}", f"parallel.tp={tp}",
        f"parallel.pp={pp}", "prm.kind=none", "advantage.method=grpo", "trainer.wandb=disabled",
        "trainer.progress=false", f"trainer.steps={steps + warmup}", *overrides])
    if threads:  # the same per rank in every run (spawn's default divides the cores by world)
        import torch

        torch.set_num_threads(threads)
    placement = remote.split_world(cfg)
    if placement is not None and placement.is_rollout:
        # CPU from the first measured block on: the engine's start-up and the warm-up blocks
        # are left out, as the trainer's build and warm-up steps are
        from megaprm.rollout import factory

        marks, build = [], factory.build_engine

        def marking_build(*a, **k):
            engine = build(*a, **k)
            generate = engine.generate

            def marked(*ga, **gk):
                marks.append(time.process_time())
                return generate(*ga, **gk)

            engine.generate = marked
            return engine

        factory.build_engine = marking_build
        drawn = rollout_source.serve(cfg, placement, build_char_tokenizer())
        end = time.process_time()
        return {"role": "rollout", "drawn": drawn,
                "cpu_s": end - marks[warmup] if len(marks) > warmup else float("nan")}
    groups = init_distributed(tp=tp, pp=pp, seed=0)
    t0 = time.perf_counter()
    trainer = RLTrainer(cfg, groups, build_char_tokenizer())
    build_s = time.perf_counter() - t0
    rows = []
    c0 = None
    for s in range(warmup + steps):
        if s == warmup:
            c0 = time.process_time()
        t0 = time.perf_counter()
        m = trainer.step(s)
        total = time.perf_counter() - t0
        if s >= warmup:
            rows.append({"step_s": total, **{p: m.get(f"timing/{p}_s", 0.0) for p in PHASES},
                         "staleness": m.get("rollout/staleness_max", 0.0)})
    cpu = time.process_time() - c0
    trainer.source.stop()
    destroy()
    return {"role": "trainer", "build_s": build_s, "steps": rows, "cpu_s": cpu}


def run_placement(model_dir: str, spec: str, args) -> dict:
    """`colocated` (1 rank) or `separate:k` (1 trainer + 1 rollout rank, max_staleness k)."""
    from megaprm.parallel.launch import spawn

    extra, world = [], 1
    if spec != "colocated":
        k = int(spec.split(":")[1])
        extra, world = ["rollout.placement=separate", "rollout.ranks=1",
                        f"rollout.max_staleness={k}"], 2
    with tempfile.TemporaryDirectory(prefix="bench-rl-async-") as run_dir:
        ranks = spawn(rank_main, world, model_dir, run_dir, 1, 1, args.steps, args.warmup,
                      [*args.overrides, *extra], args.threads)
    tr = ranks[0]
    keys = ("step_s", *PHASES)
    return {"placement": spec, "world_size": world,
            "median_s": {k: round(statistics.median(s[k] for s in tr["steps"]), 4)
                         for k in keys},
            "staleness_max": max(s["staleness"] for s in tr["steps"]),
            # the rollout rank: per block drawn after the warm-up (k blocks ahead of the last
            # step are drawn too; one block per step here)
            "cpu_s_per_step": {r["role"]: round(r["cpu_s"] / (args.steps if r["role"] == "trainer"
                                                              else r["drawn"] - args.warmup), 4)
                               for r in ranks},
            "steps_s": [{k: round(v, 4) for k, v in s.items()} for s in tr["steps"]]}


def main_placements(args) -> int:
    import torch

    load0 = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-rl-model-") as tmp:
        model_dir = make_model(os.path.join(tmp, "policy"))
        for spec in args.placements:
            print(f"placement {spec} ...", file=sys.stderr, flush=True)
            results.append(run_placement(model_dir, spec, args))
    base = next((r for r in results if r["placement"] == "colocated"), None)
    for r in results:
        if base is not None:
            r["vs_colocated"] = {k: round(v / base["median_s"][k], 3) if base["median_s"][k]
                                 else None for k, v in r["median_s"].items()}
    out = {
        "benchmark": "RL step per phase: colocated engine vs separate rollout rank at staleness k",
        "baseline": "the colocated placement (1 rank), same workload, same run",
        "device": {"kind": "cuda" if torch.cuda.is_available() else "cpu", "cpu": cpu_name(),
                   "cores": os.cpu_count(), "load_avg_at_start": [round(x, 2) for x in load0],
                   "load_avg_at_end": [round(x, 2) for x in os.getloadavg()]},
        "torch": torch.__version__, "python": platform.python_version(), "model": MODEL,
        "workload": {"overrides": args.overrides, "prm": "none", "advantage": "grpo",
                     "task": "arithmetic"},
        "steps": args.steps, "warmup": args.warmup, "phases": list(PHASES),
        "threads_per_rank": args.threads, "placements": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for r in results:
        print(f"{r['placement']}: step {r['median_s']['step_s']:.3f} s, rollout wait "
              f"{r['median_s']['rollout']:.3f} s, cpu/step {r['cpu_s_per_step']}"
              + (f" ({r['vs_colocated']['step_s']:.2f}x of colocated)" if base else ""))
    print(f"wrote {args.out}")
    return 0


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
    ap.add_argument("--placements", nargs="+", default=None,
                    help="colocated and/or separate:K (K = rollout.max_staleness) instead of "
                         "--layouts")
    ap.add_argument("--threads", type=int, default=1,
                    help="--placements: torch threads per rank, the same in every placement")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.placements:
        args.out = args.out or default_out("bench_rl_step_async.json")
        return main_placements(args)
    args.out = args.out or default_out("bench_rl_step.json")

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
