"""Episodes: samples that an agent function generates with several model calls and tools between.

slime's custom generate functions (``async def generate(args, sample, sampling_params)``) run one
episode each: they call the model through SGLang's ``/generate``, run tools, call again, and
return the finished ``Sample``. Under partial rollout an episode lives across rollout steps, so the
episode is a work item of the scheduler of its own kind, beside the plain trajectory:

* the group's member ``Trajectory`` is the episode's place in its group and in the buffer; it
  finishes when the function returns, with the returned sample's tokens, log-probs, loss mask and
  per-token versions (``EpisodeAgent.finish``);
* each model call the function makes is a ``ModelCall`` (a function may have several in flight at
  once, e.g. agents awaited together with ``asyncio.gather``: each is its own): a ``Trajectory`` of
  its own whose prompt is the call's input and whose budget is the call's ``max_new_tokens``. It is
  what the step queues,
  counts against N', dispatches, aborts at target and resumes next step (prompt + partial tokens,
  remaining budget, new weights), exactly as it does a plain trajectory (``work.TrajectoryWork``).
  The function awaits one reply per call, built once the call finished, whatever the number of
  segments (``EpisodeAgent.reply``); it never sees an abort the plugin caused. An episode's served
  calls are kept in the order the function made them, whatever order they finish in.

Between two rollout steps no call reaches an engine (slime pushes weights then, or offloads the
engines): a call made then waits, pending on its episode, until the next step opens the group.
Tools already running go on meanwhile; the coroutines live on the job's persistent event loop.

``EpisodeRunner`` owns every live episode of the job (member uid -> ``Episode``). The running step
attaches its event queue; the runner then reports ``EpisodeCallAsked(call_trajectory)`` when an
episode asks for a call and ``EpisodeEnded(member)`` when one finishes or must be given up.
Without a step attached, the same facts wait on the episode and the next step reads them when it
opens the group (``open``).

Faults. A function that raises, or whose tool phase (no call pending, not returned) outlasts
``tool_timeout_s``, or that is unfinished when the step deadline passes with its group due
(``fail_at_deadline``; masked at once with ``mask_failed``), is re-run alone from its prompt: its
calls are forgotten, the rest of its group keeps what it has. After ``max_failures`` re-runs the
episode is given up: the member is marked ``failed`` and the step drops the group (counted). With
``mask_failed`` every such failure counts as an infrastructure fault (the function raised, its tool
phase timed out, or the tokens it returned do not match the calls it was served; a wrong answer or a
truncation is a finished episode, never a failure): the given-up member is masked instead
(``TrajectoryStatus.FAILED``, no tokens) and the group goes on with its other members; a group left
with fewer than two unmasked members (nothing to normalise against) is dropped as before. A function
that cannot make progress stops the job instead of being re-run for ever (slime's own rollout raises
at its first error): once ``max_given_up_in_a_row`` episodes were given up with none finished
between them, or at once when the function's result shows it cannot serve under the plugin
(``EpisodeRefused``: a property of its code, which a re-run cannot change), the step ends with
``EpisodesFailing``, naming the function and its last failure. A suspended episode cannot be saved;
the checkpoint keeps finished members and restarts the others from their prompts: the data source
resets them at load and names them to the runner (``restored``), which counts each once, as
``restarted``, when a step first opens it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol

from april_slime.core.replay import TokenReplay
from april_slime.core.step_context import EpisodeCallAsked, EpisodeEnded, StepEvent
from april_slime.core.types import Group, Trajectory, TrajectoryStatus
from april_slime.core.work import TrajectoryWork

logger = logging.getLogger(__name__)


class EpisodeError(RuntimeError):
    """An episode's result cannot be used (its tokens do not match the calls it was served)."""


class EpisodeRefused(EpisodeError):
    """A function's result shows that the function itself cannot serve under the plugin (not this
    episode's bad luck): the job stops at once rather than re-running it."""


class EpisodesFailing(RuntimeError):
    """The job's generate function cannot make progress: the step ends with this error."""


@dataclass
class CallRequest:
    """One ``/generate`` an episode's function sent, as the front parsed it."""

    input_ids: list[int]  # the prompt the call continues (tokenized by the front when sent as text)
    max_new_tokens: int
    sampling_params: dict  # the call's own, without max_new_tokens and without the episode marker
    text: str | None = None  # the prompt as text, when the function sent text
    stop: tuple[str, ...] = ()  # stop strings, honoured across segment boundaries
    # ``return_routed_experts``: the reply carries the routed experts from this position on (None: not asked)
    routed_experts_from: int | None = None


@dataclass
class ModelCall:
    """One model call of an episode: the resumable ``trajectory`` and the reply the function awaits."""

    episode: Episode
    request: CallRequest
    trajectory: Trajectory
    reply: asyncio.Future
    number: int = 0  # the order in which the function made its calls (attempt-wide)


@dataclass
class Episode:
    """The live part of one episode (what the checkpoint cannot keep)."""

    member: Trajectory
    attempt: int = 0  # re-runs after failures
    task: asyncio.Task | None = None
    pending: dict[str, ModelCall] = field(default_factory=dict)  # call uid -> call, made and unanswered
    served: list[ModelCall] = field(default_factory=list)  # answered calls, in the order they were made
    calls_made: int = 0
    tool_deadline: asyncio.TimerHandle | None = None
    tool_started: float | None = None  # loop time the current tool phase began
    failed: str | None = None  # why it was given up
    group_restarts: int = 0  # the group's restart count when the episode began
    function: str = "the generate function"  # what runs it, for errors

    @property
    def live(self) -> bool:
        return not self.member.status.finished and self.failed is None

    def oldest_version(self) -> int | None:
        """Policy version of the oldest model token the episode holds (served calls and partials)."""
        calls = [c.trajectory for c in [*self.served, *self.pending.values()]]
        return min((v for t in calls for v in [t.oldest_version()] if v is not None), default=None)


class EpisodeAgent(Protocol):
    """What runs the user's function (the slime face provides it)."""

    def launch(self, member: Trajectory, group: Group) -> Awaitable[Any]:
        """The function's coroutine for ``member``, started from its prompt."""

    def finish(self, member: Trajectory, episode: Episode, result: Any) -> None:
        """Fill ``member`` from the function's result; raises ``EpisodeError`` when it cannot."""

    def reply(self, call: ModelCall) -> dict:
        """The SGLang reply of a finished call (``core.front.sglang_reply``, with the decoding of the
        job's tokenizer; it may cut the call's tokens at a stop string that spans segments)."""

    # optional: ``function_name(member, group) -> str``, what runs ``member``'s episode (for errors)


@dataclass
class EpisodeCounters:
    """Cumulative over the job (the step reports their difference)."""

    started: int = 0
    finished: int = 0
    calls: int = 0  # model calls answered (turns)
    suspended: int = 0  # calls left pending at the end of a step
    resumed_calls: int = 0  # answered calls that took more than one segment
    restarted: int = 0  # episodes restarted from their prompt (staleness, restore)
    failures: int = 0  # functions that raised
    timeouts: int = 0  # tool phases past the deadline
    given_up: int = 0
    masked: int = 0  # given-up members masked out of their group (mask_failed) instead of dropping it
    refused: int = 0  # results showing the function cannot serve under the plugin (the job stops)
    deadline_failures: int = 0  # unfinished when the step deadline passed with their group due
    tool_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class EpisodeRunner:
    """Every live episode of the job, and the model calls they wait on."""

    def __init__(self, agent: EpisodeAgent, *, max_failures: int = 2, tool_timeout_s: float | None = None,
                 max_given_up_in_a_row: int | None = 16, restored: set[str] | None = None,
                 mask_failed: bool = False):
        self.agent = agent
        self.max_failures = max_failures
        self.mask_failed = mask_failed  # a given-up member is masked, its group kept (module doc)
        self.tool_timeout_s = tool_timeout_s
        self.max_given_up_in_a_row = max_given_up_in_a_row  # None: no bound
        self.given_up_in_a_row = 0  # episodes given up since the last one finished
        self.failing: str | None = None  # why the job must stop (EpisodesFailing), once it must
        self.episodes: dict[str, Episode] = {}
        self.calls: dict[str, ModelCall] = {}  # call trajectory uid -> call
        self.counters = EpisodeCounters()
        self.events: asyncio.Queue | None = None  # the running step's
        self._reported = self.counters.as_dict()  # what the last step's metrics counted up to
        self.groups: dict[str, Group] = {}
        # member uids of unfinished episodes a checkpoint restored without their live state (the data
        # source's set, shared: it fills it at load); each leaves it when first opened, counted then
        self.restored = restored if restored is not None else set()

    # ------------------------------------------------------------------ the step
    def attach(self, events: asyncio.Queue) -> None:
        self.events = events

    def detach(self) -> None:
        """The step ended: what is still pending waits for the next one. The buffer's staleness
        bound sees each unfinished episode by its oldest token."""
        self.events = None
        for episode in self.episodes.values():
            if episode.live:
                episode.member.episode_oldest_version = episode.oldest_version()
                self.counters.suspended += len(episode.pending)

    def metrics_since_last(self) -> dict[str, float]:
        """What happened since the previous step's metrics, between steps included (tools run and
        time out then too), and how many episodes are alive."""
        now = self.counters.as_dict()
        delta = {k: now[k] - self._reported[k] for k in now}
        self._reported = now
        return {**delta, "live": self.live, "given_up_in_a_row": self.given_up_in_a_row}

    def _report(self, event: StepEvent) -> None:
        if self.events is not None:
            self.events.put_nowait(event)

    @property
    def live(self) -> int:
        return sum(1 for e in self.episodes.values() if e.live)

    def owns_call(self, t: Trajectory) -> bool:
        return t.uid in self.calls

    def is_live(self, member: Trajectory) -> bool:
        episode = self.episodes.get(member.uid)
        return episode is not None and episode.live

    def check(self) -> None:
        """Raise ``EpisodesFailing`` once the job's function cannot make progress."""
        if self.failing is not None:
            raise EpisodesFailing(self.failing)

    def open(self, member: Trajectory, group: Group) -> list[Trajectory]:
        """The step opened ``member``'s group: start its episode if none runs, and return the call
        trajectories to queue (its pending calls that are not finished)."""
        self.check()
        if member.status.finished:
            return []
        self.groups[group.uid] = group
        episode = self.episodes.get(member.uid)
        if episode is not None and episode.group_restarts != group.restarts:
            # the buffer restarted the group from its prompt (staleness): so is the episode
            self.counters.restarted += 1
            self._stop(self.episodes.pop(member.uid))
            episode = None
        if episode is None:
            if member.uid in self.restored:
                # its episode died with the job that saved it: this one starts again from the prompt
                self.restored.discard(member.uid)
                self.counters.restarted += 1
            episode = self.episodes[member.uid] = Episode(member, group_restarts=group.restarts)
            self._launch(episode)
        return [c.trajectory for c in episode.pending.values() if not c.trajectory.status.finished]

    def oldest_version(self, member: Trajectory) -> int | None:
        episode = self.episodes.get(member.uid)
        return episode.oldest_version() if episode is not None else None

    # ------------------------------------------------------------------ the function's side
    def _launch(self, episode: Episode) -> None:
        loop = asyncio.get_running_loop()
        member = episode.member
        group = self.groups[member.group_uid]
        self.counters.started += 1
        name = getattr(self.agent, "function_name", None)
        if name is not None:
            episode.function = name(member, group)
        episode.task = loop.create_task(self._run(episode, self.agent.launch(member, group)))
        self._enter_tools(episode)

    async def _run(self, episode: Episode, coro: Awaitable[Any]) -> None:
        try:
            result = await coro
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._failed(episode, f"the generate function raised {type(e).__name__}: {e}")
            return
        if self.episodes.get(episode.member.uid) is not episode:
            return  # forgotten meanwhile (restart, drop)
        self._leave_tools(episode)
        try:
            self.agent.finish(episode.member, episode, result)
        except EpisodeRefused as e:
            self._refused(episode, str(e))
            return
        except Exception as e:
            self._failed(episode, f"its result cannot be used: {type(e).__name__}: {e}")
            return
        self.counters.finished += 1
        self.given_up_in_a_row = 0
        self._report(EpisodeEnded(episode.member))

    async def call(self, episode_uid: str, request: CallRequest) -> dict:
        """A model call of episode ``episode_uid`` (from the front): pending until a step runs it,
        then answered once, with every segment."""
        episode = self.episodes.get(episode_uid)
        if episode is None or not episode.live:
            raise EpisodeError(f"no live episode {episode_uid!r} (pass the sampling_params the generate "
                               "function was given on to /generate)")
        member = episode.member
        number = episode.calls_made
        uid = f"{member.uid}@{episode.attempt}.{number}"
        episode.calls_made += 1
        t = Trajectory(uid=uid, group_uid=member.group_uid, index_in_group=member.index_in_group,
                       prompt_ids=list(request.input_ids), max_new_tokens=request.max_new_tokens,
                       sampling_seed=member.sampling_seed, sampling_params=dict(request.sampling_params))
        t.replay = _rows_run_before(episode, t.prompt_ids)
        call = ModelCall(episode, request, t, asyncio.get_running_loop().create_future(), number)
        episode.pending[uid] = call
        self.calls[uid] = call
        self._leave_tools(episode)
        self._report(EpisodeCallAsked(t))
        return await call.reply

    def call_finished(self, t: Trajectory) -> None:
        """The step finished call ``t`` (every segment): answer the function."""
        call = self.calls.pop(t.uid)
        episode = call.episode
        del episode.pending[t.uid]
        episode.served.append(call)
        episode.served.sort(key=lambda c: c.number)  # concurrent calls may finish out of order
        self.counters.calls += 1
        if t.num_calls > 1:
            self.counters.resumed_calls += 1
        try:
            reply = self.agent.reply(call)
        except Exception as e:
            call.reply.set_exception(e)
        else:
            call.reply.set_result(reply)
        if not episode.pending:
            self._enter_tools(episode)

    # ------------------------------------------------------------------ tool phases and faults
    def _enter_tools(self, episode: Episode) -> None:
        if episode.tool_started is not None:
            return  # already in a tool phase (its deadline runs from when it began)
        loop = asyncio.get_running_loop()
        episode.tool_started = loop.time()
        if self.tool_timeout_s is not None:
            episode.tool_deadline = loop.call_later(self.tool_timeout_s, self._tool_timeout, episode)

    def _leave_tools(self, episode: Episode) -> None:
        if episode.tool_started is not None:
            self.counters.tool_seconds += asyncio.get_running_loop().time() - episode.tool_started
            episode.tool_started = None
        if episode.tool_deadline is not None:
            episode.tool_deadline.cancel()
            episode.tool_deadline = None

    def _tool_timeout(self, episode: Episode) -> None:
        episode.tool_deadline = None
        if self.episodes.get(episode.member.uid) is episode and episode.live and not episode.pending:
            self.counters.timeouts += 1
            self._failed(episode, f"its tool phase ran past april_episode_tool_timeout_s={self.tool_timeout_s:g}",
                         timed_out=True)

    def _failed(self, episode: Episode, why: str, timed_out: bool = False) -> None:
        """Re-run the episode alone from its prompt, or give it up past ``max_failures``. A deadline
        that passed (``timed_out``: a tool phase's, counted in ``timeouts``, or the step's, in
        ``deadline_failures``) is counted by the caller, any other fault in ``failures``."""
        member = episode.member
        if self.episodes.get(member.uid) is not episode:
            return
        if not timed_out:
            self.counters.failures += 1
        logger.warning("episode %s (attempt %d): %s", member.uid, episode.attempt + 1, why)
        self._stop(episode)
        if episode.attempt >= self.max_failures:
            self._give_up(episode, why, mask=self.mask_failed)
            return
        fresh = self.episodes[member.uid] = Episode(member, attempt=episode.attempt + 1,
                                                    group_restarts=episode.group_restarts)
        member.reset()
        self._launch(fresh)

    def _give_up(self, episode: Episode, why: str, mask: bool = False) -> None:
        if mask:
            # an infrastructure fault, not the policy's outcome: the member leaves its group's
            # statistics and the loss, holding nothing of its failed attempts
            episode.member.reset()
            episode.member.status = TrajectoryStatus.FAILED
            self.counters.masked += 1
        else:
            episode.failed = why
        self.counters.given_up += 1
        self.given_up_in_a_row += 1
        bound = self.max_given_up_in_a_row
        if self.failing is None and bound is not None and self.given_up_in_a_row >= bound:
            self.failing = (f"{episode.function} cannot make progress: {self.given_up_in_a_row} episodes in a row "
                            f"were given up (april_max_given_up_in_a_row={bound}); the last, "
                            f"{episode.member.uid}, because {why}")
        self._report(EpisodeEnded(episode.member))

    def _refused(self, episode: Episode, why: str) -> None:
        """The function cannot serve under the plugin: its episode is given up and the job stops."""
        logger.error("episode %s: %s", episode.member.uid, why)
        self.counters.refused += 1
        self._stop(episode)
        if self.failing is None:
            self.failing = f"{episode.function} cannot run under the plugin: {why}"
        self._give_up(episode, why)

    def _stop(self, episode: Episode) -> None:
        self._leave_tools(episode)
        if episode.task is not None and not episode.task.done():
            episode.task.cancel()
        for call in [*episode.pending.values(), *episode.served]:
            self.calls.pop(call.trajectory.uid, None)
            if not call.reply.done():
                call.reply.cancel()
        episode.pending = {}

    def pending_call_uids(self, member: Trajectory) -> set[str]:
        """The uids of the model calls ``member``'s episode made and has no reply for."""
        episode = self.episodes.get(member.uid)
        return set() if episode is None else {c.trajectory.uid for c in episode.pending.values()}

    def fail_at_deadline(self, member: Trajectory, why: str) -> None:
        """The step deadline passed with ``member``'s group due and its episode unfinished (a tool
        or a model call that has not returned): an infrastructure fault. With ``mask_failed`` the
        member is masked at once (a re-run could not be trained in time), else the episode fails as
        any fault does: re-run from its prompt, or given up past ``max_failures``."""
        episode = self.episodes.get(member.uid)
        if episode is None or not episode.live:
            return
        self.counters.deadline_failures += 1
        if self.mask_failed:
            logger.warning("episode %s (attempt %d): %s; masked", member.uid, episode.attempt + 1, why)
            self._stop(episode)
            self._give_up(episode, why, mask=True)
        else:
            self._failed(episode, why, timed_out=True)

    def failure_of(self, member: Trajectory) -> str | None:
        episode = self.episodes.get(member.uid)
        return episode.failed if episode is not None else None

    # ------------------------------------------------------------------ the buffer's side
    def forget(self, group: Group, *, restarted: bool) -> None:
        """The group is restarted from its prompt or discarded: stop its live episodes."""
        for member in group.trajectories:
            episode = self.episodes.pop(member.uid, None)
            if episode is None:
                continue
            if restarted and episode.live:
                self.counters.restarted += 1
            self._stop(episode)
        self.groups.pop(group.uid, None)

    def settle(self, group: Group) -> None:
        """The group left the job (trained on): drop what the runner kept of it."""
        for member in group.trajectories:
            episode = self.episodes.pop(member.uid, None)
            if episode is not None:
                self._stop(episode)
        self.groups.pop(group.uid, None)

    async def close(self) -> None:
        for episode in list(self.episodes.values()):
            self._stop(episode)
        tasks = [e.task for e in self.episodes.values() if e.task is not None]
        self.episodes.clear()
        self.calls.clear()
        await asyncio.gather(*tasks, return_exceptions=True)


def _rows_run_before(episode: Episode, input_ids: list[int]) -> TokenReplay | None:
    """Routing replay: the routed experts an answered call of the episode ran for a prefix of this
    call's input (its own input and output), so that this call asks the engine only for the
    positions after them (``Trajectory.replay_rows``) rather than the whole conversation again.
    A returned sample takes each position's rows from the first call that ran it
    (``core.replay.stitch_calls``): these are those rows."""
    for call in reversed(episode.served):
        t = call.trajectory
        held = t.replay
        if held is None or held.routed is None or not t.response_ids:
            continue
        ran = len(t.prompt_ids) + len(t.response_ids)
        if ran <= len(input_ids) and input_ids[:len(t.prompt_ids)] == t.prompt_ids and (
                input_ids[len(t.prompt_ids):ran] == t.response_ids):
            return TokenReplay(routed_width=held.routed_width, routed=held.routed.frozen(),
                               routed_itemsize=held.routed_itemsize)
    return None


def finished_status(finish_reason: str | None) -> TrajectoryStatus:
    return TrajectoryStatus.TRUNCATED if finish_reason == "length" else TrajectoryStatus.COMPLETED


class EpisodeWork(TrajectoryWork):
    """Episodes as work items of one step: a group's members run their episodes, and the step
    queues, runs and resumes their model calls as trajectories."""

    def __init__(self, stop_token_ids: frozenset[int], counters, runner: EpisodeRunner):
        super().__init__(stop_token_ids, counters)
        self.runner = runner

    def open_group(self, group: Group) -> list[Trajectory]:
        return [call for member in group.trajectories for call in self.runner.open(member, group)]

    def gave_up(self, group: Group) -> bool:
        """Whether the step drops the group: a member's episode was given up unmasked, or masking
        left fewer than two members to normalise against; raises ``EpisodesFailing`` instead once
        the job's function cannot make progress."""
        self.runner.check()
        masked = len(group.masked())
        return (any(self.runner.failure_of(m) is not None for m in group.trajectories)
                or (masked > 0 and len(group.trajectories) - masked < 2))

    def busy(self, groups: list[Group]) -> bool:
        return any(self.runner.is_live(m) for g in groups for m in g.trajectories)

    def items_of(self, member: Trajectory) -> set[str]:
        return self.runner.pending_call_uids(member)

    def fail_at_deadline(self, member: Trajectory, why: str) -> bool:
        self.runner.fail_at_deadline(member, why)
        return True

    @property
    def live_episodes(self) -> int:
        return self.runner.live

    def absorb(self, t: Trajectory, result, draining: bool):
        error = super().absorb(t, result, draining)
        if error is None and t.status.finished and self.runner.owns_call(t):
            self.runner.call_finished(t)
        return error

    def discard(self, group: Group) -> None:
        self.runner.forget(group, restarted=False)

    def settle(self, group: Group) -> None:
        self.runner.settle(group)
