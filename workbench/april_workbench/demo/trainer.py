"""The demo's training side: a plain torch copy of the policy, trained with the plugin's loss.

slime's trainer is Megatron-LM on GPUs; here the same checkpoint is loaded with transformers and
trained with a torch optimizer. What a slime trainer would hand the loss is rebuilt from the
rollout's slime samples: per-sample ``unconcat_tokens``, ``response_lengths``, ``total_lengths``,
``loss_masks``, ``rollout_log_probs``, the log-probs recomputed before the step (``log_probs``),
GRPO advantages, and ``metadata`` (the samples' ``train_metadata``: per-token policy versions).
The loss is ``april_slime.loss.policy_loss``, the function a slime job loads with
``--custom-loss-function-path``, called with the job's own ``args``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from april_slime import loss as plugin_loss
from april_slime import vcpo
from april_slime.training.packed import response_log_probs_from_logits


def group_advantages(rewards: list[list[float]]) -> list[list[float]]:
    """GRPO: each reward minus its group's mean, over the group's standard deviation (+1e-6)."""
    out = []
    for group in rewards:
        r = torch.tensor(group, dtype=torch.float64)
        std = r.std() if r.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
        out.append(((r - r.mean()) / (std + 1e-6)).tolist())
    return out


def sample_mean_reducer(loss_masks: list[torch.Tensor]):
    """slime's ``sum_of_sample_mean`` for one micro-batch that is the whole global batch: the mean
    over samples of each sample's loss-masked token mean."""
    sizes = [int(m.numel()) for m in loss_masks]
    counts = [m.sum().clamp_min(1) for m in loss_masks]
    n = max(len(loss_masks), 1)

    def reduce(x: torch.Tensor) -> torch.Tensor:
        parts = x.split(sizes)
        return sum((p * m).sum() / c for p, m, c in zip(parts, loss_masks, counts)) / n

    return reduce


class PolicyTrainer:
    """Owns the trained policy and its optimizer."""

    def __init__(self, checkpoint: str | Path, args: Any, *, lr: float, minibatches: int = 1,
                 max_grad_norm: float = 1.0) -> None:
        from transformers import AutoModelForCausalLM

        self.args = args
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.minibatches = minibatches
        self.max_grad_norm = max_grad_norm
        self.pad_id = int(self.model.config.pad_token_id or 0)

    # ------------------------------------------------------------ slime samples -> loss batch
    def _logits(self, tokens: list[list[int]]) -> torch.Tensor:
        """Packed logits ``[1, sum(total_lengths), V]``: each sample's own positions, back to back,
        as slime's packed forward lays them out (computed here as a padded batch, so samples do
        not attend to each other)."""
        width = max(len(t) for t in tokens)
        ids = torch.tensor([t + [self.pad_id] * (width - len(t)) for t in tokens])
        mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in tokens])
        logits = self.model(input_ids=ids, attention_mask=mask).logits
        return torch.cat([logits[i, :len(t)] for i, t in enumerate(tokens)]).unsqueeze(0)

    def _batch(self, samples: list[Any], advantages: list[float]) -> dict[str, Any]:
        for s in samples:
            if s.response_length <= 0 or len(s.rollout_log_probs or []) != s.response_length:
                raise ValueError(f"sample {s.index}: {len(s.rollout_log_probs or [])} rollout log-probs for "
                                 f"{s.response_length} response tokens")
        return {
            "unconcat_tokens": [torch.tensor(s.tokens) for s in samples],
            "response_lengths": [s.response_length for s in samples],
            "total_lengths": [len(s.tokens) for s in samples],
            "loss_masks": [torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples],
            "rollout_log_probs": [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples],
            "advantages": [torch.full((s.response_length,), a, dtype=torch.float32)
                           for s, a in zip(samples, advantages)],
            "metadata": [s.train_metadata or {} for s in samples],
        }

    @torch.no_grad()
    def _recomputed_log_probs(self, batch: dict[str, Any]) -> list[torch.Tensor]:
        logits = self._logits([t.tolist() for t in batch["unconcat_tokens"]])
        log_probs, _ = response_log_probs_from_logits(
            logits, batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"],
            temperature=self.args.rollout_temperature)
        return log_probs

    # ------------------------------------------------------------ one training step
    def step(self, groups: list[list[Any]], rollout_id: int = 0) -> dict[str, float]:
        """One rollout batch: recompute log-probs, then ``minibatches`` optimizer steps.

        Returns the loss metrics averaged over the samples (every metric is a sample mean) and
        ``ess_ratio`` = (mean w)^2 / mean(w^2) of the unclipped sequence weights w = pi_old / pi_rollout;
        with ``april_vcpo_lr_scaling``, ``lr_scale`` is VCPO's learning-rate factor (sample mean over
        the optimizer steps).
        """
        advantages = [a for g in group_advantages([[float(s.reward) for s in g] for g in groups]) for a in g]
        samples = [s for g in groups for s in g]
        batch = self._batch(samples, advantages)
        if self.minibatches > 1:
            # slime recomputes pi_old before the step; with one optimizer step pi_old is the policy of
            # that step's own forward, which the loss detaches itself when ``log_probs`` is absent
            batch["log_probs"] = self._recomputed_log_probs(batch)
        order = torch.randperm(len(samples)).tolist()
        chunks = [order[i::self.minibatches] for i in range(self.minibatches) if order[i::self.minibatches]]
        sums: dict[str, float] = {}
        vcpo_on = plugin_loss.config_for(self.args).vcpo_lr_scaling
        for step_id, chunk in enumerate(chunks):
            if vcpo_on:
                # slime's before-train-step hook: the loss feeds the step's ESS statistics and the
                # optimizer step runs at lr * sqrt(ESS_ratio / rho_on)
                vcpo.before_train_step(self.args, rollout_id, step_id, [self.model], self.optimizer, None)
            mini = {k: [v[i] for i in chunk] for k, v in batch.items()}
            logits = self._logits([t.tolist() for t in mini["unconcat_tokens"]])
            loss, metrics = plugin_loss.policy_loss(self.args, mini, logits, sample_mean_reducer(mini["loss_masks"]))
            if not torch.isfinite(loss):
                raise FloatingPointError(f"the policy loss is {float(loss)}; the step is not applied")
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            self.optimizer.step()
            metrics["grad_norm"] = grad_norm
            if vcpo_on:
                metrics["lr_scale"] = vcpo.runtime().lr_scaler.last_scale
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value) * len(chunk)
        out = {k: v / len(samples) for k, v in sums.items()}
        w, w2 = out.get("april/seq_weight"), out.get("april/seq_weight_sq")
        out["ess_ratio"] = w * w / w2 if w is not None and w2 and math.isfinite(w2) else math.nan
        return out

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        self.model.save_pretrained(path)
        return path
