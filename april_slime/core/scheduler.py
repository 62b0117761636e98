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

A step runs in four phases, each a section of ``_Step`` below; the step's state (every group and
every call of the step) lives in ``_Step`` alone and data flows one way: prompt source / buffer ->
fill -> engine calls -> reply handling -> groups -> result / buffer.

1. fill: open groups (buffer first, then fresh prompts) and submit trajectories to engines.
2. reply: append each reply to its trajectory, complete, reward and judge groups, refill.
3. drain (target reached): abort what still runs and collect the replies, until
   ``drain_timeout_s`` at most.
4. recover (any error): the same drain, then every group of the step goes back to the buffer;
   a cancellation puts every group back at once, without draining.

Group life: a group counts once all of its trajectories finished (COMPLETED or TRUNCATED);
finished members of unfinished groups stay with their group (CoPRIS eq. 7) and are never
regenerated. A reply whose last token is EOS or a stop token id is finished whatever its
finish_reason says (SGLang can answer "abort" or "length" for a request whose last sampled token
was EOS; resuming it would run past the stop). A completed group is rewarded (``reward_fn``
awaited, in its own task so refills do not wait on it), then ``group_filter`` decides whether it
counts. Rejected groups are discarded and counted; passing groups beyond the target ("surplus")
go back to the buffer when ``config.return_surplus`` (else they are discarded and counted).

Resumption: every step first takes the whole buffer (``PartialBuffer.take`` applies the staleness
bound and the resume priority) and opens those groups before any new prompt. An unfinished
trajectory is resubmitted with ``input_ids = prompt + partial response`` and ``max_new_tokens``
reduced by what it already has; the reply's tokens and log-probs are appended with their per-token
policy versions (SGLang's ``weight_versions`` spans when the weights changed during the call, else
the reply's ``weight_version``). A trajectory with no budget left is marked TRUNCATED without a
call. Buffered groups the step never opened go back into the buffer unchanged.

Dispatch (verl's per-engine supplementation): each request goes directly to the healthy engine
with the fewest requests in flight from this step, so a refill lands on the engine whose slot just
freed. Every rid is ``f"{trajectory.uid}#{trajectory.num_calls}"`` and ``num_calls`` never
decreases (it is saved with the buffer), so rids are unique for the job.

Engine health (``EngineHealth``, held by the scheduler across steps): an engine whose call failed
(the client already retried what was safe to retry), that did not answer an abort before the drain
deadline, or that stalled (requests in flight, no reply for ``stall_probe_after_s``, and a failed
health probe) is taken out of dispatch until it answers a health probe (a one-token generate
within ``probe_timeout_s``, retried every ``probe_interval_s`` while a step runs). Calls of an
engine found stalled are cancelled and their trajectories resubmitted elsewhere, keeping what they
had. When every engine is out, all of them are used (their failures then end the step).

Abort at target: one best-effort ``abort_all`` per engine that has requests of this step in
flight (short ``abort_timeout_s``, no retries, never awaited before replies are handled); requests
still running after ``abort_retry_interval_s`` without any reply are aborted again by rid. Aborted
replies carry their partial tokens, which are appended; a reply that raced the abort and finished
counts as finished. At ``drain_timeout_s`` the calls still pending are cancelled: their
trajectories keep what they had before the call and go to the buffer with their group, and their
engines are taken out of dispatch.

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
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable, Protocol

from april_slime.core.buffer import PartialBuffer
from april_slime.core.config import AprilConfig
from april_slime.core.engine import (EngineClient, EngineError, EngineLoad, EngineReplyError, GenerateResult,
                                RequestRejected)
from april_slime.core.keys import METRIC_PREFIX
from april_slime.core.types import Group, Trajectory, TrajectoryStatus

logger = logging.getLogger(__name__)


# reasons a group is discarded, as they appear in StepResult.dropped / RolloutScheduler.last_dropped
DROP_FILTERED = "filtered"
DROP_SURPLUS = "surplus_discarded"
DROP_STALE = "stale"
DROP_REJECTED = "rejected_by_engine"


class PromptSource(Protocol):
    def next_groups(self, n: int, current_version: int) -> list[Group]:
        """Up to ``n`` fresh groups; fewer than asked means the dataset is exhausted."""


class ConcurrencyController(Protocol):
    def initial(self) -> int: ...

    def observe(self, loads: list[EngineLoad], now: float) -> int:
        """Returns the new concurrency target N'."""


class RolloutStepError(RuntimeError):
    """A rollout step could not finish. Every group of the step was put back into the buffer
    (except those discarded with a counted reason, listed in ``RolloutScheduler.last_dropped``)."""


class PromptsExhausted(RolloutStepError):
    """The prompt source ran dry before the step had ``rollout_batch_size`` groups."""


@dataclass
class StepResult:
    """``groups``: exactly ``rollout_batch_size`` complete, rewarded, filter-passing groups.
    ``dropped``: uid -> reason of every group this step discarded (filter, discarded surplus,
    staleness drop, rejected by the engines).

    ``metrics`` (all floats, every key prefixed ``april/``):
    step_time_s, time_to_target_s (loop time until the target was met, before the abort drain),
    generated_tokens (every token that came back this step, aborted partials included),
    throughput_tokens_per_s (generated_tokens / step_time_s), aborted_tokens, engine_calls,
    engine_errors, abort_calls, abort_errors, load_poll_errors, truncated_without_call,
    stop_token_finishes (replies finished by their last token although the engine said abort or
    length), resumed_groups (buffered groups opened), resumed_trajectories (submitted with a
    partial response), filtered_groups, surplus_groups, surplus_discarded_groups,
    stale_restarted_groups, stale_dropped_groups, recomputed_tokens (thrown away by staleness
    restarts), discarded_tokens (filter rejections + discarded surplus + staleness drops + groups
    rejected by the engines), rejected_calls, rejected_groups, drain_cancelled_calls (pending at
    the drain deadline), stalled_engines, probe_failures, engines_excluded (out of dispatch at the
    end of the step), carried_groups (unfinished groups put back), buffer_groups,
    buffer_trajectories, buffer_partial_trajectories (unfinished with tokens), concurrency_limit
    (copris N' at the end; 0 otherwise), inflight_mean (time-weighted over the step), inflight_max,
    inflight_min_while_work, returned_groups, returned_tokens, offpolicy_token_fraction (returned
    tokens whose version != current_version), staleness_mean, staleness_max, staleness_hist/<k>
    (returned trajectories whose oldest token lags k versions).
    """

    groups: list[Group]
    metrics: dict[str, float]
    dropped: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TimelinePoint:
    """The scheduler's state after it settled (handled every ready reply and refilled)."""

    time: float  # seconds since the step started (loop time)
    in_flight: int
    limit: int | None  # copris: N' at that moment; None for sync / april
    work_remaining: bool  # the target is not reached and there is something left to submit


class EngineHealth:
    """Which engines may take requests. One instance per scheduler, kept across steps, so an engine
    that failed stays out of dispatch in the next step until it answers a health probe."""

    def __init__(self, urls: Iterable[str]):
        self.urls = list(urls)
        self.excluded: dict[str, str] = {}  # url -> why it is out of dispatch
        self.exclusions = 0  # cumulative
        self.readmissions = 0  # cumulative

    def usable(self) -> list[str]:
        """Engines to dispatch to; every engine when all of them are out (nothing better left)."""
        healthy = [u for u in self.urls if u not in self.excluded]
        return healthy or list(self.urls)

    def exclude(self, url: str, reason: str) -> None:
        if url not in self.excluded:
            self.exclusions += 1
            logger.warning("engine %s taken out of dispatch until it answers a health probe: %s",
                           url, reason)
        self.excluded[url] = reason

    def readmit(self, url: str) -> None:
        if self.excluded.pop(url, None) is not None:
            self.readmissions += 1
            logger.info("engine %s answered and is back in dispatch", url)


class RolloutScheduler:
    """Owns the requests in flight of one rollout step at a time (``run_step`` is not reentrant)
    and the engines' health across steps."""

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
                 probe_interval_s: float = 5.0):
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
            self.concurrency = max(1, int(controller.initial()))
        else:
            self.concurrency = config.resolved_concurrency(rollout_batch_size, n_samples_per_prompt)
        if config.policy == "copris" and self.concurrency < n_samples_per_prompt:
            logger.warning("copris concurrency %d < n_samples_per_prompt %d: a group can never be "
                           "in flight as a whole", self.concurrency, n_samples_per_prompt)
        self.last_timeline: list[TimelinePoint] = []  # of the latest step, for metrics and tests
        self.last_dropped: dict[str, str] = {}  # groups the latest step discarded, success or not
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
    stop_token_finishes: int = 0
    resumed_groups: int = 0
    filtered_groups: int = 0
    filtered_tokens: int = 0
    surplus_groups: int = 0
    surplus_discarded_groups: int = 0
    surplus_discarded_tokens: int = 0
    rejected_calls: int = 0
    rejected_groups: int = 0
    rejected_tokens: int = 0
    drain_cancelled_calls: int = 0
    stalled_engines: int = 0
    probe_failures: int = 0
    load_poll_errors: int = 0
    resumed_uids: set[str] = field(default_factory=set)


class _Step:
    """State of one ``run_step`` call, owned here and nowhere else. Every group of the step is in
    exactly one of: ``resume`` (taken from the buffer, not opened), ``fresh`` (from the prompt
    source, not opened), ``active`` (opened, unfinished trajectories), ``rewarding``, ``accepted``,
    ``surplus``, ``unjudged`` (completed but not judged: while recovering, or its reward was cut
    off by the drain deadline), or ``dropped`` (discarded, with its reason)."""

    def __init__(self, sched: RolloutScheduler, prompt_source: PromptSource, current_version: int):
        self.s = sched
        self.client = sched.client
        self.health = sched.health
        self.policy = sched.config.policy
        self.prompt_source = prompt_source
        self.current_version = current_version
        self.target = sched.rollout_batch_size
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        # groups
        self.resume: deque[Group] = deque()
        self.fresh: deque[Group] = deque()
        self.active: dict[str, Group] = {}
        self.rewarding: dict[str, tuple[Group, asyncio.Task]] = {}
        self.accepted: list[Group] = []
        self.surplus: list[Group] = []
        self.unjudged: list[Group] = []
        self.dropped: dict[str, str] = {}
        self.seen_groups: set[str] = set()
        # trajectories and calls
        self.queue: deque[Trajectory] = deque()
        self.in_flight: dict[str, _Call] = {}
        self.failures: dict[str, int] = {}  # trajectory uid -> failed calls in this step
        # engines, as this step sees them
        self.engine_in_flight = {url: 0 for url in sched.client.engine_urls}
        self.last_activity = {url: 0.0 for url in sched.client.engine_urls}
        self.probes: dict[str, asyncio.Task] = {}
        self.aborts: dict[tuple[str, str | None], asyncio.Task] = {}
        self.poller: asyncio.Task | None = None
        # phase: "fill" until the target is met, then "drain"; "recover" after an error
        self.phase = "fill"
        self.exhausted = False
        self.counters = _StepCounters()
        self.timeline: list[TimelinePoint] = []
        self.t_target: float | None = None
        sched.last_timeline = self.timeline
        sched.last_dropped = self.dropped

    @property
    def draining(self) -> bool:
        return self.phase != "fill"

    # ================================================================== driver
    async def run(self) -> StepResult:
        self.t0 = self.loop.time()
        try:
            self._take_buffer()
            for url in self.health.excluded:
                self._start_probe(url)
            if self.s.controller is not None and self.policy == "copris":
                self.poller = self.loop.create_task(self._poll_loads())
            await self._fill_phase()
            self.t_target = self.loop.time() - self.t0
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
            self._stop_background()
        self._return_leftovers()
        return StepResult(groups=list(self.accepted), metrics=self._metrics(), dropped=dict(self.dropped))

    def _take_buffer(self) -> None:
        buffer = self.s.buffer
        before_counters = buffer.counters()
        before = {g.uid for g in buffer.groups()}
        taken = buffer.take(len(buffer), self.current_version)
        self.resume.extend(taken)
        self.stale_delta = {k: buffer.counters()[k] - before_counters[k] for k in before_counters}
        still_there = {g.uid for g in buffer.groups()}
        for uid in before - still_there - {g.uid for g in taken}:
            self.dropped[uid] = DROP_STALE

    async def _next_events(self, timeout: float | None = None) -> bool:
        """Handle one event (waiting at most ``timeout`` for it), then every event already queued.
        Returns False when nothing arrived in time."""
        try:
            if timeout is None:
                event = await self.events.get()
            else:
                event = await asyncio.wait_for(self.events.get(), max(timeout, 0.0))
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
        elif kind == "probe":
            self._on_probe(*event[1:])
        elif kind == "concurrency":
            self.s.concurrency = event[1]
        else:  # pragma: no cover - events are produced only in this module
            raise AssertionError(f"unknown event {kind!r}")

    # ================================================================== phase 1: fill
    async def _fill_phase(self) -> None:
        self._fill()
        while len(self.accepted) < self.target:
            if not self.in_flight and not self.rewarding:
                raise PromptsExhausted(
                    f"the prompt source is exhausted: {len(self.accepted)} of {self.target} "
                    f"groups complete and nothing left to generate")
            await self._next_events(timeout=self._until_stall_check())
            self._check_stalls()
            self._fill()

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
            if t.response_ids and t.response_ids[-1] in self.s.stop_token_ids:
                # buffered by an older version that resumed past a stop: it is finished
                t.status, t.finish_reason = TrajectoryStatus.COMPLETED, "stop"
                self.counters.stop_token_finishes += 1
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
        url = min(self.health.usable(), key=lambda u: self.engine_in_flight[u])
        rid = f"{t.uid}#{t.num_calls}"
        t.num_calls += 1
        if t.response_ids:
            self.counters.resumed_uids.add(t.uid)
        t.status = TrajectoryStatus.RUNNING
        call = _Call(t, url, rid)
        self.in_flight[rid] = call
        if self.engine_in_flight[url] == 0:
            self.last_activity[url] = self.loop.time()  # the stall clock starts with its first call
        self.engine_in_flight[url] += 1
        self.counters.engine_calls += 1
        call.task = self.loop.create_task(self._generate(call, t.input_ids(), t.remaining_tokens))

    async def _generate(self, call: _Call, input_ids: list[int], max_new_tokens: int) -> None:
        try:
            result = await self.client.generate(
                call.engine_url, input_ids, max_new_tokens=max_new_tokens, rid=call.rid,
                sampling_params=self.s.sampling_params, sampling_seed=call.trajectory.sampling_seed)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # classified in _on_reply, inside the step's only consumer
            self.events.put_nowait(("reply", call, None, e))
        else:
            self.events.put_nowait(("reply", call, result, None))

    def _forget_call(self, call: _Call) -> bool:
        """Take a call out of flight (its reply, if any comes, is ignored). The trajectory keeps
        exactly what it had before the call. Returns False when the call was already settled."""
        if self.in_flight.pop(call.rid, None) is None:
            return False
        self.engine_in_flight[call.engine_url] -= 1
        if call.task is not None and not call.task.done():
            call.task.cancel()
        t = call.trajectory
        if t.status is TrajectoryStatus.RUNNING:
            t.status = TrajectoryStatus.ABORTED if t.response_ids else TrajectoryStatus.PENDING
        return True

    # ================================================================== phase 2: replies
    def _on_reply(self, call: _Call, result: GenerateResult | None, error: Exception | None) -> None:
        if self.in_flight.pop(call.rid, None) is None:
            return  # cancelled (drain deadline, stalled engine, dropped group); already settled
        url = call.engine_url
        self.engine_in_flight[url] -= 1
        self.last_activity[url] = self.loop.time()
        t = call.trajectory
        if t.group_uid in self.dropped:
            t.status = TrajectoryStatus.ABORTED if t.response_ids else TrajectoryStatus.PENDING
            return
        if error is None:
            error = self._apply(t, result)
        if error is None:
            self.health.readmit(url)
            if t.status.finished:
                group = self.active[t.group_uid]
                if group.complete:
                    del self.active[group.uid]
                    self._on_group_complete(group)
            elif not self.draining:
                self.queue.appendleft(t)  # the engine aborted on its own: resume at once
            return
        t.status = TrajectoryStatus.ABORTED if t.response_ids else TrajectoryStatus.PENDING
        if isinstance(error, RequestRejected):
            self._on_rejected(call, error)
        elif isinstance(error, EngineError):
            self._on_call_failed(call, error)
        else:
            raise error

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
            t.append(result.output_ids, result.logprobs, int(result.weight_version), result.version_runs)
        except (ValueError, TypeError) as e:
            return EngineReplyError(f"{result.engine_url}: {e}")
        tokens = len(result.output_ids)
        self.counters.generated_tokens += tokens
        if finish != "stop" and result.output_ids and result.output_ids[-1] in self.s.stop_token_ids:
            # the abort (or the budget) raced a sampled stop token: the response is complete
            self.counters.stop_token_finishes += 1
            if finish == "abort":
                t.num_aborts += 1
                self.counters.aborted_tokens += tokens
            finish = "stop"
        t.finish_reason = finish
        if finish == "stop":
            t.status = TrajectoryStatus.COMPLETED
        elif finish == "length" or t.remaining_tokens <= 0:
            t.status = TrajectoryStatus.TRUNCATED
        else:
            t.status = TrajectoryStatus.ABORTED if t.response_ids else TrajectoryStatus.PENDING
            t.num_aborts += 1
            self.counters.aborted_tokens += tokens
        return None

    def _on_call_failed(self, call: _Call, error: EngineError) -> None:
        t = call.trajectory
        self.counters.engine_errors += 1
        self.health.exclude(call.engine_url, f"generate {call.rid} failed: {error}")
        self._start_probe(call.engine_url)
        self._count_failure(t, f"generate {call.rid} on {call.engine_url} failed: {error}")

    def _count_failure(self, t: Trajectory, what: str) -> None:
        """One failed call of ``t``; past the limit the step ends (during a drain the trajectory
        just stays with its group)."""
        self.failures[t.uid] = self.failures.get(t.uid, 0) + 1
        logger.warning("%s (%d/%d)", what, self.failures[t.uid], self.s.max_failures_per_trajectory + 1)
        if self.draining:
            return
        if self.failures[t.uid] > self.s.max_failures_per_trajectory:
            raise RolloutStepError(f"trajectory {t.uid} failed {self.failures[t.uid]} engine calls in "
                                   f"one step (last: {what}); all groups of the step are back in "
                                   "the buffer")
        self.queue.appendleft(t)

    def _on_rejected(self, call: _Call, error: RequestRejected) -> None:
        t = call.trajectory
        t.rejected_calls += 1
        self.counters.rejected_calls += 1
        logger.warning("generate %s refused as invalid (%d/%d): %s", call.rid, t.rejected_calls,
                       self.s.max_rejected_calls, error)
        if t.rejected_calls >= self.s.max_rejected_calls:
            group = self.active.pop(t.group_uid)
            self._drop(group, DROP_REJECTED)
            self.counters.rejected_groups += 1
            self.counters.rejected_tokens += _tokens(group)
            for other in list(self.in_flight.values()):
                if other.trajectory.group_uid == group.uid:
                    self._forget_call(other)
                    self._abort_later(other.engine_url, other.rid)
            if self.queue:
                self.queue = deque(q for q in self.queue if q.group_uid != group.uid)
        elif not self.draining:
            self.queue.appendleft(t)

    def _drop(self, group: Group, reason: str) -> None:
        self.dropped[group.uid] = reason
        logger.info("group %s discarded: %s", group.uid, reason)

    # ------------------------------------------------------------------ groups
    def _on_group_complete(self, group: Group) -> None:
        if self.phase == "recover":
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
            if self.phase == "recover":
                logger.warning("reward function failed on group %s while recovering: %s", group.uid, error)
                return
            raise RolloutStepError(f"reward function failed on group {group.uid}: "
                                   f"{type(error).__name__}: {error}") from error
        if self.phase == "recover":
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
            self._drop(group, DROP_FILTERED)
            self.counters.filtered_groups += 1
            self.counters.filtered_tokens += _tokens(group)
        elif len(self.accepted) < self.target:
            self.accepted.append(group)
        else:
            self.surplus.append(group)

    # ------------------------------------------------------------------ engine health in a step
    def _stall_deadlines(self) -> dict[str, float]:
        """Busy engines not being probed -> the time at which their silence counts as a stall."""
        after = self.s.stall_probe_after_s
        if after is None:
            return {}
        return {u: self.last_activity[u] + after for u, n in self.engine_in_flight.items()
                if n > 0 and u not in self.probes}

    def _until_stall_check(self) -> float | None:
        deadlines = self._stall_deadlines()
        return max(min(deadlines.values()) - self.loop.time(), 0.0) if deadlines else None

    def _check_stalls(self) -> None:
        """An engine with requests in flight and no reply for ``stall_probe_after_s`` gets a health
        probe; if that fails too, its calls are moved to other engines (``_on_probe``)."""
        # a millisecond of slack: a timer set for the deadline may fire a rounding error early
        now = self.loop.time() + 1e-3
        for url, deadline in self._stall_deadlines().items():
            if now >= deadline:
                logger.warning("engine %s: %d requests in flight and no reply for %.0f s; probing it",
                               url, self.engine_in_flight[url], now - self.last_activity[url])
                self._start_probe(url)

    def _start_probe(self, url: str) -> None:
        if url not in self.probes:
            self.probes[url] = self.loop.create_task(self._probe_loop(url))

    async def _probe_loop(self, url: str) -> None:
        while True:
            try:
                await self.client.probe(url, timeout_s=self.s.probe_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.events.put_nowait(("probe", url, e))
                await asyncio.sleep(self.s.probe_interval_s)
            else:
                self.events.put_nowait(("probe", url, None))
                return

    def _on_probe(self, url: str, error: Exception | None) -> None:
        if error is None:
            self.probes.pop(url, None)
            self.last_activity[url] = self.loop.time()
            self.health.readmit(url)
            return
        self.counters.probe_failures += 1
        if url in self.health.excluded:
            return
        self.counters.stalled_engines += 1
        self.health.exclude(url, f"no reply for {self.s.stall_probe_after_s:g} s with requests in "
                                 f"flight, and the health probe failed: {error}")
        self._evacuate(url)

    def _evacuate(self, url: str) -> None:
        """Move every call of a stalled engine elsewhere; the engine is asked to abort them."""
        calls = [c for c in self.in_flight.values() if c.engine_url == url]
        if calls:
            self._abort_later(url, None)
        for call in calls:
            self._forget_call(call)
        for call in calls:
            self._count_failure(call.trajectory, f"generate {call.rid} cancelled: engine {url} stalled")

    # ================================================================== phase 3: drain
    async def _drain_phase(self) -> None:
        """Abort everything in flight and collect the replies (and pending rewards), until the
        drain deadline at most."""
        self.phase = "drain"
        await self._drain(self.loop.time() + self.s.drain_timeout_s)

    async def _drain(self, deadline: float) -> None:
        if self.poller is not None:
            self.poller.cancel()
        self.queue.clear()
        for url in [u for u, n in self.engine_in_flight.items() if n > 0]:
            self._abort_later(url, None)
        while self.in_flight or self.rewarding:
            left = deadline - self.loop.time()
            if left <= 0:
                break
            try:
                got = await self._next_events(timeout=min(left, self.s.abort_retry_interval_s))
            except Exception as e:
                if self.phase != "recover":
                    raise
                logger.warning("ignored while recovering: %s", e)  # the clean-up must go on
                continue
            if not got:
                # the abort may have overtaken a request still in transit: abort those again
                for call in list(self.in_flight.values()):
                    self._abort_later(call.engine_url, call.rid)
            self._record(work_remaining=False)
        self._cut_at_deadline()

    def _cut_at_deadline(self) -> None:
        for call in list(self.in_flight.values()):
            self._forget_call(call)
            self.counters.drain_cancelled_calls += 1
            self.health.exclude(call.engine_url, f"no reply to the abort of {call.rid} within the "
                                                 f"drain deadline ({self.s.drain_timeout_s:g} s)")
        self._cancel_rewards()
        if self.timeline:
            self._record(work_remaining=False)

    def _cancel_rewards(self) -> None:
        """Groups still being rewarded go back unjudged, their partial rewards cleared: the next
        step rewards them again from scratch."""
        for group, task in list(self.rewarding.values()):
            task.cancel()
            for t in group.trajectories:
                t.reward = None
            self.unjudged.append(group)
        self.rewarding.clear()

    def _abort_later(self, url: str, rid: str | None) -> None:
        """Send a best-effort abort in the background (never awaited by the drain)."""
        key = (url, rid)
        pending = self.aborts.get(key)
        if pending is not None and not pending.done():
            return
        self.aborts[key] = self.loop.create_task(self._abort(url, rid))

    async def _abort(self, url: str, rid: str | None) -> None:
        self.counters.abort_calls += 1
        try:
            await self.client.abort(url, rid=rid, abort_all=rid is None,
                                    timeout_s=self.s.abort_timeout_s, max_retries=0)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # the request's own reply (or the drain deadline) still settles the trajectory
            self.counters.abort_errors += 1
            logger.warning("abort on %s failed: %s", url, e)

    def _return_leftovers(self) -> None:
        """Unopened, unfinished and unjudged groups, then surplus, go back into the buffer."""
        buffer = self.s.buffer
        self.carried_groups = len(self.resume) + len(self.fresh) + len(self.active)
        for group in [*self.resume, *self.fresh, *self.active.values(), *self.unjudged]:
            buffer.put(group)
        self.resume.clear()
        self.fresh.clear()
        self.active.clear()
        self.unjudged = []
        self.counters.surplus_groups = len(self.surplus)
        for group in self.surplus:
            if self.s.config.return_surplus:
                buffer.put(group)
            else:
                self._drop(group, DROP_SURPLUS)
                self.counters.surplus_discarded_groups += 1
                self.counters.surplus_discarded_tokens += _tokens(group)
        self.surplus = []

    # ================================================================== phase 4: recover
    async def _recover_phase(self) -> None:
        """After an error: drain (bounded by the drain deadline), then buffer every group."""
        self.phase = "recover"
        try:
            await self._drain(self.loop.time() + self.s.drain_timeout_s)
        finally:
            self._settle_now()

    def _settle_now(self) -> None:
        """Synchronous end of a failed or cancelled step: cancel what is left and put every group
        of the step back in the buffer (aborts are sent in the background, not awaited)."""
        self.phase = "recover"
        busy = [u for u, n in self.engine_in_flight.items() if n > 0]
        for call in list(self.in_flight.values()):
            self._forget_call(call)
        for url in busy:
            # the engines would otherwise keep generating replies nobody reads
            _detach(self.loop, self.client.abort(url, abort_all=True, timeout_s=self.s.abort_timeout_s,
                                                 max_retries=0))
        self._cancel_rewards()
        for group in [*self.accepted, *self.surplus, *self.unjudged, *self.resume, *self.fresh,
                      *self.active.values()]:
            if group.uid not in self.s.buffer and group.uid not in self.dropped:
                self.s.buffer.put(group)
        self.accepted, self.surplus, self.unjudged = [], [], []
        self.resume.clear()
        self.fresh.clear()
        self.active.clear()

    def _stop_background(self) -> None:
        """Probes, aborts and the load poller live only as long as the step (an engine still out
        of dispatch is probed again by the next step)."""
        if self.poller is not None:
            self.poller.cancel()
        for task in [*self.probes.values(), *self.aborts.values()]:
            task.cancel()
        self.probes.clear()
        self.aborts.clear()

    # ================================================================== adaptive N'
    async def _poll_loads(self) -> None:
        while True:
            await asyncio.sleep(self.s.load_poll_interval_s)
            try:
                loads = await self.client.loads()
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
            "stop_token_finishes": c.stop_token_finishes,
            "resumed_groups": c.resumed_groups,
            "resumed_trajectories": len(c.resumed_uids),
            "filtered_groups": c.filtered_groups,
            "surplus_groups": c.surplus_groups,
            "surplus_discarded_groups": c.surplus_discarded_groups,
            "stale_restarted_groups": self.stale_delta["restarted_groups"],
            "stale_dropped_groups": self.stale_delta["dropped_groups"],
            "recomputed_tokens": self.stale_delta["restarted_tokens"],
            "discarded_tokens": c.filtered_tokens + c.surplus_discarded_tokens + c.rejected_tokens
            + self.stale_delta["dropped_tokens"],
            "rejected_calls": c.rejected_calls,
            "rejected_groups": c.rejected_groups,
            "drain_cancelled_calls": c.drain_cancelled_calls,
            "stalled_engines": c.stalled_engines,
            "probe_failures": c.probe_failures,
            "engines_excluded": len(self.health.excluded),
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


# Aborts sent by a cancelled step must outlive it; holding them here keeps them from being
# garbage-collected before they run. Each is bounded by its own short timeout.
_DETACHED: set[asyncio.Task] = set()


def _detach(loop: asyncio.AbstractEventLoop, coro: Awaitable) -> None:
    async def best_effort() -> None:
        try:
            await coro
        except Exception as e:
            logger.warning("abort after a cancelled step failed: %s", e)

    task = loop.create_task(best_effort())
    _DETACHED.add(task)
    task.add_done_callback(_DETACHED.discard)


def _tokens(group: Group) -> int:
    return sum(t.response_length for t in group.trajectories)
