"""The rollout scheduler: drives one rollout step from prompts (and buffered partials) to exactly
``rollout_batch_size`` complete, rewarded, filter-passing groups.

Policies (``AprilConfig.policy``):

* ``sync``: the baseline. Opens as many groups as are still missing (buffer first), submits every
  trajectory at once and waits for all of them; groups rejected by the filter are replaced.
  Nothing is aborted.
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

Group life: a group counts once all of its trajectories finished (COMPLETED or TRUNCATED);
finished members of unfinished groups stay with their group (CoPRIS eq. 7) and are never
regenerated. A completed group is rewarded (``reward_fn`` awaited, in its own task so refills do
not wait on it), then ``group_filter`` decides whether it counts. Rejected groups are discarded
and counted; passing groups beyond the target ("surplus") go back to the buffer when
``config.return_surplus`` (else they are discarded and counted).

Resumption: every step first takes the whole buffer (``PartialBuffer.take`` applies the staleness
bound and the resume priority) and opens those groups before any new prompt. An unfinished
trajectory is resubmitted with ``input_ids = prompt + partial response`` and ``max_new_tokens``
reduced by what it already has; the reply's tokens and log-probs are appended with the reply's
``weight_version``. A trajectory with no budget left is marked TRUNCATED without a call. Buffered
groups the step never opened go back into the buffer unchanged.

Dispatch (verl's per-engine supplementation): each request goes directly to the engine with the
fewest requests in flight from this step (engines whose last call failed come last), so a refill
lands on the engine whose slot just freed. Every rid is ``f"{trajectory.uid}#{trajectory.num_calls}"``
and ``num_calls`` never decreases (it is saved with the buffer), so rids are unique for the job.

Abort at target: one ``abort_all`` per engine that has requests of this step in flight, then every
reply is awaited; requests still running after ``abort_retry_interval_s`` (the abort can overtake a
request still in transit) are aborted again by rid. Aborted replies carry their partial tokens,
which are appended; a reply that raced the abort and finished with stop/length counts as finished.
After the drain every trajectory is in exactly one place: a returned group, the buffer, or
discarded with a counted reason.

Engine failures (chosen behaviour): an ``EngineError`` on one call (the client has already retried
what was safe to retry) leaves the trajectory exactly as it was before the call, puts it at the
front of the queue and marks the engine so the next requests prefer other engines. A trajectory
may fail ``max_failures_per_trajectory`` calls within one step (an engine-initiated abort that
returns no token counts as a failure, so a wedged engine cannot loop forever); one more failure
ends the step with ``RolloutStepError``. Before that error (or any other: a reward function or
filter that raises, an exhausted prompt source) is raised, everything in flight is aborted and
awaited (at most ``recovery_timeout_s``; calls still pending then are cancelled and the trajectory
keeps what it had) and every group of the step, including accepted and surplus ones, is put back
into the buffer, so nothing generated is lost and the next step can pick up from there.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol

from april_slime.buffer import PartialBuffer
from april_slime.config import AprilConfig
from april_slime.engine import EngineClient, EngineError, EngineLoad, EngineReplyError, GenerateResult
from april_slime.types import Group, Trajectory, TrajectoryStatus

logger = logging.getLogger(__name__)

METRIC_PREFIX = "april/"


class PromptSource(Protocol):
    def next_groups(self, n: int, current_version: int) -> list[Group]:
        """Up to ``n`` fresh groups; fewer than asked means the dataset is exhausted."""


class ConcurrencyController(Protocol):
    def initial(self) -> int: ...

    def observe(self, loads: list[EngineLoad], now: float) -> int:
        """Returns the new concurrency target N'."""


class RolloutStepError(RuntimeError):
    """A rollout step could not finish. Every group of the step was put back into the buffer."""


class PromptsExhausted(RolloutStepError):
    """The prompt source ran dry before the step had ``rollout_batch_size`` groups."""


@dataclass
class StepResult:
    """``groups``: exactly ``rollout_batch_size`` complete, rewarded, filter-passing groups.

    ``metrics`` (all floats, every key prefixed ``april/``):
    step_time_s, time_to_target_s (loop time until the target was met, before the abort drain),
    generated_tokens (every token that came back this step, aborted partials included),
    throughput_tokens_per_s (generated_tokens / step_time_s), aborted_tokens, engine_calls,
    engine_errors, abort_calls, abort_errors, load_poll_errors, truncated_without_call,
    resumed_groups (buffered groups opened), resumed_trajectories (submitted with a partial
    response), filtered_groups, surplus_groups, surplus_discarded_groups, stale_restarted_groups,
    stale_dropped_groups, recomputed_tokens (thrown away by staleness restarts), discarded_tokens
    (filter rejections + discarded surplus + staleness drops), carried_groups (unfinished groups put
    back), buffer_groups, buffer_trajectories, buffer_partial_trajectories (unfinished with tokens),
    concurrency_limit (copris N' at the end; 0 otherwise), inflight_mean (time-weighted over the
    step), inflight_max, inflight_min_while_work, returned_groups, returned_tokens,
    offpolicy_token_fraction (returned tokens whose version != current_version), staleness_mean,
    staleness_max, staleness_hist/<k> (returned trajectories whose oldest token lags k versions).
    """

    groups: list[Group]
    metrics: dict[str, float]


@dataclass(frozen=True)
class TimelinePoint:
    """The scheduler's state after it settled (handled every ready reply and refilled)."""

    time: float  # seconds since the step started (loop time)
    in_flight: int
    limit: int | None  # copris: N' at that moment; None for sync / april
    work_remaining: bool  # the target is not reached and there is something left to submit


@dataclass
class _Call:
    trajectory: Trajectory
    engine_url: str
    rid: str
    task: asyncio.Task | None = None


@dataclass
class _StepCounters:
    engine_calls: int = 0
    engine_errors: int = 0
    abort_calls: int = 0
    abort_errors: int = 0
    generated_tokens: int = 0
    aborted_tokens: int = 0
    truncated_without_call: int = 0
    resumed_groups: int = 0
    filtered_groups: int = 0
    filtered_tokens: int = 0
    surplus_groups: int = 0
    surplus_discarded_groups: int = 0
    surplus_discarded_tokens: int = 0
    load_poll_errors: int = 0
    resumed_uids: set[str] = field(default_factory=set)


class RolloutScheduler:
    """Owns the requests in flight of one rollout step at a time (``run_step`` is not reentrant)."""

    def __init__(self, config: AprilConfig, client: EngineClient, buffer: PartialBuffer, *,
                 rollout_batch_size: int, n_samples_per_prompt: int, sampling_params: dict,
                 reward_fn: Callable[[Group], Awaitable[None]] | None = None,
                 group_filter: Callable[[Group], bool] | None = None,
                 controller: ConcurrencyController | None = None,
                 load_poll_interval_s: float = 1.0,
                 over_sampling_batch_size: int | None = None,
                 max_failures_per_trajectory: int = 3,
                 abort_retry_interval_s: float = 1.0,
                 recovery_timeout_s: float = 60.0):
        config.validate()
        if rollout_batch_size < 1 or n_samples_per_prompt < 1:
            raise ValueError(f"rollout_batch_size ({rollout_batch_size}) and n_samples_per_prompt "
                             f"({n_samples_per_prompt}) must be >= 1")
        if not client.engine_urls:
            raise ValueError("the engine client has no engine urls")
        if over_sampling_batch_size is not None and over_sampling_batch_size < rollout_batch_size:
            raise ValueError(f"over_sampling_batch_size ({over_sampling_batch_size}) must be >= "
                             f"rollout_batch_size ({rollout_batch_size})")
        if max_failures_per_trajectory < 0:
            raise ValueError(f"max_failures_per_trajectory must be >= 0, got {max_failures_per_trajectory}")
        if not load_poll_interval_s > 0:
            raise ValueError(f"load_poll_interval_s must be > 0, got {load_poll_interval_s}")
        self.config = config
        self.client = client
        self.buffer = buffer
        self.rollout_batch_size = rollout_batch_size
        self.n_samples_per_prompt = n_samples_per_prompt
        self.sampling_params = dict(sampling_params)
        self.sampling_params.pop("max_new_tokens", None)  # per call: the trajectory's remaining budget
        self.reward_fn = reward_fn
        self.group_filter = group_filter
        self.controller = controller
        self.load_poll_interval_s = load_poll_interval_s
        self.over_sampling_groups = over_sampling_batch_size or math.ceil(
            config.over_sampling_factor * rollout_batch_size)
        self.max_failures_per_trajectory = max_failures_per_trajectory
        self.abort_retry_interval_s = abort_retry_interval_s
        self.recovery_timeout_s = recovery_timeout_s
        if controller is not None:
            self.concurrency = max(1, int(controller.initial()))
        else:
            self.concurrency = config.resolved_concurrency(rollout_batch_size, n_samples_per_prompt)
        if config.policy == "copris" and self.concurrency < n_samples_per_prompt:
            logger.warning("copris concurrency %d < n_samples_per_prompt %d: a group can never be "
                           "in flight as a whole", self.concurrency, n_samples_per_prompt)
        self.last_timeline: list[TimelinePoint] = []  # of the latest step, for metrics and tests
        self._running = False

    async def run_step(self, prompt_source: PromptSource, current_version: int) -> StepResult:
        if self._running:
            raise RuntimeError("run_step is already running on this scheduler")
        self._running = True
        try:
            step = _Step(self, prompt_source, current_version)
            result = await step.run()
            return result
        finally:
            self._running = False


class _Step:
    """State of one ``run_step`` call. Every group of the step is in exactly one of: ``resume``
    (taken from the buffer, not opened), ``fresh`` (from the prompt source, not opened),
    ``active`` (opened, unfinished trajectories), ``rewarding``, ``accepted``, ``surplus``,
    ``unjudged`` (completed while recovering from an error), or discarded (counted)."""

    def __init__(self, sched: RolloutScheduler, prompt_source: PromptSource, current_version: int):
        self.s = sched
        self.policy = sched.config.policy
        self.prompt_source = prompt_source
        self.current_version = current_version
        self.target = sched.rollout_batch_size
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.resume: deque[Group] = deque()
        self.fresh: deque[Group] = deque()
        self.active: dict[str, Group] = {}
        self.rewarding: dict[str, tuple[Group, asyncio.Task]] = {}
        self.accepted: list[Group] = []
        self.surplus: list[Group] = []
        self.unjudged: list[Group] = []
        self.seen_groups: set[str] = set()
        self.queue: deque[Trajectory] = deque()
        self.in_flight: dict[str, _Call] = {}
        self.engine_in_flight = {url: 0 for url in sched.client.engine_urls}
        self.engine_failures = {url: 0 for url in sched.client.engine_urls}
        self.failures: dict[str, int] = {}
        self.exhausted = False
        self.draining = False
        self.recovering = False
        self.poller: asyncio.Task | None = None
        self.counters = _StepCounters()
        self.timeline: list[TimelinePoint] = []
        sched.last_timeline = self.timeline

    # ================================================================== driver
    async def run(self) -> StepResult:
        self.t0 = self.loop.time()
        buffer = self.s.buffer
        before = buffer.counters()
        try:
            self.resume.extend(buffer.take(len(buffer), self.current_version))
            self.stale_delta = {k: buffer.counters()[k] - before[k] for k in before}
            if self.s.controller is not None and self.policy == "copris":
                self.poller = self.loop.create_task(self._poll_loads())
            self._fill()
            while len(self.accepted) < self.target:
                if not self.in_flight and not self.rewarding:
                    raise PromptsExhausted(
                        f"the prompt source is exhausted: {len(self.accepted)} of {self.target} "
                        f"groups complete and nothing left to generate")
                await self._handle_next_events()
                self._fill()
            self.t_target = self.loop.time() - self.t0
            await self._drain()
        except Exception as e:
            await self._recover()
            if isinstance(e, RolloutStepError):
                raise
            raise RolloutStepError(f"rollout step failed, all its groups are back in the buffer: "
                                   f"{type(e).__name__}: {e}") from e
        except BaseException:
            self._recover_now()
            raise
        finally:
            if self.poller is not None:
                self.poller.cancel()
        self._return_leftovers()
        return StepResult(groups=list(self.accepted), metrics=self._metrics())

    async def _handle_next_events(self, timeout: float | None = None) -> bool:
        """Handle one event (waiting for it) and then every event already queued."""
        try:
            event = await asyncio.wait_for(self.events.get(), timeout) if timeout is not None \
                else await self.events.get()
        except asyncio.TimeoutError:
            return False
        self._handle(event)
        while not self.events.empty():
            self._handle(self.events.get_nowait())
        return True

    def _handle(self, event: tuple) -> None:
        kind = event[0]
        if kind == "reply":
            self._on_reply(*event[1:])
        elif kind == "rewarded":
            self._on_rewarded(*event[1:])
        elif kind == "concurrency":
            self.s.concurrency = event[1]
        else:  # pragma: no cover - events are produced only in this module
            raise AssertionError(f"unknown event {kind!r}")

    # ================================================================== refill
    def _fill(self) -> None:
        if self.draining:
            return
        n = self.s.n_samples_per_prompt
        if self.policy == "sync":
            while (missing := self.target - self._groups_in_play()) > 0 and self._open_groups(missing):
                pass
        elif self.policy == "april":
            while self._groups_in_play() < self.target and self._open_groups(self.s.over_sampling_groups):
                pass
        else:
            while (free := self.s.concurrency - len(self.in_flight) - len(self.queue)) > 0 \
                    and len(self.accepted) < self.target and self._open_groups(math.ceil(free / n)):
                pass
        limit = self.s.concurrency if self.policy == "copris" else None
        while self.queue and (limit is None or len(self.in_flight) < limit) \
                and len(self.accepted) < self.target:
            self._submit(self.queue.popleft())
        self._record(work_remaining=len(self.accepted) < self.target and (
            bool(self.queue) or bool(self.resume) or bool(self.fresh) or not self.exhausted))

    def _groups_in_play(self) -> int:
        return len(self.accepted) + len(self.active) + len(self.rewarding)

    def _open_groups(self, k: int) -> int:
        """Open up to ``k`` groups, buffered ones first; returns how many were opened. New prompts
        are fetched only once the buffered groups are used up, and opening stops as soon as the
        target is met (buffered complete groups count at once)."""
        opened = 0
        while opened < k and len(self.accepted) < self.target:
            if self.resume:
                self._open(self.resume.popleft(), resumed=True)
            else:
                if not self.fresh and not self.exhausted:
                    self._fetch_fresh(k - opened)
                if not self.fresh:
                    break
                self._open(self.fresh.popleft(), resumed=False)
            opened += 1
        return opened

    def _fetch_fresh(self, k: int) -> None:
        """Ask the prompt source for ``k`` groups; the batch is checked as a whole before any of
        it is accepted, so a bad batch is refused without half of it entering the step."""
        groups = list(self.prompt_source.next_groups(k, self.current_version))
        if len(groups) > k:
            raise ValueError(f"prompt source returned {len(groups)} groups when asked for {k}")
        uids = [g.uid for g in groups]
        for group in groups:
            if len(group.trajectories) != self.s.n_samples_per_prompt:
                raise ValueError(f"prompt source gave group {group.uid} with {len(group.trajectories)} "
                                 f"trajectories, expected n_samples_per_prompt="
                                 f"{self.s.n_samples_per_prompt}")
            if group.uid in self.seen_groups or group.uid in self.s.buffer or uids.count(group.uid) > 1:
                raise ValueError(f"prompt source gave group {group.uid} twice")
            if any(t.status is TrajectoryStatus.RUNNING for t in group.trajectories):
                raise ValueError(f"prompt source gave group {group.uid} with a running trajectory")
        if len(groups) < k:
            self.exhausted = True
        self.seen_groups.update(uids)
        self.fresh.extend(groups)

    def _open(self, group: Group, resumed: bool) -> None:
        self.seen_groups.add(group.uid)
        if resumed:
            self.counters.resumed_groups += 1
        for t in group.trajectories:
            if t.status.finished:
                continue
            if t.remaining_tokens <= 0:
                t.status, t.finish_reason = TrajectoryStatus.TRUNCATED, "length"
                self.counters.truncated_without_call += 1
                continue
            self.queue.append(t)
        if group.complete:
            self._on_group_complete(group)
        else:
            self.active[group.uid] = group

    def _submit(self, t: Trajectory) -> None:
        urls = self.s.client.engine_urls
        url = min(urls, key=lambda u: (self.engine_failures[u], self.engine_in_flight[u]))
        rid = f"{t.uid}#{t.num_calls}"
        t.num_calls += 1
        if t.response_ids:
            self.counters.resumed_uids.add(t.uid)
        t.status = TrajectoryStatus.RUNNING
        call = _Call(t, url, rid)
        self.in_flight[rid] = call
        self.engine_in_flight[url] += 1
        self.counters.engine_calls += 1
        call.task = self.loop.create_task(self._generate(call, t.input_ids(), t.remaining_tokens))

    async def _generate(self, call: _Call, input_ids: list[int], max_new_tokens: int) -> None:
        try:
            result = await self.s.client.generate(
                call.engine_url, input_ids, max_new_tokens=max_new_tokens, rid=call.rid,
                sampling_params=self.s.sampling_params, sampling_seed=call.trajectory.sampling_seed)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # classified in _on_reply, inside the step's only consumer
            self.events.put_nowait(("reply", call, None, e))
        else:
            self.events.put_nowait(("reply", call, result, None))

    # ================================================================== replies
    def _on_reply(self, call: _Call, result: GenerateResult | None, error: Exception | None) -> None:
        if self.in_flight.pop(call.rid, None) is None:
            return  # cancelled during recovery; the trajectory was already settled
        self.engine_in_flight[call.engine_url] -= 1
        t = call.trajectory
        if error is None:
            error = self._apply(t, result)
        if error is not None:
            if not isinstance(error, EngineError):
                t.status = TrajectoryStatus.ABORTED if t.response_ids else TrajectoryStatus.PENDING
                raise error
            self._on_call_failed(call, error)
            return
        self.engine_failures[call.engine_url] = 0
        if t.status.finished:
            group = self.active[t.group_uid]
            if group.complete:
                del self.active[group.uid]
                self._on_group_complete(group)
        elif not self.draining:
            self.queue.appendleft(t)  # the engine aborted on its own: resume at once

    def _apply(self, t: Trajectory, result: GenerateResult) -> EngineError | None:
        """Append one reply to its trajectory; returns an error (and appends nothing) if the reply
        cannot be used."""
        finish = result.finish_reason
        if finish not in ("stop", "length", "abort"):
            return EngineReplyError(f"{result.engine_url}: unknown finish reason {finish!r} for {t.uid}")
        if len(result.output_ids) > t.remaining_tokens:
            return EngineReplyError(f"{result.engine_url}: {len(result.output_ids)} tokens for {t.uid} "
                                    f"exceed its remaining budget {t.remaining_tokens}")
        if finish == "abort" and not result.output_ids and not self.draining:
            return EngineReplyError(f"{result.engine_url}: request of {t.uid} aborted by the engine "
                                    "without any token")
        try:
            t.append(result.output_ids, result.logprobs, int(result.weight_version))
        except (ValueError, TypeError) as e:
            return EngineReplyError(f"{result.engine_url}: {e}")
        tokens = len(result.output_ids)
        self.counters.generated_tokens += tokens
        t.finish_reason = finish
        if finish == "stop":
            t.status = TrajectoryStatus.COMPLETED
        elif finish == "length" or t.remaining_tokens <= 0:
            t.status = TrajectoryStatus.TRUNCATED
        else:
            t.status = TrajectoryStatus.ABORTED if t.response_ids else TrajectoryStatus.PENDING
        if finish == "abort":
            t.num_aborts += 1
            self.counters.aborted_tokens += tokens
        return None

    def _on_call_failed(self, call: _Call, error: EngineError) -> None:
        t = call.trajectory
        t.status = TrajectoryStatus.ABORTED if t.response_ids else TrajectoryStatus.PENDING
        self.counters.engine_errors += 1
        self.engine_failures[call.engine_url] += 1
        self.failures[t.uid] = self.failures.get(t.uid, 0) + 1
        logger.warning("generate %s on %s failed (%d/%d): %s", call.rid, call.engine_url,
                       self.failures[t.uid], self.s.max_failures_per_trajectory + 1, error)
        if self.draining:
            return  # the trajectory stays with its group and goes to the buffer
        if self.failures[t.uid] > self.s.max_failures_per_trajectory:
            raise RolloutStepError(f"trajectory {t.uid} failed {self.failures[t.uid]} engine calls in "
                                   f"one step (last: {error}); all groups of the step are back in "
                                   "the buffer")
        self.queue.appendleft(t)

    # ================================================================== groups
    def _on_group_complete(self, group: Group) -> None:
        if self.recovering:
            self.unjudged.append(group)
            return
        needs_reward = self.s.reward_fn is not None and any(t.reward is None for t in group.trajectories)
        if needs_reward:
            task = self.loop.create_task(self._reward(group))
            self.rewarding[group.uid] = (group, task)
        else:
            self._judge(group)

    async def _reward(self, group: Group) -> None:
        try:
            await self.s.reward_fn(group)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.events.put_nowait(("rewarded", group, e))
        else:
            self.events.put_nowait(("rewarded", group, None))

    def _on_rewarded(self, group: Group, error: Exception | None) -> None:
        if self.rewarding.pop(group.uid, None) is None:
            return
        if error is not None:
            for t in group.trajectories:
                t.reward = None
            self.unjudged.append(group)
            raise RolloutStepError(f"reward function failed on group {group.uid}: "
                                   f"{type(error).__name__}: {error}") from error
        if self.recovering:
            self.unjudged.append(group)
            return
        self._judge(group)

    def _judge(self, group: Group) -> None:
        try:
            keep = True if self.s.group_filter is None else bool(self.s.group_filter(group))
        except Exception:
            self.unjudged.append(group)
            raise
        if not keep:
            self.counters.filtered_groups += 1
            self.counters.filtered_tokens += _tokens(group)
        elif len(self.accepted) < self.target:
            self.accepted.append(group)
        else:
            self.surplus.append(group)

    # ================================================================== end of step
    async def _drain(self) -> None:
        """Abort everything in flight and wait for every reply (and every pending reward)."""
        self.draining = True
        if self.poller is not None:
            self.poller.cancel()
        self.queue.clear()
        await self._abort_engines()
        while self.in_flight or self.rewarding:
            if not await self._handle_next_events(timeout=self.s.abort_retry_interval_s):
                await self._abort_rids(list(self.in_flight.values()))
            self._record(work_remaining=False)

    async def _abort_engines(self) -> None:
        urls = [u for u, n in self.engine_in_flight.items() if n > 0]
        await asyncio.gather(*(self._abort(url, None) for url in urls))

    async def _abort_rids(self, calls: list[_Call]) -> None:
        await asyncio.gather(*(self._abort(c.engine_url, c.rid) for c in calls))

    async def _abort(self, url: str, rid: str | None) -> None:
        self.counters.abort_calls += 1
        try:
            if rid is None:
                await self.s.client.abort(url, abort_all=True)
            else:
                await self.s.client.abort(url, rid=rid)
        except EngineError as e:
            # the request's own reply (or its timeout) still settles the trajectory
            self.counters.abort_errors += 1
            logger.warning("abort on %s failed: %s", url, e)

    def _return_leftovers(self) -> None:
        """Unopened and unfinished groups, then surplus, go back into the buffer."""
        buffer = self.s.buffer
        self.carried_groups = len(self.resume) + len(self.fresh) + len(self.active)
        for group in [*self.resume, *self.fresh, *self.active.values()]:
            buffer.put(group)
        self.resume.clear()
        self.fresh.clear()
        self.active.clear()
        self.counters.surplus_groups = len(self.surplus)
        for group in self.surplus:
            if self.s.config.return_surplus:
                buffer.put(group)
            else:
                self.counters.surplus_discarded_groups += 1
                self.counters.surplus_discarded_tokens += _tokens(group)
        self.surplus = []

    async def _recover(self) -> None:
        """After an error: abort and await what is in flight (bounded), then buffer every group."""
        self.draining = self.recovering = True
        if self.poller is not None:
            self.poller.cancel()
        self.queue.clear()
        deadline = self.loop.time() + self.s.recovery_timeout_s
        try:
            await asyncio.wait_for(self._abort_engines(), self.s.recovery_timeout_s)
            while self.in_flight and (left := deadline - self.loop.time()) > 0:
                try:
                    got = await self._handle_next_events(timeout=min(left, self.s.abort_retry_interval_s))
                except Exception as e:  # a second failure must not stop the clean-up
                    logger.warning("ignored while recovering: %s", e)
                    continue
                if not got:
                    await asyncio.wait_for(self._abort_rids(list(self.in_flight.values())),
                                           max(deadline - self.loop.time(), 0.001))
        except asyncio.TimeoutError:
            pass
        self._recover_now()

    def _recover_now(self) -> None:
        """Synchronous part of recovery: cancel what is left and put every group in the buffer."""
        self.draining = self.recovering = True
        busy = [u for u, n in self.engine_in_flight.items() if n > 0]
        if busy:
            # the engines would otherwise keep generating replies nobody reads
            task = self.loop.create_task(asyncio.gather(*(self._abort(u, None) for u in busy),
                                                        return_exceptions=True))
            _DETACHED.add(task)
            task.add_done_callback(_DETACHED.discard)
        for call in list(self.in_flight.values()):
            call.task.cancel()
            t = call.trajectory
            t.status = TrajectoryStatus.ABORTED if t.response_ids else TrajectoryStatus.PENDING
        self.in_flight.clear()
        for group, task in list(self.rewarding.values()):
            task.cancel()
            for t in group.trajectories:
                t.reward = None
            self.unjudged.append(group)
        self.rewarding.clear()
        for group in [*self.accepted, *self.surplus, *self.unjudged, *self.resume, *self.fresh,
                      *self.active.values()]:
            if group.uid not in self.s.buffer:
                self.s.buffer.put(group)
        self.accepted, self.surplus, self.unjudged = [], [], []
        self.resume.clear()
        self.fresh.clear()
        self.active.clear()

    # ================================================================== adaptive N'
    async def _poll_loads(self) -> None:
        while True:
            await asyncio.sleep(self.s.load_poll_interval_s)
            try:
                loads = await self.s.client.loads()
            except EngineError as e:
                self.counters.load_poll_errors += 1
                logger.warning("reading engine loads failed: %s", e)
                continue
            target = max(1, int(self.s.controller.observe(loads, self.loop.time())))
            if target != self.s.concurrency:
                self.events.put_nowait(("concurrency", target))

    # ================================================================== metrics
    def _record(self, work_remaining: bool) -> None:
        limit = self.s.concurrency if self.policy == "copris" else None
        point = TimelinePoint(self.loop.time() - self.t0, len(self.in_flight), limit, work_remaining)
        if self.timeline and self.timeline[-1].time == point.time:
            self.timeline[-1] = point  # only the settled state of an instant matters
        else:
            self.timeline.append(point)

    def _metrics(self) -> dict[str, float]:
        c = self.counters
        step_time = self.loop.time() - self.t0
        m: dict[str, float] = {
            "step_time_s": step_time,
            "time_to_target_s": self.t_target,
            "generated_tokens": c.generated_tokens,
            "throughput_tokens_per_s": c.generated_tokens / step_time if step_time > 0 else 0.0,
            "aborted_tokens": c.aborted_tokens,
            "engine_calls": c.engine_calls,
            "engine_errors": c.engine_errors,
            "abort_calls": c.abort_calls,
            "abort_errors": c.abort_errors,
            "load_poll_errors": c.load_poll_errors,
            "truncated_without_call": c.truncated_without_call,
            "resumed_groups": c.resumed_groups,
            "resumed_trajectories": len(c.resumed_uids),
            "filtered_groups": c.filtered_groups,
            "surplus_groups": c.surplus_groups,
            "surplus_discarded_groups": c.surplus_discarded_groups,
            "stale_restarted_groups": self.stale_delta["restarted_groups"],
            "stale_dropped_groups": self.stale_delta["dropped_groups"],
            "recomputed_tokens": self.stale_delta["restarted_tokens"],
            "discarded_tokens": c.filtered_tokens + c.surplus_discarded_tokens
            + self.stale_delta["dropped_tokens"],
            "carried_groups": self.carried_groups,
            "buffer_groups": len(self.s.buffer),
            "buffer_trajectories": self.s.buffer.num_trajectories(),
            "buffer_partial_trajectories": self.s.buffer.num_partial_trajectories(),
            "concurrency_limit": self.s.concurrency if self.policy == "copris" else 0,
        }
        m.update(self._in_flight_stats())
        trajectories = [t for g in self.accepted for t in g.trajectories]
        tokens = sum(t.response_length for t in trajectories)
        m["returned_groups"] = len(self.accepted)
        m["returned_tokens"] = tokens
        m["offpolicy_token_fraction"] = (
            sum(t.offpolicy_tokens(self.current_version) for t in trajectories) / tokens if tokens else 0.0)
        staleness = [t.staleness(self.current_version) for t in trajectories]
        m["staleness_mean"] = sum(staleness) / len(staleness) if staleness else 0.0
        m["staleness_max"] = max(staleness, default=0)
        for k in sorted(set(staleness)):
            m[f"staleness_hist/{k}"] = staleness.count(k)
        return {METRIC_PREFIX + k: float(v) for k, v in m.items()}

    def _in_flight_stats(self) -> dict[str, float]:
        points = self.timeline
        end = self.loop.time() - self.t0
        weighted = 0.0
        for p, nxt in zip(points, points[1:] + [None]):
            weighted += p.in_flight * ((nxt.time if nxt else end) - p.time)
        working = [p.in_flight for p in points if p.work_remaining]
        return {
            "inflight_mean": weighted / end if end > 0 else (points[-1].in_flight if points else 0),
            "inflight_max": max((p.in_flight for p in points), default=0),
            "inflight_min_while_work": min(working, default=0),
        }


# aborts sent after a cancelled step must outlive it; holding them here keeps them from being
# garbage-collected before they run
_DETACHED: set[asyncio.Task] = set()


def _tokens(group: Group) -> int:
    return sum(t.response_length for t in group.trajectories)
