"""The training tier: slime's loss path and Megatron's layers on CPU, and the guard its modules share.

Every test module here imports megatron-core at its top (directly or through the helpers
``tests.support.training.slime_cpu`` / ``megatron_cpu``), and all but those in ``MEGATRON_ONLY`` slime's Megatron loss
module too. Before a module is imported, what it needs is imported here; where that fails the
module is skipped at collection with the reason, the skip that ``tests/real/conftest.py`` turns
into a failure in CI. The modules themselves carry no import guard.
"""

from __future__ import annotations

import functools
import importlib

import pytest

SETUP = "scripts/real-stack/setup.sh"
MEGATRON = ("megatron.core",)
SLIME_LOSS_PATH = ("megatron.core", "slime.backends.megatron_utils.loss")
# test modules that need megatron-core alone; every other one needs slime's loss path as well
MEGATRON_ONLY = {"test_vcpo_megatron_tp.py"}


@functools.cache
def why_missing(modules: tuple[str, ...]) -> str | None:
    """The ImportError of the first of ``modules`` that cannot be imported, or None."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            return str(exc)
    return None


class TrainingTierModule(pytest.Module):
    """A test module of this tier: skipped, with the reason, when what it imports is missing."""

    def collect(self):
        megatron_only = self.path.name in MEGATRON_ONLY
        missing = why_missing(MEGATRON if megatron_only else SLIME_LOSS_PATH)
        if missing is not None:
            needs = "megatron-core" if megatron_only else "megatron-core and slime"
            pytest.skip(f"training tier needs {needs} ({SETUP}): {missing}", allow_module_level=True)
        return super().collect()


def pytest_pycollect_makemodule(module_path, parent):
    return TrainingTierModule.from_parent(parent, path=module_path)
