"""Training tier: a sample masked out of its group (``april_mask_failed_samples``) through slime's real
reward post-processing, data path and loss_function (CPU, gloo; see slime_cpu.py).

The masked sample is the plugin's own (``SampleCodec`` of a ``FAILED`` trajectory) in a batch of two
groups of four. The reference is computed here, independently, on the remaining members only: their
group-normalised rewards (``statistics``), and slime's loss and gradients over a batch without the
masked sample whose rewards are those reference advantages (slime's normalisation off).
"""

from __future__ import annotations

import copy
import statistics

import pytest
import torch

from april_slime.core.config import AprilConfig
from april_slime.core.replay import ReplaySpec
from april_slime.core.types import Group, Trajectory, TrajectoryStatus
from april_slime.masking import post_process_rewards
from april_slime.samples import SampleCodec, Slime, plain
from april_slime.slime_args import SlimeArgs
from tests.support.training import slime_cpu as sc

pytestmark = pytest.mark.real

N, PROMPTS, MASKED = 4, 2, 1  # sample 1 of group 0 is masked


@pytest.fixture(scope="module")
def world():
    with sc.gloo_world():
        yield


def masked_sample(like):
    """The plugin's sample of a member masked out of ``like``'s group (its prompt, version 4)."""
    codec_args = SlimeArgs(n_samples_per_prompt=N, rollout_max_response_len=8, rollout_seed=1)
    prompt_ids = like.tokens[:len(like.tokens) - like.response_length]
    prompt = like.to_dict()
    prompt.update(tokens=[], response="", response_length=0, loss_mask=None, rollout_log_probs=None, reward=None)
    t = Trajectory(uid=f"{like.group_index}/{MASKED}", group_uid=str(like.group_index), index_in_group=MASKED,
                   prompt_ids=prompt_ids, max_new_tokens=8, sampling_seed=0, status=TrajectoryStatus.FAILED)
    group = Group(uid=str(like.group_index), prompt_ids=prompt_ids, trajectories=[t],
                  payload={"prompt_sample": plain(prompt), "group_index": like.group_index,
                           "indices": list(range(N))})
    return SampleCodec(Slime(), AprilConfig(), codec_args, ReplaySpec()).sample(group, t, current_version=4)


def batch(seed=0):
    model = sc.TokenwiseLM(seed=seed)
    samples = sc.make_samples(seed=seed, num_prompts=PROMPTS, per_prompt=N, model=model)
    for s in samples:  # rewards with spread in every group
        s.reward = float((s.index * 7) % 5) / 4
    samples[MASKED] = masked_sample(samples[MASKED])
    return model, samples


def reference_advantages(samples):
    """Each group's GRPO advantage over its unmasked members only (slime's unbiased std, 1e-6)."""
    out = {}
    for start in range(0, len(samples), N):
        kept = [s for s in samples[start:start + N] if s.index != MASKED]
        values = [s.reward for s in kept]
        mean, std = statistics.mean(values), statistics.stdev(values)
        out.update({s.index: (s.reward - mean) / (std + 1e-6) for s in kept})
    return out


def by_index(data, key):
    return dict(zip(data["sample_indices"], data[key]))


def test_the_masked_member_is_left_out_of_slimes_reward_normalisation_and_loss(world):
    # an entropy term: a sample's loss mask, not only its advantage of 0, keeps it out of the loss
    args = sc.make_args(n_samples_per_prompt=N, rollout_batch_size=PROMPTS, global_batch_size=N * PROMPTS,
                        entropy_coef=0.01)
    model, samples = batch()
    assert samples[MASKED].status.value == "failed" and samples[MASKED].remove_sample
    expected = reference_advantages(samples)

    data = sc.rollout_to_trainer(args, copy.deepcopy(samples), reward_post_process=post_process_rewards)
    rewards = by_index(data, "rewards")
    for index, advantage in expected.items():
        assert rewards[index] == pytest.approx(advantage, rel=1e-5, abs=1e-6), index
    assert rewards[MASKED] == 0.0
    assert not by_index(data, "loss_masks")[MASKED].any()  # slime zeroed it (remove_sample)
    # slime's own post-processing counts the masked member in its group's mean and std
    default = by_index(sc.rollout_to_trainer(args, copy.deepcopy(samples)), "rewards")
    assert any(abs(default[i] - expected[i]) > 1e-3 for i in range(N) if i != MASKED)

    # slime's loss and gradients: the masked member contributes nothing, the others exactly their terms
    sc.recompute_log_probs(args, model, data)
    got_metrics, got_grads = sc.train_step(args, model, data)
    remaining = [copy.deepcopy(s) for s in samples if s.index != MASKED]
    for s in remaining:
        s.reward = expected[s.index]
    ref_args = sc.make_args(n_samples_per_prompt=N, rollout_batch_size=PROMPTS, global_batch_size=len(remaining),
                            rewards_normalization=False, entropy_coef=0.01)
    ref_data = sc.rollout_to_trainer(ref_args, remaining)
    sc.recompute_log_probs(ref_args, model, ref_data)
    ref_metrics, ref_grads = sc.train_step(ref_args, model, ref_data)
    # slime divides the step's sums by its sample count, in which the masked member still counts
    scale = len(remaining) / (N * PROMPTS)
    for key in ("pg_loss", "entropy_loss"):
        assert got_metrics[key] == pytest.approx(ref_metrics[key] * scale, rel=1e-5, abs=1e-7), key
    for name, g in ref_grads.items():
        torch.testing.assert_close(got_grads[name], g * scale, rtol=1e-5, atol=1e-7, msg=name)
    assert any(g.abs().max() > 0 for g in ref_grads.values())
