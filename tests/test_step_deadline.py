"""The step deadline (``april_step_deadline_s``, ``core.deadline``): a group at its staleness bound
must be trained in its step, and one of its samples whose tool never returns no longer holds that
step for good.

Emulated engines on the virtual clock (the deadline is a timer: the step ends at it, whatever the
machine's speed). The function is ``tests.support.hanging_tool``: model call, tool, model call;
the tool of sample ``p0/0`` never returns. At ``april_max_staleness: 1`` its group, carried from
step 1 with tokens of version 0, is due in step 2.
"""

from __future__ import annotations

import asyncio

import pytest
import yaml

from april_slime.core.buffer import PartialBuffer
from april_slime.core.config import AprilConfig, AprilConfigError
from april_slime.core.engine import EngineClient
from april_slime.core.episodes import EpisodeRunner
from april_slime.core.scheduler import RolloutScheduler
from april_slime.core.types import Group, Trajectory, TrajectoryStatus
from april_slime.job import read_settings
from april_workbench.emulator.testing import start_cluster
from april_workbench.emulator.vclock import run_virtual
from tests.support.hanging_tool import HangingToolAgent

HUNG = "p0/0"
DEADLINE_S = 600.0
N = 3  # samples per group: a masked one leaves two to normalise against


class Prompts:
    def __init__(self):
        self.made: list[str] = []

    def next_groups(self, k, current_version):
        out = []
        for _ in range(k):
            i = len(self.made)
            uid = f"p{i}"
            prompt = [10 + i, 11 + i, 12 + i, 13 + i]
            trajs = [Trajectory(uid=f"{uid}/{j}", group_uid=uid, index_in_group=j, prompt_ids=prompt,
                                max_new_tokens=64, sampling_seed=100 * i + j) for j in range(N)]
            out.append(Group(uid=uid, prompt_ids=prompt, trajectories=trajs, created_version=current_version))
            self.made.append(uid)
        return out


class Ledger:
    """Where every group handed out is: delivered once, buffered, or dropped with a reason."""

    def __init__(self, prompts: Prompts, buffer: PartialBuffer):
        self.prompts, self.buffer = prompts, buffer
        self.delivered: list[str] = []
        self.dropped: dict[str, str] = {}

    def step(self, sched: RolloutScheduler, result) -> None:
        self.delivered += [g.uid for g in result.groups]
        self.dropped.update(sched.last_dropped)
        delivered, buffered = set(self.delivered), {g.uid for g in self.buffer.groups()}
        assert len(delivered) == len(self.delivered), "a group was delivered twice"
        assert not delivered & buffered and not set(self.dropped) & (delivered | buffered)
        assert delivered | buffered | set(self.dropped) == set(self.prompts.made), "a group was lost"


async def _job(running, *, mask: bool, max_episode_failures: int = 2, deadline_s: float = DEADLINE_S):
    config = AprilConfig.from_dict({
        "policy": "copris", "concurrency": 6, "max_staleness": 1, "step_deadline_s": deadline_s,
        "mask_failed_samples": mask, "max_episode_failures": max_episode_failures})
    agent = HangingToolAgent(hang={HUNG})
    runner = EpisodeRunner(agent, max_failures=max_episode_failures, mask_failed=mask)
    agent.runner = runner
    client = EngineClient(running.engine_urls, transport=running.transport,
                          vocab_size=running.cluster.model.vocab_size)
    buffer = PartialBuffer.from_config(config)
    sched = RolloutScheduler(config, client, buffer, rollout_batch_size=2, n_samples_per_prompt=N,
                             sampling_params={"temperature": 1.0}, episodes=runner)
    return sched, agent, runner, buffer


async def _step(sched, prompts, ledger, running, version):
    running.cluster.bump_weight_version(version)
    # bounded: a step that waits for ever fails the test at 2 h of virtual time instead of hanging
    result = await asyncio.wait_for(sched.run_step(prompts, current_version=version), 2 * 3600)
    ledger.step(sched, result)
    return result


async def _due_after_step_one(running, **job):
    """Step 1 (version 0): ``p0/0`` is answered its first call, then its tool hangs; the target is
    met by other groups and p0 goes back to the buffer holding tokens of version 0."""
    sched, agent, runner, buffer = await _job(running, **job)
    prompts = Prompts()
    ledger = Ledger(prompts, buffer)
    first = await _step(sched, prompts, ledger, running, 0)
    assert first.metrics["april/deadline_failed_samples"] == 0
    assert agent.hung == [HUNG], "the tool of p0/0 never started hanging"
    assert "p0" in buffer, "p0 was not carried to step 2"
    assert runner.is_live(next(t for g in buffer.groups() for t in g.trajectories if t.uid == HUNG))
    assert next(g for g in buffer.groups() if g.uid == "p0").staleness(1) == 1  # due at version 1
    return sched, agent, runner, buffer, prompts, ledger


def _step_two_timing(result, sched):
    """Step 2 reached its target at the deadline, not before and not much after it."""
    t_target = result.metrics["april/time_to_target_s"]
    assert DEADLINE_S - 1e-3 <= t_target <= DEADLINE_S + 1.0, t_target
    assert result.metrics["april/step_time_s"] <= DEADLINE_S + sched.drain_timeout_s


def test_a_due_groups_hung_tool_is_masked_at_the_step_deadline():
    async def main():
        async with start_cluster(num_engines=2, seed=7, time_scale=1.0, http=False, length="short") as running:
            sched, agent, runner, buffer, prompts, ledger = await _due_after_step_one(running, mask=True)
            second = await _step(sched, prompts, ledger, running, 1)
            _step_two_timing(second, sched)
            m = second.metrics
            assert m["april/deadline_failed_samples"] == 1
            assert m["april/deadline_released_groups"] == 0
            assert m["april/episodes/masked"] == 1 and m["april/episodes/deadline_failures"] == 1
            p0 = next(g for g in second.groups if g.uid == "p0")  # trained in its step, masked
            statuses = {t.uid: t.status for t in p0.trajectories}
            assert statuses[HUNG] is TrajectoryStatus.FAILED and not p0.trajectories[0].response_ids
            assert all(s is TrajectoryStatus.COMPLETED for uid, s in statuses.items() if uid != HUNG)
            assert agent.hung == [HUNG], "a masked sample is not re-run"
            await _step(sched, prompts, ledger, running, 2)  # and the job goes on
            await runner.close()

    run_virtual(main())


@pytest.mark.parametrize("reruns", [0, 1], ids=["out-of-reruns", "a-rerun-left"])
def test_without_masking_a_hung_sample_is_given_up_or_rerun_at_the_deadline(reruns):
    """Out of re-runs, the sample is given up and its group dropped. With a re-run left, the
    sample is re-run from its prompt; the re-run cannot be trained in its step: p0 goes back to the
    buffer past its bound, and the next step's staleness fallback (restart) takes it, counted."""

    async def main():
        async with start_cluster(num_engines=2, seed=7, time_scale=1.0, http=False, length="short") as running:
            sched, agent, runner, buffer, prompts, ledger = await _due_after_step_one(
                running, mask=False, max_episode_failures=reruns)
            second = await _step(sched, prompts, ledger, running, 1)
            _step_two_timing(second, sched)
            m = second.metrics
            assert m["april/deadline_failed_samples"] == 1 and m["april/episodes/masked"] == 0
            assert m["april/deadline_released_groups"] == reruns
            assert m["april/episodes/given_up"] == m["april/episodes/failed_groups"] == 1 - reruns
            if reruns == 0:
                assert second.dropped == {"p0": "episode_failed"}
                assert "p0" not in {g.uid for g in second.groups} and "p0" not in buffer
            else:
                rerun = runner.episodes[HUNG]  # re-run from its prompt, its first call suspended at the target
                assert rerun.attempt == 1 and runner.is_live(rerun.member), "the failed sample was not re-run"
                assert "p0" in buffer and not second.dropped
                third = await _step(sched, prompts, ledger, running, 2)
                assert third.metrics["april/stale_restarted_groups"] == 1  # p0, past its bound
                assert third.metrics["april/deadline_failed_samples"] == 0
            await runner.close()

    run_virtual(main())


def test_with_the_deadline_off_the_same_step_waits_for_ever():
    """What the deadline guards against: with ``april_step_deadline_s: 0`` step 2 is still
    waiting for p0 after two hours (of virtual time)."""

    async def main():
        async with start_cluster(num_engines=2, seed=7, time_scale=1.0, http=False, length="short") as running:
            sched, agent, runner, buffer, prompts, ledger = await _due_after_step_one(
                running, mask=True, deadline_s=0.0)
            with pytest.raises(TimeoutError):
                await _step(sched, prompts, ledger, running, 1)
            await runner.close()

    run_virtual(main())


@pytest.mark.parametrize("text, why", [("-1", "finite number"), (".inf", "finite number"),
                                       ("an hour", "must be a number"), ("", "must not be empty")])
def test_a_bad_step_deadline_is_refused_naming_the_key(tmp_path, text, why):
    """As slime hands it over: every key of the custom YAML set on ``args``; ``null`` (an empty
    value) is refused too, not read as "off" (that is 0)."""
    path = tmp_path / "april.yaml"
    path.write_text(f"april_step_deadline_s: {text}\n", encoding="utf-8")

    class Args:
        custom_config_path = str(path)

    Args.april_step_deadline_s = yaml.safe_load(path.read_text(encoding="utf-8"))["april_step_deadline_s"]
    with pytest.raises(AprilConfigError, match=f"^april_step_deadline_s: .*{why}"):
        read_settings(Args())


def test_the_step_deadline_defaults_to_an_hour_and_zero_turns_it_off():
    assert AprilConfig().step_deadline_s == 3600.0
    assert AprilConfig.from_dict({"step_deadline_s": 0}).step_deadline_s == 0.0
