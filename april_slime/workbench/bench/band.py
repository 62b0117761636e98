"""The headline's band: the same workload over seeds and over the inputs we are least sure of.

A ratio from one run of one seed says little: the response-length tail decides how long sync
waits, and the per-step overhead (weight sync, offload, reward) dilutes every rollout gain.
``headline_variants`` spans three seeds at the nominal inputs, a lighter and a heavier length tail
and a lower and a higher per-step overhead; ``run_band`` runs every (variant, policy) pair in its
own process (each on a fresh emulated cluster, as ``run_benchmark`` does) and reports, per policy,
the nominal steps/h with the min-max over the variants, and the same for the ratio to sync, where
each variant's ratio is measured within that variant (same seed, same inputs for both policies).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from april_slime.workbench.emulator import LengthModel

from .runner import run_benchmark, run_jobs
from .spec import EngineSpec
from .workloads import Workload


@dataclass(frozen=True)
class Variant:
    name: str
    seed: int = 0
    length: dict[str, float] = field(default_factory=dict)  # LengthModel field -> value
    spec: dict[str, float] = field(default_factory=dict)  # EngineSpec field -> value
    workload: dict[str, float] = field(default_factory=dict)  # Workload field -> value

    def apply(self, workload: Workload, spec: EngineSpec) -> tuple[Workload, EngineSpec]:
        w = replace(workload, seed=self.seed, **self.workload)
        if self.length:
            w = replace(w, length=length_spec(replace(workload.length_model(), **self.length)))
        return w, replace(spec, **self.spec)


def length_spec(model: LengthModel) -> str:
    """A ``Workload.length`` string that parses back to exactly ``model``."""
    values = asdict(model)
    kind = values.pop("kind")
    if kind == "max-length":
        return "max-length"
    return "default:" + ",".join(f"{k}={v!r}" for k, v in values.items())


def headline_variants(workload: Workload, spec: EngineSpec | None = None) -> list[Variant]:
    """Seeds 0-2; the length tail lighter/heavier (half/double the never-stopping fraction and
    the spread across prompts -/+ 0.15); per-step overhead halved/doubled (the training phase's
    fixed part and the engine's per-decode-step overhead)."""
    lm = workload.length_model()
    base_fixed = (spec.train_fixed_s if spec is not None else 8.0)
    base_step = (spec.step_overhead_s if spec is not None else 1e-3)
    return [
        Variant("seed 0 (nominal)", 0),
        Variant("seed 1", 1),
        Variant("seed 2", 2),
        Variant("light tail", 0, {"truncation_fraction": lm.truncation_fraction / 2,
                                  "prompt_sigma": max(0.0, lm.prompt_sigma - 0.15)}),
        Variant("heavy tail", 0, {"truncation_fraction": min(1.0, lm.truncation_fraction * 2),
                                  "prompt_sigma": lm.prompt_sigma + 0.15}),
        Variant("low overhead", 0, spec={"train_fixed_s": base_fixed / 2,
                                         "step_overhead_s": base_step / 2}),
        Variant("high overhead", 0, spec={"train_fixed_s": base_fixed * 2,
                                          "step_overhead_s": base_step * 2}),
    ]


def run_variant(job: tuple[Workload, EngineSpec, Variant, str]) -> tuple[str, str, dict[str, Any]]:
    workload, spec, variant, policy = job
    w, s = variant.apply(replace(workload, policies=(policy,), sweep="none"), spec)
    result = run_benchmark(w, s)
    return variant.name, policy, result.summaries[policy]


def run_band(workload: Workload, spec: EngineSpec, variants: list[Variant], *,
             jobs: int = 1) -> dict[str, Any]:
    """``{"variants": [...], "policies": {policy: {steps_per_hour, _min, _max, ratio_to_sync,
    _min, _max, throughput_tokens_per_s, utilization, offpolicy_token_fraction}}, "runs": ...}``."""
    policies = list(workload.policies)
    if "sync" not in policies:
        policies.insert(0, "sync")
    todo = [(workload, spec, v, p) for v in variants for p in policies]
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    for name, policy, summary in run_jobs(run_variant, todo, jobs):
        runs.setdefault(name, {})[policy] = summary
    return summarize_band(runs, variants, policies)


def summarize_band(runs: dict[str, dict[str, dict[str, Any]]], variants: list[Variant],
                   policies: list[str]) -> dict[str, Any]:
    """``run_band``'s answer from the summaries of its runs (variant name -> policy -> summary)."""
    nominal = variants[0].name
    out: dict[str, Any] = {}
    for policy in policies:
        rates = [runs[v.name][policy]["steps_per_hour"] for v in variants]
        ratios = [runs[v.name][policy]["steps_per_hour"] / runs[v.name]["sync"]["steps_per_hour"]
                  for v in variants]
        n = runs[nominal][policy]
        out[policy] = {
            "steps_per_hour": n["steps_per_hour"], "steps_per_hour_min": min(rates),
            "steps_per_hour_max": max(rates), "ratio_to_sync": ratios[0],
            "ratio_to_sync_min": min(ratios), "ratio_to_sync_max": max(ratios),
            "throughput_tokens_per_s": n["throughput_tokens_per_s"],
            "utilization": n["utilization"], "offpolicy_token_fraction": n["offpolicy_token_fraction"],
            "stationary_everywhere": all(runs[v.name][policy]["stationary"] for v in variants),
        }
    return {"variants": [asdict(v) for v in variants], "policies": out, "runs": runs}
