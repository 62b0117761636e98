"""VCPO cross-rank reductions on two gloo processes: the global OPOB baseline over data-parallel
ranks, the ESS statistics, TP sums of partial per-sample norms of a manually sharded model (from
the layer hooks and from the gradient buffer of a one-sample micro-batch)."""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from april_slime.training.baseline import OpobAccumulator, OpobOptions, SampleGroups
from april_slime.training.ess import EssLrScaler, EssStats
from april_slime.training.grad_norms import PerSampleGradNorms, reduce_per_sample_sq_norms
from april_slime.training.offpolicy import Packing
from tests.support.gloo import run_on_gloo_ranks

D, H = 6, 8
PAPER = OpobOptions(scope="global", weights="paper", length_norm=False)


class _AllReduceSum(torch.autograd.Function):
    """Megatron's reduce_from_tensor_model_parallel_region: sum forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class _CopyToTP(torch.autograd.Function):
    """copy_to_tensor_model_parallel_region: identity forward, sum of input grads backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


class ColumnParallelLinear(nn.Linear):
    def forward(self, x):
        return super().forward(_CopyToTP.apply(x))


class RowParallelLinear(nn.Linear):
    def forward(self, x):
        return _AllReduceSum.apply(nn.functional.linear(x, self.weight)) + self.bias


class FullMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x):
        return self.down(torch.tanh(self.up(self.norm(x))))


class ShardedMLP(nn.Module):
    def __init__(self, full: FullMLP, rank: int, world: int):
        super().__init__()
        h = H // world
        rows = slice(rank * h, (rank + 1) * h)
        self.norm = nn.LayerNorm(D).double()  # replicated: counted on TP rank 0 only
        self.norm.load_state_dict(full.norm.state_dict())
        self.up = ColumnParallelLinear(D, h).double()
        self.down = RowParallelLinear(h, D).double()
        with torch.no_grad():
            self.up.weight.copy_(full.up.weight[rows])
            self.up.bias.copy_(full.up.bias[rows])
            self.down.weight.copy_(full.down.weight[:, rows])
            self.down.bias.copy_(full.down.bias)  # replicated
        for p in (self.up.weight, self.up.bias, self.down.weight):
            p.tensor_model_parallel = True

    def forward(self, x):
        return self.down(torch.tanh(self.up(self.norm(x))))


def _per_sample_norms(model, x, seg, n, tp_rank=0, tp_size=1):
    tracker = PerSampleGradNorms(model, tp_rank=tp_rank, tp_size=tp_size)
    tracker.set_microbatch(seg, n)
    model(x).pow(2).sum().backward()
    tracker.remove()
    return tracker.last_sq_norms.clone()


def _worker(rank, world):
    torch.manual_seed(0)
    full = FullMLP().double()
    with torch.no_grad():
        full.norm.weight.add_(0.2 * torch.randn(D, dtype=torch.float64))
    lengths = [5, 2, 4]
    x = torch.randn(3, 5, D, dtype=torch.float64)
    seg = Packing.from_lengths(lengths).padded_segment_ids(5)
    ref = _per_sample_norms(full, x, seg, 3)  # every rank computes the unsharded reference

    # --- tensor parallel: partial norms of the shards add up to the full per-sample norms
    sharded = ShardedMLP(full, rank, world)
    partial = _per_sample_norms(sharded, x, seg, 3, tp_rank=rank, tp_size=world)
    assert not torch.allclose(partial, ref)
    total = reduce_per_sample_sq_norms(partial.clone())
    torch.testing.assert_close(total, ref, rtol=1e-10, atol=0)

    # --- one-sample micro-batches: the norm read off the gradient buffer sums over the TP shards
    # (global scope, the paper's weights: b = sum R n / sum n over the two samples)
    group = dist.group.WORLD
    acc = OpobAccumulator(PerSampleGradNorms(sharded, weighted=True, tp_rank=rank, tp_size=world, tp_group=group),
                          list(sharded.parameters()), PAPER)
    acc.begin_step()
    sharded.zero_grad(set_to_none=True)  # as slime's train_one_step starts a step
    for i, r in ((0, 1.0), (2, 0.25)):
        acc.add_microbatch(torch.zeros(5, dtype=torch.long), torch.tensor([r], dtype=torch.float64),
                           torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64), None)
        sharded(x[i:i + 1, :lengths[i]]).pow(2).sum().backward()
    b = acc.finish()
    b_ref = float((1.0 * ref[0] + 0.25 * ref[2]) / (ref[0] + ref[2]))
    assert abs(b - b_ref) < 1e-12, (b, b_ref)
    acc.grad_norms.remove()

    # --- data parallel: each rank holds different samples; one baseline over both ranks, and the
    # DP sum of the ranks' gradients is the single-process baselined gradient
    rewards = torch.tensor([[1.0, 0.0, 0.5], [1.0, 0.25, 0.0]], dtype=torch.float64)
    model = FullMLP().double()
    model.load_state_dict(full.state_dict())
    xs = [x, 0.5 * x.flip(0)]
    acc = OpobAccumulator(PerSampleGradNorms(model, weighted=True), list(model.parameters()), PAPER,
                          dp_group=group)
    acc.begin_step()
    acc.add_microbatch(seg.reshape(-1), rewards[rank], torch.zeros(3, dtype=torch.float64),
                       torch.ones(3, dtype=torch.float64), None)
    (model(xs[rank]).pow(2).sum(-1) * (seg >= 0)).sum().backward()  # padding carries no loss
    b = acc.finish()
    grads = [p.grad.clone() for p in model.parameters()]
    for g in grads:
        dist.all_reduce(g)
    norms = torch.cat([_per_sample_norms(full, xs[k], seg, 3) for k in range(2)])
    b_ref = float((rewards.reshape(-1) * norms).sum() / norms.sum())
    assert abs(b - b_ref) < 1e-12, (b, b_ref)
    expected = [torch.zeros_like(g) for g in grads]
    for k in range(2):
        for i in range(3):
            full.zero_grad()
            full(xs[k][i:i + 1, :lengths[i]]).pow(2).sum().backward()
            for e, p in zip(expected, full.parameters()):
                e += (float(rewards[k, i]) - b_ref) * p.grad
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)

    # --- ESS statistics merged across ranks (one rank empty, as a non-last pipeline stage)
    log_w = torch.tensor([0.3, -1.0, 700.0, 699.0], dtype=torch.float64)
    stats = EssStats()
    if rank == 0:
        stats.add(log_w)
    merged = stats.reduce()
    full_stats = EssStats()
    full_stats.add(log_w)
    assert merged.num_samples == 4 and abs(merged.ess_ratio - full_stats.ess_ratio) < 1e-12
    return "ok"


def test_tp_and_dp_reductions_on_two_gloo_ranks():
    assert run_on_gloo_ranks(_worker, 2) == ["ok", "ok"]


# ESS learning-rate factor under data parallelism: each rank sees its own samples, in its own
# number of micro-batches; the factor must be the one of all the step's samples, on every rank.
ESS_STEPS = [
    # step 0 (rho_on is measured here): per rank, its micro-batches' sequence log-weights
    {0: [[0.0, 0.2], [-0.1]], 1: [[0.1, 0.0, -0.2]]},
    # step 1: rank 0's samples nearly uniform, rank 1 holds a dominant weight
    {0: [[0.0], [0.05, -0.05], [0.02]], 1: [[2.5, -1.0]]},
]


class _LrRecordingSGD(torch.optim.SGD):
    """SGD that records the learning rate each step ran with."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.lrs: list[float] = []

    def step(self, closure=None):
        self.lrs.append(self.param_groups[0]["lr"])
        return super().step(closure)


def _ess_lr_worker(rank, world):
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = _LrRecordingSGD([param], lr=0.1)
    scaler = EssLrScaler()
    scaler.wrap_optimizer(optimizer)
    for step in ESS_STEPS:
        scaler.begin_step()
        for micro_batch in step[rank]:
            scaler.observe(torch.tensor(micro_batch, dtype=torch.float64))
        param.grad = torch.ones(2)
        optimizer.step()
    return optimizer.lrs, scaler.rho_on


def test_ess_lr_factor_is_the_whole_steps_on_every_data_parallel_rank():
    def ratio(step):
        stats = EssStats()
        for rank in sorted(step):
            for micro_batch in step[rank]:
                stats.add(torch.tensor(micro_batch, dtype=torch.float64))
        return stats.ess_ratio

    rho_on = ratio(ESS_STEPS[0])
    expected = [0.1, 0.1 * min(1.0, math.sqrt(ratio(ESS_STEPS[1]) / rho_on))]
    assert expected[1] < 0.09  # the dominant weight lowers it: a rank-local factor would differ
    results = run_on_gloo_ranks(_ess_lr_worker, 2)
    for lrs, rank_rho_on in results:
        assert rank_rho_on == pytest.approx(rho_on, rel=1e-12)
        assert lrs == pytest.approx(expected, rel=1e-12)


# The group baseline with one sample per micro-batch on two data-parallel ranks: slime's static
# schedule hands the one-sample micro-batches out round-robin, so each prompt group of 4 has two
# samples on each rank, at the same micro-batches of both.
DP_GROUP_SIZE, DP_GROUPS = 4, 2
DP_OPTIONS = OpobOptions(scope="group", weights="released", norm_by_std=True, length_norm=True)


def _dp_samples():
    """Per global sample: its input, reward, unclipped log-weight and length scale."""
    g = torch.Generator().manual_seed(3)
    n = DP_GROUP_SIZE * DP_GROUPS
    lengths = [2 + (i * 3) % 5 for i in range(n)]
    xs = [torch.randn(1, length, D, generator=g, dtype=torch.float64) for length in lengths]
    rewards = [float(v) for v in torch.rand(n, generator=g, dtype=torch.float64)]
    log_w = [float(v) for v in 0.5 * torch.randn(n, generator=g, dtype=torch.float64)]
    scale = [1.0 / length for length in lengths]
    return xs, rewards, log_w, scale


def _dp_group_worker(rank, world, across):
    torch.manual_seed(0)
    model = FullMLP().double()
    xs, rewards, log_w, scale = _dp_samples()
    stds = []
    for gid in range(DP_GROUPS):
        group = torch.tensor(rewards[gid * DP_GROUP_SIZE:(gid + 1) * DP_GROUP_SIZE], dtype=torch.float64)
        stds.append(float(group.std(unbiased=False)))

    # the reference, on every rank: each sample's gradient on its own, the baseline from its definition
    grads = []
    for x, lam in zip(xs, scale):
        model.zero_grad()
        (lam * model(x).pow(2).sum()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    expected = [torch.zeros_like(p) for p in model.parameters()]
    for gid in range(DP_GROUPS):
        members = range(gid * DP_GROUP_SIZE, (gid + 1) * DP_GROUP_SIZE)
        weight = {i: sum(float(g.square().sum()) for g in grads[i]) / scale[i] ** 2 * math.exp(2 * log_w[i])
                  for i in members}
        b = sum(weight[i] * rewards[i] for i in members) / sum(weight.values())
        for i in members:
            for e, g in zip(expected, grads[i]):
                e += (rewards[i] - b) / stds[gid] * g

    # this rank's one-sample micro-batches, as slime hands them out
    model.zero_grad(set_to_none=True)
    acc = OpobAccumulator(PerSampleGradNorms(model, weighted=True), list(model.parameters()), DP_OPTIONS,
                          dp_group=dist.group.WORLD, groups_across_ranks=across)
    acc.begin_step()
    try:
        for i in range(rank, len(xs), world):
            gid = i // DP_GROUP_SIZE
            one = [torch.tensor([v], dtype=torch.float64) for v in (rewards[i], log_w[i], scale[i])]
            acc.add_microbatch(torch.zeros(xs[i].shape[1], dtype=torch.long), *one,
                               SampleGroups([gid], [DP_GROUP_SIZE], [stds[gid]]))
            (scale[i] * model(xs[i]).pow(2).sum()).backward()
        acc.finish()
    except RuntimeError as exc:
        return str(exc)
    got = [p.grad.clone() for p in model.parameters()]
    for g in got:
        dist.all_reduce(g)  # the DP gradient reduction (a sum; Megatron's mean divides it by 2)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)
    return len(acc.last_group_baselines)


def test_group_baseline_with_one_sample_micro_batches_spread_over_data_parallel_ranks():
    assert run_on_gloo_ranks(_dp_group_worker, 2, True) == [DP_GROUPS, DP_GROUPS]
    # rank-local groups cannot serve this layout: each rank holds half of every group
    refused = run_on_gloo_ranks(_dp_group_worker, 2, False)
    assert all("prompt group 0 is interrupted after 2 of its 4 samples by group 1" in r for r in refused), refused
