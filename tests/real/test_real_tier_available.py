"""The real tier's own availability, as one test: it passes where the real stack is installed,
skips with the reason elsewhere, and fails with the reason in CI (see conftest.py), so a run
without the real tier can never pass as a run with it."""

import pytest

from tests.support.real_tier import REQUIRED, WHY_SKIPPED


def test_the_real_tier_can_run():
    if WHY_SKIPPED:
        message = f"the real tier cannot run: {WHY_SKIPPED}"
        if REQUIRED:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
