"""The multi-turn workload: episodes of several model calls with tools between, run by the core.

What this module owns:

* ``EpisodePlan`` / ``plan_episode``: what one episode does, fixed by (seed, prompt, sample) so
  every policy runs the same episodes: its number of turns (uniform in ``turns_min..turns_max``),
  the model tokens of each turn (the emulator's length law under the per-turn budget, one draw per
  turn with its own sampling seed) and the attempts of each tool phase: the successful call's
  latency (lognormal, emulated seconds), after ``tool_timeout_s`` for every failed attempt before
  it (each fails with ``tool_failure_rate``, at most ``tool_max_retries`` retries). Calls run with
  ``ignore_eos`` and ``max_new_tokens`` = the drawn length, so a turn has exactly its drawn tokens
  however often it is aborted and resumed.
* ``EpisodePrompts``: the bench's synthetic prompts with every sample's plan; in the flat twin
  (``flat_episodes``) a sample is one plain trajectory of the episode's total model tokens.
* ``BenchAgent``: an in-process ``core.episodes.EpisodeAgent``. Its coroutine makes the turns by
  calling ``EpisodeRunner.call`` directly (the HTTP front is only a transport, not needed here) and
  runs each tool attempt on one of ``tool_workers`` workers (a semaphore shared by every episode:
  a call waits for a free worker, as on a sandbox pool; first come first served, or with
  ``tool_pool_order: oldest`` the oldest episode's call first, ``OldestFirstPool``), sleeping its
  latency on the loop's clock,
  which on the bench's virtual loop is emulated time; ``finish`` builds the member as a generate
  function's sample would be (calls and tool results concatenated, tool tokens masked, per-token
  versions).
* ``EpisodeDriver``: what ``runner.run_policy`` swaps in for a multi-turn workload: the prompts,
  the sampling parameters, the ``EpisodeRunner`` for ``RolloutScheduler(episodes=...)``, and the
  per-step accounting of the tokens that unfinished episodes hold (steady-state detection).

The scheduling (N' counts calls, abort at target, suspended calls resumed next step) is the
core's (``core.episodes``, ``core.scheduler``); nothing of it is re-implemented here.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from april_slime.core.episodes import CallRequest, Episode, EpisodeError, EpisodeRunner, ModelCall
from april_slime.core.types import Group, Trajectory, TrajectoryStatus
from april_slime.core.versions import VersionRuns
from april_workbench.emulator import SyntheticLM

from .workloads import MAX_TURNS, LengthStats, SyntheticPrompts, Workload

# temperature 1 as the single-turn bench; ignore_eos so a call ends exactly at its drawn length
SAMPLING_PARAMS = {"temperature": 1.0, "top_p": 1.0, "ignore_eos": True}
_PLAN_SALT = 0x6570697364  # keeps the plan's random stream apart from any other use of the seed


@dataclass(frozen=True)
class EpisodePlan:
    lengths: tuple[int, ...]  # model tokens of each turn
    # each tool phase (one between two turns): its attempts' seconds on a worker, emulated; every
    # attempt but the last failed (a timeout)
    tool_attempts: tuple[tuple[float, ...], ...]

    @property
    def tool_s(self) -> tuple[float, ...]:
        """Worker seconds of each tool phase, its failed attempts included (queueing excluded)."""
        return tuple(sum(a) for a in self.tool_attempts)

    @property
    def tool_failures(self) -> int:
        return sum(len(a) - 1 for a in self.tool_attempts)

    @property
    def turns(self) -> int:
        return len(self.lengths)

    @property
    def model_tokens(self) -> int:
        return sum(self.lengths)


def plan_episode(workload: Workload, model: SyntheticLM, prompt_ids: Sequence[int], index: int, j: int,
                 budget: int) -> EpisodePlan:
    """The episode of sample ``j`` of prompt ``index``. Turn ``k``'s length is the emulator's
    uninterrupted response length for this prompt under sampling seed ``seed * MAX_TURNS + k``:
    the length law as the single-turn bench draws it (the prompt's difficulty shared by its turns,
    the sample's spread and runaways per turn)."""
    rng = np.random.default_rng([_PLAN_SALT, workload.seed, index, j])
    turns = int(rng.integers(workload.turns_min, workload.turns_max + 1))
    z = rng.standard_normal(turns - 1)
    tool_s = [float(workload.tool_median_s * math.exp(workload.tool_sigma * x)) for x in z]
    # drawn after the latencies, so a workload without failures has the plans it had before
    fails = rng.random((turns - 1, workload.tool_max_retries + 1)) < workload.tool_failure_rate
    attempts = []
    for latency, row in zip(tool_s, fails):
        if row.all():  # every attempt timed out: the error text is the result
            attempts.append((workload.tool_timeout_s,) * len(row))
            continue
        failed = int(np.argmin(row))  # failed attempts before the first that succeeds
        attempts.append((workload.tool_timeout_s,) * failed + (latency,))
    seed = (index * workload.n_samples_per_prompt + j) * MAX_TURNS
    lengths = tuple(model.response_length(prompt_ids, seed + k, budget) for k in range(turns))
    return EpisodePlan(lengths, tuple(attempts))


def plans_of(workload: Workload, budget: int, num_prompts: int) -> list[EpisodePlan]:
    """The plans of every sample of the first ``num_prompts`` prompts."""
    model = SyntheticLM(seed=workload.seed, length=workload.length_model())
    prompts = SyntheticPrompts(workload.prompt_len, workload.n_samples_per_prompt, 1, model.vocab_size,
                               workload.seed)
    return [plan_episode(workload, model, prompts.prompt_ids(i), i, j, budget)
            for i in range(num_prompts) for j in range(workload.n_samples_per_prompt)]


def episode_length_stats(workload: Workload, budget: int, num_prompts: int = 64) -> LengthStats:
    """``LengthStats`` of the episodes' model tokens, as one response each (the flat twin's lengths):
    what the bench's ideal throughput is computed for on a multi-turn workload. ``truncated_fraction``
    counts the episodes with a turn at the per-turn budget."""
    plans = plans_of(workload, budget, num_prompts)
    tokens = np.array([p.model_tokens for p in plans], dtype=float)
    return LengthStats(mean=float(tokens.mean()), mean_square=float((tokens ** 2).mean()),
                       median=float(np.median(tokens)), p90=float(np.percentile(tokens, 90)),
                       truncated_fraction=float(np.mean([max(p.lengths) >= budget for p in plans])))


def tool_result(n: int) -> list[int]:
    """The ``n`` tokens a tool's result adds to the context (any valid ids: the emulator's streams
    depend on positions, not on the context's content)."""
    return [1000 + (37 * k) % 5000 for k in range(n)]


class EpisodePrompts(SyntheticPrompts):
    """The bench's prompts, each sample with its ``EpisodePlan`` (``plans``, by member uid)."""

    def __init__(self, workload: Workload, model: SyntheticLM, budget: int):
        super().__init__(workload.prompt_len, workload.n_samples_per_prompt, budget, model.vocab_size,
                         workload.seed)
        self.workload = workload
        self.model = model
        self.budget = budget
        self.plans: dict[str, EpisodePlan] = {}

    def group(self, index: int, current_version: int) -> Group:
        group = super().group(index, current_version)
        for t in group.trajectories:
            plan = plan_episode(self.workload, self.model, group.prompt_ids, index, t.index_in_group, self.budget)
            self.plans[t.uid] = plan
            # flat: one call of the episode's model tokens; episodes: the member's whole response
            t.max_new_tokens = plan.model_tokens + (0 if self.workload.flat_episodes
                                                    else self.workload.tool_tokens * (plan.turns - 1))
        return group


@dataclass
class EpisodeRecord:
    """A finished episode, as the agent saw it (for the run's summary and the tests)."""

    uid: str
    turns: int
    call_tokens: tuple[int, ...]  # model tokens each call returned
    segments: int  # engine calls over all its turns (a turn aborted and resumed takes several)
    aborts: int
    tool_s: float  # worker seconds of its tools (failed attempts included), emulated seconds
    started: float  # loop time of its first call request and of its return
    ended: float


class OldestFirstPool:
    """Tool workers, each freed one handed to the waiting call of the oldest episode (its launch
    time; ties: first come) instead of the first come (``asyncio.Semaphore``, ``tool_pool_order``
    fifo). Under a staleness bound the oldest episodes are the ones their step waits for."""

    def __init__(self, workers: int):
        self.free = workers
        self.waiting: list[tuple[float, int, asyncio.Future]] = []  # (episode launch time, arrival, waiter)
        self.arrivals = 0

    @contextlib.asynccontextmanager
    async def slot(self, started: float):
        await self._acquire(started)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, started: float) -> None:
        if self.free and not self.waiting:
            self.free -= 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self.arrivals += 1
        heapq.heappush(self.waiting, (started, self.arrivals, waiter))
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # handed a worker as it was cancelled: pass the worker on
            raise

    def _release(self) -> None:
        while self.waiting:
            *_, waiter = heapq.heappop(self.waiting)
            if not waiter.done():  # a cancelled call's waiter is skipped
                waiter.set_result(None)
                return
        self.free += 1


class BenchAgent:
    """An ``EpisodeAgent`` whose episodes make their planned turns through ``runner.call``."""

    def __init__(self, plans: dict[str, EpisodePlan], tool_tokens: int, time_scale: float = 1.0,
                 tool_workers: int | None = None, tool_pool_order: str = "fifo",
                 tool_ids: list[int] | None = None, run_tool: Callable[[float], Awaitable[None]] | None = None):
        self.plans = plans
        self.tool_ids = tool_result(tool_tokens) if tool_ids is None else list(tool_ids)
        # what holds a worker for a tool's seconds: a sleep on the loop's clock, or a real tool
        # (``real.tools.ToolProcessPool.run``: a worker process, wall seconds)
        self.run_tool = run_tool
        self.tools_open = 0  # tool attempts waiting for a worker or running
        self.time_scale = time_scale  # emulated seconds per loop second (http mode runs on the wall clock)
        self.tool_workers = tool_workers  # None: every tool call runs at once
        self.tool_pool_order = tool_pool_order  # fifo or oldest (Workload.tool_pool_order)
        self._pool: asyncio.Semaphore | OldestFirstPool | None = None
        self.tool_wait_s = 0.0  # emulated seconds tool calls waited for a free worker
        self.tool_busy_max = 0  # most workers busy at once
        self._busy = 0
        self.runner: EpisodeRunner | None = None
        self.log: dict[str, EpisodeRecord] = {}
        self._started: dict[str, float] = {}

    def launch(self, member: Trajectory, group: Group):
        return self._episode(member, self.plans[member.uid])

    async def _episode(self, member: Trajectory, plan: EpisodePlan) -> list[int]:
        assert self.runner is not None, "the driver sets the agent's runner"
        loop = asyncio.get_running_loop()
        started = self._started[member.uid] = loop.time()
        context = list(member.prompt_ids)
        for turn, tokens in enumerate(plan.lengths):
            if turn:
                for seconds in plan.tool_attempts[turn - 1]:
                    await self._tool(seconds, started)
                context += self.tool_ids
            reply = await self.runner.call(member.uid, CallRequest(
                input_ids=list(context), max_new_tokens=tokens, sampling_params=dict(SAMPLING_PARAMS)))
            context += reply["output_ids"]
        return context

    async def _tool(self, seconds: float, started: float) -> None:
        """One tool attempt: wait for a worker, hold it ``seconds`` (emulated); ``started``: when
        its episode was launched (the oldest-first pool's order)."""
        self.tools_open += 1
        try:
            await self._tool_attempt(seconds, started)
        finally:
            self.tools_open -= 1

    async def _hold(self, seconds: float) -> None:
        if self.run_tool is not None:
            await self.run_tool(seconds)
        else:
            await asyncio.sleep(seconds / self.time_scale)

    async def _tool_attempt(self, seconds: float, started: float) -> None:
        if self.tool_workers is None:
            await self._hold(seconds)
            return
        if self._pool is None:
            self._pool = (asyncio.Semaphore(self.tool_workers) if self.tool_pool_order == "fifo"
                          else OldestFirstPool(self.tool_workers))
        loop = asyncio.get_running_loop()
        queued = loop.time()
        slot = self._pool if isinstance(self._pool, asyncio.Semaphore) else self._pool.slot(started)
        async with slot:
            self.tool_wait_s += (loop.time() - queued) * self.time_scale
            self._busy += 1
            self.tool_busy_max = max(self.tool_busy_max, self._busy)
            try:
                await self._hold(seconds)
            finally:
                self._busy -= 1

    def reply(self, call: ModelCall) -> dict:
        t = call.trajectory
        return {"output_ids": list(t.response_ids),
                "meta_info": {"finish_reason": {"type": t.finish_reason}, "completion_tokens": t.response_length}}

    def finish(self, member: Trajectory, episode: Episode, result: Any) -> None:
        """The member as a generate function's sample: every call's tokens and log-probs with their
        versions, each tool result between two calls (log-prob 0, masked, the version before it)."""
        plan = self.plans[member.uid]
        calls = [c.trajectory for c in episode.served]
        got = tuple(t.response_length for t in calls)
        if got != plan.lengths:
            raise EpisodeError(f"episode {member.uid}: calls returned {got} tokens, planned {plan.lengths}")
        member.response_ids, member.logprobs, member.version_runs = [], [], VersionRuns()
        mask: list[int] = []
        for k, t in enumerate(calls):
            if k:
                member.append(self.tool_ids, [0.0] * len(self.tool_ids), member.version_runs.newest())
                mask += [0] * len(self.tool_ids)
            member.append(t.response_ids, t.logprobs, t.call_versions[-1], version_runs=t.version_runs)
            mask += [1] * t.response_length
        if list(result) != member.prompt_ids + member.response_ids:
            raise EpisodeError(f"episode {member.uid}: its context is not its calls and tool results")
        member.loss_mask = mask
        member.call_versions = [v for t in calls for v in t.call_versions]
        member.num_calls = sum(t.num_calls for t in calls)
        member.num_aborts = sum(t.num_aborts for t in calls)
        member.max_new_tokens = max(member.max_new_tokens, member.response_length)
        member.status, member.finish_reason = TrajectoryStatus.COMPLETED, "stop"
        self.log[member.uid] = EpisodeRecord(
            member.uid, len(calls), got, member.num_calls, member.num_aborts, sum(plan.tool_s),
            self._started.pop(member.uid, math.nan), asyncio.get_running_loop().time())


class EpisodeDriver:
    """What ``run_policy`` runs a multi-turn workload (or its flat twin) with."""

    def __init__(self, workload: Workload, model: SyntheticLM, budget: int, time_scale: float = 1.0):
        self.workload = workload
        self.prompts = EpisodePrompts(workload, model, budget)
        self.sampling_params = dict(SAMPLING_PARAMS)
        self.agent: BenchAgent | None = None
        self.episodes: EpisodeRunner | None = None
        if not workload.flat_episodes:
            self.agent = BenchAgent(self.prompts.plans, workload.tool_tokens, time_scale, workload.tool_workers,
                                    workload.tool_pool_order)
            self.episodes = EpisodeRunner(self.agent)
            self.agent.runner = self.episodes
        self.returned: list[dict[str, list[str]]] = []  # per step: group uid -> member uids

    # ------------------------------------------------------------------ token accounting
    def _calls(self, member: Trajectory) -> list[Trajectory] | None:
        """The calls of ``member``'s episode while the runner holds it (None: a plain trajectory,
        or an episode whose group was trained)."""
        episode = self.episodes.episodes.get(member.uid) if self.episodes is not None else None
        if episode is None:
            return None
        return [c.trajectory for c in [*episode.served, *episode.pending.values()]]

    def _state(self, member: Trajectory) -> tuple[int, int, Iterable[tuple[int, int]]]:
        """(model tokens held, context length past the prompt, version runs of those tokens)."""
        calls = self._calls(member)
        if calls is None:
            mask = member.loss_mask
            model = sum(mask) if mask is not None else member.response_length
            return model, member.response_length, member.version_runs
        model = sum(t.response_length for t in calls)
        tools = max(0, len(calls) - 1)  # a tool result joins the context with the next call
        return model, model + tools * self.workload.tool_tokens, [r for t in calls for r in t.version_runs.runs()]

    def snapshot(self, groups: Sequence[Group]) -> dict[str, tuple[int, int]]:
        return {t.uid: self._state(t)[:2] for g in groups for t in g.trajectories}

    def step_done(self, before: dict[str, tuple[int, int]], returned: Sequence[Group],
                  buffered: Sequence[Group], next_version: int) -> tuple[int, float, int, float]:
        """(model tokens generated in the step, the sum of the context each was decoded at, model
        tokens the buffered groups hold, their token-weighted mean age in versions)."""
        self.returned.append({g.uid: [t.uid for t in g.trajectories] for g in returned})
        tracked, context_sum = 0, 0.0
        for group in [*returned, *buffered]:
            for t in group.trajectories:
                model, context, _ = self._state(t)
                prev_model, prev_context = before.get(t.uid, (0, 0))
                if model > prev_model:
                    d = model - prev_model
                    tracked += d
                    # tokens spread evenly over the context they grew through (tool results included)
                    context_sum += d * (len(t.prompt_ids) + (prev_context + context - 1) / 2.0)
        held, age_sum = 0, 0.0
        for group in buffered:
            for t in group.trajectories:
                for version, count in self._state(t)[2]:
                    held += count
                    age_sum += count * (next_version - version)
        return tracked, context_sum, held, (age_sum / held if held else 0.0)

    async def close(self) -> None:
        if self.episodes is not None:
            await self.episodes.close()


def episode_summary(metrics: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per-step means of what the episodes did over the steady-state steps (the scheduler's
    ``april/episodes/*`` metrics; tool seconds are summed over episodes, so they exceed a step)."""
    n = len(metrics)

    def total(key: str) -> float:
        return sum(x[f"april/episodes/{key}"] for x in metrics)

    calls = total("calls")
    return {"episode_calls_per_step": calls / n, "episodes_finished_per_step": total("finished") / n,
            "suspended_calls_per_step": total("suspended") / n,
            "resumed_call_fraction": total("resumed_calls") / calls if calls else 0.0,
            "tool_s_per_step": total("tool_seconds") / n, "live_episodes_mean": total("live") / n}
