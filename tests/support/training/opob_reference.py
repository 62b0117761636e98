"""VCPO's baselined gradient in float64, straight from its definition (test helper).

Independent of ``april_slime.training.baseline``: every per-sample score is given whole, the
baselines are plain weighted means, the gradient a plain sum. The definitions (docs/vcpo.md, from
the paper and the released code, mit-han-lab/vcpo):

* ``wbar_i`` = the corrected (TIS: truncated at ``high``) sequence weight, ``w_i`` the unclipped one;
* ``lambda_i = 1 / L_i`` (L_i: loss-masked tokens) with length normalisation, else 1;
* ``W_i = ||wbar_i g_i||^2`` (``paper``), times ``w_i^2`` (``released``), g_i the summed score;
* group scope: ``a_i = (R_i - b_g) / s_g`` with ``b_g = sum_g W R / sum_g W`` and ``s_g`` the
  population std of the group's raw rewards (1 without std normalisation or when below 1e-8);
  global scope: ``a_i = R_i - b``;
* the step's gradient: ``scale * sum_i a_i wbar_i lambda_i g_i``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch


def reference_gradient(scores: Sequence[Sequence[torch.Tensor]], log_w: Sequence[float], tokens: Sequence[int],
                       rewards: Sequence[float], groups: Sequence[int] | None, *, scope: str, norm_by_std: bool,
                       length_norm: bool, weights: str, high: float, scale: float = 1.0,
                       group_rewards: dict[int, list[float]] | None = None):
    """(gradient per parameter, baselines {group or "global": b}). ``scores[i]``: g_i = grad of
    ``-sum_t m_t log pi_t`` per parameter; ``group_rewards``: every reward of each group (default:
    the given samples of the group)."""
    n = len(scores)
    wbar = [min(math.exp(x), high) for x in log_w]
    lam = [1.0 / max(t, 1) if length_norm else 1.0 for t in tokens]
    sq = [sum(float((wb * g.double()).pow(2).sum()) for g in gi) for wb, gi in zip(wbar, scores)]
    big_w = [s * (math.exp(2 * x) if weights == "released" else 1.0) for s, x in zip(sq, log_w)]
    coeff, baselines = [0.0] * n, {}
    if scope == "global":
        b = sum(w * r for w, r in zip(big_w, rewards)) / sum(big_w)
        baselines["global"] = b
        coeff = [r - b for r in rewards]
    else:
        members = defaultdict(list)
        for i, g in enumerate(groups):
            members[g].append(i)
        for g, idx in members.items():
            den = sum(big_w[i] for i in idx)
            b = sum(big_w[i] * rewards[i] for i in idx) / den if den > 0 else 0.0
            baselines[g] = b
            all_r = torch.tensor((group_rewards or {}).get(g, [rewards[i] for i in idx]), dtype=torch.float64)
            s = float(all_r.std(unbiased=False))
            s = s if (norm_by_std and s > 1e-8) else 1.0
            for i in idx:
                coeff[i] = (rewards[i] - b) / s
    grad = [scale * sum(coeff[i] * wbar[i] * lam[i] * scores[i][k].double() for i in range(n))
            for k in range(len(scores[0]))]
    return grad, baselines
