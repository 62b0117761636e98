"""Samples masked out of their group (``april_mask_failed_samples``), as slime's trainer receives them.

An episode given up for an infrastructure fault is masked instead of dropping its group
(``april_slime.core.episodes``): its trajectory is ``TrajectoryStatus.FAILED`` and holds no token.
Its slime sample (``SampleCodec``) is ``Sample.Status.FAILED`` with ``remove_sample`` set (slime
then zeroes its loss mask), one placeholder response token (the prompt's last, loss mask 0: slime's
trainer slices every response by its length, and a length of 0 would take the whole sequence) and a
reward of 0 that nothing reads: the reward function is not called on it, the dynamic filter does not
see it, and ``post_process_rewards`` leaves it out of its group's mean and std.

slime's own ``_post_process_rewards`` normalises over every sample of a group, and what its
``remove_sample`` does not change (slime's ``--rollout-sample-filter-path`` help says so);
``post_process_rewards`` is the same group normalisation over the unmasked samples only, for slime's
``--custom-reward-post-process-path``.
"""

from __future__ import annotations

import math
from typing import Any

from april_slime.job_checks import GROUP_NORMALISED_ESTIMATORS
from april_slime.slime_args import SlimeArgs

STD_ESTIMATORS = ("grpo", "gspo", "cispo")  # those slime divides by the group's std (--grpo-std-normalization)
STD_EPSILON = 1e-6  # slime's


def is_masked(sample: Any) -> bool:
    """Whether ``sample`` was masked out of its group (a failed sample the plugin kept)."""
    return bool(getattr(sample, "remove_sample", False)) and getattr(sample.status, "value", None) == "failed"


def masked_reward(reward_key: str | None) -> Any:
    """The reward a masked sample carries: of the shape slime reads (``--reward-key``), never used."""
    return {reward_key: 0.0} if reward_key else 0.0


def _groups(count: int, n: int, batch: int) -> list[range]:
    """slime's groups: consecutive runs of ``n_samples_per_prompt`` when the batch is whole groups,
    else one group of every sample (as its ``_post_process_rewards`` reshapes them)."""
    if count == n * batch:
        return [range(start, start + n) for start in range(0, count, n)]
    return [range(count)]


def post_process_rewards(args: Any, samples: list[Any]) -> tuple[list[float], list[float]]:
    """slime ``--custom-reward-post-process-path``: ``(raw rewards, rewards)`` as slime's own
    reward post-processing returns them, each group's mean (and std, for the estimators slime
    divides by it) taken over its unmasked samples only; a masked sample's reward is 0."""
    slime = SlimeArgs.read(args)
    raw = [s.get_reward_value(args) for s in samples]  # slime's own method reads its arguments
    if not (slime.advantage_estimator in GROUP_NORMALISED_ESTIMATORS and slime.rewards_normalization):
        return raw, list(raw)
    divide = slime.advantage_estimator in STD_ESTIMATORS and slime.grpo_std_normalization
    rewards = [0.0] * len(samples)
    for group in _groups(len(samples), slime.n_samples_per_prompt, slime.rollout_batch_size):
        kept = [i for i in group if not is_masked(samples[i])]
        if not kept:
            continue
        values = [float(raw[i]) for i in kept]
        mean = math.fsum(values) / len(values)
        # slime's torch.std: the unbiased estimate; a single kept sample has no spread
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
        for i, v in zip(kept, values):
            rewards[i] = (v - mean) / (std + STD_EPSILON) if divide else v - mean
    return raw, rewards
