"""Arms and rounds: the policies of one comparison take turns on the same engines.

An arm is a policy at a staleness bound with its settings (``Arm``); each arm is a job of its
own: its scheduler (``assemble_scheduler``, as the plugin's face builds it), partial buffer,
prompts, policy-version count and, for a multi-turn workload, its episodes. A round runs one step
of every arm, in an order that rotates from round to round, so a slow spell of a shared machine
lands on every arm alike and the arms' steps can be compared round by round.

Before each step the engines take the arm's policy version and drop their prefix cache
(``Stack.next_version``). Every arm counts its versions from the engines' version at the start
(``Stack.version_base``) and all arms advance one a round, so the engines' version never goes back.
After a multi-turn arm's step the bench waits, uncounted, for the tool calls its suspended episodes
still hold (as they would finish during the training phase), so no arm gets tool time during
another arm's step. An arm's ``dispatch`` setting (``april_dispatch``) sends its calls straight to
the engines or through the router; the comparison's ``--dispatch`` otherwise.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from april_slime.core.buffer import PartialBuffer
from april_slime.core.config import AprilConfig
from april_slime.core.dispatch import Dispatch
from april_slime.core.engine import EngineClient
from april_slime.core.episodes import EpisodeRunner
from april_slime.core.scheduler import RolloutScheduler, assemble_scheduler

from ..multiturn import SAMPLING_PARAMS, BenchAgent
from .stacks import Stack
from .trace import TracingTransport, breakdown
from .workload import FixedLengthPrompts, RealWorkload, tool_ids

POLICIES = ("sync", "april", "copris")


@dataclass(frozen=True)
class Arm:
    """``policy`` at ``bound`` (``april_max_staleness``; None: unbounded) with ``settings`` (other
    ``april_*`` rollout settings, e.g. ``refill_batch``)."""

    policy: str
    bound: int | None = None
    settings: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"arm policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.policy == "sync" and self.bound is not None:
            raise ValueError("sync trains on-policy: it takes no staleness bound")
        AprilConfig.from_dict(self.config_values())  # an impossible setting fails before any engine starts

    @property
    def label(self) -> str:
        text = self.policy + ("" if self.bound is None else f"@s{self.bound}")
        if self.settings:
            text += "[" + ",".join(f"{k}={v}" for k, v in self.settings) + "]"
        return text

    def config_values(self) -> dict[str, Any]:
        return {"policy": self.policy, "max_staleness": self.bound, **dict(self.settings)}


def parse_arm(text: str) -> Arm:
    """``copris``, ``copris@s2``, ``copris[refill_batch=1]``, ``april@s2[over_sampling_factor=3]``."""
    head, _, rest = text.strip().partition("[")
    policy, _, bound = head.partition("@")
    settings: list[tuple[str, Any]] = []
    if rest:
        if not rest.endswith("]"):
            raise ValueError(f"arm {text!r}: settings go in [key=value,...]")
        for item in rest[:-1].split(","):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"arm {text!r}: expected key=value, got {item!r}")
            settings.append((key.strip().removeprefix("april_"), _value(value.strip())))
    if bound and not (bound.startswith("s") and bound[1:].isdigit()):
        raise ValueError(f"arm {text!r}: a bound is written @s<k>, e.g. copris@s2")
    return Arm(policy, int(bound[1:]) if bound else None, tuple(settings))


def _value(text: str) -> Any:
    if text.lower() in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def default_arms(bounds: Sequence[int | None]) -> list[Arm]:
    """sync, then april and copris at every bound (the plugin's defaults otherwise)."""
    return [Arm("sync"), *(Arm(p, b) for b in bounds for p in ("april", "copris"))]


@dataclass
class StepRecord:
    round: int
    arm: str
    version: int
    breakdown: dict[str, float]  # trace.breakdown, client_cpu_s, engine_cpu_s
    generated_tokens: float
    returned_tokens: float
    buffer_tokens: int  # response tokens held in the buffer after the step
    buffer_age_mean: float  # their token-weighted age in versions, once the next version is live
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        return self.breakdown["step_s"]


class ArmRunner:
    """One arm as a job: its scheduler, buffer, prompts, version count and episodes."""

    def __init__(self, arm: Arm, workload: RealWorkload, stack: Stack, transport: TracingTransport,
                 dispatch: str = "direct", tool_runner: Callable[[float], Any] | None = None):
        self.arm = arm
        self.workload = workload
        self.prompts = FixedLengthPrompts(workload)
        self.version = stack.version_base
        config = AprilConfig.from_dict(arm.config_values())
        dispatch = dict(arm.settings).get("dispatch", dispatch)  # an arm's april_dispatch wins
        if dispatch == "router" and stack.router_url:
            chosen = Dispatch("router", tuple(stack.engine_urls), stack.router_url, "bench --dispatch router")
        else:
            chosen = Dispatch.direct(stack.engine_urls)
        self.client = EngineClient([], transport=transport, dispatch=chosen)
        self.buffer = PartialBuffer.from_config(config)
        self.agent: BenchAgent | None = None
        self.episodes: EpisodeRunner | None = None
        self.last_groups: list = []  # the groups the latest step returned (for checks)
        if workload.multi_turn:
            self.agent = BenchAgent(self.prompts.plans, workload.tool_tokens, 1.0, workload.tool_workers,
                                    tool_ids=tool_ids(workload.tool_tokens), run_tool=tool_runner)
            self.episodes = EpisodeRunner(self.agent)
            self.agent.runner = self.episodes
        self.scheduler: RolloutScheduler = assemble_scheduler(
            config, self.client, self.buffer, rollout_batch_size=workload.rollout_batch_size,
            n_samples_per_prompt=workload.n_samples_per_prompt, sampling_params=dict(SAMPLING_PARAMS),
            episodes=self.episodes)

    def buffer_state(self, next_version: int) -> tuple[int, float]:
        tokens, age = 0, 0.0
        for group in self.buffer.groups():
            for t in group.trajectories:
                for version, count in t.version_runs:
                    tokens += count
                    age += count * (next_version - version)
        return tokens, (age / tokens if tokens else 0.0)

    async def step(self, stack: Stack, transport: TracingTransport, index: int, measure_cpu: bool) -> StepRecord:
        loop = asyncio.get_running_loop()
        await stack.next_version(self.version)
        first = len(transport.records)
        engine_cpu = stack.engine_cpu_s() if measure_cpu else None
        cpu0, t0 = time.process_time(), loop.time()
        result = await self.scheduler.run_step(self.prompts, self.version)
        step_s = loop.time() - t0
        self.last_groups = result.groups
        client_cpu = time.process_time() - cpu0
        if engine_cpu is not None:
            engine_cpu = stack.engine_cpu_s() - engine_cpu
        m = result.metrics
        parts = breakdown(transport.records[first:], t0, step_s, m["april/time_to_target_s"],
                          self.scheduler.last_timeline, self.client.engine_urls)
        parts["client_cpu_s"] = client_cpu if measure_cpu else float("nan")
        parts["engine_cpu_s"] = engine_cpu if engine_cpu is not None else float("nan")
        self.version += 1
        held, age = self.buffer_state(self.version)
        if self.agent is not None:
            while self.agent.tools_open:  # uncounted: the training phase (module doc)
                await asyncio.sleep(0.01)
        keep = ("april/returned_groups", "april/resumed_trajectories", "april/carried_groups",
                "april/offpolicy_token_fraction", "april/staleness_mean", "april/staleness_max",
                "april/aborted_tokens", "april/engine_calls", "april/pacing_held_opens",
                "april/pacing_deferred_groups", "april/stale_fallback_groups", "april/inflight_mean")
        return StepRecord(index, self.arm.label, self.version - 1, parts, m["april/generated_tokens"],
                          m["april/returned_tokens"], held, age, {k: m[k] for k in keep if k in m})

    async def close(self) -> None:
        if self.episodes is not None:
            await self.episodes.close()
        await self.client.close()


async def run_rounds(stack: Stack, workload: RealWorkload, arms: Sequence[Arm], rounds: int, *,
                     dispatch: str = "direct", tool_runner: Callable[[float], Any] | None = None,
                     measure_cpu: bool = True,
                     on_step: Callable[[StepRecord, ArmRunner], None] | None = None) -> dict[str, list[StepRecord]]:
    """``rounds`` rounds of one step per arm, the order rotating; every step's record, by arm
    (``on_step`` sees each record with its arm's runner as it comes)."""
    transport = TracingTransport(stack.transport)
    runners = [ArmRunner(a, workload, stack, transport, dispatch, tool_runner) for a in arms]
    out: dict[str, list[StepRecord]] = {a.label: [] for a in arms}
    try:
        for index in range(rounds):
            k = index % len(runners)
            for runner in runners[k:] + runners[:k]:
                record = await runner.step(stack, transport, index, measure_cpu)
                out[runner.arm.label].append(record)
                if on_step is not None:
                    on_step(record, runner)
    finally:
        for runner in runners:
            await runner.close()
    return out
