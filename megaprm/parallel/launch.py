"""Starting ranks: the one launcher every subcommand uses, and `spawn` for tests and benches.

* `add_launch_args` / `relaunch`: `megaprm <cmd> --nproc N [--nnodes M --node-rank R
  --master-addr HOST --master-port P]` re-runs `megaprm <cmd>` as torchrun ranks. megaprm parses
  its own flags and translates them into torchrun's (`--nproc-per-node`, `--nnodes`,
  `--node-rank`, `--master-addr`, `--master-port`; `--standalone` on one node), so torchrun never
  sees an argument it could misread. Ranks die with their launcher: the torchrun process gets
  SIGKILL when the launcher dies (Linux parent-death signal), each rank likewise when torchrun
  dies (`die_with_parent`, called by the CLI on every rank), and SIGINT/SIGTERM/SIGHUP sent to
  the launcher are forwarded.
* User errors inside ranks: a rank writes its one-line message to `$MEGAPRM_ERROR_DIR` and exits
  2 (`report_user_error`); the launcher prints the lowest rank's line once and exits 2, with
  torchrun's ChildFailedError report suppressed (`python -m megaprm.parallel.launch` is torchrun
  with that one change).
* `--launcher ray`: `ray_launch.relaunch` starts the same ranks as Ray actors, one command for
  every node; the rank side (`die_with_parent`, `report_user_error`) is this module's.
* `spawn(fn, world_size, *args)`: `world_size` local ranks without torchrun (tests,
  `checkpoint_tools verify`, benches). Each child gets the environment torchrun would give it
  (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), runs `fn(*args)` and sends back its
  return value or its traceback. With more ranks than GPUs the children see no GPU
  (`CUDA_VISIBLE_DEVICES=""`): multi-rank work on a one-GPU machine runs under gloo on the CPU,
  unless MEGAPRM_RANKS_SHARE_DEVICE=1 (device.ranks_share_device): then they all run on GPU 0.
  On a machine without a GPU the children are forks of a forkserver that imported torch,
  megatron-core and the trainer once (`PRELOAD`; seconds per rank saved), each taking the
  caller's environment and new RNG seeds; `start_context`/`rank_env`/`enter_rank` give other
  rank starters the same. Where CUDA is present they are fresh interpreters.
"""
from __future__ import annotations

import ctypes
import io
import os
import queue as queue_mod
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, List, Optional

from megaprm.parallel.ports import AGENT_STORE_ENV, held_store

# torch is imported where it is used: `megaprm <cmd> --help` builds its parser from this module
# and must not pay torch's import (seconds)

ERROR_DIR_ENV = "MEGAPRM_ERROR_DIR"
LAUNCH_T0_ENV = "MEGAPRM_LAUNCH_T0"  # time.time() when `megaprm` started; inherited by ranks
_PR_SET_PDEATHSIG = 1


class RankFailed(RuntimeError):
    pass


class RankTimeout(RankFailed):
    """`spawn`'s ranks did not all report within its `timeout_s` (none failed first): they were
    stopped. A caller that budgets its own time tells this from a rank's error by type."""


class LaunchError(ValueError):
    """A launch request that cannot work (too many local ranks for the GPUs, bad node rank)."""


def seconds_since_launch() -> float | None:
    """Wall seconds since the `megaprm` command started (ranks, imports included), or None
    outside the CLI."""
    t0 = os.environ.get(LAUNCH_T0_ENV)
    return time.time() - float(t0) if t0 else None


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# ------------------------------------------------------------------------------ the launcher

def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_nproc(cpu_default: int) -> int:
    """One rank per GPU where CUDA is present, else `cpu_default` ranks."""
    return gpu_count() or cpu_default


def add_launch_args(parser, cpu_default: int) -> None:
    """megaprm's launch flags (never forwarded to torchrun as written)."""
    g = parser.add_argument_group("launch (torchrun)")
    g.add_argument("--nproc", type=int, default=None,
                   help=f"ranks on this node (default: one per GPU, else {cpu_default})")
    g.add_argument("--nnodes", type=int, default=1, help="nodes in the job")
    g.add_argument("--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1")
    g.add_argument("--master-addr", default="127.0.0.1", help="host of node 0")
    g.add_argument("--master-port", type=int, default=29500, help="free port on node 0")
    parser.set_defaults(_launch_cpu_default=cpu_default)


_LAUNCH_FLAGS = ("--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port")


def strip_launch_args(argv: List[str], flags=_LAUNCH_FLAGS) -> List[str]:
    """argv without megaprm's launch flags (`--flag value` and `--flag=value` forms)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if a.split("=", 1)[0] in flags and "=" in a:
            continue
        out.append(a)
    return out


def world_size_of(args) -> int:
    return resolve_nproc(args) * args.nnodes


def resolve_nproc(args) -> int:
    nproc = args.nproc if args.nproc is not None else default_nproc(args._launch_cpu_default)
    if nproc < 1:
        raise LaunchError(f"--nproc={nproc}: must be >= 1")
    # deferred: device imports torch, which --help must not pay
    from megaprm.parallel.device import default_backend, ranks_share_device

    default_backend()  # a bad MEGAPRM_BACKEND is refused here, before any rank starts
    gpus = gpu_count()
    if gpus and nproc > gpus and not ranks_share_device():
        raise LaunchError(f"--nproc={nproc} local ranks but this machine has {gpus} GPU(s); "
                          f"use --nproc {gpus} or fewer (one rank per GPU), or set "
                          "MEGAPRM_RANKS_SHARE_DEVICE=1 to put every rank on GPU 0")
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise LaunchError(f"--node-rank={args.node_rank} with --nnodes={args.nnodes}: the node "
                          f"rank must be in 0..{args.nnodes - 1}")
    return nproc


def torchrun_args(args) -> List[str]:
    nproc = resolve_nproc(args)
    out = [f"--nproc-per-node={nproc}"]
    if args.nnodes == 1:
        out.append("--standalone")
    else:
        out += [f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}",
                f"--master-addr={args.master_addr}", f"--master-port={args.master_port}"]
    return out


def _set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Linux: have the kernel send `sig` to this process when its parent dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except OSError:
        pass


def _stop_quietly(sig, _frame) -> None:
    os._exit(128 + sig)


def die_with_parent() -> None:
    """Called on every rank: die when torchrun (our parent) dies, even by SIGKILL. Under
    megaprm's launcher a rank also stops at once and without a word on SIGINT: a terminal's
    Ctrl-C reaches every process of the foreground group, and each rank's KeyboardInterrupt
    traceback (~110 lines for two) came before the launcher's one line (which it prints; it
    forwards the signal to torchrun too). Ignoring it instead would leave the ranks to
    torchrun's SIGKILL, 30 s later."""
    expected = os.environ.get("MEGAPRM_TORCHRUN_PID")
    _set_pdeathsig()
    if os.environ.get(ERROR_DIR_ENV):
        signal.signal(signal.SIGINT, _stop_quietly)
    if expected and str(os.getppid()) != expected:  # the parent died before prctl took effect
        os._exit(1)


def relaunch(args, argv: List[str], module: str = "megaprm.cli") -> int:
    """Re-run `python -m <module> <argv minus launch flags>` as torchrun ranks; returns the exit
    code (2 after printing the first rank's user error once)."""
    return run_torchrun([*torchrun_args(args), "-m", module, *strip_launch_args(argv)])


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def run_torchrun(torchrun_argv: List[str]) -> int:
    """`python -m megaprm.parallel.launch <torchrun_argv>` (torchrun, see `_torchrun_main`) as a
    child that dies with us; SIGINT/SIGTERM/SIGHUP are forwarded. Every way it ends is one
    line: a rank's user error (exit 2), a stop by a signal we were sent (128 + signal), torchrun
    itself killed (128 + signal); a rank failure is reported by torchrun (`_torchrun_main`)."""
    cmd = [sys.executable, "-m", "megaprm.parallel.launch", *torchrun_argv]
    with tempfile.TemporaryDirectory(prefix="megaprm-errors-") as err_dir:
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   **{ERROR_DIR_ENV: err_dir})
        proc = subprocess.Popen(cmd, env=env, preexec_fn=_set_pdeathsig)
        received = []

        def forward(sig, _frame):
            received.append(sig)
            proc.send_signal(sig)

        forwarded = {s: signal.signal(s, forward)
                     for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            rc = proc.wait()
        finally:
            for s, h in forwarded.items():
                signal.signal(s, h)
            if proc.poll() is None:
                proc.kill()
        line = first_user_error(err_dir)
        if line is not None:
            print(line, file=sys.stderr)
            return 2
        if received:
            print(f"megaprm: stopped by {_signal_name(received[0])}; the ranks were stopped "
                  "with it", file=sys.stderr)
            return 128 + received[0]
        if rc < 0:  # torchrun itself was killed: its ranks die with it (parent-death signal)
            print(f"megaprm: torchrun (pid {proc.pid}) was killed by {_signal_name(-rc)}; its "
                  f"ranks died with it{_OOM_HINT if -rc == signal.SIGKILL else ''}",
                  file=sys.stderr)
            return 128 - rc
        return rc


_OOM_HINT = " (SIGKILL is also how the kernel's out-of-memory killer stops a process)"


def report_user_error(message: str) -> int:
    """On a rank: record the one-line user error for the launcher (or print it when there is no
    launcher, e.g. under a hand-written torchrun command: rank 0 only). Returns exit code 2."""
    err_dir = os.environ.get(ERROR_DIR_ENV)
    rank = int(os.environ.get("RANK", "0"))
    if err_dir and os.path.isdir(err_dir):
        with open(os.path.join(err_dir, f"rank_{rank:05d}.txt"), "w", encoding="utf-8") as f:
            f.write(message)
    elif rank == 0:
        print(message, file=sys.stderr, flush=True)
    return 2


def first_user_error(err_dir: str) -> Optional[str]:
    files = sorted(f for f in os.listdir(err_dir) if f.startswith("rank_"))
    if not files:
        return None
    with open(os.path.join(err_dir, files[0]), encoding="utf-8") as f:
        return f.read().strip()


def first_failure(failures: dict) -> tuple:
    """(rank, exit code) of the rank that failed first, from torchrun's `ChildFailedError.
    failures` (rank -> ProcessFailure). torchrun records the first failures it sees, then stops
    the other ranks (SIGTERM) and records those too, in that order and with second-resolution
    timestamps, so the earliest timestamp, then the record order decide (not the rank number:
    with rank 1 killed, rank 0's SIGTERM is not the cause)."""
    order = {r: i for i, r in enumerate(failures)}
    rank = min(failures, key=lambda r: (failures[r].timestamp, order[r]))
    return rank, failures[rank].exitcode


def describe_exit(code: int) -> str:
    if code < 0:
        hint = _OOM_HINT if -code == signal.SIGKILL else ""
        return f"was killed by {_signal_name(-code)} (exit code {code}){hint}"
    return f"failed with exit code {code}"


def _torchrun_main(argv: List[str]) -> int:
    """torchrun, quiet about a rank that exited with a user error (code 2), naming the rank that
    failed first and how, and one line (no traceback) when stopped by a signal."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ["MEGAPRM_TORCHRUN_PID"] = str(os.getpid())
    # elastic's modules set their own levels (a parent's does not reach them): quiet each one
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        codes = {r: f.exitcode for r, f in e.failures.items()}
        if 2 in codes.values():
            return 2
        rank, code = first_failure(e.failures)
        others = len(codes) - 1
        print(f"megaprm: rank {rank} {describe_exit(code)}"
              f"{f'; the other {others} rank(s) were stopped' if others else ''} (its output is "
              "above)", file=sys.stderr)
        return code if code > 0 else 128 - code
    except SignalException as e:  # a stop we were sent: the launcher (or the user) says so
        if not os.environ.get(ERROR_DIR_ENV):
            print(f"megaprm: stopped by {_signal_name(e.sigval)}", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0


# ------------------------------------------------------------------------------ spawn

@contextmanager
def hidden_gpus(hide: bool):
    """Children started inside see no GPU when `hide` (more local ranks than GPUs)."""
    if not hide or not gpu_count():
        yield
        return
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


# The modules a rank of this project imports (seconds each): the forkserver imports them once,
# and every rank it forks starts with them (see `spawn`).
PRELOAD = ("torch", "torch.distributed", "numpy", "transformers", "megatron.core",
           "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.distributed",
           "megaprm.parallel.init", "megaprm.trainer.rl.loop")
# Variables that no PRELOAD module reads while it is imported (torch reads
# CUDA_VISIBLE_DEVICES when CUDA starts, inductor its cache dir when it compiles; megatron-core
# sets NVTE_* itself when it builds a model; the rest are read by megaprm, torch.distributed,
# vLLM or Ray when used): one that differs from the forkserver's environment is simply set in
# the rank. Any other difference (HF_HUB_OFFLINE, OMP_NUM_THREADS, ...) may have been read at
# import, so its ranks start as fresh interpreters.
_LATE_ENV = ("CUDA_VISIBLE_DEVICES", "PYTEST_CURRENT_TEST", "RANK", "WORLD_SIZE", "LOCAL_RANK",
             "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")
_LATE_PREFIXES = ("MEGAPRM_", "VLLM_", "RAY_", "NVTE_", "TORCHINDUCTOR_")
_server: dict = {}  # pid and environment of the forkserver this process started


def _env_key(env) -> dict:
    return {k: v for k, v in env.items()
            if k not in _LATE_ENV and not k.startswith(_LATE_PREFIXES)}


def start_context(start_method: str = "forkserver"):
    """The multiprocessing context to start ranks with; "forkserver" (on a machine without a
    GPU; "spawn" where there is one) starts (once) a server that has imported PRELOAD and
    nothing else, with this process's environment. When the environment has changed since (a
    variable an import may read, e.g. HF_HUB_OFFLINE), or a forkserver not started here is
    running, ranks start with "spawn" instead. A rank started with the returned context calls
    `enter_rank(rank_env(ctx))` first."""
    import multiprocessing.forkserver as fs

    import torch.multiprocessing as mp

    if start_method != "forkserver":
        return mp.get_context(start_method)
    if gpu_count():
        # where CUDA is present, ranks start as fresh interpreters, as before the forkserver:
        # that no PRELOAD import initialises CUDA in the server (which would break CUDA in
        # every fork) has only been checked on machines without a GPU
        return mp.get_context("spawn")
    server = fs._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None and pid != _server.get("pid"):  # another caller's server
        return mp.get_context("spawn")
    try:
        dead = pid is not None and os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:  # a fork of the process that started it: not ours to use
        return mp.get_context("spawn")
    if pid is None or dead:  # not started yet, or it died
        if pid is not None:  # let ensure_running see it dead
            server._forkserver_pid = None
            os.close(server._forkserver_alive_fd)
        server._preload_modules = list(PRELOAD)
        env = _env_key(os.environ)
        # Python 3.11's forkserver imports PRELOAD before taking our sys.path: it must import
        # them from where this process would (this checkout's megaprm, not another install)
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        try:
            server.ensure_running()
        finally:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old
        _server.update(pid=server._forkserver_pid, env=env)
    if _env_key(os.environ) != _server["env"]:
        return mp.get_context("spawn")
    return mp.get_context("forkserver")


def rank_env(ctx) -> Optional[dict]:
    """What a rank started with `ctx` passes to `enter_rank`: this process's environment when
    the rank is a fork of the forkserver (which has its own)."""
    return dict(os.environ) if ctx.get_start_method() == "forkserver" else None


def enter_rank(env: Optional[dict]) -> None:
    """First thing in a rank: it dies with its parent; a fork of the forkserver also takes the
    caller's environment (`env`) and seeds its RNGs anew, as a fresh interpreter would."""
    _set_pdeathsig()  # never outlive the test or bench that spawned us (or its forkserver)
    if env is None:
        return
    import multiprocessing.forkserver as fs

    # the forkserver exits (and its ranks with it, by the parent-death signal) when the last
    # holder of this pipe closes it: that must be the caller alone, or a killed caller would
    # leave its ranks running
    alive = fs._forkserver._forkserver_alive_fd
    if alive is not None:
        os.close(alive)
        fs._forkserver._forkserver_alive_fd = None
    os.environ.clear()
    os.environ.update(env)
    import torch

    torch.seed()  # Python's `random` reseeds itself in a fork
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _child(rank, world_size, port, fn, args, queue, threads, env):
    enter_rank(env)
    # the caller holds the rendezvous store on `port` (ports.held_store): every rank is a client
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), **AGENT_STORE_ENV)
    import torch

    torch.set_num_threads(threads)
    try:
        result = fn(*args)
        # Serialise here: a tensor put on the queue as-is lives in shared memory that
        # disappears when this process exits, before the parent reads it.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent re-raises with this traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args, timeout_s: float = 600.0,
          start_method: str = "forkserver") -> List[Any]:
    """Run fn(*args) on `world_size` fresh processes; return each rank's result, rank order.
    `start_method` "forkserver" (default): the ranks are forks of a server process that has
    imported PRELOAD and done nothing else (started on the first call, with this process's
    environment; it ends with this process), so a rank skips the seconds of those imports; its
    environment is this process's. "spawn": fresh interpreters. "fork": forks of this process,
    with its imports (for callers that have started no threads or GPU work yet)."""
    import torch

    # deferred: device imports torch, which --help must not pay
    from megaprm.parallel.device import ranks_share_device

    ctx = start_context(start_method)
    queue = ctx.Queue()
    store = held_store()  # bound now and held until the ranks end: no port to race for
    port = store.port
    threads = max(1, (os.cpu_count() or 1) // world_size)
    with hidden_gpus(world_size > gpu_count() and not ranks_share_device()):
        env = rank_env(ctx)
        procs = [ctx.Process(target=_child,
                             args=(r, world_size, port, fn, args, queue, threads, env))
                 for r in range(world_size)]
        for p in procs:
            p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size and not errors:
            try:
                rank, ok, value = queue.get(timeout=1.0)
            except queue_mod.Empty:
                # A rank killed (os._exit, a signal, OOM) never reports: notice its exit code
                # instead of waiting out the timeout.
                dead = [(r, p.exitcode) for r, p in enumerate(procs)
                        if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    errors[dead[0][0]] = (f"rank {dead[0][0]} exited with code {dead[0][1]} "
                                          "without reporting a result or a traceback")
                elif time.monotonic() > deadline:
                    errors[-1] = (f"timed out after {timeout_s}s waiting for ranks "
                                  f"{sorted(set(range(world_size)) - set(results))}")
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank, tb = sorted(errors.items())[0]
        if rank == -1:
            raise RankTimeout(f"{world_size} rank(s): {tb}")
        raise RankFailed(f"rank {rank} of {world_size} failed:\n{tb}")
    return [results[r] for r in range(world_size)]


if __name__ == "__main__":
    sys.exit(_torchrun_main(sys.argv[1:]))
