"""Repeat `torchrun --nproc-per-node 4 -m checkpoint_tools import-hf ... --tp 2 --pp 2` and count
the runs that do not exit 0, and those whose ranks print `terminate called` (a C++ abort at
interpreter exit: issue 50 saw rank 1 SIGABRT in 1 of 9 runs after a complete checkpoint).

    .venv/bin/python scripts/repeat_torchrun_import.py --runs 30

Each run imports the same tiny random Qwen2 model (4 heads, 2 KV heads, 2 layers: tp 2 x pp 2
fits) into a fresh directory and must print `"passed": true`. Prints one JSON line: runs, the
failed ones with their exit codes and the first `terminate`/`Abort` line of each, seconds, the
load average; `--out FILE` writes it too. Exit 1 when any run failed. Minutes: ~10-20 s a run on a
2-core CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def tiny_model(out: str) -> str:
    from megaprm.models.tiny import save_tiny_model
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    return save_tiny_model("qwen2", out, tokenizer=tok, vocab_size=len(tok), hidden_size=32,
                           num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def one_run(model: str, out: str, nproc: int, tp: int, pp: int) -> dict:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc-per-node", str(nproc), "-m", "checkpoint_tools", "import-hf",
           "--hf", model, "--out", out, "--tp", str(tp), "--pp", str(pp)]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                       check=False)
    text = p.stdout + p.stderr
    aborts = [ln for ln in text.splitlines() if "terminate called" in ln or "SIGABRT" in ln
              or "Aborted" in ln]
    return {"rc": p.returncode, "passed": '"passed": true' in p.stdout, "aborts": aborts[:3],
            "s": round(time.perf_counter() - t, 1), "tail": text[-1500:] if p.returncode else ""}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the JSON summary here too")
    args = ap.parse_args()
    t0 = time.perf_counter()
    bad = []
    with tempfile.TemporaryDirectory(prefix="megaprm-repeat-import-") as tmp:
        model = tiny_model(os.path.join(tmp, "hf"))
        for i in range(args.runs):
            r = one_run(model, os.path.join(tmp, f"ckpt{i}"), args.nproc, args.tp, args.pp)
            ok = r["rc"] == 0 and r["passed"] and not r["aborts"]
            print(f"run {i + 1}/{args.runs}: rc {r['rc']}, passed {r['passed']}, "
                  f"{'ok' if ok else 'FAILED ' + '; '.join(r['aborts'])} ({r['s']} s)",
                  file=sys.stderr, flush=True)
            if not ok:
                bad.append({"run": i + 1, **r})
    summary = {"command": f"torchrun --nproc-per-node {args.nproc} -m checkpoint_tools "
                          f"import-hf --tp {args.tp} --pp {args.pp}",
               "runs": args.runs, "failed": len(bad), "failures": bad,
               "seconds": round(time.perf_counter() - t0, 1),
               "load": [round(x, 2) for x in os.getloadavg()]}
    line = json.dumps(summary)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n", encoding="utf-8")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
