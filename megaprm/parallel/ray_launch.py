"""Starting ranks as Ray actors: `megaprm <cmd> --launcher ray [--ray-address auto|HOST:PORT]
--nproc N [--nnodes M]`, the Ray counterpart of `launch.relaunch` (torchrun).

* One command, on any node of the cluster, starts every rank: a placement group of M bundles,
  one per node (`STRICT_SPREAD` over distinct nodes), each holding N GPUs (N CPUs on a cluster
  without GPUs), and N actors per bundle. Ranks are packed per node: rank = node * N + local
  rank, rank 0's node is MASTER_ADDR with a port free there. A cluster that cannot place the
  group within $MEGAPRM_RAY_PLACEMENT_TIMEOUT_S (300 s: an autoscaler may be adding nodes) is
  one line saying what it has.
* Each actor only holds a node-local process: `python -m megaprm.cli <the same argv>` with the
  environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT; CUDA_VISIBLE_DEVICES = the node's GPUs of this job in local-rank
  order, so LOCAL_RANK picks the actor's own GPU as under torchrun). So the rank body is the
  torchrun one, line for line: `die_with_parent` ties the rank to its actor (the actor's pid
  stands in for torchrun's), user errors go through `$MEGAPRM_ERROR_DIR` (a node-local
  directory the actor reads back), and the driver prints the lowest rank's line once, exit 2.
* The driver keeps the torchrun path's promises: preflight and the run-dir lock happen before
  `relaunch` (in the CLI), the first rank that fails or whose actor dies stops the others, and
  every actor, the placement group and a Ray started here are gone when the command returns
  (SIGINT/SIGTERM/SIGHUP included). A driver killed with SIGKILL takes its actors along: a
  local Ray shares the driver's fate, and a cluster kills the actors of a job whose driver died.
* No --ray-address: a local Ray for this command (num_cpus = max(ranks, cores), no dashboard,
  a small object store: the ranks exchange nothing through it). `auto`: the cluster `ray start`
  made on this node. HOST:PORT: that head's GCS port, checked with a plain TCP connect first
  because `ray.init` waits minutes on an address that does not answer.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from megaprm.parallel.launch import (
    ERROR_DIR_ENV,
    LaunchError,
    describe_exit,
    first_user_error,
    resolve_nproc,
    strip_launch_args,
)
from megaprm.parallel.ports import free_port

INSTALL_HINT = "--launcher ray needs Ray: pip install -e '.[ray]' (or pip install ray)"
RAY_FLAGS = ("--launcher", "--ray-address")
# how long to wait for the cluster to place the ranks: an autoscaling cluster may need minutes
# to bring up nodes, a fixed one that lacks them never will
PLACEMENT_TIMEOUT_ENV = "MEGAPRM_RAY_PLACEMENT_TIMEOUT_S"
PLACEMENT_TIMEOUT_S = 300.0
CONNECT_TIMEOUT_S = 5.0
OBJECT_STORE_BYTES = 100 * 1024 * 1024
# the ranks' output as under torchrun: without Ray's "(rank1 pid=...)" prefix and its colour,
# and a line that several ranks print is printed by each, not folded into one
RAY_ENV_DEFAULTS = {"RAY_DISABLE_WORKER_LOG_PREFIX": "1", "RAY_COLOR_PREFIX": "0",
                    "RAY_DEDUP_LOGS": "0"}
# driver variables every rank gets (the rest of a remote node's environment is its own)
FORWARDED_ENV_PREFIXES = ("MEGAPRM_", "WANDB_", "HF_", "TRANSFORMERS_", "TOKENIZERS_",
                          "NCCL_", "TORCH_")
FORWARDED_ENV = ("OMP_NUM_THREADS", "PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG")


def add_ray_args(parser) -> None:
    g = parser.add_argument_group("launch (Ray)")
    g.add_argument("--launcher", choices=("torchrun", "ray"), default="torchrun",
                   help="torchrun: one command per node (default); ray: one command starts the "
                        "ranks of every node as Ray actors")
    g.add_argument("--ray-address", default=None,
                   help="with --launcher ray: 'auto' (the cluster `ray start` made on this "
                        "node) or HOST:PORT of its head; default: a local Ray for this command")


def wanted(args) -> bool:
    """True when `args` ask for the Ray launcher (LaunchError for Ray flags without it)."""
    launcher = getattr(args, "launcher", "torchrun")
    if launcher != "ray" and getattr(args, "ray_address", None):
        raise LaunchError(f"--ray-address={args.ray_address} needs --launcher ray")
    return launcher == "ray"


def rank_argv(argv: list[str]) -> list[str]:
    """What each rank runs: argv without the torchrun and the Ray launch flags."""
    return strip_launch_args(strip_launch_args(argv), flags=RAY_FLAGS)


def check_args(args) -> None:
    """Launch flags that mean nothing under Ray, and the nproc/nnodes layout."""
    resolve_nproc(args)
    if args.node_rank != 0:
        raise LaunchError(f"--node-rank={args.node_rank}: under --launcher ray one command starts "
                          "the ranks of every node; drop --node-rank")
    if args.nnodes > 1 and not args.ray_address:
        raise LaunchError(f"--nnodes={args.nnodes} needs a Ray cluster: start one (`ray start "
                          "--head` on one node, `ray start --address HEAD:6379` on the others) "
                          "and pass --ray-address auto or HEAD:6379")


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise LaunchError(f"{INSTALL_HINT} ({e})") from e
    return ray


def _check_reachable(address: str) -> None:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise LaunchError(f"--ray-address={address}: expected auto or HOST:PORT (the head's GCS "
                          "port, 6379 unless `ray start --port` said otherwise)")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise LaunchError(f"--ray-address={address}: no Ray head answers there ({e}); start one "
                          "with `ray start --head` or check the host and port") from None


def _connect(ray, address: str | None, world_size: int) -> None:
    quiet = {"logging_level": logging.WARNING, "log_to_driver": True}
    if address is None:
        ray.init(num_cpus=max(world_size, os.cpu_count() or 1), include_dashboard=False,
                 object_store_memory=OBJECT_STORE_BYTES, **quiet)
        return
    if address != "auto":
        _check_reachable(address)
    try:
        ray.init(address=address, **quiet)
    except ConnectionError as e:  # Ray's own text names its flags (--address, RAY_ADDRESS)
        why = str(e).splitlines()[0].split(". Please", 1)[0]
        raise LaunchError(f"--ray-address={address}: {why}; start a cluster with `ray start "
                          "--head` and pass --ray-address auto (on its nodes) or HEAD:6379, or "
                          "leave --ray-address out for a local Ray of this command's own"
                          ) from None


# ------------------------------------------------------------------------------ the actor

class RankActor:
    """Holds one rank's process on its node (a Ray actor class once `_actor_class` wraps it)."""

    def __init__(self, rank: int):
        self.rank = rank

    def __repr__(self) -> str:  # Ray's name for the actor: "(rank1 pid=...)" in its messages
        return f"rank{self.rank}"

    def where(self) -> tuple[str, list[str]]:
        import ray

        return ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()]

    def free_port(self) -> int:
        return free_port(host="")  # on the actor's node, reachable from the others

    def run(self, module: str, argv: list[str], cwd: str, env: dict) -> tuple[int, str | None]:
        """Run the rank to its end: (exit code, its one-line user error or None). No
        preexec_fn (unsafe in this threaded process): the rank ties itself to this actor with
        `die_with_parent`, MEGAPRM_TORCHRUN_PID naming the actor."""
        if not os.path.isdir(cwd):
            return 2, (f"megaprm: the working directory {cwd} does not exist on Ray node "
                       f"{socket.gethostname()}: run from a directory every node shares")
        with tempfile.TemporaryDirectory(prefix="megaprm-errors-") as err_dir:
            full = {**os.environ, **env, ERROR_DIR_ENV: err_dir,
                    "MEGAPRM_TORCHRUN_PID": str(os.getpid())}
            rc = subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, env=full,
                                check=False).returncode
            return rc, first_user_error(err_dir)


def _actor_class(ray):
    return ray.remote(max_restarts=0, max_task_retries=0)(RankActor)


# ------------------------------------------------------------------------------ the driver

class _Stopped(Exception):
    """A signal the driver received (SIGINT/SIGTERM/SIGHUP): stop every rank."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _check_stop(stop: list) -> None:
    """Raise _Stopped for a signal noted by the handler. The handler only notes it: an exception
    raised inside a Ray call (where Python runs signal handlers) comes out mangled."""
    if stop:
        raise _Stopped(stop[0])


def _summary(e: BaseException) -> str:
    """The last line of a remote error: its exception and message, without the traceback."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


def forwarded_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k.startswith(FORWARDED_ENV_PREFIXES) or k in FORWARDED_ENV}
    env.setdefault("OMP_NUM_THREADS", "1")  # as under torchrun (launch.relaunch)
    env["PYTHONUNBUFFERED"] = "1"  # Ray forwards the ranks' output as it is written
    return env


def rank_env(rank: int, nproc: int, nnodes: int, master: tuple[str, int],
             node_gpus: list[str]) -> dict:
    """The torchrun variables of `rank` (packed per node: rank = node * nproc + local rank);
    `node_gpus` are the GPU ids of its node's ranks in local-rank order ([] without GPUs)."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(nproc * nnodes), "LOCAL_RANK": str(rank % nproc),
           "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(rank // nproc),
           "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])}
    env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
    return env


def _place(ray, nproc: int, nnodes: int, stop: list):
    """A placement group of one bundle per node; returns it and whether the ranks get GPUs."""
    from ray.util.placement_group import placement_group, remove_placement_group

    resources = ray.cluster_resources()
    use_gpu = resources.get("GPU", 0) > 0
    bundle = {"CPU": nproc, "GPU": nproc} if use_gpu else {"CPU": nproc}
    pg = placement_group([bundle] * nnodes, strategy="STRICT_SPREAD" if nnodes > 1 else "PACK")
    timeout = float(os.environ.get(PLACEMENT_TIMEOUT_ENV, PLACEMENT_TIMEOUT_S))
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    fit = sum(all(res.get(k, 0) >= v for k, v in bundle.items()) for res in nodes)
    what = (f"{nnodes} node(s) x {nproc} {'GPU' if use_gpu else 'CPU'} rank(s) (it has "
            f"{len(nodes)} node(s), {fit} of them with " + " and ".join(
                f"{v} {k}" for k, v in bundle.items()) + ")")
    if fit < nnodes:  # an autoscaler may still add nodes: say what we wait for
        print(f"megaprm: waiting up to {timeout:g}s ({PLACEMENT_TIMEOUT_ENV}) for the Ray cluster "
              f"to place {what}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout
    while not pg.wait(timeout_seconds=1):  # 1 s at a time: Ctrl-C stops the wait
        if stop or time.monotonic() > deadline:
            remove_placement_group(pg)
            _check_stop(stop)
            raise LaunchError(f"the Ray cluster cannot place {what}; lower --nproc/--nnodes or "
                              "add nodes")
    return pg, use_gpu



def _start_actors(ray, pg, use_gpu: bool, nproc: int, nnodes: int) -> list:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cls = _actor_class(ray)
    return [cls.options(num_cpus=1, num_gpus=1 if use_gpu else 0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            pg, placement_group_bundle_index=rank // nproc)).remote(rank)
            for rank in range(nproc * nnodes)]


def _outcome(ray, ref) -> tuple[int, str | None]:
    """(exit code, user error line or None) of one rank; (-1, None) when its actor died."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError:
        return -1, None


def _wait(ray, refs: list, stop: list) -> tuple[int, str | None]:
    """Wait for every rank; after the first failure (other than a dead actor: nothing else
    to wait for) give the others a second to report theirs, then return (the caller kills the
    rest). Returns (exit code, the line to print or None)."""
    pending, failures = list(refs), {}
    while pending and not failures:
        _check_stop(stop)  # looked at every second: ray.wait's timeout
        done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
        if not done:
            continue
        rc, line = _outcome(ray, done[0])
        if rc != 0:
            failures[refs.index(done[0])] = (rc, line)
    if not failures:
        return 0, None
    first = next(iter(failures))  # the root cause; the others mostly fail because of it
    if pending and failures[first][0] != -1:
        # ranks that hit the same user error at the same point; and the failed rank's output
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=1.0)
        for ref in done:
            failures[refs.index(ref)] = _outcome(ray, ref)
    user = sorted((r, line) for r, (_, line) in failures.items() if line is not None)
    if user:  # the lowest rank's user error, as under torchrun
        return 2, user[0][1]
    rc = failures[first][0]
    if rc == -1:
        return 1, (f"megaprm: rank {first}'s Ray actor died before the rank finished (killed, "
                   "out of memory, or its node left the cluster); the other ranks were stopped")
    # as under torchrun (`launch._torchrun_main`): a signal named, exit 128 + signal
    return (rc if rc > 0 else 128 - rc), (f"megaprm: rank {first} {describe_exit(rc)} (its "
                                          "output is above)")


def relaunch(args, argv: list[str], module: str = "megaprm.cli") -> int:
    """Run `python -m <module> <argv minus launch flags>` as Ray actors' ranks; returns the exit
    code (2 after printing the first rank's user error once)."""
    check_args(args)
    nproc, nnodes = resolve_nproc(args), args.nnodes
    # read when ray is imported; a setting of the user's wins
    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if args.ray_address is None:
        # a local Ray with token auth, as Ray's default, without its warning saying so
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    ray = _import_ray()
    actors, pg, old, stop = [], None, {}, []
    try:
        _connect(ray, args.ray_address, nproc * nnodes)
        # after ray.init, whose fatal-signal handler would abort on SIGTERM without cleaning up
        old = {s: signal.signal(s, lambda signum, _f: stop.append(signum))
               for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        pg, use_gpu = _place(ray, nproc, nnodes, stop)
        actors = _start_actors(ray, pg, use_gpu, nproc, nnodes)
        try:
            where = ray.get([a.where.remote() for a in actors])
        except ray.exceptions.RayActorError as e:
            raise LaunchError(f"the Ray rank actors did not start ({_summary(e)}); megaprm "
                              "must be importable, at the same version, on every node") from None
        master = (where[0][0], ray.get(actors[0].free_port.remote()))
        env = forwarded_env()
        refs = []
        for rank, actor in enumerate(actors):
            node = rank // nproc
            node_gpus = [g for _ip, gpus in where[node * nproc:(node + 1) * nproc] for g in gpus]
            refs.append(actor.run.remote(module, rank_argv(argv), os.getcwd(),
                                         {**env, **rank_env(rank, nproc, nnodes, master,
                                                            node_gpus)}))
        rc, line = _wait(ray, refs, stop)
    except (KeyboardInterrupt, _Stopped) as e:  # KeyboardInterrupt: before the handlers
        signum = e.signum if isinstance(e, _Stopped) else signal.SIGINT
        rc, line = 128 + signum, f"megaprm: {signal.Signals(signum).name}: stopped the Ray ranks"
    finally:
        if ray.is_initialized():
            for a in actors:
                ray.kill(a, no_restart=True)
            if pg is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(pg)
            ray.shutdown()
        for s, h in old.items():
            signal.signal(s, h)
    if line is not None:
        print(line, file=sys.stderr, flush=True)
    return rc
