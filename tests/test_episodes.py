"""Multi-turn jobs: a slime custom generate function runs unchanged under every policy, its model
calls are scheduled (and aborted and resumed) by the plugin, and its samples carry exact data.

Runs inside slime (real where importable, else the stand-in) on emulated engines; the function is
``tests.support.agent_functions.multi_turn`` (model call, tool, model call, tool, model call).
"""

from __future__ import annotations

import time

import pytest

from april_slime import rollout
from april_slime.core.keys import TOKEN_VERSIONS_KEY
from tests.support import agent_functions as af
from tests.support.agent_functions import check_sample, expand
from tests.support.slime_jobs import make_args, point_at, run_steps

FUNCTION = "tests.support.agent_functions.multi_turn"


@pytest.fixture
def prompts(tmp_path):
    yield af.prompts_file(tmp_path)
    af.reset()


def job(tmp_path, prompts, cluster, **settings):
    settings.setdefault("custom_generate_function_path", FUNCTION)
    args = point_at(make_args(tmp_path, prompts, **settings), cluster)
    return args, rollout.AprilDataSource(args)


@pytest.mark.parametrize("policy", ["sync", "april", "copris"])
def test_a_custom_generate_function_runs_unchanged_under_every_policy(cluster, tmp_path, prompts, policy):
    args, source = job(tmp_path, prompts, cluster, april_policy=policy, april_concurrency=6)
    _, totals = run_steps(args, source, cluster, range(3), check=lambda s: check_sample(s, version_floor=1))
    # the function asserts itself that it never saw an abort; every call it counted was answered (a
    # reply answered at a step's end may still be on its way to the function)
    assert totals["april/episodes/calls"] >= sum(af.CALLS.values()) > 0


def test_calls_cut_at_the_target_are_resumed_next_step_inside_the_same_call(cluster, tmp_path, prompts):
    """copris with more episodes than the target: at the target the calls in flight are aborted,
    their episodes wait (suspended) and the next step resumes them; the function receives one
    reply per call, whose tokens span two policy versions. An abort can find a call still queued
    (nothing to keep), so steps go on, at most 10, until a resumed call kept tokens of both."""
    args, source = job(tmp_path, prompts, cluster, april_policy="copris", april_concurrency=12)
    spanning, suspended = [], 0
    for step in range(10):
        cluster.bump(step + 1)
        out = rollout.generate_rollout(args, step, source)
        suspended += out.metrics["april/episodes/suspended"]
        for group in out.samples:
            for s in group:
                check_sample(s, version_floor=1)
                versions = expand(s.train_metadata[TOKEN_VERSIONS_KEY])
                if s.metadata["april_num_aborts"] > 0 and len(set(versions)) > 1:
                    spanning.append(s)
        if suspended and spanning:
            break
    assert suspended > 0, "no call was left pending at a step's end"
    assert spanning, "no call resumed across a step reached a trained sample with both versions"


def test_a_failing_function_reruns_its_sample_alone(cluster, tmp_path, prompts):
    args, source = job(tmp_path, prompts, cluster, april_policy="copris", april_concurrency=6)
    af.CONTROL["raise"][0] = 1  # sample 0 loses its sandbox once
    cluster.bump(1)
    out = rollout.generate_rollout(args, 0, source)
    assert out.metrics["april/episodes/failures"] == 1
    samples = {s.index: s for g in out.samples for s in g}
    assert 0 in samples  # its group still trained, with the re-run sample
    check_sample(samples[0], version_floor=1)


def test_a_function_whose_tokens_do_not_match_its_calls_is_given_up_with_its_group(cluster, tmp_path, prompts):
    args, source = job(tmp_path, prompts, cluster, april_policy="copris", april_concurrency=6,
                       april_max_episode_failures=1)
    af.CONTROL["corrupt"][0] = 2  # sample 0 alters a token of its calls, twice
    samples, totals = run_steps(args, source, cluster, range(4))
    assert totals["april/episodes/failures"] == 2
    assert totals["april/episodes/given_up"] == 1
    assert totals["april/episodes/failed_groups"] == 1
    assert not {0, 1, 2} & set(samples), "the given-up group was trained"
    assert af.CONTROL["corrupt"][0] == 0


def test_a_hung_tool_is_ended_by_the_tool_deadline_and_rerun(cluster, tmp_path, prompts):
    """The tool of sample 1 never returns: the deadline ends the episode (between steps, as the
    loop runs) and it is re-run alone; the wait is for that event, bounded."""
    # the deadline is far above any healthy tool phase, on a loaded machine too: only the hung one passes it
    args, source = job(tmp_path, prompts, cluster, april_policy="copris", april_concurrency=6,
                       april_episode_tool_timeout_s=5.0)
    af.CONTROL["hang"][1] = 1
    samples, totals = run_steps(args, source, cluster, range(1))
    runner = rollout._RUNTIME.episodes
    deadline = time.monotonic() + 60
    while runner.counters.timeouts == 0:
        assert time.monotonic() < deadline, "the tool deadline never fired"
        time.sleep(0.05)
    more, more_totals = run_steps(args, source, cluster, range(1, 4))
    # the hung tool's timeout, counted once; on a starved machine another episode's tool phase (the
    # loop's own delays included) can pass the short deadline too, and is re-run the same way
    assert totals.get("april/episodes/timeouts", 0) + more_totals["april/episodes/timeouts"] >= 1
    assert af.CONTROL["hang"][1] == 0
    samples.update(more)
    assert 1 in samples, "the re-run sample never trained"
    check_sample(samples[1], version_floor=1)


def test_a_stale_suspended_episode_is_restarted_from_its_prompt(cluster, tmp_path, prompts):
    """max_staleness 1 and the versions jumping by 2 between two steps (what the staleness pacing
    cannot foresee): a group buffered with episodes (suspended in a call or in a tool, or finished
    between steps) is past the bound at the next step, so its episodes start again from the prompt
    (counted), and nothing trained lags more than 1 version."""
    args, source = job(tmp_path, prompts, cluster, april_policy="copris", april_concurrency=12,
                       april_max_staleness=1)
    samples, totals = run_steps(args, source, cluster, range(1))
    more, later = run_steps(args, source, cluster, range(2, 5))
    samples.update(more)
    assert later["april/episodes/restarted"] > 0 and later["april/stale_fallback_groups"] > 0
    for s in samples.values():
        versions = expand(s.train_metadata[TOKEN_VERSIONS_KEY])
        assert s.train_metadata["april_policy_version"] - min(versions) <= 1


def test_concurrent_calls_of_one_episode_are_scheduled_aborted_and_resumed(cluster, tmp_path, prompts):
    """A function that awaits two model calls together (``asyncio.gather``): both are scheduled,
    aborted at a step's target and resumed like sequential calls, also those made in the pause
    between two steps, and its sample carries the three calls' tokens with their exact versions.
    Steps go on (at most 10) until a call of a trained sample was aborted and resumed."""
    args, source = job(tmp_path, prompts, cluster, april_policy="copris", april_concurrency=12,
                       custom_generate_function_path="tests.support.agent_functions.concurrent_turns")
    resumed, trained = 0, 0
    for step in range(10):
        cluster.bump(step + 1)
        out = rollout.generate_rollout(args, step, source)
        assert out.metrics["april/episodes/failures"] == 0, "a concurrent call was refused or mismatched"
        for group in out.samples:
            for s in group:
                trained += 1
                assert s.loss_mask.count(0) == len(af.TOOL_TOKENS)
                versions = expand(s.train_metadata[TOKEN_VERSIONS_KEY])
                assert len(versions) == s.response_length
                assert all(1 <= v <= s.train_metadata["april_policy_version"] for v in versions)
                resumed += s.metadata["april_num_aborts"] > 0
        # the pause between rollouts (slime's training step): the episodes make their calls, which
        # wait for the next step; it ends once no live episode is between two calls
        runner = rollout._RUNTIME.episodes
        deadline = time.monotonic() + 60
        while any(e.live and not e.pending for e in runner.episodes.values()):
            assert time.monotonic() < deadline, "an episode never made its next call"
            time.sleep(0.01)
        if resumed and step >= 2:
            break
    assert trained >= 3 * args.rollout_batch_size * args.n_samples_per_prompt
    assert resumed, "no call of a trained sample was aborted and resumed"


GIVEN_UP_GUARD = 60  # far more episodes given up than a bound of 3 lets through: the bound does not work


def test_a_function_that_always_fails_stops_the_job_naming_it(cluster, tmp_path, prompts, monkeypatch):
    """slime's own rollout stops at a function's first error; under the plugin the episodes are
    re-run and given up, and once ``april_max_given_up_in_a_row`` are given up in a row the step
    ends with an error naming the function and its last failure (not an endless step).

    Without the bound the step would draw prompts for ever (slime's data source cycles epochs): a
    guard ends the step once ``GIVEN_UP_GUARD`` episodes were given up (counted from the runner,
    raised where the step opens its next group), so a broken bound fails here instead of hanging."""
    from april_slime.core.episodes import EpisodeWork

    open_group = EpisodeWork.open_group

    def guarded(self, group):
        given_up = self.runner.counters.given_up
        assert given_up < GIVEN_UP_GUARD, f"{given_up} episodes given up and the step goes on: no bound stopped it"
        return open_group(self, group)

    monkeypatch.setattr(EpisodeWork, "open_group", guarded)
    function = "tests.support.agent_functions.always_raises"
    args, source = job(tmp_path, prompts, cluster, april_policy="copris", april_concurrency=6,
                       april_max_episode_failures=1, april_max_given_up_in_a_row=3,
                       custom_generate_function_path=function)
    cluster.bump(1)
    with pytest.raises(Exception) as failed:
        rollout.generate_rollout(args, 0, source)
    message = str(failed.value)
    assert function in message and "ConnectionError: tool server unreachable" in message, message
    assert "3 episodes in a row" in message and "\n" not in message
    runner = rollout._RUNTIME.episodes
    assert runner.counters.given_up >= 3 and runner.counters.failures >= 6


def test_given_up_episodes_with_successes_between_them_do_not_stop_the_job(cluster, tmp_path, prompts):
    """The bound counts given-up episodes in a row: one finished episode between them resets it,
    and the step's metrics show where it stands."""
    args, source = job(tmp_path, prompts, cluster, april_policy="copris", april_concurrency=6,
                       april_max_episode_failures=0, april_max_given_up_in_a_row=2)
    af.CONTROL["raise"][0] = 1
    # group 13 opens only once at least nine groups were settled, so after episodes finished
    af.CONTROL["raise"][40] = 1
    samples, totals = run_steps(args, source, cluster, range(5))
    assert totals["april/episodes/given_up"] == 2
    assert "april/episodes/given_up_in_a_row" in totals
    assert rollout._RUNTIME.episodes.given_up_in_a_row < 2


def test_a_function_without_rollout_log_probs_is_refused_at_its_first_sample(cluster, tmp_path, prompts):
    """slime's tau-bench returns samples without ``rollout_log_probs`` (it trains re-tokenized text):
    the plugin cannot give their tokens the versions and log-probs they were served with, and a re-run
    cannot change that, so the first such sample stops the job, before anything trains, with one line
    saying why."""
    function = "tests.support.agent_functions.without_log_probs"
    args, source = job(tmp_path, prompts, cluster, april_policy="april", april_concurrency=6,
                       custom_generate_function_path=function)
    cluster.bump(1)
    with pytest.raises(Exception) as refused:
        rollout.generate_rollout(args, 0, source)
    message = str(refused.value)
    assert function in message and "no rollout_log_probs" in message and "\n" not in message, message
    runner = rollout._RUNTIME.episodes
    assert runner.counters.refused >= 1 and runner.counters.failures == 0, "the function was re-run"


def test_string_statuses_are_trained_as_slime_trains_them(cluster, tmp_path, prompts):
    """tau-bench sets ``sample.status`` to a string ("completed", "truncated", "aborted"), which
    slime trains as it is: so does the plugin ("truncated" as a truncation)."""
    args, source = job(tmp_path, prompts, cluster, april_policy="copris", april_concurrency=6,
                       custom_generate_function_path="tests.support.agent_functions.string_status")
    samples, totals = run_steps(args, source, cluster, range(2))
    assert totals["april/episodes/failures"] == 0
    assert len(samples) == 2 * args.rollout_batch_size * args.n_samples_per_prompt
    for s in samples.values():
        check_sample(s, version_floor=1)
        expected = af.STRING_STATUSES[s.index % len(af.STRING_STATUSES)]
        assert s.status.name == ("TRUNCATED" if expected == "truncated" else "COMPLETED"), (s.index, s.status)


def test_copris_keeps_the_live_episodes_within_april_max_live_episodes(cluster, tmp_path, prompts, monkeypatch):
    """An episode in a tool holds no call, so copris's N' alone would open another group for every
    tool phase: ``april_max_live_episodes`` bounds the episodes alive at once, in a call or in a
    tool. The first two groups' episodes hang in their first tool (tools that never return), which
    frees all of N' = 6 while 6 episodes stay alive: under the cap of 9 one more group opens at a
    time (9 alive), without it two (12). Counted at every episode start, and as ``episodes/live``."""
    from april_slime.core.episodes import EpisodeRunner

    live_at_start = []
    launch = EpisodeRunner._launch

    def counting_launch(self, episode):
        launch(self, episode)
        live_at_start.append(self.live)

    monkeypatch.setattr(EpisodeRunner, "_launch", counting_launch)
    hung = range(6)  # the samples of groups 0 and 1 (3 each)
    for index in hung:
        af.CONTROL["hang"][index] = 1
    args, source = job(tmp_path, prompts, cluster, april_policy="copris", april_concurrency=6,
                       april_max_live_episodes=9)
    assert args.n_samples_per_prompt == 3
    cluster.bump(1)
    out = rollout.generate_rollout(args, 0, source)
    assert len(out.samples) == args.rollout_batch_size
    assert all(af.CONTROL["hang"][i] == 0 for i in hung), "the first two groups never reached their tools"
    assert max(live_at_start) == 9, str(live_at_start)  # the cap is reached, and never passed
    runner = rollout._RUNTIME.episodes
    assert out.metrics["april/episodes/live"] == runner.live <= 9
    assert runner.live >= 6  # the hung episodes are still alive
