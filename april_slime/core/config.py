"""The rollout's settings: what the scheduler, the buffer and the engine client read.

Every setting is a dataclass field, read in a slime job from ``args.april_<field>`` (slime fills it
from the YAML passed with ``--custom-config-path``). The job's settings are built once, with the
loss's (``april_slime.training.settings``), by the face (``april_slime.settings``), which also
refuses misspelled keys; this module defines the rollout's fields, their checks and the coercion of
YAML values to a field's type. A wrong value stops the job at start with one line that names the key
and says why (``AprilConfigError``).

This module owns no runtime state: the scheduler, buffer and engine client each take the validated
``AprilConfig`` and read from it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any

from april_slime.core.keys import SETTING_PREFIX

POLICIES = ("sync", "april", "copris")
DISPATCH_MODES = ("auto", "direct", "router")  # april_slime.core.dispatch reads them
STALE_ACTIONS = ("restart", "drop")
RESUME_PRIORITIES = ("verl", "fifo", "stalest")
# slime's estimators whose rewards it normalises per group (--rewards-normalization), and the
# function that does it without the masked samples (mask_failed_samples)
MASKING_POST_PROCESS = "april_slime.masking.post_process_rewards"

# Sane upper bounds of settings whose absurd values would otherwise pass (documented in the help).
MAX_OVER_SAMPLING_FACTOR = 100.0
MAX_RETRIES = 20
MAX_TOTAL_RETRY_BACKOFF_S = 86400.0


class AprilConfigError(ValueError):
    """A plugin setting is invalid. The message is one line: ``april_<key>: <reason>``."""


@dataclass
class AprilConfig:
    # ---------------------------------------------------------------- rollout side
    policy: str = field(
        default="copris",
        metadata={"help": "Rollout policy: sync (whole batch, no abort), april (over-sampled batches, "
                          "abort at target), copris (fixed number of requests in flight, refilled as they "
                          "complete, april_refill_batch at a time; abort at target)."},
    )
    concurrency: int | None = field(
        default=None,
        metadata={"help": "copris: requests (samples) held in flight across all engines, N'. "
                          "Default: rollout_batch_size * n_samples_per_prompt."},
    )
    refill_batch: int | None = field(
        default=None,
        metadata={"help": "copris: calls submitted together: a refill waits until this many of the N' "
                          "slots are free (never while nothing is in flight), so an engine runs one "
                          "prefill step for several new requests instead of one per completion, each "
                          "stalling its decoding. Unset: n_samples_per_prompt (a group's worth); 1: every "
                          "completion refilled at once (CoPRIS as published)."},
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
        "is protected: resumed first and run to completion in its next step (at most rollout_batch_size "
        "groups a step; the rest at a later one). Unset: never protected.")})
    step_deadline_s: float = field(
        default=3600.0,
        metadata={"help": "Longest wait of a rollout step for the groups it must train (at "
                          "april_max_staleness, or protected by april_max_interruptions), in seconds from the "
                          "step's start; past it each unfinished sample of such a group fails: masked with "
                          "april_mask_failed_samples (episodes), else re-run or dropped as any failed sample, "
                          "and the step goes on without waiting for it (docs/reliability.md). Counted in "
                          "april/deadline_failed_samples. 0: no deadline (a tool that never returns can then "
                          "hold a step for good). The default is the request timeout's default: an hour, "
                          "some 20 steps of the 8-GPU layouts docs/results.md predicts."},
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
        metadata={"help": "Folder of the data-source checkpoint (april_state_<rollout_id>.bin: prompt "
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
    # ------------------------------------------------------------------ building
    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> AprilConfig:
        """Build from plain keys (with or without the ``april_`` prefix); a key that is not a
        rollout setting is an error (a job's whole set of settings goes through
        ``april_slime.settings.JobSettings``, which also knows the loss's)."""
        known = {f.name: f for f in fields(cls)}
        kwargs = {}
        for key, value in values.items():
            name = key[len(SETTING_PREFIX):] if key.startswith(SETTING_PREFIX) else key
            if name not in known:
                raise AprilConfigError(f"{SETTING_PREFIX}{name}: not a rollout setting")
            kwargs[name] = coerce(name, known[name], value)
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
        if self.concurrency is not None and self.concurrency < 1:
            _fail("concurrency", f"must be >= 1, got {self.concurrency}")
        if self.refill_batch is not None and self.refill_batch < 1:
            _fail("refill_batch", f"must be >= 1 or unset, got {self.refill_batch}")
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

    def resolved_concurrency(self, rollout_batch_size: int, n_samples_per_prompt: int) -> int:
        return self.concurrency or rollout_batch_size * n_samples_per_prompt

    def resolved_refill_batch(self, n_samples_per_prompt: int) -> int:
        return self.refill_batch or n_samples_per_prompt


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


def _check_staleness(c: AprilConfig) -> None:
    """The settings of the staleness bound, of protection and of the wait for the groups they make due."""
    if c.max_staleness is not None and c.max_staleness < 0:
        _fail("max_staleness", f"must be >= 0 or unset, got {c.max_staleness}")
    if c.max_interruptions is not None and c.max_interruptions < 1:
        _fail("max_interruptions", f"must be >= 1 or unset, got {c.max_interruptions}")
    # the wait for the groups the bound (or protection) makes the step train
    if not (math.isfinite(c.step_deadline_s) and c.step_deadline_s >= 0):
        _fail("step_deadline_s", f"must be a finite number of seconds > 0, or 0 for no deadline, "
                                 f"got {c.step_deadline_s}")


def _fail(name: str, reason: str) -> None:
    raise AprilConfigError(f"{SETTING_PREFIX}{name}: {reason}")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        _fail(name, f"must be one of {', '.join(allowed)}; got {value!r}")


_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def coerce(name: str, f: dataclasses.Field, value: Any, empty: str = "must not be null") -> Any:
    """YAML and argparse hand us strings, ints for floats, etc.; convert to the field's type (any
    settings dataclass's: the face coerces the loss's settings with it too)."""
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
