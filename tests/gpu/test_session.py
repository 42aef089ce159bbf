"""The GPU session script (scripts/gpu_session.sh -> scripts/gpu_checks.py) on the CPU: its dry
run starts, runs every check's CPU-sized form and leaves one JSON per check whose numbers hold
(every gloo collective on the shared device stand-in, the multi-rank selection collected,
offload's bytes all returned and bit-exact on reload, the step's four planned phases measured
beside the plan and the lifecycle in its order, the compile decision made). Not GPU-marked: it
runs in the CPU tier. The GPU run itself is not tested here (no GPU)."""
import json
import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)

from scripts.gpu_checks import CHECKS, PLAN_PHASES, decide_compile  # noqa: E402


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-dry")
    files = out.parent / (out.name + "-files")  # the session's default: beside $OUT
    env = {**os.environ, "DRY": "1", "OUT": str(out), "PYTHON": sys.executable,
           "CHECKS": " ".join(CHECKS)}
    env.pop("RESULTS", None)
    p = subprocess.run(["bash", "scripts/gpu_session.sh"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    # what a device call brings back (at most 8 files): the archive and the summary alone
    assert sorted(os.listdir(out)) == ["gpu_session.tgz", "summary.txt"]
    with tarfile.open(out / "gpu_session.tgz") as tar:
        packed = {os.path.basename(n) for n in tar.getnames()}
    assert {f"{c}.json" for c in CHECKS} | {"machine.txt", "summary.txt"} <= packed, packed
    assert len((out / "summary.txt").read_text().splitlines()) == len(CHECKS)
    res = {}
    for c in CHECKS:
        path = files / f"{c}.json"
        assert path.exists(), f"{c}: no JSON; log: {(files / f'{c}.log').read_text()[-2000:]}"
        res[c] = json.loads(path.read_text())
    return res


@pytest.mark.slow
def test_every_check_ran_its_dry_form(dry):
    for c, r in dry.items():
        assert r["ok"] and r["dry"] and r["check"] == c, (c, r.get("error"), r.get("traceback"))
        assert r["device"] and r["commit"] and r["seconds"] > 0
    # the trail of a check that builds a trainer: each model, the engine, each phase, in order
    stages = [s["stage"] for s in dry["step"]["progress"]]
    order = ["models written; start the rank", "rank started", "build the rollout engine done",
             "trainer built", "step 0 ...", "  phase rollout done", "  phase update done",
             "step 0 done", "megaprm plan of the same config"]
    assert [stages.index(s) for s in order] == sorted(stages.index(s) for s in order), stages
    times = [s["t"] for s in dry["step"]["progress"]]
    assert times == sorted(times)


@pytest.mark.slow
def test_dry_collectives_and_multirank(dry):
    col = dry["collectives"]
    assert all(col["gloo_on_device"].values()), col["gloo_on_device"]
    assert {r["device"] for r in col["gloo"]} == {"cpu"}
    assert "nccl" not in col  # no CUDA: not attempted
    mr = dry["multirank"]
    assert mr["returncode"] == 0 and mr["every_selection_collected"], mr["tail"]


@pytest.mark.slow
def test_dry_offload_returns_every_byte_bit_exactly(dry):
    models = {m["model"]: m for m in dry["offload"]["models"]}
    assert set(models) == {"actor", "ref", "prm"}
    for name, m in models.items():
        assert m["storage_bytes"] > 0 and m["bytes_freed"] == m["storage_bytes"], name
        assert m["storage_bytes_left"] == 0 and m["bytes_restored"] == m["bytes_freed"], name
        assert m["bit_exact_after_reload"] and m["grads_zero_after_reload"], name
    # the actor carries grads and Adam's two moments besides its weights; the others weights
    assert models["actor"]["keep_bytes"] > models["ref"]["keep_bytes"]
    assert models["actor"]["storage_bytes"] > models["actor"]["keep_bytes"]


@pytest.mark.slow
def test_dry_step_beside_its_plan(dry):
    st = dry["step"]
    assert "error" not in st["plan"], st["plan"]
    assert set(st["per_phase"]) == set(PLAN_PHASES)
    for phase, c in st["per_phase"].items():
        assert c["measured_s"] > 0 and c["plan_s"] is not None, phase
    assert set(st["implied_efficiency"]) >= {"train_mfu"}
    events = [e["event"] for e in st["steps"][-1]["lifecycle"]]
    # the colocated lifecycle: offload the trainer's state, wake, generate, sleep, reload; the
    # sync at the end of the update
    assert events.index("offload") < events.index("wake") < events.index("sleep") \
        < events.index("reload") < events.index("sync"), events


@pytest.mark.slow
def test_dry_compile_decision(dry):
    c = dry["compile"]
    assert c["make_cuda_default"] is False and c["shapes"][0]["error"] == "no compile row"


def _bench(rows_per_shape):
    return {"shapes": [{"shape": f"s{i}", "rows": [
        {"variant": v, "tokens_per_s": t, "max_abs_logprob_diff_vs_hf": d}
        for v, t, d in rows]} for i, rows in enumerate(rows_per_shape)]}


def test_compile_becomes_the_default_only_faster_at_both_shapes_with_equal_logprobs():
    fast = [("sdpa_chunked", 100.0, 0.02), ("sdpa_chunked_compile", 130.0, 0.021)]
    slow = [("sdpa_chunked", 100.0, 0.02), ("sdpa_chunked_compile", 95.0, 0.02)]
    off = [("sdpa_chunked", 100.0, 0.02), ("sdpa_chunked_compile", 150.0, 0.2)]
    assert decide_compile(_bench([fast, fast]))["make_cuda_default"]
    assert not decide_compile(_bench([fast, slow]))["make_cuda_default"]
    assert not decide_compile(_bench([fast, off]))["make_cuda_default"]
    d = decide_compile(_bench([fast, off]))["shapes"][1]
    assert d["faster"] and not d["logprobs_equal"]


def test_a_gpu_check_on_a_machine_without_cuda_is_one_line_exit_2(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    p = subprocess.run([sys.executable, "scripts/gpu_checks.py", "step", "--out",
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "--dry" in p.stderr and os.listdir(tmp_path) == []


def test_a_check_out_of_budget_still_writes_its_json_with_where_it_stood(tmp_path):
    """The first H100 run lost three checks to the session's timeouts with nothing to show:
    a check now stops itself at --budget and its JSON has its trail up to there."""
    p = subprocess.run([sys.executable, "scripts/gpu_checks.py", "step", "--dry", "--budget",
                        "6", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads((tmp_path / "step.json").read_text())
    assert not r["ok"] and r["timed_out"], r.get("error")
    stages = [s["stage"] for s in r["progress"]]
    assert stages[0] == "write the policy and the PRM (HF format)"
    assert r["last_stage"] == stages[-1] and "plan" not in r
    assert r["seconds"] < 6 + 30  # the rank's own timeout, not the 10-minute default


def test_multirank_cut_by_its_budget_names_the_tests_done_and_the_one_running(tmp_path,
                                                                             monkeypatch):
    """pytest -v's lines so far give each finished test's outcome and the test the budget
    interrupted; pytest and everything it started are killed."""
    import scripts.gpu_checks as gc

    suite = tmp_path / "test_cut.py"
    suite.write_text("import time\n\ndef test_a():\n    pass\n\n"
                     "def test_b():\n    assert 1 == 2\n\n"
                     "def test_c():\n    time.sleep(600)\n\n"
                     "def test_d():\n    pass\n")
    monkeypatch.setattr(gc, "MULTIRANK_TESTS", (str(suite),))
    with pytest.raises(gc.CheckTimeout) as e:
        gc.check_multirank(False, str(tmp_path), gc.Budget(25))
    res = e.value.args[1]
    outcomes = {t["test"].split("::")[1]: t["outcome"] for t in res["tests"]}
    assert outcomes == {"test_a": "passed", "test_b": "failed"}, res["tail"]
    assert res["running_when_cut"].endswith("::test_c") and res["returncode"] is None
    assert (res["passed"], res["failed"]) == (1, 1)
    left = subprocess.run(["pgrep", "-f", str(suite)], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout
