"""Fault injection against trainer checkpoints, with real processes: a process killed between
the rename and `latest`, after the model files, or by SIGKILL at seeded random moments of a
save loop; a real full disk (a small tmpfs in a private mount namespace). After each fault the
next start resumes from an intact checkpoint holding exactly the weights that were saved.

The victim is one process per fault, in a session of its own: a fork of launch's forkserver
(which has imported torch and megatron-core once for all victims), or this file run as a script
(`python test_faults.py MODE ...`) under `unshare` for the full disk; the resume runs in the
test process.
"""
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TINY = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
CONFIG = {"advantage": {"method": "grpo"}}


# ------------------------------------------------------------------------- shared with the victim

def _build(hf, g):
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.mapping import load_hf_weights
    from megaprm.models.actor import build_stage
    from megaprm.parallel import pipeline
    from megaprm.parallel.optimizer import OptimConfig, Optimizer

    spec = spec_from_hf(hf)
    model = build_stage(spec, g)
    load_hf_weights(model, hf, spec, tp_rank=0, tp_size=1, pp=1, pp_rank=0)
    ddp = pipeline.wrap_ddp(model, g)
    return ddp, Optimizer(ddp, OptimConfig(lr=1e-2), g)


def _train_step(ddp, opt):
    opt.zero_grad()
    for p in ddp.parameters():
        p.main_grad.copy_(torch.randn_like(p) * 0.01)
    opt.step()


def _digest(ddp) -> str:
    h = hashlib.sha256()
    for k, v in sorted(ddp.module.state_dict().items()):
        if not k.endswith("_extra_state"):
            h.update(k.encode())
            h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _save(root, step, g, ddp, opt, hf, **kw):
    from megaprm.trainer.checkpoint.save import SideFiles, save

    return save(root, step, g, models={"actor": ddp}, optimizers={"actor": opt},
                sources={"actor": SideFiles(hf)},
                trainer_state={"next_step": step + 1}, config=CONFIG, **kw)


def _victim(mode: str, root: str, hf: str, arg: str) -> None:
    from megaprm.parallel.init import init_distributed
    from megaprm.trainer.checkpoint.store import CheckpointError, verify

    torch.manual_seed(0)
    g = init_distributed()
    ddp, opt = _build(hf, g)
    def say(*a):  # one write per line (under PYTHONUNBUFFERED print() writes piece by piece)
        sys.stdout.write(" ".join(map(str, a)) + "\n")
        sys.stdout.flush()
    if mode == "crash":  # save 1, then die at `arg` while saving 2
        _train_step(ddp, opt)
        _save(root, 1, g, ddp, opt, hf)
        say("saved", 1, _digest(ddp))
        _train_step(ddp, opt)
        say("saving", 2, _digest(ddp))
        _save(root, 2, g, ddp, opt, hf, crash_at=arg)
        say("survived")
    elif mode == "loop":  # save forever; the test kills us
        step = 0
        while True:
            _train_step(ddp, opt)
            say("saving", step, _digest(ddp))
            t0 = time.perf_counter()
            _save(root, step, g, ddp, opt, hf, keep_last=2)
            say("saved", step, _digest(ddp), f"{time.perf_counter() - t0:.4f}")
            step += 1
    elif mode == "enospc":  # `root` is an empty dir we may mount on (private namespace)
        scratch = root + "-measure"
        _save(scratch, 0, g, ddp, opt, hf)
        pages = sum(-(-os.path.getsize(os.path.join(d, f)) // 4096)
                    for d, _, fs in os.walk(scratch) for f in fs)
        size = int(pages * 4096 * 1.6) + 64 * 1024  # one checkpoint fits, two do not
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", root], check=True)
        out = {}
        _save(root, 1, g, ddp, opt, hf)
        _train_step(ddp, opt)
        try:
            _save(root, 2, g, ddp, opt, hf)
            out["error"] = None
        except CheckpointError as e:
            out["error"] = str(e)
        out["after_error"] = sorted(os.listdir(root))
        out["step1_problems"] = verify(os.path.join(root, "step_000001"), g)
        subprocess.run(["mount", "-o", f"remount,size={size * 3}", root], check=True)
        _save(root, 2, g, ddp, opt, hf)
        out["after_next_save"] = sorted(os.listdir(root))
        say(json.dumps(out))
    else:
        raise SystemExit(f"unknown mode {mode}")


def _start(mode, root, hf, arg="", wrap=()):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    if not wrap:
        return _Forked(mode, root, hf, arg, env)
    return subprocess.Popen([*wrap, sys.executable, os.path.abspath(__file__), mode, root, hf,
                             arg], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT, start_new_session=True)


def _forked_victim(mode, root, hf, arg, out, err):
    os.setsid()  # a session of its own, as start_new_session gives the script
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    torch.set_num_threads(1)  # OMP_NUM_THREADS=1 of the script (read at import: in the server)
    _victim(mode, root, hf, arg)


class _Forked:
    """The victim as a fork of launch's forkserver (torch and megatron-core imported once for
    all trials, not once per victim), with the part of Popen's interface these tests use: its
    own session, stdout and stderr pipes, signals, and its exit code (-signal when killed)."""

    def __init__(self, mode, root, hf, arg, env):
        from multiprocessing.connection import Connection

        from megaprm.parallel import launch

        ctx = launch.start_context()
        ends = [os.pipe(), os.pipe()]
        writers = [Connection(w, readable=False) for _, w in ends]
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)  # the victim's environment (a forkserver rank takes ours)
        try:
            self._p = ctx.Process(target=_enter_and_run, args=(
                launch.rank_env(ctx), mode, root, hf, arg, *writers))
            self._p.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
            for w in writers:
                w.close()
        self.pid = self._p.pid
        self.stdout, self.stderr = (os.fdopen(r, "r") for r, _ in ends)
        self._err: list = []
        self._readers = [threading.Thread(target=lambda: self._err.append(self.stderr.read()),
                                          daemon=True)]
        self._readers[0].start()

    @property
    def returncode(self):
        return self._p.exitcode

    def poll(self):
        return self._p.exitcode

    def send_signal(self, sig):
        if self._p.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def wait(self):
        self._p.join()
        return self._p.exitcode

    def communicate(self, timeout):
        out: list = []
        reader = threading.Thread(target=lambda: out.append(self.stdout.read()), daemon=True)
        reader.start()
        deadline = time.time() + timeout
        self._p.join(timeout)
        for t in (reader, *self._readers):
            t.join(max(0.0, deadline - time.time()))
        if self._p.exitcode is None or not out or not self._err:
            raise subprocess.TimeoutExpired("victim", timeout)
        return out[0], self._err[0]


def _enter_and_run(env, *args):
    from megaprm.parallel.launch import enter_rank

    enter_rank(env)
    _forked_victim(*args)


def _session(sid: int) -> list:
    """Pids still in session `sid` (the victim and everything it started)."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = open(f"/proc/{pid}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                out.append(int(pid))
    return out


def _finish(proc, timeout: float) -> tuple:
    """(stdout, stderr) of a victim that exits or was killed; fails if any process it started
    outlives it (an orphan), and kills those so the test leaves none."""
    try:
        out, err = proc.communicate(timeout=timeout)
        deadline = time.time() + 10
        while _session(proc.pid) and time.time() < deadline:
            time.sleep(0.2)
        orphans = _session(proc.pid)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.kill()
        proc.wait()
    assert not orphans, f"processes outlived the killed rank: {orphans}"
    return out, err


# ----------------------------------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megaprm.models.tiny import save_tiny_model

    return save_tiny_model("qwen2", str(tmp_path_factory.mktemp("hf") / "policy"), **TINY)


@pytest.fixture(scope="module")
def resume(hf_dir):
    """load(ckpt_root) in this process -> (state, digest of the loaded weights, log lines)."""
    from megaprm.parallel.init import destroy, init_distributed
    from megaprm.trainer.checkpoint.load import load

    g = init_distributed()
    ddp, opt = _build(hf_dir, g)

    def run(root):
        lines = []
        state = load(root, g, models={"actor": ddp}, optimizers={"actor": opt},
                     config=CONFIG, log=lines.append)
        return state, _digest(ddp), lines
    yield run
    destroy()


def _lines(out: str, tag: str) -> dict:
    """{step: digest} of the complete `tag` lines (a SIGKILL can cut the last line short)."""
    whole = out.split("\n")[:-1]  # the text after the last newline is an unfinished line
    return {int(p[1]): p[2] for p in map(str.split, whole) if len(p) >= 3 and p[0] == tag}


@pytest.mark.slow
@pytest.mark.parametrize("crash_at", ["after_rename", "after_models"])
def test_killed_inside_a_save_resumes(tmp_path, hf_dir, resume, crash_at):
    root = str(tmp_path / "ckpt")
    proc = _start("crash", root, hf_dir, crash_at)
    out, err = _finish(proc, 300)
    assert proc.returncode == 17 and "survived" not in out, err[-2000:]
    saved, saving = _lines(out, "saved"), _lines(out, "saving")
    state, digest, lines = resume(root)
    if crash_at == "after_rename":  # step_2 is complete, `latest` still names step_1
        assert state["step"] == 2 and digest == saving[2]
        assert len(lines) == 1 and "adopting" in lines[0]
    else:  # step_2.tmp is a leftover: step_1 it is
        assert state["step"] == 1 and digest == saved[1] and lines == []
        assert "step_000002.tmp" in os.listdir(root)
    assert open(os.path.join(root, "latest")).read() == f"step_{state['step']:06d}"


@pytest.mark.slow
def test_sigkill_at_random_moments_always_resumes(tmp_path, hf_dir, resume):
    """10 seeded trials: SIGKILL lands anywhere in a save loop; the next start resumes from the
    newest checkpoint whose save returned (or the one whose rename had just happened)."""
    for trial in range(10):
        rng = random.Random(1000 + trial)
        root = str(tmp_path / f"t{trial}")
        proc = _start("loop", root, hf_dir)
        head = []
        while not (head and head[-1].startswith("saved 1 ")):  # past the first-save warm-up
            head.append(proc.stdout.readline())
            assert head[-1], proc.stderr.read()[-2000:]
        save_s = float(head[-1].split()[3])
        time.sleep(rng.uniform(0, 3 * max(save_s, 0.05)))  # lands in one of the next ~3 saves
        proc.send_signal(signal.SIGKILL)
        rest, _ = _finish(proc, 60)
        out = "".join(head) + rest
        saved, saving = _lines(out, "saved"), _lines(out, "saving")
        state, digest, _ = resume(root)
        last = max(saved)
        assert state["step"] in (last, last + 1), (trial, state["step"], last)
        assert digest == saving[state["step"]]
        names = [n for n in os.listdir(root) if n.startswith("step_") and "." not in n]
        assert len(names) <= 3  # keep_last=2 (+ one renamed before its prune)
        assert proc.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_full_disk_real_tmpfs(tmp_path, hf_dir):
    """ENOSPC from a real 1.6-checkpoint tmpfs (mounted in a private user+mount namespace)."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("SKIPPED LOUDLY: no `unshare -rm` (user namespaces) here; the simulated "
                    "ENOSPC in test_checkpoint.py covers the logic")
    root = tmp_path / "mnt"
    root.mkdir()
    proc = _start("enospc", str(root), hf_dir, wrap=("unshare", "-rm"))
    out, err = _finish(proc, 300)
    assert proc.returncode == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    msg = res["error"]
    assert msg is not None and "\n" not in msg and "no space left on device" in msg
    assert "step_000002" in msg and "needs about" in msg and "step_000001 is intact" in msg
    assert res["after_error"] == ["latest", "step_000001"]
    assert res["step1_problems"] == []
    assert res["after_next_save"] == ["latest", "step_000001", "step_000002"]


# ------------------------------------------------- run directories, config, metrics, lock
# Single-process checks of what the launcher (preflight) and rank 0 do before and during a run.

@pytest.fixture
def g1():
    """This process as a world of one (torn down after the test)."""
    import torch.distributed as dist

    from megaprm.parallel.init import destroy, init_distributed

    ours = not dist.is_initialized()
    yield init_distributed()
    if ours:
        destroy()


def _cfg(run_dir, *more):
    from megaprm.config import load_config

    return load_config(None, [f"trainer.run_dir={run_dir}", "prm.kind=oracle", *more])


def test_fresh_start_never_overwrites_a_run(tmp_path, g1):
    """trainer.resume=false on a directory holding a run deleted its metrics and
    overwrote its checkpoints without a word. Refused in one line naming the flag; with
    trainer.replace_run=true the old run is moved aside whole, nothing deleted."""
    from megaprm.trainer.checkpoint.run_dir import start_fresh
    from megaprm.trainer.checkpoint.store import CheckpointError
    from megaprm.trainer.preflight import check_resume

    run = tmp_path / "run"
    (run / "checkpoints" / "step_000003").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (run / "config.yaml").write_text("x: 1\n")
    before = {p.relative_to(run): p.read_bytes() if p.is_file() else None for p in run.rglob("*")}
    with pytest.raises(CheckpointError) as e:
        check_resume(_cfg(run, "trainer.resume=false"), 1)
    msg = str(e.value)
    assert "\n" not in msg and "trainer.replace_run=true" in msg and "step_000003" in msg
    with pytest.raises(CheckpointError, match="trainer.replace_run=true"):
        start_fresh(str(run), g1, replace=False)
    assert {p.relative_to(run): p.read_bytes() if p.is_file() else None
            for p in run.rglob("*")} == before
    check_resume(_cfg(run, "trainer.resume=false", "trainer.replace_run=true"), 1)
    lines = []
    start_fresh(str(run), g1, replace=True, log=lines.append)
    (aside,) = [p for p in run.iterdir()]
    assert aside.name.startswith("replaced-") and str(aside) in lines[0]
    assert {p.relative_to(aside): p.read_bytes() if p.is_file() else None
            for p in aside.rglob("*")} == before
    check_resume(_cfg(run, "trainer.resume=false"), 1)  # nothing of a run left at the top


def test_resume_where_a_finished_runs_checkpoints_were_removed_is_refused(tmp_path):
    """A finished run whose checkpoints/ was removed, started again with trainer.resume=true,
    had its metrics.jsonl rewritten from step 0 without a word (resume=false was refused).
    Refused in one line naming the flags, every byte kept; a run killed before its first save
    (its rows up to that step) still starts over."""
    from megaprm.config import save_config
    from megaprm.trainer.checkpoint.store import CheckpointError
    from megaprm.trainer.preflight import check_resume

    run = tmp_path / "run"
    run.mkdir()
    earlier = _cfg(run, "trainer.steps=4")
    save_config(earlier, str(run / "config.yaml"))
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {i}}}\n' for i in range(4)))
    before = _tree(run)
    for more in ((), ("trainer.steps=8",), ("trainer.save_every=1",)):
        with pytest.raises(CheckpointError) as e:
            check_resume(_cfg(run, *more), 1)
        msg = str(e.value)
        assert "\n" not in msg and "no checkpoint" in msg and "trainer.replace_run=true" in msg
    assert _tree(run) == before
    # rows past the earlier run's first save (save_every=2: step 1) with no checkpoint
    save_config(_cfg(run, "trainer.steps=8", "trainer.save_every=2"), str(run / "config.yaml"))
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n')
    with pytest.raises(CheckpointError, match="no checkpoint"):
        check_resume(_cfg(run, "trainer.steps=8"), 1)
    # killed after logging step 1, before its first save (of step 1): runs again
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    assert check_resume(_cfg(run, "trainer.steps=8"), 1) is None


def test_replace_run_without_resume_false_is_refused():
    """trainer.replace_run=true with trainer.resume left true resumed the old run, trained 0
    steps and exited 0."""
    from megaprm.config import load_config
    from megaprm.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.replace_run=true"])
    assert "\n" not in str(e.value) and "trainer.resume=false" in str(e.value)
    assert load_config(None, ["trainer.replace_run=true", "trainer.resume=false"]).trainer.replace_run


def test_an_override_that_is_not_yaml_names_the_field():
    """`data.prompt_template={question} {` ended in a 37-line YAML traceback."""
    from megaprm.config import load_config
    from megaprm.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.prompt_template={question} {"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("override data.prompt_template=") and "quote" in msg
    quoted = msg.split("e.g. ", 1)[1].strip('"')  # the fix it names, as one shell word
    with pytest.raises(ConfigError, match=r"^data.prompt_template='\{question\} \{' is not "
                       "valid: .* braces doubled"):  # now read as a string: the field's check
        load_config(None, [quoted])
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(None, ["data.prompt_template={question} {{x}}"])
    assert load_config(None, ["data.prompt_template='{question} {{x}}'"]).data.prompt_template \
        == "{question} {{x}}"


def test_config_yaml_on_a_full_disk_is_one_line_and_leaves_no_tmp(tmp_path, monkeypatch):
    """Room for the run lock but not for config.yaml: 111 lines ending "rank 0 failed with exit
    code 1", and a 0-byte config.yaml.tmp left behind. Now a user error (one line in the
    launcher, exit 2) naming the file, ENOSPC and trainer.run_dir, and nothing left."""
    import errno

    import yaml

    from megaprm import config as config_mod

    def full(data, f, **kw):
        f.write("parallel:\n")  # a part, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(yaml, "safe_dump", full)
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.save_config(_cfg(tmp_path), str(tmp_path / "config.yaml"))
    msg = str(e.value)
    assert "\n" not in msg and "config.yaml" in msg and "ENOSPC" in msg and "trainer.run_dir" in msg
    assert os.listdir(tmp_path) == []


def _tree(root) -> dict:
    """Every path under `root` with its bytes (None for a directory)."""
    return {p.relative_to(root): p.read_bytes() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("override, says", [
    ("trainer.steps=true", "trainer.steps=True must be a number (int), not bool"),  # 35.4
    ("actor.kl_coef=nan", "actor.kl_coef=nan must be a finite number"),  # 35.4
    ("actor.optim.lr=.inf", "actor.optim.lr=inf must be a finite number"),
    ("data.max_prompt_tokens=abc", "data.max_prompt_tokens='abc' must be a number (int)"),  # 35.8
    ("rollout.n=2.5", "rollout.n=2.5 must be an integer"),
])
def test_config_numbers_are_checked_for_type_and_finiteness(override, says):
    """a bool was taken as 1, NaN was accepted (then every step was skipped,
    exit 0), and an Optional field's type error did not name the field."""
    from megaprm.config import load_config
    from megaprm.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_config_numbers_still_widen_and_allow_null():
    from megaprm.config import load_config

    cfg = load_config(None, ["actor.kl_coef=1", "actor.dual_clip_c=3", "actor.optim.lr=1e-5",
                             "data.max_prompt_tokens=null"])
    assert cfg.actor.kl_coef == 1.0 and isinstance(cfg.actor.kl_coef, float)
    assert cfg.actor.dual_clip_c == 3.0 and cfg.actor.optim.lr == 1e-5
    assert cfg.data.max_prompt_tokens is None


def test_torn_last_metrics_line_is_dropped_on_resume(tmp_path, capsys):
    """a torn last line in metrics.jsonl (a full disk) made every restart fail."""
    from megaprm.trainer.metrics import MetricsLogger, read_metrics

    run = tmp_path / "run"
    log = MetricsLogger(str(run), enabled=True, wandb_mode="disabled")
    for step in range(3):
        log.log(step, {"reward": step / 2})
    with open(log.path, "a") as f:
        f.write('{"step": 3, "rew')  # the write of step 3 cut short
    assert [r["step"] for r in read_metrics(str(run))] == [0, 1, 2]
    log.truncate_after(1)  # resumed from the checkpoint of step 1
    assert "dropped a torn last line" in capsys.readouterr().out
    log.log(2, {"reward": 7.0})
    assert read_metrics(str(run)) == [{"step": 0, "reward": 0.0}, {"step": 1, "reward": 0.5},
                                      {"step": 2, "reward": 7.0}]
    # the torn line is the row of the step its checkpoint saved: restored from it, not lost
    saved = {"step": 2, "reward": 7.0}
    with open(log.path, "r+") as f:
        f.truncate(os.path.getsize(log.path) - 5)
    log.truncate_after(2, saved)
    assert "step 2's row restored from its checkpoint" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(str(run))] == [0, 1, 2]
    assert read_metrics(str(run))[-1] == saved
    with open(log.path, "r+") as f:  # no row in the checkpoint (an older one): said to be lost
        f.truncate(os.path.getsize(log.path) - 5)
    log.truncate_after(2)
    assert "step 2 was checkpointed, so its row is lost" in capsys.readouterr().out
    log.log(2, {"reward": 7.0})
    with open(log.path, "a") as f:  # a bad line before the last is no torn write: named
        f.write("garbage\n" + '{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:4 is not a metrics row"):
        log.truncate_after(3)


def test_unreadable_lock_of_no_live_process_is_taken_over(tmp_path, monkeypatch):
    """a full disk at start left an empty lock file; every restart then said 'in
    use by an unknown process'. Now a start on a full disk leaves no lock, an unreadable lock
    no process holds is taken over, and one a live process holds is still refused."""
    import fcntl

    from megaprm.trainer import run_lock
    from megaprm.trainer.run_lock import RunLock, RunLockError

    run = tmp_path / "run"
    run.mkdir()
    lock = run / run_lock.LOCK_FILE
    lock.write_bytes(b"")  # what the old code left on a full disk
    os.utime(lock, (time.time() - 60, time.time() - 60))
    held = os.open(lock, os.O_RDONLY)  # a live holder (its own open file, flock()ed)
    fcntl.flock(held, fcntl.LOCK_EX)
    with pytest.raises(RunLockError, match="unknown process"):
        RunLock(str(run)).acquire()
    os.close(held)
    taken = RunLock(str(run)).acquire()
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    taken.release()
    assert os.listdir(run) == []

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run_lock.os, "fsync", full)
    with pytest.raises(RunLockError, match="No space left on device") as e:
        RunLock(str(run)).acquire()
    assert "\n" not in str(e.value) and os.listdir(run) == []  # no lock left behind
    monkeypatch.undo()
    RunLock(str(run)).acquire().release()


def test_unclear_inputs_are_one_line_naming_what_and_where(tmp_path, hf_dir):
    """a data.path directory ('does not exist'), a .json array ('bad JSON'), a broken
    config.json (no file named), missing tokenizer files ('prompt 0 is empty')."""
    from megaprm.errors import ConfigError
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.tasks.datasets import DataError, load_prompts
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.preflight import check_rl_launch

    bare = str(tmp_path / "bare")
    shutil.copytree(hf_dir, bare)
    with pytest.raises(ValueError, match=r"^model.path: .*bare holds no tokenizer"):
        check_rl_launch(_cfg(tmp_path / "run", f"model.path={bare}"), 1)
    pol = str(tmp_path / "pol")
    shutil.copytree(hf_dir, pol)
    build_char_tokenizer(pol)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with pytest.raises(ConfigError, match=r"data.path=.*data' is a directory"):
        check_rl_launch(_cfg(tmp_path / "run", f"model.path={pol}", "data.task=math",
                             f"data.path={data_dir}", "prm.kind=none", "advantage.method=grpo"), 1)
    with pytest.raises(DataError, match=r"data' is a directory|data is a directory"):
        load_prompts(data_dir)
    array = data_dir / "p.json"
    array.write_text(json.dumps([{"problem": "1+1", "answer": "2"}], indent=1))
    with pytest.raises(DataError, match=r"p.json holds a JSON array; .* jq -c"):
        load_prompts(array)
    _follow_the_array_hint(data_dir / "array.jsonl")
    with open(os.path.join(pol, "config.json"), "r+") as f:
        f.truncate(40)
    with pytest.raises(ValueError, match=r"pol/config.json is not valid JSON"):
        spec_from_hf(pol)


def _follow_the_array_hint(array):
    """The hint for a JSON array in a .jsonl file, run as written in the file's directory: it
    once redirected jq's output onto its own input (the shell empties the file first, so the
    data was gone). Now the array is still there and the new file loads."""
    from megaprm.tasks.datasets import DataError, load_prompts

    rows = [{"problem": "1+1", "answer": "2"}, {"problem": "2+2", "answer": "4"}]
    array.write_text(json.dumps(rows, indent=1))
    before = array.read_bytes()
    with pytest.raises(DataError) as e:
        load_prompts(array)
    hint = str(e.value).split("convert it into a new file, never onto itself: ", 1)[1]
    command = hint.split(", then pass", 1)[0]
    if shutil.which("jq") is None:
        pytest.skip("jq is not installed: the hint's command cannot be run")
    subprocess.run(["bash", "-c", command], cwd=array.parent, check=True)
    assert array.read_bytes() == before
    out = array.parent / command.rsplit("> ", 1)[1]
    assert [json.loads(x) for x in out.read_text().splitlines()] == rows


def test_a_wrong_shaped_tensor_is_named_before_loading(tmp_path, hf_dir, g1):
    """a tensor of the wrong shape in the trainer was a 91-line traceback."""
    from safetensors.torch import load_file, save_file

    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.actor import build_stage
    from checkpoint_tools import model_source

    bad = str(tmp_path / "bad")
    shutil.copytree(hf_dir, bad)
    sd = load_file(os.path.join(bad, "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    sd[name] = sd[name][:, :-1].contiguous()
    save_file(sd, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    spec = spec_from_hf(bad)
    model = build_stage(spec, g1)
    with pytest.raises(ValueError) as e:
        model_source.load_weights(model, model_source.resolve(bad), spec, g1)
    assert "\n" not in str(e.value) and f"shape mismatch for {name}" in str(e.value)


def test_a_huge_row_is_refused_before_it_is_tokenised(tmp_path):
    """a 60 MB prompt line took one rank to 21 GB (an OOM kill). A row over
    MAX_ROW_BYTES is a bad row (skipped and reported, or named under on_bad_row=error) before
    it is decoded, parsed or tokenised."""
    from megaprm.tasks import datasets

    big = "x" * (datasets.MAX_ROW_BYTES + 10)
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (
        {"problem": "1+1", "answer": "2"}, {"problem": big, "answer": "3"},
        {"problem": "2+2", "answer": "4"})) + "\n")

    class Counting:  # a tokenizer that records what it was given
        seen = 0

        def __call__(self, text, **kw):
            Counting.seen = max(Counting.seen, len(text))
            return {"input_ids": list(range(len(text)))}

    records, report = datasets.load_prompts(path, max_prompt_tokens=10 ** 7,
                                            long_prompt="truncate", tokenizer=Counting())
    assert [r.answer for r in records] == ["2", "4"] and report.skip_kinds["too big"] == 1
    assert "line 2: row is 1.0 MiB > 1 MiB" in report.summary() and Counting.seen < 10
    with pytest.raises(datasets.DataError, match=r"p.jsonl line 2: row is 1.0 MiB"):
        datasets.load_prompts(path, on_bad_row="error")


# --------------------------------------------------------- which rank failed, and how (35.10)

_RANK = """import ctypes, os, signal, sys, time
ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # dies with torchrun, as launch.die_with_parent
if sys.argv[1] == "ctrlc":  # the hook every megaprm rank calls first
    from megaprm.parallel import launch
    launch.die_with_parent()
rank = int(os.environ["RANK"])
os.write(1, b"up %d\\n" % rank)  # one write: atomic on a pipe, so the ranks' lines never interleave
if rank == 1 and sys.argv[1] == "kill1":
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""


def _torchrun(tmp_path, mode, launcher):
    """Two ranks of a tiny script (no torch) under megaprm's torchrun, directly or through the
    launcher (`launch.run_torchrun`, as `megaprm train` runs it)."""
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    targs = ["--standalone", "--nproc-per-node=2", str(script), mode]
    cmd = ([sys.executable, "-c", "import sys; from megaprm.parallel import launch; "
            f"sys.exit(launch.run_torchrun({targs!r}))"] if launcher else
           [sys.executable, "-m", "megaprm.parallel.launch", *targs])
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    up, seen = set(), []
    while up != {"up 0", "up 1"}:
        seen.append(proc.stdout.readline())
        assert seen[-1], (seen, proc.stderr.read()[-2000:])
        up |= {seen[-1].strip()} & {"up 0", "up 1"}
    return proc


def _children(pid: int) -> list:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                stat = open(f"/proc/{p}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(p))
    return out


@pytest.mark.slow
def test_the_rank_that_died_first_is_named_with_its_signal(tmp_path):
    """with rank 1 killed, the launcher said 'rank 0 failed with exit code -15'."""
    proc = _torchrun(tmp_path, "kill1", launcher=False)
    _, err = _finish(proc, 60)
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 128 + signal.SIGKILL, err[-2000:]
    assert last.startswith("megaprm: rank 1 was killed by SIGKILL (exit code -9)"), last
    assert "the other 1 rank(s) were stopped" in last and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill_torchrun", "sigterm_launcher"])
def test_launcher_stops_are_one_line(tmp_path, fault):
    """torchrun killed -> exit 247 and no message; SIGTERM to the launcher -> a
    traceback. Now one line each, exit 128 + signal, and no rank outlives it."""
    proc = _torchrun(tmp_path, "sleep", launcher=True)
    if fault == "kill_torchrun":
        (torchrun,) = _children(proc.pid)
        os.kill(torchrun, signal.SIGKILL)
        want = (128 + signal.SIGKILL, f"megaprm: torchrun (pid {torchrun}) was killed by SIGKILL")
    else:
        proc.send_signal(signal.SIGTERM)
        want = (128 + signal.SIGTERM, "megaprm: stopped by SIGTERM")
    _, err = _finish(proc, 60)
    lines = err.strip().splitlines()
    assert proc.returncode == want[0] and len(lines) == 1, err[-3000:]
    assert lines[0].startswith(want[1]), lines[0]


def test_ctrl_c_is_one_line_without_rank_tracebacks(tmp_path):
    """Ctrl-C in a terminal (SIGINT to the whole foreground group: launcher, torchrun and every
    rank) exited 130 with the right last line after ~110 lines of the ranks' KeyboardInterrupt
    tracebacks. Ranks started by the launcher stop at once without a word: one line, exit 130,
    within seconds, no rank left."""
    proc = _torchrun(tmp_path, "ctrlc", launcher=True)
    ranks = [p for t in _children(proc.pid) for p in _children(t)]
    assert len(ranks) == 2, ranks
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends
    t0 = time.monotonic()
    _, err = _finish(proc, 60)
    assert time.monotonic() - t0 < 15, "the ranks waited for torchrun's SIGKILL (30 s)"
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert err.strip().splitlines() == ["megaprm: stopped by SIGINT; the ranks were stopped "
                                        "with it"], err[-3000:]
    for pid in ranks:
        assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read(
        ).rsplit(")", 1)[1].split()[0], f"rank {pid} outlived the launcher"


@pytest.mark.parametrize("argv", [
    ["demo"], ["compare"], ["train", "--config", "configs/grpo_tiny.yaml"],
    ["train-prm", "--config", "configs/prm/tiny.yaml"], ["plan", "configs/grpo_tiny.yaml"],
    ["plot", "runs/x"], ["eval", "--model", "m", "--benchmarks", "math500"],
    ["convert", "verify", "--hf", "a", "--ckpt", "b"]])
def test_an_interrupt_in_any_command_is_one_line(argv, monkeypatch, capsys):
    """Whatever command a KeyboardInterrupt stops (the launcher's preflight, a single-process
    command): one line naming the command and SIGINT, exit 130, no traceback."""
    from megaprm import cli

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    parser = cli._parser
    monkeypatch.setattr(cli, "_parser", lambda: _interrupting(parser(), interrupted))
    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"megaprm {argv[0]}: stopped by SIGINT (Ctrl-C)"], err


def _interrupting(parser, fn):
    """`parser` with every subcommand's function replaced by `fn`."""
    import argparse

    for action in parser._subparsers._group_actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.set_defaults(fn=fn)
    return parser


def _fake_step(root, step, state) -> str:
    """A step directory holding only trainer.json, sealed by a MANIFEST as the trainer does."""
    from checkpoint_tools import manifest

    d = os.path.join(root, f"step_{step:06d}")
    os.makedirs(d)
    with open(os.path.join(d, "trainer.json"), "w") as f:
        json.dump({"step": step, "next_step": step + 1, **state}, f)
    manifest.write(d)
    return d


def test_preflight_reads_only_verified_trainer_json_and_falls_back(tmp_path):
    """a torn trainer.json in the newest checkpoint failed preflight with a bare JSON
    error and the fallback to the previous intact checkpoint was never tried."""
    from megaprm.trainer.checkpoint.store import CheckpointError
    from megaprm.trainer.preflight import check_resume
    from megaprm.trainer.run_config import config_digest_fields

    run = tmp_path / "run"
    cfg = _cfg(run)
    root = str(run / "checkpoints")
    # the previous checkpoint has another layout: a refusal naming it proves preflight read it
    _fake_step(root, 1, {"world_size": 2, "tp": 1, "pp": 1, "config": config_digest_fields(cfg)})
    newest = _fake_step(root, 2, {"world_size": 1, "tp": 1, "pp": 1,
                                  "config": config_digest_fields(cfg)})
    check_resume(cfg, 1)  # intact newest: same layout, same config
    with open(os.path.join(newest, "trainer.json"), "r+") as f:
        f.truncate(10)  # torn
    with pytest.raises(CheckpointError, match=r"step_000001 was written with "
                       r"\(world, tp, pp\) = \(2, 1, 1\)"):
        check_resume(cfg, 1)
    with pytest.raises(CheckpointError) as e:
        check_resume(_cfg(run, "trainer.resume_fallback=false"), 1)
    assert "step_000002 is damaged" in str(e.value) and "trainer.resume_fallback" in str(e.value)
    with open(os.path.join(newest, "trainer.json"), "w") as f:  # edited, valid JSON
        json.dump({"step": 2, "world_size": 2, "tp": 1, "pp": 1}, f)
    with pytest.raises(CheckpointError, match="step_000001"):
        check_resume(cfg, 1)


if __name__ == "__main__":
    _victim(*sys.argv[1:5])
