"""Plugin settings.

Every setting is a dataclass field. In a slime job each one is read from ``args.april_<field>``,
which slime fills from the YAML passed with ``--custom-config-path`` (or from the launcher). A value
that is missing keeps its default; a value that is wrong stops the job at start with one line that
names the key and says why (``AprilConfigError``).

Misspelled keys. slime sets every key of the custom YAML as an attribute of ``args`` (no check:
the file also carries arguments of users' own functions), so a misspelled setting would silently
keep its default. ``from_args`` therefore refuses every ``april_*`` attribute that is not a setting,
and, for the keys it can tell came from the custom YAML (it reads ``args.custom_config_path`` again),
every key that names a setting without its prefix (``policy``) or nearly names one (``aprl_policy``,
``april-policy``). Only the YAML's keys are compared this loosely: every other attribute of ``args``
is slime's or Megatron's own, and none of those is a near miss of a setting (checked against
slime's parser by ``tests/real``). Each refusal names the closest valid key.

This module owns no runtime state: the scheduler, buffer and loss hooks each take the validated
``AprilConfig`` and read from it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field, fields
from typing import Any

from april_slime.core.keys import SETTING_PREFIX

POLICIES = ("sync", "april", "copris")
DISPATCH_MODES = ("auto", "direct", "router")  # april_slime.core.dispatch reads them
STALE_ACTIONS = ("restart", "drop")
RESUME_PRIORITIES = ("verl", "fifo", "stalest")
IS_MODES = ("on_policy", "copris", "decoupled")
IS_LEVELS = ("token", "sequence", "geometric")
IS_CORRECTIONS = ("none", "truncate", "mask")
LOSS_LEVELS = ("token", "sequence")
VCPO_BASELINE_SCOPES = ("group", "global")
VCPO_BASELINE_WEIGHTS = ("released", "paper")
PROX_LOG_PROBS = ("auto", "recompute", "loglinear")
# slime's estimators whose rewards it normalises per group (--rewards-normalization), and the
# function that does it without the masked samples (mask_failed_samples)
GROUP_NORMALISED_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
MASKING_POST_PROCESS = "april_slime.masking.post_process_rewards"

# Sane upper bounds of settings whose absurd values would otherwise pass (documented in the help).
MAX_OVER_SAMPLING_FACTOR = 100.0
MAX_RETRIES = 20
MAX_TOTAL_RETRY_BACKOFF_S = 86400.0
MAX_VCPO_LR_SCALE = 10.0
# How close a custom-YAML key must be to a setting's name to be taken for a misspelling of it.
NEAR_MISS_CUTOFF = 0.85


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
                          "(slime's --over-sampling-batch-size wins when set); 1 to "
                          f"{MAX_OVER_SAMPLING_FACTOR:.0f}."},
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
    max_interruptions: int | None = field(default=None, metadata={"help": (
        "Times a group may be suspended at a step's target (aborted with work left, carried over) before it "
        "is protected: resumed first and run to completion in its next step. Unset: never protected.")})
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
        metadata={"help": "copris: tune N' online from engine loads, KV usage and retractions "
                          "(copris only)."},
    )
    min_concurrency: int = field(
        default=1, metadata={"help": "Lower bound for the adaptive concurrency controller."})
    max_concurrency: int | None = field(
        default=None, metadata={"help": "Upper bound for the adaptive controller (default 4 * N')."})
    dispatch: str = field(
        default="auto",
        metadata={"help": "Where model calls go: direct (to the engine the plugin picks by load; aborts by "
                          "rid), router (generate through slime's router, which places each call by its own "
                          "policy; aborts fanned out to every engine), auto (router where the engines must be "
                          "reached through it: PD disaggregation, a DP-aware router; else direct)."},
    )
    request_timeout_s: float = field(
        default=3600.0, metadata={"help": "Timeout of one generate call, in seconds (finite)."})
    max_retries: int = field(
        default=3, metadata={"help": "Retries of one engine call on connection errors and HTTP 5xx "
                                     f"(at most {MAX_RETRIES})."})
    retry_backoff_s: float = field(
        default=1.0, metadata={"help": "First retry delay; doubles on every retry (all the delays of "
                                       f"one call at most {MAX_TOTAL_RETRY_BACKOFF_S:.0f} s)."})
    engine_wait_s: float = field(
        default=300.0,
        metadata={"help": "Longest wait, at job start, for slime's router to list the engines slime started "
                          "(sglang-router queues a registration and lists the engine only after its own "
                          "health check), in seconds; also the longest wait for a router that lists none "
                          "later on."},
    )
    buffer_dir: str | None = field(
        default=None,
        metadata={"help": "Folder of the data-source checkpoint (april_state_<rollout_id>.json: prompt "
                          "position and partial buffer); default: <args.save>/rollout (loaded from "
                          "<args.load>/rollout), next to slime's own data-source state."},
    )
    # ---------------------------------------------------------------- agent functions (multi-turn)
    max_live_episodes: int | None = field(
        default=None,
        metadata={"help": "copris with a custom generate function: episodes alive at once (in a model "
                          "call or in a tool); N' counts model calls in flight. Default: 2 * N'."},
    )
    max_episode_failures: int = field(
        default=2,
        metadata={"help": "Times one episode is re-run alone from its prompt after its function raised "
                          "or its tool phase timed out; one more failure drops its group (counted)."},
    )
    max_given_up_in_a_row: int | None = field(
        default=16,
        metadata={"help": "Episodes given up (past max_episode_failures) in a row, none finishing between "
                          "them, after which the job stops with an error naming the generate function and "
                          "its last failure (slime's own rollout stops at the first); counted in "
                          "april/episodes/given_up_in_a_row. Unset: no bound."},
    )
    episode_tool_timeout_s: float | None = field(
        default=None,
        metadata={"help": "Longest tool phase of an episode (no model call pending, not returned), in "
                          "seconds; past it the episode is ended and re-run as a failure. Unset: none."},
    )
    mask_failed_samples: bool = field(
        default=False,
        metadata={"help": "An episode given up past max_episode_failures for an infrastructure fault (its "
                          "generate function raised, e.g. a lost sandbox or a crashed verifier; its tool phase "
                          "timed out; or the tokens it returned do not match the calls it was served) is "
                          "masked instead of dropping its group: the sample (Sample.Status.FAILED, "
                          "remove_sample, loss mask 0) trains nothing and is left out of its group's reward "
                          "normalisation, and the group's other samples train. A wrong answer or a "
                          "truncation is the policy's outcome and trains as usual. A job whose rewards slime "
                          "group-normalises needs --custom-reward-post-process-path "
                          f"{MASKING_POST_PROCESS} (docs/reliability.md). Counted in april/masked_samples."},
    )
    # ---------------------------------------------------------------- loss side
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

    # ------------------------------------------------------------------ building
    @classmethod
    def from_args(cls, args: Any) -> "AprilConfig":
        """Read every ``args.april_<field>`` that is set (not None) and validate the result.

        Refuses ``april_*`` attributes that are not settings, near misses of a setting among the
        custom YAML's keys, and settings the YAML leaves empty (``april_policy:``).
        """
        yaml_keys = custom_config_keys(args)
        check_keys([k for k in _attributes(args) if _looks_prefixed(k)], yaml_keys)
        values = {}
        for f in fields(cls):
            key = SETTING_PREFIX + f.name
            value = getattr(args, key, None)
            if value is not None:
                values[f.name] = value
            elif key in yaml_keys:
                _coerce(f.name, f, None, empty="must not be empty")
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "AprilConfig":
        """Build from plain keys (with or without the ``april_`` prefix); unknown keys are an error."""
        known = {f.name: f for f in fields(cls)}
        kwargs = {}
        for key, value in values.items():
            name = key[len(SETTING_PREFIX):] if key.startswith(SETTING_PREFIX) else key
            if name not in known:
                raise AprilConfigError(f"{SETTING_PREFIX}{name}: unknown setting; {_closest(SETTING_PREFIX + name)}")
            kwargs[name] = _coerce(name, known[name], value)
        _imply_vcpo_objective(kwargs)
        config = cls(**kwargs)
        config.validate()
        return config

    def to_dict(self, prefixed: bool = False) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return {SETTING_PREFIX + k: v for k, v in out.items()} if prefixed else out

    def validate(self) -> None:
        _choice("policy", self.policy, POLICIES)
        _choice("stale_action", self.stale_action, STALE_ACTIONS)
        _choice("resume_priority", self.resume_priority, RESUME_PRIORITIES)
        _choice("dispatch", self.dispatch, DISPATCH_MODES)
        _choice("is_mode", self.is_mode, IS_MODES)
        _choice("is_level", self.is_level, IS_LEVELS)
        _choice("is_correction", self.is_correction, IS_CORRECTIONS)
        _choice("loss_level", self.loss_level, LOSS_LEVELS)
        _choice("vcpo_baseline_scope", self.vcpo_baseline_scope, VCPO_BASELINE_SCOPES)
        _choice("vcpo_baseline_weights", self.vcpo_baseline_weights, VCPO_BASELINE_WEIGHTS)
        _choice("prox_log_probs", self.prox_log_probs, PROX_LOG_PROBS)
        if self.concurrency is not None and self.concurrency < 1:
            _fail("concurrency", f"must be >= 1, got {self.concurrency}")
        if not (math.isfinite(self.over_sampling_factor) and self.over_sampling_factor >= 1.0):
            _fail("over_sampling_factor", f"must be a finite number >= 1, got {self.over_sampling_factor}")
        _check_staleness(self)
        if self.min_concurrency < 1:
            _fail("min_concurrency", f"must be >= 1, got {self.min_concurrency}")
        if self.max_concurrency is not None and self.max_concurrency < self.min_concurrency:
            _fail("max_concurrency", f"must be >= min_concurrency ({self.min_concurrency}), "
                                     f"got {self.max_concurrency}")
        _check_engine_calls(self)
        if self.over_sampling_factor > MAX_OVER_SAMPLING_FACTOR:
            _fail("over_sampling_factor", f"must be at most {MAX_OVER_SAMPLING_FACTOR:.0f}, "
                                          f"got {self.over_sampling_factor}")
        _check_episodes(self)
        if self.buffer_dir is not None and not self.buffer_dir.strip():
            _fail("buffer_dir", "must not be empty (leave it unset for <save>/rollout)")
        if not (0.0 <= self.is_low < self.is_high) or not math.isfinite(self.is_high):
            _fail("is_high" if self.is_low >= 0 else "is_low",
                  f"need 0 <= is_low < is_high < inf, got is_low={self.is_low}, is_high={self.is_high}")
        if not (0.0 < self.vcpo_rho_on <= 1.0):
            _fail("vcpo_rho_on", f"must be in (0, 1], got {self.vcpo_rho_on}")
        if self.vcpo_rho_on_estimate and self.vcpo_rho_on != 1.0:
            _fail("vcpo_rho_on", f"set either a fixed value ({self.vcpo_rho_on}) or vcpo_rho_on_estimate, not both")
        if not (0.0 <= self.vcpo_lr_scale_min <= self.vcpo_lr_scale_max):
            _fail("vcpo_lr_scale_min", f"need 0 <= vcpo_lr_scale_min <= vcpo_lr_scale_max, got "
                                       f"{self.vcpo_lr_scale_min} > {self.vcpo_lr_scale_max}")
        if not self.vcpo_lr_scale_max <= MAX_VCPO_LR_SCALE:
            _fail("vcpo_lr_scale_max", f"must be at most {MAX_VCPO_LR_SCALE:.0f}, got {self.vcpo_lr_scale_max}")
        # settings that only one policy reads would otherwise be ignored without a word
        if self.adaptive_concurrency and self.policy != "copris":
            _fail("adaptive_concurrency", f"needs april_policy: copris (it tunes the requests in flight, "
                                          f"which only copris holds fixed), got policy {self.policy!r}")
        if self.max_concurrency is not None and not self.adaptive_concurrency:
            _fail("max_concurrency", "only read with april_adaptive_concurrency: true")
        if self.adaptive_concurrency and self.concurrency is not None:
            top = self.max_concurrency if self.max_concurrency is not None else 4 * self.concurrency
            if not self.min_concurrency <= self.concurrency <= top:
                _fail("concurrency", f"the adaptive controller starts here, so it must lie in "
                                     f"[min_concurrency, max_concurrency] = [{self.min_concurrency}, {top}], "
                                     f"got {self.concurrency}")

    def check_against_slime(self, args: Any) -> None:
        """Cross-checks with slime's own arguments, run once at job start."""
        _check_against_slime(self, args)

    def resolved_concurrency(self, rollout_batch_size: int, n_samples_per_prompt: int) -> int:
        return self.concurrency or rollout_batch_size * n_samples_per_prompt


def _check_against_slime(c: AprilConfig, args: Any) -> None:
    _check_masking(c, args)
    batch = getattr(args, "rollout_batch_size", None)
    n = getattr(args, "n_samples_per_prompt", None)
    if batch is not None and batch < 1:
        raise AprilConfigError(f"rollout_batch_size: must be >= 1, got {batch}")
    if n is not None and n < 1:
        raise AprilConfigError(f"n_samples_per_prompt: must be >= 1, got {n}")
    if c.policy == "copris" and c.concurrency is not None and n is not None and c.concurrency < n:
        _fail("concurrency", f"must be >= n_samples_per_prompt ({n}) so one whole group can be in "
                             f"flight, got {c.concurrency}")
    if c.max_live_episodes is not None and n is not None and c.max_live_episodes < n:
        _fail("max_live_episodes", f"must be >= n_samples_per_prompt ({n}) so one whole group can be "
                                   f"alive, got {c.max_live_episodes}")
    if c.is_mode == "decoupled" and getattr(args, "use_rollout_logprobs", False):
        _fail("is_mode", "decoupled needs the recomputed proximal log-probs; drop slime's "
                         "--use-rollout-logprobs")


def _check_engine_calls(c: AprilConfig) -> None:
    """The settings of engine calls: timeouts, retries and their backoff, the wait for the engines."""
    if not (math.isfinite(c.request_timeout_s) and c.request_timeout_s > 0):
        _fail("request_timeout_s", f"must be a finite number > 0, got {c.request_timeout_s}")
    if not 0 <= c.max_retries <= MAX_RETRIES:
        _fail("max_retries", f"must be in 0..{MAX_RETRIES}, got {c.max_retries}")
    if not (math.isfinite(c.engine_wait_s) and c.engine_wait_s > 0):
        _fail("engine_wait_s", f"must be a finite number > 0, got {c.engine_wait_s}")
    if not (math.isfinite(c.retry_backoff_s) and c.retry_backoff_s >= 0):
        _fail("retry_backoff_s", f"must be a finite number >= 0, got {c.retry_backoff_s}")
    total_backoff = c.retry_backoff_s * (2 ** c.max_retries - 1)
    if total_backoff > MAX_TOTAL_RETRY_BACKOFF_S:
        _fail("retry_backoff_s", f"{c.retry_backoff_s} s doubled over {c.max_retries} retries waits "
                                 f"{total_backoff:.0f} s per call, more than {MAX_TOTAL_RETRY_BACKOFF_S:.0f}")


def _check_episodes(c: AprilConfig) -> None:
    """The settings of agent functions' episodes."""
    if c.max_live_episodes is not None and c.max_live_episodes < 1:
        _fail("max_live_episodes", f"must be >= 1 or unset, got {c.max_live_episodes}")
    if c.max_episode_failures < 0:
        _fail("max_episode_failures", f"must be >= 0, got {c.max_episode_failures}")
    if c.max_given_up_in_a_row is not None and c.max_given_up_in_a_row < 1:
        _fail("max_given_up_in_a_row", f"must be >= 1 or unset, got {c.max_given_up_in_a_row}")
    if c.episode_tool_timeout_s is not None and not (
            math.isfinite(c.episode_tool_timeout_s) and c.episode_tool_timeout_s > 0):
        _fail("episode_tool_timeout_s", f"must be a finite number > 0 or unset, got {c.episode_tool_timeout_s}")


def _check_masking(c: AprilConfig, args: Any) -> None:
    """slime's own group normalisation counts every sample of a group, a masked one included."""
    normalises = (getattr(args, "advantage_estimator", None) in GROUP_NORMALISED_ESTIMATORS
                  and getattr(args, "rewards_normalization", False))
    if c.mask_failed_samples and normalises and getattr(args, "custom_reward_post_process_path", None) is None:
        _fail("mask_failed_samples", "slime's group reward normalisation would count the masked samples; set "
                                     f"--custom-reward-post-process-path {MASKING_POST_PROCESS}")


def _check_staleness(c: AprilConfig) -> None:
    """The settings of the staleness bound, of protection and of the loss's stale-token weight."""
    if c.max_staleness is not None and c.max_staleness < 0:
        _fail("max_staleness", f"must be >= 0 or unset, got {c.max_staleness}")
    if c.max_interruptions is not None and c.max_interruptions < 1:
        _fail("max_interruptions", f"must be >= 1 or unset, got {c.max_interruptions}")
    if c.stale_token_lag is not None and c.stale_token_lag < 0:
        _fail("stale_token_lag", f"must be >= 0 or unset, got {c.stale_token_lag}")
    if not 0.0 <= c.stale_token_weight < 1.0:
        _fail("stale_token_weight", f"must be in [0, 1), got {c.stale_token_weight}")
    if c.stale_token_weight and c.stale_token_lag is None:
        _fail("stale_token_weight", "only read with april_stale_token_lag set")
    if c.stale_token_lag is not None and c.vcpo_baseline:
        _fail("stale_token_lag", "not available with april_vcpo_baseline (its loss is reduced per trajectory)")


# What the VCPO settings imply where the job does not set them: the objective VCPO's rules are
# derived for and the authors' released runs train (sequence-level importance weights truncated at
# 8; paper section 3.5 and appendix F.3-F.4), not the token-level weights truncated at 2 that are
# the defaults otherwise. The baseline also implies april_is_mode: copris (the importance-weighted
# REINFORCE estimator against the rollout log-probs), the only mode it serves. A value the job sets
# is kept.
VCPO_OBJECTIVE: dict[str, Any] = {"is_level": "sequence", "is_high": 8.0}


def _imply_vcpo_objective(kwargs: dict[str, Any]) -> None:
    """``VCPO_OBJECTIVE`` (and, for the baseline, ``is_mode: copris``) where a VCPO setting is on
    and the job left those keys unset."""
    if kwargs.get("vcpo_lr_scaling") or kwargs.get("vcpo_baseline"):
        for name, value in VCPO_OBJECTIVE.items():
            kwargs.setdefault(name, value)
        if kwargs.get("vcpo_baseline"):
            kwargs.setdefault("is_mode", "copris")


def _fail(name: str, reason: str) -> None:
    raise AprilConfigError(f"{SETTING_PREFIX}{name}: {reason}")


# ---------------------------------------------------------------------------- misspelled keys
def setting_keys() -> list[str]:
    return [SETTING_PREFIX + f.name for f in fields(AprilConfig)]


def _attributes(args: Any) -> list[str]:
    try:
        return list(vars(args))
    except TypeError:  # an args object without __dict__
        return [k for k in dir(args) if not k.startswith("__")]


def _normalized(key: str) -> str:
    return key.strip().lower().replace("-", "_")


def _looks_prefixed(key: str) -> bool:
    return _normalized(key).startswith(SETTING_PREFIX)


def _closest(key: str) -> str:
    match = difflib.get_close_matches(_normalized(key), setting_keys(), n=1, cutoff=0.5)
    if match:
        return f"closest valid name: {match[0]}"
    return "no setting is close; `april-slime settings` lists them all"


def custom_config_keys(args: Any) -> set[str]:
    """The keys of the YAML slime applied from ``--custom-config-path`` (empty when there is none,
    or when the file is not readable from this process: then only ``april_*`` keys are checked)."""
    path = getattr(args, "custom_config_path", None)
    if not path:
        return set()
    try:
        import yaml

        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except Exception:  # unreadable here (another node's path), or changed since slime parsed it
        return set()
    return {str(k) for k in data} if isinstance(data, dict) else set()


def check_keys(prefixed_attributes: list[str], yaml_keys: set[str] | list[str] = ()) -> None:
    """Stop at the first key that looks meant for this plugin but is not one of its settings."""
    valid = set(setting_keys())
    unprefixed = {k[len(SETTING_PREFIX):] for k in valid}
    for key in sorted(prefixed_attributes):
        if key not in valid:
            raise AprilConfigError(f"{key}: unknown setting; {_closest(key)}")
    for key in sorted(yaml_keys):
        if key in valid:
            continue
        norm = _normalized(key)
        if norm in valid or norm.startswith(SETTING_PREFIX):
            raise AprilConfigError(f"{key}: unknown setting; {_closest(norm)}")
        if norm in unprefixed:
            raise AprilConfigError(f"{key}: plugin settings take the {SETTING_PREFIX} prefix; "
                                   f"closest valid name: {SETTING_PREFIX}{norm}")
        near = difflib.get_close_matches(norm, sorted(valid | unprefixed), n=1, cutoff=NEAR_MISS_CUTOFF)
        if near:
            name = near[0] if near[0].startswith(SETTING_PREFIX) else SETTING_PREFIX + near[0]
            raise AprilConfigError(f"{key}: not a setting, but close to one; closest valid name: {name}")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        _fail(name, f"must be one of {', '.join(allowed)}; got {value!r}")


_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def _coerce(name: str, f: dataclasses.Field, value: Any, empty: str = "must not be null") -> Any:
    """YAML and argparse hand us strings, ints for floats, etc.; convert to the field's type."""
    type_str = str(f.type).replace(" ", "")
    optional = "|None" in type_str
    base = type_str.replace("|None", "")
    if value is None:
        if optional:
            return None
        _fail(name, empty)
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
        rows.append(f"| `{SETTING_PREFIX}{f.name}` | `{default}` | {f.metadata.get('help', '')} |")
    return "\n".join(rows)
