"""Several ranks on one device (device.ranks_share_device, MEGAPRM_RANKS_SHARE_DEVICE=1): every
local rank's device is GPU 0, the default backend is gloo where local ranks share a GPU (NCCL
refuses two ranks of one communicator on one GPU) and NCCL where each has its own, a forced
MEGAPRM_BACKEND wins (nccl without CUDA: a clear error), and `launch.spawn` keeps the GPU visible
for such ranks. CUDA's presence is patched where the answer depends on it; the 2-rank run is the
CPU stand-in (gloo, each rank reporting the device and backend it was given)."""
import os

import pytest
import torch

from megaprm.parallel import device, launch


@pytest.mark.parametrize("share,local_rank,expected", [("0", "1", 1), ("1", "1", 0),
                                                       ("1", "3", 0), ("", "2", 2)])
def test_rank_device_is_gpu_0_for_every_rank_when_ranks_share(monkeypatch, share, local_rank,
                                                              expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv(device.SHARE_ENV, share)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert device.rank_device() == torch.device("cuda", expected)


@pytest.mark.parametrize("cuda,share,local_world,forced,expected", [
    (False, "1", "2", "", "gloo"), (True, "0", "2", "", "nccl"), (True, "1", "2", "", "gloo"),
    (True, "1", "1", "", "nccl"), (True, "1", "2", "nccl", "nccl"),
    (True, "0", "2", "gloo", "gloo")])
def test_default_backend(monkeypatch, cuda, share, local_world, forced, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setenv(device.SHARE_ENV, share)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    monkeypatch.setenv(device.BACKEND_ENV, forced)
    assert device.default_backend() == expected


def test_a_forced_backend_that_cannot_work_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(device.BACKEND_ENV, "nccl")
    with pytest.raises(ValueError, match="MEGAPRM_BACKEND=nccl needs CUDA"):
        device.default_backend()
    monkeypatch.setenv(device.BACKEND_ENV, "mpi")
    with pytest.raises(ValueError, match=r"MEGAPRM_BACKEND='mpi': expected one of"):
        device.default_backend()


def test_spawn_keeps_the_gpu_visible_only_for_ranks_that_share_it(monkeypatch):
    """More ranks than GPUs: hidden (the CPU fallback) unless the ranks share GPU 0; `--nproc`
    past the GPU count is refused only without sharing."""
    from types import SimpleNamespace

    seen = []
    monkeypatch.setattr(launch, "gpu_count", lambda: 1)
    monkeypatch.setattr(launch, "hidden_gpus", lambda hide: seen.append(hide) or _null())
    monkeypatch.setattr(launch, "start_context", lambda m: _NoStart())
    args = SimpleNamespace(nproc=2, nnodes=1, node_rank=0, _launch_cpu_default=2)
    for share in ("0", "1"):
        monkeypatch.setenv(device.SHARE_ENV, share)
        with pytest.raises(_Stop):
            launch.spawn(print, 2)
        if share == "0":
            with pytest.raises(launch.LaunchError, match="MEGAPRM_RANKS_SHARE_DEVICE=1"):
                launch.resolve_nproc(args)
        else:
            assert launch.resolve_nproc(args) == 2
    assert seen == [True, False]


class _Stop(Exception):
    pass


class _NoStart:
    """A start context that stops at the first rank's start (after the GPU decision)."""

    def Queue(self):  # noqa: N802 - multiprocessing's name
        return None

    def get_start_method(self):
        return "spawn"

    def Process(self, **kw):  # noqa: N802
        raise _Stop


def _null():
    import contextlib

    return contextlib.nullcontext()


def _ranks():
    from megaprm.parallel.init import init_distributed

    g = init_distributed()
    t = torch.full((2,), float(g.rank + 1), device=device.rank_device())
    torch.distributed.all_reduce(t)
    return {"device": str(device.rank_device()), "backend": g.backend, "sum": t.tolist(),
            "local_rank": os.environ.get("LOCAL_RANK")}


def test_two_ranks_sharing_the_device_stand_in(monkeypatch):
    """2 gloo ranks with MEGAPRM_RANKS_SHARE_DEVICE=1 on the CPU: both on the one device
    (the CPU; cuda:0 on a GPU machine), the gloo backend, a collective across them."""
    monkeypatch.setenv(device.SHARE_ENV, "1")
    out = launch.spawn(_ranks, 2)
    assert [o["local_rank"] for o in out] == ["0", "1"]
    assert {o["device"] for o in out} == {"cuda:0" if torch.cuda.is_available() else "cpu"}
    assert {o["backend"] for o in out} == {"gloo"}
    assert all(o["sum"] == [3.0, 3.0] for o in out)


def test_a_bad_backend_is_refused_before_any_rank_starts(tmp_path):
    """`megaprm train --nproc 2` with MEGAPRM_BACKEND=mpi: one line naming the variable, exit 2,
    printed once, and the run directory never created."""
    import subprocess
    import sys

    from megaprm.models.tiny import save_tiny_model
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from tests.rl_setup import DEMO_YAML

    tok = build_char_tokenizer()
    policy = save_tiny_model("qwen2", str(tmp_path / "policy"), tokenizer=tok,
                             vocab_size=len(tok), hidden_size=32, num_layers=1, num_heads=4,
                             num_kv_heads=2, intermediate_size=64)
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "megaprm.cli", "train", "--config", DEMO_YAML,
                        "--nproc", "2", f"trainer.run_dir={run}", f"model.path={policy}",
                        "prm.kind=none", "advantage.method=grpo"],
                       env={**os.environ, device.BACKEND_ENV: "mpi"}, capture_output=True,
                       text=True, timeout=300)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-2000:]
    assert "MEGAPRM_BACKEND='mpi'" in lines[0] and not run.exists()
