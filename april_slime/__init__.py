"""april_slime: partial rollouts (APRIL, CoPRIS) and off-policy correction (decoupled PPO, TIS/MIS,
VCPO) as a plugin for slime.

This module declares the public surface, all of it:

* ``SLIME_FLAGS``: what a slime job names on its command line, flag by flag;
* the few names a custom generate function or a user's own loss needs: the job's settings
  (``AprilConfig``, ``AprilConfigError``, ``for_job``), the ``Sample.metadata`` keys the plugin writes
  (``TOKEN_VERSIONS_KEY``, ``POLICY_VERSION_KEY``), and the loss hooks' packing step
  (``read_samples``, ``SlimeMicrobatch``, ``token_versions``).

Everything else (``april_slime.core``, ``april_slime.training``, the other names of the face
modules) is implementation and may change. Names load on first use, so ``import april_slime``
imports neither torch nor slime.
"""

from __future__ import annotations

import importlib
from typing import Any

# slime's flag -> the import path it names (README, "Use it in a slime job")
SLIME_FLAGS = {
    "--rollout-function-path": "april_slime.rollout.generate_rollout",
    "--data-source-path": "april_slime.rollout.AprilDataSource",
    "--custom-loss-function-path": "april_slime.loss.policy_loss",
    "--custom-tis-function-path": "april_slime.loss.tis",
    "--custom-megatron-before-train-step-hook-path": "april_slime.vcpo.before_train_step",
    "--custom-advantage-function-path": "april_slime.vcpo.opob_advantages",
    # slime's group normalisation without the masked samples (april_mask_failed_samples)
    "--custom-reward-post-process-path": "april_slime.masking.post_process_rewards",
}

# public name -> the module that owns it
_OWNERS = {
    "generate_rollout": "april_slime.rollout",
    "AprilDataSource": "april_slime.rollout",
    "policy_loss": "april_slime.loss",
    "tis": "april_slime.loss",
    "before_train_step": "april_slime.vcpo",
    "opob_advantages": "april_slime.vcpo",
    "post_process_rewards": "april_slime.masking",
    "AprilConfig": "april_slime.core.config",
    "AprilConfigError": "april_slime.core.config",
    "for_job": "april_slime.job",
    "TOKEN_VERSIONS_KEY": "april_slime.core.keys",
    "POLICY_VERSION_KEY": "april_slime.core.keys",
    "read_samples": "april_slime.loss_batch",
    "SlimeMicrobatch": "april_slime.loss_batch",
    "token_versions": "april_slime.loss_batch",
}

__all__ = ["SLIME_FLAGS", *_OWNERS]


def __getattr__(name: str) -> Any:
    owner = _OWNERS.get(name)
    if owner is None:
        raise AttributeError(f"module 'april_slime' has no attribute {name!r} (public names: {', '.join(__all__)})")
    value = getattr(importlib.import_module(owner), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
