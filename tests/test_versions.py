"""``VersionRuns`` owns its runs: only its methods change them, and whatever stores them takes the
plain pairs and reads them back through ``VersionRuns.of``."""

from __future__ import annotations

import copy
import json

import pytest

from april_slime.core.versions import VersionRuns


def test_no_list_method_reaches_the_runs():
    runs = VersionRuns.of([[3, 2], [4, 1]])
    assert not isinstance(runs, list)
    for method in ("append", "insert", "extend", "pop", "__setitem__", "__getitem__", "sort", "clear"):
        assert not hasattr(runs, method), method
    assert runs.runs() == ((3, 2), (4, 1)) and list(runs) == [(3, 2), (4, 1)] and len(runs) == 2
    assert runs.newest() == 4 and runs.oldest() == 3 and runs.total == 3
    assert VersionRuns().newest() is None and VersionRuns().oldest() is None


def test_the_invariants_hold_whatever_the_builder_gets():
    runs = VersionRuns.of([[2, 1], [2, 2], [3, 0], [4, 1]])
    assert runs.plain() == [[2, 3], [4, 1]]  # merged, the empty run dropped
    runs.add(4, 2).add(5, 0).extend_runs([(4, 1), (6, 1)])
    assert runs.plain() == [[2, 3], [4, 4], [6, 1]]
    with pytest.raises(ValueError, match="negative count"):
        VersionRuns.of([[1, -1]])
    with pytest.raises(ValueError, match="cover 3 tokens, not 4"):
        VersionRuns.of([[1, 3]], total=4)


def test_stored_as_plain_pairs_and_read_back_with_of():
    runs = VersionRuns.of([[7, 2], [8, 5]])
    stored = json.loads(json.dumps({"version_runs": runs.plain()}))
    assert VersionRuns.of(stored["version_runs"]) == runs
    assert runs != [[7, 2], [8, 5]]  # a plain list compares through plain()
    twin = copy.deepcopy(runs)
    twin.add(9, 1)
    assert runs.plain() == [[7, 2], [8, 5]] and twin.newest() == 9
    assert runs.shifted(3).plain() == [[10, 2], [11, 5]] and runs.truncated(3).plain() == [[7, 2], [8, 1]]
    with pytest.raises(TypeError):
        json.dumps(runs)  # storing it takes plain()
