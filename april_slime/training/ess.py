"""The ESS learning-rate rule of VCPO: one optimizer step's learning rate scaled by the effective
sample size of exactly the batch that produced its gradient.

Huang et al., "Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs", eq. 4-5: the
learning rate is multiplied by ``clamp(sqrt(ESS_ratio / rho_on), min, max)``, where
``ESS_ratio = (sum w)^2 / (N sum w^2)`` of the unclipped sequence-level importance weights
``w_i = pi_theta(y_i|x_i) / mu(y_i|x_i)``. This module owns the ESS statistics (``EssStats``,
``effective_sample_size``: sums of weights kept in log space, reduced across ranks) and the rule:
when they are collected, reduced and applied to an optimizer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from april_slime.training.offpolicy import NonFiniteLogProbError, collective_device

__all__ = ["EssLrScaler", "EssStats", "effective_sample_size"]


# ------------------------------------------------------------------------------- the statistics
@dataclass
class EssStats:
    """Sufficient statistics of the effective sample size of a set of weights given in log space.

    ``ESS = (sum w)^2 / sum w^2`` and ``ess_ratio = ESS / N``. Both are invariant to a common scale
    of the weights, so the sums are kept relative to ``exp(log_shift)`` (the largest log-weight
    seen): sequence-level weights (products of hundreds of token ratios) then never overflow.
    Statistics accumulate with ``add`` (any number of batches; merging rescales to the larger
    shift) and are combined across ranks with ``reduce`` (one MAX and one SUM all-reduce), so a
    caller can collect micro-batches locally and reduce once.
    """

    log_shift: float = -math.inf
    sum_weights: float = 0.0
    sum_sq_weights: float = 0.0
    num_samples: int = 0

    def add(self, log_weights: torch.Tensor, valid: torch.Tensor | None = None) -> EssStats:
        """Merge the UNCLIPPED log-weights [N] (``valid``, bool [N], excludes samples); returns self."""
        lw = log_weights.detach().reshape(-1).to(torch.float64)
        if valid is not None:
            lw = lw[valid.detach().reshape(-1).to(lw.device).bool()]
        if lw.numel() == 0:
            return self
        finite = torch.isfinite(lw)
        if not bool(finite.all()):
            bad = (~finite).nonzero().reshape(-1)[:5].tolist()
            raise NonFiniteLogProbError(f"non-finite sequence log-weight at positions {bad}: the training or "
                                        "rollout log-probs contain NaN/inf")
        batch_shift = float(lw.max())
        shift = max(self.log_shift, batch_shift)
        rescale = math.exp(self.log_shift - shift) if self.num_samples else 0.0
        scaled = torch.exp(lw - shift)
        sum_w, sum_w2 = torch.stack([scaled.sum(), scaled.square().sum()]).tolist()
        self.sum_weights = self.sum_weights * rescale + sum_w
        self.sum_sq_weights = self.sum_sq_weights * rescale * rescale + sum_w2
        self.log_shift = shift
        self.num_samples += int(lw.numel())
        return self

    def reduce(self, group: torch.distributed.ProcessGroup | None = None,
               device: torch.device | str | None = None) -> EssStats:
        """The statistics of every rank of ``group`` together (None = the default group).

        A collective when ``torch.distributed`` is initialised: every rank of the group must call
        it, those without observations too (they contribute zeros). Ranks holding copies of the
        same samples (tensor- or context-parallel peers) do not bias the ratio: k copies multiply
        ``(sum w)^2`` and ``N sum w^2`` alike. Without ``torch.distributed`` it returns a copy.
        """
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return EssStats(self.log_shift, self.sum_weights, self.sum_sq_weights, self.num_samples)
        device = collective_device(group, device)
        shift = torch.tensor([self.log_shift], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(shift, op=torch.distributed.ReduceOp.MAX, group=group)
        global_shift = float(shift.item())
        rescale = math.exp(self.log_shift - global_shift) if self.num_samples else 0.0
        sums = torch.tensor([self.sum_weights * rescale, self.sum_sq_weights * rescale * rescale,
                             float(self.num_samples)], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(sums, op=torch.distributed.ReduceOp.SUM, group=group)
        sum_w, sum_w2, n = sums.tolist()
        return EssStats(global_shift, sum_w, sum_w2, int(round(n)))

    @property
    def ess(self) -> float:
        return self.sum_weights ** 2 / self.sum_sq_weights if self.num_samples else 0.0

    @property
    def ess_ratio(self) -> float:
        """ESS / N; 1.0 for no samples, so that scaling by it is a no-op."""
        return self.ess / self.num_samples if self.num_samples else 1.0


def effective_sample_size(
    log_weights: torch.Tensor,
    valid: torch.Tensor | None = None,
    group: torch.distributed.ProcessGroup | None = None,
    *,
    reduce: bool = True,
) -> EssStats:
    """ESS of UNCLIPPED sequence weights given as log-weights [N], in one call.

    ``valid`` (bool [N]) excludes samples, e.g. those without any loss-masked token. With
    ``reduce`` (default) the statistics are reduced over ``group`` (see ``EssStats.reduce``: a
    collective when ``torch.distributed`` is initialised), so every rank gets the ESS of the
    global batch; ``reduce=False`` keeps it local.
    """
    stats = EssStats().add(log_weights, valid)
    return stats.reduce(group, device=log_weights.device) if reduce else stats


# ------------------------------------------------------------------------------------- the rule
class EssLrScaler:
    """Owns the ESS learning-rate rule: rho_on, the statistics of the current step, the last scale.

    Call order per optimizer step: ``begin_step()`` -> ``observe(seq_log_weights)`` for every
    micro-batch of the step -> the optimizer step runs inside ``scaled_lr(optimizer)`` (which
    reduces the statistics across ranks, multiplies every param group's ``lr`` by the factor and
    puts the exact previous values back afterwards, whatever the step does). ``wrap_optimizer``
    installs that context around ``optimizer.step`` once.

    rho_on: given, or the ESS ratio of the first step at which any weight was observed (the
    paper estimates it from one on-policy step; the first step of a run is the on-policy one).
    That step's factor is therefore 1.
    """

    def __init__(self, rho_on: float | None = None, scale_min: float = 0.0, scale_max: float = 1.0,
                 group=None) -> None:
        if rho_on is not None and not (0.0 < rho_on <= 1.0):
            raise ValueError(f"rho_on must be in (0, 1], got {rho_on}")
        if not (0.0 <= scale_min <= scale_max):
            raise ValueError(f"need 0 <= scale_min <= scale_max, got {scale_min}, {scale_max}")
        self.rho_on = rho_on
        self.rho_on_from_first_step = rho_on is None
        self.scale_min = scale_min
        self.scale_max = scale_max
        self.group = group
        self._stats = EssStats()
        self._clipped = EssStats()
        self._device: torch.device | str = "cpu"
        self.last_ess_ratio: float = float("nan")
        self.last_ess_ratio_clipped: float = float("nan")
        self.last_scale: float = 1.0
        self.steps_scaled = 0

    # -- per step --------------------------------------------------------------------------
    def begin_step(self) -> None:
        self._stats = EssStats()
        self._clipped = EssStats()

    def observe(self, seq_log_weights: torch.Tensor, valid: torch.Tensor | None = None,
                clipped_log_weights: torch.Tensor | None = None) -> None:
        """Unclipped sequence log importance weights ``log pi_theta(y|x) - log mu(y|x)`` [N] of
        samples of the current step (any number of calls per step; whole sequences, not CP chunks;
        ``valid`` excludes samples). Local only: the cross-rank reduction waits for the optimizer
        step, because data-parallel ranks may run different numbers of micro-batches.
        ``clipped_log_weights`` [N]: the same samples' weights truncated (the loss passes them
        truncated at april_is_high), for the clipped-weight ESS logged beside the rule's, which it
        does not use."""
        self._device = seq_log_weights.device
        self._stats.add(seq_log_weights, valid)
        if clipped_log_weights is not None:
            self._clipped.add(clipped_log_weights, valid)

    def compute_scale(self) -> float:
        """Collective over ``group``: every rank must call it once per step."""
        stats = self._stats.reduce(self.group, device=self._device)
        clipped = self._clipped.reduce(self.group, device=self._device)
        self.last_ess_ratio_clipped = clipped.ess_ratio if clipped.num_samples else float("nan")
        if stats.num_samples == 0:
            # Nothing was measured anywhere (e.g. a loss that does not feed the scaler): leave
            # the step unscaled.
            self.last_ess_ratio, self.last_scale = float("nan"), 1.0
            return 1.0
        ratio = stats.ess_ratio
        if self.rho_on is None:
            self.rho_on = ratio
        self.last_ess_ratio = ratio
        self.last_scale = min(self.scale_max, max(self.scale_min, math.sqrt(ratio / self.rho_on)))
        return self.last_scale

    @contextlib.contextmanager
    def scaled_lr(self, optimizer) -> Iterator[float]:
        scale = self.compute_scale()
        groups = list(optimizer.param_groups)
        saved = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = group["lr"] * scale
        self.steps_scaled += 1
        try:
            yield scale
        finally:
            # Restore the exact values: a scheduler that overwrites lr after the step makes this
            # redundant, but a skipped step (inf/nan grads: no scheduler step) must not keep it.
            for group, lr in zip(groups, saved):
                group["lr"] = lr
            self._stats = EssStats()
            self._clipped = EssStats()

    def wrap_optimizer(self, optimizer) -> None:
        """Make ``optimizer.step()`` run inside ``scaled_lr`` (idempotent, instance-level)."""
        current = optimizer.step
        if getattr(current, "_vcpo_scaler", None) is self:
            return
        original = getattr(current, "_vcpo_original", current)

        def step(*args, **kwargs):
            with self.scaled_lr(optimizer):
                return original(*args, **kwargs)

        step._vcpo_scaler = self  # type: ignore[attr-defined]
        step._vcpo_original = original  # type: ignore[attr-defined]
        optimizer.step = step

    # -- persistence -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"rho_on": self.rho_on, "last_ess_ratio": self.last_ess_ratio,
                "last_scale": self.last_scale, "steps_scaled": self.steps_scaled}

    def load_state_dict(self, state: dict) -> None:
        self.rho_on = state["rho_on"]
        self.last_ess_ratio = state["last_ess_ratio"]
        self.last_scale = state["last_scale"]
        self.steps_scaled = state["steps_scaled"]

    def metrics(self) -> dict[str, float]:
        return {"vcpo/ess_ratio": self.last_ess_ratio, "vcpo/ess_ratio_clipped": self.last_ess_ratio_clipped,
                "vcpo/lr_scale": self.last_scale,
                "vcpo/rho_on": float("nan") if self.rho_on is None else self.rho_on}
