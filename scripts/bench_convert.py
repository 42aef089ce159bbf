"""checkpoint_tools import/export throughput and peak RSS vs raw safetensors read+write.

A Qwen2-shaped model of a few hundred MB (fp32) is saved in the HF format; then, each in its own
process so that peak RSS is per phase:

  raw       safetensors load_file + save_file of the same bytes (the floor: one read, one write)
  import    python -m checkpoint_tools import-hf  (HF -> Megatron distributed checkpoint)
  export    python -m checkpoint_tools export-hf  (-> HF safetensors shards)

Throughput = weight bytes / seconds. "end_to_end" includes process start-up and imports of the
CLI (what a user waits for); "core" is the conversion proper, as the tool's report times it.
Writes runs/bench/bench_convert.json (`megaprm bench --update-results`: scripts/results/).

    python scripts/bench_convert.py [--layers 10] [--hidden 1024] [--tp 1 --pp 1] [--repeats 3]
    python scripts/bench_convert.py --layers 12 --hidden 2048 --ffn 5632 --vocab 32000 \
        --out scripts/results/bench_convert_2gb.json      # the >= 2 GB model
    python scripts/bench_convert.py --family qwen3_moe --layers 4 --experts 16 --ffn 1024 \
        --ep 2 --out scripts/results/bench_convert_moe.json   # a ~1 GB Qwen3-MoE at ep2

With --family qwen3_moe, --ffn is each expert's width (moe_intermediate_size), --experts their
number (2 per token), and import-hf / verify run at --ep ranks per stage (tp*pp*ep in all).
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


def _phase_make(out_dir: str, layers: int, hidden: int, ffn: int, vocab: int,
                family: str = "qwen2", experts: int = 0) -> dict:
    from megaprm.models.tiny import build_hf_model, tiny_config

    heads = dict(num_heads=hidden // 64, num_kv_heads=max(1, hidden // 256))
    if family == "qwen3_moe":
        import transformers as tf

        cfg = tf.Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                num_attention_heads=heads["num_heads"], head_dim=64,
                                num_key_value_heads=heads["num_kv_heads"],
                                intermediate_size=ffn, moe_intermediate_size=ffn,
                                num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True,
                                tie_word_embeddings=False)
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    else:
        cfg = tiny_config("qwen2", vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                          intermediate_size=ffn, **heads)
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


def _phase_baseline() -> dict:
    """Peak RSS of an interpreter holding what a conversion imports, with no model: the
    'interpreter baseline' of the peak-RSS target."""
    t0 = time.perf_counter()
    from checkpoint_tools.__main__ import lean_imports

    lean_imports()  # as the CLI imports (megatron.core's dist_checkpointing and models.gpt)
    import safetensors.torch  # noqa: F401

    import checkpoint_tools.convert  # noqa: F401
    import megaprm.parallel.pipeline  # noqa: F401
    return {"import_s": time.perf_counter() - t0,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}


def _largest_tensor_bytes(hf_dir: str) -> int:
    from safetensors import safe_open

    big = 0
    for f in os.listdir(hf_dir):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, f), framework="pt") as h:
                for k in h.keys():  # noqa: SIM118
                    sl = h.get_slice(k)
                    n = 1
                    for d in sl.get_shape():
                        n *= d
                    big = max(big, n * {"F32": 4, "BF16": 2, "F16": 2}.get(sl.get_dtype(), 4))
    return big


def _largest_file(d: str, suffixes: tuple) -> int:
    return max((os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs
                if f.endswith(suffixes)), default=0)


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def main() -> None:
    from megaprm.bench import default_out  # runs/bench/, or $MEGAPRM_BENCH_RESULTS

    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=["make", "raw", "baseline"])
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--family", choices=["qwen2", "qwen3_moe"], default="qwen2")
    p.add_argument("--experts", type=int, default=16, help="qwen3_moe: experts per layer")
    p.add_argument("--ep", type=int, default=1, help="qwen3_moe: expert parallelism")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds of (raw, import, export), interleaved so that disk write-back "
                        "and other processes' load hit every row alike; min and median kept")
    p.add_argument("--dirs", nargs="*")
    p.add_argument("--work", default=None, help="scratch dir (default: a new tmp dir)")
    p.add_argument("--out", default=default_out("bench_convert.json"))
    a = p.parse_args()
    from megaprm.bench import load_average, write_result

    if a.phase == "make":
        print(json.dumps(_phase_make(a.dirs[0], a.layers, a.hidden, a.ffn, a.vocab, a.family,
                                     a.experts)))
        return
    if a.phase == "raw":
        print(json.dumps(_phase_raw(*a.dirs)))
        return
    if a.phase == "baseline":
        print(json.dumps(_phase_baseline()))
        return

    machine = _machine()
    work = tempfile.mkdtemp(prefix="bench_convert-", dir=a.work)
    raw, imps, exps = [], [], []
    try:
        hf, ck, out = (os.path.join(work, n) for n in ("hf", "ckpt", "export"))
        made = _in_child("make", "--layers", str(a.layers), "--hidden", str(a.hidden),
                         "--ffn", str(a.ffn), "--vocab", str(a.vocab), "--family", a.family,
                         "--experts", str(a.experts), "--dirs", hf)
        baseline = [_in_child("baseline") for _ in range(2)]
        largest_tensor = _largest_tensor_bytes(hf)
        largest_in_shard = _largest_file(hf, (".safetensors",))
        raw_out = os.path.join(work, "raw")
        for _ in range(a.repeats):
            # Each phase deletes its own previous output just before it runs, so that every
            # row writes into memory the kernel has just freed (the same size each time). On
            # the 2-core development VM, page cache grown into memory that has been free for a while costs
            # ~2.5 s/GB (host faults) against ~0.25 s/GB for just-freed pages: a phase that ran
            # after another's delete and one that did not differed by up to 5x.
            shutil.rmtree(raw_out, ignore_errors=True)
            raw.append(_in_child("raw", "--dirs", hf, raw_out))
            shutil.rmtree(ck, ignore_errors=True)
            imps.append(_cli("import-hf", "--hf", hf, "--out", ck, "--tp", str(a.tp),
                             "--pp", str(a.pp), "--ep", str(a.ep), "--no-verify"))
            shutil.rmtree(out, ignore_errors=True)
            exps.append(_cli("export-hf", "--ckpt", ck, "--out", out, "--no-verify",
                             "--max-shard-size", "200MB"))
        largest_ckpt_file = _largest_file(ck, (".distcp",))
        largest_out_shard = _largest_file(out, (".safetensors",))
        # the verification, timed apart: the conversion's own check, then the `verify` command
        shutil.rmtree(ck, ignore_errors=True)
        imp_v, imp_v_wall = _cli("import-hf", "--hf", hf, "--out", ck, "--tp", str(a.tp),
                                 "--pp", str(a.pp), "--ep", str(a.ep))
        ver, ver_wall = _cli("verify", "--hf", out, "--ckpt", ck, "--tp", str(a.tp),
                             "--pp", str(a.pp), "--ep", str(a.ep))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    before = None
    if os.path.isfile(a.out):  # the result this run replaces, for the before/after columns
        with open(a.out, encoding="utf-8") as f:
            old = json.load(f)
        before = {"load": old.get("load"),
                  "model_mb": old.get("model", {}).get("weight_mb"),
                  **{side: {k: old.get(side, {}).get(k) for k in
                            ("end_to_end_s", "core_s", "raw_over_core_ratio", "core_over_raw",
                             "end_to_end_minus_core_s", "read_s", "save_s", "load_s",
                             "write_s", "peak_rss_mb", "peak_rss_target_mb")}
                     for side in ("import_hf", "export_hf")},
                  "raw_safetensors_s": old.get("raw_safetensors", {}).get("seconds"),
                  "interpreter_baseline": old.get("interpreter_baseline")}
    nbytes = raw[0]["bytes"]
    raw_min = min(r["seconds"] for r in raw)
    raw_med = _median([r["seconds"] for r in raw])
    def gbps(s):
        return nbytes / s / 1e9
    base_mb = min(b["peak_rss_mb"] for b in baseline)
    import_s = min(b["import_s"] for b in baseline)

    def side(runs, parts, shard_bytes, extra):
        core = [sum(r[k] for k in parts) for r, _ in runs]
        walls = [w for _, w in runs]
        rss = max(max(r["peak_rss_mb"]["ranks"]) for r, _ in runs)
        target = shard_bytes / 2**20 + 2 * largest_tensor / 2**20 + base_mb
        i = core.index(min(core))
        return {"core_s": min(core), "core_s_median": _median(core), "core_s_runs": core,
                "core_GBps": gbps(min(core)),
                "core_over_raw": min(core) / raw_min,
                "core_over_raw_median": _median(core) / raw_med,
                "raw_over_core_ratio": min(core) / raw_min,  # (old name, same value)
                "end_to_end_s": min(walls), "end_to_end_s_runs": walls,
                "end_to_end_minus_core_s": min(w - c for w, c in zip(walls, core)),
                "end_to_end_GBps": gbps(min(walls)),
                **{k: runs[i][0][k] for k in parts},
                **{k: runs[i][0].get(k) for k in extra},
                "peak_rss_mb": rss,
                "peak_rss_target_mb": target,
                "peak_rss_target_terms_mb": {"largest_shard": shard_bytes / 2**20,
                                             "two_largest_tensors": 2 * largest_tensor / 2**20,
                                             "interpreter_baseline": base_mb},
                "peak_rss_within_target": rss <= target,
                "core_within_2x_raw": min(core) <= 2 * raw_min,
                "end_to_end_within_core_plus_5s": min(walls) <= min(core) + 5.0}

    imp = side(imps, ("read_s", "save_s"), largest_in_shard, ())
    exp = side(exps, ("load_s", "write_s"), max(largest_out_shard, largest_ckpt_file),
               ("files", "peak_shard_bytes", "streamed"))
    result = {
        "machine": {**machine, "load_avg_1m_at_end": os.getloadavg()[0]},
        "model": {"family": a.family, "experts": a.experts if a.family != "qwen2" else 0,
                  "layers": a.layers, "hidden": a.hidden, "ffn": a.ffn,
                  "vocab": a.vocab, "params": made["params"], "dtype": "fp32",
                  "weight_bytes": nbytes, "weight_mb": round(nbytes / 1e6, 1),
                  "largest_tensor_mb": largest_tensor / 2**20,
                  "largest_input_shard_mb": largest_in_shard / 2**20},
        "layout": {"tp": a.tp, "pp": a.pp, "ep": a.ep},
        "repeats": a.repeats,
        "raw_safetensors": {"seconds": raw_min, "seconds_median": raw_med, "GBps": gbps(raw_min),
                            "peak_rss_mb": max(r["peak_rss_mb"] for r in raw),
                            "runs_s": [r["seconds"] for r in raw]},
        "interpreter_baseline": {"peak_rss_mb": base_mb, "import_s": import_s,
                                 "what": "checkpoint_tools.convert + megatron.core "
                                         "(dist_checkpointing, models.gpt) + megaprm.parallel "
                                         "imported, no model"},
        "import_hf": imp,
        "export_hf": exp,
        "verification": {"import_hf_with_verify_end_to_end_s": imp_v_wall,
                         "import_hf_verify": imp_v["verify"],
                         "flag_to_skip": "--no-verify (the report then says "
                                         "verify.skipped=true)",
                         "verify_command_end_to_end_s": ver_wall,
                         "after_roundtrip": {k: ver[k] for k in ("max_abs_diff",
                                                                 "top1_agreement", "passed")}},
        "load": load_average(),
        "before": before,
        "notes": "core_over_raw > 1: the tool's conversion proper takes that many times one raw "
                 "safetensors read+write of the same bytes (min over the interleaved rounds; "
                 "_median likewise with medians). Writes go to the page cache (neither the raw "
                 "row nor the converter fsyncs). Peak RSS is ru_maxrss of each rank process "
                 "(the CLI's own report): anonymous memory plus the touched mmap pages of the "
                 "input; target = largest shard (import: the HF input file; export: the larger "
                 "of the .distcp files and the written HF shards) + 2 x largest tensor + the "
                 "interpreter baseline.",
    }
    print(json.dumps(result, indent=2))
    print(f"wrote {write_result(a.out, result)}")


if __name__ == "__main__":
    main()
