"""The proximal policy's log-probs without a forward pass of their own.

Decoupled PPO clips around the proximal policy pi_prox: in slime, the policy at the start of the
rollout's training (slime recomputes its log-probs with a separate forward before the first
optimizer step). Two cases need no such forward:

* one optimizer step per rollout: pi_prox *is* the policy of the training forward, whose
  log-probs the loss has anyway (AReaL's ``reuse_train_logp``);
* several steps: ``loglinear`` (AReaL's ``prox_logp_method=loglinear``, A-3PO) interpolates in log
  space between the behaviour policy mu and the current policy pi_theta by the token's policy
  version, on a clock of optimizer steps: a token sampled by version v, trained at step k of the
  S steps of a rollout whose weights have version V, has ``t_mu = v S``, ``t_prox = V S`` and
  ``t_theta = V S + k``, so ``log pi_prox ~ log mu + alpha (log pi_theta - log mu)`` with
  ``alpha = (t_prox - t_mu) / (t_theta - t_mu) = (V - v) S / ((V - v) S + k)``. At step 0
  ``alpha = 1`` for every token (pi_prox = pi_theta, exactly what slime would recompute); later, a
  token of the current version gets ``alpha = 0`` (mu, the engines' log-prob under the proximal
  weights).
"""

from __future__ import annotations

import torch

__all__ = ["loglinear_alpha", "loglinear_proximal_log_probs"]


def loglinear_alpha(token_versions: torch.Tensor, policy_version: torch.Tensor | int, step: int,
                    steps_per_rollout: int) -> torch.Tensor:
    """Per-token interpolation weight in [0, 1] (module doc); ``policy_version``: V per token or one int."""
    if steps_per_rollout < 1 or not (0 <= step < steps_per_rollout):
        raise ValueError(f"step {step} of {steps_per_rollout} steps per rollout")
    lag = (torch.as_tensor(policy_version, device=token_versions.device) - token_versions).to(torch.float64)
    lag = lag.clamp_min(0.0) * steps_per_rollout
    if step == 0:
        return torch.ones_like(lag)
    return lag / (lag + step)


def loglinear_proximal_log_probs(rollout_log_probs: torch.Tensor, current_log_probs: torch.Tensor,
                                 token_versions: torch.Tensor, policy_version: torch.Tensor | int, step: int,
                                 steps_per_rollout: int) -> torch.Tensor:
    """``log mu + alpha (log pi_theta - log mu)`` per token, detached (module doc)."""
    alpha = loglinear_alpha(token_versions, policy_version, step, steps_per_rollout)
    mu = rollout_log_probs.detach()
    theta = current_log_probs.detach().to(mu.dtype)
    return mu + alpha.to(mu.dtype) * (theta - mu)
