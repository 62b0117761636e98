"""Cross-rank ESS reduction with torch.distributed (gloo, 2 processes)."""

import math

import pytest
import torch
import torch.distributed as dist

from april_slime.training.ess import effective_sample_size
from tests.support.gloo import run_on_gloo_ranks

WORLD = 2
# rank 1 holds the dominant weight, so a rank-local ESS would differ from the global one
LOG_WEIGHTS = {0: [0.1, -0.3, 0.2], 1: [-0.5, 40.0, 0.0, 0.3]}
VALID = {0: [True, True, False], 1: [True, True, True, True]}


def _worker(rank: int, world: int):
    lw = torch.tensor(LOG_WEIGHTS[rank], dtype=torch.float32)
    valid = torch.tensor(VALID[rank])
    default = effective_sample_size(lw, valid=valid)
    group = dist.new_group([0, 1])
    grouped = effective_sample_size(lw, valid=valid, group=group)
    local = effective_sample_size(lw, valid=valid, reduce=False)
    return default.ess, default.ess_ratio, default.num_samples, grouped.ess, local.num_samples


def test_ess_is_reduced_across_ranks():
    results = run_on_gloo_ranks(_worker, WORLD)
    weights = [math.exp(x) for r in range(WORLD) for x, v in zip(LOG_WEIGHTS[r], VALID[r]) if v]
    expected = sum(weights) ** 2 / sum(w * w for w in weights)
    for rank in range(WORLD):
        ess, ratio, n, grouped_ess, local_n = results[rank]
        assert n == len(weights) == 6
        assert ess == pytest.approx(expected, rel=1e-6)
        assert ratio == pytest.approx(expected / 6, rel=1e-6)
        assert grouped_ess == pytest.approx(expected, rel=1e-6)
        assert local_n == sum(VALID[rank])
