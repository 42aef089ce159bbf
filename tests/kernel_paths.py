"""torch's CPU kernel paths on x86, and the tests whose verdict is a training outcome.

torch picks its vectorised ATen kernels for the CPU at hand (DEFAULT, AVX2, AVX512) and MKL
its own; `ATEN_CPU_CAPABILITY` and `MKL_ENABLE_INSTRUCTIONS` force a lower one, which is how
one machine reproduces what another CPU computes. A model trained for a few hundred steps
lands on different weights under each path, so a threshold on a learning outcome must hold
under all of them (margins: docs/testing.md, scripts/learning_margins.py), and
tests/test_kernel_paths.py reruns the learning tests under a second path (`make test-learning`).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

# path -> the environment that forces it (MKL's own dispatch is forced alongside ATen's)
PATHS = {
    "default": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
}

# The tests whose assertions read a training outcome (an AUROC, a loss going down). Each
# holds with the margin docs/testing.md lists on every path above; they carry the `learning`
# marker and tests/test_kernel_paths.py reruns them under another path.
LEARNING_TESTS = [
    "tests/experiments/arithmetic/test_compare.py::test_compare_tiny_end_to_end_killed_and_resumed",
    "tests/trainer/test_prm_training.py::test_tiny_prm_learns_arithmetic_step_labels",
]


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def available_paths() -> list:
    """The paths this CPU can run (torch's AVX512 path needs avx512f/bw/vl/dq)."""
    flags = _cpu_flags()
    out = ["default"]
    if {"avx2", "fma"} <= flags:
        out.append("avx2")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        out.append("avx512")
    return out


def native_path() -> str:
    """The path torch picks here when nothing is forced."""
    return available_paths()[-1]


def path_env(path: str, base: dict | None = None) -> dict:
    """`base` (default: this process's environment) with `path` forced."""
    env = dict(os.environ if base is None else base)
    env.update(PATHS[path])
    return env


def main(argv=None) -> int:
    """`--env PATH`: the path's variables as `K=V` words for `env` (nothing for ""), for the
    Makefile's KERNEL_PATH; `--run-learning`: the learning tests under every path this CPU has
    (`make test-learning`)."""
    ap = argparse.ArgumentParser(prog="python -m tests.kernel_paths")
    ap.add_argument("--env", metavar="PATH")
    ap.add_argument("--run-learning", action="store_true")
    a = ap.parse_args(argv)
    if a.env is not None:
        if a.env and a.env not in available_paths():
            print(f"KERNEL_PATH={a.env!r}: choose one of {available_paths()} (the kernel paths "
                  f"this CPU has; docs/testing.md)", file=sys.stderr)
            return 2
        print(" ".join(f"{k}={v}" for k, v in PATHS[a.env].items()) if a.env else "")
        return 0
    if a.run_learning:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        failed = []
        for path in available_paths():
            print(f"== learning tests under {path}", flush=True)
            rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-s", "-p",
                                  "no:cacheprovider", *LEARNING_TESTS], cwd=root,
                                 env=path_env(path))
            if rc:
                failed.append(path)
        print("learning tests: " + (f"failed under {failed}" if failed
                                    else f"passed under {available_paths()}"))
        return 1 if failed else 0
    ap.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
