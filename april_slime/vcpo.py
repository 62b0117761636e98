"""VCPO's slime face: the job's VCPO state and the hooks slime loads by import path.

VCPO (Huang et al., "Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs") has two
independent controls of the variance of an importance-weighted policy gradient, both in the
training wing: the ESS learning-rate rule (``april_slime.training.ess.EssLrScaler``) and the
off-policy optimal baseline applied by linearity (``april_slime.training.grad_norms`` for the
exact per-sample norms, ``april_slime.training.baseline`` for the loss side and the folding).
The importance-weight formulas belong to ``april_slime.training.offpolicy``, the ESS statistics
to ``april_slime.training.ess``.

This module owns what ties them to one slime job: ``VcpoRuntime`` (built from the job's
``LossSettings``), the per-step log line, the saved rho_on estimate, and the entry points
(docs/vcpo.md has the exact call order inside slime's Megatron loop): ``before_train_step``
(``--custom-megatron-before-train-step-hook-path``) and ``opob_advantages``
(``--custom-advantage-function-path``); ``april_slime.loss.policy_loss`` (the custom loss) feeds
``runtime().lr_scaler`` and calls ``opob_policy_loss``. The setups VCPO refuses are
``april_slime.job_checks.check_vcpo``'s, run at job start; ``before_train_step`` runs it again with
the data-parallel size, which is known only once Megatron has built its process groups.

torch is imported at module level: this module is only used on the training side.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from april_slime import job_checks
from april_slime.core.config import AprilConfigError
from april_slime.core.keys import MASKED_MEMBERS_KEY, OPOB_GROUP_KEY
from april_slime.job import SlimeJob, describe
from april_slime.training.baseline import OpobAccumulator, OpobOptions
from april_slime.training.ess import EssLrScaler
from april_slime.training.grad_norms import PerSampleGradNorms, group_active
from april_slime.training.settings import LossSettings

__all__ = [
    "STATE_FILE",
    "VcpoRuntime",
    "runtime",
    "reset_runtime",
    "before_train_step",
    "opob_advantages",
]

logger = logging.getLogger(__name__)

STATE_FILE = "april_vcpo_state.json"  # in --save / --load: the rho_on estimate


class VcpoRuntime:
    """Everything VCPO keeps for one slime training job (one per training process): the learning-rate
    rule, the baseline's accumulator, which step of which rollout runs, and the step's timing."""

    def __init__(self, config: LossSettings, *, job: SlimeJob | None = None, group=None) -> None:
        self.config = config
        self.job = job  # None outside a slime job: nothing is logged, rho_on is neither saved nor restored
        self.group = group  # every rank of the job: the ESS statistics
        self.lr_scaler: EssLrScaler | None = None
        if config.vcpo_lr_scaling:
            self.lr_scaler = EssLrScaler(None if config.vcpo_rho_on_estimate else config.vcpo_rho_on,
                                         config.vcpo_lr_scale_min, config.vcpo_lr_scale_max, group=group)
            self._restore_rho_on()
        self.opob: OpobAccumulator | None = None
        self.rollout_id = self.step_id = 0
        self.last_log: dict[str, float] = {}
        self._step_started = 0.0
        self._rho_on_saved = False

    @property
    def grad_norms(self) -> PerSampleGradNorms | None:
        return self.opob.grad_norms if self.opob is not None else None

    @property
    def opob_options(self) -> OpobOptions:
        c = self.config
        return OpobOptions(scope=c.vcpo_baseline_scope, norm_by_std=c.vcpo_baseline_norm_by_std,
                           length_norm=c.vcpo_length_norm, weights=c.vcpo_baseline_weights,
                           correction=c.is_correction, low=c.is_low, high=c.is_high)

    @property
    def last_baseline(self) -> float:
        return self.opob.last_baseline if self.opob is not None else float("nan")

    def attach_model(self, model: Sequence[nn.Module], tp_rank: int = 0, tp_size: int = 1, tp_group=None,
                     dp_group=None, groups_across_ranks: bool = False) -> None:
        if not self.config.vcpo_baseline or self.opob is not None:
            return
        try:
            norms = PerSampleGradNorms(model, weighted=True, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)
        except ValueError as exc:  # a model the per-sample rules cannot cover: a setting error here
            raise AprilConfigError(f"april_vcpo_baseline: {exc}") from exc
        params = [p for chunk in model for p in chunk.parameters() if p.requires_grad]
        self.opob = OpobAccumulator(norms, params, self.opob_options, dp_group=dp_group,
                                    groups_across_ranks=groups_across_ranks)

    # -- one optimizer step ------------------------------------------------------------------
    def begin_step(self, rollout_id: int = 0, step_id: int = 0) -> None:
        self.rollout_id, self.step_id = rollout_id, step_id
        if self.lr_scaler is not None:
            self.lr_scaler.begin_step()
        if self.opob is not None:
            self.opob.begin_step()
        self._step_started = time.perf_counter()

    def finish_gradients(self) -> float:
        """Form the baselined gradient (after the last backward, before the DP reduction)."""
        if self.opob is None:
            return float("nan")
        return self.opob.finish()

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

    def wrap_optimizer(self, optimizer) -> None:
        """Make ``optimizer.step()`` run at the ESS-scaled learning rate (when on) and log the step's
        VCPO values afterwards (idempotent, instance-level)."""
        current = optimizer.step
        if getattr(current, "_vcpo_runtime", None) is self:
            return
        original = getattr(current, "_vcpo_original", current)

        def step(*args, **kwargs):
            if self.lr_scaler is not None:
                with self.lr_scaler.scaled_lr(optimizer):
                    out = original(*args, **kwargs)
            else:
                out = original(*args, **kwargs)
            self.after_step()
            return out

        step._vcpo_runtime = self  # type: ignore[attr-defined]
        step._vcpo_original = original  # type: ignore[attr-defined]
        optimizer.step = step

    def after_step(self) -> None:
        """The step's VCPO values (a collective over the baseline's data-parallel group with the
        group scope), logged through slime's logger; the rho_on estimate is saved once."""
        out = self.metrics()
        if self.opob is not None:
            out.update(self._baseline_metrics())
            device = self.opob.params[0].device if self.opob.params else None
            opob_s = self.opob.clock.seconds()
            if device is not None and device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            step_s = time.perf_counter() - self._step_started
            out["vcpo/opob_seconds"] = opob_s
            out["vcpo/opob_time_frac"] = opob_s / step_s if step_s > 0 else float("nan")
        self.last_log = out
        self._save_rho_on()
        _log_to_slime(self.job, self.rollout_id, self.step_id, out)

    def _baseline_metrics(self) -> dict[str, float]:
        opob = self.opob
        if opob.options.scope == "global":
            return {"vcpo/baseline": opob.last_baseline}
        pairs = opob.last_group_baselines
        sums = torch.tensor([len(pairs), sum(b for b, _ in pairs), sum(b - m for b, m in pairs)],
                            dtype=torch.float64)
        if group_active(opob.dp_group):
            from april_slime.training.offpolicy import collective_device

            sums = sums.to(collective_device(opob.dp_group))
            dist.all_reduce(sums, group=opob.dp_group)
        count, total, shift = (float(x) for x in sums)
        if count == 0:
            return {"vcpo/baseline": float("nan"), "vcpo/baseline_shift": float("nan")}
        # mean over the step's groups of b_g, and of b_g minus the group's mean reward (GRPO's baseline)
        return {"vcpo/baseline": total / count, "vcpo/baseline_shift": shift / count}

    def metrics(self) -> dict[str, float]:
        out = {}
        if self.lr_scaler is not None:
            out.update(self.lr_scaler.metrics())
        if self.opob is not None:
            out["vcpo/opob_baseline"] = self.last_baseline
        return out

    # -- rho_on across restarts --------------------------------------------------------------
    def _restore_rho_on(self) -> None:
        """With the estimate, a restarted job takes the rho_on its first run measured (``--load``)."""
        if not self.config.vcpo_rho_on_estimate:
            return
        load = self.job.slime.load if self.job is not None else None
        path = os.path.join(load, STATE_FILE) if load else None
        if path is None or not os.path.isfile(path):
            return
        with open(path) as f:
            state = json.load(f)
        rho_on = state.get("rho_on")
        if not (isinstance(rho_on, (int, float)) and 0.0 < rho_on <= 1.0):
            raise AprilConfigError(f"april_vcpo_rho_on_estimate: {path} holds no valid rho_on ({state!r})")
        self.lr_scaler.rho_on = float(rho_on)
        self._rho_on_saved = True  # already on disk
        logger.info("VCPO rho_on %.6f restored from %s", rho_on, path)

    def _save_rho_on(self) -> None:
        if self._rho_on_saved or self.lr_scaler is None or not self.config.vcpo_rho_on_estimate:
            return
        rho_on = self.lr_scaler.rho_on
        save = self.job.slime.save if self.job is not None else None
        if rho_on is None or not save:
            return
        self._rho_on_saved = True
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        os.makedirs(save, exist_ok=True)
        path = os.path.join(save, STATE_FILE)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"rho_on": rho_on}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def _log_to_slime(job: SlimeJob | None, rollout_id: int, step_id: int, values: dict[str, float]) -> None:
    """One line per optimizer step through slime's own logger (wandb / tensorboard), on the rank
    slime logs its train metrics from, at slime's ``train/step``."""
    if not values or job is None or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        from megatron.core import mpu
        from slime.observability import logging_utils
    except ImportError:
        return
    if (mpu.get_data_parallel_rank(with_context_parallel=True) != 0 or mpu.get_tensor_model_parallel_rank() != 0
            or mpu.get_pipeline_model_parallel_rank() != mpu.get_pipeline_model_parallel_world_size() - 1):
        return
    log = {f"train/{k}": v for k, v in values.items()}
    log["train/step"] = rollout_id * job.slime.steps_per_rollout + step_id
    logging_utils.log(job.args, log, step_key="train/step")
    logger.info("vcpo step %d: %s", log["train/step"], log)


_RUNTIME: VcpoRuntime | None = None


def runtime() -> VcpoRuntime | None:
    """The job's VCPO state, created by the first ``before_train_step`` (None before)."""
    return _RUNTIME


def reset_runtime() -> None:
    global _RUNTIME
    if _RUNTIME is not None and _RUNTIME.grad_norms is not None:
        _RUNTIME.grad_norms.remove()
    _RUNTIME = None


def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) -> None:
    """slime ``--custom-megatron-before-train-step-hook-path`` entry point.

    slime calls it in ``train_one_step`` after zeroing the gradients and before the step's
    forward/backward, with the optimizer whose ``step()`` follows the backward and the scheduler
    whose ``step()`` follows that (and overwrites every group's lr). It also tells the custom
    loss which step of the rollout runs (``april_prox_log_probs: loglinear`` needs it).
    """
    global _RUNTIME
    if _RUNTIME is None:
        job = describe(args)  # the job's start-time checks, VCPO's included
        config = job.loss
        tp = dp = (0, 1, None)
        if config.vcpo_baseline:
            from megatron.core import mpu  # lazy: only inside a Megatron job

            tp = (mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size(),
                  mpu.get_tensor_model_parallel_group())
            dp = (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(), mpu.get_data_parallel_group())
            if dp[1] > 1:  # the group scope's layouts on several ranks, known only now
                job_checks.check_vcpo(job.slime, config, dp_size=dp[1])
        rt = VcpoRuntime(config, job=job)
        rt.attach_model(model, tp_rank=tp[0], tp_size=tp[1], tp_group=tp[2], dp_group=dp[2],
                        groups_across_ranks=job_checks.groups_across_ranks(job.slime, dp[1]))
        _RUNTIME = rt
    rt = _RUNTIME
    if rt.lr_scaler is not None or rt.opob is not None:
        rt.wrap_optimizer(optimizer)
    if rt.opob is not None:
        from megatron.core.utils import get_model_config  # lazy

        rt.wrap_finalize(get_model_config(model[0]))
    rt.begin_step(rollout_id, step_id)


def opob_advantages(args, rollout_data: dict) -> None:
    """slime ``--custom-advantage-function-path``: advantages (and returns) are each sample's RAW
    reward broadcast over its response, whatever slime's reward normalisation did to
    ``rollout_data["rewards"]``; each sample's prompt group (id, size, std of its raw rewards) is
    written to its metadata for the group-scope baseline. Groups are slime's: consecutive runs of
    ``n_samples_per_prompt`` samples in the rollout (as slime's own group normalisation reads them)."""
    raw_all = rollout_data.get("raw_reward")
    partition = rollout_data.get("partition")
    if raw_all is not None and partition is not None:
        rewards = [raw_all[i] for i in partition]
    elif "local_raw_reward" in rollout_data:
        rewards, partition = rollout_data["local_raw_reward"], None
    else:
        raise ValueError("opob_advantages needs slime's raw rewards (rollout_data['raw_reward'] with 'partition')")
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
    if raw_all is None or partition is None:
        return
    n = int(describe(args).slime.n_samples_per_prompt or 1)
    if len(raw_all) % n:
        raise ValueError(f"{len(raw_all)} rewards in the rollout are not whole groups of n_samples_per_prompt {n}")
    metadata = rollout_data.get("metadata")
    if metadata is None:
        metadata = rollout_data["metadata"] = [None] * len(rewards)
    for i, pos in enumerate(partition):
        entry = dict(metadata[i] or {})
        group = int(pos) // n
        # members masked out of the group (april_mask_failed_samples) train nothing and have no reward
        masked = set(entry.get(MASKED_MEMBERS_KEY) or ())
        kept = torch.tensor([float(raw_all[group * n + k]) for k in range(n) if k not in masked], dtype=torch.float64)
        std = float(kept.std(unbiased=False)) if kept.numel() else 0.0
        entry[OPOB_GROUP_KEY] = {"group": group, "size": n, "reward_std": std}
        metadata[i] = entry
