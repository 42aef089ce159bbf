"""`launch.spawn`'s ranks are forks of a forkserver that has imported PRELOAD: each runs with the
caller's environment and RNG seeds of its own (as a fresh interpreter would), a rank's exception
or death is reported, no rank outlives `spawn`, and the ranks die with a killed caller. (The
trainer, checkpoint and fault tests run on these ranks too.)"""
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from megaprm.parallel import launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _probe():
    import huggingface_hub.constants
    import numpy as np
    import torch

    return {"pid": os.getpid(), "ppid": os.getppid(), "tag": os.environ.get("MEGAPRM_TEST_TAG"),
            "rank": os.environ["RANK"], "preloaded": "megatron.core" in sys.modules,
            "offline": huggingface_hub.constants.HF_HUB_OFFLINE,  # read when imported
            "draws": (random.random(), float(np.random.rand()), torch.initial_seed())}


def _raise():
    raise ValueError("boom on purpose")


def _exit():
    os._exit(7)


def _sleep(pid_dir):
    with open(os.path.join(pid_dir, os.environ["RANK"]), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ranks_are_fresh_forks_with_the_callers_environment(monkeypatch):
    if launch.gpu_count():
        pytest.skip("with a GPU present ranks start as fresh interpreters (see the next test)")
    a, b = launch.spawn(_probe, 2)
    assert [a["rank"], b["rank"]] == ["0", "1"]
    assert a["ppid"] == b["ppid"] != os.getpid()  # forks of the forkserver, not of this process
    assert a["preloaded"] and b["preloaded"] and a["tag"] is None
    again = launch.spawn(_probe, 2)
    draws = [r["draws"] for r in (a, b, *again)]
    for i in range(3):  # Python, numpy and torch RNGs: new entropy in every rank
        assert len({d[i] for d in draws}) == 4, draws
    assert not any(_alive(r["pid"]) for r in (a, b, *again))  # none left behind
    # set after the server started: megaprm's own variables are read when used (forks) ...
    monkeypatch.setenv("MEGAPRM_TEST_TAG", "x")
    c, d = launch.spawn(_probe, 2)
    assert c["tag"] == d["tag"] == "x" and c["ppid"] == d["ppid"] == a["ppid"]
    # ... others may be read at import (huggingface_hub's offline switch): fresh interpreters
    monkeypatch.setenv("HF_HUB_OFFLINE", "0" if a["offline"] else "1")
    e, f = launch.spawn(_probe, 2)
    assert e["offline"] == f["offline"] == (not a["offline"]) and e["tag"] == "x"
    assert e["ppid"] == f["ppid"] == os.getpid()


def test_with_a_gpu_present_ranks_are_fresh_interpreters(monkeypatch):
    """Where CUDA is present the forkserver is not used (a CUDA-initialising import in the server
    would break CUDA in every fork; only checked without a GPU)."""
    monkeypatch.setattr(launch, "gpu_count", lambda: 1)
    assert launch.start_context().get_start_method() == "spawn"
    a, b = launch.spawn(_probe, 2)
    assert a["ppid"] == b["ppid"] == os.getpid() and a["rank"] != b["rank"]


def test_a_rank_that_raises_or_dies_is_reported():
    with pytest.raises(launch.RankFailed, match="(?s)rank [01] of 2 failed.*boom on purpose"):
        launch.spawn(_raise, 2)
    with pytest.raises(launch.RankFailed, match="exited with code 7 without reporting"):
        launch.spawn(_exit, 2)


def _rank1_sleeps(pid_dir):
    if os.environ["RANK"] == "1":
        _sleep(pid_dir)
    return "done"


def test_ranks_out_of_time_are_named_stopped_and_raised_as_a_timeout(tmp_path):
    """Rank 0 reports, rank 1 never does: `spawn` raises RankTimeout (a RankFailed, so a caller
    that handles rank failures still catches it) naming the rank still out, and stops it."""
    # (rank 0 too, on a box so loaded that its start takes the whole timeout)
    with pytest.raises(launch.RankTimeout, match=r"2 rank\(s\): timed out after 8s waiting "
                                                 r"for ranks \[(0, )?1\]") as e:
        launch.spawn(_rank1_sleeps, 2, str(tmp_path), timeout_s=8)
    assert isinstance(e.value, launch.RankFailed)
    assert os.listdir(tmp_path) in (["1"], [])  # [] only when rank 1 never got to start
    assert not any(_alive(int((tmp_path / n).read_text())) for n in os.listdir(tmp_path))
    with pytest.raises(launch.RankFailed) as e:  # a rank's own error is not a timeout
        launch.spawn(_raise, 2)
    assert not isinstance(e.value, launch.RankTimeout)


def test_ranks_die_with_a_killed_caller(tmp_path):
    caller = subprocess.Popen(
        [sys.executable, "-c", "import sys; from megaprm.parallel import launch; "
         "from tests.parallel.test_launch_spawn import _sleep; launch.spawn(_sleep, 2, sys.argv[1])",
         str(tmp_path)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), start_new_session=True)
    try:
        deadline = time.time() + 120
        while len(os.listdir(tmp_path)) < 2:
            assert caller.poll() is None and time.time() < deadline, "the ranks never started"
            time.sleep(0.2)
        time.sleep(0.2)  # both pid files written in full
        pids = [int(open(tmp_path / r).read()) for r in ("0", "1")]
        assert all(_alive(p) for p in pids)
        caller.send_signal(signal.SIGKILL)
        caller.wait()
        deadline = time.time() + 30
        while any(_alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), "ranks outlived their killed caller"
    finally:
        try:
            os.killpg(caller.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        caller.wait()
