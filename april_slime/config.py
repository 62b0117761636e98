"""Plugin settings.

Every setting is a dataclass field. In a slime job each one is read from ``args.april_<field>``,
which slime fills from the YAML passed with ``--custom-config-path`` (or from the launcher). A value
that is missing keeps its default; a value that is wrong stops the job at start with one line that
names the key and says why (``AprilConfigError``).

This module owns no runtime state: the scheduler, buffer and loss hooks each take the validated
``AprilConfig`` and read from it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any

PREFIX = "april_"

POLICIES = ("sync", "april", "copris")
STALE_ACTIONS = ("restart", "drop")
RESUME_PRIORITIES = ("verl", "fifo", "stalest")
IS_MODES = ("on_policy", "copris", "decoupled")
IS_LEVELS = ("token", "sequence", "geometric")
IS_CORRECTIONS = ("none", "truncate", "mask")
LOSS_LEVELS = ("token", "sequence")


class AprilConfigError(ValueError):
    """A plugin setting is invalid. The message is one line: ``april_<key>: <reason>``."""


@dataclass
class AprilConfig:
    # ---------------------------------------------------------------- rollout side
    policy: str = field(
        default="copris",
        metadata={"help": "Rollout policy: sync (whole batch, no abort), april (over-sampled batches, "
                          "abort at target), copris (fixed number of requests in flight, refilled on "
                          "every completion, abort at target)."},
    )
    concurrency: int | None = field(
        default=None,
        metadata={"help": "copris: requests (samples) held in flight across all engines, N'. "
                          "Default: rollout_batch_size * n_samples_per_prompt."},
    )
    over_sampling_factor: float = field(
        default=2.0,
        metadata={"help": "april: groups submitted per step = factor * rollout_batch_size "
                          "(slime's --over-sampling-batch-size wins when set)."},
    )
    max_staleness: int | None = field(
        default=None,
        metadata={"help": "Largest allowed policy lag (in weight versions) of the oldest token of a "
                          "buffered group; unset = unbounded."},
    )
    stale_action: str = field(
        default="restart",
        metadata={"help": "What happens to a buffered group past max_staleness: restart (regenerate "
                          "from its prompt) or drop (count it and discard)."},
    )
    resume_priority: str = field(
        default="verl",
        metadata={"help": "Order in which buffered groups are resumed: verl (fewest unfinished samples, "
                          "shortest mean finished length, highest staleness), fifo, stalest."},
    )
    return_surplus: bool = field(
        default=True,
        metadata={"help": "Completed groups beyond the target go back to the buffer (used first next "
                          "step) instead of being discarded."},
    )
    adaptive_concurrency: bool = field(
        default=False,
        metadata={"help": "copris: tune N' online from engine loads, KV usage and retractions."},
    )
    min_concurrency: int = field(
        default=1, metadata={"help": "Lower bound for the adaptive concurrency controller."})
    max_concurrency: int | None = field(
        default=None, metadata={"help": "Upper bound for the adaptive controller (default 4 * N')."})
    request_timeout_s: float = field(
        default=3600.0, metadata={"help": "Timeout of one generate call, in seconds."})
    max_retries: int = field(
        default=3, metadata={"help": "Retries of one engine call on connection errors and HTTP 5xx."})
    retry_backoff_s: float = field(
        default=1.0, metadata={"help": "First retry delay; doubles on every retry."})
    buffer_dir: str | None = field(
        default=None,
        metadata={"help": "Folder of the partial-buffer checkpoint (april_state_<rollout_id>.json); default: "
                          "<args.save>/rollout (loaded from <args.load>/rollout), next to slime's "
                          "own data-source state."},
    )
    # ---------------------------------------------------------------- loss side
    is_mode: str = field(
        default="copris",
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
    loss_level: str = field(
        default="token",
        metadata={"help": "token: GRPO/DAPO per-token clipped objective; sequence: GSPO "
                          "sequence-level ratio (geometric mean of token ratios)."},
    )
    # ---------------------------------------------------------------- VCPO
    vcpo_lr_scaling: bool = field(
        default=False,
        metadata={"help": "Scale the learning rate of each optimizer step by sqrt(ESS_ratio / rho_on)."},
    )
    vcpo_rho_on: float | None = field(
        default=None,
        metadata={"help": "On-policy ESS ratio reference; default: taken from the first step."},
    )
    vcpo_lr_scale_min: float = field(
        default=0.0, metadata={"help": "Floor of the ESS learning-rate factor."})
    vcpo_lr_scale_max: float = field(
        default=1.0, metadata={"help": "Ceiling of the ESS learning-rate factor."})
    vcpo_baseline: bool = field(
        default=False,
        metadata={"help": "Replace the group-mean baseline by the off-policy optimal baseline "
                          "b = sum w^2 R ||g||^2 / sum w^2 ||g||^2 from exact per-trajectory "
                          "gradient norms."},
    )

    # ------------------------------------------------------------------ building
    @classmethod
    def from_args(cls, args: Any) -> "AprilConfig":
        """Read every ``args.april_<field>`` that is set (not None) and validate the result."""
        values = {}
        for f in fields(cls):
            value = getattr(args, PREFIX + f.name, None)
            if value is not None:
                values[f.name] = value
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "AprilConfig":
        """Build from plain keys (with or without the ``april_`` prefix); unknown keys are an error."""
        known = {f.name: f for f in fields(cls)}
        kwargs = {}
        for key, value in values.items():
            name = key[len(PREFIX):] if key.startswith(PREFIX) else key
            if name not in known:
                raise AprilConfigError(f"{PREFIX}{name}: unknown setting")
            kwargs[name] = _coerce(name, known[name], value)
        config = cls(**kwargs)
        config.validate()
        return config

    def to_dict(self, prefixed: bool = False) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return {PREFIX + k: v for k, v in out.items()} if prefixed else out

    def validate(self) -> None:
        _choice("policy", self.policy, POLICIES)
        _choice("stale_action", self.stale_action, STALE_ACTIONS)
        _choice("resume_priority", self.resume_priority, RESUME_PRIORITIES)
        _choice("is_mode", self.is_mode, IS_MODES)
        _choice("is_level", self.is_level, IS_LEVELS)
        _choice("is_correction", self.is_correction, IS_CORRECTIONS)
        _choice("loss_level", self.loss_level, LOSS_LEVELS)
        if self.concurrency is not None and self.concurrency < 1:
            _fail("concurrency", f"must be >= 1, got {self.concurrency}")
        if not (math.isfinite(self.over_sampling_factor) and self.over_sampling_factor >= 1.0):
            _fail("over_sampling_factor", f"must be a finite number >= 1, got {self.over_sampling_factor}")
        if self.max_staleness is not None and self.max_staleness < 0:
            _fail("max_staleness", f"must be >= 0 or unset, got {self.max_staleness}")
        if self.min_concurrency < 1:
            _fail("min_concurrency", f"must be >= 1, got {self.min_concurrency}")
        if self.max_concurrency is not None and self.max_concurrency < self.min_concurrency:
            _fail("max_concurrency", f"must be >= min_concurrency ({self.min_concurrency}), "
                                     f"got {self.max_concurrency}")
        if not self.request_timeout_s > 0:
            _fail("request_timeout_s", f"must be > 0, got {self.request_timeout_s}")
        if self.max_retries < 0:
            _fail("max_retries", f"must be >= 0, got {self.max_retries}")
        if self.retry_backoff_s < 0:
            _fail("retry_backoff_s", f"must be >= 0, got {self.retry_backoff_s}")
        if not (0.0 <= self.is_low < self.is_high) or not math.isfinite(self.is_high):
            _fail("is_high" if self.is_low >= 0 else "is_low",
                  f"need 0 <= is_low < is_high < inf, got is_low={self.is_low}, is_high={self.is_high}")
        if self.is_mode == "on_policy" and self.is_correction != "none" and self.is_level != "token":
            pass  # harmless: on_policy ignores rollout log-probs, so there is nothing to correct
        if self.vcpo_rho_on is not None and not (0.0 < self.vcpo_rho_on <= 1.0):
            _fail("vcpo_rho_on", f"must be in (0, 1], got {self.vcpo_rho_on}")
        if not (0.0 <= self.vcpo_lr_scale_min <= self.vcpo_lr_scale_max):
            _fail("vcpo_lr_scale_min", f"need 0 <= vcpo_lr_scale_min <= vcpo_lr_scale_max, got "
                                       f"{self.vcpo_lr_scale_min} > {self.vcpo_lr_scale_max}")

    def check_against_slime(self, args: Any) -> None:
        """Cross-checks with slime's own arguments, run once at job start."""
        batch = getattr(args, "rollout_batch_size", None)
        n = getattr(args, "n_samples_per_prompt", None)
        if batch is not None and batch < 1:
            raise AprilConfigError(f"rollout_batch_size: must be >= 1, got {batch}")
        if n is not None and n < 1:
            raise AprilConfigError(f"n_samples_per_prompt: must be >= 1, got {n}")
        if self.policy == "copris" and self.concurrency is not None and n is not None and self.concurrency < n:
            _fail("concurrency", f"must be >= n_samples_per_prompt ({n}) so one whole group can be in "
                                 f"flight, got {self.concurrency}")
        if self.is_mode == "decoupled" and getattr(args, "use_rollout_logprobs", False):
            _fail("is_mode", "decoupled needs the recomputed proximal log-probs; drop slime's "
                             "--use-rollout-logprobs")

    def resolved_concurrency(self, rollout_batch_size: int, n_samples_per_prompt: int) -> int:
        return self.concurrency or rollout_batch_size * n_samples_per_prompt


def _fail(name: str, reason: str) -> None:
    raise AprilConfigError(f"{PREFIX}{name}: {reason}")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        _fail(name, f"must be one of {', '.join(allowed)}; got {value!r}")


_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def _coerce(name: str, f: dataclasses.Field, value: Any) -> Any:
    """YAML and argparse hand us strings, ints for floats, etc.; convert to the field's type."""
    type_str = str(f.type).replace(" ", "")
    optional = "|None" in type_str
    base = type_str.replace("|None", "")
    if value is None:
        if optional:
            return None
        _fail(name, "must not be null")
    target = _TYPES[base]
    if target is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        _fail(name, f"must be true or false, got {value!r}")
    if target is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            _fail(name, f"must be an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            _fail(name, f"must be an integer, got {value!r}")
    if target is float:
        if isinstance(value, bool):
            _fail(name, f"must be a number, got {value!r}")
        try:
            out = float(value)
        except (TypeError, ValueError):
            _fail(name, f"must be a number, got {value!r}")
        if math.isnan(out):
            _fail(name, "must not be NaN")
        return out
    if not isinstance(value, str):
        _fail(name, f"must be a string, got {value!r}")
    return value


def settings_table_markdown() -> str:
    """The README's settings table, generated from the fields so the two cannot drift."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for f in fields(AprilConfig):
        default = f.default if f.default is not dataclasses.MISSING else None
        rows.append(f"| `{PREFIX}{f.name}` | `{default}` | {f.metadata.get('help', '')} |")
    return "\n".join(rows)
