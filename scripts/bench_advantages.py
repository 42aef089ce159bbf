"""Advantage estimators: time per call, single process and DP=2 (gloo), vs loops and vs verl.

    .venv/bin/python scripts/bench_advantages.py [--groups 512] [--n 16] [--tokens 256]

Batch: `groups x n` samples (default 512 x 16 = 8192), `tokens` response positions.
* single process: each estimator (median of `--reps` calls) vs the slow Python-loop reference
  from tests/algorithms/advantage_reference.py (one call), with the max |difference|;
* DP=2: the same estimators on 2 gloo processes, samples scattered at random over the ranks
  (groups split across ranks), time per call (slowest rank) and collectives per call;
* verl: GRPO and RLOO against verl's `core_algos` (loop and vectorised versions) on the same
  data in the same process: max |difference| and the time ratio ours / verl.

verl is NOT a project dependency. For the comparison install it into the venv only:
    .venv/bin/pip install --no-deps "verl==0.9.*" && .venv/bin/pip install ray tensordict \
        omegaconf codetiming orjson packaging
    rm -rf .venv/lib/python3.*/site-packages/tests   # verl's wheel ships a top-level `tests`
                                                   # package that shadows this repo's tests/
Without verl the script still runs and records `"verl": {"available": false, ...}`.
Writes runs/bench/bench_advantages.json (`megaprm bench --update-results`: scripts/results/; a run without verl or DP=2 never replaces a
complete result: it goes to bench_advantages.partial.json, see `megaprm.bench.write_result`).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "algorithms")]

import advantage_reference as ref
import torch
import torch.distributed as dist

from megaprm.algorithms import advantages as A
from megaprm.algorithms import filters as F
from megaprm.parallel.reductions import count_collectives
from tests.distributed_utils import run_distributed


def make_batch(groups: int, n: int, tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Binary outcomes, PRM-like scores, random lengths and steps; samples shuffled."""
    g = torch.Generator().manual_seed(seed)
    b = groups * n
    perm = torch.randperm(b, generator=g)
    group_ids = (torch.arange(groups).repeat_interleave(n) * 7 + 11)[perm]
    outcome = (torch.rand(b, generator=g) < torch.rand(groups, generator=g).repeat_interleave(n)[perm]).float()
    lengths = torch.randint(tokens // 4, tokens + 1, (b,), generator=g)
    mask = (torch.arange(tokens)[None] < lengths[:, None]).float()
    max_steps = 16
    step_mask = torch.zeros(b, max_steps, dtype=torch.bool)
    ends = torch.zeros(b, max_steps, dtype=torch.long)
    end_mask = torch.zeros(b, tokens, dtype=torch.bool)
    n_steps = torch.randint(1, max_steps + 1, (b,), generator=g)
    for i in range(b):
        k, length = int(n_steps[i]), int(lengths[i])
        inner = torch.randperm(length - 1, generator=g)[: k - 1].sort().values.tolist()
        e = inner + [length - 1]
        step_mask[i, : len(e)] = True
        ends[i, : len(e)] = torch.tensor(e)
        end_mask[i, e] = True
    step_scores = torch.rand(b, max_steps, generator=g) * 2 - 1
    process = ((step_scores + 1) / 2 * step_mask).sum(1) / step_mask.sum(1)
    return {"outcome": outcome, "process": process, "group_ids": group_ids, "mask": mask,
                "num_steps": step_mask.sum(1), "logp_a": -torch.rand(b, tokens, generator=g) * 3,
                "logp_b": -torch.rand(b, tokens, generator=g) * 3, "step_scores": step_scores,
                "step_mask": step_mask, "ends": ends, "end_mask": end_mask}


def estimators(d: dict[str, torch.Tensor], group: Any) -> dict[str, Callable[[], Any]]:
    """Name -> zero-argument call of our estimator on batch `d` (this rank's part).
    `grpo_token` is GRPO broadcast to the tokens (`[B] -> [B, T]`), the yardstick of the
    token-level estimators PRIME and PURE."""
    o, p, gid, m = d["outcome"], d["process"], d["group_ids"], d["mask"]
    return {
        "grpo": lambda: A.grpo(o, gid, group=group),
        "grpo_token": lambda: A.grpo(o, gid, group=group)[:, None] * m,
        "rloo": lambda: A.rloo(o, gid, group=group),
        "papo": lambda: A.papo(o, p, gid, group=group),
        "blend": lambda: A.blend(o, p, gid, group=group),
        "accuracy_filter": lambda: F.accuracy(o, gid, group=group),
        "prof_filter": lambda: F.prof(o, p, gid, remove=8, num_steps=d["num_steps"], group=group),
        "prime": lambda: A.prime(o, d["logp_a"], d["logp_b"], m, gid, group=group)[0],
        "pure": lambda: A.pure(o, d["step_scores"], d["step_mask"], d["ends"], m, gid,
                               group=group)[0],
    }


def loop_references(d: dict[str, torch.Tensor]) -> dict[str, Callable[[], Any]]:
    o, p, gid, m = d["outcome"], d["process"], d["group_ids"], d["mask"]
    return {
        "grpo": lambda: ref.ref_grpo(o, gid),
        "grpo_token": lambda: [[a * float(mt) for mt in row] for a, row in
                               zip(ref.ref_grpo(o, gid), m.tolist())],
        "rloo": lambda: ref.ref_rloo(o, gid),
        "papo": lambda: ref.ref_papo(o, p, gid),
        "blend": lambda: ref.ref_blend(o, p, gid),
        "accuracy_filter": lambda: ref.ref_accuracy(o, gid),
        "prof_filter": lambda: ref.ref_prof(o, p, gid, 8, "both", d["num_steps"]),
        "prime": lambda: ref.ref_prime(o, d["logp_a"], d["logp_b"], m, gid)[0],
        "pure": lambda: ref.ref_pure(o, d["step_scores"], d["step_mask"], d["ends"], m, gid)[0],
    }


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


def time_ms(fn: Callable[[], Any], reps: int, warmup: int = 2) -> dict[str, float]:
    """Median wall and thread-CPU ms per call. Single-threaded torch, so thread CPU time is the
    work done and does not count time the process waited for a core on a shared machine."""
    return time_interleaved({"f": fn}, reps, warmup)["f"]


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_interleaved(fns: dict[str, Callable[[], Any]], reps: int,
                     warmup: int = 2) -> dict[str, dict[str, float]]:
    """Median wall / CPU ms per call of several functions timed in alternation, so load from
    other processes hits all of them alike (fair ratios); also the mean minor page faults per
    call (fresh pages touched: memory the allocator had handed back to the OS), which on this
    box cost ~2 us each and are the main source of run-to-run noise."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    faults: dict[str, int] = dict.fromkeys(fns, 0)
    for _ in range(reps):
        for name, fn in fns.items():
            f0 = _minor_faults()
            w0, c0 = _clock()
            fn()
            w1, c1 = _clock()
            faults[name] += _minor_faults() - f0
            wall[name].append((w1 - w0) * 1e3)
            cpu[name].append((c1 - c0) * 1e3)
    return {k: {"wall_ms": statistics.median(wall[k]), "cpu_ms": statistics.median(cpu[k]),
                "minor_faults_per_call": faults[k] / max(reps, 1)} for k in fns}


def keep_freed_memory() -> dict[str, Any]:
    """Ask glibc malloc to keep freed memory (no trimming of the heap top, no mmap for blocks
    up to 32 MiB), as a caching allocator (PyTorch's on GPU) does: every call then reuses
    pages instead of faulting fresh ones in. Applies to all timed functions alike."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = bool(libc.mallopt(m_trim_threshold, 1 << 30)) and \
            bool(libc.mallopt(m_mmap_threshold, 32 << 20))
    except OSError as e:
        return {"keep_freed_memory": False, "error": str(e)}
    return {"keep_freed_memory": ok, "mallopt": {"M_TRIM_THRESHOLD": 1 << 30,
                                                  "M_MMAP_THRESHOLD": 32 << 20}}


def max_diff(got: Any, want: Any) -> float:
    got = got.double() if isinstance(got, torch.Tensor) else torch.tensor(got, dtype=torch.float64)
    want = want.double() if isinstance(want, torch.Tensor) else torch.tensor(want, dtype=torch.float64)
    return float((got - want).abs().max())


def single_process(d: dict[str, torch.Tensor], reps: int) -> dict[str, dict[str, float]]:
    out = {}
    loops = loop_references(d)
    for name, fn in estimators(d, None).items():
        ours = time_ms(fn, reps)
        w0, c0 = _clock()
        want = loops[name]()
        w1, c1 = _clock()
        loop_cpu = (c1 - c0) * 1e3
        out[name] = {"ours_cpu_ms": round(ours["cpu_ms"], 3), "ours_wall_ms": round(ours["wall_ms"], 3),
                     "loop_reference_cpu_ms": round(loop_cpu, 1),
                     "loop_reference_wall_ms": round((w1 - w0) * 1e3, 1),
                     "speedup_vs_loop_cpu": round(loop_cpu / ours["cpu_ms"], 1),
                     "max_abs_diff_vs_loop": max_diff(fn(), want)}
        print(f"  {name:16s} ours {ours['cpu_ms']:9.3f} ms   loop {loop_cpu:10.1f} ms   "
              f"diff {out[name]['max_abs_diff_vs_loop']:.2e}", flush=True)
    return out


def _dp_worker(rank: int, world: int, groups: int, n: int, tokens: int, reps: int) -> dict:
    torch.set_num_threads(1)
    d = make_batch(groups, n, tokens)
    b = d["outcome"].shape[0]
    perm = torch.randperm(b, generator=torch.Generator().manual_seed(1))
    mine = perm[rank::world]  # every group split over both ranks
    part = {k: v[mine] for k, v in d.items()}
    full = estimators(d, None)
    out = {}
    for name, fn in estimators(part, dist.group.WORLD).items():
        with count_collectives() as c:
            got = fn()
        diff = max_diff(got, full[name]()[mine])
        out[name] = {**time_ms(fn, reps), "collectives": c.n, "max_abs_diff_vs_single": diff}
    return out


def dp2(groups: int, n: int, tokens: int, reps: int, single: dict) -> dict[str, dict[str, float]]:
    ranks = run_distributed(_dp_worker, 2, groups, n, tokens, reps, timeout=1800)
    out = {}
    for name in ranks[0]:
        wall = max(r[name]["wall_ms"] for r in ranks)
        cpu = max(r[name]["cpu_ms"] for r in ranks)
        out[name] = {"ours_wall_ms_slowest_rank": round(wall, 3), "ours_cpu_ms_slowest_rank": round(cpu, 3),
                     "collectives_per_call": ranks[0][name]["collectives"],
                     "max_abs_diff_vs_single_process": max(r[name]["max_abs_diff_vs_single"] for r in ranks),
                     "cpu_vs_single_process_ratio": round(cpu / single[name]["ours_cpu_ms"], 2)}
        print(f"  {name:16s} DP=2 wall {wall:9.3f} ms cpu {cpu:9.3f} ms  collectives "
              f"{out[name]['collectives_per_call']}", flush=True)
    return out


def verl_comparison(d: dict[str, torch.Tensor], reps: int) -> dict[str, Any]:
    try:
        import numpy as np
        import verl
        from verl.trainer.ppo import core_algos as ca
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return {"available": False, "error": f"{type(e).__name__}: {e}"}
    o, gid, m = d["outcome"], d["group_ids"], d["mask"]
    rewards = torch.zeros_like(m)
    last = (m.sum(1) - 1).long()
    rewards[torch.arange(m.shape[0]), last] = o           # outcome on the last token, as verl
    index = np.array(gid.tolist())
    ours = {
        "grpo": lambda: A.grpo(rewards.sum(-1), gid)[:, None] * m,
        "rloo": lambda: A.rloo(rewards.sum(-1), gid)[:, None] * m,
    }
    theirs = {
        "grpo": {"loop": lambda: ca.compute_grpo_outcome_advantage(rewards, m, index)[0],
                 "vectorized": lambda: ca.compute_grpo_vectorized_outcome_advantage(rewards, m, index)[0]},
        "rloo": {"loop": lambda: ca.compute_rloo_outcome_advantage(rewards, m, index)[0],
                 "vectorized": lambda: ca.compute_rloo_vectorized_outcome_advantage(rewards, m, index)[0]},
    }
    # The estimator proper, without the [B, T] token sum and broadcast that both sides share:
    # verl's vectorised GRPO body (as_torch_index + group_mean_std + z-score, eps on the std).
    scores = rewards.sum(-1)

    def verl_grpo_sequence() -> torch.Tensor:
        g = ca.as_torch_index(index, device=scores.device)
        mean_g, std_g, _ = ca.group_mean_std(scores, g, eps=0.0, device=scores.device)
        return (scores - mean_g[g]) / (std_g[g] + 1e-6)

    ours["grpo_sequence"] = lambda: A.grpo(scores, gid)
    theirs["grpo_sequence"] = {"vectorized": verl_grpo_sequence}
    reps = max(reps, 200)  # sub-millisecond calls: many interleaved samples for a stable median
    out: dict[str, Any] = {"available": True, "version": verl.__version__,
                           "timing": f"median of {reps} interleaved calls (ours, verl vectorized); "
                                     "loop timed apart",
                           "grpo_sequence_note": "sequence-level scores [B] -> advantages [B]; "
                                                 "verl side = body of compute_grpo_vectorized_"
                                                 "outcome_advantage without the token sum/broadcast"}
    for name, fn in ours.items():
        ms = time_interleaved({"ours": fn, "vectorized": theirs[name]["vectorized"]}, reps)
        if "loop" not in theirs[name]:
            res = {"ours_cpu_ms": round(ms["ours"]["cpu_ms"], 3),
                   "ours_wall_ms": round(ms["ours"]["wall_ms"], 3),
                   "verl_vectorized_cpu_ms": round(ms["vectorized"]["cpu_ms"], 3),
                   "verl_vectorized_wall_ms": round(ms["vectorized"]["wall_ms"], 3),
                   "ratio_ours_over_verl_vectorized_cpu":
                       round(ms["ours"]["cpu_ms"] / ms["vectorized"]["cpu_ms"], 3),
                   "ratio_ours_over_verl_vectorized_wall":
                       round(ms["ours"]["wall_ms"] / ms["vectorized"]["wall_ms"], 3),
                   "max_abs_diff_vs_verl_vectorized": max_diff(fn(), verl_grpo_sequence())}
            out[name] = res
            print(f"  {name}: ours {res['ours_cpu_ms']:.3f} ms, verl vectorized "
                  f"{res['verl_vectorized_cpu_ms']:.3f} ms, ratio (cpu) "
                  f"{res['ratio_ours_over_verl_vectorized_cpu']}", flush=True)
            continue
        ms["loop"] = time_interleaved({"loop": theirs[name]["loop"]}, max(3, reps // 10), warmup=1)["loop"]
        res: dict[str, Any] = {"ours_cpu_ms": round(ms["ours"]["cpu_ms"], 3),
                               "ours_wall_ms": round(ms["ours"]["wall_ms"], 3)}
        for kind, vfn in theirs[name].items():
            res[f"verl_{kind}_cpu_ms"] = round(ms[kind]["cpu_ms"], 3)
            res[f"verl_{kind}_wall_ms"] = round(ms[kind]["wall_ms"], 3)
            res[f"ratio_ours_over_verl_{kind}_cpu"] = round(ms["ours"]["cpu_ms"] / ms[kind]["cpu_ms"], 3)
            res[f"ratio_ours_over_verl_{kind}_wall"] = round(ms["ours"]["wall_ms"] / ms[kind]["wall_ms"], 3)
            res[f"max_abs_diff_vs_verl_{kind}"] = max_diff(fn(), vfn())
        out[name] = res
        print(f"  {name}: ours {res['ours_cpu_ms']:.3f} ms, verl loop {res['verl_loop_cpu_ms']:.1f} ms, "
              f"verl vectorized {res['verl_vectorized_cpu_ms']:.3f} ms, ratio ours/vectorized (cpu) "
              f"{res['ratio_ours_over_verl_vectorized_cpu']}", flush=True)
    return out


def token_level_vs_grpo(d: dict[str, torch.Tensor], reps: int, before_rev: str | None) -> dict:
    """PRIME and PURE against the token-level GRPO, interleaved in one loop (fair under load);
    with `before_rev`, also the estimators as they were at that git revision, same batch."""
    o, gid, m = d["outcome"], d["group_ids"], d["mask"]
    fns = {"grpo_token": lambda: A.grpo(o, gid)[:, None] * m,
           "prime": lambda: A.prime(o, d["logp_a"], d["logp_b"], m, gid),
           "pure": lambda: A.pure(o, d["step_scores"], d["step_mask"], d["ends"], m, gid)}
    out: dict[str, Any] = {}
    if before_rev:
        from megaprm.bench import load_module_at

        old = load_module_at(before_rev, "megaprm/algorithms/advantages.py", "advantages_before")
        fns["prime_before"] = lambda: old.prime(o, d["logp_a"], d["logp_b"], m, gid)
        fns["pure_before"] = lambda: old.pure(o, d["step_scores"], d["step_mask"], d["ends"], m, gid)
        for name in ("prime", "pure"):
            out[f"{name}_max_abs_diff_vs_before"] = max(
                max_diff(a, b) for a, b in zip(fns[name](), fns[f"{name}_before"]()))
        out["before_rev"] = before_rev
    ms = time_interleaved(fns, reps)
    base = ms["grpo_token"]["cpu_ms"]
    for name, t in ms.items():
        out[name] = {"cpu_ms": round(t["cpu_ms"], 3), "wall_ms": round(t["wall_ms"], 3),
                     "ratio_to_grpo_token_cpu": round(t["cpu_ms"] / base, 2),
                     "minor_faults_per_call": round(t["minor_faults_per_call"], 1)}
    for name in ("prime", "pure"):
        if f"{name}_before" in ms:
            out[name]["speedup_vs_before_cpu"] = round(
                ms[f"{name}_before"]["cpu_ms"] / ms[name]["cpu_ms"], 1)
    print("token level (interleaved): " + ", ".join(
        f"{k} {v['cpu_ms']:.2f} ms ({v['ratio_to_grpo_token_cpu']}x grpo_token)"
        for k, v in out.items() if isinstance(v, dict)), flush=True)
    return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    from megaprm.bench import default_out  # runs/bench/, or $MEGAPRM_BENCH_RESULTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=512)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=default_out("bench_advantages.json"))
    ap.add_argument("--before-rev", default=None,
                    help="git revision whose PRIME/PURE are timed next to the current ones")
    ap.add_argument("--skip-dp2", action="store_true", help="no DP=2 rows (recorded as missing)")
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="glibc malloc keeps freed memory (mallopt), so timed calls do not pay "
                         "page faults for memory handed back to the OS; recorded in the JSON")
    args = ap.parse_args()
    allocator = keep_freed_memory() if args.keep_freed_memory else {"keep_freed_memory": False}
    from megaprm.bench import load_average, write_result

    torch.set_num_threads(1)  # thread CPU time == work done; see time_ms
    d = make_batch(args.groups, args.n, args.tokens)
    print(f"batch {args.groups} groups x {args.n} = {d['outcome'].shape[0]} samples, "
          f"{args.tokens} tokens; torch threads {torch.get_num_threads()}", flush=True)
    print("single process:", flush=True)
    single = single_process(d, args.reps)
    print("verl:", flush=True)
    verl = verl_comparison(d, args.reps)
    print("token level vs GRPO:", flush=True)
    token_level = token_level_vs_grpo(d, args.reps, args.before_rev)
    dp = None
    if not args.skip_dp2:
        print("DP=2 (gloo):", flush=True)
        dp = dp2(args.groups, args.n, args.tokens, args.reps, single)
    result = {
        "benchmark": "advantage estimators, time per call (median)",
        "timing_note": "torch single-threaded; cpu_ms is thread CPU time per call, robust to other "
                       "processes sharing the 2-core CI box (wall_ms is also recorded); ratios on cpu_ms",
        "device": {"kind": "cpu", "cpu": cpu_name(), "cores": os.cpu_count(),
                   "torch_threads": 1, "load_average_at_end": list(os.getloadavg())},
        "load": load_average(),
        "torch": torch.__version__, "python": platform.python_version(),
        "allocator": allocator,
        "batch": {"groups": args.groups, "samples_per_group": args.n,
                  "samples": int(d["outcome"].shape[0]), "response_tokens": args.tokens,
                  "reps": args.reps},
        "single_process": single, "token_level_vs_grpo": token_level, "dp2_gloo": dp,
        "verl": verl,
    }
    missing = [k for k, absent in (("verl", not verl.get("available")), ("dp2_gloo", dp is None))
               if absent]
    print(f"wrote {write_result(args.out, result, missing=missing)}")


if __name__ == "__main__":
    main()
