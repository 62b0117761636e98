"""The rollout scheduler: drives one rollout step from prompts (and buffered partials) to exactly
``rollout_batch_size`` complete, rewarded, filter-passing groups.

Who owns what (each module's docstring says the rest):

* ``RolloutScheduler`` (here): the settings, the engines' health and the submission policy, kept
  across steps; one ``_Step`` per ``run_step``.
* ``_Step`` (here), the executor: runs the work of one step in four phases and decides no counts.
* ``april_slime.core.policies``: sync / april / copris: how many groups to open, how many calls to
  keep in flight.
* ``april_slime.core.groups``: where the step's groups come from (buffer first, then the prompt
  source), how they complete (reward, filter) and where they go (result, buffer, dropped).
* ``april_slime.core.ledger``: where every group of the step is, changed by one ``move``.
* ``april_slime.core.work``: what a work item (today a trajectory) is: how it becomes a call, takes
  a reply and is resumed.
* ``april_slime.core.calls``: the model calls in flight: rids, replies, cancellation, aborts.
* ``april_slime.core.health``: engine health across steps; dispatch, stalls, probes and load
  polling within a step.
* ``april_slime.core.deadline``: the step deadline, past which the due groups' unfinished samples
  fail instead of holding the step.
* ``april_slime.core.step_metrics``: the step's counters, timeline and metrics.
* ``april_slime.core.step_context``: what the step's parts share (``StepContext``) and the typed
  events that change the step's state.

A step runs in four phases, each a section of ``_Step`` below; the step's state (every group and
every call of the step) lives in ``_Step`` and the objects it holds, and data flows one way:
prompt source / buffer -> fill -> engine calls -> reply handling -> groups -> result / buffer.
Everything that changes the step's state (replies, rewards, probe outcomes, a new N', an episode's
call or end) arrives as a typed event on one queue and is handled in between, so no two changes
interleave.

1. fill: open groups (buffer first, then fresh prompts) and submit calls, as many as the policy
   says; repeated after every batch of events, so each completion refills at once.
2. reply: apply each reply to its work item, complete, reward and judge groups, refill.
3. drain (target reached): abort what still runs and collect the replies, until
   ``drain_timeout_s`` at most.
4. recover (any error): the same drain, then every group of the step goes back to the buffer;
   a cancellation puts every group back at once, without draining.

Work items reach the engines through one narrow method, ``_Step._submit`` (the work kind's
``begin_call``, then ``EngineCalls.start``), and their replies come back through ``_on_reply`` (the
work kind's ``absorb``). That is the seam for a second kind of work item (a multi-turn episode,
``april_slime.core.work``): the policy, the ledger, the calls and the phases stay as they are.

Abort at target: one best-effort ``abort_all`` per engine that has requests of this step in
flight (never awaited before replies are handled); requests still running after
``abort_retry_interval_s`` without any reply are aborted again by rid. Aborted replies carry their
partial tokens, which are appended; a reply that raced the abort and finished counts as finished.
At ``drain_timeout_s`` the calls still pending are cancelled: their trajectories keep what they had
before the call and go to the buffer with their group, and their engines are taken out of
dispatch; groups still being rewarded go back unjudged.

Failures (chosen behaviour): an ``EngineError`` on one call leaves the trajectory exactly as it was
before the call and puts it at the front of the queue. A trajectory may fail
``max_failures_per_trajectory`` calls within one step (an engine-initiated abort that returns no
token, and a cancellation because its engine stalled, count as failures, so a wedged engine cannot
loop forever); one more failure ends the step with ``RolloutStepError``. A call the engine refuses
as invalid (HTTP 4xx, or token ids outside the vocabulary, refused by the client before sending)
is no engine failure: it counts in ``Trajectory.rejected_calls`` (saved with the buffer), and a
trajectory rejected ``max_rejected_calls`` times is dropped with its group, counted, so one bad
sample cannot fail every step. Before any step error (a reward function or filter that raises, an
exhausted prompt source, too many failures) is raised, the step is drained as above and every
group of the step, including accepted and surplus ones, is put back into the buffer; a cancelled
``run_step`` puts every group back at once (aborts are sent without waiting for them). After every
step, successful or not, each group the step held is in exactly one place: the returned groups,
the buffer, or ``last_dropped`` (discarded, with its reason).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from april_slime.core.adaptive import AdaptiveConcurrencyController
from april_slime.core.buffer import PartialBuffer
from april_slime.core.calls import EngineCalls
from april_slime.core.config import AprilConfig
from april_slime.core.deadline import StepDeadline, sooner
from april_slime.core.engine import EngineClient
from april_slime.core.episodes import EpisodeRunner, EpisodeWork
from april_slime.core.faults import CallFaults, RolloutStepError
from april_slime.core.groups import PromptSource, StepGroups
from april_slime.core.health import EngineHealth, EngineWatch
from april_slime.core.ledger import DROP_FILTERED, DROP_REJECTED, DROP_STALE, DROP_SURPLUS, Place
from april_slime.core.pacing import StalenessPacing
from april_slime.core.policies import ConcurrencyController, make_policy
from april_slime.core.sglang_protocol import EngineError, GenerateResult, RequestRejected
from april_slime.core.step_context import (
    DRAIN,
    RECOVER,
    CallReplied,
    ConcurrencyChosen,
    EpisodeCallAsked,
    EpisodeEnded,
    GroupRewarded,
    ProbeAnswered,
    StepContext,
    StepEvent,
)
from april_slime.core.step_metrics import StepCounters, TimelinePoint, record, step_metrics
from april_slime.core.types import Group, Trajectory
from april_slime.core.work import TrajectoryWork

__all__ = ["DROP_FILTERED", "DROP_REJECTED", "DROP_STALE", "DROP_SURPLUS", "ConcurrencyController",
           "EngineHealth", "PromptSource", "PromptsExhausted", "RolloutScheduler", "RolloutStepError",
           "StepResult", "TimelinePoint"]

logger = logging.getLogger(__name__)


class PromptsExhausted(RolloutStepError):
    """The prompt source ran dry before the step had ``rollout_batch_size`` groups."""


@dataclass
class StepResult:
    """``groups``: exactly ``rollout_batch_size`` complete, rewarded, filter-passing groups.
    ``dropped``: uid -> reason of every group this step discarded (filter, discarded surplus,
    staleness drop, rejected by the engines). ``metrics``: all floats, every key prefixed
    ``april/``, listed in ``april_slime.core.step_metrics``."""

    groups: list[Group]
    metrics: dict[str, float]
    dropped: dict[str, str] = field(default_factory=dict)


class RolloutScheduler:
    """Owns the requests in flight of one rollout step at a time (``run_step`` is not reentrant)
    and, across steps, the engines' health and the submission policy."""

    def __init__(self, config: AprilConfig, client: EngineClient, buffer: PartialBuffer, *,
                 rollout_batch_size: int, n_samples_per_prompt: int, sampling_params: dict,
                 reward_fn: Callable[[Group], Awaitable[None]] | None = None,
                 group_filter: Callable[[Group], bool] | None = None,
                 controller: ConcurrencyController | None = None,
                 load_poll_interval_s: float = 1.0,
                 over_sampling_batch_size: int | None = None,
                 max_failures_per_trajectory: int = 3,
                 max_rejected_calls: int = 2,
                 eos_token_id: int | Iterable[int] | None = None,
                 abort_retry_interval_s: float = 1.0,
                 abort_timeout_s: float = 5.0,
                 drain_timeout_s: float = 30.0,
                 stall_probe_after_s: float | None = 60.0,
                 probe_timeout_s: float = 30.0,
                 probe_interval_s: float = 5.0,
                 episodes: EpisodeRunner | None = None):
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
        if max_rejected_calls < 1:
            raise ValueError(f"max_rejected_calls must be >= 1, got {max_rejected_calls}")
        for name, value in (("load_poll_interval_s", load_poll_interval_s),
                            ("abort_retry_interval_s", abort_retry_interval_s),
                            ("abort_timeout_s", abort_timeout_s), ("drain_timeout_s", drain_timeout_s),
                            ("probe_timeout_s", probe_timeout_s), ("probe_interval_s", probe_interval_s),
                            ("stall_probe_after_s", 1.0 if stall_probe_after_s is None else stall_probe_after_s)):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        self.config = config
        self.client = client
        self.buffer = buffer
        self.rollout_batch_size = rollout_batch_size
        self.n_samples_per_prompt = n_samples_per_prompt
        self.sampling_params = dict(sampling_params)
        self.sampling_params.pop("max_new_tokens", None)  # per call: the trajectory's remaining budget
        # token ids that end a response whatever finish_reason the engine reports
        self.stop_token_ids: frozenset[int] = frozenset(
            int(t) for t in (self.sampling_params.get("stop_token_ids") or []))
        if eos_token_id is not None and not self.sampling_params.get("ignore_eos", False):
            eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
            self.stop_token_ids |= {int(t) for t in eos}
        self.reward_fn = reward_fn
        self.group_filter = group_filter
        self.controller = controller
        self.load_poll_interval_s = load_poll_interval_s
        self.over_sampling_groups = over_sampling_batch_size or math.ceil(
            config.over_sampling_factor * rollout_batch_size)
        self.max_failures_per_trajectory = max_failures_per_trajectory
        self.max_rejected_calls = max_rejected_calls
        self.abort_retry_interval_s = abort_retry_interval_s
        self.abort_timeout_s = abort_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.stall_probe_after_s = stall_probe_after_s
        self.probe_timeout_s = probe_timeout_s
        self.probe_interval_s = probe_interval_s
        self.health = EngineHealth(client.engine_urls)
        if controller is not None:
            concurrency = max(1, int(controller.initial()))
        else:
            concurrency = config.resolved_concurrency(rollout_batch_size, n_samples_per_prompt)
        self.policy = make_policy(config, n_samples_per_prompt=n_samples_per_prompt,
                                  over_sampling_groups=self.over_sampling_groups, concurrency=concurrency,
                                  controller=controller)
        self.last_timeline: list[TimelinePoint] = []  # of the latest step, for metrics and tests
        self.last_dropped: dict[str, str] = {}  # groups the latest step discarded, success or not
        self.episodes = episodes  # the job's live episodes, when its samples come from an agent function
        self._running = False

    async def run_step(self, prompt_source: PromptSource, current_version: int) -> StepResult:
        if self._running:
            raise RuntimeError("run_step is already running on this scheduler")
        self._running = True
        try:
            step = _Step(self, prompt_source, current_version)
            return await step.run()
        finally:
            self._running = False


def assemble_scheduler(config: AprilConfig, client: EngineClient, buffer: PartialBuffer, *,
                       rollout_batch_size: int, n_samples_per_prompt: int, sampling_params: dict,
                       controller_overrides: dict | None = None, **options) -> RolloutScheduler:
    """The scheduler a job's settings describe, for the plugin's face and for the benchmark alike
    (so the benchmark measures what a job runs): an adaptive copris gets its concurrency controller
    here (``controller_overrides``: its timings, e.g. scaled to an emulated clock); ``options`` are
    ``RolloutScheduler``'s keyword arguments."""
    controller = None
    if config.adaptive_concurrency and config.policy == "copris":
        controller = AdaptiveConcurrencyController.from_config(
            config, rollout_batch_size, n_samples_per_prompt, **(controller_overrides or {}))
    return RolloutScheduler(config, client, buffer, rollout_batch_size=rollout_batch_size,
                            n_samples_per_prompt=n_samples_per_prompt, sampling_params=sampling_params,
                            controller=controller, **options)


class _Step:
    """One ``run_step`` call: runs the work the policy asks for, in the four phases. Its groups are
    in ``groups`` (their ledger: ``groups.ledger``), its calls in ``calls``, its engines in
    ``engines``; what these share (the queue of work items waiting for a call, the counters, the
    event queue, the phase) in ``ctx``."""

    def __init__(self, sched: RolloutScheduler, prompt_source: PromptSource, current_version: int):
        self.s = sched
        self.policy = sched.policy
        loop = asyncio.get_running_loop()
        target = sched.rollout_batch_size
        counters = StepCounters()
        work = (TrajectoryWork(sched.stop_token_ids, counters) if sched.episodes is None
                else EpisodeWork(sched.stop_token_ids, counters, sched.episodes))
        pacing = StalenessPacing(max_staleness=sched.buffer.max_staleness,
                                 max_interruptions=sched.config.max_interruptions,
                                 current_version=current_version, target=target)
        self.ctx = StepContext(loop=loop, current_version=current_version, target=target, work=work,
                               pacing=pacing, counters=counters)
        self.groups = StepGroups(
            self.ctx, buffer=sched.buffer, prompt_source=prompt_source,
            n_samples_per_prompt=sched.n_samples_per_prompt, reward_fn=sched.reward_fn,
            group_filter=sched.group_filter, return_surplus=sched.config.return_surplus)
        self.ledger = self.groups.ledger
        self.engines = EngineWatch(self.ctx, sched.health, sched.client,
                                   stall_probe_after_s=sched.stall_probe_after_s,
                                   probe_timeout_s=sched.probe_timeout_s, probe_interval_s=sched.probe_interval_s)
        self.calls = EngineCalls(self.ctx, sched.client, self.engines, sampling_params=sched.sampling_params,
                                 abort_timeout_s=sched.abort_timeout_s)
        self.faults = CallFaults(self.ctx, health=sched.health, engines=self.engines, calls=self.calls,
                                 groups=self.groups, max_failures=sched.max_failures_per_trajectory,
                                 max_rejected_calls=sched.max_rejected_calls)
        self.deadline = StepDeadline(self.ctx, groups=self.groups, calls=self.calls, faults=self.faults,
                                     seconds=sched.config.step_deadline_s)
        self.timeline: list[TimelinePoint] = []
        self.t_target: float | None = None
        sched.last_timeline = self.timeline
        sched.last_dropped = self.ledger.dropped

    @property
    def draining(self) -> bool:
        return self.ctx.draining

    # the policy's view of the step (policies.StepView)
    @property
    def target(self) -> int:
        return self.ctx.target

    @property
    def accepted_groups(self) -> int:
        return self.ledger.count(Place.ACCEPTED)

    @property
    def groups_in_play(self) -> int:
        return self.ledger.count(Place.ACCEPTED, Place.ACTIVE, Place.REWARDING)

    @property
    def calls_in_flight(self) -> int:
        return len(self.calls)

    @property
    def calls_queued(self) -> int:
        return len(self.ctx.queue)

    @property
    def episodes_live(self) -> int:
        return self.ctx.work.live_episodes

    @property
    def groups_to_resume(self) -> int:
        return self.ledger.count(Place.RESUME)

    # ================================================================== driver
    async def run(self) -> StepResult:
        self.t0 = self.ctx.loop.time()
        if self.s.episodes is not None:
            self.s.episodes.attach(self.ctx.events)
        try:
            self.groups.take_buffer()
            await self.engines.probe_excluded()
            if self.policy.watches_loads:
                self.engines.watch_loads(self.policy, self.s.load_poll_interval_s)
            await self._fill_phase()
            self.t_target = self.ctx.loop.time() - self.t0
            await self._drain_phase()
        except Exception as e:
            await self._recover_phase()
            if isinstance(e, RolloutStepError):
                raise
            raise RolloutStepError(f"rollout step failed, all its groups are back in the buffer: "
                                   f"{type(e).__name__}: {e}") from e
        except BaseException:
            self._settle_now()
            raise
        finally:
            self.engines.stop()  # probes and the load poller, then the aborts still pending
            self.calls.stop()
            if self.s.episodes is not None:
                self.s.episodes.detach()
        self.groups.return_leftovers()
        self.ledger.check_settled()
        for group in self.ledger.groups(Place.ACCEPTED):
            self.ctx.work.settle(group)
        return StepResult(groups=self.ledger.groups(Place.ACCEPTED), metrics=self._metrics(),
                          dropped=dict(self.ledger.dropped))

    async def _next_events(self, timeout: float | None = None) -> bool:
        """Handle one event (waiting at most ``timeout`` for it), then every event already queued.
        Returns False when nothing arrived in time."""
        try:  # a deadline on this task itself (asyncio.wait_for would make a task per wait)
            async with asyncio.timeout(None if timeout is None else max(timeout, 0.0)):
                event = await self.ctx.events.get()
        except TimeoutError:
            return False
        self._handle(event)
        self._handle_queued()
        return True

    def _handle_queued(self) -> None:
        while not self.ctx.events.empty():
            self._handle(self.ctx.events.get_nowait())

    def _handle(self, event: StepEvent) -> None:
        match event:
            case CallReplied(rid, result, error):
                self._on_reply(rid, result, error)
            case GroupRewarded(group, error):
                if self.groups.on_rewarded(group, error) is not None:
                    raise RolloutStepError(f"reward function failed on group {group.uid}: "
                                           f"{type(error).__name__}: {error}") from error
            case ProbeAnswered(url, error):
                if self.engines.on_probe(url, error):
                    self.faults.evacuate(url)
            case ConcurrencyChosen(limit):
                self.policy.set_limit(limit)
            case EpisodeCallAsked(item):
                if not self.draining and self.ledger.place_of(item.group_uid) is Place.ACTIVE:
                    # (otherwise it waits on its episode for the group to open); a group that must
                    # finish in this step goes first, so the target never waits behind other work
                    if self.ctx.pacing.must_finish(self.ledger.get(item.group_uid, Place.ACTIVE)):
                        self.ctx.queue.appendleft(item)
                    else:
                        self.ctx.queue.append(item)
            case EpisodeEnded(member):
                self.groups.episode_done(member)
            case _:  # pragma: no cover - events are produced only by the step and what it holds
                raise AssertionError(f"unknown event {event!r}")

    # ================================================================== phase 1: fill
    async def _fill_phase(self) -> None:
        self._fill()
        while self.accepted_groups < self.ctx.target:
            idle = not self.calls and not self.ledger.count(Place.REWARDING) and not self.ctx.work.busy(
                self.ledger.groups(Place.ACTIVE))
            if idle and self.ledger.count(Place.DEFERRED):
                self.groups.promote_deferred(force=True)  # nothing else can run: never stall on them
                continue
            if idle:
                raise PromptsExhausted(
                    f"the prompt source is exhausted: {self.accepted_groups} of {self.ctx.target} "
                    f"groups complete and nothing left to generate")
            await self._next_events(timeout=sooner(self.engines.until_stall_check(), self.deadline.left()))
            self.engines.check_stalls()
            if self.deadline.check():  # past it, a due group's unfinished samples no longer hold the step
                self._handle_queued()  # the ends it caused (a sample masked, given up) count before the next wait
            self._fill()

    def _fill(self) -> None:
        """Open the groups and submit the calls the policy asks for."""
        if self.draining:
            return
        while (k := self.policy.groups_to_open(self)) > 0 and self.groups.open(k):
            pass
        if self.accepted_groups < self.ctx.target:
            for _ in range(min(self.policy.calls_to_submit(self), len(self.ctx.queue))):
                self._submit(self.ctx.queue.popleft())
        self._record(work_remaining=self.accepted_groups < self.ctx.target and (
            bool(self.ctx.queue) or bool(self.ledger.count(Place.RESUME, Place.FRESH)) or not self.groups.exhausted))

    def _submit(self, t: Trajectory) -> None:
        """The one way work reaches an engine: the item's next call, counted and dispatched."""
        input_ids, max_new_tokens = self.ctx.work.begin_call(t)
        self.calls.start(t, input_ids, max_new_tokens)

    # ================================================================== phase 2: replies
    def _on_reply(self, rid: str, result: GenerateResult | None, error: Exception | None) -> None:
        call = self.calls.settle(rid)
        if call is None:
            return  # cancelled (drain deadline, stalled engine, dropped group); already settled
        t = call.item
        if self.ledger.place_of(t.group_uid) is Place.DROPPED:
            self.ctx.work.unanswered(t)
            return
        if error is None:
            error = self.ctx.work.absorb(t, result, self.draining)
            self.groups.tokens_changed(t.group_uid, t)
        if error is None:
            self.ctx.counters.answered_call_s += call.running_s(self.ctx.loop.time())
            self.s.health.readmit(call.engine_url)
            if t.status.finished:
                group = self.ledger.get(t.group_uid, Place.ACTIVE)
                if group.complete:
                    self.groups.complete(group)
            elif not self.draining:
                self.ctx.queue.appendleft(t)  # the engine aborted on its own: resume at once
            return
        self.ctx.work.unanswered(t)
        if isinstance(error, RequestRejected):
            self.faults.rejected(call, error)
        elif isinstance(error, EngineError):
            self.faults.call_failed(call, error, seen=None if result is None else len(result.output_ids))
        else:
            raise error

    # ================================================================== phase 3: drain
    async def _drain_phase(self) -> None:
        """Abort everything in flight and collect the replies (and pending rewards), until the
        drain deadline at most."""
        self.ctx.phase = DRAIN
        await self._drain(self.ctx.loop.time() + self.s.drain_timeout_s)

    async def _drain(self, deadline: float) -> None:
        self.engines.stop_load_watch()
        self.ctx.queue.clear()
        for url in self.engines.busy():
            self.calls.abort_later(url, None)
        while self.calls or self.ledger.count(Place.REWARDING):
            before = self.ctx.loop.time()
            left = deadline - before
            if left <= 0:
                break
            try:
                got = await self._next_events(timeout=min(left, self.s.abort_retry_interval_s))
            except Exception as e:
                if not self.ctx.recovering:
                    raise
                logger.warning("ignored while recovering: %s", e)  # the clean-up must go on
                continue
            if not got:
                if self.ctx.loop.time() <= before:
                    # The wait ended without the clock moving: what was left of the deadline is
                    # below the loop's clock resolution, at which asyncio runs a timer early (on
                    # the benchmark's virtual clock nothing else moves it). The deadline is here.
                    break
                # The abort may have overtaken a request still in transit: abort again, once per
                # engine still holding calls (once per call: thousands of requests an interval at
                # N' = 4096, each on a new connection, the generates holding the pooled ones).
                for url in self.engines.busy():
                    self.calls.abort_later(url, None)
            self._record(work_remaining=False)
        self._cut_at_deadline()

    def _cut_at_deadline(self) -> None:
        for call in list(self.calls.in_flight.values()):
            self.faults.count_lost(call)
            self.faults.forget_call(call)
            self.ctx.counters.drain_cancelled_calls += 1
            self.s.health.exclude(call.engine_url, f"no reply to the abort of {call.rid} within the "
                                                   f"drain deadline ({self.s.drain_timeout_s:g} s)", unanswering=True)
        self.groups.cancel_rewards()
        if self.timeline:
            self._record(work_remaining=False)

    # ================================================================== phase 4: recover
    async def _recover_phase(self) -> None:
        """After an error: drain (bounded by the drain deadline), then buffer every group."""
        self.ctx.phase = RECOVER
        try:
            await self._drain(self.ctx.loop.time() + self.s.drain_timeout_s)
        finally:
            self._settle_now()

    def _settle_now(self) -> None:
        """Synchronous end of a failed or cancelled step: cancel what is left and put every group
        of the step back in the buffer (aborts are sent in the background, not awaited)."""
        self.ctx.phase = RECOVER
        busy = self.engines.busy()
        for call in list(self.calls.in_flight.values()):
            self.faults.forget_call(call)
        for url in busy:
            self.calls.abort_detached(url)  # the engines would otherwise keep generating
        self.groups.cancel_rewards()
        self.groups.return_all()

    # ================================================================== metrics
    def _record(self, work_remaining: bool) -> None:
        record(self.timeline, TimelinePoint(self.ctx.loop.time() - self.t0, len(self.calls),
                                            self.policy.in_flight_limit, work_remaining))

    def _metrics(self) -> dict[str, float]:
        return step_metrics(clock=self.ctx.loop.time, t0=self.t0, t_target=self.t_target, counters=self.ctx.counters,
                            stale_delta=self.groups.stale_delta, engines_excluded=len(self.s.health.excluded),
                            carried_groups=self.groups.carried_groups, buffer=self.s.buffer,
                            concurrency_limit=self.policy.in_flight_limit, timeline=self.timeline,
                            returned=self.ledger.groups(Place.ACCEPTED), current_version=self.ctx.current_version,
                            protected_groups=len(self.ctx.pacing.protected), deferred_groups=self.ctx.pacing.deferrals,
                            episodes=self._episode_metrics())

    def _episode_metrics(self) -> dict[str, float] | None:
        return None if self.s.episodes is None else self.s.episodes.metrics_since_last()
