"""Trainer checkpoints: checkpoint_tools layout per model, manifest verification and fallback,
idempotent rename/`latest`, ENOSPC, keep_last, non-finite weights, config digest, run lock;
single process and 2 gloo ranks (the ranks must agree: no rank raises while another waits)."""
import copy
import errno
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from megaprm.trainer.checkpoint.load import load as load_checkpoint
from megaprm.trainer.checkpoint.save import SideFiles
from megaprm.trainer.checkpoint.save import save as save_checkpoint
from megaprm.trainer.checkpoint.store import CheckpointError, verify
from megaprm.trainer.run_config import config_digest
from megaprm.trainer.run_lock import RunLock, RunLockError
from tests.distributed_utils import run_distributed

TINY = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
CONFIG = {"advantage": {"method": "prof_grpo", "prof": {"remove": 2}}, "model": {"path": "m"}}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megaprm.models.tiny import save_tiny_model

    return save_tiny_model("qwen2", str(tmp_path_factory.mktemp("hf") / "policy"), **TINY)


@pytest.fixture(scope="module")
def groups():
    from megaprm.parallel.init import destroy, init_distributed

    g = init_distributed()
    yield g
    destroy()


def _build(hf, g):
    """A tiny actor (Megatron DDP) with an AdamW state from one random-gradient step."""
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.mapping import load_hf_weights
    from megaprm.models.actor import build_stage
    from megaprm.parallel import pipeline
    from megaprm.parallel.optimizer import OptimConfig, Optimizer

    spec = spec_from_hf(hf)
    model = build_stage(spec, g)
    load_hf_weights(model, hf, spec, tp_rank=g.tp_rank, tp_size=g.tp_size, pp=g.pp_size,
                    pp_rank=g.pp_rank)
    ddp = pipeline.wrap_ddp(model, g)
    opt = Optimizer(ddp, OptimConfig(lr=1e-2), g)
    _train_step(ddp, opt)
    return ddp, opt


def _train_step(ddp, opt):
    opt.zero_grad()
    for p in ddp.parameters():
        p.main_grad.copy_(torch.randn_like(p) * 0.01)
    opt.step()


def _weights(ddp) -> dict:
    return {k: v.detach().clone() for k, v in ddp.module.state_dict().items()
            if not k.endswith("_extra_state")}


def _save(root, step, g, ddp, opt, hf, **kw):
    return save_checkpoint(str(root), step, g, models={"actor": ddp}, optimizers={"actor": opt},
                           sources={"actor": SideFiles(hf)},
                           trainer_state={"next_step": step + 1, "skipped_steps": 0},
                           config=kw.pop("config", CONFIG), **kw)


def _load(root, g, ddp, opt, **kw):
    return load_checkpoint(str(root), g, models={"actor": ddp}, optimizers={"actor": opt},
                           config=kw.pop("config", CONFIG), **kw)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _scribble(path, offset_frac=0.5, n=4096, seed=0):
    """Overwrite n bytes in the middle of a file with random bytes (same size)."""
    size = os.path.getsize(path)
    start = int(size * offset_frac)
    noise = torch.randint(0, 256, (min(n, size - start),), generator=torch.Generator().manual_seed(
        seed), dtype=torch.uint8).numpy().tobytes()
    with open(path, "r+b") as f:
        f.seek(start)
        old = f.read(len(noise))
        if old == noise:
            noise = bytes(b ^ 0xFF for b in noise)
        f.seek(start)
        f.write(noise)


def _distcp(step_dir):
    model_dir = os.path.join(step_dir, "actor", "model")
    return sorted(os.path.join(model_dir, f) for f in os.listdir(model_dir)
                  if f.endswith(".distcp"))


def test_layout_roundtrip_and_checkpoint_tools_meta(tmp_path, hf_dir, groups):
    from checkpoint_tools import layout

    ddp, opt = _build(hf_dir, groups)
    saved_w, saved_opt = _weights(ddp), copy.deepcopy(opt.state_dict())
    torch.manual_seed(5)
    path = _save(tmp_path, 3, groups, ddp, opt, hf_dir)
    expect_rand = torch.rand(3)
    assert sorted(os.listdir(path)) == ["MANIFEST.json", "actor", "rank_00000.pt", "trainer.json"]
    assert sorted(os.listdir(os.path.join(path, "actor"))) == ["hf", "megaprm_checkpoint.json",
                                                               "model"]
    assert set(layout.side_files(hf_dir)) == set(os.listdir(os.path.join(path, "actor", "hf")))
    meta = layout.CheckpointMeta.read(os.path.join(path, "actor"))
    assert (meta.architecture, meta.dtype, meta.tp, meta.pp) == ("Qwen2ForCausalLM", "fp32", 1, 1)
    manifest = json.load(open(os.path.join(path, "MANIFEST.json")))
    assert set(manifest["files"]) == {os.path.relpath(os.path.join(d, f), path)
                                      for d, _, fs in os.walk(path) for f in fs} - {"MANIFEST.json"}
    assert open(os.path.join(tmp_path, "latest")).read() == "step_000003"

    _train_step(ddp, opt)  # move away from the saved state, then come back
    assert not _same(_weights(ddp), saved_w)
    state = _load(tmp_path, groups, ddp, opt)
    assert state["step"] == 3 and state["next_step"] == 4 and state["path"] == path
    assert state["config_digest"] == config_digest(CONFIG)
    assert _same(_weights(ddp), saved_w)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved_opt["state"][0]["exp_avg"])
    assert torch.equal(torch.rand(3), expect_rand)  # RNG restored


@pytest.mark.parametrize("target", ["distcp", "rank_file", "metadata_deleted", "truncated"])
def test_damaged_latest_falls_back_to_previous(tmp_path, hf_dir, groups, target):
    ddp, opt = _build(hf_dir, groups)
    _save(tmp_path, 1, groups, ddp, opt, hf_dir)
    good = _weights(ddp)
    _train_step(ddp, opt)
    step2 = _save(tmp_path, 2, groups, ddp, opt, hf_dir)
    if target == "distcp":
        victim = _distcp(step2)[0]
        _scribble(victim)
    elif target == "rank_file":
        victim = os.path.join(step2, "rank_00000.pt")
        _scribble(victim, 0.3, 512)
    elif target == "metadata_deleted":
        victim = os.path.join(step2, "actor", "model", ".metadata")
        os.remove(victim)
    else:
        victim = _distcp(step2)[0]
        os.truncate(victim, os.path.getsize(victim) // 2)
    rel = os.path.relpath(victim, step2)

    with pytest.raises(CheckpointError, match=re.escape(f"{step2} is damaged: {rel}")):
        _load(tmp_path, groups, ddp, opt, fallback=False)
    lines = []
    state = _load(tmp_path, groups, ddp, opt, log=lines.append)
    assert state["step"] == 1 and _same(_weights(ddp), good)
    assert len(lines) == 1 and "step_000002" in lines[0] and rel in lines[0] and "\n" not in lines[0]
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000001", "step_000002.damaged"]
    assert open(os.path.join(tmp_path, "latest")).read() == "step_000001"


def test_crash_between_rename_and_latest_is_adopted(tmp_path, hf_dir, groups):
    """The disk state of a crash after `step_2.tmp -> step_2` and before `latest` was rewritten,
    with a leftover .tmp of a later attempt: the next start adopts step_2, the next save cleans."""
    ddp, opt = _build(hf_dir, groups)
    _save(tmp_path, 1, groups, ddp, opt, hf_dir)
    _train_step(ddp, opt)
    _save(tmp_path, 2, groups, ddp, opt, hf_dir)
    at_two = _weights(ddp)
    (tmp_path / "latest").write_text("step_000001")
    (tmp_path / "step_000003.tmp" / "actor").mkdir(parents=True)
    (tmp_path / "latest.tmp").write_text("")
    _train_step(ddp, opt)
    lines = []
    state = _load(tmp_path, groups, ddp, opt, log=lines.append)
    assert state["step"] == 2 and _same(_weights(ddp), at_two)
    assert len(lines) == 1 and "adopting" in lines[0] and "step_000001" in lines[0]
    assert (tmp_path / "latest").read_text() == "step_000002"
    _save(tmp_path, 3, groups, ddp, opt, hf_dir)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000001", "step_000002", "step_000003"]
    # Saving a step that already exists (re-reached after a fallback) replaces it.
    _train_step(ddp, opt)
    _save(tmp_path, 3, groups, ddp, opt, hf_dir)
    assert verify(str(tmp_path / "step_000003"), groups) == []
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000001", "step_000002", "step_000003"]


def test_enospc_one_line_previous_intact_no_leftovers(tmp_path, hf_dir, groups, monkeypatch):
    ddp, opt = _build(hf_dir, groups)
    _save(tmp_path, 1, groups, ddp, opt, hf_dir)
    real_save = torch.save

    def full_disk(obj, f, *a, **k):  # half a file, then the disk is full
        real_save(obj, f, *a, **k)
        if isinstance(f, str):
            os.truncate(f, os.path.getsize(f) // 2)
        raise OSError(errno.ENOSPC, "No space left on device", str(f))

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError) as e:
        _save(tmp_path, 2, groups, ddp, opt, hf_dir)
    msg = str(e.value)
    assert "\n" not in msg and "no space left on device" in msg
    assert str(tmp_path / "step_000002") in msg and re.search(r"needs about [\d.]+ (MiB|GiB)", msg)
    assert "step_000001 is intact" in msg
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000001"]
    assert verify(str(tmp_path / "step_000001"), groups) == []
    monkeypatch.setattr(torch, "save", real_save)
    _save(tmp_path, 2, groups, ddp, opt, hf_dir)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000001", "step_000002"]


def test_keep_last_prunes_oldest(tmp_path, hf_dir, groups):
    ddp, opt = _build(hf_dir, groups)
    for step in range(5):
        _save(tmp_path, step, groups, ddp, opt, hf_dir, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000003", "step_000004"]
    assert _load(tmp_path, groups, ddp, opt)["step"] == 4


def test_nonfinite_weights_never_saved(tmp_path, hf_dir, groups):
    ddp, opt = _build(hf_dir, groups)
    _save(tmp_path, 1, groups, ddp, opt, hf_dir)
    name, p = next((n, p) for n, p in ddp.module.named_parameters() if "linear_fc2" in n)
    with torch.no_grad():
        p.view(-1)[7] = float("nan")
    with pytest.raises(CheckpointError, match=rf"not saving checkpoint step_000002: actor "
                                              rf"parameter {re.escape(name)} holds NaN/inf"):
        _save(tmp_path, 2, groups, ddp, opt, hf_dir)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000001"]


def test_config_digest_mismatch_names_keys(tmp_path, hf_dir, groups):
    ddp, opt = _build(hf_dir, groups)
    _save(tmp_path, 1, groups, ddp, opt, hf_dir)
    changed = {"advantage": {"method": "grpo", "prof": {"remove": 2}}, "model": {"path": "m"},
               "data": {"path": "x"}}
    with pytest.raises(CheckpointError) as e:
        _load(tmp_path, groups, ddp, opt, config=changed)
    msg = str(e.value)
    assert "advantage.method: 'prof_grpo' -> 'grpo'" in msg and "data.path: '<absent>' -> 'x'" \
        in msg and "model.path" not in msg and "\n" not in msg
    assert _load(tmp_path, groups, ddp, opt, config=changed, allow_config_change=True)["step"] == 1
    reordered = {"model": {"path": "m"}, "advantage": {"prof": {"remove": 2},
                                                       "method": "prof_grpo"}}
    assert _load(tmp_path, groups, ddp, opt, config=reordered)["step"] == 1


def test_no_checkpoint_and_legacy_checkpoint(tmp_path, hf_dir, groups):
    ddp, opt = _build(hf_dir, groups)
    assert _load(tmp_path / "none", groups, ddp, opt) is None
    (tmp_path / "old" / "step_000005" / "actor").mkdir(parents=True)  # no MANIFEST.json
    with pytest.raises(CheckpointError, match=r"step_000005 is damaged: no MANIFEST.json.*no "
                                              r"earlier intact checkpoint"):
        _load(tmp_path / "old", groups, ddp, opt)


# ------------------------------------------------------------------------------------ run lock

def test_lock_refuses_second_holder_and_takes_over_stale(tmp_path):
    import socket

    run = str(tmp_path / "run")
    with RunLock(run) as lock:
        with pytest.raises(RunLockError, match=rf"is in use by pid {os.getpid()} on host "
                                               rf"{re.escape(socket.gethostname())}"):
            RunLock(run).acquire()
        assert lock.held
    assert not os.path.exists(os.path.join(run, ".megaprm.lock"))

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(os.path.join(run, ".megaprm.lock"), "w") as f:
        json.dump({"pid": dead.pid, "host": socket.gethostname(), "started": 0}, f)
    lock = RunLock(run).acquire()
    assert json.load(open(lock.path))["pid"] == os.getpid()
    lock.release()

    with open(os.path.join(run, ".megaprm.lock"), "w") as f:  # another host: cannot tell
        json.dump({"pid": dead.pid, "host": "elsewhere-node", "started": 0}, f)
    with pytest.raises(RunLockError, match=r"elsewhere-node.*delete .*\.megaprm\.lock"):
        RunLock(run).acquire()


def test_lock_in_another_process_refuses(tmp_path):
    run = str(tmp_path / "run")
    code = ("import sys, time; from megaprm.trainer.run_lock import RunLock\n"
            f"RunLock({run!r}).acquire(); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockError, match=rf"pid {holder.pid} "):
            RunLock(run).acquire()
    finally:
        holder.kill()
        holder.wait()
    RunLock(run).acquire().release()  # the dead holder's lock is stale now


# ------------------------------------------------------------------------------------- 2 ranks

def _two_ranks(rank, world, hf, root):
    import multiprocessing

    from megaprm.parallel.init import init_distributed

    # dist_checkpointing writes through (joined) worker processes; the harness's ranks are
    # daemonic, which multiprocessing refuses to give children. torchrun's ranks are not.
    multiprocessing.current_process()._config["daemon"] = False
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))  # what init_distributed reads

    g = init_distributed()
    ddp, opt = _build(hf, g)
    out = {}
    _save(root, 1, g, ddp, opt, hf)
    good = _weights(ddp)
    _train_step(ddp, opt)
    step2 = _save(root, 2, g, ddp, opt, hf)
    torch.distributed.barrier()
    if rank == 0:
        _scribble(os.path.join(step2, "rank_00001.pt"), 0.5, 256)  # the OTHER rank's file
    torch.distributed.barrier()
    lines = []
    state = _load(root, g, ddp, opt, log=lines.append)
    out["fallback_step"] = state["step"]
    out["fallback_weights_ok"] = _same(_weights(ddp), good)
    out["lines"] = lines

    # ENOSPC on rank 1 only: both ranks raise the same one line, nobody hangs.
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(f))

    if rank == 1:
        torch.save = full_disk
    try:
        _save(root, 3, g, ddp, opt, hf)
        out["enospc"] = None
    except CheckpointError as e:
        out["enospc"] = str(e)
    finally:
        torch.save = real_save
    # NaN on rank 1 only: both refuse.
    if rank == 1:
        with torch.no_grad():
            next(ddp.module.parameters()).view(-1)[0] = float("inf")
    try:
        _save(root, 3, g, ddp, opt, hf)
        out["nan"] = None
    except CheckpointError as e:
        out["nan"] = str(e)
    torch.distributed.barrier()
    out["listing"] = sorted(os.listdir(root))
    return out


def test_two_ranks_agree_on_damage_enospc_and_nan(tmp_path, hf_dir):
    root = str(tmp_path / "ckpt")
    r0, r1 = run_distributed(_two_ranks, 2, hf_dir, root, timeout=240)
    assert r0["fallback_step"] == r1["fallback_step"] == 1
    assert r0["fallback_weights_ok"] and r1["fallback_weights_ok"]
    assert len(r0["lines"]) == 1 and "rank_00001.pt fails its checksum" in r0["lines"][0]
    assert r1["lines"] == []  # rank 0 reports
    assert r0["enospc"] == r1["enospc"] and "no space left on device (rank 1)" in r0["enospc"]
    assert r0["nan"] == r1["nan"] and "holds NaN/inf (on 1 rank(s))" in r0["nan"]
    assert r0["listing"] == ["latest", "step_000001", "step_000002.damaged"]


def test_trainer_checkpoint_exports_with_checkpoint_tools(tmp_path, hf_dir, groups):
    """step_N/actor is a checkpoint_tools checkpoint: export-hf writes HF weights equal to the
    trained (saved) ones, and the side files travel."""
    from safetensors.torch import load_file

    from checkpoint_tools import export_hf
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.mapping import load_hf_weights
    from megaprm.models.actor import build_stage

    ddp, opt = _build(hf_dir, groups)
    _train_step(ddp, opt)
    path = _save(tmp_path / "ckpt", 0, groups, ddp, opt, hf_dir)
    out = str(tmp_path / "exported")
    export_hf(os.path.join(path, "actor"), out)  # a 1-rank export runs here, then tears down
    from megaprm.parallel.init import init_distributed

    groups = init_distributed()
    assert os.path.isfile(os.path.join(out, "config.json"))
    fresh = build_stage(spec_from_hf(out), groups)
    load_hf_weights(fresh, out, spec_from_hf(out), tp_rank=0, tp_size=1, pp=1, pp_rank=0)
    vocab = spec_from_hf(out).vocab_size  # rows past it are Megatron's padding, not exported
    got = {k: v for k, v in fresh.state_dict().items() if not k.endswith("_extra_state")}
    want = _weights(ddp)
    assert got.keys() == want.keys()
    for k in want:
        cut = vocab if k in ("embedding.word_embeddings.weight", "output_layer.weight") else None
        assert torch.equal(got[k][:cut], want[k][:cut]), k
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert exported.keys() == original.keys()
    assert not torch.equal(exported["model.norm.weight"], original["model.norm.weight"])


def test_a_newer_checkpoint_of_another_run_is_never_adopted(tmp_path, hf_dir, groups):
    """A reused run directory held an earlier run's step_3; the new run's resume
    (latest -> its step_1) adopted step_3 as 'a save was interrupted'. A checkpoint newer than
    `latest` is adopted only when the same run wrote it (run id and config digest)."""
    ddp, opt = _build(hf_dir, groups)
    root = str(tmp_path / "ckpt")

    def save(step, run_id, config=CONFIG):
        return save_checkpoint(root, step, groups, models={"actor": ddp},
                               optimizers={"actor": opt},
                               trainer_state={"next_step": step + 1, "run_id": run_id},
                               config=config)

    save(3, "earlier")
    _train_step(ddp, opt)
    save(1, "current")
    mine = _weights(ddp)
    _train_step(ddp, opt)
    lines = []
    state = _load(root, groups, ddp, opt, log=lines.append)
    assert state["step"] == 1 and state["run_id"] == "current" and _same(_weights(ddp), mine)
    assert len(lines) == 1 and "another run" in lines[0] and "step_000003" in lines[0]
    assert sorted(os.listdir(root)) == ["latest", "step_000001", "step_000003.other-run"]
    # the same run's newer complete save (a crash before `latest`) is still adopted
    save(2, "current")
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("step_000001")
    state = _load(root, groups, ddp, opt, log=lines.append)
    assert state["step"] == 2 and "adopting" in lines[-1]
