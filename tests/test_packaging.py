"""`make install` builds megaprm with setuptools: the build prints no warning flood (before:
~290 lines of "Package would be ignored", one per data directory) and the wheel still carries
the data (recipes, evaluation sets). Built with `pip wheel -q` from a copy of the sources."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_build_is_quiet_and_ships_the_data(tmp_path):
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for d in ("megaprm", "checkpoint_tools", "eval"):
        shutil.copytree(ROOT / d, src / d, ignore=ignore)
    for f in ("setup.py", "README.md"):
        shutil.copy(ROOT / f, src / f)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                        "--no-build-isolation", "-q", "-w", str(tmp_path / "wheel")],
                       check=False, capture_output=True, text=True, timeout=300, cwd=src)
    assert p.returncode == 0, p.stderr[-3000:]
    out = (p.stdout + p.stderr).strip()
    assert "would be ignored" not in out and out == "", out[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("megaprm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = {str(f.relative_to(ROOT)) for f in (ROOT / "eval" / "data").rglob("*") if f.is_file()}
    assert data and data <= names, sorted(data - names)[:5]
    assert "megaprm/configs/demo.yaml" in names and "checkpoint_tools/convert.py" in names
