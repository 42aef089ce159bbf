"""scripts/plot_benchmarks.py on synthetic results: one PNG per JSON, missing files tolerated."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SYNTHETIC = {
    "bench_actor": {"device": "CPU", "megaprm_tokens_per_s": 2500.0,
                    "transformers_tokens_per_s": 5000.0, "ratio_megaprm_over_transformers": 0.5},
    # the keys bench_advantages.py writes (thread-CPU and wall ms per call)
    "bench_advantages": {"device": {"kind": "cpu", "cores": 2}, "single_process": {
        "grpo": {"ours_cpu_ms": 0.1, "ours_wall_ms": 0.2, "loop_reference_cpu_ms": 12.0,
                 "loop_reference_wall_ms": 13.0, "speedup_vs_loop_cpu": 120.0}},
        "verl": {"available": True, "grpo": {"ours_cpu_ms": 0.1, "verl_loop_cpu_ms": 9.0,
                                             "verl_vectorized_cpu_ms": 0.5}}},
    "bench_weight_sync": {"backend": "gloo", "world_size": 2, "machine": "x86_64", "cpus": 2,
                          "layouts": [{"tp": 1, "pp": 1, "rows": [
                              {"mode": "bucket 4 MiB", "gbytes_per_s": 1.0,
                               "memcpy_gbytes_per_s": 5.0}]}]},
    "bench_rl_step": {"backend": "gloo", "device": {"kind": "cpu", "cores": 2},
                      "phases": ["rollout", "update"], "layouts": [
                          {"tp": 1, "pp": 1, "dp": 1, "median_s": {"step_s": 2.0, "rollout": 1.5,
                                                                   "update": 0.5},
                           "vs_1_1_1": {"step_s": 1.0}},
                          {"tp": 1, "pp": 1, "dp": 2, "median_s": {"step_s": 2.4, "rollout": 1.6,
                                                                   "update": 0.8},
                           "vs_1_1_1": {"step_s": 1.2}}]},
    # a layout the plotter has no handler for, and one its handler cannot read
    "bench_unknown": {"benchmark": "x", "baseline": "y",
                      "import_s": 1.2, "raw_read_s": 0.3},
}


def test_plots_written_for_every_json(tmp_path):
    plot = _load("plot_benchmarks")
    for name, d in SYNTHETIC.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(d))
    (tmp_path / "bench_broken.json").write_text("{not json")
    written = plot.plot_all(tmp_path, tmp_path / "png")
    assert sorted(p.name for p in written) == sorted(f"{n}.png" for n in SYNTHETIC)
    for p in written:
        assert p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG"


def test_unreadable_layout_falls_back_and_empty_dir_is_fine(tmp_path, capsys):
    plot = _load("plot_benchmarks")
    (tmp_path / "bench_actor.json").write_text(json.dumps({"elapsed_s": 1.0}))
    assert [p.name for p in plot.plot_all(tmp_path, tmp_path)] == ["bench_actor.png"]
    assert "layout not understood" in capsys.readouterr().err
    assert plot.main(["--results", str(tmp_path / "none")]) == 0


def test_bench_cli_rejects_unknown_name():
    import argparse

    import pytest

    from megaprm.bench import BENCHES, cmd_bench

    with pytest.raises(ValueError, match="unknown"):
        cmd_bench(argparse.Namespace(only="nope", timeout_s=1.0))
    assert "rl_step" in BENCHES


def test_committed_results_plot_with_their_own_plotter(tmp_path, capsys):
    """Every JSON under scripts/results is read by its plotter, never the generic fallback
    (`megaprm bench --only advantages` once hit KeyError: 'ours_ms')."""
    import shutil

    plot = _load("plot_benchmarks")
    results = sorted((ROOT / "scripts" / "results").glob("bench_*.json"))
    assert results
    for p in results:
        shutil.copy(p, tmp_path / p.name)
    written = plot.plot_all(tmp_path, tmp_path / "png")
    assert len(written) == len(results)
    assert "layout not understood" not in capsys.readouterr().err


def test_partial_run_never_replaces_a_complete_result(tmp_path, capsys):
    from megaprm.bench import write_result

    plot = _load("plot_benchmarks")
    out = tmp_path / "bench_advantages.json"
    full = SYNTHETIC["bench_advantages"]
    assert write_result(out, full) == out
    partial = {**full, "verl": {"available": False}}
    # a run without verl goes next to the complete one, which stays as it was
    assert write_result(out, partial, missing=["verl"]) == tmp_path / "bench_advantages.partial.json"
    assert "kept" in capsys.readouterr().err
    kept = json.loads(out.read_text())
    assert kept["complete"] and kept["verl"]["available"]
    # both plot, the partial one with its own plotter and a PARTIAL mark
    names = sorted(p.name for p in plot.plot_all(tmp_path, tmp_path / "png"))
    assert names == ["bench_advantages.partial.png", "bench_advantages.png"]
    assert "layout not understood" not in capsys.readouterr().err
    # with no complete result there yet, a partial run is the result; a complete run replaces it
    other = tmp_path / "new" / "bench_x.json"
    assert write_result(other, {"a": 1}, missing=["verl"]) == other
    assert write_result(other, {"a": 2}) == other and json.loads(other.read_text())["a"] == 2
    # results committed before the flag existed count as complete
    legacy = tmp_path / "bench_legacy.json"
    legacy.write_text(json.dumps({"a": 0}))
    assert write_result(legacy, {"a": 3}, missing=["dp2"]).name == "bench_legacy.partial.json"
