"""The loss and VCPO settings of a job: their names, vocabulary, defaults and checks, in one place.

Every name here is a key of the job's YAML with the ``april_`` prefix (``april_is_mode``), read by the
plugin's face (``april_slime.settings``), which builds a ``LossSettings`` once per job next to the
rollout's settings (``april_slime.core.config.AprilConfig``) and hands it to the loss hooks. The
training wing's functions take these values as plain arguments; the vocabulary they accept
(``IS_MODES``, ...) is defined here and imported where they check it.

A wrong value raises ``LossSettingsError`` with one line ``april_<key>: <reason>``; the face turns it
into the job's ``AprilConfigError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

SETTING_PREFIX = "april_"  # as the face's keys module spells it (this wing imports nothing of the face)

IS_MODES = ("on_policy", "copris", "decoupled")
IS_LEVELS = ("token", "sequence", "geometric")
IS_CORRECTIONS = ("none", "truncate", "mask")
LOSS_LEVELS = ("token", "sequence")
VCPO_BASELINE_SCOPES = ("group", "global")
VCPO_BASELINE_WEIGHTS = ("released", "paper")
PROX_LOG_PROBS = ("auto", "recompute", "loglinear")
MAX_VCPO_LR_SCALE = 10.0  # an ESS factor above 1 raises the learning rate past the configured one

# What the VCPO settings imply where the job does not set them: the objective VCPO's rules are
# derived for and the authors' released runs train (sequence-level importance weights truncated at
# 8; paper section 3.5 and appendix F.3-F.4), not the token-level weights truncated at 2 that are
# the defaults otherwise. The baseline also implies april_is_mode: copris (the importance-weighted
# REINFORCE estimator against the rollout log-probs), the only mode it serves. A value the job sets
# is kept.
VCPO_OBJECTIVE: dict[str, Any] = {"is_level": "sequence", "is_high": 8.0}


class LossSettingsError(ValueError):
    """A loss or VCPO setting is invalid. The message is one line: ``april_<key>: <reason>``."""


@dataclass
class LossSettings:
    is_mode: str = field(
        # decoupled learned fastest at the staleness partial rollouts produce (docs/loss.md,
        # "Defaults, and why"); copris saves slime's log-prob forward with --use-rollout-logprobs
        default="decoupled",
        metadata={"help": "Off-policy correction: on_policy (ignore rollout log-probs), copris (ratio "
                          "against the concatenated rollout log-probs of all stages), decoupled "
                          "(clip around the recomputed proximal policy, weight prox/behaviour)."},
    )
    is_level: str = field(
        default="token",
        metadata={"help": "Level of the importance weight: token, sequence or geometric (mean)."},
    )
    is_correction: str = field(
        default="truncate",
        metadata={"help": "What to do with weights outside [is_low, is_high]: none, truncate (clamp), "
                          "mask (drop the token / sequence from the loss)."},
    )
    is_low: float = field(default=0.0, metadata={"help": "Lower IS threshold (0 = none)."})
    is_high: float = field(default=2.0, metadata={"help": "Upper IS threshold."})
    stale_token_lag: int | None = field(default=None, metadata={"help": (
        "Tokens generated more than this many policy versions before the step that trains them get "
        "april_stale_token_weight in the policy loss, apart from the IS correction (custom loss; metric "
        "stale_token_frac). Unset: off.")})
    stale_token_weight: float = field(default=0.0, metadata={"help": (
        "Loss weight of the tokens older than april_stale_token_lag: 0 masks them, (0, 1) down-weights them.")})
    loss_level: str = field(
        default="token",
        metadata={"help": "token: GRPO/DAPO per-token clipped objective; sequence: GSPO "
                          "sequence-level ratio (geometric mean of token ratios)."},
    )
    # ---------------------------------------------------------------- VCPO
    vcpo_lr_scaling: bool = field(
        default=False,
        metadata={"help": "Scale the learning rate of each optimizer step by sqrt(ESS_ratio / rho_on). Unless "
                          "set, april_is_level is then sequence and april_is_high 8 (VCPO's objective)."},
    )
    vcpo_rho_on: float = field(
        default=1.0,
        metadata={"help": "On-policy ESS ratio rho_on of the learning-rate rule. VCPO's released runs fix it: "
                          "1.0 for single-turn math, 0.55 for multi-turn tool use."},
    )
    vcpo_rho_on_estimate: bool = field(
        default=False,
        metadata={"help": "Take rho_on from the ESS ratio of the first step instead (april_vcpo_rho_on is then "
                          "not read); the estimate is saved with the job and restored on restart."},
    )
    vcpo_lr_scale_min: float = field(
        default=0.0, metadata={"help": "Floor of the ESS learning-rate factor."})
    vcpo_lr_scale_max: float = field(
        default=1.0, metadata={"help": "Ceiling of the ESS learning-rate factor (at most "
                                       f"{MAX_VCPO_LR_SCALE:.0f}: above 1 it raises the learning "
                                       "rate past the configured one)."})
    vcpo_baseline: bool = field(
        default=False,
        metadata={"help": "Replace the group-mean baseline by the off-policy optimal baseline "
                          "b = sum w^2 R ||g||^2 / sum w^2 ||g||^2 from exact per-trajectory "
                          "gradient norms. Unless set, april_is_mode is then copris, april_is_level "
                          "sequence and april_is_high 8 (VCPO's objective)."},
    )
    vcpo_baseline_scope: str = field(
        default="group",
        metadata={"help": "group: one baseline per prompt group (VCPO's released runs); global: one baseline per "
                          "optimizer step over every data-parallel rank."},
    )
    vcpo_baseline_norm_by_std: bool = field(
        default=True,
        metadata={"help": "group scope: divide each group's baselined rewards by the std of its raw rewards."},
    )
    vcpo_baseline_weights: str = field(
        default="released",
        metadata={"help": "released: W_i = ||w_i g_i||^2 times the squared unclipped ratio (the released code); "
                          "paper: W_i = ||w_i g_i||^2 (eq. 7)."},
    )
    vcpo_length_norm: bool = field(
        default=True,
        metadata={"help": "Divide each trajectory's loss by its loss-masked token count (the released runs' "
                          "seq-mean-token-mean); false: the summed trajectory loss."},
    )
    prox_log_probs: str = field(
        default="auto",
        metadata={"help": "Where the proximal log-probs come from with the custom loss: auto (the training "
                          "forward's own when the rollout has one optimizer step, slime's recompute otherwise), "
                          "recompute (always slime's forward), loglinear (interpolate between the rollout and "
                          "current log-probs by each token's policy version, no recompute)."},
    )

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def build(cls, values: dict[str, Any]) -> LossSettings:
        """From already-typed values (the face coerces YAML strings): VCPO's objective implied
        where a VCPO setting is on and the job left it unset, then checked."""
        values = dict(values)
        imply_vcpo_objective(values)
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        _choice("is_mode", self.is_mode, IS_MODES)
        _choice("is_level", self.is_level, IS_LEVELS)
        _choice("is_correction", self.is_correction, IS_CORRECTIONS)
        _choice("loss_level", self.loss_level, LOSS_LEVELS)
        _choice("vcpo_baseline_scope", self.vcpo_baseline_scope, VCPO_BASELINE_SCOPES)
        _choice("vcpo_baseline_weights", self.vcpo_baseline_weights, VCPO_BASELINE_WEIGHTS)
        _choice("prox_log_probs", self.prox_log_probs, PROX_LOG_PROBS)
        if not (0.0 <= self.is_low < self.is_high) or not math.isfinite(self.is_high):
            _fail("is_high" if self.is_low >= 0 else "is_low",
                  f"need 0 <= is_low < is_high < inf, got is_low={self.is_low}, is_high={self.is_high}")
        if self.stale_token_lag is not None and self.stale_token_lag < 0:
            _fail("stale_token_lag", f"must be >= 0 or unset, got {self.stale_token_lag}")
        if not 0.0 <= self.stale_token_weight < 1.0:
            _fail("stale_token_weight", f"must be in [0, 1), got {self.stale_token_weight}")
        if self.stale_token_weight and self.stale_token_lag is None:
            _fail("stale_token_weight", "only read with april_stale_token_lag set")
        if self.stale_token_lag is not None and self.vcpo_baseline:
            _fail("stale_token_lag", "not available with april_vcpo_baseline (its loss is reduced per trajectory)")
        if not (0.0 < self.vcpo_rho_on <= 1.0):
            _fail("vcpo_rho_on", f"must be in (0, 1], got {self.vcpo_rho_on}")
        if self.vcpo_rho_on_estimate and self.vcpo_rho_on != 1.0:
            _fail("vcpo_rho_on", f"set either a fixed value ({self.vcpo_rho_on}) or vcpo_rho_on_estimate, not both")
        if not (0.0 <= self.vcpo_lr_scale_min <= self.vcpo_lr_scale_max):
            _fail("vcpo_lr_scale_min", f"need 0 <= vcpo_lr_scale_min <= vcpo_lr_scale_max, got "
                                       f"{self.vcpo_lr_scale_min} > {self.vcpo_lr_scale_max}")
        if not self.vcpo_lr_scale_max <= MAX_VCPO_LR_SCALE:
            _fail("vcpo_lr_scale_max", f"must be at most {MAX_VCPO_LR_SCALE:.0f}, got {self.vcpo_lr_scale_max}")


def imply_vcpo_objective(values: dict[str, Any]) -> None:
    """``VCPO_OBJECTIVE`` (and, for the baseline, ``is_mode: copris``) where a VCPO setting is on
    and the job left those keys unset."""
    if values.get("vcpo_lr_scaling") or values.get("vcpo_baseline"):
        for name, value in VCPO_OBJECTIVE.items():
            values.setdefault(name, value)
        if values.get("vcpo_baseline"):
            values.setdefault("is_mode", "copris")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        _fail(name, f"must be one of {', '.join(allowed)}; got {value!r}")


def _fail(name: str, reason: str) -> None:
    raise LossSettingsError(f"{SETTING_PREFIX}{name}: {reason}")
