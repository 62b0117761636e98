"""One micro-batch's samples as the off-policy math takes them: whole responses, packed.

A loss hook receives per-sample lists, one tensor per sample aligned with its response tokens.
``PackedSamples.pack`` checks every list against the responses' lengths and concatenates them once
into flat [T] tensors on one device, with the one ``offpolicy.Packing`` that records the layout;
the objective, the importance weights and the per-token metrics all read those.
``response_log_probs_from_logits`` reads the per-sample response log-probs out of the logits of a
packed stream (samples back to back), in plain torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from april_slime.training import offpolicy

__all__ = ["PackedSamples", "check_sample_lengths", "concat_samples", "response_log_probs_from_logits"]


def concat_samples(tensors: Sequence[torch.Tensor] | None) -> torch.Tensor:
    """Per-sample tensors back to back; an empty float tensor when there are none."""
    return torch.cat(list(tensors)) if tensors else torch.zeros(0)


def check_sample_lengths(response_lengths: Sequence[int], **named: Sequence[torch.Tensor] | None) -> None:
    """Every per-sample tensor must cover its sample's response exactly (whole-response layout).

    A total-only check lets one sample that is a token short and another a token long through,
    and the loss then pairs every later token with its neighbour's log-probs.
    """
    for name, tensors in named.items():
        if tensors is None:
            continue
        if len(tensors) != len(response_lengths):
            raise ValueError(f"{name}: {len(tensors)} samples in the micro-batch, expected {len(response_lengths)}")
        for i, (x, n) in enumerate(zip(tensors, response_lengths)):
            if x.dim() != 1 or x.numel() != n:
                raise ValueError(f"sample {i}: {name} has shape {tuple(x.shape)} but its response has {n} tokens")


@dataclass(frozen=True)
class PackedSamples:
    """Whole-response tensors of one micro-batch, the samples back to back, each [T] on one device.

    The policy being trained (``log_probs``, with grad) sets the dtype and device when it is given,
    otherwise the detached ``old_log_probs`` do; ``loss_mask`` keeps its own dtype. ``None`` marks
    what the caller does not have (the TIS hook sees no current log-probs and no advantages; an
    on-policy batch may have no rollout log-probs).
    """

    packing: offpolicy.Packing
    loss_mask: torch.Tensor
    old_log_probs: torch.Tensor  # pi_old: recomputed before the step, or the current ones detached
    log_probs: torch.Tensor | None = None  # pi_theta of this forward
    rollout_log_probs: torch.Tensor | None = None  # the behaviour policy of every token
    advantages: torch.Tensor | None = None

    @classmethod
    def pack(
        cls,
        response_lengths: Sequence[int],
        *,
        loss_masks: Sequence[torch.Tensor],
        old_log_probs: Sequence[torch.Tensor],
        log_probs: Sequence[torch.Tensor] | None = None,
        rollout_log_probs: Sequence[torch.Tensor] | None = None,
        advantages: Sequence[torch.Tensor] | None = None,
        old_name: str = "log_probs",
    ) -> PackedSamples:
        """Check and pack whole-response per-sample lists; ``old_name`` names ``old_log_probs`` in
        errors as the caller's input calls them."""
        check_sample_lengths(response_lengths, **{old_name: old_log_probs}, rollout_log_probs=rollout_log_probs,
                             advantages=advantages, loss_masks=list(loss_masks))
        if log_probs is not None:
            current, packing = offpolicy.pack(log_probs)
            old = concat_samples(old_log_probs).to(current)
            reference = current
        else:
            current = None
            old, packing = offpolicy.pack([x.detach() for x in old_log_probs])
            reference = old
        rollout = concat_samples(rollout_log_probs).to(reference) if rollout_log_probs is not None else None
        adv = concat_samples(advantages).to(reference) if advantages is not None else None
        mask = concat_samples(loss_masks).to(reference.device)
        packing.check("loss_masks", mask)
        return cls(packing, mask, old, current, rollout, adv)


def response_log_probs_from_logits(
    logits: torch.Tensor,
    unconcat_tokens: list[torch.Tensor],
    total_lengths: list[int],
    response_lengths: list[int],
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-sample response log-probs (and entropies) from packed logits ``[1, T, V]``, plain torch.

    The position that predicts token j is j - 1, and logits are divided by the rollout temperature
    first, as the engines sampled from softmax(logits / temperature). Used where slime is not
    importable (tests, CPU); without tensor or context parallelism it gives the same numbers as
    slime's ``get_log_probs_and_entropy``.
    """
    if logits.dim() != 3 or logits.size(0) != 1:
        raise ValueError(f"expected logits of shape [1, T, V], got {tuple(logits.shape)}")
    scaled = logits[0] / temperature if temperature != 1.0 else logits[0]
    log_probs, entropies = [], []
    end = 0
    for tokens, total, response in zip(unconcat_tokens, total_lengths, response_lengths, strict=True):
        total, response = int(total), int(response)
        if response > 0 and total - response < 1:
            raise ValueError("every sample needs at least one prompt token before its response")
        end += total
        if end - 1 > scaled.size(0):
            raise ValueError(f"samples cover {end} positions but the logits have {scaled.size(0)}")
        start = end - response
        chunk = scaled[start - 1:end - 1] if response > 0 else scaled[:0]
        targets = tokens[total - response:total].to(device=chunk.device, dtype=torch.long)
        log_softmax = torch.log_softmax(chunk, dim=-1)
        log_probs.append(log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
        if with_entropy:
            entropies.append(-(log_softmax.exp() * log_softmax).sum(-1))
    return log_probs, entropies
