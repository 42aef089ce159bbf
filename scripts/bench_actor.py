"""fwd+bwd tokens/s of the megaprm actor vs transformers' model of the same config and batch.

Everything runs in this process on one device with the same weights (one HF dir) and batch;
transformers (its default SDPA attention) is the same-run baseline. One row per switch, so each
gain is measured on its own:

  megatron_local       Megatron's local spec as is, unchunked log-probs (megaprm's first actor)
  sdpa                 + core attention on torch SDPA, norm weights in the params dtype
  sdpa_chunked         + chunked log-probs as the trainer calls them (`next_token_logprobs`,
                       chunk `default_chunk_tokens`: the default)
  sdpa_chunked_compile + torch.compile of each layer
  ragged: transformers_padded / sdpa_chunked_padded / sdpa_chunked_packed: a batch whose
          lengths are uniform in [seq/4, seq]; tokens/s counts real tokens only.

A step is forward + backward of the token log-prob loss (no optimiser); tokens/s and ratios use
the fastest of --iters steps (the median is reported too). On CUDA each row also
reports MFU (6 * params * tokens + causal attention 6 * layers * d_attn * sum(len^2), against the
bf16 dense peak of the device named) and peak memory. Default (no arguments): on CPU the
default shape and hidden 1024 / 12 layers; on GPU a 0.79 B shape and Qwen2.5-1.5B's, bf16.
Writes JSON with the device, the load average and all rows (default runs/bench/; `megaprm bench --update-results`: scripts/results/).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import tempfile
import time

import psutil
import torch

# name -> (hidden, layers, heads, kv_heads, ffn, vocab, batch, seq, tied)
SHAPES = {
    "cpu-default": (256, 4, 4, 2, 768, 2048, 8, 256, True),
    "cpu-1024x12": (1024, 12, 16, 8, 3072, 2048, 2, 256, True),
    # a 0.79 B Qwen2 shape (tied embeddings)
    "gpu-0.79b": (2048, 16, 32, 16, 5504, 32768, 4, 2048, True),
    # Qwen2.5-1.5B
    "gpu-1.5b": (1536, 28, 12, 2, 8960, 151936, 4, 2048, True),
}
# bf16 dense peak TFLOP/s by device-name substring (first match wins)
PEAKS = [("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("H800", 989.0),
         ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0), ("A10", 125.0)]


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timeit(fn, warmup: int, iters: int) -> tuple:
    """(min, median) seconds per call. On a machine shared with other jobs the minimum is the
    closest to the quiet-machine time; both are reported."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return (f"CPU {platform.processor() or platform.machine()}, {psutil.cpu_count()} cores, "
            f"{torch.get_num_threads()} threads")


def _peak_tflops(name: str):
    return next((p for k, p in PEAKS if k in name), None)


def _load() -> dict:
    one, five, fifteen = os.getloadavg()
    return {"loadavg_1_5_15": [one, five, fifteen], "cpus": psutil.cpu_count()}


def bench_shape(name, shape, args, dev, dtype) -> dict:
    import transformers as tf

    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.logprobs import next_token_logprobs, vocab_parallel_logprobs
    from megaprm.models.mapping import load_hf_weights
    from megaprm.models.tiny import save_tiny_model
    from megaprm.models.actor import build_stage
    from megaprm.parallel import microbatch, pipeline
    from megaprm.parallel.init import init_distributed

    hidden, layers, heads, kv, ffn, vocab, batch, seq, tied = shape
    d = tempfile.mkdtemp()
    save_tiny_model("qwen2", d, vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                    num_heads=heads, num_kv_heads=kv, intermediate_size=ffn, tie=tied)
    g = init_distributed()
    spec = spec_from_hf(d)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(dev)
    lengths = torch.randint(seq // 4, seq + 1, (batch,), generator=gen)
    # loss mask of the ragged batch: position t counts when token t+1 is real
    real = (torch.arange(seq)[None] < lengths[:, None] - 1).to(dev)
    n_params = None
    d_attn = spec.num_heads * spec.head_dim

    def flops(lens) -> float:
        return 6 * n_params * sum(lens) + 6 * layers * d_attn * sum(n * n for n in lens)

    rows = []

    def record(row, step, lens):
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            t, t_median = _timeit(step, args.warmup, args.iters)
        except torch.OutOfMemoryError:
            row.update(tokens=sum(lens), error="out of memory", tokens_per_s=None)
            rows.append(row)
            print(json.dumps({"shape": name, **row}), flush=True)
            return
        row.update(tokens=sum(lens), step_s=t, step_s_median=t_median,
                   tokens_per_s=sum(lens) / t, tokens_per_s_median=sum(lens) / t_median)
        if dev.type == "cuda":
            row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
            peak = _peak_tflops(torch.cuda.get_device_name())
            if peak and dtype == torch.bfloat16:
                row["mfu"] = flops(lens) / t / (peak * 1e12)
        rows.append(row)
        print(json.dumps({"shape": name, **row}), flush=True)

    full = [seq] * batch
    ragged = lengths.tolist()
    # ---- transformers: the same-run baseline (its default attention: SDPA)
    hf = tf.AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(dev)
    n_params = sum(p.numel() for p in hf.parameters())

    def hf_step(mask=None):
        hf.zero_grad(set_to_none=True)
        logits = hf(ids).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        (-(lp if mask is None else lp * mask[:, :-1]).mean()).backward()

    record({"variant": "transformers", "batch": "full"}, hf_step, full)
    if not args.compile_rows_only:
        record({"variant": "transformers_padded", "batch": "ragged"}, lambda: hf_step(real),
               ragged)
    with torch.no_grad():
        ref_lp = torch.log_softmax(hf(ids).logits[:, :-1].float(), -1).gather(
            -1, ids[:, 1:, None])[..., 0]
    hf = None  # free it before the megaprm models are built

    def megaprm_rows(impl, chunk, compile_, variants):
        model = build_stage(spec, g, dtype=dtype, impl=impl, compile=compile_)
        load_hf_weights(model, d, spec, tp_rank=0, tp_size=1, pp=1, pp_rank=0)

        def step(mbs):
            model.zero_grad(set_to_none=True)
            for mb in mbs:  # the trainer's call: full logits, rolled targets
                logits = pipeline.gpt_forward(model, mb)
                lp = next_token_logprobs(logits, mb.input_ids, vocab_size=spec.vocab_size,
                                         chunk_tokens=chunk)
                (-(lp * mb.loss_mask[:, :-1]).sum() / max(1, batch * (seq - 1))).backward()

        padded = [pipeline.TokenBatch(ids, real.float())]
        try:
            with torch.no_grad():
                logits = pipeline.gpt_forward(model, padded[0])
                lp = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:],
                                             vocab_size=spec.vocab_size)
            err = float((lp - ref_lp).abs().max())
            del logits, lp
        except torch.OutOfMemoryError:
            err = None
        for variant, kind in variants:
            row = {"variant": variant, "batch": kind, "max_abs_logprob_diff_vs_hf": err}
            if kind == "full":
                mbs = [pipeline.TokenBatch(ids, torch.ones(batch, seq, device=dev))]
                record(row, lambda mbs=mbs: step(mbs), full)
            elif kind == "ragged":
                record(row, lambda: step(padded), ragged)
            else:  # packed by a token budget of one padded micro-batch's tokens
                mbs = microbatch.make_micro_batches(
                    ids, real.float(), max_tokens=batch * seq, lengths=lengths.to(dev))
                row["micro_batches"] = len(mbs)
                record(row, lambda mbs=mbs: step(mbs), ragged)

    if args.compile_rows_only:
        megaprm_rows("sdpa", None, False, [("sdpa_chunked", "full")])
    else:
        megaprm_rows("local", 0, False, [("megatron_local", "full")])
        megaprm_rows("sdpa", 0, False, [("sdpa", "full")])
        megaprm_rows("sdpa", None, False, [("sdpa_chunked", "full"),
                                           ("sdpa_chunked_padded", "ragged"),
                                           ("sdpa_chunked_packed", "packed")])
    if not args.no_compile:
        megaprm_rows("sdpa", None, True, [("sdpa_chunked_compile", "full")])
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["variant"].startswith("transformers")}
    base_med = {r["batch"]: r.get("tokens_per_s_median") for r in rows
                if r["variant"].startswith("transformers")}
    for r in rows:
        kind = "full" if r["batch"] == "full" else "ragged"
        b, bm = base[kind], base_med[kind]
        r["ratio_vs_transformers"] = r["tokens_per_s"] / b if r["tokens_per_s"] and b else None
        r["ratio_vs_transformers_median"] = (r["tokens_per_s_median"] / bm
                                             if r.get("tokens_per_s_median") and bm else None)
    shutil.rmtree(d, ignore_errors=True)  # the HF copy: 6 GB at the 1.5 B shape
    return {"shape": name, "model": {"family": "qwen2", "hidden": hidden, "layers": layers,
                                     "heads": heads, "kv_heads": kv, "ffn": ffn, "vocab": vocab,
                                     "params": n_params},
            "batch": batch, "seq": seq, "ragged_lengths": ragged, "rows": rows}


def main() -> None:
    from megaprm.bench import default_out  # runs/bench/, or $MEGAPRM_BENCH_RESULTS

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None,
                    help=f"comma list from {','.join(SHAPES)} (default: cpu-* on CPU, gpu-* on "
                         "GPU)")
    ap.add_argument("--shape", default=None,
                    help="a custom shape: hidden,layers,heads,kv_heads,ffn,vocab,batch,seq")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dtype", default=None, choices=["fp32", "bf16"],
                    help="default: bf16 on GPU, fp32 on CPU")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    ap.add_argument("--compile-rows-only", action="store_true",
                    help="only the rows torch.compile is judged by: transformers, sdpa_chunked "
                         "and sdpa_chunked_compile (scripts/gpu_checks.py compile)")
    ap.add_argument("--out", default=default_out("bench_actor.json"))
    args = ap.parse_args()

    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype_name = args.dtype or ("bf16" if dev.type == "cuda" else "fp32")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    if args.shape:
        try:
            vals = [int(x) for x in args.shape.split(",")]
            assert len(vals) == 8
        except (ValueError, AssertionError):
            raise SystemExit(f"--shape {args.shape!r}: expected 8 integers "
                             "hidden,layers,heads,kv_heads,ffn,vocab,batch,seq")
        shapes = {"custom": (*vals, True)}
    else:
        names = (args.shapes.split(",") if args.shapes else
                 [n for n in SHAPES if n.startswith("gpu" if dev.type == "cuda" else "cpu")])
        unknown = [n for n in names if n not in SHAPES]
        if unknown:
            raise SystemExit(f"--shapes: unknown {unknown}; choose from {','.join(SHAPES)}")
        shapes = {n: SHAPES[n] for n in names}
    load_before = _load()
    t0 = time.perf_counter()
    results = [bench_shape(n, s, args, dev, dtype) for n, s in shapes.items()]
    from megaprm.parallel.init import destroy

    destroy()  # the process group bench_shape set up (NCCL warns at exit otherwise)
    first = {r["variant"]: r for r in results[0]["rows"]}
    result = {
        "device": _device_name(), "torch": torch.__version__, "dtype": dtype_name,
        "peak_tflops_bf16": _peak_tflops(_device_name()) if dev.type == "cuda" else None,
        "load_before": load_before, "load_after": _load(),
        "elapsed_s": time.perf_counter() - t0,
        "note": "same-process baseline: transformers (SDPA attention), same weights and batch",
        # headline (first shape; the plot reads these): the default megaprm path
        "megaprm_tokens_per_s": first["sdpa_chunked"]["tokens_per_s"],
        "transformers_tokens_per_s": first["transformers"]["tokens_per_s"],
        "ratio_megaprm_over_transformers": first["sdpa_chunked"]["ratio_vs_transformers"],
        "shapes": results,
        "peak_rss_mb": psutil.Process().memory_info().rss / 2**20,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "shapes"}, indent=2))


if __name__ == "__main__":
    main()
