"""Run order for the whole suite: the fast tier, then the real tier's tests that need no engine
(training side, checkpoints), then those on the shared engines (the ``real_stack`` fixture).

The real tier starts SGLang engines once per session and keeps them until the session ends; their
scheduler loops keep polling while idle, so run earlier they would share the two cores with
everything after them, timing-sensitive tests included. Order changes nothing else: every test
is independent of it.

The helpers the tests share live in ``tests/support/`` and are imported as ``tests.support...``:
the repository root goes on ``sys.path`` here, once, before any test module is imported. The
fixtures ``slime_mode`` and ``cluster`` (``tests.support.slime_jobs``) are re-exported for every test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support.slime_jobs import cluster, slime_mode  # noqa: E402,F401  (fixtures for every test)

REAL_TIER = ROOT / "tests" / "real"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    def stage(item) -> int:
        if REAL_TIER not in Path(str(item.fspath)).parents:
            return 0
        return 2 if "real_stack" in getattr(item, "fixturenames", ()) else 1

    items.sort(key=stage)  # stable: the order within each stage stays as collected


@pytest.fixture(autouse=True)
def pacing_cross_check(monkeypatch):
    """Every staleness-pacing decision of every test is also recomputed from the groups themselves:
    the slacks the pacing keeps must be those the groups have (``StalenessPacing.cross_check``)."""
    from april_slime.core.pacing import StalenessPacing

    monkeypatch.setattr(StalenessPacing, "cross_check", True)
