"""`--launcher ray` without a cluster: the torchrun environment each actor's rank gets, the
flags the ranks must not see, and the one-line errors that need no Ray start (no Ray installed,
a bad or silent --ray-address, torchrun-only flags). Training under Ray, a killed actor and the
processes left behind: tests/test_megaprm_cli.py."""
import argparse
import sys

import pytest

from megaprm.parallel import launch, ray_launch
from megaprm.parallel.launch import LaunchError
from megaprm.parallel.ports import free_port


def _args(*argv):
    ap = argparse.ArgumentParser()
    launch.add_launch_args(ap, cpu_default=1)
    ray_launch.add_ray_args(ap)
    return ap.parse_args(list(argv))


@pytest.mark.parametrize("nproc,nnodes", [(1, 1), (2, 1), (2, 3), (4, 2)])
def test_rank_env_is_torchruns_packed_per_node(nproc, nnodes):
    """torchrun on node n with --nproc-per-node P gives local rank l the global rank n*P + l;
    every rank of a node sees that node's GPUs of the job, and LOCAL_RANK indexes its own."""
    world = nproc * nnodes
    gpus = {n: [str(7 - i) for i in range(nproc)] for n in range(nnodes)}  # Ray's ids, any order
    seen = set()
    for n in range(nnodes):
        for local in range(nproc):
            rank = n * nproc + local
            env = ray_launch.rank_env(rank, nproc, nnodes, ("10.0.0.1", 1234), gpus[n])
            assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == str(world)
            assert env["LOCAL_RANK"] == str(local) and env["LOCAL_WORLD_SIZE"] == str(nproc)
            assert env["GROUP_RANK"] == str(n)
            assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "1234")
            assert env["CUDA_VISIBLE_DEVICES"].split(",")[local] == gpus[n][local]
            seen.add(rank)
    assert seen == set(range(world))
    assert ray_launch.rank_env(0, 2, 1, ("h", 1), [])["CUDA_VISIBLE_DEVICES"] == ""


def test_ranks_see_neither_launch_nor_ray_flags():
    argv = ["train", "--config", "c.yaml", "--launcher", "ray", "--ray-address=auto", "--nproc",
            "2", "--nnodes=1", "trainer.steps=2", "--launcher=ray", "--ray-address", "h:1"]
    assert ray_launch.rank_argv(argv) == ["train", "--config", "c.yaml", "trainer.steps=2"]


def test_forwarded_env_keeps_megaprm_and_thread_settings(monkeypatch):
    monkeypatch.setenv("MEGAPRM_RUN_DIR_LOCKED", "/r")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HOSTNAME", "driver-host")  # a remote node keeps its own
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = ray_launch.forwarded_env()
    assert env["MEGAPRM_RUN_DIR_LOCKED"] == "/r" and env["WANDB_MODE"] == "offline"
    assert "HOSTNAME" not in env and "PATH" not in env
    assert env["OMP_NUM_THREADS"] == "1"  # as launch.relaunch gives torchrun ranks


@pytest.mark.parametrize("argv,needle", [
    (["--ray-address", "auto"], "--ray-address=auto needs --launcher ray"),
    (["--launcher", "ray", "--node-rank", "1", "--nnodes", "2", "--ray-address", "auto"],
     "drop --node-rank"),
    (["--launcher", "ray", "--nnodes", "2"], "--nnodes=2 needs a Ray cluster"),
    (["--launcher", "ray", "--nproc", "0"], "--nproc=0"),
])
def test_launch_flags_that_cannot_work_under_ray(argv, needle):
    args = _args(*argv)
    with pytest.raises(LaunchError, match=needle) as e:
        if ray_launch.wanted(args):
            ray_launch.check_args(args)
    assert "\n" not in str(e.value)


def test_without_ray_installed_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(LaunchError, match=r"pip install -e '\.\[ray\]'"):
        ray_launch._import_ray()


def test_a_bad_or_silent_address_fails_fast():
    with pytest.raises(LaunchError, match="expected auto or HOST:PORT"):
        ray_launch._check_reachable("headnode")
    port = free_port()  # nothing listens on it: refused at once
    with pytest.raises(LaunchError, match=f"127.0.0.1:{port}: no Ray head answers there"):
        ray_launch._check_reachable(f"127.0.0.1:{port}")


def test_a_killed_rank_is_named_with_its_signal_as_under_torchrun():
    """kill -9 of a rank under Ray said "failed with exit code -9", exit 1; torchrun says
    "was killed by SIGKILL", exit 137. The same line and code now (the rank's subprocess
    exit code is what the actor reports)."""
    import signal
    import types

    from megaprm.parallel import launch, ray_launch

    class Ref:  # one rank's outcome, as ray.get returns it
        def __init__(self, rc):
            self.rc = rc

    class FakeRay:
        exceptions = types.SimpleNamespace(RayActorError=RuntimeError)

        @staticmethod
        def wait(pending, num_returns=1, timeout=None):
            return pending[:num_returns], pending[num_returns:]

        @staticmethod
        def get(ref):
            return ref.rc, None

    refs = [Ref(-signal.SIGKILL), Ref(-signal.SIGTERM)]  # rank 0 killed; rank 1 then stopped
    rc, line = ray_launch._wait(FakeRay, refs, [])
    assert rc == 128 + signal.SIGKILL
    assert line == f"megaprm: rank 0 {launch.describe_exit(-signal.SIGKILL)} (its output is above)"
    assert line.startswith("megaprm: rank 0 was killed by SIGKILL (exit code -9)")
    assert ray_launch._wait(FakeRay, [Ref(0), Ref(3)], []) == (
        3, "megaprm: rank 1 failed with exit code 3 (its output is above)")


def test_no_cluster_at_the_address_names_megaprms_fix():
    """`--ray-address auto` with no cluster ended in Ray's line naming its own `--address` flag
    and RAY_ADDRESS; the line now names `ray start --head` and megaprm's --ray-address."""
    from megaprm.parallel import ray_launch
    from megaprm.parallel.launch import LaunchError

    class NoCluster:
        @staticmethod
        def init(**kw):
            raise ConnectionError("Could not find any running Ray instance. Please specify the "
                                  "one to connect to by setting `--address` flag or "
                                  "`RAY_ADDRESS` environment variable.")

    with pytest.raises(LaunchError) as e:
        ray_launch._connect(NoCluster, "auto", 2)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--ray-address=auto: Could not find any running")
    assert "ray start --head" in msg and "RAY_ADDRESS" not in msg and "`--address`" not in msg
