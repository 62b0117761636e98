"""What the parts of one rollout step share, and the events that change the step's state.

A step (``scheduler._Step``) is run by a few parts, each owning its own state: the groups
(``groups.StepGroups``), the calls in flight (``calls.EngineCalls``), the engines as the step sees
them (``health.EngineWatch``) and the faults (``faults.CallFaults``). What they all read or add to
(the event loop, the one event queue, the counters, the queue of work items waiting for a call, the
work kind, the pacing and the phase) is one ``StepContext``, built by the step and handed to each
part, instead of a copy of each reference in every constructor.

Everything that changes the step's state arrives on ``StepContext.events`` as one of the typed
events below and is handled by the step between events, so no two changes interleave. Each event
names what happened, not what to do about it: the step decides.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from april_slime.core.step_metrics import StepCounters

if TYPE_CHECKING:  # types only: these modules import this one
    from april_slime.core.pacing import StalenessPacing
    from april_slime.core.sglang_protocol import GenerateResult
    from april_slime.core.types import Group, Trajectory
    from april_slime.core.work import TrajectoryWork


@dataclass(frozen=True)
class CallReplied:
    """Model call ``rid`` ended: with the engine's reply, or with the error that ended it."""

    rid: str
    result: GenerateResult | None
    error: Exception | None


@dataclass(frozen=True)
class GroupRewarded:
    """A group's reward task ended (``error``: what the reward function raised)."""

    group: Group
    error: Exception | None


@dataclass(frozen=True)
class ProbeAnswered:
    """A health probe of ``url`` ended: the engine answered (``error`` None) or did not."""

    url: str
    error: Exception | None


@dataclass(frozen=True)
class ConcurrencyChosen:
    """The adaptive controller chose a new number of calls in flight."""

    limit: int


@dataclass(frozen=True)
class EpisodeCallAsked:
    """An episode's function asked for a model call (``call``: the call's trajectory)."""

    call: Trajectory


@dataclass(frozen=True)
class EpisodeEnded:
    """An episode finished or was given up (``member``: the sample it produces)."""

    member: Trajectory


StepEvent = CallReplied | GroupRewarded | ProbeAnswered | ConcurrencyChosen | EpisodeCallAsked | EpisodeEnded

FILL, DRAIN, RECOVER = "fill", "drain", "recover"


@dataclass
class StepContext:
    """The state one step's parts share; owned by the step, which alone changes ``phase``."""

    loop: asyncio.AbstractEventLoop
    current_version: int
    target: int  # groups the step returns
    work: TrajectoryWork  # the step's kind of work item (trajectories, or episodes' calls)
    pacing: StalenessPacing
    counters: StepCounters = field(default_factory=StepCounters)
    events: asyncio.Queue[StepEvent] = field(default_factory=asyncio.Queue)
    queue: deque[Any] = field(default_factory=deque)  # work items waiting for a call
    # FILL until the target is met, then DRAIN; RECOVER after an error
    phase: str = FILL

    @property
    def draining(self) -> bool:
        """Past the fill: nothing is resubmitted, and no failure ends the step."""
        return self.phase != FILL

    @property
    def recovering(self) -> bool:
        """The step failed: completed groups go back unjudged."""
        return self.phase == RECOVER

    def report(self, event: StepEvent) -> None:
        self.events.put_nowait(event)
