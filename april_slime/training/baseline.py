"""VCPO's off-policy optimal baseline (OPOB), applied by linearity after the one backward pass.

Huang et al., "Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs", eq. 7 / 13:
``b = sum_i W_i R_i / sum_i W_i`` with ``W_i = w_i^2 ||g_i||^2``, ``g_i = grad log pi(y_i|x_i)`` the
score of the whole sequence. The gradient of one optimizer step is ``sum_i a_i G_i`` where
``G_i = wbar_i lambda_i grad(-log pi_i)`` is sample i's term of the loss (``wbar_i`` the corrected
sequence weight, ``lambda_i = 1 / L_i`` with length normalisation, else 1) and

* ``scope="group"`` (the authors' released runs): ``a_i = (R_i - b_g) / s_g``, one baseline per
  prompt group g from the group's own samples, ``s_g`` the population std of the group's raw
  rewards (``norm_by_std``; 1 when off or when the std is below 1e-8);
* ``scope="global"``: ``a_i = R_i - b``, one baseline over the step's samples on every rank.

``weights="released"`` is ``W_i = ||wbar_i g_i||^2 w_i^2`` (the released code multiplies the norm of
the weighted score by the squared unclipped ratio); ``weights="paper"`` is ``W_i = ||wbar_i g_i||^2``.

How, with no second backward pass (``OpobAccumulator``): autograd accumulates each micro-batch's
``P = sum_i G_i`` into the parameters' gradients; the layer hooks of ``PerSampleGradNorms`` give
the exact per-sample norms and the second buffer ``F += sum_i c_i G_i`` (``c_i = R_i / s_g``) for
a micro-batch of several samples. A micro-batch of one sample needs no hook: its norm is read off
the gradient buffer and ``F += c_i P`` (VCPO's own micro-batch-of-one path). At each micro-batch
boundary the micro-batch is folded: a completed group subtracts ``(b_g / s_g) P_g`` from ``F``
(``P_g`` kept in a score buffer ``S`` while the group spans micro-batches); with the global scope
``S`` collects every ``P`` and ``F - b S`` is formed after the step's last backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from april_slime.training import offpolicy
from april_slime.training.grad_norms import PerSampleGradNorms, group_active
from april_slime.training.settings import VCPO_BASELINE_SCOPES, VCPO_BASELINE_WEIGHTS

__all__ = ["OpobAccumulator", "OpobOptions", "OpobResult", "SampleGroups", "opob_policy_loss", "weighted_mean"]

MIN_REWARD_STD = 1e-8


@dataclass(frozen=True)
class OpobOptions:
    """How the baseline is formed (module doc); ``correction`` / ``low`` / ``high``: the sequence
    weight's TIS/MIS (``offpolicy.correct_log_weights``)."""

    scope: str = "group"
    norm_by_std: bool = True
    length_norm: bool = True
    weights: str = "released"
    correction: str = "truncate"
    low: float = 0.0
    high: float = 8.0

    def __post_init__(self) -> None:
        if self.scope not in VCPO_BASELINE_SCOPES:
            raise ValueError(f"OPOB scope must be one of {VCPO_BASELINE_SCOPES}, got {self.scope!r}")
        if self.weights not in VCPO_BASELINE_WEIGHTS:
            raise ValueError(f"OPOB weights must be one of {VCPO_BASELINE_WEIGHTS}, got {self.weights!r}")


@dataclass(frozen=True)
class SampleGroups:
    """Prompt group of each sample of a micro-batch: its id, its size (samples in the whole
    rollout) and the population std of its raw rewards."""

    ids: Sequence[int]
    sizes: Sequence[int]
    reward_std: Sequence[float]


@dataclass
class OpobResult:
    loss: torch.Tensor            # sum_i wbar_i lambda_i (-log pi(y_i|x_i)): what autograd differentiates
    is_weights: torch.Tensor      # [N] wbar_i (after truncation / masking)
    seq_log_ratios: torch.Tensor  # [N] unclipped log pi_theta(y_i|x_i) - log mu(y_i|x_i)
    rewards: torch.Tensor         # [N] R_i
    keep: torch.Tensor            # [N] 0.0 where masking (MIS) removed the sample
    truncated: torch.Tensor       # [N] 1.0 where truncation (TIS) changed the weight
    length_scale: torch.Tensor    # [N] lambda_i
    packing: offpolicy.Packing    # layout of the samples' response tokens

    def objective(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                  mask: torch.Tensor) -> offpolicy.PolicyObjective:
        """The per-token view of the term (packed [T] inputs), so that it reports the same metrics
        as the PPO objectives: ``loss`` holds the terms ``wbar_i lambda_i (-log pi_t)`` whose plain
        sum is ``self.loss``; the ratio is the unclipped sequence ratio pi_theta / pi_rollout
        (nothing is clipped); the behaviour ratio is pi_old / pi_rollout."""
        packing = self.packing
        clean = offpolicy.check_finite({"log_probs": log_probs, "old_log_probs": old_log_probs.detach()},
                                       mask, packing)
        behaviour_log_ratio = offpolicy.masked_log_ratio(clean["old_log_probs"], rollout_log_probs, mask)
        dtype = old_log_probs.dtype
        weight = packing.expand(self.is_weights.to(dtype))
        return offpolicy.PolicyObjective(
            loss=-weight * packing.expand(self.length_scale.to(dtype)) * clean["log_probs"] * mask.to(dtype),
            ratio=packing.expand(offpolicy.safe_exp(self.seq_log_ratios).to(dtype)),
            clipped=torch.zeros_like(mask, dtype=dtype),
            is_weight=weight,
            keep=packing.expand(self.keep.to(dtype)),
            truncated=packing.expand(self.truncated.to(dtype)),
            behaviour_log_ratio=behaviour_log_ratio,
            sequence_log_weights=offpolicy.sequence_log_weights(behaviour_log_ratio, packing, mask),
        )


def weighted_mean(values: Sequence[float], log_weights: Sequence[float]) -> float:
    """``sum W v / sum W`` with the weights given in log space (float64, shifted by the largest);
    0 when every weight is 0."""
    lw = torch.tensor(list(log_weights), dtype=torch.float64)
    if lw.numel() == 0 or not bool(torch.isfinite(lw).any()):
        return 0.0
    w = torch.exp(lw - lw.max())
    return float((w * torch.tensor(list(values), dtype=torch.float64)).sum() / w.sum())


def opob_policy_loss(log_probs: Sequence[torch.Tensor], rollout_log_probs: Sequence[torch.Tensor],
                     loss_masks: Sequence[torch.Tensor], rewards: torch.Tensor | Sequence[float],
                     segment_ids: torch.Tensor, *, accumulator: OpobAccumulator | None = None,
                     groups: SampleGroups | None = None, options: OpobOptions = OpobOptions()) -> OpobResult:
    """Loss side of VCPO for one micro-batch (paper eq. 9 without the baseline term).

    Returns ``loss = sum_i wbar_i lambda_i (-sum_t m_t log pi_t)``; differentiate it once. With an
    ``accumulator`` the micro-batch is registered so that the step's gradient becomes the
    baselined one (module doc). ``log_probs``: the training forward's per-token response
    log-probs (with grad); ``rollout_log_probs``: the behaviour log-probs (a resumed sample's
    concatenation over its stages); ``segment_ids``: the sample of every token of the layers'
    activations (-1 = none); ``rewards``: raw rewards R_i; ``groups``: needed by the group scope.
    """
    n = len(log_probs)
    if not (len(rollout_log_probs) == n == len(loss_masks)):
        raise ValueError("log_probs, rollout_log_probs and loss_masks must have one entry per sample")
    for i, (lp, rlp, m) in enumerate(zip(log_probs, rollout_log_probs, loss_masks)):
        if lp.shape != rlp.shape or lp.shape != m.shape:
            raise ValueError(f"sample {i}: log_probs {tuple(lp.shape)}, rollout_log_probs "
                             f"{tuple(rlp.shape)} and loss_mask {tuple(m.shape)} differ in length")
    if n == 0:
        raise ValueError("empty micro-batch")
    if isinstance(rewards, (list, tuple)):
        rewards = torch.stack([torch.as_tensor(r, dtype=torch.float64).reshape(()) for r in rewards])
    rewards = torch.as_tensor(rewards).detach().reshape(-1).to(torch.float64)
    if rewards.numel() != n:
        raise ValueError(f"{rewards.numel()} rewards for {n} samples")
    if not torch.isfinite(rewards).all():
        raise ValueError("non-finite reward")
    if groups is not None and not (len(groups.ids) == len(groups.sizes) == len(groups.reward_std) == n):
        raise ValueError(f"group information for {len(groups.ids)} samples, expected {n}")

    current, packing = offpolicy.pack(list(log_probs))
    rollout = torch.cat([r.detach() for r in rollout_log_probs]).to(device=current.device, dtype=torch.float64)
    mask = torch.cat(list(loss_masks)).to(current.device)
    clean = offpolicy.check_finite({"log_probs": current, "rollout_log_probs": rollout}, mask, packing)
    current = clean["log_probs"]
    log_ratio = offpolicy.sequence_log_weights(
        offpolicy.masked_log_ratio(current.detach().to(torch.float64), clean["rollout_log_probs"], mask),
        packing, mask)
    weights = offpolicy.correct_log_weights(log_ratio, options.correction, options.low, options.high)
    tokens = packing.sum(mask.to(torch.float64))
    length_scale = 1.0 / tokens.clamp_min(1.0) if options.length_norm else torch.ones_like(tokens)
    if accumulator is not None:
        accumulator.add_microbatch(segment_ids, rewards, log_ratio, length_scale, groups)
    nll = -packing.sum(current * mask.to(current.dtype))
    loss = (nll * (weights.weights * length_scale).to(current.dtype)).sum()
    return OpobResult(loss, weights.weights, log_ratio, rewards, weights.keep, weights.truncated, length_scale,
                      packing)


@dataclass
class _Microbatch:
    rewards: list[float]
    coeffs: list[float]            # c_i of the second buffer: R_i / s_g (group scope) or R_i
    log_factor: list[float]        # log of W_i / n_i: -2 log lambda_i (+ 2 log w_i when "released")
    group_ids: list[int] | None
    group_sizes: list[int] | None
    scale: list[float]             # s_g per sample (1 when the std is not used)


@dataclass
class _Group:
    size: int
    scale: float
    rewards: list[float] = field(default_factory=list)
    log_weights: list[float] = field(default_factory=list)


class OpobAccumulator:
    """The baselined gradient of one optimizer step, folded micro-batch by micro-batch.

    Call order per step: ``add_microbatch`` in every micro-batch's loss (before its backward;
    it folds the previous micro-batch), then ``finish()`` after the last backward and before any
    gradient reduction (Megatron's ``finalize_model_grads``). The tensor-parallel group whose
    shards add up to a sample's norm is ``grad_norms``'; ``dp_group``: the ranks whose samples
    share the global baseline (None: every rank of the job).

    The group scope keeps each group on one rank (nothing crosses ranks but the per-sample norms
    over the TP group), unless ``groups_across_ranks``: then every group's samples are spread over
    the ranks of ``dp_group`` at the same micro-batches of each rank (slime's static schedule with
    micro-batches smaller than a group hands them out round-robin, VCPO's one sample per
    micro-batch among them). At each micro-batch boundary the ranks then agree on the group in
    play and count its samples (one ``MAX`` and one ``SUM`` all-reduce of four numbers); once all
    of its samples have run, ``b_g`` is formed from every rank's ``W_i`` and ``R_i``, and each rank
    folds its own part ``(b_g / s_g) P_g``: the DP reduction of the gradients adds the parts up.
    """

    def __init__(self, grad_norms: PerSampleGradNorms, params: Sequence[nn.Parameter],
                 options: OpobOptions = OpobOptions(), *, dp_group=None, groups_across_ranks: bool = False) -> None:
        self.grad_norms = grad_norms
        self.params = [p for p in params if p.requires_grad]
        self.options = options
        self.dp_group = dp_group
        self.groups_across_ranks = groups_across_ranks and options.scope == "group" and group_active(dp_group)
        counts = [grad_norms.counts_in_norm(p) for p in self.params]
        self._counted = [p for p, c in zip(self.params, counts) if c == "counted"]
        self._tp_partial = [p for p, c in zip(self.params, counts) if c == "tp_partial"]
        self.clock = grad_norms.clock  # the hooks, the folds and the finish of this step
        self.last_baseline = float("nan")
        self.last_group_baselines: list[tuple[float, float]] = []  # (b_g, mean reward of g) per group
        self._reset()

    # -- per step ----------------------------------------------------------------------------
    def _reset(self) -> None:
        self._pending: _Microbatch | None = None
        self._score: list[torch.Tensor] | None = None  # S: a group's (or, globally, every) P
        self._open: int | None = None
        self._groups: dict[int, _Group] = {}
        self._closed: set[int] = set()
        self._global: list[tuple[float, float]] = []  # (R_i, log W_i)
        self.microbatches = 0
        self.grad_norms.reset()

    def begin_step(self) -> None:
        self._reset()
        self.clock.reset()
        self.last_group_baselines = []

    def add_microbatch(self, segment_ids: torch.Tensor, rewards: torch.Tensor, seq_log_ratios: torch.Tensor,
                       length_scale: torch.Tensor, groups: SampleGroups | None) -> None:
        """Describe the micro-batch whose backward comes next (see ``opob_policy_loss``)."""
        with self.clock.section(rewards.device if rewards.device.type != "cpu" else self._device):
            self._add_microbatch(segment_ids, rewards, seq_log_ratios, length_scale, groups)

    @property
    def _device(self) -> torch.device | None:
        return self.params[0].device if self.params else None

    def _add_microbatch(self, segment_ids, rewards, seq_log_ratios, length_scale, groups) -> None:
        opt = self.options
        n = rewards.numel()
        if opt.scope == "group":
            if groups is None:
                raise ValueError("the group-scope baseline needs each sample's prompt group")
            scale = [s if (opt.norm_by_std and s > MIN_REWARD_STD) else 1.0 for s in groups.reward_std]
        else:
            scale = [1.0] * n
        r = rewards.tolist()
        log_factor = (-2.0 * torch.log(length_scale.detach().to(torch.float64).cpu()))
        if opt.weights == "released":
            log_factor = log_factor + 2.0 * seq_log_ratios.detach().to(torch.float64).cpu()
        mb = _Microbatch(r, [ri / si for ri, si in zip(r, scale)], log_factor.tolist(),
                         list(map(int, groups.ids)) if groups is not None else None,
                         list(map(int, groups.sizes)) if groups is not None else None, scale)
        self._fold(next_single=(n == 1))
        self.grad_norms.set_microbatch(segment_ids, n, torch.tensor(mb.coeffs, dtype=torch.float64))
        self._pending = mb
        self.microbatches += 1

    def finish(self) -> float:
        """Form the step's baselined gradient in place (``main_grad`` when Megatron keeps one, else
        ``.grad``). Collective over ``dp_group`` with the global scope. Returns the baseline (the
        mean over groups with the group scope)."""
        if self.microbatches == 0:
            raise RuntimeError("the OPOB baseline is on but the loss never registered a micro-batch: "
                               "use the VCPO loss (opob_policy_loss)")
        with self.clock.section(self._device):
            return self._finish()

    def _finish(self) -> float:
        self._fold(next_single=False)
        grads = self._grads()
        weighted = self._weighted(grads)
        if self.options.scope == "group":
            if self._open is not None:
                g = self._groups[self._open]
                raise RuntimeError(f"prompt group {self._open} has {len(g.rewards)} of its {g.size} samples in this "
                                   "step on this rank: the group-scope baseline needs whole groups on one rank")
            baselines = [b for b, _ in self.last_group_baselines]
            self.last_baseline = sum(baselines) / len(baselines) if baselines else float("nan")
            torch._foreach_copy_(grads, weighted)
        else:
            b = self._global_baseline()
            self.last_baseline = b
            if self._score is not None:
                torch._foreach_add_(grads, self._score)
            torch._foreach_mul_(grads, -b)
            torch._foreach_add_(grads, weighted)
        self._reset()
        return self.last_baseline

    # -- folding ---------------------------------------------------------------------------
    def _grads(self) -> list[torch.Tensor]:
        out = []
        for p in self.params:
            g = getattr(p, "main_grad", None)
            if g is None:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                g = p.grad
            out.append(g)
        return out

    def _weighted(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The second buffer F, one tensor per parameter (created on first use)."""
        buffers = self.grad_norms.weighted_grads
        for p, g in zip(self.params, grads):
            if p not in buffers:
                buffers[p] = torch.zeros_like(g, dtype=torch.promote_types(g.dtype, torch.float32))
        return [buffers[p] for p in self.params]

    def _single_sample_sq_norm(self) -> float:
        """||G||^2 of the gradient buffer (one sample's gradient), summed over the TP shards."""
        counted = [self._grad(p) for p in self._counted]
        sq = torch.zeros((), dtype=torch.float64, device=counted[0].device if counted else "cpu")
        if counted:
            norms = torch._foreach_norm(counted)
            sq = sq + torch.stack([x.to(torch.float64) for x in norms]).square().sum()
        if self._tp_partial:
            # sequence-parallel replicated parameters: each TP rank holds a partial gradient
            flat = torch.cat([self._grad(p).reshape(-1).to(torch.float64) for p in self._tp_partial])
            dist.all_reduce(flat, group=self.grad_norms.tp_group)
            if self.grad_norms.tp_rank == 0:
                sq = sq + flat.square().sum().to(sq.device)
        if self._tp_active:
            dist.all_reduce(sq, group=self.grad_norms.tp_group)
        return float(sq)

    @property
    def _tp_active(self) -> bool:
        return self.grad_norms.tp_size > 1 and group_active(self.grad_norms.tp_group)

    def _grad(self, p: nn.Parameter) -> torch.Tensor:
        g = getattr(p, "main_grad", None)
        return g if g is not None else (p.grad if p.grad is not None else torch.zeros_like(p))

    def _fold(self, next_single: bool) -> None:
        """Fold the micro-batch whose backward has run (if any); ``next_single``: the next one has
        a single sample, so its gradient must find the buffer empty."""
        mb, self._pending = self._pending, None
        if mb is None:
            return
        grads = self._grads()
        n = len(mb.rewards)
        if n == 1:
            sq = [self._single_sample_sq_norm()]
            torch._foreach_add_(self._weighted(grads), grads, alpha=mb.coeffs[0])
        else:
            per_sample = self.grad_norms.last_sq_norms
            if per_sample is None:
                raise RuntimeError("no layer hook ran for this micro-batch's backward")
            per_sample = per_sample.detach().to(torch.float64).clone()
            if self._tp_active:
                dist.all_reduce(per_sample, group=self.grad_norms.tp_group)
            sq = per_sample.tolist()
        log_w = [(math.log(s) if s > 0 else -math.inf) + f for s, f in zip(sq, mb.log_factor)]
        if self.options.scope == "global":
            self._global += list(zip(mb.rewards, log_w))
            if next_single:
                self._move_to_score(grads)
            return
        self._fold_group(mb, log_w, grads)

    def _move_to_score(self, grads: list[torch.Tensor]) -> None:
        if self._score is None:
            self._score = [torch.zeros_like(g) for g in grads]
        torch._foreach_add_(self._score, grads)
        torch._foreach_zero_(grads)

    def _fold_group(self, mb: _Microbatch, log_w: list[float], grads: list[torch.Tensor]) -> None:
        ids = set(mb.group_ids)
        if len(ids) != 1:
            raise RuntimeError(f"a micro-batch holds samples of prompt groups {sorted(ids)}: the group-scope "
                               "baseline needs every micro-batch to hold one group (or part of one)")
        gid = mb.group_ids[0]
        if self._open is not None and self._open != gid:
            g = self._groups[self._open]
            raise RuntimeError(f"prompt group {self._open} is interrupted after {len(g.rewards)} of its {g.size} "
                               f"samples by group {gid}: the group-scope baseline needs each group's samples in "
                               "consecutive micro-batches")
        if gid in self._closed:
            raise RuntimeError(f"prompt group {gid} has more samples in this step than its size")
        group = self._groups.setdefault(gid, _Group(size=mb.group_sizes[0], scale=mb.scale[0]))
        group.rewards += mb.rewards
        group.log_weights += log_w
        if self.groups_across_ranks:
            seen, b, mean_reward = self._group_across_ranks(gid, group)
        else:
            seen = len(group.rewards)
            b, mean_reward = weighted_mean(group.rewards, group.log_weights), sum(group.rewards) / seen
        if seen > group.size:
            raise RuntimeError(f"prompt group {gid} has more samples in this step than its size {group.size}")
        if seen < group.size:
            self._open = gid
            self._move_to_score(grads)
            return
        # the group is complete: F -= (b_g / s_g) P_g
        self.last_group_baselines.append((b, mean_reward))
        weighted = self._weighted(grads)
        if self._score is not None and self._open == gid:
            torch._foreach_add_(self._score, grads)
            torch._foreach_add_(weighted, self._score, alpha=-b / group.scale)
            torch._foreach_zero_(self._score)
        else:
            torch._foreach_add_(weighted, grads, alpha=-b / group.scale)
        torch._foreach_zero_(grads)
        self._open = None
        self._closed.add(gid)

    def _group_across_ranks(self, gid: int, group: _Group) -> tuple[int, float, float]:
        """The samples of ``gid`` run so far on every rank of ``dp_group``, and, once that is the
        whole group, its baseline and mean reward over them (collective: every rank folds its
        micro-batch of the same group at the same boundary)."""
        device = offpolicy.collective_device(self.dp_group, self._device)
        finite = [lw for lw in group.log_weights if math.isfinite(lw)]
        head = torch.tensor([gid, -gid, max(finite) if finite else -math.inf], dtype=torch.float64, device=device)
        dist.all_reduce(head, op=dist.ReduceOp.MAX, group=self.dp_group)
        highest, lowest, shift = int(head[0]), -int(head[1]), float(head[2])
        if highest != gid or lowest != gid:
            raise RuntimeError(f"prompt group {gid} meets groups {lowest}..{highest} at the same micro-batch of the "
                               "other data-parallel ranks: a group spread over the ranks needs its samples at the "
                               "same micro-batches of every rank (static batching, no --balance-data, "
                               "--n-samples-per-prompt a multiple of --micro-batch-size x the data-parallel size)")
        w = [math.exp(lw - shift) if math.isfinite(lw) else 0.0 for lw in group.log_weights]
        sums = torch.tensor([len(group.rewards), sum(wi * r for wi, r in zip(w, group.rewards)), sum(w),
                             sum(group.rewards)], dtype=torch.float64, device=device)
        dist.all_reduce(sums, group=self.dp_group)
        seen, num, den, total = int(round(float(sums[0]))), float(sums[1]), float(sums[2]), float(sums[3])
        return seen, (num / den if den > 0 else 0.0), total / max(seen, 1)

    def _global_baseline(self) -> float:
        """``b`` over every rank of ``dp_group``: one MAX and one SUM all-reduce (log-space shift)."""
        device = offpolicy.collective_device(self.dp_group, self.params[0].device if self.params else None)
        local = [lw for _, lw in self._global if math.isfinite(lw)]
        shift = torch.tensor([max(local) if local else -math.inf], dtype=torch.float64, device=device)
        if group_active(self.dp_group):
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=self.dp_group)
        m = float(shift)
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        if math.isfinite(m):
            for r, lw in self._global:
                w = math.exp(lw - m) if math.isfinite(lw) else 0.0
                sums[0] += r * w
                sums[1] += w
        if group_active(self.dp_group):
            dist.all_reduce(sums, group=self.dp_group)
        num, den = float(sums[0]), float(sums[1])
        if not (math.isfinite(num) and math.isfinite(den)):
            raise FloatingPointError(f"non-finite OPOB sums num={num} den={den}")
        return num / den if den > 0 else 0.0


def per_sample_rewards(advantages: list[torch.Tensor]) -> torch.Tensor:
    """R_i from slime's advantages, which must be constant over each response (0 for an empty one)."""
    rewards = []
    for i, a in enumerate(advantages):
        if a.numel() and bool((a != a[0]).any()):
            raise ValueError(f"sample {i}: april_vcpo_baseline needs one reward per sample, constant over the "
                             "response (april_slime.vcpo.opob_advantages writes them so); got per-token values")
        rewards.append(a[0].detach().to(torch.float64) if a.numel() else torch.zeros((), dtype=torch.float64))
    return torch.stack(rewards)
