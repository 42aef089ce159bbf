"""Benchmark: Megatron actor -> HF rollout engine weight sync, by bucket size and layout.

    python scripts/bench_weight_sync.py [--out runs/bench/bench_weight_sync.json]

A Qwen2-shaped model (hidden 1024, 12 layers, vocab 32000, fp32: ~670 MB) on 2 local ranks at
(tp, pp) = (1, 1) (dp 2) and (2, 1). Each rank syncs into its own HFEngine; for each bucket size we
time 5 syncs (after a warm-up), round-robin over the modes so that load from other processes hits
every mode alike: wall seconds (min and median), process CPU seconds (all threads, gloo's included;
robust to a loaded machine), GB/s of HF bytes delivered (at the min wall time), buckets,
collectives, the RSS growth over the pre-sync baseline (peak sampled every 2 ms), and the ratio to
a plain memcpy (`Tensor.copy_` between two preallocated buffers of the same number of bytes,
one more mode of the same round-robin, in the same process). The
unbucketed `iter_hf_weights` (one collective per tensor) is the baseline row "per-tensor".
The "bucket" rows use the transport `sync_weights` picks ("auto": at tp > 1 on one host, the
shared-memory buffer); at tp > 1 the "gloo bucket" rows force the all-gather path
(`transport="collective"`) at the same bucket sizes. At tp > 1 two more rows time the backend's
bare all-gather of the same bytes (4 MiB slices as the
sync issues them on gloo, and one call): `ratio_to_raw_allgather` is the share of what the
collective itself can move that the whole sync (pack, gather, reorder, engine copy) delivers.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import threading
import time

import torch

HF_CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 32000,
                 "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12,
                 "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 2048,
                 "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True}
BUCKET_MB = (4, 16, 64, 256, 1024)
LAYOUTS = ((1, 1), (2, 1))
REPEATS = 5


class PeakRSS:
    """Peak resident set size of this process while the block runs, sampled by a thread."""

    def __init__(self, interval_s: float = 0.002):
        import psutil

        self.proc, self.interval, self.peak = psutil.Process(), interval_s, 0

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self):
        self.base = self.proc.memory_info().rss
        self.peak, self._stop = self.base, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def _per_tensor_sync(model, groups, engine):
    """The unbucketed reference path (`iter_hf_weights`), timed like `sync_weights`."""
    from megaprm.rollout.weight_sync import iter_hf_weights

    nbytes = 0

    def stream():
        nonlocal nbytes
        for name, t in iter_hf_weights(model, groups):
            nbytes += t.numel() * t.element_size()
            yield name, t

    engine.load_weights(stream())
    return nbytes


def _memcpy(nbytes: int):
    """A plain copy of `nbytes` between two preallocated buffers (the speed-of-light row)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)

    def run():
        dst.copy_(src)
        return {"bytes": nbytes, "collectives": 0}

    return run


def _raw_gather(nbytes: int, groups, *, sliced: bool):
    """A bare tp all-gather delivering `nbytes` to every rank (each rank sends nbytes / tp) into
    a preallocated [tp, n] buffer: in 4 MiB slices as the sync issues it on gloo
    (`weight_sync._gather`), or as one `all_gather_into_tensor` call. The sync's ceiling."""
    from megaprm.rollout import weight_sync

    tp = groups.tp_size
    n = nbytes // 4 // tp
    local = torch.ones(n, dtype=torch.float32)
    gathered = torch.empty(tp, n, dtype=torch.float32)

    def run():
        if sliced:
            weight_sync._gather(gathered, local, groups.tp)
        else:
            weight_sync._all_gather_flat(gathered.view(-1), local, group=groups.tp)
        return {"bytes": tp * n * 4, "collectives": -(-n * 4 // weight_sync.GLOO_SLICE_BYTES)
                if sliced else 1}

    return run


def _rank(tp: int, pp: int, before_rev: str | None = None, repeats: int = REPEATS) -> dict:
    import torch.distributed as dist
    import transformers as tf

    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.actor import build_stage
    from megaprm.parallel.init import init_distributed
    from megaprm.rollout import weight_sync
    from megaprm.rollout.hf_engine import HFEngine

    g = init_distributed(tp=tp, pp=pp)
    spec = spec_from_hf(HF_CONFIG)
    model = build_stage(spec, g)
    engine = HFEngine.from_config(tf.Qwen2Config(**HF_CONFIG), seed=g.rank)
    n_split = sum(1 for r, _ in weight_sync._own_params(model, spec, g) if r.tp_dim is not None)

    auto = weight_sync._transport("auto", g, torch.device("cpu")) if tp * pp > 1 else "none"

    def bucketed(mb, transport="auto"):
        s = weight_sync.sync_weights(model, g, engine, bucket_bytes=mb << 20, transport=transport)
        shm = tp * pp > 1 and (transport == "shm" or transport == "auto" and auto == "shm")
        return {"bytes": s.bytes, "num_buckets": s.num_buckets,
                "peak_bucket_bytes": s.peak_bucket_bytes, "transport": transport,
                # one all-gather per bucket; shared memory: two barriers, no bytes on the wire
                "collectives": 0 if tp == 1 else 2 * s.num_buckets if shm else s.num_buckets}

    def per_tensor():  # one all-gather per tp-split parameter
        return {"bytes": _per_tensor_sync(model, g, engine),
                "collectives": n_split if tp > 1 else 0}

    modes = [(f"bucket {mb} MiB", lambda mb=mb: bucketed(mb)) for mb in BUCKET_MB]
    if auto == "shm":  # the gloo all-gather path at the same bucket sizes, same run
        modes += [(f"gloo bucket {mb} MiB", lambda mb=mb: bucketed(mb, "collective"))
                  for mb in BUCKET_MB]
    modes.append(("per-tensor", per_tensor))
    if before_rev:  # the bucketed sync as it was at that revision, same run, same engine
        import subprocess

        from megaprm.bench import ROOT, load_module_at

        # rollout/weight_sync.py was parallel/weight_sync.py in older revisions
        here = "megaprm/rollout/weight_sync.py"
        if subprocess.run(["git", "cat-file", "-e", f"{before_rev}:{here}"], cwd=ROOT,
                          capture_output=True).returncode:
            here = "megaprm/parallel/weight_sync.py"
        old = load_module_at(before_rev, here, "weight_sync_before")

        def before(mb):
            st = old.sync_weights(model, g, engine, bucket_bytes=mb << 20)
            return {"bytes": st.bytes, "num_buckets": st.num_buckets,
                    "peak_bucket_bytes": st.peak_bucket_bytes,
                    "collectives": st.num_buckets if tp > 1 else 0}

        modes += [(f"before {mb} MiB", lambda mb=mb: before(mb)) for mb in (BUCKET_MB[0], BUCKET_MB[-1])]
    nbytes_hf = bucketed(BUCKET_MB[-1])["bytes"]
    if tp > 1:  # what the backend itself moves: the same bytes, no packing, no reorder, no engine
        modes += [("raw all-gather sliced", _raw_gather(nbytes_hf, g, sliced=True)),
                  ("raw all-gather one call", _raw_gather(nbytes_hf, g, sliced=False))]
    modes.append(("memcpy", _memcpy(nbytes_hf)))
    samples = {label: [] for label, _ in modes}
    info = {}
    # round-robin over modes, so load from other processes hits every mode alike
    for rep in range(repeats + 1):
        for label, fn in modes:
            dist.barrier()
            with PeakRSS() as rss:
                wall, cpu = time.perf_counter(), time.process_time()
                info[label] = fn()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if rep:  # rep 0 is the warm-up (allocator, first touch of the engine's pages)
                samples[label].append((wall, cpu, rss.growth_mb))
    rows = []
    for label, _ in modes:
        wall = [w for w, _, _ in samples[label]]
        nbytes = info[label]["bytes"]
        rows.append(dict(mode=label, **info[label], seconds_min=min(wall),
                         seconds_median=statistics.median(wall),
                         cpu_seconds_median=statistics.median(c for _, c, _ in samples[label]),
                         gbytes_per_s=nbytes / min(wall) / 1e9,
                         rss_growth_mb=max(m for _, _, m in samples[label])))

    memcpy, memcpy_cpu = rows[-1]["gbytes_per_s"], rows[-1]["cpu_seconds_median"]
    raw = [r["gbytes_per_s"] for r in rows if r["mode"].startswith("raw all-gather")]
    for r in rows:
        if raw:  # the best the backend's all-gather moved in this run
            r["raw_allgather_gbytes_per_s"] = max(raw)
            r["ratio_to_raw_allgather"] = r["gbytes_per_s"] / max(raw)
        r["memcpy_gbytes_per_s"] = memcpy
        r["ratio_to_memcpy"] = r["gbytes_per_s"] / memcpy
        # CPU-time ratio: what the sync costs in memcpys, insensitive to other processes' load
        r["cpu_cost_in_memcpys"] = r["cpu_seconds_median"] / memcpy_cpu
    import psutil

    return {"rank": g.rank, "tp": tp, "pp": pp, "dp": g.dp_size, "rows": rows,
            "transport_auto": auto,
            "rss_mb": psutil.Process().memory_info().rss / 2**20,
            "megatron_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def main():
    from megaprm.bench import default_out  # runs/bench/, or $MEGAPRM_BENCH_RESULTS
    from megaprm.parallel import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=default_out("bench_weight_sync.json"))
    ap.add_argument("--before-rev", default=None,
                    help="git revision whose bucketed sync is timed too (rows 'before N MiB')")
    ap.add_argument("--repeats", type=int, default=REPEATS, help="timed syncs per mode")
    args = ap.parse_args()
    from megaprm.bench import load_average, write_result

    results = []
    for tp, pp in LAYOUTS:
        per_rank = launch.spawn(_rank, 2, tp, pp, args.before_rev, args.repeats, timeout_s=1800)
        r0 = per_rank[0]
        for i, row in enumerate(r0["rows"]):  # the slowest rank's time is the sync's time
            row["seconds_min_max_over_ranks"] = max(r["rows"][i]["seconds_min"] for r in per_rank)
            row["rss_growth_mb_max_over_ranks"] = max(r["rows"][i]["rss_growth_mb"]
                                                      for r in per_rank)
        results.append(r0)
        print(f"tp={tp} pp={pp} dp={r0['dp']} ({r0['megatron_param_bytes'] / 2**20:.0f} MiB of "
              f"Megatron params per rank; process RSS {r0['rss_mb']:.0f} MiB)")
        for row in r0["rows"]:
            print(f"  {row['mode']:>16}: {row['seconds_min']:.3f} s (median "
                  f"{row['seconds_median']:.3f}, cpu {row['cpu_seconds_median']:.3f})  "
                  f"{row['gbytes_per_s']:.2f} GB/s  "
                  f"x{row['ratio_to_memcpy']:.2f} memcpy ({row['memcpy_gbytes_per_s']:.2f} GB/s)  "
                  + (f"x{row['ratio_to_raw_allgather']:.2f} raw all-gather  "
                     if "ratio_to_raw_allgather" in row else "")
                  + f"buckets {row.get('num_buckets', '-')}  collectives {row['collectives']}  "
                  f"RSS +{row['rss_growth_mb']:.0f} MiB")
    out = {
        "model": HF_CONFIG, "hf_bytes": results[0]["rows"][0]["bytes"], "world_size": 2,
        "repeats": args.repeats, "torch": torch.__version__, "machine": platform.machine(),
        "cpus": os.cpu_count(), "load_average_at_end": os.getloadavg(), "load": load_average(),
        "before_rev": args.before_rev,
        "threads_per_rank": max(1, (os.cpu_count() or 1) // 2),
        "backend": "gloo" if not torch.cuda.is_available() else "nccl", "layouts": results}
    print(f"wrote {write_result(args.out, out)}")


if __name__ == "__main__":
    main()
