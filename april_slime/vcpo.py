"""VCPO's slime face: the job's VCPO state and the hooks slime loads by import path.

VCPO (Huang et al., "Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs") has two
independent controls of the variance of an importance-weighted policy gradient, both in the
training wing: the ESS learning-rate rule (``april_slime.training.ess.EssLrScaler``) and the
off-policy optimal baseline applied by linearity (``april_slime.training.grad_norms`` for the
exact per-sample norms, ``april_slime.training.baseline`` for the loss side and ``Q - b P``).
The importance-weight and ESS formulas themselves belong to ``april_slime.training.offpolicy``.

This module owns what ties them to one slime job: ``VcpoRuntime`` (built from the job's
``AprilConfig``), the settings VCPO refuses (``check_settings``), and the entry points (see
docs/vcpo.md for the exact call order inside slime's Megatron loop): ``before_train_step``
(``--custom-megatron-before-train-step-hook-path``) and ``opob_advantages``
(``--custom-advantage-function-path``); ``april_slime.loss.policy_loss`` (the custom loss) feeds
``runtime().lr_scaler`` and calls ``opob_policy_loss``.

torch is imported at module level: this module is only used on the training side.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import nn

from april_slime import settings
from april_slime.core.config import AprilConfig, AprilConfigError
from april_slime.training.baseline import finish_opob_step
from april_slime.training.ess import EssLrScaler
from april_slime.training.grad_norms import PerSampleGradNorms

__all__ = [
    "VcpoRuntime",
    "runtime",
    "reset_runtime",
    "check_settings",
    "before_train_step",
    "opob_advantages",
]


class VcpoRuntime:
    """Everything VCPO keeps for one slime training job (one per training process)."""

    def __init__(self, config: AprilConfig, *, group=None) -> None:
        self.config = config
        self.group = group
        self.lr_scaler: EssLrScaler | None = None
        if config.vcpo_lr_scaling:
            self.lr_scaler = EssLrScaler(config.vcpo_rho_on, config.vcpo_lr_scale_min,
                                         config.vcpo_lr_scale_max, group=group)
        self.grad_norms: PerSampleGradNorms | None = None
        self._params: list[nn.Parameter] = []
        self.last_baseline = float("nan")

    @property
    def is_correction(self) -> tuple[str, float, float]:
        c = self.config
        return c.is_correction, c.is_low, c.is_high

    def attach_model(self, model: Sequence[nn.Module], tp_rank: int = 0, tp_size: int = 1, tp_group=None) -> None:
        if not self.config.vcpo_baseline or self.grad_norms is not None:
            return
        try:
            self.grad_norms = PerSampleGradNorms(model, weighted=True, tp_rank=tp_rank, tp_size=tp_size,
                                                 tp_group=tp_group)
        except ValueError as exc:  # a model the per-sample rules cannot cover: a setting error here
            raise AprilConfigError(f"april_vcpo_baseline: {exc}") from exc
        self._params = [p for chunk in model for p in chunk.parameters() if p.requires_grad]

    def begin_step(self) -> None:
        if self.lr_scaler is not None:
            self.lr_scaler.begin_step()
        if self.grad_norms is not None:
            self.grad_norms.reset()

    def finish_gradients(self) -> float:
        """Apply the baseline to the accumulated gradients (before the DP reduction)."""
        if self.grad_norms is None:
            return float("nan")
        if self.grad_norms.microbatches == 0:
            raise RuntimeError("april_vcpo_baseline is on but the loss never registered a micro-batch: "
                               "use the VCPO loss (opob_policy_loss)")
        self.last_baseline = finish_opob_step(self.grad_norms, self._params, group=self.group)
        return self.last_baseline

    def wrap_finalize(self, megatron_config) -> None:
        """Run ``finish_gradients`` first inside Megatron's ``finalize_model_grads_func``, which
        forward_backward_func calls once after the last micro-batch and which starts the DP
        gradient reduction. slime's ``train()`` re-installs the original every rollout, so this is
        called every step."""
        current = megatron_config.finalize_model_grads_func
        if current is None or getattr(current, "_vcpo_runtime", None) is self:
            return

        def finalize(*args, **kwargs):
            self.finish_gradients()
            return current(*args, **kwargs)

        finalize._vcpo_runtime = self  # type: ignore[attr-defined]
        megatron_config.finalize_model_grads_func = finalize

    def metrics(self) -> dict[str, float]:
        out = {}
        if self.lr_scaler is not None:
            out.update(self.lr_scaler.metrics())
        if self.grad_norms is not None:
            out["vcpo/opob_baseline"] = self.last_baseline
        return out


_RUNTIME: VcpoRuntime | None = None


def runtime() -> VcpoRuntime | None:
    """The job's VCPO state, created by the first ``before_train_step`` (None before / when off)."""
    return _RUNTIME


def reset_runtime() -> None:
    global _RUNTIME
    _RUNTIME = None


def check_settings(args: Any, config: AprilConfig) -> None:
    """Refuse, in one ``AprilConfigError``, every setup the enabled VCPO controls cannot serve."""
    if not (config.vcpo_lr_scaling or config.vcpo_baseline):
        return
    loss_type = getattr(args, "loss_type", None)
    if loss_type is not None and loss_type != "custom_loss":
        raise AprilConfigError(
            "april_vcpo_lr_scaling / april_vcpo_baseline are fed by the custom loss: set --loss-type custom_loss "
            f"--custom-loss-function-path april_slime.loss.policy_loss (got --loss-type {loss_type})")
    if not config.vcpo_baseline:
        return
    estimator = getattr(args, "advantage_estimator", None)
    checks = [
        (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1,
        (getattr(args, "context_parallel_size", 1) or 1) > 1,
        bool(getattr(args, "overlap_grad_reduce", False)),
        bool(getattr(args, "use_kl_loss", False)),
        float(getattr(args, "entropy_coef", 0.0) or 0.0) != 0.0,
        bool(getattr(args, "recompute_loss_function", False)),
        config.is_mode != "copris",
        config.is_level != "sequence",
        config.loss_level != "token" or estimator in ("gspo", "cispo"),
    ]
    reasons = [
        "pipeline parallelism (only the last stage sees the rewards)",
        "context parallelism (sequences split across ranks)",
        "--overlap-grad-reduce (gradients must stay local until the baseline is applied)",
        "--use-kl-loss (the baseline is defined for the pure policy-gradient loss)",
        "a non-zero --entropy-coef (same reason)",
        "--recompute-loss-function (the loss would register its micro-batch twice)",
        f"april_is_mode={config.is_mode} (the baseline is derived for the importance-weighted REINFORCE "
        "estimator against the rollout log-probs: set april_is_mode: copris; decoupled and on_policy clip "
        "around the recomputed policy, which has no per-trajectory baseline)",
        f"april_is_level={config.is_level} (one weight per trajectory: set april_is_level: sequence)",
        f"april_loss_level={config.loss_level} / --advantage-estimator {estimator} (the baselined loss is "
        "REINFORCE, not a GSPO or CISPO objective)",
    ]
    bad = [r for c, r in zip(checks, reasons) if c]
    if bad:
        raise AprilConfigError("april_vcpo_baseline: not supported with " + "; ".join(bad))


def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) -> None:
    """slime ``--custom-megatron-before-train-step-hook-path`` entry point.

    slime calls it in ``train_one_step`` after zeroing the gradients and before the step's
    forward/backward, with the optimizer whose ``step()`` follows the backward and the scheduler
    whose ``step()`` follows that (and overwrites every group's lr).
    """
    global _RUNTIME
    if _RUNTIME is None:
        config = settings.for_job(args)
        check_settings(args, config)
        _RUNTIME = VcpoRuntime(config)
        if config.vcpo_baseline:
            from megatron.core import mpu  # lazy: only inside a Megatron job

            _RUNTIME.attach_model(model, tp_rank=mpu.get_tensor_model_parallel_rank(),
                                  tp_size=mpu.get_tensor_model_parallel_world_size(),
                                  tp_group=mpu.get_tensor_model_parallel_group())
    rt = _RUNTIME
    if rt.lr_scaler is not None:
        rt.lr_scaler.wrap_optimizer(optimizer)
    if rt.grad_norms is not None:
        from megatron.core.utils import get_model_config  # lazy

        rt.wrap_finalize(get_model_config(model[0]))
    rt.begin_step()


def opob_advantages(args, rollout_data: dict) -> None:
    """slime ``--custom-advantage-function-path``: advantages (and returns) are the raw rewards
    broadcast over each response, so the OPOB loss sees ``R_i`` and the baseline replaces the
    group mean."""
    rewards = rollout_data["rewards"]
    shapes = rollout_data.get("kl") or rollout_data.get("log_probs") or rollout_data["rollout_log_probs"]
    if len(rewards) != len(shapes):
        raise ValueError(f"{len(rewards)} rewards for {len(shapes)} samples")
    advantages = []
    for r, like in zip(rewards, shapes):
        r = float(r)
        if not math.isfinite(r):
            raise ValueError(f"non-finite reward {r}")
        advantages.append(torch.full_like(like, r, dtype=torch.float32))
    rollout_data["advantages"] = advantages
    rollout_data["returns"] = [a.clone() for a in advantages]
