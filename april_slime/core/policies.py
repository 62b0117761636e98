"""Submission policies: how much work a rollout step opens and keeps in flight (``AprilConfig.policy``).

A policy decides counts and the step's executor only runs work (as AReaL-lite's staleness manager
decides how many rollouts may run and its executor runs them). The executor asks, each time it
settles:

* ``groups_to_open(step)``: how many more groups to open now (0: none); asked again after every
  batch it opened, until the answer is 0 or nothing is left to open;
* ``calls_to_submit(step)``: how many of the queued calls may go in flight now;
* ``in_flight_limit``: the limit on calls in flight (``None``: none), as the timeline and the
  ``concurrency_limit`` metric report it;
* ``watches_loads`` / ``observe(loads, now)`` / ``set_limit(n)``: whether the step polls the engine
  loads for the policy, the limit the policy derives from them, and taking that limit.

Every policy counts the step's model calls (``calls_in_flight``, ``calls_queued`` of the
``StepView``), not its trajectories, so a coming multi-turn episode's calls count against the
same limit as a trajectory's. Every policy aborts what still runs once the target is met.

* ``sync``: the baseline. Opens as many groups as are still missing (buffer first), submits every
  trajectory at once and waits for all of them; groups rejected by the filter are replaced.
  Nothing is in flight when the target is met, so nothing is aborted.
* ``april``: batch-granular over-provisioning, as slime ships it. Opens an over-sampling batch
  (``over_sampling_batch_size`` groups, default ``over_sampling_factor * rollout_batch_size``) and
  submits all of it; whenever the groups still in play can no longer reach the target (accepted +
  running + being rewarded < target, e.g. after filter rejections) it opens another batch. Once
  the target is reached everything still running is aborted.
* ``copris``: concurrency-controlled partial rollout. Exactly N' requests are held in flight
  across all engines and refilled on every completion, from the buffer first and then from new
  prompts. N' is ``config.resolved_concurrency(...)`` or, with a controller, the controller's
  latest target (polled from the engine loads in a background task; shrinking only stops
  refilling until the count drops). Aborts at target.
  Refills go out in batches of at least ``refill_batch`` calls (``AprilConfig.refill_batch``): an
  engine that takes a new request runs a prefill step for it before its next decode step (SGLang
  schedules prefill first and does not mix the two by default), which stalls every request it is
  decoding. One completion refilled at a time pays that stall per completion; waiting until a few
  slots are free pays it once for all of them, and the calls of one group then share their prompt's
  prefill. With nothing in flight a refill never waits.

A policy is held by the scheduler across steps (copris' N' carries over).
"""

from __future__ import annotations

import logging
import math
from typing import Protocol

from april_slime.core.config import AprilConfig
from april_slime.core.sglang_protocol import EngineLoad

logger = logging.getLogger(__name__)


class StepView(Protocol):
    """What a policy reads of the running step."""

    @property
    def target(self) -> int: ...

    @property
    def accepted_groups(self) -> int: ...

    @property
    def groups_in_play(self) -> int:
        """Accepted + open + being rewarded."""

    @property
    def calls_in_flight(self) -> int: ...

    @property
    def calls_queued(self) -> int:
        """Calls ready to be submitted (work items waiting for a call)."""

    @property
    def episodes_live(self) -> int:
        """Episodes of agent functions alive (0 for a job without one)."""

    @property
    def groups_to_resume(self) -> int:
        """Buffered groups taken by the step and not opened yet."""


class ConcurrencyController(Protocol):
    def initial(self) -> int: ...

    def observe(self, loads: list[EngineLoad], now: float) -> int:
        """Returns the new concurrency target N'."""


class Policy:
    name = ""

    def groups_to_open(self, step: StepView) -> int:
        raise NotImplementedError

    @property
    def in_flight_limit(self) -> int | None:
        return None

    def calls_to_submit(self, step: StepView) -> int:
        limit = self.in_flight_limit
        return step.calls_queued if limit is None else max(0, limit - step.calls_in_flight)

    @property
    def watches_loads(self) -> bool:
        return False

    def observe(self, loads: list[EngineLoad], now: float) -> int:
        raise NotImplementedError(f"the {self.name} policy does not watch the engine loads")

    def set_limit(self, limit: int) -> None:
        raise NotImplementedError(f"the {self.name} policy has no in-flight limit")


class SyncPolicy(Policy):
    name = "sync"

    def groups_to_open(self, step: StepView) -> int:
        return max(step.target - step.groups_in_play, 0)


class AprilPolicy(Policy):
    name = "april"

    def __init__(self, over_sampling_groups: int):
        self.over_sampling_groups = over_sampling_groups

    def groups_to_open(self, step: StepView) -> int:
        return self.over_sampling_groups if step.groups_in_play < step.target else 0


class CoprisPolicy(Policy):
    name = "copris"

    def __init__(self, concurrency: int, n_samples_per_prompt: int,
                 controller: ConcurrencyController | None = None, max_live_episodes: int | None = None,
                 refill_batch: int = 1):
        if concurrency < n_samples_per_prompt:
            logger.warning("copris concurrency %d < n_samples_per_prompt %d: a group can never be "
                           "in flight as a whole", concurrency, n_samples_per_prompt)
        self.concurrency = concurrency
        self.n_samples_per_prompt = n_samples_per_prompt
        self.controller = controller
        self.max_live_episodes = max_live_episodes
        self.refill_batch = max(1, refill_batch)

    def calls_to_submit(self, step: StepView) -> int:
        limit = self.in_flight_limit
        free = max(0, limit - step.calls_in_flight)
        # a batch smaller than refill_batch waits for more slots, unless nothing would run meanwhile
        # (or the limit itself is smaller than a batch)
        if free < min(self.refill_batch, limit) and step.calls_in_flight > 0:
            return 0
        return free

    def groups_to_open(self, step: StepView) -> int:
        free = self.in_flight_limit - step.calls_in_flight - step.calls_queued
        if free <= 0 or step.accepted_groups >= step.target:
            return 0
        groups = math.ceil(free / self.n_samples_per_prompt)
        if step.episodes_live or self.max_live_episodes is not None:
            # An episode in a tool holds no call: without a cap every tool phase would open another
            # group. N' still bounds the calls; this bounds the episodes alive. Buffered groups are
            # alive already (their episodes wait), so only fresh ones count against the cap, and
            # only whole groups that fit under it: rounding up would pass it by up to n - 1.
            # (A job without episodes has none alive: the cap then only splits one opening into
            # several, as the scheduler asks again until nothing more opens.)
            cap = self.max_live_episodes or 2 * self.concurrency
            fresh = max(0, (cap - step.episodes_live) // self.n_samples_per_prompt)
            groups = min(groups, step.groups_to_resume + fresh)
        return groups

    @property
    def in_flight_limit(self) -> int:
        return self.concurrency

    @property
    def watches_loads(self) -> bool:
        return self.controller is not None

    def observe(self, loads: list[EngineLoad], now: float) -> int:
        return max(1, int(self.controller.observe(loads, now)))

    def set_limit(self, limit: int) -> None:
        self.concurrency = limit


def make_policy(config: AprilConfig, *, n_samples_per_prompt: int, over_sampling_groups: int, concurrency: int,
                controller: ConcurrencyController | None) -> Policy:
    """The policy ``config.policy`` names; ``concurrency`` is copris' first N'."""
    if config.policy == "sync":
        return SyncPolicy()
    if config.policy == "april":
        return AprilPolicy(over_sampling_groups)
    return CoprisPolicy(concurrency, n_samples_per_prompt, controller, config.max_live_episodes,
                        config.resolved_refill_batch(n_samples_per_prompt))
