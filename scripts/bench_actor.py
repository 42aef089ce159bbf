"""fwd+bwd tokens/s of the megaprm actor vs transformers' model of the same config and batch.

Both sides run in this process on the same device, same weights (loaded from one HF dir), same
batch; the ratio megaprm/transformers is the number to read. On CUDA it also reports model FLOPs
utilisation (6 * params * tokens / time / peak). Writes JSON (default scripts/results/).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import psutil
import torch


def _timeit(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H100 SXM)")
    ap.add_argument("--out", default="scripts/results/bench_actor.json")
    args = ap.parse_args()

    import transformers as tf

    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.logprobs import vocab_parallel_logprobs
    from megaprm.models.mapping import load_hf_weights
    from megaprm.models.tiny import save_tiny_model
    from megaprm.parallel import pipeline
    from megaprm.parallel.init import init_distributed

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    d = tempfile.mkdtemp()
    save_tiny_model("qwen2", d, vocab_size=args.vocab, hidden_size=args.hidden,
                    num_layers=args.layers, num_heads=max(1, args.hidden // 64),
                    num_kv_heads=max(1, args.hidden // 128), intermediate_size=args.hidden * 3)
    g = init_distributed()
    spec = spec_from_hf(d)
    actor = pipeline.build_stage(spec, g, dtype=dtype)
    load_hf_weights(actor, d, spec, tp_rank=0, tp_size=1, pp=1, pp_rank=0)
    hf = tf.AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(dev)
    n_params = sum(p.numel() for p in hf.parameters())
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    mb = pipeline.TokenBatch(ids, torch.ones_like(ids, dtype=torch.float))

    def mega_step():
        logits = pipeline.gpt_forward(actor, mb)
        lp = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], vocab_size=spec.vocab_size)
        (-lp.mean()).backward()

    def hf_step():
        logits = hf(ids).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])
        (-lp.mean()).backward()

    tokens = args.batch * args.seq
    t_mega = _timeit(mega_step, 2, args.iters)
    t_hf = _timeit(hf_step, 2, args.iters)
    result = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else
        f"CPU {platform.processor() or platform.machine()}, {psutil.cpu_count()} cores, "
        f"{torch.get_num_threads()} threads",
        "torch": torch.__version__, "dtype": args.dtype,
        "model": {"family": "qwen2", "hidden": args.hidden, "layers": args.layers,
                  "vocab": args.vocab, "params": n_params},
        "batch": args.batch, "seq": args.seq,
        "megaprm_tokens_per_s": tokens / t_mega,
        "transformers_tokens_per_s": tokens / t_hf,
        "ratio_megaprm_over_transformers": t_hf / t_mega,
        "peak_rss_mb": psutil.Process().memory_info().rss / 2**20,
    }
    if dev.type == "cuda":
        flops = 6 * n_params * tokens
        result["megaprm_mfu"] = flops / t_mega / (args.peak_tflops * 1e12)
        result["transformers_mfu"] = flops / t_hf / (args.peak_tflops * 1e12)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
