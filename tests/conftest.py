"""What the whole suite shares.

- `tiny_models`: the tiny Qwen2 policy and token-classification PRM of tests/rl_setup.py (the
  task's char tokenizer), built once per test process and read, never written, by the tests
  that train on them.
- The order modules run in: the slowest files of the committed snapshot
  (docs/testing-durations.md, scripts/test_durations.py) first, so that under pytest-xdist
  (`make test`: two workers, a module per worker) the long modules start early and the last
  minutes are not one worker finishing a long module while the other idles (the Makefile passes
  `--no-loadscope-reorder`, or xdist would start the modules with the most tests first). Tests
  keep their order inside a module; a module the snapshot does not list runs after the listed
  ones.
"""
import os
import re

import pytest

SNAPSHOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                        "testing-durations.md")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """(policy dir, PRM dir): tests/rl_setup.py's tiny pair, built once per process."""
    from tests.rl_setup import tiny_policy_and_prm

    return tiny_policy_and_prm(tmp_path_factory.mktemp("tiny_models"))


def file_seconds(path: str = SNAPSHOT) -> dict:
    """{test file: seconds} from the snapshot's "Slowest files" table ({} without one)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return {}
    return {name: float(t) for t, name in re.findall(r"^\| ([\d.]+) \| `(tests/[^`:]+)` \|$",
                                                     text, re.M)}


def pytest_collection_modifyitems(session, config, items):
    seconds = file_seconds()
    if not seconds:
        return
    root = str(config.rootpath)
    first = {}  # the module's position in collection order, for the ones the snapshot lacks
    for i, item in enumerate(items):
        first.setdefault(os.path.relpath(str(item.path), root), i)

    def key(item):
        rel = os.path.relpath(str(item.path), root)
        return (-seconds.get(rel, 0.0), first[rel])

    items.sort(key=key)  # stable: a module's own tests keep their order
