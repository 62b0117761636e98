"""The real tier cannot drop out of CI unnoticed: with a part of it hidden, ``pytest tests/real``
skips with one line for a user, and fails with that line in CI (``CI=true`` or
``APRIL_REQUIRE_REAL=1``). A module of the tier that skips at import fails in CI too.

The part hidden is SGLang, the first thing the gate checks, so the line is the same on every
machine, with the real stack installed or not; the reasons for the later parts (slime,
megatron-core) are checked with the parts before them in place, where the stack is installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_real_tier(tmp_path: Path, hidden: list[str], target: str, **env: str) -> subprocess.CompletedProcess:
    """``pytest target`` in a child whose interpreter cannot import the ``hidden`` modules."""
    site = tmp_path / "site"
    site.mkdir()
    # None in sys.modules: find_spec() answers None and an import raises ImportError, as when absent
    (site / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in hidden), encoding="utf-8")
    child_env = {k: v for k, v in os.environ.items() if k not in ("CI", "APRIL_REQUIRE_REAL")}
    child_env["PYTHONPATH"] = os.pathsep.join([str(site), child_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    child_env.update(env)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", target],
                          cwd=REPO, env=child_env, capture_output=True, text=True, timeout=600)


HIDDEN = "sglang"
REASON = "SGLang is not installed (sglang not importable)"


def test_without_the_real_stack_a_user_gets_one_skip_with_the_reason(tmp_path):
    run = run_real_tier(tmp_path, [HIDDEN], "tests/real")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 skipped" in run.stdout and "passed" not in run.stdout
    assert f"tests/real skipped: {REASON}" in run.stdout


@pytest.mark.parametrize("flag", [{"CI": "true"}, {"APRIL_REQUIRE_REAL": "1"}])
def test_without_the_real_stack_ci_fails_with_the_reason(tmp_path, flag):
    run = run_real_tier(tmp_path, [HIDDEN], "tests/real", **flag)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 failed" in run.stdout
    assert f"the real tier cannot run: {REASON}" in run.stdout


def test_without_slime_the_reason_names_slime(tmp_path):
    from tests.support.real_tier import WHY_SKIPPED

    if WHY_SKIPPED is not None:
        pytest.skip(f"slime is checked after the rest of the real stack, which is missing here: {WHY_SKIPPED}")
    run = run_real_tier(tmp_path, ["slime"], "tests/real")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "tests/real skipped: slime is not installed" in run.stdout


def test_in_ci_a_module_of_the_tier_that_skips_at_import_fails(tmp_path):
    # slime itself is there; one module the training tier needs is not, so its test file skips
    run = run_real_tier(tmp_path, ["slime.backends.megatron_utils.loss"],
                        "tests/real/training/test_slime_loss_path.py", CI="true")
    if "the real tier cannot run" in run.stdout:
        pytest.skip("the real stack is not installed here, so its modules cannot be probed one by one")
    assert run.returncode != 0, run.stdout + run.stderr
    assert "the real tier must run in CI, but test_slime_loss_path.py skipped" in run.stdout
