"""``april_mask_failed_samples``: an episode given up for an infrastructure fault is masked out of its
group instead of dropping the group; the group's other samples train.

The job-level tests run inside slime (real where importable, else the stand-in) on emulated engines
with ``tests.support.agent_functions.multi_turn``; the reward post-processing is checked against
group statistics computed here, independently, over the unmasked members only. slime's own reward
and loss path with a masked member: ``tests/real/training/test_slime_masked_samples.py``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from types import SimpleNamespace

import pytest
import torch

from april_slime import rollout
from april_slime.core.config import MASKING_POST_PROCESS, AprilConfig, AprilConfigError
from april_slime.core.keys import MASKED_MEMBERS_KEY, OPOB_GROUP_KEY
from april_slime.job_checks import check_rollout_shape
from april_slime.masking import post_process_rewards
from april_slime.slime_args import SlimeArgs
from april_slime.vcpo import opob_advantages
from tests.support import agent_functions as af
from tests.support import slime_standin
from tests.support.agent_functions import check_sample
from tests.support.slime_jobs import N, make_args, point_at, run_steps

FUNCTION = "tests.support.agent_functions.multi_turn"


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(f'{{"prompt": "question {i:02d}", "label": "{i}"}}\n' for i in range(200)))
    af.reset()
    yield path
    af.reset()


@pytest.mark.parametrize("fault", ["raise", "corrupt", "hang"])
def test_a_sample_given_up_for_an_infrastructure_fault_is_masked_and_its_group_trains(cluster, tmp_path, prompts,
                                                                                     fault):
    """Sample 0's only run fails (its function raises, returns tokens it was not served, or its tool
    passes the deadline): it is masked, and its group trains with the two other samples."""
    # the deadline is far above any tool phase of the healthy samples, on a loaded machine too (their
    # tools return at once): only the hung one can pass it
    timeout = {"april_episode_tool_timeout_s": 5.0} if fault == "hang" else {}
    args = point_at(make_args(tmp_path, prompts, custom_generate_function_path=FUNCTION, april_policy="copris",
                              april_concurrency=6, april_max_episode_failures=0, april_mask_failed_samples=True,
                              **timeout), cluster)
    source = rollout.AprilDataSource(args)
    af.CONTROL[fault][0] = 1
    samples, totals = {}, {}
    for step in range(12):
        run_steps(args, source, cluster, [step], samples=samples, totals=totals)
        if 0 in samples:
            break
        runner = rollout._RUNTIME.episodes
        deadline = time.monotonic() + 60  # the fault happens on the job's loop, between steps too
        while runner.counters.masked == 0:
            assert time.monotonic() < deadline, "sample 0 was never masked"
            time.sleep(0.05)
    assert 0 in samples, "the group of the masked sample never trained"
    masked = samples[0]
    assert masked.status.value == "failed" and masked.remove_sample
    assert masked.response_length == 1 and masked.loss_mask == [0] and masked.tokens[-1] == masked.tokens[-2]
    for index in (1, 2):  # the group's other samples, as any trained sample
        check_sample(samples[index], version_floor=1)
    for index in (0, 1, 2):  # what VCPO's group baseline reads on the trainer
        assert samples[index].train_metadata[MASKED_MEMBERS_KEY] == [0]
    failed = [s for s in samples.values() if s.status.value == "failed"]
    assert all(s.remove_sample and not any(s.loss_mask) for s in failed)
    assert totals["april/masked_samples"] == len(failed) >= 1
    assert totals["april/episodes/masked"] >= 1 and totals["april/episodes/failed_groups"] == 0
    if fault != "hang":  # a starved loop may pass another episode's short tool deadline too
        assert len(failed) == 1 and totals["april/episodes/given_up"] == 1


def test_without_the_setting_the_group_is_dropped(cluster, tmp_path, prompts):
    args = point_at(make_args(tmp_path, prompts, custom_generate_function_path=FUNCTION, april_policy="copris",
                              april_concurrency=6, april_max_episode_failures=0), cluster)
    source = rollout.AprilDataSource(args)
    af.CONTROL["raise"][0] = 1
    samples, totals = run_steps(args, source, cluster, range(3))
    assert not {0, 1, 2} & set(samples) and totals["april/episodes/failed_groups"] == 1
    assert totals["april/masked_samples"] == 0


def test_a_group_left_with_one_unmasked_sample_is_dropped(cluster, tmp_path, prompts):
    """Two of the three samples fail: one sample has nothing to be normalised against."""
    args = point_at(make_args(tmp_path, prompts, custom_generate_function_path=FUNCTION, april_policy="copris",
                              april_concurrency=6, april_max_episode_failures=0, april_mask_failed_samples=True),
                    cluster)
    source = rollout.AprilDataSource(args)
    af.CONTROL["raise"][0] = af.CONTROL["raise"][1] = 1
    samples, totals = run_steps(args, source, cluster, range(3))
    assert not {0, 1, 2} & set(samples) and totals["april/episodes/failed_groups"] == 1
    assert totals["april/episodes/masked"] == 2


# ---------------------------------------------------------------------------- reward post-processing
def _samples(rewards, masked, reward_key=None):
    out = []
    for i, r in enumerate(rewards):
        s = slime_standin.Sample(index=i, reward={reward_key: r} if reward_key else r,
                                 status=slime_standin.Sample.Status.COMPLETED)
        if i in masked:
            s.status, s.remove_sample, s.reward = slime_standin.Sample.Status.FAILED, True, (
                {reward_key: 0.0} if reward_key else 0.0)
        out.append(s)
    return out


def _args(**kw):
    values = dict(n_samples_per_prompt=4, rollout_batch_size=3, advantage_estimator="grpo",
                  rewards_normalization=True, grpo_std_normalization=True, reward_key=None)
    values.update(kw)
    return SimpleNamespace(**values)


@pytest.mark.parametrize("estimator, std", [("grpo", True), ("grpo", False), ("reinforce_plus_plus_baseline", False)])
def test_group_normalisation_leaves_the_masked_members_out(estimator, std):
    rewards = [1.0, 0.0, 1.0, 1.0, 0.3, 0.9, 0.2, 0.7, 0.0, 1.0, 0.5, 0.25]
    masked = {2, 5, 11}
    args = _args(advantage_estimator=estimator, grpo_std_normalization=std, reward_key="acc")
    raw, normalised = post_process_rewards(args, _samples(rewards, masked, reward_key="acc"))
    assert len(raw) == len(normalised) == len(rewards)
    for start in range(0, 12, 4):
        kept = [i for i in range(start, start + 4) if i not in masked]
        values = [rewards[i] for i in kept]
        mean = statistics.mean(values)
        spread = statistics.stdev(values) if std else None
        for i in kept:
            expected = (rewards[i] - mean) / (spread + 1e-6) if std else rewards[i] - mean
            assert normalised[i] == pytest.approx(expected, rel=1e-9, abs=1e-12), i
            assert raw[i] == rewards[i]
        for i in set(range(start, start + 4)) - set(kept):
            assert normalised[i] == 0.0


def test_without_group_normalisation_the_rewards_pass_through():
    rewards = [1.0, 0.0, 1.0, 0.5]
    raw, out = post_process_rewards(_args(rollout_batch_size=1, rewards_normalization=False), _samples(rewards, {1}))
    assert raw == out == [1.0, 0.0, 1.0, 0.5]


def test_slimes_group_normalisation_without_the_post_process_is_refused():
    normalising = SlimeArgs(advantage_estimator="grpo", rewards_normalization=True)
    config = AprilConfig(mask_failed_samples=True)
    with pytest.raises(AprilConfigError, match=f"mask_failed_samples: .*{MASKING_POST_PROCESS}"):
        check_rollout_shape(normalising, config)
    check_rollout_shape(dataclasses.replace(normalising, custom_reward_post_process_path=MASKING_POST_PROCESS), config)
    check_rollout_shape(normalising, AprilConfig())
    assert N == 3  # the job tests above rely on groups of three


def test_vcpos_group_std_leaves_the_masked_members_out():
    """``vcpo.opob_advantages`` (the group baseline's std, population) over the unmasked members of
    each group, as the samples' metadata names them; the step's gradient with a masked member:
    ``tests/test_vcpo_opob.py``."""
    raw = [1.0, 0.0, 1.0, 0.25, 0.5, 0.5, 0.0, 1.0]
    masked = {0: [2], 1: []}  # group -> its masked members
    data = {"raw_reward": raw, "partition": list(range(8)), "kl": [torch.zeros(2)] * 8,
            "metadata": [{MASKED_MEMBERS_KEY: masked[i // 4]} if masked[i // 4] else None for i in range(8)]}
    opob_advantages(SimpleNamespace(n_samples_per_prompt=4), data)
    for i, entry in enumerate(data["metadata"]):
        group = i // 4
        kept = [raw[4 * group + k] for k in range(4) if k not in masked[group]]
        assert entry[OPOB_GROUP_KEY]["reward_std"] == pytest.approx(statistics.pstdev(kept), rel=1e-12)
        assert entry[OPOB_GROUP_KEY]["group"] == group and entry[OPOB_GROUP_KEY]["size"] == 4


def test_a_masked_sample_carries_replay_fields_of_the_shapes_training_reads():
    """Under routing / top-p / top-k replay a masked member has no engine rows: it gets placeholders
    of the shapes slime checks, which the plugin's own reading accepts as covering the sample."""
    from april_slime.core.replay import ReplaySpec
    from april_slime.samples import put_placeholder_replay, take_replay

    spec = ReplaySpec(routed_layers=2, routed_topk=3, top_p=True, top_p_log_probs=True, topk=4)
    s = SimpleNamespace(tokens=[5, 6, 7, 7], response_length=1)
    put_placeholder_replay(s, spec)
    assert tuple(s.rollout_routed_experts.shape) == (3, 2, 3)  # tokens - 1 rows
    assert all(sorted(row.tolist()) == [0, 1, 2] for row in s.rollout_routed_experts.reshape(-1, 3))
    replay = take_replay(s, spec)
    assert replay is not None and replay.covers(spec, prompt_len=3, response_len=1) is None
