"""checkpoint_tools import/export throughput and peak RSS vs raw safetensors read+write.

A Qwen2-shaped model of a few hundred MB (fp32) is saved in the HF format; then, each in its own
process so that peak RSS is per phase:

  raw       safetensors load_file + save_file of the same bytes (the floor: one read, one write)
  import    python -m checkpoint_tools import-hf  (HF -> Megatron distributed checkpoint)
  export    python -m checkpoint_tools export-hf  (-> HF safetensors shards)

Throughput = weight bytes / seconds. "end_to_end" includes process start-up and imports of the
CLI (what a user waits for); "core" is the conversion proper, as the tool's report times it.
Writes scripts/results/bench_convert.json.

    python scripts/bench_convert.py [--layers 10] [--hidden 1024] [--tp 1 --pp 1]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "scripts", "results", "bench_convert.json")


def _phase_make(out_dir: str, layers: int, hidden: int, ffn: int, vocab: int) -> dict:
    from megaprm.models.tiny import build_hf_model, tiny_config

    cfg = tiny_config("qwen2", vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                      num_heads=hidden // 64, num_kv_heads=max(1, hidden // 256),
                      intermediate_size=ffn)
    model = build_hf_model(cfg, seed=0)
    model.save_pretrained(out_dir, max_shard_size="50GB")  # one file: the raw baseline's input
    return {"params": sum(p.numel() for p in model.parameters())}


def _phase_raw(src_dir: str, dst_dir: str) -> dict:
    from safetensors.torch import load_file, save_file

    os.makedirs(dst_dir, exist_ok=True)
    t0 = time.perf_counter()
    sd = load_file(os.path.join(src_dir, "model.safetensors"))
    t_read = time.perf_counter() - t0
    save_file(sd, os.path.join(dst_dir, "model.safetensors"), metadata={"format": "pt"})
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "read_s": t_read, "write_s": seconds - t_read,
            "bytes": sum(t.numel() * t.element_size() for t in sd.values()),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}


def _in_child(phase: str, *args) -> dict:
    """Run one phase in a fresh interpreter (own peak RSS); returns its JSON result."""
    r = subprocess.run([sys.executable, "-W", "ignore", __file__, "--phase", phase, *args],
                       cwd=REPO, capture_output=True, text=True, check=False)
    if r.returncode:
        raise RuntimeError(f"phase {phase} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _cli(*args) -> tuple:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "checkpoint_tools", *args],
                       cwd=REPO, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise RuntimeError(f"checkpoint_tools {args[0]} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout), wall


def _machine() -> dict:
    import psutil
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gb": round(psutil.virtual_memory().total
                                                                  / 2**30, 1),
            "gpu": None, "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "load_avg_1m_at_start": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=["make", "raw"])
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dirs", nargs="*")
    p.add_argument("--out", default=OUT)
    a = p.parse_args()
    from megaprm.bench import load_average, write_result

    if a.phase == "make":
        print(json.dumps(_phase_make(a.dirs[0], a.layers, a.hidden, a.ffn, a.vocab)))
        return
    if a.phase == "raw":
        print(json.dumps(_phase_raw(*a.dirs)))
        return

    machine = _machine()
    work = tempfile.mkdtemp(prefix="bench_convert-")
    try:
        hf, ck, out = (os.path.join(work, n) for n in ("hf", "ckpt", "export"))
        made = _in_child("make", "--layers", str(a.layers), "--hidden", str(a.hidden),
                         "--ffn", str(a.ffn), "--vocab", str(a.vocab), "--dirs", hf)
        raw = [_in_child("raw", "--dirs", hf, os.path.join(work, f"raw{i}")) for i in range(2)]
        imp, imp_wall = _cli("import-hf", "--hf", hf, "--out", ck, "--tp", str(a.tp),
                             "--pp", str(a.pp), "--no-verify")
        exp, exp_wall = _cli("export-hf", "--ckpt", ck, "--out", out, "--no-verify",
                             "--max-shard-size", "200MB")
        ver, ver_wall = _cli("verify", "--hf", out, "--ckpt", ck, "--tp", str(a.tp),
                             "--pp", str(a.pp))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    before = None
    if os.path.isfile(a.out):  # the result this run replaces, for the before/after columns
        with open(a.out, encoding="utf-8") as f:
            old = json.load(f)
        before = {"machine_load_1m": [old.get("machine", {}).get("load_avg_1m_at_start"),
                                      old.get("machine", {}).get("load_avg_1m_at_end")],
                  **{side: {k: old.get(side, {}).get(k) for k in
                            ("end_to_end_s", "core_s", "raw_over_core_ratio")}
                     for side in ("import_hf", "export_hf")},
                  "raw_safetensors_s": old.get("raw_safetensors", {}).get("seconds")}
    nbytes = raw[0]["bytes"]
    raw_s = min(r["seconds"] for r in raw)
    gbps = lambda s: nbytes / s / 1e9
    imp_core, exp_core = imp["read_s"] + imp["save_s"], exp["load_s"] + exp["write_s"]
    result = {
        "machine": {**machine, "load_avg_1m_at_end": os.getloadavg()[0]},
        "model": {"family": "qwen2", "layers": a.layers, "hidden": a.hidden, "ffn": a.ffn,
                  "vocab": a.vocab, "params": made["params"], "dtype": "fp32",
                  "weight_bytes": nbytes, "weight_mb": round(nbytes / 1e6, 1)},
        "layout": {"tp": a.tp, "pp": a.pp},
        "raw_safetensors": {"seconds": raw_s, "GBps": gbps(raw_s),
                            "peak_rss_mb": max(r["peak_rss_mb"] for r in raw),
                            "runs_s": [r["seconds"] for r in raw]},
        "import_hf": {"end_to_end_s": imp_wall, "end_to_end_GBps": gbps(imp_wall),
                      "core_s": imp_core, "core_GBps": gbps(imp_core),
                      "read_s": imp["read_s"], "dist_ckpt_save_s": imp["save_s"],
                      "peak_rss_mb": imp["peak_rss_mb"],
                      "raw_over_core_ratio": gbps(raw_s) / gbps(imp_core)},
        "export_hf": {"end_to_end_s": exp_wall, "end_to_end_GBps": gbps(exp_wall),
                      "core_s": exp_core, "core_GBps": gbps(exp_core),
                      "dist_ckpt_load_s": exp["load_s"], "gather_and_write_s": exp["write_s"],
                      "shards": len(exp["files"]), "peak_shard_mb": exp["peak_shard_bytes"] / 1e6,
                      "peak_rss_mb": exp["peak_rss_mb"],
                      "raw_over_core_ratio": gbps(raw_s) / gbps(exp_core)},
        "verify_after_roundtrip": {k: ver[k] for k in ("max_abs_diff", "top1_agreement",
                                                       "passed")},
        "verify_command": {"end_to_end_s": ver_wall},
        "load": load_average(),
        "before": before,
        "notes": "ratios > 1: the tool is that many times slower than one raw safetensors "
                 "read+write of the same bytes. Peak RSS per rank includes the rank's model "
                 "stage (the whole model at tp=pp=1), the touched mmap pages of the input, "
                 "and the Python/torch/megatron baseline (~390 MB for a tiny model).",
    }
    print(json.dumps(result, indent=2))
    print(f"wrote {write_result(a.out, result)}")


if __name__ == "__main__":
    main()
