"""The GPU session's checks (scripts/gpu_session.sh), one JSON each under --out.

    python scripts/gpu_checks.py CHECK [--dry] [--out DIR]

CHECK is one of
  collectives  which collectives gloo runs on device tensors for 2 ranks sharing one device, and
               what NCCL says to 2 ranks on one GPU (the backend choice of
               parallel/device.default_backend rests on it)
  multirank    the multi-rank tests with MEGAPRM_RANKS_SHARE_DEVICE=1 (every rank on cuda:0,
               gloo): tp2 / pp2 RL steps (PURE, PRIME) vs world size 1 and a tp2 checkpoint
               exported and loaded by transformers on the device (tests/trainer/
               test_layouts.py), dp2 update vs one batch (test_loop), dp2
               DistributedOptimizer save -> resume (test_optimizer_state), offload at dp2
               (test_offload), the separate placement's weights group (test_remote_weights),
               import-hf at tp2 pp2 (test_convert). Per test: passed / failed with its message.
  offload      actor (with its optimizer), reference and PRM of one RL step: bytes returned by
               offload (CUDA: torch.cuda.memory_allocated; CPU: the bytes of the storages),
               what remains, bit-exactness after reload, reload's host-to-device GB/s against a
               same-run pinned `torch.empty(n).copy_` of the same bytes
  step         one RL step of a Qwen2.5-1.5B-shaped actor (random weights, vocab 151,936) with
               a reference and a 1.5B-shaped PRM, bf16, offload on, short responses: seconds
               and peak memory per phase, the colocated lifecycle's order, next to `megaprm
               plan` for the same config on 1 GPU; each phase's plan error and the
               efficiencies the measurement implies for the planner's constants
  compile      scripts/bench_actor.py at its GPU shapes: torch.compile of the layers vs eager,
               log-probs of both against transformers; the decision on the CUDA default

--dry: the CPU-sized form of each (tiny models, the CPU, seconds; multirank only collects its
tests, which the CPU tier runs anyway): tests/gpu/test_session.py runs every check so.
Every JSON has the device, torch version, commit, load average and wall seconds, and the check's
trail (`progress`: each stage reached, with its second and the device memory allocated).
--budget S: the check stops itself after S seconds and still writes its JSON (`timed_out`,
the trail up to where it stood, the steps and tests finished by then), so a check cut short
says where its time went (the first H100 run, 2026-11-28, had three checks killed by the
session's timeouts with nothing to show).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

CHECKS = ("collectives", "multirank", "offload", "step", "compile")
# the quick ones first: a budget that ends the run early has the most outcomes (test_layouts
# builds a world-size-1 reference and two layouts of two methods: the longest by far)
MULTIRANK_TESTS = (
    "tests/parallel/test_shared_device.py::test_two_ranks_sharing_the_device_stand_in",
    "tests/rollout/test_remote_weights.py",
    "tests/parallel/test_optimizer_state.py::"
    "test_distributed_optimizer_resume_is_bit_exact_and_head_only_builds",
    "tests/checkpoint_tools/test_convert.py::test_roundtrip_bitwise",
    "tests/trainer/test_loop.py::test_update_metrics_equal_a_single_batch_reference[2ranks-3mb]",
    "tests/parallel/test_offload.py",
    "tests/trainer/test_layouts.py",
)
# Qwen2.5-1.5B's config.json (hidden, layers, heads, kv heads, ffn; tied embeddings)
QWEN25_1_5B = dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                   intermediate_size=8960, vocab_size=151936)
TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
# the check's trail: a file the check and its ranks append to (environment, so spawned ranks
# find it), and the wall clock its seconds count from
PROGRESS_ENV, T0_ENV = "GPU_CHECK_PROGRESS", "GPU_CHECK_T0"


class CheckTimeout(Exception):
    """The check's --budget ran out."""


def note(msg: str, **data) -> None:
    """One stage of the check: a line in its log (stdout) and a record in its trail, with the
    seconds since the check began and the device memory allocated."""
    t = time.time() - float(os.environ.get(T0_ENV, time.time()))
    rec = {"t": round(t, 1), "stage": msg, **data}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rec["allocated_gb"] = round(torch.cuda.memory_allocated() / 1e9, 3)
    print(f"[{t:7.1f} s] {msg}", flush=True)
    path = os.environ.get(PROGRESS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")


def read_trail(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


class Budget:
    """The seconds left of the check's --budget (None: unbounded)."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self, default: float = 600.0) -> float:
        if self.end is None:
            return default
        left = self.end - time.monotonic()
        if left <= 0:
            raise CheckTimeout("no time left")
        return left


def _traced(owner, name: str, label: str) -> None:
    """Wrap owner.name so the trail records when it starts and ends."""
    fn = getattr(owner, name)

    def run(*a, **k):
        note(f"{label} ...")
        t0 = time.perf_counter()
        out = fn(*a, **k)
        note(f"{label} done", seconds=round(time.perf_counter() - t0, 2))
        return out
    setattr(owner, name, run)


def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    from scripts.bench_rl_step import cpu_name

    return cpu_name()


def _header(check: str, dry: bool) -> dict:
    try:  # the device machine's copy of the checkout may have no .git (or no git)
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip() or os.environ.get("MEGAPRM_COMMIT")
    except OSError:
        commit = os.environ.get("MEGAPRM_COMMIT")
    return {"check": check, "dry": dry, "device": _device_name(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "commit": commit, "load_before": os.getloadavg()}


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:400] if text else type(e).__name__


# ------------------------------------------------------------------------------ collectives

def _collective_rank(nccl: bool) -> dict:
    """On each of 2 ranks sharing the device: every collective megaprm's paths use, on device
    tensors, over the default group (gloo), each {"ok", "error"}; with `nccl`, one all-reduce
    over an NCCL group of the 2 ranks instead."""
    import torch.distributed as dist

    from megaprm.parallel.device import rank_device

    dev = rank_device()
    if torch.cuda.is_available():
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"device": str(dev)}

    def attempt(name, fn, expect):
        try:
            got = fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ok = bool(torch.equal(got.cpu(), expect))
            out[name] = {"ok": ok, "error": None if ok else f"wrong values {got.tolist()}"}
        except Exception as e:  # noqa: BLE001 - the probe reports what fails
            out[name] = {"ok": False, "error": _first_line(e)}

    if nccl:
        def nccl_all_reduce():
            g = dist.new_group(backend="nccl")
            t = torch.full((4,), float(rank + 1), device=dev)
            dist.all_reduce(t, group=g)
            return t
        attempt("nccl_all_reduce", nccl_all_reduce, torch.full((4,), 3.0))
        return out

    def all_reduce():
        t = torch.full((4,), float(rank + 1), device=dev)
        dist.all_reduce(t)
        return t

    def broadcast():
        t = torch.full((4,), float(rank + 7), device=dev)
        dist.broadcast(t, src=0)
        return t

    def all_gather():
        parts = [torch.empty(2, device=dev) for _ in range(world)]
        dist.all_gather(parts, torch.full((2,), float(rank), device=dev))
        return torch.cat(parts)

    def all_gather_into_tensor():  # Megatron's DistributedOptimizer: parameters
        out_t = torch.empty(2 * world, device=dev)
        dist.all_gather_into_tensor(out_t, torch.full((2,), float(rank), device=dev))
        return out_t

    def reduce_scatter_tensor():  # Megatron's DistributedOptimizer: grads
        t = torch.arange(2 * world, dtype=torch.float32, device=dev)
        out_t = torch.empty(2, device=dev)
        dist.reduce_scatter_tensor(out_t, t)
        return out_t

    def send_recv():  # the pipeline's p2p (pp > 1)
        t = torch.full((3,), 5.0, device=dev) if rank == 0 else torch.empty(3, device=dev)
        if rank == 0:
            dist.send(t, 1)
            return torch.full((3,), 5.0)
        dist.recv(t, 0)
        return t

    def batch_isend_irecv():  # megatron-core's p2p_communication uses batched P2P ops
        t = torch.full((3,), float(rank), device=dev)
        r = torch.empty(3, device=dev)
        peer = 1 - rank
        ops = [dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, r, peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return r

    attempt("all_reduce", all_reduce, torch.full((4,), 3.0))
    attempt("broadcast", broadcast, torch.full((4,), 7.0))
    attempt("all_gather", all_gather, torch.tensor([0.0, 0.0, 1.0, 1.0]))
    attempt("all_gather_into_tensor", all_gather_into_tensor, torch.tensor([0.0, 0.0, 1.0, 1.0]))
    attempt("reduce_scatter_tensor", reduce_scatter_tensor,
            2 * torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32))
    attempt("send_recv", send_recv, torch.full((3,), 5.0))
    attempt("batch_isend_irecv", batch_isend_irecv, torch.full((3,), float(1 - rank)))
    return out


def check_collectives(dry: bool) -> dict:
    from megaprm.parallel import launch
    from megaprm.parallel.device import SHARE_ENV

    os.environ[SHARE_ENV] = "1"
    res = {"gloo": launch.spawn(_collective_rank, 2, False, timeout_s=120)}
    if torch.cuda.is_available():  # NCCL with 2 ranks on one GPU: expected to refuse
        try:
            res["nccl"] = launch.spawn(_collective_rank, 2, True, timeout_s=90)
        except Exception as e:  # noqa: BLE001 - a hang or a crash is the answer
            res["nccl"] = {"error": _first_line(e)}
    ops = [k for k in res["gloo"][0] if k != "device"]
    res["gloo_on_device"] = {k: all(r[k]["ok"] for r in res["gloo"]) for k in ops}
    # what each failing op means for megaprm's paths on a shared GPU (only NCCL across GPUs
    # can run them there)
    users = {"all_gather_into_tensor": "Megatron DistributedOptimizer (dp > 1)",
             "reduce_scatter_tensor": "Megatron DistributedOptimizer (dp > 1)",
             "send_recv": "pipeline p2p (pp > 1)", "batch_isend_irecv": "pipeline p2p (pp > 1)",
             "all_reduce": "DDP grads, tp all-reduce", "all_gather": "tp gathers",
             "broadcast": "weights group, tp broadcasts"}
    res["needs_nccl_across_gpus"] = {k: users.get(k, "") for k, ok in
                                     res["gloo_on_device"].items() if not ok}
    return res


# ------------------------------------------------------------------------------ multirank

def _verbose_outcomes(text: str) -> tuple:
    """(finished tests, the one running) from pytest -v's lines `path::name OUTCOME`."""
    done, running = [], None
    for ln in text.splitlines():
        m = re.match(r"^(\S+\.py::\S+)(?: (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS))?", ln)
        if not m:
            continue
        if m.group(2):
            done.append({"test": m.group(1), "outcome": m.group(2).lower()})
            running = None
        else:
            running = m.group(1)
    return done, running


def check_multirank(dry: bool, out_dir: str, budget: Budget) -> dict:
    """pytest over MULTIRANK_TESTS with every rank on the one device; per-test outcome from
    its junit XML, or, where the budget ends the run first, from pytest -v's lines so far
    (the test it was in named)."""
    import xml.etree.ElementTree as ET

    from megaprm.parallel.device import SHARE_ENV

    xml = os.path.join(out_dir, "multirank_junit.xml")
    log = os.path.join(out_dir, "multirank_pytest.log")
    cmd = [sys.executable, "-m", "pytest", "-q" if dry else "-v", "-p", "no:cacheprovider",
           "-rf", "--junitxml", xml, *MULTIRANK_TESTS]
    if dry:
        cmd.append("--collect-only")
    env = {**os.environ, SHARE_ENV: "1"}
    t0 = time.perf_counter()
    note("pytest over the multi-rank selection")
    with open(log, "w") as f:  # its own session: a budget's end kills pytest and its ranks
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
        try:
            returncode, cut = p.wait(timeout=budget.left()), False
        except (subprocess.TimeoutExpired, CheckTimeout):
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            returncode, cut = None, True
    with open(log) as f:
        text = f.read()
    res = {"command": " ".join(cmd[1:]), "returncode": returncode,
           "seconds": time.perf_counter() - t0, "tail": text[-3000:]}
    if dry:
        lines = [ln for ln in text.splitlines() if "::" in ln]
        res["collected"] = lines
        res["every_selection_collected"] = all(
            any(ln.startswith(sel.split("::")[0]) for ln in lines) for sel in MULTIRANK_TESTS)
        return res
    tests = []
    if not cut and os.path.exists(xml):
        for case in ET.parse(xml).getroot().iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            skipped = case.find("skipped")
            tests.append({"test": f"{case.get('classname')}::{case.get('name')}",
                          "seconds": float(case.get("time", 0)),
                          "outcome": ("failed" if bad is not None else
                                      "skipped" if skipped is not None else "passed"),
                          "message": (bad.get("message", "")[:600] if bad is not None else
                                      skipped.get("message", "")[:300] if skipped is not None
                                      else None)})
    else:
        tests, res["running_when_cut"] = _verbose_outcomes(text)
    res["tests"] = tests
    res["passed"] = sum(t["outcome"] == "passed" for t in tests)
    res["failed"] = sum(t["outcome"] in ("failed", "error") for t in tests)
    if cut:
        raise CheckTimeout(f"the budget ended pytest after {res['passed']} passed and "
                           f"{res['failed']} failed tests, in {res['running_when_cut']}", res)
    return res


# ------------------------------------------------------------------------------ models

def _save_model(out: str, shape: dict, head: str | None, dtype: torch.dtype) -> str:
    """A random-weight Qwen2 of `shape` in the real HF format (config, safetensors, the char
    tokenizer), built on the device in `dtype` (seconds at 1.5 B, where the CPU's init would
    take minutes)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from megaprm.models.tiny import tiny_config
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    shape = {"vocab_size": len(tok), **shape}
    cfg = tiny_config("qwen2", **({"head": head} if head else {}), **shape,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cls = AutoModelForTokenClassification if head else AutoModelForCausalLM
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0 if head is None else 1)
    with torch.device(dev):
        model = cls.from_config(cfg, dtype=dtype)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def _save_models(d: str, shape: dict, dtype: torch.dtype) -> tuple:
    """The policy and the PRM of `shape` under `d`, each stage in the trail: (policy, prm,
    seconds taken)."""
    t0 = time.perf_counter()
    note("write the policy and the PRM (HF format)")
    policy = _save_model(os.path.join(d, "policy"), shape, None, dtype)
    prm = _save_model(os.path.join(d, "prm"), shape, "token_cls", dtype)
    seconds = time.perf_counter() - t0
    note("models written; start the rank", seconds=round(seconds, 2))
    return policy, prm, seconds


def _step_overrides(policy: str, prm: str, run_dir: str, dry: bool) -> list:
    """A PURE step with its KL reference and a discriminative PRM, every model offloaded while
    the engine generates; short responses."""
    return [f"model.path={policy}", f"prm.path={prm}", "prm.kind=discriminative",
            "prm.input_format=raw", "advantage.method=pure", "advantage.pure.kl_coef=0.001",
            "actor.offload=true", "ref.offload=true", "prm.offload=true",
            f"model.dtype={'fp32' if dry else 'bf16'}", "rollout.engine=hf",
            f"rollout.max_tokens={16 if dry else 128}", "rollout.n=4",
            f"data.prompts_per_step={4 if dry else 8}", "actor.mini_batches=1",
            f"actor.micro_batch_size={4 if dry else 8}", "trainer.save_every=0",
            "trainer.wandb=disabled", "trainer.progress=false", f"trainer.run_dir={run_dir}"]


# ------------------------------------------------------------------------------ instruments

def _memory() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


class Recorder:
    """Per-phase wall seconds and peak device memory (PhaseTimer's phases), and the lifecycle's
    events in order with the memory allocated after each."""

    def __init__(self):
        self.events: list = []
        self.phase_peak: dict = {}
        self.prompt_tokens_max = 0

    def install(self, tr) -> None:
        from megaprm.trainer import metrics

        rec, timer_call = self, metrics.PhaseTimer.__call__.__wrapped__

        from contextlib import contextmanager

        @contextmanager
        def measured(timer, name):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            note(f"  phase {name} ...")
            t0 = time.perf_counter()
            with contextmanager(timer_call)(timer, name):
                yield
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            note(f"  phase {name} done", seconds=round(time.perf_counter() - t0, 3))
            if torch.cuda.is_available():
                rec.phase_peak[name] = max(rec.phase_peak.get(name, 0),
                                           torch.cuda.max_memory_allocated())
        metrics.PhaseTimer.__call__ = measured
        generate = tr.source.generate

        def generated(*a, **k):  # the longest prompt, for the plan's --prompt-tokens
            batch = generate(*a, **k)
            rec.prompt_tokens_max = max(rec.prompt_tokens_max,
                                        int(batch.prompt_mask.sum(1).max()))
            return batch
        tr.source.generate = generated
        life = tr.lifecycle
        for obj, names in ((life, ("offload", "reload", "_sync")),
                           (life.engine, ("wake", "sleep"))):
            for n in names:
                setattr(obj, n, self._logged(n.strip("_"), getattr(obj, n)))

    def _logged(self, name, fn):
        def run(*a, **k):
            out = fn(*a, **k)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.events.append({"event": name, "allocated_gb": _memory() / 1e9})
            return out
        return run


def _storage_bytes(offload) -> int:
    return sum(st.nbytes() for st, _ in offload.storages())


def _offload_accounting(off) -> dict:
    """offload() -> reload() of one model with its bytes, what remains and the copy speeds."""
    from megaprm.parallel.offload import KEEP, _bytes

    cuda = torch.cuda.is_available()
    keep = [(st, kind) for st, kind in off.storages() if st.nbytes()]
    snapshot = [(_bytes(st).to("cpu", copy=True) if kind == KEEP else None) for st, kind in keep]
    held = _storage_bytes(off)
    keep_bytes = sum(st.nbytes() for st, kind in keep if kind == KEEP)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    before = _memory()
    freed = off.offload()
    if cuda:
        torch.cuda.synchronize()
    after = _memory()
    left = _storage_bytes(off)
    t0 = time.perf_counter()
    restored = off.reload()
    if cuda:
        torch.cuda.synchronize()
    reload_s = time.perf_counter() - t0
    bit_exact = all(s is None or torch.equal(_bytes(st).cpu(), s)
                    for (st, _), s in zip(keep, snapshot))
    dropped_zero = all(kind == KEEP or not bool(_bytes(st).any()) for st, kind in keep)
    r = {"model": off.name, "storages": len(keep), "storage_bytes": held,
         "bytes_freed": freed, "bytes_restored": restored, "storage_bytes_left": left,
         "keep_bytes": keep_bytes, "bit_exact_after_reload": bit_exact,
         "grads_zero_after_reload": dropped_zero, "reload_s": reload_s}
    if cuda:
        r.update(allocated_before=before, allocated_after_offload=after,
                 allocated_returned=before - after,
                 allocated_returned_minus_freed=before - after - freed,
                 reload_h2d_gbps=keep_bytes / reload_s / 1e9)
        # the same-run baseline: one pinned host buffer of the same bytes into a fresh tensor
        host = torch.empty(keep_bytes, dtype=torch.uint8, pin_memory=True)
        for _ in range(2):  # the second is timed (the first pays the allocation)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dev = torch.empty(keep_bytes, dtype=torch.uint8, device="cuda")
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            base_s = time.perf_counter() - t0
            del dev
        r["baseline_pinned_copy_gbps"] = keep_bytes / base_s / 1e9
        r["reload_vs_baseline"] = r["reload_h2d_gbps"] / r["baseline_pinned_copy_gbps"]
    return r


def _trainer(policy, prm, run_dir, dry):
    from megaprm.config import load_config
    from megaprm.parallel.init import init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl import loop
    from megaprm.trainer.rl.loop import RLTrainer

    note("rank started")
    cfg = load_config(str(ROOT / "megaprm" / "configs" / "demo.yaml"),
                      [*_step_overrides(policy, prm, run_dir, dry),
                       f"trainer.steps={1 if dry else 2}"])
    g = init_distributed()
    note("process group up")
    # the trail records each model's build, the engine's and the lifecycle's first sync
    _traced(loop, "Policy", "build a Megatron policy (actor or reference)")
    _traced(loop.reward_phase, "build_discriminative_prm", "build the PRM")
    _traced(loop.rollout_source, "build_engine", "build the rollout engine")
    _traced(loop.rollout_source, "make_source", "colocate: offload switches, first sync")
    tr = RLTrainer(cfg, g, build_char_tokenizer())
    note("trainer built")
    return tr, cfg


def _offload_rank(policy, prm, run_dir, dry) -> dict:
    tr, _ = _trainer(policy, prm, run_dir, dry)
    note("step 0 (the optimizer's state exists after one update) ...")
    tr.step_or_skip(0)
    note("step 0 done")
    models = []
    for o in tr.lifecycle.offloads:
        models.append(_offload_accounting(o))
        note(f"offload -> reload of {o.name} measured", result=models[-1])
    return {"models": models}


def check_offload(dry: bool, budget: Budget) -> dict:
    from megaprm.parallel import launch

    shape = TINY if dry else dict(QWEN25_1_5B, num_layers=8)  # 0.6 B: seconds per copy
    dtype = torch.float32 if dry else torch.bfloat16
    with tempfile.TemporaryDirectory(prefix="gpu-offload-") as d:
        policy, prm, _ = _save_models(d, shape, dtype)
        res = launch.spawn(_offload_rank, 1, policy, prm, os.path.join(d, "run"), dry,
                           timeout_s=budget.left())[0]
    res["shape"] = shape
    return res


# ------------------------------------------------------------------------------ real-size step

def _step_rank(policy, prm, run_dir, dry) -> dict:
    tr, cfg = _trainer(policy, prm, run_dir, dry)
    rec = Recorder()
    rec.install(tr)
    steps = []
    # on the GPU step 0 warms up (allocator, kernels) and step 1 is the one measured
    for s in range(cfg.trainer.steps):
        rec.events.clear()
        rec.phase_peak.clear()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        note(f"step {s} ...")
        m = tr.step_or_skip(s)
        steps.append({"metrics": {k: v for k, v in m.items() if isinstance(v, (int, float))},
                      "phase_peak_gb": {k: v / 1e9 for k, v in rec.phase_peak.items()},
                      "lifecycle": list(rec.events),
                      "step_peak_gb": (torch.cuda.max_memory_allocated() / 1e9
                                       if torch.cuda.is_available() else None)})
        # the whole record in the trail: a check cut short keeps the steps it finished
        note(f"step {s} done", step=steps[-1], prompt_tokens_max=rec.prompt_tokens_max)
    return {"steps": steps, "prompt_tokens_max": rec.prompt_tokens_max}


# the plan's phases <- the step's timed phases (`timing/<name>_s`)
PLAN_PHASES = {"rollout": ("rollout",), "log-probs": ("old_logprobs", "process_reward"),
               "update": ("update",), "weight sync": ("weight_sync",)}


def _plan(overrides: list, gpu: str, prompt_tokens: int, mean_response: float,
          budget: Budget) -> dict:
    cmd = [sys.executable, "-m", "megaprm.cli", "plan", str(ROOT / "megaprm" / "configs" /
                                                            "demo.yaml"), *overrides,
           "--gpus", "1", "--gpu", gpu, "--json", "--prompt-tokens", str(prompt_tokens),
           "--mean-response", str(mean_response)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=budget.left())
    if p.returncode:
        return {"error": p.stderr.strip()[-1000:], "command": " ".join(cmd[3:])}
    return {"command": "megaprm " + " ".join(cmd[3:]), **json.loads(p.stdout)}


def check_step(dry: bool, budget: Budget) -> dict:
    from megaprm.parallel import launch
    from megaprm.planner.hardware import DEFAULT_EFFICIENCY

    shape = TINY if dry else QWEN25_1_5B
    dtype = torch.float32 if dry else torch.bfloat16
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    gpu = "h200" if "H200" in name else "h100"
    with tempfile.TemporaryDirectory(prefix="gpu-step-") as d:
        policy, prm, build_s = _save_models(d, shape, dtype)
        run_dir = os.path.join(d, "run")
        res = launch.spawn(_step_rank, 1, policy, prm, run_dir, dry,
                           timeout_s=budget.left())[0]
        m = res["steps"][-1]["metrics"]
        prompt = res["prompt_tokens_max"]
        note("megaprm plan of the same config")
        plan = _plan([o for o in _step_overrides(policy, prm, run_dir, dry)
                      if not o.startswith("trainer.run_dir")], gpu, prompt,
                     max(1.0, m["response/length_mean"]), budget)
    res.update(shape=shape, models_written_s=build_s, gpu_for_plan=gpu, plan=plan)
    measured = res["steps"][-1]
    compare = {}
    for phase, parts in PLAN_PHASES.items():
        secs = sum(measured["metrics"].get(f"timing/{p}_s", 0.0) for p in parts)
        pred = plan.get("seconds", {}).get(phase)
        compare[phase] = {"measured_s": secs, "plan_s": pred,
                          "plan_error": (pred - secs) / secs if pred is not None and secs else None,
                          "peak_gb": max((measured["phase_peak_gb"].get(p, 0.0) for p in parts),
                                         default=None)}
    res["per_phase"] = compare
    # what the measurement implies for the planner's constants (hardware.Efficiency): a phase's
    # time is FLOPs (or bytes) / (peak x efficiency), so efficiency x plan / measured
    eff = DEFAULT_EFFICIENCY
    implied = {}
    for const, phase in (("train_mfu", "update"), ("train_mfu (log-probs)", "log-probs"),
                         ("decode_bw (HF engine, not vLLM)", "rollout")):
        c = compare[phase]
        base = eff.train_mfu if const.startswith("train") else eff.decode_bw
        if c["plan_s"] and c["measured_s"]:
            implied[const] = {"assumed": base, "implied": base * c["plan_s"] / c["measured_s"],
                              "from_phase": phase}
    res["implied_efficiency"] = implied
    if "memory_bytes" in plan:
        res["plan_memory_gb"] = {k: plan["memory_bytes"][k] / 1e9
                                 for k in ("train_peak", "sync_peak", "rollout_peak")}
    return res


# ------------------------------------------------------------------------------ compile

def decide_compile(bench: dict) -> dict:
    """torch.compile becomes the CUDA default when, at every shape, its fwd+bwd is faster than
    eager (sdpa_chunked, the default path) and its log-probs are as close to transformers'
    (max |diff| no more than 1.5 x eager's + 1e-3: bf16 kernels fused differently round
    differently)."""
    shapes, ok = [], True
    for s in bench["shapes"]:
        rows = {r["variant"]: r for r in s["rows"]}
        eager, comp = rows.get("sdpa_chunked"), rows.get("sdpa_chunked_compile")
        if not eager or not comp or not comp.get("tokens_per_s"):
            shapes.append({"shape": s["shape"], "error": "no compile row"})
            ok = False
            continue
        speed = comp["tokens_per_s"] / eager["tokens_per_s"]
        de, dc = eager["max_abs_logprob_diff_vs_hf"], comp["max_abs_logprob_diff_vs_hf"]
        equal = de is not None and dc is not None and dc <= 1.5 * de + 1e-3
        shapes.append({"shape": s["shape"], "compile_over_eager": speed,
                       "eager_logprob_diff_vs_hf": de, "compile_logprob_diff_vs_hf": dc,
                       "logprobs_equal": equal, "faster": speed > 1.0})
        ok = ok and equal and speed > 1.0
    return {"shapes": shapes, "make_cuda_default": ok,
            "why": ("faster at every shape with equal log-probs" if ok else
                    "not faster at every shape, or log-probs differ, or a row is missing")}


def check_compile(dry: bool, out_dir: str) -> dict:
    out = os.path.join(out_dir, "bench_actor_compile.json")
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_actor.py"), "--out", out]
    # dry: a tiny shape without the compile row (inductor's CPU compile alone takes a minute
    # on two cores; decide_compile's rule has its own test)
    cmd += ["--compile-rows-only"]
    cmd += (["--shape", "64,2,4,2,128,256,2,32", "--iters", "1", "--no-compile"] if dry else
            ["--shapes", "gpu-0.79b,gpu-1.5b", "--iters", "2"])
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        return {"command": " ".join(cmd[1:]), "returncode": p.returncode,
                "error": p.stderr[-2000:]}
    bench = json.load(open(out))
    return {"command": " ".join(cmd[1:]), "bench_json": os.path.basename(out),
            **decide_compile(bench)}


# ------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("check", choices=CHECKS)
    ap.add_argument("--dry", action="store_true", help="the CPU-sized form (CI)")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/gpu"))
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds: the check stops itself then and writes what it has")
    args = ap.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        print(f"gpu_checks {args.check}: no CUDA on this machine; run it with --dry for the "
              "CPU-sized form", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    res = _header(args.check, args.dry)
    trail = os.path.join(args.out, f"{args.check}.trail.jsonl")
    if os.path.exists(trail):
        os.remove(trail)
    os.environ.update({PROGRESS_ENV: trail, T0_ENV: repr(time.time())})
    budget = Budget(args.budget)
    if args.budget is not None:  # the parent's own stages: a backstop past the ranks' timeout

        def out_of_time(*_):
            raise CheckTimeout(f"over its budget of {args.budget:.0f} s")
        signal.signal(signal.SIGALRM, out_of_time)
        signal.alarm(int(args.budget) + 15)
    t0 = time.perf_counter()
    try:
        if args.check == "collectives":
            res.update(check_collectives(args.dry))
        elif args.check == "multirank":
            res.update(check_multirank(args.dry, args.out, budget))
        elif args.check == "offload":
            res.update(check_offload(args.dry, budget))
        elif args.check == "step":
            res.update(check_step(args.dry, budget))
        else:
            res.update(check_compile(args.dry, args.out))
        res["ok"] = True
    except Exception as e:  # noqa: BLE001 - the session goes on; the JSON names the failure
        import traceback

        from megaprm.parallel.launch import RankTimeout

        res.update(ok=False, error=_first_line(e), traceback=traceback.format_exc()[-4000:])
        res["timed_out"] = isinstance(e, (CheckTimeout, subprocess.TimeoutExpired,
                                          RankTimeout))
        if isinstance(e, CheckTimeout) and len(e.args) > 1:
            res.update(e.args[1])  # what the check had when the budget ended it
    finally:
        signal.alarm(0)
    res["seconds"] = time.perf_counter() - t0
    res["load_after"] = os.getloadavg()
    res.update(_trail_summary(read_trail(trail), res["ok"]))
    path = os.path.join(args.out, f"{args.check}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"{args.check}: {'ok' if res['ok'] else 'FAILED: ' + res['error']} "
          f"({res['seconds']:.0f} s) -> {path}")
    return 0 if res["ok"] else 1


def _trail_summary(trail: list, ok: bool) -> dict:
    """The stages reached (without the records they carry) and, for a check that failed, the
    records finished before it did: the step check's steps, the offload check's models."""
    out = {"progress": [{k: v for k, v in r.items() if k not in ("step", "result")}
                        for r in trail]}
    if not ok:
        steps = [r["step"] for r in trail if "step" in r]
        models = [r["result"] for r in trail if "result" in r]
        if steps:
            out["steps_finished"] = steps
        if models:
            out["models_measured"] = models
        if trail:
            out["last_stage"] = trail[-1]["stage"]
    return out


if __name__ == "__main__":
    sys.exit(main())
