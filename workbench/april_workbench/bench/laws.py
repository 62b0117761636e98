"""A length law's batch statistics, and laws that meet a published statistic.

What papers publish about response lengths is a few batch statistics: APRIL §3.2.3 gives the
standard deviation of lengths across a step's batch (figs. 7: 4,000-4,500 tokens) and within a
prompt's group (fig. 8: under 1,500 for GRPO, 2,400 for DAPO), at a 16K budget with 32 prompts x 8
samples. ``statistics`` computes the same numbers for an emulator law (``LengthModel`` in the
``"preset:field=value,..."`` form the bench uses), from one exact draw per sample of 512 prompts;
``solve`` finds the value of one law field that makes a statistic equal a target (bisection: the
statistic must grow with the field over the bracket).
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

import numpy as np

from april_workbench.emulator import LengthModel

from .workloads import Workload, sample_lengths

STATISTICS = ("median", "mean", "sigma_batch", "sigma_group", "at_budget")

# The medians at which each law's fit row stays within 5% of its published ratio (`april-slime
# bench reproduce --fit`, docs/results/calibration/fit.json): the headline band spans them.
MEDIAN_INTERVALS: dict[str, tuple[float, float]] = {
    "dapo-math-qwen3-4b-16k": (8481.0, 10466.0),
    "deepmath-qwen3-16k": (7026.0, 8707.0),
}


def length_spec(model: LengthModel) -> str:
    """A ``Workload.length`` string that parses back to exactly ``model``."""
    values = asdict(model)
    kind = values.pop("kind")
    if kind == "max-length":
        return "max-length"
    return "default:" + ",".join(f"{k}={v!r}" for k, v in values.items())


def with_fields(law: str, **values: float) -> str:
    """``law`` with ``values`` set (replacing any given before), keeping its preset name."""
    name, _, rest = law.partition(":")
    items = dict(item.split("=", 1) for item in filter(None, (s.strip() for s in rest.split(","))))
    known = {f.name for f in fields(LengthModel)}
    for key, value in values.items():
        if key not in known:
            raise ValueError(f"length law has no field {key!r}")
        items[key] = f"{value:.6g}"
    text = f"{name}:" + ",".join(f"{k}={v}" for k, v in items.items()) if items else name
    LengthModel.parse(text)  # refuse what the emulator would refuse
    return text


def statistics(law: str, budget: int = 16384, prompts_per_step: int = 32, n_samples_per_prompt: int = 8,
               prompt_len: int = 256, num_prompts: int = 512, seed: int = 0) -> dict[str, float]:
    """Median, mean, standard deviation across each step's batch (mean over steps) and within each
    prompt's group (mean over groups), and the share of samples at the budget."""
    w = Workload(name="statistics", length=law, max_response_len=budget, prompt_len=prompt_len,
                 rollout_batch_size=prompts_per_step, n_samples_per_prompt=n_samples_per_prompt, seed=seed)
    lengths = sample_lengths(w, budget, num_prompts - num_prompts % prompts_per_step)
    batches = lengths.reshape(-1, prompts_per_step * n_samples_per_prompt)
    return {"median": float(np.median(lengths)), "mean": float(lengths.mean()),
            "sigma_batch": float(batches.std(axis=1).mean()),
            "sigma_group": float(lengths.std(axis=1, ddof=1).mean()),
            "at_budget": float((lengths >= budget).mean())}


def solve(law: str, field: str, statistic: str, target: float, lo: float, hi: float,
          iterations: int = 24, increasing: bool = True, **kw: Any) -> str:
    """``law`` with ``field`` set in [lo, hi] so that ``statistics(...)[statistic]`` is ``target``
    (to bisection precision; a target outside the bracket's range gives the nearer end). The
    statistic must grow with the field over the bracket, or shrink with it (``increasing=False``)."""
    if statistic not in STATISTICS:
        raise ValueError(f"unknown statistic {statistic!r}; known: {STATISTICS}")
    for _ in range(iterations):
        mid = (lo + hi) / 2.0
        below = statistics(with_fields(law, **{field: mid}), **kw)[statistic] < target
        if below == increasing:
            lo = mid
        else:
            hi = mid
    return with_fields(law, **{field: (lo + hi) / 2.0})


def on_family(law: str, median: float, sigma_batch: float, sigma_group_max: float, rounds: int = 3) -> str:
    """``law`` at ``median`` with its tail across prompts solved for ``sigma_batch`` and, where the
    group spread would be wider than ``sigma_group_max``, its Weibull shape raised until it is not
    (a larger shape: lengths within a group closer together). A few rounds, since each moves the
    other's statistic a little."""
    law = with_fields(law, median_tokens=median)
    for _ in range(rounds):
        law = solve(law, "prompt_sigma", "sigma_batch", sigma_batch, 0.0, 2.5)
        if statistics(law)["sigma_group"] > sigma_group_max:
            law = solve(law, "shape", "sigma_group", sigma_group_max, LengthModel.parse(law).shape, 40.0,
                        increasing=False)
    return law
