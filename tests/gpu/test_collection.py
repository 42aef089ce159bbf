"""The GPU tier collects on the GPU image: its modules import, at module level, only what that
image carries (torch 2.11, transformers, safetensors, numpy, pyyaml, tqdm, psutil, matplotlib,
pyarrow, pytest) plus the wheels the GPU kit brings (megatron-core, math-verify and its
LaTeX parser, hypothesis, pytest-timeout). A CPU test, not GPU-marked: it runs in both tiers.
Anything else (vLLM, Transformer Engine) must be imported inside a test that skips, with the
reason, where it is missing."""
import glob
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPU_IMAGE = {"torch", "transformers", "safetensors", "numpy", "yaml", "tqdm", "psutil",
             "matplotlib", "pyarrow", "pytest", "_pytest"}
GPU_KIT_WHEELS = {"megatron", "math_verify", "latex2sympy2_extended", "antlr4", "hypothesis",
                  "sortedcontainers", "pytest_timeout"}
REPO = {"megaprm", "tests", "checkpoint_tools", "eval", "scripts"}

# Run in a fresh interpreter: records every import made *from a repo file* whose top-level
# package is neither stdlib nor in the sets above (the packages' own imports are theirs).
_PROBE = r"""
import importlib, os, sys
root, allowed, modules = sys.argv[1], set(sys.argv[2].split(",")), sys.argv[3].split(",")
bad = set()

class Probe:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in allowed or top in sys.stdlib_module_names:
            return None
        f = sys._getframe(1)
        while f is not None and ("importlib" in f.f_code.co_filename
                                 or f.f_code.co_filename.startswith("<frozen")):
            f = f.f_back
        where = f.f_code.co_filename if f is not None else ""
        if where.startswith(root) and "/.venv/" not in where:
            bad.add(f"{os.path.relpath(where, root)}:{f.f_lineno} imports {name}")
        return None

sys.meta_path.insert(0, Probe())
for m in modules:
    importlib.import_module(m)
print("BAD:" + ";".join(sorted(bad)))
"""


def test_gpu_tier_modules_import_only_what_the_gpu_kit_carries():
    modules = [os.path.relpath(p, ROOT)[:-3].replace(os.sep, ".")
               for p in sorted(glob.glob(os.path.join(ROOT, "tests", "gpu", "test_*.py")))]
    allowed = ",".join(sorted(GPU_IMAGE | GPU_KIT_WHEELS | REPO))
    out = subprocess.run([sys.executable, "-c", _PROBE, ROOT, allowed, ",".join(modules)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    bad = out.stdout.split("BAD:")[-1].strip()
    assert "tests.gpu.test_gpu" in modules and bad == "", bad
