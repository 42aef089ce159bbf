"""`megaprm bench` writes a user's results outside the committed scripts/results/ unless
--update-results, says up front how long it takes and prints progress. Run with stand-in bench
scripts (the real ones take minutes each)."""
import json

from megaprm import bench
from megaprm.cli import main

STANDIN = """
import json, os, pathlib, sys
sys.path.insert(0, {root!r})
from megaprm.bench import default_out
out = pathlib.Path(default_out("bench_actor.json"))
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps({{"ok": 1}}))
"""


def test_results_go_to_runs_bench_with_durations_and_progress(tmp_path, monkeypatch, capsys):
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "bench_actor.py").write_text(STANDIN.format(root=str(bench.ROOT)))
    (scripts / "plot_benchmarks.py").write_text("")
    monkeypatch.setattr(bench, "SCRIPTS", scripts)
    monkeypatch.setattr(bench, "COMMITTED_RESULTS", tmp_path / "committed")
    out = tmp_path / "runs-bench"
    for run in (1, 2):
        assert bench.run_benches(["actor"], 60, out) == {"actor": "ok", "plots": "ok"}
        err = capsys.readouterr().err
        assert f"results in {out}/" in err and "[1/1] actor: ok in" in err and "min so far" in err
        assert ("no duration measured yet" in err) == (run == 1), err
    assert json.loads((out / "bench_actor.json").read_text()) == {"ok": 1}
    assert set(json.loads((out / bench.DURATIONS).read_text())) == {"actor"}
    assert not (tmp_path / "committed").exists()


def test_update_results_is_the_only_way_to_the_committed_dir(monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "run_benches", lambda names, t, out: seen.append(out) or {"actor": "ok"})
    monkeypatch.delenv(bench.RESULTS_ENV, raising=False)
    assert main(["bench", "--only", "actor"]) == 0
    assert main(["bench", "--only", "actor", "--update-results"]) == 0
    assert seen == [bench.ROOT / "runs" / "bench", bench.ROOT / "scripts" / "results"]
    assert bench.default_out("x.json") == str(bench.ROOT / "runs" / "bench" / "x.json")
