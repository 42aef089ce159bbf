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

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)

from scripts.gpu_checks import CHECKS, PLAN_PHASES, decide_compile  # noqa: E402


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-dry")
    env = {**os.environ, "DRY": "1", "OUT": str(out), "PYTHON": sys.executable}
    p = subprocess.run(["bash", "scripts/gpu_session.sh"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = {}
    for c in CHECKS:
        path = out / f"{c}.json"
        assert path.exists(), f"{c}: no JSON; log: {(out / f'{c}.log').read_text()[-2000:]}"
        res[c] = json.loads(path.read_text())
    return res


@pytest.mark.slow
def test_every_check_ran_its_dry_form(dry):
    for c, r in dry.items():
        assert r["ok"] and r["dry"] and r["check"] == c, (c, r.get("error"), r.get("traceback"))
        assert r["device"] and r["commit"] and r["seconds"] > 0


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
