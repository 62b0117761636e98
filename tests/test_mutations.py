"""scripts/mutations.py stays runnable: every mutation's old text occurs exactly once in the code it
names, and every test it names exists (the script aborts before running anything otherwise)."""

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mutations():
    spec = importlib.util.spec_from_file_location("mutations", REPO / "scripts" / "mutations.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutations"] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("mutations", None)


def test_every_mutation_pattern_still_matches_the_code(mutations):
    assert mutations.MUTATIONS
    mutations.check_edits(REPO, mutations.MUTATIONS)  # raises Abort naming every stale pattern


def test_the_names_are_unique(mutations):
    names = [m.name for m in mutations.MUTATIONS]
    assert len(names) == len(set(names))


def test_a_pattern_that_is_gone_is_named(mutations, tmp_path):
    (tmp_path / "april_slime").mkdir()
    (tmp_path / "april_slime" / "x.py").write_text("a = 1\na = 1\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("")
    Edit, Mutation = mutations.Edit, mutations.Mutation
    listed = [
        Mutation("gone", "", (Edit("april_slime/x.py", "b = 2", "b = 3"),), ("tests/test_x.py",)),
        Mutation("twice", "", (Edit("april_slime/x.py", "a = 1", "a = 2"),), ("tests/test_x.py",)),
        Mutation("no-test", "", (Edit("april_slime/x.py", "a = 1\na", "a = 2\na"),), ("tests/test_y.py",)),
    ]
    with pytest.raises(mutations.Abort) as caught:
        mutations.check_edits(tmp_path, listed)
    message = str(caught.value)
    assert "gone: april_slime/x.py: the old text occurs 0 times" in message
    assert "twice: april_slime/x.py: the old text occurs 2 times" in message
    assert "no-test: test path tests/test_y.py does not exist" in message
